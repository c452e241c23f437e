//! `--peer PYTHON`: streambp's step beside PyTorch + transformers' on the same machine, in one run.
//! The peer (`scripts/peer_bench.py --serve`) stays up and answers one step at a time, so every round
//! alternates the peer's steps (without and with gradient checkpointing) with ours (each `--modes`
//! mode); each figure is the median over the rounds, and the ratios compare medians taken side by
//! side. With `--plot` each side's heap peak above its weights is measured too (the peer's by
//! `scripts/heap_peak.c`, preloaded into it). `--peer-doc FILE` writes the tables into FILE between
//! two marker lines.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{bail, Context};

/// The peer's two settings, as the script names them.
pub const PEER_MODES: [(&str, &str); 2] = [
    ("none", "transformers"),
    ("gc", "transformers + checkpointing"),
];

/// The script beside the workspace (the bench is a development tool run from a checkout).
pub const DEFAULT_SCRIPT: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/peer_bench.py");

/// The running peer.
pub struct Peer {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
    /// What it reported of itself (torch and transformers versions, threads).
    pub info: serde_json::Value,
}

impl Peer {
    /// Starts `python script --config config --dtype dtype --serve` (and `--memory`: each step's
    /// heap peak) and waits until it is ready.
    pub fn start(
        python: &Path,
        script: &Path,
        (config, dtype): (&Path, &str),
        memory: bool,
    ) -> anyhow::Result<Self> {
        let mut child = Command::new(python)
            .arg(script)
            .arg("--config")
            .arg(config)
            .args(["--dtype", dtype, "--serve"])
            .args(memory.then_some("--memory"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| {
                format!(
                    "starting the peer: {} {}",
                    python.display(),
                    script.display()
                )
            })?;
        let input = child.stdin.take().context("the peer's stdin")?;
        let output = BufReader::new(child.stdout.take().context("the peer's stdout")?);
        let mut peer = Self {
            child,
            input,
            output,
            info: serde_json::Value::Null,
        };
        peer.info = peer.answer()?;
        Ok(peer)
    }

    fn answer(&mut self) -> anyhow::Result<serde_json::Value> {
        let mut line = String::new();
        if self.output.read_line(&mut line)? == 0 {
            bail!("the peer stopped (its error is above)");
        }
        serde_json::from_str(&line).with_context(|| format!("the peer's answer {line:?}"))
    }

    /// One peer step at `t` tokens in `mode` (`none` or `gc`).
    pub fn step(&mut self, t: usize, mode: &str) -> anyhow::Result<Step> {
        writeln!(self.input, "{t} {mode}")?;
        self.input.flush()?;
        let answer = self.answer()?;
        let seconds = answer["seconds"]
            .as_f64()
            .with_context(|| format!("no seconds in the peer's answer {answer}"))?;
        Ok(Step {
            seconds,
            peak: answer["peak_bytes"].as_f64(),
        })
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One step's seconds and, where measured, its peak bytes above what was live before it.
#[derive(Debug, Clone, Copy)]
pub struct Step {
    /// Wall time.
    pub seconds: f64,
    /// Peak bytes above the weights.
    pub peak: Option<f64>,
}

/// The median of `v` (the mean of the middle two for an even count).
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// One sequence length's medians: the peer's (none, gc) and ours, by mode name.
pub struct Row {
    /// Tokens.
    pub t: usize,
    /// The peer without and with checkpointing: seconds.
    pub peer: [f64; 2],
    /// Ours, per mode: seconds.
    pub ours: Vec<(String, f64)>,
    /// The peaks in bytes, where both sides measured them: the peer's two, then ours per mode.
    pub peaks: Option<([f64; 2], Vec<f64>)>,
}

/// The median of each side's peaks (`None` where a step did not measure one).
fn median_peaks(steps: &[Step]) -> Option<f64> {
    let peaks: Option<Vec<f64>> = steps.iter().map(|s| s.peak).collect();
    peaks.map(|p| median(&p))
}

/// Alternates, `rounds` times at each T: the peer's two steps, then `ours(t, mode)` for each mode.
pub fn compare(
    peer: &mut Peer,
    seq_lens: &[usize],
    modes: &[String],
    rounds: usize,
    mut ours: impl FnMut(usize, &str) -> anyhow::Result<Step>,
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &t in seq_lens {
        // Warm-up of both at this length (allocator, caches), untimed.
        for (mode, _) in PEER_MODES {
            peer.step(t, mode)?;
        }
        for mode in modes {
            ours(t, mode)?;
        }
        let mut peer_steps = [Vec::new(), Vec::new()];
        let mut our_steps = vec![Vec::new(); modes.len()];
        for round in 0..rounds {
            for (k, (mode, _)) in PEER_MODES.iter().enumerate() {
                peer_steps[k].push(peer.step(t, mode)?);
            }
            for (k, mode) in modes.iter().enumerate() {
                our_steps[k].push(ours(t, mode)?);
            }
            eprintln!(
                "T={t} round {}: peer {:.3} s / {:.3} s (gc), ours {}",
                round + 1,
                peer_steps[0][round].seconds,
                peer_steps[1][round].seconds,
                modes
                    .iter()
                    .zip(&our_steps)
                    .map(|(m, v)| format!("{m} {:.3} s", v[round].seconds))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let seconds = |steps: &[Step]| median(&steps.iter().map(|s| s.seconds).collect::<Vec<_>>());
        let peaks = match (
            median_peaks(&peer_steps[0]),
            median_peaks(&peer_steps[1]),
            our_steps.iter().map(|s| median_peaks(s)).collect(),
        ) {
            (Some(none), Some(gc), Some(ours)) => Some(([none, gc], ours)),
            _ => None,
        };
        rows.push(Row {
            t,
            peer: [seconds(&peer_steps[0]), seconds(&peer_steps[1])],
            ours: modes
                .iter()
                .zip(&our_steps)
                .map(|(m, v)| (m.clone(), seconds(v)))
                .collect(),
            peaks,
        });
    }
    Ok(rows)
}

/// The comparison as a markdown table: seconds, and each of our modes over the peer's two.
pub fn table(rows: &[Row]) -> String {
    let Some(first) = rows.first() else {
        return String::new();
    };
    let modes: Vec<&str> = first.ours.iter().map(|(m, _)| m.as_str()).collect();
    let mut head = vec!["T".to_string()];
    head.extend(PEER_MODES.iter().map(|(_, name)| format!("{name} (s)")));
    head.extend(modes.iter().map(|m| format!("streambp {m} (s)")));
    for m in &modes {
        head.push(format!("{m} / checkpointing"));
        head.push(format!("{m} / no checkpointing"));
    }
    let mut out = format!("| {} |\n|{}\n", head.join(" | "), "---|".repeat(head.len()));
    for row in rows {
        let mut cells = vec![row.t.to_string()];
        cells.extend(row.peer.iter().map(|s| format!("{s:.3}")));
        cells.extend(row.ours.iter().map(|(_, s)| format!("{s:.3}")));
        for (_, s) in &row.ours {
            cells.push(format!("{:.2}x", s / row.peer[1]));
            cells.push(format!("{:.2}x", s / row.peer[0]));
        }
        out.push_str(&format!("| {} |\n", cells.join(" | ")));
    }
    out
}

/// The peaks as a markdown table (MiB above the weights, and each of our modes over the peer's
/// two), or nothing where they were not measured.
pub fn memory_table(rows: &[Row]) -> String {
    let Some(first) = rows.iter().find(|r| r.peaks.is_some()) else {
        return String::new();
    };
    let modes: Vec<&str> = first.ours.iter().map(|(m, _)| m.as_str()).collect();
    let mut head = vec!["T".to_string()];
    head.extend(PEER_MODES.iter().map(|(_, name)| format!("{name} (MiB)")));
    head.extend(modes.iter().map(|m| format!("streambp {m} (MiB)")));
    for m in &modes {
        head.push(format!("{m} / checkpointing"));
    }
    let mut out = format!("| {} |\n|{}\n", head.join(" | "), "---|".repeat(head.len()));
    let mib = |b: f64| b / (1u64 << 20) as f64;
    for row in rows {
        let Some((peer, ours)) = &row.peaks else {
            continue;
        };
        let mut cells = vec![row.t.to_string()];
        cells.extend(peer.iter().chain(ours).map(|&b| format!("{:.1}", mib(b))));
        cells.extend(ours.iter().map(|b| format!("{:.2}x", b / peer[1])));
        out.push_str(&format!("| {} |\n", cells.join(" | ")));
    }
    out
}

/// Replaces the text between `key`'s markers in `doc` with `body` (appending the markers if
/// absent): one table per key (the CPU and the dtype), so runs on other machines add theirs.
pub fn write_into(doc: &Path, key: &str, body: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(doc).unwrap_or_default();
    let begin = format!("<!-- peer-table:begin {key} (written by streambp-bench --peer-doc) -->");
    let end = format!("<!-- peer-table:end {key} -->");
    let block = format!("{begin}\n{body}{end}");
    let new = match (text.find(&begin), text.find(&end)) {
        (Some(b), Some(e)) if b < e => format!("{}{block}{}", &text[..b], &text[e + end.len()..]),
        _ => format!("{text}\n{block}\n"),
    };
    std::fs::write(doc, new).with_context(|| format!("writing {}", doc.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_the_table() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        let mut rows = [Row {
            t: 2048,
            peer: [1.0, 2.0],
            ours: vec![("stream".into(), 3.0)],
            peaks: None,
        }];
        let t = table(&rows);
        assert!(
            t.contains("| 2048 | 1.000 | 2.000 | 3.000 | 1.50x | 3.00x |"),
            "{t}"
        );
        assert_eq!(memory_table(&rows), "");
        let mib = (1u64 << 20) as f64;
        rows[0].peaks = Some(([400.0 * mib, 200.0 * mib], vec![50.0 * mib]));
        let m = memory_table(&rows);
        assert!(m.contains("| 2048 | 400.0 | 200.0 | 50.0 | 0.25x |"), "{m}");
        let steps = |peaks: &[Option<f64>]| -> Vec<Step> {
            peaks
                .iter()
                .map(|&peak| Step { seconds: 1.0, peak })
                .collect()
        };
        assert_eq!(
            median_peaks(&steps(&[Some(3.0), Some(1.0), Some(2.0)])),
            Some(2.0)
        );
        assert_eq!(median_peaks(&steps(&[Some(3.0), None])), None);
    }

    #[test]
    fn the_table_replaces_its_old_self() {
        let dir = tempfile::tempdir().unwrap();
        let doc = dir.path().join("b.md");
        std::fs::write(&doc, "# Bench\n\nbefore\n").unwrap();
        write_into(&doc, "cpu A, f32", "one\n").unwrap();
        write_into(&doc, "cpu B, f32", "other\n").unwrap();
        write_into(&doc, "cpu A, f32", "two\n").unwrap();
        let text = std::fs::read_to_string(&doc).unwrap();
        assert!(text.starts_with("# Bench\n\nbefore\n"), "{text}");
        assert!(text.contains("two\n") && !text.contains("one\n"), "{text}");
        assert!(text.contains("other\n"), "{text}");
        assert_eq!(text.matches("peer-table:begin cpu A, f32").count(), 1);
    }
}
