//! The attention kernel's bf16 products ([`Products::Bf16`], a bf16 layer computed in f32) round
//! where PyTorch's bf16 attention on the CPU rounds (`cpu_flash_attention` and its backward): the
//! forward's exponentials against the running maximum, the backward's probabilities, output
//! gradient and `dS`, each before its product, the sums in f32, `q·kᵀ` of the unscaled q scaled
//! after. Checked against an f64 model of exactly those roundings, and against the same model
//! without them, which the kernel must be much farther from (so that the test sees the roundings),
//! on whichever bf16 kernel is in force; the f32 products (`Products::Compute`) sit the other way
//! round.

use candle_core::{DType, Device, Tensor, Var};
use half::bf16;
use streambp_kernels::host::half_product::Kernel;
use streambp_kernels::ops::attention::{attention_over_heads, Blocking, Products};

/// `(b, kv_heads, group, c, t, hd, key_block)`.
type Shape = (usize, usize, usize, usize, usize, usize, usize);

/// Rows per kv head (`group · c`) past the packing kernels' minimum (16) in the first, under it in
/// the second (their products then take the widened kernel); key blocks that split the keys
/// unevenly, so that the online softmax rescales.
const SHAPES: [Shape; 2] = [(2, 2, 2, 24, 37, 8, 16), (1, 2, 3, 3, 11, 4, 4)];

/// A head width whose scale `1/√hd` is no power of two (bf16 q times it is not a bf16).
const SCALE: f64 = 0.353_553_390_593_273_8;

/// The values of the output and the gradients of q, k and v, flattened.
type Run = [Vec<f64>; 4];

/// A seeded stream of normal-ish values (sums of uniforms), as f32.
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut uniform = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..len)
        .map(|_| ((0..4).map(|_| uniform()).sum::<f64>() - 2.0) as f32)
        .collect()
}

fn to_bf16_values(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
}

/// The inputs of one shape: q `[b, heads, c, hd]`, k and v `[b, kv_heads, t, hd]` holding bf16
/// values, the loss weights `[b, c, heads·hd]` (f32 values: the output gradient rounds), and the
/// causal mask `[c, t]` of `c` queries at the last `c` of `t` positions.
struct Inputs {
    shape: Shape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    w: Vec<f32>,
    mask: Vec<f32>,
}

impl Inputs {
    fn new(shape: Shape) -> Self {
        let (b, kv, group, c, t, hd, _) = shape;
        let heads = kv * group;
        let mask = (0..c * t)
            .map(|x| match x % t <= t - c + x / t {
                true => 0.0,
                false => f32::MIN,
            })
            .collect();
        Self {
            shape,
            q: to_bf16_values(&values(b * heads * c * hd, 1)),
            k: to_bf16_values(&values(b * kv * t * hd, 2)),
            v: to_bf16_values(&values(b * kv * t * hd, 3)),
            w: values(b * c * heads * hd, 4),
            mask,
        }
    }

    /// The op's output and gradients of `Σ out ⊙ w` with `products`.
    fn kernel(&self, products: Products) -> Run {
        let (b, kv, group, c, t, hd, key_block) = self.shape;
        let dev = Device::Cpu;
        let var = |x: &[f32], shape: &[usize]| {
            Var::from_tensor(&Tensor::from_slice(x, shape, &dev).unwrap()).unwrap()
        };
        let q = var(&self.q, &[b, kv * group, c, hd]);
        let (k, v) = (var(&self.k, &[b, kv, t, hd]), var(&self.v, &[b, kv, t, hd]));
        let mask = Tensor::from_slice(&self.mask, (1, 1, 1, c, t), &dev).unwrap();
        let blocking = Blocking {
            compute: DType::F32,
            key_block,
            products,
        };
        let out = attention_over_heads(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            None,
            mask,
            blocking,
            SCALE,
        )
        .unwrap();
        let w = Tensor::from_slice(&self.w, out.shape(), &dev).unwrap();
        let grads = (&out * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let flat = |t: &Tensor| {
            t.flatten_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
        };
        let grad = |x: &Var| flat(grads.get(x.as_tensor()).unwrap());
        [flat(&out), grad(&q), grad(&k), grad(&v)]
    }

    /// The same in f64, rounding to bf16 where PyTorch's bf16 attention does (`round`), or nowhere.
    fn model(&self, round: bool) -> Run {
        let (b, kv, group, c, t, hd, key_block) = self.shape;
        let heads = kv * group;
        let r = |x: f64| match round {
            true => bf16::from_f64(x).to_f64(),
            false => x,
        };
        let at = |x: &[f32], i: usize| f64::from(x[i]);
        let qi = |bb: usize, h: usize, i: usize, d: usize| ((bb * heads + h) * c + i) * hd + d;
        let kj = |bb: usize, kvh: usize, j: usize, d: usize| ((bb * kv + kvh) * t + j) * hd + d;
        let oi = |bb: usize, i: usize, h: usize, d: usize| ((bb * c + i) * heads + h) * hd + d;
        let (mut out, mut dq) = (vec![0.0; b * c * heads * hd], vec![0.0; b * heads * c * hd]);
        let (mut dk, mut dv) = (vec![0.0; b * kv * t * hd], vec![0.0; b * kv * t * hd]);
        for (bb, h, i) in
            (0..b).flat_map(|bb| (0..heads).flat_map(move |h| (0..c).map(move |i| (bb, h, i))))
        {
            let kvh = h / group;
            let score = |j: usize| {
                let dot: f64 = (0..hd)
                    .map(|d| at(&self.q, qi(bb, h, i, d)) * at(&self.k, kj(bb, kvh, j, d)))
                    .sum();
                SCALE * dot + at(&self.mask, i * t + j)
            };
            // The forward: the online softmax over the key blocks, the exponentials against the
            // running maximum rounded for `P·V`, their sum not.
            let (mut max, mut sum, mut acc) = (f64::NEG_INFINITY, 0.0, vec![0.0; hd]);
            for start in (0..t).step_by(key_block) {
                let block = start..(start + key_block).min(t);
                let block_max = block.clone().map(score).fold(f64::NEG_INFINITY, f64::max);
                let new_max = max.max(block_max);
                let rescale = (max - new_max).exp();
                sum *= rescale;
                acc.iter_mut().for_each(|a| *a *= rescale);
                for j in block {
                    let e = (score(j) - new_max).exp();
                    sum += e;
                    for (d, a) in acc.iter_mut().enumerate() {
                        *a += r(e) * at(&self.v, kj(bb, kvh, j, d));
                    }
                }
                max = new_max;
            }
            let o: Vec<f64> = acc.iter().map(|a| a / sum).collect();
            let log_sum = sum.ln();
            // The backward: P from the normalizer; the output gradient and the output rounded
            // (both bf16 in PyTorch), P for `dV`, `dS` for `dQ` and `dK`.
            let g: Vec<f64> = (0..hd).map(|d| r(at(&self.w, oi(bb, i, h, d)))).collect();
            let dot: f64 = (0..hd).map(|d| g[d] * r(o[d])).sum();
            for j in 0..t {
                let p = ((score(j) - max) - log_sum).exp();
                let dp: f64 = (0..hd).map(|d| g[d] * at(&self.v, kj(bb, kvh, j, d))).sum();
                let ds = r(p * (dp - dot));
                for d in 0..hd {
                    dv[kj(bb, kvh, j, d)] += r(p) * g[d];
                    dq[qi(bb, h, i, d)] += SCALE * ds * at(&self.k, kj(bb, kvh, j, d));
                    dk[kj(bb, kvh, j, d)] += SCALE * ds * at(&self.q, qi(bb, h, i, d));
                }
            }
            for (d, &o) in o.iter().enumerate() {
                out[oi(bb, i, h, d)] = o;
            }
        }
        [out, dq, dk, dv]
    }
}

/// How far `got` is from `want`, per part: the 99th percentile and the largest of the elements'
/// differences, relative to `want`'s largest element. A bf16 rounding that falls the other way in
/// f32 than in f64 (a `dS` near a rounding boundary, whose `dP − Σ g ⊙ out` cancels) moves the
/// few elements it feeds by up to a bf16 step of that term; the percentile sees past those.
fn distances(got: &Run, want: &Run) -> [(f64, f64); 4] {
    std::array::from_fn(|p| {
        let largest = want[p].iter().fold(0f64, |m, x| m.max(x.abs()));
        let mut diffs: Vec<f64> = (got[p].iter().zip(&want[p]))
            .map(|(a, b)| (a - b).abs() / largest)
            .collect();
        diffs.sort_by(f64::total_cmp);
        let n = diffs.len();
        (diffs[n * 99 / 100], diffs[n - 1])
    })
}

#[test]
fn bf16_products_round_where_pytorchs_bf16_attention_rounds() {
    println!("bf16 kernel in force: {}", Kernel::detect().label());
    for shape in SHAPES {
        let inputs = Inputs::new(shape);
        let (rounded, exact) = (inputs.model(true), inputs.model(false));
        let bf16 = inputs.kernel(Products::Bf16);
        let f32 = inputs.kernel(Products::Compute);
        let parts = ["out", "dq", "dk", "dv"];
        let (bf16_rounded, bf16_exact) = (distances(&bf16, &rounded), distances(&bf16, &exact));
        let (f32_rounded, f32_exact) = (distances(&f32, &rounded), distances(&f32, &exact));
        for (p, part) in parts.iter().enumerate() {
            println!(
                "{shape:?} {part} (99th percentile, largest): bf16 products {:.1e}, {:.1e} from \
                 the rounding model, {:.1e}, {:.1e} from exact; f32 {:.1e}, {:.1e} / {:.1e}, {:.1e}",
                bf16_rounded[p].0,
                bf16_rounded[p].1,
                bf16_exact[p].0,
                bf16_exact[p].1,
                f32_rounded[p].0,
                f32_rounded[p].1,
                f32_exact[p].0,
                f32_exact[p].1,
            );
            let (near, far) = (bf16_rounded[p], bf16_exact[p]);
            assert!(
                near.0 < 1e-6 && near.1 < 2e-3,
                "{shape:?} {part}: bf16 products off the model"
            );
            assert!(
                far.0 > 100.0 * near.0,
                "{shape:?} {part}: the roundings do not show"
            );
            let (near, far) = (f32_exact[p], f32_rounded[p]);
            assert!(near.1 < 1e-5, "{shape:?} {part}: f32 products off exact");
            assert!(
                far.0 > 100.0 * near.0,
                "{shape:?} {part}: f32 products round"
            );
        }
    }
}
