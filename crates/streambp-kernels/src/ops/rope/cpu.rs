//! Rope's CPU kernel: each row of `x` (one head of one token) rotated in one pass, written out for
//! halves `x = [x₁, x₂]` as `y = [x₁c₁ − x₂s₁, x₂c₂ + x₁s₂]` (the composed ops' arithmetic,
//! `x·cos + rotate_half(x)·sin`), and its transpose for the gradient,
//! `dx = [g₁c₁ + g₂s₂, g₂c₂ − g₁s₁]`.

use num_traits::Float;
use rayon::prelude::*;

use crate::vectorized;

type CResult<T> = candle_core::Result<T>;

/// Rows (one head of one token each) per rayon task.
const ROWS_PER_TASK: usize = 16;

/// Where each row of `x` `[b, heads, len, hd]` finds its table row.
#[derive(Debug, Clone, Copy)]
pub(super) struct Rotation {
    pub head_dim: usize,
    /// `heads × len`: rows of `x` per batch row.
    pub rows_per_batch: usize,
    pub len: usize,
    /// Whether the tables hold one table per batch row (packing).
    pub per_batch: bool,
}

impl Rotation {
    /// The table row of `x`'s row `r`.
    fn table_row(&self, r: usize) -> usize {
        let batch = match self.per_batch {
            true => r / self.rows_per_batch,
            false => 0,
        };
        batch * self.len + r % self.len
    }

    /// `x` rotated forward (`inverse` false) or by the transpose (the gradient, `inverse` true).
    pub(super) fn rotate<T: Float + Send + Sync>(
        &self,
        x: &[T],
        (cos, sin): (&[T], &[T]),
        inverse: bool,
    ) -> CResult<Vec<T>> {
        let hd = self.head_dim;
        let half = hd / 2;
        let rows = x.len() / hd.max(1);
        let needed = match rows {
            0 => 0,
            _ => (self.table_row(rows - 1) + 1) * hd,
        };
        if cos.len() < needed || sin.len() < needed || hd == 0 {
            candle_core::bail!("rope: tables of {} values for {rows} rows", cos.len());
        }
        let mut y = vec![T::zero(); x.len()];
        y.par_chunks_mut(hd * ROWS_PER_TASK)
            .zip(x.par_chunks(hd * ROWS_PER_TASK))
            .enumerate()
            .for_each(|(task, (y, x))| {
                vectorized!(|_| {
                    let rows = y.chunks_mut(hd).zip(x.chunks(hd));
                    for (i, (y, x)) in rows.enumerate() {
                        let t = self.table_row(task * ROWS_PER_TASK + i) * hd;
                        let (c, s) = (&cos[t..t + hd], &sin[t..t + hd]);
                        let (y1, y2) = y.split_at_mut(half);
                        let (x1, x2) = x.split_at(half);
                        let (c1, c2) = c.split_at(half);
                        let (s1, s2) = s.split_at(half);
                        for i in 0..half {
                            let (a, b) = (x1[i], x2[i]);
                            if inverse {
                                y1[i] = a * c1[i] + b * s2[i];
                                y2[i] = b * c2[i] - a * s1[i];
                            } else {
                                y1[i] = a * c1[i] + (-b) * s1[i];
                                y2[i] = b * c2[i] + a * s2[i];
                            }
                        }
                    }
                })
            });
        Ok(y)
    }
}
