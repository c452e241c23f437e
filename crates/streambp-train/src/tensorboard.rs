//! TensorBoard event files: a run's scalars (loss, learning rate, rewards, eval metrics…) as
//! `events.out.tfevents.*` files that `tensorboard --logdir runs/` shows while the run goes on.
//!
//! The format is TensorFlow's: a sequence of TFRecords (`u64` length, masked CRC-32C of the length,
//! the bytes, masked CRC-32C of the bytes), each an `Event` protobuf. The first event names the file
//! version; a resumed run starts its file with a `SessionLog START` at the first step it logs, which
//! makes TensorBoard drop that step and the later ones of the run it replaces (its "orphaned data"), as
//! metrics.jsonl drops their rows.

use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};

use prost::Message;

use crate::{Result, TrainError};

/// `tensorflow.Event`: the fields a scalar log uses.
#[derive(Clone, PartialEq, Message)]
pub struct Event {
    /// Seconds since the epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The training step the event belongs to.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// `brain.Event:2` in a file's first event.
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    /// Scalars.
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
    /// A session's start (or stop); tag 6 is the deprecated `log_message`.
    #[prost(message, optional, tag = "7")]
    pub session_log: Option<SessionLog>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    /// One value per tag.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` holding a `simple_value` (TensorBoard's scalar).
#[derive(Clone, PartialEq, Message)]
pub struct SummaryValue {
    /// The chart's name, `train/loss` say.
    #[prost(string, tag = "1")]
    pub tag: String,
    /// The value (TensorBoard's scalars are `f32`).
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}

/// `tensorflow.SessionLog`.
#[derive(Clone, PartialEq, Message)]
pub struct SessionLog {
    /// 1 = START: TensorBoard drops what it holds at this step and after.
    #[prost(int32, tag = "1")]
    pub status: i32,
}

const SESSION_START: i32 = 1;

/// Appends events to one new event file of a run's directory.
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

/// Whether `name` is an event file's (the files a fresh run clears from its output directory).
pub fn is_event_file(name: &str) -> bool {
    name.starts_with("events.out.tfevents.")
}

impl EventWriter {
    /// A new event file in `dir` for a run starting after `first_step` steps (0, or the step it
    /// resumes from). `fresh` removes the directory's earlier event files first: a run that does not continue
    /// the directory's own run replaces its charts, as it replaces metrics.jsonl.
    pub fn create(dir: &Path, first_step: usize, fresh: bool) -> Result<Self> {
        if fresh {
            let entries = std::fs::read_dir(dir).map_err(TrainError::io("read", dir))?;
            for entry in entries.flatten() {
                if entry.file_name().to_str().is_some_and(is_event_file) {
                    let path = entry.path();
                    std::fs::remove_file(&path).map_err(TrainError::io("remove", &path))?;
                }
            }
        }
        let wall = now();
        // TensorBoard reads a directory's event files in name order: the time (then, within one
        // process, a counter) keeps a later run's file after an earlier one's.
        static FILES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let path = dir.join(format!(
            "events.out.tfevents.{:010}.streambp.{}.{:04}",
            wall as u64,
            std::process::id(),
            FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let file = std::fs::File::create(&path).map_err(TrainError::io("create", &path))?;
        let mut writer = Self { path, file };
        writer.write(&Event {
            wall_time: wall,
            file_version: Some("brain.Event:2".into()),
            ..Default::default()
        })?;
        if first_step > 0 {
            // Steps are logged counted from 1: the resumed run's first is `first_step + 1`.
            writer.write(&Event {
                wall_time: wall,
                step: first_step as i64 + 1,
                session_log: Some(SessionLog {
                    status: SESSION_START,
                }),
                ..Default::default()
            })?;
        }
        Ok(writer)
    }

    /// The event file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Logs `scalars` (tag, value) at `step`, flushed so that TensorBoard sees them at once.
    pub fn scalars(&mut self, step: usize, scalars: &[(String, f64)]) -> Result<()> {
        let value = scalars
            .iter()
            .map(|(tag, v)| SummaryValue {
                tag: tag.clone(),
                simple_value: Some(*v as f32),
            })
            .collect();
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            summary: Some(Summary { value }),
            ..Default::default()
        })
    }

    fn write(&mut self, event: &Event) -> Result<()> {
        let data = event.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc(&len).to_le_bytes());
        record.extend_from_slice(&data);
        record.extend_from_slice(&masked_crc(&data).to_le_bytes());
        // One write per record: a kill leaves at most a torn last record, which readers skip.
        self.file
            .write_all(&record)
            .and_then(|()| self.file.flush())
            .map_err(TrainError::io("write", &self.path))
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// TFRecord's checksum: CRC-32C, rotated and offset so that a checksum of checksums is not trivial.
fn masked_crc(bytes: &[u8]) -> u32 {
    const CRC32C: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);
    let c = CRC32C.checksum(bytes);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// The events of the file `path`, checksums verified; a torn last record (a killed writer) ends the
/// list.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let file = std::fs::File::open(path).map_err(TrainError::io("open", path))?;
    let mut reader = BufReader::new(file);
    let corrupt = |what: &str| {
        TrainError::data(
            path.display(),
            format!("not a TensorBoard event file ({what})"),
        )
    };
    let mut events = Vec::new();
    loop {
        let mut head = [0u8; 12];
        match read_full(&mut reader, &mut head).map_err(TrainError::io("read", path))? {
            0 => return Ok(events),
            12 => {}
            _ => return Ok(events),
        }
        let (len, len_crc) = head.split_at(8);
        if masked_crc(len).to_le_bytes() != len_crc {
            return Err(corrupt("a record length's checksum differs"));
        }
        let len = u64::from_le_bytes(len.try_into().map_err(|_| corrupt("length"))?) as usize;
        let mut body = vec![0u8; len + 4];
        if read_full(&mut reader, &mut body).map_err(TrainError::io("read", path))? < body.len() {
            return Ok(events);
        }
        let (data, data_crc) = body.split_at(len);
        if masked_crc(data).to_le_bytes() != data_crc {
            return Err(corrupt("a record's checksum differs"));
        }
        events.push(Event::decode(data).map_err(|e| corrupt(&e.to_string()))?);
    }
}

/// Reads until `buf` is full or the file ends; the bytes read.
fn read_full(reader: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    Ok(filled)
}

/// The scalars of a run directory's event files as TensorBoard shows them: `(tag, step, value)` in
/// file and write order, a `SessionLog START` at step `s` dropping what came before it at `s` or after.
pub fn read_scalars(dir: &Path) -> Result<Vec<(String, i64, f32)>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(TrainError::io("read", dir))?
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(is_event_file))
        .map(|e| e.path())
        .collect();
    files.sort();
    let mut scalars: Vec<(String, i64, f32)> = Vec::new();
    for file in files {
        for event in read_events(&file)? {
            if event
                .session_log
                .as_ref()
                .is_some_and(|s| s.status == SESSION_START)
            {
                scalars.retain(|(_, step, _)| *step < event.step);
            }
            for v in event.summary.into_iter().flat_map(|s| s.value) {
                if let Some(x) = v.simple_value {
                    scalars.push((v.tag, event.step, x));
                }
            }
        }
    }
    Ok(scalars)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_matches_tensorflow() {
        // CRC-32C("123456789") = 0xe3069283 (the catalogue's check value), masked as TFRecord does.
        let c: u32 = 0xe306_9283;
        assert_eq!(
            masked_crc(b"123456789"),
            c.rotate_right(15).wrapping_add(0xa282_ead8)
        );
    }

    #[test]
    fn scalars_round_trip_and_a_resume_drops_the_replaced_steps() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path(), 0, true).unwrap();
        for step in 1..=4 {
            w.scalars(step, &[("train/loss".into(), step as f64)])
                .unwrap();
        }
        drop(w);
        // Resumed from step 2: steps 3 and 4 are trained again.
        let mut w = EventWriter::create(dir.path(), 2, false).unwrap();
        w.scalars(3, &[("train/loss".into(), 30.0)]).unwrap();
        let got = read_scalars(dir.path()).unwrap();
        let want: Vec<(String, i64, f32)> = vec![
            ("train/loss".into(), 1, 1.0),
            ("train/loss".into(), 2, 2.0),
            ("train/loss".into(), 3, 30.0),
        ];
        assert_eq!(got, want);
        // A fresh run clears the directory's event files.
        let w = EventWriter::create(dir.path(), 0, true).unwrap();
        assert_eq!(read_scalars(dir.path()).unwrap(), vec![]);
        assert!(w.path().exists());
    }

    /// Files written by TensorBoard's own writer (scripts/make_tensorboard_fixture.py) read as
    /// TensorBoard's EventAccumulator reads them: the same scalars, and the resumed run's
    /// `SessionLog START` at step 3 dropping the first run's steps 3 and 4.
    #[test]
    fn reads_tensorboards_own_files_as_tensorboard_does() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tensorboard");
        let got = read_scalars(&dir).unwrap();
        let want: Vec<(String, i64, f32)> = vec![
            ("eval/loss".into(), 0, 5.0),
            ("train/loss".into(), 1, 1.0),
            ("train/loss".into(), 2, 2.0),
            ("train/loss".into(), 3, 30.0),
            ("train/loss".into(), 4, 40.0),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn a_damaged_record_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path(), 0, true).unwrap();
        w.scalars(1, &[("train/loss".into(), 1.0)]).unwrap();
        let path = w.path().to_path_buf();
        drop(w);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 6;
        bytes[last] ^= 0xff;
        std::fs::write(&path, bytes).unwrap();
        let err = read_events(&path).unwrap_err().to_string();
        assert!(err.contains("checksum"), "{err}");
    }
}
