//! Every DPO loss type of TRL 1.16 against TRL's own `_compute_loss` in float64
//! (`scripts/dpo_loss_reference.py` wrote `tests/fixtures/dpo_loss_types/trl.json`): the loss and
//! its gradient in each pair's chosen and rejected log-probs, within 1e-12 (`exo_pair`: 1e-8, as
//! TRL takes its `log ε` constants in float32).

use candle_core::{DType, Device, Tensor, Var};
use serde_json::Value;
use streambp_objectives::{Dpo, DpoLoss, Objective, TokenTargets};

fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/dpo_loss_types/trl.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// The fixture's batch as engine rows: each row's completion tokens after a prompt token (label
/// -100), right-padded; per-token log-probs whose row sums are the fixture's sequence log-probs
/// (the chosen rows' own tokens, which `sft` reads; the rejected rows' sums spread evenly).
struct Batch {
    labels: Vec<Vec<i64>>,
    logp: Vec<Vec<f64>>,
}

fn batch(f: &Value) -> Batch {
    let mut rows: Vec<Vec<f64>> = f["chosen_token_logps"]
        .as_array()
        .unwrap()
        .iter()
        .map(floats)
        .collect();
    let rejected = floats(&f["rejected_logps"]);
    let rejected_n = floats(&f["rejected_completion_tokens"]);
    rows.extend(
        rejected
            .iter()
            .zip(&rejected_n)
            .map(|(&sum, &n)| vec![sum / n; n as usize]),
    );
    let t = rows.iter().map(Vec::len).max().unwrap() + 2;
    let mut labels = Vec::new();
    let mut logp = Vec::new();
    for row in &rows {
        // The log-prob at position i is that of label i + 1 (labels are shifted inside).
        let mut l = vec![-100i64; t];
        let mut p = vec![0.0; t];
        for (k, &v) in row.iter().enumerate() {
            l[k + 1] = 3;
            p[k] = v;
        }
        labels.push(l);
        logp.push(p);
    }
    Batch { labels, logp }
}

/// `"0.8*sigmoid+0.2*bco_pair+1.0*sft"` as names and weights.
fn terms(name: &str) -> (Vec<&str>, Vec<f64>) {
    name.split('+')
        .map(|term| match term.split_once('*') {
            Some((w, n)) => (n, w.parse::<f64>().unwrap()),
            None => (term, 1.0),
        })
        .unzip()
}

#[test]
fn every_dpo_loss_type_matches_trl() {
    let f = fixture();
    let b = batch(&f);
    let device = Device::Cpu;
    let mask = TokenTargets::from_labels(&b.labels, 8, &device)
        .unwrap()
        .mask
        .to_vec2::<f64>()
        .unwrap();
    // The rows' masked sums are the fixture's sequence log-probs.
    let expected = [floats(&f["chosen_logps"]), floats(&f["rejected_logps"])].concat();
    for ((p, m), e) in b.logp.iter().zip(&mask).zip(&expected) {
        let sum: f64 = p.iter().zip(m).map(|(a, b)| a * b).sum();
        assert!((sum - e).abs() < 1e-12, "row sum {sum} vs {e}");
    }
    let (ref_c, ref_r) = (
        floats(&f["ref_chosen_logps"]),
        floats(&f["ref_rejected_logps"]),
    );
    let beta = f["beta"].as_f64().unwrap();
    let mut checked = 0;
    for (name, want) in f["losses"].as_object().unwrap() {
        let (names, weights) = terms(name);
        let mut loss = DpoLoss::from_names(&names, Some(&weights)).unwrap();
        // TRL reads ε only in the smoothed types (and refusing it elsewhere is ours).
        if loss.terms.iter().any(|(t, _)| t.smoothed()) {
            loss.label_smoothing = f["label_smoothing"].as_f64().unwrap();
        }
        loss.discopop_tau = f["discopop_tau"].as_f64().unwrap();
        let dpo = Dpo::new(&b.labels, &ref_c, &ref_r, beta, 8, &device)
            .unwrap()
            .with_loss(loss)
            .unwrap();
        let logp = Var::from_tensor(&Tensor::new(b.logp.clone(), &device).unwrap()).unwrap();
        let value = dpo.loss(logp.as_tensor(), 0..b.logp[0].len()).unwrap();
        let got = value
            .to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        let grads = value.backward().unwrap();
        let grad = grads
            .get(logp.as_tensor())
            .unwrap()
            .to_vec2::<f64>()
            .unwrap();
        let tolerance = if name.contains("exo_pair") {
            1e-8
        } else {
            1e-12
        };
        let loss_want = want["loss"].as_f64().unwrap();
        assert!(
            (got - loss_want).abs() <= tolerance * loss_want.abs().max(1.0),
            "{name}: loss {got} vs TRL {loss_want}"
        );
        // Every completion token of a row has the row's gradient (TRL's gradient of the sequence's
        // log-prob; for sft, of one of its tokens).
        let rows_want = [
            floats(&want["d_chosen_logps"]),
            floats(&want["d_rejected_logps"]),
        ]
        .concat();
        for (row, w) in rows_want.iter().enumerate() {
            for (k, g) in grad[row].iter().enumerate() {
                let w = if mask[row][k] > 0.0 { *w } else { 0.0 };
                assert!(
                    (g - w).abs() <= tolerance * w.abs().max(1e-3),
                    "{name}: row {row} position {k}: gradient {g} vs TRL {w}"
                );
            }
        }
        checked += 1;
    }
    assert_eq!(checked, 17, "15 loss types and 2 weighted lists");
}

#[test]
fn loss_types_parse_as_trl_names_them() {
    let loss =
        DpoLoss::from_names(&["sigmoid", "aot_pair", "sft"], Some(&[1.0, 0.5, 2.0])).unwrap();
    assert_eq!(loss.describe(), "sigmoid+0.5*aot_unpaired+2*sft");
    assert_eq!(loss.sft_weight(), 2.0);
    assert!(DpoLoss::from_names(&["ppo"], None).is_err());
    assert!(DpoLoss::from_names(&["sigmoid", "ipo"], Some(&[1.0])).is_err());
    let exo = DpoLoss::from_names(&["exo_pair"], None).unwrap();
    assert!(
        exo.validate().is_err(),
        "exo_pair needs label_smoothing above 0"
    );
    let sigmoid = DpoLoss {
        label_smoothing: 0.1,
        ..DpoLoss::default()
    };
    assert!(
        sigmoid.validate().is_err(),
        "TRL 1.16's sigmoid reads no label smoothing"
    );
}
