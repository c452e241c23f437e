//! Your own loss through the streamed backward: a token-weighted SFT (later tokens of a row count
//! more) written against `streambp_objectives::Objective`, run by `stream` and checked against the
//! plain `full` backward. The pattern to follow for any loss over target log-probabilities.
//!
//! ```sh
//! cargo run --release -p streambp-objectives --example custom_objective
//! ```

use std::ops::Range;

use candle_core::{DType, Device, Tensor};
use streambp_core::{backward, Batch, Chunks, Mode};
use streambp_models::load_model;
use streambp_objectives::{Objective, Result};

/// `−Σ w_t · log p(token_{t+1})` over the positions of each row, `w_t ∝ t + 1` normalised to sum to 1
/// over the batch: the later a token, the more its prediction counts.
struct PositionWeightedSft {
    /// `[batch, T]`: the token each logits position scores (the next input token; the last scores
    /// nothing and gets weight 0).
    targets: Tensor,
    /// `[batch, T]` weights, f64.
    weights: Tensor,
}

impl PositionWeightedSft {
    fn new(ids: &Tensor) -> Result<Self> {
        let (rows, t) = ids.dims2()?;
        let next = ids.narrow(1, 1, t - 1)?;
        let targets = Tensor::cat(
            &[&next, &Tensor::zeros((rows, 1), DType::U32, ids.device())?],
            1,
        )?;
        let raw: Vec<f64> = (0..rows * t)
            .map(|i| {
                if i % t == t - 1 {
                    0.0
                } else {
                    (i % t + 1) as f64
                }
            })
            .collect();
        let total: f64 = raw.iter().sum();
        let weights = Tensor::from_vec(raw, (rows, t), ids.device())?.affine(1.0 / total, 0.0)?;
        Ok(Self { targets, weights })
    }
}

impl Objective for PositionWeightedSft {
    fn name(&self) -> &str {
        "position-weighted-sft"
    }

    fn targets(&self) -> &Tensor {
        &self.targets
    }

    /// A sum of per-position terms: the engine may take it a logits chunk at a time.
    fn separable(&self) -> bool {
        true
    }

    /// The share of positions `cols` (a differentiable scalar in `logp`).
    fn loss(&self, logp: &Tensor, cols: Range<usize>) -> Result<Tensor> {
        let w = self
            .weights
            .narrow(1, cols.start, cols.len())?
            .to_dtype(logp.dtype())?;
        Ok((logp * w)?.sum_all()?.neg()?)
    }
}

fn main() -> anyhow::Result<()> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gemma3");
    let device = Device::Cpu;
    let model = load_model(&dir, DType::F64, &device)?;
    let vocab = model.config.vocab_size as u32;
    let (rows, t) = (3, 33);
    let ids: Vec<u32> = (0..(rows * t) as u32)
        .map(|i| (i * 53 + 5) % vocab)
        .collect();
    let ids = Tensor::from_vec(ids, (rows, t), &device)?;
    let objective = PositionWeightedSft::new(&ids)?;
    let batch = Batch::new(&ids, None);

    let full = backward(
        &model,
        batch,
        &objective,
        Mode::Full,
        Chunks {
            chunk: 1,
            logits_chunk: 1,
        },
    )?;
    let stream = backward(
        &model,
        batch,
        &objective,
        Mode::Stream,
        Chunks {
            chunk: 5,
            logits_chunk: 4,
        },
    )?;
    let mut worst = (0.0f64, "");
    for ((name, a), (_, b)) in stream.grads.iter().zip(&full.grads) {
        let scale = b
            .abs()?
            .max_all()?
            .to_scalar::<f64>()?
            .max(f64::MIN_POSITIVE);
        let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f64>()? / scale;
        if diff > worst.0 {
            worst = (diff, name);
        }
    }
    let (worst, name) = worst;
    println!(
        "{} on gemma3 (sliding windows), {rows} x {t} tokens: loss {:.12} streamed, {:.12} full; \
         largest gradient difference {worst:.1e} ({name})",
        objective.name(),
        stream.loss,
        full.loss
    );
    anyhow::ensure!(
        worst < 1e-10,
        "the streamed gradients are off by {worst:.1e}"
    );
    Ok(())
}
