//! Decoding with a KV cache: the model run one new token (or a prompt) at a time over the keys and
//! values of the positions before it, so each step costs one position's work. All rows share their
//! positions (one prompt, or prompts of one length), so no padding is needed.

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
