//! HF-loadable checkpoints, written atomically: everything goes into a temporary directory next to the
//! target, which is renamed into place only when complete, so an interrupted run never leaves a
//! half-written checkpoint (and a previous one is replaced only by a complete one). A save that fails
//! removes its temporary directory; one that is killed leaves it for the next run's
//! [`crate::output::clean_interrupted_saves`].
//!
//! A resumable checkpoint also records the run that wrote it ([`RunRecord`]), so that `--resume` can
//! refuse a run that would continue differently (other data, batch size, model) and warn about settings
//! that only change the course from there on.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use streambp_dist::{Communicator, SingleProcess};
use streambp_models::adapter::save_adapter;
use streambp_models::{save_safetensors, Model};

use crate::output::{OLD_MARK, TMP_MARK};
use crate::{Result, TrainError};

/// Optimizer moments of a resumable checkpoint.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Step, epoch, data position and run record of a resumable checkpoint.
pub const STATE_FILE: &str = "trainer_state.json";

/// The settings of a run that decide how it continues, under the flag names a user types (and
/// `recipe`, `data` for the job and the training examples themselves).
pub type RunRecord = BTreeMap<String, serde_json::Value>;

/// Where a run stood when its checkpoint was written: enough to continue it exactly.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainerState {
    /// Optimizer steps taken.
    pub step: usize,
    /// Passes over the data begun (the shuffle of epoch `e` is seeded with `seed + e`).
    pub epoch: u64,
    /// Position in the current epoch's order.
    pub cursor: usize,
    /// The run's `--seed`, which the data order is drawn from.
    pub seed: u64,
    /// The run's first step's loss, for the summary of a resumed run (absent in checkpoints of older
    /// versions: then the summary starts at the first resumed step).
    #[serde(default)]
    pub first_loss: Option<f64>,
    /// The run's settings (absent in checkpoints of older versions: then nothing is compared).
    #[serde(default)]
    pub run: RunRecord,
    /// What the job carries from step to step beyond the optimizer and the data order (GRPO's
    /// adaptive entropy coefficient), as the job wrote it; absent where it carries nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recipe_state: Option<serde_json::Value>,
}

impl TrainerState {
    /// The state of the checkpoint in `dir`; an error saying it is not resumable when the state file
    /// is missing or unreadable.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(STATE_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            TrainError::Checkpoint(format!(
                "{} is not a resumable checkpoint ({STATE_FILE}: {e})",
                dir.display()
            ))
        })?;
        serde_json::from_str(&text)
            .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", path.display())))
    }
}

/// Settings that must be equal to resume: the job, the weights' origin, the examples and how many make
/// a step, and GRPO's group shape. Every other recorded setting only warns when it changed.
const MUST_MATCH: &[&str] = &[
    "recipe",
    "--model",
    "data",
    "--seed",
    "--batch-size",
    "--grad-accum",
    "--group-size",
    "--num-iterations",
    "--lora-r",
    "--lora-alpha",
    "--lora-target",
    "--use-rslora",
    "--adapter",
    "--ref-model",
    "--zero",
    "--sp",
    "ranks",
];

/// Compares the checkpoint's run with the one resuming it: refuses when a setting of [`MUST_MATCH`]
/// differs, naming each; warns for every other difference.
pub fn check_resume(checkpoint: &Path, saved: &RunRecord, given: &RunRecord) -> Result<()> {
    let mut refused = Vec::new();
    for (key, now) in given {
        let Some(before) = saved.get(key) else {
            continue;
        };
        if before == now {
            continue;
        }
        if MUST_MATCH.contains(&key.as_str()) {
            refused.push(format!(
                "{key}: {before} in the checkpoint's run, {now} now"
            ));
        } else {
            tracing::warn!(
                setting = key.as_str(),
                checkpoint = %before,
                now = %now,
                "resuming with a setting changed: the run continues differently from here"
            );
        }
    }
    if refused.is_empty() {
        return Ok(());
    }
    Err(TrainError::Checkpoint(format!(
        "cannot resume from {}: {}. Resume with the settings it was trained with (the data's \
         examples depend on --data, --max-length, --overflow, --packing and the tokenizer)",
        checkpoint.display(),
        refused.join("; ")
    )))
}

/// A 64-bit FNV-1a digest of an explicit little-endian encoding of training items (not of
/// `std::hash::Hash`, whose bytes no Rust release promises to keep): the same for the same items on
/// every run, machine and toolchain, to tell whether a resumed run trains on the data it began with.
pub struct Fingerprint(u64);

impl Default for Fingerprint {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fingerprint {
    /// Adds raw bytes.
    pub fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }

    /// Adds a length-prefixed list of numbers, each as 8 little-endian bytes.
    pub fn numbers(&mut self, values: impl ExactSizeIterator<Item = i64>) {
        self.bytes(&(values.len() as u64).to_le_bytes());
        for v in values {
            self.bytes(&v.to_le_bytes());
        }
    }

    /// Adds bytes 8 at a time (a model's gigabytes at memory speed rather than byte by byte), the
    /// tail zero-padded, then their count.
    pub fn words(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let word = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            self.0 = (self.0 ^ word).wrapping_mul(0x100_0000_01b3);
        }
        let mut tail = [0u8; 8];
        tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
        self.0 = (self.0 ^ u64::from_le_bytes(tail)).wrapping_mul(0x100_0000_01b3);
        self.bytes(&(bytes.len() as u64).to_le_bytes());
    }

    /// The digest as 16 hex digits.
    pub fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

/// A training item whose content a [`Fingerprint`] can take.
pub trait Digest {
    /// Feeds the item's content into `into`.
    fn digest(&self, into: &mut Fingerprint);
}

/// The record of a run's training data: how many items and their [`Fingerprint`].
pub fn data_identity<T: Digest>(items: &[T]) -> serde_json::Value {
    let mut f = Fingerprint::default();
    for item in items {
        item.digest(&mut f);
    }
    identity(items.len(), &f)
}

/// The record of the weights in the model directory `dir`: how many bytes its `.safetensors` files
/// hold and a [`Fingerprint`] of them (names and bytes, in name order). The same model under another
/// spelling of its path is the same record; another model written over the same path is not.
pub fn weights_identity(dir: &Path) -> Result<serde_json::Value> {
    use std::io::Read;
    let entries = std::fs::read_dir(dir).map_err(TrainError::io("list", dir))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let mut f = Fingerprint::default();
    let mut total = 0u64;
    let mut block = vec![0u8; 1 << 20];
    for path in &files {
        f.bytes(path.file_name().unwrap_or_default().as_encoded_bytes());
        let mut file = std::fs::File::open(path).map_err(TrainError::io("read", path))?;
        loop {
            // Whole blocks (a short read only at the end), so the digest does not depend on how
            // the reads happened to split.
            let mut filled = 0;
            while filled < block.len() {
                match file.read(&mut block[filled..]) {
                    Ok(0) => break,
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(TrainError::io("read", path)(e)),
                }
            }
            f.words(&block[..filled]);
            total += filled as u64;
            if filled < block.len() {
                break;
            }
        }
    }
    Ok(format!("weights: {total} bytes, fingerprint {}", f.hex()).into())
}

/// The record of `count` items whose content gave `fingerprint`.
pub fn identity(count: usize, fingerprint: &Fingerprint) -> serde_json::Value {
    format!("{count} items, fingerprint {}", fingerprint.hex()).into()
}

/// Copies `config.json` with its dtype set to the one the weights are saved in, so that
/// `from_pretrained(..., dtype="auto")` loads them as they are.
fn write_config(src: &Path, model: &Model, dst: &Path) -> Result<()> {
    let dtype = model.dtype();
    let text = std::fs::read_to_string(src).map_err(TrainError::io("read", src))?;
    let mut config: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| TrainError::data(src.display(), format!("not valid JSON: {e}")))?;
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
        // A reward model (also one started from a causal LM's config): transformers' classifier
        // with one label, reading rows at their last non-pad token.
        if model.scores_positions() {
            let config = &model.config;
            object.insert(
                "architectures".into(),
                serde_json::json!([config.architecture()]),
            );
            object.insert("id2label".into(), serde_json::json!({"0": "LABEL_0"}));
            object.insert("label2id".into(), serde_json::json!({"LABEL_0": 0}));
            object.remove("num_labels");
            if let Some(pad) = config.pad_token_id {
                object.insert("pad_token_id".into(), pad.into());
            }
        }
    }
    let pretty = serde_json::to_string_pretty(&config)
        .map_err(|e| TrainError::Internal(format!("config.json: {e}")))?;
    std::fs::write(dst, pretty).map_err(TrainError::io("write", dst))
}

/// What a checkpoint directory holds.
pub struct CheckpointFiles<'a> {
    /// The model saved, in its own dtype: its weights, or a LoRA model's adapter only (as PEFT
    /// saves it).
    pub model: &'a Model,
    /// The base model's name or path, recorded as an adapter's `base_model_name_or_path`.
    pub base_model: Option<&'a str>,
    /// The model's `config.json`, copied with the saved dtype.
    pub config_json: &'a Path,
    /// Tokenizer files copied as they are (`tokenizer.json`, `tokenizer_config.json`…).
    pub tokenizer_files: &'a [PathBuf],
    /// Further text files: `(name, contents)`.
    pub extra: &'a [(&'a str, String)],
}

/// Writes a checkpoint into `dir` atomically (weights under their HF names, tied embeddings once).
pub fn save_checkpoint(files: &CheckpointFiles, dir: &Path) -> Result<()> {
    let pid = u64::from(std::process::id());
    save_checkpoint_shared(&SingleProcess, pid, Some(files), &[], dir)
}

/// Writes a checkpoint into `dir` atomically from every rank of a run: rank 0 (`main`) writes the
/// model, config, tokenizer and extra files, every rank its own tensor files (`own`: its optimizer
/// shard), all into one hidden directory named after the run's `job`, which rank 0 renames into place
/// once every rank is done. A failed save removes that directory; a killed one leaves it for the next
/// run's cleanup.
pub fn save_checkpoint_shared(
    comm: &dyn Communicator,
    job: u64,
    main: Option<&CheckpointFiles>,
    own: &[(String, HashMap<String, Tensor>)],
    dir: &Path,
) -> Result<()> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "checkpoint".into());
    let tmp = parent.join(format!(".{name}{TMP_MARK}{job}"));
    let barrier = || comm.barrier().map_err(TrainError::from);
    let mut written = match main {
        Some(files) => std::fs::create_dir_all(parent)
            .map_err(TrainError::io("create", parent))
            .and_then(|()| write_into(files, &tmp)),
        None => Ok(()),
    };
    barrier()?;
    if written.is_ok() {
        written = own
            .iter()
            .try_for_each(|(file, tensors)| save_tensors(&on_host(tensors)?, &tmp.join(file)));
    }
    barrier()?;
    if written.is_ok() && main.is_some() {
        written = sync_directory(&tmp, true).and_then(|()| replace(&tmp, dir, parent, &name, job));
    }
    barrier()?;
    if written.is_err() && tmp.exists() && main.is_some() {
        // Disk full or a failed copy: leave no half-written directory behind.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written.map_err(|e| match e {
        TrainError::Io {
            action,
            path,
            error,
        } if path.starts_with(&tmp) => TrainError::Io {
            action,
            path: dir.join(path.strip_prefix(&tmp).unwrap_or(&path)),
            error,
        },
        other => other,
    })
}

/// `tensors` copied to host memory (what a file is written from).
fn on_host(tensors: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    tensors
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.to_device(&Device::Cpu)?)))
        .collect()
}

/// Writes rank 0's files of the checkpoint into the (new, empty) directory `tmp`.
fn write_into(files: &CheckpointFiles, tmp: &Path) -> Result<()> {
    if tmp.exists() {
        std::fs::remove_dir_all(tmp).map_err(TrainError::io("remove", tmp))?;
    }
    std::fs::create_dir_all(tmp).map_err(TrainError::io("create", tmp))?;
    match files.model.lora() {
        Some(_) => save_adapter(files.model, files.base_model, tmp)?,
        None => {
            let tensors: HashMap<String, Tensor> = files
                .model
                .weights()
                .iter()
                .map(|(n, t)| (n.clone(), t.detach()))
                .collect();
            save_tensors(&on_host(&tensors)?, &tmp.join("model.safetensors"))?;
            write_config(files.config_json, files.model, &tmp.join("config.json"))?;
        }
    }
    for f in files.tokenizer_files {
        if let Some(n) = f.file_name() {
            std::fs::copy(f, tmp.join(n)).map_err(TrainError::io("copy", f))?;
        }
    }
    for (file, text) in files.extra {
        let path = tmp.join(file);
        std::fs::write(&path, text).map_err(TrainError::io("write", &path))?;
    }
    Ok(())
}

/// Flushes `dir` (and with `files`, every file in it) to the disk, so that a checkpoint renamed into
/// place after a power loss is whole, not a directory of empty files.
fn sync_directory(dir: &Path, files: bool) -> Result<()> {
    let sync = |path: &Path| {
        std::fs::File::open(path)
            .and_then(|f| f.sync_all())
            .map_err(TrainError::io("flush", path))
    };
    if files {
        let entries = std::fs::read_dir(dir).map_err(TrainError::io("list", dir))?;
        for entry in entries {
            sync(&entry.map_err(TrainError::io("list", dir))?.path())?;
        }
    }
    sync(dir)
}

/// Puts the complete `tmp` in the place of `dir`, moving an older `dir` aside until then (and back,
/// should the new one fail to move in).
fn replace(tmp: &Path, dir: &Path, parent: &Path, name: &str, pid: u64) -> Result<()> {
    if dir.exists() {
        let old = parent.join(format!(".{name}{OLD_MARK}{pid}"));
        std::fs::rename(dir, &old).map_err(TrainError::io("move aside", dir))?;
        if let Err(e) = std::fs::rename(tmp, dir) {
            let _ = std::fs::rename(&old, dir);
            return Err(TrainError::io("write", dir)(e));
        }
        // The new checkpoint is in place; an old copy that will not go is the next run's to clean.
        if let Err(e) = std::fs::remove_dir_all(&old) {
            tracing::warn!(path = %old.display(), error = %e, "could not remove the replaced checkpoint");
        }
    } else {
        std::fs::rename(tmp, dir).map_err(TrainError::io("write", dir))?;
    }
    sync_directory(parent, false)
}

/// [`save_safetensors`], with a failure reported as a write of `path` (which [`save_checkpoint`]
/// renames from the temporary directory to the checkpoint's).
fn save_tensors(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    save_safetensors(tensors, path).map_err(|e| TrainError::Io {
        action: "write",
        path: path.to_path_buf(),
        error: std::io::Error::other(match e {
            streambp_models::ModelError::Write { reason, .. } => reason,
            other => other.to_string(),
        }),
    })
}
