//! Ranks as threads of one process ([`LocalGroup`]): every collective of [`Communicator`] without a
//! library, for tests and examples that run several ranks side by side (each thread drives its own
//! rank's backward) and for a backend of one's own to start from.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use candle_core::{DType, Device, Tensor};

use crate::{check_flat, Communicator, DistError, Result};

/// One rank of a group of threads. Each collective puts this rank's value in a slot, waits for the
/// others, and combines the slots in rank order, so every rank gets the same bits.
///
/// A collective blocks its thread until every rank has called it: where ranks call collectives from
/// inside rayon work (the engine's sequence parallelism does), give each rank's thread a rayon pool
/// of its own (`ThreadPoolBuilder::build()?.install(..)`), or a waiting rank holds a worker the
/// others need.
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
    /// Splits this rank has made: the ranks of a split agree on its number, as they call them in
    /// the same order.
    splits: AtomicU64,
}

/// What the ranks of one group share.
struct Shared {
    size: usize,
    slots: Mutex<Vec<Option<Tensor>>>,
    barrier: Barrier,
    /// The groups split from this one, by split number and color: the first member to arrive makes
    /// a group's shared part, the others join it.
    groups: Mutex<HashMap<(u64, usize), Arc<Shared>>>,
}

impl Shared {
    fn new(n: usize) -> Arc<Self> {
        Arc::new(Self {
            size: n,
            slots: Mutex::new(vec![None; n]),
            barrier: Barrier::new(n),
            groups: Mutex::new(HashMap::new()),
        })
    }
}

fn poisoned<T>(_: T) -> DistError {
    DistError::Backend("a rank of the local group panicked".into())
}

impl LocalGroup {
    /// The `n` ranks of a new group, rank `r` at index `r`: hand one to each thread.
    pub fn new(n: usize) -> Vec<Self> {
        let shared = Shared::new(n);
        (0..n)
            .map(|rank| Self::member(rank, shared.clone()))
            .collect()
    }

    fn member(rank: usize, shared: Arc<Shared>) -> Self {
        Self {
            rank,
            shared,
            splits: AtomicU64::new(0),
        }
    }

    /// Every rank's `x`, in rank order.
    fn exchange(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        self.shared.slots.lock().map_err(poisoned)?[self.rank] = Some(x.clone());
        self.shared.barrier.wait();
        let all = self
            .shared
            .slots
            .lock()
            .map_err(poisoned)?
            .iter()
            .flatten()
            .cloned()
            .collect();
        // No rank overwrites its slot before every rank has read them all.
        self.shared.barrier.wait();
        Ok(all)
    }
}

impl Communicator for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.shared.size
    }
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        check_flat(x)?;
        let all = self.exchange(x)?;
        Ok(all[1..].iter().try_fold(all[0].clone(), |acc, t| acc + t)?)
    }
    fn reduce_scatter_sum(&self, x: &Tensor) -> Result<Tensor> {
        let world = self.world_size();
        let k = x.elem_count() / world;
        if k * world != x.elem_count() {
            return Err(DistError::Uneven {
                what: "reduce-scatter",
                len: x.elem_count(),
                world,
            });
        }
        Ok(self.all_reduce_sum(x)?.narrow(0, self.rank * k, k)?)
    }
    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        check_flat(x)?;
        Ok(Tensor::cat(&self.exchange(x)?, 0)?)
    }
    fn sum(&self, x: f64) -> Result<f64> {
        let t = self.all_reduce_sum(&Tensor::new(&[x], &Device::Cpu)?)?;
        Ok(t.to_vec1::<f64>()?[0])
    }
    fn broadcast(&self, x: u64) -> Result<u64> {
        let halves = Tensor::new(&[(x >> 32) as u32, x as u32], &Device::Cpu)?;
        let first = self.exchange(&halves)?[0]
            .to_dtype(DType::U32)?
            .to_vec1::<u32>()?;
        Ok((u64::from(first[0]) << 32) | u64::from(first[1]))
    }
    fn barrier(&self) -> Result<()> {
        self.shared.barrier.wait();
        Ok(())
    }
    fn name(&self) -> &'static str {
        "local threads"
    }
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator>> {
        let split = self.splits.fetch_add(1, Ordering::Relaxed);
        let wire = u32::try_from(color)
            .map_err(|_| DistError::Backend(format!("group color {color} out of range")))?;
        let colors = self.exchange(&Tensor::new(&[wire], &Device::Cpu)?)?;
        let colors: Vec<u32> = colors
            .iter()
            .map(|c| Ok(c.to_vec1::<u32>()?[0]))
            .collect::<Result<_>>()?;
        let members: Vec<usize> = (0..colors.len()).filter(|&r| colors[r] == wire).collect();
        let rank = members
            .iter()
            .position(|&r| r == self.rank)
            .ok_or_else(|| DistError::Backend("a rank missing from its own group".into()))?;
        let shared = self
            .shared
            .groups
            .lock()
            .map_err(poisoned)?
            .entry((split, color))
            .or_insert_with(|| Shared::new(members.len()))
            .clone();
        Ok(Arc::new(Self::member(rank, shared)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collectives_combine_every_rank_in_order() {
        let ranks = LocalGroup::new(3);
        let out: Vec<(Vec<f64>, Vec<f64>, f64, u64)> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|comm| {
                    s.spawn(move || {
                        let r = comm.rank() as f64;
                        let x = Tensor::new(&[r, 10.0 + r, 20.0 + r], &Device::Cpu).unwrap();
                        let scattered = comm.reduce_scatter_sum(&x).unwrap();
                        let gathered = comm.all_gather(&scattered).unwrap();
                        let seed = comm.broadcast(u64::MAX - comm.rank() as u64).unwrap();
                        (
                            scattered.to_vec1::<f64>().unwrap(),
                            gathered.to_vec1::<f64>().unwrap(),
                            comm.sum(r).unwrap(),
                            seed,
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (scattered, gathered, sum, seed)) in out.into_iter().enumerate() {
            assert_eq!(scattered, vec![3.0 + 30.0 * rank as f64]);
            assert_eq!(gathered, vec![3.0, 33.0, 63.0]);
            assert_eq!(sum, 3.0);
            assert_eq!(seed, u64::MAX, "rank 0's value");
        }
    }

    #[test]
    fn split_groups_talk_among_themselves() {
        let ranks = LocalGroup::new(4);
        let out: Vec<(usize, usize, f64, f64)> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|comm| {
                    s.spawn(move || {
                        let r = comm.rank();
                        // Pairs {0, 1}, {2, 3}, then {0, 2}, {1, 3}.
                        let pair = comm.split(r / 2).unwrap();
                        let across = comm.split(r % 2).unwrap();
                        let x = Tensor::new(&[r as f64], &Device::Cpu).unwrap();
                        let in_pair = pair.all_reduce_sum(&x).unwrap().to_vec1::<f64>().unwrap();
                        (
                            pair.rank(),
                            across.rank(),
                            in_pair[0],
                            across.sum(r as f64).unwrap(),
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(
            out,
            vec![
                (0, 0, 1.0, 2.0),
                (1, 0, 1.0, 4.0),
                (0, 1, 5.0, 2.0),
                (1, 1, 5.0, 4.0)
            ]
        );
    }

    #[test]
    fn numbers_of_any_length_gather_in_rank_order() {
        let ranks = LocalGroup::new(3);
        // Rank r holds r numbers: none, one, two.
        let out: Vec<Vec<f64>> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|comm| {
                    s.spawn(move || {
                        let r = comm.rank();
                        let local: Vec<f64> = (0..r).map(|i| (10 * r + i) as f64).collect();
                        crate::gather_numbers(comm, &local, &Device::Cpu).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(out, vec![vec![10.0, 20.0, 21.0]; 3]);
        let none = crate::gather_numbers(&crate::SingleProcess, &[], &Device::Cpu).unwrap();
        assert!(none.is_empty());
    }
}
