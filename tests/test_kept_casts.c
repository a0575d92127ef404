/*
 * test_kept_casts.c - autocast's 16-bit weight copies kept across regions and rewritten by the
 * optimizer's own pass (ampc_autocast_keep_weight_casts).
 *
 * - The kernels' 16-bit output is the rounding of the updated parameter, checked against the
 *   plain-C conversions (ampc__f32_to_bf16_c / _f16_c) over several threads' blocks.
 * - Training with kept copies is bit-identical to recasting every weight in every region
 *   (PyTorch's behaviour, the switch off): bf16 with SGD and Adam, fp16 with the GradScaler
 *   including skipped steps; and the copies are really reused (they stay current after each
 *   step, so no step recasts a weight).
 * - Every write path to a weight makes its copy stale: a pointer from ampc_tensor_data, one
 *   through a detached view, ampc_tensor_copy_from_f32, a checkpoint load.
 * - A graph that saved a copy keeps the values it saw when a step runs before its backward.
 * - Two threads running one model under different autocast dtypes (each forward replaces the
 *   other's kept copy) get the single-threaded outputs (and, under ASan, touch no freed copy).
 */
#include "testutil.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"

enum { IN = 12, HID = 40, OUT = 5, BATCH = 16, STEPS = 6 };

// ---------------------------------------------------------------------------------------------
// The kernels' cast_out

static void test_kernel_cast_out(void **state) {
    (void)state;
    const int64_t n = 3 * 16384 + 77;   /* several update blocks and threads; a ragged tail */
    float *pv = malloc((size_t)n * sizeof *pv), *gv = malloc((size_t)n * sizeof *gv);
    float *after = malloc((size_t)n * sizeof *after);
    uint16_t *want = malloc((size_t)n * sizeof *want);
    uint64_t s = 5;
    for (int64_t i = 0; i < n; i++) {
        pv[i] = (float)tu_uniform(&s, -2, 2);
        gv[i] = (float)tu_uniform(&s, -1, 1);
    }
    /* values at the edges of the 16-bit formats: halfway cases, subnormals, overflow */
    pv[0] = 1.0f + 0x1p-8f;
    pv[1] = 1.0f + 0x1p-11f;
    pv[2] = 0x1p-130f;
    pv[3] = 0x1p-20f;
    pv[4] = 70000.0f;
    for (int i = 0; i < 5; i++) gv[i] = 0;
    for (int opt = 0; opt < 2; opt++)
        for (int d = 0; d < 2; d++) {
            ampc_dtype dt = d ? AMPC_F16 : AMPC_BF16;
            ampc_scope_begin();
            ampc_tensor *p = ampc_tensor_from_f32(AMPC_F32, 1, &n, pv), *g = ampc_tensor_from_f32(AMPC_F32, 1, &n, gv);
            ampc_tensor *a = ampc_tensor_zeros(AMPC_F32, 1, &n), *b = ampc_tensor_zeros(AMPC_F32, 1, &n);
            ampc_tensor *c = ampc_tensor_empty(dt, 1, &n);
            ASSERT_NOT_NULL_MSG(c);
            const ampc_backend *be = ampc__backend(AMPC_DEVICE_CPU);
            ampc_optim_item it = {.param = p, .grad = g, .state = {a, b}, .cast_out = c, .first = true, .step = 1};
            if (opt == 0) {
                ampc_sgd_hparams h = {.lr = 0.1, .momentum = 0.9};
                ASSERT_OK(be->sgd_step(&it, 1, &h));
            } else {
                ampc_adam_hparams h = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
                ASSERT_OK(be->adam_step(&it, 1, &h));
            }
            ASSERT_OK(ampc_tensor_to_f32(p, after, (size_t)n));
            if (dt == AMPC_BF16) ampc__f32_to_bf16_c(after, want, (size_t)n);
            else ampc__f32_to_f16_c(after, want, (size_t)n);
            const uint16_t *got = ampc_tensor_cdata(c);
            for (int64_t i = 0; i < n; i++)
                if (got[i] != want[i])
                    fail_msg("%s %s: element %lld of %g: 0x%04x, want 0x%04x", opt ? "adam" : "sgd", ampc_dtype_name(dt),
                             (long long)i, after[i], got[i], want[i]);
            /* a copy of another shape or dtype is refused, naming the problem */
            ampc_tensor *bad = ampc_tensor_empty(AMPC_F32, 1, &n);
            ampc_sgd_hparams h = {.lr = 0.1};
            ampc_optim_item bad_it = {.param = p, .grad = g, .cast_out = bad};
            assert_int_equal(ampc__k_sgd_step(&bad_it, 1, &h), AMPC_ERR_DTYPE);
            assert_non_null(strstr(ampc_last_error(), "not f16/bf16"));
            ampc_clear_error();
            ampc_scope_end();
        }
    free(pv);
    free(gv);
    free(after);
    free(want);
}

// ---------------------------------------------------------------------------------------------
// Training, kept copies on and off

typedef struct { ampc_dtype dt; bool adam, scaler; float init_scale; const char *name; } train_case;

static ampc_module *make_net(void) {
    ampc_manual_seed(7);
    ampc_module *net = ampc_sequential(5, ampc_linear_new(IN, HID, true), ampc_relu_new(), ampc_linear_new(HID, HID, true),
                                       ampc_relu_new(), ampc_linear_new(HID, OUT, true));
    ASSERT_NOT_NULL_MSG(net);
    return net;
}

static void make_batch(int k, ampc_tensor **x, ampc_tensor **y) {
    float xv[BATCH * IN];
    int64_t t[BATCH];
    uint64_t s = 1000 + (uint64_t)k;
    for (int i = 0; i < BATCH * IN; i++) xv[i] = (float)tu_uniform(&s, -2, 2);
    for (int i = 0; i < BATCH; i++) t[i] = (i * 3 + k) % OUT;
    *x = ampc_tensor_from_f32(AMPC_F32, 2, (int64_t[]){BATCH, IN}, xv);
    *y = ampc_tensor_from_i64(1, (int64_t[]){BATCH}, t);
}

static ampc_optimizer *make_opt(ampc_module *net, bool adam) {
    ampc_optimizer *o = adam ? ampc_adam_new(net, &(ampc_adam_options){.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8})
                             : ampc_sgd_new(net, &(ampc_sgd_options){.lr = 0.05, .momentum = 0.9});
    ASSERT_NOT_NULL_MSG(o);
    return o;
}

/* Every parameter's values, concatenated; *n their count. */
static float *snapshot(ampc_module *net, size_t *n) {
    ampc_tensor **p;
    int np = ampc_module_parameters(net, &p, NULL);
    size_t total = 0;
    for (int i = 0; i < np; i++) total += (size_t)ampc_tensor_numel(p[i]);
    float *v = malloc(total * sizeof *v), *at = v;
    for (int i = 0; i < np; i++) {
        ASSERT_OK(ampc_tensor_to_f32(p[i], at, (size_t)ampc_tensor_numel(p[i])));
        at += ampc_tensor_numel(p[i]);
    }
    *n = total;
    return v;
}

/* Each weight's kept copy is current (the step rewrote it rather than dropping it). */
static void assert_copies_current(ampc_module *net, ampc_dtype dt, const char *what) {
    ampc_tensor **p;
    int np = ampc_module_parameters(net, &p, NULL);
    for (int i = 0; i < np; i++) {
        const ampc_tensor *c = p[i]->shadow;
        if (!c || c->dtype != dt || p[i]->shadow_version != ampc__version(p[i]))
            fail_msg("%s: parameter %d has no current %s copy", what, i, ampc_dtype_name(dt));
    }
}

typedef struct { float *params[STEPS]; float loss[STEPS]; size_t n; int64_t skipped; } run;

static run train(const train_case *tc, bool keep) {
    ampc_autocast_keep_weight_casts(keep);
    ampc_module *net = make_net();
    ampc_optimizer *opt = make_opt(net, tc->adam);
    ampc_scaler_options so = ampc_scaler_defaults();
    so.enabled = tc->scaler;
    if (tc->init_scale > 0) so.init_scale = tc->init_scale;
    ampc_scaler *sc = ampc_scaler_new(&so);
    ASSERT_NOT_NULL_MSG(sc);
    run r = {0};
    for (int s = 0; s < STEPS; s++) {
        ampc_scope_begin();
        ampc_tensor *x, *y;
        make_batch(s % 2, &x, &y);   /* two batches in turn: the loss on each falls */
        ampc_autocast_enter(tc->dt, true);
        ampc_tensor *loss = ampc_cross_entropy(ampc_module_forward(net, x), y, NULL);
        ampc_autocast_exit();
        ASSERT_NOT_NULL_MSG(loss);
        r.loss[s] = (float)ampc_tensor_item(loss);
        ASSERT_OK(ampc_backward(ampc_scaler_scale(sc, loss)));
        ASSERT_OK(ampc_scaler_step(sc, opt));
        ASSERT_OK(ampc_scaler_update(sc));
        ampc_optimizer_zero_grad(opt);
        ampc_scope_end();
        r.params[s] = snapshot(net, &r.n);
        /* the region and the step are over: a kept copy exists only when on, and is current */
        if (keep) assert_copies_current(net, tc->dt, tc->name);
        else assert_int_equal(ampc_memory_stats().current[AMPC_MEM_CASTS], 0);
    }
    r.skipped = ampc_scaler_steps_skipped(sc);
    ampc_scaler_free(sc);
    ampc_optimizer_free(opt);
    ampc_module_free(net);
    ampc_autocast_keep_weight_casts(true);
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_CASTS], 0);   /* the copies went with the net */
    return r;
}

static void test_training_bit_identical(void **state) {
    (void)state;
    const train_case cases[] = {
        {AMPC_BF16, false, false, 0, "bf16 SGD"},
        {AMPC_BF16, true, false, 0, "bf16 Adam"},
        {AMPC_F16, false, true, 0, "fp16 SGD + GradScaler"},
        /* 2^22 overflows these fp16 gradients: the first steps are skipped, the scale backs off */
        {AMPC_F16, true, true, 0x1p22f, "fp16 Adam + GradScaler, skipped steps"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        run on = train(&cases[c], true), off = train(&cases[c], false);
        print_message("%s: loss %.6f -> %.6f, %lld skipped\n", cases[c].name, on.loss[0], on.loss[STEPS - 1],
                      (long long)on.skipped);
        assert_int_equal(on.skipped, off.skipped);
        if (cases[c].init_scale > 0) assert_true(on.skipped >= 1 && on.skipped < STEPS);
        for (int s = 0; s < STEPS; s++) {
            if (memcmp(&on.loss[s], &off.loss[s], sizeof(float)))
                fail_msg("%s step %d: loss %.9g kept vs %.9g recast", cases[c].name, s, on.loss[s], off.loss[s]);
            for (size_t i = 0; i < on.n; i++)
                if (memcmp(&on.params[s][i], &off.params[s][i], sizeof(float)))
                    fail_msg("%s step %d: parameter value %zu %.9g kept vs %.9g recast", cases[c].name, s, i,
                             on.params[s][i], off.params[s][i]);
            free(on.params[s]);
            free(off.params[s]);
        }
        /* it learned something (the comparison is not between two frozen nets): batch 0 again */
        assert_true(on.loss[STEPS - 2] < on.loss[0]);
    }
}

// ---------------------------------------------------------------------------------------------
// Writes make a kept copy stale

/* The net's output on batch 0 under bf16 autocast. */
static void forward_values(ampc_module *net, float *out) {
    ampc_scope_begin();
    ampc_tensor *x, *y;
    make_batch(0, &x, &y);
    ampc_autocast_enter(AMPC_BF16, true);
    ampc_tensor *o = ampc_module_forward(net, x);
    ampc_autocast_exit();
    ASSERT_NOT_NULL_MSG(o);
    ASSERT_OK(ampc_tensor_to_f32(o, out, BATCH * OUT));
    ampc_scope_end();
}

/* One bf16 step, so that every weight has a current kept copy. */
static void one_step(ampc_module *net, ampc_optimizer *opt) {
    ampc_scope_begin();
    ampc_tensor *x, *y;
    make_batch(1, &x, &y);
    ampc_autocast_enter(AMPC_BF16, true);
    ampc_tensor *loss = ampc_cross_entropy(ampc_module_forward(net, x), y, NULL);
    ampc_autocast_exit();
    ASSERT_OK(ampc_backward(loss));
    ASSERT_OK(ampc_optimizer_step(opt));
    ampc_optimizer_zero_grad(opt);
    ampc_scope_end();
    if (ampc_autocast_keeps_weight_casts()) assert_copies_current(net, AMPC_BF16, "after one step");
}

/* The output with kept copies must be what a recast of every weight gives. */
static void expect_fresh(ampc_module *net, const char *how) {
    float kept[BATCH * OUT], fresh[BATCH * OUT];
    forward_values(net, kept);
    ampc_autocast_keep_weight_casts(false);
    forward_values(net, fresh);
    ampc_autocast_keep_weight_casts(true);
    for (int i = 0; i < BATCH * OUT; i++)
        if (memcmp(&kept[i], &fresh[i], sizeof(float)))
            fail_msg("after a write through %s: output %d is %.9g with the kept copies, %.9g recast", how, i, kept[i],
                     fresh[i]);
}

static void test_writes_make_copies_stale(void **state) {
    (void)state;
    char path[] = "/tmp/ampc_kept_casts_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    ampc_module *net = make_net();
    ampc_optimizer *opt = make_opt(net, false);
    ampc_tensor **p;
    int np = ampc_module_parameters(net, &p, NULL);
    assert_true(np == 6);
    one_step(net, opt);
    ASSERT_OK(ampc_checkpoint_save(path, net, NULL, NULL, NULL));   /* the weights after step 1 */

    /* 1. a pointer from ampc_tensor_data: scale the first weight by 3 (bf16 sees the change) */
    one_step(net, opt);
    float *w = ampc_tensor_data(p[0]);
    for (int64_t i = 0; i < ampc_tensor_numel(p[0]); i++) w[i] *= 3.0f;
    expect_fresh(net, "ampc_tensor_data");

    /* 2. a detached view of the second weight, written through its own pointer */
    one_step(net, opt);
    ampc_scope_begin();
    ampc_tensor *d = ampc_tensor_detach(p[2]);
    float *dv = ampc_tensor_data(d);
    for (int64_t i = 0; i < ampc_tensor_numel(d); i++) dv[i] = -dv[i];
    ampc_scope_end();
    expect_fresh(net, "a detached view");

    /* 3. ampc_tensor_copy_from_f32 into the last bias */
    one_step(net, opt);
    float nb[OUT] = {1, -2, 3, -4, 5};
    ASSERT_OK(ampc_tensor_copy_from_f32(p[5], nb, OUT));
    expect_fresh(net, "ampc_tensor_copy_from_f32");

    /* 4. a checkpoint load (every parameter) */
    one_step(net, opt);
    ASSERT_OK(ampc_checkpoint_load(path, net, NULL, NULL, NULL));
    expect_fresh(net, "ampc_checkpoint_load");

    ampc_optimizer_free(opt);
    ampc_module_free(net);
    unlink(path);
}

// ---------------------------------------------------------------------------------------------
// A graph alive across a step

/* forward A (saved copies), a step with gradients from an earlier backward, then A's backward:
   returns the first weight's gradient from A's backward. */
static float *grad_across_step(bool keep, size_t *n) {
    ampc_autocast_keep_weight_casts(keep);
    ampc_module *net = make_net();
    ampc_optimizer *opt = make_opt(net, false);
    ampc_tensor **p;
    ampc_module_parameters(net, &p, NULL);
    one_step(net, opt);
    ampc_scope_begin();
    ampc_tensor *x, *y;
    make_batch(2, &x, &y);
    ampc_autocast_enter(AMPC_BF16, true);
    ampc_tensor *a = ampc_cross_entropy(ampc_module_forward(net, x), y, NULL);
    ampc_tensor *b = ampc_cross_entropy(ampc_module_forward(net, x), y, &(ampc_cross_entropy_options){.reduction = AMPC_REDUCTION_SUM});
    ampc_autocast_exit();
    ASSERT_OK(ampc_backward(b));
    ASSERT_OK(ampc_optimizer_step(opt));   /* a's graph still holds the copies it used */
    /* the hidden and last weights are saved by a's graph for the input gradients: their copies
       were dropped, not overwritten (biases and the first weight may be refreshed: nothing
       saved them) */
    if (keep) {
        assert_null(p[2]->shadow);
        assert_null(p[4]->shadow);
    }
    ampc_optimizer_zero_grad(opt);
    ASSERT_OK(ampc_backward(a));
    *n = (size_t)ampc_tensor_numel(p[0]);
    float *g = malloc(*n * sizeof *g);
    ASSERT_OK(ampc_tensor_to_f32(ampc_tensor_grad(p[0]), g, *n));
    ampc_scope_end();
    ampc_optimizer_free(opt);
    ampc_module_free(net);
    ampc_autocast_keep_weight_casts(true);
    return g;
}

static void test_graph_keeps_its_copy(void **state) {
    (void)state;
    size_t n1, n2;
    float *on = grad_across_step(true, &n1), *off = grad_across_step(false, &n2);
    assert_int_equal(n1, n2);
    for (size_t i = 0; i < n1; i++)
        if (memcmp(&on[i], &off[i], sizeof(float)))
            fail_msg("gradient %zu: %.9g with kept copies, %.9g recast", i, on[i], off[i]);
    free(on);
    free(off);
}

// ---------------------------------------------------------------------------------------------
// Threads sharing a model

enum { ROUNDS = 60 };

typedef struct {
    ampc_module *net;
    ampc_dtype dt;
    float want[BATCH * OUT];
    int mismatches, failures;
} fwd_job;

static int forward_once(ampc_module *net, ampc_dtype dt, float *out) {
    ampc_scope_begin();
    ampc_tensor *x, *y;
    make_batch(0, &x, &y);
    ampc_no_grad_enter();
    ampc_autocast_enter(dt, true);
    ampc_tensor *o = ampc_module_forward(net, x);
    ampc_autocast_exit();
    ampc_no_grad_exit();
    int rc = o ? ampc_tensor_to_f32(o, out, BATCH * OUT) : -1;
    ampc_scope_end();
    return rc;
}

static void *fwd_thread(void *arg) {
    fwd_job *j = arg;
    for (int r = 0; r < ROUNDS; r++) {
        float got[BATCH * OUT];
        if (forward_once(j->net, j->dt, got) < 0) j->failures++;
        else if (memcmp(got, j->want, sizeof got)) j->mismatches++;
    }
    return NULL;
}

static void test_threads_share_a_model(void **state) {
    (void)state;
    ampc_module *net = make_net();
    fwd_job jobs[2] = {{.net = net, .dt = AMPC_BF16}, {.net = net, .dt = AMPC_F16}};
    for (int t = 0; t < 2; t++) ASSERT_OK(forward_once(net, jobs[t].dt, jobs[t].want));
    pthread_t th[2];
    for (int t = 0; t < 2; t++) assert_int_equal(pthread_create(&th[t], NULL, fwd_thread, &jobs[t]), 0);
    for (int t = 0; t < 2; t++) assert_int_equal(pthread_join(th[t], NULL), 0);
    for (int t = 0; t < 2; t++) {
        assert_int_equal(jobs[t].failures, 0);
        assert_int_equal(jobs[t].mismatches, 0);
    }
    ampc_module_free(net);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kernel_cast_out),
        cmocka_unit_test(test_training_bit_identical),
        cmocka_unit_test(test_writes_make_copies_stale),
        cmocka_unit_test(test_graph_keeps_its_copy),
        cmocka_unit_test(test_threads_share_a_model),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
