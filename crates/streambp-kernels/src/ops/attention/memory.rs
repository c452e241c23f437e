//! What the attention op holds beyond its inputs and output, by backend: for the planner, which adds
//! it to a layer's backward and forward. The terms are fitted to peaks measured exactly with the
//! counting allocator (docs/benchmarks.md, "The planner's cost model"); gemm's workspace is derived.

use super::kernel::MAX_ROW_TILE;
use super::KEY_BLOCK;
use crate::backend::Backend;
use crate::host::gemm_memory::{self, Product};
use crate::host::transpose::COLUMNS_MULTIPLE;

/// The sizes the op's memory depends on.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Rows of the batch.
    pub batch: u64,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Elements per head.
    pub head_dim: u64,
    /// Queries of a chunk.
    pub queries: u64,
    /// Keys of the sequence.
    pub keys: u64,
    /// Bytes of the dtype the op computes in.
    pub element: u64,
    /// Threads the CPU kernel's tasks run on.
    pub threads: u64,
}

impl Sizes {
    fn group(&self) -> u64 {
        self.heads / self.kv_heads.max(1)
    }

    /// The CPU kernel's tasks: a key/value head of a row each.
    fn items(&self) -> u64 {
        self.batch * self.kv_heads
    }
}

/// The most bytes the backward of one chunk of queries holds at once in score-sized buffers (the
/// chunk that scores the most keys: [`score_area`]), with the products' workspace, on `backend`.
pub fn backward_bytes(s: Sizes, backend: Backend) -> u64 {
    let key_block = KEY_BLOCK as u64;
    let (t, c) = (s.keys, s.queries);
    match backend {
        // Each running task (a row, key/value head and key block) holds two score tiles (the
        // block's probabilities and their gradient) for its head's group of query heads, and its
        // products' workspace; each block of a wave (as many as keep the threads busy) holds its
        // share of dQ until the wave is summed.
        Backend::Cpu => {
            let blocks = t.div_ceil(key_block) + 1;
            let running = (s.items() * blocks).min(s.threads);
            let (rows, n, hd) = (
                (s.group() * c) as usize,
                key_block.min(t) as usize,
                s.head_dim as usize,
            );
            // The last block of keys is as wide as the chunks leave it: whole vectors (of the copy
            // of a transposed view, `host::transpose`) where the chunk and `T` are, any width else.
            let whole = COLUMNS_MULTIPLE as u64;
            let aligned = c % whole == 0 && t % whole == 0;
            let products = [
                Product::by_transposed(rows, n, hd),
                Product::transposed_by(n, hd, rows),
                Product::by_plain(rows, n, hd),
            ]
            .map(|p| match aligned {
                true => p,
                false => p.with_narrower_calls(),
            });
            let elem = s.element.max(4) as usize;
            let workspace = products
                .iter()
                .map(|&p| gemm_memory::workspace(p, elem, false))
                .max()
                .unwrap_or(0);
            let area = s.group() * score_area(t, c, key_block);
            let task = 2 * area * s.element + workspace;
            let wave = s.threads.div_ceil(s.items().max(1)).clamp(1, blocks);
            let shares = s.batch * s.heads * c * s.head_dim * wave * s.element;
            running * task + shares
        }
        // The fused kernels (a card's, where they have the head dim and dtype): no score is ever
        // stored; the forward's log-sum-exp and the backward's delta, one f32 per query and head.
        Backend::Cuda if fused_kernels_take(s) => 2 * s.batch * s.heads * c * 4,
        // The composed ops: about four score tensors of a block at once (fitted: 4.1).
        Backend::Cuda | Backend::Composed => {
            41 * s.batch * s.heads * score_area(t, c, key_block) * s.element.max(4) / 10
        }
    }
}

/// Whether the card's fused kernels were compiled for the op's head dim and dtype (on a card whose
/// architecture has none, the composed ops run and hold more than planned: logged when it happens).
fn fused_kernels_take(s: Sizes) -> bool {
    let dtype = match s.element {
        2 => "bf16",
        4 => "fp32",
        _ => return false,
    };
    super::cuda_table::find("attention_forward", 90, dtype, s.head_dim as usize).is_some()
}

/// The bytes a bf16 layer's forward on the CPU kernel adds (`Products::Bf16`): each running task
/// rounds its block's exponentials (a tile of at most `MAX_ROW_TILE` query rows by a key block)
/// into a copy, which its kernel packs.
pub fn bf16_forward_bytes(s: Sizes) -> u64 {
    let rows = (s.group() * s.queries).min(MAX_ROW_TILE as u64);
    s.items().min(s.threads) * rows * (KEY_BLOCK as u64).min(s.keys) * (2 + 2)
}

/// The largest `queries × keys in one block` over the query chunks of `c` in `t` tokens. A chunk
/// starting at `s` reads its `s` earlier keys in blocks of `key_block` and its own keys as one more
/// block, so its largest block is `max(min(s, key_block), len)`; the largest product is that of the
/// last chunk or of the one before it (the last full one).
pub fn score_area(t: u64, c: u64, key_block: u64) -> u64 {
    let chunks = t.div_ceil(c);
    let area = |start: u64, len: u64| len * start.min(key_block).max(len.min(key_block));
    let last = area((chunks - 1) * c, t - (chunks - 1) * c);
    match chunks > 1 {
        true => last.max(area((chunks - 2) * c, c)),
        false => last,
    }
}
