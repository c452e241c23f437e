//! The optimizer step and its bookkeeping, shared by every recipe: the seeded data order, each
//! micro-batch's backward (this rank's rows of the global batch), the step's reduction over ranks
//! (ZeRO 0, 1 or 2, [`crate::parallel`]), clipping, schedule, AdamW, metrics.jsonl, progress bar,
//! atomic checkpoints with resumable state, and the run's summary.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use streambp_core::{Batch, Plan};
use streambp_dist::Communicator;
use streambp_models::Model;
use streambp_objectives::Objective;

use crate::checkpoint::{
    check_resume, data_identity, save_checkpoint_shared, weights_identity, CheckpointFiles, Digest,
    RunRecord, TrainerState, STATE_FILE,
};
use crate::config::{Recipe, TrainConfig};
use crate::metrics_log::MetricsLog;
use crate::optim::{learning_rate, AdamWConfig};
use crate::parallel::DataParallel;
use crate::setup::Setup;
use crate::{Result, TrainError};

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Summary {
    /// The step the run ended at (resumed steps included).
    pub steps: usize,
    /// The loss of the first step this process took (after a resume, the first step after it).
    pub first_loss: f64,
    /// The loss of the last step.
    pub last_loss: f64,
    /// Held-out metric before and after (exact-match accuracy; DPO: also preference accuracy).
    pub before: Vec<(String, f64)>,
    /// The held-out metrics of the trained model, named like `before`.
    pub after: Vec<(String, f64)>,
    /// The final checkpoint's directory (`<output-dir>/final`).
    pub output_dir: PathBuf,
    /// Wall-clock seconds from the trainer's start to the end of the run.
    pub seconds: f64,
}

/// The key of the LoRA dropout masks of micro-batch `micro` of optimizer step `step` (distinct for
/// every pair; the masks hash it with each token's place).
pub fn dropout_key(seed: u64, step: usize, micro: usize) -> u64 {
    seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((step as u64) << 20) ^ micro as u64
}

/// A seeded permutation (Fisher-Yates over SplitMix64), so runs are reproducible.
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = streambp_models::init::NormalRng::new(seed);
    let mut idx: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.uniform() * (i + 1) as f64) as usize;
        idx.swap(i, j.min(i));
    }
    idx
}

/// Walks the data in a new seeded order every epoch; its position is part of a checkpoint.
pub struct DataOrder {
    len: usize,
    seed: u64,
    order: Vec<usize>,
    /// Passes over the data begun, counted from 0.
    pub epoch: u64,
    /// Position of the next example in the current epoch's order.
    pub cursor: usize,
}

impl DataOrder {
    /// The order of `len` examples at `cursor` in epoch `epoch` (a cursor past the end is an error: the
    /// data is not the one the position was saved with).
    pub fn new(len: usize, seed: u64, epoch: u64, cursor: usize) -> Result<Self> {
        if len == 0 || cursor > len {
            return Err(TrainError::Checkpoint(format!(
                "data position {cursor} does not fit data of {len} examples"
            )));
        }
        Ok(Self {
            len,
            seed,
            order: shuffled(len, seed.wrapping_add(epoch)),
            epoch,
            cursor,
        })
    }

    /// The seed the order is drawn from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The next `n` example indices.
    pub fn take(&mut self, n: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            if self.cursor == self.len {
                self.epoch += 1;
                self.order = shuffled(self.len, self.seed.wrapping_add(self.epoch));
                self.cursor = 0;
            }
            out.push(self.order[self.cursor]);
            self.cursor += 1;
        }
        out
    }
}

/// A run's training items (examples, pairs or prompts): how many, their record for checkpoints, what
/// they are called and where they came from.
pub struct TrainingData<'a> {
    /// How many items the data order walks.
    pub count: usize,
    /// Their number and fingerprint ([`data_identity`]), which a resumed run must match.
    pub identity: serde_json::Value,
    /// Their name in messages ("examples", "pairs", "prompts").
    pub what: &'a str,
    /// Where they were read from (a file, or a data set and its split).
    pub source: &'a str,
}

impl<'a> TrainingData<'a> {
    /// Items held in memory.
    pub fn of<T: Digest>(items: &[T], what: &'a str, source: &'a str) -> Self {
        Self {
            count: items.len(),
            identity: data_identity(items),
            what,
            source,
        }
    }
}

/// A step's loss, real tokens and metrics over all ranks.
struct StepTotals {
    loss: f64,
    tokens: usize,
    metrics: Vec<(String, f64)>,
}

/// What the step's micro-batches have added up on this rank.
#[derive(Default)]
struct StepSums {
    loss: f64,
    tokens: usize,
    peak: usize,
    /// The objectives' metrics, weighted like the loss: summed over ranks, then divided by the
    /// weights' sum (`metric_weight`), so that a metric is its mean over the step's micro-batches
    /// whether their losses are means (weights summing to 1) or shares of one global sum (weight 1
    /// each: dapo's, cispo's, vespo's).
    summed: Vec<(String, f64)>,
    metric_weight: f64,
    /// The recipe's own metrics (rewards…), each rank's mean: averaged over ranks.
    averaged: Vec<(String, f64)>,
    micro_batches: usize,
}

fn add_to(list: &mut Vec<(String, f64)>, name: &str, value: f64) {
    match list.iter_mut().find(|(n, _)| n == name) {
        Some((_, acc)) => *acc += value,
        None => list.push((name.to_string(), value)),
    }
}

/// The optimizer step and its bookkeeping: each micro-batch's backward on this rank's rows, the
/// step's reduction over ranks, clipping, schedule, AdamW, metrics.jsonl, progress bar, periodic atomic
/// checkpoints with resumable state.
pub struct Trainer<'a> {
    /// The run's configuration and setup, which every step reads.
    cfg: &'a TrainConfig,
    setup: &'a Setup,
    parallel: DataParallel,
    /// The step the run ends at: `--max-steps`, or `--epochs` over the data.
    pub max_steps: usize,
    /// The first step to take: 0, or the resumed checkpoint's step.
    pub start_step: usize,
    /// Which examples come next (the global order, the same on every rank).
    pub data: DataOrder,
    /// The run's settings, written into every resumable checkpoint.
    run: RunRecord,
    /// What the job carries from step to step (set by the job, written into every resumable
    /// checkpoint; a resumed run's, from its checkpoint).
    pub recipe_state: Option<serde_json::Value>,
    /// metrics.jsonl (rank 0).
    metrics: Option<MetricsLog>,
    bar: indicatif::ProgressBar,
    started: Instant,
    step_started: Instant,
    /// The loss of the first step this process took (NaN before it).
    pub first_loss: f64,
    /// The loss of the latest step.
    pub last_loss: f64,
    last_good: Option<PathBuf>,
    comm: Arc<dyn Communicator>,
    sums: StepSums,
    step: usize,
    /// Rank 0's process id: names the temporary directories every rank writes a checkpoint into.
    job: u64,
}

/// Records the weights in `dir` under `flag` (by content) and the path the run gave under
/// "`flag` path".
fn record_weights(run: &mut RunRecord, flag: &str, dir: &Path) -> Result<()> {
    if let Some(path) = run.remove(flag) {
        run.insert(format!("{flag} path"), path);
    }
    run.insert(flag.into(), weights_identity(dir)?);
    Ok(())
}

impl<'a> Trainer<'a> {
    /// The trainer of a `recipe` run over `data`: checks that a step fits the data, records the run
    /// (its settings, `extra` ones included, the data's fingerprint, the number of ranks) and,
    /// resuming, compares that record with the checkpoint's and restores the optimizer (this rank's
    /// shard) and data position. Call it before any long work (evaluation), so that a refused run
    /// stops at once.
    pub fn new(
        cfg: &'a TrainConfig,
        setup: &'a Setup,
        recipe: Recipe,
        data: &TrainingData,
        extra: RunRecord,
    ) -> Result<Self> {
        let comm = setup.comm.clone();
        let rank = comm.rank();
        let data_ranks = setup.data.world_size();
        let examples = data.count;
        let per_step = cfg.examples_per_step()?.saturating_mul(data_ranks);
        cfg.check_data_size(examples, data.what, data.source, data_ranks)?;
        let run = run_record(cfg, setup, recipe, data, extra)?;
        let adamw = AdamWConfig {
            weight_decay: cfg.weight_decay,
            ..Default::default()
        };
        let groups = (comm.clone(), setup.sequence.clone());
        let mut parallel = DataParallel::new(&setup.model, groups, cfg.zero, adamw)?;
        // Warned here, once per run (validation runs more than once: GRPO checks its settings
        // before parsing rewards, and `Setup::new` checks them again).
        if let Some(max_steps) = cfg.max_steps {
            if cfg.warmup_steps >= max_steps {
                tracing::warn!(
                    warmup_steps = cfg.warmup_steps,
                    max_steps,
                    "the warmup lasts the whole run: the learning rate never reaches --lr"
                );
            }
        }
        let max_steps = cfg
            .max_steps
            .unwrap_or(((examples as f64 * cfg.epochs) / per_step as f64).ceil() as usize)
            .max(1);
        let state = match &cfg.resume {
            Some(dir) => resume(dir, &run, max_steps, &mut parallel, &setup.device)?,
            None => TrainerState {
                step: 0,
                epoch: 0,
                cursor: 0,
                seed: cfg.seed,
                first_loss: None,
                run: RunRecord::new(),
                recipe_state: None,
            },
        };
        let start_step = state.step;
        let continues = cfg
            .resume
            .as_ref()
            .is_some_and(|dir| in_same_dir(dir, &cfg.output_dir));
        let metrics = match rank {
            0 => Some(MetricsLog::open(&cfg.output_dir, start_step, continues)?),
            _ => None,
        };
        let bar = progress_bar(max_steps, cfg.progress && rank == 0);
        bar.set_position(start_step as u64);
        let job = comm.broadcast(u64::from(std::process::id()))?;
        Ok(Self {
            cfg,
            setup,
            parallel,
            max_steps,
            start_step,
            data: DataOrder::new(examples, state.seed, state.epoch, state.cursor)?,
            run,
            recipe_state: state.recipe_state,
            metrics,
            bar,
            started: Instant::now(),
            step_started: Instant::now(),
            first_loss: state.first_loss.unwrap_or(f64::NAN),
            last_loss: f64::NAN,
            last_good: None,
            comm,
            sums: StepSums::default(),
            step: start_step,
            job,
        })
    }

    /// The run's configuration.
    pub fn config(&self) -> &'a TrainConfig {
        self.cfg
    }

    /// The run's model, tokenizer, devices and ranks.
    pub fn setup(&self) -> &'a Setup {
        self.setup
    }

    /// Whether this process is rank 0 (which writes metrics, checkpoints' models and the summary).
    pub fn is_main(&self) -> bool {
        self.comm.rank() == 0
    }

    /// The held-out metrics before training, from `measure` (on rank 0, logged as step 0's `eval/…`);
    /// none when resuming (the checkpoint's model is not the one the run began with).
    pub fn held_out_before(
        &mut self,
        measure: impl FnOnce() -> Result<Vec<(String, f64)>>,
    ) -> Result<Vec<(String, f64)>> {
        if self.start_step > 0 || !self.is_main() {
            return Ok(Vec::new());
        }
        let before = measure()?;
        self.log_eval(0, &before)?;
        Ok(before)
    }

    /// After a step: the held-out metrics from `measure` when `--eval-every` makes this step one to
    /// measure at (rank 0; the other ranks go on and wait for it at the next step's reduction). The
    /// last step's are measured by [`Trainer::finish`].
    pub fn evaluate_if_due(
        &mut self,
        measure: impl FnOnce() -> Result<Vec<(String, f64)>>,
    ) -> Result<()> {
        let cfg = self.cfg;
        let done = self.step + 1;
        if cfg.eval_every == 0
            || !done.is_multiple_of(cfg.eval_every)
            || done >= self.max_steps
            || !self.is_main()
        {
            return Ok(());
        }
        let metrics = measure()?;
        let shown: Vec<String> = metrics.iter().map(|(k, v)| format!("{k} {v:.4}")).collect();
        tracing::info!(step = done, "eval: {}", shown.join(", "));
        self.log_eval(done, &metrics)
    }

    fn log_eval(&mut self, step: usize, metrics: &[(String, f64)]) -> Result<()> {
        match (self.metrics.as_mut(), metrics.is_empty()) {
            (Some(log), false) => log.write(step, "eval", metrics),
            _ => Ok(()),
        }
    }

    /// This rank's share of a global micro-batch (`global`, whose length the ranks divide: each rank's
    /// `--batch-size` rows), and the index of its first row in it.
    pub fn local<'g, T>(&self, global: &'g [T]) -> (&'g [T], usize) {
        let data = &self.setup.data;
        let n = global.len() / data.world_size();
        let first = data.rank() * n;
        (&global[first..first + n], first)
    }

    /// The examples one optimizer step takes from the data, on all ranks together.
    pub fn global_step_items(&self) -> Result<usize> {
        Ok(self.cfg.examples_per_step()? * self.setup.data.world_size())
    }

    /// Marks the start of step `step` (for its timing and its dropout masks).
    pub fn begin_step(&mut self, step: usize) {
        self.step = step;
        self.step_started = Instant::now();
    }

    /// One micro-batch's backward on this rank's rows: `micro` is its index in the step (the same
    /// on every rank), `first_row` its rows' place in the global micro-batch (so that LoRA dropout
    /// masks differ across ranks as across rows), `tokens` its real tokens, `weight` its share of the
    /// step's loss (the objective's normalisation already global: 1 for SFT, one over the global
    /// micro-batches for means). With ZeRO-2 its gradients are reduced over ranks layer by layer here.
    pub fn backward(
        &mut self,
        batch: Batch,
        objective: &dyn Objective,
        (micro, first_row): (usize, usize),
        tokens: usize,
        weight: f64,
    ) -> Result<()> {
        let (cfg, model) = (self.cfg, &self.setup.model);
        let planned = cfg.plan_for(model, batch.input_ids, Some(objective))?;
        let plan = Plan {
            mode: cfg.mode,
            chunks: planned.chunks,
            options: planned.options(cfg.options_for(self.step, micro, first_row)),
        };
        let out = self
            .parallel
            .backward(model, batch, objective, plan, weight)?;
        let s = &mut self.sums;
        s.micro_batches += 1;
        s.loss += out.loss * weight;
        s.tokens += tokens;
        s.peak = s.peak.max(out.phases.overall_peak().unwrap_or(0));
        for (name, value) in &out.metrics {
            add_to(&mut s.summed, name, value * weight);
        }
        s.metric_weight += weight;
        Ok(())
    }

    /// The step's value so far of an objective's metric `name` over every rank's micro-batches
    /// (as [`Trainer::finish_step`] will log it), `None` where no micro-batch weighs anything. A
    /// collective: every data-parallel rank calls it with the same names.
    pub fn step_metric(&self, name: &str) -> Result<Option<f64>> {
        let data = &self.setup.data;
        let local = self
            .sums
            .summed
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0.0, |(_, v)| *v);
        let (value, weight) = (data.sum(local)?, data.sum(self.sums.metric_weight)?);
        Ok((weight > 0.0).then_some(value / weight))
    }

    /// Adds this rank's value of a metric of the step (its mean over this rank's items); the step
    /// reports the mean over ranks.
    pub fn add_metric(&mut self, name: &str, value: f64) {
        add_to(&mut self.sums.averaged, name, value);
    }

    /// The step's loss and metrics, summed (or averaged) over ranks.
    fn reduce_metrics(&self, sums: &StepSums) -> Result<StepTotals> {
        // Over the data-parallel ranks: the ranks of a sequence group report the same whole rows.
        let data = &self.setup.data;
        let sum = |x: f64| data.sum(x).map_err(TrainError::from);
        let world = data.world_size() as f64;
        let loss = sum(sums.loss)?;
        let tokens = sum(sums.tokens as f64)? as usize;
        let mut metrics = Vec::new();
        // A step whose micro-batches all weigh 0 (every completion masked) reports none.
        let metric_weight = sum(sums.metric_weight)?;
        for (k, v) in &sums.summed {
            let v = sum(*v)?;
            if metric_weight > 0.0 {
                metrics.push((k.clone(), v / metric_weight));
            }
        }
        for (k, v) in &sums.averaged {
            metrics.push((k.clone(), sum(*v)? / world));
        }
        Ok(StepTotals {
            loss,
            tokens,
            metrics,
        })
    }

    /// Reduces the step's gradients over ranks, clips, schedules and applies them, logs the step, and
    /// checkpoints when due; returns the step's metrics (over all ranks). A non-finite loss stops the
    /// run before any update, naming the last good checkpoint.
    pub fn finish_step(&mut self) -> Result<Vec<(String, f64)>> {
        let cfg = self.cfg;
        let step = self.step;
        let sums = std::mem::take(&mut self.sums);
        if sums.micro_batches == 0 {
            return Err(TrainError::Internal(
                "an optimizer step without a micro-batch".into(),
            ));
        }
        let StepTotals {
            loss,
            tokens,
            metrics,
        } = self.reduce_metrics(&sums)?;
        if !loss.is_finite() {
            self.bar.abandon();
            return Err(TrainError::NonFiniteLoss {
                loss,
                step: step + 1,
                last_good: self
                    .last_good
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "none yet".into()),
            });
        }
        let lr = learning_rate(cfg.schedule, cfg.lr, step, cfg.warmup_steps, self.max_steps);
        let grad_norm = self.parallel.step(cfg.max_grad_norm, lr)?;
        // The run's first loss: a resumed run has it from its checkpoint.
        if self.first_loss.is_nan() {
            self.first_loss = loss;
        }
        self.last_loss = loss;
        let seconds = self.step_started.elapsed().as_secs_f64();
        if let Some(log) = self.metrics.as_mut() {
            let mut row: Vec<(String, f64)> = [
                ("loss", loss),
                ("lr", lr),
                ("grad_norm", grad_norm),
                ("tokens", tokens as f64),
                ("tokens_per_sec", tokens as f64 / seconds),
                ("peak_bytes", sums.peak as f64),
                ("seconds", seconds),
                ("epoch", self.data.epoch as f64),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            row.extend(metrics.iter().cloned());
            log.write(step + 1, "train", &row)?;
        }
        self.bar.set_message(format!(
            "loss {loss:.4} lr {lr:.2e} {:.0} tok/s peak {:.0} MiB",
            tokens as f64 / seconds,
            sums.peak as f64 / (1 << 20) as f64
        ));
        self.bar.inc(1);
        // The last step's always (as the HF Trainer saves at the end), so that a finished run can
        // be extended with a larger --max-steps.
        let due = cfg.save_every > 0 && (step + 1).is_multiple_of(cfg.save_every);
        if due || step + 1 == self.max_steps {
            let dir = cfg.output_dir.join(format!("checkpoint-{}", step + 1));
            self.save(&dir, step + 1)?;
            self.last_good = Some(dir);
        }
        Ok(metrics)
    }

    /// A resumable checkpoint of step `step` in `dir`: the model (or adapter), tokenizer and trainer
    /// state from rank 0, every rank's optimizer state (its shard, or rank 0's whole one).
    fn save(&self, dir: &Path, step: usize) -> Result<()> {
        let (cfg, setup) = (self.cfg, self.setup);
        let state = TrainerState {
            step,
            epoch: self.data.epoch,
            cursor: self.data.cursor,
            seed: self.data.seed(),
            first_loss: Some(self.first_loss).filter(|l| l.is_finite()),
            run: self.run.clone(),
            recipe_state: self.recipe_state.clone(),
        };
        let state = serde_json::to_string_pretty(&state)
            .map_err(|e| TrainError::Internal(format!("trainer state: {e}")))?;
        let config_json = setup.model_dir.join("config.json");
        let extra = [(STATE_FILE, state)];
        let files = CheckpointFiles {
            extra: &extra,
            ..setup.checkpoint_files(cfg, &config_json)
        };
        // Whole moments are the same on every rank: rank 0 writes them; shards come from their ranks.
        let own: Vec<_> = self.parallel.state().into_iter().collect();
        let main = (self.comm.rank() == 0).then_some(&files);
        save_checkpoint_shared(self.comm.as_ref(), self.job, main, &own, dir)
    }

    /// Ends the run: the final checkpoint (weights or adapter, config, tokenizer) in
    /// `output_dir/final` (and the merged model with `--merge`) written by rank 0, then its summary
    /// with the held-out metrics `before` and those `after` measures on the trained model (rank 0).
    pub fn finish(
        &mut self,
        before: Vec<(String, f64)>,
        after: impl FnOnce() -> Result<Vec<(String, f64)>>,
    ) -> Result<Summary> {
        let (cfg, setup) = (self.cfg, self.setup);
        self.bar.finish();
        let dir = cfg.output_dir.join("final");
        let config_json = setup.model_dir.join("config.json");
        let files = setup.checkpoint_files(cfg, &config_json);
        let main = self.is_main().then_some(&files);
        save_checkpoint_shared(self.comm.as_ref(), self.job, main, &[], &dir)?;
        if cfg.merge && self.is_main() {
            // The adapter merged into the base: a plain HF model, for tools that know no PEFT.
            let merged = Model::from_tensors(
                setup.model.config.clone(),
                setup.model.merged_weights()?.into_iter().collect(),
            )?;
            let files = CheckpointFiles {
                model: &merged,
                ..setup.checkpoint_files(cfg, &config_json)
            };
            save_checkpoint_shared(
                &streambp_dist::SingleProcess,
                self.job,
                Some(&files),
                &[],
                &cfg.output_dir.join("merged"),
            )?;
        }
        let after = match self.is_main() {
            true => after()?,
            false => Vec::new(),
        };
        self.log_eval(self.max_steps, &after)?;
        if self.is_main() {
            // The run is saved and its last evaluation logged (the chart's last point); a chart that cannot be drawn costs nothing but the chart.
            let plots = cfg.output_dir.join("plots");
            if let Err(e) =
                crate::plots::plot_metrics(&cfg.output_dir.join("metrics.jsonl"), &plots)
            {
                tracing::warn!(error = %e, "no metrics plot");
            }
        }
        let seconds = self.started.elapsed().as_secs_f64();
        Ok(Summary {
            steps: self.max_steps,
            first_loss: self.first_loss,
            last_loss: self.last_loss,
            before,
            after,
            output_dir: dir,
            seconds,
        })
    }
}

fn progress_bar(steps: usize, visible: bool) -> indicatif::ProgressBar {
    if !visible {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(steps as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{bar:30} {pos}/{len} [{elapsed_precise} < {eta_precise}] {msg}",
    ) {
        bar.set_style(style);
    }
    bar
}

/// The record of a `recipe` run: its settings (`extra` ones included), the data's fingerprint, the
/// number of ranks, and the model, an adapter to train further and DPO's or KTO's reference
/// identified by their weights, their paths kept for the record alone (a changed path warns,
/// changed weights refuse a resume).
fn run_record(
    cfg: &TrainConfig,
    setup: &Setup,
    recipe: Recipe,
    data: &TrainingData,
    extra: RunRecord,
) -> Result<RunRecord> {
    let mut run = cfg.record(recipe);
    if let crate::setup::InitialModel::Dir(dir) = &setup.initial {
        record_weights(&mut run, "--model", dir)?;
    }
    if let Some(spec) = &cfg.adapter {
        let dir = streambp_models::resolve_adapter_dir(spec)?;
        record_weights(&mut run, "--adapter", &dir)?;
    }
    if let (Recipe::Dpo | Recipe::Kto, Some(spec)) = (recipe, &cfg.ref_model) {
        let dir = streambp_models::resolve_model_dir(spec)?;
        record_weights(&mut run, "--ref-model", &dir)?;
    }
    run.extend(extra);
    run.insert("data".into(), data.identity.clone());
    run.insert("ranks".into(), setup.comm.world_size().into());
    Ok(run)
}

/// Resuming from checkpoint `dir`: its record checked against `run`, the optimizer's state (this
/// rank's shard) loaded into `parallel`; the step, epoch, data cursor, seed (the order the position
/// was saved in is the checkpoint's seed's) and first loss to go on from. An error where the
/// checkpoint is at or past `max_steps`.
fn resume(
    dir: &Path,
    run: &RunRecord,
    max_steps: usize,
    parallel: &mut DataParallel,
    device: &candle_core::Device,
) -> Result<TrainerState> {
    let state = TrainerState::read(dir)?;
    check_resume(dir, &state.run, run)?;
    if state.step >= max_steps {
        return Err(TrainError::Checkpoint(format!(
            "{} is at step {}, and the run ends at step {max_steps}: nothing left to \
             train (raise --max-steps)",
            dir.display(),
            state.step
        )));
    }
    parallel.load_state(dir, state.step, device)?;
    tracing::info!(step = state.step, dir = %dir.display(), "resumed");
    Ok(state)
}

/// Whether `checkpoint` lies in `output_dir` (both existing): a resumed run that goes on writing
/// beside its checkpoints continues their metrics log.
fn in_same_dir(checkpoint: &Path, output_dir: &Path) -> bool {
    let real = |p: &Path| std::fs::canonicalize(p).ok();
    checkpoint.parent().and_then(real).is_some()
        && checkpoint.parent().and_then(real) == real(output_dir)
}
