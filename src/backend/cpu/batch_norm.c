/*
 * batch_norm.c - CPU kernels of batch norm (and batch norm + ReLU), written by hand
 * (vectorized loops: norm.h, OpenMP), for f32/f16/bf16 activations with f32 statistics.
 *
 *   batch norm: x (N, C, S...) per channel. Two storage walks:
 *     - channels (S >= BN_COLS_BELOW): one thread does a whole channel - the N runs of S
 *       contiguous values - in three passes (mean, centred variance, normalise). A channel's
 *       slice stays in L2 between the passes, so x comes from memory once.
 *     - columns (small S: BatchNorm1d's (N, C), or tiny images): x is N rows of C*S
 *       contiguous values; fixed blocks of rows accumulate per-column sums, reduced per
 *       channel afterwards, so the loops run along contiguous memory.
 *   channels-last (4-D x with format AMPC_CHANNELS_LAST; y, gy, gx too): M = N*H*W rows of C
 *     channels, in L1-sized tiles of rows: the statistics in one pass from memory (a tile's
 *     sum, then its centred squares while it is in L1, merged by Chan's formula), then the
 *     normalise pass walking each thread's rows backwards (cached tiles first). NCHW's channel
 *     walk reads x from memory once (a channel stays in L2); here the statistics must cover all
 *     rows before any output, so x is read twice: ~1.1-1.35x slower where x is larger than L3,
 *     faster for small maps / large C. ms, 2 threads, best of 30, one shared noisy run
 *     (NCHW -> NHWC, training fwd | bwd):
 *       (64,64,32,32)   f32 1.96 -> 2.22 | 2.14 -> 2.51   bf16 1.43 -> 1.47 | 1.45 -> 1.45
 *       (64,128,16,16)  f32 1.12 -> 1.04 | 1.24 -> 0.96   bf16 0.80 -> 0.72 | 0.81 -> 0.69
 *       (64,256,8,8)    f32 0.62 -> 0.53 | 0.77 -> 0.53   bf16 0.64 -> 0.37 | 0.88 -> 0.36
 *       (64,512,4,4)    f32 0.46 -> 0.22 | 0.56 -> 0.21   bf16 0.35 -> 0.19 | 0.34 -> 0.18
 *       (16,64,112,112) f32 5.57 -> 7.44 | 6.65 -> 8.61   bf16 3.94 -> 4.85 | 3.95 -> 5.28
 *       (16,64,56,56)   f32 1.51 -> 1.79 | 1.85 -> 2.08   bf16 1.16 -> 1.16 | 1.17 -> 1.23
 *       (16,256,56,56)  f32 6.10 -> 7.93 | 7.70 -> 8.52   bf16 3.96 -> 4.92 | 4.34 -> 4.82
 *       (16,512,28,28)  f32 4.11 -> 4.22 | 4.64 -> 4.73   bf16 2.64 -> 2.56 | 2.92 -> 2.34
 *       (16,1024,14,14) f32 2.05 -> 1.69 | 2.66 -> 2.04   bf16 0.85 -> 0.69 | 1.08 -> 0.66
 *       (16,2048,7,7)   f32 0.87 -> 0.84 | 1.30 -> 1.01   bf16 0.90 -> 0.59 | 1.16 -> 0.63
 *
 * Storage: when x, y (gy, gx) are all f32 or all bf16, the batch-norm loops read and write
 * them in place (bf16 converted in registers, AVX-512/AVX2 clones: cpu.h), a channel's N runs
 * in one call; otherwise (f16, mixed dtypes; layer norm always: layer_norm.c) chunks are staged
 * through f32 buffers. Values are computed in f32 with one rounding on store.
 *
 * Numerics: every statistic and every gradient sum accumulates in f64 (DL lanes combined in a
 * fixed order), and the variance is the centred second pass sum((x - mean)^2): a channel at
 * 1000 + noise keeps its variance (no E[x^2] - E[x]^2 cancellation). Block and channel
 * assignment depends only on the shape, so results do not depend on the number of threads.
 *
 * Why not oneDNN's batch normalization: on plain NCHW data oneDNN 2.6 picks its generic
 * "ncsp_bnorm" implementation, measured on (64, 64, 32, 32) training forward + backward at
 * ~35 ms for bf16 and ~12 ms for f32 against ~4 ms for these loops (2 cores, best of 60). It
 * also has no f16, no unbiased variance and no running-statistics update.
 */
#include "backend/cpu/norm.h"

/* The loops that read these tensors in place (all f32, or all bf16; NULLs ignored), with the
   fused ReLU or not, or NULL: then the caller stages chunks into f32 buffers and runs fns_f32
   on them (the ReLU applied around it: relu_staged, masked_gy). */
static const vec_fns *direct_fns(const ampc_tensor *a, const ampc_tensor *b, const ampc_tensor *c, bool relu) {
    ampc_dtype dt = a->dtype;
    if (!ampc__cpu_direct(dt) || (b && b->dtype != dt) || (c && c->dtype != dt)) return NULL;
    if (relu) return dt == AMPC_BF16 ? &fns_bf16_relu : &fns_f32_relu;
    return dt == AMPC_BF16 ? &fns_bf16 : &fns_f32;
}

// ---------------------------------------------------------------------------------------------
// Batch norm: per-channel statistics and coefficients

typedef struct {
    int64_t N, C, S, M;   /* M = N * S values per channel */
    int64_t Ms;           /* values per channel the statistics cover: M, or the world's with sync */
    const float *w, *b;   /* (C) or NULL */
    float *rm, *rv, *save_mean, *save_invstd;
    double momentum, eps;
    bool training;
    bool relu;              /* the fused ReLU */
    float *save_coef;       /* forward with relu: (3, C) the m, scale, shift applied, or NULL */
    const float *rc;        /* backward with relu: those (3, C) coefficients */
    /* SyncBatchNorm's two passes (bn_forward_sync, bn_backward_sync). The statistics pass of
       the forward writes this process's mean and squared deviations (the layout of
       ampc__bn_sync_stats) into stats_out and stops; the normalisation pass takes the world's
       from stats_in. The backward's first pass writes sum(gy), sum(gy (x - mean)) into
       sums_out (2, C) with gw and gb, the second makes gx from the world's sums_in. */
    double *stats_out, *sums_out;
    const double *stats_in, *sums_in;
} bn_ctx;

/* The fused ReLU on the staged path: relu of the n values just stored into t from element i
   (rounded to t's dtype first, as ampc_relu would see them; buf: CHUNK floats). */
static void relu_staged(ampc_tensor *t, size_t i, size_t n, float *buf) {
    const float *v = ampc__cpu_load(t, i, n, buf);
    size_t es = ampc__dt(t->dtype)->size;
    char *p = ampc__cpu_at(t, i);
    for (size_t j = 0; j < n; j++)
        if (v[j] < 0.0f) memset(p + j * es, 0, es);   /* +0 is all zero bits in every float dtype */
}

/* The staged backward's gy: rows x len values of gy from element i as f32 in bg, zeroed where
   the fused forward's output was not positive: v = (x - m) * a + b recomputed from xv (the
   same values as x's elements), rounded to x's dtype (y's). The coefficients per column
   (cs = 1) or one channel's (cs = 0). n = rows * len <= CHUNK. */
static const float *masked_gy(const ampc_tensor *gy, const ampc_tensor *x, const float *xv, size_t i, size_t rows,
                              size_t len, bn_rcv rc, size_t cs, float *bg) {
    size_t n = rows * len;
    float v[CHUNK];
    uint16_t h[CHUNK];
    if (gy->dtype == AMPC_F32) memcpy(bg, (const float *)ampc__data(gy) + i, n * sizeof *bg);
    else ampc__cpu_load(gy, i, n, bg);
    for (size_t r = 0; r < rows; r++)
        for (size_t j = 0; j < len; j++) v[r * len + j] = (xv[r * len + j] - rc.m[j * cs]) * rc.a[j * cs] + rc.b[j * cs];
    if (x->dtype != AMPC_F32) {   /* the rounding to y's dtype */
        ampc__dt(x->dtype)->from_f32(v, h, n);
        ampc__dt(x->dtype)->to_f32(h, v, n);
    }
    for (size_t j = 0; j < n; j++) bg[j] = v[j] > 0.0f ? bg[j] : 0.0f;
    return bg;
}

/* x (N, C, S...) into c; the door (dispatch.c) checked every argument */
static void bn_dims(const ampc_tensor *x, bn_ctx *c) {
    c->N = x->shape[0];
    c->C = x->shape[1];
    c->S = 1;
    for (int i = 2; i < x->ndim; i++) c->S *= x->shape[i];
    c->M = c->N * c->S;
    c->Ms = c->M;
}

/* y = (x - m) * scale + shift for one channel */
typedef struct {
    float m, scale, shift;
} bn_coef;

/* This process's statistics of channel ch into stats_out when this is the statistics pass of a
   sync forward (true: the pass ends there for the channel). */
static bool bn_stats_only(const bn_ctx *c, int64_t ch, double mean, double q) {
    if (!c->stats_out) return false;
    c->stats_out[ch] = mean;
    c->stats_out[c->C + 1 + ch] = q;
    return true;
}

/* Channel ch with batch mean and sum of squared deviations q (training; the world's from
   stats_in with sync) or its running stats: saves the statistics, updates the running ones,
   returns the normalisation's coefficients. */
static bn_coef bn_finish_channel(const bn_ctx *c, int64_t ch, double mean, double q) {
    double var;
    if (c->training) {
        if (c->stats_in) mean = c->stats_in[ch], q = c->stats_in[c->C + 1 + ch];
        var = q / (double)c->Ms;
        double unbiased = c->Ms > 1 ? q / (double)(c->Ms - 1) : NAN;   /* the op refuses M == 1 */
        if (c->rm) c->rm[ch] = (float)((1 - c->momentum) * c->rm[ch] + c->momentum * mean);
        if (c->rv) c->rv[ch] = (float)((1 - c->momentum) * c->rv[ch] + c->momentum * unbiased);
    } else {
        mean = c->rm[ch];
        var = c->rv[ch];
    }
    double invstd = 1 / sqrt(var + c->eps), w = c->w ? c->w[ch] : 1, b = c->b ? c->b[ch] : 0;
    if (c->save_mean) c->save_mean[ch] = (float)mean;
    if (c->save_invstd) c->save_invstd[ch] = (float)invstd;
    /* the mean as a float plus a remainder folded into the shift */
    bn_coef r = {.m = (float)mean, .scale = (float)(invstd * w)};
    r.shift = (float)(b - (mean - (double)r.m) * invstd * w);
    if (c->save_coef) c->save_coef[ch] = r.m, c->save_coef[c->C + ch] = r.scale, c->save_coef[2 * c->C + ch] = r.shift;
    return r;
}

/* Backward coefficients of channel ch from sg = sum(gy), sgx = sum(gy * (x - mean)) (the
   world's from sums_in with sync): gx = k * gy + a * (x - mean) + b; gw = sgx * invstd, gb = sg. */
static void bn_grad_coefs(const bn_ctx *c, int64_t ch, double invstd, double sg, double sgx, float *k, float *a, float *b) {
    double kk = (c->w ? c->w[ch] : 1) * invstd, aa = 0, bb = 0;
    if (c->sums_in) sg = c->sums_in[ch], sgx = c->sums_in[c->C + ch];
    if (c->training) {   /* gx = w invstd (gy - sg/M - xhat sum(gy xhat)/M) */
        aa = -kk * invstd * invstd * sgx / (double)c->Ms;
        bb = -kk * sg / (double)c->Ms;
    }
    *k = (float)kk;
    *a = (float)aa;
    *b = (float)bb;
}

// ---------------------------------------------------------------------------------------------
// Batch norm: the channel walk (large S)

/* The runs of channel ch: row n of length S from element (n * C + ch) * S, in chunks (the
   staged path). */
#define FOR_CHANNEL_CHUNKS(c, ch, i, len)                                                          \
    for (int64_t n_ = 0; n_ < (c)->N; n_++)                                                        \
        for (size_t off_ = 0, i = (size_t)((n_ * (c)->C + (ch)) * (c)->S), len;                    \
             off_ < (size_t)(c)->S && (len = min_sz(CHUNK, (size_t)(c)->S - off_), 1); off_ += len, i += len)

static void bn_fwd_channels(const bn_ctx *c, const ampc_tensor *x, ampc_tensor *y) {
    int nt = threads_for_items(c->C, x->numel);
    const vec_fns *d = direct_fns(x, y, NULL, c->relu), *f = &fns_f32;
    const int64_t N = c->N, S = c->S, CS = c->C * c->S;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t ch = 0; ch < c->C; ch++) {
        float bx[CHUNK], by[CHUNK];
        double mean = 0, q = 0;
        const void *xc = d ? ampc__cpu_at(x, (size_t)(ch * S)) : NULL;
        void *yc = d ? ampc__cpu_at(y, (size_t)(ch * S)) : NULL;
        if (c->training && !c->stats_in) {
            double s = 0;
            if (d) s = d->sum(xc, N, CS, S);
            else FOR_CHANNEL_CHUNKS(c, ch, i, len) s += f->sum(ampc__cpu_load(x, i, len, bx), 1, 0, (int64_t)len);
            mean = s / (double)c->M;
            if (d) q = d->sq_dev(xc, N, CS, S, mean);
            else FOR_CHANNEL_CHUNKS(c, ch, i, len) q += f->sq_dev(ampc__cpu_load(x, i, len, bx), 1, 0, (int64_t)len, mean);
        }
        if (bn_stats_only(c, ch, mean, q)) continue;
        bn_coef k = bn_finish_channel(c, ch, mean, q);
        if (d) {
            d->affine(xc, yc, N, CS, S, k.m, k.scale, k.shift);
            continue;
        }
        FOR_CHANNEL_CHUNKS(c, ch, i, len) {
            float *out = ampc__cpu_out(y, i, by);
            f->affine(ampc__cpu_load(x, i, len, bx), out, 1, 0, (int64_t)len, k.m, k.scale, k.shift);
            ampc__cpu_store(y, i, len, out);
            if (c->relu) relu_staged(y, i, len, by);
        }
    }
}

static void bn_bwd_channels(const bn_ctx *c, const ampc_tensor *x, const ampc_tensor *gy, const float *mean,
                            const float *invstd, ampc_tensor *gx, float *gw, float *gb) {
    int nt = threads_for_items(c->C, x->numel);
    bool sums = !c->sums_in && (gw || gb || (gx && c->training));
    const vec_fns *d = direct_fns(x, gy, gx, c->rc != NULL), *f = &fns_f32;
    const int64_t N = c->N, S = c->S, C = c->C, CS = C * S;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t ch = 0; ch < C; ch++) {
        float bx[CHUNK], bg[CHUNK], k, a, b;
        double sg = 0, sgx = 0, m = mean[ch], is = invstd[ch];
        size_t first = (size_t)(ch * S);
        bn_preact_coefs r1 = {0};
        if (c->rc) r1 = (bn_preact_coefs){c->rc[ch], c->rc[C + ch], c->rc[2 * C + ch]};
        const bn_rcv rv = {&r1.m, &r1.a, &r1.b};
        if (sums) {
            if (d) d->grad_sums(ampc__cpu_at(gy, first), ampc__cpu_at(x, first), N, CS, S, m, &sg, &sgx, r1);
            else
                FOR_CHANNEL_CHUNKS(c, ch, i, len) {
                    const float *xp = ampc__cpu_load(x, i, len, bx);
                    const float *gp = c->rc ? masked_gy(gy, x, xp, i, 1, len, rv, 0, bg) : ampc__cpu_load(gy, i, len, bg);
                    f->grad_sums(gp, xp, 1, 0, (int64_t)len, m, &sg, &sgx, r1);
                }
        }
        if (gw) gw[ch] = (float)(sgx * is);
        if (gb) gb[ch] = (float)sg;
        if (c->sums_out) c->sums_out[ch] = sg, c->sums_out[C + ch] = sgx;
        if (!gx || c->sums_out) continue;
        bn_grad_coefs(c, ch, is, sg, sgx, &k, &a, &b);
        if (d) {
            d->affine2(ampc__cpu_at(gy, first), ampc__cpu_at(x, first), ampc__cpu_at(gx, first), N, CS, S, k, mean[ch], a, b,
                       r1);
            continue;
        }
        FOR_CHANNEL_CHUNKS(c, ch, i, len) {
            const float *xp = ampc__cpu_load(x, i, len, bx);
            const float *gp = c->rc ? masked_gy(gy, x, xp, i, 1, len, rv, 0, bg) : ampc__cpu_load(gy, i, len, bg);
            float *out = ampc__cpu_out(gx, i, bg);   /* may overwrite bg: affine2 reads g[i] first */
            f->affine2(gp, xp, out, 1, 0, (int64_t)len, k, mean[ch], a, b, r1);
            ampc__cpu_store(gx, i, len, out);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Batch norm: the column walk (small S). x is N rows of CS = C * S values.


/* The pieces of row n's columns: the whole row for the register path (chunk CS), chunks of
   CHUNK for the staged one. */
#define FOR_ROW_CHUNKS(CS, chunk, n, j, i, len)                                                    \
    for (size_t j = 0, i = (size_t)((n) * (CS)), len; j < (size_t)(CS) && (len = min_sz(chunk, (size_t)(CS) - j), 1); \
         j += len, i += len)

/* Source of elements [i, i+len) of t for the vector loops: in place when d (the register
   path), else converted into buf. */
static const void *src_of(const ampc_tensor *t, size_t i, size_t len, float *buf, const vec_fns *d) {
    return d ? ampc__cpu_at(t, i) : ampc__cpu_load(t, i, len, buf);
}

/* part (nb, CS): per-block column sums of x (m NULL) or of (x - m[col])^2. */
static void col_sums(const ampc_tensor *x, int64_t N, int64_t CS, int64_t nb, const double *m, double *part) {
    int nt = threads_for_items(nb, x->numel);
    const vec_fns *d = direct_fns(x, NULL, NULL, false), *f = d ? d : &fns_f32;
    size_t chunk = d ? (size_t)CS : CHUNK;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t bi = 0; bi < nb; bi++) {
        float bx[CHUNK];
        double *acc = part + bi * CS;
        int64_t r0, r1;
        row_block(N, nb, bi, &r0, &r1);
        memset(acc, 0, (size_t)CS * sizeof *acc);
        for (int64_t n = r0; n < r1; n++) {
            FOR_ROW_CHUNKS(CS, chunk, n, j, i, len) {
                const void *xp = src_of(x, i, len, bx, d);
                if (m) f->col_sq_dev(acc + j, xp, m + j, 1, len);
                else f->col_add(acc + j, xp, 1, len);
            }
        }
    }
}

/* Sums the block partials of the columns of each channel: out[ch] (in block order). */
static void col_reduce(const double *part, int64_t nb, int64_t C, int64_t S, double *out) {
    for (int64_t ch = 0; ch < C; ch++) {
        double s = 0;
        for (int64_t bi = 0; bi < nb; bi++)
            for (int64_t i = 0; i < S; i++) s += part[bi * C * S + ch * S + i];
        out[ch] = s;
    }
}

/* y = (x - Mc[col]) * A[col] + B[col], or gx = K[col] * gy + A[col] * (x - Mc[col]) + B[col]
   when g is given; with the fused ReLU (relu): y's relu, or gy masked by the forward's
   coefficients rc (per column). */
static void col_apply(const ampc_tensor *g, const ampc_tensor *x, ampc_tensor *out, int64_t N, int64_t CS, const float *K,
                      const float *Mc, const float *A, const float *B, bool relu, bn_rcv rc) {
    int nt = threads_for_items(N, x->numel);
    const vec_fns *d = direct_fns(x, g, out, relu), *f = d ? d : &fns_f32;
    size_t chunk = d ? (size_t)CS : CHUNK;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float bx[CHUNK], bg[CHUNK], bo[CHUNK];
        FOR_ROW_CHUNKS(CS, chunk, n, j, i, len) {
            const void *xp = src_of(x, i, len, bx, d);
            void *op = d ? ampc__cpu_at(out, i) : ampc__cpu_out(out, i, bo);
            bn_rcv rj = relu && g ? (bn_rcv){rc.m + j, rc.a + j, rc.b + j} : rc;
            if (g) {
                const void *gp = !d && relu ? masked_gy(g, x, xp, i, 1, len, rj, 1, bg) : src_of(g, i, len, bg, d);
                f->col_affine2(gp, xp, op, 1, len, K + j, Mc + j, A + j, B + j, rj);
            } else f->col_affine(xp, op, 1, len, Mc + j, A + j, B + j);
            if (!d) ampc__cpu_store(out, i, len, op);
            if (!d && relu && !g) relu_staged(out, i, len, bo);
        }
    }
}

static int bn_fwd_columns(const bn_ctx *c, const ampc_tensor *x, ampc_tensor *y) {
    int64_t C = c->C, S = c->S, CS = C * S, nb = c->N < ROW_BLOCKS ? (c->N > 0 ? c->N : 1) : ROW_BLOCKS;
    ws_block w = {0};
    /* part (nb, CS) | mexp (CS) | stat (C) doubles, then Mc, A, B (CS) floats */
    size_t nd = (size_t)(nb * CS + CS + C);
    double *part = ws_get(&w, nd * sizeof(double) + 3 * (size_t)CS * sizeof(float));
    if (!part) return ampc_last_status();
    double *mexp = part + nb * CS, *stat = mexp + CS;
    float *Mc = (float *)(stat + C), *A = Mc + CS, *B = A + CS;
    bool own = c->training && !c->stats_in;   /* this pass computes the statistics */
    if (own) {
        col_sums(x, c->N, CS, nb, NULL, part);
        col_reduce(part, nb, C, S, stat);
        for (int64_t j = 0; j < CS; j++) mexp[j] = stat[j / S] / (double)c->M;
        col_sums(x, c->N, CS, nb, mexp, part);
        col_reduce(part, nb, C, S, stat);   /* now sum of squared deviations */
    }
    for (int64_t ch = 0; ch < C; ch++) {
        double mean = own ? mexp[ch * S] : 0, q = own ? stat[ch] : 0;
        if (bn_stats_only(c, ch, mean, q)) continue;
        bn_coef f = bn_finish_channel(c, ch, mean, q);
        for (int64_t i = 0; i < S; i++) Mc[ch * S + i] = f.m, A[ch * S + i] = f.scale, B[ch * S + i] = f.shift;
    }
    if (!c->stats_out) col_apply(NULL, x, y, c->N, CS, NULL, Mc, A, B, c->relu, (bn_rcv){0});
    ws_put(&w);
    return AMPC_OK;
}

static int bn_bwd_columns(const bn_ctx *c, const ampc_tensor *x, const ampc_tensor *gy, const float *mean,
                          const float *invstd, ampc_tensor *gx, float *gw, float *gb) {
    int64_t C = c->C, S = c->S, CS = C * S, nb = c->N < ROW_BLOCKS ? (c->N > 0 ? c->N : 1) : ROW_BLOCKS;
    bool sums = !c->sums_in && (gw || gb || (gx && c->training));
    ws_block w = {0};
    /* part_g, part_gx (nb, CS) | sg, sgx (C) doubles, then Mc, K, A, B (CS) floats, and with
       the fused ReLU its coefficients RM, RA, RB (CS) */
    size_t nd = (size_t)(2 * nb * CS + 2 * C), nf = c->rc ? 7 : 4;
    double *pg = ws_get(&w, nd * sizeof(double) + nf * (size_t)CS * sizeof(float));
    if (!pg) return ampc_last_status();
    double *pgx = pg + nb * CS, *sg = pgx + nb * CS, *sgx = sg + C;
    float *Mc = (float *)(sgx + C), *K = Mc + CS, *A = K + CS, *B = A + CS, *R = B + CS;
    for (int64_t j = 0; j < CS; j++) Mc[j] = mean[j / S];
    for (int64_t j = 0; c->rc && j < CS; j++)
        R[j] = c->rc[j / S], R[CS + j] = c->rc[C + j / S], R[2 * CS + j] = c->rc[2 * C + j / S];
    const bn_rcv rc = c->rc ? (bn_rcv){R, R + CS, R + 2 * CS} : (bn_rcv){0};
    if (sums) {
        int nt = threads_for_items(nb, x->numel);
        const vec_fns *d = direct_fns(x, gy, NULL, c->rc != NULL), *f = d ? d : &fns_f32;
        size_t chunk = d ? (size_t)CS : CHUNK;
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t bi = 0; bi < nb; bi++) {
            float bx[CHUNK], bg[CHUNK];
            double *ag = pg + bi * CS, *agx = pgx + bi * CS;
            int64_t r0, r1;
            row_block(c->N, nb, bi, &r0, &r1);
            memset(ag, 0, (size_t)CS * sizeof *ag);
            memset(agx, 0, (size_t)CS * sizeof *agx);
            for (int64_t n = r0; n < r1; n++) {
                FOR_ROW_CHUNKS(CS, chunk, n, j, i, len) {
                    const void *xp = src_of(x, i, len, bx, d);
                    bn_rcv rj = c->rc ? (bn_rcv){rc.m + j, rc.a + j, rc.b + j} : rc;
                    const void *gp = !d && c->rc ? masked_gy(gy, x, xp, i, 1, len, rj, 1, bg) : src_of(gy, i, len, bg, d);
                    f->col_grad(ag + j, agx + j, gp, xp, Mc + j, 1, len, rj);
                }
            }
        }
        col_reduce(pg, nb, C, S, sg);
        col_reduce(pgx, nb, C, S, sgx);
    }
    for (int64_t ch = 0; ch < C; ch++) {
        if (gw) gw[ch] = (float)(sgx[ch] * invstd[ch]);
        if (gb) gb[ch] = (float)sg[ch];
        if (c->sums_out) c->sums_out[ch] = sg[ch], c->sums_out[C + ch] = sgx[ch];
        if (!gx || c->sums_out) continue;
        float k, a, b;
        bn_grad_coefs(c, ch, invstd[ch], sums ? sg[ch] : 0, sums ? sgx[ch] : 0, &k, &a, &b);
        for (int64_t i = 0; i < S; i++) K[ch * S + i] = k, A[ch * S + i] = a, B[ch * S + i] = b;
    }
    if (gx && !c->sums_out) col_apply(gy, x, gx, c->N, CS, K, Mc, A, B, c->rc != NULL, rc);
    ws_put(&w);
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Batch norm: channels-last. x is M = N*H*W rows of C contiguous channels, the column walk's
// layout with S = 1, walked in tiles of rows that stay in L1:
//   forward (training): one pass from memory. Each tile is summed, then its squared deviations
//     from its own mean are summed while it is still in L1; tiles merge into their row block's
//     (mean, M2) by Chan's formula (f64, centred at every step: no cancellation), blocks merge
//     in block order. Then the normalise pass.
//   backward: one pass for the gradient sums, then the gx pass.
// The second pass walks each thread's rows backwards, so it starts on the tiles the first pass
// left in L2/L3 (memory traffic of ResNet-50's (16, 64, 112, 112), 51 MB in f32, above L3).

#define CL_TILE_BYTES 32768    /* a statistics tile: read twice, the second time from L1/L2 */
#define CL_TILE_MIN_ROWS 32
#define CL_APPLY_BYTES 262144  /* rows of a tile of the second pass (walked backwards) */

/* Rows per tile: ~CL_TILE_BYTES of x, at least CL_TILE_MIN_ROWS so that clearing and merging
   the tile's 2 C sums stays small next to its rows (depends on the shape and dtype only). */
static int64_t cl_tile_rows(const ampc_tensor *x, int64_t C) {
    int64_t row = C * (int64_t)ampc__dt(x->dtype)->size, r = row ? CL_TILE_BYTES / row : CL_TILE_MIN_ROWS;
    return r > CL_TILE_MIN_ROWS ? r : CL_TILE_MIN_ROWS;
}

/* Rows per tile of the second pass, walked backwards tile by tile: ~CL_APPLY_BYTES of x, long
   enough runs for the hardware prefetcher (16 KiB tiles backwards measured 1.3x slower). */
static int64_t cl_apply_rows(const ampc_tensor *x, int64_t C) {
    int64_t row = C * (int64_t)ampc__dt(x->dtype)->size;
    return row >= CL_APPLY_BYTES ? 1 : CL_APPLY_BYTES / row;
}

/* A piece of rows [r0, r1) for the vector loops: `rows` rows of `len` values from element
   row * C + col, contiguous (len == C, or rows == 1). In place (direct): the whole range; staged:
   whole rows up to CHUNK values, or CHUNK-value parts of one row when C > CHUNK. */
typedef struct {
    int64_t row, rows, col, len;
} cl_piece;

static cl_piece cl_first(int64_t r0, int64_t r1, int64_t C, bool direct) {
    cl_piece p = {.row = r0, .rows = 0, .col = 0, .len = C};
    if (r0 >= r1 || C == 0) return p;
    if (direct) p.rows = r1 - r0;
    else if (C <= CHUNK) p.rows = (r1 - r0 < CHUNK / C) ? r1 - r0 : CHUNK / C;
    else p.rows = 1, p.len = CHUNK;
    return p;
}

static void cl_next(cl_piece *p, int64_t r1, int64_t C) {
    if (p->col + p->len < C) {   /* the next part of a long row */
        p->col += p->len;
        p->len = (int64_t)min_sz(CHUNK, (size_t)(C - p->col));
        return;
    }
    p->row += p->rows;
    p->col = 0;
    if (p->len < C) p->len = CHUNK;   /* parts of rows longer than CHUNK */
    p->rows = p->row >= r1 ? 0 : p->rows < r1 - p->row ? p->rows : r1 - p->row;
}

#define FOR_CL_PIECES(p, r0, r1, C, direct) \
    for (cl_piece p = cl_first(r0, r1, C, direct); p.rows > 0; cl_next(&p, r1, C))
/* first element and number of values of a piece */
#define CL_AT(p, C) ((size_t)((p).row * (C) + (p).col))
#define CL_N(p) ((size_t)((p).rows * (p).len))

/* (n, mean, m2) += k rows of mean tm and centred sum of squares q (Chan, Golub, LeVeque):
   m2 += q + (tm - mean)^2 n k / (n + k). */
static void chan_merge(double n, double *mean, double *m2, double k, const double *tm, const double *q, int64_t C) {
    double wa = k / (n + k), wb = n * k / (n + k);
    for (int64_t j = 0; j < C; j++) {
        double dlt = tm[j] - mean[j];
        mean[j] += dlt * wa;
        m2[j] += q[j] + dlt * dlt * wb;
    }
}

/* This thread's share [*b0, *b1) of nb blocks (the same in both passes of a kernel). */
static void thread_blocks(int64_t nb, int64_t *b0, int64_t *b1) {
    int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    *b0 = nb * t / T;
    *b1 = nb * (t + 1) / T;
}

static int bn_fwd_cl(const bn_ctx *c, const ampc_tensor *x, ampc_tensor *y) {
    const int64_t M = c->M, C = c->C, nb = M < ROW_BLOCKS ? (M > 0 ? M : 1) : ROW_BLOCKS, R = cl_tile_rows(x, C);
    const vec_fns *d = direct_fns(x, y, NULL, c->relu), *f = d ? d : &fns_f32;
    int nt = threads_for_items(nb, x->numel);
    ws_block w = {0};
    /* per block mean, m2 (nb, 2, C) | per thread s, q (nt, 2, C) doubles, then Mc, A, B (C) floats */
    size_t nd = (size_t)(2 * nb * C + 2 * nt * C);
    double *blk = ws_get(&w, nd * sizeof(double) + 3 * (size_t)C * sizeof(float));
    if (!blk) return ampc_last_status();
    double *scr = blk + 2 * nb * C;
    float *Mc = (float *)(scr + 2 * nt * C), *A = Mc + C, *B = A + C;
    const bool own = c->training && !c->stats_in;   /* this pass computes the statistics */
#pragma omp parallel num_threads(nt)
    {
        float bx[CHUNK], by[CHUNK];
        int64_t b0, b1, lo, hi, unused;
        thread_blocks(nb, &b0, &b1);
        double *s = scr + 2 * C * omp_get_thread_num(), *q = s + C;
        for (int64_t bi = b0; own && bi < b1; bi++) {
            double *mean = blk + 2 * C * bi, *m2 = mean + C, n = 0;
            int64_t r0, r1;
            row_block(M, nb, bi, &r0, &r1);
            memset(mean, 0, 2 * (size_t)C * sizeof *mean);
            for (int64_t t0 = r0; t0 < r1; t0 += R) {
                int64_t t1 = t0 + R < r1 ? t0 + R : r1;
                memset(s, 0, 2 * (size_t)C * sizeof *s);
                FOR_CL_PIECES(p, t0, t1, C, d) f->col_add(s + p.col, src_of(x, CL_AT(p, C), CL_N(p), bx, d), (size_t)p.rows, (size_t)p.len);
                for (int64_t j = 0; j < C; j++) s[j] /= (double)(t1 - t0);   /* the tile's mean */
                FOR_CL_PIECES(p, t0, t1, C, d) {
                    f->col_sq_dev(q + p.col, src_of(x, CL_AT(p, C), CL_N(p), bx, d), s + p.col, (size_t)p.rows, (size_t)p.len);
                }
                chan_merge(n, mean, m2, (double)(t1 - t0), s, q, C);
                n += (double)(t1 - t0);
            }
        }
#pragma omp barrier
#pragma omp single
        {
            double *mean = blk, *m2 = blk + C;   /* block 0, then the others merged in order */
            for (int64_t bi = 1; own && bi < nb; bi++) {
                int64_t r0, r1;
                row_block(M, nb, bi, &r0, &r1);   /* r0 rows merged so far */
                chan_merge((double)r0, mean, m2, (double)(r1 - r0), blk + 2 * C * bi, blk + 2 * C * bi + C, C);
            }
            for (int64_t ch = 0; ch < C; ch++) {
                double m = own ? mean[ch] : 0, q = own ? m2[ch] : 0;
                if (bn_stats_only(c, ch, m, q)) continue;
                bn_coef k = bn_finish_channel(c, ch, m, q);
                Mc[ch] = k.m, A[ch] = k.scale, B[ch] = k.shift;
            }
        }
        row_block(M, nb, b0, &lo, &unused);
        row_block(M, nb, b1 > b0 ? b1 - 1 : b0, &unused, &hi);
        const int64_t RA = cl_apply_rows(x, C);
        for (int64_t t1 = hi; !c->stats_out && b0 < b1 && t1 > lo; t1 -= RA) {   /* backwards: the cached tiles first */
            int64_t t0 = t1 - RA > lo ? t1 - RA : lo;
            FOR_CL_PIECES(p, t0, t1, C, d) {
                size_t i = CL_AT(p, C);
                void *op = d ? ampc__cpu_at(y, i) : ampc__cpu_out(y, i, by);
                f->col_affine(src_of(x, i, CL_N(p), bx, d), op, (size_t)p.rows, (size_t)p.len, Mc + p.col, A + p.col, B + p.col);
                if (!d) ampc__cpu_store(y, i, CL_N(p), op);
                if (!d && c->relu) relu_staged(y, i, CL_N(p), by);
            }
        }
    }
    ws_put(&w);
    return AMPC_OK;
}

/* The fused ReLU's coefficients from channel col on (none without it). */
static bn_rcv cl_rc(const bn_ctx *c, int64_t col) {
    if (!c->rc) return (bn_rcv){0};
    return (bn_rcv){c->rc + col, c->rc + c->C + col, c->rc + 2 * c->C + col};
}

static int bn_bwd_cl(const bn_ctx *c, const ampc_tensor *x, const ampc_tensor *gy, const float *mean, const float *invstd,
                     ampc_tensor *gx, float *gw, float *gb) {
    const int64_t M = c->M, C = c->C, nb = M < ROW_BLOCKS ? (M > 0 ? M : 1) : ROW_BLOCKS;
    bool sums = !c->sums_in && (gw || gb || (gx && c->training));
    const vec_fns *d = direct_fns(x, gy, gx, c->rc != NULL), *f = d ? d : &fns_f32;
    int nt = threads_for_items(nb, x->numel);
    ws_block w = {0};
    /* per block sg, sgx (nb, 2, C) doubles, then Mc, K, A, B (C) floats */
    double *blk = ws_get(&w, 2 * (size_t)(nb * C) * sizeof(double) + 4 * (size_t)C * sizeof(float));
    if (!blk) return ampc_last_status();
    float *Mc = (float *)(blk + 2 * nb * C), *K = Mc + C, *A = K + C, *B = A + C;
    memcpy(Mc, mean, (size_t)C * sizeof *Mc);
#pragma omp parallel num_threads(nt)
    {
        float bx[CHUNK], bg[CHUNK], bo[CHUNK];
        int64_t b0, b1, lo, hi, unused;
        thread_blocks(nb, &b0, &b1);
        for (int64_t bi = b0; sums && bi < b1; bi++) {
            double *ag = blk + 2 * C * bi, *agx = ag + C;
            int64_t r0, r1;
            row_block(M, nb, bi, &r0, &r1);
            memset(ag, 0, 2 * (size_t)C * sizeof *ag);
            FOR_CL_PIECES(p, r0, r1, C, d) {
                size_t i = CL_AT(p, C), n = CL_N(p);
                const void *xp = src_of(x, i, n, bx, d);
                bn_rcv rj = cl_rc(c, p.col);
                const void *gp = !d && c->rc ? masked_gy(gy, x, xp, i, (size_t)p.rows, (size_t)p.len, rj, 1, bg)
                                             : src_of(gy, i, n, bg, d);
                f->col_grad(ag + p.col, agx + p.col, gp, xp, Mc + p.col, (size_t)p.rows, (size_t)p.len, rj);
            }
        }
#pragma omp barrier
#pragma omp single
        {
            double *sg = blk, *sgx = blk + C;   /* block 0, then the others added in order */
            for (int64_t bi = 1; sums && bi < nb; bi++)
                for (int64_t ch = 0; ch < C; ch++) sg[ch] += blk[2 * C * bi + ch], sgx[ch] += blk[2 * C * bi + C + ch];
            for (int64_t ch = 0; ch < C; ch++) {
                double g0 = sums ? sg[ch] : 0, g1 = sums ? sgx[ch] : 0;
                if (gw) gw[ch] = (float)(g1 * invstd[ch]);
                if (gb) gb[ch] = (float)g0;
                if (c->sums_out) c->sums_out[ch] = g0, c->sums_out[C + ch] = g1;
                bn_grad_coefs(c, ch, invstd[ch], g0, g1, &K[ch], &A[ch], &B[ch]);
            }
        }
        row_block(M, nb, b0, &lo, &unused);
        row_block(M, nb, b1 > b0 ? b1 - 1 : b0, &unused, &hi);
        const int64_t RA = cl_apply_rows(x, C);
        for (int64_t t1 = hi; gx && !c->sums_out && b0 < b1 && t1 > lo; t1 -= RA) {   /* backwards: the cached tiles first */
            int64_t t0 = t1 - RA > lo ? t1 - RA : lo;
            FOR_CL_PIECES(p, t0, t1, C, d) {
                size_t i = CL_AT(p, C), n = CL_N(p);
                void *op = d ? ampc__cpu_at(gx, i) : ampc__cpu_out(gx, i, bo);
                const void *xp = src_of(x, i, n, bx, d);
                bn_rcv rj = cl_rc(c, p.col);
                const void *gp = !d && c->rc ? masked_gy(gy, x, xp, i, (size_t)p.rows, (size_t)p.len, rj, 1, bg)
                                             : src_of(gy, i, n, bg, d);
                f->col_affine2(gp, xp, op, (size_t)p.rows, (size_t)p.len, K + p.col, Mc + p.col, A + p.col, B + p.col, rj);
                if (!d) ampc__cpu_store(gx, i, n, op);
            }
        }
    }
    ws_put(&w);
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Batch norm kernels

/* The walk that suits x's layout and size. */
static int bn_fwd_walk(const bn_ctx *c, const ampc_tensor *x, ampc_tensor *y) {
    if (ampc__is_cl(x)) return bn_fwd_cl(c, x, y);
    if (c->S >= BN_COLS_BELOW) {
        bn_fwd_channels(c, x, y);
        return AMPC_OK;
    }
    return bn_fwd_columns(c, x, y);
}

/* The forward after the statistics outputs were checked and set in c (with c->relu). */
static int bn_forward(bn_ctx *c, const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                      ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y) {
    c->w = f32_or_null(weight);
    c->b = f32_or_null(bias);
    c->rm = running_mean ? ampc__data(running_mean) : NULL;
    c->rv = running_var ? ampc__data(running_var) : NULL;
    return bn_fwd_walk(c, x, y);
}

/* bn_forward with the statistics of all processes (sync, training): this process's statistics
   pass, the exchange, then the normalisation with the world's. */
static int bn_forward_sync(bn_ctx *c, const ampc_tensor *x, const ampc_tensor *weight,
                           const ampc_tensor *bias, ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y) {
    ws_block w = {0};
    double *st = ws_get(&w, (size_t)(3 * c->C + 1) * sizeof(double));
    if (!st) return ampc_last_status();
    c->stats_out = st;
    int rc = bn_forward(c, x, weight, bias, running_mean, running_var, y);
    st[c->C] = (double)c->M;
    c->stats_out = NULL;
    if (rc >= 0) rc = ampc__bn_sync_stats(c->C, st);
    if (rc >= 0) {
        c->stats_in = st;
        c->Ms = (int64_t)st[c->C];
        rc = bn_fwd_walk(c, x, y);
    }
    ws_put(&w);
    return rc;
}

static int cpu_batch_norm(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                          ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *save_mean,
                          ampc_tensor *save_invstd, bool training, double momentum, double eps, bool sync) {
    bn_ctx c = {.training = training, .momentum = momentum, .eps = eps};
    bn_dims(x, &c);
    c.save_mean = save_mean ? ampc__data(save_mean) : NULL;
    c.save_invstd = save_invstd ? ampc__data(save_invstd) : NULL;
    return (sync && training ? bn_forward_sync : bn_forward)(&c, x, weight, bias, running_mean, running_var, y);
}

/* stats rows: mean, invstd, then the m, scale, shift the normalisation applied (bn_finish_channel) */
static int cpu_batch_norm_relu(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                               ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *stats,
                               bool training, double momentum, double eps, bool sync) {
    bn_ctx c = {.training = training, .momentum = momentum, .eps = eps, .relu = true};
    bn_dims(x, &c);
    if (stats) {
        float *s = ampc__data(stats);
        c.save_mean = s;
        c.save_invstd = s + c.C;
        c.save_coef = s + 2 * c.C;
    }
    return (sync && training ? bn_forward_sync : bn_forward)(&c, x, weight, bias, running_mean, running_var, y);
}

/* The backward walk that suits x's layout and size. */
static int bn_bwd_walk(const bn_ctx *c, const ampc_tensor *x, const ampc_tensor *gy, const float *mean, const float *invstd,
                       ampc_tensor *gx, float *gw, float *gb) {
    if (ampc__is_cl(x)) return bn_bwd_cl(c, x, gy, mean, invstd, gx, gw, gb);
    if (c->S >= BN_COLS_BELOW) {
        bn_bwd_channels(c, x, gy, mean, invstd, gx, gw, gb);
        return AMPC_OK;
    }
    return bn_bwd_columns(c, x, gy, mean, invstd, gx, gw, gb);
}

/* The backward after the statistics were checked and set (c->rc with the fused ReLU). */
static int bn_backward(bn_ctx *c, const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                       const float *mean, const float *invstd, ampc_tensor *gx, ampc_tensor *gw, ampc_tensor *gb) {
    c->w = f32_or_null(weight);
    float *gwp = gw ? ampc__data(gw) : NULL, *gbp = gb ? ampc__data(gb) : NULL;
    return bn_bwd_walk(c, x, gy, mean, invstd, gx, gwp, gbp);
}

/* bn_backward with the sums of all processes (sync, training): this process's sums (and its own
   gw, gb), the exchange, then gx from the world's. Without gx there is nothing to exchange. */
static int bn_backward_sync(bn_ctx *c, const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                            const float *mean, const float *invstd, ampc_tensor *gx, ampc_tensor *gw, ampc_tensor *gb) {
    if (!gx) return bn_backward(c, x, gy, weight, mean, invstd, gx, gw, gb);
    const int64_t C = c->C;
    ws_block w = {0};
    double *sums = ws_get(&w, (size_t)(2 * C + 1) * sizeof(double));
    if (!sums) return ampc_last_status();
    c->sums_out = sums;
    int rc = bn_backward(c, x, gy, weight, mean, invstd, gx, gw, gb);
    c->sums_out = NULL;
    sums[2 * C] = (double)c->M;   /* and the world's count with the sums */
    if (rc >= 0) rc = ampc__bn_sync_sums(sums, 2 * C + 1);
    if (rc >= 0) {
        c->sums_in = sums;
        c->Ms = (int64_t)sums[2 * C];
        rc = bn_bwd_walk(c, x, gy, mean, invstd, gx, NULL, NULL);
    }
    ws_put(&w);
    return rc;
}

static int cpu_batch_norm_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                   const ampc_tensor *save_mean, const ampc_tensor *save_invstd, bool training,
                                   bool sync, ampc_tensor *gx, ampc_tensor *gw, ampc_tensor *gb) {
    bn_ctx c = {.training = training};
    bn_dims(x, &c);
    return (sync && training ? bn_backward_sync : bn_backward)(&c, x, gy, weight, ampc__data(save_mean),
                                                              ampc__data(save_invstd), gx, gw, gb);
}

static int cpu_batch_norm_relu_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                        const ampc_tensor *stats, bool training, bool sync, ampc_tensor *gx,
                                        ampc_tensor *gw, ampc_tensor *gb) {
    bn_ctx c = {.training = training};
    bn_dims(x, &c);
    const float *s = ampc__data(stats);
    c.rc = s + 2 * c.C;
    return (sync && training ? bn_backward_sync : bn_backward)(&c, x, gy, weight, s, s + c.C, gx, gw, gb);
}
// ---------------------------------------------------------------------------------------------

void ampc__cpu_register_batch_norm(ampc_backend *be) {
    be->batch_norm = cpu_batch_norm;
    be->batch_norm_backward = cpu_batch_norm_backward;
    be->batch_norm_relu = cpu_batch_norm_relu;
    be->batch_norm_relu_backward = cpu_batch_norm_relu_backward;
}
