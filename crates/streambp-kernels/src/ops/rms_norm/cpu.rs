//! RMSNorm's CPU kernel: one pass per row forward, one per row backward, rows split over the
//! threads.

use num_traits::Float;
use rayon::prelude::*;

use super::NormStyle;
use crate::vectorized;

/// Rows per rayon task: a row is a few hundred elements, too little work to hand out alone.
const ROWS_PER_TASK: usize = 16;

/// A norm's constants, as both passes read them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Norm {
    pub(super) eps: f64,
    /// `s = 1 + w` (Gemma) rather than `w`.
    pub(super) one_plus: bool,
}

impl Norm {
    pub(super) fn new(eps: f64, style: NormStyle) -> Self {
        Self {
            eps,
            one_plus: style == NormStyle::OnePlusWeightInF32,
        }
    }

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

    /// `y` for rows `x` of `w.len()` values each.
    pub(super) fn forward<T: Float + Send + Sync>(&self, x: &[T], w: &[T]) -> Vec<T> {
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

    /// dx's rows followed by dw, for rows `x`, weight `w` and the output's gradient `g`.
    pub(super) fn backward<T: Float + Send + Sync + std::ops::AddAssign>(
        &self,
        x: &[T],
        w: &[T],
        g: &[T],
    ) -> Vec<T> {
        let dim = w.len().max(1);
        let inv_dim = T::from(1.0 / dim as f64).unwrap_or_else(T::zero);
        let mut out = vec![T::zero(); x.len() + dim];
        let (dx, dw) = out.split_at_mut(x.len());
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
        vectorized!(|_| {
            for ((x, g), &r) in x.chunks(dim).zip(g.chunks(dim)).zip(&inv_rms) {
                for ((dw, &x), &g) in dw.iter_mut().zip(x).zip(g) {
                    *dw += g * (x * r);
                }
            }
        });
        out
    }
}
