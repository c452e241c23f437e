//! The card's attention kernels as the launcher sees them: the compiled table ([`KERNELS`], generated
//! by `scripts/compile_triton.py`), the argument lists the launcher builds for each kernel, and the
//! check that a list matches what the compiler was told (names, types, and the divisibility by 16 it
//! assumed of pointers and strides). Plain numbers only, so the CPU build and its tests hold the
//! launcher's lists against the metadata; launching is `fused`'s, under the `cuda` feature.

/// A cubin's bytes under the `cuda` feature; nothing in a CPU build.
#[cfg(feature = "cuda")]
macro_rules! cubin {
    ($path:literal) => {
        include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/cubins/", $path))
    };
}
#[cfg(not(feature = "cuda"))]
macro_rules! cubin {
    ($path:literal) => {
        &[]
    };
}
pub(super) use cubin;

/// A kernel argument's name and type, as the kernel declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arg {
    /// A device pointer (64-bit address), 16-byte aligned.
    Pointer(&'static str),
    I32(&'static str),
    /// Strides, 64-bit so offsets past 2^31 elements hold.
    I64(&'static str),
    F32(&'static str),
}

impl Arg {
    fn name(self) -> &'static str {
        match self {
            Arg::Pointer(n) | Arg::I32(n) | Arg::I64(n) | Arg::F32(n) => n,
        }
    }
}

/// One compiled kernel.
#[derive(Debug)]
pub(crate) struct Compiled {
    /// The Triton function's name.
    pub kernel: &'static str,
    /// Compute capability (80: A100/A800 and later 8.x; 90: H100/H200).
    pub arch: u32,
    /// The inputs' dtype: "bf16" or "fp32".
    pub dtype: &'static str,
    pub head_dim: usize,
    /// Query rows per program.
    pub block_m: usize,
    /// Keys per program or step (0 where the kernel has none).
    pub block_n: usize,
    /// Threads per block: 32 × warps.
    pub warps: u32,
    /// Dynamic shared memory per block, bytes.
    pub shared: u32,
    /// The function's symbol in the cubin.
    pub symbol: &'static str,
    /// The arguments in order (the two scratch pointers Triton appends are not listed).
    pub args: &'static [Arg],
    pub cubin: &'static [u8],
    /// Of the cubin, as the script wrote it.
    pub sha256: &'static str,
}

/// An argument's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Value {
    Pointer(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// A tensor as a kernel reads it: its first element's device address and the strides, in elements,
/// of its three dimensions above the last, which must be contiguous.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct View {
    pub ptr: u64,
    pub strides: [i64; 3],
}

/// A `[b, T]` per-token table (document starts, key validity): its address and row stride; `None`
/// where the batch has none.
pub(crate) type Row = Option<(u64, i64)>;

/// Which rows and keys one chunk's kernels cover, and which keys each row reads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Chunk {
    pub heads: usize,
    pub group: usize,
    /// Query rows.
    pub rows: usize,
    /// Earlier keys (read from their own tensors), then the chunk's own.
    pub earlier: usize,
    pub own: usize,
    /// Absolute index of the first query and of the first (earlier) key.
    pub q_start: usize,
    pub k_start: usize,
    /// Sliding window (0: none).
    pub window: usize,
    pub scale: f32,
}

/// The arguments of an entry's kernel in order, named as the kernel names them.
pub(crate) type Args = Vec<(&'static str, Value)>;

/// A count as the kernels' 32-bit argument; -1 (refused by [`check`]) where it does not fit.
fn i32_of(x: usize) -> Value {
    Value::I32(i32::try_from(x).unwrap_or(-1))
}

fn view(args: &mut Args, names: [&'static str; 3], v: View) {
    for (name, s) in names.into_iter().zip(v.strides) {
        args.push((name, Value::I64(s)));
    }
}

fn rows(doc: Row, valid: Row) -> [(u64, i64); 2] {
    [doc.unwrap_or((0, 0)), valid.unwrap_or((0, 0))]
}

/// Pointer arguments, in order.
fn pointers<const N: usize>(named: [(&'static str, u64); N]) -> Args {
    named.map(|(n, p)| (n, Value::Pointer(p))).to_vec()
}

/// The tensors the forward and the queries' backward read: q, both key segments, their rows.
pub(crate) struct Reads {
    pub q: View,
    pub k1: View,
    pub v1: View,
    pub k2: View,
    pub v2: View,
    pub doc: Row,
    pub valid: Row,
}

impl Reads {
    /// The pointer arguments: q and the key segments', then `between`, then the tables'.
    fn pointers<const N: usize>(&self, between: [(&'static str, u64); N]) -> Args {
        let [doc, valid] = rows(self.doc, self.valid);
        let mut a = pointers([
            ("Q", self.q.ptr),
            ("K1", self.k1.ptr),
            ("V1", self.v1.ptr),
            ("K2", self.k2.ptr),
            ("V2", self.v2.ptr),
        ]);
        a.extend(pointers(between));
        a.extend(pointers([("DOC", doc.0), ("VALID", valid.0)]));
        a
    }

    /// The key segments' strides.
    fn segments(&self, a: &mut Args) {
        view(a, ["stride_k1b", "stride_k1h", "stride_k1n"], self.k1);
        view(a, ["stride_v1b", "stride_v1h", "stride_v1n"], self.v1);
        view(a, ["stride_k2b", "stride_k2h", "stride_k2n"], self.k2);
        view(a, ["stride_v2b", "stride_v2h", "stride_v2n"], self.v2);
    }

    /// After the tensors' strides: the tables' row strides, the counts, the mask and the scale.
    fn rest(&self, a: &mut Args, c: &Chunk) {
        let [doc, valid] = rows(self.doc, self.valid);
        a.extend([
            ("stride_docb", Value::I64(doc.1)),
            ("stride_validb", Value::I64(valid.1)),
            ("heads", i32_of(c.heads)),
            ("group", i32_of(c.group)),
            ("c", i32_of(c.rows)),
            ("n1", i32_of(c.earlier)),
            ("n2", i32_of(c.own)),
            ("q_start", i32_of(c.q_start)),
            ("k_start", i32_of(c.k_start)),
            ("window", i32_of(c.window)),
            ("has_docs", Value::I32(self.doc.is_some() as i32)),
            ("has_valid", Value::I32(self.valid.is_some() as i32)),
            ("scale", Value::F32(c.scale)),
        ]);
    }
}

/// `attention_forward`'s arguments: the output `o` and the log-sum-exp `lse` (`[b, heads, rows]` f32).
pub(crate) fn forward_args(r: &Reads, o: View, lse: u64, c: &Chunk) -> Args {
    let mut a = r.pointers([("O", o.ptr), ("LSE", lse)]);
    view(&mut a, ["stride_qb", "stride_qh", "stride_qm"], r.q);
    r.segments(&mut a);
    view(&mut a, ["stride_ob", "stride_oh", "stride_om"], o);
    r.rest(&mut a, c);
    a
}

/// `attention_backward_delta`'s arguments: `delta` (`[b, heads, rows]` f32) = rowsum(dO ⊙ O).
pub(crate) fn delta_args(o: View, d_o: View, delta: u64, c: &Chunk) -> Args {
    let mut a = pointers([("O", o.ptr), ("DO", d_o.ptr), ("DELTA", delta)]);
    view(&mut a, ["stride_ob", "stride_oh", "stride_om"], o);
    view(&mut a, ["stride_dob", "stride_doh", "stride_dom"], d_o);
    a.extend([("heads", i32_of(c.heads)), ("c", i32_of(c.rows))]);
    a
}

/// The forward's statistics the backward reads: dO, and the log-sum-exp and delta's addresses.
pub(crate) struct Grads {
    pub d_o: View,
    pub lse: u64,
    pub delta: u64,
}

/// `attention_backward_queries`'s arguments: q's gradient into `dq`.
pub(crate) fn queries_args(r: &Reads, g: &Grads, dq: View, c: &Chunk) -> Args {
    let mut a = r.pointers([
        ("DO", g.d_o.ptr),
        ("LSE", g.lse),
        ("DELTA", g.delta),
        ("DQ", dq.ptr),
    ]);
    view(&mut a, ["stride_qb", "stride_qh", "stride_qm"], r.q);
    r.segments(&mut a);
    view(&mut a, ["stride_dob", "stride_doh", "stride_dom"], g.d_o);
    view(&mut a, ["stride_dqb", "stride_dqh", "stride_dqm"], dq);
    r.rest(&mut a, c);
    a
}

/// One key segment's backward: its keys and values, where their gradients go, and whether they add
/// into what is there.
pub(crate) struct KeySegment {
    pub k: View,
    pub v: View,
    pub dk: View,
    pub dv: View,
    pub keys: usize,
    /// Absolute index of the segment's first key.
    pub first: usize,
    pub accumulate: bool,
}

/// `attention_backward_keys`'s arguments for one segment.
pub(crate) fn keys_args(
    q: View,
    s: &KeySegment,
    g: &Grads,
    doc: Row,
    valid: Row,
    c: &Chunk,
) -> Args {
    let [doc_row, valid_row] = rows(doc, valid);
    let mut a = pointers([
        ("Q", q.ptr),
        ("K", s.k.ptr),
        ("V", s.v.ptr),
        ("DO", g.d_o.ptr),
        ("LSE", g.lse),
        ("DELTA", g.delta),
        ("DK", s.dk.ptr),
        ("DV", s.dv.ptr),
        ("DOC", doc_row.0),
        ("VALID", valid_row.0),
    ]);
    view(&mut a, ["stride_qb", "stride_qh", "stride_qm"], q);
    view(&mut a, ["stride_kb", "stride_kh", "stride_kn"], s.k);
    view(&mut a, ["stride_vb", "stride_vh", "stride_vn"], s.v);
    view(&mut a, ["stride_dob", "stride_doh", "stride_dom"], g.d_o);
    view(&mut a, ["stride_dkb", "stride_dkh", "stride_dkn"], s.dk);
    view(&mut a, ["stride_dvb", "stride_dvh", "stride_dvn"], s.dv);
    a.extend([
        ("stride_docb", Value::I64(doc_row.1)),
        ("stride_validb", Value::I64(valid_row.1)),
    ]);
    a.extend([
        ("heads", i32_of(c.heads)),
        ("group", i32_of(c.group)),
        ("c", i32_of(c.rows)),
        ("n_keys", i32_of(s.keys)),
    ]);
    // The segment's first key is its own, named k_first.
    a.extend([
        ("q_start", i32_of(c.q_start)),
        ("k_first", i32_of(s.first)),
        ("window", i32_of(c.window)),
        ("has_docs", Value::I32(doc.is_some() as i32)),
        ("has_valid", Value::I32(valid.is_some() as i32)),
        ("accumulate", Value::I32(s.accumulate as i32)),
        ("scale", Value::F32(c.scale)),
    ]);
    a
}

/// Why an argument list does not fit a compiled kernel.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Mismatch {
    #[error("{kernel}: {given} arguments given, {declared} declared")]
    Count {
        kernel: &'static str,
        given: usize,
        declared: usize,
    },
    #[error("{kernel}: argument {index} is {given:?}, the kernel's is {declared:?}")]
    Argument {
        kernel: &'static str,
        index: usize,
        given: String,
        declared: Arg,
    },
    #[error(
        "{kernel}: {name} = {value} is not a multiple of 16, which the kernel was compiled for"
    )]
    Unaligned {
        kernel: &'static str,
        name: &'static str,
        value: i128,
    },
    #[error("{kernel}: {name} = {value} is negative or does not fit the kernel's 32-bit argument")]
    OutOfRange {
        kernel: &'static str,
        name: &'static str,
        value: i128,
    },
}

/// Whether the compiler assumed `name` divisible by 16: pointers (16-byte aligned) and the strides
/// other than the per-token tables' rows (as `scripts/compile_triton.py`'s `signature` says).
fn assumed_divisible(arg: Arg) -> bool {
    match arg {
        Arg::Pointer(_) => true,
        Arg::I64(name) => name != "stride_docb" && name != "stride_validb",
        Arg::I32(_) | Arg::F32(_) => false,
    }
}

/// `args` checked against what `kernel` was compiled with: the same names and types in order, and
/// every value the compiler assumed divisible by 16 so (a pointer of an absent table is 0).
pub(crate) fn check(kernel: &Compiled, args: &Args) -> Result<(), Mismatch> {
    if args.len() != kernel.args.len() {
        return Err(Mismatch::Count {
            kernel: kernel.kernel,
            given: args.len(),
            declared: kernel.args.len(),
        });
    }
    for (index, (&(name, value), &declared)) in args.iter().zip(kernel.args).enumerate() {
        let same_type = matches!(
            (value, declared),
            (Value::Pointer(_), Arg::Pointer(_))
                | (Value::I32(_), Arg::I32(_))
                | (Value::I64(_), Arg::I64(_))
                | (Value::F32(_), Arg::F32(_))
        );
        if !same_type || name != declared.name() {
            return Err(Mismatch::Argument {
                kernel: kernel.kernel,
                index,
                given: format!("{name}: {value:?}"),
                declared,
            });
        }
        let number = match value {
            Value::Pointer(p) => p as i128,
            Value::I32(x) => x as i128,
            Value::I64(x) => x as i128,
            Value::F32(_) => 0,
        };
        if assumed_divisible(declared) && number % 16 != 0 {
            return Err(Mismatch::Unaligned {
                kernel: kernel.kernel,
                name,
                value: number,
            });
        }
        if let Value::I32(x) = value {
            if x < 0 {
                return Err(Mismatch::OutOfRange {
                    kernel: kernel.kernel,
                    name,
                    value: x as i128,
                });
            }
        }
    }
    Ok(())
}

/// The compiled kernel `kernel` for `arch`, `dtype` ("bf16", "fp32") and `head_dim`, if there is one.
pub(crate) fn find(
    kernel: &str,
    arch: u32,
    dtype: &str,
    head_dim: usize,
) -> Option<&'static Compiled> {
    super::compiled::KERNELS.iter().find(|k| {
        k.kernel == kernel && k.arch == arch && k.dtype == dtype && k.head_dim == head_dim
    })
}

/// The compiled architecture a card of compute capability `major.minor` runs: sm_90's cubins
/// (`sm_90a`) on 9.0 only; sm_80's on every 8.x; none elsewhere.
pub(crate) fn arch_for(major: u32, minor: u32) -> Option<u32> {
    match (major, minor) {
        (9, 0) => Some(90),
        (8, _) => Some(80),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::attention::compiled::KERNELS;

    const KERNEL_NAMES: [&str; 4] = [
        "attention_forward",
        "attention_backward_delta",
        "attention_backward_queries",
        "attention_backward_keys",
    ];

    fn v(base: u64) -> View {
        View {
            ptr: base,
            strides: [4096 * 128, 128, 4096],
        }
    }

    fn chunk() -> Chunk {
        Chunk {
            heads: 32,
            group: 4,
            rows: 1000,
            earlier: 3000,
            own: 1000,
            q_start: 3000,
            k_start: 0,
            window: 0,
            scale: 0.088,
        }
    }

    /// The launcher's list for `kernel`, with aligned addresses and strides, a packed and padded batch.
    fn args_for(kernel: &str) -> Args {
        let c = chunk();
        let reads = Reads {
            q: v(0x1000),
            k1: v(0x2000),
            v1: v(0x3000),
            k2: v(0x4000),
            v2: v(0x5000),
            doc: Some((0x6000, 4001)),
            valid: Some((0x7000, 4001)),
        };
        let grads = Grads {
            d_o: v(0x8000),
            lse: 0x9000,
            delta: 0xa000,
        };
        match kernel {
            "attention_forward" => forward_args(&reads, v(0xb000), 0x9000, &c),
            "attention_backward_delta" => delta_args(v(0xb000), v(0x8000), 0xa000, &c),
            "attention_backward_queries" => queries_args(&reads, &grads, v(0xc000), &c),
            _ => {
                let segment = KeySegment {
                    k: v(0x2000),
                    v: v(0x3000),
                    dk: v(0xd000),
                    dv: v(0xe000),
                    keys: 3000,
                    first: 0,
                    accumulate: true,
                };
                keys_args(v(0x1000), &segment, &grads, reads.doc, reads.valid, &c)
            }
        }
    }

    #[test]
    fn every_architecture_dtype_and_head_dim_has_its_four_kernels() {
        for arch in [80, 90] {
            for dtype in ["bf16", "fp32"] {
                for hd in [64, 128, 256] {
                    for kernel in KERNEL_NAMES {
                        let k = find(kernel, arch, dtype, hd);
                        assert!(k.is_some(), "{kernel} sm_{arch} {dtype} hd {hd} missing");
                    }
                }
            }
        }
        assert_eq!(KERNELS.len(), 2 * 2 * 3 * 4);
    }

    #[test]
    fn the_launchers_argument_lists_match_the_compiled_kernels() {
        for k in KERNELS {
            let args = args_for(k.kernel);
            assert_eq!(
                check(k, &args),
                Ok(()),
                "{} sm_{} {}",
                k.kernel,
                k.arch,
                k.dtype
            );
        }
    }

    #[test]
    fn a_wrong_list_is_refused() {
        let k = find("attention_forward", 90, "bf16", 128).expect("compiled");
        let mut args = args_for(k.kernel);
        args.swap(9, 10);
        assert!(matches!(check(k, &args), Err(Mismatch::Argument { .. })));
        let mut args = args_for(k.kernel);
        args.pop();
        assert!(matches!(check(k, &args), Err(Mismatch::Count { .. })));
        let mut args = args_for(k.kernel);
        args[0].1 = Value::Pointer(0x1008);
        assert!(matches!(check(k, &args), Err(Mismatch::Unaligned { .. })));
        let mut args = args_for(k.kernel);
        args[9].1 = Value::I64(4100);
        assert!(matches!(check(k, &args), Err(Mismatch::Unaligned { .. })));
        let mut args = args_for(k.kernel);
        let last_i32 = args.len() - 2;
        args[last_i32].1 = Value::I32(-1);
        assert!(matches!(check(k, &args), Err(Mismatch::OutOfRange { .. })));
    }

    #[test]
    fn the_architectures() {
        assert_eq!(arch_for(9, 0), Some(90));
        assert_eq!(arch_for(8, 0), Some(80));
        assert_eq!(arch_for(8, 9), Some(80));
        assert_eq!(arch_for(7, 5), None);
        assert_eq!(arch_for(10, 0), None);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn the_cubins_are_the_scripts() {
        for k in KERNELS {
            assert!(!k.cubin.is_empty(), "{}", k.symbol);
            assert!(
                k.cubin.starts_with(b"\x7fELF"),
                "{} is not an ELF cubin",
                k.symbol
            );
        }
    }
}
