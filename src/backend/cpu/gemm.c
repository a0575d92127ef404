/*
 * gemm.c - CPU gemm on oneDNN's matmul primitive (C API).
 *
 * C[b] = op(A[b]) @ op(B[b]) (+ bias) becomes one matmul primitive whose memory descriptors
 * carry the layout: transposes are strides, batches are 3-D descriptors, a broadcast operand
 * has batch dim 1 (oneDNN takes that; a 0 stride would fall back to its slow reference code).
 * f32 and bf16 run natively (bf16 in, bf16 out, f32 accumulation: the avx512_core_bf16
 * brgemm kernels). oneDNN 2.6 has no f16 matmul on CPU, so f16 operands are widened to f32
 * workspace copies, multiplied in f32 and the result rounded once to f16 - what tensor cores
 * do (f16 inputs, f32 accumulation, one rounding).
 * A 16-bit product may also be written to an f32 C without rounding (bf16: oneDNN's bf16
 * kernels with an f32 destination): autocast's weight gradients go straight into the fp32
 * master's dtype instead of being rounded to 16 bits and widened again by the cast's backward.
 *
 * Gemms with one small dimension (a classifier head) run gemm_skinny.c's AVX-512 kernels
 * instead, where the CPU has them.
 *
 * Primitives live in the shared oneDNN cache (dnnl_cache.h) keyed by shape, layout, dtype and
 * thread count, so a steady-state call does no malloc.
 */
#include "backend/backend.h"
#include "backend/cpu/cpu.h"
#include "backend/cpu/dnnl_cache.h"

#include <omp.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Primitive cache key

/* Everything that makes two calls need different primitives. Zero-initialised with memset
   before filling, so it can be compared bytewise. */
typedef struct {
    dnnl_data_type_t dt, dst_dt;
    int64_t batch, M, N, K;
    int64_t stride_a, stride_b, stride_c;   /* 0: broadcast operand (batch dim 1) */
    int32_t ta, tb, has_bias, nthr;         /* nthr: oneDNN sizes blocking and scratchpad by it */
    int32_t slot;                           /* ampc__cpu_gemm_entry's: one primitive per thread */
} gemm_key;

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

/* Builds the matmul primitive descriptor for key k; arguments: src, weights, dst[, bias]. */
static int build_matmul(ampc_dnnl_entry *e, const void *key) {
    const gemm_key *k = key;
    int rc = AMPC_OK;
    bool batched = k->batch > 1;
    dnnl_memory_desc_t a, b, c, bias;
    AMPC_DNNL_TRY(operand_md(&a, k->dt, k->batch, k->stride_a, k->M, k->K, k->ta), "src descriptor");
    AMPC_DNNL_TRY(operand_md(&b, k->dt, k->batch, k->stride_b, k->K, k->N, k->tb), "weights descriptor");
    AMPC_DNNL_TRY(operand_md(&c, k->dst_dt, k->batch, k->stride_c, k->M, k->N, false), "dst descriptor");
    if (k->has_bias) {   /* (1, N) or (1, 1, N): one row added to every output row */
        dnnl_dims_t dims = {1, 1, k->N}, strides = {k->N, k->N, 1};
        int nd = batched ? 3 : 2;
        if (!batched) dims[1] = k->N, strides[1] = 1;
        AMPC_DNNL_TRY(dnnl_memory_desc_init_by_strides(&bias, nd, dims, k->dt, strides), "bias descriptor");
    }
    dnnl_matmul_desc_t op;
    AMPC_DNNL_TRY(dnnl_matmul_desc_init(&op, &a, &b, k->has_bias ? &bias : NULL, &c), "matmul_desc_init");
    AMPC_DNNL_TRY(dnnl_primitive_desc_create(&e->pd, &op, ampc__dnnl_attr(), ampc__dnnl_engine(), NULL),
                  "matmul primitive_desc_create");
    if ((rc = ampc__dnnl_add_arg(e, DNNL_ARG_SRC, &a)) < 0 || (rc = ampc__dnnl_add_arg(e, DNNL_ARG_WEIGHTS, &b)) < 0 ||
        (rc = ampc__dnnl_add_arg(e, DNNL_ARG_DST, &c)) < 0)
        return rc;
    if (k->has_bias) return ampc__dnnl_add_arg(e, DNNL_ARG_BIAS, &bias);
    return AMPC_OK;
fail:
    return rc;
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

// ---------------------------------------------------------------------------------------------
// Kernel

static gemm_key make_key(const ampc_gemm_desc *d, ampc_dtype dt, ampc_dtype dst_dt, bool has_bias) {
    gemm_key k;
    memset(&k, 0, sizeof k);
    k.dt = ampc__dnnl_dt(dt);
    k.dst_dt = ampc__dnnl_dt(dst_dt);
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
static int run_primitive(const ampc_gemm_desc *d, ampc_dtype dt, ampc_dtype dst_dt, const void *a, const void *b,
                         const void *bias, void *c) {
    gemm_key k = make_key(d, dt, dst_dt, bias != NULL);
    ampc_dnnl_entry *e = ampc__dnnl_get(AMPC_DNNL_MATMUL, &k, sizeof k, build_matmul);
    if (!e) return ampc_last_status();
    void *handles[4] = {(void *)a, (void *)b, c, (void *)bias};
    return ampc__dnnl_run(e, handles);
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

/* Widens 16-bit operands (f16; bf16 where oneDNN has no bf16 kernels) to f32 workspace, runs
   the f32 primitive, rounds the result once (an f32 c gets the result unrounded, with no
   workspace for it). */
static int gemm_via_f32(const ampc_gemm_desc *d, const ampc_tensor *a, const ampc_tensor *b, const ampc_tensor *bias,
                    ampc_tensor *c) {
    bool wide_out = c->dtype == AMPC_F32;
    size_t na = extent(d->batch, d->stride_a, d->M, d->K), nb = extent(d->batch, d->stride_b, d->K, d->N);
    size_t nc = wide_out ? 0 : extent(d->batch, d->stride_c, d->M, d->N), nbias = bias ? (size_t)d->N : 0;
    size_t bytes = (na + nb + nc + nbias) * sizeof(float), block = 0;
    float *ws = ampc__alloc(AMPC_DEVICE_CPU, bytes, AMPC_MEM_WORKSPACE, &block);
    if (!ws) return ampc_last_status();
    float *a32 = ws, *b32 = a32 + na, *c32 = wide_out ? (float *)ampc__data(c) : b32 + nb;
    float *bias32 = bias ? b32 + nb + nc : NULL;
    /* Single-threaded on purpose: the vectorized conversions run near memory speed (4M values
       in ~0.4 ms, <5% of the gemm they feed), and extra OpenMP regions measured slower on
       these 2 shared cores than the conversion they would split. */
    const ampc_dtype_traits *h = ampc__dt(a->dtype);
    h->to_f32(ampc__data(a), a32, na);
    h->to_f32(ampc__data(b), b32, nb);
    if (bias) h->to_f32(ampc__data(bias), bias32, nbias);
    int rc = run_primitive(d, AMPC_F32, AMPC_F32, a32, b32, bias32, c32);
    if (rc >= 0 && !wide_out) ampc__dt(c->dtype)->from_f32(c32, ampc__data(c), nc);
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return rc;
}

static int cpu_gemm(const ampc_gemm_desc *desc, const ampc_tensor *a, const ampc_tensor *b, const ampc_tensor *bias,
                    ampc_tensor *c) {
    ampc_gemm_desc d = normalize(desc);
    if (d.batch == 0 || d.M == 0 || d.N == 0) return AMPC_OK;
    if (d.K == 0) return fill_bias(&d, bias, c);
    if (ampc__cpu_gemm_skinny_takes(&d, a->dtype, NULL)) return ampc__cpu_gemm_skinny_run(&d, a, b, bias, c);
    /* both operands broadcast: every batch is the same product, computed once and copied */
    int64_t copies = 1, stride_c = d.stride_c;
    if (d.batch > 1 && d.stride_a == 0 && d.stride_b == 0) {
        copies = d.batch;
        d.batch = 1;
        d.stride_c = 0;
    }
    int rc;
    ampc__dnnl_lock();
    if (ampc__dnnl_via_f32(a->dtype)) rc = gemm_via_f32(&d, a, b, bias, c);
    else rc = run_primitive(&d, a->dtype, c->dtype, ampc__data(a), ampc__data(b), bias ? ampc__data(bias) : NULL, ampc__data(c));
    ampc__dnnl_unlock();
    size_t mat = (size_t)(d.M * d.N) * ampc__dt(c->dtype)->size;
    for (int64_t i = 1; i < copies && rc >= 0; i++)
        memcpy((char *)ampc__data(c) + (size_t)(i * stride_c) * ampc__dt(c->dtype)->size, ampc__data(c), mat);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Introspection and registration

int ampc__cpu_gemm_impl(const ampc_gemm_desc *desc, ampc_dtype dt, bool has_bias, char *buf, size_t n) {
    ampc_gemm_desc d = normalize(desc);
    const char *skinny;
    if (ampc__cpu_gemm_skinny_takes(&d, dt, &skinny)) {
        snprintf(buf, n, "%s", skinny);
        return AMPC_OK;
    }
    ampc_dtype kdt = ampc__dnnl_compute_dt(dt);
    gemm_key k = make_key(&d, kdt, kdt, has_bias);
    ampc__dnnl_lock();
    ampc_dnnl_entry *e = ampc__dnnl_get(AMPC_DNNL_MATMUL, &k, sizeof k, build_matmul);
    snprintf(buf, n, "%s", e ? ampc__dnnl_impl(e) : "?");
    ampc__dnnl_unlock();
    return e ? AMPC_OK : ampc_last_status();
}

ampc_dnnl_entry *ampc__cpu_gemm_entry(const ampc_gemm_desc *desc, ampc_dtype dt, ampc_dtype dst_dt, int slot) {
    ampc_gemm_desc d = normalize(desc);
    gemm_key k = make_key(&d, dt, dst_dt, false);
    k.slot = slot + 1;
    return ampc__dnnl_get(AMPC_DNNL_MATMUL, &k, sizeof k, build_matmul);
}

void ampc__cpu_register_gemm(ampc_backend *be) {
    be->gemm = cpu_gemm;
    be->device.shutdown = ampc__dnnl_shutdown;
}
