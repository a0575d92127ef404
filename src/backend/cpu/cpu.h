/*
 * cpu.h - shared helpers of the CPU kernels. Every kernel computes in f32 whatever the storage
 * dtype ("load, convert, compute, store"), in one of two ways:
 *   - in registers: loops read f32 or bf16 storage in place through ampc__cpu_ld/ampc__cpu_st
 *     (bf16 <-> f32 is integer shifts and adds), compiled with AMPC_CPU_VEC for AVX-512/AVX2;
 *   - staged: chunks of AMPC_CPU_CHUNK values converted into f32 stack buffers
 *     (ampc__cpu_load/_out/_store), for f16 (F16C conversions) and mixed dtypes.
 */
#ifndef AMPC_CPU_H
#define AMPC_CPU_H

#include "backend/backend.h"
#include "core/round.h"

#include <math.h>
#include <string.h>

#define AMPC_CPU_CHUNK 1024   /* elements per f32 staging buffer (4 KiB, on the stack) */

/* AVX-512 and AVX2 clones of a loop, picked at load time: the build has no -march, and the
   binary still runs on any x86-64. Both vector levels have FMA (x86-64-v3 is AVX2 + FMA), so
   the polynomials' explicit fmaf below are one instruction there; ISO C mode contracts nothing
   by itself, and a fused multiply-add rounds alike everywhere (libm's fmaf in the baseline
   clone), so the clones differ only in the order of their sums. */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define AMPC_CPU_VEC __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef AMPC_CPU_VEC
#define AMPC_CPU_VEC
#endif

/* For loop bodies written once over a `bool bf16` that the callers pass as a constant: each
   caller (one per storage type) gets its own branch-free copy. */
#define AMPC_CPU_INLINE static inline __attribute__((always_inline))

/* bf16 <-> f32 in registers: core/round.h's exact widening and its rounding (the bits of
   ampc_f32_to_bf16), which vectorizes in the loops. */
AMPC_CPU_INLINE float ampc__cpu_bf16_f32(uint16_t h) { return ampc__widen_bf16(h); }
AMPC_CPU_INLINE uint16_t ampc__cpu_f32_bf16(float f) { return ampc__round_bf16(f); }

AMPC_CPU_INLINE uint32_t ampc__cpu_fbits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}
AMPC_CPU_INLINE float ampc__cpu_bitsf(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}
/* c ? a : b on the bit patterns: with -ftrapping-math (the default) gcc does not if-convert
   float selects, which would keep the loops around ampc__cpu_exp from vectorizing. */
AMPC_CPU_INLINE float ampc__cpu_fsel(uint32_t c, float a, float b) {
    uint32_t m = 0u - c;
    return ampc__cpu_bitsf((ampc__cpu_fbits(a) & m) | (ampc__cpu_fbits(b) & ~m));
}

/* exp(a + b) in plain arithmetic so loops over it vectorize, with a + b never rounded as a
   sum: Cephes' expf (range reduction by ln 2 in two parts, degree-6 polynomial; within 1 ulp of
   exp on [-87.3, 88.3]), the reduction r = a - n ln 2 + b taken from a exactly (n ln 2's first
   part has 9 bits, so a - n C1 is one fused rounding) and b added after, so b may carry the
   low part of an argument (exp(a + b) of an exact a + b split in two floats). Results below
   FLT_MIN flush to 0 (they vanish next to a softmax denominator >= 1), -inf gives 0, NaN stays
   NaN, arguments above 88.3 clamp (callers pass x - max <= 0). */
AMPC_CPU_INLINE float ampc__cpu_exp2(float a, float b) {
    const float lo = -87.33654f, hi = 88.3f, x = a + b;   /* x only picks n and the range */
    uint32_t xb = ampc__cpu_fbits(x);
    uint32_t nan = (xb & 0x7fffffffu) > 0x7f800000u;
    uint32_t under = xb > ampc__cpu_fbits(lo);                            /* negative and below lo */
    uint32_t over = (xb < 0x80000000u) & (xb > ampc__cpu_fbits(hi));      /* positive and above hi */
    float ac = ampc__cpu_fsel(under, lo, ampc__cpu_fsel(over, hi, a));   /* out of range: a clamped, b kept */
    /* n = round(x / ln 2) by adding 1.5 * 2^23: the low mantissa bits of t then hold n */
    float t = fmaf(ampc__cpu_fsel(under | over, ac, x), 1.44269504088896341f, 12582912.0f);
    float n = t - 12582912.0f;
    float r = fmaf(n, 2.12194440e-4f, fmaf(n, -0.693359375f, ac) + b);   /* a + b - n ln 2 */
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    float y = p * ampc__cpu_bitsf((ampc__cpu_fbits(t) - 0x4B400000u + 127u) << 23);   /* * 2^n, n in [-126, 127] */
    return ampc__cpu_fsel(nan, x, ampc__cpu_fsel(under, 0.0f, y));
}

/* exp(x), as above (tests in tests/test_loss.c); the softmax and cross-entropy (loss.c),
   attention and exact GELU use it. */
AMPC_CPU_INLINE float ampc__cpu_exp(float x) { return ampc__cpu_exp2(x, -0.0f); }   /* x + -0 is x: folded away */

/* The standard normal CDF Phi(x) = erfc(-x / sqrt 2) / 2 (exact GELU's gate), vectorizable, and
   relatively accurate in the tails too (no 1 + erf cancellation): erfc by Numerical Recipes'
   Chebyshev fit t exp(-z^2 - 1.26551223 + t c(t)) (fractional error < 1.2e-7), with z^2 = x^2 / 2
   carried exactly (x x and its rounding error by fma) into the exponential's two parts, so the
   large -z^2 is never rounded into a sum. Measured against erfc in double over [-12, 12] (step
   1e-5): within 5e-7 relative (8 ulp) everywhere; libm's 1 + erff(x / sqrt 2) loses all
   relative accuracy below x = -4. tests/test_ops.c holds it to 1e-6 over [-13, 13]. */
AMPC_CPU_INLINE float ampc__cpu_phi(float x) {
    const float z = fabsf(x) * 0.70710678118654752440f, t = 1.0f / fmaf(0.5f, z, 1.0f);
    float c = 0.17087277f;
    c = fmaf(c, t, -0.82215223f);
    c = fmaf(c, t, 1.48851587f);
    c = fmaf(c, t, -1.13520398f);
    c = fmaf(c, t, 0.27886807f);
    c = fmaf(c, t, -0.18628806f);
    c = fmaf(c, t, 0.09678418f);
    c = fmaf(c, t, 0.37409196f);
    c = fmaf(c, t, 1.00002368f);
    const float xx = x * x, xx_err = fmaf(x, x, -xx);   /* x^2 = xx + xx_err exactly; z^2 is half of it */
    const float half_erfc = 0.5f * t * ampc__cpu_exp2(-0.5f * xx, fmaf(t, c, fmaf(-0.5f, xx_err, -1.26551223f)));   /* erfc(|x| / sqrt 2) / 2 */
    return x < 0.0f ? half_erfc : 1.0f - half_erfc;
}

/* The logistic function 1 / (1 + exp(-x)) from e = exp(-|x|) <= 1 (no overflow, and relatively
   accurate on both sides: e / (1 + e) for x < 0); results below FLT_MIN flush to 0. */
AMPC_CPU_INLINE float ampc__cpu_sigmoid(float x) {
    const float e = ampc__cpu_exp(-fabsf(x)), r = 1.0f / (1.0f + e);
    return x < 0.0f ? e * r : r;
}
/* sigmoid(x) and, in *rest, 1 - sigmoid(x) = sigmoid(-x), each relatively accurate (the
   derivatives' s (1 - s) without 1 - s's cancellation) */
AMPC_CPU_INLINE float ampc__cpu_sigmoid2(float x, float *rest) {
    const float e = ampc__cpu_exp(-fabsf(x)), r = 1.0f / (1.0f + e);
    *rest = x < 0.0f ? r : e * r;
    return x < 0.0f ? e * r : r;
}

/* tanh(x), vectorizable: Cephes' tanhf (an odd polynomial below |x| = 0.625, where 1 - exp
   would cancel; (1 - e) / (1 + e), e = exp(-2|x|), above), within 2 ulp. */
AMPC_CPU_INLINE float ampc__cpu_tanh(float x) {
    const float ax = fabsf(x), z = x * x;
    float p = -5.70498872745e-3f;
    p = fmaf(p, z, 2.06390887954e-2f);
    p = fmaf(p, z, -5.37397155531e-2f);
    p = fmaf(p, z, 1.33314422036e-1f);
    p = fmaf(p, z, -3.33332819422e-1f);
    const float small = fmaf(p * z, x, x);
    const float e = ampc__cpu_exp(-2.0f * ax), big = (1.0f - e) / (1.0f + e);
    return ax < 0.625f ? small : x < 0.0f ? -big : big;
}

/* Element i of f32 (bf16 false) or bf16 storage, as f32; and the store of an f32 result. */
AMPC_CPU_INLINE float ampc__cpu_ld(const void *p, size_t i, bool bf16) {
    return bf16 ? ampc__cpu_bf16_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
AMPC_CPU_INLINE void ampc__cpu_st(void *p, size_t i, float v, bool bf16) {
    if (bf16) ((uint16_t *)p)[i] = ampc__cpu_f32_bf16(v);
    else ((float *)p)[i] = v;
}

/* Storage the register path reads in place: f32 and bf16 (f16 takes the staged path). */
static inline bool ampc__cpu_direct(ampc_dtype dt) { return dt == AMPC_F32 || dt == AMPC_BF16; }

/* Address of element i of t. */
static inline void *ampc__cpu_at(const ampc_tensor *t, size_t i) {
    return (char *)ampc__data(t) + i * ampc__dt(t->dtype)->size;
}

/* n elements of t starting at element i, as f32 into buf (no copy for f32: returns a pointer
   into t's storage). */
static inline const float *ampc__cpu_load(const ampc_tensor *t, size_t i, size_t n, float *buf) {
    if (t->dtype == AMPC_F32) return (const float *)ampc__data(t) + i;
    ampc__dt(t->dtype)->to_f32((const char *)ampc__data(t) + i * ampc__dt(t->dtype)->size, buf, n);
    return buf;
}

/* Where to compute n f32 results for elements [i, i+n) of t: t's storage for f32, else buf. */
static inline float *ampc__cpu_out(ampc_tensor *t, size_t i, float *buf) {
    return t->dtype == AMPC_F32 ? (float *)ampc__data(t) + i : buf;
}

/* Stores the n results computed by ampc__cpu_out (a no-op for f32). */
static inline void ampc__cpu_store(ampc_tensor *t, size_t i, size_t n, const float *buf) {
    if (t->dtype == AMPC_F32) return;
    ampc__dt(t->dtype)->from_f32(buf, (char *)ampc__data(t) + i * ampc__dt(t->dtype)->size, n);
}

/* Blocks of several tensors in one parallel loop: tensor j's blocks of blk elements are
   numbered from first[j] (first[0] = 0, first[k] = the total), so one `omp for` over all of
   them wakes the thread team once for the lot. Fills first (k + 1 entries), returns the total
   number of elements. */
static inline size_t ampc__cpu_blocks_plan(const size_t *n, int k, size_t blk, size_t *first) {
    size_t elems = 0;
    first[0] = 0;
    for (int j = 0; j < k; j++) {
        first[j + 1] = first[j] + (n[j] + blk - 1) / blk;
        elems += n[j];
    }
    return elems;
}
/* The tensor holding block b of a plan (first[j] <= b < first[j + 1]), and where in it the
   block starts; *len its length. */
static inline int ampc__cpu_block_at(const size_t *first, int k, size_t b, size_t blk, const size_t *n, size_t *base,
                                     size_t *len) {
    int lo = 0, hi = k - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first[mid] <= b) lo = mid;
        else hi = mid - 1;
    }
    *base = (b - first[lo]) * blk;
    *len = n[lo] - *base < blk ? n[lo] - *base : blk;
    return lo;
}

/* Implementation name of the kernel that runs this gemm into buf: "skinny:rows:avx512" or
   "skinny:dots:avx512" (gemm_skinny.c), or the one oneDNN picked (e.g. "brg:avx512_core_bf16"),
   creating and caching the primitive if needed (gemm.c). For benchmarks and tests. */
int ampc__cpu_gemm_impl(const ampc_gemm_desc *d, ampc_dtype dt, bool has_bias, char *buf, size_t n);
/* Same for a convolution pass (0 forward, 1 backward data, 2 backward weights; conv.c). */
int ampc__cpu_conv_impl(const ampc_conv_desc *d, ampc_dtype dt, int pass, bool has_bias, char *buf, size_t n);

/* gemm_skinny.c: AVX-512 kernels for gemms with one small dimension (M, N or K <= 16), run by
   cpu_gemm in place of oneDNN. _takes says whether they run the normalised desc d (batch 1)
   for operands of dtype dt, with the kernel's name in *name (may be NULL); _run computes it
   (a, b, bias, c as the backend's gemm). ampc__cpu_gemm_skinny: -1 the measured rule (default),
   0 never, 1 whenever the layout, dtype and CPU allow (tests and benchmarks). */
extern int ampc__cpu_gemm_skinny;
bool ampc__cpu_gemm_skinny_takes(const ampc_gemm_desc *d, ampc_dtype dt, const char **name);
int ampc__cpu_gemm_skinny_run(const ampc_gemm_desc *d, const ampc_tensor *a, const ampc_tensor *b,
                              const ampc_tensor *bias, ampc_tensor *c);

/* The convolution's switches for tests and benchmarks (conv_choose.c, conv_im2col.c): the NHWC
   im2col + matmul path for convolution passes (-1: its measured rule, 0: never, 1: always),
   the cap on its columns buffer, oneDNN's Winograd kernels (-1: ampc_conv_winograd and the
   rule, 0: never, 1: every shape they take, whatever its workspace) and the cap on a chunk's
   blocked copies of the activations there (conv_wino.c). */
extern int ampc__cpu_conv_im2col;
extern int ampc__cpu_conv_winograd;
extern size_t ampc__cpu_conv_im2col_cap;
extern size_t ampc__cpu_conv_wino_cap;

/* random.c: keep[j] = 1 iff draw first + j of rng survives a dropout of probability p (the
   dropout kernel's rule: its uniform not below p), else 0, for j < n; any first. */
void ampc__cpu_dropout_keep(ampc_rng_state rng, uint64_t first, size_t n, double p, uint8_t *keep);

#endif /* AMPC_CPU_H */
