//! The backward engine: StreamBP and its two baselines on the same model code.
//!
//! Phases, in the order they run (each a plain function, called in this order by `backward_impl`
//! below, in the spirit of llm.c), and the buffers they pass on:
//! 1. `forward_checkpoints`: the model once without a graph, keeping each layer's input (`L + 1`
//!    tensors `[b, T, d]`, in host memory when offloaded), or only every `K`-th layer's
//!    ([`CheckpointEvery`]).
//! 2. `head_backward`: final norm, LM head and objective, streamed over logits chunks; yields the
//!    loss, the target log-probs and the gradient of the last layer's output.
//! 3. `layer_backward_streamed` (or `layer_backward_whole` for `checkpoint`), top layer first: each
//!    turns the gradient of its output into that of its input. With `K > 1`, each segment of `K`
//!    layers first gets its other inputs back from its stored one (`segment_inputs`).
//! 4. `embedding_backward`: the gradient of the first layer's input into the embedding table.
//!
//! Parameter gradients go into a `GradSink` as they are produced, found by role through the model's
//! accessors (head, final norm, embedding, layer `i`): the engine knows no checkpoint name and no
//! family. `full` builds one graph over everything and calls `backward()` once.
//!
//! Files: this one (the entry points, phase 1 and the phases' order, `full`), `head.rs` (phase 2),
//! `layers.rs` (a layer's chunked forward, phases 3 and 4), `grad_sink.rs` (where parameter
//! gradients accumulate), `store.rs` (where phase 1's stored checkpoints wait: device, host, disk),
//! `sequence.rs` (a rank's positions of a sequence split over a group, and the exchanges along
//! them).

mod grad_sink;
mod head;
mod host_buffer;
mod layers;
mod sequence;
mod store;

use std::ops::Range;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use streambp_dist::Communicator;
use streambp_kernels::op_times;
use streambp_kernels::ops::cast::cast;
use streambp_models::lora::DropoutKey;
use streambp_models::{Layout, Model};
use streambp_objectives::Objective;

use crate::error::{EngineError, Result};
use crate::memory::PhaseLog;
use crate::workers::on_workers;

use grad_sink::GradSink;
pub(crate) use head::compute_dtype;
pub use head::target_logprobs;
pub(crate) use head::Reads;
use head::{head_backward, head_logprobs};
use layers::{
    embedding_backward, layer_backward_streamed, layer_backward_whole, layer_forward_streamed,
};
pub use sequence::shard_ranges;
use sequence::Shard;
pub use store::CheckpointIo;
use store::CheckpointStore;

/// How the backward is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// StreamBP: layers streamed over query chunks, LM head over logits chunks.
    Stream,
    /// Per-layer gradient checkpointing: each layer recomputed and backpropagated whole; head unchunked.
    Checkpoint,
    /// Plain backprop through one graph of the whole model.
    Full,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "stream" => Ok(Mode::Stream),
            "checkpoint" => Ok(Mode::Checkpoint),
            "full" => Ok(Mode::Full),
            other => Err(format!(
                "unknown mode {other:?} (expected stream, checkpoint or full)"
            )),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Stream => "stream",
            Mode::Checkpoint => "checkpoint",
            Mode::Full => "full",
        })
    }
}

/// Chunk sizes, in tokens of the sequence (every row of the batch is chunked alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunks {
    /// Query chunk of the streamed layer backward.
    pub chunk: usize,
    /// Positions per LM-head chunk.
    pub logits_chunk: usize,
}

/// How many consecutive layers share one stored checkpoint (`--checkpoint-every`): the forward keeps
/// the input of every `K`-th layer only, and the backward recomputes a segment's other inputs from
/// it (one segment at a time) before streaming that segment's backwards. The recomputation repeats the
/// forward's own arithmetic, so the gradients are the same bits for every `K`; what changes is memory
/// (`⌈L/K⌉` stored inputs plus `K − 1` of the current segment, least near `K = √L`) against one more
/// forward of the layers between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointEvery {
    /// Every `K`-th layer (1: every layer, no recomputation beyond the streamed backward's own).
    Layers(usize),
    /// `K = ⌈√L⌉`, which makes `⌈L/K⌉ + K − 1` about `2√L`.
    Sqrt,
}

impl CheckpointEvery {
    /// `K` for a model of `layers` layers (at least 1, at most `layers`).
    pub fn layers(self, layers: usize) -> usize {
        let k = match self {
            CheckpointEvery::Layers(k) => k,
            CheckpointEvery::Sqrt => (layers as f64).sqrt().ceil() as usize,
        };
        k.clamp(1, layers.max(1))
    }
}

impl Default for CheckpointEvery {
    fn default() -> Self {
        CheckpointEvery::Layers(1)
    }
}

impl std::str::FromStr for CheckpointEvery {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "sqrt" => Ok(CheckpointEvery::Sqrt),
            n => match n.parse::<usize>() {
                Ok(k) if k >= 1 => Ok(CheckpointEvery::Layers(k)),
                _ => Err(format!(
                    "{s:?}: expected a number of layers (at least 1) or `sqrt`"
                )),
            },
        }
    }
}

impl std::fmt::Display for CheckpointEvery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckpointEvery::Layers(k) => write!(f, "{k}"),
            CheckpointEvery::Sqrt => f.write_str("sqrt"),
        }
    }
}

/// Engine options beyond the mode and chunk sizes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    /// Keep the layer checkpoints in host memory and bring each back for its layer's backward, so
    /// accelerator memory no longer grows with `L × T × d` (a no-op for a model on the CPU).
    pub offload_checkpoints: bool,
    /// How many layers share one stored checkpoint ([`CheckpointEvery`]).
    pub checkpoint_every: CheckpointEvery,
    /// LoRA dropout on, its masks derived from this key (the trainer's seed, step and micro-batch);
    /// every mode sees the same masks. `None`: no dropout.
    pub dropout: Option<DropoutKey>,
    /// Keep the stored checkpoints in scratch files in this directory instead of memory.
    pub checkpoint_dir: Option<std::sync::Arc<std::path::Path>>,
}

impl Options {
    /// Whether the checkpoints leave `device`'s memory (offloading from the CPU to the CPU keeps them).
    pub fn offloads_from(&self, device: &candle_core::Device) -> bool {
        self.offload_checkpoints && !device.is_cpu()
    }
}

/// A batch of right-padded token rows.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    /// `[batch, T]` u32.
    pub input_ids: &'a Tensor,
    /// `[batch, T]`, 1 = real token; all ones when absent.
    pub attention_mask: Option<&'a Tensor>,
    /// `[batch, T]` positions restarting at 0 where a packed row's next document begins
    /// (transformers' padding-free convention); `0..T` in every row when absent.
    pub position_ids: Option<&'a Tensor>,
}

impl<'a> Batch<'a> {
    /// Rows of one document each.
    pub fn new(input_ids: &'a Tensor, attention_mask: Option<&'a Tensor>) -> Self {
        Self {
            input_ids,
            attention_mask,
            position_ids: None,
        }
    }

    /// The batch's padding and document boundaries, checked against its shape.
    pub fn layout(&self) -> Result<Layout> {
        let (b, t) = self.input_ids.dims2()?;
        for (name, tensor) in [
            ("attention_mask", self.attention_mask),
            ("position_ids", self.position_ids),
        ] {
            if let Some(x) = tensor {
                if x.dims() != [b, t] {
                    return Err(EngineError::Shape(format!(
                        "{name} {:?} does not match input_ids [{b}, {t}]",
                        x.dims()
                    )));
                }
            }
        }
        Ok(Layout::new(self.attention_mask, self.position_ids)?.with_seq_len(t))
    }
}

/// The result of one backward.
#[derive(Debug)]
pub struct Gradients {
    /// The objective's loss on the batch.
    pub loss: f64,
    /// Every trainable parameter's gradient under its HF name, in the model's dtype.
    pub grads: Vec<(String, Tensor)>,
    /// `[batch, T]` target log-probs the objective saw (for metrics).
    pub logp: Tensor,
    /// The objective's metrics (DPO rewards, GRPO clip ratio and KL, …).
    pub metrics: Vec<(String, f64)>,
    /// Peak bytes (the host's with the counting allocator, or the CUDA memory pool's) and seconds of
    /// each phase.
    pub phases: PhaseLog,
    /// What the checkpoints moved to and from disk (`checkpoint_dir`; zero otherwise).
    pub checkpoint_io: CheckpointIo,
}

/// How one backward is computed: its mode, chunk sizes and options, decided together for a
/// micro-batch (by the trainer, `grad` or the bench) and handed on as one value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Stream, checkpoint or full.
    pub mode: Mode,
    /// The query chunk and the LM head's chunk.
    pub chunks: Chunks,
    /// Offloading and LoRA dropout.
    pub options: Options,
}

impl Plan {
    /// `mode` with `chunks` and default options.
    pub fn new(mode: Mode, chunks: Chunks) -> Self {
        Self {
            mode,
            chunks,
            options: Options::default(),
        }
    }

    /// This plan with `options`.
    pub fn with(self, options: Options) -> Self {
        Self { options, ..self }
    }
}

/// Computes the loss and the gradient of every parameter of `model` for `objective` on `batch`.
pub fn backward(
    model: &Model,
    batch: Batch,
    objective: &dyn Objective,
    mode: Mode,
    chunks: Chunks,
) -> Result<Gradients> {
    backward_with(model, batch, objective, Plan::new(mode, chunks))
}

/// [`backward`] as `plan` says (engine options included).
pub fn backward_with(
    model: &Model,
    batch: Batch,
    objective: &dyn Objective,
    plan: Plan,
) -> Result<Gradients> {
    backward_impl(model, batch, objective, plan, (None, None))
}

/// Receives groups of parameter gradients as soon as the backward has finished them: a layer's when
/// its backward is done (top layer first), then the rest (embedding, final norm, head) at the end. A
/// data-parallel trainer reduces them across ranks there, one collective per layer, and keeps only its
/// shard, so a rank never holds the whole model's gradients.
pub trait FinishedGradients {
    /// One group's finished gradients, in the model's parameter order and dtype.
    fn take(&mut self, grads: Vec<(String, Tensor)>) -> Result<()>;
}

/// [`backward_with`], handing every parameter's gradient to `finished` group by group as soon as it is
/// complete instead of returning them (the result's `grads` is empty).
pub fn backward_into(
    model: &Model,
    batch: Batch,
    objective: &dyn Objective,
    plan: Plan,
    finished: &mut dyn FinishedGradients,
) -> Result<Gradients> {
    backward_impl(model, batch, objective, plan, (None, Some(finished)))
}

/// [`backward_with`] on one rank of a sequence group (sequence parallelism): every rank of `group`
/// passes the same whole `batch`, holds the activations of its own positions only ([`shard_ranges`]:
/// about `T / S` of them in two spans, a zigzag that balances the causal attention's work; every rank
/// at least one position), and exchanges keys, values and
/// their gradients with the others layer by layer. The loss, log-probs and metrics are the whole
/// batch's on every rank; each rank's `grads` are its share, and their sum over the group is the
/// gradient one process computes (data parallelism sums over its ranks the same way). `full` mode
/// is not offered (one graph of the whole rows); `checkpoint` backpropagates each layer over the
/// rank's spans, a span in one piece. With `finished`, gradients go there group by group as in
/// [`backward_into`].
pub fn backward_sequence_parallel(
    model: &Model,
    batch: Batch,
    objective: &dyn Objective,
    plan: Plan,
    group: &dyn Communicator,
    finished: Option<&mut dyn FinishedGradients>,
) -> Result<Gradients> {
    backward_impl(model, batch, objective, plan, (Some(group), finished))
}

fn backward_impl(
    model: &Model,
    batch: Batch,
    objective: &dyn Objective,
    Plan {
        mode,
        chunks,
        options,
    }: Plan,
    (group, mut finished): (
        Option<&dyn Communicator>,
        Option<&mut dyn FinishedGradients>,
    ),
) -> Result<Gradients> {
    let (b, t) = batch.input_ids.dims2()?;
    let shard = match group {
        Some(group) => Shard::of(group, t)?,
        None => Shard::whole(t),
    };
    if shard.is_split() && mode == Mode::Full {
        return Err(EngineError::Plan(
            "full backprop builds one graph of the whole rows: a sequence group needs stream or \
             checkpoint mode"
                .into(),
        ));
    }
    // Checkpointing on a split sequence: each layer backpropagated over each of the rank's spans in
    // one piece.
    let (mode, chunks) = match (shard.is_split(), mode) {
        (true, Mode::Checkpoint) => (
            Mode::Stream,
            Chunks {
                chunk: shard.len,
                logits_chunk: shard.len,
            },
        ),
        _ => (mode, chunks),
    };
    if objective.targets().dims() != [b, t] {
        return Err(EngineError::Shape(format!(
            "objective targets {:?} do not match input_ids [{b}, {t}]",
            objective.targets().dims()
        )));
    }
    if chunks.chunk == 0 || chunks.logits_chunk == 0 {
        return Err(EngineError::Plan("chunk sizes must be at least 1".into()));
    }
    if options.checkpoint_every == CheckpointEvery::Layers(0) {
        return Err(EngineError::Plan(
            "checkpoint_every must be at least 1 layer".into(),
        ));
    }
    let layout = match options.dropout {
        Some(key) => batch.layout()?.with_dropout(key),
        None => batch.layout()?,
    };
    let mut sink = GradSink::new();
    let device = model.device();
    let mut peaks = PhaseLog::start_on(device);

    let mut checkpoint_io = CheckpointIo::default();
    let (loss, logp, entropy) = match mode {
        Mode::Full => {
            let out = on_workers(device, || {
                full_backward(model, batch, &layout, objective, &mut sink)
            })?;
            peaks.record("full");
            out
        }
        Mode::Stream | Mode::Checkpoint => {
            let detached = model.detached();
            let segments = segments(
                model.layers.len(),
                options.checkpoint_every.layers(model.layers.len()),
            );
            let input_ids = shard.local(batch.input_ids, 1)?;
            let (mut starts, last) = on_workers(device, || {
                forward_checkpoints(
                    &detached,
                    &input_ids,
                    (&layout, &shard),
                    (chunks.chunk, &segments),
                    &options,
                )
            })?;
            peaks.record("forward");
            let logits_chunk = match mode {
                Mode::Stream => chunks.logits_chunk,
                _ => t,
            };
            let head = on_workers(device, || {
                head_backward(model, &last, objective, (logits_chunk, &shard), &mut sink)
            })?;
            objective.head_done();
            let mut grad = head.grad_last;
            drop(last);
            // The final norm and an untied head are done; a tied head still gets the embedding
            // phase's gradient.
            sink.seal(model.output_parameters())?;
            peaks.record("head");
            for segment in segments.iter().rev() {
                let start = starts.pop(device)?.ok_or_else(|| {
                    EngineError::CheckpointIo("fewer stored checkpoints than segments".into())
                })?;
                // The segment's other layer inputs, recomputed as the forward made them.
                let mut inputs = on_workers(device, || {
                    segment_inputs(&detached, start, segment, (&layout, &shard), chunks.chunk)
                })?;
                for index in segment.clone().rev() {
                    let x = inputs.pop().expect("one input per layer of the segment");
                    grad = on_workers(device, || match mode {
                        Mode::Stream => layer_backward_streamed(
                            (model, index),
                            &x,
                            &grad,
                            (&layout, &shard),
                            chunks.chunk,
                            &mut sink,
                        ),
                        _ => layer_backward_whole((model, index), &x, &grad, &layout, &mut sink),
                    })?;
                    sink.seal(model.layer_parameters(index).iter())?;
                    if let Some(hook) = finished.as_mut() {
                        hook.take(sink.take(model.layer_parameters(index))?)?;
                    }
                }
            }
            checkpoint_io = starts.io();
            peaks.record("layers");
            on_workers(device, || {
                embedding_backward(model, &input_ids, &grad, &mut sink)
            })?;
            peaks.record("embedding");
            (head.loss, head.logp, head.entropy)
        }
    };
    let metrics = objective.metrics_with_entropy(&logp, entropy.as_ref())?;
    let mut grads = sink.finish(model)?;
    if let Some(hook) = finished {
        hook.take(std::mem::take(&mut grads))?;
    }
    Ok(Gradients {
        loss,
        grads,
        logp,
        metrics,
        phases: peaks,
        checkpoint_io,
    })
}

/// The layers `0..layers` in runs of `every` (the last may be shorter), in order.
pub(crate) fn segments(layers: usize, every: usize) -> Vec<Range<usize>> {
    chunk_ranges(layers, every.max(1))
}

/// Phase 1: the model without a graph, each layer over query chunks; stores the input of each
/// segment's first layer (with segments of one layer, every layer's: `[batch, T, d]` each) where
/// `options` says (the device, host memory or disk), and returns them with the last layer's output.
fn forward_checkpoints(
    detached: &Model,
    input_ids: &Tensor,
    (layout, shard): (&Layout, &Shard),
    (chunk, segments): (usize, &[Range<usize>]),
    options: &Options,
) -> Result<(CheckpointStore, Tensor)> {
    let mut current = detached.embed(input_ids)?;
    let mut store = CheckpointStore::new(
        options.checkpoint_dir.as_deref(),
        options.offloads_from(detached.device()),
        segments.len(),
        &current,
    )?;
    for segment in segments {
        store.push(&current)?;
        for index in segment.clone() {
            current =
                layer_forward_streamed(&detached.layers[index], &current, layout, chunk, shard)?;
        }
    }
    Ok((store, current))
}

/// The inputs of every layer of `segment` (on the model's device), from that of its first: the
/// forward of its layers but the last, made as phase 1 made it (the same chunks, so the same bits).
fn segment_inputs(
    detached: &Model,
    start: Tensor,
    segment: &Range<usize>,
    (layout, shard): (&Layout, &Shard),
    chunk: usize,
) -> Result<Vec<Tensor>> {
    let mut inputs = Vec::with_capacity(segment.len());
    inputs.push(start);
    for index in segment.start..segment.end.saturating_sub(1) {
        let x = inputs.last().expect("the segment's first input");
        let next = layer_forward_streamed(&detached.layers[index], x, layout, chunk, shard)?;
        inputs.push(next);
    }
    Ok(inputs)
}

/// Target log-probs `[batch, T]` of `targets` under `model` at `temperature` (`log softmax(logits /
/// temperature)`), without any graph and streamed like the backward (one layer's hidden states at a
/// time, query chunks, logits chunks): the reference model of DPO and GRPO, and GRPO's old policy.
pub fn forward_logprobs(
    model: &Model,
    batch: Batch,
    targets: &Tensor,
    (chunks, temperature): (Chunks, f64),
) -> Result<Tensor> {
    let t = batch.input_ids.dim(1)?;
    forward_logprobs_impl(
        model,
        batch,
        targets,
        (chunks, temperature),
        &Shard::whole(t),
    )
}

/// The final-normed hidden states of `model` at the positions this rank holds (all of them, or
/// with a sequence `group` its spans, as [`backward_sequence_parallel`] splits the rows), without
/// any graph and streamed like the backward (one layer's hidden states at a time, query chunks): a
/// distillation teacher's, whose head the loss applies a logits chunk at a time.
pub fn forward_hidden(
    model: &Model,
    batch: Batch,
    chunks: Chunks,
    group: Option<&dyn Communicator>,
) -> Result<HiddenStates> {
    let t = batch.input_ids.dim(1)?;
    let shard = match group {
        Some(group) => Shard::of(group, t)?,
        None => Shard::whole(t),
    };
    let detached = model.detached();
    let layout = batch.layout()?;
    let hidden = on_workers(model.device(), || {
        let mut h = detached.embed(&shard.local(batch.input_ids, 1)?)?;
        for layer in &detached.layers {
            h = layer_forward_streamed(layer, &h, &layout, chunks.chunk, &shard)?;
        }
        Ok::<_, EngineError>(detached.final_norm(&h)?)
    })?;
    Ok(HiddenStates {
        hidden,
        spans: shard.spans().to_vec(),
    })
}

/// A frozen model's final-normed hidden states `[batch, positions held, d]` of the positions a
/// rank holds ([`forward_hidden`]), read by positions of the whole rows.
#[derive(Debug, Clone)]
pub struct HiddenStates {
    hidden: Tensor,
    /// The spans of the whole rows held, in the order they are stored.
    spans: Vec<Range<usize>>,
}

impl HiddenStates {
    /// The hidden states `[batch, cols.len(), d]` of positions `cols` of the whole rows, which lie
    /// in one span this rank holds (as every chunk of the engine's head does).
    pub fn positions(&self, cols: Range<usize>) -> Result<Tensor> {
        let mut at = 0;
        for span in &self.spans {
            if span.start <= cols.start && cols.end <= span.end {
                let start = at + cols.start - span.start;
                return Ok(self.hidden.narrow(1, start, cols.len())?);
            }
            at += span.len();
        }
        Err(EngineError::Shape(format!(
            "positions {cols:?} are not within one span held here ({:?})",
            self.spans
        )))
    }
}

/// [`forward_logprobs`] on one rank of a sequence group ([`backward_sequence_parallel`]): each rank
/// runs its positions; every rank returns the whole rows' log-probs.
pub fn forward_logprobs_sequence_parallel(
    model: &Model,
    batch: Batch,
    targets: &Tensor,
    (chunks, temperature): (Chunks, f64),
    group: &dyn Communicator,
) -> Result<Tensor> {
    let shard = Shard::of(group, batch.input_ids.dim(1)?)?;
    forward_logprobs_impl(model, batch, targets, (chunks, temperature), &shard)
}

fn forward_logprobs_impl(
    model: &Model,
    batch: Batch,
    targets: &Tensor,
    (chunks, temperature): (Chunks, f64),
    shard: &Shard,
) -> Result<Tensor> {
    let detached = model.detached();
    let layout = batch.layout()?;
    on_workers(model.device(), || {
        let mut h = detached.embed(&shard.local(batch.input_ids, 1)?)?;
        for layer in &detached.layers {
            h = layer_forward_streamed(layer, &h, &layout, chunks.chunk, shard)?;
        }
        let (logp, _) = head_logprobs(
            &detached,
            &h,
            &shard.local(targets, 1)?,
            &chunk_ranges(h.dim(1)?, chunks.logits_chunk),
            (temperature, false),
        )?;
        shard.gather(&logp, 1)
    })
}

fn chunk_ranges(t: usize, size: usize) -> Vec<Range<usize>> {
    (0..t.div_ceil(size))
        .map(|i| i * size..((i + 1) * size).min(t))
        .collect()
}

/// `full`: one graph over the model and the loss. Returns the loss, the target log-probs and
/// (for an objective that reads them) the entropies.
fn full_backward(
    model: &Model,
    batch: Batch,
    layout: &Layout,
    objective: &dyn Objective,
    sink: &mut GradSink,
) -> Result<(f64, Tensor, Option<Tensor>)> {
    let mut h = model.embed(batch.input_ids)?;
    // A half-precision layer on the host computes in f32 (`DecoderLayer::computed_in_f32`): its
    // trained weights' gradients land on f32 stand-ins, which `params` then lists. (The graph holds
    // every layer's f32 weights until the backward: this baseline's peak grows by twice the layers'
    // bf16 weights, next to all their activations.)
    let mut params = model.parameters().to_vec();
    for layer in &model.layers {
        let wide = layer.computed_in_f32()?;
        let layer = match &wide {
            Some(wide) => {
                params = wide.parameters(&params);
                &wide.layer
            }
            None => layer,
        };
        let y = layer.forward(&cast(&h, layer.dtype())?, layout)?;
        h = cast(&y, h.dtype())?;
    }
    let logits = model.logits(&model.final_norm(&h)?)?;
    let temperature = objective.temperature();
    let reads = head::Reads::of(objective);
    // Where the objective reads more than the targets' log-probs: the tempered logits, and their
    // entropies (read by the loss, or for a logits-reading loss's metrics, outside its graph).
    let tempered = match reads {
        head::Reads::Targets => None,
        _ => {
            let compute = head::compute_dtype(logits.dtype());
            Some(head::tempered(logits.to_dtype(compute)?, temperature)?)
        }
    };
    let entropy = match (reads, &tempered) {
        (head::Reads::TargetsAndEntropy, Some(z)) => Some(head::entropies(z)?),
        (head::Reads::Logits, Some(z)) => Some(head::entropies(&z.detach())?),
        _ => None,
    };
    let logp = head::head_outputs(model, logits, objective.targets(), temperature)?;
    let t = logp.dim(1)?;
    let loss = match (&tempered, &entropy) {
        (Some(z), _) if reads == head::Reads::Logits => objective.logits_loss(z, 0..t)?,
        (_, Some(entropy)) => objective.loss_with_entropy(&logp, entropy, 0..t)?,
        _ => objective.loss(&logp, 0..t)?,
    };
    let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let store = op_times::timed("full.backward", loss.device(), || loss.backward())?;
    sink.absorb(&store, params.iter())?;
    Ok((value, logp.detach(), entropy.map(|e| e.detach())))
}

fn required(store: &GradStore, t: &Tensor, what: &str) -> Result<Tensor> {
    store
        .get(t)
        .map(Tensor::detach)
        .ok_or_else(|| EngineError::MissingGradient(what.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A rank holding positions 2..4 and 6..8 of rows of 8 (rank 1 of 2's pieces) reads each
    /// span's positions from where it stores them.
    #[test]
    fn hidden_states_are_read_by_whole_row_positions() {
        let stored: Vec<f64> = [2.0, 3.0, 6.0, 7.0].to_vec();
        let states = HiddenStates {
            hidden: Tensor::from_vec(stored, (1, 4, 1), &Device::Cpu).unwrap(),
            spans: vec![2..4, 6..8],
        };
        let read = |cols: Range<usize>| {
            states
                .positions(cols)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
        };
        assert_eq!(read(2..4), [2.0, 3.0]);
        assert_eq!(read(7..8), [7.0]);
        assert_eq!(read(6..8), [6.0, 7.0]);
        assert!(states.positions(3..7).is_err(), "across spans");
        assert!(states.positions(0..1).is_err(), "not held");
    }
}
