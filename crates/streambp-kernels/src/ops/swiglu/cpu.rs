//! SwiGLU's CPU kernel: the exponentials of a task's elements in one vectorized call
//! ([`BulkExp`]), then one pass over them; elements split over the threads.

use num_traits::Float;
use rayon::prelude::*;

use crate::host::exp::BulkExp;
use crate::vectorized;

/// Elements per rayon task.
const PER_TASK: usize = 4096;

/// `x / (1 + e)` with `e = exp(−x)`: silu as candle's `silu` computes it.
#[inline(always)]
fn silu<T: Float>(x: T, e: T) -> T {
    x / (T::one() + e)
}

/// `exp(−x)` for each `x` of `xs` into `out`, through [`BulkExp`] (vectorized in f32) rather than
/// one library call per element.
fn exp_neg<T: BulkExp>(xs: &[T], out: &mut [T]) {
    for (e, &x) in out.iter_mut().zip(xs) {
        *e = -x;
    }
    T::exp_in_place(out);
}

/// `silu(gate) ⊙ up`.
pub(super) fn forward<T: BulkExp + Float + Send + Sync>(gate: &[T], up: &[T]) -> Vec<T> {
    let mut y = vec![T::zero(); gate.len()];
    y.par_chunks_mut(PER_TASK)
        .zip(gate.par_chunks(PER_TASK).zip(up.par_chunks(PER_TASK)))
        .for_each(|(y, (gate, up))| {
            exp_neg(gate, y);
            vectorized!(|_| {
                for (y, (&a, &u)) in y.iter_mut().zip(gate.iter().zip(up)) {
                    *y = silu(a, *y) * u;
                }
            })
        });
    y
}

/// d gate followed by d up, for the output's gradient `g`.
pub(super) fn backward<T: BulkExp + Float + Send + Sync>(gate: &[T], up: &[T], g: &[T]) -> Vec<T> {
    let mut out = vec![T::zero(); 2 * gate.len()];
    let (d_gate, d_up) = out.split_at_mut(gate.len());
    d_gate
        .par_chunks_mut(PER_TASK)
        .zip(d_up.par_chunks_mut(PER_TASK))
        .zip(gate.par_chunks(PER_TASK).zip(up.par_chunks(PER_TASK)))
        .zip(g.par_chunks(PER_TASK))
        .for_each(|(((d_gate, d_up), (gate, up)), g)| {
            exp_neg(gate, d_gate);
            vectorized!(|_| {
                let inputs = gate.iter().zip(up).zip(g);
                let outputs = d_gate.iter_mut().zip(d_up.iter_mut());
                for ((dg, du), ((&a, &u), &g)) in outputs.zip(inputs) {
                    let e = *dg;
                    let s = silu(a, e);
                    let sigmoid = T::one() / (e + T::one());
                    *du = g * s;
                    *dg = (g * u) * (sigmoid * (T::one() - s) + s);
                }
            })
        });
    out
}
