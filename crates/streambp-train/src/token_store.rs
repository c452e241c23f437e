//! Tokenized examples on disk, read back through memory maps, so that a multi-GB data set trains in
//! bounded memory: the loader streams rows into a [`StoreWriter`] (one example in memory at a time),
//! and a step reads its examples from the [`TokenStore`] by index. The pages belong to the OS's page
//! cache, shared and dropped under pressure, not to the process's heap.
//!
//! Layout, in a directory of its own: `input_ids` (u32), `labels` (i64), `position_ids` (u32), all
//! little-endian and concatenated over examples, and `offsets` (u64): where each example starts, in
//! tokens, with the total at the end.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::checkpoint::Fingerprint;
use crate::data::{pack_plan, Example};
use crate::{Result, TrainError};

const FILES: [&str; 4] = ["input_ids", "labels", "position_ids", "offsets"];

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

/// Writes examples into a new store directory; [`StoreWriter::finish`] maps it for reading.
pub struct StoreWriter {
    dir: PathBuf,
    files: Vec<BufWriter<File>>,
    tokens: u64,
    count: usize,
    fingerprint: Fingerprint,
}

impl StoreWriter {
    /// A store in the new directory `dir` (which must not exist: a store is written once).
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir(dir).map_err(TrainError::io("create", dir))?;
        let files = FILES
            .iter()
            .map(|name| {
                let path = dir.join(name);
                File::create(&path)
                    .map(BufWriter::new)
                    .map_err(TrainError::io("create", &path))
            })
            .collect::<Result<_>>()?;
        let mut writer = Self {
            dir: dir.to_path_buf(),
            files,
            tokens: 0,
            count: 0,
            fingerprint: Fingerprint::default(),
        };
        writer.write(3, &0u64.to_le_bytes())?;
        Ok(writer)
    }

    fn write(&mut self, file: usize, bytes: &[u8]) -> Result<()> {
        let path = self.dir.join(FILES[file]);
        self.files[file]
            .write_all(bytes)
            .map_err(TrainError::io("write", &path))
    }

    /// Maps the finished store for reading; it is removed from disk when dropped.
    pub fn finish(mut self) -> Result<TokenStore> {
        for (file, name) in self.files.iter_mut().zip(FILES) {
            file.flush()
                .map_err(TrainError::io("write", &self.dir.join(name)))?;
        }
        let identity = crate::checkpoint::identity(self.count, &self.fingerprint);
        let map = |name: &str| -> Result<Option<Mmap>> {
            let path = self.dir.join(name);
            let file = File::open(&path).map_err(TrainError::io("open", &path))?;
            if file.metadata().map(|m| m.len()).unwrap_or(0) == 0 {
                return Ok(None);
            }
            // SAFETY: the store's files are this process's own, in a directory only it writes, and
            // are not changed while mapped (they are only ever removed, after the maps are gone).
            unsafe { Mmap::map(&file) }
                .map(Some)
                .map_err(TrainError::io("map", &path))
        };
        Ok(TokenStore {
            input_ids: map(FILES[0])?,
            labels: map(FILES[1])?,
            position_ids: map(FILES[2])?,
            offsets: map(FILES[3])?,
            count: self.count,
            identity,
            dir: self.dir.clone(),
        })
    }
}

impl ExampleSink for StoreWriter {
    fn push(&mut self, example: Example) -> Result<()> {
        use crate::checkpoint::Digest;
        example.digest(&mut self.fingerprint);
        let (ids, labels, positions) = (
            example.input_ids.iter().flat_map(|t| t.to_le_bytes()),
            example.labels.iter().flat_map(|l| l.to_le_bytes()),
            example.position_ids.iter().flat_map(|p| p.to_le_bytes()),
        );
        let (ids, labels, positions): (Vec<u8>, Vec<u8>, Vec<u8>) =
            (ids.collect(), labels.collect(), positions.collect());
        self.write(0, &ids)?;
        self.write(1, &labels)?;
        self.write(2, &positions)?;
        self.tokens += example.input_ids.len() as u64;
        self.write(3, &self.tokens.to_le_bytes())?;
        self.count += 1;
        Ok(())
    }

    fn count(&self) -> usize {
        self.count
    }
}

/// Examples read from disk by index; the directory is removed when the store is dropped.
pub struct TokenStore {
    input_ids: Option<Mmap>,
    labels: Option<Mmap>,
    position_ids: Option<Mmap>,
    offsets: Option<Mmap>,
    count: usize,
    identity: serde_json::Value,
    dir: PathBuf,
}

/// Bytes `[from, to)` (in elements of `width` bytes) of a map, empty for an empty file.
fn slice(map: &Option<Mmap>, width: usize, from: usize, to: usize) -> &[u8] {
    map.as_deref().map_or(&[], |m| &m[from * width..to * width])
}

fn u32s(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn u64_at(bytes: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(b)
}

impl TokenStore {
    /// The number of examples.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether it holds no example.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The record of the examples for a checkpoint: their number and fingerprint, as
    /// [`crate::checkpoint::data_identity`] gives for the same examples in memory.
    pub fn identity(&self) -> &serde_json::Value {
        &self.identity
    }

    fn span(&self, i: usize) -> (usize, usize) {
        let at = |k: usize| u64_at(slice(&self.offsets, 8, k, k + 1)) as usize;
        (at(i), at(i + 1))
    }

    /// Example `i`'s length in tokens.
    pub fn tokens(&self, i: usize) -> usize {
        let (from, to) = self.span(i);
        to - from
    }

    /// Example `i` (an index below [`TokenStore::len`]), copied out of the maps.
    pub fn get(&self, i: usize) -> Example {
        let (from, to) = self.span(i);
        Example {
            input_ids: u32s(slice(&self.input_ids, 4, from, to)),
            labels: slice(&self.labels, 8, from, to)
                .chunks_exact(8)
                .map(|b| u64_at(b) as i64)
                .collect(),
            position_ids: u32s(slice(&self.position_ids, 4, from, to)),
        }
    }

    /// The examples packed into rows of at most `max_length` tokens ([`crate::data::pack`]'s rows,
    /// in its order), as a new store in `dir`. Only the examples' lengths are held in memory.
    pub fn packed(&self, max_length: usize, dir: &Path) -> Result<TokenStore> {
        let lengths: Vec<usize> = (0..self.count).map(|i| self.tokens(i)).collect();
        let mut writer = StoreWriter::create(dir)?;
        for members in pack_plan(&lengths, max_length) {
            writer.push(Example::join(members.into_iter().map(|i| self.get(i))))?;
        }
        writer.finish()
    }
}

impl Drop for TokenStore {
    fn drop(&mut self) {
        // Unmapped first (the fields go after this body runs, so take them now).
        for map in [
            &mut self.input_ids,
            &mut self.labels,
            &mut self.position_ids,
            &mut self.offsets,
        ] {
            map.take();
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "could not remove tokenized data");
        }
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
