//! Exponentials of whole rows on the host: f64's from the standard library, f32's from a
//! polynomial the compiler vectorizes at the width of the path in force.

use num_traits::Float;

use crate::host::reduce::LANES;

use crate::vectorized;

/// Float types whose exponentials the CPU passes take a row at a time: f64 through the standard
/// library's `exp`; f32 through a polynomial the compiler vectorizes at the width of the path in
/// force ([`crate::host::simd`]: [`exp_f32_fused`] where it has FMA, [`exp_f32`] on the baseline), where
/// glibc's `expf` takes one element per call.
pub trait BulkExp:
    Float + std::ops::AddAssign + std::ops::SubAssign + std::ops::MulAssign + std::ops::DivAssign
{
    /// `x ← exp(x)` for every element.
    fn exp_in_place(xs: &mut [Self]);

    /// `x ← exp(x − shift)` for every element, returning their sum (added as [`row_sum`](crate::host::reduce::row_sum) adds): a
    /// softmax row's exponentials and normalizer in one pass over it instead of three.
    fn exp_shifted_sum(xs: &mut [Self], shift: Self) -> Self;

    /// `(Σ eᵈ, Σ eᵈ·d)` over the elements, `d = x − shift`, reading `xs` only: a softmax row's
    /// normalizer and the first moment its entropy needs, in one pass. An element of −∞ adds 0 to
    /// both.
    fn exp_shifted_moments(xs: &[Self], shift: Self) -> (Self, Self);

    /// `x ← f(d, eᵈ)` for every element, `d = x − shift`: a pass that rewrites a row from its
    /// shifted exponentials (`f` is inlined into the vectorized loop).
    fn exp_shifted_map(xs: &mut [Self], shift: Self, f: impl Fn(Self, Self) -> Self);
}

impl BulkExp for f64 {
    fn exp_in_place(xs: &mut [f64]) {
        for x in xs {
            *x = x.exp();
        }
    }

    fn exp_shifted_sum(xs: &mut [f64], shift: f64) -> f64 {
        exp_shifted_sum_by(xs, shift, f64::exp)
    }

    fn exp_shifted_moments(xs: &[f64], shift: f64) -> (f64, f64) {
        exp_shifted_moments_by(xs, shift, f64::exp)
    }

    fn exp_shifted_map(xs: &mut [f64], shift: f64, f: impl Fn(f64, f64) -> f64) {
        exp_shifted_map_by(xs, shift, f64::exp, f)
    }
}

/// [`BulkExp::exp_shifted_map`] with the exponential `exp`.
#[inline(always)]
fn exp_shifted_map_by<T: Float>(
    xs: &mut [T],
    shift: T,
    exp: impl Fn(T) -> T,
    f: impl Fn(T, T) -> T,
) {
    for x in xs {
        let d = *x - shift;
        *x = f(d, exp(d));
    }
}

/// [`BulkExp::exp_shifted_moments`] with the exponential `exp`, each sum in [`LANES`] partial sums.
#[inline(always)]
fn exp_shifted_moments_by<T: Float>(xs: &[T], shift: T, exp: impl Fn(T) -> T) -> (T, T) {
    let term = |x: T| {
        let d = x - shift;
        let e = exp(d);
        // `e = 0` where `d = −∞`, whose product would be NaN.
        (e, if e > T::zero() { e * d } else { T::zero() })
    };
    let (mut sums, mut moments) = ([T::zero(); LANES], [T::zero(); LANES]);
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for ((s, m), &x) in sums.iter_mut().zip(moments.iter_mut()).zip(chunk) {
            let (e, ed) = term(x);
            *s = *s + e;
            *m = *m + ed;
        }
    }
    let total = |lanes: [T; LANES]| lanes.iter().fold(T::zero(), |s, &x| s + x);
    rest.iter()
        .fold((total(sums), total(moments)), |(s, m), &x| {
            let (e, ed) = term(x);
            (s + e, m + ed)
        })
}

/// [`BulkExp::exp_shifted_sum`] with the exponential `exp`, the sum in [`row_sum`](crate::host::reduce::row_sum)'s lanes and order.
/// A block of the row is exponentiated in one loop (which vectorizes) and then added into the lanes
/// while it is in the L1 cache.
#[inline(always)]
fn exp_shifted_sum_by<T: Float>(xs: &mut [T], shift: T, exp: impl Fn(T) -> T) -> T {
    const BLOCK: usize = 16 * LANES;
    let mut lanes = [T::zero(); LANES];
    let (body, rest) = xs.split_at_mut(xs.len() / LANES * LANES);
    for block in body.chunks_mut(BLOCK) {
        for x in block.iter_mut() {
            *x = exp(*x - shift);
        }
        for chunk in block.chunks_exact(LANES) {
            for (s, &x) in lanes.iter_mut().zip(chunk) {
                *s = *s + x;
            }
        }
    }
    let mut sum = lanes.iter().fold(T::zero(), |s, &x| s + x);
    for x in rest {
        *x = exp(*x - shift);
        sum = sum + *x;
    }
    sum
}

impl BulkExp for f32 {
    fn exp_in_place(xs: &mut [f32]) {
        vectorized!(|isa| {
            if isa.fma() {
                xs.iter_mut().for_each(|x| *x = exp_f32_fused(*x));
            } else {
                xs.iter_mut().for_each(|x| *x = exp_f32(*x));
            }
        })
    }

    fn exp_shifted_moments(xs: &[f32], shift: f32) -> (f32, f32) {
        vectorized!(|isa| {
            if isa.fma() {
                exp_shifted_moments_by(xs, shift, exp_f32_fused)
            } else {
                exp_shifted_moments_by(xs, shift, exp_f32)
            }
        })
    }

    fn exp_shifted_map(xs: &mut [f32], shift: f32, f: impl Fn(f32, f32) -> f32) {
        vectorized!(|isa| {
            if isa.fma() {
                exp_shifted_map_by(xs, shift, exp_f32_fused, f)
            } else {
                exp_shifted_map_by(xs, shift, exp_f32, f)
            }
        })
    }

    fn exp_shifted_sum(xs: &mut [f32], shift: f32) -> f32 {
        vectorized!(|isa| {
            if isa.fma() {
                exp_shifted_sum_by(xs, shift, exp_f32_fused)
            } else {
                exp_shifted_sum_by(xs, shift, exp_f32)
            }
        })
    }
}

/// `eˣ` in f32 within 2 ulp (Cephes' `expf`: `x = n·ln2 + r` with `ln 2` split in two, a degree-7
/// polynomial for `eʳ`, `2ⁿ` built in the exponent bits). Written without branches or library calls
/// so that a loop over a slice vectorizes; below `ln(f32::MIN_POSITIVE)` it gives 0 (a softmax's
/// masked scores), above 88.376 infinity.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    // `floor` by truncation corrected towards −∞: without SSE4.1 `floor` is a library call.
    let floor = |v: f32| {
        // SAFETY: `v` is finite and within ±128 (`exp_by` bounds it), so it fits an i32. (`as`
        // would saturate, which the compiler does not vectorize.)
        let t = unsafe { v.to_int_unchecked::<i32>() } as f32;
        if t > v {
            t - 1.0
        } else {
            t
        }
    };
    exp_by(x, |a, b, c| a * b + c, floor)
}

/// [`exp_f32`] with fused multiply-adds and the rounding instruction (within 1 ulp: one rounding
/// per fused step); for code compiled with FMA and SSE4.1, where both are single instructions.
#[inline(always)]
pub fn exp_f32_fused(x: f32) -> f32 {
    exp_by(x, f32::mul_add, f32::floor)
}

/// The exponential's formula, given how to form `a·b + c` and `⌊v⌋`.
#[inline(always)]
fn exp_by(x: f32, madd: impl Fn(f32, f32, f32) -> f32, floor: impl Fn(f32) -> f32) -> f32 {
    const LOW: f32 = -87.336_55;
    const HIGH: f32 = 88.376_26;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // `max`/`min` (unlike `clamp`) turn NaN into a bound, so the conversions below stay in range.
    #[allow(clippy::manual_clamp)]
    let xc = x.max(LOW).min(HIGH);
    // n = round(x / ln 2).
    let n = floor(madd(xc, std::f32::consts::LOG2_E, 0.5));
    let r = madd(n, -LN2_LO, madd(n, -LN2_HI, xc));
    let p = [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ]
    .into_iter()
    .fold(1.987_569_2e-4, |p, c| madd(p, r, c));
    let e_r = madd(p, r * r, r) + 1.0;
    // SAFETY: `n` is within ±128 (`xc` is bounded).
    let n = unsafe { n.to_int_unchecked::<i32>() };
    let two_n = f32::from_bits(((n + 127) << 23) as u32);
    match x {
        x if x < LOW => 0.0,
        x if x > HIGH => f32::INFINITY,
        x if x.is_nan() => x,
        _ => e_r * two_n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::reduce::row_sum;

    /// Worst error of `exp` against f64's over the whole range a softmax feeds it, in ulps.
    fn worst_ulp(exp: impl Fn(f32) -> f32) -> f64 {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let ulp = (want as f32).abs() as f64 * f32::EPSILON as f64;
            worst = worst.max((exp(x) as f64 - want).abs() / ulp);
            x += 0.000_731;
        }
        worst
    }

    /// Both forms of the f32 exponential, and the slice pass (the fused form where the CPU has
    /// FMA), within 2 ulp of f64's; exact at 0 (a row's maximum gives exactly 1), 0 for masked
    /// scores, infinity above the range, NaN kept.
    #[test]
    fn the_f32_exponential_is_within_two_ulp() {
        let in_place = |x: f32| {
            let mut row = [x];
            f32::exp_in_place(&mut row);
            row[0]
        };
        let forms: [(&str, &dyn Fn(f32) -> f32); 3] = [
            ("plain", &exp_f32),
            ("fused", &exp_f32_fused),
            ("in place", &in_place),
        ];
        for (name, exp) in forms {
            let worst = worst_ulp(exp);
            assert!(worst <= 2.0, "{name}: worst error {worst} ulp");
            assert_eq!(exp(0.0), 1.0, "{name}");
            assert_eq!(exp(f32::MIN), 0.0, "{name}");
            assert_eq!(exp(f32::NEG_INFINITY), 0.0, "{name}");
            assert_eq!(exp(100.0), f32::INFINITY, "{name}");
            assert!(exp(f32::NAN).is_nan(), "{name}");
        }
    }

    /// The one-pass shifted exponentials and their sum equal the three passes they replace
    /// (subtract, exponentiate, [`row_sum`](crate::host::reduce::row_sum)), bit for bit, in f32 and f64, rows of 0..20 elements.
    #[test]
    fn shifted_exponentials_and_sum_equal_the_separate_passes() {
        fn check<T: BulkExp + std::fmt::Debug>(values: &[T], shift: T) {
            let mut want = values.to_vec();
            want.iter_mut().for_each(|x| *x -= shift);
            T::exp_in_place(&mut want);
            let mut got = values.to_vec();
            let sum = T::exp_shifted_sum(&mut got, shift);
            assert_eq!(got, want);
            assert_eq!(sum, row_sum(&want));
        }
        for n in 0..20 {
            let row: Vec<f64> = (0..n).map(|i| (i as f64 * 0.77).sin() * 9.0).collect();
            check(&row, 3.25);
            let row32: Vec<f32> = row.iter().map(|&x| x as f32).collect();
            check(&row32, 3.25);
        }
    }

    /// The moments' pass against the exponentials it stands for, within a few roundings in f32 and
    /// f64, rows of 0..20 elements and one with −∞ (adding 0 to both sums); the map's pass gives
    /// `f` each element's shifted value and its exponential.
    #[test]
    fn shifted_moments_and_map_equal_their_definitions() {
        fn check<T: BulkExp + std::fmt::Debug + Into<f64>>(values: &[T], shift: T, bound: f64) {
            let (sum, moment) = T::exp_shifted_moments(values, shift);
            let (mut want_sum, mut want_moment) = (0.0f64, 0.0f64);
            for &x in values {
                let d = x.into() - shift.into();
                if d > f64::NEG_INFINITY {
                    want_sum += d.exp();
                    want_moment += d.exp() * d;
                }
            }
            assert!((sum.into() - want_sum).abs() <= bound * want_sum.max(1.0));
            assert!((moment.into() - want_moment).abs() <= bound * want_sum.max(1.0) * 10.0);
            let mut mapped = values.to_vec();
            T::exp_shifted_map(&mut mapped, shift, |d, e| d + e);
            for (&x, &y) in values.iter().zip(&mapped) {
                let d = x.into() - shift.into();
                let want = d + d.exp();
                assert!(
                    (y.into() - want).abs() <= bound * want.abs().max(1.0) || y.into() == want,
                    "{x:?} -> {y:?}"
                );
            }
        }
        for n in 0..20 {
            let mut row: Vec<f64> = (0..n).map(|i| (i as f64 * 0.77).sin() * 9.0).collect();
            if n > 5 {
                row[3] = f64::NEG_INFINITY;
            }
            check(&row, 3.25, 1e-14);
            let row32: Vec<f32> = row.iter().map(|&x| x as f32).collect();
            check(&row32, 3.25, 1e-5);
        }
    }
}
