//! Load a model from a Hugging Face directory, print its shape, and continue a prompt greedily with
//! the KV cache.
//!
//! With no arguments it loads the model the repo ships (the arithmetic task's SFT checkpoint,
//! `assets/arithmetic`) and asks it `12+34=`:
//!
//! ```sh
//! cargo run --release -p streambp-models --example generate
//! cargo run --release -p streambp-models --example generate -- Qwen/Qwen3-0.6B "The capital of France is"
//! ```
//!
//! The first argument may be any local HF directory or hub id of the four families; the second is
//! the prompt.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use streambp_models::{decode, load_model, resolve_model_dir};
use tokenizers::Tokenizer;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let scratch = tempfile::tempdir()?;
    let dir = match args.next() {
        Some(spec) => resolve_model_dir(&spec)?,
        None => shipped_model(scratch.path())?,
    };
    let prompt = args.next().unwrap_or_else(|| "12+34=".to_string());

    let model = load_model(&dir, DType::F32, &Device::Cpu)?;
    let c = &model.config;
    let parameters: usize = model.weights().iter().map(|(_, t)| t.elem_count()).sum();
    println!(
        "{:?}: {} layers, hidden {}, {} heads ({} key/value heads of {}), vocabulary {}, {:.1}M parameters",
        c.family,
        c.num_layers(),
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
        parameters as f64 / 1e6
    );

    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
    let ids = tokenizer
        .encode(prompt.as_str(), false)
        .map_err(anyhow::Error::msg)?
        .get_ids()
        .to_vec();
    let eos = eos_id(&dir, &tokenizer).unwrap_or(u32::MAX);
    let started = std::time::Instant::now();
    let out = decode::greedy(&model, &ids, eos, 32)?;
    let text = tokenizer.decode(&out, true).map_err(anyhow::Error::msg)?;
    println!("{prompt}{text}");
    println!(
        "{} tokens in {:.3} s",
        out.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The shipped arithmetic model as an HF directory: its config, tokenizer and weights.
fn shipped_model(into: &Path) -> Result<PathBuf> {
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/arithmetic");
    for (from, to) in [
        ("config.json", "config.json"),
        ("tokenizer.json", "tokenizer.json"),
        ("tokenizer_config.json", "tokenizer_config.json"),
        ("sft-model.safetensors", "model.safetensors"),
    ] {
        std::fs::copy(assets.join(from), into.join(to))
            .with_context(|| format!("copying {}", assets.join(from).display()))?;
    }
    Ok(into.to_path_buf())
}

/// The end-of-sequence token: `tokenizer_config.json`'s `eos_token`, looked up in the vocabulary.
fn eos_id(dir: &Path, tokenizer: &Tokenizer) -> Option<u32> {
    let text = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?;
    let config: serde_json::Value = serde_json::from_str(&text).ok()?;
    let eos = match &config["eos_token"] {
        serde_json::Value::String(s) => s.clone(),
        other => other["content"].as_str()?.to_string(),
    };
    tokenizer.token_to_id(&eos)
}
