//! The engine's per-layer phases: a layer's forward over query chunks without a graph (phase 1),
//! its backward streamed over query chunks or whole under checkpointing (phase 3), and the
//! embedding's (phase 4).

use std::ops::Range;

use candle_core::{DType, Tensor, Var};
use streambp_kernels::op_times;
use streambp_kernels::ops::attention::EarlierKeys;
use streambp_kernels::ops::cast::{cast, widened_values};
use streambp_models::{DecoderLayer, KeyBlock, Layout, MapWeights, Model};

use crate::error::Result;
use crate::seed::seed;

use super::grad_sink::GradSink;
use super::required;
use super::sequence::{Chunk, Shard};

/// `layer` as the host computes it ([`DecoderLayer::computed_in_f32`]: a half-precision layer on the
/// CPU in f32), and `params` as the variables its gradients land on.
fn computed(
    layer: &DecoderLayer,
    params: &[(String, Var)],
) -> Result<(DecoderLayer, Vec<(String, Var)>)> {
    Ok(match layer.computed_in_f32()? {
        Some(wide) => {
            let params = wide.parameters(params);
            (wide.layer, params)
        }
        None => (layer.clone(), params.to_vec()),
    })
}

/// Positions `range` of a layer input `x` (`[b, T, d]`, a checkpoint in the model's dtype) in the
/// dtype the layer computes in: a half-precision model's on the host widened, exactly, to f32
/// (`cast` hands a tensor already in `dtype` back as it is).
fn chunk_input(x: &Tensor, range: Range<usize>, dtype: DType) -> Result<Tensor> {
    Ok(cast(&x.narrow(1, range.start, range.len())?, dtype)?)
}

/// [`chunk_input`] as a variable, to differentiate a chunk's graph by.
fn chunk_variable(x: &Tensor, range: Range<usize>, dtype: DType) -> Result<Var> {
    let part = x.narrow(1, range.start, range.len())?;
    if part.dtype() == dtype {
        return Ok(Var::from_tensor(&part)?);
    }
    // Widened straight into the variable's own buffer (`Var::from_tensor` would copy it again).
    Ok(Var::from_vec(
        widened_values(&part)?,
        part.shape(),
        part.device(),
    )?)
}

/// Keys and values `[batch, kv_heads, T, head_dim]` of a layer input, computed chunk by chunk into
/// one buffer each (no list of parts to concatenate), in the dtype `layer` computes in (f32 for half
/// precision on the host, [`computed`]: the keys' gradients, summed over every later chunk, then
/// never round on the way).
/// `x` holds the `shard`'s positions; the other shards' keys and values are gathered from their ranks.
fn keys_values_streamed(
    layer: &DecoderLayer,
    x: &Tensor,
    layout: &Layout,
    chunk: usize,
    shard: &Shard,
) -> Result<(Tensor, Tensor)> {
    let (b, t, _) = x.dims3()?;
    let shape = (b, layer.shape.num_kv_heads, t, layer.shape.head_dim);
    let keys = Tensor::zeros(shape, layer.dtype(), x.device())?;
    let values = keys.zeros_like()?;
    op_times::timed("layer.keys_values", x.device(), || {
        for c in shard.chunks(chunk) {
            let normed = layer.norm_input(&chunk_input(x, c.local.clone(), layer.dtype())?)?;
            let (k, v) = layer.keys_values(&normed, c.start, layout)?;
            keys.slice_set(&k, 2, c.local.start)?;
            values.slice_set(&v, 2, c.local.start)?;
        }
        Ok::<_, crate::EngineError>(())
    })?;
    Ok((shard.gather(&keys, 2)?, shard.gather(&values, 2)?))
}

/// One layer's output over query chunks (no graph when `layer` is detached): attention memory is
/// `chunk × T` per head instead of `T × T`. `x` holds the `shard`'s positions, and so does the output.
pub(super) fn layer_forward_streamed(
    layer: &DecoderLayer,
    x: &Tensor,
    layout: &Layout,
    chunk: usize,
    shard: &Shard,
) -> Result<Tensor> {
    let (layer, _) = computed(layer, &[])?;
    let layer = &layer;
    let (keys, values) = keys_values_streamed(layer, x, layout, chunk, shard)?;
    let out = x.zeros_like()?;
    for c in shard.chunks(chunk) {
        let (s, e) = (c.start, c.global().end);
        let k0 = layer.first_visible_key(s, layout);
        let block = KeyBlock {
            q_start: s,
            k_start: k0,
            layout,
            earlier: None,
        };
        op_times::timed("layer.forward_chunk", x.device(), || {
            let y = layer.forward_chunk(
                &chunk_input(x, c.local.clone(), layer.dtype())?,
                &keys.narrow(2, k0, e - k0)?,
                &values.narrow(2, k0, e - k0)?,
                block,
            )?;
            Ok::<_, crate::EngineError>(out.slice_set(&cast(&y, x.dtype())?, 1, c.local.start)?)
        })?;
    }
    Ok(out)
}

/// Phase 3 (StreamBP): one layer's backward streamed over query chunks. `x` is the layer's input
/// (checkpoint), `grad_out` the gradient of its output; returns the gradient of its input. All three
/// hold the `shard`'s positions (chunks never cross from one of its spans to the next).
///
/// Query chunks are visited last first. Keys and values of the whole sequence are recomputed once
/// without a graph; when chunk `[s, e)` is reached, every later chunk has already pushed its gradient
/// into keys/values `[s, e)`, so that gradient is final. One graph per chunk then covers: the chunk's
/// queries against keys `[k0, e)` (earlier keys as detached leaves whose gradients are accumulated, the
/// chunk's own keys/values recomputed from `x_c` in the graph), the rest of the layer, and the pending
/// key/value gradient of `[s, e)` through the chunk's own k/v projections. Its backward yields the
/// chunk's input gradient complete. Queries never score keys they cannot see (future, outside the window).
///
/// On a split sequence other ranks' queries push gradients into this rank's keys and values too:
/// after its own chunks, each rank sends what it pushed into other ranks' keys to their owners (a
/// reduce-scatter), and backpropagates what it received through its chunks' k/v projections.
pub(super) fn layer_backward_streamed(
    (model, index): (&Model, usize),
    x: &Tensor,
    grad_out: &Tensor,
    (layout, shard): (&Layout, &Shard),
    chunk: usize,
    sink: &mut GradSink,
) -> Result<Tensor> {
    let (layer, params) = computed(&model.layers[index], model.layer_parameters(index))?;
    let dtype = layer.dtype();
    let chunks = shard.chunks(chunk);
    let (keys, values) = keys_values_streamed(&layer.detached(), x, layout, chunk, shard)?;
    // The gradients of the layer's keys and values, filled from the last chunk backwards. Two writers:
    // each chunk's graph pushes its queries' gradient into the keys/values of *earlier* chunks through
    // the attention op's backward, which adds it in place into these buffers
    // (`streambp_kernels::ops::attention`: `EarlierKeys::grad_keys` / `grad_values`, its `add_at`); a
    // chunk's *own* keys/values get theirs from its graph, and the buffers' `[s, e)` part, complete by
    // then, is fed into that graph by the surrogate below.
    let grad_keys = keys.zeros_like()?;
    let grad_values = values.zeros_like()?;
    let grad_in = x.zeros_like()?;
    // The projections' weight gradients go straight into the sink's accumulators: no chunk makes a
    // weight-sized buffer.
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

    for c in chunks.iter().rev() {
        let (s, len) = (c.start, c.local.len());
        let k0 = layer.first_visible_key(s, layout);
        // The chunk's part of the layer again, with a graph.
        let (x_c, surrogate) = op_times::timed("layer.chunk_recompute", x.device(), || {
            let x_c = chunk_variable(x, c.local.clone(), dtype)?;
            let normed = layer.norm_input(x_c.as_tensor())?;
            let (k_own, v_own) = layer.keys_values(&normed, s, layout)?;
            let q = layer.queries(&normed, s, layout)?;
            // Keys before the chunk are constants of its graph; the attention op adds their
            // gradients straight into `grad_keys` / `grad_values`.
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
            // The pending gradients of the chunk's own keys and values, complete now.
            let own = |grads: &Tensor| grads.narrow(2, s, len);
            let surrogate = (seed(&y, &chunk_input(grad_out, c.local.clone(), dtype)?)?
                + seed(&k_own, &own(&grad_keys)?)?
                + seed(&v_own, &own(&grad_values)?)?)?;
            Ok::<_, crate::EngineError>((x_c, surrogate))
        })?;
        let store = op_times::timed("layer.chunk_backward", x.device(), || surrogate.backward())?;
        op_times::timed("layer.chunk_gradients", x.device(), || {
            let grad_x = required(&store, x_c.as_tensor(), "layer input")?;
            grad_in.slice_set(&cast(&grad_x, grad_in.dtype())?, 1, c.local.start)?;
            sink.absorb(&store, params.iter())
        })?;
    }
    if shard.is_split() {
        // This rank's own part was fed in above; what is left are the gradients of other ranks' keys
        // and values, which their ranks receive, as this rank receives theirs.
        // The whole rows' buffers go as soon as they are used: the exchange's copies take their place.
        drop((keys, values));
        shard.zero_own(&grad_keys, 2)?;
        shard.zero_own(&grad_values, 2)?;
        let from_keys = shard.reduce_scatter(&grad_keys, 2)?;
        drop(grad_keys);
        let from_values = shard.reduce_scatter(&grad_values, 2)?;
        drop(grad_values);
        let from_others = (from_keys, from_values);
        keys_values_backward(
            (layer, &params),
            x,
            from_others,
            (layout, &chunks),
            sink,
            &grad_in,
        )?;
    }
    Ok(grad_in)
}

/// The gradients `grad_keys` / `grad_values` (`[b, kv_heads, len, head_dim]`, this rank's positions)
/// of a layer's keys and values backpropagated through its input norm and k/v projections chunk by
/// chunk, the input's share added into `grad_in` and the parameters' into `sink`.
fn keys_values_backward(
    (layer, params): (&DecoderLayer, &[(String, Var)]),
    x: &Tensor,
    (grad_keys, grad_values): (Tensor, Tensor),
    (layout, chunks): (&Layout, &[Chunk]),
    sink: &mut GradSink,
    grad_in: &Tensor,
) -> Result<()> {
    for c in chunks {
        let r = &c.local;
        let x_c = chunk_variable(x, r.clone(), layer.dtype())?;
        let normed = layer.norm_input(x_c.as_tensor())?;
        let (k, v) = layer.keys_values(&normed, c.start, layout)?;
        let part = |g: &Tensor| g.narrow(2, r.start, r.len());
        let surrogate = (seed(&k, &part(&grad_keys)?)? + seed(&v, &part(&grad_values)?)?)?;
        let store = surrogate.backward()?;
        // Summed in the layer's dtype (f32 for half precision on the host), rounded once.
        let earlier = cast(&grad_in.narrow(1, r.start, r.len())?, layer.dtype())?;
        let grad_x = required(&store, x_c.as_tensor(), "layer input")?;
        let added = cast(&(earlier + grad_x)?, grad_in.dtype())?;
        grad_in.slice_set(&added, 1, r.start)?;
        sink.absorb(&store, params.iter())?;
    }
    Ok(())
}

/// Phase 3 (checkpoint): the layer recomputed over the whole sequence with a graph and backpropagated.
pub(super) fn layer_backward_whole(
    (model, index): (&Model, usize),
    x: &Tensor,
    grad_out: &Tensor,
    layout: &Layout,
    sink: &mut GradSink,
) -> Result<Tensor> {
    let (layer, params) = computed(&model.layers[index], model.layer_parameters(index))?;
    let whole = 0..x.dim(1)?;
    let x_var = chunk_variable(x, whole.clone(), layer.dtype())?;
    let surrogate = op_times::timed("layer.whole_recompute", x.device(), || {
        let y = layer.forward(x_var.as_tensor(), layout)?;
        seed(&y, &chunk_input(grad_out, whole, layer.dtype())?)
    })?;
    let store = op_times::timed("layer.whole_backward", x.device(), || surrogate.backward())?;
    let grad_in = required(&store, x_var.as_tensor(), "layer input")?;
    sink.absorb(&store, params.iter())?;
    Ok(cast(&grad_in, x.dtype())?)
}

/// Phase 4: the gradient of the embedding table from the gradient of the first layer's input, by the
/// lookup's written-out VJP ([`Model::embed_vjp_rows`]) rather than a graph that would hold several
/// `[b, T, d]` copies; its rows are added into the table's accumulator in place where that can be
/// (tied to the head, the accumulator already holds the head's share: no second table-sized buffer).
pub(super) fn embedding_backward(
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
