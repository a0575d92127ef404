/*
 * alloc.c - the caching allocator: rounds requests into size classes, keeps freed blocks in
 * per-device free lists for reuse (a steady-state step does no malloc), counts bytes in use by
 * kind with peaks, and enforces an optional budget that emulates a device's memory size.
 */
#include "backend/backend.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define NBUCKETS 1024   /* open-addressing table of size classes, per device */

typedef struct { size_t size; void *head; size_t count; } bucket;

static struct {
    pthread_mutex_t lock;
    bucket buckets[AMPC_DEVICE_COUNT][NBUCKETS];
    ampc_memory_stats_t st;
} A = {.lock = PTHREAD_MUTEX_INITIALIZER};

static _Thread_local ampc_mem_kind cur_kind = AMPC_MEM_ACTIVATIONS;

/* Size class: 64-byte granularity up to 4 KiB, then 16 classes per power of two (<= 6% waste). */
static size_t round_size(size_t n) {
    if (n == 0) n = 1;
    if (n <= 4096) return (n + 63) & ~(size_t)63;
    size_t p = (size_t)1 << (63 - __builtin_clzll((unsigned long long)n));   /* p <= n < 2p */
    size_t step = p / 16;
    return (n + step - 1) / step * step;
}

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

static void empty_cache_locked(void) {
    for (int d = 0; d < AMPC_DEVICE_COUNT; d++) {
        const ampc_backend *be = ampc__backend((ampc_device)d);
        for (size_t i = 0; i < NBUCKETS; i++) {
            bucket *b = &A.buckets[d][i];
            while (b->head) {
                void *p = b->head;
                memcpy(&b->head, p, sizeof(void *));
                be->raw_free(p);
                A.st.cached -= b->size;
            }
            b->count = 0;
        }
    }
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
    bucket *b = find_bucket(dev, size, false);
    if (b && b->head) {
        p = b->head;
        memcpy(&b->head, p, sizeof(void *));
        b->count--;
        A.st.cached -= size;
    } else {
        const ampc_backend *be = ampc__backend(dev);
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
    bucket *b = find_bucket(dev, block_bytes, true);
    if (b) {
        memcpy(p, &b->head, sizeof(void *));
        b->head = p;
        b->count++;
        A.st.cached += block_bytes;
    } else {
        ampc__backend(dev)->raw_free(p);   /* table full: don't cache this size */
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
// Header pools: tensor, storage and node headers are recycled, never returned to malloc.

void *ampc__pool_get(ampc_pool *pool) {
    pthread_mutex_lock(&A.lock);
    void *p = pool->free_list;
    if (p) memcpy(&pool->free_list, p, sizeof(void *));
    pthread_mutex_unlock(&A.lock);
    if (!p) p = malloc(pool->obj_size);
    if (!p) return ampc__err_null(AMPC_ERR_OOM, "object header of %zu bytes", pool->obj_size);
    memset(p, 0, pool->obj_size);
    return p;
}

void ampc__pool_put(ampc_pool *pool, void *p) {
    if (!p) return;
    pthread_mutex_lock(&A.lock);
    memcpy(p, &pool->free_list, sizeof(void *));
    pool->free_list = p;
    pthread_mutex_unlock(&A.lock);
}

void ampc__pool_drain(ampc_pool *pool) {
    pthread_mutex_lock(&A.lock);
    while (pool->free_list) {
        void *p = pool->free_list;
        memcpy(&pool->free_list, p, sizeof(void *));
        free(p);
    }
    pthread_mutex_unlock(&A.lock);
}

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
