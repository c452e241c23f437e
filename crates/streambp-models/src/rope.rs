//! Rotary position embeddings (the `rotate_half` convention of transformers), for any positions, so a
//! chunk of queries or keys (or a packed row's documents) can be rotated on its own.
//!
//! Inverse frequencies and angles are computed in f64 and only then cast to the model dtype: the f64
//! path is then exact, and lower precisions get the correctly rounded table.
//!
//! On the CPU in f32/f64 the rotation is one op with its backward written out ([`FusedRope`]: one
//! pass each way); elsewhere it is composed from differentiable tensor ops (seven, each with a buffer,
//! and their backward).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor, WithDType, D};
use half::{bf16, f16};
use num_traits::Float;
use rayon::prelude::*;

use crate::config::{RopeConfig, RopeScaling};
use crate::error::Result;
use streambp_kernels::host::cast::through_f32;
use streambp_kernels::host::storage::{fusable, input_data, tensor_from, with_data};
use streambp_kernels::vectorized;

/// Rows (one head of one token each) per rayon task of the rotation.
const ROWS_PER_TASK: usize = 16;

type CResult<T> = candle_core::Result<T>;

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

/// Applies rope to `x` of shape `[batch, heads, len, head_dim]` with tables `[len, head_dim]` (or
/// `[batch, 1, len, head_dim]`, one table per row).
/// Differentiable in `x` (candle's fused rope records no backward).
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (_, heads, len, head_dim) = x.dims4()?;
    if fusable(x) && head_dim > 0 && cos.dtype() == x.dtype() && sin.dtype() == x.dtype() {
        let op = FusedRope {
            head_dim,
            cos: cos.detach().contiguous()?,
            sin: sin.detach().contiguous()?,
            rows_per_batch: heads * len,
            len,
            per_batch: cos.rank() == 4,
        };
        return Ok(x.contiguous()?.apply_op1(op)?);
    }
    let in_f32 = |[x, cos, sin]: [Tensor; 3]| apply_rope(&x, &cos, &sin);
    if let Some(out) = through_f32([x, &cos.detach(), &sin.detach()], in_f32)? {
        return Ok(out);
    }
    composed_rope(x, cos, sin)
}

/// [`apply_rope`] from tensor ops (every device and dtype).
fn composed_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?)
}

/// Rope as one CPU op on `x` `[b, heads, len, hd]` (contiguous), with the rotation written out per
/// row: for halves `x = [x₁, x₂]`, `y = [x₁c₁ − x₂s₁, x₂c₂ + x₁s₂]` (the composed ops' arithmetic,
/// `x·cos + rotate_half(x)·sin`), and its transpose for the gradient,
/// `dx = [g₁c₁ + g₂s₂, g₂c₂ − g₁s₁]`.
struct FusedRope {
    /// `[len, hd]` or `[b, 1, len, hd]`.
    cos: Tensor,
    sin: Tensor,
    /// `heads × len`: rows of `x` per batch row.
    rows_per_batch: usize,
    len: usize,
    /// Whether the tables hold one table per batch row (packing).
    per_batch: bool,
    head_dim: usize,
}

impl FusedRope {
    /// The table row of `x`'s row `r`.
    fn table_row(&self, r: usize) -> usize {
        let batch = match self.per_batch {
            true => r / self.rows_per_batch,
            false => 0,
        };
        batch * self.len + r % self.len
    }

    /// `x` rotated forward (`inverse` false) or by the transpose (the gradient, `inverse` true).
    fn rotate<T: WithDType + Float>(&self, x: &[T], inverse: bool) -> CResult<Vec<T>> {
        let rotated = with_data::<T, _>(&self.cos, |cos| {
            with_data::<T, _>(&self.sin, |sin| {
                let hd = self.head_dim;
                let half = hd / 2;
                let mut y = vec![T::zero(); x.len()];
                y.par_chunks_mut(hd * ROWS_PER_TASK)
                    .zip(x.par_chunks(hd * ROWS_PER_TASK))
                    .enumerate()
                    .for_each(|(task, (y, x))| {
                        vectorized!(|_| {
                            let rows = y.chunks_mut(hd).zip(x.chunks(hd));
                            for (i, (y, x)) in rows.enumerate() {
                                let t = self.table_row(task * ROWS_PER_TASK + i) * hd;
                                let (c, s) = (&cos[t..t + hd], &sin[t..t + hd]);
                                let (y1, y2) = y.split_at_mut(half);
                                let (x1, x2) = x.split_at(half);
                                let (c1, c2) = c.split_at(half);
                                let (s1, s2) = s.split_at(half);
                                for i in 0..half {
                                    let (a, b) = (x1[i], x2[i]);
                                    if inverse {
                                        y1[i] = a * c1[i] + b * s2[i];
                                        y2[i] = b * c2[i] - a * s1[i];
                                    } else {
                                        y1[i] = a * c1[i] + (-b) * s1[i];
                                        y2[i] = b * c2[i] + a * s2[i];
                                    }
                                }
                            }
                        })
                    });
                Ok(y)
            })
        })?
        .flatten();
        rotated.ok_or_else(|| candle_core::Error::Msg("rope: tables off the CPU".into()))
    }
}

impl CustomOp1 for FusedRope {
    fn name(&self) -> &'static str {
        "streambp-rope"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout) -> CResult<(CpuStorage, Shape)> {
        let y = match xs.dtype() {
            DType::F32 => {
                f32::to_cpu_storage_owned(self.rotate::<f32>(input_data(xs, xl)?, false)?)
            }
            DType::F64 => {
                f64::to_cpu_storage_owned(self.rotate::<f64>(input_data(xs, xl)?, false)?)
            }
            other => candle_core::bail!("rope op: {other:?} is not f32 or f64"),
        };
        Ok((y, xl.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> CResult<Option<Tensor>> {
        let dx = match x.dtype() {
            DType::F32 => with_data::<f32, _>(g, |g| tensor_from(self.rotate(g, true)?, x))?,
            _ => with_data::<f64, _>(g, |g| tensor_from(self.rotate(g, true)?, x))?,
        };
        Ok(dx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;
    use streambp_testkit::{grads, max_diff};

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

    /// The fused rotation and the composed one: equal outputs and input gradients in f64, with one
    /// table for all rows and with one table per batch row (packing), on a strided input.
    #[test]
    fn the_fused_rope_matches_the_composed_one_in_f64() {
        let dev = Device::Cpu;
        let (b, heads, len, hd) = (2, 3, 5, 8);
        let rotary = Rotary::new(
            &RopeConfig {
                theta: 10_000.0,
                scaling: RopeScaling::None,
            },
            hd,
        );
        let shared = rotary
            .tables((0..len).map(|p| p as f64), len, DType::F64, &dev)
            .unwrap();
        let positions = (0..b * len).map(|i| ((i * 7) % 11) as f64);
        let (cos, sin) = rotary.tables(positions, b * len, DType::F64, &dev).unwrap();
        let per_row = (
            cos.reshape((b, 1, len, hd)).unwrap(),
            sin.reshape((b, 1, len, hd)).unwrap(),
        );
        for (cos, sin) in [shared, per_row] {
            let x = Var::from_tensor(
                &Tensor::randn(0f64, 1.0, (b, len, heads, hd), &dev)
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap(),
            )
            .unwrap();
            let g = Tensor::randn(0f64, 1.0, (b, heads, len, hd), &dev).unwrap();
            let fused = apply_rope(x.as_tensor(), &cos, &sin).unwrap();
            let composed = composed_rope(x.as_tensor(), &cos, &sin).unwrap();
            assert!(max_diff(&fused, &composed) < 1e-12, "rank {}", cos.rank());
            let (fused_dx, composed_dx) = (grads(&fused, &g, &[&x]), grads(&composed, &g, &[&x]));
            assert!(
                max_diff(&fused_dx[0], &composed_dx[0]) < 1e-12,
                "rank {}",
                cos.rank()
            );
        }
    }
}
