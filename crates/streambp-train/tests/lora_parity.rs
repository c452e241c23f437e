//! LoRA, exact: on every family's PEFT adapter (tests/fixtures/<family>/lora, written by PEFT with
//! scripts/make_lora_fixtures.py), the adapters' gradients of `stream` and `checkpoint` equal `full`'s
//! (f64, awkward chunkings, padded batches, GQA, tied embeddings, Gemma3's window), with and without
//! dropout, for SFT, DPO (and its SFT term), GRPO, ORPO, CPO, KTO and a reward model; and every mode
//! matches transformers + PEFT's float64 losses and gradients (with TRL's own loss code for the
//! preference objectives and the reward model). The merged model's logits equal the adapter's; the adapter streambp
//! writes is the one PEFT wrote (keys, values, settings, metadata); bad adapters are clear errors.

mod common;

use common::*;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use streambp_core::{backward_with, Batch, Chunks, Gradients, Mode, Options, Plan};
use streambp_models::adapter::{load_adapter, save_adapter};
use streambp_models::{load_model, LoraConfig, Model};

fn lora_dir(family: &str) -> PathBuf {
    fixture_dir(family).join("lora")
}

/// The family's base model in f64 with its PEFT adapter; `dropout` replaces the adapter's (0 in the
/// fixture).
fn lora_model(family: &str, dropout: f64) -> Model {
    let base = load_model(&fixture_dir(family), DType::F64, &Device::Cpu).unwrap();
    let adapter = load_adapter(&lora_dir(family), &Device::Cpu).unwrap();
    let config = LoraConfig {
        dropout,
        ..adapter.config
    };
    base.with_lora(config, Some(adapter.tensors), 0).unwrap()
}

fn lora_reference(family: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(lora_dir(family).join("reference.safetensors"), &Device::Cpu)
        .unwrap()
}

/// One objective's batch: the SFT rows of the fixture, or a DPO / GRPO batch file after `edit`.
fn backward(
    model: &Model,
    family: &str,
    objective: &str,
    mode: Mode,
    (chunk, logits_chunk): (usize, usize),
    dropout: Option<u64>,
) -> Gradients {
    let chunks = Chunks {
        chunk,
        logits_chunk,
    };
    let options = Options {
        dropout: dropout.map(|key| streambp_models::lora::DropoutKey { key, first_row: 0 }),
        ..Default::default()
    };
    let (file, edit): (&str, fn(&mut serde_json::Value)) = match objective {
        "sft" => {
            let r = reference(family);
            let ids = r["input_ids"].to_dtype(DType::U32).unwrap();
            let labels = r["labels"].to_vec2::<i64>().unwrap();
            let sft = streambp_objectives::Sft::new(&labels, 96, None, &Device::Cpu).unwrap();
            let batch = Batch::new(&ids, Some(&r["attention_mask"]));
            return backward_with(model, batch, &sft, Plan::new(mode, chunks).with(options))
                .unwrap();
        }
        "dpo" => ("dpo-batch.json", |_| {}),
        "dpo_sft" => ("dpo-batch.json", |j| j["sft_weight"] = 0.5.into()),
        // The loss the PEFT fixture wrote out (scripts/make_lora_fixtures.py): grpo's reduction,
        // the plain KL.
        "grpo" => ("grpo-batch.json", |j| {
            j["loss_type"] = "grpo".into();
            j["use_bias_correction_kl"] = false.into();
        }),
        // TRL 1.16's other GRPO losses (bias-corrected KL), at a sampling temperature.
        "grpo_dapo" => ("grpo-batch.json", |j| {
            j["loss_type"] = "dapo".into();
            j["num_items_in_batch"] = 40.into();
            j["temperature"] = 0.7.into();
        }),
        // Neither reads epsilon, which a batch file may then not give.
        "grpo_cispo" => ("grpo-batch.json", |j| {
            j["loss_type"] = "cispo".into();
            j["epsilon_high"] = 1.2.into();
            j.as_object_mut().unwrap().remove("epsilon");
        }),
        "grpo_sapo" => ("grpo-batch.json", |j| {
            j["loss_type"] = "sapo".into();
            j.as_object_mut().unwrap().remove("epsilon");
        }),
        "dpo_ipo" => ("dpo-batch.json", |j| j["loss_type"] = "ipo".into()),
        "dpo_aot_unpaired" => ("dpo-batch.json", |j| {
            j["loss_type"] = "aot_unpaired".into();
            j["label_smoothing"] = 0.2.into();
        }),
        "dpo_list" => ("dpo-batch.json", |j| {
            j["loss_type"] = serde_json::json!(["sigmoid", "bco_pair", "sft"]);
            j["loss_weights"] = serde_json::json!([0.8, 0.2, 1.0]);
        }),
        // The reference-free preference objectives (no reference log-probs in their files).
        "orpo" => ("dpo-batch.json", |j| {
            j["objective"] = "orpo".into();
            reference_free(j);
        }),
        "cpo_simpo" => ("dpo-batch.json", |j| {
            j["objective"] = "cpo".into();
            j["loss_type"] = "simpo".into();
            j["label_smoothing"] = 0.1.into();
            reference_free(j);
        }),
        "alphapo" => ("dpo-batch.json", |j| {
            j["objective"] = "cpo".into();
            j["loss_type"] = "alphapo".into();
            j["alpha"] = 0.25.into();
            reference_free(j);
        }),
        // KTO with a KL baseline given (the recipe's estimate is a constant of the step).
        "kto" => ("kto-batch.json", |j| {
            let o = j.as_object_mut().unwrap();
            for key in [
                "kl_input_ids",
                "kl_attention_mask",
                "kl_labels",
                "ref_kl_logps",
            ] {
                o.remove(key);
            }
            o.insert("kl".into(), 0.3.into());
        }),
        // A reward model's pairs: whole rows (the fixture's reward/ directory).
        "reward" => ("reward-batch.json", |_| {}),
        "reward_margin_center" => ("reward-batch.json", |j| {
            j["margin"] = serde_json::json!([0.5, -0.25]);
            j["center_rewards_coefficient"] = 0.01.into();
        }),
        other => panic!("no objective {other}"),
    };
    let batch = edited_batch(family, file, &edit, &model.config);
    let input = Batch::new(&batch.input_ids, batch.attention_mask.as_ref());
    backward_with(
        model,
        input,
        batch.objective.as_ref(),
        Plan::new(mode, chunks).with(options),
    )
    .unwrap()
}

/// A DPO batch file made ORPO's or CPO's: without reference log-probs.
fn reference_free(json: &mut serde_json::Value) {
    let o = json.as_object_mut().unwrap();
    o.remove("ref_chosen_logps");
    o.remove("ref_rejected_logps");
}

const OBJECTIVES: [&str; 4] = ["sft", "dpo", "dpo_sft", "grpo"];

/// `(mode, chunk, logits_chunk)`: chunk 1, chunks that do not divide the batches' lengths (and cross
/// Gemma3's window of 4), chunk ≥ T, logits chunk 1 and ≥ T.
const RUNS: [(Mode, usize, usize); 6] = [
    (Mode::Checkpoint, 1, 1),
    (Mode::Stream, 1, 1),
    (Mode::Stream, 3, 4),
    (Mode::Stream, 5, 1),
    (Mode::Stream, 4, 16),
    (Mode::Stream, 16, 3),
];

#[test]
fn adapter_gradients_match_full_backward_and_peft() {
    for family in FAMILIES {
        let model = lora_model(family, 0.0);
        let r = lora_reference(family);
        for objective in OBJECTIVES {
            assert_matches_peft(&model, family, objective, &r);
        }
    }
}

/// GRPO's sequence-level weights (grpo and luspo), vespo, the off-policy mask and the entropy
/// terms, RLOO, and distillation from a wider teacher, through the adapters, against TRL's own
/// `_compute_loss` on PEFT's float64 model (scripts/make_grpo_trl_fixtures.py,
/// make_rloo_fixtures.py, make_distill_fixtures.py: `lora/grpo_trl.safetensors`,
/// `lora/rloo.safetensors`, `lora/distill.safetensors`, the variants each holds).
#[test]
fn trl_objectives_match_trl_with_lora() {
    for family in FAMILIES {
        let model = lora_model(family, 0.0);
        let load = |file: &str| {
            candle_core::safetensors::load(lora_dir(family).join(file), &Device::Cpu)
                .unwrap_or_else(|e| panic!("fixture lora/{file}: {e}"))
        };
        let grpo = load("grpo_trl.safetensors");
        let threshold = grpo["off_policy.threshold"].to_vec1::<f64>().unwrap()[0];
        for (r, variants, count) in [
            (grpo, trl_variants::variants(threshold), 5),
            (load("rloo.safetensors"), trl_variants::rloo_variants(), 1),
            (
                load("distill.safetensors"),
                trl_variants::distill_variants(),
                1,
            ),
        ] {
            let in_fixture: Vec<_> = variants
                .iter()
                .filter(|v| r.contains_key(&format!("{}.loss", v.name)))
                .collect();
            assert_eq!(
                in_fixture.len(),
                count,
                "{family}: the fixture's LoRA variants"
            );
            for v in in_fixture {
                assert_batch_matches(&model, (family, v.name), v.edit.as_ref(), &r);
            }
        }
    }
}

/// The edited GRPO batch of `family` on `model` in every mode and chunking: the loss and every
/// adapter gradient equal the full backward's and the reference `r`'s (`{variant}.loss`,
/// `{variant}.grad.{key}`).
fn assert_batch_matches(
    model: &Model,
    (family, variant): (&str, &str),
    edit: &dyn Fn(&mut serde_json::Value),
    r: &HashMap<String, Tensor>,
) {
    let batch = edited_batch(family, "grpo-batch.json", edit, &model.config);
    let run = |mode, (chunk, logits_chunk)| {
        let input = Batch::new(&batch.input_ids, batch.attention_mask.as_ref());
        let chunks = Chunks {
            chunk,
            logits_chunk,
        };
        backward_with(
            model,
            input,
            batch.objective.as_ref(),
            Plan::new(mode, chunks),
        )
        .unwrap()
    };
    let full = run(Mode::Full, (1, 1));
    for (mode, chunk, logits_chunk) in [(Mode::Full, 1, 1)].into_iter().chain(RUNS) {
        let out = run(mode, (chunk, logits_chunk));
        let what = format!("{family} {variant} {mode} {chunk}/{logits_chunk} (PEFT)");
        assert_exact(&what, (out.loss, &out.grads), &full.grads, (r, variant));
    }
}

/// ORPO, CPO (SimPO with smoothing, AlphaPO) and KTO through the same adapters, against TRL's own
/// loss code on PEFT's float64 model (scripts/make_lora_preference_fixtures.py: KTO's KL baseline
/// made 0.3); and a LoRA reward model, its score head trained beside the adapters as PEFT's
/// `SEQ_CLS` does (the fixture's `reward/lora`), against TRL's `RewardTrainer` on PEFT's classifier.
#[test]
fn new_objectives_and_lora_reward_models_match_peft() {
    for family in FAMILIES {
        let model = lora_model(family, 0.0);
        let r = candle_core::safetensors::load(
            lora_dir(family).join("preference.safetensors"),
            &Device::Cpu,
        )
        .expect("fixture lora/preference.safetensors");
        for objective in ["orpo", "cpo_simpo", "alphapo", "kto"] {
            assert_matches_peft(&model, family, objective, &r);
        }
        let case = format!("{family}/reward");
        let base = load_model(&fixture_dir(&case), DType::F64, &Device::Cpu).unwrap();
        let adapter = load_adapter(&lora_dir(&case), &Device::Cpu).unwrap();
        let model = base
            .with_lora(adapter.config, Some(adapter.tensors), 0)
            .unwrap();
        let r = candle_core::safetensors::load(
            lora_dir(&case).join("reference.safetensors"),
            &Device::Cpu,
        )
        .expect("fixture reward/lora/reference.safetensors");
        for objective in ["reward", "reward_margin_center"] {
            assert_matches_peft(&model, &case, objective, &r);
        }
        // Written back, the adapter is PEFT's: the same tensors under the same keys, the score
        // head's included, and PEFT's SEQ_CLS settings.
        let out = tempfile::tempdir().unwrap();
        save_adapter(&model, None, out.path()).unwrap();
        let ours = candle_core::safetensors::load(
            out.path().join("adapter_model.safetensors"),
            &Device::Cpu,
        )
        .unwrap();
        let peft = candle_core::safetensors::load(
            lora_dir(&case).join("adapter_model.safetensors"),
            &Device::Cpu,
        )
        .unwrap();
        assert_eq!(ours.len(), peft.len(), "{case}");
        for (key, t) in &peft {
            let written = ours[key].to_dtype(t.dtype()).unwrap();
            assert_eq!(rel_err(&written, t), 0.0, "{case}: {key}");
        }
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.path().join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(config["task_type"], "SEQ_CLS");
        assert_eq!(
            config["modules_to_save"],
            serde_json::json!(["classifier", "score"])
        );
    }
}

/// `objective` on `model` (the adapters of `case`'s fixture) in every mode and chunking: the loss and
/// every trained parameter's gradient equal the full backward's within 1e-10 and the PEFT
/// reference `r`'s (`{objective}.loss`, `{objective}.grad.{key}`) within 1e-8.
fn assert_matches_peft(model: &Model, case: &str, objective: &str, r: &HashMap<String, Tensor>) {
    let full = backward(model, case, objective, Mode::Full, (1, 1), None);
    let mut worst = 0.0f64;
    for (mode, chunk, logits_chunk) in [(Mode::Full, 1, 1)].into_iter().chain(RUNS) {
        let out = match mode {
            Mode::Full => None,
            _ => Some(backward(
                model,
                case,
                objective,
                mode,
                (chunk, logits_chunk),
                None,
            )),
        };
        let out = out.as_ref().unwrap_or(&full);
        // Only the adapters (and a reward model's score head) are trained, under PEFT's keys.
        let expected = r
            .keys()
            .filter(|k| k.starts_with(&format!("{objective}.grad.")))
            .count();
        assert_eq!(out.grads.len(), expected, "{case} {objective}");
        let what = format!("{case} {objective} {mode} {chunk}/{logits_chunk} (PEFT)");
        let run_worst = assert_exact(&what, (out.loss, &out.grads), &full.grads, (r, objective));
        worst = worst.max(run_worst);
    }
    println!("{case} {objective}: worst adapter gradient error vs PEFT {worst:.2e}");
}

/// Dropout masks come from the token's place, not a running generator: every mode and chunking sees
/// the same masks, so the streamed gradients still equal the full backward's.
#[test]
fn dropout_stays_exact_in_every_mode() {
    for family in FAMILIES {
        let model = lora_model(family, 0.3);
        for objective in OBJECTIVES {
            let key = Some(17);
            let full = backward(&model, family, objective, Mode::Full, (1, 1), key);
            let plain = backward(&model, family, objective, Mode::Full, (1, 1), None);
            let (changed, _) = worst_grad_err(&full, &plain);
            assert!(
                changed > 1e-3,
                "{family} {objective}: dropout changes nothing ({changed:.1e})"
            );
            for (mode, chunk, logits_chunk) in RUNS {
                let out = backward(&model, family, objective, mode, (chunk, logits_chunk), key);
                let (err, name) = worst_grad_err(&out, &full);
                assert!(
                    err < 1e-10,
                    "{family} {objective} {mode} {chunk}/{logits_chunk} with dropout: {name} off by {err:.2e}"
                );
                assert!((out.loss - full.loss).abs() < 1e-12 * full.loss.abs());
            }
        }
    }
}

/// DPO's other loss types on the adapters (IPO's length averaging, aot's batch-wide sorts, a weighted
/// list with the NLL term), GRPO's (dapo at temperature 0.7, cispo, sapo), ORPO, CPO (SimPO with
/// smoothing, AlphaPO) and KTO, with dropout: every mode and chunking equals the full backward.
#[test]
fn dpo_loss_types_stay_exact_with_lora() {
    for family in FAMILIES {
        let model = lora_model(family, 0.3);
        for objective in [
            "dpo_ipo",
            "dpo_aot_unpaired",
            "dpo_list",
            "grpo_dapo",
            "grpo_cispo",
            "grpo_sapo",
            "orpo",
            "cpo_simpo",
            "alphapo",
            "kto",
        ] {
            let key = Some(5);
            let full = backward(&model, family, objective, Mode::Full, (1, 1), key);
            for (mode, chunk, logits_chunk) in RUNS {
                let out = backward(&model, family, objective, mode, (chunk, logits_chunk), key);
                let (err, name) = worst_grad_err(&out, &full);
                assert!(
                    err < 1e-10,
                    "{family} {objective} {mode} {chunk}/{logits_chunk}: {name} off by {err:.2e}"
                );
                assert!((out.loss - full.loss).abs() < 1e-12 * full.loss.abs().max(1.0));
            }
        }
    }
}

/// The worst per-tensor relative error between two gradient sets (same names, same order).
fn worst_grad_err(a: &Gradients, b: &Gradients) -> (f64, String) {
    let mut worst = (0.0, String::new());
    for ((na, ga), (nb, gb)) in a.grads.iter().zip(&b.grads) {
        assert_eq!(na, nb);
        let e = rel_err(ga, gb);
        if e >= worst.0 {
            worst = (e, na.clone());
        }
    }
    worst
}

#[test]
fn merged_model_gives_the_adapters_logits() {
    for family in FAMILIES {
        let model = lora_model(family, 0.0);
        let r = reference(family);
        let peft = lora_reference(family);
        let ids = r["input_ids"].to_dtype(DType::U32).unwrap();
        let mask = &r["attention_mask"];
        let logits = model.detached().forward(&ids, Some(mask)).unwrap();
        let err = masked_rel_err(&logits, &peft["logits"], mask);
        assert!(err < 1e-10, "{family}: adapter logits vs PEFT {err:.2e}");
        let merged = Model::from_tensors(
            model.config.clone(),
            model.merged_weights().unwrap().into_iter().collect(),
        )
        .unwrap();
        let merged_logits = merged.detached().forward(&ids, Some(mask)).unwrap();
        let err = masked_rel_err(&merged_logits, &peft["merged_logits"], mask);
        assert!(
            err < 1e-10,
            "{family}: merged logits vs PEFT's merge_and_unload {err:.2e}"
        );
        // Adapters off: the base model's logits.
        let base = model.without_adapters().forward(&ids, Some(mask)).unwrap();
        let err = masked_rel_err(&base, &r["logits"], mask);
        assert!(err < 1e-10, "{family}: base logits {err:.2e}");
    }
}

/// A safetensors file as written: its sorted keys, its tensors and its metadata.
type SafetensorsFile = (
    Vec<String>,
    HashMap<String, Tensor>,
    Option<HashMap<String, String>>,
);

/// An edit of an adapter directory, and a fragment of the error it must cause.
type BadCase = (Box<dyn Fn(&Path)>, &'static str);

/// The keys, tensors and metadata of a safetensors file.
fn read_safetensors(path: &Path) -> SafetensorsFile {
    let bytes = std::fs::read(path).unwrap();
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let tensors = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    let mut keys: Vec<String> = tensors.keys().cloned().collect();
    keys.sort();
    (keys, tensors, metadata.metadata().clone())
}

/// An adapter loaded from PEFT's files and written back by streambp is PEFT's adapter: the same keys,
/// the same f32 values to the bit, `{"format": "pt"}` metadata, and the settings PEFT reads.
#[test]
fn written_adapters_are_what_peft_writes() {
    for family in FAMILIES {
        let base = load_model(&fixture_dir(family), DType::F32, &Device::Cpu).unwrap();
        let adapter = load_adapter(&lora_dir(family), &Device::Cpu).unwrap();
        let model = base
            .with_lora(adapter.config, Some(adapter.tensors), 0)
            .unwrap();
        let out = tempfile::tempdir().unwrap();
        save_adapter(&model, Some("tests/fixtures"), out.path()).unwrap();

        let (peft_keys, peft_tensors, peft_meta) =
            read_safetensors(&lora_dir(family).join("adapter_model.safetensors"));
        let (keys, tensors, meta) = read_safetensors(&out.path().join("adapter_model.safetensors"));
        assert_eq!(keys, peft_keys, "{family}");
        for k in &keys {
            assert_eq!(tensors[k].dtype(), DType::F32);
            assert_eq!(rel_err(&tensors[k], &peft_tensors[k]), 0.0, "{family} {k}");
        }
        assert_eq!(meta, peft_meta);
        assert_eq!(meta.unwrap()["format"], "pt");

        let read = |p: &Path| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(p.join("adapter_config.json")).unwrap())
                .unwrap()
        };
        let (ours, theirs) = (read(out.path()), read(&lora_dir(family)));
        for field in [
            "peft_type",
            "task_type",
            "r",
            "lora_alpha",
            "use_rslora",
            "lora_dropout",
            "bias",
            "fan_in_fan_out",
        ] {
            assert_eq!(ours[field], theirs[field], "{family} {field}");
        }
        assert_eq!(ours["base_model_name_or_path"], "tests/fixtures");
        // The same modules, whether named (PEFT keeps names it was given) or as paths (all-linear).
        let names = |v: &serde_json::Value| -> std::collections::BTreeSet<String> {
            v["target_modules"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_str().unwrap().rsplit('.').next().unwrap().to_string())
                .collect()
        };
        assert_eq!(names(&ours), names(&theirs), "{family}");
        // And it loads back into the same model.
        let again = load_adapter(out.path(), &Device::Cpu).unwrap();
        assert_eq!(again.config, model.lora().unwrap().clone());
    }
}

/// A broken adapter is an error naming the file (and the tensor or field); nothing panics.
#[test]
fn bad_adapters_are_clear_errors() {
    let base = || load_model(&fixture_dir("qwen3"), DType::F64, &Device::Cpu).unwrap();
    let copy = |edit: &dyn Fn(&Path)| {
        let dir = tempfile::tempdir().unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(lora_dir("qwen3").join(f), dir.path().join(f)).unwrap();
        }
        edit(dir.path());
        dir
    };
    let try_load = |dir: &Path| -> String {
        match load_adapter(dir, &Device::Cpu) {
            Err(e) => e.to_string(),
            Ok(a) => match base().with_lora(a.config, Some(a.tensors), 0) {
                Err(e) => e.to_string(),
                Ok(_) => String::new(),
            },
        }
    };
    let set = |key: &'static str, value: serde_json::Value| {
        move |dir: &Path| {
            let path = dir.join("adapter_config.json");
            let mut v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            v[key] = value.clone();
            std::fs::write(&path, v.to_string()).unwrap();
        }
    };
    let cases: Vec<BadCase> = vec![
        (
            Box::new(set("peft_type", "PREFIX_TUNING".into())),
            "peft_type \"PREFIX_TUNING\": only LORA",
        ),
        (
            Box::new(set("r", 0.into())),
            "the rank must be a whole number of at least 1",
        ),
        (
            Box::new(set("use_dora", true.into())),
            "use_dora: true is not supported",
        ),
        (Box::new(set("bias", "all".into())), "bias \"all\""),
        (
            Box::new(set("target_modules", serde_json::json!(["q_proj"]))),
            "target_modules does not name it",
        ),
        (
            Box::new(|d: &Path| std::fs::remove_file(d.join("adapter_model.safetensors")).unwrap()),
            "adapter_model.safetensors",
        ),
        (
            Box::new(|d: &Path| std::fs::write(d.join("adapter_config.json"), "{").unwrap()),
            "adapter_config.json: invalid config: not valid JSON",
        ),
    ];
    for (edit, fragment) in cases {
        let dir = copy(edit.as_ref());
        let err = try_load(dir.path());
        assert!(err.contains(fragment), "want {fragment:?}, got {err:?}");
    }
    // Another model's adapter: its matrices do not fit this base (qwen2's q_proj is 32 wide as well,
    // but its adapter sits on other projections and its v_proj differs in shape).
    let qwen2 = load_adapter(&lora_dir("qwen2"), &Device::Cpu).unwrap();
    let llama = load_model(&fixture_dir("llama3"), DType::F64, &Device::Cpu).unwrap();
    let err = llama
        .with_lora(qwen2.config, Some(qwen2.tensors), 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("lora"), "{err}");
}

/// An adapter streambp writes after changing it (fresh `A`, random `B`), with the logits streambp
/// computes with it on the fixture's SFT batch: `scripts/make_lora_fixtures.py --check DIR` loads it
/// in PEFT and compares. The files go to `STREAMBP_PEFT_CHECK_DIR` when set (a manual cross-check;
/// docs/lora.md records its result), else to a temporary directory.
#[test]
fn writes_an_adapter_for_the_peft_cross_check() {
    let family = "qwen3";
    let base = load_model(&fixture_dir(family), DType::F64, &Device::Cpu).unwrap();
    let config = LoraConfig {
        r: 3,
        alpha: 5.0,
        targets: vec![
            streambp_models::Projection::K,
            streambp_models::Projection::O,
            streambp_models::Projection::Up,
        ],
        use_rslora: true,
        dropout: 0.0,
    };
    let model = base.with_lora(config, None, 11).unwrap();
    let mut rng = streambp_models::init::NormalRng::new(5);
    for (name, var) in model.parameters() {
        if name.contains("lora_B") {
            let t = rng
                .tensor(var.dims(), 0.0, 0.3, DType::F32, &Device::Cpu)
                .unwrap();
            var.set(&t.to_dtype(DType::F64).unwrap()).unwrap();
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = std::env::var_os("STREAMBP_PEFT_CHECK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| tmp.path().to_path_buf());
    std::fs::create_dir_all(&dir).unwrap();
    save_adapter(&model, None, &dir).unwrap();
    let r = reference(family);
    let ids = r["input_ids"].to_dtype(DType::U32).unwrap();
    let logits = model
        .detached()
        .forward(&ids, Some(&r["attention_mask"]))
        .unwrap();
    let tensors = HashMap::from([("logits".to_string(), logits)]);
    streambp_models::save_safetensors(&tensors, &dir.join("logits.safetensors")).unwrap();
    let check = serde_json::json!({"family": family, "logits": "logits.safetensors"});
    std::fs::write(dir.join("check.json"), check.to_string()).unwrap();
    // The adapter it wrote reads back as the model it came from.
    let again = load_adapter(&dir, &Device::Cpu).unwrap();
    let reloaded = load_model(&fixture_dir(family), DType::F64, &Device::Cpu)
        .unwrap()
        .with_lora(again.config, Some(again.tensors), 0)
        .unwrap();
    let logits2 = reloaded
        .detached()
        .forward(&ids, Some(&r["attention_mask"]))
        .unwrap();
    assert!(masked_rel_err(&logits2, &tensors["logits"], &r["attention_mask"]) < 1e-12);
}
