//! The variants of the fixtures made by TRL's own `_compute_loss`, as edits of a family's
//! grpo-batch.json: GRPO's options beyond the token-level loss types ([`variants`],
//! scripts/make_grpo_trl_fixtures.py, `grpo_trl.safetensors`) and RLOO ([`rloo_variants`],
//! scripts/make_rloo_fixtures.py, `rloo.safetensors`): the scripts' VARIANTS.

/// An edit of a batch file's JSON.
pub type Edit = Box<dyn Fn(&mut serde_json::Value)>;

/// One variant: its name in the fixture, the edit that makes it, the metrics TRL logged for it.
pub struct Variant {
    pub name: &'static str,
    pub edit: Edit,
    pub metrics: &'static [&'static str],
}

/// Every GRPO variant of the script, `threshold` the fixture's `off_policy.threshold`.
pub fn variants(threshold: f64) -> Vec<Variant> {
    use serde_json::Value;
    let set = |pairs: Vec<(&'static str, Value)>| -> Edit {
        Box::new(move |j| {
            for (k, v) in &pairs {
                j[*k] = v.clone();
            }
        })
    };
    let sequence = || ("importance_sampling_level", Value::from("sequence"));
    let loss = |name: &str| ("loss_type", Value::from(name));
    // A tighter clip than the batch's 0.2, so that some sequence weights clip.
    let gspo_epsilon = || ("epsilon", Value::from(0.05));
    // TRL's num_items_in_batch as a third of the global batch, for the dapo-reduced types.
    let third = |edit: Edit| -> Edit {
        Box::new(move |j| {
            edit(j);
            let tokens: f64 = j["completion_mask"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|r| r.as_array().unwrap())
                .map(|m| m.as_f64().unwrap())
                .sum();
            j["num_items_in_batch"] = (3.0 * tokens).into();
        })
    };
    // The loss types that clip nothing may not be given epsilon.
    let unclipped = |edit: Edit| -> Edit {
        Box::new(move |j| {
            edit(j);
            j.as_object_mut().unwrap().remove("epsilon");
        })
    };
    let off_policy = || ("off_policy_mask_threshold", Value::from(threshold));
    let variant = |name, edit, metrics| Variant {
        name,
        edit,
        metrics,
    };
    let kl_clip: &'static [&'static str] = &["kl", "clip_ratio"];
    let kl_phi: &'static [&'static str] = &["kl", "vespo/phi_seq_mean"];
    let with_entropy: &'static [&'static str] = &["kl", "clip_ratio", "entropy"];
    vec![
        variant(
            "gspo",
            set(vec![sequence(), loss("grpo"), gspo_epsilon()]),
            kl_clip,
        ),
        variant(
            "gspo_plain_kl",
            set(vec![
                sequence(),
                loss("grpo"),
                gspo_epsilon(),
                ("use_bias_correction_kl", false.into()),
            ]),
            kl_clip,
        ),
        variant(
            "gspo_cispo",
            unclipped(set(vec![
                sequence(),
                loss("cispo"),
                ("epsilon_high", 1.02.into()),
            ])),
            kl_clip,
        ),
        variant(
            "gspo_sapo",
            unclipped(set(vec![sequence(), loss("sapo")])),
            &["kl"],
        ),
        variant(
            "gspo_noold",
            Box::new(|j: &mut Value| {
                let o = j.as_object_mut().unwrap();
                o.remove("old_logps");
                o.remove("ref_logps");
                o.insert("beta".into(), 0.0.into());
                o.insert("loss_type".into(), "grpo".into());
                o.insert("importance_sampling_level".into(), "sequence".into());
            }),
            &["clip_ratio"],
        ),
        variant(
            "luspo",
            set(vec![sequence(), loss("luspo"), gspo_epsilon()]),
            kl_clip,
        ),
        variant("luspo_token", set(vec![loss("luspo")]), kl_clip),
        variant("vespo", third(unclipped(set(vec![loss("vespo")]))), kl_phi),
        variant(
            "vespo_shape",
            third(unclipped(set(vec![
                loss("vespo"),
                ("vespo_k_pos", 1.5.into()),
                ("vespo_lambda_pos", 0.5.into()),
                ("vespo_k_neg", 0.7.into()),
                ("vespo_lambda_neg", 4.0.into()),
            ]))),
            kl_phi,
        ),
        variant(
            "vespo_sequence",
            third(unclipped(set(vec![loss("vespo"), sequence()]))),
            kl_phi,
        ),
        variant("off_policy", set(vec![loss("grpo"), off_policy()]), kl_clip),
        variant(
            "off_policy_gspo",
            third(set(vec![loss("dapo"), sequence(), off_policy()])),
            kl_clip,
        ),
        variant(
            "entropy_bonus",
            set(vec![loss("grpo"), ("entropy_coef", 0.05.into())]),
            with_entropy,
        ),
        variant(
            "top_entropy",
            third(set(vec![
                loss("dapo"),
                ("top_entropy_quantile", 0.3.into()),
            ])),
            with_entropy,
        ),
        variant(
            "top_entropy_bonus",
            set(vec![
                loss("bnpo"),
                ("top_entropy_quantile", 0.5.into()),
                ("entropy_coef", (-0.1).into()),
            ]),
            with_entropy,
        ),
        variant(
            "entropy_gspo",
            set(vec![
                loss("grpo"),
                sequence(),
                gspo_epsilon(),
                ("entropy_coef", 0.02.into()),
                ("top_entropy_quantile", 0.0.into()),
            ]),
            with_entropy,
        ),
    ]
}

/// The fixture's key of `metric` for `variant`: TRL logs the clip fraction as
/// `clip_ratio/region_mean`, cispo's as `cispo_clip_ratio` ('/' written '_').
pub fn metric_key(variant: &str, metric: &str) -> String {
    let key = match (metric, variant.ends_with("cispo")) {
        ("clip_ratio", true) => "cispo_clip_ratio".to_string(),
        ("clip_ratio", false) => "clip_ratio_region_mean".to_string(),
        (m, _) => m.replace('/', "_"),
    };
    format!("{variant}.{key}")
}

/// The rewards scripts/make_rloo_fixtures.py gives the batch's completions.
pub const RLOO_REWARDS: [f64; 4] = [1.0, 0.2, -0.5, 0.7];

/// Every RLOO variant of scripts/make_rloo_fixtures.py: the GRPO batch as an RLOO one (rewards for
/// advantages, TRL's RLOO defaults: beta 0.05, two completions a prompt), then the variant's settings.
pub fn rloo_variants() -> Vec<Variant> {
    use serde_json::Value;
    let rloo = |edit: fn(&mut serde_json::Map<String, Value>)| -> Edit {
        Box::new(move |j| {
            let o = j.as_object_mut().unwrap();
            for key in ["advantages", "beta", "max_completion_length"] {
                o.remove(key);
            }
            o.insert("objective".into(), "rloo".into());
            o.insert("rewards".into(), RLOO_REWARDS.to_vec().into());
            edit(o);
        })
    };
    let variant = |name, edit, metrics| Variant {
        name,
        edit,
        metrics,
    };
    let kl_clip: &'static [&'static str] = &["kl", "clip_ratio"];
    vec![
        variant("rloo", rloo(|_| {}), kl_clip),
        variant(
            "normalized",
            rloo(|o| {
                o.insert("num_generations".into(), 4.into());
                o.insert("normalize_advantages".into(), true.into());
            }),
            kl_clip,
        ),
        variant(
            "beta0",
            rloo(|o| {
                o.insert("beta".into(), 0.0.into());
                o.insert("epsilon".into(), 0.1.into());
                o.insert("epsilon_high".into(), 0.28.into());
            }),
            &["clip_ratio"],
        ),
        variant(
            "noold",
            rloo(|o| {
                o.remove("old_logps");
            }),
            kl_clip,
        ),
        variant(
            "temperature",
            rloo(|o| {
                o.insert("temperature".into(), 0.7.into());
            }),
            kl_clip,
        ),
    ]
}

/// Every distillation variant of scripts/make_distill_fixtures.py: the GRPO batch's rows with their
/// completion mask, TRL's defaults (beta 1, the reverse KL; temperature 1), then the variant's.
pub fn distill_variants() -> Vec<Variant> {
    use serde_json::Value;
    let distill = |beta: Option<f64>, temperature: Option<f64>| -> Edit {
        Box::new(move |j: &mut Value| {
            let o = j.as_object_mut().unwrap();
            for key in [
                "advantages",
                "old_logps",
                "ref_logps",
                "beta",
                "epsilon",
                "max_completion_length",
            ] {
                o.remove(key);
            }
            o.insert("objective".into(), "distill".into());
            if let Some(beta) = beta {
                o.insert("beta".into(), beta.into());
            }
            if let Some(t) = temperature {
                o.insert("temperature".into(), t.into());
            }
        })
    };
    let variant = |name, edit| Variant {
        name,
        edit,
        metrics: &["entropy"],
    };
    vec![
        variant("reverse_kl", distill(None, None)),
        variant("forward_kl", distill(Some(0.0), None)),
        variant("jsd", distill(Some(0.5), None)),
        variant("jsd_temperature", distill(Some(0.3), Some(0.7))),
    ]
}
