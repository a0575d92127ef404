/*
 * test_pool.c - max/avg/adaptive pooling and cat: gradients by finite differences on REF, every
 * CPU dtype against REF, output sizes against PyTorch's formula, values PyTorch documents,
 * tie-breaking, errors, autocast dtypes and the steady state (no new system allocations).
 */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"

static const ampc_dtype cpu_dtypes[] = {AMPC_F32, AMPC_F16, AMPC_BF16};

// ---------------------------------------------------------------------------------------------
// Op cases

typedef struct {
    ampc_pool2d_options o;
    int adaptive[2];   /* adaptive output size when > 0 */
} pool_ctx;

/* A scrambled ramp per (N, C) plane: ((h*W + w) * 37 + plane * 11) % 67, distinct within a plane
   of up to 67 elements. Inputs in [-0.2, 0.2) added to it stay ordered after rounding to any
   dtype (half-ulp at 67 is 0.25 in bf16), so max pooling has no ties: the finite differences
   see a smooth function and CPU and REF pick the same maximum. */
static ampc_tensor *with_ramp(ampc_tensor *x) {
    int64_t n = ampc_tensor_numel(x), H = ampc_tensor_dim(x, 2), W = ampc_tensor_dim(x, 3);
    double *r = malloc((size_t)n * sizeof *r);
    for (int64_t i = 0; i < n; i++) {
        int64_t plane = i / (H * W), hw = i % (H * W);
        r[i] = (double)((hw * 37 + plane * 11) % 67);
    }
    ampc_tensor *ramp = ampc_tensor_from_f64(ampc_tensor_dtype(x), 4, ampc_tensor_shape(x), r);
    free(r);
    return ampc_add(x, ramp);
}

static ampc_tensor *run_max(ampc_tensor **in, const void *ctx) {
    return ampc_max_pool2d(with_ramp(in[0]), &((const pool_ctx *)ctx)->o);
}
static ampc_tensor *run_avg(ampc_tensor **in, const void *ctx) { return ampc_avg_pool2d(in[0], &((const pool_ctx *)ctx)->o); }
static ampc_tensor *run_adaptive(ampc_tensor **in, const void *ctx) {
    const pool_ctx *c = ctx;
    return ampc_adaptive_avg_pool2d(in[0], c->adaptive[0], c->adaptive[1]);
}

typedef struct { int n, dim; } cat_ctx;
static ampc_tensor *run_cat(ampc_tensor **in, const void *ctx) {
    const cat_ctx *c = ctx;
    return ampc_cat(in, c->n, c->dim);
}

#define S(...) {__VA_ARGS__}
#define POOL(nm, f, xs, ctx_, k_, kb_)                                                             \
    {.name = nm, .n_inputs = 1, .ndim = {4}, .shape = {xs}, .lo = -0.2, .hi = 0.2, .fn = f, .ctx = ctx_, .k = k_, \
     .k_backward = kb_}

static const pool_ctx max_2x2 = {.o = {.kernel = {2, 2}}};
static const pool_ctx max_3x3_s2_p1 = {.o = {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}}};
static const pool_ctx max_3x3_s2_ceil = {.o = {.kernel = {3, 3}, .stride = {2, 2}, .ceil_mode = true}};
static const pool_ctx max_2x2_p1_ceil = {.o = {.kernel = {2, 2}, .stride = {2, 2}, .padding = {1, 1}, .ceil_mode = true}};
static const pool_ctx max_rect = {.o = {.kernel = {3, 2}, .stride = {1, 2}, .padding = {1, 0}}};
static const pool_ctx avg_incl = {.o = {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}}};
static const pool_ctx avg_excl = {.o = {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}, .exclude_pad = true}};
static const pool_ctx avg_incl_ceil = {.o = {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}, .ceil_mode = true}};
static const pool_ctx avg_excl_ceil = {.o = {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}, .ceil_mode = true, .exclude_pad = true}};
static const pool_ctx avg_2x2_ceil = {.o = {.kernel = {2, 2}, .ceil_mode = true}};
static const pool_ctx adaptive_1x1 = {.adaptive = {1, 1}};
static const pool_ctx adaptive_3x2 = {.adaptive = {3, 2}};
static const pool_ctx adaptive_tiled = {.adaptive = {3, 2}};

/* k: the longest window sum (1 for max); k_backward: how many windows can add into one input */
static const tu_op_case pool_cases[] = {
    POOL("max_2x2_s2", run_max, S(2, 3, 6, 8), &max_2x2, 1, 1),
    POOL("max_3x3_s2_p1_7x9", run_max, S(2, 2, 7, 9), &max_3x3_s2_p1, 1, 4),
    POOL("max_3x3_s2_ceil_8x8", run_max, S(1, 2, 8, 8), &max_3x3_s2_ceil, 1, 4),   /* 4x4, last window past the edge */
    POOL("max_2x2_p1_ceil_5x7", run_max, S(2, 2, 5, 7), &max_2x2_p1_ceil, 1, 1),      /* ceil mode drops a window */
    POOL("max_3x2_rect", run_max, S(1, 3, 6, 7), &max_rect, 1, 3),
    POOL("avg_incl_pad_7x9", run_avg, S(2, 2, 7, 9), &avg_incl, 9, 4),
    POOL("avg_excl_pad_7x9", run_avg, S(2, 2, 7, 9), &avg_excl, 9, 4),
    POOL("avg_incl_pad_ceil_8x6", run_avg, S(2, 2, 8, 6), &avg_incl_ceil, 9, 4),
    POOL("avg_excl_pad_ceil_8x6", run_avg, S(2, 2, 8, 6), &avg_excl_ceil, 9, 4),
    POOL("avg_2x2_ceil_5x7", run_avg, S(1, 3, 5, 7), &avg_2x2_ceil, 4, 1),
    POOL("adaptive_7x5_to_1x1", run_adaptive, S(2, 3, 7, 5), &adaptive_1x1, 35, 1),
    POOL("adaptive_7x5_to_3x2", run_adaptive, S(2, 3, 7, 5), &adaptive_3x2, 12, 4),
    POOL("adaptive_6x8_to_3x2", run_adaptive, S(2, 2, 6, 8), &adaptive_tiled, 8, 1),
};

static void test_pool_cases(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof pool_cases / sizeof *pool_cases; i++) tu_check_op(&pool_cases[i]);
}

static const cat_ctx cat2_d0 = {2, 0}, cat2_d1 = {2, 1}, cat3_d1 = {3, 1}, cat2_last = {2, -1}, cat3_last = {3, 2}, cat3_d0 = {3, 0};
#define CAT(nm, ctx_, n_, nd, s0, s1, s2)                                                          \
    {.name = nm, .n_inputs = n_, .ndim = {nd, nd, nd}, .shape = {s0, s1, s2}, .lo = -1, .hi = 1, .fn = run_cat, \
     .ctx = ctx_, .k = 1}

static const tu_op_case cat_cases[] = {
    CAT("cat2_dim0", &cat2_d0, 2, 3, S(2, 3, 4), S(3, 3, 4), S(0)),
    CAT("cat3_dim0_1d", &cat3_d0, 3, 1, S(5), S(1), S(3)),
    CAT("cat3_dim1", &cat3_d1, 3, 3, S(2, 3, 4), S(2, 1, 4), S(2, 2, 4)),
    CAT("cat2_last", &cat2_last, 2, 3, S(2, 3, 4), S(2, 3, 5), S(0)),
    CAT("cat3_last", &cat3_last, 3, 3, S(2, 3, 1), S(2, 3, 5), S(2, 3, 2)),
    CAT("cat2_dim1_4d", &cat2_d1, 2, 4, S(2, 3, 4, 2), S(2, 1, 4, 2), S(0)),
};

static void test_cat_cases(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof cat_cases / sizeof *cat_cases; i++) tu_check_op(&cat_cases[i]);
}

// ---------------------------------------------------------------------------------------------
// Output sizes: PyTorch's pooling_output_shape, written out here with float division

static int64_t torch_out_size(int64_t H, int k, int s, int p, bool ceil_mode) {
    double q = (double)(H + 2 * p - k) / s;
    int64_t o = (int64_t)(ceil_mode ? ceil(q) : floor(q)) + 1;
    if (ceil_mode && (o - 1) * s >= H + p) o--;   /* the last window starts inside input or left pad */
    return o;
}

static void test_output_sizes(void **state) {
    (void)state;
    /* documented values first: ResNet stem pool, and a ceil-mode window that is dropped */
    assert_int_equal(torch_out_size(112, 3, 2, 1, false), 56);
    assert_int_equal(torch_out_size(5, 2, 2, 1, true), 3);
    assert_int_equal(torch_out_size(8, 3, 2, 0, true), 4);
    int tried = 0, too_small = 0;
    for (int64_t H = 1; H <= 12; H++)
        for (int k = 1; k <= 4; k++)
            for (int s = 1; s <= 3; s++)
                for (int p = 0; p <= k / 2; p++)
                    for (int c = 0; c < 2; c++) {
                        int64_t want = torch_out_size(H, k, s, p, c);
                        ampc_scope_begin();
                        ampc_tensor *x = ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){1, 1, H, 3});
                        ampc_pool2d_options o = {.kernel = {k, 1}, .stride = {s, 1}, .padding = {p, 0}, .ceil_mode = c};
                        for (int max = 0; max < 2; max++) {
                            ampc_tensor *y = max ? ampc_max_pool2d(x, &o) : ampc_avg_pool2d(x, &o);
                            if (want < 1) {
                                assert_null(y);
                                assert_int_equal(ampc_last_status(), AMPC_ERR_SHAPE);
                                ampc_clear_error();
                                too_small += max;
                                continue;
                            }
                            if (!y) fail_msg("H %lld k %d s %d p %d ceil %d: %s", (long long)H, k, s, p, c, ampc_last_error());
                            if (ampc_tensor_dim(y, 2) != want)
                                fail_msg("H %lld k %d s %d p %d ceil %d: %lld rows, PyTorch %lld", (long long)H, k, s, p, c,
                                         (long long)ampc_tensor_dim(y, 2), (long long)want);
                            assert_int_equal(ampc_tensor_dim(y, 3), 3);
                            tried++;
                        }
                        ampc_scope_end();
                    }
    assert_true(tried > 500 && too_small > 0);
}

// ---------------------------------------------------------------------------------------------
// Values PyTorch gives: avg_pool2d(ones(1,1,4,4), 3, 2, 1) with and without ceil_mode, and
// count_include_pad=False; ceil mode's extra end padding is not counted.

static void check_values(const char *what, ampc_tensor *y, const double *want, int64_t n, ampc_dtype dt) {
    ASSERT_NOT_NULL_MSG(y);
    assert_int_equal(ampc_tensor_numel(y), n);
    double *got = tu_values(y);
    tu_assert_close(what, got, want, (size_t)n, 0, 2 * tu_eps(dt));
    free(got);
}

static void test_avg_pool_torch_values(void **state) {
    (void)state;
    const double floor_incl[] = {4 / 9., 6 / 9., 6 / 9., 1};
    const double ceil_incl[] = {4 / 9., 6 / 9., 2 / 6., 6 / 9., 1, 3 / 6., 2 / 6., 3 / 6., 1 / 4.};
    const double ones9[] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    for (int dev = 0; dev < 2; dev++)
        for (size_t di = 0; di < (dev ? 1 : 3); di++) {
            ampc_dtype dt = dev ? AMPC_F64 : cpu_dtypes[di];
            ampc_set_default_device(dev ? AMPC_DEVICE_REF : AMPC_DEVICE_CPU);
            ampc_scope_begin();
            ampc_tensor *x = ampc_tensor_full(dt, 4, (int64_t[]){1, 1, 4, 4}, 1.0);
            ampc_pool2d_options o = {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}};
            char what[64];
            snprintf(what, sizeof what, "%s floor include_pad", ampc_dtype_name(dt));
            check_values(what, ampc_avg_pool2d(x, &o), floor_incl, 4, dt);
            o.ceil_mode = true;
            snprintf(what, sizeof what, "%s ceil include_pad", ampc_dtype_name(dt));
            check_values(what, ampc_avg_pool2d(x, &o), ceil_incl, 9, dt);
            o.exclude_pad = true;
            snprintf(what, sizeof what, "%s ceil exclude_pad", ampc_dtype_name(dt));
            check_values(what, ampc_avg_pool2d(x, &o), ones9, 9, dt);
            ampc_scope_end();
        }
    ampc_set_default_device(AMPC_DEVICE_CPU);
}

// ---------------------------------------------------------------------------------------------
// Ties: the gradient goes to the first maximum of each window in row-major order (PyTorch's
// rule), on CPU (oneDNN) and REF alike, for every dtype

static void test_max_pool_ties(void **state) {
    (void)state;
    /* one 4x6 plane: constant 1 with a tie of 2s inside window (0, 1) and of 3s inside (1, 2) */
    double x[24];
    for (int i = 0; i < 24; i++) x[i] = 1;
    x[0 * 6 + 3] = x[1 * 6 + 2] = 2;   /* window (0,1) covers rows 0-1, cols 2-3: first 2 at (0,3) */
    x[2 * 6 + 5] = x[3 * 6 + 4] = 3;   /* window (1,2): first 3 at (2,5) */
    /* expected gradient with gy = 1 everywhere (2x2 windows, stride 2, plus padding 1 below) */
    double want[24] = {0};
    want[0 * 6 + 0] = 1;   /* window (0,0): all ones, first element */
    want[0 * 6 + 3] = 1;
    want[0 * 6 + 4] = 1;   /* window (0,2) */
    want[2 * 6 + 0] = 1;   /* window (1,0) */
    want[2 * 6 + 2] = 1;   /* window (1,1) */
    want[2 * 6 + 5] = 1;
    for (int dev = 0; dev < 2; dev++)
        for (size_t di = 0; di < (dev ? 1 : 3); di++) {
            ampc_dtype dt = dev ? AMPC_F64 : cpu_dtypes[di];
            ampc_set_default_device(dev ? AMPC_DEVICE_REF : AMPC_DEVICE_CPU);
            for (int pad = 0; pad < 2; pad++) {
                ampc_scope_begin();
                /* 32 channels of the same plane: oneDNN's vectorized kernels, not just the scalar one */
                double *xs = malloc(32 * 24 * sizeof *xs);
                for (int c = 0; c < 32; c++) memcpy(xs + c * 24, x, sizeof x);
                ampc_tensor *t = ampc_tensor_from_f64(dt, 4, (int64_t[]){1, 32, 4, 6}, xs);
                free(xs);
                ampc_tensor_set_requires_grad(t, true);
                /* padding (1, 0) with kernel (2, 2): rows shift by one, windows start at -1, 1, 3 */
                ampc_pool2d_options o = {.kernel = {2, 2}, .padding = {pad, 0}};
                ampc_tensor *y = ampc_max_pool2d(t, &o);
                ASSERT_NOT_NULL_MSG(y);
                ASSERT_OK(ampc_backward_with_grad(y, ampc_tensor_full(dt, 4, ampc_tensor_shape(y), 1.0)));
                double *g = tu_values(ampc_tensor_grad(t));
                double w[24] = {0};
                if (pad == 0) {
                    memcpy(w, want, sizeof w);
                } else {   /* windows: rows {0}, {1,2}, {3}: first maxima written out */
                    w[0] = 1, w[3] = 1, w[4] = 1;                   /* row 0: cols 0-1, 2-3 (the 2), 4-5 */
                    w[1 * 6 + 2] = 1;                               /* rows 1-2, cols 2-3: the 2 at (1,2) */
                    w[1 * 6 + 0] = 1;                               /* rows 1-2, cols 0-1: first one */
                    w[2 * 6 + 5] = 1;                               /* rows 1-2, cols 4-5: the 3 at (2,5) */
                    w[3 * 6 + 0] = 1, w[3 * 6 + 2] = 1, w[3 * 6 + 4] = 1;   /* row 3: (3,4) is the 3 */
                }
                for (int c = 0; c < 32; c++)
                    for (int i = 0; i < 24; i++)
                        if (g[c * 24 + i] != w[i])
                            fail_msg("%s/%s pad %d channel %d: gradient at (%d, %d) is %g, first-maximum rule gives %g",
                                     ampc_device_name(dev ? AMPC_DEVICE_REF : AMPC_DEVICE_CPU), ampc_dtype_name(dt), pad, c,
                                     i / 6, i % 6, g[c * 24 + i], w[i]);
                free(g);
                ampc_scope_end();
            }
        }
    ampc_set_default_device(AMPC_DEVICE_CPU);
}

/* Max pooling only selects: CPU output equals the rounded input's maximum exactly. */
static void test_max_pool_exact(void **state) {
    (void)state;
    int64_t shape[4] = {3, 5, 9, 11};
    int64_t n = 3 * 5 * 9 * 11;
    double *x = malloc((size_t)n * sizeof *x);
    tu_fill_uniform(x, (size_t)n, 42, -4, 4);
    ampc_pool2d_options o = {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}, .ceil_mode = true};
    for (size_t di = 0; di < 3; di++) {
        ampc_dtype dt = cpu_dtypes[di];
        ampc_scope_begin();
        ampc_tensor *xc = ampc_tensor_from_f64(dt, 4, shape, x);
        ampc_tensor *yc = ampc_max_pool2d(xc, &o);
        ampc_set_default_device(AMPC_DEVICE_REF);
        ampc_tensor *yr = ampc_max_pool2d(ampc_tensor_to(xc, AMPC_DEVICE_REF, AMPC_F64), &o);
        ampc_set_default_device(AMPC_DEVICE_CPU);
        ASSERT_NOT_NULL_MSG(yc);
        ASSERT_NOT_NULL_MSG(yr);
        double *a = tu_values(yc), *b = tu_values(yr);
        for (int64_t i = 0; i < ampc_tensor_numel(yr); i++)
            if (a[i] != b[i]) fail_msg("%s: output %lld is %g, REF %g", ampc_dtype_name(dt), (long long)i, a[i], b[i]);
        free(a), free(b);
        ampc_scope_end();
    }
    free(x);
}

static void test_grad_fn_names(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_rand(AMPC_F32, 4, (int64_t[]){1, 2, 4, 4}, -1, 1);
    ampc_tensor_set_requires_grad(x, true);
    ampc_pool2d_options o = {.kernel = {2, 2}};
    assert_string_equal(ampc_tensor_grad_fn_name(ampc_max_pool2d(x, &o)), "MaxPool2DWithIndicesBackward");
    assert_string_equal(ampc_tensor_grad_fn_name(ampc_avg_pool2d(x, &o)), "AvgPool2DBackward");
    assert_string_equal(ampc_tensor_grad_fn_name(ampc_adaptive_avg_pool2d(x, 1, 1)), "AdaptiveAvgPool2DBackward");
    assert_string_equal(ampc_tensor_grad_fn_name(ampc_adaptive_avg_pool2d(x, 3, 3)), "AdaptiveAvgPool2DBackward");
    assert_string_equal(ampc_tensor_grad_fn_name(ampc_cat((ampc_tensor *[]){x, x}, 2, 1)), "CatBackward");
    ampc_no_grad_enter();
    assert_null(ampc_tensor_grad_fn_name(ampc_max_pool2d(x, &o)));
    ampc_no_grad_exit();
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Errors

static void test_errors(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_clear_error();
    ampc_tensor *x = ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){2, 3, 5, 5});
    ampc_tensor *x3 = ampc_tensor_zeros(AMPC_F32, 3, (int64_t[]){3, 5, 5});
    ampc_pool2d_options k2 = {.kernel = {2, 2}};
    tu_expect_error(ampc_max_pool2d(x3, &k2), AMPC_ERR_SHAPE, "4-D (N, C, H, W) input with non-zero C, H, W, got (3, 5, 5)");
    tu_expect_error(ampc_max_pool2d(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){2, 0, 5, 5}), &k2), AMPC_ERR_SHAPE, "(2, 0, 5, 5)");
    tu_expect_error(ampc_avg_pool2d(x, &(ampc_pool2d_options){.kernel = {3, 3}, .padding = {2, 2}}), AMPC_ERR_INVALID,
                 "padding (2, 2) should be at most half of kernel size (3, 3)");
    tu_expect_error(ampc_max_pool2d(x, &(ampc_pool2d_options){.kernel = {0, 2}}), AMPC_ERR_INVALID, "must be positive");
    tu_expect_error(ampc_max_pool2d(x, &(ampc_pool2d_options){.kernel = {2, 2}, .stride = {-1, 1}}), AMPC_ERR_INVALID, "stride (-1, 1)");
    tu_expect_error(ampc_max_pool2d(x, NULL), AMPC_ERR_INVALID, "kernel size");
    tu_expect_error(ampc_max_pool2d(x, &(ampc_pool2d_options){.kernel = {6, 2}}), AMPC_ERR_SHAPE,
                 "input (2, 3, 5, 5) with kernel (6, 2), stride (6, 2), padding (0, 0) gives output size (0, 2): too small");
    tu_expect_error(ampc_max_pool2d(ampc_tensor_from_i64(4, (int64_t[]){1, 1, 2, 2}, (int64_t[4]){0}), &k2), AMPC_ERR_DTYPE, "i64");
    tu_expect_error(ampc_adaptive_avg_pool2d(x, -1, 2), AMPC_ERR_INVALID, "output size (-1, 2)");
    tu_expect_error(ampc_adaptive_avg_pool2d(x3, 1, 1), AMPC_ERR_SHAPE, "4-D");
    /* a NULL input keeps the first error of a chain */
    tu_expect_error(ampc_avg_pool2d(ampc_max_pool2d(x3, &k2), &k2), AMPC_ERR_SHAPE, "(3, 5, 5)");

    ampc_tensor *a = ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){2, 3});
    ampc_tensor *b = ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){3, 4});
    tu_expect_error(ampc_cat((ampc_tensor *[]){a, b}, 2, 0), AMPC_ERR_SHAPE,
                 "sizes must match except in dimension 0: input 0 is (2, 3), input 1 is (3, 4)");
    tu_expect_error(ampc_cat((ampc_tensor *[]){a, x}, 2, 1), AMPC_ERR_SHAPE, "input 1 is (2, 3, 5, 5)");
    tu_expect_error(ampc_cat((ampc_tensor *[]){a, a}, 2, 2), AMPC_ERR_INVALID, "dim 2 out of range");
    ampc_tensor *nine[9] = {a, a, a, a, a, a, a, a, a};
    tu_expect_error(ampc_cat(nine, 9, 0), AMPC_ERR_INVALID, "9 tensors, at most 8");
    tu_expect_error(ampc_cat(nine, 0, 0), AMPC_ERR_INVALID, "non-empty");
    tu_expect_error(ampc_cat(NULL, 2, 0), AMPC_ERR_INVALID, "non-empty");
    tu_expect_error(ampc_cat((ampc_tensor *[]){ampc_tensor_full(AMPC_F32, 0, NULL, 1), a}, 2, 0), AMPC_ERR_SHAPE, "zero-dimensional");
    tu_expect_error(ampc_cat((ampc_tensor *[]){a, ampc_tensor_from_i64(2, (int64_t[]){2, 3}, (int64_t[6]){0})}, 2, 0), AMPC_ERR_DTYPE,
                 "input 1 is i64");
    ampc_set_default_device(AMPC_DEVICE_REF);
    ampc_tensor *r = ampc_tensor_zeros(AMPC_F64, 2, (int64_t[]){2, 3});
    ampc_set_default_device(AMPC_DEVICE_CPU);
    tu_expect_error(ampc_cat((ampc_tensor *[]){a, r}, 2, 0), AMPC_ERR_INVALID, "devices");
    /* 8 inputs are fine */
    ampc_tensor *y = ampc_cat(nine, 8, 0);
    ASSERT_NOT_NULL_MSG(y);
    assert_int_equal(ampc_tensor_dim(y, 0), 16);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Dtypes: pooling keeps the input's dtype under autocast; cat promotes, and every input gets
// its gradient in its own dtype

static void test_autocast_dtypes(void **state) {
    (void)state;
    ampc_pool2d_options o = {.kernel = {2, 2}};
    const ampc_dtype lows[] = {AMPC_F16, AMPC_BF16};
    for (int l = 0; l < 2; l++) {
        ampc_scope_begin();
        ampc_tensor *x16 = ampc_tensor_rand(AMPC_BF16, 4, (int64_t[]){2, 3, 4, 4}, -1, 1);
        ampc_tensor *x32 = ampc_tensor_rand(AMPC_F32, 4, (int64_t[]){2, 3, 4, 4}, -1, 1);
        ampc_tensor_set_requires_grad(x16, true);
        ampc_autocast_enter(lows[l], true);
        ampc_tensor *y16 = ampc_max_pool2d(x16, &o), *y32 = ampc_max_pool2d(x32, &o);
        ampc_tensor *a16 = ampc_adaptive_avg_pool2d(x16, 1, 1);
        ampc_autocast_exit();
        ASSERT_NOT_NULL_MSG(y16);
        ASSERT_NOT_NULL_MSG(y32);
        ASSERT_NOT_NULL_MSG(a16);
        assert_int_equal(ampc_tensor_dtype(y16), AMPC_BF16);
        assert_int_equal(ampc_tensor_dtype(y32), AMPC_F32);
        assert_int_equal(ampc_tensor_dtype(a16), AMPC_BF16);
        ASSERT_OK(ampc_backward(ampc_sum(y16, AMPC_ALL_DIMS, false)));
        assert_int_equal(ampc_tensor_dtype(ampc_tensor_grad(x16)), AMPC_BF16);
        ampc_scope_end();
    }
    for (int autocast = 0; autocast < 2; autocast++) {
        ampc_scope_begin();
        double va[6] = {1, 2, 3, 4, 5, 6}, vb[4] = {0.5, -1, 7, 8};
        ampc_tensor *a = ampc_tensor_from_f64(AMPC_F16, 2, (int64_t[]){2, 3}, va);
        ampc_tensor *b = ampc_tensor_from_f64(AMPC_F32, 2, (int64_t[]){2, 2}, vb);
        ampc_tensor_set_requires_grad(a, true);
        ampc_tensor_set_requires_grad(b, true);
        if (autocast) ampc_autocast_enter(AMPC_BF16, true);
        ampc_tensor *y = ampc_cat((ampc_tensor *[]){a, b}, 2, 1);
        if (autocast) ampc_autocast_exit();
        ASSERT_NOT_NULL_MSG(y);
        assert_int_equal(ampc_tensor_dtype(y), AMPC_F32);
        double got[10], want[10] = {1, 2, 3, 0.5, -1, 4, 5, 6, 7, 8};
        ASSERT_OK(ampc_tensor_to_f64(y, got, 10));
        tu_assert_close("cat f16+f32", got, want, 10, 0, 0);
        double g[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
        ASSERT_OK(ampc_backward_with_grad(y, ampc_tensor_from_f64(AMPC_F32, 2, (int64_t[]){2, 5}, g)));
        assert_int_equal(ampc_tensor_dtype(ampc_tensor_grad(a)), AMPC_F16);
        assert_int_equal(ampc_tensor_dtype(ampc_tensor_grad(b)), AMPC_F32);
        double ga[6], gb[4], wa[6] = {1, 2, 3, 6, 7, 8}, wb[4] = {4, 5, 9, 10};
        ASSERT_OK(ampc_tensor_to_f64(ampc_tensor_grad(a), ga, 6));
        ASSERT_OK(ampc_tensor_to_f64(ampc_tensor_grad(b), gb, 4));
        tu_assert_close("cat grad a", ga, wa, 6, 0, 0);
        tu_assert_close("cat grad b", gb, wb, 4, 0, 0);
        ampc_scope_end();
    }
    /* f16 with bf16: both promote to f32 (PyTorch's rule) */
    ampc_scope_begin();
    ampc_tensor *h = ampc_tensor_zeros(AMPC_F16, 1, (int64_t[]){2}), *bh = ampc_tensor_zeros(AMPC_BF16, 1, (int64_t[]){3});
    ampc_tensor *y = ampc_cat((ampc_tensor *[]){h, bh}, 2, 0);
    ASSERT_NOT_NULL_MSG(y);
    assert_int_equal(ampc_tensor_dtype(y), AMPC_F32);
    /* labels concatenate as i64 */
    ampc_tensor *l = ampc_tensor_from_i64(1, (int64_t[]){2}, (int64_t[]){3, 4});
    ampc_tensor *ll = ampc_cat((ampc_tensor *[]){l, l}, 2, 0);
    ASSERT_NOT_NULL_MSG(ll);
    assert_int_equal(ampc_tensor_dtype(ll), AMPC_I64);
    assert_int_equal(ampc_tensor_numel(ll), 4);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Empty and degenerate shapes

static void test_empty(void **state) {
    (void)state;
    for (int dev = 0; dev < 2; dev++) {
        ampc_dtype dt = dev ? AMPC_F64 : AMPC_BF16;
        ampc_set_default_device(dev ? AMPC_DEVICE_REF : AMPC_DEVICE_CPU);
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_rand(dt, 4, (int64_t[]){0, 3, 4, 4}, -1, 1);
        ampc_tensor_set_requires_grad(x, true);
        ampc_tensor *y = ampc_max_pool2d(x, &(ampc_pool2d_options){.kernel = {2, 2}});
        ASSERT_NOT_NULL_MSG(y);
        assert_int_equal(ampc_tensor_numel(y), 0);
        ampc_tensor *x2 = ampc_tensor_rand(dt, 4, (int64_t[]){1, 2, 3, 3}, -1, 1);
        ampc_tensor_set_requires_grad(x2, true);
        ampc_tensor *z = ampc_adaptive_avg_pool2d(x2, 0, 2);
        ASSERT_NOT_NULL_MSG(z);
        assert_int_equal(ampc_tensor_numel(z), 0);
        ASSERT_OK(ampc_backward_with_grad(z, ampc_tensor_zeros(dt, 4, ampc_tensor_shape(z))));
        double g[18];
        ASSERT_OK(ampc_tensor_to_f64(ampc_tensor_grad(x2), g, 18));
        for (int i = 0; i < 18; i++) assert_true(g[i] == 0);
        ampc_tensor *e = ampc_tensor_zeros(dt, 2, (int64_t[]){0, 3});
        ampc_tensor *c = ampc_cat((ampc_tensor *[]){e, ampc_tensor_zeros(dt, 2, (int64_t[]){2, 3})}, 2, 0);
        ASSERT_NOT_NULL_MSG(c);
        assert_int_equal(ampc_tensor_dim(c, 0), 2);
        ampc_scope_end();
    }
    ampc_set_default_device(AMPC_DEVICE_CPU);
}

// ---------------------------------------------------------------------------------------------
// Steady state: the third identical forward + backward reuses primitives, workspaces, blocks

static void test_steady_state_no_malloc(void **state) {
    (void)state;
    for (size_t di = 0; di < 3; di++) {
        ampc_dtype dt = cpu_dtypes[di];
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_rand(dt, 4, (int64_t[]){4, 16, 15, 15}, -1, 1);
        ampc_tensor_set_requires_grad(x, true);
        uint64_t before = 0;
        for (int step = 0; step < 3; step++) {
            if (step == 2) before = ampc_memory_stats().n_malloc;
            ampc_scope_begin();
            ampc_tensor *y = ampc_max_pool2d(x, &(ampc_pool2d_options){.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}});
            ampc_tensor *z = ampc_avg_pool2d(y, &(ampc_pool2d_options){.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1},
                                                                       .ceil_mode = true});
            ampc_tensor *w = ampc_adaptive_avg_pool2d(z, 3, 2);
            ampc_tensor *v = ampc_cat((ampc_tensor *[]){w, w}, 2, 1);
            ASSERT_NOT_NULL_MSG(v);
            ASSERT_OK(ampc_backward_with_grad(v, ampc_tensor_full(dt, 4, ampc_tensor_shape(v), 0.5)));
            ampc_scope_end();
        }
        uint64_t after = ampc_memory_stats().n_malloc;
        if (after != before)
            fail_msg("%s: step 3 made %llu new system allocations", ampc_dtype_name(dt), (unsigned long long)(after - before));
        ampc_scope_end();
    }
}

// ---------------------------------------------------------------------------------------------
// copy_block: CPU against the definition, every dtype (i64 too), bounds checked

static void test_copy_block(void **state) {
    (void)state;
    const ampc_dtype dts[] = {AMPC_F32, AMPC_F16, AMPC_BF16, AMPC_I64};
    for (size_t di = 0; di < 4; di++) {
        ampc_scope_begin();
        int64_t n = 7 * 9;
        double v[63], w[80];
        int64_t iv[63];
        for (int i = 0; i < n; i++) v[i] = i - 20, iv[i] = i - 20;
        ampc_tensor *src = dts[di] == AMPC_I64 ? ampc_tensor_from_i64(1, &n, iv) : ampc_tensor_from_f64(dts[di], 1, &n, v);
        ampc_tensor *dst = ampc_tensor_zeros(dts[di], 1, (int64_t[]){80});
        ASSERT_NOT_NULL_MSG(src);
        ASSERT_NOT_NULL_MSG(dst);
        /* 5 rows of 4 from src (ld 9, offset 2) into dst (ld 11, offset 3) */
        ASSERT_OK(ampc__backend(AMPC_DEVICE_CPU)->copy_block(src, 2, 9, dst, 3, 11, 5, 4, 1.0));
        ASSERT_OK(ampc_tensor_to_f64(dst, w, 80));
        for (int i = 0; i < 80; i++) {
            int r = (i - 3) / 11, c = (i - 3) % 11;
            double want = i >= 3 && r < 5 && c < 4 ? v[r * 9 + 2 + c] : 0;
            if (w[i] != want) fail_msg("%s: dst[%d] = %g, want %g", ampc_dtype_name(dts[di]), i, w[i], want);
        }
        assert_true(ampc__k_copy_block(src, 2, 9, dst, 3, 11, 8, 4, 1.0) == AMPC_ERR_INVALID);   /* the door checks */
        ampc_clear_error();
        /* a scale: f32 only of these (16-bit and i64 refused, naming the dtype) */
        int rc = ampc__k_copy_block(src, 2, 9, dst, 3, 11, 5, 4, 0.5);
        if (dts[di] == AMPC_F32) ASSERT_OK(rc);
        else assert_int_equal(rc, AMPC_ERR_DTYPE);
        ampc_clear_error();
        ampc_scope_end();
    }
}

/* copy_block with a scale (the data-parallel buckets' gradient / world): each element
   round(x * k) in the dtype, k = 1/3 rounded to the dtype, on every device there is, against
   the same product computed here in that precision */
static void test_copy_block_scale(void **state) {
    (void)state;
    const ampc_device devs[] = {AMPC_DEVICE_CPU, AMPC_DEVICE_REF, AMPC_DEVICE_CUDA};
    for (size_t k = 0; k < 3; k++) {
        if (!ampc_device_available(devs[k])) continue;
        ampc_scope_begin();
        ampc_dtype dt = devs[k] == AMPC_DEVICE_REF ? AMPC_F64 : AMPC_F32;
        int64_t n = 1000, m = 1500;
        double v[1000], w[1500];
        for (int i = 0; i < n; i++) v[i] = (i * 7919 % 1000 - 500) * 0.123456789;
        ampc_tensor *src = ampc_tensor_to(ampc_tensor_from_f64(dt == AMPC_F64 ? AMPC_F32 : dt, 1, &n, v), devs[k], dt);
        ampc_tensor *dst = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 1, &m), devs[k], dt);
        ASSERT_NOT_NULL_MSG(src);
        ASSERT_NOT_NULL_MSG(dst);
        /* all 1000 as one row into dst at 250 (the buckets' use), then 3 rows of 10 strided */
        ASSERT_OK(ampc__k_copy_block(src, 0, n, dst, 250, m, 1, n, 1.0 / 3));
        ASSERT_OK(ampc__k_copy_block(src, 5, 100, dst, 0, 50, 3, 10, 1.0 / 3));
        ASSERT_OK(ampc_tensor_to_f64(dst, w, (size_t)m));
        for (int i = 0; i < m; i++) {
            double x = i >= 250 && i < 1250 ? v[i - 250] : i < 150 && i % 50 < 10 ? v[i / 50 * 100 + 5 + i % 50] : 0;
            double want = dt == AMPC_F32 ? (double)((float)x * (float)(1.0 / 3)) : (double)(float)x * (1.0 / 3);
            if (w[i] != want) fail_msg("%s: dst[%d] = %.17g, want %.17g", ampc_device_name(devs[k]), i, w[i], want);
        }
        ampc_scope_end();
    }
}

/* The door refuses pooling arguments before any device's kernel sees them, with the same
   status on CPU and REF: sizes or formats other than the descriptor's, tensors on two devices,
   integer tensors, a bad window, max pooling's backward without its workspace. */
static void test_pool_door(void **state) {
    (void)state;
    const ampc_device devs[] = {AMPC_DEVICE_CPU, AMPC_DEVICE_REF};
    for (int k = 0; k < 2; k++) {
        ampc_scope_begin();
        ampc_device dev = devs[k];
        ampc_dtype dt = dev == AMPC_DEVICE_REF ? AMPC_F64 : AMPC_F32;
        ampc_pool_desc d = {.kind = AMPC_POOL_MAX, .N = 1, .C = 2, .H = 4, .W = 4, .OH = 2, .OW = 2,
                            .kernel = {2, 2}, .stride = {2, 2}};
        ampc_tensor *x = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){1, 2, 4, 4}), dev, dt);
        ampc_tensor *y = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){1, 2, 2, 2}), dev, dt);
        ampc_tensor *big = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){1, 2, 3, 3}), dev, dt);
        ampc_tensor *other = ampc_tensor_zeros(dev == AMPC_DEVICE_REF ? AMPC_F32 : AMPC_BF16, 4, (int64_t[]){1, 2, 2, 2});
        ampc_tensor *ix = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){1, 2, 4, 4}), dev, AMPC_I64);
        ampc_tensor *iy = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){1, 2, 2, 2}), dev, AMPC_I64);
        ASSERT_NOT_NULL_MSG(x && y && big && other && ix && iy);
        assert_int_equal(ampc__k_pool2d(&d, big, y, NULL), AMPC_ERR_INVALID);
        assert_non_null(strstr(ampc_last_error(), "sizes do not match"));
        /* REF and CPU tensors, or f32 and bf16 */
        assert_int_equal(ampc__k_pool2d(&d, x, other, NULL), dev == AMPC_DEVICE_REF ? AMPC_ERR_INVALID : AMPC_ERR_DTYPE);
        if (dev == AMPC_DEVICE_REF) assert_non_null(strstr(ampc_last_error(), "tensors on ref and cpu"));
        assert_int_equal(ampc__k_pool2d(&d, ix, iy, NULL), AMPC_ERR_DTYPE);
        ampc_pool_desc bad = d;
        bad.stride[1] = 0;
        assert_int_equal(ampc__k_pool2d(&bad, x, y, NULL), AMPC_ERR_INVALID);
        assert_int_equal(ampc__k_pool2d_backward(&d, y, x, NULL), AMPC_ERR_INVALID);
        assert_non_null(strstr(ampc_last_error(), "without the forward's workspace"));
        ampc_clear_error();
        ampc_scope_end();
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pool_door),
        cmocka_unit_test(test_copy_block_scale),
        cmocka_unit_test(test_pool_cases),
        cmocka_unit_test(test_cat_cases),
        cmocka_unit_test(test_output_sizes),
        cmocka_unit_test(test_avg_pool_torch_values),
        cmocka_unit_test(test_max_pool_ties),
        cmocka_unit_test(test_max_pool_exact),
        cmocka_unit_test(test_grad_fn_names),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_autocast_dtypes),
        cmocka_unit_test(test_empty),
        cmocka_unit_test(test_steady_state_no_malloc),
        cmocka_unit_test(test_copy_block),
    };
    return cmocka_run_group_tests_name("pool", tests, tu_group_setup, tu_group_teardown);
}
