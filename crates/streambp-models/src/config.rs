//! One `ModelConfig` for all four families, read from a Hugging Face `config.json`.
//!
//! The families differ in a handful of switches (biases, q/k norms, norm style, sandwich norms, embedding
//! scale, attention scale, sliding windows, rope per layer). Keeping them as data rather than as four model
//! implementations means the streamed engine drives one set of blocks.
//!
//! Configs come in two styles: older checkpoints carry `rope_theta` / `rope_scaling` /
//! `rope_local_base_freq` / `sliding_window_pattern`, newer transformers writes `rope_parameters` (per layer
//! type for Gemma3) and `layer_types`. Both are read.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::error::{ModelError, Result};

/// The model families this crate implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Qwen2 and Qwen2.5 (`model_type` `qwen2`).
    Qwen2,
    /// Qwen3 (`qwen3`).
    Qwen3,
    /// Llama, Llama-3.x included (`llama`).
    Llama,
    /// Gemma3's text model (`gemma3_text`, or the text part of a multimodal `gemma3`).
    Gemma3,
}

/// What a family fixes that its `config.json` does not say (or only says by default): one row per
/// family, read wherever a family difference matters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FamilyTraits {
    /// q, k and v carry a bias whatever `attention_bias` says, and the output projection none (Qwen2).
    pub qkv_bias_always: bool,
    /// Per-head RMSNorm on q and k before rope.
    pub qk_norm: bool,
    /// Norms after attention and around the MLP (Gemma's `pre/post_feedforward_layernorm`).
    pub sandwich_norms: bool,
    /// How the family's RMSNorms apply their weight.
    pub norm_style: NormStyle,
    /// Embeddings multiplied by `sqrt(hidden_size)`.
    pub scaled_embeddings: bool,
    /// The MLP activation when the config names none.
    pub default_activation: &'static str,
    /// `rope_theta` when the config gives none.
    pub default_rope_theta: f64,
    /// The rotary base of sliding-window layers, when they have their own (Gemma3's local rope).
    pub local_rope_theta: Option<f64>,
    /// `tie_word_embeddings` when the config does not say.
    pub ties_embeddings: bool,
    /// The attention scale is `query_pre_attn_scalar^-½` (required) instead of `head_dim^-½`.
    pub query_pre_attn_scalar: bool,
    /// Which layers use a sliding window when the config has no `layer_types`.
    pub sliding_layers: SlidingLayers,
}

/// Where a family's legacy configs put sliding-window layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlidingLayers {
    /// None.
    Never,
    /// Every layer but each `sliding_window_pattern`-th (default given) is sliding (Gemma3).
    AllButEveryNth {
        /// The pattern when the config has no `sliding_window_pattern`.
        default_pattern: usize,
    },
    /// With `use_sliding_window`, the layers from `max_window_layers` on (Qwen2/Qwen3).
    FromMaxWindowLayers,
}

impl Family {
    /// The family's row of the traits table.
    pub fn traits(self) -> FamilyTraits {
        let llama_like = FamilyTraits {
            qkv_bias_always: false,
            qk_norm: false,
            sandwich_norms: false,
            norm_style: NormStyle::CastThenScale,
            scaled_embeddings: false,
            default_activation: "silu",
            default_rope_theta: 10_000.0,
            local_rope_theta: None,
            ties_embeddings: false,
            query_pre_attn_scalar: false,
            sliding_layers: SlidingLayers::Never,
        };
        match self {
            Family::Llama => llama_like,
            Family::Qwen2 => FamilyTraits {
                qkv_bias_always: true,
                sliding_layers: SlidingLayers::FromMaxWindowLayers,
                ..llama_like
            },
            Family::Qwen3 => FamilyTraits {
                qk_norm: true,
                sliding_layers: SlidingLayers::FromMaxWindowLayers,
                ..llama_like
            },
            Family::Gemma3 => FamilyTraits {
                qkv_bias_always: false,
                qk_norm: true,
                sandwich_norms: true,
                norm_style: NormStyle::OnePlusWeightInF32,
                scaled_embeddings: true,
                default_activation: "gelu_pytorch_tanh",
                default_rope_theta: 1_000_000.0,
                local_rope_theta: Some(10_000.0),
                ties_embeddings: true,
                query_pre_attn_scalar: true,
                sliding_layers: SlidingLayers::AllButEveryNth { default_pattern: 6 },
            },
        }
    }
}

pub use streambp_kernels::ops::rms_norm::NormStyle;

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (`silu`, `swish`): Llama and Qwen.
    Silu,
    /// `gelu_pytorch_tanh`: the tanh approximation.
    GeluTanh,
    /// Exact (erf) GELU.
    Gelu,
}

/// How rotary inverse frequencies are rescaled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// The plain `theta^(-2i/head_dim)` frequencies.
    None,
    /// Every frequency divided by `factor` (`rope_type` `linear`).
    Linear {
        /// The divisor of every frequency.
        factor: f64,
    },
    /// Llama 3.1's scaling (`rope_type` `llama3`): low frequencies divided by `factor`, high ones kept,
    /// those between interpolated, as transformers computes it.
    Llama3 {
        /// The divisor of the low frequencies.
        factor: f64,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length the model was pre-trained at, in tokens.
        original_max_position_embeddings: f64,
    },
}

/// Rotary embedding parameters of one kind of layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// The rotary base (`rope_theta`).
    pub theta: f64,
    /// How the frequencies are rescaled for long contexts.
    pub scaling: RopeScaling,
}

/// What differs from layer to layer: the attention span and which rotary table it uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerKind {
    /// `Some(w)`: query `i` sees keys `j` with `i - w < j <= i`.
    pub sliding_window: Option<usize>,
    /// The rotary table of the layer (Gemma3's sliding layers have their own base).
    pub rope: RopeConfig,
}

/// Everything the blocks need to know about a model, family differences included.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Which family's checkpoint this is (from `model_type`).
    pub family: Family,
    /// Rows of the embedding table and of the LM head (`V`).
    pub vocab_size: usize,
    /// Width of the residual stream (`d`).
    pub hidden_size: usize,
    /// Width of the MLP's gate and up projections.
    pub intermediate_size: usize,
    /// Query heads per layer.
    pub num_heads: usize,
    /// Key/value heads per layer (fewer than `num_heads` with grouped-query attention).
    pub num_kv_heads: usize,
    /// Width of one head (`hidden_size / num_heads` when the config gives none).
    pub head_dim: usize,
    /// The epsilon of every RMSNorm (1e-6 when the config gives none).
    pub rms_norm_eps: f64,
    /// The LM head is the embedding table (no `lm_head.weight` in the checkpoint).
    pub tie_word_embeddings: bool,
    /// Bias on the q, k, v projections.
    pub qkv_bias: bool,
    /// Bias on the attention output projection.
    pub o_bias: bool,
    /// Bias on the MLP's three projections.
    pub mlp_bias: bool,
    /// The MLP's gate activation.
    pub activation: Activation,
    /// How every RMSNorm applies its weight.
    pub norm_style: NormStyle,
    /// Per-head RMSNorm on q and k before rope (Qwen3, Gemma3).
    pub qk_norm: bool,
    /// Gemma's extra norms after attention and around the MLP.
    pub sandwich_norms: bool,
    /// Multiply the embeddings by this (Gemma: sqrt(hidden_size)).
    pub embed_scale: Option<f64>,
    /// Multiplies q·k (head_dim^-½, or Gemma's query_pre_attn_scalar^-½). Gemma3 configs carry an
    /// `attn_logit_softcapping`, but transformers' Gemma3 attention never applies it, so neither do we.
    pub attn_scale: f64,
    /// `Some(cap)`: logits become `cap·tanh(logits / cap)` (Gemma's `final_logit_softcapping`).
    pub final_logit_softcap: Option<f64>,
    /// The longest context the model was trained for, in tokens (`usize::MAX` when the config gives
    /// none); the trainer warns above it, nothing here enforces it.
    pub max_position_embeddings: usize,
    /// transformers builds the embedding with `padding_idx = pad_token_id`: that row gets no gradient
    /// from the lookup (it still gets one through a tied LM head).
    pub pad_token_id: Option<u32>,
    /// One entry per decoder layer, in order: its attention span and rotary table.
    pub layers: Vec<LayerKind>,
    /// What the final norm's output feeds: the LM head, or a reward model's score.
    pub head: Head,
}

/// The head on top of the final norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    /// `*ForCausalLM`: logits over the vocabulary (`lm_head.weight`, or the tied embedding table).
    Lm,
    /// `*ForSequenceClassification` with one label (a reward model): one score per position
    /// (`score.weight`, `[1, hidden]`, never tied), read at each row's last token by the objective.
    Score,
}

/// The token embedding table's name in a checkpoint.
pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
/// The final norm's weight.
pub const FINAL_NORM: &str = "model.norm.weight";
/// The untied LM head.
pub const LM_HEAD: &str = "lm_head.weight";
/// A sequence-classification (reward) model's score head.
pub const SCORE: &str = "score.weight";

/// The names (under `model.layers.{i}.`, before `.weight`) of a layer's norms after its attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerNormNames {
    /// Gemma: the norm of the attention output before the residual.
    pub post_attention: Option<&'static str>,
    /// The norm in front of the MLP.
    pub pre_mlp: &'static str,
    /// Gemma: the norm of the MLP output before the residual.
    pub post_mlp: Option<&'static str>,
}

impl LayerNormNames {
    /// The names in the order checkpoints list them.
    pub fn in_checkpoint_order(self) -> impl Iterator<Item = &'static str> {
        self.post_attention
            .into_iter()
            .chain([self.pre_mlp])
            .chain(self.post_mlp)
    }
}

/// The raw fields of a config.json that matter to us; everything optional, validated afterwards.
#[derive(Debug, Deserialize, Default)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    rope_local_base_freq: Option<f64>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
    sliding_window_pattern: Option<usize>,
    #[serde(rename = "_sliding_window_pattern")]
    sliding_window_pattern_private: Option<usize>,
    query_pre_attn_scalar: Option<f64>,
    final_logit_softcapping: Option<f64>,
    max_position_embeddings: Option<usize>,
    pad_token_id: Option<i64>,
    text_config: Option<Value>,
    architectures: Option<Vec<String>>,
    num_labels: Option<usize>,
    id2label: Option<serde_json::Map<String, Value>>,
}

impl ModelConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|error| ModelError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        Self::from_json_str(&text, path)
    }

    /// Parses a config.json text; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| ModelError::Config {
            path: path.to_path_buf(),
            reason: format!("not valid JSON: {e}"),
        })?;
        Self::from_json(&value, path)
    }

    /// Builds the config from a parsed config.json.
    pub fn from_json(value: &Value, path: &Path) -> Result<Self> {
        let err = |reason: String| ModelError::Config {
            path: path.to_path_buf(),
            reason,
        };
        let raw: RawConfig =
            serde_json::from_value(value.clone()).map_err(|e| err(format!("{e}")))?;
        let model_type = raw
            .model_type
            .clone()
            .ok_or_else(|| err("no model_type".into()))?;
        let family = match model_type.as_str() {
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "llama" => Family::Llama,
            "gemma3_text" => Family::Gemma3,
            "gemma3" => {
                // The multimodal wrapper: its text model is what we train.
                let text = raw
                    .text_config
                    .as_ref()
                    .ok_or_else(|| err("model_type gemma3 without text_config".into()))?;
                let mut text = text.clone();
                if let Some(obj) = text.as_object_mut() {
                    obj.insert("model_type".into(), Value::String("gemma3_text".into()));
                }
                return Self::from_json(&text, path);
            }
            _ => {
                return Err(ModelError::UnknownModelType {
                    path: path.to_path_buf(),
                    model_type,
                })
            }
        };
        build(family, raw, path)
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Query heads sharing one key/value head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// The names of a layer's norms after its attention: the one in front of the MLP, and the
    /// sandwich norms where the family has them. Derived here once, for the shapes and the model.
    pub fn layer_norm_names(&self) -> LayerNormNames {
        match self.sandwich_norms {
            true => LayerNormNames {
                post_attention: Some("post_attention_layernorm"),
                pre_mlp: "pre_feedforward_layernorm",
                post_mlp: Some("post_feedforward_layernorm"),
            },
            false => LayerNormNames {
                post_attention: None,
                pre_mlp: "post_attention_layernorm",
                post_mlp: None,
            },
        }
    }

    /// HF names and shapes of every parameter, in checkpoint order. With tied embeddings there is no
    /// `lm_head.weight`.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (d, f, hd) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let (q, kv) = (self.num_heads * hd, self.num_kv_heads * hd);
        let mut out = vec![(EMBED_TOKENS.to_string(), vec![self.vocab_size, d])];
        for i in 0..self.num_layers() {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            out.push((p("input_layernorm.weight"), vec![d]));
            for (name, rows, bias) in [
                ("q_proj", q, self.qkv_bias),
                ("k_proj", kv, self.qkv_bias),
                ("v_proj", kv, self.qkv_bias),
            ] {
                out.push((p(&format!("self_attn.{name}.weight")), vec![rows, d]));
                if bias {
                    out.push((p(&format!("self_attn.{name}.bias")), vec![rows]));
                }
            }
            out.push((p("self_attn.o_proj.weight"), vec![d, q]));
            if self.o_bias {
                out.push((p("self_attn.o_proj.bias"), vec![d]));
            }
            if self.qk_norm {
                out.push((p("self_attn.q_norm.weight"), vec![hd]));
                out.push((p("self_attn.k_norm.weight"), vec![hd]));
            }
            for norm in self.layer_norm_names().in_checkpoint_order() {
                out.push((p(&format!("{norm}.weight")), vec![d]));
            }
            for (name, shape) in [
                ("gate_proj", vec![f, d]),
                ("up_proj", vec![f, d]),
                ("down_proj", vec![d, f]),
            ] {
                let rows = shape[0];
                out.push((p(&format!("mlp.{name}.weight")), shape));
                if self.mlp_bias {
                    out.push((p(&format!("mlp.{name}.bias")), vec![rows]));
                }
            }
        }
        out.push((FINAL_NORM.to_string(), vec![d]));
        match self.head {
            Head::Score => out.push((SCORE.to_string(), vec![1, d])),
            Head::Lm if !self.tie_word_embeddings => {
                out.push((LM_HEAD.to_string(), vec![self.vocab_size, d]))
            }
            Head::Lm => {}
        }
        out
    }

    /// Whether the head of a model in `dtype` carries its logits on the host as f32 holding bf16
    /// values ([`crate::Model::logits_as_bf16_values`]) rather than casting them: a bf16 LM head
    /// without a soft-cap (whose ops round in bf16). The planner counts the cast's copy elsewhere.
    pub fn head_logits_as_bf16_values(&self, dtype: candle_core::DType) -> bool {
        dtype == candle_core::DType::BF16
            && self.head == Head::Lm
            && self.final_logit_softcap.is_none()
    }

    /// The checkpoint name of the head's weight (the embedding table's under tied embeddings).
    pub fn head_name(&self) -> &'static str {
        match (self.head, self.tie_word_embeddings) {
            (Head::Score, _) => SCORE,
            (Head::Lm, true) => EMBED_TOKENS,
            (Head::Lm, false) => LM_HEAD,
        }
    }

    /// transformers' class name of this model with this head (`Qwen3ForCausalLM`,
    /// `LlamaForSequenceClassification`, ...), as a saved config.json's `architectures` says.
    pub fn architecture(&self) -> String {
        let base = match self.family {
            Family::Qwen2 => "Qwen2",
            Family::Qwen3 => "Qwen3",
            Family::Llama => "Llama",
            Family::Gemma3 => "Gemma3Text",
        };
        let head = match (self.head, self.family) {
            (Head::Lm, Family::Gemma3) => return "Gemma3ForCausalLM".into(),
            (Head::Lm, _) => "ForCausalLM",
            (Head::Score, _) => "ForSequenceClassification",
        };
        format!("{base}{head}")
    }
}

fn build(family: Family, raw: RawConfig, path: &Path) -> Result<ModelConfig> {
    let path: PathBuf = path.to_path_buf();
    let err = |reason: String| ModelError::Config {
        path: path.clone(),
        reason,
    };
    let need = |v: Option<usize>, name: &str| v.ok_or_else(|| err(format!("missing {name}")));
    let hidden_size = need(raw.hidden_size, "hidden_size")?;
    let num_heads = need(raw.num_attention_heads, "num_attention_heads")?;
    let num_layers = need(raw.num_hidden_layers, "num_hidden_layers")?;
    let num_kv_heads = raw.num_key_value_heads.unwrap_or(num_heads);
    let head_dim = match raw.head_dim {
        Some(h) => h,
        None if num_heads > 0 && hidden_size % num_heads == 0 => hidden_size / num_heads,
        None => {
            return Err(err(
                "no head_dim and hidden_size is not a multiple of heads".into(),
            ))
        }
    };
    if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(err(format!(
            "num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )));
    }
    if head_dim % 2 != 0 {
        return Err(err(format!("head_dim {head_dim} must be even for rope")));
    }
    let traits = family.traits();
    let activation_name = raw
        .hidden_activation
        .clone()
        .or(raw.hidden_act.clone())
        .unwrap_or_else(|| traits.default_activation.into());
    let activation = match activation_name.as_str() {
        "silu" | "swish" => Activation::Silu,
        "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Activation::GeluTanh,
        "gelu" => Activation::Gelu,
        other => return Err(err(format!("unsupported activation {other:?}"))),
    };

    let (global_rope, local_rope) = rope_configs(traits, &raw).map_err(&err)?;
    let layer_types = layer_types(traits, &raw, num_layers).map_err(&err)?;
    let window = raw.sliding_window;
    let layers = layer_types
        .iter()
        .map(|t| match t.as_str() {
            "full_attention" => Ok(LayerKind {
                sliding_window: None,
                rope: global_rope,
            }),
            "sliding_attention" => Ok(LayerKind {
                sliding_window: Some(
                    window.ok_or_else(|| err("sliding layers but no sliding_window".into()))?,
                ),
                rope: local_rope.unwrap_or(global_rope),
            }),
            other => Err(err(format!("unsupported layer type {other:?}"))),
        })
        .collect::<Result<Vec<_>>>()?;

    let attention_bias = raw.attention_bias.unwrap_or(false);
    let attn_scale = match (traits.query_pre_attn_scalar, raw.query_pre_attn_scalar) {
        (true, Some(s)) => s.powf(-0.5),
        (true, None) => return Err(err("no query_pre_attn_scalar (its attention scale)".into())),
        _ => (head_dim as f64).powf(-0.5),
    };
    let vocab_size = need(raw.vocab_size, "vocab_size")?;
    Ok(ModelConfig {
        family,
        vocab_size,
        hidden_size,
        intermediate_size: need(raw.intermediate_size, "intermediate_size")?,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
        tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(traits.ties_embeddings),
        qkv_bias: traits.qkv_bias_always || attention_bias,
        o_bias: !traits.qkv_bias_always && attention_bias,
        mlp_bias: raw.mlp_bias.unwrap_or(false),
        activation,
        norm_style: traits.norm_style,
        qk_norm: traits.qk_norm,
        sandwich_norms: traits.sandwich_norms,
        embed_scale: traits
            .scaled_embeddings
            .then(|| (hidden_size as f64).sqrt()),
        attn_scale,
        final_logit_softcap: raw.final_logit_softcapping,
        max_position_embeddings: raw.max_position_embeddings.unwrap_or(usize::MAX),
        pad_token_id: raw
            .pad_token_id
            .and_then(|p| u32::try_from(p).ok())
            .filter(|&p| (p as usize) < vocab_size),
        layers,
        head: head_of(&raw).map_err(err)?,
    })
}

/// The head `architectures` names: a sequence classifier must have one label (a reward model);
/// transformers' default for a classifier that does not say is two.
fn head_of(raw: &RawConfig) -> std::result::Result<Head, String> {
    // Heads other than a causal LM's and a sequence classifier's (token classification, question
    // answering, masked LM): loading one as a causal LM would throw its head away.
    let known = |a: &str| {
        !a.contains("For")
            || [
                "ForCausalLM",
                "ForConditionalGeneration",
                "ForSequenceClassification",
            ]
            .iter()
            .any(|head| a.ends_with(head))
    };
    if let Some(other) = raw.architectures.iter().flatten().find(|a| !known(a)) {
        return Err(format!(
            "architecture {other}: streambp trains causal LMs (*ForCausalLM) and reward models \
             (*ForSequenceClassification with one label), not this head"
        ));
    }
    let classifies = raw
        .architectures
        .iter()
        .flatten()
        .any(|a| a.ends_with("ForSequenceClassification"));
    if !classifies {
        return Ok(Head::Lm);
    }
    let labels = raw
        .num_labels
        .or(raw.id2label.as_ref().map(|m| m.len()))
        .unwrap_or(2);
    match labels {
        1 => Ok(Head::Score),
        n => Err(format!(
            "a sequence classifier with {n} labels: streambp trains reward models, which have one \
             (num_labels 1)"
        )),
    }
}

/// The per-layer attention types, from `layer_types` or the legacy fields.
fn layer_types(
    traits: FamilyTraits,
    raw: &RawConfig,
    num_layers: usize,
) -> std::result::Result<Vec<String>, String> {
    if let Some(types) = &raw.layer_types {
        if types.len() != num_layers {
            return Err(format!(
                "layer_types has {} entries for {num_layers} layers",
                types.len()
            ));
        }
        return Ok(types.clone());
    }
    let sliding = |i: usize| match traits.sliding_layers {
        SlidingLayers::Never => false,
        SlidingLayers::AllButEveryNth { default_pattern } => {
            let pattern = raw
                .sliding_window_pattern
                .or(raw.sliding_window_pattern_private)
                .unwrap_or(default_pattern);
            !(i + 1).is_multiple_of(pattern.max(1))
        }
        SlidingLayers::FromMaxWindowLayers => {
            raw.use_sliding_window == Some(true) && i >= raw.max_window_layers.unwrap_or(num_layers)
        }
    };
    Ok((0..num_layers)
        .map(|i| match sliding(i) {
            true => "sliding_attention".to_string(),
            false => "full_attention".to_string(),
        })
        .collect())
}

/// The rotary configs of full-attention layers and of sliding layers where they have their own.
fn rope_configs(
    traits: FamilyTraits,
    raw: &RawConfig,
) -> std::result::Result<(RopeConfig, Option<RopeConfig>), String> {
    let default_theta = traits.default_rope_theta;
    let plain = |theta: f64| RopeConfig {
        theta,
        scaling: RopeScaling::None,
    };
    if let Some(params) = &raw.rope_parameters {
        // New style: either one dict, or one per layer type (Gemma3).
        if let Some(full) = params.get("full_attention") {
            let global = parse_rope(full, default_theta)?;
            let local = match params.get("sliding_attention") {
                Some(p) => Some(parse_rope(p, traits.local_rope_theta.unwrap_or(10_000.0))?),
                None => None,
            };
            return Ok((global, local));
        }
        let global = parse_rope(params, raw.rope_theta.unwrap_or(default_theta))?;
        let local = raw
            .rope_local_base_freq
            .or(traits.local_rope_theta)
            .map(plain);
        return Ok((global, local));
    }
    let theta = raw.rope_theta.unwrap_or(default_theta);
    let scaling = match &raw.rope_scaling {
        None | Some(Value::Null) => RopeScaling::None,
        Some(v) => parse_scaling(v)?,
    };
    let local = traits
        .local_rope_theta
        .map(|theta| plain(raw.rope_local_base_freq.unwrap_or(theta)));
    Ok((RopeConfig { theta, scaling }, local))
}

fn parse_rope(v: &Value, default_theta: f64) -> std::result::Result<RopeConfig, String> {
    let theta = v
        .get("rope_theta")
        .and_then(Value::as_f64)
        .unwrap_or(default_theta);
    Ok(RopeConfig {
        theta,
        scaling: parse_scaling(v)?,
    })
}

fn parse_scaling(v: &Value) -> std::result::Result<RopeScaling, String> {
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |key: &str| {
        v.get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("rope scaling {kind:?} without {key}"))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: num("factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        }),
        other => Err(format!(
            "unsupported rope scaling type {other:?} (supported: default, linear, llama3)"
        )),
    }
}
