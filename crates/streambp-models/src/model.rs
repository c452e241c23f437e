//! The whole decoder: embedding → layers → final norm → LM head, over parameters that are candle
//! `Var`s named as in the Hugging Face checkpoint.
//!
//! The model's tensors are the `Var`s themselves, so running it records a graph. `detached()` gives a
//! view of the same storage that records nothing: the no-grad path, at no copy.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{DType, Device, Shape, Tensor, Var};

use crate::config::{Head, ModelConfig, EMBED_TOKENS, FINAL_NORM};
use crate::error::{ModelError, Result};
use crate::init::NormalRng;
use crate::layer::DecoderLayer;
use crate::layout::Layout;
use crate::linear::Linear;
use crate::lora::{kaiming_uniform, peft_key, LoraAdapter, LoraConfig, Matrix, Projection};
use crate::norm::RmsNorm;
use crate::rope::Rotary;
use crate::weights::MapWeights;

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
    /// Every weight under its checkpoint name (tied embeddings once): what a full model is saved as.
    weights: Vec<(String, Tensor)>,
    /// What is trained: every weight (full fine-tuning) or the adapters' matrices under PEFT's keys.
    params: Vec<(String, Var)>,
    roles: Roles,
    /// The LoRA settings when the model carries adapters; its weights are then constants.
    lora: Option<LoraConfig>,
}

/// Where each role's trainable parameters sit in `params`, so an engine can ask for "the head" or
/// "layer 3" without knowing any checkpoint name. A role without a trainable parameter (a LoRA
/// model's head, norms and embedding) is `None`.
#[derive(Debug, Clone)]
struct Roles {
    embedding: Option<usize>,
    final_norm: Option<usize>,
    /// The untied head; with tied embeddings the embedding serves.
    head: Option<usize>,
    layers: Vec<Range<usize>>,
}

impl Roles {
    /// The roles of a fully trainable model's parameters (checkpoint names, checkpoint order).
    fn of(params: &[(String, Var)], layers: usize, head: &str) -> Result<Self> {
        let find = |name: &str| params.iter().position(|(n, _)| n == name);
        let missing = |name: &str| ModelError::MissingTensor {
            name: name.into(),
            files: "the model's parameters".into(),
        };
        let embedding = find(EMBED_TOKENS).ok_or_else(|| missing(EMBED_TOKENS))?;
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
            embedding: Some(embedding),
            final_norm: Some(find(FINAL_NORM).ok_or_else(|| missing(FINAL_NORM))?),
            head: Some(find(head).ok_or_else(|| missing(head))?),
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
        let weights = params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
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
                    index: i,
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
                    round_to: None,
                }
            })
            .collect();
        let embed_tokens = get(EMBED_TOKENS);
        let lm_head = get(config.head_name());
        let roles = Roles::of(&params, config.num_layers(), config.head_name())?;
        Ok(Self {
            norm: norm(FINAL_NORM),
            config,
            embed_tokens,
            layers,
            lm_head,
            weights,
            params,
            roles,
            lora: None,
        })
    }

    /// Every trainable parameter: each weight under its HF name (tied embeddings once) for full
    /// fine-tuning, each adapter matrix under its PEFT key for LoRA.
    pub fn parameters(&self) -> &[(String, Var)] {
        &self.params
    }

    /// Every weight of the (base) model under its HF name, tied embeddings once: what a full
    /// checkpoint holds. For LoRA these are the frozen base weights, without the adapters.
    pub fn weights(&self) -> &[(String, Tensor)] {
        &self.weights
    }

    /// The LoRA settings, when the model carries adapters.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// The parameters of decoder layer `index`.
    pub fn layer_parameters(&self, index: usize) -> &[(String, Var)] {
        match self.roles.layers.get(index) {
            Some(range) => &self.params[range.clone()],
            None => &[],
        }
    }

    /// The token embedding table, when it is trained.
    pub fn embedding_parameter(&self) -> Option<&(String, Var)> {
        self.roles.embedding.map(|i| &self.params[i])
    }

    /// The LM head's weight when it is trained: its own, or the embedding table when they are tied.
    pub fn head_parameter(&self) -> Option<&(String, Var)> {
        self.roles.head.map(|i| &self.params[i])
    }

    /// The LM head's weight tensor `[vocab, hidden]` (the embedding table when tied), as this model
    /// holds it: recorded when the model is, not when it is `detached()`.
    pub fn head_weight(&self) -> &Tensor {
        &self.lm_head
    }

    /// The final norm's weight, when it is trained.
    pub fn final_norm_parameter(&self) -> Option<&(String, Var)> {
        self.roles.final_norm.map(|i| &self.params[i])
    }

    /// The trained parameters whose gradients are complete once the LM head's backward is done: the
    /// final norm, and the head unless it is the embedding table (which the embedding phase adds to).
    pub fn output_parameters(&self) -> impl Iterator<Item = &(String, Var)> {
        let untied_head = self.roles.head.filter(|&h| Some(h) != self.roles.embedding);
        [self.roles.final_norm, untied_head]
            .into_iter()
            .flatten()
            .map(|i| &self.params[i])
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
        let (ids, rows) = self.embed_vjp_rows(input_ids, grad)?;
        Ok(self.embed_tokens.zeros_like()?.index_add(&ids, &rows, 0)?)
    }

    /// [`Model::embed_vjp`] before its sum: the flat ids `[n]` and the rows `[n, d]` to add at them,
    /// for a caller that adds them into a gradient it already holds (no table-sized temporary).
    pub fn embed_vjp_rows(&self, input_ids: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
        let ids = input_ids.flatten_all()?;
        let mut rows = grad.reshape((ids.dim(0)?, self.config.hidden_size))?;
        if let Some(s) = self.embed_scale() {
            rows = rows.affine(s, 0.0)?;
        }
        if let Some(pad) = self.pad_positions(&ids, rows.shape())? {
            rows = pad.where_cond(&rows.zeros_like()?, &rows)?;
        }
        Ok((ids, rows))
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

    /// Logits `[.., vocab]` of final-normed hidden states, soft-capped where the config says so; a
    /// reward model's scores `[.., 1]` (never capped, as transformers' classifiers are not).
    pub fn logits(&self, normed: &Tensor) -> Result<Tensor> {
        // Under LoRA the LM head is a constant; a reward model's score head is trained.
        let head = Linear {
            frozen: self.lora.is_some() && !self.scores_positions(),
            ..Linear::new(self.lm_head.clone(), None)
        };
        let out = head.forward(normed)?;
        match self.config.head {
            Head::Lm => self.soft_cap(&out),
            Head::Score => Ok(out),
        }
    }

    /// [`Model::logits`] of bf16 rows `normed` (`[n, d]`) on the host, as f32 holding their bf16
    /// values ([`streambp_kernels::ops::matmul::linear_as_bf16_values`]): for the LM head's softmax, which
    /// runs in f32, without a bf16 copy and its widening. `None` where the config's head casts
    /// instead ([`ModelConfig::head_logits_as_bf16_values`]: a score head, a soft-capped one) and
    /// off the host.
    pub fn logits_as_bf16_values(&self, normed: &Tensor) -> Result<Option<Tensor>> {
        if !self.config.head_logits_as_bf16_values(self.dtype()) {
            return Ok(None);
        }
        Ok(streambp_kernels::ops::matmul::linear_as_bf16_values(
            normed,
            &self.lm_head,
        )?)
    }

    /// Whether the head yields one score per position (a reward model) rather than logits.
    pub fn scores_positions(&self) -> bool {
        self.config.head == Head::Score
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

    /// An independent copy of every weight, without adapters (a frozen reference model: optimizer
    /// updates of `self` write into its storage in place, so a `detached()` view would follow them).
    pub fn frozen_copy(&self) -> Result<Self> {
        let tensors = self
            .weights
            .iter()
            .map(|(n, t)| Ok((n.clone(), t.detach().copy()?)))
            .collect::<Result<HashMap<_, _>>>()?;
        Ok(Model::from_tensors(self.config.clone(), tensors)?.detached())
    }

    /// The highest useful LoRA rank on `targets`: the smallest dimension of a targeted projection
    /// (`B·A` of a higher rank has that projection's rank at most; it adds parameters, nothing else).
    /// `None` where no layer has a targeted projection.
    pub fn lora_rank_limit(&self, targets: &[Projection]) -> Option<usize> {
        self.layers
            .iter()
            .flat_map(|layer| targets.iter().map(|&p| layer.projection(p).weight.dims()))
            .filter_map(|dims| dims.iter().copied().min())
            .min()
    }

    /// The model with LoRA adapters on `config.targets` of every layer: the base weights become
    /// constants (no gradient, not even a discarded one), the adapters the only trainable parameters
    /// (in f32, or f64 for an f64 model, whatever the base's dtype). `adapters` gives their matrices
    /// under PEFT's keys (an adapter to continue); without it they start as PEFT's fresh ones (`A`
    /// kaiming-uniform from `seed`, `B` zero). Every given matrix must fit a target, and every target
    /// must be given.
    pub fn with_lora(
        self,
        config: LoraConfig,
        adapters: Option<HashMap<String, Tensor>>,
        seed: u64,
    ) -> Result<Self> {
        config.validate()?;
        let mut model = self.detached();
        let mut source = AdapterSource {
            given: adapters,
            rng: NormalRng::new(seed ^ 0x1_0ea),
            dtype: match model.dtype() {
                DType::F64 => DType::F64,
                _ => DType::F32,
            },
            device: model.device().clone(),
        };
        let mut params = Vec::new();
        let mut ranges = Vec::with_capacity(model.layers.len());
        for layer in &mut model.layers {
            let start = params.len();
            attach_adapters(layer, &config, &mut source, &mut params)?;
            ranges.push(start..params.len());
        }
        // A reward model's score head is trained in full beside the adapters (PEFT's
        // modules_to_save): the adapter's copy, or the base's to start, in the model's dtype.
        let mut head = None;
        if model.scores_positions() {
            let var = Var::from_tensor(&source.score(&model.lm_head)?)?;
            model.lm_head = var.as_tensor().clone();
            head = Some(params.len());
            params.push((crate::adapter::PEFT_SCORE_KEY.to_string(), var));
        }
        source.all_used(&config)?;
        model.weights = model
            .weights
            .iter()
            .map(|(n, t)| (n.clone(), t.detach()))
            .collect();
        model.params = params;
        model.roles = Roles {
            embedding: None,
            final_norm: None,
            head,
            layers: ranges,
        };
        model.lora = Some(config);
        Ok(model)
    }

    /// The base model, adapters off, recording nothing: a LoRA run's reference model (no second copy
    /// of the weights, as TRL's reference for PEFT models).
    pub fn without_adapters(&self) -> Self {
        let mut base = self.detached();
        for layer in &mut base.layers {
            for p in Projection::ALL {
                layer.projection_mut(p).lora = None;
            }
        }
        base
    }

    /// The weights with every adapter merged in (`W + s·B·A`, computed in f32 or f64 and stored in
    /// the base's dtype), under their HF names: a LoRA model as a plain checkpoint.
    pub fn merged_weights(&self) -> Result<Vec<(String, Tensor)>> {
        let mut merged: HashMap<String, Tensor> = HashMap::new();
        for layer in &self.layers {
            for p in Projection::ALL {
                let linear = layer.projection(p);
                if let Some(a) = &linear.lora {
                    let delta = (a.b.detach().matmul(&a.a.detach())? * a.scale)?;
                    let w = linear.weight.to_dtype(delta.dtype())?;
                    let name = format!("{}.weight", p.module_path(layer.index));
                    merged.insert(name, (w + delta)?.to_dtype(linear.weight.dtype())?);
                }
            }
        }
        // A reward model's trained score head replaces the base's.
        if self.lora.is_some() && self.scores_positions() {
            merged.insert(crate::config::SCORE.to_string(), self.lm_head.detach());
        }
        Ok(self
            .weights
            .iter()
            .map(|(n, t)| (n.clone(), merged.remove(n).unwrap_or_else(|| t.clone())))
            .collect())
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

/// Where [`Model::with_lora`]'s adapter matrices come from: the given adapter's tensors (taken out
/// as they are used), else PEFT's fresh ones (`A` kaiming-uniform from the seed, `B` zero).
struct AdapterSource {
    given: Option<HashMap<String, Tensor>>,
    rng: NormalRng,
    /// The adapters' dtype (f32, or f64 for an f64 model) and device.
    dtype: DType,
    device: Device,
}

impl AdapterSource {
    /// Matrix `m` of shape `shape` under PEFT's `key`: the given one (an error naming the key where
    /// it is missing or of another shape), else a fresh one.
    fn matrix(&mut self, key: String, m: Matrix, shape: (usize, usize)) -> Result<(String, Var)> {
        let t = match self.given.as_mut() {
            Some(tensors) => {
                let t = tensors
                    .remove(&key)
                    .ok_or_else(|| ModelError::MissingTensor {
                        name: key.clone(),
                        files: "the adapter".into(),
                    })?;
                if t.dims() != [shape.0, shape.1] {
                    return Err(ModelError::ShapeMismatch {
                        name: key,
                        path: "the adapter".into(),
                        expected: vec![shape.0, shape.1],
                        found: t.dims().to_vec(),
                    });
                }
                t.to_dtype(self.dtype)?.to_device(&self.device)?
            }
            None if m == Matrix::A => {
                kaiming_uniform(&mut self.rng, shape.0, shape.1, self.dtype, &self.device)?
            }
            None => Tensor::zeros(shape, self.dtype, &self.device)?,
        };
        Ok((key, Var::from_tensor(&t)?))
    }

    /// A score head's starting weight: the adapter's copy where it has one, else `base`'s, in
    /// `base`'s dtype (an error where the copy's shape differs).
    fn score(&mut self, base: &Tensor) -> Result<Tensor> {
        let key = crate::adapter::PEFT_SCORE_KEY;
        let given = self.given.as_mut().and_then(|t| t.remove(key));
        let start = given.unwrap_or_else(|| base.clone());
        let score = start.to_dtype(base.dtype())?.to_device(&self.device)?;
        if score.dims() != base.dims() {
            return Err(ModelError::ShapeMismatch {
                name: key.into(),
                path: "the adapter".into(),
                expected: base.dims().to_vec(),
                found: score.dims().to_vec(),
            });
        }
        Ok(score)
    }

    /// An error naming the first given tensor no target took, if any.
    fn all_used(self, config: &LoraConfig) -> Result<()> {
        match self.given.and_then(|t| t.into_keys().min()) {
            None => Ok(()),
            Some(left) => Err(ModelError::Input(format!(
                "the adapter's tensor {left:?} fits no LoRA target of this model (targets: {})",
                config
                    .targets
                    .iter()
                    .map(|p| p.name())
                    .collect::<Vec<_>>()
                    .join(" ")
            ))),
        }
    }
}

/// `layer`'s projections frozen and the targeted ones given adapters from `source`, their matrices
/// appended to `params` (`A` then `B` of each target, in [`Projection::ALL`]'s order).
fn attach_adapters(
    layer: &mut DecoderLayer,
    config: &LoraConfig,
    source: &mut AdapterSource,
    params: &mut Vec<(String, Var)>,
) -> Result<()> {
    let index = layer.index;
    for p in Projection::ALL {
        let linear = layer.projection_mut(p);
        linear.frozen = true;
        if !config.targets.contains(&p) {
            continue;
        }
        let (out, features) = linear.weight.dims2()?;
        let a = source.matrix(
            peft_key(index, p, Matrix::A),
            Matrix::A,
            (config.r, features),
        )?;
        let b = source.matrix(peft_key(index, p, Matrix::B), Matrix::B, (out, config.r))?;
        linear.lora = Some(LoraAdapter {
            a: a.1.as_tensor().clone(),
            b: b.1.as_tensor().clone(),
            scale: config.scale(),
            dropout: config.dropout,
            layer: index,
            projection: p,
            round_base_to: None,
        });
        params.extend([a, b]);
    }
    Ok(())
}
