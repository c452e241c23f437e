//! AdamW (decoupled weight decay, as `torch.optim.AdamW`) with f32 state (f64 for f64 models), global-norm
//! gradient clipping, and the warmup + cosine/linear learning-rate schedules of transformers.

use candle_core::{DType, Tensor, Var};
use streambp_kernels::ops::adamw::{self, update_in_place, AdamWStep};
use streambp_kernels::ops::cast::cast;
use streambp_kernels::ops::grad_norm;

use crate::{Result, TrainError};

/// AdamW's hyperparameters (defaults: torch's, with no weight decay). The learning rate is not one of
/// them: the schedule gives each step's to [`AdamW::apply`].
#[derive(Debug, Clone, Copy)]
pub struct AdamWConfig {
    /// Decay of the first-moment average.
    pub beta1: f64,
    /// Decay of the second-moment average.
    pub beta2: f64,
    /// Added to the root of the second moment in the denominator.
    pub eps: f64,
    /// Decoupled weight decay per unit learning rate (`p ← p·(1 − lr·wd)`), on parameters that
    /// [`decays`] selects.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// Parameters that get no weight decay, as in transformers' Trainer: biases and norm weights.
pub fn decays(name: &str) -> bool {
    !(name.ends_with(".bias") || name.ends_with("norm.weight"))
}

struct Slot {
    name: String,
    var: Var,
    m: Tensor,
    v: Tensor,
    decay: bool,
}

/// Whether weight decay applies to a parameter (or its run of a shard).
pub enum Decay {
    /// Not (biases, norms).
    None,
    /// It does.
    All,
}

/// A parameter's (or shard's) AdamW moments, updated in place.
pub struct Moments<'a> {
    /// The first moment.
    pub m: &'a mut Tensor,
    /// The second moment.
    pub v: &'a mut Tensor,
}

impl AdamWConfig {
    /// One AdamW update of the values `p` with the gradient `g` (both in the moments' dtype) at rate
    /// `lr`, with the step's bias corrections `(1 − β1ᵗ, 1 − β2ᵗ)`: the new values (torch's AdamW,
    /// decoupled decay first), composed of tensor ops ([`adamw::composed`]), for a device without a
    /// kernel that updates in place.
    pub fn update(
        &self,
        p: Tensor,
        g: &Tensor,
        moments: Moments,
        lr: f64,
        bc: (f64, f64),
        decay: Decay,
    ) -> Result<Tensor> {
        let constants = self.step_constants(lr, bc, matches!(decay, Decay::All));
        let [p, m, v] = adamw::composed(&p, g, (moments.m, moments.v), &constants)?;
        (*moments.m, *moments.v) = (m, v);
        Ok(p)
    }

    /// The constants of one update at rate `lr` with bias corrections `bc`, with or without decay,
    /// as the kernels that update in place take them.
    pub(crate) fn step_constants(&self, lr: f64, bc: (f64, f64), decay: bool) -> AdamWStep {
        AdamWStep {
            lr,
            decay: match decay && self.weight_decay != 0.0 {
                true => 1.0 - lr * self.weight_decay,
                false => 1.0,
            },
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            bias_corrections: bc,
        }
    }

    /// The bias corrections of update number `step` (from 1).
    pub fn bias_corrections(&self, step: usize) -> (f64, f64) {
        (
            1.0 - self.beta1.powi(step as i32),
            1.0 - self.beta2.powi(step as i32),
        )
    }
}

/// AdamW over whole parameters.
pub struct AdamW {
    /// The hyperparameters.
    pub config: AdamWConfig,
    slots: Vec<Slot>,
    /// Updates applied so far (for the bias correction).
    pub step: usize,
}

fn state_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

impl AdamW {
    /// An optimizer for `params` (name and variable, in the order gradients will come) with zeroed
    /// moments in f32 (f64 for f64 parameters).
    pub fn new(params: &[(String, Var)], config: AdamWConfig) -> Result<Self> {
        let slots = params
            .iter()
            .map(|(name, var)| {
                // Two allocations: the moments are held apart from the first update on anyway.
                let zeros = || var.zeros_like()?.to_dtype(state_dtype(var.dtype()));
                Ok(Slot {
                    name: name.clone(),
                    var: var.clone(),
                    m: zeros()?,
                    v: zeros()?,
                    decay: decays(name),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config,
            slots,
            step: 0,
        })
    }

    /// One update with `grads` (same names and order as the parameters) at learning rate `lr`.
    pub fn apply(&mut self, grads: &[(String, Tensor)], lr: f64) -> Result<()> {
        if grads.len() != self.slots.len() {
            return Err(TrainError::Internal(format!(
                "{} gradients for {} parameters",
                grads.len(),
                self.slots.len()
            )));
        }
        self.step += 1;
        let c = self.config;
        let (bc1, bc2) = c.bias_corrections(self.step);
        for (slot, (name, g)) in self.slots.iter_mut().zip(grads) {
            if *name != slot.name {
                return Err(TrainError::Internal(format!(
                    "gradient {name} where {} was expected",
                    slot.name
                )));
            }
            // One pass in place where the device has a kernel for it (the host's, the card's); else
            // composed.
            let constants = c.step_constants(lr, (bc1, bc2), slot.decay);
            let p = slot.var.as_tensor();
            if update_in_place(p, g, (&slot.m, &slot.v), &constants)? {
                continue;
            }
            let sd = slot.m.dtype();
            // (`cast`: between bf16 and f32 on the host over rayon's threads; candle's `to_dtype`
            // runs on one.)
            let p = cast(&slot.var.as_tensor().detach(), sd)?;
            let decay = match slot.decay {
                true => Decay::All,
                false => Decay::None,
            };
            let moments = Moments {
                m: &mut slot.m,
                v: &mut slot.v,
            };
            let p = c.update(p, &cast(g, sd)?, moments, lr, (bc1, bc2), decay)?;
            slot.var.set(&cast(&p, slot.var.dtype())?)?;
        }
        Ok(())
    }

    /// The optimizer state for checkpoints: `name.m` and `name.v` for every parameter.
    pub fn state(&self) -> std::collections::HashMap<String, Tensor> {
        self.slots
            .iter()
            .flat_map(|s| {
                [
                    (format!("{}.m", s.name), s.m.clone()),
                    (format!("{}.v", s.name), s.v.clone()),
                ]
            })
            .collect()
    }

    /// Restores the moments saved by [`AdamW::state`] and the step count.
    pub fn load_state(
        &mut self,
        state: &std::collections::HashMap<String, Tensor>,
        step: usize,
    ) -> Result<()> {
        for slot in &mut self.slots {
            for (suffix, dst) in [("m", &mut slot.m), ("v", &mut slot.v)] {
                let key = format!("{}.{suffix}", slot.name);
                let t = state.get(&key).ok_or_else(|| {
                    TrainError::Checkpoint(format!("the optimizer state has no {key}"))
                })?;
                if t.dims() != dst.dims() {
                    return Err(TrainError::Checkpoint(format!(
                        "the optimizer state's {key} has shape {:?}, expected {:?}",
                        t.dims(),
                        dst.dims()
                    )));
                }
                *dst = t.to_dtype(dst.dtype())?.to_device(dst.device())?;
            }
        }
        self.step = step;
        Ok(())
    }
}

/// Scales `grads` so their global L2 norm is at most `max_norm`; returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut [(String, Tensor)], max_norm: f64) -> Result<f64> {
    let mut sq = 0.0;
    for (_, g) in grads.iter() {
        sq += grad_norm::sum_of_squares(g)?;
    }
    let norm = sq.sqrt();
    if max_norm > 0.0 && norm > max_norm {
        let scale = max_norm / (norm + 1e-6);
        for (_, g) in grads.iter_mut() {
            *g = grad_norm::scaled(g, scale)?;
        }
    }
    Ok(norm)
}

/// Learning-rate schedules (transformers' `get_*_schedule_with_warmup`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Half a cosine from the peak to 0 at the last step.
    Cosine,
    /// A straight line from the peak to 0 at the last step.
    Linear,
    /// The peak rate until the end.
    Constant,
}

impl std::str::FromStr for Schedule {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cosine" => Ok(Self::Cosine),
            "linear" => Ok(Self::Linear),
            "constant" => Ok(Self::Constant),
            other => Err(format!(
                "expected cosine, linear or constant, got {other:?}"
            )),
        }
    }
}

/// The learning rate at optimizer step `step` (0-based) of `total`.
pub fn learning_rate(
    schedule: Schedule,
    base: f64,
    step: usize,
    warmup: usize,
    total: usize,
) -> f64 {
    if step < warmup {
        return base * step as f64 / warmup.max(1) as f64;
    }
    let progress = (step - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
    match schedule {
        Schedule::Cosine => base * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        Schedule::Linear => base * (1.0 - progress).max(0.0),
        Schedule::Constant => base,
    }
}
