//! The chunk planner: explicit chunk sizes, or the largest that fit a memory budget according to a
//! cost model of the streamed backward's peak bytes.
//!
//! The model counts what `stream` holds in each of its phases (see `engine/`):
//! - throughout: parameters, the rope tables (`2 × T × head_dim`), a few bytes per token (ids,
//!   positions, targets, log-probs) and, on the host, gemm's per-thread packing slabs;
//! - gradient accumulators as the backward makes them: the head's in the head, all of them once the
//!   layers are done;
//! - the layer checkpoints `[b, T, d]`: `L + 1` at the forward's end and in the head, `L` when the
//!   layers' backward starts, one at a time when they are offloaded to the host; with one stored per
//!   segment of `K` layers, `⌈L/K⌉ + 1` and in the backward those not yet reached plus the
//!   segment in flight's `K` recomputed inputs;
//! - in the forward: one layer's keys and values and a chunk's activations (and, for half precision
//!   on the host, computed in f32, that layer's weights widened to f32, as in its backward);
//! - in the head, per logits chunk: its logits `lc × V` (on the host one f32 buffer, which the softmax
//!   and its VJP overwrite; four elsewhere, half precision more) and its `lc × d` rows (the hidden
//!   state's copy, the final norm and its backward, the hidden state's gradient);
//! - in a layer's backward: K, V and their pending gradients, the incoming and outgoing `[b, T, d]`
//!   gradients, and one chunk's graph: its activations (`c × (d, q, kv, ffn)` several times) and
//!   the larger of its gradients' two peaks: the attention op's backward, with its scores against
//!   one block of keys (`heads × c × min(T, KEY_BLOCK)`, a few copies; on the host two per running
//!   task of its kernel), or the MLP's;
//! - in the embedding's backward: the incoming `[b, T, d]` gradient (and its f32 copy in half
//!   precision on the host), and off the host copies of the table's gradient;
//! - on the host, the largest packing workspace of the phase's matrix products, from the blocking
//!   gemm derives on the running CPU ([`gemm_memory`]): this, and the slabs, are what differ
//!   between CPUs (tens of MiB on a CPU with a large L3 cache, for products with a wide operand).
//!
//! The copy counts are fitted to peaks measured exactly with the counting allocator (CPU, candle 0.11)
//! over the shapes of `tests/planner.rs` — vocabularies 16 to 256K, hidden sizes 64 to 8192, one of
//! `d`, `q`, `kv` or `ffn` far wider than the others, T up to 64K, batch 2 and 3, LoRA, f32, f64 and
//! bf16 — on one CPU (docs/benchmarks.md, "The planner's cost model"), with gemm's workspace
//! derived, not fitted, so that they hold where gemm blocks differently. The test checks the model against measured peaks; the bench prints its error next to
//! every measured stream peak, and `--predict` prints its estimate for shapes too large to run here.

use candle_core::DType;
use streambp_kernels::host::gemm_memory::{self, Product};
use streambp_kernels::ops::attention::memory as attention;
use streambp_kernels::Backend;
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
    /// accelerator (see [`crate::Options::offloads_from`]) or on disk (`checkpoint_dir`). The device then holds the last layer's output
    /// during the head and one layer's input at a time during the layers.
    pub offloaded: bool,
    /// Layers per stored checkpoint (`K` of [`crate::CheckpointEvery`], resolved for this model;
    /// 1: every layer's input is stored).
    pub checkpoint_every: usize,
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
        options: &crate::Options,
    ) -> Self {
        Self {
            config: &model.config,
            batch,
            seq_len,
            dtype: model.dtype(),
            offloaded: options.offloads_from(model.device()) || options.checkpoint_dir.is_some(),
            checkpoint_every: options.checkpoint_every.layers(model.layers.len()),
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
    /// The largest chunks whose estimated peak fits this many bytes ([`plan_for_budget`]), storing
    /// fewer checkpoints or moving them to the tiers allowed where that keeps the chunks from
    /// getting small ([`plan_with_checkpoints`]).
    Budget(u64, Tiers),
}

/// Where a budget plan may move the stored checkpoints out of the memory it plans. With a budget
/// the plan decides where they go; these say what is available.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tiers {
    /// Host memory for them, in bytes (`--host-memory-budget`, or unbounded for
    /// `--offload-checkpoints` alone; used off the CPU only).
    pub host: Option<u64>,
    /// A checkpoint directory is given (`--checkpoint-dir`).
    pub disk: bool,
}

impl Tiers {
    /// What `options` make available, with `host_budget` bytes of host memory for checkpoints.
    pub fn of(options: &crate::Options, host_budget: Option<u64>) -> Self {
        Self {
            host: host_budget.or(options.offload_checkpoints.then_some(u64::MAX)),
            disk: options.checkpoint_dir.is_some(),
        }
    }
}

/// Where a plan keeps the stored checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CheckpointPlace {
    /// With the rest of the planned memory (the device's).
    Device,
    /// In host memory, off an accelerator.
    Host,
    /// In a scratch file in the checkpoint directory.
    Disk,
}

impl ChunkPolicy {
    /// The chunks for `problem` (at its own `checkpoint_every`).
    pub fn chunks_for(&self, problem: Problem) -> Result<Chunks> {
        match *self {
            ChunkPolicy::Fixed(chunks) => Ok(chunks),
            ChunkPolicy::Budget(budget, _) => plan_for_budget(problem, budget),
        }
    }

    /// The chunks, the layers per stored checkpoint and where they are kept for `problem`: fixed
    /// chunks keep the problem's own; a budget may store fewer or move them out of the planned
    /// memory ([`plan_with_checkpoints`]), which changes memory and time but not the gradients.
    pub fn plan_for(&self, problem: Problem) -> Result<Planned> {
        match *self {
            ChunkPolicy::Fixed(chunks) => Ok(Planned {
                chunks,
                checkpoint_every: problem.checkpoint_every,
                place: None,
            }),
            ChunkPolicy::Budget(budget, tiers) => plan_with_checkpoints(problem, budget, tiers),
        }
    }
}

/// What a policy decided for one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    /// The query chunk and the LM head's chunk.
    pub chunks: Chunks,
    /// Layers per stored checkpoint (`K`).
    pub checkpoint_every: usize,
    /// Where the stored checkpoints go, when the plan chose it (`None`: as the options say).
    pub place: Option<CheckpointPlace>,
}

impl Planned {
    /// `options` with this plan's layers per stored checkpoint and, when it chose one, their place
    /// (`Disk` keeps the options' checkpoint directory, the others drop it).
    pub fn options(&self, options: crate::Options) -> crate::Options {
        let options = crate::Options {
            checkpoint_every: crate::CheckpointEvery::Layers(self.checkpoint_every),
            ..options
        };
        match self.place {
            None => options,
            Some(place) => crate::Options {
                offload_checkpoints: place == CheckpointPlace::Host,
                checkpoint_dir: match place {
                    CheckpointPlace::Disk => options.checkpoint_dir.clone(),
                    _ => None,
                },
                ..options
            },
        }
    }
}

/// Estimated peak bytes of the phases of a streamed backward: what stays allocated throughout and each
/// phase's own peak above it (its gradient accumulators included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    /// Bytes held throughout: parameters, the rope tables and, on the host, gemm's per-thread packing
    /// slabs.
    pub resident: u64,
    /// Peak bytes above `resident` during the forward that stores the checkpoints.
    pub forward_phase: u64,
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
                .forward_phase
                .max(self.head_phase)
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
    let layer_params = params.saturating_sub(vocab * d) / layers.max(1);
    let in_flight = layer_params + vocab * d;
    // The rope tables (cos and sin for every position), built once per backward.
    let rope = 2 * t * cfg.head_dim as u64 * e;
    // On the host, gemm's per-thread packing slabs (kept for the process's life).
    let slabs = if p.host {
        gemm_memory::thread_slabs()
    } else {
        0
    };
    // Full fine-tuning: weights, and gradients made as the backward reaches them: the head's (the
    // table's when tied) in the head, every one once the layers are done. LoRA: the frozen weights,
    // and the adapters with their gradients (f32, or f64 for an f64 model); the head's and the
    // table's gradients never exist.
    // Once the layers are done, only the table's accumulator is still in f32.
    let (weights, grads, grads_after_layers, head_grad, table_grad) = match p.lora {
        None => (
            params * e,
            params * e + in_flight * (grad_bytes - e),
            params * e + vocab * d * (grad_bytes - e),
            vocab * d * grad_bytes,
            vocab * d * (e + grad_bytes),
        ),
        Some(lora) => {
            let adapters = adapter_count(cfg, lora) * f32b.max(e);
            (params * e + adapters, adapters, adapters, 0, 0)
        }
    };
    // Per token: the batch's ids, positions, targets and log-probs (fitted: 48 bytes).
    let tokens = b * t * 48;
    let resident = weights + rope + slabs + tokens;

    // `[b, T, d]` hidden states; the checkpoints on the device: one per segment of `K` layers and
    // the last output at the forward's end and in the head (`L + 1` for `K = 1`); in the layers'
    // backward the segments not yet reached and the inputs of the one in flight, recomputed from
    // its stored one (`L` at the start for `K = 1`). Offloaded, the stored ones are on the host
    // and the device holds the last output, then the segment in flight.
    let hidden = b * t * d * e;
    let counts = checkpoint_counts(cfg.num_layers(), p.checkpoint_every);
    // On the CPU only the disk tier offloads; its read-ahead holds the next checkpoint's bytes.
    let read_ahead = u64::from(p.offloaded && p.host);
    let (forward_checkpoints, head_checkpoints, layer_checkpoints) = match p.offloaded {
        true => (hidden, hidden, (counts.segment + read_ahead) * hidden),
        false => (
            counts.forward * hidden,
            counts.head * hidden,
            counts.backward * hidden,
        ),
    };
    let (c, lc) = (
        (chunks.chunk as u64).min(t),
        (chunks.logits_chunk as u64).min(t),
    );
    let workspace = |products: &[Product], tiled: bool| -> u64 {
        let elem = e.max(f32b) as usize; // the host runs half-precision products in f32
        match p.host {
            true => products
                .iter()
                .map(|&pr| gemm_memory::workspace(pr, elem, tiled))
                .max()
                .unwrap_or(0),
            false => 0,
        }
    };
    // The projections of a chunk of `rows` rows: forward, input gradient and (trained) weight
    // gradient products, `(out, in)` each.
    let projections = |rows: u64| -> Vec<Product> {
        let trained = p.lora.is_none();
        let rows = rows as usize;
        [(q, d), (kv, d), (d, q), (ffn, d), (d, ffn)]
            .into_iter()
            .flat_map(|(out, inner)| {
                let (out, inner) = (out as usize, inner as usize);
                let mut products = vec![
                    Product::by_transposed(rows, out, inner),
                    Product::by_plain(rows, out, inner),
                ];
                if trained {
                    products.push(Product::transposed_by(out, inner, rows));
                }
                products
            })
            .collect()
    };

    // A chunk's rows (`[c, d | q | kv | ffn]`, counts fitted, see the module docs). Half precision
    // on the host computes them in f32 (`DecoderLayer::computed_in_f32`), with the layer in
    // flight's weights widened to f32 for the phase.
    let half_host = half && p.host;
    let act = if half_host { f32b } else { e };
    let widened_layer = if half_host { layer_params * f32b } else { 0 };
    let chunk_rows = |(of_d, of_q, of_kv, of_ffn): (u64, u64, u64, u64)| {
        b * c * (of_d * d + of_q * q + of_kv * kv + of_ffn * ffn) * act
    };
    // In the backward, the chunk's graph holds every activation until its backward ends (the input,
    // the norms, the projections, q/k norms and rope, the attention's output, the residual sums) ...
    let chunk_acts = chunk_rows((7, 6, 6, 3));
    // ... and its gradients peak at one of two moments: the attention op's backward (its output's
    // gradient, its inputs', the inner-layout copies, the input's gradient so far, and its score
    // tiles: `scores`) or the MLP's (the gate's and up projection's gradients beside the SwiGLU's
    // and the residual's). Which one is the larger depends on the shape: one fitted sum for all of
    // them under-estimated a wide `d`, `q`, `kv` or `ffn` by up to 19%.
    let attention_moment = chunk_rows((1, 3, 3, 0));
    let mlp_moment = chunk_rows((4, 0, 0, 5));
    // In the forward no graph: what one op of a chunk reads and writes, and what the layer keeps
    // for later ops (the input, the residual sum).
    let forward_acts = chunk_rows((5, 4, 1, 4));
    // The layer's keys and values of the whole sequence, in the dtype the layer computes in (f32 for
    // half precision on the host).
    let keys_values = 2 * b * t * kv * act;

    // A chunk's projections run in the forward and in the layers' backward.
    let projection_workspace = workspace(&projections(b * c), true);

    // The attention op's own buffers, on the backend the layer runs on.
    let attention = attention::Sizes {
        batch: b,
        heads,
        kv_heads: cfg.num_kv_heads as u64,
        head_dim: cfg.head_dim as u64,
        queries: c,
        keys: t,
        element: act,
        threads: rayon::current_num_threads() as u64,
    };
    let backend = match p.host {
        true => Backend::Cpu,
        false => Backend::Cuda,
    };
    // A bf16 layer's attention forward on the host multiplies bf16 copies.
    let bf16_forward = match (p.dtype, p.host) {
        (DType::BF16, true) => attention::bf16_forward_bytes(attention),
        _ => 0,
    };

    // The forward: the checkpoints, one layer's keys and values and a chunk's activations.
    let forward_phase = forward_checkpoints
        + keys_values
        + forward_acts
        + projection_workspace
        + widened_layer
        + bf16_forward;

    // The head, per logits chunk of `b · lc` rows. The scores in the compute dtype, their softmax,
    // its VJP and the target scatter; on the host the scores alone, which their softmax and its VJP
    // overwrite (a bf16 head's too: its logits and their gradient are f32 holding bf16 values,
    // which its products read as bf16; a head that casts instead, f16, soft-capped or a score
    // head, adds the half-precision copy each cast makes); elsewhere half precision adds the raw
    // logits, the rounded VJP and temporaries (fitted).
    let cast_head = !cfg.head_logits_as_bf16_values(p.dtype);
    let half_logits = match (half, p.host) {
        (true, false) => 4 * e,
        (true, true) if cast_head => e,
        _ => 0,
    };
    let buffers = if p.host { 1 } else { 4 };
    let logits = b * lc * vocab * (buffers * f32b.max(e) + half_logits);
    // The chunk's `[lc, d]` rows: its copy of the last hidden state, the final norm's output and
    // what its backward keeps, the hidden state's gradient and the norm's VJP (fitted: 7, at least
    // f32's size: half precision's norm runs in f32, on the host in one op, elsewhere composed;
    // and one more in half precision: its bf16 rows beside their f32 ones).
    let head_rows = b * lc * d * (7 * e.max(f32b) + if half { e } else { 0 });
    // Each chunk's share of the head weight's gradient: added into the accumulator by the product
    // itself on the host (bf16 operands into an f32 accumulator), a `[V, d]` buffer elsewhere.
    let head_share = if p.host { 0 } else { head_grad };
    let rows = (b * lc) as usize;
    let (v, dd) = (vocab as usize, d as usize);
    let mut head_products = vec![
        Product::by_transposed(rows, v, dd),
        Product::by_plain(rows, v, dd),
    ];
    if head_grad > 0 {
        head_products.push(Product::transposed_by(v, dd, rows));
    }
    // Each chunk's log-probs are a tensor of their own until they are joined (fitted: 320 bytes).
    let parts = t.div_ceil(lc) * 320;
    let head_phase = head_grad
        + head_checkpoints
        + hidden
        + parts
        + logits
        + head_rows
        + head_share
        + workspace(&head_products, true);

    // K, V and their pending gradients, and (fitted, seen at T = 64K) one more `[T, kv]` state.
    let kv_state = 5 * keys_values / 2;
    let grads_io = 2 * hidden;
    // The attention op keeps no score-sized tensor in the graph; its backward holds a few at once.
    let scores = attention::backward_bytes(attention, backend);
    // Measured on the host; on an accelerator (not measured there yet) both, to err high.
    let busiest_moment = match p.host {
        true => (attention_moment + scores).max(mlp_moment),
        false => attention_moment + scores + mlp_moment,
    };
    let layer_phase = grads
        + widened_layer
        + layer_checkpoints
        + kv_state
        + grads_io
        + chunk_acts
        + busiest_moment
        + projection_workspace;

    // The embedding's VJP (written out): the incoming `[b, T, d]` gradient; on the host its rows go
    // into the table's accumulator in place (in half precision widened to f32 first); elsewhere they
    // make a table-sized sum in the model dtype (`index_add` onto zeros), copied to f32 in half
    // precision. Not tied, that sum (or its copy) becomes the table's accumulator, already counted
    // in `grads_after_layers`: one more model-dtype table comes on top, the zeros beside the sum or
    // the sum beside its copy (as a card measured: docs/benchmarks.md, "Checkpoint tiers on the
    // card"). Tied, the accumulator holds the head's share already, and the
    // scaled rows and the sum (with its f32 copy) are added to it out of place, a new sum beside it
    // (not yet measured on a card). Under LoRA the gradient arrives and nothing is done with it.
    // Gemma's embedding scale and a padding id each make one more copy of the rows (not under LoRA).
    let row_copies = match p.lora {
        None => cfg.embed_scale.is_some() as u64 + cfg.pad_token_id.is_some() as u64,
        Some(_) => 0,
    };
    let embedding_phase = grads_after_layers
        + row_copies * hidden
        + match (p.lora, p.host) {
            (Some(_), _) => hidden,
            (None, true) if half => hidden + b * t * d * f32b,
            (None, true) => hidden,
            (None, false) if !cfg.tie_word_embeddings => hidden + vocab * d * e,
            (None, false) if half => 2 * hidden + table_grad + vocab * d * f32b,
            (None, false) => 2 * hidden + table_grad,
        };
    Estimate {
        resident,
        forward_phase,
        head_phase,
        layer_phase,
        embedding_phase,
    }
}

/// `[b, T, d]` layer inputs held at once, for `layers` layers in segments of `every`.
struct CheckpointCounts {
    /// In the forward: the stored ones, the last output, and while a segment's inner layers run the
    /// unstored input of the one running.
    forward: u64,
    /// In the head: the stored ones and the last output.
    head: u64,
    /// In the layers' backward: the segments not yet reached plus the inputs of the one in flight.
    backward: u64,
    /// The inputs of the longest segment alone (what stays on the device when the stored ones are
    /// offloaded).
    segment: u64,
}

fn checkpoint_counts(layers: usize, every: usize) -> CheckpointCounts {
    // The engine's own segments, bottom up (the backward takes them top down).
    let lengths: Vec<u64> = crate::engine::segments(layers, every)
        .iter()
        .map(|s| s.len() as u64)
        .collect();
    let stored = lengths.len() as u64;
    // Segment i from the bottom runs while the i below it wait.
    let backward = lengths
        .iter()
        .enumerate()
        .map(|(i, &len)| i as u64 + len)
        .max()
        .unwrap_or(0);
    let top = lengths.last().copied().unwrap_or(0);
    CheckpointCounts {
        forward: stored + 1 + u64::from(top > 1),
        head: stored + 1,
        backward,
        segment: lengths.iter().copied().max().unwrap_or(0),
    }
}

/// Share of the budget the chunks are planned for: the cost model's measured error is within about
/// ±6% (docs/benchmarks.md), so planning for the whole budget would overshoot it about half the time.
pub const BUDGET_MARGIN: f64 = 0.93;

/// The layer chunk below which a budget plan stores fewer checkpoints, or moves them out of the
/// planned memory, rather than chunk more finely (the memory setting of the benchmarks: smaller
/// chunks cost more time than the recompute or the copies).
pub const GOOD_CHUNK: usize = 128;

/// [`plan_for_budget`] over the ways of storing the checkpoints, fastest first: on the device at
/// the problem's `checkpoint_every` or more (up to `⌈√L⌉`, where they take the least memory); then,
/// when `tiers` allow, in host memory (off an accelerator: the smallest `K` whose stored
/// checkpoints fit `tiers.host`); then on disk (one per layer, the least device memory). The
/// first way whose layer chunk reaches [`GOOD_CHUNK`] (or `T`) is taken, else the one with the
/// largest chunk; an error only when none fits at all (the last way's error, which names the
/// smallest budget that would). The problem's own `offloaded` is not looked at: the plan decides.
/// On the CPU host memory is the planned memory, so only the device and disk are tried.
pub fn plan_with_checkpoints(p: Problem, budget: u64, tiers: Tiers) -> Result<Planned> {
    let layers = p.config.num_layers().max(1);
    let first = p.checkpoint_every.clamp(1, layers);
    let last = crate::CheckpointEvery::Sqrt.layers(layers).max(first);
    let good = GOOD_CHUNK.min(p.seq_len.max(1));
    let hidden = (p.batch * p.seq_len * p.config.hidden_size * p.dtype.size_in_bytes()) as u64;
    let mut ways: Vec<(CheckpointPlace, usize)> = (first..=last)
        .map(|k| (CheckpointPlace::Device, k))
        .collect();
    if let (Some(bytes), false) = (tiers.host, p.host) {
        let fits_host = |k: &usize| layers.div_ceil(*k) as u64 * hidden <= bytes;
        ways.extend(
            (first..=last)
                .find(fits_host)
                .map(|k| (CheckpointPlace::Host, k)),
        );
    }
    if tiers.disk {
        ways.push((CheckpointPlace::Disk, first));
    }
    let plan = |(place, k): (CheckpointPlace, usize)| {
        let problem = Problem {
            checkpoint_every: k,
            offloaded: place != CheckpointPlace::Device,
            ..p
        };
        plan_for_budget(problem, budget).map(|chunks| Planned {
            chunks,
            checkpoint_every: k,
            place: Some(place),
        })
    };
    let mut best: Option<Planned> = None;
    for planned in ways.iter().filter_map(|&way| plan(way).ok()) {
        if planned.chunks.chunk >= good {
            return Ok(planned);
        }
        if best.is_none_or(|b| planned.chunks.chunk > b.chunks.chunk) {
            best = Some(planned);
        }
    }
    match best {
        Some(planned) => Ok(planned),
        None => plan(*ways.last().unwrap_or(&(CheckpointPlace::Device, last))),
    }
}

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
    // Every phase depends on one of the two chunks at most (the forward's and the layers' on the
    // layer chunk, the head's on the logits chunk) and grows with it, so each is searched on its own
    // with the other at 1, and the pair's peak is the larger of the two found.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3_8b() -> ModelConfig {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../benches/configs/qwen3-8b.json");
        ModelConfig::from_file(&path).unwrap()
    }

    fn problem(cfg: &ModelConfig, t: usize, host: bool) -> Problem<'_> {
        Problem {
            config: cfg,
            batch: 1,
            seq_len: t,
            dtype: DType::BF16,
            offloaded: false,
            checkpoint_every: 1,
            lora: None,
            host,
        }
    }

    /// A budget takes the fastest way of storing the checkpoints that keeps the layer chunk at 128 or
    /// more: on the card while they fit, then fewer of them, then host memory when it has room for
    /// them, then disk; without room anywhere, the way with the largest chunk.
    #[test]
    fn a_budget_moves_the_checkpoints_only_as_far_as_it_must() {
        let cfg = qwen3_8b();
        let budget = 80 << 30;
        let gib = 1u64 << 30;
        let place = |t: usize, tiers: Tiers| {
            let planned = plan_with_checkpoints(problem(&cfg, t, false), budget, tiers).unwrap();
            (planned.place.unwrap(), planned.checkpoint_every)
        };
        let everything = Tiers {
            host: Some(120 * gib),
            disk: true,
        };
        // 64K tokens: every checkpoint fits on the card.
        assert_eq!(place(65_536, everything), (CheckpointPlace::Device, 1));
        // 512K: not on the card at any K; 36 of 4 GiB do not fit 120 GiB of host memory, but 18
        // (K = 2) do.
        assert_eq!(place(524_288, everything), (CheckpointPlace::Host, 2));
        // No host memory to spare: disk, one per layer.
        let disk_only = Tiers {
            host: None,
            disk: true,
        };
        assert_eq!(place(524_288, disk_only), (CheckpointPlace::Disk, 1));
        // Nowhere to go: the card cannot hold 512K at any K.
        assert!(
            plan_with_checkpoints(problem(&cfg, 524_288, false), budget, Tiers::default()).is_err()
        );
        // On the CPU host memory is the planned memory: only the device or disk.
        let cpu = plan_with_checkpoints(problem(&cfg, 524_288, true), budget, everything).unwrap();
        assert_eq!(cpu.place, Some(CheckpointPlace::Disk));
    }

    /// Off the host, the estimate against what a card measured (docs/benchmarks.md, "Checkpoint
    /// tiers on the card"): Qwen3-8B's first 4 layers in bf16, T = 32,768, chunk 2048,
    /// logits chunk 1024, one stream backward; the phases' peaks above the weights, in bytes. The
    /// embedding phase (an untied table: its rows' sum becomes the accumulator) to 1%; the head's,
    /// the peak there, not under by more than the 7% a budget keeps.
    #[test]
    fn device_phases_match_the_card() {
        let mut cfg = qwen3_8b();
        cfg.layers.truncate(4);
        let rows = Chunks {
            chunk: 2048,
            logits_chunk: 1024,
        };
        let estimate = estimate(problem(&cfg, 32_768, false), rows);
        // The estimate's phases are above `resident`: the weights, and the rope tables and tokens.
        let above_weights = |phase: u64| phase + estimate.resident - 4_033_685_504;
        let error = |phase: u64, measured: f64| above_weights(phase) as f64 / measured - 1.0;
        let embedding = error(estimate.embedding_phase, 6_807_562_240.0);
        assert!(
            embedding.abs() < 0.01,
            "embedding phase off by {embedding:+.3}"
        );
        let head = error(estimate.head_phase, 10_735_226_880.0);
        assert!(
            (-0.07..0.25).contains(&head),
            "head phase off by {head:+.3}"
        );
    }

    /// The plan's place sets the options: host offloads, disk keeps the directory, device drops both.
    #[test]
    fn the_planned_place_sets_the_options() {
        let dir: std::sync::Arc<std::path::Path> = std::path::Path::new("/scratch").into();
        let given = crate::Options {
            offload_checkpoints: true,
            checkpoint_dir: Some(dir.clone()),
            ..Default::default()
        };
        let planned = |place| Planned {
            chunks: Chunks {
                chunk: 128,
                logits_chunk: 100,
            },
            checkpoint_every: 2,
            place,
        };
        let device = planned(Some(CheckpointPlace::Device)).options(given.clone());
        assert!(!device.offload_checkpoints && device.checkpoint_dir.is_none());
        assert_eq!(device.checkpoint_every, crate::CheckpointEvery::Layers(2));
        let host = planned(Some(CheckpointPlace::Host)).options(given.clone());
        assert!(host.offload_checkpoints && host.checkpoint_dir.is_none());
        let disk = planned(Some(CheckpointPlace::Disk)).options(given.clone());
        assert!(!disk.offload_checkpoints && disk.checkpoint_dir == Some(dir));
        assert_eq!(
            planned(None).options(given.clone()).checkpoint_dir,
            given.checkpoint_dir
        );
    }
}
