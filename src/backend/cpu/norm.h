/*
 * norm.h - what the CPU kernels of batch norm (batch_norm.c) and layer norm (layer_norm.c)
 * share: the vector loops over f32 or bf16 storage with f64 accumulation (layer norm runs the
 * f32 statistics loops on its staged rows), workspace and row blocks.
 * Private to those two files.
 */
#ifndef AMPC_CPU_NORM_H
#define AMPC_CPU_NORM_H

#include "backend/cpu/cpu.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#define CHUNK AMPC_CPU_CHUNK
#define BN_COLS_BELOW 32   /* spatial sizes below this take the column walk */
#define ROW_BLOCKS 16      /* row blocks of the column sums (fixed: thread-count independent) */
/* f64 accumulators of a sum: four AVX-512 registers' worth for bf16, two for f32 (with 32,
   gcc 12 keeps the f32 ones in memory: 1.6x slower; bf16 gains 1.3x from the extra chains) */
#define DL_MAX 32
#define DL(bf) ((bf) ? 32 : 16)

static inline size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

// ---------------------------------------------------------------------------------------------
// Vector loops over f32 or bf16 storage (f64 accumulation). The batch-norm loops walk `runs`
// runs of `len` values `stride` elements apart: a channel's N runs of S values in one call.

/* The forward's coefficients of a fused ReLU's pre-activation v = (x - m) * a + b: one
   channel's, or per column (arrays indexed like the loop's columns). */
typedef struct {
    float m, a, b;
} bn_preact_coefs;
typedef struct {
    const float *m, *a, *b;
} bn_rcv;

AMPC_CPU_INLINE const void *elt(const void *p, int64_t i, bool bf) { return (const char *)p + i * (bf ? 2 : 4); }

/* The DL lanes added pairwise: a fixed association whatever the vector width. */
AMPC_CPU_INLINE double lanes_total(double *acc, bool bf) {
    for (int h = DL(bf) / 2; h > 0; h /= 2)
        for (int j = 0; j < h; j++) acc[j] += acc[j + h];
    return acc[0];
}

/* ReLU fused into the normalisation (RELU constant per clone): the forward stores relu of the
   value rounded to storage, so a tiny negative that rounds to -0 stays -0 and NaN stays NaN,
   as ampc_relu on the stored output; the backward keeps gy where that stored output was > 0
   (relu's backward reads its output y), recomputing it from x with the forward's f32
   coefficients (same operations, so the same value). */
AMPC_CPU_INLINE void st_out(void *p, size_t i, float v, bool bf, bool relu) {
    if (!relu) ampc__cpu_st(p, i, v, bf);
    else if (bf) {
        uint16_t h = ampc__cpu_f32_bf16(v);
        ((uint16_t *)p)[i] = ampc__cpu_bf16_f32(h) < 0.0f ? 0 : h;
    } else ((float *)p)[i] = v < 0.0f ? 0.0f : v;
}
AMPC_CPU_INLINE float relu_mask(float g, float xv, float m, float a, float b, bool bf, bool relu) {
    if (!relu) return g;
    float v = (xv - m) * a + b;
    /* the stored bf16 value is > 0 exactly when v > 2^-134: below, v rounds to +0 (2^-134 itself
       ties to the even 0); no rounding in the loop needed */
    const float zero = bf ? 0x1p-134f : 0.0f;
    /* a bitwise select, not a branch: the loops around stay vectorized (gcc turned the
       ternary into an unpredictable branch in scalar code: 25x slower) and a masked NaN or inf
       in gy still gives exactly 0, as relu's backward does */
    uint32_t gb;
    memcpy(&gb, &g, sizeof gb);
    gb &= 0u - (uint32_t)(v > zero);
    memcpy(&g, &gb, sizeof g);
    return g;
}

/* The run some 4 KiB ahead of run r (the last one at the end): the first passes over a channel
   prefetch it while reading run r, since the hardware prefetcher starts over at every run
   (measured: a channel's sum from memory 2.3x faster in bf16, 1.9x in f32, runs of 4096). */
AMPC_CPU_INLINE const void *run_ahead(const void *x, int64_t r, int64_t runs, int64_t stride, int64_t len, bool bf) {
    int64_t bytes = len * (bf ? 2 : 4), k = bytes >= 4096 ? 1 : 4096 / (bytes ? bytes : 1);
    return elt(x, (r + k < runs ? r + k : runs - 1) * stride, bf);
}

/* sum(x) */
AMPC_CPU_INLINE double sum_body(const void *x, int64_t runs, int64_t stride, int64_t len, bool bf) {
    double acc[DL_MAX] = {0}, tail = 0;
    for (int64_t r = 0; r < runs; r++) {
        const void *p = elt(x, r * stride, bf), *ahead = run_ahead(x, r, runs, stride, len, bf);
        int64_t i = 0;
        for (; i + DL(bf) <= len; i += DL(bf)) {
            __builtin_prefetch(elt(ahead, i, bf));
#pragma omp simd
            for (int j = 0; j < DL(bf); j++) acc[j] += (double)ampc__cpu_ld(p, (size_t)(i + j), bf);
        }
        for (; i < len; i++) tail += (double)ampc__cpu_ld(p, (size_t)i, bf);
    }
    return lanes_total(acc, bf) + tail;
}

/* sum((x - m)^2) */
AMPC_CPU_INLINE double sq_dev_body(const void *x, int64_t runs, int64_t stride, int64_t len, double m, bool bf) {
    double acc[DL_MAX] = {0}, tail = 0;
    for (int64_t r = 0; r < runs; r++) {
        const void *p = elt(x, r * stride, bf);
        int64_t i = 0;
        for (; i + DL(bf) <= len; i += DL(bf)) {
#pragma omp simd
            for (int j = 0; j < DL(bf); j++) {
                double d = (double)ampc__cpu_ld(p, (size_t)(i + j), bf) - m;
                acc[j] += d * d;
            }
        }
        for (; i < len; i++) {
            double d = (double)ampc__cpu_ld(p, (size_t)i, bf) - m;
            tail += d * d;
        }
    }
    return lanes_total(acc, bf) + tail;
}

/* *sg += sum(g), *sgx += sum(g * (x - m)) */
AMPC_CPU_INLINE void grad_sums_body(const void *g, const void *x, int64_t runs, int64_t stride, int64_t len, double m,
                                    double *sg, double *sgx, bn_preact_coefs rc, bool bf, bool relu) {
    double a[DL_MAX] = {0}, b[DL_MAX] = {0}, ta = 0, tb = 0;
    for (int64_t r = 0; r < runs; r++) {
        const void *pg = elt(g, r * stride, bf), *px = elt(x, r * stride, bf);
        const void *ag = run_ahead(g, r, runs, stride, len, bf), *ax = run_ahead(x, r, runs, stride, len, bf);
        int64_t i = 0;
        for (; i + DL(bf) <= len; i += DL(bf)) {
            __builtin_prefetch(elt(ag, i, bf));
            __builtin_prefetch(elt(ax, i, bf));
#pragma omp simd
            for (int j = 0; j < DL(bf); j++) {
                float xv = ampc__cpu_ld(px, (size_t)(i + j), bf);
                double gv = (double)relu_mask(ampc__cpu_ld(pg, (size_t)(i + j), bf), xv, rc.m, rc.a, rc.b, bf, relu);
                a[j] += gv;
                b[j] += gv * ((double)xv - m);
            }
        }
        for (; i < len; i++) {
            float xv = ampc__cpu_ld(px, (size_t)i, bf);
            double gv = (double)relu_mask(ampc__cpu_ld(pg, (size_t)i, bf), xv, rc.m, rc.a, rc.b, bf, relu);
            ta += gv;
            tb += gv * ((double)xv - m);
        }
    }
    *sg += lanes_total(a, bf) + ta;
    *sgx += lanes_total(b, bf) + tb;
}

/* y = (x - m) * a + b. x - m is exact for x near m (Sterbenz), so a large common offset
   (x = 1000 + noise) does not cost precision as a * x + (b - a * m) would. */
AMPC_CPU_INLINE void affine_body(const void *x, void *y, int64_t runs, int64_t stride, int64_t len, float m, float a,
                                 float b, bool bf, bool relu) {
    for (int64_t r = 0; r < runs; r++) {
        const void *px = elt(x, r * stride, bf);
        void *py = (void *)elt(y, r * stride, bf);
#pragma omp simd
        for (int64_t i = 0; i < len; i++) st_out(py, (size_t)i, (ampc__cpu_ld(px, (size_t)i, bf) - m) * a + b, bf, relu);
    }
}

/* o = k * g + a * (x - m) + b (o may be g's or x's array) */
AMPC_CPU_INLINE void affine2_body(const void *g, const void *x, void *o, int64_t runs, int64_t stride, int64_t len,
                                  float k, float m, float a, float b, bn_preact_coefs rc, bool bf, bool relu) {
    for (int64_t r = 0; r < runs; r++) {
        const void *pg = elt(g, r * stride, bf), *px = elt(x, r * stride, bf);
        void *po = (void *)elt(o, r * stride, bf);
#pragma omp simd
        for (int64_t i = 0; i < len; i++) {
            float xv = ampc__cpu_ld(px, (size_t)i, bf);
            float gv = relu_mask(ampc__cpu_ld(pg, (size_t)i, bf), xv, rc.m, rc.a, rc.b, bf, relu);
            ampc__cpu_st(po, (size_t)i, k * gv + a * (xv - m) + b, bf);
        }
    }
}

/* Per-column versions over `rows` consecutive rows of n values: acc[j] += x[j];
   acc[j] += (x[j] - m[j])^2; the gradient sums; the affine maps with per-column coefficients. */
AMPC_CPU_INLINE void col_add_body(double *acc, const void *x, size_t rows, size_t n, bool bf) {
    for (size_t r = 0; r < rows; r++) {
        const void *p = elt(x, (int64_t)(r * n), bf);
#pragma omp simd
        for (size_t j = 0; j < n; j++) acc[j] += (double)ampc__cpu_ld(p, j, bf);
    }
}

AMPC_CPU_INLINE void col_sq_dev_body(double *acc, const void *x, const double *m, size_t rows, size_t n, bool bf) {
    for (size_t r = 0; r < rows; r++) {
        const void *p = elt(x, (int64_t)(r * n), bf);
#pragma omp simd
        for (size_t j = 0; j < n; j++) {
            double d = (double)ampc__cpu_ld(p, j, bf) - m[j];
            acc[j] += d * d;
        }
    }
}

AMPC_CPU_INLINE void col_grad_body(double *sg, double *sgx, const void *g, const void *x, const float *m, size_t rows,
                                   size_t n, bn_rcv rc, bool bf, bool relu) {
    for (size_t r = 0; r < rows; r++) {
        const void *pg = elt(g, (int64_t)(r * n), bf), *px = elt(x, (int64_t)(r * n), bf);
#pragma omp simd
        for (size_t j = 0; j < n; j++) {
            float xv = ampc__cpu_ld(px, j, bf);
            double gv = (double)relu_mask(ampc__cpu_ld(pg, j, bf), xv, relu ? rc.m[j] : 0, relu ? rc.a[j] : 0,
                                          relu ? rc.b[j] : 0, bf, relu);
            sg[j] += gv;
            sgx[j] += gv * ((double)xv - m[j]);
        }
    }
}

AMPC_CPU_INLINE void col_affine_body(const void *x, void *y, size_t rows, size_t n, const float *m, const float *a,
                                     const float *b, bool bf, bool relu) {
    for (size_t r = 0; r < rows; r++) {
        const void *px = elt(x, (int64_t)(r * n), bf);
        void *py = (void *)elt(y, (int64_t)(r * n), bf);
#pragma omp simd
        for (size_t j = 0; j < n; j++) st_out(py, j, (ampc__cpu_ld(px, j, bf) - m[j]) * a[j] + b[j], bf, relu);
    }
}

AMPC_CPU_INLINE void col_affine2_body(const void *g, const void *x, void *o, size_t rows, size_t n, const float *k,
                                      const float *m, const float *a, const float *b, bn_rcv rc, bool bf, bool relu) {
    for (size_t r = 0; r < rows; r++) {
        const void *pg = elt(g, (int64_t)(r * n), bf), *px = elt(x, (int64_t)(r * n), bf);
        void *po = (void *)elt(o, (int64_t)(r * n), bf);
#pragma omp simd
        for (size_t j = 0; j < n; j++) {
            float xv = ampc__cpu_ld(px, j, bf);
            float gv = relu_mask(ampc__cpu_ld(pg, j, bf), xv, relu ? rc.m[j] : 0, relu ? rc.a[j] : 0, relu ? rc.b[j] : 0,
                                 bf, relu);
            ampc__cpu_st(po, j, k[j] * gv + a[j] * (xv - m[j]) + b[j], bf);
        }
    }
}

/* Each loop compiled for f32 and for bf16 storage, without and with the fused ReLU (AVX-512/AVX2
   clones of each), collected in one table per variant. */
typedef struct {
    double (*sum)(const void *x, int64_t runs, int64_t stride, int64_t len);
    double (*sq_dev)(const void *x, int64_t runs, int64_t stride, int64_t len, double m);
    void (*grad_sums)(const void *g, const void *x, int64_t runs, int64_t stride, int64_t len, double m, double *sg,
                      double *sgx, bn_preact_coefs rc);
    void (*affine)(const void *x, void *y, int64_t runs, int64_t stride, int64_t len, float m, float a, float b);
    void (*affine2)(const void *g, const void *x, void *o, int64_t runs, int64_t stride, int64_t len, float k, float m,
                    float a, float b, bn_preact_coefs rc);
    void (*col_add)(double *acc, const void *x, size_t rows, size_t n);
    void (*col_sq_dev)(double *acc, const void *x, const double *m, size_t rows, size_t n);
    void (*col_grad)(double *sg, double *sgx, const void *g, const void *x, const float *m, size_t rows, size_t n,
                     bn_rcv rc);
    void (*col_affine)(const void *x, void *y, size_t rows, size_t n, const float *m, const float *a, const float *b);
    void (*col_affine2)(const void *g, const void *x, void *o, size_t rows, size_t n, const float *k, const float *m,
                        const float *a, const float *b, bn_rcv rc);
} vec_fns;

/* the statistics loops, which a fused ReLU does not change */
#define VEC_STAT_FNS(T, BF)                                                                        \
    AMPC_CPU_VEC static double sum_##T(const void *x, int64_t runs, int64_t stride, int64_t len) {  \
        return sum_body(x, runs, stride, len, BF);                                                 \
    }                                                                                              \
    AMPC_CPU_VEC static double sq_dev_##T(const void *x, int64_t runs, int64_t stride, int64_t len, double m) { \
        return sq_dev_body(x, runs, stride, len, m, BF);                                           \
    }                                                                                              \
    AMPC_CPU_VEC static void col_add_##T(double *acc, const void *x, size_t rows, size_t n) {    \
        col_add_body(acc, x, rows, n, BF);                                                         \
    }                                                                                              \
    AMPC_CPU_VEC static void col_sq_dev_##T(double *acc, const void *x, const double *m, size_t rows, size_t n) { \
        col_sq_dev_body(acc, x, m, rows, n, BF);                                                   \
    }

#define VEC_FNS(T, S, BF, RELU)                                                                    \
    AMPC_CPU_VEC static void grad_sums_##T(const void *g, const void *x, int64_t runs, int64_t stride, int64_t len, \
                                           double m, double *sg, double *sgx, bn_preact_coefs rc) {   \
        grad_sums_body(g, x, runs, stride, len, m, sg, sgx, rc, BF, RELU);                         \
    }                                                                                              \
    AMPC_CPU_VEC static void affine_##T(const void *x, void *y, int64_t runs, int64_t stride, int64_t len, float m, \
                                        float a, float b) {                                        \
        affine_body(x, y, runs, stride, len, m, a, b, BF, RELU);                                   \
    }                                                                                              \
    AMPC_CPU_VEC static void affine2_##T(const void *g, const void *x, void *o, int64_t runs, int64_t stride,       \
                                         int64_t len, float k, float m, float a, float b, bn_preact_coefs rc) { \
        affine2_body(g, x, o, runs, stride, len, k, m, a, b, rc, BF, RELU);                        \
    }                                                                                              \
    AMPC_CPU_VEC static void col_grad_##T(double *sg, double *sgx, const void *g, const void *x, const float *m,    \
                                          size_t rows, size_t n, bn_rcv rc) {                      \
        col_grad_body(sg, sgx, g, x, m, rows, n, rc, BF, RELU);                                    \
    }                                                                                              \
    AMPC_CPU_VEC static void col_affine_##T(const void *x, void *y, size_t rows, size_t n, const float *m,          \
                                            const float *a, const float *b) {                      \
        col_affine_body(x, y, rows, n, m, a, b, BF, RELU);                                         \
    }                                                                                              \
    AMPC_CPU_VEC static void col_affine2_##T(const void *g, const void *x, void *o, size_t rows, size_t n,          \
                                             const float *k, const float *m, const float *a, const float *b,       \
                                             bn_rcv rc) {                                          \
        col_affine2_body(g, x, o, rows, n, k, m, a, b, rc, BF, RELU);                              \
    }                                                                                              \
    static const vec_fns fns_##T = {sum_##S,     sq_dev_##S,     grad_sums_##T, affine_##T,     affine2_##T,       \
                                    col_add_##S, col_sq_dev_##S, col_grad_##T,  col_affine_##T, col_affine2_##T};

VEC_STAT_FNS(f32, false)
VEC_STAT_FNS(bf16, true)
VEC_FNS(f32, f32, false, false)
VEC_FNS(bf16, bf16, true, false)
VEC_FNS(f32_relu, f32, false, true)
VEC_FNS(bf16_relu, bf16, true, true)

// ---------------------------------------------------------------------------------------------
// Workspace and row blocks

typedef struct {
    void *p;
    size_t bytes;
} ws_block;

static inline void *ws_get(ws_block *w, size_t bytes) {
    w->p = ampc__alloc(AMPC_DEVICE_CPU, bytes ? bytes : 1, AMPC_MEM_WORKSPACE, &w->bytes);
    return w->p;
}
static inline void ws_put(ws_block *w) {
    if (w->p) ampc__free(AMPC_DEVICE_CPU, w->p, w->bytes, AMPC_MEM_WORKSPACE);
    w->p = NULL;
}

static inline int threads_for_items(int64_t items, int64_t numel) {
    int nt = ampc__threads_for(numel);
    return items < nt ? (int)(items > 0 ? items : 1) : nt;
}

static inline const float *f32_or_null(const ampc_tensor *t) { return t ? (const float *)ampc__data(t) : NULL; }

/* Rows of block bi of nb over N rows. */
static inline void row_block(int64_t N, int64_t nb, int64_t bi, int64_t *r0, int64_t *r1) {
    *r0 = N * bi / nb;
    *r1 = N * (bi + 1) / nb;
}
#endif /* AMPC_CPU_NORM_H */
