/*
 * common.cuh - what the CUDA kernel files share: element loads and stores per dtype (computing
 * in f32, rounding to nearest even on store, as the CPU backend and PyTorch do), the dtype
 * dispatch and the launch shape.
 */
#ifndef AMPC_CUDA_COMMON_CUH
#define AMPC_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/kernels.h"

namespace ampc_cu {

template <class T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/* Grid for n elements handled by a grid-stride loop of `threads` per block. */
static inline unsigned blocks_for(int64_t n, int threads = 256) {
    int64_t b = (n + threads - 1) / threads;
    if (b < 1) b = 1;
    return (unsigned)(b > 65535 * 8 ? 65535 * 8 : b);
}

#define AMPC_CU_LOOP(i, n) for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

}  // namespace ampc_cu

/* Runs the statement with T bound to the C++ type of float dtype dt (f32, f16, bf16); others:
   the enclosing function returns cudaErrorInvalidValue. */
#define AMPC_CU_FLOAT_TYPES(dt, T, ...)                                                            \
    switch (dt) {                                                                                  \
    case AMPC_F32: { typedef float T; __VA_ARGS__; } break;                                        \
    case AMPC_F16: { typedef __half T; __VA_ARGS__; } break;                                       \
    case AMPC_BF16: { typedef __nv_bfloat16 T; __VA_ARGS__; } break;                               \
    default: return cudaErrorInvalidValue;                                                         \
    }

#endif /* AMPC_CUDA_COMMON_CUH */
