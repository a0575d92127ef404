/*
 * handles.c - the pools of user-visible handles (tensors, modules, optimizers, scalers,
 * datasets, loaders, transforms, metrics logs, data-parallel wrappers): an address handed out
 * once is never handed out again, so a freed handle never names a live object (ampc.h, "Stale
 * handles").
 *
 * A handle is a plain pointer the user holds, so "never names a live object" means "its address
 * is never reused": objects are bump-allocated from slabs (a page or more, one pool's objects
 * each) cut in order from reserved address space (mmap PROT_NONE + MAP_NORESERVE, 1 GiB at a
 * time, made read-write 256 KiB at a time as the bump reaches it, and prefaulted then in one
 * call: every header lands on fresh memory, and a page fault per page of headers had tripled
 * the pool's cost; now ~55 ns per tensor made and freed, against ~25 ns for the old pool that
 * reused headers, and ~180 ns for the whole of ampc_tensor_zeros + free). A freed object keeps
 * its place, generation 0 written by its free. A slab whose objects are all freed (and that its
 * pool has left) is given back with madvise(MADV_DONTNEED): it stays mapped and reads as zeros,
 * generation 0, so a stale handle still reads as stale, and costs no memory. Empty slabs are
 * given back in batches, adjacent ones in one call, so a steady training step makes a few
 * system calls, not one per slab. What is never returned is address space: about 200 bytes per
 * tensor ever made (a 47-bit address space holds some 10^11), plus up to 1/512 of that in the
 * kernel's page tables.
 *
 * Each slab starts with a header (live objects, whether its pool still cuts from it); a slab's
 * size is a power of two, and slabs are aligned to it, so a free finds its slab by masking.
 */
#include "core/core.h"

#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
/* LeakSanitizer scans the readable part of a root region: tensors hold the only pointers to
   their storages, and their headers live here, outside malloc. */
#define LSAN_ROOT(p, n) __lsan_register_root_region((p), (n))
#else
#define LSAN_ROOT(p, n) ((void)(p), (void)(n))
#endif

#define RESERVE ((size_t)1 << 30)        /* address space reserved at a time */
#define RESERVE_MIN ((size_t)1 << 20)    /* halved down to this when mmap refuses (ulimit -v) */
#define COMMIT_STEP ((size_t)256 << 10)  /* made read-write at a time */
#define SLAB_HEAD ((size_t)64)           /* header; objects after it stay 64-byte aligned */
#define MIN_PER_SLAB 8                   /* a slab holds at least this many objects */
#define GIVE_BACK_BATCH 64               /* empty slabs gathered before they are given back */

typedef struct {
    uint32_t live;   /* objects handed out and not yet freed */
    bool open;       /* its pool still cuts objects from it */
} slab_head;

static struct {
    pthread_mutex_t lock;
    unsigned char *next, *committed, *end;   /* the current reservation: bump, read-write end, end */
    void *empty[GIVE_BACK_BATCH];            /* empty slabs waiting to be given back */
    size_t empty_bytes[GIVE_BACK_BATCH];
    int n_empty;
} H = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int cmp_ptr(const void *a, const void *b) {
    uintptr_t x = (uintptr_t) * (void *const *)a, y = (uintptr_t) * (void *const *)b;
    return x < y ? -1 : x > y;
}

/* Gives every gathered empty slab back, adjacent ones in one madvise. H.lock held. */
static void give_back_locked(void) {
    if (!H.n_empty) return;
    /* sort the pairs by address (slab sizes travel with their slab) */
    uintptr_t pair[GIVE_BACK_BATCH][2];
    for (int i = 0; i < H.n_empty; i++) pair[i][0] = (uintptr_t)H.empty[i], pair[i][1] = H.empty_bytes[i];
    qsort(pair, (size_t)H.n_empty, sizeof pair[0], cmp_ptr);
    for (int i = 0; i < H.n_empty;) {
        uintptr_t start = pair[i][0], stop = start + pair[i][1];
        for (i++; i < H.n_empty && pair[i][0] == stop; i++) stop += pair[i][1];
        /* cannot fail on a private anonymous mapping we made; the memory is then simply kept */
        (void)madvise((void *)start, stop - start, MADV_DONTNEED);
    }
    H.n_empty = 0;
}

static void slab_empty_locked(slab_head *s, size_t bytes) {
    if (H.n_empty == GIVE_BACK_BATCH) give_back_locked();
    H.empty[H.n_empty] = s;
    H.empty_bytes[H.n_empty++] = bytes;
}

/* A fresh slab of `bytes` (a power of two, at least a page), aligned to its size; NULL + error
   when no address space is left. H.lock held. */
static slab_head *slab_new_locked(size_t bytes) {
    unsigned char *p = (unsigned char *)(((uintptr_t)H.next + bytes - 1) & ~(uintptr_t)(bytes - 1));
    if (!H.next || p + bytes > H.end) {
        /* a new reservation; the old one's rest stays reserved, never used */
        size_t want = RESERVE > 2 * bytes ? RESERVE : 2 * bytes;
        void *r;
        while ((r = mmap(NULL, want, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)) == MAP_FAILED &&
               want / 2 >= RESERVE_MIN && want / 2 >= 2 * bytes)
            want /= 2;
        if (r == MAP_FAILED) return ampc__err_null(AMPC_ERR_OOM, "no address space left for a %zu-byte handle slab", bytes);
        LSAN_ROOT(r, want);
        H.next = H.committed = r;
        H.end = (unsigned char *)r + want;
        p = (unsigned char *)(((uintptr_t)H.next + bytes - 1) & ~(uintptr_t)(bytes - 1));
    }
    if (p + bytes > H.committed) {
        size_t grow = (size_t)(p + bytes - H.committed);
        grow = (grow + COMMIT_STEP - 1) / COMMIT_STEP * COMMIT_STEP;
        if (grow > (size_t)(H.end - H.committed)) grow = (size_t)(H.end - H.committed);
        if (mprotect(H.committed, grow, PROT_READ | PROT_WRITE) != 0)
            return ampc__err_null(AMPC_ERR_OOM, "cannot commit %zu bytes for handles", grow);
        (void)madvise(H.committed, grow, MADV_POPULATE_WRITE);   /* before Linux 5.14: faults instead */
        H.committed += grow;
    }
    H.next = p + bytes;
    slab_head *s = (slab_head *)p;
    s->live = 0;
    s->open = true;
    return s;
}

/* The slab size for objects of obj_size: a power of two from a page up, holding MIN_PER_SLAB. */
static size_t slab_bytes_for(size_t obj_size) {
    size_t b = (size_t)sysconf(_SC_PAGESIZE);
    while (b < SLAB_HEAD + MIN_PER_SLAB * obj_size) b *= 2;
    return b;
}

static size_t obj_stride(size_t obj_size) { return (obj_size + 15) / 16 * 16; }

void *ampc__handle_pool_get(ampc_handle_pool *hp) {
    pthread_mutex_lock(&H.lock);
    if (!hp->slab_bytes) hp->slab_bytes = slab_bytes_for(obj_stride(hp->obj_size));
    const size_t stride = obj_stride(hp->obj_size);
    if (!hp->slab || hp->next + stride > hp->slab_bytes) {
        slab_head *s = slab_new_locked(hp->slab_bytes);
        if (!s) {
            pthread_mutex_unlock(&H.lock);
            return NULL;
        }
        slab_head *old = (slab_head *)hp->slab;
        if (old) {
            old->open = false;
            if (!old->live) slab_empty_locked(old, hp->slab_bytes);
        }
        hp->slab = s;
        hp->next = SLAB_HEAD;
    }
    unsigned char *p = (unsigned char *)hp->slab + hp->next;
    hp->next += stride;
    ((slab_head *)hp->slab)->live++;
    pthread_mutex_unlock(&H.lock);
    return p;   /* zeroed: fresh memory, as no address is handed out twice */
}

void ampc__handle_pool_put(ampc_handle_pool *hp, void *p) {
    if (!p) return;
    slab_head *s = (slab_head *)((uintptr_t)p & ~(uintptr_t)(hp->slab_bytes - 1));
    pthread_mutex_lock(&H.lock);
    if (--s->live == 0 && !s->open) slab_empty_locked(s, hp->slab_bytes);
    pthread_mutex_unlock(&H.lock);
}
