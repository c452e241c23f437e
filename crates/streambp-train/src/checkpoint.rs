//! HF-loadable checkpoints, written atomically: everything goes into a temporary directory next to the
//! target, which is renamed into place only when complete, so an interrupted run never leaves a
//! half-written checkpoint (and a previous one is replaced only by a complete one).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use streambp_models::Model;

use crate::{Result, TrainError};

/// Optimizer moments of a resumable checkpoint.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Step, epoch and data position of a resumable checkpoint.
pub const STATE_FILE: &str = "trainer_state.json";

/// Where a run stood when its checkpoint was written: enough to continue it exactly.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainerState {
    /// Optimizer steps taken.
    pub step: usize,
    /// Passes over the data begun (the shuffle of epoch `e` is seeded with `seed + e`).
    pub epoch: u64,
    /// Position in the current epoch's order.
    pub cursor: usize,
    pub seed: u64,
}

impl TrainerState {
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(STATE_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            TrainError::Usage(format!(
                "{} is not a resumable checkpoint ({}: {e})",
                dir.display(),
                STATE_FILE
            ))
        })?;
        serde_json::from_str(&text)
            .map_err(|e| TrainError::Usage(format!("{}: {e}", path.display())))
    }
}

/// Copies `config.json` with its dtype set to the one the weights are saved in, so that
/// `from_pretrained(..., dtype="auto")` loads them as they are.
fn write_config(src: &Path, dtype: DType, dst: &Path) -> Result<()> {
    let text = std::fs::read_to_string(src)?;
    let mut config: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| TrainError::Usage(format!("{}: not valid JSON: {e}", src.display())))?;
    let name = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "float32",
    };
    if let Some(object) = config.as_object_mut() {
        // transformers 4 reads `torch_dtype`, transformers 5 `dtype`.
        object.insert("torch_dtype".into(), name.into());
        if object.contains_key("dtype") {
            object.insert("dtype".into(), name.into());
        }
    }
    let pretty = serde_json::to_string_pretty(&config)
        .map_err(|e| TrainError::Usage(format!("config.json: {e}")))?;
    std::fs::write(dst, pretty)?;
    Ok(())
}

/// Writes `model` (weights under their HF names, tied embeddings once), its `config.json` and the
/// tokenizer files into `dir`.
pub fn save_checkpoint(
    model: &Model,
    config_json: &Path,
    tokenizer_files: &[PathBuf],
    extra: &[(&str, String)],
    optimizer: Option<&HashMap<String, Tensor>>,
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
    write_config(config_json, model.dtype(), &tmp.join("config.json"))?;
    for f in tokenizer_files {
        if let Some(n) = f.file_name() {
            std::fs::copy(f, tmp.join(n))?;
        }
    }
    for (file, text) in extra {
        std::fs::write(tmp.join(file), text)?;
    }
    if let Some(state) = optimizer {
        let cpu: HashMap<String, Tensor> = state
            .iter()
            .map(|(k, v)| Ok((k.clone(), v.to_device(&Device::Cpu)?)))
            .collect::<Result<_>>()?;
        candle_core::safetensors::save(&cpu, tmp.join(OPTIMIZER_FILE))?;
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
