//! Which host kernels run where the CPU can run several: the instruction set of the hand-written
//! passes ([`Isa`]) and the bf16 products' kernel ([`Kernel`]). A program chooses once, before its
//! first pass or product ([`choose`]); what it leaves open is the fastest the CPU has. Fixed per
//! process because every kernel reads it without a lock, and a run must not change paths midway.
//!
//! The libraries read no environment. The binaries hand the values of their switches
//! ([`SIMD_ENV`], [`KERNEL_ENV`]) to [`Choices::from_switches`]; the `env-switches` feature,
//! which the workspace's test builds turn on, makes the first use read them here instead, so that a
//! whole test run can take another path (CI runs the suite on AMX's kernel so).

use std::sync::OnceLock;

pub use crate::host::half_product::{Kernel, KERNEL_ENV};
pub use crate::host::simd::{Isa, SIMD_ENV};
use crate::host::{amx_kernel, bf16_kernel};

/// What a program asks for; `None` leaves the choice to the CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Choices {
    /// The passes' instruction set (at most the CPU's widest).
    pub simd: Option<Isa>,
    /// The bf16 products' kernel.
    pub bf16_kernel: Option<Kernel>,
    /// With [`Kernel::Amx`]: on a software model of its tiles where the CPU has none, so that any
    /// CPU runs AMX's order of sums (slowly; for tests).
    pub amx_on_model: bool,
}

/// The choices in force, each resolved for the running CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InForce {
    /// The passes' instruction set.
    pub simd: Isa,
    /// The bf16 products' kernel.
    pub bf16_kernel: Kernel,
    /// AMX's kernel runs on its software model (the CPU has no tiles).
    pub amx_on_model: bool,
}

/// A choice that cannot be honoured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChoiceError {
    /// The CPU cannot run the instruction set asked for.
    #[error("this CPU cannot run the {0} path")]
    SimdUnavailable(&'static str),
    /// The CPU (or the instruction set chosen) cannot run the bf16 kernel asked for.
    #[error("this CPU cannot run the {asked} bf16 kernel on the {simd} path (it can run: {can})")]
    KernelUnavailable {
        /// The kernel asked for.
        asked: &'static str,
        /// The path in force.
        simd: &'static str,
        /// The kernels it can run.
        can: String,
    },
    /// Another choice is in force already: a pass or product has run, or [`choose`] was called.
    #[error(
        "the host kernels are chosen already ({0:?}); choose before the first pass or product"
    )]
    AlreadyInForce(InForce),
}

impl Choices {
    /// The choices the switches' values name (`simd`: `avx512`, `avx2` or `baseline`; `bf16_kernel`:
    /// `widened`, `dot`, `amx`, or `amx-emulated` for AMX's kernel on its model where the CPU has no
    /// tiles), each left to the CPU, with a warning (`tracing`), where it names nothing or what the
    /// CPU cannot run: a mistyped switch does not stop a run.
    pub fn from_switches(simd: Option<&str>, bf16_kernel: Option<&str>) -> Self {
        let mut choices = Choices::default();
        if let Some(asked) = simd.map(str::trim) {
            match Isa::ALL.into_iter().find(|isa| isa.name() == asked) {
                Some(isa) if isa.available() => choices.simd = Some(isa),
                Some(isa) => tracing::warn!(
                    "{SIMD_ENV}={asked}: {}; using {}",
                    ChoiceError::SimdUnavailable(isa.name()),
                    Isa::detected().name()
                ),
                None => tracing::warn!(
                    "{SIMD_ENV}={asked:?}: not one of avx512, avx2, baseline; using {}",
                    Isa::detected().name()
                ),
            }
        }
        let Some(asked) = bf16_kernel.map(str::trim) else {
            return choices;
        };
        if asked == amx_kernel::EMULATED {
            choices.bf16_kernel = Some(Kernel::Amx);
            choices.amx_on_model = true;
            return choices;
        }
        let isa = choices.simd.unwrap_or_else(Isa::detected);
        let can = Kernel::on(isa, false);
        match can.iter().find(|k| k.name() == asked) {
            Some(&kernel) => choices.bf16_kernel = Some(kernel),
            None => {
                let names: Vec<_> = can.iter().map(|k| k.name()).collect();
                tracing::warn!(
                    "{KERNEL_ENV}={asked:?}: not one of this CPU's bf16 kernels ({}); using {}",
                    names.join(", "),
                    Kernel::fastest(isa).name()
                );
            }
        }
        choices
    }

    /// Each choice resolved for the running CPU.
    pub fn resolve(self) -> Result<InForce, ChoiceError> {
        let simd = match self.simd {
            Some(isa) if !isa.available() => return Err(ChoiceError::SimdUnavailable(isa.name())),
            Some(isa) => isa,
            None => Isa::detected(),
        };
        let tiles = amx_kernel::available_on(simd);
        let can = Kernel::on(simd, self.amx_on_model);
        let bf16_kernel = match self.bf16_kernel {
            Some(kernel) if can.contains(&kernel) => kernel,
            Some(kernel) => {
                return Err(ChoiceError::KernelUnavailable {
                    asked: kernel.name(),
                    simd: simd.name(),
                    can: can.iter().map(|k| k.name()).collect::<Vec<_>>().join(", "),
                })
            }
            None => Kernel::fastest(simd),
        };
        Ok(InForce {
            simd,
            bf16_kernel,
            amx_on_model: bf16_kernel == Kernel::Amx && !tiles,
        })
    }
}

static IN_FORCE: OnceLock<InForce> = OnceLock::new();

/// Fixes the host kernels for this process, before its first pass or product. Choosing again what
/// is in force is no error; choosing otherwise once anything has run, or once another choice was
/// made, is.
pub fn choose(choices: Choices) -> Result<InForce, ChoiceError> {
    let wanted = choices.resolve()?;
    let in_force = *IN_FORCE.get_or_init(|| wanted);
    match in_force == wanted {
        true => Ok(in_force),
        false => Err(ChoiceError::AlreadyInForce(in_force)),
    }
}

/// The choices in force: [`choose`]'s, else (at the first pass or product) the CPU's own.
pub fn in_force() -> InForce {
    *IN_FORCE.get_or_init(|| {
        unchosen()
            .resolve()
            .expect("switches' choices are the CPU's own")
    })
}

/// What a process that chose nothing runs: the CPU's own choices, or under the `env-switches`
/// feature (and in this crate's tests) the switches' values.
fn unchosen() -> Choices {
    #[cfg(any(test, feature = "env-switches"))]
    {
        let var = |name| std::env::var(name).ok();
        Choices::from_switches(var(SIMD_ENV).as_deref(), var(KERNEL_ENV).as_deref())
    }
    #[cfg(not(any(test, feature = "env-switches")))]
    Choices::default()
}

impl Kernel {
    /// The kernels the CPU can run on the `isa` path (AMX's on its model too, with `amx_on_model`).
    pub(crate) fn on(isa: Isa, amx_on_model: bool) -> Vec<Kernel> {
        let mut kernels = vec![Kernel::Widened];
        if bf16_kernel::available_on(isa) {
            kernels.push(Kernel::Bf16Dot);
        }
        if amx_kernel::available_on(isa) || amx_on_model {
            kernels.push(Kernel::Amx);
        }
        kernels
    }

    /// The fastest kernel on the `isa` path: AMX's tiles where the CPU has them, the dot products
    /// where it has those and they were measured faster ([`bf16_kernel::pays`]), the widened f32
    /// products elsewhere.
    fn fastest(isa: Isa) -> Kernel {
        if amx_kernel::available_on(isa) {
            Kernel::Amx
        } else if bf16_kernel::available_on(isa) && bf16_kernel::pays() {
            Kernel::Bf16Dot
        } else {
            Kernel::Widened
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_name_choices_and_what_cannot_run_is_left_to_the_cpu() {
        let own = Choices::default().resolve().unwrap();
        assert_eq!(own.simd, Isa::detected());
        let named = Choices::from_switches(Some(" baseline "), Some("widened"));
        assert_eq!(named.simd, Some(Isa::Baseline));
        assert_eq!(named.bf16_kernel, Some(Kernel::Widened));
        let typo = Choices::from_switches(Some("avx-512"), Some("fastest"));
        assert_eq!(typo, Choices::default());
        let model = Choices::from_switches(None, Some("amx-emulated"));
        assert_eq!(
            (model.bf16_kernel, model.amx_on_model),
            (Some(Kernel::Amx), true)
        );
        let on_model = model.resolve().unwrap();
        assert_eq!(on_model.bf16_kernel, Kernel::Amx);
        assert_eq!(
            on_model.amx_on_model,
            !amx_kernel::available_on(on_model.simd)
        );
        // The dot products and AMX's tiles need the AVX-512 path.
        for kernel in [Kernel::Bf16Dot, Kernel::Amx] {
            let narrow = Choices {
                simd: Some(Isa::Baseline),
                bf16_kernel: Some(kernel),
                amx_on_model: false,
            };
            assert!(matches!(
                narrow.resolve(),
                Err(ChoiceError::KernelUnavailable { .. })
            ));
        }
    }

    #[test]
    fn the_first_choice_stays() {
        let first = in_force();
        let again = Choices {
            simd: Some(first.simd),
            bf16_kernel: Some(first.bf16_kernel),
            amx_on_model: first.amx_on_model,
        };
        assert_eq!(choose(again), Ok(first));
        let other = Choices {
            simd: Some(Isa::Baseline),
            bf16_kernel: Some(Kernel::Widened),
            amx_on_model: false,
        };
        if other.resolve().unwrap() != first {
            assert_eq!(choose(other), Err(ChoiceError::AlreadyInForce(first)));
        }
    }
}
