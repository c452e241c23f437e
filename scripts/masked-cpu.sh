#!/usr/bin/env bash
# Runs a program natively with CPUID answering as a CPU of fewer instruction sets would
# (scripts/masked-cpu.c, loaded with LD_PRELOAD; its children inherit it), so that every runtime
# dispatch (our SIMD layer, gemm's kernels, the bf16 kernel's choice, the planner's model of gemm's
# workspace) takes that CPU's path at this CPU's speed. It does not stop an instruction the masked CPU
# lacks from running: `scripts/emulated-cpu.sh` (QEMU) checks that, about a hundred times slower.
#
#   scripts/masked-cpu.sh avx2 PROGRAM [ARGS...]      AVX2 + FMA, no AVX-512 or AMX (an AMD Zen 3)
#   scripts/masked-cpu.sh baseline PROGRAM [ARGS...]  SSE2 only, no AVX
#   scripts/masked-cpu.sh --check avx2|baseline       exit 0 where this machine can mask CPUID
#
# As cargo's runner:
#   CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$PWD/scripts/masked-cpu.sh avx2" cargo test ...
# Masking needs CPUID faulting (Linux's arch_prctl ARCH_SET_CPUID: Intel CPUs since Ivy Bridge, and
# hypervisors that offer it); where there is none, --check fails and a run stops with exit 2.
set -euo pipefail
check=false
if [ "${1:-}" = --check ]; then check=true; shift; fi
kind=${1:?"usage: $0 [--check] avx2|baseline [PROGRAM [ARGS...]]"}
shift
case "$kind" in
    avx2|baseline) ;;
    *) echo "$0: unknown CPU kind '$kind' (avx2 or baseline)" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
lib="${CARGO_TARGET_DIR:-$here/../target}/masked-cpu/libmasked_cpu.so"
if [ ! -e "$lib" ] || [ "$here/masked-cpu.c" -nt "$lib" ]; then
    mkdir -p "$(dirname "$lib")"
    gcc -O2 -Wall -Wextra -Werror -shared -fPIC -o "$lib.$$" "$here/masked-cpu.c"
    mv "$lib.$$" "$lib"
fi
if $check; then
    exec env STREAMBP_MASKED_CPU="$kind" LD_PRELOAD="$lib" true 2>/dev/null
fi
[ $# -gt 0 ] || { echo "$0: no program to run" >&2; exit 2; }
STREAMBP_MASKED_CPU=$kind LD_PRELOAD=$lib exec "$@"
