/*
 * loss.c - the CUDA table's softmax / log-softmax, fused cross-entropy and layer norm:
 * argument checks here, the kernels in loss.cu. Semantics are the CPU backend's
 * (src/backend/cpu/loss.c, norm.c).
 *
 * Cross-entropy's targets live on the GPU: the forward counts them and finds the first one
 * out of range on the device, then reads those three numbers back (one small copy and a
 * stream synchronisation, which the MEAN divisor *weight_out needs anyway) to report a bad
 * target as the CPU does. The backward runs on targets the forward has checked; a target
 * changed out of range in between gives NaN gradients for its row, never a stray read.
 */
#include "backend/cuda/cuda.h"
#include "backend/cuda/ew_kernels.h"

static int check_float(const ampc_tensor *t, const char *kernel, const char *what) {
    int rc = ampc__cu_on_device(t, kernel);
    if (rc < 0) return rc;
    if (t->dtype != AMPC_F32 && t->dtype != AMPC_F16 && t->dtype != AMPC_BF16)
        return ampc__err(AMPC_ERR_DTYPE, "%s: %s is %s, not f32/f16/bf16", kernel, what, ampc_dtype_name(t->dtype));
    return AMPC_OK;
}

/* x viewed as (outer, dim, inner) with numel elements */
static int check_axis(const ampc_tensor *t, ampc_axis_desc ax, const char *kernel) {
    if (ax.outer < 0 || ax.dim < 0 || ax.inner < 0 || ax.outer * ax.dim * ax.inner != t->numel)
        return ampc__err(AMPC_ERR_SHAPE, "cuda %s: axis (%lld, %lld, %lld) does not cover %lld elements", kernel,
                         (long long)ax.outer, (long long)ax.dim, (long long)ax.inner, (long long)t->numel);
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Softmax

static int cu_softmax(const ampc_tensor *x, ampc_tensor *y, ampc_axis_desc ax, bool is_log) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    if ((rc = check_float(x, "softmax", "x")) < 0 || (rc = check_float(y, "softmax", "y")) < 0) return rc;
    if (y->numel != x->numel) return ampc__err(AMPC_ERR_SHAPE, "cuda softmax: x and y sizes differ");
    if (x->numel == 0 || ax.dim == 0) return AMPC_OK;
    if ((rc = check_axis(x, ax, "softmax")) < 0) return rc;
    return ampc__cu_check(ampc_cu_softmax(ampc__data(x), x->dtype, ampc__data(y), y->dtype, ax.outer, ax.dim, ax.inner, is_log,
                                          ampc__cu_stream()),
                          is_log ? "log_softmax" : "softmax");
}

static int cu_softmax_backward(const ampc_tensor *y, const ampc_tensor *gy, ampc_tensor *gx, ampc_axis_desc ax, bool is_log) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    if ((rc = check_float(y, "softmax_backward", "y")) < 0 || (rc = check_float(gy, "softmax_backward", "gy")) < 0 ||
        (rc = check_float(gx, "softmax_backward", "gx")) < 0)
        return rc;
    if (gy->numel != y->numel || gx->numel != y->numel) return ampc__err(AMPC_ERR_SHAPE, "cuda softmax_backward: sizes differ");
    if (gx->dtype != y->dtype)
        return ampc__err(AMPC_ERR_DTYPE, "cuda softmax_backward: gx is %s but y %s (gx takes y's dtype)",
                         ampc_dtype_name(gx->dtype), ampc_dtype_name(y->dtype));
    if (y->numel == 0 || ax.dim == 0) return AMPC_OK;
    if ((rc = check_axis(y, ax, "softmax_backward")) < 0) return rc;
    return ampc__cu_check(ampc_cu_softmax_backward(ampc__data(y), y->dtype, ampc__data(gy), gy->dtype, ampc__data(gx), ax.outer,
                                                   ax.dim, ax.inner, is_log, ampc__cu_stream()),
                          is_log ? "log_softmax backward" : "softmax backward");
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

/* shapes and dtypes (the targets' values are checked on the device) */
static int ce_check(const ampc_tensor *logits, const ampc_tensor *targets, const char *kernel) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    if ((rc = check_float(logits, kernel, "logits")) < 0 || (rc = ampc__cu_on_device(targets, kernel)) < 0) return rc;
    if (targets->dtype != AMPC_I64)
        return ampc__err(AMPC_ERR_DTYPE, "cross_entropy: targets are %s, not i64", ampc_dtype_name(targets->dtype));
    if (logits->ndim != 2 || targets->ndim != 1 || targets->shape[0] != logits->shape[0])
        return ampc__err(AMPC_ERR_SHAPE, "cross_entropy: logits must be (N, C) and targets (N)");
    return AMPC_OK;
}

static int cu_cross_entropy(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_cross_entropy_options *o,
                            ampc_tensor *out, double *weight_out) {
    int rc;
    if ((rc = ce_check(logits, targets, "cross_entropy")) < 0 || (rc = check_float(out, "cross_entropy", "out")) < 0)
        return rc;
    int64_t N = logits->shape[0], C = logits->shape[1];
    bool none = o->reduction == AMPC_REDUCTION_NONE;
    if (out->numel != (none ? N : 1))
        return ampc__err(AMPC_ERR_SHAPE, "cross_entropy: output of %lld elements", (long long)out->numel);
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
    if ((rc = ce_check(logits, targets, "cross_entropy_backward")) < 0 ||
        (rc = check_float(gy, "cross_entropy_backward", "gy")) < 0 || (rc = check_float(gx, "cross_entropy_backward", "gx")) < 0)
        return rc;
    int64_t N = logits->shape[0], C = logits->shape[1];
    bool none = o->reduction == AMPC_REDUCTION_NONE;
    if (gy->numel != (none ? N : 1) || gx->numel != logits->numel)
        return ampc__err(AMPC_ERR_SHAPE, "cross_entropy_backward: gy of %lld or gx of %lld elements", (long long)gy->numel,
                         (long long)gx->numel);
    return ampc__cu_check(ampc_cu_cross_entropy_backward(ampc__data(logits), logits->dtype, ampc__data(targets), N, C,
                                                         ampc__data(gy), gy->dtype, none, weight, o->ignore_index,
                                                         (float)o->label_smoothing, ampc__data(gx), gx->dtype, ampc__cu_stream()),
                          "cross_entropy_backward");
}

// ---------------------------------------------------------------------------------------------
// Layer norm

/* t (NULL allowed) has n elements and is f32 (stat) or any float dtype, on the GPU */
static int ln_check(const ampc_tensor *t, int64_t n, bool stat, const char *k, const char *what) {
    if (!t) return AMPC_OK;
    int rc = check_float(t, k, what);
    if (rc < 0) return rc;
    if (stat && t->dtype != AMPC_F32)
        return ampc__err(AMPC_ERR_DTYPE, "cuda %s: %s is %s, expected f32", k, what, ampc_dtype_name(t->dtype));
    if (t->numel != n)
        return ampc__err(AMPC_ERR_SHAPE, "cuda %s: %s has %lld elements, expected %lld", k, what, (long long)t->numel, (long long)n);
    return AMPC_OK;
}


/* Parameters as f32 for the kernels: an f32 tensor's own data, else converted into dst. */
static const float *ln_param(const ampc_tensor *t, float *dst, cudaStream_t s, int *rc) {
    if (!t || t->dtype == AMPC_F32) return t ? ampc__data(t) : NULL;
    *rc = ampc__cu_check(ampc_cu_convert(ampc__data(t), t->dtype, dst, AMPC_F32, t->numel, s), "layer_norm parameter");
    return dst;
}

static int cu_layer_norm(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias, ampc_tensor *y,
                         ampc_tensor *mean, ampc_tensor *rstd, double eps) {
    const char *k = "layer_norm";
    int64_t rows = 0, cols = 0;
    int rc;
    if ((rc = ampc__cu_ready()) < 0 || (rc = ampc__layer_norm_dims(x, mean, "cuda ", k, &rows, &cols)) < 0) return rc;
    if ((rc = ln_check(x, x->numel, false, k, "x")) < 0 || (rc = ln_check(y, x->numel, false, k, "y")) < 0 ||
        (rc = ln_check(weight, cols, false, k, "weight")) < 0 || (rc = ln_check(bias, cols, false, k, "bias")) < 0 ||
        (rc = ln_check(mean, rows, true, k, "mean")) < 0 || (rc = ln_check(rstd, rows, true, k, "rstd")) < 0)
        return rc;
    if (x->numel == 0) return AMPC_OK;
    cudaStream_t s = ampc__cu_stream();
    size_t block = 0;
    float *pbuf = NULL;
    if (((weight && weight->dtype != AMPC_F32) || (bias && bias->dtype != AMPC_F32)) &&
        !(pbuf = ampc__cu_scratch(2 * (size_t)cols * sizeof(float), &block)))
        return ampc_last_status();
    const float *w = ln_param(weight, pbuf, s, &rc), *b = rc < 0 ? NULL : ln_param(bias, pbuf ? pbuf + cols : NULL, s, &rc);
    if (rc >= 0)
        rc = ampc__cu_check(ampc_cu_layer_norm(ampc__data(x), x->dtype, w, b, ampc__data(y), y->dtype, ampc__data(mean),
                                               rstd ? ampc__data(rstd) : NULL, rows, cols, eps, s),
                            k);
    ampc__cu_scratch_free(pbuf, block);
    return rc;
}

static int cu_layer_norm_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                  const ampc_tensor *mean, const ampc_tensor *rstd, ampc_tensor *gx, ampc_tensor *gw,
                                  ampc_tensor *gb) {
    const char *k = "layer_norm_backward";
    int64_t rows = 0, cols = 0, n = x->numel;
    int rc;
    if ((rc = ampc__cu_ready()) < 0 || (rc = ampc__layer_norm_dims(x, mean, "cuda ", k, &rows, &cols)) < 0) return rc;
    if ((rc = ln_check(x, n, false, k, "x")) < 0 || (rc = ln_check(gy, n, false, k, "gy")) < 0 ||
        (rc = ln_check(gx, n, false, k, "gx")) < 0 || (rc = ln_check(weight, cols, false, k, "weight")) < 0 ||
        (rc = ln_check(mean, rows, true, k, "mean")) < 0 || (rc = ln_check(rstd, rows, true, k, "rstd")) < 0 ||
        (rc = ln_check(gw, cols, false, k, "gw")) < 0 || (rc = ln_check(gb, cols, false, k, "gb")) < 0)
        return rc;
    if (!rstd) return ampc__err(AMPC_ERR_INVALID, "cuda %s: rstd missing", k);
    if (gy->dtype != x->dtype || (gx && gx->dtype != x->dtype))
        return ampc__err(AMPC_ERR_DTYPE, "cuda %s: x, gy and gx must share a dtype (x is %s)", k, ampc_dtype_name(x->dtype));
    if (cols == 0) return AMPC_OK;
    cudaStream_t s = ampc__cu_stream();
    int64_t splits = ampc_cu_layer_norm_splits(rows, cols, ampc__cu_sm_count());
    bool wconv = weight && weight->dtype != AMPC_F32, sums = gw || gb;
    /* scratch: the weight as f32 (cols) | the column sums' slices (splits * 2 * cols) */
    size_t nw = wconv ? (size_t)cols : 0, np = sums ? (size_t)(splits * 2 * cols) : 0, block = 0;
    float *ws = NULL;
    if ((nw || np) && !(ws = ampc__cu_scratch((nw + np) * sizeof(float), &block))) return ampc_last_status();
    const float *w = ln_param(weight, ws, s, &rc);
    if (rc >= 0)
        rc = ampc__cu_check(ampc_cu_layer_norm_backward(ampc__data(x), ampc__data(gy), x->dtype, w, ampc__data(mean), ampc__data(rstd),
                                                        gx ? ampc__data(gx) : NULL, gw ? ampc__data(gw) : NULL,
                                                        gw ? gw->dtype : AMPC_F32, gb ? ampc__data(gb) : NULL,
                                                        gb ? gb->dtype : AMPC_F32, rows, cols, splits, ws ? ws + nw : NULL, s),
                            k);
    ampc__cu_scratch_free(ws, block);
    return rc;
}

void ampc__cuda_register_loss(ampc_backend *be) {
    be->softmax = cu_softmax;
    be->softmax_backward = cu_softmax_backward;
    be->cross_entropy = cu_cross_entropy;
    be->cross_entropy_backward = cu_cross_entropy_backward;
    be->layer_norm = cu_layer_norm;
    be->layer_norm_backward = cu_layer_norm_backward;
}
