//! `--config FILE.toml`: keys mirror the flags, typed flags override the file, bad files are explained.

fn sft(args: &[&str]) -> (bool, String, String) {
    let out = streambp_testkit::command(env!("CARGO_BIN_EXE_streambp-train"))
        .arg("sft")
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn toml_config_mirrors_flags_and_typed_flags_win() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let config = dir.path().join("run.toml");
    std::fs::write(
        &config,
        format!(
            "max_steps = 3\nbatch-size = 4\nlr = 1e-3\nno_progress = true\noutput_dir = {:?}\n",
            out.display().to_string()
        ),
    )
    .unwrap();
    let (ok, stdout, stderr) = sft(&["--config", config.to_str().unwrap(), "--max-steps", "2"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("sft: 2 steps"), "{stdout}");
    assert_eq!(
        std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .filter(|l| l.contains("\"loss\""))
            .count(),
        2
    );

    std::fs::write(&config, "max_steps = { a = 1 }\n").unwrap();
    let (ok, _, stderr) = sft(&["--config", config.to_str().unwrap()]);
    assert!(!ok && stderr.contains("not a flag value"), "{stderr}");
    // A list repeats its flag; a flag that takes one value says so.
    std::fs::write(&config, "max_steps = [1, 2]\n").unwrap();
    let (ok, _, stderr) = sft(&["--config", config.to_str().unwrap()]);
    assert!(!ok && stderr.contains("--max-steps"), "{stderr}");
    std::fs::write(&config, "max_steps = \n").unwrap();
    let (ok, _, stderr) = sft(&["--config", config.to_str().unwrap()]);
    assert!(!ok && stderr.contains("not valid TOML"), "{stderr}");
}
