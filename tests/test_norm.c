/*
 * test_norm.c - batch norm and layer norm: gradients by finite differences on REF, every CPU
 * dtype against REF (both storage walks of the CPU batch norm: per channel for large spatial
 * sizes, per column for small ones), and independent f64 computations written here: running
 * statistics over several training steps (unbiased variance, PyTorch's momentum rule),
 * evaluation with the running statistics, bf16 activations with f32 statistics, variance
 * accuracy under a large common offset, autocast dtypes, mixed storage dtypes (the staged
 * path) against the register path, errors, and the no-malloc steady state.
 */
#include "testutil.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"

static const ampc_dtype cpu_dtypes[] = {AMPC_F32, AMPC_F16, AMPC_BF16};

/* Statistics dtype of the tensor's device: f64 on REF (its only float), else f32. */
static ampc_dtype stat_dt(const ampc_tensor *x) { return ampc_tensor_dtype(x) == AMPC_F64 ? AMPC_F64 : AMPC_F32; }

static double mean_abs(const double *v, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += fabs(v[i]);
    return n ? s / (double)n : 0;
}

// ---------------------------------------------------------------------------------------------
// Op cases: the harness creates every float input in the tested dtype; batch norm's weight and
// bias are cast to the statistics dtype here (a recorded cast: their gradients flow back).

typedef struct {
    bool training, affine, no_bias;
} bn_cfg;

static ampc_tensor *run_bn(ampc_tensor **in, const void *ctx) {
    const bn_cfg *c = ctx;
    ampc_tensor *x = in[0], *w = NULL, *b = NULL, *rm = NULL, *rv = NULL;
    ampc_dtype sdt = stat_dt(x);
    if (c->affine) {
        w = ampc_cast(in[1], sdt);
        b = c->no_bias ? NULL : ampc_cast(in[2], sdt);
    }
    int64_t C = ampc_tensor_dim(x, 1);
    if (!c->training) {   /* fixed running statistics: inputs that need no gradient */
        double m[16], v[16];
        assert_true(C <= 16);
        for (int64_t i = 0; i < C; i++) m[i] = 0.1 * (double)i - 0.2, v[i] = 0.5 + 0.25 * (double)i;
        rm = ampc_tensor_from_f64(sdt, 1, &C, m);
        rv = ampc_tensor_from_f64(sdt, 1, &C, v);
    }
    return ampc_batch_norm2d(x, w, b, rm, rv, c->training, 0.1, 1e-5);
}

static const bn_cfg bn_train_affine = {true, true, false}, bn_train_plain = {true, false, false},
                    bn_train_weight = {true, true, true}, bn_eval_affine = {false, true, false},
                    bn_eval_plain = {false, false, false};

#define S(...) {__VA_ARGS__}
/* k: the reduction length per channel M = N * spatial */
#define BN_CASE(nm, nd, xs, C_, cfg, M_)                                                           \
    {.name = nm, .n_inputs = (cfg).affine ? ((cfg).no_bias ? 2 : 3) : 1, .ndim = {nd, 1, 1}, .shape = {xs, {C_}, {C_}}, .lo = -1, .hi = 1, \
     .fn = run_bn, .ctx = &(cfg), .k = M_}

static const tu_op_case bn_cases[] = {
    BN_CASE("bn_train_4x3x5x5", 4, S(4, 3, 5, 5), 3, bn_train_affine, 100),
    BN_CASE("bn_train_4x3x5x5_noaffine", 4, S(4, 3, 5, 5), 3, bn_train_plain, 100),
    BN_CASE("bn_train_2x5x3x1", 4, S(2, 5, 3, 1), 5, bn_train_affine, 6),
    BN_CASE("bn_train_2x5x3x1_noaffine", 4, S(2, 5, 3, 1), 5, bn_train_plain, 6),
    BN_CASE("bn_train_7x2x1x1", 4, S(7, 2, 1, 1), 2, bn_train_affine, 7),
    BN_CASE("bn_train_7x2x1x1_noaffine", 4, S(7, 2, 1, 1), 2, bn_train_plain, 7),
    BN_CASE("bn_train_2x3x6x6", 4, S(2, 3, 6, 6), 3, bn_train_affine, 72),   /* per-channel walk */
    BN_CASE("bn_train_2x3x6x6_noaffine", 4, S(2, 3, 6, 6), 3, bn_train_plain, 72),
    BN_CASE("bn_train_2x3x6x6_weight_only", 4, S(2, 3, 6, 6), 3, bn_train_weight, 72),
    BN_CASE("bn_train_4x3x5x5_weight_only", 4, S(4, 3, 5, 5), 3, bn_train_weight, 100),
    BN_CASE("bn_train_1d_6x4", 2, S(6, 4), 4, bn_train_affine, 6),           /* BatchNorm1d (N, C) */
    BN_CASE("bn_train_1d_3x2x5", 3, S(3, 2, 5), 2, bn_train_affine, 15),     /* (N, C, L) */
    BN_CASE("bn_eval_4x3x5x5", 4, S(4, 3, 5, 5), 3, bn_eval_affine, 1),
    BN_CASE("bn_eval_2x3x6x6", 4, S(2, 3, 6, 6), 3, bn_eval_affine, 1),
    BN_CASE("bn_eval_2x3x6x6_noaffine", 4, S(2, 3, 6, 6), 3, bn_eval_plain, 1),
    BN_CASE("bn_eval_7x2x1x1_noaffine", 4, S(7, 2, 1, 1), 2, bn_eval_plain, 1),
};

static void test_batch_norm_cases(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof bn_cases / sizeof *bn_cases; i++) tu_check_op(&bn_cases[i]);
}

/* Rows longer than a staging chunk (1024 values), against REF only (no finite differences). */
static void test_batch_norm_long_rows(void **state) {
    (void)state;
    tu_op_case a = BN_CASE("bn_train_2x3x33x33", 4, S(2, 3, 33, 33), 3, bn_train_affine, 2178);
    tu_op_case b = BN_CASE("bn_train_1d_40x1500", 2, S(40, 1500), 1500, bn_train_affine, 40);
    tu_op_case e = BN_CASE("bn_eval_2x3x33x33", 4, S(2, 3, 33, 33), 3, bn_eval_plain, 1);
    a.skip_fd = b.skip_fd = e.skip_fd = true;
    tu_check_op(&a);
    tu_check_op(&b);
    tu_check_op(&e);
}

typedef struct {
    int norm_ndim;
    bool affine, no_bias;
} ln_cfg;

static ampc_tensor *run_ln(ampc_tensor **in, const void *ctx) {
    const ln_cfg *c = ctx;
    return ampc_layer_norm(in[0], c->norm_ndim, c->affine ? in[1] : NULL, c->affine && !c->no_bias ? in[2] : NULL, 1e-5);
}

static const ln_cfg ln1a = {1, true, false}, ln1 = {1, false, false}, ln2a = {2, true, false}, ln2 = {2, false, false},
                    ln1w = {1, true, true};

/* k: cols (the row statistics) and, backward, max(rows, cols) (the weight gradient sums rows) */
#define LN_CASE(nm, nd, xs, pnd, ps, cfg, k_, kb_)                                                 \
    {.name = nm, .n_inputs = (cfg).affine ? ((cfg).no_bias ? 2 : 3) : 1, .ndim = {nd, pnd, pnd}, .shape = {xs, ps, ps}, .lo = -1, .hi = 1, \
     .fn = run_ln, .ctx = &(cfg), .k = k_, .k_backward = kb_}

static const tu_op_case ln_cases[] = {
    LN_CASE("ln_4x6", 2, S(4, 6), 1, S(6), ln1a, 6, 6),
    LN_CASE("ln_4x6_noaffine", 2, S(4, 6), 1, S(6), ln1, 6, 6),
    LN_CASE("ln_2x3x7", 3, S(2, 3, 7), 1, S(7), ln1a, 7, 7),
    LN_CASE("ln_3x4x5_last2", 3, S(3, 4, 5), 2, S(4, 5), ln2a, 20, 20),
    LN_CASE("ln_3x4x5_last2_noaffine", 3, S(3, 4, 5), 2, S(4, 5), ln2, 20, 20),
    LN_CASE("ln_2x5_all", 2, S(2, 5), 2, S(2, 5), ln2a, 10, 10),
    LN_CASE("ln_9x4", 2, S(9, 4), 1, S(4), ln1a, 4, 9),
    LN_CASE("ln_5x6_weight_only", 2, S(5, 6), 1, S(6), ln1w, 6, 6),
};

static void test_layer_norm_cases(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof ln_cases / sizeof *ln_cases; i++) tu_check_op(&ln_cases[i]);
    tu_op_case big = LN_CASE("ln_40x1500", 2, S(40, 1500), 1, S(1500), ln1a, 1500, 1500);
    big.skip_fd = true;
    tu_check_op(&big);
}

// ---------------------------------------------------------------------------------------------
// Running statistics: three training steps against the formulas in f64

/* mean and unbiased variance of channel c of x (N, C, S) */
static void channel_stats(const double *x, int64_t N, int64_t C, int64_t S, int64_t c, double *mean, double *var_b,
                          double *var_u) {
    double s = 0, q = 0, M = (double)(N * S);
    for (int64_t n = 0; n < N; n++)
        for (int64_t i = 0; i < S; i++) s += x[(n * C + c) * S + i];
    *mean = s / M;
    for (int64_t n = 0; n < N; n++)
        for (int64_t i = 0; i < S; i++) q += (x[(n * C + c) * S + i] - *mean) * (x[(n * C + c) * S + i] - *mean);
    if (var_b) *var_b = q / M;
    if (var_u) *var_u = q / (M - 1);
}

static void check_running_stats(ampc_device dev, ampc_dtype dt, int nd, const int64_t *shape, double momentum) {
    int64_t N = shape[0], C = shape[1], S = 1;
    for (int i = 2; i < nd; i++) S *= shape[i];
    int64_t n = N * C * S;
    ampc_dtype sdt = dev == AMPC_DEVICE_REF ? AMPC_F64 : AMPC_F32;
    ampc_set_default_device(dev);
    ampc_scope_begin();
    double want_m[8], want_v[8];
    for (int64_t c = 0; c < C; c++) want_m[c] = 0, want_v[c] = 1;   /* PyTorch's initial buffers */
    ampc_tensor *rm = ampc_tensor_zeros(sdt, 1, &C), *rv = ampc_tensor_full(sdt, 1, &C, 1.0);
    double *x = malloc((size_t)n * sizeof *x);
    for (int step = 0; step < 3; step++) {
        tu_fill_uniform(x, (size_t)n, 40 + (uint64_t)step, -1 + step, 2 + 2 * step);   /* statistics move */
        for (int64_t i = 0; i < n; i++) x[i] = tu_round_to(dt, x[i]);
        ampc_scope_begin();
        ampc_tensor *xt = ampc_tensor_from_f64(dt, nd, shape, x);
        ASSERT_NOT_NULL_MSG(ampc_batch_norm2d(xt, NULL, NULL, rm, rv, true, momentum, 1e-5));
        ampc_scope_end();
        for (int64_t c = 0; c < C; c++) {
            double m, vu;
            channel_stats(x, N, C, S, c, &m, NULL, &vu);
            want_m[c] = (1 - momentum) * want_m[c] + momentum * m;
            want_v[c] = (1 - momentum) * want_v[c] + momentum * vu;
        }
    }
    /* inputs are exact; each step rounds the f32 buffers once, with f32-or-better sums of M terms */
    double u = dev == AMPC_DEVICE_REF ? 0x1p-53 : 0x1p-24, tol = (6 + (double)(N * S)) * u * 2;
    double *gm = tu_values(rm), *gv = tu_values(rv);
    char what[128];
    snprintf(what, sizeof what, "running_mean %s/%s N %lld C %lld S %lld momentum %g", ampc_device_name(dev),
             ampc_dtype_name(dt), (long long)N, (long long)C, (long long)S, momentum);
    tu_assert_close(what, gm, want_m, (size_t)C, tol, tol);
    snprintf(what, sizeof what, "running_var %s/%s N %lld C %lld S %lld momentum %g", ampc_device_name(dev),
             ampc_dtype_name(dt), (long long)N, (long long)C, (long long)S, momentum);
    tu_assert_close(what, gv, want_v, (size_t)C, tol, tol);
    free(gm), free(gv), free(x);
    ampc_scope_end();
    ampc_set_default_device(AMPC_DEVICE_CPU);
}

static void test_running_stats(void **state) {
    (void)state;
    const int64_t s4[] = {4, 3, 6, 6}, s4small[] = {5, 3, 2, 2}, s2[] = {9, 4};
    const double moms[] = {0.1, 0.5};
    for (int mi = 0; mi < 2; mi++) {
        check_running_stats(AMPC_DEVICE_REF, AMPC_F64, 4, s4, moms[mi]);
        check_running_stats(AMPC_DEVICE_REF, AMPC_F64, 2, s2, moms[mi]);
        for (size_t d = 0; d < sizeof cpu_dtypes / sizeof *cpu_dtypes; d++) {
            check_running_stats(AMPC_DEVICE_CPU, cpu_dtypes[d], 4, s4, moms[mi]);
            check_running_stats(AMPC_DEVICE_CPU, cpu_dtypes[d], 4, s4small, moms[mi]);
            check_running_stats(AMPC_DEVICE_CPU, cpu_dtypes[d], 2, s2, moms[mi]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Evaluation: y = (x - running_mean) / sqrt(running_var + eps) * w + b, buffers unchanged

static void test_eval_uses_running_stats(void **state) {
    (void)state;
    const int64_t shapes[][4] = {{3, 4, 6, 6}, {3, 4, 2, 3}};
    const int64_t C = 4;
    const double rm[] = {0.5, -1.0, 2.0, 0.0}, rv[] = {0.25, 2.0, 1.0, 4.0}, w[] = {1.5, -0.5, 1.0, 2.0},
                 b[] = {0.1, 0.2, -0.3, 0.0}, eps = 1e-3;
    for (int si = 0; si < 2; si++)
        for (size_t d = 0; d < sizeof cpu_dtypes / sizeof *cpu_dtypes; d++) {
            ampc_dtype dt = cpu_dtypes[d];
            const int64_t *sh = shapes[si];
            int64_t S = sh[2] * sh[3], n = sh[0] * C * S;
            ampc_scope_begin();
            double *x = malloc((size_t)n * sizeof *x), *want = malloc((size_t)n * sizeof *want);
            tu_fill_uniform(x, (size_t)n, 7, -2, 2);
            for (int64_t i = 0; i < n; i++) {
                x[i] = tu_round_to(dt, x[i]);
                int64_t c = (i / S) % C;
                want[i] = (x[i] - rm[c]) / sqrt(rv[c] + eps) * w[c] + b[c];
            }
            ampc_tensor *rmt = ampc_tensor_from_f64(AMPC_F32, 1, &C, rm), *rvt = ampc_tensor_from_f64(AMPC_F32, 1, &C, rv);
            ampc_tensor *y = ampc_batch_norm2d(ampc_tensor_from_f64(dt, 4, sh, x), ampc_tensor_from_f64(AMPC_F32, 1, &C, w),
                                               ampc_tensor_from_f64(AMPC_F32, 1, &C, b), rmt, rvt, false, 0.1, eps);
            ASSERT_NOT_NULL_MSG(y);
            assert_int_equal(ampc_tensor_dtype(y), dt);
            double *got = tu_values(y), *grm = tu_values(rmt), *grv = tu_values(rvt);
            /* f32 coefficients, one rounding to dt */
            double tol = 2 * tu_eps(dt) + 16 * 0x1p-24;
            char what[96];
            snprintf(what, sizeof what, "eval %s shape %d", ampc_dtype_name(dt), si);
            tu_assert_close(what, got, want, (size_t)n, tol * mean_abs(want, (size_t)n), tol);
            for (int64_t c = 0; c < C; c++) {   /* evaluation leaves the buffers alone */
                assert_true(grm[c] == rm[c]);
                assert_true(grv[c] == rv[c]);
            }
            free(x), free(want), free(got), free(grm), free(grv);
            ampc_scope_end();
        }
}

// ---------------------------------------------------------------------------------------------
// bf16 activations with f32 statistics (the autocast situation) against f64 formulas

static void test_bf16_with_f32_stats(void **state) {
    (void)state;
    /* large enough for two threads in the per-channel walk */
    const int64_t sh[] = {16, 4, 24, 24}, C = 4, S = 576, N = 16, n = 16 * 4 * 576;
    const double M = (double)(N * S), eps = 1e-5;
    double *x = malloc(n * sizeof *x), *gy = malloc(n * sizeof *gy), w[4] = {1.5, -0.75, 0.5, 2.0}, b[4] = {0, 1, -1, 0.25};
    tu_fill_uniform(x, n, 3, -3, 5);
    tu_fill_uniform(gy, n, 4, -1, 1);
    for (int64_t i = 0; i < n; i++) x[i] = tu_round_to(AMPC_BF16, x[i]), gy[i] = tu_round_to(AMPC_BF16, gy[i]);
    ampc_scope_begin();
    ampc_tensor *xt = ampc_tensor_from_f64(AMPC_BF16, 4, sh, x), *wt = ampc_tensor_from_f64(AMPC_F32, 1, &C, w);
    ampc_tensor *bt = ampc_tensor_from_f64(AMPC_F32, 1, &C, b);
    ampc_tensor *rm = ampc_tensor_zeros(AMPC_F32, 1, &C), *rv = ampc_tensor_full(AMPC_F32, 1, &C, 1.0);
    ampc_tensor_set_requires_grad(xt, true);
    ampc_tensor_set_requires_grad(wt, true);
    ampc_tensor_set_requires_grad(bt, true);
    ampc_tensor *y = ampc_batch_norm2d(xt, wt, bt, rm, rv, true, 0.1, eps);
    ASSERT_NOT_NULL_MSG(y);
    assert_int_equal(ampc_tensor_dtype(y), AMPC_BF16);
    assert_string_equal(ampc_tensor_grad_fn_name(y), "NativeBatchNormBackward");
    ASSERT_OK(ampc_backward_with_grad(y, ampc_tensor_from_f64(AMPC_BF16, 4, sh, gy)));
    assert_int_equal(ampc_tensor_dtype(ampc_tensor_grad(wt)), AMPC_F32);
    assert_int_equal(ampc_tensor_dtype(ampc_tensor_grad(bt)), AMPC_F32);
    assert_int_equal(ampc_tensor_dtype(ampc_tensor_grad(xt)), AMPC_BF16);
    double *want_y = malloc(n * sizeof *want_y), *want_gx = malloc(n * sizeof *want_gx), want_gw[4], want_gb[4];
    double abs_gw[4], abs_gb[4];
    for (int64_t c = 0; c < C; c++) {
        double m, vb;
        channel_stats(x, N, C, S, c, &m, &vb, NULL);
        double is = 1 / sqrt(vb + eps), sg = 0, sgx = 0;
        abs_gw[c] = abs_gb[c] = 0;
        for (int64_t k = 0; k < N; k++)
            for (int64_t i = 0; i < S; i++) {
                int64_t j = (k * C + c) * S + i;
                double xh = (x[j] - m) * is;
                want_y[j] = xh * w[c] + b[c];
                sg += gy[j], sgx += gy[j] * xh;
                abs_gb[c] += fabs(gy[j]), abs_gw[c] += fabs(gy[j] * xh);
            }
        want_gw[c] = sgx, want_gb[c] = sg;
        for (int64_t k = 0; k < N; k++)
            for (int64_t i = 0; i < S; i++) {
                int64_t j = (k * C + c) * S + i;
                want_gx[j] = w[c] * is / M * (M * gy[j] - sg - (x[j] - m) * is * sgx);
            }
    }
    double *gy_ = tu_values(y), *gx = tu_values(ampc_tensor_grad(xt)), *gw = tu_values(ampc_tensor_grad(wt));
    double *gb = tu_values(ampc_tensor_grad(bt));
    /* outputs: one bf16 rounding after f32 arithmetic with statistics accurate to f32 */
    double tb = 2 * 0x1p-8 + 64 * 0x1p-24;
    tu_assert_close("bf16 batch norm y", gy_, want_y, n, tb * mean_abs(want_y, n), tb);
    tu_assert_close("bf16 batch norm gx", gx, want_gx, n, tb * mean_abs(want_gx, n), tb);
    /* weight/bias gradients in f32: sums of M terms, each term's error a few f32 ulps */
    for (int64_t c = 0; c < C; c++) {
        double tw = (8 + M) * 0x1p-24 * abs_gw[c], tbb = (8 + M) * 0x1p-24 * abs_gb[c];
        if (fabs(gw[c] - want_gw[c]) > tw) fail_msg("gw[%lld] %.9g vs %.9g", (long long)c, gw[c], want_gw[c]);
        if (fabs(gb[c] - want_gb[c]) > tbb) fail_msg("gb[%lld] %.9g vs %.9g", (long long)c, gb[c], want_gb[c]);
    }
    free(x), free(gy), free(want_y), free(want_gx), free(gy_), free(gx), free(gw), free(gb);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// A large common offset: x = 1000 + noise. E[x^2] - E[x]^2 in f32 would lose the variance
// (1e6 against 3e-5); the centred second pass keeps it to f32 accuracy.

static void check_offset_bn(int nd, const int64_t *shape) {
    int64_t N = shape[0], C = shape[1], S = 1;
    for (int i = 2; i < nd; i++) S *= shape[i];
    int64_t n = N * C * S;
    double *x = malloc((size_t)n * sizeof *x);
    tu_fill_uniform(x, (size_t)n, 11, -0.01, 0.01);
    for (int64_t i = 0; i < n; i++) x[i] = tu_round_to(AMPC_F32, 1000 + x[i] * (1 + (double)((i / S) % C)));
    ampc_scope_begin();
    ampc_tensor *rm = ampc_tensor_zeros(AMPC_F32, 1, &C), *rv = ampc_tensor_zeros(AMPC_F32, 1, &C);
    /* momentum 1: the buffers receive the batch mean and unbiased variance themselves */
    ampc_tensor *y = ampc_batch_norm2d(ampc_tensor_from_f64(AMPC_F32, nd, shape, x), NULL, NULL, rm, rv, true, 1.0, 0.0);
    ASSERT_NOT_NULL_MSG(y);
    double *gm = tu_values(rm), *gv = tu_values(rv), *gy = tu_values(y), *want = malloc((size_t)n * sizeof *want);
    double want_m[8], want_v[8];
    for (int64_t c = 0; c < C; c++) {
        double vb;
        channel_stats(x, N, C, S, c, &want_m[c], &vb, &want_v[c]);
        for (int64_t k = 0; k < N; k++)
            for (int64_t i = 0; i < S; i++) {
                int64_t j = (k * C + c) * S + i;
                want[j] = (x[j] - want_m[c]) / sqrt(vb);
            }
    }
    /* f32 results of f64-accurate sums: a few roundings */
    double tol = 8 * 0x1p-24;
    tu_assert_close("offset running_mean", gm, want_m, (size_t)C, 0, tol);
    tu_assert_close("offset running_var", gv, want_v, (size_t)C, 0, tol);
    /* y = (x - m) * invstd: x - m exact, the mean's f32 rounding (1000 * 2^-24 = 6e-5, the size
       of the noise) compensated; |y| <= ~1.7 */
    tu_assert_close("offset y", gy, want, (size_t)n, 16 * 0x1p-24 * mean_abs(want, (size_t)n), 16 * 0x1p-24);
    free(x), free(gm), free(gv), free(gy), free(want);
    ampc_scope_end();
}

static void test_large_offset(void **state) {
    (void)state;
    check_offset_bn(4, (int64_t[]){4, 2, 8, 8});   /* per-channel walk */
    check_offset_bn(2, (int64_t[]){256, 3});       /* column walk */
    /* layer norm rows at 1000 + noise */
    const int64_t rows = 6, cols = 300;
    double x[6 * 300], want[6 * 300];
    tu_fill_uniform(x, rows * cols, 12, -0.01, 0.01);
    for (int64_t i = 0; i < rows * cols; i++) x[i] = tu_round_to(AMPC_F32, 1000 + x[i]);
    for (int64_t r = 0; r < rows; r++) {
        double s = 0, q = 0;
        for (int64_t i = 0; i < cols; i++) s += x[r * cols + i];
        double m = s / (double)cols;
        for (int64_t i = 0; i < cols; i++) q += (x[r * cols + i] - m) * (x[r * cols + i] - m);
        for (int64_t i = 0; i < cols; i++) want[r * cols + i] = (x[r * cols + i] - m) / sqrt(q / (double)cols);
    }
    ampc_scope_begin();
    ampc_tensor *y = ampc_layer_norm(ampc_tensor_from_f64(AMPC_F32, 2, (int64_t[]){rows, cols}, x), 1, NULL, NULL, 0.0);
    ASSERT_NOT_NULL_MSG(y);
    double *got = tu_values(y);
    tu_assert_close("offset layer norm", got, want, rows * cols, 16 * 0x1p-24 * mean_abs(want, rows * cols), 16 * 0x1p-24);
    free(got);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Autocast: batch norm passes the 16-bit activation through with f32 parameters; layer norm
// runs in f32

static void test_autocast(void **state) {
    (void)state;
    const int64_t C = 3;
    ampc_scope_begin();
    ampc_tensor *x16 = ampc_tensor_rand(AMPC_BF16, 4, (int64_t[]){2, C, 4, 4}, -1, 1);
    ampc_tensor *x32 = ampc_tensor_rand(AMPC_F32, 4, (int64_t[]){2, C, 4, 4}, -1, 1);
    ampc_tensor *w = ampc_tensor_full(AMPC_F32, 1, &C, 1.0), *b = ampc_tensor_zeros(AMPC_F32, 1, &C);
    ampc_tensor_set_requires_grad(w, true);
    ampc_tensor_set_requires_grad(b, true);
    ampc_autocast_enter(AMPC_BF16, true);
    ampc_tensor *y16 = ampc_batch_norm2d(x16, w, b, NULL, NULL, true, 0.1, 1e-5);
    ampc_tensor *y32 = ampc_batch_norm2d(x32, w, b, NULL, NULL, true, 0.1, 1e-5);
    ampc_tensor *lw = ampc_tensor_full(AMPC_F32, 1, (int64_t[]){4}, 1.0);
    ampc_tensor_set_requires_grad(lw, true);
    ampc_tensor *ln = ampc_layer_norm(x16, 1, lw, NULL, 1e-5);
    ampc_autocast_exit();
    ASSERT_NOT_NULL_MSG(y16);
    ASSERT_NOT_NULL_MSG(y32);
    ASSERT_NOT_NULL_MSG(ln);
    assert_int_equal(ampc_tensor_dtype(y16), AMPC_BF16);
    assert_int_equal(ampc_tensor_dtype(y32), AMPC_F32);
    assert_int_equal(ampc_tensor_dtype(ln), AMPC_F32);
    assert_string_equal(ampc_tensor_grad_fn_name(ln), "NativeLayerNormBackward");
    ASSERT_OK(ampc_backward(ampc_sum(ampc_mul(y16, y16), AMPC_ALL_DIMS, false)));
    assert_int_equal(ampc_tensor_dtype(ampc_tensor_grad(w)), AMPC_F32);
    /* d/db sum(y^2) = 2 sum(y) = 0 for normalised y, up to bf16 rounding of y */
    double gb[3];
    ASSERT_OK(ampc_tensor_to_f64(ampc_tensor_grad(b), gb, 3));
    for (int c = 0; c < 3; c++) assert_true(fabs(gb[c]) < 32 * 2 * 0x1p-8 * 2);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Results do not depend on the thread count: channels and row blocks are assigned by shape

/* Output, input gradients and running statistics (concatenated, as f64) of a batch norm
   followed by a layer norm, forward and backward. */
static double *norm_step(ampc_dtype dt, int nd, const int64_t *shape, size_t *n_out) {
    int64_t C = shape[1], cols = shape[nd - 1];
    ampc_scope_begin();
    ampc_manual_seed(77);
    ampc_tensor *x = ampc_tensor_rand(dt, nd, shape, -1, 3), *g = ampc_tensor_rand(dt, nd, shape, -1, 1);
    ampc_tensor *w = ampc_tensor_rand(AMPC_F32, 1, &C, 0.5, 1.5), *b = ampc_tensor_rand(AMPC_F32, 1, &C, -1, 1);
    ampc_tensor *lw = ampc_tensor_rand(dt, 1, &cols, 0.5, 1.5);
    ampc_tensor *rm = ampc_tensor_zeros(AMPC_F32, 1, &C), *rv = ampc_tensor_full(AMPC_F32, 1, &C, 1.0);
    ampc_tensor *ts[] = {x, w, b, lw};
    for (int i = 0; i < 4; i++) ampc_tensor_set_requires_grad(ts[i], true);
    ampc_tensor *z = ampc_layer_norm(ampc_batch_norm2d(x, w, b, rm, rv, true, 0.1, 1e-5), 1, lw, NULL, 1e-5);
    ASSERT_NOT_NULL_MSG(z);
    ASSERT_OK(ampc_backward_with_grad(z, g));
    ampc_tensor *outs[] = {z, ampc_tensor_grad(x), ampc_tensor_grad(w), ampc_tensor_grad(b), ampc_tensor_grad(lw), rm, rv};
    size_t total = 0;
    for (int i = 0; i < 7; i++) total += (size_t)ampc_tensor_numel(outs[i]);
    double *all = malloc(total * sizeof *all);
    size_t at = 0;
    for (int i = 0; i < 7; i++) {
        ASSERT_OK(ampc_tensor_to_f64(outs[i], all + at, total - at));
        at += (size_t)ampc_tensor_numel(outs[i]);
    }
    ampc_scope_end();
    *n_out = total;
    return all;
}

static void test_thread_count_independent(void **state) {
    (void)state;
    const int64_t big[] = {16, 4, 24, 24}, cols[] = {4096, 12};   /* per-channel walk; column walk */
    int saved = omp_get_max_threads();
    for (size_t d = 0; d < sizeof cpu_dtypes / sizeof *cpu_dtypes; d++)
        for (int si = 0; si < 2; si++) {
            size_t n1, n2;
            omp_set_num_threads(1);
            double *a = norm_step(cpu_dtypes[d], si ? 2 : 4, si ? cols : big, &n1);
            omp_set_num_threads(2);
            double *b = norm_step(cpu_dtypes[d], si ? 2 : 4, si ? cols : big, &n2);
            assert_int_equal(n1, n2);
            for (size_t i = 0; i < n1; i++)
                if (memcmp(&a[i], &b[i], sizeof a[i]))
                    fail_msg("%s shape %d: value %zu differs between 1 and 2 threads: %.17g vs %.17g",
                             ampc_dtype_name(cpu_dtypes[d]), si, i, a[i], b[i]);
            free(a), free(b);
        }
    omp_set_num_threads(saved);
}

// ---------------------------------------------------------------------------------------------
// Mixed storage dtypes (x bf16, y/gy/gx f32) take the staged path (chunks through f32
// buffers); on the same values they agree with the all-f32 register path. Both evaluate the
// same f32 formulas from coefficients rounded to f32 from f64 statistics that agree to ~2^-50,
// so they differ by at most one f32 rounding of each coefficient and of each operation.

static void test_mixed_storage(void **state) {
    (void)state;
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_CPU);
    const int64_t shapes[][4] = {{4, 3, 40, 40}, {64, 12, 1, 1}};   /* channel walk (runs > a chunk); column walk */
    const double u = 0x1p-24;
    for (int si = 0; si < 2; si++) {
        ampc_scope_begin();
        const int64_t *sh = shapes[si], C = sh[1], S = sh[2] * sh[3], N = sh[0];
        const double M = (double)(N * S);
        ampc_tensor *x16 = ampc_tensor_rand(AMPC_BF16, 4, sh, -1, 3), *x32 = ampc_cast(x16, AMPC_F32);
        ampc_tensor *g = ampc_tensor_rand(AMPC_F32, 4, sh, -1, 1);
        ampc_tensor *w = ampc_tensor_rand(AMPC_F32, 1, &C, 0.5, 1.5), *b = ampc_tensor_rand(AMPC_F32, 1, &C, -1, 1);
        ampc_tensor *y[2], *gx[2], *sm[2], *sv[2], *gw[2], *gb[2];
        for (int p = 0; p < 2; p++) {   /* p 0: all f32 (register path); 1: x bf16 (staged) */
            ampc_tensor *x = p ? x16 : x32;
            y[p] = ampc_tensor_empty(AMPC_F32, 4, sh), gx[p] = ampc_tensor_empty(AMPC_F32, 4, sh);
            sm[p] = ampc_tensor_empty(AMPC_F32, 1, &C), sv[p] = ampc_tensor_empty(AMPC_F32, 1, &C);
            gw[p] = ampc_tensor_empty(AMPC_F32, 1, &C), gb[p] = ampc_tensor_empty(AMPC_F32, 1, &C);
            ASSERT_OK(be->batch_norm(x, w, b, NULL, NULL, y[p], sm[p], sv[p], true, 0.1, 1e-5, false));
            ASSERT_OK(be->batch_norm_backward(x, g, w, sm[p], sv[p], true, false, gx[p], gw[p], gb[p]));
        }
        double *xv = tu_values(x32), *gv = tu_values(g), *wv = tu_values(w), *bv = tu_values(b);
        double *ya = tu_values(y[0]), *yb = tu_values(y[1]), *gxa = tu_values(gx[0]), *gxb = tu_values(gx[1]);
        double *m = tu_values(sm[0]), *is = tu_values(sv[0]), *gwa = tu_values(gw[0]), *gwb = tu_values(gw[1]);
        double *gba = tu_values(gb[0]), *gbb = tu_values(gb[1]);
        for (int64_t c = 0; c < C; c++) {
            double a = wv[c] * is[c], k = a, sgx = gwa[c] / is[c], sg = gba[c];
            double a2 = -k * is[c] * is[c] * sgx / M, b2 = -k * sg / M, ey = 0, eg = 0;
            for (int64_t r = 0; r < N; r++)   /* largest terms of the channel's formulas */
                for (int64_t i = 0; i < S; i++) {
                    int64_t j = (r * C + c) * S + i;
                    double xm = fabs(xv[j] - m[c]);
                    ey = fmax(ey, xm * fabs(a) + fabs(a * m[c]) + fabs(bv[c]) + fabs(ya[j]));
                    eg = fmax(eg, fabs(k * gv[j]) + fabs(a2) * (xm + fabs(m[c])) + fabs(b2) + fabs(gxa[j]));
                }
            for (int64_t r = 0; r < N; r++)
                for (int64_t i = 0; i < S; i++) {
                    int64_t j = (r * C + c) * S + i;
                    if (fabs(ya[j] - yb[j]) > 6 * u * ey) fail_msg("shape %d y[%lld]: %.9g vs %.9g", si, (long long)j, ya[j], yb[j]);
                    if (fabs(gxa[j] - gxb[j]) > 6 * u * eg)
                        fail_msg("shape %d gx[%lld]: %.9g vs %.9g", si, (long long)j, gxa[j], gxb[j]);
                }
            /* f32 roundings of f64 sums of M terms, |g (x - m)| <= 4 and |g| <= 1, in two orders
               (which differ by at most M 2^-52 times the sum of the terms) */
            double tw = 2 * u * fabs(gwa[c]) + M * M * 4 * 0x1p-52 * is[c], tb = 2 * u * fabs(gba[c]) + M * M * 0x1p-52;
            if (fabs(gwa[c] - gwb[c]) > tw || fabs(gba[c] - gbb[c]) > tb)
                fail_msg("shape %d channel %lld: gw %.9g vs %.9g, gb %.9g vs %.9g", si, (long long)c, gwa[c], gwb[c], gba[c], gbb[c]);
        }
        free(xv), free(gv), free(wv), free(bv), free(ya), free(yb), free(gxa), free(gxb), free(m), free(is);
        free(gwa), free(gwb), free(gba), free(gbb);
        ampc_scope_end();
    }
}

// ---------------------------------------------------------------------------------------------
// Errors

static void test_errors(void **state) {
    (void)state;
    ampc_scope_begin();
    const int64_t C = 3;
    ampc_tensor *x = ampc_tensor_zeros(AMPC_BF16, 4, (int64_t[]){4, C, 2, 2});
    ampc_tensor *w = ampc_tensor_full(AMPC_F32, 1, &C, 1.0), *rm = ampc_tensor_zeros(AMPC_F32, 1, &C);
    ampc_tensor *rv = ampc_tensor_full(AMPC_F32, 1, &C, 1.0);
    ampc_clear_error();
    tu_expect_error(ampc_batch_norm2d(x, ampc_tensor_full(AMPC_BF16, 1, &C, 1.0), NULL, NULL, NULL, true, 0.1, 1e-5), AMPC_ERR_DTYPE,
                 "weight is bf16");
    tu_expect_error(ampc_batch_norm2d(x, NULL, NULL, ampc_tensor_zeros(AMPC_F16, 1, &C), rv, true, 0.1, 1e-5), AMPC_ERR_DTYPE,
                 "running_mean is f16");
    tu_expect_error(ampc_batch_norm2d(x, ampc_tensor_full(AMPC_F32, 1, (int64_t[]){4}, 1.0), NULL, NULL, NULL, true, 0.1, 1e-5),
                 AMPC_ERR_SHAPE, "weight has shape (4,), expected (3,)");
    tu_expect_error(ampc_batch_norm2d(x, w, ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){1, 3}), NULL, NULL, true, 0.1, 1e-5),
                 AMPC_ERR_SHAPE, "bias has shape (1, 3)");
    tu_expect_error(ampc_batch_norm2d(x, w, NULL, NULL, NULL, false, 0.1, 1e-5), AMPC_ERR_INVALID, "evaluation mode needs");
    tu_expect_error(ampc_batch_norm2d(x, w, NULL, rm, NULL, true, 0.1, 1e-5), AMPC_ERR_INVALID, "together");
    tu_expect_error(ampc_batch_norm2d(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){1, C, 1, 1}), w, NULL, rm, rv, true, 0.1, 1e-5),
                 AMPC_ERR_INVALID, "Expected more than 1 value per channel when training");
    tu_expect_error(ampc_batch_norm2d(ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){1, C}), NULL, NULL, NULL, NULL, true, 0.1, 1e-5),
                 AMPC_ERR_INVALID, "got input size (1, 3)");
    tu_expect_error(ampc_batch_norm2d(ampc_tensor_zeros(AMPC_F32, 1, &C), NULL, NULL, NULL, NULL, true, 0.1, 1e-5), AMPC_ERR_SHAPE,
                 "(N, C, H, W)");
    tu_expect_error(ampc_batch_norm2d(ampc_tensor_from_i64(2, (int64_t[]){2, 3}, (int64_t[6]){0}), NULL, NULL, NULL, NULL, true, 0.1,
                                   1e-5),
                 AMPC_ERR_DTYPE, "i64");
    /* one value per channel is fine in evaluation */
    ASSERT_NOT_NULL_MSG(ampc_batch_norm2d(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){1, C, 1, 1}), w, NULL, rm, rv, false, 0.1, 1e-5));
    /* the REF device wants f64 parameters */
    ampc_set_default_device(AMPC_DEVICE_REF);
    ampc_tensor *xr = ampc_tensor_zeros(AMPC_F64, 4, (int64_t[]){2, C, 2, 2});
    ampc_set_default_device(AMPC_DEVICE_CPU);
    ASSERT_NOT_NULL_MSG(ampc_batch_norm2d(xr, NULL, NULL, NULL, NULL, true, 0.1, 1e-5));
    tu_expect_error(ampc_batch_norm2d(xr, w, NULL, NULL, NULL, true, 0.1, 1e-5), AMPC_ERR_INVALID, "devices");
    tu_expect_error(ampc_batch_norm2d(xr, NULL, NULL, rm, rv, true, 0.1, 1e-5), AMPC_ERR_INVALID,
                 "running_mean is on device cpu but input on ref");

    ampc_tensor *lx = ampc_tensor_zeros(AMPC_F32, 3, (int64_t[]){2, 3, 4});
    tu_expect_error(ampc_layer_norm(lx, 0, NULL, NULL, 1e-5), AMPC_ERR_SHAPE, "last 0 dims");
    tu_expect_error(ampc_layer_norm(lx, 4, NULL, NULL, 1e-5), AMPC_ERR_SHAPE, "last 4 dims");
    tu_expect_error(ampc_layer_norm(lx, 1, ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){3}), NULL, 1e-5), AMPC_ERR_SHAPE,
                 "weight has shape (3,)");
    tu_expect_error(ampc_layer_norm(lx, 2, NULL, ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){12}), 1e-5), AMPC_ERR_SHAPE,
                 "bias has shape (12,)");
    tu_expect_error(ampc_layer_norm(lx, 1, ampc_tensor_zeros(AMPC_BF16, 1, (int64_t[]){4}), NULL, 1e-5), AMPC_ERR_DTYPE, "bf16");
    tu_expect_error(ampc_layer_norm(ampc_tensor_from_i64(1, (int64_t[]){2}, (int64_t[2]){0}), 1, NULL, NULL, 1e-5), AMPC_ERR_DTYPE,
                 "i64");
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Steady state: a repeated training step makes no new system allocations

static void test_steady_state_no_malloc(void **state) {
    (void)state;
    const int64_t shapes[][4] = {{4, 8, 8, 8}, {16, 8, 2, 2}};
    for (size_t d = 0; d < sizeof cpu_dtypes / sizeof *cpu_dtypes; d++)
        for (int si = 0; si < 2; si++) {
            ampc_dtype dt = cpu_dtypes[d];
            const int64_t C = 8;
            ampc_scope_begin();
            ampc_tensor *x = ampc_tensor_rand(dt, 4, shapes[si], -1, 1);
            ampc_tensor *w = ampc_tensor_full(AMPC_F32, 1, &C, 1.0), *b = ampc_tensor_zeros(AMPC_F32, 1, &C);
            ampc_tensor *rm = ampc_tensor_zeros(AMPC_F32, 1, &C), *rv = ampc_tensor_full(AMPC_F32, 1, &C, 1.0);
            ampc_tensor *lw = ampc_tensor_full(dt, 1, (int64_t[]){shapes[si][3]}, 1.0);
            ampc_tensor_set_requires_grad(x, true);
            ampc_tensor_set_requires_grad(w, true);
            ampc_tensor_set_requires_grad(b, true);
            ampc_tensor_set_requires_grad(lw, true);
            uint64_t before = 0;
            for (int step = 0; step < 4; step++) {
                if (step == 2) before = ampc_memory_stats().n_malloc;
                ampc_scope_begin();
                ampc_tensor *y = ampc_batch_norm2d(x, w, b, rm, rv, step != 3, 0.1, 1e-5);
                ampc_tensor *z = ampc_layer_norm(y, 1, lw, NULL, 1e-5);
                ASSERT_NOT_NULL_MSG(z);
                ASSERT_OK(ampc_backward_with_grad(z, ampc_tensor_full(dt, 4, shapes[si], 0.5)));
                ampc_scope_end();
            }
            uint64_t after = ampc_memory_stats().n_malloc;
            if (after != before)
                fail_msg("%s shape %d: steps 3-4 made %llu new system allocations", ampc_dtype_name(dt), si,
                         (unsigned long long)(after - before));
            ampc_scope_end();
        }
}

/* The door refuses batch norm's bad arguments before any device's kernel sees them, the same
   on CPU and REF (statistics in f32 there, f64 here): x of one dimension, evaluation without
   running statistics, a statistic of another dtype or size, y on another device, a backward
   without its saved statistics, the fused ReLU's stats of the wrong size. */
static void test_batch_norm_door(void **state) {
    (void)state;
    const ampc_device devs[] = {AMPC_DEVICE_CPU, AMPC_DEVICE_REF};
    for (int k = 0; k < 2; k++) {
        ampc_scope_begin();
        ampc_device dev = devs[k];
        ampc_dtype dt = dev == AMPC_DEVICE_REF ? AMPC_F64 : AMPC_F32;
        const int64_t C = 3;
        ampc_tensor *x = ampc_tensor_to(ampc_tensor_rand(AMPC_F32, 4, (int64_t[]){2, 3, 2, 2}, -1, 1), dev, dt);
        ampc_tensor *y = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){2, 3, 2, 2}), dev, dt);
        ampc_tensor *x1 = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){3}), dev, dt);
        ampc_tensor *sm = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 1, &C), dev, dt);
        ampc_tensor *si = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 1, &C), dev, dt);
        ampc_tensor *s4 = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){4}), dev, dt);
        ampc_tensor *st = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){2 * C}), dev, dt);
        ampc_tensor *far = dev == AMPC_DEVICE_REF ? ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){2, 3, 2, 2})
                                                  : ampc_tensor_zeros(AMPC_BF16, 1, &C);   /* CPU: a bf16 statistic */
        ASSERT_NOT_NULL_MSG(x && y && x1 && sm && si && s4 && st && far);
        ASSERT_OK(ampc__k_batch_norm(x, NULL, NULL, NULL, NULL, y, sm, si, true, 0.1, 1e-5, false));
        assert_int_equal(ampc__k_batch_norm(x1, NULL, NULL, NULL, NULL, x1, NULL, NULL, true, 0.1, 1e-5, false), AMPC_ERR_SHAPE);
        assert_int_equal(ampc__k_batch_norm(x, NULL, NULL, NULL, NULL, y, NULL, NULL, false, 0.1, 1e-5, false), AMPC_ERR_INVALID);
        assert_non_null(strstr(ampc_last_error(), "evaluation needs running_mean and running_var"));
        assert_int_equal(ampc__k_batch_norm(x, NULL, NULL, NULL, NULL, y, s4, si, true, 0.1, 1e-5, false), AMPC_ERR_SHAPE);
        if (dev == AMPC_DEVICE_REF) {
            assert_int_equal(ampc__k_batch_norm(x, NULL, NULL, NULL, NULL, far, sm, si, true, 0.1, 1e-5, false), AMPC_ERR_INVALID);
        } else {
            assert_int_equal(ampc__k_batch_norm(x, NULL, NULL, NULL, NULL, y, far, si, true, 0.1, 1e-5, false), AMPC_ERR_DTYPE);
        }
        assert_int_equal(ampc__k_batch_norm_backward(x, y, NULL, NULL, si, true, false, y, NULL, NULL), AMPC_ERR_INVALID);
        assert_non_null(strstr(ampc_last_error(), "missing"));
        assert_int_equal(ampc__k_batch_norm_relu(x, NULL, NULL, NULL, NULL, y, st, true, 0.1, 1e-5, false), AMPC_ERR_SHAPE);
        ampc_clear_error();
        ampc_scope_end();
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_norm_door),
        cmocka_unit_test(test_batch_norm_cases),
        cmocka_unit_test(test_batch_norm_long_rows),
        cmocka_unit_test(test_layer_norm_cases),
        cmocka_unit_test(test_running_stats),
        cmocka_unit_test(test_eval_uses_running_stats),
        cmocka_unit_test(test_bf16_with_f32_stats),
        cmocka_unit_test(test_large_offset),
        cmocka_unit_test(test_autocast),
        cmocka_unit_test(test_thread_count_independent),
        cmocka_unit_test(test_mixed_storage),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_steady_state_no_malloc),
    };
    return cmocka_run_group_tests_name("norm", tests, tu_group_setup, tu_group_teardown);
}
