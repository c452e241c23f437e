//! Random models from a config, for tests and benchmarks that need no download. Deterministic in the
//! seed, so two runs (and two modes in one run) see the same weights.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use crate::config::{Head, ModelConfig, NormStyle, LM_HEAD, SCORE};
use crate::error::Result;
use crate::model::Model;

/// SplitMix64's increment.
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// A small deterministic normal generator (SplitMix64 + Box-Muller): enough for weight init, and keeps
/// the crate free of an RNG dependency.
#[derive(Debug, Clone)]
pub struct NormalRng(u64);

impl NormalRng {
    /// A generator whose stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN_GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal.
    pub fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// A tensor of `shape` with entries `mean + std·N(0,1)`, in `dtype`. SplitMix64 is a counter:
    /// entry `i` depends only on the state before it, so the entries are drawn in parallel (an 8B
    /// model's weights take seconds, not minutes) and equal the sequential stream's.
    pub fn tensor(
        &mut self,
        shape: &[usize],
        mean: f64,
        std: f64,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        use rayon::prelude::*;
        let n: usize = shape.iter().product();
        let start = self.0;
        // Each entry takes two uniforms: two steps of the counter.
        let state_at = |i: usize| start.wrapping_add((2 * i as u64).wrapping_mul(GOLDEN_GAMMA));
        let v: Vec<f32> = (0..n)
            .into_par_iter()
            .map(|i| (mean + std * NormalRng(state_at(i)).normal()) as f32)
            .collect();
        self.0 = state_at(n);
        Ok(Tensor::from_vec(v, shape, device)?.to_dtype(dtype)?)
    }
}

impl Model {
    /// A model with random weights: projections N(0, 0.02²) like transformers' init, norm weights
    /// perturbed around their neutral value (so a wrong `(1 + w)` convention cannot hide).
    pub fn random(config: ModelConfig, dtype: DType, device: &Device, seed: u64) -> Result<Self> {
        let mut rng = NormalRng::new(seed);
        let neutral = match config.norm_style {
            NormStyle::CastThenScale => 1.0,
            NormStyle::OnePlusWeightInF32 => 0.0,
        };
        let mut tensors = HashMap::new();
        for (name, shape) in config.parameter_shapes() {
            let is_norm = name.ends_with("norm.weight") || name.ends_with("layernorm.weight");
            let t = if is_norm {
                rng.tensor(&shape, neutral, 0.1, dtype, device)?
            } else {
                rng.tensor(&shape, 0.0, 0.02, dtype, device)?
            };
            tensors.insert(name, t);
        }
        Model::from_tensors(config, tensors)
    }
}

impl Model {
    /// This model with a fresh score head in place of its LM head: a reward model started from a
    /// causal LM, as transformers' `AutoModelForSequenceClassification` starts one (`score.weight`
    /// drawn from N(0, 0.02²), here from `seed`). The weights are shared, not copied.
    pub fn with_score_head(&self, seed: u64) -> Result<Self> {
        let mut config = self.config.clone();
        config.head = Head::Score;
        let mut tensors: HashMap<String, Tensor> = self
            .weights()
            .iter()
            .filter(|(name, _)| name != LM_HEAD)
            .cloned()
            .collect();
        let like = &self.embed_tokens;
        let score = NormalRng::new(seed).tensor(
            &[1, config.hidden_size],
            0.0,
            0.02,
            like.dtype(),
            like.device(),
        )?;
        tensors.insert(SCORE.to_string(), score);
        Model::from_tensors(config, tensors)
    }
}
