//! Where phase 1's stored checkpoints wait for the layers' backward: the model's device (the
//! default), host memory (`offload_checkpoints`), or a scratch file on disk (`checkpoint_dir`).
//!
//! They are pushed in layer order and popped in reverse, so the disk tier is one file written front
//! to back and read back to front; while a checkpoint's layers run their backward, the one before it
//! is read on a thread of its own (one checkpoint's bytes more in memory, the disk's time hidden),
//! into the host buffer the forward wrote through (pinned for a CUDA card: `host_buffer`). The file
//! is reserved at its full size before the forward writes
//! anything (a full disk is an error naming the directory and the bytes, before any work is lost),
//! and unlinked as soon as it is created: the kernel frees its blocks when the step ends or the
//! process dies, even by `kill -9`, so no scratch file is ever left behind.

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Shape, Tensor};

use super::host_buffer::HostBuffer;
use crate::error::{EngineError, Result};

/// Bytes a step's checkpoints moved to and from disk, and the seconds that took.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CheckpointIo {
    /// Bytes written in the forward.
    pub written: u64,
    /// Bytes read back in the backward.
    pub read: u64,
    /// Seconds spent writing and reading (converting to and from bytes included).
    pub seconds: f64,
}

/// The stored checkpoints of one backward, in push order.
pub(super) struct CheckpointStore {
    place: Place,
    entries: Vec<Entry>,
    io: CheckpointIo,
}

enum Place {
    /// Kept as they are, where they were made.
    Device,
    /// Copied to host memory.
    Host,
    /// Written to this file (unlinked), `next` bytes in, through `buffer` (lent to the read ahead
    /// of the next entry to pop while it runs).
    Disk {
        file: std::fs::File,
        next: u64,
        buffer: Option<HostBuffer>,
        ahead: Option<ReadAhead>,
    },
}

/// An entry's bytes being read on a thread of its own, into the store's buffer.
struct ReadAhead {
    offset: u64,
    bytes: std::thread::JoinHandle<std::io::Result<HostBuffer>>,
}

impl ReadAhead {
    /// The buffer, once the read is done.
    fn finish(self) -> Result<HostBuffer> {
        self.bytes
            .join()
            .map_err(|_| EngineError::CheckpointIo("the read-ahead panicked".into()))?
            .map_err(|e| EngineError::CheckpointIo(format!("reading ahead: {e}")))
    }
}

enum Entry {
    Tensor(Tensor),
    OnDisk {
        offset: u64,
        bytes: usize,
        shape: Shape,
        dtype: DType,
    },
}

impl CheckpointStore {
    /// A store for `count` tensors shaped like `like` (`[b, T, d]`): on disk in `dir` when given
    /// (reserving `count` tensors' bytes now), else in host memory when `host`, else where they are.
    pub(super) fn new(dir: Option<&Path>, host: bool, count: usize, like: &Tensor) -> Result<Self> {
        let place = match dir {
            Some(dir) => {
                let bytes = (count * like.elem_count() * like.dtype().size_in_bytes()) as u64;
                Place::Disk {
                    file: scratch_file(dir, bytes)?,
                    next: 0,
                    buffer: Some(HostBuffer::for_device(like.device())),
                    ahead: None,
                }
            }
            None if host => Place::Host,
            None => Place::Device,
        };
        Ok(Self {
            place,
            entries: Vec::with_capacity(count),
            io: CheckpointIo::default(),
        })
    }

    /// Stores `t` after those before it.
    pub(super) fn push(&mut self, t: &Tensor) -> Result<()> {
        let entry = match &mut self.place {
            Place::Device => Entry::Tensor(t.clone()),
            Place::Host => Entry::Tensor(t.to_device(&Device::Cpu)?),
            Place::Disk {
                file, next, buffer, ..
            } => {
                let start = Instant::now();
                let buffer = buffer.as_mut().ok_or_else(|| {
                    EngineError::CheckpointIo("a checkpoint stored while others are read".into())
                })?;
                let bytes = buffer.fill_from(t)?;
                write_at(file, bytes, *next)?;
                let entry = Entry::OnDisk {
                    offset: *next,
                    bytes: bytes.len(),
                    shape: t.shape().clone(),
                    dtype: t.dtype(),
                };
                *next += bytes.len() as u64;
                self.io.written += bytes.len() as u64;
                self.io.seconds += start.elapsed().as_secs_f64();
                entry
            }
        };
        self.entries.push(entry);
        Ok(())
    }

    /// The last tensor stored, on `device`, and removed from the store (`None` when empty).
    pub(super) fn pop(&mut self, device: &Device) -> Result<Option<Tensor>> {
        let Some(entry) = self.entries.pop() else {
            return Ok(None);
        };
        let t = match entry {
            Entry::Tensor(t) => t.to_device(device)?,
            Entry::OnDisk {
                offset,
                bytes,
                shape,
                dtype,
            } => {
                let Place::Disk {
                    file,
                    buffer: slot,
                    ahead,
                    ..
                } = &mut self.place
                else {
                    return Err(EngineError::CheckpointIo(
                        "a checkpoint on disk in a store without a file".into(),
                    ));
                };
                let start = Instant::now();
                let buffer = match ahead.take() {
                    Some(read) if read.offset == offset => read.finish()?,
                    other => {
                        let mut buffer = match other {
                            Some(read) => read.finish()?,
                            None => slot.take().ok_or_else(|| {
                                EngineError::CheckpointIo("the store's buffer is lost".into())
                            })?,
                        };
                        buffer.read_from(file, offset, bytes).map_err(|e| {
                            EngineError::CheckpointIo(format!("reading a checkpoint back: {e}"))
                        })?;
                        buffer
                    }
                };
                let t = buffer.to_tensor(dtype, &shape, device);
                *slot = Some(buffer);
                let t = t?;
                self.io.read += bytes as u64;
                self.io.seconds += start.elapsed().as_secs_f64();
                t
            }
        };
        self.read_ahead()?;
        Ok(Some(t))
    }

    /// Starts reading the next entry to pop, when it is on disk.
    fn read_ahead(&mut self) -> Result<()> {
        let (
            Place::Disk {
                file,
                buffer: slot,
                ahead,
                ..
            },
            Some(&Entry::OnDisk { offset, bytes, .. }),
        ) = (&mut self.place, self.entries.last())
        else {
            return Ok(());
        };
        let file = file
            .try_clone()
            .map_err(|e| EngineError::CheckpointIo(format!("reading ahead: {e}")))?;
        let Some(mut buffer) = slot.take() else {
            return Ok(());
        };
        let bytes = std::thread::spawn(move || {
            buffer.read_from(&file, offset, bytes)?;
            Ok(buffer)
        });
        *ahead = Some(ReadAhead { offset, bytes });
        Ok(())
    }

    /// What this store moved to and from disk so far.
    pub(super) fn io(&self) -> CheckpointIo {
        self.io
    }
}

/// A new file in `dir`, unlinked at once, with `bytes` reserved.
fn scratch_file(dir: &Path, bytes: u64) -> Result<std::fs::File> {
    let io_error = |what: &str, e: std::io::Error| EngineError::CheckpointDir {
        dir: dir.to_path_buf(),
        reason: format!("{what}: {e}"),
    };
    std::fs::create_dir_all(dir).map_err(|e| io_error("cannot create it", e))?;
    let file = tempfile::tempfile_in(dir).map_err(|e| io_error("cannot create a file in it", e))?;
    reserve(&file, bytes).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOSPC) => EngineError::CheckpointDir {
            dir: dir.to_path_buf(),
            reason: format!("not enough free space: this step's checkpoints need {bytes} bytes"),
        },
        _ => io_error(&format!("cannot reserve {bytes} bytes"), e),
    })?;
    Ok(file)
}

/// Allocates `bytes` of `file`'s blocks now (not a sparse file that fails when written).
fn reserve(file: &std::fs::File, bytes: u64) -> std::io::Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: the descriptor is open for the call's duration (`file` is borrowed).
        let code = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, bytes as libc::off_t) };
        match code {
            0 => Ok(()),
            // Filesystems without fallocate: fall back to setting the length.
            libc::EOPNOTSUPP | libc::EINVAL => file.set_len(bytes),
            code => Err(std::io::Error::from_raw_os_error(code)),
        }
    }
    #[cfg(not(target_os = "linux"))]
    file.set_len(bytes)
}

fn write_at(file: &std::fs::File, bytes: &[u8], offset: u64) -> Result<()> {
    use std::os::unix::fs::FileExt;
    file.write_all_at(bytes, offset)
        .map_err(|e| EngineError::CheckpointIo(format!("writing a checkpoint: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint too large for the disk is refused before anything is written, naming the
    /// directory and the bytes; a directory that cannot exist is named too.
    #[test]
    fn a_disk_too_small_or_missing_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = 1u64 << 60;
        let err = scratch_file(dir.path(), bytes).unwrap_err().to_string();
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
        assert!(err.contains(&bytes.to_string()), "{err}");
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"x").unwrap();
        let under_file = file.join("checkpoints");
        let err = scratch_file(&under_file, 8).unwrap_err().to_string();
        assert!(err.contains("a-file"), "{err}");
        // Nothing but the plain file is in the directory: the scratch files were never named.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// Tensors come back from disk as they went in, last first, in every float dtype.
    #[test]
    fn checkpoints_round_trip_through_disk() {
        let dir = tempfile::tempdir().unwrap();
        let device = Device::Cpu;
        let base = Tensor::arange(0f32, 24., &device)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap()
            .affine(0.37, -1.1)
            .unwrap();
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let a = base.to_dtype(dtype).unwrap();
            let b = (&a * 2.0).unwrap();
            let mut store = CheckpointStore::new(Some(dir.path()), false, 2, &a).unwrap();
            store.push(&a).unwrap();
            store.push(&b).unwrap();
            for want in [&b, &a] {
                let got = store.pop(&device).unwrap().unwrap();
                assert_eq!(got.dtype(), dtype);
                assert_eq!(got.dims(), want.dims());
                let diff = (got.to_dtype(DType::F64).unwrap() - want.to_dtype(DType::F64).unwrap())
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap();
                assert_eq!(diff, 0.0, "{dtype:?}");
            }
            assert!(store.pop(&device).unwrap().is_none());
            let io = store.io();
            assert_eq!(io.written, io.read);
            assert_eq!(io.written, 2 * 24 * dtype.size_in_bytes() as u64);
        }
    }
}
