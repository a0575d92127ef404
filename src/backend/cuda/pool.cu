/*
 * pool.cu - ampc's own CUDA kernels of 2-D pooling (all kinds, both memory formats).
 *
 * Pooling: one thread per output (forward) or per input element (backward, which gathers the
 * outputs whose windows hold the element, in output order: no atomics, deterministic, gx fully
 * written). The rules are the REF device's (PyTorch's): max takes a value greater than the
 * running maximum or NaN, the argmax is its index in the (H, W) plane; averages divide by the
 * window's count (include-pad: the part inside [-pad_begin, H + pad_begin)).
 *
 * Max pooling on channels-last data whose C is a multiple of a 16-byte vector (8 halves, 4
 * floats), with 16-byte aligned arrays, takes faster kernels of the same rules (vec.cuh): every
 * thread moves whole vectors and the window arithmetic is 32-bit. On an H100 (resnet50 batch
 * 256 amp-fp16, one step under Nsight Compute) pooling went from 2.2 (first version; 10.3
 * before) to 1.5 ms (bench/NOTES.md).
 */
#include "backend/cuda/pool_kernels.h"
#include "backend/cuda/vec.cuh"

using namespace ampc_cu;

namespace {

__device__ __forceinline__ float neg_inf() { return __int_as_float((int)0xff800000u); }

// ---------------------------------------------------------------------------------------------
// Pooling

/* Rows [*lo, *hi) of the input that window o reads along axis (0: H, 1: W), and *count, the
   divisor of average pooling. */
__device__ __forceinline__ void pool_window(const ampc_cu_pool_geom &g, int axis, long long o, long long *lo, long long *hi,
                                            long long *count) {
    long long size = axis ? g.W : g.H, out = axis ? g.OW : g.OH;
    if (g.kind == AMPC_CU_POOL_ADAPTIVE_AVG) {
        *lo = o * size / out;                    /* floor */
        *hi = ((o + 1) * size + out - 1) / out;  /* ceil */
        *count = *hi - *lo;
        return;
    }
    long long start = o * g.stride[axis] - g.pad_begin[axis], end = start + g.kernel[axis];
    long long lim = size + g.pad_begin[axis], padded_end = end < lim ? end : lim;
    *lo = start > 0 ? start : 0;
    *hi = end < size ? end : size;
    *count = g.kind == AMPC_CU_POOL_AVG_INCLUDE_PAD ? padded_end - start : *hi - *lo;
}

/* Outputs [*o0, *o1) along axis whose windows may hold input row h (a superset: callers check). */
__device__ __forceinline__ void pool_candidates(const ampc_cu_pool_geom &g, int axis, long long h, long long *o0,
                                                long long *o1) {
    long long size = axis ? g.W : g.H, out = axis ? g.OW : g.OH, lo, hi;
    if (g.kind == AMPC_CU_POOL_ADAPTIVE_AVG) {
        lo = h * out / size;
        hi = ((h + 1) * out + size - 1) / size;
    } else {
        long long st = g.stride[axis], top = h + g.pad_begin[axis], first = top - g.kernel[axis];
        lo = first >= 0 ? first / st + 1 : 0;
        hi = top / st + 1;
    }
    *o0 = lo > 0 ? lo : 0;
    *o1 = hi < out ? hi : out;
}

/* Element (h, w) of plane (n, c) of an (N, C, H, W) tensor is at *base + (h * W + w) * *step. */
__device__ __forceinline__ void plane_of(bool cl, long long n, long long c, long long C, long long H, long long W,
                                         long long *base, long long *step) {
    if (cl) {
        *base = n * H * W * C + c;
        *step = C;
    } else {
        *base = (n * C + c) * H * W;
        *step = 1;
    }
}

/* (n, c, a, b) of storage index i of an (N, C, A, B) tensor */
template <class I> __device__ __forceinline__ void decode4(bool cl, I i, I C, I A, I B, I *n, I *c, I *a, I *b) {
    if (cl) {
        *c = i % C;
        i /= C;
        *b = i % B;
        i /= B;
        *a = i % A;
        *n = i / A;
    } else {
        *b = i % B;
        i /= B;
        *a = i % A;
        i /= A;
        *c = i % C;
        *n = i / C;
    }
}

template <class T, class I>
__global__ void pool_fwd_kernel(ampc_cu_pool_geom g, const T *x, T *y, int32_t *arg, I total) {
    GRID_LOOP(I, i, total) {
        I n, c, oh, ow;
        decode4<I>(g.cl, i, (I)g.C, (I)g.OH, (I)g.OW, &n, &c, &oh, &ow);
        long long base, step, h0, h1, ch, w0, w1, cw;
        plane_of(g.cl, n, c, g.C, g.H, g.W, &base, &step);
        pool_window(g, 0, oh, &h0, &h1, &ch);
        pool_window(g, 1, ow, &w0, &w1, &cw);
        if (g.kind == AMPC_CU_POOL_MAX) {
            float m = neg_inf();
            long long at = h0 * g.W + w0;
            for (long long h = h0; h < h1; h++)
                for (long long w = w0; w < w1; w++) {
                    float v = to_f<T>(x[base + (h * g.W + w) * step]);
                    if (v > m || v != v) m = v, at = h * g.W + w;
                }
            y[i] = from_f<T>(m);
            if (arg) arg[i] = (int32_t)at;
        } else {
            float s = 0.0f;
            for (long long h = h0; h < h1; h++)
                for (long long w = w0; w < w1; w++) s += to_f<T>(x[base + (h * g.W + w) * step]);
            y[i] = from_f<T>(h0 < h1 && w0 < w1 ? s / (float)(ch * cw) : 0.0f);
        }
    }
}

template <class T, class I>
__global__ void pool_bwd_kernel(ampc_cu_pool_geom g, const T *gy, T *gx, const int32_t *arg, I total) {
    GRID_LOOP(I, i, total) {
        I n, c, hh, ww;
        decode4<I>(g.cl, i, (I)g.C, (I)g.H, (I)g.W, &n, &c, &hh, &ww);
        long long h = hh, w = ww, me = h * g.W + w, base, step, oh0, oh1, ow0, ow1;
        plane_of(g.cl, n, c, g.C, g.OH, g.OW, &base, &step);
        pool_candidates(g, 0, h, &oh0, &oh1);
        pool_candidates(g, 1, w, &ow0, &ow1);
        float acc = 0.0f;
        for (long long oh = oh0; oh < oh1; oh++) {
            long long h0, h1, ch;
            pool_window(g, 0, oh, &h0, &h1, &ch);
            if (h < h0 || h >= h1) continue;
            for (long long ow = ow0; ow < ow1; ow++) {
                long long w0, w1, cw;
                pool_window(g, 1, ow, &w0, &w1, &cw);
                if (w < w0 || w >= w1) continue;
                long long o = base + (oh * g.OW + ow) * step;
                if (g.kind == AMPC_CU_POOL_MAX) {
                    if (arg[o] == (int32_t)me) acc += to_f<T>(gy[o]);
                } else {
                    acc += to_f<T>(gy[o]) / (float)(ch * cw);
                }
            }
        }
        gx[i] = from_f<T>(acc);
    }
}

/* Max pooling, channels-last: one thread per V-channel vector of an output (forward) or of an
   input element (backward), the window arithmetic in 32 bits, the rules of pool_fwd_kernel and
   pool_bwd_kernel (ties to the first, NaN wins; gx gathers in output order). */
struct mp_geom {
    int C, H, W, OH, OW, kh, kw, sh, sw, ph, pw;
};

template <class T> __global__ void maxpool_fwd_vec(mp_geom g, unsigned nv, const T *x, T *y, int32_t *arg) {
    constexpr int V = vec_of<T>::V;
    const unsigned CV = g.C / V;
    GRID_LOOP(unsigned, v, nv) {
        unsigned t = v / CV, cv = v - t * CV;
        int ow = (int)(t % g.OW);
        t /= g.OW;
        int oh = (int)(t % g.OH), n = (int)(t / g.OH);
        int h0 = oh * g.sh - g.ph, w0 = ow * g.sw - g.pw, h1 = min(h0 + g.kh, g.H), w1 = min(w0 + g.kw, g.W);
        h0 = max(h0, 0);
        w0 = max(w0, 0);
        float m[V];
        int at[V];
#pragma unroll
        for (int l = 0; l < V; l++) m[l] = neg_inf(), at[l] = h0 * g.W + w0;
        for (int h = h0; h < h1; h++)
            for (int w = w0; w < w1; w++) {
                float f[V];
                unpack<T>(ld16(x + ((size_t)((long long)n * g.H + h) * g.W + w) * g.C + cv * V), f);
#pragma unroll
                for (int l = 0; l < V; l++)
                    if (f[l] > m[l] || f[l] != f[l]) m[l] = f[l], at[l] = h * g.W + w;
            }
        *reinterpret_cast<uint4 *>(y + (size_t)v * V) = pack<T>(m);
        if (arg)
#pragma unroll
            for (int q = 0; q < V / 4; q++)
                reinterpret_cast<int4 *>(arg + (size_t)v * V)[q] = make_int4(at[4 * q], at[4 * q + 1], at[4 * q + 2], at[4 * q + 3]);
    }
}

template <class T> __global__ void maxpool_bwd_vec(mp_geom g, unsigned nv, const T *gy, T *gx, const int32_t *arg) {
    constexpr int V = vec_of<T>::V;
    const unsigned CV = g.C / V;
    GRID_LOOP(unsigned, v, nv) {
        unsigned t = v / CV, cv = v - t * CV;
        int w = (int)(t % g.W);
        t /= g.W;
        int h = (int)(t % g.H), n = (int)(t / g.H), me = h * g.W + w;
        int fh = h + g.ph - g.kh, fw = w + g.pw - g.kw;
        int oh0 = fh >= 0 ? fh / g.sh + 1 : 0, oh1 = min((h + g.ph) / g.sh + 1, g.OH);
        int ow0 = fw >= 0 ? fw / g.sw + 1 : 0, ow1 = min((w + g.pw) / g.sw + 1, g.OW);
        float acc[V];
#pragma unroll
        for (int l = 0; l < V; l++) acc[l] = 0.0f;
        for (int oh = oh0; oh < oh1; oh++) {
            int hs = oh * g.sh - g.ph;
            if (h < max(hs, 0) || h >= min(hs + g.kh, g.H)) continue;
            for (int ow = ow0; ow < ow1; ow++) {
                int ws = ow * g.sw - g.pw;
                if (w < max(ws, 0) || w >= min(ws + g.kw, g.W)) continue;
                size_t o = ((size_t)((long long)n * g.OH + oh) * g.OW + ow) * g.C + cv * V;
                float gv[V];
                int a[V];
                unpack<T>(ld16(gy + o), gv);
#pragma unroll
                for (int q = 0; q < V / 4; q++) {
                    int4 a4 = __ldg(reinterpret_cast<const int4 *>(arg + o) + q);
                    a[4 * q] = a4.x, a[4 * q + 1] = a4.y, a[4 * q + 2] = a4.z, a[4 * q + 3] = a4.w;
                }
#pragma unroll
                for (int l = 0; l < V; l++)
                    if (a[l] == me) acc[l] += gv[l];
            }
        }
        *reinterpret_cast<uint4 *>(gx + (size_t)v * V) = pack<T>(acc);
    }
}

/* Max pooling on the vector kernels: channels-last, C a multiple of V, 16-byte aligned arrays,
   every index in 32 bits (n: the larger tensor's elements). */
bool mp_vec(const ampc_cu_pool_geom *g, ampc_dtype dt, int64_t n, const void *a, const void *b, const int32_t *arg) {
    int V = dt == AMPC_F32 ? 4 : 8;
    return g->kind == AMPC_CU_POOL_MAX && g->cl && g->C % V == 0 && n < ((int64_t)1 << 31) && al16(a) && al16(b) &&
           (!arg || al16(arg)) && g->kernel[0] >= 1 && g->kernel[1] >= 1;
}

mp_geom mp_of(const ampc_cu_pool_geom *g) {
    mp_geom m = {(int)g->C, (int)g->H, (int)g->W, (int)g->OH, (int)g->OW, g->kernel[0], g->kernel[1], g->stride[0], g->stride[1],
                 g->pad_begin[0], g->pad_begin[1]};
    return m;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

extern "C" cudaError_t ampc_cu_pool_fwd(const ampc_cu_pool_geom *g, ampc_dtype dt, const void *x, void *y, int32_t *argmax,
                                        cudaStream_t s) {
    int64_t total = g->N * g->C * g->OH * g->OW;
    if (total <= 0) return cudaSuccess;
    int64_t xn = g->N * g->C * g->H * g->W;
    if (mp_vec(g, dt, total > xn ? total : xn, x, y, argmax)) {
        mp_geom m = mp_of(g);
        AMPC_CU_FLOAT_TYPES(dt, T,
                            unsigned nv = (unsigned)(total / vec_of<T>::V);
                            maxpool_fwd_vec<T><<<blocks_for(nv), 256, 0, s>>>(m, nv, (const T *)x, (T *)y, argmax));
        return cudaGetLastError();
    }
    AMPC_CU_FLOAT_TYPES(dt, T,
                        AMPC_CU_INDEX(total > xn ? total : xn, I,
                                      pool_fwd_kernel<T, I><<<blocks_for(total), 256, 0, s>>>(*g, (const T *)x, (T *)y, argmax,
                                                                                              (I)total)));
    return cudaGetLastError();
}

extern "C" cudaError_t ampc_cu_pool_bwd(const ampc_cu_pool_geom *g, ampc_dtype dt, const void *gy, void *gx,
                                        const int32_t *argmax, cudaStream_t s) {
    int64_t total = g->N * g->C * g->H * g->W;
    if (total <= 0) return cudaSuccess;
    int64_t yn = g->N * g->C * g->OH * g->OW;
    if (yn > 0 && argmax && mp_vec(g, dt, total > yn ? total : yn, gy, gx, argmax)) {
        mp_geom m = mp_of(g);
        AMPC_CU_FLOAT_TYPES(dt, T,
                            unsigned nv = (unsigned)(total / vec_of<T>::V);
                            maxpool_bwd_vec<T><<<blocks_for(nv), 256, 0, s>>>(m, nv, (const T *)gy, (T *)gx, argmax));
        return cudaGetLastError();
    }
    AMPC_CU_FLOAT_TYPES(dt, T,
                        AMPC_CU_INDEX(total, I,
                                      pool_bwd_kernel<T, I><<<blocks_for(total), 256, 0, s>>>(*g, (const T *)gy, (T *)gx, argmax,
                                                                                              (I)total)));
    return cudaGetLastError();
}
