/*
 * random.c - the CUDA table's ops that draw random numbers: dropout (argument checks here, the
 * kernels in random.cu). Semantics are the CPU backend's (src/backend/cpu/random.c).
 */
#include "backend/cuda/cuda.h"
#include "backend/cuda/ew_kernels.h"

#include <math.h>

// ---------------------------------------------------------------------------------------------
// Dropout: the mask (numel bytes of device memory) from the Philox stream of the CPU and REF
// kernels, so every device drops the same elements for the same rng state.


static int cu_dropout(const ampc_tensor *x, ampc_tensor *y, uint8_t *mask, double p, ampc_rng_state rng) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    uint32_t thr = ampc__dropout_threshold(p);
    return ampc__cu_check(ampc_cu_dropout(ampc__data(x), x->dtype, ampc__data(y), y->dtype, mask, x->numel, rng.seed, rng.offset,
                                          thr, ampc__dropout_scale(p), ampc__cu_stream()),
                          "dropout");
}

static int cu_dropout_backward(const ampc_tensor *gy, const uint8_t *mask, double p, ampc_tensor *gx) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    return ampc__cu_check(ampc_cu_dropout_backward(ampc__data(gy), gy->dtype, mask, ampc__data(gx), gx->dtype, gy->numel,
                                                   ampc__dropout_scale(p), ampc__cu_stream()),
                          "dropout_backward");
}

// ---------------------------------------------------------------------------------------------

void ampc__cuda_register_random(ampc_backend *be) {
    be->dropout = cu_dropout;
    be->dropout_backward = cu_dropout_backward;
}
