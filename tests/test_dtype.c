/*
 * test_dtype.c - fp16/bf16 conversions against independent references:
 *   - every one of the 65,536 f16 and bf16 bit patterns decodes to the value its fields say
 *     (ldexp in double) and round-trips through f32;
 *   - f32 -> f16/bf16 is correctly rounded (RNE, subnormals kept, overflow at the right
 *     threshold, NaN stays NaN), checked against a double-arithmetic rounding on the format's
 *     grid and, for f16, against gcc's _Float16 (libgcc soft-fp), on boundary sets around every
 *     rounding midpoint plus millions of random bit patterns;
 *   - every vectorized level (convert_x86.c) is bit-identical to the scalar functions, for
 *     tails of 0..67 elements and long arrays, from unaligned pointers, writing nothing outside;
 *   - f64 -> f16/bf16 through the dtype table has no double rounding.
 */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/convert.h"

// ---------------------------------------------------------------------------------------------
// Formats and the independent references

typedef struct {
    const char *name;
    int mant_bits, exp_bits;   /* stored fraction and exponent widths */
    int emin, emax;            /* exponent range of normal numbers */
    uint16_t (*from_f32)(float);
    float (*to_f32)(uint16_t);
} fmt16;

static const fmt16 FMT_F16 = {"f16", 10, 5, -14, 15, ampc_f32_to_f16, ampc_f16_to_f32};
static const fmt16 FMT_BF16 = {"bf16", 7, 8, -126, 127, ampc_f32_to_bf16, ampc_bf16_to_f32};
static const fmt16 *const FORMATS[] = {&FMT_F16, &FMT_BF16};

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static unsigned exp_field(const fmt16 *f, uint16_t h) { return (h >> f->mant_bits) & ((1u << f->exp_bits) - 1u); }
static unsigned mant_field(const fmt16 *f, uint16_t h) { return h & ((1u << f->mant_bits) - 1u); }
static unsigned quiet_bit(const fmt16 *f) { return 1u << (f->mant_bits - 1); }
static bool is_nan16(const fmt16 *f, uint16_t h) { return exp_field(f, h) == (1u << f->exp_bits) - 1u && mant_field(f, h); }

/* The value of a 16-bit pattern from its fields (NaN patterns give a NaN). */
static double decode_ref(const fmt16 *f, uint16_t h) {
    unsigned e = exp_field(f, h), m = mant_field(f, h);
    int bias = (1 << (f->exp_bits - 1)) - 1;
    double v;
    if (e == (1u << f->exp_bits) - 1u) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp((double)m, 1 - bias - f->mant_bits);
    else v = ldexp((double)((1u << f->mant_bits) | m), (int)e - bias - f->mant_bits);
    return (h & 0x8000u) ? -v : v;
}

/* x rounded to the format, computed on the grid of representable values in double: the two
   neighbours lo = q*ulp and hi = (q+1)*ulp, the nearer wins, ties go to even q; a result at
   2^(emax+1) or above is an overflow to inf. Exact for any double x. */
static double ref_round(const fmt16 *f, double x) {
    if (isnan(x) || isinf(x) || x == 0) return x;
    double a = fabs(x);
    int k;
    frexp(a, &k);                                   /* a in [2^(k-1), 2^k) */
    int e = k - 1 < f->emin ? f->emin : k - 1;      /* subnormals share emin's spacing */
    double ulp = ldexp(1.0, e - f->mant_bits);
    double q = floor(a / ulp), rem = a - q * ulp;   /* all exact: ulp is a power of two */
    double r = rem < ulp / 2 ? q : rem > ulp / 2 ? q + 1 : q + fmod(q, 2.0);
    double v = r * ulp;
    if (v >= ldexp(1.0, f->emax + 1)) v = INFINITY;
    return copysign(v, x);
}

/* gcc's own float -> _Float16 (libgcc __truncsfhf2 without -mf16c: soft-fp, RNE). */
static uint16_t gcc_f16(float x) {
    _Float16 h = (_Float16)x;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}

static uint64_t xorshift64(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

// ---------------------------------------------------------------------------------------------
// Failure tally: count every mismatch, report the first one

typedef struct {
    long bad, total;
    char first[256];
} tally;

#define TALLY_BAD(t, ...)                                                                          \
    do {                                                                                           \
        if ((t)->bad++ == 0) snprintf((t)->first, sizeof (t)->first, __VA_ARGS__);                 \
    } while (0)

static void tally_assert(const tally *t, const char *what) {
    if (t->bad) fail_msg("%s: %ld of %ld wrong; first: %s", what, t->bad, t->total, t->first);
}

/* One narrowing result `got` for input x: NaN -> quiet NaN of the same sign, else the value and
   sign of ref_round(x). */
static bool narrow_ok(const fmt16 *f, double x, uint16_t got) {
    if (isnan(x)) return is_nan16(f, got) && (got & quiet_bit(f)) && (bool)(got >> 15) == (bool)signbit(x);
    double want = ref_round(f, x), have = decode_ref(f, got);
    return !is_nan16(f, got) && have == want && (bool)signbit(have) == (bool)signbit(want);
}

// ---------------------------------------------------------------------------------------------
// f32 inputs: specials, every rounding midpoint neighbourhood, random bit patterns

enum { N_RANDOM = 4000000 };

static void push(uint32_t *x, size_t *n, uint32_t v) { x[(*n)++] = v; }

/* Returns a malloc'd array of f32 bit patterns (count in *n). */
static uint32_t *make_inputs(size_t *n_out) {
    static const uint32_t specials[] = {
        0x00000000, 0x7f800000, 0x7f7fffff, 0x00000001, 0x007fffff, 0x00800000,   /* 0, inf, max, f32 subnormals/normal */
        0x7f800001, 0x7f800fff, 0x7f801000, 0x7f802000, 0x7fa00000, 0x7fbfffff,   /* signalling NaNs */
        0x7fc00000, 0x7fc00001, 0x7fd55555, 0x7fffe000, 0x7fffffff,               /* quiet NaNs */
        0x477fe000, 0x477fefff, 0x477ff000, 0x477ff001, 0x47800000,               /* f16: 65504, 65520 threshold, 65536 */
        0x38800000, 0x387fffff, 0x33800000, 0x33000000, 0x33000001, 0x32ffffff,   /* f16 min normal, 2^-24, 2^-25 */
        0x337fffff, 0x33c00000, 0x33bfffff, 0x33c00001, 0x387fc000, 0x387fe000,   /* f16 subnormal ties, max subnormal */
        0x7f7f0000, 0x7f7f7fff, 0x7f7f8000, 0x7f7f8001, 0x7f7effff,               /* bf16 max, overflow threshold */
        0x00010000, 0x00008000, 0x00008001, 0x00007fff, 0x00018000, 0x007f8000,   /* bf16 subnormal ulps and ties */
        0x007fffff, 0x3f800000, 0x3f808000, 0x3f818000, 0x3f800fff, 0x3f801000,   /* 1.0 and its ties */
    };
    size_t cap = 2 * (sizeof specials / 4 + 256 * 23 * 6 * 8) + N_RANDOM, n = 0;
    uint32_t *x = malloc(cap * sizeof *x);
    if (!x) fail_msg("out of memory");
    for (unsigned s = 0; s < 2; s++)
        for (size_t i = 0; i < sizeof specials / 4; i++) push(x, &n, specials[i] | s << 31);
    /* For every f32 exponent and every cut position k (the target keeps the top 23-k fraction
       bits: k = 13 for normal f16, 14..23 for f16 subnormals, 16 for bf16), low parts just
       below, at and above the half-ulp 2^(k-1), under a few kept high parts. */
    for (uint32_t s = 0; s < 2; s++)
        for (uint32_t e = 0; e < 256; e++)
            for (int k = 1; k <= 23; k++) {
                uint32_t hmax = (1u << (23 - k)) - 1u, half = 1u << (k - 1), full = 1u << k;
                uint32_t highs[6] = {0, 1, 2, hmax / 2 + 1, hmax - 1, hmax};
                int64_t lows[8] = {0, 1, (int64_t)half - 2, (int64_t)half - 1, half, (int64_t)half + 1, (int64_t)half + 2, (int64_t)full - 1};
                for (int a = 0; a < 6; a++) {
                    if (highs[a] > hmax) continue;
                    for (int b = 0; b < 8; b++) {
                        if (lows[b] < 0 || lows[b] >= full) continue;
                        push(x, &n, s << 31 | e << 23 | highs[a] << k | (uint32_t)lows[b]);
                    }
                }
            }
    /* Random bit patterns: half anywhere, half with exponents around f16's range. */
    uint64_t st = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < N_RANDOM; i++) {
        uint32_t r = (uint32_t)(xorshift64(&st) >> 16);
        if (i & 1) r = (r & 0x807fffffu) | (uint32_t)(95 + (xorshift64(&st) >> 32) % 56) << 23;
        push(x, &n, r);
    }
    *n_out = n;
    return x;
}

// ---------------------------------------------------------------------------------------------
// Every 16-bit pattern

static void test_decode_exhaustive(void **state) {
    (void)state;
    for (size_t fi = 0; fi < 2; fi++) {
        const fmt16 *f = FORMATS[fi];
        tally dec = {0}, trip = {0};
        for (uint32_t i = 0; i < 65536; i++) {
            uint16_t h = (uint16_t)i;
            float got = f->to_f32(h);
            uint32_t gb = f32_bits(got);
            dec.total++, trip.total++;
            if (is_nan16(f, h)) {
                /* NaN: same sign, same payload in the top fraction bits, signalling kept */
                uint32_t want = (uint32_t)(h & 0x8000u) << 16 | 0x7f800000u | mant_field(f, h) << (23 - f->mant_bits);
                if (gb != want) TALLY_BAD(&dec, "%s %04x -> %08x, want %08x", f->name, h, gb, want);
                uint16_t back = f->from_f32(got);
                if (back != (h | quiet_bit(f))) TALLY_BAD(&trip, "%s NaN %04x -> %04x", f->name, h, back);
                continue;
            }
            double want = decode_ref(f, h);
            if ((double)got != want || (bool)signbit(got) != (bool)(h >> 15))
                TALLY_BAD(&dec, "%s %04x -> %.17g, want %.17g", f->name, h, (double)got, want);
            uint16_t back = f->from_f32(got);
            if (back != h) TALLY_BAD(&trip, "%s %04x -> f32 -> %04x", f->name, h, back);
        }
        tally_assert(&dec, f->name);
        tally_assert(&trip, f->name);
    }
}

// ---------------------------------------------------------------------------------------------
// f32 -> f16 / bf16 rounding

static void test_reference_thresholds(void **state) {
    (void)state;
    /* The double reference itself at the overflow thresholds. */
    assert_true(isinf(ref_round(&FMT_F16, 65520.0)));
    assert_true(ref_round(&FMT_F16, nextafter(65520.0, 0)) == 65504.0);
    assert_true(ref_round(&FMT_F16, 0x1p-25) == 0 && ref_round(&FMT_F16, nextafter(0x1p-25, 1)) == 0x1p-24);
    double bf_max = ldexp(2 - 0x1p-7, 127), bf_thr = (bf_max + 0x1p128) / 2;
    assert_true(isinf(ref_round(&FMT_BF16, bf_thr)));
    assert_true(ref_round(&FMT_BF16, nextafter(bf_thr, 0)) == bf_max);
    assert_true(ref_round(&FMT_BF16, 0x1p-134) == 0 && ref_round(&FMT_BF16, 0x1.8p-134) == 0x1p-133);
    /* and the library at the same points */
    assert_int_equal(ampc_f32_to_f16(65520.0f), 0x7c00);
    assert_int_equal(ampc_f32_to_f16(nextafterf(65520.0f, 0)), 0x7bff);
    assert_int_equal(ampc_f32_to_bf16((float)bf_thr), 0x7f80);
    assert_int_equal(ampc_f32_to_bf16(nextafterf((float)bf_thr, 0)), 0x7f7f);
    assert_int_equal(ampc_f32_to_bf16(-0x1.8p-134f), 0x8001);
}

static void test_f32_narrowing_correctly_rounded(void **state) {
    (void)state;
    size_t n;
    uint32_t *x = make_inputs(&n);
    tally ref16 = {0}, gcc16 = {0}, refbf = {0};
    for (size_t i = 0; i < n; i++) {
        float v = bits_f32(x[i]);
        uint16_t h = ampc_f32_to_f16(v), b = ampc_f32_to_bf16(v);
        ref16.total++, gcc16.total++, refbf.total++;
        if (!narrow_ok(&FMT_F16, v, h)) TALLY_BAD(&ref16, "f32 %08x -> f16 %04x, want %.17g", x[i], h, ref_round(&FMT_F16, v));
        if (!isnan(v) && h != gcc_f16(v)) TALLY_BAD(&gcc16, "f32 %08x -> f16 %04x, _Float16 %04x", x[i], h, gcc_f16(v));
        if (!narrow_ok(&FMT_BF16, v, b)) TALLY_BAD(&refbf, "f32 %08x -> bf16 %04x, want %.17g", x[i], b, ref_round(&FMT_BF16, v));
    }
    free(x);
    tally_assert(&ref16, "f32->f16 vs double reference");
    tally_assert(&gcc16, "f32->f16 vs _Float16");
    tally_assert(&refbf, "f32->bf16 vs double reference");
}

// ---------------------------------------------------------------------------------------------
// Vectorized levels == scalar, bit for bit

typedef void (*narrow_fn)(const float *, uint16_t *, size_t);
typedef void (*widen_fn)(const uint16_t *, float *, size_t);

enum { CANARY16 = 0xa5a5, MAX_TAIL = 67, MAX_OFF = 4 };
static const uint32_t CANARY32 = 0xdeadbeefu;

/* fn over x[0..n) from src offset so into dst offset d_off, against want[0..n); checks the
   canaries on both sides. */
static void run_narrow(tally *t, const char *what, narrow_fn fn, const uint32_t *x, const uint16_t *want, size_t n,
                       size_t so, size_t d_off) {
    float *src = malloc((n + MAX_OFF) * sizeof *src);
    uint16_t *dst = malloc((n + MAX_OFF + 1) * sizeof *dst);
    if (!src || !dst) fail_msg("out of memory");
    memcpy(src + so, x, n * 4);
    for (size_t i = 0; i < n + MAX_OFF + 1; i++) dst[i] = CANARY16;
    fn(src + so, dst + d_off, n);
    t->total += (long)n;
    for (size_t i = 0; i < n; i++)
        if (dst[d_off + i] != want[i])
            TALLY_BAD(t, "%s n=%zu [%zu] f32 %08x -> %04x, scalar %04x", what, n, i, x[i], dst[d_off + i], want[i]);
    for (size_t i = 0; i < n + MAX_OFF + 1; i++)
        if ((i < d_off || i >= d_off + n) && dst[i] != CANARY16) TALLY_BAD(t, "%s n=%zu wrote outside at %zu", what, n, i);
    free(src);
    free(dst);
}

static void run_widen(tally *t, const char *what, widen_fn fn, const uint16_t *x, const float *want, size_t n,
                      size_t so, size_t d_off) {
    uint16_t *src = malloc((n + MAX_OFF) * sizeof *src);
    float *dst = malloc((n + MAX_OFF + 1) * sizeof *dst);
    if (!src || !dst) fail_msg("out of memory");
    memcpy(src + so, x, n * 2);
    for (size_t i = 0; i < n + MAX_OFF + 1; i++) dst[i] = bits_f32(CANARY32);
    fn(src + so, dst + d_off, n);
    t->total += (long)n;
    for (size_t i = 0; i < n; i++)
        if (f32_bits(dst[d_off + i]) != f32_bits(want[i]))
            TALLY_BAD(t, "%s n=%zu [%zu] %04x -> %08x, scalar %08x", what, n, i, x[i], f32_bits(dst[d_off + i]), f32_bits(want[i]));
    for (size_t i = 0; i < n + MAX_OFF + 1; i++)
        if ((i < d_off || i >= d_off + n) && f32_bits(dst[i]) != CANARY32) TALLY_BAD(t, "%s n=%zu wrote outside at %zu", what, n, i);
    free(src);
    free(dst);
}

static void test_levels_match_scalar(void **state) {
    (void)state;
    static const char *levels[] = {"c", "avx2", "avx512"};
    size_t n;
    uint32_t *x = make_inputs(&n);
    uint16_t *want16 = malloc(n * 2), *wantbf = malloc(n * 2), all16[65536];
    float *wide16 = malloc(65536 * 4), *widebf = malloc(65536 * 4);
    if (!want16 || !wantbf || !wide16 || !widebf) fail_msg("out of memory");
    for (size_t i = 0; i < n; i++) {
        want16[i] = ampc_f32_to_f16(bits_f32(x[i]));
        wantbf[i] = ampc_f32_to_bf16(bits_f32(x[i]));
    }
    /* 16-bit inputs: every pattern, in an order that scatters NaNs and subnormals into tails */
    for (uint32_t i = 0; i < 65536; i++) all16[i] = (uint16_t)(i * 40503u);
    for (uint32_t i = 0; i < 65536; i++) wide16[i] = ampc_f16_to_f32(all16[i]), widebf[i] = ampc_bf16_to_f32(all16[i]);

    for (size_t l = 0; l < sizeof levels / sizeof *levels; l++) {
        const char *name = ampc__convert_select(levels[l]);
        if (strncmp(name, levels[l], strlen(levels[l])) != 0) {
            print_message("note: this CPU lacks level %s, skipped (fell back to %s)\n", levels[l], name);
            continue;
        }
        ampc_convert_fns c = ampc__convert;
        tally t = {0};
        char what[64];
        for (size_t len = 0; len <= MAX_TAIL; len++)
            for (size_t so = 0; so < MAX_OFF; so++)
                for (size_t d_off = 0; d_off < MAX_OFF; d_off++) {
                    size_t s = (len * 7919 + so * 131) % 2048, s16 = (len * 4099 + d_off * 257) % (65536 - MAX_TAIL);
                    snprintf(what, sizeof what, "%s f32->f16", name);
                    run_narrow(&t, what, c.f32_to_f16, x + s, want16 + s, len, so, d_off);
                    snprintf(what, sizeof what, "%s f32->bf16", name);
                    run_narrow(&t, what, c.f32_to_bf16, x + s, wantbf + s, len, so, d_off);
                    snprintf(what, sizeof what, "%s f16->f32", name);
                    run_widen(&t, what, c.f16_to_f32, all16 + s16, wide16 + s16, len, so, d_off);
                    snprintf(what, sizeof what, "%s bf16->f32", name);
                    run_widen(&t, what, c.bf16_to_f32, all16 + s16, widebf + s16, len, so, d_off);
                }
        /* long arrays, unaligned, lengths not a multiple of any width */
        snprintf(what, sizeof what, "%s f32->f16 long", name);
        run_narrow(&t, what, c.f32_to_f16, x, want16, n, 1, 3);
        snprintf(what, sizeof what, "%s f32->bf16 long", name);
        run_narrow(&t, what, c.f32_to_bf16, x, wantbf, n, 3, 1);
        snprintf(what, sizeof what, "%s f16->f32 long", name);
        run_widen(&t, what, c.f16_to_f32, all16 + 1, wide16 + 1, 65535, 1, 2);
        snprintf(what, sizeof what, "%s bf16->f32 long", name);
        run_widen(&t, what, c.bf16_to_f32, all16 + 1, widebf + 1, 65535, 3, 1);
        tally_assert(&t, name);
    }
    ampc__convert_init();   /* back to the best level */
    free(x), free(want16), free(wantbf), free(wide16), free(widebf);
}

static void test_best_level_chosen(void **state) {
    (void)state;
    const char *best = ampc__convert.name;
    bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    assert_string_equal(best, avx512 ? "avx512" : avx2 ? "avx2+f16c" : "c");
    assert_string_equal(ampc__convert_select("no-such-level"), best);
    assert_string_equal(ampc__convert_select("c"), "c");
    assert_string_equal(ampc__convert_select("avx512"), best);
}

// ---------------------------------------------------------------------------------------------
// f64 -> f16 / bf16 through the dtype table: one rounding, not f64 -> f32 -> 16-bit

static void test_f64_narrowing_no_double_rounding(void **state) {
    (void)state;
    const ampc_dtype dts[2] = {AMPC_F16, AMPC_BF16};
    for (size_t fi = 0; fi < 2; fi++) {
        const fmt16 *f = FORMATS[fi];
        uint16_t top = (uint16_t)(((1u << f->exp_bits) - 1u) << f->mant_bits);   /* +inf pattern */
        size_t cap = (size_t)top * 22 + 32, n = 0;
        double *x = malloc(cap * sizeof *x);
        uint16_t *got = malloc(cap * sizeof *got);
        if (!x || !got) fail_msg("out of memory");
        /* Around every midpoint between neighbours v < w (w = 2^(emax+1) past the maximum: the
           overflow threshold): below f32's resolution a plain (float) cast lands exactly on the
           midpoint and the second rounding would go to even instead of towards x. */
        for (uint32_t h = 0; h < top; h++) {
            double v = decode_ref(f, (uint16_t)h), w = h + 1 < top ? decode_ref(f, (uint16_t)(h + 1)) : ldexp(1.0, f->emax + 1);
            double mid = (v + w) / 2, gap = w - v;
            double xs[11] = {mid, mid + gap * 0x1p-30, mid - gap * 0x1p-30, mid + gap * 0x1p-45, mid - gap * 0x1p-45,
                             nextafter(mid, INFINITY), nextafter(mid, 0), mid + gap * 0x1p-14, mid - gap * 0x1p-14,
                             v + gap * 0x1p-40, w - gap * 0x1p-40};
            for (int k = 0; k < 11; k++) x[n++] = xs[k], x[n++] = -xs[k];
        }
        const double specials[] = {0.0, -0.0, INFINITY, -INFINITY, NAN, -NAN, 1e300, -1e300, 1e-300, -1e-300,
                                   0x1p-1074, -0x1p-1074, 1.7976931348623157e308, 0x1.fffffffffffffp127, 65519.999999,
                                   65520.000001, 3.3961e38, 1.0 + 0x1p-9 + 0x1p-40};
        for (size_t k = 0; k < sizeof specials / sizeof *specials; k++) x[n++] = specials[k];
        ampc__dt(dts[fi])->from_f64(x, got, n);
        tally t = {.total = (long)n};
        for (size_t i = 0; i < n; i++)
            if (!narrow_ok(f, x[i], got[i]))
                TALLY_BAD(&t, "%s from f64 %a -> %04x, want %a", f->name, x[i], got[i], ref_round(f, x[i]));
        free(x), free(got);
        tally_assert(&t, f->name);
    }
}

/* ampc_tensor_count_nonfinite reads bit patterns (an all-ones exponent): against isfinite of
   each value's exact f64 conversion, over every f16 and bf16 pattern (twice: 131072 elements,
   the parallel path) and over f32 patterns from every exponent with random mantissas. */
static void test_count_nonfinite_bit_patterns(void **state) {
    (void)state;
    const ampc_dtype d16[2] = {AMPC_F16, AMPC_BF16};
    for (int k = 0; k < 2; k++) {
        const int64_t n = 2 * 65536;
        ampc_tensor *t = ampc_tensor_empty(d16[k], 1, &n);
        uint16_t *u = ampc_tensor_data(t);
        for (int64_t i = 0; i < n; i++) u[i] = (uint16_t)i;
        double *v = malloc((size_t)n * sizeof *v);
        ASSERT_OK(ampc_tensor_to_f64(t, v, (size_t)n));
        int64_t want = 0;
        for (int64_t i = 0; i < n; i++) want += !isfinite(v[i]);
        assert_int_equal(ampc_tensor_count_nonfinite(t), want);
        assert_int_equal(want, 2 * 2 * (d16[k] == AMPC_F16 ? 1024 : 128));   /* both signs, every mantissa */
        free(v);
        ampc_tensor_free(t);
    }
    const int64_t n = 256 * 1024;
    ampc_tensor *t = ampc_tensor_empty(AMPC_F32, 1, &n);
    uint32_t *u = ampc_tensor_data(t);
    uint64_t rs = 7;
    for (int64_t i = 0; i < n; i++) {
        rs = rs * 6364136223846793005u + 1442695040888963407u;
        uint32_t sign = (uint32_t)(rs >> 63) << 31, exp = (uint32_t)(i % 256) << 23, mant = (uint32_t)(rs >> 20) & 0x7fffffu;
        u[i] = sign | exp | (i % 1024 == 0 ? 0 : mant);   /* infinities too */
    }
    int64_t want = 0;
    for (int64_t i = 0; i < n; i++) {
        float f;
        memcpy(&f, &u[i], sizeof f);
        want += !isfinite(f);
    }
    assert_int_equal(ampc_tensor_count_nonfinite(t), want);
    assert_int_equal(want, n / 256);
    ampc_tensor_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_exhaustive),
        cmocka_unit_test(test_reference_thresholds),
        cmocka_unit_test(test_f32_narrowing_correctly_rounded),
        cmocka_unit_test(test_best_level_chosen),
        cmocka_unit_test(test_levels_match_scalar),
        cmocka_unit_test(test_f64_narrowing_no_double_rounding),
        cmocka_unit_test(test_count_nonfinite_bit_patterns),
    };
    return cmocka_run_group_tests_name("dtype", tests, tu_group_setup, tu_group_teardown);
}
