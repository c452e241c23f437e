//! The host's worker threads follow the cores the process may run on, not the machine's: under
//! `taskset` to one core, the bench runs one worker thread (candle's own count reads the
//! machine's cores from `/proc/cpuinfo`, which on a 16-core machine under `taskset -c 0,1` gave
//! 16 workers to two cores).

#![cfg(target_os = "linux")]

use std::process::Command;

/// The first core this process may run on, from `/proc/self/status`.
fn first_allowed_core() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list in /proc/self/status");
    list.trim().split([',', '-']).next().unwrap().to_string()
}

#[test]
fn one_allowed_core_gets_one_worker_thread() {
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../benches/configs/qwen3-small.json"
    );
    let out = Command::new("taskset")
        .args([
            "-c",
            &first_allowed_core(),
            env!("CARGO_BIN_EXE_streambp-bench"),
        ])
        .args(["--config", config, "--layers", "1", "--seq-lens", "16"])
        .args(["--chunk", "16", "--modes", "stream", "--repeats", "1"])
        .env_remove("RAYON_NUM_THREADS")
        .env_remove("CANDLE_NUM_THREADS")
        .env("RUST_LOG", "warn")
        .output();
    let out = match out {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            println!("not checked: no taskset on this machine (util-linux)");
            return;
        }
        Err(e) => panic!("taskset: {e}"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cpu = stdout
        .lines()
        .find(|l| l.starts_with("CPU:"))
        .expect("the bench names its CPU");
    assert!(cpu.contains("1 cores, 1 worker threads"), "{cpu}");
}
