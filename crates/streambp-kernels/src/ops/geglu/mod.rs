//! The gated MLP's `gelu(gate) ⊙ up` (Gemma's), its backward written out: `d up = g ⊙ gelu(gate)`
//! and `d gate = g ⊙ up ⊙ gelu'(gate)`, for both of transformers' GELUs ([`Gelu`]).
//!
//! [`geglu`] picks the implementation by [`Backend`]: on the CPU the forward and the backward are
//! each one op of one pass ([`cpu`]), where composed the activation alone is eight tensor ops with
//! a buffer each, and autograd's backward about as many again; half precision on the CPU runs them
//! in f32. On the card (bf16, f32) each is one Triton kernel computing what the CPU's does, a bf16
//! activation rounded as bf16's arithmetic rounds it (`triton/gated.py`). [`composed`] is the
//! reference and every other device's path. candle's own fused `gelu`
//! is not used: its backward has 6-digit constants (relative error ~1e-6), which breaks exact
//! gradients.

mod cpu;

use candle_core::{DType, Tensor};

use crate::backend::Backend;
use crate::ops::cast::{round_in_place, through_f32};
use crate::ops::gated;

type CResult<T> = candle_core::Result<T>;

/// Which GELU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gelu {
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (transformers' `gelu_pytorch_tanh`).
    Tanh,
    /// `0.5·x·(1 + erf(x/√2))` (transformers' `gelu`).
    Erf,
}

/// `gelu(gate) ⊙ up`, differentiable in both. `round_to` (f32 inputs only) rounds the activation
/// to that dtype's values before the product, as a half-precision model's own arithmetic does
/// (a layer computed in f32 on the host); its backward, like autograd's, reads the rounded
/// activation for `d up` and differentiates the unrounded one for `d gate`.
pub fn geglu(gate: &Tensor, up: &Tensor, gelu: Gelu, round_to: Option<DType>) -> CResult<Tensor> {
    match Backend::of(gate) {
        Backend::Cpu => {
            let alike = gate.dtype() == up.dtype() && gate.shape() == up.shape();
            if matches!(gate.dtype(), DType::F32 | DType::F64) && alike {
                let kernel = cpu::Geglu::new(gelu, round_to, gate.dtype())?;
                return gated::apply(kernel, gate, up);
            }
            // bf16: computed in f32, its activation rounded to bf16 as bf16's arithmetic would.
            let in_f32 = |[gate, up]: [Tensor; 2]| geglu(&gate, &up, gelu, Some(DType::BF16));
            match through_f32([gate, up], in_f32)? {
                Some(out) => Ok(out),
                None => composed(gate, up, gelu, round_to),
            }
        }
        Backend::Cuda => {
            let on_card = match cpu::Geglu::new(gelu, round_to, gate.dtype()) {
                Ok(kernel) => gated::on_card(kernel, gate, up)?,
                Err(_) => None,
            };
            match on_card {
                Some(out) => Ok(out),
                None => composed(gate, up, gelu, round_to),
            }
        }
        Backend::Composed => composed(gate, up, gelu, round_to),
    }
}

/// [`geglu`] from tensor ops (every device and dtype; autograd differentiates it). `round_to`
/// rounds in place, which only the host does.
pub fn composed(
    gate: &Tensor,
    up: &Tensor,
    gelu: Gelu,
    round_to: Option<DType>,
) -> CResult<Tensor> {
    let activation = match gelu {
        Gelu::Tanh => gelu_tanh(gate)?,
        Gelu::Erf => gelu_erf(gate)?,
    };
    if let Some(dtype) = round_to {
        round_in_place(&activation, dtype)?;
    }
    activation * up
}

/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` from tensor ops.
pub fn gelu_tanh(x: &Tensor) -> CResult<Tensor> {
    let inner =
        ((x + (x.sqr()? * x)?.affine(cpu::CUBIC, 0.0)?)? * (2.0 / std::f64::consts::PI).sqrt())?;
    ((inner.tanh()? + 1.0)? * x)?.affine(0.5, 0.0)
}

/// `0.5·x·(1 + erf(x/√2))` from tensor ops.
pub fn gelu_erf(x: &Tensor) -> CResult<Tensor> {
    let e = (x / std::f64::consts::SQRT_2)?.erf()?;
    ((e + 1.0)? * x)?.affine(0.5, 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use streambp_testkit::{grads, max_diff};

    /// Both GELUs have the card's kernels for unrounded activations (a bf16 input's rounds in them).
    #[test]
    fn the_card_has_geglus_kernels() {
        for gelu in [Gelu::Tanh, Gelu::Erf] {
            let kernel = cpu::Geglu::new(gelu, None, DType::BF16).unwrap();
            assert!(gated::has_card_kernels(kernel), "{gelu:?}");
            let rounding = cpu::Geglu::new(gelu, Some(DType::BF16), DType::F32).unwrap();
            assert!(!gated::has_card_kernels(rounding), "{gelu:?}");
        }
    }

    /// The CPU ops and the composed ops: equal outputs and gradients for both GELUs, in f64 to
    /// 1e-12 and in f32 to 1e-5, with the activation rounded to bf16 in f32 as the composed path
    /// rounds it, on a strided gate and sizes below and above one task.
    #[test]
    fn the_cpu_geglu_matches_the_composed_one() {
        let dev = Device::Cpu;
        let cases = [
            (DType::F64, None, 1e-12),
            (DType::F32, None, 1e-5),
            (DType::F32, Some(DType::BF16), 1e-5),
        ];
        for (dtype, round_to, bound) in cases {
            for gelu in [Gelu::Tanh, Gelu::Erf] {
                for (rows, cols) in [(1, 3), (5, 96), (64, 200)] {
                    let randn = |std: f64, shape: (usize, usize)| {
                        Tensor::randn(0f64, std, shape, &dev)
                            .and_then(|t| t.to_dtype(dtype))
                            .and_then(|t| Var::from_tensor(&t))
                            .unwrap()
                    };
                    let gate = randn(2.0, (cols, rows));
                    let up = randn(1.0, (rows, cols));
                    let gate_t = gate.as_tensor().t().unwrap();
                    let g = randn(1.0, (rows, cols)).as_tensor().detach();
                    let on_cpu = geglu(&gate_t, up.as_tensor(), gelu, round_to).unwrap();
                    let reference = composed(&gate_t, up.as_tensor(), gelu, round_to).unwrap();
                    let what = format!("{dtype:?} {gelu:?} {round_to:?} {rows}x{cols}");
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

    /// Half precision runs in f32 with the activation rounded, as the composed ops in bf16 round
    /// it: the same bf16 output to the composed ops' own rounding error, on many random draws.
    #[test]
    fn bf16_rounds_the_activation_as_bf16_arithmetic_does() {
        let dev = Device::Cpu;
        for _ in 0..200 {
            let gate = Tensor::randn(0f32, 2.0, (7, 50), &dev).unwrap();
            let up = Tensor::randn(0f32, 1.0, (7, 50), &dev).unwrap();
            let (g16, u16) = (
                gate.to_dtype(DType::BF16).unwrap(),
                up.to_dtype(DType::BF16).unwrap(),
            );
            let got = geglu(&g16, &u16, Gelu::Tanh, None).unwrap();
            assert_eq!(got.dtype(), DType::BF16);
            let want = composed(&g16, &u16, Gelu::Tanh, None).unwrap();
            let as_f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            let values = |t: &Tensor| as_f32(t).to_vec1::<f32>().unwrap();
            let (got, want) = (values(&got), values(&want));
            let (gate, up) = (values(&g16), values(&u16));
            for i in 0..got.len() {
                // bf16's composed activation rounds each of its eight ops (2⁻⁹ each, relative to
                // terms as large as gate·up where `1 + tanh` cancels); the kernel only its result.
                let scale = want[i].abs() + (gate[i] * up[i]).abs();
                let bound = scale / 32.0;
                let diff = (got[i] - want[i]).abs();
                assert!(
                    diff <= bound,
                    "{i}: {} vs {} (gate {}, up {})",
                    got[i],
                    want[i],
                    gate[i],
                    up[i]
                );
            }
        }
    }
}
