//! Data-parallel training over a [`Communicator`]: ZeRO stages 0, 1 and 2 (DeepSpeed's names).
//!
//! The trainable parameters are grouped in buckets: one per decoder layer and one for the rest
//! (embedding, final norm, head). A bucket's values are flattened (in the model's parameter order) and
//! split into `world` equal shards (zero-padded to a multiple of `world`); rank `r` owns shard `r` of
//! every bucket.
//! - ZeRO-0 all-reduces the gradients; every rank updates every parameter (AdamW over whole parameters).
//! - ZeRO-1 reduce-scatters the step's gradients bucket by bucket; each rank updates its shards (its
//!   AdamW moments are 1/world of one process's) and all-gathers the new values.
//! - ZeRO-2 also keeps only its gradient shards: the engine hands each layer's finished gradients over
//!   as soon as the layer's backward is done ([`FinishedGradients`]), they are reduce-scattered there
//!   (one collective per layer per backward) and the rank keeps its shard.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Tensor, Var};
use streambp_core::FinishedGradients;
use streambp_dist::Communicator;
use streambp_models::Model;

use crate::optim::{decays, AdamWConfig, Decay, Moments};
use crate::{Result, TrainError};

/// How much of the training state each rank keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ZeroStage {
    /// Every rank keeps everything; gradients are all-reduced.
    #[default]
    Zero0,
    /// The optimizer's moments are sharded over the ranks.
    Zero1,
    /// The moments and the gradients are sharded; a layer's gradients are reduced as soon as its
    /// backward is done.
    Zero2,
}

impl std::str::FromStr for ZeroStage {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "0" => Ok(Self::Zero0),
            "1" => Ok(Self::Zero1),
            "2" => Ok(Self::Zero2),
            other => Err(format!("expected 0, 1 or 2, got {other:?}")),
        }
    }
}

impl std::fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = match self {
            Self::Zero0 => 0,
            Self::Zero1 => 1,
            Self::Zero2 => 2,
        };
        write!(f, "{n}")
    }
}

/// One group of parameters, flattened and sharded.
#[derive(Debug, Clone)]
struct Bucket {
    /// Indices into the model's trainable parameters, in order.
    params: Vec<usize>,
    /// Their shapes.
    shapes: Vec<Vec<usize>>,
    /// Elements before padding.
    len: usize,
    /// Elements after padding to a multiple of the number of ranks.
    padded: usize,
}

/// The trainable parameters' buckets, and what this rank owns of them.
#[derive(Debug, Clone)]
pub struct Buckets {
    buckets: Vec<Bucket>,
    /// The bucket of each parameter and its position there, by name.
    of_param: HashMap<String, (usize, usize)>,
    world: usize,
    rank: usize,
    /// What gradients are summed in: f32, or f64 for an f64 model.
    dtype: DType,
}

impl Buckets {
    /// The buckets of `model`'s trainable parameters for `world` ranks.
    pub fn new(model: &Model, world: usize, rank: usize) -> Self {
        let params = model.parameters();
        let index: HashMap<&str, usize> = params
            .iter()
            .enumerate()
            .map(|(i, (n, _))| (n.as_str(), i))
            .collect();
        let mut groups: Vec<Vec<usize>> = (0..model.layers.len())
            .map(|l| {
                model
                    .layer_parameters(l)
                    .iter()
                    .map(|(n, _)| index[n.as_str()])
                    .collect()
            })
            .collect();
        let in_layers: std::collections::HashSet<usize> =
            groups.iter().flatten().copied().collect();
        groups.push(
            (0..params.len())
                .filter(|i| !in_layers.contains(i))
                .collect(),
        );
        let mut of_param = HashMap::new();
        let buckets = groups
            .into_iter()
            .filter(|g| !g.is_empty())
            .enumerate()
            .map(|(b, group)| {
                let shapes: Vec<Vec<usize>> =
                    group.iter().map(|&i| params[i].1.dims().to_vec()).collect();
                let len = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
                for (at, &i) in group.iter().enumerate() {
                    of_param.insert(params[i].0.clone(), (b, at));
                }
                Bucket {
                    params: group,
                    shapes,
                    len,
                    padded: len.div_ceil(world) * world,
                }
            })
            .collect();
        let dtype = match model.dtype() {
            DType::F64 => DType::F64,
            _ => DType::F32,
        };
        Self {
            buckets,
            of_param,
            world,
            rank,
            dtype,
        }
    }

    /// The number of buckets.
    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    /// Whether there is no bucket (a model without trainable parameters).
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// The bucket of one group's gradients (every parameter of one bucket, in any order), flattened in
    /// the bucket's order and zero-padded.
    fn flatten(&self, grads: &[(String, Tensor)]) -> Result<(usize, Tensor)> {
        let place = |name: &str| {
            self.of_param
                .get(name)
                .copied()
                .ok_or_else(|| TrainError::Internal(format!("no bucket holds {name}")))
        };
        let (b, _) = place(&grads[0].0)?;
        let bucket = &self.buckets[b];
        let mut ordered: Vec<Option<Tensor>> = vec![None; bucket.params.len()];
        for (name, g) in grads {
            match place(name)? {
                (in_b, at) if in_b == b && ordered[at].is_none() => {
                    ordered[at] = Some(g.flatten_all()?.to_dtype(self.dtype)?)
                }
                _ => {
                    return Err(TrainError::Internal(format!(
                        "gradient of {name} handed with bucket {b}'s twice or out of its bucket"
                    )))
                }
            }
        }
        let tensors: Vec<Tensor> = ordered
            .into_iter()
            .enumerate()
            .map(|(at, t)| {
                t.ok_or_else(|| {
                    TrainError::Internal(format!("bucket {b}: no gradient for its parameter {at}"))
                })
            })
            .collect::<Result<_>>()?;
        Ok((b, self.pad(b, Tensor::cat(&tensors, 0)?)?))
    }

    fn pad(&self, b: usize, flat: Tensor) -> Result<Tensor> {
        let extra = self.buckets[b].padded - self.buckets[b].len;
        Ok(match extra {
            0 => flat,
            n => Tensor::cat(&[&flat, &Tensor::zeros(n, flat.dtype(), flat.device())?], 0)?,
        })
    }

    /// This rank's shard of the flat, padded `flat` of bucket `b`.
    fn shard(&self, b: usize, flat: &Tensor) -> Result<Tensor> {
        let n = self.buckets[b].padded / self.world;
        Ok(flat.narrow(0, self.rank * n, n)?)
    }

    /// The sum over ranks of one group's gradients (`grads`, named in the model's order), scaled by
    /// `weight`: this rank's shard of its bucket.
    pub fn reduce_scatter(
        &self,
        comm: &dyn Communicator,
        grads: &[(String, Tensor)],
        weight: f64,
    ) -> Result<(usize, Tensor)> {
        let (b, flat) = self.flatten(grads)?;
        let flat = match weight {
            1.0 => flat,
            w => (flat * w)?,
        };
        Ok((b, comm.reduce_scatter_sum(&flat)?))
    }

    /// Whole-model gradients sorted into the buckets' groups, in bucket order (a gradient no bucket
    /// holds is left out).
    pub fn groups(&self, grads: Vec<(String, Tensor)>) -> Vec<Vec<(String, Tensor)>> {
        let mut by_bucket: Vec<Vec<(String, Tensor)>> = vec![Vec::new(); self.buckets.len()];
        for (name, g) in grads {
            if let Some(&(b, _)) = self.of_param.get(&name) {
                by_bucket[b].push((name, g));
            }
        }
        by_bucket
    }

    /// Every parameter's gradient summed over ranks (ZeRO-0), in one all-reduce.
    pub fn all_reduce(
        &self,
        comm: &dyn Communicator,
        grads: Vec<(String, Tensor)>,
    ) -> Result<Vec<(String, Tensor)>> {
        let flat: Vec<Tensor> = grads
            .iter()
            .map(|(_, g)| Ok(g.flatten_all()?.to_dtype(self.dtype)?))
            .collect::<Result<_>>()?;
        let summed = comm.all_reduce_sum(&Tensor::cat(&flat, 0)?)?;
        let mut at = 0;
        grads
            .into_iter()
            .map(|(name, g)| {
                let n = g.elem_count();
                let part = summed
                    .narrow(0, at, n)?
                    .reshape(g.shape())?
                    .to_dtype(g.dtype())?;
                at += n;
                Ok((name, part))
            })
            .collect()
    }
}

/// A step's gradient shards, bucket by bucket (ZeRO-1 and 2). As the engine's [`FinishedGradients`]
/// (ZeRO-2) it reduce-scatters each finished layer at once, scaled by the micro-batch's `weight`.
pub struct ShardedGradients {
    buckets: Arc<Buckets>,
    comm: Arc<dyn Communicator>,
    shards: Vec<Option<Tensor>>,
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
    /// Per bucket shard, 1 where weight decay applies.
    decay: Vec<Tensor>,
    /// Updates applied so far.
    pub step: usize,
}

impl ShardedAdamW {
    /// Zero moments for this rank's shards of `model`'s buckets.
    pub fn new(model: &Model, buckets: Arc<Buckets>, config: AdamWConfig) -> Result<Self> {
        let params = model.parameters();
        let device = model.device();
        let (mut m, mut v, mut decay) = (Vec::new(), Vec::new(), Vec::new());
        for (b, bucket) in buckets.buckets.iter().enumerate() {
            let mask: Vec<Tensor> = bucket
                .params
                .iter()
                .zip(&bucket.shapes)
                .map(|(&i, shape)| {
                    let n: usize = shape.iter().product();
                    let on = f64::from(u8::from(decays(&params[i].0)));
                    Ok(Tensor::full(on, n, device)?.to_dtype(buckets.dtype)?)
                })
                .collect::<Result<_>>()?;
            let mask = buckets.pad(b, Tensor::cat(&mask, 0)?)?;
            let shard = buckets.shard(b, &mask)?.contiguous()?;
            m.push(shard.zeros_like()?);
            v.push(shard.zeros_like()?);
            decay.push(shard);
        }
        Ok(Self {
            config,
            vars: params.iter().map(|(_, v)| v.clone()).collect(),
            buckets,
            m,
            v,
            decay,
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
            let p = buckets.shard(b, &flat)?;
            let moments = Moments {
                m: &mut self.m[b],
                v: &mut self.v[b],
            };
            let decay = Decay::Mask(&self.decay[b]);
            let p = self.config.update(
                p,
                &shards[b].to_dtype(buckets.dtype)?,
                moments,
                lr,
                corrections,
                decay,
            )?;
            let whole = comm.all_gather(&p.contiguous()?)?;
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
