//! Distillation from a teacher as TRL 1.16's `DistillationTrainer` computes it
//! (`_chunked_divergence_loss`): at each completion position, a divergence between the student's
//! next-token distribution `p_s = softmax(z_s / T)` and the teacher's `p_t = softmax(z_t / T)`
//! (each model's logits soft-capped first), summed over the batch's completion positions and divided
//! by their number:
//! - `beta = 0`: the forward KL, `KL(p_t ‖ p_s)`;
//! - `beta = 1`: the reverse KL, `KL(p_s ‖ p_t)`;
//! - between: the generalized Jensen-Shannon divergence `β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m)`,
//!   `m = (1 − β)·p_s + β·p_t`.
//!
//! It reads the whole distribution at each position ([`Objective::reads_logits`]): the engine hands
//! it the student's logits chunk by chunk, and it asks its [`TeacherLogits`] for the teacher's of
//! the same positions, so neither model's logits exist for the whole sequence.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};
use streambp_kernels::ops::divergence::generalized_jsd;

use crate::rollouts::{bad, shift};
use crate::{Objective, ObjectiveError, Result};

/// Where a distillation batch's teacher logits come from (a closure of the positions is one).
pub trait TeacherSource: Send + Sync {
    /// The teacher's logits `[batch, cols.len(), V]` (soft-capped, before the temperature) at
    /// logits positions `cols` (position `t` predicts `input_ids[t + 1]`).
    fn logits(&self, cols: Range<usize>) -> Result<Tensor>;

    /// Frees what only [`TeacherSource::logits`] reads (the teacher's hidden states), to be made
    /// again if they are asked for later: the engine's head has read every chunk of its backward.
    fn release(&self) {}
}

impl<F> TeacherSource for F
where
    F: Fn(Range<usize>) -> Result<Tensor> + Send + Sync,
{
    fn logits(&self, cols: Range<usize>) -> Result<Tensor> {
        self(cols)
    }
}

/// A distillation batch's teacher logits.
pub type TeacherLogits = Box<dyn TeacherSource>;

/// A distillation batch: rows whose completions the student learns the teacher's distributions on.
pub struct DistillBatch<'a> {
    /// `[B][T]` token ids, prompt then completion, right-padded.
    pub input_ids: &'a [Vec<i64>],
    /// `[B][T]`, 1 at the completion tokens whose predicting position counts (never position 0).
    pub completion_mask: &'a [Vec<i64>],
    /// The divergence, in `[0, 1]` (TRL's `beta`, default 1: the reverse KL).
    pub beta: f64,
    /// Both distributions are of `logits / temperature` (TRL's `temperature`, default 1).
    pub temperature: f64,
}

/// The distillation objective of one batch, built from a [`DistillBatch`] and its teacher.
pub struct Distill {
    /// `[B, T]` in logits coordinates (the next tokens; read for the metrics only).
    targets: Tensor,
    /// `[B, T]` u8: the positions that predict a completion token.
    mask: Tensor,
    /// How many positions count.
    count: f64,
    beta: f64,
    temperature: f64,
    teacher: TeacherLogits,
}

impl std::fmt::Debug for Distill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Distill")
            .field("count", &self.count)
            .field("beta", &self.beta)
            .field("temperature", &self.temperature)
            .finish_non_exhaustive()
    }
}

impl DistillBatch<'_> {
    /// The rows as [`crate::Rollouts`] without log-probs.
    fn rollouts(&self) -> crate::Rollouts<'_> {
        crate::Rollouts {
            input_ids: self.input_ids,
            completion_mask: self.completion_mask,
            old_logps: None,
            ref_logps: None,
        }
    }

    /// Checks the batch (rectangular rows, ids inside `vocab_size`, a 0/1 mask that never marks
    /// position 0 and marks some token, `beta` in `[0, 1]`, a temperature above 0); returns each
    /// row's completion tokens.
    pub fn check(&self, vocab_size: usize) -> Result<Vec<usize>> {
        let (_, lengths) = self.rollouts().check(&[], vocab_size)?;
        if !(0.0..=1.0).contains(&self.beta) {
            return Err(bad(format!("beta {} must be in [0, 1]", self.beta)));
        }
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            return Err(bad(format!(
                "temperature {} must be above 0",
                self.temperature
            )));
        }
        Ok(lengths)
    }
}

impl Distill {
    /// [Checks](DistillBatch::check) `batch` and moves it to `device`, with the `teacher`'s logits
    /// to compare against.
    pub fn new(
        batch: &DistillBatch,
        teacher: TeacherLogits,
        vocab_size: usize,
        device: &Device,
    ) -> Result<Self> {
        let lengths = batch.check(vocab_size)?;
        let rollouts = batch.rollouts();
        let (b, t) = (batch.input_ids.len(), batch.input_ids[0].len());
        let mask: Vec<u8> = shift(batch.completion_mask)
            .into_iter()
            .map(|m| m as u8)
            .collect();
        Ok(Self {
            targets: rollouts.targets(device)?,
            mask: Tensor::from_vec(mask, (b, t), device)?,
            count: lengths.iter().sum::<usize>() as f64,
            beta: batch.beta,
            temperature: batch.temperature,
            teacher,
        })
    }

    /// `Σ m·x / count` over positions `cols` of `x` (`[b, cols.len()]`).
    fn share(&self, x: &Tensor, cols: &Range<usize>) -> Result<Tensor> {
        let mask = self.mask.narrow(1, cols.start, cols.len())?;
        let zeros = x.zeros_like()?;
        Ok((mask.where_cond(x, &zeros)?.sum_all()? / self.count)?)
    }
}

impl Objective for Distill {
    fn name(&self) -> &str {
        "distill"
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

    fn loss(&self, _logp: &Tensor, _cols: Range<usize>) -> Result<Tensor> {
        Err(ObjectiveError::Loss(
            "distill reads the student's logits, not its target log-probs: run it through an \
             engine that honours Objective::reads_logits"
                .into(),
        ))
    }

    fn reads_logits(&self) -> bool {
        true
    }

    fn logits_loss(&self, logits: &Tensor, cols: Range<usize>) -> Result<Tensor> {
        let teacher = self
            .teacher
            .logits(cols.clone())?
            .to_dtype(logits.dtype())?;
        let teacher = match self.temperature == 1.0 {
            true => teacher,
            false => teacher.affine(1.0 / self.temperature, 0.0)?,
        };
        // One op whose backward writes the student's gradient out (on the host): the chunk holds
        // two logits and one gradient rather than autograd's log-softmaxes and mixture.
        let divergence = generalized_jsd(logits, &teacher, self.beta)?;
        self.share(&divergence, &cols)
    }

    /// The teacher's hidden states are read by the head alone: freed before the layers' backward.
    fn head_done(&self) {
        self.teacher.release();
    }

    /// TRL's `entropy`: the student's mean entropy over the counted positions.
    fn metrics_with_entropy(
        &self,
        _logp: &Tensor,
        entropy: Option<&Tensor>,
    ) -> Result<Vec<(String, f64)>> {
        let Some(entropy) = entropy else {
            return Ok(Vec::new());
        };
        let t = entropy.dim(1)?;
        let mean = self.share(&entropy.to_dtype(DType::F64)?, &(0..t))?;
        Ok(vec![("entropy".into(), mean.to_scalar::<f64>()?)])
    }
}
