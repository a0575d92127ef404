/*
 * batch_norm.c - the CUDA table's batch norm, batch norm + ReLU and batch norm + residual add
 * + ReLU (own kernels, batch_norm.cu), and the scratch of the per-channel reductions, which
 * convolution's bias gradient uses too (conv.c). The checks mirror the CPU backend's.
 *
 * Why own kernels rather than cuDNN's batch norm: f16 and bf16 activations with f32
 * statistics, the unbiased running variance, the fused ReLU's exact mask, and NHWC and NCHW
 * alike. Batch norm is memory bound: one read of x per statistics pass (channels-last with
 * whole 16-byte vectors per row: one pass in all, batch_norm.cu).
 */
#include "backend/cuda/batch_norm.h"

#include <stdlib.h>
#include <string.h>

int ampc__cu_chan_scratch(ampc_cu_chan_scratch *s, const ampc_cu_chan_geom *g, int passes, int64_t floats) {
    s->P = ampc_cu_chan_parts(g, ampc__cu_sm_count());
    size_t nd = (size_t)passes * 2 * (size_t)s->P * (size_t)g->C;
    s->p = ampc__cu_scratch(nd * sizeof(double) + (size_t)floats * sizeof(float), &s->bytes);
    if (!s->p) return ampc_last_status();
    s->part = s->p;
    s->f = (float *)(s->part + nd);
    return AMPC_OK;
}

void ampc__cu_chan_scratch_free(ampc_cu_chan_scratch *s) {
    ampc__cu_scratch_free(s->p, s->bytes);
    s->p = NULL;
}

// ---------------------------------------------------------------------------------------------
// Batch norm

/* x (N, C, S...) as the kernels' geometry (channels-last: 4-D x stored N, H, W, C) */
static int bn_geom(const ampc_tensor *x, ampc_cu_chan_geom *g) {
    g->N = x->shape[0];
    g->C = x->shape[1];
    g->S = 1;
    for (int i = 2; i < x->ndim; i++) g->S *= x->shape[i];
    g->cl = ampc__is_cl(x);
    return ampc__cu_ready();   /* the arguments: checked by the door (dispatch.c) */
}

static float *f32_or_null(const ampc_tensor *t) { return t ? (float *)ampc__data(t) : NULL; }

/* The forward once the statistics outputs (save_mean, save_invstd, coef: device f32 (C) / (3, C),
   each may be NULL) were checked. */
static int bn_forward(const char *k, const ampc_cu_chan_geom *g, const ampc_tensor *x, const ampc_tensor *weight,
                      const ampc_tensor *bias, ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y,
                      float *save_mean, float *save_invstd, float *coef, bool relu, bool training, double momentum, double eps,
                      const ampc_tensor *z) {
    int64_t C = g->C;
    int rc;
    if (C == 0) return AMPC_OK;
    ampc_cu_chan_scratch s;
    if ((rc = ampc__cu_chan_scratch(&s, g, training ? 2 : 0, coef ? 0 : 3 * C)) < 0) return rc;
    ampc_cu_bn_fwd_args a = {.training = training, .relu = relu, .momentum = momentum, .eps = eps, .z = z ? ampc__data(z) : NULL,
                             .w = f32_or_null(weight), .b = f32_or_null(bias), .rm = f32_or_null(running_mean),
                             .rv = f32_or_null(running_var), .save_mean = save_mean, .save_invstd = save_invstd,
                             .coef = coef ? coef : s.f, .part = s.part, .P = s.P};
    rc = ampc__cu_check(ampc_cu_bn_forward(g, x->dtype, ampc__data(x), ampc__data(y), &a, ampc__cu_stream()), k);
    ampc__cu_chan_scratch_free(&s);
    return rc;
}

/* SyncBatchNorm's exchange of statistics is not done on this device yet (its kernels compute the
   statistics and normalise in one launch sequence; the exchange would sit between them). */
static int no_sync(const char *k, bool sync, bool training) {
    return sync && training ? ampc__err(AMPC_ERR_UNSUPPORTED, "cuda %s: synchronised batch norm (--sync-bn) runs on the CPU only "
                                                              "for now; train without it on cuda",
                                        k)
                            : AMPC_OK;
}

static int cu_batch_norm(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias, ampc_tensor *running_mean,
                         ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *save_mean, ampc_tensor *save_invstd,
                         bool training, double momentum, double eps, bool sync) {
    const char *k = "batch_norm";
    ampc_cu_chan_geom g;
    int rc;
    if ((rc = no_sync(k, sync, training)) < 0 || (rc = bn_geom(x, &g)) < 0) return rc;
    return bn_forward(k, &g, x, weight, bias, running_mean, running_var, y, f32_or_null(save_mean), f32_or_null(save_invstd),
                      NULL, false, training, momentum, eps, NULL);
}

/* stats rows: mean, invstd, then the f32 m, scale, shift the normalisation applied
   (y = fma(x - m, scale, shift)), which the backward's mask recomputes exactly */
static int cu_batch_norm_relu(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                              ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *stats,
                              bool training, double momentum, double eps, bool sync) {
    const char *k = "batch_norm_relu";
    ampc_cu_chan_geom g;
    int rc;
    if ((rc = no_sync(k, sync, training)) < 0 || (rc = bn_geom(x, &g)) < 0) return rc;
    float *s = f32_or_null(stats);
    return bn_forward(k, &g, x, weight, bias, running_mean, running_var, y, s, s ? s + g.C : NULL, s ? s + 2 * g.C : NULL, true,
                      training, momentum, eps, NULL);
}

/* The backward once the statistics were checked (rc: the fused ReLU's coefficients, or NULL). */
static int bn_backward(const char *k, const ampc_cu_chan_geom *g, const ampc_tensor *x, const ampc_tensor *gy,
                       const ampc_tensor *weight, const float *mean, const float *invstd, const float *rc_coef, bool training,
                       ampc_tensor *gx, ampc_tensor *gw, ampc_tensor *gb, const ampc_tensor *ymask, ampc_tensor *gz) {
    int64_t C = g->C;
    int rc;
    if (C == 0) return AMPC_OK;
    ampc_cu_chan_scratch s;
    if ((rc = ampc__cu_chan_scratch(&s, g, 1, 3 * C)) < 0) return rc;
    ampc_cu_bn_bwd_args a = {.training = training, .ymask = ymask ? ampc__data(ymask) : NULL, .gz = gz ? ampc__data(gz) : NULL,
                             .w = f32_or_null(weight), .mean = mean, .invstd = invstd, .rc = rc_coef,
                             .gw = f32_or_null(gw), .gb = f32_or_null(gb), .kab = s.f, .part = s.part, .P = s.P};
    rc = ampc__cu_check(ampc_cu_bn_backward(g, x->dtype, ampc__data(x), ampc__data(gy), gx ? ampc__data(gx) : NULL, &a,
                                            ampc__cu_stream()),
                        k);
    ampc__cu_chan_scratch_free(&s);
    return rc;
}

static int cu_batch_norm_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                  const ampc_tensor *save_mean, const ampc_tensor *save_invstd, bool training, bool sync,
                                  ampc_tensor *gx, ampc_tensor *gw, ampc_tensor *gb) {
    const char *k = "batch_norm_backward";
    ampc_cu_chan_geom g;
    int rc;
    if ((rc = no_sync(k, sync, training)) < 0 || (rc = bn_geom(x, &g)) < 0) return rc;
    return bn_backward(k, &g, x, gy, weight, ampc__data(save_mean), ampc__data(save_invstd), NULL, training, gx, gw, gb, NULL, NULL);
}

static int cu_batch_norm_relu_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                       const ampc_tensor *stats, bool training, bool sync, ampc_tensor *gx, ampc_tensor *gw,
                                       ampc_tensor *gb) {
    const char *k = "batch_norm_relu_backward";
    ampc_cu_chan_geom g;
    int rc;
    if ((rc = no_sync(k, sync, training)) < 0 || (rc = bn_geom(x, &g)) < 0) return rc;
    const float *s = ampc__data(stats);
    return bn_backward(k, &g, x, gy, weight, s, s + g.C, s + 2 * g.C, training, gx, gw, gb, NULL, NULL);
}

/* relu(batch_norm(x) + z): stats rows mean, invstd */
static int cu_batch_norm_add_relu(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                                  ampc_tensor *running_mean, ampc_tensor *running_var, const ampc_tensor *z, ampc_tensor *y,
                                  ampc_tensor *stats, bool training, double momentum, double eps) {
    const char *k = "batch_norm_add_relu";
    ampc_cu_chan_geom g;
    int rc;
    if ((rc = bn_geom(x, &g)) < 0) return rc;
    float *s = f32_or_null(stats);
    return bn_forward(k, &g, x, weight, bias, running_mean, running_var, y, s, s ? s + g.C : NULL, NULL, true, training, momentum,
                      eps, z);
}

static int cu_batch_norm_add_relu_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *y,
                                           const ampc_tensor *weight, const ampc_tensor *stats, bool training, ampc_tensor *gx,
                                           ampc_tensor *gz, ampc_tensor *gw, ampc_tensor *gb) {
    const char *k = "batch_norm_add_relu_backward";
    ampc_cu_chan_geom g;
    int rc;
    if ((rc = bn_geom(x, &g)) < 0) return rc;
    const float *s = ampc__data(stats);
    return bn_backward(k, &g, x, gy, weight, s, s + g.C, NULL, training, gx, gw, gb, y, gz);
}

// ---------------------------------------------------------------------------------------------

void ampc__cuda_register_batch_norm(ampc_backend *be) {
    be->batch_norm = cu_batch_norm;
    be->batch_norm_backward = cu_batch_norm_backward;
    be->batch_norm_relu = cu_batch_norm_relu;
    be->batch_norm_relu_backward = cu_batch_norm_relu_backward;
    /* The fused kernels (on an H100, 2026-11-27: resnet50 amp-fp16 51.5 -> 44.6 ms a step);
       AMPC_CUDA_BN_ADD_RELU=0 composes batch_norm, add and relu instead, as the CPU does. */
    const char *fuse = getenv("AMPC_CUDA_BN_ADD_RELU");
    if (!fuse || strcmp(fuse, "0")) {
        be->batch_norm_add_relu = cu_batch_norm_add_relu;
        be->batch_norm_add_relu_backward = cu_batch_norm_add_relu_backward;
    }
}
