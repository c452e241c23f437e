//! Batch files of the `grad` command: one JSON object holding a whole batch in HF conventions.
//!
//! SFT: `{"objective":"sft","input_ids":[[..]],"labels":[[..]],"attention_mask":[[..]]}`; labels are
//! aligned with input_ids (shifted inside), -100 (`IGNORE_INDEX`) is ignored, rows are right-padded, the attention mask
//! is optional (all ones when absent). DPO, ORPO, CPO, KTO and GRPO: see docs/grad.md.

use std::path::Path;

use candle_core::{Device, Tensor};
use serde::Deserialize;
use streambp_models::ModelConfig;
use streambp_objectives::pooled_positions;
use streambp_objectives::{
    Cpo, CpoLoss, Distill, DistillBatch, Dpo, DpoLoss, Grpo, GrpoBatch, GrpoLossType, Kto, KtoLoss,
    KtoLossType, LossSettings, Objective, Orpo, RewardModel, Rloo, RlooBatch, Rollouts, Sft,
    TeacherLogits, VespoGamma, IGNORE_INDEX,
};

use crate::batch::{masked_labels, padded, to_u32_tensor};
use crate::logprobs::{sequence_logps, token_logps, Scorer};
use crate::{Result, TrainError};

/// A batch ready for the engine.
pub struct PreparedBatch {
    /// `[batch, T]` u32.
    pub input_ids: Tensor,
    /// `[batch, T]` u32 (1 = real token), when given.
    pub attention_mask: Option<Tensor>,
    /// `[batch, T]` u32 positions restarting at 0 at each packed document, when given.
    pub position_ids: Option<Tensor>,
    /// The batch's objective (SFT, DPO or GRPO), its targets `[batch, T]` like `input_ids`.
    pub objective: Box<dyn Objective>,
    /// Real (unpadded) tokens in the batch.
    pub tokens: usize,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SftFile {
    #[allow(dead_code)]
    objective: String,
    input_ids: Vec<Vec<i64>>,
    labels: Vec<Vec<i64>>,
    attention_mask: Option<Vec<Vec<i64>>>,
    position_ids: Option<Vec<Vec<i64>>>,
}

/// A batch of preference pairs: DPO's, ORPO's or CPO's (each reads its own settings; a setting of
/// another objective is refused).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PairFile {
    objective: String,
    chosen_input_ids: Vec<Vec<i64>>,
    /// The completions' labels (every objective but `reward`, which reads whole rows).
    chosen_labels: Option<Vec<Vec<i64>>>,
    chosen_attention_mask: Option<Vec<Vec<i64>>>,
    rejected_input_ids: Vec<Vec<i64>>,
    rejected_labels: Option<Vec<Vec<i64>>>,
    rejected_attention_mask: Option<Vec<Vec<i64>>>,
    ref_chosen_logps: Option<Vec<f64>>,
    ref_rejected_logps: Option<Vec<f64>>,
    #[serde(default = "default_dpo_beta")]
    beta: f64,
    /// Weight of the chosen completions' mean token NLL added to the loss (TRL's "sft" loss type).
    #[serde(default)]
    sft_weight: f64,
    /// TRL's `loss_type`: one name or a list [default: sigmoid].
    loss_type: Option<OneOrMany>,
    /// TRL's `loss_weights`, one per loss type [default: 1 each].
    loss_weights: Option<Vec<f64>>,
    /// TRL's `label_smoothing` (exo_pair, robust, aot, aot_unpaired) [default: 0].
    label_smoothing: Option<f64>,
    /// TRL's `discopop_tau` [default: 0.05].
    discopop_tau: Option<f64>,
    /// CPO's NLL weight [default: 1; 0 for loss_type alphapo].
    cpo_alpha: Option<f64>,
    /// SimPO's target margin [default: 0.5].
    simpo_gamma: Option<f64>,
    /// AlphaPO's reward shape [default: 0].
    alpha: Option<f64>,
    /// The reward model's per-pair margins (TRL's `margin` column).
    margin: Option<Vec<f64>>,
    /// The reward model's `center_rewards_coefficient`.
    center_rewards_coefficient: Option<f64>,
}

/// A batch of unpaired KTO rows.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KtoFile {
    #[allow(dead_code)]
    objective: String,
    input_ids: Vec<Vec<i64>>,
    labels: Vec<Vec<i64>>,
    attention_mask: Option<Vec<Vec<i64>>>,
    /// Each row's kind: desirable (true) or undesirable.
    label: Vec<bool>,
    /// The reference's summed completion log-probs (computed when absent).
    ref_logps: Option<Vec<f64>>,
    /// The detached KL baseline (`kto`; at least 0).
    kl: Option<f64>,
    #[serde(default = "default_dpo_beta")]
    beta: f64,
    /// `kto` or `apo_zero_unpaired` [default: kto].
    loss_type: Option<String>,
    desirable_weight: Option<f64>,
    undesirable_weight: Option<f64>,
}

/// A name or a list of names, as TRL's config takes `loss_type`.
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl PairFile {
    /// Refuses the settings `self.objective` does not read (named as TRL's config names them).
    fn check_fields(&self) -> Result<()> {
        let objective = self.objective.as_str();
        let given = [
            ("ref_chosen_logps", self.ref_chosen_logps.is_some(), "dpo"),
            (
                "ref_rejected_logps",
                self.ref_rejected_logps.is_some(),
                "dpo",
            ),
            ("sft_weight", self.sft_weight != 0.0, "dpo"),
            ("loss_weights", self.loss_weights.is_some(), "dpo"),
            ("discopop_tau", self.discopop_tau.is_some(), "dpo"),
            ("loss_type", self.loss_type.is_some(), "dpo cpo"),
            ("label_smoothing", self.label_smoothing.is_some(), "dpo cpo"),
            ("cpo_alpha", self.cpo_alpha.is_some(), "cpo"),
            ("simpo_gamma", self.simpo_gamma.is_some(), "cpo"),
            ("alpha", self.alpha.is_some(), "cpo"),
            ("beta", self.beta != default_dpo_beta(), "dpo orpo cpo"),
            (
                "chosen_labels",
                self.chosen_labels.is_some(),
                "dpo orpo cpo",
            ),
            (
                "rejected_labels",
                self.rejected_labels.is_some(),
                "dpo orpo cpo",
            ),
            ("margin", self.margin.is_some(), "reward"),
            (
                "center_rewards_coefficient",
                self.center_rewards_coefficient.is_some(),
                "reward",
            ),
        ];
        let has_labels = self.chosen_labels.is_some() && self.rejected_labels.is_some();
        if objective != "reward" && !has_labels {
            return Err(TrainError::data(
                "batch",
                format!("{objective} needs chosen_labels and rejected_labels"),
            ));
        }
        for (field, set, takers) in given {
            if set && !takers.split(' ').any(|t| t == objective) {
                return Err(TrainError::data(
                    "batch",
                    format!(
                        "{field} applies to {}, not {objective}",
                        crate::and_list(&takers.split(' ').collect::<Vec<_>>())
                    ),
                ));
            }
        }
        Ok(())
    }

    /// CPO's settings: `loss_type`'s (TRL's defaults for it), then the file's own values.
    fn cpo_loss(&self) -> Result<CpoLoss> {
        let name = match &self.loss_type {
            None => None,
            Some(OneOrMany::One(name)) => Some(name.as_str()),
            Some(OneOrMany::Many(_)) => {
                return Err(TrainError::data(
                    "batch",
                    "cpo takes one loss_type, not a list",
                ))
            }
        };
        let (smoothing, gamma) = (self.label_smoothing, self.simpo_gamma);
        Ok(CpoLoss::from_config(
            name,
            smoothing,
            self.cpo_alpha,
            gamma,
            self.alpha,
        )?)
    }

    /// The loss the file asks for with `loss_type` (and its weights and constants); `None` without
    /// one: the default sigmoid, plus `sft_weight`'s NLL term.
    fn loss(&self) -> Result<Option<DpoLoss>> {
        let names: Vec<&str> = match &self.loss_type {
            None => {
                let stray = [
                    ("loss_weights", self.loss_weights.is_some()),
                    ("label_smoothing", self.label_smoothing.is_some()),
                    ("discopop_tau", self.discopop_tau.is_some()),
                ];
                if let Some((field, _)) = stray.iter().find(|(_, given)| *given) {
                    return Err(TrainError::data(
                        "batch",
                        format!("{field} needs loss_type"),
                    ));
                }
                return Ok(None);
            }
            Some(_) if self.sft_weight != 0.0 => return Err(TrainError::data(
                "batch",
                "sft_weight and loss_type both given: list \"sft\" in loss_type, its weight in \
                     loss_weights",
            )),
            Some(OneOrMany::One(name)) => vec![name.as_str()],
            Some(OneOrMany::Many(names)) => names.iter().map(String::as_str).collect(),
        };
        let loss = DpoLoss::from_config(
            &names,
            self.loss_weights.as_deref(),
            self.label_smoothing,
            self.discopop_tau,
        )?;
        Ok(Some(loss))
    }
}

/// Refuses a field of the file that none of the loss's `types` reads ([`LossSettings`]).
fn refuse_unread<T: LossSettings>(given: &[(&str, bool)], types: &[T]) -> Result<()> {
    for (field, _) in given.iter().filter(|(_, given)| *given) {
        if let Some(why) = streambp_objectives::settings::unread(field, types) {
            return Err(TrainError::data("batch", format!("{field} {why}")));
        }
    }
    Ok(())
}

fn default_dpo_beta() -> f64 {
    0.1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GrpoFile {
    #[allow(dead_code)]
    objective: String,
    input_ids: Vec<Vec<i64>>,
    attention_mask: Option<Vec<Vec<i64>>>,
    completion_mask: Vec<Vec<i64>>,
    advantages: Vec<f64>,
    old_logps: Option<Vec<Vec<f64>>>,
    ref_logps: Option<Vec<Vec<f64>>>,
    #[serde(default)]
    beta: f64,
    epsilon: Option<f64>,
    epsilon_high: Option<f64>,
    #[serde(default = "default_loss_type")]
    loss_type: String,
    max_completion_length: Option<usize>,
    /// TRL's GRPOConfig `temperature`: the policy's (and a computed reference's) log-probs are taken
    /// from `logits / temperature` [default: 1].
    #[serde(default = "default_temperature")]
    temperature: f64,
    /// dapo/cispo: the completion tokens of the whole global batch [default: this batch's].
    num_items_in_batch: Option<f64>,
    /// TRL's default: the KL term times the ratio.
    #[serde(default = "default_true")]
    use_bias_correction_kl: bool,
    sapo_temperature_pos: Option<f64>,
    sapo_temperature_neg: Option<f64>,
    /// `token` (TRL's default) or `sequence` (GSPO).
    #[serde(default = "default_importance_sampling_level")]
    importance_sampling_level: String,
    vespo_k_pos: Option<f64>,
    vespo_lambda_pos: Option<f64>,
    vespo_k_neg: Option<f64>,
    vespo_lambda_neg: Option<f64>,
    off_policy_mask_threshold: Option<f64>,
    #[serde(default)]
    entropy_coef: f64,
    #[serde(default = "default_top_entropy_quantile")]
    top_entropy_quantile: f64,
}

/// TRL's default: every completion token keeps its policy term.
fn default_top_entropy_quantile() -> f64 {
    1.0
}

/// An RLOO batch file: GRPO's rows with rewards in place of advantages.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RlooFile {
    #[allow(dead_code)]
    objective: String,
    input_ids: Vec<Vec<i64>>,
    attention_mask: Option<Vec<Vec<i64>>>,
    completion_mask: Vec<Vec<i64>>,
    rewards: Vec<f64>,
    #[serde(default = "default_rloo_generations")]
    num_generations: usize,
    old_logps: Option<Vec<Vec<f64>>>,
    ref_logps: Option<Vec<Vec<f64>>>,
    #[serde(default = "default_rloo_beta")]
    beta: f64,
    #[serde(default = "default_epsilon")]
    epsilon: f64,
    epsilon_high: Option<f64>,
    #[serde(default)]
    normalize_advantages: bool,
    #[serde(default = "default_temperature")]
    temperature: f64,
}

/// A distillation batch file: rows whose completions the student learns the teacher's
/// distributions on (TRL's `DistillationConfig` names and defaults).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DistillFile {
    #[allow(dead_code)]
    objective: String,
    input_ids: Vec<Vec<i64>>,
    attention_mask: Option<Vec<Vec<i64>>>,
    completion_mask: Vec<Vec<i64>>,
    #[serde(default = "default_distill_beta")]
    beta: f64,
    #[serde(default = "default_temperature")]
    temperature: f64,
}

/// TRL 1.16's `DistillationConfig.beta`: the reverse KL.
fn default_distill_beta() -> f64 {
    1.0
}

/// TRL 1.16's `RLOOConfig.num_generations`.
fn default_rloo_generations() -> usize {
    2
}

/// TRL 1.16's `RLOOConfig.beta`.
fn default_rloo_beta() -> f64 {
    0.05
}

fn default_importance_sampling_level() -> String {
    "token".into()
}

fn default_true() -> bool {
    true
}

fn default_sapo_pos() -> f64 {
    1.0
}

fn default_sapo_neg() -> f64 {
    1.05
}

fn default_temperature() -> f64 {
    1.0
}

fn default_epsilon() -> f64 {
    0.2
}

/// TRL 1.16's default.
fn default_loss_type() -> String {
    "dapo".into()
}

/// The largest batch file read: a batch of eight 128K-token rows in JSON is about 10 MiB.
pub const MAX_BYTES: u64 = 256 << 20;

/// Makes the teacher's logits of a distillation batch's rows (`input_ids`, attention mask).
pub type Teacher<'a> = dyn FnMut(&Tensor, Option<&Tensor>) -> Result<TeacherLogits> + 'a;

/// Reads and validates a batch file for the model `config` describes (its vocabulary, and for a
/// reward model its pad token, which says where rows are read). `reference` supplies reference
/// log-probs that DPO / GRPO files leave out. A distillation file needs a teacher:
/// [`load_batch_with_teacher`].
pub fn load_batch(
    path: &Path,
    config: &ModelConfig,
    device: &Device,
    reference: &mut Scorer,
) -> Result<PreparedBatch> {
    load_batch_with_teacher(path, config, device, reference, None)
}

/// [`load_batch`] with the `teacher` a distillation file compares against.
pub fn load_batch_with_teacher(
    path: &Path,
    config: &ModelConfig,
    device: &Device,
    reference: &mut Scorer,
    teacher: Option<&mut Teacher>,
) -> Result<PreparedBatch> {
    let vocab_size = config.vocab_size;
    let name = path.display().to_string();
    let fail = |reason: String| TrainError::BatchFile {
        path: name.clone(),
        reason,
    };
    let text = crate::input_file::read_text(path, MAX_BYTES).map_err(fail)?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        let hint = if text.contains("NaN") || text.contains("Infinity") {
            " (NaN and Infinity are not allowed in batch files)"
        } else {
            ""
        };
        fail(format!("not valid JSON: {e}{hint}"))
    })?;
    let objective = value
        .get("objective")
        .and_then(|o| o.as_str())
        .ok_or_else(|| fail(format!("no \"objective\" field ({})", objectives())))?;
    let unknown = || {
        fail(format!(
            "unknown objective {objective:?} (expected {})",
            objectives()
        ))
    };
    if !OBJECTIVE_NAMES.contains(&objective) {
        return Err(unknown());
    }
    if config.head == streambp_models::Head::Score && objective != "reward" {
        return Err(fail(format!(
            "objective {objective} needs a causal LM, and --model is a reward model (a sequence \
             classifier): give objective reward"
        )));
    }
    let named = |e: TrainError| match e {
        TrainError::Data { reason, .. } => fail(reason),
        TrainError::Objective(o) => fail(o.to_string()),
        other => other,
    };
    match objective {
        "sft" => {
            let file: SftFile = serde_json::from_value(value.clone())
                .map_err(|e| fail(format!("bad sft batch: {e}")))?;
            prepare_sft(file, vocab_size, device).map_err(named)
        }
        "dpo" | "orpo" | "cpo" | "reward" => {
            let file: PairFile = serde_json::from_value(value.clone())
                .map_err(|e| fail(format!("bad {objective} batch: {e}")))?;
            prepare_pairs(file, config, device, reference).map_err(named)
        }
        "kto" => {
            let file: KtoFile = serde_json::from_value(value.clone())
                .map_err(|e| fail(format!("bad kto batch: {e}")))?;
            prepare_kto(file, vocab_size, device, reference).map_err(named)
        }
        "grpo" => {
            let file: GrpoFile = serde_json::from_value(value.clone())
                .map_err(|e| fail(format!("bad grpo batch: {e}")))?;
            prepare_grpo(file, vocab_size, device, reference).map_err(named)
        }
        "rloo" => {
            let file: RlooFile = serde_json::from_value(value.clone())
                .map_err(|e| fail(format!("bad rloo batch: {e}")))?;
            prepare_rloo(file, vocab_size, device, reference).map_err(named)
        }
        "distill" => {
            let file: DistillFile = serde_json::from_value(value.clone())
                .map_err(|e| fail(format!("bad distill batch: {e}")))?;
            let teacher = teacher.ok_or_else(|| {
                fail("objective distill needs a teacher (grad --teacher DIR_OR_HUB_ID)".into())
            })?;
            prepare_distill(file, (vocab_size, device), reference, teacher).map_err(named)
        }
        _ => Err(unknown()),
    }
}

/// The objectives a batch file may name.
const OBJECTIVE_NAMES: [&str; 9] = [
    "sft", "dpo", "orpo", "cpo", "kto", "reward", "grpo", "rloo", "distill",
];
/// [`OBJECTIVE_NAMES`] in a message: "sft, dpo, … or grpo".
fn objectives() -> String {
    let (last, rest) = OBJECTIVE_NAMES.split_last().unwrap_or((&"", &[]));
    format!("{} or {last}", rest.join(", "))
}

/// Chosen and rejected rows stacked (chosen first) and right-padded to one length, under the pair
/// objective the file names.
fn prepare_pairs(
    file: PairFile,
    config: &ModelConfig,
    device: &Device,
    reference: &mut Scorer,
) -> Result<PreparedBatch> {
    let vocab_size = config.vocab_size;
    file.check_fields()?;
    let (pc, tc) = check_rectangular("chosen_input_ids", &file.chosen_input_ids)?;
    let (pr, tr) = check_rectangular("rejected_input_ids", &file.rejected_input_ids)?;
    if pc != pr {
        return Err(TrainError::data(
            "batch",
            format!("{pc} chosen rows but {pr} rejected rows: pairs must match"),
        ));
    }
    // A reward model reads whole rows: its labels (never given) are the ids.
    let chosen_labels = file
        .chosen_labels
        .clone()
        .unwrap_or(file.chosen_input_ids.clone());
    let rejected_labels = file
        .rejected_labels
        .clone()
        .unwrap_or(file.rejected_input_ids.clone());
    check_same_shape("chosen_labels", &chosen_labels, pc, tc)?;
    check_same_shape("rejected_labels", &rejected_labels, pr, tr)?;
    let ones = |b: usize, t: usize| vec![vec![1i64; t]; b];
    let chosen_mask = file
        .chosen_attention_mask
        .clone()
        .unwrap_or_else(|| ones(pc, tc));
    let rejected_mask = file
        .rejected_attention_mask
        .clone()
        .unwrap_or_else(|| ones(pr, tr));
    check_same_shape("chosen_attention_mask", &chosen_mask, pc, tc)?;
    check_same_shape("rejected_attention_mask", &rejected_mask, pr, tr)?;
    let t = tc.max(tr);
    let pad = |rows: &[Vec<i64>], fill: i64| -> Vec<Vec<i64>> {
        rows.iter().map(|r| padded(r, t, fill)).collect()
    };
    let ids = [
        pad(&file.chosen_input_ids, 0),
        pad(&file.rejected_input_ids, 0),
    ]
    .concat();
    let mask = [pad(&chosen_mask, 0), pad(&rejected_mask, 0)].concat();
    let labels = masked_labels(
        &[
            pad(&chosen_labels, IGNORE_INDEX),
            pad(&rejected_labels, IGNORE_INDEX),
        ]
        .concat(),
        &mask,
    );
    check_vocab(&ids, vocab_size)?;
    check_right_padded(&mask)?;
    let input_ids = to_u32_tensor(&ids, device)?;
    let attention_mask = to_u32_tensor(&mask, device)?;
    let objective: Box<dyn Objective> = match file.objective.as_str() {
        "orpo" => {
            let every_token = masked_labels(&ids, &mask);
            let orpo = Orpo::new(&labels, &every_token, file.beta, vocab_size, device)?;
            Box::new(orpo)
        }
        "reward" => Box::new(reward_objective(&file, &ids, config, device)?),
        "cpo" => Box::new(Cpo::new(
            &labels,
            file.beta,
            file.cpo_loss()?,
            vocab_size,
            device,
        )?),
        _ => {
            let rows = (&input_ids, &attention_mask, pc);
            Box::new(dpo_objective(&file, &labels, rows, vocab_size, reference)?)
        }
    };
    Ok(PreparedBatch {
        input_ids,
        attention_mask: Some(attention_mask),
        position_ids: None,
        objective,
        tokens: mask.iter().flatten().filter(|&&v| v != 0).count(),
    })
}

/// A reward model's objective over the stacked rows `ids`, read where `config`'s classifier reads
/// them (transformers' rule: the last token that is not the pad token).
fn reward_objective(
    file: &PairFile,
    ids: &[Vec<i64>],
    config: &ModelConfig,
    device: &Device,
) -> Result<RewardModel> {
    if config.head != streambp_models::Head::Score {
        return Err(TrainError::data(
            "batch",
            "objective reward needs a reward model (--model a *ForSequenceClassification directory \
             with num_labels 1)",
        ));
    }
    let pad = config.pad_token_id.ok_or_else(|| {
        TrainError::data(
            "batch",
            "the reward model's config has no pad_token_id: transformers reads each row at its \
             last non-pad token",
        )
    })?;
    let t = ids.first().map(Vec::len).unwrap_or(0);
    let mut reward = RewardModel::new(&pooled_positions(ids, pad), t, device)?;
    if let Some(margins) = &file.margin {
        reward = reward.with_margins(margins)?;
    }
    if let Some(c) = file.center_rewards_coefficient {
        reward = reward.with_center(c)?;
    }
    Ok(reward)
}

/// DPO over stacked rows `(input_ids, attention_mask, pairs)`, its reference log-probs the file's or
/// `reference`'s.
fn dpo_objective(
    file: &PairFile,
    labels: &[Vec<i64>],
    (input_ids, attention_mask, pc): (&Tensor, &Tensor, usize),
    vocab_size: usize,
    reference: &mut Scorer,
) -> Result<Dpo> {
    let loss = file.loss()?;
    let device = input_ids.device();
    let (ref_chosen, ref_rejected) = match (&file.ref_chosen_logps, &file.ref_rejected_logps) {
        (Some(c), Some(r)) => (c.clone(), r.clone()),
        (None, None) => {
            let targets =
                streambp_objectives::TokenTargets::from_labels(labels, vocab_size, device)?;
            let sums = sequence_logps(reference, input_ids, Some(attention_mask), &targets)?;
            (sums[..pc].to_vec(), sums[pc..].to_vec())
        }
        _ => {
            return Err(TrainError::data(
                "batch",
                "give both ref_chosen_logps and ref_rejected_logps, or neither",
            ))
        }
    };
    let dpo = Dpo::new(
        labels,
        &ref_chosen,
        &ref_rejected,
        file.beta,
        vocab_size,
        device,
    )?;
    Ok(match loss {
        Some(loss) => dpo.with_loss(loss)?,
        None => dpo.with_sft_weight(file.sft_weight)?,
    })
}

/// The rows of a GRPO or RLOO file on the device: `input_ids` and the attention mask checked
/// (rectangular, inside the vocabulary, right-padded, no completion token on padding), and the
/// reference's log-probs: the file's, or computed where `beta` needs them and it gives none.
struct CompletionRows {
    input_ids: Tensor,
    attention_mask: Option<Tensor>,
    ref_logps: Option<Vec<Vec<f64>>>,
    /// Real (unpadded) tokens.
    tokens: usize,
}

impl CompletionRows {
    /// The batch of these rows and `objective`.
    fn with(self, objective: Box<dyn Objective>) -> PreparedBatch {
        PreparedBatch {
            input_ids: self.input_ids,
            attention_mask: self.attention_mask,
            position_ids: None,
            objective,
            tokens: self.tokens,
        }
    }
}

/// What [`completion_rows`] reads of a GRPO or RLOO file, as the file gives it.
struct RowArrays<'a> {
    ids: &'a [Vec<i64>],
    attention_mask: Option<&'a Vec<Vec<i64>>>,
    completion_mask: &'a [Vec<i64>],
    ref_logps: Option<&'a Vec<Vec<f64>>>,
    beta: f64,
    temperature: f64,
}

/// The [`RowArrays`] of a GRPO or RLOO file, which name them alike.
macro_rules! row_arrays {
    ($file:expr) => {
        RowArrays {
            ids: &$file.input_ids,
            attention_mask: $file.attention_mask.as_ref(),
            completion_mask: &$file.completion_mask,
            ref_logps: $file.ref_logps.as_ref(),
            beta: $file.beta,
            temperature: $file.temperature,
        }
    };
}

/// [`CompletionRows`] of a file's arrays.
fn completion_rows(
    file: RowArrays,
    (vocab_size, device): (usize, &Device),
    reference: &mut Scorer,
) -> Result<CompletionRows> {
    let RowArrays {
        ids,
        attention_mask,
        completion_mask,
        ref_logps,
        beta,
        temperature,
    } = file;
    let (b, t) = check_rectangular("input_ids", ids)?;
    check_vocab(ids, vocab_size)?;
    check_same_shape("completion_mask", completion_mask, b, t)?;
    if let Some(m) = attention_mask {
        check_same_shape("attention_mask", m, b, t)?;
        check_right_padded(m)?;
        for (row, (c, m)) in completion_mask.iter().zip(m).enumerate() {
            if c.iter().zip(m).any(|(&c, &m)| c != 0 && m == 0) {
                return Err(TrainError::data(
                    "batch",
                    format!("completion_mask row {row} marks a padded position"),
                ));
            }
        }
    }
    let input_ids = to_u32_tensor(ids, device)?;
    let mask = attention_mask
        .map(|m| to_u32_tensor(m, device))
        .transpose()?;
    let ref_logps = match (ref_logps, beta != 0.0) {
        (None, true) => Some(token_logps(
            reference,
            (&input_ids, mask.as_ref()),
            ids,
            temperature,
        )?),
        (given, _) => given.cloned(),
    };
    Ok(CompletionRows {
        input_ids,
        attention_mask: mask,
        ref_logps,
        tokens: match attention_mask {
            Some(m) => m.iter().flatten().filter(|&&v| v != 0).count(),
            None => b * t,
        },
    })
}

fn prepare_grpo(
    file: GrpoFile,
    vocab_size: usize,
    device: &Device,
    reference: &mut Scorer,
) -> Result<PreparedBatch> {
    let rows = completion_rows(row_arrays!(file), (vocab_size, device), reference)?;
    let loss_type = file.loss_type.parse::<GrpoLossType>()?;
    refuse_unread(
        &[
            ("epsilon", file.epsilon.is_some()),
            ("epsilon_high", file.epsilon_high.is_some()),
            ("sapo_temperature_pos", file.sapo_temperature_pos.is_some()),
            ("sapo_temperature_neg", file.sapo_temperature_neg.is_some()),
            ("vespo_k_pos", file.vespo_k_pos.is_some()),
            ("vespo_lambda_pos", file.vespo_lambda_pos.is_some()),
            ("vespo_k_neg", file.vespo_k_neg.is_some()),
            ("vespo_lambda_neg", file.vespo_lambda_neg.is_some()),
        ],
        &[loss_type],
    )?;
    let epsilon = file.epsilon.unwrap_or(default_epsilon());
    let gamma = VespoGamma::default();
    let grpo = Grpo::new(
        &GrpoBatch {
            rollouts: Rollouts {
                input_ids: &file.input_ids,
                completion_mask: &file.completion_mask,
                old_logps: file.old_logps.as_deref(),
                ref_logps: rows.ref_logps.as_deref(),
            },
            advantages: &file.advantages,
            beta: file.beta,
            epsilon_low: epsilon,
            epsilon_high: file.epsilon_high.unwrap_or(epsilon),
            loss_type,
            max_completion_length: file.max_completion_length,
            temperature: file.temperature,
            num_items_in_batch: file.num_items_in_batch,
            use_bias_correction_kl: file.use_bias_correction_kl,
            sapo_temperatures: (
                file.sapo_temperature_pos.unwrap_or(default_sapo_pos()),
                file.sapo_temperature_neg.unwrap_or(default_sapo_neg()),
            ),
            importance_sampling: file.importance_sampling_level.parse()?,
            vespo_gamma: VespoGamma {
                positive: (
                    file.vespo_k_pos.unwrap_or(gamma.positive.0),
                    file.vespo_lambda_pos.unwrap_or(gamma.positive.1),
                ),
                negative: (
                    file.vespo_k_neg.unwrap_or(gamma.negative.0),
                    file.vespo_lambda_neg.unwrap_or(gamma.negative.1),
                ),
            },
            off_policy_mask_threshold: file.off_policy_mask_threshold,
            entropy_coef: file.entropy_coef,
            top_entropy_quantile: file.top_entropy_quantile,
            entropy_pool: None,
            entropy_stats: false,
        },
        vocab_size,
        device,
    )?;
    Ok(rows.with(Box::new(grpo)))
}

/// A distillation file's batch, its teacher's logits from `teacher`.
fn prepare_distill(
    file: DistillFile,
    (vocab_size, device): (usize, &Device),
    reference: &mut Scorer,
    teacher: &mut Teacher,
) -> Result<PreparedBatch> {
    let rows = completion_rows(
        RowArrays {
            ids: &file.input_ids,
            attention_mask: file.attention_mask.as_ref(),
            completion_mask: &file.completion_mask,
            ref_logps: None,
            // No reference: beta is the divergence's.
            beta: 0.0,
            temperature: file.temperature,
        },
        (vocab_size, device),
        reference,
    )?;
    let batch = DistillBatch {
        input_ids: &file.input_ids,
        completion_mask: &file.completion_mask,
        beta: file.beta,
        temperature: file.temperature,
    };
    // The file's settings first: the teacher's forward is the expensive part.
    batch.check(vocab_size)?;
    let logits = teacher(&rows.input_ids, rows.attention_mask.as_ref())?;
    let distill = Distill::new(&batch, logits, vocab_size, device)?;
    Ok(rows.with(Box::new(distill)))
}

/// An RLOO file's batch (TRL's `RLOOConfig` names and defaults).
fn prepare_rloo(
    file: RlooFile,
    vocab_size: usize,
    device: &Device,
    reference: &mut Scorer,
) -> Result<PreparedBatch> {
    let rows = completion_rows(row_arrays!(file), (vocab_size, device), reference)?;
    let rloo = Rloo::new(
        &RlooBatch {
            rollouts: Rollouts {
                input_ids: &file.input_ids,
                completion_mask: &file.completion_mask,
                old_logps: file.old_logps.as_deref(),
                ref_logps: rows.ref_logps.as_deref(),
            },
            rewards: &file.rewards,
            num_generations: file.num_generations,
            beta: file.beta,
            epsilon_low: file.epsilon,
            epsilon_high: file.epsilon_high.unwrap_or(file.epsilon),
            normalize_advantages: file.normalize_advantages,
            temperature: file.temperature,
        },
        vocab_size,
        device,
    )?;
    Ok(rows.with(Box::new(rloo)))
}

/// KTO's rows, their kinds and the KL baseline as the file gives them (the reference's log-probs
/// computed when absent).
fn prepare_kto(
    file: KtoFile,
    vocab_size: usize,
    device: &Device,
    reference: &mut Scorer,
) -> Result<PreparedBatch> {
    let (b, t) = check_rectangular("input_ids", &file.input_ids)?;
    check_same_shape("labels", &file.labels, b, t)?;
    let mask = file.attention_mask.clone().unwrap_or(vec![vec![1; t]; b]);
    check_same_shape("attention_mask", &mask, b, t)?;
    check_right_padded(&mask)?;
    check_vocab(&file.input_ids, vocab_size)?;
    let loss_type: KtoLossType = match &file.loss_type {
        Some(name) => name.parse()?,
        None => KtoLossType::Kto,
    };
    let kl = match (loss_type.uses_kl(), file.kl) {
        (true, Some(kl)) => kl,
        (true, None) => {
            return Err(TrainError::data(
                "batch",
                "kto needs kl, the detached KL baseline (TRL's mean over the batch of the \
                 mismatched rows' policy-minus-reference log-probs, clamped at 0)",
            ))
        }
        (false, Some(_)) => {
            return Err(TrainError::data(
                "batch",
                "kl applies to loss_type kto, not apo_zero_unpaired",
            ))
        }
        (false, None) => 0.0,
    };
    let weights = (file.desirable_weight, file.undesirable_weight);
    let loss = KtoLoss::from_config(Some(loss_type), weights.0, weights.1);
    let labels = masked_labels(&file.labels, &mask);
    let input_ids = to_u32_tensor(&file.input_ids, device)?;
    let attention_mask = to_u32_tensor(&mask, device)?;
    let ref_logps = match file.ref_logps {
        Some(given) => given,
        None => {
            let targets =
                streambp_objectives::TokenTargets::from_labels(&labels, vocab_size, device)?;
            sequence_logps(reference, &input_ids, Some(&attention_mask), &targets)?
        }
    };
    let on = (vocab_size, device);
    let kto = Kto::new(&labels, &file.label, &ref_logps, kl, file.beta, loss, on)?;
    Ok(PreparedBatch {
        input_ids,
        attention_mask: Some(attention_mask),
        position_ids: None,
        objective: Box::new(kto),
        tokens: mask.iter().flatten().filter(|&&v| v != 0).count(),
    })
}

fn prepare_sft(file: SftFile, vocab_size: usize, device: &Device) -> Result<PreparedBatch> {
    let (b, t) = check_rectangular("input_ids", &file.input_ids)?;
    check_same_shape("labels", &file.labels, b, t)?;
    check_vocab(&file.input_ids, vocab_size)?;
    let mask = match &file.attention_mask {
        Some(m) => {
            check_same_shape("attention_mask", m, b, t)?;
            check_right_padded(m)?;
            Some(m)
        }
        None => None,
    };
    if let Some(p) = &file.position_ids {
        check_same_shape("position_ids", p, b, t)?;
    }
    // Padded positions are never targets, whatever their label says.
    let labels = match mask {
        Some(m) => masked_labels(&file.labels, m),
        None => file.labels.clone(),
    };
    let sft = Sft::new(&labels, vocab_size, None, device)?;
    let tokens = match mask {
        Some(m) => m.iter().flatten().filter(|&&v| v != 0).count(),
        None => b * t,
    };
    Ok(PreparedBatch {
        input_ids: to_u32_tensor(&file.input_ids, device)?,
        attention_mask: mask.map(|m| to_u32_tensor(m, device)).transpose()?,
        position_ids: file
            .position_ids
            .as_ref()
            .map(|p| to_u32_tensor(p, device))
            .transpose()?,
        objective: Box::new(sft),
        tokens,
    })
}

/// `(rows, columns)` of a non-empty rectangular matrix, or an error naming the first bad row.
pub fn check_rectangular(what: &str, rows: &[Vec<i64>]) -> Result<(usize, usize)> {
    let t = rows
        .first()
        .map(Vec::len)
        .ok_or_else(|| TrainError::data("batch", format!("{what} has no rows")))?;
    if t == 0 {
        return Err(TrainError::data("batch", format!("{what} row 0 is empty")));
    }
    if let Some((i, r)) = rows.iter().enumerate().find(|(_, r)| r.len() != t) {
        return Err(TrainError::data(
            "batch",
            format!(
                "{what} is ragged: row {i} has {} entries, row 0 has {t} (pad rows to one length)",
                r.len()
            ),
        ));
    }
    Ok((rows.len(), t))
}

/// `rows` is rectangular and `b × t`, like input_ids; `what` names it in the error.
pub fn check_same_shape(what: &str, rows: &[Vec<i64>], b: usize, t: usize) -> Result<()> {
    let shape = check_rectangular(what, rows)?;
    if shape != (b, t) {
        return Err(TrainError::data(
            "batch",
            format!("{what} is {}x{} but input_ids is {b}x{t}", shape.0, shape.1),
        ));
    }
    Ok(())
}

/// Every id is in `0..vocab_size`.
pub fn check_vocab(ids: &[Vec<i64>], vocab_size: usize) -> Result<()> {
    for (row, r) in ids.iter().enumerate() {
        if let Some((pos, id)) = r
            .iter()
            .enumerate()
            .find(|(_, &id)| id < 0 || id as usize >= vocab_size)
        {
            return Err(TrainError::data("batch", format!(
                "token id {id} at row {row}, position {pos} is outside the vocabulary (size {vocab_size})"
            )));
        }
    }
    Ok(())
}

/// Masks hold 0/1, and once a row has a 0 it stays 0 (right padding, which the engine assumes).
pub fn check_right_padded(mask: &[Vec<i64>]) -> Result<()> {
    for (row, r) in mask.iter().enumerate() {
        if let Some(v) = r.iter().find(|&&v| v != 0 && v != 1) {
            return Err(TrainError::data(
                "batch",
                format!("attention_mask row {row} holds {v}; expected 0 or 1"),
            ));
        }
        let first_pad = r.iter().position(|&v| v == 0).unwrap_or(r.len());
        if r[first_pad..].iter().any(|&v| v != 0) {
            return Err(TrainError::data(
                "batch",
                format!("attention_mask row {row} is not right-padded (a 1 follows a 0)"),
            ));
        }
        if first_pad == 0 {
            return Err(TrainError::data(
                "batch",
                format!("attention_mask row {row} has no real token"),
            ));
        }
    }
    Ok(())
}
