//! The attention of one streamed chunk on the card, timed: the fused kernels and the composed tensor
//! ops, forward and forward + backward, for queries [s, e) against keys [0, e) of a Qwen3-8B layer's
//! shape (32 query heads, 8 key/value heads, head dim 128, bf16). Prints one JSON line per shape and
//! path, with TFLOP/s counted as for a causal kernel (forward 4·hd per query-key pair read, backward
//! 2.5 times the forward), for `scripts/sdpa_peer.py`'s figures of PyTorch's SDPA on the same card.
//!
//! `cargo run --release -p streambp-kernels --features cuda --example attention_card -- [T:CHUNK ...]`
//! (default 4096:4096 16384:16384 16384:2048; a chunk below T is the last chunk of the sequence).

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use streambp_kernels::backend::with_composed;
use streambp_kernels::ops::attention::{
    attention_in_layer, EarlierKeys, KeyMask, MaskStructure, Products,
};

/// Causal by index: the chunk's queries from `q_start`, keys from 0.
#[derive(Clone)]
struct Causal {
    q_start: usize,
    rows: usize,
    device: Device,
}

impl KeyMask for Causal {
    fn bias(&self, start: usize, n: usize, dtype: DType) -> candle_core::Result<Option<Tensor>> {
        let q = Tensor::arange(
            self.q_start as i64,
            (self.q_start + self.rows) as i64,
            &self.device,
        )?
        .reshape((self.rows, 1))?;
        let k = Tensor::arange(start as i64, (start + n) as i64, &self.device)?.reshape((1, n))?;
        let allowed = k.broadcast_le(&q)?.to_dtype(DType::F32)?;
        let floor = f32::MIN as f64;
        let bias = allowed
            .affine(-floor, floor)?
            .reshape((1, 1, 1, self.rows, n))?;
        Ok(Some(bias.to_dtype(dtype)?))
    }

    fn structure(&self) -> Option<MaskStructure> {
        Some(MaskStructure {
            q_start: self.q_start,
            k_start: 0,
            window: None,
            doc_start: None,
            key_valid: None,
        })
    }
}

fn main() -> candle_core::Result<()> {
    let device = Device::new_cuda(0)?;
    let shapes: Vec<(usize, usize)> = match std::env::args().skip(1).collect::<Vec<_>>() {
        args if args.is_empty() => vec![(4096, 4096), (16384, 16384), (16384, 2048)],
        args => args
            .iter()
            .map(|a| {
                let (t, c) = a.split_once(':').unwrap_or((a, a));
                (t.parse().expect("T"), c.parse().expect("CHUNK"))
            })
            .collect(),
    };
    let (heads, kv_heads, hd) = (32, 8, 128);
    for (t, c) in shapes {
        let s = t - c;
        let q = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (1, heads, c, hd), &device)?.to_dtype(DType::BF16)?,
        )?;
        let k_all =
            Tensor::randn(0f32, 1.0, (1, kv_heads, t, hd), &device)?.to_dtype(DType::BF16)?;
        let v_all =
            Tensor::randn(0f32, 1.0, (1, kv_heads, t, hd), &device)?.to_dtype(DType::BF16)?;
        let k = Var::from_tensor(&k_all.narrow(2, s, c)?)?;
        let v = Var::from_tensor(&v_all.narrow(2, s, c)?)?;
        let grad_keys = Tensor::zeros((1, kv_heads, t, hd), DType::BF16, &device)?;
        let grad_values = grad_keys.zeros_like()?;
        let pairs = (c * s + c * (c + 1) / 2) as f64;
        let forward_flops = 4.0 * (hd * heads) as f64 * pairs;
        let run = |backward: bool| -> candle_core::Result<()> {
            let earlier = (s > 0).then(|| EarlierKeys {
                keys: k_all.narrow(2, 0, s).unwrap(),
                values: v_all.narrow(2, 0, s).unwrap(),
                grad_keys: grad_keys.clone(),
                grad_values: grad_values.clone(),
                offset: 0,
            });
            let mask = Causal {
                q_start: s,
                rows: c,
                device: device.clone(),
            };
            // What a layer calls: on the card, the fused kernels where they apply.
            let scale = 1.0 / (hd as f64).sqrt();
            let (q, k, v) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
            let out = attention_in_layer(q, k, v, earlier, mask, Products::Compute, scale)?;
            if backward {
                out.to_dtype(DType::F32)?.sum_all()?.backward()?;
            }
            device.synchronize()
        };
        for composed in [false, true] {
            let path = if composed { "composed" } else { "fused" };
            let time = |backward: bool| -> candle_core::Result<f64> {
                let go = || run(backward);
                let once = || if composed { with_composed(go) } else { go() };
                once()?;
                let repeats = 3;
                let start = Instant::now();
                for _ in 0..repeats {
                    once()?;
                }
                Ok(start.elapsed().as_secs_f64() / repeats as f64)
            };
            let forward = time(false)?;
            let both = time(true)?;
            let backward = (both - forward).max(1e-9);
            println!(
                "{{\"path\": \"{path}\", \"T\": {t}, \"chunk\": {c}, \"heads\": {heads}, \"kv_heads\": {kv_heads}, \
                 \"head_dim\": {hd}, \"forward_ms\": {:.3}, \"backward_ms\": {:.3}, \"forward_tflops\": {:.1}, \
                 \"backward_tflops\": {:.1}}}",
                forward * 1e3,
                backward * 1e3,
                forward_flops / forward / 1e12,
                2.5 * forward_flops / backward / 1e12,
            );
        }
    }
    Ok(())
}
