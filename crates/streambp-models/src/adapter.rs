//! PEFT LoRA adapter directories, read and written as PEFT does (`peft/utils/save_and_load.py`,
//! `tuners/lora/config.py`): `adapter_config.json` (sorted keys, `peft_type: "LORA"`, `task_type:
//! "CAUSAL_LM"`, `r`, `lora_alpha`, `target_modules`, `use_rslora`, `lora_dropout`, `bias: "none"`,
//! `base_model_name_or_path`, …) and `adapter_model.safetensors` with the matrices under
//! `base_model.model.<module path>.lora_A.weight` / `.lora_B.weight` and metadata `{"format": "pt"}`.
//!
//! Reading accepts what PEFT writes for these models and refuses, naming the file and the field, what
//! this implementation does not compute the same way (DoRA, trained biases, per-module ranks or
//! alphas, `fan_in_fan_out`, extra trained modules, adapters on only some layers).

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use candle_core::{Device, Tensor};
use serde_json::{json, Value};

use crate::error::{ModelError, Result};
use crate::hub::ADAPTER_FILES;
use crate::lora::{LoraConfig, Projection};
use crate::model::Model;

/// The modules PEFT's `SEQ_CLS` task trains in full beside the adapters (`modules_to_save`).
const SCORE_MODULES: [&str; 2] = ["classifier", "score"];

/// A reward model's score head in a PEFT adapter (PEFT saves `modules_to_save` without the
/// adapter's name).
pub const PEFT_SCORE_KEY: &str = "base_model.model.score.weight";

/// An adapter read from disk: its settings and its matrices under PEFT's keys.
#[derive(Debug)]
pub struct Adapter {
    /// r, alpha, targets, rsLoRA and dropout, from `adapter_config.json`.
    pub config: LoraConfig,
    /// Every `lora_A` / `lora_B` matrix, as stored (f32 usually), and a reward model's trained score
    /// head under [`PEFT_SCORE_KEY`].
    pub tensors: HashMap<String, Tensor>,
    /// `base_model_name_or_path`, when the file names one.
    pub base_model: Option<String>,
}

fn config_error(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::Config {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Reads the PEFT LoRA adapter in `dir` onto `device`.
pub fn load_adapter(dir: &Path, device: &Device) -> Result<Adapter> {
    let config_path = dir.join(ADAPTER_FILES[0]);
    let text = std::fs::read_to_string(&config_path).map_err(|error| ModelError::Io {
        path: config_path.clone(),
        error,
    })?;
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| config_error(&config_path, format!("not valid JSON: {e}")))?;
    let weights_path = dir.join(ADAPTER_FILES[1]);
    let tensors = candle_core::safetensors::load(&weights_path, device).map_err(|e| {
        ModelError::BadSafetensors {
            path: weights_path.clone(),
            reason: e.to_string(),
        }
    })?;
    let (config, base_model) = parse_config(&value, &config_path)?;
    let targets = targets_of(&tensors, &weights_path)?;
    check_targets(&value, &targets, &config_path)?;
    Ok(Adapter {
        config: LoraConfig { targets, ..config },
        tensors,
        base_model,
    })
}

/// The settings of a parsed `adapter_config.json` (targets still empty: the tensors decide them).
fn parse_config(value: &Value, path: &Path) -> Result<(LoraConfig, Option<String>)> {
    let field = |k: &str| value.get(k).filter(|v| !v.is_null());
    match field("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        Some(other) => {
            return Err(config_error(
                path,
                format!("peft_type {other:?}: only LORA adapters are supported"),
            ))
        }
        None => {
            return Err(config_error(
                path,
                "no peft_type (not a PEFT adapter config)",
            ))
        }
    }
    // What PEFT can express but this implementation does not compute: refuse rather than differ.
    let unsupported = [
        ("use_dora", json!(true)),
        ("fan_in_fan_out", json!(true)),
        ("lora_bias", json!(true)),
    ];
    for (key, bad) in unsupported {
        if field(key) == Some(&bad) {
            return Err(config_error(path, format!("{key}: {bad} is not supported")));
        }
    }
    if let Some(bias) = field("bias").and_then(Value::as_str) {
        if bias != "none" {
            return Err(config_error(
                path,
                format!("bias {bias:?}: only \"none\" is supported (no trained biases)"),
            ));
        }
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if field(key)
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            return Err(config_error(
                path,
                format!("{key}: per-module ranks or alphas are not supported"),
            ));
        }
    }
    // A reward model's adapter trains its score head in full (PEFT's default for SEQ_CLS).
    let saved = field("modules_to_save")
        .and_then(Value::as_array)
        .into_iter()
        .flatten();
    if let Some(other) = saved
        .filter_map(Value::as_str)
        .find(|m| !SCORE_MODULES.contains(m))
    {
        return Err(config_error(
            path,
            format!("modules_to_save: {other:?} is not supported (only a reward model's score)"),
        ));
    }
    for key in ["layers_to_transform", "trainable_token_indices"] {
        if field(key).is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(config_error(path, format!("{key}: not supported")));
        }
    }
    let number = |key: &str, default: f64| -> Result<f64> {
        match field(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| config_error(path, format!("{key} must be a number"))),
        }
    };
    let r = number("r", 8.0)?;
    if r < 1.0 || r.fract() != 0.0 {
        return Err(config_error(
            path,
            format!("r = {r}: the rank must be a whole number of at least 1"),
        ));
    }
    let config = LoraConfig {
        r: r as usize,
        alpha: number("lora_alpha", 8.0)?,
        targets: Vec::new(),
        use_rslora: field("use_rslora")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        dropout: number("lora_dropout", 0.0)?,
    };
    config
        .validate()
        .map_err(|e| config_error(path, e.to_string()))?;
    let base = field("base_model_name_or_path")
        .and_then(Value::as_str)
        .map(String::from);
    Ok((config, base))
}

/// The projections the adapter's tensors cover, which must be the same in every layer that has any.
fn targets_of(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<Vec<Projection>> {
    let mut per_layer: HashMap<usize, BTreeSet<Projection>> = HashMap::new();
    for key in tensors.keys().filter(|k| *k != PEFT_SCORE_KEY) {
        let site = key
            .strip_prefix("base_model.model.model.layers.")
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(layer, rest)| {
                let layer: usize = layer.parse().ok()?;
                let module = rest
                    .strip_suffix(".lora_A.weight")
                    .or_else(|| rest.strip_suffix(".lora_B.weight"))?;
                let name = module.rsplit('.').next()?;
                Some((layer, Projection::parse(name)?))
            });
        match site {
            Some((layer, p)) => {
                per_layer.entry(layer).or_default().insert(p);
            }
            None => {
                return Err(ModelError::BadSafetensors {
                    path: path.to_path_buf(),
                    reason: format!(
                        "tensor {key:?} is not a LoRA matrix of a decoder layer's projection"
                    ),
                })
            }
        }
    }
    let mut sets = per_layer.values();
    let first = sets
        .next()
        .cloned()
        .ok_or_else(|| ModelError::BadSafetensors {
            path: path.to_path_buf(),
            reason: "holds no LoRA matrix".into(),
        })?;
    if sets.any(|s| *s != first) {
        return Err(ModelError::BadSafetensors {
            path: path.to_path_buf(),
            reason: "the layers carry adapters on different projections; not supported".into(),
        });
    }
    Ok(first.into_iter().collect())
}

/// Checks that `target_modules` (names, module paths, or `all-linear`) agrees with the tensors found.
fn check_targets(value: &Value, targets: &[Projection], path: &Path) -> Result<()> {
    let named: Vec<&str> = match value.get("target_modules") {
        Some(Value::Array(list)) => list.iter().filter_map(Value::as_str).collect(),
        // A regular expression or `all-linear`: the tensors say which modules it matched.
        _ => return Ok(()),
    };
    for p in targets {
        let listed = named
            .iter()
            .any(|n| *n == p.name() || n.ends_with(&format!(".{}", p.name())));
        if !listed {
            return Err(config_error(
                path,
                format!(
                    "the adapter has {} matrices, but target_modules does not name it",
                    p.name()
                ),
            ));
        }
    }
    Ok(())
}

/// Writes `model`'s adapters into `dir` as PEFT does (`dir` must exist; callers that need atomicity
/// write into a temporary directory and rename it). `base_model` is recorded as
/// `base_model_name_or_path`.
pub fn save_adapter(model: &Model, base_model: Option<&str>, dir: &Path) -> Result<()> {
    let config = model
        .lora()
        .ok_or_else(|| ModelError::Input("the model carries no LoRA adapter to save".into()))?;
    let alpha = match config.alpha.fract() == 0.0 {
        true => json!(config.alpha as i64),
        false => json!(config.alpha),
    };
    let targets: Vec<&str> = config.targets.iter().map(|p| p.name()).collect();
    // A reward model's score head is trained in full beside the adapters, as PEFT's SEQ_CLS does.
    let (saved, task) = match model.scores_positions() {
        true => (json!(SCORE_MODULES), "SEQ_CLS"),
        false => (Value::Null, "CAUSAL_LM"),
    };
    // serde_json's map is ordered by key: the file comes out sorted, as PEFT writes it.
    let file = json!({
        "alpha_pattern": {},
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "layers_pattern": null,
        "layers_to_transform": null,
        "lora_alpha": alpha,
        "lora_dropout": config.dropout,
        "modules_to_save": saved,
        "peft_type": "LORA",
        "r": config.r,
        "rank_pattern": {},
        "revision": null,
        "target_modules": targets,
        "task_type": task,
        "use_dora": false,
        "use_rslora": config.use_rslora,
    });
    let config_path = dir.join(ADAPTER_FILES[0]);
    let text = serde_json::to_string_pretty(&file)
        .map_err(|e| ModelError::Input(format!("adapter config: {e}")))?;
    std::fs::write(&config_path, text).map_err(|e| ModelError::Write {
        path: config_path.clone(),
        reason: e.to_string(),
    })?;
    let tensors: Vec<(String, Tensor)> = model
        .parameters()
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.as_tensor().detach().to_device(&Device::Cpu)?)))
        .collect::<Result<_>>()?;
    let weights_path = dir.join(ADAPTER_FILES[1]);
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(
        tensors.iter().map(|(k, t)| (k.as_str(), t)),
        Some(metadata),
        &weights_path,
    )
    .map_err(|e| ModelError::Write {
        path: weights_path,
        reason: e.to_string(),
    })
}
