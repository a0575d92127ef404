/*
 * test_ops.c - elementwise ops, broadcasting binary ops, sum and mean: every op through the
 * op-check table (finite differences on REF in f64, then CPU f32/f16/bf16 forward and
 * backward against REF), plus errors, type promotion, large threaded tensors, in-place
 * aliasing, what each op saves for backward, the bits of the bf16 register path (widen,
 * compute in f32, round once, for every bf16 input), sum_to of 16-bit x into f32, and the door
 * to the kernels (unknown devices, kernels a table lacks, ampc__backend_supports).
 */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/cpu/cpu.h"
#include "ops/ops.h"

// ---------------------------------------------------------------------------------------------
// The op table

typedef struct {
    ampc_tensor *(*unary)(ampc_tensor *);
    ampc_tensor *(*binary)(ampc_tensor *, ampc_tensor *);
    ampc_tensor *(*scalar)(ampc_tensor *, double);
    ampc_tensor *(*reduce)(ampc_tensor *, int, bool);
    double s;
    int dim;
    bool keepdim;
} op_ctx;

static ampc_tensor *call_op(ampc_tensor **in, const void *ctx) {
    const op_ctx *c = ctx;
    if (c->unary) return c->unary(in[0]);
    if (c->binary) return c->binary(in[0], in[1]);
    if (c->scalar) return c->scalar(in[0], c->s);
    return c->reduce(in[0], c->dim, c->keepdim);
}

#define UNPAREN(...) __VA_ARGS__
#define NDIM(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t))
#define CTX(...) .fn = call_op, .ctx = &(const op_ctx){__VA_ARGS__}

/* one input of shape sh (parenthesized) */
#define UN(nm, sh, lo_, hi_, av, k_, ...)                                                          \
    {.name = nm, .n_inputs = 1, .ndim = {NDIM sh}, .shape = {{UNPAREN sh}}, .lo = lo_, .hi = hi_,  \
     .avoid = av, .k = k_, CTX(__VA_ARGS__)}
/* two inputs; kb: the longest sum in the gradients (the broadcast factor) */
#define BIN(nm, sa, sb, kb, f)                                                                     \
    {.name = nm, .n_inputs = 2, .ndim = {NDIM sa, NDIM sb}, .shape = {{UNPAREN sa}, {UNPAREN sb}}, \
     .lo = -1, .hi = 1, .k = 1, .k_backward = kb, CTX(.binary = f)}
#define RED(nm, sh, f, d, kd, k_) UN(nm, sh, -1, 1, 0, k_, .reduce = f, .dim = d, .keepdim = kd)

/* Ranges: relu avoids its kink at 0; log and pow get positive inputs. tanh and sigmoid stay
   where |y| is away from 1: their derivatives 1 - y^2 and y (1 - y) are computed, like
   PyTorch, from the output saved in the tensor's dtype, and lose relative accuracy (by the
   condition number 2y^2 / (1 - y^2)) where they cancel, which the derived tolerance does not
   model. */
static const tu_op_case unary_cases[] = {
    UN("relu (1,)", (1), -2, 2, 0.05, 1, .unary = ampc_relu),
    UN("relu (3,5,7)", (3, 5, 7), -2, 2, 0.05, 1, .unary = ampc_relu),
    UN("relu (30,50)", (30, 50), -2, 2, 0.05, 1, .unary = ampc_relu),
    UN("gelu (1,)", (1), -3, 3, 0, 1, .unary = ampc_gelu),
    UN("gelu (3,5,7)", (3, 5, 7), -3, 3, 0, 1, .unary = ampc_gelu),
    UN("gelu (30,50)", (30, 50), -3, 3, 0, 1, .unary = ampc_gelu),
    UN("gelu_tanh (1,)", (1), -3, 3, 0, 1, .unary = ampc_gelu_tanh),
    UN("gelu_tanh (3,5,7)", (3, 5, 7), -3, 3, 0, 1, .unary = ampc_gelu_tanh),
    UN("gelu_tanh (30,50)", (30, 50), -3, 3, 0, 1, .unary = ampc_gelu_tanh),
    UN("silu (1,)", (1), -4, 4, 0, 1, .unary = ampc_silu),
    UN("silu (3,5,7)", (3, 5, 7), -4, 4, 0, 1, .unary = ampc_silu),
    UN("silu (30,50)", (30, 50), -4, 4, 0, 1, .unary = ampc_silu),
    UN("tanh (1,)", (1), -1, 1, 0, 1, .unary = ampc_tanh),
    UN("tanh (3,5,7)", (3, 5, 7), -1, 1, 0, 1, .unary = ampc_tanh),
    UN("tanh (30,50)", (30, 50), -1, 1, 0, 1, .unary = ampc_tanh),
    UN("sigmoid (1,)", (1), -1.5, 1.5, 0, 1, .unary = ampc_sigmoid),
    UN("sigmoid (3,5,7)", (3, 5, 7), -1.5, 1.5, 0, 1, .unary = ampc_sigmoid),
    UN("sigmoid (30,50)", (30, 50), -1.5, 1.5, 0, 1, .unary = ampc_sigmoid),
    UN("exp (1,)", (1), -3, 3, 0, 1, .unary = ampc_exp),
    UN("exp (3,5,7)", (3, 5, 7), -3, 3, 0, 1, .unary = ampc_exp),
    UN("exp (30,50)", (30, 50), -3, 3, 0, 1, .unary = ampc_exp),
    UN("log (1,)", (1), 0.1, 5, 0, 1, .unary = ampc_log),
    UN("log (3,5,7)", (3, 5, 7), 0.1, 5, 0, 1, .unary = ampc_log),
    UN("log (30,50)", (30, 50), 0.1, 5, 0, 1, .unary = ampc_log),
    UN("pow 2 (3,5,7)", (3, 5, 7), 0.2, 3, 0, 1, .scalar = ampc_pow, .s = 2),
    UN("pow 0.5 (3,5,7)", (3, 5, 7), 0.2, 3, 0, 1, .scalar = ampc_pow, .s = 0.5),
    UN("pow -1.5 (2,3)", (2, 3), 0.2, 3, 0, 1, .scalar = ampc_pow, .s = -1.5),
    UN("pow 3 (1,)", (1), 0.2, 3, 0, 1, .scalar = ampc_pow, .s = 3),
    UN("pow 3 (30,50)", (30, 50), 0.2, 3, 0, 1, .scalar = ampc_pow, .s = 3),
    UN("add_scalar (1,)", (1), -1, 1, 0, 1, .scalar = ampc_add_scalar, .s = 0.75),
    UN("add_scalar (3,5,7)", (3, 5, 7), -1, 1, 0, 1, .scalar = ampc_add_scalar, .s = 0.75),
    UN("add_scalar (30,50)", (30, 50), -1, 1, 0, 1, .scalar = ampc_add_scalar, .s = -2.5),
    UN("mul_scalar (1,)", (1), -1, 1, 0, 1, .scalar = ampc_mul_scalar, .s = -1.5),
    UN("mul_scalar (3,5,7)", (3, 5, 7), -1, 1, 0, 1, .scalar = ampc_mul_scalar, .s = -1.5),
    UN("mul_scalar (30,50)", (30, 50), -1, 1, 0, 1, .scalar = ampc_mul_scalar, .s = 0.1),
};

#define BIN3(nm, sa, sb, kb)                                                                       \
    BIN("add " nm, sa, sb, kb, ampc_add), BIN("sub " nm, sa, sb, kb, ampc_sub), BIN("mul " nm, sa, sb, kb, ampc_mul)

static const tu_op_case binary_cases[] = {
    BIN3("(1,)+(1,)", (1), (1), 1),
    BIN3("(3,5,7)+(3,5,7)", (3, 5, 7), (3, 5, 7), 1),
    BIN3("(4,1,3)+(5,3)", (4, 1, 3), (5, 3), 5),
    BIN3("(2,3)+(3,)", (2, 3), (3), 2),
    BIN3("(1,)+(2,3)", (1), (2, 3), 6),
    BIN3("(2,3)+(1,)", (2, 3), (1), 6),
    BIN3("(3,1)+(3,4)", (3, 1), (3, 4), 4),
    BIN3("(5,1)+(4,5,3)", (5, 1), (4, 5, 3), 12),
    BIN3("(300,7)+(7,)", (300, 7), (7), 300),      /* bias with a tiled row, many chunks */
    BIN3("(7,)+(300,7)", (7), (300, 7), 300),
    BIN3("(3,1100)+(1100,)", (3, 1100), (1100), 3), /* bias rows longer than a chunk */
    BIN3("(30,50)+(30,50)", (30, 50), (30, 50), 1),
    /* broadcast rows of >= 64 values (the register path): one value per row, or a row vector */
    BIN3("(2,3,8,8)+(3,1,1)", (2, 3, 8, 8), (3, 1, 1), 128),   /* per channel */
    BIN3("(3,1,1)+(2,3,8,8)", (3, 1, 1), (2, 3, 8, 8), 128),
    BIN3("(5,70)+(5,1)", (5, 70), (5, 1), 70),
    BIN3("(4,96)+(96,)", (4, 96), (96), 4),
};

static const tu_op_case reduce_cases[] = {
    RED("sum all (1,)", (1), ampc_sum, AMPC_ALL_DIMS, false, 1),
    RED("sum all (3,5,7)", (3, 5, 7), ampc_sum, AMPC_ALL_DIMS, false, 105),
    RED("sum all keepdim (3,5,7)", (3, 5, 7), ampc_sum, AMPC_ALL_DIMS, true, 105),
    RED("sum dim 0 (3,5,7)", (3, 5, 7), ampc_sum, 0, false, 3),
    RED("sum dim 0 keepdim (3,5,7)", (3, 5, 7), ampc_sum, 0, true, 3),
    RED("sum dim 1 (3,5,7)", (3, 5, 7), ampc_sum, 1, false, 5),
    RED("sum dim 1 keepdim (3,5,7)", (3, 5, 7), ampc_sum, 1, true, 5),
    RED("sum dim 2 (3,5,7)", (3, 5, 7), ampc_sum, 2, false, 7),
    RED("sum dim -1 keepdim (3,5,7)", (3, 5, 7), ampc_sum, -1, true, 7),
    RED("sum dim 0 (1,)", (1), ampc_sum, 0, false, 1),
    RED("sum dim 0 (300,8)", (300, 8), ampc_sum, 0, false, 300),
    RED("sum dim 1 (500,7)", (500, 7), ampc_sum, 1, false, 7),
    RED("sum dim 1 (3,1500)", (3, 1500), ampc_sum, 1, true, 1500),
    RED("mean all (1,)", (1), ampc_mean, AMPC_ALL_DIMS, false, 1),
    RED("mean all (3,5,7)", (3, 5, 7), ampc_mean, AMPC_ALL_DIMS, false, 105),
    RED("mean all keepdim (3,5,7)", (3, 5, 7), ampc_mean, AMPC_ALL_DIMS, true, 105),
    RED("mean dim 0 (3,5,7)", (3, 5, 7), ampc_mean, 0, false, 3),
    RED("mean dim 0 keepdim (3,5,7)", (3, 5, 7), ampc_mean, 0, true, 3),
    RED("mean dim 1 (3,5,7)", (3, 5, 7), ampc_mean, 1, false, 5),
    RED("mean dim 1 keepdim (3,5,7)", (3, 5, 7), ampc_mean, 1, true, 5),
    RED("mean dim 2 (3,5,7)", (3, 5, 7), ampc_mean, 2, false, 7),
    RED("mean dim -1 keepdim (3,5,7)", (3, 5, 7), ampc_mean, -1, true, 7),
    RED("mean dim 0 (300,8)", (300, 8), ampc_mean, 0, true, 300),
};

/* Too large for finite differences (2 evaluations per input element): CPU against REF only.
   They reach the blocked reduction paths (partial sums of RBLK-element blocks). */
static const tu_op_case big_reduce_cases[] = {
    {.name = "sum dim 1 (3,300,600)", .n_inputs = 1, .ndim = {3}, .shape = {{3, 300, 600}}, .lo = -1, .hi = 1,
     .k = 300, .skip_fd = true, CTX(.reduce = ampc_sum, .dim = 1)},
    {.name = "mean dim 0 (200,3000)", .n_inputs = 1, .ndim = {2}, .shape = {{200, 3000}}, .lo = -1, .hi = 1,
     .k = 200, .skip_fd = true, CTX(.reduce = ampc_mean, .dim = 0)},
    {.name = "sum dim 1 (2,70000)", .n_inputs = 1, .ndim = {2}, .shape = {{2, 70000}}, .lo = -1, .hi = 1,
     .k = 70000, .skip_fd = true, CTX(.reduce = ampc_sum, .dim = 1)},
};

static void run_cases(const tu_op_case *cases, size_t n) {
    for (size_t i = 0; i < n; i++) tu_check_op(&cases[i]);
}

static void test_unary_ops(void **state) {
    (void)state;
    run_cases(unary_cases, sizeof unary_cases / sizeof *unary_cases);
}

static void test_binary_ops(void **state) {
    (void)state;
    run_cases(binary_cases, sizeof binary_cases / sizeof *binary_cases);
}

static void test_reductions(void **state) {
    (void)state;
    run_cases(reduce_cases, sizeof reduce_cases / sizeof *reduce_cases);
    run_cases(big_reduce_cases, sizeof big_reduce_cases / sizeof *big_reduce_cases);
}

// ---------------------------------------------------------------------------------------------
// Shapes, names, errors

static void test_output_shapes_and_names(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_rand(AMPC_F32, 3, (int64_t[]){3, 5, 7}, -1, 1);
    ampc_tensor_set_requires_grad(x, true);
    ampc_tensor *s = ampc_sum(x, 1, false);
    assert_int_equal(ampc_tensor_ndim(s), 2);
    assert_int_equal(ampc_tensor_dim(s, 0), 3);
    assert_int_equal(ampc_tensor_dim(s, 1), 7);
    assert_string_equal(ampc_tensor_grad_fn_name(s), "SumBackward");
    ampc_tensor *all = ampc_mean(x, AMPC_ALL_DIMS, false);
    assert_int_equal(ampc_tensor_ndim(all), 0);
    assert_string_equal(ampc_tensor_grad_fn_name(all), "MeanBackward");
    ampc_tensor *allk = ampc_sum(x, AMPC_ALL_DIMS, true);
    assert_int_equal(ampc_tensor_ndim(allk), 3);
    assert_int_equal(ampc_tensor_numel(allk), 1);
    ampc_tensor *again = ampc_sum(all, 0, false);   /* a 0-d tensor reduces over its one dim */
    ASSERT_NOT_NULL_MSG(again);
    assert_int_equal(ampc_tensor_ndim(again), 0);

    ampc_tensor *b = ampc_tensor_rand(AMPC_F32, 1, (int64_t[]){7}, -1, 1);
    struct { ampc_tensor *t; const char *name; } expect[] = {
        {ampc_add(x, b), "AddBackward"}, {ampc_sub(x, b), "SubBackward"}, {ampc_mul(x, b), "MulBackward"},
        {ampc_add_scalar(x, 1), "AddBackward"}, {ampc_mul_scalar(x, 2), "MulBackward"},
        {ampc_relu(x), "ReluBackward"}, {ampc_gelu(x), "GeluBackward"}, {ampc_gelu_tanh(x), "GeluBackward"}, {ampc_silu(x), "SiluBackward"}, {ampc_tanh(x), "TanhBackward"},
        {ampc_sigmoid(x), "SigmoidBackward"}, {ampc_exp(x), "ExpBackward"}, {ampc_log(ampc_exp(x)), "LogBackward"},
        {ampc_pow(ampc_exp(x), 2), "PowBackward"},
    };
    for (size_t i = 0; i < sizeof expect / sizeof *expect; i++) {
        ASSERT_NOT_NULL_MSG(expect[i].t);
        assert_string_equal(ampc_tensor_grad_fn_name(expect[i].t), expect[i].name);
    }
    assert_int_equal(ampc_tensor_ndim(expect[0].t), 3);
    /* every op of the table names its backward node there */
    for (int op = 0; op < AMPC_OP_COUNT; op++) {
        const char *g = ampc_op_grad_fn((ampc_op)op);
        assert_true(strlen(g) > 8 && !strcmp(g + strlen(g) - 8, "Backward"));
    }
    assert_string_equal(ampc_op_grad_fn(AMPC_OP_COUNT), "?");
    /* no history without grad */
    ampc_no_grad_enter();
    assert_null(ampc_tensor_grad_fn_name(ampc_relu(x)));
    ampc_no_grad_exit();
    ampc_scope_end();
}

static void test_errors(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *a = ampc_tensor_rand(AMPC_F32, 2, (int64_t[]){2, 3}, -1, 1);
    ampc_tensor *b = ampc_tensor_rand(AMPC_F32, 1, (int64_t[]){4}, -1, 1);
    ampc_tensor *lab = ampc_tensor_from_i64(1, (int64_t[]){3}, (int64_t[]){0, 1, 2});

    assert_null(ampc_add(a, b));
    assert_int_equal(ampc_last_status(), AMPC_ERR_SHAPE);
    assert_non_null(strstr(ampc_last_error(), "(2, 3)"));
    assert_non_null(strstr(ampc_last_error(), "(4,)"));
    assert_null(ampc_mul(b, a));
    assert_int_equal(ampc_last_status(), AMPC_ERR_SHAPE);

    ampc_tensor *(*binaries[])(ampc_tensor *, ampc_tensor *) = {ampc_add, ampc_sub, ampc_mul};
    for (int i = 0; i < 3; i++) {
        ampc_clear_error();
        assert_null(binaries[i](a, lab));
        assert_int_equal(ampc_last_status(), AMPC_ERR_DTYPE);
        assert_non_null(strstr(ampc_last_error(), "i64"));
    }
    ampc_tensor *(*unaries[])(ampc_tensor *) = {ampc_relu, ampc_gelu, ampc_tanh, ampc_sigmoid, ampc_exp, ampc_log, ampc_silu, ampc_gelu_tanh};
    for (int i = 0; i < 8; i++) {
        ampc_clear_error();
        assert_null(unaries[i](lab));
        assert_int_equal(ampc_last_status(), AMPC_ERR_DTYPE);
    }
    ampc_clear_error();
    assert_null(ampc_pow(lab, 2));
    assert_int_equal(ampc_last_status(), AMPC_ERR_DTYPE);
    assert_null(ampc_add_scalar(lab, 2));
    assert_int_equal(ampc_last_status(), AMPC_ERR_DTYPE);
    assert_null(ampc_sum(lab, AMPC_ALL_DIMS, false));
    assert_int_equal(ampc_last_status(), AMPC_ERR_DTYPE);
    assert_null(ampc_mean(lab, 0, false));
    assert_int_equal(ampc_last_status(), AMPC_ERR_DTYPE);

    ampc_clear_error();
    assert_null(ampc_sum(a, 2, false));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    assert_null(ampc_mean(a, -3, true));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);

    /* NULL inputs keep the first error */
    ampc_clear_error();
    assert_null(ampc_add(a, b));
    assert_null(ampc_relu(ampc_add(NULL, a)));
    assert_int_equal(ampc_last_status(), AMPC_ERR_SHAPE);
    ampc_clear_error();
    assert_null(ampc_exp(NULL));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);

    /* inputs on different devices */
    ampc_set_default_device(AMPC_DEVICE_REF);
    ampc_tensor *r = ampc_tensor_rand(AMPC_F64, 2, (int64_t[]){2, 3}, -1, 1);
    ampc_set_default_device(AMPC_DEVICE_CPU);
    ampc_clear_error();
    assert_null(ampc_add(a, r));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    ampc_clear_error();
    ampc_scope_end();
}

/* Empty tensors: sums of nothing are 0, means NaN (as in PyTorch), on both devices. */
static void test_empty(void **state) {
    (void)state;
    ampc_scope_begin();
    for (int dev = 0; dev < AMPC_DEVICE_COUNT; dev++) {
        if (!ampc_device_available((ampc_device)dev)) continue;   /* CUDA where a GPU is present */
        ampc_set_default_device((ampc_device)dev);
        ampc_dtype dt = dev == AMPC_DEVICE_REF ? AMPC_F64 : AMPC_BF16;
        ampc_tensor *e = ampc_tensor_zeros(dt, 2, (int64_t[]){0, 3});
        ampc_tensor *s = ampc_sum(e, 0, false), *m = ampc_mean(e, 0, false);
        ASSERT_NOT_NULL_MSG(s);
        ASSERT_NOT_NULL_MSG(m);
        double sv[3], mv[3];
        ASSERT_OK(ampc_tensor_to_f64(s, sv, 3));
        ASSERT_OK(ampc_tensor_to_f64(m, mv, 3));
        for (int i = 0; i < 3; i++) {
            assert_true(sv[i] == 0.0);
            assert_true(isnan(mv[i]));
        }
        assert_int_equal(ampc_tensor_numel(ampc_add(e, ampc_tensor_zeros(dt, 1, (int64_t[]){3}))), 0);
        assert_int_equal(ampc_tensor_numel(ampc_relu(e)), 0);
    }
    ampc_set_default_device(AMPC_DEVICE_CPU);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Type promotion

static void test_mixed_dtypes(void **state) {
    (void)state;
    ampc_scope_begin();
    double av[6], bv[3];
    tu_fill_uniform(av, 6, 1, -2, 2);
    tu_fill_uniform(bv, 3, 2, -2, 2);
    ampc_dtype pairs[][3] = {{AMPC_F16, AMPC_F32, AMPC_F32}, {AMPC_BF16, AMPC_F16, AMPC_F32},
                             {AMPC_F32, AMPC_BF16, AMPC_F32}, {AMPC_BF16, AMPC_BF16, AMPC_BF16}};
    for (size_t p = 0; p < sizeof pairs / sizeof *pairs; p++) {
        ampc_tensor *a = ampc_tensor_from_f64(pairs[p][0], 2, (int64_t[]){2, 3}, av);
        ampc_tensor *b = ampc_tensor_from_f64(pairs[p][1], 1, (int64_t[]){3}, bv);
        ampc_tensor_set_requires_grad(a, true);
        ampc_tensor_set_requires_grad(b, true);
        double *ar = tu_values(a), *br = tu_values(b);   /* the values as stored */

        ampc_tensor *s = ampc_add(a, b);
        ASSERT_NOT_NULL_MSG(s);
        assert_int_equal(ampc_tensor_dtype(s), pairs[p][2]);
        ampc_tensor *m = ampc_mul(a, b);
        assert_int_equal(ampc_tensor_dtype(m), pairs[p][2]);
        /* loss = sum(a + b) + sum(a * b): da = 1 + b, db = 2 + sum_rows(a) */
        ampc_tensor *loss = ampc_add(ampc_sum(s, AMPC_ALL_DIMS, false), ampc_sum(m, AMPC_ALL_DIMS, false));
        ASSERT_OK(ampc_backward(loss));
        ampc_tensor *ga = ampc_tensor_grad(a), *gb = ampc_tensor_grad(b);
        ASSERT_NOT_NULL_MSG(ga);
        ASSERT_NOT_NULL_MSG(gb);
        assert_int_equal(ampc_tensor_dtype(ga), pairs[p][0]);
        assert_int_equal(ampc_tensor_dtype(gb), pairs[p][1]);
        assert_int_equal(ampc_tensor_ndim(gb), 1);
        double *gav = tu_values(ga), *gbv = tu_values(gb), ea[6], eb[3];
        for (int i = 0; i < 6; i++) ea[i] = 1 + br[i % 3];
        for (int j = 0; j < 3; j++) eb[j] = 2 + ar[j] + ar[3 + j];
        /* each op's branch is cast back to the input's dtype (one rounding: b in da = 1 + b,
           the row sums in db), then the two branches are added in that dtype (a second
           rounding), with a few roundings in the promoted dtype on the way */
        double ua = tu_eps(pairs[p][0]), ub = tu_eps(pairs[p][1]), up = tu_eps(pairs[p][2]);
        double max_b = 0;
        for (int j = 0; j < 3; j++) max_b = fmax(max_b, fabs(br[j]));
        tu_assert_close("mixed grad a", gav, ea, 6, (ua + 4 * up) * max_b, ua + 4 * up);
        double mean_eb = (fabs(eb[0]) + fabs(eb[1]) + fabs(eb[2])) / 3;
        tu_assert_close("mixed grad b", gbv, eb, 3, 4 * (ub + 4 * up) * mean_eb, ub + 4 * up);
        free(ar), free(br), free(gav), free(gbv);
    }
    ampc_scope_end();
}

/* Under autocast, sum/exp/log/pow run in fp32 (PyTorch's fp32 list) and the rest in the
   input's dtype. */
static void test_autocast_policies(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_rand(AMPC_BF16, 2, (int64_t[]){4, 8}, 0.5, 1.5);
    ampc_autocast_enter(AMPC_BF16, true);
    assert_int_equal(ampc_tensor_dtype(ampc_sum(x, 1, false)), AMPC_F32);
    assert_int_equal(ampc_tensor_dtype(ampc_exp(x)), AMPC_F32);
    assert_int_equal(ampc_tensor_dtype(ampc_log(x)), AMPC_F32);
    assert_int_equal(ampc_tensor_dtype(ampc_pow(x, 2)), AMPC_F32);
    assert_int_equal(ampc_tensor_dtype(ampc_mean(x, 1, false)), AMPC_BF16);
    assert_int_equal(ampc_tensor_dtype(ampc_relu(x)), AMPC_BF16);
    assert_int_equal(ampc_tensor_dtype(ampc_add(x, x)), AMPC_BF16);
    ampc_autocast_exit();
    assert_int_equal(ampc_tensor_dtype(ampc_sum(x, 1, false)), AMPC_BF16);   /* no autocast */
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Large tensors (the threaded paths)

#define LARGE_NUMEL (1 << 20)   /* elements of the large tensors: many blocks of the threaded loops */

static void test_big_add_and_sum(void **state) {
    (void)state;
    ampc_scope_begin();
    double *av = malloc(LARGE_NUMEL * sizeof *av), *bv = malloc(LARGE_NUMEL * sizeof *bv);
    tu_fill_uniform(av, LARGE_NUMEL, 11, -1, 1);
    tu_fill_uniform(bv, LARGE_NUMEL, 12, -1, 1);
    const ampc_dtype dts[] = {AMPC_F32, AMPC_F16, AMPC_BF16};
    for (int d = 0; d < 3; d++) {
        ampc_dtype dt = dts[d];
        int64_t shape[] = {LARGE_NUMEL};
        ampc_tensor *a = ampc_tensor_from_f64(dt, 1, shape, av), *b = ampc_tensor_from_f64(dt, 1, shape, bv);
        double *ar = tu_values(a), *br = tu_values(b);

        /* add: one rounding of the exact sum of the stored values */
        double *got = tu_values(ampc_add(a, b));
        ampc_set_default_device(AMPC_DEVICE_REF);
        double *rv = tu_values(ampc_add(ampc_tensor_to(a, AMPC_DEVICE_REF, AMPC_F64), ampc_tensor_to(b, AMPC_DEVICE_REF, AMPC_F64)));
        ampc_set_default_device(AMPC_DEVICE_CPU);
        /* (f16/bf16: the f32 sum may round before the final rounding, hence 1 + 2^-12) */
        tu_assert_close("1M add vs ref", got, rv, LARGE_NUMEL, 0, tu_eps(dt) * (1 + 0x1p-12));
        free(got), free(rv);

        /* sum: f32 accumulation; each value passes through at most CHUNK adds inside a chunk,
           RBLK/CHUNK chunk sums and LARGE_NUMEL/RBLK block sums, so |err| <= depth * 2^-24 * sum|x|
           (then one rounding to dt) */
        double exact = 0, abs_sum = 0;
        for (int i = 0; i < LARGE_NUMEL; i++) exact += ar[i], abs_sum += fabs(ar[i]);
        double depth = 1024 + 65536 / 1024 + LARGE_NUMEL / 65536;
        int threads = ampc_get_num_threads();
        ampc_set_num_threads(2);
        double s2 = ampc_tensor_item(ampc_sum(a, AMPC_ALL_DIMS, false));
        ampc_set_num_threads(1);
        double s1 = ampc_tensor_item(ampc_sum(a, AMPC_ALL_DIMS, false));
        ampc_set_num_threads(threads);
        assert_true(s1 == s2);   /* fixed blocks: independent of the thread count */
        double tol = depth * 0x1p-24 * abs_sum + tu_eps(dt) * fabs(exact) * 1.01;
        if (fabs(s2 - exact) > tol) fail_msg("1M sum %s: %.9g vs %.9g (tol %.3g)", ampc_dtype_name(dt), s2, exact, tol);
        double m = ampc_tensor_item(ampc_mean(a, 0, false));
        if (fabs(m - exact / LARGE_NUMEL) > tol / LARGE_NUMEL)
            fail_msg("1M mean %s: %.9g vs %.9g", ampc_dtype_name(dt), m, exact / LARGE_NUMEL);

        /* sum over rows of a (1024, 1024) view: parallel over rows */
        ampc_tensor *rows = ampc_sum(ampc_reshape(a, 2, (int64_t[]){1024, 1024}), 1, false);
        double *rs = tu_values(rows);
        for (int r = 0; r < 1024; r++) {
            double e = 0, ab = 0;
            for (int j = 0; j < 1024; j++) e += ar[r * 1024 + j], ab += fabs(ar[r * 1024 + j]);
            double t = 1024 * 0x1p-24 * ab + tu_eps(dt) * fabs(e) * 1.01;
            if (fabs(rs[r] - e) > t) fail_msg("row sum %d %s: %.9g vs %.9g", r, ampc_dtype_name(dt), rs[r], e);
        }
        free(rs), free(ar), free(br);
    }
    free(av), free(bv);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// In-place kernels (gradient accumulation adds into its accumulator: out == a)

static void test_in_place(void **state) {
    (void)state;
    ampc_scope_begin();
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_CPU);
    const ampc_dtype dts[] = {AMPC_F32, AMPC_F16, AMPC_BF16};
    /* same shape (flat path, several chunks and threads) and a bias-shaped b */
    const int64_t shapes[][2] = {{300, 1000}, {37, 5}};
    for (int d = 0; d < 3; d++)
        for (int s = 0; s < 2; s++)
            for (ampc_op op = AMPC_OP_ADD; op <= AMPC_OP_MUL; op++) {
                ampc_tensor *a = ampc_tensor_rand(dts[d], 2, shapes[s], -1, 1);
                ampc_tensor *b = s ? ampc_tensor_rand(dts[d], 1, &shapes[s][1], -1, 1)
                                   : ampc_tensor_rand(dts[d], 2, shapes[s], -1, 1);
                ampc_tensor *expect = ampc_tensor_empty(dts[d], 2, shapes[s]);
                ASSERT_OK(be->binary((ampc_op)op, a, b, expect));
                ASSERT_OK(be->binary((ampc_op)op, a, b, a));
                assert_memory_equal(ampc_tensor_data(a), ampc_tensor_data(expect), (size_t)ampc_tensor_numel(a) * ampc_dtype_size(dts[d]));
            }
    /* unary in place (x == y), as gradient clipping scales in place */
    for (int d = 0; d < 3; d++) {
        ampc_tensor *x = ampc_tensor_rand(dts[d], 1, (int64_t[]){50000}, -1, 1);
        ampc_tensor *expect = ampc_tensor_empty(dts[d], 1, (int64_t[]){50000});
        ASSERT_OK(be->unary(AMPC_OP_GELU, x, expect, 0));
        ASSERT_OK(be->unary(AMPC_OP_GELU, x, x, 0));
        assert_memory_equal(ampc_tensor_data(x), ampc_tensor_data(expect), 50000 * ampc_dtype_size(dts[d]));
    }
    /* a gradient reaching a leaf twice is accumulated (x + x: the accumulator adds in place) */
    ampc_tensor *x = ampc_tensor_rand(AMPC_F32, 1, (int64_t[]){3}, -1, 1);
    ampc_tensor_set_requires_grad(x, true);
    ASSERT_OK(ampc_backward(ampc_sum(ampc_add(x, x), AMPC_ALL_DIMS, false)));
    double g[3];
    ASSERT_OK(ampc_tensor_to_f64(ampc_tensor_grad(x), g, 3));
    for (int i = 0; i < 3; i++) assert_true(g[i] == 2.0);
    ampc_scope_end();
}

/* Exact GELU on the CPU keeps its relative accuracy in the tails (where x Phi(x) is tiny and
   1 + erf(x / sqrt 2) would cancel): within 1e-6 of x erfc(-x / sqrt 2) / 2 by libm in double
   over [-12.5, 13] in steps of 2^-10, in f32. */
static void test_gelu_tails(void **state) {
    (void)state;
    ampc_scope_begin();
    const int64_t n = (int64_t)(25.5 * 1024) + 1;
    double *xs = malloc((size_t)n * sizeof *xs);
    for (int64_t i = 0; i < n; i++) xs[i] = -12.5 + (double)i / 1024;
    ampc_tensor *x = ampc_tensor_from_f64(AMPC_F32, 1, &n, xs), *y = ampc_gelu(x);
    ASSERT_NOT_NULL_MSG(y);
    double *got = tu_values(y), worst = 0;
    for (int64_t i = 0; i < n; i++) {
        double want = xs[i] * 0.5 * erfc(-xs[i] / sqrt(2.0)), rel = want == 0 ? fabs(got[i]) : fabs(got[i] - want) / fabs(want);
        worst = fmax(worst, rel);
        if (!(rel <= 1e-6)) fail_msg("gelu(%.10g) = %.9g, x erfc(-x / sqrt 2) / 2 = %.9g: relative error %.3g", xs[i], got[i], want, rel);
    }
    printf("gelu on [-12.5, 13]: worst relative error %.3g\n", worst);
    free(got), free(xs);
    ampc_scope_end();
}

/* The CPU's vectorized activations against libm in double over [-20, 20] in steps of 2^-8, in
   f32: sigmoid, SiLU and tanh within 8 unit roundoffs (a sigmoid below FLT_MIN may flush to 0,
   so results below max(1, |x|) FLT_MIN may), GELU's tanh form within (8 + 6 |z|) unit
   roundoffs, z = 2 sqrt(2/pi) (x + 0.044715 x^3): z is computed in f32 (the two constants
   rounded, two products, a fused multiply-add and the scaling: within 6 unit roundoffs), and
   where sigmoid(z) is about exp(z) an absolute error in z is that relative error in the result.
   The reference takes it as x / (1 + exp(-z)), the same function without 1 + tanh's
   cancellation. */
static double ref_activation(int op, double x) {
    double z = 2 * 0.79788456080286535588 * (x + 0.044715 * x * x * x);
    switch (op) {
    case 0: return 1 / (1 + exp(-x));
    case 1: return x / (1 + exp(-x));
    case 2: return tanh(x);
    default: return x / (1 + exp(-z));
    }
}

static void test_activation_accuracy(void **state) {
    (void)state;
    ampc_tensor *(*fn[4])(ampc_tensor *) = {ampc_sigmoid, ampc_silu, ampc_tanh, ampc_gelu_tanh};
    const char *name[4] = {"sigmoid", "silu", "tanh", "gelu_tanh"};
    const int64_t n = 40 * 256 + 1;
    double *xs = malloc((size_t)n * sizeof *xs);
    for (int64_t i = 0; i < n; i++) xs[i] = -20.0 + (double)i / 256;
    for (int op = 0; op < 4; op++) {
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_from_f64(AMPC_F32, 1, &n, xs), *y = fn[op](x);
        ASSERT_NOT_NULL_MSG(y);
        double *got = tu_values(y), worst = 0;
        for (int64_t i = 0; i < n; i++) {
            double want = ref_activation(op, xs[i]), z = 2 * 0.79788456080286535588 * (xs[i] + 0.044715 * xs[i] * xs[i] * xs[i]);
            double units = op == 3 ? 8 + 6 * fabs(z) : 8, err = fabs(got[i] - want);
            double bound = units * 0x1p-24 * fabs(want) + fmax(1, fabs(xs[i])) * 0x1p-126;
            worst = fmax(worst, err / bound);
            if (!(err <= bound))
                fail_msg("%s(%.10g) = %.9g, libm %.9g: %.3g unit roundoffs (allowed %g)", name[op], xs[i], got[i], want,
                         err / fabs(want) / 0x1p-24, units);
        }
        printf("%s on [-20, 20]: worst error %.2f of its bound\n", name[op], worst);
        free(got);
        ampc_scope_end();
    }
    free(xs);
}

// ---------------------------------------------------------------------------------------------
// What each op saves for backward

static int n_saved(const ampc_tensor *t) {
    int n = 0;
    for (int i = 0; i < AMPC_NODE_MAX_SAVED; i++) n += t->grad_fn->saved[i] != NULL;
    return n;
}

static void test_saved_tensors(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_rand(AMPC_F32, 1, (int64_t[]){8}, 0.5, 1);
    ampc_tensor *c = ampc_tensor_rand(AMPC_F32, 1, (int64_t[]){8}, 0.5, 1);   /* no grad */
    ampc_tensor_set_requires_grad(x, true);
    assert_int_equal(n_saved(ampc_add(x, c)), 0);
    assert_int_equal(n_saved(ampc_sub(c, x)), 0);
    assert_int_equal(n_saved(ampc_mul(x, c)), 1);   /* only c, for x's gradient */
    assert_int_equal(n_saved(ampc_mul(x, x)), 2);
    assert_int_equal(n_saved(ampc_add_scalar(x, 1)), 0);
    assert_int_equal(n_saved(ampc_mul_scalar(x, 2)), 0);
    assert_int_equal(n_saved(ampc_sum(x, 0, false)), 0);
    assert_int_equal(n_saved(ampc_mean(x, AMPC_ALL_DIMS, true)), 0);
    /* each unary op saves exactly what the op table says its backward reads: x in slot 0 or y
       in slot 1 */
    const struct { ampc_op op; ampc_tensor *(*f)(ampc_tensor *); } one_saved[] = {
        {AMPC_OP_RELU, ampc_relu}, {AMPC_OP_GELU, ampc_gelu}, {AMPC_OP_TANH, ampc_tanh}, {AMPC_OP_SIGMOID, ampc_sigmoid},
        {AMPC_OP_EXP, ampc_exp},   {AMPC_OP_LOG, ampc_log},   {AMPC_OP_SILU, ampc_silu}, {AMPC_OP_GELU_TANH, ampc_gelu_tanh},
    };
    for (size_t i = 0; i < sizeof one_saved / sizeof *one_saved; i++) {
        ampc_tensor *y = one_saved[i].f(x);
        assert_int_equal(n_saved(y), 1);
        bool reads_x = ampc_op_backward_reads(one_saved[i].op) == AMPC_READS_X;
        assert_true(y->grad_fn->saved[reads_x ? 0 : 1] != NULL);
    }
    assert_int_equal(n_saved(ampc_pow(x, 3)), 1);
    /* an output saved by its own node is no reference cycle: without backward, the scope
       frees everything */
    size_t before = ampc_memory_stats().current_total;
    ampc_scope_begin();
    ampc_tensor *(*save_output[])(ampc_tensor *) = {ampc_relu, ampc_tanh, ampc_sigmoid, ampc_exp};
    for (int i = 0; i < 4; i++) ASSERT_NOT_NULL_MSG(ampc_sum(save_output[i](x), AMPC_ALL_DIMS, false));
    ampc_scope_end();
    assert_int_equal(ampc_memory_stats().current_total, before);
    /* backward releases the saved tensors at once */
    ampc_tensor *y = ampc_relu(x);
    ampc_tensor *loss = ampc_sum(y, AMPC_ALL_DIMS, false);
    ASSERT_OK(ampc_backward(loss));
    assert_int_equal(n_saved(y), 0);
    ampc_scope_end();
}


// ---------------------------------------------------------------------------------------------
// The bf16 register path: the loops convert bf16 in registers (cpu.h); the result must be the
// bits of "widen exactly, compute in f32, round once with ampc_f32_to_bf16", for every input

static bool bf16_is_nan(uint16_t h) { return (h & 0x7fff) > 0x7f80; }

/* got[i] == round(want[i]) bit for bit; a NaN only needs to be a NaN (which input's payload an
   operation keeps is the compiler's choice of operand order) */
static void expect_bf16(const char *what, const uint16_t *got, const float *want, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint16_t w = ampc_f32_to_bf16(want[i]);
        if (bf16_is_nan(w) ? !bf16_is_nan(got[i]) : got[i] != w)
            fail_msg("%s [%zu]: %04x, expected %04x (%a)", what, i, got[i], w, (double)want[i]);
    }
}

/* f32 -> bf16 inside the loops at the dispatched vector width: every high half (sign,
   exponent, top mantissa bits: every kept value, odd and even) with the low halves that decide
   the rounding (zero, just below / at / above the tie, all ones: carries into the exponent and
   into inf, NaNs with only low bits set) and a few others, against ampc_f32_to_bf16. (All 2^32
   patterns were checked once this way: 11 s, too slow for every run.) */
static const uint32_t lows[] = {0x0000, 0x0001, 0x0002, 0x3fff, 0x7ffe, 0x7fff, 0x8000, 0x8001,
                                0x8002, 0xbfff, 0xc000, 0xfffe, 0xffff, 0x1234, 0x9abc, 0x5555};
enum { NLOWS = sizeof lows / sizeof *lows };

AMPC_CPU_VEC static void narrow_all_highs(uint32_t low, uint16_t *out) {
#pragma omp simd
    for (uint32_t h = 0; h < 65536; h++) {
        union { uint32_t u; float f; } v = {.u = h << 16 | low};
        out[h] = ampc__cpu_f32_bf16(v.f);
    }
}

static void test_bf16_rounding_in_registers(void **state) {
    (void)state;
    uint16_t *out = malloc(65536 * sizeof *out);
    for (int k = 0; k < NLOWS; k++) {
        narrow_all_highs(lows[k], out);
        for (uint32_t h = 0; h < 65536; h++) {
            union { uint32_t u; float f; } v = {.u = h << 16 | lows[k]};
            if (out[h] != ampc_f32_to_bf16(v.f)) fail_msg("f32 %08x -> %04x, scalar %04x", v.u, out[h], ampc_f32_to_bf16(v.f));
            if (ampc__cpu_bf16_f32((uint16_t)h) != ampc_bf16_to_f32((uint16_t)h) && !bf16_is_nan((uint16_t)h))
                fail_msg("bf16 %04x widened differently", h);
        }
    }
    free(out);
}

static void test_bf16_register_path_bits(void **state) {
    (void)state;
    ampc_scope_begin();
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_CPU);
    const int64_t n = 65536 + 37;   /* every pattern, then a ragged tail of BLK-sized blocks */
    ampc_tensor *x = ampc_tensor_empty(AMPC_BF16, 1, &n), *y = ampc_tensor_empty(AMPC_BF16, 1, &n);
    ampc_tensor *o = ampc_tensor_empty(AMPC_BF16, 1, &n);
    uint16_t *xv = ampc_tensor_data(x), *yv = ampc_tensor_data(y), *ov = ampc_tensor_data(o);
    float *want = malloc((size_t)n * sizeof *want);
    for (int64_t i = 0; i < n; i++) xv[i] = (uint16_t)i, yv[i] = (uint16_t)((uint32_t)i * 40503u + 7u);
#define XF(i) ampc_bf16_to_f32(xv[i])
#define YF(i) ampc_bf16_to_f32(yv[i])
    /* unary: relu; scales that round (1/3), land on ties and subnormals (0.5) or overflow (3);
       shifts that round and absorb */
    const struct { ampc_op op; double a; } un[] = {{AMPC_OP_RELU, 0},       {AMPC_OP_MUL_SCALAR, 1.0 / 3},
                                                       {AMPC_OP_MUL_SCALAR, 0.5},    {AMPC_OP_MUL_SCALAR, 3},
                                                       {AMPC_OP_ADD_SCALAR, 0.1}, {AMPC_OP_ADD_SCALAR, -1e-39}};
    char what[64];
    for (size_t k = 0; k < sizeof un / sizeof *un; k++) {
        float a = (float)un[k].a;
        ASSERT_OK(be->unary(un[k].op, x, o, un[k].a));
        for (int64_t i = 0; i < n; i++) {
            float v = XF(i);
            want[i] = un[k].op == AMPC_OP_RELU ? (v < 0.0f ? 0.0f : v) : un[k].op == AMPC_OP_MUL_SCALAR ? a * v : v + a;
        }
        snprintf(what, sizeof what, "unary %s (%g)", ampc_op_name(un[k].op), un[k].a);
        expect_bf16(what, ov, want, (size_t)n);
    }
    /* relu's derivative from its output (y > 0: gy, else 0) */
    ASSERT_OK(be->unary_backward(AMPC_OP_RELU, NULL, x, y, o, 0));
    for (int64_t i = 0; i < n; i++) want[i] = XF(i) > 0.0f ? YF(i) : 0.0f;
    expect_bf16("relu backward", ov, want, (size_t)n);
    /* binary, same shape: products of two 8-bit significands hit every rounding case */
    for (ampc_op op = AMPC_OP_ADD; op <= AMPC_OP_MUL; op++) {
        ASSERT_OK(be->binary((ampc_op)op, x, y, o));
        for (int64_t i = 0; i < n; i++)
            want[i] = op == AMPC_OP_ADD ? XF(i) + YF(i) : op == AMPC_OP_SUB ? XF(i) - YF(i) : XF(i) * YF(i);
        snprintf(what, sizeof what, "binary %s", ampc_op_name(op));
        expect_bf16(what, ov, want, (size_t)n);
    }
    /* broadcast rows: x's first 65536 patterns as (256, 256), with y's first 256 as a row
       vector (256,) and as a column (256, 1) */
    const int64_t sq[] = {256, 256}, row[] = {256}, col[] = {256, 1};
    ampc_tensor *xs = ampc_tensor_empty(AMPC_BF16, 2, sq), *os = ampc_tensor_empty(AMPC_BF16, 2, sq);
    ampc_tensor *yr = ampc_tensor_empty(AMPC_BF16, 1, row), *yc = ampc_tensor_empty(AMPC_BF16, 2, col);
    uint16_t *osv = ampc_tensor_data(os);
    memcpy(ampc_tensor_data(xs), xv, 65536 * sizeof *xv);
    memcpy(ampc_tensor_data(yr), yv, 256 * sizeof *yv);
    memcpy(ampc_tensor_data(yc), yv, 256 * sizeof *yv);
    for (ampc_op op = AMPC_OP_ADD; op <= AMPC_OP_MUL; op++)
        for (int form = 0; form < 3; form++) {
            if (form < 2) ASSERT_OK(be->binary((ampc_op)op, xs, form ? yc : yr, os));
            else ASSERT_OK(be->binary((ampc_op)op, yc, xs, os));   /* the broadcast one first */
            for (int64_t i = 0; i < 65536; i++) {
                float a = XF(i), b = form == 0 ? YF(i % 256) : YF(i / 256);
                if (form == 2) a = b, b = XF(i);
                want[i] = op == AMPC_OP_ADD ? a + b : op == AMPC_OP_SUB ? a - b : a * b;
            }
            snprintf(what, sizeof what, "broadcast binary %s form %d", ampc_op_name(op), form);
            expect_bf16(what, osv, want, 65536);
        }
    /* expand of a row vector, times alpha */
    ASSERT_OK(be->expand(yr, os, 1.0 / 3));
    for (int64_t i = 0; i < 65536; i++) want[i] = (float)(1.0 / 3) * YF(i % 256);
    expect_bf16("expand", osv, want, 65536);
#undef XF
#undef YF
    free(want);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// sum_to of a 16-bit x into an f32 out (a bias gradient straight into its fp32 master): the f32
// accumulator unrounded, the same bits as summing the widened values on the f32 path, and
// within the recursive-summation bound of the f64 sum

static void test_sum_to_f32_out(void **state) {
    (void)state;
    ampc_scope_begin();
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_CPU);
    const struct {
        int nd, od;
        int64_t xs[4], os[4];
    } cases[] = {
        {2, 1, {256, 2048}, {2048}},          /* bias of a linear layer: sum over rows */
        {4, 3, {8, 16, 9, 9}, {16, 1, 1}},    /* bias of a convolution: over N, H, W */
        {2, 2, {3, 70000}, {3, 1}},           /* long rows: blocked */
        {3, 2, {4, 5, 3}, {5, 1}},            /* two separate summed groups */
        {2, 2, {7, 5}, {7, 5}},               /* nothing summed */
    };
    const ampc_dtype dts[] = {AMPC_BF16, AMPC_F16};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        for (int d = 0; d < 2; d++) {
            int64_t n = 1, m = 1;
            for (int i = 0; i < cases[c].nd; i++) n *= cases[c].xs[i];
            for (int i = 0; i < cases[c].od; i++) m *= cases[c].os[i];
            ampc_tensor *x = ampc_tensor_rand(dts[d], cases[c].nd, cases[c].xs, -1, 1);
            ampc_tensor *x32 = ampc_cast(x, AMPC_F32);   /* the same values, exactly */
            ampc_tensor *out = ampc_tensor_empty(AMPC_F32, cases[c].od, cases[c].os);
            ampc_tensor *out32 = ampc_tensor_empty(AMPC_F32, cases[c].od, cases[c].os);
            ASSERT_OK(be->sum_to(x, out, 1.0));
            ASSERT_OK(be->sum_to(x32, out32, 1.0));
            const float *r = ampc_tensor_data(out), *r32 = ampc_tensor_data(out32);
            if (memcmp(r, r32, (size_t)m * sizeof *r))
                fail_msg("case %zu %s: f32 out differs from the f32 path", c, ampc_dtype_name(dts[d]));
            /* against f64 sums: any order of k additions is within (k - 1) u sum|x| */
            double *xv = tu_values(x), *exact = calloc((size_t)m, sizeof *exact), *abs_sum = calloc((size_t)m, sizeof *abs_sum);
            int64_t k = n / m;
            size_t unrounded = 0;
            for (int64_t i = 0; i < n; i++) {   /* slot: element i's out index under the broadcast */
                int64_t idx[4], rest = i, slot = 0;
                for (int dd = cases[c].nd - 1; dd >= 0; dd--) idx[dd] = rest % cases[c].xs[dd], rest /= cases[c].xs[dd];
                for (int dd = 0; dd < cases[c].nd; dd++) {
                    int od = dd - (cases[c].nd - cases[c].od);
                    if (od >= 0) slot = slot * cases[c].os[od] + (cases[c].os[od] == 1 ? 0 : idx[dd]);
                }
                exact[slot] += xv[i];
                abs_sum[slot] += fabs(xv[i]);
            }
            for (int64_t j = 0; j < m; j++) {
                double tol = (double)(k - 1) * 0x1p-24 * abs_sum[j];
                if (fabs((double)r[j] - exact[j]) > tol)
                    fail_msg("case %zu %s [%lld]: %.9g vs %.9g (tol %.3g)", c, ampc_dtype_name(dts[d]), (long long)j,
                             (double)r[j], exact[j], tol);
                uint32_t bits;
                memcpy(&bits, &r[j], 4);
                unrounded += (bits & 0xffff) != 0;
            }
            /* sums of more than one value are not rounded to 16 bits (a few may happen to fit) */
            if (k > 1 && unrounded < (size_t)m / 2)
                fail_msg("case %zu %s: %zu of %lld sums look rounded to 16 bits", c, ampc_dtype_name(dts[d]),
                         (size_t)m - unrounded, (long long)m);
            free(xv), free(exact), free(abs_sum);
        }
    /* thread-count independent on every path */
    int threads = ampc_get_num_threads();
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        ampc_tensor *x = ampc_tensor_rand(AMPC_BF16, cases[c].nd, cases[c].xs, -1, 1);
        ampc_tensor *o1 = ampc_tensor_empty(AMPC_F32, cases[c].od, cases[c].os), *o2 = ampc_tensor_empty(AMPC_F32, cases[c].od, cases[c].os);
        ampc_set_num_threads(1);
        ASSERT_OK(be->sum_to(x, o1, 0.5));
        ampc_set_num_threads(2);
        ASSERT_OK(be->sum_to(x, o2, 0.5));
        assert_memory_equal(ampc_tensor_data(o1), ampc_tensor_data(o2), (size_t)ampc_tensor_numel(o1) * sizeof(float));
    }
    ampc_set_num_threads(threads);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// The door to the kernels (dispatch.c): unknown devices, missing kernels, supports

/* ampc_cudnn_benchmark(): $AMPC_CUDNN_BENCHMARK decides until the program sets it ("0" off, any
   other text on, unset or empty: off); each case in a child of its own, since the variable is
   read once per process. The child's exit status: 10 + the answer before the set, + 20 after. */
static int cudnn_benchmark_child(const char *env) {
    pid_t pid = fork();
    if (pid == 0) {
        if (env) setenv("AMPC_CUDNN_BENCHMARK", env, 1);
        else unsetenv("AMPC_CUDNN_BENCHMARK");
        int before = ampc_cudnn_benchmark();
        ampc_set_cudnn_benchmark(!before);
        _exit(10 + before + 20 * ampc_cudnn_benchmark());
    }
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st)) return -1;
    return WEXITSTATUS(st);
}

/* permute and transpose: every CPU dtype against REF (element by element there) with finite
   differences, keeping and moving the innermost dim; a transpose's values written out; a dim
   named twice or out of range refused. */
static ampc_tensor *op_permute(ampc_tensor **in, const void *ctx) { return ampc_permute(in[0], ctx); }

static void test_permute(void **state) {
    (void)state;
    static const int p0213[] = {0, 2, 1, 3}, p10[] = {1, 0}, p201[] = {2, 0, 1}, pneg[] = {-1, 0, 1};
    const struct { const char *name; int nd; int64_t shape[4]; const int *dims; } cs[] = {
        {"permute (2,3,4,5) by 0,2,1,3", 4, {2, 3, 4, 5}, p0213}, {"permute (7,9) by 1,0", 2, {7, 9}, p10},
        {"permute (3,4,5) by 2,0,1", 3, {3, 4, 5}, p201},         {"permute (3,4,6) by -1,0,1", 3, {3, 4, 6}, pneg},
    };
    for (size_t i = 0; i < sizeof cs / sizeof *cs; i++) {
        tu_op_case c = {.name = cs[i].name, .n_inputs = 1, .ndim = {cs[i].nd}, .lo = -2, .hi = 2, .fn = op_permute,
                        .ctx = cs[i].dims, .k = 1};
        memcpy(c.shape[0], cs[i].shape, sizeof cs[i].shape);
        tu_check_op(&c);
    }
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_from_f32(AMPC_F32, 2, (int64_t[]){2, 3}, (const float[]){0, 1, 2, 3, 4, 5});
    ampc_tensor *t = ampc_transpose(x, 0, -1);
    ASSERT_NOT_NULL_MSG(x && t);
    assert_int_equal(ampc_tensor_dim(t, 0), 3);
    const float want[6] = {0, 3, 1, 4, 2, 5};
    assert_memory_equal(ampc_tensor_cdata(t), want, sizeof want);
    assert_null(ampc_permute(x, (const int[]){0, 0}));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    assert_null(ampc_permute(x, (const int[]){0, 2}));
    assert_null(ampc_transpose(x, 0, 5));
    ampc_clear_error();
    ampc_scope_end();
}

/* GELU's tanh approximation against PyTorch's, made by Debian's python3-torch 1.13:
     x = torch.tensor([...], dtype=torch.float64, requires_grad=True)
     y = torch.nn.functional.gelu(x, approximate='tanh'); y.sum().backward()
   (REF and CPU are checked against each other above; this pins the formula itself). Bounds: 8
   unit roundoffs of the dtype (f64 on REF, f32 on the CPU: a tanh and a few products), times
   the derivative's condition where 1 + t cancels as t = tanh(...) nears -1 (1 / (1 + t): 7 at
   x = -1.5, 150 at x = -3). */
static void test_gelu_tanh_pytorch(void **state) {
    (void)state;
    static const double xs[8] = {-3.0, -1.5, -0.5, 0.0, 0.25, 1.0, 2.5, 4.0};
    static const double ys[8] = {-0.0036373920817729943, -0.10042842301976707, -0.15428599017485606, 0.0,
                                 0.149675350701685,      0.8411919906082768,   2.484915733910001,    3.9999297540518075};
    static const double gs[8] = {-0.011584166630969648, -0.12771079315143308, 0.13263009646535764, 0.5,
                                 0.6953540951510604,    1.0829640838457826,   1.037951576212666,   1.000335123197122};
    const ampc_device devs[2] = {AMPC_DEVICE_REF, AMPC_DEVICE_CPU};
    for (int k = 0; k < 2; k++) {
        ampc_scope_begin();
        ampc_set_default_device(devs[k]);
        ampc_tensor *x = ampc_tensor_from_f64(k ? AMPC_F32 : AMPC_F64, 1, (int64_t[]){8}, xs);
        ASSERT_NOT_NULL_MSG(x);
        ASSERT_OK(ampc_tensor_set_requires_grad(x, true));
        ampc_tensor *y = ampc_gelu_tanh(x);
        ASSERT_NOT_NULL_MSG(y);
        ASSERT_OK(ampc_backward(ampc_sum(y, AMPC_ALL_DIMS, false)));
        double *yv = tu_values(y), *gv = tu_values(ampc_tensor_grad(x));
        double u8 = 8 * (k ? 0x1p-24 : 0x1p-53);
        for (int i = 0; i < 8; i++) {
            double t = tanh(0.79788456080286535588 * (xs[i] + 0.044715 * xs[i] * xs[i] * xs[i])), cond = 1 / (1 + t);
            if (fabs(yv[i] - ys[i]) > u8 * cond * fabs(ys[i]))
                fail_msg("%s gelu_tanh(%g) = %.17g, PyTorch %.17g", k ? "cpu" : "ref", xs[i], yv[i], ys[i]);
            if (fabs(gv[i] - gs[i]) > u8 * (cond > 1 ? cond : 1) * fabs(gs[i]))
                fail_msg("%s gelu_tanh'(%g) = %.17g, PyTorch %.17g", k ? "cpu" : "ref", xs[i], gv[i], gs[i]);
        }
        free(yv), free(gv);
        ampc_set_default_device(AMPC_DEVICE_CPU);
        ampc_scope_end();
    }
}

static void test_cudnn_benchmark_switch(void **state) {
    (void)state;
    assert_int_equal(cudnn_benchmark_child(NULL), 10 + 0 + 20);
    assert_int_equal(cudnn_benchmark_child(""), 10 + 0 + 20);
    assert_int_equal(cudnn_benchmark_child("0"), 10 + 0 + 20);
    assert_int_equal(cudnn_benchmark_child("1"), 10 + 1 + 0);
    assert_int_equal(cudnn_benchmark_child("yes"), 10 + 1 + 0);
}

static void test_kernel_door(void **state) {
    (void)state;
    ampc_scope_begin();
    /* an unknown device is an error, never the CPU's table */
    assert_null(ampc__backend((ampc_device)7));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    assert_non_null(strstr(ampc_last_error(), "unknown device 7"));
    ampc_tensor *x = ampc_tensor_from_f32(AMPC_F32, 1, (int64_t[]){3}, (float[]){-1, 2, -3});
    x->device = (ampc_device)7;   /* a corrupt tensor: the door refuses it before any kernel runs */
    assert_int_equal(ampc__k_unary_into(AMPC_OP_RELU, x, x, 0), AMPC_ERR_INVALID);
    assert_non_null(strstr(ampc_last_error(), "unknown device 7"));
    assert_int_equal(ampc__backend_check(AMPC_K_softmax, AMPC_F32, (ampc_device)-1), AMPC_ERR_INVALID);
    x->device = AMPC_DEVICE_CPU;
    assert_true(((const float *)ampc_tensor_data(x))[0] == -1.0f);   /* no CPU result written */
    assert_false(ampc__backend_supports(AMPC_K_unary, AMPC_F32, (ampc_device)7));

    /* a kernel the table lacks (REF composes batch_norm_add_relu): unsupported, named */
    const ampc_backend *ref = ampc__backend(AMPC_DEVICE_REF);
    assert_null(ref->batch_norm_add_relu);
    ampc_tensor *r = ampc_tensor_to(ampc_tensor_rand(AMPC_F32, 4, (int64_t[]){2, 3, 2, 2}, -1, 1), AMPC_DEVICE_REF, AMPC_F64);
    ampc_tensor *ry = ampc_tensor_to(r, AMPC_DEVICE_REF, AMPC_F64);
    assert_int_equal(ampc__k_batch_norm_add_relu(r, NULL, NULL, NULL, NULL, r, ry, NULL, true, 0.1, 1e-5),
                     AMPC_ERR_UNSUPPORTED);
    assert_non_null(strstr(ampc_last_error(), "batch_norm_add_relu"));
    assert_non_null(strstr(ampc_last_error(), "f64"));
    assert_non_null(strstr(ampc_last_error(), "ref"));
    /* a dtype the device does not hold */
    assert_int_equal(ampc__backend_check(AMPC_K_softmax, AMPC_BF16, AMPC_DEVICE_REF), AMPC_ERR_UNSUPPORTED);
    assert_non_null(strstr(ampc_last_error(), "softmax"));
    assert_non_null(strstr(ampc_last_error(), "bf16"));
    assert_non_null(strstr(ampc_last_error(), "ref"));

    /* supports answers from the tables and the devices' dtypes, and agrees with the check */
    for (int dev = 0; dev < AMPC_DEVICE_COUNT; dev++) {
        const ampc_backend *be = ampc__backend((ampc_device)dev);
        for (int dt = 0; dt < AMPC_DTYPE_COUNT; dt++) {
            bool held = be->device.dtypes[dt];
            assert_int_equal(ampc__backend_supports(AMPC_K_softmax, (ampc_dtype)dt, (ampc_device)dev), held && be->softmax);
            assert_int_equal(ampc__backend_supports(AMPC_K_gemm, (ampc_dtype)dt, (ampc_device)dev), held && be->gemm);
            assert_int_equal(ampc__backend_supports(AMPC_K_copy_block, (ampc_dtype)dt, (ampc_device)dev), held && be->copy_block);
            assert_int_equal(ampc__backend_supports(AMPC_K_batch_norm_add_relu, (ampc_dtype)dt, (ampc_device)dev),
                             held && be->batch_norm_add_relu);
            for (int k = 0; k < AMPC_K_COUNT; k++)
                assert_int_equal(ampc__backend_supports((ampc_kernel)k, (ampc_dtype)dt, (ampc_device)dev),
                                 ampc__backend_check((ampc_kernel)k, (ampc_dtype)dt, (ampc_device)dev) == AMPC_OK);
        }
    }
    assert_true(ampc__backend_supports(AMPC_K_softmax, AMPC_BF16, AMPC_DEVICE_CPU));
    assert_true(ampc__backend_supports(AMPC_K_softmax, AMPC_F64, AMPC_DEVICE_REF));
    assert_false(ampc__backend_supports(AMPC_K_softmax, AMPC_F32, AMPC_DEVICE_REF));
    assert_false(ampc__backend_supports(AMPC_K_batch_norm_add_relu, AMPC_F32, AMPC_DEVICE_CPU));
    assert_string_equal(ampc__kernel_name(AMPC_K_layer_norm_backward), "layer_norm_backward");
    ampc_scope_end();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unary_ops),
        cmocka_unit_test(test_binary_ops),
        cmocka_unit_test(test_reductions),
        cmocka_unit_test(test_output_shapes_and_names),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_empty),
        cmocka_unit_test(test_mixed_dtypes),
        cmocka_unit_test(test_autocast_policies),
        cmocka_unit_test(test_big_add_and_sum),
        cmocka_unit_test(test_in_place),
        cmocka_unit_test(test_saved_tensors),
        cmocka_unit_test(test_bf16_rounding_in_registers),
        cmocka_unit_test(test_bf16_register_path_bits),
        cmocka_unit_test(test_sum_to_f32_out),
        cmocka_unit_test(test_kernel_door), cmocka_unit_test(test_cudnn_benchmark_switch), cmocka_unit_test(test_gelu_tanh_pytorch), cmocka_unit_test(test_gelu_tails), cmocka_unit_test(test_activation_accuracy),
        cmocka_unit_test(test_permute),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
