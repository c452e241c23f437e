//! Times decoding with the KV cache on a random model of a given config, f32 and bf16 alternated
//! twice: a prompt of `prompt` tokens for each of `rows` rows, then `steps` steps of one new token per row
//! (greedy), as GRPO's sampling runs them, and the KV cache's size at the end. Weights are random;
//! nothing is downloaded.
//!
//! `cargo run --release -p streambp-models --example decode_speed [config.json] [rows] [steps] [prompt]`
//! (default `benches/configs/qwen3-small.json`, 8 rows, 64 steps, a prompt of 64).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, D};
use streambp_models::decode::KvCache;
use streambp_models::{Model, ModelConfig};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let config = args.next().map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../benches/configs/qwen3-small.json")
    });
    let mut count = |default: usize| -> Result<usize> {
        Ok(match args.next() {
            Some(n) => n.parse()?,
            None => default,
        })
    };
    let (rows, steps, prompt_len) = (count(8)?, count(64)?, count(64)?);
    let config = ModelConfig::from_file(&config)?;
    let vocab = config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..rows)
        .map(|r| {
            (0..prompt_len as u32)
                .map(|i| (i * 7 + r as u32) % vocab)
                .collect()
        })
        .collect();
    let prompts: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    for dtype in [DType::F32, DType::BF16, DType::F32, DType::BF16] {
        let model = Model::random(config.clone(), dtype, &Device::Cpu, 1)?.detached();
        let started = Instant::now();
        let (mut cache, ids) = KvCache::left_padded(&model, &prompts, 0, steps)?;
        let mut logits = cache.step(&model, &ids)?;
        let prompt = started.elapsed().as_secs_f64();
        let started = Instant::now();
        for _ in 0..steps {
            let next = logits.to_dtype(DType::F32)?.argmax(D::Minus1)?;
            logits = cache.step(&model, &next.unsqueeze(1)?)?;
        }
        let step = started.elapsed().as_secs_f64() / steps as f64;
        println!(
            "{}: {rows} rows, prompt of {prompt_len} {prompt:.3} s, then {:.1} ms per new token; \
             KV cache {:.1} MiB",
            dtype.as_str(),
            step * 1e3,
            cache.bytes() as f64 / (1 << 20) as f64
        );
    }
    Ok(())
}
