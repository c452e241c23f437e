//! The on-policy recipe of GRPO, RLOO and distillation (TRL's losses): per prompt, sample a group
//! of completions with the KV-cache sampler, score them with the reward functions, turn the rewards
//! into advantages, and take `num_iterations` optimizer steps on those rollouts (old log-probs fixed
//! before the first one). GRPO normalises rewards within the group and adds its KL to the loss;
//! RLOO takes the KL from the reward (scored when the rollouts are drawn), uses each completion's
//! leave-one-out baseline, and clips one ratio per completion. Distillation samples one completion
//! per prompt, scores nothing, and learns the teacher's next-token distributions on it.

use std::time::Instant;

use candle_core::Tensor;
use serde_json::Value;
use streambp_models::init::NormalRng;
use streambp_models::Model;
use streambp_objectives::rloo::{leave_one_out, less_kl, normalize_advantages};
use streambp_objectives::{
    rollouts, Distill, DistillBatch, EntropyPool, Grpo, GrpoBatch, Objective, Rloo, TeacherLogits,
};

use crate::batch::{collate, padded, Collated};
use crate::checkpoint::{Digest, Fingerprint, RunRecord};
use crate::config::{Algorithm, GrpoConfig, TrainConfig};
use crate::data::{text_field, Example, LoadReport, Overflow, Row, Text};
use crate::dataset::DataSource;
use crate::entropy_control::EntropyControl;
use crate::eval::{eval_accuracy, eval_rows};
use crate::logprobs::{token_logps, Scorer};
use crate::output::temporary;
use crate::rewards::{
    group_advantages, group_without_signal, parse_reward, scaled_advantages, std_from_sums, Reward,
    ScaleRewards,
};
use crate::sampling::sample_groups;
use crate::setup::Setup;
use crate::teacher::{frozen_memory, load_teacher, teacher_logits};
use crate::token_store::{RecordStore, RecordWriter};
use crate::tokenizer::Keep;
use crate::trainer::{Summary, Trainer, TrainingData};
use crate::{Result, TrainError};

/// The standard deviation of every reward of the step's batch, all ranks' groups together (TRL's
/// `scale_rewards="batch"`).
fn batch_reward_std(setup: &Setup, batch: &[Group]) -> Result<f64> {
    let rewards = batch.iter().flat_map(|r| r.rewards.iter());
    let (sum, squares, n) =
        rewards.fold((0.0, 0.0, 0.0), |(s, q, n), &r| (s + r, q + r * r, n + 1.0));
    let total = |x: f64| setup.data.sum(x).map_err(TrainError::from);
    Ok(std_from_sums(total(sum)?, total(squares)?, total(n)?))
}

/// One micro-batch's groups as one batch of rows (`--batch-size` prompts' groups: one backward, as
/// TRL's micro-batch), right-padded to the longest row; masks and log-probs padded with 0.
struct MicroBatch {
    rows: Collated,
    completion_mask: Vec<Vec<i64>>,
    advantages: Vec<f64>,
    old_logps: Option<Vec<Vec<f64>>>,
}

impl MicroBatch {
    fn of(groups: &[Group], pad_id: u32) -> Self {
        let examples: Vec<&Example> = groups.iter().flat_map(|g| &g.examples).collect();
        let rows = collate(&examples, pad_id);
        let t = rows.input_ids.first().map_or(0, Vec::len);
        let completion_mask = groups
            .iter()
            .flat_map(|g| &g.completion_mask)
            .map(|r| padded(r, t, 0))
            .collect();
        // Old log-probs are kept for every group of a step or for none.
        let old_logps = groups
            .iter()
            .map(|g| g.old_logps.as_ref())
            .collect::<Option<Vec<_>>>()
            .map(|olds| {
                olds.into_iter()
                    .flatten()
                    .map(|r| padded(r, t, 0.0))
                    .collect()
            });
        Self {
            completion_mask,
            advantages: groups.iter().flat_map(|g| g.advantages.clone()).collect(),
            old_logps,
            rows,
        }
    }

    /// The micro-batch's objective (GRPO's with the reference's log-probs `ref_logps` where
    /// `--beta` is not 0; RLOO's took its KL into the advantages; distillation's against the
    /// `teacher`'s logits) and the weight of its loss, from the step's weight and
    /// `num_items_in_batch`.
    fn objective(
        &self,
        setup: &Setup,
        (cfg, g): (&TrainConfig, &GrpoConfig),
        (ref_logps, teacher): (Option<&[Vec<f64>]>, Option<TeacherLogits>),
        (weight, num_items, entropy_coef): LossScale,
    ) -> Result<(Box<dyn Objective>, f64)> {
        // A micro-batch whose every completion was masked out (truncated) adds nothing; it
        // still runs, its completions unmasked at weight 0, so that every rank makes the same
        // calls.
        let unmasked;
        let has_completions = self.completion_mask.iter().flatten().any(|&v| v == 1);
        let (completion_mask, weight, num_items) = match has_completions {
            true => (&self.completion_mask, weight, num_items),
            false => {
                unmasked = self.rows.target_mask();
                (&unmasked, 0.0, None)
            }
        };
        let rollouts = rollouts::Rollouts {
            input_ids: &self.rows.input_ids,
            completion_mask,
            old_logps: self.old_logps.as_deref(),
            ref_logps,
        };
        let (vocab_size, device) = (setup.model.config.vocab_size, &setup.device);
        if let Some(teacher) = teacher {
            let batch = DistillBatch {
                input_ids: &self.rows.input_ids,
                completion_mask,
                beta: cfg.beta,
                temperature: g.sampling.temperature,
            };
            let distill = Distill::new(&batch, teacher, vocab_size, device)?;
            // TRL's loss: the divergences summed over the step's completion tokens (every
            // micro-batch, every rank) over their number; the objective gives this micro-batch's
            // mean.
            let tokens = completion_mask.iter().flatten().sum::<i64>() as f64;
            let weight = match num_items {
                Some(n) => weight * tokens / n.max(1.0),
                None => weight,
            };
            return Ok((Box::new(distill), weight));
        }
        let epsilons = (g.epsilon, g.epsilon_high.unwrap_or(g.epsilon));
        if let Algorithm::Rloo { .. } = g.algorithm {
            let temperature = g.sampling.temperature;
            let rloo = Rloo::with_advantages(
                &rollouts,
                &self.advantages,
                epsilons,
                temperature,
                (vocab_size, device),
            )?;
            return Ok((Box::new(rloo), weight));
        }
        let objective = Grpo::new(
            &GrpoBatch {
                rollouts,
                advantages: &self.advantages,
                beta: cfg.beta,
                epsilon_low: epsilons.0,
                epsilon_high: epsilons.1,
                loss_type: g.loss_type,
                // TRL's `max_completion_length`: a completion, its EOS included, never has
                // more than `--max-new-tokens` tokens (EOS is not added to a truncated one).
                max_completion_length: Some(g.sampling.max_new_tokens),
                // The policy's log-probs at the temperature it sampled with, as TRL's.
                temperature: g.sampling.temperature,
                num_items_in_batch: num_items,
                use_bias_correction_kl: true,
                sapo_temperatures: g.sapo_temperatures,
                importance_sampling: g.importance_sampling,
                vespo_gamma: g.vespo_gamma,
                off_policy_mask_threshold: g.off_policy_mask_threshold,
                entropy_coef,
                top_entropy_quantile: g.top_entropy_quantile,
                entropy_pool: entropy_pool(setup, has_completions),
                entropy_stats: g.adaptive_entropy.is_some(),
            },
            vocab_size,
            device,
        )?;
        Ok((Box::new(objective), weight))
    }
}

/// The high-entropy mask's quantile over every data-parallel rank's micro-batch, as TRL's over
/// every process's (none with one rank). A micro-batch whose completions were all masked out joins
/// the gather with no tokens.
fn entropy_pool(setup: &Setup, has_completions: bool) -> Option<EntropyPool> {
    if setup.data.world_size() == 1 {
        return None;
    }
    let (data, device) = (setup.data.clone(), setup.device.clone());
    Some(EntropyPool::new(move |local| {
        let local = if has_completions { local } else { &[] };
        streambp_dist::gather_numbers(data.as_ref(), local, &device).map_err(|e| e.to_string())
    }))
}

/// The completion tokens of every rank's `pending` rollouts: GRPO's dapo's, cispo's and vespo's
/// normaliser.
fn global_tokens(setup: &Setup, pending: &[Group]) -> Result<f64> {
    let local: i64 = pending
        .iter()
        .flat_map(|r| r.completion_mask.iter().flatten())
        .sum();
    Ok(setup.data.sum(local as f64)?)
}

/// One group of rollouts: the completions of one prompt, collated into right-padded rows (the loss on
/// the completions), with their rewards and group-relative advantages.
struct Group {
    /// The prompt and completion of each row (collated again with the other groups of its
    /// micro-batch).
    examples: Vec<Example>,
    /// 1 on completion tokens (the labels that are targets).
    completion_mask: Vec<Vec<i64>>,
    advantages: Vec<f64>,
    rewards: Vec<f64>,
    lengths: Vec<usize>,
    /// Per-token log-probs of the policy that sampled them, kept for the later iterations on these
    /// rollouts (`--num-iterations` > 1) and RLOO's KL.
    old_logps: Option<Vec<Vec<f64>>>,
    /// RLOO: each completion's first-order KL to the reference, `Σ m (π_old − ρ)` (with `--beta`).
    kls: Option<Vec<f64>>,
}

impl Group {
    /// The group's rows alone, right-padded (as they were scored and masked when sampled).
    fn collated(&self, pad_id: u32) -> Collated {
        collate(&self.examples.iter().collect::<Vec<_>>(), pad_id)
    }
}

/// A prompt to sample from: its tokens (cut to fit `--max-length` with the completion) and its data row,
/// which the rewards read.
#[derive(serde::Serialize, serde::Deserialize)]
struct Prompt {
    ids: Vec<u32>,
    row: Row,
}

impl Digest for Prompt {
    fn digest(&self, into: &mut Fingerprint) {
        into.numbers(self.ids.iter().map(|&t| i64::from(t)));
        // serde_json keeps a row's keys sorted: the same row gives the same text.
        into.bytes(
            serde_json::Value::Object(self.row.clone())
                .to_string()
                .as_bytes(),
        );
    }
}

/// The prompts of a GRPO or RLOO data file: rows with a `prompt` string and every column a reward reads. A
/// prompt that leaves no room for `max_new_tokens` within `max_length` is skipped or cut from the left
/// (TRL keeps a prompt's end). They go onto disk one at a time (a store in the output directory), so
/// a prompt set of any size loads in bounded memory.
fn load_prompts(
    source: &DataSource,
    setup: &Setup,
    cfg: &TrainConfig,
    g: &GrpoConfig,
    rewards: &[Box<dyn Reward>],
) -> Result<RecordStore> {
    let room = cfg.max_length - g.sampling.max_new_tokens;
    let mut report = LoadReport::default();
    let mut prompts = RecordWriter::create(&temporary(&cfg.output_dir, "tokenized"))?;
    for row in source.rows() {
        let (at, row) = row?;
        let where_ = at.to_string();
        let text = match text_field(&row, "prompt", &where_)? {
            Some(Text::Plain(text)) => text,
            Some(Text::Messages(messages)) => render_prompt(&setup.tokenizer, messages, &where_)?,
            None => {
                let job = g.algorithm.recipe().name().to_uppercase();
                return Err(TrainError::data(
                    where_,
                    format!("{job} data needs a \"prompt\" (a string or a list of messages)"),
                ));
            }
        };
        for reward in rewards {
            reward
                .check_row(&row)
                .map_err(|why| TrainError::data(&where_, why))?;
        }
        // The prompt's end is what is kept (below): its last `room` tokens at most.
        let mut ids = setup.tokenizer.encode_at_most(&text, room, Keep::End)?;
        if ids.is_empty() {
            return Err(TrainError::data(
                where_,
                "the prompt is empty (no token to sample after)",
            ));
        }
        report.note_unknown(&setup.tokenizer, &ids, &where_);
        if ids.len() > room {
            if cfg.overflow == Overflow::Skip {
                report.skipped += 1;
                continue;
            }
            ids.drain(..ids.len() - room);
            report.truncated += 1;
        }
        prompts.push(&Prompt { ids, row })?;
    }
    let limit = format!(
        "--max-length {} minus --max-new-tokens {}, keeping a prompt's end",
        cfg.max_length, g.sampling.max_new_tokens
    );
    report.finish(source, "prompts", prompts.count(), &limit)?;
    prompts.finish()
}

/// A conversational prompt as text, as TRL renders it: with the generation prompt after a user turn,
/// continuing the final message after an assistant turn (the template's rendering of the whole
/// conversation, cut before its end-of-turn).
fn render_prompt(
    tok: &crate::tokenizer::TextTokenizer,
    messages: Vec<Value>,
    where_: &str,
) -> Result<String> {
    let in_context = |e: TrainError| TrainError::data(where_, e.to_string());
    let chat = tok.chat_template().map_err(in_context)?;
    // A field of the final message ("" where absent).
    let last = |key: &str| {
        messages
            .last()
            .and_then(|m| m.get(key))
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string()
    };
    match last("role").as_str() {
        "assistant" => {
            let content = last("content");
            let whole = chat
                .render(&Value::from(messages), false)
                .map_err(in_context)?;
            // Continue the final message: keep the rendering up to the end of its content.
            match whole.rfind(&content) {
                Some(at) if !content.is_empty() => Ok(whole[..at + content.len()].to_string()),
                _ => Err(TrainError::data(
                    where_,
                    "the prompt ends with an assistant message the chat template does not render \
                     as it is written: cannot continue it",
                )),
            }
        }
        "user" | "system" | "tool" => chat
            .render(&Value::from(messages), true)
            .map_err(in_context),
        other => Err(TrainError::data(
            where_,
            format!("the prompt's last message has role {other:?}; expected user or assistant"),
        )),
    }
}

/// Scores a group of sampled `completions` of `prompt` (adding each reward's scores to
/// `reward_totals`) and collates them.
fn rollout(
    setup: &Setup,
    prompt: &Prompt,
    completions: Vec<Vec<u32>>,
    rewards: &[Box<dyn Reward>],
    g: &GrpoConfig,
    reward_totals: &mut [f64],
) -> Result<Group> {
    let tok = &setup.tokenizer;
    let mut scores = Vec::with_capacity(completions.len());
    let mut examples = Vec::with_capacity(completions.len());
    // Cut at --max-new-tokens: no EOS (one that stopped on EOS is shorter before it is added).
    let truncated: Vec<bool> = completions
        .iter()
        .map(|c| c.len() >= g.sampling.max_new_tokens)
        .collect();
    for c in completions {
        let text = tok.decode(&c)?;
        let mut total = 0.0;
        for (k, r) in rewards.iter().enumerate() {
            let s = r.score(&text, &prompt.row);
            reward_totals[k] += s;
            total += s;
        }
        scores.push(total);
        let mut completion = c;
        if completion.len() < g.sampling.max_new_tokens {
            completion.push(tok.eos_id); // it stopped on EOS, which is part of what it chose
        }
        examples.push(Example::from_pair(prompt.ids.clone(), completion));
    }
    let rows = collate(&examples.iter().collect::<Vec<_>>(), tok.pad_id);
    let mut completion_mask = rows.target_mask();
    if g.mask_truncated_completions {
        for (row, _) in completion_mask
            .iter_mut()
            .zip(&truncated)
            .filter(|(_, &t)| t)
        {
            row.iter_mut().for_each(|m| *m = 0);
        }
    }
    Ok(Group {
        completion_mask,
        lengths: examples
            .iter()
            .map(|e| e.input_ids.len() - prompt.ids.len())
            .collect(),
        examples,
        advantages: group_advantages(&scores),
        rewards: scores,
        old_logps: None,
        kls: None,
    })
}

/// Each prompt's `--group-size` completions (`rngs[k]` prompt `k`'s generator). Where sequences are
/// split (`--sp`), the ranks of the sequence group share the work: rank `r` samples prompts `r`,
/// `r + S`, … and the group all-gathers the completions, so each prompt is sampled once per group and
/// every rank trains on the same rollouts.
fn sample_in_group(
    setup: &Setup,
    g: &GrpoConfig,
    prompts: &[&[u32]],
    rngs: &[NormalRng],
) -> Result<Vec<Vec<Vec<u32>>>> {
    let (group, rank, ranks) = match &setup.sequence {
        Some(group) => (Some(group.as_ref()), group.rank(), group.world_size()),
        None => (None, 0, 1),
    };
    let mine: Vec<usize> = (rank..prompts.len()).step_by(ranks).collect();
    let my_prompts: Vec<&[u32]> = mine.iter().map(|&k| prompts[k]).collect();
    let mut my_rngs: Vec<NormalRng> = mine.iter().map(|&k| rngs[k].clone()).collect();
    let eos = setup.tokenizer.eos_id;
    // On rayon's workers, as the engine's phases: the decoding loop's products then need no
    // cross-thread hand-off each.
    // (A rank with no prompt of its own gets none back.)
    let sampled = streambp_core::on_workers(setup.model.device(), || {
        sample_groups(
            &setup.model,
            &my_prompts,
            g.group_size,
            eos,
            &g.sampling,
            &mut my_rngs,
        )
    })?;
    let Some(group) = group else {
        return Ok(sampled);
    };
    // Every rank's completions as `[length, tokens…]` per row, padded to the longest share.
    let flat: Vec<f64> = sampled
        .iter()
        .flatten()
        .flat_map(|row| std::iter::once(row.len() as f64).chain(row.iter().map(|&t| f64::from(t))))
        .collect();
    // On the model's device: NCCL carries device tensors only.
    let device = &setup.device;
    let longest = group.all_gather(&Tensor::new(&[flat.len() as f64], device)?)?;
    let longest = longest.to_vec1::<f64>()?.into_iter().fold(0.0, f64::max) as usize;
    let mut padded = flat;
    padded.resize(longest, 0.0);
    let all = group.all_gather(&Tensor::new(padded.as_slice(), device)?)?;
    let all = all.to_vec1::<f64>()?;
    let mut out = vec![Vec::new(); prompts.len()];
    for (r, share) in all.chunks(longest.max(1)).enumerate().take(ranks) {
        let mut words = share.iter().map(|&w| w as u32);
        for k in (r..prompts.len()).step_by(ranks) {
            out[k] = (0..g.group_size)
                .map(|_| {
                    let len = words.next().unwrap_or(0) as usize;
                    words.by_ref().take(len).collect()
                })
                .collect();
        }
    }
    Ok(out)
}

/// New rollouts for a step: `batch_size × grad_accum` prompts, a group each, sampled from a generator
/// seeded by the step and the prompt's place in the step (so a resumed run, or one on another number
/// of ranks, draws what the uninterrupted one on one process drew): this rank's prompts `picked`, the
/// first at place `first`. Their reward metrics go to the trainer; with several iterations per batch,
/// the sampling policy's log-probs are kept; for RLOO with `--beta`, the KL to the reference
/// (`reference_scores`) is scored into the advantages.
fn draw_rollouts(
    trainer: &mut Trainer,
    (g, prompts, rewards): (&GrpoConfig, &RecordStore, &[Box<dyn Reward>]),
    (picked, first): (&[usize], usize),
    step: usize,
    mut reference_scores: Option<&mut Scorer>,
) -> Result<Vec<Group>> {
    let (setup, cfg) = (trainer.setup(), trainer.config());
    let step_seed = cfg.seed ^ 0x5eed ^ (step as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut totals = vec![0.0; rewards.len()];
    let mut policy_scores = setup.scorer(cfg, &setup.model);
    let mut batch = Vec::with_capacity(picked.len());
    // One micro-batch's prompts are sampled together (one forward per new token for all their rows),
    // each from its own generator: what a prompt draws does not depend on the prompts beside it.
    let mut sampled = Vec::with_capacity(picked.len());
    for (c, chunk) in picked.chunks(cfg.batch_size.max(1)).enumerate() {
        let at = first + c * cfg.batch_size.max(1);
        let group: Vec<Prompt> = chunk
            .iter()
            .map(|&i| prompts.get(i))
            .collect::<Result<_>>()?;
        let rngs: Vec<NormalRng> = (at..at + chunk.len())
            .map(|place| {
                NormalRng::new(step_seed ^ (place as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9))
            })
            .collect();
        let ids: Vec<&[u32]> = group.iter().map(|p| p.ids.as_slice()).collect();
        let completions = sample_in_group(setup, g, &ids, &rngs)?;
        sampled.extend(group.into_iter().zip(completions));
    }
    // RLOO's KL enters the reward: the sampling policy's and the reference's log-probs now.
    let rloo_kl = matches!(g.algorithm, Algorithm::Rloo { .. }) && cfg.beta != 0.0;
    for (prompt, completions) in sampled {
        let mut r = rollout(setup, &prompt, completions, rewards, g, &mut totals)?;
        if g.num_iterations > 1 || rloo_kl {
            let rows = r.collated(setup.tokenizer.pad_id);
            let t = rows.tensors(&setup.device)?;
            let score = |scorer: &mut Scorer| {
                let ids = (&t.input_ids, Some(&t.attention_mask));
                token_logps(scorer, ids, &rows.input_ids, g.sampling.temperature)
            };
            let old = score(&mut policy_scores)?;
            if let (true, Some(reference)) = (rloo_kl, reference_scores.as_mut()) {
                let reference = score(reference)?;
                r.kls = Some(first_order_kls(&r.completion_mask, &old, &reference));
            }
            // One step per batch: the policy trained is the one that sampled, its ratio exactly 1
            // with the engine's own log-probs (as TRL's GRPO; its RLOO re-scores them).
            r.old_logps = (g.num_iterations > 1).then_some(old);
        }
        batch.push(r);
    }
    match g.algorithm {
        Algorithm::Grpo => grpo_advantages(setup, g, &mut batch)?,
        Algorithm::Rloo {
            normalize_advantages,
        } => rloo_advantages(trainer, cfg.beta, normalize_advantages, &mut batch)?,
        Algorithm::Distill => {}
    }
    if !rewards.is_empty() {
        let completions = (picked.len() * g.group_size) as f64;
        for (r, total) in rewards.iter().zip(&totals) {
            trainer.add_metric(r.name(), total / completions);
        }
        let all: Vec<f64> = batch.iter().flat_map(|r| r.rewards.clone()).collect();
        trainer.add_metric("reward", all.iter().sum::<f64>() / all.len() as f64);
        let flat = batch.iter().filter(|r| group_without_signal(&r.rewards));
        trainer.add_metric(
            "frac_reward_zero_std",
            flat.count() as f64 / batch.len().max(1) as f64,
        );
    }
    let lengths: Vec<usize> = batch.iter().flat_map(|r| r.lengths.clone()).collect();
    trainer.add_metric(
        "completion_length",
        lengths.iter().sum::<usize>() as f64 / lengths.len() as f64,
    );
    Ok(batch)
}

/// GRPO's advantages: each group's were scaled by its own std (TRL's default scale_rewards); the
/// others replace them.
fn grpo_advantages(setup: &Setup, g: &GrpoConfig, batch: &mut [Group]) -> Result<()> {
    let std = match g.scale_rewards {
        ScaleRewards::Group => None,
        ScaleRewards::None => Some(None),
        ScaleRewards::Batch => Some(Some(batch_reward_std(setup, batch)?)),
    };
    if let Some(std) = std {
        for r in batch {
            r.advantages = scaled_advantages(&r.rewards, std);
        }
    }
    Ok(())
}

/// Each completion's first-order KL `Σ_t m_t (old_t − ref_t)` over its completion tokens (RLOO's,
/// TRL's `per_token_kl` summed).
fn first_order_kls(mask: &[Vec<i64>], old: &[Vec<f64>], reference: &[Vec<f64>]) -> Vec<f64> {
    mask.iter()
        .zip(old.iter().zip(reference))
        .map(|(m, (o, r))| {
            m.iter()
                .zip(o.iter().zip(r))
                .filter(|(&m, _)| m == 1)
                .map(|(_, (o, r))| o - r)
                .sum()
        })
        .collect()
}

/// RLOO's advantages (TRL's `_generate_and_score_completions`): the rewards less `beta` times
/// their KL, less the leave-one-out baseline of their group; normalised over the step's whole
/// batch (every rank's) when asked. Logs TRL's `kl`, the KL's mean over every completion token.
fn rloo_advantages(
    trainer: &mut Trainer,
    beta: f64,
    normalize: bool,
    batch: &mut [Group],
) -> Result<()> {
    let setup = trainer.setup();
    let total = |x: f64| setup.data.sum(x).map_err(TrainError::from);
    for r in batch.iter_mut() {
        let rewards = less_kl(&r.rewards, r.kls.as_deref(), beta);
        r.advantages = leave_one_out(&rewards, rewards.len());
    }
    if beta != 0.0 {
        let kl: f64 = batch.iter().flat_map(|r| r.kls.iter().flatten()).sum();
        let tokens: i64 = batch
            .iter()
            .flat_map(|r| r.completion_mask.iter().flatten())
            .sum();
        let (kl, tokens) = (total(kl)?, total(tokens as f64)?);
        trainer.add_metric("kl", kl / tokens.max(1.0));
    }
    if normalize {
        let mut all: Vec<f64> = batch.iter().flat_map(|r| r.advantages.clone()).collect();
        normalize_advantages(&mut all, total)?;
        let places = batch.iter_mut().flat_map(|r| r.advantages.iter_mut());
        places.zip(all).for_each(|(a, normalized)| *a = normalized);
    }
    Ok(())
}

/// The `--reward` specs of the run: its own, or on the built-in task the exact match of its answers;
/// an error when a run on its own data names none.
fn reward_specs(cfg: &TrainConfig, g: &GrpoConfig) -> Result<Vec<String>> {
    if g.algorithm == Algorithm::Distill {
        return Ok(Vec::new());
    }
    let builtin = cfg.data.is_none();
    Ok(match (g.rewards.is_empty(), builtin) {
        (false, _) => g.rewards.clone(),
        // The built-in task's answers: exactly right or not.
        (true, true) => vec!["exact:completion".into()],
        (true, false) => {
            let job = g.algorithm.recipe().name().to_uppercase();
            return Err(TrainError::flag(
                "--reward",
                "(none)",
                format!("{job} needs at least one --reward (exact:COLUMN or format:REGEX)"),
            ));
        }
    })
}

/// Warns when `trainer` resumes inside a batch of rollouts, from where the run differs from an
/// uninterrupted one.
fn warn_if_resumed_inside_batch(trainer: &Trainer, g: &GrpoConfig) {
    if !trainer.start_step.is_multiple_of(g.num_iterations) {
        // Checkpoints are saved between batches of rollouts (--save-every is a multiple of
        // --num-iterations); only an older version's could fall inside one.
        tracing::warn!(
            step = trainer.start_step,
            num_iterations = g.num_iterations,
            "resumed inside a batch of rollouts: they are drawn anew and the data position moves \
             on, so the run differs from an uninterrupted one from here"
        );
    }
}

/// Takes the step's prompts from the data and draws this rank's rollouts of them (timed as
/// `time/rollouts`): the rollouts, and the place of this rank's first group in the step.
fn fresh_rollouts(
    trainer: &mut Trainer,
    job: (&GrpoConfig, &RecordStore, &[Box<dyn Reward>]),
    step: usize,
    reference_scores: Option<&mut Scorer>,
) -> Result<(Vec<Group>, usize)> {
    // Each rank samples its own prompts' groups; a group stays on one rank.
    let picked = trainer.data.take(trainer.global_step_items()?);
    let (mine, first) = trainer.local(&picked);
    let (mine, step_seed) = (mine.to_vec(), step);
    let local = (mine.as_slice(), first);
    let start = Instant::now();
    let pending = draw_rollouts(trainer, job, local, step_seed, reference_scores)?;
    // Sampling, rewards, and (with several iterations, or RLOO's KL) the old policy's and the
    // reference's log-probs.
    trainer.add_metric("time/rollouts", start.elapsed().as_secs_f64());
    Ok((pending, first))
}

/// How a micro-batch's loss enters the step: its weight, GRPO's dapo's, cispo's and vespo's
/// `num_items_in_batch`, and the coefficient of its entropy bonus (a mean per micro-batch, as
/// TRL's, so the step's coefficient times the share of the step that the weight does not already
/// give).
type LossScale = (f64, Option<f64>, f64);

/// The [`LossScale`] of each of the step's `micro_batches` with the step's entropy bonus
/// coefficient `entropy_coef`: weight 1 and `num_items_in_batch` the completion tokens of every
/// rank's `pending` rollouts for GRPO's dapo, cispo and vespo and for distillation; for the other
/// loss types and RLOO, one over every rank's micro-batches and no `num_items_in_batch`.
fn loss_scale(
    setup: &Setup,
    (g, entropy_coef): (&GrpoConfig, f64),
    pending: &[Group],
    micro_batches: usize,
) -> Result<LossScale> {
    // RLOO's loss is a mean over each micro-batch's completions, as GRPO's per-completion types.
    let global = match g.algorithm {
        Algorithm::Grpo => g.loss_type.global_normaliser(),
        Algorithm::Rloo { .. } => false,
        Algorithm::Distill => true,
    };
    let mean = 1.0 / (micro_batches * setup.data.world_size()) as f64;
    Ok(match global {
        true => (
            1.0,
            Some(global_tokens(setup, pending)?),
            entropy_coef * mean,
        ),
        false => (mean, None, entropy_coef),
    })
}

/// Runs the step's backwards on its `pending` rollouts (this rank's first group at place
/// `first_group` of the step) with the entropy bonus's coefficient `entropy_coef`, scoring each
/// micro-batch with the reference, or the teacher, where there is one, and adds the time they and
/// the backwards took to the step's metrics.
fn train_on_rollouts(
    trainer: &mut Trainer,
    (g, entropy_coef): (&GrpoConfig, f64),
    (pending, first_group): (&[Group], usize),
    mut reference_scores: Option<&mut Scorer>,
    teacher: Option<&Model>,
) -> Result<()> {
    let (setup, cfg) = (trainer.setup(), trainer.config());
    let (mut scoring, mut backward) = (0.0, 0.0);
    // One backward per micro-batch of --batch-size prompts' groups. GRPO's dapo, cispo and vespo
    // divide its summed loss by the completion tokens of the step's whole batch (all
    // micro-batches, all ranks: TRL's num_items_in_batch); its other loss types and RLOO give
    // the micro-batch's mean, which the step averages over every rank's micro-batches.
    let micro_batches: Vec<MicroBatch> = pending
        .chunks(cfg.batch_size.max(1))
        .map(|groups| MicroBatch::of(groups, setup.tokenizer.pad_id))
        .collect();
    let scale = loss_scale(setup, (g, entropy_coef), pending, micro_batches.len())?;
    let mut first_row = first_group * g.group_size;
    for m in &micro_batches {
        let t = m.rows.tensors(&setup.device)?;
        let mask = Some(&t.attention_mask);
        let start = Instant::now();
        let ref_logps = match &mut reference_scores {
            Some(score) => Some(token_logps(
                score,
                (&t.input_ids, mask),
                &m.rows.input_ids,
                g.sampling.temperature,
            )?),
            None => None,
        };
        let teacher = match teacher {
            Some(model) => {
                let chunks = cfg.chunks_for(model, &t.input_ids)?;
                let group = setup.sequence.clone();
                Some(teacher_logits(model, t.batch(), chunks, group)?)
            }
            None => None,
        };
        scoring += start.elapsed().as_secs_f64();
        let start = Instant::now();
        let scores = (ref_logps.as_deref(), teacher);
        let (objective, weight) = m.objective(setup, (cfg, g), scores, scale)?;
        // Dropout masks by each row's place in the step, whatever the ranks and micro-batches.
        let place = (0, first_row);
        first_row += m.advantages.len();
        trainer.backward(
            t.batch(),
            objective.as_ref(),
            place,
            m.rows.tokens(),
            weight,
        )?;
        backward += start.elapsed().as_secs_f64();
    }
    trainer.add_metric("time/reference", scoring);
    trainer.add_metric("time/backward", backward);
    Ok(())
}

/// The training reward of each batch of rollouts, for the summary and the closing check that the
/// rewards told completions apart.
#[derive(Default)]
struct RewardHistory {
    /// Mean reward of each batch of rollouts, for the summary.
    means: Vec<f64>,
    /// Whether any group's rewards differed: without that, every advantage was 0.
    signal_seen: bool,
}

impl RewardHistory {
    /// Notes the reward metrics of a step that drew fresh rollouts, from its logged `metrics`.
    fn note(&mut self, metrics: &[(String, f64)]) {
        let metric = |name: &str| metrics.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
        self.means.extend(metric("reward"));
        self.signal_seen |= metric("frac_reward_zero_std").is_some_and(|f| f < 1.0);
    }

    /// Warns when batches of rollouts were drawn and none had a group whose rewards differed.
    fn warn_if_no_signal(&self, reward_specs: &[String]) {
        if !self.signal_seen && !self.means.is_empty() {
            tracing::warn!(
                rewards = ?reward_specs,
                "every group's completions got the same reward in every batch of rollouts: each \
                 advantage was 0, so only the KL term (--beta) moved the policy. Check that the \
                 rewards can tell the completions apart on this data, or start from a model that \
                 sometimes succeeds (--model)"
            );
        }
    }

    /// The training reward at the start and at the end of the run: its mean over the first and
    /// over the last (up to) five batches of rollouts.
    fn first_and_last(&self) -> (f64, f64) {
        let history = &self.means;
        // Training reward: mean over the first and the last (up to) five batches of rollouts.
        let window = history.len().clamp(1, 5);
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        (
            mean(&history[..window.min(history.len())]),
            mean(&history[history.len().saturating_sub(window)..]),
        )
    }
}

/// Trains `cfg`'s model with GRPO or RLOO (`g.algorithm`) on its prompts (the built-in arithmetic
/// prompts by default).
pub fn run_grpo(cfg: &TrainConfig, g: &GrpoConfig) -> Result<Summary> {
    let recipe = g.algorithm.recipe();
    cfg.validate(recipe)?;
    g.validate(cfg)?;
    let reward_specs = reward_specs(cfg, g)?;
    let rewards = reward_specs
        .iter()
        .map(|s| parse_reward(s))
        .collect::<Result<Vec<_>>>()?;
    let setup = Setup::new(cfg, recipe)?;
    let data = setup.data_source(cfg, "train.jsonl")?;
    let prompts = load_prompts(&data, &setup, cfg, g, &rewards)?;
    // Distillation's β selects its divergence; the others' weighs a KL to the reference.
    let reference = (cfg.beta != 0.0 && g.algorithm != Algorithm::Distill)
        .then(|| setup.reference(cfg))
        .transpose()?;
    let teacher = match g.algorithm {
        Algorithm::Distill => Some(distillation_teacher(&setup, g)?),
        Algorithm::Grpo | Algorithm::Rloo { .. } => None,
    };
    // The teacher's weights, hidden states and logits, or the reference's weights, count
    // against --memory-budget.
    let frozen = match (&teacher, &reference) {
        (Some(t), _) => frozen_memory(t, &setup.model),
        (None, Some((_, frozen))) => *frozen,
        (None, None) => cfg.frozen,
    };
    let reference = reference.map(|(model, _)| model);
    let cfg = &TrainConfig {
        frozen,
        ..cfg.clone()
    };
    let job = recipe.name();
    tracing::info!(prompts = prompts.len(), group = g.group_size, rewards = ?reward_specs, "{job}");
    let training = TrainingData {
        count: prompts.len(),
        identity: prompts.identity().clone(),
        what: "prompts",
        source: data.name(),
    };
    let extra = g.record(&reward_specs);
    let mut trainer = Trainer::new(cfg, &setup, recipe, &training, extra)?;
    warn_if_resumed_inside_batch(&trainer, g);
    let eval = setup
        .eval_source(cfg)?
        .as_ref()
        .map(|s| eval_rows(s, &setup.tokenizer, cfg.max_length))
        .transpose()?
        .flatten();
    let before = trainer.held_out_before(|| eval_accuracy(&setup, &eval))?;
    let mut reference_scores = reference.as_ref().map(|m| setup.scorer(cfg, m));
    let mut pending: Vec<Group> = Vec::new();
    let mut history = RewardHistory::default();
    let mut first_group = 0;
    let mut control = g
        .adaptive_entropy
        .map(|a| {
            let c = EntropyControl::resumed(trainer.recipe_state.as_ref(), g.entropy_coef)?;
            Ok::<_, TrainError>((c, a))
        })
        .transpose()?;
    for step in trainer.start_step..trainer.max_steps {
        trainer.begin_step(step);
        let fresh = step.is_multiple_of(g.num_iterations) || pending.is_empty();
        // GRPO scores the reference with each micro-batch; RLOO when it draws the rollouts.
        let reference = reference_scores.as_mut().map(|s| s as &mut Scorer);
        let (at_draw, in_loss) = match g.algorithm {
            Algorithm::Grpo | Algorithm::Distill => (None, reference),
            Algorithm::Rloo { .. } => (reference, None),
        };
        if fresh {
            let job = (g, &prompts, rewards.as_slice());
            (pending, first_group) = fresh_rollouts(&mut trainer, job, step, at_draw)?;
        }
        let rollouts = (pending.as_slice(), first_group);
        let entropy_coef = match &control {
            Some((c, a)) => c.applied(a),
            None => g.entropy_coef,
        };
        let job = (g, entropy_coef);
        train_on_rollouts(&mut trainer, job, rollouts, in_loss, teacher.as_ref())?;
        if let Some((c, a)) = &mut control {
            // TRL's controller: the step's entropy over the tokens the bonus acted on moves the
            // coefficient of the next step.
            let sum = trainer.step_metric("entropy_bonus/sum")?;
            let tokens = trainer.step_metric("entropy_bonus/tokens")?;
            c.update(a, sum.unwrap_or(0.0), tokens.unwrap_or(0.0));
            trainer.recipe_state = Some(c.to_state());
        } else {
            // A run resumed without adaptive control carries no stale controller forward.
            trainer.recipe_state = None;
        }
        let coef = control
            .as_ref()
            .map_or(g.entropy_coef, |(c, _)| c.entropy_coef);
        if coef != 0.0 || control.is_some() {
            trainer.add_metric("entropy_coef", coef);
        }
        let metrics = trainer.finish_step()?;
        if fresh {
            history.note(&metrics);
        }
        trainer.evaluate_if_due(|| eval_accuracy(&setup, &eval))?;
    }
    history.warn_if_no_signal(&reward_specs);
    let (first_reward, last_reward) = history.first_and_last();
    let mut before = before;
    let rewarded = !reward_specs.is_empty();
    if rewarded {
        before.push(("reward".into(), first_reward));
    }
    // The training reward joins the summary, not the held-out metrics logged at the end.
    let mut summary = trainer.finish(before, || eval_accuracy(&setup, &eval))?;
    if trainer.is_main() && rewarded {
        summary.after.push(("reward".into(), last_reward));
    }
    Ok(summary)
}

/// Distillation's teacher: `--teacher`, or on the built-in task the shipped SFT checkpoint.
fn distillation_teacher(setup: &Setup, g: &GrpoConfig) -> Result<Model> {
    let spec = match (&g.teacher, setup.builtin_sft_model()) {
        (Some(spec), _) => spec.clone(),
        (None, Some(dir)) => dir.display().to_string(),
        (None, None) => {
            return Err(TrainError::flag(
                "--teacher",
                "(none)",
                "distill needs a teacher: a causal LM directory or hub id with the model's \
                 vocabulary",
            ))
        }
    };
    load_teacher(&spec, &setup.model)
}

impl GrpoConfig {
    /// GRPO's settings in a checkpoint's run record.
    fn record(&self, rewards: &[String]) -> RunRecord {
        let s = &self.sampling;
        let mut run = RunRecord::new();
        for (flag, value) in [
            ("--group-size", self.group_size.into()),
            ("--num-iterations", self.num_iterations.into()),
            ("--temperature", s.temperature.into()),
            ("--top-p", s.top_p.into()),
            ("--max-new-tokens", s.max_new_tokens.into()),
            ("--loss-type", self.loss_type.name().into()),
            ("--epsilon", self.epsilon.into()),
            ("--epsilon-high", self.epsilon_high.into()),
            ("--scale-rewards", self.scale_rewards.name().into()),
            ("--sapo-temperature-pos", self.sapo_temperatures.0.into()),
            ("--sapo-temperature-neg", self.sapo_temperatures.1.into()),
            (
                "--importance-sampling-level",
                self.importance_sampling.name().into(),
            ),
            ("--vespo-k-pos", self.vespo_gamma.positive.0.into()),
            ("--vespo-lambda-pos", self.vespo_gamma.positive.1.into()),
            ("--vespo-k-neg", self.vespo_gamma.negative.0.into()),
            ("--vespo-lambda-neg", self.vespo_gamma.negative.1.into()),
            (
                "--off-policy-mask-threshold",
                self.off_policy_mask_threshold.into(),
            ),
            ("--entropy-coef", self.entropy_coef.into()),
            ("--top-entropy-quantile", self.top_entropy_quantile.into()),
            (
                "--use-adaptive-entropy",
                self.adaptive_entropy.is_some().into(),
            ),
            (
                "--mask-truncated-completions",
                self.mask_truncated_completions.into(),
            ),
            ("--reward", rewards.into()),
            ("--teacher", self.teacher.clone().into()),
        ] {
            run.insert(flag.into(), value);
        }
        if let Algorithm::Rloo {
            normalize_advantages,
        } = self.algorithm
        {
            run.insert("--normalize-advantages".into(), normalize_advantages.into());
        }
        if let Some(a) = self.adaptive_entropy {
            for (flag, value) in [
                ("--entropy-coef-min", a.min),
                ("--entropy-coef-max", a.max),
                ("--entropy-coef-delta", a.delta),
                ("--entropy-target", a.target),
            ] {
                run.insert(flag.into(), value.into());
            }
        }
        run
    }
}
