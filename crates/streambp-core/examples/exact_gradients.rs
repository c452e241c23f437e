//! The exact gradients of one batch three ways — StreamBP (`stream`), per-layer gradient
//! checkpointing (`checkpoint`) and plain backprop (`full`) — side by side, then the memory
//! planner choosing chunks for a budget, and the same gradients with sparse checkpoints stored on
//! disk.
//!
//! ```sh
//! cargo run --release -p streambp-core --example exact_gradients [MODEL_DIR]
//! ```
//!
//! MODEL_DIR is any HF directory of a supported family (default: the repo's tiny Qwen3 fixture).
//! The model runs in f64, so the three modes agree to rounding (about 1e-15).

use candle_core::{DType, Device, Tensor};
use streambp_core::memory::CountingAllocator;
use streambp_core::{
    backward_with, estimate, plan_for_budget, Batch, CheckpointEvery, Chunks, Gradients, Mode,
    Options, Plan, Problem,
};
use streambp_models::load_model;
use streambp_objectives::Sft;

// Counts every heap byte, so that each backward reports its exact peak.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

fn main() -> anyhow::Result<()> {
    let dir = std::env::args().nth(1).map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3"),
        Into::into,
    );
    let device = Device::Cpu;
    let model = load_model(&dir, DType::F64, &device)?;
    let vocab = model.config.vocab_size;

    // One batch of two rows of 40 tokens; SFT on every token after the first.
    let (rows, t) = (2, 40);
    let ids: Vec<u32> = (0..rows * t)
        .map(|i| (i * 37 + 11) as u32 % vocab as u32)
        .collect();
    let labels: Vec<Vec<i64>> = ids
        .chunks(t)
        .map(|r| r.iter().map(|&v| v as i64).collect())
        .collect();
    let ids = Tensor::from_vec(ids, (rows, t), &device)?;
    let sft = Sft::new(&labels, vocab, None, &device)?;
    let batch = Batch::new(&ids, None);

    let run = |mode, chunks, options| -> anyhow::Result<Gradients> {
        Ok(backward_with(
            &model,
            batch,
            &sft,
            Plan::new(mode, chunks).with(options),
        )?)
    };
    // Chunks that divide nothing evenly: 7 query positions, 9 logits positions at a time.
    let chunks = Chunks {
        chunk: 7,
        logits_chunk: 9,
    };
    let full = run(Mode::Full, chunks, Options::default())?;
    println!(
        "{} ({} layers), {rows} x {t} tokens, f64",
        dir.display(),
        model.layers.len()
    );
    println!(
        "| mode | loss | largest gradient difference from full | peak heap (weights included) |"
    );
    println!("|---|---|---|---|");
    for mode in [Mode::Full, Mode::Checkpoint, Mode::Stream] {
        let out = run(mode, chunks, Options::default())?;
        println!(
            "| {mode} | {:.12} | {:.1e} | {:.2} MiB |",
            out.loss,
            largest_difference(&out, &full)?,
            out.phases.overall_peak().unwrap_or(0) as f64 / (1 << 20) as f64
        );
    }

    // The planner: the largest chunks whose estimated peak fits a budget, and its estimate.
    let problem = Problem::of(&model, rows, t, &Options::default());
    let budget = estimate(problem, chunks).peak() * 3 / 2;
    let planned = plan_for_budget(problem, budget)?;
    println!(
        "\nA budget of {:.2} MiB: chunk {}, logits chunk {} (estimated peak {:.2} MiB)",
        budget as f64 / (1 << 20) as f64,
        planned.chunk,
        planned.logits_chunk,
        estimate(problem, planned).peak() as f64 / (1 << 20) as f64
    );

    // One checkpoint per two layers, kept in a scratch file: the same gradients, bit for bit.
    let scratch = tempfile::tempdir()?;
    let sparse = Options {
        checkpoint_every: CheckpointEvery::Layers(2),
        checkpoint_dir: Some(scratch.path().into()),
        ..Options::default()
    };
    let stream = run(Mode::Stream, chunks, Options::default())?;
    let on_disk = run(Mode::Stream, chunks, sparse)?;
    println!(
        "Checkpoints every 2 layers, on disk: {} bytes written and read back, gradients {} those \
         kept in memory",
        on_disk.checkpoint_io.written,
        match largest_difference(&on_disk, &stream)? {
            0.0 => "identical to",
            _ => "different from",
        }
    );
    Ok(())
}

/// The largest relative difference between two gradient sets, tensor by tensor.
fn largest_difference(a: &Gradients, b: &Gradients) -> anyhow::Result<f64> {
    let mut worst = 0.0f64;
    for ((_, x), (_, y)) in a.grads.iter().zip(&b.grads) {
        let scale = y
            .abs()?
            .max_all()?
            .to_scalar::<f64>()?
            .max(f64::MIN_POSITIVE);
        let diff = (x - y)?.abs()?.max_all()?.to_scalar::<f64>()?;
        worst = worst.max(diff / scale);
    }
    Ok(worst)
}
