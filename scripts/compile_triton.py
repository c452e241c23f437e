#!/usr/bin/env python3
"""Compiles the card's Triton kernels ahead of time into cubins, with no GPU: for each kernel file of
`crates/streambp-kernels/triton/` (MODULES below), writes `crates/streambp-kernels/cubins/sm_<arch>/
<kernel>_<dtype>[_<variant>].cubin` for sm_80 (A100/A800) and sm_90 (H100/H200), and the op's
`src/ops/<op>/compiled.rs`, the table its Rust launcher reads (each kernel's blocks, warps, shared
memory and argument list, from the compiler's metadata). Building the project then needs no Python; CI runs this again and fails if anything differs
from what is committed.

Pinned: triton 3.9.0, and CUDA 13.0's ptxas (the lent GPUs' driver, 580, cannot load what a newer
ptxas emits): `$CUDA_ROOT/bin/ptxas`, as `scripts/cuda-env.sh` installs it. `--check` compiles into a
temporary folder and compares instead of writing.

Usage: . scripts/cuda-env.sh && python scripts/compile_triton.py [--check]
"""

import argparse
import filecmp
import hashlib
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRATE = ROOT / "crates" / "streambp-kernels"
TRITON_VERSION = "3.9.0"
ARCHS = (80, 90)
# The most dynamic shared memory a block may have (bytes): sm_80 163 KiB, sm_90 227 KiB.
SHARED_LIMIT = {80: 166912, 90: 232448}
DTYPES = ("bf16", "fp32")


def ptxas():
    root = os.environ.get("CUDA_ROOT")
    path = Path(root) / "bin" / "ptxas" if root else None
    if path is None or not path.exists():
        sys.exit("compile_triton: CUDA 13.0's ptxas not found; source scripts/cuda-env.sh first")
    return str(path)


def attention_blocks(kernel, dtype, hd):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, dtype and head dim: FlashAttention-2's
    shapes (Triton's fused-attention tutorial) for bf16, halved for f32 (which the parity tests run)."""
    if kernel == "attention_backward_delta":
        return 64, 0, 4, 1
    if dtype == "fp32":
        m = 32 if hd == 256 else 64
        return (m, 32, 4, 2) if kernel != "attention_backward_keys" else (32, m, 4, 2)
    if kernel == "attention_forward":
        return {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 8, 2)}[hd]
    if kernel == "attention_backward_queries":
        return {64: (128, 32, 8, 2), 128: (128, 32, 8, 2), 256: (64, 32, 8, 2)}[hd]
    return {64: (32, 128, 8, 2), 128: (32, 128, 8, 2), 256: (32, 64, 8, 2)}[hd]


def attention_variants(dtype):
    """Per head dim (the variant), the four kernels' constants and launch shapes."""
    for hd in (64, 128, 256):
        for kernel in ("attention_forward", "attention_backward_delta",
                       "attention_backward_queries", "attention_backward_keys"):
            bm, bn, warps, stages = attention_blocks(kernel, dtype, hd)
            constants = {"HEAD_DIM": hd, "BLOCK_M": bm}
            if kernel != "attention_backward_delta":
                constants.update(BLOCK_N=bn, DOT="ieee" if dtype == "fp32" else "tf32", WIDEN=False)
            yield dict(kernel=kernel, variant=hd, file=f"{kernel}_{dtype}_hd{hd}", constants=constants,
                       block_m=bm, block_n=bn, warps=warps, stages=stages)


def rms_norm_variants(dtype):
    """Per block of columns (the variant: the launcher takes the smallest that holds a row, so the
    q/k norms' rows of 128 or 256 do not leave most lanes idle), the four kernels."""
    for block, warps in ((128, 1), (256, 2), (1024, 4)):
        for kernel in ("rms_norm_forward", "rms_norm_backward", "rms_norm_backward_weight",
                       "rms_norm_weight_sum"):
            yield dict(kernel=kernel, variant=block, file=f"{kernel}_{dtype}_b{block}",
                       constants={"BLOCK": block}, block_m=block, block_n=0, warps=warps, stages=1)


def gated_variants(dtype):
    """Per activation (the variant: gated.py's `ACT`, 0 SiLU, 1 tanh GELU, 2 erf GELU), the forward
    and the backward, 1024 elements per program (16 bytes per thread)."""
    for act, name in enumerate(("silu", "gelu_tanh", "gelu_erf")):
        for kernel in ("gated_forward", "gated_backward"):
            yield dict(kernel=kernel, variant=act, file=f"{kernel}_{dtype}_{name}",
                       constants={"ACT": act, "BLOCK": 1024}, block_m=1024, block_n=0, warps=4, stages=1)


def rope_variants(dtype):
    """Per head dim (the variant), the rotation: 4096 elements of a program's rows."""
    for hd in (64, 128, 256):
        yield dict(kernel="rope", variant=hd, file=f"rope_{dtype}_hd{hd}",
                   constants={"HEAD_DIM": hd, "BLOCK_ROWS": 4096 // hd}, block_m=4096 // hd, block_n=0,
                   warps=4, stages=1)


def adamw_variants(dtype):
    """The update, 1024 elements per program: the gradient in the parameter's dtype (variant 0) or
    in f32 (variant 1, gradients accumulated in f32)."""
    for grad_f32 in (0, 1):
        yield dict(kernel="adamw", variant=grad_f32, file=f"adamw_{dtype}{'_grad_fp32' if grad_f32 else ''}",
                   constants={"BLOCK": 1024},
                   types=dict(M="*fp32", V="*fp32", **({"G": "*fp32"} if grad_f32 else {})), block_m=1024,
                   block_n=0, warps=4, stages=1)


def head_softmax_variants(dtype):
    """The head's two passes, without and with the entropies, 4096 columns of a row per step."""
    for kernel in ("head_log_softmax", "head_logit_grad", "head_log_softmax_entropy",
                   "head_logit_grad_entropy"):
        yield dict(kernel=kernel, variant=4096, file=f"{kernel}_{dtype}", constants={"BLOCK": 4096},
                   types=dict(TARGETS="*i64", LOGP="*fp32", G="*fp32", ENTROPY="*fp32",
                              G_ENTROPY="*fp32"),
                   block_m=4096, block_n=0, warps=8, stages=1)


def accumulate_variants(dtype):
    """The gradient (`X`, `ROWS`) in the dtype, the accumulator f32: the sum 1024 elements per
    program, the rows' sum 256 columns per program."""
    yield dict(kernel="accumulate_add", variant=1024, file=f"accumulate_add_{dtype}",
               constants={"BLOCK": 1024}, types=dict(ACC="*fp32"), block_m=1024, block_n=0, warps=4,
               stages=1)
    yield dict(kernel="accumulate_add_rows", variant=256, file=f"accumulate_add_rows_{dtype}",
               constants={"BLOCK": 256}, types=dict(ACC="*fp32", IDS="*i64", n_rows="i64"),
               block_m=256, block_n=0, warps=2, stages=1)


# Each kernel file (`triton/<source>.py`), its variants, and the Rust table it is launched from.
MODULES = (
    dict(source="attention", variants=attention_variants, table="ops/attention/compiled.rs",
         what="attention kernels"),
    dict(source="rms_norm", variants=rms_norm_variants, table="ops/rms_norm/compiled.rs",
         what="RMSNorm kernels"),
    dict(source="gated", variants=gated_variants, table="ops/gated/compiled.rs",
         what="gated activations' kernels"),
    dict(source="rope", variants=rope_variants, table="ops/rope/compiled.rs", what="rope kernels"),
    dict(source="adamw", variants=adamw_variants, table="ops/adamw/compiled.rs",
         what="AdamW update's kernels"),
    dict(source="head_softmax", variants=head_softmax_variants, table="ops/head_softmax/compiled.rs",
         what="LM head softmax's kernels"),
    dict(source="accumulate", variants=accumulate_variants, table="ops/accumulate/compiled.rs",
         what="gradient accumulators' kernels"),
)

# Pointers to f32 whatever the inputs' dtype: statistics and partial sums.
F32_POINTERS = ("LSE", "DELTA", "R", "PARTIAL")


def signature(fn, dtype, types):
    """Every argument's Triton type, and which the compiler may assume divisible by 16: the tensor
    pointers (16-byte aligned), the strides (but the per-token tables' rows) and RMSNorm's `dim`,
    which the launchers check before each launch."""
    sig, hints = {}, {}
    constexprs = {p.name for p in fn.params if p.is_constexpr}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        elif name in ("DOC",):
            sig[name] = "*i64"
        elif name in ("VALID",):
            sig[name] = "*u8"
        elif name in F32_POINTERS:
            sig[name] = "*fp32"
        elif name.isupper():
            sig[name] = "*" + dtype
        elif name.startswith("stride_") or name == "n":
            sig[name] = "i64"
        elif name in ("scale", "eps", "lr", "decay", "beta1", "beta2", "rest1", "rest2", "inv_bc1",
                      "inv_bc2"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        aligned = sig[name].startswith("*") or name == "dim" or (
            name.startswith("stride_") and name not in ("stride_docb", "stride_validb"))
        if aligned:
            hints[(i,)] = [["tt.divisibility", 16]]
    return sig, hints


def param_sizes(cubin, symbol):
    """The byte sizes of a kernel's parameters in order, as the cubin declares them to the driver
    (the `.nv.info.<symbol>` section's EIATTR_KPARAM_INFO records of its ELF)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]

    def name(offset):
        return cubin[names + offset:cubin.index(b"\0", names + offset)].decode()

    params = {}
    for (n, _, _, _, offset, size) in sections:
        if name(n) != f".nv.info.{symbol}":
            continue
        at = offset
        while at < offset + size:
            fmt, attr = cubin[at], cubin[at + 1]
            if fmt != 4:  # values without a body
                at += 4
                continue
            length = struct.unpack_from("<H", cubin, at + 2)[0]
            if attr == 0x17:  # EIATTR_KPARAM_INFO: index, ordinal, offset, flags with the size
                _, ordinal, _, info = struct.unpack_from("<IHHI", cubin, at + 4)
                params[ordinal] = (info >> 18) & 0x3FFF
            at += 4 + length
    return [params[i] for i in sorted(params)]


def compile_one(triton, kernels, v, arch, dtype):
    kernel = v["kernel"]
    fn = getattr(kernels, kernel)
    sig, hints = signature(fn, dtype, v.get("types", {}))
    constants = {k: c for k, c in v["constants"].items() if k in sig}
    for name in list(sig):
        if sig[name] == "constexpr" and name not in constants:
            sys.exit(f"compile_triton: {kernel}'s constexpr {name} has no value")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": v["warps"], "num_stages": v["stages"]})
    src = ASTSource(fn=fn, signature=sig, constexprs=constants, attrs=hints)
    compiled = triton.compile(src, target=target, options=options.__dict__)
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        sys.exit(f"compile_triton: {kernel} needs scratch memory, which the launcher does not give")
    if meta.num_ctas != 1:
        sys.exit(f"compile_triton: {kernel} wants {meta.num_ctas} CTAs per cluster")
    if meta.shared > SHARED_LIMIT[arch]:
        sys.exit(f"compile_triton: {v['file']} needs {meta.shared} B of shared memory "
                 f"on sm_{arch} (at most {SHARED_LIMIT[arch]})")
    aligned = {fn.arg_names[i] for (i,) in hints}
    args = [(name, sig[name], name in aligned) for name in fn.arg_names if sig[name] != "constexpr"]
    # The launcher passes these arguments, then Triton's two scratch pointers: the cubin must take
    # exactly that.
    size = {"i32": 4, "fp32": 4, "i64": 8}
    wanted = [size.get(ty, 8) for _, ty, _ in args] + [8, 8]
    declared = param_sizes(compiled.asm["cubin"], meta.name)
    if declared != wanted:
        sys.exit(f"compile_triton: {kernel}'s cubin takes parameters of {declared} bytes, the launcher "
                 f"would pass {wanted}")
    v = {k: x for k, x in v.items() if k != "types"}
    return dict(v, arch=arch, dtype=dtype, shared=meta.shared, name=meta.name, args=args,
                cubin=compiled.asm["cubin"])


RUST_HEADER = """\
//! The {what} compiled for the card (generated by `scripts/compile_triton.py` from
//! `triton/{source}.py`; do not edit): each kernel's blocks, launch shape and argument list from
//! Triton's metadata, and its cubin under the `cuda` feature.

use crate::triton::{{cubin, Arg, Compiled, Type::*}};
"""


def rust_arg(name, ty, aligned):
    kind = {"i32": "I32", "i64": "I64", "fp32": "F32"}.get(ty, "Pointer")
    return f'Arg::new({kind}, "{name}", {"true" if aligned else "false"})'


def table(module, entries):
    """The Rust table: each kernel's argument list once (the same for every architecture, dtype and
    variant), then one line per compiled kernel."""
    lines = [RUST_HEADER.format(**module)]
    lists = {}
    for e in entries:
        const = e["kernel"].upper()
        args = ", ".join(rust_arg(*a) for a in e["args"])
        if lists.setdefault(const, args) != args:
            sys.exit(f"compile_triton: {e['kernel']}'s arguments differ between its variants")
    for const, args in lists.items():
        lines.append(f"\n/// The arguments of `{const.lower()}`.\n#[rustfmt::skip]\n"
                     f"const {const}: &[Arg] = &[{args}];\n")
    lines.append("\n/// Every compiled kernel: per architecture, dtype and variant.\n#[rustfmt::skip]\n"
                 "pub(crate) const KERNELS: &[Compiled] = &[\n")
    for e in entries:
        path = f"sm_{e['arch']}/{e['file']}.cubin"
        lines.append(
            f"    Compiled {{ kernel: \"{e['kernel']}\", arch: {e['arch']}, dtype: \"{e['dtype']}\", "
            f"variant: {e['variant']}, block_m: {e['block_m']}, block_n: {e['block_n']}, "
            f"warps: {e['warps']}, shared: {e['shared']}, symbol: \"{e['name']}\", "
            f"args: {e['kernel'].upper()}, cubin: cubin!(\"{path}\"), "
            f"sha256: \"{hashlib.sha256(e['cubin']).hexdigest()}\" }},\n")
    lines.append("];\n")
    return "".join(lines)


def build(out_dir, table_dir):
    """Compiles every module's variants into `out_dir/sm_<arch>/` and writes each module's table
    under `table_dir` (at the path relative to `src/`)."""
    # A fresh cache: what is written is what the compiler makes now, not an earlier run's.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")
    os.environ["TRITON_PTXAS_PATH"] = ptxas()
    os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = ptxas()
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"  # fused multiply-adds, Triton 3.9's default
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # no source lines in the cubins (their size: docs/cuda.md)
    import importlib

    import triton

    if triton.__version__ != TRITON_VERSION:
        sys.exit(f"compile_triton: triton {TRITON_VERSION} is pinned, found {triton.__version__}")
    sys.path.insert(0, str(CRATE / "triton"))
    for module in MODULES:
        kernels = importlib.import_module(module["source"])
        entries = []
        for arch in ARCHS:
            (out_dir / f"sm_{arch}").mkdir(parents=True, exist_ok=True)
            for dtype in DTYPES:
                for v in module["variants"](dtype):
                    e = compile_one(triton, kernels, v, arch, dtype)
                    (out_dir / f"sm_{arch}" / f"{v['file']}.cubin").write_bytes(e["cubin"])
                    entries.append(e)
                    print(f"sm_{arch} {v['file']}: {e['block_m']}x{e['block_n']}, {e['warps']} warps, "
                          f"{e['shared']} B shared, {len(e['cubin'])} B")
        path = table_dir / module["table"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(table(module, entries))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compile into a temporary folder and fail if it differs from the committed")
    args = parser.parse_args()
    if not args.check:
        shutil.rmtree(CRATE / "cubins", ignore_errors=True)
        build(CRATE / "cubins", CRATE / "src")
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build(tmp / "cubins", tmp / "src")
        diff = filecmp.dircmp(tmp / "cubins", CRATE / "cubins")
        problems = []

        def walk(d, prefix=""):
            problems.extend(prefix + f for f in d.left_only + d.right_only + d.diff_files)
            for name, sub in d.subdirs.items():
                walk(sub, prefix + name + "/")

        walk(diff)
        for module in MODULES:
            committed = CRATE / "src" / module["table"]
            if not committed.exists() or (tmp / "src" / module["table"]).read_text() != committed.read_text():
                problems.append(str(committed.relative_to(ROOT)))
        if problems:
            sys.exit("compile_triton --check: differs from what is committed: " + ", ".join(problems))
        print("compile_triton --check: the committed cubins and table are what the kernels compile to")


if __name__ == "__main__":
    main()
