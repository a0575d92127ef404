/*
 * linear_walkthrough.c - one training step of a 1x1 Linear layer, stage by stage, in fp32 and
 * then with fp16 autocast and a GradScaler (init_scale 4096), printing every parameter and its
 * gradient after each stage: forward, backward, unscale, step, zero_grad.
 *
 * What to look for: under autocast the output is fp16 while the weights and their gradients
 * stay fp32; after backward the gradients are the fp32 ones times 4096; unscale divides them
 * back (up to fp16 rounding of the forward and backward), so the step matches fp32's; and
 * zero_grad sets the gradients to None. Exits non-zero on any library error.
 */
#include "ampc.h"

#include <stdio.h>

static int fail(const char *what) {
    fprintf(stderr, "linear_walkthrough: %s failed: %s\n", what, ampc_last_error());
    return 1;
}

static void print_params(const char *stage, ampc_module *m) {
    ampc_tensor **p;
    const char **names;
    int n = ampc_module_parameters(m, &p, &names);
    for (int i = 0; i < n; i++) {
        ampc_tensor *g = ampc_tensor_grad(p[i]);
        printf("  %-10s %-7s = %-12.8g grad = ", i == 0 ? stage : "", names[i], ampc_tensor_item(p[i]));
        if (g) printf("%.8g\n", ampc_tensor_item(g));
        else printf("None\n");
    }
}

static int one_step(bool use_amp) {
    ampc_manual_seed(0);   /* the same initial weight and bias for both runs */
    ampc_module *lin = ampc_linear_new(1, 1, true);
    ampc_optimizer *opt = ampc_sgd_new(lin, &(ampc_sgd_options){.lr = 1.0});
    ampc_scaler_options so = ampc_scaler_defaults();
    so.init_scale = 4096;
    so.enabled = use_amp;   /* disabled: scale/unscale are no-ops, step is opt.step() */
    ampc_scaler *scaler = ampc_scaler_new(&so);
    if (!lin || !opt || !scaler) return fail("setup");
    printf("%s\n", use_amp ? "fp16 autocast + GradScaler(init_scale=4096), SGD lr 1:" : "fp32, SGD lr 1:");
    print_params("initial", lin);

    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_full(AMPC_F32, 2, (int64_t[]){1, 1}, 1.5);
    ampc_tensor *y = ampc_tensor_full(AMPC_F32, 2, (int64_t[]){1, 1}, 0.5);
    ampc_autocast_enter(AMPC_F16, use_amp);
    ampc_tensor *out = ampc_module_forward(lin, x);
    ampc_tensor *loss = ampc_mse_loss(out, y, AMPC_REDUCTION_MEAN);
    ampc_autocast_exit();
    if (!loss) return fail("forward");
    ampc_tensor *scaled = ampc_scaler_scale(scaler, loss);
    if (!scaled) return fail("scale");
    printf("  %-10s x = 1.5, target = 0.5: output = %.8g (%s), loss = %.8g (%s), scaled loss = %.8g\n", "forward",
           ampc_tensor_item(out), ampc_dtype_name(ampc_tensor_dtype(out)), ampc_tensor_item(loss),
           ampc_dtype_name(ampc_tensor_dtype(loss)), ampc_tensor_item(scaled));
    print_params("", lin);
    if (ampc_backward(scaled) < 0) return fail("backward");
    print_params("backward", lin);
    if (ampc_scaler_unscale(scaler, opt) < 0) return fail("unscale");
    print_params("unscale", lin);
    int applied = ampc_scaler_step(scaler, opt);
    if (applied < 0) return fail("step");
    print_params(applied ? "step" : "step (skipped)", lin);
    if (ampc_scaler_update(scaler) < 0) return fail("update");
    ampc_optimizer_zero_grad(opt);
    print_params("zero_grad", lin);
    printf("  %-10s scale %g, growth tracker %d\n\n", "update", (double)ampc_scaler_get_scale(scaler),
           ampc_scaler_growth_tracker(scaler));
    ampc_scope_end();

    ampc_scaler_free(scaler);
    ampc_optimizer_free(opt);
    ampc_module_free(lin);
    return 0;
}

int main(void) {
    if (ampc_init() < 0) return fail("init");
    if (one_step(false) || one_step(true)) return 1;
    ampc_shutdown();
    return 0;
}
