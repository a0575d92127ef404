/*
 * layer_norm.c - the CUDA table's layer norm (own kernels, layer_norm.cu): launches here (the door
 * checked the arguments), the kernels there. Semantics are the CPU backend's (src/backend/cpu/layer_norm.c).
 */
#include "backend/cuda/cuda.h"
#include "backend/cuda/ew_kernels.h"

// ---------------------------------------------------------------------------------------------
// Layer norm


/* Parameters as f32 for the kernels: an f32 tensor's own data, else converted into dst. */
static const float *ln_param(const ampc_tensor *t, float *dst, cudaStream_t s, int *rc) {
    if (!t || t->dtype == AMPC_F32) return t ? ampc__data(t) : NULL;
    *rc = ampc__cu_check(ampc_cu_convert(ampc__data(t), t->dtype, dst, AMPC_F32, t->numel, s), "layer_norm parameter");
    return dst;
}

static int cu_layer_norm(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias, ampc_tensor *y,
                         ampc_tensor *mean, ampc_tensor *rstd, double eps) {
    const char *k = "layer_norm";
    int64_t rows, cols;
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    ampc__layer_norm_dims(x, mean, &rows, &cols);
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
    int64_t rows, cols;
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    ampc__layer_norm_dims(x, mean, &rows, &cols);
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

// ---------------------------------------------------------------------------------------------

void ampc__cuda_register_layer_norm(ampc_backend *be) {
    be->layer_norm = cu_layer_norm;
    be->layer_norm_backward = cu_layer_norm_backward;
}
