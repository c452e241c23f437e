//! The accumulators' kernels as their launchers see them: the argument lists for the compiled table
//! ([`super::compiled`]), plain numbers so the CPU build's tests hold them to it.

use crate::triton::{i32_of, i64_of, Args, Value};

/// Elements per program of `accumulate_add` (the table's variant).
pub(crate) const ADD_BLOCK: usize = 1024;

/// Columns per program of `accumulate_add_rows` (the table's variant).
pub(crate) const ROWS_BLOCK: usize = 256;

/// `accumulate_add`'s arguments: `n` elements of `x` added into the f32 accumulator `acc`.
pub(crate) fn add_args(acc: u64, x: u64, n: usize) -> Args {
    vec![
        ("ACC", Value::Pointer(acc)),
        ("X", Value::Pointer(x)),
        ("n", i64_of(n)),
    ]
}

/// `accumulate_add_rows`'s arguments: `n_rows` rows of `dim` from `rows` added into the rows `ids`
/// (i64) of the f32 accumulator `acc` (`[vocab, dim]`).
pub(crate) fn add_rows_args(
    (acc, ids, rows): (u64, u64, u64),
    n_rows: usize,
    (vocab, dim): (usize, usize),
) -> Args {
    vec![
        ("ACC", Value::Pointer(acc)),
        ("IDS", Value::Pointer(ids)),
        ("ROWS", Value::Pointer(rows)),
        ("n_rows", i64_of(n_rows)),
        ("vocab", i32_of(vocab)),
        ("dim", i32_of(dim)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::accumulate::compiled::KERNELS;
    use crate::triton::{assert_lists_fit, check, compiled_everywhere, Mismatch};

    #[test]
    fn the_launchers_argument_lists_match_the_compiled_kernels() {
        assert!(compiled_everywhere(KERNELS, "accumulate_add", ADD_BLOCK));
        assert!(compiled_everywhere(
            KERNELS,
            "accumulate_add_rows",
            ROWS_BLOCK
        ));
        let args = |kernel: &str, dim| match kernel {
            "accumulate_add" => add_args(0x1000, 0x2000, 151_936 * 4096),
            _ => add_rows_args((0x1000, 0x2000, 0x3000), 16_384, (151_936, dim)),
        };
        assert_lists_fit(KERNELS, |k| args(k.kernel, 4096));
        // Rows not a multiple of 16 wide: refused, and summed by tensor ops instead.
        for k in KERNELS.iter().filter(|k| k.kernel == "accumulate_add_rows") {
            let refused = check(k, &args(k.kernel, 4100));
            assert!(
                matches!(refused, Err(Mismatch::Unaligned { .. })),
                "{refused:?}"
            );
        }
    }
}
