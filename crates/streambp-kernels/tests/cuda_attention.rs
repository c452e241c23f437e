//! On a CUDA device (a build with `--features cuda`; skipped when no GPU is present): the attention op
//! on the card by the fused Triton kernels gives the CPU's output and gradients (q, k, v, and the
//! earlier keys' gradients added into their buffers) in f32 to f32 rounding, and in bf16 within
//! bf16's, on the shapes a streamed backward gives it: chunk 1, a chunk not a multiple of the blocks,
//! no earlier keys and the whole prefix, GQA 1 to 8, head dims 64/128/256, sliding windows that cut a
//! chunk, packed documents, padding and batch 2. The fused kernels must have run (their launches are
//! counted), and the composed tensor ops the card ran before them stay beside as the second reference.
//!
//! To run on the GPU machine: build with `CARGO_TARGET_DIR=target-cuda cargo test --release -p
//! streambp-kernels --features cuda --test cuda_attention --no-run` and carry the binary.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor, Var};
use streambp_kernels::backend::with_composed;
use streambp_kernels::ops::attention::{
    attention_over_heads, fused_launches, Blocking, EarlierKeys, KeyMask, MaskStructure, Products,
    KEY_BLOCK,
};
use streambp_testkit::rel_err;

/// A chunk's mask by rule, as the model's: its bias for the block path, its structure for the card.
#[derive(Clone)]
struct RuleMask {
    rule: Rule,
    device: Device,
}

#[derive(Clone, Copy, Debug)]
struct Rule {
    b: usize,
    q_start: usize,
    rows: usize,
    k_start: usize,
    t: usize,
    window: Option<usize>,
    /// Each row's document starts (packed rows), and its real tokens (right padding).
    docs: Option<[&'static [usize]; 2]>,
    real: Option<[usize; 2]>,
}

impl Rule {
    fn doc_start(&self) -> Option<Vec<i64>> {
        let docs = self.docs?;
        let mut out = Vec::new();
        for starts in docs.iter().take(self.b) {
            let first = |i: usize| *starts.iter().filter(|&&s| s <= i).max().unwrap_or(&0) as i64;
            out.extend((0..self.t).map(first));
        }
        Some(out)
    }

    fn valid(&self) -> Option<Vec<u8>> {
        let real = self.real?;
        Some(
            (0..self.b)
                .flat_map(|row| (0..self.t).map(move |i| (i < real[row]) as u8))
                .collect(),
        )
    }

    fn reads(&self, row: usize, i: usize, key: usize) -> bool {
        let q = self.q_start + i;
        let causal = key <= q;
        let window = self.window.is_none_or(|w| key + w > q);
        let doc = self
            .doc_start()
            .is_none_or(|d| key as i64 >= d[row * self.t + q]);
        let valid = self.valid().is_none_or(|v| v[row * self.t + key] != 0);
        causal && window && doc && valid
    }
}

impl KeyMask for RuleMask {
    fn bias(&self, start: usize, n: usize, dtype: DType) -> candle_core::Result<Option<Tensor>> {
        let r = self.rule;
        let mut bias = Vec::with_capacity(r.b * r.rows * n);
        for row in 0..r.b {
            for i in 0..r.rows {
                for j in 0..n {
                    let read = r.reads(row, i, r.k_start + start + j);
                    bias.push(if read { 0.0f32 } else { f32::MIN });
                }
            }
        }
        let bias = Tensor::from_vec(bias, (r.b, 1, 1, r.rows, n), &self.device)?;
        Ok(Some(bias.to_dtype(dtype)?))
    }

    fn structure(&self) -> Option<MaskStructure> {
        let r = self.rule;
        let on = |t: Tensor| t.to_device(&self.device).unwrap();
        Some(MaskStructure {
            q_start: r.q_start,
            k_start: r.k_start,
            window: r.window,
            doc_start: r
                .doc_start()
                .map(|d| on(Tensor::from_vec(d, (r.b, r.t), &Device::Cpu).unwrap())),
            key_valid: r
                .valid()
                .map(|v| on(Tensor::from_vec(v, (r.b, r.t), &Device::Cpu).unwrap())),
        })
    }
}

/// One case: heads, key/value heads, head dim, earlier keys, and the rule.
struct Case {
    heads: usize,
    kv_heads: usize,
    hd: usize,
    earlier: usize,
    rule: Rule,
}

/// Output, dq, dk (whole: earlier then own), dv, as f32 on the CPU.
type Run = [Tensor; 4];

/// The op on `device` in `dtype` over the case's inputs (drawn from `seed` on the CPU), with the
/// gradients of `sum(out ⊙ weights)`.
fn run(case: &Case, device: &Device, dtype: DType, composed: bool) -> Run {
    let r = case.rule;
    let (b, own) = (r.b, r.rows);
    let t_keys = case.earlier + own;
    let draw = |shape: &[usize], seed: u64| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to_device(device)
            .unwrap()
    };
    let q = Var::from_tensor(&draw(&[b, case.heads, own, case.hd], 1)).unwrap();
    let k_all = draw(&[b, case.kv_heads, t_keys, case.hd], 2);
    let v_all = draw(&[b, case.kv_heads, t_keys, case.hd], 3);
    let k = Var::from_tensor(&k_all.narrow(2, case.earlier, own).unwrap()).unwrap();
    let v = Var::from_tensor(&v_all.narrow(2, case.earlier, own).unwrap()).unwrap();
    let weights = draw(&[b, own, case.heads * case.hd], 4);
    let offset = 3;
    let buffer =
        || Tensor::zeros((b, case.kv_heads, t_keys + offset, case.hd), dtype, device).unwrap();
    let (grad_keys, grad_values) = (buffer(), buffer());
    let earlier = (case.earlier > 0).then(|| EarlierKeys {
        keys: k_all.narrow(2, 0, case.earlier).unwrap(),
        values: v_all.narrow(2, 0, case.earlier).unwrap(),
        grad_keys: grad_keys.clone(),
        grad_values: grad_values.clone(),
        offset,
    });
    let mask = RuleMask {
        rule: r,
        device: device.clone(),
    };
    let blocking = Blocking {
        compute: DType::F32,
        key_block: KEY_BLOCK,
        products: Products::Compute,
    };
    let scale = 1.0 / (case.hd as f64).sqrt();
    let go = || {
        let out = attention_over_heads(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            earlier,
            mask,
            blocking,
            scale,
        )
        .unwrap();
        let grads = (&out * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        (out, grads)
    };
    let (out, grads) = if composed { with_composed(go) } else { go() };
    let g = |x: &Var| grads.get(x.as_tensor()).unwrap().clone();
    let whole = |buffer: &Tensor, own_grad: Tensor| {
        let earlier = buffer.narrow(2, offset, case.earlier).unwrap();
        Tensor::cat(&[&earlier, &own_grad], 2).unwrap()
    };
    let f32_cpu = |t: Tensor| {
        t.to_dtype(DType::F32)
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap()
    };
    [
        f32_cpu(out),
        f32_cpu(g(&q)),
        f32_cpu(whole(&grad_keys, g(&k))),
        f32_cpu(whole(&grad_values, g(&v))),
    ]
}

fn worst(a: &Run, b: &Run) -> (f64, &'static str) {
    ["out", "dq", "dk", "dv"]
        .into_iter()
        .zip(a.iter().zip(b))
        .map(|(name, (x, y))| (rel_err(x, y), name))
        .fold((0.0, ""), |w, e| if e.0 > w.0 { e } else { w })
}

fn rule(b: usize, q_start: usize, rows: usize) -> Rule {
    Rule {
        b,
        q_start,
        rows,
        k_start: 0,
        t: q_start + rows,
        window: None,
        docs: None,
        real: None,
    }
}

fn cases() -> Vec<(&'static str, Case)> {
    let case = |heads, kv_heads, hd, earlier, rule| Case {
        heads,
        kv_heads,
        hd,
        earlier,
        rule,
    };
    vec![
        ("first chunk, hd 64", case(4, 4, 64, 0, rule(1, 0, 100))),
        (
            "chunk 1 after 300 keys, GQA 4",
            case(8, 2, 64, 300, rule(1, 300, 1)),
        ),
        (
            "odd chunk after an odd prefix, hd 128, GQA 2",
            case(4, 2, 128, 157, rule(1, 157, 93)),
        ),
        (
            "GQA 8, hd 128, batch 2",
            case(8, 1, 128, 64, rule(2, 64, 70)),
        ),
        ("hd 256, GQA 2", case(4, 2, 256, 40, rule(1, 40, 33))),
        (
            "window cutting the chunk",
            case(
                4,
                2,
                64,
                200,
                Rule {
                    window: Some(77),
                    ..rule(1, 200, 90)
                },
            ),
        ),
        (
            "packed rows, batch 2",
            case(
                4,
                4,
                64,
                90,
                Rule {
                    docs: Some([&[0, 37, 120], &[0, 150]]),
                    ..rule(2, 90, 80)
                },
            ),
        ),
        (
            "right padding, batch 2",
            case(
                4,
                2,
                64,
                100,
                Rule {
                    real: Some([180, 130]),
                    ..rule(2, 100, 80)
                },
            ),
        ),
        (
            "keys from a later first key, window",
            case(
                4,
                2,
                128,
                60,
                Rule {
                    k_start: 40,
                    t: 40 + 60 + 50,
                    window: Some(70),
                    ..rule(1, 100, 50)
                },
            ),
        ),
    ]
}

#[test]
fn fused_attention_equals_the_cpu_in_f32_and_bf16() {
    let gpu = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => return eprintln!("no CUDA device ({e}): skipped"),
    };
    for (name, case) in cases() {
        let cpu = run(&case, &Device::Cpu, DType::F32, false);
        let before = fused_launches();
        let fused = run(&case, &gpu, DType::F32, false);
        assert!(
            fused_launches() > before,
            "{name}: the fused kernels did not run"
        );
        let composed = run(&case, &gpu, DType::F32, true);
        let (e, what) = worst(&fused, &cpu);
        let (ec, _) = worst(&composed, &cpu);
        println!("{name} f32: fused vs CPU {e:.1e} ({what}); composed vs CPU {ec:.1e}");
        assert!(e < 2e-5, "{name} f32: {what} {e:.2e}");
        let bf16 = run(&case, &gpu, DType::BF16, false);
        let bf16_composed = run(&case, &gpu, DType::BF16, true);
        let (e, what) = worst(&bf16, &cpu);
        let (ec, _) = worst(&bf16_composed, &cpu);
        println!(
            "{name} bf16: fused vs CPU f32 {e:.1e} ({what}); composed bf16 vs CPU f32 {ec:.1e}"
        );
        assert!(e < 3e-2, "{name} bf16: {what} {e:.2e}");
    }
}
