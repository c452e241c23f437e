//! GRPO's adaptive entropy control (TRL's `use_adaptive_entropy`, from Skywork-OR1): the entropy
//! bonus's coefficient, moved after each optimizer step by the entropy the step saw.

use crate::config::AdaptiveEntropy;
use crate::{Result, TrainError};

/// The controller's state between optimizer steps, kept in resumable checkpoints as TRL keeps its
/// `entropy_ctrl_state.json`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EntropyControl {
    /// The coefficient: `--entropy-coef` at the start, then moved by each step.
    pub entropy_coef: f64,
    /// The last step's mean entropy over the tokens the bonus acts on, all ranks and micro-batches
    /// together (`None` before the first step, where TRL's is infinite: no bonus yet).
    pub last_world_entropy: Option<f64>,
}

impl EntropyControl {
    /// The controller of a run starting at `entropy_coef`.
    pub fn new(entropy_coef: f64) -> Self {
        Self {
            entropy_coef,
            last_world_entropy: None,
        }
    }

    /// The controller of a resumed run, from its checkpoint's job state; a new one at
    /// `entropy_coef` where the checkpoint has none (a run that did not use adaptive control).
    pub fn resumed(state: Option<&serde_json::Value>, entropy_coef: f64) -> Result<Self> {
        match state.and_then(|s| s.get("entropy_control")) {
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| {
                TrainError::Checkpoint(format!("the checkpoint's entropy control state: {e}"))
            }),
            None => Ok(Self::new(entropy_coef)),
        }
    }

    /// The state to keep in a checkpoint.
    pub fn to_state(&self) -> serde_json::Value {
        serde_json::json!({ "entropy_control": self })
    }

    /// The coefficient every micro-batch of the coming step applies: the coefficient while the
    /// last step's entropy was at most the target, else 0 (TRL's `apply_coef`).
    pub fn applied(&self, settings: &AdaptiveEntropy) -> f64 {
        match self.last_world_entropy {
            Some(h) if h <= settings.target => self.entropy_coef,
            _ => 0.0,
        }
    }

    /// After a step whose micro-batches saw `entropy_sum` over `tokens` (each the mean over the
    /// step's micro-batches, all weighing alike, so their ratio is the step's token mean; 0 and 0
    /// where no micro-batch weighed anything): the coefficient moves towards more entropy when the
    /// mean is at most the target, towards less otherwise, within its bounds.
    pub fn update(&mut self, settings: &AdaptiveEntropy, entropy_sum: f64, tokens: f64) {
        // TRL's `sum / count.clamp(min=1)`: a step without tokens reads as entropy 0.
        let world = match tokens > 0.0 {
            true => entropy_sum / tokens,
            false => 0.0,
        };
        self.entropy_coef = match world <= settings.target {
            true => (self.entropy_coef + settings.delta).min(settings.max),
            false => (self.entropy_coef - settings.delta).max(settings.min),
        };
        self.last_world_entropy = Some(world);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TRL's controller, as `GRPOTrainer._compute_loss` writes it: the first step applies no
    /// bonus (its last entropy is infinite), then the coefficient follows the entropy, clamped.
    #[test]
    fn the_coefficient_follows_the_entropy_within_its_bounds() {
        let settings = AdaptiveEntropy {
            min: 0.01,
            max: 0.02,
            delta: 0.006,
            target: 0.5,
        };
        let mut c = EntropyControl::new(0.015);
        assert_eq!(c.applied(&settings), 0.0, "no bonus before a step was seen");
        // Entropy 0.4 ≤ 0.5: up by delta, clamped at max; the bonus now applies.
        c.update(&settings, 0.8, 2.0);
        assert_eq!(c.entropy_coef, 0.02);
        assert_eq!(c.applied(&settings), 0.02);
        // Entropy 0.75 > 0.5: down, and no bonus.
        c.update(&settings, 1.5, 2.0);
        assert!((c.entropy_coef - 0.014).abs() < 1e-15);
        assert_eq!(c.applied(&settings), 0.0);
        c.update(&settings, 3.0, 1.0);
        assert_eq!(c.entropy_coef, 0.01, "clamped at min");
        // A step without tokens reads as entropy 0: up.
        c.update(&settings, 0.0, 0.0);
        assert!((c.entropy_coef - 0.016).abs() < 1e-15);
        assert_eq!(c.last_world_entropy, Some(0.0));
        // The target itself counts as at most the target.
        c.update(&settings, 1.0, 2.0);
        assert_eq!(c.entropy_coef, 0.02);
    }

    #[test]
    fn the_state_survives_a_checkpoint() {
        let mut c = EntropyControl::new(0.1);
        c.update(&AdaptiveEntropy::default(), 0.3, 1.0);
        let state = c.to_state();
        let text = serde_json::to_string(&state).unwrap();
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(EntropyControl::resumed(Some(&back), 0.7).unwrap(), c);
        assert_eq!(
            EntropyControl::resumed(None, 0.7).unwrap(),
            EntropyControl::new(0.7)
        );
    }
}
