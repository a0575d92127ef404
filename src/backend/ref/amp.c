/*
 * amp.c - REF kernels of the grad scaler and gradient clipping (f64, plain loops): the oracle
 * for the CPU ones. unscale_check flags non-finite values (before scaling) and multiplies by
 * inv_scale unless it is 1; sum_squares adds x^2 left to right.
 */
#include "backend/backend.h"

#include <math.h>

static int ref_unscale_check(ampc_tensor **grads, int n, float inv_scale, float *found_inf) {
    bool bad = false;
    for (int k = 0; k < n; k++) {
        if (!grads[k]) continue;
        double *x = ampc__data(grads[k]);
        for (int64_t i = 0; i < grads[k]->numel; i++) {
            if (!isfinite(x[i])) bad = true;
            if (inv_scale != 1.0f) x[i] *= (double)inv_scale;
        }
    }
    if (bad) *found_inf = 1.0f;
    return AMPC_OK;
}

static int ref_sum_squares(const ampc_tensor *t, double *out) {
    const double *x = ampc__data(t);
    double s = 0;
    for (int64_t i = 0; i < t->numel; i++) s += x[i] * x[i];
    *out = s;
    return AMPC_OK;
}

void ampc__ref_register_amp(ampc_backend *be) {
    be->unscale_check = ref_unscale_check;
    be->sum_squares = ref_sum_squares;
}
