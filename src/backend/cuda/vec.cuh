/*
 * vec.cuh - what pool.cu and batch_norm.cu share beyond common.cuh: the choice of 32- or 64-bit
 * indices, the grid-stride loop over them, and the channels-last fast paths' 16-byte vectors of
 * V = 16 / sizeof(T) channels (loads through the read-only cache, unpacked to floats, packed
 * back with one rounding each).
 *
 * Elementwise kernels index in 32 bits when the tensor has fewer than 2^31 elements (64-bit
 * division is slow on the GPU), else in 64.
 */
#ifndef AMPC_CUDA_VEC_CUH
#define AMPC_CUDA_VEC_CUH

#include <stdint.h>

#include "backend/cuda/common.cuh"

namespace ampc_cu {

#define AMPC_CU_INDEX(total, I, ...)                                                               \
    if ((total) < ((int64_t)1 << 31)) {                                                            \
        typedef uint32_t I;                                                                        \
        __VA_ARGS__;                                                                               \
    } else {                                                                                       \
        typedef int64_t I;                                                                         \
        __VA_ARGS__;                                                                               \
    }

#define GRID_LOOP(I, i, n) for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (I)gridDim.x * blockDim.x)

// ---------------------------------------------------------------------------------------------
// Channels-last fast paths: each thread moves 16-byte vectors of V = 16 / sizeof(T) channels
// (C a multiple of V, every array 16-byte aligned, fewer than 2^31 rows and vectors)

template <class T> struct vec_of { static constexpr int V = 16 / (int)sizeof(T); };

template <class T> __device__ __forceinline__ uint4 ld16(const T *p) { return __ldg(reinterpret_cast<const uint4 *>(p)); }

/* the V values of a vector as floats */
template <class T> __device__ __forceinline__ void unpack(const uint4 &u, float *f) {
    const T *t = reinterpret_cast<const T *>(&u);
#pragma unroll
    for (int l = 0; l < vec_of<T>::V; l++) f[l] = to_f<T>(t[l]);
}

/* V values rounded to T (nearest even, one rounding each) */
template <class T> __device__ __forceinline__ uint4 pack(const float *f) {
    uint4 u;
    T *t = reinterpret_cast<T *>(&u);
#pragma unroll
    for (int l = 0; l < vec_of<T>::V; l++) t[l] = from_f<T>(f[l]);
    return u;
}

/* p is 16-byte aligned */
inline bool al16(const void *p) { return ((uintptr_t)p & 15) == 0; }

}  // namespace ampc_cu

#endif /* AMPC_CUDA_VEC_CUH */
