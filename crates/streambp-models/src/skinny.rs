//! Products of a few rows by a weight stored row by row: `y = x Wᵀ` for `x` `[m, k]` with `m` at
//! most [`MAX_ROWS`] and `W` `[n, k]`, each of its rows contiguous. These are a decoding step's
//! projections and LM head (one row per sequence being sampled), and a training chunk of a few
//! tokens.
//!
//! gemm forms them as it forms any product: it first packs `Wᵀ` into panels, a transposition
//! that reads `W` at its row stride, then runs its micro-kernel, whose blocks are 64 rows tall,
//! on the few rows there are; 8 rows cost it what 64 do. Here each task takes a band of `W`'s
//! rows and forms their dot products with the rows of `x`, four rows of `x` at a time: `W` is read
//! from memory once, in order, and what is reused stays in cache. Measured in [`product`].
//!
//! Each dot product is summed in [`LANES`] interleaved partial sums, multiplied and added
//! unfused, then the lanes are added pairwise: the same bits on every instruction set
//! ([`crate::simd`]), the baseline included.

use half::bf16;
use num_traits::Float;
use num_traits::Zero;
use rayon::prelude::*;

use crate::cpu::SharedDst;

/// The most rows of `x` a product may have to take this kernel: at 24 rows it still took half
/// gemm's time, at 32 about the same (see [`product`]).
pub const MAX_ROWS: usize = 24;

/// Interleaved partial sums per dot product: two AVX-512 vectors of f32 (four of AVX2), two
/// chains of additions in flight.
const LANES: usize = 32;

/// Rows of `x` whose dot products with a row of `W` are formed together (a row of `W` and these
/// stay in the L1 cache).
const ROWS_IN_L1: usize = 4;

/// Rows of `W` gone through for each group of rows of `x` (they stay in the L2 cache meanwhile).
const PART: usize = 32;

/// Rows of `W` a task takes at least: enough work to pay for its scheduling.
const MIN_BAND: usize = 16;

/// An element of `W`, and the type its products are summed in.
pub trait Element: Copy + Send + Sync {
    /// The sums' type (`x`'s elements are of it too).
    type Sum: SumType;
    /// The element exactly in the sums' type.
    fn widen(self) -> Self::Sum;
}

impl Element for f32 {
    type Sum = f32;
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Element for f64 {
    type Sum = f64;
    #[inline(always)]
    fn widen(self) -> f64 {
        self
    }
}

impl Element for bf16 {
    type Sum = f32;
    #[inline(always)]
    fn widen(self) -> f32 {
        crate::cpu::widen(self)
    }
}

/// A type products are summed in (f32, f64): an element of `W` of its own, stored as itself.
pub trait SumType: Float + Send + Sync + Element<Sum = Self> + Store<Self> {}

impl SumType for f32 {}
impl SumType for f64 {}

/// An element of the destination: takes a sum, or adds it to what it holds.
pub trait Store<S>: Copy + Send + Sync {
    /// `self = sum`, or `self += sum` (then rounded to the element's type) when `accumulate`.
    fn store(&mut self, sum: S, accumulate: bool);
}

impl<S: Float + Send + Sync> Store<S> for S {
    #[inline(always)]
    fn store(&mut self, sum: S, accumulate: bool) {
        *self = if accumulate { *self + sum } else { sum };
    }
}

impl Store<f32> for bf16 {
    #[inline(always)]
    fn store(&mut self, sum: f32, accumulate: bool) {
        let sum = if accumulate { self.to_f32() + sum } else { sum };
        *self = bf16::from_f32(sum);
    }
}

/// Whether `a·b` with `m` rows, `a`'s column stride and `b`'s row stride takes this kernel: a few
/// rows of `a`, each contiguous, by `b = Wᵀ` with each row of `W` contiguous.
pub fn applies(m: usize, a_col_stride: usize, b_row_stride: usize) -> bool {
    m <= MAX_ROWS && a_col_stride == 1 && b_row_stride == 1
}

/// `dst[r, j] (=|+=) Σ_p x[r, p]·w[j, p]` for `r < m`, `j < n`, `p < k`, in tasks over bands of
/// `W`'s rows. `x` and `w` are `(data from the first element, row stride)` with contiguous rows;
/// `dst` is `[m, n]` at row stride `dst_rs`, and with `accumulate` each sum is added to it.
///
/// Measured (`examples/skinny_products`, AMD EPYC Zen 4, 2 threads, AVX-512) against the kernels
/// these products took before, at Qwen3-0.6B's shapes: 8 rows by its `[3072, 1024]` projection
/// took 1.24 ms against gemm's 5.56 (f32) and 0.99 against the widened tiles' 2.21 (bf16); by its
/// `[151936, 1024]` head 50 ms against 237 (f32) and 41 against 106 (bf16); at 24 rows 1.0-2x
/// faster, at 1 row as fast as gemm's own one-row path or faster.
///
/// Panics if an operand's rows reach past its data or `dst` is too small.
pub fn product<W: Element, D: Store<W::Sum>>(
    (dst, dst_rs): (&mut [D], usize),
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    (x, x_rs): (&[W::Sum], usize),
    (w, w_rs): (&[W], usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    let reaches = |rows: usize, stride: usize| (rows - 1) * stride + k;
    assert!(
        x.len() >= reaches(m, x_rs) && w.len() >= reaches(n, w_rs),
        "skinny product: operand out of range"
    );
    assert!(
        dst.len() >= reaches(m, dst_rs) - k + n,
        "skinny product: destination too small"
    );
    let tasks = 4 * rayon::current_num_threads();
    let band = n.div_ceil(tasks).max(MIN_BAND);
    let out = SharedDst(dst.as_mut_ptr());
    (0..n.div_ceil(band)).into_par_iter().for_each(|b| {
        let cols = b * band..((b + 1) * band).min(n);
        crate::vectorized!(|_| {
            for part in cols.clone().step_by(PART) {
                let part = part..(part + PART).min(cols.end);
                for first in (0..m).step_by(ROWS_IN_L1) {
                    for j in part.clone() {
                        let w_row = &w[j * w_rs..j * w_rs + k];
                        for r in first..(first + ROWS_IN_L1).min(m) {
                            let sum = dot(&x[r * x_rs..r * x_rs + k], w_row);
                            // SAFETY: element (r, j) lies within `dst` (checked above), and
                            // column j is in this task's band alone.
                            unsafe { &mut *out.get().add(r * dst_rs + j) }.store(sum, accumulate);
                        }
                    }
                }
            }
        })
    });
}

/// The dot product of `x` and `w` (as long as `x`): [`LANES`] partial sums, multiplied and added
/// unfused, added pairwise, then the elements past the last whole group of lanes added in order.
#[inline(always)]
fn dot<W: Element>(x: &[W::Sum], w: &[W]) -> W::Sum {
    let mut lanes = [W::Sum::zero(); LANES];
    let (groups, rest) = x.as_chunks::<LANES>();
    let (w_groups, w_rest) = w.as_chunks::<LANES>();
    for (xs, ws) in groups.iter().zip(w_groups) {
        for l in 0..LANES {
            lanes[l] = lanes[l] + ws[l].widen() * xs[l];
        }
    }
    // The loop above keeps the lanes in whole vectors; seen together with the pairwise sums below,
    // the compiler splits them into pairs instead (a third of the speed).
    let mut lanes = std::hint::black_box(lanes);
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            lanes[l] = lanes[l] + lanes[l + width];
        }
    }
    rest.iter()
        .zip(w_rest)
        .fold(lanes[0], |s, (&x, w)| s + w.widen() * x)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x Wᵀ` in f64 from the operands' values, and `Σ |x_rp·w_jp|` for each element (what bounds
    /// a sum's rounding error).
    fn exact<W: Element>(
        (m, n, k): (usize, usize, usize),
        (x, x_rs): (&[W::Sum], usize),
        (w, w_rs): (&[W], usize),
    ) -> Vec<(f64, f64)>
    where
        W::Sum: Into<f64>,
    {
        let term = |r: usize, j: usize, p: usize| -> f64 {
            x[r * x_rs + p].into() * w[j * w_rs + p].widen().into()
        };
        (0..m * n)
            .map(|i| {
                let (r, j) = (i / n, i % n);
                let terms = (0..k).map(|p| term(r, j, p));
                (terms.clone().sum(), terms.map(f64::abs).sum())
            })
            .collect()
    }

    /// Every row count the kernel takes, `W`'s rows a multiple of the block and not (one task and
    /// several), inner lengths under, at and across the lanes (0 included), rows padded past `k`:
    /// within the sums' rounding of the exact values, in f64, f32 and with bf16 weights (the bf16
    /// destination rounded once); with `accumulate`, added to what the destination held.
    #[test]
    fn products_match_the_exact_sums_at_every_shape() {
        for m in [1, 2, 5, 7, MAX_ROWS] {
            for (n, k) in [(1, 1), (5, 0), (3, 15), (130, 16), (67, 33), (257, 200)] {
                let (x_rs, w_rs, dst_rs) = (k + 3, k + 1, n + 2);
                let value = |i: usize, seed: f64| (i as f64 * 0.37 + seed).sin() * 2.0;
                let x64: Vec<f64> = (0..m * x_rs).map(|i| value(i, 1.0)).collect();
                let w64: Vec<f64> = (0..n * w_rs).map(|i| value(i, 2.0)).collect();
                let held = |i: usize| (i % 7) as f64;
                let check = |got: f64, (want, abs): (f64, f64), eps: f64, what: &str| {
                    let tol = 2.0 * eps * (k as f64).sqrt() * abs + 4.0 * eps * want.abs();
                    assert!(
                        (got - want).abs() <= tol,
                        "{what} {m}x{n}x{k}: {got} vs {want}"
                    );
                };
                // f64, set and added.
                let want = exact::<f64>((m, n, k), (&x64, x_rs), (&w64, w_rs));
                for accumulate in [false, true] {
                    let mut dst: Vec<f64> = (0..m * dst_rs).map(held).collect();
                    let x = (x64.as_slice(), x_rs);
                    product::<f64, f64>((&mut dst, dst_rs), (m, n, k), accumulate, x, (&w64, w_rs));
                    for (i, &(w, abs)) in want.iter().enumerate() {
                        let at = i / n * dst_rs + i % n;
                        let w = w + if accumulate { held(at) } else { 0.0 };
                        check(dst[at], (w, abs), f64::EPSILON, "f64");
                    }
                }
                // f32.
                let x32: Vec<f32> = x64.iter().map(|&v| v as f32).collect();
                let w32: Vec<f32> = w64.iter().map(|&v| v as f32).collect();
                let want = exact::<f32>((m, n, k), (&x32, x_rs), (&w32, w_rs));
                let mut dst = vec![0.0f32; m * dst_rs];
                product::<f32, f32>(
                    (&mut dst, dst_rs),
                    (m, n, k),
                    false,
                    (&x32, x_rs),
                    (&w32, w_rs),
                );
                for (i, &want) in want.iter().enumerate() {
                    let eps = f32::EPSILON as f64;
                    check(dst[i / n * dst_rs + i % n] as f64, want, eps, "f32");
                }
                // bf16 weights, into bf16 (rounded once) and added into f32.
                let w16: Vec<bf16> = w64.iter().map(|&v| bf16::from_f64(v)).collect();
                let want = exact::<bf16>((m, n, k), (&x32, x_rs), (&w16, w_rs));
                let mut dst = vec![bf16::ZERO; m * dst_rs];
                product::<bf16, bf16>(
                    (&mut dst, dst_rs),
                    (m, n, k),
                    false,
                    (&x32, x_rs),
                    (&w16, w_rs),
                );
                let mut acc: Vec<f32> = (0..m * dst_rs).map(|i| held(i) as f32).collect();
                product::<bf16, f32>(
                    (&mut acc, dst_rs),
                    (m, n, k),
                    true,
                    (&x32, x_rs),
                    (&w16, w_rs),
                );
                for (i, &(w, abs)) in want.iter().enumerate() {
                    let at = i / n * dst_rs + i % n;
                    let eps = f32::EPSILON as f64;
                    let ulp = w.abs() * 2f64.powi(-8);
                    let got = dst[at].to_f64();
                    let tol = ulp + 2.0 * eps * (k as f64).sqrt() * abs + 4.0 * eps * w.abs();
                    assert!((got - w).abs() <= tol, "bf16 {m}x{n}x{k}: {got} vs {w}");
                    check(
                        acc[at] as f64,
                        (w + held(at), abs + held(at)),
                        eps,
                        "bf16 into f32",
                    );
                }
            }
        }
    }

    #[test]
    fn only_a_few_contiguous_rows_by_contiguous_weight_rows_apply() {
        assert!(applies(1, 1, 1));
        assert!(applies(MAX_ROWS, 1, 1));
        assert!(!applies(MAX_ROWS + 1, 1, 1));
        assert!(!applies(4, 2, 1), "rows of x strided");
        assert!(!applies(4, 1, 64), "W stored column by column");
    }
}
