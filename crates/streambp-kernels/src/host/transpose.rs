//! A product's right operand when it is a transposed view (`x·Wᵀ`: a projection's forward, the
//! logits, the attention's `Q·Kᵀ`), copied into rows before gemm multiplies by it.
//!
//! gemm computes a row-major product as its transpose and packs the right operand's columns into
//! its left panels. When those columns are strided (a row of `W` is a column of `Wᵀ`), its packing
//! gathers them one element at a time (`pack_lhs`, a seventh of an f32 step's time). Copied into
//! rows first (f32 by 8 × 8 blocks in AVX registers where the AVX2 or AVX-512 path is in force,
//! anything else element by element), they are packed by whole vectors, in less time than gemm's
//! gathering (docs/benchmarks.md, "Packing a transposed view"), with the same loss and peak to the bit
//! (gemm's kernel adds the same terms in the same order, and the copy takes the place of gemm's
//! own packing buffer). Elsewhere a slab
//! may round differently: one of at most 64 columns can take gemm's small-size blocking of the
//! inner dimension, and one of a single column its matrix-vector kernel.
//!
//! The copy is made per call and in slabs of columns ([`slab_columns`]), so that it holds about as
//! much as gemm's packing would, and is freed when the call returns.
//!
//! The widened bf16 kernel (`half_product`) copies its transposed bf16 operand the same way,
//! widening each element to f32 as it goes ([`IntoRow`]), so that it makes one pass over it.

/// Elements a slab holds at most, unless [`MIN_SLAB_COLUMNS`] columns need more; its columns are a
/// multiple of [`COLUMNS_MULTIPLE`] (or all of `b`'s, if fewer).
const SLAB_ELEMENTS: usize = 128 * 1024;

/// A slab's columns are a multiple of this (whole vectors of gemm's widest f32 kernel), so that gemm
/// packs no slab but the last, and none of a product whose columns are a multiple of it too.
pub const COLUMNS_MULTIPLE: usize = 16;

/// The fewest columns a slab takes (gemm's AVX-512 register tile is 64 rows of its transposed
/// problem: narrower slabs leave it part empty).
const MIN_SLAB_COLUMNS: usize = 64;

/// Outputs at most this large gemm computes as dot products of rows, packing nothing (its
/// "horizontal" kernels): no copy is made for them.
const DOT_PRODUCT_OUTPUTS: usize = 16 * 16;

/// For `a[m, k]·b[k, n]` with `b`'s row and column strides: the columns of `b` per slab copied into
/// rows, or `None` where gemm reads `b` as it is: `b`'s columns already contiguous, or a product
/// that packs nothing (a matrix-vector product, `k ≤ 2`, or a small output).
pub fn slab_columns(
    (m, n, k): (usize, usize, usize),
    (b_row_stride, b_col_stride): (usize, usize),
) -> Option<usize> {
    let transposed_view = b_row_stride == 1 && b_col_stride != 1;
    let packs = m > 1 && n > 1 && k > 2 && m * n > DOT_PRODUCT_OUTPUTS;
    (transposed_view && packs).then(|| {
        (SLAB_ELEMENTS / k / COLUMNS_MULTIPLE * COLUMNS_MULTIPLE)
            .max(MIN_SLAB_COLUMNS)
            .min(n)
    })
}

/// What a copy into rows reads and writes: an element as it is, or a bf16 widened to f32 (the widened
/// bf16 kernel's transposed operand: a table's rows, the logits' columns, widened and copied into
/// rows in one pass where widening and then copying took two).
pub(crate) trait IntoRow<D>: Copy + 'static {
    /// The element as the copy writes it.
    fn into_row(self) -> D;
}

impl<T: Copy + 'static> IntoRow<T> for T {
    #[inline(always)]
    fn into_row(self) -> T {
        self
    }
}

impl IntoRow<f32> for half::bf16 {
    #[inline(always)]
    fn into_row(self) -> f32 {
        crate::host::cast::widen(self)
    }
}

/// `c` columns of a `k`-row operand, column `j` starting at `src + j·ld` with its `k` elements
/// adjacent, into `dst` as a row-major `[k, c]` (cleared first), each element as [`IntoRow`] writes
/// it.
///
/// # Safety
/// `src + j·ld + i` must be readable for every `j < c`, `i < k`.
pub(crate) unsafe fn columns_into_rows<S: IntoRow<D>, D: Copy + 'static>(
    dst: &mut Vec<D>,
    src: *const S,
    (k, c): (usize, usize),
    ld: usize,
) {
    dst.clear();
    dst.reserve(k * c);
    // SAFETY: the caller's contract for `src`, and `dst` has room for `k × c`.
    unsafe {
        columns_into_rows_at(dst.as_mut_ptr(), c, src, (k, c), ld);
        // Every element of `[k, c]` was written.
        dst.set_len(k * c);
    }
}

/// [`columns_into_rows`] into `out` at row stride `out_stride`, the source's elements read where
/// they lie, aligned for `S` or not (the bf16 packs read pairs of bf16 as 32-bit words).
///
/// # Safety
/// As [`columns_into_rows`], with `out + i·out_stride + j` writable for every `i < k`, `j < c`.
pub(crate) unsafe fn columns_into_rows_at<S: IntoRow<D>, D: Copy + 'static>(
    out: *mut D,
    out_stride: usize,
    src: *const S,
    (k, c): (usize, usize),
    ld: usize,
) {
    // SAFETY: the caller's contract.
    let (full_rows, full_cols) = unsafe { vector_blocks(out, out_stride, src, (k, c), ld) };
    // The edges the blocks left (or everything): rows `full_rows..`, then columns `full_cols..`.
    let at = |i: usize, j: usize| {
        // SAFETY: the caller's contract.
        unsafe {
            out.add(i * out_stride + j)
                .write(src.add(j * ld + i).read_unaligned().into_row())
        }
    };
    for j in 0..c {
        (full_rows..k).for_each(|i| at(i, j));
    }
    for i in 0..full_rows {
        (full_cols..c).for_each(|j| at(i, j));
    }
}

/// The whole 8 × 8 blocks of [`columns_into_rows_at`] in AVX registers, for 32-bit elements (f32,
/// or any bits as u32) and bf16 widened to f32, where the AVX2 or AVX-512 path is in force; returns
/// how many rows and columns of the output they covered (none for anything else).
///
/// # Safety
/// As [`columns_into_rows_at`].
unsafe fn vector_blocks<S: 'static, D: 'static>(
    out: *mut D,
    out_stride: usize,
    src: *const S,
    (k, c): (usize, usize),
    ld: usize,
) -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::host::simd::isa() >= crate::host::simd::Isa::Avx2 {
        use std::any::TypeId;
        let (s, d) = (TypeId::of::<S>(), TypeId::of::<D>());
        let words = [TypeId::of::<f32>(), TypeId::of::<u32>()];
        if s == d && words.contains(&s) {
            // SAFETY: the elements are 32 bits, which the blocks move as f32 bits (unaligned loads
            // and stores); the CPU has AVX2 (the path in force says so); and the caller's contract.
            return unsafe { blocks_f32(out.cast(), out_stride, src.cast(), (k, c), ld) };
        }
        if s == TypeId::of::<half::bf16>() && d == TypeId::of::<f32>() {
            // SAFETY: as above, the source's elements bf16.
            return unsafe { blocks_widened(out.cast(), out_stride, src.cast(), (k, c), ld) };
        }
    }
    let _ = (out, out_stride, src, k, c, ld);
    (0, 0)
}

/// The whole 8 × 8 blocks of [`columns_into_rows_at`] for f32, in AVX registers; returns how many
/// rows and columns of the output they covered (multiples of 8).
///
/// # Safety
/// As [`columns_into_rows_at`]; the CPU must have AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn blocks_f32(
    out: *mut f32,
    out_stride: usize,
    src: *const f32,
    (k, c): (usize, usize),
    ld: usize,
) -> (usize, usize) {
    use std::arch::x86_64::_mm256_loadu_ps;
    // SAFETY: the caller's contract; each load reads 8 elements of a source column in range.
    unsafe { blocks(out, out_stride, src, (k, c), ld, |p| _mm256_loadu_ps(p)) }
}

/// [`blocks_f32`] for bf16 columns, each run of 8 widened to f32 as it is loaded.
///
/// # Safety
/// As [`columns_into_rows_at`]; the CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn blocks_widened(
    out: *mut f32,
    out_stride: usize,
    src: *const half::bf16,
    (k, c): (usize, usize),
    ld: usize,
) -> (usize, usize) {
    use std::arch::x86_64::*;
    // A bf16 is the upper half of its f32: each 16-bit element zero-extended, shifted up.
    let load = |p: *const half::bf16| {
        // SAFETY: the caller's contract; 8 bf16 of a source column in range.
        let bits = unsafe { _mm_loadu_si128(p.cast()) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits)))
    };
    // SAFETY: the caller's contract.
    unsafe { blocks(out, out_stride, src, (k, c), ld, load) }
}

/// The whole 8 × 8 blocks of a copy into rows, each column's run of 8 brought into a register by
/// `load`: the loop of [`blocks_f32`] and [`blocks_widened`].
///
/// # Safety
/// As [`columns_into_rows_at`]; the CPU must have AVX, and `load` read 8 elements from where it is
/// given.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn blocks<S>(
    out: *mut f32,
    out_stride: usize,
    src: *const S,
    (k, c): (usize, usize),
    ld: usize,
    load: impl Fn(*const S) -> std::arch::x86_64::__m256,
) -> (usize, usize) {
    let (rows, cols) = (k / 8 * 8, c / 8 * 8);
    // Panels of 64 rows, so that the source's lines a panel reads stay in L1 across its columns.
    for i0 in (0..rows).step_by(64) {
        for j in (0..cols).step_by(8) {
            for i in (i0..(i0 + 64).min(rows)).step_by(8) {
                // SAFETY: rows i..i + 8 and columns j..j + 8 lie within `k × c` (and the source's
                // columns within the caller's contract).
                unsafe {
                    let first = src.add(j * ld + i);
                    let r: [_; 8] = std::array::from_fn(|s| load(first.add(s * ld)));
                    store_transposed(out.add(i * out_stride + j), out_stride, r)
                };
            }
        }
    }
    (rows, cols)
}

/// `out[r][s] = r[s][r]` for an 8 × 8 block held in 8 registers, `out`'s rows at stride
/// `out_stride`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[inline]
unsafe fn store_transposed(out: *mut f32, out_stride: usize, r: [std::arch::x86_64::__m256; 8]) {
    use std::arch::x86_64::*;
    // Pairs, then quads interleaved within each 128-bit half, then the halves exchanged.
    let lo01 = _mm256_unpacklo_ps(r[0], r[1]);
    let hi01 = _mm256_unpackhi_ps(r[0], r[1]);
    let lo23 = _mm256_unpacklo_ps(r[2], r[3]);
    let hi23 = _mm256_unpackhi_ps(r[2], r[3]);
    let lo45 = _mm256_unpacklo_ps(r[4], r[5]);
    let hi45 = _mm256_unpackhi_ps(r[4], r[5]);
    let lo67 = _mm256_unpacklo_ps(r[6], r[7]);
    let hi67 = _mm256_unpackhi_ps(r[6], r[7]);
    let q = [
        _mm256_shuffle_ps::<0x44>(lo01, lo23),
        _mm256_shuffle_ps::<0xEE>(lo01, lo23),
        _mm256_shuffle_ps::<0x44>(hi01, hi23),
        _mm256_shuffle_ps::<0xEE>(hi01, hi23),
        _mm256_shuffle_ps::<0x44>(lo45, lo67),
        _mm256_shuffle_ps::<0xEE>(lo45, lo67),
        _mm256_shuffle_ps::<0x44>(hi45, hi67),
        _mm256_shuffle_ps::<0xEE>(hi45, hi67),
    ];
    let rows = [
        _mm256_permute2f128_ps::<0x20>(q[0], q[4]),
        _mm256_permute2f128_ps::<0x20>(q[1], q[5]),
        _mm256_permute2f128_ps::<0x20>(q[2], q[6]),
        _mm256_permute2f128_ps::<0x20>(q[3], q[7]),
        _mm256_permute2f128_ps::<0x31>(q[0], q[4]),
        _mm256_permute2f128_ps::<0x31>(q[1], q[5]),
        _mm256_permute2f128_ps::<0x31>(q[2], q[6]),
        _mm256_permute2f128_ps::<0x31>(q[3], q[7]),
    ];
    for (i, row) in rows.into_iter().enumerate() {
        // SAFETY: the caller's: 8 rows of 8 writable elements.
        unsafe { _mm256_storeu_ps(out.add(i * out_stride), row) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shape around the blocks' edges, f32 and u32 (the AVX blocks where the path in force
    /// has them), f64 (element by element) and bf16 widened to f32 (AVX2 blocks there), against
    /// the definition.
    #[test]
    fn columns_become_rows() {
        fn check<S: IntoRow<D>, D: Copy + PartialEq + std::fmt::Debug + 'static>(
            from: impl Fn(usize) -> S,
        ) {
            for (k, c) in [
                (1, 1),
                (8, 8),
                (7, 9),
                (16, 24),
                (65, 17),
                (130, 71),
                (3, 64),
            ] {
                let ld = k + 5;
                let src: Vec<S> = (0..c * ld).map(&from).collect();
                let mut dst = vec![from(0).into_row(); 3];
                // SAFETY: column j's k elements start at j·ld, within `src`.
                unsafe { columns_into_rows(&mut dst, src.as_ptr(), (k, c), ld) };
                assert_eq!(dst.len(), k * c);
                for i in 0..k {
                    for j in 0..c {
                        let want = src[j * ld + i].into_row();
                        assert_eq!(dst[i * c + j], want, "[{k}, {c}] at ({i}, {j})");
                    }
                }
            }
        }
        check::<f32, f32>(|i| i as f32);
        check::<u32, u32>(|i| i as u32);
        check::<f64, f64>(|i| i as f64);
        // Distinct values, negatives among them.
        check::<half::bf16, f32>(|i| half::bf16::from_f32((i as f32 - 300.0) * 1.37));
        println!("f32 path: {}", crate::host::simd::isa().name());
    }

    #[test]
    fn slabs_only_for_transposed_views_that_gemm_packs() {
        assert_eq!(
            slab_columns((128, 768, 256), (1, 256)),
            Some(512),
            "128 Ki elements"
        );
        assert_eq!(slab_columns((128, 768, 4096), (1, 4096)), Some(64));
        assert_eq!(slab_columns((128, 40, 256), (1, 256)), Some(40));
        assert_eq!(
            slab_columns((128, 768, 256), (768, 1)),
            None,
            "rows already"
        );
        assert_eq!(slab_columns((1, 768, 256), (1, 256)), None, "a vector");
        assert_eq!(slab_columns((128, 768, 2), (1, 2)), None, "k ≤ 2");
        assert_eq!(slab_columns((128, 768, 0), (1, 0)), None, "k = 0");
        assert_eq!(slab_columns((16, 16, 256), (1, 256)), None, "dot products");
    }
}
