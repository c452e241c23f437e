//! One runtime-dispatched instruction set for the hand-written CPU passes (exponentials, softmax
//! rows, norms, rope, SwiGLU, casts, in-place sums), through `pulp`, the crate gemm dispatches with.
//!
//! A pass is written once, as plain loops, and run through [`vectorized!`](crate::vectorized!):
//! its body is compiled for each instruction set ([`Isa`]) and the one in force is picked at run
//! time, so the same loops run at AVX-512's width where the CPU has it, at AVX2's elsewhere, and at
//! the build's baseline (SSE2 on x86-64) on the oldest CPUs. The loops keep their order of operations at every width
//! (their reductions add into a fixed number of lanes, and nothing is fused that the code does not
//! fuse itself), so the AVX2 and AVX-512 paths give the same bits; only where [`Isa::fma`] picks a
//! fused formula (the f32 exponential) does the baseline path differ, within its stated error.
//!
//! A program may choose a narrower path than the CPU's best (to compare them, or to test one:
//! [`crate::choices`]); gemm's products dispatch on their own.

/// The switch the binaries read for the instruction set (`avx512`, `avx2`, `baseline`; see
/// [`crate::choices`]).
pub const SIMD_ENV: &str = "STREAMBP_SIMD";

/// An instruction set the passes are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// The build's own target (SSE2 on x86-64; NEON on aarch64): no dispatch.
    Baseline,
    /// x86-64-v3: AVX2, FMA (and BMI, F16C, ...), 8 f32 lanes.
    Avx2,
    /// x86-64-v4: AVX-512 F, BW, CD, DQ and VL on top of v3, 16 f32 lanes.
    Avx512,
}

impl Isa {
    /// Every instruction set, narrowest first.
    pub const ALL: [Isa; 3] = [Isa::Baseline, Isa::Avx2, Isa::Avx512];

    /// The name `STREAMBP_SIMD` takes and reports print.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Baseline => "baseline",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Whether the running CPU can run this path.
    pub fn available(self) -> bool {
        self.arch().is_some()
    }

    /// The widest path the running CPU can run.
    pub fn detected() -> Isa {
        Isa::ALL
            .into_iter()
            .rev()
            .find(|isa| isa.available())
            .unwrap_or(Isa::Baseline)
    }

    /// Whether a fused multiply-add is one instruction on this path (elsewhere `f32::mul_add` is
    /// a library call), so that passes pick the formula written for it.
    pub fn fma(self) -> bool {
        match self {
            Isa::Baseline => cfg!(any(target_feature = "fma", target_arch = "aarch64")),
            Isa::Avx2 | Isa::Avx512 => true,
        }
    }

    fn arch(self) -> Option<pulp::Arch> {
        match self {
            Isa::Baseline => Some(pulp::Arch::Scalar),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => pulp::x86::V3::try_new().map(pulp::Arch::V3),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => pulp::x86::V4::try_new().map(pulp::Arch::V4),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => None,
        }
    }
}

/// The instruction set in force: the one chosen ([`crate::choices`]), else the widest the CPU
/// has.
pub fn isa() -> Isa {
    crate::choices::in_force().simd
}

/// `vectorized!(|isa| body)`: runs `body` compiled for the instruction set in force ([`isa`]),
/// which it is given as `isa` (to pick formulas by [`Isa::fma`]). Call it once per task or row, not
/// per element; what `body` calls should be `#[inline(always)]` (or small) so that it is compiled
/// into each instance too.
///
/// A macro rather than a function so that the closure is always `#[inline(always)]`: a closure
/// the compiler leaves out of line is compiled for the baseline only, and its `f32::mul_add` and
/// `floor` become library calls, which slow a step several times over.
#[macro_export]
macro_rules! vectorized {
    (|$isa:pat_param| $body:expr) => {
        $crate::host::simd::run_vectorized(
            #[inline(always)]
            |$isa: $crate::host::simd::Isa| $body,
        )
    };
}

/// What [`vectorized!`] expands to: `pass` run through pulp's dispatch for the path in force.
#[doc(hidden)]
#[inline(always)]
pub fn run_vectorized<R>(pass: impl FnOnce(Isa) -> R) -> R {
    let isa = isa();
    match isa.arch() {
        Some(arch) => arch.dispatch(
            #[inline(always)]
            move || pass(isa),
        ),
        None => pass(isa),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_detected_path_is_available_and_baseline_always_is() {
        assert!(Isa::Baseline.available());
        assert!(Isa::detected().available());
        assert!(isa().available());
        println!("SIMD path in force: {}", isa().name());
    }
}
