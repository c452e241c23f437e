//! HF-loadable checkpoints, written atomically: everything goes into a temporary directory next to the
//! target, which is renamed into place only when complete, so an interrupted run never leaves a
//! half-written checkpoint (and a previous one is replaced only by a complete one).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use streambp_models::Model;

use crate::{Result, TrainError};

/// Writes `model` (weights under their HF names, tied embeddings once), its `config.json` and the
/// tokenizer files into `dir`.
pub fn save_checkpoint(
    model: &Model,
    config_json: &Path,
    tokenizer_files: &[PathBuf],
    extra: &[(&str, String)],
    dir: &Path,
) -> Result<()> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)?;
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "checkpoint".into());
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir_all(&tmp)?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (n, v) in model.parameters() {
        tensors.insert(n.clone(), v.as_tensor().detach().to_device(&Device::Cpu)?);
    }
    candle_core::safetensors::save(&tensors, tmp.join("model.safetensors"))?;
    std::fs::copy(config_json, tmp.join("config.json"))?;
    for f in tokenizer_files {
        if let Some(n) = f.file_name() {
            std::fs::copy(f, tmp.join(n))?;
        }
    }
    for (file, text) in extra {
        std::fs::write(tmp.join(file), text)?;
    }
    if dir.exists() {
        let old = parent.join(format!(".{name}.old-{}", std::process::id()));
        std::fs::rename(dir, &old)?;
        std::fs::rename(&tmp, dir)?;
        std::fs::remove_dir_all(&old)?;
    } else {
        std::fs::rename(&tmp, dir).map_err(|e| {
            TrainError::Usage(format!(
                "cannot move checkpoint into {}: {e}",
                dir.display()
            ))
        })?;
    }
    Ok(())
}
