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
 * the pool's cost). A freed object keeps its place, generation 0 written by its free. A slab
 * whose objects are all freed (and that its pool has left) is given back with
 * madvise(MADV_DONTNEED): it stays mapped and reads as zeros, generation 0, so a stale handle
 * still reads as stale, and costs no memory.
 *
 * madvise keeps the kernel's page tables, though: one 4 KiB page per 2 MiB of address space
 * ever touched, ~0.4 bytes per tensor ever made, hundreds of MB over a long run. So each
 * reservation counts, per 2 MiB region (what one page-table page maps), the slabs in it not yet
 * given back; a region that lies behind the bump with none left is mapped afresh read-only
 * (mmap MAP_FIXED): the kernel frees its pages and page-table pages, it still reads as zeros,
 * and adjacent such regions merge into one mapping. A reservation the bump has left, with no
 * slab left in it, is mapped afresh whole (its upper-level page-table page goes too), and
 * reservations are placed one below the other, so those merge as well. Only regions holding a
 * live object (a parameter, say), and the first region of its reservation (the counts live
 * there), keep a page-table page and a mapping or two. Empty slabs are given back in batches,
 * adjacent ones in one call, so a steady training step makes a few system calls, not one per
 * slab: the pool costs ~60 ns per tensor made and freed (the mmap per ~10,000 tensors adds
 * ~1 ns), of ~200 ns for the whole of ampc_tensor_zeros + free. What is never returned is
 * address space: about 200 bytes per tensor ever made (a 47-bit address space holds some 10^11).
 *
 * Each slab starts with a header (live objects, whether its pool still cuts from it, its
 * reservation); a slab's size is a power of two, and slabs are aligned to it, so a free finds
 * its slab by masking.
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
#define LSAN_UNROOT(p, n) __lsan_unregister_root_region((p), (n))
#else
#define LSAN_ROOT(p, n) ((void)(p), (void)(n))
#define LSAN_UNROOT(p, n) ((void)(p), (void)(n))
#endif

#define RESERVE ((size_t)1 << 30)        /* address space reserved at a time */
#define RESERVE_MIN ((size_t)1 << 20)    /* halved down to this when mmap refuses (ulimit -v) */
#define COMMIT_STEP ((size_t)256 << 10)  /* made read-write at a time */
#define REGION ((size_t)2 << 20)         /* what one page-table page maps (x86-64, arm64 with 4 KiB pages) */
#define SLAB_HEAD ((size_t)64)           /* header; objects after it stay 64-byte aligned */
#define MIN_PER_SLAB 8                   /* a slab holds at least this many objects */
#define GIVE_BACK_BATCH 64               /* empty slabs gathered before they are given back */
#define REGION_GONE UINT16_MAX           /* a region mapped afresh read-only, for good */

/* A reservation's bookkeeping, in its own first page: region i is [rbase + i*REGION, +REGION)
   clipped to [base, end); region 0 holds this record, so it goes only with the whole. */
typedef struct {
    unsigned char *base, *end;
    uintptr_t rbase;      /* base rounded down to REGION */
    uint32_t n_regions;
    uint32_t nonempty;    /* regions whose slabs[] is neither 0 nor REGION_GONE */
    bool retired;         /* the bump has moved to a later reservation: all of it lies behind */
    uint16_t slabs[];     /* per region: slabs cut in it and not yet given back (a 2 MiB region
                             holds at most 512 of the smallest, 4 KiB ones), or REGION_GONE */
} reservation;

typedef struct {
    uint32_t live;        /* objects handed out and not yet freed */
    bool open;            /* its pool still cuts objects from it */
    reservation *res;     /* the reservation it was cut from */
} slab_head;

static struct {
    pthread_mutex_t lock;
    reservation *cur;                        /* the reservation the bump cuts from */
    unsigned char *next, *committed, *end;   /* in cur: bump, read-write end, end */
    void *empty[GIVE_BACK_BATCH];            /* empty slabs waiting to be given back */
    size_t empty_bytes[GIVE_BACK_BATCH];
    int n_empty;
} H = {.lock = PTHREAD_MUTEX_INITIALIZER};

static uint32_t region_of(const reservation *r, const void *p) { return (uint32_t)(((uintptr_t)p - r->rbase) / REGION); }

/* Region i lies wholly behind the bump: no slab will ever be cut from it again. H.lock held. */
static bool region_behind(const reservation *r, uint32_t i) {
    return r->retired || r->rbase + (uintptr_t)(i + 1) * REGION <= (uintptr_t)H.next;
}

/* Maps [p, p + n) afresh read-only: the kernel frees its pages and its page-table pages, and it
   still reads as zeros (generation 0: a stale handle reads as stale, a LeakSanitizer scan finds
   nothing). Where mmap fails (at the kernel's map-count limit, before it unmaps anything),
   madvise still gives the memory back. */
static void map_zeros(void *p, size_t n) {
    if (mmap(p, n, PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0) == MAP_FAILED)
        (void)madvise(p, n, MADV_DONTNEED);
}

/* Regions [from, to) of r whose slabs were all given back, and that lie behind the bump, are
   mapped afresh, adjacent ones in one call. H.lock held. */
static void reap_regions_locked(reservation *r, uint32_t from, uint32_t to) {
    if (from == 0) from = 1;   /* region 0 holds r itself */
    for (uint32_t i = from; i < to;) {
        if (r->slabs[i] != 0 || !region_behind(r, i)) {
            i++;
            continue;
        }
        uint32_t j = i;
        while (j < to && r->slabs[j] == 0 && region_behind(r, j)) r->slabs[j++] = REGION_GONE;
        uintptr_t lo = r->rbase + (uintptr_t)i * REGION, hi = r->rbase + (uintptr_t)j * REGION;
        if (hi > (uintptr_t)r->end) hi = (uintptr_t)r->end;
        map_zeros((void *)lo, hi - lo);
        i = j;
    }
}

/* A retired reservation with no slab left in it goes whole, record included: one mapping, whose
   page-table pages all go (an aligned reservation's upper-level one too). H.lock held. */
static bool reap_reservation_locked(reservation *r) {
    if (!r->retired || r->nonempty) return false;
    unsigned char *base = r->base;
    size_t n = (size_t)(r->end - r->base);
    LSAN_UNROOT(base, n);   /* no object is left in it to hold a pointer */
    map_zeros(base, n);
    return true;
}

/* Whether the given-back slab [p, p + bytes) of r goes with its region or reservation in
   give_back_locked's step 3 (a slab of a region or more has its regions to itself, so its last
   one tells). H.lock held. */
static bool slab_goes_locked(const reservation *r, uintptr_t p, size_t bytes) {
    const uint32_t first = region_of(r, (void *)p), last = region_of(r, (void *)(p + bytes - 1));
    return (r->retired && !r->nonempty) || (first != 0 && r->slabs[last] == 0 && region_behind(r, last));
}

static int cmp_ptr(const void *a, const void *b) {
    uintptr_t x = (uintptr_t) * (void *const *)a, y = (uintptr_t) * (void *const *)b;
    return x < y ? -1 : x > y;
}

/* Gives every gathered empty slab back: the regions and reservations it leaves empty and behind
   the bump are mapped afresh, the other slabs madvised, adjacent ones in one call. H.lock held. */
static void give_back_locked(void) {
    if (!H.n_empty) return;
    /* sort the pairs by address (slab sizes travel with their slab): a reservation's slabs are
       then adjacent */
    uintptr_t pair[GIVE_BACK_BATCH][2];
    reservation *res[GIVE_BACK_BATCH];
    const int n = H.n_empty;
    for (int i = 0; i < n; i++) pair[i][0] = (uintptr_t)H.empty[i], pair[i][1] = H.empty_bytes[i];
    qsort(pair, (size_t)n, sizeof pair[0], cmp_ptr);
    /* 1: uncount every slab, while every slab header still reads */
    for (int i = 0; i < n; i++) {
        reservation *r = res[i] = ((slab_head *)pair[i][0])->res;
        for (uint32_t k = region_of(r, (void *)pair[i][0]); k <= region_of(r, (void *)(pair[i][0] + pair[i][1] - 1)); k++)
            if (--r->slabs[k] == 0) r->nonempty--;
    }
    /* 2: madvise the slabs that step 3 keeps mapped, adjacent ones in one call */
    for (int i = 0; i < n;) {
        if (slab_goes_locked(res[i], pair[i][0], pair[i][1])) {
            i++;
            continue;
        }
        uintptr_t start = pair[i][0], stop = start + pair[i][1];
        for (i++; i < n && pair[i][0] == stop && !slab_goes_locked(res[i], pair[i][0], pair[i][1]); i++) stop += pair[i][1];
        /* cannot fail on a private anonymous mapping we made; the memory is then simply kept */
        (void)madvise((void *)start, stop - start, MADV_DONTNEED);
    }
    /* 3: map afresh what is empty and behind; a reservation's record is not read once it went */
    for (int i = 0; i < n;) {
        reservation *r = res[i];
        if (reap_reservation_locked(r)) {
            while (i < n && res[i] == r) i++;
            continue;
        }
        reap_regions_locked(r, region_of(r, (void *)pair[i][0]), region_of(r, (void *)(pair[i][0] + pair[i][1] - 1)) + 1);
        i++;
    }
    H.n_empty = 0;
}

static void slab_empty_locked(slab_head *s, size_t bytes) {
    if (H.n_empty == GIVE_BACK_BATCH) give_back_locked();
    H.empty[H.n_empty] = s;
    H.empty_bytes[H.n_empty++] = bytes;
}

/* `want` bytes of reserved address space: just below `below` where that is free (reservations
   that went whole then merge into one mapping), else aligned to `want` where twice that can be
   had (an aligned reservation has its upper-level page-table page to itself), else as mmap
   places it; MAP_FAILED when refused. */
static unsigned char *reserve(size_t want, unsigned char *below) {
    const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    if (below && (uintptr_t)below >= 2 * want) {
        unsigned char *hint = below - want, *r = mmap(hint, want, PROT_NONE, flags, -1, 0);
        if (r == hint) return r;
        if (r != MAP_FAILED) (void)munmap(r, want);
    }
    unsigned char *r = mmap(NULL, 2 * want, PROT_NONE, flags, -1, 0);
    if (r == MAP_FAILED) return mmap(NULL, want, PROT_NONE, flags, -1, 0);
    unsigned char *a = (unsigned char *)(((uintptr_t)r + want - 1) & ~(uintptr_t)(want - 1));
    if (a > r) (void)munmap(r, (size_t)(a - r));
    if (a + want < r + 2 * want) (void)munmap(a + want, (size_t)(r + 2 * want - (a + want)));
    return a;
}

/* Makes the current reservation read-write up to `upto`, COMMIT_STEP at a time. H.lock held. */
static bool commit_locked(unsigned char *upto) {
    if (upto <= H.committed) return true;
    size_t grow = (size_t)(upto - H.committed);
    grow = (grow + COMMIT_STEP - 1) / COMMIT_STEP * COMMIT_STEP;
    if (grow > (size_t)(H.end - H.committed)) grow = (size_t)(H.end - H.committed);
    if (mprotect(H.committed, grow, PROT_READ | PROT_WRITE) != 0) return false;
    (void)madvise(H.committed, grow, MADV_POPULATE_WRITE);   /* before Linux 5.14: faults instead */
    H.committed += grow;
    return true;
}

/* A new reservation for slabs of `bytes`, its record written, the old one retired; AMPC_OK, or
   AMPC_ERR_OOM (recorded) when no address space is left. H.lock held. */
static int reservation_new_locked(size_t bytes) {
    /* the old one's rest stays reserved, never used */
    size_t want = RESERVE > 2 * bytes ? RESERVE : 2 * bytes;
    unsigned char *p;
    while ((p = reserve(want, H.cur ? H.cur->base : NULL)) == MAP_FAILED && want / 2 >= RESERVE_MIN && want / 2 >= 2 * bytes) want /= 2;
    if (p == MAP_FAILED) return ampc__err(AMPC_ERR_OOM, "no address space left for a %zu-byte handle slab", bytes);
    const uintptr_t rbase = (uintptr_t)p & ~(uintptr_t)(REGION - 1);
    const uint32_t n_regions = (uint32_t)(((uintptr_t)p + want - rbase + REGION - 1) / REGION);
    const size_t record = sizeof(reservation) + n_regions * sizeof(uint16_t);
    reservation *old = H.cur;
    unsigned char *old_next = H.next, *old_committed = H.committed, *old_end = H.end;
    H.next = H.committed = p;
    H.end = p + want;
    if (!commit_locked(p + record)) {
        (void)munmap(p, want);
        H.next = old_next, H.committed = old_committed, H.end = old_end;
        return ampc__err(AMPC_ERR_OOM, "cannot commit the record of a handle reservation");
    }
    LSAN_ROOT(p, want);
    reservation *r = (reservation *)p;   /* fresh memory: slabs[] reads 0 */
    r->base = p;
    r->end = p + want;
    r->rbase = rbase;
    r->n_regions = n_regions;
    H.cur = r;
    H.next = p + record;
    if (old) {
        old->retired = true;
        if (!reap_reservation_locked(old)) reap_regions_locked(old, 0, old->n_regions);
    }
    return AMPC_OK;
}

/* A fresh slab of `bytes` (a power of two, at least a page), aligned to its size; NULL + error
   when no address space is left. H.lock held. */
static slab_head *slab_new_locked(size_t bytes) {
    unsigned char *p = (unsigned char *)(((uintptr_t)H.next + bytes - 1) & ~(uintptr_t)(bytes - 1));
    if (!H.cur || p + bytes > H.end) {
        if (reservation_new_locked(bytes) != AMPC_OK) return NULL;
        p = (unsigned char *)(((uintptr_t)H.next + bytes - 1) & ~(uintptr_t)(bytes - 1));
    }
    if (!commit_locked(p + bytes)) return ampc__err_null(AMPC_ERR_OOM, "cannot commit %zu bytes for handles", bytes);
    reservation *r = H.cur;
    const uint32_t first = region_of(r, p), last = region_of(r, p + bytes - 1);
    for (uint32_t k = first; k <= last; k++)
        if (r->slabs[k]++ == 0) r->nonempty++;
    /* regions the bump passes over untouched (alignment) or leaves behind empty go now */
    const uint32_t behind_before = (uint32_t)(((uintptr_t)H.next - r->rbase) / REGION);
    H.next = p + bytes;
    if (first > behind_before) reap_regions_locked(r, behind_before, first);
    slab_head *s = (slab_head *)p;
    s->live = 0;
    s->open = true;
    s->res = r;
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
