//! Half-precision layers computed in f32 on the host (`DecoderLayer::computed_in_f32`): their
//! rounding is a cast's, their forward is the half-precision model's, and their gradients land on
//! f32 stand-ins of the trained weights.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::*;
use streambp_kernels::ops::cast::round_in_place;
use streambp_models::{load_model, Layout, LoraConfig, Model, Projection};

/// Values around every case a rounding can get wrong: ties to even, the largest values that round
/// down and up, overflow to infinity, subnormals, signed zeros, infinities and NaN; and enough
/// ordinary ones to span several of the op's parallel tasks.
fn awkward_values() -> Vec<f32> {
    let mut values = vec![
        0.0,
        -0.0,
        1.0,
        1.0 + 2f32.powi(-8),       // a tie between 1 and 1 + 2⁻⁷ (bf16): to even
        1.0 + 3.0 * 2f32.powi(-8), // a tie that rounds up to even
        1.0 + 2f32.powi(-8) + 2f32.powi(-20), // just above a tie
        1.0 + 2f32.powi(-11),      // a tie for f16
        65504.0,                   // f16's largest
        65520.0,                   // f16's overflow threshold
        f32::MAX,                  // bf16 overflows to infinity
        f32::MIN_POSITIVE,         // normal for bf16, below f16's range
        f32::MIN_POSITIVE / 3.0,   // subnormal
        6.0e-8,                    // f16's smallest subnormal, about
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    let mut state = 0x2545_f491_u32;
    values.extend((0..50_000).map(|i| {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let unit = (state >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
        unit * 2f32.powi(i % 40 - 20)
    }));
    values
}

#[test]
fn rounding_in_place_equals_a_cast_there_and_back() {
    let values = awkward_values();
    for dtype in [DType::BF16, DType::F16] {
        let t = Tensor::new(values.as_slice(), &Device::Cpu).unwrap();
        let want = t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
        round_in_place(&t, dtype).unwrap();
        let (got, want) = (t.to_vec1::<f32>().unwrap(), want.to_vec1::<f32>().unwrap());
        for ((g, w), x) in got.iter().zip(&want).zip(&values) {
            let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
            assert!(
                same,
                "{dtype:?}: {x:e} rounded to {g:e}, a cast gives {w:e}"
            );
        }
    }
    // Only half-precision targets and f32 tensors.
    let t = Tensor::new(&[1.0f32], &Device::Cpu).unwrap();
    assert!(round_in_place(&t, DType::F64).is_err());
    let t = Tensor::new(&[1.0f64], &Device::Cpu).unwrap();
    assert!(round_in_place(&t, DType::BF16).is_err());
}

/// The first layer's input for the family's fixture batch, its rows repeated `repeats` times
/// along the sequence, in `dtype`.
fn layer_input(model: &Model, family: &str, repeats: usize) -> Tensor {
    let ids = reference(family)["input_ids"].to_dtype(DType::U32).unwrap();
    let ids = Tensor::cat(&vec![&ids; repeats], 1).unwrap();
    model.detached().embed(&ids).unwrap()
}

/// Every family's first layer in bf16: computed in f32 it gives values bf16 holds exactly (each
/// output rounded where bf16 arithmetic rounds), the bf16 layer's own bits where both round at the
/// same points (Qwen3, Llama). Two points differ, each rounding once where PyTorch's bf16 kernels
/// round once: Qwen2's biased projections (`addmm`: the product plus the bias, rounded; candle's
/// bf16 ops round the product, then the sum) and Gemma's GELU (PyTorch's fused `gelu`; composed
/// in bf16 each elementary op rounds). Measured there: 8.1e-3 (Qwen2) and 3.6e-3 (Gemma3) of the
/// output's largest value, 27% and 78% of the elements bit-equal.
///
/// The fixture's 33 rows, and those rows four times over: past
/// [`streambp_kernels::host::skinny::MAX_ROWS`] the forward's products run from the bf16 weights on the
/// packing kernel where one is in force (`Linear::bf16_weight`), as the bf16 layer's own products
/// do (that they run there, [`the_forward_reads_the_bf16_weights_the_backward_the_f32_ones`]).
#[test]
fn a_bf16_layer_in_f32_rounds_where_bf16_does() {
    for (family, repeats) in FAMILIES.iter().flat_map(|f| [(*f, 1), (*f, 4)]) {
        let model = load_model(&fixture_dir(family), DType::BF16, &Device::Cpu).unwrap();
        let layer = &model.layers[0];
        let x = layer_input(&model, family, repeats);
        let layout = Layout::default();
        let half = layer.forward(&x, &layout).unwrap();
        let wide = layer.computed_in_f32().unwrap().expect("bf16 on the host");
        assert_eq!(wide.layer.dtype(), DType::F32);
        let y = wide
            .layer
            .forward(&x.to_dtype(DType::F32).unwrap(), &layout)
            .unwrap();
        assert_eq!(y.dtype(), DType::F32);
        let rounded = y
            .to_dtype(DType::BF16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let y_values = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let rounded = rounded.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(
            y_values
                .iter()
                .zip(&rounded)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{family}: an output bf16 does not hold"
        );
        let half = half.to_dtype(DType::F32).unwrap();
        let half_values = half.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let largest = half_values.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = y_values
            .iter()
            .zip(&half_values)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let equal = y_values
            .iter()
            .zip(&half_values)
            .filter(|(a, b)| a == b)
            .count();
        let share = equal as f64 / y_values.len() as f64;
        println!(
            "{family}, {} rows: off the bf16 layer by {:.2e} of its largest value, {:.1}% equal",
            x.dims()[..2].iter().product::<usize>(),
            worst / largest,
            100.0 * share
        );
        match family {
            "qwen2" | "gemma3" => assert!(worst <= 2e-2 * largest, "{family}: {worst}"),
            _ => assert_eq!(share, 1.0, "{family}: not the bf16 layer's bits"),
        }
    }
}

/// Half precision (bf16, f16) on the host computes in f32; other dtypes run as they are.
#[test]
fn only_half_precision_layers_are_widened() {
    let family = FAMILIES[0];
    for (dtype, widened) in [
        (DType::BF16, true),
        (DType::F16, true),
        (DType::F32, false),
        (DType::F64, false),
    ] {
        let model = load_model(&fixture_dir(family), dtype, &Device::Cpu).unwrap();
        let wide = model.layers[0].computed_in_f32().unwrap();
        assert_eq!(wide.is_some(), widened, "{dtype:?}");
        if let Some(wide) = wide {
            assert_eq!(wide.layer.round_to, Some(dtype));
        }
    }
}

/// `model` with fresh rank-4 adapters on `targets` of every layer.
fn with_adapters(model: Model, targets: Vec<Projection>) -> Model {
    let config = LoraConfig {
        r: 4,
        alpha: 8.0,
        targets,
        use_rslora: false,
        dropout: 0.0,
    };
    model.with_lora(config, None, 7).unwrap()
}

/// Every trained weight of the layer gets an f32 stand-in that its gradient lands on, in the
/// model's parameter order and names; a LoRA model's adapters (f32 already) are their own.
#[test]
fn gradients_land_on_the_stand_ins() {
    let family = FAMILIES[0];
    let full = load_model(&fixture_dir(family), DType::BF16, &Device::Cpu).unwrap();
    let lora = with_adapters(full.clone(), Projection::ALL.to_vec());
    for (model, adapters) in [(&full, false), (&lora, true)] {
        let params = model.layer_parameters(0);
        let wide = model.layers[0].computed_in_f32().unwrap().unwrap();
        let stand_ins = wide.parameters(params);
        assert_eq!(stand_ins.len(), params.len());
        let x =
            Var::from_tensor(&layer_input(model, family, 1).to_dtype(DType::F32).unwrap()).unwrap();
        let y = wide
            .layer
            .forward(x.as_tensor(), &Layout::default())
            .unwrap();
        let store = y.sum_all().unwrap().backward().unwrap();
        for ((name, original), (stand_in_name, stand_in)) in params.iter().zip(&stand_ins) {
            assert_eq!(name, stand_in_name);
            assert_eq!(stand_in.dtype(), DType::F32, "{name}");
            // Widened weights are new variables; adapters stay the model's own.
            assert_eq!(stand_in.id() == original.id(), adapters, "{name}");
            let grad = store.get(stand_in.as_tensor());
            assert!(
                grad.is_some_and(|g| g.dtype() == DType::F32),
                "{name}: no f32 gradient"
            );
            assert!(
                store.get(original.as_tensor()).is_none() || adapters,
                "{name}"
            );
        }
    }
}

/// A bf16 layer computed in f32 multiplies from each projection's bf16 weight where the kernel in
/// force packs bf16 pairs, and only there (the widened kernel's products of bf16 values are f32's
/// of the f32 stand-ins, which hold the same values), in its forward and its backward: with the
/// down projection's bf16 weight zeroed the layer's output and the stand-ins' gradients of the
/// output's sum change on such a CPU (and not elsewhere), though the gradients still land on the
/// f32 stand-ins.
#[test]
fn the_forward_and_the_backward_read_the_bf16_weights() {
    let family = "qwen3";
    let model = load_model(&fixture_dir(family), DType::BF16, &Device::Cpu).unwrap();
    let params = model.layer_parameters(0);
    let wide = model.layers[0].computed_in_f32().unwrap().unwrap();
    let stand_ins = wide.parameters(params);
    let x = layer_input(&model, family, 1).to_dtype(DType::F32).unwrap();
    let mut zeroed = wide.layer.clone();
    let bf16_weight = zeroed
        .down_proj
        .bf16_weight
        .as_ref()
        .expect("a bf16 weight");
    zeroed.down_proj.bf16_weight = Some(bf16_weight.zeros_like().unwrap());
    let run = |layer: &streambp_models::DecoderLayer| {
        let y = layer.forward(&x, &Layout::default()).unwrap();
        let store = y.sum_all().unwrap().backward().unwrap();
        let grads: Vec<Vec<f32>> = stand_ins
            .iter()
            .map(|(name, v)| {
                let g = store.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}"));
                g.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            })
            .collect();
        (y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), grads)
    };
    let ((y, grads), (y_zeroed, grads_zeroed)) = (run(&wide.layer), run(&zeroed));
    let packs = streambp_kernels::choices::in_force().bf16_kernel
        != streambp_kernels::choices::Kernel::Widened;
    assert_eq!(y != y_zeroed, packs, "the bf16 weight read: {packs}");
    // The gate and up projections' gradients come through the down projection's input gradient.
    let changed: Vec<&str> = stand_ins
        .iter()
        .zip(grads.iter().zip(&grads_zeroed))
        .filter(|(_, (g, z))| g.iter().zip(*z).any(|(a, b)| a.to_bits() != b.to_bits()))
        .map(|((name, _), _)| name.as_str())
        .collect();
    assert_eq!(
        changed.iter().any(|n| n.contains("gate_proj")),
        packs,
        "the backward's bf16 weight read: {packs}; changed {changed:?}"
    );
}

/// `a·b` (`[rows, inner]·[inner, cols]`, read through `a`, `b`) in f64, with the bound on an f32
/// sum's rounding of each element: `inner · 2⁻²⁴ · Σ |terms|`.
fn exact_product(
    a: impl Fn(usize, usize) -> f64,
    b: impl Fn(usize, usize) -> f64,
    (rows, cols, inner): (usize, usize, usize),
) -> Vec<(f64, f64)> {
    (0..rows * cols)
        .map(|ij| {
            let (i, j) = (ij / cols, ij % cols);
            let terms = (0..inner).map(|p| a(i, p) * b(p, j));
            let magnitude: f64 = terms.clone().map(f64::abs).sum();
            (terms.sum(), magnitude * inner as f64 * 2f64.powi(-24))
        })
        .collect()
}

/// A projection of a bf16 layer computed in f32 multiplies the gradient rounded to bf16, as bf16
/// autograd holds it, in both of its backward's products, the sums unrounded: `g W` and `gᵀ x`
/// from `bf16(g)` to within an f32 sum's rounding of the exact products, and most elements farther
/// than that from the products of `g` itself.
#[test]
fn a_projection_multiplies_the_gradient_rounded_to_bf16() {
    let (n, inputs, outputs) = (37, 48, 40);
    let values = |len: usize, seed: f32| -> Vec<f32> {
        (0..len)
            .map(|i| (i as f32 * 0.61 + seed).sin() * 1.7)
            .collect()
    };
    let rounded = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect()
    };
    let cpu = Device::Cpu;
    let w = rounded(&values(outputs * inputs, 0.3));
    let x = rounded(&values(n * inputs, 1.1));
    // The gradient of `(y ⊙ c).sum()`: `c`, most of whose values bf16 does not hold.
    let c = values(n * outputs, 2.9);
    let weight = Var::from_vec(w.clone(), (outputs, inputs), &cpu).unwrap();
    let mut linear = streambp_models::linear::Linear::new(weight.as_tensor().clone(), None);
    linear.bf16_weight = Some(weight.as_tensor().to_dtype(DType::BF16).unwrap());
    let x_var = Var::from_vec(x.clone(), (n, inputs), &cpu).unwrap();
    let y = linear.forward(x_var.as_tensor()).unwrap();
    let c_t = Tensor::from_vec(c.clone(), (n, outputs), &cpu).unwrap();
    let store = (y * &c_t).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = |v: &Var| -> Vec<f32> {
        let g = store.get(v.as_tensor()).expect("a gradient");
        g.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    let c16 = rounded(&c);
    for (name, got, products) in [
        (
            "g W",
            grad(&x_var),
            [&c16, &c].map(|g| {
                let at = |i: usize, p: usize| g[i * outputs + p] as f64;
                exact_product(at, |p, j| w[p * inputs + j] as f64, (n, inputs, outputs))
            }),
        ),
        (
            "gᵀ x",
            grad(&weight),
            [&c16, &c].map(|g| {
                let at = |i: usize, p: usize| g[p * outputs + i] as f64;
                exact_product(at, |p, j| x[p * inputs + j] as f64, (outputs, inputs, n))
            }),
        ),
    ] {
        let [of_rounded, of_unrounded] = products;
        let within = |(v, (exact, bound)): (&f32, &(f64, f64))| (*v as f64 - exact).abs() <= *bound;
        for (k, pair) in got.iter().zip(&of_rounded).enumerate() {
            assert!(within(pair), "{name}[{k}]: {} against {:?}", pair.0, pair.1);
        }
        let apart = got
            .iter()
            .zip(&of_unrounded)
            .filter(|&p| !within(p))
            .count();
        assert!(
            apart > got.len() / 2,
            "{name}: {apart} of {} away from the unrounded gradient's products",
            got.len()
        );
    }
}

/// A LoRA projection of a bf16 layer computed in f32 forms PEFT's sum: the base layer's output
/// rounded to bf16, plus the f32 adapter's term (the projection then rounds the sum). Measured by the
/// mean distance from each form, since the two products may sum in different orders.
#[test]
fn a_lora_projection_adds_its_term_to_the_rounded_base() {
    let family = "qwen3";
    let base = load_model(&fixture_dir(family), DType::BF16, &Device::Cpu).unwrap();
    let model = with_adapters(base, vec![Projection::Q]);
    let wide = model.layers[0].computed_in_f32().unwrap().unwrap();
    let mut q = wide.layer.q_proj.clone();
    // The sum before the projection rounds it as its output.
    assert_eq!(q.round_to, Some(DType::BF16));
    q.round_to = None;
    let adapter = q.lora.as_mut().expect("an adapter on q");
    assert_eq!(adapter.round_base_to, Some(DType::BF16));
    // A fresh adapter's B is zero: give it a term to add.
    adapter.b = Tensor::randn(0f32, 0.5, adapter.b.shape(), &Device::Cpu).unwrap();
    let (a, b, scale) = (adapter.a.clone(), adapter.b.clone(), adapter.scale);
    let x = layer_input(&model, family, 1).to_dtype(DType::F32).unwrap();
    let x = x
        .reshape((x.elem_count() / x.dim(2).unwrap(), x.dim(2).unwrap()))
        .unwrap();
    let y = q.forward(&x).unwrap();
    let product = x.matmul(&q.weight.t().unwrap()).unwrap();
    let rounded = product
        .to_dtype(DType::BF16)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let term = (x
        .matmul(&a.t().unwrap())
        .unwrap()
        .matmul(&b.t().unwrap())
        .unwrap()
        * scale)
        .unwrap();
    let mean_distance = |base: &Tensor| {
        let want = (base + &term).unwrap();
        let diff = (&y - want).unwrap().abs().unwrap();
        diff.mean_all().unwrap().to_scalar::<f32>().unwrap()
    };
    let (from_peft, from_unrounded) = (mean_distance(&rounded), mean_distance(&product));
    println!("mean distance from PEFT's sum {from_peft:.2e}, from the unrounded one {from_unrounded:.2e}");
    assert!(
        from_peft * 20.0 < from_unrounded,
        "{from_peft} against {from_unrounded}"
    );
}
