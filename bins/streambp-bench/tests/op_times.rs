//! `streambp-bench --op-times`: the engine's parts of each point in its JSON line, counted per chunk
//! as the modes run them, and none without the flag.

use std::collections::BTreeMap;
use std::process::Command;

/// A mode's parts (name -> calls and seconds) and its step's seconds.
type Parts = (BTreeMap<String, (u64, f64)>, f64);

/// Each mode's parts, with or without `--op-times`.
fn parts(op_times: bool) -> BTreeMap<String, Parts> {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("points.jsonl");
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../benches/configs/qwen3-small.json"
    );
    // One layer, T = 64: four query chunks and four logits chunks of 16.
    let mut bench = Command::new(env!("CARGO_BIN_EXE_streambp-bench"));
    bench
        .args(["--config", config, "--layers", "1", "--seq-lens", "64"])
        .args(["--chunk", "16", "--logits-chunk", "16"])
        .args(["--modes", "stream,checkpoint,full", "--json"])
        .arg(&json)
        .env("RUST_LOG", "warn");
    if op_times {
        bench.arg("--op-times");
    }
    let out = bench.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| {
            let row: serde_json::Value = serde_json::from_str(l).unwrap();
            let parts = row["op_times"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    let (calls, seconds) = (p["calls"].as_u64().unwrap(), p["seconds"].as_f64());
                    let name = p["part"].as_str().unwrap().to_string();
                    (name, (calls, seconds.unwrap()))
                })
                .collect();
            let mode = row["mode"].as_str().unwrap().to_string();
            (mode, (parts, row["seconds"].as_f64().unwrap()))
        })
        .collect()
}

#[test]
fn parts_are_reported_per_chunk_only_when_asked() {
    let off = parts(false);
    assert_eq!(off.len(), 3);
    assert!(off.values().all(|(p, _)| p.is_empty()), "{off:?}");

    let on = parts(true);
    let calls = |mode: &str, part: &str| on[mode].0.get(part).map_or(0, |p| p.0);
    // The streamed backward: the layer's keys and values in the forward and again in the backward,
    // then each of the four query chunks forward, recomputed and backpropagated.
    assert_eq!(calls("stream", "layer.keys_values"), 2);
    for part in [
        "layer.forward_chunk",
        "layer.chunk_recompute",
        "layer.chunk_backward",
        "layer.chunk_gradients",
        "attention.backward.kernel",
    ] {
        assert_eq!(calls("stream", part), 4, "{part}");
    }
    // The forward's four chunks and the backward's four recomputed ones.
    assert_eq!(calls("stream", "attention.forward.kernel"), 8);
    // Checkpointing recomputes the layer whole, once.
    assert_eq!(calls("checkpoint", "layer.whole_recompute"), 1);
    assert_eq!(calls("checkpoint", "layer.whole_backward"), 1);
    assert_eq!(calls("checkpoint", "layer.chunk_backward"), 0);
    assert_eq!(calls("full", "full.backward"), 1);
    // The LM head, one call per logits chunk where it is streamed.
    for part in ["head.logits", "head.softmax", "head.hidden_gradient"] {
        assert_eq!(calls("stream", part), 4, "{part}");
    }
    // The engine's parts (the attention op's run inside them) are disjoint spans of the step.
    for (mode, (parts, seconds)) in &on {
        let spans: f64 = parts
            .iter()
            .filter(|(name, _)| !name.starts_with("attention."))
            .map(|(_, &(_, s))| s)
            .sum();
        assert!(
            spans > 0.0 && spans <= *seconds,
            "{mode}: {spans} of {seconds} s"
        );
    }
}
