//! DPO and GRPO, exact: streamed gradients equal the plain backward's (f64, every family, chunkings that
//! do not divide T), and every mode matches the float64 losses and gradients of TRL's formulas written
//! out in PyTorch on transformers' models (scripts/make_fixtures.py).

mod common;

use common::*;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use streambp_core::{backward, Batch, Chunks, Gradients, Mode};
use streambp_models::load_model;

/// Runs `mode` on the batch file of `family` after `edit`, in f64.
fn run(
    family: &str,
    file: &str,
    edit: &dyn Fn(&mut serde_json::Value),
    mode: Mode,
    chunks: Chunks,
) -> Gradients {
    let model = load_model(&fixture_dir(family), DType::F64, &Device::Cpu).unwrap();
    let batch = edited_batch(family, file, edit, &model.config);
    let input = Batch::new(&batch.input_ids, batch.attention_mask.as_ref());
    backward(&model, input, batch.objective.as_ref(), mode, chunks).unwrap()
}

fn metric(g: &Gradients, name: &str) -> f64 {
    g.metrics
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no metric {name}"))
        .1
}

fn scalar(r: &HashMap<String, Tensor>, key: &str) -> f64 {
    r[key].to_vec1::<f64>().unwrap()[0]
}

/// Every metric of `names` within 1e-10 of the reference's `{variant}.{name}` (`/` written `_`).
fn assert_metrics_match(
    out: &Gradients,
    r: &HashMap<String, Tensor>,
    (family, variant): (&str, &str),
    names: &[&str],
) {
    for name in names {
        let key = format!("{variant}.{}", name.replace('/', "_"));
        let (ours, theirs) = (metric(out, name), scalar(r, &key));
        assert!(
            (ours - theirs).abs() < 1e-10 * theirs.abs().max(1.0),
            "{family} {variant} {name}: {ours} vs TRL {theirs}"
        );
    }
}

/// Checks every mode and chunking of one objective variant against the full backward and the reference.
fn check(
    family: &str,
    file: &str,
    edit: &dyn Fn(&mut serde_json::Value),
    prefix: &str,
) -> Gradients {
    check_against(&reference(family), family, file, edit, prefix)
}

/// [`check`] against the reference values `r` (`{prefix}.loss`, `{prefix}.grad.{param}`).
fn check_against(
    r: &HashMap<String, Tensor>,
    family: &str,
    file: &str,
    edit: &dyn Fn(&mut serde_json::Value),
    prefix: &str,
) -> Gradients {
    let full = run(
        family,
        file,
        edit,
        Mode::Full,
        Chunks {
            chunk: 1,
            logits_chunk: 1,
        },
    );
    let mut worst = 0.0f64;
    for (mode, chunk, logits_chunk) in [
        (Mode::Full, 1, 1),
        (Mode::Checkpoint, 1, 1),
        (Mode::Stream, 1, 1),
        (Mode::Stream, 3, 4),
        (Mode::Stream, 4, 16),
    ] {
        let out = if mode == Mode::Full {
            None
        } else {
            Some(run(
                family,
                file,
                edit,
                mode,
                Chunks {
                    chunk,
                    logits_chunk,
                },
            ))
        };
        let out = out.as_ref().unwrap_or(&full);
        let what = format!("{family} {prefix} {mode} {chunk}/{logits_chunk}");
        let run_worst = assert_exact(&what, (out.loss, &out.grads), &full.grads, (r, prefix));
        worst = worst.max(run_worst);
    }
    println!("{family} {prefix}: worst gradient error vs reference {worst:.2e}");
    full
}

#[test]
fn dpo_matches_full_backward_and_reference() {
    for family in FAMILIES {
        let r = reference(family);
        let out = check(family, "dpo-batch.json", &|_| {}, "dpo");
        for (metric_name, key) in [
            ("rewards/chosen", "dpo.rewards_chosen"),
            ("rewards/rejected", "dpo.rewards_rejected"),
            ("rewards/accuracies", "dpo.accuracy"),
        ] {
            let (ours, theirs) = (metric(&out, metric_name), scalar(&r, key));
            assert!(
                (ours - theirs).abs() < 1e-10 * theirs.abs().max(1.0),
                "{family} {metric_name}: {ours} vs {theirs}"
            );
        }
    }
}

/// TRL's sigmoid + "sft" loss types (RPO): the chosen completions' mean token NLL added with weight 0.5.
#[test]
fn dpo_with_sft_term_matches_full_backward_and_reference() {
    for family in FAMILIES {
        let r = reference(family);
        let with_weight = |json: &mut serde_json::Value| json["sft_weight"] = 0.5.into();
        let out = check(family, "dpo-batch.json", &with_weight, "dpo_sft");
        let (ours, theirs) = (metric(&out, "nll_loss"), scalar(&r, "dpo_sft.nll"));
        assert!(
            (ours - theirs).abs() < 1e-10 * theirs.abs(),
            "{family}: nll {ours} vs {theirs}"
        );
    }
}

/// Every GRPO loss type of TRL 1.16 (its `_compute_loss`, written out in scripts/make_fixtures.py),
/// the KL with and without the ratio's bias correction, no old log-probs, and a sampling
/// temperature: each matches the reference and streams exactly.
#[test]
fn grpo_matches_full_backward_and_reference_for_each_loss_type() {
    let tokens = |j: &serde_json::Value| -> f64 {
        j["completion_mask"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r.as_array().unwrap())
            .map(|m| m.as_f64().unwrap())
            .sum()
    };
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let loss_type =
        |name: &'static str| -> Edit { Box::new(move |j| j["loss_type"] = name.into()) };
    let variants: Vec<(&str, Edit)> = vec![
        ("grpo", loss_type("grpo")),
        ("bnpo", loss_type("bnpo")),
        ("dr_grpo", loss_type("dr_grpo")),
        // dapo divides by the global batch's tokens: as if this were a third of it.
        (
            "dapo",
            Box::new(move |j| {
                j["loss_type"] = "dapo".into();
                j["num_items_in_batch"] = (3.0 * tokens(j)).into();
            }),
        ),
        (
            "cispo",
            Box::new(|j| {
                j["loss_type"] = "cispo".into();
                j["epsilon_high"] = 1.2.into();
                // cispo caps the ratio at epsilon_high alone: a batch file may not give epsilon.
                j.as_object_mut().unwrap().remove("epsilon");
            }),
        ),
        (
            "sapo",
            Box::new(|j| {
                j["loss_type"] = "sapo".into();
                // sapo gates the ratio, clipping nothing.
                j.as_object_mut().unwrap().remove("epsilon");
            }),
        ),
        (
            "plain_kl",
            Box::new(|j| {
                j["loss_type"] = "grpo".into();
                j["use_bias_correction_kl"] = false.into();
            }),
        ),
        (
            "temperature",
            Box::new(|j| {
                j["loss_type"] = "grpo".into();
                j["temperature"] = 0.7.into();
            }),
        ),
        // A masked truncated completion: row 1 without completion tokens.
        (
            "masked_row",
            Box::new(|j| {
                j["loss_type"] = "grpo".into();
                for v in j["completion_mask"][1].as_array_mut().unwrap() {
                    *v = 0.into();
                }
            }),
        ),
    ];
    for family in FAMILIES {
        let r = reference(family);
        for (name, edit) in &variants {
            let out = check(
                family,
                "grpo-batch.json",
                edit.as_ref(),
                &format!("grpo.{name}"),
            );
            let want = scalar(&r, &format!("grpo.{name}.clip_ratio"));
            if *name != "sapo" {
                let clip = metric(&out, "clip_ratio");
                assert!(
                    (clip - want).abs() < 1e-12,
                    "{family} {name}: clip {clip} vs {want}"
                );
                assert!(clip > 0.0, "{family} {name}: the fixture's ratios clip");
            }
            let kl = metric(&out, "kl");
            let want = scalar(&r, &format!("grpo.{name}.kl"));
            assert!(
                (kl - want).abs() < 1e-10,
                "{family} {name}: kl {kl} vs {want}"
            );
        }
        // No old log-probs: r = 1 with the current policy's gradient; beta = 0: no reference.
        let edit = |j: &mut serde_json::Value| {
            let o = j.as_object_mut().unwrap();
            o.remove("old_logps");
            o.remove("ref_logps");
            o.insert("beta".into(), 0.0.into());
            o.insert("loss_type".into(), "grpo".into());
        };
        let out = check(family, "grpo-batch.json", &edit, "grpo.noold");
        assert_eq!(metric(&out, "clip_ratio"), 0.0);
    }
}

/// TRL 1.16's GRPO options beyond the token-level loss types, against TRL's own `_compute_loss`
/// (scripts/make_grpo_trl_fixtures.py): sequence-level importance weights (GSPO) under each kind of
/// loss, `luspo` at either level, `vespo` with TRL's and other gamma shapes, and the off-policy
/// sequence mask dropping one of the two negative-advantage rows. Each streams exactly (one weight
/// per row needs the whole row: the engine hands these losses all positions at once).
#[test]
fn grpo_sequence_options_match_trl() {
    for family in FAMILIES {
        let dir = fixture_dir(family);
        let r = candle_core::safetensors::load(dir.join("grpo_trl.safetensors"), &Device::Cpu)
            .expect("fixture grpo_trl.safetensors");
        let variants = trl_variants::variants(scalar(&r, "off_policy.threshold"));
        assert_variants_match(family, &variants, &r);
    }
}

/// Each of `variants` of the family's GRPO batch: checked by [`check_against`] the fixture `r`, and
/// its metrics within 1e-10 of the ones TRL logged. Returns each variant's full backward.
fn assert_variants_match(
    family: &str,
    variants: &[trl_variants::Variant],
    r: &HashMap<String, Tensor>,
) -> Vec<Gradients> {
    let mut outs = Vec::new();
    for v in variants {
        let out = check_against(r, family, "grpo-batch.json", v.edit.as_ref(), v.name);
        for name in v.metrics {
            let key = trl_variants::metric_key(v.name, name);
            let (ours, theirs) = (metric(&out, name), scalar(r, &key));
            assert!(
                (ours - theirs).abs() < 1e-10 * theirs.abs().max(1.0),
                "{family} {} {name}: {ours} vs TRL {theirs}",
                v.name
            );
        }
        outs.push(out);
    }
    outs
}

/// RLOO against TRL 1.16's own `RLOOTrainer._compute_loss` (scripts/make_rloo_fixtures.py, its
/// advantages written out from `_generate_and_score_completions`): the KL in the reward, the
/// leave-one-out baseline in groups of 2 and of 4 normalised, beta 0 with an asymmetric clip, no
/// old log-probs, and a sampling temperature; each streams exactly.
#[test]
fn rloo_matches_trl() {
    for family in FAMILIES {
        let dir = fixture_dir(family);
        let r = candle_core::safetensors::load(dir.join("rloo.safetensors"), &Device::Cpu)
            .expect("fixture rloo.safetensors");
        for out in assert_variants_match(family, &trl_variants::rloo_variants(), &r) {
            // The rewards' mean, before the KL.
            let reward = metric(&out, "reward");
            assert!((reward - 0.35).abs() < 1e-12, "{family}: reward {reward}");
        }
    }
}

/// Distillation against TRL 1.16's own `DistillationTrainer._compute_loss`
/// (scripts/make_distill_fixtures.py): a teacher of another width (48 against the students' 32) and
/// family, the reverse KL (TRL's default), the forward KL, the generalized JSD, and a temperature,
/// every family (Gemma3's soft-capped logits included); the streamed head compares the two
/// distributions a logits chunk at a time, and each mode equals the full backward.
#[test]
fn distill_matches_trl() {
    for family in FAMILIES {
        let dir = fixture_dir(family);
        let r = candle_core::safetensors::load(dir.join("distill.safetensors"), &Device::Cpu)
            .expect("fixture distill.safetensors");
        assert_variants_match(family, &trl_variants::distill_variants(), &r);
    }
}

/// The teacher's hidden states are freed once the streamed head is done with them, and made again
/// when the same objective runs another backward: the second gives the first's gradients, bit for
/// bit.
#[test]
fn a_distillation_objective_runs_again_after_its_teacher_states_are_freed() {
    let model = load_model(&fixture_dir("qwen3"), DType::F64, &Device::Cpu).unwrap();
    let variant = &trl_variants::distill_variants()[0];
    let batch = edited_batch(
        "qwen3",
        "grpo-batch.json",
        variant.edit.as_ref(),
        &model.config,
    );
    let input = Batch::new(&batch.input_ids, batch.attention_mask.as_ref());
    let chunks = Chunks {
        chunk: 3,
        logits_chunk: 4,
    };
    let objective = batch.objective.as_ref();
    let first = backward(&model, input, objective, Mode::Stream, chunks).unwrap();
    let again = backward(&model, input, objective, Mode::Stream, chunks).unwrap();
    assert_eq!(first.loss, again.loss);
    for ((name, a), (_, b)) in first.grads.iter().zip(&again.grads) {
        let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(diff.to_scalar::<f64>().unwrap(), 0.0, "{name}");
    }
}

/// Every DPO loss type of TRL 1.16 (the objective's values are checked against TRL's own code in
/// streambp-objectives' `dpo_loss_types` test): streamed and checkpointed gradients equal the plain
/// backward's, every family, chunkings that do not divide T.
#[test]
fn every_dpo_loss_type_streams_exactly() {
    let types = streambp_objectives::DpoLossType::ALL;
    for family in FAMILIES {
        for kind in types {
            let edit = move |j: &mut serde_json::Value| {
                j["loss_type"] = serde_json::json!([kind.name(), "sigmoid"]);
                j["loss_weights"] = serde_json::json!([1.0, 0.25]);
                if kind.smoothed() {
                    j["label_smoothing"] = 0.2.into();
                }
            };
            let chunks = |chunk, logits_chunk| Chunks {
                chunk,
                logits_chunk,
            };
            let full = run(family, "dpo-batch.json", &edit, Mode::Full, chunks(1, 1));
            for (mode, c) in [
                (Mode::Checkpoint, chunks(1, 1)),
                (Mode::Stream, chunks(1, 1)),
                (Mode::Stream, chunks(3, 4)),
            ] {
                let out = run(family, "dpo-batch.json", &edit, mode, c);
                let name = kind.name();
                assert!(
                    (out.loss - full.loss).abs() < 1e-12 * full.loss.abs().max(1.0),
                    "{family} {name} {mode}: loss {} vs full {}",
                    out.loss,
                    full.loss
                );
                for ((param, g), (_, g_full)) in out.grads.iter().zip(&full.grads) {
                    let err = rel_err(g, g_full);
                    assert!(
                        err < 1e-10,
                        "{family} {name} {mode}: {param} vs full {err:.2e}"
                    );
                }
            }
        }
    }
}

/// DPO loss types through the models, against TRL 1.16's own `_compute_loss` on transformers' float64
/// models (scripts/make_dpo_loss_fixtures.py): IPO's length-averaged log-ratios, aot_unpaired's
/// batch-wide sorts with label smoothing, and a weighted list with the NLL term; loss and every
/// parameter's gradient within 1e-8, in the plain and the streamed backward, every family.
#[test]
fn dpo_loss_types_match_trl_on_the_models() {
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, Edit); 3] = [
        ("ipo", |j| j["loss_type"] = "ipo".into()),
        ("aot_unpaired", |j| {
            j["loss_type"] = "aot_unpaired".into();
            j["label_smoothing"] = 0.2.into();
        }),
        ("sigmoid_bco_sft", |j| {
            j["loss_type"] = serde_json::json!(["sigmoid", "bco_pair", "sft"]);
            j["loss_weights"] = serde_json::json!([0.8, 0.2, 1.0]);
        }),
    ];
    for family in FAMILIES {
        let r = candle_core::safetensors::load(
            fixture_dir(family).join("dpo_loss_types.safetensors"),
            &Device::Cpu,
        )
        .expect("fixture dpo_loss_types.safetensors");
        let mut worst = 0.0f64;
        for (name, edit) in cases {
            let want = scalar(&r, &format!("{name}.loss"));
            for (mode, chunk, logits_chunk) in [(Mode::Full, 1, 1), (Mode::Stream, 3, 4)] {
                let chunks = Chunks {
                    chunk,
                    logits_chunk,
                };
                let out = run(family, "dpo-batch.json", &edit, mode, chunks);
                assert!(
                    (out.loss - want).abs() < 1e-10 * want.abs().max(1e-3),
                    "{family} {name} {mode}: loss {} vs TRL {want}",
                    out.loss
                );
                for (param, g) in &out.grads {
                    let err = rel_err(g, &r[&format!("{name}.grad.{param}")]);
                    worst = worst.max(err);
                    assert!(
                        err < 1e-8,
                        "{family} {name} {mode}: {param} vs TRL {err:.2e}"
                    );
                }
            }
        }
        println!("{family}: worst gradient error vs TRL's DPO loss types {worst:.2e}");
    }
}

/// ORPO and CPO (with SimPO and AlphaPO) through the models, against TRL 1.16's own `ORPOTrainer` and
/// `CPOTrainer` (`get_batch_loss_metrics` on transformers' float64 models,
/// scripts/make_preference_fixtures.py): the loss, every parameter's gradient within 1e-8 and every
/// logged metric; each mode and chunking equals the plain backward within 1e-10. Every family, the DPO
/// fixture batch (two pairs of unequal lengths, padded).
#[test]
fn orpo_and_cpo_match_trl_on_the_models() {
    use serde_json::json;
    let variants = [
        ("orpo", json!({"objective": "orpo", "beta": 0.1})),
        ("orpo_beta_half", json!({"objective": "orpo", "beta": 0.5})),
        (
            "cpo_sigmoid",
            json!({"objective": "cpo", "beta": 0.1, "label_smoothing": 0.1}),
        ),
        (
            "cpo_hinge",
            json!({"objective": "cpo", "beta": 0.1, "loss_type": "hinge", "cpo_alpha": 0.5}),
        ),
        (
            "cpo_ipo",
            json!({"objective": "cpo", "beta": 0.1, "loss_type": "ipo"}),
        ),
        (
            "simpo",
            json!({"objective": "cpo", "beta": 2.0, "loss_type": "simpo", "cpo_alpha": 0.0}),
        ),
        (
            "cpo_simpo",
            json!({"objective": "cpo", "beta": 2.0, "loss_type": "simpo", "label_smoothing": 0.1}),
        ),
        (
            "alphapo",
            json!({"objective": "cpo", "beta": 2.0, "loss_type": "alphapo", "alpha": 0.25}),
        ),
    ];
    let metrics = [
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "nll_loss",
    ];
    for family in FAMILIES {
        let r = candle_core::safetensors::load(
            fixture_dir(family).join("preference.safetensors"),
            &Device::Cpu,
        )
        .expect("fixture preference.safetensors");
        for (name, settings) in &variants {
            let edit = |j: &mut serde_json::Value| {
                let o = j.as_object_mut().unwrap();
                o.remove("ref_chosen_logps");
                o.remove("ref_rejected_logps");
                for (k, v) in settings.as_object().unwrap() {
                    o.insert(k.clone(), v.clone());
                }
            };
            let out = check_against(&r, family, "dpo-batch.json", &edit, name);
            let odds = ["log_odds_ratio", "log_odds_chosen"];
            let orpo_only = odds.iter().filter(|_| name.starts_with("orpo"));
            let logged: Vec<&str> = metrics.iter().chain(orpo_only).copied().collect();
            assert_metrics_match(&out, &r, (family, name), &logged);
        }
    }
}

/// KTO as TRL 1.16's own `KTOTrainer._compute_loss` computes it on transformers' float64 models
/// (scripts/make_kto_fixtures.py): two desirable rows and one undesirable, padded; `kto` with the KL
/// baseline TRL used, weighted kinds, and `apo_zero_unpaired`: the loss, every gradient within 1e-8,
/// every logged metric; each mode and chunking equals the plain backward.
#[test]
fn kto_matches_trl_on_the_models() {
    use serde_json::json;
    let variants = [
        ("kto", json!({"beta": 0.1})),
        (
            "kto_weighted",
            json!({"beta": 0.3, "desirable_weight": 1.33, "undesirable_weight": 0.5}),
        ),
        (
            "apo_zero_unpaired",
            json!({"beta": 0.1, "loss_type": "apo_zero_unpaired"}),
        ),
    ];
    for family in FAMILIES {
        let r = candle_core::safetensors::load(
            fixture_dir(family).join("kto.safetensors"),
            &Device::Cpu,
        )
        .expect("fixture kto.safetensors");
        for (name, settings) in &variants {
            let kl = scalar(&r, &format!("{name}.kl"));
            let edit = |j: &mut serde_json::Value| {
                let o = j.as_object_mut().unwrap();
                for key in [
                    "kl_input_ids",
                    "kl_attention_mask",
                    "kl_labels",
                    "ref_kl_logps",
                ] {
                    o.remove(key);
                }
                for (k, v) in settings.as_object().unwrap() {
                    o.insert(k.clone(), v.clone());
                }
                if *name != "apo_zero_unpaired" {
                    o.insert("kl".into(), kl.into());
                }
            };
            let out = check_against(&r, family, "kto-batch.json", &edit, name);
            let logged = [
                "kl",
                "rewards/chosen",
                "rewards/rejected",
                "rewards/margins",
                "logps/chosen",
                "logps/rejected",
            ];
            assert_metrics_match(&out, &r, (family, name), &logged);
        }
    }
}

/// The KTO recipe's KL baseline as TRL's collator and `_compute_kl_logps` build it: each prompt with
/// the previous row's completion (the fixture's KL rows, made by TRL's own collator), their summed
/// completion log-probs under the policy (the fixture's `kl_logps`), and the clamped mean difference
/// from the reference's (`kto.kl`).
#[test]
fn kto_kl_rows_and_baseline_match_trl() {
    use streambp_train::data::Example;
    for family in FAMILIES {
        let dir = fixture_dir(family);
        let batch: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("kto-batch.json")).unwrap())
                .unwrap();
        let rows = |ids: &str, labels: &str, mask: &str| -> Vec<Example> {
            let list = |key: &str| -> Vec<Vec<i64>> {
                serde_json::from_value(batch[key].clone()).unwrap()
            };
            let (ids, labels, mask) = (list(ids), list(labels), list(mask));
            (0..ids.len())
                .map(|i| {
                    let n = mask[i].iter().filter(|&&m| m == 1).count();
                    let input_ids = ids[i][..n].iter().map(|&t| t as u32).collect();
                    Example::new(input_ids, labels[i][..n].to_vec())
                })
                .collect()
        };
        let examples = rows("input_ids", "labels", "attention_mask");
        let want = rows("kl_input_ids", "kl_labels", "kl_attention_mask");
        let got = streambp_train::kto::mismatched_rows(&examples, 1024);
        assert_eq!(got, want, "{family}: KL rows");

        let model = load_model(&dir, DType::F64, &Device::Cpu).unwrap();
        let chunks = |_: &Tensor| {
            Ok(Chunks {
                chunk: 3,
                logits_chunk: 4,
            })
        };
        let mut score = streambp_train::logprobs::scorer(&model, chunks, None);
        let refs: Vec<&Example> = got.iter().collect();
        let c = streambp_train::batch::collate(&refs, 0);
        let t = c.tensors(&Device::Cpu).unwrap();
        let targets =
            streambp_objectives::TokenTargets::from_labels(&c.labels, 96, &Device::Cpu).unwrap();
        let logps = streambp_train::logprobs::sequence_logps(
            &mut score,
            &t.input_ids,
            Some(&t.attention_mask),
            &targets,
        )
        .unwrap();
        let r = candle_core::safetensors::load(dir.join("kto.safetensors"), &Device::Cpu).unwrap();
        let trl = r["kl_logps"].to_vec1::<f64>().unwrap();
        for (ours, theirs) in logps.iter().zip(&trl) {
            assert!(
                (ours - theirs).abs() < 1e-10 * theirs.abs(),
                "{family}: {ours} vs {theirs}"
            );
        }
        let reference: Vec<f64> = serde_json::from_value(batch["ref_kl_logps"].clone()).unwrap();
        let kl = logps
            .iter()
            .zip(&reference)
            .map(|(p, r)| p - r)
            .sum::<f64>()
            / 3.0;
        let want = scalar(&r, "kto.kl");
        assert!(
            (kl.max(0.0) - want).abs() < 1e-10,
            "{family}: kl {kl} vs TRL {want}"
        );
    }
}

/// A reward model as TRL 1.16's own `RewardTrainer.compute_loss` trains it, on transformers'
/// `*ForSequenceClassification` models in float64 (scripts/make_reward_fixtures.py: the fixture
/// models with a score head, the DPO pairs as whole rows): plain, with per-pair margins, with
/// `center_rewards_coefficient`, and both. The loss, every gradient (the score head's and the
/// embedding's pad row, which transformers leaves without one, included) within 1e-8 and every
/// logged metric; each mode and chunking equals the plain backward.
#[test]
fn reward_model_matches_trl_on_the_models() {
    use serde_json::json;
    let variants = [
        ("reward", json!({})),
        ("reward_margin", json!({"margin": [0.5, -0.25]})),
        ("reward_center", json!({"center_rewards_coefficient": 0.01})),
        (
            "reward_margin_center",
            json!({"margin": [0.5, -0.25], "center_rewards_coefficient": 0.01}),
        ),
    ];
    for family in FAMILIES {
        let case = format!("{family}/reward");
        let r = candle_core::safetensors::load(
            fixture_dir(&case).join("reference.safetensors"),
            &Device::Cpu,
        )
        .expect("fixture reward/reference.safetensors");
        for (name, settings) in &variants {
            let edit = |j: &mut serde_json::Value| {
                let o = j.as_object_mut().unwrap();
                for (k, v) in settings.as_object().unwrap() {
                    o.insert(k.clone(), v.clone());
                }
            };
            let out = check_against(&r, &case, "reward-batch.json", &edit, name);
            let logged = [
                "accuracy",
                "margin",
                "min_reward",
                "mean_reward",
                "max_reward",
            ];
            assert_metrics_match(&out, &r, (&case, name), &logged);
        }
    }
}
