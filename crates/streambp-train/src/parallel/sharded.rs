//! ZeRO-1/2's sharded state: a step's gradient shards (reduced layer by layer under ZeRO-2), AdamW
//! over this rank's shards, and clipping to the global norm from every rank's share.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Tensor, Var};
use streambp_core::FinishedGradients;
use streambp_dist::Communicator;
use streambp_models::Model;

use super::Buckets;
use crate::optim::{decays, AdamWConfig, Decay, Moments};
use crate::{Result, TrainError};
use streambp_kernels::ops::adamw::update_in_place;

/// A step's gradient shards, bucket by bucket (ZeRO-1 and 2). As the engine's [`FinishedGradients`]
/// (ZeRO-2) it reduce-scatters each finished layer at once, scaled by the micro-batch's `weight`.
pub struct ShardedGradients {
    buckets: Arc<Buckets>,
    comm: Arc<dyn Communicator>,
    pub(super) shards: Vec<Option<Tensor>>,
    /// The weight of the micro-batch being backpropagated.
    pub weight: f64,
}

impl ShardedGradients {
    /// No gradient yet.
    pub fn new(buckets: Arc<Buckets>, comm: Arc<dyn Communicator>) -> Self {
        Self {
            shards: vec![None; buckets.len()],
            buckets,
            comm,
            weight: 1.0,
        }
    }

    /// Adds one group's gradients (reduced over ranks, this rank's shard kept).
    pub fn add(&mut self, grads: &[(String, Tensor)]) -> Result<()> {
        if grads.is_empty() {
            return Ok(());
        }
        let (b, shard) = self
            .buckets
            .reduce_scatter(self.comm.as_ref(), grads, self.weight)?;
        self.shards[b] = Some(match self.shards[b].take() {
            Some(acc) => (acc + shard)?,
            None => shard,
        });
        Ok(())
    }

    /// The step's shards, bucket by bucket; a bucket that got nothing is an error (a dropped gradient
    /// must never read as zero).
    pub fn take(&mut self) -> Result<Vec<Tensor>> {
        std::mem::replace(&mut self.shards, vec![None; self.buckets.len()])
            .into_iter()
            .enumerate()
            .map(|(b, s)| {
                s.ok_or_else(|| TrainError::Internal(format!("bucket {b} got no gradient")))
            })
            .collect()
    }
}

impl FinishedGradients for ShardedGradients {
    fn take(&mut self, grads: Vec<(String, Tensor)>) -> streambp_core::Result<()> {
        self.add(&grads)
            .map_err(|e| streambp_core::EngineError::Plan(e.to_string()))
    }
}

/// AdamW over this rank's shards of every bucket (ZeRO-1/2): moments of 1/world of the parameters;
/// after the update the new shards are all-gathered into every rank's parameters.
pub struct ShardedAdamW {
    /// The hyperparameters.
    pub config: AdamWConfig,
    buckets: Arc<Buckets>,
    vars: Vec<Var>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Whether weight decay applies, per parameter.
    decays: Vec<bool>,
    /// Updates applied so far.
    pub step: usize,
}

impl ShardedAdamW {
    /// Zero moments for this rank's shards of `model`'s buckets.
    pub fn new(model: &Model, buckets: Arc<Buckets>, config: AdamWConfig) -> Result<Self> {
        let params = model.parameters();
        let device = model.device();
        let (mut m, mut v) = (Vec::new(), Vec::new());
        for b in 0..buckets.len() {
            let n = buckets.buckets[b].padded / buckets.world;
            m.push(Tensor::zeros(n, buckets.dtype, device)?);
            v.push(Tensor::zeros(n, buckets.dtype, device)?);
        }
        Ok(Self {
            config,
            vars: params.iter().map(|(_, v)| v.clone()).collect(),
            decays: params.iter().map(|(name, _)| decays(name)).collect(),
            buckets,
            m,
            v,
            step: 0,
        })
    }

    /// One update with this rank's gradient `shards` (one per bucket) at rate `lr`, then the
    /// all-gather of the new values into the parameters.
    pub fn apply(&mut self, comm: &dyn Communicator, shards: &[Tensor], lr: f64) -> Result<()> {
        self.step += 1;
        let corrections = self.config.bias_corrections(self.step);
        let buckets = self.buckets.clone();
        for (b, bucket) in buckets.buckets.iter().enumerate() {
            let values: Vec<Tensor> = bucket
                .params
                .iter()
                .map(|&i| {
                    Ok(self.vars[i]
                        .as_tensor()
                        .detach()
                        .flatten_all()?
                        .to_dtype(buckets.dtype)?)
                })
                .collect::<Result<_>>()?;
            let flat = buckets.pad(b, Tensor::cat(&values, 0)?)?;
            // A buffer of its own: the update writes into it.
            let p = buckets.shard(b, &flat)?.copy()?;
            let g = shards[b].to_dtype(buckets.dtype)?;
            // Each parameter's run of the shard with its own decay, as the whole-parameter
            // optimizer updates it: in place where the device has a kernel, else composed.
            for (start, len, param) in buckets.shard_runs(b) {
                let decays = param.is_some_and(|i| self.decays[i]);
                let run = |t: &Tensor| t.narrow(0, start, len);
                let (p_run, m_run, v_run) = (run(&p)?, run(&self.m[b])?, run(&self.v[b])?);
                let constants = self.config.step_constants(lr, corrections, decays);
                if update_in_place(&p_run, &run(&g)?, (&m_run, &v_run), &constants)? {
                    continue;
                }
                let (mut m_new, mut v_new) = (m_run.copy()?, v_run.copy()?);
                let moments = Moments {
                    m: &mut m_new,
                    v: &mut v_new,
                };
                let decay = if decays { Decay::All } else { Decay::None };
                let p_new =
                    self.config
                        .update(p_run, &run(&g)?, moments, lr, corrections, decay)?;
                p.slice_set(&p_new, 0, start)?;
                self.m[b].slice_set(&m_new, 0, start)?;
                self.v[b].slice_set(&v_new, 0, start)?;
            }
            let whole = comm.all_gather(&p)?;
            let mut at = 0;
            for (&i, shape) in bucket.params.iter().zip(&bucket.shapes) {
                let n: usize = shape.iter().product();
                let var = &self.vars[i];
                var.set(
                    &whole
                        .narrow(0, at, n)?
                        .reshape(shape.as_slice())?
                        .to_dtype(var.dtype())?,
                )?;
                at += n;
            }
        }
        Ok(())
    }

    /// This rank's moments for checkpoints: `bucket.<b>.m` / `.v`.
    pub fn state(&self) -> HashMap<String, Tensor> {
        (0..self.m.len())
            .flat_map(|b| {
                [
                    (format!("bucket.{b}.m"), self.m[b].clone()),
                    (format!("bucket.{b}.v"), self.v[b].clone()),
                ]
            })
            .collect()
    }

    /// Restores the moments saved by [`ShardedAdamW::state`] and the step count.
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>, step: usize) -> Result<()> {
        for b in 0..self.m.len() {
            for (suffix, dst) in [("m", &mut self.m[b]), ("v", &mut self.v[b])] {
                let key = format!("bucket.{b}.{suffix}");
                let t = state.get(&key).ok_or_else(|| {
                    TrainError::Checkpoint(format!("the optimizer shard has no {key}"))
                })?;
                if t.dims() != dst.dims() {
                    return Err(TrainError::Checkpoint(format!(
                        "the optimizer shard's {key} has shape {:?}, expected {:?}",
                        t.dims(),
                        dst.dims()
                    )));
                }
                *dst = t.to_dtype(dst.dtype())?.to_device(dst.device())?;
            }
        }
        self.step = step;
        Ok(())
    }
}

/// Clips gradient shards to a global L2 norm of `max_norm` (0: no clipping): returns the norm before,
/// from every rank's share of the sum of squares.
pub fn clip_sharded(comm: &dyn Communicator, shards: &mut [Tensor], max_norm: f64) -> Result<f64> {
    let mut local = 0.0;
    for s in shards.iter() {
        local += s
            .to_dtype(DType::F64)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f64>()?;
    }
    let norm = comm.sum(local)?.sqrt();
    if max_norm > 0.0 && norm > max_norm {
        let scale = max_norm / (norm + 1e-6);
        for s in shards.iter_mut() {
            *s = (&*s * scale)?;
        }
    }
    Ok(norm)
}
