//! RMSNorm over the last dimension with its backward (candle's fused `rms_norm` records no backward
//! and rejects f64). Statistics in f32 (f64 for f64 inputs), as transformers computes them.
//!
//! [`rms_norm`] picks the implementation by [`Backend`]: on the CPU the forward and the backward are
//! each one op making one pass per row ([`cpu`]), where the composed ops make eight passes forward and
//! about a dozen in autograd's backward, each with its own buffer; half precision on the CPU runs them
//! in f32, rounded once (transformers rounds the normed rows before scaling them). [`composed`] is the
//! reference and every other device's path; the two agree to rounding (tested in f64). On the card
//! (bf16, f32, rows a multiple of 16 wide) the forward is one Triton kernel and the backward three
//! (`triton/rms_norm.py`), computing what the CPU's do (`cuda.rs`).

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod compiled;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod cuda_table;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, D};

use crate::backend::Backend;
use crate::host::storage::input_data;
use crate::ops::cast::through_f32;

type CResult<T> = candle_core::Result<T>;

/// How an RMSNorm applies its weight, which is where the model families differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormStyle {
    /// Llama/Qwen: normalise in f32, cast back to the input dtype, then multiply by `w`.
    CastThenScale,
    /// Gemma: normalise and multiply by `(1 + w)` in f32, then cast back.
    OnePlusWeightInF32,
}

/// `x / rms(x)` over the last dimension of `x` (`[.., dim]`), scaled by `weight` (`[dim]`) as
/// `style` says, `eps` added to the mean square; same shape and dtype as `x`, differentiable in
/// both.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64, style: NormStyle) -> CResult<Tensor> {
    match Backend::of(x) {
        Backend::Cpu => {
            if matches!(x.dtype(), DType::F32 | DType::F64) && weight.dtype() == x.dtype() {
                let op = Forward(cpu::Norm::new(eps, style));
                return x.contiguous()?.apply_op2(&weight.contiguous()?, op);
            }
            let in_f32 = |[x, weight]: [Tensor; 2]| rms_norm(&x, &weight, eps, style);
            match through_f32([x, weight], in_f32)? {
                Some(out) => Ok(out),
                None => composed(x, weight, eps, style),
            }
        }
        Backend::Cuda => match on_card(x, weight, eps, style)? {
            Some(out) => Ok(out),
            None => composed(x, weight, eps, style),
        },
        Backend::Composed => composed(x, weight, eps, style),
    }
}

/// [`rms_norm`] by the card's kernels, or `None` where they do not apply (another device, dtype or
/// card, a weight in another dtype, rows not a multiple of 16 wide).
fn on_card(x: &Tensor, weight: &Tensor, eps: f64, style: NormStyle) -> CResult<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if weight.dtype() == x.dtype() && cuda::takes(x, weight)? {
        let op = Forward(cpu::Norm::new(eps, style));
        let aligned = crate::triton::contiguous_for_kernels;
        let (x, weight) = (aligned(x)?, aligned(weight)?);
        return x.apply_op2(&weight, op).map(Some);
    }
    let _ = (x, weight, eps, style);
    Ok(None)
}

/// [`rms_norm`] from tensor ops (every device and dtype; autograd differentiates it).
pub fn composed(x: &Tensor, weight: &Tensor, eps: f64, style: NormStyle) -> CResult<Tensor> {
    let dtype = x.dtype();
    let compute = match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let xf = x.to_dtype(compute)?;
    let inv_rms = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let normed = xf.broadcast_mul(&inv_rms)?;
    match style {
        NormStyle::CastThenScale => normed.to_dtype(dtype)?.broadcast_mul(weight),
        NormStyle::OnePlusWeightInF32 => {
            let scale = (weight.to_dtype(compute)? + 1.0)?;
            normed.broadcast_mul(&scale)?.to_dtype(dtype)
        }
    }
}

/// The forward: `y = n ⊙ s` with `n = x / rms(x)` and `s = w` (or `1 + w`).
struct Forward(cpu::Norm);

impl CustomOp2 for Forward {
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
        let y = match (xs, ws) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => CpuStorage::F32(
                self.0
                    .forward::<f32>(input_data(xs, xl)?, input_data(ws, wl)?),
            ),
            (CpuStorage::F64(_), CpuStorage::F64(_)) => CpuStorage::F64(
                self.0
                    .forward::<f64>(input_data(xs, xl)?, input_data(ws, wl)?),
            ),
            _ => candle_core::bail!("rms norm: x and weight not both f32 or f64"),
        };
        Ok((y, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self.0, (xs, xl), (ws, wl))
    }

    /// [`Backward`], on the backend of the forward's inputs.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (x, g) = (x.detach(), crate::triton::contiguous_for_kernels(g)?);
        let both = x.apply_op3_no_bwd(&w.detach(), &g, &Backward(self.0))?;
        // `[rows + 1, dim]`: the rows of dx, then dw (copied out: it must not hold dx's buffer;
        // `copy` would clone the whole storage).
        let rows = both.dim(0)? - 1;
        let dx = both.narrow(0, 0, rows)?.reshape(x.shape())?;
        let dw = both
            .narrow(0, rows, 1)?
            .reshape(w.shape())?
            .force_contiguous()?;
        Ok((Some(dx), Some(dw)))
    }
}

/// The backward of `x`, `w` and the output's gradient `g`: per row with `r = 1 / rms(x)`,
/// `dx = r·(dn − n·mean(dn ⊙ n))` where `dn = g ⊙ s`, and `dw = Σ_rows g ⊙ n` (summed in row order,
/// so the result does not depend on the thread count). One output, `[rows + 1, dim]`: dx's rows,
/// then dw.
struct Backward(cpu::Norm);

impl CustomOp3 for Backward {
    fn name(&self) -> &'static str {
        "streambp-rms-norm-backward"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let dim = wl.shape().elem_count().max(1);
        let out = match (xs, ws, gs) {
            (CpuStorage::F32(_), CpuStorage::F32(_), CpuStorage::F32(_)) => {
                CpuStorage::F32(self.0.backward::<f32>(
                    input_data(xs, xl)?,
                    input_data(ws, wl)?,
                    input_data(gs, gl)?,
                ))
            }
            (CpuStorage::F64(_), CpuStorage::F64(_), CpuStorage::F64(_)) => {
                CpuStorage::F64(self.0.backward::<f64>(
                    input_data(xs, xl)?,
                    input_data(ws, wl)?,
                    input_data(gs, gl)?,
                ))
            }
            _ => candle_core::bail!("rms norm backward: inputs not all f32 or f64"),
        };
        Ok((out, Shape::from((xl.shape().elem_count() / dim + 1, dim))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        cuda::backward(self.0, (xs, xl), (ws, wl), (gs, gl))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use streambp_testkit::{grads, max_diff};

    /// The CPU ops and the composed ops: equal outputs and gradients (x and weight) in f64, for
    /// both weight styles, several row counts and a strided input.
    #[test]
    fn the_cpu_norm_matches_the_composed_one_in_f64() {
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
                let on_cpu = rms_norm(x.as_tensor(), w.as_tensor(), 1e-6, style).unwrap();
                let reference = composed(x.as_tensor(), w.as_tensor(), 1e-6, style).unwrap();
                let what = format!("{style:?} {rows}x{dim}");
                assert!(max_diff(&on_cpu, &reference) < 1e-12, "{what}");
                let wrt = [&x, &w];
                let pairs = grads(&on_cpu, &g, &wrt)
                    .into_iter()
                    .zip(grads(&reference, &g, &wrt));
                for (which, (f, c)) in ["dx", "dw"].into_iter().zip(pairs) {
                    assert_eq!(f.dims(), c.dims(), "{which} {what}");
                    assert!(max_diff(&f, &c) < 1e-12, "{which} {what}");
                }
            }
        }
    }
}
