//! RMSNorm, composed from differentiable ops (candle's fused `rms_norm` records no backward and
//! rejects f64). Statistics are computed in f32 (f64 for an f64 model) as transformers does.

use candle_core::{DType, Tensor, D};

use crate::config::NormStyle;
use crate::error::Result;

/// An RMSNorm over the last dimension.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    /// `[dim]`: the per-feature scale (applied as `w` or `1 + w`, per `style`).
    pub weight: Tensor,
    /// Added to the mean square before the square root.
    pub eps: f64,
    /// How the weight is applied.
    pub style: NormStyle,
}

impl RmsNorm {
    /// A norm with these parts.
    pub fn new(weight: Tensor, eps: f64, style: NormStyle) -> Self {
        Self { weight, eps, style }
    }

    /// `x / rms(x)` over the last dimension, scaled by the weight; same shape and dtype as `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let compute = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let xf = x.to_dtype(compute)?;
        let inv_rms = (xf.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?
            .sqrt()?
            .recip()?;
        let normed = xf.broadcast_mul(&inv_rms)?;
        Ok(match self.style {
            NormStyle::CastThenScale => normed.to_dtype(dtype)?.broadcast_mul(&self.weight)?,
            NormStyle::OnePlusWeightInF32 => {
                let scale = (self.weight.to_dtype(compute)? + 1.0)?;
                normed.broadcast_mul(&scale)?.to_dtype(dtype)?
            }
        })
    }

    /// The same norm with its weight cut from the graph.
    pub fn detached(&self) -> Self {
        Self {
            weight: self.weight.detach(),
            ..self.clone()
        }
    }
}
