//! The chunk planner: explicit chunk sizes, or the largest that fit a memory budget according to a
//! cost model of the streamed backward's peak bytes.
//!
//! The model counts what `stream` holds at its peak (see `engine.rs`):
//! - throughout: parameters, gradient accumulators and the rope tables (`2 × T × head_dim`);
//! - the layer checkpoints `[b, T, d]`: `L + 1` in the head, `L` when the layers' backward starts, one
//!   at a time when they are offloaded to the host;
//! - in a layer's backward: K, V and their pending gradients, the incoming and outgoing `[b, T, d]`
//!   gradients, and one chunk's graph: its activations (`c × (d, q, kv, ffn)` several times) and its
//!   attention scores against one block of keys (`heads × c × min(T, KEY_BLOCK)` in f32, a few copies
//!   inside the attention op's backward);
//! - in the head: one logits chunk `c × V` (model dtype, an f32 copy and a few f32 temporaries) and the
//!   gradient of the head weight;
//! - in the embedding's backward: two `[b, T, d]` tensors, and off the host (or in half precision) two
//!   copies of the table's gradient (on the host in f32/f64 its rows go into the accumulator in place).
//!
//! The copy counts are fitted to peaks measured with the counting allocator (CPU, candle 0.11,
//! `streambp-bench` on the bench's small model config in f32 at T = 1024/2048, chunk 128/256, logits
//! chunk 100/400, the host head's logits count refitted once its softmax ran in place, the attention count refitted at T = 4096 after the attention became one op; the head
//! and embedding phases refitted per phase on it and on `tests/planner.rs`'s model, f32 and bf16, at
//! T = 1024..4096; the layer phase refitted on both once the mask and the earlier keys' gradients stopped
//! taking `c × T` and `T × kv` copies, so as never to under-estimate by more than 5%): a chunk's
//! attention holds about 4.1 f32 copies of its `heads × c × key block` scores at once (inside the attention op's backward; none stay in the graph; on the host two per running task of its kernel), a logits chunk 4 f32 copies
//! of `c × V` (on the host 2 in f32/f64, 1 in half precision; 4 more in the model dtype for half
//! precision). `tests/planner.rs` checks the model against measured peaks; the bench prints
//! its error next to every measured stream peak, and `--predict` prints its estimate for shapes too
//! large to run here.

use candle_core::DType;
use streambp_models::{LoraConfig, ModelConfig, Projection};

use crate::engine::Chunks;
use crate::error::{EngineError, Result};

/// Shape of one backward problem.
#[derive(Debug, Clone, Copy)]
pub struct Problem<'a> {
    /// The model's architecture (sizes, layer count, vocabulary).
    pub config: &'a ModelConfig,
    /// Rows in the batch.
    pub batch: usize,
    /// Tokens per row (`T`).
    pub seq_len: usize,
    /// The model's parameter and activation dtype.
    pub dtype: DType,
    /// The layer checkpoints live outside the memory being planned: offloaded to the host from an
    /// accelerator (see [`crate::Options::offloads_from`]). The device then holds the last layer's output
    /// during the head and one layer's input at a time during the layers.
    pub offloaded: bool,
    /// LoRA: only these adapters are trained (frozen base weights get no gradient, the head and the
    /// embedding none either); `None`: every weight is.
    pub lora: Option<&'a LoraConfig>,
    /// The device is the host CPU, where the head's softmax runs as hand-written passes that hold
    /// fewer logits-sized buffers than the tensor ops other devices run.
    pub host: bool,
}

impl<'a> Problem<'a> {
    /// The problem of a backward of `model` on a `[batch, seq_len]` batch with `options`.
    pub fn of(
        model: &'a streambp_models::Model,
        batch: usize,
        seq_len: usize,
        options: crate::Options,
    ) -> Self {
        Self {
            config: &model.config,
            batch,
            seq_len,
            dtype: model.dtype(),
            offloaded: options.offloads_from(model.device()),
            lora: model.lora(),
            host: model.device().is_cpu(),
        }
    }
}

/// How a run sets its chunk sizes: the same for every batch, or the largest a memory budget allows for
/// each batch's shape. The trainer, the `grad` command and the bench all choose through this.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkPolicy {
    /// These chunk sizes for every batch.
    Fixed(Chunks),
    /// The largest chunks whose estimated peak fits this many bytes ([`plan_for_budget`]).
    Budget(u64),
}

impl ChunkPolicy {
    /// The chunks for `problem`.
    pub fn chunks_for(&self, problem: Problem) -> Result<Chunks> {
        match *self {
            ChunkPolicy::Fixed(chunks) => Ok(chunks),
            ChunkPolicy::Budget(budget) => plan_for_budget(problem, budget),
        }
    }
}

/// Estimated peak bytes of the phases of a streamed backward: what stays allocated throughout (weights
/// and gradients) and each phase's own peak above it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    /// Bytes held throughout: parameters, gradient accumulators and the rope tables.
    pub resident: u64,
    /// Peak bytes above `resident` during the LM head's backward.
    pub head_phase: u64,
    /// Peak bytes above `resident` during the layers' backward.
    pub layer_phase: u64,
    /// Peak bytes above `resident` during the embedding's backward.
    pub embedding_phase: u64,
}

impl Estimate {
    /// The estimated peak of the whole backward, in bytes: `resident` plus the largest phase.
    pub fn peak(&self) -> u64 {
        self.resident
            + self
                .head_phase
                .max(self.layer_phase)
                .max(self.embedding_phase)
    }
}

/// The number of adapter values LoRA with `lora` adds to a model of `cfg`: `r · (in + out)` for every
/// target projection of every layer.
pub fn adapter_count(cfg: &ModelConfig, lora: &LoraConfig) -> u64 {
    let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    );
    let per_layer: usize = lora
        .targets
        .iter()
        .map(|p| match p {
            Projection::Q => d + q,
            Projection::K | Projection::V => d + kv,
            Projection::O => q + d,
            Projection::Gate | Projection::Up | Projection::Down => d + f,
        })
        .sum();
    (lora.r * per_layer * cfg.num_layers()) as u64
}

fn parameter_count(cfg: &ModelConfig) -> u64 {
    cfg.parameter_shapes()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() as u64)
        .sum()
}

/// The cost model of `stream` with the given chunk sizes.
pub fn estimate(p: Problem, chunks: Chunks) -> Estimate {
    let cfg = p.config;
    let e = p.dtype.size_in_bytes() as u64;
    let f32b = 4u64;
    let (b, t) = (p.batch as u64, p.seq_len as u64);
    let d = cfg.hidden_size as u64;
    let q = (cfg.num_heads * cfg.head_dim) as u64;
    let kv = (cfg.num_kv_heads * cfg.head_dim) as u64;
    let ffn = cfg.intermediate_size as u64;
    let heads = cfg.num_heads as u64;
    let vocab = cfg.vocab_size as u64;
    let layers = cfg.num_layers() as u64;
    // Gradient accumulators are f32 for half-precision models, rounded to the model dtype once a
    // layer is done: f32 only for the layer in flight and the embedding table.
    let half = e < 4;
    let grad_bytes = if half { f32b } else { e };
    let params = parameter_count(cfg);
    let in_flight = params.saturating_sub(vocab * d) / layers.max(1) + vocab * d;
    // The rope tables (cos and sin for every position), built once per backward.
    let rope = 2 * t * cfg.head_dim as u64 * e;
    // Full fine-tuning: weights and their gradients. LoRA: the frozen weights, and the adapters with
    // their gradients (f32, or f64 for an f64 model); the head's and the table's gradients never exist.
    let (resident, head_grad, table_grad) = match p.lora {
        None => (
            params * 2 * e + in_flight * (grad_bytes - e) + rope,
            vocab * d * grad_bytes,
            vocab * d * (e + grad_bytes),
        ),
        Some(lora) => {
            let adapter_bytes = f32b.max(e) * 2 * adapter_count(cfg, lora);
            (params * e + adapter_bytes + rope, 0, 0)
        }
    };

    // `[b, T, d]` hidden states; the checkpoints on the device: `L + 1` in the head, `L` when the
    // last layer's backward starts (one fewer per layer after it), one at a time when offloaded.
    let hidden = b * t * d * e;
    let checkpoints = |n: u64| if p.offloaded { hidden } else { n * hidden };

    let lc = (chunks.logits_chunk as u64).min(t);
    // The scores in the compute dtype, their softmax, its VJP and the target scatter; on the host the
    // scores, which their softmax and its VJP overwrite, and in f32/f64 gemm's packed copy of the VJP
    // while its product adds into the head's gradient; half precision adds the raw logits, the
    // rounded VJP and temporaries (fitted).
    let half_logits = if half { 4 * e } else { 0 };
    let buffers = match (p.host, half) {
        (true, false) => 2,
        (true, true) => 1,
        (false, _) => 4,
    };
    let logits = b * lc * vocab * (buffers * f32b.max(e) + half_logits);
    // Each chunk's share of the head weight's gradient: added into the accumulator by the product
    // itself on the host in f32/f64, a `[V, d]` buffer elsewhere.
    let head_share = if p.host && !half { 0 } else { head_grad };
    let head_phase = checkpoints(layers + 1) + hidden + logits + head_share;

    let c = (chunks.chunk as u64).min(t);
    // The attention op scores a chunk against one block of keys at a time.
    let key_block = streambp_models::attention::KEY_BLOCK as u64;
    let kv_state = 4 * b * t * kv * e;
    let grads_io = 2 * hidden;
    let chunk_acts = b * c * (6 * d + 7 * q + 3 * kv + 10 * ffn) * e;
    // The attention op keeps no score-sized tensor in the graph. Its backward holds about four at
    // once for the chunk that scores the most keys; on the host in f32/f64, where its kernel runs
    // each (row, key/value head, key block) as a task, each running task holds two (the block's
    // probabilities and their gradient) for its head's group of query heads...
    let scores = if p.host && !half {
        let blocks = t.div_ceil(key_block) + 1;
        let items = b * cfg.num_kv_heads as u64;
        let threads = rayon::current_num_threads() as u64;
        let running = (items * blocks).min(threads);
        let group = heads / (cfg.num_kv_heads as u64).max(1);
        // ... and the share of dQ of each block of a wave (as many blocks as keep the threads busy)
        // until the wave is summed.
        let wave = threads.div_ceil(items.max(1)).clamp(1, blocks);
        let shares = b * heads * c * cfg.head_dim as u64 * wave * e;
        2 * running * group * score_area(t, c, key_block) * e + shares
    } else {
        41 * b * heads * score_area(t, c, key_block) * f32b.max(e) / 10
    };
    let layer_phase = checkpoints(layers) + kv_state + grads_io + chunk_acts + scores;

    // The embedding's VJP (written out): the incoming `[b, T, d]` gradient and its scaled rows. On the
    // host in f32/f64 the rows are added into the table's accumulator in place; elsewhere the table's
    // gradient is made (model dtype; an f32 copy of it for half precision) and summed with the
    // accumulated one (on the host the f32 copy is added in place).
    let table_sum = match (p.host && !half, half && !p.host && table_grad > 0) {
        (true, _) => 0,
        (false, true) => table_grad + vocab * d * f32b,
        (false, false) => table_grad,
    };
    let embedding_phase = match p.lora {
        Some(_) => 0,
        None => 2 * hidden + table_sum,
    };
    Estimate {
        resident,
        head_phase,
        layer_phase,
        embedding_phase,
    }
}

/// The largest `queries × keys in one block` over the query chunks of `c` in `t` tokens. A chunk
/// starting at `s` reads its `s` earlier keys in blocks of `key_block` and its own keys as one more
/// block, so its largest block is `max(min(s, key_block), len)`; the largest product is that of the
/// last chunk or of the one before it (the last full one).
fn score_area(t: u64, c: u64, key_block: u64) -> u64 {
    let chunks = t.div_ceil(c);
    let area = |start: u64, len: u64| len * start.min(key_block).max(len.min(key_block));
    let last = area((chunks - 1) * c, t - (chunks - 1) * c);
    match chunks > 1 {
        true => last.max(area((chunks - 2) * c, c)),
        false => last,
    }
}

/// Share of the budget the chunks are planned for: the cost model's measured error is within about
/// ±6% (docs/benchmarks.md), so planning for the whole budget would overshoot it about half the time.
pub const BUDGET_MARGIN: f64 = 0.93;

/// The largest chunk sizes (up to `T`) whose estimated peak fits in [`BUDGET_MARGIN`] of `budget` bytes.
pub fn plan_for_budget(p: Problem, budget: u64) -> Result<Chunks> {
    let budget_in = budget;
    let budget = (budget as f64 * BUDGET_MARGIN) as u64;
    let smallest = Chunks {
        chunk: 1,
        logits_chunk: 1,
    };
    let floor = estimate(p, smallest).peak();
    if floor > budget {
        return Err(EngineError::BudgetTooSmall {
            budget: budget_in,
            needed: (floor as f64 / BUDGET_MARGIN).ceil() as u64,
        });
    }
    // Both phases are monotone in their chunk; search each on its own with the other at 1.
    let largest = |f: &dyn Fn(usize) -> Chunks| {
        let (mut lo, mut hi) = (1usize, p.seq_len.max(1));
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if estimate(p, f(mid)).peak() <= budget {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    };
    let chunk = largest(&|c| Chunks {
        chunk: c,
        logits_chunk: 1,
    });
    let logits_chunk = largest(&|c| Chunks {
        chunk: 1,
        logits_chunk: c,
    });
    Ok(Chunks {
        chunk,
        logits_chunk,
    })
}
