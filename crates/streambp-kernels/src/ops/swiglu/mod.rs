//! The gated MLP's `silu(gate) ⊙ up`, its backward written out: `d up = g ⊙ silu(gate)` and
//! `d gate = g ⊙ up ⊙ silu'(gate)` with `silu'(x) = σ(x)·(1 − silu(x)) + silu(x)` (candle's own form).
//!
//! [`swiglu`] picks the implementation by [`Backend`]: on the CPU the forward and the backward are
//! each one op of one pass ([`cpu`]), where composed the activation and the product are two ops
//! with a buffer each and autograd's backward makes about seven passes; half precision on the CPU
//! runs them in f32. [`composed`] is the reference and every other device's path.

mod cpu;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

use crate::backend::Backend;
use crate::host::storage::input_data;
use crate::ops::cast::through_f32;

type CResult<T> = candle_core::Result<T>;

/// `silu(gate) ⊙ up`, differentiable in both.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    match Backend::of(gate) {
        Backend::Cpu => {
            let alike = gate.dtype() == up.dtype() && gate.shape() == up.shape();
            if matches!(gate.dtype(), DType::F32 | DType::F64) && alike {
                return gate.contiguous()?.apply_op2(&up.contiguous()?, Forward);
            }
            match through_f32([gate, up], |[gate, up]| swiglu(&gate, &up))? {
                Some(out) => Ok(out),
                None => composed(gate, up),
            }
        }
        Backend::Cuda | Backend::Composed => composed(gate, up),
    }
}

/// [`swiglu`] from tensor ops (every device and dtype; autograd differentiates it).
pub fn composed(gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    gate.silu()? * up
}

/// The forward.
struct Forward;

impl CustomOp2 for Forward {
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
        let y = match (gs, us) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => CpuStorage::F32(cpu::forward::<f32>(
                input_data(gs, gl)?,
                input_data(us, ul)?,
            )),
            (CpuStorage::F64(_), CpuStorage::F64(_)) => CpuStorage::F64(cpu::forward::<f64>(
                input_data(gs, gl)?,
                input_data(us, ul)?,
            )),
            _ => candle_core::bail!("swiglu: gate and up not both f32 or f64"),
        };
        Ok((y, gl.shape().clone()))
    }

    /// [`Backward`], on the backend of the forward's inputs.
    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (gate, up, g) = (gate.detach(), up.detach(), g.contiguous()?);
        let both = gate.apply_op3_no_bwd(&up, &g, &Backward)?;
        // `[2, n]`: d gate, then d up.
        let grad = |i: usize| both.get(i)?.reshape(gate.shape());
        Ok((Some(grad(0)?), Some(grad(1)?)))
    }
}

/// The backward of `gate`, `up` and the output's gradient: one output `[2, n]`, d gate then d up.
struct Backward;

impl CustomOp3 for Backward {
    fn name(&self) -> &'static str {
        "streambp-swiglu-backward"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
        dys: &CpuStorage,
        dyl: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let out = match (gs, us, dys) {
            (CpuStorage::F32(_), CpuStorage::F32(_), CpuStorage::F32(_)) => {
                CpuStorage::F32(cpu::backward::<f32>(
                    input_data(gs, gl)?,
                    input_data(us, ul)?,
                    input_data(dys, dyl)?,
                ))
            }
            (CpuStorage::F64(_), CpuStorage::F64(_), CpuStorage::F64(_)) => {
                CpuStorage::F64(cpu::backward::<f64>(
                    input_data(gs, gl)?,
                    input_data(us, ul)?,
                    input_data(dys, dyl)?,
                ))
            }
            _ => candle_core::bail!("swiglu backward: inputs not all f32 or f64"),
        };
        Ok((out, Shape::from((2, gl.shape().elem_count()))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use streambp_testkit::{grads, max_diff};

    /// The CPU ops and the composed ops: equal outputs and gradients, in f64 to 1e-12 and in f32
    /// (the CPU's vectorized exponential against the library's) to 1e-5, on a strided gate and
    /// sizes below and above one task.
    #[test]
    fn the_cpu_swiglu_matches_the_composed_one() {
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
                let on_cpu = swiglu(gate.as_tensor(), up.as_tensor()).unwrap();
                let reference = composed(gate.as_tensor(), up.as_tensor()).unwrap();
                let what = format!("{dtype:?} {rows}x{cols}");
                assert!(max_diff(&on_cpu, &reference) < bound, "{what}");
                let wrt = [&gate, &up];
                let pairs = grads(&on_cpu, &g, &wrt)
                    .into_iter()
                    .zip(grads(&reference, &g, &wrt));
                for (which, (f, c)) in ["d gate", "d up"].into_iter().zip(pairs) {
                    assert_eq!(f.dims(), c.dims(), "{which} {what}");
                    assert!(max_diff(&f, &c) < bound, "{which} {what}");
                }
            }
        }
    }
}
