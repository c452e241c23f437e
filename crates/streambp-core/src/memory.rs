//! Exact memory accounting. On the host: a global allocator that counts live bytes and their peak.
//! Binaries and benches install it with
//! `#[global_allocator] static ALLOC: streambp_core::memory::CountingAllocator = CountingAllocator;`;
//! without it every host figure reads as `None`. On CUDA (feature `cuda`): the device's own counters of
//! its memory pool, from which candle allocates (stream-ordered `cuMemAllocAsync`). A [`Meter`] reads
//! whichever the model's device uses.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static PROCESS_PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Tells the C allocator (glibc's, which `System` is on Linux) to keep freed buffers for reuse. By
/// default it serves each buffer above an adaptive threshold (128 KiB at first) by `mmap` and gives
/// it back on free, and gives freed heap back above another: a step's buffers of a few MiB are then
/// page-faulted and zeroed by the kernel again at every step. The default `sft --dtype bf16` run
/// spent a third of its time there (2.0 M page faults in 150 steps, 13 K with these settings): up to
/// 32 MiB (glibc's limit) from the heap, freed heap kept up to 128 MiB. What is counted is unchanged
/// (requested bytes); the process may hold up to 128 MiB more than it uses. Call it at the start
/// of `main`; elsewhere than glibc it does nothing.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets two of the allocator's parameters; called before any thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 128 << 20);
    }
}

/// `System` with a count of live bytes and of their peak.
pub struct CountingAllocator;

fn grow(bytes: usize) {
    let now = CURRENT.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
    PROCESS_PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to `System` unchanged; the counters are only bookkeeping.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            INSTALLED.store(true, Ordering::Relaxed);
            grow(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            INSTALLED.store(true, Ordering::Relaxed);
            grow(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            if new_size >= layout.size() {
                grow(new_size - layout.size());
            } else {
                CURRENT.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

/// Whether the counting allocator is the global allocator of this process.
pub fn is_counting() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// Live heap bytes now (None without the counting allocator).
pub fn current_bytes() -> Option<usize> {
    is_counting().then(|| CURRENT.load(Ordering::Relaxed))
}

/// The most live heap bytes since the last [`reset_peak`].
pub fn peak_bytes() -> Option<usize> {
    is_counting().then(|| PEAK.load(Ordering::Relaxed))
}

/// The most live heap bytes since the process started (never reset: loading data, training and
/// saving together).
pub fn process_peak_bytes() -> Option<usize> {
    is_counting().then(|| PROCESS_PEAK.load(Ordering::Relaxed))
}

/// Starts a new peak measurement from the current level.
pub fn reset_peak() {
    PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// Where live and peak bytes are read for a device.
#[derive(Debug, Clone)]
pub enum Meter {
    /// The counting allocator (the CPU backend's tensors live on the heap).
    Host,
    /// The CUDA device's memory pool counters.
    #[cfg(feature = "cuda")]
    Cuda(cuda_pool::PoolMeter),
}

impl Meter {
    /// The meter of `device`'s memory (the host's when the pool cannot be read).
    pub fn for_device(device: &candle_core::Device) -> Self {
        match device {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(d) => match cuda_pool::PoolMeter::new(d) {
                Some(m) => Self::Cuda(m),
                None => {
                    tracing::warn!("cannot read the CUDA memory pool; reporting host memory");
                    Self::Host
                }
            },
            _ => Self::Host,
        }
    }

    /// Live bytes now.
    pub fn current_bytes(&self) -> Option<usize> {
        match self {
            Self::Host => current_bytes(),
            #[cfg(feature = "cuda")]
            Self::Cuda(m) => m.current(),
        }
    }

    /// The most live bytes since the last [`Meter::reset_peak`].
    pub fn peak_bytes(&self) -> Option<usize> {
        match self {
            Self::Host => peak_bytes(),
            #[cfg(feature = "cuda")]
            Self::Cuda(m) => m.peak(),
        }
    }

    /// Starts a new peak measurement from the current level.
    pub fn reset_peak(&self) {
        match self {
            Self::Host => reset_peak(),
            #[cfg(feature = "cuda")]
            Self::Cuda(m) => m.reset_peak(),
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda_pool {
    use std::ffi::c_void;
    use std::sync::Arc;

    use cudarc::driver::result::{device, mem_pool};
    use cudarc::driver::sys::{CUmemPool_attribute, CUmemoryPool};
    use cudarc::driver::CudaContext;

    /// The `USED_MEM_CURRENT` / `USED_MEM_HIGH` counters of a device's current memory pool.
    #[derive(Clone)]
    pub struct PoolMeter {
        context: Arc<CudaContext>,
        pool: CUmemoryPool,
        /// Bytes in use when the peak was last reset: the high-water mark restarts from zero, so a
        /// phase that only frees memory would otherwise read lower than where it began.
        floor: Arc<std::sync::atomic::AtomicUsize>,
    }

    // SAFETY: the pool handle is a driver object valid for the context's lifetime, which the meter
    // holds; the driver API is thread-safe once the context is bound.
    unsafe impl Send for PoolMeter {}
    // SAFETY: as for Send: the driver calls it makes are thread-safe.
    unsafe impl Sync for PoolMeter {}

    impl std::fmt::Debug for PoolMeter {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "PoolMeter(device {})", self.context.ordinal())
        }
    }

    impl PoolMeter {
        /// The meter of `device`'s current pool; None when candle does not allocate from it (no
        /// stream-ordered allocation) or the pool cannot be read.
        pub fn new(device: &candle_core::CudaDevice) -> Option<Self> {
            let context = device.cuda_stream().context().clone();
            // Without stream-ordered allocation cudarc uses cuMemAlloc, which the pool never sees.
            if !context.has_async_alloc() {
                return None;
            }
            context.bind_to_thread().ok()?;
            // SAFETY: the device comes from a live context.
            let pool = unsafe { device::get_mem_pool(context.cu_device()) }.ok()?;
            Some(Self {
                context,
                pool,
                floor: Default::default(),
            })
        }

        fn read(&self, attribute: CUmemPool_attribute) -> Option<usize> {
            self.context.bind_to_thread().ok()?;
            let mut value: u64 = 0;
            // SAFETY: both attributes are u64 counters of a valid pool.
            unsafe {
                mem_pool::get_attribute(self.pool, attribute, &mut value as *mut u64 as *mut c_void)
            }
            .ok()?;
            Some(value as usize)
        }

        /// Bytes in use in the pool now.
        pub fn current(&self) -> Option<usize> {
            self.read(CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
        }

        /// The most bytes in use since the last [`PoolMeter::reset_peak`].
        pub fn peak(&self) -> Option<usize> {
            let high = self.read(CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?;
            let floor = self.floor.load(std::sync::atomic::Ordering::Relaxed);
            Some(high.max(floor).max(self.current()?))
        }

        /// Starts a new peak measurement from the current level.
        pub fn reset_peak(&self) {
            if self.context.bind_to_thread().is_err() {
                return;
            }
            if let Some(now) = self.current() {
                self.floor.store(now, std::sync::atomic::Ordering::Relaxed);
            }
            // The high watermark can only be reset to zero; it then follows the next allocations.
            let mut zero: u64 = 0;
            // SAFETY: a u64 counter of a valid pool.
            let _ = unsafe {
                mem_pool::set_attribute(
                    self.pool,
                    CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    &mut zero as *mut u64 as *mut c_void,
                )
            };
        }
    }
}

/// What one phase of a backward cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    /// `full` in [`crate::Mode::Full`]; otherwise `forward`, `head`, `layers`, then `embedding`.
    pub name: &'static str,
    /// Peak live bytes during the phase, as the device's [`Meter`] reads them (None on the host
    /// without the counting allocator).
    pub peak_bytes: Option<usize>,
    /// Wall-clock seconds of the phase, the device synchronised at its end.
    pub seconds: f64,
}

/// Peak bytes and seconds of each phase of a backward, in order.
#[derive(Debug, Clone)]
pub struct PhaseLog {
    /// The phases recorded so far, in the order they ran.
    pub phases: Vec<Phase>,
    started: std::time::Instant,
    meter: Meter,
    /// Synchronised at each phase end so that an accelerator's queued work is timed in its phase.
    device: candle_core::Device,
}

impl Default for PhaseLog {
    fn default() -> Self {
        Self::start()
    }
}

impl PhaseLog {
    /// Starts measuring the first phase, on the host.
    pub fn start() -> Self {
        Self::start_on(&candle_core::Device::Cpu)
    }

    /// Starts measuring the first phase of work on `device`.
    pub fn start_on(device: &candle_core::Device) -> Self {
        let meter = Meter::for_device(device);
        meter.reset_peak();
        Self {
            phases: Vec::new(),
            started: std::time::Instant::now(),
            meter,
            device: device.clone(),
        }
    }

    /// Ends a phase: records its peak and time, and starts the next phase's measurement.
    pub fn record(&mut self, name: &'static str) {
        if let Err(e) = self.device.synchronize() {
            tracing::warn!("device synchronize failed: {e}");
        }
        let now = std::time::Instant::now();
        self.phases.push(Phase {
            name,
            peak_bytes: self.meter.peak_bytes(),
            seconds: (now - self.started).as_secs_f64(),
        });
        self.started = now;
        self.meter.reset_peak();
    }

    /// The highest peak over all phases.
    pub fn overall_peak(&self) -> Option<usize> {
        self.phases.iter().filter_map(|p| p.peak_bytes).max()
    }
}
