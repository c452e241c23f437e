//! On a CUDA device (a build with `--features cuda`; skipped when no GPU is present): RMSNorm (both
//! weight styles), SwiGLU and GeGLU (both GELUs) and rope (one table, one per batch row) on the card
//! by their Triton kernels give the CPU's outputs and gradients, in f32 to f32 rounding and in bf16
//! within bf16's, on one row, rows not a multiple of a block, rows wider than a block and the q/k
//! norms' narrow rows, every head dim; a norm whose rows are not a multiple of 16 wide takes the
//! composed ops. AdamW's update in place equals its formula in float64 (f32 and bf16 parameters,
//! gradients in the parameter's dtype or f32, with and without decay). The kernels must have run
//! (their launches are counted). The head's softmax passes (log-probs, then the logits' gradient
//! over the chunk), without and with the rows' entropies, equal the CPU's on vocabularies of
//! 16 × 7 and 151,936 columns, and a vocabulary not a multiple of 16 is left to the composed ops.
//! The accumulators add into f32 in place from f32 and bf16 gradients as the CPU does, bit for bit,
//! and products into them (cuBLAS, β = 1) as the CPU's to f32 rounding.
//!
//! To run on the GPU machine: build with `CARGO_TARGET_DIR=target-cuda cargo test --release -p
//! streambp-kernels --features cuda --test cuda_elementwise --no-run` and carry the binary.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor, Var};
use streambp_kernels::card_launches;
use streambp_kernels::ops::accumulate::{add, add_product, add_rows};
use streambp_kernels::ops::adamw::{update_in_place, AdamWStep};
use streambp_kernels::ops::geglu::{geglu, Gelu};
use streambp_kernels::ops::head_softmax::{entropy_rows, log_softmax_rows};
use streambp_kernels::ops::rms_norm::{rms_norm, NormStyle};
use streambp_kernels::ops::rope::apply_rope;
use streambp_kernels::ops::swiglu::swiglu;
use streambp_testkit::rel_err;

/// The largest magnitude of an f64 tensor.
fn max_abs(t: &Tensor) -> f64 {
    t.abs()
        .and_then(|t| t.max_all())
        .and_then(|t| t.to_scalar::<f64>())
        .expect("max of a tensor")
}

/// The op on each device: its output and its inputs' gradients for the output's gradient `g`.
type Run<'a> = &'a dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>;

fn on(device: &Device, inputs: &[Tensor], g: &Tensor, op: Run) -> Vec<Tensor> {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.to_device(device).unwrap()).unwrap())
        .collect();
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = op(&tensors).unwrap();
    let g = g.to_device(device).unwrap();
    let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![y];
    out.extend(
        vars.iter()
            .map(|v| grads.get(v.as_tensor()).unwrap().clone()),
    );
    out.into_iter()
        .map(|t| {
            t.to_device(&Device::Cpu)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
        })
        .collect()
}

fn check(what: &str, gpu: &Device, inputs: &[Tensor], g: &Tensor, op: Run) {
    let dtype = inputs[0].dtype();
    let bound = if dtype == DType::BF16 { 2e-2 } else { 2e-5 };
    let before = card_launches("");
    let card = on(gpu, inputs, g, op);
    let launched = card_launches("") - before;
    let cpu = on(&Device::Cpu, inputs, g, op);
    for (i, (c, h)) in card.iter().zip(&cpu).enumerate() {
        let err = rel_err(c, h);
        println!("{what} {dtype:?} [{i}]: rel err {err:.1e}");
        assert!(
            err < bound,
            "{what} {dtype:?} output/gradient {i}: {err:.1e}"
        );
    }
    assert!(
        launched >= 2,
        "{what}: the card's kernels did not run ({launched} launches)"
    );
}

#[test]
fn the_cards_elementwise_kernels_equal_the_cpu() {
    let gpu = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => return eprintln!("no CUDA device ({e}): skipped"),
    };
    let cpu = Device::Cpu;
    let randn = |std: f64, shape: &[usize], dtype: DType| {
        Tensor::randn(0f64, std, shape, &cpu)
            .and_then(|t| t.to_dtype(dtype))
            .unwrap()
    };
    for dtype in [DType::F32, DType::BF16] {
        for style in [NormStyle::CastThenScale, NormStyle::OnePlusWeightInF32] {
            for (rows, dim) in [(1, 16), (7, 128), (33, 256), (5, 1040), (3, 4096)] {
                let x = randn(2.0, &[rows, dim], dtype);
                let w = randn(0.5, &[dim], dtype);
                let g = randn(1.0, &[rows, dim], dtype);
                let op = move |t: &[Tensor]| rms_norm(&t[0], &t[1], 1e-6, style);
                check(
                    &format!("rms_norm {style:?} {rows}x{dim}"),
                    &gpu,
                    &[x, w],
                    &g,
                    &op,
                );
            }
        }
        for (rows, cols) in [(1, 1), (3, 7), (17, 1000), (4, 3000)] {
            let gate = randn(3.0, &[rows, cols], dtype);
            let up = randn(1.0, &[rows, cols], dtype);
            let g = randn(1.0, &[rows, cols], dtype);
            let inputs = [gate, up];
            check(&format!("swiglu {rows}x{cols}"), &gpu, &inputs, &g, &|t| {
                swiglu(&t[0], &t[1])
            });
            for gelu in [Gelu::Tanh, Gelu::Erf] {
                check(
                    &format!("geglu {gelu:?} {rows}x{cols}"),
                    &gpu,
                    &inputs,
                    &g,
                    &|t| geglu(&t[0], &t[1], gelu, None),
                );
            }
        }
    }
    for dtype in [DType::F32, DType::BF16] {
        for (b, heads, len, hd, per_batch) in [
            (1, 1, 1, 64, false),
            (2, 3, 37, 128, true),
            (1, 4, 9, 256, false),
        ] {
            let x = randn(1.0, &[b, heads, len, hd], dtype);
            let tables = if per_batch {
                vec![b, 1, len, hd]
            } else {
                vec![len, hd]
            };
            let angle = randn(2.0, &tables, DType::F64);
            let cos = angle.cos().unwrap().to_dtype(dtype).unwrap();
            let sin = angle.sin().unwrap().to_dtype(dtype).unwrap();
            let g = randn(1.0, &[b, heads, len, hd], dtype);
            let what = format!("rope {b}x{heads}x{len} hd {hd} per batch {per_batch}");
            let (cos_gpu, sin_gpu) = (cos.to_device(&gpu).unwrap(), sin.to_device(&gpu).unwrap());
            let op = |t: &[Tensor]| match t[0].device() {
                Device::Cpu => apply_rope(&t[0], &cos, &sin),
                _ => apply_rope(&t[0], &cos_gpu, &sin_gpu),
            };
            check(&what, &gpu, &[x], &g, &op);
        }
    }
    for (p_dtype, g_dtype) in [
        (DType::F32, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::BF16, DType::F32),
    ] {
        for (n, decay, t) in [(1, 1.0, 1), (5000, 1.0 - 1e-3 * 0.1, 7)] {
            let step = AdamWStep {
                lr: 1e-3,
                decay,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                bias_corrections: (1.0 - 0.9f64.powi(t), 1.0 - 0.999f64.powi(t)),
            };
            let p = randn(2e-3, &[n], p_dtype);
            let g = randn(1e-2, &[n], g_dtype);
            let m = randn(1e-3, &[n], DType::F32);
            let v = randn(1e-2, &[n], DType::F64)
                .sqr()
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let on_card = [&p, &g, &m, &v].map(|t| t.to_device(&gpu).unwrap());
            let before = card_launches("adamw");
            let [cp, cg, cm, cv] = &on_card;
            assert!(
                update_in_place(cp, cg, (cm, cv), &step).unwrap(),
                "{p_dtype:?}"
            );
            assert_eq!(card_launches("adamw"), before + 1);
            let f64_of = |t: &Tensor| t.to_device(&cpu).unwrap().to_dtype(DType::F64).unwrap();
            let [p0, g0, m0, v0] = [&p, &g, &m, &v].map(f64_of);
            let m1 = ((&m0 * 0.9).unwrap() + (&g0 * 0.1).unwrap()).unwrap();
            let v1 = ((&v0 * 0.999).unwrap() + (g0.sqr().unwrap() * 1e-3).unwrap()).unwrap();
            let (bc1, bc2) = step.bias_corrections;
            let denom = ((&v1 / bc2).unwrap().sqrt().unwrap() + 1e-8).unwrap();
            let moved = ((&m1 / bc1).unwrap() / denom).unwrap() * 1e-3;
            let p1 = ((&p0 * decay).unwrap() - moved.as_ref().unwrap()).unwrap();
            let what = format!("adamw {p_dtype:?} grad {g_dtype:?} n {n}");
            let (got_p, got_m, got_v) = (f64_of(cp), f64_of(cm), f64_of(cv));
            // f32 against the step's size; bf16 against the parameter's (its rounding dominates).
            let scale = match p_dtype {
                DType::F32 => max_abs(&moved.unwrap()),
                _ => max_abs(&p1),
            };
            let p_err = max_abs(&(got_p - &p1).unwrap()) / scale;
            let bound = if p_dtype == DType::BF16 { 1e-2 } else { 1e-5 };
            println!(
                "{what}: p {p_err:.1e} m {:.1e} v {:.1e}",
                rel_err(&got_m, &m1),
                rel_err(&got_v, &v1)
            );
            assert!(p_err < bound, "{what}: p {p_err:.1e}");
            assert!(
                rel_err(&got_m, &m1) < 1e-6 && rel_err(&got_v, &v1) < 1e-6,
                "{what}: moments"
            );
        }
    }
    for (n, vocab) in [(1, 112), (5, 151_936)] {
        let z = randn(4.0, &[n, vocab], DType::F32);
        let targets: Vec<u32> = (0..n)
            .map(|i| ((i * 7919 + vocab - 1) % vocab) as u32)
            .collect();
        let idx = Tensor::from_vec(targets, (n, 1), &cpu).unwrap();
        let g = randn(1.0, &[n], DType::F32);
        let run = |device: &Device| {
            let z = z.to_device(device).unwrap().copy().unwrap();
            let rows = log_softmax_rows(&z, &idx.to_device(device).unwrap())
                .unwrap()
                .unwrap();
            let logp = rows.logp.to_device(&cpu).unwrap();
            let dz = rows
                .logit_grad(&g.to_device(device).unwrap(), None)
                .unwrap();
            (logp, dz.to_device(&cpu).unwrap())
        };
        let before = card_launches("head_");
        let (card, host) = (run(&gpu), run(&cpu));
        assert_eq!(
            card_launches("head_"),
            before + 2,
            "head softmax {n}x{vocab}"
        );
        let (logp_err, dz_err) = (rel_err(&card.0, &host.0), rel_err(&card.1, &host.1));
        println!("head softmax {n}x{vocab}: logp {logp_err:.1e} dz {dz_err:.1e}");
        assert!(logp_err < 1e-5 && dz_err < 1e-5, "head softmax {n}x{vocab}");
    }
    // With the entropies: log-probs, entropies and the logits' gradient from both gradients.
    for (n, vocab) in [(1, 112), (5, 151_936)] {
        let z = randn(4.0, &[n, vocab], DType::F32);
        let targets: Vec<u32> = (0..n).map(|i| ((i * 104_729) % vocab) as u32).collect();
        let idx = Tensor::from_vec(targets, (n, 1), &cpu).unwrap();
        let (g, g_h) = (randn(1.0, &[n], DType::F32), randn(1.0, &[n], DType::F32));
        let run = |device: &Device| {
            let z = z.to_device(device).unwrap().copy().unwrap();
            let rows = entropy_rows(&z, &idx.to_device(device).unwrap())
                .unwrap()
                .unwrap();
            let logp = rows.logp.to_device(&cpu).unwrap();
            let h = rows.entropy.clone().unwrap().to_device(&cpu).unwrap();
            let (g, g_h) = (g.to_device(device).unwrap(), g_h.to_device(device).unwrap());
            let dz = rows.logit_grad(&g, Some(&g_h)).unwrap();
            (logp, h, dz.to_device(&cpu).unwrap())
        };
        let before = card_launches("head_");
        let (card, host) = (run(&gpu), run(&cpu));
        let what = format!("head softmax with entropies {n}x{vocab}");
        assert_eq!(card_launches("head_"), before + 2, "{what}");
        let errors = [
            rel_err(&card.0, &host.0),
            rel_err(&card.1, &host.1),
            rel_err(&card.2, &host.2),
        ];
        println!(
            "{what}: logp {:.1e} entropy {:.1e} dz {:.1e}",
            errors[0], errors[1], errors[2]
        );
        assert!(errors.iter().all(|&e| e < 1e-5), "{what}");
    }
    let odd = Tensor::zeros((2, 100), DType::F32, &gpu).unwrap();
    let idx = Tensor::zeros((2, 1), DType::U32, &gpu).unwrap();
    assert!(log_softmax_rows(&odd, &idx).unwrap().is_none());
    assert!(entropy_rows(&odd, &idx).unwrap().is_none());
    // Rows 40 wide are not a multiple of 16: the composed ops, and still the CPU's values.
    let before = card_launches("rms_norm");
    let x = randn(1.0, &[3, 40], DType::F32).to_device(&gpu).unwrap();
    let w = randn(0.5, &[40], DType::F32).to_device(&gpu).unwrap();
    let y = rms_norm(&x, &w, 1e-6, NormStyle::CastThenScale).unwrap();
    assert_eq!(card_launches("rms_norm"), before);
    let want = rms_norm(
        &x.to_device(&cpu).unwrap(),
        &w.to_device(&cpu).unwrap(),
        1e-6,
        NormStyle::CastThenScale,
    )
    .unwrap();
    assert!(rel_err(&y.to_device(&cpu).unwrap(), &want) < 1e-5);
}

/// The accumulators on the card: `acc += x` and `acc[ids[i]] += rows[i]` into f32 accumulators
/// from f32 and bf16 gradients equal the host's sums bit for bit (each element widened and added
/// once, the rows in order: repeated ids included), by the kernels (their launches counted); an
/// f64 accumulator is declined.
#[test]
fn the_cards_accumulators_equal_the_cpu() {
    let gpu = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => return eprintln!("no CUDA device ({e}): skipped"),
    };
    let cpu = Device::Cpu;
    let randn = |shape: &[usize], dtype: DType| {
        Tensor::randn(0f64, 1.0, shape, &cpu)
            .and_then(|t| t.to_dtype(dtype))
            .unwrap()
    };
    let bits = |t: &Tensor| {
        let t = t.to_device(&cpu).and_then(|t| t.flatten_all()).unwrap();
        t.to_vec1::<f32>().unwrap()
    };
    for dtype in [DType::F32, DType::BF16] {
        for n in [1usize, 1000, 4097 * 3] {
            let (held, x) = (randn(&[n], DType::F32), randn(&[n], dtype));
            let sum = |device: &Device| {
                let acc = held.to_device(device).unwrap();
                assert!(add(&acc, &x.to_device(device).unwrap()).unwrap());
                bits(&acc)
            };
            let before = card_launches("accumulate_add");
            assert_eq!(sum(&gpu), sum(&cpu), "add {dtype:?} n {n}");
            assert_eq!(card_launches("accumulate_add"), before + 1);
        }
        for (vocab, n, dim) in [(5, 3, 16), (100, 700, 4096)] {
            let held = randn(&[vocab, dim], DType::F32);
            let rows = randn(&[n, dim], dtype);
            let ids: Vec<u32> = (0..n).map(|i| ((i * i) % vocab) as u32).collect();
            let ids = Tensor::from_vec(ids, n, &cpu).unwrap();
            let sum = |device: &Device| {
                let acc = held.to_device(device).unwrap();
                let (ids, rows) = (
                    ids.to_device(device).unwrap(),
                    rows.to_device(device).unwrap(),
                );
                assert!(add_rows(&acc, &ids, &rows).unwrap());
                bits(&acc)
            };
            let before = card_launches("accumulate_add_rows");
            assert_eq!(sum(&gpu), sum(&cpu), "add_rows {dtype:?} {n}x{dim}");
            assert_eq!(card_launches("accumulate_add_rows"), before + 1);
        }
    }
    // `acc += a·b` by cuBLAS with β = 1: `a` contiguous and a transposed view (the LM head's
    // `dzᵀ`, a projection's `gᵀ`), f32 and bf16 operands summed in f32, against the host's.
    for dtype in [DType::F32, DType::BF16] {
        for (m, k, n, transposed) in [(7, 5, 3, false), (96, 700, 64, true), (1, 9, 16, true)] {
            let held = randn(&[m, n], DType::F32);
            let a = match transposed {
                true => randn(&[k, m], dtype).t().unwrap(),
                false => randn(&[m, k], dtype),
            };
            let b = randn(&[k, n], dtype);
            let sum = |device: &Device| {
                let acc = held.to_device(device).unwrap();
                let (a, b) = (a.to_device(device).unwrap(), b.to_device(device).unwrap());
                assert!(add_product(&acc, &a, &b).unwrap());
                acc.to_device(&cpu).unwrap()
            };
            let before = card_launches("accumulate_add_product");
            let (card, host) = (sum(&gpu), sum(&cpu));
            assert_eq!(card_launches("accumulate_add_product"), before + 1);
            let what = format!("add_product {dtype:?} {m}x{k}x{n} transposed {transposed}");
            let err = rel_err(&card, &host);
            println!("{what}: {err:.1e}");
            assert!(err < 1e-5, "{what}: {err:.1e}");
        }
    }
    let acc64 = Tensor::zeros(8, DType::F64, &gpu).unwrap();
    assert!(!add(&acc64, &acc64.copy().unwrap()).unwrap());
}
