//! Half precision as the host computes it: a bf16 (or f16) layer on the CPU runs as the same layer
//! with f32 weights whose activations hold the model's dtype's values, each op computing in f32 and
//! its output rounded in place where the model's own arithmetic rounds. Every op then runs its f32
//! kernel, autograd's nodes are f32 and no cast sits between them; the forward is still the
//! half-precision model's. A card computes half precision as it is, so none of this applies there.
//!
//! The policy is set here ([`DecoderLayer::computed_in_f32`]) and carried out by each piece: the
//! norms and projections round their outputs ([`RmsNorm::round_to`],
//! [`crate::linear::Linear::round_to`], and LoRA's base output,
//! [`crate::lora::LoraAdapter::round_base_to`]), the layer the rest of its ops' and its residual
//! sums ([`rounded`]).

use candle_core::{DType, Tensor, TensorId, Var};

use crate::error::Result;
use crate::layer::DecoderLayer;
use crate::lora::Projection;
use crate::norm::RmsNorm;
use crate::weights::MapWeights;

/// A half-precision layer as the host computes it ([`DecoderLayer::computed_in_f32`]): the same
/// layer with f32 weights, rounding its activations to the model's dtype, and the f32 variable
/// standing in for each trained weight, which the layer's gradients land on.
pub struct InF32 {
    /// The layer to compute with.
    pub layer: DecoderLayer,
    /// Each trained weight's stand-in, by the weight's id.
    stand_ins: Vec<(TensorId, Var)>,
}

impl InF32 {
    /// `params` (the model's parameters of this layer) with each trained weight's stand-in in its
    /// place: where to read the layer's gradients from.
    pub fn parameters(&self, params: &[(String, Var)]) -> Vec<(String, Var)> {
        let stand_in = |var: &Var| {
            let found = self.stand_ins.iter().find(|(id, _)| *id == var.id());
            found.map_or_else(|| var.clone(), |(_, v)| v.clone())
        };
        params
            .iter()
            .map(|(name, var)| (name.clone(), stand_in(var)))
            .collect()
    }
}

/// `t` rounded in place to `to`'s values, where there is one (`None`: `t` as it is). `t` must be
/// the fresh, contiguous output of an op whose backward does not read it (every op of a layer's:
/// the products, norms, rope, SwiGLU, the attention, sums).
pub(crate) fn rounded(t: Tensor, to: Option<DType>) -> Result<Tensor> {
    if let Some(dtype) = to {
        streambp_kernels::ops::cast::round_in_place(&t, dtype)?;
    }
    Ok(t)
}

impl DecoderLayer {
    /// This layer as the host computes it when it is half precision (bf16, f16) on the CPU (the
    /// module doc); `None` elsewhere (it runs as it is). Its weights are widened to f32 (one
    /// layer's copy at a time: the caller's to keep for a phase); gradients flow in f32, those of
    /// trained weights landing on f32 stand-ins ([`InF32::parameters`]). A bf16 layer's forward
    /// products, whose operands both hold bf16 values, may run on the CPU's bf16 arithmetic from
    /// the bf16 weights ([`crate::linear::Linear::bf16_weight`]), and so may its backward's, from
    /// those weights and the gradient rounded to bf16, as bf16 autograd holds it. The adapters, in
    /// f32 already, are shared; the base output under each is rounded before the adapter's term is
    /// added to it, as PEFT adds it ([`crate::lora::LoraAdapter::round_base_to`]).
    pub fn computed_in_f32(&self) -> Result<Option<InF32>> {
        let dtype = self.input_norm.weight.dtype();
        let half = matches!(dtype, DType::BF16 | DType::F16);
        if !(half && self.input_norm.weight.device().is_cpu()) {
            return Ok(None);
        }
        let mut stand_ins = Vec::new();
        let mut widen = |t: &Tensor| -> candle_core::Result<Tensor> {
            if t.dtype() != dtype {
                return Ok(t.clone());
            }
            let values = streambp_kernels::ops::cast::widened_values(t)?;
            if !t.is_variable() {
                return Tensor::from_vec(values, t.shape(), t.device());
            }
            let var = Var::from_vec(values, t.shape(), t.device())?;
            stand_ins.push((t.id(), var.clone()));
            Ok(var.as_tensor().clone())
        };
        let mut layer = self.map_weights(&mut widen)?;
        layer.round_to = Some(dtype);
        layer.each_norm_mut(|norm| norm.round_to = Some(dtype));
        for p in Projection::ALL {
            // The forward's products may run from the bf16 weights ([`Linear::bf16_weight`]).
            let weight = &self.projection(p).weight;
            let bf16_weight = (weight.dtype() == DType::BF16).then(|| weight.detach());
            let projection = layer.projection_mut(p);
            projection.bf16_weight = bf16_weight;
            projection.round_to = Some(dtype);
            if let Some(adapter) = projection.lora.as_mut() {
                adapter.round_base_to = Some(dtype);
            }
        }
        Ok(Some(InF32 { layer, stand_ins }))
    }

    /// `f` on each of the layer's norms.
    fn each_norm_mut(&mut self, mut f: impl FnMut(&mut RmsNorm)) {
        let optional = [
            &mut self.q_norm,
            &mut self.k_norm,
            &mut self.post_attn_norm,
            &mut self.post_mlp_norm,
        ];
        for norm in optional.into_iter().flatten() {
            f(norm);
        }
        f(&mut self.input_norm);
        f(&mut self.pre_mlp_norm);
    }
}
