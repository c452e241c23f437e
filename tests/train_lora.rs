//! LoRA through the trainer: SFT, DPO and GRPO train adapters only; checkpoints are PEFT adapter
//! directories that resume exactly and continue with --adapter; --merge writes a plain HF model with the
//! adapter's logits; a bf16 base trains f32 adapters; `grad` writes the adapters' gradients under their
//! PEFT keys.

mod common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::*;
use streambp_models::adapter::load_adapter;
use streambp_models::{load_model, LoraConfig, Projection};
use streambp_train::config::{GrpoConfig, Recipe, TrainConfig};

fn lora() -> LoraConfig {
    LoraConfig {
        r: 8,
        alpha: 16.0,
        targets: Projection::ALL.to_vec(),
        use_rslora: false,
        dropout: 0.1,
    }
}

/// A short LoRA run on the built-in task.
fn config(out: &Path, recipe: Recipe) -> TrainConfig {
    TrainConfig {
        output_dir: out.to_path_buf(),
        max_steps: Some(8),
        batch_size: 16,
        save_every: 4,
        progress: false,
        lora: Some(lora()),
        ..TrainConfig::defaults(recipe, true)
    }
}

fn column(out: &Path, name: &str) -> Vec<f64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()[name].as_f64())
        .collect()
}

#[test]
fn sft_trains_adapters_saves_peft_dirs_resumes_and_merges() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut cfg = config(a.path(), Recipe::Sft);
    cfg.merge = true;
    cfg.lr = 1e-2;
    let summary = streambp_train::sft::run_sft(&cfg).unwrap();
    assert!(summary.last_loss < summary.first_loss, "{summary:?}");
    for dir in ["checkpoint-4", "final"] {
        let adapter = load_adapter(&a.path().join(dir), &Device::Cpu).unwrap();
        assert_eq!(adapter.config, lora(), "{dir}");
        assert!(adapter.tensors.values().all(|t| t.dtype() == DType::F32));
        assert!(
            !a.path().join(dir).join("model.safetensors").exists(),
            "{dir}: adapter only"
        );
    }
    // Resumed from the adapter checkpoint (dropout on): the same losses to the last bit.
    let whole = column(a.path(), "loss");
    let mut resumed = config(b.path(), Recipe::Sft);
    resumed.lr = 1e-2;
    resumed.resume = Some(a.path().join("checkpoint-4"));
    let summary = streambp_train::sft::run_sft(&resumed).unwrap();
    assert_eq!(whole[4..], column(b.path(), "loss")[..]);
    // The summary's first loss is the run's, not the first resumed step's.
    assert_eq!(summary.first_loss, whole[0]);

    // The merged model is a plain HF model with the adapter's logits.
    let merged = load_model(&a.path().join("merged"), DType::F32, &Device::Cpu).unwrap();
    let base_dir = a.path().join("builtin-task");
    let base = streambp_models::Model::random(
        streambp_models::ModelConfig::from_file(&base_dir.join("config.json")).unwrap(),
        DType::F32,
        &Device::Cpu,
        cfg.seed,
    )
    .unwrap();
    let adapter = load_adapter(&a.path().join("final"), &Device::Cpu).unwrap();
    let with_adapter = base
        .with_lora(adapter.config, Some(adapter.tensors), 0)
        .unwrap();
    let ids = Tensor::new(&[[3u32, 4, 11, 5, 6, 12]], &Device::Cpu).unwrap();
    let (x, y) = (
        merged.forward(&ids, None).unwrap(),
        with_adapter.detached().forward(&ids, None).unwrap(),
    );
    assert!(rel_err(&x, &y) < 1e-5, "{}", rel_err(&x, &y));

    // An adapter continues to train from where it was (--adapter).
    let c = tempfile::tempdir().unwrap();
    let mut more = config(c.path(), Recipe::Sft);
    more.lora = None;
    more.adapter = Some(a.path().join("final").display().to_string());
    more.max_steps = Some(2);
    more.save_every = 0;
    let continued = streambp_train::sft::run_sft(&more).unwrap();
    assert!(
        continued.first_loss < whole[0],
        "starts from the trained adapter"
    );
}

/// bf16 base weights, f32 adapters, gradients and optimizer state: the paper's mixed-precision LoRA.
#[test]
fn a_bf16_base_trains_f32_adapters() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), Recipe::Sft);
    cfg.dtype = "bf16".into();
    cfg.lr = 1e-2;
    let summary = streambp_train::sft::run_sft(&cfg).unwrap();
    assert!(summary.last_loss < summary.first_loss, "{summary:?}");
    let optimizer = candle_core::safetensors::load(
        dir.path().join("checkpoint-4/optimizer.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    assert!(optimizer.keys().all(|k| k.contains(".lora_")));
    assert!(optimizer.values().all(|t| t.dtype() == DType::F32));
    let adapter = load_adapter(&dir.path().join("final"), &Device::Cpu).unwrap();
    assert!(adapter.tensors.values().all(|t| t.dtype() == DType::F32));
}

/// DPO with LoRA: the reference is the base with the adapter off, which is where a fresh adapter
/// starts (loss ln 2); GRPO with LoRA and a KL term runs on the same principle.
#[test]
fn dpo_and_grpo_train_adapters_against_the_base() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), Recipe::Dpo);
    cfg.lr = 5e-3;
    cfg.sft_weight = 0.0;
    cfg.lora.as_mut().unwrap().dropout = 0.0;
    let summary = streambp_train::dpo::run_dpo(&cfg).unwrap();
    assert!(
        (summary.first_loss - std::f64::consts::LN_2).abs() < 1e-4,
        "{summary:?}"
    );
    assert!(summary.last_loss < summary.first_loss, "{summary:?}");
    assert!(dir.path().join("final/adapter_model.safetensors").exists());

    let g_dir = tempfile::tempdir().unwrap();
    let mut g_cfg = config(g_dir.path(), Recipe::Grpo);
    g_cfg.batch_size = 2;
    g_cfg.max_steps = Some(2);
    g_cfg.save_every = 0;
    g_cfg.beta = 0.04;
    let g = GrpoConfig {
        group_size: 4,
        ..GrpoConfig::defaults(true)
    };
    streambp_train::grpo::run_grpo(&g_cfg, &g).unwrap();
    assert_eq!(column(g_dir.path(), "loss").len(), 2);
    assert!(g_dir.path().join("final/adapter_config.json").exists());
}

/// `grad` with a fresh adapter or a PEFT adapter: only the adapters' gradients, under PEFT's keys,
/// plus the loss, for sft, dpo and grpo batch files.
#[test]
fn grad_writes_adapter_gradients_under_peft_keys() {
    let out = tempfile::tempdir().unwrap();
    let model = fixture_dir("qwen3");
    let adapter = fixture_dir("qwen3").join("lora");
    let batches = [
        fixture_dir("qwen3-batch.json"),
        fixture_dir("qwen3").join("dpo-batch.json"),
        fixture_dir("qwen3").join("grpo-batch.json"),
    ];
    let peft_keys: std::collections::BTreeSet<String> =
        candle_core::safetensors::load(adapter.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap()
            .into_keys()
            .collect();
    for batch in &batches {
        for lora_flags in [
            vec!["--adapter", adapter.to_str().unwrap()],
            vec!["--lora-r", "4", "--lora-target", "q_proj,down_proj"],
        ] {
            let path = out.path().join("g.safetensors");
            let status = streambp_testkit::command(env!("CARGO_BIN_EXE_streambp-train"))
                .args(["grad", "--model", model.to_str().unwrap(), "--batch"])
                .arg(batch)
                .args([
                    "--dtype",
                    "f64",
                    "--chunk",
                    "3",
                    "--out",
                    path.to_str().unwrap(),
                ])
                .args(&lora_flags)
                .env("RUST_LOG", "warn")
                .output()
                .unwrap();
            assert!(
                status.status.success(),
                "{}",
                String::from_utf8_lossy(&status.stderr)
            );
            let grads = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
            let keys: std::collections::BTreeSet<String> =
                grads.keys().filter(|k| *k != "loss").cloned().collect();
            assert!(grads.contains_key("loss"));
            assert!(keys
                .iter()
                .all(|k| k.starts_with("base_model.model.model.layers.")));
            if lora_flags[0] == "--adapter" {
                assert_eq!(keys, peft_keys, "{}", batch.display());
            } else {
                assert_eq!(
                    keys.len(),
                    2 * 2 * 2,
                    "q_proj and down_proj, A and B, 2 layers"
                );
            }
        }
    }
}

/// A LoRA run's base model is identified by its weights, not by how its path is spelled: resuming
/// through another spelling of the same directory continues, resuming after other weights were
/// written over the same path is refused, naming the model.
#[test]
fn lora_resume_checks_the_base_model_by_content() {
    let root = tempfile::tempdir().unwrap();
    // A base model directory: the final model of a one-step full fine-tune of the built-in task.
    let mut base_run = config(&root.path().join("base-run"), Recipe::Sft);
    (base_run.lora, base_run.max_steps, base_run.save_every) = (None, Some(1), 0);
    streambp_train::sft::run_sft(&base_run).unwrap();
    let base = root.path().join("base-run/final");

    let mut cfg = config(&root.path().join("a"), Recipe::Sft);
    cfg.model = Some(base.display().to_string());
    streambp_train::sft::run_sft(&cfg).unwrap();
    let checkpoint = root.path().join("a/checkpoint-4");

    let mut resumed = config(&root.path().join("b"), Recipe::Sft);
    resumed.model = Some(format!("{}/./", base.display()));
    resumed.resume = Some(checkpoint.clone());
    streambp_train::sft::run_sft(&resumed).unwrap();

    // Other weights at the same path.
    let model = load_model(&base, DType::F32, &Device::Cpu).unwrap();
    let scaled: std::collections::HashMap<String, Tensor> = model
        .parameters()
        .iter()
        .map(|(name, var)| (name.clone(), (var.as_tensor() * 1.5).unwrap()))
        .collect();
    streambp_models::save_safetensors(&scaled, &base.join("model.safetensors")).unwrap();
    let mut changed = config(&root.path().join("c"), Recipe::Sft);
    changed.model = cfg.model.clone();
    changed.resume = Some(checkpoint);
    let err = streambp_train::sft::run_sft(&changed)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--model: \"weights: ") && err.contains("in the checkpoint's run"),
        "{err}"
    );
}
