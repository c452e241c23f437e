//! Products of a few rows by a weight stored row by row: `y = x Wᵀ` for `x` `[m, k]` with `m` at
//! most [`MAX_ROWS`] and `W` `[n, k]`, each of its rows contiguous. These are a decoding step's
//! projections and LM head (one row per sequence being sampled), and a training chunk of a few
//! tokens.
//!
//! gemm forms them as it forms any product: it first packs `Wᵀ` into panels, a transposition
//! that reads `W` at its row stride, then runs its micro-kernel, whose blocks are 64 rows tall,
//! on the few rows there are; 8 rows cost it what 64 do. Here each task takes a band of `W`'s
//! rows and forms their dot products with the rows of `x`, four rows of `x` at a time: `W` is read
//! from memory once, in order, and what is reused stays in cache. On AVX-512, whose 32 vector
//! registers hold the sums of eight dot products, two rows of `W` and four of `x` go through
//! together, so each element loaded serves two or four of them. Measured in [`product`].
//!
//! Each dot product is summed in [`LANES`] interleaved partial sums, multiplied and added
//! unfused, then the lanes are added pairwise: the same bits on every instruction set
//! ([`crate::host::simd`]), the baseline included, and whichever rows share the product.

use half::bf16;
use num_traits::Float;
use num_traits::Zero;
use rayon::prelude::*;

use crate::host::products::{fits, SharedDst};
use crate::host::simd::Isa;

/// The most rows of `x` a product may have to take this kernel: where the AVX2 path (one row of `W`
/// at a time) stops beating gemm (docs/benchmarks.md, "Decoding a few rows"). The AVX-512 path's
/// blocks would pay further, but a limit that depended on the path would give the paths different
/// bits.
pub const MAX_ROWS: usize = 24;

/// Interleaved partial sums per dot product: two AVX-512 vectors of f32 (four of AVX2), two
/// chains of additions in flight.
const LANES: usize = 32;

/// Rows of `x` whose dot products with a row of `W` are formed together (a row of `W` and these
/// stay in the L1 cache).
const ROWS_IN_L1: usize = 4;

/// Rows of `W` whose dot products with a group of rows of `x` are formed in one pass: each element
/// of `x` loaded serves this many products, each of `W` [`ROWS_IN_L1`].
const W_ROWS: usize = 2;

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
        crate::host::cast::widen(self)
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
/// A decoding step's products take a fraction of gemm's and the widened tiles' time here
/// (`examples/skinny_products`; docs/benchmarks.md, "Decoding a few rows").
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
    assert!(
        fits(m, k, (x, x_rs, 1)) && fits(n, k, (w, w_rs, 1)),
        "skinny product: operand out of range"
    );
    assert!(
        fits(m, n, (dst, dst_rs, 1)),
        "skinny product: destination too small"
    );
    // Empty rows all start at the first element (`fits` checks no stride when there are none).
    let (x_rs, w_rs) = if k == 0 { (0, 0) } else { (x_rs, w_rs) };
    let tasks = 4 * rayon::current_num_threads();
    let band = n.div_ceil(tasks).max(MIN_BAND);
    let out = SharedDst(dst.as_mut_ptr());
    let x_row = |r: usize| &x[r * x_rs..r * x_rs + k];
    let w_row = |j: usize| &w[j * w_rs..j * w_rs + k];
    // `sums` of `rows` rows of `x` from `r` (inner index) by rows of `W` from `j` (outer index).
    let store = |sums: &[W::Sum], rows: usize, r: usize, j: usize| {
        for (i, &sum) in sums.iter().enumerate() {
            let (r, j) = (r + i % rows, j + i / rows);
            // SAFETY: element (r, j) lies within `dst` (checked above), and column j is in this
            // task's band alone.
            unsafe { &mut *out.get().add(r * dst_rs + j) }.store(sum, accumulate);
        }
    };
    (0..n.div_ceil(band)).into_par_iter().for_each(|b| {
        let cols = b * band..((b + 1) * band).min(n);
        crate::vectorized!(|isa| {
            // Two rows of `W` by four of `x` need sixteen vector accumulators: AVX-512 has 32
            // registers, AVX2 16 (there the blocks would spill, which costs more than they
            // save).
            let blocked = isa == Isa::Avx512;
            for part in cols.clone().step_by(PART) {
                let part = part..(part + PART).min(cols.end);
                for first in (0..m).step_by(ROWS_IN_L1) {
                    let rows = first..(first + ROWS_IN_L1).min(m);
                    let mut j = part.start;
                    if blocked && rows.len() == ROWS_IN_L1 {
                        while j + W_ROWS <= part.end {
                            let x = [first, first + 1, first + 2, first + 3].map(x_row);
                            let sums = dots_4x2::<W>(x, [w_row(j), w_row(j + 1)]);
                            store(sums.as_flattened(), ROWS_IN_L1, first, j);
                            j += W_ROWS;
                        }
                    }
                    for j in j..part.end {
                        for r in rows.clone() {
                            store(&[dot(x_row(r), w_row(j))], 1, r, j);
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
    let (groups, _) = x.as_chunks::<LANES>();
    let (w_groups, _) = w.as_chunks::<LANES>();
    for (xs, ws) in groups.iter().zip(w_groups) {
        for l in 0..LANES {
            lanes[l] = lanes[l] + ws[l].widen() * xs[l];
        }
    }
    finish(lanes, x, w)
}

/// The dot products of two rows of `W` with four rows of `x` (all as long) in one pass, each
/// element loaded serving two or four of them (`sums[c][r] = x[r]·w[c]`); each summed as [`dot`]
/// sums it, to the same bits.
#[inline(always)]
fn dots_4x2<W: Element>(x: [&[W::Sum]; 4], w: [&[W]; 2]) -> [[W::Sum; 4]; 2] {
    // Eight named accumulators, not an array of them: the compiler keeps these in registers
    // (sixteen AVX-512 ones), an array of 256 lanes it kept in memory (six times slower).
    let zero = [W::Sum::zero(); LANES];
    let (mut a0, mut a1, mut a2, mut a3) = (zero, zero, zero, zero);
    let (mut b0, mut b1, mut b2, mut b3) = (zero, zero, zero, zero);
    let groups = w[0].len() / LANES;
    for g in 0..groups {
        let at = g * LANES..(g + 1) * LANES;
        let (x0, x1, x2, x3) = (
            &x[0][at.clone()],
            &x[1][at.clone()],
            &x[2][at.clone()],
            &x[3][at.clone()],
        );
        let (u, v) = (&w[0][at.clone()], &w[1][at]);
        for l in 0..LANES {
            let (u, v) = (u[l].widen(), v[l].widen());
            a0[l] = a0[l] + u * x0[l];
            a1[l] = a1[l] + u * x1[l];
            a2[l] = a2[l] + u * x2[l];
            a3[l] = a3[l] + u * x3[l];
            b0[l] = b0[l] + v * x0[l];
            b1[l] = b1[l] + v * x1[l];
            b2[l] = b2[l] + v * x2[l];
            b3[l] = b3[l] + v * x3[l];
        }
    }
    [
        [
            finish(a0, x[0], w[0]),
            finish(a1, x[1], w[0]),
            finish(a2, x[2], w[0]),
            finish(a3, x[3], w[0]),
        ],
        [
            finish(b0, x[0], w[1]),
            finish(b1, x[1], w[1]),
            finish(b2, x[2], w[1]),
            finish(b3, x[3], w[1]),
        ],
    ]
}

/// A dot product's sum from its lanes: added pairwise, then `x`'s and `w`'s elements past the last
/// whole group of lanes added in order.
#[inline(always)]
fn finish<W: Element>(lanes: [W::Sum; LANES], x: &[W::Sum], w: &[W]) -> W::Sum {
    // The loops before keep the lanes in whole vectors; seen together with the pairwise sums
    // below, the compiler splits them into pairs instead (a third of the speed).
    let mut lanes = std::hint::black_box(lanes);
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            lanes[l] = lanes[l] + lanes[l + width];
        }
    }
    let tail = x.len() / LANES * LANES;
    x[tail..]
        .iter()
        .zip(&w[tail..])
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

    /// A row's sums are the same bits whichever rows share its product: formed in a block of four
    /// rows of `x` by two of `W`, or alone (a sampled row gives what it gives decoded by itself).
    #[test]
    fn a_rows_sums_do_not_depend_on_the_other_rows() {
        let (m, n, k) = (MAX_ROWS, 67, 77);
        let value = |i: usize| (i as f32 * 0.61).sin();
        let x: Vec<f32> = (0..m * k).map(value).collect();
        let w: Vec<bf16> = (0..n * k).map(|i| bf16::from_f32(value(i + 5))).collect();
        let mut all = vec![0.0f32; m * n];
        product::<bf16, f32>((&mut all, n), (m, n, k), false, (&x, k), (&w, k));
        for r in 0..m {
            let mut alone = vec![0.0f32; n];
            product::<bf16, f32>((&mut alone, n), (1, n, k), false, (&x[r * k..], k), (&w, k));
            assert_eq!(alone, all[r * n..(r + 1) * n], "row {r}");
        }
    }

    /// Sums over an empty inner dimension are zero, whatever strides the empty operands come with.
    #[test]
    fn empty_inner_dimension_sums_to_zero() {
        let mut dst = vec![3.0f32; 2 * 5];
        product::<f32, f32>((&mut dst, 5), (2, 5, 0), false, (&[], 4), (&[], 9));
        assert_eq!(dst, vec![0.0; 10]);
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
