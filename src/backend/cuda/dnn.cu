/*
 * dnn.cu - ampc's own kernels of the CUDA backend's dnn part: 2-D pooling (all kinds, both
 * memory formats), batch norm (with and without the fused ReLU) and convolution's bias add and
 * bias gradient.
 *
 * Pooling: one thread per output (forward) or per input element (backward, which gathers the
 * outputs whose windows hold the element, in output order: no atomics, deterministic, gx fully
 * written). The rules are the REF device's (PyTorch's): max takes a value greater than the
 * running maximum or NaN, the argmax is its index in the (H, W) plane; averages divide by the
 * window's count (include-pad: the part inside [-pad_begin, H + pad_begin)).
 *
 * Per-channel reductions (batch-norm statistics and gradient sums, the bias gradient): a grid
 * of (channel, partition) blocks, each summing its fixed share of a channel in f64 (warp
 * shuffles, then shared memory), partial rows combined per channel in partition order by the
 * next kernel: the results depend only on the shape. Planar (N, C, S) data: a block walks one
 * channel's N runs of S values; channels-last (M, C): a block of 32 channels x 8 rows walks rows.
 * Batch norm is the CPU backend's algorithm: mean, then the centred sum of squares (no
 * E[x^2] - E[x]^2 cancellation), f64 per-channel coefficients applied in f32 with one rounding.
 *
 * Elementwise kernels index in 32 bits when the tensor has fewer than 2^31 elements (64-bit
 * division is slow on the GPU), else in 64.
 */
#include "backend/cuda/common.cuh"
#include "backend/cuda/dnn_kernels.h"

using namespace ampc_cu;

namespace {

#define AMPC_CU_INDEX(total, I, ...)                                                               \
    if ((total) < ((int64_t)1 << 31)) {                                                            \
        typedef uint32_t I;                                                                        \
        __VA_ARGS__;                                                                               \
    } else {                                                                                       \
        typedef int64_t I;                                                                         \
        __VA_ARGS__;                                                                               \
    }

#define GRID_LOOP(I, i, n) for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (I)gridDim.x * blockDim.x)

template <class D> __device__ __forceinline__ D from_d(double v);
template <> __device__ __forceinline__ float from_d<float>(double v) { return (float)v; }
template <> __device__ __forceinline__ __half from_d<__half>(double v) { return __double2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_d<__nv_bfloat16>(double v) { return __double2bfloat16(v); }

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

// ---------------------------------------------------------------------------------------------
// Per-channel reductions

enum { RED_SUM = 0, RED_SQDEV = 1, RED_GRAD = 2 };

/* sum over partitions (in order) of column k of channel c's partial rows */
__device__ __forceinline__ double part_total(const double *part, int P, long long C, long long c, int k) {
    double s = 0;
    for (int p = 0; p < P; p++) s += part[((long long)p * C + c) * 2 + k];
    return s;
}

/* The fused ReLU's stored output is positive: v = fma(x - m, a, b) rounded to T, as the forward. */
template <class T> __device__ __forceinline__ bool relu_pos(float xv, float m, float a, float b) {
    return to_f<T>(from_f<T>(__fmaf_rn(xv - m, a, b))) > 0.0f;
}

/* What one element adds: RED_SUM a += x; RED_SQDEV a += (x - m)^2; RED_GRAD a += g, b += g (x - m)
   with g = gy masked by the fused ReLU when relu. */
template <class T, int MODE>
__device__ __forceinline__ void accum(const T *x, const T *gy, long long idx, double m, bool relu, float rm, float ra, float rb,
                                      double &a, double &b) {
    float xv = to_f<T>(x[idx]);
    if (MODE == RED_SUM) {
        a += (double)xv;
    } else if (MODE == RED_SQDEV) {
        double d = (double)xv - m;
        a += d * d;
    } else {
        float gv = to_f<T>(gy[idx]);
        if (relu && !relu_pos<T>(xv, rm, ra, rb)) gv = 0.0f;
        a += (double)gv;
        b += (double)gv * ((double)xv - m);
    }
}

/* The centre m of a pass: RED_SQDEV the mean from the RED_SUM pass's partial rows (prev);
   RED_GRAD the saved mean. */
template <int MODE>
__device__ __forceinline__ double centre(const double *prev, const float *mean_f, int P, long long C, long long c, long long M) {
    if (MODE == RED_SQDEV) return part_total(prev, P, C, c, 0) / (double)M;
    if (MODE == RED_GRAD) return (double)mean_f[c];
    return 0.0;
}

__device__ __forceinline__ double warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

/* Planar (N, C, S): block (c, p) of 256 threads sums elements [p * chunk, (p + 1) * chunk) of
   channel c's M = N * S (run n, offset s), writing out[(p * C + c) * 2 + {0, 1}]. */
template <class T, int MODE>
__global__ void __launch_bounds__(256) reduce_planar(ampc_cu_chan_geom g, const T *x, const T *gy, const double *prev,
                                                     const float *mean_f, const float *rc, double *out, int P) {
    const long long C = g.C, S = g.S, M = g.N * g.S, c = blockIdx.x;
    const int p = blockIdx.y;
    const long long chunk = (M + P - 1) / P, j1 = min(M, ((long long)p + 1) * chunk);
    const double m = centre<MODE>(prev, mean_f, P, C, c, M);
    const bool relu = MODE == RED_GRAD && rc;
    const float rm = relu ? rc[c] : 0.0f, ra = relu ? rc[C + c] : 0.0f, rb = relu ? rc[2 * C + c] : 0.0f;
    double a = 0, b = 0;
    long long j = (long long)p * chunk + threadIdx.x;
    if (j < j1) {
        long long n = j / S, s = j - n * S;
        const long long dq = blockDim.x / S, dr = blockDim.x - dq * S;
        for (; j < j1; j += blockDim.x) {
            accum<T, MODE>(x, gy, (n * C + c) * S + s, m, relu, rm, ra, rb, a, b);
            s += dr;
            n += dq;
            if (s >= S) s -= S, n++;
        }
    }
    __shared__ double sa[8], sb[8];
    a = warp_sum(a);
    b = warp_sum(b);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sa[warp] = a, sb[warp] = b;
    __syncthreads();
    if (threadIdx.x == 0) {
        double ta = 0, tb = 0;
        for (int k = 0; k < (int)(blockDim.x >> 5); k++) ta += sa[k], tb += sb[k];
        out[((long long)p * C + c) * 2] = ta;
        out[((long long)p * C + c) * 2 + 1] = tb;
    }
}

/* Channels-last (M, C): block (channel tile, p) of 32 x 8 threads; thread (tx, ty) sums rows
   ty, ty + 8, ... of the partition for channel tile * 32 + tx. */
template <class T, int MODE>
__global__ void __launch_bounds__(256) reduce_cl(ampc_cu_chan_geom g, const T *x, const T *gy, const double *prev,
                                                 const float *mean_f, const float *rc, double *out, int P) {
    const long long C = g.C, M = g.N * g.S, c = (long long)blockIdx.x * 32 + threadIdx.x;
    const int p = blockIdx.y;
    const long long chunk = (M + P - 1) / P, r1 = min(M, ((long long)p + 1) * chunk);
    double a = 0, b = 0;
    if (c < C) {
        const double m = centre<MODE>(prev, mean_f, P, C, c, M);
        const bool relu = MODE == RED_GRAD && rc;
        const float rm = relu ? rc[c] : 0.0f, ra = relu ? rc[C + c] : 0.0f, rb = relu ? rc[2 * C + c] : 0.0f;
        for (long long r = (long long)p * chunk + threadIdx.y; r < r1; r += 8)
            accum<T, MODE>(x, gy, r * C + c, m, relu, rm, ra, rb, a, b);
    }
    __shared__ double sa[8][32], sb[8][32];
    sa[threadIdx.y][threadIdx.x] = a;
    sb[threadIdx.y][threadIdx.x] = b;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        double ta = 0, tb = 0;
        for (int k = 0; k < 8; k++) ta += sa[k][threadIdx.x], tb += sb[k][threadIdx.x];
        out[((long long)p * C + c) * 2] = ta;
        out[((long long)p * C + c) * 2 + 1] = tb;
    }
}

/* One reduction pass of mode MODE over the channels into out (2 * P * C doubles). */
template <class T, int MODE>
void launch_reduce(const ampc_cu_chan_geom &g, const T *x, const T *gy, const double *prev, const float *mean_f, const float *rc,
                   double *out, int P, cudaStream_t s) {
    if (g.cl)
        reduce_cl<T, MODE><<<dim3((unsigned)((g.C + 31) / 32), (unsigned)P), dim3(32, 8), 0, s>>>(g, x, gy, prev, mean_f, rc, out, P);
    else
        reduce_planar<T, MODE><<<dim3((unsigned)g.C, (unsigned)P), 256, 0, s>>>(g, x, gy, prev, mean_f, rc, out, P);
}

template <class D> __global__ void chan_total_kernel(long long C, const double *part, int P, D *out) {
    GRID_LOOP(long long, c, C) out[c] = from_d<D>(part_total(part, P, C, c, 0));
}

/* channel of storage index i */
template <class I> __device__ __forceinline__ I chan_of(I i, I C, I S, bool cl) { return cl ? i % C : (i / S) % C; }

template <class T, class I> __global__ void bias_add_kernel(I total, I C, I S, bool cl, T *y, const T *b) {
    GRID_LOOP(I, i, total) y[i] = from_f<T>(to_f<T>(y[i]) + to_f<T>(b[chan_of<I>(i, C, S, cl)]));
}

// ---------------------------------------------------------------------------------------------
// Batch norm

__device__ __forceinline__ double nan_d() { return __longlong_as_double(0x7ff8000000000000LL); }

/* Per channel: statistics (batch or running), running-stat update, saved stats and the f32
   coefficients (the CPU's bn_finish_channel). */
__global__ void bn_finish_fwd(long long C, long long M, ampc_cu_bn_fwd_args a) {
    GRID_LOOP(long long, c, C) {
        double mean, var;
        if (a.training) {
            mean = part_total(a.part, a.P, C, c, 0) / (double)M;
            double q = part_total(a.part + 2 * (long long)a.P * C, a.P, C, c, 0);
            var = q / (double)M;
            double unbiased = M > 1 ? q / (double)(M - 1) : nan_d();   /* the op refuses M == 1 */
            if (a.rm) a.rm[c] = (float)((1 - a.momentum) * (double)a.rm[c] + a.momentum * mean);
            if (a.rv) a.rv[c] = (float)((1 - a.momentum) * (double)a.rv[c] + a.momentum * unbiased);
        } else {
            mean = a.rm[c];
            var = a.rv[c];
        }
        double invstd = 1 / sqrt(var + a.eps), w = a.w ? a.w[c] : 1.0, b = a.b ? a.b[c] : 0.0;
        if (a.save_mean) a.save_mean[c] = (float)mean;
        if (a.save_invstd) a.save_invstd[c] = (float)invstd;
        /* the mean as a float plus a remainder folded into the shift */
        float m = (float)mean;
        a.coef[c] = m;
        a.coef[C + c] = (float)(invstd * w);
        a.coef[2 * C + c] = (float)(b - (mean - (double)m) * invstd * w);
    }
}

/* y = fma(x - m, scale, shift) rounded once; with relu a value that rounds below zero becomes +0
   (-0 and NaN stay, as relu of the stored output) */
template <class T, class I>
__global__ void bn_apply_kernel(I total, I C, I S, bool cl, const T *x, T *y, const float *coef, bool relu) {
    GRID_LOOP(I, i, total) {
        I c = chan_of<I>(i, C, S, cl);
        T o = from_f<T>(__fmaf_rn(to_f<T>(x[i]) - coef[c], coef[C + c], coef[2 * C + c]));
        if (relu && to_f<T>(o) < 0.0f) o = from_f<T>(0.0f);
        y[i] = o;
    }
}

/* Per channel from sg = sum(g), sgx = sum(g (x - mean)) (P == 0: no sums, both 0): gw, gb and
   gx = k g + a (x - mean) + b (the CPU's bn_grad_coefs). */
__global__ void bn_finish_bwd(long long C, long long M, ampc_cu_bn_bwd_args a) {
    GRID_LOOP(long long, c, C) {
        double sg = part_total(a.part, a.P, C, c, 0), sgx = part_total(a.part, a.P, C, c, 1), is = a.invstd[c];
        if (a.gw) a.gw[c] = (float)(sgx * is);
        if (a.gb) a.gb[c] = (float)sg;
        double kk = (a.w ? a.w[c] : 1.0) * is, aa = 0, bb = 0;
        if (a.training) {   /* gx = w invstd (gy - sg/M - xhat sum(gy xhat)/M) */
            aa = -kk * is * is * sgx / (double)M;
            bb = -kk * sg / (double)M;
        }
        a.kab[c] = (float)kk;
        a.kab[C + c] = (float)aa;
        a.kab[2 * C + c] = (float)bb;
    }
}

template <class T, class I>
__global__ void bn_grad_apply_kernel(I total, I C, I S, bool cl, const T *x, const T *gy, T *gx, const float *mean,
                                     const float *kab, const float *rc) {
    GRID_LOOP(I, i, total) {
        I c = chan_of<I>(i, C, S, cl);
        float xv = to_f<T>(x[i]), gv = to_f<T>(gy[i]);
        if (rc && !relu_pos<T>(xv, rc[c], rc[C + c], rc[2 * C + c])) gv = 0.0f;
        gx[i] = from_f<T>(__fmaf_rn(kab[c], gv, __fmaf_rn(kab[C + c], xv - mean[c], kab[2 * C + c])));
    }
}

unsigned chan_blocks(int64_t C) { return blocks_for(C, 128); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

extern "C" cudaError_t ampc_cu_pool_fwd(const ampc_cu_pool_geom *g, ampc_dtype dt, const void *x, void *y, int32_t *argmax,
                                        cudaStream_t s) {
    int64_t total = g->N * g->C * g->OH * g->OW;
    if (total <= 0) return cudaSuccess;
    int64_t xn = g->N * g->C * g->H * g->W;
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
    AMPC_CU_FLOAT_TYPES(dt, T,
                        AMPC_CU_INDEX(total, I,
                                      pool_bwd_kernel<T, I><<<blocks_for(total), 256, 0, s>>>(*g, (const T *)gy, (T *)gx, argmax,
                                                                                              (I)total)));
    return cudaGetLastError();
}

extern "C" int ampc_cu_chan_parts(const ampc_cu_chan_geom *g, int sm_count) {
    int64_t M = g->N * g->S, target = 8 * (int64_t)(sm_count > 0 ? sm_count : 1);
    if (M <= 0 || g->C <= 0) return 1;
    /* blocks per partition row, and the fewest elements (planar) or rows (channels-last) a
       block should get */
    int64_t row = g->cl ? (g->C + 31) / 32 : g->C, least = g->cl ? 64 : 4096;
    int64_t P = (target + row - 1) / row, most = (M + least - 1) / least;
    if (P > most) P = most;
    if (P > 1024) P = 1024;
    return P < 1 ? 1 : (int)P;
}

extern "C" cudaError_t ampc_cu_chan_sum(const ampc_cu_chan_geom *g, ampc_dtype dt, const void *x, double *part, int P, void *out,
                                        ampc_dtype out_dt, cudaStream_t s) {
    if (g->C <= 0) return cudaSuccess;
    if (g->N * g->S <= 0) {
        P = 0;   /* empty: the totals are 0 */
    } else {
        AMPC_CU_FLOAT_TYPES(dt, T, launch_reduce<T, RED_SUM>(*g, (const T *)x, nullptr, nullptr, nullptr, nullptr, part, P, s));
    }
    AMPC_CU_FLOAT_TYPES(out_dt, D, chan_total_kernel<D><<<chan_blocks(g->C), 128, 0, s>>>(g->C, part, P, (D *)out));
    return cudaGetLastError();
}

extern "C" cudaError_t ampc_cu_bias_add(const ampc_cu_chan_geom *g, ampc_dtype dt, void *y, const void *b, cudaStream_t s) {
    int64_t total = g->N * g->C * g->S;
    if (total <= 0) return cudaSuccess;
    AMPC_CU_FLOAT_TYPES(dt, T,
                        AMPC_CU_INDEX(total, I,
                                      bias_add_kernel<T, I><<<blocks_for(total), 256, 0, s>>>((I)total, (I)g->C, (I)g->S, g->cl,
                                                                                              (T *)y, (const T *)b)));
    return cudaGetLastError();
}

extern "C" cudaError_t ampc_cu_bn_forward(const ampc_cu_chan_geom *g, ampc_dtype dt, const void *x, void *y,
                                          const ampc_cu_bn_fwd_args *a, cudaStream_t s) {
    int64_t total = g->N * g->C * g->S, M = g->N * g->S;
    if (g->C <= 0) return cudaSuccess;
    if (a->training) {
        if (M <= 0) return cudaErrorInvalidValue;
        double *p1 = a->part, *p2 = a->part + 2 * (int64_t)a->P * g->C;
        AMPC_CU_FLOAT_TYPES(dt, T, launch_reduce<T, RED_SUM>(*g, (const T *)x, nullptr, nullptr, nullptr, nullptr, p1, a->P, s);
                            launch_reduce<T, RED_SQDEV>(*g, (const T *)x, nullptr, p1, nullptr, nullptr, p2, a->P, s));
    }
    bn_finish_fwd<<<chan_blocks(g->C), 128, 0, s>>>(g->C, M, *a);
    if (total > 0)
        AMPC_CU_FLOAT_TYPES(dt, T,
                            AMPC_CU_INDEX(total, I,
                                          bn_apply_kernel<T, I><<<blocks_for(total), 256, 0, s>>>(
                                              (I)total, (I)g->C, (I)g->S, g->cl, (const T *)x, (T *)y, a->coef, a->relu)));
    return cudaGetLastError();
}

extern "C" cudaError_t ampc_cu_bn_backward(const ampc_cu_chan_geom *g, ampc_dtype dt, const void *x, const void *gy, void *gx,
                                           const ampc_cu_bn_bwd_args *a, cudaStream_t s) {
    int64_t total = g->N * g->C * g->S, M = g->N * g->S;
    if (g->C <= 0) return cudaSuccess;
    ampc_cu_bn_bwd_args b = *a;
    bool sums = a->gw || a->gb || (gx && a->training);
    if (sums && M > 0) {
        AMPC_CU_FLOAT_TYPES(dt, T,
                            launch_reduce<T, RED_GRAD>(*g, (const T *)x, (const T *)gy, nullptr, a->mean, a->rc, a->part, a->P, s));
    } else {
        b.P = 0;   /* no sums: both 0 */
    }
    bn_finish_bwd<<<chan_blocks(g->C), 128, 0, s>>>(g->C, M, b);
    if (gx && total > 0)
        AMPC_CU_FLOAT_TYPES(dt, T,
                            AMPC_CU_INDEX(total, I,
                                          bn_grad_apply_kernel<T, I><<<blocks_for(total), 256, 0, s>>>(
                                              (I)total, (I)g->C, (I)g->S, g->cl, (const T *)x, (const T *)gy, (T *)gx, a->mean,
                                              a->kab, a->rc)));
    return cudaGetLastError();
}
