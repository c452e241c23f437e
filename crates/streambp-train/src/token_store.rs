//! Training items on disk, read back through memory maps, so that a multi-GB data set trains in
//! bounded memory: a loader streams rows into a writer (one item in memory at a time), and a step
//! reads its items back by index. The pages belong to the OS's page cache, shared and dropped under
//! pressure, not to the process's heap.
//!
//! A store is a directory of columns, each a file of little-endian values concatenated over the
//! items, and `offsets` (u64): where each item starts in the columns (in elements), with the total at
//! the end. [`TokenStore`] holds tokenized examples (`input_ids` u32, `labels` i64, `position_ids`
//! u32; SFT's examples, DPO's pairs as two examples each); [`RecordStore`] holds any serializable
//! item as JSON bytes (GRPO's prompts with the data rows their rewards read).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::checkpoint::{identity, Digest, Fingerprint};
use crate::data::{pack_plan, Example};
use crate::{Result, TrainError};

/// Where examples go as a loader makes them: a vector in memory, or a [`StoreWriter`] on disk.
pub trait ExampleSink {
    /// Takes one example.
    fn push(&mut self, example: Example) -> Result<()>;
    /// How many examples it holds.
    fn count(&self) -> usize;
}

impl ExampleSink for Vec<Example> {
    fn push(&mut self, example: Example) -> Result<()> {
        Vec::push(self, example);
        Ok(())
    }

    fn count(&self) -> usize {
        self.len()
    }
}

/// A store's directory: removed (after its maps, which are declared before it) when dropped.
struct ScratchDir(PathBuf);

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            tracing::warn!(dir = %self.0.display(), error = %e, "could not remove a data store");
        }
    }
}

/// The columns of a store being written; the last column is always `offsets`.
struct Columns {
    names: &'static [&'static str],
    files: Vec<BufWriter<File>>,
    /// Elements of the first column so far: the next item's offset.
    end: u64,
    count: usize,
    fingerprint: Fingerprint,
    dir: ScratchDir,
}

impl Columns {
    /// A store with `names` columns (`offsets` last) in the new directory `dir`.
    fn create(dir: &Path, names: &'static [&'static str]) -> Result<Self> {
        std::fs::create_dir(dir).map_err(TrainError::io("create", dir))?;
        let dir = ScratchDir(dir.to_path_buf());
        let files = names
            .iter()
            .map(|name| {
                let path = dir.0.join(name);
                File::create(&path)
                    .map(BufWriter::new)
                    .map_err(TrainError::io("create", &path))
            })
            .collect::<Result<_>>()?;
        let mut columns = Self {
            names,
            files,
            end: 0,
            count: 0,
            fingerprint: Fingerprint::default(),
            dir,
        };
        columns.write(names.len() - 1, &0u64.to_le_bytes())?;
        Ok(columns)
    }

    fn write(&mut self, column: usize, bytes: &[u8]) -> Result<()> {
        let path = self.dir.0.join(self.names[column]);
        self.files[column]
            .write_all(bytes)
            .map_err(TrainError::io("write", &path))
    }

    /// One item: its bytes in each data column, `elements` long in each; `digest` its content.
    fn push(&mut self, columns: &[&[u8]], elements: usize, digest: &impl Digest) -> Result<()> {
        for (k, bytes) in columns.iter().enumerate() {
            self.write(k, bytes)?;
        }
        self.end += elements as u64;
        self.write(self.names.len() - 1, &self.end.to_le_bytes())?;
        digest.digest(&mut self.fingerprint);
        self.count += 1;
        Ok(())
    }

    /// Flushes and maps every column.
    fn finish(mut self) -> Result<Mapped> {
        let dir = self.dir.0.clone();
        for (file, name) in self.files.iter_mut().zip(self.names) {
            file.flush()
                .map_err(TrainError::io("write", &dir.join(name)))?;
        }
        let maps = self
            .names
            .iter()
            .map(|name| {
                let path = dir.join(name);
                let file = File::open(&path).map_err(TrainError::io("open", &path))?;
                if file.metadata().map(|m| m.len()).unwrap_or(0) == 0 {
                    return Ok(None);
                }
                // SAFETY: the store's files are this process's own, in a directory only it writes,
                // and are not changed while mapped (only removed, after the maps are gone).
                unsafe { Mmap::map(&file) }
                    .map(Some)
                    .map_err(TrainError::io("map", &path))
            })
            .collect::<Result<_>>()?;
        Ok(Mapped {
            maps,
            count: self.count,
            identity: identity(self.count, &self.fingerprint),
            _dir: self.dir,
        })
    }
}

/// A finished store's columns, mapped: what [`TokenStore`] and [`RecordStore`] share.
pub struct Mapped {
    maps: Vec<Option<Mmap>>,
    count: usize,
    identity: serde_json::Value,
    /// Declared last: removed after the maps are dropped.
    _dir: ScratchDir,
}

impl Mapped {
    /// The number of items.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether it holds no item.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The record of the items for a checkpoint: their number and fingerprint, as
    /// [`crate::checkpoint::data_identity`] gives for the same items in memory.
    pub fn identity(&self) -> &serde_json::Value {
        &self.identity
    }

    /// Elements `[from, to)` of `column`, `width` bytes each (empty for an empty column).
    fn bytes(&self, column: usize, width: usize, from: usize, to: usize) -> &[u8] {
        self.maps[column]
            .as_deref()
            .map_or(&[], |m| &m[from * width..to * width])
    }

    /// Where item `i` starts and ends in the data columns.
    fn span(&self, i: usize) -> (usize, usize) {
        let offsets = self.maps.len() - 1;
        let at = |k: usize| u64_at(self.bytes(offsets, 8, k, k + 1)) as usize;
        (at(i), at(i + 1))
    }
}

fn u64_at(bytes: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(b)
}

fn u32s(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

const EXAMPLE_COLUMNS: &[&str] = &["input_ids", "labels", "position_ids", "offsets"];

/// Writes examples into a new store directory; [`StoreWriter::finish`] maps it for reading.
pub struct StoreWriter(Columns);

impl StoreWriter {
    /// A store in the new directory `dir` (which must not exist: a store is written once).
    pub fn create(dir: &Path) -> Result<Self> {
        Columns::create(dir, EXAMPLE_COLUMNS).map(Self)
    }

    /// Maps the finished store for reading; it is removed from disk when dropped.
    pub fn finish(self) -> Result<TokenStore> {
        self.0.finish().map(TokenStore)
    }
}

impl ExampleSink for StoreWriter {
    fn push(&mut self, example: Example) -> Result<()> {
        let ids: Vec<u8> = example
            .input_ids
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect();
        let labels: Vec<u8> = example
            .labels
            .iter()
            .flat_map(|l| l.to_le_bytes())
            .collect();
        let positions: Vec<u8> = example
            .position_ids
            .iter()
            .flat_map(|p| p.to_le_bytes())
            .collect();
        let tokens = example.input_ids.len();
        self.0.push(&[&ids, &labels, &positions], tokens, &example)
    }

    fn count(&self) -> usize {
        self.0.count
    }
}

/// Examples read from disk by index; the directory is removed when the store is dropped.
pub struct TokenStore(Mapped);

impl std::ops::Deref for TokenStore {
    type Target = Mapped;

    fn deref(&self) -> &Mapped {
        &self.0
    }
}

impl TokenStore {
    /// Example `i`'s length in tokens.
    pub fn tokens(&self, i: usize) -> usize {
        let (from, to) = self.0.span(i);
        to - from
    }

    /// Example `i` (an index below [`Mapped::len`]), copied out of the maps.
    pub fn get(&self, i: usize) -> Example {
        let (from, to) = self.0.span(i);
        Example {
            input_ids: u32s(self.0.bytes(0, 4, from, to)),
            labels: self
                .0
                .bytes(1, 8, from, to)
                .chunks_exact(8)
                .map(|b| u64_at(b) as i64)
                .collect(),
            position_ids: u32s(self.0.bytes(2, 4, from, to)),
        }
    }

    /// The examples packed into rows of at most `max_length` tokens ([`crate::data::pack`]'s rows,
    /// in its order), as a new store in `dir`. Only the examples' lengths are held in memory.
    pub fn packed(&self, max_length: usize, dir: &Path) -> Result<TokenStore> {
        let lengths: Vec<usize> = (0..self.len()).map(|i| self.tokens(i)).collect();
        let mut writer = StoreWriter::create(dir)?;
        for members in pack_plan(&lengths, max_length) {
            writer.push(Example::join(members.into_iter().map(|i| self.get(i))))?;
        }
        writer.finish()
    }
}

const RECORD_COLUMNS: &[&str] = &["records", "offsets"];

/// Writes items as JSON into a new store directory; [`RecordWriter::finish`] maps it for reading.
pub struct RecordWriter(Columns);

impl RecordWriter {
    /// A store in the new directory `dir` (which must not exist).
    pub fn create(dir: &Path) -> Result<Self> {
        Columns::create(dir, RECORD_COLUMNS).map(Self)
    }

    /// Appends `item`.
    pub fn push<T: Serialize + Digest>(&mut self, item: &T) -> Result<()> {
        let json = serde_json::to_vec(item)
            .map_err(|e| TrainError::Internal(format!("a record for the data store: {e}")))?;
        self.0.push(&[&json], json.len(), item)
    }

    /// How many items it holds.
    pub fn count(&self) -> usize {
        self.0.count
    }

    /// Maps the finished store for reading; it is removed from disk when dropped.
    pub fn finish(self) -> Result<RecordStore> {
        self.0.finish().map(RecordStore)
    }
}

/// Items read from disk by index; the directory is removed when the store is dropped.
pub struct RecordStore(Mapped);

impl std::ops::Deref for RecordStore {
    type Target = Mapped;

    fn deref(&self) -> &Mapped {
        &self.0
    }
}

impl RecordStore {
    /// Item `i` (an index below [`Mapped::len`]).
    pub fn get<T: DeserializeOwned>(&self, i: usize) -> Result<T> {
        let (from, to) = self.0.span(i);
        serde_json::from_slice(self.0.bytes(0, 1, from, to))
            .map_err(|e| TrainError::Internal(format!("item {i} of the data store: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::data_identity;
    use crate::data::pack;
    use streambp_objectives::IGNORE_INDEX;

    fn examples() -> Vec<Example> {
        (0..7u32)
            .map(|n| {
                let ids: Vec<u32> = (0..n % 4 + 1).map(|t| 10 * n + t).collect();
                let labels = ids
                    .iter()
                    .enumerate()
                    .map(|(k, &t)| if k % 2 == 0 { IGNORE_INDEX } else { t as i64 })
                    .collect();
                Example::new(ids, labels)
            })
            .collect()
    }

    #[test]
    fn gives_back_what_was_stored_and_packs_as_in_memory() {
        let tmp = tempfile::tempdir().unwrap();
        let mut writer = StoreWriter::create(&tmp.path().join("store")).unwrap();
        for e in examples() {
            writer.push(e).unwrap();
        }
        let store = writer.finish().unwrap();
        assert_eq!(store.len(), 7);
        let back: Vec<Example> = (0..7).map(|i| store.get(i)).collect();
        assert_eq!(back, examples());
        assert_eq!(store.identity(), &data_identity(&examples()));

        let packed = store.packed(6, &tmp.path().join("packed")).unwrap();
        let want = pack(examples(), 6);
        let got: Vec<Example> = (0..packed.len()).map(|i| packed.get(i)).collect();
        assert_eq!(got, want);
        assert_eq!(packed.identity(), &data_identity(&want));
        drop((store, packed));
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0, "removed");
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Item {
        ids: Vec<u32>,
        text: String,
    }

    impl Digest for Item {
        fn digest(&self, into: &mut Fingerprint) {
            into.numbers(self.ids.iter().map(|&t| i64::from(t)));
            into.bytes(self.text.as_bytes());
        }
    }

    #[test]
    fn records_come_back_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let items: Vec<Item> = (0..5)
            .map(|i| Item {
                ids: (0..i).collect(),
                text: "é".repeat(i as usize),
            })
            .collect();
        let mut writer = RecordWriter::create(&tmp.path().join("records")).unwrap();
        for item in &items {
            writer.push(item).unwrap();
        }
        let store = writer.finish().unwrap();
        let back: Vec<Item> = (0..store.len()).map(|i| store.get(i).unwrap()).collect();
        assert_eq!(back, items);
        assert_eq!(store.identity(), &data_identity(&items));
    }

    #[test]
    fn an_empty_store_maps() {
        let tmp = tempfile::tempdir().unwrap();
        let store = StoreWriter::create(&tmp.path().join("s"))
            .unwrap()
            .finish()
            .unwrap();
        assert!(store.is_empty());
    }
}
