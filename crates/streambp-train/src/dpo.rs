//! The DPO recipe (TRL's sigmoid loss): pairs of completions of one prompt, a frozen reference model
//! (default: a copy of the initial policy, as in TRL), one readable loop over `recipe.rs`.

use std::path::Path;

use streambp_models::Model;
use streambp_objectives::{Dpo, TokenTargets};

use crate::batch::{collate, Collated};
use crate::checkpoint::{Digest, Fingerprint, RunRecord};
use crate::config::{Recipe, TrainConfig};
use crate::data::{encode_pair, read_jsonl, text_field, Example, LoadReport, Overflow, Text};
use crate::eval::{eval_accuracy, eval_rows};
use crate::logprobs::sequence_logps;
use crate::recipe::Setup;
use crate::tokenizer::TextTokenizer;
use crate::trainer::{Summary, Trainer, TrainingData};
use crate::{Result, TrainError};

/// A tokenized preference pair.
pub struct Pair {
    /// Prompt + preferred completion, the loss on the completion.
    pub chosen: Example,
    /// Prompt + dispreferred completion, the loss on the completion.
    pub rejected: Example,
}

impl Digest for Pair {
    fn digest(&self, into: &mut Fingerprint) {
        self.chosen.digest(into);
        self.rejected.digest(into);
    }
}

/// Pairs from TRL's `prompt` + `chosen` + `rejected` JSONL: strings (EOS ends each completion) or
/// conversations rendered with the chat template. A pair longer than `max_length` is skipped or, as
/// TRL's default `keep_start` truncation does, cut to its first `max_length` tokens per side (and
/// skipped when a side has no completion token left).
pub fn load_pairs(
    path: &Path,
    tok: &TextTokenizer,
    max_length: usize,
    overflow: Overflow,
) -> Result<Vec<Pair>> {
    let rows = read_jsonl(path)?;
    let mut pairs = Vec::with_capacity(rows.len());
    let mut report = LoadReport::default();
    for (line, row) in &rows {
        let where_ = format!("{} line {line}", path.display());
        let field = |k: &str| -> Result<Text> {
            text_field(row, k, &where_)?.ok_or_else(|| {
                TrainError::data(
                    &where_,
                    format!("expected fields \"prompt\", \"chosen\" and \"rejected\" (no {k:?})"),
                )
            })
        };
        let side = |reply: &str| -> Result<Example> {
            let (prompt, completion) = encode_pair(tok, field("prompt")?, field(reply)?, &where_)?;
            Ok(Example::from_pair(prompt, completion))
        };
        let (mut chosen, mut rejected) = (side("chosen")?, side("rejected")?);
        report.note_unknown(tok, &chosen.input_ids, &where_);
        report.note_unknown(tok, &rejected.input_ids, &where_);
        if chosen.input_ids.len() > max_length || rejected.input_ids.len() > max_length {
            if overflow == Overflow::Skip {
                report.skipped += 1;
                continue;
            }
            chosen.truncate(max_length);
            rejected.truncate(max_length);
            report.truncated += 1;
        }
        // A side with no completion token left (empty, or cut away) has nothing to compare.
        if chosen.targets() == 0 || rejected.targets() == 0 {
            report.skipped += 1;
            continue;
        }
        pairs.push(Pair { chosen, rejected });
    }
    report.finish(
        path,
        "pairs",
        pairs.len(),
        &format!("--max-length {max_length}"),
    )?;
    Ok(pairs)
}

/// Stacks `pairs` as `[chosen…, rejected…]` right-padded rows.
fn stack(pairs: &[&Pair], pad: u32) -> Collated {
    let rows: Vec<&Example> = pairs
        .iter()
        .map(|p| &p.chosen)
        .chain(pairs.iter().map(|p| &p.rejected))
        .collect();
    collate(&rows, pad)
}

/// Fraction of pairs whose implicit reward margin `(π_c − ρ_c) − (π_r − ρ_r)` is positive.
fn preference_accuracy(
    setup: &Setup,
    reference: &Model,
    pairs: &[Pair],
    cfg: &TrainConfig,
) -> Result<f64> {
    let mut policy_scores = cfg.scorer(&setup.model);
    let mut reference_scores = cfg.scorer(reference);
    let mut wins = 0;
    for group in pairs.chunks(32) {
        let refs: Vec<&Pair> = group.iter().collect();
        let c = stack(&refs, setup.tokenizer.pad_id);
        let t = c.tensors(&setup.device)?;
        let targets =
            TokenTargets::from_labels(&c.labels, setup.model.config.vocab_size, &setup.device)?;
        let mask = Some(&t.attention_mask);
        let policy = sequence_logps(&mut policy_scores, &t.input_ids, mask, &targets)?;
        let reference = sequence_logps(&mut reference_scores, &t.input_ids, mask, &targets)?;
        let n = group.len();
        wins += (0..n)
            .filter(|&i| (policy[i] - reference[i]) - (policy[n + i] - reference[n + i]) > 0.0)
            .count();
    }
    Ok(wins as f64 / pairs.len() as f64)
}

/// Trains `cfg`'s model on preference pairs against a frozen reference (the built-in pairs by
/// default, from the shipped SFT checkpoint).
pub fn run_dpo(cfg: &TrainConfig) -> Result<Summary> {
    let setup = Setup::new(cfg, Recipe::Dpo)?;
    let reference = match &cfg.ref_model {
        Some(spec) => setup.load_reference(spec)?,
        None => setup.initial_reference(cfg)?,
    };
    let data = setup.data_path(&cfg.data, "dpo.jsonl")?;
    let pairs = load_pairs(&data, &setup.tokenizer, cfg.max_length, cfg.overflow)?;
    let eval_pairs = match cfg.data {
        None => Some(load_pairs(
            &setup.data_path(&None, "dpo_test.jsonl")?,
            &setup.tokenizer,
            cfg.max_length,
            cfg.overflow,
        )?),
        Some(_) => None,
    };
    let eval = setup.eval_path(cfg).as_deref().map(eval_rows).transpose()?;
    let held_out = |setup: &Setup| -> Result<Vec<(String, f64)>> {
        let mut m = eval_accuracy(setup, &eval)?;
        if let Some(p) = &eval_pairs {
            m.push((
                "preference_accuracy".into(),
                preference_accuracy(setup, &reference, p, cfg)?,
            ));
        }
        Ok(m)
    };
    tracing::info!(pairs = pairs.len(), data = %data.display(), beta = cfg.beta, "dpo");
    let training = TrainingData {
        items: &pairs,
        what: "pairs",
        path: &data,
    };
    let mut trainer = Trainer::new(cfg, &setup, Recipe::Dpo, &training, RunRecord::new())?;
    let before = trainer.held_out_before(|| held_out(&setup))?;
    let model = &setup.model;
    let mut reference_scores = cfg.scorer(&reference);
    let world = setup.comm.world_size();
    for step in trainer.start_step..trainer.max_steps {
        trainer.begin_step(step);
        let picked = trainer.data.take(trainer.global_step_items(cfg)?);
        // Every rank's micro-batch is a mean over its pairs, all of one size: the step's loss is the
        // mean of all of them, over micro-batches and ranks.
        let weight = 1.0 / (picked.len() / cfg.batch_size) as f64;
        for (m, global) in picked.chunks(cfg.batch_size * world).enumerate() {
            let (micro, first) = trainer.local(global);
            let group: Vec<&Pair> = micro.iter().map(|&i| &pairs[i]).collect();
            let c = stack(&group, setup.tokenizer.pad_id);
            let t = c.tensors(&setup.device)?;
            let targets =
                TokenTargets::from_labels(&c.labels, model.config.vocab_size, &setup.device)?;
            let ref_logps = sequence_logps(
                &mut reference_scores,
                &t.input_ids,
                Some(&t.attention_mask),
                &targets,
            )?;
            let n = group.len();
            let dpo = Dpo::new(
                &c.labels,
                &ref_logps[..n],
                &ref_logps[n..],
                cfg.beta,
                model.config.vocab_size,
                &setup.device,
            )?
            .with_sft_weight(cfg.sft_weight)?;
            // The NLL is a mean over the whole micro-batch's chosen tokens, whichever rank holds them.
            let dpo = match (cfg.sft_weight > 0.0, world) {
                (true, 2..) => {
                    let tokens = setup.comm.sum(dpo.chosen_tokens()?)?;
                    dpo.with_nll_tokens(tokens / world as f64)?
                }
                _ => dpo,
            };
            // Chosen and rejected rows of the pairs from `first` on (dropout masks by row).
            let rows = (m, 2 * first);
            trainer.backward(cfg, model, t.batch(), &dpo, rows, c.tokens(), weight)?;
        }
        trainer.finish_step(cfg, &setup)?;
    }
    trainer.finish(cfg, &setup, before, || held_out(&setup))
}
