//! Resolving `--model` to a local directory: an existing directory as it is, otherwise a Hugging Face
//! hub id, taken from the local hub cache when it is there (always, with `HF_HUB_OFFLINE=1`) and
//! downloaded through `hf-hub` when it is not.

use std::path::{Path, PathBuf};

use hf_hub::{api::sync::ApiBuilder, Cache};

use crate::error::{ModelError, Result};

/// Files a training run wants besides the weights; absent ones are fine.
const OPTIONAL_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
];

/// What a repository is resolved for, and so which files it must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wanted {
    /// A model: `config.json` and its weights (one file or the shards an index lists).
    Model,
    /// A PEFT adapter: `adapter_config.json` and `adapter_model.safetensors`.
    Adapter,
}

impl Wanted {
    fn flag(self) -> &'static str {
        match self {
            Wanted::Model => "--model",
            Wanted::Adapter => "--adapter",
        }
    }
}

/// The files of a PEFT adapter directory.
pub const ADAPTER_FILES: [&str; 2] = ["adapter_config.json", "adapter_model.safetensors"];

/// A local model directory for `spec`: a path, or a hub id such as `Qwen/Qwen3-0.6B`.
pub fn resolve_model_dir(spec: &str) -> Result<PathBuf> {
    resolve(spec, Wanted::Model)
}

/// A local PEFT adapter directory for `spec`: a path, or a hub id of an adapter repository.
pub fn resolve_adapter_dir(spec: &str) -> Result<PathBuf> {
    resolve(spec, Wanted::Adapter)
}

/// Refuses a PEFT adapter directory given as a model, and a model directory given as an adapter,
/// saying which flag takes it (a missing `config.json` or `adapter_config.json` says neither).
fn check_kind(dir: &Path, spec: &str, wanted: Wanted) -> Result<()> {
    let has = |name: &str| dir.join(name).is_file();
    match wanted {
        Wanted::Model if has(ADAPTER_FILES[0]) && !has("config.json") => {
            let base = std::fs::read_to_string(dir.join(ADAPTER_FILES[0]))
                .ok()
                .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
                .and_then(|c| c["base_model_name_or_path"].as_str().map(String::from))
                .map(|base| format!(" (its base: {base})"))
                .unwrap_or_default();
            Err(ModelError::Hub(format!(
                "{spec} holds a PEFT adapter, not a model: give it as --adapter {spec}, with its \
                 base model as --model{base}"
            )))
        }
        Wanted::Adapter if has("config.json") && !has(ADAPTER_FILES[0]) => {
            Err(ModelError::Hub(format!(
                "{spec} holds a model, not a PEFT adapter (no {}): give it as --model",
                ADAPTER_FILES[0]
            )))
        }
        _ => Ok(()),
    }
}

fn resolve(spec: &str, wanted: Wanted) -> Result<PathBuf> {
    if spec.is_empty() {
        return Err(ModelError::Hub(format!(
            "{} is empty: give a directory or a hub id",
            wanted.flag()
        )));
    }
    let path = Path::new(spec);
    if path.is_dir() {
        check_kind(path, spec, wanted)?;
        return Ok(path.to_path_buf());
    }
    if path.exists() {
        return Err(ModelError::Hub(format!(
            "{spec} is a file; {} takes a directory or a hub id",
            wanted.flag()
        )));
    }
    let looks_like_id =
        spec.split('/').count() == 2 && !spec.starts_with('.') && !spec.ends_with('/');
    if !looks_like_id {
        return Err(ModelError::Hub(format!(
            "{spec} is neither an existing directory nor a hub id of the form owner/name"
        )));
    }
    let cached = match wanted {
        Wanted::Model => cached_model_dir(&Cache::from_env(), spec),
        Wanted::Adapter => cached_adapter_dir(&Cache::from_env(), spec),
    };
    if let Some(dir) = cached {
        return Ok(dir);
    }
    // `models/x` may be a mistyped local path as well as a hub id: say both where it was looked for.
    let not_local = match std::env::current_dir() {
        Ok(cwd) => format!("no directory {spec} under {}", cwd.display()),
        Err(_) => format!("no directory {spec}"),
    };
    if offline() {
        return Err(ModelError::Hub(format!(
            "{not_local}, and as a hub id it is not complete in the hub cache ({}) while \
             HF_HUB_OFFLINE is set",
            Cache::from_env().path().display()
        )));
    }
    download(spec, wanted).map_err(|e| {
        ModelError::Hub(format!(
            "{not_local}, and as a hub id it could not be fetched: {}",
            e.to_string().trim_start_matches("hub: ")
        ))
    })
}

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .map(|v| !v.is_empty() && v != "0")
        .unwrap_or(false)
}

/// The snapshot directory of `id` in `cache` if its config and all its weight files are there.
pub fn cached_model_dir(cache: &Cache, id: &str) -> Option<PathBuf> {
    let repo = cache.model(id.to_string());
    let config = repo.get("config.json")?;
    let dir = config.parent()?.to_path_buf();
    match crate::loader::weight_files(&dir) {
        Ok(files) if files.iter().all(|f| f.exists()) => Some(dir),
        _ => None,
    }
}

/// The snapshot directory of the adapter `id` in `cache` if both its files are there.
pub fn cached_adapter_dir(cache: &Cache, id: &str) -> Option<PathBuf> {
    let repo = cache.model(id.to_string());
    let files: Option<Vec<PathBuf>> = ADAPTER_FILES.iter().map(|f| repo.get(f)).collect();
    files?.first()?.parent().map(Path::to_path_buf)
}

fn download(id: &str, wanted: Wanted) -> Result<PathBuf> {
    let hub = |e: hf_hub::api::sync::ApiError| ModelError::Hub(format!("{id}: {e}"));
    let api = ApiBuilder::from_env()
        .with_progress(true)
        .build()
        .map_err(hub)?;
    let repo = api.model(id.to_string());
    if wanted == Wanted::Adapter {
        let mut files = Vec::new();
        for file in ADAPTER_FILES {
            files.push(repo.get(file).map_err(hub)?);
        }
        return files[0]
            .parent()
            .map(Path::to_path_buf)
            .ok_or_else(|| ModelError::Hub(format!("{id}: unexpected cache layout")));
    }
    let config = repo.get("config.json").map_err(hub)?;
    match repo.get("model.safetensors.index.json") {
        Ok(index) => {
            let text = std::fs::read_to_string(&index).map_err(|error| ModelError::Io {
                path: index.clone(),
                error,
            })?;
            let value: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::Hub(format!("{}: {e}", index.display())))?;
            let mut shards: Vec<&str> = value
                .get("weight_map")
                .and_then(|m| m.as_object())
                .map(|m| m.values().filter_map(|v| v.as_str()).collect())
                .unwrap_or_default();
            shards.sort();
            shards.dedup();
            for shard in shards {
                repo.get(shard).map_err(hub)?;
            }
        }
        Err(_) => {
            repo.get("model.safetensors").map_err(hub)?;
        }
    }
    for file in OPTIONAL_FILES {
        if let Err(e) = repo.get(file) {
            tracing::debug!(file, error = %e, "optional file not fetched");
        }
    }
    config
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| ModelError::Hub(format!("{id}: unexpected cache layout")))
}
