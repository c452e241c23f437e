//! `--predict`: the planner's cost-model estimate of stream's peak per phase at each T, printed as a
//! table without building the model.

use candle_core::DType;
use streambp_core::{estimate, CheckpointPlace, Chunks, Problem};
use streambp_models::ModelConfig;

use crate::args::{chunk_policy, problem, Args};

/// `--predict`: the cost model's view of stream at each T, without building the model.
pub(crate) fn predict(cfg: &ModelConfig, dtype: DType, args: &Args) -> anyhow::Result<()> {
    // GiB for models of a card's size, MiB for the small ones.
    let lora = args.lora.config()?;
    let weights = estimate(
        problem(cfg, dtype, args, 1, lora.as_ref()),
        Chunks {
            chunk: 1,
            logits_chunk: 1,
        },
    )
    .resident;
    let (unit, scale) = match weights >= 1 << 30 {
        true => ("GiB", (1u64 << 30) as f64),
        false => ("MiB", (1u64 << 20) as f64),
    };
    let in_unit = |b: u64| b as f64 / scale;
    println!();
    println!("Cost-model estimate of stream's peak (not a measurement):");
    println!("| T | chunk | logits chunk | layers per checkpoint | weights, rope, gemm slabs ({unit}) | head phase (with its gradients) | layer phase (with all gradients) | embedding phase | peak ({unit}) | stored checkpoints ({unit}) | where |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for &t in &args.seq_lens {
        let p = problem(cfg, dtype, args, t, lora.as_ref());
        let planned = match chunk_policy(args, t).plan_for(p) {
            Ok(planned) => planned,
            Err(e) => {
                println!("| {t} | - | - | - | - | - | - | - | {e} | - | - |");
                continue;
            }
        };
        let chunks = planned.chunks;
        // Where the stored checkpoints are: the plan's choice under a budget, else the flags'.
        let place = planned.place.unwrap_or(match p.offloaded {
            true if args.checkpoint_dir.is_some() => CheckpointPlace::Disk,
            true => CheckpointPlace::Host,
            false => CheckpointPlace::Device,
        });
        let est = estimate(
            Problem {
                checkpoint_every: planned.checkpoint_every,
                offloaded: place != CheckpointPlace::Device,
                ..p
            },
            chunks,
        );
        let place = match place {
            CheckpointPlace::Device => "on the device (in the peak)",
            CheckpointPlace::Host => "host memory",
            CheckpointPlace::Disk => "disk",
        };
        let stored = cfg.num_layers().div_ceil(planned.checkpoint_every)
            * p.batch
            * t
            * cfg.hidden_size
            * dtype.size_in_bytes();
        println!(
            "| {t} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {place} |",
            chunks.chunk,
            chunks.logits_chunk,
            planned.checkpoint_every,
            in_unit(est.resident),
            in_unit(est.head_phase),
            in_unit(est.layer_phase),
            in_unit(est.embedding_phase),
            in_unit(est.peak()),
            in_unit(stored as u64)
        );
    }
    Ok(())
}
