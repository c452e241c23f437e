//! The SFT recipe: token cross entropy on completions (or whole texts), one readable loop over
//! [`crate::setup::Setup`] and [`crate::trainer::Trainer`].

use streambp_objectives::Sft;

use crate::batch::collate;
use crate::checkpoint::RunRecord;
use crate::config::{Recipe, TrainConfig};
use crate::data::{load_sft, load_sft_into};
use crate::eval::{eval_accuracy, eval_loss, eval_rows};
use crate::output::temporary;
use crate::setup::Setup;
use crate::token_store::StoreWriter;
use crate::trainer::{Summary, Trainer, TrainingData};
use crate::Result;

/// Trains `cfg`'s model on its SFT data (the built-in arithmetic task by default).
pub fn run_sft(cfg: &TrainConfig) -> Result<Summary> {
    let setup = Setup::new(cfg, Recipe::Sft)?;
    let data = setup.data_source(cfg, "train.jsonl")?;
    let tok = &setup.tokenizer;
    // Tokenized row by row onto disk, and read back by index: memory does not grow with the data.
    let mut store = StoreWriter::create(&temporary(&cfg.output_dir, "tokenized"))?;
    let limits = (cfg.max_length, cfg.overflow);
    load_sft_into(&data, tok, limits, &cfg.text_field, &mut store)?;
    let mut examples = store.finish()?;
    if cfg.packing {
        let before = examples.len();
        examples = examples.packed(cfg.max_length, &temporary(&cfg.output_dir, "packed"))?;
        tracing::info!(
            examples = before,
            rows = examples.len(),
            max_length = cfg.max_length,
            "packed"
        );
    }
    tracing::info!(examples = examples.len(), data = data.name(), "sft");
    let training = TrainingData {
        count: examples.len(),
        identity: examples.identity().clone(),
        // What a step counts: packed rows, each holding several examples, under --packing.
        what: match cfg.packing {
            true => "packed rows",
            false => "examples",
        },
        source: data.name(),
    };
    let mut trainer = Trainer::new(cfg, &setup, Recipe::Sft, &training, RunRecord::new())?;
    let eval_source = setup.eval_source(cfg)?;
    let eval = eval_source
        .as_ref()
        .map(|s| eval_rows(s, tok, cfg.max_length))
        .transpose()?
        .flatten();
    let eval_examples = eval_source
        .as_ref()
        .map(|s| load_sft(s, tok, cfg.max_length, cfg.overflow, &cfg.text_field))
        .transpose()?;
    // TRL's eval loss on the held-out examples, and the accuracy of greedy answers where the rows
    // are prompt/completion.
    let held_out = || -> Result<Vec<(String, f64)>> {
        let mut metrics = Vec::new();
        if let Some(examples) = &eval_examples {
            metrics.push(("loss".into(), eval_loss(&setup, cfg, examples)?));
        }
        metrics.extend(eval_accuracy(&setup, &eval)?);
        Ok(metrics)
    };
    let before = trainer.held_out_before(held_out)?;

    let model = &setup.model;
    for step in trainer.start_step..trainer.max_steps {
        trainer.begin_step(step);
        let picked = trainer.data.take(trainer.global_step_items()?);
        // This rank's rows of each micro-batch, read from the store once for the step.
        let micro_batches: Vec<_> = picked
            .chunks(cfg.batch_size * setup.data.world_size())
            .map(|global| {
                let (rows, first_row) = trainer.local(global);
                let rows: Vec<_> = rows.iter().map(|&i| examples.get(i)).collect();
                (rows, first_row)
            })
            .collect();
        // The loss is the mean over every target token of the step, across its micro-batches and
        // ranks: this rank's count, summed over ranks before the backward.
        let mine: usize = micro_batches
            .iter()
            .flat_map(|(rows, _)| rows.iter())
            .map(|e| e.targets())
            .sum();
        let targets = setup.data.sum(mine as f64)?;
        for (m, (rows, first_row)) in micro_batches.into_iter().enumerate() {
            let c = collate(&rows.iter().collect::<Vec<_>>(), setup.tokenizer.pad_id);
            let sft = Sft::new(
                &c.labels,
                model.config.vocab_size,
                Some(targets),
                &setup.device,
            )?;
            let tensors = c.tensors(&setup.device)?;
            // The objective already divides by the step's target tokens: weight 1.
            let batch = tensors.batch();
            trainer.backward(batch, &sft, (m, first_row), c.tokens(), 1.0)?;
        }
        trainer.finish_step()?;
        trainer.evaluate_if_due(held_out)?;
    }
    trainer.finish(before, held_out)
}
