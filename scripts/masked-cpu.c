/*
 * Makes this x86-64 CPU answer CPUID as a CPU of fewer instruction sets would, for one process and its
 * threads, at native speed: loaded by `scripts/masked-cpu.sh` with LD_PRELOAD, it makes CPUID fault
 * (arch_prctl ARCH_SET_CPUID, which Linux offers where the CPU or hypervisor can fault CPUID), then
 * answers each faulting CPUID from the real one with the extensions the named kind lacks cleared.
 * Every runtime dispatch that reads CPUID (Rust's is_x86_feature_detected!, gemm's and pulp's, the
 * bf16 kernel's choice) then sees that kind. Unlike QEMU, it does not stop an instruction the kind
 * lacks from running: it tests what the dispatch picks, not that the picked code is legal there.
 *
 *   STREAMBP_MASKED_CPU=avx2      AVX2 + FMA, no AVX-512, AVX512-BF16 or AMX (an AMD Zen 3)
 *   STREAMBP_MASKED_CPU=baseline  SSE2 (and SSE3), no SSSE3, SSE4, AVX or later (QEMU's qemu64)
 *
 * Build: gcc -O2 -shared -fPIC -o libmasked_cpu.so masked-cpu.c
 */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

enum kind { AVX2, BASELINE };
static enum kind masked;

#define BIT(n) (1u << (n))

/* Leaf 7 subleaf 0: AVX-512's members and AMX (EBX: F, DQ, IFMA, PF, ER, CD, BW, VL; ECX: VBMI, VBMI2,
 * VNNI, BITALG, VPOPCNTDQ; EDX: 4VNNIW, 4FMAPS, VP2INTERSECT, AMX-BF16, FP16, AMX-TILE, AMX-INT8). */
static const uint32_t AVX512_EBX = BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30)
                                   | BIT(31);
static const uint32_t AVX512_ECX = BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14);
static const uint32_t AVX512_EDX = BIT(2) | BIT(3) | BIT(8) | BIT(22) | BIT(23) | BIT(24) | BIT(25);
/* Leaf 7 subleaf 1 EAX: AVX-VNNI, AVX512-BF16, AMX-FP16; EDX: AVX10. */
static const uint32_t LATER_EAX = BIT(4) | BIT(5) | BIT(21);
static const uint32_t LATER_EDX = BIT(19);
/* Leaf 1 ECX beyond SSE3 and CMPXCHG16B: PCLMULQDQ, SSSE3, FMA, SSE4.1, SSE4.2, MOVBE, POPCNT, AES,
 * XSAVE, OSXSAVE, AVX, F16C, RDRAND. */
static const uint32_t LEAF1_ECX = BIT(1) | BIT(9) | BIT(12) | BIT(19) | BIT(20) | BIT(22) | BIT(23)
                                  | BIT(25) | BIT(26) | BIT(27) | BIT(28) | BIT(29) | BIT(30);
/* Leaf 0x80000001 ECX: LZCNT, SSE4A, XOP, FMA4, TBM. */
static const uint32_t EXT1_ECX = BIT(5) | BIT(6) | BIT(11) | BIT(16) | BIT(21);

/* Clears in CPUID's answer `r` (EAX, EBX, ECX, EDX) for `leaf`/`sub` what the masked kind lacks. */
static void mask(uint32_t leaf, uint32_t sub, uint32_t r[4])
{
    if (leaf == 7 && sub == 0 && masked == AVX2) {
        r[1] &= ~AVX512_EBX;
        r[2] &= ~AVX512_ECX;
        r[3] &= ~AVX512_EDX;
    } else if (leaf == 7 && sub == 0) {
        r[1] = r[2] = r[3] = 0; /* AVX2, BMI, ADX, SHA and all of the above: EAX keeps the subleaf count */
    } else if (leaf == 7 && sub == 1) {
        r[0] &= ~LATER_EAX;
        r[3] &= ~LATER_EDX;
    } else if (leaf == 1 && masked == BASELINE) {
        r[2] &= ~LEAF1_ECX;
    } else if (leaf == 0x80000001 && masked == BASELINE) {
        r[2] &= ~EXT1_ECX;
    }
}

static int set_cpuid_faulting(int on)
{
    return syscall(SYS_arch_prctl, ARCH_SET_CPUID, on ? 0 : 1);
}

/* A faulting CPUID is answered here and skipped; any other SIGSEGV gets the default action when the
 * faulting instruction runs again. */
static void on_segv(int sig, siginfo_t *info, void *context)
{
    (void)sig;
    (void)info;
    ucontext_t *uc = context;
    greg_t *g = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)g[REG_RIP];
    if (ip[0] != 0x0f || ip[1] != 0xa2) {
        signal(SIGSEGV, SIG_DFL);
        return;
    }
    uint32_t leaf = (uint32_t)g[REG_RAX], sub = (uint32_t)g[REG_RCX], r[4];
    set_cpuid_faulting(0);
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
    set_cpuid_faulting(1);
    mask(leaf, sub, r);
    g[REG_RAX] = r[0];
    g[REG_RBX] = r[1];
    g[REG_RCX] = r[2];
    g[REG_RDX] = r[3];
    g[REG_RIP] += 2;
}

__attribute__((constructor)) static void start_masking(void)
{
    const char *kind = getenv("STREAMBP_MASKED_CPU");
    if (kind == NULL || strcmp(kind, "avx2") == 0) {
        masked = AVX2;
    } else if (strcmp(kind, "baseline") == 0) {
        masked = BASELINE;
    } else {
        fprintf(stderr, "masked-cpu: unknown STREAMBP_MASKED_CPU '%s' (avx2 or baseline)\n", kind);
        _exit(2);
    }
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_segv;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGSEGV, &action, NULL) != 0 || set_cpuid_faulting(1) != 0) {
        perror("masked-cpu: CPUID cannot be made to fault here (arch_prctl ARCH_SET_CPUID)");
        _exit(2);
    }
    /* The answers now come from on_segv: AVX-512 Foundation is gone whatever the kind. */
    uint32_t r[4];
    __cpuid_count(7, 0, r[0], r[1], r[2], r[3]);
    if (r[1] & BIT(16)) {
        fprintf(stderr, "masked-cpu: CPUID still reports AVX-512 after masking\n");
        _exit(2);
    }
}
