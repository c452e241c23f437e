//! GRPO with TRL 1.16's per-token losses (`_compute_loss`), `r = e^{π − π_old}`:
//! - `grpo`, `bnpo`, `dr_grpo`, `dapo`: `−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)`;
//! - `cispo`: `−min(r, ε_high)·A·π` with the capped ratio detached (ε_high is the cap itself);
//! - `sapo`: `−σ(τ·(r − 1))·(4/τ)·A`, `τ` = `sapo_temperature_pos` where `A > 0`, else `_neg`;
//!
//! plus `β·KL`, `KL = e^{ρ−π} − (ρ−π) − 1`, times `r` with `use_bias_correction_kl` (TRL's default).
//! Reduced by `grpo` and `sapo` (mean over each sequence's completion tokens, then over sequences),
//! `bnpo` (mean over the batch's completion tokens), `dr_grpo` (sum / (G · max_completion_length)), or
//! `dapo` and `cispo` (sum / the completion tokens of the whole global batch, `num_items_in_batch`).
//! Without old log-probs, `π_old = π` detached: `r = 1` with the gradient of the current policy. β = 0
//! skips the reference.
//!
//! Per-position inputs are aligned with `input_ids`: the log-prob at position `t` is that of
//! `input_ids[t]` from the logits at `t − 1`. The loss is a sum over positions, so it streams.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};

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
}

impl GrpoLossType {
    /// Every loss type.
    pub const ALL: [GrpoLossType; 6] = [
        Self::Grpo,
        Self::Bnpo,
        Self::DrGrpo,
        Self::Dapo,
        Self::Cispo,
        Self::Sapo,
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
        }
    }

    /// Whether its normaliser spans the whole global batch (`num_items_in_batch`): every
    /// micro-batch and rank of an optimizer step divides by the same token count.
    pub fn global_normaliser(self) -> bool {
        matches!(self, Self::Dapo | Self::Cispo)
    }
}

impl crate::LossSettings for GrpoLossType {
    const TYPES: &'static [Self] = &Self::ALL;
    const SETTINGS: &'static [&'static str] = &[
        "epsilon",
        "epsilon_high",
        "sapo_temperature_pos",
        "sapo_temperature_neg",
    ];
    fn type_name(self) -> &'static str {
        self.name()
    }
    /// TRL 1.16's `_compute_loss`: cispo caps the ratio at `epsilon_high` alone, sapo gates it by
    /// its temperatures and clips nothing, the others clip it to `[1 − ε, 1 + ε_high]`.
    fn reads(self, setting: &str) -> bool {
        match setting {
            "epsilon" => !matches!(self, Self::Cispo | Self::Sapo),
            "epsilon_high" => self != Self::Sapo,
            "sapo_temperature_pos" | "sapo_temperature_neg" => self == Self::Sapo,
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
                    "unknown loss_type {s:?} (expected grpo, bnpo, dr_grpo, dapo, cispo or sapo)"
                ))
            })
    }
}

/// A GRPO batch: `G` sequences (prompt + completion), right-padded.
#[derive(Debug, Clone)]
pub struct GrpoBatch<'a> {
    /// `[G][T]` token ids, prompt then completion, right-padded.
    pub input_ids: &'a [Vec<i64>],
    /// `[G][T]`, 1 = completion token (the positions the loss covers); 0 at position 0.
    pub completion_mask: &'a [Vec<i64>],
    /// `[G]`: one advantage per sequence.
    pub advantages: &'a [f64],
    /// `[G][T]` log-probs of `input_ids[t]` under the policy that sampled them (`π_old`), aligned with
    /// `input_ids`, read at completion positions; `None`: the current policy, detached.
    pub old_logps: Option<&'a [Vec<f64>]>,
    /// `[G][T]` log-probs under the reference model (`ρ`), aligned like `old_logps`; required when
    /// `beta` is not 0, unused when it is.
    pub ref_logps: Option<&'a [Vec<f64>]>,
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
    /// `dapo`/`cispo`: the completion tokens of the whole global batch (every micro-batch and rank
    /// of the optimizer step); `None`: this batch's own.
    pub num_items_in_batch: Option<f64>,
    /// The KL term times the ratio `r` (TRL's `use_bias_correction_kl`, default true).
    pub use_bias_correction_kl: bool,
    /// `sapo`'s gate temperatures for positive and negative advantages (TRL: 1.0 and 1.05).
    pub sapo_temperatures: (f64, f64),
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
}

/// Shifts a per-position array aligned with input_ids into logits coordinates (drops position 0).
fn shift<T: Copy + Default>(rows: &[Vec<T>]) -> Vec<T> {
    rows.iter()
        .flat_map(|r| {
            r.iter()
                .skip(1)
                .copied()
                .chain(std::iter::once(T::default()))
        })
        .collect()
}

/// The error of a malformed batch, saying what is wrong with it (`m`).
fn bad(m: String) -> ObjectiveError {
    ObjectiveError::Batch(m)
}

impl GrpoBatch<'_> {
    /// The batch's `(G, T)`, once every array is checked to have input_ids' `[G][T]` shape (`[G]`
    /// for the advantages).
    fn shape(&self) -> Result<(usize, usize)> {
        let g = self.input_ids.len();
        let t = self.input_ids.first().map(Vec::len).unwrap_or(0);
        if g == 0 || t == 0 {
            return Err(bad("empty input_ids".into()));
        }
        let same_shape = |name: &str, rows: usize, lens: &mut dyn Iterator<Item = usize>| {
            if rows != g {
                return Err(bad(format!("{name} has {rows} rows, input_ids has {g}")));
            }
            if let Some((i, l)) = lens.enumerate().find(|(_, l)| *l != t) {
                return Err(bad(format!("{name} row {i} has {l} entries, expected {t}")));
            }
            Ok(())
        };
        same_shape("input_ids", g, &mut self.input_ids.iter().map(Vec::len))?;
        same_shape(
            "completion_mask",
            self.completion_mask.len(),
            &mut self.completion_mask.iter().map(Vec::len),
        )?;
        for (name, arr) in [("old_logps", self.old_logps), ("ref_logps", self.ref_logps)] {
            if let Some(a) = arr {
                same_shape(name, a.len(), &mut a.iter().map(Vec::len))?;
            }
        }
        if self.advantages.len() != g {
            return Err(bad(format!(
                "advantages has {} entries for {g} sequences",
                self.advantages.len()
            )));
        }
        Ok((g, t))
    }

    /// Checks that every advantage is finite and every token id inside the vocabulary of
    /// `vocab_size`.
    fn check_advantages_and_ids(&self, vocab_size: usize) -> Result<()> {
        if let Some(a) = self.advantages.iter().find(|a| !a.is_finite()) {
            return Err(bad(format!("advantage {a} is not finite")));
        }
        for (b, row) in self.input_ids.iter().enumerate() {
            if let Some(id) = row.iter().find(|&&id| id < 0 || id as usize >= vocab_size) {
                return Err(bad(format!(
                    "token id {id} in row {b} is outside the vocabulary (size {vocab_size})"
                )));
            }
        }
        Ok(())
    }

    /// The number of completion tokens of each row, once the completion mask is checked to hold
    /// only 0/1, never to mark position 0, and to mark some token.
    fn completion_lengths(&self) -> Result<Vec<usize>> {
        let mut completion_lengths = Vec::with_capacity(self.completion_mask.len());
        for (b, row) in self.completion_mask.iter().enumerate() {
            if row.iter().any(|&m| m != 0 && m != 1) {
                return Err(bad(format!(
                    "completion_mask row {b} holds values other than 0/1"
                )));
            }
            if row[0] != 0 {
                return Err(bad(format!(
                    "completion_mask row {b} marks position 0, which has no preceding logits"
                )));
            }
            // A row without completion tokens adds nothing (TRL's mask_truncated_completions
            // leaves such rows); a batch without any is refused.
            completion_lengths.push(row.iter().filter(|&&m| m == 1).count());
        }
        if completion_lengths.iter().all(|&n| n == 0) {
            return Err(bad(
                "completion_mask marks no completion token in any row".into()
            ));
        }
        Ok(completion_lengths)
    }

    /// Checks that the old and reference log-probs given are finite at every completion position.
    fn check_logps(&self) -> Result<()> {
        for (name, arr) in [("old_logps", self.old_logps), ("ref_logps", self.ref_logps)] {
            if let Some(a) = arr {
                for (b, (row, m)) in a.iter().zip(self.completion_mask).enumerate() {
                    if let Some((p, v)) = row
                        .iter()
                        .zip(m)
                        .enumerate()
                        .find(|(_, (v, &m))| m == 1 && !v.is_finite())
                        .map(|(p, (v, _))| (p, v))
                    {
                        return Err(bad(format!("{name} row {b} position {p} is {v}")));
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks the scalar parameters: the reference log-probs `beta` needs, a positive finite
    /// temperature, non-negative `beta` and epsilons, and positive finite sapo temperatures.
    fn check_parameters(&self) -> Result<()> {
        if self.beta != 0.0 && self.ref_logps.is_none() {
            return Err(bad(
                "beta != 0 needs ref_logps (or a reference model)".into()
            ));
        }
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            return Err(bad(format!(
                "temperature {} must be above 0",
                self.temperature
            )));
        }
        let settings = [
            ("beta", self.beta),
            ("epsilon", self.epsilon_low),
            ("epsilon_high", self.epsilon_high),
        ];
        if let Some((name, value)) = settings.iter().find(|(_, v)| !(*v >= 0.0 && v.is_finite())) {
            return Err(bad(format!("{name} {value} must be a number at least 0")));
        }
        let (pos, neg) = self.sapo_temperatures;
        if !(pos > 0.0 && neg > 0.0 && pos.is_finite() && neg.is_finite()) {
            return Err(bad(format!(
                "sapo temperatures ({pos}, {neg}) must be above 0"
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
            GrpoLossType::Dapo | GrpoLossType::Cispo => {
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
        let (g, t) = batch.shape()?;
        batch.check_advantages_and_ids(vocab_size)?;
        let completion_lengths = batch.completion_lengths()?;
        batch.check_logps()?;
        batch.check_parameters()?;
        let denominators = batch.denominators(&completion_lengths)?;
        let mask = shift(batch.completion_mask);
        let weights: Vec<f64> = mask
            .iter()
            .enumerate()
            .map(|(i, &m)| m as f64 / denominators[i / t])
            .collect();
        let targets: Vec<u32> = shift(batch.input_ids)
            .into_iter()
            .map(|v| v as u32)
            .collect();
        let per_pos = |a: Option<&[Vec<f64>]>| -> Result<Option<Tensor>> {
            a.map(|a| Tensor::from_vec(shift(a), (g, t), device).map_err(ObjectiveError::from))
                .transpose()
        };
        let (pos, neg) = batch.sapo_temperatures;
        Ok(Self {
            targets: Tensor::from_vec(targets, (g, t), device)?,
            mask: Tensor::from_vec(
                mask.iter().map(|&m| m as u8).collect::<Vec<_>>(),
                (g, t),
                device,
            )?,
            weights: Tensor::from_vec(weights, (g, t), device)?,
            advantages: Tensor::from_vec(batch.advantages.to_vec(), (g, 1), device)?,
            old: per_pos(batch.old_logps)?,
            reference: if batch.beta != 0.0 {
                per_pos(batch.ref_logps)?
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
}

impl Objective for Grpo {
    fn name(&self) -> &str {
        "grpo"
    }

    fn targets(&self) -> &Tensor {
        &self.targets
    }

    fn separable(&self) -> bool {
        true
    }

    fn temperature(&self) -> f64 {
        self.temperature
    }

    fn loss(&self, logp: &Tensor, cols: Range<usize>) -> Result<Tensor> {
        let dt = logp.dtype();
        let (log_ratio, kl_arg) = self.log_ratios(logp, &cols)?;
        let r = log_ratio.exp()?;
        let a = self.advantages.to_dtype(dt)?;
        let mut per_token = match self.loss_type {
            GrpoLossType::Cispo => {
                let capped = r.clamp(f64::NEG_INFINITY, self.epsilon_high)?.detach();
                (capped.broadcast_mul(&a)? * logp)?.neg()?
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
        if let Some(d) = kl_arg {
            let mut kl = ((d.exp()? - &d)? - 1.0)?;
            if self.bias_corrected_kl {
                kl = (kl * &r)?;
            }
            per_token = (per_token + (kl * self.beta)?)?;
        }
        let w = self
            .weights
            .narrow(1, cols.start, cols.len())?
            .to_dtype(dt)?;
        Ok((per_token * w)?.sum_all()?)
    }

    fn metrics(&self, logp: &Tensor) -> Result<Vec<(String, f64)>> {
        let t = logp.dim(1)?;
        let (log_ratio, kl_arg) = self.log_ratios(logp, &(0..t))?;
        let mask = self.mask.to_dtype(DType::F64)?;
        let count = mask.sum_all()?.to_scalar::<f64>()?;
        let masked_mean = |x: &Tensor| -> Result<f64> {
            Ok((x.to_dtype(DType::F64)? * &mask)?
                .sum_all()?
                .to_scalar::<f64>()?
                / count.max(1.0))
        };
        let r = log_ratio.to_dtype(DType::F64)?.exp()?;
        let a = self.advantages.to_dtype(DType::F64)?;
        let zero = a.zeros_like()?;
        let positive = a.gt(&zero)?.broadcast_as(r.shape())?;
        // TRL's clip fractions: the clip region's for the clipped losses, the cap's for cispo (its
        // `cispo_clip_ratio`), none for sapo.
        let clipped = match self.loss_type {
            GrpoLossType::Sapo => None,
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
                masked_mean(&clipped.to_dtype(DType::F64)?)?,
            ));
        }
        if let Some(d) = kl_arg {
            let d = d.to_dtype(DType::F64)?;
            let mut kl = ((d.exp()? - &d)? - 1.0)?;
            if self.bias_corrected_kl {
                kl = (kl * &r)?;
            }
            out.push(("kl".into(), masked_mean(&kl)?));
        }
        Ok(out)
    }
}
