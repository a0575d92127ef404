/*
 * test_doctor.c - the numerics doctor and explain (src/amp/doctor.c) on the zoo's cnn: every op
 * of a training step listed with the dtypes the op table's policy gives (checked against the
 * table, op by op), casts counted once; a huge weight in one conv named as the first forward
 * overflow (intrinsic); a backward overflow that only the loss scale causes named as
 * scale-induced, and the same step at scale 1 clean.
 */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { B = 4 };

static ampc_module *cnn(void) {
    ampc_manual_seed(3);
    ampc_module *m = ampc_model_new("cnn", NULL);
    ASSERT_NOT_NULL_MSG(m);
    return m;
}

static ampc_tensor *batch(void) { return ampc_tensor_randn(AMPC_F32, 4, (int64_t[]){B, 1, 28, 28}, 0, 1); }
static ampc_tensor *labels(void) { return ampc_tensor_from_i64(1, (int64_t[]){B}, (int64_t[]){1, 3, 5, 7}); }

/* One training step's forward and backward under autocast (dt), the loss times scale. */
static void step(ampc_module *m, ampc_dtype dt, double scale) {
    ampc_tensor *x = batch(), *y = labels();
    ampc_autocast_enter(dt, true);
    ampc_tensor *loss = ampc_cross_entropy(ampc_module_forward(m, x), y, NULL);
    ampc_autocast_exit();
    ASSERT_NOT_NULL_MSG(loss);
    ASSERT_OK(ampc_backward(ampc_mul_scalar(loss, scale)));
}

static bool is_float(ampc_dtype d) { return d == AMPC_F32 || d == AMPC_F16 || d == AMPC_BF16 || d == AMPC_F64; }

static ampc_op op_by_name(const char *name) {
    for (int i = 0; i < AMPC_OP_COUNT; i++)
        if (!strcmp(ampc_op_name((ampc_op)i), name)) return (ampc_op)i;
    fail_msg("no op named %s", name);
    return AMPC_OP_COUNT;
}

static void test_explain_cnn(void **state) {
    (void)state;
    ampc_module *m = cnn();
    ampc_module_train(m, true);
    for (int dti = 0; dti < 2; dti++) {
        const ampc_dtype dt = dti ? AMPC_F16 : AMPC_BF16;
        ampc_scope_begin();
        step(m, dt, 1.0);   /* a first step: the weight casts kept from here on */
        ampc_scope_end();
        ampc_scope_begin();
        ASSERT_OK(ampc_explain_begin());
        assert_int_equal(ampc_explain_begin(), AMPC_ERR_STATE);
        step(m, dt, 1.0);
        ampc_explain_row *rows;
        int n = ampc_explain_end(&rows);
        ampc_scope_end();
        assert_true(n > 10);
        int fwd = 0, bwd = 0, convs = 0, linears = 0;
        int64_t conv1_cast = -1;
        for (int k = 0; k < n; k++) {
            const ampc_explain_row *r = &rows[k];
            if (r->backward) {
                bwd++;
                continue;
            }
            fwd++;
            if (r->policy == AMPC_POLICY_UNSET) {   /* outside the region (the loss's scaling): no casts */
                assert_string_equal(r->op, "mul_scalar");
                assert_int_equal(r->run_dtype[0], r->in_dtype[0]);
                continue;
            }
            /* the policy is the table's, and the kernel read what it prescribes */
            ampc_policy want = ampc_op_policy(op_by_name(r->op), dt);
            if (r->policy != want) fail_msg("%s %s: policy %s, table says %s", r->module, r->op, ampc_policy_name(r->policy), ampc_policy_name(want));
            ampc_dtype widest = AMPC_DTYPE_COUNT;
            for (int i = 0; i < r->n_in; i++)
                if (is_float(r->in_dtype[i]) && (widest == AMPC_DTYPE_COUNT || r->in_dtype[i] == AMPC_F32)) widest = r->in_dtype[i];
            for (int i = 0; i < r->n_in; i++) {
                if (!is_float(r->in_dtype[i])) continue;
                ampc_dtype expect = want == AMPC_POLICY_LOWER ? dt : want == AMPC_POLICY_FP32 ? AMPC_F32
                                  : want == AMPC_POLICY_PROMOTE ? widest : r->in_dtype[i];
                if (r->run_dtype[i] != expect)
                    fail_msg("%s %s (%s): input %d ran as %s, the policy gives %s", r->module, r->op, ampc_policy_name(want), i,
                             ampc_dtype_name(r->run_dtype[i]), ampc_dtype_name(expect));
            }
            if (want == AMPC_POLICY_LOWER && r->out_dtype != dt) fail_msg("%s %s: output %s", r->module, r->op, ampc_dtype_name(r->out_dtype));
            if (want == AMPC_POLICY_FP32 && r->out_dtype != AMPC_F32) fail_msg("%s %s: output %s", r->module, r->op, ampc_dtype_name(r->out_dtype));
            if (!strcmp(r->op, "conv2d")) {
                convs++;
                if (!strcmp(r->module, "conv1")) conv1_cast = r->cast_bytes;
                else assert_string_equal(r->module, "conv2");
            }
            if (!strcmp(r->op, "linear")) {
                linears++;
                assert_true(!strcmp(r->module, "fc1") || !strcmp(r->module, "fc2"));
            }
        }
        /* conv1 casts the batch (B x 1 x 28 x 28) to 16 bits; its weight's copy is kept from
           the first step, so it writes nothing new */
        assert_int_equal(conv1_cast, (int64_t)B * 28 * 28 * 2);
        assert_int_equal(convs, 2);
        assert_int_equal(linears, 2);
        assert_true(bwd >= 4);
        bool conv_bwd = false;
        for (int k = 0; k < n; k++) conv_bwd |= rows[k].backward && !strcmp(rows[k].module, "conv2") && strstr(rows[k].op, "Conv");
        assert_true(conv_bwd);
        print_message("explain %s: %d forward and %d backward ops\n", ampc_dtype_name(dt), fwd, bwd);
        free(rows);
    }
    ampc_explain_row *none;
    assert_int_equal(ampc_explain_end(&none), AMPC_ERR_STATE);
    ampc_module_free(m);
}

/* ampc_autocast_fp32_modules("fc*"): the cnn's fc1 and fc2 run their linears in fp32 under fp16
   autocast (inputs cast up, fp32 output), the convolutions stay fp16; a pattern naming a parent
   covers its children; cleared, the table's policies again. */
static void test_fp32_modules(void **state) {
    (void)state;
    ampc_module *m = cnn();
    const char *const pats[3] = {"fc*", "conv2,fc?", NULL};
    for (int k = 0; k < 3; k++) {
        ASSERT_OK(ampc_autocast_fp32_modules(pats[k]));
        ampc_scope_begin();
        ASSERT_OK(ampc_explain_begin());
        step(m, AMPC_F16, 1.0);
        ampc_explain_row *rows;
        int n = ampc_explain_end(&rows);
        ampc_scope_end();
        assert_true(n > 10);
        int checked = 0;
        for (int i = 0; i < n; i++) {
            const ampc_explain_row *r = &rows[i];
            if (r->backward || (strcmp(r->op, "linear") && strcmp(r->op, "conv2d"))) continue;
            bool fp32 = pats[k] && (!strncmp(r->module, "fc", 2) || (k == 1 && !strcmp(r->module, "conv2")));
            assert_int_equal(r->policy, fp32 ? AMPC_POLICY_FP32 : AMPC_POLICY_LOWER);
            assert_int_equal(r->out_dtype, fp32 ? AMPC_F32 : AMPC_F16);
            for (int j = 0; j < r->n_in; j++)
                if (r->run_dtype[j] != AMPC_DTYPE_COUNT) assert_int_equal(r->run_dtype[j], fp32 ? AMPC_F32 : AMPC_F16);
            checked++;
        }
        assert_int_equal(checked, 4);
        free(rows);
    }
    assert_int_equal(ampc_autocast_fp32_modules("fc1,,fc2"), AMPC_ERR_INVALID);
    ampc_module_free(m);
}

static void set_all(ampc_tensor *t, float v) {  /* every element v */
    int64_t n = ampc_tensor_numel(t);
    float *buf = malloc((size_t)n * sizeof *buf);
    for (int64_t i = 0; i < n; i++) buf[i] = v;
    ASSERT_OK(ampc_tensor_copy_from_f32(t, buf, (size_t)n));
    free(buf);
}

static ampc_tensor *param(ampc_module *m, const char *name) {
    ampc_tensor **p;
    const char **names;
    int n = ampc_module_parameters(m, &p, &names);
    for (int i = 0; i < n; i++)
        if (!strcmp(names[i], name)) return p[i];
    fail_msg("no parameter %s", name);
    return NULL;
}

/* A huge conv2 weight: conv2's fp16 output overflows in the forward, whatever the scale. */
static void test_doctor_intrinsic(void **state) {
    (void)state;
    ampc_module *m = cnn();
    set_all(param(m, "conv2.weight"), 3e3f);   /* 288 products of ~|x| 1 * 3e3: ~1e5 > 65504 */
    ampc_doctor_enable(true);
    assert_true(ampc_doctor_is_enabled());
    ampc_scope_begin();
    ampc_doctor_step_begin(65536);
    step(m, AMPC_F16, 65536);
    ampc_doctor_finding f = ampc_doctor_finding_get();
    ampc_scope_end();
    ampc_doctor_enable(false);
    print_message("doctor: %s %s (%s), %lld of %lld non-finite: %s\n", f.module, f.op, f.backward ? "backward" : "forward",
                  (long long)f.nonfinite, (long long)f.numel, ampc_doctor_verdict_name(f.verdict));
    assert_int_equal(f.verdict, AMPC_DOCTOR_INTRINSIC);
    assert_false(f.backward);
    assert_string_equal(f.module, "conv2");
    assert_string_equal(f.op, "conv2d");
    assert_true(f.nonfinite > 0);
    ampc_module_free(m);
}

/* fc2's gradients at scale 2^16: a confident net's logit gradients are up to 1/B per sample,
   so the incoming gradient is up to 2^14, and fc2's input gradient (weights of magnitude ~8,
   ten classes) overflows fp16's 65504; at scale 1 the same step is clean. */
static void test_doctor_scale_induced(void **state) {
    (void)state;
    ampc_module *m = cnn();
    ampc_tensor *w = param(m, "fc2.weight");
    float *big = malloc((size_t)ampc_tensor_numel(w) * sizeof *big);
    uint64_t rs = 99;
    for (int64_t i = 0; i < ampc_tensor_numel(w); i++) big[i] = (float)tu_uniform(&rs, -12, 12);
    ASSERT_OK(ampc_tensor_copy_from_f32(w, big, (size_t)ampc_tensor_numel(w)));
    free(big);
    ampc_doctor_enable(true);
    double scales[2] = {65536, 1};
    for (int k = 0; k < 2; k++) {
        ampc_scope_begin();
        ampc_doctor_step_begin(scales[k]);
        step(m, AMPC_F16, scales[k]);
        ampc_doctor_finding f = ampc_doctor_finding_get();
        ampc_scope_end();
        print_message("doctor at scale %g: %s %s (%s): %s\n", scales[k], f.module ? f.module : "-", f.op ? f.op : "-",
                      f.backward ? "backward" : "forward", ampc_doctor_verdict_name(f.verdict));
        if (k == 0) {
            assert_int_equal(f.verdict, AMPC_DOCTOR_SCALE_INDUCED);
            assert_true(f.backward);
            assert_string_equal(f.module, "fc2");
            assert_true(f.scale == 65536);
        } else {
            assert_int_equal(f.verdict, AMPC_DOCTOR_CLEAN);
        }
    }
    ampc_doctor_enable(false);
    ampc_module_free(m);
}

/* Numerics statistics on tiny gradients: loss = sum(linear(x) * (c * scale)) with c
   log-uniform in [1e-12, 1e-3], outside autocast, so the Linear's fp16 output is cast up (a
   recorded cast) and its gradient arrives as exactly c * scale in f32 (scale a power of 2),
   which the cast's backward narrows to fp16. That row (CastBackward) counts the values fp16
   flushes to zero or keeps only as subnormals: equal to the test's own count from c, about half
   flushed at scale 1 and none at 65536. */
static void test_numerics_underflow(void **state) {
    (void)state;
    enum { N = 64, IN = 16, OUT = 32 };
    ampc_manual_seed(8);
    ampc_module *lin = ampc_linear_new(IN, OUT, true);
    ASSERT_NOT_NULL_MSG(lin);
    static float c[N * OUT];
    uint64_t rs = 5;
    for (int i = 0; i < N * OUT; i++) c[i] = (float)pow(10.0, tu_uniform(&rs, -12, -3));
    const double scales[2] = {1, 65536};
    double flushed_frac[2];
    for (int k = 0; k < 2; k++) {
        static float cs[N * OUT];
        int64_t want_flushed = 0, want_sub = 0;
        for (int i = 0; i < N * OUT; i++) {
            cs[i] = c[i] * (float)scales[k];
            double a = fabs((double)cs[i]);
            want_flushed += a < 0x1p-25;
            want_sub += a >= 0x1p-25 && a < 0x1p-14;
        }
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_randn(AMPC_F32, 2, (int64_t[]){N, IN}, 0, 1);
        ampc_tensor *ct = ampc_tensor_from_f32(AMPC_F32, 2, (int64_t[]){N, OUT}, cs);
        ASSERT_OK(ampc_numerics_begin(AMPC_F16));
        assert_int_equal(ampc_numerics_begin(AMPC_F16), AMPC_ERR_STATE);
        ampc_autocast_enter(AMPC_F16, true);
        ampc_tensor *y = ampc_module_forward(lin, x);
        ampc_autocast_exit();
        ASSERT_OK(ampc_backward(ampc_sum(ampc_mul(y, ct), AMPC_ALL_DIMS, false)));
        ampc_numerics_row *rows;
        int n = ampc_numerics_end(&rows);
        ampc_scope_end();
        assert_true(n > 0);
        const ampc_numerics_row *r = NULL;
        for (int i = 0; i < n; i++)
            if (rows[i].backward && !strcmp(rows[i].op, "CastBackward")) r = &rows[i];
        ASSERT_NOT_NULL_MSG(r);
        assert_int_equal(r->values, N * OUT);
        assert_int_equal(r->flushed, want_flushed);
        assert_int_equal(r->subnormal, want_sub);
        assert_int_equal(r->saturated, 0);
        flushed_frac[k] = (double)r->flushed / (double)r->values;
        print_message("scale %g: the Linear output's gradient: %.1f%% flushed, %.1f%% subnormal in fp16 (amax %.3g)\n", scales[k],
                      100 * flushed_frac[k], 100.0 * (double)r->subnormal / (double)r->values, r->amax);
        /* the forward rows are there too: the linear's fp16 output */
        bool fwd = false;
        for (int i = 0; i < n; i++) fwd |= !rows[i].backward && !strcmp(rows[i].op, "linear") && rows[i].values == N * OUT;
        assert_true(fwd);
        free(rows);
    }
    assert_true(flushed_frac[0] > 0.3);
    assert_true(flushed_frac[1] < 0.01);
    ampc_numerics_row *none;
    assert_int_equal(ampc_numerics_end(&none), AMPC_ERR_STATE);
    assert_int_equal(ampc_numerics_begin(AMPC_F32), AMPC_ERR_DTYPE);
    ampc_module_free(lin);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_explain_cnn),
        cmocka_unit_test(test_fp32_modules),
        cmocka_unit_test(test_doctor_intrinsic),
        cmocka_unit_test(test_doctor_scale_induced),
        cmocka_unit_test(test_numerics_underflow),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
