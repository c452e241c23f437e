//! Batch files of the `grad` command: one JSON object holding a whole batch in HF conventions.
//!
//! SFT: `{"objective":"sft","input_ids":[[..]],"labels":[[..]],"attention_mask":[[..]]}`; labels are
//! aligned with input_ids (shifted inside), -100 is ignored, rows are right-padded, the attention mask
//! is optional (all ones when absent).

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde::Deserialize;
use streambp_objectives::{Objective, Sft};

use crate::{Result, TrainError};

/// A batch ready for the engine.
pub struct PreparedBatch {
    /// `[batch, T]` u32.
    pub input_ids: Tensor,
    /// `[batch, T]` u32 (1 = real token), when given.
    pub attention_mask: Option<Tensor>,
    pub objective: Box<dyn Objective>,
    /// Real (unpadded) tokens in the batch.
    pub tokens: usize,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SftFile {
    #[allow(dead_code)]
    objective: String,
    input_ids: Vec<Vec<i64>>,
    labels: Vec<Vec<i64>>,
    attention_mask: Option<Vec<Vec<i64>>>,
}

/// Reads and validates a batch file for a model with `vocab_size` tokens.
pub fn load_batch(path: &Path, vocab_size: usize, device: &Device) -> Result<PreparedBatch> {
    let name = path.display().to_string();
    let fail = |reason: String| TrainError::BatchFile {
        path: name.clone(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| fail(format!("cannot read: {e}")))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| fail(format!("not valid JSON: {e}")))?;
    let objective = value
        .get("objective")
        .and_then(|o| o.as_str())
        .ok_or_else(|| fail("no \"objective\" field (sft, dpo or grpo)".into()))?;
    match objective {
        "sft" => {
            let file: SftFile = serde_json::from_value(value.clone())
                .map_err(|e| fail(format!("bad sft batch: {e}")))?;
            prepare_sft(file, vocab_size, device).map_err(|e| match e {
                TrainError::Usage(reason) => fail(reason),
                TrainError::Objective(o) => fail(o.to_string()),
                other => other,
            })
        }
        other => Err(fail(format!(
            "unknown objective {other:?} (this build supports: sft)"
        ))),
    }
}

fn prepare_sft(file: SftFile, vocab_size: usize, device: &Device) -> Result<PreparedBatch> {
    let (b, t) = check_rectangular("input_ids", &file.input_ids)?;
    check_same_shape("labels", &file.labels, b, t)?;
    check_vocab(&file.input_ids, vocab_size)?;
    let mask = match &file.attention_mask {
        Some(m) => {
            check_same_shape("attention_mask", m, b, t)?;
            check_right_padded(m)?;
            Some(m)
        }
        None => None,
    };
    // Padded positions are never targets, whatever their label says.
    let labels: Vec<Vec<i64>> = match mask {
        Some(m) => file
            .labels
            .iter()
            .zip(m)
            .map(|(l, m)| {
                l.iter()
                    .zip(m)
                    .map(|(&l, &m)| if m == 0 { -100 } else { l })
                    .collect()
            })
            .collect(),
        None => file.labels.clone(),
    };
    let sft = Sft::new(&labels, vocab_size, None, device)?;
    let tokens = match mask {
        Some(m) => m.iter().flatten().filter(|&&v| v != 0).count(),
        None => b * t,
    };
    Ok(PreparedBatch {
        input_ids: to_u32_tensor(&file.input_ids, device)?,
        attention_mask: mask.map(|m| to_u32_tensor(m, device)).transpose()?,
        objective: Box::new(sft),
        tokens,
    })
}

/// `(rows, columns)` of a non-empty rectangular matrix, or an error naming the first bad row.
pub fn check_rectangular(what: &str, rows: &[Vec<i64>]) -> Result<(usize, usize)> {
    let t = rows
        .first()
        .map(Vec::len)
        .ok_or_else(|| TrainError::Usage(format!("{what} has no rows")))?;
    if t == 0 {
        return Err(TrainError::Usage(format!("{what} row 0 is empty")));
    }
    if let Some((i, r)) = rows.iter().enumerate().find(|(_, r)| r.len() != t) {
        return Err(TrainError::Usage(format!(
            "{what} is ragged: row {i} has {} entries, row 0 has {t} (pad rows to one length)",
            r.len()
        )));
    }
    Ok((rows.len(), t))
}

pub fn check_same_shape(what: &str, rows: &[Vec<i64>], b: usize, t: usize) -> Result<()> {
    let shape = check_rectangular(what, rows)?;
    if shape != (b, t) {
        return Err(TrainError::Usage(format!(
            "{what} is {}x{} but input_ids is {b}x{t}",
            shape.0, shape.1
        )));
    }
    Ok(())
}

pub fn check_vocab(ids: &[Vec<i64>], vocab_size: usize) -> Result<()> {
    for (row, r) in ids.iter().enumerate() {
        if let Some((pos, id)) = r
            .iter()
            .enumerate()
            .find(|(_, &id)| id < 0 || id as usize >= vocab_size)
        {
            return Err(TrainError::Usage(format!(
                "token id {id} at row {row}, position {pos} is outside the vocabulary (size {vocab_size})"
            )));
        }
    }
    Ok(())
}

/// Masks hold 0/1, and once a row has a 0 it stays 0 (right padding, which the engine assumes).
pub fn check_right_padded(mask: &[Vec<i64>]) -> Result<()> {
    for (row, r) in mask.iter().enumerate() {
        if let Some(v) = r.iter().find(|&&v| v != 0 && v != 1) {
            return Err(TrainError::Usage(format!(
                "attention_mask row {row} holds {v}; expected 0 or 1"
            )));
        }
        let first_pad = r.iter().position(|&v| v == 0).unwrap_or(r.len());
        if r[first_pad..].iter().any(|&v| v != 0) {
            return Err(TrainError::Usage(format!(
                "attention_mask row {row} is not right-padded (a 1 follows a 0)"
            )));
        }
        if first_pad == 0 {
            return Err(TrainError::Usage(format!(
                "attention_mask row {row} has no real token"
            )));
        }
    }
    Ok(())
}

pub fn to_u32_tensor(rows: &[Vec<i64>], device: &Device) -> Result<Tensor> {
    let (b, t) = (rows.len(), rows[0].len());
    let flat: Vec<u32> = rows.iter().flatten().map(|&v| v as u32).collect();
    Ok(Tensor::from_vec(flat, (b, t), device)?.to_dtype(DType::U32)?)
}
