/*
 * test_loss.c - softmax, log_softmax, cross_entropy, mse_loss and dropout.
 *
 * Every op goes through the shared op check (finite differences on REF in f64, then CPU in
 * f32/f16/bf16 against REF). Independently of the REF kernels: cross-entropy against the
 * textbook formula in long double (label smoothing, ignore_index), softmax of [0, x] against
 * the closed form over a sweep of x, dropout's mask statistics and exact scaling, the CPU
 * dropout kernels bit for bit against a Philox4x32-10 written here from the paper (checked on
 * Random123's known answers), over every f16/bf16 bit pattern, and the error paths.
 */
#include "testutil.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"

// ---------------------------------------------------------------------------------------------
// Helpers

static ampc_tensor *f64_tensor(ampc_dtype dt, int ndim, const int64_t *shape, const double *v, bool grad) {
    ampc_tensor *t = ampc_tensor_from_f64(dt, ndim, shape, v);
    ASSERT_NOT_NULL_MSG(t);
    if (grad) ASSERT_OK(ampc_tensor_set_requires_grad(t, true));
    return t;
}

/* The float dtype a device computes in (f64 on REF). */
static ampc_dtype dev_dtype(ampc_device dev, ampc_dtype cpu_dt) { return dev == AMPC_DEVICE_REF ? AMPC_F64 : cpu_dt; }

// ---------------------------------------------------------------------------------------------
// Softmax / log-softmax through the op check

static ampc_tensor *op_softmax(ampc_tensor **in, const void *ctx) { return ampc_softmax(in[0], *(const int *)ctx); }
static ampc_tensor *op_log_softmax(ampc_tensor **in, const void *ctx) {
    return ampc_log_softmax(in[0], *(const int *)ctx);
}

static void check_softmax(const char *tag, int ndim, const int64_t *shape, int dim, bool skip_fd) {
    static const int dims[] = {-3, -2, -1, 0, 1, 2, 3};
    int d = dim < 0 ? dim + ndim : dim;
    for (int log = 0; log < 2; log++) {
        char name[96];
        snprintf(name, sizeof name, "%s_%s_dim%d", log ? "log_softmax" : "softmax", tag, dim);
        tu_op_case c = {
            .name = name, .n_inputs = 1, .ndim = {ndim}, .lo = -3, .hi = 3,
            .fn = log ? op_log_softmax : op_softmax, .ctx = &dims[dim + 3],
            .k = (double)shape[d], .skip_fd = skip_fd,
        };
        memcpy(c.shape[0], shape, sizeof(int64_t) * (size_t)ndim);
        tu_check_op(&c);
    }
}

static void test_softmax_op_check(void **state) {
    (void)state;
    const int64_t s3[] = {3, 5, 7}, s2[] = {4, 10};
    for (int dim = 0; dim < 3; dim++) check_softmax("3x5x7", 3, s3, dim, false);
    check_softmax("3x5x7", 3, s3, -1, false);
    check_softmax("4x10", 2, s2, 0, false);
    check_softmax("4x10", 2, s2, 1, false);
}

/* Larger shapes, CPU against REF only: threaded rows, several column tiles with a tail, a long
   axis that narrows the tiles. */
static void test_softmax_large(void **state) {
    (void)state;
    check_softmax("96x512", 2, (const int64_t[]){96, 512}, 1, true);
    check_softmax("8x40x130", 3, (const int64_t[]){8, 40, 130}, 1, true);
    check_softmax("2x3000x70", 3, (const int64_t[]){2, 3000, 70}, 1, true);
}

/* softmax([0, x]) = (1, e^x) / (1 + e^x) over a sweep of x, against long double: checks the
   CPU kernel's exp on its whole range, including underflow and -inf. */
static void test_softmax_exp_sweep(void **state) {
    (void)state;
    enum { N = 4096 };
    double *v = malloc(2 * N * sizeof *v);
    for (int i = 0; i < N; i++) {
        v[2 * i] = 0;
        v[2 * i + 1] = -104.0 * i / (N - 1);   /* 0 .. -104: normal, subnormal and zero results */
    }
    v[2 * (N - 1) + 1] = -INFINITY;
    v[2 * (N - 2) + 1] = 0x1p-30;
    ampc_scope_begin();
    ampc_tensor *x = f64_tensor(AMPC_F32, 2, (int64_t[]){N, 2}, v, false);
    double *y = tu_values(ampc_softmax(x, 1));
    double *ly = tu_values(ampc_log_softmax(x, 1));
    for (int i = 0; i < N; i++) {
        long double e = expl((long double)(float)v[2 * i + 1]), p1 = e / (1 + e), p0 = 1 / (1 + e);
        long double l1 = (long double)(float)v[2 * i + 1] - log1pl(e), l0 = -log1pl(e);
        /* a few roundings of 2^-24 each (exp within 1 ulp, sum, division); below FLT_MIN the
           kernel flushes exp to 0 */
        double tol1 = 8 * 0x1p-24 * (double)p1 + FLT_MIN;
        if (fabsl(y[2 * i + 1] - p1) > tol1 || fabsl(y[2 * i] - p0) > 8 * 0x1p-24)
            fail_msg("softmax([0, %g]) = (%.9g, %.9g), expected (%.9Lg, %.9Lg)", v[2 * i + 1], y[2 * i], y[2 * i + 1], p0, p1);
        if (isinf(l1) ? ly[2 * i + 1] != (double)l1
                      : fabsl(ly[2 * i + 1] - l1) > 8 * 0x1p-24 * fabsl(l1) || fabsl(ly[2 * i] - l0) > 0x1p-24 * 4)
            fail_msg("log_softmax([0, %g]) = (%.9g, %.9g), expected (%.9Lg, %.9Lg)", v[2 * i + 1], ly[2 * i], ly[2 * i + 1], l0, l1);
    }
    free(y);
    free(ly);
    free(v);
    ampc_scope_end();
}

static void test_softmax_properties(void **state) {
    (void)state;
    ampc_scope_begin();
    for (int dev = 0; dev < AMPC_DEVICE_COUNT; dev++) {
        if (!ampc_device_available((ampc_device)dev)) continue;   /* CUDA where a GPU is present */
        ampc_set_default_device((ampc_device)dev);
        ampc_dtype dt = dev_dtype((ampc_device)dev, AMPC_F32);
        /* huge logits: max subtraction keeps them finite; -inf entries get probability 0; a
           NaN poisons its own row only */
        double v[12] = {1000, 1001, 1002, -INFINITY, -1e4, 0, 1e4, 3, 1, NAN, 2, 3};
        ampc_tensor *x = f64_tensor(dt, 2, (int64_t[]){3, 4}, v, false);
        double *p = tu_values(ampc_softmax(x, -1)), *lp = tu_values(ampc_log_softmax(x, 1));
        long double s = expl(-2) + expl(-1) + 1;
        double tol = 8 * tu_eps(dt);
        assert_true(fabs(p[0] - (double)(expl(-2) / s)) <= tol && fabs(p[2] - (double)(1 / s)) <= tol);
        assert_true(p[3] == 0 && isinf(lp[3]) && lp[3] < 0);
        assert_true(fabs(lp[2] + (double)logl(s)) <= tol);
        assert_true(p[4] == 0 && fabs(p[6] - 1) <= tol && lp[6] == 0 && fabs(lp[4] + 2e4) <= 2e4 * tol);
        for (int j = 8; j < 12; j++) assert_true(isnan(p[j]) && isnan(lp[j]));
        free(p);
        free(lp);
    }
    ampc_set_default_device(AMPC_DEVICE_CPU);
    /* output dtype: the input's outside autocast; f32 under autocast (FP32 policy) */
    ampc_tensor *h = f64_tensor(AMPC_F16, 2, (int64_t[]){2, 3}, (double[]){1, 2, 3, 4, 5, 6}, true);
    ampc_tensor *y = ampc_softmax(h, 0);
    ASSERT_NOT_NULL_MSG(y);
    assert_int_equal(ampc_tensor_dtype(y), AMPC_F16);
    assert_string_equal(ampc_tensor_grad_fn_name(y), "SoftmaxBackward");
    assert_string_equal(ampc_tensor_grad_fn_name(ampc_log_softmax(h, 1)), "LogSoftmaxBackward");
    ampc_autocast_enter(AMPC_BF16, true);
    assert_int_equal(ampc_tensor_dtype(ampc_log_softmax(h, 1)), AMPC_F32);
    ampc_autocast_exit();
    tu_expect_error(ampc_softmax(h, 2), AMPC_ERR_INVALID, "dim 2");
    tu_expect_error(ampc_softmax(ampc_tensor_from_i64(1, (int64_t[]){2}, (int64_t[]){1, 2}), 0), AMPC_ERR_DTYPE, NULL);
    ampc_scope_end();
}

/* The output is saved through a view: dropping an unused graph, or running backward, leaves no
   activation memory behind (a saved output that owned its node would be a cycle and leak). */
static void test_softmax_memory(void **state) {
    (void)state;
    size_t base = ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS];
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_own(f64_tensor(AMPC_F32, 2, (int64_t[]){64, 64}, (double[4096]){0}, true));
    size_t with_x = ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS];
    ampc_softmax(x, 1);
    ampc_log_softmax(x, 0);
    ampc_scope_end();
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS], with_x);
    ampc_scope_begin();
    ampc_tensor *y = ampc_softmax(x, 1);
    ASSERT_OK(ampc_backward_with_grad(y, ampc_tensor_full(AMPC_F32, 2, (int64_t[]){64, 64}, 1.0)));
    ampc_scope_end();
    ampc_tensor_zero_grad(x);
    ampc_tensor_free(x);
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS], base);
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy through the op check

typedef struct {
    ampc_cross_entropy_options o;
    int64_t force_row, force_value;   /* force_row >= 0: targets[force_row] = force_value */
} ce_ctx;

static ampc_tensor *op_ce(ampc_tensor **in, const void *ctx) {
    const ce_ctx *c = ctx;
    ampc_tensor *targets = in[1];
    if (c->force_row >= 0) {   /* a copy with one target replaced, on the targets' device */
        int64_t n = ampc_tensor_numel(targets), *v = test_malloc((size_t)n * sizeof *v);
        double *d = test_malloc((size_t)n * sizeof *d);
        ASSERT_OK(ampc_tensor_to_f64(targets, d, (size_t)n));
        for (int64_t i = 0; i < n; i++) v[i] = (int64_t)d[i];
        v[c->force_row] = c->force_value;
        ampc_device prev = ampc_default_device();
        ampc_set_default_device(ampc_tensor_device(targets));
        targets = ampc_tensor_from_i64(1, (int64_t[]){n}, v);
        ampc_set_default_device(prev);
        test_free(v);
        test_free(d);
    }
    return ampc_cross_entropy(in[0], targets, &c->o);
}

static void check_ce(const char *name, int64_t N, int64_t C, ce_ctx ctx, bool skip_fd) {
    tu_op_case c = {
        .name = name, .n_inputs = 2, .ndim = {2, 1}, .shape = {{N, C}, {N}}, .is_label = {false, true},
        .n_classes = C, .lo = -3, .hi = 3, .fn = op_ce, .ctx = &ctx, .k = (double)(C + N), .skip_fd = skip_fd,
    };
    tu_check_op(&c);
}

static void test_cross_entropy_op_check(void **state) {
    (void)state;
    const ampc_reduction rs[] = {AMPC_REDUCTION_MEAN, AMPC_REDUCTION_SUM, AMPC_REDUCTION_NONE};
    const char *rn[] = {"mean", "sum", "none"};
    for (int r = 0; r < 3; r++) {
        char name[64];
        ce_ctx plain = {{rs[r], 0.0, -100}, -1, 0};
        snprintf(name, sizeof name, "ce_%s", rn[r]);
        check_ce(name, 6, 5, plain, false);
        ce_ctx smooth = {{rs[r], 0.1, -100}, -1, 0};
        snprintf(name, sizeof name, "ce_smooth_%s", rn[r]);
        check_ce(name, 6, 5, smooth, false);
        /* a custom ignore_index inside [0, C), forced into row 1 */
        ce_ctx ign2 = {{rs[r], 0.0, 2}, 1, 2};
        snprintf(name, sizeof name, "ce_ignore2_%s", rn[r]);
        check_ce(name, 6, 5, ign2, false);
        /* the default ignore_index -100 in row 3, with label smoothing */
        ce_ctx ign100 = {{rs[r], 0.1, -100}, 3, -100};
        snprintf(name, sizeof name, "ce_ignore100_smooth_%s", rn[r]);
        check_ce(name, 6, 5, ign100, false);
    }
    /* threaded rows and long rows, CPU against REF (SUM: a MEAN over 512 rows would push the
       gradients into f16's subnormals, where its spacing 2^-24 exceeds the relative tolerance) */
    check_ce("ce_large_rows", 512, 100, (ce_ctx){{AMPC_REDUCTION_SUM, 0.05, -100}, 7, -100}, true);
    check_ce("ce_wide", 16, 3000, (ce_ctx){{AMPC_REDUCTION_NONE, 0.0, -100}, -1, 0}, true);
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy against the textbook formula in long double

enum { GN = 5, GC = 4 };
static const double g_logits[GN * GC] = {0.5, -1.25, 2.0, 0.125, 3.0, 3.0, -2.5, 0.75, -0.375, 1.5, 0.0, -4.0,
                                         7.0, -7.0, 0.25, 1.0, 0.0, 0.0, 0.0, 0.0};
static const int64_t g_targets[GN] = {2, 0, -100, 3, 1};

/* loss_i = -(1 - eps) log p_{i,t} - eps/C sum_c log p_{i,c}; gradient of the chosen reduction
   (gy = 1) into grad */
static void golden_ce(const double *x, double eps, ampc_reduction r, long double *loss, long double *grad) {
    long double sum = 0;
    int count = 0;
    for (int i = 0; i < GN; i++) {
        long double z = 0, lp[GC];
        for (int c = 0; c < GC; c++) z += expl((long double)x[i * GC + c]);
        for (int c = 0; c < GC; c++) lp[c] = (long double)x[i * GC + c] - logl(z);
        long double li = 0;
        if (g_targets[i] != -100) {
            li = -(1 - eps) * lp[g_targets[i]];
            for (int c = 0; c < GC; c++) li -= eps / GC * lp[c];
            count++;
        }
        sum += li;
        if (r == AMPC_REDUCTION_NONE) loss[i] = li;
        for (int c = 0; c < GC; c++)
            grad[i * GC + c] = g_targets[i] == -100 ? 0 : expl(lp[c]) - eps / GC - (c == g_targets[i] ? 1 - eps : 0);
    }
    if (r == AMPC_REDUCTION_SUM) loss[0] = sum;
    if (r == AMPC_REDUCTION_MEAN) {
        loss[0] = sum / count;
        for (int k = 0; k < GN * GC; k++) grad[k] /= count;
    }
}

static void test_cross_entropy_golden(void **state) {
    (void)state;
    const ampc_dtype cpu_dts[] = {AMPC_F32, AMPC_F16, AMPC_BF16};
    for (int dev = 0; dev < AMPC_DEVICE_COUNT; dev++)
        for (int d = 0; ampc_device_available((ampc_device)dev) && d < (dev == AMPC_DEVICE_REF ? 1 : 3); d++)
            for (int r = 0; r < 3; r++)
                for (int s = 0; s < 2; s++) {
                    ampc_set_default_device((ampc_device)dev);
                    ampc_scope_begin();
                    ampc_dtype dt = dev_dtype((ampc_device)dev, cpu_dts[d]);
                    double eps_ls = s ? 0.2 : 0.0;
                    ampc_tensor *x = f64_tensor(dt, 2, (int64_t[]){GN, GC}, g_logits, true);
                    ampc_tensor *t = ampc_tensor_from_i64(1, (int64_t[]){GN}, g_targets);
                    ampc_cross_entropy_options o = ampc_cross_entropy_defaults();
                    o.reduction = (ampc_reduction)r;
                    o.label_smoothing = eps_ls;
                    ampc_tensor *l = ampc_cross_entropy(x, t, &o);
                    ASSERT_NOT_NULL_MSG(l);
                    assert_int_equal(ampc_tensor_dtype(l), dt);
                    assert_string_equal(ampc_tensor_grad_fn_name(l), "CrossEntropyBackward");
                    int64_t nl = r == AMPC_REDUCTION_NONE ? GN : 1;
                    assert_int_equal(ampc_tensor_numel(l), nl);
                    assert_int_equal(ampc_tensor_ndim(l), r == AMPC_REDUCTION_NONE ? 1 : 0);
                    /* golden on the logits as stored (rounded to dt) */
                    double *xs = tu_values(x), *got = tu_values(l);
                    long double want[GN], wgrad[GN * GC];
                    golden_ce(xs, eps_ls, (ampc_reduction)r, want, wgrad);
                    /* f32 compute over C terms then N rows, one rounding to dt */
                    double u = tu_eps(dt), tol = dt == AMPC_F64 ? (2 + GC + GN) * u * 4 : (2 + (GC + GN) * 0x1p-24 / u) * u * 2;
                    for (int i = 0; i < nl; i++)
                        if (fabsl(got[i] - want[i]) > tol * (fabsl(want[i]) + 1))
                            fail_msg("%s/%s %s ls %g: loss[%d] %.9g, expected %.9Lg", ampc_device_name((ampc_device)dev),
                                     ampc_dtype_name(dt), r == 0 ? "mean" : r == 1 ? "sum" : "none", eps_ls, i,
                                     got[i], want[i]);
                    ampc_tensor *gy = ampc_tensor_full(dt, ampc_tensor_ndim(l), ampc_tensor_shape(l), 1.0);
                    ASSERT_OK(ampc_backward_with_grad(l, gy));
                    double *g = tu_values(ampc_tensor_grad(x));
                    for (int k = 0; k < GN * GC; k++)
                        if (fabsl(g[k] - wgrad[k]) > tol * 2 * (fabsl(wgrad[k]) + 0.1))
                            fail_msg("%s/%s reduction %d ls %g: grad[%d] %.9g, expected %.9Lg",
                                     ampc_device_name((ampc_device)dev), ampc_dtype_name(dt), r, eps_ls, k, g[k], wgrad[k]);
                    free(xs);
                    free(got);
                    free(g);
                    ampc_scope_end();
                }
    ampc_set_default_device(AMPC_DEVICE_CPU);
}

static void test_cross_entropy_all_ignored(void **state) {
    (void)state;
    for (int dev = 0; dev < AMPC_DEVICE_COUNT; dev++) {
        if (!ampc_device_available((ampc_device)dev)) continue;   /* CUDA where a GPU is present */
        ampc_set_default_device((ampc_device)dev);
        ampc_scope_begin();
        ampc_dtype dt = dev_dtype((ampc_device)dev, AMPC_BF16);
        ampc_tensor *x = f64_tensor(dt, 2, (int64_t[]){3, 4}, g_logits, true);
        ampc_tensor *t = ampc_tensor_from_i64(1, (int64_t[]){3}, (int64_t[]){-100, -100, -100});
        ampc_tensor *mean = ampc_cross_entropy(x, t, NULL);
        ASSERT_NOT_NULL_MSG(mean);
        assert_true(isnan(ampc_tensor_item(mean)));   /* PyTorch: 0 / 0 */
        ASSERT_OK(ampc_backward(mean));
        double *g = tu_values(ampc_tensor_grad(x));
        for (int k = 0; k < 12; k++) assert_true(g[k] == 0);
        free(g);
        ampc_cross_entropy_options o = ampc_cross_entropy_defaults();
        o.reduction = AMPC_REDUCTION_SUM;
        assert_true(ampc_tensor_item(ampc_cross_entropy(x, t, &o)) == 0);
        ampc_scope_end();
    }
    ampc_set_default_device(AMPC_DEVICE_CPU);
}

static void test_cross_entropy_errors(void **state) {
    (void)state;
    for (int dev = 0; dev < AMPC_DEVICE_COUNT; dev++) {
        if (!ampc_device_available((ampc_device)dev)) continue;   /* CUDA where a GPU is present */
        ampc_set_default_device((ampc_device)dev);
        ampc_scope_begin();
        ampc_tensor *x = f64_tensor(dev_dtype((ampc_device)dev, AMPC_F32), 2, (int64_t[]){GN, GC}, g_logits, true);
        ampc_tensor *bad = ampc_tensor_from_i64(1, (int64_t[]){GN}, (int64_t[]){0, 1, 4, 2, 3});
        tu_expect_error(ampc_cross_entropy(x, bad, NULL), AMPC_ERR_INVALID, "target 4 in row 2");
        ampc_tensor *neg = ampc_tensor_from_i64(1, (int64_t[]){GN}, (int64_t[]){0, 1, 2, -1, 3});
        tu_expect_error(ampc_cross_entropy(x, neg, NULL), AMPC_ERR_INVALID, "target -1 in row 3");
        /* ignore_index 4 makes the first one valid */
        ampc_cross_entropy_options o = ampc_cross_entropy_defaults();
        o.ignore_index = 4;
        assert_non_null(ampc_cross_entropy(x, bad, &o));
        ampc_tensor *short_t = ampc_tensor_from_i64(1, (int64_t[]){GN - 1}, g_targets);
        tu_expect_error(ampc_cross_entropy(x, short_t, NULL), AMPC_ERR_SHAPE, "(4,)");
        ampc_tensor *x3 = ampc_reshape(x, 3, (int64_t[]){GN, 2, 2});
        tu_expect_error(ampc_cross_entropy(x3, ampc_tensor_from_i64(1, (int64_t[]){GN}, g_targets), NULL),
                     AMPC_ERR_SHAPE, "(N, C)");
        ampc_tensor *ft = f64_tensor(ampc_tensor_dtype(x), 1, (int64_t[]){GN}, (double[]){0, 1, 2, 3, 0}, false);
        tu_expect_error(ampc_cross_entropy(x, ft, NULL), AMPC_ERR_DTYPE, "i64");
        o = ampc_cross_entropy_defaults();
        o.label_smoothing = 1.5;
        tu_expect_error(ampc_cross_entropy(x, ampc_tensor_from_i64(1, (int64_t[]){GN}, (int64_t[]){0, 0, 0, 0, 0}), &o),
                     AMPC_ERR_INVALID, "label_smoothing");
        ampc_scope_end();
    }
    /* logits and targets on different devices */
    ampc_scope_begin();
    ampc_set_default_device(AMPC_DEVICE_CPU);
    ampc_tensor *x = f64_tensor(AMPC_F32, 2, (int64_t[]){GN, GC}, g_logits, false);
    ampc_set_default_device(AMPC_DEVICE_REF);
    ampc_tensor *t = ampc_tensor_from_i64(1, (int64_t[]){GN}, g_targets);
    ampc_set_default_device(AMPC_DEVICE_CPU);
    tu_expect_error(ampc_cross_entropy(x, t, NULL), AMPC_ERR_INVALID, "devices");
    ampc_scope_end();
}

static void test_cross_entropy_autocast(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *x = f64_tensor(AMPC_BF16, 2, (int64_t[]){GN, GC}, g_logits, true);
    ampc_tensor *t = ampc_tensor_from_i64(1, (int64_t[]){GN}, g_targets);
    assert_int_equal(ampc_tensor_dtype(ampc_cross_entropy(x, t, NULL)), AMPC_BF16);
    ampc_autocast_enter(AMPC_BF16, true);
    ampc_tensor *l = ampc_cross_entropy(x, t, NULL);
    ampc_autocast_exit();
    ASSERT_NOT_NULL_MSG(l);
    assert_int_equal(ampc_tensor_dtype(l), AMPC_F32);
    ASSERT_OK(ampc_backward(l));
    assert_int_equal(ampc_tensor_dtype(ampc_tensor_grad(x)), AMPC_BF16);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// MSE loss

static ampc_tensor *op_mse(ampc_tensor **in, const void *ctx) {
    return ampc_mse_loss(in[0], in[1], *(const ampc_reduction *)ctx);
}

static void test_mse_op_check(void **state) {
    (void)state;
    static const ampc_reduction rs[] = {AMPC_REDUCTION_MEAN, AMPC_REDUCTION_SUM, AMPC_REDUCTION_NONE};
    const char *rn[] = {"mean", "sum", "none"};
    for (int r = 0; r < 3; r++)
        for (int tg = 0; tg < 2; tg++) {
            char name[64];
            snprintf(name, sizeof name, "mse_%s%s", rn[r], tg ? "_target_grad" : "");
            tu_op_case c = {
                .name = name, .n_inputs = 2, .ndim = {2, 2}, .shape = {{4, 6}, {4, 6}}, .no_grad = {false, !tg},
                .lo = -2, .hi = 2, .fn = op_mse, .ctx = &rs[r], .k = rs[r] == AMPC_REDUCTION_NONE ? 1 : 24,
            };
            tu_check_op(&c);
        }
}

static void test_mse_values_and_errors(void **state) {
    (void)state;
    ampc_scope_begin();
    /* (1.5 - 0)^2 + (-2 - 1)^2 + (0.25 - 0.25)^2 = 2.25 + 9 + 0 */
    ampc_tensor *a = f64_tensor(AMPC_F16, 1, (int64_t[]){3}, (double[]){1.5, -2, 0.25}, true);
    ampc_tensor *b = f64_tensor(AMPC_F16, 1, (int64_t[]){3}, (double[]){0, 1, 0.25}, false);
    ampc_tensor *m = ampc_mse_loss(a, b, AMPC_REDUCTION_MEAN);
    ASSERT_NOT_NULL_MSG(m);
    assert_int_equal(ampc_tensor_dtype(m), AMPC_F16);
    assert_int_equal(ampc_tensor_ndim(m), 0);
    assert_string_equal(ampc_tensor_grad_fn_name(m), "MseLossBackward");
    assert_true(ampc_tensor_item(m) == ampc_f16_to_f32(ampc_f32_to_f16(11.25f / 3)));
    assert_true(ampc_tensor_item(ampc_mse_loss(a, b, AMPC_REDUCTION_SUM)) == 11.25);
    ampc_tensor *c = f64_tensor(AMPC_F16, 1, (int64_t[]){4}, (double[]){0, 1, 2, 3}, false);
    tu_expect_error(ampc_mse_loss(a, c, AMPC_REDUCTION_MEAN), AMPC_ERR_SHAPE, "(4,)");
    tu_expect_error(ampc_mse_loss(a, b, (ampc_reduction)9), AMPC_ERR_INVALID, "reduction");
    ampc_autocast_enter(AMPC_F16, true);
    assert_int_equal(ampc_tensor_dtype(ampc_mse_loss(a, b, AMPC_REDUCTION_NONE)), AMPC_F32);
    ampc_autocast_exit();
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Dropout

/* Re-seeds before each call, so the CPU and REF runs of the op check draw the same mask. */
static ampc_tensor *op_dropout(ampc_tensor **in, const void *ctx) {
    ampc_manual_seed(77);
    return ampc_dropout(in[0], *(const double *)ctx, true);
}

static void test_dropout_op_check(void **state) {
    (void)state;
    static const double ps[] = {0.25, 0.5, 1.0};
    for (int i = 0; i < 3; i++) {
        char name[64];
        snprintf(name, sizeof name, "dropout_%g", ps[i]);
        tu_op_case c = {.name = name, .n_inputs = 1, .ndim = {2}, .shape = {{37, 129}}, .lo = -2, .hi = 2,
                        .fn = op_dropout, .ctx = &ps[i], .k = 1, .skip_fd = true};
        tu_check_op(&c);
    }
    ampc_manual_seed(1234);
}

/* One dropout of n elements on a device; returns the mask (1 kept) and checks the kept values
   are x / (1 - p) rounded once to dt, and the gradient is gy * mask / (1 - p). */
static unsigned char *dropout_run(ampc_device dev, ampc_dtype dt, int64_t n, double p, uint64_t seed) {
    ampc_set_default_device(dev);
    ampc_scope_begin();
    double *v = malloc((size_t)n * sizeof *v), *gv = malloc((size_t)n * sizeof *gv);
    tu_fill_uniform(v, (size_t)n, 5, 0.5, 2);   /* nonzero: a zero output means dropped */
    tu_fill_uniform(gv, (size_t)n, 6, -1, 1);
    ampc_tensor *x = f64_tensor(dt, 1, &n, v, true);
    ampc_manual_seed(seed);
    ampc_tensor *y = ampc_dropout(x, p, true);
    ASSERT_NOT_NULL_MSG(y);
    assert_string_equal(ampc_tensor_grad_fn_name(y), "DropoutBackward");
    ampc_tensor *gy = f64_tensor(dt, 1, &n, gv, false);
    ASSERT_OK(ampc_backward_with_grad(y, gy));
    double *xs = tu_values(x), *ys = tu_values(y), *gs = tu_values(gy), *gx = tu_values(ampc_tensor_grad(x));
    unsigned char *mask = malloc((size_t)n);
    double scale = 1 / (1 - p);
    for (int64_t i = 0; i < n; i++) {
        mask[i] = ys[i] != 0;
        /* in dt: the f32 product x * f32(1/(1-p)) rounded once (f64 on REF) */
        double want = dt == AMPC_F64 ? xs[i] * scale : (double)((float)xs[i] * (float)scale);
        double wantg = dt == AMPC_F64 ? gs[i] * scale : (double)((float)gs[i] * (float)scale);
        if (dt == AMPC_F16) {
            want = ampc_f16_to_f32(ampc_f32_to_f16((float)want));
            wantg = ampc_f16_to_f32(ampc_f32_to_f16((float)wantg));
        }
        if (dt == AMPC_BF16) {
            want = ampc_bf16_to_f32(ampc_f32_to_bf16((float)want));
            wantg = ampc_bf16_to_f32(ampc_f32_to_bf16((float)wantg));
        }
        if (mask[i] ? ys[i] != want || gx[i] != wantg : gx[i] != 0)
            fail_msg("dropout %s/%s p %g element %lld: x %.9g y %.9g grad %.9g (gy %.9g)", ampc_device_name(dev),
                     ampc_dtype_name(dt), p, (long long)i, xs[i], ys[i], gx[i], gs[i]);
    }
    free(v);
    free(gv);
    free(xs);
    free(ys);
    free(gs);
    free(gx);
    ampc_scope_end();
    ampc_set_default_device(AMPC_DEVICE_CPU);
    return mask;
}

static void test_dropout_mask(void **state) {
    (void)state;
    const int64_t n = 100000;
    const double ps[] = {0.1, 0.5, 0.9};
    int threads0 = ampc_get_num_threads();
    for (int k = 0; k < 3; k++) {
        double p = ps[k];
        unsigned char *ref = dropout_run(AMPC_DEVICE_REF, AMPC_F64, n, p, 42);
        int64_t dropped = 0;
        for (int64_t i = 0; i < n; i++) dropped += !ref[i];
        double sigma = sqrt((double)n * p * (1 - p));
        if (fabs((double)dropped - (double)n * p) > 5 * sigma)
            fail_msg("p %g: %lld of %lld dropped (expected %.0f +- %.0f)", p, (long long)dropped, (long long)n, n * p, 5 * sigma);
        /* same seed, same mask, on every CPU dtype and whatever the thread count */
        const ampc_dtype dts[] = {AMPC_F32, AMPC_F16, AMPC_BF16};
        for (int d = 0; d < 3; d++)
            for (int threads = 1; threads <= 2; threads++) {
                ampc_set_num_threads(threads);
                unsigned char *m = dropout_run(AMPC_DEVICE_CPU, dts[d], n, p, 42);
                if (memcmp(m, ref, (size_t)n)) fail_msg("p %g: CPU %s mask with %d threads differs from REF", p, ampc_dtype_name(dts[d]), threads);
                free(m);
            }
        /* another seed, another mask */
        unsigned char *other = dropout_run(AMPC_DEVICE_CPU, AMPC_F32, n, p, 43);
        assert_true(memcmp(other, ref, (size_t)n) != 0);
        free(other);
        free(ref);
    }
    ampc_set_num_threads(threads0);
    ampc_manual_seed(1234);
}

// ---------------------------------------------------------------------------------------------
// CPU dropout kernels, bit for bit against an independent reference: the mask from a
// Philox4x32-10 written from Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"
// (SC'11), and y = round(x * f32(keep ? 1/(1-p) : 0)) in f32, rounded once by dtype.c's scalars.

/* Philox4x32-10 of a 4-word counter under a 2-word key, as Random123's philox4x32_R(10, ...). */
static void kat_philox(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3], k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        if (r) {   /* Weyl key schedule between rounds */
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n1 = (uint32_t)p1;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1, n3 = (uint32_t)p0;
        c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

static void test_dropout_reference_philox(void **state) {
    (void)state;
    /* Random123's kat_vectors for philox4x32 10: counter, key, expected output */
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u},
        {~0u, ~0u, ~0u, ~0u, ~0u, ~0u, 0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu},
        {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u, 0xd16cfe09u, 0x94fdccebu,
         0x5001e420u, 0x24126ea1u},
    };
    for (int k = 0; k < 3; k++) {
        uint32_t out[4];
        kat_philox(kat[k], kat[k] + 4, out);
        for (int l = 0; l < 4; l++)
            if (out[l] != kat[k][6 + l]) fail_msg("known answer %d word %d: %08x, not %08x", k, l, out[l], kat[k][6 + l]);
    }
}

/* Whether dropout with rng state st keeps element i: draw i is word i % 4 of block
   st.offset + i / 4 (counter {lo, hi, 0, 0}, key {seed lo, seed hi}), kept iff its uniform
   (r >> 8) * 2^-24 is not below p. */
static bool ref_keep(ampc_rng_state st, uint64_t i, double p) {
    uint64_t blk = st.offset + i / 4;
    uint32_t ctr[4] = {(uint32_t)blk, (uint32_t)(blk >> 32), 0, 0}, key[2] = {(uint32_t)st.seed, (uint32_t)(st.seed >> 32)};
    uint32_t out[4];
    kat_philox(ctr, key, out);
    return !((double)(out[i % 4] >> 8) * 0x1p-24 < p);
}

/* Element i of f32/f16/bf16 storage as f32, and f32 -> storage bits (one rounding). */
static float ref_load(ampc_dtype dt, const void *p, size_t i) {
    if (dt == AMPC_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return dt == AMPC_F16 ? ampc_f16_to_f32(h) : ampc_bf16_to_f32(h);
}
static uint32_t ref_bits(ampc_dtype dt, float v) {
    if (dt == AMPC_F16) return ampc_f32_to_f16(v);
    if (dt == AMPC_BF16) return ampc_f32_to_bf16(v);
    uint32_t b;
    memcpy(&b, &v, 4);
    return b;
}
static uint32_t raw_bits(ampc_dtype dt, const void *p, size_t i) {
    if (dt != AMPC_F32) return ((const uint16_t *)p)[i];
    uint32_t b;
    memcpy(&b, (const char *)p + 4 * i, 4);
    return b;
}

/* The CPU kernels on n elements given as raw bits of dt (xb for the forward, gb for the
   backward), with 1 and 2 threads: mask, y and gx bit for bit against the reference. */
static void check_dropout_bits(ampc_dtype dt, const void *xb, const void *gb, size_t n, double p, ampc_rng_state st) {
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_CPU);
    int64_t len = (int64_t)n;
    size_t es = dt == AMPC_F32 ? 4 : 2;
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_empty(dt, 1, &len), *y = ampc_tensor_empty(dt, 1, &len);
    ampc_tensor *gy = ampc_tensor_empty(dt, 1, &len), *gx = ampc_tensor_empty(dt, 1, &len);
    memcpy(ampc_tensor_data(x), xb, n * es);
    memcpy(ampc_tensor_data(gy), gb, n * es);
    uint8_t *mask = malloc(n), *want = malloc(n);
    for (size_t i = 0; i < n; i++) want[i] = ref_keep(st, i, p);
    float scale = (float)(p < 1 ? 1 / (1 - p) : 0);
    int threads0 = ampc_get_num_threads();
    for (int threads = 1; threads <= 2; threads++) {
        ampc_set_num_threads(threads);
        memset(mask, 0xAA, n);   /* a byte the kernel leaves unwritten fails */
        ASSERT_OK(be->dropout(x, y, mask, p, st));
        ASSERT_OK(be->dropout_backward(gy, mask, p, gx));
        for (size_t i = 0; i < n; i++) {
            float s = want[i] ? scale : 0.0f;
            uint32_t wy = ref_bits(dt, ref_load(dt, xb, i) * s), wg = ref_bits(dt, ref_load(dt, gb, i) * s);
            uint32_t yb = raw_bits(dt, ampc_tensor_cdata(y), i), gxb = raw_bits(dt, ampc_tensor_cdata(gx), i);
            if (mask[i] != want[i] || yb != wy || gxb != wg)
                fail_msg("dropout %s p %g, %d threads, element %zu of %zu: mask %d (want %d), x %#x -> y %#x (want %#x), "
                         "gy %#x -> gx %#x (want %#x)", ampc_dtype_name(dt), p, threads, i, n, mask[i], want[i],
                         raw_bits(dt, xb, i), yb, wy, raw_bits(dt, gb, i), gxb, wg);
        }
    }
    ampc_set_num_threads(threads0);
    free(mask);
    free(want);
    ampc_scope_end();
}

/* p: 2^-24 keeps all but a draw of 0 (scale f32(1/(1-2^-24)) = 1 + 2^-23 rounds), 0.1 an
   inexact scale, 0.5 doubles (overflow to inf), 1 drops all (x * 0: NaN for inf). */
static const double bit_ps[] = {0x1p-24, 0.1, 0.5, 0.75, 1.0};

static void test_dropout_bits_16bit_exhaustive(void **state) {
    (void)state;
    /* every f16/bf16 pattern as x, and again in another order as gy; an offset whose blocks
       cross 2^32 (counter word 1) and a seed with both key words set */
    enum { N = 65536 };
    uint16_t *xb = malloc(N * sizeof *xb), *gb = malloc(N * sizeof *gb);
    for (uint32_t i = 0; i < N; i++) {
        xb[i] = (uint16_t)i;
        gb[i] = (uint16_t)(i * 40503u);   /* odd multiplier: a permutation */
    }
    const ampc_dtype dts[] = {AMPC_BF16, AMPC_F16};
    for (int d = 0; d < 2; d++)
        for (size_t k = 0; k < sizeof bit_ps / sizeof *bit_ps; k++)
            check_dropout_bits(dts[d], xb, gb, N, bit_ps[k], (ampc_rng_state){0x0123456789abcdefull + k, 0xffffffffull - 1000});
    free(xb);
    free(gb);
}

static void test_dropout_bits_f32(void **state) {
    (void)state;
    /* specials, then random bit patterns (every exponent); an odd length ends in a partial block */
    const size_t n = 100003;
    static const uint32_t special[] = {0, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u,
                                       0x00000001u, 0x807fffffu, 0x00800000u, 0x7f7fffffu, 0xff7fffffu, 0x3f800000u};
    const size_t ns = sizeof special / sizeof *special;
    uint32_t *xb = malloc(n * 4), *gb = malloc(n * 4);
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;   /* xorshift64 */
        xb[i] = i < ns ? special[i] : (uint32_t)s;
        gb[i] = i < ns ? special[ns - 1 - i] : (uint32_t)(s >> 32);
    }
    for (size_t k = 0; k < sizeof bit_ps / sizeof *bit_ps; k++)
        check_dropout_bits(AMPC_F32, xb, gb, n, bit_ps[k], (ampc_rng_state){77 + k, 12345});
    free(xb);
    free(gb);
}

static void test_dropout_modes_and_errors(void **state) {
    (void)state;
    ampc_scope_begin();
    double v[6] = {1, -2, 3, -4, 5, INFINITY};
    ampc_tensor *x = f64_tensor(AMPC_F32, 1, (int64_t[]){6}, v, true);
    /* eval mode and p == 0: the input itself (an alias), gradient passes unchanged */
    for (int k = 0; k < 2; k++) {
        ampc_tensor *y = k ? ampc_dropout(x, 0.5, false) : ampc_dropout(x, 0.0, true);
        ASSERT_NOT_NULL_MSG(y);
        assert_ptr_equal(ampc_tensor_cdata(y), ampc_tensor_cdata(x));
        ASSERT_OK(ampc_backward_with_grad(y, f64_tensor(AMPC_F32, 1, (int64_t[]){6}, (double[]){1, 2, 3, 4, 5, 6}, false)));
        double *g = tu_values(ampc_tensor_grad(x));
        for (int i = 0; i < 6; i++) assert_true(g[i] == i + 1);
        free(g);
        ampc_tensor_zero_grad(x);
    }
    /* p == 1: all zeros (an inf input gives NaN, as x * 0 does in PyTorch) */
    double *z = tu_values(ampc_dropout(x, 1.0, true));
    for (int i = 0; i < 5; i++) assert_true(z[i] == 0);
    assert_true(isnan(z[5]));
    free(z);
    tu_expect_error(ampc_dropout(x, -0.1, true), AMPC_ERR_INVALID, "between 0 and 1");
    tu_expect_error(ampc_dropout(x, 1.5, true), AMPC_ERR_INVALID, NULL);
    tu_expect_error(ampc_dropout(x, NAN, true), AMPC_ERR_INVALID, NULL);
    ampc_scope_end();
    /* the mask is freed after backward, and with a graph that never ran backward */
    size_t base = ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS];
    ampc_scope_begin();
    ampc_tensor *w = ampc_tensor_own(f64_tensor(AMPC_F32, 1, (int64_t[]){6}, v, true));
    size_t with_w = ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS];
    ampc_dropout(w, 0.5, true);
    ampc_scope_end();
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS], with_w);
    ampc_tensor_free(w);
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS], base);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_softmax_op_check),
        cmocka_unit_test(test_softmax_large),
        cmocka_unit_test(test_softmax_exp_sweep),
        cmocka_unit_test(test_softmax_properties),
        cmocka_unit_test(test_softmax_memory),
        cmocka_unit_test(test_cross_entropy_op_check),
        cmocka_unit_test(test_cross_entropy_golden),
        cmocka_unit_test(test_cross_entropy_all_ignored),
        cmocka_unit_test(test_cross_entropy_errors),
        cmocka_unit_test(test_cross_entropy_autocast),
        cmocka_unit_test(test_mse_op_check),
        cmocka_unit_test(test_mse_values_and_errors),
        cmocka_unit_test(test_dropout_op_check),
        cmocka_unit_test(test_dropout_mask),
        cmocka_unit_test(test_dropout_reference_philox),
        cmocka_unit_test(test_dropout_bits_16bit_exhaustive),
        cmocka_unit_test(test_dropout_bits_f32),
        cmocka_unit_test(test_dropout_modes_and_errors),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
