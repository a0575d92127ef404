/*
 * test_conv.c - conv2d: gradients by finite differences on REF and every CPU dtype against REF
 * (padding, stride, dilation, groups, depthwise, non-square kernels, with and without bias),
 * output sizes against PyTorch's formula, errors, autocast, f32 weight gradients of 16-bit
 * inputs (unrounded, on one thread and split over the batch), the steady state of the primitive
 * and reorder caches (no new system allocations), a ResNet-sized layer, and which oneDNN
 * kernels run.
 */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu.h"
#include "backend/cpu/dnnl_cache.h"

static const ampc_dtype cpu_dtypes[] = {AMPC_F32, AMPC_F16, AMPC_BF16};

// ---------------------------------------------------------------------------------------------
// Op cases

typedef struct {
    ampc_conv2d_options o;
    bool bias;
} conv_ctx;

static ampc_tensor *run_conv(ampc_tensor **in, const void *ctx) {
    const conv_ctx *c = ctx;
    return ampc_conv2d(in[0], in[1], c->bias ? in[2] : NULL, &c->o);
}

/* PyTorch's output size. */
static int64_t torch_out(int64_t in, int64_t k, int s, int p, int d) {
    return (int64_t)floor((double)(in + 2 * p - d * (k - 1) - 1) / s) + 1;
}

/* The case for x (N, C, H, W), w (O, C/g, kh, kw), b (O). k: the forward dot length
   C/g*kh*kw (+1 with bias); k_backward: the longest backward sum: N*OH*OW for the weight and
   bias gradients, O/g*kh*kw for the data gradient. */
static tu_op_case conv_case(const char *name, int64_t N, int64_t C, int64_t H, int64_t W, int64_t O, int64_t kh, int64_t kw,
                            const conv_ctx *ctx) {
    const ampc_conv2d_options *o = &ctx->o;
    int s[2] = {o->stride[0] ? o->stride[0] : 1, o->stride[1] ? o->stride[1] : 1};
    int d[2] = {o->dilation[0] ? o->dilation[0] : 1, o->dilation[1] ? o->dilation[1] : 1};
    int64_t g = o->groups ? o->groups : 1;
    int64_t OH = torch_out(H, kh, s[0], o->padding[0], d[0]), OW = torch_out(W, kw, s[1], o->padding[1], d[1]);
    double kf = (double)(C / g * kh * kw) + (ctx->bias ? 1 : 0);
    double kb1 = (double)(N * OH * OW), kb2 = (double)(O / g * kh * kw);
    tu_op_case c = {.name = name, .n_inputs = ctx->bias ? 3 : 2, .ndim = {4, 4, 1},
                    .shape = {{N, C, H, W}, {O, C / g, kh, kw}, {O}}, .lo = -1, .hi = 1, .fn = run_conv, .ctx = ctx,
                    .k = kf, .k_backward = kb1 > kb2 ? kb1 : kb2};
    return c;
}

#define OPT(...) ((ampc_conv2d_options){__VA_ARGS__})

static const conv_ctx c_3x3_pad1 = {OPT(.padding = {1, 1}), true};
static const conv_ctx c_stride2 = {OPT(.stride = {2, 2}, .padding = {1, 1}), false};
static const conv_ctx c_1x1 = {OPT(.groups = 0), true};
static const conv_ctx c_1x1_s2 = {OPT(.stride = {2, 2}), false};
static const conv_ctx c_pad0 = {OPT(.groups = 0), true};
static const conv_ctx c_dil2 = {OPT(.padding = {2, 2}, .dilation = {2, 2}), true};
static const conv_ctx c_dil_nopad = {OPT(.dilation = {2, 3}), false};
static const conv_ctx c_groups2 = {OPT(.padding = {1, 1}, .groups = 2), true};
static const conv_ctx c_groups2_nb = {OPT(.stride = {2, 1}, .groups = 2), false};
static const conv_ctx c_depthwise = {OPT(.padding = {1, 1}, .groups = 4), false};
static const conv_ctx c_depthwise_mult = {OPT(.stride = {2, 2}, .padding = {1, 1}, .groups = 3), true};
static const conv_ctx c_3x1 = {OPT(.padding = {1, 0}), true};
static const conv_ctx c_1x3 = {OPT(.stride = {1, 2}, .padding = {0, 1}, .dilation = {1, 2}), false};
static const conv_ctx c_stride3 = {OPT(.stride = {3, 3}), true};
static const conv_ctx c_asym = {OPT(.stride = {2, 1}, .padding = {0, 2}, .dilation = {1, 2}), true};

static void test_conv_cases(void **state) {
    (void)state;
    const tu_op_case cases[] = {
        conv_case("conv_3x3_pad1", 2, 3, 5, 5, 4, 3, 3, &c_3x3_pad1),
        conv_case("conv_3x3_pad1_n1", 1, 4, 6, 6, 3, 3, 3, &c_3x3_pad1),
        conv_case("conv_stride2_7x9", 1, 2, 7, 9, 3, 3, 3, &c_stride2),
        conv_case("conv_stride2_n3", 3, 3, 6, 5, 2, 3, 3, &c_stride2),
        conv_case("conv_1x1", 3, 4, 4, 4, 5, 1, 1, &c_1x1),
        conv_case("conv_1x1_stride2", 2, 4, 6, 6, 3, 1, 1, &c_1x1_s2),
        conv_case("conv_pad0", 2, 3, 6, 6, 2, 3, 3, &c_pad0),
        conv_case("conv_dilation2", 1, 2, 9, 8, 3, 3, 3, &c_dil2),
        conv_case("conv_dilation_2x3", 2, 2, 7, 9, 2, 2, 3, &c_dil_nopad),
        conv_case("conv_groups2", 2, 4, 5, 5, 6, 3, 3, &c_groups2),
        conv_case("conv_groups2_nobias", 1, 6, 6, 5, 4, 2, 2, &c_groups2_nb),
        conv_case("conv_depthwise", 2, 4, 6, 6, 4, 3, 3, &c_depthwise),
        conv_case("conv_depthwise_x2", 1, 3, 7, 7, 6, 3, 3, &c_depthwise_mult),
        conv_case("conv_3x1", 2, 3, 6, 5, 4, 3, 1, &c_3x1),
        conv_case("conv_1x3", 3, 2, 4, 9, 3, 1, 3, &c_1x3),
        conv_case("conv_stride3_dropped", 1, 3, 8, 8, 2, 3, 3, &c_stride3),   /* floor drops 2 rows */
        conv_case("conv_asymmetric", 2, 3, 7, 6, 4, 2, 3, &c_asym),
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) tu_check_op(&cases[i]);
}

/* Only some inputs need gradients: the others are not computed (and not required). */
static void test_partial_grads(void **state) {
    (void)state;
    tu_op_case frozen_w = conv_case("conv_frozen_weight", 2, 3, 5, 5, 4, 3, 3, &c_3x3_pad1);
    frozen_w.no_grad[1] = true;
    tu_check_op(&frozen_w);
    tu_op_case bias_only = conv_case("conv_bias_only", 2, 3, 5, 5, 4, 3, 3, &c_3x3_pad1);
    bias_only.no_grad[0] = bias_only.no_grad[1] = true;
    tu_check_op(&bias_only);
    tu_op_case weight_only = conv_case("conv_weight_only", 2, 4, 5, 5, 4, 3, 3, &c_groups2);
    weight_only.no_grad[0] = weight_only.no_grad[2] = true;
    tu_check_op(&weight_only);

    /* x needs grad, w does not: w gets no gradient, x does */
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_rand(AMPC_F32, 4, (int64_t[]){1, 2, 4, 4}, -1, 1);
    ampc_tensor *w = ampc_tensor_rand(AMPC_F32, 4, (int64_t[]){3, 2, 3, 3}, -1, 1);
    ampc_tensor_set_requires_grad(x, true);
    ampc_tensor *y = ampc_conv2d(x, w, NULL, NULL);
    ASSERT_NOT_NULL_MSG(y);
    assert_string_equal(ampc_tensor_grad_fn_name(y), "ConvolutionBackward");
    ASSERT_OK(ampc_backward(ampc_sum(y, AMPC_ALL_DIMS, false)));
    assert_non_null(ampc_tensor_grad(x));
    assert_null(ampc_tensor_grad(w));
    /* nothing requires grad: no node */
    assert_null(ampc_tensor_grad_fn_name(ampc_conv2d(w, w, NULL, &OPT(.padding = {1, 1}))));
    ampc_scope_end();
}

/* A ResNet-18 small-stem layer shape (batch 8, 16x16) against REF, no finite differences. */
static void test_conv_large(void **state) {
    (void)state;
    tu_op_case c = conv_case("conv_resnet_8x64x16x16", 8, 64, 16, 16, 64, 3, 3, &c_3x3_pad1);
    c.skip_fd = true;
    c.skip_dtypes = 1u << AMPC_F16;
    tu_check_op(&c);
}

// ---------------------------------------------------------------------------------------------
// Output sizes: PyTorch's formula for a table of geometries, and the values there (CPU f32 and
// bf16 against REF), where the last window's right padding is what oneDNN is told

static void test_output_shapes(void **state) {
    (void)state;
    /* H, W, kh, kw, stride h/w, padding h/w, dilation h/w */
    const int cases[][10] = {
        {5, 5, 3, 3, 1, 1, 1, 1, 1, 1}, {7, 9, 3, 3, 2, 2, 1, 1, 1, 1}, {8, 8, 3, 3, 2, 2, 1, 1, 1, 1},
        {8, 8, 1, 1, 2, 2, 0, 0, 1, 1}, {9, 9, 1, 1, 2, 2, 0, 0, 1, 1}, {8, 7, 3, 3, 3, 3, 0, 0, 1, 1},
        {10, 10, 3, 3, 4, 3, 1, 2, 1, 1}, {9, 11, 3, 3, 1, 2, 2, 2, 2, 2}, {7, 7, 7, 7, 1, 1, 0, 0, 1, 1},
        {3, 3, 5, 5, 1, 1, 1, 1, 1, 1}, {1, 1, 3, 3, 1, 1, 1, 1, 1, 1}, {6, 9, 2, 4, 5, 2, 1, 3, 2, 1},
        {12, 5, 5, 1, 3, 1, 2, 0, 1, 1}, {5, 12, 1, 5, 1, 4, 0, 3, 1, 2}, {4, 4, 3, 3, 2, 2, 3, 3, 1, 1},
    };
    char what[128];
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        const int *c = cases[ci];
        ampc_conv2d_options o = {.stride = {c[4], c[5]}, .padding = {c[6], c[7]}, .dilation = {c[8], c[9]}};
        int64_t OH = torch_out(c[0], c[2], c[4], c[6], c[8]), OW = torch_out(c[1], c[3], c[5], c[7], c[9]);
        int64_t xs[4] = {2, 3, c[0], c[1]}, ws[4] = {4, 3, c[2], c[3]};
        int64_t nx = 2 * 3 * c[0] * c[1], nw = 4 * 3 * c[2] * c[3];
        double *X = malloc((size_t)nx * sizeof *X), *Wt = malloc((size_t)nw * sizeof *Wt), *ref = NULL;
        tu_fill_uniform(X, (size_t)nx, ci + 1, -1, 1);
        tu_fill_uniform(Wt, (size_t)nw, ci + 100, -1, 1);
        /* bf16 values: exact in every dtype, so all devices convolve the same numbers */
        for (int64_t i = 0; i < nx; i++) X[i] = ampc_bf16_to_f32(ampc_f32_to_bf16((float)X[i]));
        for (int64_t i = 0; i < nw; i++) Wt[i] = ampc_bf16_to_f32(ampc_f32_to_bf16((float)Wt[i]));
        for (int dev = 0; dev < 3; dev++) {   /* REF, CPU f32, CPU bf16 */
            ampc_dtype dt = dev == 0 ? AMPC_F64 : dev == 1 ? AMPC_F32 : AMPC_BF16;
            ampc_set_default_device(dev == 0 ? AMPC_DEVICE_REF : AMPC_DEVICE_CPU);
            ampc_scope_begin();
            ampc_tensor *x = ampc_tensor_from_f64(dt, 4, xs, X), *w = ampc_tensor_from_f64(dt, 4, ws, Wt);
            ampc_tensor *y = ampc_conv2d(x, w, NULL, &o);
            snprintf(what, sizeof what, "case %zu (%dx%d k %dx%d s %d,%d p %d,%d d %d,%d) %s", ci, c[0], c[1], c[2], c[3], c[4],
                     c[5], c[6], c[7], c[8], c[9], ampc_dtype_name(dt));
            if (OH < 1 || OW < 1) {   /* PyTorch: "Kernel size can't be greater than actual input size" */
                if (y) fail_msg("%s: expected an error, got a result", what);
                assert_int_equal(ampc_last_status(), AMPC_ERR_SHAPE);
                ampc_clear_error();
                ampc_scope_end();
                continue;
            }
            if (!y) fail_msg("%s: %s", what, ampc_last_error());
            assert_int_equal(ampc_tensor_ndim(y), 4);
            if (ampc_tensor_dim(y, 0) != 2 || ampc_tensor_dim(y, 1) != 4 || ampc_tensor_dim(y, 2) != OH || ampc_tensor_dim(y, 3) != OW)
                fail_msg("%s: output (%lld, %lld, %lld, %lld), PyTorch's (2, 4, %lld, %lld)", what, (long long)ampc_tensor_dim(y, 0),
                         (long long)ampc_tensor_dim(y, 1), (long long)ampc_tensor_dim(y, 2), (long long)ampc_tensor_dim(y, 3),
                         (long long)OH, (long long)OW);
            double *v = tu_values(y);
            if (dev == 0) {
                ref = v;
            } else {   /* k-term f32 accumulation (|terms| < 1), then one rounding to dt */
                double k = 3.0 * c[2] * c[3];
                tu_assert_close(what, v, ref, (size_t)(8 * OH * OW), 2 * k * k * 0x1p-24, 2 * tu_eps(dt));
                free(v);
            }
            ampc_scope_end();
        }
        ampc_set_default_device(AMPC_DEVICE_CPU);
        free(ref), free(X), free(Wt);
    }
}

// ---------------------------------------------------------------------------------------------
// Errors

static void test_errors(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){2, 4, 5, 5});
    ampc_tensor *w = ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){6, 4, 3, 3});
    ampc_clear_error();
    tu_expect_error(ampc_conv2d(ampc_tensor_zeros(AMPC_F32, 3, (int64_t[]){4, 5, 5}), w, NULL, NULL), AMPC_ERR_SHAPE,
                 "input must be 4-D (N, C, H, W), got (4, 5, 5)");
    tu_expect_error(ampc_conv2d(x, ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){6, 36}), NULL, NULL), AMPC_ERR_SHAPE,
                 "weight must be 4-D");
    tu_expect_error(ampc_conv2d(x, ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){6, 3, 3, 3}), NULL, NULL), AMPC_ERR_SHAPE,
                 "weight (6, 3, 3, 3) expects 3 input channels per group but input (2, 4, 5, 5) has 4");
    tu_expect_error(ampc_conv2d(x, ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){6, 1, 3, 3}), NULL, &OPT(.groups = 3)),
                 AMPC_ERR_SHAPE, "4 channels, not divisible by groups 3");
    tu_expect_error(ampc_conv2d(x, ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){5, 2, 3, 3}), NULL, &OPT(.groups = 2)),
                 AMPC_ERR_SHAPE, "5 output channels, not divisible by groups 2");
    tu_expect_error(ampc_conv2d(x, w, ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){5}), NULL), AMPC_ERR_SHAPE,
                 "bias (5,) does not match weight (6, 4, 3, 3)");
    tu_expect_error(ampc_conv2d(x, ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){6, 4, 7, 3}), NULL, NULL), AMPC_ERR_SHAPE,
                 "kernel (6, 4, 7, 3) (dilated extent 7) is larger than the padded input (2, 4, 5, 5)");
    tu_expect_error(ampc_conv2d(x, w, NULL, &OPT(.dilation = {1, 3})), AMPC_ERR_SHAPE, "dilated extent 7");
    tu_expect_error(ampc_conv2d(x, ampc_tensor_zeros(AMPC_BF16, 4, (int64_t[]){6, 4, 3, 3}), NULL, NULL), AMPC_ERR_DTYPE,
                 "input is f32 but weight is bf16");
    tu_expect_error(ampc_conv2d(x, w, ampc_tensor_zeros(AMPC_F16, 1, (int64_t[]){6}), NULL), AMPC_ERR_DTYPE, "bias is f16");
    tu_expect_error(ampc_conv2d(ampc_tensor_from_i64(4, (int64_t[]){1, 1, 1, 1}, (int64_t[]){1}), w, NULL, NULL), AMPC_ERR_DTYPE,
                 "i64");
    tu_expect_error(ampc_conv2d(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){2, 4, 0, 5}), w, NULL, &OPT(.padding = {2, 2})),
                 AMPC_ERR_SHAPE, "input (2, 4, 0, 5) has an empty non-batch dimension");
    tu_expect_error(ampc_conv2d(x, w, NULL, &OPT(.stride = {-1, 1})), AMPC_ERR_INVALID, "negative stride");
    tu_expect_error(ampc_conv2d(x, w, NULL, &OPT(.groups = -2)), AMPC_ERR_INVALID, "negative groups");
    /* across devices */
    ampc_set_default_device(AMPC_DEVICE_REF);
    ampc_tensor *wr = ampc_tensor_zeros(AMPC_F64, 4, (int64_t[]){6, 4, 3, 3});
    ampc_set_default_device(AMPC_DEVICE_CPU);
    tu_expect_error(ampc_conv2d(x, wr, NULL, NULL), AMPC_ERR_INVALID, "devices");
    /* a NULL input keeps the first error of a chain */
    ampc_tensor *bad = ampc_conv2d(x, ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){6, 3, 3, 3}), NULL, NULL);
    tu_expect_error(ampc_conv2d(bad, w, NULL, NULL), AMPC_ERR_SHAPE, "input channels per group");
    /* under autocast mixed dtypes are fine: all become 16-bit */
    ampc_autocast_enter(AMPC_BF16, true);
    ampc_tensor *y = ampc_conv2d(x, ampc_tensor_zeros(AMPC_F16, 4, (int64_t[]){6, 4, 3, 3}), NULL, NULL);
    ampc_autocast_exit();
    ASSERT_NOT_NULL_MSG(y);
    assert_int_equal(ampc_tensor_dtype(y), AMPC_BF16);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Autocast: 16-bit output, f32 gradients for the f32 master weights, values against REF

static void test_autocast(void **state) {
    (void)state;
    const ampc_dtype lows[] = {AMPC_F16, AMPC_BF16};
    const int64_t N = 2, C = 4, H = 6, W = 6, O = 5;
    int64_t nx = N * C * H * W, nw = O * C * 9;
    double *X = malloc((size_t)nx * sizeof *X), *Wt = malloc((size_t)nw * sizeof *Wt), B[5];
    tu_fill_uniform(X, (size_t)nx, 11, -1, 1);
    tu_fill_uniform(Wt, (size_t)nw, 12, -1, 1);
    tu_fill_uniform(B, 5, 13, -1, 1);
    ampc_conv2d_options o = {.padding = {1, 1}};
    for (int l = 0; l < 2; l++) {
        ampc_dtype lo = lows[l];
        /* REF on the inputs rounded to the autocast dtype, gy = 1 */
        double *Xr = malloc((size_t)nx * sizeof *Xr), *Wr = malloc((size_t)nw * sizeof *Wr), Br[5];
        for (int64_t i = 0; i < nx; i++) Xr[i] = lo == AMPC_F16 ? ampc_f16_to_f32(ampc_f32_to_f16((float)X[i])) : ampc_bf16_to_f32(ampc_f32_to_bf16((float)X[i]));
        for (int64_t i = 0; i < nw; i++) Wr[i] = lo == AMPC_F16 ? ampc_f16_to_f32(ampc_f32_to_f16((float)Wt[i])) : ampc_bf16_to_f32(ampc_f32_to_bf16((float)Wt[i]));
        for (int i = 0; i < 5; i++) Br[i] = lo == AMPC_F16 ? ampc_f16_to_f32(ampc_f32_to_f16((float)B[i])) : ampc_bf16_to_f32(ampc_f32_to_bf16((float)B[i]));
        ampc_set_default_device(AMPC_DEVICE_REF);
        ampc_scope_begin();
        ampc_tensor *xr = ampc_tensor_from_f64(AMPC_F64, 4, (int64_t[]){N, C, H, W}, Xr);
        ampc_tensor *wr = ampc_tensor_from_f64(AMPC_F64, 4, (int64_t[]){O, C, 3, 3}, Wr);
        ampc_tensor *br = ampc_tensor_from_f64(AMPC_F64, 1, (int64_t[]){O}, Br);
        ampc_tensor_set_requires_grad(wr, true);
        ampc_tensor_set_requires_grad(br, true);
        ampc_tensor *yr = ampc_conv2d(xr, wr, br, &o);
        ASSERT_NOT_NULL_MSG(yr);
        ASSERT_OK(ampc_backward(ampc_sum(yr, AMPC_ALL_DIMS, false)));
        double *want_y = tu_values(yr), *want_gw = tu_values(ampc_tensor_grad(wr)), *want_gb = tu_values(ampc_tensor_grad(br));
        ampc_scope_end();
        ampc_set_default_device(AMPC_DEVICE_CPU);

        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_from_f64(AMPC_F32, 4, (int64_t[]){N, C, H, W}, X);
        ampc_tensor *w = ampc_tensor_from_f64(AMPC_F32, 4, (int64_t[]){O, C, 3, 3}, Wt);
        ampc_tensor *b = ampc_tensor_from_f64(AMPC_F32, 1, (int64_t[]){O}, B);
        ampc_tensor_set_requires_grad(w, true);
        ampc_tensor_set_requires_grad(b, true);
        ampc_autocast_enter(lo, true);
        ampc_tensor *y = ampc_conv2d(x, w, b, &o);
        ampc_autocast_exit();
        ASSERT_NOT_NULL_MSG(y);
        assert_int_equal(ampc_tensor_dtype(y), lo);
        assert_string_equal(ampc_tensor_grad_fn_name(y), "ConvolutionBackward");
        ASSERT_OK(ampc_backward(ampc_sum(y, AMPC_ALL_DIMS, false)));
        assert_int_equal(ampc_tensor_dtype(ampc_tensor_grad(w)), AMPC_F32);
        assert_int_equal(ampc_tensor_dtype(ampc_tensor_grad(b)), AMPC_F32);
        double *got_y = tu_values(y), *got_gw = tu_values(ampc_tensor_grad(w)), *got_gb = tu_values(ampc_tensor_grad(b));
        double eps = tu_eps(lo), ky = C * 9 + 1, kw = N * H * W;
        char what[64];
        snprintf(what, sizeof what, "autocast %s output", ampc_dtype_name(lo));
        tu_assert_close(what, got_y, want_y, (size_t)(N * O * H * W), (2 + ky * 0x1p-24 / eps) * eps * 4, (2 + ky * 0x1p-24 / eps) * eps * 2);
        snprintf(what, sizeof what, "autocast %s weight gradient", ampc_dtype_name(lo));
        tu_assert_close(what, got_gw, want_gw, (size_t)nw, (2 + kw * 0x1p-24 / eps) * eps * 4, (2 + kw * 0x1p-24 / eps) * eps * 2);
        /* d sum / d b[o] = N*H*W, exact in every dtype */
        for (int i = 0; i < 5; i++) {
            assert_true(want_gb[i] == (double)(N * H * W));
            assert_true(got_gb[i] == want_gb[i]);
        }
        free(got_y), free(got_gw), free(got_gb), free(want_y), free(want_gw), free(want_gb), free(Xr), free(Wr);
        ampc_scope_end();
    }
    free(X), free(Wt);
}

// ---------------------------------------------------------------------------------------------
// f32 weight gradients of 16-bit inputs (the backend contract's exception): conv2d_backward_weights
// with bf16/f16 x and gy and f32 gw/gb writes the f32 sums unrounded. Inputs are exact in every
// dtype and their products exact in f32 (8+8 or 11+11 significant bits), so the only error is
// the f32 accumulation: |got - ref| <= gamma(k) * sum|x*gy| with k = N*OH*OW terms, any order.
// The same call with a 16-bit gw must give that f32 result rounded once. Run on 1 thread and on
// 3 (bf16 weight gradients are then split over threads: by output channels or by images).

/* The (k-1)-addition bound of any summation order, unit roundoff 2^-24. */
static double gamma_f32(double k) { return k * 0x1p-24 / (1 - k * 0x1p-24); }

/* x, gy on the device in dt from the values X, GY; gw/gb (gb when bias) in gdt. */
static void run_bwd_weights(ampc_device dev, const ampc_conv_desc *d, ampc_dtype dt, ampc_dtype gdt, const double *X,
                            const double *GY, bool bias, double **gw_out, double **gb_out) {
    ampc_set_default_device(dev);
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_from_f64(dt, 4, (int64_t[]){d->N, d->C, d->H, d->W}, X);
    ampc_tensor *gy = ampc_tensor_from_f64(dt, 4, (int64_t[]){d->N, d->O, d->OH, d->OW}, GY);
    ampc_tensor *gw = ampc_tensor_full(gdt, 4, (int64_t[]){d->O, d->C / d->groups, d->KH, d->KW}, NAN);
    ampc_tensor *gb = bias ? ampc_tensor_full(gdt, 1, (int64_t[]){d->O}, NAN) : NULL;
    ASSERT_NOT_NULL_MSG(x && gy && gw && (gb || !bias));
    ASSERT_OK(ampc__backend(dev)->conv2d_backward_weights(d, x, gy, gw, gb));
    *gw_out = tu_values(gw);
    *gb_out = bias ? tu_values(gb) : NULL;
    ampc_scope_end();
    ampc_set_default_device(AMPC_DEVICE_CPU);
}

static void test_f32_weight_grad(void **state) {
    (void)state;
    /* N, C, H, W, O, kh, kw, stride, padding, groups: 1x1 small and with a longer map, 1x1 stride
       2, 3x3 stride 2, 3x3 with more weights than inputs (bf16: split over output channels, 24
       of them in a block of 16 and a partial one), 3x3 with fewer (split over the batch, 4
       images in 3 slices), grouped, depthwise */
    const int64_t shapes[][10] = {
        {2, 16, 8, 8, 24, 1, 1, 1, 0, 1}, {2, 64, 28, 28, 32, 1, 1, 1, 0, 1}, {2, 16, 9, 9, 24, 1, 1, 2, 0, 1},
        {2, 16, 9, 9, 32, 3, 3, 2, 1, 1}, {5, 16, 6, 6, 24, 3, 3, 1, 1, 1},   {4, 16, 10, 10, 16, 3, 3, 1, 1, 1},
        {2, 8, 7, 6, 12, 3, 3, 1, 1, 2},  {2, 16, 8, 8, 16, 3, 3, 1, 1, 16},
    };
    const int threads[] = {1, 3};
    int nthr = ampc_get_num_threads();
    const ampc_dtype lows[] = {AMPC_BF16, AMPC_F16};
    char what[160];
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        const int64_t *c = shapes[si];
        ampc_conv_desc d = {.N = c[0], .C = c[1], .H = c[2], .W = c[3], .O = c[4], .KH = c[5], .KW = c[6],
                            .stride = {(int)c[7], (int)c[7]}, .padding = {(int)c[8], (int)c[8]}, .dilation = {1, 1},
                            .groups = (int)c[9]};
        d.OH = (d.H + 2 * d.padding[0] - d.KH) / d.stride[0] + 1;
        d.OW = (d.W + 2 * d.padding[1] - d.KW) / d.stride[1] + 1;
        size_t nx = (size_t)(d.N * d.C * d.H * d.W), ny = (size_t)(d.N * d.O * d.OH * d.OW);
        size_t nw = (size_t)(d.O * (d.C / d.groups) * d.KH * d.KW), no = (size_t)d.O;
        double *X = malloc(nx * sizeof *X), *GY = malloc(ny * sizeof *GY);
        double *AX = malloc(nx * sizeof *AX), *AGY = malloc(ny * sizeof *AGY);
        double gam = gamma_f32((double)(d.N * d.OH * d.OW));
        for (int l = 0; l < 2; l++) {
            ampc_dtype lo = lows[l];
            /* values exact in lo; |x|, |gy| give the bound's sum|x*gy| */
            tu_fill_uniform(X, nx, 200 + si, -1, 1);
            tu_fill_uniform(GY, ny, 300 + si, -1, 1);
            for (size_t i = 0; i < nx; i++) {
                X[i] = lo == AMPC_BF16 ? ampc_bf16_to_f32(ampc_f32_to_bf16((float)X[i])) : ampc_f16_to_f32(ampc_f32_to_f16((float)X[i]));
                AX[i] = fabs(X[i]);
            }
            for (size_t i = 0; i < ny; i++) {
                GY[i] = lo == AMPC_BF16 ? ampc_bf16_to_f32(ampc_f32_to_bf16((float)GY[i])) : ampc_f16_to_f32(ampc_f32_to_f16((float)GY[i]));
                AGY[i] = fabs(GY[i]);
            }
            for (int v = 0; v < 4; v++) {   /* without and with bias, 1 and 3 threads */
                bool bias = v & 1;
                int nt = threads[v >> 1];
                double *ref_w, *ref_b, *abs_w, *abs_b, *got_w, *got_b, *low_w, *low_b;
                run_bwd_weights(AMPC_DEVICE_REF, &d, AMPC_F64, AMPC_F64, X, GY, bias, &ref_w, &ref_b);
                run_bwd_weights(AMPC_DEVICE_REF, &d, AMPC_F64, AMPC_F64, AX, AGY, bias, &abs_w, &abs_b);   /* sum|x*gy| */
                ampc_set_num_threads(nt);
                run_bwd_weights(AMPC_DEVICE_CPU, &d, lo, AMPC_F32, X, GY, bias, &got_w, &got_b);
                run_bwd_weights(AMPC_DEVICE_CPU, &d, lo, lo, X, GY, bias, &low_w, &low_b);
                ampc_set_num_threads(nthr);
                snprintf(what, sizeof what, "f32 weight gradient, %s shape %zu%s, %d threads", ampc_dtype_name(lo), si,
                         bias ? " (bias)" : "", nt);
                for (size_t i = 0; i < nw + (bias ? no : 0); i++) {
                    bool w = i < nw;
                    size_t j = w ? i : i - nw;
                    double got = w ? got_w[j] : got_b[j], ref = w ? ref_w[j] : ref_b[j], bound = gam * (w ? abs_w[j] : abs_b[j]);
                    double low = w ? low_w[j] : low_b[j];
                    double rounded = lo == AMPC_BF16 ? ampc_bf16_to_f32(ampc_f32_to_bf16((float)got)) : ampc_f16_to_f32(ampc_f32_to_f16((float)got));
                    if (!(fabs(got - ref) <= bound))
                        fail_msg("%s: %s [%zu] got %.9g ref %.9g, error %.3g > bound %.3g", what, w ? "gw" : "gb", j, got, ref,
                                 fabs(got - ref), bound);
                    if (low != rounded)
                        fail_msg("%s: %s [%zu] in %s is %.9g, the f32 result %.9g rounds to %.9g", what, w ? "gw" : "gb", j,
                                 ampc_dtype_name(lo), low, got, rounded);
                }
                free(ref_w), free(ref_b), free(abs_w), free(abs_b), free(got_w), free(got_b), free(low_w), free(low_b);
            }
        }
        free(X), free(GY), free(AX), free(AGY);
    }
    /* a 16-bit gb beside an f32 gw is refused (by the door) */
    ampc_scope_begin();
    const ampc_conv_desc d = {.N = 1, .C = 2, .H = 3, .W = 3, .O = 2, .KH = 1, .KW = 1, .OH = 3, .OW = 3,
                              .stride = {1, 1}, .padding = {0, 0}, .dilation = {1, 1}, .groups = 1};
    ampc_tensor *x = ampc_tensor_zeros(AMPC_BF16, 4, (int64_t[]){1, 2, 3, 3});
    ampc_tensor *gy = ampc_tensor_zeros(AMPC_BF16, 4, (int64_t[]){1, 2, 3, 3});
    ampc_tensor *gw = ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){2, 2, 1, 1});
    ampc_tensor *gb = ampc_tensor_zeros(AMPC_BF16, 1, (int64_t[]){2});
    assert_int_equal(ampc__k_conv2d_backward_weights(&d, x, gy, gw, gb), AMPC_ERR_DTYPE);
    ampc_clear_error();
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Empty batch: PyTorch allows N = 0; weight and bias gradients are zero

static void test_empty_batch(void **state) {
    (void)state;
    for (size_t di = 0; di < sizeof cpu_dtypes / sizeof *cpu_dtypes; di++) {
        ampc_dtype dt = cpu_dtypes[di];
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_zeros(dt, 4, (int64_t[]){0, 3, 5, 5});
        ampc_tensor *w = ampc_tensor_full(dt, 4, (int64_t[]){4, 3, 3, 3}, 1.0);
        ampc_tensor *b = ampc_tensor_full(dt, 1, (int64_t[]){4}, 1.0);
        ampc_tensor_set_requires_grad(x, true);
        ampc_tensor_set_requires_grad(w, true);
        ampc_tensor_set_requires_grad(b, true);
        ampc_tensor *y = ampc_conv2d(x, w, b, &OPT(.padding = {1, 1}));
        ASSERT_NOT_NULL_MSG(y);
        assert_int_equal(ampc_tensor_dim(y, 0), 0);
        assert_int_equal(ampc_tensor_dim(y, 2), 5);
        ASSERT_OK(ampc_backward_with_grad(y, ampc_tensor_zeros(dt, 4, (int64_t[]){0, 4, 5, 5})));
        double gw[108], gb[4];
        ASSERT_OK(ampc_tensor_to_f64(ampc_tensor_grad(w), gw, 108));
        ASSERT_OK(ampc_tensor_to_f64(ampc_tensor_grad(b), gb, 4));
        for (int i = 0; i < 108; i++) assert_true(gw[i] == 0.0);
        for (int i = 0; i < 4; i++) assert_true(gb[i] == 0.0);
        ampc_scope_end();
    }
}

/* Kernels called directly with an empty input under padding (the op refuses it, as PyTorch
   does): every output reads padding, so y is the bias, gw is zero and gb the sum of gy. */
static void test_kernel_empty_input(void **state) {
    (void)state;
    const ampc_conv_desc d = {.N = 2, .C = 3, .H = 0, .W = 2, .O = 2, .KH = 1, .KW = 1, .OH = 2, .OW = 4,
                              .stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
    for (int dev = 0; dev < 2; dev++) {
        ampc_device device = dev ? AMPC_DEVICE_REF : AMPC_DEVICE_CPU;
        ampc_dtype dt = dev ? AMPC_F64 : AMPC_BF16;
        ampc_set_default_device(device);
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_zeros(dt, 4, (int64_t[]){2, 3, 0, 2});
        ampc_tensor *w = ampc_tensor_full(dt, 4, (int64_t[]){2, 3, 1, 1}, 1.0);
        ampc_tensor *b = ampc_tensor_from_f64(dt, 1, (int64_t[]){2}, (double[]){0.5, -2});
        ampc_tensor *y = ampc_tensor_full(dt, 4, (int64_t[]){2, 2, 2, 4}, NAN);
        ampc_tensor *gy = ampc_tensor_full(dt, 4, (int64_t[]){2, 2, 2, 4}, 0.25);
        ampc_tensor *gw = ampc_tensor_full(dt, 4, (int64_t[]){2, 3, 1, 1}, NAN);
        ampc_tensor *gb = ampc_tensor_full(dt, 1, (int64_t[]){2}, NAN);
        const ampc_backend *be = ampc__backend(device);
        ASSERT_OK(be->conv2d(&d, x, w, b, y));
        ASSERT_OK(be->conv2d_backward_weights(&d, x, gy, gw, gb));
        double vy[32], vw[6], vb[2];
        ASSERT_OK(ampc_tensor_to_f64(y, vy, 32));
        ASSERT_OK(ampc_tensor_to_f64(gw, vw, 6));
        ASSERT_OK(ampc_tensor_to_f64(gb, vb, 2));
        for (int i = 0; i < 32; i++) assert_true(vy[i] == (i / 8 % 2 ? -2.0 : 0.5));
        for (int i = 0; i < 6; i++) assert_true(vw[i] == 0.0);
        for (int i = 0; i < 2; i++) assert_true(vb[i] == 4.0);   /* 2 * 8 * 0.25 */
        ampc_scope_end();
    }
    ampc_set_default_device(AMPC_DEVICE_CPU);
}

// ---------------------------------------------------------------------------------------------
// Steady state: the third identical step reuses primitives, reorders, workspace and tensor
// blocks (blocked 3x3 path with reorders, plain 1x1 path)

static void test_steady_state_no_malloc(void **state) {
    (void)state;
    const int64_t ks[2] = {3, 1};
    for (size_t di = 0; di < sizeof cpu_dtypes / sizeof *cpu_dtypes; di++)
        for (int ki = 0; ki < 2; ki++) {
            ampc_dtype dt = cpu_dtypes[di];
            int64_t k = ks[ki];
            ampc_scope_begin();
            ampc_tensor *x = ampc_tensor_rand(dt, 4, (int64_t[]){4, 16, 8, 8}, -1, 1);
            ampc_tensor *w = ampc_tensor_rand(dt, 4, (int64_t[]){24, 16, k, k}, -1, 1);
            ampc_tensor *b = ampc_tensor_rand(dt, 1, (int64_t[]){24}, -1, 1);
            ampc_tensor_set_requires_grad(x, true);
            ampc_tensor_set_requires_grad(w, true);
            ampc_tensor_set_requires_grad(b, true);
            ampc_conv2d_options o = {.padding = {(int)(k / 2), (int)(k / 2)}};
            uint64_t before = 0;
            for (int step = 0; step < 3; step++) {
                if (step == 2) before = ampc_memory_stats().n_malloc;   /* grads exist from step 1 on */
                ampc_scope_begin();
                ampc_tensor *y = ampc_conv2d(x, w, b, &o);
                ASSERT_NOT_NULL_MSG(y);
                ampc_tensor *g = ampc_tensor_full(dt, 4, (int64_t[]){4, 24, 8, 8}, 0.5);
                ASSERT_OK(ampc_backward_with_grad(y, g));
                ampc_scope_end();
            }
            uint64_t after = ampc_memory_stats().n_malloc;
            if (after != before)
                fail_msg("%s %lldx%lld: step 3 made %llu new system allocations", ampc_dtype_name(dt), (long long)k, (long long)k,
                         (unsigned long long)(after - before));
            ampc_scope_end();
        }
}

// ---------------------------------------------------------------------------------------------
// Which oneDNN kernels run: never the reference ones, and bf16 on the AVX512_BF16 kernels where
// the CPU has them

static void test_impl_names(void **state) {
    (void)state;
    const ampc_conv_desc layers[] = {
        {.N = 64, .C = 64, .H = 32, .W = 32, .O = 64, .KH = 3, .KW = 3, .OH = 32, .OW = 32,
         .stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1},
        {.N = 64, .C = 64, .H = 32, .W = 32, .O = 128, .KH = 3, .KW = 3, .OH = 16, .OW = 16,
         .stride = {2, 2}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1},
        {.N = 64, .C = 64, .H = 32, .W = 32, .O = 128, .KH = 1, .KW = 1, .OH = 16, .OW = 16,
         .stride = {2, 2}, .padding = {0, 0}, .dilation = {1, 1}, .groups = 1},
        {.N = 64, .C = 256, .H = 16, .W = 16, .O = 64, .KH = 1, .KW = 1, .OH = 16, .OW = 16,
         .stride = {1, 1}, .padding = {0, 0}, .dilation = {1, 1}, .groups = 1},
        {.N = 8, .C = 32, .H = 16, .W = 16, .O = 32, .KH = 3, .KW = 3, .OH = 16, .OW = 16,
         .stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 32},
        {.N = 16, .C = 2048, .H = 7, .W = 7, .O = 512, .KH = 1, .KW = 1, .OH = 7, .OW = 7,
         .stride = {1, 1}, .padding = {0, 0}, .dilation = {1, 1}, .groups = 1},
        {.N = 16, .C = 1024, .H = 14, .W = 14, .O = 2048, .KH = 1, .KW = 1, .OH = 7, .OW = 7,
         .stride = {2, 2}, .padding = {0, 0}, .dilation = {1, 1}, .groups = 1},
    };
    static const char *passes[3] = {"forward", "backward data", "backward weights"};
    bool has_bf16 = ampc_dtype_native(AMPC_DEVICE_CPU, AMPC_BF16);   /* oneDNN runs bf16 on bf16 units here */
    for (size_t i = 0; i < sizeof layers / sizeof *layers; i++)
        for (int d = 0; d < 2; d++)
            for (int p = 0; p < 6; p++) {   /* the three passes without, then with bias */
                char name[128];
                ampc_dtype dt = d ? AMPC_BF16 : AMPC_F32;
                const ampc_conv_desc *l = &layers[i];
                ASSERT_OK(ampc__cpu_conv_impl(l, dt, p % 3, p >= 3, name, sizeof name));
                print_message("conv %s %lldx%lld s%d g%d %lld->%lld %s%s: %s\n", ampc_dtype_name(dt), (long long)l->KH,
                              (long long)l->KW, l->stride[0], l->groups, (long long)l->C, (long long)l->O, passes[p % 3],
                              p >= 3 ? " (bias)" : "", name);
                assert_null(strstr(name, "ref"));
                /* ungrouped 1x1 runs as a gemm on NCHW (the bf16 gemm is AVX512_BF16 too) but on
                   small maps and, forward and f32 weight gradients, strided */
                bool big = l->OH * l->OW >= 100, s1 = l->stride[0] == 1;
                bool gemm = l->KH == 1 && l->KW == 1 && l->groups == 1 && big &&
                            (p % 3 == 1 || s1 || (p % 3 == 2 && dt == AMPC_BF16 && !ampc__dnnl_via_f32(dt)));
                if (gemm) assert_non_null(strstr(name, "gemm:jit"));
                else if (dt == AMPC_BF16 && has_bf16) assert_true(tu_impl_bf16_native(name));
            }
}

/* The door refuses a convolution's bad arguments before any device's kernel sees them, the same
   on CPU and REF: a window that does not fit the output size, tensors on two devices, sizes
   other than the descriptor's, no weight gradient tensor. */
static void test_conv_door(void **state) {
    (void)state;
    const ampc_device devs[] = {AMPC_DEVICE_CPU, AMPC_DEVICE_REF};
    for (int k = 0; k < 2; k++) {
        ampc_scope_begin();
        ampc_dtype dt = devs[k] == AMPC_DEVICE_REF ? AMPC_F64 : AMPC_F32;
        ampc_conv_desc d = {.N = 1, .C = 2, .H = 3, .W = 3, .O = 2, .KH = 1, .KW = 1, .OH = 3, .OW = 3,
                            .stride = {1, 1}, .padding = {0, 0}, .dilation = {1, 1}, .groups = 1};
        ampc_tensor *x = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){1, 2, 3, 3}), devs[k], dt);
        ampc_tensor *y = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){1, 2, 3, 3}), devs[k], dt);
        ampc_tensor *w = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){2, 2, 1, 1}), devs[k], dt);
        ampc_tensor *w9 = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){2, 2, 3, 3}), devs[k], dt);
        ampc_tensor *far = devs[k] == AMPC_DEVICE_REF ? ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){2, 2, 1, 1}) : NULL;
        ASSERT_NOT_NULL_MSG(x && y && w && w9);
        ASSERT_OK(ampc__k_conv2d(&d, x, w, NULL, y));
        ampc_conv_desc bad = d;
        bad.OH = 2;   /* a 1x1 window over 3 rows makes 3 */
        assert_int_equal(ampc__k_conv2d(&bad, x, w, NULL, y), AMPC_ERR_INVALID);
        assert_non_null(strstr(ampc_last_error(), "output size 2x3 does not match"));
        assert_int_equal(ampc__k_conv2d(&d, x, w9, NULL, y), AMPC_ERR_INVALID);
        assert_non_null(strstr(ampc_last_error(), "size does not match the descriptor"));
        assert_int_equal(ampc__k_conv2d_backward_weights(&d, x, y, NULL, NULL), AMPC_ERR_INVALID);
        if (far) {
            assert_int_equal(ampc__k_conv2d(&d, x, far, NULL, y), AMPC_ERR_INVALID);
            assert_non_null(strstr(ampc_last_error(), "more than one device"));
        }
        ampc_clear_error();
        ampc_scope_end();
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conv_door),
        cmocka_unit_test(test_conv_cases),
        cmocka_unit_test(test_partial_grads),
        cmocka_unit_test(test_conv_large),
        cmocka_unit_test(test_output_shapes),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_autocast),
        cmocka_unit_test(test_f32_weight_grad),
        cmocka_unit_test(test_empty_batch),
        cmocka_unit_test(test_kernel_empty_input),
        cmocka_unit_test(test_steady_state_no_malloc),
        cmocka_unit_test(test_impl_names),
    };
    return cmocka_run_group_tests_name("conv", tests, tu_group_setup, tu_group_teardown);
}
