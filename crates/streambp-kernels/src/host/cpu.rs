//! Hand-written CPU passes over tensors' data: read a tensor's contiguous host memory in place, for
//! kernels that make one pass where composed ops make several (`attention::softmax_block`, the engine's LM head).

use candle_core::{DType, Storage, Tensor, WithDType};
use num_traits::Float;

use crate::host::skinny::{self, SumType};
use crate::host::transpose;
use crate::vectorized;

type CResult<T> = candle_core::Result<T>;

/// Runs `f` on the contiguous CPU data of `t` (`None` when `t` is not on the CPU).
pub fn with_data<T: WithDType, R>(
    t: &Tensor,
    f: impl FnOnce(&[T]) -> CResult<R>,
) -> CResult<Option<R>> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Ok(None);
    };
    f(input_data(cpu, layout)?).map(Some)
}

/// Runs `f` on the data of an optional tensor (an empty slice for none).
pub fn with_optional<T: WithDType, R>(
    t: Option<&Tensor>,
    f: impl FnOnce(&[T]) -> CResult<R>,
) -> CResult<Option<R>> {
    match t {
        Some(t) => with_data(t, f),
        None => f(&[]).map(Some),
    }
}

/// Runs `f` on the CPU storage `t` lies in, mutably, with `t`'s layout (which addresses `t`'s elements
/// in it: `t` may be a view). `None` when `t` is not on the CPU in `T`. For kernels that add into
/// several views at once, which candle's in-place ops (one destination each) cannot.
pub fn with_data_mut<T: WithDType, R>(
    t: &Tensor,
    f: impl FnOnce(&mut [T], &candle_core::Layout) -> CResult<R>,
) -> CResult<Option<R>> {
    if !t.device().is_cpu() || t.dtype() != T::DTYPE {
        return Ok(None);
    }
    let op = WithMut {
        f: std::sync::Mutex::new(Some(f)),
        out: std::sync::Mutex::new(None),
        dtype: std::marker::PhantomData::<fn() -> T>,
    };
    t.inplace_op1(&op)?;
    let out = op.out.into_inner().ok().flatten();
    out.ok_or_else(|| candle_core::Error::Msg("CPU pass: storage not reached".into()))?
        .map(Some)
}

/// The in-place op through which [`with_data_mut`] reaches a storage.
struct WithMut<T, F, R> {
    f: std::sync::Mutex<Option<F>>,
    out: std::sync::Mutex<Option<CResult<R>>>,
    dtype: std::marker::PhantomData<fn() -> T>,
}

impl<T: WithDType, F: FnOnce(&mut [T], &candle_core::Layout) -> CResult<R>, R>
    candle_core::InplaceOp1 for WithMut<T, F, R>
{
    fn name(&self) -> &'static str {
        "streambp-with-data-mut"
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> CResult<()> {
        use std::any::Any;
        let data: Option<&mut Vec<T>> = match storage {
            candle_core::CpuStorage::F32(v) => (v as &mut dyn Any).downcast_mut(),
            candle_core::CpuStorage::F64(v) => (v as &mut dyn Any).downcast_mut(),
            _ => None,
        };
        let (Some(data), Ok(mut f)) = (data, self.f.lock()) else {
            candle_core::bail!("CPU pass: not f32 or f64");
        };
        let Some(f) = f.take() else {
            candle_core::bail!("CPU pass: run twice");
        };
        let result = f(data, layout);
        if let Ok(mut out) = self.out.lock() {
            *out = Some(result);
        }
        Ok(())
    }
}

/// The elements of a contiguous CPU tensor in its storage (from [`Tensor::storage_and_layout`], whose
/// guard the caller keeps while it reads).
pub fn host_slice<'a, T: WithDType>(
    storage: &'a Storage,
    layout: &candle_core::Layout,
) -> CResult<&'a [T]> {
    let Storage::Cpu(cpu) = storage else {
        candle_core::bail!("CPU pass: not on the CPU");
    };
    input_data(cpu, layout)
}

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
/// The result records no backward (for products of constants, as [`crate::host::half_product::matmul`]).
pub fn tiled_matmul(a: &Tensor, b: &Tensor) -> CResult<Option<Tensor>> {
    if !(fusable(a) && b.device().is_cpu() && a.dtype() == b.dtype())
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

/// Lanes of the row reductions below: 8 independent accumulators, so that the loop is not bound by
/// one addition's latency and vectorizes (8 f32 per AVX register, two registers of f64).
const LANES: usize = 8;

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

/// Elements per rayon task of [`sum_of_squares`]: fixed, so the sum's order is too.
const SQUARES_PER_TASK: usize = 1 << 16;

/// `Σ x²` over a float tensor on the CPU, in f64 (a square of a bf16, f16 or f32 value is exact
/// there), in [`LANES`] interleaved partial sums per task of [`SQUARES_PER_TASK`] elements added in
/// order: the same bits whatever the thread count. `None` off the CPU or for an integer tensor.
/// (candle's `to_dtype(F64)` widens a whole half-precision tensor on one thread first.)
pub fn sum_of_squares(t: &Tensor) -> CResult<Option<f64>> {
    fn sum<T: WithDType>(t: &Tensor, to_f64: impl Fn(T) -> f64 + Sync) -> CResult<Option<f64>> {
        use rayon::prelude::*;
        with_data::<T, _>(t, |xs| {
            let tasks: Vec<f64> = xs
                .par_chunks(SQUARES_PER_TASK)
                .map(|xs| {
                    vectorized!(|_| {
                        let mut lanes = [0f64; LANES];
                        let chunks = xs.chunks_exact(LANES);
                        let rest = chunks.remainder();
                        for chunk in chunks {
                            for (s, &x) in lanes.iter_mut().zip(chunk) {
                                let x = to_f64(x);
                                *s += x * x;
                            }
                        }
                        let s: f64 = lanes.iter().sum();
                        rest.iter()
                            .map(|&x| to_f64(x) * to_f64(x))
                            .fold(s, |s, x| s + x)
                    })
                })
                .collect();
            Ok(tasks.iter().sum())
        })
    }
    match t.dtype() {
        DType::F64 => sum::<f64>(t, |x| x),
        DType::F32 => sum::<f32>(t, f64::from),
        DType::BF16 => sum::<half::bf16>(t, |x| f64::from(widen(x))),
        DType::F16 => sum::<half::f16>(t, |x| x.to_f64()),
        _ => Ok(None),
    }
}

/// `t · by`: for half precision on the CPU one pass over rayon's threads, each product formed in
/// f32 (`by` rounded to f32, not to the tensor's dtype) and rounded once, as PyTorch multiplies a
/// bf16 tensor by an f32 scalar tensor (gradient clipping); candle's `affine` (any other tensor)
/// would round `by` to bf16 and run on one thread.
pub fn scaled(t: &Tensor, by: f64) -> CResult<Tensor> {
    use rayon::prelude::*;
    let by32 = by as f32;
    let out = match t.dtype() {
        DType::BF16 => with_data::<half::bf16, _>(t, |xs| {
            let mut ys = vec![half::bf16::ZERO; xs.len()];
            ys.par_chunks_mut(CAST_PER_TASK)
                .zip(xs.par_chunks(CAST_PER_TASK))
                .for_each(|(ys, xs)| {
                    vectorized!(|_| ys
                        .iter_mut()
                        .zip(xs)
                        .for_each(|(y, &x)| *y = half::bf16::from_f32(widen(x) * by32)))
                });
            Tensor::from_vec(ys, t.shape(), t.device())
        })?,
        DType::F16 => with_data::<half::f16, _>(t, |xs| {
            let ys: Vec<half::f16> = xs
                .par_iter()
                .map(|&x| half::f16::from_f32(x.to_f32() * by32))
                .collect();
            Tensor::from_vec(ys, t.shape(), t.device())
        })?,
        _ => None,
    };
    match out {
        Some(out) => Ok(out),
        None => t.affine(by, 0.0),
    }
}

/// The address of the CPU buffer `t` lies in, telling tensors that share storage apart (`None`
/// off the CPU or outside f32/f64).
pub fn storage_id(t: &Tensor) -> Option<usize> {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(candle_core::CpuStorage::F32(v)) => Some(v.as_ptr() as usize),
        Storage::Cpu(candle_core::CpuStorage::F64(v)) => Some(v.as_ptr() as usize),
        _ => None,
    }
}

/// Whether a hand-written pass applies to `t`: on the CPU, in f32 or f64.
pub fn fusable(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// Runs `op`, a pass written for f32/f64 ([`fusable`]), on bf16 CPU tensors: their f32 copies in
/// (inputs already in f32 as they are), the result rounded back to bf16 once (the casts recorded in
/// the graph). Composed in bf16 the same computation makes a buffer and a rounding per step, forward
/// and backward. `None`, with nothing run, unless the first input is bf16 and every input bf16 or
/// f32, all on the CPU.
pub fn through_f32<const N: usize, E: From<candle_core::Error>>(
    inputs: [&Tensor; N],
    op: impl FnOnce([Tensor; N]) -> Result<Tensor, E>,
) -> Result<Option<Tensor>, E> {
    let applies = inputs.first().is_some_and(|t| t.dtype() == DType::BF16)
        && inputs
            .iter()
            .all(|t| t.device().is_cpu() && matches!(t.dtype(), DType::BF16 | DType::F32));
    if !applies {
        return Ok(None);
    }
    let wide: Vec<Tensor> = inputs
        .iter()
        .map(|t| cast(t, DType::F32))
        .collect::<CResult<_>>()?;
    let wide: [Tensor; N] = wide
        .try_into()
        .map_err(|_| candle_core::Error::Msg("through_f32: inputs lost".into()))?;
    Ok(Some(cast(&op(wide)?, DType::BF16)?))
}

/// `t` in `dtype`, differentiable: between bf16 and f32 on the CPU one pass split over rayon's
/// threads (candle's `to_dtype` runs on one), rounding to nearest even as candle does; any other
/// conversion by `to_dtype`.
pub fn cast(t: &Tensor, dtype: DType) -> CResult<Tensor> {
    match (t.dtype(), dtype, t.device().is_cpu()) {
        (DType::BF16, DType::F32, true) | (DType::F32, DType::BF16, true) => {
            t.contiguous()?.apply_op1(Cast(dtype))
        }
        _ => t.to_dtype(dtype),
    }
}

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

/// The op of [`cast`]: its target dtype.
struct Cast(DType);

/// Elements per rayon task of a cast.
const CAST_PER_TASK: usize = 1 << 14;

impl candle_core::CustomOp1 for Cast {
    fn name(&self) -> &'static str {
        "streambp-cast"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> CResult<(candle_core::CpuStorage, candle_core::Shape)> {
        use half::bf16;
        use rayon::prelude::*;
        let out = match (s, self.0) {
            (candle_core::CpuStorage::BF16(_), DType::F32) => {
                candle_core::CpuStorage::F32(widened_bf16(input_data::<bf16>(s, l)?))
            }
            (candle_core::CpuStorage::F32(_), DType::BF16) => {
                let x = input_data::<f32>(s, l)?;
                let mut y = vec![bf16::ZERO; x.len()];
                y.par_chunks_mut(CAST_PER_TASK)
                    .zip(x.par_chunks(CAST_PER_TASK))
                    .for_each(|(y, x)| {
                        vectorized!(|_| {
                            y.iter_mut()
                                .zip(x)
                                .for_each(|(y, &x)| *y = bf16::from_f32(x))
                        })
                    });
                candle_core::CpuStorage::BF16(y)
            }
            (_, to) => candle_core::bail!("cast: not between bf16 and f32 (to {to:?})"),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        cast(grad, x.dtype()).map(Some)
    }
}

/// The values of a half-precision (bf16, f16) CPU tensor in f32, row-major: exact, f32 holds every
/// one. (For a buffer of one's own: candle's `to_dtype` runs on one thread and a variable made from
/// its result would be a second copy.)
pub fn widened_values(t: &Tensor) -> CResult<Vec<f32>> {
    let values = match t.dtype() {
        DType::BF16 => with_data::<half::bf16, _>(t, |x| Ok(widened_bf16(x)))?,
        DType::F16 => with_data::<half::f16, _>(t, |x| Ok(x.iter().map(|v| v.to_f32()).collect()))?,
        other => candle_core::bail!("widen: a {other:?} tensor, not half precision"),
    };
    values.ok_or_else(|| candle_core::Error::Msg("widen: a tensor off the CPU".into()))
}

/// `x` in f32, split over rayon's threads, written once (no zero-fill first).
fn widened_bf16(x: &[half::bf16]) -> Vec<f32> {
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

/// Rounds `t` (f32, contiguous, on the CPU) in place to the nearest values of `dtype` (bf16 or f16),
/// as a cast there and back would: what a half-precision layer computed in f32 does where the
/// model's own arithmetic rounds (`streambp_models`' `DecoderLayer::computed_in_f32`). It records
/// nothing: callers round only a fresh output of an op whose backward does not read that output.
pub fn round_in_place(t: &Tensor, dtype: DType) -> CResult<()> {
    t.inplace_op1(&RoundTo(dtype))
}

/// The op of [`round_in_place`]: the dtype whose values to round to.
struct RoundTo(DType);

impl candle_core::InplaceOp1 for RoundTo {
    fn name(&self) -> &'static str {
        "streambp-round"
    }

    fn cpu_fwd(&self, s: &mut candle_core::CpuStorage, l: &candle_core::Layout) -> CResult<()> {
        use rayon::prelude::*;
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("round: tensor not contiguous".into()))?;
        let candle_core::CpuStorage::F32(data) = s else {
            candle_core::bail!("round: not an f32 tensor");
        };
        let tasks = data[start..end].par_chunks_mut(CAST_PER_TASK);
        match self.0 {
            DType::BF16 => {
                tasks.for_each(|x| vectorized!(|_| x.iter_mut().for_each(|x| *x = bf16_value(*x))))
            }
            DType::F16 => tasks.for_each(|x| {
                x.iter_mut()
                    .for_each(|x| *x = half::f16::from_f32(*x).to_f32())
            }),
            other => candle_core::bail!("round: to {other:?}, not a half-precision dtype"),
        }
        Ok(())
    }
}

/// The data of a custom op's CPU input (which the caller made contiguous).
pub fn input_data<'a, T: WithDType>(
    storage: &'a candle_core::CpuStorage,
    layout: &candle_core::Layout,
) -> CResult<&'a [T]> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("CPU op: input not contiguous".into()))?;
    Ok(&storage.as_slice::<T>()?[start..end])
}

/// A CPU tensor of `shape` holding `data`, on `like`'s device.
pub fn tensor_from<T: WithDType>(data: Vec<T>, like: &Tensor) -> CResult<Tensor> {
    Tensor::from_vec(data, like.shape(), like.device())
}

/// Float types whose exponentials the CPU passes take a row at a time: f64 through the standard
/// library's `exp`; f32 through a polynomial the compiler vectorizes at the width of the path in
/// force ([`crate::host::simd`]: [`exp_f32_fused`] where it has FMA, [`exp_f32`] on the baseline), where
/// glibc's `expf` takes one element per call (it was 6-8% of a step's time).
pub trait BulkExp:
    Float + std::ops::AddAssign + std::ops::SubAssign + std::ops::MulAssign + std::ops::DivAssign
{
    /// `x ← exp(x)` for every element.
    fn exp_in_place(xs: &mut [Self]);

    /// `x ← exp(x − shift)` for every element, returning their sum (added as [`row_sum`] adds): a
    /// softmax row's exponentials and normalizer in one pass over it instead of three.
    fn exp_shifted_sum(xs: &mut [Self], shift: Self) -> Self;
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
}

/// [`BulkExp::exp_shifted_sum`] with the exponential `exp`, the sum in [`row_sum`]'s lanes and order.
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

    /// `Σ x²` in every float dtype and at lengths around the lanes and the tasks (empty, one lane,
    /// a remainder, several tasks), against candle's f64 sum of the widened values: within f64's
    /// rounding of the sum; integers and non-host tensors are declined.
    #[test]
    fn sums_of_squares_equal_candles() {
        let dev = candle_core::Device::Cpu;
        for len in [0, 1, 7, 8, 9, 3 * SQUARES_PER_TASK + 5] {
            let values: Vec<f64> = (0..len).map(|i| ((i as f64) * 0.37).sin() * 3.0).collect();
            for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
                let t = Tensor::from_vec(values.clone(), len, &dev).unwrap();
                let t = t.to_dtype(dtype).unwrap();
                let want = t
                    .to_dtype(DType::F64)
                    .unwrap()
                    .sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap();
                let want = want.to_scalar::<f64>().unwrap();
                let got = sum_of_squares(&t).unwrap().expect("a host float tensor");
                let tol = 1e-15 * want.abs() * (len as f64).sqrt().max(1.0);
                assert!(
                    (got - want).abs() <= tol,
                    "{dtype:?} {len}: {got} against {want}"
                );
            }
        }
        let ids = Tensor::new(&[1u32, 2], &dev).unwrap();
        assert!(sum_of_squares(&ids).unwrap().is_none());
    }

    /// Half precision scaled in f32 and rounded once (what PyTorch's `g * coef` gives for an f32
    /// scalar tensor `coef`), over several tasks; f32 and f64 exactly as candle scales them.
    #[test]
    fn scaling_rounds_once() {
        let dev = candle_core::Device::Cpu;
        let len = 2 * CAST_PER_TASK + 3;
        let values: Vec<f32> = (0..len).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
        let by = 0.123_456_789_f64;
        for dtype in [DType::BF16, DType::F16] {
            let t = Tensor::new(values.as_slice(), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let got = scaled(&t, by).unwrap();
            assert_eq!(got.dtype(), dtype);
            let wide = t.to_dtype(DType::F32).unwrap();
            let want = (wide * f64::from(by as f32))
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let (got, want) = (
                got.to_dtype(DType::F32).unwrap(),
                want.to_dtype(DType::F32).unwrap(),
            );
            let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{dtype:?}");
        }
        for dtype in [DType::F32, DType::F64] {
            let t = Tensor::new(values.as_slice(), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let diff = (scaled(&t, by).unwrap() - (&t * by).unwrap()).unwrap();
            let diff = diff
                .abs()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .max_all()
                .unwrap();
            assert_eq!(diff.to_scalar::<f64>().unwrap(), 0.0, "{dtype:?}");
        }
    }

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

    /// The parallel cast gives candle's `to_dtype` values both ways (rounding to nearest even: ties,
    /// infinities and NaN included, tensors longer than one task), and its backward casts the
    /// gradient back to the input's dtype.
    #[test]
    fn casts_equal_to_dtype_and_differentiate() {
        use half::bf16;
        let step = 2f32.powi(-8);
        let mut values: Vec<f32> = (0..40_000)
            .map(|i| (i as f32 * 0.37).sin() * 300.0)
            .collect();
        values.extend([
            1.0 + step,
            1.0 + 3.0 * step,
            f32::INFINITY,
            f32::MIN,
            -0.0,
            f32::NAN,
        ]);
        let t = Tensor::from_vec(values.clone(), values.len(), &candle_core::Device::Cpu).unwrap();
        let bits = |t: &Tensor| -> Vec<u16> {
            let v = t.to_vec1::<bf16>().unwrap();
            v.iter()
                .map(|x| if x.is_nan() { 0x7fc0 } else { x.to_bits() })
                .collect()
        };
        let narrow = cast(&t, DType::BF16).unwrap();
        assert_eq!(bits(&narrow), bits(&t.to_dtype(DType::BF16).unwrap()));
        let wide = cast(&narrow, DType::F32).unwrap().to_vec1::<f32>().unwrap();
        let want = narrow
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for (got, want) in wide.iter().zip(&want) {
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "{got} vs {want}"
            );
        }

        let x = candle_core::Var::from_tensor(&t.narrow(0, 0, 1000).unwrap()).unwrap();
        let y = cast(&cast(x.as_tensor(), DType::BF16).unwrap(), DType::F32).unwrap();
        let grads = (y * 3.0).unwrap().sum_all().unwrap().backward().unwrap();
        let g = grads.get(x.as_tensor()).unwrap();
        assert_eq!(g.dtype(), DType::F32);
        assert!(g.to_vec1::<f32>().unwrap().iter().all(|&g| g == 3.0));
    }

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
    /// (subtract, exponentiate, [`row_sum`]), bit for bit, in f32 and f64, rows of 0..20 elements.
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
}
