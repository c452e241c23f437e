//! A run's metrics as it goes: `metrics.jsonl` (one JSON line per step, and one per evaluation) and
//! TensorBoard event files in the output directory, written by rank 0.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::output::TMP_MARK;
use crate::tensorboard::EventWriter;
use crate::{Result, TrainError};

/// `metrics.jsonl` and the event file. A run resumed from a checkpoint of this output directory
/// keeps the rows up to the step it resumes from and drops the later ones (an older checkpoint's later
/// steps are trained again), so every step appears once; any other run starts the file anew. The
/// event files follow the same rule ([`EventWriter::create`]).
pub struct MetricsLog {
    path: PathBuf,
    file: std::fs::File,
    events: EventWriter,
}

impl MetricsLog {
    /// Opens `dir/metrics.jsonl` and a new event file for a run starting at `start_step`, keeping
    /// the rows (and events) up to that step when `continues` (a resume of this directory's run).
    pub fn open(dir: &Path, start_step: usize, continues: bool) -> Result<Self> {
        let path = dir.join("metrics.jsonl");
        let kept = match continues {
            false => String::new(),
            true => match std::fs::read_to_string(&path) {
                Ok(text) => text
                    .lines()
                    .filter(|line| {
                        serde_json::from_str::<serde_json::Value>(line)
                            .ok()
                            .and_then(|v| v["step"].as_u64())
                            .is_some_and(|s| s as usize <= start_step)
                    })
                    .map(|line| format!("{line}\n"))
                    .collect(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
                Err(e) => return Err(TrainError::io("read", &path)(e)),
            },
        };
        // Rewritten whole, through a temporary file and a rename, so a kill here loses no rows.
        let tmp = dir.join(format!(".metrics.jsonl{TMP_MARK}{}", std::process::id()));
        // A write or rename that fails (disk full) takes its temporary file with it.
        let written = std::fs::write(&tmp, kept)
            .map_err(TrainError::io("write", &tmp))
            .and_then(|()| std::fs::rename(&tmp, &path).map_err(TrainError::io("write", &path)));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(TrainError::io("open", &path))?;
        let events = EventWriter::create(dir, start_step, !continues)?;
        Ok(Self { path, file, events })
    }

    /// Logs `metrics` at `step` (counted from 1): a metrics.jsonl row, and TensorBoard scalars
    /// under `group/` (`train` or `eval`), peak memory in MiB.
    pub fn write(&mut self, step: usize, group: &str, metrics: &[(String, f64)]) -> Result<()> {
        let mut row = serde_json::Map::new();
        row.insert("step".into(), step.into());
        for (name, value) in metrics {
            let key = match group {
                "train" => name.clone(),
                _ => format!("{group}_{name}"),
            };
            // Counts (tokens, epoch, bytes) stay integers in the JSON.
            let value = match value.fract() == 0.0 && value.abs() < 2f64.powi(53) {
                true => serde_json::json!(*value as i64),
                false => serde_json::json!(value),
            };
            row.insert(key, value);
        }
        writeln!(self.file, "{}", serde_json::Value::Object(row))
            .map_err(TrainError::io("write", &self.path))?;
        let scalars: Vec<(String, f64)> = metrics
            .iter()
            .map(|(name, value)| match name.as_str() {
                "peak_bytes" => (format!("{group}/peak_mib"), value / (1u64 << 20) as f64),
                _ => (format!("{group}/{name}"), *value),
            })
            .collect();
        self.events.scalars(step, &scalars)
    }
}
