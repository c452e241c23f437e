#!/usr/bin/env python3
"""Compiles the card's Triton kernels ahead of time into cubins, with no GPU: writes
`crates/streambp-kernels/cubins/sm_<arch>/<kernel>_<dtype>_hd<head dim>.cubin` for sm_80 (A100/A800)
and sm_90 (H100/H200), and `crates/streambp-kernels/src/ops/attention/compiled.rs`, the table the
Rust launcher reads (each kernel's blocks, warps, shared memory and argument list, from the compiler's
metadata). Building the project then needs no Python; CI runs this again and fails if anything differs
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
TABLE = CRATE / "src" / "ops" / "attention" / "compiled.rs"
TRITON_VERSION = "3.9.0"
ARCHS = (80, 90)
# The most dynamic shared memory a block may have (bytes): sm_80 163 KiB, sm_90 227 KiB.
SHARED_LIMIT = {80: 166912, 90: 232448}
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bf16", "fp32")


def ptxas():
    root = os.environ.get("CUDA_ROOT")
    path = Path(root) / "bin" / "ptxas" if root else None
    if path is None or not path.exists():
        sys.exit("compile_triton: CUDA 13.0's ptxas not found; source scripts/cuda-env.sh first")
    return str(path)


def blocks(kernel, dtype, hd):
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


def signature(fn, dtype):
    """Every argument's Triton type, and which the compiler may assume divisible by 16: the tensor
    pointers (16-byte aligned) and the strides of dimensions above the head's (multiples of a head
    dim of 64 or more), which the launcher checks before each launch."""
    sig, hints = {}, {}
    constexprs = {p.name for p in fn.params if p.is_constexpr}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("DOC",):
            sig[name] = "*i64"
        elif name in ("VALID",):
            sig[name] = "*u8"
        elif name in ("LSE", "DELTA"):
            sig[name] = "*fp32"
        elif name.isupper() and name[0] in "QKVOD":
            sig[name] = "*" + dtype
        elif name.startswith("stride_"):
            sig[name] = "i64"
        elif name == "scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        aligned = sig[name].startswith("*") or (
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


def compile_one(triton, kernels, kernel, arch, dtype, hd):
    fn = getattr(kernels, kernel)
    sig, hints = signature(fn, dtype)
    bm, bn, warps, stages = blocks(kernel, dtype, hd)
    constants = {"HEAD_DIM": hd, "BLOCK_M": bm}
    if "BLOCK_N" in sig:
        constants["BLOCK_N"] = bn
    if "DOT" in sig:
        constants["DOT"] = "ieee" if dtype == "fp32" else "tf32"
        constants["WIDEN"] = False
    for name in list(sig):
        if sig[name] == "constexpr" and name not in constants:
            sys.exit(f"compile_triton: {kernel}'s constexpr {name} has no value")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": warps, "num_stages": stages})
    src = ASTSource(fn=fn, signature=sig, constexprs=constants, attrs=hints)
    compiled = triton.compile(src, target=target, options=options.__dict__)
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        sys.exit(f"compile_triton: {kernel} needs scratch memory, which the launcher does not give")
    if meta.num_ctas != 1:
        sys.exit(f"compile_triton: {kernel} wants {meta.num_ctas} CTAs per cluster")
    if meta.shared > SHARED_LIMIT[arch]:
        sys.exit(f"compile_triton: {kernel} {dtype} hd {hd} needs {meta.shared} B of shared memory "
                 f"on sm_{arch} (at most {SHARED_LIMIT[arch]})")
    args = [(name, sig[name]) for name in fn.arg_names if sig[name] != "constexpr"]
    # The launcher passes these arguments, then Triton's two scratch pointers: the cubin must take
    # exactly that.
    size = {"i32": 4, "fp32": 4, "i64": 8}
    wanted = [size.get(ty, 8) for _, ty in args] + [8, 8]
    declared = param_sizes(compiled.asm["cubin"], meta.name)
    if declared != wanted:
        sys.exit(f"compile_triton: {kernel}'s cubin takes parameters of {declared} bytes, the launcher "
                 f"would pass {wanted}")
    return dict(kernel=kernel, arch=arch, dtype=dtype, hd=hd, block_m=bm, block_n=bn, warps=warps,
                stages=stages, shared=meta.shared, name=meta.name, args=args,
                cubin=compiled.asm["cubin"])


RUST_HEADER = """\
//! The attention kernels compiled for the card (generated by `scripts/compile_triton.py` from
//! `triton/attention.py`; do not edit): each kernel's blocks, launch shape and argument list from
//! Triton's metadata, and its cubin under the `cuda` feature.

use super::cuda_table::{cubin, Arg, Compiled};
"""


def rust_arg(name, ty):
    kind = {"i32": "I32", "i64": "I64", "fp32": "F32"}.get(ty, "Pointer")
    return f'Arg::{kind}("{name}")'


def table(entries):
    """The Rust table: each kernel's argument list once (the same for every architecture, dtype and
    head dim), then one line per compiled kernel."""
    lines = [RUST_HEADER]
    lists = {}
    for e in entries:
        const = e["kernel"].upper()
        args = ", ".join(rust_arg(n, t) for n, t in e["args"])
        if lists.setdefault(const, args) != args:
            sys.exit(f"compile_triton: {e['kernel']}'s arguments differ between its variants")
    for const, args in lists.items():
        lines.append(f"\n/// The arguments of `{const.lower()}`.\n#[rustfmt::skip]\n"
                     f"const {const}: &[Arg] = &[{args}];\n")
    lines.append("\n/// Every compiled kernel: per architecture, dtype and head dim.\n#[rustfmt::skip]\n"
                 "pub(super) const KERNELS: &[Compiled] = &[\n")
    for e in entries:
        path = f"sm_{e['arch']}/{e['kernel']}_{e['dtype']}_hd{e['hd']}.cubin"
        lines.append(
            f"    Compiled {{ kernel: \"{e['kernel']}\", arch: {e['arch']}, dtype: \"{e['dtype']}\", "
            f"head_dim: {e['hd']}, block_m: {e['block_m']}, block_n: {e['block_n']}, "
            f"warps: {e['warps']}, shared: {e['shared']}, symbol: \"{e['name']}\", "
            f"args: {e['kernel'].upper()}, cubin: cubin!(\"{path}\"), "
            f"sha256: \"{hashlib.sha256(e['cubin']).hexdigest()}\" }},\n")
    lines.append("];\n")
    return "".join(lines)


def build(out_dir, table_path):
    # A fresh cache: what is written is what the compiler makes now, not an earlier run's.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")
    os.environ["TRITON_PTXAS_PATH"] = ptxas()
    os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = ptxas()
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"  # fused multiply-adds, Triton 3.9's default
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # no source lines in the cubins (their size: docs/cuda.md)
    import triton

    if triton.__version__ != TRITON_VERSION:
        sys.exit(f"compile_triton: triton {TRITON_VERSION} is pinned, found {triton.__version__}")
    sys.path.insert(0, str(CRATE / "triton"))
    import attention as kernels

    entries = []
    for arch in ARCHS:
        (out_dir / f"sm_{arch}").mkdir(parents=True, exist_ok=True)
        for dtype in DTYPES:
            for hd in HEAD_DIMS:
                for kernel in ("attention_forward", "attention_backward_delta",
                               "attention_backward_queries", "attention_backward_keys"):
                    e = compile_one(triton, kernels, kernel, arch, dtype, hd)
                    path = out_dir / f"sm_{arch}" / f"{kernel}_{dtype}_hd{hd}.cubin"
                    path.write_bytes(e["cubin"])
                    entries.append(e)
                    print(f"sm_{arch} {dtype} hd {hd:3} {kernel}: {e['block_m']}x{e['block_n']}, "
                          f"{e['warps']} warps, {e['shared']} B shared, {len(e['cubin'])} B")
    table_path.write_text(table(entries))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compile into a temporary folder and fail if it differs from the committed")
    args = parser.parse_args()
    if not args.check:
        shutil.rmtree(CRATE / "cubins", ignore_errors=True)
        build(CRATE / "cubins", TABLE)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build(tmp / "cubins", tmp / "compiled.rs")
        diff = filecmp.dircmp(tmp / "cubins", CRATE / "cubins")
        problems = []

        def walk(d, prefix=""):
            problems.extend(prefix + f for f in d.left_only + d.right_only + d.diff_files)
            for name, sub in d.subdirs.items():
                walk(sub, prefix + name + "/")

        walk(diff)
        if (tmp / "compiled.rs").read_text() != TABLE.read_text():
            problems.append(str(TABLE.relative_to(ROOT)))
        if problems:
            sys.exit("compile_triton --check: differs from what is committed: " + ", ".join(problems))
        print("compile_triton --check: the committed cubins and table are what the kernels compile to")


if __name__ == "__main__":
    main()
