//! The whole decoder: embedding → layers → final norm → LM head, over parameters that are candle
//! `Var`s named as in the Hugging Face checkpoint.
//!
//! The model's tensors are the `Var`s themselves, so running it records a graph. `detached()` gives a
//! view of the same storage that records nothing: the no-grad path, at no copy.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{DType, Device, Shape, Tensor, Var};

use crate::config::{ModelConfig, EMBED_TOKENS, FINAL_NORM, LM_HEAD};
use crate::error::{ModelError, Result};
use crate::layer::DecoderLayer;
use crate::layout::Layout;
use crate::linear::Linear;
use crate::norm::RmsNorm;
use crate::rope::Rotary;

/// A decoder-only language model of one of the supported families.
#[derive(Debug, Clone)]
pub struct Model {
    /// The architecture the weights were built for.
    pub config: ModelConfig,
    /// `[vocab, hidden]`: the token embedding table.
    pub embed_tokens: Tensor,
    /// The decoder layers, first to last.
    pub layers: Vec<DecoderLayer>,
    /// The final norm, in front of the LM head.
    pub norm: RmsNorm,
    /// `[vocab, hidden]`; the embedding itself when the embeddings are tied.
    pub lm_head: Tensor,
    params: Vec<(String, Var)>,
    roles: Roles,
}

/// Where each role's parameters sit in `params` (which is in checkpoint order), so an engine can ask
/// for "the head" or "layer 3" without knowing any checkpoint name.
#[derive(Debug, Clone)]
struct Roles {
    embedding: usize,
    final_norm: usize,
    /// The untied head; with tied embeddings the embedding serves.
    head: usize,
    layers: Vec<Range<usize>>,
}

impl Roles {
    fn of(params: &[(String, Var)], layers: usize) -> Result<Self> {
        let find = |name: &str| {
            params
                .iter()
                .position(|(n, _)| n == name)
                .ok_or_else(|| ModelError::MissingTensor {
                    name: name.into(),
                    files: "the model's parameters".into(),
                })
        };
        let embedding = find(EMBED_TOKENS)?;
        let layers = (0..layers)
            .map(|i| {
                let prefix = format!("model.layers.{i}.");
                let inside = |k: &usize| params[*k].0.starts_with(&prefix);
                match (0..params.len()).find(inside) {
                    Some(start) => {
                        start
                            ..(start..params.len())
                                .find(|k| !inside(k))
                                .unwrap_or(params.len())
                    }
                    None => 0..0,
                }
            })
            .collect();
        Ok(Self {
            embedding,
            final_norm: find(FINAL_NORM)?,
            head: find(LM_HEAD).unwrap_or(embedding),
            layers,
        })
    }
}

impl Model {
    /// Builds the model from tensors named as in the HF checkpoint, already in the wanted dtype and on
    /// the wanted device. Every name of `config.parameter_shapes()` must be present with its shape.
    pub fn from_tensors(config: ModelConfig, mut tensors: HashMap<String, Tensor>) -> Result<Self> {
        let mut params = Vec::new();
        for (name, shape) in config.parameter_shapes() {
            let t = tensors
                .remove(&name)
                .ok_or_else(|| ModelError::MissingTensor {
                    name: name.clone(),
                    files: "the given tensors".into(),
                })?;
            if t.dims() != shape.as_slice() {
                return Err(ModelError::ShapeMismatch {
                    name,
                    path: "<memory>".into(),
                    expected: shape,
                    found: t.dims().to_vec(),
                });
            }
            params.push((name, Var::from_tensor(&t)?));
        }
        let by_name: HashMap<&str, Tensor> = params
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_tensor().clone()))
            .collect();
        let get = |name: &str| -> Tensor { by_name[name].clone() };
        let has = |name: &str| by_name.contains_key(name);
        let eps = config.rms_norm_eps;
        let style = config.norm_style;
        let norm = |name: &str| RmsNorm::new(get(name), eps, style);
        let linear = |p: &str| {
            let bias = format!("{p}.bias");
            Linear::new(get(&format!("{p}.weight")), has(&bias).then(|| get(&bias)))
        };
        let shape = DecoderLayer::attention_shape(&config);
        let layers = config
            .layers
            .iter()
            .enumerate()
            .map(|(i, kind)| {
                let p = |s: &str| format!("model.layers.{i}.{s}");
                let norms = config.layer_norm_names();
                let layer_norm = |name: &str| norm(&p(&format!("{name}.weight")));
                DecoderLayer {
                    kind: *kind,
                    shape,
                    activation: config.activation,
                    rotary: Rotary::new(&kind.rope, config.head_dim),
                    input_norm: norm(&p("input_layernorm.weight")),
                    q_proj: linear(&p("self_attn.q_proj")),
                    k_proj: linear(&p("self_attn.k_proj")),
                    v_proj: linear(&p("self_attn.v_proj")),
                    o_proj: linear(&p("self_attn.o_proj")),
                    q_norm: config.qk_norm.then(|| norm(&p("self_attn.q_norm.weight"))),
                    k_norm: config.qk_norm.then(|| norm(&p("self_attn.k_norm.weight"))),
                    post_attn_norm: norms.post_attention.map(layer_norm),
                    pre_mlp_norm: layer_norm(norms.pre_mlp),
                    post_mlp_norm: norms.post_mlp.map(layer_norm),
                    gate_proj: linear(&p("mlp.gate_proj")),
                    up_proj: linear(&p("mlp.up_proj")),
                    down_proj: linear(&p("mlp.down_proj")),
                }
            })
            .collect();
        let embed_tokens = get(EMBED_TOKENS);
        let lm_head = if config.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            get(LM_HEAD)
        };
        let roles = Roles::of(&params, config.num_layers())?;
        Ok(Self {
            norm: norm(FINAL_NORM),
            config,
            embed_tokens,
            layers,
            lm_head,
            params,
            roles,
        })
    }

    /// Every trainable parameter under its HF name (tied embeddings appear once).
    pub fn parameters(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The parameters of decoder layer `index`.
    pub fn layer_parameters(&self, index: usize) -> &[(String, Var)] {
        match self.roles.layers.get(index) {
            Some(range) => &self.params[range.clone()],
            None => &[],
        }
    }

    /// The token embedding table.
    pub fn embedding_parameter(&self) -> &(String, Var) {
        &self.params[self.roles.embedding]
    }

    /// The LM head's weight: its own, or the embedding table when they are tied.
    pub fn head_parameter(&self) -> &(String, Var) {
        &self.params[self.roles.head]
    }

    /// The LM head's weight tensor `[vocab, hidden]` (the embedding table when tied), as this model
    /// holds it: recorded when the model is, not when it is `detached()`.
    pub fn head_weight(&self) -> &Tensor {
        &self.lm_head
    }

    /// Whether the LM head is the embedding table (its gradient then also gets the embedding's).
    pub fn head_is_embedding(&self) -> bool {
        self.roles.head == self.roles.embedding
    }

    /// The final norm's weight.
    pub fn final_norm_parameter(&self) -> &(String, Var) {
        &self.params[self.roles.final_norm]
    }

    /// The parameters whose gradients are complete once the LM head's backward is done: the final
    /// norm, and the head unless it is the embedding table.
    pub fn output_parameters(&self) -> impl Iterator<Item = &(String, Var)> {
        let head = (!self.head_is_embedding()).then(|| self.head_parameter());
        std::iter::once(self.final_norm_parameter()).chain(head)
    }

    /// The dtype of the parameters (and of the activations).
    pub fn dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }

    /// The device the parameters live on.
    pub fn device(&self) -> &Device {
        self.embed_tokens.device()
    }

    /// Token embeddings `[b, t, d]` of `input_ids` `[b, t]` (u32), scaled for Gemma.
    pub fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        let vocab = self.config.vocab_size;
        let ids = input_ids.flatten_all()?;
        let max = ids.max(0)?.to_scalar::<u32>()? as usize;
        if max >= vocab {
            return Err(ModelError::Input(format!(
                "token id {max} is out of the vocabulary (size {vocab})"
            )));
        }
        let mut rows = self.embed_tokens.index_select(&ids, 0)?;
        // transformers' `padding_idx`: the pad token's row gets no gradient from the lookup.
        if let Some(pad) = self.pad_positions(&ids, rows.shape())? {
            rows = pad.where_cond(&rows.detach(), &rows)?;
        }
        let h = rows.reshape((b, t, self.config.hidden_size))?;
        match self.embed_scale() {
            Some(s) => Ok(h.affine(s, 0.0)?),
            None => Ok(h),
        }
    }

    /// The VJP of [`Model::embed`] for the table: each position's gradient (`grad`, `[b, t, d]`),
    /// scaled like the forward, added into its token's row, none into the pad token's row. Written
    /// out, it holds no graph of `[b, t, d]` tensors.
    pub fn embed_vjp(&self, input_ids: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let ids = input_ids.flatten_all()?;
        let mut rows = grad.reshape((ids.dim(0)?, self.config.hidden_size))?;
        if let Some(s) = self.embed_scale() {
            rows = rows.affine(s, 0.0)?;
        }
        if let Some(pad) = self.pad_positions(&ids, rows.shape())? {
            rows = pad.where_cond(&rows.zeros_like()?, &rows)?;
        }
        Ok(self.embed_tokens.zeros_like()?.index_add(&ids, &rows, 0)?)
    }

    /// Gemma's embedding scale as the model applies it: transformers keeps it as an f32 buffer cast
    /// to the model dtype (f64 models get it exact).
    fn embed_scale(&self) -> Option<f64> {
        self.config.embed_scale.map(|s| match self.dtype() {
            DType::F64 => s,
            _ => (s as f32) as f64,
        })
    }

    /// u8 of `rows_shape` (`[n, d]`), 1 on the rows whose flat id is the config's `pad_token_id`;
    /// `None` when no id is.
    fn pad_positions(&self, flat_ids: &Tensor, rows_shape: &Shape) -> Result<Option<Tensor>> {
        let Some(pad) = self.config.pad_token_id else {
            return Ok(None);
        };
        let is_pad = flat_ids.eq(pad as f64)?;
        if is_pad.max(0)?.to_scalar::<u8>()? == 0 {
            return Ok(None);
        }
        Ok(Some(is_pad.unsqueeze(1)?.broadcast_as(rows_shape)?))
    }

    /// The final norm of the last layer's output.
    pub fn final_norm(&self, h: &Tensor) -> Result<Tensor> {
        self.norm.forward(h)
    }

    /// Logits `[.., vocab]` of final-normed hidden states, soft-capped where the config says so.
    pub fn logits(&self, normed: &Tensor) -> Result<Tensor> {
        self.soft_cap(&Linear::new(self.lm_head.clone(), None).forward(normed)?)
    }

    /// The final soft-cap of raw logits `l` where the config has one (Gemma): `cap·tanh(l / cap)`.
    pub fn soft_cap(&self, logits: &Tensor) -> Result<Tensor> {
        Ok(match self.config.final_logit_softcap {
            Some(cap) => ((logits / cap)?.tanh()? * cap)?,
            None => logits.clone(),
        })
    }

    /// The soft-cap's derivative at the capped logits `z`, `1 − (z / cap)²`; `None` without a cap
    /// (the derivative is 1). For a backward written out by hand.
    pub fn soft_cap_slope(&self, capped: &Tensor) -> Result<Option<Tensor>> {
        self.config
            .final_logit_softcap
            .map(|cap| Ok((1.0 - (capped / cap)?.sqr()?)?))
            .transpose()
    }

    /// Final-normed hidden states `[b, t, d]`. `attention_mask` is `[b, t]` (any integer dtype,
    /// 1 = real token; rows right-padded).
    pub fn hidden_states(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let layout = Layout::new(attention_mask, None)?.with_seq_len(input_ids.dim(1)?);
        let mut h = self.embed(input_ids)?;
        for layer in &self.layers {
            h = layer.forward(&h, &layout)?;
        }
        self.final_norm(&h)
    }

    /// Logits `[b, t, vocab]` over the whole sequence (records a graph unless `detached()`).
    pub fn forward(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        self.logits(&self.hidden_states(input_ids, attention_mask)?)
    }

    /// An independent copy of every parameter (a frozen reference model: optimizer updates of `self`
    /// write into its storage in place, so a `detached()` view would follow them).
    pub fn frozen_copy(&self) -> Result<Self> {
        let tensors = self
            .params
            .iter()
            .map(|(n, v)| Ok((n.clone(), v.as_tensor().detach().copy()?)))
            .collect::<Result<HashMap<_, _>>>()?;
        Ok(Model::from_tensors(self.config.clone(), tensors)?.detached())
    }

    /// The same model sharing the same storage, with nothing recorded for autograd.
    pub fn detached(&self) -> Self {
        Self {
            embed_tokens: self.embed_tokens.detach(),
            layers: self.layers.iter().map(DecoderLayer::detached).collect(),
            norm: self.norm.detached(),
            lm_head: self.lm_head.detach(),
            ..self.clone()
        }
    }
}
