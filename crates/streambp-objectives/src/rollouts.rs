//! Completions sampled for prompts, as the policy-gradient objectives ([`crate::Grpo`],
//! [`crate::Rloo`]) read them: right-padded rows, prompt first, a completion mask, and the
//! per-position log-probs of the policy that sampled them and of the reference.
//!
//! Per-position inputs are aligned with `input_ids`: the log-prob at position `t` is that of
//! `input_ids[t]` from the logits at `t − 1`; the objectives work in logits coordinates
//! ([`shift`]).

use candle_core::{Device, Tensor};

use crate::{ObjectiveError, Result};

/// A batch of completions, `[B][T]` each.
#[derive(Debug, Clone, Copy)]
pub struct Rollouts<'a> {
    /// `[B][T]` token ids, prompt then completion, right-padded.
    pub input_ids: &'a [Vec<i64>],
    /// `[B][T]`, 1 = completion token (the positions the loss covers); 0 at position 0.
    pub completion_mask: &'a [Vec<i64>],
    /// `[B][T]` log-probs of `input_ids[t]` under the policy that sampled them (`π_old`), read at
    /// completion positions; `None`: the current policy, detached.
    pub old_logps: Option<&'a [Vec<f64>]>,
    /// `[B][T]` log-probs under the reference model, aligned like `old_logps`.
    pub ref_logps: Option<&'a [Vec<f64>]>,
}

/// The error of a malformed batch, saying what is wrong with it (`m`).
pub(crate) fn bad(m: String) -> ObjectiveError {
    ObjectiveError::Batch(m)
}

/// Shifts a per-position array aligned with input_ids into logits coordinates (drops position 0).
pub(crate) fn shift<T: Copy + Default>(rows: &[Vec<T>]) -> Vec<T> {
    rows.iter()
        .flat_map(|r| {
            r.iter()
                .skip(1)
                .copied()
                .chain(std::iter::once(T::default()))
        })
        .collect()
}

/// Checks the settings every policy-gradient loss has: the reference log-probs `beta` needs (where
/// `reference` says whether they are given), a positive finite temperature, and `beta` and the
/// clip's epsilons numbers at least 0.
pub(crate) fn check_policy_settings(
    (beta, reference): (f64, bool),
    (epsilon_low, epsilon_high): (f64, f64),
    temperature: f64,
) -> Result<()> {
    if beta != 0.0 && !reference {
        return Err(bad(
            "beta != 0 needs ref_logps (or a reference model)".into()
        ));
    }
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(bad(format!("temperature {temperature} must be above 0")));
    }
    let settings = [
        ("beta", beta),
        ("epsilon", epsilon_low),
        ("epsilon_high", epsilon_high),
    ];
    if let Some((name, value)) = settings.iter().find(|(_, v)| !(*v >= 0.0 && v.is_finite())) {
        return Err(bad(format!("{name} {value} must be a number at least 0")));
    }
    Ok(())
}

impl Rollouts<'_> {
    /// The batch's `(B, T)`, once every array is checked to have input_ids' `[B][T]` shape and each
    /// of `per_row` (a name and its length) `B` entries, every token id to be inside `vocab_size`,
    /// and the log-probs given to be finite at completion positions. Returns the number of
    /// completion tokens of each row too, once the mask is checked to hold only 0/1, never to mark
    /// position 0, and to mark some token in some row.
    pub(crate) fn check(
        &self,
        per_row: &[(&str, usize)],
        vocab_size: usize,
    ) -> Result<((usize, usize), Vec<usize>)> {
        let shape = self.shape(per_row)?;
        self.check_ids(vocab_size)?;
        let lengths = self.completion_lengths()?;
        self.check_logps()?;
        Ok((shape, lengths))
    }

    fn shape(&self, per_row: &[(&str, usize)]) -> Result<(usize, usize)> {
        let b = self.input_ids.len();
        let t = self.input_ids.first().map(Vec::len).unwrap_or(0);
        if b == 0 || t == 0 {
            return Err(bad("empty input_ids".into()));
        }
        let same_shape = |name: &str, rows: usize, lens: &mut dyn Iterator<Item = usize>| {
            if rows != b {
                return Err(bad(format!("{name} has {rows} rows, input_ids has {b}")));
            }
            if let Some((i, l)) = lens.enumerate().find(|(_, l)| *l != t) {
                return Err(bad(format!("{name} row {i} has {l} entries, expected {t}")));
            }
            Ok(())
        };
        same_shape("input_ids", b, &mut self.input_ids.iter().map(Vec::len))?;
        same_shape(
            "completion_mask",
            self.completion_mask.len(),
            &mut self.completion_mask.iter().map(Vec::len),
        )?;
        for (name, arr) in [("old_logps", self.old_logps), ("ref_logps", self.ref_logps)] {
            if let Some(a) = arr {
                same_shape(name, a.len(), &mut a.iter().map(Vec::len))?;
            }
        }
        if let Some((name, n)) = per_row.iter().find(|(_, n)| *n != b) {
            return Err(bad(format!("{name} has {n} entries for {b} sequences")));
        }
        Ok((b, t))
    }

    fn check_ids(&self, vocab_size: usize) -> Result<()> {
        for (b, row) in self.input_ids.iter().enumerate() {
            if let Some(id) = row.iter().find(|&&id| id < 0 || id as usize >= vocab_size) {
                return Err(bad(format!(
                    "token id {id} in row {b} is outside the vocabulary (size {vocab_size})"
                )));
            }
        }
        Ok(())
    }

    fn completion_lengths(&self) -> Result<Vec<usize>> {
        let mut completion_lengths = Vec::with_capacity(self.completion_mask.len());
        for (b, row) in self.completion_mask.iter().enumerate() {
            if row.iter().any(|&m| m != 0 && m != 1) {
                return Err(bad(format!(
                    "completion_mask row {b} holds values other than 0/1"
                )));
            }
            if row[0] != 0 {
                return Err(bad(format!(
                    "completion_mask row {b} marks position 0, which has no preceding logits"
                )));
            }
            // A row without completion tokens adds nothing (TRL's mask_truncated_completions
            // leaves such rows); a batch without any is refused.
            completion_lengths.push(row.iter().filter(|&&m| m == 1).count());
        }
        if completion_lengths.iter().all(|&n| n == 0) {
            return Err(bad(
                "completion_mask marks no completion token in any row".into()
            ));
        }
        Ok(completion_lengths)
    }

    fn check_logps(&self) -> Result<()> {
        for (name, arr) in [("old_logps", self.old_logps), ("ref_logps", self.ref_logps)] {
            if let Some(a) = arr {
                for (b, (row, m)) in a.iter().zip(self.completion_mask).enumerate() {
                    if let Some((p, v)) = row
                        .iter()
                        .zip(m)
                        .enumerate()
                        .find(|(_, (v, &m))| m == 1 && !v.is_finite())
                        .map(|(p, (v, _))| (p, v))
                    {
                        return Err(bad(format!("{name} row {b} position {p} is {v}")));
                    }
                }
            }
        }
        Ok(())
    }

    /// `[B, T]` u32 targets in logits coordinates (position `t` scores `input_ids[t + 1]`).
    pub(crate) fn targets(&self, device: &Device) -> Result<Tensor> {
        let (b, t) = (self.input_ids.len(), self.input_ids[0].len());
        let targets: Vec<u32> = shift(self.input_ids)
            .into_iter()
            .map(|v| v as u32)
            .collect();
        Ok(Tensor::from_vec(targets, (b, t), device)?)
    }

    /// `[B, T]` u8 completion mask in logits coordinates.
    pub(crate) fn mask(&self, device: &Device) -> Result<Tensor> {
        let (b, t) = (self.input_ids.len(), self.input_ids[0].len());
        let mask: Vec<u8> = shift(self.completion_mask)
            .into_iter()
            .map(|m| m as u8)
            .collect();
        Ok(Tensor::from_vec(mask, (b, t), device)?)
    }

    /// A per-position array in logits coordinates, `[B, T]` on `device`.
    pub(crate) fn per_position(rows: &[Vec<f64>], device: &Device) -> Result<Tensor> {
        let (b, t) = (rows.len(), rows[0].len());
        Ok(Tensor::from_vec(shift(rows), (b, t), device)?)
    }
}
