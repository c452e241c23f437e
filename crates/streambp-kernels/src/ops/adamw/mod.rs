//! AdamW's update of one parameter (torch's AdamW, decoupled decay first), in place where a kernel
//! of the parameter's device does it in one pass: on the card, `triton/adamw.py` (`cuda.rs`) reads
//! the parameter, its gradient and both f32 moments once and writes the three back, where the
//! composed update (the trainer's `AdamWConfig::update`, the reference) makes about a dozen passes
//! with a buffer each. Elsewhere [`update_in_place`] answers `false` and the caller composes.

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod compiled;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod cuda_table;

use candle_core::Tensor;

use crate::backend::Backend;

type CResult<T> = candle_core::Result<T>;

/// One update's constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// The learning rate.
    pub lr: f64,
    /// The factor the parameter is first multiplied by: `1 − lr·weight_decay`, 1 without decay.
    pub decay: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the root of the corrected second moment.
    pub eps: f64,
    /// `(1 − β1ᵗ, 1 − β2ᵗ)` of update number t.
    pub bias_corrections: (f64, f64),
}

/// Updates `p` and its f32 moments `m` and `v` in place by one step with the gradient `g` (`p`'s
/// dtype or f32), where a kernel of their device does it (the card, for bf16 and f32 parameters
/// laid out contiguously): `p ← p·decay; m ← β1·m + (1 − β1)·g; v ← β2·v + (1 − β2)·g²;
/// p ← p − lr·(m / bc1) / (√(v / bc2) + eps)`, in f32, p rounded once. Answers `false` (and changes
/// nothing) where none does, and the caller composes the update.
pub fn update_in_place(
    p: &Tensor,
    g: &Tensor,
    (m, v): (&Tensor, &Tensor),
    step: &AdamWStep,
) -> CResult<bool> {
    match Backend::of(p) {
        #[cfg(feature = "cuda")]
        Backend::Cuda => cuda::update(p, g, (m, v), step),
        _ => {
            let _ = (g, m, v, step);
            Ok(false)
        }
    }
}
