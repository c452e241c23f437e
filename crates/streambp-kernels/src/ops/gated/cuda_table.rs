//! The gated activations' kernels as their launcher sees them: the argument lists it builds for the
//! compiled table ([`super::compiled`]), plain numbers so the CPU build's tests hold them to it.

use crate::triton::{i64_of, Args, Value};

/// `gated_forward`'s arguments: `y = act(gate) ⊙ up` over `n` elements.
pub(crate) fn forward_args(gate: u64, up: u64, y: u64, n: usize) -> Args {
    vec![
        ("GATE", Value::Pointer(gate)),
        ("UP", Value::Pointer(up)),
        ("Y", Value::Pointer(y)),
        ("n", i64_of(n)),
    ]
}

/// `gated_backward`'s arguments: d gate and d up for the output's gradient `g`.
pub(crate) fn backward_args(
    (gate, up, g): (u64, u64, u64),
    (d_gate, d_up): (u64, u64),
    n: usize,
) -> Args {
    vec![
        ("GATE", Value::Pointer(gate)),
        ("UP", Value::Pointer(up)),
        ("G", Value::Pointer(g)),
        ("DGATE", Value::Pointer(d_gate)),
        ("DUP", Value::Pointer(d_up)),
        ("n", i64_of(n)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gated::compiled::KERNELS;

    #[test]
    fn the_launchers_argument_lists_match_the_compiled_kernels() {
        crate::triton::assert_lists_fit(KERNELS, |k| match k.kernel {
            "gated_forward" => forward_args(0x1000, 0x2000, 0x3000, 5000),
            _ => backward_args((0x1000, 0x2000, 0x3000), (0x4000, 0x5000), 5000),
        });
    }
}
