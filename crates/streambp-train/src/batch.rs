//! Collation: tokenized examples into right-padded rows, and rows into the tensors the engine takes.
//! Every recipe and the `grad` command's batch files pad and convert through here.

use candle_core::{DType, Device, Tensor};
use streambp_core::Batch;
use streambp_objectives::IGNORE_INDEX;

use crate::data::Example;
use crate::Result;

/// A right-padded micro-batch.
pub struct Collated {
    /// `[batch][T]` token ids, padded with the pad id.
    pub input_ids: Vec<Vec<i64>>,
    /// `[batch][T]` HF-aligned labels, padded with [`IGNORE_INDEX`].
    pub labels: Vec<Vec<i64>>,
    /// `[batch][T]`, 1 = real token, 0 = padding.
    pub attention_mask: Vec<Vec<i64>>,
    /// Positions inside each document; padding continues the last document's count.
    pub position_ids: Vec<Vec<i64>>,
}

/// `row` right-padded with `fill` to `len` entries.
pub fn padded<T: Copy>(row: &[T], len: usize, fill: T) -> Vec<T> {
    let mut out = row.to_vec();
    out.resize(len.max(row.len()), fill);
    out
}

/// Pads `examples` on the right to their longest length.
pub fn collate(examples: &[&Example], pad_id: u32) -> Collated {
    let t = examples
        .iter()
        .map(|e| e.input_ids.len())
        .max()
        .unwrap_or(0);
    let widen = |row: &[u32]| -> Vec<i64> { row.iter().map(|&v| v as i64).collect() };
    let mut c = Collated {
        input_ids: Vec::with_capacity(examples.len()),
        labels: Vec::with_capacity(examples.len()),
        attention_mask: Vec::with_capacity(examples.len()),
        position_ids: Vec::with_capacity(examples.len()),
    };
    for e in examples {
        let n = e.input_ids.len();
        c.input_ids
            .push(padded(&widen(&e.input_ids), t, pad_id as i64));
        c.labels.push(padded(&e.labels, t, IGNORE_INDEX));
        c.attention_mask.push(padded(&vec![1; n], t, 0));
        let mut p = widen(&e.position_ids);
        let next = p.last().map_or(0, |l| l + 1);
        p.extend((0..(t - n) as i64).map(|k| next + k));
        c.position_ids.push(p);
    }
    c
}

impl Collated {
    /// Real (unpadded) tokens.
    pub fn tokens(&self) -> usize {
        self.attention_mask
            .iter()
            .flatten()
            .filter(|&&m| m == 1)
            .count()
    }

    /// `1` where a label is a target, `0` elsewhere (GRPO's completion mask).
    pub fn target_mask(&self) -> Vec<Vec<i64>> {
        self.labels
            .iter()
            .map(|row| row.iter().map(|&l| i64::from(l != IGNORE_INDEX)).collect())
            .collect()
    }

    /// The rows as tensors on `device`.
    pub fn tensors(&self, device: &Device) -> Result<BatchTensors> {
        Ok(BatchTensors {
            input_ids: to_u32_tensor(&self.input_ids, device)?,
            attention_mask: to_u32_tensor(&self.attention_mask, device)?,
            position_ids: to_u32_tensor(&self.position_ids, device)?,
        })
    }
}

/// `labels` with the positions where `mask` is 0 (padding) set to [`IGNORE_INDEX`]; given the input ids
/// as labels, every real token of the rows.
pub fn masked_labels(labels: &[Vec<i64>], mask: &[Vec<i64>]) -> Vec<Vec<i64>> {
    labels
        .iter()
        .zip(mask)
        .map(|(l, m)| {
            l.iter()
                .zip(m)
                .map(|(&l, &m)| if m == 0 { IGNORE_INDEX } else { l })
                .collect()
        })
        .collect()
}

/// A collated micro-batch as `[batch, T]` u32 tensors.
pub struct BatchTensors {
    /// Token ids.
    pub input_ids: Tensor,
    /// 1 = real token, 0 = padding.
    pub attention_mask: Tensor,
    /// Positions restarting at each packed document (counting `0..T` in unpacked rows, which the
    /// engine treats as no packing).
    pub position_ids: Tensor,
}

impl BatchTensors {
    /// The engine's view of the batch.
    pub fn batch(&self) -> Batch<'_> {
        Batch {
            input_ids: &self.input_ids,
            attention_mask: Some(&self.attention_mask),
            position_ids: Some(&self.position_ids),
        }
    }
}

/// `[rows, T]` u32 from equal-length rows of ids.
pub fn to_u32_tensor(rows: &[Vec<i64>], device: &Device) -> Result<Tensor> {
    let (b, t) = (rows.len(), rows.first().map_or(0, Vec::len));
    let flat: Vec<u32> = rows.iter().flatten().map(|&v| v as u32).collect();
    Ok(Tensor::from_vec(flat, (b, t), device)?.to_dtype(DType::U32)?)
}
