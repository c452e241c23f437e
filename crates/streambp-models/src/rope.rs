//! Rotary position embeddings (the `rotate_half` convention of transformers), for any positions, so a
//! chunk of queries or keys (or a packed row's documents) can be rotated on its own.
//!
//! Inverse frequencies and angles are computed in f64 and only then cast to the model dtype: the f64
//! path is then exact, and lower precisions get the correctly rounded table.
//!
//! The rotation itself is [`streambp_kernels::ops::rope`]'s ([`apply_rope`]).

use candle_core::{DType, Device, Tensor, WithDType};
use half::{bf16, f16};

use crate::config::{RopeConfig, RopeScaling};
use crate::error::Result;
pub use streambp_kernels::ops::rope::apply_rope;

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
    ///
    /// Each angle's f64 cosine and sine are rounded to `dtype` as they are computed (through f32
    /// for half precision, as transformers' tables are, to round once more the same way): the same
    /// bits as f64 tables cast afterwards, without holding them. Those were four times a bf16
    /// table's bytes, the forward's peak at long `T`.
    pub fn tables(
        &self,
        positions: impl Iterator<Item = f64>,
        n: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        match dtype {
            DType::F64 => self.tables_of(positions, n, device, |v| v),
            DType::F32 => self.tables_of(positions, n, device, |v| v as f32),
            DType::BF16 => self.tables_of(positions, n, device, |v| bf16::from_f32(v as f32)),
            DType::F16 => self.tables_of(positions, n, device, |v| f16::from_f32(v as f32)),
            other => Err(crate::error::ModelError::Input(format!(
                "rope: no tables in {other:?}"
            ))),
        }
    }

    /// [`Rotary::tables`] with each f64 value rounded by `round`.
    fn tables_of<T: WithDType>(
        &self,
        positions: impl Iterator<Item = f64>,
        n: usize,
        device: &Device,
        round: impl Fn(f64) -> T,
    ) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(n * 2 * half);
        let mut sin = Vec::with_capacity(n * 2 * half);
        for p in positions {
            // Both halves of a row hold the same angles (`rotate_half`): evaluate them once.
            let row = cos.len();
            for f in &self.inv_freq {
                let (s, c) = (p * f).sin_cos();
                cos.push(round(c));
                sin.push(round(s));
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
        Ok((
            Tensor::from_vec(cos, shape, device)?,
            Tensor::from_vec(sin, shape, device)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tables in each dtype hold the f64 tables' values rounded as candle casts them (through f32
    /// for half precision), bit for bit, at positions up to 70K and out of order (packing).
    #[test]
    fn tables_are_the_f64_tables_rounded_to_their_dtype() {
        let dev = Device::Cpu;
        let rotary = Rotary::new(
            &RopeConfig {
                theta: 1_000_000.0,
                scaling: RopeScaling::None,
            },
            16,
        );
        let positions: Vec<f64> = (0..300).map(|i| ((i * 7919) % 70_001) as f64).collect();
        let n = positions.len();
        let (cos64, sin64) = rotary
            .tables(positions.iter().copied(), n, DType::F64, &dev)
            .unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let (cos, sin) = rotary
                .tables(positions.iter().copied(), n, dtype, &dev)
                .unwrap();
            for (table, wide) in [(cos, &cos64), (sin, &sin64)] {
                assert_eq!(table.dtype(), dtype);
                let want = match dtype {
                    DType::F32 => wide.to_dtype(dtype).unwrap(),
                    _ => wide.to_dtype(DType::F32).unwrap().to_dtype(dtype).unwrap(),
                };
                let bits = |t: &Tensor| t.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
                assert_eq!(
                    bits(&table).to_vec1::<f64>().unwrap(),
                    bits(&want).to_vec1::<f64>().unwrap(),
                    "{dtype:?}"
                );
            }
        }
        let two = (0..2).map(|p| p as f64);
        assert!(rotary.tables(two, 2, DType::U8, &dev).is_err());
    }
}
