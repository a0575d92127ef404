/*
 * test_autograd.c - the tape: shared subexpressions, accumulation across backward calls,
 * freeing saved tensors during backward, no-grad mode, errors. Values on the REF device (f64),
 * where the expected gradients are exact.
 */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static ampc_tensor *leaf(const double *v, int64_t n) {
    ampc_tensor *t = ampc_tensor_from_f64(AMPC_F64, 1, (int64_t[]){n}, v);
    ASSERT_NOT_NULL_MSG(t);
    ASSERT_OK(ampc_tensor_set_requires_grad(t, true));
    return t;
}

static void test_diamond_and_reuse(void **state) {
    (void)state;
    ampc_set_default_device(AMPC_DEVICE_REF);
    ampc_scope_begin();
    double v[4] = {-1.5, 0.25, 2, 3};
    ampc_tensor *x = leaf(v, 4);
    /* y = sum(x*x + x + x): d/dx = 2x + 2 (x used four times, through two paths) */
    ampc_tensor *y = ampc_sum(ampc_add(ampc_mul(x, x), ampc_add(x, x)), AMPC_ALL_DIMS, false);
    ASSERT_NOT_NULL_MSG(y);
    assert_string_equal(ampc_tensor_grad_fn_name(y), "SumBackward");
    ASSERT_OK(ampc_backward(y));
    double *g = tu_values(ampc_tensor_grad(x));
    for (int i = 0; i < 4; i++) assert_true(g[i] == 2 * v[i] + 2);
    free(g);
    /* a second graph accumulates into the same .grad */
    ASSERT_OK(ampc_backward(ampc_sum(ampc_mul_scalar(x, 3), AMPC_ALL_DIMS, false)));
    g = tu_values(ampc_tensor_grad(x));
    for (int i = 0; i < 4; i++) assert_true(g[i] == 2 * v[i] + 5);
    free(g);
    ampc_tensor_zero_grad(x);
    assert_null(ampc_tensor_grad(x));
    ampc_scope_end();
    ampc_set_default_device(AMPC_DEVICE_CPU);
}

static void test_second_backward_is_an_error(void **state) {
    (void)state;
    ampc_set_default_device(AMPC_DEVICE_REF);
    ampc_scope_begin();
    ampc_tensor *x = leaf((double[]){1, 2}, 2);
    ampc_tensor *y = ampc_sum(ampc_tanh(x), AMPC_ALL_DIMS, false);
    ASSERT_OK(ampc_backward(y));
    assert_true(ampc_backward(y) < 0);
    assert_non_null(strstr(ampc_last_error(), "second time"));
    ampc_clear_error();
    ampc_scope_end();
    ampc_set_default_device(AMPC_DEVICE_CPU);
}

static void test_no_grad_and_flags(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_rand(AMPC_F32, 1, (int64_t[]){3}, -1, 1);
    ampc_tensor_set_requires_grad(x, true);
    ampc_no_grad_enter();
    assert_false(ampc_grad_enabled());
    ampc_tensor *y = ampc_relu(x);
    assert_false(ampc_tensor_requires_grad(y));
    assert_null(ampc_tensor_grad_fn_name(y));
    ampc_no_grad_exit();
    assert_true(ampc_grad_enabled());
    ampc_tensor *z = ampc_relu(x);
    assert_true(ampc_tensor_requires_grad(z));
    assert_false(ampc_tensor_is_leaf(z));
    assert_true(ampc_tensor_set_requires_grad(z, false) < 0);   /* not a leaf */
    assert_non_null(strstr(ampc_last_error(), "leaf"));
    assert_true(ampc_backward(z) < 0);                          /* 3 elements, no gradient */
    assert_int_equal(ampc_last_status(), AMPC_ERR_SHAPE);
    ampc_tensor *d = ampc_tensor_detach(z);
    assert_false(ampc_tensor_requires_grad(d));
    assert_true(ampc_backward(ampc_sum(d, AMPC_ALL_DIMS, false)) < 0);   /* no history */
    /* an input that does not require grad gets none */
    ampc_tensor *c = ampc_tensor_rand(AMPC_F32, 1, (int64_t[]){3}, -1, 1);
    ASSERT_OK(ampc_backward(ampc_sum(ampc_mul(x, c), AMPC_ALL_DIMS, false)));
    assert_null(ampc_tensor_grad(c));
    assert_non_null(ampc_tensor_grad(x));
    ampc_clear_error();
    ampc_scope_end();
}

/* Intermediates referenced only by the graph are freed while backward runs, before the
   scope that made the loss ends. */
static void test_saved_tensors_freed_during_backward(void **state) {
    (void)state;
    const int64_t n = 1 << 16;   /* 256 KiB per f32 tensor */
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_rand(AMPC_F32, 1, &n, -1, 1);
    ampc_tensor_set_requires_grad(x, true);
    ampc_scope_begin();
    ampc_tensor *h = x;
    for (int i = 0; i < 8; i++) h = ampc_tanh(h);   /* each saves its output */
    ampc_tensor_keep(h);
    ampc_scope_end();   /* like a module's forward: only the graph holds the intermediates */
    ampc_tensor *loss = ampc_sum(h, AMPC_ALL_DIMS, false);
    size_t before = ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS];
    ASSERT_OK(ampc_backward(loss));
    size_t after = ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS];
    /* 7 intermediate outputs (h itself is still held by the scope) are gone */
    assert_true(before - after >= 7 * (size_t)n * 4);
    ampc_scope_end();
}

static ampc_tensor *op_reshape(ampc_tensor **in, const void *ctx) {
    (void)ctx;
    return ampc_mul(ampc_reshape(in[0], 3, (int64_t[]){2, -1, 3}), ampc_reshape(in[1], 2, (int64_t[]){4, 3}));
}
static ampc_tensor *op_flatten(ampc_tensor **in, const void *ctx) {
    (void)ctx;
    return ampc_tanh(ampc_flatten(in[0], 1, 2));
}
/* cast to the device's widest float and back: identity values, gradient through two casts */
static ampc_tensor *op_cast_roundtrip(ampc_tensor **in, const void *ctx) {
    (void)ctx;
    ampc_dtype wide = ampc_tensor_device(in[0]) == AMPC_DEVICE_REF ? AMPC_F64 : AMPC_F32;
    ampc_tensor *w = ampc_cast(in[0], wide);
    return ampc_cast(ampc_mul(w, w), ampc_tensor_dtype(in[0]));
}

static void test_shape_and_cast_ops(void **state) {
    (void)state;
    tu_op_case cases[] = {
        {.name = "reshape", .n_inputs = 2, .ndim = {2, 1}, .shape = {{6, 4}, {12}}, .lo = -2, .hi = 2, .fn = op_reshape, .k = 1},
        {.name = "flatten", .n_inputs = 1, .ndim = {4}, .shape = {{2, 3, 2, 5}}, .lo = -1, .hi = 1, .fn = op_flatten, .k = 1},
        {.name = "cast", .n_inputs = 1, .ndim = {2}, .shape = {{3, 7}}, .lo = -3, .hi = 3, .fn = op_cast_roundtrip, .k = 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) tu_check_op(&cases[i]);
}

/* An fp32 leaf cast to fp16 receives an fp32 gradient: the fp16 gradient cast back. */
static void test_cast_gradient_dtype(void **state) {
    (void)state;
    ampc_scope_begin();
    float v[3] = {0.1f, -1.7f, 3.3f};
    ampc_tensor *x = ampc_tensor_from_f32(AMPC_F32, 1, (int64_t[]){3}, v);
    ampc_tensor_set_requires_grad(x, true);
    ampc_tensor *h = ampc_cast(x, AMPC_F16);
    assert_int_equal(ampc_tensor_dtype(h), AMPC_F16);
    assert_string_equal(ampc_tensor_grad_fn_name(h), "CastBackward");
    ASSERT_OK(ampc_backward(ampc_sum(ampc_mul(h, h), AMPC_ALL_DIMS, false)));   /* d/dh = 2h in f16 */
    ampc_tensor *g = ampc_tensor_grad(x);
    assert_int_equal(ampc_tensor_dtype(g), AMPC_F32);
    float got[3];
    ampc_tensor_to_f32(g, got, 3);
    for (int i = 0; i < 3; i++) {
        float h16 = ampc_f16_to_f32(ampc_f32_to_f16(v[i]));
        assert_true(got[i] == ampc_f16_to_f32(ampc_f32_to_f16(2 * h16)));
    }
    ampc_scope_end();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_diamond_and_reuse),
        cmocka_unit_test(test_second_backward_is_an_error),
        cmocka_unit_test(test_no_grad_and_flags),
        cmocka_unit_test(test_saved_tensors_freed_during_backward),
        cmocka_unit_test(test_shape_and_cast_ops),
        cmocka_unit_test(test_cast_gradient_dtype),
    };
    return cmocka_run_group_tests_name("autograd", tests, tu_group_setup, tu_group_teardown);
}
