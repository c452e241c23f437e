//! A 1 GB data set trains in the memory a small one does: rows stream from the file, are tokenized
//! onto disk one at a time and read back by index (`token_store`), so the run's heap peak (the
//! binary's counting allocator, whole process, loading included) does not grow with the file.

use std::io::Write;
use std::path::Path;
use std::process::Command;

/// `rows` JSONL rows, each a short arithmetic text to train on beside a `meta` column of
/// `meta_bytes` (as real data sets carry ids, sources and urls the loader reads and drops).
fn write_data(path: &Path, rows: usize, meta_bytes: usize) {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let meta = "x".repeat(meta_bytes);
    for i in 0..rows {
        let (a, b) = (i % 97, (i / 97) % 89);
        writeln!(
            out,
            r#"{{"prompt": "{a}+{b}=", "completion": "{}", "meta": "{i} {meta}"}}"#,
            a + b
        )
        .unwrap();
    }
    out.flush().unwrap();
}

/// The heap peak (MiB) of a 3-step SFT run on `data`, as the binary prints it.
fn peak_heap_mib(data: &Path, out: &Path) -> f64 {
    let run = Command::new(env!("CARGO_BIN_EXE_streambp-train"))
        .args([
            "sft",
            "--no-progress",
            "--max-steps",
            "3",
            "--batch-size",
            "8",
        ])
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
    assert!(stdout.contains("sft: 3 steps"), "{stdout}");
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("peak heap: "))
        .unwrap_or_else(|| panic!("no peak in {stdout}"));
    line.trim_end_matches(" MiB").parse().unwrap()
}

#[test]
fn a_gigabyte_of_data_trains_in_the_memory_of_a_small_file() {
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

    let small_peak = peak_heap_mib(&small, &dir.path().join("out-small"));
    let large_peak = peak_heap_mib(&large, &dir.path().join("out-large"));
    println!("heap peak: {small_peak:.1} MiB (1 MB of data), {large_peak:.1} MiB (1 GB of data)");
    // What grows with the number of examples is the shuffled order (8 bytes each: 7.6 MiB here, as
    // torch's RandomSampler holds). Examples kept in memory would be ~110 MiB, the file ~1 GiB.
    assert!(
        large_peak < small_peak + 12.0,
        "{small_peak:.1} MiB -> {large_peak:.1} MiB"
    );
    // The tokenized data is removed with the run.
    let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("out-large"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}
