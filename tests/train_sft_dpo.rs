//! The SFT trainer end to end on small runs: it learns, its checkpoints load as HF models, the engine's
//! modes train identically, and bad data is reported by line.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use streambp_core::Mode;
use streambp_train::config::{BuiltinModel, Recipe, TrainConfig};
use streambp_train::data::Overflow;
use streambp_train::optim::Schedule;
use streambp_train::sft::run_sft;
use streambp_train::tensorboard::read_scalars;

// As in the binary: the steps' peak memory is counted (metrics.jsonl, TensorBoard).
#[global_allocator]
static ALLOC: streambp_core::memory::CountingAllocator = streambp_core::memory::CountingAllocator;

/// A 12-step SFT run on the built-in task, small enough for a test.
fn config(out: &Path) -> TrainConfig {
    TrainConfig {
        output_dir: out.to_path_buf(),
        max_steps: Some(12),
        batch_size: 16,
        grad_accum: 2,
        weight_decay: 0.01,
        warmup_steps: 2,
        seed: 3,
        chunk: 4,
        logits_chunk: 5,
        save_every: 5,
        progress: false,
        ..TrainConfig::defaults(Recipe::Sft, true)
    }
}

fn losses(dir: &Path) -> Vec<f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64())
        .collect()
}

#[test]
fn builtin_task_learns_and_saves_hf_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let summary = run_sft(&config(dir.path())).unwrap();
    assert_eq!(summary.steps, 12);
    assert!(summary.last_loss < 0.8 * summary.first_loss, "{summary:?}");
    let losses = losses(dir.path());
    assert_eq!(losses.len(), 12);
    // Intermediate and final checkpoints load as HF model directories with the trained weights.
    for ckpt in ["checkpoint-5", "checkpoint-10", "final"] {
        let path = dir.path().join(ckpt);
        for f in [
            "model.safetensors",
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ] {
            assert!(path.join(f).exists(), "{ckpt}/{f}");
        }
        let model = streambp_models::load_model(&path, DType::F32, &Device::Cpu).unwrap();
        assert!(
            model
                .parameters()
                .iter()
                .all(|(n, _)| n != "lm_head.weight"),
            "tied: one table"
        );
    }
    // No temporary directories left behind.
    let leftovers: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// Pure bf16 (weights and activations in bf16; gradients accumulated and optimizer state kept in f32):
/// it learns, and its checkpoints are bf16 safetensors whose config says so.
#[test]
fn bf16_training_learns_and_saves_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.dtype = "bf16".into();
    cfg.save_every = 0;
    let summary = run_sft(&cfg).unwrap();
    assert!(summary.last_loss < 0.8 * summary.first_loss, "{summary:?}");
    let ckpt = dir.path().join("final");
    let model = streambp_models::load_model(&ckpt, DType::BF16, &Device::Cpu).unwrap();
    assert!(model
        .parameters()
        .iter()
        .all(|(_, v)| v.dtype() == DType::BF16));
    let bytes = std::fs::read(ckpt.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8_lossy(&bytes[8..8 + header_len]);
    assert!(
        header.contains("BF16") && !header.contains("F32"),
        "{header}"
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
}

/// StreamBP is exact, so training with it follows the same loss curve as plain backprop.
#[test]
fn stream_and_full_backward_train_identically() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut cfg = config(a.path());
    cfg.max_steps = Some(6);
    cfg.save_every = 0;
    run_sft(&cfg).unwrap();
    cfg.output_dir = b.path().to_path_buf();
    cfg.mode = Mode::Full;
    run_sft(&cfg).unwrap();
    // Chunks planned for a memory budget, layer checkpoints offloaded: still the same curve.
    let c = tempfile::tempdir().unwrap();
    cfg.output_dir = c.path().to_path_buf();
    cfg.mode = Mode::Stream;
    cfg.memory_budget = Some(64 << 20);
    cfg.offload_checkpoints = true;
    run_sft(&cfg).unwrap();
    let full = losses(b.path());
    assert_eq!(full.len(), 6);
    for run in [a.path(), c.path()] {
        for (x, y) in losses(run).iter().zip(&full) {
            assert!((x - y).abs() < 1e-4 * y.abs(), "{x} vs {y}");
        }
    }
}

fn run_on(data: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data.jsonl");
    std::fs::write(&path, data).unwrap();
    let mut cfg = config(&dir.path().join("out"));
    cfg.data = Some(path);
    cfg.max_steps = Some(1);
    cfg.batch_size = 1;
    cfg.grad_accum = 1;
    match run_sft(&cfg) {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_data_is_reported_by_line() {
    let good = "{\"prompt\": \"1+2=\", \"completion\": \"3\"}\n";
    let err = run_on(&format!(
        "{good}{good}{{\"prompt\": \"1+2=\", \"completion\": \n"
    ));
    assert!(
        err.contains("line 3") && err.contains("not valid JSON"),
        "{err}"
    );
    let err = run_on(&format!("{good}{{\"question\": \"1+2=\"}}\n"));
    assert!(
        err.contains("line 2")
            && err.contains("\"prompt\" and \"completion\", or a \"text\" string"),
        "{err}"
    );
    let err = run_on("\n\n");
    assert!(err.contains("no examples"), "{err}");
    let err = run_on(&format!(
        "{good}{{\"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}, {{\"role\": \"assistant\", \"content\": \"yo\"}}]}}\n"
    ));
    assert!(
        err.contains("line 2") && err.contains("chat template"),
        "{err}"
    );
    assert_eq!(run_on(&format!("{good}{{\"text\": \"12+3=15\"}}\n")), "");
}

#[test]
fn overlong_examples_are_skipped_or_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let builtin = streambp_train::setup::materialize_builtin(dir.path()).unwrap();
    let tok = streambp_train::tokenizer::TextTokenizer::from_dir(&builtin).unwrap();
    let path = dir.path().join("d.jsonl");
    let source = |p: &Path| streambp_train::dataset::DataSource::file(p).unwrap();
    std::fs::write(
        &path,
        "{\"prompt\": \"12+34=\", \"completion\": \"46\"}\n{\"text\": \"1+1=2\"}\n",
    )
    .unwrap();
    let skip =
        streambp_train::data::load_sft(&source(&path), &tok, 6, Overflow::Skip, "text").unwrap();
    assert_eq!(skip.len(), 1);
    let cut = streambp_train::data::load_sft(&source(&path), &tok, 8, Overflow::Truncate, "text")
        .unwrap();
    assert_eq!(cut.len(), 2);
    assert_eq!(cut[0].input_ids.len(), 8);
    // prompt tokens carry no loss; the completion ends with EOS.
    let full = streambp_train::data::load_sft(&source(&path), &tok, 64, Overflow::Truncate, "text")
        .unwrap();
    assert_eq!(full[0].labels[..6], [-100; 6]);
    assert_eq!(*full[0].input_ids.last().unwrap(), tok.eos_id);

    // DPO pairs: cut to their first tokens per side (TRL's keep_start) or skipped; a pair whose
    // completion would be cut away entirely is skipped either way.
    use streambp_train::recipes::pairs::load_pairs;
    std::fs::write(
        &path,
        "{\"prompt\": \"12+34=\", \"chosen\": \"46\", \"rejected\": \"47\"}\n",
    )
    .unwrap();
    let cut = load_pairs(&source(&path), &tok, 8, Overflow::Truncate).unwrap();
    assert_eq!(cut[0].chosen.input_ids.len(), 8);
    assert_eq!(cut[0].rejected.input_ids.len(), 8);
    assert_eq!(cut[0].chosen.targets(), 2);
    let skip = load_pairs(&source(&path), &tok, 8, Overflow::Skip)
        .err()
        .unwrap();
    assert!(skip.to_string().contains("no pairs left"), "{skip}");
    let nothing_left = load_pairs(&source(&path), &tok, 6, Overflow::Truncate)
        .err()
        .unwrap();
    assert!(
        nothing_left.to_string().contains("no pairs left"),
        "{nothing_left}"
    );
    assert_eq!(
        load_pairs(&source(&path), &tok, 9, Overflow::Skip)
            .unwrap()
            .len(),
        1
    );
}

/// A run stopped after a checkpoint and resumed from it follows the uninterrupted run's loss curve:
/// weights, optimizer moments, schedule position and data order all continue.
#[test]
fn resumed_run_gives_the_same_loss_curve() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut cfg = config(a.path());
    cfg.max_steps = Some(10);
    cfg.save_every = 4;
    cfg.batch_size = 100;
    run_sft(&cfg).unwrap();
    let whole = losses(a.path());

    let mut resumed = config(b.path());
    resumed.max_steps = Some(10);
    resumed.save_every = 4;
    resumed.batch_size = 100;
    resumed.resume = Some(a.path().join("checkpoint-4"));
    run_sft(&resumed).unwrap();
    let tail = losses(b.path());
    assert_eq!(tail.len(), 6, "steps 5..=10");
    for (i, (x, y)) in whole[4..].iter().zip(&tail).enumerate() {
        assert!(
            (x - y).abs() <= 1e-6 * x.abs(),
            "step {}: {x} vs {y}",
            i + 5
        );
    }
    // Resuming from something that is not a checkpoint says so.
    let mut bad = config(b.path());
    bad.resume = Some(a.path().join("final"));
    let err = run_sft(&bad).unwrap_err().to_string();
    assert!(err.contains("not a resumable checkpoint"), "{err}");
}

/// A resumed DPO run scores against the model the run began with (not the checkpoint's), so it follows
/// the uninterrupted run's losses to the last bit.
#[test]
fn resumed_dpo_run_keeps_its_reference() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut cfg = config(a.path());
    cfg.builtin_model = BuiltinModel::Sft;
    cfg.max_steps = Some(4);
    cfg.save_every = 2;
    cfg.batch_size = 8;
    cfg.grad_accum = 1;
    cfg.lr = 2e-3;
    cfg.data = None;
    streambp_train::dpo::run_dpo(&cfg).unwrap();
    cfg.output_dir = b.path().to_path_buf();
    cfg.resume = Some(a.path().join("checkpoint-2"));
    streambp_train::dpo::run_dpo(&cfg).unwrap();
    let (whole, tail) = (losses(a.path()), losses(b.path()));
    assert_eq!(tail.len(), 2);
    assert_eq!(whole[2..], tail[..]);
}

/// Eight pairs `i+i=`: `2i` chosen over `2i + 1`, in `dir/pairs.jsonl`.
fn fixed_pairs(dir: &Path) -> PathBuf {
    let data = dir.join("pairs.jsonl");
    let pairs: String = (0..8)
        .map(|i| {
            format!(
                "{{\"prompt\": \"{i}+{i}=\", \"chosen\": \"{}\", \"rejected\": \"{}\"}}\n",
                2 * i,
                2 * i + 1
            )
        })
        .collect();
    std::fs::write(&data, pairs).unwrap();
    data
}

/// ORPO and CPO (SimPO) on the fixed pairs: the loss falls and every held-out pair (here the training
/// pairs) ends preferred; a checkpoint records CPO's settings.
#[test]
fn orpo_and_cpo_learn_fixed_preferences() {
    use streambp_objectives::{CpoLoss, CpoLossType};
    let dir = tempfile::tempdir().unwrap();
    let data = fixed_pairs(dir.path());
    let simpo = CpoLoss {
        loss_type: CpoLossType::Simpo,
        cpo_alpha: 0.0,
        ..CpoLoss::default()
    };
    for (recipe, loss) in [
        (Recipe::Orpo, CpoLoss::default()),
        (Recipe::Cpo, CpoLoss::default()),
        (Recipe::Cpo, simpo),
    ] {
        let out = dir
            .path()
            .join(format!("{}-{:?}", recipe.name(), loss.loss_type));
        let mut cfg = TrainConfig {
            data: Some(data.clone()),
            eval_data: Some(data.clone()),
            max_steps: Some(25),
            batch_size: 8,
            grad_accum: 1,
            lr: 1e-3,
            schedule: Schedule::Constant,
            save_every: 20,
            cpo_loss: loss,
            ..config(&out)
        };
        if loss.loss_type == CpoLossType::Simpo {
            cfg.beta = 2.0;
        }
        let summary = match recipe {
            Recipe::Orpo => streambp_train::orpo::run_orpo(&cfg),
            _ => streambp_train::cpo::run_cpo(&cfg),
        }
        .unwrap();
        let accuracy = |list: &[(String, f64)]| {
            list.iter()
                .find(|(n, _)| n == "preference_accuracy")
                .map(|(_, v)| *v)
                .unwrap()
        };
        let what = format!("{} {:?}: {summary:?}", recipe.name(), loss.loss_type);
        assert!(summary.last_loss < summary.first_loss, "{what}");
        assert_eq!(accuracy(&summary.after), 1.0, "{what}");
        let state = out
            .join("checkpoint-20")
            .join(streambp_train::checkpoint::STATE_FILE);
        let record = std::fs::read_to_string(state).unwrap_or_else(|e| panic!("{what}: {e}"));
        if recipe == Recipe::Cpo {
            assert!(record.contains("--cpo-alpha"), "{record}");
            assert!(record.contains(loss.loss_type.name()), "{record}");
        }
    }
}

/// KTO on fixed unpaired rows (TRL's prompt/completion/label, the desirable and undesirable answers
/// of each prompt in separate rows) and on the same rows as pairs, unpaired: the loss falls, the
/// held-out pairs end preferred over the reference, and a row without a boolean label is reported by
/// line.
#[test]
fn kto_learns_unpaired_rows_and_reports_bad_ones() {
    let dir = tempfile::tempdir().unwrap();
    let pairs = fixed_pairs(dir.path());
    let unpaired = dir.path().join("unpaired.jsonl");
    let rows: String = (0..8)
        .flat_map(|i| {
            let row = |answer: usize, label: bool| {
                format!("{{\"prompt\": \"{i}+{i}=\", \"completion\": \"{answer}\", \"label\": {label}}}\n")
            };
            [row(2 * i, true), row(2 * i + 1, false)]
        })
        .collect();
    std::fs::write(&unpaired, &rows).unwrap();
    for data in [&unpaired, &pairs] {
        let cfg = TrainConfig {
            data: Some(data.clone()),
            eval_data: Some(pairs.clone()),
            max_steps: Some(25),
            batch_size: 8,
            grad_accum: 1,
            lr: 1e-3,
            schedule: Schedule::Constant,
            save_every: 0,
            ..config(&dir.path().join("out"))
        };
        let cfg = TrainConfig {
            overwrite_output_dir: true,
            ..cfg
        };
        let summary = streambp_train::kto::run_kto(&cfg).unwrap();
        let accuracy = summary
            .after
            .iter()
            .find(|(n, _)| n == "preference_accuracy")
            .map(|(_, v)| *v);
        assert!(summary.last_loss < summary.first_loss, "{summary:?}");
        assert_eq!(accuracy, Some(1.0), "{summary:?}");
    }
    std::fs::write(
        &unpaired,
        format!("{rows}{{\"prompt\": \"1+1=\", \"completion\": \"2\", \"label\": 1}}\n"),
    )
    .unwrap();
    let cfg = TrainConfig {
        data: Some(unpaired),
        overwrite_output_dir: true,
        ..config(&dir.path().join("out"))
    };
    let err = streambp_train::kto::run_kto(&cfg).unwrap_err().to_string();
    assert!(
        err.contains("line 17") && err.contains("\"label\" is 1"),
        "{err}"
    );
}

/// A reward model from the built-in causal model (a fresh score head) on the fixed pairs: the loss
/// falls, every held-out pair (the training pairs) ends ranked right, and the final checkpoint is a
/// transformers sequence classifier (its config and `score.weight`) that loads back as one. The data
/// carries TRL's margin column, which must be on every pair or none.
#[test]
fn reward_model_learns_fixed_preferences_and_saves_a_classifier() {
    let dir = tempfile::tempdir().unwrap();
    let pairs = fixed_pairs(dir.path());
    // TRL's margin column: each chosen reward must beat its rejected one by 0.5.
    let data = dir.path().join("margins.jsonl");
    let with_margins: String = std::fs::read_to_string(&pairs)
        .unwrap()
        .lines()
        .map(|l| format!("{}, \"margin\": 0.5}}\n", l.trim_end_matches('}')))
        .collect();
    std::fs::write(&data, &with_margins).unwrap();
    let out = dir.path().join("out");
    let cfg = TrainConfig {
        data: Some(data.clone()),
        eval_data: Some(pairs),
        max_steps: Some(40),
        batch_size: 8,
        grad_accum: 1,
        lr: 1e-3,
        schedule: Schedule::Constant,
        save_every: 0,
        center_rewards_coefficient: Some(0.01),
        ..config(&out)
    };
    // By default a pair longer than --max-length is dropped, as TRL's RewardTrainer drops it.
    let defaults = TrainConfig::defaults(Recipe::Reward, false);
    assert_eq!(defaults.overflow, streambp_train::data::Overflow::Skip);
    let summary = streambp_train::reward::run_reward(&cfg).unwrap();
    let accuracy = |list: &[(String, f64)]| {
        list.iter()
            .find(|(n, _)| n == "preference_accuracy")
            .map(|(_, v)| *v)
    };
    assert!(summary.last_loss < summary.first_loss, "{summary:?}");
    assert_eq!(accuracy(&summary.after), Some(1.0), "{summary:?}");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("final/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["architectures"][0], "Qwen3ForSequenceClassification");
    assert_eq!(config["id2label"].as_object().map(|m| m.len()), Some(1));
    let model = streambp_models::load_model(&out.join("final"), DType::F32, &Device::Cpu).unwrap();
    assert!(model.scores_positions());
    assert!(model.weights().iter().any(|(n, _)| n == "score.weight"));
    assert!(!model.weights().iter().any(|(n, _)| n == "lm_head.weight"));

    // A margin on some pairs only is refused, naming the row.
    let first_without = with_margins.replacen(", \"margin\": 0.5", "", 1);
    std::fs::write(
        &data,
        format!(
            "{}{first_without}",
            with_margins.lines().next().unwrap().to_owned() + "\n"
        ),
    )
    .unwrap();
    let cfg = TrainConfig {
        overwrite_output_dir: true,
        ..cfg
    };
    let err = streambp_train::reward::run_reward(&cfg)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("line 2") && err.contains("on every pair or on none"),
        "{err}"
    );
}

/// DPO on a few fixed pairs learns to prefer the chosen answers (the loss falls, margins grow), and a
/// malformed pair is reported by line.
#[test]
fn dpo_learns_fixed_preferences_and_reports_bad_pairs() {
    let dir = tempfile::tempdir().unwrap();
    let data = fixed_pairs(dir.path());
    let mut cfg = config(&dir.path().join("out"));
    cfg.data = Some(data.clone());
    cfg.max_steps = Some(25);
    cfg.batch_size = 8;
    cfg.grad_accum = 1;
    cfg.lr = 1e-3;
    cfg.schedule = Schedule::Constant;
    cfg.save_every = 0;
    // Held-out pairs (here the training pairs) scored by preference accuracy every 10 steps.
    cfg.eval_data = Some(data.clone());
    cfg.eval_every = 10;
    let summary = streambp_train::dpo::run_dpo(&cfg).unwrap();
    let eval: Vec<(i64, f64)> = std::fs::read_to_string(dir.path().join("out/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|r| Some((r["step"].as_i64()?, r["eval_preference_accuracy"].as_f64()?)))
        .collect();
    assert_eq!(
        eval.iter().map(|e| e.0).collect::<Vec<_>>(),
        [0, 10, 20, 25],
        "{eval:?}"
    );
    assert_eq!(eval[0].1, 0.0, "ties: the policy starts as its reference");
    assert_eq!(eval[3].1, 1.0, "{eval:?}");
    assert!(
        (summary.first_loss - std::f64::consts::LN_2).abs() < 1e-4,
        "policy = reference at start"
    );
    assert!(summary.last_loss < 0.5, "{summary:?}");
    let last: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(dir.path().join("out/metrics.jsonl"))
            .unwrap()
            .lines()
            .rfind(|l| l.contains("\"loss\""))
            .unwrap(),
    )
    .unwrap();
    assert!(last["rewards/margins"].as_f64().unwrap() > 0.5, "{last}");
    assert_eq!(last["rewards/accuracies"].as_f64().unwrap(), 1.0);
    // TensorBoard shows the rewards as metrics.jsonl has them.
    let scalars = read_scalars(&dir.path().join("out")).unwrap();
    let margins: Vec<_> = scalars
        .iter()
        .filter(|(tag, _, _)| tag == "train/rewards/margins")
        .collect();
    assert_eq!(margins.len(), 25);
    let logged = last["rewards/margins"].as_f64().unwrap() as f32;
    assert_eq!(margins.last().map(|m| (m.1, m.2)), Some((25, logged)));

    let pairs = std::fs::read_to_string(&data).unwrap();
    std::fs::write(
        &data,
        format!("{pairs}{{\"prompt\": \"1+1=\", \"chosen\": \"2\"}}\n"),
    )
    .unwrap();
    // Into the same output directory: the earlier run's outputs go.
    cfg.overwrite_output_dir = true;
    let err = streambp_train::dpo::run_dpo(&cfg).unwrap_err().to_string();
    assert!(
        err.contains("line 9") && err.contains("\"rejected\""),
        "{err}"
    );
}

/// The built-in DPO run: the shipped SFT checkpoint (71% held-out accuracy) refined with the sigmoid + SFT
/// loss ranks held-out correct answers above wrong ones more often than chance, without losing accuracy.
#[test]
fn builtin_dpo_from_the_shipped_sft_model_learns_held_out_preferences() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.builtin_model = BuiltinModel::Sft;
    cfg.max_steps = Some(60);
    cfg.batch_size = 32;
    cfg.grad_accum = 1;
    cfg.lr = 2e-4;
    cfg.warmup_steps = 0;
    cfg.weight_decay = 0.0;
    cfg.sft_weight = 1.0;
    cfg.save_every = 0;
    let summary = streambp_train::dpo::run_dpo(&cfg).unwrap();
    let metric = |list: &[(String, f64)], name: &str| {
        list.iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
            .unwrap()
    };
    assert!(metric(&summary.before, "accuracy") > 0.6, "{summary:?}");
    assert!(metric(&summary.after, "accuracy") > 0.6, "{summary:?}");
    assert!(
        metric(&summary.after, "preference_accuracy") > 0.55,
        "{summary:?}"
    );
}

/// Best-fit decreasing packing: every example once, rows within the limit, positions restarting and
/// no target at a document's first token; the packed run learns.
#[test]
fn packing_fits_examples_into_rows_and_trains() {
    use streambp_train::data::{pack, Example};
    let example = |n: u32| Example::new((1..=n).collect(), (1..=n).map(i64::from).collect());
    let examples: Vec<Example> = [5, 3, 4, 2, 6, 8].into_iter().map(example).collect();
    let targets: usize = examples.iter().map(Example::targets).sum();
    let rows = pack(examples, 8);
    assert_eq!(rows.len(), 4, "8 | 6+2 | 5+3 | 4");
    assert_eq!(rows.iter().map(Example::targets).sum::<usize>(), targets);
    let mut lengths = Vec::new();
    for row in &rows {
        assert!(row.input_ids.len() <= 8);
        for (i, &p) in row.position_ids.iter().enumerate() {
            if p == 0 {
                assert_eq!(row.labels[i], -100, "{row:?}");
                let n = row.position_ids[i..]
                    .iter()
                    .enumerate()
                    .take_while(|&(k, &q)| k as u32 == q)
                    .count();
                lengths.push(n);
                assert_eq!(row.input_ids[i..i + n], (1..=n as u32).collect::<Vec<_>>());
            }
        }
    }
    lengths.sort();
    assert_eq!(lengths, [2, 3, 4, 5, 6, 8]);

    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.packing = true;
    cfg.save_every = 0;
    let summary = run_sft(&cfg).unwrap();
    assert!(summary.last_loss < 0.8 * summary.first_loss, "{summary:?}");
}

/// `--eval-every`: the held-out loss and accuracy at step 0, every N steps and at the end, in
/// metrics.jsonl beside the training rows and in the TensorBoard event file, which parses back with
/// every logged scalar.
#[test]
fn eval_every_and_tensorboard_log_what_metrics_jsonl_logs() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.max_steps = Some(5);
    cfg.save_every = 0;
    cfg.eval_every = 2;
    run_sft(&cfg).unwrap();
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(dir.path().join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let eval: Vec<_> = rows
        .iter()
        .filter(|r| r.get("eval_loss").is_some())
        .collect();
    let steps: Vec<u64> = eval.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [0, 2, 4, 5], "before, every 2 steps, at the end");
    let eval_loss: Vec<f64> = eval
        .iter()
        .map(|r| r["eval_loss"].as_f64().unwrap())
        .collect();
    assert!(eval_loss[3] < 0.8 * eval_loss[0], "{eval_loss:?}");
    assert!(eval.iter().all(|r| r["eval_accuracy"].as_f64().is_some()));

    let scalars = read_scalars(dir.path()).unwrap();
    let series = |tag: &str| -> Vec<(i64, f32)> {
        scalars
            .iter()
            .filter(|(t, _, _)| t == tag)
            .map(|(_, step, v)| (*step, *v))
            .collect()
    };
    let train: Vec<_> = rows.iter().filter(|r| r.get("loss").is_some()).collect();
    for (tag, key) in [
        ("train/loss", "loss"),
        ("train/lr", "lr"),
        ("train/grad_norm", "grad_norm"),
        ("train/tokens_per_sec", "tokens_per_sec"),
    ] {
        let want: Vec<(i64, f32)> = train
            .iter()
            .map(|r| (r["step"].as_i64().unwrap(), r[key].as_f64().unwrap() as f32))
            .collect();
        assert_eq!(series(tag), want, "{tag}");
    }
    let peak_mib: Vec<(i64, f32)> = train
        .iter()
        .map(|r| {
            let bytes = r["peak_bytes"].as_f64().unwrap();
            assert!(bytes > 0.0, "{r}");
            (
                r["step"].as_i64().unwrap(),
                (bytes / (1u64 << 20) as f64) as f32,
            )
        })
        .collect();
    assert_eq!(series("train/peak_mib"), peak_mib);
    let want: Vec<(i64, f32)> = eval
        .iter()
        .map(|r| {
            (
                r["step"].as_i64().unwrap(),
                r["eval_loss"].as_f64().unwrap() as f32,
            )
        })
        .collect();
    assert_eq!(series("eval/loss"), want);
    assert_eq!(series("eval/accuracy").len(), 4);
}
