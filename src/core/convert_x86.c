/*
 * convert_x86.c - vectorized f32 <-> f16/bf16 bulk conversions, chosen at start-up from the
 * CPU's features (ampc__convert_init) or forced by tests (ampc__convert_select).
 *
 * Levels, each filling the ampc__convert table (convert.h):
 *   "c"          dtype.c's scalar loops
 *   "avx2+f16c"  8 lanes: F16C for f16, AVX2 integer arithmetic for bf16; scalar tails
 *   "avx512"     16 lanes: AVX512F, plus AVX512BW for the masked 16-bit loads/stores of tails
 *
 * The rounding itself (scalar and per vector width) is round.h's; the scalar functions in
 * dtype.c are the bit-exact reference: every level gives the same bits for every input, NaN
 * payloads included (tests/test_dtype.c checks this for each level, tests/test_rounding.c the
 * vector roundings on all 2^32 inputs).
 */
#include "core/convert.h"
#include "core/round.h"

#include <string.h>

enum { LEVEL_C, LEVEL_AVX2, LEVEL_AVX512 };

#ifdef AMPC_ROUND_X86

#define TARGET_AVX2 __attribute__((target("avx2,f16c")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw")))

/* bf16 uses round.h's integer arithmetic, never VCVTNEPS2BF16 (AVX512_BF16): that instruction
   reads subnormal inputs as zero, while ampc keeps bf16 subnormals. */

// ---------------------------------------------------------------------------------------------
// AVX2 + F16C: 8 lanes

TARGET_AVX2 static void f32_to_f16_avx2(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(dst + i), ampc__round_f16_x8(_mm256_loadu_ps(src + i)));
    for (; i < n; i++) dst[i] = ampc__round_f16(src[i]);
}

/* VCVTPH2PS quiets signalling NaNs (sets f32 bit 22); ampc_f16_to_f32 keeps a NaN's bits as
   they are (payload << 13), so in NaN lanes bit 22 is put back from the input's bit 9. */
TARGET_AVX2 static inline __m256 f16x8_to_f32(__m128i h) {
    const __m256i bit22 = _mm256_set1_epi32(0x00400000);
    __m256i h32 = _mm256_cvtepu16_epi32(h);
    __m256i f = _mm256_castps_si256(_mm256_cvtph_ps(h));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(h32, _mm256_set1_epi32(0x7fff)), _mm256_set1_epi32(0x7c00));
    __m256i fix = _mm256_and_si256(nan, bit22);
    f = _mm256_or_si256(_mm256_andnot_si256(fix, f), _mm256_and_si256(fix, _mm256_slli_epi32(h32, 13)));
    return _mm256_castsi256_ps(f);
}

TARGET_AVX2 static void f16_to_f32_avx2(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, f16x8_to_f32(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = ampc_f16_to_f32(src[i]);
}

TARGET_AVX2 static void f32_to_bf16_avx2(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i r = ampc__round_bf16_x8(_mm256_loadu_si256((const __m256i *)(src + i)));
        /* lanes hold 0..0xffff, so the unsigned-saturating pack is exact */
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i *)(dst + i), packed);
    }
    for (; i < n; i++) dst[i] = ampc__round_bf16(src[i]);
}

TARGET_AVX2 static void bf16_to_f32_avx2(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i h32 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_slli_epi32(h32, 16));
    }
    for (; i < n; i++) dst[i] = ampc__widen_bf16(src[i]);
}

// ---------------------------------------------------------------------------------------------
// AVX-512: 16 lanes, tails with masked loads and stores

/* Mask of the first k (< 16) lanes. */
static inline __mmask16 tail_mask(size_t k) { return (__mmask16)((1u << k) - 1u); }

TARGET_AVX512 static void f32_to_f16_avx512(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), ampc__round_f16_x16(_mm512_loadu_ps(src + i)));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        __m256i h = ampc__round_f16_x16(_mm512_maskz_loadu_ps(m, src + i));
        _mm512_mask_storeu_epi16(dst + i, m, _mm512_zextsi256_si512(h));
    }
}

/* As f16x8_to_f32: put back the signalling bit that VCVTPH2PS sets in NaN lanes. */
TARGET_AVX512 static inline __m512 f16x16_to_f32(__m256i h) {
    const __m512i bit22 = _mm512_set1_epi32(0x00400000);
    __m512i h32 = _mm512_cvtepu16_epi32(h);
    __m512i f = _mm512_castps_si512(_mm512_cvtph_ps(h));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(h32, _mm512_set1_epi32(0x7fff)), _mm512_set1_epi32(0x7c00));
    __m512i fixed = _mm512_or_si512(_mm512_andnot_si512(bit22, f), _mm512_and_si512(bit22, _mm512_slli_epi32(h32, 13)));
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(f, nan, fixed));
}

TARGET_AVX512 static void f16_to_f32_avx512(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, f16x16_to_f32(_mm256_loadu_si256((const __m256i *)(src + i))));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        __m256i h = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(m, src + i));
        _mm512_mask_storeu_ps(dst + i, m, f16x16_to_f32(h));
    }
}

TARGET_AVX512 static void f32_to_bf16_avx512(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i x = _mm512_loadu_si512(src + i);
        /* Keep x in a register: otherwise gcc folds the load into three instructions, and
           streaming from DRAM gets ~30% slower (measured on Zen 5). */
        __asm__("" : "+v"(x));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtepi32_epi16(ampc__round_bf16_x16(x)));
    }
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_cvtepi32_storeu_epi16(dst + i, m, ampc__round_bf16_x16(_mm512_maskz_loadu_epi32(m, src + i)));
    }
}

TARGET_AVX512 static void bf16_to_f32_avx512(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i h32 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
        _mm512_storeu_si512(dst + i, _mm512_slli_epi32(h32, 16));
    }
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        __m512i h32 = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(m, src + i)));
        _mm512_mask_storeu_epi32(dst + i, m, _mm512_slli_epi32(h32, 16));
    }
}

/* __builtin_cpu_supports checks the OS enabled the YMM/ZMM state too (XGETBV). */
static bool level_supported(int level) {
    __builtin_cpu_init();
    switch (level) {
    case LEVEL_AVX512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    case LEVEL_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    default: return true;
    }
}
#else
static bool level_supported(int level) { return level == LEVEL_C; }
#endif

// ---------------------------------------------------------------------------------------------
// Dispatch

/* Not synchronised with running conversions: called once at init, and by single-threaded tests. */
static void set_level(int level) {
    ampc_convert_fns c = {"c", ampc__f32_to_f16_c, ampc__f16_to_f32_c, ampc__f32_to_bf16_c, ampc__bf16_to_f32_c};
#ifdef AMPC_ROUND_X86
    if (level == LEVEL_AVX2)
        c = (ampc_convert_fns){"avx2+f16c", f32_to_f16_avx2, f16_to_f32_avx2, f32_to_bf16_avx2, bf16_to_f32_avx2};
    if (level == LEVEL_AVX512)
        c = (ampc_convert_fns){"avx512", f32_to_f16_avx512, f16_to_f32_avx512, f32_to_bf16_avx512, bf16_to_f32_avx512};
#endif
    ampc__convert = c;
}

/* Best supported level at or below `level`. */
static int fall_back(int level) {
    while (level > LEVEL_C && !level_supported(level)) level--;
    return level;
}

void ampc__convert_init(void) { set_level(fall_back(LEVEL_AVX512)); }

const char *ampc__convert_select(const char *level) {
    ampc__ensure_init();   /* so a later first init cannot undo the choice */
    if (!level) return ampc__convert.name;
    if (strcmp(level, "c") == 0) set_level(LEVEL_C);
    else if (strcmp(level, "avx2") == 0) set_level(fall_back(LEVEL_AVX2));
    else if (strcmp(level, "avx512") == 0) set_level(fall_back(LEVEL_AVX512));
    /* an unknown name leaves the level as it is */
    return ampc__convert.name;
}
