//! RMSNorm's kernels as their launcher sees them: which compiled block a row takes, how the weight's
//! gradient is grouped, and the argument lists for the compiled table ([`super::compiled`]); plain
//! numbers, so the CPU build's tests hold them to it.

use crate::triton::{i32_of, i64_of, Args, Value};

/// The compiled blocks of columns (the table's `variant`).
pub(crate) const BLOCKS: [usize; 3] = [128, 256, 1024];

/// The most groups the weight's gradient is summed in (each an f32 row of partial sums).
pub(crate) const GROUPS: usize = 256;

/// The block of columns for rows `dim` wide: the smallest that holds a row (the q/k norms' rows of
/// 128 or 256 leave no lane idle), else the largest, looped over.
pub(crate) fn block(dim: usize) -> usize {
    BLOCKS.into_iter().find(|&b| b >= dim).unwrap_or(BLOCKS[2])
}

/// Rows per group and groups for the weight's gradient over `rows` rows.
pub(crate) fn groups(rows: usize) -> (usize, usize) {
    let group_rows = rows.div_ceil(GROUPS).max(1);
    (group_rows, rows.div_ceil(group_rows).max(1))
}

/// Contiguous rows `dim` wide and the norm's constants.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rows {
    pub rows: usize,
    pub dim: usize,
    pub eps: f32,
    pub one_plus: bool,
}

impl Rows {
    fn constants(&self) -> [(&'static str, Value); 3] {
        [
            ("dim", i32_of(self.dim)),
            ("eps", Value::F32(self.eps)),
            ("one_plus", Value::I32(self.one_plus as i32)),
        ]
    }
}

/// `rms_norm_forward`'s arguments.
pub(crate) fn forward_args(r: &Rows, x: u64, w: u64, y: u64) -> Args {
    let mut a = vec![
        ("X", Value::Pointer(x)),
        ("W", Value::Pointer(w)),
        ("Y", Value::Pointer(y)),
        ("stride_x", i64_of(r.dim)),
        ("stride_y", i64_of(r.dim)),
    ];
    a.extend(r.constants());
    a
}

/// `rms_norm_backward`'s arguments: dx's rows into `dx`, each row's `1 / rms` into `inv_rms`.
pub(crate) fn backward_args(r: &Rows, (x, w, g): (u64, u64, u64), dx: u64, inv_rms: u64) -> Args {
    let mut a = vec![
        ("X", Value::Pointer(x)),
        ("W", Value::Pointer(w)),
        ("G", Value::Pointer(g)),
        ("DX", Value::Pointer(dx)),
        ("R", Value::Pointer(inv_rms)),
        ("stride_x", i64_of(r.dim)),
        ("stride_g", i64_of(r.dim)),
        ("stride_dx", i64_of(r.dim)),
    ];
    a.extend(r.constants());
    a
}

/// `rms_norm_backward_weight`'s arguments: each group's partial sums into `partial`.
pub(crate) fn weight_args(r: &Rows, (x, g, inv_rms): (u64, u64, u64), partial: u64) -> Args {
    vec![
        ("X", Value::Pointer(x)),
        ("G", Value::Pointer(g)),
        ("R", Value::Pointer(inv_rms)),
        ("PARTIAL", Value::Pointer(partial)),
        ("stride_x", i64_of(r.dim)),
        ("stride_g", i64_of(r.dim)),
        ("rows", i32_of(r.rows)),
        ("dim", i32_of(r.dim)),
        ("group_rows", i32_of(groups(r.rows).0)),
    ]
}

/// `rms_norm_weight_sum`'s arguments: the groups' sums into `dw`.
pub(crate) fn sum_args(r: &Rows, partial: u64, dw: u64) -> Args {
    vec![
        ("PARTIAL", Value::Pointer(partial)),
        ("DW", Value::Pointer(dw)),
        ("groups", i32_of(groups(r.rows).1)),
        ("dim", i32_of(r.dim)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::rms_norm::compiled::KERNELS;
    use crate::triton::{check, Mismatch};

    fn rows(dim: usize) -> Rows {
        Rows {
            rows: 16_384,
            dim,
            eps: 1e-6,
            one_plus: true,
        }
    }

    fn args_for(kernel: &str, r: &Rows) -> Args {
        match kernel {
            "rms_norm_forward" => forward_args(r, 0x1000, 0x2000, 0x3000),
            "rms_norm_backward" => backward_args(r, (0x1000, 0x2000, 0x3000), 0x4000, 0x5000),
            "rms_norm_backward_weight" => weight_args(r, (0x1000, 0x3000, 0x5000), 0x6000),
            _ => sum_args(r, 0x6000, 0x7000),
        }
    }

    #[test]
    fn the_launchers_argument_lists_match_the_compiled_kernels() {
        crate::triton::assert_lists_fit(KERNELS, |k| args_for(k.kernel, &rows(4096)));
        assert!(KERNELS.iter().all(|k| k.block_m == k.variant));
        // Rows not a multiple of 16 wide are refused (the launcher composes them instead).
        let k = &KERNELS[0];
        let refused = check(k, &args_for(k.kernel, &rows(40)));
        assert!(matches!(refused, Err(Mismatch::Unaligned { .. })));
    }

    #[test]
    fn blocks_and_groups() {
        assert_eq!(
            [16, 128, 129, 256, 1024, 4096].map(block),
            [128, 128, 256, 256, 1024, 1024]
        );
        for rows in [1, 255, 256, 257, 16_384, 524_288] {
            let (group_rows, n) = groups(rows);
            assert!(n <= GROUPS && n * group_rows >= rows && (n - 1) * group_rows < rows);
        }
    }
}
