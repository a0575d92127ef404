/*
 * test_door.c - the door to the kernels (src/backend/dispatch.c) refuses bad arguments of the
 * elementwise, softmax, cross-entropy, dropout, layer-norm, GradScaler, optimizer and gemm
 * kernels once for every device, with the status that names the problem, before any kernel
 * runs (the kernels no longer check). Each case runs on the CPU and on REF; each call is
 * also one a kernel without the door's checks would run out of bounds or silently wrong on.
 * The pooling, convolution and batch-norm families have theirs in test_pool, test_conv and
 * test_norm.
 */
#include "testutil.h"

#include <string.h>

#include "backend/backend.h"

#define REFUSED(expr, status, text)                                                                \
    do {                                                                                           \
        assert_int_equal((expr), (status));                                                        \
        if (!strstr(ampc_last_error(), (text))) fail_msg("%s: \"%s\" lacks \"%s\"", #expr, ampc_last_error(), (text)); \
        ampc_clear_error();                                                                        \
    } while (0)

static const ampc_device devs[] = {AMPC_DEVICE_CPU, AMPC_DEVICE_REF};

/* A tensor of the device's float dtype (f32 on the CPU, f64 on REF), or of dtype dt. */
static ampc_tensor *t_on(ampc_device dev, int ndim, const int64_t *shape) {
    ampc_dtype dt = dev == AMPC_DEVICE_REF ? AMPC_F64 : AMPC_F32;
    return ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, ndim, shape), dev, dt);
}
static ampc_tensor *t_as(ampc_device dev, ampc_dtype dt, int ndim, const int64_t *shape) {
    return ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, ndim, shape), dev, dt);
}

static void test_elementwise_door(void **state) {
    (void)state;
    for (int k = 0; k < 2; k++) {
        ampc_scope_begin();
        ampc_device dev = devs[k];
        ampc_tensor *a = t_on(dev, 2, (int64_t[]){3, 4}), *b = t_on(dev, 2, (int64_t[]){3, 5});
        ampc_tensor *row = t_on(dev, 1, (int64_t[]){4}), *ia = t_as(dev, AMPC_I64, 2, (int64_t[]){3, 4});
        ampc_tensor *other = dev == AMPC_DEVICE_REF ? t_on(AMPC_DEVICE_CPU, 2, (int64_t[]){3, 4}) : t_as(dev, AMPC_BF16, 2, (int64_t[]){3, 4});
        ampc_tensor *cl = ampc_tensor_to(ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){1, 3, 2, 2}), dev, a->dtype);
        ampc_tensor *cl2 = cl ? ampc__k_convert(cl, cl->dtype, AMPC_CHANNELS_LAST) : NULL;
        ampc_tensor *nchw = t_on(dev, 4, (int64_t[]){1, 3, 2, 2});
        ASSERT_NOT_NULL_MSG(a && b && row && ia && other && cl && cl2 && nchw);
        /* unary: an op of another kind, sizes, an i64 tensor other than add_scalar's counter */
        REFUSED(ampc__k_unary_into(AMPC_OP_SOFTMAX, a, a, 0), AMPC_ERR_UNSUPPORTED, "no kernel for softmax");
        REFUSED(ampc__k_unary_into(AMPC_OP_RELU, a, b, 0), AMPC_ERR_SHAPE, "y has 15 elements, expected 12");
        REFUSED(ampc__k_unary_into(AMPC_OP_RELU, ia, ia, 0), AMPC_ERR_DTYPE, "x is i64");
        ASSERT_OK(ampc__k_unary_into(AMPC_OP_ADD_SCALAR, ia, ia, 2));   /* the counter, on every device */
        assert_int_equal(((const int64_t *)ampc__data(ia))[11], 2);
        /* a channels-last tensor walked with one in another order */
        REFUSED(ampc__k_unary_into(AMPC_OP_RELU, cl2, nchw, 0), AMPC_ERR_INVALID, "channels-last");
        /* unary_backward: the saved tensor its op reads missing */
        REFUSED(ampc__k_unary_backward(AMPC_OP_TANH, a, NULL, a, 0) ? AMPC_OK : ampc_last_status(), AMPC_ERR_INVALID,
                "needs its saved output");
        /* binary: shapes that do not broadcast, mixed dtypes or devices, an op of another kind */
        REFUSED(ampc__k_binary_into(AMPC_OP_ADD, a, b, a), AMPC_ERR_SHAPE, "does not broadcast");
        REFUSED(ampc__k_binary_into(AMPC_OP_ADD, a, other, a), dev == AMPC_DEVICE_REF ? AMPC_ERR_INVALID : AMPC_ERR_DTYPE,
                dev == AMPC_DEVICE_REF ? "b on cpu, out on ref" : "b is bf16, expected f32");
        REFUSED(ampc__k_binary_into(AMPC_OP_RELU, a, a, a), AMPC_ERR_UNSUPPORTED, "no kernel for relu");
        ASSERT_OK(ampc__k_binary_into(AMPC_OP_ADD, a, row, a));   /* (4) broadcasts to (3, 4) */
        REFUSED(ampc__k_binary_into(AMPC_OP_ADD, cl2, nchw, cl2), AMPC_ERR_INVALID, "channels-last");
        /* sum_to into a shape x does not reduce to, or into a third dtype */
        REFUSED(ampc__k_sum_to(a, 1, (int64_t[]){3}, 1.0) ? AMPC_OK : ampc_last_status(), AMPC_ERR_SHAPE, "does not broadcast");
        REFUSED(ampc__k_sum_to_as(a, AMPC_I64, 1, (int64_t[]){4}, 1.0) ? AMPC_OK : ampc_last_status(), AMPC_ERR_DTYPE, "out is i64");
        REFUSED(ampc__k_expand(a, 1, (int64_t[]){12}, 1.0) ? AMPC_OK : ampc_last_status(), AMPC_ERR_SHAPE, "does not broadcast");
        /* permute: y of the unpermuted shape, dims that are no permutation */
        REFUSED(ampc__k_permute(a, (const int[]){1, 0}, a), AMPC_ERR_SHAPE, "y's dim 0 is not x's dim 1");
        REFUSED(ampc__k_permute(a, (const int[]){0, 0}, a), AMPC_ERR_INVALID, "not a permutation");
        ampc_scope_end();
    }
}

static void test_loss_door(void **state) {
    (void)state;
    for (int k = 0; k < 2; k++) {
        ampc_scope_begin();
        ampc_device dev = devs[k];
        ampc_tensor *x = t_on(dev, 2, (int64_t[]){3, 4}), *y = t_on(dev, 2, (int64_t[]){3, 4}), *small = t_on(dev, 1, (int64_t[]){11});
        ampc_tensor *tg = t_as(dev, AMPC_I64, 1, (int64_t[]){3}), *ftg = t_on(dev, 1, (int64_t[]){3});
        ampc_tensor *tg4 = t_as(dev, AMPC_I64, 1, (int64_t[]){4}), *one = t_on(dev, 1, (int64_t[]){1});
        ampc_tensor *i64 = t_as(dev, AMPC_I64, 2, (int64_t[]){3, 4});
        ASSERT_NOT_NULL_MSG(x && y && small && tg && ftg && tg4 && one && i64);
        /* softmax: an axis that does not cover x, an output of another size */
        REFUSED(ampc__k_softmax(x, y, (ampc_axis_desc){3, 5, 1}, false), AMPC_ERR_SHAPE, "does not cover 12 elements");
        REFUSED(ampc__k_softmax(x, small, (ampc_axis_desc){3, 4, 1}, false), AMPC_ERR_SHAPE, "y has 11 elements");
        REFUSED(ampc__k_softmax_backward(y, x, i64, (ampc_axis_desc){3, 4, 1}, true), AMPC_ERR_DTYPE, "gx is i64");
        /* cross-entropy: targets not i64 or of another length, an output of the wrong size */
        ampc_cross_entropy_options o = {.reduction = AMPC_REDUCTION_MEAN, .ignore_index = -100};
        double w;
        REFUSED(ampc__k_cross_entropy(x, ftg, &o, one, &w), AMPC_ERR_DTYPE, "targets is");
        REFUSED(ampc__k_cross_entropy(x, tg4, &o, one, &w), AMPC_ERR_SHAPE, "targets has 4 elements, expected 3");
        REFUSED(ampc__k_cross_entropy(x, tg, &o, ftg, &w), AMPC_ERR_SHAPE, "out has 3 elements, expected 1");
        REFUSED(ampc__k_cross_entropy_backward(x, tg, one, &o, 3, small), AMPC_ERR_SHAPE, "gx has 11 elements");
        /* the targets' values stay the kernels' (where they can read them) */
        ((int64_t *)ampc__data(tg))[1] = 4;
        REFUSED(ampc__k_cross_entropy(x, tg, &o, one, &w), AMPC_ERR_INVALID, "out of range");
        /* dropout: no mask, a probability outside [0, 1], sizes */
        uint8_t mask[12];
        ampc_rng_state rng = {0};
        REFUSED(ampc__k_dropout(x, y, NULL, 0.5, rng), AMPC_ERR_INVALID, "no mask");
        REFUSED(ampc__k_dropout(x, y, mask, 1.5, rng), AMPC_ERR_INVALID, "outside [0, 1]");
        REFUSED(ampc__k_dropout_backward(x, mask, 0.5, small), AMPC_ERR_SHAPE, "y has 11 elements");
        ampc_scope_end();
    }
}

static void test_layer_norm_door(void **state) {
    (void)state;
    for (int k = 0; k < 2; k++) {
        ampc_scope_begin();
        ampc_device dev = devs[k];
        ampc_dtype sdt = dev == AMPC_DEVICE_REF ? AMPC_F64 : AMPC_F32;
        ampc_tensor *x = t_on(dev, 2, (int64_t[]){3, 4}), *y = t_on(dev, 2, (int64_t[]){3, 4});
        ampc_tensor *mean = t_as(dev, sdt, 1, (int64_t[]){3}), *rstd = t_as(dev, sdt, 1, (int64_t[]){3});
        ampc_tensor *mean5 = t_as(dev, sdt, 1, (int64_t[]){5}), *w3 = t_on(dev, 1, (int64_t[]){3});
        ampc_tensor *wrong = t_as(dev, dev == AMPC_DEVICE_REF ? AMPC_I64 : AMPC_BF16, 1, (int64_t[]){3});
        ASSERT_NOT_NULL_MSG(x && y && mean && rstd && mean5 && w3 && wrong);
        REFUSED(ampc__k_layer_norm(x, NULL, NULL, y, NULL, rstd, 1e-5), AMPC_ERR_INVALID, "mean missing");
        REFUSED(ampc__k_layer_norm(x, NULL, NULL, y, mean5, NULL, 1e-5), AMPC_ERR_SHAPE, "12 elements do not make 5 rows");
        REFUSED(ampc__k_layer_norm(x, w3, NULL, y, mean, rstd, 1e-5), AMPC_ERR_SHAPE, "weight has 3 elements, expected 4");
        REFUSED(ampc__k_layer_norm(x, NULL, NULL, y, mean, wrong, 1e-5), AMPC_ERR_DTYPE, "rstd is");
        REFUSED(ampc__k_layer_norm_backward(x, y, NULL, mean, NULL, y, NULL, NULL), AMPC_ERR_INVALID, "rstd missing");
        ASSERT_OK(ampc__k_layer_norm(x, NULL, NULL, y, mean, rstd, 1e-5));
        ampc_scope_end();
    }
}

static void test_gemm_optim_door(void **state) {
    (void)state;
    for (int k = 0; k < 2; k++) {
        ampc_scope_begin();
        ampc_device dev = devs[k];
        ampc_tensor *a = t_on(dev, 2, (int64_t[]){2, 3}), *b = t_on(dev, 2, (int64_t[]){3, 2}), *c = t_on(dev, 2, (int64_t[]){2, 2});
        ampc_tensor *i64 = t_as(dev, AMPC_I64, 2, (int64_t[]){2, 2});
        ASSERT_NOT_NULL_MSG(a && b && c && i64);
        ampc_gemm_desc d = {.batch = 1, .M = 2, .N = 2, .K = 3};
        ampc_gemm_desc neg = d, big = d;
        neg.K = -1;
        big.M = 3;
        REFUSED(ampc__k_gemm_as(&neg, a, b, NULL, a->dtype, 2, (int64_t[]){2, 2}) ? AMPC_OK : ampc_last_status(), AMPC_ERR_INVALID,
                "negative size");
        REFUSED(ampc__k_gemm_as(&big, a, b, NULL, a->dtype, 2, (int64_t[]){2, 2}) ? AMPC_OK : ampc_last_status(), AMPC_ERR_INVALID,
                "smaller than the descriptor");
        REFUSED(ampc__k_gemm_as(&d, a, b, NULL, AMPC_I64, 2, (int64_t[]){2, 2}) ? AMPC_OK : ampc_last_status(), AMPC_ERR_DTYPE,
                "c is i64");
        /* optimizers: a state of another size, parameters on two devices; nothing is written */
        ampc_tensor *p = t_on(dev, 1, (int64_t[]){4}), *g = t_on(dev, 1, (int64_t[]){4}), *m = t_on(dev, 1, (int64_t[]){3});
        ampc_tensor *q = t_on(dev == AMPC_DEVICE_REF ? AMPC_DEVICE_CPU : AMPC_DEVICE_REF, 1, (int64_t[]){4});
        ASSERT_NOT_NULL_MSG(p && g && m && q);
        ASSERT_OK(ampc__device(g->device)->fill(g, 1.0));
        ampc_sgd_hparams h = {.lr = 0.1, .momentum = 0.9};
        ampc_optim_item it[2] = {{.param = p, .grad = g, .state = {m}, .first = true}, {.param = q, .grad = q, .first = true}};
        REFUSED(ampc__k_sgd_step(it, 1, &h), AMPC_ERR_SHAPE, "state 0 has 3 elements, expected 4");
        it[0].state[0] = ampc__tensor_like(p, p->dtype);
        h.momentum = 0;
        REFUSED(ampc__k_sgd_step(it, 2, &h), AMPC_ERR_INVALID, "parameter on");
        double s;
        ASSERT_OK(ampc__k_sum_squares(p, &s));
        assert_true(s == 0.0);   /* the valid first item was not updated either */
        /* the GradScaler's pass: an i64 gradient */
        ampc_tensor *grads[2] = {g, i64};
        float found = 0;
        REFUSED(ampc__k_unscale_check(grads, 2, 0.5f, &found), AMPC_ERR_DTYPE, "a gradient is i64");
        REFUSED(ampc__k_sum_squares(i64, &s), AMPC_ERR_DTYPE, "t is i64");
        ampc_scope_end();
    }
}

/* An unknown device is refused by name, never taken for the CPU. */
static void test_unknown_device(void **state) {
    (void)state;
    assert_false(ampc__backend_supports(AMPC_K_unary, AMPC_F32, (ampc_device)AMPC_DEVICE_COUNT));
    REFUSED(ampc__backend_check(AMPC_K_unary, AMPC_F32, (ampc_device)(AMPC_DEVICE_COUNT + 3)), AMPC_ERR_INVALID, "unknown device");
}

/* Which ops the unary and binary kernels run is the op table's kind column, and the door reads
   it: every op of kind UNARY has a unary kernel on both devices, every other op is refused. */
static void test_kind_column(void **state) {
    (void)state;
    int unary = 0, binary = 0;
    for (int k = 0; k < 2; k++) {
        ampc_scope_begin();
        ampc_tensor *x = t_on(devs[k], 1, (int64_t[]){4});
        ASSERT_NOT_NULL_MSG(x);
        ASSERT_OK(ampc__device(x->device)->fill(x, 0.5));
        for (int op = 0; op < AMPC_OP_COUNT; op++) {
            ampc_op_kind kind = ampc_op_kind_of((ampc_op)op);
            int rc = ampc__k_unary_into((ampc_op)op, x, x, 1.0);
            assert_int_equal(rc, kind == AMPC_KIND_UNARY ? AMPC_OK : AMPC_ERR_UNSUPPORTED);
            ASSERT_OK(ampc__device(x->device)->fill(x, 0.5));
            rc = ampc__k_binary_into((ampc_op)op, x, x, x);
            assert_int_equal(rc, kind == AMPC_KIND_BINARY ? AMPC_OK : AMPC_ERR_UNSUPPORTED);
            ASSERT_OK(ampc__device(x->device)->fill(x, 0.5));
            unary += k == 0 && kind == AMPC_KIND_UNARY;
            binary += k == 0 && kind == AMPC_KIND_BINARY;
        }
        ampc_clear_error();
        ampc_scope_end();
    }
    assert_int_equal(unary, 11);   /* relu gelu gelu_tanh tanh sigmoid exp log pow mul_scalar add_scalar silu */
    assert_int_equal(binary, 3);   /* add sub mul */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_elementwise_door), cmocka_unit_test(test_loss_door),     cmocka_unit_test(test_layer_norm_door),
        cmocka_unit_test(test_gemm_optim_door),  cmocka_unit_test(test_unknown_device), cmocka_unit_test(test_kind_column),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
