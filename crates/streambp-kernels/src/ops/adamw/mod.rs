//! AdamW's update of one parameter (torch's AdamW, decoupled decay first), in place where a kernel
//! of the parameter's device does it in one pass: on the card, `triton/adamw.py` (`cuda.rs`) reads
//! the parameter, its gradient and both f32 moments once and writes the three back; on the host
//! (`cpu.rs`) the same pass over rayon's threads, bit for bit the composed update. Composed (the
//! trainer's `AdamWConfig::update`, the reference) it makes about a dozen passes with a buffer
//! each. Elsewhere [`update_in_place`] answers `false` and the caller composes.

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod compiled;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod cuda_table;

use candle_core::Tensor;

use crate::backend::Backend;

type CResult<T> = candle_core::Result<T>;

/// One update's constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// The learning rate.
    pub lr: f64,
    /// The factor the parameter is first multiplied by: `1 − lr·weight_decay`, 1 without decay.
    pub decay: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the root of the corrected second moment.
    pub eps: f64,
    /// `(1 − β1ᵗ, 1 − β2ᵗ)` of update number t.
    pub bias_corrections: (f64, f64),
}

/// Updates `p` and its moments `m` and `v` (f32; f64 for an f64 parameter) in place by one step
/// with the gradient `g` (`p`'s dtype or the moments'), where a kernel of their device does it (the
/// card and the host, for bf16 and f32 parameters laid out contiguously, and f64 ones on the host):
/// `p ← p·decay; m ← β1·m + (1 − β1)·g; v ← β2·v + (1 − β2)·g²;
/// p ← p − lr·(m / bc1) / (√(v / bc2) + eps)`, in the moments' dtype, p rounded once. Answers
/// `false` (and changes nothing) where none does, and the caller composes the update.
pub fn update_in_place(
    p: &Tensor,
    g: &Tensor,
    (m, v): (&Tensor, &Tensor),
    step: &AdamWStep,
) -> CResult<bool> {
    match Backend::of(p) {
        Backend::Cpu => cpu::update(p, g, (m, v), step),
        #[cfg(feature = "cuda")]
        Backend::Cuda => cuda::update(p, g, (m, v), step),
        _ => Ok(false),
    }
}

/// The same update composed of tensor ops, every device's path without a kernel and the reference
/// the kernels are held to: `p` and `g` are taken in the moments' dtype, and the new `[p, m, v]`
/// returned (`p` in the moments' dtype; nothing is written in place).
pub fn composed(
    p: &Tensor,
    g: &Tensor,
    (m, v): (&Tensor, &Tensor),
    step: &AdamWStep,
) -> CResult<[Tensor; 3]> {
    let (bc1, bc2) = step.bias_corrections;
    let state = m.dtype();
    let (p, g) = (p.to_dtype(state)?, g.to_dtype(state)?);
    let p = match step.decay == 1.0 {
        true => p,
        false => (p * step.decay)?,
    };
    let m = ((m * step.beta1)? + (&g * (1.0 - step.beta1))?)?;
    let v = ((v * step.beta2)? + (g.sqr()? * (1.0 - step.beta2))?)?;
    let denom = ((&v / bc2)?.sqrt()? + step.eps)?;
    let update = ((&m / bc1)? / denom)?;
    Ok([(p - (update * step.lr)?)?, m, v])
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// On the host the pass equals the composed update bit for bit: f32 and f64 parameters, bf16
    /// ones with bf16 and f32 gradients (the parameter rounded once), a first and a later step,
    /// with and without decay, more elements than one thread's share; moments in another dtype, and
    /// buffers shared between the operands, are declined.
    #[test]
    fn the_host_pass_is_the_composed_update() {
        let n = 40_000;
        let dev = Device::Cpu;
        let values = |seed: u64, range: (f64, f64)| {
            Tensor::from_vec(crate::testing::spread(n, seed, range), n, &dev).unwrap()
        };
        let bits = |t: &Tensor| {
            let t = t.to_dtype(DType::F64).unwrap();
            t.to_vec1::<f64>()
                .unwrap()
                .into_iter()
                .map(f64::to_bits)
                .collect::<Vec<_>>()
        };
        let cases = [
            (DType::F32, DType::F32, DType::F32),
            (DType::F64, DType::F64, DType::F64),
            (DType::BF16, DType::F32, DType::BF16),
            (DType::BF16, DType::F32, DType::F32),
        ];
        for (p_dtype, state, g_dtype) in cases {
            for (t, decay) in [(1, 1.0), (7, 1.0 - 1e-3 * 0.1)] {
                let step = AdamWStep {
                    lr: 1e-3,
                    decay,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    bias_corrections: (1.0 - 0.9f64.powi(t), 1.0 - 0.999f64.powi(t)),
                };
                let p = values(1, (-2.0, 2.0)).to_dtype(p_dtype).unwrap();
                let g = values(2, (-0.1, 0.1)).to_dtype(g_dtype).unwrap();
                let m = values(3, (-0.05, 0.05)).to_dtype(state).unwrap();
                let v = values(4, (0.0, 0.01)).to_dtype(state).unwrap();
                let want = composed(&p, &g, (&m, &v), &step).unwrap();
                assert!(update_in_place(&p, &g, (&m, &v), &step).unwrap());
                let what = format!("{p_dtype:?} state {state:?} grad {g_dtype:?} step {t}");
                let want_p = want[0].to_dtype(p_dtype).unwrap();
                assert!(bits(&p) == bits(&want_p), "{what}: p");
                assert!(bits(&m) == bits(&want[1]), "{what}: m");
                assert!(bits(&v) == bits(&want[2]), "{what}: v");
            }
        }
        let p = values(1, (-1.0, 1.0)).to_dtype(DType::F32).unwrap();
        let m64 = values(3, (-1.0, 1.0));
        let step = AdamWStep {
            lr: 1e-3,
            decay: 1.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            bias_corrections: (0.1, 0.001),
        };
        assert!(
            !update_in_place(&p, &p.copy().unwrap(), (&m64, &m64.copy().unwrap()), &step).unwrap()
        );
        // Operands sharing a buffer (a moment the parameter's, the gradient the parameter's, the
        // two moments one): declined, not locked twice.
        let p64 = values(1, (-1.0, 1.0));
        let (g64, v64) = (values(2, (-1.0, 1.0)), values(4, (0.0, 1.0)));
        for (g, m, v) in [(&g64, &p64, &m64), (&p64, &m64, &v64), (&g64, &m64, &m64)] {
            assert!(!update_in_place(&p64, g, (m, v), &step).unwrap());
        }
    }
}
