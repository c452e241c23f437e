//! The attention op's parts as `op_times` counts them (the bench's `--op-times`): one call per key
//! block on the tensor-op path (the one CUDA takes, its softmax's tensor ops each a part of their
//! own), one per op on the host kernel, nothing while timing is off. A test binary of its own: the totals are the process's.

use candle_core::{DType, Device, Tensor, Var};
use streambp_models::attention::{attention, with_composed_path, Blocking};
use streambp_models::op_times;

/// One forward and backward of a causal attention op of 20 queries and keys in blocks of 8 (three
/// blocks), on the path `with_composed_path` or not says.
fn forward_and_backward() {
    let dev = Device::Cpu;
    let (kv_heads, group, t, hd) = (2, 2, 20, 4);
    let randn = |shape: &[usize]| Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
    let q = Var::from_tensor(&randn(&[1, kv_heads, group * t, hd])).unwrap();
    let k = Var::from_tensor(&randn(&[1, kv_heads, t, hd])).unwrap();
    let v = Var::from_tensor(&randn(&[1, kv_heads, t, hd])).unwrap();
    let causal: Vec<f32> = (0..t * t)
        .map(|x| if x % t <= x / t { 0.0 } else { f32::MIN })
        .collect();
    let bias = Tensor::from_vec(causal, (1, 1, 1, t, t), &dev).unwrap();
    let blocking = Blocking {
        compute: DType::F32,
        key_block: 8,
    };
    let out = attention(
        q.as_tensor(),
        k.as_tensor(),
        v.as_tensor(),
        None,
        bias,
        group,
        blocking,
    );
    let grads = out.unwrap().sum_all().unwrap().backward().unwrap();
    assert!(grads.get(q.as_tensor()).is_some());
}

fn calls() -> Vec<(&'static str, u64)> {
    let mut parts: Vec<_> = op_times::take()
        .into_iter()
        .map(|t| {
            assert!(t.seconds >= 0.0, "{t:?}");
            (t.name, t.calls)
        })
        .collect();
    parts.sort();
    parts
}

#[test]
fn attention_parts_are_counted_per_key_block_and_only_while_on() {
    forward_and_backward();
    with_composed_path(forward_and_backward);
    assert_eq!(calls(), []);

    op_times::switch(true);
    with_composed_path(forward_and_backward);
    let blocks = 3;
    assert_eq!(
        calls(),
        [
            ("attention.backward.products", blocks),
            ("attention.backward.scatter", blocks),
            ("attention.backward.scores", blocks),
            ("attention.backward.softmax", blocks),
            ("attention.backward.softmax.gradient", blocks),
            ("attention.backward.softmax.probabilities", blocks),
            ("attention.forward.scores", blocks),
            ("attention.forward.softmax", blocks),
            ("attention.forward.softmax.exp", blocks),
            ("attention.forward.softmax.mask", blocks),
            ("attention.forward.softmax.max", blocks),
            ("attention.forward.softmax.sum", blocks),
            ("attention.forward.values", blocks),
            // The scores' parts, the forward's and the backward's.
            ("attention.scores.cast", 2 * blocks),
            ("attention.scores.mask", 2 * blocks),
            ("attention.scores.product", 2 * blocks),
        ]
    );
    forward_and_backward();
    op_times::switch(false);
    assert_eq!(
        calls(),
        [
            ("attention.backward.kernel", 1),
            ("attention.forward.kernel", 1)
        ]
    );
}
