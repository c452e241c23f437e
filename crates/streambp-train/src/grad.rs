//! The `grad` command: one backward on one batch file, every gradient written under its HF name.
//! Other tools rely on its output contract; keep it stable.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use candle_core::{Device, Tensor};
use serde::Serialize;
use streambp_core::{
    backward_with, Batch, CheckpointEvery, ChunkPolicy, Chunks, Frozen, Mode, Options, Plan,
    Problem, Tiers,
};
use streambp_models::{load_model, resolve_adapter_dir, resolve_model_dir, save_safetensors};

use crate::batch_file::{load_batch_with_teacher, Teacher};
use crate::config::LoraArgs;
use crate::device::{parse_device, parse_dtype};
use crate::logprobs::scorer;
use crate::setup::{attach_lora, load_reference};
use crate::teacher::{frozen_memory, load_teacher, teacher_of};
use crate::trainer::dropout_key;
use crate::{Result, TrainError};
use streambp_models::lora::DropoutKey;

/// Default chunk sizes when neither explicit sizes nor a budget are given: the query chunk, in tokens.
pub const DEFAULT_CHUNK: usize = 512;
/// The default LM-head chunk, in positions (see [`DEFAULT_CHUNK`]).
pub const DEFAULT_LOGITS_CHUNK: usize = 128;

/// The flags of `grad`.
#[derive(Debug, Clone, clap::Args)]
pub struct GradArgs {
    /// Batch file (JSON; see docs/grad.md).
    #[arg(long, help_heading = "Data")]
    pub batch: PathBuf,
    /// Model directory (HF format) or hub id.
    #[arg(long, help_heading = "Model")]
    pub model: String,
    /// Compute dtype: f64, f32 or bf16.
    #[arg(long, default_value = "f32", help_heading = "Model")]
    pub dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", help_heading = "Model")]
    pub device: String,
    /// LoRA: the gradient of an adapter's matrices (under their PEFT keys) instead of every weight's.
    #[command(flatten)]
    pub lora: LoraArgs,
    /// Seeds a fresh adapter's initialisation and its dropout masks.
    #[arg(long, default_value_t = 42, help_heading = "Model")]
    pub seed: u64,
    /// Reference model for DPO / GRPO batches that carry no reference log-probs [default: the policy
    /// itself, as TRL's reference is the initial policy].
    #[arg(long, help_heading = "Objective")]
    pub ref_model: Option<String>,
    /// The teacher of a distillation batch (objective distill): a causal LM directory or hub id with
    /// the model's vocabulary, any size; forward only.
    #[arg(long, help_heading = "Objective")]
    pub teacher: Option<String>,
    /// stream (StreamBP), checkpoint (per-layer gradient checkpointing) or full (plain backprop).
    #[arg(long, default_value = "stream", help_heading = "Memory")]
    pub mode: Mode,
    /// Query chunk of the streamed layer backward, in tokens [default: 512, or from --memory-budget].
    #[arg(long, help_heading = "Memory")]
    pub chunk: Option<usize>,
    /// Positions per LM-head chunk [default: 128, or from --memory-budget].
    #[arg(long, help_heading = "Memory")]
    pub logits_chunk: Option<usize>,
    /// Pick the largest chunks whose estimated peak fits this budget (e.g. 8GiB).
    #[arg(long, value_parser = crate::device::parse_budget, help_heading = "Memory")]
    pub memory_budget: Option<u64>,
    /// With --memory-budget on an accelerator: host memory the plan may keep checkpoints in.
    #[arg(long, value_parser = crate::device::parse_budget, help_heading = "Memory")]
    pub host_memory_budget: Option<u64>,
    /// Keep layer checkpoints in host memory (accelerator memory then no longer grows with L × T × d).
    #[arg(long, help_heading = "Memory")]
    pub offload_checkpoints: bool,
    /// Store every K-th layer's input only and recompute the others' in the backward, a segment at
    /// a time (`sqrt`: K = ⌈√layers⌉); the same gradients.
    #[arg(long, default_value = "1", help_heading = "Memory")]
    pub checkpoint_every: CheckpointEvery,
    /// Keep the stored checkpoints in a scratch file in this directory instead of memory.
    #[arg(long, help_heading = "Memory")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Output safetensors file.
    #[arg(long, help_heading = "Output")]
    pub out: PathBuf,
}

/// The one JSON line `grad` prints.
#[derive(Debug, Clone, Serialize)]
pub struct GradReport {
    /// The objective's loss on the batch.
    pub loss: f64,
    /// `stream`, `checkpoint` or `full`.
    pub mode: String,
    /// Peak host heap bytes during the backward (null on CUDA or without the counting allocator).
    pub peak_bytes: Option<usize>,
    /// Wall-clock seconds of the backward (loading and writing not included).
    pub seconds: f64,
    /// Real (unpadded) tokens in the batch.
    pub tokens: usize,
    /// The query chunk used, in tokens (given, default or planned from the budget).
    pub chunk: usize,
    /// The LM-head chunk used, in positions.
    pub logits_chunk: usize,
    /// The objective's metrics (DPO rewards and accuracy, GRPO clip ratio and KL).
    pub metrics: serde_json::Map<String, serde_json::Value>,
}

impl GradArgs {
    /// Checks the flags before anything is loaded: chunks of at least 1, an output file whose directory
    /// exists.
    pub fn validate(&self) -> Result<()> {
        for (flag, value) in [
            ("--chunk", self.chunk),
            ("--logits-chunk", self.logits_chunk),
        ] {
            match value {
                Some(0) => return Err(TrainError::flag(flag, 0, "must be at least 1")),
                Some(v) if self.memory_budget.is_some() => {
                    return Err(TrainError::flag(
                        flag,
                        v,
                        "--memory-budget picks the chunks: give one or the other",
                    ))
                }
                _ => {}
            }
        }
        let input = |e: streambp_models::ModelError| match e {
            streambp_models::ModelError::Input(reason) => reason,
            other => other.to_string(),
        };
        if let (Some(adapter), Some(_)) = (&self.lora.adapter, self.lora.lora_r) {
            return Err(TrainError::flag(
                "--adapter",
                adapter,
                "brings its own r, alpha and targets: give it without --lora-r",
            ));
        }
        parse_dtype(&self.dtype).map_err(|e| TrainError::flag("--dtype", &self.dtype, input(e)))?;
        parse_device(&self.device)
            .map_err(|e| TrainError::flag("--device", &self.device, input(e)))?;
        if let Some(why) = crate::input_file::check(&self.batch, crate::batch_file::MAX_BYTES) {
            return Err(TrainError::flag("--batch", self.batch.display(), why));
        }
        let out = &self.out;
        if out.is_dir() {
            return Err(TrainError::flag(
                "--out",
                out.display(),
                "is a directory; expected a file",
            ));
        }
        let dir = match out.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => std::path::Path::new("."),
        };
        if !dir.is_dir() {
            return Err(TrainError::flag(
                "--out",
                out.display(),
                format!("its directory {} does not exist", dir.display()),
            ));
        }
        Ok(())
    }
}

/// The chunks and options of `grad`'s backward of a `[b, t]` batch: the flags' chunks (`given`,
/// defaults filled in), or the planner's for `--memory-budget` where no chunk is given.
fn plan(
    args: &GradArgs,
    model: &streambp_models::Model,
    (b, t): (usize, usize),
    given: Chunks,
    (frozen, objective): (Frozen, &dyn streambp_objectives::Objective),
) -> Result<(Chunks, Options)> {
    let options = Options {
        offload_checkpoints: args.offload_checkpoints,
        checkpoint_every: args.checkpoint_every,
        checkpoint_dir: args.checkpoint_dir.as_deref().map(Into::into),
        dropout: Some(DropoutKey {
            key: dropout_key(args.seed, 0, 0),
            first_row: 0,
        }),
    };
    // A budget picks the chunks unless they are given.
    let policy = match (args.chunk, args.logits_chunk, args.memory_budget) {
        (None, None, Some(budget)) => {
            ChunkPolicy::Budget(budget, Tiers::of(&options, args.host_memory_budget))
        }
        _ => ChunkPolicy::Fixed(given),
    };
    let problem = Problem::of(model, b, t, &options)
        .with_frozen(frozen)
        .with_objective(objective);
    let planned = policy.plan_for(problem)?;
    let (chunks, options) = (planned.chunks, planned.options(options));
    tracing::info!(
        ?chunks,
        checkpoint_every = planned.checkpoint_every,
        mode = %args.mode,
        batch = b,
        seq_len = t,
        "backward"
    );
    Ok((chunks, options))
}

/// Every gradient under its name and the loss as `loss` (`[1]`, in `dtype`), on the host, written
/// to `out` atomically.
fn save_gradients(
    grads: &[(String, Tensor)],
    loss: f64,
    dtype: candle_core::DType,
    out: &std::path::Path,
) -> Result<()> {
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (name, g) in grads {
        tensors.insert(name.clone(), g.to_device(&Device::Cpu)?);
    }
    tensors.insert(
        "loss".into(),
        Tensor::new(&[loss], &Device::Cpu)?.to_dtype(dtype)?,
    );
    save_safetensors(&tensors, out)?;
    Ok(())
}

/// Runs `grad`: loads the model (and reference), reads the batch file, runs one backward and writes
/// every gradient under its HF name, plus the loss as `loss`, to `--out`; returns the line to print.
pub fn run_grad(args: &GradArgs) -> Result<GradReport> {
    args.validate()?;
    let device = parse_device(&args.device)?;
    let dtype = parse_dtype(&args.dtype)?;
    let dir = resolve_model_dir(&args.model)?;
    let adapter = args
        .lora
        .adapter
        .as_deref()
        .map(resolve_adapter_dir)
        .transpose()?;
    let lora = args.lora.config()?;
    let model = attach_lora(load_model(&dir, dtype, &device)?, adapter, lora, args.seed)?;
    // TRL's reference: the initial policy, which for a LoRA model is its base with the adapter off.
    let ref_model = match &args.ref_model {
        Some(spec) => Some(load_reference(spec, &model, None)?),
        None => model.lora().map(|_| model.without_adapters()),
    };
    let reference_chunks = Chunks {
        chunk: args.chunk.unwrap_or(DEFAULT_CHUNK),
        logits_chunk: args.logits_chunk.unwrap_or(DEFAULT_LOGITS_CHUNK),
    };
    let mut reference = scorer(
        ref_model.as_ref().unwrap_or(&model),
        |_| Ok(reference_chunks),
        None,
    );
    let teacher = args
        .teacher
        .as_deref()
        .map(|spec| load_teacher(spec, &model))
        .transpose()?;
    let mut make_teacher = teacher.as_ref().map(|t| teacher_of(t, reference_chunks));
    let with_teacher = make_teacher.as_mut().map(|t| t as &mut Teacher);
    let batch = load_batch_with_teacher(
        &args.batch,
        &model.config,
        &device,
        &mut reference,
        with_teacher,
    )?;
    if let (Some(spec), false) = (&args.teacher, batch.objective.reads_logits()) {
        return Err(TrainError::flag(
            "--teacher",
            spec,
            format!(
                "applies to objective distill only, not {}",
                batch.objective.name()
            ),
        ));
    }
    let (b, t) = batch.input_ids.dims2()?;
    // A --ref-model's weights stay loaded through the backward (LoRA's base is the model's own).
    let frozen = match (&teacher, &args.ref_model, &ref_model) {
        (Some(t), _, _) => frozen_memory(t, &model),
        (None, Some(_), Some(r)) => Frozen::weights(&r.config, r.dtype()),
        _ => Frozen::default(),
    };
    let objective = batch.objective.as_ref();
    let (chunks, options) = plan(args, &model, (b, t), reference_chunks, (frozen, objective))?;
    let start = Instant::now();
    let out = backward_with(
        &model,
        Batch {
            input_ids: &batch.input_ids,
            attention_mask: batch.attention_mask.as_ref(),
            position_ids: batch.position_ids.as_ref(),
        },
        batch.objective.as_ref(),
        Plan::new(args.mode, chunks).with(options),
    )?;
    let seconds = start.elapsed().as_secs_f64();
    for phase in &out.phases.phases {
        tracing::info!(
            phase = phase.name,
            seconds = phase.seconds,
            peak_mib = phase.peak_bytes.map(|b| b as f64 / (1 << 20) as f64),
            "phase"
        );
    }

    save_gradients(&out.grads, out.loss, dtype, &args.out)?;
    Ok(GradReport {
        loss: out.loss,
        mode: args.mode.to_string(),
        peak_bytes: if device.is_cpu() {
            out.phases.overall_peak()
        } else {
            None
        },
        seconds,
        tokens: batch.tokens,
        chunk: chunks.chunk,
        logits_chunk: chunks.logits_chunk,
        metrics: out
            .metrics
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::json!(v)))
            .collect(),
    })
}
