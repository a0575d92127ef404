/*
 * gemm.c - matmul on cuBLASLt: C[b] = op(A[b]) @ op(B[b]) (+ bias over columns), row-major as
 * backend.h says. cuBLASLt is column-major, so the product is computed transposed:
 * C^T (N x M, column-major, which is C row-major) = op(B)^T @ op(A)^T, with our B as its first
 * operand and our A as its second, and the bias added per row of C^T by the BIAS epilogue.
 * f16/bf16 run on tensor cores with f32 accumulation (CUBLAS_COMPUTE_32F) and one rounding of
 * the result (or none: D may be f32, the unrounded accumulator of an autocast weight
 * gradient); f32 runs in full f32 unless ampc_set_allow_tf32(true) (CUBLAS_COMPUTE_32F_FAST_TF32).
 * A plan (descriptors, layouts, the heuristic's algorithm) is made once per shape and kept.
 */
#include "backend/cuda/cuda.h"

#include <cublasLt.h>
#include <pthread.h>
#include <string.h>

#define WORKSPACE_BYTES (32u << 20)   /* what NVIDIA recommends for Hopper */
#define PLANS 256

typedef struct {
    int64_t batch, M, N, K, sa, sb, sc;
    int ta, tb, in_dt, out_dt, has_bias, tf32;
    uint32_t align_a, align_b, align_c;   /* bytes every matrix of the operand starts at a multiple of (<= 256) */
    uint32_t zero;                        /* 0: the struct has no padding (keys compare with memcmp) */
} plan_key;

typedef struct {
    bool used;
    plan_key key;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
    size_t ws;
} plan;

static struct {
    pthread_once_t once;
    cublasStatus_t status;
    cublasLtHandle_t lt;
    pthread_mutex_t lock;
    plan plans[PLANS];
    int nplans;
} L = {.once = PTHREAD_ONCE_INIT, .lock = PTHREAD_MUTEX_INITIALIZER};

static void lt_start(void) { L.status = cublasLtCreate(&L.lt); }

static int lt_check(cublasStatus_t s, const char *what) {
    if (s == CUBLAS_STATUS_SUCCESS) return AMPC_OK;
    return ampc__err(s == CUBLAS_STATUS_ALLOC_FAILED ? AMPC_ERR_OOM : AMPC_ERR_BACKEND, "cuBLASLt: %s: status %d", what, (int)s);
}

static cudaDataType_t cuda_type(ampc_dtype dt) {
    return dt == AMPC_F16 ? CUDA_R_16F : dt == AMPC_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

/* Column-major layout of rows x cols (ld = rows), batch strided. */
static cublasStatus_t layout(cublasLtMatrixLayout_t *l, ampc_dtype dt, int64_t rows, int64_t cols, int64_t batch, int64_t stride) {
    cublasStatus_t s = cublasLtMatrixLayoutCreate(l, cuda_type(dt), (uint64_t)rows, (uint64_t)cols, rows);
    if (s == CUBLAS_STATUS_SUCCESS && batch > 1) {
        int32_t bc = (int32_t)batch;
        s = cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride);
    }
    return s;
}

static void plan_destroy(plan *p) {
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
    memset(p, 0, sizeof *p);
}

/* Makes the plan for k (descriptors + the heuristic's first algorithm). */
static int plan_make(plan *p, const plan_key *k, const void *bias_ptr) {
    memset(p, 0, sizeof *p);
    p->key = *k;
    cublasComputeType_t ct = k->in_dt == AMPC_F32 && k->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    cublasStatus_t s = cublasLtMatmulDescCreate(&p->op, ct, CUDA_R_32F);
    /* cuBLASLt's A is our B, its B our A (see the top) */
    cublasOperation_t opa = k->tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = k->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (!s) s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
    if (!s) s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
    if (!s && k->has_bias) {
        cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
        cudaDataType_t bt = cuda_type((ampc_dtype)k->out_dt);
        s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep);
        if (!s) s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr, sizeof bias_ptr);
        if (!s) s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt);
    }
    /* our B: (K, N) row-major = (N, K) column-major; transposed (tb): (K, N) column-major */
    if (!s) s = layout(&p->la, (ampc_dtype)k->in_dt, k->tb ? k->K : k->N, k->tb ? k->N : k->K, k->batch, k->sb);
    /* our A: (M, K) row-major = (K, M) column-major; transposed (ta): (M, K) column-major */
    if (!s) s = layout(&p->lb, (ampc_dtype)k->in_dt, k->ta ? k->M : k->K, k->ta ? k->K : k->M, k->batch, k->sa);
    if (!s) s = layout(&p->lc, (ampc_dtype)k->out_dt, k->N, k->M, k->batch, k->sc);
    cublasLtMatmulPreference_t pref = NULL;
    size_t ws = WORKSPACE_BYTES;
    if (!s) s = cublasLtMatmulPreferenceCreate(&pref);
    if (!s) s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    /* algorithms that work on operands aligned as these are (cuBLASLt assumes 256 bytes; parts
       of tensors, as attention's blocks of rows, may start anywhere); its A is our B */
    if (!s) s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &k->align_b, sizeof k->align_b);
    if (!s) s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &k->align_a, sizeof k->align_a);
    if (!s) s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &k->align_c, sizeof k->align_c);
    if (!s) s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &k->align_c, sizeof k->align_c);
    cublasLtMatmulHeuristicResult_t r;
    int found = 0;
    if (!s) s = cublasLtMatmulAlgoGetHeuristic(L.lt, p->op, p->la, p->lb, p->lc, p->lc, pref, 1, &r, &found);
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (!s && !found) s = CUBLAS_STATUS_NOT_SUPPORTED;
    if (s) {
        plan_destroy(p);
        return lt_check(s, "no algorithm for this matmul");
    }
    p->algo = r.algo;
    p->ws = r.workspaceSize;
    p->used = true;
    return AMPC_OK;
}

/* The alignment every matrix of a strided batch starting at p keeps: the lowest set bit of the
   address and of the batch stride in bytes, at most 256 */
static uint32_t alignment(const void *p, int64_t stride, size_t es) {
    uint64_t v = (uint64_t)(uintptr_t)p | (stride ? (uint64_t)stride * es : 0) | 256u;
    return (uint32_t)(v & (~v + 1));
}

/* C = alpha op(A) op(B) (+ bias) + beta C on raw device pointers (in_dt operands, out_dt C) */
static int gemm_raw(const ampc_gemm_desc *d, ampc_dtype in_dt, ampc_dtype out_dt, const void *a, const void *b, const void *bias,
                    void *c, float alpha, float beta) {
    int rc = ampc__cu_ready();
    if (rc < 0) return rc;
    pthread_once(&L.once, lt_start);
    if ((rc = lt_check(L.status, "cublasLtCreate")) < 0) return rc;
    const size_t ies = ampc_dtype_size(in_dt), oes = ampc_dtype_size(out_dt);
    plan_key k = {d->batch, d->M, d->N, d->K, d->stride_a, d->stride_b, d->stride_c, d->ta, d->tb,
                  in_dt, out_dt, bias != NULL, ampc_allow_tf32(), alignment(a, d->batch > 1 ? d->stride_a : 0, ies),
                  alignment(b, d->batch > 1 ? d->stride_b : 0, ies), alignment(c, d->batch > 1 ? d->stride_c : 0, oes), 0};
    pthread_mutex_lock(&L.lock);
    plan *p = NULL;
    for (int i = 0; i < L.nplans && !p; i++)
        if (!memcmp(&L.plans[i].key, &k, sizeof k)) p = &L.plans[i];
    if (!p) {
        p = &L.plans[L.nplans < PLANS ? L.nplans++ : (int)(((unsigned)d->M * 31u + (unsigned)d->N) % PLANS)];
        if (p->used) plan_destroy(p);
        rc = plan_make(p, &k, bias);   /* plan_key has no padding: keys compare with memcmp */
    }
    cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
    if (rc >= 0 && bias) s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
    size_t wb = 0;
    void *ws = NULL;
    if (rc >= 0 && !s && p->ws && !(ws = ampc__cu_scratch(p->ws, &wb))) rc = ampc_last_status();
    if (rc >= 0 && !s)
        s = cublasLtMatmul(L.lt, p->op, &alpha, b, p->la, a, p->lb, &beta, c, p->lc, c, p->lc, &p->algo, ws, p->ws,
                           ampc__cu_stream());
    pthread_mutex_unlock(&L.lock);
    ampc__cu_scratch_free(ws, wb);
    if (rc < 0) return rc;
    return lt_check(s, "cublasLtMatmul");
}

int ampc__cu_gemm_ptr(const ampc_gemm_desc *d, ampc_dtype in_dt, ampc_dtype out_dt, const void *a, const void *b, void *c,
                      float alpha, float beta) {
    if (d->batch <= 0 || d->M <= 0 || d->N <= 0 || d->K <= 0)
        return ampc__err(AMPC_ERR_INVALID, "cuda gemm: an empty product (%lld x %lld x %lld, batch %lld)", (long long)d->M,
                         (long long)d->N, (long long)d->K, (long long)d->batch);
    return gemm_raw(d, in_dt, out_dt, a, b, NULL, c, alpha, beta);
}

static int cu_gemm(const ampc_gemm_desc *d, const ampc_tensor *a, const ampc_tensor *b, const ampc_tensor *bias, ampc_tensor *c) {
    int rc = ampc__cu_ready();
    if (rc < 0) return rc;
    if (c->numel == 0) return AMPC_OK;
    if (d->K == 0) return ampc__device(AMPC_DEVICE_CUDA)->fill(c, 0.0);   /* an empty sum (bias aside) */
    return gemm_raw(d, a->dtype, c->dtype, ampc__data(a), ampc__data(b), bias ? ampc__data(bias) : NULL, ampc__data(c), 1.0f,
                    0.0f);
}

void ampc__cuda_register_gemm(ampc_backend *be) { be->gemm = cu_gemm; }
