//! The head softmax's kernels as their launcher sees them: the argument lists for the compiled
//! table ([`super::compiled`]), plain numbers so the CPU build's tests hold them to it.

use crate::triton::{i32_of, i64_of, Args, Value};

/// Columns per step of every compiled variant (the table's `variant`).
pub(crate) const BLOCK: usize = 4096;

/// A chunk `[n, vocab]` of contiguous rows and its per-row tables: the targets (i64) and the
/// log-sum-exps (f32).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chunk {
    pub z: u64,
    pub targets: u64,
    pub lse: u64,
    pub vocab: usize,
}

/// `head_log_softmax`'s arguments: the log-sum-exps, and the targets' log-probs into `logp`.
pub(crate) fn log_softmax_args(c: &Chunk, logp: u64) -> Args {
    vec![
        ("Z", Value::Pointer(c.z)),
        ("TARGETS", Value::Pointer(c.targets)),
        ("LSE", Value::Pointer(c.lse)),
        ("LOGP", Value::Pointer(logp)),
        ("stride_z", i64_of(c.vocab)),
        ("vocab", i32_of(c.vocab)),
    ]
}

/// `head_logit_grad`'s arguments: the logits' gradient over `z` for the rows' gradients `g` (f32).
pub(crate) fn logit_grad_args(c: &Chunk, g: u64) -> Args {
    vec![
        ("Z", Value::Pointer(c.z)),
        ("TARGETS", Value::Pointer(c.targets)),
        ("LSE", Value::Pointer(c.lse)),
        ("G", Value::Pointer(g)),
        ("stride_z", i64_of(c.vocab)),
        ("vocab", i32_of(c.vocab)),
    ]
}

/// `head_log_softmax_entropy`'s arguments: as [`log_softmax_args`], and the rows' entropies into
/// `entropy`.
pub(crate) fn log_softmax_entropy_args(c: &Chunk, logp: u64, entropy: u64) -> Args {
    vec![
        ("Z", Value::Pointer(c.z)),
        ("TARGETS", Value::Pointer(c.targets)),
        ("LSE", Value::Pointer(c.lse)),
        ("LOGP", Value::Pointer(logp)),
        ("ENTROPY", Value::Pointer(entropy)),
        ("stride_z", i64_of(c.vocab)),
        ("vocab", i32_of(c.vocab)),
    ]
}

/// `head_logit_grad_entropy`'s arguments: the logits' gradient over `z` from the rows' entropies
/// and the gradients `g` of their log-probs and `g_entropy` of their entropies (f32 each).
pub(crate) fn logit_grad_entropy_args(c: &Chunk, entropy: u64, (g, g_entropy): (u64, u64)) -> Args {
    vec![
        ("Z", Value::Pointer(c.z)),
        ("TARGETS", Value::Pointer(c.targets)),
        ("LSE", Value::Pointer(c.lse)),
        ("ENTROPY", Value::Pointer(entropy)),
        ("G", Value::Pointer(g)),
        ("G_ENTROPY", Value::Pointer(g_entropy)),
        ("stride_z", i64_of(c.vocab)),
        ("vocab", i32_of(c.vocab)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::head_softmax::compiled::KERNELS;
    use crate::triton::{assert_lists_fit, check, compiled_everywhere, Compiled, Mismatch};

    fn chunk(vocab: usize) -> Chunk {
        Chunk {
            z: 0x1000,
            targets: 0x2000,
            lse: 0x3000,
            vocab,
        }
    }

    #[test]
    fn the_launchers_argument_lists_match_the_compiled_kernels() {
        for kernel in [
            "head_log_softmax",
            "head_logit_grad",
            "head_log_softmax_entropy",
            "head_logit_grad_entropy",
        ] {
            assert!(compiled_everywhere(KERNELS, kernel, BLOCK), "{kernel}");
        }
        let args = |k: &Compiled, vocab| match k.kernel {
            "head_log_softmax" => log_softmax_args(&chunk(vocab), 0x4000),
            "head_log_softmax_entropy" => log_softmax_entropy_args(&chunk(vocab), 0x4000, 0x5000),
            "head_logit_grad_entropy" => {
                logit_grad_entropy_args(&chunk(vocab), 0x4000, (0x5000, 0x6000))
            }
            _ => logit_grad_args(&chunk(vocab), 0x4000),
        };
        assert_lists_fit(KERNELS, |k| args(k, 151_936));
        // A vocabulary not a multiple of 16 (a test model's): refused, and composed instead.
        for k in KERNELS {
            let refused = check(k, &args(k, 1000 + 3));
            assert!(matches!(refused, Err(Mismatch::Unaligned { .. })));
        }
    }
}
