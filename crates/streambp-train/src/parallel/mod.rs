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
//!   as soon as the layer's backward is done ([`streambp_core::FinishedGradients`]), they are reduce-scattered there
//!   (one collective per layer per backward) and the rank keeps its shard.

mod buckets;
mod sharded;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::Tensor;
use streambp_core::{
    backward_into, backward_sequence_parallel, backward_with, Batch, FinishedGradients, Gradients,
    Plan,
};
use streambp_dist::Communicator;
use streambp_models::Model;
use streambp_objectives::Objective;

pub use buckets::Buckets;
pub use sharded::{clip_sharded, ShardedAdamW, ShardedGradients};

use crate::checkpoint::OPTIMIZER_FILE;
use crate::optim::{clip_grad_norm, AdamW, AdamWConfig};
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
/// The optimizer of a run: over whole parameters (one process, ZeRO-0), or over this rank's shards.
enum Optimizer {
    Whole(AdamW),
    Sharded(ShardedAdamW),
}

/// The file of rank `rank`'s optimizer shard in a checkpoint of a `world`-rank run.
pub fn shard_file(rank: usize, world: usize) -> String {
    format!("optimizer-rank-{rank}-of-{world}.safetensors")
}

/// Bytes of training state one rank holds, by what they are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldBytes {
    /// AdamW's moments.
    pub optimizer: usize,
    /// The step's gradients accumulated so far (whole, or this rank's shards under ZeRO-2).
    pub gradients: usize,
}

fn bytes(tensors: impl IntoIterator<Item = Tensor>) -> usize {
    tensors
        .into_iter()
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum()
}

/// One rank's side of data-parallel training: each micro-batch's backward with its gradients kept
/// whole (ZeRO-0/1) or reduced into this rank's shards layer by layer (ZeRO-2), then the step:
/// reduction over ranks, clipping to the global norm, AdamW (whole or sharded). With one process and
/// ZeRO-0 it is plain training.
pub struct DataParallel {
    comm: Arc<dyn Communicator>,
    /// The ranks each sequence is split over (`--sp`), when it is.
    sequence: Option<Arc<dyn Communicator>>,
    zero: ZeroStage,
    buckets: Arc<Buckets>,
    optimizer: Optimizer,
    /// ZeRO-0/1: the step's whole gradients, weighted as added.
    grads: Option<Vec<(String, Tensor)>>,
    /// ZeRO-2: the shards the engine's backward reduces into.
    shards: Option<ShardedGradients>,
}

impl DataParallel {
    /// Zero moments for `model`'s trainable parameters (this rank's shards from ZeRO-1 on).
    pub fn new(
        model: &Model,
        (comm, sequence): (Arc<dyn Communicator>, Option<Arc<dyn Communicator>>),
        zero: ZeroStage,
        adamw: AdamWConfig,
    ) -> Result<Self> {
        let buckets = Arc::new(Buckets::new(model, comm.world_size(), comm.rank()));
        let optimizer = match zero {
            ZeroStage::Zero0 => Optimizer::Whole(AdamW::new(model.parameters(), adamw)?),
            _ => Optimizer::Sharded(ShardedAdamW::new(model, buckets.clone(), adamw)?),
        };
        let shards = (zero == ZeroStage::Zero2)
            .then(|| ShardedGradients::new(buckets.clone(), comm.clone()));
        Ok(Self {
            comm,
            sequence,
            zero,
            buckets,
            optimizer,
            grads: None,
            shards,
        })
    }

    /// One micro-batch's backward, its gradients scaled by `weight` (its share of the step's loss) and
    /// added to the step's; the result carries the loss, metrics and phases (not the gradients).
    pub fn backward(
        &mut self,
        model: &Model,
        batch: Batch,
        objective: &dyn Objective,
        plan: Plan,
        weight: f64,
    ) -> Result<Gradients> {
        let sequence = self.sequence.as_deref();
        if let Some(shards) = self.shards.as_mut() {
            shards.weight = weight;
            return engine_backward(sequence, (model, batch, objective, plan), Some(shards));
        }
        let mut out = engine_backward(sequence, (model, batch, objective, plan), None)?;
        let grads = weighted(std::mem::take(&mut out.grads), weight)?;
        self.grads = Some(match self.grads.take() {
            None => grads,
            Some(acc) => acc
                .into_iter()
                .zip(grads)
                .map(|((n, a), (_, g))| Ok((n, (a + g)?)))
                .collect::<Result<Vec<_>>>()?,
        });
        Ok(out)
    }

    /// The step: the accumulated gradients summed over ranks, clipped to a global L2 norm of
    /// `max_grad_norm` (0: not clipped), applied at rate `lr`. Returns the norm before clipping.
    pub fn step(&mut self, max_grad_norm: f64, lr: f64) -> Result<f64> {
        let comm = self.comm.clone();
        let grads = self.grads.take().unwrap_or_default();
        match &mut self.optimizer {
            Optimizer::Whole(adamw) => {
                let mut grads = match comm.world_size() {
                    1 => grads,
                    _ => self.buckets.all_reduce(comm.as_ref(), grads)?,
                };
                let norm = clip_grad_norm(&mut grads, max_grad_norm)?;
                adamw.apply(&grads, lr)?;
                Ok(norm)
            }
            Optimizer::Sharded(adamw) => {
                let mut shards = match (self.zero, self.shards.as_mut()) {
                    (ZeroStage::Zero2, Some(s)) => s.take()?,
                    _ => {
                        // ZeRO-1: the whole step's gradients, reduced bucket by bucket.
                        let mut sharded = ShardedGradients::new(self.buckets.clone(), comm.clone());
                        for group in self.buckets.groups(grads) {
                            sharded.add(&group)?;
                        }
                        sharded.take()?
                    }
                };
                let norm = clip_sharded(comm.as_ref(), &mut shards, max_grad_norm)?;
                adamw.apply(comm.as_ref(), &shards, lr)?;
                Ok(norm)
            }
        }
    }

    /// What a checkpoint keeps of the optimizer on this rank: `(file name, tensors)`, or nothing on
    /// ranks other than 0 when the state is whole (the same on every rank).
    pub fn state(&self) -> Option<(String, HashMap<String, Tensor>)> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        match &self.optimizer {
            Optimizer::Whole(_) if rank > 0 => None,
            Optimizer::Whole(o) => Some((OPTIMIZER_FILE.to_string(), o.state())),
            Optimizer::Sharded(o) => Some((shard_file(rank, world), o.state())),
        }
    }

    /// Restores this rank's optimizer state of step `step` from checkpoint `dir`.
    pub fn load_state(
        &mut self,
        dir: &Path,
        step: usize,
        device: &candle_core::Device,
    ) -> Result<()> {
        let file = match &self.optimizer {
            Optimizer::Whole(_) => OPTIMIZER_FILE.to_string(),
            Optimizer::Sharded(_) => shard_file(self.comm.rank(), self.comm.world_size()),
        };
        let path = dir.join(file);
        let moments = candle_core::safetensors::load(&path, device)
            .map_err(|e| TrainError::Checkpoint(format!("cannot read {}: {e}", path.display())))?;
        match &mut self.optimizer {
            Optimizer::Whole(o) => o.load_state(&moments, step),
            Optimizer::Sharded(o) => o.load_state(&moments, step),
        }
    }

    /// The bytes of optimizer state and gradients this rank holds now (tensor sizes, the same on any
    /// device): what ZeRO divides over the ranks.
    pub fn held_bytes(&self) -> HeldBytes {
        let optimizer = match &self.optimizer {
            Optimizer::Whole(o) => bytes(o.state().into_values()),
            Optimizer::Sharded(o) => bytes(o.state().into_values()),
        };
        let gradients = match (&self.grads, &self.shards) {
            (Some(g), _) => bytes(g.iter().map(|(_, t)| t.clone())),
            (None, Some(s)) => bytes(s.shards.iter().flatten().cloned()),
            (None, None) => 0,
        };
        HeldBytes {
            optimizer,
            gradients,
        }
    }
}

fn weighted(grads: Vec<(String, Tensor)>, weight: f64) -> Result<Vec<(String, Tensor)>> {
    match weight {
        1.0 => Ok(grads),
        w => grads.into_iter().map(|(n, g)| Ok((n, (g * w)?))).collect(),
    }
}

/// The engine's backward on this rank: over its positions of a split `sequence`, or its whole rows;
/// gradients handed to `finished` as each group of them is done, or returned. On a split sequence
/// each rank's gradients are its share: the reduction over all ranks sums the shares as it sums the
/// data-parallel ranks' gradients.
fn engine_backward(
    sequence: Option<&dyn Communicator>,
    (model, batch, objective, plan): (&Model, Batch, &dyn Objective, Plan),
    finished: Option<&mut dyn FinishedGradients>,
) -> Result<Gradients> {
    Ok(match (sequence, finished) {
        (Some(group), finished) => {
            backward_sequence_parallel(model, batch, objective, plan, group, finished)?
        }
        (None, Some(finished)) => backward_into(model, batch, objective, plan, finished)?,
        (None, None) => backward_with(model, batch, objective, plan)?,
    })
}

/// The groups a job's ranks form.
pub struct ParallelGroups {
    /// The data-parallel ranks (each its own rows of every global batch).
    pub data: Arc<dyn Communicator>,
    /// The ranks each sequence is split over, when it is.
    pub sequence: Option<Arc<dyn Communicator>>,
}

/// The groups of a job whose ranks are `world`, for `--sp sp` (a divisor of the number of ranks):
/// consecutive runs of `sp` ranks each split their sequences (rank `r` in group `r / sp`, its rank
/// `r % sp` there deciding its positions; on a node, consecutive ranks share its links), and the ranks
/// of the same rank in their groups form the data-parallel groups, each taking its group's rows of
/// every global batch.
pub fn parallel_groups(world: Arc<dyn Communicator>, sp: usize) -> Result<ParallelGroups> {
    let ranks = world.world_size();
    if sp == 1 {
        return Ok(ParallelGroups {
            data: world,
            sequence: None,
        });
    }
    if sp == 0 || !ranks.is_multiple_of(sp) {
        return Err(TrainError::flag(
            "--sp",
            sp,
            format!("must divide the job's number of ranks ({ranks})"),
        ));
    }
    let rank = world.rank();
    // Every rank splits in this order.
    let sequence = world.split(rank / sp)?;
    let data = world.split(rank % sp)?;
    Ok(ParallelGroups {
        data,
        sequence: Some(sequence),
    })
}
