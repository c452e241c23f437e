//! Where a step's time goes, part by part, on any device. The engine and the attention op time their
//! parts through [`timed`], which costs one atomic load while off (the default). Switched on (the
//! bench's `--op-times`), each timed part synchronises its device before and after, so that an
//! accelerator's queued kernels count in the part that queued them rather than in whichever later
//! part waits for them. The synchronisation slows the step itself, so the figures are shares of a
//! step, not its time. A part may run inside another (the attention op's inside the engine's
//! layer parts, each tensor op's inside its step of the op), so shares can add up to more than
//! the step. Totals are over every thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use candle_core::Device;

static ON: AtomicBool = AtomicBool::new(false);
static TOTALS: Mutex<Vec<OpTime>> = Mutex::new(Vec::new());

/// One part's calls and seconds since the last [`take`].
#[derive(Debug, Clone, PartialEq)]
pub struct OpTime {
    /// The part, dotted by what holds it (`attention.forward.scores`).
    pub name: &'static str,
    /// How many times it ran.
    pub calls: u64,
    /// Its seconds, each call's device work included.
    pub seconds: f64,
}

/// Switches the timing of parts on or off, for the whole process.
pub fn switch(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Whether parts are being timed.
pub fn is_on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Runs `f` as the part `name` of work on `device`, adding its time to the part's total when timing
/// is on.
pub fn timed<T, E>(
    name: &'static str,
    device: &Device,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    if !is_on() {
        return f();
    }
    settle(device);
    let start = Instant::now();
    let out = f();
    settle(device);
    add(name, start.elapsed().as_secs_f64());
    out
}

/// The totals since the last call, in the order each part first finished; the totals start again
/// at zero.
pub fn take() -> Vec<OpTime> {
    std::mem::take(&mut *totals())
}

/// Waits for the device's queued work (nothing to wait for on the host).
fn settle(device: &Device) {
    if let Err(e) = device.synchronize() {
        tracing::warn!("op times: device synchronize failed: {e}");
    }
}

fn add(name: &'static str, seconds: f64) {
    let mut totals = totals();
    match totals.iter_mut().find(|t| t.name == name) {
        Some(t) => {
            t.calls += 1;
            t.seconds += seconds;
        }
        None => totals.push(OpTime {
            name,
            calls: 1,
            seconds,
        }),
    }
}

/// The totals, also after a thread panicked while holding them (they are plain sums).
fn totals() -> MutexGuard<'static, Vec<OpTime>> {
    TOTALS.lock().unwrap_or_else(PoisonError::into_inner)
}
