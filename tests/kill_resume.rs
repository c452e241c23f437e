//! A run killed with SIGKILL in the middle of writing a checkpoint: the next run removes the half-written
//! directory, resumes from the last complete checkpoint and reproduces the uninterrupted run's losses bit
//! for bit, each step once in metrics.jsonl.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const RUN: &str = "sft --no-progress --max-steps 30 --save-every 1 --batch-size 16 --seed 5";

fn trainer(out: &Path, extra: &[&str]) -> Command {
    let mut cmd = streambp_testkit::command(env!("CARGO_BIN_EXE_streambp-train"));
    cmd.args(RUN.split(' '))
        .arg("--output-dir")
        .arg(out)
        .args(extra)
        .env("RUST_LOG", "warn");
    cmd
}

fn losses(out: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Some((v["step"].as_u64().unwrap(), v["loss"].as_f64()?))
        })
        .collect()
}

/// Hidden directories of interrupted saves in `out`.
fn debris(out: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(out)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    let name = p.file_name().unwrap().to_string_lossy();
                    name.starts_with('.') && (name.contains(".tmp-") || name.contains(".old-"))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Starts a run and kills it (SIGKILL) while a checkpoint after the first is being written; false when
/// the run ended before a save could be caught.
fn kill_during_a_save(out: &Path) -> bool {
    let mut child = trainer(out, &[]).stdout(Stdio::null()).spawn().unwrap();
    let start = Instant::now();
    let mut caught = false;
    while child.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(120) {
        if out.join("checkpoint-1").exists() && !debris(out).is_empty() {
            caught = true;
            break;
        }
        // Poll often enough to land inside a save, without taking a core from the trainer.
        std::thread::sleep(Duration::from_micros(200));
    }
    let _ = child.kill();
    child.wait().unwrap();
    caught && !debris(out).is_empty()
}

/// The highest complete `checkpoint-N` in `out`.
fn last_checkpoint(out: &Path) -> PathBuf {
    std::fs::read_dir(out)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name.strip_prefix("checkpoint-")?.parse::<u64>().ok()
        })
        .max()
        .map(|n| out.join(format!("checkpoint-{n}")))
        .expect("a checkpoint was written before the kill")
}

#[test]
fn killed_during_a_save_cleans_up_and_resumes_exactly() {
    let root = tempfile::tempdir().unwrap();
    let whole = root.path().join("whole");
    let status = trainer(&whole, &[]).stdout(Stdio::null()).status().unwrap();
    assert!(status.success());
    let reference = losses(&whole);
    assert_eq!(reference.len(), 30);

    let mut killed = None;
    for attempt in 0..5 {
        let out = root.path().join(format!("killed-{attempt}"));
        if kill_during_a_save(&out) {
            killed = Some(out);
            break;
        }
    }
    let out = killed.expect("a save was caught in flight in one of 5 runs");
    let left = debris(&out);
    assert!(!left.is_empty());

    let checkpoint = last_checkpoint(&out);
    let resumed = trainer(&out, &["--resume", checkpoint.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    assert_eq!(debris(&out), Vec::<PathBuf>::new(), "was: {left:?}");
    // Every step once, each loss equal to the uninterrupted run's to the last bit.
    assert_eq!(
        losses(&out),
        reference,
        "resumed from {}",
        checkpoint.display()
    );
    assert!(!out.join(".lock").exists());
}
