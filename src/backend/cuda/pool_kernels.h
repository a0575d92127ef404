/*
 * pool_kernels.h - the launchers of pool.cu: 2-D pooling, forward and backward, callable from
 * pool.c (plain C types; read by gcc and nvcc).
 *
 * Every launcher queues its work on stream s and returns cudaGetLastError(). Tensors are dense,
 * NCHW-like or channels-last per `cl`; 64-bit element counts.
 */
#ifndef AMPC_CUDA_POOL_KERNELS_H
#define AMPC_CUDA_POOL_KERNELS_H

#include <stdbool.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "ampc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Pooling geometry: the fields of ampc_pool_desc (kind: AMPC_CU_POOL_*). */
enum { AMPC_CU_POOL_MAX = 0, AMPC_CU_POOL_AVG_INCLUDE_PAD, AMPC_CU_POOL_AVG_EXCLUDE_PAD, AMPC_CU_POOL_ADAPTIVE_AVG };
typedef struct {
    int kind;
    int64_t N, C, H, W, OH, OW;
    int kernel[2], stride[2], pad_begin[2];
    bool cl;
} ampc_cu_pool_geom;

/* y (N, C, OH, OW) from x (N, C, H, W). Max: PyTorch's rule (a value wins if greater than the
   running maximum or NaN: ties to the first, NaN propagates); argmax (one int32 per output, the
   winner's index h * W + w in its plane) written when not NULL. Averages summed in f32 in window
   order, divided by the window's count. H * W must fit in int32. */
cudaError_t ampc_cu_pool_fwd(const ampc_cu_pool_geom *g, ampc_dtype dt, const void *x, void *y, int32_t *argmax,
                             cudaStream_t s);
/* gx (every element written) from gy: each input element gathers the outputs whose windows
   hold it, in output order (f32 sums, one rounding). Max reads argmax. */
cudaError_t ampc_cu_pool_bwd(const ampc_cu_pool_geom *g, ampc_dtype dt, const void *gy, void *gx, const int32_t *argmax,
                             cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif /* AMPC_CUDA_POOL_KERNELS_H */
