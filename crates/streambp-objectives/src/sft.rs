//! Supervised fine-tuning: token cross entropy with transformers' conventions. Labels are aligned with
//! `input_ids` and shifted here (logits at `t` predict `labels[t + 1]`), `-100` is ignored, and the loss
//! is the mean over all target tokens of the batch, or over a normaliser given from outside (gradient
//! accumulation divides by the tokens of all accumulated micro-batches).

use std::ops::Range;

use candle_core::{Device, Tensor};

use crate::{Objective, ObjectiveError, Result, TokenTargets};

pub use crate::targets::IGNORE_INDEX;

/// The SFT cross-entropy objective of one batch.
#[derive(Debug, Clone)]
pub struct Sft {
    targets: TokenTargets,
    /// `[batch, T]`: `1 / normaliser` where a target exists, else 0.
    weights: Tensor,
}

impl Sft {
    /// From HF-style labels (`[batch][T]`, `-100` ignored). `normaliser`: divide the summed token losses
    /// by this instead of by the batch's own target count.
    pub fn new(
        labels: &[Vec<i64>],
        vocab_size: usize,
        normaliser: Option<f64>,
        device: &Device,
    ) -> Result<Self> {
        let targets = TokenTargets::from_labels(labels, vocab_size, device)?;
        if targets.total() == 0 {
            return Err(ObjectiveError::Batch(
                "no target token: every label after the first position is -100".into(),
            ));
        }
        let norm = normaliser.unwrap_or(targets.total() as f64);
        let weights = (&targets.mask / norm)?;
        Ok(Self { targets, weights })
    }

    /// Number of target tokens in this batch.
    pub fn target_tokens(&self) -> usize {
        self.targets.total()
    }
}

impl Objective for Sft {
    fn name(&self) -> &str {
        "sft"
    }

    fn targets(&self) -> &Tensor {
        &self.targets.ids
    }

    fn separable(&self) -> bool {
        true
    }

    fn loss(&self, logp: &Tensor, cols: Range<usize>) -> Result<Tensor> {
        let w = self
            .weights
            .narrow(1, cols.start, cols.len())?
            .to_dtype(logp.dtype())?;
        Ok((logp * w)?.sum_all()?.neg()?)
    }
}
