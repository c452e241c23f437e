//! Where the engine's host work runs, and the two thread settings of candle's CPU backend.
//!
//! On the CPU every matrix product fans out over rayon's worker threads. Called from a thread outside
//! that pool, each product hands its work to a sleeping worker and puts the caller to sleep until it
//! is done: two wake-ups per product, thousands of products per step. Run from a worker, the caller
//! is one of the threads doing the product and the other joins it by work stealing. So the engine
//! runs each phase on a worker ([`on_workers`]) and comes back to the caller's thread between
//! phases, where the hooks that may talk to other processes (a data-parallel reduction) run.

use candle_core::Device;

/// Runs `work` on one of rayon's worker threads (the caller waits) when `device` is the host and
/// the caller is not a worker already; elsewhere (an accelerator's kernels are queued by the
/// caller) it runs in place.
pub fn on_workers<R: Send>(device: &Device, work: impl FnOnce() -> R + Send) -> R {
    if device.is_cpu() && rayon::current_thread_index().is_none() {
        rayon::scope(|_| work())
    } else {
        work()
    }
}

/// Sets, for this process, the thread settings candle's CPU backend reads from the environment, unless
/// the user has set them:
/// - `RAYON_NUM_THREADS` to [`host_threads`]: left unset, candle recounts the cores, reading
///   `/proc/cpuinfo`, at every matrix product;
/// - `CANDLE_BARRIER_POOL_SPIN_LIMIT` to 200: after each large element-wise op, candle's second
///   pool spins 25,000 times by default before sleeping, on a core the next product's workers need
///   (measured in docs/benchmarks.md).
///
/// Call it first thing in `main`, before any other thread exists: it writes the process environment.
pub fn settle_thread_settings() {
    let settings = [
        ("RAYON_NUM_THREADS", host_threads().to_string()),
        ("CANDLE_BARRIER_POOL_SPIN_LIMIT", "200".to_string()),
    ];
    for (key, value) in settings {
        if std::env::var_os(key).is_none() {
            std::env::set_var(key, value);
        }
    }
}

/// The worker threads for the host's kernels: candle's count (the machine's physical cores, from
/// `/proc/cpuinfo`) capped by the cores this process may run on (its affinity mask and cgroup
/// quota: `taskset`, a container's `--cpuset-cpus`, a batch scheduler's allocation). Candle's
/// count alone ignores the mask: on a 16-core machine under `taskset -c 0,1` it would give 16
/// rayon workers and 15 spinning element-wise workers to two cores, which then mostly switch
/// between each other (docs/benchmarks.md, "16 worker threads on 2 cores").
pub fn host_threads() -> usize {
    let allowed = std::thread::available_parallelism().map_or(usize::MAX, |n| n.get());
    candle_core::utils::get_num_threads().min(allowed).max(1)
}
