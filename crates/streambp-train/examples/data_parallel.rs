//! Data parallelism over the `Communicator` trait, with a backend of your own: two ranks as threads
//! of this process, each computing the exact streamed gradient of its half of a batch, summed by an
//! all-reduce. The result equals one process's gradient of the whole batch (f64, to rounding). The
//! trainer runs the same steps over MPI or NCCL (`streambp_dist::world`).
//!
//! ```sh
//! cargo run --release -p streambp-train --example data_parallel
//! ```

use std::path::Path;
use std::sync::{Arc, Barrier, Mutex};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use streambp_core::{backward, Chunks, Gradients, Mode};
use streambp_dist::Communicator;
use streambp_models::{Model, ModelConfig};
use streambp_objectives::Sft;
use streambp_train::batch::collate;
use streambp_train::data::{load_sft, Example, Overflow};
use streambp_train::dataset::DataSource;
use streambp_train::tokenizer::TextTokenizer;

/// Ranks as threads: each collective puts its rank's value in a slot, waits for the others, and
/// combines the slots in rank order (so every rank gets the same bits).
struct Threads {
    rank: usize,
    slots: Arc<Mutex<Vec<Option<Tensor>>>>,
    barrier: Arc<Barrier>,
}

impl Threads {
    /// Every rank's `x`, in rank order.
    fn exchange(&self, x: &Tensor) -> streambp_dist::Result<Vec<Tensor>> {
        self.slots.lock().unwrap()[self.rank] = Some(x.clone());
        self.barrier.wait();
        let all = self
            .slots
            .lock()
            .unwrap()
            .iter()
            .flatten()
            .cloned()
            .collect();
        self.barrier.wait();
        Ok(all)
    }
}

impl Communicator for Threads {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.slots.lock().unwrap().len()
    }
    fn all_reduce_sum(&self, x: &Tensor) -> streambp_dist::Result<Tensor> {
        let all = self.exchange(x)?;
        Ok(all[1..].iter().try_fold(all[0].clone(), |acc, t| acc + t)?)
    }
    fn reduce_scatter_sum(&self, x: &Tensor) -> streambp_dist::Result<Tensor> {
        let k = x.elem_count() / self.world_size();
        Ok(self
            .all_reduce_sum(&x.flatten_all()?)?
            .narrow(0, self.rank * k, k)?)
    }
    fn all_gather(&self, x: &Tensor) -> streambp_dist::Result<Tensor> {
        Ok(Tensor::cat(&self.exchange(x)?, 0)?)
    }
    fn sum(&self, x: f64) -> streambp_dist::Result<f64> {
        let t = self.all_reduce_sum(&Tensor::new(&[x], &Device::Cpu)?)?;
        Ok(t.to_vec1::<f64>()?[0])
    }
    fn broadcast(&self, x: u64) -> streambp_dist::Result<u64> {
        let all = self.exchange(&Tensor::new(&[x as f64], &Device::Cpu)?)?;
        Ok(all[0].to_vec1::<f64>()?[0] as u64)
    }
    fn barrier(&self) -> streambp_dist::Result<()> {
        self.barrier.wait();
        Ok(())
    }
    fn name(&self) -> &'static str {
        "threads"
    }
}

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
    let slots = Arc::new(Mutex::new(vec![None, None]));
    let barrier = Arc::new(Barrier::new(2));
    let per_rank: Vec<Vec<(String, Tensor)>> = std::thread::scope(|s| {
        let ranks: Vec<_> = batch
            .chunks(4)
            .enumerate()
            .map(|(rank, rows)| {
                let comm = Threads {
                    rank,
                    slots: slots.clone(),
                    barrier: barrier.clone(),
                };
                let model = &model;
                s.spawn(move || -> Result<Vec<(String, Tensor)>> {
                    let all_tokens = comm.sum(tokens(rows))?;
                    let out = gradients(model, rows, all_tokens)?;
                    out.grads
                        .iter()
                        .map(|(n, g)| Ok((n.clone(), comm.all_reduce_sum(g)?)))
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
