/*
 * attention.c - the CUDA table's scaled-dot-product attention: for each block of R query rows of
 * every head at once, the products on cuBLASLt (batched over the heads by strides; f16/bf16 on
 * tensor cores with f32 accumulation) and the row passes in attention.cu. Semantics are the CPU
 * backend's (src/backend/cpu/attention.c), whose bf16 route this mirrors:
 *   forward:  S = q k^T (f32); P = softmax(S scale + mask) through dropout (q's dtype); o = P v
 *   backward: S = q k^T; P = exp(S scale + mask - lse) (f32) and P through dropout (q's dtype);
 *             dv += Pd^T do and dk += dS^T q scale (f32 accumulators); dP = do v^T (f32);
 *             dS = P (dP - rowsum(P dP)) (q's dtype, and f32 into dmask); dq = dS k scale.
 * A block holds every key its rows see, so rowsum(P dP) comes from the row itself. The
 * workspace holds one block of rows for every head (R shrinks so that it stays under 256 MiB);
 * nothing of T x T size outlives a call. Not flash attention's fused kernel: the scores go
 * through global memory between the products, so this is the correct baseline a fused kernel
 * (cuDNN's or ampc's own) is to beat.
 */
#include "backend/cuda/cuda.h"
#include "backend/cuda/ew_kernels.h"

#include <math.h>
#include <string.h>

#define ROWS 128                      /* query rows per block at most */
#define WORKSPACE_CAP (256u << 20)    /* bytes of block workspace at most */

/* Query rows per block: ROWS, fewer when a block of every head would pass the cap */
static int64_t rows_per_block(const ampc_attn_desc *d, size_t per_score) {
    int64_t R = d->Tq < ROWS ? d->Tq : ROWS;
    const double row_bytes = (double)d->batch * (double)d->Tk * (double)per_score;
    while (R > 1 && row_bytes * (double)R > WORKSPACE_CAP) R = R > 16 ? (R / 2 + 15) / 16 * 16 : R / 2;
    return R > 0 ? R : 1;
}

/* The row passes' view of block [i0, i0 + n) */
static ampc_cu_attn_rows rows_of(const ampc_attn_desc *d, int64_t i0, int64_t n, int64_t kn) {
    ampc_cu_attn_rows a;
    memset(&a, 0, sizeof a);
    a.batch = d->batch, a.Tq = d->Tq, a.Tk = d->Tk, a.i0 = i0, a.n = n, a.kn = kn;
    a.causal = d->causal, a.scale = (float)d->scale;
    if (d->dropout > 0) {
        a.drop_thr = ampc__dropout_threshold(d->dropout);
        a.drop_factor = ampc__dropout_scale(d->dropout);
        a.seed = d->rng.seed, a.offset = d->rng.offset;
    }
    a.nlead = d->nlead;
    memcpy(a.lead, d->lead, sizeof a.lead);
    memcpy(a.mask_lead, d->mask_lead, sizeof a.mask_lead);
    a.mask_si = d->mask_si, a.mask_sj = d->mask_sj;
    return a;
}

/* C = alpha op(A) op(B) + beta C batched over the heads; an empty sum (K 0) leaves beta C */
static int mm(const ampc_attn_desc *d, int64_t M, int64_t N, int64_t K, bool ta, bool tb, ampc_dtype in, ampc_dtype out,
              const void *a, int64_t sa, const void *b, int64_t sb, void *c, int64_t sc, float alpha, float beta) {
    if (M == 0 || N == 0) return AMPC_OK;
    if (K == 0) {
        if (beta != 0.0f) return AMPC_OK;
        size_t es = ampc_dtype_size(out);
        return ampc__cu_check(cudaMemset2DAsync(c, (size_t)sc * es, 0, (size_t)(M * N) * es, (size_t)d->batch, ampc__cu_stream()),
                              "attention");
    }
    ampc_gemm_desc g = {d->batch, M, N, K, ta, tb, sa, sb, sc};
    return ampc__cu_gemm_ptr(&g, in, out, a, b, c, alpha, beta);
}

static char *at(const ampc_tensor *t, int64_t elements) {
    return (char *)ampc__data(t) + (size_t)elements * ampc__dt(t->dtype)->size;
}

static int cu_attention(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                        const ampc_tensor *mask, ampc_tensor *o, ampc_tensor *lse) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    const int64_t Tq = d->Tq, Tk = d->Tk, E = d->E, Ev = d->Ev, H = d->batch;
    if (H == 0 || Tq == 0) return AMPC_OK;
    const ampc_dtype dt = q->dtype;
    const size_t es = ampc_dtype_size(dt);
    cudaStream_t s = ampc__cu_stream();
    if (Tk == 0) {   /* no key: o = 0, lse -inf */
        rc = ampc__cu_check(ampc_cu_fill(ampc__data(o), dt, o->numel, 0.0, s), "attention");
        if (rc >= 0 && lse) rc = ampc__cu_check(ampc_cu_fill(ampc__data(lse), AMPC_F32, lse->numel, -INFINITY, s), "attention");
        return rc;
    }
    const int64_t R = rows_per_block(d, 4 + es);
    size_t block = 0;
    float *S = ampc__cu_scratch((size_t)(H * R * Tk) * (4 + es), &block);
    if (!S) return ampc_last_status();
    void *P = S + H * R * Tk;
    const float *M = mask ? ampc__data(mask) : NULL;
    int64_t ko, vo;
    ampc__attn_offsets(d, &ko, &vo);
    for (int64_t i0 = 0; i0 < Tq && rc >= 0; i0 += R) {
        const int64_t n = Tq - i0 < R ? Tq - i0 : R, kn = ampc__attn_keys(d, i0 + n - 1);
        ampc_cu_attn_rows a = rows_of(d, i0, n, kn);
        rc = mm(d, n, kn, E, false, true, dt, AMPC_F32, at(q, i0 * E), Tq * E, at(k, ko), Tk * E, S, n * kn, 1.0f, 0.0f);
        if (rc >= 0)
            rc = ampc__cu_check(ampc_cu_attn_probs(&a, S, M, lse ? ampc__data(lse) : NULL, true, P, dt, s), "attention");
        if (rc >= 0)
            rc = mm(d, n, Ev, kn, false, false, dt, dt, P, n * kn, at(v, vo), Tk * Ev, at(o, i0 * Ev), Tq * Ev, 1.0f, 0.0f);
    }
    ampc__cu_scratch_free(S, block);
    return rc;
}

static int cu_attention_backward(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                                 const ampc_tensor *mask, const ampc_tensor *lse, const ampc_tensor *dout, ampc_tensor *dq,
                                 ampc_tensor *dk, ampc_tensor *dv, ampc_tensor *dmask) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    const int64_t Tq = d->Tq, Tk = d->Tk, E = d->E, Ev = d->Ev, H = d->batch;
    if (H == 0) return AMPC_OK;
    const ampc_dtype dt = q->dtype;
    const size_t es = ampc_dtype_size(dt);
    const bool wide = dt == AMPC_F32;   /* f32: dk and dv accumulate in place */
    cudaStream_t s = ampc__cu_stream();
    const int64_t R = rows_per_block(d, 8 + 2 * es);
    int64_t ko, vo;
    ampc__attn_offsets(d, &ko, &vo);
    /* workspace: S/P and dP (f32), P dropped and dS (dt) for a block; the f32 dk, dv sums */
    const size_t nblk = (size_t)(H * R * Tk), nacc = wide ? 0 : (size_t)(H * Tk * (E + Ev));
    size_t block = 0;
    float *S = ampc__cu_scratch(nblk * (8 + 2 * es) + nacc * 4 + 64, &block);
    if (!S) return ampc_last_status();
    float *dP = S + nblk, *ak = wide ? (float *)at(dk, ko) : dP + nblk, *av = wide ? (float *)at(dv, vo) : ak + H * Tk * E;
    char *Pd = (char *)(wide ? dP + nblk : av + H * Tk * Ev), *dS = Pd + nblk * es;
    rc = ampc__cu_check(cudaMemsetAsync(ak, 0, (size_t)(H * Tk * E) * 4, s), "attention_backward");
    if (rc >= 0) rc = ampc__cu_check(cudaMemsetAsync(av, 0, (size_t)(H * Tk * Ev) * 4, s), "attention_backward");
    if (rc >= 0 && Tk == 0 && Tq > 0) rc = ampc__cu_check(ampc_cu_fill(ampc__data(dq), dt, H * Tq * E, 0.0, s), "attention_backward");
    const float *M = mask ? ampc__data(mask) : NULL, scale = (float)d->scale;
    for (int64_t i0 = 0; i0 < Tq && Tk > 0 && rc >= 0; i0 += R) {
        const int64_t n = Tq - i0 < R ? Tq - i0 : R, kn = ampc__attn_keys(d, i0 + n - 1);
        ampc_cu_attn_rows a = rows_of(d, i0, n, kn);
        const void *qb = at(q, i0 * E), *gb = at(dout, i0 * Ev);
        rc = mm(d, n, kn, E, false, true, dt, AMPC_F32, qb, Tq * E, at(k, ko), Tk * E, S, n * kn, 1.0f, 0.0f);
        if (rc >= 0)
            rc = ampc__cu_check(ampc_cu_attn_probs(&a, S, M, (float *)ampc__data(lse), false, Pd, dt, s), "attention_backward");
        if (rc >= 0)   /* dv += Pd^T do */
            rc = mm(d, kn, Ev, n, true, false, dt, AMPC_F32, Pd, n * kn, gb, Tq * Ev, av, Tk * Ev, 1.0f, 1.0f);
        if (rc >= 0)   /* dP = do v^T */
            rc = mm(d, n, kn, Ev, false, true, dt, AMPC_F32, gb, Tq * Ev, at(v, vo), Tk * Ev, dP, n * kn, 1.0f, 0.0f);
        if (rc >= 0)
            rc = ampc__cu_check(ampc_cu_attn_dscores(&a, S, dP, dS, dt, dmask ? ampc__data(dmask) : NULL, s), "attention_backward");
        if (rc >= 0)   /* dq = dS k scale */
            rc = mm(d, n, E, kn, false, false, dt, dt, dS, n * kn, at(k, ko), Tk * E, at(dq, i0 * E), Tq * E, scale, 0.0f);
        if (rc >= 0)   /* dk += dS^T q scale */
            rc = mm(d, kn, E, n, true, false, dt, AMPC_F32, dS, n * kn, qb, Tq * E, ak, Tk * E, scale, 1.0f);
    }
    if (rc >= 0 && !wide) rc = ampc__cu_check(ampc_cu_convert(ak, AMPC_F32, at(dk, ko), dt, H * Tk * E, s), "attention_backward");
    if (rc >= 0 && !wide) rc = ampc__cu_check(ampc_cu_convert(av, AMPC_F32, at(dv, vo), dt, H * Tk * Ev, s), "attention_backward");
    ampc__cu_scratch_free(S, block);
    return rc;
}

void ampc__cuda_register_attention(ampc_backend *be) {
    be->attention = cu_attention;
    be->attention_backward = cu_attention_backward;
}
