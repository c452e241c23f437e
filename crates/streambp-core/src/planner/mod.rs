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
//!   gemm derives on the running CPU ([`streambp_kernels::ops::matmul::workspace`]): this, and the
//!   slabs, are what differ between CPUs (tens of MiB on a CPU with a large L3 cache, for products
//!   with a wide operand).
//!
//! The copy counts are fitted to peaks measured exactly with the counting allocator (CPU, candle 0.11)
//! over the shapes of `tests/planner.rs` — vocabularies 16 to 256K, hidden sizes 64 to 8192, one of
//! `d`, `q`, `kv` or `ffn` far wider than the others, T up to 64K, batch 2 and 3, LoRA, f32, f64 and
//! bf16 — on one CPU (docs/benchmarks.md, "The planner's cost model"), with gemm's workspace
//! derived, not fitted, so that they hold where gemm blocks differently. The test checks the model against measured peaks; the bench prints its error next to
//! every measured stream peak, and `--predict` prints its estimate for shapes too large to run here.

use candle_core::DType;
use streambp_models::{LoraConfig, ModelConfig, Projection};

use crate::engine::{Chunks, Reads};

mod estimate;
use crate::error::{EngineError, Result};
pub use estimate::estimate;

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
    /// What frozen models the objective reads hold beside the model planned (a distillation
    /// teacher's, a reference's weights); none by default.
    pub frozen: Frozen,
    /// The objective reads each position's entropy beside its target's log-prob (GRPO's entropy
    /// terms): where the head's passes do not run, it then holds the chunk's log-probabilities and
    /// their gradient's terms.
    pub reads_entropy: bool,
}

/// The memory of a frozen model an objective reads during the backward, in the planner's terms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Frozen {
    /// Held throughout: its weights.
    pub bytes: u64,
    /// Per token of the batch, through the forward and the head (the objective frees them
    /// before the layers' backward): its final hidden states.
    pub per_token: u64,
    /// In the head, per row of a logits chunk: what the objective makes of it beside the model's
    /// own logits (the frozen model's logits and the gradient the divergence writes).
    pub per_logits_row: u64,
}

impl Frozen {
    /// A frozen model of architecture `config` in `dtype` scored before the backward (a DPO, KTO,
    /// GRPO or RLOO reference): only its weights stay, its log-probs being a number per position.
    pub fn weights(config: &ModelConfig, dtype: DType) -> Self {
        Self {
            bytes: parameter_count(config) * dtype.size_in_bytes() as u64,
            per_token: 0,
            per_logits_row: 0,
        }
    }

    /// A distillation teacher of architecture `teacher` in `dtype`, read by the divergence of a
    /// student in `student` (whose head computes in f32, f64 for f64): its weights, its final hidden states, and per
    /// logits row its logits (cast to `compute` where that differs) and its normed rows, with what
    /// the student's head holds for a whole-distribution objective beyond the softmax's one buffer
    /// (fitted on the CPU: four more of the logits' size, for the entropies' terms, the logits
    /// autograd differentiates and their gradient; docs/benchmarks.md, "With the divergence as one
    /// op").
    pub fn teacher(teacher: &ModelConfig, dtype: DType, student: DType) -> Self {
        let compute = crate::engine::compute_dtype(student);
        let (e, c) = (dtype.size_in_bytes() as u64, compute.size_in_bytes() as u64);
        let (vocab, d) = (teacher.vocab_size as u64, teacher.hidden_size as u64);
        let cast = if dtype == compute { 0 } else { vocab * c };
        Self {
            bytes: parameter_count(teacher) * e,
            per_token: d * e,
            per_logits_row: vocab * (e + 4 * c) + cast + 2 * d * c,
        }
    }
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
            frozen: Frozen::default(),
            reads_entropy: false,
        }
    }

    /// The problem with `frozen` held beside the model.
    pub fn with_frozen(self, frozen: Frozen) -> Self {
        Self { frozen, ..self }
    }

    /// The problem of a backward of `objective`, whose head reads the entropies or not.
    pub fn with_objective(self, objective: &dyn streambp_objectives::Objective) -> Self {
        Self {
            reads_entropy: Reads::of(objective) == Reads::TargetsAndEntropy,
            ..self
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
            frozen: Frozen::default(),
            reads_entropy: false,
        }
    }

    /// A frozen teacher adds its weights to every phase, its hidden states to the forward and the
    /// head (freed before the layers), and its logits rows to the head's, so a budget leaves it
    /// room: smaller chunks, or none where it cannot fit.
    #[test]
    fn a_teacher_counts_against_the_budget() {
        let cfg = qwen3_8b();
        let chunks = Chunks {
            chunk: 1024,
            logits_chunk: 512,
        };
        let t = 16_384;
        let teacher = Frozen::teacher(&cfg, DType::BF16, DType::BF16);
        assert_eq!(teacher.bytes, parameter_count(&cfg) * 2);
        assert_eq!(teacher.per_token, cfg.hidden_size as u64 * 2);
        let alone = estimate(problem(&cfg, t, false), chunks);
        let taught = estimate(problem(&cfg, t, false).with_frozen(teacher), chunks);
        let states = t as u64 * teacher.per_token;
        assert_eq!(taught.resident - alone.resident, teacher.bytes);
        assert_eq!(taught.forward_phase - alone.forward_phase, states);
        assert_eq!(
            taught.layer_phase, alone.layer_phase,
            "freed before the layers"
        );
        let rows = chunks.logits_chunk as u64 * teacher.per_logits_row;
        assert_eq!(taught.head_phase - alone.head_phase, states + rows);
        assert!(taught.peak() >= alone.peak() + teacher.bytes);
        let budget = 80 << 30;
        let tiers = Tiers::default();
        let own = plan_with_checkpoints(problem(&cfg, t, false), budget, tiers).unwrap();
        let with =
            plan_with_checkpoints(problem(&cfg, t, false).with_frozen(teacher), budget, tiers);
        let with = with.unwrap();
        assert!(with.chunks.logits_chunk <= own.chunks.logits_chunk);
        assert!(
            estimate(problem(&cfg, t, false).with_frozen(teacher), with.chunks).peak() <= budget
        );
        let small = plan_with_checkpoints(
            problem(&cfg, t, false).with_frozen(teacher),
            20 << 30,
            tiers,
        );
        assert!(
            small.is_err(),
            "a budget below the teacher's weights is refused"
        );
    }

    /// A reference scored before the backward holds only its weights, through every phase.
    #[test]
    fn a_reference_counts_its_weights_only() {
        let cfg = qwen3_8b();
        let chunks = Chunks {
            chunk: 1024,
            logits_chunk: 512,
        };
        let reference = Frozen::weights(&cfg, DType::BF16);
        assert_eq!(reference.bytes, parameter_count(&cfg) * 2);
        let alone = estimate(problem(&cfg, 16_384, false), chunks);
        let with = estimate(problem(&cfg, 16_384, false).with_frozen(reference), chunks);
        assert_eq!(with.resident - alone.resident, reference.bytes);
        assert_eq!(with.layer_phase, alone.layer_phase);
        assert_eq!(with.head_phase, alone.head_phase);
    }

    /// Reading the entropies adds five logits-sized buffers per chunk to the head where the ops are
    /// composed (the card's terms), nothing on the host (its passes keep per-row terms), nothing
    /// else.
    #[test]
    fn entropies_count_in_the_head_where_composed() {
        let cfg = qwen3_8b();
        let chunks = Chunks {
            chunk: 1024,
            logits_chunk: 512,
        };
        for (host, buffers) in [(false, 5), (true, 0)] {
            let plain = estimate(problem(&cfg, 16_384, host), chunks);
            let with = estimate(
                Problem {
                    reads_entropy: true,
                    ..problem(&cfg, 16_384, host)
                },
                chunks,
            );
            let rows = buffers * 512 * cfg.vocab_size as u64 * 4;
            assert_eq!(with.head_phase - plain.head_phase, rows, "host {host}");
            assert_eq!(with.layer_phase, plain.layer_phase);
            assert_eq!(with.resident, plain.resident);
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
