//! The attention op's forward and backward on the CPU as one kernel, a task per head and block.
//!
//! Built from tensor ops, each key block of the op is a dozen ops: two or five products, each split
//! over every core, and the online softmax's rescaling as whole-tensor passes with a fork and a join
//! each, on buffers allocated and freed per block.
//! Here the forward's task is a tile of one key/value head's query rows, from the first key block to
//! the last: its scores for a block land in a buffer the task reuses, the softmax runs on each row
//! while it is in cache, and `out += P·V` adds straight into the output. The backward's task is one
//! head's queries against one key block: it adds the block's `dK`, `dV` into their rows (no other task
//! touches them) and returns its share of `dQ`, summed over the blocks in order afterwards. Every
//! product is one single-threaded call (the tasks are the parallelism): gemm's (the kernel candle's
//! products run), or for a bf16 layer the bf16 kernel in force on operands rounded as PyTorch's bf16
//! attention rounds them ([`Multiply::Bf16`]). The arithmetic is the composed path's
//! (`attention.rs`), step for step; only sums round apart, and none depends on the thread count.
//!
//! Shapes as in [`super`]: q `[b, kv_heads, rows, hd]` with `rows = group·c` (query heads of a
//! group one after the other, `c` queries each); keys and values `[b, kv_heads, t, hd]`; each block's
//! mask `[1 | b, 1, 1, c, n]`.

use num_traits::Float;
use rayon::prelude::*;

use crate::host::exp::BulkExp;
use crate::host::half_product::{self, Kernel, Operand};
use crate::host::products::{gemm_into, Threads};
use crate::host::reduce::row_max;
use crate::vectorized;
use candle_core::WithDType;
use half::bf16;

type CResult<T> = candle_core::Result<T>;

/// Sizes shared by every task.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    /// `b · kv_heads`: the tasks.
    pub items: usize,
    /// Key/value heads (a task's batch row is `item / kv_heads`).
    pub kv_heads: usize,
    /// Query rows per task: `group · c`.
    pub rows: usize,
    /// Queries per head.
    pub c: usize,
    /// Head width.
    pub hd: usize,
}

/// One block of keys, with its mask's data (none: every query reads every key).
pub struct KeyBlock<T> {
    /// The keys come from the earlier keys (else the op's own).
    pub earlier: bool,
    /// First key of the block in its source.
    pub start: usize,
    /// Keys in the block.
    pub n: usize,
    /// The additive mask `[1 | b, c, n]` and whether it has a row per batch row.
    pub mask: Option<(Vec<T>, bool)>,
}

/// Keys and values `[b, kv_heads, len, hd]`, each head's rows contiguous.
#[derive(Clone, Copy)]
pub struct KeysValues<'a, T> {
    /// The keys.
    pub keys: HeadRows<'a, T>,
    /// The values, laid out as the keys.
    pub values: HeadRows<'a, T>,
}

/// A `[b, heads, len, hd]` tensor's elements from its first, with the strides of its batch rows and
/// heads: a view narrowed along the sequence (a chunk's keys) is read in place, not copied.
#[derive(Clone, Copy)]
pub struct HeadRows<'a, T> {
    /// The elements, from the first row of the first batch row's first head.
    pub data: &'a [T],
    /// Elements from one batch row to the next.
    pub batch_stride: usize,
    /// Elements from one head to the next.
    pub head_stride: usize,
}

impl<T> HeadRows<'_, T> {
    /// `n` elements of item `i` (of `kv_heads` heads per batch row) from element `at` of its rows.
    fn slice(&self, i: usize, kv_heads: usize, at: usize, n: usize) -> &[T] {
        let start = (i / kv_heads) * self.batch_stride + (i % kv_heads) * self.head_stride + at;
        &self.data[start..start + n]
    }
}

/// What the forward and the backward read: queries in the compute type `T`, keys and values in `K`
/// (`T` itself, or bf16 for an f32 forward: see [`Stored`]).
pub struct Inputs<'a, T, K = T> {
    /// The shapes.
    pub dims: Dims,
    /// `[items, rows, hd]`, scaled.
    pub q: &'a [T],
    /// The op's own keys and values.
    pub own: KeysValues<'a, K>,
    /// Keys and values before the op's own, if any.
    pub earlier: Option<KeysValues<'a, K>>,
    /// How the products multiply.
    pub multiply: Multiply,
}

/// How the kernel multiplies matrices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Multiply {
    /// In `T`, by gemm; q comes scaled.
    Exact,
    /// As PyTorch's bf16 attention on the CPU: each operand rounded to bf16 (q, the keys and the
    /// values hold bf16 values already; the exponentials, the output gradient and `dS` are rounded
    /// here), multiplied by `kernel`, summed in f32; q comes unscaled, and the sums of the
    /// products it is a factor of (`Q·Kᵀ`, `dS·K`, `dSᵀ·Q`) are multiplied by `scale`.
    Bf16 {
        /// The bf16 products' kernel.
        kernel: Kernel,
        /// The softmax's scale, applied to the sums.
        scale: f32,
    },
}

/// The kernel's element types: f32 and f64.
pub trait KernelFloat: WithDType + BulkExp + Bf16Operand {}

impl<T: WithDType + BulkExp + Bf16Operand> KernelFloat for T {}

/// What [`Multiply::Bf16`] needs of the kernel's element type: f32's, which it runs on (f64's
/// exist for the generic kernel; `Blocks::bf16_products` never chooses them for f64).
pub trait Bf16Operand: Copy {
    /// The elements rounded to the nearest bf16, into `out` (cleared first).
    fn rounded_into(xs: &[Self], out: &mut Vec<bf16>);
    /// The value of the nearest bf16.
    fn bf16_value(self) -> Self;
    /// An f32 sum as `Self`.
    fn from_sum(x: f32) -> Self;
    /// The elements as f32, where they are: the products then write their sums in place.
    fn as_sums(xs: &mut [Self]) -> Option<&mut [f32]>;
    /// The elements as f32, where they are: the widened kernel's products then read them in place.
    fn as_f32(xs: &[Self]) -> Option<&[f32]>;
}

impl Bf16Operand for f32 {
    fn rounded_into(xs: &[f32], out: &mut Vec<bf16>) {
        out.clear();
        vectorized!(|_| out.extend(xs.iter().map(|&x| bf16::from_f32(x))));
    }
    fn bf16_value(self) -> f32 {
        crate::host::cast::bf16_value(self)
    }
    fn from_sum(x: f32) -> f32 {
        x
    }
    fn as_sums(xs: &mut [f32]) -> Option<&mut [f32]> {
        Some(xs)
    }
    fn as_f32(xs: &[f32]) -> Option<&[f32]> {
        Some(xs)
    }
}

impl Bf16Operand for f64 {
    fn rounded_into(xs: &[f64], out: &mut Vec<bf16>) {
        out.clear();
        out.extend(xs.iter().map(|&x| bf16::from_f64(x)));
    }
    fn bf16_value(self) -> f64 {
        bf16::from_f64(self).to_f64()
    }
    fn from_sum(x: f32) -> f64 {
        f64::from(x)
    }
    fn as_sums(_: &mut [f64]) -> Option<&mut [f32]> {
        None
    }
    fn as_f32(_: &[f64]) -> Option<&[f32]> {
        None
    }
}

/// The elements a `rows × cols` operand at strides `(row, column)` spans from its first.
fn extent(rows: usize, cols: usize, (rs, cs): (usize, usize)) -> usize {
    match rows * cols {
        0 => 0,
        _ => (rows - 1) * rs + (cols - 1) * cs + 1,
    }
}

/// A product's operand: its data from its first element, its row and column strides.
type Matrix<'a, T> = (&'a [T], usize, usize);

/// A bf16 product's operand's values: bf16 values already (q, the keys and values, `dS` rounded
/// where it is made, the widened kernel's forward exponentials), or values the product rounds
/// (the exponentials otherwise, and the output gradient).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Values {
    Bf16,
    Rounded,
}

/// Both operands hold bf16 values.
const BF16_VALUES: (Values, Values) = (Values::Bf16, Values::Bf16);

/// A task's products, as [`Multiply`] says, with the buffers they reuse.
struct Products {
    multiply: Multiply,
    a: Vec<bf16>,
    b: Vec<bf16>,
    a32: Vec<f32>,
    b32: Vec<f32>,
    sums: Vec<f32>,
    scratch: half_product::Scratch,
}

impl Products {
    fn new(multiply: Multiply) -> Self {
        Self {
            multiply,
            a: Vec::new(),
            b: Vec::new(),
            a32: Vec::new(),
            b32: Vec::new(),
            sums: Vec::new(),
            scratch: half_product::Scratch::default(),
        }
    }

    /// Frees the buffers (the next product makes them again, as large as it needs).
    fn release(&mut self) {
        *self = Self::new(self.multiply);
    }

    /// `dst (=|+=) a·b` on this thread, each operand as `(data from its first element, row stride,
    /// column stride)` and, for bf16 products, whether its values are rounded first; `with_q`: q
    /// is a factor of the product, or of the gradient it is a share of (bf16 products then scale
    /// their sums).
    fn product<T: WithDType + Bf16Operand>(
        &mut self,
        dst: &mut [T],
        (m, n, k): (usize, usize, usize),
        accumulate: bool,
        (a, b): (Matrix<T>, Matrix<T>),
        values: (Values, Values),
        with_q: bool,
    ) {
        let Multiply::Bf16 { kernel, scale } = self.multiply else {
            return gemm_into(dst, (m, n, k), accumulate, a, b, Threads::One);
        };
        let factor = if with_q { scale } else { 1.0 };
        let Self {
            a: a16,
            b: b16,
            a32,
            b32,
            sums,
            scratch,
            ..
        } = self;
        // `out (=|+=) a·b` in f32 sums.
        let mut multiply = |out: &mut [f32], add: bool| {
            let operands = (T::as_f32(a.0), T::as_f32(b.0));
            if let (Kernel::Widened, (Some(a_data), Some(b_data))) = (kernel, operands) {
                // Products of bf16 values in f32 are exact: the widened kernel's products are
                // f32's of the rounded values, which gemm reads in place or from f32 copies
                // (widening bf16 copies instead would take a pass more).
                let a_data = values_for_f32(a_data, extent(m, k, (a.1, a.2)), values.0, a32);
                let b_data = values_for_f32(b_data, extent(k, n, (b.1, b.2)), values.1, b32);
                return gemm_into(
                    out,
                    (m, n, k),
                    add,
                    (a_data, a.1, a.2),
                    (b_data, b.1, b.2),
                    Threads::One,
                );
            }
            // Rounded into a copy by a vectorized pass, then packed (rounding as it packs would run
            // on the packs' plain loops, which are slower).
            T::rounded_into(&a.0[..extent(m, k, (a.1, a.2))], a16);
            T::rounded_into(&b.0[..extent(k, n, (b.1, b.2))], b16);
            let (a, b) = (operand(a16, (a.1, a.2)), operand(b16, (b.1, b.2)));
            half_product::product_here(kernel, (out, add), (m, n, k), a, b, scratch);
        };
        let dst = &mut dst[..m * n];
        // f32 takes the sums in place, scaled after, unless they are scaled and added.
        if !accumulate || factor == 1.0 {
            if let Some(out) = T::as_sums(dst) {
                multiply(out, accumulate);
                if factor != 1.0 {
                    vectorized!(|_| out.iter_mut().for_each(|y| *y *= factor));
                }
                return;
            }
        }
        sums.resize(m * n, 0.0);
        multiply(sums, false);
        vectorized!(|_| {
            for (d, &s) in dst.iter_mut().zip(sums.iter()) {
                let s = T::from_sum(factor * s);
                *d = if accumulate { *d + s } else { s };
            }
        });
    }
}

/// A bf16 operand from its data and its row and column strides.
fn operand(data: &[bf16], (row_stride, col_stride): (usize, usize)) -> Operand<'_> {
    Operand {
        data,
        row_stride,
        col_stride,
    }
}

/// The first `len` elements of an f32 operand as bf16 values: in place where they are, else
/// rounded into `copy`.
fn values_for_f32<'a>(
    data: &'a [f32],
    len: usize,
    values: Values,
    copy: &'a mut Vec<f32>,
) -> &'a [f32] {
    let data = &data[..len];
    match values {
        Values::Bf16 => data,
        Values::Rounded => {
            copy.clear();
            vectorized!(|_| copy.extend(data.iter().map(|&x| crate::host::cast::bf16_value(x))));
            copy
        }
    }
}

/// An element keys and values are stored in, for a kernel computing in `T`: `T` itself, read in
/// place, or bf16 for f32, widened a key block at a time into the task's buffer (a decoding step's
/// bf16 cache is read as it is, not widened whole at every step).
pub trait Stored<T>: Copy + Send + Sync {
    /// `src` in `T`: itself, or widened into `buffer`.
    fn in_compute_type<'s>(src: &'s [Self], buffer: &'s mut Vec<T>) -> &'s [T];
}

impl<T: Copy + Send + Sync> Stored<T> for T {
    fn in_compute_type<'s>(src: &'s [T], _: &'s mut Vec<T>) -> &'s [T] {
        src
    }
}

impl Stored<f32> for half::bf16 {
    fn in_compute_type<'s>(src: &'s [Self], buffer: &'s mut Vec<f32>) -> &'s [f32] {
        buffer.clear();
        buffer.extend(src.iter().map(|&x| crate::host::cast::widen(x)));
        buffer
    }
}

/// The key blocks, made (their masks built) a wave at a time: `count` of them, block `k` from
/// `fetch(k)`.
pub struct Blocks<'f, T> {
    /// How many blocks there are.
    pub count: usize,
    /// Block `k`, made when its wave is.
    pub fetch: &'f (dyn Fn(usize) -> CResult<KeyBlock<T>> + Sync),
}

/// Tasks of each of `items` items that keep every thread busy: at least one.
fn tasks_per_item(items: usize) -> usize {
    rayon::current_num_threads().div_ceil(items.max(1)).max(1)
}

impl<T> Blocks<'_, T> {
    /// The blocks in waves of as many as keep the threads busy given `items` tasks per block (one
    /// block where there are as many items as threads), so that only a wave's masks (`c × key
    /// block` each) and, in the backward, its `dQ` shares exist at once.
    fn waves(&self, items: usize) -> impl Iterator<Item = CResult<Vec<KeyBlock<T>>>> + '_ {
        let wave = tasks_per_item(items);
        (0..self.count).step_by(wave).map(move |first| {
            (first..(first + wave).min(self.count))
                .map(self.fetch)
                .collect()
        })
    }
}

impl<T: KernelFloat, K> Inputs<'_, T, K> {
    /// Item `i`'s keys and values of block `blk` (`[n, hd]` each).
    fn keys_values(&self, i: usize, blk: &KeyBlock<T>) -> (&[K], &[K]) {
        let src = match (&self.earlier, blk.earlier) {
            (Some(e), true) => e,
            _ => &self.own,
        };
        let (hd, kv_heads) = (self.dims.hd, self.dims.kv_heads);
        let (at, n) = (blk.start * hd, blk.n * hd);
        (
            src.keys.slice(i, kv_heads, at, n),
            src.values.slice(i, kv_heads, at, n),
        )
    }

    /// Item `i`'s query rows.
    fn queries(&self, i: usize) -> &[T] {
        let len = self.dims.rows * self.dims.hd;
        &self.q[i * len..(i + 1) * len]
    }

    /// Scores of item `i`'s query rows `first..first + s.len() / n` against block `blk`, mask
    /// added, into `s` (`[rows, n]`).
    fn masked_scores(
        &self,
        (i, first): (usize, usize),
        (blk, keys): (&KeyBlock<T>, &[T]),
        s: &mut [T],
        products: &mut Products,
    ) {
        let Dims { hd, c, .. } = self.dims;
        let n = blk.n;
        let rows = s.len() / n;
        let q = &self.queries(i)[first * hd..(first + rows) * hd];
        // S = Q·Kᵀ: Kᵀ read through K's strides.
        let (q, keys) = ((q, hd, 1), (keys, 1, hd));
        products.product(s, (rows, n, hd), false, (q, keys), BF16_VALUES, true);
        if let Some((mask, per_batch)) = &blk.mask {
            let base = if *per_batch {
                (i / self.dims.kv_heads) * c * n
            } else {
                0
            };
            for (j, row) in s.chunks_exact_mut(n).enumerate() {
                let bias = &mask[base + ((first + j) % c) * n..][..n];
                for (x, &b) in row.iter_mut().zip(bias) {
                    *x += b;
                }
            }
        }
    }
}

/// What the forward returns: the output (`[items, rows, hd]`) and each row's softmax maximum and
/// log-sum (`[items, rows]`).
pub struct Forward<T> {
    /// The attention's output.
    pub out: Vec<T>,
    /// Each row's largest score.
    pub max: Vec<T>,
    /// Each row's `log Σ exp(score − max)`.
    pub log_sum: Vec<T>,
}

/// Query rows per task of the forward at most: a tile's scores against a key block (256 × 512 in
/// f32: 512 KiB) stay in the core's cache between the product, the softmax and the next product.
pub const MAX_ROW_TILE: usize = 256;

/// Query rows per task of the forward for `items` items of `rows` rows: as many as leave every
/// thread a task (a tile of each item per thread where there are fewer items than threads), at
/// most [`MAX_ROW_TILE`]. Each task copies each key block it reads into rows for its product
/// (`crate::host::transpose`), so fewer, taller tiles copy less, as long as every thread still has a
/// task (docs/benchmarks.md, "Figures the kernels' comments held").
fn row_tile(rows: usize, items: usize) -> usize {
    let tiles = rows.div_ceil(MAX_ROW_TILE).max(tasks_per_item(items));
    rows.div_ceil(tiles).max(1)
}

/// The online softmax over the key blocks, per tile of query rows: for each block the scores, each
/// row's new maximum, its exponentials and their sum, the running sum and output rescaled, then
/// `out += P·V`; the output divided by the sums at the end.
pub fn forward<T: KernelFloat, K: Stored<T>>(
    inp: &Inputs<'_, T, K>,
    blocks: Blocks<'_, T>,
) -> CResult<Forward<T>> {
    let Dims {
        items, rows, hd, ..
    } = inp.dims;
    let mut out = vec![T::zero(); items * rows * hd];
    let mut max = vec![T::neg_infinity(); items * rows];
    let mut sum = vec![T::zero(); items * rows];
    let tile_rows = row_tile(rows, items);
    for wave in blocks.waves(items) {
        let wave = wave?;
        out.par_chunks_mut(rows * hd)
            .zip(max.par_chunks_mut(rows))
            .zip(sum.par_chunks_mut(rows))
            .enumerate()
            .for_each(|(i, ((out, max), sum))| {
                out.par_chunks_mut(tile_rows * hd)
                    .zip(max.par_chunks_mut(tile_rows))
                    .zip(sum.par_chunks_mut(tile_rows))
                    .enumerate()
                    .for_each(|(tile, ((out, max), sum))| {
                        forward_tile(inp, (i, tile * tile_rows), &wave, out, max, sum)
                    });
            });
    }
    out.par_chunks_mut(hd)
        .zip(sum.par_iter())
        .for_each(|(row, &l)| row.iter_mut().for_each(|o| *o /= l));
    let log_sum = sum.into_iter().map(Float::ln).collect();
    Ok(Forward { out, max, log_sum })
}

/// [`forward`]'s running softmax for item `i`'s query rows from `first` (as many as `max` has)
/// through the key blocks `wave`.
fn forward_tile<T: KernelFloat, K: Stored<T>>(
    inp: &Inputs<'_, T, K>,
    (i, first): (usize, usize),
    wave: &[KeyBlock<T>],
    out: &mut [T],
    max: &mut [T],
    sum: &mut [T],
) {
    let (rows, hd) = (max.len(), inp.dims.hd);
    let widest = wave.iter().map(|b| b.n).max().unwrap_or(0);
    let mut scores = vec![T::zero(); rows * widest];
    let (mut key_buffer, mut value_buffer) = (Vec::new(), Vec::new());
    let mut products = Products::new(inp.multiply);
    // bf16 products take the exponentials rounded, their sum taken first: in place where the
    // product then reads them in place (the widened kernel; an extra pass for the packing kernels,
    // which round while copying them).
    let in_place = matches!(
        inp.multiply,
        Multiply::Bf16 {
            kernel: Kernel::Widened,
            ..
        }
    );
    let exponentials = match in_place {
        true => Values::Bf16,
        false => Values::Rounded,
    };
    for blk in wave {
        let n = blk.n;
        let (keys, values) = inp.keys_values(i, blk);
        let keys = K::in_compute_type(keys, &mut key_buffer);
        let values = K::in_compute_type(values, &mut value_buffer);
        let s = &mut scores[..rows * n];
        inp.masked_scores((i, first), (blk, keys), s, &mut products);
        vectorized!(|_| {
            for (j, row) in s.chunks_exact_mut(n).enumerate() {
                let before = max[j];
                let m = row_max(row, before);
                let total = T::exp_shifted_sum(row, m);
                if in_place {
                    row.iter_mut().for_each(|x| *x = x.bf16_value());
                }
                // exp(−∞) = 0 at the first block: nothing before to rescale.
                let rescale = (before - m).exp();
                sum[j] = sum[j] * rescale + total;
                for o in &mut out[j * hd..(j + 1) * hd] {
                    *o *= rescale;
                }
                max[j] = m;
            }
        });
        let (p, values) = ((&s[..], n, 1), (values, hd, 1));
        let rounds = (exponentials, Values::Bf16);
        products.product(out, (rows, hd, n), true, (p, values), rounds, false);
    }
}

/// Where the backward adds each key block's gradients: `[items, len, hd]` buffers, the earlier keys'
/// from index `offset`.
pub struct KeyGrads<'a, T> {
    /// The keys' gradient.
    pub keys: &'a mut [T],
    /// The values' gradient.
    pub values: &'a mut [T],
    /// Keys per item in these buffers.
    pub len: usize,
    /// The buffers' first key in the earlier keys' numbering.
    pub offset: usize,
}

/// The gradients the backward adds into (each zero or holding what came before): `dq`
/// (`[items, rows, hd]`), the op's own keys' and values', and the earlier keys' (when there are any).
pub struct Grads<'a, T> {
    /// The queries' gradient.
    pub dq: &'a mut [T],
    /// The op's own keys' and values'.
    pub own: KeyGrads<'a, T>,
    /// The earlier keys' and values', where there are any.
    pub earlier: Option<KeyGrads<'a, T>>,
}

/// Raw parts of a [`KeyGrads`], handed to the tasks (each writes only its own item's rows).
#[derive(Clone, Copy)]
struct SharedGrads<T> {
    keys: *mut T,
    values: *mut T,
    len: usize,
    offset: usize,
    total: usize,
}

// SAFETY: the pointers are only dereferenced for one item's disjoint rows per task.
unsafe impl<T: Send> Send for SharedGrads<T> {}
// SAFETY: as for Send: tasks sharing it each reach only their own item's rows.
unsafe impl<T: Send> Sync for SharedGrads<T> {}

impl<T> SharedGrads<T> {
    fn new(g: &mut KeyGrads<'_, T>) -> Self {
        Self {
            keys: g.keys.as_mut_ptr(),
            values: g.values.as_mut_ptr(),
            len: g.len,
            offset: g.offset,
            total: g.keys.len().min(g.values.len()),
        }
    }

    /// Item `i`'s key and value gradient rows `start..start + n` (`[n, hd]` each).
    ///
    /// # Safety
    /// No other live reference may cover item `i`'s rows (each task takes only its own item).
    unsafe fn rows<'a>(
        &self,
        i: usize,
        start: usize,
        n: usize,
        hd: usize,
    ) -> (&'a mut [T], &'a mut [T]) {
        assert!(
            self.offset + start + n <= self.len,
            "attention kernel: keys beyond their gradient buffer"
        );
        let at = (i * self.len + self.offset + start) * hd;
        assert!(
            at + n * hd <= self.total,
            "attention kernel: gradient out of range"
        );
        // SAFETY: both ranges lie within the buffers (checked above), and the caller guarantees no
        // other reference covers them.
        unsafe {
            (
                std::slice::from_raw_parts_mut(self.keys.add(at), n * hd),
                std::slice::from_raw_parts_mut(self.values.add(at), n * hd),
            )
        }
    }
}

/// Per item and key block (one task each), with `P` recomputed from the normalizer: `dP = g·Vᵀ`,
/// `dS = P ⊙ (dP − Σ g ⊙ out)`, `dV = Pᵀ·g` and `dK = dSᵀ·Q` added into the block's rows (which no
/// other task touches), and the block's share `dS·K` of `dQ`, added into `dQ` in block order once a
/// wave's tasks are done.
pub fn backward<T: KernelFloat>(
    inp: &Inputs<'_, T>,
    blocks: Blocks<'_, T>,
    fwd: (&[T], &[T], &[T]),
    grad: &[T],
    grads: Grads<'_, T>,
) -> CResult<()> {
    let (out, max, log_sum) = fwd;
    let Dims {
        items, rows, hd, ..
    } = inp.dims;
    let Grads {
        dq,
        mut own,
        mut earlier,
    } = grads;
    let own = SharedGrads::new(&mut own);
    let earlier = earlier.as_mut().map(SharedGrads::new);
    // Σ g ⊙ out per query row (of their bf16 values for bf16 products, as PyTorch's bf16 output
    // and gradient).
    let value = |x: T| match inp.multiply {
        Multiply::Exact => x,
        Multiply::Bf16 { .. } => x.bf16_value(),
    };
    let dot: Vec<T> = grad
        .par_chunks_exact(hd)
        .zip(out.par_chunks_exact(hd))
        .map(|(g, o)| {
            g.iter()
                .zip(o)
                .fold(T::zero(), |acc, (&g, &o)| acc + value(g) * value(o))
        })
        .collect();
    for wave in blocks.waves(items) {
        let wave = wave?;
        let n_blocks = wave.len();
        let shares: Vec<Vec<T>> = (0..items * n_blocks)
            .into_par_iter()
            .map(|task| {
                let (i, blk) = (task / n_blocks, &wave[task % n_blocks]);
                let target = match (&earlier, blk.earlier) {
                    (Some(e), true) => e,
                    _ => &own,
                };
                // SAFETY: this task alone touches block `blk`'s rows of item i.
                let (dk, dv) = unsafe { target.rows(i, blk.start, blk.n, hd) };
                let span = i * rows..(i + 1) * rows;
                let per_row = (&max[span.clone()], &log_sum[span.clone()], &dot[span]);
                let g = &grad[i * rows * hd..(i + 1) * rows * hd];
                block_backward(inp, (i, blk), per_row, g, (dk, dv))
            })
            .collect();
        dq.par_chunks_mut(rows * hd)
            .zip(shares.par_chunks(n_blocks.max(1)))
            .for_each(|(dq, shares)| {
                vectorized!(|_| {
                    for share in shares {
                        dq.iter_mut().zip(share).for_each(|(d, &x)| *d += x);
                    }
                })
            });
    }
    Ok(())
}

/// One item's backward through one key block: adds the block's `dK` and `dV` into `dk`, `dv` and
/// returns its share of `dQ` (`[rows, hd]`). `per_row`: each query row's maximum, log-sum and
/// `Σ g ⊙ out`; `g`: the item's output gradient.
fn block_backward<T: KernelFloat>(
    inp: &Inputs<'_, T>,
    (i, blk): (usize, &KeyBlock<T>),
    (max, log_sum, dot): (&[T], &[T], &[T]),
    g: &[T],
    (dk, dv): (&mut [T], &mut [T]),
) -> Vec<T> {
    let Dims { rows, hd, .. } = inp.dims;
    let n = blk.n;
    let (keys, values) = inp.keys_values(i, blk);
    let mut products = Products::new(inp.multiply);
    let mut p = vec![T::zero(); rows * n];
    inp.masked_scores((i, 0), (blk, keys), &mut p, &mut products);
    vectorized!(|_| {
        for ((row, &m), &l) in p.chunks_exact_mut(n).zip(max).zip(log_sum) {
            row.iter_mut().for_each(|x| *x = (*x - m) - l);
            T::exp_in_place(row);
        }
    });
    // `dV` first, while `P` is the only score-sized buffer: a bf16 product's copy of it and its
    // pack then take the place `dS` takes after (so that a task holds two f32 score-sized
    // buffers' worth at most, as with f32 products).
    let (rounded, bf16) = (Values::Rounded, Values::Bf16);
    let (pt, g_rows) = ((&p[..], 1, n), (g, hd, 1));
    products.product(
        dv,
        (n, hd, rows),
        true,
        (pt, g_rows),
        (rounded, rounded),
        false,
    );
    products.release();
    let mut ds = vec![T::zero(); rows * n];
    let values_t = (values, 1, hd);
    products.product(
        &mut ds,
        (rows, n, hd),
        false,
        (g_rows, values_t),
        (rounded, bf16),
        false,
    );
    // dS = P ⊙ (dP − Σ g ⊙ out), rounded here for bf16 products (both of its products take it so).
    let round = matches!(inp.multiply, Multiply::Bf16 { .. });
    vectorized!(|_| {
        for ((ds, p), &d) in ds.chunks_exact_mut(n).zip(p.chunks_exact(n)).zip(dot) {
            let terms = ds.iter_mut().zip(p);
            match round {
                true => terms.for_each(|(x, &prob)| *x = (prob * (*x - d)).bf16_value()),
                false => terms.for_each(|(x, &prob)| *x = prob * (*x - d)),
            }
        }
    });
    drop(p);
    let q = (inp.queries(i), hd, 1);
    products.product(dk, (n, hd, rows), true, ((&ds, 1, n), q), BF16_VALUES, true);
    let mut dq = vec![T::zero(); rows * hd];
    let keys = (keys, hd, 1);
    products.product(
        &mut dq,
        (rows, hd, n),
        false,
        ((&ds, n, 1), keys),
        BF16_VALUES,
        true,
    );
    dq
}
