//! The GRPO recipe (TRL's loss): per prompt, sample a group of completions with the KV-cache sampler,
//! score them with the reward functions, normalise rewards within the group into advantages, and take
//! `num_iterations` optimizer steps on those rollouts (old log-probs fixed before the first one).

use std::path::Path;

use candle_core::Tensor;
use serde_json::{Map, Value};
use streambp_core::{forward_logprobs, Batch};
use streambp_models::init::NormalRng;
use streambp_objectives::{Grpo, GrpoBatch, GrpoLossType};

use crate::batch_file::{align_to_inputs, next_token_targets, to_u32_tensor};
use crate::data::read_jsonl;
use crate::recipe::{Setup, StepAccumulator, Summary, TrainConfig, Trainer};
use crate::rewards::{group_advantages, parse_reward, Reward};
use crate::sampling::{sample_group, SamplingConfig};
use crate::sft::{eval_accuracy, eval_rows};
use crate::{Result, TrainError};

/// GRPO's settings beyond the shared ones.
#[derive(Debug, Clone)]
pub struct GrpoConfig {
    pub group_size: usize,
    pub sampling: SamplingConfig,
    /// `exact:COLUMN` / `format:REGEX`, summed.
    pub rewards: Vec<String>,
    pub loss_type: String,
    pub epsilon: f64,
    pub num_iterations: usize,
}

/// One group of rollouts as a right-padded GRPO batch.
struct Rollouts {
    input_ids: Vec<Vec<i64>>,
    attention_mask: Vec<Vec<i64>>,
    completion_mask: Vec<Vec<i64>>,
    advantages: Vec<f64>,
    rewards: Vec<f64>,
    lengths: Vec<usize>,
}

fn prompt_rows(path: &Path) -> Result<Vec<Map<String, Value>>> {
    let rows = read_jsonl(path)?;
    for (i, r) in rows.iter().enumerate() {
        if !matches!(r.get("prompt"), Some(Value::String(_))) {
            return Err(TrainError::Usage(format!(
                "{} line {}: GRPO data needs a \"prompt\" string",
                path.display(),
                i + 1
            )));
        }
    }
    Ok(rows)
}

#[allow(clippy::too_many_arguments)]
fn rollout(
    setup: &Setup,
    row: &Map<String, Value>,
    rewards: &[Box<dyn Reward>],
    g: &GrpoConfig,
    rng: &mut NormalRng,
    reward_totals: &mut [f64],
) -> Result<Rollouts> {
    let tok = &setup.tokenizer;
    let prompt = row["prompt"].as_str().unwrap_or_default();
    let prompt_ids = tok.encode(prompt)?;
    let completions = sample_group(
        &setup.model,
        &prompt_ids,
        g.group_size,
        tok.eos_id,
        &g.sampling,
        rng,
    )?;
    let mut scores = Vec::with_capacity(completions.len());
    for c in &completions {
        let text = tok.decode(c)?;
        let mut total = 0.0;
        for (k, r) in rewards.iter().enumerate() {
            let s = r.score(&text, row);
            reward_totals[k] += s;
            total += s;
        }
        scores.push(total);
    }
    let mut rows: Vec<Vec<i64>> = Vec::new();
    let mut masks = Vec::new();
    let mut lengths = Vec::new();
    for c in &completions {
        let mut ids: Vec<i64> = prompt_ids.iter().map(|&t| t as i64).collect();
        let mut comp: Vec<i64> = c.iter().map(|&t| t as i64).collect();
        if c.len() < g.sampling.max_new_tokens {
            comp.push(tok.eos_id as i64); // it stopped on EOS, which is part of what it chose
        }
        lengths.push(comp.len());
        let mut mask = vec![0i64; ids.len()];
        mask.extend(std::iter::repeat_n(1, comp.len()));
        ids.extend(comp);
        rows.push(ids);
        masks.push(mask);
    }
    let t = rows.iter().map(Vec::len).max().unwrap_or(0);
    let attention_mask = rows
        .iter()
        .map(|r| (0..t).map(|i| (i < r.len()) as i64).collect())
        .collect();
    for (r, m) in rows.iter_mut().zip(masks.iter_mut()) {
        r.resize(t, tok.pad_id as i64);
        m.resize(t, 0);
    }
    Ok(Rollouts {
        input_ids: rows,
        attention_mask,
        completion_mask: masks,
        advantages: group_advantages(&scores),
        rewards: scores,
        lengths,
    })
}

pub fn run_grpo(cfg: &TrainConfig, g: &GrpoConfig) -> Result<Summary> {
    cfg.reject_packing()?;
    let setup = Setup::new(cfg)?;
    let builtin = cfg.data.is_none();
    let data = setup
        .data_path(&cfg.data, "train.jsonl")
        .expect("built-in data");
    let rows = prompt_rows(&data)?;
    let reward_specs: Vec<String> = match (g.rewards.is_empty(), builtin) {
        (false, _) => g.rewards.clone(),
        (true, true) => vec!["exact:completion".into(), "format:[0-9]+".into()],
        (true, false) => {
            return Err(TrainError::Usage(
                "GRPO needs at least one --reward (exact:COLUMN or format:REGEX)".into(),
            ))
        }
    };
    let rewards = reward_specs
        .iter()
        .map(|s| parse_reward(s))
        .collect::<Result<Vec<_>>>()?;
    let loss_type: GrpoLossType = g.loss_type.parse()?;
    let reference = (cfg.beta != 0.0)
        .then(|| setup.model.frozen_copy())
        .transpose()?;
    let eval_path = cfg.eval_data.clone().or_else(|| {
        builtin
            .then(|| setup.data_path(&None, "test.jsonl"))
            .flatten()
    });
    let eval = eval_path.as_deref().map(eval_rows).transpose()?;
    let before = eval_accuracy(&setup, &eval)?;
    tracing::info!(prompts = rows.len(), group = g.group_size, rewards = ?reward_specs, "grpo");

    let mut trainer = Trainer::new(cfg, &setup, rows.len())?;
    let model = &setup.model;
    let mut rng = NormalRng::new(cfg.seed ^ 0x5eed);
    let mut pending: Vec<(Rollouts, Option<Vec<Vec<f64>>>)> = Vec::new();
    // Mean reward of each batch of rollouts, for the summary.
    let mut reward_history: Vec<f64> = Vec::new();
    let mut iteration = 0;
    for step in trainer.start_step..trainer.max_steps {
        trainer.begin_step();
        let mut acc = StepAccumulator::default();
        if iteration == 0 {
            // New rollouts: batch_size prompts, a group each.
            pending.clear();
            let mut totals = vec![0.0; rewards.len()];
            let picked = trainer.data.take(cfg.batch_size);
            for &i in &picked {
                let r = rollout(&setup, &rows[i], &rewards, g, &mut rng, &mut totals)?;
                let old = if g.num_iterations > 1 {
                    Some(per_position_logps(model, &r, cfg)?)
                } else {
                    None
                };
                pending.push((r, old));
            }
            let n = (picked.len() * g.group_size) as f64;
            for (r, total) in rewards.iter().zip(&totals) {
                acc.add_metric(r.name(), total / n);
            }
            let all: Vec<f64> = pending
                .iter()
                .flat_map(|(r, _)| r.rewards.clone())
                .collect();
            let mean_reward = all.iter().sum::<f64>() / all.len() as f64;
            reward_history.push(mean_reward);
            acc.add_metric("reward", mean_reward);
            let lengths: Vec<usize> = pending
                .iter()
                .flat_map(|(r, _)| r.lengths.clone())
                .collect();
            acc.add_metric(
                "completion_length",
                lengths.iter().sum::<usize>() as f64 / lengths.len() as f64,
            );
        }
        iteration = (iteration + 1) % g.num_iterations.max(1);

        let groups = pending.len() as f64;
        for (r, old) in &pending {
            let ids = to_u32_tensor(&r.input_ids, &setup.device)?;
            let mask = to_u32_tensor(&r.attention_mask, &setup.device)?;
            let ref_logps = match &reference {
                Some(m) => Some(logps_of(m, &ids, &mask, &r.input_ids, cfg)?),
                None => None,
            };
            let objective = Grpo::new(
                &GrpoBatch {
                    input_ids: &r.input_ids,
                    completion_mask: &r.completion_mask,
                    advantages: &r.advantages,
                    old_logps: old.as_deref(),
                    ref_logps: ref_logps.as_deref(),
                    beta: cfg.beta,
                    epsilon_low: g.epsilon,
                    epsilon_high: g.epsilon,
                    loss_type,
                    max_completion_length: Some(g.sampling.max_new_tokens + 1),
                },
                model.config.vocab_size,
                &setup.device,
            )?;
            let batch = Batch::new(&ids, Some(&mask));
            let out = cfg.backward(model, batch, &objective)?;
            let tokens = r
                .attention_mask
                .iter()
                .flatten()
                .filter(|&&m| m == 1)
                .count();
            // Each group's loss is a mean over its sequences; the step averages the groups.
            acc.add(out, tokens, 1.0 / groups)?;
        }
        trainer.finish_step(cfg, &setup, step, acc.into_report()?)?;
    }
    // Training reward: mean over the first and the last (up to) five batches of rollouts.
    let window = reward_history.len().clamp(1, 5);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let mut before = before;
    before.push((
        "reward".into(),
        mean(&reward_history[..window.min(reward_history.len())]),
    ));
    let last_reward = mean(&reward_history[reward_history.len().saturating_sub(window)..]);
    trainer.finish(cfg, &setup, before, || {
        let mut after = eval_accuracy(&setup, &eval)?;
        after.push(("reward".into(), last_reward));
        Ok(after)
    })
}

/// Per-position log-probs aligned with input_ids (position t: log p(ids[t]); 0 at t = 0), no graph.
fn logps_of(
    model: &streambp_models::Model,
    ids: &Tensor,
    mask: &Tensor,
    rows: &[Vec<i64>],
    cfg: &TrainConfig,
) -> Result<Vec<Vec<f64>>> {
    let targets = to_u32_tensor(&next_token_targets(rows), ids.device())?;
    let chunks = cfg.chunks_for(model, ids)?;
    let batch = Batch::new(ids, Some(mask));
    align_to_inputs(&forward_logprobs(model, batch, &targets, chunks)?)
}

fn per_position_logps(
    model: &streambp_models::Model,
    r: &Rollouts,
    cfg: &TrainConfig,
) -> Result<Vec<Vec<f64>>> {
    let ids = to_u32_tensor(&r.input_ids, model.device())?;
    let mask = to_u32_tensor(&r.attention_mask, model.device())?;
    logps_of(model, &ids, &mask, &r.input_ids, cfg)
}
