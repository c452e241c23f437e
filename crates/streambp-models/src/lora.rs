//! LoRA adapters with PEFT's semantics: on a projection `y = x Wᵀ (+ b)`, an adapter adds
//! `s · (dropout(x) Aᵀ) Bᵀ` with `A` `[r, in]`, `B` `[out, r]` and `s = alpha / r` (`alpha / √r` with
//! rsLoRA). A fresh adapter starts as PEFT's: `A` kaiming-uniform with `a = √5` (uniform in
//! `±1/√in`), `B` zero, so the model starts as its base.
//!
//! Dropout masks are not drawn from a running generator but derived from the batch's dropout key (set
//! per optimizer step and micro-batch), the layer, the projection and each token's index and feature:
//! the streamed backward's recomputation of a chunk, gradient checkpointing and the plain backward all
//! see the same mask for the same token, so they stay exact with dropout on.

use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};
use crate::init::NormalRng;
use crate::weights::MapWeights;

/// A projection of a decoder layer an adapter can sit on, named as PEFT's `target_modules` name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Projection {
    /// `self_attn.q_proj`.
    Q,
    /// `self_attn.k_proj`.
    K,
    /// `self_attn.v_proj`.
    V,
    /// `self_attn.o_proj`.
    O,
    /// `mlp.gate_proj`.
    Gate,
    /// `mlp.up_proj`.
    Up,
    /// `mlp.down_proj`.
    Down,
}

impl Projection {
    /// Every projection, in checkpoint order (what `all-linear` resolves to; never the LM head).
    pub const ALL: [Projection; 7] = [
        Projection::Q,
        Projection::K,
        Projection::V,
        Projection::O,
        Projection::Gate,
        Projection::Up,
        Projection::Down,
    ];

    /// The module's name (`q_proj`, …).
    pub fn name(self) -> &'static str {
        match self {
            Projection::Q => "q_proj",
            Projection::K => "k_proj",
            Projection::V => "v_proj",
            Projection::O => "o_proj",
            Projection::Gate => "gate_proj",
            Projection::Up => "up_proj",
            Projection::Down => "down_proj",
        }
    }

    /// The projection named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The module's path in a Hugging Face checkpoint: `model.layers.{layer}.self_attn.q_proj`.
    pub fn module_path(self, layer: usize) -> String {
        let block = match self {
            Projection::Q | Projection::K | Projection::V | Projection::O => "self_attn",
            Projection::Gate | Projection::Up | Projection::Down => "mlp",
        };
        format!("model.layers.{layer}.{block}.{}", self.name())
    }

    /// The projections a `--lora-target` list names: `all-linear` or module names (comma-separated
    /// entries allowed), in checkpoint order without repeats.
    pub fn parse_targets(names: &[String]) -> Result<Vec<Projection>> {
        let mut out = Vec::new();
        for name in names.iter().flat_map(|n| n.split(',')).map(str::trim) {
            match (name, Projection::parse(name)) {
                ("all-linear", _) => out.extend(Projection::ALL),
                (_, Some(p)) => out.push(p),
                _ => {
                    return Err(ModelError::Input(format!(
                        "unknown LoRA target {name:?} (all-linear, or some of q_proj k_proj v_proj \
                         o_proj gate_proj up_proj down_proj)"
                    )))
                }
            }
        }
        out.sort();
        out.dedup();
        match out.is_empty() {
            true => Err(ModelError::Input("no LoRA target".into())),
            false => Ok(out),
        }
    }
}

/// Which of an adapter's two matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Matrix {
    /// `lora_A`, `[r, in]`: projects the input down to rank `r`.
    A,
    /// `lora_B`, `[out, r]`: back up to the output.
    B,
}

/// The key of an adapter matrix as PEFT saves it in `adapter_model.safetensors`, e.g.
/// `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
pub fn peft_key(layer: usize, projection: Projection, matrix: Matrix) -> String {
    let m = match matrix {
        Matrix::A => "A",
        Matrix::B => "B",
    };
    format!(
        "base_model.model.{}.lora_{m}.weight",
        projection.module_path(layer)
    )
}

/// The settings that shape a LoRA model's math (the part of PEFT's `LoraConfig` that matters here).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The rank (at least 1).
    pub r: usize,
    /// `lora_alpha`: the scale's numerator.
    pub alpha: f64,
    /// The projections that get an adapter, in every layer.
    pub targets: Vec<Projection>,
    /// rsLoRA: scale by `alpha / √r` instead of `alpha / r`.
    pub use_rslora: bool,
    /// Dropout probability on an adapter's input, in `[0, 1)`.
    pub dropout: f64,
}

impl LoraConfig {
    /// The factor on the adapter's output, PEFT's `scaling`.
    pub fn scale(&self) -> f64 {
        match self.use_rslora {
            true => self.alpha / (self.r as f64).sqrt(),
            false => self.alpha / self.r as f64,
        }
    }

    /// Checks the ranges PEFT checks (rank at least 1, dropout a probability).
    pub fn validate(&self) -> Result<()> {
        if self.r == 0 {
            return Err(ModelError::Input("LoRA rank r must be at least 1".into()));
        }
        if !(self.dropout >= 0.0 && self.dropout < 1.0) {
            return Err(ModelError::Input(format!(
                "LoRA dropout {} must be in [0, 1)",
                self.dropout
            )));
        }
        if !self.alpha.is_finite() || self.alpha <= 0.0 {
            return Err(ModelError::Input(format!(
                "lora_alpha {} must be a number above 0",
                self.alpha
            )));
        }
        Ok(())
    }
}

/// The adapter on one projection.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    /// `[r, in]`, the trainable `lora_A` (f32, or f64 for an f64 model).
    pub a: Tensor,
    /// `[out, r]`, the trainable `lora_B`.
    pub b: Tensor,
    /// The factor on the adapter's output.
    pub scale: f64,
    /// Dropout probability on the adapter's input.
    pub dropout: f64,
    /// Where it sits, for its dropout masks.
    pub layer: usize,
    /// Which projection of the layer.
    pub projection: Projection,
    /// The dtype the base projection's output is rounded to before the adapter's term is added,
    /// where a layer computes a half-precision model in f32
    /// ([`crate::layer::DecoderLayer::computed_in_f32`]): PEFT adds its f32 adapter's term to the
    /// half-precision base layer's (rounded) output, then rounds the sum.
    pub round_base_to: Option<DType>,
}

impl LoraAdapter {
    /// `x Wᵀ (+ b) + s · (dropout(x) Aᵀ) Bᵀ` for the flattened input `x` `[n, in]` of tokens `start..`
    /// of a batch of `rows` rows, with the frozen `weight` and `bias` of the projection it sits on
    /// (dropout only when the batch carries a dropout key), in `x`'s dtype: the adapter's f32 weights
    /// are cast to it, as autocast does, and their gradients come back in f32. (In a half-precision
    /// layer computed in f32, `x` is f32: the adapter runs in f32 as PEFT's does, and the base's
    /// output is rounded first, [`LoraAdapter::round_base_to`].)
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        (weight, bias): (streambp_kernels::ops::linear::Weight, Option<&Tensor>),
        rows: usize,
        start: usize,
        dropout: Option<DropoutKey>,
    ) -> Result<Tensor> {
        let dropped = match dropout {
            Some(key) if self.dropout > 0.0 => {
                let (n, features) = x.dims2()?;
                let mask = dropout_mask(
                    DropoutSite {
                        key,
                        layer: self.layer,
                        projection: self.projection,
                        start,
                    },
                    self.dropout,
                    (rows, n / rows.max(1), features),
                    x.dtype(),
                    x.device(),
                )?;
                (x * mask.reshape((n, features))?)?
            }
            _ => x.clone(),
        };
        let a = self.a.to_dtype(x.dtype())?;
        let b = self.b.to_dtype(x.dtype())?;
        let u = dropped.matmul(&a.t()?)?;
        let adapter = (&u, &b, self.scale);
        Ok(streambp_kernels::ops::linear::lora_linear(
            x,
            (weight, bias),
            adapter,
            self.round_base_to,
        )?)
    }
}

impl MapWeights for LoraAdapter {
    /// The same adapter with `lora_A` and `lora_B` replaced by `f(weight)`.
    fn map_weights<E>(
        &self,
        f: &mut impl FnMut(&Tensor) -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<Self, E> {
        Ok(Self {
            a: f(&self.a)?,
            b: f(&self.b)?,
            ..self.clone()
        })
    }
}

/// A fresh adapter's `A` `[r, in]` as PEFT initialises it: `kaiming_uniform_(a=√5)`, i.e. uniform in
/// `±1/√in`, drawn from `rng`.
pub fn kaiming_uniform(
    rng: &mut NormalRng,
    r: usize,
    features: usize,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let bound = 1.0 / (features as f64).sqrt();
    let values: Vec<f64> = (0..r * features)
        .map(|_| (2.0 * rng.uniform() - 1.0) * bound)
        .collect();
    Ok(Tensor::from_vec(values, (r, features), device)?.to_dtype(dtype)?)
}

/// Where a batch's LoRA dropout masks come from: its key (seed, optimizer step, micro-batch) and the
/// place of its first row among the rows of every rank (data-parallel ranks get different masks, as
/// different rows of one batch do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DropoutKey {
    /// The key the masks are hashed from.
    pub key: u64,
    /// The index of the batch's first row in the global batch.
    pub first_row: usize,
}

/// Where an adapter's input sits, which decides its dropout mask.
#[derive(Debug, Clone, Copy)]
pub struct DropoutSite {
    /// The batch's dropout key (seed, step, micro-batch) and its first row's place.
    pub key: DropoutKey,
    /// The decoder layer.
    pub layer: usize,
    /// The projection.
    pub projection: Projection,
    /// The index of the first token of the input in its rows.
    pub start: usize,
}

/// SplitMix64's finaliser: a well-mixed 64-bit value of `x`.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The inverted-dropout mask `[rows, len, features]` of the input at `site`: `1 / (1 − p)` where a
/// feature is kept, 0 where dropped, each decided by a hash of (key, layer, projection, row, token
/// index, feature), so any chunk of the same tokens gets the same mask.
pub fn dropout_mask(
    site: DropoutSite,
    p: f64,
    (rows, len, features): (usize, usize, usize),
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let keep = 1.0 / (1.0 - p);
    let threshold = (p * (u64::MAX as f64)) as u64;
    let base = mix(site.key.key ^ mix(((site.layer as u64) << 8) | site.projection as u64));
    let mut values = Vec::with_capacity(rows * len * features);
    for row in 0..rows {
        let row_key = mix(base ^ mix((site.key.first_row + row) as u64));
        for t in 0..len {
            let token_key = mix(row_key ^ ((site.start + t) as u64));
            values.extend(
                (0..features).map(|j| match mix(token_key ^ j as u64) < threshold {
                    true => 0.0f32,
                    false => keep as f32,
                }),
            );
        }
    }
    let mask = Tensor::from_vec(values, (rows, len, features), device)?;
    // An f64 model gets the exact factor (f32 would round 1 / (1 − p)).
    Ok(match dtype {
        DType::F64 => (mask.ne(0.0)?.to_dtype(DType::F64)? * keep)?,
        _ => mask.to_dtype(dtype)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use streambp_testkit::max_diff;

    /// The mask of a chunk is the same as that chunk of the whole sequence's mask, and drops about p.
    #[test]
    fn masks_depend_on_token_indices_not_on_chunks() {
        let site = DropoutSite {
            key: DropoutKey {
                key: 7,
                first_row: 0,
            },
            layer: 1,
            projection: Projection::Up,
            start: 0,
        };
        let dev = Device::Cpu;
        let whole = dropout_mask(site, 0.25, (2, 12, 16), DType::F64, &dev).unwrap();
        let chunk = dropout_mask(
            DropoutSite { start: 5, ..site },
            0.25,
            (2, 4, 16),
            DType::F64,
            &dev,
        )
        .unwrap();
        assert_eq!(max_diff(&whole.narrow(1, 5, 4).unwrap(), &chunk), 0.0);
        let kept = whole
            .ne(0.0)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .mean_all()
            .unwrap();
        let kept = kept.to_scalar::<f64>().unwrap();
        assert!((kept - 0.75).abs() < 0.1, "{kept}");
        let other = dropout_mask(
            DropoutSite {
                key: DropoutKey {
                    key: 8,
                    first_row: 0,
                },
                ..site
            },
            0.25,
            (2, 12, 16),
            DType::F64,
            &dev,
        )
        .unwrap();
        assert_ne!(
            whole.to_vec3::<f64>().unwrap(),
            other.to_vec3::<f64>().unwrap(),
            "another key, another mask"
        );
    }

    #[test]
    fn targets_parse_like_peft() {
        let all = Projection::parse_targets(&["all-linear".into()]).unwrap();
        assert_eq!(all, Projection::ALL);
        let some = Projection::parse_targets(&["v_proj,q_proj".into(), "q_proj".into()]).unwrap();
        assert_eq!(some, [Projection::Q, Projection::V]);
        assert!(Projection::parse_targets(&["lm_head".into()]).is_err());
        assert_eq!(
            peft_key(3, Projection::Down, Matrix::B),
            "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"
        );
    }
}
