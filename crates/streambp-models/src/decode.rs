//! Decoding with a KV cache: the model run one new token (or a prompt) at a time over the keys and
//! values of the positions before it, so each step costs one position's work. Rows decode in step:
//! prompts of different lengths are left-padded to one length ([`KvCache::left_padded`]), so every
//! row's new token sits at the same index and one forward serves them all.

use candle_core::{Tensor, D};

use crate::error::{ModelError, Result};
use crate::layer::KeyBlock;
use crate::layout::Layout;
use crate::model::Model;

/// Each layer's cached keys and values, and the sequence's layout (which keeps its rope tables
/// across steps).
///
/// A layer's keys (and values) live in one buffer `[rows, kv_heads, capacity, head_dim]` that a step
/// writes its new positions into and the attention reads in place up to the positions cached:
/// growing the cache by concatenation would copy every cached position at every step, which at long
/// completions costs more than the step's own work.
pub struct KvCache {
    keys: Vec<Option<Tensor>>,
    values: Vec<Option<Tensor>>,
    layout: Layout,
    /// Positions cached so far.
    len: usize,
    /// Positions the buffers are made for when first allocated (the prompt and the tokens to come,
    /// where known); a buffer that fills up is reallocated at twice its size.
    capacity: usize,
}

impl KvCache {
    /// An empty cache for `model`.
    pub fn new(model: &Model) -> Self {
        Self {
            keys: vec![None; model.layers.len()],
            values: vec![None; model.layers.len()],
            layout: Layout::default(),
            len: 0,
            capacity: 0,
        }
    }

    /// An empty cache for `model` whose buffers hold `positions` before they grow.
    pub fn with_capacity(model: &Model, positions: usize) -> Self {
        Self {
            capacity: positions,
            ..Self::new(model)
        }
    }

    /// A cache for rows starting from `prompts` of different lengths, and the `[rows, longest]` ids
    /// to pass to the first [`step`](Self::step): each prompt is left-padded to the longest. The pads
    /// are laid out as a document of their own before the prompt (the packed-rows mechanism of
    /// [`Layout`]), so no prompt or new token reads them and rope counts each row's positions from its
    /// prompt's first token: each row computes what it would alone. Holds `max_new` tokens after the
    /// prompts (rope tables of padded rows are built once, for that length).
    pub fn left_padded(
        model: &Model,
        prompts: &[&[u32]],
        pad: u32,
        max_new: usize,
    ) -> Result<(Self, Tensor)> {
        let longest = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
        if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
            return Err(ModelError::Input(
                "decoding needs at least one prompt, each of at least one token".into(),
            ));
        }
        let width = longest + max_new;
        let mut ids = Vec::with_capacity(prompts.len() * longest);
        let mut positions = Vec::with_capacity(prompts.len() * width);
        for p in prompts {
            let pads = longest - p.len();
            ids.extend(std::iter::repeat_n(pad, pads).chain(p.iter().copied()));
            positions.extend((0..pads as i64).chain(0..(width - pads) as i64));
        }
        let device = model.device();
        let ids = Tensor::from_vec(ids, (prompts.len(), longest), device)?;
        let positions = Tensor::from_vec(positions, (prompts.len(), width), device)?;
        let layout = Layout::new(None, Some(&positions))?.with_seq_len(width);
        let cache = Self {
            layout,
            ..Self::with_capacity(model, width)
        };
        Ok((cache, ids))
    }

    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Runs `ids` (`[rows, n]` u32, the positions after those cached) through `model`, extending the
    /// cache, and returns the logits of the last position (`[rows, vocab]`).
    pub fn step(&mut self, model: &Model, ids: &Tensor) -> Result<Tensor> {
        let start = self.len;
        let mut h = model.embed(ids)?;
        let layout = self.layout.clone();
        for (i, layer) in model.layers.iter().enumerate() {
            let normed = layer.norm_input(&h)?;
            let (k, v) = layer.keys_values(&normed, start, &layout)?;
            let k = append(&mut self.keys[i], &k, start, self.capacity)?;
            let v = append(&mut self.values[i], &v, start, self.capacity)?;
            let q = layer.queries(&normed, start, &layout)?;
            let k0 = layer.first_visible_key(start, &layout);
            let len = k.dim(2)? - k0;
            let block = KeyBlock {
                q_start: start,
                k_start: k0,
                layout: &layout,
                earlier: None,
            };
            let attn = layer.attend(&q, &k.narrow(2, k0, len)?, &v.narrow(2, k0, len)?, block)?;
            h = layer.after_attention(&h, &attn, start, &layout)?;
        }
        let n = h.dim(1)?;
        self.len += n;
        let last = model.final_norm(&h.narrow(1, n - 1, 1)?)?;
        Ok(model.logits(&last)?.squeeze(1)?)
    }
}

/// Writes `new` (`[rows, kv_heads, n, head_dim]`) after the `cached` positions of `buffer` and
/// returns the positions filled so far, a view of the buffer. A missing or full buffer is
/// (re)allocated for at least `capacity` positions and at least twice what it held, so a cache grown
/// one token at a time copies each position a bounded number of times.
fn append(
    buffer: &mut Option<Tensor>,
    new: &Tensor,
    cached: usize,
    capacity: usize,
) -> Result<Tensor> {
    let new = new.contiguous()?;
    let (rows, heads, n, head_dim) = new.dims4()?;
    let filled = cached + n;
    let buffer = match buffer.take() {
        Some(b) if b.dim(2)? >= filled => buffer.insert(b),
        old => {
            let held = old.as_ref().map_or(Ok(0), |b| b.dim(2))?;
            let size = filled.max(capacity).max(2 * held);
            let grown = Tensor::zeros((rows, heads, size, head_dim), new.dtype(), new.device())?;
            if let Some(old) = old {
                grown.slice_set(&old, 2, 0)?;
            }
            buffer.insert(grown)
        }
    };
    buffer.slice_set(&new, 2, cached)?;
    Ok(buffer.narrow(2, 0, filled)?)
}

/// Greedy continuation of `prompt` until `eos` or `max_new` tokens (`eos` excluded), with a KV cache.
pub fn greedy(model: &Model, prompt: &[u32], eos: u32, max_new: usize) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(ModelError::Input(
            "greedy decoding needs a prompt of at least one token".into(),
        ));
    }
    let model = model.detached();
    let mut cache = KvCache::with_capacity(&model, prompt.len() + max_new);
    let ids = Tensor::new(prompt, model.device())?.unsqueeze(0)?;
    let mut logits = cache.step(&model, &ids)?;
    let mut out = Vec::new();
    for _ in 0..max_new {
        let next = logits.squeeze(0)?.argmax(D::Minus1)?.to_scalar::<u32>()?;
        if next == eos {
            break;
        }
        out.push(next);
        let ids = Tensor::new(&[next], model.device())?.unsqueeze(0)?;
        logits = cache.step(&model, &ids)?;
    }
    Ok(out)
}
