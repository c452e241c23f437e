//! The KV cache's buffers: a cache that starts empty and grows as tokens come and one made for the
//! whole sequence give each position the logits of the uncached forward over the sequence so far,
//! in every family; Gemma3's sliding-window layers (window 4, which the sequence passes) drop the
//! keys no later query sees and hold at most twice the window.

mod common;

use candle_core::{DType, Device, IndexOp, Tensor};
use common::*;
use streambp_models::decode::KvCache;
use streambp_models::load_model;

#[test]
fn growing_and_preallocated_caches_match_the_uncached_forward() {
    let tokens: Vec<u32> = (0..11u32).map(|i| (i * 37 + 5) % 90).collect();
    let prompt = 3;
    for family in ["qwen2", "qwen3", "llama3", "gemma3"] {
        let model = load_model(&fixture_dir(family), DType::F64, &Device::Cpu)
            .unwrap()
            .detached();
        let all = Tensor::new(tokens.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let uncached = model.forward(&all, None).unwrap().i(0).unwrap();
        for mut cache in [
            KvCache::new(&model),
            KvCache::with_capacity(&model, tokens.len()),
        ] {
            // The prompt in one step, then one token at a time: the growing cache's global layers
            // reallocate for 3, 7 and 15 positions (twice those kept, plus the new one).
            let mut at = 0;
            for n in std::iter::once(prompt).chain(std::iter::repeat_n(1, tokens.len() - prompt)) {
                let logits = cache.step(&model, &all.narrow(1, at, n).unwrap()).unwrap();
                at += n;
                let want = uncached.i(at - 1).unwrap().unsqueeze(0).unwrap();
                let err = rel_err(&logits, &want);
                assert!(err < 1e-12, "{family}, position {}: {err:e}", at - 1);
            }
            assert_eq!(cache.len(), tokens.len());
            for (layer, room) in model.layers.iter().zip(cache.room().unwrap()) {
                match layer.kind.sliding_window {
                    Some(window) => assert!(room <= 2 * window, "{family}: {room} positions"),
                    None => assert!(room >= tokens.len(), "{family}: {room} positions"),
                }
            }
        }
    }
}
