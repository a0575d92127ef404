/*
 * kernels.h - the launchers of ampc's own CUDA kernels (the *.cu files), callable from the C
 * side of the CUDA backend (the *.c files, which check arguments and fill the backend table).
 *
 * Plain C types only (this header is read by gcc and by nvcc): device pointers, element
 * counts, dtypes of include/ampc.h. Every launcher queues its work on stream s and returns
 * cudaGetLastError() (launch errors; faults show up at the next synchronisation). Contiguous
 * (row-major or channels-last storage order) data, 64-bit element counts.
 */
#ifndef AMPC_CUDA_KERNELS_H
#define AMPC_CUDA_KERNELS_H

#include <stdbool.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "ampc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* dst[i] = src[i] converted (f32/f16/bf16 any to any, round to nearest even; i64 to i64) */
cudaError_t ampc_cu_convert(const void *src, ampc_dtype sdt, void *dst, ampc_dtype ddt, int64_t n, cudaStream_t s);
/* The same with the layout changed: (N, C, HW) <-> (N, HW, C); to_cl: NCHW source, NHWC dest */
cudaError_t ampc_cu_convert_permute(const void *src, ampc_dtype sdt, void *dst, ampc_dtype ddt, int64_t N, int64_t C,
                                    int64_t HW, bool to_cl, cudaStream_t s);
/* every element = v (in dt, rounded to nearest even; i64 truncated) */
cudaError_t ampc_cu_fill(void *dst, ampc_dtype dt, int64_t n, double v, cudaStream_t s);
/* dst[r * dst_ld + c] = src[r * src_ld + c] * k, r < rows, c < cols (copy_block with a scale) */
cudaError_t ampc_cu_scale_rows(const float *src, int64_t src_ld, float *dst, int64_t dst_ld, int64_t rows, int64_t cols, float k,
                               cudaStream_t s);
/* Multiprocessor count of the device (cuda_backend.c; after the backend started), for launch
   shapes. */
int ampc__cu_sm_count(void);

#ifdef __cplusplus
}
#endif

#endif /* AMPC_CUDA_KERNELS_H */
