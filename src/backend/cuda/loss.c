/*
 * loss.c - the CUDA table's softmax / log-softmax and fused cross-entropy: launches here (the
 * door checked the arguments), the kernels in loss.cu. Semantics are the CPU backend's (src/backend/cpu/loss.c).
 *
 * Cross-entropy's targets live on the GPU: the forward counts them and finds the first one
 * out of range on the device, then reads those three numbers back (one small copy and a
 * stream synchronisation, which the MEAN divisor *weight_out needs anyway) to report a bad
 * target as the CPU does. The backward runs on targets the forward has checked; a target
 * changed out of range in between gives NaN gradients for its row, never a stray read.
 */
#include "backend/cuda/cuda.h"
#include "backend/cuda/ew_kernels.h"

// ---------------------------------------------------------------------------------------------
// Softmax

static int cu_softmax(const ampc_tensor *x, ampc_tensor *y, ampc_axis_desc ax, bool is_log) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    if (x->numel == 0 || ax.dim == 0) return AMPC_OK;
    return ampc__cu_check(ampc_cu_softmax(ampc__data(x), x->dtype, ampc__data(y), y->dtype, ax.outer, ax.dim, ax.inner, is_log,
                                          ampc__cu_stream()),
                          is_log ? "log_softmax" : "softmax");
}

static int cu_softmax_backward(const ampc_tensor *y, const ampc_tensor *gy, ampc_tensor *gx, ampc_axis_desc ax, bool is_log) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    if (y->numel == 0 || ax.dim == 0) return AMPC_OK;
    return ampc__cu_check(ampc_cu_softmax_backward(ampc__data(y), y->dtype, ampc__data(gy), gy->dtype, ampc__data(gx), ax.outer,
                                                   ax.dim, ax.inner, is_log, ampc__cu_stream()),
                          is_log ? "log_softmax backward" : "softmax backward");
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

static int cu_cross_entropy(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_cross_entropy_options *o,
                            ampc_tensor *out, double *weight_out) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    int64_t N = logits->shape[0], C = logits->shape[1];
    bool none = o->reduction == AMPC_REDUCTION_NONE;
    /* scratch: info (3 i64) | the row losses (N f32) for MEAN/SUM */
    size_t block = 0;
    int64_t *info = ampc__cu_scratch(3 * sizeof(int64_t) + (none ? 0 : (size_t)N * sizeof(float)), &block);
    if (!info) return ampc_last_status();
    cudaStream_t s = ampc__cu_stream();
    int64_t h[3] = {0, -1, 0};
    rc = ampc__cu_check(ampc_cu_cross_entropy(ampc__data(logits), logits->dtype, ampc__data(targets), N, C, o->reduction,
                                              o->ignore_index, (float)o->label_smoothing, ampc__data(out), out->dtype,
                                              none ? NULL : (float *)(info + 3), info, s),
                        "cross_entropy");
    if (rc >= 0) rc = ampc__cu_check(cudaMemcpyAsync(h, info, sizeof h, cudaMemcpyDeviceToHost, s), "cross_entropy's count");
    if (rc >= 0) rc = ampc__cu_check(cudaStreamSynchronize(s), "cross_entropy (a kernel queued before it failed)");
    ampc__cu_scratch_free(info, block);
    if (rc < 0) return rc;
    if (h[1] >= 0)
        return ampc__err(AMPC_ERR_INVALID, "cross_entropy: target %lld in row %lld is out of range [0, %lld)", (long long)h[2],
                         (long long)h[1], (long long)C);
    if (weight_out) *weight_out = (double)h[0];
    return AMPC_OK;
}

static int cu_cross_entropy_backward(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_tensor *gy,
                                     const ampc_cross_entropy_options *o, double weight, ampc_tensor *gx) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    int64_t N = logits->shape[0], C = logits->shape[1];
    bool none = o->reduction == AMPC_REDUCTION_NONE;
    return ampc__cu_check(ampc_cu_cross_entropy_backward(ampc__data(logits), logits->dtype, ampc__data(targets), N, C,
                                                         ampc__data(gy), gy->dtype, none, weight, o->ignore_index,
                                                         (float)o->label_smoothing, ampc__data(gx), gx->dtype, ampc__cu_stream()),
                          "cross_entropy_backward");
}

void ampc__cuda_register_loss(ampc_backend *be) {
    be->softmax = cu_softmax;
    be->softmax_backward = cu_softmax_backward;
    be->cross_entropy = cu_cross_entropy;
    be->cross_entropy_backward = cu_cross_entropy_backward;
}
