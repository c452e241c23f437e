//! GeGLU's CPU kernel: one pass per direction over the elements, split over the threads, each
//! element's GELU and its derivative in closed form.

use candle_core::DType;
use num_traits::Float;
use rayon::prelude::*;

use super::Gelu;
use crate::host::cast::bf16_value;
use crate::ops::gated::GatedKernel;

/// The `0.044715` on `x³` of the tanh GELU.
pub(super) const CUBIC: f64 = 0.044715;

/// Elements per rayon task.
const PER_TASK: usize = 4096;

/// A float the kernel runs on: its `erf` as candle computes it, and its rounding to a half
/// precision's values.
pub(super) trait GeluFloat: Float + Send + Sync {
    /// The error function.
    fn erf(self) -> Self;
    /// The nearest value of `dtype` (bf16 or f16).
    fn rounded_to(self, dtype: DType) -> Self;
}

impl GeluFloat for f32 {
    fn erf(self) -> Self {
        candle_core::cpu::erf::erf_f32(self)
    }
    fn rounded_to(self, dtype: DType) -> Self {
        match dtype {
            DType::F16 => half::f16::from_f32(self).to_f32(),
            _ => bf16_value(self),
        }
    }
}

impl GeluFloat for f64 {
    fn erf(self) -> Self {
        candle_core::cpu::erf::erf_f64(self)
    }
    fn rounded_to(self, _: DType) -> Self {
        self
    }
}

/// The kernel for one GELU, the activation rounded to `round_to`'s values or not.
#[derive(Debug, Clone, Copy)]
pub(super) struct Geglu {
    gelu: Gelu,
    round_to: Option<DType>,
}

impl Geglu {
    /// The kernel; rounding to a half precision applies to f32 inputs only.
    pub(super) fn new(
        gelu: Gelu,
        round_to: Option<DType>,
        dtype: DType,
    ) -> candle_core::Result<Self> {
        match (round_to, dtype) {
            (None, _) | (Some(DType::BF16 | DType::F16), DType::F32) => Ok(Self { gelu, round_to }),
            (Some(to), _) => candle_core::bail!("geglu: a {dtype:?} activation rounded to {to:?}"),
        }
    }

    /// `gelu(x)` and `gelu'(x)`.
    #[inline(always)]
    fn activation<T: GeluFloat>(self, x: T) -> (T, T) {
        let c = |v: f64| T::from(v).unwrap_or_else(T::nan);
        let (one, half) = (T::one(), c(0.5));
        match self.gelu {
            Gelu::Tanh => {
                let k = c((2.0 / std::f64::consts::PI).sqrt());
                let inner = (x + x * x * x * c(CUBIC)) * k;
                let t = inner.tanh();
                let a = (t + one) * x * half;
                let slope = k * (one + c(3.0 * CUBIC) * x * x);
                (a, half * (one + t) + half * x * (one - t * t) * slope)
            }
            Gelu::Erf => {
                let e = (x * c(std::f64::consts::FRAC_1_SQRT_2)).erf();
                let a = (e + one) * x * half;
                let density =
                    c(0.5 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2);
                (a, half * (one + e) + x * (-(x * x) * half).exp() * density)
            }
        }
    }

    /// The activation as the product reads it.
    #[inline(always)]
    fn stored<T: GeluFloat>(self, a: T) -> T {
        match self.round_to {
            Some(dtype) => a.rounded_to(dtype),
            None => a,
        }
    }

    /// `gelu(gate) ⊙ up`.
    fn forward<T: GeluFloat>(self, gate: &[T], up: &[T]) -> Vec<T> {
        let mut y = vec![T::zero(); gate.len()];
        y.par_chunks_mut(PER_TASK)
            .zip(gate.par_chunks(PER_TASK).zip(up.par_chunks(PER_TASK)))
            .for_each(|(y, (gate, up))| {
                for (y, (&x, &u)) in y.iter_mut().zip(gate.iter().zip(up)) {
                    *y = self.stored(self.activation(x).0) * u;
                }
            });
        y
    }

    /// d gate followed by d up, for the output's gradient `g`.
    fn backward<T: GeluFloat>(self, gate: &[T], up: &[T], g: &[T]) -> Vec<T> {
        let mut out = vec![T::zero(); 2 * gate.len()];
        let (d_gate, d_up) = out.split_at_mut(gate.len());
        d_gate
            .par_chunks_mut(PER_TASK)
            .zip(d_up.par_chunks_mut(PER_TASK))
            .zip(gate.par_chunks(PER_TASK).zip(up.par_chunks(PER_TASK)))
            .zip(g.par_chunks(PER_TASK))
            .for_each(|(((d_gate, d_up), (gate, up)), g)| {
                let outputs = d_gate.iter_mut().zip(d_up.iter_mut());
                for ((dg, du), ((&x, &u), &g)) in outputs.zip(gate.iter().zip(up).zip(g)) {
                    let (a, slope) = self.activation(x);
                    *du = g * self.stored(a);
                    *dg = g * u * slope;
                }
            });
        out
    }
}

impl GatedKernel for Geglu {
    const NAME: &'static str = "streambp-geglu";
    const BACKWARD_NAME: &'static str = "streambp-geglu-backward";
    fn forward_f32(self, gate: &[f32], up: &[f32]) -> Vec<f32> {
        self.forward(gate, up)
    }
    fn forward_f64(self, gate: &[f64], up: &[f64]) -> Vec<f64> {
        self.forward(gate, up)
    }
    fn backward_f32(self, gate: &[f32], up: &[f32], g: &[f32]) -> Vec<f32> {
        self.backward(gate, up, g)
    }
    fn backward_f64(self, gate: &[f64], up: &[f64], g: &[f64]) -> Vec<f64> {
        self.backward(gate, up, g)
    }
    /// The card's kernels round a bf16 input's activation themselves, and an f32 one's not at all.
    fn card_variant(self) -> Option<usize> {
        match (self.round_to, self.gelu) {
            (Some(_), _) => None,
            (None, Gelu::Tanh) => Some(1),
            (None, Gelu::Erf) => Some(2),
        }
    }
}
