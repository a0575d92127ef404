/*
 * round.h - f32 -> f16 / bf16 rounding, defined once: the scalar definitions (dtype.c's table
 * and ampc_f32_to_f16/_bf16 are them) and their vector forms, which the bulk conversions
 * (convert_x86.c) and the CPU kernels (backend/cpu) use. Also the exact bf16 -> f32 widening.
 *
 * Both round to nearest even whatever MXCSR says, keep subnormals, turn values beyond the
 * format's range into inf, and keep a NaN a NaN: quieted (top fraction bit set), sign and top
 * payload bits kept, so it cannot round into inf. tests/test_rounding.c checks every vector
 * form against the scalar one on all 2^32 f32 patterns, and the scalar ones against rounding
 * done in double arithmetic.
 */
#ifndef AMPC_ROUND_H
#define AMPC_ROUND_H

#include <stdint.h>

// ---------------------------------------------------------------------------------------------
// Scalar definitions

/* RNE on the bits: x + 0x7fff + (bit 16 of x), then the top half (a carry into the exponent is
   the correct rounding up, into inf the overflow). Written as a select, so loops using it
   vectorize (the kernels' target_clones loops do). */
static inline uint16_t ampc__round_bf16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    uint32_t x = v.u, r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16, nan = (x >> 16) | 0x40u;
    return (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? nan : r);
}

/* bf16 -> f32: the 16 bits on top of an f32, exact. */
static inline float ampc__widen_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

static inline uint16_t ampc__round_f16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    uint32_t x = v.u, ax = x & 0x7fffffffu;
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));   /* quiet NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);   /* >= 65520 rounds to inf */
    if (ax >= 0x38800000u) {                                     /* normal half */
        uint32_t h = ax - (112u << 23);
        return (uint16_t)(sign | ((h + 0x0fffu + ((h >> 13) & 1u)) >> 13));
    }
    uint32_t e = ax >> 23;
    if (e < 102) return sign;                                    /* below 2^-25: zero */
    uint32_t m = (ax & 0x7fffffu) | 0x800000u, s = 126 - e;     /* value / 2^-24 = m >> s */
    uint32_t q = m >> s, rem = m & ((1u << s) - 1), half = 1u << (s - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

// ---------------------------------------------------------------------------------------------
// Vector forms (x86; each compiled for the features in its target attribute, inlined into
// callers compiled for at least those)

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define AMPC_ROUND_X86 1
#include <immintrin.h>

#define AMPC_ROUND_INLINE(features) static inline __attribute__((always_inline, target(features)))

/* Round to nearest even whatever MXCSR.RC says, and raise no precision exception. */
#define AMPC_F16_ROUND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* f16, 8 and 16 lanes: VCVTPS2PH rounds as ampc__round_f16 (RNE, subnormals kept, NaNs quieted
   with the top 10 payload bits kept). */
AMPC_ROUND_INLINE("f16c") __m128i ampc__round_f16_x8(__m256 v) { return _mm256_cvtps_ph(v, AMPC_F16_ROUND); }
AMPC_ROUND_INLINE("avx512f") __m256i ampc__round_f16_x16(__m512 v) { return _mm512_cvtps_ph(v, AMPC_F16_ROUND); }

/* bf16 in integer arithmetic, ampc__round_bf16 lane by lane: x holds f32 bits, the result bf16
   bits in 32-bit lanes (0..0xffff, so a saturating pack or VPMOVDW is exact). Never
   VCVTNEPS2BF16 alone: it reads subnormal inputs as zero (see ampc__round_bf16_x32). */
AMPC_ROUND_INLINE("avx2") __m256i ampc__round_bf16_x8(__m256i x) {
    __m256i hi = _mm256_srli_epi32(x, 16);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)),
                                                   _mm256_and_si256(hi, _mm256_set1_epi32(1))), 16);
    /* |x| > inf as signed ints is fine: the sign bit is masked off */
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}

AMPC_ROUND_INLINE("avx512f") __m512i ampc__round_bf16_x16(__m512i x) {
    __m512i hi = _mm512_srli_epi32(x, 16);
    __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
}

/* 32 results (v0: the first 16) as 32 packed bf16, on AVX512_BF16. VCVTNE2PS2BF16 rounds as
   ampc__round_bf16 (to nearest even, NaN quieted the same) in one instruction, but reads
   subnormal inputs as zero (normal inputs never round to a subnormal): vectors holding one take
   the integer path. */
AMPC_ROUND_INLINE("avx512f,avx512bw,avx512dq,avx512bf16") __m512i ampc__round_bf16_x32(__m512 v0, __m512 v1) {
    if (!(_mm512_fpclass_ps_mask(v0, 0x20) | _mm512_fpclass_ps_mask(v1, 0x20)))   /* 0x20: denormal */
        return (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
    __m256i lo = _mm512_cvtepi32_epi16(ampc__round_bf16_x16(_mm512_castps_si512(v0)));
    __m256i hi = _mm512_cvtepi32_epi16(ampc__round_bf16_x16(_mm512_castps_si512(v1)));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
#endif

#endif /* AMPC_ROUND_H */
