#!/usr/bin/env bash
# Runs a program on an emulated x86-64 CPU (QEMU's user mode, Debian's qemu-user), so that the test
# suite can run on the kinds of CPU this machine is not: its runtime dispatch (our SIMD layer, gemm's
# kernels, the bf16 kernel's choice) then sees only what the emulated CPU has.
#
#   scripts/emulated-cpu.sh avx2 PROGRAM [ARGS...]      AMD Zen 3 (EPYC-Milan): AVX2, FMA, no AVX-512
#   scripts/emulated-cpu.sh baseline PROGRAM [ARGS...]  qemu64: SSE2 only, no AVX
#
# As cargo's runner (its children start under it too: streambp_testkit::command):
#   CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$PWD/scripts/emulated-cpu.sh avx2" cargo test ...
# Emulation is about ten times slower than the host; memory and cache sizes are the host's.
set -euo pipefail
kind=${1:?"usage: $0 avx2|baseline PROGRAM [ARGS...]"}
shift
case "$kind" in
    # The features QEMU's model of the CPU names but its emulator lacks are turned off by name, which
    # changes nothing but its warnings.
    avx2) cpu="EPYC-Milan$(printf ',-%s' 3dnowprefetch amd-ssbd amd-stibp clzero fsrm fxsr-opt ibpb \
        ibrs invpcid misalignsse nrip-save osvw pcid perfctr-core rdpid rdseed sha-ni topoext \
        wbnoinvd xsavec xsaveerptr xsaves)" ;;
    baseline) cpu=qemu64 ;;
    *) echo "$0: unknown CPU kind '$kind' (avx2 or baseline)" >&2; exit 2 ;;
esac
command -v qemu-x86_64 >/dev/null || { echo "$0: qemu-x86_64 is missing (apt-get install qemu-user)" >&2; exit 2; }
exec qemu-x86_64 -cpu "$cpu" "$@"
