//! The chunk planner: explicit chunk sizes, or the largest that fit a memory budget according to a
//! cost model of the streamed backward's peak bytes.
//!
//! The model counts what `stream` holds at its peak (see `engine.rs`):
//! - held throughout: parameters, gradient accumulators, the `L + 1` layer checkpoints `[b, T, d]`;
//! - in a layer's backward: K, V and their pending gradients, the incoming and outgoing `[b, T, d]`
//!   gradients, and one chunk's graph: its activations (`c × (d, q, kv, ffn)` several times) and its
//!   attention scores against one block of keys (`heads × c × min(T, KEY_BLOCK)` in f32, a few copies
//!   inside the attention op's backward);
//! - in the head: one logits chunk `c × V` (model dtype, an f32 copy and a few f32 temporaries) and the
//!   gradient of the head weight.
//!
//! The copy counts are fitted to peaks measured with the counting allocator (CPU, f32, candle 0.11,
//! `streambp-bench` on `benches/configs/qwen3-small.json`, T = 1024/2048, chunk 128/256, logits chunk
//! 100/400; the attention count refitted at T = 4096 after the attention became one op): a chunk's
//! attention holds about 5 f32 copies of its `heads × c × key block` scores at once (inside the
//! attention op's backward; none stay in the graph), a logits chunk about 3.4 f32 copies of `c × V`. The bench prints
//! the model's error next to every measured stream peak.

use candle_core::DType;
use streambp_models::ModelConfig;

use crate::engine::Chunks;
use crate::error::{EngineError, Result};

/// Shape of one backward problem.
#[derive(Debug, Clone, Copy)]
pub struct Problem<'a> {
    pub config: &'a ModelConfig,
    pub batch: usize,
    pub seq_len: usize,
    pub dtype: DType,
}

/// Estimated peak bytes of the phases of a streamed backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    pub resident: u64,
    pub layer_phase: u64,
    pub head_phase: u64,
}

impl Estimate {
    pub fn peak(&self) -> u64 {
        self.resident + self.layer_phase.max(self.head_phase)
    }
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
    let grad_bytes = if e < 4 { f32b } else { e };
    let params = parameter_count(cfg);
    let in_flight = params.saturating_sub(vocab * d) / layers.max(1) + vocab * d;
    let resident = params * 2 * e + in_flight * (grad_bytes - e) + (layers + 1) * b * t * d * e;

    let c = (chunks.chunk as u64).min(t);
    // The attention op scores a chunk against one block of keys at a time.
    let keys = t.min(streambp_models::attention::KEY_BLOCK as u64);
    let kv_state = 4 * b * t * kv * e;
    let grads_io = 2 * b * t * d * e;
    let chunk_acts = b * c * (8 * d + 4 * q + 4 * kv + 6 * ffn) * e;
    // The attention op keeps no score-sized tensor in the graph; its backward holds about five at once.
    let scores = 5 * b * heads * c * keys * f32b.max(e);
    let layer_phase = kv_state + grads_io + chunk_acts + scores;

    let lc = (chunks.logits_chunk as u64).min(t);
    let logits = b * lc * vocab * (e + 3 * f32b.max(e));
    let head_phase = b * t * d * e + logits + vocab * d * grad_bytes;
    Estimate {
        resident,
        layer_phase,
        head_phase,
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
