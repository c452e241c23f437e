//! The output directory of a run, checked before anything trains: it must be a writable directory whose
//! `final` can be written, and one run uses it at a time (a lock file). Saves that an earlier run did
//! not finish (killed, disk full) leave hidden temporary directories; they are removed here, and a
//! checkpoint caught between its two renames is put back.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::{Result, TrainError};

/// Prefixes of the hidden directories a save works in: `.NAME.tmp-PID` (being written) and
/// `.NAME.old-PID` (the checkpoint it replaces, until the new one is in place).
pub const TMP_MARK: &str = ".tmp-";
/// See [`TMP_MARK`]: the marker of a replaced checkpoint kept aside during a save.
pub const OLD_MARK: &str = ".old-";

/// A checked output directory, locked for this run while the value lives.
#[derive(Debug)]
pub struct OutputDir {
    /// The directory, as given.
    pub path: PathBuf,
    /// Held open: the lock is released when the run ends, however it ends (a killed run leaves the
    /// file, unlocked).
    lock: File,
    /// Whether this run created the directory: one it then wrote no output into (it failed early)
    /// is removed again rather than left empty.
    created: bool,
}

impl Drop for OutputDir {
    /// Removes the lock file, leaving the directory as the run's outputs alone (and removing the
    /// directory where this run created it and wrote nothing there).
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.path.join(LOCK_FILE));
        let _ = self.lock.unlock();
        if self.created && !holds_outputs(&self.path) {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Whether `dir` (created by this run) holds an output of it: a checkpoint, the final or merged
/// model, or a logged metric. The built-in task's files, an empty metrics log, an event file with no
/// scalar yet and hidden entries (the lock, temporary stores) are not.
fn holds_outputs(dir: &Path) -> bool {
    match std::fs::read_dir(dir) {
        Ok(entries) => entries.filter_map(|e| e.ok()).any(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let size = e.metadata().map(|m| m.len()).unwrap_or(1);
            match name.as_ref() {
                "metrics.jsonl" => size > 0,
                "builtin-task" => false,
                // An event file's header alone: no scalar logged.
                _ if name.starts_with("events.out.tfevents.") => size > EVENT_HEADER_BYTES,
                _ => !name.starts_with('.'),
            }
        }),
        // Unreadable: keep it.
        Err(_) => true,
    }
}

/// The size of a TensorBoard event file holding its header record alone.
const EVENT_HEADER_BYTES: u64 = 40;

/// The lock file of a run's output directory.
const LOCK_FILE: &str = ".lock";

impl OutputDir {
    /// Creates `path` if needed, checks that it and its `final` can be written, takes its lock and
    /// cleans what interrupted saves left.
    pub fn prepare(path: &Path) -> Result<Self> {
        if path.exists() && !path.is_dir() {
            return Err(TrainError::flag(
                "--output-dir",
                path.display(),
                "exists and is not a directory",
            ));
        }
        let created = !path.exists();
        std::fs::create_dir_all(path)
            .map_err(TrainError::io("create the output directory", path))?;
        let final_dir = path.join("final");
        if final_dir.exists() && !final_dir.is_dir() {
            return Err(TrainError::flag(
                "--output-dir",
                path.display(),
                format!(
                    "{} exists and is not a directory; the final checkpoint goes there",
                    final_dir.display()
                ),
            ));
        }
        let probe = path.join(format!(".write-test-{}", std::process::id()));
        File::create(&probe).map_err(TrainError::io("write into the output directory", path))?;
        std::fs::remove_file(&probe).map_err(TrainError::io("remove", &probe))?;
        let lock_path = path.join(LOCK_FILE);
        let lock = File::create(&lock_path).map_err(TrainError::io("create", &lock_path))?;
        let in_use = || {
            TrainError::flag(
                "--output-dir",
                path.display(),
                format!(
                    "is in use by another run (it holds {}); give another --output-dir",
                    lock_path.display()
                ),
            )
        };
        lock.try_lock().map_err(|_| in_use())?;
        // A run ending removes its lock file; one that opened it just before then holds a lock on a
        // file that is gone, which guards nothing: only the file at the path counts.
        if !same_file(&lock, &lock_path) {
            return Err(in_use());
        }
        clean_interrupted_saves(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            lock,
            created,
        })
    }

    /// Makes way for a fresh run: an earlier run's checkpoints and final model (which would sit
    /// beside this run's, or be half replaced by them) are removed when `overwrite`, else refused.
    pub fn replace_earlier_run(&self, overwrite: bool) -> Result<()> {
        let entries = std::fs::read_dir(&self.path).map_err(TrainError::io("list", &self.path))?;
        let mut earlier: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|name| {
                is_run_output(name) && (name == "final" || name.starts_with("checkpoint-"))
            })
            .collect();
        if earlier.is_empty() {
            return Ok(());
        }
        earlier.sort();
        if !overwrite {
            return Err(TrainError::flag(
                "--output-dir",
                self.path.display(),
                format!(
                    "holds an earlier run ({}): give --resume to continue it, \
                     --overwrite-output-dir to replace it, or another --output-dir",
                    earlier.join(", ")
                ),
            ));
        }
        for name in &earlier {
            let dir = self.path.join(name);
            std::fs::remove_dir_all(&dir).map_err(TrainError::io("remove", &dir))?;
        }
        tracing::info!(
            removed = earlier.join(", "),
            "an earlier run's outputs replaced"
        );
        Ok(())
    }
}

/// Whether `name` is one of the outputs a run writes through a hidden temporary: `checkpoint-N`,
/// `final`, `merged` or `metrics.jsonl`, or its tokenized data (`tokenized`, `packed`: only ever
/// temporary). Cleanup touches nothing else a user keeps in the directory.
fn is_run_output(name: &str) -> bool {
    let checkpoint = name
        .strip_prefix("checkpoint-")
        .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
    checkpoint
        || matches!(
            name,
            "final" | "merged" | "metrics.jsonl" | "tokenized" | "packed"
        )
}

/// The run output a save's hidden temporary belongs to (`.checkpoint-5.tmp-123` → `checkpoint-5`);
/// `None` for any other name.
fn save_target<'a>(name: &'a str, mark: &str) -> Option<&'a str> {
    let (head, pid) = name.strip_prefix('.')?.rsplit_once(mark)?;
    let pid_ok = !pid.is_empty() && pid.chars().all(|c| c.is_ascii_digit());
    (pid_ok && is_run_output(head)).then_some(head)
}

/// The hidden temporary path of the run output `name` in `dir` for this process
/// (`.NAME.tmp-PID`), which [`clean_interrupted_saves`] removes if the process dies.
pub fn temporary(dir: &Path, name: &str) -> std::path::PathBuf {
    dir.join(format!(".{name}{TMP_MARK}{}", std::process::id()))
}

/// Removes every `.NAME.tmp-PID` in `dir` whose NAME is a run output ([`is_run_output`]), and puts
/// `.NAME.old-PID` back as `NAME` where the save that was replacing it died before its new copy was in
/// place (else removes it). Only call this holding the directory's lock: then no other save is running
/// there.
pub fn clean_interrupted_saves(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(TrainError::io("list", dir))?;
    for entry in entries {
        let entry = entry.map_err(TrainError::io("list", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if save_target(&name, TMP_MARK).is_some() {
            tracing::info!(path = %path.display(), "removing an interrupted save");
            remove(&path)?;
        } else if let Some(target) = save_target(&name, OLD_MARK) {
            let target = dir.join(target);
            if target.exists() {
                remove(&path)?;
            } else {
                tracing::info!(path = %target.display(), "restoring a checkpoint an interrupted save had moved aside");
                std::fs::rename(&path, &target).map_err(TrainError::io("restore", &target))?;
            }
        }
    }
    Ok(())
}

/// Whether `path` names the file `file` has open.
#[cfg(unix)]
fn same_file(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// Elsewhere a lock file is never removed while locked by another process, so the path is the file.
#[cfg(not(unix))]
fn same_file(_: &File, _: &Path) -> bool {
    true
}

fn remove(path: &Path) -> Result<()> {
    let removed = match path.is_dir() {
        true => std::fs::remove_dir_all(path),
        false => std::fs::remove_file(path),
    };
    removed.map_err(TrainError::io("remove", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_targets_are_read_from_hidden_names() {
        assert_eq!(
            save_target(".checkpoint-5.tmp-123", TMP_MARK),
            Some("checkpoint-5")
        );
        assert_eq!(save_target(".final.old-9", OLD_MARK), Some("final"));
        assert_eq!(save_target("checkpoint-5", TMP_MARK), None);
        assert_eq!(save_target(".final.tmp-12a", TMP_MARK), None);
        assert_eq!(save_target(".final.tmp-", TMP_MARK), None);
        assert_eq!(
            save_target(".notes.tmp-1", TMP_MARK),
            None,
            "not a run output"
        );
        assert_eq!(
            save_target(".env.old-2024", OLD_MARK),
            None,
            "not a run output"
        );
        assert_eq!(
            save_target(".metrics.jsonl.tmp-9", TMP_MARK),
            Some("metrics.jsonl")
        );
    }

    /// A half-written save is removed; a checkpoint moved aside by a save that died before its new copy
    /// was in place is put back; one whose new copy made it is dropped.
    #[test]
    fn interrupted_saves_are_cleaned_and_moved_checkpoints_restored() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for sub in [
            ".checkpoint-4.tmp-77",
            ".checkpoint-3.old-77",
            ".final.old-78",
            "final",
            ".cache.tmp-42",
        ] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
            std::fs::write(d.join(sub).join("model.safetensors"), sub).unwrap();
        }
        std::fs::write(d.join(".notes.tmp-1"), "mine").unwrap();
        std::fs::write(d.join(".env.old-2024"), "mine").unwrap();
        clean_interrupted_saves(d).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        // A user's own hidden files and directories stay as they are.
        assert_eq!(
            names,
            [
                ".cache.tmp-42",
                ".env.old-2024",
                ".notes.tmp-1",
                "checkpoint-3",
                "final"
            ]
        );
        let restored = std::fs::read_to_string(d.join("checkpoint-3/model.safetensors")).unwrap();
        assert_eq!(restored, ".checkpoint-3.old-77");
        let kept = std::fs::read_to_string(d.join("final/model.safetensors")).unwrap();
        assert_eq!(kept, "final");
    }
}
