//! Target tokens from HF-style labels: logits at `t` predict `labels[t + 1]`, `-100` is ignored.

use candle_core::{Device, Tensor};

use crate::{ObjectiveError, Result};

/// The label value that marks a position as not trained on.
pub const IGNORE_INDEX: i64 = -100;

/// Shifted targets and their mask, in logits coordinates.
#[derive(Debug, Clone)]
pub struct TokenTargets {
    /// `[batch, T]` u32 (0 where there is no target).
    pub ids: Tensor,
    /// `[batch, T]` f64, 1 where there is a target.
    pub mask: Tensor,
    /// Targets per row.
    pub counts: Vec<usize>,
}

impl TokenTargets {
    /// From HF-style labels `[batch][T]` aligned with input_ids; errors on empty or ragged rows or on
    /// a label outside `vocab_size`.
    pub fn from_labels(labels: &[Vec<i64>], vocab_size: usize, device: &Device) -> Result<Self> {
        let b = labels.len();
        let t = labels.first().map(Vec::len).unwrap_or(0);
        if b == 0 || t == 0 {
            return Err(ObjectiveError::Batch("empty labels".into()));
        }
        let mut ids = vec![0u32; b * t];
        let mut mask = vec![0f64; b * t];
        let mut counts = vec![0usize; b];
        for (row, labels_row) in labels.iter().enumerate() {
            if labels_row.len() != t {
                return Err(ObjectiveError::Batch(format!(
                    "labels row {row} has {} entries, row 0 has {t}",
                    labels_row.len()
                )));
            }
            for pos in 0..t - 1 {
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
                ids[row * t + pos] = label as u32;
                mask[row * t + pos] = 1.0;
                counts[row] += 1;
            }
        }
        Ok(Self {
            ids: Tensor::from_vec(ids, (b, t), device)?,
            mask: Tensor::from_vec(mask, (b, t), device)?,
            counts,
        })
    }

    /// Rows with no target token.
    pub fn rows_without_target(&self) -> Vec<usize> {
        self.counts
            .iter()
            .enumerate()
            .filter(|(_, &c)| c == 0)
            .map(|(i, _)| i)
            .collect()
    }

    /// Target tokens in the batch.
    pub fn total(&self) -> usize {
        self.counts.iter().sum()
    }
}
