//! AdamW's kernel as its launcher sees it: the argument list for the compiled table
//! ([`super::compiled`]), plain numbers so the CPU build's tests hold it to it.

use super::AdamWStep;
use crate::triton::{i64_of, Args, Value};

/// The table's variant for a gradient in the parameter's dtype (`false`) or in f32 (`true`).
pub(crate) fn variant(grad_f32: bool) -> usize {
    grad_f32 as usize
}

/// `adamw`'s arguments: `n` elements of `p`, `g`, `m` and `v`, updated in place.
pub(crate) fn adamw_args((p, g, m, v): (u64, u64, u64, u64), n: usize, s: &AdamWStep) -> Args {
    let f = |x: f64| Value::F32(x as f32);
    vec![
        ("P", Value::Pointer(p)),
        ("G", Value::Pointer(g)),
        ("M", Value::Pointer(m)),
        ("V", Value::Pointer(v)),
        ("n", i64_of(n)),
        ("lr", f(s.lr)),
        ("decay", f(s.decay)),
        ("beta1", f(s.beta1)),
        ("beta2", f(s.beta2)),
        // As the composed update has them: formed in f64, rounded once.
        ("rest1", f(1.0 - s.beta1)),
        ("rest2", f(1.0 - s.beta2)),
        ("inv_bc1", f(1.0 / s.bias_corrections.0)),
        ("inv_bc2", f(1.0 / s.bias_corrections.1)),
        ("eps", f(s.eps)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::adamw::compiled::KERNELS;
    use crate::triton::{assert_lists_fit, compiled_everywhere};

    #[test]
    fn the_launchers_argument_list_matches_the_compiled_kernels() {
        let step = AdamWStep {
            lr: 1e-5,
            decay: 1.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            bias_corrections: (0.1, 0.001),
        };
        for grad_f32 in [false, true] {
            assert!(compiled_everywhere(KERNELS, "adamw", variant(grad_f32)));
        }
        let buffers = (0x1000, 0x2000, 0x3000, 0x4000);
        assert_lists_fit(KERNELS, |_| adamw_args(buffers, 4096 * 4096, &step));
    }
}
