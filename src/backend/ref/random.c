/*
 * random.c - REF kernels of the ops that draw random numbers: dropout, in f64, one element at a
 * time, the oracle of the CPU kernels (src/backend/cpu/random.c). The mask uses draw i of the rng
 * stream for element i, as the CPU kernel does, so both devices drop the same elements for the
 * same rng state.
 */
#include "backend/ref/ref.h"

// ---------------------------------------------------------------------------------------------
// Dropout

static int ref_dropout(const ampc_tensor *x, ampc_tensor *y, uint8_t *mask, double p, ampc_rng_state rng) {
    const double *xp = ampc__data(x);
    double *yp = ampc__data(y), scale = p < 1 ? 1 / (1 - p) : 0;
    for (int64_t i = 0; i < x->numel; i++) {
        mask[i] = !(ampc__rng_uniform(rng, (uint64_t)i) < p);
        yp[i] = xp[i] * (mask[i] ? scale : 0.0);
    }
    return AMPC_OK;
}

static int ref_dropout_backward(const ampc_tensor *gy, const uint8_t *mask, double p, ampc_tensor *gx) {
    const double *g = ampc__data(gy);
    double *o = ampc__data(gx), scale = p < 1 ? 1 / (1 - p) : 0;
    for (int64_t i = 0; i < gy->numel; i++) o[i] = g[i] * (mask[i] ? scale : 0.0);
    return AMPC_OK;
}
// ---------------------------------------------------------------------------------------------

void ampc__ref_register_random(ampc_backend *be) {
    be->dropout = ref_dropout;
    be->dropout_backward = ref_dropout_backward;
}
