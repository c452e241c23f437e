//! Rotary position embeddings (the `rotate_half` convention of transformers), for any positions, so a
//! chunk of queries or keys (or a packed row's documents) can be rotated on its own.
//!
//! Inverse frequencies and angles are computed in f64 and only then cast to the model dtype: the f64
//! path is then exact, and lower precisions get the correctly rounded table.

use candle_core::{DType, Device, Tensor, D};

use crate::config::{RopeConfig, RopeScaling};
use crate::error::Result;

/// The inverse frequencies of one rotary table.
#[derive(Debug, Clone, PartialEq)]
pub struct Rotary {
    inv_freq: Vec<f64>,
}

impl Rotary {
    /// Inverse frequencies for `head_dim`, with the config's scaling applied.
    pub fn new(cfg: &RopeConfig, head_dim: usize) -> Self {
        let base: Vec<f64> = (0..head_dim / 2)
            .map(|i| 1.0 / cfg.theta.powf((2 * i) as f64 / head_dim as f64))
            .collect();
        let inv_freq = match cfg.scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old_len,
            } => {
                // transformers' `_compute_llama3_parameters`, term for term.
                let low_freq_wavelen = old_len / low_freq_factor;
                let high_freq_wavelen = old_len / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        let scaled = if wavelen > low_freq_wavelen {
                            f / factor
                        } else {
                            f
                        };
                        let medium = (high_freq_wavelen..=low_freq_wavelen).contains(&wavelen);
                        if medium {
                            let smooth = (old_len / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect()
            }
        };
        Self { inv_freq }
    }

    /// The inverse frequencies (half the head dimension).
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// `(cos, sin)` tables of shape `[n, head_dim]` in `dtype` for the `n` given positions.
    pub fn tables(
        &self,
        positions: impl Iterator<Item = f64>,
        n: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(n * 2 * half);
        let mut sin = Vec::with_capacity(n * 2 * half);
        for p in positions {
            // Both halves of a row hold the same angles (`rotate_half`): evaluate them once.
            let row = cos.len();
            for f in &self.inv_freq {
                let (s, c) = (p * f).sin_cos();
                cos.push(c);
                sin.push(s);
            }
            cos.extend_from_within(row..);
            sin.extend_from_within(row..);
        }
        if cos.len() != n * 2 * half {
            return Err(crate::error::ModelError::Input(format!(
                "rope: {} positions where {n} were expected",
                cos.len() / (2 * half).max(1)
            )));
        }
        let shape = (n, 2 * half);
        // Non-f64 dtypes go through f32 like transformers' tables do, to round once more the same way.
        let cast = |v: Vec<f64>| -> Result<Tensor> {
            let t = Tensor::from_vec(v, shape, device)?;
            Ok(match dtype {
                DType::F64 => t,
                DType::F32 => t.to_dtype(DType::F32)?,
                _ => t.to_dtype(DType::F32)?.to_dtype(dtype)?,
            })
        };
        Ok((cast(cos)?, cast(sin)?))
    }
}

/// Applies rope to `x` of shape `[batch, heads, len, head_dim]` with tables `[len, head_dim]` (or
/// `[batch, 1, len, head_dim]`, one table per row).
/// Built from differentiable ops (candle's fused rope records no backward).
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?)
}
