//! Times the host's matrix products and casts one at a time, bf16 beside f32, at the shapes of a
//! `qwen3-small` step (hidden 256, MLP 768, vocabulary 16,384, chunks of 128 rows, logits chunk
//! 100), and AdamW's update of the embedding-sized parameter in place and composed: to find which
//! of them makes one CPU slower than another where a whole step only says that it is. Medians of `REPEATS` (default 30) after one warm-up; threads are rayon's.
//!
//! `cargo run --release -p streambp-kernels --example op_timings [hidden mlp vocab rows]`

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use half::bf16;
use streambp_kernels::host::{half_product, products};
use streambp_kernels::ops::adamw::{composed, update_in_place, AdamWStep};
use streambp_kernels::ops::cast;

type Result<T> = candle_core::Result<T>;

fn median_seconds(repeats: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[repeats / 2])
}

/// A row-major `[_, cols]` bf16 matrix as a product operand, transposed or not.
fn operand(data: &[bf16], cols: usize, transpose: bool) -> half_product::Operand<'_> {
    let op = half_product::Operand {
        data,
        row_stride: cols,
        col_stride: 1,
    };
    if transpose {
        op.transposed()
    } else {
        op
    }
}

fn random(rows: usize, cols: usize, dtype: DType) -> Result<Tensor> {
    Tensor::randn(0f32, 0.02, (rows, cols), &Device::Cpu)?.to_dtype(dtype)
}

fn main() -> Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("sizes are whole numbers"))
        .collect();
    let size = |i: usize, default: usize| args.get(i).copied().unwrap_or(default);
    let (hidden, mlp, vocab, rows) = (size(0, 256), size(1, 768), size(2, 16384), size(3, 128));
    let logits_rows = 100;
    let repeats = std::env::var("REPEATS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(30)
        .max(1);
    println!(
        "threads {}, SIMD {}, hidden {hidden}, mlp {mlp}, vocab {vocab}, rows {rows}",
        rayon::current_num_threads(),
        streambp_kernels::choices::in_force().simd.name()
    );
    // (name, a's rows × cols, b's rows × cols, transpose a, transpose b): a·b after the transposes.
    let products = [
        ("x Wᵀ (forward)", (rows, hidden), (mlp, hidden), false, true),
        (
            "dY W (input grad)",
            (rows, mlp),
            (mlp, hidden),
            false,
            false,
        ),
        (
            "dYᵀ X (weight grad)",
            (rows, mlp),
            (rows, hidden),
            true,
            false,
        ),
        (
            "h Eᵀ (logits)",
            (logits_rows, hidden),
            (vocab, hidden),
            false,
            true,
        ),
        (
            "dL E (head input grad)",
            (logits_rows, vocab),
            (vocab, hidden),
            false,
            false,
        ),
        (
            "dLᵀ h (embedding grad)",
            (logits_rows, vocab),
            (logits_rows, hidden),
            true,
            false,
        ),
    ];
    let kernels = half_product::Kernel::available();
    let chosen = half_product::Kernel::detect();
    let names: Vec<String> = kernels.iter().map(|k| format!("bf16 {k:?} (ms)")).collect();
    println!(
        "bf16 kernels {kernels:?}, {} chosen\n\n| product | m × n × k | {} | f32, ours in tiles (ms) | f32, candle's (ms) |",
        chosen.label(),
        names.join(" | ")
    );
    println!("|---|---|{}---|---|", "---|".repeat(kernels.len()));
    for (name, (ar, ac), (br, bc), ta, tb) in products {
        let matrix = |rows, cols, transpose| -> Result<(Tensor, Vec<bf16>)> {
            let t = random(rows, cols, DType::F32)?;
            let data = t.flatten_all()?.to_dtype(DType::BF16)?.to_vec1::<bf16>()?;
            Ok((if transpose { t.t()? } else { t }, data))
        };
        let ((a, a16), (b, b16)) = (matrix(ar, ac, ta)?, matrix(br, bc, tb)?);
        let (oa, ob) = (operand(&a16, ac, ta), operand(&b16, bc, tb));
        let mnk = (a.dim(0)?, b.dim(1)?, a.dim(1)?);
        let mut out = vec![bf16::ZERO; mnk.0 * mnk.1];
        let mut row = format!("| {name} | {} × {} × {} |", mnk.0, mnk.1, mnk.2);
        for &kernel in &kernels {
            let s = median_seconds(repeats, || {
                half_product::product_by(
                    kernel,
                    half_product::Destination::Bf16(&mut out),
                    mnk,
                    oa,
                    ob,
                );
                Ok(())
            })?;
            row += &format!(" {:.3} |", s * 1e3);
        }
        // The step's own f32 products (`cpu::tiled_matmul`: tiles over rayon's threads), then
        // candle's (gemm splitting one call over the threads).
        let tiled = median_seconds(repeats, || {
            std::hint::black_box(products::tiled_matmul(&a, &b)?);
            Ok(())
        })?;
        let candle = median_seconds(repeats, || {
            std::hint::black_box(a.matmul(&b)?);
            Ok(())
        })?;
        println!("{row} {:.3} | {:.3} |", tiled * 1e3, candle * 1e3);
    }
    let elements = 2048 * mlp;
    let wide = random(2048, mlp, DType::F32)?;
    let narrow = wide.to_dtype(DType::BF16)?;
    let casts = [
        ("bf16 -> f32, ours", &narrow, DType::F32, true),
        ("f32 -> bf16, ours", &wide, DType::BF16, true),
        ("bf16 -> f32, candle", &narrow, DType::F32, false),
        ("f32 -> bf16, candle", &wide, DType::BF16, false),
    ];
    println!("\n| cast of {elements} elements | ms | GB/s read + written |");
    println!("|---|---|---|");
    for (name, t, dtype, ours) in casts {
        let s = median_seconds(repeats, || {
            let out = if ours {
                cast::cast(t, dtype)?
            } else {
                t.to_dtype(dtype)?
            };
            std::hint::black_box(out);
            Ok(())
        })?;
        println!(
            "| {name} | {:.3} | {:.1} |",
            s * 1e3,
            (elements * 6) as f64 / s / 1e9
        );
    }
    adamw_timings(vocab * hidden, repeats)
}

/// AdamW's update of one `n`-element parameter (the embedding's size), in place in one pass
/// against the composed ops it equals, f32 and bf16 parameters (moments f32).
fn adamw_timings(n: usize, repeats: usize) -> Result<()> {
    let step = AdamWStep {
        lr: 1e-5,
        decay: 1.0 - 1e-5 * 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        bias_corrections: (0.1, 0.001),
    };
    println!(
        "
| AdamW on {n} elements | in place (ms) | composed (ms) |"
    );
    println!("|---|---|---|");
    for dtype in [DType::F32, DType::BF16] {
        let p = random(n, 1, dtype)?;
        let g = random(n, 1, dtype)?;
        let (m, v) = (random(n, 1, DType::F32)?, random(n, 1, DType::F32)?.abs()?);
        let in_place = median_seconds(repeats, || {
            assert!(update_in_place(&p, &g, (&m, &v), &step)?);
            Ok(())
        })?;
        let composed = median_seconds(repeats, || {
            let [p_new, m_new, v_new] = composed(&p, &g, (&m, &v), &step)?;
            std::hint::black_box((p_new.to_dtype(dtype)?, m_new, v_new));
            Ok(())
        })?;
        println!(
            "| {dtype:?} parameter | {:.3} | {:.3} |",
            in_place * 1e3,
            composed * 1e3
        );
    }
    Ok(())
}
