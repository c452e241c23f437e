//! Helpers the crate's unit tests share.

/// `n` deterministic values spread evenly over `[lo, hi)` in no simple order (a Weyl sequence
/// started at `seed`).
pub(crate) fn spread(n: usize, seed: u64, (lo, hi): (f64, f64)) -> Vec<f64> {
    const GOLDEN: f64 = 0.618_033_988_749_894_9;
    (0..n)
        .map(|i| {
            lo + (hi - lo) * ((seed as f64 * 0.414_213_562_373_095) + i as f64 * GOLDEN).fract()
        })
        .collect()
}
