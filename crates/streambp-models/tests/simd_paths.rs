//! The hand-written CPU passes give the same values on every instruction set this CPU can run
//! (`streambp_kernels::host::simd`): the test runs itself again in child processes, one per path
//! (`STREAMBP_SIMD`), each computing a Qwen3 and a Gemma3 forward and backward (norms, rope,
//! SwiGLU, the attention kernel, softmax exponentials) in f64 and f32, plus the bf16 casts, the
//! in-place sums, bf16 products by the widened kernel and products of a few rows
//! (`streambp_kernels::host::skinny`), and the parent compares them. gemm picks its kernels by itself, the
//! same in every child, so any difference is the passes'.
//!
//! - f64, the casts, the sums and the products: the same bits on every path, the baseline (SSE2)
//!   included.
//! - f32 models: the same bits on the vector paths (AVX2, AVX-512); the baseline's exponential has
//!   no fused multiply-add, so it differs there within the exponential's 2 ulp, carried through.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use streambp_kernels::choices::{self, Isa, SIMD_ENV};
use streambp_models::{Model, ModelConfig};

/// Where a child writes its values (set only in children).
const OUT_ENV: &str = "STREAMBP_SIMD_PATHS_OUT";
const TEST_NAME: &str = "every_simd_path_gives_the_same_values";

type Values = BTreeMap<String, Vec<f64>>;

#[test]
fn every_simd_path_gives_the_same_values() {
    if let Ok(out) = std::env::var(OUT_ENV) {
        let values = compute();
        let json = serde_json::to_string(&values).unwrap();
        std::fs::write(out, json).unwrap();
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut runs: Vec<(Isa, Values)> = Vec::new();
    for isa in Isa::ALL.into_iter().filter(|isa| isa.available()) {
        let out = dir.path().join(format!("{}.json", isa.name()));
        let status = streambp_testkit::command(&exe)
            .args([TEST_NAME, "--exact", "--test-threads", "1"])
            .env(SIMD_ENV, isa.name())
            .env(OUT_ENV, &out)
            .status()
            .unwrap();
        assert!(status.success(), "the {} child failed", isa.name());
        let values: Values = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        runs.push((isa, values));
    }
    println!(
        "SIMD paths run: {} (widest on this CPU: {})",
        runs.iter()
            .map(|(isa, _)| isa.name())
            .collect::<Vec<_>>()
            .join(", "),
        Isa::detected().name()
    );
    // Every path the CPU has ran, its widest last. A CPU with only the baseline (an x86-64 without
    // AVX2, or one emulated as such: `qemu-x86_64 -cpu qemu64`) leaves nothing to compare.
    assert_eq!(runs.last().map(|(isa, _)| *isa), Some(Isa::detected()));
    let widest = runs.last().unwrap();
    for (isa, values) in &runs[..runs.len() - 1] {
        let mut largest = 0.0f64;
        for (name, want) in &widest.1 {
            let got = &values[name];
            assert_eq!(got.len(), want.len(), "{name}");
            // Only the f32 models take exponentials, whose formula the baseline picks differently.
            let exact = !name.starts_with("f32") || *isa != Isa::Baseline;
            // The tensor's relative error: |got − want| / |want| over all its elements.
            let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
            let worst = norm(&mut got.iter().zip(want).map(|(g, w)| g - w))
                / norm(&mut want.iter().copied()).max(f64::MIN_POSITIVE);
            largest = largest.max(worst);
            if exact {
                assert!(
                    got.iter()
                        .zip(want)
                        .all(|(g, w)| g.to_bits() == w.to_bits()),
                    "{name}: {} and {} differ (worst {worst:.2e})",
                    isa.name(),
                    widest.0.name()
                );
            } else {
                assert!(worst < 1e-5, "{name}: {} off by {worst:.2e}", isa.name());
            }
        }
        println!(
            "{} against {}: {} tensors, largest relative difference {largest:.2e}",
            isa.name(),
            widest.0.name(),
            widest.1.len()
        );
    }
}

/// The values one child computes on the path in force.
fn compute() -> Values {
    assert_eq!(
        choices::in_force().simd.name(),
        std::env::var(SIMD_ENV).unwrap(),
        "the child runs the path it was given"
    );
    let mut values = Values::new();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    for family in ["qwen3", "gemma3"] {
        let config = ModelConfig::from_file(&fixtures.join(family).join("config.json")).unwrap();
        for dtype in [DType::F64, DType::F32] {
            let name = format!("{}-{family}", dtype.as_str());
            values.extend(model_values(&name, config.clone(), dtype));
        }
    }
    let device = Device::Cpu;
    let x: Vec<f32> = (0..70_000)
        .map(|i| (i as f32 * 0.37).sin() * 30.0)
        .collect();
    let x = Tensor::from_vec(x, 70_000, &device).unwrap();
    let narrow = streambp_kernels::ops::cast::cast(&x, DType::BF16).unwrap();
    let wide = streambp_kernels::ops::cast::cast(&narrow, DType::F32).unwrap();
    values.insert("casts".into(), flat(&wide));
    for dtype in [DType::F64, DType::F32] {
        let acc = x.to_dtype(dtype).unwrap();
        let step = (x.to_dtype(dtype).unwrap() * 0.5).unwrap();
        assert!(streambp_kernels::ops::accumulate::add(&acc, &step).unwrap());
        values.insert(format!("add {}", dtype.as_str()), flat(&acc));
    }
    values.extend(widened_products());
    values.extend(skinny_products());
    values
}

/// bf16 products by the widened kernel (its operands widened and its sums rounded or added on the
/// path in force; gemm's f32 kernel is the same in every child), with each operand read along rows
/// and along columns, at sizes no vector width divides (several tiles and inner slices).
fn widened_products() -> Values {
    use half::bf16;
    use streambp_kernels::host::half_product::{product_by, Destination, Kernel, Operand};
    let (m, n, k) = (37, 301, 290);
    let data = |len: usize, seed: f32| -> Vec<bf16> {
        (0..len)
            .map(|i| bf16::from_f32((i as f32 * seed).sin()))
            .collect()
    };
    let (a, b) = (data(m * k, 0.37), data(k * n, 0.11));
    let operand = |data, row_stride, col_stride| Operand {
        data,
        row_stride,
        col_stride,
    };
    let mut values = Values::new();
    for transposed in [false, true] {
        // Each operand row-major, or the transpose of a row-major matrix (read along columns).
        let (a_op, b_op) = match transposed {
            false => (operand(&a, k, 1), operand(&b, n, 1)),
            true => (operand(&a, 1, m), operand(&b, 1, k)),
        };
        let mut rounded = vec![bf16::ZERO; m * n];
        let dst = Destination::Bf16(&mut rounded);
        product_by(Kernel::Widened, dst, (m, n, k), a_op, b_op);
        let mut added: Vec<f32> = (0..m * n).map(|i| i as f32 * 1e-3).collect();
        let dst = Destination::AddF32(&mut added);
        product_by(Kernel::Widened, dst, (m, n, k), a_op, b_op);
        let name = if transposed {
            "read along columns"
        } else {
            "read along rows"
        };
        values.insert(
            format!("bf16 widened product, {name}, rounded"),
            rounded.iter().map(|x| f64::from(x.to_f32())).collect(),
        );
        values.insert(
            format!("bf16 widened product, {name}, added"),
            added.iter().map(|&x| f64::from(x)).collect(),
        );
    }
    values
}

/// Products of a few rows by a weight stored row by row (`streambp_kernels::host::skinny`, a decoding
/// step's projections) in f64, f32 and with bf16 weights (rounded to bf16 and added into f32),
/// rows padded past their length, an inner length no vector width divides; five rows by an odd
/// number of `W`'s, so that the AVX-512 path forms blocks of four by two and single rows alike.
fn skinny_products() -> Values {
    use half::bf16;
    use streambp_kernels::host::skinny::product;
    let (m, n, k, stride) = (5, 301, 290, 293);
    let x: Vec<f64> = (0..m * stride).map(|i| (i as f64 * 0.37).sin()).collect();
    let w: Vec<f64> = (0..n * stride).map(|i| (i as f64 * 0.11).cos()).collect();
    let (x32, w32): (Vec<f32>, Vec<f32>) = (
        x.iter().map(|&v| v as f32).collect(),
        w.iter().map(|&v| v as f32).collect(),
    );
    let w16: Vec<bf16> = w.iter().map(|&v| bf16::from_f64(v)).collect();
    let mut values = Values::new();
    let mut y64 = vec![0.0f64; m * n];
    product::<f64, f64>((&mut y64, n), (m, n, k), false, (&x, stride), (&w, stride));
    values.insert("skinny product f64".into(), y64);
    let mut y32 = vec![0.0f32; m * n];
    product::<f32, f32>(
        (&mut y32, n),
        (m, n, k),
        false,
        (&x32, stride),
        (&w32, stride),
    );
    values.insert(
        "skinny product f32".into(),
        y32.iter().map(|&v| v.into()).collect(),
    );
    let mut y16 = vec![bf16::ZERO; m * n];
    product::<bf16, bf16>(
        (&mut y16, n),
        (m, n, k),
        false,
        (&x32, stride),
        (&w16, stride),
    );
    values.insert(
        "skinny product bf16".into(),
        y16.iter().map(|v| v.to_f64()).collect(),
    );
    let mut added: Vec<f32> = (0..m * n).map(|i| i as f32 * 1e-3).collect();
    product::<bf16, f32>(
        (&mut added, n),
        (m, n, k),
        true,
        (&x32, stride),
        (&w16, stride),
    );
    values.insert(
        "skinny product bf16, added".into(),
        added.iter().map(|&v| v.into()).collect(),
    );
    values
}

/// Logits and every parameter's gradient of `Σ logits ⊙ g` for a batch of two rows, the second
/// padded, 37 tokens (not a multiple of any vector width).
fn model_values(name: &str, config: ModelConfig, dtype: DType) -> Values {
    let device = Device::Cpu;
    let vocab = config.vocab_size;
    let model = Model::random(config, dtype, &device, 7).unwrap();
    let t = 37;
    let ids: Vec<u32> = (0..2 * t)
        .map(|i| (i * 7 + 3) as u32 % vocab as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (2, t), &device).unwrap();
    let mask: Vec<u32> = (0..2 * t).map(|i| u32::from(i < t + 30)).collect();
    let mask = Tensor::from_vec(mask, (2, t), &device).unwrap();
    let logits = model.forward(&ids, Some(&mask)).unwrap();
    let g = logits
        .ones_like()
        .unwrap()
        .cumsum(2)
        .unwrap()
        .sin()
        .unwrap();
    let grads = (&logits * &g)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let mut values = Values::new();
    values.insert(format!("{name} logits"), flat(&logits));
    for (param, var) in model.parameters() {
        let grad = grads.get(var.as_tensor()).unwrap();
        values.insert(format!("{name} d {param}"), flat(grad));
    }
    values
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap()
}
