//! The attention op's parts as `op_times` counts them (the bench's `--op-times`): one call per key
//! block on the tensor-op path (the one CUDA takes, its softmax's tensor ops each a part of their
//! own), one per op on the host kernel, nothing while timing is off; and parts in parts. A test
//! binary of its own: the totals are the process's, and its tests take turns with them.

use std::sync::Mutex;

use candle_core::{DType, Device, Tensor, Var};
use streambp_kernels::backend::with_composed;
use streambp_kernels::op_times;
use streambp_kernels::ops::attention::{attention, Blocking, Products};

/// One forward and backward of a causal attention op of 20 queries and keys in blocks of 8 (three
/// blocks), on the path `with_composed` or not says.
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
        products: Products::Compute,
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
        .map(|t| (t.name, t.calls))
        .collect();
    parts.sort();
    parts
}

/// The tests' turns with the process's timing.
static TURN: Mutex<()> = Mutex::new(());

#[test]
fn attention_parts_are_counted_per_key_block_and_only_while_on() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    forward_and_backward();
    with_composed(forward_and_backward);
    assert_eq!(calls(), []);

    op_times::switch(true);
    with_composed(forward_and_backward);
    let blocks = 3;
    assert_eq!(
        calls(),
        [
            ("attention.backward.products", blocks),
            ("attention.backward.scatter", blocks),
            ("attention.backward.scores_and_dp", blocks),
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

#[test]
fn parts_in_parts_are_counted_each_and_only_while_on() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let cpu = Device::Cpu;
    let inner = || {
        op_times::timed("inner", &cpu, || {
            std::thread::sleep(std::time::Duration::from_millis(2));
            Ok::<_, ()>(())
        })
    };
    inner().unwrap();
    op_times::switch(true);
    for _ in 0..3 {
        op_times::timed("outer", &cpu, inner).unwrap();
    }
    op_times::switch(false);
    inner().unwrap();
    let parts = op_times::take();
    // The outer part starts first but ends last: it is added after its inner part.
    let names: Vec<_> = parts.iter().map(|t| (t.name, t.calls)).collect();
    assert_eq!(names, [("inner", 3), ("outer", 3)]);
    // Three sleeps of 2 ms each, the outer part holding the inner one.
    assert!(parts[0].seconds >= 0.006, "{parts:?}");
    assert!(parts[1].seconds >= parts[0].seconds, "{parts:?}");
}
