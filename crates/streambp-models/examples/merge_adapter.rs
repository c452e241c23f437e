//! Load a PEFT LoRA adapter onto its base model, merge it into the weights (`W + s·B·A`), and check
//! that the merged model computes what the adapter model does.
//!
//! With no arguments it uses the tiny Qwen3 fixture and the PEFT adapter written for it
//! (`tests/fixtures/qwen3` and `tests/fixtures/qwen3/lora`):
//!
//! ```sh
//! cargo run --release -p streambp-models --example merge_adapter
//! cargo run --release -p streambp-models --example merge_adapter -- BASE_DIR ADAPTER_DIR
//! ```

use std::path::PathBuf;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use streambp_models::adapter::load_adapter;
use streambp_models::{load_model, Model};

fn main() -> Result<()> {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let mut args = std::env::args().skip(1);
    let base_dir = args.next().map_or(fixtures.join("qwen3"), PathBuf::from);
    let adapter_dir = args
        .next()
        .map_or(fixtures.join("qwen3/lora"), PathBuf::from);

    let base = load_model(&base_dir, DType::F64, &Device::Cpu)?;
    let adapter = load_adapter(&adapter_dir, &Device::Cpu)?;
    let c = &adapter.config;
    println!(
        "adapter: r {}, alpha {}, rsLoRA {}, on {}",
        c.r,
        c.alpha,
        c.use_rslora,
        c.targets
            .iter()
            .map(|p| p.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let with_adapter = base
        .clone()
        .with_lora(adapter.config, Some(adapter.tensors), 0)?;
    let merged = Model::from_tensors(
        with_adapter.config.clone(),
        with_adapter.merged_weights()?.into_iter().collect(),
    )?;

    // Some tokens of the vocabulary, as one row.
    let vocab = merged.config.vocab_size as u32;
    let ids: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % vocab).collect();
    let ids = Tensor::new(ids.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
    let a = with_adapter.forward(&ids, None)?;
    let m = merged.forward(&ids, None)?;
    let b = base.forward(&ids, None)?;
    let largest = |t: Tensor| -> Result<f64> { Ok(t.abs()?.max_all()?.to_scalar::<f64>()?) };
    let scale = largest(a.clone())?;
    println!(
        "logits: the adapter moves them by {:.3e}; merged vs adapter differ by {:.1e} (relative)",
        largest((&a - &b)?)? / scale,
        largest((&a - &m)?)? / scale
    );
    Ok(())
}
