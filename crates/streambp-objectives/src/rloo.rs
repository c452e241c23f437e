//! RLOO as TRL 1.16's `RLOOTrainer` computes it: REINFORCE with a leave-one-out baseline over each
//! prompt's `G` completions, and PPO's clip on one ratio per completion.
//!
//! The KL to the reference enters the reward, not the loss (`_generate_and_score_completions`):
//! `R_i = r_i − β·Σ_t m_t (π_old − ρ)`, the first-order estimate summed over the completion;
//! `A_i = R_i − (Σ_group R − R_i)/(G − 1)`, and with `normalize_advantages`
//! `(A − mean A)/(std A + 1e-4)` over the batch (std unbiased). With one ratio per completion,
//! `w_i = e^{Σ m π − Σ m π_old}`, the loss (`_compute_loss`) is the mean over rows of
//! `−min(w·A, clip(w, 1 − ε_low, 1 + ε_high)·A)`. Without old log-probs `π_old = π` detached (the
//! KL then reads the current policy too). A row's ratio needs all its tokens: the loss is not
//! separable.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};

use crate::rollouts::{bad, check_policy_settings, Rollouts};
use crate::{Objective, ObjectiveError, Result};

/// An RLOO batch: groups of completions of one prompt each, with their rewards.
#[derive(Debug, Clone)]
pub struct RlooBatch<'a> {
    /// The completions (rows `[gG, (g+1)G)` share a prompt) and the log-probs that scored them; the
    /// reference's are required when `beta` is not 0.
    pub rollouts: Rollouts<'a>,
    /// `[B]`: each completion's reward (the reward functions' weighted sum).
    pub rewards: &'a [f64],
    /// `G`, completions per prompt (at least 2, dividing the batch).
    pub num_generations: usize,
    /// Weight of the KL penalty in the reward (TRL: 0.05).
    pub beta: f64,
    /// The ratio is clipped below at `1 − epsilon_low`.
    pub epsilon_low: f64,
    /// The ratio is clipped above at `1 + epsilon_high`.
    pub epsilon_high: f64,
    /// Normalise the advantages over the batch (TRL's `normalize_advantages`, default false).
    pub normalize_advantages: bool,
    /// The temperature the completions were sampled at: log-probs from `logits / temperature`.
    pub temperature: f64,
}

/// The RLOO objective of one batch, built from an [`RlooBatch`].
#[derive(Debug, Clone)]
pub struct Rloo {
    /// `[B, T]` in logits coordinates.
    targets: Tensor,
    /// `[B, T]` u8 completion mask in logits coordinates.
    mask: Tensor,
    old: Option<Tensor>,
    reference: Option<Tensor>,
    advantages: Advantages,
    epsilon_low: f64,
    epsilon_high: f64,
    temperature: f64,
}

/// Where an [`Rloo`]'s advantages come from.
#[derive(Debug, Clone)]
enum Advantages {
    /// The batch is the whole generation batch: computed from its rewards at the loss (where the
    /// KL may read the current policy).
    FromRewards {
        rewards: Vec<f64>,
        num_generations: usize,
        beta: f64,
        normalize: bool,
    },
    /// Computed where the completions were drawn, over the whole generation batch (a trainer's
    /// micro-batch is part of it).
    Given(Vec<f64>),
}

impl Rloo {
    /// Checks `batch` (shapes, ids inside `vocab_size`, masks, finite values, whole groups, the
    /// reference `beta` needs, the ranges of its settings) and moves it to `device`.
    pub fn new(batch: &RlooBatch, vocab_size: usize, device: &Device) -> Result<Self> {
        let rollouts = &batch.rollouts;
        let ((rows, _), _) = rollouts.check(&[("rewards", batch.rewards.len())], vocab_size)?;
        if let Some(r) = batch.rewards.iter().find(|r| !r.is_finite()) {
            return Err(bad(format!("reward {r} is not finite")));
        }
        let g = batch.num_generations;
        if g < 2 || !rows.is_multiple_of(g) {
            return Err(bad(format!(
                "num_generations {g} must be at least 2 and divide the batch's {rows} completions"
            )));
        }
        check_policy_settings(
            (batch.beta, rollouts.ref_logps.is_some()),
            (batch.epsilon_low, batch.epsilon_high),
            batch.temperature,
        )?;
        let per_pos = |a: Option<&[Vec<f64>]>| a.map(|a| Rollouts::per_position(a, device));
        Ok(Self {
            targets: rollouts.targets(device)?,
            mask: rollouts.mask(device)?,
            old: per_pos(rollouts.old_logps).transpose()?,
            reference: match batch.beta != 0.0 {
                true => per_pos(rollouts.ref_logps).transpose()?,
                false => None,
            },
            advantages: Advantages::FromRewards {
                rewards: batch.rewards.to_vec(),
                num_generations: g,
                beta: batch.beta,
                normalize: batch.normalize_advantages,
            },
            epsilon_low: batch.epsilon_low,
            epsilon_high: batch.epsilon_high,
            temperature: batch.temperature,
        })
    }

    /// The objective of a micro-batch of `rollouts` whose `advantages` were computed over their
    /// generation batch ([`leave_one_out`], the KL in the reward, the normalisation), the ratio
    /// clipped to `[1 − epsilon_low, 1 + epsilon_high]`, log-probs at `temperature`. The reference's
    /// log-probs are not read. Checked as [`Rloo::new`] checks its batch.
    pub fn with_advantages(
        rollouts: &Rollouts,
        advantages: &[f64],
        (epsilon_low, epsilon_high): (f64, f64),
        temperature: f64,
        (vocab_size, device): (usize, &Device),
    ) -> Result<Self> {
        rollouts.check(&[("advantages", advantages.len())], vocab_size)?;
        if let Some(a) = advantages.iter().find(|a| !a.is_finite()) {
            return Err(bad(format!("advantage {a} is not finite")));
        }
        check_policy_settings((0.0, false), (epsilon_low, epsilon_high), temperature)?;
        let old = rollouts
            .old_logps
            .map(|a| Rollouts::per_position(a, device));
        Ok(Self {
            targets: rollouts.targets(device)?,
            mask: rollouts.mask(device)?,
            old: old.transpose()?,
            reference: None,
            advantages: Advantages::Given(advantages.to_vec()),
            epsilon_low,
            epsilon_high,
            temperature,
        })
    }

    /// `[B]`: each row's sum of `x` (`[B, T]`) over its completion tokens.
    fn row_sums(&self, x: &Tensor) -> Result<Tensor> {
        let zeros = x.zeros_like()?;
        Ok(self.mask.where_cond(x, &zeros)?.sum(1)?)
    }

    /// `[B, T]`: the old log-probs in `logp`'s dtype, or `logp` detached without them.
    fn old(&self, logp: &Tensor) -> Result<Tensor> {
        Ok(match &self.old {
            Some(o) => o.to_dtype(logp.dtype())?,
            None => logp.detach(),
        })
    }

    /// Each row's first-order KL `Σ m (π_old − ρ)`, in f64; `None` when `beta` is 0.
    fn row_kls(&self, logp: &Tensor) -> Result<Option<Vec<f64>>> {
        let Some(reference) = &self.reference else {
            return Ok(None);
        };
        let old = self.old(logp)?.to_dtype(DType::F64)?;
        let kl = self.row_sums(&(old - reference)?)?;
        Ok(Some(kl.to_vec1::<f64>()?))
    }

    /// The advantages, held constant: given, or the rewards less `β·KL`, less the leave-one-out
    /// baseline of their group, normalised over the batch when asked.
    fn advantages(&self, logp: &Tensor) -> Result<Vec<f64>> {
        let (rewards, g, beta, normalize) = match &self.advantages {
            Advantages::Given(a) => return Ok(a.clone()),
            Advantages::FromRewards {
                rewards,
                num_generations,
                beta,
                normalize,
            } => (rewards, *num_generations, *beta, *normalize),
        };
        let kls = self.row_kls(logp)?;
        let mut advantages = leave_one_out(&less_kl(rewards, kls.as_deref(), beta), g);
        if normalize {
            normalize_advantages(&mut advantages, Ok::<f64, ObjectiveError>)?;
        }
        Ok(advantages)
    }

    /// `[B]`: each row's ratio `e^{Σ m π − Σ m π_old}`.
    fn ratios(&self, logp: &Tensor) -> Result<Tensor> {
        let old = self.row_sums(&self.old(logp)?)?;
        Ok((self.row_sums(logp)? - old)?.exp()?)
    }
}

/// RLOO's advantages of `rewards` in groups of `g` (`g ≥ 2` dividing their number): each reward less
/// the mean of the others of its group, `R_i − (Σ_group R − R_i)/(g − 1)`.
pub fn leave_one_out(rewards: &[f64], g: usize) -> Vec<f64> {
    rewards
        .chunks(g)
        .flat_map(|group| {
            let sum: f64 = group.iter().sum();
            group.iter().map(move |r| r - (sum - r) / (g - 1) as f64)
        })
        .collect()
}

/// RLOO's rewards with the KL in them: `rewards − beta·kls` (the rewards as they are without
/// `kls`).
pub fn less_kl(rewards: &[f64], kls: Option<&[f64]>, beta: f64) -> Vec<f64> {
    match kls {
        Some(kls) => rewards
            .iter()
            .zip(kls)
            .map(|(r, kl)| r - beta * kl)
            .collect(),
        None => rewards.to_vec(),
    }
}

/// Normalises `advantages` as TRL's `normalize_advantages`: `(a − mean)/(std + 1e-4)`, with the
/// batch's mean and standard deviation (Bessel's correction, two passes as TRL's `nanstd`), where
/// `total` sums a value over the batch (`Ok` for these advantages alone; a sum over ranks where
/// the batch is split across them).
pub fn normalize_advantages<E>(
    advantages: &mut [f64],
    total: impl Fn(f64) -> std::result::Result<f64, E>,
) -> std::result::Result<(), E> {
    let n = total(advantages.len() as f64)?;
    let mean = total(advantages.iter().sum())? / n;
    let squares = total(advantages.iter().map(|a| (a - mean).powi(2)).sum())?;
    let std = (squares / (n - 1.0)).sqrt();
    for a in advantages {
        *a = (*a - mean) / (std + 1e-4);
    }
    Ok(())
}

/// The mean of `values` and their standard deviation with Bessel's correction (TRL's `nanstd`).
fn mean_and_unbiased_std(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    (mean, (variance * n / (n - 1.0)).sqrt())
}

impl Objective for Rloo {
    fn name(&self) -> &str {
        "rloo"
    }

    fn targets(&self) -> &Tensor {
        &self.targets
    }

    fn separable(&self) -> bool {
        false
    }

    fn temperature(&self) -> f64 {
        self.temperature
    }

    fn loss(&self, logp: &Tensor, _cols: Range<usize>) -> Result<Tensor> {
        let w = self.ratios(logp)?;
        let a = self.advantages(logp)?;
        let a = Tensor::from_vec(a, w.dims1()?, w.device())?.to_dtype(w.dtype())?;
        let unclipped = (&w * &a)?;
        let clipped = (w.clamp(1.0 - self.epsilon_low, 1.0 + self.epsilon_high)? * &a)?;
        Ok(unclipped.minimum(&clipped)?.neg()?.mean(0)?)
    }

    /// TRL's `clip_ratio/region_mean` (as `clip_ratio`, over rows); from rewards, also `kl` (the
    /// first-order estimate's mean over completion tokens, when `beta` is not 0), `reward` and
    /// `reward_std` (the rewards given, before the KL).
    fn metrics(&self, logp: &Tensor) -> Result<Vec<(String, f64)>> {
        let w = self.ratios(logp)?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        let a = self.advantages(logp)?;
        let clipped = w
            .iter()
            .zip(&a)
            .filter(|&(&w, &a)| {
                (w < 1.0 - self.epsilon_low && a < 0.0) || (w > 1.0 + self.epsilon_high && a > 0.0)
            })
            .count();
        let mut out = vec![("clip_ratio".to_string(), clipped as f64 / w.len() as f64)];
        if let Advantages::FromRewards { rewards, .. } = &self.advantages {
            let (reward, reward_std) = mean_and_unbiased_std(rewards);
            out.extend([("reward".into(), reward), ("reward_std".into(), reward_std)]);
        }
        if let Some(kls) = self.row_kls(logp)? {
            let tokens = self
                .mask
                .to_dtype(DType::F64)?
                .sum_all()?
                .to_scalar::<f64>()?;
            out.push(("kl".into(), kls.iter().sum::<f64>() / tokens.max(1.0)));
        }
        Ok(out)
    }
}
