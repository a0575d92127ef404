/*
 * batch_norm_kernels.h - the launchers of batch_norm.cu: batch norm and the per-channel sums and
 * bias add that convolution uses too, callable from batch_norm.c / conv.c (plain C types; read
 * by gcc and nvcc).
 *
 * Every launcher queues its work on stream s and returns cudaGetLastError(). Tensors are dense,
 * NCHW-like (N, C, S) or channels-last (N, S, C) per `cl`; 64-bit element counts.
 */
#ifndef AMPC_CUDA_BATCH_NORM_KERNELS_H
#define AMPC_CUDA_BATCH_NORM_KERNELS_H

#include <stdbool.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "ampc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Per-channel geometry: x (N, C, S) planar, or (N, S, C) when cl. */
typedef struct {
    int64_t N, C, S;
    bool cl;
} ampc_cu_chan_geom;

/* P, the partial rows of the per-channel reductions below (fixed by the shape and sm_count:
   the results do not depend on anything else); each reduction pass needs 2 * P * C doubles. */
int ampc_cu_chan_parts(const ampc_cu_chan_geom *g, int sm_count);
/* out[c] = sum of x over N and S (f64 accumulation), stored in out_dt (any float dtype);
   part: 2 * P * C doubles of scratch. */
cudaError_t ampc_cu_chan_sum(const ampc_cu_chan_geom *g, ampc_dtype dt, const void *x, double *part, int P, void *out,
                             ampc_dtype out_dt, cudaStream_t s);
/* y[n, c, s] += b[c] (y and b in dt; f32 add, one rounding) */
cudaError_t ampc_cu_bias_add(const ampc_cu_chan_geom *g, ampc_dtype dt, void *y, const void *b, cudaStream_t s);

/* Batch norm forward. Device pointers: w, b, rm, rv, save_mean, save_invstd (C floats, each may
   be NULL; rm and rv required in evaluation), coef (3 * C floats, required: the f32 m, scale,
   shift applied, y = fma(x - m, scale, shift)), part (4 * P * C doubles, training only). */
typedef struct {
    bool training, relu;
    double momentum, eps;
    const void *z;   /* batch_norm_add_relu: y = relu(bn(x) + z) (relu set), z in x's dtype and layout */
    const float *w, *b;
    float *rm, *rv, *save_mean, *save_invstd, *coef;
    double *part;
    int P;
    /* SyncBatchNorm (training) in two calls around the exchange (ampc__bn_sync_stats):
       stats_out set: this process's statistics pass only, into stats_out (3 * C + 1 doubles in
       that function's layout: the means, [C] left to the caller, the centred sums of squares),
       nothing else written; then stats_in set: the world's statistics (that layout after the
       exchange, [C] the world's count) in place of the pass, and the rest as usual. */
    double *stats_out;
    const double *stats_in;
} ampc_cu_bn_fwd_args;
cudaError_t ampc_cu_bn_forward(const ampc_cu_chan_geom *g, ampc_dtype dt, const void *x, void *y, const ampc_cu_bn_fwd_args *a,
                               cudaStream_t s);

/* Batch norm backward: gx (may be NULL), gw, gb (C floats, may be NULL) from x, gy and the
   saved mean / invstd; rc (3 * C floats: the forward's coef) masks gy by the fused ReLU's
   recomputed output when not NULL. kab: 3 * C floats of scratch; part: 2 * P * C doubles. */
typedef struct {
    bool training;
    const void *ymask;   /* batch_norm_add_relu: gy masked where this output (x's dtype) is <= 0 ... */
    void *gz;            /* ... and the masked gradient written here (both or neither) */
    const float *w, *mean, *invstd, *rc;
    float *gw, *gb, *kab;
    double *part;
    int P;
    /* SyncBatchNorm (training, with gx) in two calls around the exchange (ampc__bn_sync_sums):
       sums_out set: this process's pass only: gw, gb (its own share), gz where ymask, and its
       sums into sums_out (2 * C doubles: sum(g), then sum(g (x - mean))); then sums_in set: the
       world's sums (2 * C + 1 doubles, [2 C] the world's count) in place of the pass, and only gx
       written (from gz where ymask: the first call's masked gradient). */
    double *sums_out;
    const double *sums_in;
} ampc_cu_bn_bwd_args;
cudaError_t ampc_cu_bn_backward(const ampc_cu_chan_geom *g, ampc_dtype dt, const void *x, const void *gy, void *gx,
                                const ampc_cu_bn_bwd_args *a, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif /* AMPC_CUDA_BATCH_NORM_KERNELS_H */
