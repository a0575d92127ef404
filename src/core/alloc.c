/*
 * alloc.c - the caching allocator: keeps freed blocks for reuse (a steady-state step does no
 * malloc), counts bytes in use by kind with peaks, and enforces an optional budget that
 * emulates a device's memory size.
 *
 * Two pools, as PyTorch's CUDA caching allocator: requests under 1 MiB round to size classes
 * with a free list each; larger ones are carved best-fit out of segments (20 MiB, or the
 * request rounded to 2 MiB), split when the rest is 1 MiB or more, and merged with free
 * neighbours when freed. An exact-size-class cache for large blocks kept each class's own peak
 * (1.2-1.7x the peak in use was reserved: bench/NOTES.md); carving lets every freed byte serve
 * any later request. In sanitizer builds each large block is followed by a poisoned red zone
 * and free segment space is poisoned, so overruns between carved blocks are still caught.
 */
#include "core/core.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define REDZONE ((size_t)256)
#define POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define REDZONE ((size_t)0)
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#define LARGE_MIN ((size_t)1 << 20)       /* requests from here on are carved from segments */
#define LARGE_ALIGN ((size_t)4096)
#define SEG_DEFAULT ((size_t)20 << 20)    /* segment for requests under SEG_BIG */
#define SEG_BIG ((size_t)10 << 20)
#define SEG_ROUND ((size_t)2 << 20)
#define SPLIT_MIN ((size_t)1 << 20)       /* a smaller rest stays with the block it came from */
#define LIVE_BUCKETS 4096

/* A large block: a piece of a segment, free or in use. Headers live outside the memory they
   describe (device memory may not be host-readable), recycled through spare_blocks. */
typedef struct lblock {
    char *ptr;
    size_t size;
    bool free;
    struct lblock *prev, *next;     /* neighbours in the segment, by address */
    struct lblock *link_prev, *link; /* free: the device's free list; in use: a live-table chain */
} lblock;

#define NBUCKETS 1024   /* open-addressing table of size classes, per device */

/* A size class's free blocks: linked through their first bytes in host memory; for a device
   whose memory the CPU cannot touch (CUDA), kept in a host-side stack (stack, cap) instead. */
typedef struct { size_t size; void *head; size_t count; void **stack; size_t cap; } bucket;

static struct {
    pthread_mutex_t lock;
    bucket buckets[AMPC_DEVICE_COUNT][NBUCKETS];
    lblock *free_large[AMPC_DEVICE_COUNT];           /* unsorted; best fit by a scan */
    lblock *live[AMPC_DEVICE_COUNT][LIVE_BUCKETS];   /* in-use large blocks by address */
    lblock *spare_blocks;
    ampc_memory_stats_t st;
} A = {.lock = PTHREAD_MUTEX_INITIALIZER};

static _Thread_local ampc_mem_kind cur_kind = AMPC_MEM_ACTIVATIONS;

static size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

/* Size class: 64-byte granularity up to 4 KiB, then 16 classes per power of two (<= 6% waste);
   large requests: 4 KiB granularity (plus the red zone in sanitizer builds). */
static size_t round_size(size_t n) {
    if (n == 0) n = 1;
    if (n <= 4096) return (n + 63) & ~(size_t)63;
    if (n >= LARGE_MIN) return round_up(n, LARGE_ALIGN) + REDZONE;
    size_t p = (size_t)1 << (63 - __builtin_clzll((unsigned long long)n));   /* p <= n < 2p */
    return round_up(n, p / 16);
}

size_t ampc__mem_block_size(size_t nbytes) { return round_size(nbytes); }

static bucket *find_bucket(ampc_device dev, size_t size, bool create) {
    size_t h = (size * 0x9E3779B97F4A7C15ull) >> 54;   /* 10 bits */
    for (size_t i = 0; i < NBUCKETS; i++) {
        bucket *b = &A.buckets[dev][(h + i) % NBUCKETS];
        if (b->size == size) return b;
        if (b->size == 0) {
            if (!create) return NULL;
            b->size = size;
            return b;
        }
    }
    return NULL;
}

static void count_in(size_t bytes, ampc_mem_kind kind) {
    A.st.current[kind] += bytes;
    if (A.st.current[kind] > A.st.peak[kind]) A.st.peak[kind] = A.st.current[kind];
    A.st.current_total += bytes;
    if (A.st.current_total > A.st.peak_total) A.st.peak_total = A.st.current_total;
}

// ---------------------------------------------------------------------------------------------
// Large blocks

static lblock *block_new(void) {
    lblock *b = A.spare_blocks;
    if (b) A.spare_blocks = b->link;
    else b = malloc(sizeof *b);
    if (b) memset(b, 0, sizeof *b);
    return b;
}

static void block_recycle(lblock *b) {
    b->link = A.spare_blocks;
    A.spare_blocks = b;
}

static void free_list_add(ampc_device dev, lblock *b) {
    b->free = true;
    b->link_prev = NULL;
    b->link = A.free_large[dev];
    if (b->link) b->link->link_prev = b;
    A.free_large[dev] = b;
    POISON(b->ptr, b->size);
}

static void free_list_remove(ampc_device dev, lblock *b) {
    if (b->link_prev) b->link_prev->link = b->link;
    else A.free_large[dev] = b->link;
    if (b->link) b->link->link_prev = b->link_prev;
    b->link = b->link_prev = NULL;
    b->free = false;
}

static size_t live_slot(const void *p) { return (size_t)(((uintptr_t)p >> 12) * 0x9E3779B97F4A7C15ull >> 52); }

static void empty_cache_locked(void);
static void *bucket_pop(ampc_device dev, bucket *b);

/* A block of exactly `size` bytes in use (NULL when no segment could be had). */
static lblock *large_take(ampc_device dev, size_t size) {
    lblock *best = NULL;
    for (lblock *b = A.free_large[dev]; b; b = b->link)
        if (b->size >= size && (!best || b->size < best->size)) best = b;
    if (!best) {
        const ampc_device_ops *be = ampc__device(dev);
        size_t seg = size < SEG_BIG ? SEG_DEFAULT : round_up(size, SEG_ROUND);
        /* under a budget (a device of `limit` bytes holds in-use and cached blocks), a segment
           holds only what the request needs, and the cache goes first when even that is over */
        if (A.st.limit && A.st.current_total + A.st.cached + seg > A.st.limit) {
            seg = size;
            if (A.st.current_total + A.st.cached + seg > A.st.limit) empty_cache_locked();
        }
        lblock *h = block_new();
        char *p = h ? be->raw_alloc(seg) : NULL;
        if (!p) {
            if (h) block_recycle(h);
            return NULL;
        }
        A.st.n_malloc++;
        A.st.cached += seg;
        h->ptr = p;
        h->size = seg;
        free_list_add(dev, h);
        best = h;
    }
    free_list_remove(dev, best);
    if (best->size - size >= SPLIT_MIN) {
        lblock *rest = block_new();
        if (rest) {
            rest->ptr = best->ptr + size;
            rest->size = best->size - size;
            rest->prev = best;
            rest->next = best->next;
            if (best->next) best->next->prev = rest;
            best->next = rest;
            best->size = size;
            free_list_add(dev, rest);
        }
    }
    A.st.cached -= best->size;
    size_t slot = live_slot(best->ptr);
    best->link = A.live[dev][slot];
    A.live[dev][slot] = best;
    UNPOISON(best->ptr, best->size - REDZONE);
    return best;
}

/* Merges l's right neighbour (adjacent in the segment) into l and recycles its header. */
static void absorb_next(lblock *l) {
    lblock *r = l->next;
    l->size += r->size;
    l->next = r->next;
    if (r->next) r->next->prev = l;
    block_recycle(r);
}

/* Frees the block at p; returns false if p is not a live large block. */
static bool large_give_back(ampc_device dev, void *p) {
    lblock **pp = &A.live[dev][live_slot(p)];
    while (*pp && (*pp)->ptr != p) pp = &(*pp)->link;
    lblock *b = *pp;
    if (!b) return false;
    *pp = b->link;
    A.st.cached += b->size;
    if (b->next && b->next->free) {   /* merge the right neighbour into b */
        free_list_remove(dev, b->next);
        absorb_next(b);
    }
    if (b->prev && b->prev->free) {   /* merge b into the left neighbour */
        b = b->prev;
        free_list_remove(dev, b);
        absorb_next(b);
    }
    free_list_add(dev, b);
    return true;
}

/* Returns every wholly free segment to the system. */
static void large_release_free_segments(ampc_device dev) {
    const ampc_device_ops *be = ampc__device(dev);
    lblock *b = A.free_large[dev];
    while (b) {
        lblock *nx = b->link;
        if (!b->prev && !b->next) {
            free_list_remove(dev, b);
            UNPOISON(b->ptr, b->size);
            be->raw_free(b->ptr);
            A.st.cached -= b->size;
            block_recycle(b);
        }
        b = nx;
    }
}

// ---------------------------------------------------------------------------------------------
// Allocation

static void empty_cache_locked(void) {
    for (int d = 0; d < AMPC_DEVICE_COUNT; d++) {
        large_release_free_segments((ampc_device)d);
        const ampc_device_ops *be = ampc__device((ampc_device)d);
        for (size_t i = 0; i < NBUCKETS; i++) {
            bucket *b = &A.buckets[d][i];
            for (void *p; (p = bucket_pop((ampc_device)d, b));) {
                be->raw_free(p);
                A.st.cached -= b->size;
            }
        }
    }
}

/* Takes a free block of b (NULL if none). */
static void *bucket_pop(ampc_device dev, bucket *b) {
    if (!ampc__device(dev)->host_memory) return b->count ? b->stack[--b->count] : NULL;
    void *p = b->head;
    if (p) {
        memcpy(&b->head, p, sizeof(void *));
        b->count--;
    }
    return p;
}

/* Gives p to b; false if it can't be kept (then the caller frees it). */
static bool bucket_push(ampc_device dev, bucket *b, void *p) {
    if (!ampc__device(dev)->host_memory) {
        if (b->count == b->cap) {
            size_t cap = b->cap ? 2 * b->cap : 16;
            void **st = realloc(b->stack, cap * sizeof *st);
            if (!st) return false;
            b->stack = st;
            b->cap = cap;
        }
        b->stack[b->count++] = p;
        return true;
    }
    memcpy(p, &b->head, sizeof(void *));
    b->head = p;
    b->count++;
    return true;
}

void *ampc__alloc(ampc_device dev, size_t nbytes, ampc_mem_kind kind, size_t *block_bytes) {
    size_t size = round_size(nbytes);
    pthread_mutex_lock(&A.lock);
    if (A.st.limit && A.st.current_total + size > A.st.limit) {
        size_t in_use = A.st.current_total, limit = A.st.limit;
        pthread_mutex_unlock(&A.lock);
        return ampc__err_null(AMPC_ERR_OOM,
                              "tried to allocate %.2f MiB (%s) with %.2f MiB in use of a %.2f MiB limit",
                              (double)size / 1048576.0, ampc_mem_kind_name(kind),
                              (double)in_use / 1048576.0, (double)limit / 1048576.0);
    }
    A.st.n_alloc++;
    void *p = NULL;
    if (size >= LARGE_MIN) {
        lblock *lb = large_take(dev, size);
        if (!lb) {   /* a device of `limit` bytes holds in-use and cached blocks */
            empty_cache_locked();
            lb = large_take(dev, size);
        }
        if (!lb) {
            pthread_mutex_unlock(&A.lock);
            return ampc__err_null(AMPC_ERR_OOM, "the system refused %.2f MiB (%s)", (double)size / 1048576.0,
                                  ampc_mem_kind_name(kind));
        }
        count_in(size, kind);
        pthread_mutex_unlock(&A.lock);
        if (block_bytes) *block_bytes = size;
        return lb->ptr;
    }
    bucket *b = find_bucket(dev, size, false);
    if (b && (p = bucket_pop(dev, b))) {
        A.st.cached -= size;
    } else {
        const ampc_device_ops *be = ampc__device(dev);
        /* A device of `limit` bytes holds in-use and cached blocks: free the cache first. */
        if (A.st.limit && A.st.current_total + A.st.cached + size > A.st.limit) empty_cache_locked();
        p = be->raw_alloc(size);
        if (!p) {
            empty_cache_locked();
            p = be->raw_alloc(size);
        }
        if (!p) {
            pthread_mutex_unlock(&A.lock);
            return ampc__err_null(AMPC_ERR_OOM, "the system refused %.2f MiB (%s)",
                                  (double)size / 1048576.0, ampc_mem_kind_name(kind));
        }
        A.st.n_malloc++;
    }
    count_in(size, kind);
    pthread_mutex_unlock(&A.lock);
    if (block_bytes) *block_bytes = size;
    return p;
}

void ampc__free(ampc_device dev, void *p, size_t block_bytes, ampc_mem_kind kind) {
    if (!p) return;
    pthread_mutex_lock(&A.lock);
    A.st.current[kind] -= block_bytes;
    A.st.current_total -= block_bytes;
    if (block_bytes >= LARGE_MIN && large_give_back(dev, p)) {
        pthread_mutex_unlock(&A.lock);
        return;
    }
    bucket *b = find_bucket(dev, block_bytes, true);
    if (b && bucket_push(dev, b, p)) {
        A.st.cached += block_bytes;
    } else {
        ampc__device(dev)->raw_free(p);   /* table full: don't cache this size */
    }
    pthread_mutex_unlock(&A.lock);
}

void ampc__mem_retag(size_t block_bytes, ampc_mem_kind from, ampc_mem_kind to) {
    if (from == to) return;
    pthread_mutex_lock(&A.lock);
    A.st.current[from] -= block_bytes;
    A.st.current[to] += block_bytes;
    if (A.st.current[to] > A.st.peak[to]) A.st.peak[to] = A.st.current[to];
    pthread_mutex_unlock(&A.lock);
}

ampc_mem_kind ampc__mem_kind_push(ampc_mem_kind k) {
    ampc_mem_kind prev = cur_kind;
    cur_kind = k;
    return prev;
}
void ampc__mem_kind_pop(ampc_mem_kind prev) { cur_kind = prev; }

// ---------------------------------------------------------------------------------------------
// Header pools: storage and node headers are recycled (the handle pools are in handles.c).

static void *link_of(void *p) {
    void *next;
    memcpy(&next, p, sizeof next);
    return next;
}

static void set_link(void *p, void *next) { memcpy(p, &next, sizeof next); }

/* A zeroed object: first (if any, under A.lock) of the free list, else from malloc. */
static void *pool_take(ampc_pool *pool, void *first) {
    void *p = first ? first : malloc(pool->obj_size);
    if (!p) return ampc__err_null(AMPC_ERR_OOM, "object header of %zu bytes", pool->obj_size);
    memset(p, 0, pool->obj_size);
    return p;
}

void *ampc__pool_get(ampc_pool *pool) {
    pthread_mutex_lock(&A.lock);
    void *p = pool->free_list;
    if (p) pool->free_list = link_of(p);
    pthread_mutex_unlock(&A.lock);
    return pool_take(pool, p);
}

void ampc__pool_put(ampc_pool *pool, void *p) {
    if (!p) return;
    pthread_mutex_lock(&A.lock);
    set_link(p, pool->free_list);
    pool->free_list = p;
    pthread_mutex_unlock(&A.lock);
}

void ampc__pool_drain(ampc_pool *pool) {
    pthread_mutex_lock(&A.lock);
    while (pool->free_list) {
        void *p = pool->free_list;
        pool->free_list = link_of(p);
        free(p);
    }
    pthread_mutex_unlock(&A.lock);
}

static atomic_uint_fast64_t next_gen = 1;

uint64_t ampc__new_gen(void) { return atomic_fetch_add_explicit(&next_gen, 1, memory_order_relaxed); }

// ---------------------------------------------------------------------------------------------
// Storage

static ampc_pool storage_pool = {sizeof(ampc_storage), NULL};

ampc_storage *ampc__storage_new(ampc_device dev, size_t nbytes, ampc_mem_kind kind) {
    ampc_storage *s = ampc__pool_get(&storage_pool);
    if (!s) return NULL;
    s->data = ampc__alloc(dev, nbytes, kind, &s->block_bytes);
    if (!s->data) {
        ampc__pool_put(&storage_pool, s);
        return NULL;
    }
    s->nbytes = nbytes;
    s->kind = kind;
    s->device = dev;
    atomic_init(&s->refcount, 1);
    atomic_init(&s->version, 0);
    return s;
}

void ampc__storage_retain(ampc_storage *s) { atomic_fetch_add(&s->refcount, 1); }

void ampc__storage_release(ampc_storage *s) {
    if (!s || atomic_fetch_sub(&s->refcount, 1) != 1) return;
    ampc__free(s->device, s->data, s->block_bytes, s->kind);
    ampc__pool_put(&storage_pool, s);
}

void ampc__storage_set_kind(ampc_storage *s, ampc_mem_kind kind) {
    ampc__mem_retag(s->block_bytes, s->kind, kind);
    s->kind = kind;
}

ampc_mem_kind ampc__current_mem_kind(void) { return cur_kind; }

// ---------------------------------------------------------------------------------------------
// Public stats

ampc_memory_stats_t ampc_memory_stats(void) {
    pthread_mutex_lock(&A.lock);
    ampc_memory_stats_t s = A.st;
    pthread_mutex_unlock(&A.lock);
    return s;
}

const char *ampc_mem_kind_name(ampc_mem_kind k) {
    static const char *names[AMPC_MEM_KIND_COUNT] = {"parameters", "gradients", "optimizer",
                                                     "activations", "workspace", "casts"};
    return (unsigned)k < AMPC_MEM_KIND_COUNT ? names[k] : "?";
}

void ampc_memory_reset_peak(void) {
    pthread_mutex_lock(&A.lock);
    for (int k = 0; k < AMPC_MEM_KIND_COUNT; k++) A.st.peak[k] = A.st.current[k];
    A.st.peak_total = A.st.current_total;
    pthread_mutex_unlock(&A.lock);
}

void ampc_memory_set_limit(size_t bytes) {
    pthread_mutex_lock(&A.lock);
    A.st.limit = bytes;
    pthread_mutex_unlock(&A.lock);
}

void ampc_memory_empty_cache(void) {
    pthread_mutex_lock(&A.lock);
    empty_cache_locked();
    pthread_mutex_unlock(&A.lock);
    ampc__pool_drain(&storage_pool);
}
