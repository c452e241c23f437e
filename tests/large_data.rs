//! A 1 GB data set trains in the memory a small one does, for every job: rows stream from the file,
//! are tokenized onto disk one at a time and read back by index (`token_store`), so the run's heap
//! peak (the binary's counting allocator, whole process, loading included) does not grow with the
//! file.

use std::io::Write;
use std::path::Path;

/// `rows` JSONL rows, each a short arithmetic problem in the columns of every job (SFT's
/// prompt/completion, DPO's chosen/rejected, GRPO's answer) beside a `meta` column of `meta_bytes`
/// (as real data sets carry ids, sources and urls the loader reads and drops).
fn write_data(path: &Path, rows: usize, meta_bytes: usize) {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let meta = "x".repeat(meta_bytes);
    for i in 0..rows {
        let (a, b) = (i % 97, (i / 97) % 89);
        writeln!(
            out,
            r#"{{"prompt": "{a}+{b}=", "completion": "{c}", "chosen": "{c}", "rejected": "{w}", "answer": "{c}", "meta": "{i} {meta}"}}"#,
            c = a + b,
            w = a + b + 1
        )
        .unwrap();
    }
    out.flush().unwrap();
}

/// The heap peak (MiB) of a 3-step run of `job` on `data`, as the binary prints it.
fn peak_heap_mib(job: &str, data: &Path, out: &Path) -> f64 {
    let mut command = streambp_testkit::command(env!("CARGO_BIN_EXE_streambp-train"));
    command.args([
        job,
        "--no-progress",
        "--max-steps",
        "3",
        "--batch-size",
        "4",
    ]);
    if job == "grpo" {
        command.args(["--reward", "exact:answer", "--group-size", "4"]);
    }
    let run = command
        .arg("--data")
        .arg(data)
        .arg("--output-dir")
        .arg(out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains(&format!("{job}: 3 steps")), "{stdout}");
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("peak heap: "))
        .unwrap_or_else(|| panic!("no peak in {stdout}"));
    line.trim_end_matches(" MiB").parse().unwrap()
}

#[test]
fn a_gigabyte_of_data_trains_in_the_memory_of_a_small_file_for_every_job() {
    let dir = tempfile::tempdir().unwrap();
    let (small, large) = (
        dir.path().join("small.jsonl"),
        dir.path().join("large.jsonl"),
    );
    // 1,000 rows (~1 MB) and 1,000,000 rows (~1.07 GB, ~7 M tokens to keep).
    write_data(&small, 1_000, 1_000);
    write_data(&large, 1_000_000, 1_000);
    let bytes = std::fs::metadata(&large).unwrap().len();
    assert!(bytes > 1_000_000_000, "{bytes}");

    for job in ["sft", "dpo", "grpo"] {
        let small_peak = peak_heap_mib(job, &small, &dir.path().join(format!("{job}-small")));
        let large_peak = peak_heap_mib(job, &large, &dir.path().join(format!("{job}-large")));
        println!("{job} heap peak: {small_peak:.1} MiB (1 MB of data), {large_peak:.1} MiB (1 GB)");
        // What grows with the number of items is the shuffled order (8 bytes each: 7.6 MiB here,
        // as torch's RandomSampler holds). Items kept in memory would be 70 MiB or more (SFT's
        // ~7 M tokens at 16 bytes), the file ~1 GiB.
        assert!(
            large_peak < small_peak + 12.0,
            "{job}: {small_peak:.1} MiB -> {large_peak:.1} MiB"
        );
    }
    // The tokenized data is removed with the run.
    for job in ["sft", "dpo", "grpo"] {
        let leftovers: Vec<_> = std::fs::read_dir(dir.path().join(format!("{job}-large")))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .filter(|n| n.to_string_lossy().starts_with('.'))
            .collect();
        assert!(leftovers.is_empty(), "{job}: {leftovers:?}");
    }
}

/// One huge row (a 4-million-character prompt among ordinary rows) costs memory in proportion to
/// `--max-length`, not to its size: it is cut before the tokenizer sees it (which holds hundreds of
/// bytes per character), then truncated or skipped as any long row is.
#[test]
fn a_huge_row_is_tokenized_within_the_length_limit() {
    let dir = tempfile::tempdir().unwrap();
    let (small, huge) = (
        dir.path().join("small.jsonl"),
        dir.path().join("huge.jsonl"),
    );
    write_data(&small, 1_000, 10);
    write_data(&huge, 1_000, 10);
    let prompt = "12+".repeat(4_000_000 / 3);
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&huge)
        .unwrap();
    writeln!(
        file,
        r#"{{"prompt": "{prompt}", "completion": "1", "chosen": "1", "rejected": "2", "answer": "1"}}"#
    )
    .unwrap();
    for job in ["sft", "dpo", "grpo"] {
        let small_peak = peak_heap_mib(job, &small, &dir.path().join(format!("{job}-small")));
        let huge_peak = peak_heap_mib(job, &huge, &dir.path().join(format!("{job}-huge")));
        println!("{job} heap peak: {small_peak:.1} MiB, {huge_peak:.1} MiB with a 4 MB row");
        // The row itself is read whole (a line, then its JSON value: ~8 MiB); tokenized whole it
        // would take over 500 MiB.
        assert!(
            huge_peak < small_peak + 40.0,
            "{job}: {small_peak:.1} MiB -> {huge_peak:.1} MiB"
        );
    }
}
