//! Exact host-memory accounting: a global allocator that counts live bytes and their peak.
//!
//! Binaries and benches install it with
//! `#[global_allocator] static ALLOC: streambp_core::memory::CountingAllocator = CountingAllocator;`.
//! Without it every figure reads as `None`. On CUDA the device memory is not seen here.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// `System` with a count of live bytes and of their peak.
pub struct CountingAllocator;

fn grow(bytes: usize) {
    let now = CURRENT.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
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

/// Starts a new peak measurement from the current level.
pub fn reset_peak() {
    PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// What one phase of a backward cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    pub name: &'static str,
    /// Peak live heap bytes during the phase (None without the counting allocator).
    pub peak_bytes: Option<usize>,
    pub seconds: f64,
}

/// Peak bytes and seconds of each phase of a backward, in order.
#[derive(Debug, Clone)]
pub struct PhaseLog {
    pub phases: Vec<Phase>,
    started: std::time::Instant,
}

impl Default for PhaseLog {
    fn default() -> Self {
        Self::start()
    }
}

impl PhaseLog {
    /// Starts measuring the first phase.
    pub fn start() -> Self {
        reset_peak();
        Self {
            phases: Vec::new(),
            started: std::time::Instant::now(),
        }
    }

    /// Ends a phase: records its peak and time, and starts the next phase's measurement.
    pub fn record(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        self.phases.push(Phase {
            name,
            peak_bytes: peak_bytes(),
            seconds: (now - self.started).as_secs_f64(),
        });
        self.started = now;
        reset_peak();
    }

    /// The highest peak over all phases.
    pub fn overall_peak(&self) -> Option<usize> {
        self.phases.iter().filter_map(|p| p.peak_bytes).max()
    }
}
