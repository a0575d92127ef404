/*
 * mlp_amp.c - PyTorch's "Automatic Mixed Precision" recipe in C: an 8 -> 16 -> 16 -> 1 MLP
 * (ReLU) fitted with MSE on 50 random batches of 512, trained once in fp32 and once with
 * autocast + GradScaler from the same initial weights, each run timed.
 *
 *     ./mlp_amp                 fp16 autocast (the default)
 *     ./mlp_amp --dtype bf16    bf16 autocast
 *     ./mlp_amp --batches 200   more batches (the data repeat after 50)
 *
 * The training step is the recipe's loop:
 *     with autocast(dtype, enabled=use_amp): out = net(x); loss = mse(out, y)
 *     scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad()
 * with SGD lr 0.001 and no momentum, as in the recipe. Exits non-zero on any library error.
 */
#include "ampc.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { IN = 8, HIDDEN = 16, BATCH = 512, N_DATA = 50 };

static int fail(const char *what) {
    fprintf(stderr, "mlp_amp: %s failed: %s\n", what, ampc_last_error());
    return 1;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// ---------------------------------------------------------------------------------------------
// Data: x ~ N(0, 1); the target is a fixed random function of x, y = tanh(2 a.x) + 0.5 b.x,
// so a small MLP can fit it and the loss can fall.

typedef struct { ampc_tensor *x[N_DATA], *y[N_DATA]; } dataset;

static int make_data(dataset *d) {
    ampc_manual_seed(1);
    ampc_tensor *ab = ampc_tensor_rand(AMPC_F32, 1, (int64_t[]){2 * IN}, -0.5, 0.5);
    float coef[2 * IN];
    if (!ab || ampc_tensor_to_f32(ab, coef, 2 * IN) < 0) return -1;
    for (int b = 0; b < N_DATA; b++) {
        d->x[b] = ampc_tensor_own(ampc_tensor_randn(AMPC_F32, 2, (int64_t[]){BATCH, IN}, 0, 1));
        float xs[BATCH * IN], ys[BATCH];
        if (!d->x[b] || ampc_tensor_to_f32(d->x[b], xs, BATCH * IN) < 0) return -1;
        for (int i = 0; i < BATCH; i++) {
            double ax = 0, bx = 0;
            for (int k = 0; k < IN; k++) {
                ax += coef[k] * xs[i * IN + k];
                bx += coef[IN + k] * xs[i * IN + k];
            }
            ys[i] = (float)(tanh(2 * ax) + 0.5 * bx);
        }
        d->y[b] = ampc_tensor_own(ampc_tensor_from_f32(AMPC_F32, 2, (int64_t[]){BATCH, 1}, ys));
        if (!d->y[b]) return -1;
    }
    ampc_tensor_free(ab);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// One training run

typedef struct {
    double first_loss, final_loss, seconds;
    float scale;
    int64_t skipped;
} run_result;

static int train(const dataset *d, int batches, bool use_amp, ampc_dtype dtype, run_result *r, bool verbose) {
    ampc_manual_seed(0);   /* the same initial weights for every run */
    ampc_module *net = ampc_sequential(5, ampc_linear_new(IN, HIDDEN, true), ampc_relu_new(),
                                       ampc_linear_new(HIDDEN, HIDDEN, true), ampc_relu_new(),
                                       ampc_linear_new(HIDDEN, 1, true));
    if (!net) return fail("building the network");
    ampc_optimizer *opt = ampc_sgd_new(net, &(ampc_sgd_options){.lr = 0.001});
    ampc_scaler_options so = ampc_scaler_defaults();
    so.enabled = use_amp;
    ampc_scaler *scaler = ampc_scaler_new(&so);
    if (!opt || !scaler) return fail("creating the optimizer and scaler");

    const char *mode = use_amp ? (dtype == AMPC_BF16 ? "bf16 autocast" : "fp16 autocast") : "fp32";
    double t0 = now();
    for (int b = 0; b < batches; b++) {
        ampc_scope_begin();   /* this step's tensors are released at its end */
        ampc_autocast_enter(dtype, use_amp);
        ampc_tensor *out = ampc_module_forward(net, d->x[b % N_DATA]);
        ampc_tensor *loss = ampc_mse_loss(out, d->y[b % N_DATA], AMPC_REDUCTION_MEAN);
        ampc_autocast_exit();
        if (!loss) return fail("forward");
        if (ampc_backward(ampc_scaler_scale(scaler, loss)) < 0) return fail("backward");
        if (ampc_scaler_step(scaler, opt) < 0) return fail("scaler step");
        if (ampc_scaler_update(scaler) < 0) return fail("scaler update");
        ampc_optimizer_zero_grad(opt);
        double l = ampc_tensor_item(loss);
        if (b == 0) r->first_loss = l;
        r->final_loss = l;
        if (verbose && (b % 10 == 0 || b == batches - 1))
            printf("  %-13s batch %3d  loss %.6f  (scale %g)\n", mode, b, l, (double)ampc_scaler_get_scale(scaler));
        ampc_scope_end();
    }
    r->seconds = now() - t0;
    r->scale = ampc_scaler_get_scale(scaler);
    r->skipped = ampc_scaler_steps_skipped(scaler);
    ampc_scaler_free(scaler);
    ampc_optimizer_free(opt);
    ampc_module_free(net);
    return 0;
}

int main(int argc, char **argv) {
    ampc_dtype dtype = AMPC_F16;
    int batches = N_DATA;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--dtype") && i + 1 < argc) {
            const char *v = argv[++i];
            if (!strcmp(v, "bf16")) dtype = AMPC_BF16;
            else if (!strcmp(v, "fp16") || !strcmp(v, "f16")) dtype = AMPC_F16;
            else {
                fprintf(stderr, "mlp_amp: --dtype takes fp16 or bf16, not %s\n", v);
                return 2;
            }
        } else if (!strcmp(argv[i], "--batches") && i + 1 < argc) {
            batches = atoi(argv[++i]);
            if (batches < 1) batches = 1;
        } else {
            fprintf(stderr, "usage: %s [--dtype fp16|bf16] [--batches N]\n", argv[0]);
            return 2;
        }
    }
    if (ampc_init() < 0) return fail("init");
    printf("ampc mlp_amp: %d-%d-%d-1 MLP, %d batches of %d, SGD lr 0.001; cpu: %s, %d threads\n", IN, HIDDEN, HIDDEN,
           batches, BATCH, ampc_cpu_features(), ampc_get_num_threads());
    dataset d;
    memset(&d, 0, sizeof d);
    if (make_data(&d) < 0) return fail("making the data");

    /* Untimed warm-up of both modes: oneDNN builds its kernels at first use. */
    run_result fp32 = {0}, amp = {0};
    if (train(&d, 2, false, dtype, &fp32, false) || train(&d, 2, true, dtype, &amp, false)) return 1;
    if (train(&d, batches, false, dtype, &fp32, true)) return 1;
    if (train(&d, batches, true, dtype, &amp, true)) return 1;

    const char *name = dtype == AMPC_BF16 ? "bf16" : "fp16";
    printf("fp32:          loss %.6f -> %.6f  in %.3f s\n", fp32.first_loss, fp32.final_loss, fp32.seconds);
    printf("%s autocast: loss %.6f -> %.6f  in %.3f s  (scaler: final scale %g, %lld skipped steps)\n", name,
           amp.first_loss, amp.final_loss, amp.seconds, (double)amp.scale, (long long)amp.skipped);
    printf("final loss difference amp - fp32: %.3g (relative %.3g)\n", amp.final_loss - fp32.final_loss,
           fabs(amp.final_loss - fp32.final_loss) / fp32.final_loss);
    if (amp.seconds > 1.5 * fp32.seconds)   /* say why, rather than leave a newcomer to guess */
        printf("note: %s autocast took %.1fx the fp32 time here: this CPU (%s) has no %s arithmetic, so the 16-bit\n"
               "      ops compute in f32 and round to %s on top; the memory saving stays. AMP pays off in speed on\n"
               "      CPUs with %s (and on GPUs); try --dtype %s.\n",
               name, amp.seconds / fp32.seconds, ampc_cpu_features(), name, name,
               dtype == AMPC_BF16 ? "AVX512-BF16 or AMX" : "AVX512-FP16", dtype == AMPC_BF16 ? "fp16" : "bf16");
    for (int b = 0; b < N_DATA; b++) {
        ampc_tensor_free(d.x[b]);
        ampc_tensor_free(d.y[b]);
    }
    ampc_shutdown();
    return 0;
}
