//! The gated MLP's `silu(gate) ⊙ up` as one op on the CPU (f32/f64), its backward written out:
//! `d up = g ⊙ silu(gate)` and `d gate = g ⊙ up ⊙ silu'(gate)` with
//! `silu'(x) = σ(x)·(1 − silu(x)) + silu(x)` (candle's own form). Composed, the activation and the
//! product are two ops with a buffer each and autograd's backward makes about seven passes; here each
//! is one pass. Elsewhere (CUDA, half precision) [`swiglu`] composes the same tensor ops as before.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor, WithDType};
use num_traits::Float;
use rayon::prelude::*;

use crate::cpu::{fusable, input_data, tensor_from, with_data};
use crate::error::Result;

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
    composed(gate, up)
}

/// [`swiglu`] from tensor ops (every device and dtype).
fn composed(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok((candle_nn::ops::silu(gate)? * up)?)
}

/// `x / (1 + exp(−x))`, as candle's `silu` computes it.
fn silu<T: Float>(x: T) -> T {
    x / (T::one() + (-x).exp())
}

struct FusedSwiglu;

impl FusedSwiglu {
    fn forward<T: WithDType + Float>(gate: &[T], up: &[T]) -> Vec<T> {
        let mut y = vec![T::zero(); gate.len()];
        y.par_iter_mut()
            .zip(gate.par_iter().zip(up.par_iter()))
            .with_min_len(PER_TASK)
            .for_each(|(y, (&a, &u))| *y = silu(a) * u);
        y
    }

    fn backward<T: WithDType + Float>(gate: &[T], up: &[T], g: &[T]) -> (Vec<T>, Vec<T>) {
        let mut d_gate = vec![T::zero(); gate.len()];
        let mut d_up = vec![T::zero(); gate.len()];
        d_gate
            .par_iter_mut()
            .zip(d_up.par_iter_mut())
            .zip(gate.par_iter().zip(up.par_iter()).zip(g.par_iter()))
            .with_min_len(PER_TASK)
            .for_each(|((dg, du), ((&a, &u), &g))| {
                let s = silu(a);
                let sigmoid = T::one() / ((-a).exp() + T::one());
                *du = g * s;
                *dg = (g * u) * (sigmoid * (T::one() - s) + s);
            });
        (d_gate, d_up)
    }

    fn backward_as<T: WithDType + Float>(
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
    use crate::testing::{grads, max_diff};
    use candle_core::{Device, Var};

    /// The fused op and the composed ops: equal outputs and gradients in f64, on a strided gate and
    /// sizes below and above one task.
    #[test]
    fn the_fused_swiglu_matches_the_composed_one_in_f64() {
        let dev = Device::Cpu;
        for (rows, cols) in [(1, 3), (5, 96), (64, 200)] {
            let gate = Var::from_tensor(
                &Tensor::randn(0f64, 3.0, (cols, rows), &dev)
                    .unwrap()
                    .t()
                    .unwrap(),
            )
            .unwrap();
            let up =
                Var::from_tensor(&Tensor::randn(0f64, 1.0, (rows, cols), &dev).unwrap()).unwrap();
            let g = Tensor::randn(0f64, 1.0, (rows, cols), &dev).unwrap();
            let fused = swiglu(gate.as_tensor(), up.as_tensor()).unwrap();
            let reference = composed(gate.as_tensor(), up.as_tensor()).unwrap();
            assert!(max_diff(&fused, &reference) < 1e-12, "{rows}x{cols}");
            let wrt = [&gate, &up];
            let pairs = grads(&fused, &g, &wrt)
                .into_iter()
                .zip(grads(&reference, &g, &wrt));
            for (which, (f, c)) in ["d gate", "d up"].into_iter().zip(pairs) {
                assert!(max_diff(&f, &c) < 1e-12, "{which} {rows}x{cols}");
            }
        }
    }
}
