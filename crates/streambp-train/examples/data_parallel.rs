//! Data parallelism over the `Communicator` trait: two ranks as threads of this process
//! (`streambp_dist::local::LocalGroup`), each computing the exact streamed gradient of its half of a
//! batch, summed by an all-reduce. The result equals one process's gradient of the whole batch (f64, to rounding). The
//! trainer runs the same steps over MPI or NCCL (`streambp_dist::world`).
//!
//! ```sh
//! cargo run --release -p streambp-train --example data_parallel
//! ```

use std::path::Path;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use streambp_core::{backward, Chunks, Gradients, Mode};
use streambp_dist::local::LocalGroup;
use streambp_dist::Communicator;
use streambp_models::{Model, ModelConfig};
use streambp_objectives::Sft;
use streambp_train::batch::collate;
use streambp_train::data::{load_sft, Example, Overflow};
use streambp_train::dataset::DataSource;
use streambp_train::tokenizer::TextTokenizer;

/// The SFT gradient of `rows`, its token mean taken over `tokens` (the whole batch's).
fn gradients(model: &Model, rows: &[Example], tokens: f64) -> Result<Gradients> {
    let collated = collate(&rows.iter().collect::<Vec<_>>(), 0);
    let tensors = collated.tensors(&Device::Cpu)?;
    let sft = Sft::new(
        &collated.labels,
        model.config.vocab_size,
        Some(tokens),
        &Device::Cpu,
    )?;
    let chunks = Chunks {
        chunk: 4,
        logits_chunk: 4,
    };
    Ok(backward(
        model,
        tensors.batch(),
        &sft,
        Mode::Stream,
        chunks,
    )?)
}

fn main() -> Result<()> {
    let task = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/arithmetic");
    let model = Model::random(
        ModelConfig::from_file(&task.join("config.json"))?,
        DType::F64,
        &Device::Cpu,
        7,
    )?;
    let tokenizer = TextTokenizer::from_dir(&task)?;
    let source = DataSource::file(&task.join("train.jsonl"))?;
    let batch: Vec<Example> = load_sft(&source, &tokenizer, 16, Overflow::Truncate, "text")?
        .into_iter()
        .take(8)
        .collect();

    // One process, the whole batch.
    let tokens = |rows: &[Example]| rows.iter().map(Example::targets).sum::<usize>() as f64;
    let whole = gradients(&model, &batch, tokens(&batch))?;

    // Two ranks, half the batch each: the token count and the gradients summed over the ranks.
    let ranks = LocalGroup::new(2);
    let per_rank: Vec<Vec<(String, Tensor)>> = std::thread::scope(|s| {
        let ranks: Vec<_> = batch
            .chunks(4)
            .zip(&ranks)
            .map(|(rows, comm)| {
                let model = &model;
                s.spawn(move || -> Result<Vec<(String, Tensor)>> {
                    let all_tokens = comm.sum(tokens(rows))?;
                    let out = gradients(model, rows, all_tokens)?;
                    out.grads
                        .iter()
                        .map(|(n, g)| {
                            let sum = comm.all_reduce_sum(&g.flatten_all()?)?;
                            Ok((n.clone(), sum.reshape(g.shape())?))
                        })
                        .collect()
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|r| r.join().unwrap())
            .collect::<Result<_>>()
    })?;
    let mut worst = 0.0f64;
    for ((_, g), (_, reduced)) in whole.grads.iter().zip(&per_rank[0]) {
        let diff = (g - reduced)?.abs()?.max_all()?.to_scalar::<f64>()?;
        let scale = g.abs()?.max_all()?.to_scalar::<f64>()?.max(1e-300);
        worst = worst.max(diff / scale);
    }
    println!(
        "{} parameters: two ranks' all-reduced gradients vs one process's: worst relative difference {worst:.1e}",
        whole.grads.len()
    );
    Ok(())
}
