/*
 * batch_norm.c - the CUDA table's batch norm, batch norm + ReLU and batch norm + residual add
 * + ReLU (own kernels, batch_norm.cu), and the scratch of the per-channel reductions, which
 * convolution's bias gradient uses too (conv.c). The checks mirror the CPU backend's.
 *
 * Why own kernels rather than cuDNN's batch norm: f16 and bf16 activations with f32
 * statistics, the unbiased running variance, the fused ReLU's exact mask, and NHWC and NCHW
 * alike. Batch norm is memory bound: one read of x per statistics pass (channels-last with
 * whole 16-byte vectors per row: one pass in all, batch_norm.cu).
 *
 * SyncBatchNorm (sync): each kernel sequence runs in two calls, this process's statistics (or
 * gradient sums) first, and the normalisation (or gx) from the world's; between them the few
 * doubles per channel go to the host, through the collectives seam (bn_sync.c, the same
 * exchange the CPU's kernels make) and back.
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

/* The host's side of SyncBatchNorm's exchanges (bn_sync.c) for C channels: this process's
   doubles from the device (dev), with `count` stored where the device left it, exchanged, and
   the world's written back over them. stats: the forward's statistics (3 C + 1 doubles, the
   count at [C]; ampc__bn_sync_stats); else the backward's sums (2 C + 1, the count at [2 C];
   ampc__bn_sync_sums). Blocking: the stream is drained twice. */
static int exchange_on_host(const char *k, double *dev, int64_t C, double count, bool stats) {
    const int64_t n = (stats ? 3 : 2) * C + 1, at = stats ? C : 2 * C;
    cudaStream_t st = ampc__cu_stream();
    size_t block = 0;   /* from the caching allocator: no system allocation in a steady-state step */
    double *h = ampc__alloc(AMPC_DEVICE_CPU, (size_t)n * sizeof(double), AMPC_MEM_WORKSPACE, &block);
    if (!h) return ampc_last_status();
    int rc = ampc__cu_check(cudaMemcpyAsync(h, dev, (size_t)n * sizeof(double), cudaMemcpyDeviceToHost, st), k);
    if (rc >= 0) rc = ampc__cu_check(cudaStreamSynchronize(st), k);
    if (rc >= 0) {
        h[at] = count;
        rc = stats ? ampc__bn_sync_stats(C, h) : ampc__bn_sync_sums(h, n);
    }
    if (rc >= 0) rc = ampc__cu_check(cudaMemcpyAsync(dev, h, (size_t)n * sizeof(double), cudaMemcpyHostToDevice, st), k);
    if (rc >= 0) rc = ampc__cu_check(cudaStreamSynchronize(st), k);
    ampc__free(AMPC_DEVICE_CPU, h, block, AMPC_MEM_WORKSPACE);
    return rc;
}

/* The forward once the statistics outputs (save_mean, save_invstd, coef: device f32 (C) / (3, C),
   each may be NULL) were checked. sync (training; SyncBatchNorm): the statistics of every
   process, exchanged between this process's statistics pass and the normalisation. */
static int bn_forward(const char *k, const ampc_cu_chan_geom *g, const ampc_tensor *x, const ampc_tensor *weight,
                      const ampc_tensor *bias, ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y,
                      float *save_mean, float *save_invstd, float *coef, bool relu, bool training, double momentum, double eps,
                      const ampc_tensor *z, bool sync) {
    int64_t C = g->C;
    int rc;
    if (C == 0) return AMPC_OK;
    sync = sync && training;
    /* scratch floats: the coefficients when the caller keeps none; then (sync, 8-byte aligned)
       the 3 C + 1 doubles of the exchange */
    int64_t cf = coef ? 0 : 3 * C, cfa = cf + (cf & 1), nst = sync ? 3 * C + 1 : 0;
    ampc_cu_chan_scratch s;
    if ((rc = ampc__cu_chan_scratch(&s, g, training ? 2 : 0, cfa + 2 * nst)) < 0) return rc;
    double *st = sync ? (double *)(void *)(s.f + cfa) : NULL;
    ampc_cu_bn_fwd_args a = {.training = training, .relu = relu, .momentum = momentum, .eps = eps, .z = z ? ampc__data(z) : NULL,
                             .w = f32_or_null(weight), .b = f32_or_null(bias), .rm = f32_or_null(running_mean),
                             .rv = f32_or_null(running_var), .save_mean = save_mean, .save_invstd = save_invstd,
                             .coef = coef ? coef : s.f, .part = s.part, .P = s.P, .stats_out = st};
    cudaStream_t cs = ampc__cu_stream();
    rc = ampc__cu_check(ampc_cu_bn_forward(g, x->dtype, ampc__data(x), ampc__data(y), &a, cs), k);
    if (sync && rc >= 0) {
        rc = exchange_on_host(k, st, C, (double)(g->N * g->S), true);
        a.stats_out = NULL;
        a.stats_in = st;
        if (rc >= 0) rc = ampc__cu_check(ampc_cu_bn_forward(g, x->dtype, ampc__data(x), ampc__data(y), &a, cs), k);
    }
    ampc__cu_chan_scratch_free(&s);
    return rc;
}

static int cu_batch_norm(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias, ampc_tensor *running_mean,
                         ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *save_mean, ampc_tensor *save_invstd,
                         bool training, double momentum, double eps, bool sync) {
    const char *k = "batch_norm";
    ampc_cu_chan_geom g;
    int rc;
    if ((rc = bn_geom(x, &g)) < 0) return rc;
    return bn_forward(k, &g, x, weight, bias, running_mean, running_var, y, f32_or_null(save_mean), f32_or_null(save_invstd),
                      NULL, false, training, momentum, eps, NULL, sync);
}

/* stats rows: mean, invstd, then the f32 m, scale, shift the normalisation applied
   (y = fma(x - m, scale, shift)), which the backward's mask recomputes exactly */
static int cu_batch_norm_relu(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                              ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *stats,
                              bool training, double momentum, double eps, bool sync) {
    const char *k = "batch_norm_relu";
    ampc_cu_chan_geom g;
    int rc;
    if ((rc = bn_geom(x, &g)) < 0) return rc;
    float *s = f32_or_null(stats);
    return bn_forward(k, &g, x, weight, bias, running_mean, running_var, y, s, s ? s + g.C : NULL, s ? s + 2 * g.C : NULL, true,
                      training, momentum, eps, NULL, sync);
}

/* The backward once the statistics were checked (rc: the fused ReLU's coefficients, or NULL).
   sync (training, with gx; SyncBatchNorm): gx from every process's sums, exchanged between this
   process's pass (which writes gw and gb, its own share) and gx's. */
static int bn_backward(const char *k, const ampc_cu_chan_geom *g, const ampc_tensor *x, const ampc_tensor *gy,
                       const ampc_tensor *weight, const float *mean, const float *invstd, const float *rc_coef, bool training,
                       ampc_tensor *gx, ampc_tensor *gw, ampc_tensor *gb, const ampc_tensor *ymask, ampc_tensor *gz, bool sync) {
    int64_t C = g->C;
    int rc;
    if (C == 0) return AMPC_OK;
    sync = sync && training && gx;   /* without gx nothing is exchanged */
    /* scratch floats: kab (3 C); then (sync, 8-byte aligned) the 2 C + 1 doubles of the exchange */
    int64_t ka = 3 * C + ((3 * C) & 1), nsum = sync ? 2 * C + 1 : 0;
    ampc_cu_chan_scratch s;
    if ((rc = ampc__cu_chan_scratch(&s, g, 1, ka + 2 * nsum)) < 0) return rc;
    double *sums = sync ? (double *)(void *)(s.f + ka) : NULL;
    ampc_cu_bn_bwd_args a = {.training = training, .ymask = ymask ? ampc__data(ymask) : NULL, .gz = gz ? ampc__data(gz) : NULL,
                             .w = f32_or_null(weight), .mean = mean, .invstd = invstd, .rc = rc_coef,
                             .gw = f32_or_null(gw), .gb = f32_or_null(gb), .kab = s.f, .part = s.part, .P = s.P, .sums_out = sums};
    cudaStream_t cs = ampc__cu_stream();
    void *gxp = gx ? ampc__data(gx) : NULL;
    rc = ampc__cu_check(ampc_cu_bn_backward(g, x->dtype, ampc__data(x), ampc__data(gy), gxp, &a, cs), k);
    if (sync && rc >= 0) {
        rc = exchange_on_host(k, sums, C, (double)(g->N * g->S), false);
        a.sums_out = NULL;
        a.sums_in = sums;
        if (rc >= 0) rc = ampc__cu_check(ampc_cu_bn_backward(g, x->dtype, ampc__data(x), ampc__data(gy), gxp, &a, cs), k);
    }
    ampc__cu_chan_scratch_free(&s);
    return rc;
}

static int cu_batch_norm_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                  const ampc_tensor *save_mean, const ampc_tensor *save_invstd, bool training, bool sync,
                                  ampc_tensor *gx, ampc_tensor *gw, ampc_tensor *gb) {
    const char *k = "batch_norm_backward";
    ampc_cu_chan_geom g;
    int rc;
    if ((rc = bn_geom(x, &g)) < 0) return rc;
    return bn_backward(k, &g, x, gy, weight, ampc__data(save_mean), ampc__data(save_invstd), NULL, training, gx, gw, gb, NULL, NULL,
                       sync);
}

static int cu_batch_norm_relu_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                       const ampc_tensor *stats, bool training, bool sync, ampc_tensor *gx, ampc_tensor *gw,
                                       ampc_tensor *gb) {
    const char *k = "batch_norm_relu_backward";
    ampc_cu_chan_geom g;
    int rc;
    if ((rc = bn_geom(x, &g)) < 0) return rc;
    const float *s = ampc__data(stats);
    return bn_backward(k, &g, x, gy, weight, s, s + g.C, s + 2 * g.C, training, gx, gw, gb, NULL, NULL, sync);
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
                      eps, z, false);
}

static int cu_batch_norm_add_relu_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *y,
                                           const ampc_tensor *weight, const ampc_tensor *stats, bool training, ampc_tensor *gx,
                                           ampc_tensor *gz, ampc_tensor *gw, ampc_tensor *gb) {
    const char *k = "batch_norm_add_relu_backward";
    ampc_cu_chan_geom g;
    int rc;
    if ((rc = bn_geom(x, &g)) < 0) return rc;
    const float *s = ampc__data(stats);
    return bn_backward(k, &g, x, gy, weight, s, s + g.C, NULL, training, gx, gw, gb, y, gz, false);
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
