//! One backward per mode, measured: the synthetic workload, the run that times it and reads its
//! peaks (the fastest of `--repeats`), and the [`Point`] it reports.

use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::{Device, Tensor};
use streambp_core::memory::Meter;
use streambp_core::{backward_with, Batch, Chunks, Mode, Options, Plan};
use streambp_kernels::op_times;
use streambp_models::Model;
use streambp_objectives::{Dpo, Grpo, GrpoBatch, GrpoLossType, Objective, Rollouts, Sft};
use streambp_train::optim::{AdamW, AdamWConfig};

use crate::args::{rows_of, Args};

/// One measured backward: a training and mode at one T.
pub(crate) struct Point {
    /// What is trained: `full`, or `LoRA r=N`.
    pub(crate) trained: String,
    pub(crate) mode: Mode,
    pub(crate) t: usize,
    /// Peak bytes above what was live before the backward (the weights).
    pub(crate) peak: usize,
    /// Bytes live before the backward.
    pub(crate) base: usize,
    pub(crate) phases: Vec<(&'static str, usize, f64)>,
    pub(crate) seconds: f64,
    pub(crate) loss: f64,
    /// With --optimizer-step: the step's peak bytes above what was live before it, and its seconds.
    pub(crate) optimizer: Option<(usize, f64)>,
    /// With --checkpoint-dir: the checkpoints' bytes written and read and their seconds.
    pub(crate) checkpoint_io: streambp_core::CheckpointIo,
    /// With --op-times: the parts' calls and seconds in this run.
    pub(crate) op_times: Vec<op_times::OpTime>,
}

/// A synthetic batch of `rows` sequences of `t` tokens and the objective over it.
pub(crate) fn workload(
    objective: &str,
    vocab: usize,
    t: usize,
    group: usize,
    dev: &Device,
) -> anyhow::Result<(Tensor, Box<dyn Objective>)> {
    if !matches!(objective, "sft" | "dpo" | "grpo") {
        bail!("unknown objective {objective} (sft, dpo or grpo)");
    }
    let rows = rows_of(objective, group);
    let ids: Vec<Vec<i64>> = (0..rows)
        .map(|r| {
            (0..t as u64)
                .map(|i| ((i * 2654435761 + r as u64 * 97) >> 7) as i64 % vocab as i64)
                .collect()
        })
        .collect();
    let objective: Box<dyn Objective> = match objective {
        "sft" => Box::new(Sft::new(&ids, vocab, None, dev)?),
        "dpo" => Box::new(Dpo::new(&ids, &[-1000.0], &[-1000.0], 0.1, vocab, dev)?),
        _ => {
            let completion: Vec<Vec<i64>> = (0..rows)
                .map(|_| (0..t).map(|i| (i >= t / 2) as i64).collect())
                .collect();
            let advantages: Vec<f64> = (0..rows)
                .map(|r| if r % 2 == 0 { 1.0 } else { -1.0 })
                .collect();
            let reference: Vec<Vec<f64>> = vec![vec![-5.0; t]; rows];
            Box::new(Grpo::new(
                &GrpoBatch {
                    rollouts: Rollouts {
                        input_ids: &ids,
                        completion_mask: &completion,
                        old_logps: None,
                        ref_logps: Some(&reference),
                    },
                    advantages: &advantages,
                    beta: 0.04,
                    epsilon_low: 0.2,
                    epsilon_high: 0.2,
                    loss_type: GrpoLossType::Grpo,
                    max_completion_length: None,
                    temperature: 1.0,
                    num_items_in_batch: None,
                    use_bias_correction_kl: true,
                    sapo_temperatures: (1.0, 1.05),
                    importance_sampling: Default::default(),
                    vespo_gamma: Default::default(),
                    off_policy_mask_threshold: None,
                    entropy_coef: 0.0,
                    top_entropy_quantile: 1.0,
                    entropy_pool: None,
                    entropy_stats: false,
                },
                vocab,
                dev,
            )?)
        }
    };
    let flat: Vec<u32> = ids.iter().flatten().map(|&v| v as u32).collect();
    Ok((Tensor::from_vec(flat, (rows, t), dev)?, objective))
}

/// One AdamW step on `grads` (moments created for it, learning rate 0): peak bytes above what was live
/// before it, and seconds.
pub(crate) fn optimizer_step(
    model: &Model,
    grads: &[(String, Tensor)],
) -> anyhow::Result<(usize, f64)> {
    let meter = Meter::for_device(model.device());
    let before = meter.current_bytes().unwrap_or(0);
    meter.reset_peak();
    let start = Instant::now();
    let mut adamw = AdamW::new(model.parameters(), AdamWConfig::default())?;
    adamw.apply(grads, 0.0)?;
    model.device().synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    let peak = meter.peak_bytes().unwrap_or(0).saturating_sub(before);
    Ok((peak, seconds))
}

pub(crate) fn run(
    (trained, model): (&str, &Model),
    work: &(Tensor, Box<dyn Objective>),
    mode: Mode,
    chunks: Chunks,
    repeats: usize,
    options: Options,
    with_optimizer: bool,
) -> anyhow::Result<Point> {
    let (ids, objective) = work;
    let t = ids.dim(1)?;
    let mut best: Option<Point> = None;
    for _ in 0..repeats.max(1) {
        let before = Meter::for_device(model.device())
            .current_bytes()
            .unwrap_or(0);
        // Only this run's parts (empty unless --op-times switched the timing on).
        op_times::take();
        let start = Instant::now();
        let out = backward_with(
            model,
            Batch::new(ids, None),
            objective.as_ref(),
            Plan::new(mode, chunks).with(options.clone()),
        )?;
        let seconds = start.elapsed().as_secs_f64();
        let op_times = op_times::take();
        let optimizer = with_optimizer
            .then(|| optimizer_step(model, &out.grads))
            .transpose()?;
        let phases: Vec<_> = out
            .phases
            .phases
            .iter()
            .map(|p| {
                (
                    p.name,
                    p.peak_bytes.unwrap_or(0).saturating_sub(before),
                    p.seconds,
                )
            })
            .collect();
        let peak = phases.iter().map(|(_, b, _)| *b).max().unwrap_or(0);
        if best.as_ref().is_none_or(|b| seconds < b.seconds) {
            best = Some(Point {
                trained: trained.to_string(),
                mode,
                t,
                peak,
                base: before,
                phases,
                seconds,
                loss: out.loss,
                optimizer,
                checkpoint_io: out.checkpoint_io,
                op_times,
            });
        }
    }
    best.context("no run")
}

/// An accelerator that runs out of memory answers with an error, which the bench reports as a result.
pub(crate) fn is_out_of_memory(e: &anyhow::Error) -> bool {
    format!("{e:#}")
        .to_ascii_lowercase()
        .contains("out of memory")
}

/// What the points train: full fine-tuning, and with `--lora-r` a fresh LoRA adapter too.
pub(crate) fn trainings(args: &Args, model: &Model) -> anyhow::Result<Vec<(String, Model)>> {
    if args.lora.adapter.is_some() {
        bail!("--adapter: the bench measures a fresh adapter (--lora-r), not a loaded one");
    }
    // Full fine-tuning, and LoRA on the same weights (a view of them: no second copy).
    let mut trainings = vec![("full".to_string(), model.clone())];
    if let Some(lora) = args.lora.config()? {
        let label = format!("LoRA r={}", lora.r);
        trainings.push((label, model.clone().with_lora(lora, None, 0)?));
    }
    Ok(trainings)
}

/// One short streamed backward, not reported.
pub(crate) fn warm_up(model: &Model) -> anyhow::Result<()> {
    // Warm-up: first-touch costs (thread pools, page faults) out of the timings.
    let warm = Chunks {
        chunk: 64,
        logits_chunk: 64,
    };
    let vocab = model.config.vocab_size;
    run(
        ("full", model),
        &workload("sft", vocab, 128, 1, model.device())?,
        Mode::Stream,
        warm,
        1,
        Options::default(),
        false,
    )?;
    Ok(())
}
