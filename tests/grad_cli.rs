//! The `grad` command end to end: its output contract, its gradients against transformers', and a clear
//! error for each kind of bad batch.

mod common;

use common::*;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

fn rows(t: &Tensor) -> Vec<Vec<i64>> {
    t.to_vec2::<i64>().unwrap()
}

/// The fixture's batch as a grad batch file.
fn batch_json(name: &str) -> serde_json::Value {
    let r = reference(name);
    serde_json::json!({
        "objective": "sft",
        "input_ids": rows(&r["input_ids"]),
        "labels": rows(&r["labels"]),
        "attention_mask": rows(&r["attention_mask"]),
    })
}

fn grad(
    model: &Path,
    batch: &serde_json::Value,
    extra: &[&str],
) -> (bool, String, String, PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let batch_path = dir.path().join("batch.json");
    std::fs::write(&batch_path, batch.to_string()).unwrap();
    let out = dir.path().join("grads.safetensors");
    let output = streambp_testkit::command(env!("CARGO_BIN_EXE_streambp-train"))
        .args(["grad", "--model"])
        .arg(model)
        .arg("--batch")
        .arg(&batch_path)
        .arg("--out")
        .arg(&out)
        .args(extra)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
        out,
        dir,
    )
}

#[test]
fn grad_writes_hf_named_gradients_matching_transformers() {
    for family in ["qwen2", "gemma3"] {
        for mode in ["stream", "checkpoint", "full"] {
            let (ok, stdout, stderr, out, _dir) = grad(
                &fixture_dir(family),
                &batch_json(family),
                &[
                    "--mode",
                    mode,
                    "--chunk",
                    "3",
                    "--logits-chunk",
                    "4",
                    "--dtype",
                    "f64",
                ],
            );
            assert!(ok, "{family} {mode}: {stderr}");
            let line: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
            for key in ["loss", "mode", "peak_bytes", "seconds", "tokens"] {
                assert!(line.get(key).is_some(), "missing {key} in {stdout}");
            }
            assert_eq!(line["mode"], mode);
            assert_eq!(line["tokens"], 11 + 7 + 9);
            assert!(line["peak_bytes"].as_u64().unwrap() > 0);

            let written = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
            let r = reference(family);
            let loss = written["loss"].to_vec1::<f64>().unwrap();
            assert_eq!(written["loss"].dims(), [1]);
            assert!((loss[0] - r["loss"].to_vec1::<f64>().unwrap()[0]).abs() < 1e-12);
            let expected: Vec<_> = r.keys().filter_map(|k| k.strip_prefix("grad.")).collect();
            assert_eq!(written.len(), expected.len() + 1);
            for name in expected {
                let err = rel_err(&written[name], &r[&format!("grad.{name}")]);
                assert!(err < 1e-10, "{family} {mode} {name}: {err:.2e}");
                assert_eq!(written[name].dtype(), DType::F64);
            }
        }
    }
}

#[test]
fn offloaded_checkpoints_write_the_same_gradients() {
    let run = |extra: &[&str]| {
        let (ok, _, stderr, out, dir) = grad(&fixture_dir("llama3"), &batch_json("llama3"), extra);
        assert!(ok, "{stderr}");
        (
            candle_core::safetensors::load(&out, &Device::Cpu).unwrap(),
            dir,
        )
    };
    let (a, _d1) = run(&["--dtype", "f64", "--chunk", "3"]);
    let (b, _d2) = run(&["--dtype", "f64", "--chunk", "3", "--offload-checkpoints"]);
    for (name, g) in &a {
        assert_eq!(rel_err(g, &b[name]), 0.0, "{name}");
    }
}

/// Sparse checkpoints and the disk tier write the same gradients, bit for bit, for SFT, DPO and
/// GRPO, full and LoRA, in both recomputing modes (llama3: 2 layers; gemma3: 3, so K = 2 leaves a
/// segment of one), and leave nothing in the checkpoint directory.
#[test]
fn sparse_and_disk_checkpoints_write_the_same_gradients() {
    let scratch = tempfile::tempdir().unwrap();
    let disk = scratch.path().to_str().unwrap();
    for family in ["llama3", "gemma3"] {
        for batch in [
            batch_json(family),
            fixture_batch(family, "dpo-batch.json"),
            fixture_batch(family, "grpo-batch.json"),
        ] {
            for trained in [&[][..], &["--lora-r", "4"]] {
                for mode in ["stream", "checkpoint"] {
                    let run = |extra: &[&str]| {
                        let mut args = vec!["--dtype", "f64", "--chunk", "3", "--mode", mode];
                        args.extend(trained);
                        args.extend(extra);
                        let (ok, _, stderr, out, dir) = grad(&fixture_dir(family), &batch, &args);
                        assert!(ok, "{stderr}");
                        let grads = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
                        (grads, dir)
                    };
                    let (dense, _d1) = run(&[]);
                    for extra in [
                        &["--checkpoint-every", "2"][..],
                        &["--checkpoint-dir", disk],
                        &["--checkpoint-every", "sqrt", "--checkpoint-dir", disk],
                    ] {
                        let (sparse, _d2) = run(extra);
                        assert_eq!(sparse.len(), dense.len());
                        for (name, g) in &dense {
                            let what = format!("{family} {mode} {trained:?} {extra:?} {name}");
                            assert_eq!(rel_err(g, &sparse[name]), 0.0, "{what}");
                        }
                    }
                }
            }
        }
    }
    assert_eq!(std::fs::read_dir(scratch.path()).unwrap().count(), 0);
}

#[test]
fn tied_embeddings_are_written_once() {
    let (ok, _, stderr, out, _dir) = grad(
        &fixture_dir("qwen3"),
        &batch_json("qwen3"),
        &["--dtype", "f32"],
    );
    assert!(ok, "{stderr}");
    let written = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
    assert!(written.contains_key("model.embed_tokens.weight"));
    assert!(!written.contains_key("lm_head.weight"));
    assert_eq!(written["loss"].dtype(), DType::F32);
}

#[test]
fn memory_budget_picks_chunks_and_too_small_budget_is_explained() {
    let (ok, stdout, stderr, _, _dir) = grad(
        &fixture_dir("llama3"),
        &batch_json("llama3"),
        &["--memory-budget", "64MiB"],
    );
    assert!(ok, "{stderr}");
    let line: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(line["chunk"].as_u64().unwrap() >= 1);
    let (ok, _, stderr, _, _dir) = grad(
        &fixture_dir("llama3"),
        &batch_json("llama3"),
        &["--memory-budget", "1000"],
    );
    assert!(!ok);
    assert!(
        stderr.contains("too small") && stderr.contains("need an estimated"),
        "{stderr}"
    );
}

#[test]
fn bad_batches_are_clear_errors() {
    let model = fixture_dir("qwen2");
    let mut cases: Vec<(serde_json::Value, &str)> = Vec::new();

    let mut ragged = batch_json("qwen2");
    ragged["input_ids"][1].as_array_mut().unwrap().pop();
    cases.push((ragged, "ragged: row 1"));

    let mut oov = batch_json("qwen2");
    oov["input_ids"][0][2] = 96.into();
    cases.push((oov, "token id 96 at row 0, position 2"));

    let mut no_target = batch_json("qwen2");
    for row in no_target["labels"].as_array_mut().unwrap() {
        for v in row.as_array_mut().unwrap() {
            *v = (-100).into();
        }
    }
    cases.push((no_target, "no target token"));

    let mut unknown = batch_json("qwen2");
    unknown["objective"] = "ppo".into();
    cases.push((unknown, "unknown objective \"ppo\""));

    let mut left_padded = batch_json("qwen2");
    left_padded["attention_mask"][1] = serde_json::json!([0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]);
    cases.push((left_padded, "not right-padded"));

    let mut bad_label = batch_json("qwen2");
    bad_label["labels"][0][5] = 500.into();
    cases.push((bad_label, "label 500"));

    for (batch, expected) in cases {
        let (ok, _, stderr, out, _dir) = grad(&model, &batch, &[]);
        assert!(!ok, "accepted a bad batch ({expected})");
        assert!(
            stderr.contains(expected),
            "expected {expected:?} in: {stderr}"
        );
        assert!(
            stderr.contains("batch.json"),
            "error should name the file: {stderr}"
        );
        assert!(!out.exists(), "no output on error");
    }
}

#[test]
fn unknown_mode_and_missing_model_are_reported() {
    let (ok, _, stderr, _, _dir) = grad(
        &fixture_dir("qwen2"),
        &batch_json("qwen2"),
        &["--mode", "fast"],
    );
    assert!(!ok && stderr.contains("unknown mode"), "{stderr}");
    let (ok, _, stderr, _, _dir) = grad(Path::new("/nonexistent/model"), &batch_json("qwen2"), &[]);
    assert!(!ok && stderr.contains("/nonexistent/model"), "{stderr}");
}

fn fixture_batch(family: &str, file: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_dir(family).join(file)).unwrap()).unwrap()
}

#[test]
fn dpo_and_grpo_batches_through_grad() {
    let r = reference("llama3");
    // The GRPO batch names no loss type: TRL's default dapo, whose normaliser without
    // num_items_in_batch is this batch's own tokens, which makes it bnpo.
    for (file, prefix, metric) in [
        ("dpo-batch.json", "dpo", "rewards/margins"),
        ("grpo-batch.json", "grpo.bnpo", "clip_ratio"),
    ] {
        let (ok, stdout, stderr, out, _dir) = grad(
            &fixture_dir("llama3"),
            &fixture_batch("llama3", file),
            &["--dtype", "f64", "--chunk", "3", "--logits-chunk", "5"],
        );
        assert!(ok, "{file}: {stderr}");
        let line: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert!(line["metrics"][metric].is_number(), "{stdout}");
        let written = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
        let loss = written["loss"].to_vec1::<f64>().unwrap()[0];
        assert!((loss - r[&format!("{prefix}.loss")].to_vec1::<f64>().unwrap()[0]).abs() < 1e-12);
        for (name, g) in &written {
            if name != "loss" {
                let err = rel_err(g, &r[&format!("{prefix}.grad.{name}")]);
                assert!(err < 1e-10, "{file} {name}: {err:.2e}");
            }
        }
    }
}

/// Without reference log-probs the reference is the policy itself (TRL's default reference is the
/// initial policy): DPO's margin is 0 and its loss is exactly ln 2; GRPO's KL is 0.
#[test]
fn missing_reference_logps_use_the_policy_or_ref_model() {
    let mut dpo = fixture_batch("qwen3", "dpo-batch.json");
    dpo.as_object_mut().unwrap().remove("ref_chosen_logps");
    dpo.as_object_mut().unwrap().remove("ref_rejected_logps");
    let model = fixture_dir("qwen3");
    for extra in [
        vec!["--dtype", "f64"],
        vec!["--dtype", "f64", "--ref-model", model.to_str().unwrap()],
    ] {
        let (ok, stdout, stderr, _, _dir) = grad(&model, &dpo, &extra);
        assert!(ok, "{stderr}");
        let line: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert!(
            (line["loss"].as_f64().unwrap() - std::f64::consts::LN_2).abs() < 1e-12,
            "{stdout}"
        );
    }
    let mut grpo = fixture_batch("qwen3", "grpo-batch.json");
    grpo.as_object_mut().unwrap().remove("ref_logps");
    let (ok, stdout, stderr, _, _dir) = grad(&model, &grpo, &["--dtype", "f64"]);
    assert!(ok, "{stderr}");
    let line: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(
        line["metrics"]["kl"].as_f64().unwrap().abs() < 1e-12,
        "{stdout}"
    );
}

#[test]
fn bad_pair_and_grpo_batches_are_clear_errors() {
    let model = fixture_dir("qwen2");
    let mut cases: Vec<(serde_json::Value, &str)> = Vec::new();

    let mut pairs = fixture_batch("qwen2", "dpo-batch.json");
    pairs["rejected_input_ids"].as_array_mut().unwrap().pop();
    cases.push((pairs, "2 chosen rows but 1 rejected rows"));

    let mut one_ref = fixture_batch("qwen2", "dpo-batch.json");
    one_ref
        .as_object_mut()
        .unwrap()
        .remove("ref_rejected_logps");
    cases.push((one_ref, "or neither"));

    let mut lengths = fixture_batch("qwen2", "dpo-batch.json");
    lengths["chosen_labels"][0].as_array_mut().unwrap().pop();
    cases.push((lengths, "chosen_labels is ragged"));

    let mut both = fixture_batch("qwen2", "dpo-batch.json");
    both["loss_type"] = serde_json::json!(["sigmoid", "sft"]);
    both["sft_weight"] = 0.5.into();
    cases.push((both, "sft_weight and loss_type both given"));

    let mut unknown = fixture_batch("qwen2", "dpo-batch.json");
    unknown["loss_type"] = "kto".into();
    cases.push((unknown, "unknown DPO loss_type \"kto\""));

    let mut smoothing = fixture_batch("qwen2", "dpo-batch.json");
    smoothing["label_smoothing"] = 0.1.into();
    cases.push((smoothing, "label_smoothing needs loss_type"));

    // ORPO and CPO read no reference and refuse the other objectives' settings by name.
    let mut orpo_ref = fixture_batch("qwen2", "dpo-batch.json");
    orpo_ref["objective"] = "orpo".into();
    cases.push((orpo_ref, "ref_chosen_logps applies to dpo, not orpo"));

    let mut cpo_batch = fixture_batch("qwen2", "dpo-batch.json");
    let fields = cpo_batch.as_object_mut().unwrap();
    fields.remove("ref_chosen_logps");
    fields.remove("ref_rejected_logps");
    fields.insert("objective".into(), "cpo".into());
    let mut cpo_type = cpo_batch.clone();
    cpo_type["loss_type"] = "robust".into();
    cases.push((cpo_type, "unknown CPO loss type \"robust\""));
    let mut cpo_tau = cpo_batch.clone();
    cpo_tau["discopop_tau"] = 0.1.into();
    cases.push((cpo_tau, "discopop_tau applies to dpo, not cpo"));
    let mut orpo_alpha = cpo_batch;
    orpo_alpha["objective"] = "orpo".into();
    orpo_alpha["cpo_alpha"] = 1.0.into();
    cases.push((orpo_alpha, "cpo_alpha applies to cpo, not orpo"));

    // A reward batch on a causal LM, and a pair setting a reward model does not read.
    let mut on_causal = fixture_batch("qwen2", "dpo-batch.json");
    let fields = on_causal.as_object_mut().unwrap();
    for key in [
        "ref_chosen_logps",
        "ref_rejected_logps",
        "chosen_labels",
        "rejected_labels",
    ] {
        fields.remove(key);
    }
    fields.insert("objective".into(), "reward".into());
    let mut with_beta = on_causal.clone();
    cases.push((on_causal, "objective reward needs a reward model"));
    with_beta["beta"] = 0.5.into();
    cases.push((with_beta, "beta applies to dpo, orpo and cpo, not reward"));

    // One row without completion tokens is allowed (TRL's masked truncated completions), none at
    // all is not.
    let mut empty = fixture_batch("qwen2", "grpo-batch.json");
    for row in empty["completion_mask"].as_array_mut().unwrap() {
        for v in row.as_array_mut().unwrap() {
            *v = 0.into();
        }
    }
    cases.push((
        empty,
        "completion_mask marks no completion token in any row",
    ));

    let mut short = fixture_batch("qwen2", "grpo-batch.json");
    short["old_logps"][1].as_array_mut().unwrap().pop();
    cases.push((short, "old_logps row 1 has 9 entries, expected 10"));

    let mut advantages = fixture_batch("qwen2", "grpo-batch.json");
    advantages["advantages"].as_array_mut().unwrap().pop();
    cases.push((advantages, "advantages has 3 entries for 4 sequences"));

    let mut loss_type = fixture_batch("qwen2", "grpo-batch.json");
    loss_type["loss_type"] = "gspo".into();
    cases.push((loss_type, "unknown loss_type \"gspo\""));

    for (batch, expected) in cases {
        let (ok, _, stderr, _, _dir) = grad(&model, &batch, &[]);
        assert!(!ok, "accepted a bad batch ({expected})");
        assert!(
            stderr.contains(expected),
            "expected {expected:?} in: {stderr}"
        );
    }

    // NaN is not JSON; the error says so.
    let dir = tempfile::tempdir().unwrap();
    let text = fixture_batch("qwen2", "grpo-batch.json")
        .to_string()
        .replacen("0.2", "NaN", 1);
    let path = dir.path().join("nan.json");
    std::fs::write(&path, text).unwrap();
    let output = streambp_testkit::command(env!("CARGO_BIN_EXE_streambp-train"))
        .args(["grad", "--model"])
        .arg(&model)
        .arg("--batch")
        .arg(&path)
        .args(["--out", "/tmp/never.safetensors"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("NaN and Infinity are not allowed"));
}
