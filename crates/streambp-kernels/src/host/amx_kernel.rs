//! One output tile of a bf16 product on AMX, the tile unit of Intel's server CPUs: `tdpbf16ps` multiplies a 16 × 32 bf16 tile by a 32 × 16 one into a 16 × 16 tile of f32
//! sums, 8,192 multiply-adds an instruction, which is what PyTorch's bf16 products run on there.
//! The products of two bf16 are exact in f32 and the sums are f32's, as on the other kernels
//! (the unit treats bf16 denormals as zero, as AVX512-BF16 does).
//!
//! AMX's instructions are not stable Rust, so the six used here are inline assembly (their
//! encodings checked in the tests). A 32 × 32 block of sums lives in four tiles (`tmm0..3`), fed by
//! two tiles of `a`'s rows (`tmm4`, `tmm5`) and two of `b`'s columns (`tmm6`, `tmm7`). The operands
//! are packed per inner slice of [`KC`] elements into pairs (`u32`, the lower inner index in the
//! low half) padded to whole tiles: `a` row by row, each row's pairs contiguous (a tile row is 16
//! pairs), `b` in panels of 16 columns as [`crate::host::bf16_kernel`] packs them (a tile row is one
//! pair of each of the 16 columns). Everything but the tile unit is [`tile_with`] over a
//! [`TileUnit`], so the tests run it on a model of the unit ([`Emulated`]) on every CPU, and
//! `STREAMBP_BF16_KERNEL=amx-emulated` runs every bf16 product on that model.
//!
//! Linux hands AMX's 8 KiB of tile state to a process only when asked (`arch_prctl`): asked once,
//! by [`available`].

use std::ops::Range;

use crate::host::bf16_kernel::zeroed_on_line;
use crate::host::half_product::{put_sums, Element, Operand, Tile};

/// Rows of a block of sums: two tiles of 16.
const MR: usize = 32;
/// Columns of a block of sums: two tiles of 16.
const NR: usize = 32;
/// Rows of a tile, and pairs in one of its rows (64 bytes): the inner depth of a tile is 32.
const TILE: usize = 16;
/// Inner elements per packed slice (8 tiles deep): `a`'s pack for a 256-row tile is then 128 KiB.
const KC: usize = 256;

/// Whether the running CPU has AMX's tiles and bf16 products, the OS keeps their state, the process
/// was granted it, and the AVX-512 path is in force (choosing the AVX2 path turns this kernel off
/// too).
pub fn available() -> bool {
    available_on(crate::host::simd::isa())
}

/// Whether the tiles are there for the process (checked, and their state asked for, once) and
/// `isa` is the AVX-512 path.
pub(crate) fn available_on(isa: crate::host::simd::Isa) -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        static TILES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        isa == crate::host::simd::Isa::Avx512
            && *TILES.get_or_init(|| cpu_has_amx() && granted_tile_state())
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        let _ = isa;
        false
    }
}

/// CPUID's AMX-BF16 and AMX-TILE bits (leaf 7, EDX 22 and 24), tiles of the shapes used here, and
/// the OS's XCR0 bits for the tile configuration and data (17, 18).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn cpu_has_amx() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // `__cpuid` is safe from Rust 1.90 on, unsafe before (rust-version is 1.89).
    // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is read only where leaf 0 lists it.
    #[allow(unused_unsafe)]
    let (max_leaf, leaf1) = unsafe { (__cpuid(0).eax, __cpuid(1).ecx) };
    if max_leaf < 7 || leaf1 & (1 << 27) == 0 {
        // No leaf 7, or no OSXSAVE (XGETBV would fault).
        return false;
    }
    // SAFETY: as above.
    #[allow(unused_unsafe)]
    let edx = unsafe { __cpuid_count(7, 0).edx };
    if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
        return false;
    }
    // The shapes this kernel configures: palette 1 with 8 tiles of 16 rows of 64 bytes (leaf 0x1D),
    // and a tile multiply that takes them (leaf 0x1E: 16 rows of `b`, 64 bytes of a row).
    if max_leaf < 0x1e {
        return false;
    }
    // SAFETY: leaves 0x1D and 0x1E exist (checked above).
    #[allow(unused_unsafe)]
    let (palettes, palette1, tmul) = unsafe {
        (
            __cpuid_count(0x1d, 0).eax,
            __cpuid_count(0x1d, 1),
            __cpuid_count(0x1e, 0).ebx,
        )
    };
    let tiles_fit = palettes >= 1
        && palette1.ebx & 0xffff >= 64
        && palette1.ebx >> 16 >= 8
        && palette1.ecx & 0xffff >= 16;
    if !tiles_fit || tmul & 0xff < 16 || (tmul >> 8) & 0xffff < 64 {
        return false;
    }
    let (lo, _hi): (u32, u32);
    // SAFETY: XGETBV with ECX = 0 reads XCR0, defined wherever OSXSAVE is set (checked above).
    unsafe {
        std::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") _hi,
            options(nomem, nostack, preserves_flags));
    }
    let tile_state = (1 << 17) | (1 << 18);
    lo & tile_state == tile_state
}

/// Asks Linux for the tile data state (`ARCH_REQ_XCOMP_PERM`, `XFEATURE_XTILEDATA`), which it
/// grants to the whole process; without it the first tile instruction faults.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn granted_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these integer arguments reads and writes no memory of ours; a
    // refusal is its return value.
    let granted = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    } == 0;
    if !granted {
        tracing::info!("AMX: the kernel did not grant the tile state; bf16 products go without");
    }
    granted
}

/// A task's packing buffers, reused across its tiles.
#[derive(Default)]
pub struct Packs {
    a: Vec<u32>,
    b: Vec<u32>,
}

/// Packs rows `rows` of `x` (`[rows, len]`), inner elements `k0..k0 + 2·pairs` (zero from `len`
/// on), row by row into `buf` (zeros, [`MR`] rows' worth per block of them): row `i`, pair `p` at
/// `i · pairs + p`, the rows short of a whole block left zero. Reads run along `x`'s rows where
/// its columns are contiguous, else inner index by inner index (each a contiguous run of rows
/// where `x.row_stride` is 1).
fn pack_rows<E: Element>(
    x: &Operand<E>,
    rows: Range<usize>,
    (k0, pairs, len): (usize, usize, usize),
    buf: &mut [u32],
) {
    let size = rows.len().next_multiple_of(MR) * pairs;
    assert!(buf.len() >= size, "AMX kernel: pack too small");
    let buf = &mut buf[..size];
    let end = len.min(k0 + 2 * pairs);
    let bits = |v: E| v.to_bf16().to_bits() as u32;
    if x.col_stride == 1 {
        for (row, i) in buf.chunks_exact_mut(pairs).zip(rows) {
            let start = i * x.row_stride;
            let run = &x.data[start + k0..start + end];
            // Whole pairs by `chunks_exact`, which the compiler vectorizes; an odd last one after.
            let whole = run.chunks_exact(2);
            if let &[last] = whole.remainder() {
                row[run.len() / 2] = bits(last);
            }
            for (y, two) in row.iter_mut().zip(whole) {
                *y = bits(two[0]) | bits(two[1]) << 16;
            }
        }
    } else {
        // Each pair from its two inner indices at once (no second pass over the pack).
        for p in 0..(end - k0).div_ceil(2) {
            let (lo, hi) = (k0 + 2 * p, k0 + 2 * p + 1);
            for (ii, i) in rows.clone().enumerate() {
                let at = |kk: usize| x.data[i * x.row_stride + kk * x.col_stride];
                let hi = if hi < end { bits(at(hi)) } else { 0 };
                buf[ii * pairs + p] = bits(at(lo)) | hi << 16;
            }
        }
    }
}

/// What computes one [`MR`] × [`NR`] block of sums from packed operands: AMX's tiles ([`Amx`]), or
/// a model of them ([`Emulated`]).
pub(crate) trait TileUnit {
    /// Readies the unit for [`TileUnit::block`]s (AMX: configures the tiles, once per product
    /// rather than per block: `ldtilecfg` and `tilerelease` took about as long as a block's
    /// multiplications at a head width of 64).
    fn begin(&self) {}
    /// After the last block of a [`TileUnit::begin`] (AMX: releases the tiles).
    fn end(&self) {}
    /// `sums = a_block · panels` over `pairs` pairs (a whole number of [`TILE`]s): `a_block` holds
    /// [`MR`] packed rows of `pairs` pairs ([`pack_rows`]), `panels` two panels of 16 columns,
    /// `pairs · 16` pairs each; `sums` from its first element, `row` elements from one row to the
    /// next (a block of the product's own output, or a buffer of [`NR`] to a row), at least
    /// `(MR − 1) · row + NR` long.
    fn block(&self, a_block: &[u32], panels: &[u32], pairs: usize, sums: (&mut [f32], usize));
}

/// Where a block's tiles start in its operands and sums, in elements, and their rows' strides: the
/// addresses [`Amx::block`]'s loads and stores take, and [`Emulated`]'s.
mod addresses {
    use super::TILE;

    /// The second `a` tile (rows 16..32) and the second `b` tile (the second panel), from the
    /// first: the same distance, 16 rows of `pairs` pairs.
    pub fn second_tile(pairs: usize) -> usize {
        TILE * pairs
    }

    /// From one inner step of 32 elements (16 pairs) to the next: along an `a` row, and down a
    /// `b` panel (16 pair-rows of 16 pairs).
    pub const A_STEP: usize = TILE;
    pub const B_STEP: usize = TILE * TILE;

    /// Rows' strides: `a`'s packed rows, `b`'s pair-rows.
    pub fn a_row(pairs: usize) -> usize {
        pairs
    }
    pub const B_ROW: usize = TILE;

    /// The sums' quarters that tiles 0-3 hold (`a` tile · `b` tile: 0·0, 0·1, 1·0, 1·1), for sums
    /// `row` elements to a row.
    pub fn quarters(row: usize) -> [usize; 4] {
        [0, TILE, TILE * row, TILE * row + TILE]
    }
}

/// AMX's tile unit: only made where [`available`] (only x86-64 runs it: its `TileUnit`).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Amx(());

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl Amx {
    /// The unit, where the CPU has it and the process may use it.
    pub(crate) fn new() -> Option<Self> {
        available().then_some(Amx(()))
    }
}

/// The tiles' shapes for `ldtilecfg`: palette 1, tiles 0-7 of 16 rows of 64 bytes.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

#[cfg(target_arch = "x86_64")]
static CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

#[cfg(target_arch = "x86_64")]
impl TileUnit for Amx {
    fn begin(&self) {
        // SAFETY: an `Amx` exists only where the CPU has AMX-TILE with this palette, the OS keeps
        // the tile state and the process was granted it; `CONFIG` is a valid 64-byte configuration.
        // The configuration is state no compiled code touches: only this module's assembly uses
        // the tiles, and the blocks between this and `end` run on this thread.
        unsafe {
            std::arch::asm!("ldtilecfg [{config}]", config = in(reg) &CONFIG, options(nostack));
        }
    }

    fn end(&self) {
        // SAFETY: as in `begin`; releasing tiles that are configured (or not) is always valid.
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem));
        }
    }

    /// One assembly block from zeroing the sums to storing them (the tiles' contents live only
    /// inside it: Rust promises nothing about registers between blocks); the configuration is
    /// [`TileUnit::begin`]'s.
    fn block(
        &self,
        a_block: &[u32],
        panels: &[u32],
        pairs: usize,
        (sums, row): (&mut [f32], usize),
    ) {
        use addresses::*;
        assert!(
            pairs > 0 && pairs.is_multiple_of(TILE),
            "AMX kernel: {pairs} pairs"
        );
        assert!(a_block.len() >= MR * pairs && panels.len() >= 2 * TILE * pairs);
        assert!(
            row >= NR && sums.len() >= (MR - 1) * row + NR,
            "AMX kernel: sums too small"
        );
        let (a0, b0) = (a_block.as_ptr(), panels.as_ptr());
        // SAFETY: within the slices, whose lengths were checked.
        let (a1, b1) = unsafe { (a0.add(second_tile(pairs)), b0.add(second_tile(pairs))) };
        let quarter = addresses::quarters(row);
        // SAFETY: each quarter's first element lies within `sums` (checked above).
        let c = quarter.map(|q| unsafe { sums.as_mut_ptr().add(q) });
        // SAFETY: the tiles were configured (`begin`, this thread) on a CPU with AMX-BF16 (an
        // `Amx` exists only there). Each load reads 16 rows of 64 bytes: `a`'s from pair
        // `16·step` of rows `pairs · 4` bytes apart (within the block's `MR · pairs` pairs),
        // `b`'s from pair-row `16·step` of a panel, 64 bytes apart (within `2 · 16 · pairs`);
        // `pairs / 16` steps (at least one). Each store writes 16 rows of 64 bytes, `row · 4`
        // bytes apart, from its quarter's first element: within `sums`, whose last row ends
        // `(MR − 1) · row + NR` elements from its first (checked above).
        unsafe {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                "tileloadd tmm4, [{a0} + {a_row}*1]",
                "tileloadd tmm5, [{a1} + {a_row}*1]",
                "tileloadd tmm6, [{b0} + {row}*1]",
                "tileloadd tmm7, [{b1} + {row}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a0}, {a_step}",
                "add {a1}, {a_step}",
                "add {b0}, {b_step}",
                "add {b1}, {b_step}",
                "dec {steps}",
                "jnz 2b",
                "tilestored [{c0} + {sums_row}*1], tmm0",
                "tilestored [{c1} + {sums_row}*1], tmm1",
                "tilestored [{c2} + {sums_row}*1], tmm2",
                "tilestored [{c3} + {sums_row}*1], tmm3",
                a0 = inout(reg) a0 => _,
                a1 = inout(reg) a1 => _,
                b0 = inout(reg) b0 => _,
                b1 = inout(reg) b1 => _,
                a_row = in(reg) a_row(pairs) * 4,
                row = in(reg) B_ROW * 4,
                steps = inout(reg) pairs / TILE => _,
                sums_row = in(reg) row * 4,
                c0 = in(reg) c[0],
                c1 = in(reg) c[1],
                c2 = in(reg) c[2],
                c3 = in(reg) c[3],
                a_step = const A_STEP * 4,
                b_step = const B_STEP * 4,
                out("tmm0") _,
                out("tmm1") _,
                out("tmm2") _,
                out("tmm3") _,
                out("tmm4") _,
                out("tmm5") _,
                out("tmm6") _,
                out("tmm7") _,
                options(nostack)
            );
        }
    }
}

/// AMX's tile unit in software, at the addresses [`Amx::block`] takes: each tile loaded as 16 rows
/// from its base at its row stride; `tdpbf16ps c, a, b` adds, for each row `m` of `a`, pair `p` and
/// column `n` of `b`, `a[m][p].hi·b[p][n].hi`, then `a[m][p].lo·b[p][n].lo`, to `c[m][n]` in f32
/// (each product exact, each sum rounded; denormals aside). The tests run [`tile_with`] on it on
/// every CPU; [`EMULATED`] runs every bf16 product on it where the CPU has no AMX, so that the whole
/// test suite can run with the tiles' order of sums on any CPU (slowly).
///
/// The order is the one nearest the hardware's, of those compared on a step's loss against AMX's
/// own tiles (docs/benchmarks.md, "The tiles in software, for every CI machine"): high halves
/// first, as the AVX512-BF16 kernel adds; orders of summation alone move a bf16 step's loss by
/// about 1e-5 (the rounding of bf16 activations amplifies them).
pub(crate) struct Emulated;

/// Sixteen rows of sixteen packed pairs: one tile.
type TileRows = [[u32; TILE]; TILE];

fn load(data: &[u32], base: usize, stride: usize) -> TileRows {
    std::array::from_fn(|m| std::array::from_fn(|p| data[base + m * stride + p]))
}

fn tdpbf16ps(c: &mut [[f32; TILE]; TILE], a: &TileRows, b: &TileRows) {
    let half = |x: u32, hi: bool| f32::from_bits(if hi { x & 0xffff_0000 } else { x << 16 });
    for (c, a) in c.iter_mut().zip(a) {
        for (p, &a) in a.iter().enumerate() {
            for (c, &b) in c.iter_mut().zip(&b[p]) {
                *c += half(a, true) * half(b, true);
                *c += half(a, false) * half(b, false);
            }
        }
    }
}

impl TileUnit for Emulated {
    fn block(
        &self,
        a_block: &[u32],
        panels: &[u32],
        pairs: usize,
        (sums, row): (&mut [f32], usize),
    ) {
        use addresses::*;
        let mut c = [[[0f32; TILE]; TILE]; 4];
        for step in 0..pairs / TILE {
            let a = [0, second_tile(pairs)].map(|t| load(a_block, t + step * A_STEP, a_row(pairs)));
            let b = [0, second_tile(pairs)].map(|t| load(panels, t + step * B_STEP, B_ROW));
            tdpbf16ps(&mut c[0], &a[0], &b[0]);
            tdpbf16ps(&mut c[1], &a[0], &b[1]);
            tdpbf16ps(&mut c[2], &a[1], &b[0]);
            tdpbf16ps(&mut c[3], &a[1], &b[1]);
        }
        for (tile, base) in c.iter().zip(addresses::quarters(row)) {
            for (m, tile_row) in tile.iter().enumerate() {
                sums[base + m * row..][..TILE].copy_from_slice(tile_row);
            }
        }
    }
}

/// The name of the choice that runs this kernel on [`Emulated`] where its tiles are not
/// [`available`] (and on them where they are): [`crate::choices::Choices::amx_on_model`].
pub const EMULATED: &str = "amx-emulated";

/// Whether bf16 products on this kernel run on [`Emulated`]: chosen
/// ([`crate::choices::Choices::amx_on_model`]), where the tiles are not [`available`].
pub fn emulated() -> bool {
    crate::choices::in_force().amx_on_model
}

/// `out += a[rows, ..k]·b[..k, cols]` into the tile's f32 sums `out` (`rows × cols`, row-major), or
/// `out =` it (`accumulate` false), on AMX's tiles, or on [`Emulated`] where asked for
/// ([`emulated`]). Panics if neither (the caller dispatches on [`available`]) and if `out` is too
/// small; the operands' ranges are the caller's to check.
pub fn tile<A: Element>(tile: &Tile<A>, packs: &mut Packs, out: (&mut [f32], bool)) {
    #[cfg(target_arch = "x86_64")]
    if let Some(unit) = Amx::new() {
        return tile_with(&unit, tile, packs, out);
    }
    assert!(emulated(), "AMX kernel: the CPU or the process has no AMX");
    tile_with(&Emulated, tile, packs, out)
}

/// [`tile`] on any [`TileUnit`].
pub(crate) fn tile_with<A: Element>(
    unit: &dyn TileUnit,
    tile: &Tile<A>,
    packs: &mut Packs,
    (out, accumulate): (&mut [f32], bool),
) {
    let Tile { a, b, k, .. } = *tile;
    let (rows, cols) = (tile.rows.clone(), tile.cols.clone());
    let (r, c) = (rows.len(), cols.len());
    assert!(out.len() >= r * c, "AMX kernel: tile buffer too small");
    let (row_blocks, col_blocks) = (r.div_ceil(MR), c.div_ceil(NR));
    let mut sums = [0f32; MR * NR];
    unit.begin();
    for k0 in (0..k).step_by(KC) {
        let pairs = KC.min(k - k0).div_ceil(2).next_multiple_of(TILE);
        // Each pack starts on a cache line, and so does each tile row in it (16 pairs, 64 bytes).
        let a_pack = zeroed_on_line(&mut packs.a, row_blocks * MR * pairs);
        pack_rows(a, rows.clone(), (k0, pairs, k), a_pack);
        // Whole blocks: a second, empty panel where the columns end in the first half of one.
        let b_pack = zeroed_on_line(&mut packs.b, col_blocks * 2 * TILE * pairs);
        crate::host::bf16_kernel::pack(&b.transposed(), cols.clone(), (k0, pairs, k), TILE, b_pack);
        let (a_pack, b_pack) = (&*a_pack, &*b_pack);
        for cb in 0..col_blocks {
            let panels = &b_pack[cb * 2 * TILE * pairs..(cb + 1) * 2 * TILE * pairs];
            for rb in 0..row_blocks {
                let a_block = &a_pack[rb * MR * pairs..(rb + 1) * MR * pairs];
                let (block_rows, block_cols) = (MR.min(r - rb * MR), NR.min(c - cb * NR));
                let first = rb * MR * c + cb * NR;
                if !(accumulate || k0 > 0) && (block_rows, block_cols) == (MR, NR) {
                    // A whole block written, not added: its sums go straight into `out`.
                    unit.block(a_block, panels, pairs, (&mut out[first..], c));
                    continue;
                }
                unit.block(a_block, panels, pairs, (&mut sums, NR));
                for (i, sums) in sums.chunks_exact(NR).take(block_rows).enumerate() {
                    let at = first + i * c;
                    put_sums(&mut out[at..at + block_cols], sums, accumulate || k0 > 0);
                }
            }
        }
    }
    unit.end();
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Small integers: every product and partial sum is exact in f32, so any order of summing
    /// gives the same bits.
    fn integers(len: usize, seed: usize) -> Vec<bf16> {
        (0..len)
            .map(|i| bf16::from_f32(((i * 7 + seed * 3) % 9) as f32 - 4.0))
            .collect()
    }

    /// The exact sums of `a·b`, added to the accumulator's initial values.
    fn exact(m: usize, n: usize, k: usize, a: &Operand, b: &Operand) -> Vec<f32> {
        let at =
            |o: &Operand, i: usize, j: usize| o.data[i * o.row_stride + j * o.col_stride].to_f32();
        (0..m * n)
            .map(|ij| {
                (0..k)
                    .map(|p| at(a, ij / n, p) * at(b, p, ij % n))
                    .sum::<f32>()
                    + ij as f32
            })
            .collect()
    }

    /// Every pair of `a`'s pack where the layout puts it (row by row) and zeros everywhere else,
    /// on every path (contiguous rows, strided ones), nothing written past it.
    #[test]
    fn row_packs_hold_each_pair_where_the_layout_puts_it() {
        use crate::host::bf16_kernel::tests::{each_packed_layout, PackOperand};
        for len in [530, 531] {
            each_packed_layout((45, len), |bits, x| {
                for rows in [0..45, 3..40, 5..6] {
                    for (k0, pairs) in [(0, 128), (256, 144), (512, 16)] {
                        let need = rows.len().next_multiple_of(MR) * pairs;
                        let mut want = vec![0u32; need + 64];
                        for (ii, i) in rows.clone().enumerate() {
                            let half = |k: usize| if k < len { bits(i, k) as u32 } else { 0 };
                            for p in 0..pairs {
                                want[ii * pairs + p] =
                                    half(k0 + 2 * p) | half(k0 + 2 * p + 1) << 16;
                            }
                        }
                        let mut got = vec![0u32; need + 64];
                        let strides = match &x {
                            PackOperand::Bf16(x) => {
                                pack_rows(x, rows.clone(), (k0, pairs, len), &mut got);
                                (x.row_stride, x.col_stride, "bf16")
                            }
                            PackOperand::F32(x) => {
                                pack_rows(x, rows.clone(), (k0, pairs, len), &mut got);
                                (x.row_stride, x.col_stride, "f32")
                            }
                        };
                        assert!(
                            got == want,
                            "{strides:?}, len {len}, rows {rows:?}, k0 {k0}"
                        );
                    }
                }
            });
        }
    }

    /// The packing, the blocks and the edges (rows and columns short of a block, an odd inner
    /// slice, several slices), on the model of the unit with either operand's layout, added into
    /// the output and written into it: the exact sums. Where the CPU has AMX, its tiles give the
    /// same bits.
    #[test]
    fn tiles_give_exact_sums_in_every_layout() {
        let amx = Amx::new();
        println!("AMX on this CPU: {}", amx.is_some());
        for (m, n, k) in [
            (1, 1, 1),
            (32, 32, 32),
            (33, 17, 65),
            (70, 100, 513),
            (40, 20, 298),
            (33, 33, 512),
            (5, 48, 3),
        ] {
            let (a_data, b_data) = (integers(2 * m * k + 1, 1), integers(2 * k * n + 1, 2));
            crate::host::half_product::each_layout((m, n, k), (&a_data, &b_data), |a, b| {
                let want = exact(m, n, k, &a, &b);
                let start: Vec<f32> = (0..m * n).map(|i| i as f32).collect();
                let tile = Tile {
                    a: &a,
                    rows: 0..m,
                    b: &b,
                    cols: 0..n,
                    k,
                };
                let layouts = format!(
                    "{m}x{n}x{k}, a strides ({}, {}), b ({}, {})",
                    a.row_stride, a.col_stride, b.row_stride, b.col_stride
                );
                let mut packs = Packs::default();
                let mut got = start.clone();
                tile_with(&Emulated, &tile, &mut packs, (&mut got, true));
                assert_eq!(got, want, "model {layouts}");
                // Written rather than added (whole blocks stored straight into the output): every
                // element, none left as it was.
                let written: Vec<f32> = want.iter().zip(&start).map(|(w, s)| w - s).collect();
                let mut got = vec![f32::NAN; m * n];
                tile_with(&Emulated, &tile, &mut packs, (&mut got, false));
                assert_eq!(got, written, "model, written, {layouts}");
                #[cfg(target_arch = "x86_64")]
                if let Some(amx) = &amx {
                    let mut got = start.clone();
                    tile_with(amx, &tile, &mut packs, (&mut got, true));
                    assert_eq!(got, want, "AMX {layouts}");
                    let mut got = vec![f32::NAN; m * n];
                    tile_with(amx, &tile, &mut packs, (&mut got, false));
                    assert_eq!(got, written, "AMX, written, {layouts}");
                }
            });
        }
    }

    /// On operands whose sums round (not small integers), the model adds in the AVX512-BF16
    /// kernel's order: the same bits as it, where the CPU has it, in every layout and across
    /// several inner slices. (The tiles themselves were measured near it, not equal: see
    /// [`Emulated`].)
    #[test]
    fn the_model_sums_in_the_dot_kernels_order() {
        if !crate::host::bf16_kernel::available() {
            println!("not checked: no AVX512-BF16 on this CPU");
            return;
        }
        let (m, n, k) = (37, 45, 600);
        let values = |len: usize, seed: u64| -> Vec<bf16> {
            (0..len as u64)
                .map(|i| {
                    bf16::from_f32(((i * 2654435761 + seed * 97) % 2001) as f32 / 1000.0 - 1.0)
                })
                .collect()
        };
        let (a_data, b_data) = (values(2 * m * k + 1, 1), values(2 * k * n + 1, 2));
        crate::host::half_product::each_layout((m, n, k), (&a_data, &b_data), |a, b| {
            let tile = Tile {
                a: &a,
                rows: 0..m,
                b: &b,
                cols: 0..n,
                k,
            };
            let (mut model, mut dot) = (vec![0.5f32; m * n], vec![0.5f32; m * n]);
            tile_with(&Emulated, &tile, &mut Packs::default(), (&mut model, true));
            crate::host::bf16_kernel::tile(&tile, &mut Default::default(), (&mut dot, true));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&model),
                bits(&dot),
                "a strides ({}, {}), b ({}, {})",
                a.row_stride,
                a.col_stride,
                b.row_stride,
                b.col_stride
            );
        });
    }

    /// A tile inside a larger product: rows and columns that start past 0.
    #[test]
    fn a_tile_inside_a_product() {
        let (m, n, k) = (80, 90, 40);
        let (a_data, b_data) = (integers(m * k, 3), integers(k * n, 4));
        let a = Operand {
            data: &a_data,
            row_stride: k,
            col_stride: 1,
        };
        let b = Operand {
            data: &b_data,
            row_stride: n,
            col_stride: 1,
        };
        let full: Vec<f32> = exact(m, n, k, &a, &b)
            .iter()
            .enumerate()
            .map(|(i, x)| x - i as f32)
            .collect();
        let (rows, cols) = (37..80, 5..66);
        let tile = Tile {
            a: &a,
            rows: rows.clone(),
            b: &b,
            cols: cols.clone(),
            k,
        };
        let mut units: Vec<(&str, &dyn TileUnit)> = vec![("model", &Emulated)];
        let amx = Amx::new();
        #[cfg(target_arch = "x86_64")]
        if let Some(amx) = &amx {
            units.push(("AMX", amx));
        }
        for (name, unit) in units {
            let mut got = vec![0f32; rows.len() * cols.len()];
            tile_with(unit, &tile, &mut Packs::default(), (&mut got, true));
            for (t, i) in rows.clone().enumerate() {
                assert_eq!(
                    got[t * cols.len()..(t + 1) * cols.len()],
                    full[i * n + cols.start..i * n + cols.end],
                    "{name}"
                );
            }
        }
    }

    /// The assembler's bytes for the instructions this kernel uses are Intel's encodings
    /// (`tdpbf16ps tmm0, tmm4, tmm6`: C4 E2 4A 5C C4, `a` in ModRM.rm, `b` in VEX.vvvv), so a
    /// mnemonic the assembler read otherwise than meant cannot pass unseen on CPUs without AMX.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_instructions_assemble_to_intels_encodings() {
        /// The bytes between two labels of an assembled sequence that is jumped over.
        fn bytes_of(start: *const u8, end: *const u8) -> Vec<u8> {
            let len = end as usize - start as usize;
            // SAFETY: both point into this function's text, `start` before `end`.
            unsafe { std::slice::from_raw_parts(start, len).to_vec() }
        }
        let (start, end): (*const u8, *const u8);
        // SAFETY: the sequence is jumped over, never run; only the labels' addresses are read.
        unsafe {
            std::arch::asm!(
                "lea {start}, [rip + 2f]",
                "lea {end}, [rip + 3f]",
                "jmp 3f",
                "2:",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm4, [rax + rcx*1]",
                "tilestored [rdx + rcx*1], tmm1",
                "tilezero tmm2",
                "tilerelease",
                "ldtilecfg [rax]",
                "3:",
                start = out(reg) start,
                end = out(reg) end,
                options(nostack, nomem)
            );
        }
        let want: Vec<u8> = [
            &[0xc4, 0xe2, 0x4a, 0x5c, 0xc4][..], // tdpbf16ps tmm0, tmm4, tmm6
            &[0xc4, 0xe2, 0x42, 0x5c, 0xdd],     // tdpbf16ps tmm3, tmm5, tmm7
            &[0xc4, 0xe2, 0x7b, 0x4b, 0x24, 0x08], // tileloadd tmm4, [rax + rcx]
            &[0xc4, 0xe2, 0x7a, 0x4b, 0x0c, 0x0a], // tilestored [rdx + rcx], tmm1
            &[0xc4, 0xe2, 0x7b, 0x49, 0xd0],     // tilezero tmm2
            &[0xc4, 0xe2, 0x78, 0x49, 0xc0],     // tilerelease
            &[0xc4, 0xe2, 0x78, 0x49, 0x00],     // ldtilecfg [rax]
        ]
        .concat();
        assert_eq!(bytes_of(start, end), want);
    }
}
