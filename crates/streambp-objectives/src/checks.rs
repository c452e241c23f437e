//! Argument checks the objectives share: the same rule, and the same message, wherever it applies.

use std::ops::Range;

use candle_core::Tensor;

use crate::{ObjectiveError, Result};

/// Validates a positive, finite `β`.
pub(crate) fn check_beta(beta: f64) -> Result<()> {
    if !beta.is_finite() || beta <= 0.0 {
        return Err(ObjectiveError::Batch(format!(
            "beta must be positive, got {beta}"
        )));
    }
    Ok(())
}

/// Validates an NLL token count given from outside (data-parallel steps pass the micro-batch's).
pub(crate) fn check_nll_tokens(tokens: f64) -> Result<f64> {
    if !tokens.is_finite() || tokens <= 0.0 {
        return Err(ObjectiveError::Batch(format!(
            "the NLL's token count must be positive, got {tokens}"
        )));
    }
    Ok(tokens)
}

/// Refuses the first value that is not finite, naming it as `what` (`reference log-prob`, `margin`).
pub(crate) fn check_finite<'a>(
    what: &str,
    values: impl IntoIterator<Item = &'a f64>,
) -> Result<()> {
    match values.into_iter().find(|v| !v.is_finite()) {
        Some(v) => Err(ObjectiveError::Batch(format!("{what} {v} is not finite"))),
        None => Ok(()),
    }
}

/// Refuses a chunk of positions: a loss that is not a sum over positions (DPO's, KTO's, a reward
/// model's, ...) is asked for all of `targets`' positions at once; `name` says whose loss it is.
pub(crate) fn check_all_positions(name: &str, cols: &Range<usize>, targets: &Tensor) -> Result<()> {
    if cols.start != 0 || cols.len() != targets.dim(1)? {
        return Err(ObjectiveError::Batch(format!(
            "{name} needs all positions at once: its loss is not a sum over them"
        )));
    }
    Ok(())
}
