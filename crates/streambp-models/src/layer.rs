//! One decoder layer, decomposed into the pieces a streamed engine drives chunk by chunk:
//! input norm → q/k/v projections (with q/k norms and rope, for any range of positions) → attention core
//! for a block of queries against a block of keys/values → output projection (→ Gemma's post-attention
//! norm) → residual → MLP block with its norms → residual.
//!
//! Everything but the attention core is position-wise, so any piece can run on a chunk of positions.

use candle_core::{DType, Device, Tensor};

use crate::config::{Activation, LayerKind, ModelConfig};
use crate::error::Result;
use crate::in_f32::rounded;
use crate::layout::Layout;
use crate::linear::Linear;
use crate::lora::Projection;
use crate::norm::RmsNorm;
use crate::rope::{apply_rope, Rotary};
use crate::weights::MapWeights;
use streambp_kernels::ops::attention::{
    attention_in_layer, EarlierKeys, KeyMask, MaskStructure, Products,
};
use streambp_kernels::ops::cast::cast;
use streambp_kernels::ops::geglu::{geglu, Gelu};
pub use streambp_kernels::ops::geglu::{gelu_erf, gelu_tanh};
use streambp_kernels::ops::swiglu::swiglu;

/// Queries per attention call when a layer runs over a whole sequence ([`DecoderLayer::forward`]).
const QUERY_BLOCK: usize = 512;

/// Head counts and score transforms of the attention core.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (each shared by `num_heads / num_kv_heads` query heads).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// The factor on q·k ([`ModelConfig::attn_scale`]), applied to q.
    pub scale: f64,
}

/// The weights of one decoder layer.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    /// The layer's index in the model (its adapters' dropout masks depend on it).
    pub index: usize,
    /// The layer's attention span (sliding window or not) and rotary parameters.
    pub kind: LayerKind,
    /// Head counts and the q·k scale.
    pub shape: AttentionShape,
    /// The MLP's gate activation.
    pub activation: Activation,
    /// Inverse frequencies of the layer's rotary embedding.
    pub rotary: Rotary,
    /// The norm in front of attention (`input_layernorm`).
    pub input_norm: RmsNorm,
    /// `[heads·hd, d]`.
    pub q_proj: Linear,
    /// `[kv_heads·hd, d]`.
    pub k_proj: Linear,
    /// `[kv_heads·hd, d]`.
    pub v_proj: Linear,
    /// `[d, heads·hd]`: attention output back into the residual stream.
    pub o_proj: Linear,
    /// Qwen3/Gemma3: per-head RMSNorm of q before rope.
    pub q_norm: Option<RmsNorm>,
    /// Qwen3/Gemma3: per-head RMSNorm of k before rope.
    pub k_norm: Option<RmsNorm>,
    /// Gemma: norm of the attention output before the residual.
    pub post_attn_norm: Option<RmsNorm>,
    /// The norm in front of the MLP (`post_attention_layernorm` in Llama/Qwen,
    /// `pre_feedforward_layernorm` in Gemma).
    pub pre_mlp_norm: RmsNorm,
    /// Gemma: norm of the MLP output before the residual.
    pub post_mlp_norm: Option<RmsNorm>,
    /// `[ffn, d]`: the activated branch of the gated MLP.
    pub gate_proj: Linear,
    /// `[ffn, d]`: the linear branch, multiplied by the activated gate.
    pub up_proj: Linear,
    /// `[d, ffn]`: back into the residual stream.
    pub down_proj: Linear,
    /// The half-precision dtype whose values this layer's f32 activations are rounded to where that
    /// model's own arithmetic would round them; `None` for a layer computing in its weights' dtype
    /// ([`DecoderLayer::computed_in_f32`]).
    pub round_to: Option<DType>,
}

/// Which keys a block of queries reads: queries from index `q_start`, keys at indices
/// `k_start..k_start + K.len` (the `earlier` keys first, when given, then the ones passed with the
/// queries), in a batch laid out as `layout` (padding, packed documents).
#[derive(Debug, Clone, Copy)]
pub struct KeyBlock<'a> {
    /// Sequence index of the first query.
    pub q_start: usize,
    /// Sequence index of the first key (the first earlier key when there are any).
    pub k_start: usize,
    /// The batch's padding and document boundaries.
    pub layout: &'a Layout,
    /// Keys before the ones passed with the queries, read as constants of the graph (streamed
    /// backward); `None` when the passed keys are all the block reads.
    pub earlier: Option<&'a EarlierKeys>,
}

/// The mask of one query chunk: causal (and windowed) by index, padded keys and other documents' keys
/// hidden; built for one block of keys at a time, and not at all for a block every query reads whole.
struct ChunkMask {
    q_start: usize,
    queries: usize,
    k_start: usize,
    sliding_window: Option<usize>,
    layout: Layout,
    device: Device,
}

impl ChunkMask {
    /// Whether every query of the chunk reads every key of `first..first + n` (absolute indices).
    fn reads_whole(&self, first: usize, n: usize) -> bool {
        let last_query = self.q_start + self.queries - 1;
        let causal = first + n <= self.q_start + 1;
        let window = self.sliding_window.is_none_or(|w| first + w > last_query);
        causal && window && self.layout.key_valid.is_none() && !self.layout.is_packed()
    }

    /// `[b|1, 1, 1, c, n]` u8: 1 where query `q_start + i` may read key `first + j`.
    fn allowed(&self, first: usize, n: usize) -> Result<Tensor> {
        let c = self.queries;
        let pos = |start: i64, len: usize| Tensor::arange(start, start + len as i64, &self.device);
        let q0 = self.q_start as i64;
        let q = pos(q0, c)?.reshape((c, 1))?;
        let k = pos(first as i64, n)?.reshape((1, n))?;
        let mut allowed = k.broadcast_le(&q)?;
        if let Some(w) = self.sliding_window {
            // key > query - w
            let lowest = pos(q0 - w as i64 + 1, c)?.reshape((c, 1))?;
            allowed = (allowed * k.broadcast_ge(&lowest)?)?;
        }
        let mut allowed = match &self.layout.key_valid {
            Some(valid) => {
                let b = valid.dim(0)?;
                let valid = valid.narrow(1, first, n)?.reshape((b, 1, n))?;
                valid.broadcast_mul(&allowed.reshape((1, c, n))?)?
            }
            None => allowed.reshape((1, c, n))?,
        };
        if let Some(same) = self.layout.same_document(self.q_start, c, first, n)? {
            allowed = same.broadcast_mul(&allowed)?;
        }
        let rows = allowed.dim(0)?;
        Ok(allowed.reshape((rows, 1, 1, c, n))?)
    }
}

impl KeyMask for ChunkMask {
    fn bias(&self, start: usize, n: usize, dtype: DType) -> candle_core::Result<Option<Tensor>> {
        let first = self.k_start + start;
        if self.reads_whole(first, n) {
            return Ok(None);
        }
        // An additive mask as in transformers: 0 where allowed, the dtype's minimum elsewhere (a row
        // with no visible key, only possible at padding, becomes uniform instead of NaN).
        let floor = match dtype {
            DType::F64 => f64::MIN,
            _ => f32::MIN as f64,
        };
        let allowed = self.allowed(first, n).map_err(|e| match e {
            crate::error::ModelError::Candle(e) => e,
            other => candle_core::Error::Msg(format!("attention mask: {other}")),
        })?;
        Ok(Some(allowed.to_dtype(dtype)?.affine(-floor, floor)?))
    }

    fn structure(&self) -> Option<MaskStructure> {
        Some(MaskStructure {
            q_start: self.q_start,
            k_start: self.k_start,
            window: self.sliding_window,
            doc_start: self.layout.doc_start().cloned(),
            key_valid: self.layout.key_valid.clone(),
        })
    }
}

impl DecoderLayer {
    /// The first key index a query block starting at `q_start` can see: 0, unless a sliding window
    /// or a packed document boundary hides the earlier keys from every query of the block.
    pub fn first_visible_key(&self, q_start: usize, layout: &Layout) -> usize {
        let window = match self.kind.sliding_window {
            Some(w) => (q_start + 1).saturating_sub(w),
            None => 0,
        };
        window.max(layout.first_key_of_document(q_start))
    }

    /// The dtype the layer computes its activations in: its weights' (f32 for a half-precision
    /// layer [`DecoderLayer::computed_in_f32`]).
    pub fn dtype(&self) -> DType {
        self.input_norm.weight.dtype()
    }

    /// The input norm of the attention block.
    pub fn norm_input(&self, x: &Tensor) -> Result<Tensor> {
        self.input_norm.forward(x)
    }

    /// Queries `[batch, heads, len, head_dim]` for normed inputs at indices `start..start + len`.
    pub fn queries(&self, normed: &Tensor, start: usize, layout: &Layout) -> Result<Tensor> {
        let q = self.project_heads(normed, &self.q_proj, self.shape.num_heads, start, layout)?;
        self.norm_and_rotate(q, self.q_norm.as_ref(), start, layout)
    }

    /// Keys and values `[batch, kv_heads, len, head_dim]` for normed inputs at `start..start + len`.
    pub fn keys_values(
        &self,
        normed: &Tensor,
        start: usize,
        layout: &Layout,
    ) -> Result<(Tensor, Tensor)> {
        let heads = self.shape.num_kv_heads;
        let k = self.project_heads(normed, &self.k_proj, heads, start, layout)?;
        let k = self.norm_and_rotate(k, self.k_norm.as_ref(), start, layout)?;
        let v = self.project_heads(normed, &self.v_proj, heads, start, layout)?;
        Ok((k, v.contiguous()?))
    }

    fn project_heads(
        &self,
        normed: &Tensor,
        proj: &Linear,
        heads: usize,
        start: usize,
        layout: &Layout,
    ) -> Result<Tensor> {
        let (b, len, _) = normed.dims3()?;
        let projected = proj.forward_at(normed, start, layout.dropout_key())?;
        Ok(projected
            .reshape((b, len, heads, self.shape.head_dim))?
            .transpose(1, 2)?)
    }

    fn norm_and_rotate(
        &self,
        x: Tensor,
        norm: Option<&RmsNorm>,
        start: usize,
        layout: &Layout,
    ) -> Result<Tensor> {
        let x = match norm {
            Some(n) => n.forward(&x)?,
            None => x,
        };
        let len = x.dim(2)?;
        // Rounded like the activations: the model's own rope multiplies by tables in its dtype.
        let table_dtype = self.round_to.unwrap_or(x.dtype());
        let (cos, sin) = layout.rope_tables(&self.rotary, start, len, table_dtype, x.device())?;
        let (cos, sin) = (cast(&cos, x.dtype())?, cast(&sin, x.dtype())?);
        rounded(apply_rope(&x, &cos, &sin)?, self.round_to)
    }

    /// The attention core: queries `[b, heads, c, hd]` against keys/values `[b, kv_heads, t, hd]`,
    /// causal (and windowed) by position, padded keys and other documents' keys masked. Returns
    /// `[b, c, heads·hd]`, by [`attention_in_layer`] (GQA without repeated keys, scores softmaxed
    /// in f32, f64 for f64 models, like transformers' eager attention). A bf16 layer's products
    /// take bf16 operands, as PyTorch's bf16 attention ([`Products::Bf16`]), also when the layer
    /// is computed in f32 ([`DecoderLayer::computed_in_f32`]).
    pub fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, keys: KeyBlock) -> Result<Tensor> {
        let products = match (q.dtype(), self.round_to) {
            (DType::BF16, _) | (_, Some(DType::BF16)) => Products::Bf16,
            _ => Products::Compute,
        };
        let mask = ChunkMask {
            q_start: keys.q_start,
            queries: q.dim(2)?,
            k_start: keys.k_start,
            sliding_window: self.kind.sliding_window,
            layout: keys.layout.clone(),
            device: q.device().clone(),
        };
        let earlier = keys.earlier.cloned();
        let out = attention_in_layer(q, k, v, earlier, mask, products, self.shape.scale)?;
        rounded(out, self.round_to)
    }

    /// Output projection of the attention core's result for tokens `start..`, with Gemma's
    /// post-attention norm.
    pub fn attention_output(&self, attn: &Tensor, start: usize, layout: &Layout) -> Result<Tensor> {
        let o = self.o_proj.forward_at(attn, start, layout.dropout_key())?;
        match &self.post_attn_norm {
            Some(n) => n.forward(&o),
            None => Ok(o),
        }
    }

    /// The MLP branch (without its residual) for tokens `start..`: norm → gated MLP → Gemma's
    /// post-MLP norm.
    pub fn mlp_block(&self, x: &Tensor, start: usize, layout: &Layout) -> Result<Tensor> {
        let key = layout.dropout_key();
        let h = self.pre_mlp_norm.forward(x)?;
        let gate = self.gate_proj.forward_at(&h, start, key)?;
        let up = self.up_proj.forward_at(&h, start, key)?;
        let gated = match self.activation {
            Activation::Silu => swiglu(&gate, &up)?,
            Activation::GeluTanh => geglu(&gate, &up, Gelu::Tanh, self.round_to)?,
            Activation::Gelu => geglu(&gate, &up, Gelu::Erf, self.round_to)?,
        };
        let gated = rounded(gated, self.round_to)?;
        let m = self.down_proj.forward_at(&gated, start, key)?;
        match &self.post_mlp_norm {
            Some(n) => n.forward(&m),
            None => Ok(m),
        }
    }

    /// The rest of the layer once its attention core has given `attn` for the input `x` (tokens
    /// `start..`): the output projection into the residual stream, then the MLP block into it. The
    /// layer's residual structure, written once for every caller (whole sequences, chunks, the
    /// streamed backward, sampling).
    pub fn after_attention(
        &self,
        x: &Tensor,
        attn: &Tensor,
        start: usize,
        layout: &Layout,
    ) -> Result<Tensor> {
        let x1 = rounded(
            (x + self.attention_output(attn, start, layout)?)?,
            self.round_to,
        )?;
        rounded((&x1 + self.mlp_block(&x1, start, layout)?)?, self.round_to)
    }

    /// The layer output for the input chunk `x_c` at positions `q_start..`, given keys/values for
    /// positions `keys.k_start..` (computed by the caller, typically once for the whole sequence).
    pub fn forward_chunk(
        &self,
        x_c: &Tensor,
        k: &Tensor,
        v: &Tensor,
        keys: KeyBlock,
    ) -> Result<Tensor> {
        let normed = self.norm_input(x_c)?;
        let q = self.queries(&normed, keys.q_start, keys.layout)?;
        let attn = self.attend(&q, k, v, keys)?;
        self.after_attention(x_c, &attn, keys.q_start, keys.layout)
    }

    /// The layer over a whole sequence `[b, t, d]` laid out as `layout`. The attention runs
    /// [`QUERY_BLOCK`] queries at a time, each block against the keys up to its last query: the
    /// scores above the diagonal (half of them) are never formed.
    pub fn forward(&self, x: &Tensor, layout: &Layout) -> Result<Tensor> {
        let normed = self.norm_input(x)?;
        let (k, v) = self.keys_values(&normed, 0, layout)?;
        let q = self.queries(&normed, 0, layout)?;
        let t = x.dim(1)?;
        let mut parts = Vec::with_capacity(t.div_ceil(QUERY_BLOCK));
        for start in (0..t).step_by(QUERY_BLOCK) {
            let end = (start + QUERY_BLOCK).min(t);
            let k0 = self.first_visible_key(start, layout);
            let keys = KeyBlock {
                q_start: start,
                k_start: k0,
                layout,
                earlier: None,
            };
            parts.push(self.attend(
                &q.narrow(2, start, end - start)?,
                &k.narrow(2, k0, end - k0)?,
                &v.narrow(2, k0, end - k0)?,
                keys,
            )?);
        }
        let attn = Tensor::cat(&parts, 1)?;
        self.after_attention(x, &attn, 0, layout)
    }

    /// The projection `p` of the layer.
    pub fn projection(&self, p: Projection) -> &Linear {
        match p {
            Projection::Q => &self.q_proj,
            Projection::K => &self.k_proj,
            Projection::V => &self.v_proj,
            Projection::O => &self.o_proj,
            Projection::Gate => &self.gate_proj,
            Projection::Up => &self.up_proj,
            Projection::Down => &self.down_proj,
        }
    }

    /// The projection `p` of the layer, to change.
    pub fn projection_mut(&mut self, p: Projection) -> &mut Linear {
        match p {
            Projection::Q => &mut self.q_proj,
            Projection::K => &mut self.k_proj,
            Projection::V => &mut self.v_proj,
            Projection::O => &mut self.o_proj,
            Projection::Gate => &mut self.gate_proj,
            Projection::Up => &mut self.up_proj,
            Projection::Down => &mut self.down_proj,
        }
    }

    /// The same layer with each trained projection's weight gradient added in place into
    /// `accumulator(weight)` by the backward ([`Linear::grad_into`]); projections it gives none for,
    /// frozen ones and those with adapters keep handing their gradients to autograd.
    pub fn accumulating_into<E>(
        &self,
        mut accumulator: impl FnMut(&Tensor) -> std::result::Result<Option<Tensor>, E>,
    ) -> std::result::Result<Self, E> {
        let mut layer = self.clone();
        for p in Projection::ALL {
            let linear = layer.projection_mut(p);
            if !linear.frozen && linear.lora.is_none() {
                linear.grad_into = accumulator(&linear.weight)?;
            }
        }
        Ok(layer)
    }

    /// The attention shape of layers of `cfg`.
    pub fn attention_shape(cfg: &ModelConfig) -> AttentionShape {
        AttentionShape {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            scale: cfg.attn_scale,
        }
    }
}

impl MapWeights for DecoderLayer {
    /// The same layer cut from the graph, each projection's bf16 weight kept
    /// ([`Linear::bf16_weight`]): detaching keeps the values, which a mapping in general does not
    /// (the streamed backward recomputes a layer's keys and values detached).
    fn detached(&self) -> Self {
        let Ok(mut layer) =
            self.map_weights(&mut |t: &Tensor| Ok::<_, std::convert::Infallible>(t.detach()));
        for p in Projection::ALL {
            layer.projection_mut(p).bf16_weight = self.projection(p).bf16_weight.clone();
        }
        layer
    }

    /// The same layer with each weight (norms, projections, adapters) replaced by `f(weight)`.
    fn map_weights<E>(
        &self,
        f: &mut impl FnMut(&Tensor) -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<Self, E> {
        let mut norm = |n: &Option<RmsNorm>| n.as_ref().map(|n| n.map_weights(f)).transpose();
        let (q_norm, k_norm) = (norm(&self.q_norm)?, norm(&self.k_norm)?);
        let (post_attn_norm, post_mlp_norm) =
            (norm(&self.post_attn_norm)?, norm(&self.post_mlp_norm)?);
        Ok(Self {
            input_norm: self.input_norm.map_weights(f)?,
            q_proj: self.q_proj.map_weights(f)?,
            k_proj: self.k_proj.map_weights(f)?,
            v_proj: self.v_proj.map_weights(f)?,
            o_proj: self.o_proj.map_weights(f)?,
            q_norm,
            k_norm,
            post_attn_norm,
            pre_mlp_norm: self.pre_mlp_norm.map_weights(f)?,
            post_mlp_norm,
            gate_proj: self.gate_proj.map_weights(f)?,
            up_proj: self.up_proj.map_weights(f)?,
            down_proj: self.down_proj.map_weights(f)?,
            ..self.clone()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mask is skipped exactly for the key blocks it would leave whole.
    #[test]
    fn a_key_block_is_skipped_only_when_every_query_reads_all_of_it() {
        let dev = Device::Cpu;
        let mut skipped = 0;
        for window in [None, Some(3), Some(8)] {
            for (q_start, queries) in [(0, 4), (5, 1), (9, 6), (20, 3)] {
                for first in 0..24 {
                    for n in 1..6 {
                        let mask = ChunkMask {
                            q_start,
                            queries,
                            k_start: 0,
                            sliding_window: window,
                            layout: Layout::default(),
                            device: dev.clone(),
                        };
                        let all = mask
                            .allowed(first, n)
                            .unwrap()
                            .min_all()
                            .unwrap()
                            .to_scalar::<u8>()
                            .unwrap()
                            == 1;
                        let bias = mask.bias(first, n, DType::F64).unwrap();
                        assert_eq!(
                            bias.is_none(),
                            all,
                            "{window:?} q {q_start}+{queries} k {first}+{n}"
                        );
                        skipped += usize::from(all);
                    }
                }
            }
        }
        assert!(skipped > 0);
        // Padding or packing always build the mask.
        let valid = Tensor::new(&[[1u8, 1, 1, 1]], &dev).unwrap();
        let padded = ChunkMask {
            q_start: 3,
            queries: 1,
            k_start: 0,
            sliding_window: None,
            layout: Layout::new(Some(&valid), None).unwrap(),
            device: dev.clone(),
        };
        assert!(padded.bias(0, 2, DType::F64).unwrap().is_some());
    }
}
