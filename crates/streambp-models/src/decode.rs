//! Decoding with a KV cache: the model run one new token (or a prompt) at a time over the keys and
//! values of the positions before it, so each step costs one position's work. Rows decode in step:
//! prompts of different lengths are left-padded to one length ([`KvCache::left_padded`]), so every
//! row's new token sits at the same index and one forward serves them all.

use candle_core::{Tensor, D};

use crate::error::{ModelError, Result};
use crate::layer::KeyBlock;
use crate::layout::Layout;
use crate::model::Model;

/// Each layer's cached keys and values `[rows, kv_heads, t, head_dim]`, and the sequence's layout
/// (which keeps its rope tables across steps).
pub struct KvCache {
    keys: Vec<Option<Tensor>>,
    values: Vec<Option<Tensor>>,
    layout: Layout,
    /// Positions cached so far.
    len: usize,
}

impl KvCache {
    /// An empty cache for `model`.
    pub fn new(model: &Model) -> Self {
        Self {
            keys: vec![None; model.layers.len()],
            values: vec![None; model.layers.len()],
            layout: Layout::default(),
            len: 0,
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
        let mut cache = Self::new(model);
        cache.layout = layout;
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
            let k = match self.keys[i].take() {
                Some(prev) => Tensor::cat(&[&prev, &k], 2)?,
                None => k,
            };
            let v = match self.values[i].take() {
                Some(prev) => Tensor::cat(&[&prev, &v], 2)?,
                None => v,
            };
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
            self.keys[i] = Some(k);
            self.values[i] = Some(v);
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
    let mut cache = KvCache::new(&model);
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
