//! The host memory of the `gemm` crate's matrix products, which candle's CPU products and the
//! models' own host kernels run: derived from the blocking gemm itself derives on this CPU (its
//! cache sizes, read by `gemm-common`, and the kernel it dispatches to for the CPU's vector width),
//! not fitted on one machine.
//!
//! What gemm allocates (gemm-common 0.19, `gemm_basic_generic`):
//! - once per thread that runs a product, never freed: a slab the size of one core's L2 cache, in
//!   which it packs blocks of the left operand ([`thread_slabs`]);
//! - per call, freed when it returns: the right operand packed `kc × nc` when it is read along
//!   strided rows or is large, and the left one prepacked `kc × m` when it is short. `nc` is bounded
//!   by the L3 cache (`~(assoc − 1)/assoc` of it), so one call for a whole product with a wide
//!   operand can take tens of MiB (32 MiB under a 32 MiB L3); the host's products
//!   call it per output tile of at most 256 × 256 ([`workspace`]), which bounds it by the tile.
//!
//! Public so that `tests/gemm_workspace.rs` can hold [`workspace`] against what gemm allocates on
//! whichever CPU runs it (emulated ones included: `scripts/emulated-cpu.sh`).

use gemm_common::cache::{kernel_params, KernelParams, CACHE_INFO};

/// The shape of the register tile of the kernel gemm dispatches to for elements of `elem` bytes:
/// `(mr, nr, lanes)` (rows, columns, elements per vector register), as gemm-f32/f64 0.19 define them.
fn kernel(elem: usize) -> (usize, usize, usize) {
    #[cfg(target_arch = "x86_64")]
    {
        // gemm's `x86-v4` feature (the workspace turns it on): 4 × 6 tiles of 512-bit vectors.
        if std::arch::is_x86_feature_detected!("avx512f") {
            let lanes = 64 / elem;
            return (4 * lanes, 6, lanes);
        }
        if std::arch::is_x86_feature_detected!("fma") {
            let lanes = 32 / elem;
            return (2 * lanes, 6, lanes);
        }
    }
    // The scalar kernel (and, as an approximation, other architectures').
    (2, 4, 1)
}

/// Bytes gemm keeps for good once threads have run products: one L2-sized slab per thread of the
/// rayon pool (the engine runs every phase on it).
pub fn thread_slabs() -> u64 {
    (rayon::current_num_threads() * CACHE_INFO[1].cache_bytes) as u64
}

/// A product `C[m, n] = A[m, k] · B[k, n]` into a row-major `C`, as the planner sees it: whether `A`'s
/// elements are adjacent along `k` and `B`'s along `n` (a row-major operand's are; a transposed
/// view's are not).
#[derive(Debug, Clone, Copy)]
pub struct Product {
    m: usize,
    n: usize,
    k: usize,
    a_rows_contiguous: bool,
    b_rows_contiguous: bool,
    /// Whether calls narrower than `n`, of any width, run too ([`Product::with_narrower_calls`]).
    narrower: bool,
}

impl Product {
    /// `x · Wᵀ` for `x` `[rows, in]` and `W` `[out, in]` (a projection's forward, the logits).
    pub fn by_transposed(rows: usize, out: usize, inner: usize) -> Self {
        Self {
            m: rows,
            n: out,
            k: inner,
            a_rows_contiguous: true,
            b_rows_contiguous: false,
            narrower: false,
        }
    }

    /// `g · W` for `g` `[rows, out]` and `W` `[out, in]` (an input's gradient).
    pub fn by_plain(rows: usize, out: usize, inner: usize) -> Self {
        Self {
            m: rows,
            n: inner,
            k: out,
            a_rows_contiguous: true,
            b_rows_contiguous: true,
            narrower: false,
        }
    }

    /// `gᵀ · x` for `g` `[rows, out]`, `x` `[rows, in]` (a weight's gradient, `[out, in]`).
    pub fn transposed_by(out: usize, inner: usize, rows: usize) -> Self {
        Self {
            m: out,
            n: inner,
            k: rows,
            a_rows_contiguous: false,
            b_rows_contiguous: true,
            narrower: false,
        }
    }

    /// The same product, and calls like it narrower than `n` of any width (the attention's last
    /// block of keys, as wide as the chunks leave it), which can take more workspace than it.
    pub fn with_narrower_calls(self) -> Self {
        Self {
            narrower: true,
            ..self
        }
    }

    /// `A`'s column stride in the layout the engine gives it: 1 for a row-major `[m, k]`, `m` for a
    /// transposed view of a row-major `[k, m]`.
    fn a_col_stride(&self) -> usize {
        if self.a_rows_contiguous {
            1
        } else {
            self.m
        }
    }

    /// `B`'s row stride likewise: `n` for a row-major `[k, n]`, 1 for a view `Wᵀ` of a row-major
    /// `W` `[n, k]`.
    fn b_row_stride(&self) -> usize {
        if self.b_rows_contiguous {
            self.n
        } else {
            1
        }
    }

    /// `B`'s column stride: 1 for a row-major `[k, n]`, `k` for a view `Wᵀ`.
    fn b_col_stride(&self) -> usize {
        if self.b_rows_contiguous {
            1
        } else {
            self.k
        }
    }
}

/// Bytes a host product allocates while it runs, for elements of `elem` bytes: split into output
/// tiles that the threads take one each (`tiled`: the models' `cpu::product_into`, which every f32
/// and f64 product of a layer and of the LM head takes), or one single-threaded gemm call (the
/// attention kernel's, inside tasks that are themselves the parallelism). A tiled product holds
/// one tile's workspace per thread at once (at most: short tiles often do not overlap), and the
/// list of its tiles; a few rows by `Wᵀ` take the models' `skinny` kernel, which allocates nothing.
pub fn workspace(p: Product, elem: usize, tiled: bool) -> u64 {
    if !tiled {
        return call_workspace(p, elem);
    }
    if crate::host::skinny::applies(p.m, p.a_col_stride(), p.b_row_stride()) {
        return 0;
    }
    let (tm, tn) = crate::host::products::tile_sizes(p.m, p.n);
    let tiles = p.m.div_ceil(tm) * p.n.div_ceil(tn);
    // A full tile, and the last column's tiles where the columns do not divide into whole ones.
    let tile = |n: usize| {
        let tile = Product {
            m: tm.min(p.m),
            n,
            ..p
        };
        call_workspace(tile, elem)
    };
    let edge = match p.n % tn {
        0 => 0,
        cols => tile(cols),
    };
    let tile_list = (tiles * std::mem::size_of::<(usize, usize)>()) as u64;
    rayon::current_num_threads().min(tiles) as u64 * tile(tn.min(p.n)).max(edge) + tile_list
}

/// Bytes one single-threaded product allocates while it runs, for elements of `elem` bytes (and of
/// any narrower one, [`Product::with_narrower_calls`]): where `B` is a transposed view, the copy
/// of a slab of its columns into rows (kept across the slabs, the first the widest) beside the
/// gemm call on each (`crate::host::transpose`), else the call's own.
///
/// gemm packs a slab only where its columns do not fill its vectors, as a full slab's do but the
/// last slab's may not; for a narrower call, at most one column short of a slab, under either of
/// gemm's blockings (its small-size one up to 64 columns).
fn call_workspace(p: Product, elem: usize) -> u64 {
    let b_strides = (p.b_row_stride(), p.b_col_stride());
    let Some(slab) = crate::host::transpose::slab_columns((p.m, p.n, p.k), b_strides) else {
        return gemm_call_workspace(p, elem);
    };
    let on_rows = |n: usize| {
        let slab = Product {
            n,
            b_rows_contiguous: true,
            ..p
        };
        gemm_call_workspace(slab, elem)
    };
    let mut widths = vec![slab, p.n % slab];
    if p.narrower {
        widths.extend([slab - 1, (slab - 1).min(63)]);
    }
    let packing = widths.into_iter().filter(|&n| n > 0).map(on_rows).max();
    (p.k * slab * elem) as u64 + packing.unwrap_or(0)
}

/// Bytes one single-threaded gemm call allocates while it runs, for elements of `elem` bytes.
fn gemm_call_workspace(p: Product, elem: usize) -> u64 {
    if p.m == 0 || p.n == 0 || p.k <= 2 {
        return 0;
    }
    // gemm computes a row-major destination as its transpose, `Cᵀ = Bᵀ·Aᵀ`: its left operand is B
    // (`n` rows), its right A; the right is "row-strided" unless A's elements are adjacent along k.
    let (m, n, k) = (p.n, p.m, p.k);
    let rhs_unit_rows = p.a_rows_contiguous;
    let lhs_unit_rows = p.b_rows_contiguous;
    if n <= 1 || m <= 1 {
        return 0; // matrix-vector products
    }
    let (mr, nr, lanes) = kernel(elem);
    let KernelParams { kc, mc, nc } = if m <= 64 && n <= 64 {
        let kc = k.min(512);
        let mc = (CACHE_INFO[1].cache_bytes / elem / kc) / mr * mr;
        KernelParams {
            kc,
            mc,
            nc: n.next_multiple_of(nr),
        }
    } else {
        kernel_params(m, n, k, mr, nr, elem)
    };
    // No L3 cache size known: gemm's choice for a call on one thread.
    let nc = if nc == 0 { 128 * nr } else { nc };
    let rhs_threshold = gemm::get_rhs_packing_threshold();
    let pack_rhs = (!rhs_unit_rows && m > 2 * mr) || (rhs_unit_rows && m > rhs_threshold * mr);
    let prepack_lhs = m <= 2 * mc && (m % lanes != 0 || !lhs_unit_rows);
    // Each part is aligned to gemm's 128-byte cache-line alignment.
    let part = |elements: usize| (elements * elem + 128) as u64;
    let rhs = if pack_rhs { part(kc * nc) } else { 0 };
    let lhs = if prepack_lhs {
        part(kc * m.next_multiple_of(mr))
    } else {
        0
    };
    rhs + lhs
}
