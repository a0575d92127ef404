/*
 * test_channels_last.c - the channels-last memory format above the kernels: conversions (the
 * storage order against the definition, round trips in every float dtype, logical-order reads
 * and writes), which ops keep the format and which convert, gradients coming back in the
 * caller's format, and the zoo's conv nets giving the same loss and gradients channels-last as
 * contiguous (fp32: to summation order; autocast bf16: to bf16 rounding) on CPU and on REF
 * (which has no channels-last kernels: its ops convert).
 *
 * The channels-last kernels themselves are checked against contiguous ones and the f64 REF
 * backend in test_conv_cl.c and test_cl_kernels.c.
 */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/core.h"

static const int64_t SHAPE[4] = {2, 5, 3, 4};   /* C not a power of two, H != W */

/* (N, C, H, W) f32 tensor of test data on the default device. */
static ampc_tensor *data4(const int64_t *shape, uint64_t seed) {
    int64_t n = shape[0] * shape[1] * shape[2] * shape[3];
    double *v = malloc((size_t)n * sizeof *v);
    float *f = malloc((size_t)n * sizeof *f);
    tu_fill_uniform(v, (size_t)n, seed, -2, 2);
    for (int64_t i = 0; i < n; i++) f[i] = (float)v[i];
    ampc_tensor *t = ampc_tensor_from_f32(AMPC_F32, 4, shape, f);
    free(v);
    free(f);
    ASSERT_NOT_NULL_MSG(t);
    return t;
}

static bool cl_kernels(void) { return ampc__backend(AMPC_DEVICE_CPU)->channels_last; }

// ---------------------------------------------------------------------------------------------
// Conversions

/* Element (n, c, h, w) sits at ((n*H + h)*W + w)*C + c, in every float dtype; round trips are
   exact; reads and writes through the public accessors are in logical order. */
static void test_storage_order(void **state) {
    (void)state;
    const ampc_dtype dts[] = {AMPC_F32, AMPC_BF16, AMPC_F16};
    int64_t N = SHAPE[0], C = SHAPE[1], H = SHAPE[2], W = SHAPE[3], n = N * C * H * W;
    ampc_tensor *x32 = data4(SHAPE, 1);
    for (size_t k = 0; k < sizeof dts / sizeof *dts; k++) {
        ampc_tensor *x = ampc_tensor_to(x32, AMPC_DEVICE_CPU, dts[k]);
        ampc_tensor *y = ampc_to_memory_format(x, AMPC_CHANNELS_LAST);
        ASSERT_NOT_NULL_MSG(y);
        assert_int_equal(ampc_tensor_memory_format(y), AMPC_CHANNELS_LAST);
        assert_int_equal(ampc_tensor_memory_format(x), AMPC_CONTIGUOUS_FORMAT);
        double *logical = tu_values(x), *got = tu_values(y), *raw = malloc((size_t)n * sizeof *raw);
        ampc__dt(dts[k])->to_f64(ampc_tensor_cdata(y), raw, (size_t)n);
        for (int64_t i = 0; i < N; i++)
            for (int64_t c = 0; c < C; c++)
                for (int64_t h = 0; h < H; h++)
                    for (int64_t w = 0; w < W; w++)
                        if (raw[((i * H + h) * W + w) * C + c] != logical[((i * C + c) * H + h) * W + w])
                            fail_msg("%s: element (%lld, %lld, %lld, %lld) misplaced", ampc_dtype_name(dts[k]), (long long)i,
                                     (long long)c, (long long)h, (long long)w);
        tu_assert_close("logical read", got, logical, (size_t)n, 0, 0);
        ampc_tensor *back = ampc_to_memory_format(y, AMPC_CONTIGUOUS_FORMAT);
        double *b = tu_values(back);
        tu_assert_close("round trip", b, logical, (size_t)n, 0, 0);
        /* ampc_tensor_to keeps the format (as PyTorch's .to) and converts the dtype */
        ampc_tensor *z = ampc_tensor_to(y, AMPC_DEVICE_CPU, AMPC_F32);
        assert_int_equal(ampc_tensor_memory_format(z), AMPC_CHANNELS_LAST);
        double *zv = tu_values(z);
        tu_assert_close("to f32", zv, logical, (size_t)n, 0, 0);
        free(logical), free(got), free(raw), free(b), free(zv);
    }
    /* writing in logical order */
    ampc_tensor *y = ampc_to_memory_format(x32, AMPC_CHANNELS_LAST);
    float *src = malloc((size_t)n * sizeof *src);
    for (int64_t i = 0; i < n; i++) src[i] = (float)i;
    ASSERT_OK(ampc_tensor_copy_from_f32(y, src, (size_t)n));
    double *v = tu_values(y);
    for (int64_t i = 0; i < n; i++)
        if (v[i] != (double)i) fail_msg("copy_from_f32: element %lld is %g", (long long)i, v[i]);
    free(src);
    free(v);
}

/* C == 1 or H * W == 1: both formats order the elements alike, so the conversion shares storage. */
static void test_trivial_conversion_shares_storage(void **state) {
    (void)state;
    const int64_t shapes[2][4] = {{3, 1, 4, 5}, {3, 7, 1, 1}};
    for (int k = 0; k < 2; k++) {
        ampc_tensor *x = data4(shapes[k], 2);
        ampc_tensor *y = ampc_to_memory_format(x, AMPC_CHANNELS_LAST);
        ASSERT_NOT_NULL_MSG(y);
        assert_int_equal(ampc_tensor_memory_format(y), AMPC_CHANNELS_LAST);
        assert_ptr_equal(ampc_tensor_cdata(y), ampc_tensor_cdata(x));
    }
}

static void test_conversion_errors(void **state) {
    (void)state;
    ampc_tensor *x3 = ampc_tensor_zeros(AMPC_F32, 3, (int64_t[]){2, 3, 4});
    tu_expect_error(ampc_to_memory_format(x3, AMPC_CHANNELS_LAST), AMPC_ERR_SHAPE, "4-D");
    ampc_tensor *x4 = data4(SHAPE, 3);
    tu_expect_error(ampc_to_memory_format(x4, (ampc_memory_format)7), AMPC_ERR_INVALID, "memory format");
    tu_expect_error(ampc_to_memory_format(NULL, AMPC_CHANNELS_LAST), AMPC_ERR_INVALID, NULL);
}

// ---------------------------------------------------------------------------------------------
// Ops on channels-last inputs: same values as on contiguous ones; the format kept by the ops
// that have channels-last kernels, dropped by the others

static void expect_same(const char *what, ampc_tensor *got, ampc_tensor *want, double rtol) {
    ASSERT_NOT_NULL_MSG(got);
    ASSERT_NOT_NULL_MSG(want);
    assert_int_equal(ampc_tensor_numel(got), ampc_tensor_numel(want));
    double *g = tu_values(got), *w = tu_values(want);
    tu_assert_close(what, g, w, (size_t)ampc_tensor_numel(want), rtol, rtol);
    free(g);
    free(w);
}

static void test_elementwise_keep_the_format(void **state) {
    (void)state;
    ampc_tensor *a = data4(SHAPE, 4), *b = data4(SHAPE, 5);
    ampc_tensor *ac = ampc_to_memory_format(a, AMPC_CHANNELS_LAST), *bc = ampc_to_memory_format(b, AMPC_CHANNELS_LAST);
    ampc_tensor *r[] = {ampc_relu(ac), ampc_add(ac, bc), ampc_mul(ac, bc), ampc_mul_scalar(ac, 3), ampc_tanh(ac)};
    ampc_tensor *e[] = {ampc_relu(a), ampc_add(a, b), ampc_mul(a, b), ampc_mul_scalar(a, 3), ampc_tanh(a)};
    for (size_t i = 0; i < sizeof r / sizeof *r; i++) {
        expect_same("elementwise", r[i], e[i], 0);
        assert_int_equal(ampc_tensor_memory_format(r[i]), cl_kernels() ? AMPC_CHANNELS_LAST : AMPC_CONTIGUOUS_FORMAT);
    }
    /* mixed formats and broadcasting: computed right, whatever the format chosen */
    expect_same("mixed formats", ampc_add(ac, b), ampc_add(a, b), 0);
    ampc_tensor *bias = ampc_tensor_full(AMPC_F32, 3, (int64_t[]){5, 1, 1}, 0.5);
    expect_same("broadcast", ampc_mul(ac, bias), ampc_mul(a, bias), 0);
    /* ops without channels-last kernels convert: reshape, sum over a dim, softmax */
    expect_same("flatten", ampc_flatten(ac, 1, -1), ampc_flatten(a, 1, -1), 0);
    expect_same("sum dim 1", ampc_sum(ac, 1, false), ampc_sum(a, 1, false), 1e-6);
    expect_same("softmax", ampc_softmax(ac, 1), ampc_softmax(a, 1), 1e-6);
    assert_int_equal(ampc_tensor_memory_format(ampc_flatten(ac, 0, 1)), AMPC_CONTIGUOUS_FORMAT);
}

/* Every other kind of op on a channels-last input: the contiguous op's values and gradients
   (each op either has a channels-last kernel or converts its input first). */
static void test_other_ops_match_contiguous(void **state) {
    (void)state;
    const int64_t s6[4] = {2, 6, 5, 4};
    for (int k = 0; k < 9; k++) {
        ampc_tensor *out[2], *grad[2];
        for (int cl = 0; cl < 2; cl++) {
            ampc_scope_begin();
            ampc_tensor *x = data4(s6, 20), *y = data4(s6, 21);
            ampc_tensor_set_requires_grad(x, true);
            ampc_tensor *h = cl ? ampc_to_memory_format(x, AMPC_CHANNELS_LAST) : x;
            ampc_tensor *w4 = ampc_tensor_full(AMPC_F32, 2, (int64_t[]){3, 4}, 0.25);
            ampc_tensor *r = NULL;
            switch (k) {
            case 0: r = ampc_linear(h, w4, NULL); break;                                /* over the last dim */
            case 1: r = ampc_layer_norm(h, 2, NULL, NULL, 1e-5); break;
            case 2: r = ampc_cat((ampc_tensor *[]){h, h}, 2, 1); break;
            case 3: r = ampc_mse_loss(h, y, AMPC_REDUCTION_SUM); break;
            case 4: r = ampc_max_pool2d(h, &(ampc_pool2d_options){.kernel = {3, 2}, .stride = {2, 1}, .ceil_mode = true}); break;
            case 5: r = ampc_avg_pool2d(h, &(ampc_pool2d_options){.kernel = {2, 2}, .padding = {1, 1}}); break;
            case 6: r = ampc_adaptive_avg_pool2d(h, 3, 2); break;
            case 7: r = ampc_log_softmax(h, 1); break;
            case 8: r = ampc_matmul(h, ampc_tensor_full(AMPC_F32, 2, (int64_t[]){4, 2}, 0.5)); break;
            }
            ASSERT_NOT_NULL_MSG(r);
            ampc_tensor *loss = ampc_sum(ampc_mul(r, r), AMPC_ALL_DIMS, false);
            ASSERT_OK(ampc_backward(loss));
            out[cl] = ampc_tensor_own(ampc_tensor_to(r, AMPC_DEVICE_CPU, AMPC_F32));
            grad[cl] = ampc_tensor_own(ampc_tensor_to(ampc_tensor_grad(x), AMPC_DEVICE_CPU, AMPC_F32));
            ampc_scope_end();
        }
        expect_same("op output", out[1], out[0], 1e-6);
        expect_same("op gradient", grad[1], grad[0], 1e-5);
        for (int cl = 0; cl < 2; cl++) {
            ampc_tensor_free(out[cl]);
            ampc_tensor_free(grad[cl]);
        }
    }
}

/* Dropout keeps the format; the mask applies alike to the output and the gradient. */
static void test_dropout_channels_last(void **state) {
    (void)state;
    ampc_tensor *x = data4(SHAPE, 30);
    ampc_tensor_set_requires_grad(x, true);
    ampc_tensor *h = ampc_to_memory_format(x, AMPC_CHANNELS_LAST);
    ampc_tensor *y = ampc_dropout(h, 0.5, true);
    ASSERT_NOT_NULL_MSG(y);
    assert_int_equal(ampc_tensor_memory_format(y), cl_kernels() ? AMPC_CHANNELS_LAST : AMPC_CONTIGUOUS_FORMAT);
    ASSERT_OK(ampc_backward(ampc_sum(y, AMPC_ALL_DIMS, false)));
    double *yv = tu_values(y), *xv = tu_values(x), *gv = tu_values(ampc_tensor_grad(x));
    int kept = 0;
    for (int64_t i = 0; i < ampc_tensor_numel(x); i++) {
        bool on = yv[i] != 0;
        kept += on;
        if (on && (fabs(yv[i] - 2 * xv[i]) > 1e-6 * fabs(xv[i]) || gv[i] != 2)) fail_msg("element %lld kept wrongly", (long long)i);
        if (!on && gv[i] != 0) fail_msg("element %lld dropped but has gradient %g", (long long)i, gv[i]);
    }
    assert_true(kept > 0 && kept < ampc_tensor_numel(x));
    free(yv), free(xv), free(gv);
}

/* A graph mixing formats: gradients reach each leaf in the leaf's format with the values of the
   all-contiguous graph. */
static void test_gradients_come_back_in_the_callers_format(void **state) {
    (void)state;
    ampc_tensor *grads[2][2];
    for (int cl = 0; cl < 2; cl++) {
        ampc_tensor *x = data4(SHAPE, 6), *w = data4((int64_t[]){1, 5, 3, 4}, 7);
        ampc_tensor_set_requires_grad(x, true);
        ampc_tensor_set_requires_grad(w, true);
        ampc_tensor *h = cl ? ampc_to_memory_format(x, AMPC_CHANNELS_LAST) : x;
        ampc_tensor *y = ampc_mul(ampc_relu(h), ampc_sigmoid(h));            /* kept channels-last */
        y = ampc_add(y, ampc_mul_scalar(ampc_relu(h), 2));
        y = ampc_mul(y, w);                                                 /* broadcast: converts */
        ampc_tensor *loss = ampc_sum(ampc_mul(ampc_flatten(y, 1, -1), ampc_flatten(y, 1, -1)), AMPC_ALL_DIMS, false);
        ASSERT_OK(ampc_backward(loss));
        assert_int_equal(ampc_tensor_memory_format(ampc_tensor_grad(x)), AMPC_CONTIGUOUS_FORMAT);
        grads[cl][0] = ampc_tensor_grad(x);
        grads[cl][1] = ampc_tensor_grad(w);
        ampc_tensor_keep(grads[cl][0]);
    }
    expect_same("grad x", grads[1][0], grads[0][0], 1e-6);
    expect_same("grad w", grads[1][1], grads[0][1], 1e-5);

    /* a channels-last leaf gets a channels-last gradient */
    ampc_tensor *x = ampc_tensor_to(ampc_to_memory_format(data4(SHAPE, 8), AMPC_CHANNELS_LAST), AMPC_DEVICE_CPU, AMPC_F32);
    ampc_tensor_set_requires_grad(x, true);
    ampc_tensor *loss = ampc_sum(ampc_flatten(ampc_mul(x, x), 0, -1), AMPC_ALL_DIMS, false);
    ASSERT_OK(ampc_backward(loss));
    ampc_tensor *g = ampc_tensor_grad(x);
    assert_int_equal(ampc_tensor_memory_format(g), AMPC_CHANNELS_LAST);
    expect_same("2x", g, ampc_mul_scalar(x, 2), 0);
}

// ---------------------------------------------------------------------------------------------
// The zoo's conv nets: channels-last against contiguous

typedef struct {
    double loss;
    int n;
    double **grads;
    int64_t *sizes;
} run_result;

/* One forward + backward of a fresh model (seeded: both formats get the same weights). */
static run_result run_model(const char *name, ampc_memory_format fmt, ampc_device dev, bool amp, bool training,
                            const int64_t *xs, int64_t classes) {
    ampc_manual_seed(11);
    ampc_set_default_device(dev);   /* the parameters' device */
    ampc_module *m = ampc_model_new(name, &(ampc_model_options){.num_classes = classes, .small_input = true,
                                                                .in_channels = xs[1], .memory_format = fmt});
    ampc_set_default_device(AMPC_DEVICE_CPU);
    ASSERT_NOT_NULL_MSG(m);
    ampc_module_train(m, training);
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_to(data4(xs, 12), dev, dev == AMPC_DEVICE_CPU ? AMPC_F32 : AMPC_F64);
    int64_t labels[64];
    for (int64_t i = 0; i < xs[0]; i++) labels[i] = (i * 7) % classes;
    ampc_tensor *y = ampc_tensor_to(ampc_tensor_from_i64(1, xs, labels), dev, AMPC_I64);
    if (amp) ampc_autocast_enter(AMPC_BF16, true);
    ampc_tensor *loss = ampc_cross_entropy(ampc_module_forward(m, x), y, NULL);
    if (amp) ampc_autocast_exit();
    ASSERT_NOT_NULL_MSG(loss);
    ASSERT_OK(ampc_backward(loss));
    run_result r = {.loss = ampc_tensor_item(loss)};
    ampc_tensor **p;
    r.n = ampc_module_parameters(m, &p, NULL);
    r.grads = calloc((size_t)r.n, sizeof *r.grads);
    r.sizes = calloc((size_t)r.n, sizeof *r.sizes);
    for (int i = 0; i < r.n; i++) {
        ASSERT_NOT_NULL_MSG(ampc_tensor_grad(p[i]));
        r.grads[i] = tu_values(ampc_tensor_grad(p[i]));
        r.sizes[i] = ampc_tensor_numel(p[i]);
    }
    ampc_scope_end();
    ampc_module_free(m);
    return r;
}

static void free_result(run_result *r) {
    for (int i = 0; i < r->n; i++) free(r->grads[i]);
    free(r->grads);
    free(r->sizes);
}

/* Loss within rtol; each parameter's gradient within rtol in relative L2 norm. Norms, not
   elements: an activation within rounding of a ReLU's kink may land on either side of it in
   the two runs (measured: one of 32768 in a ResNet-18 layer), which moves single elements of
   small gradients (a BatchNorm bias: 3%) but a layer's gradient as a whole only by ~1/sqrt(n)
   of that; a layout mistake moves whole gradients by O(1). */
static void compare_models(const char *what, run_result *a, run_result *b, double rtol) {
    if (fabs(a->loss - b->loss) > rtol * fabs(b->loss)) fail_msg("%s: loss %.9g vs %.9g", what, a->loss, b->loss);
    assert_int_equal(a->n, b->n);
    for (int i = 0; i < a->n; i++) {
        double dd = 0, nn = 0;
        for (int64_t j = 0; j < b->sizes[i]; j++) {
            dd += (a->grads[i][j] - b->grads[i][j]) * (a->grads[i][j] - b->grads[i][j]);
            nn += b->grads[i][j] * b->grads[i][j];
        }
        if (!(sqrt(dd) <= rtol * sqrt(nn)))
            fail_msg("%s: gradient of parameter %d (%lld values) off by %.3g in relative L2 norm (allowed %.3g)", what, i,
                     (long long)b->sizes[i], sqrt(dd / nn), rtol);
    }
}

/* fp32: the formats differ in summation order inside the kernels, O(K * 2^-24) relative per
   layer (K up to 4608 here), and in ReLU kink flips (above: 1.5% of a 128-value BatchNorm
   bias gradient measured); 5% in norm covers both and is still far below a layout error's. */
static void test_models_fp32_match(void **state) {
    (void)state;
    struct { const char *name; int64_t xs[4]; bool training; } cases[] = {
        {"cnn", {4, 1, 28, 28}, false},        /* eval: dropout draws would follow storage order */
        {"resnet18", {4, 3, 16, 16}, true},    /* training: batch statistics */
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        run_result c = run_model(cases[k].name, AMPC_CONTIGUOUS_FORMAT, AMPC_DEVICE_CPU, false, cases[k].training, cases[k].xs, 10);
        run_result l = run_model(cases[k].name, AMPC_CHANNELS_LAST, AMPC_DEVICE_CPU, false, cases[k].training, cases[k].xs, 10);
        compare_models(cases[k].name, &l, &c, 5e-2);
        free_result(&c);
        free_result(&l);
    }
}

/* Relative L2 distance of parameter i's gradient in a from b's. */
static double grad_dist(const run_result *a, const run_result *b, int i) {
    double dd = 0, nn = 0;
    for (int64_t j = 0; j < b->sizes[i]; j++) {
        dd += (a->grads[i][j] - b->grads[i][j]) * (a->grads[i][j] - b->grads[i][j]);
        nn += b->grads[i][j] * b->grads[i][j];
    }
    return sqrt(dd / nn);
}

/* Autocast bf16: each layer rounds to bf16 (2^-8) where the kernel's summation order decides, and
   through 18 layers of a batch of 4 that moves the first layers' gradients far: against the fp64
   REF backend's exact gradient, conv1's is off by 0.36-0.41 in norm with every kernel (measured:
   AVX512-BF16 0.36, AMX 0.37, and AMX's channels-last 0.36). The two layouts agree bit for bit
   where oneDNN runs both through one computation (AVX512-BF16), but not on AMX, whose kernels for
   the two layouts round in other places: there they differ by up to 0.28. So each layout is held
   to the exact gradient, not to the other: channels-last's error is within 1.5x contiguous's
   (+0.02 for the smallest), measured 1.14 at worst; a layout mistake moves a whole gradient by
   O(1) (an error of ~1.4). And neither is farther than 0.6 from it. */
static void test_models_bf16_match(void **state) {
    (void)state;
    if (!ampc_dtype_supported(AMPC_DEVICE_CPU, AMPC_BF16)) {   /* AVX2 only: oneDNN has no bf16 kernels */
        print_message("skipped: no bf16 kernels on this CPU (%s)\n", ampc_cpu_features());
        return;
    }
    const int64_t xs[4] = {4, 3, 16, 16};
    run_result c = run_model("resnet18", AMPC_CONTIGUOUS_FORMAT, AMPC_DEVICE_CPU, true, true, xs, 10);
    run_result l = run_model("resnet18", AMPC_CHANNELS_LAST, AMPC_DEVICE_CPU, true, true, xs, 10);
    run_result r = run_model("resnet18", AMPC_CONTIGUOUS_FORMAT, AMPC_DEVICE_REF, false, true, xs, 10);
    assert_int_equal(c.n, r.n);
    assert_int_equal(l.n, r.n);
    for (int i = 0; i < r.n; i++) {
        double ec = grad_dist(&c, &r, i), el = grad_dist(&l, &r, i);
        if (!(ec <= 0.6 && el <= 0.6 && el <= 1.5 * ec + 0.02))
            fail_msg("resnet18 bf16: gradient of parameter %d (%lld values) off the fp64 reference by %.3g (channels-last) and %.3g "
                     "(contiguous)", i, (long long)r.sizes[i], el, ec);
    }
    free_result(&c);
    free_result(&l);
    free_result(&r);
}

/* REF has no channels-last kernels: every op converts, and the result is the contiguous one. */
static void test_ref_device_converts(void **state) {
    (void)state;
    const int64_t xs[4] = {2, 3, 8, 8};
    run_result c = run_model("resnet18", AMPC_CONTIGUOUS_FORMAT, AMPC_DEVICE_REF, false, true, xs, 10);
    run_result l = run_model("resnet18", AMPC_CHANNELS_LAST, AMPC_DEVICE_REF, false, true, xs, 10);
    compare_models("resnet18 ref", &l, &c, 1e-12);
    free_result(&c);
    free_result(&l);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_storage_order),
        cmocka_unit_test(test_trivial_conversion_shares_storage),
        cmocka_unit_test(test_conversion_errors),
        cmocka_unit_test(test_elementwise_keep_the_format),
        cmocka_unit_test(test_gradients_come_back_in_the_callers_format),
        cmocka_unit_test(test_other_ops_match_contiguous),
        cmocka_unit_test(test_dropout_channels_last),
        cmocka_unit_test(test_models_fp32_match),
        cmocka_unit_test(test_models_bf16_match),
        cmocka_unit_test(test_ref_device_converts),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
