//! Where the tokens of a batch sit: which of them are real (rows are right-padded) and, for packed rows
//! that hold several documents one after another, each token's position inside its own document.
//!
//! Packed rows follow transformers' padding-free convention: `position_ids` restart at 0 where a new
//! document begins. A token then sees only earlier tokens of its own document, and rope rotates it by
//! its position in that document, so a packed row computes exactly what its documents would as rows of
//! their own.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};
use crate::lora::DropoutKey;
use crate::rope::Rotary;

/// The real tokens and document boundaries of a `[batch, T]` batch.
#[derive(Debug, Clone, Default)]
pub struct Layout {
    /// `[batch, T]` u8, 1 = real token; `None`: no padding.
    pub key_valid: Option<Tensor>,
    packing: Option<Arc<Packing>>,
    rope: RopeCache,
    /// Tokens per row, when known: the rope tables are built that long at once.
    seq_len: usize,
    /// Where the LoRA dropout masks of this batch come from (seed, step, micro-batch); `None`: no
    /// dropout (evaluation, reference models, sampling).
    dropout: Option<DropoutKey>,
}

/// Rope tables this layout has built, per rotary table and dtype: every layer and chunk of a backward
/// cuts its rows from one table instead of evaluating sines and cosines again (on the host, and
/// copying them to the device, where that stalls the accelerator). Clones share it.
#[derive(Debug, Clone, Default)]
struct RopeCache(Arc<Mutex<Vec<RopeTables>>>);

/// `cos` and `sin` for tokens `0..len`: `[len, head_dim]`, or `[batch, 1, len, head_dim]` when packed.
#[derive(Debug)]
struct RopeTables {
    rotary: Rotary,
    dtype: DType,
    cos: Tensor,
    sin: Tensor,
}

impl RopeTables {
    /// Tokens covered.
    fn len(&self) -> usize {
        let dims = self.cos.dims();
        dims[dims.len() - 2]
    }
}

/// Document boundaries of packed rows.
#[derive(Debug, Clone)]
struct Packing {
    /// Position of every token inside its document, per row (host side: rope tables are built there).
    positions: Vec<Vec<u32>>,
    /// `[batch, T]` i64: index of the first token of each token's document.
    doc_start: Tensor,
    /// For each index, the earliest document start over the rows: no query at or after it reads an
    /// earlier key.
    earliest_doc_start: Vec<usize>,
}

/// `[b, t]` u8 (1 = real token) from an attention mask of any numeric dtype.
pub fn key_validity(mask: &Tensor) -> Result<Tensor> {
    Ok(mask.ne(0.0)?)
}

impl Layout {
    /// The layout of a batch from its attention mask (1 = real token) and optional `position_ids`
    /// (`[batch, T]`, any integer dtype). Rows whose positions simply count `0..T` are not packed; a
    /// batch without any restart is treated as unpacked.
    pub fn new(attention_mask: Option<&Tensor>, position_ids: Option<&Tensor>) -> Result<Self> {
        let key_valid = attention_mask.map(key_validity).transpose()?;
        let packing = match position_ids {
            Some(p) => Packing::from_position_ids(p, key_valid.as_ref())?.map(Arc::new),
            None => None,
        };
        Ok(Self {
            key_valid,
            packing,
            rope: RopeCache::default(),
            seq_len: 0,
            dropout: None,
        })
    }

    /// The rows' length, so that rope tables are built once at that length (without it they grow by
    /// doubling to what the chunks ask for).
    pub fn with_seq_len(mut self, seq_len: usize) -> Self {
        self.seq_len = seq_len;
        self
    }

    /// The same layout with LoRA dropout on, its masks derived from `key` (see [`crate::lora`]).
    pub fn with_dropout(mut self, key: DropoutKey) -> Self {
        self.dropout = Some(key);
        self
    }

    /// Where this batch's LoRA dropout masks come from, when dropout is on.
    pub fn dropout_key(&self) -> Option<DropoutKey> {
        self.dropout
    }

    /// `(cos, sin)` rope tables for tokens `start..start + len`: `[len, head_dim]`, or `[batch, 1, len,
    /// head_dim]` for packed rows. Cut from a table built once per rotary and dtype (grown by doubling
    /// when a longer one is asked for, as decoding does).
    pub fn rope_tables(
        &self,
        rotary: &Rotary,
        start: usize,
        len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let end = start + len;
        let mut cache = self
            .rope
            .0
            .lock()
            .map_err(|_| ModelError::Input("rope table cache poisoned".into()))?;
        let found = cache.iter().position(|c| {
            c.rotary == *rotary && c.dtype == dtype && c.cos.device().same_device(device)
        });
        let index = match found {
            Some(i) if cache[i].len() >= end => i,
            Some(i) => {
                let longer = end.max(2 * cache[i].len()).max(self.seq_len);
                cache[i] = self.build_rope_tables(rotary, longer, dtype, device)?;
                i
            }
            None => {
                let len = end.max(self.seq_len);
                cache.push(self.build_rope_tables(rotary, len, dtype, device)?);
                cache.len() - 1
            }
        };
        let t = &cache[index];
        let axis = t.cos.rank() - 2;
        Ok((
            t.cos.narrow(axis, start, len)?,
            t.sin.narrow(axis, start, len)?,
        ))
    }

    /// Tables for tokens `0..len` (a packed batch's whole rows, whatever `len` asks).
    fn build_rope_tables(
        &self,
        rotary: &Rotary,
        len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<RopeTables> {
        let (cos, sin) = match &self.packing {
            None => rotary.tables((0..len).map(|p| p as f64), len, dtype, device)?,
            Some(p) => {
                let rows = p.positions.len();
                let t = p.positions.first().map_or(0, Vec::len);
                let positions = p
                    .positions
                    .iter()
                    .flat_map(|row| row.iter().map(|&q| q as f64));
                let (cos, sin) = rotary.tables(positions, rows * t, dtype, device)?;
                let shape = (rows, 1, t, cos.dim(1)?);
                (cos.reshape(shape)?, sin.reshape(shape)?)
            }
        };
        Ok(RopeTables {
            rotary: rotary.clone(),
            dtype,
            cos,
            sin,
        })
    }

    /// Whether rows hold several documents (positions restarting).
    pub fn is_packed(&self) -> bool {
        self.packing.is_some()
    }

    /// `[batch, T]` i64 for packed rows: the index of the first token of each token's document.
    pub fn doc_start(&self) -> Option<&Tensor> {
        self.packing.as_ref().map(|p| &p.doc_start)
    }

    /// The first key that any query at index `q_start` or later can see across document boundaries.
    pub fn first_key_of_document(&self, q_start: usize) -> usize {
        self.packing
            .as_ref()
            .map_or(0, |p| p.earliest_doc_start[q_start])
    }

    /// `[batch, c, t]` u8 for packed rows: 1 where query `q_start + i` and key `k_start + j` are in the
    /// same document (keys after the query are masked by causality elsewhere).
    pub fn same_document(
        &self,
        q_start: usize,
        c: usize,
        k_start: usize,
        t: usize,
    ) -> Result<Option<Tensor>> {
        let Some(p) = &self.packing else {
            return Ok(None);
        };
        let b = p.positions.len();
        let first = p.doc_start.narrow(1, q_start, c)?.reshape((b, c, 1))?;
        let keys = Tensor::arange(k_start as i64, (k_start + t) as i64, first.device())?
            .reshape((1, 1, t))?;
        Ok(Some(keys.broadcast_ge(&first)?))
    }
}

impl Packing {
    /// Padding positions (`key_valid` 0) may hold anything (transformers fills them with 1): they are
    /// taken as continuing the count.
    fn from_position_ids(
        position_ids: &Tensor,
        key_valid: Option<&Tensor>,
    ) -> Result<Option<Self>> {
        let (b, t) = position_ids.dims2()?;
        let valid: Option<Vec<Vec<u8>>> = key_valid.map(|v| v.to_vec2::<u8>()).transpose()?;
        let positions: Vec<Vec<u32>> = position_ids.to_dtype(DType::I64)?.to_vec2::<i64>()?
            .into_iter()
            .enumerate()
            .map(|(row, ids)| {
                let mut out: Vec<u32> = Vec::with_capacity(t);
                for (i, &p) in ids.iter().enumerate() {
                    let padding = valid.as_ref().is_some_and(|v| v[row][i] == 0);
                    if padding {
                        out.push(out.last().map_or(0, |&q| q + 1));
                        continue;
                    }
                    let follows = i > 0 && p == i64::from(out[i - 1]) + 1;
                    if !(p == 0 || follows) {
                        return Err(ModelError::Input(format!(
                            "position_ids row {row}, index {i}: {p}; positions must count up from 0 \
                             inside each document"
                        )));
                    }
                    out.push(p as u32);
                }
                Ok(out)
            })
            .collect::<Result<_>>()?;
        if positions
            .iter()
            .all(|row| row.iter().enumerate().all(|(i, &p)| p as usize == i))
        {
            return Ok(None);
        }
        let starts: Vec<Vec<i64>> = positions
            .iter()
            .map(|row| {
                row.iter()
                    .enumerate()
                    .map(|(i, &p)| (i - p as usize) as i64)
                    .collect()
            })
            .collect();
        let earliest_doc_start = (0..t)
            .map(|i| starts.iter().map(|row| row[i] as usize).min().unwrap_or(0))
            .collect();
        let flat: Vec<i64> = starts.into_iter().flatten().collect();
        let doc_start = Tensor::from_vec(flat, (b, t), position_ids.device())?;
        Ok(Some(Self {
            positions,
            doc_start,
            earliest_doc_start,
        }))
    }
}
