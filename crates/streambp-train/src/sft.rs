//! The SFT recipe: token cross entropy on completions, one readable loop over the shared components of
//! `recipe.rs`.

use std::path::Path;

use streambp_core::Batch;
use streambp_models::Model;
use streambp_objectives::Sft;

use crate::batch_file::to_u32_tensor;
use crate::checkpoint::data_identity;
use crate::config::{Recipe, TrainConfig};
use crate::data::{collate, load_sft, pack, read_jsonl, Collated};
use crate::generate::greedy;
use crate::recipe::{Setup, StepAccumulator, Summary, Trainer};
use crate::tokenizer::TextTokenizer;
use crate::{Result, TrainError};

/// Exact-match accuracy of greedy answers on prompt/completion rows.
pub fn accuracy(model: &Model, tok: &TextTokenizer, rows: &[(String, String)]) -> Result<f64> {
    let mut correct = 0;
    for (prompt, answer) in rows {
        let ids = tok.encode(prompt)?;
        let max_new = tok.encode(answer)?.len() + 2;
        let out = greedy(model, &ids, tok.eos_id, max_new)?;
        if tok.decode(&out)?.trim() == answer.trim() {
            correct += 1;
        }
    }
    Ok(correct as f64 / rows.len().max(1) as f64)
}

/// Prompt/completion rows of an evaluation file.
pub fn eval_rows(path: &Path) -> Result<Vec<(String, String)>> {
    read_jsonl(path)?
        .iter()
        .map(|(line, r)| {
            let field = |k: &str| r.get(k).and_then(|v| v.as_str()).map(String::from);
            match (field("prompt"), field("completion")) {
                (Some(p), Some(c)) => Ok((p, c)),
                _ => Err(TrainError::data(
                    format!("{} line {line}", path.display()),
                    "eval data needs \"prompt\" and \"completion\" strings",
                )),
            }
        })
        .collect()
}

/// Exact-match accuracy on `rows`, as a named metric (empty without rows).
pub fn eval_accuracy(
    setup: &Setup,
    rows: &Option<Vec<(String, String)>>,
) -> Result<Vec<(String, f64)>> {
    Ok(match rows {
        Some(rows) => vec![(
            "accuracy".into(),
            accuracy(&setup.model, &setup.tokenizer, rows)?,
        )],
        None => Vec::new(),
    })
}

pub fn run_sft(cfg: &TrainConfig) -> Result<Summary> {
    let setup = Setup::new(cfg, Recipe::Sft)?;
    let data = setup.data_path(&cfg.data, "train.jsonl")?;
    let mut examples = load_sft(&data, &setup.tokenizer, cfg.max_length, cfg.overflow)?;
    if cfg.packing {
        let before = examples.len();
        examples = pack(examples, cfg.max_length);
        tracing::info!(
            examples = before,
            rows = examples.len(),
            max_length = cfg.max_length,
            "packed"
        );
    }
    let eval = setup.eval_path(cfg).as_deref().map(eval_rows).transpose()?;
    tracing::info!(examples = examples.len(), data = %data.display(), "sft");
    let before = match cfg.resume {
        Some(_) => Vec::new(),
        None => eval_accuracy(&setup, &eval)?,
    };
    for (k, v) in &before {
        tracing::info!(metric = k.as_str(), value = v, "held-out before training");
    }

    cfg.check_data_size(examples.len(), "examples", &data)?;
    let mut run = cfg.record(Recipe::Sft);
    run.insert("data".into(), data_identity(&examples));
    let mut trainer = Trainer::new(cfg, &setup, examples.len(), run)?;
    let model = &setup.model;
    for step in trainer.start_step..trainer.max_steps {
        trainer.begin_step();
        let picked = trainer.data.take(cfg.batch_size * cfg.grad_accum);
        // The loss is the mean over every target token of the step, across its micro-batches.
        let targets: usize = picked.iter().map(|&i| examples[i].targets()).sum();
        let mut acc = StepAccumulator::default();
        for micro in picked.chunks(cfg.batch_size) {
            let rows: Vec<_> = micro.iter().map(|&i| &examples[i]).collect();
            let Collated {
                input_ids,
                labels,
                attention_mask,
                position_ids,
            } = collate(&rows, setup.tokenizer.pad_id);
            let tokens = attention_mask.iter().flatten().filter(|&&m| m == 1).count();
            let sft = Sft::new(
                &labels,
                model.config.vocab_size,
                Some(targets as f64),
                &setup.device,
            )?;
            let ids = to_u32_tensor(&input_ids, &setup.device)?;
            let mask = to_u32_tensor(&attention_mask, &setup.device)?;
            let positions = to_u32_tensor(&position_ids, &setup.device)?;
            let batch = Batch {
                input_ids: &ids,
                attention_mask: Some(&mask),
                position_ids: Some(&positions),
            };
            // The objective already divides by the step's target tokens: weight 1.
            acc.add(cfg.backward(model, batch, &sft)?, tokens, 1.0)?;
        }
        trainer.finish_step(cfg, &setup, step, acc.into_report()?)?;
    }
    trainer.finish(cfg, &setup, before, || eval_accuracy(&setup, &eval))
}
