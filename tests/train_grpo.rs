//! GRPO's pieces: the KV-cache sampler agrees with uncached decoding (every family, Gemma3's sliding
//! window included), rewards and advantages follow TRL, and a short run raises the reward.

mod common;

use common::*;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use streambp_models::init::NormalRng;
use streambp_models::load_model;
use streambp_train::config::{AdaptiveEntropy, GrpoConfig, Recipe, TrainConfig};
use streambp_train::grpo::run_grpo;
use streambp_train::optim::Schedule;
use streambp_train::rewards::{
    group_advantages, group_without_signal, parse_reward, scaled_advantages, std_from_sums,
    ScaleRewards,
};
use streambp_train::sampling::{sample_group, sample_groups, SamplingConfig};

#[test]
fn cached_greedy_sampling_matches_uncached_decoding() {
    for family in ["qwen2", "qwen3", "llama3", "gemma3"] {
        let model = load_model(&fixture_dir(family), DType::F64, &Device::Cpu).unwrap();
        let prompt = [5u32, 17, 42];
        let eos = 95; // an id the tiny random models are unlikely to pick: decode runs long
        let greedy = SamplingConfig {
            temperature: 0.0,
            top_p: 1.0,
            max_new_tokens: 9,
        };
        let mut rng = NormalRng::new(0);
        let cached = sample_group(&model, &prompt, 2, eos, &greedy, &mut rng).unwrap();
        let uncached = streambp_train::generate::greedy(&model, &prompt, eos, 9).unwrap();
        assert_eq!(cached[0], uncached, "{family}");
        assert_eq!(
            cached[1], uncached,
            "{family}: rows of a group are independent"
        );
    }
}

/// Prompts of different lengths sampled together (left-padded, one forward per new token) draw what
/// each draws alone: the pads are invisible and rope counts from each prompt's first token (Gemma3's
/// sliding window of 4 included).
#[test]
fn batched_sampling_matches_each_prompt_alone() {
    let prompts: [&[u32]; 3] = [&[5, 17, 42, 7, 9, 11], &[3], &[8, 2, 30]];
    let cfg = SamplingConfig {
        temperature: 1.0,
        top_p: 0.9,
        max_new_tokens: 7,
    };
    let eos = 95;
    for family in ["qwen2", "qwen3", "llama3", "gemma3"] {
        let model = load_model(&fixture_dir(family), DType::F64, &Device::Cpu).unwrap();
        let seeds = [11u64, 12, 13];
        let mut rngs: Vec<NormalRng> = seeds.iter().map(|&s| NormalRng::new(s)).collect();
        let together = sample_groups(&model, &prompts, 2, eos, &cfg, &mut rngs).unwrap();
        for ((prompt, seed), got) in prompts.iter().zip(seeds).zip(&together) {
            let alone =
                sample_group(&model, prompt, 2, eos, &cfg, &mut NormalRng::new(seed)).unwrap();
            assert_eq!(got, &alone, "{family}, prompt {prompt:?}");
            assert!(got.iter().all(|c| !c.is_empty()), "{family}: rows decoded");
        }
        // Greedy rows of a padded batch continue their prompts as uncached decoding does.
        let greedy = SamplingConfig {
            temperature: 0.0,
            ..cfg
        };
        let rows = sample_groups(&model, &prompts, 1, eos, &greedy, &mut rngs).unwrap();
        for (prompt, got) in prompts.iter().zip(&rows) {
            let uncached = streambp_train::generate::greedy(&model, prompt, eos, 7).unwrap();
            assert_eq!(got[0], uncached, "{family}, prompt {prompt:?}");
        }
    }
}

#[test]
fn rewards_and_advantages_follow_trl() {
    let row: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(r#"{"prompt": "2+2=", "answer": "4"}"#).unwrap();
    let exact = parse_reward("exact:answer").unwrap();
    assert_eq!(exact.score(" 4 ", &row), 1.0);
    assert_eq!(exact.score("5", &row), 0.0);
    let format = parse_reward("format:[0-9]+").unwrap();
    assert_eq!(format.score("42", &row), 1.0);
    assert_eq!(
        format.score("42x", &row),
        0.0,
        "the whole completion must match"
    );
    assert!(parse_reward("length:3").is_err());
    assert!(parse_reward("format:(").is_err());
    // (r - mean) / (std + 1e-4) with torch's unbiased std.
    let a = group_advantages(&[1.0, 0.0, 0.0, 1.0]);
    let std = (4.0f64 / 3.0 * 0.25).sqrt();
    assert!((a[0] - 0.5 / (std + 1e-4)).abs() < 1e-12);
    assert_eq!(group_advantages(&[1.0, 1.0, 1.0]), vec![0.0, 0.0, 0.0]);
    // scale_rewards: none leaves the centred rewards; batch divides by the batch's std, here from
    // its sums as ranks add them up (the same as the group's when the batch is one group).
    assert_eq!(
        scaled_advantages(&[1.0, 0.0, 0.0, 1.0], None),
        vec![0.5, -0.5, -0.5, 0.5]
    );
    assert!((std_from_sums(2.0, 2.0, 4.0) - std).abs() < 1e-15);
    assert_eq!(std_from_sums(3.0, 9.0, 1.0), 0.0);
    assert_eq!("batch".parse(), Ok(ScaleRewards::Batch));
    assert!("global".parse::<ScaleRewards>().is_err());
    // TRL's frac_reward_zero_std counts the groups whose rewards are all the same.
    assert!(group_without_signal(&[1.0, 1.0, 1.0]));
    assert!(group_without_signal(&[0.5]));
    assert!(!group_without_signal(&[1.0, 0.0, 0.0, 1.0]));
    assert!(!group_without_signal(&[0.0, 0.0, 0.0, 1e-6]));
}

/// A short GRPO run on the built-in task: 4 prompts a step, groups of 8, two steps per batch of rollouts.
fn short_run(out: &std::path::Path) -> (TrainConfig, GrpoConfig) {
    let cfg = TrainConfig {
        output_dir: out.to_path_buf(),
        max_steps: Some(12),
        batch_size: 4,
        schedule: Schedule::Constant,
        seed: 1,
        chunk: 4,
        logits_chunk: 4,
        progress: false,
        ..TrainConfig::defaults(Recipe::Grpo, true)
    };
    let g = GrpoConfig {
        num_iterations: 2,
        ..GrpoConfig::defaults(true)
    };
    (cfg, g)
}

fn metric(out: &std::path::Path, name: &str) -> Vec<f64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()[name].as_f64())
        .collect()
}

#[test]
fn short_grpo_run_raises_the_reward() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, g) = short_run(dir.path());
    run_grpo(&cfg, &g).unwrap();
    let rewards = metric(dir.path(), "reward");
    assert_eq!(
        rewards.len(),
        6,
        "new rollouts every num_iterations = 2 steps"
    );
    let (first, last) = (rewards[0] + rewards[1], rewards[4] + rewards[5]);
    assert!(last > first, "reward should rise: {rewards:?}");
    // Four groups a batch: a fraction in quarters, below 1 where the reward rose.
    let flat = metric(dir.path(), "frac_reward_zero_std");
    assert_eq!(flat.len(), 6, "{flat:?}");
    assert!(
        flat.iter()
            .all(|f| (f * 4.0).fract() == 0.0 && (0.0..=1.0).contains(f)),
        "{flat:?}"
    );
    assert!(flat.iter().any(|&f| f < 1.0), "{flat:?}");
}

/// Rollouts are drawn from a generator seeded by the step, so a run resumed from a checkpoint samples
/// what the uninterrupted run sampled: the same rewards and losses, to the last bit; for GRPO and
/// for RLOO (whose KL to the reference enters the reward when the rollouts are drawn).
#[test]
fn resumed_grpo_run_draws_the_same_rollouts() {
    let rloo = GrpoConfig {
        num_iterations: 2,
        ..GrpoConfig::rloo_defaults(true, true)
    };
    for (g, recipe) in [
        (short_run(Path::new("")).1, Recipe::Grpo),
        (rloo, Recipe::Rloo),
    ] {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (mut cfg, _) = short_run(a.path());
        cfg.max_steps = Some(6);
        cfg.save_every = 2;
        // With a KL term: the reference, the model the run began with, must be the same after a
        // resume.
        cfg.beta = 0.04;
        run_grpo(&cfg, &g).unwrap();
        cfg.output_dir = b.path().to_path_buf();
        cfg.resume = Some(a.path().join("checkpoint-2"));
        run_grpo(&cfg, &g).unwrap();
        for name in ["loss", "reward", "kl"] {
            let whole = metric(a.path(), name);
            let resumed = metric(b.path(), name);
            assert!(!resumed.is_empty(), "{recipe:?} {name}");
            assert_eq!(
                whole[whole.len() - resumed.len()..],
                resumed[..],
                "{recipe:?} {name}"
            );
        }
        assert_eq!(metric(b.path(), "loss").len(), 4, "steps 3..=6");
    }
}

/// RLOO on the built-in task: the KL to the reference is scored when each batch of rollouts is
/// drawn (0 on the first, where the policy is the reference; above 0 once it moved), the loss has
/// one clipped ratio per completion, and the normalised advantages of each batch average 0 (their
/// loss at ratio 1 on the first step of a batch is `−mean A` = 0).
#[test]
fn rloo_run_takes_its_kl_from_the_reward() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, _) = short_run(dir.path());
    cfg.beta = 0.05;
    let g = GrpoConfig {
        num_iterations: 2,
        ..GrpoConfig::rloo_defaults(true, true)
    };
    run_grpo(&cfg, &g).unwrap();
    let kl = metric(dir.path(), "kl");
    assert_eq!(kl.len(), 6, "one kl per batch of rollouts: {kl:?}");
    assert_eq!(
        kl[0], 0.0,
        "the first batch is drawn by the reference itself"
    );
    assert!(kl[1..].iter().any(|&k| k != 0.0), "{kl:?}");
    let loss = metric(dir.path(), "loss");
    for (step, l) in loss.iter().enumerate().step_by(2) {
        assert!(l.abs() < 1e-4, "step {step}: loss {l} at ratio 1 (f32)");
    }
    assert!(metric(dir.path(), "clip_ratio").len() == 12);
}

/// A distillation run on the built-in task: 8 prompts a step, `batch_size` of them per backward,
/// a randomly initialised student against the shipped SFT checkpoint as teacher.
fn distill_run(out: &Path, steps: usize, batch_size: usize) -> (TrainConfig, GrpoConfig) {
    let cfg = TrainConfig {
        output_dir: out.to_path_buf(),
        max_steps: Some(steps),
        batch_size,
        grad_accum: 8 / batch_size,
        seed: 3,
        progress: false,
        ..TrainConfig::defaults(Recipe::Distill, true)
    };
    (cfg, GrpoConfig::distill_defaults(true, None))
}

/// The student learns the teacher's distributions on its own completions: the divergence (the
/// reverse KL, TRL's default) falls over a short run, and nothing is rewarded.
#[test]
fn distillation_run_lowers_the_divergence() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, g) = distill_run(dir.path(), 60, 8);
    run_grpo(&cfg, &g).unwrap();
    let loss = metric(dir.path(), "loss");
    assert_eq!(loss.len(), 60);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (first, last) = (mean(&loss[..10]), mean(&loss[50..]));
    println!("divergence {first:.3} -> {last:.3}");
    assert!(last < 0.8 * first, "the divergence should fall: {loss:?}");
    assert!(metric(dir.path(), "reward").is_empty());
    assert_eq!(metric(dir.path(), "completion_length").len(), 60);
}

/// TRL's normaliser: the divergences of the step's completion tokens, whatever the micro-batches,
/// over their number. One step on 8 prompts as one micro-batch or as four (the same completions:
/// each prompt's generator is seeded by its place in the step) gives the same loss and the same
/// model, to f32's rounding of the sums in another order.
#[test]
fn distillation_loss_is_one_mean_over_the_step() {
    let (one, four) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for (dir, batch_size) in [(&one, 8), (&four, 2)] {
        let (cfg, g) = distill_run(dir.path(), 1, batch_size);
        run_grpo(&cfg, &g).unwrap();
    }
    let (a, b) = (
        metric(one.path(), "loss")[0],
        metric(four.path(), "loss")[0],
    );
    assert!(
        (a - b).abs() < 1e-5 * a.abs(),
        "one micro-batch {a}, four {b}"
    );
    let weights = |dir: &Path| {
        let path = dir.join("final/model.safetensors");
        candle_core::safetensors::load(path, &Device::Cpu).unwrap()
    };
    let (wa, wb) = (weights(one.path()), weights(four.path()));
    for (name, x) in &wa {
        let e = rel_err(x, &wb[name]);
        assert!(e < 1e-4, "{name}: {e:.2e}");
    }
}

/// Adaptive entropy control (TRL's `use_adaptive_entropy`): no bonus on the first step (nothing
/// seen yet), then with a target no entropy exceeds the coefficient climbs by its delta each step
/// to its bound and the bonus applies, while with a target below every entropy it falls to its
/// floor and the run is the run without a bonus (the built-in model's f32 aside). A resumed run takes the coefficient from its
/// checkpoint: the same losses and coefficients, to the last bit.
#[test]
fn adaptive_entropy_control_follows_trl_and_resumes_exactly() {
    let adaptive = |target| GrpoConfig {
        entropy_coef: 0.1,
        adaptive_entropy: Some(AdaptiveEntropy {
            min: 0.02,
            max: 0.3,
            delta: 0.05,
            target,
        }),
        ..short_run(Path::new("")).1
    };
    let run = |g: &GrpoConfig, out: &Path, resume: Option<PathBuf>| {
        let (mut cfg, _) = short_run(out);
        cfg.max_steps = Some(5);
        cfg.save_every = 2;
        cfg.resume = resume;
        run_grpo(&cfg, g).unwrap();
    };
    let (plain, high, low, resumed) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    run(&short_run(Path::new("")).1, plain.path(), None);
    run(&adaptive(100.0), high.path(), None);
    run(&adaptive(-1.0), low.path(), None);
    let coefs = metric(high.path(), "entropy_coef");
    let expected = [0.15, 0.2, 0.25, 0.3, 0.3];
    assert_eq!(coefs.len(), 5, "{coefs:?}");
    for (c, e) in coefs.iter().zip(expected) {
        assert!((c - e).abs() < 1e-12, "{coefs:?}");
    }
    let low_coefs = metric(low.path(), "entropy_coef");
    assert!((low_coefs[0] - 0.05).abs() < 1e-12, "{low_coefs:?}");
    assert!(low_coefs[1..].iter().all(|&c| c == 0.02), "{low_coefs:?}");
    let (plain_loss, high_loss) = (metric(plain.path(), "loss"), metric(high.path(), "loss"));
    assert!(
        (plain_loss[0] - high_loss[0]).abs() < 1e-6,
        "no bonus on step 1: {plain_loss:?} {high_loss:?}"
    );
    assert!(
        (plain_loss[1] - high_loss[1]).abs() > 1e-3,
        "the bonus on step 2"
    );
    // The same run in f32 (the head reads the entropies too, so the roundings differ).
    for (a, b) in plain_loss.iter().zip(metric(low.path(), "loss")) {
        assert!((a - b).abs() < 1e-6, "never applied: {plain_loss:?}");
    }
    run(
        &adaptive(100.0),
        resumed.path(),
        Some(high.path().join("checkpoint-2")),
    );
    for name in ["loss", "entropy_coef"] {
        let (whole, part) = (metric(high.path(), name), metric(resumed.path(), name));
        assert_eq!(part.len(), 3, "steps 3..=5");
        assert_eq!(whole[2..], part[..], "{name}");
    }
}
