//! `streambp-bench --world 2`: what each rank holds, counted by the allocator. ZeRO-1 halves the
//! optimizer's moments, ZeRO-2 also the gradients; ZeRO-0 holds what one process does.
//!
//! Needs the `mpi` feature and `mpiexec`; without them the test says so and passes, unless
//! `STREAMBP_REQUIRE_MPI=1` (CI) makes that a failure.

use std::process::Command;

fn mpi_available() -> bool {
    streambp_testkit::mpi_available(cfg!(feature = "mpi"))
}

#[test]
fn zero_stages_divide_the_state_over_ranks() {
    if !mpi_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("world.jsonl");
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../benches/configs/qwen3-small.json"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_streambp-bench"))
        .args([
            "--config",
            config,
            "--layers",
            "2",
            "--seq-lens",
            "64",
            "--chunk",
            "16",
        ])
        .args(["--world", "2", "--json"])
        .arg(&json)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let stage = |z: &str, key: &str| -> f64 {
        rows.iter().find(|r| r["zero"] == z).unwrap()[key]
            .as_f64()
            .unwrap()
    };
    // One process's moments and gradients (f32): 2 and 1 times the parameters' bytes.
    let (moments, grads) = (stage("0", "optimizer_bytes"), stage("0", "gradient_bytes"));
    assert!((moments / grads - 2.0).abs() < 0.01, "{moments} {grads}");
    let half = |x: f64, whole: f64| (x / whole - 0.5).abs() < 0.01;
    for z in ["1", "2"] {
        let m = stage(z, "optimizer_bytes");
        assert!(half(m, moments), "ZeRO-{z}: moments {m} of {moments}");
    }
    assert!((stage("1", "gradient_bytes") / grads - 1.0).abs() < 0.01);
    let g = stage("2", "gradient_bytes");
    assert!(half(g, grads), "ZeRO-2: gradients {g} of {grads}");
    // The tensors' own sizes agree with the allocator.
    for z in ["0", "1", "2"] {
        for (counted, sized) in [
            ("optimizer_bytes", "optimizer_tensor_bytes"),
            ("gradient_bytes", "gradient_tensor_bytes"),
        ] {
            let (c, s) = (stage(z, counted), stage(z, sized));
            assert!(
                (c / s - 1.0).abs() < 0.01,
                "ZeRO-{z}: {counted} {c}, {sized} {s}"
            );
        }
    }
}
