/*
 * test_optim.c - SGD, Adam and AdamW against an fp64 re-implementation of PyTorch 1.13's
 * update rules written here (independent of the kernels), on the CPU device (fp32) and the
 * REF device (f64); skipping of params without grad; optimizer state memory; errors; and the
 * CPU kernels bit for bit against the same updates replayed here in fp32 on a large parameter
 * (threads, blocks, a ragged tail).
 *
 * Tolerances: the oracle carries, per element, a first-order bound on the difference between
 * the device's arithmetic and exact arithmetic: every rounded op adds u*|result| (u the
 * device dtype's unit roundoff; a product with a rounded constant 2u), and errors in inputs
 * propagate through the op's derivative (sqrt: e/(2 sqrt v)). The check is |got - ref| <= 2e:
 * the factor 2 covers second-order terms and the oracle's own f64 rounding (which obeys the
 * same bound with u = 2^-53, so it matters only on REF).
 */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/core.h"
#include "optim/optim.h"

#define STEPS 6

// ---------------------------------------------------------------------------------------------
// The oracle

typedef struct {
    double p, buf, m, v, vmax;       /* values in exact (f64) arithmetic */
    double ep, ebuf, em, ev, evmax;  /* bounds on the device's deviation from them */
    int64_t step;
} elem;

typedef struct {
    const char *name;
    ampc_optim_kind kind;
    ampc_sgd_options sgd;
    ampc_adam_options adam;
} optcase;

static void oracle_sgd(elem *e, double g, const ampc_sgd_options *o, double u) {
    double d = g, ed = 0;
    if (o->weight_decay != 0) {
        d = g + o->weight_decay * e->p;
        ed = o->weight_decay * e->ep + 2 * u * o->weight_decay * fabs(e->p) + u * fabs(d);
    }
    if (o->momentum != 0) {
        double keep = 1 - o->dampening;
        if (e->step == 0) {
            e->buf = d;
            e->ebuf = ed;
        } else {
            double nb = o->momentum * e->buf + keep * d;
            e->ebuf = o->momentum * e->ebuf + keep * ed + 2 * u * o->momentum * fabs(e->buf) + 2 * u * keep * fabs(d) +
                      u * fabs(nb);
            e->buf = nb;
        }
        if (o->nesterov) {
            double nd = d + o->momentum * e->buf;
            ed = ed + o->momentum * e->ebuf + 2 * u * o->momentum * fabs(e->buf) + u * fabs(nd);
            d = nd;
        } else {
            d = e->buf;
            ed = e->ebuf;
        }
    }
    double np = e->p - o->lr * d;
    e->ep = e->ep + o->lr * ed + 2 * u * o->lr * fabs(d) + u * fabs(np);
    e->p = np;
    e->step++;
}

static void oracle_adam(elem *e, double g, const ampc_adam_options *o, bool decoupled, double u) {
    int64_t t = ++e->step;
    double bc1 = 1 - pow(o->beta1, (double)t), bc2 = 1 - pow(o->beta2, (double)t);
    double ss = o->lr / bc1, bs = sqrt(bc2);
    double pi = e->p, epi = e->ep;
    if (decoupled) {
        pi = e->p * (1 - o->lr * o->weight_decay);
        epi = e->ep * (1 - o->lr * o->weight_decay) + 2 * u * fabs(pi);
    }
    double gi = g, eg = 0;
    if (!decoupled && o->weight_decay != 0) {
        gi = g + o->weight_decay * pi;
        eg = o->weight_decay * epi + 2 * u * o->weight_decay * fabs(pi) + u * fabs(gi);
    }
    double nm = o->beta1 * e->m + (1 - o->beta1) * gi;
    e->em = o->beta1 * e->em + (1 - o->beta1) * eg + 2 * u * o->beta1 * fabs(e->m) + 2 * u * (1 - o->beta1) * fabs(gi) +
            u * fabs(nm);
    e->m = nm;
    double nv = o->beta2 * e->v + (1 - o->beta2) * gi * gi;
    e->ev = o->beta2 * e->ev + (1 - o->beta2) * 2 * fabs(gi) * eg + 2 * u * o->beta2 * fabs(e->v) +
            3 * u * (1 - o->beta2) * gi * gi + u * fabs(nv);
    e->v = nv;
    double vi = nv, evi = e->ev;
    if (o->amsgrad) {   /* max is 1-Lipschitz in each argument */
        e->vmax = fmax(e->vmax, nv);
        e->evmax = fmax(e->evmax, e->ev);
        vi = e->vmax;
        evi = e->evmax;
    }
    double s = sqrt(vi), es = evi / (2 * s) + u * s;
    double q = s / bs, eq = es / bs + 2 * u * q;
    double den = q + o->eps, eden = eq + u * den + u * o->eps;
    double upd = ss * e->m / den;
    double eupd = ss * e->em / den + fabs(upd) * eden / den + 3 * u * fabs(upd);
    double np = pi - upd;
    e->ep = epi + eupd + u * fabs(np);
    e->p = np;
}

/* Asserts |got[i] - ref[i]| <= 2 * bound[i] + tiny for all i; names the worst. */
static void assert_within(const char *what, const double *got, const elem *ref, size_t n, int which) {
    size_t bad = 0, worst = 0;
    double worst_ratio = 0;
    for (size_t i = 0; i < n; i++) {
        double r = which == 0 ? ref[i].p : which == 1 ? ref[i].m : which == 2 ? ref[i].v : ref[i].buf;
        double e = which == 0 ? ref[i].ep : which == 1 ? ref[i].em : which == 2 ? ref[i].ev : ref[i].ebuf;
        double tol = 2 * e + 1e-300, err = fabs(got[i] - r);
        if (!(err <= tol)) {
            bad++;
            if (!(err / tol <= worst_ratio)) {
                worst_ratio = err / tol;
                worst = i;
            }
        }
    }
    if (getenv("TEST_OPTIM_VERBOSE")) {
        double mx = 0;
        for (size_t i = 0; i < n; i++) {
            double r = which == 0 ? ref[i].p : which == 1 ? ref[i].m : which == 2 ? ref[i].v : ref[i].buf;
            double e = which == 0 ? ref[i].ep : which == 1 ? ref[i].em : which == 2 ? ref[i].ev : ref[i].ebuf;
            if (e > 0) mx = fmax(mx, fabs(got[i] - r) / e);
        }
        print_message("%s: max err/bound %.3f\n", what, mx);
    }
    if (bad) fail_msg("%s: %zu of %zu values out of their bound; worst [%zu] err/(2 bound) %.3g", what, bad, n, worst, worst_ratio);
}

// ---------------------------------------------------------------------------------------------
// Driving an optimizer and the oracle with the same gradients

static const int64_t sizes[] = {3000, 7};   /* several chunks and threads; a ragged tail */
#define NPARAMS 2

/* Gradient values of step t for parameter k: |g| in [0.5, 1] * scale, random sign, where the
   scale drops after two steps so amsgrad's max differs from v. */
static void grad_values(double *g, int64_t n, int t, int k, bool round_f32) {
    tu_fill_uniform(g, (size_t)n, 1000u + 17u * (unsigned)t + (unsigned)k, -1, 1);
    double scale = t < 2 ? 1.0 : 0.3;
    for (int64_t i = 0; i < n; i++) {
        g[i] = copysign(0.5 + 0.5 * fabs(g[i]), g[i]) * scale;
        if (round_f32) g[i] = (double)(float)g[i];
    }
}

static ampc_optimizer *make_opt(const optcase *c, ampc_tensor **p, int n) {
    switch (c->kind) {
    case AMPC_OPTIM_SGD: return ampc_sgd_new_params(p, n, &c->sgd);
    case AMPC_OPTIM_ADAM: return ampc_adam_new_params(p, n, &c->adam);
    default: return ampc_adamw_new_params(p, n, &c->adam);
    }
}

static void run_case(const optcase *c, ampc_device dev) {
    ampc_dtype dt = dev == AMPC_DEVICE_CPU ? AMPC_F32 : AMPC_F64;
    bool f32 = dt == AMPC_F32;
    double u = tu_eps(dt);
    ampc_set_default_device(dev);
    ampc_scope_begin();
    ampc_tensor *params[NPARAMS];
    elem *ref[NPARAMS];
    for (int k = 0; k < NPARAMS; k++) {
        int64_t n = sizes[k];
        double *init = malloc((size_t)n * sizeof *init);
        tu_fill_uniform(init, (size_t)n, 77u + (unsigned)k, -1, 1);
        ref[k] = calloc((size_t)n, sizeof *ref[k]);
        for (int64_t i = 0; i < n; i++) {
            if (f32) init[i] = (double)(float)init[i];
            ref[k][i].p = init[i];
        }
        params[k] = ampc_tensor_from_f64(dt, 1, &n, init);
        ASSERT_NOT_NULL_MSG(params[k]);
        ASSERT_OK(ampc_tensor_set_requires_grad(params[k], true));
        free(init);
    }
    ampc_optimizer *opt = make_opt(c, params, NPARAMS);
    ASSERT_NOT_NULL_MSG(opt);
    ampc_sgd_options so = c->sgd;
    ampc_adam_options ao = c->adam;
    for (int t = 0; t < STEPS; t++) {
        if (t == 3) {   /* a schedule changes the lr between steps */
            ampc_optimizer_set_lr(opt, ampc_optimizer_get_lr(opt) * 0.5);
            so.lr *= 0.5;
            ao.lr *= 0.5;
            assert_true(ampc_optimizer_get_lr(opt) == (c->kind == AMPC_OPTIM_SGD ? so.lr : ao.lr));
        }
        for (int k = 0; k < NPARAMS; k++) {
            int64_t n = sizes[k];
            double *g = malloc((size_t)n * sizeof *g);
            grad_values(g, n, t, k, f32);
            ASSERT_OK(ampc_backward_with_grad(params[k], ampc_tensor_from_f64(dt, 1, &n, g)));
            for (int64_t i = 0; i < n; i++) {
                if (c->kind == AMPC_OPTIM_SGD) oracle_sgd(&ref[k][i], g[i], &so, u);
                else oracle_adam(&ref[k][i], g[i], &ao, c->kind == AMPC_OPTIM_ADAMW, u);
            }
            free(g);
        }
        ASSERT_OK(ampc_optimizer_step(opt));
        ampc_optimizer_zero_grad(opt);
        for (int k = 0; k < NPARAMS; k++) assert_null(ampc_tensor_grad(params[k]));
    }
    char what[128];
    bool ams_mattered = false;
    for (int k = 0; k < NPARAMS; k++) {
        size_t n = (size_t)sizes[k];
        double *got = tu_values(params[k]);
        snprintf(what, sizeof what, "%s on %s: param %d", c->name, ampc_device_name(dev), k);
        assert_within(what, got, ref[k], n, 0);
        free(got);
        /* the state too: momentum buffer, or exp_avg and exp_avg_sq */
        int nstate = c->kind == AMPC_OPTIM_SGD ? (c->sgd.momentum != 0) : 2;
        for (int s = 0; s < nstate; s++) {
            ampc_tensor *st = opt->state[s][k];
            ASSERT_NOT_NULL_MSG(st);
            got = tu_values(st);
            snprintf(what, sizeof what, "%s on %s: state %d of param %d", c->name, ampc_device_name(dev), s, k);
            assert_within(what, got, ref[k], n, c->kind == AMPC_OPTIM_SGD ? 3 : 1 + s);
            free(got);
        }
        if (c->kind == AMPC_OPTIM_SGD && c->sgd.momentum == 0) assert_null(opt->state[0][k]);
        for (size_t i = 0; i < n; i++)
            if (ref[k][i].vmax > ref[k][i].v) ams_mattered = true;
        free(ref[k]);
    }
    if (c->kind != AMPC_OPTIM_SGD && c->adam.amsgrad) assert_true(ams_mattered);   /* the data exercise it */
    ampc_optimizer_free(opt);
    ampc_scope_end();
    ampc_set_default_device(AMPC_DEVICE_CPU);
}

// ---------------------------------------------------------------------------------------------
// Tests

static void test_sgd_variants(void **state) {
    (void)state;
    const optcase cases[] = {
        {.name = "SGD", .kind = AMPC_OPTIM_SGD, .sgd = {.lr = 0.1}},
        {.name = "SGD momentum", .kind = AMPC_OPTIM_SGD, .sgd = {.lr = 0.1, .momentum = 0.9}},
        {.name = "SGD momentum dampening", .kind = AMPC_OPTIM_SGD, .sgd = {.lr = 0.1, .momentum = 0.9, .dampening = 0.3}},
        {.name = "SGD nesterov", .kind = AMPC_OPTIM_SGD, .sgd = {.lr = 0.1, .momentum = 0.8, .nesterov = true}},
        {.name = "SGD weight decay", .kind = AMPC_OPTIM_SGD, .sgd = {.lr = 0.05, .weight_decay = 0.1}},
        {.name = "SGD all", .kind = AMPC_OPTIM_SGD, .sgd = {.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        run_case(&cases[i], AMPC_DEVICE_CPU);
        run_case(&cases[i], AMPC_DEVICE_REF);
    }
}

static void test_adam_variants(void **state) {
    (void)state;
    ampc_adam_options a = ampc_adam_defaults(), aw = ampc_adamw_defaults();
    assert_true(a.lr == 1e-3 && a.beta1 == 0.9 && a.beta2 == 0.999 && a.eps == 1e-8 && a.weight_decay == 0);
    assert_true(aw.weight_decay == 1e-2 && !aw.amsgrad);
    a.lr = aw.lr = 0.01;
    ampc_adam_options a_wd = a, a_ams = a, aw_big = aw, aw_ams = aw, a_eps = a;
    a_wd.weight_decay = 0.1;
    a_ams.amsgrad = true;
    a_ams.beta2 = 0.5;   /* v forgets fast, so it falls below its max within STEPS */
    aw_big.weight_decay = 0.5;
    aw_ams.amsgrad = true;
    aw_ams.beta2 = 0.6;
    a_eps.eps = 0.3;   /* eps comparable to sqrt(v): the denominator's sum matters */
    const optcase cases[] = {
        {.name = "Adam", .kind = AMPC_OPTIM_ADAM, .adam = a},          {.name = "Adam weight decay", .kind = AMPC_OPTIM_ADAM, .adam = a_wd},
        {.name = "Adam amsgrad", .kind = AMPC_OPTIM_ADAM, .adam = a_ams}, {.name = "Adam big eps", .kind = AMPC_OPTIM_ADAM, .adam = a_eps},
        {.name = "AdamW", .kind = AMPC_OPTIM_ADAMW, .adam = aw},       {.name = "AdamW wd 0.5", .kind = AMPC_OPTIM_ADAMW, .adam = aw_big},
        {.name = "AdamW amsgrad", .kind = AMPC_OPTIM_ADAMW, .adam = aw_ams},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        run_case(&cases[i], AMPC_DEVICE_CPU);
        run_case(&cases[i], AMPC_DEVICE_REF);
    }
}

/* A param without grad is left bit-identical with no state; when it first gets a grad its own
   step count starts at 1 (bias correction per parameter, as PyTorch's state['step']). */
static void test_skips_params_without_grad(void **state) {
    (void)state;
    ampc_scope_begin();
    int64_t n = 100;
    double init[100], g[100];
    tu_fill_uniform(init, 100, 5, -1, 1);
    tu_fill_uniform(g, 100, 6, -1, 1);
    ampc_tensor *a = ampc_tensor_from_f64(AMPC_F32, 1, &n, init), *b = ampc_tensor_from_f64(AMPC_F32, 1, &n, init);
    ampc_tensor *fresh = ampc_tensor_from_f64(AMPC_F32, 1, &n, init);
    ampc_tensor *gt = ampc_tensor_from_f64(AMPC_F32, 1, &n, g);
    ASSERT_OK(ampc_tensor_set_requires_grad(a, true));
    ASSERT_OK(ampc_tensor_set_requires_grad(b, true));
    ASSERT_OK(ampc_tensor_set_requires_grad(fresh, true));
    ampc_adam_options o = ampc_adam_defaults();
    o.amsgrad = true;
    ampc_optimizer *opt = ampc_adam_new_params((ampc_tensor *[]){a, b}, 2, &o);
    ASSERT_NOT_NULL_MSG(opt);
    size_t mem0 = ampc_memory_stats().current[AMPC_MEM_OPTIMIZER];
    for (int t = 0; t < 3; t++) {
        ASSERT_OK(ampc_backward_with_grad(a, gt));
        ASSERT_OK(ampc_optimizer_step(opt));
        ampc_optimizer_zero_grad(opt);
    }
    assert_memory_equal(ampc_tensor_data(b), ampc_tensor_data(fresh), 400);
    assert_null(opt->state[0][1]);
    assert_null(opt->state[1][1]);
    assert_null(opt->state[2][1]);
    assert_int_equal(opt->steps[0], 3);
    assert_int_equal(opt->steps[1], 0);
    /* state of one parameter only: exp_avg, exp_avg_sq, max_exp_avg_sq of 400 bytes each */
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_OPTIMIZER] - mem0, 3 * 448);
    ASSERT_OK(ampc_backward_with_grad(b, gt));
    ASSERT_OK(ampc_optimizer_step(opt));
    ampc_optimizer *one = ampc_adam_new_params(&fresh, 1, &o);
    ASSERT_OK(ampc_backward_with_grad(fresh, gt));
    ASSERT_OK(ampc_optimizer_step(one));
    assert_memory_equal(ampc_tensor_data(b), ampc_tensor_data(fresh), 400);
    assert_int_equal(opt->steps[1], 1);
    ampc_optimizer_free(one);
    ampc_optimizer_free(opt);
    ampc_scope_end();
}

/* count_nonfinite sees NaN/inf in a parameter and in Adam's moments, for every float dtype of a
   tensor, and counts exactly (a bit-pattern set: every NaN, both infinities, the largest finite). */
static void test_count_nonfinite(void **state) {
    (void)state;
    ampc_scope_begin();
    const ampc_dtype dts[] = {AMPC_F32, AMPC_F16, AMPC_BF16};
    for (size_t d = 0; d < 3; d++) {
        int64_t n = 5000;
        float *v = malloc((size_t)n * sizeof *v);
        for (int64_t i = 0; i < n; i++) v[i] = (float)(i % 7) - 3.0f;
        v[0] = NAN, v[1] = INFINITY, v[4999] = -INFINITY, v[2048] = -NAN;
        v[3] = 1e4f;   /* finite in every dtype */
        ampc_tensor *t = ampc_tensor_from_f32(dts[d], 1, &n, v);
        assert_int_equal(ampc_tensor_count_nonfinite(t), 4);
        free(v);
    }
    int64_t n = 100;
    double init[100], g[100];
    tu_fill_uniform(init, 100, 5, -1, 1);
    tu_fill_uniform(g, 100, 6, -1, 1);
    ampc_tensor *a = ampc_tensor_from_f64(AMPC_F32, 1, &n, init);
    ASSERT_OK(ampc_tensor_set_requires_grad(a, true));
    ampc_optimizer *opt = ampc_adam_new_params(&a, 1, NULL);
    assert_int_equal(ampc_optimizer_count_nonfinite(opt), 0);
    g[7] = INFINITY;   /* an inf gradient: exp_avg and exp_avg_sq get inf, the parameter NaN */
    ampc_tensor *gt = ampc_tensor_from_f64(AMPC_F32, 1, &n, g);
    ASSERT_OK(ampc_backward_with_grad(a, gt));
    ASSERT_OK(ampc_optimizer_step(opt));
    assert_int_equal(ampc_tensor_count_nonfinite(a), 1);
    assert_int_equal(ampc_tensor_count_nonfinite(opt->state[0][0]), 1);
    assert_int_equal(ampc_tensor_count_nonfinite(opt->state[1][0]), 1);
    assert_int_equal(ampc_optimizer_count_nonfinite(opt), 3);
    assert_true(ampc_optimizer_count_nonfinite(NULL) < 0);
    assert_true(ampc_tensor_count_nonfinite(NULL) < 0);
    ampc_optimizer_free(opt);
    ampc_scope_end();
}

/* State is fp32, counted as optimizer memory, allocated at the first step, released by free. */
static void test_state_memory(void **state) {
    (void)state;
    ampc_scope_begin();
    int64_t n = 1024;   /* 4096 bytes: exactly one allocator size class */
    ampc_tensor *p = ampc_tensor_zeros(AMPC_F32, 1, &n), *g = ampc_tensor_full(AMPC_F32, 1, &n, 0.25);
    ASSERT_OK(ampc_tensor_set_requires_grad(p, true));
    struct { ampc_optimizer *opt; size_t bytes; } cases[4];
    cases[0].opt = ampc_sgd_new_params(&p, 1, &(ampc_sgd_options){.lr = 0.1});
    cases[0].bytes = 0;   /* no momentum: no buffer, like PyTorch */
    cases[1].opt = ampc_sgd_new_params(&p, 1, &(ampc_sgd_options){.lr = 0.1, .momentum = 0.5});
    cases[1].bytes = 4096;
    cases[2].opt = ampc_adamw_new_params(&p, 1, NULL);
    cases[2].bytes = 2 * 4096;
    ampc_adam_options ams = ampc_adam_defaults();
    ams.amsgrad = true;
    cases[3].opt = ampc_adam_new_params(&p, 1, &ams);
    cases[3].bytes = 3 * 4096;
    for (int i = 0; i < 4; i++) {
        ASSERT_NOT_NULL_MSG(cases[i].opt);
        ampc_memory_stats_t s0 = ampc_memory_stats();
        ASSERT_OK(ampc_optimizer_step(cases[i].opt));   /* no grad yet: nothing happens */
        assert_int_equal(ampc_memory_stats().current[AMPC_MEM_OPTIMIZER], s0.current[AMPC_MEM_OPTIMIZER]);
        assert_int_equal(ampc_optimizer_steps_taken(cases[i].opt), 0);   /* nothing stepped */
        ASSERT_OK(ampc_backward_with_grad(p, g));
        ASSERT_OK(ampc_optimizer_step(cases[i].opt));
        assert_int_equal(ampc_optimizer_steps_taken(cases[i].opt), 1);
        ampc_optimizer_zero_grad(cases[i].opt);
        ampc_memory_stats_t s1 = ampc_memory_stats();
        assert_int_equal(s1.current[AMPC_MEM_OPTIMIZER] - s0.current[AMPC_MEM_OPTIMIZER], cases[i].bytes);
        assert_int_equal(s1.current[AMPC_MEM_GRADIENTS], s0.current[AMPC_MEM_GRADIENTS]);   /* grad gone */
        if (cases[i].bytes) assert_int_equal(ampc_tensor_dtype(cases[i].opt->state[0][0]), AMPC_F32);
        ampc_optimizer_free(cases[i].opt);
        assert_int_equal(ampc_memory_stats().current[AMPC_MEM_OPTIMIZER], s0.current[AMPC_MEM_OPTIMIZER]);
    }
    ampc_scope_end();
}

static void test_errors(void **state) {
    (void)state;
    ampc_scope_begin();
    int64_t n = 4;
    ampc_tensor *h = ampc_tensor_zeros(AMPC_F16, 1, &n), *f = ampc_tensor_zeros(AMPC_F32, 1, &n);
    ASSERT_OK(ampc_tensor_set_requires_grad(h, true));
    ASSERT_OK(ampc_tensor_set_requires_grad(f, true));
    ampc_clear_error();
    assert_null(ampc_sgd_new_params((ampc_tensor *[]){f, h}, 2, NULL));
    assert_int_equal(ampc_last_status(), AMPC_ERR_DTYPE);
    assert_non_null(strstr(ampc_last_error(), "f16"));
    assert_null(ampc_adam_new_params(&h, 1, NULL));
    assert_int_equal(ampc_last_status(), AMPC_ERR_DTYPE);
    assert_null(ampc_sgd_new_params((ampc_tensor *[]){NULL}, 1, NULL));
    assert_null(ampc_sgd_new_params(&f, 1, &(ampc_sgd_options){.lr = 0.1, .nesterov = true}));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    assert_null(ampc_sgd_new_params(&f, 1, &(ampc_sgd_options){.lr = -1}));
    ampc_adam_options bad = ampc_adam_defaults();
    bad.beta2 = 1.0;
    assert_null(ampc_adam_new_params(&f, 1, &bad));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    assert_int_equal(ampc_optimizer_step(NULL), AMPC_ERR_INVALID);
    /* an empty optimizer is valid (PyTorch refuses it; nothing here depends on that) */
    ampc_optimizer *empty = ampc_sgd_new_params(NULL, 0, NULL);
    ASSERT_NOT_NULL_MSG(empty);
    ASSERT_OK(ampc_optimizer_step(empty));
    assert_int_equal(ampc_optimizer_num_params(empty), 0);
    ampc_optimizer_free(empty);
    /* accessors */
    ampc_optimizer *o = ampc_sgd_new_params(&f, 1, NULL);
    assert_true(ampc_optimizer_get_lr(o) == 1e-3);
    assert_ptr_equal(ampc_optimizer_param(o, 0), f);
    assert_null(ampc_optimizer_param(o, 1));
    ampc_optimizer_set_lr(o, -1);   /* refused */
    assert_true(ampc_optimizer_get_lr(o) == 1e-3);
    ampc_optimizer_free(o);
    ampc_scope_end();
}

/* The optimizer holds its parameters: freeing them (or their module) first is safe. */
static void test_holds_params(void **state) {
    (void)state;
    int64_t n = 8;
    ampc_tensor *p = ampc_tensor_own(ampc_tensor_full(AMPC_F32, 1, &n, 1.0));
    ASSERT_OK(ampc_tensor_set_requires_grad(p, true));
    ampc_optimizer *o = ampc_sgd_new_params(&p, 1, &(ampc_sgd_options){.lr = 0.5});
    ampc_tensor_free(p);
    ampc_scope_begin();
    ASSERT_OK(ampc_backward_with_grad(ampc_optimizer_param(o, 0), ampc_tensor_full(AMPC_F32, 1, &n, 1.0)));
    ASSERT_OK(ampc_optimizer_step(o));
    float v[8];   /* alive: reading it is fine under ASan */
    ASSERT_OK(ampc_tensor_to_f32(ampc_optimizer_param(o, 0), v, 8));
    for (int i = 0; i < 8; i++) assert_true(v[i] == 0.5f);
    ampc_scope_end();
    ampc_optimizer_free(o);
}


// ---------------------------------------------------------------------------------------------
// The fused kernels, bit for bit: PyTorch's single-tensor updates do one fp32 rounding per
// tensor op, in the order of the rules above; the kernels promise exactly those ops per
// element. Replayed here in scalar fp32 (ISO C: no contraction into FMAs) on 70001 elements
// (several blocks and both threads, a ragged tail), over every option combination.

#define BIG_N 70001

static void fill_f32(float *v, size_t n, uint64_t seed, double lo, double hi) {
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++) v[i] = (float)tu_uniform(&s, lo, hi);
}

static void expect_same_floats(const char *what, const float *got, const float *want, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)))
            fail_msg("%s [%zu]: %a, fp32 replay %a", what, i, (double)got[i], (double)want[i]);
}

static void test_sgd_kernel_matches_fp32_replay(void **state) {
    (void)state;
    ampc_scope_begin();
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_CPU);
    const int64_t n = BIG_N;
    float *p0 = malloc(n * sizeof(float)), *g = malloc(n * sizeof(float)), *b0 = malloc(n * sizeof(float));
    float *p = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
    fill_f32(p0, n, 1, -1, 1);
    fill_f32(g, n, 2, -1, 1);
    fill_f32(b0, n, 3, -0.5, 0.5);
    for (int k = 0; k < 32; k++) {
        bool wd = k & 1, mom = k & 2, first = k & 4, nest = k & 8, damp = k & 16;
        if (!mom && (first || nest || damp)) continue;   /* those only change momentum */
        ampc_sgd_hparams h = {.lr = 0.1, .momentum = mom ? 0.9 : 0, .dampening = damp ? 0.3 : 0,
                              .weight_decay = wd ? 0.01 : 0, .nesterov = nest};
        ampc_tensor *pt = ampc_tensor_empty(AMPC_F32, 1, &n), *gt = ampc_tensor_empty(AMPC_F32, 1, &n);
        ampc_tensor *bt = ampc_tensor_empty(AMPC_F32, 1, &n);
        memcpy(ampc_tensor_data(pt), p0, n * sizeof(float));
        memcpy(ampc_tensor_data(gt), g, n * sizeof(float));
        memcpy(ampc_tensor_data(bt), b0, n * sizeof(float));
        ampc_optim_item it = {.param = pt, .grad = gt, .state = {mom ? bt : NULL}, .first = first};
        ASSERT_OK(be->sgd_step(&it, 1, &h));
        const float fwd = (float)h.weight_decay, fm = (float)h.momentum, keep = (float)(1.0 - h.dampening);
        const float neg_lr = (float)-h.lr;
        for (int64_t i = 0; i < n; i++) {
            float d = g[i];
            if (wd) d = d + fwd * p0[i];
            b[i] = b0[i];
            if (mom) {
                b[i] = first ? d : fm * b0[i] + keep * d;
                d = nest ? d + fm * b[i] : b[i];
            }
            p[i] = p0[i] + neg_lr * d;
        }
        char what[64];
        snprintf(what, sizeof what, "SGD options %d param", k);
        expect_same_floats(what, ampc_tensor_data(pt), p, n);
        snprintf(what, sizeof what, "SGD options %d momentum buffer", k);
        expect_same_floats(what, ampc_tensor_data(bt), b, n);
    }
    free(p0), free(g), free(b0), free(p), free(b);
    ampc_scope_end();
}

static void test_adam_kernel_matches_fp32_replay(void **state) {
    (void)state;
    ampc_scope_begin();
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_CPU);
    const int64_t n = BIG_N;
    float *in[5], *out[5];   /* p, g, m, v, vmax */
    for (int t = 0; t < 5; t++) {
        in[t] = malloc(n * sizeof(float)), out[t] = malloc(n * sizeof(float));
        fill_f32(in[t], n, 10 + (uint64_t)t, t >= 3 ? 0 : -1, t >= 3 ? 1e-2 : 1);   /* v, vmax >= 0 */
    }
    for (int k = 0; k < 8; k++) {
        ampc_adam_hparams h = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = k & 1 ? 0.01 : 0,
                               .amsgrad = k & 2, .decoupled = k & 4};
        ampc_tensor *ts[5];
        for (int t = 0; t < 5; t++) {
            ts[t] = ampc_tensor_empty(AMPC_F32, 1, &n);
            memcpy(ampc_tensor_data(ts[t]), in[t], n * sizeof(float));
        }
        ampc_optim_item it = {.param = ts[0], .grad = ts[1], .state = {ts[2], ts[3], h.amsgrad ? ts[4] : NULL}, .step = 3};
        ASSERT_OK(be->adam_step(&it, 1, &h));
        /* the per-tensor scalars as the kernel's contract states: in double, rounded once */
        double bc1 = 1.0 - pow(h.beta1, 3.0), bc2 = 1.0 - pow(h.beta2, 3.0);
        const float decay = h.decoupled ? (float)(1.0 - h.lr * h.weight_decay) : 1.0f;
        const float l2 = h.decoupled ? 0.0f : (float)h.weight_decay, b1 = (float)h.beta1, omb1 = (float)(1.0 - h.beta1);
        const float b2 = (float)h.beta2, omb2 = (float)(1.0 - h.beta2), eps = (float)h.eps, bc2s = (float)sqrt(bc2);
        const float neg_ss = (float)(-h.lr / bc1);
        for (int64_t i = 0; i < n; i++) {
            float pi = in[0][i] * decay, gi = in[1][i] + l2 * pi;
            float mi = b1 * in[2][i] + omb1 * gi, vi = b2 * in[3][i] + omb2 * gi * gi;
            out[2][i] = mi, out[3][i] = vi, out[4][i] = in[4][i];
            if (h.amsgrad) vi = out[4][i] = in[4][i] > vi ? in[4][i] : vi;
            out[0][i] = pi + neg_ss * mi / (sqrtf(vi) / bc2s + eps);
        }
        const char *names[] = {"param", "", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
        for (int t = 0; t < 5; t++) {
            if (t == 1) continue;
            char what[64];
            snprintf(what, sizeof what, "Adam options %d %s", k, names[t]);
            expect_same_floats(what, ampc_tensor_data(ts[t]), out[t], n);
        }
    }
    for (int t = 0; t < 5; t++) free(in[t]), free(out[t]);
    ampc_scope_end();
}

/* One call over many parameters (more than one region's group of 64, sizes from 0 to several
   blocks, each with its own first-step flag or Adam step count) gives each parameter the
   bits a call of its own gives; an invalid item anywhere means nothing is written. */
enum { MANY = 70 };

static int64_t many_size(int i) {
    static const int64_t sizes[] = {0, 1, 7, 16383, 16384, 16385, 40000, 3, 100};
    return sizes[i % 9];
}

static void test_many_params_one_call(void **state) {
    (void)state;
    ampc_scope_begin();
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_CPU);
    for (int adam = 0; adam < 2; adam++) {
        ampc_tensor *t[2][MANY][5];   /* [together, alone][param][p, g, s0, s1, s2] */
        ampc_optim_item items[2][MANY];
        for (int i = 0; i < MANY; i++) {
            int64_t n = many_size(i);
            float *v = malloc((size_t)(n ? n : 1) * sizeof(float));
            for (int k = 0; k < 5; k++) {
                fill_f32(v, (size_t)n, 100 + (uint64_t)(i * 5 + k), k >= 3 ? 0 : -1, k >= 3 ? 1e-2 : 1);
                for (int c = 0; c < 2; c++) {
                    t[c][i][k] = ampc_tensor_empty(AMPC_F32, 1, &n);
                    memcpy(ampc_tensor_data(t[c][i][k]), v, (size_t)n * sizeof(float));
                }
            }
            free(v);
            for (int c = 0; c < 2; c++)
                items[c][i] = (ampc_optim_item){.param = t[c][i][0], .grad = t[c][i][1],
                                                .state = {t[c][i][2], t[c][i][3], t[c][i][4]},
                                                .first = i % 3 == 0, .step = 1 + i % 4};
        }
        ampc_sgd_hparams hs = {.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01};
        ampc_adam_hparams ha = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .amsgrad = true};
        /* an invalid item (a bf16 gradient) at the end: refused, and no parameter changed */
        ampc_tensor *bad = ampc_tensor_zeros(AMPC_BF16, 1, (int64_t[]){7});
        ampc_optim_item saved = items[0][MANY - 1];
        items[0][MANY - 1].grad = bad;
        items[0][MANY - 1].param = t[0][MANY - 1][0];
        int rc = adam ? ampc__k_adam_step(items[0], MANY, &ha) : ampc__k_sgd_step(items[0], MANY, &hs);
        assert_int_equal(rc, AMPC_ERR_DTYPE);
        ampc_clear_error();
        for (int i = 0; i < MANY; i++)
            expect_same_floats("untouched after a refused call", ampc_tensor_cdata(t[0][i][0]), ampc_tensor_cdata(t[1][i][0]),
                               (size_t)many_size(i));
        items[0][MANY - 1] = saved;
        ASSERT_OK(adam ? be->adam_step(items[0], MANY, &ha) : be->sgd_step(items[0], MANY, &hs));
        for (int i = 0; i < MANY; i++) {
            ASSERT_OK(adam ? be->adam_step(&items[1][i], 1, &ha) : be->sgd_step(&items[1][i], 1, &hs));
            for (int k = 0; k < 5; k++) {
                char what[64];
                snprintf(what, sizeof what, "%s param %d tensor %d", adam ? "Adam" : "SGD", i, k);
                expect_same_floats(what, ampc_tensor_cdata(t[0][i][k]), ampc_tensor_cdata(t[1][i][k]), (size_t)many_size(i));
            }
        }
    }
    ampc_scope_end();
}

/* ZeRO's parts (ampc_optim_item begin/count): a parameter stepped in three parts, each with its
   own 1-D state, is bit for bit the parameter stepped whole, and its parts' state the slices of
   the whole state, on the CPU (f32) and REF (f64) kernels, SGD and Adam; a part out of range,
   a state of another size and a 16-bit copy for a part are refused before anything is written. */
static void test_parts(void **state) {
    (void)state;
    ampc_scope_begin();
    const int64_t n = 1000, cut[4] = {0, 304, 700, 1000};
    ampc_sgd_hparams hs = {.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01, .nesterov = true, .grad_scale = 0.5f};
    ampc_adam_hparams ha = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .amsgrad = true,
                            .grad_scale = 0.25f};
    for (int dev = AMPC_DEVICE_CPU; dev <= AMPC_DEVICE_REF; dev++)
        for (int adam = 0; adam < 2; adam++) {
            const ampc_backend *be = ampc__backend((ampc_device)dev);
            const ampc_dtype dt = dev == AMPC_DEVICE_REF ? AMPC_F64 : AMPC_F32;
            const size_t es = ampc__dt(dt)->size;
            float *v = malloc((size_t)n * sizeof(float));
            ampc_tensor *whole[5], *split[2], *part_state[3][3];   /* [p, g, s0, s1, s2]; param and grad of the parts */
            for (int k = 0; k < 5; k++) {
                fill_f32(v, (size_t)n, 300 + (uint64_t)k, k >= 3 ? 0 : -1, k >= 3 ? 1e-2 : 1);
                whole[k] = ampc__tensor_new(dt, (ampc_device)dev, 1, &n);
                ampc__dt(dt)->from_f32(v, ampc__data(whole[k]), (size_t)n);
                if (k < 2) {
                    split[k] = ampc__tensor_new(dt, (ampc_device)dev, 1, &n);
                    memcpy(ampc__data(split[k]), ampc__data(whole[k]), (size_t)n * es);
                } else {
                    for (int q = 0; q < 3; q++) {
                        int64_t c = cut[q + 1] - cut[q];
                        part_state[q][k - 2] = ampc__tensor_new(dt, (ampc_device)dev, 1, &c);
                        memcpy(ampc__data(part_state[q][k - 2]), (char *)ampc__data(whole[k]) + cut[q] * es, (size_t)c * es);
                    }
                }
            }
            free(v);
            ampc_optim_item w = {.param = whole[0], .grad = whole[1], .state = {whole[2], whole[3], whole[4]}, .step = 3}, parts[3];
            for (int q = 0; q < 3; q++)
                parts[q] = (ampc_optim_item){.param = split[0], .grad = split[1], .state = {part_state[q][0], part_state[q][1], part_state[q][2]},
                                             .step = 3, .begin = cut[q], .count = cut[q + 1] - cut[q]};
            /* refused: out of range, a state of the whole's size, a 16-bit copy */
            ampc_optim_item bad = parts[2];
            bad.count = 301;
            assert_int_equal(adam ? ampc__k_adam_step(&bad, 1, &ha) : ampc__k_sgd_step(&bad, 1, &hs), AMPC_ERR_SHAPE);
            bad = parts[1];
            bad.state[0] = whole[2];
            assert_int_equal(adam ? ampc__k_adam_step(&bad, 1, &ha) : ampc__k_sgd_step(&bad, 1, &hs), AMPC_ERR_SHAPE);
            if (dev == AMPC_DEVICE_CPU) {   /* REF tensors are f64 only */
                bad = parts[0];
                bad.cast_out = ampc__tensor_new(AMPC_BF16, (ampc_device)dev, 1, &n);
                assert_non_null(bad.cast_out);
                assert_int_equal(adam ? ampc__k_adam_step(&bad, 1, &ha) : ampc__k_sgd_step(&bad, 1, &hs), AMPC_ERR_INVALID);
                ampc__release(bad.cast_out);
            }
            assert_memory_equal(ampc__data(split[0]), ampc__data(whole[0]), (size_t)n * es);
            ampc_clear_error();
            ASSERT_OK(adam ? be->adam_step(&w, 1, &ha) : be->sgd_step(&w, 1, &hs));
            ASSERT_OK(adam ? be->adam_step(parts, 3, &ha) : be->sgd_step(parts, 3, &hs));
            assert_memory_equal(ampc__data(split[0]), ampc__data(whole[0]), (size_t)n * es);
            for (int q = 0; q < 3; q++)
                for (int k = 0; k < (adam ? 3 : 1); k++)
                    assert_memory_equal(ampc__data(part_state[q][k]), (char *)ampc__data(whole[k + 2]) + cut[q] * es,
                                        (size_t)(cut[q + 1] - cut[q]) * es);
            for (int k = 0; k < 5; k++) ampc__release(whole[k]);
            for (int k = 0; k < 2; k++) ampc__release(split[k]);
            for (int q = 0; q < 3; q++)
                for (int k = 0; k < 3; k++) ampc__release(part_state[q][k]);
        }
    ampc_scope_end();
}

/* tests/fixtures/lr_schedules.txt (make_lr_schedules.py, torch.optim.lr_scheduler): StepLR,
   CosineAnnealingLR and a constant rate, alone and after a LinearLR warm-up (SequentialLR), over
   300 steps each: ampc_lr_at's closed forms equal PyTorch's chained updates within 1e-12
   relative (their rounding differs in the last bits). Invalid settings give NaN and an error. */
static void test_lr_schedules_match_pytorch(void **state) {
    (void)state;
    char line[256];
    FILE *f = tu_open_fixture("lr_schedules.txt");
    ampc_lr_schedule sc = {0};
    double base = 0, worst = 0;
    int64_t t = 0;
    int configs = 0, values = 0;
    while (fgets(line, sizeof line, f)) {
        char kind[16], lr[40], gamma[40], eta[40], sf[40];
        long long step_size, t_max, warmup;
        if (sscanf(line, "config %15s %39s %lld %39s %lld %39s %lld %39s", kind, lr, &step_size, gamma, &t_max, eta, &warmup, sf) == 8) {
            sc = (ampc_lr_schedule){.kind = !strcmp(kind, "step") ? AMPC_LR_STEP : !strcmp(kind, "cosine") ? AMPC_LR_COSINE : AMPC_LR_CONSTANT,
                                    .step_size = step_size, .gamma = strtod(gamma, NULL), .t_max = t_max, .eta_min = strtod(eta, NULL),
                                    .warmup_steps = warmup, .warmup_start_factor = strtod(sf, NULL)};
            base = strtod(lr, NULL);
            t = 0;
            configs++;
            continue;
        }
        const double want = strtod(line, NULL), got = ampc_lr_at(&sc, base, t);
        const double rel = fabs(got - want) / want;
        if (!(rel <= 1e-12)) fail_msg("config %d step %lld: lr %.17g, PyTorch %.17g", configs, (long long)t, got, want);
        worst = fmax(worst, rel);
        t++;
        values++;
    }
    fclose(f);
    assert_int_equal(configs, 5);
    assert_int_equal(values, 1500);
    print_message("lr schedules: 1500 steps of 5 schedules within %.2g of PyTorch's\n", worst);
    const ampc_lr_schedule bad[] = {{.kind = AMPC_LR_STEP, .step_size = 0, .gamma = 0.1}, {.kind = AMPC_LR_COSINE, .t_max = 0},
                                    {.kind = AMPC_LR_CONSTANT, .warmup_steps = 5, .warmup_start_factor = 0}, {.kind = (ampc_lr_kind)7}};
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        ampc_clear_error();
        assert_true(isnan(ampc_lr_at(&bad[k], 0.1, 3)));
        assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    }
    assert_true(isnan(ampc_lr_at(&(ampc_lr_schedule){0}, 0.1, -1)));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sgd_variants),         cmocka_unit_test(test_adam_variants),
        cmocka_unit_test(test_skips_params_without_grad), cmocka_unit_test(test_state_memory),
        cmocka_unit_test(test_errors),               cmocka_unit_test(test_holds_params),
        cmocka_unit_test(test_sgd_kernel_matches_fp32_replay), cmocka_unit_test(test_adam_kernel_matches_fp32_replay),
        cmocka_unit_test(test_many_params_one_call),
        cmocka_unit_test(test_count_nonfinite),      cmocka_unit_test(test_parts),
        cmocka_unit_test(test_lr_schedules_match_pytorch),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
