//! The KTO recipe (TRL's `KTOTrainer`): unpaired completions, each desirable or not, against a frozen
//! reference (a copy of the initial policy, or `--ref-model`). Rows are TRL's `prompt` /
//! `completion` / boolean `label`, or preference pairs unpaired as TRL's `unpair_preference_dataset`
//! does (the chosen completion desirable, the rejected one not). Each micro-batch's KL baseline comes
//! from mismatched rows as TRL's collator builds them: every prompt with the previous row's
//! completion, scored by the policy and the reference without a graph.

use streambp_objectives::{Kto, KtoLoss};

use super::pairs::{load_pairs_into, HeldOut};
use crate::batch::collate;
use crate::checkpoint::{Fingerprint, RunRecord};
use crate::config::{Recipe, TrainConfig};
use crate::data::{encode_pair, row_columns, text_field, Example, LoadReport, Overflow};
use crate::dataset::DataSource;
use crate::logprobs::{collated_logps, Scorer};
use crate::output::temporary;
use crate::setup::Setup;
use crate::token_store::{ExampleSink, StoreWriter};
use crate::tokenizer::TextTokenizer;
use crate::trainer::{Summary, Trainer, TrainingData};
use crate::{Result, TrainError};

/// Loads `source`'s rows into `out` and returns each row's kind (desirable or not): TRL's unpaired
/// `prompt` / `completion` / `label` rows, or, when its first row is a pair, every pair as its chosen
/// (desirable) and its rejected (undesirable) completion. `limits` are `--max-length` and
/// `--overflow`.
pub fn load_unpaired_into(
    source: &DataSource,
    tok: &TextTokenizer,
    limits: (usize, Overflow),
    out: &mut impl ExampleSink,
) -> Result<Vec<bool>> {
    let paired = source
        .rows()
        .next()
        .is_some_and(|row| row.is_ok_and(|(_, r)| r.contains_key("chosen")));
    if paired {
        load_pairs_into(source, tok, limits, out)?;
        return Ok((0..out.count()).map(|i| i % 2 == 0).collect());
    }
    let (max_length, overflow) = limits;
    let mut report = LoadReport::default();
    let mut desirable = Vec::new();
    for row in source.rows() {
        let (at, row) = row?;
        let where_ = at.to_string();
        let missing = |what: &str| {
            TrainError::data(
                &where_,
                format!(
                    "expected \"prompt\", \"completion\" and a boolean \"label\" (or \"chosen\" and \
                     \"rejected\" pairs), {what}; the row has {}",
                    row_columns(&row)
                ),
            )
        };
        let label = match row.get("label") {
            Some(serde_json::Value::Bool(b)) => *b,
            Some(other) => return Err(missing(&format!("\"label\" is {other}"))),
            None => return Err(missing("no \"label\"")),
        };
        let prompt =
            text_field(&row, "prompt", &where_)?.ok_or_else(|| missing("no \"prompt\""))?;
        let completion =
            text_field(&row, "completion", &where_)?.ok_or_else(|| missing("no \"completion\""))?;
        let (p, c) = encode_pair(tok, prompt, completion, max_length, &where_)?;
        let example = Example::from_pair(p, c);
        if let Some(example) = report.fit(tok, example, (max_length, overflow), &where_) {
            out.push(example)?;
            desirable.push(label);
        }
    }
    let limit = format!("--max-length {max_length}");
    report.finish(source, "rows", out.count(), &limit)?;
    Ok(desirable)
}

/// TRL's mismatched rows for the KL baseline: row `i`'s prompt with row `i − 1`'s completion (the
/// last row's for the first), cut to `max_length` tokens.
pub fn mismatched_rows(rows: &[Example], max_length: usize) -> Vec<Example> {
    let split = |e: &Example| {
        let prompt = e.labels.iter().take_while(|&&l| l < 0).count();
        (
            e.input_ids[..prompt].to_vec(),
            e.input_ids[prompt..].to_vec(),
        )
    };
    let parts: Vec<(Vec<u32>, Vec<u32>)> = rows.iter().map(split).collect();
    (0..parts.len())
        .map(|i| {
            let previous = (i + parts.len() - 1) % parts.len();
            let mut row = Example::from_pair(parts[i].0.clone(), parts[previous].1.clone());
            row.truncate(max_length);
            row
        })
        .collect()
}

/// Summed completion log-probs of `rows` under `score` (no graph).
fn completion_logps(
    score: &mut Scorer,
    rows: &[&Example],
    (pad, vocab, device): (u32, usize, &candle_core::Device),
) -> Result<Vec<f64>> {
    let c = collate(rows, pad);
    collated_logps(score, &c, &c.tensors(device)?, vocab)
}

/// Trains `cfg`'s model on unpaired rows with KTO against a frozen reference (the built-in pairs,
/// unpaired, by default, from the shipped SFT checkpoint).
pub fn run_kto(cfg: &TrainConfig) -> Result<Summary> {
    let setup = Setup::new(cfg, Recipe::Kto)?;
    let (reference, frozen) = setup.reference(cfg)?;
    let cfg = &TrainConfig {
        frozen,
        ..cfg.clone()
    };
    let data = setup.data_source(cfg, "dpo.jsonl")?;
    let mut store = StoreWriter::create(&temporary(&cfg.output_dir, "tokenized"))?;
    let desirable = load_unpaired_into(
        &data,
        &setup.tokenizer,
        (cfg.max_length, cfg.overflow),
        &mut store,
    )?;
    let rows = store.finish()?;
    let mut kinds = Fingerprint::default();
    kinds.numbers(desirable.iter().map(|&d| i64::from(d)));
    let held_out_data = HeldOut::load(cfg, &setup)?;
    let held_out = |setup: &Setup| held_out_data.measure(setup, cfg, (Some(&reference), false));
    let loss: KtoLoss = cfg.kto_loss;
    tracing::info!(
        rows = rows.len(),
        data = data.name(),
        beta = cfg.beta,
        "kto"
    );
    let training = TrainingData {
        count: rows.len(),
        identity: serde_json::json!({"rows": rows.identity(), "labels": kinds.hex()}),
        what: "rows",
        source: data.name(),
    };
    let mut trainer = Trainer::new(cfg, &setup, Recipe::Kto, &training, RunRecord::new())?;
    let before = trainer.held_out_before(|| held_out(&setup))?;
    let model = &setup.model;
    let on = (
        setup.tokenizer.pad_id,
        model.config.vocab_size,
        &setup.device,
    );
    let mut policy_scores = setup.scorer(cfg, model);
    let mut reference_scores = setup.scorer(cfg, &reference);
    let world = setup.data.world_size();
    for step in trainer.start_step..trainer.max_steps {
        trainer.begin_step(step);
        let picked = trainer.data.take(trainer.global_step_items()?);
        // Every rank's micro-batch is a mean over its rows: the step's loss is their mean.
        let weight = 1.0 / (picked.len() / cfg.batch_size) as f64;
        for (m, global) in picked.chunks(cfg.batch_size * world).enumerate() {
            let (micro, first) = trainer.local(global);
            let examples: Vec<Example> = micro.iter().map(|&i| rows.get(i)).collect();
            let refs: Vec<&Example> = examples.iter().collect();
            let kinds: Vec<bool> = micro.iter().map(|&i| desirable[i]).collect();
            let ref_logps = completion_logps(&mut reference_scores, &refs, on)?;
            // The KL baseline: the mean over the micro-batch (all ranks') of the mismatched rows'
            // policy-minus-reference log-probs, clamped at 0, as TRL's.
            let kl = match loss.loss_type.uses_kl() {
                true => {
                    let kl_rows = mismatched_rows(&examples, cfg.max_length);
                    let kl_refs: Vec<&Example> = kl_rows.iter().collect();
                    let policy = completion_logps(&mut policy_scores, &kl_refs, on)?;
                    let frozen = completion_logps(&mut reference_scores, &kl_refs, on)?;
                    let mean = policy.iter().zip(&frozen).map(|(p, r)| p - r).sum::<f64>()
                        / policy.len() as f64;
                    (setup.data.sum(mean)? / world as f64).max(0.0)
                }
                false => 0.0,
            };
            let c = collate(&refs, setup.tokenizer.pad_id);
            let t = c.tensors(&setup.device)?;
            let kto = Kto::new(
                &c.labels,
                &kinds,
                &ref_logps,
                kl,
                cfg.beta,
                loss,
                (model.config.vocab_size, &setup.device),
            )?;
            trainer.backward(t.batch(), &kto, (m, first), c.tokens(), weight)?;
        }
        trainer.finish_step()?;
        trainer.evaluate_if_due(|| held_out(&setup))?;
    }
    trainer.finish(before, || held_out(&setup))
}
