//! Softmax over the last dimension as one op with its backward, for the attention scores: the composed
//! softmax keeps `x − max`, its exponential and the quotient alive in the graph, and its backward
//! materialises a gradient for each. This op keeps only the output `p` and computes
//! `dx = p ⊙ (g − Σ g ⊙ p)` (same formula as autograd through the composition, fewer copies).
//!
//! The forward runs on the CPU (f32 and f64); other devices use the composed softmax.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, D};

use crate::error::Result;

struct SoftmaxLastDim;

fn softmax_rows<T: num_like::Float>(x: &[T], dim: usize) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    for (row, dst) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let max = row.iter().copied().fold(T::neg_infinity(), T::max);
        let mut sum = T::zero();
        for (d, &v) in dst.iter_mut().zip(row) {
            *d = (v - max).exp();
            sum = sum + *d;
        }
        for d in dst.iter_mut() {
            *d = *d / sum;
        }
    }
    out
}

/// The few float operations the kernel needs, for f32 and f64.
mod num_like {
    pub trait Float:
        Copy
        + std::ops::Sub<Output = Self>
        + std::ops::Add<Output = Self>
        + std::ops::Div<Output = Self>
    {
        fn zero() -> Self;
        fn neg_infinity() -> Self;
        fn max(self, other: Self) -> Self;
        fn exp(self) -> Self;
    }
    macro_rules! float {
        ($t:ty) => {
            impl Float for $t {
                fn zero() -> Self {
                    0.0
                }
                fn neg_infinity() -> Self {
                    <$t>::NEG_INFINITY
                }
                fn max(self, other: Self) -> Self {
                    <$t>::max(self, other)
                }
                fn exp(self) -> Self {
                    <$t>::exp(self)
                }
            }
        };
    }
    float!(f32);
    float!(f64);
}

impl CustomOp1 for SoftmaxLastDim {
    fn name(&self) -> &'static str {
        "streambp-softmax-last-dim"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let dim = layout.dims().last().copied().unwrap_or(1);
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("softmax: input must be contiguous")
        };
        let out = match storage {
            CpuStorage::F32(v) => CpuStorage::F32(softmax_rows(&v[start..end], dim)),
            CpuStorage::F64(v) => CpuStorage::F64(softmax_rows(&v[start..end], dim)),
            _ => candle_core::bail!("softmax: only f32 and f64 run on the CPU kernel"),
        };
        Ok((out, layout.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let dot = (grad * res)?.sum_keepdim(D::Minus1)?;
        Ok(Some((res * grad.broadcast_sub(&dot)?)?))
    }
}

/// Softmax over the last dimension, differentiable; one op on the CPU for f32/f64.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64) {
        Ok(x.contiguous()?.apply_op1(SoftmaxLastDim)?)
    } else {
        Ok(candle_nn::ops::softmax(x, D::Minus1)?)
    }
}
