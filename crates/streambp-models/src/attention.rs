//! The attention core as one differentiable op. Composed from tensor ops, autograd would keep the
//! scores, the masked scores, the probabilities (and their f32 copies) in the graph and build a gradient
//! for each: about a dozen `heads × queries × keys` tensors. This op computes the probabilities, uses and
//! drops them in the forward, and recomputes them in the backward (FlashAttention's trade, at the
//! granularity of a query block): the graph holds only q, k, v and the output, and no score-sized tensor
//! outlives the forward or the backward. Built from candle ops, so it runs on every backend.
//!
//! Shapes (GQA without repeating K/V): q `[b, kv_heads, group·c, hd]` (already scaled), k and v
//! `[b, kv_heads, t, hd]`, additive mask `[rows, 1, 1, c, t]` (rows = b or 1), output like q.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Storage, Tensor, D};

use crate::error::Result;

struct Attention {
    /// Additive mask in the compute dtype (0 where allowed, the dtype's minimum elsewhere).
    bias: Tensor,
    group: usize,
    /// The softmax's dtype: f32 (f64 for f64 models), like transformers' eager attention.
    compute: DType,
    /// The forward's result, computed before the op is recorded; the op's forward only hands it over.
    out: Mutex<Option<Tensor>>,
}

impl Attention {
    /// Softmax probabilities `[b, kv_heads, group, c, t]` in the compute dtype (no graph).
    fn probs(&self, q: &Tensor, k: &Tensor) -> candle_core::Result<Tensor> {
        let (b, kv_heads, rows, _) = q.dims4()?;
        let c = rows / self.group;
        let t = k.dim(2)?;
        let scores = q
            .matmul(&k.t()?)?
            .to_dtype(self.compute)?
            .reshape((b, kv_heads, self.group, c, t))?
            .broadcast_add(&self.bias)?;
        candle_nn::ops::softmax_last_dim(&scores)
    }

    /// `probs` in the model dtype as `[b, kv_heads, group·c, t]`.
    fn flat(&self, p: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
        let (b, kv_heads, group, c, t) = p.dims5()?;
        p.to_dtype(dtype)?.reshape((b, kv_heads, group * c, t))
    }

    fn take_out(&self) -> candle_core::Result<Tensor> {
        self.out
            .lock()
            .map_err(|_| candle_core::Error::Msg("attention: poisoned lock".into()))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg("attention: forward run twice".into()))
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "streambp-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = self.take_out()?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("attention: output on another device than its inputs"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out = self.take_out()?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((s.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("attention: output on another device than its inputs"),
        }
    }

    /// With `P` recomputed: `dV = Pᵀ g`, `dP = g Vᵀ`, `dS = P ⊙ (dP − Σ_keys P ⊙ dP)` (the softmax's
    /// backward), `dQ = dS K`, `dK = dSᵀ Q`: the same products autograd forms through the composition.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (q, k, v, grad) = (q.detach(), k.detach(), v.detach(), grad.detach());
        let dtype = q.dtype();
        let p = self.probs(&q, &k)?;
        let grad_v = self.flat(&p, dtype)?.t()?.matmul(&grad)?;
        let grad_p = grad
            .matmul(&v.t()?)?
            .to_dtype(self.compute)?
            .reshape(p.shape())?;
        let dot = (&grad_p * &p)?.sum_keepdim(D::Minus1)?;
        let grad_s = self.flat(&(p * grad_p.broadcast_sub(&dot)?)?, dtype)?;
        let grad_q = grad_s.matmul(&k)?;
        let grad_k = grad_s.t()?.matmul(&q)?;
        Ok((Some(grad_q), Some(grad_k), Some(grad_v)))
    }
}

/// `softmax(q kᵀ + bias) v` per key/value head, differentiable in q, k and v, holding no score-sized
/// tensor in the graph (see the module doc for shapes).
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    group: usize,
    compute: DType,
) -> Result<Tensor> {
    let op = Attention {
        bias: bias.detach(),
        group,
        compute,
        out: Mutex::new(None),
    };
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    let out = op
        .flat(&op.probs(&qd, &kd)?, qd.dtype())?
        .matmul(&vd)?
        .contiguous()?;
    *op.out
        .lock()
        .map_err(|_| candle_core::Error::Msg("attention: poisoned lock".into()))? = Some(out);
    Ok(q.apply_op3(k, v, op)?)
}
