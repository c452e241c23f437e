//! Ranks as threads of one process ([`LocalGroup`]): every collective of [`Communicator`] without a
//! library, for tests and examples that run several ranks side by side (each thread drives its own
//! rank's backward) and for a backend of one's own to start from.

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
    size: usize,
    slots: Arc<Mutex<Vec<Option<Tensor>>>>,
    barrier: Arc<Barrier>,
}

impl LocalGroup {
    /// The `n` ranks of a new group, rank `r` at index `r`: hand one to each thread.
    pub fn new(n: usize) -> Vec<Self> {
        let slots = Arc::new(Mutex::new(vec![None; n]));
        let barrier = Arc::new(Barrier::new(n));
        (0..n)
            .map(|rank| Self {
                rank,
                size: n,
                slots: slots.clone(),
                barrier: barrier.clone(),
            })
            .collect()
    }

    /// Every rank's `x`, in rank order.
    fn exchange(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let poisoned = |_| DistError::Backend("a rank of the local group panicked".into());
        self.slots.lock().map_err(poisoned)?[self.rank] = Some(x.clone());
        self.barrier.wait();
        let all = self
            .slots
            .lock()
            .map_err(poisoned)?
            .iter()
            .flatten()
            .cloned()
            .collect();
        // No rank overwrites its slot before every rank has read them all.
        self.barrier.wait();
        Ok(all)
    }
}

impl Communicator for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        check_flat(x)?;
        let all = self.exchange(x)?;
        Ok(all[1..].iter().try_fold(all[0].clone(), |acc, t| acc + t)?)
    }
    fn reduce_scatter_sum(&self, x: &Tensor) -> Result<Tensor> {
        let k = x.elem_count() / self.size;
        if k * self.size != x.elem_count() {
            return Err(DistError::Uneven {
                what: "reduce-scatter",
                len: x.elem_count(),
                world: self.size,
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
        self.barrier.wait();
        Ok(())
    }
    fn name(&self) -> &'static str {
        "local threads"
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
}
