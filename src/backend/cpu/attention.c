/*
 * attention.c - CPU kernels of scaled-dot-product attention, one head per thread, in blocks of
 * query rows (flash attention's scheme with blocks of rows instead of tiles): for a block of R
 * query rows the scores S = q k^T * scale against the keys the block sees (causal: up to its
 * last row) and the output P v are oneDNN sgemms, the softmax between them a pass over each row
 * with a vectorized exp (cpu.h). The forward saves each row's log-sum-exp; the backward recomputes each
 * block's probabilities from it (nothing of T x T size is kept between the passes, only one
 * block's R x T workspace per thread):
 *     P = exp(S - lse); Pd = P keep / (1 - p); dv += Pd^T do; dP = (do v^T) keep / (1 - p);
 *     dS = P (dP - rowsum(do o)); dmask = dS; dq = dS k scale; dk += dS^T q scale.
 * The additive mask is added to each row of scores before its softmax; dropout's keep decisions
 * are the Philox draws (b Tq + i) Tk + j (random.c), made again by the backward.
 * Every head's q, k, v (and o, do) are staged to f32 once. oneDNN's gemm runs single-threaded
 * inside each thread, so a head's sums come in one order whatever the thread count.
 */
#include "backend/cpu/cpu.h"
#include "backend/cpu/dnnl_cache.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#define ROWS 128   /* query rows per block */

/* Rows [r0, r0 + n) of t (rows of `width` elements) as f32 into dst. */
static void stage(const ampc_tensor *t, int64_t r0, int64_t n, int64_t width, float *dst) {
    const ampc_dtype_traits *tr = ampc__dt(t->dtype);
    tr->to_f32((const char *)ampc__data(t) + (size_t)(r0 * width) * tr->size, dst, (size_t)(n * width));
}
static void unstage(ampc_tensor *t, int64_t r0, int64_t n, int64_t width, const float *src) {
    const ampc_dtype_traits *tr = ampc__dt(t->dtype);
    tr->from_f32(src, (char *)ampc__data(t) + (size_t)(r0 * width) * tr->size, (size_t)(n * width));
}

/* Keys query i sees: [0, keys_of(i)) */
static int64_t keys_of(const ampc_attn_desc *d, int64_t i) { return d->causal ? (i + 1 < d->Tk ? i + 1 : d->Tk) : d->Tk; }

/* C (M x N, row-major, ldc) = alpha op(A) op(B) + beta C: oneDNN's sgemm, row-major ('N'/'T'). */
static void sgemm(char ta, char tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const float *B,
                  int64_t ldb, float beta, float *C, int64_t ldc) {
    if (M == 0 || N == 0) return;
    dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* s[j] += m[j sj] for the nj keys a row sees (sj 0: one value for the row) */
AMPC_CPU_VEC static void add_mask_row(float *s, const float *m, int64_t sj, int64_t nj) {
    if (sj == 1) {
#pragma omp simd
        for (int64_t j = 0; j < nj; j++) s[j] += m[j];
    } else {
        for (int64_t j = 0; j < nj; j++) s[j] += m[j * sj];
    }
}

/* A row of kn scores, of which the first nj are seen: the probabilities in place (0 past nj);
   returns the row's log-sum-exp (-inf, and a row of 0, when it sees no key or every key it sees
   is masked by -inf). */
AMPC_CPU_VEC static float softmax_row(float *s, int64_t nj, int64_t kn) {
    float m = -INFINITY, l = 0.0f;
    for (int64_t j = 0; j < nj; j++) m = s[j] > m ? s[j] : m;
    if (m == -INFINITY) {
        memset(s, 0, (size_t)kn * sizeof *s);
        return -INFINITY;
    }
#pragma omp simd reduction(+ : l)
    for (int64_t j = 0; j < nj; j++) {
        s[j] = ampc__cpu_exp(s[j] - m);
        l += s[j];
    }
    const float inv = 1.0f / l;
#pragma omp simd
    for (int64_t j = 0; j < kn; j++) s[j] = j < nj ? s[j] * inv : 0.0f;
    return m + logf(l);
}

/* The probabilities of a row of scores from its log-sum-exp lse (0 past nj, and for a row that
   saw no key). */
AMPC_CPU_VEC static void probs_row(float *p, int64_t nj, int64_t kn, float lse) {
#pragma omp simd
    for (int64_t j = 0; j < kn; j++) p[j] = j < nj && lse > -INFINITY ? ampc__cpu_exp(p[j] - lse) : 0.0f;
}

/* y = x keep f (f = 1 / (1 - p)): a row through dropout's decisions; y may be x */
AMPC_CPU_VEC static void drop_row(const float *x, const uint8_t *keep, int64_t n, float f, float *y) {
#pragma omp simd
    for (int64_t j = 0; j < n; j++) y[j] = keep[j] ? x[j] * f : 0.0f;
}

/* dS = P (dP - D), in place of P */
AMPC_CPU_VEC static void dscores_row(float *p, const float *dp, int64_t kn, float D) {
#pragma omp simd
    for (int64_t j = 0; j < kn; j++) p[j] = p[j] * (dp[j] - D);
}

static float drop_factor(double p) { return p < 1.0 ? (float)(1.0 / (1.0 - p)) : 0.0f; }

/* Threads for batch heads of work w each, and a workspace of `per` floats each (NULL + error). */
static float *workspace(const ampc_attn_desc *d, size_t per, int *nt, size_t *block) {
    *nt = ampc__threads_for(d->batch * d->Tq * d->Tk * (d->E + d->Ev));
    if (*nt > d->batch) *nt = (int)d->batch;
    return ampc__alloc(AMPC_DEVICE_CPU, (size_t)*nt * per * sizeof(float), AMPC_MEM_WORKSPACE, block);
}

static int cpu_attention(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                         const ampc_tensor *mask, ampc_tensor *o, ampc_tensor *lse) {
    const int64_t Tq = d->Tq, Tk = d->Tk, E = d->E, Ev = d->Ev, R = Tq < ROWS ? Tq : ROWS;
    if (d->batch == 0 || Tq == 0) return AMPC_OK;
    const float scale = (float)d->scale, fdrop = drop_factor(d->dropout);
    const bool drop = d->dropout > 0;
    /* per thread: q, k, v, o staged, a block's scores, a row's keep bytes */
    const size_t per = (size_t)(Tq * E + Tk * E + Tk * Ev + Tq * Ev + R * Tk + (Tk + 3) / 4);
    int nt;
    size_t block = 0;
    float *ws = workspace(d, per, &nt, &block);
    if (!ws) return ampc_last_status();
    float *L = lse ? ampc__data(lse) : NULL;
    const float *M = mask ? ampc__data(mask) : NULL;
#pragma omp parallel num_threads(nt)
    {
        omp_set_num_threads(1);   /* oneDNN's gemm below: on this thread alone */
        float *qs = ws + (size_t)omp_get_thread_num() * per, *ks = qs + Tq * E, *vs = ks + Tk * E, *os = vs + Tk * Ev, *S = os + Tq * Ev;
        uint8_t *keep = (uint8_t *)(S + R * Tk);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < d->batch; b++) {
            const float *Mb = M ? M + ampc__attn_mask_offset(d, b) : NULL;
            stage(q, b * Tq, Tq, E, qs);
            stage(k, b * Tk, Tk, E, ks);
            stage(v, b * Tk, Tk, Ev, vs);
            for (int64_t i0 = 0; i0 < Tq; i0 += R) {
                const int64_t n = Tq - i0 < R ? Tq - i0 : R, kn = keys_of(d, i0 + n - 1);
                sgemm('N', 'T', n, kn, E, scale, qs + i0 * E, E, ks, E, 0.0f, S, kn);
                for (int64_t r = 0; r < n; r++) {
                    const int64_t i = i0 + r, nj = keys_of(d, i);
                    float *s = S + r * kn;
                    if (Mb) add_mask_row(s, Mb + i * d->mask_si, d->mask_sj, nj);
                    const float lse_r = softmax_row(s, nj, kn);
                    if (L) L[b * Tq + i] = lse_r;
                    if (drop) {
                        ampc__cpu_dropout_keep(d->rng, (uint64_t)((b * Tq + i) * Tk), (size_t)kn, d->dropout, keep);
                        drop_row(s, keep, kn, fdrop, s);
                    }
                }
                sgemm('N', 'N', n, Ev, kn, 1.0f, S, kn, vs, Ev, 0.0f, os + i0 * Ev, Ev);
            }
            unstage(o, b * Tq, Tq, Ev, os);
        }
    }
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return AMPC_OK;
}

static int cpu_attention_backward(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                                  const ampc_tensor *mask, const ampc_tensor *o, const ampc_tensor *lse, const ampc_tensor *dout,
                                  ampc_tensor *dq, ampc_tensor *dk, ampc_tensor *dv, ampc_tensor *dmask) {
    const int64_t Tq = d->Tq, Tk = d->Tk, E = d->E, Ev = d->Ev, R = Tq < ROWS ? Tq : ROWS;
    if (d->batch == 0) return AMPC_OK;
    const float scale = (float)d->scale, fdrop = drop_factor(d->dropout);
    const bool drop = d->dropout > 0;
    /* per thread: q, k, v, o, do staged, the gradients dq, dk, dv, a block's P and dP, the rows'
       D; with dropout a block's dropped P and its keep bytes */
    const size_t per = (size_t)(2 * Tq * E + 2 * Tk * E + 2 * Tk * Ev + 2 * Tq * Ev + 2 * R * Tk + Tq) +
                       (drop ? (size_t)(R * Tk + (R * Tk + 3) / 4) : 0);
    int nt;
    size_t block = 0;
    float *ws = workspace(d, per, &nt, &block);
    if (!ws) return ampc_last_status();
    const float *L = ampc__data(lse), *M = mask ? ampc__data(mask) : NULL;
    float *GM = dmask ? ampc__data(dmask) : NULL;
#pragma omp parallel num_threads(nt)
    {
        omp_set_num_threads(1);
        float *qs = ws + (size_t)omp_get_thread_num() * per, *ks = qs + Tq * E, *vs = ks + Tk * E, *os = vs + Tk * Ev;
        float *gs = os + Tq * Ev, *gq = gs + Tq * Ev, *gk = gq + Tq * E, *gv = gk + Tk * E, *P = gv + Tk * Ev, *dP = P + R * Tk;
        float *D = dP + R * Tk, *Pd = drop ? D + Tq : NULL;
        uint8_t *keep = drop ? (uint8_t *)(Pd + R * Tk) : NULL;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < d->batch; b++) {
            const float *Mb = M ? M + ampc__attn_mask_offset(d, b) : NULL;
            stage(q, b * Tq, Tq, E, qs);
            stage(k, b * Tk, Tk, E, ks);
            stage(v, b * Tk, Tk, Ev, vs);
            stage(o, b * Tq, Tq, Ev, os);
            stage(dout, b * Tq, Tq, Ev, gs);
            memset(gk, 0, (size_t)(Tk * E + Tk * Ev) * sizeof(float));
            for (int64_t i = 0; i < Tq; i++) {
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t e = 0; e < Ev; e++) s += gs[i * Ev + e] * os[i * Ev + e];
                D[i] = s;
            }
            for (int64_t i0 = 0; i0 < Tq; i0 += R) {
                const int64_t n = Tq - i0 < R ? Tq - i0 : R, kn = keys_of(d, i0 + n - 1);
                sgemm('N', 'T', n, kn, E, scale, qs + i0 * E, E, ks, E, 0.0f, P, kn);
                for (int64_t r = 0; r < n; r++) {
                    const int64_t i = i0 + r, nj = keys_of(d, i);
                    if (Mb) add_mask_row(P + r * kn, Mb + i * d->mask_si, d->mask_sj, nj);
                    probs_row(P + r * kn, nj, kn, L[b * Tq + i]);
                    if (drop) {
                        ampc__cpu_dropout_keep(d->rng, (uint64_t)((b * Tq + i) * Tk), (size_t)kn, d->dropout, keep + r * kn);
                        drop_row(P + r * kn, keep + r * kn, kn, fdrop, Pd + r * kn);
                    }
                }
                sgemm('T', 'N', kn, Ev, n, 1.0f, drop ? Pd : P, kn, gs + i0 * Ev, Ev, 1.0f, gv, Ev);   /* dv += Pd^T do */
                sgemm('N', 'T', n, kn, Ev, 1.0f, gs + i0 * Ev, Ev, vs, Ev, 0.0f, dP, kn);              /* dP = do v^T */
                for (int64_t r = 0; r < n; r++) {
                    if (drop) drop_row(dP + r * kn, keep + r * kn, kn, fdrop, dP + r * kn);
                    dscores_row(P + r * kn, dP + r * kn, kn, D[i0 + r]);
                    if (GM) {
                        float *g = GM + (b * Tq + i0 + r) * Tk;
                        memcpy(g, P + r * kn, (size_t)kn * sizeof *g);
                        memset(g + kn, 0, (size_t)(Tk - kn) * sizeof *g);
                    }
                }
                sgemm('N', 'N', n, E, kn, scale, P, kn, ks, E, 0.0f, gq + i0 * E, E);       /* dq = dS k scale */
                sgemm('T', 'N', kn, E, n, scale, P, kn, qs + i0 * E, E, 1.0f, gk, E);       /* dk += dS^T q scale */
            }
            unstage(dq, b * Tq, Tq, E, gq);
            unstage(dk, b * Tk, Tk, E, gk);
            unstage(dv, b * Tk, Tk, Ev, gv);
        }
    }
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return AMPC_OK;
}

void ampc__cpu_register_attention(ampc_backend *be) {
    be->attention = cpu_attention;
    be->attention_backward = cpu_attention_backward;
}
