//! RMSNorm with its backward (candle's fused `rms_norm` records no backward and rejects f64).
//! Statistics are computed in f32 (f64 for an f64 model) as transformers does.
//!
//! On the CPU in f32/f64 the norm is one op ([`FusedRmsNorm`]): one pass per row forward, one per
//! row backward, where the composed ops make eight passes forward and about a dozen in autograd's
//! backward, each with its own buffer; bf16 on the CPU runs it in f32 (rounded once, where
//! transformers rounds the normed rows before scaling them). Elsewhere (CUDA) it is composed from
//! differentiable tensor ops; the two agree to rounding (tested in f64).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor, WithDType, D};
use num_traits::Float;
use rayon::prelude::*;

use crate::config::NormStyle;
use crate::error::Result;
use crate::weights::MapWeights;
use streambp_kernels::host::cast::through_f32;
use streambp_kernels::host::storage::{fusable, input_data, tensor_from, with_data};
use streambp_kernels::vectorized;

type CResult<T> = candle_core::Result<T>;

/// Rows per rayon task: a row is a few hundred elements, too little work to hand out alone.
const ROWS_PER_TASK: usize = 16;

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
        if fusable(x) && self.weight.dtype() == x.dtype() {
            let op = FusedRmsNorm {
                eps: self.eps,
                one_plus: self.style == NormStyle::OnePlusWeightInF32,
            };
            return Ok(x.contiguous()?.apply_op2(&self.weight.contiguous()?, op)?);
        }
        let in_f32 = |[x, weight]: [Tensor; 2]| {
            Self {
                weight,
                ..self.clone()
            }
            .forward(&x)
        };
        if let Some(out) = through_f32([x, &self.weight], in_f32)? {
            return Ok(out);
        }
        self.composed(x)
    }

    /// The norm from tensor ops (every device and dtype).
    fn composed(&self, x: &Tensor) -> Result<Tensor> {
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

/// RMSNorm of `x` (`[.., dim]`) with weight `[dim]` as one CPU op in `x`'s float dtype: `y = n ⊙ s`
/// with `n = x / rms(x)` and `s = w` (or `1 + w`). Backward, per row with `r = 1 / rms(x)`:
/// `dx = r·(dn − n·mean(dn ⊙ n))` where `dn = g ⊙ s`, and `dw = Σ_rows g ⊙ n` (summed in row order,
/// so the result does not depend on the thread count).
struct FusedRmsNorm {
    eps: f64,
    /// `s = 1 + w` (Gemma) rather than `w`.
    one_plus: bool,
}

impl FusedRmsNorm {
    #[inline(always)]
    fn scale<T: Float>(&self, w: T) -> T {
        match self.one_plus {
            true => w + T::one(),
            false => w,
        }
    }

    /// `1 / rms(row)`, as the composed ops form it: `recip(sqrt(Σx² · (1/dim) + eps))`.
    #[inline(always)]
    fn inv_rms<T: Float>(&self, row: &[T]) -> T {
        let sum = row.iter().fold(T::zero(), |acc, &v| acc + v * v);
        let inv_dim = T::from(1.0 / row.len() as f64).unwrap_or_else(T::zero);
        let eps = T::from(self.eps).unwrap_or_else(T::zero);
        T::one() / (sum * inv_dim + eps).sqrt()
    }

    fn forward_rows<T: WithDType + Float>(&self, x: &[T], w: &[T]) -> Vec<T> {
        let dim = w.len().max(1);
        let mut y = vec![T::zero(); x.len()];
        let task = dim * ROWS_PER_TASK;
        y.par_chunks_mut(task)
            .zip(x.par_chunks(task))
            .for_each(|(y, x)| {
                vectorized!(|_| {
                    for (y, x) in y.chunks_mut(dim).zip(x.chunks(dim)) {
                        let r = self.inv_rms(x);
                        for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                            *y = (x * r) * self.scale(w);
                        }
                    }
                })
            });
        y
    }

    fn backward_rows<T: WithDType + Float + std::ops::AddAssign>(
        &self,
        x: &[T],
        w: &[T],
        g: &[T],
    ) -> (Vec<T>, Vec<T>) {
        let dim = w.len().max(1);
        let inv_dim = T::from(1.0 / dim as f64).unwrap_or_else(T::zero);
        let mut dx = vec![T::zero(); x.len()];
        let mut inv_rms = vec![T::zero(); x.len() / dim];
        let task = dim * ROWS_PER_TASK;
        dx.par_chunks_mut(task)
            .zip(inv_rms.par_chunks_mut(ROWS_PER_TASK))
            .zip(x.par_chunks(task).zip(g.par_chunks(task)))
            .for_each(|((dx, r_out), (x, g))| {
                vectorized!(|_| {
                    let rows = dx.chunks_mut(dim).zip(r_out);
                    for ((dx, r_out), (x, g)) in rows.zip(x.chunks(dim).zip(g.chunks(dim))) {
                        let r = self.inv_rms(x);
                        *r_out = r;
                        let dot = x
                            .iter()
                            .zip(g)
                            .zip(w)
                            .fold(T::zero(), |acc, ((&x, &g), &w)| {
                                acc + (g * self.scale(w)) * (x * r)
                            });
                        let mean = dot * inv_dim;
                        for (((dx, &x), &g), &w) in dx.iter_mut().zip(x).zip(g).zip(w) {
                            *dx = r * (g * self.scale(w) - (x * r) * mean);
                        }
                    }
                })
            });
        let mut dw = vec![T::zero(); dim];
        vectorized!(|_| {
            for ((x, g), &r) in x.chunks(dim).zip(g.chunks(dim)).zip(&inv_rms) {
                for ((dw, &x), &g) in dw.iter_mut().zip(x).zip(g) {
                    *dw += g * (x * r);
                }
            }
        });
        (dx, dw)
    }

    fn backward_as<T: WithDType + Float + std::ops::AddAssign>(
        &self,
        x: &Tensor,
        w: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let grads = with_data::<T, _>(x, |xs| {
            let grads = with_data::<T, _>(w, |ws| {
                with_data::<T, _>(g, |gs| Ok(self.backward_rows(xs, ws, gs)))
            })?;
            Ok(grads.flatten())
        })?
        .flatten()
        .ok_or_else(|| candle_core::Error::Msg("rms norm: backward off the CPU".into()))?;
        let (dx, dw) = grads;
        Ok((Some(tensor_from(dx, x)?), Some(tensor_from(dw, w)?)))
    }
}

impl CustomOp2 for FusedRmsNorm {
    fn name(&self) -> &'static str {
        "streambp-rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let y = match xs.dtype() {
            DType::F32 => f32::to_cpu_storage_owned(
                self.forward_rows::<f32>(input_data(xs, xl)?, input_data(ws, wl)?),
            ),
            DType::F64 => f64::to_cpu_storage_owned(
                self.forward_rows::<f64>(input_data(xs, xl)?, input_data(ws, wl)?),
            ),
            other => candle_core::bail!("rms norm op: {other:?} is not f32 or f64"),
        };
        Ok((y, xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        match x.dtype() {
            DType::F32 => self.backward_as::<f32>(x, w, g),
            _ => self.backward_as::<f64>(x, w, g),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use streambp_testkit::{grads, max_diff};

    /// The fused op and the composed ops: equal outputs and gradients (x and weight) in f64, for
    /// both weight styles, several row counts and a strided input.
    #[test]
    fn the_fused_norm_matches_the_composed_one_in_f64() {
        let dev = Device::Cpu;
        for style in [NormStyle::CastThenScale, NormStyle::OnePlusWeightInF32] {
            for (rows, dim) in [(1, 8), (7, 64), (33, 256)] {
                let x = Var::from_tensor(
                    &Tensor::randn(0f64, 1.0, (dim, rows), &dev)
                        .unwrap()
                        .t()
                        .unwrap(),
                )
                .unwrap();
                let w = Var::from_tensor(&Tensor::randn(0f64, 0.5, dim, &dev).unwrap()).unwrap();
                let g = Tensor::randn(0f64, 1.0, (rows, dim), &dev).unwrap();
                let norm = RmsNorm::new(w.as_tensor().clone(), 1e-6, style);
                let fused = norm.forward(x.as_tensor()).unwrap();
                let composed = norm.composed(x.as_tensor()).unwrap();
                assert!(
                    max_diff(&fused, &composed) < 1e-12,
                    "{style:?} {rows}x{dim}"
                );
                let wrt = [&x, &w];
                let pairs = grads(&fused, &g, &wrt)
                    .into_iter()
                    .zip(grads(&composed, &g, &wrt));
                for (which, (f, c)) in ["dx", "dw"].into_iter().zip(pairs) {
                    assert!(max_diff(&f, &c) < 1e-12, "{which} {style:?} {rows}x{dim}");
                }
            }
        }
    }
}
