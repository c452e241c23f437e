//! The trainable parameters grouped in buckets (one per decoder layer, one for the rest), each
//! flattened in the model's parameter order, zero-padded to a multiple of the ranks and split into one
//! shard per rank: what ZeRO-1/2 reduce-scatter, update and all-gather.

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use streambp_dist::Communicator;
use streambp_models::Model;

use crate::{Result, TrainError};

/// Every shard's length is a multiple of this many elements (16 bytes of f32), so each rank's
/// shard starts where the card's kernels can read it (AdamW's in place).
const SHARD_ALIGN: usize = 4;

/// One group of parameters, flattened and sharded.
#[derive(Debug, Clone)]
pub(super) struct Bucket {
    /// Indices into the model's trainable parameters, in order.
    pub(super) params: Vec<usize>,
    /// Their shapes.
    pub(super) shapes: Vec<Vec<usize>>,
    /// Elements before padding.
    len: usize,
    /// Elements after padding to a multiple of the number of ranks times [`SHARD_ALIGN`].
    pub(super) padded: usize,
}

/// The trainable parameters' buckets, and what this rank owns of them.
#[derive(Debug, Clone)]
pub struct Buckets {
    pub(super) buckets: Vec<Bucket>,
    /// The bucket of each parameter and its position there, by name.
    of_param: HashMap<String, (usize, usize)>,
    pub(super) world: usize,
    rank: usize,
    /// What gradients are summed in: f32, or f64 for an f64 model.
    pub(super) dtype: DType,
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
                    padded: len.div_ceil(SHARD_ALIGN * world) * SHARD_ALIGN * world,
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

    pub(super) fn pad(&self, b: usize, flat: Tensor) -> Result<Tensor> {
        let extra = self.buckets[b].padded - self.buckets[b].len;
        Ok(match extra {
            0 => flat,
            n => Tensor::cat(&[&flat, &Tensor::zeros(n, flat.dtype(), flat.device())?], 0)?,
        })
    }

    /// This rank's shard of the flat, padded `flat` of bucket `b`.
    pub(super) fn shard(&self, b: usize, flat: &Tensor) -> Result<Tensor> {
        let range = self.shard_range(b);
        Ok(flat.narrow(0, range.start, range.len())?)
    }

    /// Where this rank's shard of bucket `b` lies in the flat, padded bucket.
    fn shard_range(&self, b: usize) -> std::ops::Range<usize> {
        let n = self.buckets[b].padded / self.world;
        self.rank * n..(self.rank + 1) * n
    }

    /// This rank's shard of bucket `b` as runs of one parameter each: `(start in the shard,
    /// length, the parameter's index)`, the padding's run with `None`.
    pub(super) fn shard_runs(&self, b: usize) -> Vec<(usize, usize, Option<usize>)> {
        let bucket = &self.buckets[b];
        let shard = self.shard_range(b);
        let mut at = 0;
        let mut pieces: Vec<(std::ops::Range<usize>, Option<usize>)> = Vec::new();
        for (&i, shape) in bucket.params.iter().zip(&bucket.shapes) {
            let n: usize = shape.iter().product();
            pieces.push((at..at + n, Some(i)));
            at += n;
        }
        pieces.push((bucket.len..bucket.padded, None));
        pieces
            .into_iter()
            .filter_map(|(range, param)| {
                let (start, end) = (range.start.max(shard.start), range.end.min(shard.end));
                (start < end).then(|| (start - shard.start, end - start, param))
            })
            .collect()
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

    /// Every parameter's gradient summed over ranks (ZeRO-0), one all-reduce per bucket (so the step
    /// holds one bucket's copy beyond the gradients, not the whole model's); returned in `grads`' order.
    pub fn all_reduce(
        &self,
        comm: &dyn Communicator,
        grads: Vec<(String, Tensor)>,
    ) -> Result<Vec<(String, Tensor)>> {
        let names: Vec<String> = grads.iter().map(|(n, _)| n.clone()).collect();
        let mut summed: HashMap<String, Tensor> = HashMap::with_capacity(names.len());
        for group in self.groups(grads).into_iter().filter(|g| !g.is_empty()) {
            let (b, flat) = self.flatten(&group)?;
            let flat = comm.all_reduce_sum(&flat)?;
            let offsets: Vec<usize> = self.buckets[b]
                .shapes
                .iter()
                .scan(0, |at, shape| {
                    let start = *at;
                    *at += shape.iter().product::<usize>();
                    Some(start)
                })
                .collect();
            for (name, g) in group {
                let at = offsets[self.of_param[&name].1];
                let part = flat
                    .narrow(0, at, g.elem_count())?
                    .reshape(g.shape())?
                    .to_dtype(g.dtype())?;
                summed.insert(name, part);
            }
        }
        names
            .into_iter()
            .map(|name| {
                let g = summed.remove(&name).ok_or_else(|| {
                    TrainError::Internal(format!("no bucket holds the gradient of {name}"))
                })?;
                Ok((name, g))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runs of every rank's shard tile it exactly, each inside one parameter (or the padding)
    /// at its place in the bucket, for 1 to 4 ranks and lengths that do and do not divide.
    #[test]
    fn shard_runs_tile_each_shard_by_parameter() {
        for shapes in [
            vec![vec![3, 5], vec![7], vec![2, 2]],
            vec![vec![16, 4]],
            vec![vec![1]],
        ] {
            let sizes: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
            let len: usize = sizes.iter().sum();
            for world in 1..=4 {
                let padded = len.div_ceil(SHARD_ALIGN * world) * SHARD_ALIGN * world;
                let mut owner: Vec<Option<usize>> = Vec::new();
                for (i, &n) in sizes.iter().enumerate() {
                    owner.extend(std::iter::repeat_n(Some(i), n));
                }
                owner.resize(padded, None);
                for rank in 0..world {
                    let buckets = Buckets {
                        buckets: vec![Bucket {
                            params: (0..sizes.len()).collect(),
                            shapes: shapes.clone(),
                            len,
                            padded,
                        }],
                        of_param: HashMap::new(),
                        world,
                        rank,
                        dtype: DType::F32,
                    };
                    let n = padded / world;
                    assert_eq!(n % SHARD_ALIGN, 0);
                    let mut next = 0;
                    for (start, run, param) in buckets.shard_runs(0) {
                        assert_eq!(start, next, "runs in order, without gaps");
                        assert!(run > 0);
                        let at = rank * n + start;
                        assert!(owner[at..at + run].iter().all(|o| *o == param), "{param:?}");
                        next = start + run;
                    }
                    assert_eq!(next, n, "world {world} rank {rank}: the whole shard");
                }
            }
        }
    }
}
