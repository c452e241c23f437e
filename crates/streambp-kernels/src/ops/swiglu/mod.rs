//! The gated MLP's `silu(gate) ⊙ up`, its backward written out: `d up = g ⊙ silu(gate)` and
//! `d gate = g ⊙ up ⊙ silu'(gate)` with `silu'(x) = σ(x)·(1 − silu(x)) + silu(x)` (candle's own form).
//!
//! [`swiglu`] picks the implementation by [`Backend`]: on the CPU the forward and the backward are
//! each one op of one pass ([`cpu`]), where composed the activation and the product are two ops
//! with a buffer each and autograd's backward makes about seven passes; half precision on the CPU
//! runs them in f32. On the card (bf16, f32) each is one Triton kernel computing what the CPU's
//! does (`triton/gated.py`). [`composed`] is the reference and every other device's path.

mod cpu;

use candle_core::{DType, Tensor};

use crate::backend::Backend;
use crate::ops::cast::through_f32;
use crate::ops::gated::{self, GatedKernel};

type CResult<T> = candle_core::Result<T>;

/// `silu(gate) ⊙ up`, differentiable in both.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    match Backend::of(gate) {
        Backend::Cpu => {
            let alike = gate.dtype() == up.dtype() && gate.shape() == up.shape();
            if matches!(gate.dtype(), DType::F32 | DType::F64) && alike {
                return gated::apply(Silu, gate, up);
            }
            match through_f32([gate, up], |[gate, up]| swiglu(&gate, &up))? {
                Some(out) => Ok(out),
                None => composed(gate, up),
            }
        }
        Backend::Cuda => match gated::on_card(Silu, gate, up)? {
            Some(out) => Ok(out),
            None => composed(gate, up),
        },
        Backend::Composed => composed(gate, up),
    }
}

/// [`swiglu`] from tensor ops (every device and dtype; autograd differentiates it).
pub fn composed(gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    gate.silu()? * up
}

/// SwiGLU's kernel ([`cpu`]).
#[derive(Clone, Copy)]
struct Silu;

impl GatedKernel for Silu {
    const NAME: &'static str = "streambp-swiglu";
    const BACKWARD_NAME: &'static str = "streambp-swiglu-backward";
    fn forward_f32(self, gate: &[f32], up: &[f32]) -> Vec<f32> {
        cpu::forward(gate, up)
    }
    fn forward_f64(self, gate: &[f64], up: &[f64]) -> Vec<f64> {
        cpu::forward(gate, up)
    }
    fn backward_f32(self, gate: &[f32], up: &[f32], g: &[f32]) -> Vec<f32> {
        cpu::backward(gate, up, g)
    }
    fn backward_f64(self, gate: &[f64], up: &[f64], g: &[f64]) -> Vec<f64> {
        cpu::backward(gate, up, g)
    }
    fn card_variant(self) -> Option<usize> {
        Some(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use streambp_testkit::{grads, max_diff};

    #[test]
    fn the_card_has_swiglus_kernels() {
        assert!(gated::has_card_kernels(Silu));
    }

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
