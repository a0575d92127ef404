/*
 * test_train.c - end to end: the MLP of examples/mlp_amp.c (8 -> 16 -> 16 -> 1, ReLU, MSE,
 * targets y = tanh(2 a.x) + 0.5 b.x of x ~ N(0, 1)) trained from the same initial weights in
 * fp32, under bf16 autocast, and under fp16 autocast with a GradScaler. Each run must learn
 * (the loss falls by a stated factor) and the mixed-precision runs must end where fp32 ends.
 */
#include "testutil.h"

#include "ampc/io.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

// ---------------------------------------------------------------------------------------------
// Transfer learning: a pretrained ResNet-18, the backbone frozen, a new head

enum { FT_CLASSES = 4, FT_BATCH = 32, FT_SIDE = 8, FT_STEPS = 12 };

/* The tutorial's workflow in fp32, bf16 autocast and fp16 autocast with the GradScaler: a
   ResNet-18 saved with a 10-class head (the "pretrained" file) is loaded non-strictly into a
   4-class one (only fc.weight/fc.bias mismatch and stay new), everything but fc is frozen, and
   Adam trains the head on a fixed batch. Checked: the backbone's parameters are bit for bit the
   file's, their gradients were never made (backward stops at the head), 2,052 parameters are
   trainable, BatchNorm's running statistics still move in training mode (PyTorch's behaviour
   with requires_grad off), the head changes, and the loss falls below half its first value. */
static void test_finetune_frozen_resnet(void **state) {
    (void)state;
    char path[] = "/tmp/ampc_test_finetune_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    ampc_model_options mo = {.num_classes = 10, .in_channels = 3, .small_input = true};
    ampc_manual_seed(11);
    ampc_module *pre = ampc_model_new("resnet18", &mo);
    ASSERT_NOT_NULL_MSG(pre);
    ASSERT_OK(ampc_checkpoint_save(path, pre, NULL, NULL, NULL));
    ampc_tensor **pt;
    const char **pn;
    const int npre = ampc_module_state_dict(pre, &pt, &pn);
    assert_true(npre > 100);

    /* a class-dependent pattern plus noise */
    ampc_manual_seed(5);
    ampc_tensor *protos = ampc_tensor_own(ampc_tensor_randn(AMPC_F32, 2, (int64_t[]){FT_CLASSES, 3 * FT_SIDE * FT_SIDE}, 0, 1));
    ampc_tensor *noise = ampc_tensor_own(ampc_tensor_randn(AMPC_F32, 2, (int64_t[]){FT_BATCH, 3 * FT_SIDE * FT_SIDE}, 0, 0.5));
    const int64_t per = 3 * FT_SIDE * FT_SIDE;
    float *xs = malloc((size_t)(FT_BATCH * per) * sizeof *xs), *pr = malloc((size_t)(FT_CLASSES * per) * sizeof *pr);
    int64_t ys[FT_BATCH];
    ASSERT_OK(ampc_tensor_to_f32(noise, xs, (size_t)(FT_BATCH * per)));
    ASSERT_OK(ampc_tensor_to_f32(protos, pr, (size_t)(FT_CLASSES * per)));
    for (int i = 0; i < FT_BATCH; i++) {
        ys[i] = i % FT_CLASSES;
        for (int64_t k = 0; k < per; k++) xs[i * per + k] += pr[ys[i] * per + k];
    }
    ampc_tensor *x = ampc_tensor_own(ampc_tensor_from_f32(AMPC_F32, 4, (int64_t[]){FT_BATCH, 3, FT_SIDE, FT_SIDE}, xs));
    ampc_tensor *y = ampc_tensor_own(ampc_tensor_from_i64(1, (int64_t[]){FT_BATCH}, ys));
    ASSERT_NOT_NULL_MSG(x && y);

    const struct { const char *name; bool amp; ampc_dtype dt; bool scaler; } modes[3] = {
        {"fp32", false, AMPC_F32, false}, {"bf16", true, AMPC_BF16, false}, {"fp16", true, AMPC_F16, true}};
    for (int m = 0; m < 3; m++) {
        mo.num_classes = FT_CLASSES;
        ampc_manual_seed(100 + (uint64_t)m);
        ampc_module *net = ampc_model_new("resnet18", &mo);
        ASSERT_NOT_NULL_MSG(net);
        ampc_load_report rep;
        ASSERT_OK(ampc_load_state_dict(path, net, false, NULL, &rep));
        assert_int_equal(rep.mismatched, 2);
        assert_int_equal(rep.missing, 0);
        assert_int_equal(rep.unexpected, 0);
        assert_int_equal(rep.loaded, npre - 2);
        ampc_module_requires_grad(net, false);
        ampc_module_requires_grad(ampc_module_find(net, "fc"), true);
        assert_int_equal(ampc_module_num_parameters(net, true), 512 * FT_CLASSES + FT_CLASSES);
        ampc_adam_options ao = ampc_adam_defaults();
        ao.lr = 1e-2;
        ampc_optimizer *opt = ampc_adam_new(net, &ao);
        ampc_scaler_options so = ampc_scaler_defaults();
        so.enabled = modes[m].scaler;
        ampc_scaler *sc = ampc_scaler_new(&so);
        ASSERT_NOT_NULL_MSG(opt && sc);
        float fc0[512 * FT_CLASSES];
        ampc_tensor **nt;
        const char **nn;
        const int n = ampc_module_state_dict(net, &nt, &nn);
        assert_int_equal(n, npre);
        int fcw = -1;
        for (int i = 0; i < n; i++)
            if (!strcmp(nn[i], "fc.weight")) fcw = i;
        assert_true(fcw >= 0);
        ASSERT_OK(ampc_tensor_to_f32(nt[fcw], fc0, 512 * FT_CLASSES));

        ampc_module_train(net, true);
        double first = 0, last = 0;
        for (int s = 0; s < FT_STEPS; s++) {
            ampc_scope_begin();
            ampc_autocast_enter(modes[m].dt, modes[m].amp);
            ampc_tensor *loss = ampc_cross_entropy(ampc_module_forward(net, x), y, NULL);
            ampc_autocast_exit();
            ASSERT_NOT_NULL_MSG(loss);
            const double l = ampc_tensor_item(loss);
            if (s == 0) first = l;
            last = l;
            ASSERT_OK(ampc_backward(ampc_scaler_scale(sc, loss)));
            if (s == FT_STEPS - 1)   /* backward made no gradient for the frozen backbone */
                for (int i = 0; i < n; i++)
                    if (strncmp(nn[i], "fc.", 3) != 0 && ampc_tensor_grad(nt[i]))
                        fail_msg("%s: frozen %s has a gradient", modes[m].name, nn[i]);
            ASSERT_OK(ampc_scaler_step(sc, opt));
            ASSERT_OK(ampc_scaler_update(sc));
            ampc_optimizer_zero_grad(opt);
            ampc_scope_end();
        }
        print_message("%s: fine-tuning loss %.4f -> %.4f, %lld skipped\n", modes[m].name, first, last,
                      (long long)ampc_scaler_steps_skipped(sc));
        assert_true(last < 0.5 * first);

        /* the backbone is the file's, bit for bit; the running statistics moved; the head changed */
        int moved_stats = 0;
        for (int i = 0; i < n; i++) {
            if (!strncmp(nn[i], "fc.", 3)) continue;
            int64_t cnt = ampc_tensor_numel(nt[i]);
            if (ampc_tensor_dtype(nt[i]) != AMPC_F32) continue;   /* num_batches_tracked */
            float *a = malloc((size_t)cnt * sizeof *a), *b = malloc((size_t)cnt * sizeof *b);
            ASSERT_OK(ampc_tensor_to_f32(nt[i], a, (size_t)cnt));
            ASSERT_OK(ampc_tensor_to_f32(pt[i], b, (size_t)cnt));
            bool same = memcmp(a, b, (size_t)cnt * sizeof *a) == 0;
            bool stat = strstr(nn[i], "running_") != NULL;
            if (!stat && !same) fail_msg("%s: frozen %s changed", modes[m].name, nn[i]);
            moved_stats += stat && !same;
            free(a);
            free(b);
        }
        assert_true(moved_stats > 0);
        float fc1[512 * FT_CLASSES];
        ASSERT_OK(ampc_tensor_to_f32(nt[fcw], fc1, 512 * FT_CLASSES));
        assert_memory_not_equal(fc0, fc1, sizeof fc0);
        ampc_scaler_free(sc);
        ampc_optimizer_free(opt);
        ampc_module_free(net);
    }
    free(xs);
    free(pr);
    ampc_tensor_free(x);
    ampc_tensor_free(y);
    ampc_tensor_free(protos);
    ampc_tensor_free(noise);
    ampc_module_free(pre);
    unlink(path);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_fp32_bf16_fp16_agree), cmocka_unit_test(test_finetune_frozen_resnet)};
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
