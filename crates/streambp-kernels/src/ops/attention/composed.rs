//! The op's path in tensor ops (every device's, and the CPU's where its kernel does not take the
//! inputs): the forward with a running maximum over the key blocks and the backward block by block,
//! each block's softmax one host pass where that applies ([`super::softmax_block`]).

use candle_core::{DType, Tensor, D};

use super::kernel::Multiply;
use super::op::Attention;
use super::{softmax_block, Blocks, KeyRange, Normalizer};
use crate::op_times;
use crate::ops::cast::cast;

type CResult<T> = candle_core::Result<T>;

impl Blocks {
    /// Scores of all queries against the keys `k` of block `r` (`[b, kv_heads, group, c, n]`, in the
    /// compute dtype), and the block's additive mask (`None`: every query reads every key).
    /// Timed in parts ([`op_times`], the forward's and the backward's together): the product, its
    /// cast to the compute dtype and the mask.
    pub(super) fn scores(
        &self,
        q: &Tensor,
        k: &Tensor,
        r: KeyRange,
    ) -> CResult<(Tensor, Option<Tensor>)> {
        let (b, kv_heads, rows, _) = q.dims4()?;
        let device = q.device();
        let s = op_times::timed("attention.scores.product", device, || q.matmul(&k.t()?))?;
        let s = op_times::timed("attention.scores.cast", device, || {
            s.to_dtype(self.compute)?
                .reshape((b, kv_heads, self.group, rows / self.group, r.n))
        })?;
        let mask = op_times::timed("attention.scores.mask", device, || {
            self.mask.bias(r.index, r.n, self.compute)
        })?;
        Ok((s, mask))
    }

    /// `[b, kv_heads, group, c, n]` in the compute dtype as `[b, kv_heads, group·c, n]` in `dtype`.
    pub(super) fn flat(&self, x: &Tensor, dtype: DType) -> CResult<Tensor> {
        let (b, kv_heads, group, c, n) = x.dims5()?;
        x.to_dtype(dtype)?.reshape((b, kv_heads, group * c, n))
    }

    /// `[b, kv_heads, group·c, hd]` as `[b, kv_heads, group, c, hd]` in the compute dtype.
    pub(super) fn grouped(&self, x: &Tensor) -> CResult<Tensor> {
        let (b, kv_heads, rows, hd) = x.dims4()?;
        x.to_dtype(self.compute)?
            .reshape((b, kv_heads, self.group, rows / self.group, hd))
    }

    /// Output (like q) and each query's softmax normalizer, for q unscaled ([`Blocks::scale`]).
    pub(super) fn forward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> CResult<(Tensor, Normalizer)> {
        if let Some(multiply) = self.bf16_products(q, k, v)? {
            return self.timed_kernel_forward((q, k, v), multiply);
        }
        self.forward_scaled(&self.scaled(q)?, k, v)
    }

    /// [`Blocks::forward`] for q scaled, with a running maximum so that no block's exponentials
    /// overflow.
    pub(super) fn forward_scaled(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> CResult<(Tensor, Normalizer)> {
        let device = q.device();
        if self.kernel_applies(q, k, v)? {
            return self.timed_kernel_forward((q, k, v), Multiply::Exact);
        }
        if k.dtype() != q.dtype() {
            let (k, v) = (cast(k, q.dtype())?, cast(v, q.dtype())?);
            return self.forward_scaled(q, &k, &v);
        }
        let dtype = q.dtype();
        // (running max, running sum of exponentials, running weighted sum of values)
        let mut state: Option<(Tensor, Tensor, Tensor)> = None;
        for r in self.ranges(k.dim(2)?)? {
            let (k, v) = self.keys_values(r, k, v)?;
            let (s, mask) =
                op_times::timed("attention.forward.scores", device, || self.scores(q, &k, r))?;
            let before = state.as_ref().map(|(m, _, _)| m);
            let (p, max, sum) = op_times::timed("attention.forward.softmax", device, || {
                if let Some(fused) = softmax_block::forward(&s, mask.as_ref(), before)? {
                    return Ok(fused);
                }
                // The tensor ops of the softmax block, each timed (the suspects on a card).
                let s = op_times::timed("attention.forward.softmax.mask", device, || {
                    masked(&s, mask.as_ref())
                })?;
                let max = op_times::timed("attention.forward.softmax.max", device, || {
                    let block_max = s.max_keepdim(D::Minus1)?;
                    match before {
                        Some(m) => m.maximum(&block_max),
                        None => Ok(block_max),
                    }
                })?;
                let p = op_times::timed("attention.forward.softmax.exp", device, || {
                    s.broadcast_sub(&max)?.exp()
                })?;
                let sum = op_times::timed("attention.forward.softmax.sum", device, || {
                    p.sum_keepdim(D::Minus1)
                })?;
                Ok::<_, candle_core::Error>((p, max, sum))
            })?;
            // Only the probabilities go on: the scores' memory is free for the product.
            drop((s, mask));
            state = Some(op_times::timed("attention.forward.values", device, || {
                let pv = self.grouped(&self.flat(&p, dtype)?.matmul(&v)?)?;
                Ok::<_, candle_core::Error>(match state {
                    None => (max, sum, pv),
                    Some((m, l, acc)) => {
                        let rescale = (m - &max)?.exp()?;
                        let l = ((l * &rescale)? + sum)?;
                        let acc = (acc.broadcast_mul(&rescale)? + pv)?;
                        (max, l, acc)
                    }
                })
            })?);
        }
        let (max, sum, acc) = state.ok_or_else(|| candle_core::Error::Msg("no keys".into()))?;
        let out = self.flat(&acc.broadcast_div(&sum)?, dtype)?.contiguous()?;
        let log_sum = sum.log()?;
        Ok((out, Normalizer { max, log_sum }))
    }
}

impl Attention {
    /// [`Attention::inner_bwd`] for q scaled (the gradient of q is the scaled q's), keys and values
    /// in q's dtype.
    pub(super) fn scaled_bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Tensor, Tensor, Tensor)> {
        let b = &self.blocks;
        let device = q.device();
        let dtype = q.dtype();
        let saved = self.saved()?;
        let dot = (b.grouped(grad)? * b.grouped(out)?)?.sum_keepdim(D::Minus1)?;
        let mut grad_q: Option<Tensor> = None;
        let (own_grad_k, own_grad_v) = (k.zeros_like()?, v.zeros_like()?);
        for r in b.ranges(k.dim(2)?)? {
            let (k_r, v_r) = b.keys_values(r, k, v)?;
            let (s, mask, grad_p) =
                op_times::timed("attention.backward.scores_and_dp", device, || {
                    let (s, mask) = b.scores(q, &k_r, r)?;
                    let grad_p = grad
                        .matmul(&v_r.t()?)?
                        .to_dtype(b.compute)?
                        .reshape(s.shape())?;
                    Ok::<_, candle_core::Error>((s, mask, grad_p))
                })?;
            let n = saved.stats.normalizer()?;
            let normalizer = (&n.max, &n.log_sum);
            let (p, grad_s) = op_times::timed("attention.backward.softmax", device, || {
                let fused = softmax_block::backward(&s, mask.as_ref(), normalizer, &grad_p, &dot)?;
                if let Some(fused) = fused {
                    return Ok(fused);
                }
                // The tensor ops of the softmax block, each timed (the suspects on a card).
                let p =
                    op_times::timed("attention.backward.softmax.probabilities", device, || {
                        masked(&s, mask.as_ref())?
                            .broadcast_sub(normalizer.0)?
                            .broadcast_sub(normalizer.1)?
                            .exp()
                    })?;
                let grad_s =
                    op_times::timed("attention.backward.softmax.gradient", device, || {
                        &p * grad_p.broadcast_sub(&dot)?
                    })?;
                Ok::<_, candle_core::Error>((p, grad_s))
            })?;
            // Each score-sized buffer is freed as soon as it is used: the scores and dP now, P after
            // its product.
            drop((s, mask, grad_p));
            let (grad_k_r, grad_v_r) =
                op_times::timed("attention.backward.products", device, || {
                    let grad_v_r = b.flat(&p, dtype)?.t()?.matmul(grad)?;
                    drop(p);
                    let grad_s = b.flat(&grad_s, dtype)?;
                    let dq = grad_s.matmul(&k_r)?.to_dtype(b.compute)?;
                    grad_q = Some(match grad_q.take() {
                        Some(acc) => (acc + dq)?,
                        None => dq,
                    });
                    Ok::<_, candle_core::Error>((grad_s.t()?.matmul(q)?, grad_v_r))
                })?;
            // Each block's gradient goes straight where it belongs: no per-block list to concatenate.
            let (grad_keys, grad_values, at) = match (&b.earlier, r.earlier) {
                (Some(e), true) => (&e.grad_keys, &e.grad_values, e.offset + r.start),
                _ => (&own_grad_k, &own_grad_v, r.start),
            };
            op_times::timed("attention.backward.scatter", device, || {
                add_at(grad_keys, &grad_k_r, at)?;
                add_at(grad_values, &grad_v_r, at)
            })?;
        }
        let grad_q = grad_q
            .ok_or_else(|| candle_core::Error::Msg("no keys".into()))?
            .to_dtype(dtype)?;
        Ok((grad_q, own_grad_k, own_grad_v))
    }
}

/// Scores with their mask added (the composed path).
pub(super) fn masked(s: &Tensor, mask: Option<&Tensor>) -> CResult<Tensor> {
    match mask {
        Some(mask) => s.broadcast_add(mask),
        None => Ok(s.clone()),
    }
}

/// `dst[:, :, at..at + n] += src` (`n` = `src`'s keys), in place.
pub(super) fn add_at(dst: &Tensor, src: &Tensor, at: usize) -> CResult<()> {
    let n = src.dim(2)?;
    let sum = (dst.narrow(2, at, n)? + src.to_dtype(dst.dtype())?)?;
    dst.slice_set(&sum, 2, at)
}
