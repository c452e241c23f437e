//! One output tile of a bf16 product on AVX512-BF16's dot-product instruction (`vdpbf16ps`, stable
//! Rust's `_mm512_dpbf16_ps`): each of its 16 f32 lanes adds the two products of a pair of bf16
//! (consecutive along the inner dimension) to its sum, 32 multiply-adds an instruction where f32's
//! FMA does 16, on operands half the bytes and never widened. The products of two bf16 are exact in
//! f32; the sums are f32's, as on the widened path (the instruction treats bf16 denormals as zero).
//!
//! The operands are packed per inner slice of [`KC`] elements into pairs (`u32`, the lower inner
//! index in the low half): `a` in blocks of [`MR`] rows, `b` in panels of [`NR`] columns, each laid
//! out in the order the micro-kernel reads it. The micro-kernel keeps an `MR × NR` block of sums in
//! 16 registers across the slice and adds it into the tile's f32 sums.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m512, __m512bh, _mm512_dpbf16_ps, _mm512_loadu_si512, _mm512_set1_epi32, _mm512_setzero_ps,
    _mm512_storeu_ps,
};
use std::ops::Range;

use half::bf16;

use crate::host::half_product::{put_sums, Element, Operand, Tile};
use crate::host::transpose;

/// Rows of the micro-kernel's block.
const MR: usize = 8;
/// Columns of the micro-kernel's block: two vectors of 16 sums.
const NR: usize = 32;
/// Inner elements per packed slice (128 pairs): a panel of `b` is then 16 KiB, within L1.
const KC: usize = 256;

/// Whether the running CPU has AVX512-BF16 and the AVX-512 path is in force
/// ([`crate::host::simd::isa`]: choosing the AVX2 path turns this kernel off too).
pub fn available() -> bool {
    available_on(crate::host::simd::isa())
}

/// Whether the running CPU has AVX512-BF16 and `isa` is the AVX-512 path.
pub(crate) fn available_on(isa: crate::host::simd::Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        isa == crate::host::simd::Isa::Avx512 && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this kernel beats the widened f32 one on the running CPU, as measured on both vendors'
/// CPUs (docs/benchmarks.md, the sections of each CPU beside the peer): on AMD's, a dot product of
/// bf16 pairs does twice an f32 multiply-add's work in the same time, so it pays; Intel's AVX-512
/// cores multiply-add f32 at full width on two ports, as fast as their one bf16 dot-product port,
/// so the pairs' packing is pure cost there (and AMX's tiles take the products where they exist).
/// So AMD CPUs from family 25 on (every AMD CPU with AVX512-BF16) take this kernel and every other
/// CPU the widened products; `Kernel::available`
/// still lists it wherever the instructions exist, so tests check it on every such CPU. Read once,
/// by [`crate::host::half_product::Kernel::detect`], which keeps the choice.
pub fn pays() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        // `__cpuid` is safe from Rust 1.90 on, unsafe before (rust-version is 1.89).
        // SAFETY: CPUID leaves 0 and 1 exist on every x86-64 CPU.
        #[allow(unused_unsafe)]
        let (vendor, signature) = unsafe { (__cpuid(0), __cpuid(1).eax) };
        let mut name = [0u8; 12];
        for (bytes, register) in name
            .chunks_exact_mut(4)
            .zip([vendor.ebx, vendor.edx, vendor.ecx])
        {
            bytes.copy_from_slice(&register.to_le_bytes());
        }
        // The family: the base field, plus the extended one where the base is 15.
        let base = (signature >> 8) & 0xf;
        let family = if base == 0xf {
            base + ((signature >> 20) & 0xff)
        } else {
            base
        };
        &name == b"AuthenticAMD" && family >= 0x19
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// A task's packing buffers, reused across its tiles.
#[derive(Default)]
pub struct Packs {
    a: Vec<u32>,
    b: Vec<u32>,
}

/// `len` zeros in `buf`, starting on a 64-byte cache line: a load of 16 pairs (a vector here, a
/// tile's row for AMX) from a pack that starts off a line straddles two lines, and the allocator
/// aligns large buffers to 16 bytes only.
pub(crate) fn zeroed_on_line(buf: &mut Vec<u32>, len: usize) -> &mut [u32] {
    const PER_LINE: usize = 64 / std::mem::size_of::<u32>();
    buf.clear();
    buf.resize(len + PER_LINE - 1, 0);
    let skip = (buf.as_ptr() as usize).wrapping_neg() % 64 / std::mem::size_of::<u32>();
    &mut buf[skip..skip + len]
}

/// Packs rows `rows` of `x` (`[rows, len]`), inner elements `k0..k0 + 2·pairs` (zero from `len`
/// on: an odd last pair), into blocks of `lanes` rows in `buf` (zeros, at least that long, as
/// [`zeroed_on_line`] gives): block `b`, pair `p`, lane `l` at `(b · pairs + p) · lanes + l`, each
/// pair a `u32` with the lower inner index in its low half, the lanes past the last row left zero.
/// Reads run along whichever of `x`'s strides is 1. `lanes` is at most [`NR`].
pub(crate) fn pack<E: Element>(
    x: &Operand<E>,
    rows: Range<usize>,
    (k0, pairs, len): (usize, usize, usize),
    lanes: usize,
    buf: &mut [u32],
) {
    assert!(lanes <= NR, "bf16 kernel: blocks of {lanes} rows");
    let blocks = rows.len().div_ceil(lanes);
    assert!(
        buf.len() >= blocks * pairs * lanes,
        "bf16 kernel: pack too small"
    );
    let buf = &mut buf[..blocks * pairs * lanes];
    let end = len.min(k0 + 2 * pairs);
    let pair = |lo: bf16, hi: bf16| lo.to_bits() as u32 | (hi.to_bits() as u32) << 16;
    if x.col_stride == 1 {
        // Each row's inner run is contiguous: its pairs are adjacent elements. Whole pairs of bf16
        // as the words they are where they can be; the rest one pair at a time.
        let done = pair_words(x, &rows, (k0, pairs, end), lanes, buf);
        for (ii, i) in rows.enumerate() {
            let start = i * x.row_stride;
            let run = &x.data[start + k0 + 2 * done..start + end];
            if run.is_empty() {
                continue;
            }
            let block = &mut buf[(ii / lanes) * pairs * lanes + done * lanes + ii % lanes..];
            let (whole, odd) = (run.chunks_exact(2), run.len() % 2 == 1);
            for (y, two) in block.iter_mut().step_by(lanes).zip(whole) {
                *y = pair(two[0].to_bf16(), two[1].to_bf16());
            }
            if odd {
                // The run's last pair (not always the slice's: AMX's slices are padded to whole tiles).
                let last = run[run.len() - 1].to_bf16();
                block[(run.len() / 2) * lanes] = pair(last, bf16::ZERO);
            }
        }
    } else if x.row_stride == 1 {
        // Each inner index's run of rows is contiguous: a pair's two runs are interleaved straight
        // into the block's lanes, a loop the compiler vectorizes (the lanes past the runs' end,
        // and a pair's high half past `end`, stay zero).
        let bits = |v: &E| v.to_bf16().to_bits() as u32;
        for (b, block) in buf.chunks_exact_mut(pairs * lanes).enumerate() {
            let first = rows.start + b * lanes;
            let count = lanes.min(rows.end - first);
            for (p, lane) in block.chunks_exact_mut(lanes).enumerate() {
                let (lo, hi) = (k0 + 2 * p, k0 + 2 * p + 1);
                if lo >= end {
                    break;
                }
                let run = |k: usize| &x.data[first + k * x.col_stride..][..count];
                if hi < end {
                    for ((y, l), h) in lane.iter_mut().zip(run(lo)).zip(run(hi)) {
                        *y = bits(l) | bits(h) << 16;
                    }
                } else {
                    lane.iter_mut().zip(run(lo)).for_each(|(y, l)| *y = bits(l));
                }
            }
        }
    } else {
        // Neither stride is 1: each pair's two runs of rows are gathered, then interleaved.
        let run = |first: usize, k: usize, into: &mut [bf16]| {
            if k >= end {
                into.fill(bf16::ZERO);
                return;
            }
            for (l, y) in into.iter_mut().enumerate() {
                *y = x.data[(first + l) * x.row_stride + k * x.col_stride].to_bf16();
            }
        };
        let (mut lo, mut hi) = ([bf16::ZERO; NR], [bf16::ZERO; NR]);
        for (b, block) in buf.chunks_exact_mut(pairs * lanes).enumerate() {
            let first = rows.start + b * lanes;
            let count = lanes.min(rows.end - first);
            for (p, lane) in block.chunks_exact_mut(lanes).enumerate() {
                run(first, k0 + 2 * p, &mut lo[..count]);
                run(first, k0 + 2 * p + 1, &mut hi[..count]);
                for ((y, &lo), &hi) in lane.iter_mut().zip(&lo[..count]).zip(&hi[..count]) {
                    *y = pair(lo, hi);
                }
            }
        }
    }
}

/// The whole pairs of [`pack`]'s contiguous rows, written into `buf` as [`pack`] lays them out,
/// where the elements are bf16 at an even row stride (and `k0` even) on a little-endian machine:
/// a pair is then the 32-bit word it is packed as, in place, and a block's pairs are the transpose
/// of its rows' words ([`transpose::columns_into_rows_at`], by 8 × 8 blocks in AVX registers where
/// the path in force has them; one pair at a time, a row's pairs land `lanes` words apart, each
/// store on its own cache line). Returns how many pairs of every row (from `k0`'s) it wrote: none
/// where it does not apply.
fn pair_words<E: Element>(
    x: &Operand<E>,
    rows: &Range<usize>,
    (k0, pairs, end): (usize, usize, usize),
    lanes: usize,
    buf: &mut [u32],
) -> usize {
    let words = std::any::TypeId::of::<E>() == std::any::TypeId::of::<bf16>()
        && cfg!(target_endian = "little")
        && x.row_stride.is_multiple_of(2)
        && k0.is_multiple_of(2);
    if !words || rows.is_empty() {
        return 0;
    }
    let whole = (end - k0) / 2;
    // The reads and writes below are raw: their bounds checked once here.
    assert!(
        whole <= pairs && buf.len() >= rows.len().div_ceil(lanes) * pairs * lanes,
        "bf16 kernel: pack too small"
    );
    assert!(
        (rows.end - 1) * x.row_stride + end <= x.data.len(),
        "bf16 kernel: operand out of range"
    );
    let data = x.data.as_ptr().cast::<u32>();
    for (b, first) in rows.clone().step_by(lanes).enumerate() {
        // SAFETY: the block's rows (at most `lanes`, from `first`) each have `whole` pairs (2 ·
        // `whole` bf16, the word at `(row · row_stride + k0) / 2` on, all even) within their run
        // `k0..end`, which lies within the data (asserted above); the block's `whole × lanes`
        // words at row stride `lanes` lie within its `pairs × lanes` in `buf` (asserted).
        unsafe {
            transpose::columns_into_rows_at(
                buf.as_mut_ptr().add(b * pairs * lanes),
                lanes,
                data.add((first * x.row_stride + k0) / 2),
                (whole, lanes.min(rows.end - first)),
                x.row_stride / 2,
            )
        };
    }
    whole
}

/// `out += a[rows, ..k]·b[..k, cols]` into the tile's f32 sums `out` (`rows × cols`, row-major), or
/// `out =` it (`accumulate` false: the first inner slice writes, so `out` needs no zeros first).
/// Panics unless [`available`] (the caller dispatches on it) and if `out` is too small; the operands'
/// ranges are the caller's to check ([`Operand`]s that fit `rows × k` and `k × cols`).
pub fn tile<A: Element>(tile: &Tile<A>, packs: &mut Packs, (out, accumulate): (&mut [f32], bool)) {
    assert!(available(), "bf16 kernel: the CPU has no AVX512-BF16");
    let Tile { a, b, k, .. } = *tile;
    let (rows, cols) = (tile.rows.clone(), tile.cols.clone());
    let (r, c) = (rows.len(), cols.len());
    assert!(out.len() >= r * c, "bf16 kernel: tile buffer too small");
    let (row_blocks, panels) = (r.div_ceil(MR), c.div_ceil(NR));
    for k0 in (0..k).step_by(KC) {
        let pairs = KC.min(k - k0).div_ceil(2);
        // `a` in blocks of MR rows, `b` in panels of NR columns (the rows of `bᵀ`).
        let a_pack = zeroed_on_line(&mut packs.a, row_blocks * pairs * MR);
        pack(a, rows.clone(), (k0, pairs, k), MR, a_pack);
        let b_pack = zeroed_on_line(&mut packs.b, panels * pairs * NR);
        pack(&b.transposed(), cols.clone(), (k0, pairs, k), NR, b_pack);
        let (a_pack, b_pack) = (&*a_pack, &*b_pack);
        for pn in 0..panels {
            for rb in 0..row_blocks {
                let block_rows = MR.min(r - rb * MR);
                let block_cols = NR.min(c - pn * NR);
                let a_block = &a_pack[rb * pairs * MR..(rb + 1) * pairs * MR];
                let b_panel = &b_pack[pn * pairs * NR..(pn + 1) * pairs * NR];
                let at = rb * MR * c + pn * NR;
                // SAFETY: the CPU has AVX512-BF16 (asserted above); the packs hold `pairs` pairs of
                // their block and panel; `out` holds the block's rows and columns from `at` at row
                // stride `c` (its size was checked).
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    micro(
                        a_block,
                        b_panel,
                        pairs,
                        (&mut out[at..], c, accumulate || k0 > 0),
                        (block_rows, block_cols),
                    );
                }
            }
        }
    }
}

/// `out[..rows, ..cols] += a_block · b_panel` (or `=`, `add` false) over `pairs` packed pairs,
/// `out` at row stride `ldo`.
///
/// # Safety
/// The CPU must have AVX-512F and AVX512-BF16; `a_block` and `b_panel` must hold `pairs · MR` and
/// `pairs · NR` pairs; `out` must hold `(rows − 1) · ldo + cols` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn micro(
    a_block: &[u32],
    b_panel: &[u32],
    pairs: usize,
    (out, ldo, add): (&mut [f32], usize, bool),
    (rows, cols): (usize, usize),
) {
    let as_pairs = |v: std::arch::x86_64::__m512i| -> __m512bh {
        // SAFETY: both are 512 bits; the pairs' bits are bf16 values.
        unsafe { std::mem::transmute(v) }
    };
    let mut sums: [[__m512; 2]; MR] = [[_mm512_setzero_ps(); 2]; MR];
    for p in 0..pairs {
        let b = &b_panel[p * NR..(p + 1) * NR];
        // SAFETY: `b` holds 32 u32, two vectors' worth.
        let (b0, b1) = unsafe {
            (
                as_pairs(_mm512_loadu_si512(b.as_ptr().cast())),
                as_pairs(_mm512_loadu_si512(b[16..].as_ptr().cast())),
            )
        };
        let a = &a_block[p * MR..(p + 1) * MR];
        for (sum, &pair) in sums.iter_mut().zip(a) {
            let a = as_pairs(_mm512_set1_epi32(pair as i32));
            sum[0] = _mm512_dpbf16_ps(sum[0], a, b0);
            sum[1] = _mm512_dpbf16_ps(sum[1], a, b1);
        }
    }
    let mut lanes = [0f32; NR];
    for (i, sum) in sums.iter().enumerate().take(rows) {
        // SAFETY: `lanes` holds 32 f32, two vectors' worth.
        unsafe {
            _mm512_storeu_ps(lanes.as_mut_ptr(), sum[0]);
            _mm512_storeu_ps(lanes[16..].as_mut_ptr(), sum[1]);
        }
        put_sums(&mut out[i * ldo..i * ldo + cols], &lanes, add);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Operands for the packs' layout tests: `rows` rows of `len` elements at each layout the
    /// products take (row-major at an even and an odd row stride, transposed, every second
    /// element), as bf16 and as f32 whose low bits the narrowing drops; `each` gets the operand
    /// and the element at (row, inner index)'s bf16 bits.
    pub(crate) fn each_packed_layout(
        (rows, len): (usize, usize),
        mut each: impl FnMut(&dyn Fn(usize, usize) -> u16, PackOperand),
    ) {
        let values: Vec<bf16> = (0..2 * rows * (len + 1))
            .map(|i| bf16::from_bits(0x3c00 + (i % 4093) as u16))
            .collect();
        let wide: Vec<f32> = values
            .iter()
            .map(|v| f32::from_bits((v.to_bits() as u32) << 16 | 0x1234))
            .collect();
        for (row_stride, col_stride) in [(len, 1), (len + 1, 1), (1, rows), (2 * len, 2)] {
            let at = |i: usize, k: usize| i * row_stride + k * col_stride;
            let bits = |i: usize, k: usize| values[at(i, k)].to_bits();
            let (data, row_stride, col_stride) = (&values[..], row_stride, col_stride);
            each(
                &bits,
                PackOperand::Bf16(Operand {
                    data,
                    row_stride,
                    col_stride,
                }),
            );
            let data = &wide[..];
            each(
                &bits,
                PackOperand::F32(Operand {
                    data,
                    row_stride,
                    col_stride,
                }),
            );
        }
    }

    /// An operand of either element type.
    pub(crate) enum PackOperand<'a> {
        Bf16(Operand<'a, bf16>),
        F32(Operand<'a, f32>),
    }

    /// Every pair of a pack where the layout puts it and zeros everywhere else, whichever path
    /// packed it (whole 8 × 8 blocks, rows one by one, interleaved runs, gathered), and nothing
    /// written past it: the products' exact-sum tests cannot see a wrong value that meets a zero.
    #[test]
    fn packs_hold_each_pair_where_the_layout_puts_it() {
        for len in [530, 531] {
            each_packed_layout((45, len), |bits, x| {
                for lanes in [8, 16, 32] {
                    for rows in [0..45, 3..40, 5..6] {
                        // Whole slices, the last one (odd where `len` is), one padded past `len`.
                        for (k0, pairs) in [(0, 128), (256, 137), (512, 16)] {
                            let need = rows.len().div_ceil(lanes) * pairs * lanes;
                            let mut want = vec![0u32; need + 64];
                            for (ii, i) in rows.clone().enumerate() {
                                let half = |k: usize| if k < len { bits(i, k) as u32 } else { 0 };
                                for p in 0..pairs {
                                    want[((ii / lanes) * pairs + p) * lanes + ii % lanes] =
                                        half(k0 + 2 * p) | half(k0 + 2 * p + 1) << 16;
                                }
                            }
                            let mut buf = Vec::new();
                            let got = zeroed_on_line(&mut buf, need + 64);
                            let strides = match &x {
                                PackOperand::Bf16(x) => {
                                    pack(x, rows.clone(), (k0, pairs, len), lanes, got);
                                    (x.row_stride, x.col_stride, "bf16")
                                }
                                PackOperand::F32(x) => {
                                    pack(x, rows.clone(), (k0, pairs, len), lanes, got);
                                    (x.row_stride, x.col_stride, "f32")
                                }
                            };
                            assert!(
                                got == &want[..],
                                "{strides:?}, len {len}, lanes {lanes}, rows {rows:?}, k0 {k0}"
                            );
                        }
                    }
                }
            });
        }
    }

    /// Each pack starts on a cache line, holds zeros only, and is as long as asked, whatever the
    /// buffer held before and wherever the allocator put it.
    #[test]
    fn packs_start_on_a_line_and_hold_zeros() {
        let mut buf = Vec::new();
        for len in [0, 1, 17, 4096, 100_003] {
            let pack = zeroed_on_line(&mut buf, len);
            assert_eq!(pack.len(), len);
            assert_eq!(pack.as_ptr() as usize % 64, 0, "{len}: not on a line");
            assert!(pack.iter().all(|&v| v == 0), "{len}: not zeros");
            pack.fill(u32::MAX);
        }
    }
}
