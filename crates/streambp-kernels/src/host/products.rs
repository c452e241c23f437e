//! Matrix products on the host by gemm (the kernel candle's own products run): split into output
//! tiles that the threads take one each ([`tiled_matmul`], [`product_into`]), or one call on the
//! calling thread inside tasks that are themselves the parallelism.

use candle_core::{DType, Storage, Tensor, WithDType};

use crate::host::skinny::{self, SumType};
use crate::host::storage::host_float;
use crate::host::transpose;

type CResult<T> = candle_core::Result<T>;

/// Output rows and columns of a product's tile (gemm blocks each tile's inner dimension for the
/// caches itself).
const TILE: usize = 256;

/// The smallest tile edge the tiles shrink to when a product has too few tiles to keep every thread
/// busy (gemm's f32 kernel loses little at 64).
const MIN_TILE: usize = 64;

/// Tile edges for an `m × n` output: [`TILE`], halved (down to [`MIN_TILE`]) along the longer edge
/// while there are fewer tiles than twice the threads.
pub fn tile_sizes(m: usize, n: usize) -> (usize, usize) {
    let want = 2 * rayon::current_num_threads();
    let (mut tm, mut tn) = (TILE.min(m).max(1), TILE.min(n).max(1));
    while m.div_ceil(tm) * n.div_ceil(tn) < want {
        if tm >= tn && tm / 2 >= MIN_TILE {
            tm /= 2;
        } else if tn / 2 >= MIN_TILE {
            tn /= 2;
        } else {
            break;
        }
    }
    (tm, tn)
}

/// The tiles of an `m × n` output, as their first rows and columns.
pub(crate) fn tiles(m: usize, n: usize, (tm, tn): (usize, usize)) -> Vec<(usize, usize)> {
    (0..m.div_ceil(tm))
        .flat_map(|i| (0..n.div_ceil(tn)).map(move |j| (i * tm, j * tn)))
        .collect()
}

/// A pointer to a product's destination that tasks share, each writing only its own tile.
#[derive(Clone, Copy)]
pub(crate) struct SharedDst<T>(pub(crate) *mut T);

impl<T> SharedDst<T> {
    /// The pointer (a method, so that closures capture the whole `Send` wrapper, not its field).
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}
// SAFETY: each task writes a tile no other task touches (see the products that use it).
unsafe impl<T> Send for SharedDst<T> {}
// SAFETY: as for Send: the tasks sharing it write disjoint tiles.
unsafe impl<T> Sync for SharedDst<T> {}

/// Whether a `rows × cols` operand `(data, row stride, column stride)` lies within its data.
pub(crate) fn fits<T>(rows: usize, cols: usize, (data, rs, cs): (&[T], usize, usize)) -> bool {
    let last = (rows.wrapping_sub(1).checked_mul(rs))
        .zip(cols.wrapping_sub(1).checked_mul(cs))
        .and_then(|(r, c)| r.checked_add(c));
    rows == 0 || cols == 0 || last.is_some_and(|last| last < data.len())
}

/// A 2-D layout's matrix in `data` as [`gemm_into`] takes it: the data from its first element (empty
/// past the end, which [`fits`] then refuses), its row and column strides.
pub(crate) fn strided<'a, T>(
    (data, l): (&'a [T], &candle_core::Layout),
) -> (&'a [T], usize, usize) {
    let s = l.stride();
    (data.get(l.start_offset()..).unwrap_or_default(), s[0], s[1])
}

/// `a·b` for 2-D f32/f64 CPU tensors (any strides) by [`gemm_into`] in tiles; `None` for any others.
/// The result records no backward (for products of constants, as [`crate::ops::matmul::matmul`]).
pub fn tiled_matmul(a: &Tensor, b: &Tensor) -> CResult<Option<Tensor>> {
    if !(host_float(a) && b.device().is_cpu() && a.dtype() == b.dtype())
        || a.rank() != 2
        || b.rank() != 2
    {
        return Ok(None);
    }
    fn product<T: WithDType + SumType>(a: &Tensor, b: &Tensor) -> CResult<Tensor> {
        let ((m, k), (k2, n)) = (a.dims2()?, b.dims2()?);
        if k != k2 {
            candle_core::bail!("product: [{m}, {k}] by [{k2}, {n}]");
        }
        let ((sa, la), (sb, lb)) = (a.storage_and_layout(), b.storage_and_layout());
        let (Storage::Cpu(ca), Storage::Cpu(cb)) = (&*sa, &*sb) else {
            candle_core::bail!("product: operands not on the CPU");
        };
        let (oa, ob) = (
            strided((ca.as_slice::<T>()?, la)),
            strided((cb.as_slice::<T>()?, lb)),
        );
        if !(fits(m, k, oa) && fits(k, n, ob)) {
            candle_core::bail!("product: an operand outside its storage");
        }
        let mut out = vec![T::zero(); m * n];
        product_into(&mut out, (m, n, k), false, oa, ob);
        Tensor::from_vec(out, (m, n), a.device())
    }
    match a.dtype() {
        DType::F32 => product::<f32>(a, b).map(Some),
        DType::F64 => product::<f64>(a, b).map(Some),
        _ => Ok(None),
    }
}

/// How a product uses rayon's threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Threads {
    /// One gemm call on the calling thread (in tasks that are themselves the parallelism).
    One,
    /// The output split into tiles ([`tile_sizes`]) that the threads take one each, each tile one
    /// single-threaded gemm call. gemm's own threading shares one call's packed panels between the
    /// threads, which at a chunk's sizes costs more than it gains (docs/benchmarks.md, "Products in
    /// tiles"); at a few thousand rows the two take about the same.
    Tiles,
}

/// `dst (=|+=) a·b` by gemm (the kernel candle's products run), with `(m, n, k)` and each operand
/// as `(data from its first element, row stride, column stride)`; `dst` is `[m, n]` row-major.
/// Panics if an operand's strides reach past its slice or `dst` is too small.
pub(crate) fn gemm_into<T: WithDType>(
    dst: &mut [T],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    a: (&[T], usize, usize),
    b: (&[T], usize, usize),
    threads: Threads,
) {
    assert!(dst.len() >= m * n, "product: destination too small");
    assert!(
        fits(m, k, a) && fits(k, n, b),
        "product: operand out of range"
    );
    if m * n == 0 {
        return;
    }
    let (tm, tn) = match threads {
        Threads::One => (m, n),
        Threads::Tiles => tile_sizes(m, n),
    };
    let out = SharedDst(dst.as_mut_ptr());
    let tile = |&(i0, j0): &(usize, usize)| {
        // SAFETY: tile (i0, j0) of `dst` (row stride n) is this call's alone and lies within
        // `m × n`; rows i0.. of `a` and columns j0.. of `b` lie within their slices (checked
        // above for the whole product); the operands are only read.
        unsafe {
            gemm_call(
                out.get().add(i0 * n + j0),
                n,
                (tm.min(m - i0), tn.min(n - j0), k),
                accumulate,
                (a.0.as_ptr().wrapping_add(i0 * a.1), a.1, a.2),
                (b.0.as_ptr().wrapping_add(j0 * b.2), b.1, b.2),
            )
        }
    };
    match threads {
        Threads::One => tile(&(0, 0)),
        Threads::Tiles => {
            use rayon::prelude::*;
            tiles(m, n, (tm, tn)).par_iter().for_each(tile)
        }
    }
}

/// `dst (=|+=) a·b` over the threads, as [`gemm_into`] in tiles, except for a few rows of `a` by
/// `b = Wᵀ` with each row of `W` contiguous (a projection of a decoding step), which takes
/// [`skinny::product`]: gemm would pack all of `W` for them.
pub fn product_into<T: WithDType + SumType>(
    dst: &mut [T],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    a: (&[T], usize, usize),
    b: (&[T], usize, usize),
) {
    if skinny::applies(m, a.2, b.1) {
        skinny::product((dst, n), (m, n, k), accumulate, (a.0, a.1), (b.0, b.2));
    } else {
        gemm_into(dst, (m, n, k), accumulate, a, b, Threads::Tiles);
    }
}

/// `dst (=|+=) a·b` on one thread, `dst` at row stride `dst_rs` and each operand as `(first
/// element, row stride, column stride)`: one gemm call, or where `b` is a transposed view (`Wᵀ`),
/// one per slab of its columns copied into rows ([`transpose`]).
///
/// # Safety
/// `dst` must address `m` rows of `n` writable elements at row stride `dst_rs` that nothing else
/// touches during the call, `a` an `m × k` and `b` a `k × n` matrix of readable elements.
pub(crate) unsafe fn gemm_call<T: WithDType>(
    dst: *mut T,
    dst_rs: usize,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    a: (*const T, usize, usize),
    b: (*const T, usize, usize),
) {
    // `dst`'s first `cols` columns (=|+=) `a` by `b`'s, as gemm takes them.
    let gemm_on = |dst: *mut T, cols: usize, b: (*const T, usize, usize)| {
        // SAFETY: each call below passes columns of `dst` within the caller's `n` (its contract),
        // and `b` as the caller gave it or a readable `[k, cols]` copy of its columns.
        unsafe {
            gemm::gemm(
                m,
                cols,
                k,
                dst,
                1,
                dst_rs as isize,
                accumulate,
                a.0,
                a.2 as isize,
                a.1 as isize,
                b.0,
                b.2 as isize,
                b.1 as isize,
                T::from_f64(1.0),
                T::from_f64(1.0),
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        }
    };
    let Some(slab) = transpose::slab_columns((m, n, k), (b.1, b.2)) else {
        return gemm_on(dst, n, b);
    };
    let mut rows = Vec::new();
    for j0 in (0..n).step_by(slab) {
        let c = slab.min(n - j0);
        // SAFETY: columns j0..j0 + c of `b` (each `k` adjacent elements: `b.1` is 1) are readable.
        unsafe { transpose::columns_into_rows(&mut rows, b.0.wrapping_add(j0 * b.2), (k, c), b.2) };
        gemm_on(dst.wrapping_add(j0), c, (rows.as_ptr(), c, 1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiled product equals candle's `matmul` in f64 for every layout of either operand
    /// (row-major, transposed, a strided column slice, an offset), outputs smaller and larger than
    /// a tile and not a multiple of one, an empty inner dimension; adding into a destination too.
    #[test]
    fn tiled_products_equal_candles() {
        let dev = candle_core::Device::Cpu;
        let matrix = |rows: usize, cols: usize, seed: f64| {
            let v: Vec<f64> = (0..rows * cols)
                .map(|i| ((i as f64 + seed) * 0.731).sin())
                .collect();
            Tensor::from_vec(v, (rows, cols), &dev).unwrap()
        };
        // Each operand as given, transposed, and as a column slice of a wider matrix at an offset.
        let layouts = |rows: usize, cols: usize, seed: f64| {
            vec![
                matrix(rows, cols, seed),
                matrix(cols, rows, seed).t().unwrap(),
                matrix(rows, cols + 5, seed).narrow(1, 3, cols).unwrap(),
            ]
        };
        for (m, n, k) in [
            (1, 1, 1),
            (3, 5, 7),
            (130, 300, 17),
            (300, 70, 129),
            (4, 6, 0),
        ] {
            for a in layouts(m, k, 1.0) {
                for b in layouts(k, n, 2.0) {
                    let got = tiled_matmul(&a, &b).unwrap().unwrap();
                    let want = a.matmul(&b).unwrap();
                    let diff = (&got - &want).unwrap().abs().unwrap();
                    let worst = diff.flatten_all().unwrap().max(0).unwrap();
                    let worst = if m * n == 0 {
                        0.0
                    } else {
                        worst.to_scalar::<f64>().unwrap()
                    };
                    assert!(worst <= 1e-13, "{m}x{n}x{k}: {worst}");
                }
            }
            let (a, b) = (matrix(m, k, 3.0), matrix(k, n, 4.0));
            let mut sum = vec![1.0f64; m * n];
            let data = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
            let (da, db) = (data(&a), data(&b));
            gemm_into(
                &mut sum,
                (m, n, k),
                true,
                (&da, k, 1),
                (&db, n, 1),
                Threads::Tiles,
            );
            let want = data(&(a.matmul(&b).unwrap() + 1.0).unwrap());
            for (got, want) in sum.iter().zip(&want) {
                assert!(
                    (got - want).abs() <= 1e-13,
                    "{m}x{n}x{k} added: {got} vs {want}"
                );
            }
        }
        // Other dtypes are not its to take.
        let half = matrix(2, 2, 0.0).to_dtype(DType::BF16).unwrap();
        assert!(tiled_matmul(&half, &half).unwrap().is_none());
    }
}
