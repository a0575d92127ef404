/*
 * test_handles.c - API misuse that used to corrupt silently: NULL and stale tensor handles in
 * every accessor, freeing twice (also after many more objects were made and freed), tensors used
 * after their scope ended, modules, optimizers, scalers, datasets, transforms, loaders, metrics
 * logs and data-parallel wrappers used or freed after being freed, an optimizer stepped after
 * its module was freed. Each case checks the return value, ampc_last_status() and that
 * the message names the call; tensors that must not be touched keep their values.
 */
#include "testutil.h"

#include "ampc/dist.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The last error is `status` and its message names `call` and contains `fragment`; clears it. */
static void expect_status(int status, const char *call, const char *fragment) {
    assert_int_equal(ampc_last_status(), status);
    const char *msg = ampc_last_error();
    if (!strstr(msg, call)) fail_msg("error message \"%s\" does not name %s", msg, call);
    if (fragment && !strstr(msg, fragment)) fail_msg("error message \"%s\" does not mention \"%s\"", msg, fragment);
    ampc_clear_error();
}

static ampc_tensor *owned_full(double v) {
    ampc_tensor *t = ampc_tensor_own(ampc_tensor_full(AMPC_F32, 1, (int64_t[]){4}, v));
    ASSERT_NOT_NULL_MSG(t);
    return t;
}

static void assert_all(const ampc_tensor *t, float v) {
    float out[4];
    ASSERT_OK(ampc_tensor_to_f32(t, out, 4));
    for (int i = 0; i < 4; i++) assert_true(out[i] == v);
}

/* Every accessor given t (NULL or stale) returns its documented value and records `status`
   naming the call. */
static void check_accessors(ampc_tensor *t, int status, const char *fragment) {
    float f[4] = {0};
    double d[4] = {0};
    ampc_clear_error();
#define EXPECT(expr, call)                       \
    do {                                         \
        assert_true(expr);                       \
        expect_status(status, call, fragment);   \
    } while (0)
    EXPECT(ampc_tensor_dtype(t) == AMPC_DTYPE_COUNT, "ampc_tensor_dtype");
    EXPECT(ampc_tensor_device(t) == AMPC_DEVICE_COUNT, "ampc_tensor_device");
    EXPECT(ampc_tensor_ndim(t) == -1, "ampc_tensor_ndim");
    EXPECT(ampc_tensor_dim(t, 0) == -1, "ampc_tensor_dim");
    EXPECT(ampc_tensor_numel(t) == -1, "ampc_tensor_numel");
    EXPECT(ampc_tensor_shape(t) == NULL, "ampc_tensor_shape");
    EXPECT(ampc_tensor_memory_format(t) == AMPC_CONTIGUOUS_FORMAT, "ampc_tensor_memory_format");
    EXPECT(ampc_tensor_data(t) == NULL, "ampc_tensor_data");
    EXPECT(ampc_tensor_cdata(t) == NULL, "ampc_tensor_cdata");
    EXPECT(ampc_tensor_to_f32(t, f, 4) == status, "ampc_tensor_to_f32");
    EXPECT(ampc_tensor_to_f64(t, d, 4) == status, "ampc_tensor_to_f64");
    EXPECT(ampc_tensor_copy_from_f32(t, f, 4) == status, "ampc_tensor_copy_from_f32");
    EXPECT(isnan(ampc_tensor_item(t)), "ampc_tensor_item");
    EXPECT(ampc_tensor_to(t, AMPC_DEVICE_CPU, AMPC_F32) == NULL, "ampc_tensor_to");
    EXPECT(ampc_tensor_set_requires_grad(t, true) == status, "ampc_tensor_set_requires_grad");
    EXPECT(!ampc_tensor_requires_grad(t), "ampc_tensor_requires_grad");
    EXPECT(!ampc_tensor_is_leaf(t), "ampc_tensor_is_leaf");
    EXPECT(ampc_tensor_grad(t) == NULL, "ampc_tensor_grad");
    EXPECT(ampc_tensor_grad_fn_name(t) == NULL, "ampc_tensor_grad_fn_name");
    EXPECT(ampc_tensor_detach(t) == NULL, "ampc_tensor_detach");
    ampc_tensor_zero_grad(t);
    expect_status(status, "ampc_tensor_zero_grad", fragment);
#undef EXPECT
}

static void test_null_accessors(void **state) {
    (void)state;
    check_accessors(NULL, AMPC_ERR_INVALID, "tensor is NULL");
    /* NULL keeps the first error, as ops do: a chain can be checked at its end */
    ampc_tensor *bad = ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){-1});
    assert_int_equal(ampc_tensor_numel(bad), -1);
    assert_int_equal(ampc_last_status(), AMPC_ERR_SHAPE);
    ampc_clear_error();
    assert_null(ampc_tensor_keep(NULL));
    expect_status(AMPC_ERR_INVALID, "ampc_tensor_keep", "tensor is NULL");
    assert_null(ampc_tensor_own(NULL));
    expect_status(AMPC_ERR_INVALID, "ampc_tensor_own", "tensor is NULL");
    assert_int_equal(ampc_tensor_free(NULL), AMPC_OK);   /* like free(NULL) */
    assert_int_equal(ampc_last_status(), AMPC_OK);
}

static void test_use_after_scope_end(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *t = ampc_tensor_full(AMPC_F32, 1, (int64_t[]){4}, 2.0);
    ASSERT_NOT_NULL_MSG(t);
    ampc_scope_end();
    check_accessors(t, AMPC_ERR_STATE, "stale (freed, or its scope ended)");
    assert_null(ampc_tensor_keep(t));
    expect_status(AMPC_ERR_STATE, "ampc_tensor_keep", "stale");
    assert_null(ampc_tensor_own(t));
    expect_status(AMPC_ERR_STATE, "ampc_tensor_own", "stale");
    assert_int_equal(ampc_tensor_free(t), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_tensor_free", "stale");
    ampc_module *relu = ampc_relu_new();
    assert_null(ampc_module_forward(relu, t));
    expect_status(AMPC_ERR_STATE, "ampc_module_forward", "tensor handle is stale");
    ampc_module_free(relu);
}

static void test_free_twice(void **state) {
    (void)state;
    ampc_tensor *live = owned_full(2.0);
    /* owned by the user */
    ampc_tensor *t = owned_full(1.0);
    assert_int_equal(ampc_tensor_free(t), AMPC_OK);
    assert_int_equal(ampc_tensor_free(t), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_tensor_free", "stale");
    /* held by a scope */
    ampc_scope_begin();
    t = ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){4});
    assert_int_equal(ampc_tensor_free(t), AMPC_OK);
    assert_int_equal(ampc_tensor_free(t), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_tensor_free", "stale");
    ampc_scope_end();
    assert_all(live, 2.0f);
    ASSERT_OK(ampc_tensor_free(live));
}

/* Free, allocate a new tensor (the freed header is never handed to it), free the old
   handle again: an error, and the new tensor is untouched. */
static void test_free_twice_with_allocation_between(void **state) {
    (void)state;
    ampc_tensor *old = owned_full(1.0);
    ASSERT_OK(ampc_tensor_free(old));
    ampc_tensor *fresh = owned_full(2.0);
    assert_ptr_not_equal(fresh, old);
    assert_int_equal(ampc_tensor_free(old), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_tensor_free", "stale");
    ampc_tensor *more = ampc_add_scalar(fresh, 1.0);   /* the new tensor still works */
    assert_true(ampc_tensor_item(ampc_sum(more, AMPC_ALL_DIMS, false)) == 12.0);
    assert_all(fresh, 2.0f);
    ASSERT_OK(ampc_tensor_free(fresh));
    assert_int_equal(ampc_tensor_free(fresh), AMPC_ERR_STATE);
    ampc_clear_error();
}

/* A tensor autograd still holds: freeing it twice must not drop the graph's reference. */
static void test_free_twice_while_graph_holds_it(void **state) {
    (void)state;
    ampc_scope_begin();
    float xv[4] = {1, 2, 3, 4};
    ampc_tensor *w = ampc_tensor_own(ampc_tensor_from_f32(AMPC_F32, 1, (int64_t[]){4}, xv));
    ASSERT_OK(ampc_tensor_set_requires_grad(w, true));
    ampc_tensor *x = ampc_mul_scalar(w, 1.0);
    ampc_tensor *y = ampc_mul(x, x);   /* saves x for backward */
    ASSERT_OK(ampc_tensor_free(x));
    assert_int_equal(ampc_tensor_free(x), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_tensor_free", "holds no reference");
    assert_null(ampc_tensor_own(x));
    expect_status(AMPC_ERR_STATE, "ampc_tensor_own", "holds no reference");
    ASSERT_OK(ampc_backward(ampc_sum(y, AMPC_ALL_DIMS, false)));
    float g[4];
    ASSERT_OK(ampc_tensor_to_f32(ampc_tensor_grad(w), g, 4));
    for (int i = 0; i < 4; i++) assert_true(g[i] == 2 * xv[i]);
    ampc_scope_end();
    ASSERT_OK(ampc_tensor_free(w));
}

/* Parameters and grads belong to their module / tensor: the user cannot free or own them. */
static void test_borrowed_tensors_refuse_free(void **state) {
    (void)state;
    ampc_module *lin = ampc_linear_new(3, 2, true);
    ASSERT_NOT_NULL_MSG(lin);
    ampc_tensor **p;
    assert_int_equal(ampc_module_parameters(lin, &p, NULL), 2);
    assert_int_equal(ampc_tensor_free(p[0]), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_tensor_free", "holds no reference");
    assert_null(ampc_tensor_own(p[0]));
    expect_status(AMPC_ERR_STATE, "ampc_tensor_own", "holds no reference");
    assert_int_equal(ampc_tensor_numel(p[0]), 6);   /* still the module's */
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_rand(AMPC_F32, 2, (int64_t[]){4, 3}, -1, 1);
    ASSERT_OK(ampc_backward(ampc_sum(ampc_module_forward(lin, x), AMPC_ALL_DIMS, false)));
    ampc_scope_end();
    ampc_tensor *g = ampc_tensor_grad(p[0]);
    ASSERT_NOT_NULL_MSG(g);
    assert_int_equal(ampc_tensor_free(g), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_tensor_free", "holds no reference");
    assert_ptr_equal(ampc_tensor_grad(p[0]), g);
    assert_int_equal(ampc_tensor_numel(g), 6);
    ampc_module_free(lin);
    assert_int_equal(ampc_last_status(), AMPC_OK);
}

/* An op returning its own input (same memory format) gives back the caller's tensor: it is
   listed once in its scope (it used to be linked twice, and the scope's end looped forever). */
static void test_op_returning_its_input(void **state) {
    (void)state;
    alarm(20);   /* the old failure was a hang */
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_full(AMPC_F32, 4, (int64_t[]){1, 2, 3, 4}, 5.0);
    ampc_tensor *y = ampc_to_memory_format(x, AMPC_CONTIGUOUS_FORMAT);
    assert_ptr_equal(x, y);
    ampc_tensor *z = ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){3});
    ampc_scope_end();
    assert_int_equal(ampc_tensor_numel(z), -1);
    ampc_clear_error();
    ampc_scope_begin();
    x = ampc_tensor_full(AMPC_F32, 4, (int64_t[]){1, 2, 3, 4}, 5.0);
    y = ampc_to_memory_format(x, AMPC_CONTIGUOUS_FORMAT);
    ASSERT_OK(ampc_tensor_free(y));
    assert_int_equal(ampc_tensor_free(x), AMPC_ERR_STATE);   /* the same tensor, one reference */
    expect_status(AMPC_ERR_STATE, "ampc_tensor_free", "stale");
    ampc_scope_end();
    alarm(0);
}

/* One SGD step's worth of grads on net's parameters. */
static void make_grads(ampc_module *net) {
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_rand(AMPC_F32, 2, (int64_t[]){4, 3}, -1, 1);
    ASSERT_OK(ampc_backward(ampc_sum(ampc_module_forward(net, x), AMPC_ALL_DIMS, false)));
    ampc_scope_end();
}

static void test_optimizer_after_module_freed(void **state) {
    (void)state;
    ampc_module *net = ampc_sequential(2, ampc_linear_new(3, 2, true), ampc_relu_new());
    ASSERT_NOT_NULL_MSG(net);
    ampc_optimizer *opt = ampc_sgd_new(net, &(ampc_sgd_options){.lr = 0.1, .momentum = 0.9});
    ASSERT_NOT_NULL_MSG(opt);
    make_grads(net);
    ASSERT_OK(ampc_optimizer_step(opt));
    ampc_module_free(net);
    assert_int_equal(ampc_optimizer_step(opt), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_optimizer_step", "module that was freed");
    /* many modules made since: the freed one's generation still tells */
    for (int i = 0; i < 300; i++) ampc_module_free(ampc_relu_new());
    ampc_module *other = ampc_linear_new(3, 2, true);
    assert_int_equal(ampc_optimizer_step(opt), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_optimizer_step", "module that was freed");
    ampc_scaler *sc = ampc_scaler_new(NULL);
    assert_true(ampc_scaler_step(sc, opt) < 0);
    expect_status(AMPC_ERR_STATE, "ampc_scaler_step", "module that was freed");
    /* the unscale pass, grad clipping and the finiteness check read the parameters too */
    assert_true(ampc_scaler_unscale(sc, opt) < 0);
    expect_status(AMPC_ERR_STATE, "ampc_scaler_unscale", "module that was freed");
    assert_true(ampc_clip_grad_norm(opt, 1.0) < 0);
    expect_status(AMPC_ERR_STATE, "ampc_clip_grad_norm", "module that was freed");
    assert_true(ampc_optimizer_count_nonfinite(opt) < 0);
    expect_status(AMPC_ERR_STATE, "ampc_optimizer_count_nonfinite", "module that was freed");
    ampc_scaler_free(sc);
    ampc_optimizer_zero_grad(opt);   /* harmless: drops grads */
    assert_int_equal(ampc_last_status(), AMPC_OK);
    ampc_optimizer_free(opt);
    assert_int_equal(ampc_last_status(), AMPC_OK);
    ampc_module_free(other);
}

/* A child replaced after the optimizer was built: its old parameters are no longer trained. */
static void test_optimizer_after_child_replaced(void **state) {
    (void)state;
    ampc_module *net = ampc_sequential(2, ampc_linear_new(3, 2, true), ampc_relu_new());
    ampc_optimizer *opt = ampc_adam_new(net, NULL);
    ASSERT_NOT_NULL_MSG(opt);
    ASSERT_OK(ampc_module_replace(net, "0", ampc_linear_new(3, 2, true)));
    make_grads(net);
    assert_int_equal(ampc_optimizer_step(opt), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_optimizer_step", "freed or replaced");
    ampc_optimizer_free(opt);
    opt = ampc_adam_new(net, NULL);   /* built over the live module: fine */
    ASSERT_OK(ampc_optimizer_step(opt));
    ampc_optimizer_free(opt);
    ampc_module_free(net);
}

static void test_stale_module_and_optimizer(void **state) {
    (void)state;
    ampc_module *net = ampc_sequential(1, ampc_linear_new(3, 2, true));
    ampc_module *child = ampc_module_child(net, 0);
    ampc_optimizer *opt = ampc_sgd_new(net, NULL);
    ASSERT_NOT_NULL_MSG(opt);
    ampc_module_free(child);   /* a child belongs to its parent */
    expect_status(AMPC_ERR_STATE, "ampc_module_free", "child of a Sequential");
    ampc_optimizer_free(opt);
    ampc_module_free(net);
    assert_int_equal(ampc_last_status(), AMPC_OK);

    ampc_module_free(net);
    expect_status(AMPC_ERR_STATE, "ampc_module_free", "module handle is stale");
    ampc_module_free(child);
    expect_status(AMPC_ERR_STATE, "ampc_module_free", "module handle is stale");
    ampc_scope_begin();
    assert_null(ampc_module_forward(net, ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){1, 3})));
    ampc_scope_end();
    expect_status(AMPC_ERR_STATE, "ampc_module_forward", "module handle is stale");
    assert_true(ampc_module_parameters(net, NULL, NULL) == AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_module_parameters", "stale");
    assert_null(ampc_module_type(child));
    expect_status(AMPC_ERR_STATE, "ampc_module_type", "stale");

    ampc_optimizer_free(opt);
    expect_status(AMPC_ERR_STATE, "ampc_optimizer_free", "optimizer handle is stale");
    assert_int_equal(ampc_optimizer_step(opt), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_optimizer_step", "optimizer handle is stale");
    assert_true(isnan(ampc_optimizer_get_lr(opt)));
    expect_status(AMPC_ERR_STATE, "ampc_optimizer_get_lr", "stale");
    assert_int_equal(ampc_optimizer_num_params(opt), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_optimizer_num_params", "stale");
}

/* A freed optimizer given to the scaler or a checkpoint: refused before its (freed) parameter
   list is read (ampc_scaler_step and the checkpoint calls used to read it first: ASan's
   heap-use-after-free), scaler enabled or not. */
static void test_freed_optimizer_elsewhere(void **state) {
    (void)state;
    ampc_module *net = ampc_sequential(2, ampc_linear_new(3, 2, true), ampc_relu_new());
    ampc_optimizer *opt = ampc_sgd_new(net, NULL);
    ASSERT_NOT_NULL_MSG(opt);
    make_grads(net);
    ampc_optimizer_free(opt);
    for (int enabled = 0; enabled < 2; enabled++) {
        ampc_scaler_options so = ampc_scaler_defaults();
        so.enabled = enabled;
        ampc_scaler *sc = ampc_scaler_new(&so);
        assert_int_equal(ampc_scaler_step(sc, opt), AMPC_ERR_STATE);
        expect_status(AMPC_ERR_STATE, "ampc_scaler_step", "optimizer handle is stale");
        assert_int_equal(ampc_scaler_unscale(sc, opt), AMPC_ERR_STATE);
        expect_status(AMPC_ERR_STATE, "ampc_scaler_unscale", "optimizer handle is stale");
        assert_int_equal(ampc_scaler_steps_applied(sc), 0);
        ampc_scaler_free(sc);
    }
    char path[64];
    snprintf(path, sizeof path, "/tmp/ampc-test-handles-%d.safetensors", (int)getpid());
    assert_int_equal(ampc_checkpoint_save(path, net, opt, NULL, NULL), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_checkpoint_save", "optimizer handle is stale");
    assert_int_equal(access(path, F_OK), -1);   /* nothing written */
    ASSERT_OK(ampc_checkpoint_save(path, net, NULL, NULL, NULL));
    assert_int_equal(ampc_checkpoint_load(path, net, opt, NULL, NULL), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_checkpoint_load", "optimizer handle is stale");
    unlink(path);
    ampc_module_free(net);
}

/* A freed handle never names a new object: headers used to be reused after 1024 more tensors
   (256 modules, 64 optimizers) were freed, and then a stale handle's double free freed a live
   object with status 0. Now no address is handed out twice. */
static void test_stale_handle_never_names_a_new_object(void **state) {
    (void)state;
    /* free one, then more than the old pool kept aside (1024 tensors, 256 modules, 64
       optimizers), then make new ones: the old pool handed the first freed header out again */
    enum { MANY = 1100, NEW = 64 };
    ampc_tensor **t = malloc(MANY * sizeof *t);
    ampc_tensor *old = owned_full(1.0);
    ASSERT_OK(ampc_tensor_free(old));
    for (int i = 0; i < MANY; i++) t[i] = owned_full(0.0);
    for (int i = 0; i < MANY; i++) ASSERT_OK(ampc_tensor_free(t[i]));
    for (int i = 0; i < NEW; i++) {
        t[i] = owned_full(2.0);
        assert_ptr_not_equal(t[i], old);
    }
    assert_int_equal(ampc_tensor_free(old), AMPC_ERR_STATE);   /* used to free t[0], status 0 */
    expect_status(AMPC_ERR_STATE, "ampc_tensor_free", "stale");
    for (int i = 0; i < NEW; i++) {
        assert_all(t[i], 2.0f);
        ASSERT_OK(ampc_tensor_free(t[i]));
    }
    free(t);

    ampc_module *mods[300];
    ampc_module *m = ampc_relu_new();
    ampc_module_free(m);
    for (int i = 0; i < 300; i++) mods[i] = ampc_relu_new();
    for (int i = 0; i < 300; i++) ampc_module_free(mods[i]);
    for (int i = 0; i < NEW; i++) {
        mods[i] = ampc_linear_new(3, 2, true);
        assert_ptr_not_equal(mods[i], m);
    }
    ampc_module_free(m);
    expect_status(AMPC_ERR_STATE, "ampc_module_free", "module handle is stale");

    ampc_optimizer *opts[100];
    ampc_optimizer *o = ampc_sgd_new(mods[0], NULL);
    ampc_optimizer_free(o);
    for (int i = 0; i < 100; i++) opts[i] = ampc_sgd_new(mods[0], NULL);
    for (int i = 0; i < 100; i++) ampc_optimizer_free(opts[i]);
    for (int i = 0; i < NEW; i++) {
        opts[i] = ampc_sgd_new(mods[i], NULL);
        assert_ptr_not_equal(opts[i], o);
    }
    ampc_optimizer_free(o);
    expect_status(AMPC_ERR_STATE, "ampc_optimizer_free", "optimizer handle is stale");
    for (int i = 0; i < NEW; i++) {
        assert_int_equal(ampc_optimizer_num_params(opts[i]), 2);   /* untouched */
        ampc_optimizer_free(opts[i]);
        assert_int_equal(ampc_module_parameters(mods[i], NULL, NULL), 2);
        ampc_module_free(mods[i]);
    }
    assert_int_equal(ampc_last_status(), AMPC_OK);
}

/* A freed scaler: every call refuses it (it used to read freed memory; a double free crashed). */
static void test_stale_scaler(void **state) {
    (void)state;
    ampc_scaler *sc = ampc_scaler_new(NULL);
    ASSERT_NOT_NULL_MSG(sc);
    ampc_scaler_free(sc);
    assert_int_equal(ampc_last_status(), AMPC_OK);
    ampc_scaler_free(sc);
    expect_status(AMPC_ERR_STATE, "ampc_scaler_free", "scaler handle is stale");
    ampc_module *net = ampc_sequential(1, ampc_linear_new(3, 2, true));
    ampc_optimizer *opt = ampc_sgd_new(net, NULL);
    make_grads(net);
    ampc_scope_begin();
    assert_null(ampc_scaler_scale(sc, ampc_tensor_full(AMPC_F32, 0, NULL, 1.0)));
    expect_status(AMPC_ERR_STATE, "ampc_scaler_scale", "stale");
    ampc_scope_end();
    assert_int_equal(ampc_scaler_unscale(sc, opt), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_scaler_unscale", "scaler handle is stale");
    assert_int_equal(ampc_scaler_step(sc, opt), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_scaler_step", "scaler handle is stale");
    assert_int_equal(ampc_scaler_update(sc), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_scaler_update", "stale");
    ampc_scaler_set_scale(sc, 2.0f);
    expect_status(AMPC_ERR_STATE, "ampc_scaler_set_scale", "stale");
    assert_true(ampc_scaler_get_scale(sc) == 1.0f);
    expect_status(AMPC_ERR_STATE, "ampc_scaler_get_scale", "stale");
    assert_int_equal(ampc_scaler_growth_tracker(sc), 0);
    expect_status(AMPC_ERR_STATE, "ampc_scaler_growth_tracker", "stale");
    assert_false(ampc_scaler_is_enabled(sc));
    expect_status(AMPC_ERR_STATE, "ampc_scaler_is_enabled", "stale");
    assert_int_equal(ampc_scaler_steps_applied(sc), 0);
    expect_status(AMPC_ERR_STATE, "ampc_scaler_steps_applied", "stale");
    assert_int_equal(ampc_scaler_steps_skipped(sc), 0);
    expect_status(AMPC_ERR_STATE, "ampc_scaler_steps_skipped", "stale");
    assert_false(ampc_scaler_found_inf(sc, opt));
    expect_status(AMPC_ERR_STATE, "ampc_scaler_found_inf", "stale");
    assert_true(ampc_scaler_get_options(sc).init_scale == ampc_scaler_defaults().init_scale);
    expect_status(AMPC_ERR_STATE, "ampc_scaler_get_options", "stale");
    char path[64];
    snprintf(path, sizeof path, "/tmp/ampc-test-handles-%d.safetensors", (int)getpid());
    assert_int_equal(ampc_checkpoint_save(path, net, opt, sc, NULL), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_checkpoint_save", "scaler handle is stale");
    assert_int_equal(access(path, F_OK), -1);
    ampc_optimizer_free(opt);
    ampc_module_free(net);
}

/* An IDX pair of n 2x2 images with labels i % 3 under /tmp; the paths into img and lab. */
static void write_tiny_idx(char *img, char *lab, size_t cap, int n) {
    snprintf(img, cap, "/tmp/ampc-test-handles-%d-img", (int)getpid());
    snprintf(lab, cap, "/tmp/ampc-test-handles-%d-lab", (int)getpid());
    FILE *f = fopen(img, "wb");
    ASSERT_NOT_NULL_MSG(f);
    const unsigned char ih[16] = {0, 0, 8, 3, 0, 0, 0, (unsigned char)n, 0, 0, 0, 2, 0, 0, 0, 2};
    fwrite(ih, 1, sizeof ih, f);
    for (int i = 0; i < 4 * n; i++) fputc(i * 7 % 256, f);
    fclose(f);
    f = fopen(lab, "wb");
    ASSERT_NOT_NULL_MSG(f);
    const unsigned char lh[8] = {0, 0, 8, 1, 0, 0, 0, (unsigned char)n};
    fwrite(lh, 1, sizeof lh, f);
    for (int i = 0; i < n; i++) fputc(i % 3, f);
    fclose(f);
}

/* Datasets, transforms and loaders: a freed handle is refused by every call; a dataset freed by
   its user while a loader holds it stays usable through the loader. */
static void test_stale_data_handles(void **state) {
    (void)state;
    char img[96], lab[96];
    write_tiny_idx(img, lab, sizeof img, 8);
    ampc_dataset *ds = ampc_dataset_idx_open(img, lab);
    ASSERT_NOT_NULL_MSG(ds);
    ampc_transforms *tf = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_hflip(tf, 0.5));
    ampc_loader_options lo = ampc_loader_defaults();
    lo.batch_size = 4;
    lo.transforms = tf;
    ampc_loader *ld = ampc_loader_new(ds, &lo);
    ASSERT_NOT_NULL_MSG(ld);
    ampc_dataset_free(ds);   /* the loader's reference keeps it */
    ampc_transforms_free(tf);   /* the loader keeps its own copy */
    assert_int_equal(ampc_last_status(), AMPC_OK);

    ampc_dataset_free(ds);
    expect_status(AMPC_ERR_STATE, "ampc_dataset_free", "dataset handle is stale");
    assert_int_equal(ampc_dataset_size(ds), 0);
    expect_status(AMPC_ERR_STATE, "ampc_dataset_size", "stale");
    assert_int_equal(ampc_dataset_num_classes(ds), 0);
    expect_status(AMPC_ERR_STATE, "ampc_dataset_num_classes", "stale");
    int64_t c = -1, h = -1, w = -1;
    ampc_dataset_sample_shape(ds, &c, &h, &w);
    expect_status(AMPC_ERR_STATE, "ampc_dataset_sample_shape", "stale");
    assert_true(c == 0 && h == 0 && w == 0);
    assert_null(ampc_dataset_class_name(ds, 0));
    expect_status(AMPC_ERR_STATE, "ampc_dataset_class_name", "stale");
    float px[4];
    int64_t label;
    assert_int_equal(ampc_dataset_get(ds, 0, px, &label), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_dataset_get", "stale");
    assert_null(ampc_dataset_subset(ds, (int64_t[]){0}, 1));
    expect_status(AMPC_ERR_STATE, "ampc_dataset_subset", "stale");
    ampc_dataset *tr, *va;
    assert_int_equal(ampc_dataset_split(ds, 0.5, 1, &tr, &va), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_dataset_split", "stale");
    assert_null(ampc_loader_new(ds, NULL));
    expect_status(AMPC_ERR_STATE, "ampc_loader_new", "dataset handle is stale");
    assert_int_equal(ampc_dataset_folder_skipped(ds), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_dataset_folder_skipped", "stale");

    ampc_transforms_free(tf);
    expect_status(AMPC_ERR_STATE, "ampc_transforms_free", "transforms handle is stale");
    assert_int_equal(ampc_transforms_add_resize(tf, 2, 2), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_transforms_add_resize", "stale");
    assert_int_equal(ampc_transforms_add_hflip(tf, 0.5), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_transforms_add_hflip", "stale");
    assert_int_equal(ampc_transforms_add_affine(tf, 0.1, 0.9, 1.1, 10), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_transforms_add_affine", "stale");
    assert_int_equal(ampc_transforms_add_shift_scale_rotate(tf, 0.5, 0.1, 0.1, 10, AMPC_BORDER_ZERO), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_transforms_add_shift_scale_rotate", "stale");
    assert_int_equal(ampc_transforms_add_normalize(tf, 1, (float[]){0}, (float[]){1}), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_transforms_add_normalize", "stale");
    assert_int_equal(ampc_transforms_output_shape(tf, 1, 2, 2, &c, &h, &w), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_transforms_output_shape", "stale");
    float out[4];
    assert_int_equal(ampc_transforms_apply(tf, 1, 2, 2, px, out, 1, 0, 0), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_transforms_apply", "stale");
    lo.transforms = tf;
    assert_null(ampc_loader_new(ds, &lo));
    ampc_clear_error();

    /* the loader still reads the dataset its user freed */
    ampc_scope_begin();
    ampc_tensor *x, *y;
    assert_int_equal(ampc_loader_next(ld, &x, &y), 1);
    assert_int_equal(ampc_tensor_numel(y), 4);
    ampc_scope_end();
    ampc_loader_free(ld);
    assert_int_equal(ampc_last_status(), AMPC_OK);
    ampc_loader_free(ld);
    expect_status(AMPC_ERR_STATE, "ampc_loader_free", "loader handle is stale");
    assert_int_equal(ampc_loader_next(ld, &x, &y), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_loader_next", "stale");
    assert_int_equal(ampc_loader_start_epoch(ld, 1), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_loader_start_epoch", "stale");
    assert_int_equal(ampc_loader_start_epoch_at_sample(ld, 1, 0), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_loader_start_epoch_at_sample", "stale");
    assert_int_equal(ampc_loader_num_batches(ld), 0);
    expect_status(AMPC_ERR_STATE, "ampc_loader_num_batches", "stale");
    assert_int_equal(ampc_loader_count_batches(ld, 0), -1);
    expect_status(AMPC_ERR_STATE, "ampc_loader_count_batches", "stale");
    assert_int_equal(ampc_loader_epoch_position(ld), 0);
    expect_status(AMPC_ERR_STATE, "ampc_loader_epoch_position", "stale");
    ampc_loader_sample_shape(ld, &c, &h, &w);
    expect_status(AMPC_ERR_STATE, "ampc_loader_sample_shape", "stale");
    unlink(img);
    unlink(lab);
}

/* A closed metrics log and a freed data-parallel wrapper are refused the same way. */
static void test_stale_metrics_and_ddp(void **state) {
    (void)state;
    char path[64];
    snprintf(path, sizeof path, "/tmp/ampc-test-handles-%d.csv", (int)getpid());
    ampc_metrics *m = ampc_metrics_open(path, (const char *const[]){"step", "loss"}, 2, false);
    ASSERT_NOT_NULL_MSG(m);
    ASSERT_OK(ampc_metrics_row(m, (double[]){1, 0.5}));
    ASSERT_OK(ampc_metrics_close(m));
    assert_int_equal(ampc_metrics_close(m), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_metrics_close", "metrics log handle is stale");
    assert_int_equal(ampc_metrics_row(m, (double[]){2, 0.25}), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_metrics_row", "stale");
    assert_int_equal(ampc_metrics_num_columns(m), 0);
    expect_status(AMPC_ERR_STATE, "ampc_metrics_num_columns", "stale");
    unlink(path);

    ampc_module *net = ampc_linear_new(3, 2, true);
    ampc_ddp *d = ampc_ddp_new(net, NULL);
    ASSERT_NOT_NULL_MSG(d);
    ampc_ddp_free(d);
    assert_int_equal(ampc_last_status(), AMPC_OK);
    ampc_ddp_free(d);
    expect_status(AMPC_ERR_STATE, "ampc_ddp_free", "model wrapper handle is stale");
    assert_int_equal(ampc_ddp_set_sync(d, false), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ddp_set_sync", "stale");
    assert_int_equal(ampc_ddp_sync_buffers(d), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ddp_sync_buffers", "stale");
    ampc_ddp_stats st;
    assert_int_equal(ampc_ddp_get_stats(d, &st), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ddp_get_stats", "stale");
    ampc_module_free(net);
}

/* Last: after ampc_shutdown the root scope's tensors are released, and their handles read as
   stale (headers are never returned to malloc, so ASan sees no use of freed memory). */
/* An op given a tensor whose scope ended (or that was freed) refuses it, naming the op. */
static void test_op_on_stale_tensor(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *a = ampc_tensor_full(AMPC_F32, 1, (int64_t[]){4}, 1.0);
    ampc_scope_end();
    ampc_scope_begin();
    ampc_tensor *b = ampc_tensor_full(AMPC_F32, 1, (int64_t[]){4}, 1.0);
    assert_null(ampc_add(a, b));
    expect_status(AMPC_ERR_STATE, "add", "freed, or its scope ended");
    assert_null(ampc_relu(a));
    expect_status(AMPC_ERR_STATE, "relu", "freed, or its scope ended");
    assert_true(ampc_tensor_count_nonfinite(a) < 0);
    expect_status(AMPC_ERR_STATE, "ampc_tensor_count_nonfinite", "freed, or its scope ended");
    assert_int_equal(ampc_tensor_count_nonfinite(b), 0);
    ampc_scope_end();
}

/* A field of /proc/self/status in kB, or -1 where it is absent. */
static long status_kb(const char *field) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kb = -1;
    const size_t n = strlen(field);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, field, n) && line[n] == ':') kb = atol(line + n + 1);
    if (f) fclose(f);
    return kb;
}

/* The permissions ("rw-p", ...) of the mapping holding p, and the number of mappings; "" and
   -1 without /proc/self/maps. */
static long mapping_of(const void *p, char perms[5]) {
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    long n = 0;
    perms[0] = 0;
    while (f && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        char pr[5];
        n++;
        if (sscanf(line, "%lx-%lx %4s", &lo, &hi, pr) == 3 && (uintptr_t)p >= lo && (uintptr_t)p < hi) memcpy(perms, pr, 5);
    }
    if (!f) return -1;
    fclose(f);
    return n;
}

static void churn_tensors(long n) {
    for (long i = 0; i < n; i++) ASSERT_OK(ampc_tensor_free(owned_full(0.0)));
}

/* Long runs keep flat page tables. madvise gave freed headers' memory back but kept the page
   tables: one 4 KiB page per 2 MiB of headers, ~0.4 bytes per tensor ever made (~400 KiB per
   million). Now a 2 MiB region whose headers were all freed is mapped afresh read-only once the
   bump has left it: its page-table page goes, a stale handle in it still reads as stale, and a
   region holding a live tensor is kept as it is. */
static void test_page_tables_stay_flat(void **state) {
    (void)state;
    enum { REGION = 2 << 20 };
    ampc_tensor *kept = owned_full(3.0);
    /* a stale handle in another region than kept's */
    ampc_tensor *stale;
    do {
        stale = owned_full(1.0);
        ASSERT_OK(ampc_tensor_free(stale));
    } while ((uintptr_t)stale / REGION == (uintptr_t)kept / REGION);
    churn_tensors(50000);   /* warm-up: stale's region is left behind, the caches are full */
    char perms[5];
    const long pte0 = status_kb("VmPTE"), maps0 = mapping_of(stale, perms);
    churn_tensors(1000000);   /* ~200 MiB of headers: ~100 page-table pages if they were kept */
    const long pte1 = status_kb("VmPTE");
    if (pte0 < 0 || pte1 < 0) {
        print_message("VmPTE absent from /proc/self/status: page-table growth not checked\n");
    } else if (pte1 - pte0 > 128) {
        fail_msg("page tables grew from %ld kB to %ld kB over a million tensors made and freed", pte0, pte1);
    }
    const long maps1 = mapping_of(stale, perms);
    if (maps0 < 0) {
        print_message("no /proc/self/maps: mappings not checked\n");
    } else {
        /* freed regions merge into one mapping: the kernel allows 65530 */
        if (maps1 > maps0 + 8) fail_msg("mappings grew from %ld to %ld", maps0, maps1);
        assert_string_equal(perms, "r--p");   /* stale's region was mapped afresh */
        mapping_of(kept, perms);
        assert_string_equal(perms, "rw-p");   /* kept's was not */
    }
    assert_int_equal(ampc_tensor_free(stale), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_tensor_free", "stale");
    check_accessors(stale, AMPC_ERR_STATE, "stale (freed, or its scope ended)");
    assert_all(kept, 3.0f);
    ASSERT_OK(ampc_tensor_free(kept));
}

static void test_handle_after_shutdown(void **state) {
    (void)state;
    ampc_tensor *t = ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){4});
    ASSERT_NOT_NULL_MSG(t);
    ampc_shutdown();
    assert_int_equal(ampc_tensor_numel(t), -1);
    expect_status(AMPC_ERR_STATE, "ampc_tensor_numel", "stale");
    assert_int_equal(ampc_tensor_free(t), AMPC_ERR_STATE);
    expect_status(AMPC_ERR_STATE, "ampc_tensor_free", "stale");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_null_accessors),
        cmocka_unit_test(test_use_after_scope_end),
        cmocka_unit_test(test_free_twice),
        cmocka_unit_test(test_free_twice_with_allocation_between),
        cmocka_unit_test(test_free_twice_while_graph_holds_it),
        cmocka_unit_test(test_borrowed_tensors_refuse_free),
        cmocka_unit_test(test_op_returning_its_input),
        cmocka_unit_test(test_optimizer_after_module_freed),
        cmocka_unit_test(test_optimizer_after_child_replaced),
        cmocka_unit_test(test_stale_module_and_optimizer),
        cmocka_unit_test(test_freed_optimizer_elsewhere),
        cmocka_unit_test(test_stale_handle_never_names_a_new_object),
        cmocka_unit_test(test_stale_scaler),
        cmocka_unit_test(test_stale_data_handles),
        cmocka_unit_test(test_stale_metrics_and_ddp),
        cmocka_unit_test(test_op_on_stale_tensor),
        cmocka_unit_test(test_page_tables_stay_flat),
        cmocka_unit_test(test_handle_after_shutdown),
    };
    return cmocka_run_group_tests_name("handles", tests, tu_group_setup, tu_group_teardown);
}
