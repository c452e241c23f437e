//! GRPO with TRL 1.16's per-token losses (`_compute_loss`), `r` the importance weight: `e^{π − π_old}`
//! per token, or with `importance_sampling_level = "sequence"` (GSPO) one per row,
//! `e^{Σ m (π − π_old) / max(Σ m, 1)}`:
//! - `grpo`, `bnpo`, `dr_grpo`, `dapo`, `luspo`: `−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)`;
//! - `cispo`: `−min(r, ε_high)·A·π` with the capped ratio detached (ε_high is the cap itself);
//! - `sapo`: `−σ(τ·(r − 1))·(4/τ)·A`, `τ` = `sapo_temperature_pos` where `A > 0`, else `_neg`;
//! - `vespo`: `−φ·A·π` with `φ` the row's gamma weight of its summed log-ratio, held constant
//!   ([`VespoGamma`]);
//!
//! times the off-policy mask when `off_policy_mask_threshold` is set (a row with `A < 0` whose mean
//! `π_old − π` exceeds it leaves the policy term), plus `β·KL`, `KL = e^{ρ−π} − (ρ−π) − 1`, times `r`
//! with `use_bias_correction_kl` (TRL's default).
//! Reduced by `grpo` and `sapo` (mean over each sequence's completion tokens, then over sequences),
//! `bnpo` (mean over the batch's completion tokens), `dr_grpo` (sum / (G · max_completion_length)),
//! `luspo` (each row's sum, mean over rows), or `dapo`, `cispo` and `vespo` (sum / the completion
//! tokens of the whole global batch, `num_items_in_batch`).
//! Without old log-probs, `π_old = π` detached: `r = 1` with the gradient of the current policy. β = 0
//! skips the reference.
//!
//! Per-position inputs are aligned with `input_ids`: the log-prob at position `t` is that of
//! `input_ids[t]` from the logits at `t − 1`. With token-level weights and neither `vespo` nor the
//! off-policy mask the loss is a sum over positions, so it streams; otherwise a row's terms depend on
//! its whole sum and the engine hands over all positions at once.

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};

use crate::rollouts::{bad, check_policy_settings, shift, Rollouts};
use crate::{Objective, ObjectiveError, Result};

/// How GRPO reduces per-token losses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpoLossType {
    /// `grpo`: mean over each sequence's completion tokens, then mean over the sequences.
    Grpo,
    /// `bnpo`: mean over all completion tokens of the batch.
    Bnpo,
    /// `dr_grpo`: sum over all completion tokens / (`G` · `max_completion_length`).
    DrGrpo,
    /// `dapo` (TRL's default): sum over all completion tokens / those of the whole global batch.
    Dapo,
    /// `cispo` (MiniMax-M1): the capped, detached ratio weighting the log-prob; reduced as `dapo`.
    Cispo,
    /// `sapo`: a sigmoid gate on the ratio in place of the clip; reduced as `grpo`.
    Sapo,
    /// `luspo`: clipped as `grpo`, each row's summed per-token losses (not divided by its length),
    /// mean over rows.
    Luspo,
    /// `vespo`: the log-prob weighted by a row's gamma weight ([`VespoGamma`]) in place of a ratio;
    /// reduced as `dapo`.
    Vespo,
}

impl GrpoLossType {
    /// Every loss type.
    pub const ALL: [GrpoLossType; 8] = [
        Self::Grpo,
        Self::Bnpo,
        Self::DrGrpo,
        Self::Dapo,
        Self::Cispo,
        Self::Sapo,
        Self::Luspo,
        Self::Vespo,
    ];

    /// TRL's name of the loss type (`loss_type=`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Grpo => "grpo",
            Self::Bnpo => "bnpo",
            Self::DrGrpo => "dr_grpo",
            Self::Dapo => "dapo",
            Self::Cispo => "cispo",
            Self::Sapo => "sapo",
            Self::Luspo => "luspo",
            Self::Vespo => "vespo",
        }
    }

    /// Whether its normaliser spans the whole global batch (`num_items_in_batch`): every
    /// micro-batch and rank of an optimizer step divides by the same token count.
    pub fn global_normaliser(self) -> bool {
        matches!(self, Self::Dapo | Self::Cispo | Self::Vespo)
    }

    /// Whether the ratio is clipped to `[1 − ε_low, 1 + ε_high]` (TRL's clipped loss types).
    fn clipped(self) -> bool {
        matches!(
            self,
            Self::Grpo | Self::Bnpo | Self::DrGrpo | Self::Dapo | Self::Luspo
        )
    }
}

/// The `q` quantile of sorted `values` by linear interpolation between the nearest ranks (as
/// `torch.quantile`'s default), in f64 (TRL's runs on its entropies in f32: only ties at the
/// threshold can fall otherwise); `+∞` for none (nothing reaches it).
fn quantile(values: &[f64], q: f64) -> f64 {
    let Some(last) = values.len().checked_sub(1) else {
        return f64::INFINITY;
    };
    let at = q * last as f64;
    let (below, above) = (at.floor() as usize, at.ceil() as usize);
    values[below] + (values[above] - values[below]) * (at - below as f64)
}

impl crate::LossSettings for GrpoLossType {
    const TYPES: &'static [Self] = &Self::ALL;
    const SETTINGS: &'static [&'static str] = &[
        "epsilon",
        "epsilon_high",
        "sapo_temperature_pos",
        "sapo_temperature_neg",
        "vespo_k_pos",
        "vespo_lambda_pos",
        "vespo_k_neg",
        "vespo_lambda_neg",
    ];
    fn type_name(self) -> &'static str {
        self.name()
    }
    /// TRL 1.16's `_compute_loss`: cispo caps the ratio at `epsilon_high` alone, sapo gates it by
    /// its temperatures, vespo weights by its gamma weights (neither clips), the others clip it to
    /// `[1 − ε, 1 + ε_high]`.
    fn reads(self, setting: &str) -> bool {
        match setting {
            "epsilon" => self.clipped(),
            "epsilon_high" => self.clipped() || self == Self::Cispo,
            "sapo_temperature_pos" | "sapo_temperature_neg" => self == Self::Sapo,
            s if s.starts_with("vespo_") => self == Self::Vespo,
            _ => true,
        }
    }
}

impl std::str::FromStr for GrpoLossType {
    type Err = ObjectiveError;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                ObjectiveError::Batch(format!(
                    "unknown loss_type {s:?} (expected one of {})",
                    Self::ALL.map(Self::name).join(", ")
                ))
            })
    }
}

/// Whether the importance weight is one per token or one per row (TRL's
/// `importance_sampling_level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImportanceSampling {
    /// `e^{π − π_old}` at each token (TRL's default).
    #[default]
    Token,
    /// GSPO's `e^{mean over the row's completion tokens of (π − π_old)}`, one per row.
    Sequence,
}

impl ImportanceSampling {
    /// TRL's name (`"token"`, `"sequence"`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Token => "token",
            Self::Sequence => "sequence",
        }
    }
}

impl std::str::FromStr for ImportanceSampling {
    type Err = ObjectiveError;
    fn from_str(s: &str) -> Result<Self> {
        [Self::Token, Self::Sequence]
            .into_iter()
            .find(|l| l.name() == s)
            .ok_or_else(|| {
                bad(format!(
                    "unknown importance_sampling_level {s:?} (expected token or sequence)"
                ))
            })
    }
}

/// VESPO's gamma weight of a row (TRL's `get_gamma_weights`): with `L` its summed log-ratio
/// `Σ m·clamp(π − π_old, −20, 20)` clamped to `[ln 1e-8, 20]`, `φ = e^{λ + k·L − λ·e^L}` (1 at
/// `L = 0`), `(k, λ)` by the sign of the row's advantage; a non-finite `φ` counts 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VespoGamma {
    /// `(vespo_k_pos, vespo_lambda_pos)`, for `A ≥ 0` (TRL: 2.0, 3.0).
    pub positive: (f64, f64),
    /// `(vespo_k_neg, vespo_lambda_neg)`, for `A < 0` (TRL: 3.0, 2.0).
    pub negative: (f64, f64),
}

impl Default for VespoGamma {
    fn default() -> Self {
        VespoGamma {
            positive: (2.0, 3.0),
            negative: (3.0, 2.0),
        }
    }
}

impl VespoGamma {
    /// The weight of a row with summed log-ratio `log_ratio` and advantage `advantage`.
    fn weight(&self, log_ratio: f64, advantage: f64) -> f64 {
        let (k, lambda) = if advantage >= 0.0 {
            self.positive
        } else {
            self.negative
        };
        let lambda = lambda.max(1e-4);
        let l = log_ratio.clamp(1e-8f64.ln(), 20.0);
        let phi = (lambda + k * l - lambda * l.exp()).exp();
        if phi.is_finite() {
            phi
        } else {
            0.0
        }
    }
}

/// The completion tokens' entropies of every data-parallel rank's batch, given this rank's, in rank
/// order: TRL's `get_high_entropy_mask` takes its quantile over all of them (it pads and gathers
/// them across processes). Every rank's batch calls it once per loss, in the same order; an error
/// is the collective's, in words.
#[derive(Clone)]
pub struct EntropyPool(Arc<PoolFn>);

/// What an [`EntropyPool`] runs.
type PoolFn = dyn Fn(&[f64]) -> std::result::Result<Vec<f64>, String> + Send + Sync;

impl EntropyPool {
    /// The pool that `gather` forms from this rank's entropies.
    pub fn new(
        gather: impl Fn(&[f64]) -> std::result::Result<Vec<f64>, String> + Send + Sync + 'static,
    ) -> Self {
        Self(Arc::new(gather))
    }

    /// Every rank's entropies, from this rank's `local` ones.
    fn gather(&self, local: &[f64]) -> Result<Vec<f64>> {
        (self.0)(local).map_err(|e| {
            ObjectiveError::Loss(format!("gathering the ranks' entropies failed: {e}"))
        })
    }
}

impl fmt::Debug for EntropyPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("EntropyPool")
    }
}

/// A GRPO batch.
#[derive(Debug, Clone)]
pub struct GrpoBatch<'a> {
    /// `G` sequences (prompt + completion), right-padded, with the log-probs that scored them; the
    /// reference's are required when `beta` is not 0, unused when it is.
    pub rollouts: Rollouts<'a>,
    /// `[G]`: one advantage per sequence.
    pub advantages: &'a [f64],
    /// Weight of the KL penalty to the reference (≥ 0; 0 skips the reference).
    pub beta: f64,
    /// The ratio is clipped below at `1 − epsilon_low`.
    pub epsilon_low: f64,
    /// The ratio is clipped above at `1 + epsilon_high`.
    pub epsilon_high: f64,
    /// How per-token losses are reduced to the batch's loss.
    pub loss_type: GrpoLossType,
    /// The generation's completion-length limit, in tokens; required by `dr_grpo`.
    pub max_completion_length: Option<usize>,
    /// The temperature the completions were sampled at: the policy's log-probs are taken from
    /// `logits / temperature`, as TRL's (the old and reference log-probs must be too).
    pub temperature: f64,
    /// `dapo`/`cispo`/`vespo`: the completion tokens of the whole global batch (every micro-batch
    /// and rank of the optimizer step); `None`: this batch's own.
    pub num_items_in_batch: Option<f64>,
    /// The KL term times the ratio `r` (TRL's `use_bias_correction_kl`, default true).
    pub use_bias_correction_kl: bool,
    /// `sapo`'s gate temperatures for positive and negative advantages (TRL: 1.0 and 1.05).
    pub sapo_temperatures: (f64, f64),
    /// One importance weight per token or per row.
    pub importance_sampling: ImportanceSampling,
    /// `vespo`'s gamma weights.
    pub vespo_gamma: VespoGamma,
    /// Rows with a negative advantage whose mean `π_old − π` over their completion tokens exceeds
    /// this leave the policy term (TRL's `off_policy_mask_threshold`, DeepSeek-V3.2's sequence
    /// mask); `None`: every row stays.
    pub off_policy_mask_threshold: Option<f64>,
    /// The weight of the batch's mean entropy over its completion tokens subtracted from the loss
    /// (TRL's `entropy_coef`, as a share of this batch's loss: a caller whose batches each weigh 1
    /// divides it by their number); 0: none.
    pub entropy_coef: f64,
    /// Only the completion tokens whose entropy is in the batch's top `top_entropy_quantile`
    /// (`[0, 1]`, TRL's; 1: every token, 0: the highest) keep their policy term and count in the
    /// entropy bonus.
    pub top_entropy_quantile: f64,
    /// Where the quantile of `top_entropy_quantile` runs over every data-parallel rank's
    /// completion tokens, as TRL's across processes; `None`: over this batch's alone.
    pub entropy_pool: Option<EntropyPool>,
    /// Reads the entropies even where no bonus applies, and reports as metrics the sum of the
    /// entropies of the tokens the bonus acts on (`entropy_bonus/sum`) and their number
    /// (`entropy_bonus/tokens`): what TRL's adaptive entropy control reads over an optimizer step.
    pub entropy_stats: bool,
}

/// The GRPO objective of one batch, built from a [`GrpoBatch`].
#[derive(Debug, Clone)]
pub struct Grpo {
    /// `[G, T]` in logits coordinates (position `t` scores `input_ids[t + 1]`).
    targets: Tensor,
    /// `[G, T]` u8 completion mask in logits coordinates.
    mask: Tensor,
    /// `[G, T]` per-token weight of the reduction.
    weights: Tensor,
    /// `[G, 1]`.
    advantages: Tensor,
    old: Option<Tensor>,
    reference: Option<Tensor>,
    beta: f64,
    epsilon_low: f64,
    epsilon_high: f64,
    temperature: f64,
    loss_type: GrpoLossType,
    bias_corrected_kl: bool,
    /// `[G, 1]`: `sapo`'s gate temperature for each sequence's advantage.
    sapo_temperatures: Tensor,
    /// Each row's completion tokens, at least 1 (the sequence-level means' divisor).
    lengths: Vec<f64>,
    /// The batch's completion tokens.
    completion_tokens: f64,
    advantage_values: Vec<f64>,
    importance_sampling: ImportanceSampling,
    vespo_gamma: VespoGamma,
    off_policy_mask_threshold: Option<f64>,
    entropy_coef: f64,
    top_entropy_quantile: f64,
    entropy_pool: Option<EntropyPool>,
    entropy_stats: bool,
    /// The high-entropy mask of the last loss, for the metrics.
    kept: KeptMask,
}

/// The high-entropy mask a loss used, kept for the batch's metrics (a clone starts without one).
#[derive(Debug, Default)]
struct KeptMask(Mutex<Option<Tensor>>);

impl Clone for KeptMask {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl KeptMask {
    fn set(&self, mask: &Tensor) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(mask.clone());
    }

    fn get(&self) -> Option<Tensor> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl GrpoBatch<'_> {
    /// Checks the scalar parameters: those of every policy-gradient loss
    /// ([`check_policy_settings`]), positive finite sapo temperatures, vespo's shapes numbers at
    /// least 0, and a finite off-policy threshold.
    fn check_parameters(&self) -> Result<()> {
        check_policy_settings(
            (self.beta, self.rollouts.ref_logps.is_some()),
            (self.epsilon_low, self.epsilon_high),
            self.temperature,
        )?;
        let (pos, neg) = self.sapo_temperatures;
        if !(pos > 0.0 && neg > 0.0 && pos.is_finite() && neg.is_finite()) {
            return Err(bad(format!(
                "sapo temperatures ({pos}, {neg}) must be above 0"
            )));
        }
        let VespoGamma { positive, negative } = self.vespo_gamma;
        for (name, value) in [
            ("vespo_k_pos", positive.0),
            ("vespo_lambda_pos", positive.1),
            ("vespo_k_neg", negative.0),
            ("vespo_lambda_neg", negative.1),
        ] {
            if !(value >= 0.0 && value.is_finite()) {
                return Err(bad(format!("{name} {value} must be a number at least 0")));
            }
        }
        if !self.entropy_coef.is_finite() {
            return Err(bad(format!(
                "entropy_coef {} must be a number",
                self.entropy_coef
            )));
        }
        let q = self.top_entropy_quantile;
        if !(0.0..=1.0).contains(&q) {
            return Err(bad(format!("top_entropy_quantile {q} must be in [0, 1]")));
        }
        if let Some(t) = self.off_policy_mask_threshold.filter(|t| !t.is_finite()) {
            return Err(bad(format!(
                "off_policy_mask_threshold {t} must be a number"
            )));
        }
        Ok(())
    }

    /// What the loss type divides each row's summed per-token losses by, given the rows'
    /// `completion_lengths` (checking `num_items_in_batch` and `max_completion_length` against them).
    fn denominators(&self, completion_lengths: &[usize]) -> Result<Vec<f64>> {
        let g = completion_lengths.len();
        let tokens = completion_lengths.iter().sum::<usize>() as f64;
        let longest = completion_lengths.iter().copied().max().unwrap_or(0);
        Ok(match self.loss_type {
            // TRL's `mask.sum(-1).clamp(min=1.0)`.
            GrpoLossType::Grpo | GrpoLossType::Sapo => completion_lengths
                .iter()
                .map(|&n| (n.max(1) * g) as f64)
                .collect(),
            GrpoLossType::Bnpo => vec![tokens; g],
            GrpoLossType::Luspo => vec![g as f64; g],
            GrpoLossType::Dapo | GrpoLossType::Cispo | GrpoLossType::Vespo => {
                let items = self.num_items_in_batch.unwrap_or(tokens);
                if !(items >= tokens && items.is_finite()) {
                    return Err(bad(format!(
                        "num_items_in_batch {items} is below this batch's {tokens} completion tokens"
                    )));
                }
                vec![items; g]
            }
            GrpoLossType::DrGrpo => {
                let max_len = self
                    .max_completion_length
                    .ok_or_else(|| bad("loss_type dr_grpo needs max_completion_length".into()))?;
                if max_len < longest {
                    return Err(bad(format!(
                        "max_completion_length {max_len} is shorter than a completion ({longest} tokens)"
                    )));
                }
                vec![(g * max_len) as f64; g]
            }
        })
    }
}

impl Grpo {
    /// Checks `batch` (shapes, ids inside `vocab_size`, masks, finite values, the parameters its loss
    /// type needs) and moves it to `device` in logits coordinates.
    pub fn new(batch: &GrpoBatch, vocab_size: usize, device: &Device) -> Result<Self> {
        let rollouts = &batch.rollouts;
        let advantages = ("advantages", batch.advantages.len());
        let ((g, t), completion_lengths) = rollouts.check(&[advantages], vocab_size)?;
        if let Some(a) = batch.advantages.iter().find(|a| !a.is_finite()) {
            return Err(bad(format!("advantage {a} is not finite")));
        }
        batch.check_parameters()?;
        let denominators = batch.denominators(&completion_lengths)?;
        let weights: Vec<f64> = shift(rollouts.completion_mask)
            .iter()
            .enumerate()
            .map(|(i, &m)| m as f64 / denominators[i / t])
            .collect();
        let per_pos = |a: Option<&[Vec<f64>]>| -> Result<Option<Tensor>> {
            a.map(|a| Rollouts::per_position(a, device)).transpose()
        };
        let (pos, neg) = batch.sapo_temperatures;
        Ok(Self {
            targets: rollouts.targets(device)?,
            mask: rollouts.mask(device)?,
            weights: Tensor::from_vec(weights, (g, t), device)?,
            advantages: Tensor::from_vec(batch.advantages.to_vec(), (g, 1), device)?,
            old: per_pos(rollouts.old_logps)?,
            reference: if batch.beta != 0.0 {
                per_pos(rollouts.ref_logps)?
            } else {
                None
            },
            beta: batch.beta,
            epsilon_low: batch.epsilon_low,
            epsilon_high: batch.epsilon_high,
            temperature: batch.temperature,
            loss_type: batch.loss_type,
            bias_corrected_kl: batch.use_bias_correction_kl,
            sapo_temperatures: Tensor::from_vec(
                batch
                    .advantages
                    .iter()
                    .map(|&a| if a > 0.0 { pos } else { neg })
                    .collect::<Vec<_>>(),
                (g, 1),
                device,
            )?,
            completion_tokens: completion_lengths.iter().sum::<usize>() as f64,
            lengths: completion_lengths
                .iter()
                .map(|&n| n.max(1) as f64)
                .collect(),
            advantage_values: batch.advantages.to_vec(),
            importance_sampling: batch.importance_sampling,
            vespo_gamma: batch.vespo_gamma,
            off_policy_mask_threshold: batch.off_policy_mask_threshold,
            entropy_coef: batch.entropy_coef,
            top_entropy_quantile: batch.top_entropy_quantile,
            entropy_pool: batch.entropy_pool.clone(),
            entropy_stats: batch.entropy_stats,
            kept: KeptMask::default(),
        })
    }

    /// `(log-ratio π − π_old, ρ − π)` on `cols`, zero where the mask is 0 (so nothing overflows there).
    fn log_ratios(&self, logp: &Tensor, cols: &Range<usize>) -> Result<(Tensor, Option<Tensor>)> {
        let dt = logp.dtype();
        let mask = self.mask.narrow(1, cols.start, cols.len())?;
        let zeros = logp.zeros_like()?;
        let select = |x: Tensor| mask.where_cond(&x, &zeros);
        let old = match &self.old {
            Some(o) => o.narrow(1, cols.start, cols.len())?.to_dtype(dt)?,
            None => logp.detach(),
        };
        let ratio = select((logp - old)?)?;
        let kl_arg = match &self.reference {
            Some(r) => Some(select(
                (r.narrow(1, cols.start, cols.len())?.to_dtype(dt)? - logp)?,
            )?),
            None => None,
        };
        Ok((ratio, kl_arg))
    }

    /// The importance weights from the masked log-ratios of all positions' (or, per token, of any
    /// columns'): `[G, cols]` per token, `[G, 1]` per row.
    fn importance_weights(&self, log_ratio: &Tensor) -> Result<Tensor> {
        Ok(match self.importance_sampling {
            ImportanceSampling::Token => log_ratio.exp()?,
            ImportanceSampling::Sequence => {
                let lengths = self.row_constants(&self.lengths, log_ratio.dtype())?;
                log_ratio.sum_keepdim(1)?.broadcast_div(&lengths)?.exp()?
            }
        })
    }

    /// Each row's `vespo` gamma weight from its masked log-ratios (all positions), held constant.
    fn gamma_weights(&self, log_ratio: &Tensor) -> Result<Vec<f64>> {
        let rows = log_ratio.detach().to_dtype(DType::F64)?.to_vec2::<f64>()?;
        Ok(rows
            .iter()
            .zip(&self.advantage_values)
            .map(|(row, &a)| {
                let sum = row.iter().map(|x| x.clamp(-20.0, 20.0)).sum();
                self.vespo_gamma.weight(sum, a)
            })
            .collect())
    }

    /// TRL's off-policy sequence mask from the masked log-ratios (all positions): `[G, 1]`, 0 where
    /// a row has `A < 0` and a mean `π_old − π` above the threshold, else 1; `None` without one.
    fn off_policy_mask(&self, log_ratio: &Tensor) -> Result<Option<Tensor>> {
        let Some(threshold) = self.off_policy_mask_threshold else {
            return Ok(None);
        };
        let sums = log_ratio
            .detach()
            .sum(1)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        let keep: Vec<f64> = sums
            .iter()
            .zip(&self.lengths)
            .zip(&self.advantage_values)
            .map(|((&sum, &n), &a)| f64::from(u8::from(a >= 0.0 || -sum / n <= threshold)))
            .collect();
        Ok(Some(self.row_constants(&keep, log_ratio.dtype())?))
    }

    /// The loss of positions `cols` from their log-probs and, where the objective reads them, their
    /// entropies (all positions when the loss is not separable).
    fn total_loss(
        &self,
        logp: &Tensor,
        entropy: Option<&Tensor>,
        cols: Range<usize>,
    ) -> Result<Tensor> {
        let dt = logp.dtype();
        let (log_ratio, kl_arg) = self.log_ratios(logp, &cols)?;
        let r = self.importance_weights(&log_ratio)?;
        let a = self.advantages.to_dtype(dt)?;
        let mut per_token = match self.loss_type {
            GrpoLossType::Vespo => {
                let phi = self.row_constants(&self.gamma_weights(&log_ratio)?, dt)?;
                phi.broadcast_mul(&a)?.broadcast_mul(logp)?.neg()?
            }
            GrpoLossType::Cispo => {
                let capped = r.clamp(f64::NEG_INFINITY, self.epsilon_high)?.detach();
                capped.broadcast_mul(&a)?.broadcast_mul(logp)?.neg()?
            }
            GrpoLossType::Sapo => {
                let tau = self.sapo_temperatures.to_dtype(dt)?;
                let x = (&r - 1.0)?.broadcast_mul(&tau)?;
                let gate = (x.neg()?.exp()? + 1.0)?.recip()?;
                let soft = (gate.broadcast_div(&tau)? * 4.0)?;
                soft.broadcast_mul(&a)?.neg()?
            }
            _ => {
                let unclipped = r.broadcast_mul(&a)?;
                let clipped = r
                    .clamp(1.0 - self.epsilon_low, 1.0 + self.epsilon_high)?
                    .broadcast_mul(&a)?;
                unclipped.minimum(&clipped)?.neg()?
            }
        };
        if let Some(keep) = self.off_policy_mask(&log_ratio)? {
            per_token = per_token.broadcast_mul(&keep)?;
        }
        // TRL's high-entropy mask: only the batch's top `top_entropy_quantile` of completion tokens
        // by entropy (held constant) keep their policy term.
        let kept = match entropy {
            Some(h) if self.top_entropy_quantile < 1.0 => Some(self.high_entropy_mask(h)?),
            _ => None,
        };
        if let Some(kept) = &kept {
            self.kept.set(kept);
            per_token = per_token.broadcast_mul(&kept.to_dtype(dt)?)?;
        }
        if let Some(d) = kl_arg {
            let mut kl = ((d.exp()? - &d)? - 1.0)?;
            if self.bias_corrected_kl {
                kl = kl.broadcast_mul(&r)?;
            }
            per_token = per_token.broadcast_add(&(kl * self.beta)?)?;
        }
        let w = self
            .weights
            .narrow(1, cols.start, cols.len())?
            .to_dtype(dt)?;
        let loss = per_token.broadcast_mul(&w)?.sum_all()?;
        match entropy {
            // The entropy bonus: a token mean over the tokens the policy term acts on, whatever
            // the loss type's reduction (TRL's `entropy_coef`).
            Some(h) if self.entropy_coef != 0.0 => {
                let bonus = self.entropy_bonus(h, kept.as_ref(), &cols)?;
                Ok((loss - (bonus * self.entropy_coef)?)?)
            }
            _ => Ok(loss),
        }
    }

    /// `Σ m·x` over the completion tokens of `x` (`[G, cols]` from column `cols.start`, f64) and
    /// their count, the tokens further restricted to `kept`'s where given.
    fn masked_sum_and_count(&self, x: &Tensor, kept: Option<&Tensor>) -> Result<(f64, f64)> {
        let mut mask = self.mask.to_dtype(DType::F64)?;
        if let Some(kept) = kept {
            mask = (mask * kept.to_dtype(DType::F64)?)?;
        }
        let sum = (x * &mask)?.sum_all()?.to_scalar::<f64>()?;
        Ok((sum, mask.sum_all()?.to_scalar::<f64>()?))
    }

    /// TRL's `get_high_entropy_mask`: `[G, T]` u8, 1 at the completion tokens whose entropy is at
    /// least the `1 − top_entropy_quantile` quantile (linear interpolation, as `torch.quantile`)
    /// of the completion tokens' entropies: the batch's, or every rank's through the pool.
    fn high_entropy_mask(&self, entropy: &Tensor) -> Result<Tensor> {
        let h = entropy.detach().to_dtype(DType::F64)?;
        let values = h.flatten_all()?.to_vec1::<f64>()?;
        let mask = self.mask.flatten_all()?.to_vec1::<u8>()?;
        let local: Vec<f64> = values
            .iter()
            .zip(&mask)
            .filter(|(_, &m)| m == 1)
            .map(|(&v, _)| v)
            .collect();
        let mut tokens = match &self.entropy_pool {
            Some(pool) => pool.gather(&local)?,
            None => local,
        };
        tokens.sort_by(f64::total_cmp);
        let threshold = quantile(&tokens, 1.0 - self.top_entropy_quantile);
        let kept: Vec<u8> = values
            .iter()
            .zip(&mask)
            .map(|(&v, &m)| u8::from(m == 1 && v >= threshold))
            .collect();
        Ok(Tensor::from_vec(kept, h.shape(), h.device())?)
    }

    /// The entropy bonus of positions `cols`: `Σ H·m·e / max(Σ m·e, 1)` over the whole batch's
    /// completion tokens (restricted to `kept`, the high-entropy mask, where given).
    fn entropy_bonus(
        &self,
        entropy: &Tensor,
        kept: Option<&Tensor>,
        cols: &Range<usize>,
    ) -> Result<Tensor> {
        let count = match kept {
            Some(kept) => {
                self.masked_sum_and_count(&self.mask.to_dtype(DType::F64)?, Some(kept))?
                    .1
            }
            None => self.completion_tokens,
        };
        let mut mask = self.mask.narrow(1, cols.start, cols.len())?;
        if let Some(kept) = kept {
            mask = (mask * kept.narrow(1, cols.start, cols.len())?)?;
        }
        let zeros = entropy.zeros_like()?;
        let sum = mask.where_cond(entropy, &zeros)?.sum_all()?;
        Ok((sum / count.max(1.0))?)
    }

    /// `[G, 1]` constants of `dtype` on the batch's device.
    fn row_constants(&self, values: &[f64], dtype: DType) -> Result<Tensor> {
        let t = Tensor::from_vec(values.to_vec(), (values.len(), 1), self.advantages.device())?;
        Ok(t.to_dtype(dtype)?)
    }
}

impl Objective for Grpo {
    fn name(&self) -> &str {
        "grpo"
    }

    fn targets(&self) -> &Tensor {
        &self.targets
    }

    fn separable(&self) -> bool {
        self.importance_sampling == ImportanceSampling::Token
            && self.loss_type != GrpoLossType::Vespo
            && self.off_policy_mask_threshold.is_none()
            && self.top_entropy_quantile == 1.0
    }

    fn temperature(&self) -> f64 {
        self.temperature
    }

    fn loss(&self, logp: &Tensor, cols: Range<usize>) -> Result<Tensor> {
        self.total_loss(logp, None, cols)
    }

    fn reads_entropy(&self) -> bool {
        self.entropy_coef != 0.0 || self.top_entropy_quantile < 1.0 || self.entropy_stats
    }

    fn loss_with_entropy(
        &self,
        logp: &Tensor,
        entropy: &Tensor,
        cols: Range<usize>,
    ) -> Result<Tensor> {
        self.total_loss(logp, Some(entropy), cols)
    }

    fn metrics_with_entropy(
        &self,
        logp: &Tensor,
        entropy: Option<&Tensor>,
    ) -> Result<Vec<(String, f64)>> {
        let mut out = self.metrics(logp)?;
        if let Some(entropy) = entropy {
            // TRL's `entropy`: the mean over the completion tokens.
            let entropy = entropy.to_dtype(DType::F64)?;
            let (sum, count) = self.masked_sum_and_count(&entropy, None)?;
            out.push(("entropy".into(), sum / count.max(1.0)));
            if self.entropy_stats {
                // The tokens the bonus acts on: those the loss's high-entropy mask kept.
                let kept = match self.top_entropy_quantile < 1.0 {
                    true => Some(self.kept.get().ok_or_else(|| {
                        ObjectiveError::Loss(
                            "the entropy statistics need the high-entropy mask of this batch's \
                             loss, which has not run"
                                .into(),
                        )
                    })?),
                    false => None,
                };
                let (sum, count) = self.masked_sum_and_count(&entropy, kept.as_ref())?;
                out.push(("entropy_bonus/sum".into(), sum));
                out.push(("entropy_bonus/tokens".into(), count));
            }
        }
        Ok(out)
    }
    fn metrics(&self, logp: &Tensor) -> Result<Vec<(String, f64)>> {
        let t = logp.dim(1)?;
        let (log_ratio, kl_arg) = self.log_ratios(logp, &(0..t))?;
        let log_ratio = log_ratio.to_dtype(DType::F64)?;
        let mask = self.mask.to_dtype(DType::F64)?;
        let count = mask.sum_all()?.to_scalar::<f64>()?;
        // TRL's `global_masked_mean`: over completion tokens, or over rows for one value per row.
        let mean = |x: &Tensor| -> Result<f64> {
            let (rows, cols) = x.dims2()?;
            Ok(if cols == 1 {
                x.sum_all()?.to_scalar::<f64>()? / rows as f64
            } else {
                (x * &mask)?.sum_all()?.to_scalar::<f64>()? / count.max(1.0)
            })
        };
        let r = self.importance_weights(&log_ratio)?;
        let a = self.advantages.to_dtype(DType::F64)?;
        let zero = a.zeros_like()?;
        let positive = a.gt(&zero)?.broadcast_as(r.shape())?;
        // TRL's clip fractions: the clip region's for the clipped losses, the cap's for cispo (its
        // `cispo_clip_ratio`), none for sapo and vespo.
        let clipped = match self.loss_type {
            GrpoLossType::Sapo | GrpoLossType::Vespo => None,
            GrpoLossType::Cispo => Some(r.gt(self.epsilon_high)?.mul(&positive)?),
            _ => {
                let low = r
                    .lt(1.0 - self.epsilon_low)?
                    .mul(&a.lt(&zero)?.broadcast_as(r.shape())?)?;
                let high = r.gt(1.0 + self.epsilon_high)?.mul(&positive)?;
                Some((low + high)?)
            }
        };
        let mut out = Vec::new();
        if let Some(clipped) = clipped {
            out.push((
                "clip_ratio".to_string(),
                mean(&clipped.to_dtype(DType::F64)?)?,
            ));
        }
        if self.loss_type == GrpoLossType::Vespo {
            let phi = self.gamma_weights(&log_ratio)?;
            out.push((
                "vespo/phi_seq_mean".into(),
                phi.iter().sum::<f64>() / phi.len() as f64,
            ));
        }
        if let Some(d) = kl_arg {
            let d = d.to_dtype(DType::F64)?;
            let mut kl = ((d.exp()? - &d)? - 1.0)?;
            if self.bias_corrected_kl {
                kl = kl.broadcast_mul(&r)?;
            }
            out.push(("kl".into(), mean(&kl)?));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two rows of 5 positions, 3 completion tokens each (logits positions 1..4 of each row).
    fn objective(pool: Option<EntropyPool>) -> Grpo {
        let input_ids = vec![vec![1, 2, 3, 4, 0], vec![1, 2, 4, 3, 2]];
        let mask = vec![vec![0, 0, 1, 1, 1], vec![0, 0, 1, 1, 1]];
        let batch = GrpoBatch {
            rollouts: Rollouts {
                input_ids: &input_ids,
                completion_mask: &mask,
                old_logps: None,
                ref_logps: None,
            },
            advantages: &[1.0, -1.0],
            beta: 0.0,
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            loss_type: GrpoLossType::Dapo,
            max_completion_length: None,
            temperature: 1.0,
            num_items_in_batch: None,
            use_bias_correction_kl: true,
            sapo_temperatures: (1.0, 1.05),
            importance_sampling: ImportanceSampling::Token,
            vespo_gamma: VespoGamma::default(),
            off_policy_mask_threshold: None,
            entropy_coef: 0.0,
            top_entropy_quantile: 0.5,
            entropy_pool: pool,
            entropy_stats: true,
        };
        Grpo::new(&batch, 8, &Device::Cpu).unwrap()
    }

    /// The entropy statistics adaptive control reads cover the tokens the loss's high-entropy
    /// mask kept, whose quantile runs over what the pool gathers (here, another rank's tokens
    /// that lift the threshold).
    #[test]
    fn entropy_stats_cover_the_kept_tokens_of_the_pooled_quantile() {
        let entropy = Tensor::new(
            &[[9.0, 0.1, 0.2, 0.3, 9.0], [9.0, 0.4, 0.5, 0.6, 9.0]],
            &Device::Cpu,
        )
        .unwrap();
        let logp = (entropy.zeros_like().unwrap() - 1.0).unwrap();
        let stats = |grpo: &Grpo| {
            grpo.loss_with_entropy(&logp, &entropy, 0..5).unwrap();
            let metrics = grpo.metrics_with_entropy(&logp, Some(&entropy)).unwrap();
            let get = |n: &str| metrics.iter().find(|(k, _)| k == n).unwrap().1;
            (get("entropy_bonus/sum"), get("entropy_bonus/tokens"))
        };
        // Alone: the median of 0.1..0.6 is 0.35, so 0.4, 0.5 and 0.6 stay.
        let (sum, tokens) = stats(&objective(None));
        assert!((sum - 1.5).abs() < 1e-12 && tokens == 3.0, "{sum} {tokens}");
        // With another rank's 0.55, 0.55, 0.55 and 0.7: the median of the ten is 0.525.
        let pool = EntropyPool::new(|local| Ok([local, &[0.55, 0.55, 0.55, 0.7]].concat()));
        let (sum, tokens) = stats(&objective(Some(pool)));
        assert!((sum - 0.6).abs() < 1e-12 && tokens == 1.0, "{sum} {tokens}");
    }
}
