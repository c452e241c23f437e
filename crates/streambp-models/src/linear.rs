//! A dense projection `x Wᵀ + b` over the last dimension of a tensor of any rank, with an optional LoRA
//! adapter, and a frozen mode in which the weight gets no gradient (not even a discarded one).

use candle_core::{DType, Tensor};

use crate::error::{ModelError, Result};
use crate::lora::{DropoutKey, LoraAdapter};
use crate::weights::MapWeights;

/// A projection's weight and optional bias, applied as `x Wᵀ + b`, plus an adapter's
/// `s · (dropout(x) Aᵀ) Bᵀ` where it has one.
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out, in]`, as stored by transformers.
    pub weight: Tensor,
    /// `[out]`, where the layer has one.
    pub bias: Option<Tensor>,
    /// The weight and bias are constants (a LoRA model's base): the backward computes the input's
    /// gradient only.
    pub frozen: bool,
    /// The LoRA adapter, where one sits on this projection (its base is then always frozen).
    pub lora: Option<LoraAdapter>,
    /// A trained weight's gradient accumulator (`[out, in]`, held by its owner alone): the backward adds
    /// `dW` into it in place and gives autograd none for the weight (CPU, f32/f64; elsewhere it hands
    /// `dW` to autograd as usual). The streamed backward sets it for each chunk's graph, so a chunk
    /// makes no weight-sized buffer.
    pub grad_into: Option<Tensor>,
    /// In a bf16 layer computed in f32 ([`crate::layer::DecoderLayer::computed_in_f32`]), the bf16
    /// weight `weight` was widened from: the forward's product, whose input holds bf16 values too,
    /// runs from it on the CPU's bf16 arithmetic where that is faster
    /// ([`streambp_kernels::ops::linear::Weight`]), and the backward's products from it and the
    /// gradient rounded to bf16. Gradients still land on `weight`. It is
    /// the model's own weight, which an optimizer step changes in place while `weight` is a copy:
    /// such a layer is made for one phase of one step, and must not outlive it.
    pub bf16_weight: Option<Tensor>,
    /// In a half-precision layer computed in f32, the dtype whose values the output is rounded to
    /// ([`crate::in_f32`]); `None` elsewhere.
    pub round_to: Option<DType>,
}

impl Linear {
    /// A trainable projection with these weights and no adapter.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            weight,
            bias,
            frozen: false,
            lora: None,
            grad_into: None,
            bf16_weight: None,
            round_to: None,
        }
    }

    /// The weight as the ops read it.
    fn op_weight(&self) -> streambp_kernels::ops::linear::Weight<'_> {
        streambp_kernels::ops::linear::Weight {
            tensor: &self.weight,
            bf16: self.bf16_weight.as_ref(),
        }
    }

    /// `x Wᵀ + b` (+ the adapter, without dropout) for `x` `[.., in]`: `[.., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_at(x, 0, None)
    }

    /// [`Linear::forward`] for the tokens `start..` of a `[b, len, in]` input, whose adapter's dropout
    /// masks come from `dropout` (none without a key).
    pub fn forward_at(
        &self,
        x: &Tensor,
        start: usize,
        dropout: Option<DropoutKey>,
    ) -> Result<Tensor> {
        crate::in_f32::rounded(self.unrounded(x, start, dropout)?, self.round_to)
    }

    /// [`Linear::forward_at`] before its rounding ([`Linear::round_to`]).
    fn unrounded(&self, x: &Tensor, start: usize, dropout: Option<DropoutKey>) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let Some((inner, lead)) = dims.split_last() else {
            return Err(ModelError::Input(
                "a linear layer needs at least a 1-d input".into(),
            ));
        };
        if self.lora.is_none() && !self.frozen {
            // Any leading dimensions: no reshape nodes in the graph (see `streambp_kernels::ops::linear::trained_linear`).
            let y = streambp_kernels::ops::linear::trained_linear(
                x,
                self.op_weight(),
                self.grad_into.as_ref(),
            )?;
            return Ok(match &self.bias {
                Some(b) => y.broadcast_add(b)?,
                None => y,
            });
        }
        let rows: usize = lead.iter().product();
        let x2 = x.reshape((rows, *inner))?;
        let y = match (&self.lora, self.frozen) {
            (Some(adapter), _) => {
                let batch_rows = if lead.len() > 1 { lead[0] } else { 1 };
                let base = (self.op_weight(), self.bias.as_ref());
                adapter.forward(&x2, base, batch_rows, start, dropout)?
            }
            (None, _) => streambp_kernels::ops::linear::frozen_linear(
                &x2,
                self.op_weight(),
                self.bias.as_ref(),
            )?,
        };
        let mut out_shape = lead.to_vec();
        out_shape.push(self.weight.dim(0)?);
        Ok(y.reshape(out_shape)?)
    }
}

impl MapWeights for Linear {
    /// The same projection with each weight (the adapter's too) replaced by `f(weight)`, and no
    /// gradient accumulator or bf16 weight (each belongs to the weight it was made for).
    fn map_weights<E>(
        &self,
        f: &mut impl FnMut(&Tensor) -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<Self, E> {
        Ok(Self {
            weight: f(&self.weight)?,
            bias: self.bias.as_ref().map(&mut *f).transpose()?,
            frozen: self.frozen,
            lora: self.lora.as_ref().map(|a| a.map_weights(f)).transpose()?,
            grad_into: None,
            bf16_weight: None,
            round_to: self.round_to,
        })
    }
}
