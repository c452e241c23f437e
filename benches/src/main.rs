//! `streambp-bench`: one backward per (mode, T) on a random model built from a config, reporting peak
//! host bytes per phase (exact, counting allocator) and seconds, with every mode measured side by side
//! in one process.
//!
//! `cargo run --release -p streambp-bench -- --config benches/configs/qwen3-small.json --seq-lens 1024,2048`

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use streambp_core::memory::{current_bytes, CountingAllocator};
use streambp_core::{backward, Batch, Chunks, Mode};
use streambp_models::{Model, ModelConfig};
use streambp_objectives::Sft;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[derive(Parser)]
#[command(about = "StreamBP vs gradient checkpointing vs full backprop: memory and time")]
struct Args {
    /// Model config.json (weights are random; nothing is downloaded).
    #[arg(long)]
    config: PathBuf,
    /// Sequence lengths, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048")]
    seq_lens: Vec<usize>,
    /// Modes, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "stream,checkpoint,full")]
    modes: Vec<Mode>,
    /// Query chunk of the streamed backward; default T/3 (the paper's timing setting).
    #[arg(long)]
    chunk: Option<usize>,
    /// LM-head chunk (the paper: 100).
    #[arg(long, default_value_t = 100)]
    logits_chunk: usize,
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Timed repetitions per point (the fastest is reported).
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// Write the results as JSON lines here too.
    #[arg(long)]
    json: Option<PathBuf>,
}

struct Point {
    mode: Mode,
    t: usize,
    peak: usize,
    phases: Vec<(&'static str, usize, f64)>,
    seconds: f64,
    loss: f64,
}

fn run(
    model: &Model,
    mode: Mode,
    t: usize,
    chunks: Chunks,
    repeats: usize,
) -> anyhow::Result<Point> {
    let vocab = model.config.vocab_size as u32;
    let ids: Vec<u32> = (0..t as u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 7) % vocab)
        .collect();
    let labels = vec![ids.iter().map(|&v| v as i64).collect::<Vec<_>>()];
    let ids = Tensor::from_vec(ids, (1, t), &Device::Cpu)?;
    let sft = Sft::new(&labels, vocab as usize, None, &Device::Cpu)?;
    let mut best: Option<Point> = None;
    for _ in 0..repeats.max(1) {
        let before = current_bytes().unwrap_or(0);
        let start = Instant::now();
        let out = backward(
            model,
            Batch {
                input_ids: &ids,
                attention_mask: None,
            },
            &sft,
            mode,
            chunks,
        )?;
        let seconds = start.elapsed().as_secs_f64();
        let phases: Vec<_> = out
            .phases
            .phases
            .iter()
            .map(|p| {
                (
                    p.name,
                    p.peak_bytes.unwrap_or(0).saturating_sub(before),
                    p.seconds,
                )
            })
            .collect();
        let peak = phases.iter().map(|(_, b, _)| *b).max().unwrap_or(0);
        if best.as_ref().is_none_or(|b| seconds < b.seconds) {
            best = Some(Point {
                mode,
                t,
                peak,
                phases,
                seconds,
                loss: out.loss,
            });
        }
    }
    best.context("no run")
}

fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dtype = match args.dtype.as_str() {
        "f32" => DType::F32,
        "f64" => DType::F64,
        "bf16" => DType::BF16,
        other => bail!("unknown dtype {other}"),
    };
    let cfg = ModelConfig::from_file(&args.config)?;
    let model = Model::random(cfg, dtype, &Device::Cpu, 0)?;
    let params: usize = model.parameters().iter().map(|(_, v)| v.elem_count()).sum();
    println!(
        "model {} ({:.1}M parameters, {} layers), dtype {dtype:?}, logits chunk {}",
        args.config.display(),
        params as f64 / 1e6,
        model.layers.len(),
        args.logits_chunk
    );
    // Warm-up: first-touch costs (thread pools, page faults) out of the timings.
    let warm = Chunks {
        chunk: 64,
        logits_chunk: 64,
    };
    run(&model, Mode::Stream, 128, warm, 1)?;

    let mut points = Vec::new();
    for &t in &args.seq_lens {
        let chunks = Chunks {
            chunk: args.chunk.unwrap_or(t.div_ceil(3)),
            logits_chunk: args.logits_chunk,
        };
        for &mode in &args.modes {
            let p = run(&model, mode, t, chunks, args.repeats)?;
            eprintln!(
                "T={t} {mode}: peak {:.1} MiB, {:.3} s",
                mib(p.peak),
                p.seconds
            );
            points.push((p, chunks));
        }
    }

    println!();
    println!("| T | mode | chunk | activation peak (MiB) | vs checkpoint | vs full | seconds | vs checkpoint |");
    println!("|---|---|---|---|---|---|---|---|");
    for (p, chunks) in &points {
        let same_t = |m: Mode| {
            points
                .iter()
                .map(|(q, _)| q)
                .find(|q| q.t == p.t && q.mode == m)
        };
        let ratio = |other: Option<&Point>, f: &dyn Fn(&Point) -> f64| {
            other
                .map(|o| format!("{:.3}", f(p) / f(o)))
                .unwrap_or_else(|| "-".into())
        };
        println!(
            "| {} | {} | {} | {:.1} | {} | {} | {:.3} | {} |",
            p.t,
            p.mode,
            if p.mode == Mode::Stream {
                chunks.chunk.to_string()
            } else {
                "-".into()
            },
            mib(p.peak),
            ratio(same_t(Mode::Checkpoint), &|x| x.peak as f64),
            ratio(same_t(Mode::Full), &|x| x.peak as f64),
            p.seconds,
            ratio(same_t(Mode::Checkpoint), &|x| x.seconds),
        );
    }
    if let Some(path) = &args.json {
        let lines: Vec<String> = points
            .iter()
            .map(|(p, c)| {
                serde_json::json!({
                    "t": p.t, "mode": p.mode.to_string(), "chunk": c.chunk, "logits_chunk": c.logits_chunk,
                    "peak_bytes": p.peak, "seconds": p.seconds, "loss": p.loss,
                    "phases": p.phases.iter().map(|(n, b, s)| serde_json::json!({"phase": n, "peak_bytes": b, "seconds": s})).collect::<Vec<_>>(),
                })
                .to_string()
            })
            .collect();
        std::fs::write(path, lines.join("\n") + "\n")?;
    }
    Ok(())
}
