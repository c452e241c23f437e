//! Where the rows of a data set come from. TRL users name a data set, not a file: `--data` takes a
//! JSONL file, a JSON array file, a Parquet file, a directory of shards, or a Hugging Face hub dataset
//! id (`owner/name`), with `--split` and `--data-config` choosing its files as `datasets.load_dataset`
//! does. Rows are read shard by shard and row group by row group, never a whole file at once (a JSON
//! array excepted), and an error names the shard and its line (JSONL) or row (Parquet, JSON array).

mod hub;
mod json_array;
mod parquet_rows;
mod splits;

use std::fmt;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::data::Row;
use crate::{Result, TrainError};

pub use hub::looks_like_id as looks_like_hub_id;
pub use splits::select_split;

/// How a shard is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One JSON object per line.
    Jsonl,
    /// A JSON array of objects (a `.json` file that starts with `[`; otherwise `.json` is read as
    /// JSON Lines, as `datasets` does).
    JsonArray,
    /// Apache Parquet (what the hub stores data sets as).
    Parquet,
}

impl Format {
    /// The format of a data file by its name (and, for `.json`, its first character); `None` for a
    /// file that holds no rows (a README, `.gitattributes`).
    pub fn of(path: &Path) -> Result<Option<Self>> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        Ok(match ext.as_deref() {
            Some("jsonl") => Some(Self::Jsonl),
            Some("parquet") => Some(Self::Parquet),
            Some("json") => Some(match first_char(path)? {
                Some('[') => Self::JsonArray,
                _ => Self::Jsonl,
            }),
            _ => None,
        })
    }
}

/// The UTF-8 byte-order mark.
const BOM: char = '\u{feff}';

/// The first non-blank character of a file (after a byte-order mark).
fn first_char(path: &Path) -> Result<Option<char>> {
    let file = std::fs::File::open(path).map_err(TrainError::io("read", path))?;
    let mut reader = std::io::BufReader::new(file);
    loop {
        let buf = reader.fill_buf().map_err(TrainError::io("read", path))?;
        if buf.is_empty() {
            return Ok(None);
        }
        let n = buf.len();
        let text = buf.strip_prefix(BOM.to_string().as_bytes()).unwrap_or(buf);
        if let Some(&b) = text.iter().find(|b| !b.is_ascii_whitespace()) {
            return Ok(Some(b as char));
        }
        reader.consume(n);
    }
}

/// One file of a data set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// Its local path (in the hub cache for a hub data set).
    pub path: PathBuf,
    /// How it is stored.
    pub format: Format,
}

/// The rows of one split of a data set: its shards, in order.
#[derive(Debug, Clone)]
pub struct DataSource {
    name: String,
    shards: Vec<Shard>,
}

impl DataSource {
    /// One local data file.
    pub fn file(path: &Path) -> Result<Self> {
        let format = Format::of(path)?.ok_or_else(|| {
            TrainError::data(
                path.display(),
                "not a data file: expected .jsonl, .json or .parquet",
            )
        })?;
        Ok(Self {
            name: path.display().to_string(),
            shards: vec![Shard {
                path: path.to_path_buf(),
                format,
            }],
        })
    }

    /// `spec` as `--data` takes it: a file, a directory of shards or a hub dataset id; for a directory
    /// or a hub id, the files of `split` (and of `config`, where the data set has several).
    pub fn resolve(spec: &Path, split: &str, config: Option<&str>) -> Result<Self> {
        if spec.is_file() {
            return Self::file(spec);
        }
        // A device or a named pipe is no data set (reading one could fill the memory or block).
        if spec.exists() && !spec.is_dir() {
            let why = crate::input_file::check(spec, u64::MAX);
            let why = why.unwrap_or_else(|| "not a data file".into());
            return Err(TrainError::data(spec.display(), why));
        }
        let (name, chosen) = if spec.is_dir() {
            let name = spec.display().to_string();
            let chosen = select_split(&local_files(spec)?, split, config)
                .map_err(|why| TrainError::data(&name, why))?;
            (name, chosen)
        } else {
            let id = spec.to_string_lossy();
            (
                format!("hub dataset {id}"),
                hub::dataset_files(&id, split, config)?,
            )
        };
        let mut shards = Vec::new();
        for (relative, path) in chosen {
            if let Some(format) = Format::of(&path)? {
                shards.push(Shard { path, format });
            } else {
                tracing::debug!(file = relative.as_str(), "not a data file, skipped");
            }
        }
        if shards.is_empty() {
            return Err(TrainError::data(
                &name,
                format!("no .jsonl, .json or .parquet file for split {split:?}"),
            ));
        }
        let name = match config {
            Some(c) => format!("{name} ({c}, split {split})"),
            None => format!("{name} (split {split})"),
        };
        tracing::info!(data = name.as_str(), shards = shards.len(), "data files");
        Ok(Self { name, shards })
    }

    /// What the data is called in messages: the file, or the data set and its split.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its shards.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// Its rows in order, each with where it is; a data set without any row is an error at the end.
    pub fn rows(&self) -> Rows<'_> {
        Rows {
            source: self,
            next_shard: 0,
            current: None,
            seen: 0,
            done: false,
        }
    }
}

/// Every file under `dir` (relative path with `/`, full path), sorted, hidden ones left out.
fn local_files(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).map_err(TrainError::io("read", &d))? {
            let path = entry.map_err(TrainError::io("read", &d))?.path();
            let hidden = path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'));
            if hidden {
                continue;
            }
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(rel) = path.strip_prefix(dir) {
                let rel: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                out.push((rel.join("/"), path.clone()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Where a row is: its shard and its line (JSONL, from 1) or row index (Parquet and JSON arrays, from
/// 0, as `dataset[i]` counts).
#[derive(Debug, Clone)]
pub struct Location {
    file: Arc<PathBuf>,
    at: At,
}

#[derive(Debug, Clone, Copy)]
enum At {
    Line(usize),
    Row(usize),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            At::Line(n) => write!(f, "{} line {n}", self.file.display()),
            At::Row(n) => write!(f, "{} row {n}", self.file.display()),
        }
    }
}

/// The rows of a [`DataSource`], shard after shard.
pub struct Rows<'a> {
    source: &'a DataSource,
    next_shard: usize,
    current: Option<ShardRows>,
    seen: usize,
    done: bool,
}

/// The rows left in one shard.
enum ShardRows {
    Jsonl {
        file: Arc<PathBuf>,
        lines: std::io::Split<std::io::BufReader<std::fs::File>>,
        line: usize,
    },
    Array {
        file: Arc<PathBuf>,
        rows: std::iter::Enumerate<json_array::ArrayElements>,
    },
    Parquet(parquet_rows::ParquetRows),
}

impl ShardRows {
    fn open(shard: &Shard) -> Result<Self> {
        let file = Arc::new(shard.path.clone());
        let open = || std::fs::File::open(&shard.path).map_err(TrainError::io("read", &shard.path));
        Ok(match shard.format {
            Format::Jsonl => Self::Jsonl {
                lines: std::io::BufReader::new(open()?).split(b'\n'),
                file,
                line: 0,
            },
            Format::JsonArray => Self::Array {
                rows: json_array::ArrayElements::start(open()?).enumerate(),
                file,
            },
            Format::Parquet => Self::Parquet(parquet_rows::ParquetRows::open(&shard.path)?),
        })
    }

    /// The next row of the shard, `None` at its end.
    fn next_row(&mut self) -> Option<Result<(Location, Row)>> {
        match self {
            Self::Jsonl { file, lines, line } => loop {
                let bytes = lines.next()?;
                *line += 1;
                let at = Location {
                    file: file.clone(),
                    at: At::Line(*line),
                };
                let bytes = match bytes {
                    Ok(b) => b,
                    Err(error) => {
                        return Some(Err(TrainError::Io {
                            action: "read",
                            path: file.as_ref().clone(),
                            error,
                        }))
                    }
                };
                let text = match std::str::from_utf8(&bytes) {
                    Ok(t) => t,
                    Err(e) => {
                        return Some(Err(TrainError::data(
                            at,
                            format!("not valid UTF-8 (at byte {} of the line)", e.valid_up_to()),
                        )))
                    }
                };
                // A UTF-8 byte-order mark (Windows tools write one) is no part of the data, as
                // Python's utf-8-sig readers and `datasets` take it.
                let text = match *line {
                    1 => text.strip_prefix(BOM).unwrap_or(text),
                    _ => text,
                };
                if text.trim().is_empty() {
                    continue;
                }
                return Some(match serde_json::from_str(text) {
                    Ok(serde_json::Value::Object(o)) => Ok((at, o)),
                    Ok(_) => Err(TrainError::data(at, "expected a JSON object")),
                    // Lines ended by a bare carriage return (classic Mac OS) read as one line.
                    Err(_) if text.trim_end().contains('\r') => Err(TrainError::data(
                        at,
                        "several JSON lines separated by a bare carriage return (\\r): JSONL \
                         lines end with \\n (or \\r\\n); convert the line ends",
                    )),
                    Err(e) => Err(TrainError::data(at, format!("not valid JSON: {e}"))),
                });
            },
            Self::Array { file, rows } => {
                let (i, value) = rows.next()?;
                let at = Location {
                    file: file.clone(),
                    at: At::Row(i),
                };
                Some(match value {
                    Ok(serde_json::Value::Object(o)) => Ok((at, o)),
                    Ok(_) => Err(TrainError::data(at, "expected a JSON object")),
                    Err(e) => Err(TrainError::data(
                        file.display(),
                        format!("not a valid JSON array (at row {i}): {e}"),
                    )),
                })
            }
            Self::Parquet(rows) => rows.next(),
        }
    }
}

impl Iterator for Rows<'_> {
    type Item = Result<(Location, Row)>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.done {
                return None;
            }
            if let Some(row) = self.current.as_mut().and_then(ShardRows::next_row) {
                if row.is_err() {
                    self.done = true;
                }
                self.seen += 1;
                return Some(row);
            }
            let Some(shard) = self.source.shards.get(self.next_shard) else {
                self.done = true;
                return (self.seen == 0)
                    .then(|| Err(TrainError::data(&self.source.name, "holds no examples")));
            };
            self.next_shard += 1;
            match ShardRows::open(shard) {
                Ok(rows) => self.current = Some(rows),
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
    }
}
