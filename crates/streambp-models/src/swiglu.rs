//! The gated MLP's `silu(gate) ⊙ up` as one op on the CPU (f32/f64), its backward written out:
//! `d up = g ⊙ silu(gate)` and `d gate = g ⊙ up ⊙ silu'(gate)` with
//! `silu'(x) = σ(x)·(1 − silu(x)) + silu(x)` (candle's own form). Composed, the activation and the
//! product are two ops with a buffer each and autograd's backward makes about seven passes; here each
//! is one pass. bf16 on the CPU runs it in f32 ([`streambp_kernels::host::cast::through_f32`]); elsewhere (CUDA)
//! [`swiglu`] composes the same tensor ops as before.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor, WithDType};
use num_traits::Float;
use rayon::prelude::*;

use crate::error::Result;
use streambp_kernels::host::cast::through_f32;
use streambp_kernels::host::exp::BulkExp;
use streambp_kernels::host::storage::{fusable, input_data, tensor_from, with_data};
use streambp_kernels::vectorized;

type CResult<T> = candle_core::Result<T>;

/// Elements per rayon task.
const PER_TASK: usize = 4096;

/// `silu(gate) ⊙ up`, differentiable in both.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if fusable(gate) && gate.dtype() == up.dtype() && gate.shape() == up.shape() {
        return Ok(gate
            .contiguous()?
            .apply_op2(&up.contiguous()?, FusedSwiglu)?);
    }
    if let Some(out) = through_f32([gate, up], |[gate, up]| swiglu(&gate, &up))? {
        return Ok(out);
    }
    composed(gate, up)
}

/// [`swiglu`] from tensor ops (every device and dtype).
fn composed(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok((candle_nn::ops::silu(gate)? * up)?)
}

/// `x / (1 + e)` with `e = exp(−x)`: silu as candle's `silu` computes it.
#[inline(always)]
fn silu<T: Float>(x: T, e: T) -> T {
    x / (T::one() + e)
}

/// `exp(−x)` for each `x` of `xs` into `out`, through [`BulkExp`] (vectorized in f32) rather than
/// one library call per element.
fn exp_neg<T: BulkExp>(xs: &[T], out: &mut [T]) {
    for (e, &x) in out.iter_mut().zip(xs) {
        *e = -x;
    }
    T::exp_in_place(out);
}

struct FusedSwiglu;

impl FusedSwiglu {
    fn forward<T: WithDType + BulkExp>(gate: &[T], up: &[T]) -> Vec<T> {
        let mut y = vec![T::zero(); gate.len()];
        y.par_chunks_mut(PER_TASK)
            .zip(gate.par_chunks(PER_TASK).zip(up.par_chunks(PER_TASK)))
            .for_each(|(y, (gate, up))| {
                exp_neg(gate, y);
                vectorized!(|_| {
                    for (y, (&a, &u)) in y.iter_mut().zip(gate.iter().zip(up)) {
                        *y = silu(a, *y) * u;
                    }
                })
            });
        y
    }

    fn backward<T: WithDType + BulkExp>(gate: &[T], up: &[T], g: &[T]) -> (Vec<T>, Vec<T>) {
        let mut d_gate = vec![T::zero(); gate.len()];
        let mut d_up = vec![T::zero(); gate.len()];
        d_gate
            .par_chunks_mut(PER_TASK)
            .zip(d_up.par_chunks_mut(PER_TASK))
            .zip(gate.par_chunks(PER_TASK).zip(up.par_chunks(PER_TASK)))
            .zip(g.par_chunks(PER_TASK))
            .for_each(|(((d_gate, d_up), (gate, up)), g)| {
                exp_neg(gate, d_gate);
                vectorized!(|_| {
                    let inputs = gate.iter().zip(up).zip(g);
                    let outputs = d_gate.iter_mut().zip(d_up.iter_mut());
                    for ((dg, du), ((&a, &u), &g)) in outputs.zip(inputs) {
                        let e = *dg;
                        let s = silu(a, e);
                        let sigmoid = T::one() / (e + T::one());
                        *du = g * s;
                        *dg = (g * u) * (sigmoid * (T::one() - s) + s);
                    }
                })
            });
        (d_gate, d_up)
    }

    fn backward_as<T: WithDType + BulkExp>(
        gate: &Tensor,
        up: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let grads = with_data::<T, _>(gate, |a| {
            let grads = with_data::<T, _>(up, |u| {
                with_data::<T, _>(g, |g| Ok(Self::backward(a, u, g)))
            })?;
            Ok(grads.flatten())
        })?
        .flatten()
        .ok_or_else(|| candle_core::Error::Msg("swiglu: backward off the CPU".into()))?;
        let (d_gate, d_up) = grads;
        Ok((
            Some(tensor_from(d_gate, gate)?),
            Some(tensor_from(d_up, up)?),
        ))
    }
}

impl CustomOp2 for FusedSwiglu {
    fn name(&self) -> &'static str {
        "streambp-swiglu"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let y = match gs.dtype() {
            DType::F32 => f32::to_cpu_storage_owned(Self::forward::<f32>(
                input_data(gs, gl)?,
                input_data(us, ul)?,
            )),
            DType::F64 => f64::to_cpu_storage_owned(Self::forward::<f64>(
                input_data(gs, gl)?,
                input_data(us, ul)?,
            )),
            other => candle_core::bail!("swiglu op: {other:?} is not f32 or f64"),
        };
        Ok((y, gl.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        match gate.dtype() {
            DType::F32 => Self::backward_as::<f32>(gate, up, g),
            _ => Self::backward_as::<f64>(gate, up, g),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use streambp_testkit::{grads, max_diff};

    /// The fused op and the composed ops: equal outputs and gradients, in f64 to 1e-12 and in f32
    /// (the fused op's vectorized exponential against the library's) to 1e-5, on a strided gate and
    /// sizes below and above one task.
    #[test]
    fn the_fused_swiglu_matches_the_composed_one() {
        let dev = Device::Cpu;
        for (dtype, bound) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            for (rows, cols) in [(1, 3), (5, 96), (64, 200)] {
                let randn = |std: f64, shape: (usize, usize)| {
                    Tensor::randn(0f64, std, shape, &dev)
                        .and_then(|t| t.to_dtype(dtype))
                        .unwrap()
                };
                let gate = Var::from_tensor(&randn(3.0, (cols, rows)).t().unwrap()).unwrap();
                let up = Var::from_tensor(&randn(1.0, (rows, cols))).unwrap();
                let g = randn(1.0, (rows, cols));
                let fused = swiglu(gate.as_tensor(), up.as_tensor()).unwrap();
                let reference = composed(gate.as_tensor(), up.as_tensor()).unwrap();
                let what = format!("{dtype:?} {rows}x{cols}");
                assert!(max_diff(&fused, &reference) < bound, "{what}");
                let wrt = [&gate, &up];
                let pairs = grads(&fused, &g, &wrt)
                    .into_iter()
                    .zip(grads(&reference, &g, &wrt));
                for (which, (f, c)) in ["d gate", "d up"].into_iter().zip(pairs) {
                    assert!(max_diff(&f, &c) < bound, "{which} {what}");
                }
            }
        }
    }
}
