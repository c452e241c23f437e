//! Which implementation of an op runs: the kernel of the tensor's device, or the composed tensor
//! ops. Every op in [`crate::ops`] asks [`Backend::of`] its input and matches on the answer, so a
//! kernel for a new device is one more arm in each op that has one.

use std::cell::Cell;

use candle_core::{Device, Tensor};

/// Where an op's forward and backward run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The host's kernels (f32/f64; half precision computed in f32 by those that take it).
    Cpu,
    /// The card's kernels, for the ops that have one; the others compose tensor ops there.
    Cuda,
    /// The composed tensor ops: every device's path, and the reference the kernels are held to.
    Composed,
}

thread_local! {
    /// Set by [`with_composed`].
    static COMPOSED: Cell<bool> = const { Cell::new(false) };
}

impl Backend {
    /// The backend of ops on `t`: its device's, or [`Backend::Composed`] on a device without
    /// kernels and inside [`with_composed`].
    pub fn of(t: &Tensor) -> Self {
        if COMPOSED.with(Cell::get) {
            return Self::Composed;
        }
        match t.device() {
            Device::Cpu => Self::Cpu,
            Device::Cuda(_) => Self::Cuda,
            Device::Metal(_) => Self::Composed,
        }
    }
}

/// Runs `f` with the ops it makes and differentiates on this thread taking the composed backend
/// whatever their device, restored however `f` ends (a failing test's panic included): the path a
/// device without kernels runs, checked on the CPU by the tests.
pub fn with_composed<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            COMPOSED.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(COMPOSED.with(|c| c.replace(true)));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_override_holds_inside_and_ends_with_the_closure() {
        let t = Tensor::zeros(2, candle_core::DType::F32, &Device::Cpu).unwrap();
        assert_eq!(Backend::of(&t), Backend::Cpu);
        assert_eq!(with_composed(|| Backend::of(&t)), Backend::Composed);
        let caught = std::panic::catch_unwind(|| with_composed(|| panic!("inside")));
        assert!(caught.is_err());
        assert_eq!(Backend::of(&t), Backend::Cpu);
    }
}
