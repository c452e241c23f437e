//! Rope's kernel as its launcher sees it: the argument list for the compiled table
//! ([`super::compiled`]), plain numbers so the CPU build's tests hold it to it.

use super::cpu::Rotation;
use crate::triton::{i32_of, Args, Value};

/// The head dims compiled (the table's `variant`).
pub(crate) const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// `rope`'s arguments: `rows` rows of `x` rotated into `y`, forward or by the transpose.
pub(crate) fn rope_args(
    r: &Rotation,
    rows: usize,
    (x, cos, sin): (u64, u64, u64),
    y: u64,
    inverse: bool,
) -> Args {
    vec![
        ("X", Value::Pointer(x)),
        ("COS", Value::Pointer(cos)),
        ("SIN", Value::Pointer(sin)),
        ("Y", Value::Pointer(y)),
        ("rows", i32_of(rows)),
        ("rows_per_batch", i32_of(r.rows_per_batch)),
        ("length", i32_of(r.len)),
        ("per_batch", Value::I32(r.per_batch as i32)),
        ("inverse", Value::I32(inverse as i32)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::rope::compiled::KERNELS;
    use crate::triton::{assert_lists_fit, compiled_everywhere};

    #[test]
    fn the_launchers_argument_list_matches_the_compiled_kernels() {
        for hd in HEAD_DIMS {
            assert!(compiled_everywhere(KERNELS, "rope", hd), "hd {hd}");
        }
        assert_lists_fit(KERNELS, |k| {
            let r = Rotation {
                head_dim: k.variant,
                rows_per_batch: 32 * 4096,
                len: 4096,
                per_batch: true,
            };
            rope_args(&r, 2 * 32 * 4096, (0x1000, 0x2000, 0x3000), 0x4000, true)
        });
    }
}
