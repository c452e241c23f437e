//! Supervised fine-tuning: token cross entropy with transformers' conventions. Labels are aligned with
//! `input_ids` and shifted here (logits at `t` predict `labels[t + 1]`), `-100` is ignored, and the loss
//! is the mean over all target tokens of the batch, or over a normaliser given from outside (gradient
//! accumulation divides by the tokens of all accumulated micro-batches).

use std::ops::Range;

use candle_core::{Device, Tensor};

use crate::{Objective, ObjectiveError, Result};

/// The label value that marks a position as not trained on.
pub const IGNORE_INDEX: i64 = -100;

#[derive(Debug, Clone)]
pub struct Sft {
    targets: Tensor,
    /// `[batch, T]`: `1 / normaliser` where a target exists, else 0 (in the loss dtype, set lazily).
    weights: Tensor,
    target_tokens: usize,
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
        let b = labels.len();
        let t = labels.first().map(Vec::len).unwrap_or(0);
        if b == 0 || t == 0 {
            return Err(ObjectiveError::Batch("empty labels".into()));
        }
        let mut targets = vec![0u32; b * t];
        let mut mask = vec![0f64; b * t];
        let mut count = 0usize;
        for (row, labels_row) in labels.iter().enumerate() {
            if labels_row.len() != t {
                return Err(ObjectiveError::Batch(format!(
                    "labels row {row} has {} entries, row 0 has {t}",
                    labels_row.len()
                )));
            }
            for pos in 0..t.saturating_sub(1) {
                let label = labels_row[pos + 1];
                if label == IGNORE_INDEX {
                    continue;
                }
                if label < 0 || label as usize >= vocab_size {
                    return Err(ObjectiveError::Batch(format!(
                        "label {label} at row {row}, position {} is outside the vocabulary (size {vocab_size})",
                        pos + 1
                    )));
                }
                targets[row * t + pos] = label as u32;
                mask[row * t + pos] = 1.0;
                count += 1;
            }
        }
        if count == 0 {
            return Err(ObjectiveError::Batch(
                "no target token: every label after the first position is -100".into(),
            ));
        }
        let norm = normaliser.unwrap_or(count as f64);
        let weights: Vec<f64> = mask.iter().map(|m| m / norm).collect();
        Ok(Self {
            targets: Tensor::from_vec(targets, (b, t), device)?,
            weights: Tensor::from_vec(weights, (b, t), device)?,
            target_tokens: count,
        })
    }

    /// Number of target tokens in this batch.
    pub fn target_tokens(&self) -> usize {
        self.target_tokens
    }
}

impl Objective for Sft {
    fn name(&self) -> &str {
        "sft"
    }

    fn targets(&self) -> &Tensor {
        &self.targets
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
