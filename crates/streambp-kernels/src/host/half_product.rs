//! bf16 matrix products computed in f32, a tile at a time.
//!
//! candle 0.11 multiplies bf16 matrices by widening both operands' *whole storages* to f32, then
//! narrowing the result: for a projection that is the weight, for the LM head the whole vocabulary
//! table, on every call (and a second f32 copy of each gradient product). Here each task owns one
//! tile of the output and sums it over slices of the inner dimension, reading only the slices of
//! each operand it needs, with one of the [`Kernel`]s: on CPUs with AVX512-BF16 the slices can be
//! packed as bf16 pairs for its dot-product instruction ([`crate::host::bf16_kernel`]) or, with AMX, for
//! its tiles ([`crate::host::amx_kernel`]); otherwise they are widened into small f32 buffers for gemm's
//! f32 kernel (the one candle's f32 products run, on one thread: the tiles are what run in
//! parallel). No operand is ever widened whole, and the result is
//! rounded once (or added, unrounded, into an f32 accumulator), so the arithmetic is f32's with f32
//! accumulation, as candle's widened product and PyTorch's bf16 products on the CPU do.

use candle_core::Layout;
use half::bf16;
use rayon::prelude::*;

use crate::host::cast::{bf16_value, widen};
use crate::host::products::{tile_sizes, tiles, SharedDst};
use crate::host::transpose;

type CResult<T> = candle_core::Result<T>;

/// The inner slice summed per kernel call, as long as a tile's edge ([`crate::host::products::tile_sizes`]).
const INNER: usize = 256;

/// An element of a product's operand: a bf16, or an f32 holding a bf16's value (a half-precision
/// computation's value carried in f32, rounded where bf16 rounds: the LM head's logits and their
/// gradient on the host), which the kernels read as that bf16.
pub trait Element: Copy + Send + Sync + 'static {
    /// The value in f32 (exact).
    fn to_f32(self) -> f32;
    /// The value as a bf16: exact for a bf16's value (an f32 of another value is truncated).
    fn to_bf16(self) -> bf16;
    /// The elements as f32 where they are f32 already: the widened kernel then reads them in
    /// place.
    fn as_f32(data: &[Self]) -> Option<&[f32]>;
}

impl Element for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        widen(self)
    }
    #[inline(always)]
    fn to_bf16(self) -> bf16 {
        self
    }
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn to_bf16(self) -> bf16 {
        bf16::from_bits((self.to_bits() >> 16) as u16)
    }
    fn as_f32(data: &[Self]) -> Option<&[f32]> {
        Some(data)
    }
}

/// A matrix operand of bf16 values: its data from its first element and its row and column
/// strides.
#[derive(Clone, Copy)]
pub struct Operand<'a, E = bf16> {
    /// The elements, from the matrix's first.
    pub data: &'a [E],
    /// Elements from one row to the next.
    pub row_stride: usize,
    /// Elements from one column to the next.
    pub col_stride: usize,
}

impl<'a, E: Element> Operand<'a, E> {
    /// The same matrix transposed (reads `xᵀ[j, i]` as `x[i, j]`).
    pub fn transposed(&self) -> Operand<'a, E> {
        Operand {
            data: self.data,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// Whether a `rows × cols` matrix with these strides lies within the data.
    fn fits(&self, rows: usize, cols: usize) -> bool {
        crate::host::products::fits(rows, cols, (self.data, self.row_stride, self.col_stride))
    }

    /// Widens rows `rows` × columns `cols` into `buf`, laid out along whichever of the operand's
    /// strides is 1 (so the reads are contiguous): returns the buffer's (row, column) strides.
    fn widen(
        &self,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        buf: &mut Vec<f32>,
    ) -> (usize, usize) {
        let (r, c) = (rows.len(), cols.len());
        buf.clear();
        buf.reserve(r * c);
        let at = |i: usize, j: usize| i * self.row_stride + j * self.col_stride;
        // Each contiguous run is one loop through the SIMD layer (the widening is about 7% of a
        // widened bf16 step's time; compiled for the baseline alone it ran on SSE2).
        let widen_run = |buf: &mut Vec<f32>, run: &[E]| {
            crate::vectorized!(|_| buf.extend(run.iter().map(|x| x.to_f32())))
        };
        if self.row_stride == 1 && self.col_stride != 1 {
            // Column-major: each column's run of rows is contiguous.
            for j in cols {
                let start = at(rows.start, j);
                widen_run(buf, &self.data[start..start + r]);
            }
            (1, r)
        } else if self.col_stride == 1 {
            for i in rows {
                let start = at(i, cols.start);
                widen_run(buf, &self.data[start..start + c]);
            }
            (c, 1)
        } else {
            for i in rows {
                buf.extend(cols.clone().map(|j| self.data[at(i, j)].to_f32()));
            }
            (c, 1)
        }
    }
}

impl Operand<'_> {
    /// Widens rows `rows` × columns `cols` of a transposed view (each column's run of rows
    /// contiguous: a table's rows as the logits' columns) into `buf` row by row, in one pass
    /// ([`transpose::columns_into_rows`]): gemm then reads the rows as they are, where from the
    /// columns [`widen`](Operand::widen) lays out its caller would copy them into rows again
    /// ([`crate::host::products::gemm_call`]). Returns the buffer's (row, column) strides.
    fn widen_into_rows(
        &self,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        buf: &mut Vec<f32>,
    ) -> (usize, usize) {
        assert!(
            self.row_stride == 1 && self.fits(rows.end, cols.end),
            "bf16 product: not a transposed view, or out of range"
        );
        let first = rows.start + cols.start * self.col_stride;
        // SAFETY: column `j` of the slice is `rows.len()` adjacent elements from `first + j ·
        // col_stride`, within the data (the operand fits `rows.end × cols.end`, asserted).
        unsafe {
            transpose::columns_into_rows(
                buf,
                self.data.as_ptr().wrapping_add(first),
                (rows.len(), cols.len()),
                self.col_stride,
            )
        };
        (cols.len(), 1)
    }
}

/// One output tile of a product, `a[rows, ..k]·b[..k, cols]`: what a kernel computes at a time.
#[derive(Clone)]
pub struct Tile<'a, A = bf16> {
    /// The left operand, of which the tile takes `rows`.
    pub a: &'a Operand<'a, A>,
    /// The tile's rows.
    pub rows: std::ops::Range<usize>,
    /// The right operand, of which the tile takes `cols`.
    pub b: &'a Operand<'a>,
    /// The tile's columns.
    pub cols: std::ops::Range<usize>,
    /// The inner dimension.
    pub k: usize,
}

/// Where a product's result goes.
pub enum Destination<'a> {
    /// A new `[m, n]` row-major bf16 matrix, rounded once from the f32 sums.
    Bf16(&'a mut [bf16]),
    /// A new `[m, n]` row-major f32 matrix, the sums unrounded (a layer computed in f32 rounds
    /// them where the model rounds: [`linear_of_bf16_values`]).
    F32(&'a mut [f32]),
    /// `dst += a·b` into an `[m, n]` row-major f32 accumulator, unrounded.
    AddF32(&'a mut [f32]),
    /// A new `[m, n]` row-major f32 matrix holding the sums rounded once to bf16: the values of
    /// [`Destination::Bf16`] for a computation that carries them in f32.
    Bf16Values(&'a mut [f32]),
}

impl Destination<'_> {
    fn len(&self) -> usize {
        match self {
            Destination::Bf16(d) => d.len(),
            Destination::F32(d) | Destination::AddF32(d) | Destination::Bf16Values(d) => d.len(),
        }
    }
}

/// How a tile's sums are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// gemm's f32 kernel on the tile's slices widened to f32 (every CPU).
    Widened,
    /// AVX512-BF16's dot products of bf16 pairs on the packed slices ([`crate::host::bf16_kernel`]).
    Bf16Dot,
    /// AMX's tile products on the packed slices ([`crate::host::amx_kernel`]): the choice wherever the
    /// CPU has AMX, whose bf16 step it took in the least time of the three (docs/benchmarks.md, the
    /// AMX sections).
    Amx,
}

/// The switch the binaries read for the bf16 products' kernel, by [`Kernel::name`] (see
/// [`crate::choices`]): to compare them on a CPU whose choice was never measured, or to test
/// one; `amx-emulated` runs AMX's kernel on a software model of its tiles where the CPU has none,
/// to run the tests with AMX's order of sums on any CPU (slowly).
pub const KERNEL_ENV: &str = "STREAMBP_BF16_KERNEL";

impl Kernel {
    /// The name [`KERNEL_ENV`] takes and reports print.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Widened => "widened",
            Kernel::Bf16Dot => "dot",
            Kernel::Amx => "amx",
        }
    }

    /// The name reports print for the kernel in force: [`Kernel::name`], or `amx-emulated` where
    /// AMX's kernel runs on its software model ([`crate::choices::Choices::amx_on_model`]).
    pub fn label(self) -> &'static str {
        match self {
            Kernel::Amx if crate::host::amx_kernel::emulated() => crate::host::amx_kernel::EMULATED,
            kernel => kernel.name(),
        }
    }

    /// The kernel in force: the one chosen ([`crate::choices`]), else the fastest the CPU
    /// has: AMX's tiles where the CPU has them, the dot products where it has those and they were
    /// measured faster ([`crate::host::bf16_kernel::pays`]), the widened f32 products elsewhere.
    pub fn detect() -> Self {
        crate::choices::in_force().bf16_kernel
    }

    /// Every kernel the running CPU can run on the path in force (for tests that check each), AMX's
    /// on its model of the tiles included where that is chosen (`amx-emulated`).
    pub fn available() -> Vec<Self> {
        let in_force = crate::choices::in_force();
        Kernel::on(in_force.simd, in_force.amx_on_model)
    }
}

/// Rows a product needs for the AVX512-BF16 kernel to pay: its micro-kernel works on blocks of 8
/// rows and packs `b` once per tile, so a product of a few rows (a short row's chunk, a decoding
/// step) takes the widened path, whose gemm has kernels for them: at 16 rows the two take about the
/// same time, from 64 rows on the dot products less (docs/benchmarks.md, "Figures the kernels'
/// comments held"). AMX's tiles are 16 rows: fewer would multiply padding.
const MIN_DOT_ROWS: usize = 16;

/// `dst (=|+=) a·b` for `a` `[m, k]` and `b` `[k, n]` in bf16, summed in f32 (see the module doc),
/// by the fastest kernel the CPU has for it ([`Kernel::detect`], [`MIN_DOT_ROWS`]). Panics if an
/// operand's strides reach past its data or the destination is smaller than `[m, n]`.
pub fn product<A: Element>(
    dst: Destination<'_>,
    mnk: (usize, usize, usize),
    a: Operand<A>,
    b: Operand,
) {
    match route(Kernel::detect(), mnk.0, (a.col_stride, b.row_stride)) {
        Route::Skinny => skinny_product(dst, mnk, a, b),
        Route::Tiles(kernel) => product_by(kernel, dst, mnk, a, b),
    }
}

/// Whether a product of `a` (`m × k`) by `b` (`k × n`) into a destination of `dst_len` elements
/// has any output; panics if an operand's strides reach past its data or the destination is
/// smaller than `m × n`.
fn has_output<A: Element>(
    (m, n, k): (usize, usize, usize),
    (a, b): (&Operand<A>, &Operand),
    dst_len: usize,
) -> bool {
    assert!(
        a.fits(m, k) && b.fits(k, n),
        "bf16 product: operand out of range"
    );
    assert!(dst_len >= m * n, "bf16 product: destination too small");
    m * n > 0
}

/// How [`product`] takes a product.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    /// [`crate::host::skinny`]'s dot products.
    Skinny,
    /// Tiles by this kernel.
    Tiles(Kernel),
}

/// The route of a product of `rows` rows of `a` by `b` (their column and row strides) with
/// `kernel` in force: a few rows by a weight stored row by row take [`crate::host::skinny`]; a packing
/// kernel takes at least [`MIN_DOT_ROWS`] rows, the widened kernel the rest.
fn route(kernel: Kernel, rows: usize, (a_col_stride, b_row_stride): (usize, usize)) -> Route {
    if crate::host::skinny::applies(rows, a_col_stride, b_row_stride) {
        return Route::Skinny;
    }
    Route::Tiles(tile_kernel(kernel, rows))
}

/// The kernel that takes a tile of `rows` rows with `kernel` in force: a packing kernel from
/// [`MIN_DOT_ROWS`] rows on, the widened one below.
fn tile_kernel(kernel: Kernel, rows: usize) -> Kernel {
    match kernel {
        Kernel::Bf16Dot | Kernel::Amx if rows < MIN_DOT_ROWS => Kernel::Widened,
        kernel => kernel,
    }
}

/// [`product`] of a few rows by `b = Wᵀ` with each row of `W` contiguous, by
/// [`crate::host::skinny::product`]: `a`'s rows widened to f32 (a few rows: the weight is never widened),
/// the sums rounded once or added into the f32 destination.
fn skinny_product<A: Element>(
    dst: Destination<'_>,
    (m, n, k): (usize, usize, usize),
    a: Operand<A>,
    b: Operand,
) {
    // `b`'s range is `skinny::product`'s to check; `a`'s is read here, to widen it.
    assert!(a.fits(m, k), "bf16 product: operand out of range");
    let mut x = Vec::new();
    // Row by row, as `a`'s columns are contiguous.
    let (x_rs, _) = a.widen(0..m, 0..k, &mut x);
    let (x, w) = ((x.as_slice(), x_rs), (b.data, b.col_stride));
    match dst {
        Destination::Bf16(d) => crate::host::skinny::product((d, n), (m, n, k), false, x, w),
        Destination::F32(d) => crate::host::skinny::product((d, n), (m, n, k), false, x, w),
        Destination::AddF32(d) => crate::host::skinny::product((d, n), (m, n, k), true, x, w),
        Destination::Bf16Values(d) => {
            crate::host::skinny::product((&mut *d, n), (m, n, k), false, x, w);
            crate::vectorized!(|_| d[..m * n].iter_mut().for_each(|y| *y = bf16_value(*y)));
        }
    }
}

/// [`product`] by `kernel` (which must be among [`Kernel::available`]).
pub fn product_by<A: Element>(
    kernel: Kernel,
    mut dst: Destination<'_>,
    (m, n, k): (usize, usize, usize),
    a: Operand<A>,
    b: Operand,
) {
    if !has_output((m, n, k), (&a, &b), dst.len()) {
        return;
    }
    if let (Destination::F32(d) | Destination::Bf16Values(d), 0) = (&mut dst, k) {
        // No kernel sums anything (the widened one would leave the tiles as they are): zeros.
        d[..m * n].fill(0.0);
        return;
    }
    let (tm, tn) = tile_sizes(m, n);
    let tiles = tiles(m, n, (tm, tn));
    // Where the sums go, through a pointer the tasks share (each writes its own tile).
    let sink = match dst {
        Destination::Bf16(d) => Sink::Bf16(SharedDst(d.as_mut_ptr())),
        Destination::F32(d) => Sink::F32(SharedDst(d.as_mut_ptr()), false),
        Destination::AddF32(d) => Sink::F32(SharedDst(d.as_mut_ptr()), true),
        Destination::Bf16Values(d) => Sink::Bf16Values(SharedDst(d.as_mut_ptr())),
    };
    tiles.par_iter().for_each_init(
        || (Scratch::default(), Vec::new()),
        |(scratch, sums), &(i0, j0)| {
            let tile = Tile {
                a: &a,
                rows: i0..(i0 + tm).min(m),
                b: &b,
                cols: j0..(j0 + tn).min(n),
                k,
            };
            let (r, c) = (tile.rows.len(), tile.cols.len());
            if let (Kernel::Widened, Sink::F32(d, add)) = (kernel, sink) {
                // gemm writes (or adds) the tile's sums into the f32 destination itself.
                // SAFETY: tile (i0, j0) is this task's alone; its elements lie within `m × n`.
                let dst = unsafe { d.0.add(i0 * n + j0) };
                return widened_tile(&tile, (dst, n, add), &mut scratch.bufs);
            }
            // Otherwise the sums go into `sums`, then are written or added into an f32
            // destination or rounded into a bf16 one. The kernels write them (not add into
            // zeros: a tile's memset was a pass over its sums per product).
            sums.resize(r * c, 0.0f32);
            sum_tile(kernel, &tile, (sums, false), scratch);
            for (t, sums) in sums.chunks_exact(c).enumerate() {
                // SAFETY: row `i0 + t` of tile (i0, j0) is this task's alone, within `m × n`.
                unsafe { sink.write_row((i0 + t) * n + j0, sums) };
            }
        },
    );
}

/// `dst = sums`, or `dst += sums` (`add`), over `dst`'s elements: how the kernels put a row of
/// f32 sums into their output.
#[inline]
pub(crate) fn put_sums(dst: &mut [f32], sums: &[f32], add: bool) {
    let pairs = dst.iter_mut().zip(sums);
    match add {
        true => pairs.for_each(|(y, &s)| *y += s),
        false => pairs.for_each(|(y, &s)| *y = s),
    }
}

/// Where [`product_by`]'s tasks put their sums: a [`Destination`]'s data, shared.
#[derive(Clone, Copy)]
enum Sink {
    /// Rounded to bf16.
    Bf16(SharedDst<bf16>),
    /// Written, or added (`true`), unrounded.
    F32(SharedDst<f32>, bool),
    /// Rounded to bf16, stored in f32.
    Bf16Values(SharedDst<f32>),
}

impl Sink {
    /// Puts a tile row's `sums` at element `at` of the destination.
    ///
    /// # Safety
    /// `at..at + sums.len()` must lie within the destination and be the caller's alone.
    unsafe fn write_row(self, at: usize, sums: &[f32]) {
        let row = |d: SharedDst<f32>| {
            // SAFETY: the caller's.
            unsafe { std::slice::from_raw_parts_mut(d.0.add(at), sums.len()) }
        };
        match self {
            Sink::F32(d, add) => crate::vectorized!(|_| put_sums(row(d), sums, add)),
            Sink::Bf16Values(d) => crate::vectorized!(|_| row(d)
                .iter_mut()
                .zip(sums)
                .for_each(|(y, &s)| *y = bf16_value(s))),
            Sink::Bf16(d) => {
                // SAFETY: the caller's.
                let row = unsafe { std::slice::from_raw_parts_mut(d.0.add(at), sums.len()) };
                crate::vectorized!(|_| row
                    .iter_mut()
                    .zip(sums)
                    .for_each(|(y, &s)| *y = bf16::from_f32(s)))
            }
        }
    }
}

/// `dst (=|+=) a·b` (`[m, n]` row-major, the f32 sums unrounded) on the calling thread by
/// `kernel`, a packing kernel only from [`MIN_DOT_ROWS`] rows on (as [`product`] routes): for
/// tasks that are themselves the parallelism (the attention kernel's bf16 products), with their
/// buffers in `scratch` from one call to the next.
pub(crate) fn product_here<A: Element>(
    kernel: Kernel,
    (dst, accumulate): (&mut [f32], bool),
    (m, n, k): (usize, usize, usize),
    a: Operand<A>,
    b: Operand,
    scratch: &mut Scratch,
) {
    if !has_output((m, n, k), (&a, &b), dst.len()) {
        return;
    }
    let tile = Tile {
        a: &a,
        rows: 0..m,
        b: &b,
        cols: 0..n,
        k,
    };
    sum_tile(
        tile_kernel(kernel, m),
        &tile,
        (&mut dst[..m * n], accumulate),
        scratch,
    );
}

/// `out (=|+=)` `tile`'s sums by `kernel` (`out` row-major, the tile's columns to a row): the one
/// dispatch of [`product_by`]'s tasks and [`product_here`]. An empty inner dimension, which no
/// kernel sums, writes zeros (or adds nothing).
fn sum_tile<A: Element>(
    kernel: Kernel,
    tile: &Tile<A>,
    (out, accumulate): (&mut [f32], bool),
    scratch: &mut Scratch,
) {
    let cells = tile.rows.len() * tile.cols.len();
    assert!(out.len() >= cells, "bf16 product: tile buffer too small");
    if tile.k == 0 {
        if !accumulate {
            out[..cells].fill(0.0);
        }
        return;
    }
    match kernel {
        Kernel::Widened => {
            let dst = (out.as_mut_ptr(), tile.cols.len(), accumulate);
            widened_tile(tile, dst, &mut scratch.bufs)
        }
        Kernel::Bf16Dot => {
            crate::host::bf16_kernel::tile(tile, &mut scratch.packs.dot, (out, accumulate))
        }
        Kernel::Amx => {
            crate::host::amx_kernel::tile(tile, &mut scratch.packs.amx, (out, accumulate))
        }
    }
}

/// A task's buffers for [`product_here`] and [`product_by`], from one tile to the next.
#[derive(Default)]
pub(crate) struct Scratch {
    bufs: Buffers,
    packs: Packs,
}

/// A task's packing buffers for the kernels that pack bf16 pairs.
#[derive(Default)]
struct Packs {
    dot: crate::host::bf16_kernel::Packs,
    amx: crate::host::amx_kernel::Packs,
}

/// A task's widened slices.
#[derive(Default)]
struct Buffers {
    a: Vec<f32>,
    b: Vec<f32>,
}

/// `dst (=|+=) a[rows, ..k]·b[..k, cols]` for `tile` by gemm's f32 kernel on slices of [`INNER`]
/// inner elements widened into `bufs`; `dst` is `(first element, row stride, whether to add into
/// it)`.
fn widened_tile<A: Element>(
    tile: &Tile<A>,
    (dst, dst_rs, mut read_dst): (*mut f32, usize, bool),
    bufs: &mut Buffers,
) {
    let Tile { a, b, k, .. } = *tile;
    let (rows, cols) = (tile.rows.clone(), tile.cols.clone());
    let (r, c) = (rows.len(), cols.len());
    for k0 in (0..k).step_by(INNER) {
        let inner = k0..(k0 + INNER).min(k);
        // `a`'s slice where it is f32 already (its first element in range: the operand fits
        // `r × k`, and `r` and the slice are not empty), else widened.
        let a_slice = match A::as_f32(a.data) {
            Some(data) => (
                data[rows.start * a.row_stride + k0 * a.col_stride..].as_ptr(),
                a.row_stride,
                a.col_stride,
            ),
            None => {
                let (ars, acs) = a.widen(rows.clone(), inner.clone(), &mut bufs.a);
                (bufs.a.as_ptr(), ars, acs)
            }
        };
        // A transposed view that gemm's caller would copy into rows (one slab: the same gemm
        // call) is widened into rows at once.
        let into_rows = matches!(
            transpose::slab_columns((r, c, inner.len()), (b.row_stride, b.col_stride)),
            Some(slab) if slab >= c
        );
        let (brs, bcs) = match into_rows {
            true => b.widen_into_rows(inner.clone(), cols.clone(), &mut bufs.b),
            false => b.widen(inner.clone(), cols.clone(), &mut bufs.b),
        };
        // SAFETY: `a_slice` addresses `r × inner` elements at its strides (the operand's, which
        // fit it, or those `widen` returned), `bufs.b` holds `inner × c` at the strides its
        // widening returned; the caller's `dst` has room for `r × c` at row stride `dst_rs`, its
        // alone.
        unsafe {
            crate::host::products::gemm_call(
                dst,
                dst_rs,
                (r, c, inner.len()),
                read_dst,
                a_slice,
                (bufs.b.as_ptr(), brs, bcs),
            );
        }
        read_dst = true;
    }
}

/// The operand a 2-D layout (or a contiguous one of any rank, its leading dimensions as rows)
/// addresses in `data`, with its rows and columns.
pub fn operand<'a, E: Element>(
    data: &'a [E],
    l: &Layout,
) -> CResult<(Operand<'a, E>, usize, usize)> {
    let (dims, stride) = (l.dims(), l.stride());
    let (rows, cols, row_stride, col_stride) = match *dims {
        [rows, cols] => (rows, cols, stride[0], stride[1]),
        [.., cols] if l.is_contiguous() => (l.shape().elem_count() / cols.max(1), cols, cols, 1),
        _ => {
            candle_core::bail!("bf16 product: an operand of shape {dims:?} and strides {stride:?}")
        }
    };
    let data = data.get(l.start_offset()..).ok_or_else(|| {
        candle_core::Error::Msg("bf16 product: operand outside its storage".into())
    })?;
    let op = Operand {
        data,
        row_stride,
        col_stride,
    };
    if !op.fits(rows, cols) {
        candle_core::bail!("bf16 product: operand outside its storage");
    }
    Ok((op, rows, cols))
}

/// Runs `check` on each pair of layouts the kernels' tests take: row-major, column-major and a
/// strided view of either operand (`a` `[m, k]` in `a_data`, `b` `[k, n]` in `b_data`, each holding
/// at least twice its elements).
#[cfg(test)]
pub(crate) fn each_layout(
    (m, n, k): (usize, usize, usize),
    (a_data, b_data): (&[bf16], &[bf16]),
    mut check: impl FnMut(Operand, Operand),
) {
    let layouts = |rows: usize, cols: usize| [(cols, 1), (1, rows), (2 * cols, 2)];
    for (row_stride, col_stride) in layouts(m, k) {
        let a = Operand {
            data: a_data,
            row_stride,
            col_stride,
        };
        for (row_stride, col_stride) in layouts(k, n) {
            let b = Operand {
                data: b_data,
                row_stride,
                col_stride,
            };
            check(a, b);
        }
    }
}

/// `x Wᵀ` for bf16 host data: `x` `[.., in]` contiguous, `W` `[out, in]` (any strides); the result
/// `[.., out]`.
pub fn linear(
    x: (&[bf16], &Layout),
    w: (&[bf16], &Layout),
) -> CResult<(Vec<bf16>, candle_core::Shape)> {
    linear_into(x, w, |d| Destination::Bf16(d))
}

/// [`linear`] into a new buffer of `T`, written as `destination` says (bf16, or f32 of bf16
/// values).
pub(crate) fn linear_into<T: Copy + Default>(
    (x, xl): (&[bf16], &Layout),
    (w, wl): (&[bf16], &Layout),
    destination: impl FnOnce(&mut [T]) -> Destination<'_>,
) -> CResult<(Vec<T>, candle_core::Shape)> {
    let ((x_op, n, k), (w_op, out, k2)) = (operand(x, xl)?, operand(w, wl)?);
    if k != k2 || wl.dims().len() != 2 {
        candle_core::bail!("linear: x {:?}, weight {:?}", xl.dims(), wl.dims());
    }
    let mut dst = vec![T::default(); n * out];
    product(destination(&mut dst), (n, out, k), x_op, w_op.transposed());
    Ok((dst, with_last_dim(xl, out)))
}

/// `l`'s shape with its last dimension `last`.
fn with_last_dim(l: &Layout, last: usize) -> candle_core::Shape {
    let mut dims = l.dims().to_vec();
    if let Some(d) = dims.last_mut() {
        *d = last;
    }
    dims.into()
}

/// `x Wᵀ` in f32 for f32 `x` `[.., in]` (contiguous) whose every value bf16 holds and `W` the bf16
/// weight `[out, in]` (any strides): `x` narrowed to bf16, which is then exact, and the product
/// taken by the bf16 kernel in force, its sums unrounded. A bf16 layer computed in f32
/// (`streambp_models`' `DecoderLayer::computed_in_f32`) multiplies such operands in its forward (its
/// activations rounded where bf16 rounds, its weights widened from bf16), so they can run on the
/// CPU's bf16 arithmetic; its backward's products take the gradient rounded to bf16 (as bf16
/// autograd holds it) and run there too ([`crate::ops::matmul::matmul_unrounded`]). `None` where
/// f32's product is the faster way (the kernel in force widens, or `x` has too few rows for it:
/// [`route`]) or where `x` is not contiguous or holds a value bf16 does not.
pub fn linear_of_bf16_values(
    x: (&[f32], &Layout),
    w: (&[bf16], &Layout),
) -> CResult<Option<(Vec<f32>, candle_core::Shape)>> {
    linear_of_bf16_values_by(Kernel::detect(), x, w)
}

/// [`linear_of_bf16_values`] where `kernel` is the one in force.
fn linear_of_bf16_values_by(
    kernel: Kernel,
    (x, xl): (&[f32], &Layout),
    (w, wl): (&[bf16], &Layout),
) -> CResult<Option<(Vec<f32>, candle_core::Shape)>> {
    let (w_op, out, k) = operand(w, wl)?;
    let k_x = xl.dims().last().copied().unwrap_or(0);
    if k_x != k || wl.dims().len() != 2 {
        candle_core::bail!("linear: x {:?}, weight {:?}", xl.dims(), wl.dims());
    }
    if !xl.is_contiguous() {
        return Ok(None);
    }
    let n = xl.dims()[..xl.dims().len().saturating_sub(1)]
        .iter()
        .product();
    let w_t = w_op.transposed();
    // `x`'s columns are contiguous.
    let kernel = match route(kernel, n, (1, w_t.row_stride)) {
        Route::Tiles(kernel) if kernel != Kernel::Widened => kernel,
        _ => return Ok(None),
    };
    let Some(x) = x.get(xl.start_offset()..xl.start_offset() + n * k) else {
        candle_core::bail!("linear: operand outside its storage");
    };
    let Some(x) = crate::host::cast::narrowed_exactly(x) else {
        return Ok(None);
    };
    let x_op = Operand {
        data: &x,
        row_stride: k,
        col_stride: 1,
    };
    let mut dst = vec![0f32; n * out];
    product_by(kernel, Destination::F32(&mut dst), (n, out, k), x_op, w_t);
    Ok(Some((dst, with_last_dim(xl, out))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::bf16_values as values;

    /// `a·b` in f64 from the operands' exact values, with `Σ |a_ip·b_pj|` for each element (what
    /// bounds an f32 sum's rounding error).
    fn exact(m: usize, n: usize, k: usize, a: Operand, b: Operand) -> Vec<(f64, f64)> {
        let at =
            |o: &Operand, i: usize, j: usize| o.data[i * o.row_stride + j * o.col_stride].to_f64();
        (0..m * n)
            .map(|ij| {
                let (i, j) = (ij / n, ij % n);
                let terms = (0..k).map(|p| at(&a, i, p) * at(&b, p, j));
                (terms.clone().sum(), terms.map(f64::abs).sum())
            })
            .collect()
    }

    /// Every layout of either operand (row-major, column-major, a strided view), sizes that do and
    /// do not fill whole tiles (inner dimension across slices, k = 0 included), every destination,
    /// in tiles over the threads and on the calling thread ([`product_here`], written into NaNs
    /// and added): within f32's rounding of f64's sums, the bf16 result rounded once from them.
    #[test]
    fn products_match_f64_in_every_layout() {
        // Every kernel this CPU runs: the widened one always, AVX512-BF16's where it has it.
        println!("bf16 product kernels tested: {:?}", Kernel::available());
        for (m, n, k) in [
            (1, 1, 1),
            (3, 5, 0),
            (70, 300, 513),
            (257, 65, 40),
            (128, 128, 256),
        ] {
            let a_data = values(2 * m * k + 1, 1);
            let b_data = values(2 * k * n + 1, 2);
            each_layout((m, n, k), (&a_data, &b_data), |a, b| {
                let want = exact(m, n, k, a, b);
                // f32 sums of k terms in any order: within a few √k roundings of their
                // magnitudes (a kernel that sums each element in one long chain, as the
                // AVX512-BF16 one does, comes nearer that than gemm's blocked sums).
                let eps = f32::EPSILON as f64;
                let tol =
                    |w: f64, abs: f64| 4.0 * eps * (k as f64).sqrt() * abs + 8.0 * eps * w.abs();
                for kernel in Kernel::available() {
                    let mut acc: Vec<f32> = (0..m * n).map(|i| i as f32).collect();
                    product_by(kernel, Destination::AddF32(&mut acc), (m, n, k), a, b);
                    for (i, (&got, &(w, abs))) in acc.iter().zip(&want).enumerate() {
                        let w = w + i as f64;
                        let err = (got as f64 - w).abs();
                        let tol = tol(w, abs);
                        assert!(err <= tol, "{kernel:?} {m}x{n}x{k} add: {got} vs {w}");
                    }
                    let mut sums = vec![f32::NAN; m * n];
                    product_by(kernel, Destination::F32(&mut sums), (m, n, k), a, b);
                    for (&got, &(w, abs)) in sums.iter().zip(&want) {
                        let err = (got as f64 - w).abs();
                        assert!(
                            err <= tol(w, abs),
                            "{kernel:?} {m}x{n}x{k} f32: {got} vs {w}"
                        );
                    }
                    // On the calling thread (the whole product one tile), written and added.
                    let mut scratch = Scratch::default();
                    let mut here = vec![f32::NAN; m * n];
                    product_here(kernel, (&mut here, false), (m, n, k), a, b, &mut scratch);
                    let start = |i: usize| i as f32;
                    let mut added: Vec<f32> = (0..m * n).map(start).collect();
                    product_here(kernel, (&mut added, true), (m, n, k), a, b, &mut scratch);
                    for (i, &(w, abs)) in want.iter().enumerate() {
                        let tol = tol(w, abs);
                        let (wrote, add) = (here[i] as f64, added[i] as f64 - i as f64);
                        assert!(
                            (wrote - w).abs() <= tol,
                            "{kernel:?} {m}x{n}x{k} here: {wrote}"
                        );
                        let tol = tol + 8.0 * eps * i as f64;
                        assert!((add - w).abs() <= tol, "{kernel:?} {m}x{n}x{k} here, added");
                    }
                    let mut out = vec![bf16::ZERO; m * n];
                    product_by(kernel, Destination::Bf16(&mut out), (m, n, k), a, b);
                    for (&got, &(w, abs)) in out.iter().zip(&want) {
                        let rounded = bf16::from_f64(w).to_f64();
                        let ulp = w.abs() * 2f64.powi(-7);
                        let err = (got.to_f64() - rounded).abs();
                        let tol = ulp + tol(w, abs);
                        assert!(err <= tol, "{kernel:?} {m}x{n}x{k}: {got} vs {w}");
                    }
                }
            });
        }
    }

    /// An f32 operand holding bf16 values multiplies as those bf16 do, in every layout of either
    /// operand and into every destination: bit for bit on the kernels that pack it as bf16, within
    /// f32's rounding of the exact sums on the widened one (which reads it in place, and gemm's
    /// order of summation depends on the layout); [`Destination::Bf16Values`] holds the
    /// [`Destination::Bf16`] result's values.
    #[test]
    fn bf16_values_in_f32_multiply_as_their_bf16() {
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (m, n, k) in [(70, 300, 513), (257, 65, 40), (20, 33, 7)] {
            let a16 = values(2 * m * k + 1, 5);
            let a32: Vec<f32> = a16.iter().map(|v| v.to_f32()).collect();
            let b_data = values(2 * k * n + 1, 6);
            each_layout((m, n, k), (&a16, &b_data), |a, b| {
                let a_values = Operand {
                    data: a32.as_slice(),
                    row_stride: a.row_stride,
                    col_stride: a.col_stride,
                };
                let exact = exact(m, n, k, a, b);
                let strides = (a.row_stride, a.col_stride, b.row_stride, b.col_stride);
                for kernel in Kernel::available() {
                    let case = format!("{kernel:?} {m}x{n}x{k}, strides {strides:?}");
                    let same = |got: &[f32], want: &[f32], what: &str| match kernel {
                        Kernel::Widened => {
                            // Each within f32's rounding of the exact sum (plus what `want` held).
                            let eps = f32::EPSILON as f64;
                            for ((&g, &w), &(_, abs)) in got.iter().zip(want).zip(&exact) {
                                let (g, w) = (g as f64, w as f64);
                                let tol = 4.0 * eps * (k as f64).sqrt() * abs + 8.0 * eps * w.abs();
                                assert!((g - w).abs() <= 2.0 * tol, "{case}: {what}");
                            }
                        }
                        _ => assert!(bits(got) == bits(want), "{case}: {what}"),
                    };
                    let start: Vec<f32> = (0..m * n).map(|i| i as f32).collect();
                    let (mut want, mut got) = (start.clone(), start);
                    product_by(kernel, Destination::AddF32(&mut want), (m, n, k), a, b);
                    product_by(
                        kernel,
                        Destination::AddF32(&mut got),
                        (m, n, k),
                        a_values,
                        b,
                    );
                    same(&got, &want, "added");
                    product_by(kernel, Destination::F32(&mut want), (m, n, k), a, b);
                    product_by(kernel, Destination::F32(&mut got), (m, n, k), a_values, b);
                    same(&got, &want, "f32");
                    let mut rounded = vec![bf16::ZERO; m * n];
                    product_by(kernel, Destination::Bf16(&mut rounded), (m, n, k), a, b);
                    let mut from_values = vec![bf16::ZERO; m * n];
                    let dst = Destination::Bf16(&mut from_values);
                    product_by(kernel, dst, (m, n, k), a_values, b);
                    if kernel != Kernel::Widened {
                        assert!(from_values == rounded, "{case}: bf16");
                    }
                    product_by(kernel, Destination::Bf16Values(&mut got), (m, n, k), a, b);
                    let widened: Vec<f32> = rounded.iter().map(|v| v.to_f32()).collect();
                    assert!(bits(&got) == bits(&widened), "{case}: values");
                }
            });
        }
    }

    /// f32 inputs holding bf16 values (read from an offset, after values bf16 does not hold) by a
    /// bf16 weight, with leading dimensions and in either layout of the weight: with each kernel
    /// that packs bf16 pairs, f32 sums within f32's rounding of the exact ones that, rounded, are
    /// the same kernel's bf16 product bit for bit (and [`linear`]'s, for the kernel in force); by
    /// f32's product (`None`) under the widened kernel, for rows too few for the packing kernels
    /// or few enough for `skinny` (by a row-major weight), and for an input holding a value bf16
    /// does not.
    #[test]
    fn bf16_values_take_the_packing_kernels() {
        let (rows, out, k, offset) = (70, 100, 300, 5);
        let x16 = values(rows * k, 3);
        let not_bf16 = 1.0 + f32::EPSILON;
        let mut x = vec![not_bf16; offset];
        x.extend(x16.iter().map(|v| v.to_f32()));
        let x_at = |dims: &[usize]| Layout::contiguous_with_offset(dims, offset);
        let w16 = values(out * k, 4);
        // The weight `[out, k]` row-major, and the transpose of a `[k, out]` row-major matrix.
        let w_t16: Vec<bf16> = (0..k * out).map(|i| w16[(i % out) * k + i / out]).collect();
        let weights = [
            (w16.as_slice(), Layout::contiguous((out, k)), true),
            (
                w_t16.as_slice(),
                Layout::contiguous((k, out)).transpose(0, 1).unwrap(),
                false,
            ),
        ];
        let x_layout = x_at(&[2, rows / 2, k]);
        for kernel in Kernel::available() {
            for (w, w_layout, row_major) in &weights {
                let got = linear_of_bf16_values_by(kernel, (&x, &x_layout), (w, w_layout));
                let got = got.unwrap();
                if kernel == Kernel::Widened {
                    assert!(
                        got.is_none(),
                        "the widened kernel widens back: f32's product"
                    );
                    continue;
                }
                let (sums, got_shape) = got.expect("bf16 values by a packing kernel");
                assert_eq!(got_shape.dims(), &[2, rows / 2, out]);
                let x_op = operand(&x16, &Layout::contiguous((rows, k))).unwrap().0;
                let w_op = operand(w, w_layout).unwrap().0.transposed();
                let mut rounded = vec![bf16::ZERO; rows * out];
                product_by(
                    kernel,
                    Destination::Bf16(&mut rounded),
                    (rows, out, k),
                    x_op,
                    w_op,
                );
                let same = |other: &[bf16]| {
                    let mut pairs = sums.iter().zip(other);
                    pairs.all(|(s, r)| bf16::from_f32(*s).to_bits() == r.to_bits())
                };
                assert!(same(&rounded), "{kernel:?}: not its bf16 product's bits");
                if Kernel::detect() == kernel {
                    let (linear, _) =
                        linear((&x16, &Layout::contiguous((2, rows / 2, k))), (w, w_layout))
                            .unwrap();
                    assert!(same(&linear), "{kernel:?}: not `linear`'s bits");
                }
                let eps = f32::EPSILON as f64;
                for (&got, &(w, abs)) in sums.iter().zip(&exact(rows, out, k, x_op, w_op)) {
                    let tol = 4.0 * eps * (k as f64).sqrt() * abs + 8.0 * eps * w.abs();
                    assert!((got as f64 - w).abs() <= tol, "{kernel:?}: {got} vs {w}");
                }
                let max_skinny = crate::host::skinny::MAX_ROWS;
                for few in [MIN_DOT_ROWS - 1, MIN_DOT_ROWS, max_skinny, max_skinny + 1] {
                    let taken = few >= MIN_DOT_ROWS && !(*row_major && few <= max_skinny);
                    let x_few = (&x[..offset + few * k], &x_at(&[few, k]));
                    let got = linear_of_bf16_values_by(kernel, x_few, (w, w_layout)).unwrap();
                    assert_eq!(got.is_some(), taken, "{kernel:?}, {few} rows");
                }
                let mut off = x.clone();
                off[offset + rows * k - 1] = not_bf16;
                let off_values = linear_of_bf16_values_by(kernel, (&off, &x_layout), (w, w_layout));
                assert!(off_values.unwrap().is_none(), "{kernel:?}: not bf16 values");
            }
        }
    }
}
