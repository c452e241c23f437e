//! Training objectives, written over the log-probabilities of target tokens.
//!
//! A loss of one's own implements [`Objective`]; `examples/custom_objective.rs` writes one and runs it
//! through `streambp-core`'s engine, its streamed gradient checked against the full backward:
//! `cargo run --release -p streambp-objectives --example custom_objective`.
//!
//! Every objective here (SFT cross entropy, DPO, KTO, ORPO, CPO, GRPO) depends on the logits only through
//! `logp[b, t] = log softmax(logits[b, t])[target[b, t]]`: the log-prob, at logits position `t`, of the
//! token the objective scores there. `logp` is tiny (`[batch, T]`), so an engine can stream the LM head
//! over chunks of positions, hand each chunk's `logp` to the objective, and backpropagate
//! `Σ (dLoss/dlogp) · logp` through that chunk's logits: the exact gradient without the `T × V` logits.
//!
//! Objectives that are sums over positions ([`Objective::separable`]) get their loss chunk by chunk;
//! the others (DPO's sequence-level sigmoid) get all of `logp` at once after a first pass.
//!
//! Exports: the [`Objective`] trait; [`Sft`], [`Dpo`], [`Kto`] (unpaired rows, [`KtoLoss`]), the
//! reference-free [`Orpo`] and [`Cpo`], a reward model's [`RewardModel`]
//! (SimPO, AlphaPO: [`CpoLoss`]) over a batch's [`PairRows`], and [`Grpo`] (built from a
//! [`GrpoBatch`], reduced per [`GrpoLossType`]); [`TokenTargets`] and [`IGNORE_INDEX`] for HF-style labels; [`ObjectiveError`].
//!
//! The crate knows no model and no engine: it sees target ids and their log-probs, never logits,
//! hidden states or parameters, and it does not decide how positions are chunked.

#![warn(missing_docs)]

use std::ops::Range;

use candle_core::Tensor;

mod checks;
pub mod cpo;
pub mod distill;
pub mod dpo;
pub mod dpo_loss;
pub mod grpo;
pub mod kto;
pub mod orpo;
pub mod pairs;
pub mod reward;
pub mod rloo;
pub mod rollouts;
pub mod settings;
pub mod sft;
mod targets;

pub use cpo::{Cpo, CpoLoss, CpoLossType};
pub use distill::{Distill, DistillBatch, TeacherLogits, TeacherSource};
pub use dpo::Dpo;
pub use dpo_loss::{DpoLoss, DpoLossType};
pub use grpo::{EntropyPool, Grpo, GrpoBatch, GrpoLossType, ImportanceSampling, VespoGamma};
pub use kto::{Kto, KtoLoss, KtoLossType};
pub use orpo::Orpo;
pub use pairs::PairRows;
pub use reward::{pooled_positions, RewardModel};
pub use rloo::{Rloo, RlooBatch};
pub use rollouts::Rollouts;
pub use settings::LossSettings;
pub use sft::Sft;
pub use targets::{TokenTargets, IGNORE_INDEX};

/// Errors of objective construction and evaluation.
#[derive(Debug, thiserror::Error)]
pub enum ObjectiveError {
    /// Inputs the objective cannot be built from: ragged or empty rows, ids outside the vocabulary,
    /// a row with no target, non-finite or out-of-range values, an unknown loss type.
    #[error("invalid batch: {0}")]
    Batch(String),
    /// A loss configured as the reference refuses it: an unknown loss type, weights that do not
    /// match the types, a constant out of its range.
    #[error("{0}")]
    Loss(String),
    /// From a candle tensor op.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// `Result` with [`ObjectiveError`].
pub type Result<T> = std::result::Result<T, ObjectiveError>;

/// A loss over target log-probabilities. `Send + Sync` so the engine can evaluate it on a worker
/// thread.
pub trait Objective: Send + Sync {
    /// Short name (`sft`, `dpo`, `grpo`).
    fn name(&self) -> &str;

    /// `[batch, T]` u32: the token whose log-prob is read at each logits position (any valid id where
    /// the loss does not look).
    fn targets(&self) -> &Tensor;

    /// Whether the loss is a sum of per-position terms, so that `loss(logp_c, c)` summed over chunks `c`
    /// is the loss. When false the engine calls `loss` once with all positions.
    fn separable(&self) -> bool;

    /// The loss (a scalar tensor) from `logp` of positions `cols` (`[batch, cols.len()]`), differentiable
    /// in `logp`. For separable objectives this is the share of those positions. On a reward model
    /// (a score head) `logp` holds each position's score instead.
    fn loss(&self, logp: &Tensor, cols: Range<usize>) -> Result<Tensor>;

    /// Metrics of the batch from the final `[batch, T]` log-probs (DPO rewards, GRPO clip ratio…).
    fn metrics(&self, _logp: &Tensor) -> Result<Vec<(String, f64)>> {
        Ok(Vec::new())
    }

    /// Whether the loss reads each position's entropy beside its target log-prob (GRPO's entropy
    /// bonus and high-entropy token mask): the engine then computes `H = −Σ_v p_v log p_v` of
    /// `p = softmax(logits / temperature)` at every position, chunk by chunk as the log-probs, and
    /// backpropagates through it too (`dH/dz = −p ⊙ (log p + H)`).
    fn reads_entropy(&self) -> bool {
        false
    }

    /// [`Objective::loss`] of an objective that [reads the entropy](Objective::reads_entropy):
    /// from `logp` and `entropy` of positions `cols` (both `[batch, cols.len()]`), differentiable in
    /// both.
    fn loss_with_entropy(
        &self,
        logp: &Tensor,
        _entropy: &Tensor,
        cols: Range<usize>,
    ) -> Result<Tensor> {
        self.loss(logp, cols)
    }

    /// Whether the loss reads the student's whole next-token distribution at each position
    /// (distillation), not only its targets' log-probs: the engine then hands
    /// [`Objective::logits_loss`] each chunk's logits divided by the temperature, and backpropagates
    /// through them. Such a loss is separable.
    fn reads_logits(&self) -> bool {
        false
    }

    /// The loss of positions `cols` from their tempered logits (`[batch, cols.len(), V]`),
    /// differentiable in them, for an objective that [reads the logits](Objective::reads_logits).
    fn logits_loss(&self, _logits: &Tensor, _cols: Range<usize>) -> Result<Tensor> {
        Err(ObjectiveError::Loss(format!(
            "{} reads target log-probs, not logits",
            self.name()
        )))
    }

    /// Called by a streaming engine once its head has read every logits chunk of a backward, before
    /// the layers' backward: the objective may free what only the head reads (distillation's
    /// teacher hidden states), making it again should a later backward ask for it.
    fn head_done(&self) {}

    /// [`Objective::metrics`] with the final `[batch, T]` entropies where the objective reads them
    /// (or, for one that reads the logits, the student's entropies, for its metrics).
    fn metrics_with_entropy(
        &self,
        logp: &Tensor,
        _entropy: Option<&Tensor>,
    ) -> Result<Vec<(String, f64)>> {
        self.metrics(logp)
    }

    /// The temperature the log-probs are taken at: `log softmax(logits / temperature)`, as TRL's
    /// GRPO scores completions at the temperature it sampled them with. 1 for the others.
    fn temperature(&self) -> f64 {
        1.0
    }
}
