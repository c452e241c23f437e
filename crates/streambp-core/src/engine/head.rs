//! Phase 2 of the backward: final norm, LM head and objective, a chunk of positions at a time
//! (logits never exist for the whole sequence), and the forward-only log-probs the same way.

use std::ops::Range;

use candle_core::{DType, Tensor, Var, D};
use streambp_kernels::op_times;
use streambp_kernels::ops::cast::{cast, round_in_place};
use streambp_kernels::ops::head_softmax::{self, HeadRows};
use streambp_kernels::ops::matmul;
use streambp_models::Model;
use streambp_objectives::Objective;

use crate::error::Result;
use crate::seed::seed;

use super::grad_sink::GradSink;
use super::required;
use super::sequence::Shard;

/// Target log-probs `[batch, T]` of the last layer's output `last` under a detached model's final norm
/// and head at `temperature`, computed logits chunk by logits chunk (`ranges`), without a graph;
/// `with_entropy`: each position's entropy too.
pub(super) fn head_logprobs(
    detached: &Model,
    last: &Tensor,
    targets: &Tensor,
    ranges: &[Range<usize>],
    (temperature, with_entropy): (f64, bool),
) -> Result<(Tensor, Option<Tensor>)> {
    let mut parts = Vec::with_capacity(ranges.len());
    let mut entropies = Vec::new();
    for r in ranges {
        let normed = detached.final_norm(&last.narrow(1, r.start, r.len())?)?;
        let chunk_targets = targets.narrow(1, r.start, r.len())?;
        if with_entropy {
            let (b, c, d) = normed.dims3()?;
            let (z, _) = chunk_logits(detached, &normed.reshape((b * c, d))?)?;
            let idx = chunk_targets.reshape((b * c, 1))?.contiguous()?;
            let (logp, entropy) = EntropyRows::of(&tempered(z, temperature)?, &idx)?.values()?;
            parts.push(logp.reshape((b, c))?);
            entropies.push(entropy.reshape((b, c))?);
            continue;
        }
        parts.push(chunk_logprobs(
            detached,
            &normed,
            &chunk_targets,
            temperature,
        )?);
    }
    let entropy = match with_entropy {
        true => Some(Tensor::cat(&entropies, 1)?),
        false => None,
    };
    Ok((Tensor::cat(&parts, 1)?, entropy))
}

/// Each row's target log-prob and entropy of tempered logits `z` (`[n, V]`), for an objective that
/// reads the entropies ([`Objective::reads_entropy`]), and what their gradient needs: the kernels'
/// passes ([`head_softmax::entropy_rows`], `z`'s buffer alone) where they apply, else composed
/// tensor ops, which keep a few more `[n, V]` buffers per logits chunk.
enum EntropyRows {
    Fused {
        rows: HeadRows,
        /// `[n]`: the rows' entropies.
        entropy: Tensor,
    },
    Composed {
        /// `[n]`: the targets' log-probs.
        logp: Tensor,
        /// `[n]`: `H = −Σ_v p_v log p_v`.
        entropy: Tensor,
        /// `[n, V]`: `log p`.
        log_probs: Tensor,
    },
}

impl EntropyRows {
    /// The rows of `z` and their targets `idx` (`[n, 1]`); `z` itself is left as it is, but its
    /// buffer is handed over: [`EntropyRows::logit_grad`] may write over it.
    fn of(z: &Tensor, idx: &Tensor) -> Result<Self> {
        if let Some(rows) = head_softmax::entropy_rows(z, idx)? {
            let entropy = rows.entropy.clone().ok_or_else(|| {
                candle_core::Error::Msg("head softmax: entropy rows without entropies".into())
            })?;
            return Ok(Self::Fused { rows, entropy });
        }
        let lse = z.log_sum_exp(D::Minus1)?;
        let log_probs = z.broadcast_sub(&lse.unsqueeze(D::Minus1)?)?;
        let entropy = (log_probs.exp()? * &log_probs)?.sum(D::Minus1)?.neg()?;
        let logp = log_probs.gather(idx, D::Minus1)?.squeeze(D::Minus1)?;
        Ok(Self::Composed {
            logp,
            entropy,
            log_probs,
        })
    }

    /// `[n]` target log-probs and `[n]` entropies.
    fn values(&self) -> Result<(Tensor, Tensor)> {
        Ok(match self {
            Self::Fused { rows, entropy } => (rows.logp.clone(), entropy.clone()),
            Self::Composed { logp, entropy, .. } => (logp.clone(), entropy.clone()),
        })
    }

    /// `dLoss/dz` from the gradients `g` of the targets' log-probs and `g_entropy` of the
    /// entropies (`[n, 1]` each): `g ⊙ (onehot − p) − g_entropy ⊙ p ⊙ (log p + H)`.
    fn logit_grad(self, idx: &Tensor, g: &Tensor, g_entropy: &Tensor) -> Result<Tensor> {
        let (entropy, log_probs) = match self {
            Self::Fused { rows, .. } => return Ok(rows.logit_grad(g, Some(g_entropy))?),
            Self::Composed {
                entropy, log_probs, ..
            } => (entropy, log_probs),
        };
        let p = log_probs.exp()?;
        let from_logp = p.broadcast_mul(&g.neg()?)?.scatter_add(idx, g, D::Minus1)?;
        let centred = log_probs.broadcast_add(&entropy.unsqueeze(D::Minus1)?)?;
        let from_entropy = (p * centred)?.broadcast_mul(&g_entropy.neg()?)?;
        Ok((from_logp + from_entropy)?)
    }
}

/// [`head_outputs`] of one chunk of normed rows `normed` (`[b, c, d]`), without a graph: on the
/// host the softmax's passes in the logits' one buffer ([`streambp_kernels::ops::head_softmax`]), as the head's
/// backward takes them, so this pass (the loss of an objective that reads every position first,
/// a frozen model's log-probs) holds no more than the backward does; the composed ops elsewhere.
fn chunk_logprobs(
    detached: &Model,
    normed: &Tensor,
    targets: &Tensor,
    temperature: f64,
) -> Result<Tensor> {
    if detached.scores_positions() {
        return head_outputs(detached, detached.logits(normed)?, targets, temperature);
    }
    let (b, c, d) = normed.dims3()?;
    let (z, _) = chunk_logits(detached, &normed.reshape((b * c, d))?)?;
    let z = tempered(z, temperature)?;
    let idx = targets.reshape((b * c, 1))?.contiguous()?;
    Ok(match head_softmax::log_softmax_rows(&z, &idx)? {
        Some(rows) => rows.logp.reshape((b, c))?,
        None => target_logprobs(&z.reshape((b, c, ()))?, targets)?,
    })
}

/// The logits of normed rows `h2` (`[n, d]`) in the compute dtype, for the softmax: on the host a
/// bf16 head's as f32 holding bf16 values (`true`: its gradient is then rounded to bf16 in place),
/// else the model's logits cast (on the host split over the threads: `cpu::cast`).
fn chunk_logits(detached: &Model, h2: &Tensor) -> Result<(Tensor, bool)> {
    Ok(match detached.logits_as_bf16_values(h2)? {
        Some(z) => (z, true),
        None => {
            let compute = compute_dtype(h2.dtype());
            (cast(&detached.logits(h2)?, compute)?, false)
        }
    })
}

/// What the objective reads from the head's `logits` `[b, c, V]`: the targets' log-probs at
/// `temperature`, or a reward model's scores (`V = 1`: one per position), in f32 (f64 for f64
/// models), differentiable in the logits. The logits are divided by the temperature in that
/// dtype, as the streamed head does.
pub(super) fn head_outputs(
    model: &Model,
    logits: Tensor,
    targets: &Tensor,
    temperature: f64,
) -> Result<Tensor> {
    let z = logits.to_dtype(compute_dtype(logits.dtype()))?;
    if model.scores_positions() {
        return Ok(z.squeeze(D::Minus1)?);
    }
    target_logprobs(&tempered(z, temperature)?, targets)
}

/// `logits / temperature` (the logits themselves at temperature 1).
pub(super) fn tempered(logits: Tensor, temperature: f64) -> Result<Tensor> {
    Ok(match temperature == 1.0 {
        true => logits,
        false => logits.affine(1.0 / temperature, 0.0)?,
    })
}

/// Each position's entropy `−Σ_v p_v log p_v` of `p = softmax(z)` for tempered logits `z`
/// (`[b, c, V]`), differentiable in them (the plain backward's).
pub(super) fn entropies(z: &Tensor) -> Result<Tensor> {
    let log_probs = z.broadcast_sub(&z.log_sum_exp(D::Minus1)?.unsqueeze(D::Minus1)?)?;
    Ok((log_probs.exp()? * &log_probs)?.sum(D::Minus1)?.neg()?)
}

/// What the head's outputs are computed in: f32, f64 for f64 models.
pub(crate) fn compute_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// `log softmax(logits)[target]` for `logits` `[b, c, V]` and `targets` `[b, c]`, in f32 (f64 for f64
/// models), differentiable in the logits.
pub fn target_logprobs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let z = logits.to_dtype(compute_dtype(logits.dtype()))?;
    let lse = z.log_sum_exp(D::Minus1)?;
    let picked = z
        .gather(&targets.unsqueeze(D::Minus1)?.contiguous()?, D::Minus1)?
        .squeeze(D::Minus1)?;
    Ok((picked - lse)?)
}

/// The objective's loss on `logp` (and `entropy`, where it reads them) of positions `cols` (an f64
/// scalar on their device, not read here: see [`summed`]) and its gradients `dLoss/dlogp` and
/// `dLoss/dentropy` (autograd on the tiny `[batch, cols]` tensors).
fn loss_and_grad(
    objective: &dyn Objective,
    (logp, entropy): (&Tensor, Option<&Tensor>),
    cols: Range<usize>,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let lp = Var::from_tensor(&logp.detach())?;
    let h = entropy.map(|e| Var::from_tensor(&e.detach())).transpose()?;
    let loss = match &h {
        Some(h) => objective.loss_with_entropy(lp.as_tensor(), h.as_tensor(), cols)?,
        None => objective.loss(lp.as_tensor(), cols)?,
    };
    let value = loss.to_dtype(DType::F64)?.detach();
    let store = loss.backward()?;
    // An objective that does not read these positions (all ignored) has a zero gradient there.
    let grad_of = |x: &Var| -> Result<Tensor> {
        Ok(match store.get(x.as_tensor()) {
            Some(g) => g.detach(),
            None => x.as_tensor().zeros_like()?,
        })
    };
    let grad_entropy = h.as_ref().map(grad_of).transpose()?;
    Ok((value, grad_of(&lp)?, grad_entropy))
}

/// `total + loss` for the chunks' losses, summed on their device: reading each chunk's loss back
/// would make the host wait for the card at every logits chunk; the sum is read once.
fn summed(total: Option<Tensor>, loss: Tensor) -> Result<Option<Tensor>> {
    Ok(Some(match total {
        Some(total) => (total + loss)?,
        None => loss,
    }))
}

/// The value of a summed loss (0 for none).
fn read_loss(total: Option<Tensor>) -> Result<f64> {
    Ok(match total {
        Some(t) => t.to_scalar::<f64>()?,
        None => 0.0,
    })
}

/// Phase 2: final norm, LM head and loss over logits chunks. Returns the loss, the `[batch, T]` target
/// log-probs and the gradient of the last layer's output.
///
/// Per chunk the head's VJP is explicit (see [`head_chunk`]): with `g = dLoss/dlogp`,
/// `dlogits = g ⊙ (onehot(target) − softmax)`, `dH = dlogits·W`, `dW += dlogitsᵀ·H`. Separable objectives
/// give `g` chunk by chunk; others need all of `logp` first, so a forward-only pass computes it and the
/// loss before the backward pass. The final norm is backpropagated through autograd (`c × d` only).
///
/// `last` and the returned gradient hold the `shard`'s positions. A separable loss is the sum of
/// every shard's terms; another reads the whole rows' log-probs, gathered (the same loss and gradient
/// on every rank, each keeping its own positions'). The returned log-probs (and entropies, for an
/// objective that reads them) are the whole rows'.
pub(super) fn head_backward(
    model: &Model,
    last: &Tensor,
    objective: &dyn Objective,
    (logits_chunk, shard): (usize, &Shard),
    sink: &mut GradSink,
) -> Result<HeadResult> {
    let targets = shard.local(objective.targets(), 1)?;
    let chunks = shard.chunks(logits_chunk);
    let ranges: Vec<Range<usize>> = chunks.iter().map(|c| c.local.clone()).collect();
    let detached = model.detached();
    let temperature = objective.temperature();
    let reads = Reads::of(objective);
    let with_entropy = reads != Reads::Targets;
    if reads == Reads::Logits && !objective.separable() {
        return Err(crate::EngineError::Objective(
            streambp_objectives::ObjectiveError::Loss(format!(
                "{} reads the logits and is not a sum over positions, which no engine mode runs",
                objective.name()
            )),
        ));
    }
    let whole = if objective.separable() {
        None
    } else {
        let settings = (temperature, with_entropy);
        let (logp, entropy) = head_logprobs(&detached, last, &targets, &ranges, settings)?;
        let logp = shard.gather(&logp, 1)?;
        let entropy = entropy.map(|e| shard.gather(&e, 1)).transpose()?;
        let (loss, grad, grad_entropy) =
            loss_and_grad(objective, (&logp, entropy.as_ref()), 0..shard.total)?;
        let grad_entropy = grad_entropy.map(|g| shard.local(&g, 1)).transpose()?;
        Some((loss, shard.local(&grad, 1)?, grad_entropy))
    };

    // The head's weight gradient only where the head is trained (not under LoRA).
    let head = model.head_parameter().map(|(name, _)| name);
    let grad_last = last.zeros_like()?;
    let mut logp_parts = Vec::with_capacity(ranges.len());
    let mut entropy_parts = Vec::new();
    let mut loss = None;
    for c in chunks {
        let r = c.local.clone();
        let x = Var::from_tensor(&last.narrow(1, r.start, r.len())?)?;
        let h = model.final_norm(x.as_tensor())?;
        let chunk_targets = targets.narrow(1, r.start, r.len())?;
        let grad_of = |view: ChunkView| -> Result<ChunkGrads> {
            Ok(match (&whole, view) {
                (Some((_, g, g_entropy)), _) => {
                    let here = |g: &Tensor| g.narrow(1, r.start, r.len());
                    (here(g)?, g_entropy.as_ref().map(here).transpose()?)
                }
                (None, ChunkView::Targets { logp, entropy }) => {
                    let (l, g, g_entropy) = loss_and_grad(objective, (logp, entropy), c.global())?;
                    loss = summed(loss.take(), l)?;
                    (g, g_entropy)
                }
                (None, ChunkView::Logits(z)) => {
                    let (l, dz) = logits_loss_and_grad(objective, z, c.global())?;
                    loss = summed(loss.take(), l)?;
                    (dz, None)
                }
            })
        };
        let out = head_chunk(
            &detached,
            &h.detach(),
            (&chunk_targets, temperature, reads),
            grad_of,
        )?;
        if let Some(name) = head {
            op_times::timed("head.weight_gradient", last.device(), || {
                let (b, c, d) = h.dims3()?;
                let h = h.detach().reshape((b * c, d))?;
                let dz_t = out.grad_logits.t()?;
                match out.grad_logits.dtype() == h.dtype() {
                    true => sink.add_product(name, &dz_t, &h),
                    false => sink.add_product_of_bf16_values(name, &dz_t, &h),
                }
            })?;
        }
        let store = seed(&h, &out.grad_hidden)?.backward()?;
        grad_last.slice_set(
            &required(&store, x.as_tensor(), "last hidden state")?,
            1,
            r.start,
        )?;
        sink.absorb(&store, model.final_norm_parameter().into_iter())?;
        logp_parts.push(out.logp);
        entropy_parts.extend(out.entropy);
    }
    let loss = match whole {
        Some((l, _, _)) => read_loss(Some(l))?,
        None => shard.sum(read_loss(loss)?)?,
    };
    let whole_rows = |parts: &[Tensor]| shard.gather(&Tensor::cat(parts, 1)?, 1);
    Ok(HeadResult {
        loss,
        logp: whole_rows(&logp_parts)?,
        entropy: match with_entropy {
            true => Some(whole_rows(&entropy_parts)?),
            false => None,
        },
        grad_last,
    })
}

/// What [`head_backward`] yields.
pub(super) struct HeadResult {
    /// The objective's loss.
    pub loss: f64,
    /// `[batch, T]` target log-probs of the whole rows.
    pub logp: Tensor,
    /// `[batch, T]` entropies of the whole rows, for an objective that reads them.
    pub entropy: Option<Tensor>,
    /// The gradient of the last layer's output (the shard's positions).
    pub grad_last: Tensor,
}

/// The gradients of a chunk's target log-probs and, where the objective reads them, its entropies;
/// or of its logits, for an objective that reads them.
type ChunkGrads = (Tensor, Option<Tensor>);

/// What an objective reads of each logits chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reads {
    /// The targets' log-probs.
    Targets,
    /// The targets' log-probs and each position's entropy ([`Objective::reads_entropy`]).
    TargetsAndEntropy,
    /// The whole tempered logits ([`Objective::reads_logits`]).
    Logits,
}

impl Reads {
    /// What `objective` reads.
    pub(crate) fn of(objective: &dyn Objective) -> Self {
        match (objective.reads_logits(), objective.reads_entropy()) {
            (true, _) => Reads::Logits,
            (false, true) => Reads::TargetsAndEntropy,
            (false, false) => Reads::Targets,
        }
    }
}

/// A logits chunk as the objective reads it.
enum ChunkView<'t> {
    /// `[b, c]` target log-probs, and entropies where read.
    Targets {
        logp: &'t Tensor,
        entropy: Option<&'t Tensor>,
    },
    /// `[b, c, V]` tempered logits.
    Logits(&'t Tensor),
}

/// The loss of an objective that reads the logits on a chunk's tempered logits `z` (positions
/// `cols`; an f64 scalar on their device, as [`loss_and_grad`]'s) and its gradient `dLoss/dz`
/// (autograd on the chunk).
fn logits_loss_and_grad(
    objective: &dyn Objective,
    z: &Tensor,
    cols: Range<usize>,
) -> Result<(Tensor, Tensor)> {
    let zv = Var::from_tensor(&z.detach())?;
    let loss = objective.logits_loss(zv.as_tensor(), cols)?;
    let value = loss.to_dtype(DType::F64)?.detach();
    let grad = match loss.backward()?.get(zv.as_tensor()) {
        Some(g) => g.detach(),
        None => zv.as_tensor().zeros_like()?,
    };
    Ok((value, grad))
}

/// What one LM-head chunk yields.
struct HeadChunk {
    /// `[b, c]` target log-probs.
    logp: Tensor,
    /// `[b, c]` entropies, where the objective reads them.
    entropy: Option<Tensor>,
    /// `[b, c, d]` gradient of the normed hidden states.
    grad_hidden: Tensor,
    /// `[b·c, V]` gradient of the logits, in the model's dtype or, for a bf16 head on the host,
    /// f32 holding its bf16 values: the head weight's gradient is its transpose times the normed
    /// hidden states.
    grad_logits: Tensor,
}

/// The LM head's forward and explicit VJP on one chunk of normed hidden states `h` (`[b, c, d]`,
/// detached), its log-probs of `targets` taken at `temperature`, and what the objective `reads`
/// beside them (each position's entropy, or the whole logits). `grad_of` maps the chunk as the
/// objective reads it to the gradient of its loss (`dLoss/dlogp` and `dLoss/dentropy`, or
/// `dLoss/dlogits`).
///
/// With `z` the (soft-capped) logits in f32/f64 divided by the temperature `τ` and `p = softmax(z)`,
/// `d logp / dz = onehot − p`, and `1/τ` and a soft-cap's slope (the model's [`Model::soft_cap`])
/// are factors on the way back to the logits. Writing it out avoids autograd's `[V, d]` zero-fill
/// and strided transpose-add per chunk.
fn head_chunk(
    detached: &Model,
    h: &Tensor,
    (targets, temperature, reads): (&Tensor, f64, Reads),
    mut grad_of: impl FnMut(ChunkView) -> Result<ChunkGrads>,
) -> Result<HeadChunk> {
    let (b, c, d) = h.dims3()?;
    let n = b * c;
    let h2 = h.reshape((n, d))?;
    let weight = detached.head_weight();
    let dtype = h.dtype();
    let compute = compute_dtype(dtype);
    // The model's own head product (on the host one gemm into a buffer that is never zero-filled).
    let device = h.device();
    let (z, in_f32) = op_times::timed("head.logits", device, || chunk_logits(detached, &h2))?;
    if detached.scores_positions() {
        // A reward model: the `[n, 1]` scores are what the objective reads; their gradient is its.
        let scores = z.reshape((b, c))?;
        let view = ChunkView::Targets {
            logp: &scores,
            entropy: None,
        };
        let dz = grad_of(view)?.0.to_dtype(dtype)?.reshape((n, 1))?;
        return Ok(HeadChunk {
            logp: scores,
            entropy: None,
            grad_hidden: matmul::matmul(&dz, weight)?.reshape((b, c, d))?,
            grad_logits: dz,
        });
    }
    let idx = targets.reshape((n, 1))?.contiguous()?;
    // Before the softmax, which on the host writes its exponentials over `z`.
    let slope = detached.soft_cap_slope(&z)?;
    let z = tempered(z, temperature)?;
    // `dz` is linear in the objective's gradients: the temperature's `1/τ` scales those `[n]`
    // columns rather than the `[n, V]` gradient.
    let column = |g: Tensor| -> Result<Tensor> {
        let g = g.to_dtype(compute)?.reshape((n, 1))?;
        Ok(match temperature == 1.0 {
            true => g,
            false => g.affine(1.0 / temperature, 0.0)?,
        })
    };
    // Two passes per row in `z`'s buffer where the host's or the card's kernels run
    // (streambp_kernels::ops::head_softmax), with the entropies where the objective reads them;
    // elsewhere the same with tensor ops.
    // Timed with the objective's loss and gradient of the chunk, which `grad_of` computes.
    let (logp, entropy, mut dz) = op_times::timed("head.softmax", device, || {
        if reads == Reads::Logits {
            // The targets' log-probs and the entropies for the metrics; the loss of the logits.
            let (logp, entropy) = EntropyRows::of(&z, &idx)?.values()?;
            let (logp, entropy) = (logp.reshape((b, c))?, entropy.reshape((b, c))?);
            let vocab = z.dim(1)?;
            let (dz, _) = grad_of(ChunkView::Logits(&z.reshape((b, c, vocab))?))?;
            let dz = tempered(dz.to_dtype(compute)?.reshape((n, vocab))?, temperature)?;
            return Ok::<_, crate::EngineError>((logp, Some(entropy), dz));
        }
        if reads == Reads::TargetsAndEntropy {
            let rows = EntropyRows::of(&z, &idx)?;
            let (logp, entropy) = rows.values()?;
            let (logp, entropy) = (logp.reshape((b, c))?, entropy.reshape((b, c))?);
            let view = ChunkView::Targets {
                logp: &logp,
                entropy: Some(&entropy),
            };
            let (g, g_entropy) = grad_of(view)?;
            let g_entropy = g_entropy.ok_or_else(|| {
                crate::EngineError::MissingGradient("the entropy's gradient".into())
            })?;
            let dz = rows.logit_grad(&idx, &column(g)?, &column(g_entropy)?)?;
            return Ok::<_, crate::EngineError>((logp, Some(entropy), dz));
        }
        Ok(match head_softmax::log_softmax_rows(&z, &idx)? {
            Some(rows) => {
                let logp = rows.logp.reshape((b, c))?;
                let view = ChunkView::Targets {
                    logp: &logp,
                    entropy: None,
                };
                let g = column(grad_of(view)?.0)?.reshape(n)?;
                let dz = rows.logit_grad(&g, None)?;
                (logp, None, dz)
            }
            None => {
                let lse = z.log_sum_exp(D::Minus1)?;
                let logp =
                    (z.gather(&idx, D::Minus1)?.squeeze(D::Minus1)? - &lse)?.reshape((b, c))?;
                let view = ChunkView::Targets {
                    logp: &logp,
                    entropy: None,
                };
                let g = column(grad_of(view)?.0)?;
                let p = z.broadcast_sub(&lse.unsqueeze(D::Minus1)?)?.exp()?;
                let dz = p
                    .broadcast_mul(&g.neg()?)?
                    .scatter_add(&idx, &g, D::Minus1)?;
                (logp, None, dz)
            }
        })
    })?;
    if let Some(slope) = slope {
        dz = (dz * slope)?;
    }
    // The gradient of bf16 logits is bf16: rounded in place where the logits were f32 values of
    // bf16 (the products read those values as bf16), else cast.
    let grad_hidden = op_times::timed("head.hidden_gradient", device, || {
        Ok::<_, crate::EngineError>(if in_f32 {
            round_in_place(&dz, dtype)?;
            matmul::matmul_of_bf16_values(&dz, weight)?
        } else {
            dz = cast(&dz, dtype)?;
            matmul::matmul(&dz, weight)?
        })
    })?;
    Ok(HeadChunk {
        logp,
        entropy,
        grad_hidden: grad_hidden.reshape((b, c, d))?,
        grad_logits: dz,
    })
}
