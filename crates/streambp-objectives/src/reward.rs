//! A Bradley-Terry reward model as TRL's `RewardTrainer` trains one: the model's head gives each
//! position a score (a `*ForSequenceClassification` head with one label), a row's reward is the
//! score at its last token as transformers pools it ([`pooled_positions`]), and over the pairs
//!
//! `loss = −mean log σ(r_c − r_r − m) + c · mean (r_c + r_r)²`
//!
//! with the pair's optional margin `m` and the optional `center_rewards_coefficient` `c`. Rows are
//! laid out as DPO's, `[chosen…, rejected…]`. The engine hands the objective the per-position
//! scores where a language model's objective gets target log-probs.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};

use crate::checks::{check_all_positions, check_finite};
use crate::dpo_loss::log_sigmoid;
use crate::{Objective, ObjectiveError, Result};

/// The position transformers' sequence classifiers read each row at: the rightmost one whose token
/// is not `pad_id` (position 0 when every token is), whatever the attention mask says.
pub fn pooled_positions(input_ids: &[Vec<i64>], pad_id: u32) -> Vec<usize> {
    input_ids
        .iter()
        .map(|row| {
            row.iter()
                .rposition(|&id| id != i64::from(pad_id))
                .unwrap_or(0)
        })
        .collect()
}

/// The reward-model objective of one batch of preference pairs.
#[derive(Debug, Clone)]
pub struct RewardModel {
    pairs: usize,
    /// `[2P, 1]` u32: where each row's reward is read.
    pooled: Tensor,
    /// `[P]`: each pair's margin (zeros without one).
    margin: Tensor,
    /// TRL's `center_rewards_coefficient`.
    center: Option<f64>,
    /// `[2P, T]` u32 zeros: a score head reads no target token.
    targets: Tensor,
}

impl RewardModel {
    /// The `2P` rows (chosen first) of length `seq_len`, each read at `pooled[i]`.
    pub fn new(pooled: &[usize], seq_len: usize, device: &Device) -> Result<Self> {
        if pooled.is_empty() || !pooled.len().is_multiple_of(2) {
            return Err(ObjectiveError::Batch(format!(
                "{} rows: expected 2P rows (P chosen, then P rejected)",
                pooled.len()
            )));
        }
        if let Some(&p) = pooled.iter().find(|&&p| p >= seq_len) {
            return Err(ObjectiveError::Batch(format!(
                "a reward read at position {p} of rows of {seq_len} tokens"
            )));
        }
        let rows = pooled.len();
        let index: Vec<u32> = pooled.iter().map(|&p| p as u32).collect();
        Ok(Self {
            pairs: rows / 2,
            pooled: Tensor::from_vec(index, (rows, 1), device)?,
            margin: Tensor::zeros(rows / 2, DType::F64, device)?,
            center: None,
            targets: Tensor::zeros((rows, seq_len), DType::U32, device)?,
        })
    }

    /// Each pair's margin `m` (TRL's `margin` column): the chosen reward must beat the rejected by it.
    pub fn with_margins(mut self, margins: &[f64]) -> Result<Self> {
        if margins.len() != self.pairs {
            return Err(ObjectiveError::Batch(format!(
                "{} margins for {} pairs",
                margins.len(),
                self.pairs
            )));
        }
        check_finite("margin", margins)?;
        self.margin = Tensor::from_vec(margins.to_vec(), self.pairs, self.margin.device())?;
        Ok(self)
    }

    /// Adds `coefficient × mean (r_c + r_r)²` (TRL's `center_rewards_coefficient`), which keeps the
    /// rewards centred on 0.
    pub fn with_center(mut self, coefficient: f64) -> Result<Self> {
        if !coefficient.is_finite() || coefficient < 0.0 {
            return Err(ObjectiveError::Loss(format!(
                "center_rewards_coefficient must be a number at least 0, got {coefficient}"
            )));
        }
        self.center = Some(coefficient);
        Ok(self)
    }

    /// The `[2P]` rewards from the per-position scores.
    fn rewards(&self, scores: &Tensor) -> Result<Tensor> {
        Ok(scores.gather(&self.pooled, 1)?.squeeze(1)?)
    }
}

impl Objective for RewardModel {
    fn name(&self) -> &str {
        "reward"
    }

    fn targets(&self) -> &Tensor {
        &self.targets
    }

    fn separable(&self) -> bool {
        false
    }

    fn loss(&self, scores: &Tensor, cols: Range<usize>) -> Result<Tensor> {
        check_all_positions("the reward model", &cols, &self.targets)?;
        let rewards = self.rewards(scores)?;
        let p = self.pairs;
        let (chosen, rejected) = (rewards.narrow(0, 0, p)?, rewards.narrow(0, p, p)?);
        let margin = self.margin.to_dtype(scores.dtype())?;
        let z = ((&chosen - &rejected)? - margin)?;
        let loss = log_sigmoid(&z)?.mean_all()?.neg()?;
        Ok(match self.center {
            Some(c) => (loss + ((chosen + rejected)?.sqr()?.mean_all()? * c)?)?,
            None => loss,
        })
    }

    fn metrics(&self, scores: &Tensor) -> Result<Vec<(String, f64)>> {
        let rewards = self
            .rewards(scores)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        let (chosen, rejected) = rewards.split_at(self.pairs);
        let p = self.pairs as f64;
        let margins: Vec<f64> = chosen.iter().zip(rejected).map(|(c, r)| c - r).collect();
        let n = rewards.len() as f64;
        Ok(vec![
            (
                "min_reward".into(),
                rewards.iter().copied().fold(f64::INFINITY, f64::min),
            ),
            ("mean_reward".into(), rewards.iter().sum::<f64>() / n),
            (
                "max_reward".into(),
                rewards.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            ),
            (
                "accuracy".into(),
                margins.iter().filter(|m| **m > 0.0).count() as f64 / p,
            ),
            ("margin".into(), margins.iter().sum::<f64>() / p),
        ])
    }
}
