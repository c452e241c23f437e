//! The preference jobs' shared half: pairs in TRL's formats (loaded, tokenized onto disk, stacked
//! into `[chosen…, rejected…]` micro-batches) and the one training loop over them, which DPO, ORPO
//! and CPO drive through [`PairJob`]: what a job adds is its objective for a micro-batch, and the
//! frozen reference its margins are measured against when it has one.

use streambp_models::Model;
use streambp_objectives::{Objective, TokenTargets};

use crate::batch::{collate, Collated};
use crate::checkpoint::{Digest, Fingerprint, RunRecord};
use crate::config::{Recipe, TrainConfig};
use crate::data::{encode_pair, row_columns, text_field, Example, LoadReport, Overflow, Text};
use crate::dataset::DataSource;
use crate::eval::{eval_accuracy, eval_rows};
use crate::logprobs::{collated_logps, sequence_logps};
use crate::output::temporary;
use crate::setup::Setup;
use crate::token_store::{ExampleSink, StoreWriter};
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

/// Pairs in TRL's preference formats: `prompt` + `chosen` + `rejected`, or `chosen` + `rejected` with
/// the prompt implicit in both (their shared start, as TRL's `maybe_extract_prompt` finds it, also
/// when a `prompt` column of the other kind sits beside conversations); strings (EOS ends each
/// completion) or conversations rendered with the chat template. A pair longer than `max_length` is
/// skipped or, as TRL's default `keep_start` truncation does, cut to its first `max_length` tokens per
/// side (and skipped when a side has no completion token left).
pub fn load_pairs(
    source: &DataSource,
    tok: &TextTokenizer,
    max_length: usize,
    overflow: Overflow,
) -> Result<Vec<Pair>> {
    let mut sides = Vec::new();
    load_pairs_into(source, tok, (max_length, overflow), &mut sides)?;
    let mut sides = sides.into_iter();
    Ok(std::iter::from_fn(|| {
        Some(Pair {
            chosen: sides.next()?,
            rejected: sides.next()?,
        })
    })
    .collect())
}

/// [`load_pairs`] into `out`, one pair at a time as its chosen then its rejected example (a
/// [`crate::token_store::StoreWriter`] keeps a data set of any size on disk: pair `i` is examples
/// `2i` and `2i + 1`); `limits` are `--max-length` and `--overflow`.
pub fn load_pairs_into(
    source: &DataSource,
    tok: &TextTokenizer,
    (max_length, overflow): (usize, Overflow),
    out: &mut impl ExampleSink,
) -> Result<Option<Vec<f64>>> {
    let mut report = LoadReport::default();
    // TRL's `margin` column (read by reward models): every kept pair's, or none.
    let mut margins: Option<Vec<f64>> = None;
    for row in source.rows() {
        let (at, row) = row?;
        let where_ = at.to_string();
        let margin = match row.get("margin") {
            None | Some(serde_json::Value::Null) => None,
            // The loss grows with the margin: one beyond f32's range makes it infinite.
            Some(v) => Some(
                v.as_f64()
                    .filter(|m| m.abs() <= f64::from(f32::MAX))
                    .ok_or_else(|| {
                        TrainError::data(
                            &where_,
                            format!(
                                "\"margin\" must be a number within f32's range (±3.4e38), not {v}"
                            ),
                        )
                    })?,
            ),
        };
        let need = |k: &str| -> Result<Text> {
            text_field(&row, k, &where_)?.ok_or_else(|| {
                TrainError::data(
                    &where_,
                    format!(
                        "expected \"chosen\" and \"rejected\" (and \"prompt\" unless both hold it), \
                         no {k:?}; the row has {}",
                        row_columns(&row)
                    ),
                )
            })
        };
        let (chosen, rejected) = (need("chosen")?, need("rejected")?);
        let (prompt, chosen, rejected) = match text_field(&row, "prompt", &where_)? {
            Some(prompt) if same_kind(&prompt, &chosen) => (prompt, chosen, rejected),
            _ => extract_prompt(chosen, rejected, &where_)?,
        };
        let side = |reply: Text| -> Result<Example> {
            let (p, completion) = encode_pair(tok, prompt.clone(), reply, max_length, &where_)?;
            Ok(Example::from_pair(p, completion))
        };
        let (mut chosen, mut rejected) = (side(chosen)?, side(rejected)?);
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
        // Identical sides (as written, or once truncated) carry no preference: the loss is ln 2 and
        // the gradient zero whatever the model.
        if chosen.input_ids == rejected.input_ids {
            report.note_identical(&where_);
            continue;
        }
        let kept = out.count() / 2;
        match (&mut margins, margin) {
            (None, Some(m)) if kept == 0 => margins = Some(vec![m]),
            (Some(list), Some(m)) => list.push(m),
            (None, None) => {}
            _ => {
                return Err(TrainError::data(
                    &where_,
                    "\"margin\" must be given on every pair or on none",
                ))
            }
        }
        out.push(chosen)?;
        out.push(rejected)?;
    }
    report.finish(
        source,
        "pairs",
        out.count() / 2,
        &format!("--max-length {max_length}"),
    )?;
    Ok(margins)
}

fn same_kind(a: &Text, b: &Text) -> bool {
    matches!(
        (a, b),
        (Text::Plain(_), Text::Plain(_)) | (Text::Messages(_), Text::Messages(_))
    )
}

/// The prompt `chosen` and `rejected` share, and what each adds, as TRL's `extract_prompt` cuts them:
/// at the first message (conversations) or character (strings) where they differ, a space before that
/// character going with the completions; where one holds the other, before the shorter's last item.
fn extract_prompt(chosen: Text, rejected: Text, where_: &str) -> Result<(Text, Text, Text)> {
    fn cut<T: PartialEq + Clone>(c: &[T], r: &[T], is_space: impl Fn(&T) -> bool) -> Option<usize> {
        let n = c.len().min(r.len());
        let first_difference = (0..n).find(|&i| c[i] != r[i]);
        match first_difference {
            Some(i) if i > 0 && is_space(&c[i - 1]) => Some(i - 1),
            Some(i) => Some(i),
            None => n.checked_sub(1),
        }
    }
    let none = || {
        TrainError::data(
            where_,
            "no \"prompt\", and \"chosen\" or \"rejected\" is empty: no prompt to find in them",
        )
    };
    match (chosen, rejected) {
        (Text::Messages(c), Text::Messages(r)) => {
            let at = cut(&c, &r, |_| false).ok_or_else(none)?;
            if at == 0 {
                return Err(TrainError::data(
                    where_,
                    "no \"prompt\", and the conversations \"chosen\" and \"rejected\" differ from \
                     their first message: no shared prompt",
                ));
            }
            Ok((
                Text::Messages(c[..at].to_vec()),
                Text::Messages(c[at..].to_vec()),
                Text::Messages(r[at..].to_vec()),
            ))
        }
        (Text::Plain(c), Text::Plain(r)) => {
            let (cc, rc): (Vec<char>, Vec<char>) = (c.chars().collect(), r.chars().collect());
            let at = cut(&cc, &rc, |ch| *ch == ' ').ok_or_else(none)?;
            let text = |chars: &[char]| chars.iter().collect::<String>();
            Ok((
                Text::Plain(text(&cc[..at])),
                Text::Plain(text(&cc[at..])),
                Text::Plain(text(&rc[at..])),
            ))
        }
        _ => Err(TrainError::data(
            where_,
            "\"chosen\" and \"rejected\" must both be strings or both be conversations",
        )),
    }
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

/// What one preference job adds to the shared loop.
pub trait PairJob {
    /// The frozen model its margins are measured against (DPO's reference), if any: the loop scores
    /// each micro-batch with it and hands the log-probs to [`PairJob::objective`].
    fn reference(&self) -> Option<&Model> {
        None
    }

    /// Whether the job's rewards compare completions' mean token log-probs rather than their sums
    /// (held-out preference accuracy follows it).
    fn averaged(&self) -> bool;

    /// The objective of one micro-batch.
    fn objective(&self, batch: &PairBatch) -> Result<Box<dyn Objective>>;
}

/// One micro-batch of stacked pairs, as a [`PairJob`] builds its objective from it.
pub struct PairBatch<'a> {
    /// The rows, chosen first.
    pub rows: &'a Collated,
    /// Each pair's `margin`, when the data has that column.
    pub margins: Option<Vec<f64>>,
    /// The reference's summed completion log-prob of each row, when the job has a reference.
    pub reference_logps: Option<Vec<f64>>,
    setup: &'a Setup,
}

impl PairBatch<'_> {
    /// The number of pairs.
    pub fn pairs(&self) -> usize {
        self.rows.input_ids.len() / 2
    }

    /// The vocabulary size and device objectives are built for.
    pub fn vocab_and_device(&self) -> (usize, &candle_core::Device) {
        (self.setup.model.config.vocab_size, &self.setup.device)
    }

    /// An NLL's normaliser when the micro-batch is split over ranks: `local` (this rank's tokens)
    /// summed over the ranks and divided by their number, so the ranks' terms average to the whole
    /// micro-batch's mean; `None` on one process (the objective's own count). Every rank must call it.
    pub fn pooled_nll_tokens(&self, local: f64) -> Result<Option<f64>> {
        let world = self.setup.data.world_size();
        if world < 2 {
            return Ok(None);
        }
        Ok(Some(self.setup.data.sum(local)? / world as f64))
    }
}

/// What a preference run is scored on before, during and after training: held-out pairs by
/// preference accuracy (--eval-data's or --eval-split's when its rows are pairs, the built-in task's
/// test pairs on the built-in task), held-out prompt/completion rows by exact-match accuracy.
pub struct HeldOut {
    pairs: Option<Vec<Pair>>,
    questions: Option<Vec<crate::eval::Question>>,
}

impl HeldOut {
    /// The run's held-out data, loaded and tokenized.
    pub fn load(cfg: &TrainConfig, setup: &Setup) -> Result<Self> {
        let holds_pairs = |source: &DataSource| {
            source.rows().next().is_some_and(|row| {
                row.is_ok_and(|(_, r)| r.contains_key("chosen") && r.contains_key("rejected"))
            })
        };
        let load = |source: &DataSource| {
            load_pairs(source, &setup.tokenizer, cfg.max_length, cfg.overflow)
        };
        let (pairs, questions) = match &setup.eval_source(cfg)? {
            Some(source) if holds_pairs(source) => (Some(load(source)?), None),
            // A reward model generates nothing: only pairs measure it.
            Some(source) if setup.model.scores_positions() => {
                return Err(TrainError::data(
                    source.name(),
                    "a reward model is measured on held-out preference pairs (\"chosen\" and \
                     \"rejected\"), and these rows are not pairs",
                ))
            }
            Some(source) => (None, eval_rows(source, &setup.tokenizer, cfg.max_length)?),
            None => (None, None),
        };
        let pairs = match (pairs, &cfg.data) {
            (None, None) => Some(load(&setup.builtin_file("dpo_test.jsonl")?)?),
            (pairs, _) => pairs,
        };
        Ok(Self { pairs, questions })
    }

    /// Exact-match accuracy, and preference accuracy: the fraction of pairs whose margin is
    /// positive, the policy's chosen-minus-rejected completion log-prob (summed, or its tokens' mean
    /// when `averaged`) less the `reference`'s where there is one. A reward model (which generates
    /// nothing) is scored by its rewards' margins alone.
    pub fn measure(
        &self,
        setup: &Setup,
        cfg: &TrainConfig,
        (reference, averaged): (Option<&Model>, bool),
    ) -> Result<Vec<(String, f64)>> {
        if setup.model.scores_positions() {
            return self.measure_rewards(setup, cfg);
        }
        let mut metrics = eval_accuracy(setup, &self.questions)?;
        let Some(pairs) = &self.pairs else {
            return Ok(metrics);
        };
        let mut policy_scores = cfg.local_scorer(&setup.model);
        let mut reference_scores = reference.map(|r| cfg.local_scorer(r));
        let mut wins = 0;
        for group in pairs.chunks(32) {
            let refs: Vec<&Pair> = group.iter().collect();
            let c = stack(&refs, setup.tokenizer.pad_id);
            let t = c.tensors(&setup.device)?;
            let vocab = setup.model.config.vocab_size;
            let targets = TokenTargets::from_labels(&c.labels, vocab, &setup.device)?;
            let mask = Some(&t.attention_mask);
            let mut margin = sequence_logps(&mut policy_scores, &t.input_ids, mask, &targets)?;
            if let Some(scores) = &mut reference_scores {
                let reference = sequence_logps(scores, &t.input_ids, mask, &targets)?;
                margin.iter_mut().zip(reference).for_each(|(m, r)| *m -= r);
            }
            if averaged {
                margin
                    .iter_mut()
                    .zip(&targets.counts)
                    .for_each(|(m, &n)| *m /= n as f64);
            }
            let n = group.len();
            wins += (0..n).filter(|&i| margin[i] - margin[n + i] > 0.0).count();
        }
        let accuracy = wins as f64 / pairs.len() as f64;
        metrics.push(("preference_accuracy".into(), accuracy));
        Ok(metrics)
    }

    /// A reward model's preference accuracy: the fraction of held-out pairs whose chosen row's
    /// reward (its score where transformers reads it) beats the rejected row's.
    fn measure_rewards(&self, setup: &Setup, cfg: &TrainConfig) -> Result<Vec<(String, f64)>> {
        let Some(pairs) = &self.pairs else {
            return Ok(Vec::new());
        };
        let mut scores = cfg.local_scorer(&setup.model);
        let pad = setup.tokenizer.pad_id;
        let mut wins = 0;
        for group in pairs.chunks(32) {
            let refs: Vec<&Pair> = group.iter().collect();
            let c = stack(&refs, pad);
            let t = c.tensors(&setup.device)?;
            let no_targets = t.input_ids.zeros_like()?;
            let all = scores(&t.input_ids, Some(&t.attention_mask), &no_targets, 1.0)?;
            let all = all.to_dtype(candle_core::DType::F64)?.to_vec2::<f64>()?;
            let rewards: Vec<f64> = streambp_objectives::pooled_positions(&c.input_ids, pad)
                .iter()
                .zip(&all)
                .map(|(&p, row)| row[p])
                .collect();
            let n = group.len();
            wins += (0..n).filter(|&i| rewards[i] > rewards[n + i]).count();
        }
        let accuracy = wins as f64 / pairs.len() as f64;
        Ok(vec![("preference_accuracy".into(), accuracy)])
    }
}

/// Trains `setup`'s model on preference pairs as `job` says (the built-in pairs by default).
pub fn train_on_pairs(
    cfg: &TrainConfig,
    recipe: Recipe,
    setup: &Setup,
    job: &dyn PairJob,
) -> Result<Summary> {
    let data = setup.data_source(cfg, "dpo.jsonl")?;
    // Tokenized pair by pair onto disk and read back by index, as SFT's examples.
    let mut store = StoreWriter::create(&temporary(&cfg.output_dir, "tokenized"))?;
    let limits = (cfg.max_length, cfg.overflow);
    let margins = load_pairs_into(&data, &setup.tokenizer, limits, &mut store)?;
    let sides = store.finish()?;
    let pairs = sides.len() / 2;
    let pair = |i: usize| Pair {
        chosen: sides.get(2 * i),
        rejected: sides.get(2 * i + 1),
    };
    let held_out_data = HeldOut::load(cfg, setup)?;
    let scoring = (job.reference(), job.averaged());
    let held_out = |setup: &Setup| held_out_data.measure(setup, cfg, scoring);
    tracing::info!(
        pairs,
        data = data.name(),
        beta = cfg.beta,
        "{}",
        recipe.name()
    );
    // The margins change the objective as the tokens do: a resume checks both.
    let identity = match &margins {
        None => sides.identity().clone(),
        Some(margins) => {
            let mut digest = Fingerprint::default();
            margins.iter().for_each(|m| digest.bytes(&m.to_le_bytes()));
            serde_json::json!({"pairs": sides.identity(), "margins": digest.hex()})
        }
    };
    let training = TrainingData {
        count: pairs,
        identity,
        what: "pairs",
        source: data.name(),
    };
    let mut trainer = Trainer::new(cfg, setup, recipe, &training, RunRecord::new())?;
    let before = trainer.held_out_before(|| held_out(setup))?;
    let model = &setup.model;
    let mut reference_scores = job.reference().map(|r| setup.scorer(cfg, r));
    let world = setup.data.world_size();
    for step in trainer.start_step..trainer.max_steps {
        trainer.begin_step(step);
        let picked = trainer.data.take(trainer.global_step_items()?);
        // Every rank's micro-batch is a mean over its pairs, all of one size: the step's loss is the
        // mean of all of them, over micro-batches and ranks.
        let weight = 1.0 / (picked.len() / cfg.batch_size) as f64;
        for (m, global) in picked.chunks(cfg.batch_size * world).enumerate() {
            let (micro, first) = trainer.local(global);
            let group: Vec<Pair> = micro.iter().map(|&i| pair(i)).collect();
            let c = stack(&group.iter().collect::<Vec<_>>(), setup.tokenizer.pad_id);
            let t = c.tensors(&setup.device)?;
            let reference_logps = match &mut reference_scores {
                Some(scores) => Some(collated_logps(scores, &c, &t, model.config.vocab_size)?),
                None => None,
            };
            let batch = PairBatch {
                rows: &c,
                margins: margins
                    .as_ref()
                    .map(|all| micro.iter().map(|&i| all[i]).collect()),
                reference_logps,
                setup,
            };
            let objective = job.objective(&batch)?;
            // Chosen and rejected rows of the pairs from `first` on (dropout masks by row).
            let rows = (m, 2 * first);
            trainer.backward(t.batch(), objective.as_ref(), rows, c.tokens(), weight)?;
        }
        trainer.finish_step()?;
        trainer.evaluate_if_due(|| held_out(setup))?;
    }
    trainer.finish(before, || held_out(setup))
}
