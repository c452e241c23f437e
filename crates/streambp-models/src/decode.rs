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
/// A layer's keys (and values) live in one buffer `[rows, kv_heads, room, head_dim]` that a step
/// writes its new positions into and the attention reads in place: growing the cache by
/// concatenation would copy every cached position at every step, which at long completions costs
/// more than the step's own work. Keys no query to come can see (before a sliding window, or
/// before the documents the rows are in) are dropped when a buffer fills, so a sliding-window
/// layer (most of Gemma3's) holds about twice its window, not the whole sequence.
pub struct KvCache {
    layers: Vec<LayerCache>,
    layout: Layout,
    /// Positions cached so far.
    len: usize,
    /// Positions the buffers are made for when first allocated (the prompt and the tokens to come,
    /// where known; at most twice the window of a sliding-window layer).
    capacity: usize,
}

/// One layer's buffers of keys and values, holding sequence positions from `first` on.
#[derive(Clone, Default)]
struct LayerCache {
    keys: Option<Tensor>,
    values: Option<Tensor>,
    /// The sequence position at index 0 of the buffers.
    first: usize,
}

impl LayerCache {
    /// Positions the buffers have room for.
    fn room(&self) -> Result<usize> {
        Ok(self.keys.as_ref().map_or(Ok(0), |k| k.dim(2))?)
    }

    /// Writes keys `k` and values `v` (`[rows, kv_heads, n, head_dim]`) of positions
    /// `cached..cached + n` and returns those of positions `visible..cached + n`, views of the
    /// buffers. Buffers without room for them are reallocated, keeping positions `visible..` only,
    /// for at least `capacity` positions and room for as many more as they keep: a cache grown one
    /// token at a time copies each position a bounded number of times.
    fn append(
        &mut self,
        (k, v): (&Tensor, &Tensor),
        (cached, visible): (usize, usize),
        capacity: usize,
    ) -> Result<(Tensor, Tensor)> {
        let n = k.dim(2)?;
        let end = cached + n;
        let full = self.keys.is_none() || end - self.first > self.room()?;
        let moved = full.then(|| {
            let kept = cached - visible;
            let size = capacity.max(2 * kept + n);
            (visible - self.first..cached - self.first, size)
        });
        if moved.is_some() {
            self.first = visible;
        }
        let at = cached - self.first;
        let keys = write(&mut self.keys, k, at, moved.clone())?;
        let values = write(&mut self.values, v, at, moved)?;
        let (from, len) = (visible - self.first, end - visible);
        Ok((keys.narrow(2, from, len)?, values.narrow(2, from, len)?))
    }
}

/// Writes `new` (`[rows, kv_heads, n, head_dim]`) at index `at` of `buffer` and returns the buffer.
/// With `moved` (`(kept, size)`), or where there is no buffer yet, a fresh one of `size` positions
/// takes its place first, holding the old one's positions `kept` from index 0.
fn write(
    buffer: &mut Option<Tensor>,
    new: &Tensor,
    at: usize,
    moved: Option<(std::ops::Range<usize>, usize)>,
) -> Result<Tensor> {
    let new = new.contiguous()?;
    let b = match (buffer.take(), moved) {
        (Some(b), None) => b,
        (old, moved) => {
            let (kept, size) = moved.unwrap_or((0..0, at + new.dim(2)?));
            let (rows, heads, _, head_dim) = new.dims4()?;
            let fresh = Tensor::zeros((rows, heads, size, head_dim), new.dtype(), new.device())?;
            if let Some(old) = old.filter(|_| !kept.is_empty()) {
                // slice_set takes a contiguous source: the kept positions are strided in `old`.
                let kept = old.narrow(2, kept.start, kept.len())?.contiguous()?;
                fresh.slice_set(&kept, 2, 0)?;
            }
            fresh
        }
    };
    b.slice_set(&new, 2, at)?;
    *buffer = Some(b.clone());
    Ok(b)
}

impl KvCache {
    /// An empty cache for `model`.
    pub fn new(model: &Model) -> Self {
        Self {
            layers: vec![LayerCache::default(); model.layers.len()],
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

    /// Positions each layer's buffers have room for.
    pub fn room(&self) -> Result<Vec<usize>> {
        self.layers.iter().map(LayerCache::room).collect()
    }

    /// Bytes the buffers hold, every layer's keys and values.
    pub fn bytes(&self) -> usize {
        let layers = self.layers.iter();
        let buffers = layers.flat_map(|l| [&l.keys, &l.values]).flatten();
        buffers
            .map(|b| b.elem_count() * b.dtype().size_in_bytes())
            .sum()
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
            let k0 = layer.first_visible_key(start, &layout);
            let capacity = match layer.kind.sliding_window {
                Some(window) => self.capacity.min(2 * window),
                None => self.capacity,
            };
            let (k, v) = self.layers[i].append((&k, &v), (start, k0), capacity)?;
            let q = layer.queries(&normed, start, &layout)?;
            let block = KeyBlock {
                q_start: start,
                k_start: k0,
                layout: &layout,
                earlier: None,
            };
            let attn = layer.attend(&q, &k, &v, block)?;
            h = layer.after_attention(&h, &attn, start, &layout)?;
        }
        let n = h.dim(1)?;
        self.len += n;
        let last = model.final_norm(&h.narrow(1, n - 1, 1)?)?;
        Ok(model.logits(&last)?.squeeze(1)?)
    }
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
