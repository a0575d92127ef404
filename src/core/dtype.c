/*
 * dtype.c - the dtype table, scalar fp16/bf16 conversions (the rounding itself is defined once,
 * in round.h; these are the bit-exact reference for the vectorized ones in convert_x86.c) and
 * the bulk-conversion entry points.
 */
#include "core/core.h"
#include "core/convert.h"
#include "core/round.h"

#include <math.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Scalar conversions

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

uint16_t ampc_f32_to_f16(float f) { return ampc__round_f16(f); }

float ampc_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        float v = (float)m * 0x1p-24f;   /* exact: m < 2^10 */
        return bits_f32(f32_bits(v) | sign);
    }
    if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t ampc_f32_to_bf16(float f) { return ampc__round_bf16(f); }

float ampc_bf16_to_f32(uint16_t h) { return ampc__widen_bf16(h); }

/* f64 -> f32 rounding to odd: a following RNE narrowing to f16/bf16 is then correctly rounded
   (f32 has >= 2 more significand bits than both), avoiding double rounding. */
static float f64_to_f32_odd(double d) {
    float f = (float)d;
    if (isnan(d) || isinf(d) || (double)f == d) return f;
    uint32_t u = f32_bits(f);
    if (fabs((double)f) > fabs(d)) u--;   /* step back toward zero (also from inf) */
    return bits_f32(u | 1u);
}

// ---------------------------------------------------------------------------------------------
// Plain C loops

void ampc__f32_to_f16_c(const float *src, uint16_t *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = ampc__round_f16(src[i]);
}
void ampc__f16_to_f32_c(const uint16_t *src, float *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = ampc_f16_to_f32(src[i]);
}
void ampc__f32_to_bf16_c(const float *src, uint16_t *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = ampc__round_bf16(src[i]);
}
void ampc__bf16_to_f32_c(const uint16_t *src, float *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = ampc__widen_bf16(src[i]);
}

ampc_convert_fns ampc__convert = {
    .name = "c",
    .f32_to_f16 = ampc__f32_to_f16_c,
    .f16_to_f32 = ampc__f16_to_f32_c,
    .f32_to_bf16 = ampc__f32_to_bf16_c,
    .bf16_to_f32 = ampc__bf16_to_f32_c,
};

void ampc_convert_f32_to_f16(const float *s, uint16_t *d, size_t n) { ampc__ensure_init(); ampc__convert.f32_to_f16(s, d, n); }
void ampc_convert_f16_to_f32(const uint16_t *s, float *d, size_t n) { ampc__ensure_init(); ampc__convert.f16_to_f32(s, d, n); }
void ampc_convert_f32_to_bf16(const float *s, uint16_t *d, size_t n) { ampc__ensure_init(); ampc__convert.f32_to_bf16(s, d, n); }
void ampc_convert_bf16_to_f32(const uint16_t *s, float *d, size_t n) { ampc__ensure_init(); ampc__convert.bf16_to_f32(s, d, n); }

// ---------------------------------------------------------------------------------------------
// Table entries

static void f32_to_f32(const void *s, float *d, size_t n) { memcpy(d, s, n * 4); }
static void f32_from_f32(const float *s, void *d, size_t n) { memcpy(d, s, n * 4); }
static void f32_to_f64(const void *s, double *d, size_t n) { const float *p = s; for (size_t i = 0; i < n; i++) d[i] = p[i]; }
static void f32_from_f64(const double *s, void *d, size_t n) { float *p = d; for (size_t i = 0; i < n; i++) p[i] = (float)s[i]; }

static void f16_to_f32(const void *s, float *d, size_t n) { ampc__convert.f16_to_f32(s, d, n); }
static void f16_from_f32(const float *s, void *d, size_t n) { ampc__convert.f32_to_f16(s, d, n); }
static void f16_to_f64(const void *s, double *d, size_t n) { const uint16_t *p = s; for (size_t i = 0; i < n; i++) d[i] = ampc_f16_to_f32(p[i]); }
static void f16_from_f64(const double *s, void *d, size_t n) { uint16_t *p = d; for (size_t i = 0; i < n; i++) p[i] = ampc__round_f16(f64_to_f32_odd(s[i])); }

static void bf16_to_f32(const void *s, float *d, size_t n) { ampc__convert.bf16_to_f32(s, d, n); }
static void bf16_from_f32(const float *s, void *d, size_t n) { ampc__convert.f32_to_bf16(s, d, n); }
static void bf16_to_f64(const void *s, double *d, size_t n) { const uint16_t *p = s; for (size_t i = 0; i < n; i++) d[i] = ampc__widen_bf16(p[i]); }
static void bf16_from_f64(const double *s, void *d, size_t n) { uint16_t *p = d; for (size_t i = 0; i < n; i++) p[i] = ampc__round_bf16(f64_to_f32_odd(s[i])); }

static void f64_to_f32(const void *s, float *d, size_t n) { const double *p = s; for (size_t i = 0; i < n; i++) d[i] = (float)p[i]; }
static void f64_from_f32(const float *s, void *d, size_t n) { double *p = d; for (size_t i = 0; i < n; i++) p[i] = s[i]; }
static void f64_to_f64(const void *s, double *d, size_t n) { memcpy(d, s, n * 8); }
static void f64_from_f64(const double *s, void *d, size_t n) { memcpy(d, s, n * 8); }

static void i64_to_f32(const void *s, float *d, size_t n) { const int64_t *p = s; for (size_t i = 0; i < n; i++) d[i] = (float)p[i]; }
static void i64_from_f32(const float *s, void *d, size_t n) { int64_t *p = d; for (size_t i = 0; i < n; i++) p[i] = (int64_t)s[i]; }
static void i64_to_f64(const void *s, double *d, size_t n) { const int64_t *p = s; for (size_t i = 0; i < n; i++) d[i] = (double)p[i]; }
static void i64_from_f64(const double *s, void *d, size_t n) { int64_t *p = d; for (size_t i = 0; i < n; i++) p[i] = (int64_t)s[i]; }

const ampc_dtype_traits ampc__dtype_traits[AMPC_DTYPE_COUNT] = {
    [AMPC_F32] = {"f32", 4, true, f32_to_f32, f32_from_f32, f32_to_f64, f32_from_f64, 0x1p-24, 3.4028234663852886e38},
    [AMPC_F16] = {"f16", 2, true, f16_to_f32, f16_from_f32, f16_to_f64, f16_from_f64, 0x1p-11, 65504.0},
    [AMPC_BF16] = {"bf16", 2, true, bf16_to_f32, bf16_from_f32, bf16_to_f64, bf16_from_f64, 0x1p-8, 3.3895313892515355e38},
    [AMPC_F64] = {"f64", 8, true, f64_to_f32, f64_from_f32, f64_to_f64, f64_from_f64, 0x1p-53, 1.7976931348623157e308},
    [AMPC_I64] = {"i64", 8, false, i64_to_f32, i64_from_f32, i64_to_f64, i64_from_f64, 0.0, 9.2233720368547758e18},
};

const char *ampc_dtype_name(ampc_dtype dt) { return (unsigned)dt < AMPC_DTYPE_COUNT ? ampc__dtype_traits[dt].name : "?"; }
size_t ampc_dtype_size(ampc_dtype dt) { return (unsigned)dt < AMPC_DTYPE_COUNT ? ampc__dtype_traits[dt].size : 0; }
bool ampc_dtype_is_float(ampc_dtype dt) { return (unsigned)dt < AMPC_DTYPE_COUNT && ampc__dtype_traits[dt].is_float; }

ampc_dtype ampc__promote(ampc_dtype a, ampc_dtype b) {
    if (a == b) return a;
    if (a == AMPC_F64 || b == AMPC_F64) return AMPC_F64;
    if (a == AMPC_I64) return b;
    if (b == AMPC_I64) return a;
    return AMPC_F32;   /* f32 with anything narrower, or f16 with bf16 */
}
