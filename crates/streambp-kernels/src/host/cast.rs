//! bf16's element conversions on the host: widened exactly, rounded to nearest even, narrowed
//! exactly where the values allow, split over rayon's threads ([`CAST_PER_TASK`]); the tensor-level
//! casts built on them are [`crate::ops::cast`]'s.

use crate::vectorized;

/// bf16 to f32: exact (the bf16 bits are f32's upper half), and a shift the compiler vectorizes.
#[inline(always)]
pub(crate) fn widen(x: half::bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// `x` rounded to the nearest bf16, kept in f32: the value a cast there and back gives.
#[inline(always)]
pub(crate) fn bf16_value(x: f32) -> f32 {
    widen(half::bf16::from_f32(x))
}

/// Elements per rayon task of a cast.
pub(crate) const CAST_PER_TASK: usize = 1 << 14;

/// `x` in f32, split over rayon's threads, written once (no zero-fill first).
pub(crate) fn widened_bf16(x: &[half::bf16]) -> Vec<f32> {
    use rayon::prelude::*;
    let mut y = Vec::with_capacity(x.len());
    y.spare_capacity_mut()[..x.len()]
        .par_chunks_mut(CAST_PER_TASK)
        .zip(x.par_chunks(CAST_PER_TASK))
        .for_each(|(y, x)| {
            vectorized!(|_| y.iter_mut().zip(x).for_each(|(y, &x)| {
                y.write(widen(x));
            }))
        });
    // SAFETY: the loop above wrote each of the first `x.len()` elements (the chunks of `y` and `x`
    // pair up one to one and have equal lengths).
    unsafe { y.set_len(x.len()) };
    y
}

/// `x` narrowed to bf16 where every value is one bf16 holds (the low 16 bits of each zero, so the
/// narrowing is exact), `None` where one is not; split over rayon's threads as the casts are.
pub fn narrowed_exactly(x: &[f32]) -> Option<Vec<half::bf16>> {
    use rayon::prelude::*;
    let mut y = vec![half::bf16::ZERO; x.len()];
    let exact = y
        .par_chunks_mut(CAST_PER_TASK)
        .zip(x.par_chunks(CAST_PER_TASK))
        .all(|(y, x)| {
            let low_bits = vectorized!(|_| y.iter_mut().zip(x).fold(0u32, |low, (y, &x)| {
                let bits = x.to_bits();
                *y = half::bf16::from_bits((bits >> 16) as u16);
                low | (bits & 0xffff)
            }));
            low_bits == 0
        });
    exact.then_some(y)
}
