/*
 * reduce.cuh - what elementwise.cu, loss.cu, layer_norm.cu, random.cu and attention.cu share beyond
 * common.cuh: loads and stores of a dtype known only at run time (single values: a scalar
 * gradient, a loss), four elements at a time where aligned, warp and block reductions, and the
 * row kernels' choice between a warp and a block per row.
 */
#ifndef AMPC_CUDA_REDUCE_CUH
#define AMPC_CUDA_REDUCE_CUH

#include <math.h>
#include <stdint.h>

#include "backend/cuda/common.cuh"
#include "backend/cuda/ew_kernels.h"

namespace ampc_cu {

__device__ __forceinline__ float load_any(const void *p, ampc_dtype dt, int64_t i) {
    switch (dt) {
    case AMPC_F16: return to_f<__half>(((const __half *)p)[i]);
    case AMPC_BF16: return to_f<__nv_bfloat16>(((const __nv_bfloat16 *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

/* v rounded once from f64 (the reductions' results), as the CPU's from_f64 does */
__device__ __forceinline__ void store_any_f64(void *p, ampc_dtype dt, int64_t i, double v) {
    switch (dt) {
    case AMPC_F16: ((__half *)p)[i] = __double2half(v); break;
    case AMPC_BF16: ((__nv_bfloat16 *)p)[i] = __double2bfloat16(v); break;
    default: ((float *)p)[i] = (float)v; break;
    }
}

__device__ __forceinline__ void store_any(void *p, ampc_dtype dt, int64_t i, float v) {
    switch (dt) {
    case AMPC_F16: ((__half *)p)[i] = from_f<__half>(v); break;
    case AMPC_BF16: ((__nv_bfloat16 *)p)[i] = from_f<__nv_bfloat16>(v); break;
    default: ((float *)p)[i] = v; break;
    }
}

/* Four consecutive elements as one aligned access (16 bytes of f32, 8 of f16/bf16): the flat
   elementwise kernels take 4 at a time where every array is aligned (views may not be). */
template <class T> struct alignas(4 * sizeof(T)) pack4 {
    T v[4];
};
template <class T> __device__ __forceinline__ void load4(const T *p, int64_t q, float f[4]) {
    pack4<T> k = ((const pack4<T> *)p)[q];
#pragma unroll
    for (int l = 0; l < 4; l++) f[l] = to_f<T>(k.v[l]);
}
template <class T> __device__ __forceinline__ void store4(T *p, int64_t q, const float f[4]) {
    pack4<T> k;
#pragma unroll
    for (int l = 0; l < 4; l++) k.v[l] = from_f<T>(f[l]);
    ((pack4<T> *)p)[q] = k;
}
/* p (NULL allowed) can be read 4 elements of elem bytes at a time */
static inline bool aligned4(const void *p, size_t elem) { return (uintptr_t)p % (4 * elem) == 0; }

/* n elements: body4(q) for elements 4q..4q+3 while whole groups last (vec: every array
   aligned), then body1(i) for the rest */
template <class F4, class F1> __device__ __forceinline__ void loop4(int64_t n, bool vec, F4 body4, F1 body1) {
    int64_t n4 = vec ? n / 4 : 0;
    AMPC_CU_LOOP(q, n4) body4(q);
    AMPC_CU_LOOP(t, n - 4 * n4) body1(4 * n4 + t);
}

/* blocks for n elements taken 4 at a time (vec) or one at a time */
static inline unsigned blocks_vec(int64_t n, bool vec) { return blocks_for(vec ? (n + 3) / 4 : n); }

/* max that ignores NaN (a NaN reaches the result through the sums instead, as on the CPU) */
__device__ __forceinline__ float max_nan_ignored(float a, float b) { return b > a ? b : a; }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = max_nan_ignored(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Row kernels run a warp per row (BLOCK false: blockDim.x / 32 rows per block) or a block per
   row; these reduce v over the threads of one row, every thread getting the result. sh: 32
   floats of shared memory (unused for a warp). */
template <bool BLOCK> __device__ __forceinline__ float row_sum(float v, float *sh) {
    v = warp_sum(v);
    if (!BLOCK) return v;
    unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();   /* sh may still be read by a previous reduction */
    if (lane == 0) sh[w] = v;
    __syncthreads();
    return warp_sum(lane < (blockDim.x >> 5) ? sh[lane] : 0.0f);
}
template <bool BLOCK> __device__ __forceinline__ float row_max(float v, float *sh) {
    v = warp_max(v);
    if (!BLOCK) return v;
    unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    return warp_max(lane < (blockDim.x >> 5) ? sh[lane] : -INFINITY);
}
/* orders this thread's reads of the row before the writes of the others (gx may alias x) */
template <bool BLOCK> __device__ __forceinline__ void row_barrier() {
    if (BLOCK) __syncthreads();
    else __syncwarp();
}

/* The threads of the row kernels: row r's thread t of nt, rows walked grid-stride. */
#define AMPC_CU_ROWS(BLOCK, r, t, nt, rows)                                                        \
    const int64_t t = BLOCK ? threadIdx.x : (threadIdx.x & 31), nt = BLOCK ? blockDim.x : 32;     \
    const int64_t r##_step = BLOCK ? gridDim.x : (int64_t)gridDim.x * (blockDim.x >> 5);           \
    for (int64_t r = BLOCK ? blockIdx.x : (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < (rows); \
         r += r##_step)

/* Launch shape of a row kernel over rows of n elements: a block per row for long rows, or
   for middling rows when there are too few of them to fill the GPU with warps. */
struct row_launch {
    bool block;
    unsigned grid, threads;
};
static inline row_launch row_shape(int64_t rows, int64_t n) {
    row_launch l;
    l.block = n > 1024 || (n > 128 && rows < 2048);
    if (l.block) {
        int64_t t = (n / 4 + 31) / 32 * 32;
        l.threads = (unsigned)(t < 64 ? 64 : t > 512 ? 512 : t);
        l.grid = (unsigned)(rows < 65535 * 8 ? rows : 65535 * 8);
    } else {
        l.threads = 256;
        int64_t g = (rows + 7) / 8;
        l.grid = (unsigned)(g < 65535 * 8 ? g : 65535 * 8);
    }
    if (l.grid < 1) l.grid = 1;
    return l;
}

/* Philox4x32-10 of block ctr under key seed: the draws of ampc's rng stream (core/rng.c), which
   dropout (random.cu) and attention's dropout (attention.cu) take on every device */
__device__ __forceinline__ uint4 philox4x32_10(uint64_t seed, uint64_t ctr) {
    uint32_t c0 = (uint32_t)ctr, c1 = (uint32_t)(ctr >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
#pragma unroll
    for (int r = 0; r < 10; r++) {
        uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c1 = lo1;
        c3 = lo0;
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return make_uint4(c0, c1, c2, c3);
}

}  // namespace ampc_cu

#endif /* AMPC_CUDA_REDUCE_CUH */
