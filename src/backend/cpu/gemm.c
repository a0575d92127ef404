/*
 * gemm.c - CPU gemm on oneDNN's matmul primitive (C API), and the CPU table's shutdown hook.
 *
 * C[b] = op(A[b]) @ op(B[b]) (+ bias) becomes one matmul primitive whose memory descriptors
 * carry the layout: transposes are strides, batches are 3-D descriptors, a broadcast operand
 * has batch dim 1 (oneDNN takes that; a 0 stride would fall back to its slow reference code).
 * f32 and bf16 run natively (bf16 in, bf16 out, f32 accumulation: the avx512_core_bf16
 * brgemm kernels). oneDNN 2.6 has no f16 matmul on CPU, so f16 operands are widened to f32
 * workspace copies, multiplied in f32 and the result rounded once to f16 - what tensor cores
 * do (f16 inputs, f32 accumulation, one rounding).
 *
 * Primitives are expensive to create, so they live in a small LRU cache keyed by the shape,
 * layout, dtype and thread count, together with their memory objects (created without data;
 * each call only sets data handles). The scratchpad is user-managed and comes from the
 * caching allocator, so a steady-state call does no malloc. One mutex guards the cache and
 * the single CPU stream.
 */
#include "backend/backend.h"
#include "backend/cpu/cpu.h"

#include <dnnl.h>
#include <dnnl_debug.h>
#include <omp.h>
#include <pthread.h>
#include <string.h>

#define CACHE_SIZE 64

// ---------------------------------------------------------------------------------------------
// Primitive cache

/* Everything that makes two calls need different primitives. Zero-initialised with memset
   before filling, so it can be compared with memcmp. */
typedef struct {
    dnnl_data_type_t dt;
    int64_t batch, M, N, K;
    int64_t stride_a, stride_b, stride_c;   /* 0: broadcast operand (batch dim 1) */
    int32_t ta, tb, has_bias, nthr;         /* nthr: oneDNN sizes blocking and scratchpad by it */
} gemm_key;

typedef struct {
    gemm_key key;
    bool used;
    uint64_t last_use;
    dnnl_primitive_desc_t pd;
    dnnl_primitive_t prim;
    dnnl_memory_t mem_a, mem_b, mem_bias, mem_c, mem_scratch;   /* no data: handles per call */
    size_t scratch_bytes;
} gemm_entry;

static struct {
    pthread_mutex_t lock;
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    gemm_entry cache[CACHE_SIZE];
    uint64_t clock;
} G = {.lock = PTHREAD_MUTEX_INITIALIZER};

#define DNNL_TRY(call, what)                                                                       \
    do {                                                                                           \
        dnnl_status_t st_ = (call);                                                                \
        if (st_ != dnnl_success) {                                                                 \
            rc = ampc__err(AMPC_ERR_BACKEND, "oneDNN %s: %s", what, dnnl_status2str(st_));         \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

static void entry_destroy(gemm_entry *e) {
    dnnl_memory_t *mems[] = {&e->mem_a, &e->mem_b, &e->mem_bias, &e->mem_c, &e->mem_scratch};
    for (size_t i = 0; i < sizeof mems / sizeof *mems; i++) {
        if (*mems[i]) dnnl_memory_destroy(*mems[i]);
        *mems[i] = NULL;
    }
    if (e->prim) dnnl_primitive_destroy(e->prim);
    if (e->pd) dnnl_primitive_desc_destroy(e->pd);
    memset(e, 0, sizeof *e);
}

/* Lazily creates the engine and stream (lock held). */
static int ensure_engine(void) {
    int rc = AMPC_OK;
    if (G.stream) return AMPC_OK;
    if (!G.engine) DNNL_TRY(dnnl_engine_create(&G.engine, dnnl_cpu, 0), "engine_create");
    DNNL_TRY(dnnl_stream_create(&G.stream, G.engine, dnnl_stream_default_flags), "stream_create");
    return AMPC_OK;
fail:
    return rc;
}

/* Descriptor of one operand viewed as (batch, rows, cols) with the stored matrix being
   (rows, cols) row-major, or (cols, rows) row-major when transposed. */
static dnnl_status_t operand_md(dnnl_memory_desc_t *md, dnnl_data_type_t dt, int64_t batch, int64_t bstride,
                                int64_t rows, int64_t cols, bool trans) {
    /* dnnl_dims_t is a fixed-size array parameter: pass whole ones */
    dnnl_dims_t dims = {0}, strides = {0};
    int64_t rs = trans ? 1 : cols, cs = trans ? rows : 1;
    if (batch == 1) {
        dims[0] = rows, dims[1] = cols, strides[0] = rs, strides[1] = cs;
        return dnnl_memory_desc_init_by_strides(md, 2, dims, dt, strides);
    }
    dims[0] = bstride == 0 ? 1 : batch, dims[1] = rows, dims[2] = cols;
    strides[0] = bstride == 0 ? rows * cols : bstride, strides[1] = rs, strides[2] = cs;
    return dnnl_memory_desc_init_by_strides(md, 3, dims, dt, strides);
}

/* Builds the primitive and its memory objects for key k into e (lock held). */
static int entry_create(gemm_entry *e, const gemm_key *k) {
    int rc = AMPC_OK;
    dnnl_primitive_attr_t attr = NULL;
    memset(e, 0, sizeof *e);
    e->key = *k;
    bool batched = k->batch > 1;
    dnnl_memory_desc_t a, b, c, bias;
    DNNL_TRY(operand_md(&a, k->dt, k->batch, k->stride_a, k->M, k->K, k->ta), "src descriptor");
    DNNL_TRY(operand_md(&b, k->dt, k->batch, k->stride_b, k->K, k->N, k->tb), "weights descriptor");
    DNNL_TRY(operand_md(&c, k->dt, k->batch, k->stride_c, k->M, k->N, false), "dst descriptor");
    if (k->has_bias) {   /* (1, N) or (1, 1, N): one row added to every output row */
        dnnl_dims_t dims = {1, 1, k->N}, strides = {k->N, k->N, 1};
        int nd = batched ? 3 : 2;
        if (!batched) dims[1] = k->N, strides[1] = 1;
        DNNL_TRY(dnnl_memory_desc_init_by_strides(&bias, nd, dims, k->dt, strides), "bias descriptor");
    }
    dnnl_matmul_desc_t op;
    DNNL_TRY(dnnl_matmul_desc_init(&op, &a, &b, k->has_bias ? &bias : NULL, &c), "matmul_desc_init");
    DNNL_TRY(dnnl_primitive_attr_create(&attr), "attr_create");
    DNNL_TRY(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user), "set_scratchpad_mode");
    DNNL_TRY(dnnl_primitive_desc_create(&e->pd, &op, attr, G.engine, NULL), "matmul primitive_desc_create");
    DNNL_TRY(dnnl_primitive_create(&e->prim, e->pd), "matmul primitive_create");
    DNNL_TRY(dnnl_memory_create(&e->mem_a, &a, G.engine, DNNL_MEMORY_NONE), "memory_create");
    DNNL_TRY(dnnl_memory_create(&e->mem_b, &b, G.engine, DNNL_MEMORY_NONE), "memory_create");
    DNNL_TRY(dnnl_memory_create(&e->mem_c, &c, G.engine, DNNL_MEMORY_NONE), "memory_create");
    if (k->has_bias) DNNL_TRY(dnnl_memory_create(&e->mem_bias, &bias, G.engine, DNNL_MEMORY_NONE), "memory_create");
    const dnnl_memory_desc_t *sp = dnnl_primitive_desc_query_md(e->pd, dnnl_query_scratchpad_md, 0);
    e->scratch_bytes = sp ? dnnl_memory_desc_get_size(sp) : 0;
    if (e->scratch_bytes) DNNL_TRY(dnnl_memory_create(&e->mem_scratch, sp, G.engine, DNNL_MEMORY_NONE), "memory_create");
    dnnl_primitive_attr_destroy(attr);
    e->used = true;
    return AMPC_OK;
fail:
    if (attr) dnnl_primitive_attr_destroy(attr);
    entry_destroy(e);
    return rc;
}

/* The cached entry for k, created on a miss (evicting the least recently used). Lock held. */
static gemm_entry *cache_get(const gemm_key *k) {
    if (ensure_engine() < 0) return NULL;
    gemm_entry *victim = &G.cache[0];
    for (int i = 0; i < CACHE_SIZE; i++) {
        gemm_entry *e = &G.cache[i];
        if (e->used && !memcmp(&e->key, k, sizeof *k)) {
            e->last_use = ++G.clock;
            return e;
        }
        if (!e->used) {
            if (victim->used) victim = e;
        } else if (victim->used && e->last_use < victim->last_use) {
            victim = e;
        }
    }
    if (victim->used) entry_destroy(victim);
    if (entry_create(victim, k) < 0) return NULL;
    victim->last_use = ++G.clock;
    return victim;
}

static void gemm_shutdown(void) {
    pthread_mutex_lock(&G.lock);
    for (int i = 0; i < CACHE_SIZE; i++)
        if (G.cache[i].used) entry_destroy(&G.cache[i]);
    if (G.stream) dnnl_stream_destroy(G.stream);
    if (G.engine) dnnl_engine_destroy(G.engine);
    G.stream = NULL;
    G.engine = NULL;
    G.clock = 0;
    pthread_mutex_unlock(&G.lock);
}

// ---------------------------------------------------------------------------------------------
// Descriptor normalisation

static size_t extent(int64_t batch, int64_t stride, int64_t rows, int64_t cols) {
    return (size_t)((stride ? batch - 1 : 0) * stride + rows * cols);
}

/* Canonical form of d: transposes of vectors dropped (same memory either way), strides of
   a single batch zeroed, and a batch over a broadcast B with a dense A folded into M (one big
   gemm instead of many small ones). */
static ampc_gemm_desc normalize(const ampc_gemm_desc *d) {
    ampc_gemm_desc n = *d;
    if (n.M == 1 || n.K == 1) n.ta = false;
    if (n.N == 1 || n.K == 1) n.tb = false;
    if (n.batch == 1) n.stride_a = n.stride_b = n.stride_c = 0;
    if (n.batch > 1 && n.stride_b == 0 && !n.ta && n.stride_a == n.M * n.K && n.stride_c == n.M * n.N) {
        n.M *= n.batch;
        n.batch = 1;
        n.stride_a = n.stride_c = 0;
    }
    return n;
}

static int check_desc(const ampc_gemm_desc *d, const ampc_tensor *a, const ampc_tensor *b, const ampc_tensor *bias,
                      const ampc_tensor *c) {
    if (d->batch < 0 || d->M < 0 || d->N < 0 || d->K < 0 || d->stride_a < 0 || d->stride_b < 0 || d->stride_c < 0)
        return ampc__err(AMPC_ERR_INVALID, "gemm: negative size or stride");
    if (a->dtype != b->dtype || a->dtype != c->dtype || (bias && bias->dtype != a->dtype))
        return ampc__err(AMPC_ERR_DTYPE, "gemm: operands of different dtypes");
    if (d->batch == 0 || d->M == 0 || d->N == 0) return AMPC_OK;
    if (d->batch > 1 && d->stride_c == 0) return ampc__err(AMPC_ERR_INVALID, "gemm: output batch stride 0");
    if ((d->K && ((size_t)a->numel < extent(d->batch, d->stride_a, d->M, d->K) ||
                  (size_t)b->numel < extent(d->batch, d->stride_b, d->K, d->N))) ||
        (size_t)c->numel < extent(d->batch, d->stride_c, d->M, d->N) || (bias && bias->numel < d->N))
        return ampc__err(AMPC_ERR_INVALID, "gemm: a tensor is smaller than the descriptor (batch %lld, M %lld, N %lld, K %lld)",
                         (long long)d->batch, (long long)d->M, (long long)d->N, (long long)d->K);
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Kernel

static dnnl_data_type_t dnnl_dt(ampc_dtype dt) { return dt == AMPC_BF16 ? dnnl_bf16 : dnnl_f32; }

static gemm_key make_key(const ampc_gemm_desc *d, ampc_dtype dt, bool has_bias) {
    gemm_key k;
    memset(&k, 0, sizeof k);
    k.dt = dnnl_dt(dt);
    k.batch = d->batch;
    k.M = d->M;
    k.N = d->N;
    k.K = d->K;
    k.stride_a = d->stride_a;
    k.stride_b = d->stride_b;
    k.stride_c = d->stride_c;
    k.ta = d->ta;
    k.tb = d->tb;
    k.has_bias = has_bias;
    k.nthr = omp_get_max_threads();
    return k;
}

/* Runs the cached primitive of d on raw pointers (lock held). */
static int run_primitive(const ampc_gemm_desc *d, ampc_dtype dt, const void *a, const void *b, const void *bias, void *c) {
    int rc = AMPC_OK;
    gemm_key k = make_key(d, dt, bias != NULL);
    gemm_entry *e = cache_get(&k);
    if (!e) return ampc_last_status();
    void *scratch = NULL;
    size_t scratch_block = 0;
    if (e->scratch_bytes) {
        scratch = ampc__alloc(AMPC_DEVICE_CPU, e->scratch_bytes, AMPC_MEM_WORKSPACE, &scratch_block);
        if (!scratch) return ampc_last_status();
        DNNL_TRY(dnnl_memory_set_data_handle(e->mem_scratch, scratch), "set_data_handle");
    }
    DNNL_TRY(dnnl_memory_set_data_handle(e->mem_a, (void *)a), "set_data_handle");
    DNNL_TRY(dnnl_memory_set_data_handle(e->mem_b, (void *)b), "set_data_handle");
    DNNL_TRY(dnnl_memory_set_data_handle(e->mem_c, c), "set_data_handle");
    dnnl_exec_arg_t args[5] = {{DNNL_ARG_SRC, e->mem_a}, {DNNL_ARG_WEIGHTS, e->mem_b}, {DNNL_ARG_DST, e->mem_c}};
    int nargs = 3;
    if (bias) {
        DNNL_TRY(dnnl_memory_set_data_handle(e->mem_bias, (void *)bias), "set_data_handle");
        args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_BIAS, e->mem_bias};
    }
    if (scratch) args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, e->mem_scratch};
    DNNL_TRY(dnnl_primitive_execute(e->prim, G.stream, nargs, args), "matmul execute");
    DNNL_TRY(dnnl_stream_wait(G.stream), "stream_wait");
fail:
    ampc__free(AMPC_DEVICE_CPU, scratch, scratch_block, AMPC_MEM_WORKSPACE);
    return rc;
}

/* K == 0: every output row is the bias (or zero). */
static int fill_bias(const ampc_gemm_desc *d, const ampc_tensor *bias, ampc_tensor *c) {
    size_t sz = ampc__dt(c->dtype)->size, row = (size_t)d->N * sz;
    char *out = ampc__data(c);
    for (int64_t bt = 0; bt < d->batch; bt++)
        for (int64_t i = 0; i < d->M; i++) {
            char *dst = out + ((size_t)(bt * d->stride_c + i * d->N)) * sz;
            if (bias) memcpy(dst, ampc__data(bias), row);
            else memset(dst, 0, row);   /* all-zero bits are 0.0 in f32, f16 and bf16 */
        }
    return AMPC_OK;
}

/* Widens f16 operands to f32 workspace, runs the f32 primitive, rounds the result once. */
static int gemm_f16(const ampc_gemm_desc *d, const ampc_tensor *a, const ampc_tensor *b, const ampc_tensor *bias,
                    ampc_tensor *c) {
    size_t na = extent(d->batch, d->stride_a, d->M, d->K), nb = extent(d->batch, d->stride_b, d->K, d->N);
    size_t nc = extent(d->batch, d->stride_c, d->M, d->N), nbias = bias ? (size_t)d->N : 0;
    size_t bytes = (na + nb + nc + nbias) * sizeof(float), block = 0;
    float *ws = ampc__alloc(AMPC_DEVICE_CPU, bytes, AMPC_MEM_WORKSPACE, &block);
    if (!ws) return ampc_last_status();
    float *a32 = ws, *b32 = a32 + na, *c32 = b32 + nb, *bias32 = bias ? c32 + nc : NULL;
    /* Single-threaded on purpose: the vectorized conversions run near memory speed (4M values
       in ~0.4 ms, <5% of the gemm they feed), and extra OpenMP regions measured slower on
       these 2 shared cores than the conversion they would split. */
    const ampc_dtype_traits *h = ampc__dt(AMPC_F16);
    h->to_f32(ampc__data(a), a32, na);
    h->to_f32(ampc__data(b), b32, nb);
    if (bias) h->to_f32(ampc__data(bias), bias32, nbias);
    int rc = run_primitive(d, AMPC_F32, a32, b32, bias32, c32);
    if (rc >= 0) h->from_f32(c32, ampc__data(c), nc);
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return rc;
}

static int cpu_gemm(const ampc_gemm_desc *desc, const ampc_tensor *a, const ampc_tensor *b, const ampc_tensor *bias,
                    ampc_tensor *c) {
    int rc = check_desc(desc, a, b, bias, c);
    if (rc < 0) return rc;
    if (c->dtype != AMPC_F32 && c->dtype != AMPC_F16 && c->dtype != AMPC_BF16)
        return ampc__err(AMPC_ERR_DTYPE, "gemm on %s tensors", ampc_dtype_name(c->dtype));
    ampc_gemm_desc d = normalize(desc);
    if (d.batch == 0 || d.M == 0 || d.N == 0) return AMPC_OK;
    if (d.K == 0) return fill_bias(&d, bias, c);
    /* both operands broadcast: every batch is the same product, computed once and copied */
    int64_t copies = 1, stride_c = d.stride_c;
    if (d.batch > 1 && d.stride_a == 0 && d.stride_b == 0) {
        copies = d.batch;
        d.batch = 1;
        d.stride_c = 0;
    }
    pthread_mutex_lock(&G.lock);
    if (c->dtype == AMPC_F16) rc = gemm_f16(&d, a, b, bias, c);
    else rc = run_primitive(&d, c->dtype, ampc__data(a), ampc__data(b), bias ? ampc__data(bias) : NULL, ampc__data(c));
    pthread_mutex_unlock(&G.lock);
    size_t mat = (size_t)(d.M * d.N) * ampc__dt(c->dtype)->size;
    for (int64_t i = 1; i < copies && rc >= 0; i++)
        memcpy((char *)ampc__data(c) + (size_t)(i * stride_c) * ampc__dt(c->dtype)->size, ampc__data(c), mat);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Introspection and registration

int ampc__cpu_gemm_impl(const ampc_gemm_desc *desc, ampc_dtype dt, bool has_bias, char *buf, size_t n) {
    ampc_gemm_desc d = normalize(desc);
    gemm_key k = make_key(&d, dt == AMPC_F16 ? AMPC_F32 : dt, has_bias);
    pthread_mutex_lock(&G.lock);
    gemm_entry *e = cache_get(&k);
    const char *name = NULL;
    int rc = e ? AMPC_OK : ampc_last_status();
    if (e && dnnl_primitive_desc_query(e->pd, dnnl_query_impl_info_str, 0, &name) != dnnl_success) name = NULL;
    snprintf(buf, n, "%s", name ? name : "?");
    pthread_mutex_unlock(&G.lock);
    return rc;
}

void ampc__cpu_register_gemm(ampc_backend *be) {
    be->gemm = cpu_gemm;
    be->shutdown = gemm_shutdown;
}
