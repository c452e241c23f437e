//! A dense projection `x Wᵀ + b` over the last dimension of a tensor of any rank.

use candle_core::Tensor;

use crate::error::{ModelError, Result};

/// A projection's weight and optional bias, applied as `x Wᵀ + b`.
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out, in]`, as stored by transformers.
    pub weight: Tensor,
    /// `[out]`, where the layer has one.
    pub bias: Option<Tensor>,
}

impl Linear {
    /// A projection with these weights.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }

    /// `x Wᵀ + b` for `x` `[.., in]`: `[.., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let Some((inner, lead)) = dims.split_last() else {
            return Err(ModelError::Input(
                "a linear layer needs at least a 1-d input".into(),
            ));
        };
        let rows: usize = lead.iter().product();
        let y = x.reshape((rows, *inner))?.matmul(&self.weight.t()?)?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        let mut out_shape = lead.to_vec();
        out_shape.push(self.weight.dim(0)?);
        Ok(y.reshape(out_shape)?)
    }

    /// The same projection with its weights cut from the graph.
    pub fn detached(&self) -> Self {
        Self {
            weight: self.weight.detach(),
            bias: self.bias.as_ref().map(Tensor::detach),
        }
    }
}
