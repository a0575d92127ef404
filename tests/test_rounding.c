/*
 * test_rounding.c - core/round.h's f32 -> bf16 / f16 rounding on every f32 bit pattern:
 *   - the scalar definitions (ampc__round_bf16, ampc__round_f16) against rounding done in double
 *     arithmetic: adding and subtracting 1.5 * 2^52 ulp rounds to a multiple of the format's ulp
 *     with the FPU's round-to-nearest-even; the 16-bit result is decoded from its fields and
 *     must have that value (or inf past the format's range) and the input's sign; NaNs must
 *     give quiet NaNs with the sign and top payload bits kept;
 *   - every vector form this CPU can run, bit for bit against the scalar one: AVX2 (bf16, 8
 *     lanes), F16C (f16, 8), AVX-512 (bf16 and f16, 16: the integer emulation runs on every
 *     AVX-512 CPU), AVX512_BF16 (bf16, 32: VCVTNE2PS2BF16, and the emulation for vectors with
 *     subnormals), and the scalar select as the CPU kernels' target_clones loops compile it.
 * The sweep goes by blocks of 2^16 inputs sharing their top 16 bits (all the bits that decide a
 * rounding vary within a block). Release builds take every block (about 10 s on two idle
 * cores); sanitizer builds (-O0, 60x slower) one block per sign and exponent, 512 of them, whose
 * top fraction bits vary from block to block.
 */
#include "testutil.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/round.h"

enum { BLOCK = 1 << 16 };

#if defined(__SANITIZE_ADDRESS__)
enum { NSWEEP = 512 };
/* Block k of the sweep: sign and exponent k, top fraction bits 37k mod 128. */
static uint32_t sweep_block_at(uint32_t k) { return k << 7 | (k * 37u & 127u); }
#else
enum { NSWEEP = 1 << 16 };
static uint32_t sweep_block_at(uint32_t k) { return k; }
#endif

/* a union, not memcpy: gcc 12 vectorizes the loops using it */
static inline float bits_f32(uint32_t u) { union { uint32_t u; float f; } v = {.u = u}; return v.f; }

// ---------------------------------------------------------------------------------------------
// The checks and their tallies

enum {
    REF_BF16, REF_F16,   /* scalar vs the double reference */
    CLONES_BF16,         /* the select in a target_clones loop */
    AVX2_BF16, F16C_F16, AVX512_BF16, AVX512_F16, AVX512BF16_BF16,
    NCHECKS
};
static const char *const CHECK_NAMES[NCHECKS] = {
    "bf16 scalar vs double reference", "f16 scalar vs double reference", "bf16 target_clones loop",
    "bf16 AVX2 x8",                    "f16 F16C x8",                    "bf16 AVX-512 x16 (integer emulation)",
    "f16 AVX-512 x16",                 "bf16 AVX512_BF16 x32 (VCVTNE2PS2BF16 + emulation)",
};

/* want: the scalar result's bits for the vector checks, the reference value (magnitude) or a
   special's bits for the scalar ones */
typedef struct {
    long bad[NCHECKS];
    uint32_t first[NCHECKS];   /* the smallest failing input */
    uint16_t got[NCHECKS];
    double want[NCHECKS];
} tallies;

static void note(tallies *t, int check, uint32_t x, uint16_t got, double want) {
    if (t->bad[check]++ == 0 || x < t->first[check]) t->first[check] = x, t->got[check] = got, t->want[check] = want;
}

/* got[i] == want[i] for the block at base; mismatches tallied. */
static void compare16(tallies *t, int check, uint32_t base, const uint16_t *got, const uint16_t *want) {
    if (memcmp(got, want, BLOCK * sizeof *got) == 0) return;
    for (uint32_t i = 0; i < BLOCK; i++)
        if (got[i] != want[i]) note(t, check, base | i, got[i], want[i]);
}

/* 32-bit lanes holding 16-bit results: equal and nothing above bit 15. */
static void compare32(tallies *t, int check, uint32_t base, const uint32_t *got, const uint16_t *want) {
    int bad = 0;
    for (int i = 0; i < BLOCK; i++) bad += got[i] != want[i];
    if (!bad) return;
    for (uint32_t i = 0; i < BLOCK; i++)
        if (got[i] != want[i]) note(t, check, base | i, (uint16_t)got[i], want[i]);
}

// ---------------------------------------------------------------------------------------------
// The independent reference

/* bf16 magnitude from its fields: the top half of an f32 (0x7f80: inf, above: NaN). */
static inline float decode_bf16_abs(uint16_t h) { return bits_f32((uint32_t)(h & 0x7fffu) << 16); }

/* f16 magnitude from its fields: (m + 2^10 [e > 0]) * 2^(max(e, 1) - 25). Read this way the inf
   pattern 0x7c00 is 2^16 and NaN patterns lie above it (no selects: the loops vectorize). */
static inline float decode_f16_abs(uint16_t h) {
    int32_t e = (h >> 10) & 31, m = h & 1023;
    return (float)(m | (e != 0) << 10) * bits_f32((uint32_t)(e + (e == 0) + 102) << 23);
}

/* A finite input xb rounded in double: r = |(x + C) - C| with C = 1.5 * 2^52 * ulp is x to the
   nearest multiple of ulp, ties to even (x + C lies in [2^52 ulp, 2^53 ulp), whose spacing is
   ulp, and C is an even multiple of it); at or past `overflow` the result is inf, given as
   `inf` (the decoded value of the format's inf pattern). */
static inline double ref_round_abs(uint32_t xb, double ulp, double overflow, double inf) {
    const double C = 0x1.8p52 * ulp;
    double r = fabs(((double)bits_f32(xb) + C) - C);
    return r >= overflow ? inf : r;
}

/* Counts the block's inputs whose 16-bit result got[i] has another magnitude than
   ref_round_abs says (2^32 inputs: written so that gcc vectorizes it). */
#define REF_CHECK(name, decode)                                                                    \
    __attribute__((target_clones("arch=x86-64-v4", "avx2", "default"))) static int name(            \
        uint32_t base, const uint16_t *got, double ulp, double overflow, double inf) {             \
        int bad = 0;                                                                               \
        for (int i = 0; i < BLOCK; i++) bad += (double)decode(got[i]) != ref_round_abs(base | (uint32_t)i, ulp, overflow, inf); \
        return bad;                                                                                \
    }
REF_CHECK(ref_bad_bf16, decode_bf16_abs)
REF_CHECK(ref_bad_f16, decode_f16_abs)

/* Counts the results whose sign is not the block's. */
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default"))) static int sign_bad(uint32_t base, const uint16_t *got) {
    int bad = 0;
    for (int i = 0; i < BLOCK; i++) bad += got[i] >> 15 != (int)(base >> 31);
    return bad;
}

/* Exponent field 255: inf stays inf; a NaN becomes the format's quiet NaN (top fraction bit
   set) with the sign and the top fraction bits (the payload) of the input. */
static uint16_t want_special(uint32_t xb, int mant_bits) {
    uint16_t sign = (uint16_t)(xb >> 16 & 0x8000u), exp = (uint16_t)(0x7fffu >> mant_bits << mant_bits);
    uint32_t frac = xb & 0x7fffffu;
    if (!frac) return sign | exp;
    return (uint16_t)(sign | exp | 1u << (mant_bits - 1) | frac >> (23 - mant_bits));
}

// ---------------------------------------------------------------------------------------------
// The vector forms over one block (n a multiple of 32)

__attribute__((target_clones("arch=x86-64-v4", "avx2", "default"))) static void clones_bf16(const float *x, uint16_t *out) {
#pragma omp simd
    for (uint32_t i = 0; i < BLOCK; i++) out[i] = ampc__round_bf16(x[i]);
}

#ifdef AMPC_ROUND_X86
__attribute__((target("avx2"))) static void avx2_bf16(const float *x, uint32_t *out) {
    for (uint32_t i = 0; i < BLOCK; i += 8)
        _mm256_storeu_si256((__m256i *)(out + i), ampc__round_bf16_x8(_mm256_loadu_si256((const __m256i *)(x + i))));
}
__attribute__((target("avx2,f16c"))) static void f16c_f16(const float *x, uint16_t *out) {
    for (uint32_t i = 0; i < BLOCK; i += 8) _mm_storeu_si128((__m128i *)(out + i), ampc__round_f16_x8(_mm256_loadu_ps(x + i)));
}
__attribute__((target("avx512f"))) static void avx512_bf16(const float *x, uint32_t *out) {
    for (uint32_t i = 0; i < BLOCK; i += 16) _mm512_storeu_si512(out + i, ampc__round_bf16_x16(_mm512_loadu_si512(x + i)));
}
__attribute__((target("avx512f"))) static void avx512_f16(const float *x, uint16_t *out) {
    for (uint32_t i = 0; i < BLOCK; i += 16) _mm256_storeu_si256((__m256i *)(out + i), ampc__round_f16_x16(_mm512_loadu_ps(x + i)));
}
__attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16"))) static void avx512bf16_bf16(const float *x, uint16_t *out) {
    for (uint32_t i = 0; i < BLOCK; i += 32)
        _mm512_storeu_si512(out + i, ampc__round_bf16_x32(_mm512_loadu_ps(x + i), _mm512_loadu_ps(x + i + 16)));
}
#endif

typedef struct {
    bool avx2, f16c, avx512, avx512bf16;
} cpu_paths;

static cpu_paths detect(void) {
    cpu_paths p = {0};
#ifdef AMPC_ROUND_X86
    __builtin_cpu_init();
    p.avx2 = __builtin_cpu_supports("avx2");
    p.f16c = p.avx2 && __builtin_cpu_supports("f16c");
    p.avx512 = __builtin_cpu_supports("avx512f");
    p.avx512bf16 = p.avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                   __builtin_cpu_supports("avx512bf16");
#endif
    return p;
}

// ---------------------------------------------------------------------------------------------
// The sweep

static void sweep_block(uint32_t block, const cpu_paths *cpu, tallies *t, float *x, uint16_t *sbf, uint16_t *sf16,
                        uint16_t *v16, uint32_t *v32) {
    uint32_t base = block << 16, E = block >> 7 & 0xffu;
    for (uint32_t i = 0; i < BLOCK; i++) x[i] = bits_f32(base | i);
    for (uint32_t i = 0; i < BLOCK; i++) sbf[i] = ampc__round_bf16(x[i]);
    for (uint32_t i = 0; i < BLOCK; i++) sf16[i] = ampc__round_f16(x[i]);

    if (E == 255) {
        for (uint32_t i = 0; i < BLOCK; i++) {
            uint16_t wb = want_special(base | i, 7), wh = want_special(base | i, 10);
            if (sbf[i] != wb) note(t, REF_BF16, base | i, sbf[i], wb);
            if (sf16[i] != wh) note(t, REF_F16, base | i, sf16[i], wh);
        }
    } else {
        /* ulp at this exponent; f32 subnormals (E = 0) share E = 1's, as do f16's below 2^-14 */
        int e = E ? (int)E - 127 : -126;
        double ulp_bf = ldexp(1.0, e - 7), ulp_h = ldexp(1.0, (e < -14 ? -14 : e) - 10);
        if (ref_bad_bf16(base, sbf, ulp_bf, 0x1p128, INFINITY) || sign_bad(base, sbf))   /* find them: slow is fine */
            for (uint32_t i = 0; i < BLOCK; i++) {
                double want = ref_round_abs(base | i, ulp_bf, 0x1p128, INFINITY);
                if (decode_bf16_abs(sbf[i]) != want || sbf[i] >> 15 != base >> 31) note(t, REF_BF16, base | i, sbf[i], want);
            }
        if (ref_bad_f16(base, sf16, ulp_h, 0x1p16, 0x1p16) || sign_bad(base, sf16))
            for (uint32_t i = 0; i < BLOCK; i++) {
                double want = ref_round_abs(base | i, ulp_h, 0x1p16, 0x1p16);
                if (decode_f16_abs(sf16[i]) != want || sf16[i] >> 15 != base >> 31) note(t, REF_F16, base | i, sf16[i], want);
            }
    }

    clones_bf16(x, v16);
    compare16(t, CLONES_BF16, base, v16, sbf);
#ifdef AMPC_ROUND_X86
    if (cpu->avx2) avx2_bf16(x, v32), compare32(t, AVX2_BF16, base, v32, sbf);
    if (cpu->f16c) f16c_f16(x, v16), compare16(t, F16C_F16, base, v16, sf16);
    if (cpu->avx512) {
        avx512_bf16(x, v32), compare32(t, AVX512_BF16, base, v32, sbf);
        avx512_f16(x, v16), compare16(t, AVX512_F16, base, v16, sf16);
    }
    if (cpu->avx512bf16) avx512bf16_bf16(x, v16), compare16(t, AVX512BF16_BF16, base, v16, sbf);
#else
    (void)cpu, (void)v32;
#endif
}

static void test_every_f32_pattern(void **state) {
    (void)state;
    const cpu_paths cpu = detect();
    const bool ran[NCHECKS] = {true, true, true, cpu.avx2, cpu.f16c, cpu.avx512, cpu.avx512, cpu.avx512bf16};
    tallies total = {0};
    bool oom = false;
#pragma omp parallel
    {
        tallies t = {0};
        float *x = malloc(BLOCK * sizeof *x);
        uint16_t *sbf = malloc(BLOCK * 2), *sf16 = malloc(BLOCK * 2), *v16 = malloc(BLOCK * 2);
        uint32_t *v32 = malloc(BLOCK * 4);
        bool ok = x && sbf && sf16 && v16 && v32;
#pragma omp for schedule(dynamic, 64)
        for (uint32_t k = 0; k < NSWEEP; k++)
            if (ok) sweep_block(sweep_block_at(k), &cpu, &t, x, sbf, sf16, v16, v32);
#pragma omp critical
        {
            oom |= !ok;
            for (int c = 0; c < NCHECKS; c++)
                if (t.bad[c]) {
                    if (!total.bad[c] || t.first[c] < total.first[c])
                        total.first[c] = t.first[c], total.got[c] = t.got[c], total.want[c] = t.want[c];
                    total.bad[c] += t.bad[c];
                }
        }
        free(x), free(sbf), free(sf16), free(v16), free(v32);
    }
    if (oom) fail_msg("out of memory");
    char paths[512] = "";
    for (int c = 0; c < NCHECKS; c++)
        if (ran[c]) snprintf(paths + strlen(paths), sizeof paths - strlen(paths), "%s%s", *paths ? ", " : "", CHECK_NAMES[c]);
    print_message("checked on %s of the 2^32 f32 patterns: %s\n", NSWEEP == 1 << 16 ? "all" : "one block per sign and exponent", paths);
    for (int c = 0; c < NCHECKS; c++)
        if (total.bad[c]) {
            uint32_t x = total.first[c];
            if (c > REF_F16 || (x >> 23 & 0xffu) == 255)
                fail_msg("%s: %ld inputs wrong; first f32 %08x -> %04x, want %04x", CHECK_NAMES[c], total.bad[c], x,
                         total.got[c], (unsigned)total.want[c]);
            fail_msg("%s: %ld inputs wrong; first f32 %08x (%a) -> %04x, want magnitude %a with the input's sign",
                     CHECK_NAMES[c], total.bad[c], x, (double)bits_f32(x), total.got[c], total.want[c]);
        }
}

/* The reference itself, at points whose results are known: it must be able to fail. */
static void test_reference_catches_errors(void **state) {
    (void)state;
    uint16_t *h = malloc(BLOCK * 2);
    if (!h) fail_msg("out of memory");
    /* block 0x3f80: [1, 1 + 2^-7), bf16 ulp 2^-7: all round to 1.0 (0x3f80) but those at or
       above the half ulp (low half 0x8000, odd neighbour 0x3f81 loses the tie) */
    for (uint32_t i = 0; i < BLOCK; i++) h[i] = i > 0x8000 ? 0x3f81 : 0x3f80;
    assert_int_equal(ref_bad_bf16(0x3f800000u, h, 0x1p-7, 0x1p128, INFINITY), 0);
    h[0x8000] = 0x3f81;   /* the tie rounded away from even */
    assert_int_equal(ref_bad_bf16(0x3f800000u, h, 0x1p-7, 0x1p128, INFINITY), 1);
    h[0x8000] = 0xbf80;   /* the wrong sign */
    assert_int_equal(sign_bad(0x3f800000u, h), 1);
    /* f16 ulp 32 on [32768, 65536): block 0x477f, [65280, 65536), all said to be 65504 (0x7bff)
       below 65520 (0x477ff000) and inf from it: wrong up to the tie 65488 (0x477fd000), which
       goes to the even 65472 */
    for (uint32_t i = 0; i < BLOCK; i++) h[i] = 0x477f0000u + i >= 0x477ff000u ? 0x7c00 : 0x7bff;
    assert_int_equal(ref_bad_f16(0x477f0000u, h, 0x1p5, 0x1p16, 0x1p16), 0x477fd000u - 0x477f0000u + 1);
    h[0xffff] = 0x7c01;   /* a NaN for an overflow */
    assert_int_equal(ref_bad_f16(0x477f0000u, h, 0x1p5, 0x1p16, 0x1p16), 0x477fd000u - 0x477f0000u + 2);
    free(h);
    /* specials */
    assert_int_equal(want_special(0xff800000u, 7), 0xff80);
    assert_int_equal(want_special(0x7f800001u, 7), 0x7fc0);
    assert_int_equal(want_special(0xffa12345u, 10), 0xff09);
    assert_true(decode_f16_abs(0x0001) == 0x1p-24 && decode_f16_abs(0x03ff) == 0x3ffp-24 && decode_f16_abs(0x0400) == 0x1p-14);
    assert_true(decode_f16_abs(0x3c00) == 1.0 && decode_f16_abs(0x7bff) == 65504.0 && decode_f16_abs(0x7c00) == 0x1p16);
    assert_true(decode_bf16_abs(0x8001) == 0x1p-133 && decode_bf16_abs(0x3f80) == 1.0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reference_catches_errors),
        cmocka_unit_test(test_every_f32_pattern),
    };
    return cmocka_run_group_tests_name("rounding", tests, tu_group_setup, tu_group_teardown);
}
