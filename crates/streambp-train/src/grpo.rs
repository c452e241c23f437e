//! The GRPO recipe (TRL's loss): per prompt, sample a group of completions with the KV-cache sampler,
//! score them with the reward functions, normalise rewards within the group into advantages, and take
//! `num_iterations` optimizer steps on those rollouts (old log-probs fixed before the first one).

use std::path::Path;

use candle_core::Tensor;
use serde_json::Value;
use streambp_core::{forward_logprobs, Batch};
use streambp_models::init::NormalRng;
use streambp_objectives::{Grpo, GrpoBatch};

use crate::batch_file::{align_to_inputs, next_token_targets, to_u32_tensor};
use crate::checkpoint::{data_identity, RunRecord};
use crate::config::{GrpoConfig, Recipe, TrainConfig};
use crate::data::{read_jsonl, Overflow, Row, UnknownText};
use crate::recipe::{Setup, StepAccumulator, Summary, Trainer};
use crate::rewards::{group_advantages, parse_reward, Reward};
use crate::sampling::sample_group;
use crate::sft::{eval_accuracy, eval_rows};
use crate::{Result, TrainError};

/// One group of rollouts as a right-padded GRPO batch.
struct Rollouts {
    input_ids: Vec<Vec<i64>>,
    attention_mask: Vec<Vec<i64>>,
    completion_mask: Vec<Vec<i64>>,
    advantages: Vec<f64>,
    rewards: Vec<f64>,
    lengths: Vec<usize>,
}

/// A prompt to sample from: its tokens (cut to fit `--max-length` with the completion) and its data row,
/// which the rewards read.
#[derive(Hash)]
struct Prompt {
    ids: Vec<u32>,
    row: Row,
}

/// The prompts of a GRPO data file: rows with a `prompt` string and every column a reward reads. A
/// prompt that leaves no room for `max_new_tokens` within `max_length` is skipped or cut from the left
/// (TRL keeps a prompt's end).
fn load_prompts(
    path: &Path,
    setup: &Setup,
    cfg: &TrainConfig,
    g: &GrpoConfig,
    rewards: &[Box<dyn Reward>],
) -> Result<Vec<Prompt>> {
    let room = cfg.max_length - g.sampling.max_new_tokens;
    let (mut truncated, mut skipped) = (0usize, 0usize);
    let mut unknown = UnknownText::default();
    let mut prompts = Vec::new();
    for (line, row) in read_jsonl(path)? {
        let where_ = format!("{} line {line}", path.display());
        let Some(Value::String(text)) = row.get("prompt") else {
            return Err(TrainError::data(
                where_,
                "GRPO data needs a \"prompt\" string",
            ));
        };
        for column in rewards.iter().filter_map(|r| r.column()) {
            if !row.contains_key(column) {
                return Err(TrainError::data(
                    where_,
                    format!("no {column:?} column, which the reward exact:{column} reads"),
                ));
            }
        }
        let mut ids = setup.tokenizer.encode(text)?;
        unknown.note(&setup.tokenizer, &ids, &where_);
        if ids.len() > room {
            if cfg.overflow == Overflow::Skip {
                skipped += 1;
                continue;
            }
            ids.drain(..ids.len() - room);
            truncated += 1;
        }
        prompts.push(Prompt { ids, row });
    }
    unknown.report();
    if truncated + skipped > 0 {
        tracing::warn!(
            truncated,
            skipped,
            room,
            "prompts longer than --max-length minus --max-new-tokens"
        );
    }
    if prompts.is_empty() {
        return Err(TrainError::data(
            path.display(),
            "no prompt left to train on",
        ));
    }
    Ok(prompts)
}

fn rollout(
    setup: &Setup,
    prompt: &Prompt,
    rewards: &[Box<dyn Reward>],
    g: &GrpoConfig,
    rng: &mut NormalRng,
    reward_totals: &mut [f64],
) -> Result<Rollouts> {
    let tok = &setup.tokenizer;
    let (prompt_ids, row) = (&prompt.ids, &prompt.row);
    let completions = sample_group(
        &setup.model,
        prompt_ids,
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
    g.validate(cfg)?;
    let builtin = cfg.data.is_none();
    let reward_specs: Vec<String> = match (g.rewards.is_empty(), builtin) {
        (false, _) => g.rewards.clone(),
        (true, true) => vec!["exact:completion".into(), "format:[0-9]+".into()],
        (true, false) => {
            return Err(TrainError::flag(
                "--reward",
                "(none)",
                "GRPO needs at least one --reward (exact:COLUMN or format:REGEX)",
            ))
        }
    };
    let rewards = reward_specs
        .iter()
        .map(|s| parse_reward(s))
        .collect::<Result<Vec<_>>>()?;
    let setup = Setup::new(cfg, Recipe::Grpo)?;
    let data = setup.data_path(&cfg.data, "train.jsonl")?;
    let prompts = load_prompts(&data, &setup, cfg, g, &rewards)?;
    let reference = (cfg.beta != 0.0)
        .then(|| setup.model.frozen_copy())
        .transpose()?;
    let eval = setup.eval_path(cfg).as_deref().map(eval_rows).transpose()?;
    let before = eval_accuracy(&setup, &eval)?;
    tracing::info!(prompts = prompts.len(), group = g.group_size, rewards = ?reward_specs, "grpo");

    cfg.check_data_size(prompts.len(), "prompts", &data)?;
    let mut run = cfg.record(Recipe::Grpo);
    run.insert("data".into(), data_identity(&prompts));
    g.record(&reward_specs, &mut run);
    let mut trainer = Trainer::new(cfg, &setup, prompts.len(), run)?;
    if trainer.start_step % g.num_iterations != 0 {
        tracing::warn!(
            step = trainer.start_step,
            num_iterations = g.num_iterations,
            "resumed between the iterations of one batch of rollouts: new rollouts are drawn, so the \
             run differs from an uninterrupted one until the next batch"
        );
    }
    let model = &setup.model;
    let mut pending: Vec<(Rollouts, Option<Vec<Vec<f64>>>)> = Vec::new();
    // Mean reward of each batch of rollouts, for the summary.
    let mut reward_history: Vec<f64> = Vec::new();
    for step in trainer.start_step..trainer.max_steps {
        trainer.begin_step();
        let mut acc = StepAccumulator::default();
        if step % g.num_iterations == 0 || pending.is_empty() {
            // New rollouts: batch_size × grad_accum prompts, a group each, sampled from a generator
            // seeded by the step, so a resumed run draws what the uninterrupted one drew.
            pending.clear();
            let mut rng = NormalRng::new(
                cfg.seed ^ 0x5eed ^ (step as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
            let mut totals = vec![0.0; rewards.len()];
            let picked = trainer.data.take(cfg.examples_per_step()?);
            for &i in &picked {
                let r = rollout(&setup, &prompts[i], &rewards, g, &mut rng, &mut totals)?;
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
                    loss_type: g.loss_type,
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

impl GrpoConfig {
    /// GRPO's settings in a checkpoint's run record.
    fn record(&self, rewards: &[String], run: &mut RunRecord) {
        let s = &self.sampling;
        for (flag, value) in [
            ("--group-size", self.group_size.into()),
            ("--num-iterations", self.num_iterations.into()),
            ("--temperature", s.temperature.into()),
            ("--top-p", s.top_p.into()),
            ("--max-new-tokens", s.max_new_tokens.into()),
            ("--loss-type", format!("{:?}", self.loss_type).into()),
            ("--epsilon", self.epsilon.into()),
            ("--reward", rewards.into()),
        ] {
            run.insert(flag.into(), value);
        }
    }
}
