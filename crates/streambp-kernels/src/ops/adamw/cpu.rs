//! AdamW's update on the host: one pass over the parameter, its gradient and both moments, split
//! over rayon's threads, each element computed exactly as the composed update's ops compute it
//! (candle's `x·mul + add` for every product by a number, the constants rounded to the state's
//! dtype once), so the result is the composed update's, bit for bit.

use candle_core::{DType, Tensor, WithDType};
use half::bf16;
use num_traits::Float;
use rayon::prelude::*;

use super::AdamWStep;
use crate::host::storage::{storage_id, with_data, with_data_mut};

type CResult<T> = candle_core::Result<T>;

/// Elements per rayon task.
const PER_TASK: usize = 1 << 14;

/// An element of a parameter or gradient read into, and written from, the state's float `S`.
trait Element<S>: WithDType {
    fn load(self) -> S;
    fn store(s: S) -> Self;
}

impl Element<f32> for f32 {
    fn load(self) -> f32 {
        self
    }
    fn store(s: f32) -> f32 {
        s
    }
}

impl Element<f64> for f64 {
    fn load(self) -> f64 {
        self
    }
    fn store(s: f64) -> f64 {
        s
    }
}

impl Element<f32> for bf16 {
    fn load(self) -> f32 {
        self.to_f32()
    }
    /// Rounded to nearest even, as candle's (and the host's) cast.
    fn store(s: f32) -> bf16 {
        bf16::from_f32(s)
    }
}

/// The update's numbers in the state's dtype, as candle's ops round them from f64.
#[derive(Clone, Copy)]
struct Constants<S> {
    decay: Option<S>,
    beta1: S,
    rest1: S,
    beta2: S,
    rest2: S,
    inv_bc1: S,
    inv_bc2: S,
    eps: S,
    lr: S,
}

impl<S: Float> Constants<S> {
    fn of(step: &AdamWStep) -> Self {
        let s = |x: f64| S::from(x).unwrap_or_else(S::nan);
        Self {
            decay: (step.decay != 1.0).then(|| s(step.decay)),
            beta1: s(step.beta1),
            rest1: s(1.0 - step.beta1),
            beta2: s(step.beta2),
            rest2: s(1.0 - step.beta2),
            inv_bc1: s(1.0 / step.bias_corrections.0),
            inv_bc2: s(1.0 / step.bias_corrections.1),
            eps: s(step.eps),
            lr: s(step.lr),
        }
    }

    /// One element's update, op for op the composed one's (`x·mul + 0` is candle's product by a
    /// number, `x·1 + eps` its sum).
    #[inline(always)]
    fn apply(&self, p: S, g: S, m: &mut S, v: &mut S) -> S {
        let zero = S::zero();
        let p = match self.decay {
            Some(decay) => p * decay + zero,
            None => p,
        };
        *m = (*m * self.beta1 + zero) + (g * self.rest1 + zero);
        *v = (*v * self.beta2 + zero) + ((g * g) * self.rest2 + zero);
        let denom = (*v * self.inv_bc2 + zero).sqrt() * S::one() + self.eps;
        let update = (*m * self.inv_bc1 + zero) / denom;
        p - (update * self.lr + zero)
    }
}

/// [`super::update_in_place`] on the host: `p` f32, f64 or bf16 with moments in f32 (f64 for f64),
/// the gradient in `p`'s dtype or the moments'; all contiguous, with `p`'s element count, and no
/// two sharing storage (each is locked for the pass). `false` otherwise.
pub(super) fn update(
    p: &Tensor,
    g: &Tensor,
    (m, v): (&Tensor, &Tensor),
    step: &AdamWStep,
) -> CResult<bool> {
    let n = p.elem_count();
    let state = m.dtype();
    let laid_out = [p, g, m, v]
        .iter()
        .all(|t| t.device().is_cpu() && t.is_contiguous() && t.elem_count() == n);
    let dtypes = v.dtype() == state && (g.dtype() == p.dtype() || g.dtype() == state);
    if !laid_out || !dtypes || !distinct(&[p, g, m, v]) {
        return Ok(false);
    }
    match (p.dtype(), state, g.dtype()) {
        (DType::F32, DType::F32, _) => run::<f32, f32, f32>(p, g, (m, v), step),
        (DType::F64, DType::F64, _) => run::<f64, f64, f64>(p, g, (m, v), step),
        (DType::BF16, DType::F32, DType::BF16) => run::<f32, bf16, bf16>(p, g, (m, v), step),
        (DType::BF16, DType::F32, _) => run::<f32, bf16, f32>(p, g, (m, v), step),
        _ => Ok(false),
    }
}

/// Whether no two of `tensors` share a buffer (the empty ones aside, which hold none).
fn distinct(tensors: &[&Tensor]) -> bool {
    let ids: Vec<Option<usize>> = tensors.iter().map(|t| storage_id(t)).collect();
    ids.iter()
        .enumerate()
        .all(|(i, a)| a.is_some_and(|a| a == 0 || ids[i + 1..].iter().all(|b| *b != Some(a))))
}

/// The pass for state `S`, parameter `P` and gradient `G`.
fn run<S, P, G>(
    p: &Tensor,
    g: &Tensor,
    (m, v): (&Tensor, &Tensor),
    step: &AdamWStep,
) -> CResult<bool>
where
    S: Float + WithDType + Send + Sync,
    P: Element<S>,
    G: Element<S>,
{
    let c = Constants::<S>::of(step);
    let slice = |l: &candle_core::Layout| -> CResult<std::ops::Range<usize>> {
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("adamw: not contiguous".into()))?;
        Ok(start..end)
    };
    let done = with_data::<G, _>(g, |g| {
        with_data_mut::<S, _>(m, |m, lm| {
            let m = &mut m[slice(lm)?];
            with_data_mut::<S, _>(v, |v, lv| {
                let v = &mut v[slice(lv)?];
                with_data_mut::<P, _>(p, |p, lp| {
                    let p = &mut p[slice(lp)?];
                    p.par_chunks_mut(PER_TASK)
                        .zip(g.par_chunks(PER_TASK))
                        .zip(m.par_chunks_mut(PER_TASK).zip(v.par_chunks_mut(PER_TASK)))
                        .for_each(|((p, g), (m, v))| {
                            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
                                *p = P::store(c.apply((*p).load(), g.load(), m, v));
                            }
                        });
                    Ok(())
                })
            })
        })
    })?;
    Ok(done.flatten().flatten().flatten().is_some())
}
