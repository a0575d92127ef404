/*
 * test_gemm_skinny.c - the CPU gemm on shapes with one small dimension (M, N or K <= 16: the
 * mlp's classifier head and ragged variants), which gemm_skinny.c's AVX-512 kernels run:
 * against an fp64 reference on the same rounded inputs within a derived bound, bit-exact on
 * integer data (the output rounding), NaN/inf propagation, the same bits for any thread count,
 * and the dispatch of the head's three shapes.
 */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu.h"

typedef struct {
    int64_t M, N, K;
} dims;

/* Operand dtype -> output dtype, as the backend takes them (bf16 into f32: autocast's weight
   gradient, which comes without bias). */
typedef struct {
    ampc_dtype in, out;
} dtypes;
static const dtypes configs[] = {{AMPC_F32, AMPC_F32}, {AMPC_BF16, AMPC_BF16}, {AMPC_BF16, AMPC_F32}};

/* The mlp head (784->2048->2048->10, batch 256): forward x @ W^T + b, backward data gy @ W,
   backward weights gy^T @ x. */
static const ampc_gemm_desc head[] = {
    {.batch = 1, .M = 256, .N = 10, .K = 2048, .tb = true},
    {.batch = 1, .M = 256, .N = 2048, .K = 10},
    {.batch = 1, .M = 10, .N = 2048, .K = 256, .ta = true},
};

/* Whether the kernels run dt here: ampc_cpu_features lists avx512_bf16 and avx512bw (not VL
   and DQ, which every AVX512BW CPU has). */
static bool skinny_cpu(ampc_dtype dt) {
    const char *f = ampc_cpu_features();
    return strstr(f, "avx512bw") && (dt != AMPC_BF16 || strstr(f, "avx512_bf16"));
}

// ---------------------------------------------------------------------------------------------
// One gemm through the CPU backend, and its reference

typedef struct {
    double *A, *B, *bias;   /* the inputs as rounded to the operand dtype */
    double *got;            /* the CPU result */
} run_result;

/* Runs d on A, B, bias (NULL: none) rounded to cfg.in; fills r (caller frees). */
static void run_gemm(const ampc_gemm_desc *d, dtypes cfg, const double *A, const double *B, const double *bias, run_result *r) {
    int64_t na = d->M * d->K, nb = d->K * d->N, nc = d->M * d->N;
    ampc_scope_begin();
    ampc_tensor *a = ampc_tensor_from_f64(cfg.in, 1, (int64_t[]){na}, A);
    ampc_tensor *b = ampc_tensor_from_f64(cfg.in, 1, (int64_t[]){nb}, B);
    ampc_tensor *bs = bias ? ampc_tensor_from_f64(cfg.in, 1, (int64_t[]){d->N}, bias) : NULL;
    ampc_tensor *c = ampc_tensor_full(cfg.out, 1, (int64_t[]){nc}, NAN);
    ASSERT_NOT_NULL_MSG(c);
    ASSERT_OK(ampc__backend(AMPC_DEVICE_CPU)->gemm(d, a, b, bs, c));
    r->A = tu_values(a);
    r->B = tu_values(b);
    r->bias = bs ? tu_values(bs) : NULL;
    r->got = tu_values(c);
    ampc_scope_end();
}

static void free_result(run_result *r) { free(r->A), free(r->B), free(r->bias), free(r->got); }

/* ref = the exact product in fp64 (+ bias), mag = sum over k of |a*b| (+ |bias|). */
static void reference(const ampc_gemm_desc *d, const run_result *r, double *ref, double *mag) {
    for (int64_t i = 0; i < d->M; i++)
        for (int64_t j = 0; j < d->N; j++) {
            double s = r->bias ? r->bias[j] : 0, m = r->bias ? fabs(r->bias[j]) : 0;
            for (int64_t k = 0; k < d->K; k++) {
                double a = d->ta ? r->A[k * d->M + i] : r->A[i * d->K + k];
                double b = d->tb ? r->B[j * d->K + k] : r->B[k * d->N + j];
                s += a * b;
                m += fabs(a * b);
            }
            ref[i * d->N + j] = s, mag[i * d->N + j] = m;
        }
}

static void describe(char *buf, size_t n, const ampc_gemm_desc *d, dtypes cfg, bool bias) {
    snprintf(buf, n, "M %lld N %lld K %lld ta %d tb %d %s->%s%s (skinny %d)", (long long)d->M, (long long)d->N, (long long)d->K,
             d->ta, d->tb, ampc_dtype_name(cfg.in), ampc_dtype_name(cfg.out), bias ? " +bias" : "", ampc__cpu_gemm_skinny);
}

/*
 * The bound. The inputs are exact in both computations (the reference reads the rounded
 * values), so all error comes from the f32 accumulation and the output rounding. Each output is
 * the sum of K products and the bias, added in f32 in some order (sequentially, in 16 lanes
 * then a tree, or two products per VDPBF16PS step): at most K+1 roundings on any path from a
 * term to the result, so with u = 2^-24 (Higham, Accuracy and Stability, 4.2 and 3.1)
 *     |acc - ref| <= gamma(K+1) * mag,   gamma(n) = n*u / (1 - n*u),   mag = sum |a*b| + |bias|
 * (a product of two bf16 values is exact in f32; an f32 FMA rounds once per step). VDPBF16PS
 * also flushes subnormal products and sums, at most 2^-126 each: + (K+1) * 2^-126. Rounding the
 * output once to a dtype of unit roundoff u_out adds u_out * |acc|, and |acc| <= |ref| + the
 * above, so
 *     |got - ref| <= u_out * |ref| + (1 + u_out) * (gamma(K+1) * mag + (K+1) * 2^-126).
 */
static void check_bound(const char *what, const ampc_gemm_desc *d, dtypes cfg, const run_result *r) {
    size_t nc = (size_t)(d->M * d->N);
    double *ref = malloc(nc * sizeof *ref), *mag = malloc(nc * sizeof *mag);
    reference(d, r, ref, mag);
    double n = (double)(d->K + 1), u = 0x1p-24, u_out = cfg.out == AMPC_F32 ? 0 : tu_eps(cfg.out);
    double gamma = n * u / (1 - n * u);
    for (size_t i = 0; i < nc; i++) {
        double tol = u_out * fabs(ref[i]) + (1 + u_out) * (gamma * mag[i] + n * 0x1p-126);
        if (!(fabs(r->got[i] - ref[i]) <= tol))
            fail_msg("%s: element %zu (row %lld col %lld) is %.9g, fp64 reference %.9g, bound %.3g", what, i,
                     (long long)(i / (size_t)d->N), (long long)(i % (size_t)d->N), r->got[i], ref[i], tol);
    }
    free(ref), free(mag);
}

static double *uniform(size_t n, uint64_t seed, double lo, double hi) {
    double *x = malloc((n ? n : 1) * sizeof *x);
    tu_fill_uniform(x, n, seed, lo, hi);
    return x;
}

/* d for every dtype config, with and without bias, against the bound. */
static void check_desc(const ampc_gemm_desc *d, uint64_t seed) {
    double *A = uniform((size_t)(d->M * d->K), seed, -1, 1), *B = uniform((size_t)(d->K * d->N), seed + 1, -1, 1);
    double *bias = uniform((size_t)d->N, seed + 2, -1, 1);
    for (size_t ci = 0; ci < sizeof configs / sizeof *configs; ci++)
        for (int hb = 0; hb < 2; hb++) {
            if (hb && configs[ci].out != configs[ci].in) continue;   /* no bias into a wider output */
            char what[160];
            describe(what, sizeof what, d, configs[ci], hb);
            run_result r;
            run_gemm(d, configs[ci], A, B, hb ? bias : NULL, &r);
            check_bound(what, d, configs[ci], &r);
            free_result(&r);
        }
    free(A), free(B), free(bias);
}

// ---------------------------------------------------------------------------------------------
// Against the fp64 reference

/* The head's shapes through both paths (the bound holds for oneDNN too: it is about any f32
   accumulation order), then through the rule. */
static void test_head_shapes(void **state) {
    (void)state;
    for (int mode = 1; mode >= -1; mode--) {
        ampc__cpu_gemm_skinny = mode;
        for (size_t i = 0; i < sizeof head / sizeof *head; i++) check_desc(&head[i], 10 + i);
    }
    ampc__cpu_gemm_skinny = -1;
}

/* Ragged sizes: lanes and blocks of the kernels partly filled, every transpose the fast path
   takes (and those it leaves to oneDNN: the result is checked the same). K values: tails of 16
   f32 / 32 bf16 lanes; an odd K (a bf16 pair padded with 0); more than one panel of 32 rows. */
static void test_ragged(void **state) {
    (void)state;
    const dims cases[] = {
        /* small N (dots) */
        {5, 1, 1007}, {5, 3, 1007}, {37, 10, 1007}, {37, 17, 64}, {1, 10, 2048}, {256, 3, 333}, {9, 16, 100},
        /* small K (rows) */
        {37, 1, 7}, {5, 3, 10}, {37, 17, 1}, {1, 100, 7}, {256, 2048, 7}, {37, 100, 10}, {13, 1000, 16},
        /* small M (rows, panels over K) */
        {1, 3, 301}, {5, 17, 256}, {5, 100, 33}, {1, 1000, 301}, {10, 2048, 257}, {16, 100, 300}, {13, 70, 64},
    };
    ampc__cpu_gemm_skinny = 1;
    uint64_t seed = 100;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        for (int t = 0; t < 4; t++) {
            ampc_gemm_desc d = {.batch = 1, .M = cases[i].M, .N = cases[i].N, .K = cases[i].K, .ta = t & 1, .tb = t >> 1};
            check_desc(&d, seed += 3);
        }
    ampc__cpu_gemm_skinny = -1;
}

// ---------------------------------------------------------------------------------------------
// Exactness: integers in [-16, 16] keep every f32 partial sum exact (|sum| <= 2048 * 256 + 64 <
// 2^24), so the result must be the exact value rounded once, to nearest even: results past
// 256 in bf16 land on ties often, which checks the kernels' output rounding bit for bit.

static double round_once(double v, ampc_dtype dt) {
    double r;
    char buf[8];
    ampc__dt(dt)->from_f64(&v, buf, 1);
    ampc__dt(dt)->to_f64(buf, &r, 1);
    return r;
}

static double *integers(size_t n, uint64_t seed, double range) {
    double *x = uniform(n, seed, -range, range + 1);
    for (size_t i = 0; i < n; i++) x[i] = floor(x[i]);
    return x;
}

static void test_exact_rounding(void **state) {
    (void)state;
    const ampc_gemm_desc more[] = {
        {.batch = 1, .M = 37, .N = 17, .K = 7, .tb = true},
        {.batch = 1, .M = 5, .N = 100, .K = 301, .ta = true},
        {.batch = 1, .M = 37, .N = 3, .K = 1007},
    };
    ampc__cpu_gemm_skinny = 1;
    for (size_t i = 0; i < 6; i++) {
        const ampc_gemm_desc *d = i < 3 ? &head[i] : &more[i - 3];
        size_t nc = (size_t)(d->M * d->N);
        double *A = integers((size_t)(d->M * d->K), 40 + i, 16), *B = integers((size_t)(d->K * d->N), 50 + i, 16);
        double *bias = integers((size_t)d->N, 60 + i, 64), *ref = malloc(nc * sizeof *ref), *mag = malloc(nc * sizeof *mag);
        for (size_t ci = 0; ci < sizeof configs / sizeof *configs; ci++) {
            bool hb = configs[ci].in == configs[ci].out;
            run_result r;
            run_gemm(d, configs[ci], A, B, hb ? bias : NULL, &r);
            reference(d, &r, ref, mag);
            int ties = 0;
            for (size_t e = 0; e < nc; e++) {
                double want = round_once(ref[e], configs[ci].out);
                ties += want != ref[e];
                if (r.got[e] != want) {
                    char what[160];
                    describe(what, sizeof what, d, configs[ci], hb);
                    fail_msg("%s: element %zu is %.9g, exact %.17g rounded once %.9g", what, e, r.got[e], ref[e], want);
                }
            }
            if (configs[ci].out == AMPC_BF16) assert_true(ties > 0);   /* the data does exercise the rounding */
            free_result(&r);
        }
        free(A), free(B), free(bias), free(ref), free(mag);
    }
    ampc__cpu_gemm_skinny = -1;
}

// ---------------------------------------------------------------------------------------------
// NaN and inf: a NaN in A makes its row of C NaN; an inf in B makes its column +-inf (or NaN
// where multiplied by 0); a NaN bias makes its column NaN; the reference says which, in fp64.

static void test_nan_inf(void **state) {
    (void)state;
    const ampc_gemm_desc cases[] = {
        head[0], head[1], head[2],
        {.batch = 1, .M = 5, .N = 17, .K = 7, .ta = true, .tb = true},
        {.batch = 1, .M = 37, .N = 3, .K = 1007},
        {.batch = 1, .M = 5, .N = 100, .K = 301},
    };
    ampc__cpu_gemm_skinny = 1;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const ampc_gemm_desc *d = &cases[i];
        size_t na = (size_t)(d->M * d->K), nb = (size_t)(d->K * d->N), nc = (size_t)(d->M * d->N);
        /* |values| in [0.5, 1]: no subnormal products, which VDPBF16PS would read as 0 */
        double *A = uniform(na, 70 + i, 0.5, 1), *B = uniform(nb, 80 + i, -1, -0.5), *bias = uniform((size_t)d->N, 90 + i, -1, 1);
        A[(d->M - 1) * (d->ta ? 1 : d->K)] = NAN;               /* a(M-1, 0) */
        B[d->tb ? d->K - 1 : (d->K - 1) * d->N] = INFINITY;    /* b(K-1, 0) */
        if (d->N > 1) B[d->tb ? 1 * d->K : 1] = -INFINITY;      /* b(0, 1) */
        bias[d->N - 1] = NAN;
        for (size_t ci = 0; ci < sizeof configs / sizeof *configs; ci++) {
            bool hb = configs[ci].in == configs[ci].out;
            char what[160];
            describe(what, sizeof what, d, configs[ci], hb);
            run_result r;
            run_gemm(d, configs[ci], A, B, hb ? bias : NULL, &r);
            double *ref = malloc(nc * sizeof *ref), *mag = malloc(nc * sizeof *mag);
            reference(d, &r, ref, mag);
            int special = 0;
            for (size_t e = 0; e < nc; e++) {
                if (isfinite(ref[e])) continue;
                special++;
                if (isnan(ref[e]) ? !isnan(r.got[e]) : r.got[e] != ref[e])
                    fail_msg("%s: element %zu is %g, fp64 reference %g", what, e, r.got[e], ref[e]);
            }
            assert_true(special >= d->N);   /* at least the NaN row */
            free(ref), free(mag);
            free_result(&r);
        }
        free(A), free(B), free(bias);
    }
    ampc__cpu_gemm_skinny = -1;
}

/* Subnormal results (bf16 keeps them, like f32): products of 2^-126 and more, each minus a
   bias of 2^-126, leave multiples of 2^-129 below 2^-126, all exact in every dtype. The rows
   kernel rounds 32 results with VCVTNE2PS2BF16, which would flush them, and must take its
   integer path; dots rounds one at a time. */
static void test_subnormal_output(void **state) {
    (void)state;
    const ampc_gemm_desc cases[] = {
        {.batch = 1, .M = 2, .N = 40, .K = 1},    /* rows */
        {.batch = 1, .M = 2, .N = 40, .K = 2},    /* rows, one pair */
        {.batch = 1, .M = 2, .N = 5, .K = 64},    /* dots */
    };
    ampc__cpu_gemm_skinny = 1;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const ampc_gemm_desc *d = &cases[i];
        size_t na = (size_t)(d->M * d->K), nb = (size_t)(d->K * d->N), nc = (size_t)(d->M * d->N);
        double *A = calloc(na, sizeof *A), *B = calloc(nb, sizeof *B), *bias = malloc((size_t)d->N * sizeof *bias);
        for (int64_t r = 0; r < d->M; r++) A[r * d->K] = 0x1p-63;                     /* a(r, 0) */
        for (int64_t j = 0; j < d->N; j++) {
            B[j] = (1 + (double)(j % 8) / 8) * 0x1p-63;                                 /* b(0, j) */
            bias[j] = -0x1p-126;
        }
        for (size_t ci = 0; ci < 2; ci++) {   /* f32 -> f32, bf16 -> bf16 */
            run_result r;
            run_gemm(d, configs[ci], A, B, bias, &r);
            for (size_t e = 0; e < nc; e++) {
                double want = (double)(e % (size_t)d->N % 8) * 0x1p-129;
                if (r.got[e] != want) {
                    char what[160];
                    describe(what, sizeof what, d, configs[ci], true);
                    fail_msg("%s: element %zu is %g, want the subnormal %g", what, e, r.got[e], want);
                }
            }
            free_result(&r);
        }
        free(A), free(B), free(bias);
    }
    ampc__cpu_gemm_skinny = -1;
}

// ---------------------------------------------------------------------------------------------
// Determinism: problems past the threading threshold, the same bits on 1 and 2 threads

static void test_thread_count(void **state) {
    (void)state;
    const ampc_gemm_desc cases[] = {
        {.batch = 1, .M = 1024, .N = 2048, .K = 8},              /* rows, small K */
        {.batch = 1, .M = 10, .N = 2048, .K = 1000, .ta = true},  /* rows, small M, panels */
        {.batch = 1, .M = 512, .N = 16, .K = 2100, .tb = true},   /* dots (bf16 only: f32 goes to oneDNN) */
    };
    int threads = ampc_get_num_threads();
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const ampc_gemm_desc *d = &cases[i];
        double *A = uniform((size_t)(d->M * d->K), 110 + i, -1, 1), *B = uniform((size_t)(d->K * d->N), 120 + i, -1, 1);
        for (size_t ci = 1; ci < sizeof configs / sizeof *configs; ci++) {   /* bf16 -> bf16, bf16 -> f32 */
            run_result r1, r2;
            ampc_set_num_threads(1);
            run_gemm(d, configs[ci], A, B, NULL, &r1);
            ampc_set_num_threads(2);
            run_gemm(d, configs[ci], A, B, NULL, &r2);
            char what[160];
            describe(what, sizeof what, d, configs[ci], false);
            if (memcmp(r1.got, r2.got, (size_t)(d->M * d->N) * sizeof *r1.got))
                fail_msg("%s: 1 and 2 threads give different results", what);
            check_bound(what, d, configs[ci], &r2);
            free_result(&r1), free_result(&r2);
        }
        free(A), free(B);
    }
    ampc_set_num_threads(threads);
}

// ---------------------------------------------------------------------------------------------
// Dispatch: with the default rule, the head's three shapes run the skinny kernels in f32 and
// bf16 where the CPU has AVX512_BF16; f16 and batched descs stay with oneDNN

static void test_dispatch(void **state) {
    (void)state;
    const ampc_dtype dts[] = {AMPC_F32, AMPC_BF16};
    for (size_t i = 0; i < sizeof head / sizeof *head; i++) {
        for (size_t t = 0; t < 2; t++) {
            char name[128];
            ASSERT_OK(ampc__cpu_gemm_impl(&head[i], dts[t], i == 0, name, sizeof name));
            print_message("gemm %s M %lld N %lld K %lld: %s\n", ampc_dtype_name(dts[t]), (long long)head[i].M,
                          (long long)head[i].N, (long long)head[i].K, name);
            if (skinny_cpu(dts[t])) assert_non_null(strstr(name, "skinny"));
            else assert_null(strstr(name, "skinny"));
        }
        assert_false(ampc__cpu_gemm_skinny_takes(&head[i], AMPC_F16, NULL));
        ampc_gemm_desc batched = head[i];
        batched.batch = 2;
        assert_false(ampc__cpu_gemm_skinny_takes(&batched, AMPC_BF16, NULL));
    }
    /* f32 dots only up to N 12 and below 2^24 MACs (measured), bf16 up to 16 and any size */
    ampc_gemm_desc n13 = {.batch = 1, .M = 256, .N = 13, .K = 2048, .tb = true}, big = {.batch = 1, .M = 1024, .N = 10, .K = 4096};
    assert_false(ampc__cpu_gemm_skinny_takes(&n13, AMPC_F32, NULL));
    assert_false(ampc__cpu_gemm_skinny_takes(&big, AMPC_F32, NULL));
    assert_int_equal(ampc__cpu_gemm_skinny_takes(&n13, AMPC_BF16, NULL), skinny_cpu(AMPC_BF16));
    assert_int_equal(ampc__cpu_gemm_skinny_takes(&big, AMPC_BF16, NULL), skinny_cpu(AMPC_BF16));
    /* off: oneDNN even where the kernels could run */
    ampc__cpu_gemm_skinny = 0;
    assert_false(ampc__cpu_gemm_skinny_takes(&head[0], AMPC_BF16, NULL));
    ampc__cpu_gemm_skinny = -1;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_head_shapes),
        cmocka_unit_test(test_ragged),
        cmocka_unit_test(test_exact_rounding),
        cmocka_unit_test(test_nan_inf),
        cmocka_unit_test(test_subnormal_output),
        cmocka_unit_test(test_thread_count),
        cmocka_unit_test(test_dispatch),
    };
    return cmocka_run_group_tests_name("gemm_skinny", tests, tu_group_setup, tu_group_teardown);
}
