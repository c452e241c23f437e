//! Loading a Hugging Face model directory: `config.json` plus `model.safetensors` or shards listed in
//! `model.safetensors.index.json`. Every tensor the config implies is looked up, shape-checked and
//! converted to the wanted dtype; anything wrong is an error naming the file and the tensor.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor};
use safetensors::SafeTensors;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::model::Model;

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// Loads the model in `dir` as `dtype` on `device`.
pub fn load_model(dir: &Path, dtype: DType, device: &Device) -> Result<Model> {
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    let files = weight_files(dir)?;
    let mut maps = Vec::with_capacity(files.len());
    for path in &files {
        let file = File::open(path).map_err(|error| ModelError::Io {
            path: path.clone(),
            error,
        })?;
        // SAFETY: the file is only read; a checkpoint rewritten while we load it is the user's race,
        // as with every mmap-based loader (transformers' included).
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|error| ModelError::Io {
            path: path.clone(),
            error,
        })?;
        maps.push(mmap);
    }
    let mut archives = Vec::with_capacity(files.len());
    for (path, map) in files.iter().zip(&maps) {
        let st = SafeTensors::deserialize(map).map_err(|e| ModelError::BadSafetensors {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        archives.push((path.as_path(), st));
    }

    let mut tensors = HashMap::new();
    for (name, expected) in config.parameter_shapes() {
        let (path, view) = find_tensor(&archives, &name)?;
        if view.shape() != expected.as_slice() {
            return Err(ModelError::ShapeMismatch {
                name,
                path: path.to_path_buf(),
                expected,
                found: view.shape().to_vec(),
            });
        }
        let t = view
            .load(device)
            .and_then(|t| t.to_dtype(dtype))
            .map_err(|e| ModelError::BadSafetensors {
                path: path.to_path_buf(),
                reason: format!("tensor {name:?}: {e}"),
            })?;
        tensors.insert(name, t);
    }
    tracing::info!(
        dir = %dir.display(),
        files = files.len(),
        tensors = tensors.len(),
        ?dtype,
        "loaded model"
    );
    Model::from_tensors(config, tensors)
}

/// The safetensors files of a model directory, from the index when there is one.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(INDEX_FILE);
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|error| ModelError::Io {
            path: index.clone(),
            error,
        })?;
        let bad = |reason: String| ModelError::Config {
            path: index.clone(),
            reason,
        };
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("no weight_map object".into()))?;
        let mut files: Vec<String> = Vec::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("weight_map entry {name:?} is not a file name")))?;
            if !dir.join(file).exists() {
                return Err(ModelError::MissingShard {
                    path: index.clone(),
                    name: name.clone(),
                    file: file.to_string(),
                });
            }
            if !files.iter().any(|f| f == file) {
                files.push(file.to_string());
            }
        }
        files.sort();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join(SINGLE_FILE);
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(ModelError::NoWeights {
        path: dir.to_path_buf(),
    })
}

/// Names a tensor can have in a checkpoint: its text-model name, and the prefixes of the multimodal
/// Gemma3 wrapper (old and new transformers layouts).
fn candidate_names(name: &str) -> Vec<String> {
    let mut out = vec![name.to_string()];
    if let Some(rest) = name.strip_prefix("model.") {
        out.push(format!("language_model.model.{rest}"));
        out.push(format!("model.language_model.{rest}"));
    } else {
        out.push(format!("language_model.{name}"));
    }
    out
}

fn find_tensor<'a>(
    archives: &'a [(&'a Path, SafeTensors<'a>)],
    name: &str,
) -> Result<(&'a Path, safetensors::tensor::TensorView<'a>)> {
    for candidate in candidate_names(name) {
        for (path, st) in archives {
            if let Ok(view) = st.tensor(&candidate) {
                return Ok((path, view));
            }
        }
    }
    Err(ModelError::MissingTensor {
        name: name.to_string(),
        files: archives
            .iter()
            .map(|(p, _)| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// Writes `tensors` as a safetensors file atomically: to a temporary file in the same directory, then
/// renamed over `path`, so an interrupted write never leaves a truncated file behind. A failure names
/// `path` and removes the temporary file.
pub fn save_safetensors(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "tensors.safetensors".into());
    let tmp = dir.join(format!(".{file_name}.tmp-{}", std::process::id()));
    let written = candle_core::safetensors::save(tensors, &tmp)
        .map_err(|e| e.to_string())
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| e.to_string()));
    written.map_err(|reason| {
        let _ = std::fs::remove_file(&tmp);
        ModelError::Write {
            path: path.to_path_buf(),
            reason,
        }
    })
}
