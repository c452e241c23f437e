//! The divergence's CPU kernel: per row of a logits chunk, both log-sum-exps (one vectorized pass
//! of exponentials each, into a row of scratch), then the divergence, or its gradient written out;
//! rows split over the threads.

use rayon::prelude::*;

use crate::host::exp::BulkExp;
use crate::host::reduce::row_max;

/// Rows per rayon task.
const ROWS_PER_TASK: usize = 4;

/// One row's softmax: `p = exp(z − max) / Σ` from its exponentials, `log p = z − lse`.
#[derive(Clone, Copy)]
struct Row<T> {
    lse: T,
    inv_sum: T,
}

/// The exponentials `exp(z − max)` of `z` into `exps`, and the row's log-sum-exp and `1 / Σ`.
fn softmax_row<T: BulkExp>(z: &[T], exps: &mut [T]) -> Row<T> {
    let max = row_max(z, T::neg_infinity());
    exps.copy_from_slice(z);
    let sum = T::exp_shifted_sum(exps, max);
    Row {
        lse: sum.ln() + max,
        inv_sum: T::one() / sum,
    }
}

/// One pair of rows after [`Jsd::row`]: both softmaxes, the divergence, and the KL the student's
/// gradient subtracts (`KL(p_s‖p_t)`, or `KL(p_s‖m)` between the ends; unused for `β = 0`).
struct Pair<T> {
    s: Row<T>,
    t: Row<T>,
    divergence: T,
    kl: T,
}

/// `p·(log p − log q)`, 0 where `p` is 0 (its limit; `log p` may then be −∞).
#[inline(always)]
fn plogp<T: num_traits::Float>(p: T, log_p: T, log_q: T) -> T {
    match p > T::zero() {
        true => p * (log_p - log_q),
        false => T::zero(),
    }
}

/// The generalized JSD of pairs of rows, `beta` as TRL's.
#[derive(Debug, Clone, Copy)]
pub(super) struct Jsd {
    pub beta: f64,
}

impl Jsd {
    /// Each row's divergence, for rows `student` and `teacher` of `vocab` values each.
    pub(super) fn forward<T: BulkExp + Send + Sync>(
        self,
        student: &[T],
        teacher: &[T],
        vocab: usize,
    ) -> Vec<T> {
        let rows = student.len() / vocab.max(1);
        let mut out = vec![T::zero(); rows];
        out.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(task, out)| {
                let (mut es, mut et) = (vec![T::zero(); vocab], vec![T::zero(); vocab]);
                for (i, out) in out.iter_mut().enumerate() {
                    let r = (task * ROWS_PER_TASK + i) * vocab;
                    let (zs, zt) = (&student[r..r + vocab], &teacher[r..r + vocab]);
                    *out = self.row(zs, zt, (&mut es, &mut et)).divergence;
                }
            });
        out
    }

    /// The divergence of one row, leaving both softmaxes' exponentials in `es` and `et`.
    fn row<T: BulkExp>(self, zs: &[T], zt: &[T], (es, et): (&mut [T], &mut [T])) -> Pair<T> {
        let (s, t) = (softmax_row(zs, es), softmax_row(zt, et));
        let beta = T::from(self.beta).unwrap_or_else(T::nan);
        let one = T::one();
        let (mut to_s, mut to_m_t, mut to_m_s) = (T::zero(), T::zero(), T::zero());
        for j in 0..zs.len() {
            let (ps, pt) = (es[j] * s.inv_sum, et[j] * t.inv_sum);
            let (lps, lpt) = (zs[j] - s.lse, zt[j] - t.lse);
            if self.beta == 0.0 {
                to_s += plogp(pt, lpt, lps);
            } else if self.beta == 1.0 {
                to_s += plogp(ps, lps, lpt);
            } else {
                let lm = ((one - beta) * ps + beta * pt).ln();
                to_m_t += plogp(pt, lpt, lm);
                to_m_s += plogp(ps, lps, lm);
            }
        }
        let (divergence, kl) = match self.beta {
            0.0 | 1.0 => (to_s, to_s),
            _ => (beta * to_m_t + (one - beta) * to_m_s, to_m_s),
        };
        Pair {
            s,
            t,
            divergence,
            kl,
        }
    }

    /// The student's logits' gradient for each row's `g` = dLoss/d(divergence):
    /// `β = 0`: `g·(p_s − p_t)`; `β = 1`: `g·p_s·(log p_s − log p_t − KL(p_s‖p_t))`; between:
    /// `g·(1 − β)·p_s·(log p_s − log m − KL(p_s‖m))`.
    pub(super) fn backward<T: BulkExp + Send + Sync>(
        self,
        student: &[T],
        teacher: &[T],
        g: &[T],
        vocab: usize,
    ) -> Vec<T> {
        let mut dz = vec![T::zero(); student.len()];
        let task = ROWS_PER_TASK * vocab.max(1);
        dz.par_chunks_mut(task)
            .enumerate()
            .for_each(|(task_index, dz)| {
                let mut et = vec![T::zero(); vocab];
                for (i, dz) in dz.chunks_mut(vocab.max(1)).enumerate() {
                    let row = task_index * ROWS_PER_TASK + i;
                    let r = row * vocab;
                    let (zs, zt) = (&student[r..r + vocab], &teacher[r..r + vocab]);
                    // The student's exponentials go where its gradient will.
                    let pair = self.row(zs, zt, (dz, &mut et));
                    self.row_grad(zs, zt, (dz, &et), &pair, g[row]);
                }
            });
        dz
    }

    /// One row's gradient, written over the student's exponentials `es` ([`Jsd::row`]'s).
    fn row_grad<T: BulkExp>(
        self,
        zs: &[T],
        zt: &[T],
        (es, et): (&mut [T], &[T]),
        pair: &Pair<T>,
        g: T,
    ) {
        let (s, t, kl) = (pair.s, pair.t, pair.kl);
        let beta = T::from(self.beta).unwrap_or_else(T::nan);
        let one = T::one();
        for j in 0..zs.len() {
            let (ps, pt) = (es[j] * s.inv_sum, et[j] * t.inv_sum);
            let lps = zs[j] - s.lse;
            es[j] = if self.beta == 0.0 {
                g * (ps - pt)
            } else if self.beta == 1.0 {
                g * ps * (lps - (zt[j] - t.lse) - kl)
            } else {
                let lm = ((one - beta) * ps + beta * pt).ln();
                match ps > T::zero() {
                    true => g * (one - beta) * ps * (lps - lm - kl),
                    false => T::zero(),
                }
            };
        }
    }
}
