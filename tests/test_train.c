/*
 * test_train.c - end to end: the MLP of examples/mlp_amp.c (8 -> 16 -> 16 -> 1, ReLU, MSE,
 * targets y = tanh(2 a.x) + 0.5 b.x of x ~ N(0, 1)) trained from the same initial weights in
 * fp32, under bf16 autocast, and under fp16 autocast with a GradScaler. Each run must learn
 * (the loss falls by a stated factor) and the mixed-precision runs must end where fp32 ends.
 */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { IN = 8, HIDDEN = 16, BATCH = 512, N_DATA = 20, EVAL = 2048, STEPS = 200 };
#define LR 0.05
#define MOMENTUM 0.9

typedef struct { ampc_tensor *x[N_DATA], *y[N_DATA], *ex, *ey; } dataset;

static float coef[2 * IN];

static ampc_tensor *targets(ampc_tensor *x, int64_t n) {
    float *xs = malloc((size_t)n * IN * sizeof *xs), *ys = malloc((size_t)n * sizeof *ys);
    ASSERT_OK(ampc_tensor_to_f32(x, xs, (size_t)n * IN));
    for (int64_t i = 0; i < n; i++) {
        double ax = 0, bx = 0;
        for (int k = 0; k < IN; k++) {
            ax += coef[k] * xs[i * IN + k];
            bx += coef[IN + k] * xs[i * IN + k];
        }
        ys[i] = (float)(tanh(2 * ax) + 0.5 * bx);
    }
    ampc_tensor *y = ampc_tensor_own(ampc_tensor_from_f32(AMPC_F32, 2, (int64_t[]){n, 1}, ys));
    free(xs);
    free(ys);
    return y;
}

static void make_data(dataset *d) {
    ampc_manual_seed(1);
    ASSERT_OK(ampc_tensor_to_f32(ampc_tensor_rand(AMPC_F32, 1, (int64_t[]){2 * IN}, -0.5, 0.5), coef, 2 * IN));
    for (int b = 0; b < N_DATA; b++) {
        d->x[b] = ampc_tensor_own(ampc_tensor_randn(AMPC_F32, 2, (int64_t[]){BATCH, IN}, 0, 1));
        d->y[b] = targets(d->x[b], BATCH);
    }
    d->ex = ampc_tensor_own(ampc_tensor_randn(AMPC_F32, 2, (int64_t[]){EVAL, IN}, 0, 1));
    d->ey = targets(d->ex, EVAL);
}

static void free_data(dataset *d) {
    for (int b = 0; b < N_DATA; b++) {
        ampc_tensor_free(d->x[b]);
        ampc_tensor_free(d->y[b]);
    }
    ampc_tensor_free(d->ex);
    ampc_tensor_free(d->ey);
}

/* MSE on the held-out batch, in fp32 without grad: it measures the weights, not the rounding
   of a mixed-precision forward. */
static double eval_loss(ampc_module *net, const dataset *d) {
    ampc_scope_begin();
    ampc_no_grad_enter();
    double l = ampc_tensor_item(ampc_mse_loss(ampc_module_forward(net, d->ex), d->ey, AMPC_REDUCTION_MEAN));
    ampc_no_grad_exit();
    ampc_scope_end();
    if (isnan(l)) fail_msg("eval: %s", ampc_last_error());
    return l;
}

typedef struct { double initial, final; int64_t skipped; } result;

static result train(const dataset *d, bool use_amp, ampc_dtype dt, bool use_scaler) {
    ampc_manual_seed(0);
    ampc_module *net = ampc_sequential(5, ampc_linear_new(IN, HIDDEN, true), ampc_relu_new(),
                                       ampc_linear_new(HIDDEN, HIDDEN, true), ampc_relu_new(),
                                       ampc_linear_new(HIDDEN, 1, true));
    ASSERT_NOT_NULL_MSG(net);
    ampc_optimizer *opt = ampc_sgd_new(net, &(ampc_sgd_options){.lr = LR, .momentum = MOMENTUM});
    ampc_scaler_options so = ampc_scaler_defaults();
    so.enabled = use_scaler;
    ampc_scaler *scaler = ampc_scaler_new(&so);
    ASSERT_NOT_NULL_MSG(opt && scaler);
    result r = {.initial = eval_loss(net, d)};
    for (int s = 0; s < STEPS; s++) {
        ampc_scope_begin();
        ampc_autocast_enter(dt, use_amp);
        ampc_tensor *loss = ampc_mse_loss(ampc_module_forward(net, d->x[s % N_DATA]), d->y[s % N_DATA], AMPC_REDUCTION_MEAN);
        ampc_autocast_exit();
        ASSERT_NOT_NULL_MSG(loss);
        ASSERT_OK(ampc_backward(ampc_scaler_scale(scaler, loss)));
        ASSERT_OK(ampc_scaler_step(scaler, opt));
        ASSERT_OK(ampc_scaler_update(scaler));
        ampc_optimizer_zero_grad(opt);
        ampc_scope_end();
    }
    r.final = eval_loss(net, d);
    r.skipped = ampc_scaler_steps_skipped(scaler);
    ampc_scaler_free(scaler);
    ampc_optimizer_free(opt);
    ampc_module_free(net);
    return r;
}

static void test_fp32_bf16_fp16_agree(void **state) {
    (void)state;
    dataset d;
    memset(&d, 0, sizeof d);
    make_data(&d);
    result fp32 = train(&d, false, AMPC_F16, false);
    result bf16 = train(&d, true, AMPC_BF16, false);
    result fp16 = train(&d, true, AMPC_F16, true);
    print_message("eval loss: initial %.6f; final fp32 %.6f, bf16 %.6f, fp16 %.6f (%lld skipped)\n", fp32.initial,
                  fp32.final, bf16.final, fp16.final, (long long)fp16.skipped);
    free_data(&d);
    /* Same initial weights and data: the initial loss is the same network's. */
    assert_true(bf16.initial == fp32.initial && fp16.initial == fp32.initial);
    /* Learning: fp32 brings the held-out loss from ~0.69 to ~1/150 of it in STEPS steps; every
       mode must reach below 1/FALL of its initial value. */
    const double FALL = 50;
    assert_true(fp32.final < fp32.initial / FALL);
    assert_true(bf16.final < bf16.initial / FALL);
    assert_true(fp16.final < fp16.initial / FALL);
    /* Agreement, relative to fp32's final loss: |L_amp - L_fp32| / L_fp32 <= 16 u, u the
       autocast dtype's unit roundoff (bf16 2^-8: 6.3%; fp16 2^-11: 0.78%). Derivation: a step
       under autocast computes its gradient from operands rounded once to the autocast dtype:
       the three forward matmuls round input and weight (6u relative), the backward matmuls
       round the incoming gradient (2u more; the rest is fp32 accumulation, ~2^-24 K), so each
       update differs from fp32's by <= ~8u relative. SGD at this lr is stable (the loss falls
       steadily), so these perturbations do not grow from step to step beyond their size, and
       the weights differ by ~8u relative; the MSE is quadratic in the residual, which doubles
       the relative difference of the loss: 16u. The loss is evaluated in fp32 on held-out data
       so the final forward's own rounding is not counted. Measured: ~2u in both modes. */
    assert_true(fabs(bf16.final - fp32.final) <= 16 * tu_eps(AMPC_BF16) * fp32.final);
    assert_true(fabs(fp16.final - fp32.final) <= 16 * tu_eps(AMPC_F16) * fp32.final);
    /* fp16 with the default scale 65536: these gradients never overflow, so no step is lost */
    assert_int_equal(fp16.skipped, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_fp32_bf16_fp16_agree)};
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
