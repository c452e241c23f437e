//! The planner's model of the host products' workspace (`streambp_kernels::ops::matmul::workspace`) against
//! what they allocate, counted exactly by the counting allocator, for the three products of a
//! projection and of an LM head at several row counts, in f32 and f64. The model must never be
//! below the count (the budget mode's promise) and not far above it.
//!
//! gemm's blocking, and so its workspace, depends on the CPU: its cache sizes and the kernel it
//! dispatches to (AVX-512, AVX2 + FMA or scalar). The test holds on whichever CPU runs it; to run it
//! on the kinds this machine is not, `scripts/emulated-cpu.sh` (`.ci/run` does).
//!
//! One test function in its own binary, so no other test allocates while it measures.

use candle_core::{DType, Device, Tensor};
use streambp_core::memory::{current_bytes, peak_bytes, reset_peak, CountingAllocator};
use streambp_kernels::ops::matmul::{matmul, workspace, Product};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// A product as the engine runs it, `(label, model's view, a, b)`.
type Case = (String, Product, Tensor, Tensor);

/// The three products of a `[out, inner]` weight with `rows` rows of input: `x·Wᵀ` (forward),
/// `g·W` (input gradient), `gᵀ·x` (weight gradient), with the operands' layouts the engine gives
/// them (a transposed view where the engine takes one).
fn products(rows: usize, out: usize, inner: usize, dtype: DType) -> Vec<Case> {
    let filled = |shape: (usize, usize)| {
        Tensor::arange(0u32, (shape.0 * shape.1) as u32, &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| (t * 1e-3)?.sin())
            .and_then(|t| t.reshape(shape))
            .unwrap()
    };
    let (x, w, g) = (
        filled((rows, inner)),
        filled((out, inner)),
        filled((rows, out)),
    );
    let name = |what: &str| format!("{what} rows {rows}, W [{out}, {inner}], {dtype:?}");
    vec![
        (
            name("x·Wᵀ"),
            Product::by_transposed(rows, out, inner),
            x.clone(),
            w.t().unwrap(),
        ),
        (
            name("g·W"),
            Product::by_plain(rows, out, inner),
            g.clone(),
            w,
        ),
        (
            name("gᵀ·x"),
            Product::transposed_by(out, inner, rows),
            g.t().unwrap(),
            x,
        ),
    ]
}

#[test]
fn workspace_model_covers_what_the_products_allocate() {
    // Every worker's gemm slab (one L2 cache each, kept for good) first, so that the counts below
    // are each product's own: on each thread of the pool, a product whose blocks gemm packs in the
    // slab (rather than in a workspace of the call's own), small enough to be one tile, which the
    // thread that asks for it runs.
    let a = Tensor::ones((8, 2048), DType::F32, &Device::Cpu).unwrap();
    let b = Tensor::ones((2048, 64), DType::F32, &Device::Cpu).unwrap();
    rayon::broadcast(|_| matmul(&a, &b).unwrap());

    let mut shapes = Vec::new();
    for dtype in [DType::F32, DType::F64] {
        // A projection of a small model and of a wider one, an LM head (vocabulary 4096), a head
        // with hidden size 64, and a projection whose 500 outputs leave edge tiles that do not fill
        // gemm's vectors; rows from a decoding step's 8 to a large chunk's 600 (sizes kept
        // small enough to run on an emulated CPU in a minute or two).
        for (out, inner) in [(768, 256), (256, 768), (4096, 256), (2048, 64), (500, 256)] {
            for rows in [8, 100, 128, 300, 600] {
                shapes.extend(products(rows, out, inner, dtype));
            }
        }
    }
    // On a worker of rayon's pool, as the engine runs its phases (`on_workers`).
    let failures = streambp_core::on_workers(&Device::Cpu, || {
        shapes.into_iter().filter_map(check).collect::<Vec<_>>()
    });
    assert!(failures.is_empty(), "workspace model off: {failures:#?}");
}

/// One product's count against the model: a failure's description, if it is one.
fn check((label, product, a, b): Case) -> Option<String> {
    let dtype = a.dtype();
    let output = a.dim(0).unwrap() * b.dim(1).unwrap() * dtype.size_in_bytes();
    let before = current_bytes().unwrap();
    reset_peak();
    let c = matmul(&a, &b).unwrap();
    let measured = (peak_bytes().unwrap() - before).saturating_sub(output) as i64;
    drop(c);
    let model = workspace(product, dtype.size_in_bytes(), true) as i64;
    println!("{label}: measured {measured} B, model {model} B");
    // The count holds the output tensor's own small allocations (its shape and strides: a few
    // hundred bytes; the skinny kernel's tasks, a few more). The model counts every thread's tile
    // at once, which short tiles do not always reach.
    let threads = rayon::current_num_threads() as i64;
    let slack = 2048;
    (model < measured - slack || model > threads * measured + slack)
        .then(|| format!("{label}: measured {measured} B, model {model} B"))
}
