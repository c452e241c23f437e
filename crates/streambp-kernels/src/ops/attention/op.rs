//! The op autograd records: its forward by the CPU kernel in `cpu_fwd` or handed over from the
//! composed path, and its backward, which recomputes each block's probabilities from the normalizer
//! the forward left.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp3, Device, Layout, Shape, Tensor};

use super::host::{rows_are_contiguous, rows_contiguous};
use super::kernel::{KernelFloat, Multiply};
use super::{Blocks, Normalizer, Stats};
use crate::backend::Backend;
use crate::op_times;
use crate::ops::cast::cast;
use crate::precomputed::Precomputed;

type CResult<T> = candle_core::Result<T>;

/// The op: q, k and v in, the output out, the backward written out ([`Attention::inner_bwd`]).
pub(super) struct Attention {
    pub(super) blocks: Blocks,
    pub(super) forward: Forward,
    /// Whether q and the output are in the layer's layout ([`HeadsLayout`]).
    pub(super) over_heads: bool,
    /// What the forward leaves for the backward.
    pub(super) saved: Mutex<Option<Saved>>,
}

/// How the op's forward runs.
pub(super) enum Forward {
    /// In the op, by the CPU kernel multiplying so, the earlier keys and values read from these
    /// (each head's rows contiguous).
    CpuKernel(Multiply, Option<(Tensor, Tensor)>),
    /// By the composed path before the op was recorded, handed over.
    Composed(Precomputed),
}

/// What the forward leaves for the backward.
#[derive(Clone)]
pub(super) struct Saved {
    /// To recompute the probabilities.
    pub(super) stats: Stats,
    /// Over heads ([`HeadsLayout`]): the output in the inner layout.
    pub(super) inner_out: Option<Tensor>,
}

/// The op recorded over the layer's layout: q `[b, heads, c, hd]` unscaled, output
/// `[b, c, heads·hd]`; the inner layout (q `[b, kv_heads, group·c, hd]` scaled, output like it) is
/// formed inside the op, so none of its reshapes, transposes and the scaling is a graph node (each
/// would be a zero-filled buffer and a sum in candle's backward).
pub(super) struct HeadsLayout;

impl HeadsLayout {
    /// q `[b, heads, c, hd]` as the inner layout's `[b, kv_heads, group·c, hd]`.
    pub(super) fn inner_q(q: &Tensor, kv_heads: usize) -> CResult<Tensor> {
        let (b, heads, c, hd) = q.dims4()?;
        q.contiguous()?
            .reshape((b, kv_heads, heads / kv_heads.max(1) * c, hd))
    }

    /// The data of an output `[b, heads, c, hd]` (the inner layout's `[b, kv_heads, group·c, hd]`)
    /// laid out as `[b, c, heads·hd]`.
    pub(super) fn outer_data<T: Copy>(
        inner: &[T],
        (b, heads, c, hd): (usize, usize, usize, usize),
    ) -> Vec<T> {
        let mut out = Vec::with_capacity(inner.len());
        for batch in 0..b {
            for i in 0..c {
                for h in 0..heads {
                    let at = ((batch * heads + h) * c + i) * hd;
                    out.extend_from_slice(&inner[at..at + hd]);
                }
            }
        }
        out
    }

    /// An output or its gradient `[b, kv_heads, group·c, hd]` as `[b, c, heads·hd]`.
    pub(super) fn outer(x: &Tensor, heads: usize) -> CResult<Tensor> {
        let (b, kv_heads, rows, hd) = x.dims4()?;
        let c = kv_heads * rows / heads.max(1);
        x.reshape((b, heads, c, hd))?
            .transpose(1, 2)?
            .reshape((b, c, heads * hd))
    }

    /// The gradient of the output `[b, c, heads·hd]` in the inner layout.
    pub(super) fn inner_grad(grad: &Tensor, kv_heads: usize, hd: usize) -> CResult<Tensor> {
        let (b, c, width) = grad.dims3()?;
        let heads = width / hd.max(1);
        grad.reshape((b, c, heads, hd))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b, kv_heads, heads / kv_heads.max(1) * c, hd))
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "streambp-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        match &self.forward {
            Forward::CpuKernel(multiply, earlier) => {
                let inputs = [(s1, l1), (s2, l2), (s3, l3)];
                let kernel = || self.kernel_fwd(*multiply, earlier.as_ref(), inputs);
                op_times::timed("attention.forward.kernel", &Device::Cpu, kernel)
            }
            Forward::Composed(out) => out.cpu(),
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
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        match &self.forward {
            Forward::Composed(out) => out.cuda(),
            Forward::CpuKernel(..) => candle_core::bail!("attention: the CPU kernel on the card"),
        }
    }

    /// Per key block, with `P` recomputed from the normalizer: `dV = Pᵀ g`, `dP = g Vᵀ`,
    /// `dS = P ⊙ (dP − Σ g ⊙ out)` (the softmax's backward; `Σ_keys P ⊙ dP = g · out`), `dQ += dS K`,
    /// `dK = dSᵀ Q`.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (k, v) = (k.detach(), v.detach());
        let saved = self.saved()?;
        #[cfg(feature = "cuda")]
        if let Stats::Fused(fused, lse) = &saved.stats {
            let inputs = (&q.detach(), &k, &v);
            let earlier = self.blocks.earlier.as_ref();
            let (dq, dk, dv) =
                fused.backward(inputs, (&out.detach(), &grad.detach(), lse), earlier)?;
            return Ok((Some(dq), Some(dk), Some(dv)));
        }
        let (dq, dk, dv) = match &saved.inner_out {
            None => self.inner_bwd(&q.detach(), &k, &v, &out.detach(), &grad.detach())?,
            Some(inner_out) => {
                let (kv_heads, hd) = (k.dim(1)?, k.dim(3)?);
                let inner_q = HeadsLayout::inner_q(&q.detach(), kv_heads)?;
                let inner_grad = HeadsLayout::inner_grad(&grad.detach(), kv_heads, hd)?;
                let (dq, dk, dv) = self.inner_bwd(&inner_q, &k, &v, inner_out, &inner_grad)?;
                (dq.reshape(q.dims())?, dk, dv)
            }
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

impl Attention {
    /// The op with its forward computed as `forward` says.
    pub(super) fn new(
        blocks: Blocks,
        forward: Forward,
        over_heads: bool,
        saved: Option<Saved>,
    ) -> Self {
        Self {
            blocks,
            forward,
            over_heads,
            saved: Mutex::new(saved),
        }
    }

    /// What the forward left (an error before the forward ran).
    pub(super) fn saved(&self) -> CResult<Saved> {
        let saved = self.saved.lock().map_err(|_| poisoned())?;
        saved
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("attention: backward before forward".into()))
    }

    /// The backward in the inner layout (see [`HeadsLayout`]), q unscaled ([`Blocks::scale`]): the
    /// gradients of q, k and v.
    pub(super) fn inner_bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Tensor, Tensor, Tensor)> {
        let b = &self.blocks;
        if k.dtype() != q.dtype() {
            // Keys and values stored in bf16 for an f32 forward: their gradients in f32, rounded.
            let (wide_k, wide_v) = (cast(k, q.dtype())?, cast(v, q.dtype())?);
            let (dq, dk, dv) = self.inner_bwd(q, &wide_k, &wide_v, out, grad)?;
            return Ok((dq, cast(&dk, k.dtype())?, cast(&dv, v.dtype())?));
        }
        let multiply = match Backend::of(q) {
            Backend::Cpu => b.kernel_multiply(q, k, v)?,
            // The card's fused kernels ran from `bwd` where the forward was theirs; else composed.
            Backend::Cuda | Backend::Composed => None,
        };
        match multiply {
            // The exact products take q scaled, and give the scaled q's gradient.
            Some(Multiply::Exact) => {
                let (dq, dk, dv) =
                    self.kernel_bwd(&b.scaled(q)?, k, v, (out, grad), Multiply::Exact)?;
                Ok((b.scaled(&dq)?, dk, dv))
            }
            Some(multiply) => self.kernel_bwd(q, k, v, (out, grad), multiply),
            None => {
                let (dq, dk, dv) = self.scaled_bwd(&b.scaled(q)?, k, v, out, grad)?;
                Ok((b.scaled(&dq)?, dk, dv))
            }
        }
    }

    /// The backward by the CPU kernel, as its own op ([`KernelBackward`]), timed.
    fn kernel_bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        (out, grad): (&Tensor, &Tensor),
        multiply: Multiply,
    ) -> CResult<(Tensor, Tensor, Tensor)> {
        let earlier = match &self.blocks.earlier {
            Some(e) => Some((rows_contiguous(&e.keys)?, rows_contiguous(&e.values)?)),
            None => None,
        };
        let op = KernelBackward {
            blocks: &self.blocks,
            earlier,
            out,
            grad,
            normalizer: self.saved()?.stats.normalizer()?.clone(),
            multiply,
            key_grads: Mutex::new(None),
        };
        let (q, k, v) = (q.contiguous()?, rows_contiguous(k)?, rows_contiguous(v)?);
        let run = || q.apply_op3_no_bwd(&k, &v, &op);
        let dq = op_times::timed("attention.backward.kernel", q.device(), run)?;
        let key_grads = op.key_grads.lock().map_err(|_| poisoned())?.take();
        let (dk, dv) = key_grads
            .ok_or_else(|| candle_core::Error::Msg("attention: no key gradients".into()))?;
        Ok((dq, dk, dv))
    }
}

/// The backward by the CPU kernel, an op of its own over q (contiguous; scaled for
/// [`Multiply::Exact`]), k and v (each head's rows contiguous, in q's dtype) in the inner layout,
/// reading the forward's output, its normalizer and the output's gradient: its output is q's
/// gradient; the keys' and values' are left in `key_grads`, the earlier keys' added into their
/// buffers ([`EarlierKeys`]). A card's kernel would be its `cuda_fwd`.
struct KernelBackward<'a> {
    blocks: &'a Blocks,
    /// The earlier keys and values, each head's rows contiguous.
    earlier: Option<(Tensor, Tensor)>,
    out: &'a Tensor,
    grad: &'a Tensor,
    normalizer: Normalizer,
    multiply: Multiply,
    /// The gradients of the op's own keys and values, once it ran.
    key_grads: Mutex<Option<(Tensor, Tensor)>>,
}

impl KernelBackward<'_> {
    /// [`CustomOp3::cpu_fwd`] for q in `T`.
    fn on_host<T: KernelFloat>(
        &self,
        inputs: [(&CpuStorage, &Layout); 3],
    ) -> CResult<(CpuStorage, Shape)> {
        let fwd = (self.out, &self.normalizer, self.grad);
        let earlier = self.earlier.as_ref();
        let (dq, dk, dv) = self
            .blocks
            .kernel_backward::<T>(inputs, earlier, fwd, self.multiply)?;
        let key_shape = inputs[1].1.shape();
        let (dk, dv) = (
            Tensor::from_vec(dk, key_shape, &Device::Cpu)?,
            Tensor::from_vec(dv, key_shape, &Device::Cpu)?,
        );
        *self.key_grads.lock().map_err(|_| poisoned())? = Some((dk, dv));
        Ok((T::to_cpu_storage_owned(dq), inputs[0].1.shape().clone()))
    }
}

impl CustomOp3 for KernelBackward<'_> {
    fn name(&self) -> &'static str {
        "streambp-attention-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let inputs = [(s1, l1), (s2, l2), (s3, l3)];
        match s1 {
            CpuStorage::F32(_) => self.on_host::<f32>(inputs),
            CpuStorage::F64(_) => self.on_host::<f64>(inputs),
            _ => candle_core::bail!("attention backward: q neither f32 nor f64"),
        }
    }
}

/// The op of `blocks` on q, k and v recorded, its forward by the backend of q: the CPU kernel in
/// the op where it takes the inputs as they are (q contiguous, each head's rows of the keys and
/// values contiguous), else the composed path (which the kernel may still run, on copies: see
/// [`Blocks::forward`]) before the op, handed over.
pub(super) fn record(
    blocks: Blocks,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    over_heads: bool,
) -> CResult<Tensor> {
    let (heads, kv_heads) = (q.dim(1)?, k.dim(1)?);
    let (k0, v0) = (k.detach(), v.detach());
    #[cfg(feature = "cuda")]
    if Backend::of(q) == Backend::Cuda {
        let q0 = q.detach();
        if let Some(fused) = super::fused::Fused::new(&blocks, (&q0, &k0, &v0), over_heads)? {
            let (out, lse) = fused.forward(&q0, &k0, &v0, blocks.earlier.as_ref())?;
            let saved = Saved {
                stats: Stats::Fused(std::sync::Arc::new(fused), lse),
                inner_out: None,
            };
            let forward = Forward::Composed(Precomputed::new(out));
            let op = Attention::new(blocks, forward, over_heads, Some(saved));
            return q.apply_op3(k, v, op);
        }
    }
    let inner_q = match over_heads {
        true => HeadsLayout::inner_q(&q.detach(), kv_heads)?,
        false => q.detach(),
    };
    let as_they_are = q.is_contiguous() && rows_are_contiguous(k) && rows_are_contiguous(v);
    let multiply = match Backend::of(q) {
        Backend::Cpu if as_they_are => blocks.kernel_multiply(&inner_q, &k0, &v0)?,
        // The card's fused kernels took it above where they apply.
        Backend::Cpu | Backend::Cuda | Backend::Composed => None,
    };
    let op = match multiply {
        Some(multiply) => {
            let earlier = match &blocks.earlier {
                Some(e) => Some((rows_contiguous(&e.keys)?, rows_contiguous(&e.values)?)),
                None => None,
            };
            Attention::new(
                blocks,
                Forward::CpuKernel(multiply, earlier),
                over_heads,
                None,
            )
        }
        None => {
            let (inner_out, normalizer) = blocks.forward(&inner_q, &k0, &v0)?;
            let (out, inner_out) = match over_heads {
                true => (HeadsLayout::outer(&inner_out, heads)?, Some(inner_out)),
                false => (inner_out, None),
            };
            let saved = Saved {
                stats: Stats::Blocks(normalizer),
                inner_out,
            };
            let forward = Forward::Composed(Precomputed::new(out));
            Attention::new(blocks, forward, over_heads, Some(saved))
        }
    };
    q.apply_op3(k, v, op)
}

pub(super) fn poisoned() -> candle_core::Error {
    candle_core::Error::Msg("attention: poisoned lock".into())
}
