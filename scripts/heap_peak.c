/* The PyTorch peer's heap, counted as streambp's counting allocator counts ours: preloaded into the
 * peer (LD_PRELOAD), it wraps glibc's allocation functions and keeps the bytes live and their peak
 * since the last reset. Every allocation of the process counts (tensors, oneDNN's scratch, Python's
 * objects), each by malloc_usable_size, so a free subtracts what its allocation added.
 *
 *   cc -shared -fPIC -O2 -o heap_peak.so scripts/heap_peak.c
 *   LD_PRELOAD=./heap_peak.so python scripts/peer_bench.py ...   (peer_bench.py --memory does this)
 *
 * Read from the process through ctypes: heap_live_bytes(), heap_peak_bytes(), heap_peak_reset().
 */
#include <errno.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void *__libc_valloc(size_t);
extern void *__libc_pvalloc(size_t);
extern void __libc_free(void *);

static _Atomic long long live;
static _Atomic long long peak;

static void *counted(void *p) {
    if (p) {
        long long size = (long long)malloc_usable_size(p);
        long long now = atomic_fetch_add(&live, size) + size;
        long long seen = atomic_load(&peak);
        while (now > seen && !atomic_compare_exchange_weak(&peak, &seen, now)) {
        }
    }
    return p;
}

static void uncount(void *p) {
    if (p) atomic_fetch_sub(&live, (long long)malloc_usable_size(p));
}

void *malloc(size_t n) { return counted(__libc_malloc(n)); }
void *calloc(size_t k, size_t n) { return counted(__libc_calloc(k, n)); }
void *memalign(size_t a, size_t n) { return counted(__libc_memalign(a, n)); }
void *aligned_alloc(size_t a, size_t n) { return counted(__libc_memalign(a, n)); }
void *valloc(size_t n) { return counted(__libc_valloc(n)); }
void *pvalloc(size_t n) { return counted(__libc_pvalloc(n)); }

int posix_memalign(void **out, size_t a, size_t n) {
    void *p = counted(__libc_memalign(a, n));
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}

void *realloc(void *p, size_t n) {
    uncount(p);
    void *q = __libc_realloc(p, n);
    if (!q && n) {
        counted(p); /* the old block stays */
        return NULL;
    }
    return counted(q);
}

void free(void *p) {
    uncount(p);
    __libc_free(p);
}

long long heap_live_bytes(void) { return atomic_load(&live); }
long long heap_peak_bytes(void) { return atomic_load(&peak); }
void heap_peak_reset(void) { atomic_store(&peak, atomic_load(&live)); }
