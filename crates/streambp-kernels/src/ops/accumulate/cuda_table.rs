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

/// How cuBLAS (column-major) reads the transpose of a row-major operand `[rows, cols]` with
/// element strides `(s0, s1)`: `(transposed, leading dimension)`, i.e. op `N` on a column-major
/// `[cols, rows]` (rows contiguous) or op `T` on a column-major `[rows, cols]` (columns
/// contiguous); `None` for other layouts. A row-major `C = A·B` is then cuBLAS's `Cᵀ = Bᵀ·Aᵀ`.
pub(crate) fn transposed_operand(
    (rows, cols): (usize, usize),
    (s0, s1): (usize, usize),
) -> Option<(bool, usize)> {
    if cols == 1 || s1 == 1 {
        let ld = if rows == 1 { cols } else { s0 };
        return (ld >= cols.max(1)).then_some((false, ld));
    }
    if rows == 1 || s0 == 1 {
        let ld = if cols == 1 { rows } else { s1 };
        return (ld >= rows.max(1)).then_some((true, ld));
    }
    None
}

/// A row-major matrix operand: its `(rows, cols)` and element strides.
pub(crate) type Layout2 = ((usize, usize), (usize, usize));

/// The column-major call computing `accᵀ += bᵀ·aᵀ`, i.e. the row-major `acc[m, n] += a[m, k]·b[k, n]`
/// (`acc` contiguous), for operands laid out as `a` and `b`; `None` where cuBLAS cannot read a
/// layout or a size is past its 32-bit arguments.
pub(crate) fn gemm_args(a: Layout2, b: Layout2) -> Option<GemmArgs> {
    let ((m, k), (_, n)) = (a.0, b.0);
    let (op_a, ld_a) = transposed_operand(a.0, a.1)?;
    let (op_b, ld_b) = transposed_operand(b.0, b.1)?;
    let fits = [m, n, k, ld_a, ld_b]
        .iter()
        .all(|&x| x <= i32::MAX as usize);
    fits.then_some(GemmArgs {
        op_b,
        op_a,
        m: n,
        n: m,
        k,
        ld_b,
        ld_a,
        ld_c: n.max(1),
    })
}

/// A column-major product `C[m, n] += op(B)[m, k]·op(A)[k, n]` as cuBLAS takes it (the row-major
/// operands' roles swapped: see [`gemm_args`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GemmArgs {
    pub op_b: bool,
    pub op_a: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub ld_b: usize,
    pub ld_a: usize,
    pub ld_c: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::accumulate::compiled::KERNELS;
    use crate::triton::{assert_lists_fit, check, compiled_everywhere, Mismatch};

    /// What cuBLAS computes for `args`: `C += op(X)·op(Y)` over column-major buffers, `X` the first
    /// operand (`b`'s buffer) and `Y` the second (`a`'s).
    fn column_major_gemm(args: &GemmArgs, x: &[f64], y: &[f64], c: &mut [f64]) {
        let read = |buf: &[f64], op: bool, ld: usize, (i, j): (usize, usize)| match op {
            false => buf[i + j * ld],
            true => buf[j + i * ld],
        };
        for i in 0..args.m {
            for j in 0..args.n {
                let dot: f64 = (0..args.k)
                    .map(|l| {
                        read(x, args.op_b, args.ld_b, (i, l))
                            * read(y, args.op_a, args.ld_a, (l, j))
                    })
                    .sum();
                c[i + j * args.ld_c] += dot;
            }
        }
    }

    /// The call's arguments compute the row-major `acc += a·b` for operands contiguous, transposed
    /// views (the LM head's `dzᵀ`, a projection's `gᵀ`), rows padded wider than they are, and sizes
    /// of 1 (whose strides carry nothing); a layout with no contiguous dimension is refused.
    #[test]
    fn the_product_call_adds_the_row_major_product() {
        // Element (i, j) of a row-major `[r, c]` view at `i·s0 + j·s1` of `buf`.
        let value = |i: usize, j: usize, seed: usize| ((i * 31 + j * 7 + seed) as f64 * 0.13).sin();
        let buffer = |(r, c): (usize, usize), (s0, s1): (usize, usize), seed| {
            let len = (r.max(1) - 1) * s0 + (c.max(1) - 1) * s1 + 1;
            let mut buf = vec![f64::NAN; len];
            for i in 0..r {
                for j in 0..c {
                    buf[i * s0 + j * s1] = value(i, j, seed);
                }
            }
            buf
        };
        // `(m, k, n)` and the strides of `a` and `b`.
        type Case = ((usize, usize, usize), (usize, usize), (usize, usize));
        let cases: &[Case] = &[
            ((3, 4, 5), (4, 1), (5, 1)), // both contiguous
            ((3, 4, 5), (1, 3), (5, 1)), // `a` a transposed view
            ((3, 4, 5), (4, 1), (1, 4)), // `b` a transposed view
            ((3, 4, 5), (1, 3), (1, 4)), // both
            ((3, 4, 5), (6, 1), (9, 1)), // rows padded
            ((1, 4, 5), (7, 1), (5, 1)), // one row of `a`: its stride unused
            ((3, 1, 5), (1, 2), (5, 1)), // k = 1
            ((3, 4, 1), (4, 1), (1, 9)), // n = 1
        ];
        for &((m, k, n), sa, sb) in cases {
            let (a, b) = (buffer((m, k), sa, 1), buffer((k, n), sb, 2));
            let args = gemm_args(((m, k), sa), ((k, n), sb)).expect("a layout cuBLAS reads");
            let mut c: Vec<f64> = (0..m * n).map(|i| i as f64).collect();
            column_major_gemm(&args, &b, &a, &mut c);
            for i in 0..m {
                for j in 0..n {
                    let dot: f64 = (0..k).map(|l| value(i, l, 1) * value(l, j, 2)).sum();
                    let want = (i * n + j) as f64 + dot;
                    assert!(
                        (c[i * n + j] - want).abs() < 1e-12,
                        "{m}x{k}x{n} {sa:?} {sb:?}"
                    );
                }
            }
        }
        assert_eq!(gemm_args(((3, 4), (8, 2)), ((4, 5), (5, 1))), None);
    }

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
