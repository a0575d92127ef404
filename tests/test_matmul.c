/*
 * test_matmul.c - linear and matmul: gradients by finite differences on REF, every CPU dtype
 * against REF, the gemm kernel bit-exact on integer data for every layout, errors, and the
 * steady state of the primitive cache (no new system allocations).
 */
#include "testutil.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu.h"

static const ampc_dtype cpu_dtypes[] = {AMPC_F32, AMPC_F16, AMPC_BF16};

// ---------------------------------------------------------------------------------------------
// Op cases: finite differences on REF, then CPU f32/f16/bf16 vs REF

static ampc_tensor *run_linear(ampc_tensor **in, const void *ctx) { return ampc_linear(in[0], in[1], ctx ? in[2] : NULL); }
static ampc_tensor *run_matmul(ampc_tensor **in, const void *ctx) {
    (void)ctx;
    return ampc_matmul(in[0], in[1]);
}

static const int with_bias = 1;

#define LINEAR_CASE(nm, xnd, xs, in_, out_, bias, k_, kb_)                                         \
    {.name = nm, .n_inputs = (bias) ? 3 : 2, .ndim = {xnd, 2, 1}, .shape = {xs, {out_, in_}, {out_}}, \
     .lo = -1, .hi = 1, .fn = run_linear, .ctx = (bias) ? &with_bias : NULL, .k = k_, .k_backward = kb_}
#define MATMUL_CASE(nm, and_, as, bnd, bs, k_, kb_)                                                \
    {.name = nm, .n_inputs = 2, .ndim = {and_, bnd}, .shape = {as, bs}, .lo = -1, .hi = 1,              \
     .fn = run_matmul, .k = k_, .k_backward = kb_}
#define S(...) {__VA_ARGS__}

/* k: the forward dot length K (plus the bias term); k_backward: the longest reduction of the
   backward gemms and bias sum: max(N for dx, M*batch for dw and db, K). */
static const tu_op_case linear_cases[] = {
    LINEAR_CASE("linear_bias", 2, S(4, 6), 6, 5, true, 7, 6),
    LINEAR_CASE("linear_nobias", 2, S(3, 7), 7, 4, false, 7, 7),
    LINEAR_CASE("linear_3d", 3, S(2, 3, 5), 5, 4, true, 6, 6),
    LINEAR_CASE("linear_1d_input", 1, S(6), 6, 3, true, 7, 6),
    LINEAR_CASE("linear_m1", 2, S(1, 9), 9, 4, true, 10, 9),
    LINEAR_CASE("linear_k1", 2, S(6, 1), 1, 5, true, 2, 6),
};

static const tu_op_case matmul_cases[] = {
    MATMUL_CASE("matmul_odd", 2, S(7, 13), 2, S(13, 5), 13, 13),
    MATMUL_CASE("matmul_m1", 2, S(1, 9), 2, S(9, 4), 9, 9),
    MATMUL_CASE("matmul_k1", 2, S(6, 1), 2, S(1, 5), 1, 6),
    MATMUL_CASE("matmul_vec_mat", 1, S(8), 2, S(8, 3), 8, 8),
    MATMUL_CASE("matmul_mat_vec", 2, S(5, 8), 1, S(8), 8, 8),
    MATMUL_CASE("matmul_vec_vec", 1, S(6), 1, S(6), 6, 6),
    MATMUL_CASE("matmul_batched", 3, S(3, 4, 5), 3, S(3, 5, 2), 5, 5),
    MATMUL_CASE("matmul_batched_4d", 4, S(2, 3, 2, 4), 4, S(2, 3, 4, 3), 4, 4),
    MATMUL_CASE("matmul_bcast_b", 4, S(2, 3, 4, 5), 2, S(5, 6), 5, 24),            /* gb: K = 2*3*4 */
    MATMUL_CASE("matmul_bcast_b_dim1", 3, S(3, 4, 5), 3, S(1, 5, 2), 5, 12),
    MATMUL_CASE("matmul_bcast_b_vec", 3, S(3, 4, 5), 1, S(5), 5, 12),
    MATMUL_CASE("matmul_bcast_a", 2, S(4, 5), 3, S(3, 5, 2), 5, 6),                 /* ga: 3 batches x N 2 */
    MATMUL_CASE("matmul_bcast_a_dim1", 3, S(1, 4, 5), 3, S(3, 5, 2), 5, 6),
    MATMUL_CASE("matmul_bcast_a_vec", 1, S(5), 3, S(3, 5, 2), 5, 6),
    MATMUL_CASE("matmul_batched_rank", 3, S(3, 2, 4), 4, S(1, 3, 4, 2), 4, 4),
};

static void test_linear_cases(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof linear_cases / sizeof *linear_cases; i++) tu_check_op(&linear_cases[i]);
}

static void test_matmul_cases(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof matmul_cases / sizeof *matmul_cases; i++) tu_check_op(&matmul_cases[i]);
}

/* An MLP-sized product against REF (no finite differences at this size). */
static void test_matmul_large(void **state) {
    (void)state;
    tu_op_case c = MATMUL_CASE("matmul_256x784x512", 2, S(256, 784), 2, S(784, 512), 784, 784);
    c.skip_fd = true;
    c.skip_dtypes = 1u << AMPC_F16;
    tu_check_op(&c);
}

// ---------------------------------------------------------------------------------------------
// numpy semantics: result shapes and values against a direct broadcasting loop (the op cases
// above only compare the op with itself on two devices)

typedef struct {
    int nda, ndb, ndo;
    int64_t a[5], b[5], out[5];
} mm_shape_case;

/* numpy's matmul written out: promote vectors, broadcast batch dims index by index. */
static void numpy_matmul(const mm_shape_case *c, const double *A, const double *B, double *C) {
    int64_t sa[6], sb[6];
    int na = c->nda, nb = c->ndb;
    memcpy(sa, c->a, sizeof c->a);
    memcpy(sb, c->b, sizeof c->b);
    if (na == 1) sa[1] = sa[0], sa[0] = 1, na = 2;
    if (nb == 1) sb[1] = 1, nb = 2;
    int64_t M = sa[na - 2], K = sa[na - 1], N = sb[nb - 1];
    int bn = (na > nb ? na : nb) - 2;
    int64_t bshape[4], nbatch = 1;
    for (int i = 0; i < bn; i++) {
        int ia = na - 2 - bn + i, ib = nb - 2 - bn + i;
        int64_t da = ia >= 0 ? sa[ia] : 1, db = ib >= 0 ? sb[ib] : 1;
        bshape[i] = da == 1 ? db : da;
        nbatch *= bshape[i];
    }
    for (int64_t t = 0; t < nbatch; t++) {
        int64_t ra = t, offa = 0, offb = 0, stra = 1, strb = 1;
        for (int i = bn - 1; i >= 0; i--) {   /* batch index digits, right to left */
            int64_t digit = ra % bshape[i];
            ra /= bshape[i];
            int ia = na - 2 - bn + i, ib = nb - 2 - bn + i;
            if (ia >= 0) offa += (sa[ia] == 1 ? 0 : digit) * stra, stra *= sa[ia];
            if (ib >= 0) offb += (sb[ib] == 1 ? 0 : digit) * strb, strb *= sb[ib];
        }
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                double s = 0;
                for (int64_t k = 0; k < K; k++) s += A[(offa * M + i) * K + k] * B[(offb * K + k) * N + j];
                C[(t * M + i) * N + j] = s;
            }
    }
}

static void test_matmul_numpy_semantics(void **state) {
    (void)state;
    const mm_shape_case cases[] = {
        {1, 2, 1, {8}, {8, 3}, {3}},
        {2, 1, 1, {5, 8}, {8}, {5}},
        {1, 1, 0, {6}, {6}, {0}},
        {3, 1, 2, {3, 4, 5}, {5}, {3, 4}},
        {1, 3, 2, {5}, {3, 5, 2}, {3, 2}},
        {2, 3, 3, {4, 5}, {3, 5, 2}, {3, 4, 2}},
        {3, 4, 4, {3, 2, 4}, {1, 3, 4, 2}, {1, 3, 2, 2}},
        {4, 2, 4, {2, 3, 4, 5}, {5, 6}, {2, 3, 4, 6}},
        {3, 3, 3, {3, 4, 5}, {1, 5, 2}, {3, 4, 2}},
        {4, 3, 4, {1, 1, 4, 5}, {3, 5, 2}, {1, 3, 4, 2}},
        {4, 4, 4, {2, 3, 2, 4}, {2, 3, 4, 3}, {2, 3, 2, 3}},
    };
    ampc_set_default_device(AMPC_DEVICE_REF);
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        const mm_shape_case *c = &cases[ci];
        ampc_scope_begin();
        ampc_tensor *a = ampc_tensor_rand(AMPC_F64, c->nda, c->a, -1, 1);
        ampc_tensor *b = ampc_tensor_rand(AMPC_F64, c->ndb, c->b, -1, 1);
        ampc_tensor *y = ampc_matmul(a, b);
        ASSERT_NOT_NULL_MSG(y);
        assert_int_equal(ampc_tensor_ndim(y), c->ndo);
        for (int i = 0; i < c->ndo; i++) assert_int_equal(ampc_tensor_dim(y, i), c->out[i]);
        double *A = tu_values(a), *B = tu_values(b), *Y = tu_values(y);
        double *want = malloc((size_t)ampc_tensor_numel(y) * sizeof *want);
        numpy_matmul(c, A, B, want);
        char what[64];
        snprintf(what, sizeof what, "matmul case %zu", ci);
        tu_assert_close(what, Y, want, (size_t)ampc_tensor_numel(y), 1e-14, 1e-14);
        free(A), free(B), free(Y), free(want);
        ampc_scope_end();
    }
    ampc_set_default_device(AMPC_DEVICE_CPU);
}

static void test_grad_fn_names(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_rand(AMPC_F32, 2, (int64_t[]){2, 3}, -1, 1);
    ampc_tensor *w = ampc_tensor_rand(AMPC_F32, 2, (int64_t[]){4, 3}, -1, 1);
    ampc_tensor_set_requires_grad(w, true);
    const char *name = ampc_tensor_grad_fn_name(ampc_linear(x, w, NULL));
    assert_non_null(name);
    assert_string_equal(name, "LinearBackward");
    ampc_tensor *m = ampc_tensor_rand(AMPC_F32, 2, (int64_t[]){3, 2}, -1, 1);
    ampc_tensor_set_requires_grad(m, true);
    name = ampc_tensor_grad_fn_name(ampc_matmul(x, m));
    assert_non_null(name);
    assert_string_equal(name, "MatmulBackward");
    ampc_tensor *v = ampc_tensor_rand(AMPC_F32, 1, (int64_t[]){3}, -1, 1);
    assert_null(ampc_tensor_grad_fn_name(ampc_matmul(x, v)));   /* nothing requires grad */
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Exactness: integer data keeps every f32 partial sum exact (|sum| < 2^24), so the CPU result
// must be the exact product rounded once to the dtype, for every layout and dtype.

static double round_once(double v, ampc_dtype dt) {
    double r;
    char buf[8];
    ampc__dt(dt)->from_f64(&v, buf, 1);   /* correctly rounded (round to nearest even) */
    ampc__dt(dt)->to_f64(buf, &r, 1);
    return r;
}

static double *int_data(size_t n, uint64_t seed, double range) {
    double *x = malloc((n ? n : 1) * sizeof *x);
    tu_fill_uniform(x, n, seed, -range, range + 1);
    for (size_t i = 0; i < n; i++) x[i] = floor(x[i]);
    return x;
}

/* The descriptor's product in f64, the test's own loop. */
static void naive_gemm(const ampc_gemm_desc *d, const double *A, const double *B, const double *bias, double *C) {
    for (int64_t t = 0; t < d->batch; t++)
        for (int64_t i = 0; i < d->M; i++)
            for (int64_t j = 0; j < d->N; j++) {
                double s = 0;
                for (int64_t k = 0; k < d->K; k++) {
                    double a = d->ta ? A[t * d->stride_a + k * d->M + i] : A[t * d->stride_a + i * d->K + k];
                    double b = d->tb ? B[t * d->stride_b + j * d->K + k] : B[t * d->stride_b + k * d->N + j];
                    s += a * b;
                }
                C[t * d->stride_c + i * d->N + j] = s + (bias ? bias[j] : 0);
            }
}

static void check_kernel(ampc_gemm_desc d, bool has_bias, uint64_t seed) {
    int64_t na = (d.stride_a ? (d.batch - 1) * d.stride_a : 0) + d.M * d.K;
    int64_t nb = (d.stride_b ? (d.batch - 1) * d.stride_b : 0) + d.K * d.N;
    int64_t nc = d.batch * d.M * d.N;
    double *A = int_data((size_t)na, seed, 16), *B = int_data((size_t)nb, seed + 1, 16);
    double *bias = int_data((size_t)d.N, seed + 2, 64), *want = malloc((size_t)nc * sizeof *want);
    naive_gemm(&d, A, B, has_bias ? bias : NULL, want);
    char what[200];
    for (int dev = 0; dev < 2; dev++) {
        size_t ndt = dev == 0 ? sizeof cpu_dtypes / sizeof *cpu_dtypes : 1;
        for (size_t di = 0; di < ndt; di++) {
            ampc_dtype dt = dev == 0 ? cpu_dtypes[di] : AMPC_F64;
            ampc_device device = dev == 0 ? AMPC_DEVICE_CPU : AMPC_DEVICE_REF;
            ampc_set_default_device(device);
            ampc_scope_begin();
            ampc_tensor *a = ampc_tensor_from_f64(dt, 1, (int64_t[]){na}, A);
            ampc_tensor *b = ampc_tensor_from_f64(dt, 1, (int64_t[]){nb}, B);
            ampc_tensor *bs = has_bias ? ampc_tensor_from_f64(dt, 1, (int64_t[]){d.N}, bias) : NULL;
            ampc_tensor *c = ampc_tensor_full(dt, 1, (int64_t[]){nc}, NAN);
            ASSERT_NOT_NULL_MSG(c);
            ASSERT_OK(ampc__backend(device)->gemm(&d, a, b, bs, c));
            double *got = tu_values(c);
            for (int64_t i = 0; i < nc; i++) {
                double w = round_once(want[i], dt);
                if (got[i] != w) {
                    snprintf(what, sizeof what, "%s/%s batch %lld M %lld N %lld K %lld ta %d tb %d strides %lld %lld bias %d",
                             ampc_device_name(device), ampc_dtype_name(dt), (long long)d.batch, (long long)d.M, (long long)d.N,
                             (long long)d.K, d.ta, d.tb, (long long)d.stride_a, (long long)d.stride_b, has_bias);
                    fail_msg("%s: element %lld is %.9g, exact rounded %.9g", what, (long long)i, got[i], w);
                }
            }
            free(got);
            ampc_scope_end();
        }
    }
    ampc_set_default_device(AMPC_DEVICE_CPU);
    free(A), free(B), free(bias), free(want);
}

static void test_gemm_exact_layouts(void **state) {
    (void)state;
    const int64_t Ks[] = {1, 2, 64, 300};
    uint64_t seed = 1;
    for (size_t ki = 0; ki < sizeof Ks / sizeof *Ks; ki++)
        for (int t = 0; t < 4; t++)
            for (int mode = 0; mode < 5; mode++) {
                int64_t M = 5, N = 7, K = Ks[ki];
                ampc_gemm_desc d = {.batch = 1, .M = M, .N = N, .K = K, .ta = t & 1, .tb = (t >> 1) & 1};
                if (mode > 0) {   /* batched: dense, A broadcast, B broadcast, both broadcast */
                    d.batch = 3;
                    d.stride_a = mode == 2 || mode == 4 ? 0 : M * K;
                    d.stride_b = mode == 3 || mode == 4 ? 0 : K * N;
                    d.stride_c = M * N;
                }
                check_kernel(d, (seed & 1) != 0, seed);
                seed++;
            }
}

/* Vectors as matrices (M, N or K of 1), where the kernel drops meaningless transposes. */
static void test_gemm_exact_degenerate(void **state) {
    (void)state;
    const int64_t dims[][3] = {{1, 7, 9}, {6, 1, 9}, {6, 7, 1}, {1, 1, 9}, {1, 1, 1}};
    uint64_t seed = 100;
    for (size_t i = 0; i < sizeof dims / sizeof *dims; i++)
        for (int t = 0; t < 4; t++) {
            ampc_gemm_desc d = {.batch = 2, .M = dims[i][0], .N = dims[i][1], .K = dims[i][2], .ta = t & 1, .tb = t >> 1};
            d.stride_a = d.M * d.K, d.stride_b = d.K * d.N, d.stride_c = d.M * d.N;
            check_kernel(d, t == 1, seed++);
        }
}

/* Sizes beyond the 16-bit formats' exact integers: rounding happens once, at the end. */
static void test_linear_exact_16bit(void **state) {
    (void)state;
    int64_t in = 40, out = 9, nx = 2 * 3 * in;
    double *X = int_data((size_t)nx, 7, 16), *W = int_data((size_t)(out * in), 8, 16), *Bv = int_data((size_t)out, 9, 64);
    for (size_t di = 0; di < sizeof cpu_dtypes / sizeof *cpu_dtypes; di++) {
        ampc_dtype dt = cpu_dtypes[di];
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_from_f64(dt, 3, (int64_t[]){2, 3, in}, X);
        ampc_tensor *w = ampc_tensor_from_f64(dt, 2, (int64_t[]){out, in}, W);
        ampc_tensor *b = ampc_tensor_from_f64(dt, 1, (int64_t[]){out}, Bv);
        ampc_tensor *y = ampc_linear(x, w, b);
        ASSERT_NOT_NULL_MSG(y);
        assert_int_equal(ampc_tensor_ndim(y), 3);
        assert_int_equal(ampc_tensor_dim(y, 2), out);
        assert_int_equal(ampc_tensor_dtype(y), dt);
        double *got = tu_values(y);
        int rounded = 0;
        for (int64_t r = 0; r < 6; r++)
            for (int64_t j = 0; j < out; j++) {
                double s = Bv[j];
                for (int64_t k = 0; k < in; k++) s += X[r * in + k] * W[j * in + k];
                double want = round_once(s, dt);
                rounded += want != s;
                if (got[r * out + j] != want)
                    fail_msg("linear %s [%lld, %lld]: %.9g, exact %.17g rounded once %.9g", ampc_dtype_name(dt), (long long)r,
                             (long long)j, got[r * out + j], s, want);
            }
        if (dt == AMPC_BF16) assert_true(rounded > 0);   /* the data does exercise the rounding */
        free(got);
        ampc_scope_end();
    }
    free(X), free(W), free(Bv);
}

// ---------------------------------------------------------------------------------------------
// Autocast: the product runs in the autocast dtype, master weights get f32 gradients

static void test_linear_autocast(void **state) {
    (void)state;
    const ampc_dtype lows[] = {AMPC_F16, AMPC_BF16};
    for (int l = 0; l < 2; l++) {
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_rand(AMPC_F32, 2, (int64_t[]){8, 16}, -1, 1);
        ampc_tensor *w = ampc_tensor_rand(AMPC_F32, 2, (int64_t[]){4, 16}, -1, 1);
        ampc_tensor *b = ampc_tensor_rand(AMPC_F32, 1, (int64_t[]){4}, -1, 1);
        ampc_tensor_set_requires_grad(w, true);
        ampc_tensor_set_requires_grad(b, true);
        ampc_autocast_enter(lows[l], true);
        ampc_tensor *y = ampc_linear(x, w, b);
        ampc_autocast_exit();
        ASSERT_NOT_NULL_MSG(y);
        assert_int_equal(ampc_tensor_dtype(y), lows[l]);
        ASSERT_OK(ampc_backward(ampc_sum(y, AMPC_ALL_DIMS, false)));
        assert_int_equal(ampc_tensor_dtype(ampc_tensor_grad(w)), AMPC_F32);
        assert_int_equal(ampc_tensor_dtype(ampc_tensor_grad(b)), AMPC_F32);
        /* d sum / d b = number of rows, exact in every dtype */
        double gb[4];
        ASSERT_OK(ampc_tensor_to_f64(ampc_tensor_grad(b), gb, 4));
        for (int j = 0; j < 4; j++) assert_true(gb[j] == 8.0);
        ampc_scope_end();
    }
}

// ---------------------------------------------------------------------------------------------
// Errors

static void test_errors(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *x43 = ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){4, 3});
    ampc_tensor *w57 = ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){5, 7});
    ampc_tensor *w53 = ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){5, 3});
    ampc_clear_error();
    tu_expect_error(ampc_linear(x43, w57, NULL), AMPC_ERR_SHAPE, "input (4, 3) has 3 features but weight (5, 7) expects 7");
    tu_expect_error(ampc_linear(x43, w53, ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){4})), AMPC_ERR_SHAPE, "bias (4,)");
    tu_expect_error(ampc_linear(x43, ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){3}), NULL), AMPC_ERR_SHAPE, "2-D");
    tu_expect_error(ampc_linear(ampc_tensor_zeros(AMPC_F16, 2, (int64_t[]){4, 3}), w53, NULL), AMPC_ERR_DTYPE, "f16");
    tu_expect_error(ampc_linear(ampc_tensor_from_i64(2, (int64_t[]){4, 3}, (int64_t[12]){0}), w53, NULL), AMPC_ERR_DTYPE, "i64");
    tu_expect_error(ampc_matmul(x43, w57), AMPC_ERR_SHAPE, "(4, 3)");
    tu_expect_error(ampc_matmul(x43, ampc_tensor_zeros(AMPC_BF16, 2, (int64_t[]){3, 2})), AMPC_ERR_DTYPE, "bf16");
    tu_expect_error(ampc_matmul(ampc_tensor_zeros(AMPC_F32, 3, (int64_t[]){2, 4, 3}), ampc_tensor_zeros(AMPC_F32, 3, (int64_t[]){3, 3, 2})),
                 AMPC_ERR_SHAPE, "batch dimensions");
    tu_expect_error(ampc_matmul(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){2, 1, 4, 3}), ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){1, 5, 3, 2})),
                 AMPC_ERR_UNSUPPORTED, "(2, 1, 4, 3)");
    tu_expect_error(ampc_matmul(ampc_tensor_full(AMPC_F32, 0, NULL, 1), x43), AMPC_ERR_SHAPE, "at least 1 dimension");
    /* a NULL input keeps the first error of a chain */
    ampc_tensor *bad = ampc_linear(x43, w57, NULL);
    tu_expect_error(ampc_matmul(bad, x43), AMPC_ERR_SHAPE, "expects 7");
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Steady state: the second identical step reuses primitive, scratchpad and tensor blocks

static void test_steady_state_no_malloc(void **state) {
    (void)state;
    for (size_t di = 0; di < sizeof cpu_dtypes / sizeof *cpu_dtypes; di++) {
        ampc_dtype dt = cpu_dtypes[di];
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_rand(dt, 2, (int64_t[]){64, 96}, -1, 1);
        ampc_tensor *w = ampc_tensor_rand(dt, 2, (int64_t[]){48, 96}, -1, 1);
        ampc_tensor *b = ampc_tensor_rand(dt, 1, (int64_t[]){48}, -1, 1);
        ampc_tensor_set_requires_grad(x, true);
        ampc_tensor_set_requires_grad(w, true);
        ampc_tensor_set_requires_grad(b, true);
        uint64_t before = 0;
        for (int step = 0; step < 3; step++) {
            if (step == 2) before = ampc_memory_stats().n_malloc;   /* grads exist from step 1 on */
            ampc_scope_begin();
            ampc_tensor *y = ampc_linear(x, w, b);
            ASSERT_NOT_NULL_MSG(y);
            ampc_tensor *g = ampc_tensor_full(dt, 2, (int64_t[]){64, 48}, 0.5);
            ASSERT_OK(ampc_backward_with_grad(y, g));
            ampc_scope_end();
        }
        uint64_t after = ampc_memory_stats().n_malloc;
        if (after != before) fail_msg("%s: step 3 made %llu new system allocations", ampc_dtype_name(dt), (unsigned long long)(after - before));
        ampc_scope_end();
    }
}

// ---------------------------------------------------------------------------------------------
// Threads: the primitive cache and the stream are shared; concurrent callers must get their
// own correct results

typedef struct { int id; int bad; } thread_arg;

static void *thread_main(void *p) {
    thread_arg *t = p;
    for (int it = 0; it < 20 && !t->bad; it++) {
        ampc_scope_begin();
        int64_t n = 8 + t->id;   /* a different shape per thread: different cache entries */
        ampc_tensor *a = ampc_tensor_full(AMPC_BF16, 2, (int64_t[]){n, 16}, 1.0);
        ampc_tensor *b = ampc_tensor_full(AMPC_BF16, 2, (int64_t[]){16, n}, (double)(t->id + 1));
        ampc_tensor *y = ampc_matmul(a, b);
        double v[16 * 16];
        if (!y || ampc_tensor_to_f64(y, v, sizeof v / sizeof *v) < 0) t->bad = 1;
        for (int64_t i = 0; y && i < n * n; i++)
            if (v[i] != 16.0 * (t->id + 1)) t->bad = 1;
        ampc_scope_end();
    }
    return NULL;
}

static void test_concurrent_callers(void **state) {
    (void)state;
    pthread_t th[3];
    thread_arg args[3];
    for (int i = 0; i < 3; i++) {
        args[i] = (thread_arg){i, 0};
        assert_int_equal(pthread_create(&th[i], NULL, thread_main, &args[i]), 0);
    }
    for (int i = 0; i < 3; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(args[i].bad, 0);
    }
}

// ---------------------------------------------------------------------------------------------
// Which oneDNN kernels run: bf16 must take the native AVX512_BF16 path where the CPU has it

static void test_impl_names(void **state) {
    (void)state;
    const ampc_gemm_desc shapes[] = {
        {.batch = 1, .M = 256, .N = 512, .K = 784, .tb = true},   /* linear forward */
        {.batch = 1, .M = 256, .N = 784, .K = 512},               /* dx */
        {.batch = 1, .M = 512, .N = 784, .K = 256, .ta = true},   /* dw */
    };
    bool has_bf16 = ampc_dtype_native(AMPC_DEVICE_CPU, AMPC_BF16);   /* oneDNN runs bf16 on bf16 units here */
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (int d = 0; d < 2; d++) {
            char name[128];
            ampc_dtype dt = d ? AMPC_BF16 : AMPC_F32;
            ASSERT_OK(ampc__cpu_gemm_impl(&shapes[i], dt, i == 0, name, sizeof name));
            print_message("gemm %s M %lld N %lld K %lld ta %d tb %d: %s\n", ampc_dtype_name(dt), (long long)shapes[i].M,
                          (long long)shapes[i].N, (long long)shapes[i].K, shapes[i].ta, shapes[i].tb, name);
            assert_null(strstr(name, "ref"));
            if (dt == AMPC_BF16 && has_bf16) assert_true(tu_impl_bf16_native(name));
        }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_linear_cases),
        cmocka_unit_test(test_matmul_cases),
        cmocka_unit_test(test_matmul_large),
        cmocka_unit_test(test_matmul_numpy_semantics),
        cmocka_unit_test(test_grad_fn_names),
        cmocka_unit_test(test_gemm_exact_layouts),
        cmocka_unit_test(test_gemm_exact_degenerate),
        cmocka_unit_test(test_linear_exact_16bit),
        cmocka_unit_test(test_linear_autocast),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_steady_state_no_malloc),
        cmocka_unit_test(test_concurrent_callers),
        cmocka_unit_test(test_impl_names),
    };
    return cmocka_run_group_tests_name("matmul", tests, tu_group_setup, tu_group_teardown);
}
