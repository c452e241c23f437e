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

/// `len` deterministic bf16 values (a matrix's elements; `seed` varies them).
pub(crate) fn bf16_values(len: usize, seed: u32) -> Vec<half::bf16> {
    (0..len)
        .map(|i| half::bf16::from_f32(((i as f32 * 0.37 + seed as f32).sin()) * 2.0))
        .collect()
}
