//! The layers' RMSNorm: its weight, epsilon and style, applied by
//! [`streambp_kernels::ops::rms_norm`].

use candle_core::{DType, Tensor};

use crate::config::NormStyle;
use crate::error::Result;
use crate::weights::MapWeights;

/// An RMSNorm over the last dimension.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    /// `[dim]`: the per-feature scale (applied as `w` or `1 + w`, per `style`).
    pub weight: Tensor,
    /// Added to the mean square before the square root.
    pub eps: f64,
    /// How the weight is applied.
    pub style: NormStyle,
    /// In a half-precision layer computed in f32, the dtype whose values the output is rounded to
    /// ([`crate::in_f32`]); `None` elsewhere.
    pub round_to: Option<DType>,
}

impl RmsNorm {
    /// A norm with these parts.
    pub fn new(weight: Tensor, eps: f64, style: NormStyle) -> Self {
        Self {
            weight,
            eps,
            style,
            round_to: None,
        }
    }

    /// `x / rms(x)` over the last dimension, scaled by the weight; same shape and dtype as `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let norm = streambp_kernels::ops::rms_norm::rms_norm;
        crate::in_f32::rounded(norm(x, &self.weight, self.eps, self.style)?, self.round_to)
    }
}

impl MapWeights for RmsNorm {
    /// The same norm with its weight replaced by `f(weight)`.
    fn map_weights<E>(
        &self,
        f: &mut impl FnMut(&Tensor) -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<Self, E> {
        Ok(Self {
            weight: f(&self.weight)?,
            ..self.clone()
        })
    }
}
