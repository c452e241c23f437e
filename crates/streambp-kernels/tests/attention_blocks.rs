//! The attention op gives the output and gradients of the composed softmax attention that autograd
//! differentiates, whatever its key block (f64), including rows whose keys are all masked in some
//! blocks, and rows masked entirely (padding); and the same with the first keys given as earlier keys
//! (constants whose gradients the op adds into buffers).

use candle_core::{DType, Device, Tensor, Var};
use streambp_kernels::backend::with_composed;
use streambp_kernels::ops::attention::{
    attention, with_fused_softmax_blocks, Blocking, EarlierKeys, Products,
};
use streambp_testkit::rel_err;

/// An output and its gradients for q, k and v.
type Run = (Tensor, Tensor, Tensor, Tensor);

fn refs(r: &Run) -> [&Tensor; 4] {
    [&r.0, &r.1, &r.2, &r.3]
}

/// `got` equals `want` (output, dq, dk, dv) to 1e-12 relative.
fn assert_same(what: &str, got: [&Tensor; 4], want: [&Tensor; 4]) {
    assert_within(1e-12, what, got, want);
}

/// `got` equals `want` (output, dq, dk, dv) to `bound` relative.
fn assert_within(bound: f64, what: &str, got: [&Tensor; 4], want: [&Tensor; 4]) {
    for ((name, a), b) in ["out", "dq", "dk", "dv"].into_iter().zip(got).zip(want) {
        let e = rel_err(a, b);
        assert!(e < bound, "{what}: {name} {e:.2e}");
    }
}

/// An output with the gradients of `sum(out ⊙ weights)` with respect to q, k and v.
fn with_grads(out: Tensor, weights: &Tensor, [q, k, v]: [&Var; 3]) -> Run {
    let grads = (&out * weights)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = |x: &Var| grads.get(x.as_tensor()).unwrap().clone();
    (out, g(q), g(k), g(v))
}

/// The shapes checked: small, and one whose 140 query rows per head span two of the CPU kernel's
/// row tiles (128 rows) with queries that wrap around the chunk (`row % c`).
const SHAPES: [Shape; 2] = [(2, 2, 3, 5, 11, 4), (2, 1, 2, 70, 83, 3)];

/// `(b, kv_heads, group, c, t, hd)`.
type Shape = (usize, usize, usize, usize, usize, usize);

/// The CPU kernel (what f64 on the CPU runs).
#[test]
fn key_blocks_do_not_change_output_or_gradients() {
    SHAPES.into_iter().for_each(check_against_composed_softmax);
}

/// The op's tensor-op path (CUDA's), run on the CPU, and the same with the host's fused softmax
/// blocks (what the CPU runs where its kernel does not apply).
#[test]
fn the_tensor_op_path_agrees_too() {
    with_composed(|| SHAPES.into_iter().for_each(check_against_composed_softmax));
    with_fused_softmax_blocks(|| SHAPES.into_iter().for_each(check_against_composed_softmax));
}

/// The f32 additive mask `[1, 1, 1, c, t]` of `c` queries at the last `c` of `t` positions, each
/// seeing the keys up to its own.
fn causal_bias(c: usize, t: usize) -> Tensor {
    let causal: Vec<f32> = (0..c * t)
        .map(|x| {
            if x % t <= t - c + x / t {
                0.0
            } else {
                f32::MIN
            }
        })
        .collect();
    Tensor::from_vec(causal, (1, 1, 1, c, t), &Device::Cpu).unwrap()
}

/// The kernel in f32 against the tensor-op path in f32 (the dtype training runs in).
#[test]
fn the_kernel_agrees_in_f32() {
    let dev = Device::Cpu;
    let (b, kv_heads, group, c, t, hd) = (1, 2, 2, 130, 700, 8);
    let randn = |shape: &[usize]| Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
    let q = Var::from_tensor(&randn(&[b, kv_heads, group * c, hd])).unwrap();
    let k = Var::from_tensor(&randn(&[b, kv_heads, t, hd])).unwrap();
    let v = Var::from_tensor(&randn(&[b, kv_heads, t, hd])).unwrap();
    let bias = causal_bias(c, t);
    let weights = randn(&[b, kv_heads, group * c, hd]);
    let run = || {
        let out = attention(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            None,
            bias.clone(),
            group,
            Blocking {
                compute: DType::F32,
                key_block: 256,
                products: Products::Compute,
            },
        )
        .unwrap();
        with_grads(out, &weights, [&q, &k, &v])
    };
    let kernel = run();
    let composed = with_composed(run);
    assert_within(1e-5, "f32", refs(&kernel), refs(&composed));
    let fused_softmax = with_fused_softmax_blocks(run);
    assert_within(1e-5, "f32", refs(&kernel), refs(&fused_softmax));
}

fn check_against_composed_softmax((b, kv_heads, group, c, t, hd): Shape) {
    let dev = Device::Cpu;
    let randn = |shape: &[usize]| Tensor::randn(0f64, 1.0, shape, &dev).unwrap();
    let q = Var::from_tensor(&randn(&[b, kv_heads, group * c, hd])).unwrap();
    let k = Var::from_tensor(&randn(&[b, kv_heads, t, hd])).unwrap();
    let v = Var::from_tensor(&randn(&[b, kv_heads, t, hd])).unwrap();
    // Queries at the last c positions of row 0 see keys up to their own position; row 1 sees only
    // its last 3 keys, except its first query, which sees nothing (a padding row).
    let mut allowed = vec![0f64; b * c * t];
    for i in 0..c {
        for j in 0..t {
            allowed[i * t + j] = f64::from(u8::from(j <= t - c + i));
            allowed[c * t + i * t + j] = f64::from(u8::from(i > 0 && j >= t - 3));
        }
    }
    let bias = Tensor::from_vec(allowed, (b, 1, 1, c, t), &dev)
        .unwrap()
        .affine(-f64::MIN, f64::MIN)
        .unwrap();
    let weights = randn(&[b, kv_heads, group * c, hd]);
    let run = |key_block: usize| {
        let out = attention(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            None,
            bias.clone(),
            group,
            Blocking {
                compute: DType::F64,
                key_block,
                products: Products::Compute,
            },
        )
        .unwrap();
        with_grads(out, &weights, [&q, &k, &v])
    };
    let whole = run(t);
    // The composition autograd differentiates: softmax(q kᵀ + bias) v with the query heads grouped.
    let composed = {
        let scores = q
            .as_tensor()
            .matmul(&k.as_tensor().t().unwrap())
            .unwrap()
            .reshape((b, kv_heads, group, c, t))
            .unwrap()
            .broadcast_add(&bias)
            .unwrap();
        let p = candle_nn::ops::softmax(&scores, candle_core::D::Minus1)
            .unwrap()
            .reshape((b, kv_heads, group * c, t))
            .unwrap();
        let out = p.matmul(v.as_tensor()).unwrap();
        with_grads(out, &weights, [&q, &k, &v])
    };
    assert_same("vs composed softmax", refs(&whole), refs(&composed));
    // The first `m` keys given as earlier keys (constants whose gradients the op adds in place into
    // buffers from `offset`), the rest as the op's own: the same output and gradients.
    for (m, key_block) in [(1, 2), (4, 3), (6, 11), (10, 4)] {
        let offset = 2;
        let grad_keys = Tensor::zeros((b, kv_heads, t + offset, hd), DType::F64, &dev).unwrap();
        let grad_values = grad_keys.zeros_like().unwrap();
        let earlier = EarlierKeys {
            keys: k.as_tensor().narrow(2, 0, m).unwrap(),
            values: v.as_tensor().narrow(2, 0, m).unwrap(),
            grad_keys: grad_keys.clone(),
            grad_values: grad_values.clone(),
            offset,
        };
        let own = |x: &Var| x.as_tensor().narrow(2, m, t - m).unwrap();
        let out = attention(
            q.as_tensor(),
            &own(&k),
            &own(&v),
            Some(earlier),
            bias.clone(),
            group,
            Blocking {
                compute: DType::F64,
                key_block,
                products: Products::Compute,
            },
        )
        .unwrap();
        let (out, dq, dk, dv) = with_grads(out, &weights, [&q, &k, &v]);
        // Autograd's gradient of k and v is for their own part only (the earlier part entered as a
        // constant); the buffers hold the earlier part's.
        let whole_keys = |buffer: &Tensor, g: &Tensor| {
            let earlier = buffer.narrow(2, offset, m).unwrap();
            Tensor::cat(&[&earlier, &g.narrow(2, m, t - m).unwrap()], 2).unwrap()
        };
        assert_eq!(
            grad_keys
                .narrow(2, 0, offset)
                .unwrap()
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap(),
            0.0,
            "nothing written before the offset"
        );
        assert_same(
            &format!("{m} earlier keys, key block {key_block}"),
            [
                &out,
                &dq,
                &whole_keys(&grad_keys, &dk),
                &whole_keys(&grad_values, &dv),
            ],
            refs(&whole),
        );
    }
    for key_block in [1, 3, 4, 8] {
        let blocked = run(key_block);
        assert_same(
            &format!("key block {key_block}"),
            refs(&blocked),
            refs(&whole),
        );
    }
}

/// bf16 keys and values under f32 queries (a bf16 model's KV cache): the kernel widens them a key
/// block at a time, the backward whole, with the bits of the same keys widened to f32 before the
/// op (their gradients then rounded to bf16), on the kernel and on the tensor-op path, across
/// several key blocks.
#[test]
fn bf16_keys_give_the_bits_of_their_f32_values() {
    let dev = Device::Cpu;
    let (b, kv_heads, group, c, t, hd) = (2, 2, 2, 3, 300, 8);
    let randn = |shape: &[usize]| Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
    let q = Var::from_tensor(&randn(&[b, kv_heads, group * c, hd])).unwrap();
    let bf16 = |x: Tensor| Var::from_tensor(&x.to_dtype(DType::BF16).unwrap()).unwrap();
    let (k16, v16) = (
        bf16(randn(&[b, kv_heads, t, hd])),
        bf16(randn(&[b, kv_heads, t, hd])),
    );
    let f32_of = |x: &Var| Var::from_tensor(&x.to_dtype(DType::F32).unwrap()).unwrap();
    let (k32, v32) = (f32_of(&k16), f32_of(&v16));
    let bias = causal_bias(c, t);
    let weights = randn(&[b, kv_heads, group * c, hd]);
    let run = |k: &Var, v: &Var| {
        let blocking = Blocking {
            compute: DType::F32,
            key_block: 128,
            products: Products::Compute,
        };
        let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
        let out = attention(qt, kt, vt, None, bias.clone(), group, blocking).unwrap();
        with_grads(out, &weights, [&q, k, v])
    };
    let rounded = |x: &Tensor| x.to_dtype(DType::BF16).unwrap();
    for path in ["kernel", "tensor ops", "fused softmax blocks"] {
        let on_path = |k: &Var, v: &Var| match path {
            "tensor ops" => with_composed(|| run(k, v)),
            "fused softmax blocks" => with_fused_softmax_blocks(|| run(k, v)),
            _ => run(k, v),
        };
        let (stored, widened) = (on_path(&k16, &v16), on_path(&k32, &v32));
        assert_eq!(stored.2.dtype(), DType::BF16, "dk in the keys' dtype");
        let widened = (
            widened.0,
            widened.1,
            rounded(&widened.2),
            rounded(&widened.3),
        );
        for (name, a, b) in [
            ("out", &stored.0, &widened.0),
            ("dq", &stored.1, &widened.1),
            ("dk", &stored.2, &widened.2),
            ("dv", &stored.3, &widened.3),
        ] {
            let (a, b) = (
                a.to_dtype(DType::F32).unwrap(),
                b.to_dtype(DType::F32).unwrap(),
            );
            let same = a.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                == b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(same, "{path}: {name} differs");
        }
    }
}
