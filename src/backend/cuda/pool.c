/*
 * pool.c - the CUDA table's 2-D pooling (own kernels, pool.cu): the launches here, the kernels
 * there; the door (dispatch.c) checks the arguments.
 *
 * Why own kernels rather than cuDNN's pooling: they take every ampc_pool_desc (PyTorch's
 * include-pad divisor under ceil_mode, adaptive windows, NaN propagation and ties to the first
 * maximum, which cuDNN's pooling does not promise) and run on NHWC and NCHW alike.
 */
#include "backend/cuda/cuda.h"
#include "backend/cuda/pool_kernels.h"

// ---------------------------------------------------------------------------------------------
// Pooling

/* what the door does not check (dispatch.c: the rest): the argmax's 32 bits */
static int pool_check(const ampc_pool_desc *d, const char *what) {
    if (d->H * d->W > INT32_MAX)
        return ampc__err(AMPC_ERR_UNSUPPORTED, "cuda %s: planes of %lld x %lld elements: the argmax is 32-bit, at most 2^31 - 1 "
                         "per plane", what, (long long)d->H, (long long)d->W);
    return ampc__cu_ready();
}

static ampc_cu_pool_geom pool_geom(const ampc_pool_desc *d) {
    ampc_cu_pool_geom g = {
        .kind = d->kind == AMPC_POOL_MAX ? AMPC_CU_POOL_MAX
                : d->kind == AMPC_POOL_AVG_INCLUDE_PAD ? AMPC_CU_POOL_AVG_INCLUDE_PAD
                : d->kind == AMPC_POOL_AVG_EXCLUDE_PAD ? AMPC_CU_POOL_AVG_EXCLUDE_PAD
                                                        : AMPC_CU_POOL_ADAPTIVE_AVG,
        .N = d->N, .C = d->C, .H = d->H, .W = d->W, .OH = d->OH, .OW = d->OW, .cl = d->channels_last};
    for (int i = 0; i < 2; i++) {
        g.kernel[i] = d->kernel[i];
        g.stride[i] = d->stride[i];
        g.pad_begin[i] = d->pad_begin[i];
    }
    return g;
}

/* max pooling: the argmax, an int32 per output (its index in the (H, W) plane) */
static size_t cu_pool2d_workspace_size(const ampc_pool_desc *d, ampc_dtype dt) {
    (void)dt;
    return d->kind == AMPC_POOL_MAX ? (size_t)(d->N * d->C * d->OH * d->OW) * sizeof(int32_t) : 0;
}

static int cu_pool2d(const ampc_pool_desc *d, const ampc_tensor *x, ampc_tensor *y, void *ws) {
    int rc = pool_check(d, "pool2d");
    if (rc < 0 || y->numel == 0) return rc;
    ampc_cu_pool_geom g = pool_geom(d);
    return ampc__cu_check(ampc_cu_pool_fwd(&g, x->dtype, ampc__data(x), ampc__data(y), d->kind == AMPC_POOL_MAX ? ws : NULL,
                                           ampc__cu_stream()),
                          "pool2d");
}

static int cu_pool2d_backward(const ampc_pool_desc *d, const ampc_tensor *gy, ampc_tensor *gx, const void *ws) {
    int rc = pool_check(d, "pool2d_backward");
    if (rc < 0 || gx->numel == 0) return rc;
    ampc_cu_pool_geom g = pool_geom(d);
    /* with gy empty no window holds an element: the kernel writes zeros */
    return ampc__cu_check(ampc_cu_pool_bwd(&g, gy->dtype, ampc__data(gy), ampc__data(gx), ws, ampc__cu_stream()),
                          "pool2d_backward");
}

// ---------------------------------------------------------------------------------------------

void ampc__cuda_register_pool(ampc_backend *be) {
    be->pool2d_workspace_size = cu_pool2d_workspace_size;
    be->pool2d = cu_pool2d;
    be->pool2d_backward = cu_pool2d_backward;
}
