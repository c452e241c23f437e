//! Which of an objective's settings each of its loss types reads, named as TRL's configs name them:
//! one description per loss type, from which a setting given for a loss type that ignores it is
//! refused (by the command line, `--config` files and `grad`'s batch files alike) instead of being
//! dropped silently.

/// An objective's loss types and the settings that only some of them read.
pub trait LossSettings: Copy + PartialEq + 'static {
    /// Every loss type, in TRL's order.
    const TYPES: &'static [Self];
    /// The objective's settings that some of its loss types ignore.
    const SETTINGS: &'static [&'static str];
    /// TRL's name of the type.
    fn type_name(self) -> &'static str;
    /// Whether the type reads `setting` (one of [`LossSettings::SETTINGS`]; any other setting
    /// every type reads).
    fn reads(self, setting: &str) -> bool;
}

/// Why `setting`, given for a loss made of `types`, changes nothing: none of them reads it. The
/// reason names the types that do (`"applies to loss_type discopop only, not sigmoid"`); `None`
/// when one of `types` reads it.
pub fn unread<T: LossSettings>(setting: &str, types: &[T]) -> Option<String> {
    if types.iter().any(|t| t.reads(setting)) {
        return None;
    }
    let names = |types: Vec<T>| -> String {
        let names: Vec<&str> = types.into_iter().map(T::type_name).collect();
        match names.as_slice() {
            [] => "none".into(),
            [one] => (*one).into(),
            [init @ .., last] => format!("{} and {last}", init.join(", ")),
        }
    };
    let readers: Vec<T> = T::TYPES
        .iter()
        .copied()
        .filter(|t| t.reads(setting))
        .collect();
    let only = if readers.len() == 1 { " only" } else { "" };
    Some(format!(
        "applies to loss_type {}{only}, not {}",
        names(readers),
        names(types.to_vec())
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CpoLossType, DpoLossType, GrpoLossType, KtoLossType};

    /// Every setting of a description is read by some type and ignored by another (else it
    /// would not be type-specific), and the reason names both sides.
    fn check_description<T: LossSettings + std::fmt::Debug>() {
        for setting in T::SETTINGS {
            let readers: Vec<T> = T::TYPES
                .iter()
                .copied()
                .filter(|t| t.reads(setting))
                .collect();
            assert!(!readers.is_empty(), "{setting}: read by no type");
            assert!(
                readers.len() < T::TYPES.len(),
                "{setting}: read by every type"
            );
            for t in T::TYPES {
                let reason = unread(setting, &[*t]);
                assert_eq!(reason.is_none(), t.reads(setting), "{setting} {t:?}");
                if let Some(reason) = reason {
                    assert!(reason.contains(readers[0].type_name()), "{reason}");
                    assert!(
                        reason.ends_with(&format!("not {}", t.type_name())),
                        "{reason}"
                    );
                }
            }
        }
        assert!(unread("beta", T::TYPES).is_none(), "a shared setting");
    }

    #[test]
    fn each_description_is_consistent() {
        check_description::<DpoLossType>();
        check_description::<CpoLossType>();
        check_description::<GrpoLossType>();
        check_description::<KtoLossType>();
    }

    /// TRL 1.16's readers: `discopop_tau` by discopop; `simpo_gamma` by CPO's simpo; `epsilon` by
    /// the clipping types (not cispo, not sapo), `epsilon_high` by those and cispo, the sapo
    /// temperatures by sapo; in a list of DPO types, a setting one of them reads is read.
    #[test]
    fn the_readers_are_trls() {
        assert_eq!(
            unread("discopop_tau", &[DpoLossType::Sigmoid]).as_deref(),
            Some("applies to loss_type discopop only, not sigmoid")
        );
        assert!(unread(
            "discopop_tau",
            &[DpoLossType::Sigmoid, DpoLossType::Discopop]
        )
        .is_none());
        assert!(unread("simpo_gamma", &[CpoLossType::Sigmoid]).is_some());
        assert!(unread("simpo_gamma", &[CpoLossType::Simpo]).is_none());
        assert_eq!(
            unread("epsilon", &[GrpoLossType::Cispo]).as_deref(),
            Some("applies to loss_type grpo, bnpo, dr_grpo, dapo and luspo, not cispo")
        );
        assert!(unread("epsilon_high", &[GrpoLossType::Cispo]).is_none());
        assert!(unread("epsilon_high", &[GrpoLossType::Sapo]).is_some());
        assert!(unread("sapo_temperature_pos", &[GrpoLossType::Dapo]).is_some());
        assert!(unread("sapo_temperature_neg", &[GrpoLossType::Sapo]).is_none());
        assert!(unread("vespo_k_pos", &[GrpoLossType::Dapo]).is_some());
        assert!(unread("vespo_lambda_neg", &[GrpoLossType::Vespo]).is_none());
        assert!(unread("epsilon", &[GrpoLossType::Vespo]).is_some());
        assert!(unread("epsilon", &[GrpoLossType::Luspo]).is_none());
    }
}
