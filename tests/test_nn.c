/*
 * test_nn.c - modules: PyTorch parameter names and counts, default init (bounds, seeding,
 * draw order), freezing, Linear forward against the REF device in f64 (fp32 and autocast),
 * train/eval and dropout, Flatten, Sequential ownership and errors, and memory: a module's
 * intermediates live only as long as the autograd graph needs them.
 */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "nn/nn.h"
#include "optim/optim.h"

static ampc_module *mlp(void) {
    return ampc_sequential(5, ampc_linear_new(8, 16, true), ampc_relu_new(), ampc_linear_new(16, 16, true),
                           ampc_relu_new(), ampc_linear_new(16, 1, true));
}

/* Allocator size class of a request (64-byte granularity up to 4 KiB; the sizes used here). */
static size_t block(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

// ---------------------------------------------------------------------------------------------

static void test_names_and_counts(void **state) {
    (void)state;
    size_t mem0 = ampc_memory_stats().current[AMPC_MEM_PARAMETERS];
    ampc_module *net = mlp();
    ASSERT_NOT_NULL_MSG(net);
    assert_string_equal(ampc_module_type(net), "Sequential");
    assert_int_equal(ampc_module_num_children(net), 5);
    const char *types[] = {"Linear", "ReLU", "Linear", "ReLU", "Linear"};
    for (int i = 0; i < 5; i++) assert_string_equal(ampc_module_type(ampc_module_child(net, i)), types[i]);
    assert_null(ampc_module_child(net, 5));
    ampc_tensor **p;
    const char **names;
    int n = ampc_module_parameters(net, &p, &names);
    assert_int_equal(n, 6);
    const char *expect[] = {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"};
    const int64_t shapes[6][2] = {{16, 8}, {16, 0}, {16, 16}, {16, 0}, {1, 16}, {1, 0}};
    size_t bytes = 0;
    for (int i = 0; i < 6; i++) {
        assert_string_equal(names[i], expect[i]);
        assert_int_equal(ampc_tensor_ndim(p[i]), shapes[i][1] ? 2 : 1);
        assert_int_equal(ampc_tensor_dim(p[i], 0), shapes[i][0]);
        if (shapes[i][1]) assert_int_equal(ampc_tensor_dim(p[i], 1), shapes[i][1]);
        assert_int_equal(ampc_tensor_dtype(p[i]), AMPC_F32);
        assert_true(ampc_tensor_requires_grad(p[i]) && ampc_tensor_is_leaf(p[i]));
        bytes += block((size_t)ampc_tensor_numel(p[i]) * 4);
    }
    assert_int_equal(ampc_module_num_parameters(net, false), 8 * 16 + 16 + 16 * 16 + 16 + 16 + 1);
    assert_int_equal(ampc_module_num_parameters(net, true), 8 * 16 + 16 + 16 * 16 + 16 + 16 + 1);
    /* parameters are counted as such, and out of every scope (a scope end does not free them) */
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_PARAMETERS] - mem0, bytes);
    ampc_scope_begin();
    ampc_scope_end();
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_PARAMETERS] - mem0, bytes);
    /* the arrays are cached, not rebuilt on every call */
    ampc_tensor **p2;
    assert_int_equal(ampc_module_parameters(net, &p2, NULL), 6);
    assert_ptr_equal(p, p2);
    ampc_module_free(net);
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_PARAMETERS], mem0);

    /* nesting, a bias-free Linear, layers without parameters */
    ampc_module *nested = ampc_sequential(3, ampc_flatten_new(),
                                          ampc_sequential(2, ampc_linear_new(4, 3, false), ampc_gelu_new()),
                                          ampc_sequential(3, ampc_tanh_new(), ampc_linear_new(3, 2, true), ampc_sigmoid_new()));
    ASSERT_NOT_NULL_MSG(nested);
    n = ampc_module_parameters(nested, NULL, &names);
    assert_int_equal(n, 3);
    assert_string_equal(names[0], "1.0.weight");
    assert_string_equal(names[1], "2.1.weight");
    assert_string_equal(names[2], "2.1.bias");
    assert_int_equal(ampc_module_num_parameters(nested, false), 12 + 6 + 2);
    const char *t2[] = {"Flatten", "GELU", "Tanh", "Sigmoid", "Dropout"};
    assert_string_equal(ampc_module_type(ampc_module_child(nested, 0)), t2[0]);
    assert_string_equal(ampc_module_type(ampc_module_child(ampc_module_child(nested, 1), 1)), t2[1]);
    assert_string_equal(ampc_module_type(ampc_module_child(ampc_module_child(nested, 2), 0)), t2[2]);
    assert_string_equal(ampc_module_type(ampc_module_child(ampc_module_child(nested, 2), 2)), t2[3]);
    ampc_module *d = ampc_dropout_new(0.1);
    assert_string_equal(ampc_module_type(d), t2[4]);
    ampc_module_free(d);
    /* SiLU: the op as a layer */
    ampc_module *silu = ampc_silu_new();
    assert_string_equal(ampc_module_type(silu), "SiLU");
    ampc_tensor *sx = ampc_tensor_rand(AMPC_F32, 2, (int64_t[]){3, 5}, -4, 4);
    ampc_tensor *sy = ampc_module_forward(silu, sx), *sref = ampc_silu(sx);
    ASSERT_NOT_NULL_MSG(sy);
    assert_memory_equal(ampc_tensor_cdata(sy), ampc_tensor_cdata(sref), 15 * sizeof(float));
    ampc_module_free(silu);
    /* state_dict order and names (no buffers in these layers) */
    ampc_tensor **sd;
    const char **sdn;
    assert_int_equal(ampc__module_state_dict(nested, &sd, &sdn), 3);
    assert_string_equal(sdn[2], "2.1.bias");
    ampc_module_free(nested);
    ampc_module_free(NULL);
}

/* Weight and bias ~ U(-1/sqrt(in), 1/sqrt(in)) drawn from the library generator, weight
   first, so ampc_manual_seed reproduces them and the same draws from ampc_tensor_rand match. */
static void test_init_bounds_and_seed(void **state) {
    (void)state;
    ampc_scope_begin();
    const int64_t in = 100, out = 50;
    double bound = 1.0 / sqrt((double)in);
    float fb = (float)bound;   /* an f64 draw below the bound may round up to it in f32 */
    ampc_manual_seed(42);
    ampc_module *a = ampc_linear_new(in, out, true);
    ampc_manual_seed(42);
    ampc_tensor *w_expect = ampc_tensor_rand(AMPC_F32, 2, (int64_t[]){out, in}, -bound, bound);
    ampc_tensor *b_expect = ampc_tensor_rand(AMPC_F32, 1, (int64_t[]){out}, -bound, bound);
    ampc_manual_seed(42);
    ampc_module *b = ampc_linear_new(in, out, true);
    ampc_manual_seed(43);
    ampc_module *c = ampc_linear_new(in, out, true);
    ASSERT_NOT_NULL_MSG(a && b && c);
    ampc_tensor **pa, **pb, **pc;
    assert_int_equal(ampc_module_parameters(a, &pa, NULL), 2);
    ampc_module_parameters(b, &pb, NULL);
    ampc_module_parameters(c, &pc, NULL);
    for (int k = 0; k < 2; k++) {
        size_t n = (size_t)ampc_tensor_numel(pa[k]);
        assert_memory_equal(ampc_tensor_data(pa[k]), ampc_tensor_data(pb[k]), n * 4);
        assert_memory_not_equal(ampc_tensor_data(pa[k]), ampc_tensor_data(pc[k]), n * 4);
        assert_memory_equal(ampc_tensor_data(pa[k]), ampc_tensor_data(k ? b_expect : w_expect), n * 4);
        double *v = tu_values(pa[k]);
        double lo = 1, hi = -1, mean = 0;
        for (size_t i = 0; i < n; i++) {
            assert_true(fabs(v[i]) <= fb);
            lo = fmin(lo, v[i]);
            hi = fmax(hi, v[i]);
            mean += v[i] / (double)n;
        }
        /* uniform on the whole interval: extremes near the bounds (n >= 50 draws: the chance
           that none lands in the outer 15% on one side is 0.85^50 < 3e-4, and this is seeded),
           mean within 4 standard deviations bound/sqrt(3n) of 0 */
        assert_true(hi > 0.85 * bound && lo < -0.85 * bound);
        assert_true(fabs(mean) < 4 * bound / sqrt(3.0 * (double)n));
        free(v);
    }
    ampc_module_free(a);
    ampc_module_free(b);
    ampc_module_free(c);
    /* negative sizes are errors */
    assert_null(ampc_linear_new(-1, 2, true));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    ampc_scope_end();
}

/* Linear forward vs the REF device in f64 on the same (converted) weights, in fp32 and under
   autocast. Bound per element: the inputs of the product round to the compute dtype (2u_in
   relative per term), the sum of K terms accumulates in fp32 (K u32), the output rounds once
   (u_out): err <= (2u_in + (K+2) u32) * sum_k |x_k w_k| + u32 |b| + u_out |y|. */
static void test_linear_forward_vs_ref(void **state) {
    (void)state;
    const int64_t N = 5, K = 37, M = 7;
    const ampc_dtype modes[] = {AMPC_F32, AMPC_F16, AMPC_BF16};
    ampc_module *lin = ampc_linear_new(K, M, true);
    ASSERT_NOT_NULL_MSG(lin);
    ampc_tensor **p;
    ampc_module_parameters(lin, &p, NULL);
    double xs[5 * 37];
    tu_fill_uniform(xs, (size_t)(N * K), 9, -2, 2);
    for (size_t m = 0; m < sizeof modes / sizeof modes[0]; m++) {
        ampc_dtype dt = modes[m];
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_from_f64(AMPC_F32, 2, (int64_t[]){N, K}, xs);
        if (dt != AMPC_F32) ampc_autocast_enter(dt, true);
        ampc_tensor *y = ampc_module_forward(lin, x);
        if (dt != AMPC_F32) ampc_autocast_exit();
        ASSERT_NOT_NULL_MSG(y);
        assert_int_equal(ampc_tensor_dtype(y), dt);
        assert_int_equal(ampc_tensor_dim(y, 0), N);
        assert_int_equal(ampc_tensor_dim(y, 1), M);
        assert_string_equal(ampc_tensor_grad_fn_name(y), "LinearBackward");
        /* the oracle: the fp32 tensors converted exactly to f64 on REF */
        ampc_tensor *y_ref = ampc_linear(ampc_tensor_to(x, AMPC_DEVICE_REF, AMPC_F64),
                                         ampc_tensor_to(p[0], AMPC_DEVICE_REF, AMPC_F64),
                                         ampc_tensor_to(p[1], AMPC_DEVICE_REF, AMPC_F64));
        ASSERT_NOT_NULL_MSG(y_ref);
        double *got = tu_values(y), *ref = tu_values(y_ref), *w = tu_values(p[0]), *b = tu_values(p[1]);
        double uin = tu_eps(dt), u32 = tu_eps(AMPC_F32);
        for (int64_t i = 0; i < N; i++)
            for (int64_t j = 0; j < M; j++) {
                double mag = 0;
                for (int64_t k = 0; k < K; k++) mag += fabs(xs[i * K + k] * w[j * K + k]);
                double r = ref[i * M + j];
                double tol = (2 * uin + (double)(K + 2) * u32) * mag + u32 * fabs(b[j]) + uin * fabs(r);
                if (!(fabs(got[i * M + j] - r) <= tol))
                    fail_msg("%s: y[%lld,%lld] = %.9g, ref %.9g, bound %.3g", ampc_dtype_name(dt), (long long)i,
                             (long long)j, got[i * M + j], r, tol);
            }
        free(got);
        free(ref);
        free(w);
        free(b);
        ampc_scope_end();
    }
    ampc_module_free(lin);
}

/* Frozen parameters get no grad and an optimizer step leaves them bit-identical. */
static void test_freeze(void **state) {
    (void)state;
    ampc_module *net = mlp();
    ASSERT_NOT_NULL_MSG(net);
    ampc_module_requires_grad(ampc_module_child(net, 0), false);
    assert_int_equal(ampc_module_num_parameters(net, true), 16 * 16 + 16 + 16 + 1);
    ampc_tensor **p;
    int n = ampc_module_parameters(net, &p, NULL);
    float before[6][256];
    for (int i = 0; i < n; i++) ASSERT_OK(ampc_tensor_to_f32(p[i], before[i], 256));
    ampc_optimizer *opt = ampc_sgd_new(net, &(ampc_sgd_options){.lr = 0.1, .momentum = 0.9});
    ASSERT_NOT_NULL_MSG(opt);
    assert_int_equal(ampc_optimizer_num_params(opt), 6);
    for (int step = 0; step < 2; step++) {
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_randn(AMPC_F32, 2, (int64_t[]){32, 8}, 0, 1);
        ampc_tensor *y = ampc_tensor_randn(AMPC_F32, 2, (int64_t[]){32, 1}, 0, 1);
        ASSERT_OK(ampc_backward(ampc_mse_loss(ampc_module_forward(net, x), y, AMPC_REDUCTION_MEAN)));
        assert_null(ampc_tensor_grad(p[0]));
        assert_null(ampc_tensor_grad(p[1]));
        for (int i = 2; i < n; i++) assert_non_null(ampc_tensor_grad(p[i]));
        ASSERT_OK(ampc_optimizer_step(opt));
        ampc_optimizer_zero_grad(opt);
        ampc_scope_end();
    }
    for (int i = 0; i < n; i++) {
        float after[256];
        ASSERT_OK(ampc_tensor_to_f32(p[i], after, 256));
        size_t bytes = (size_t)ampc_tensor_numel(p[i]) * 4;
        if (i < 2) assert_memory_equal(before[i], after, bytes);
        else assert_memory_not_equal(before[i], after, bytes);
    }
    assert_null(opt->state[0][0]);   /* no momentum buffer for the frozen ones */
    /* unfreeze: everything trains again */
    ampc_module_requires_grad(net, true);
    assert_int_equal(ampc_module_num_parameters(net, true), ampc_module_num_parameters(net, false));
    ampc_optimizer_free(opt);
    ampc_module_free(net);
}

/* Dropout is active in training mode only; train/eval recurse. */
static void test_train_eval_dropout(void **state) {
    (void)state;
    ampc_module *net = ampc_sequential(2, ampc_flatten_new(), ampc_sequential(1, ampc_dropout_new(0.5)));
    ASSERT_NOT_NULL_MSG(net);
    ampc_module *drop = ampc_module_child(ampc_module_child(net, 1), 0);
    assert_true(ampc_module_is_training(net) && ampc_module_is_training(drop));
    ampc_scope_begin();
    const int64_t n = 4096;
    ampc_tensor *x = ampc_tensor_full(AMPC_F32, 3, (int64_t[]){4, 32, 32}, 1.5);
    ampc_tensor *y = ampc_module_forward(net, x);
    ASSERT_NOT_NULL_MSG(y);
    assert_int_equal(ampc_tensor_ndim(y), 2);
    assert_int_equal(ampc_tensor_dim(y, 1), 1024);
    double *v = tu_values(y);
    int zeros = 0;
    for (int64_t i = 0; i < n; i++) {
        assert_true(v[i] == 0 || v[i] == 3.0);   /* kept values scaled by 1/(1-p) */
        zeros += v[i] == 0;
    }
    /* Binomial(4096, 0.5): 6 standard deviations is 192 */
    assert_true(abs(zeros - 2048) < 192);
    free(v);
    ampc_module_train(net, false);
    assert_true(!ampc_module_is_training(net) && !ampc_module_is_training(drop));
    y = ampc_module_forward(net, x);
    ASSERT_NOT_NULL_MSG(y);
    v = tu_values(y);
    for (int64_t i = 0; i < n; i++) assert_true(v[i] == 1.5);
    free(v);
    ampc_module_train(net, true);
    assert_true(ampc_module_is_training(drop));
    ampc_scope_end();
    ampc_module_free(net);
    assert_null(ampc_dropout_new(1.5));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
}

/* Sequential owns its children; a NULL child frees the others and keeps the first error. */
static void test_sequential_errors(void **state) {
    (void)state;
    size_t mem0 = ampc_memory_stats().current[AMPC_MEM_PARAMETERS];
    ampc_clear_error();
    assert_null(ampc_sequential(3, ampc_linear_new(4, 4, true), NULL, ampc_relu_new()));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    assert_non_null(strstr(ampc_last_error(), "child 1"));
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_PARAMETERS], mem0);   /* the Linear was freed */
    ampc_clear_error();
    assert_null(ampc_sequential(2, ampc_linear_new(4, 4, true), ampc_dropout_new(-1)));
    assert_non_null(strstr(ampc_last_error(), "Dropout"));   /* the constructor's error is kept */
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_PARAMETERS], mem0);
    ampc_module *empty = ampc_sequential(0);
    ASSERT_NOT_NULL_MSG(empty);
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){3});
    assert_ptr_equal(ampc_module_forward(empty, x), x);   /* identity */
    assert_null(ampc_module_forward(NULL, x));
    ampc_clear_error();
    assert_null(ampc_module_forward(empty, NULL));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    ampc_scope_end();
    ampc_module_free(empty);
    ampc_module *from = ampc_sequential_from(2, (ampc_module *[]){ampc_relu_new(), ampc_tanh_new()});
    ASSERT_NOT_NULL_MSG(from);
    assert_string_equal(ampc_module_type(ampc_module_child(from, 1)), "Tanh");
    ampc_module_free(from);
}

/* A module's intermediates are not in the caller's scope: without grad only the input and the
   output remain after the forward; with grad, whatever the graph saved is freed by backward,
   and everything is gone at the scope's end. */
static void test_memory(void **state) {
    (void)state;
    ampc_module *net = mlp();
    ASSERT_NOT_NULL_MSG(net);
    const int64_t B = 64;
    size_t act0 = ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS];
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_randn(AMPC_F32, 2, (int64_t[]){B, 8}, 0, 1);
    ampc_no_grad_enter();
    ampc_tensor *y = ampc_module_forward(net, x);
    ampc_no_grad_exit();
    ASSERT_NOT_NULL_MSG(y);
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS] - act0, block(B * 8 * 4) + block(B * 1 * 4));
    ampc_scope_end();
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS], act0);

    size_t grad0 = ampc_memory_stats().current[AMPC_MEM_GRADIENTS];
    ampc_scope_begin();
    x = ampc_tensor_randn(AMPC_F32, 2, (int64_t[]){B, 8}, 0, 1);
    ampc_tensor *t = ampc_tensor_randn(AMPC_F32, 2, (int64_t[]){B, 1}, 0, 1);
    ampc_tensor *loss = ampc_mse_loss(ampc_module_forward(net, x), t, AMPC_REDUCTION_MEAN);
    ASSERT_NOT_NULL_MSG(loss);
    size_t during = ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS] - act0;
    assert_true(during > block(B * 8 * 4) + block(B * 4) + block(4));   /* the graph saved activations */
    ASSERT_OK(ampc_backward(loss));
    /* backward freed what the graph saved: only x, t, the network's output and the loss (the
       tensors of this scope) remain */
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS] - act0,
                     block(B * 8 * 4) + 2 * block(B * 4) + block(4));
    ampc_scope_end();
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS], act0);
    size_t grads = 0;
    ampc_tensor **p;
    int n = ampc_module_parameters(net, &p, NULL);
    for (int i = 0; i < n; i++) grads += block((size_t)ampc_tensor_numel(p[i]) * 4);
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_GRADIENTS] - grad0, grads);
    ampc_module_free(net);   /* frees the grads with the parameters */
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_GRADIENTS], grad0);
}

/* On the REF device (no fp32) parameters are f64, and the whole loop runs there: the REF
   kernels are the oracle for everything above, so they must be usable through modules. */
static void test_ref_device_module(void **state) {
    (void)state;
    ampc_set_default_device(AMPC_DEVICE_REF);
    ampc_module *lin = ampc_linear_new(3, 2, true);
    ASSERT_NOT_NULL_MSG(lin);
    ampc_tensor **p;
    assert_int_equal(ampc_module_parameters(lin, &p, NULL), 2);
    assert_int_equal(ampc_tensor_dtype(p[0]), AMPC_F64);
    assert_int_equal(ampc_tensor_device(p[0]), AMPC_DEVICE_REF);
    double w[6], b[2];
    ASSERT_OK(ampc_tensor_to_f64(p[0], w, 6));
    ASSERT_OK(ampc_tensor_to_f64(p[1], b, 2));
    ampc_optimizer *opt = ampc_sgd_new(lin, &(ampc_sgd_options){.lr = 0.5});
    ASSERT_NOT_NULL_MSG(opt);
    ampc_scope_begin();
    const double xs[3] = {1, -2, 0.5};
    ampc_tensor *x = ampc_tensor_from_f64(AMPC_F64, 2, (int64_t[]){1, 3}, xs);
    ampc_tensor *y = ampc_module_forward(lin, x);
    ASSERT_NOT_NULL_MSG(y);
    /* d sum(y) / dW[j][k] = x[k], d sum(y) / db[j] = 1: one SGD step subtracts lr times them */
    ASSERT_OK(ampc_backward(ampc_sum(y, AMPC_ALL_DIMS, false)));
    ASSERT_OK(ampc_optimizer_step(opt));
    ampc_scope_end();
    double w2[6], b2[2];
    ASSERT_OK(ampc_tensor_to_f64(p[0], w2, 6));
    ASSERT_OK(ampc_tensor_to_f64(p[1], b2, 2));
    for (int j = 0; j < 2; j++) {
        assert_true(b2[j] == b[j] - 0.5);
        for (int k = 0; k < 3; k++) assert_true(w2[j * 3 + k] == w[j * 3 + k] - 0.5 * xs[k]);
    }
    ampc_optimizer_free(opt);
    ampc_module_free(lin);
    ampc_set_default_device(AMPC_DEVICE_CPU);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names_and_counts),   cmocka_unit_test(test_init_bounds_and_seed),
        cmocka_unit_test(test_linear_forward_vs_ref), cmocka_unit_test(test_freeze),
        cmocka_unit_test(test_train_eval_dropout), cmocka_unit_test(test_sequential_errors),
        cmocka_unit_test(test_memory),             cmocka_unit_test(test_ref_device_module),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
