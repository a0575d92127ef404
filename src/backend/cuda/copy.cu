/*
 * copy.cu - dtype conversion, layout permutation (NCHW <-> NHWC) and fill: what core's tensor
 * copies and constructors need of the device.
 */
#include "backend/cuda/common.cuh"

using namespace ampc_cu;

template <class S, class D> __global__ void convert_kernel(const S *src, D *dst, int64_t n) {
    AMPC_CU_LOOP(i, n) dst[i] = from_f<D>(to_f<S>(src[i]));
}

/* element (n, c, p) of (N, C, P) <-> (n, p, c) of (N, P, C) */
template <class S, class D> __global__ void permute_kernel(const S *src, D *dst, int64_t N, int64_t C, int64_t P, bool to_cl) {
    int64_t total = N * C * P;
    AMPC_CU_LOOP(i, total) {
        /* i indexes the destination */
        int64_t n, c, p;
        if (to_cl) { c = i % C; p = (i / C) % P; n = i / (C * P); }
        else { p = i % P; c = (i / P) % C; n = i / (C * P); }
        int64_t si = to_cl ? (n * C + c) * P + p : (n * P + p) * C + c;
        dst[i] = from_f<D>(to_f<S>(src[si]));
    }
}

__global__ void copy_i64_kernel(const int64_t *src, int64_t *dst, int64_t n) { AMPC_CU_LOOP(i, n) dst[i] = src[i]; }

template <class D> __global__ void fill_kernel(D *dst, int64_t n, D v) { AMPC_CU_LOOP(i, n) dst[i] = v; }
__global__ void scale_rows_kernel(const float *src, int64_t src_ld, float *dst, int64_t dst_ld, int64_t cols, int64_t n, float k) {
    AMPC_CU_LOOP(i, n) dst[i / cols * dst_ld + i % cols] = src[i / cols * src_ld + i % cols] * k;
}

extern "C" cudaError_t ampc_cu_scale_rows(const float *src, int64_t src_ld, float *dst, int64_t dst_ld, int64_t rows, int64_t cols,
                                          float k, cudaStream_t s) {
    int64_t n = rows * cols;
    if (n > 0) scale_rows_kernel<<<blocks_for(n), 256, 0, s>>>(src, src_ld, dst, dst_ld, cols, n, k);
    return cudaGetLastError();
}

extern "C" cudaError_t ampc_cu_convert(const void *src, ampc_dtype sdt, void *dst, ampc_dtype ddt, int64_t n, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    if (sdt == AMPC_I64 || ddt == AMPC_I64) {
        if (sdt != ddt) return cudaErrorInvalidValue;
        copy_i64_kernel<<<blocks_for(n), 256, 0, s>>>((const int64_t *)src, (int64_t *)dst, n);
        return cudaGetLastError();
    }
    AMPC_CU_FLOAT_TYPES(sdt, S, AMPC_CU_FLOAT_TYPES(ddt, D, convert_kernel<S, D><<<blocks_for(n), 256, 0, s>>>((const S *)src, (D *)dst, n)));
    return cudaGetLastError();
}

extern "C" cudaError_t ampc_cu_convert_permute(const void *src, ampc_dtype sdt, void *dst, ampc_dtype ddt, int64_t N, int64_t C,
                                               int64_t HW, bool to_cl, cudaStream_t s) {
    int64_t n = N * C * HW;
    if (n <= 0) return cudaSuccess;
    AMPC_CU_FLOAT_TYPES(sdt, S, AMPC_CU_FLOAT_TYPES(ddt, D, permute_kernel<S, D><<<blocks_for(n), 256, 0, s>>>((const S *)src, (D *)dst, N, C, HW, to_cl)));
    return cudaGetLastError();
}

extern "C" cudaError_t ampc_cu_fill(void *dst, ampc_dtype dt, int64_t n, double v, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    if (dt == AMPC_I64) {
        fill_kernel<int64_t><<<blocks_for(n), 256, 0, s>>>((int64_t *)dst, n, (int64_t)v);
        return cudaGetLastError();
    }
    /* rounded once from the double, as the CPU's from_f64 does (a double -> f32 -> f16 path
       could round twice) */
    switch (dt) {
    case AMPC_F32: fill_kernel<float><<<blocks_for(n), 256, 0, s>>>((float *)dst, n, (float)v); break;
    case AMPC_F16: fill_kernel<__half><<<blocks_for(n), 256, 0, s>>>((__half *)dst, n, __double2half(v)); break;
    case AMPC_BF16: fill_kernel<__nv_bfloat16><<<blocks_for(n), 256, 0, s>>>((__nv_bfloat16 *)dst, n, __double2bfloat16(v)); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}
