//! The backward engine: StreamBP and its two baselines on the same model code.
//!
//! Phases, in the order they run (each a plain function below, in the spirit of llm.c), and the
//! buffers they pass on:
//! 1. `forward_checkpoints`: the model once without a graph, keeping each layer's input (`L + 1`
//!    tensors `[b, T, d]`, in host memory when offloaded).
//! 2. `head_backward`: final norm, LM head and objective, streamed over logits chunks; yields the
//!    loss, the target log-probs and the gradient of the last layer's output.
//! 3. `layer_backward_streamed` (or `layer_backward_whole` for `checkpoint`), top layer first: each
//!    turns the gradient of its output into that of its input.
//! 4. `embedding_backward`: the gradient of the first layer's input into the embedding table.
//!
//! Parameter gradients go into a `GradSink` as they are produced, found by role through the model's
//! accessors (head, final norm, embedding, layer `i`): the engine knows no checkpoint name and no
//! family. `full` builds one graph over everything and calls `backward()` once.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var, D};
use streambp_models::attention::{keys_dtype, EarlierKeys};
use streambp_models::cpu::cast;
use streambp_models::lora::DropoutKey;
use streambp_models::{accumulate, half_product};
use streambp_models::{DecoderLayer, KeyBlock, Layout, Model};
use streambp_objectives::Objective;

use crate::error::{EngineError, Result};
use crate::memory::PhaseLog;
use crate::seed::seed;
use crate::workers::on_workers;

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

/// Engine options beyond the mode and chunk sizes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Options {
    /// Keep the layer checkpoints in host memory and bring each back for its layer's backward, so
    /// accelerator memory no longer grows with `L × T × d` (a no-op for a model on the CPU).
    pub offload_checkpoints: bool,
    /// LoRA dropout on, its masks derived from this key (the trainer's seed, step and micro-batch);
    /// every mode sees the same masks. `None`: no dropout.
    pub dropout: Option<DropoutKey>,
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
}

/// Computes the loss and the gradient of every parameter of `model` for `objective` on `batch`.
pub fn backward(
    model: &Model,
    batch: Batch,
    objective: &dyn Objective,
    mode: Mode,
    chunks: Chunks,
) -> Result<Gradients> {
    backward_with(model, batch, objective, mode, chunks, Options::default())
}

/// [`backward`] with engine options.
pub fn backward_with(
    model: &Model,
    batch: Batch,
    objective: &dyn Objective,
    mode: Mode,
    chunks: Chunks,
    options: Options,
) -> Result<Gradients> {
    backward_impl(model, batch, objective, mode, chunks, options, None)
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
    mode: Mode,
    chunks: Chunks,
    options: Options,
    finished: &mut dyn FinishedGradients,
) -> Result<Gradients> {
    backward_impl(
        model,
        batch,
        objective,
        mode,
        chunks,
        options,
        Some(finished),
    )
}

fn backward_impl(
    model: &Model,
    batch: Batch,
    objective: &dyn Objective,
    mode: Mode,
    chunks: Chunks,
    options: Options,
    mut finished: Option<&mut dyn FinishedGradients>,
) -> Result<Gradients> {
    let (b, t) = batch.input_ids.dims2()?;
    if objective.targets().dims() != [b, t] {
        return Err(EngineError::Shape(format!(
            "objective targets {:?} do not match input_ids [{b}, {t}]",
            objective.targets().dims()
        )));
    }
    if chunks.chunk == 0 || chunks.logits_chunk == 0 {
        return Err(EngineError::Plan("chunk sizes must be at least 1".into()));
    }
    let layout = match options.dropout {
        Some(key) => batch.layout()?.with_dropout(key),
        None => batch.layout()?,
    };
    let mut sink = GradSink::new();
    let device = model.device();
    let mut peaks = PhaseLog::start_on(device);

    let (loss, logp) = match mode {
        Mode::Full => {
            let out = on_workers(device, || {
                full_backward(model, batch, &layout, objective, &mut sink)
            })?;
            peaks.record("full");
            out
        }
        Mode::Stream | Mode::Checkpoint => {
            let detached = model.detached();
            let mut inputs = on_workers(device, || {
                forward_checkpoints(
                    &detached,
                    batch.input_ids,
                    &layout,
                    chunks.chunk,
                    options.offload_checkpoints,
                )
            })?;
            peaks.record("forward");
            let last = inputs
                .pop()
                .expect("forward_checkpoints returns L + 1 tensors");
            let logits_chunk = match mode {
                Mode::Stream => chunks.logits_chunk,
                _ => t,
            };
            let (loss, logp, mut grad) = on_workers(device, || {
                head_backward(model, &last, objective, logits_chunk, &mut sink)
            })?;
            drop(last);
            // The final norm and an untied head are done; a tied head still gets the embedding
            // phase's gradient.
            sink.seal(model.output_parameters())?;
            peaks.record("head");
            for (index, layer) in model.layers.iter().enumerate().rev() {
                let x = inputs
                    .pop()
                    .expect("one checkpoint per layer")
                    .to_device(model.device())?;
                grad = on_workers(device, || match mode {
                    Mode::Stream => layer_backward_streamed(
                        layer,
                        &x,
                        &grad,
                        &layout,
                        chunks.chunk,
                        &mut sink,
                        model,
                        index,
                    ),
                    _ => layer_backward_whole(layer, &x, &grad, &layout, &mut sink, model, index),
                })?;
                sink.seal(model.layer_parameters(index).iter())?;
                if let Some(hook) = finished.as_mut() {
                    hook.take(sink.take(model.layer_parameters(index))?)?;
                }
            }
            peaks.record("layers");
            on_workers(device, || {
                embedding_backward(model, batch.input_ids, &grad, &mut sink)
            })?;
            peaks.record("embedding");
            (loss, logp)
        }
    };
    let metrics = objective.metrics(&logp)?;
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
    })
}

/// Phase 1: the model without a graph, each layer over query chunks; returns the input of every layer
/// (in host memory with `offload`) and the last layer's output (`L + 1` tensors of `[batch, T, d]`).
fn forward_checkpoints(
    detached: &Model,
    input_ids: &Tensor,
    layout: &Layout,
    chunk: usize,
    offload: bool,
) -> Result<Vec<Tensor>> {
    let mut states = Vec::with_capacity(detached.layers.len() + 1);
    let mut current = detached.embed(input_ids)?;
    for layer in &detached.layers {
        let next = layer_forward_streamed(layer, &current, layout, chunk)?;
        states.push(match offload {
            true => current.to_device(&candle_core::Device::Cpu)?,
            false => current,
        });
        current = next;
    }
    states.push(current);
    Ok(states)
}

/// Target log-probs `[batch, T]` of `targets` under `model`, without any graph and streamed like the
/// backward (one layer's hidden states at a time, query chunks, logits chunks): the reference model of
/// DPO and GRPO, and GRPO's old policy.
pub fn forward_logprobs(
    model: &Model,
    batch: Batch,
    targets: &Tensor,
    chunks: Chunks,
) -> Result<Tensor> {
    let detached = model.detached();
    let layout = batch.layout()?;
    on_workers(model.device(), || {
        let mut h = detached.embed(batch.input_ids)?;
        for layer in &detached.layers {
            h = layer_forward_streamed(layer, &h, &layout, chunks.chunk)?;
        }
        head_logprobs(
            &detached,
            &h,
            targets,
            &chunk_ranges(h.dim(1)?, chunks.logits_chunk),
        )
    })
}

/// Target log-probs `[batch, T]` of the last layer's output `last` under a detached model's final norm
/// and head, computed logits chunk by logits chunk (`ranges`), without a graph.
fn head_logprobs(
    detached: &Model,
    last: &Tensor,
    targets: &Tensor,
    ranges: &[Range<usize>],
) -> Result<Tensor> {
    let mut parts = Vec::with_capacity(ranges.len());
    for r in ranges {
        let normed = detached.final_norm(&last.narrow(1, r.start, r.len())?)?;
        let logits = detached.logits(&normed)?;
        parts.push(target_logprobs(
            &logits,
            &targets.narrow(1, r.start, r.len())?,
        )?);
    }
    Ok(Tensor::cat(&parts, 1)?)
}

/// Keys and values `[batch, kv_heads, T, head_dim]` of a layer input, computed chunk by chunk into
/// one buffer each (no list of parts to concatenate), in [`keys_dtype`] (f32 for bf16 on the host).
fn keys_values_streamed(
    layer: &DecoderLayer,
    x: &Tensor,
    layout: &Layout,
    chunk: usize,
) -> Result<(Tensor, Tensor)> {
    let (b, t, _) = x.dims3()?;
    let shape = (b, layer.shape.num_kv_heads, t, layer.shape.head_dim);
    let dtype = keys_dtype(x.dtype(), x.device());
    let keys = Tensor::zeros(shape, dtype, x.device())?;
    let values = keys.zeros_like()?;
    for r in chunk_ranges(t, chunk) {
        let normed = layer.norm_input(&x.narrow(1, r.start, r.len())?)?;
        let (k, v) = layer.keys_values(&normed, r.start, layout)?;
        keys.slice_set(&cast(&k, dtype)?, 2, r.start)?;
        values.slice_set(&cast(&v, dtype)?, 2, r.start)?;
    }
    Ok((keys, values))
}

/// One layer's output over query chunks (no graph when `layer` is detached): attention memory is
/// `chunk × T` per head instead of `T × T`.
fn layer_forward_streamed(
    layer: &DecoderLayer,
    x: &Tensor,
    layout: &Layout,
    chunk: usize,
) -> Result<Tensor> {
    let (keys, values) = keys_values_streamed(layer, x, layout, chunk)?;
    let out = x.zeros_like()?;
    for r in chunk_ranges(x.dim(1)?, chunk) {
        let k0 = layer.first_visible_key(r.start, layout);
        let block = KeyBlock {
            q_start: r.start,
            k_start: k0,
            layout,
            earlier: None,
        };
        let y = layer.forward_chunk(
            &x.narrow(1, r.start, r.len())?,
            &keys.narrow(2, k0, r.end - k0)?,
            &values.narrow(2, k0, r.end - k0)?,
            block,
        )?;
        out.slice_set(&y, 1, r.start)?;
    }
    Ok(out)
}

/// `log softmax(logits)[target]` for `logits` `[b, c, V]` and `targets` `[b, c]`, in f32 (f64 for f64
/// models), differentiable in the logits.
pub fn target_logprobs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let compute = if logits.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let z = logits.to_dtype(compute)?;
    let lse = z.log_sum_exp(D::Minus1)?;
    let picked = z
        .gather(&targets.unsqueeze(D::Minus1)?.contiguous()?, D::Minus1)?
        .squeeze(D::Minus1)?;
    Ok((picked - lse)?)
}

/// The objective's loss on `logp` of positions `cols` and its gradient `dLoss/dlogp` (autograd on the
/// tiny `[batch, cols]` tensor).
fn loss_and_grad(
    objective: &dyn Objective,
    logp: &Tensor,
    cols: Range<usize>,
) -> Result<(f64, Tensor)> {
    let lp = Var::from_tensor(&logp.detach())?;
    let loss = objective.loss(lp.as_tensor(), cols)?;
    let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    // An objective that does not read these positions (all ignored) has a zero gradient there.
    let grad = match loss.backward()?.get(lp.as_tensor()) {
        Some(g) => g.detach(),
        None => lp.as_tensor().zeros_like()?,
    };
    Ok((value, grad))
}

fn chunk_ranges(t: usize, size: usize) -> Vec<Range<usize>> {
    (0..t.div_ceil(size))
        .map(|i| i * size..((i + 1) * size).min(t))
        .collect()
}

/// Phase 2: final norm, LM head and loss over logits chunks. Returns the loss, the `[batch, T]` target
/// log-probs and the gradient of the last layer's output.
///
/// Per chunk the head's VJP is explicit (see [`head_chunk`]): with `g = dLoss/dlogp`,
/// `dlogits = g ⊙ (onehot(target) − softmax)`, `dH = dlogits·W`, `dW += dlogitsᵀ·H`. Separable objectives
/// give `g` chunk by chunk; others need all of `logp` first, so a forward-only pass computes it and the
/// loss before the backward pass. The final norm is backpropagated through autograd (`c × d` only).
fn head_backward(
    model: &Model,
    last: &Tensor,
    objective: &dyn Objective,
    logits_chunk: usize,
    sink: &mut GradSink,
) -> Result<(f64, Tensor, Tensor)> {
    let t = last.dim(1)?;
    let targets = objective.targets();
    let ranges = chunk_ranges(t, logits_chunk);
    let detached = model.detached();
    let whole = if objective.separable() {
        None
    } else {
        let logp = head_logprobs(&detached, last, targets, &ranges)?;
        Some(loss_and_grad(objective, &logp, 0..t)?)
    };

    // The head's weight gradient only where the head is trained (not under LoRA).
    let head = model.head_parameter().map(|(name, _)| name);
    let grad_last = last.zeros_like()?;
    let mut logp_parts = Vec::with_capacity(ranges.len());
    let mut loss = 0.0;
    for r in ranges {
        let x = Var::from_tensor(&last.narrow(1, r.start, r.len())?)?;
        let h = model.final_norm(x.as_tensor())?;
        let chunk_targets = targets.narrow(1, r.start, r.len())?;
        let grad_of = |logp: &Tensor| -> Result<Tensor> {
            Ok(match &whole {
                Some((_, g)) => g.narrow(1, r.start, r.len())?,
                None => {
                    let (l, g) = loss_and_grad(objective, logp, r.clone())?;
                    loss += l;
                    g
                }
            })
        };
        let out = head_chunk(&detached, &h.detach(), &chunk_targets, grad_of)?;
        if let Some(name) = head {
            let (b, c, d) = h.dims3()?;
            let h = h.detach().reshape((b * c, d))?;
            sink.add_product(name, &out.grad_logits.t()?, &h)?;
        }
        let store = seed(&h, &out.grad_hidden)?.backward()?;
        grad_last.slice_set(
            &required(&store, x.as_tensor(), "last hidden state")?,
            1,
            r.start,
        )?;
        sink.absorb(&store, model.final_norm_parameter().into_iter())?;
        logp_parts.push(out.logp);
    }
    if let Some((l, _)) = whole {
        loss = l;
    }
    Ok((loss, Tensor::cat(&logp_parts, 1)?, grad_last))
}

/// What one LM-head chunk yields.
struct HeadChunk {
    /// `[b, c]` target log-probs.
    logp: Tensor,
    /// `[b, c, d]` gradient of the normed hidden states.
    grad_hidden: Tensor,
    /// `[b·c, V]` gradient of the logits: the head weight's gradient is its transpose times the
    /// normed hidden states.
    grad_logits: Tensor,
}

/// The LM head's forward and explicit VJP on one chunk of normed hidden states `h` (`[b, c, d]`,
/// detached). `grad_of` maps the chunk's `logp` to `dLoss/dlogp`.
///
/// With `z` the (soft-capped) logits in f32/f64 and `p = softmax(z)`, `d logp / dz = onehot − p`; a
/// soft-cap (the model's [`Model::soft_cap`]) adds its slope as a factor. Writing it out avoids
/// autograd's `[V, d]` zero-fill and strided transpose-add per chunk.
fn head_chunk(
    detached: &Model,
    h: &Tensor,
    targets: &Tensor,
    mut grad_of: impl FnMut(&Tensor) -> Result<Tensor>,
) -> Result<HeadChunk> {
    let (b, c, d) = h.dims3()?;
    let n = b * c;
    let h2 = h.reshape((n, d))?;
    let weight = detached.head_weight();
    let dtype = h.dtype();
    let compute = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    // The model's own head product (on the host one gemm into a buffer that is never zero-filled).
    let z = detached.logits(&h2)?.to_dtype(compute)?;
    let idx = targets.reshape((n, 1))?.contiguous()?;
    // Before the softmax, which on the host writes its exponentials over `z`.
    let slope = detached.soft_cap_slope(&z)?;
    // On the CPU two passes per row in `z`'s buffer (crate::head_softmax); elsewhere the same with
    // tensor ops.
    let (logp, mut dz) = match crate::head_softmax::log_softmax_rows(&z, &idx)? {
        Some(rows) => {
            let logp = rows.logp.reshape((b, c))?;
            let g = grad_of(&logp)?.to_dtype(compute)?;
            let dz = rows.logit_grad(&g)?;
            (logp, dz)
        }
        None => {
            let lse = z.log_sum_exp(D::Minus1)?;
            let logp = (z.gather(&idx, D::Minus1)?.squeeze(D::Minus1)? - &lse)?.reshape((b, c))?;
            let g = grad_of(&logp)?.to_dtype(compute)?.reshape((n, 1))?;
            let p = z.broadcast_sub(&lse.unsqueeze(D::Minus1)?)?.exp()?;
            let dz = p
                .broadcast_mul(&g.neg()?)?
                .scatter_add(&idx, &g, D::Minus1)?;
            (logp, dz)
        }
    };
    if let Some(slope) = slope {
        dz = (dz * slope)?;
    }
    let dz = dz.to_dtype(dtype)?;
    Ok(HeadChunk {
        logp,
        grad_hidden: half_product::matmul(&dz, weight)?.reshape((b, c, d))?,
        grad_logits: dz,
    })
}

/// Phase 3 (StreamBP): one layer's backward streamed over query chunks. `x` is the layer's input
/// (checkpoint), `grad_out` the gradient of its output; returns the gradient of its input.
///
/// Query chunks are visited last first. Keys and values of the whole sequence are recomputed once
/// without a graph; when chunk `[s, e)` is reached, every later chunk has already pushed its gradient
/// into keys/values `[s, e)`, so that gradient is final. One graph per chunk then covers: the chunk's
/// queries against keys `[k0, e)` (earlier keys as detached leaves whose gradients are accumulated, the
/// chunk's own keys/values recomputed from `x_c` in the graph), the rest of the layer, and the pending
/// key/value gradient of `[s, e)` through the chunk's own k/v projections. Its backward yields the
/// chunk's input gradient complete. Queries never score keys they cannot see (future, outside the window).
#[allow(clippy::too_many_arguments)]
fn layer_backward_streamed(
    layer: &DecoderLayer,
    x: &Tensor,
    grad_out: &Tensor,
    layout: &Layout,
    chunk: usize,
    sink: &mut GradSink,
    model: &Model,
    index: usize,
) -> Result<Tensor> {
    let t = x.dim(1)?;
    let ranges = chunk_ranges(t, chunk);
    let (keys, values) = keys_values_streamed(&layer.detached(), x, layout, chunk)?;
    // The gradients of the layer's keys and values, filled from the last chunk backwards. Two writers:
    // each chunk's graph pushes its queries' gradient into the keys/values of *earlier* chunks through
    // the attention op's backward, which adds it in place into these buffers
    // (`streambp_models::attention`: `EarlierKeys::grad_keys` / `grad_values`, its `add_at`); a
    // chunk's *own* keys/values get theirs from its graph, and the buffers' `[s, e)` part, complete by
    // then, is fed into that graph by the surrogate below.
    let grad_keys = keys.zeros_like()?;
    let grad_values = values.zeros_like()?;
    let grad_in = x.zeros_like()?;
    // The projections' weight gradients go straight into the sink's accumulators: no chunk makes a
    // weight-sized buffer.
    let params = model.layer_parameters(index);
    let layer = layer.accumulating_into(|weight| {
        match params
            .iter()
            .find(|(_, var)| var.as_tensor().id() == weight.id())
        {
            Some((name, _)) => sink.accumulator(name, weight),
            None => Ok(None),
        }
    })?;
    let layer = &layer;

    for r in ranges.into_iter().rev() {
        let (s, len) = (r.start, r.len());
        let k0 = layer.first_visible_key(s, layout);
        let x_c = Var::from_tensor(&x.narrow(1, s, len)?)?;
        let normed = layer.norm_input(x_c.as_tensor())?;
        let (k_own, v_own) = layer.keys_values(&normed, s, layout)?;
        let q = layer.queries(&normed, s, layout)?;
        // Keys before the chunk are constants of its graph; the attention op adds their gradients
        // straight into `grad_keys` / `grad_values`.
        let earlier = match k0 < s {
            true => Some(EarlierKeys {
                keys: keys.narrow(2, k0, s - k0)?,
                values: values.narrow(2, k0, s - k0)?,
                grad_keys: grad_keys.clone(),
                grad_values: grad_values.clone(),
                offset: k0,
            }),
            false => None,
        };
        let block = KeyBlock {
            q_start: s,
            k_start: k0,
            layout,
            earlier: earlier.as_ref(),
        };
        let attn = layer.attend(&q, &k_own, &v_own, block)?;
        let y = layer.after_attention(x_c.as_tensor(), &attn, s, layout)?;
        // (Kept in f32 for a bf16 model on the host, the complete gradients are rounded once here.)
        let own = |grads: &Tensor| cast(&grads.narrow(2, s, len)?, k_own.dtype());
        let surrogate = (seed(&y, &grad_out.narrow(1, s, len)?)?
            + seed(&k_own, &own(&grad_keys)?)?
            + seed(&v_own, &own(&grad_values)?)?)?;
        let store = surrogate.backward()?;
        grad_in.slice_set(&required(&store, x_c.as_tensor(), "layer input")?, 1, s)?;
        sink.absorb(&store, model.layer_parameters(index).iter())?;
    }
    Ok(grad_in)
}

/// Phase 3 (checkpoint): the layer recomputed over the whole sequence with a graph and backpropagated.
fn layer_backward_whole(
    layer: &DecoderLayer,
    x: &Tensor,
    grad_out: &Tensor,
    layout: &Layout,
    sink: &mut GradSink,
    model: &Model,
    index: usize,
) -> Result<Tensor> {
    let x = Var::from_tensor(x)?;
    let y = layer.forward(x.as_tensor(), layout)?;
    let store = seed(&y, grad_out)?.backward()?;
    let grad_in = required(&store, x.as_tensor(), "layer input")?;
    sink.absorb(&store, model.layer_parameters(index).iter())?;
    Ok(grad_in)
}

/// Phase 4: the gradient of the embedding table from the gradient of the first layer's input, by the
/// lookup's written-out VJP ([`Model::embed_vjp_rows`]) rather than a graph that would hold several
/// `[b, T, d]` copies; its rows are added into the table's accumulator in place where that can be
/// (tied to the head, the accumulator already holds the head's share: no second table-sized buffer).
fn embedding_backward(
    model: &Model,
    input_ids: &Tensor,
    grad: &Tensor,
    sink: &mut GradSink,
) -> Result<()> {
    match model.embedding_parameter() {
        Some((name, table)) => {
            let (ids, rows) = model.embed_vjp_rows(input_ids, grad)?;
            sink.add_rows(name, table.as_tensor(), &ids, &rows)
        }
        None => Ok(()),
    }
}

/// `full`: one graph over the model and the loss.
fn full_backward(
    model: &Model,
    batch: Batch,
    layout: &Layout,
    objective: &dyn Objective,
    sink: &mut GradSink,
) -> Result<(f64, Tensor)> {
    let mut h = model.embed(batch.input_ids)?;
    for layer in &model.layers {
        h = layer.forward(&h, layout)?;
    }
    let logits = model.logits(&model.final_norm(&h)?)?;
    let logp = target_logprobs(&logits, objective.targets())?;
    let t = logp.dim(1)?;
    let loss = objective.loss(&logp, 0..t)?;
    let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let store = loss.backward()?;
    sink.absorb(&store, model.parameters().iter())?;
    Ok((value, logp.detach()))
}

fn required(store: &GradStore, t: &Tensor, what: &str) -> Result<Tensor> {
    store
        .get(t)
        .map(Tensor::detach)
        .ok_or_else(|| EngineError::MissingGradient(what.to_string()))
}

/// The dtype gradients of `dtype` parameters are summed in: f32 for half precision (a sum over many
/// chunks in bf16 would lose the small shares), the parameter's own otherwise.
fn accumulator_dtype(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        other => other,
    }
}

/// Accumulates parameter gradients across chunks and phases, detached (so no chunk's graph stays
/// alive) and in f32 for half-precision models (so chunking does not add rounding).
struct GradSink {
    acc: HashMap<String, Tensor>,
    /// Accumulators made by the sink's own arithmetic, whose storage nothing else holds: these are
    /// added into in place ([`crate::accumulate`]).
    owned: HashSet<String>,
    /// Parameters whose finished gradients were handed on ([`FinishedGradients`]).
    taken: HashSet<String>,
}

impl GradSink {
    fn new() -> Self {
        Self {
            acc: HashMap::new(),
            owned: HashSet::new(),
            taken: HashSet::new(),
        }
    }

    /// Removes and returns the accumulator of `name`.
    fn remove(&mut self, name: &str) -> Option<Tensor> {
        self.owned.remove(name);
        self.acc.remove(name)
    }

    /// Hands over the (sealed) gradients of `params`, in their order; a parameter that got none is an
    /// error, as in [`GradSink::finish`].
    fn take(&mut self, params: &[(String, Var)]) -> Result<Vec<(String, Tensor)>> {
        params
            .iter()
            .map(|(name, var)| {
                let g = self
                    .remove(name)
                    .ok_or_else(|| EngineError::MissingGradient(name.clone()))?;
                self.taken.insert(name.clone());
                Ok((name.clone(), g.to_dtype(var.dtype())?))
            })
            .collect()
    }

    /// Adds the gradients `store` holds for `params`.
    fn absorb<'a>(
        &mut self,
        store: &GradStore,
        params: impl Iterator<Item = &'a (String, Var)>,
    ) -> Result<()> {
        for (name, var) in params {
            if let Some(g) = store.get(var.as_tensor()) {
                self.add(name, g.detach())?;
            }
        }
        Ok(())
    }

    /// The accumulator of `name` (`like`'s shape), made zero if there is none yet, for adding into in
    /// place; `None` where it could not be (one the sink does not own, or off the host). A half
    /// precision parameter's accumulator is f32 ([`accumulator_dtype`]).
    fn accumulator(&mut self, name: &str, like: &Tensor) -> Result<Option<Tensor>> {
        self.accumulator_for(name, like.shape(), like.dtype(), like.device())
    }

    /// [`GradSink::accumulator`] for a parameter of this shape, dtype and device.
    fn accumulator_for(
        &mut self,
        name: &str,
        shape: &candle_core::Shape,
        dtype: DType,
        device: &candle_core::Device,
    ) -> Result<Option<Tensor>> {
        let dtype = accumulator_dtype(dtype);
        if !self.acc.contains_key(name) {
            let zeros = Tensor::zeros(shape, dtype, device)?;
            self.acc.insert(name.to_string(), zeros);
            self.owned.insert(name.to_string());
        }
        Ok(self
            .acc
            .get(name)
            .filter(|acc| self.owned.contains(name) && acc.dtype() == dtype)
            .cloned())
    }

    /// Adds a gradient that other tensors may share storage with (autograd's).
    fn add(&mut self, name: &str, grad: Tensor) -> Result<()> {
        self.accumulate(name, grad, false)
    }

    /// Adds the gradient `a·b` (a weight's share from one chunk: the LM head's `dzᵀ·h`), into the
    /// accumulator in place where it can. In half precision on the host the first chunk's share goes
    /// into a zero f32 accumulator too, never through a product rounded to bf16.
    fn add_product(&mut self, name: &str, a: &Tensor, b: &Tensor) -> Result<()> {
        let half_on_host = a.device().is_cpu() && accumulator_dtype(a.dtype()) != a.dtype();
        if !self.acc.contains_key(name) && half_on_host {
            let shape = (a.dim(0)?, b.dim(1)?).into();
            self.accumulator_for(name, &shape, a.dtype(), a.device())?;
        }
        if let Some(acc) = self.acc.get(name) {
            if self.owned.contains(name) && accumulate::add_product(acc, a, b)? {
                return Ok(());
            }
        }
        self.accumulate(name, half_product::matmul(a, b)?, true)
    }

    /// Adds `rows[i]` into row `ids[i]` of the gradient of `name` (shaped like `table`): in place on
    /// the host in f32/f64, else as a table-sized sum added like any other.
    fn add_rows(&mut self, name: &str, table: &Tensor, ids: &Tensor, rows: &Tensor) -> Result<()> {
        if streambp_models::cpu::fusable(table) && rows.dtype() == table.dtype() {
            if let Some(acc) = self.accumulator(name, table)? {
                if accumulate::add_rows(&acc, ids, rows)? {
                    return Ok(());
                }
            }
        }
        let grad = table.detach().zeros_like()?.index_add(ids, rows, 0)?;
        self.accumulate(name, grad, true)
    }

    /// Adds `grad` (`fresh`: a tensor only the sink holds) to the accumulator of `name`: in place
    /// once the sink owns the accumulator, else as a new sum, which it then owns.
    fn accumulate(&mut self, name: &str, grad: Tensor, fresh: bool) -> Result<()> {
        let dtype = accumulator_dtype(grad.dtype());
        let (grad, fresh) = match grad.dtype() == dtype {
            true => (grad, fresh),
            false => (grad.to_dtype(dtype)?, true),
        };
        if let Some(acc) = self.acc.get(name) {
            if self.owned.contains(name) && accumulate::add(acc, &grad)? {
                return Ok(());
            }
        }
        let (sum, owned) = match self.remove(name) {
            Some(prev) => ((prev.to_dtype(grad.dtype())? + grad)?, true),
            None => (grad, fresh),
        };
        if owned {
            self.owned.insert(name.to_string());
        }
        self.acc.insert(name.to_string(), sum);
        Ok(())
    }

    /// Rounds the gradients of `params` to their parameters' dtype once nothing more will be added to
    /// them (a layer after its backward): the result is the same as rounding at the end, and a bf16
    /// model then holds 2 bytes per finished gradient instead of 4.
    fn seal<'a>(&mut self, params: impl Iterator<Item = &'a (String, Var)>) -> Result<()> {
        for (name, var) in params {
            if let Some(g) = self.acc.get_mut(name) {
                if g.dtype() != var.dtype() {
                    *g = g.to_dtype(var.dtype())?;
                }
            }
        }
        Ok(())
    }

    /// Every parameter's gradient in the model's order and dtype; a parameter that received none is an
    /// error (a dropped gradient must never read as zero).
    fn finish(mut self, model: &Model) -> Result<Vec<(String, Tensor)>> {
        model
            .parameters()
            .iter()
            .filter(|(name, _)| !self.taken.contains(name))
            .map(|(name, var)| {
                let g = self
                    .acc
                    .remove(name)
                    .ok_or_else(|| EngineError::MissingGradient(name.clone()))?;
                Ok((name.clone(), g.to_dtype(var.dtype())?))
            })
            .collect()
    }
}
