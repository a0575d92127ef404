/*
 * attention.c - CPU kernels of scaled-dot-product attention, one head per thread, in blocks of
 * query rows (flash attention's scheme with blocks of rows instead of tiles): for a block of R
 * query rows the scores S = q k^T * scale against the keys the block sees (causal: up to its
 * last row) and the output P v are oneDNN sgemms, the softmax between them a pass over each row
 * with a vectorized exp (cpu.h). The forward saves each row's log-sum-exp; the backward recomputes each
 * block's probabilities from it (nothing of T x T size is kept between the passes, only one
 * block's R x T workspace per thread):
 *     P = exp(S - lse); Pd = P keep / (1 - p); dv += Pd^T do; dP = (do v^T) keep / (1 - p);
 *     dS = P (dP - rowsum(P dP)); dmask = dS; dq = dS k scale; dk += dS^T q scale.
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

/* Rows [r0, r0 + n) of t (rows of `width` elements, from element `off` on) as f32 into dst. */
static void stage(const ampc_tensor *t, int64_t off, int64_t r0, int64_t n, int64_t width, float *dst) {
    const ampc_dtype_traits *tr = ampc__dt(t->dtype);
    tr->to_f32((const char *)ampc__data(t) + (size_t)(off + r0 * width) * tr->size, dst, (size_t)(n * width));
}
static void unstage(ampc_tensor *t, int64_t off, int64_t r0, int64_t n, int64_t width, const float *src) {
    const ampc_dtype_traits *tr = ampc__dt(t->dtype);
    tr->from_f32(src, (char *)ampc__data(t) + (size_t)(off + r0 * width) * tr->size, (size_t)(n * width));
}


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

/* dS = P (dP - D), D = sum_j P dP, in place of P. A block holds every key its rows see, so D
   comes from the row itself in f32 (not from the rounded output o, as flash attention's tiles
   over keys must take it). */
AMPC_CPU_VEC static void dscores_row(float *p, const float *dp, int64_t kn) {
    float D = 0.0f;
#pragma omp simd reduction(+ : D)
    for (int64_t j = 0; j < kn; j++) D += p[j] * dp[j];
#pragma omp simd
    for (int64_t j = 0; j < kn; j++) p[j] = p[j] * (dp[j] - D);
}

/* Threads for the batch heads (a head per thread at a time) */
static int threads_of(const ampc_attn_desc *d) {
    int nt = ampc__threads_for(d->batch * d->Tq * d->Tk * (d->E + d->Ev));
    return nt > d->batch ? (int)d->batch : nt;
}

/* Threads for the batch heads, and a workspace of `per` floats each (NULL + error). */
static float *workspace(const ampc_attn_desc *d, size_t per, int *nt, size_t *block) {
    *nt = threads_of(d);
    return ampc__alloc(AMPC_DEVICE_CPU, (size_t)*nt * per * sizeof(float), AMPC_MEM_WORKSPACE, block);
}

// ---------------------------------------------------------------------------------------------
// The bf16 route: where oneDNN runs bf16 matmuls on bf16 units (AVX512-BF16, AMX), bf16 q, k, v
// go to them in place (no staging) and each block's probabilities P and score gradients dS are
// rounded to bf16 for the products that take them (as flash attention does on GPUs); the scores,
// the softmax, dP and the accumulators of dk and dv stay f32. Each thread runs its own one-thread
// matmul primitives (gemm.c's entries, one per thread slot) on its own stream.

enum { G_S, G_PV, G_DV, G_DP, G_DQ, G_DK, G_COUNT };

/* Whether attention on q's dtype takes the bf16 route */
static bool bf16_route(const ampc_attn_desc *d, const ampc_tensor *q) {
    return q->dtype == AMPC_BF16 && d->E > 0 && d->Ev > 0 && d->Tk > 0 && ampc__dnnl_bf16_native();
}

/* Query rows [i0, i0 + n) of block ib, and the keys kn they see */
static void block_of(const ampc_attn_desc *d, int64_t ib, int64_t *i0, int64_t *n, int64_t *kn) {
    const int64_t R = d->Tq < ROWS ? d->Tq : ROWS;
    *i0 = ib * R;
    *n = d->Tq - *i0 < R ? d->Tq - *i0 : R;
    *kn = ampc__attn_keys(d, *i0 + *n - 1);
}

/* Gemm g of a block of n rows seeing kn keys (see the kernels for the operands) */
static ampc_gemm_desc block_gemm(const ampc_attn_desc *d, int g, int64_t n, int64_t kn) {
    ampc_gemm_desc G = {.batch = 1};
    switch (g) {
    case G_S: G.M = n, G.N = kn, G.K = d->E, G.tb = true; break;      /* S = q k^T */
    case G_PV: G.M = n, G.N = d->Ev, G.K = kn; break;                 /* o = P v */
    case G_DV: G.M = kn, G.N = d->Ev, G.K = n, G.ta = true; break;    /* P^T do */
    case G_DP: G.M = n, G.N = kn, G.K = d->Ev, G.tb = true; break;    /* dP = do v^T */
    case G_DQ: G.M = n, G.N = d->E, G.K = kn; break;                  /* dq = dS k */
    default: G.M = kn, G.N = d->E, G.K = n, G.ta = true; break;       /* dS^T q */
    }
    return G;
}

/* The entries of gemms `mask` (bits 1 << g) of every block for thread slots 0..nt-1, at
   e[(ib * G_COUNT + g) * nt + slot], and each slot's scratchpad size (the largest of its
   entries, rounded to 64 bytes) in *scratch; the streams reserved. */
static int bf16_entries(const ampc_attn_desc *d, unsigned mask, int nt, int64_t nblk, ampc_dnnl_entry **e, size_t *scratch) {
    int rc = AMPC_OK, nthr = omp_get_max_threads();
    *scratch = 0;
    ampc__dnnl_lock();
    omp_set_num_threads(1);   /* oneDNN sizes a primitive's threading at creation */
    for (int64_t ib = 0; ib < nblk && rc >= 0; ib++) {
        int64_t i0, n, kn;
        block_of(d, ib, &i0, &n, &kn);
        for (int g = 0; g < G_COUNT && rc >= 0; g++) {
            if (!(mask & (1u << g))) continue;
            ampc_gemm_desc G = block_gemm(d, g, n, kn);
            ampc_dtype out = g == G_PV ? AMPC_BF16 : AMPC_F32;
            for (int t = 0; t < nt && rc >= 0; t++) {
                ampc_dnnl_entry *x = e[(ib * G_COUNT + g) * nt + t] = ampc__cpu_gemm_entry(&G, AMPC_BF16, out, t);
                if (!x) rc = ampc_last_status();
                else if (x->scratch_bytes > *scratch) *scratch = x->scratch_bytes;
            }
        }
    }
    omp_set_num_threads(nthr);
    if (rc >= 0) rc = ampc__dnnl_reserve_streams(nt);
    ampc__dnnl_unlock();
    *scratch = (*scratch + 63) / 64 * 64;
    return rc;
}

/* Runs entry e (C = op(A) op(B)) on the calling thread's stream slot */
static bool mm(ampc_dnnl_entry *e, const void *a, const void *b, void *c, void *scratch, int slot) {
    void *h[3] = {(void *)a, (void *)b, c};
    return ampc__dnnl_exec(e, h, scratch, slot) == dnnl_success;
}

/* f32 n values into bf16 */
static void to_bf16(const float *x, uint16_t *y, int64_t n) { ampc_convert_f32_to_bf16(x, y, (size_t)n); }

/* The rows of a block of scores (n rows of kn, f32, unscaled) into probabilities: scale, mask,
   then the softmax (forward: lse out) or the saved lse's exp (backward: lse in) */
static void scores_to_probs(const ampc_attn_desc *d, float *S, int64_t b, int64_t i0, int64_t n, int64_t kn, const float *Mb,
                            float *L, bool forward) {
    const float scale = (float)d->scale;
    for (int64_t r = 0; r < n; r++) {
        const int64_t i = i0 + r, nj = ampc__attn_keys(d, i);
        float *s = S + r * kn;
#pragma omp simd
        for (int64_t j = 0; j < nj; j++) s[j] *= scale;
        if (Mb) add_mask_row(s, Mb + i * d->mask_si, d->mask_sj, nj);
        if (forward) {
            const float l = softmax_row(s, nj, kn);
            if (L) L[b * d->Tq + i] = l;
        } else {
            probs_row(s, nj, kn, L[b * d->Tq + i]);
        }
    }
}

/* What a bf16 kernel call holds: its threads, blocks, matmul entries and per-thread workspaces */
typedef struct {
    int nt;
    int64_t nblk;
    ampc_dnnl_entry **e;     /* e[(ib * G_COUNT + g) * nt + slot] */
    size_t scratch, per64;   /* a thread's oneDNN scratchpad, and its whole workspace (64-byte multiples) */
    char *ws;
    size_t eblock, wblock;
} bf16_plan;

/* The plan for gemms `gemms` (bits 1 << g) with `bytes` of the caller's per thread besides the
   scratchpad; NULL ws and the error set on failure (nothing held) */
static int plan_begin(const ampc_attn_desc *d, unsigned gemms, size_t bytes, bf16_plan *p) {
    memset(p, 0, sizeof *p);
    const int64_t R = d->Tq < ROWS ? d->Tq : ROWS;
    p->nblk = (d->Tq + R - 1) / R;
    p->nt = threads_of(d);
    p->e = ampc__alloc(AMPC_DEVICE_CPU, (size_t)(p->nblk * G_COUNT * p->nt) * sizeof *p->e, AMPC_MEM_WORKSPACE, &p->eblock);
    if (!p->e) return ampc_last_status();
    int rc = bf16_entries(d, gemms, p->nt, p->nblk, p->e, &p->scratch);
    p->per64 = (bytes + p->scratch + 63) / 64 * 64;
    if (rc >= 0 && !(p->ws = ampc__alloc(AMPC_DEVICE_CPU, (size_t)p->nt * p->per64 + 64, AMPC_MEM_WORKSPACE, &p->wblock)))
        rc = ampc_last_status();
    if (rc < 0) ampc__free(AMPC_DEVICE_CPU, p->e, p->eblock, AMPC_MEM_WORKSPACE);
    return rc;
}
/* Thread slot's oneDNN scratchpad; the caller's bytes follow it (64-byte aligned) */
static char *plan_thread(const bf16_plan *p, int slot) {
    return (char *)(((uintptr_t)p->ws + 63) / 64 * 64) + (size_t)slot * p->per64;
}
static int plan_end(bf16_plan *p, bool ok, const char *what) {
    ampc__free(AMPC_DEVICE_CPU, p->ws, p->wblock, AMPC_MEM_WORKSPACE);
    ampc__free(AMPC_DEVICE_CPU, p->e, p->eblock, AMPC_MEM_WORKSPACE);
    return ok ? AMPC_OK : ampc__err(AMPC_ERR_BACKEND, "oneDNN bf16 matmul of %s failed", what);
}

/* Dropout of a block's probabilities P (n rows of kn): keep (n kn bytes) gets each row's
   decisions, out = P keep / (1 - p) (out may be P) */
static void drop_block(const ampc_attn_desc *d, const float *P, int64_t b, int64_t i0, int64_t n, int64_t kn, uint8_t *keep,
                       float *out) {
    const float f = ampc__dropout_scale(d->dropout);
    for (int64_t r = 0; r < n; r++) {
        ampc__cpu_dropout_keep(d->rng, (uint64_t)((b * d->Tq + i0 + r) * d->Tk), (size_t)kn, d->dropout, keep + r * kn);
        drop_row(P + r * kn, keep + r * kn, kn, f, out + r * kn);
    }
}

/* A block's score gradients in place of its probabilities P from dP = do v^T (n rows of kn):
   dP through dropout's decisions (keep NULL: none), dS = P (dP - rowsum(P dP)), and dS copied
   into the rows of dmask (GM: the block's first row, rows of Tk; 0 past kn) when given */
static void block_dscores(const ampc_attn_desc *d, float *P, float *dP, const uint8_t *keep, int64_t n, int64_t kn, float *GM) {
    const float f = ampc__dropout_scale(d->dropout);
    for (int64_t r = 0; r < n; r++) {
        if (keep) drop_row(dP + r * kn, keep + r * kn, kn, f, dP + r * kn);
        dscores_row(P + r * kn, dP + r * kn, kn);
        if (GM) {
            memcpy(GM + r * d->Tk, P + r * kn, (size_t)kn * sizeof *GM);
            memset(GM + r * d->Tk + kn, 0, (size_t)(d->Tk - kn) * sizeof *GM);
        }
    }
}

static int cpu_attention_bf16(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                              const ampc_tensor *mask, ampc_tensor *o, ampc_tensor *lse) {
    const int64_t Tq = d->Tq, Tk = d->Tk, E = d->E, Ev = d->Ev, R = Tq < ROWS ? Tq : ROWS;
    const bool drop = d->dropout > 0;
    bf16_plan pl;   /* per thread: a block's scores (f32) and probabilities (bf16), its keep bytes */
    if (plan_begin(d, 1u << G_S | 1u << G_PV, (size_t)(R * Tk) * 7, &pl) < 0) return ampc_last_status();
    const int nt = pl.nt;
    ampc_dnnl_entry *const *e = pl.e;
    int64_t ko, vo;
    ampc__attn_offsets(d, &ko, &vo);
    const uint16_t *qp = ampc__data(q), *kp = (const uint16_t *)ampc__data(k) + ko, *vp = (const uint16_t *)ampc__data(v) + vo;
    uint16_t *op = ampc__data(o);
    float *L = lse ? ampc__data(lse) : NULL;
    const float *M = mask ? ampc__data(mask) : NULL;
    bool ok = true;
#pragma omp parallel num_threads(nt) reduction(&& : ok)
    {
        const int slot = omp_get_thread_num();
        char *scr = plan_thread(&pl, slot);
        float *S = (float *)(scr + pl.scratch);
        uint16_t *P = (uint16_t *)(S + R * Tk);
        uint8_t *keep = (uint8_t *)(P + R * Tk);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < d->batch; b++) {
            const float *Mb = M ? M + ampc__attn_mask_offset(d, b) : NULL;
            for (int64_t ib = 0; ib < pl.nblk; ib++) {
                int64_t i0, n, kn;
                block_of(d, ib, &i0, &n, &kn);
                ok = ok && mm(e[(ib * G_COUNT + G_S) * nt + slot], qp + (b * Tq + i0) * E, kp + b * Tk * E, S, scr, slot);
                scores_to_probs(d, S, b, i0, n, kn, Mb, L, true);
                if (drop) drop_block(d, S, b, i0, n, kn, keep, S);
                to_bf16(S, P, n * kn);
                ok = ok && mm(e[(ib * G_COUNT + G_PV) * nt + slot], P, vp + b * Tk * Ev, op + (b * Tq + i0) * Ev, scr, slot);
            }
        }
    }
    return plan_end(&pl, ok, "attention");
}

static int cpu_attention_backward_bf16(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k,
                                       const ampc_tensor *v, const ampc_tensor *mask, const ampc_tensor *lse, const ampc_tensor *dout, ampc_tensor *dq, ampc_tensor *dk,
                                       ampc_tensor *dv, ampc_tensor *dmask) {
    const int64_t Tq = d->Tq, Tk = d->Tk, E = d->E, Ev = d->Ev, R = Tq < ROWS ? Tq : ROWS;
    const int64_t W = E > Ev ? E : Ev, rows_tmp = Tk > R ? Tk : R;
    const float scale = (float)d->scale;
    const bool drop = d->dropout > 0;
    /* per thread (f32 unless said): a block's P and dP, P and dS in bf16, keep bytes, the dk and
       dv accumulators, a product's temporary (Tk or R rows of W) */
    bf16_plan pl;
    if (plan_begin(d, 1u << G_S | 1u << G_DV | 1u << G_DP | 1u << G_DQ | 1u << G_DK,
                   (size_t)(2 * R * Tk + Tk * E + Tk * Ev + rows_tmp * W) * 4 + (size_t)(R * Tk) * 5, &pl) < 0)
        return ampc_last_status();
    const int nt = pl.nt;
    int64_t ko, vo;
    ampc__attn_offsets(d, &ko, &vo);
    const uint16_t *qp = ampc__data(q), *kp = (const uint16_t *)ampc__data(k) + ko, *vp = (const uint16_t *)ampc__data(v) + vo;
    const uint16_t *gp = ampc__data(dout);
    uint16_t *gq = ampc__data(dq), *gk = (uint16_t *)ampc__data(dk) + ko, *gv = (uint16_t *)ampc__data(dv) + vo;
    float *L = ampc__data(lse), *GM = dmask ? ampc__data(dmask) : NULL;   /* L: read only (scores_to_probs) */
    const float *M = mask ? ampc__data(mask) : NULL;
    bool ok = true;
#pragma omp parallel num_threads(nt) reduction(&& : ok)
    {
        const int slot = omp_get_thread_num();
        char *scr = plan_thread(&pl, slot);
        float *P = (float *)(scr + pl.scratch), *dP = P + R * Tk, *ak = dP + R * Tk, *av = ak + Tk * E, *tmp = av + Tk * Ev;
        uint16_t *Pb = (uint16_t *)(tmp + rows_tmp * W), *dSb = Pb + R * Tk;
        uint8_t *keep = (uint8_t *)(dSb + R * Tk);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < d->batch; b++) {
            const float *Mb = M ? M + ampc__attn_mask_offset(d, b) : NULL;
            const uint16_t *qb = qp + b * Tq * E, *kb = kp + b * Tk * E, *vb = vp + b * Tk * Ev, *gb = gp + b * Tq * Ev;
            memset(ak, 0, (size_t)(Tk * E + Tk * Ev) * sizeof(float));
            for (int64_t ib = 0; ib < pl.nblk; ib++) {
                int64_t i0, n, kn;
                block_of(d, ib, &i0, &n, &kn);
                ampc_dnnl_entry *const *eb = pl.e + ib * G_COUNT * nt;
                ok = ok && mm(eb[G_S * nt + slot], qb + i0 * E, kb, P, scr, slot);
                scores_to_probs(d, P, b, i0, n, kn, Mb, L, false);
                if (drop) drop_block(d, P, b, i0, n, kn, keep, dP);   /* Pb: the probabilities v saw, in bf16 */
                to_bf16(drop ? dP : P, Pb, n * kn);
                ok = ok && mm(eb[G_DV * nt + slot], Pb, gb + i0 * Ev, tmp, scr, slot);   /* dv += P^T do */
#pragma omp simd
                for (int64_t x = 0; x < kn * Ev; x++) av[x] += tmp[x];
                ok = ok && mm(eb[G_DP * nt + slot], gb + i0 * Ev, vb, dP, scr, slot);   /* dP = do v^T */
                block_dscores(d, P, dP, drop ? keep : NULL, n, kn, GM ? GM + (b * Tq + i0) * Tk : NULL);
                to_bf16(P, dSb, n * kn);
                ok = ok && mm(eb[G_DQ * nt + slot], dSb, kb, tmp, scr, slot);   /* dq = dS k scale */
#pragma omp simd
                for (int64_t x = 0; x < n * E; x++) tmp[x] *= scale;
                to_bf16(tmp, gq + (b * Tq + i0) * E, n * E);
                ok = ok && mm(eb[G_DK * nt + slot], dSb, qb + i0 * E, tmp, scr, slot);   /* dk += dS^T q */
#pragma omp simd
                for (int64_t x = 0; x < kn * E; x++) ak[x] += tmp[x];
            }
#pragma omp simd
            for (int64_t x = 0; x < Tk * E; x++) ak[x] *= scale;
            to_bf16(ak, gk + b * Tk * E, Tk * E);
            to_bf16(av, gv + b * Tk * Ev, Tk * Ev);
        }
    }
    return plan_end(&pl, ok, "attention backward");
}

static int cpu_attention(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                         const ampc_tensor *mask, ampc_tensor *o, ampc_tensor *lse) {
    const int64_t Tq = d->Tq, Tk = d->Tk, E = d->E, Ev = d->Ev, R = Tq < ROWS ? Tq : ROWS;
    int64_t ko, vo;
    ampc__attn_offsets(d, &ko, &vo);
    if (d->batch == 0 || Tq == 0) return AMPC_OK;
    if (bf16_route(d, q)) return cpu_attention_bf16(d, q, k, v, mask, o, lse);
    const bool drop = d->dropout > 0;
    /* per thread: q, k, v, o staged, a block's scores and its keep bytes */
    const size_t per = (size_t)(Tq * E + Tk * E + Tk * Ev + Tq * Ev + R * Tk + (R * Tk + 3) / 4);
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
            stage(q, 0, b * Tq, Tq, E, qs);
            stage(k, ko, b * Tk, Tk, E, ks);
            stage(v, vo, b * Tk, Tk, Ev, vs);
            for (int64_t ib = 0; ib * R < Tq; ib++) {
                int64_t i0, n, kn;
                block_of(d, ib, &i0, &n, &kn);
                sgemm('N', 'T', n, kn, E, 1.0f, qs + i0 * E, E, ks, E, 0.0f, S, kn);
                scores_to_probs(d, S, b, i0, n, kn, Mb, L, true);
                if (drop) drop_block(d, S, b, i0, n, kn, keep, S);
                sgemm('N', 'N', n, Ev, kn, 1.0f, S, kn, vs, Ev, 0.0f, os + i0 * Ev, Ev);
            }
            unstage(o, 0, b * Tq, Tq, Ev, os);
        }
    }
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return AMPC_OK;
}

static int cpu_attention_backward(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                                  const ampc_tensor *mask, const ampc_tensor *lse, const ampc_tensor *dout, ampc_tensor *dq,
                                  ampc_tensor *dk, ampc_tensor *dv, ampc_tensor *dmask) {
    const int64_t Tq = d->Tq, Tk = d->Tk, E = d->E, Ev = d->Ev, R = Tq < ROWS ? Tq : ROWS;
    int64_t ko, vo;
    ampc__attn_offsets(d, &ko, &vo);
    if (d->batch == 0) return AMPC_OK;
    if (Tq > 0 && bf16_route(d, q)) return cpu_attention_backward_bf16(d, q, k, v, mask, lse, dout, dq, dk, dv, dmask);
    const float scale = (float)d->scale;
    const bool drop = d->dropout > 0;
    /* per thread: q, k, v, do staged, the gradients dq, dk, dv, a block's P and dP; with dropout
       a block's dropped P and its keep bytes */
    const size_t per = (size_t)(2 * Tq * E + 2 * Tk * E + 2 * Tk * Ev + Tq * Ev + 2 * R * Tk) +
                       (drop ? (size_t)(R * Tk + (R * Tk + 3) / 4) : 0);
    int nt;
    size_t block = 0;
    float *ws = workspace(d, per, &nt, &block);
    if (!ws) return ampc_last_status();
    float *L = ampc__data(lse), *GM = dmask ? ampc__data(dmask) : NULL;   /* L: read only (scores_to_probs) */
    const float *M = mask ? ampc__data(mask) : NULL;
#pragma omp parallel num_threads(nt)
    {
        omp_set_num_threads(1);
        float *qs = ws + (size_t)omp_get_thread_num() * per, *ks = qs + Tq * E, *vs = ks + Tk * E, *gs = vs + Tk * Ev;
        float *gq = gs + Tq * Ev, *gk = gq + Tq * E, *gv = gk + Tk * E, *P = gv + Tk * Ev, *dP = P + R * Tk;
        float *Pd = drop ? dP + R * Tk : NULL;
        uint8_t *keep = drop ? (uint8_t *)(Pd + R * Tk) : NULL;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < d->batch; b++) {
            const float *Mb = M ? M + ampc__attn_mask_offset(d, b) : NULL;
            stage(q, 0, b * Tq, Tq, E, qs);
            stage(k, ko, b * Tk, Tk, E, ks);
            stage(v, vo, b * Tk, Tk, Ev, vs);
            stage(dout, 0, b * Tq, Tq, Ev, gs);
            memset(gk, 0, (size_t)(Tk * E + Tk * Ev) * sizeof(float));
            for (int64_t ib = 0; ib * R < Tq; ib++) {
                int64_t i0, n, kn;
                block_of(d, ib, &i0, &n, &kn);
                sgemm('N', 'T', n, kn, E, 1.0f, qs + i0 * E, E, ks, E, 0.0f, P, kn);
                scores_to_probs(d, P, b, i0, n, kn, Mb, L, false);
                if (drop) drop_block(d, P, b, i0, n, kn, keep, Pd);
                sgemm('T', 'N', kn, Ev, n, 1.0f, drop ? Pd : P, kn, gs + i0 * Ev, Ev, 1.0f, gv, Ev);   /* dv += Pd^T do */
                sgemm('N', 'T', n, kn, Ev, 1.0f, gs + i0 * Ev, Ev, vs, Ev, 0.0f, dP, kn);              /* dP = do v^T */
                block_dscores(d, P, dP, keep, n, kn, GM ? GM + (b * Tq + i0) * Tk : NULL);
                sgemm('N', 'N', n, E, kn, scale, P, kn, ks, E, 0.0f, gq + i0 * E, E);       /* dq = dS k scale */
                sgemm('T', 'N', kn, E, n, scale, P, kn, qs + i0 * E, E, 1.0f, gk, E);       /* dk += dS^T q scale */
            }
            unstage(dq, 0, b * Tq, Tq, E, gq);
            unstage(dk, ko, b * Tk, Tk, E, gk);
            unstage(dv, vo, b * Tk, Tk, Ev, gv);
        }
    }
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return AMPC_OK;
}

void ampc__cpu_register_attention(ampc_backend *be) {
    be->attention = cpu_attention;
    be->attention_backward = cpu_attention_backward;
}
