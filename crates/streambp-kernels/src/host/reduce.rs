//! Reductions over a row on the host: its maximum and sum in fixed lanes.

use num_traits::Float;

/// Lanes of the row reductions below: 8 independent accumulators, so that the loop is not bound by
/// one addition's latency and vectorizes (8 f32 per AVX register, two registers of f64).
pub(crate) const LANES: usize = 8;

/// The largest of `init` and the elements of `xs` (NaN-free inputs: a softmax's scores).
#[inline(always)]
pub fn row_max<T: Float>(xs: &[T], init: T) -> T {
    let mut lanes = [init; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = if x > *m { x } else { *m };
        }
    }
    let m = lanes.iter().fold(init, |m, &x| if x > m { x } else { m });
    rest.iter().fold(m, |m, &x| if x > m { x } else { m })
}

/// The sum of `xs`, in [`LANES`] interleaved partial sums added at the end.
#[inline(always)]
pub fn row_sum<T: Float>(xs: &[T]) -> T {
    let mut lanes = [T::zero(); LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (s, &x) in lanes.iter_mut().zip(chunk) {
            *s = *s + x;
        }
    }
    let s = lanes.iter().fold(T::zero(), |s, &x| s + x);
    rest.iter().fold(s, |s, &x| s + x)
}
