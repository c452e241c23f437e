//! Times products of a few rows by a weight stored row by row (`x Wᵀ`, a decoding step's
//! projections and LM head) by `streambp_kernels::host::skinny` and by the kernels they took before:
//! gemm in tiles of 256 columns for f32, the widened tiles for bf16. The shapes are Qwen3-0.6B's
//! MLP up and down projections and its LM head; threads are rayon's; medians of 5 after a warm-up.
//!
//! `cargo run --release -p streambp-kernels --example skinny_products [rows,rows,...]`

use std::time::Instant;

use half::bf16;
use rayon::prelude::*;
use streambp_kernels::host::half_product::{product_by, Destination, Kernel, Operand};
use streambp_kernels::host::skinny;

/// Median seconds of `f` over 5 runs after one.
fn median_seconds(mut f: impl FnMut()) -> f64 {
    f();
    let mut times: Vec<f64> = (0..5)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[2]
}

/// `y = x Wᵀ` by gemm, one single-threaded call per tile of 256 columns over rayon's threads: the
/// f32 path before `skinny` (`cpu::gemm_into` in tiles).
fn gemm_in_tiles(y: &mut [f32], (m, n, k): (usize, usize, usize), x: &[f32], w: &[f32]) {
    struct Out(*mut f32);
    // SAFETY: each task writes only its own columns of `y`.
    unsafe impl Sync for Out {}
    let out = Out(y.as_mut_ptr());
    let out = &out;
    (0..n.div_ceil(256)).into_par_iter().for_each(|t| {
        let (j0, cols) = (t * 256, 256.min(n - t * 256));
        // SAFETY: columns j0..j0 + cols of the `[m, n]` output are this task's; `x` is `[m, k]`
        // and rows j0.. of `w` (`[n, k]`) are read as the columns of `Wᵀ`.
        unsafe {
            gemm::gemm(
                m,
                cols,
                k,
                out.0.add(j0),
                1,
                n as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                w.as_ptr().add(j0 * k),
                k as isize,
                1,
                1.0f32,
                1.0f32,
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        }
    });
}

fn main() {
    let rows: Vec<usize> = match std::env::args().nth(1) {
        Some(list) => list
            .split(',')
            .map(|r| {
                r.trim()
                    .parse()
                    .expect("rows: a comma-separated list of numbers")
            })
            .collect(),
        None => vec![1, 4, 8, 16, 24],
    };
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            let line = info.lines().find(|l| l.starts_with("model name"))?;
            Some(line.split(':').nth(1)?.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    println!(
        "{cpu}, {} threads, SIMD path {}; milliseconds (weight read per second)",
        rayon::current_num_threads(),
        streambp_kernels::choices::in_force().simd.name()
    );
    println!("| rows | W [n, k] | f32 gemm | f32 skinny | bf16 widened | bf16 skinny |");
    println!("|---|---|---|---|---|---|");
    for (n, k) in [(3072, 1024), (1024, 3072), (151936, 1024)] {
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
        let w16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        for &m in &rows {
            let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let x16: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let mut y = vec![0.0f32; m * n];
            let mut y16 = vec![bf16::ZERO; m * n];
            let gemm = median_seconds(|| gemm_in_tiles(&mut y, (m, n, k), &x, &w));
            let f32_skinny = median_seconds(|| {
                skinny::product::<f32, f32>((&mut y, n), (m, n, k), false, (&x, k), (&w, k))
            });
            let (a, b) = (
                Operand {
                    data: &x16,
                    row_stride: k,
                    col_stride: 1,
                },
                Operand {
                    data: &w16,
                    row_stride: 1,
                    col_stride: k,
                },
            );
            let widened = median_seconds(|| {
                let dst = Destination::Bf16(&mut y16);
                product_by(Kernel::Widened, dst, (m, n, k), a, b)
            });
            let x_wide: Vec<f32> = x16.iter().map(|v| v.to_f32()).collect();
            let bf16_skinny = median_seconds(|| {
                let x = (x_wide.as_slice(), k);
                skinny::product::<bf16, bf16>((&mut y16, n), (m, n, k), false, x, (&w16, k))
            });
            let cell = |seconds: f64, bytes: usize| {
                format!(
                    "{:.2} ({:.1} GB/s)",
                    seconds * 1e3,
                    bytes as f64 / seconds / 1e9
                )
            };
            println!(
                "| {m} | [{n}, {k}] | {} | {} | {} | {} |",
                cell(gemm, 4 * n * k),
                cell(f32_skinny, 4 * n * k),
                cell(widened, 2 * n * k),
                cell(bf16_skinny, 2 * n * k)
            );
        }
    }
}
