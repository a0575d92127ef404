/*
 * test_autocast.c - autocast regions: the policy table, output dtypes per op and autocast
 * dtype, nesting and enabled=false regions, the weight-cast cache, and gradients through
 * autocast ops (fp32 for fp32 parameters, 16-bit tensors saved for backward).
 */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops/ops.h"

static const ampc_dtype ac_dtypes[] = {AMPC_F16, AMPC_BF16};

/* A fp32 leaf with values k/8 (exact in f16 and bf16), optionally requiring grad. */
static ampc_tensor *exact_tensor(int ndim, const int64_t *shape, uint64_t seed, bool positive, bool requires_grad) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    float *v = malloc((size_t)n * sizeof *v);
    uint64_t s = seed * 7919 + 1;
    for (int64_t i = 0; i < n; i++) {
        int k = (int)tu_uniform(&s, positive ? 1 : -16, 16);
        v[i] = (float)k / 8.0f;
    }
    ampc_tensor *t = ampc_tensor_from_f32(AMPC_F32, ndim, shape, v);
    free(v);
    ASSERT_NOT_NULL_MSG(t);
    if (requires_grad) ASSERT_OK(ampc_tensor_set_requires_grad(t, true));
    return t;
}

#define ASSERT_DTYPE(expr, dt)                                                                     \
    do {                                                                                           \
        ampc_tensor *t_ = (expr);                                                                  \
        if (!t_) fail_msg("%s is NULL: %s", #expr, ampc_last_error());                             \
        if (ampc_tensor_dtype(t_) != (dt))                                                         \
            fail_msg("%s is %s, expected %s", #expr, ampc_dtype_name(ampc_tensor_dtype(t_)),       \
                     ampc_dtype_name(dt));                                                         \
    } while (0)

// ---------------------------------------------------------------------------------------------
// Policy table

static void test_every_op_has_a_policy(void **state) {
    (void)state;
    for (int op = 0; op < AMPC_OP_COUNT; op++) {
        for (int k = 0; k < 2; k++) {
            ampc_policy p = ampc_op_policy((ampc_op)op, ac_dtypes[k]);
            if (p == AMPC_POLICY_UNSET)
                fail_msg("op %d (%s) has no autocast policy for %s", op, ampc_op_name((ampc_op)op), ampc_dtype_name(ac_dtypes[k]));
            assert_string_not_equal(ampc_policy_name(p), "unset");
        }
        assert_string_not_equal(ampc_op_name((ampc_op)op), "?");
    }
    assert_int_equal(ampc_op_policy(AMPC_OP_LINEAR, AMPC_F16), AMPC_POLICY_LOWER);
    assert_int_equal(ampc_op_policy(AMPC_OP_MATMUL, AMPC_BF16), AMPC_POLICY_LOWER);
    assert_int_equal(ampc_op_policy(AMPC_OP_SOFTMAX, AMPC_BF16), AMPC_POLICY_FP32);
    assert_int_equal(ampc_op_policy(AMPC_OP_COUNT, AMPC_F16), AMPC_POLICY_UNSET);
}

static void test_state_and_nesting(void **state) {
    (void)state;
    assert_false(ampc_autocast_is_enabled());
    ampc_autocast_enter(AMPC_F16, true);
    assert_true(ampc_autocast_is_enabled());
    assert_int_equal(ampc_autocast_dtype(), AMPC_F16);
    ampc_autocast_enter(AMPC_BF16, true);
    assert_int_equal(ampc_autocast_dtype(), AMPC_BF16);
    ampc_autocast_enter(AMPC_BF16, false);
    assert_false(ampc_autocast_is_enabled());
    ampc_autocast_exit();
    assert_true(ampc_autocast_is_enabled());
    assert_int_equal(ampc_autocast_dtype(), AMPC_BF16);
    ampc_autocast_exit();
    assert_int_equal(ampc_autocast_dtype(), AMPC_F16);
    ampc_autocast_exit();
    assert_false(ampc_autocast_is_enabled());
    /* errors: exit without enter; a non-16-bit dtype makes a disabled region */
    ampc_clear_error();
    ampc_autocast_exit();
    assert_true(ampc_last_status() == AMPC_ERR_STATE);
    ampc_clear_error();
    ampc_autocast_enter(AMPC_F32, true);
    assert_true(ampc_last_status() == AMPC_ERR_DTYPE);
    assert_false(ampc_autocast_is_enabled());
    ampc_autocast_exit();
}

// ---------------------------------------------------------------------------------------------
// Output dtypes per op

static void test_output_dtypes(void **state) {
    (void)state;
    for (int k = 0; k < 2; k++) {
        const ampc_dtype ac = ac_dtypes[k];
        ampc_scope_begin();
        ampc_tensor *x32 = exact_tensor(2, (int64_t[]){4, 5}, 1, true, false);
        ampc_tensor *y32 = exact_tensor(2, (int64_t[]){4, 5}, 2, true, false);
        ampc_tensor *w32 = exact_tensor(2, (int64_t[]){3, 5}, 3, false, true);
        ampc_tensor *b32 = exact_tensor(1, (int64_t[]){3}, 4, false, true);
        ampc_tensor *m32 = exact_tensor(2, (int64_t[]){5, 3}, 5, false, false);
        ampc_tensor *x16 = ampc_cast(x32, ac), *y16 = ampc_cast(y32, ac);
        ampc_tensor *labels = ampc_tensor_from_i64(1, (int64_t[]){4}, (int64_t[]){0, 4, 2, 1});
        ASSERT_NOT_NULL_MSG(x16);

        ampc_autocast_enter(ac, true);
        /* lower precision */
        ASSERT_DTYPE(ampc_linear(x32, w32, b32), ac);
        ASSERT_DTYPE(ampc_linear(x16, w32, NULL), ac);
        ASSERT_DTYPE(ampc_matmul(x32, m32), ac);
        ASSERT_DTYPE(ampc_matmul(x16, m32), ac);
        /* fp32, even from 16-bit inputs */
        ASSERT_DTYPE(ampc_softmax(x16, 1), AMPC_F32);
        ASSERT_DTYPE(ampc_log_softmax(x16, -1), AMPC_F32);
        ASSERT_DTYPE(ampc_sum(x16, AMPC_ALL_DIMS, false), AMPC_F32);
        ASSERT_DTYPE(ampc_sum(x16, 0, true), AMPC_F32);
        ASSERT_DTYPE(ampc_exp(x16), AMPC_F32);
        ASSERT_DTYPE(ampc_log(x16), AMPC_F32);
        ASSERT_DTYPE(ampc_pow(x16, 2.0), AMPC_F32);
        ASSERT_DTYPE(ampc_mse_loss(x16, y16, AMPC_REDUCTION_MEAN), AMPC_F32);
        ASSERT_DTYPE(ampc_mse_loss(x16, y32, AMPC_REDUCTION_NONE), AMPC_F32);
        ASSERT_DTYPE(ampc_cross_entropy(x16, labels, NULL), AMPC_F32);
        /* the inputs' dtype, with type promotion for binary ops */
        ASSERT_DTYPE(ampc_add(x16, x32), AMPC_F32);
        ASSERT_DTYPE(ampc_add(x16, y16), ac);
        ASSERT_DTYPE(ampc_mul(y32, x16), AMPC_F32);
        ASSERT_DTYPE(ampc_relu(x16), ac);
        ASSERT_DTYPE(ampc_relu(x32), AMPC_F32);
        ASSERT_DTYPE(ampc_mul_scalar(x16, 3.0), ac);
        ASSERT_DTYPE(ampc_reshape(x16, 1, (int64_t[]){20}), ac);
        ASSERT_DTYPE(ampc_mean(x16, AMPC_ALL_DIMS, false), ac);
        /* a disabled region inside runs in fp32 (inputs keep their dtype) */
        ampc_autocast_enter(ac, false);
        ASSERT_DTYPE(ampc_linear(x32, w32, b32), AMPC_F32);
        ASSERT_DTYPE(ampc_matmul(x32, m32), AMPC_F32);
        ASSERT_DTYPE(ampc_softmax(x16, 1), ac);
        ampc_autocast_exit();
        ASSERT_DTYPE(ampc_linear(x32, w32, b32), ac);   /* restored */
        ampc_autocast_exit();
        /* outside autocast nothing is cast */
        ASSERT_DTYPE(ampc_linear(x32, w32, b32), AMPC_F32);
        ASSERT_DTYPE(ampc_softmax(x16, 1), ac);
        ASSERT_DTYPE(ampc_sum(x16, AMPC_ALL_DIMS, false), ac);
        ampc_scope_end();
    }
}

/* Under autocast, linear is exactly linear on the 16-bit casts of its inputs. */
static void test_linear_equals_explicit_casts(void **state) {
    (void)state;
    for (int k = 0; k < 2; k++) {
        const ampc_dtype ac = ac_dtypes[k];
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_randn(AMPC_F32, 2, (int64_t[]){7, 9}, 0, 1);
        ampc_tensor *w = ampc_tensor_randn(AMPC_F32, 2, (int64_t[]){5, 9}, 0, 1);
        ampc_tensor *b = ampc_tensor_randn(AMPC_F32, 1, (int64_t[]){5}, 0, 1);
        ampc_autocast_enter(ac, true);
        ampc_tensor *y = ampc_linear(x, w, b);
        ampc_autocast_exit();
        ampc_tensor *ref = ampc_linear(ampc_cast(x, ac), ampc_cast(w, ac), ampc_cast(b, ac));
        ASSERT_NOT_NULL_MSG(y);
        ASSERT_NOT_NULL_MSG(ref);
        assert_int_equal(ampc_tensor_dtype(ref), ac);
        assert_memory_equal(ampc_tensor_data(y), ampc_tensor_data(ref), 7 * 5 * 2);
        ampc_scope_end();
    }
}

// ---------------------------------------------------------------------------------------------
// Weight-cast cache

static void test_cache(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *x = exact_tensor(2, (int64_t[]){3, 4}, 6, false, false);
    ampc_tensor *w = exact_tensor(2, (int64_t[]){2, 4}, 7, false, true);
    ampc_tensor *w2 = exact_tensor(2, (int64_t[]){2, 4}, 8, false, true);
    ampc_tensor *plain = exact_tensor(2, (int64_t[]){2, 4}, 9, false, false);
    assert_int_equal(ampc_autocast_cache_size(), 0);

    ampc_autocast_enter(AMPC_F16, true);
    /* the same fp32 parameter used twice is cast once: one entry, one storage */
    ampc_op_args a1, a2;   /* the op front door: it applies the policy (autocast's hook) */
    ASSERT_OK(ampc__op_prepare(AMPC_OP_LINEAR, &a1, 1, &w, 0));
    ASSERT_OK(ampc__op_prepare(AMPC_OP_LINEAR, &a2, 1, &w, 0));
    assert_int_equal(a1.in[0]->dtype, AMPC_F16);
    assert_ptr_equal(a1.in[0]->storage, a2.in[0]->storage);
    assert_int_equal(ampc_autocast_cache_size(), 1);
    ampc__op_args_release(&a1);
    ampc__op_args_release(&a2);
    /* through the op: x requires grad so LinearBackward saves the weight cast */
    ASSERT_OK(ampc_tensor_set_requires_grad(x, true));
    ampc_tensor *y1 = ampc_linear(x, w, NULL), *y2 = ampc_linear(x, w, NULL);
    ASSERT_NOT_NULL_MSG(y1);
    ASSERT_NOT_NULL_MSG(y2);
    assert_int_equal(ampc_autocast_cache_size(), 2);   /* w, and x: an fp32 leaf requiring grad */
    assert_non_null(y1->grad_fn->saved[1]);
    assert_ptr_equal(y1->grad_fn->saved[1]->storage, y2->grad_fn->saved[1]->storage);
    ASSERT_OK(ampc_tensor_set_requires_grad(x, false));

    /* not cached: a tensor that does not require grad, a non-leaf, a 16-bit tensor */
    ampc_tensor *nonleaf = ampc_mul_scalar(w2, 1.0);
    ASSERT_NOT_NULL_MSG(nonleaf);
    ampc_tensor *w16 = ampc_cast(plain, AMPC_F16);
    ASSERT_NOT_NULL_MSG(ampc_linear(x, plain, NULL));
    ASSERT_NOT_NULL_MSG(ampc_linear(x, nonleaf, NULL));
    ASSERT_NOT_NULL_MSG(ampc_linear(x, w16, NULL));
    assert_int_equal(ampc_autocast_cache_size(), 2);

    /* an inner region adds to the cache and does not clear it on exit */
    ampc_autocast_enter(AMPC_F16, true);
    ASSERT_NOT_NULL_MSG(ampc_linear(x, w2, NULL));
    assert_int_equal(ampc_autocast_cache_size(), 3);
    ampc_autocast_exit();
    assert_int_equal(ampc_autocast_cache_size(), 3);
    /* an inner bf16 region gets bf16 casts of the same weight, not the cached f16 one */
    ampc_autocast_enter(AMPC_BF16, true);
    ASSERT_DTYPE(ampc_linear(x, w, NULL), AMPC_BF16);
    assert_int_equal(ampc_autocast_cache_size(), 4);
    ampc_autocast_exit();
    /* a disabled inner region does not cast, so does not cache */
    ampc_autocast_enter(AMPC_F16, false);
    ASSERT_DTYPE(ampc_linear(x, w2, NULL), AMPC_F32);
    ampc_autocast_exit();
    assert_int_equal(ampc_autocast_cache_size(), 4);
    ampc_autocast_exit();
    assert_int_equal(ampc_autocast_cache_size(), 0);   /* the outermost exit clears it */
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Gradients through autocast

static void test_fp32_grads_and_16bit_saved(void **state) {
    (void)state;
    enum { N = 6, IN = 5, OUT = 3 };
    for (int k = 0; k < 2; k++) {
        const ampc_dtype ac = ac_dtypes[k];
        ampc_scope_begin();
        ampc_tensor *x = exact_tensor(2, (int64_t[]){N, IN}, 10, false, true);
        ampc_tensor *w = exact_tensor(2, (int64_t[]){OUT, IN}, 11, false, true);
        ampc_tensor *b = exact_tensor(1, (int64_t[]){OUT}, 12, false, true);
        ampc_memory_reset_peak();
        ampc_autocast_enter(ac, true);
        ampc_tensor *y = ampc_linear(x, w, b);
        ampc_tensor *loss = ampc_sum(y, AMPC_ALL_DIMS, false);
        ampc_autocast_exit();
        ASSERT_NOT_NULL_MSG(loss);
        assert_int_equal(ampc_tensor_dtype(y), ac);
        assert_int_equal(ampc_tensor_dtype(loss), AMPC_F32);

        /* the graph: LinearBackward with its inputs from CastBackward, which feeds the leaves */
        assert_string_equal(ampc_tensor_grad_fn_name(y), "LinearBackward");
        const ampc_node *lin = y->grad_fn;
        for (int i = 0; i < 3; i++) {
            assert_non_null(lin->next[i]);
            assert_string_equal(lin->next[i]->name, "CastBackward");
            assert_string_equal(lin->next[i]->next[0]->name, "AccumulateGrad");
            assert_int_equal(lin->in[i].dtype, ac);
        }
        /* every tensor saved for backward is 16-bit */
        int n_saved = 0;
        for (int i = 0; i < AMPC_NODE_MAX_SAVED; i++) {
            if (!lin->saved[i]) continue;
            n_saved++;
            if (lin->saved[i]->dtype != ac)
                fail_msg("LinearBackward saved[%d] is %s, expected %s", i, ampc_dtype_name(lin->saved[i]->dtype),
                         ampc_dtype_name(ac));
        }
        assert_true(n_saved >= 2);

        ASSERT_OK(ampc_backward(loss));
        ampc_tensor *gw = ampc_tensor_grad(w), *gx = ampc_tensor_grad(x), *gb = ampc_tensor_grad(b);
        ASSERT_NOT_NULL_MSG(gw);
        ASSERT_NOT_NULL_MSG(gx);
        ASSERT_NOT_NULL_MSG(gb);
        assert_int_equal(ampc_tensor_dtype(gw), AMPC_F32);
        assert_int_equal(ampc_tensor_dtype(gx), AMPC_F32);
        assert_int_equal(ampc_tensor_dtype(gb), AMPC_F32);
        /* d sum(x w^T + b): dw[o][i] = sum_n x[n][i], dx[n][i] = sum_o w[o][i], db = N; the
           inputs are exact in 16 bits, each gradient is rounded once to the autocast dtype */
        double *xv = tu_values(x), *wv = tu_values(w), *gwv = tu_values(gw), *gxv = tu_values(gx), *gbv = tu_values(gb);
        double rw[OUT * IN], rx[N * IN], rb[OUT];
        for (int o = 0; o < OUT; o++) {
            rb[o] = N;
            for (int i = 0; i < IN; i++) {
                rw[o * IN + i] = 0;
                for (int n = 0; n < N; n++) rw[o * IN + i] += xv[n * IN + i];
            }
        }
        for (int n = 0; n < N; n++)
            for (int i = 0; i < IN; i++) {
                rx[n * IN + i] = 0;
                for (int o = 0; o < OUT; o++) rx[n * IN + i] += wv[o * IN + i];
            }
        tu_assert_close("dw", gwv, rw, OUT * IN, 0, tu_eps(ac));
        tu_assert_close("dx", gxv, rx, N * IN, 0, tu_eps(ac));
        tu_assert_close("db", gbv, rb, OUT, 0, 0);
        free(xv);
        free(wv);
        free(gwv);
        free(gxv);
        free(gbv);
        ampc_scope_end();
    }
}

/* An input batch that needs no gradient is saved uncast when the caller holds its storage (a
   view of it reaches the op, as through a model's flatten): the graph then holds no 16-bit
   copy of it (activation memory drops by exactly that copy), and the weight gradients, from the
   recast in backward, are bit-identical to those from a saved copy. A tensor nobody else
   holds is saved as its cast, as before. Linear and conv2d alike. */
static void test_input_batch_saved_uncast(void **state) {
    (void)state;
    for (int op = 0; op < 2; op++) {
        const int64_t xs_lin[2] = {64, 48}, xs_conv[4] = {4, 3, 12, 12};
        const int64_t *xs = op ? xs_conv : xs_lin;
        int nd = op ? 4 : 2;
        ampc_tensor *grads[2];
        int64_t activ[2];
        for (int shared = 0; shared < 2; shared++) {
            ampc_scope_begin();
            ampc_manual_seed(5);
            ampc_tensor *batch = ampc_tensor_rand(AMPC_F32, nd, xs, -1, 1);
            ampc_tensor *w = op ? ampc_tensor_rand(AMPC_F32, 4, (int64_t[]){8, 3, 3, 3}, -1, 1)
                                : ampc_tensor_rand(AMPC_F32, 2, (int64_t[]){16, 48}, -1, 1);
            ampc_tensor_set_requires_grad(w, true);
            /* shared: a view of the batch (the batch holds the storage too); else the batch alone */
            ampc_tensor *x = shared ? ampc_tensor_detach(batch) : batch;
            ampc_autocast_enter(AMPC_BF16, true);
            ampc_tensor *w16 = ampc_cast(w, AMPC_BF16);   /* cached: not counted as an activation below */
            (void)w16;
            int64_t before = (int64_t)ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS];
            ampc_tensor *y = op ? ampc_conv2d(x, w, NULL, NULL) : ampc_linear(x, w, NULL);
            ampc_tensor *loss = ampc_sum(ampc_mul(y, y), AMPC_ALL_DIMS, false);
            ampc_autocast_exit();
            ASSERT_NOT_NULL_MSG(loss);
            activ[shared] = (int64_t)ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS] - before;
            const ampc_node *n = y->grad_fn;
            assert_int_equal(n->saved[0]->dtype, shared ? AMPC_F32 : AMPC_BF16);
            ASSERT_OK(ampc_backward(loss));
            grads[shared] = ampc_tensor_to(ampc_tensor_grad(w), AMPC_DEVICE_CPU, AMPC_F32);
            ampc_tensor_own(grads[shared]);
            ampc_scope_end();
        }
        int64_t numel = 1;
        for (int i = 0; i < nd; i++) numel *= xs[i];
        assert_int_equal(activ[0] - activ[1], (int64_t)ampc__mem_block_size((size_t)numel * 2));
        double *g0 = tu_values(grads[0]), *g1 = tu_values(grads[1]);
        tu_assert_close(op ? "conv dw" : "linear dw", g1, g0, (size_t)ampc_tensor_numel(grads[0]), 0, 0);
        free(g0);
        free(g1);
        ampc_tensor_free(grads[0]);
        ampc_tensor_free(grads[1]);
    }
}

/* Under autocast the weight and bias gradients of a linear layer are written in fp32 straight
   from the kernels' f32 accumulators: no rounding to 16 bits (PyTorch rounds them to the
   autocast dtype, then widens). Inputs 1 + k/128 are exact in f16 and bf16; every product and
   partial sum of 64 rows needs at most 22 significant bits, so the f32 results are exact in
   any summation order while their 16-bit roundings are not. The cast cache and the gradients
   are counted under their own memory kinds. */
static void test_weight_grads_unrounded(void **state) {
    (void)state;
    enum { N = 64, IN = 5, OUT = 3 };
    for (int k = 0; k < 2; k++) {
        const ampc_dtype ac = ac_dtypes[k];
        ampc_scope_begin();
        float xv[N * IN], wv[OUT * IN], gv[N * OUT];
        uint64_t s = 99 + (uint64_t)k;
        for (int i = 0; i < N * IN; i++) xv[i] = 1.0f + (float)(int)tu_uniform(&s, 0, 128) / 128.0f;
        for (int i = 0; i < OUT * IN; i++) wv[i] = 1.0f + (float)(int)tu_uniform(&s, 0, 128) / 128.0f;
        for (int i = 0; i < N * OUT; i++) gv[i] = 1.0f + (float)(int)tu_uniform(&s, 0, 128) / 128.0f;
        ampc_tensor *x = ampc_tensor_from_f32(AMPC_F32, 2, (int64_t[]){N, IN}, xv);
        ampc_tensor *w = ampc_tensor_from_f32(AMPC_F32, 2, (int64_t[]){OUT, IN}, wv);
        ampc_tensor *b = ampc_tensor_from_f32(AMPC_F32, 1, (int64_t[]){OUT}, wv);
        ampc_tensor *g = ampc_tensor_from_f32(ac, 2, (int64_t[]){N, OUT}, gv);
        ASSERT_NOT_NULL_MSG(g);
        ASSERT_OK(ampc_tensor_set_requires_grad(w, true));
        ASSERT_OK(ampc_tensor_set_requires_grad(b, true));
        size_t casts0 = ampc_memory_stats().current[AMPC_MEM_CASTS];
        ampc_autocast_enter(ac, true);
        ampc_tensor *y = ampc_linear(x, w, b);
        ASSERT_NOT_NULL_MSG(y);
        /* the 16-bit copies of w and b are the cast cache's memory */
        assert_true(ampc_memory_stats().current[AMPC_MEM_CASTS] - casts0 >= (size_t)(OUT * IN + OUT) * 2);
        ampc_autocast_exit();
        ASSERT_OK(ampc_backward_with_grad(y, g));
        ampc_tensor *gw = ampc_tensor_grad(w), *gb = ampc_tensor_grad(b);
        ASSERT_NOT_NULL_MSG(gw);
        ASSERT_NOT_NULL_MSG(gb);
        assert_int_equal(ampc_tensor_dtype(gw), AMPC_F32);
        double rw[OUT * IN], rb[OUT];
        for (int o = 0; o < OUT; o++) {
            rb[o] = 0;
            for (int n = 0; n < N; n++) rb[o] += gv[n * OUT + o];
            for (int i = 0; i < IN; i++) {
                rw[o * IN + i] = 0;
                for (int n = 0; n < N; n++) rw[o * IN + i] += (double)gv[n * OUT + o] * xv[n * IN + i];
            }
        }
        double *gwv = tu_values(gw), *gbv = tu_values(gb);
        tu_assert_close("dw (exact in f32)", gwv, rw, OUT * IN, 0, 0);
        tu_assert_close("db (exact in f32)", gbv, rb, OUT, 0, 0);
        /* the reference is not representable in 16 bits: a rounded gradient would fail above */
        bool rounded_differs = false;
        for (int i = 0; i < OUT * IN; i++) {
            ampc_tensor *r = ampc_tensor_from_f32(ac, 1, (int64_t[]){1}, (float[]){(float)rw[i]});
            double *rv = tu_values(r);
            rounded_differs |= rv[0] != rw[i];
            free(rv);
        }
        assert_true(rounded_differs);
        free(gwv);
        free(gbv);
        ampc_scope_end();
        /* nothing of the region is left in the cast kind once its graph and scope are gone */
        assert_int_equal(ampc_memory_stats().current[AMPC_MEM_CASTS], casts0);
    }
}

/* The same for a convolution: weight and bias gradients exact in f32 (32 products of 8-bit
   significands per entry), so a rounding to 16 bits anywhere on the way would show. */
static void test_conv_weight_grads_unrounded(void **state) {
    (void)state;
    enum { N = 2, C = 3, H = 6, O = 4, K = 3, OH = H - K + 1 };
    for (int k = 0; k < 2; k++) {
        const ampc_dtype ac = ac_dtypes[k];
        ampc_scope_begin();
        static float xv[N * C * H * H], wv[O * C * K * K], bv[O], gv[N * O * OH * OH];
        uint64_t s = 7 + (uint64_t)k;
        float *arrays[4] = {xv, wv, bv, gv};
        int sizes[4] = {N * C * H * H, O * C * K * K, O, N * O * OH * OH};
        for (int a = 0; a < 4; a++)
            for (int i = 0; i < sizes[a]; i++) arrays[a][i] = 1.0f + (float)(int)tu_uniform(&s, 0, 128) / 128.0f;
        ampc_tensor *x = ampc_tensor_from_f32(AMPC_F32, 4, (int64_t[]){N, C, H, H}, xv);
        ampc_tensor *w = ampc_tensor_from_f32(AMPC_F32, 4, (int64_t[]){O, C, K, K}, wv);
        ampc_tensor *b = ampc_tensor_from_f32(AMPC_F32, 1, (int64_t[]){O}, bv);
        ampc_tensor *g = ampc_tensor_from_f32(ac, 4, (int64_t[]){N, O, OH, OH}, gv);
        ASSERT_NOT_NULL_MSG(g);
        ASSERT_OK(ampc_tensor_set_requires_grad(w, true));
        ASSERT_OK(ampc_tensor_set_requires_grad(b, true));
        ampc_autocast_enter(ac, true);
        ampc_tensor *y = ampc_conv2d(x, w, b, NULL);
        ampc_autocast_exit();
        ASSERT_NOT_NULL_MSG(y);
        assert_int_equal(ampc_tensor_dtype(y), ac);
        ASSERT_OK(ampc_backward_with_grad(y, g));
        double rw[O * C * K * K] = {0}, rb[O] = {0};
        for (int n = 0; n < N; n++)
            for (int o = 0; o < O; o++)
                for (int i = 0; i < OH; i++)
                    for (int j = 0; j < OH; j++) {
                        double gij = gv[((n * O + o) * OH + i) * OH + j];
                        rb[o] += gij;
                        for (int c = 0; c < C; c++)
                            for (int kh = 0; kh < K; kh++)
                                for (int kw = 0; kw < K; kw++)
                                    rw[((o * C + c) * K + kh) * K + kw] += gij * xv[((n * C + c) * H + i + kh) * H + j + kw];
                    }
        ampc_tensor *gw = ampc_tensor_grad(w), *gb = ampc_tensor_grad(b);
        ASSERT_NOT_NULL_MSG(gw);
        ASSERT_NOT_NULL_MSG(gb);
        assert_int_equal(ampc_tensor_dtype(gw), AMPC_F32);
        double *gwv = tu_values(gw), *gbv = tu_values(gb);
        tu_assert_close("conv dw (exact in f32)", gwv, rw, O * C * K * K, 0, 0);
        tu_assert_close("conv db (exact in f32)", gbv, rb, O, 0, 0);
        free(gwv);
        free(gbv);
        ampc_scope_end();
    }
}

/* Two forward/backward passes in one region reuse the cached weight cast and both reach the
   parameter (PyTorch accumulates: the gradient doubles). */
static void test_backward_twice_in_one_region(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *x = exact_tensor(2, (int64_t[]){4, 3}, 13, false, false);
    ampc_tensor *w = exact_tensor(2, (int64_t[]){2, 3}, 14, false, true);
    ampc_autocast_enter(AMPC_BF16, true);
    ASSERT_OK(ampc_backward(ampc_sum(ampc_linear(x, w, NULL), AMPC_ALL_DIMS, false)));
    double *g1 = tu_values(ampc_tensor_grad(w));
    ASSERT_OK(ampc_backward(ampc_sum(ampc_linear(x, w, NULL), AMPC_ALL_DIMS, false)));
    ampc_autocast_exit();
    double *g2 = tu_values(ampc_tensor_grad(w));
    for (int i = 0; i < 6; i++) g1[i] *= 2;
    tu_assert_close("accumulated dw", g2, g1, 6, 0, 0);
    free(g1);
    free(g2);

    /* a cast cached under no-grad is redone when grad is on: the weight still gets its grad */
    ampc_tensor_zero_grad(w);
    ampc_autocast_enter(AMPC_F16, true);
    ampc_no_grad_enter();
    ASSERT_NOT_NULL_MSG(ampc_linear(x, w, NULL));
    ampc_no_grad_exit();
    ampc_tensor *y = ampc_linear(x, w, NULL);
    ampc_autocast_exit();
    ASSERT_NOT_NULL_MSG(y);
    assert_true(ampc_tensor_requires_grad(y));
    ASSERT_OK(ampc_backward(ampc_sum(y, AMPC_ALL_DIMS, false)));
    assert_non_null(ampc_tensor_grad(w));
    ampc_scope_end();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_op_has_a_policy),
        cmocka_unit_test(test_state_and_nesting),
        cmocka_unit_test(test_output_dtypes),
        cmocka_unit_test(test_linear_equals_explicit_casts),
        cmocka_unit_test(test_cache),
        cmocka_unit_test(test_fp32_grads_and_16bit_saved),
        cmocka_unit_test(test_weight_grads_unrounded),
        cmocka_unit_test(test_conv_weight_grads_unrounded),
        cmocka_unit_test(test_backward_twice_in_one_region),
        cmocka_unit_test(test_input_batch_saved_uncast),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
