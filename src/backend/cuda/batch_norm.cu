/*
 * batch_norm.cu - ampc's own CUDA kernels of batch norm (with and without the fused ReLU, and
 * the fused residual add + ReLU) and the per-channel reductions they are built on, which
 * convolution's bias add and bias gradient use too (conv.c).
 *
 * Per-channel reductions (batch-norm statistics and gradient sums, the bias gradient): a grid
 * of (channel, partition) blocks, each summing its fixed share of a channel in f64 (warp
 * shuffles, then shared memory), partial rows combined per channel in partition order by the
 * next kernel: the results depend only on the shape. Planar (N, C, S) data: a block walks one
 * channel's N runs of S values; channels-last (M, C): a block of 32 channels x 8 rows walks rows.
 * Batch norm is the CPU backend's algorithm: mean, then the centred sum of squares (no
 * E[x^2] - E[x]^2 cancellation), f64 per-channel coefficients applied in f32 with one rounding.
 *
 * Channels-last data whose C is a multiple of a 16-byte vector (8 halves, 4 floats), with
 * 16-byte aligned arrays, takes faster kernels of the same results' rules (the layout of the
 * ResNets under AMP): every thread moves whole vectors; batch norm's statistics are one pass of
 * f64 sums about each channel's first value (K): mean = K + S/M, centred sum of squares Q - S^2/M,
 * which loses at most log2(M + 1) bits of f64 because (K - mean)^2 <= M var; the partial rows are
 * summed by a warp per channel in a fixed order; the elementwise passes keep each thread's
 * channel coefficients in registers and stream rows. On an H100 (resnet50 batch 256 amp-fp16,
 * one step under Nsight Compute) batch norm went from 42.3 to 18.5 ms (bench/NOTES.md).
 */
#include "backend/cuda/batch_norm_kernels.h"
#include "backend/cuda/vec.cuh"

using namespace ampc_cu;

namespace {

template <class D> __device__ __forceinline__ D from_d(double v);
template <> __device__ __forceinline__ float from_d<float>(double v) { return (float)v; }
template <> __device__ __forceinline__ __half from_d<__half>(double v) { return __double2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_d<__nv_bfloat16>(double v) { return __double2bfloat16(v); }

// ---------------------------------------------------------------------------------------------
// Per-channel reductions

enum { RED_SUM = 0, RED_SQDEV = 1, RED_GRAD = 2, RED_GRADM = 3 };   /* RED_GRADM: reduce_vec only */

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

/* channel of storage index i */
template <class I> __device__ __forceinline__ I chan_of(I i, I C, I S, bool cl) { return cl ? i % C : (i / S) % C; }

template <class T, class I> __global__ void bias_add_kernel(I total, I C, I S, bool cl, T *y, const T *b) {
    GRID_LOOP(I, i, total) y[i] = from_f<T>(to_f<T>(y[i]) + to_f<T>(b[chan_of<I>(i, C, S, cl)]));
}

// ---------------------------------------------------------------------------------------------
// Batch norm

__device__ __forceinline__ double nan_d() { return __longlong_as_double(0x7ff8000000000000LL); }

/* A warp per channel (blocks of 256 threads: 8 channels): *c, and the totals over the P partial
   rows of part's two columns, lane l adding rows l, l + 32, ... in order, then a fixed shuffle
   tree (deterministic). True in lane 0 of a warp whose channel exists. */
__device__ __forceinline__ bool warp_parts(const double *part, int P, long long C, long long *c, double *a, double *b) {
    *c = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (*c >= C) return false;   /* whole warps leave together */
    double ta = 0, tb = 0;
    for (int p = lane; p < P; p += 32) ta += part[((long long)p * C + *c) * 2], tb += part[((long long)p * C + *c) * 2 + 1];
    ta = warp_sum(ta);
    tb = warp_sum(tb);
    *a = ta, *b = tb;
    return lane == 0;
}

/* Channel c's running-stat update (training), saved stats and the f32 coefficients from its
   statistics (the CPU's bn_finish_channel). */
__device__ __forceinline__ void bn_set_channel(long long C, long long c, double mean, double var, double unbiased,
                                               const ampc_cu_bn_fwd_args &a) {
    if (a.training) {
        if (a.rm) a.rm[c] = (float)((1 - a.momentum) * (double)a.rm[c] + a.momentum * mean);
        if (a.rv) a.rv[c] = (float)((1 - a.momentum) * (double)a.rv[c] + a.momentum * unbiased);
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

/* Per channel: statistics (batch: the RED_SUM and RED_SQDEV passes' partial rows; or running),
   then bn_set_channel. */
__global__ void bn_finish_fwd(long long C, long long M, ampc_cu_bn_fwd_args a) {
    GRID_LOOP(long long, c, C) {
        if (a.training) {
            double mean = part_total(a.part, a.P, C, c, 0) / (double)M;
            double q = part_total(a.part + 2 * (long long)a.P * C, a.P, C, c, 0);
            double unbiased = M > 1 ? q / (double)(M - 1) : nan_d();   /* the op refuses M == 1 */
            bn_set_channel(C, c, mean, q / (double)M, unbiased, a);
        } else {
            bn_set_channel(C, c, a.rm[c], a.rv[c], 0, a);
        }
    }
}

/* The same from the one-pass shifted sums of the channels-last path (reduce_vec's partial rows,
   summed by warp_parts: S = sum(x - K), Q = sum((x - K)^2) with K = x[0, c], the channel's first
   value): mean = K + S / M, centred sum of squares Q - S^2 / M. K is one of the values, so
   (K - mean)^2 <= M var: the cancellation costs at most log2(M + 1) of f64's 53 bits. */
template <class T>
__device__ __forceinline__ bool shift_stats(long long C, long long M, const T *x, const double *part, int P, long long *c,
                                            double *mean, double *q) {
    double S, Q;
    if (!warp_parts(part, P, C, c, &S, &Q)) return false;
    double K = (double)to_f<T>(x[*c]);
    *q = Q - S * (S / (double)M);
    if (*q < 0) *q = 0;
    *mean = K + S / (double)M;
    return true;
}

template <class T> __global__ void bn_finish_fwd_shift(long long C, long long M, const T *x, ampc_cu_bn_fwd_args a) {
    double mean, q;
    long long c;
    if (!shift_stats<T>(C, M, x, a.part, a.P, &c, &mean, &q)) return;
    double unbiased = M > 1 ? q / (double)(M - 1) : nan_d();
    bn_set_channel(C, c, mean, q / (double)M, unbiased, a);
}

/* SyncBatchNorm: this process's statistics in ampc__bn_sync_stats's layout (st[c] the mean,
   st[C + 1 + c] the centred sum of squares; st[C], the count, is the host's), from the same
   passes as bn_finish_fwd (planar; M 0: zeros) or bn_finish_fwd_shift (channels-last vectors). */
__global__ void bn_stats_planar(long long C, long long M, const double *part, int P, double *st) {
    GRID_LOOP(long long, c, C) {
        st[c] = M > 0 ? part_total(part, P, C, c, 0) / (double)M : 0.0;
        st[C + 1 + c] = M > 0 ? part_total(part + 2 * (long long)P * C, P, C, c, 0) : 0.0;
    }
}

template <class T> __global__ void bn_stats_shift(long long C, long long M, const T *x, const double *part, int P, double *st) {
    double mean, q;
    long long c;
    if (!shift_stats<T>(C, M, x, part, P, &c, &mean, &q)) return;
    st[c] = mean;
    st[C + 1 + c] = q;
}

/* The world's statistics (st after the exchange, the count in st[C]) -> bn_set_channel */
__global__ void bn_finish_fwd_world(long long C, const double *st, ampc_cu_bn_fwd_args a) {
    const double M = st[C];
    GRID_LOOP(long long, c, C) {
        double q = st[C + 1 + c] > 0 ? st[C + 1 + c] : 0.0;
        bn_set_channel(C, c, st[c], q / M, M > 1 ? q / (M - 1) : nan_d(), a);
    }
}


/* y = fma(x - m, scale, shift) rounded once; with relu a value that rounds below zero becomes +0
   (-0 and NaN stay, as relu of the stored output) */
template <class T, class I>
__global__ void bn_apply_kernel(I total, I C, I S, bool cl, const T *x, T *y, const float *coef, bool relu, const T *z) {
    GRID_LOOP(I, i, total) {
        I c = chan_of<I>(i, C, S, cl);
        T o = from_f<T>(__fmaf_rn(to_f<T>(x[i]) - coef[c], coef[C + c], coef[2 * C + c]));
        if (z) o = from_f<T>(to_f<T>(o) + to_f<T>(z[i]));   /* the residual add, rounded once */
        if (relu && to_f<T>(o) < 0.0f) o = from_f<T>(0.0f);
        y[i] = o;
    }
}

/* gz = gy where y > 0, else +0 (relu's backward on its output) */
template <class T, class I> __global__ void relu_mask_kernel(I total, const T *y, const T *gy, T *gz) {
    GRID_LOOP(I, i, total) gz[i] = to_f<T>(y[i]) > 0.0f ? gy[i] : from_f<T>(0.0f);
}

/* Per channel from sg = sum(g), sgx = sum(g (x - mean)) (P == 0: no sums, both 0): gw, gb and
   gx = k g + a (x - mean) + b (the CPU's bn_grad_coefs). */
__device__ __forceinline__ void bn_bwd_channel(long long C, long long M, long long c, double sg, double sgx,
                                               const ampc_cu_bn_bwd_args &a) {
    double is = a.invstd[c];
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

__global__ void bn_finish_bwd(long long C, long long M, ampc_cu_bn_bwd_args a) {
    GRID_LOOP(long long, c, C) bn_bwd_channel(C, M, c, part_total(a.part, a.P, C, c, 0), part_total(a.part, a.P, C, c, 1), a);
}

/* out[c] = channel c's total of the first column over the P partial rows (P 0: 0), in D; a warp
   per channel (warp_parts) */
template <class D> __global__ void chan_total_warp(long long C, const double *part, int P, D *out) {
    double a, b;
    long long c;
    if (warp_parts(part, P, C, &c, &a, &b)) out[c] = from_d<D>(a);
}

/* bn_finish_bwd with a warp per channel summing the P partial rows (a.P 0: no sums) */
__global__ void bn_finish_bwd_warp(long long C, long long M, ampc_cu_bn_bwd_args a) {
    double sg, sgx;
    long long c;
    if (!warp_parts(a.part, a.P, C, &c, &sg, &sgx)) return;
    bn_bwd_channel(C, M, c, sg, sgx, a);
}

/* SyncBatchNorm: bn_finish_bwd and bn_finish_bwd_warp that also keep this process's sums for
   the exchange (a.sums_out: sum(g) in [0, C), sum(g (x - mean)) in [C, 2 C)) */
__device__ __forceinline__ void bn_bwd_local(long long C, long long M, long long c, double sg, double sgx,
                                             const ampc_cu_bn_bwd_args &a) {
    bn_bwd_channel(C, M, c, sg, sgx, a);
    a.sums_out[c] = sg;
    a.sums_out[C + c] = sgx;
}

__global__ void bn_sums_out(long long C, long long M, ampc_cu_bn_bwd_args a) {
    GRID_LOOP(long long, c, C) bn_bwd_local(C, M, c, part_total(a.part, a.P, C, c, 0), part_total(a.part, a.P, C, c, 1), a);
}

__global__ void bn_sums_out_warp(long long C, long long M, ampc_cu_bn_bwd_args a) {
    double sg, sgx;
    long long c;
    if (warp_parts(a.part, a.P, C, &c, &sg, &sgx)) bn_bwd_local(C, M, c, sg, sgx, a);
}

/* The coefficients of gx from the world's sums (the count in sums[2 C]); a.gw, a.gb NULL */
__global__ void bn_finish_bwd_world(long long C, const double *sums, ampc_cu_bn_bwd_args a) {
    const long long M = (long long)sums[2 * C];
    GRID_LOOP(long long, c, C) bn_bwd_channel(C, M, c, sums[c], sums[C + c], a);
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

// ---------------------------------------------------------------------------------------------
// Channels-last fast paths: each thread moves 16-byte vectors of V = 16 / sizeof(T) channels
// (C a multiple of V, every array 16-byte aligned, fewer than 2^31 rows and vectors)

/* Partial sums of channels-last x (M, C) (and gy): block (TX * TY threads; grid (ceil(CV / TX),
   P)) sums rows [p * chunk, (p + 1) * chunk) for the channel vectors blockIdx.x * TX + tx, thread
   (tx, ty) walking rows ty, ty + TY, ... four at a time (eight loads in flight for RED_GRAD),
   accumulating in f64 per element; the block's threads then add their rows in ty order: out[(p
   * C + c) * 2 + {0, 1}] depends only on the shape. RED_SUM here is the one-pass shifted pass:
   a = sum(x - K), b = sum((x - K)^2) with K = x[0, c]. RED_GRAD: a = sum(g), b = sum(g (x -
   mean)), g masked by the fused ReLU's recomputed output when rc. */
template <class T, int MODE>
__global__ void __launch_bounds__(256) reduce_vec(int M, int C, int TX, int TY, const T *x, const T *gy, const float *mean_f,
                                                  const float *rc, double *out, const T *ym, T *gz) {
    constexpr int V = vec_of<T>::V;
    constexpr bool GRAD = MODE == RED_GRAD || MODE == RED_GRADM;
    const int CV = C / V, tx = threadIdx.x % TX, ty = threadIdx.x / TX, cv = blockIdx.x * TX + tx, p = blockIdx.y;
    const int chunk = (int)(((long long)M + gridDim.y - 1) / gridDim.y);
    const int r1 = (int)min((long long)M, ((long long)p + 1) * chunk);
    double a[V], b[V];
#pragma unroll
    for (int l = 0; l < V; l++) a[l] = 0, b[l] = 0;
    if (ty < TY && cv < CV) {
        const int c0 = cv * V;
        double m[V];
        float rm[V], ra[V], rb[V];
        const bool relu = MODE == RED_GRAD && rc;
        if (MODE == RED_SUM) {
            float k[V];
            unpack<T>(ld16(x + c0), k);
#pragma unroll
            for (int l = 0; l < V; l++) m[l] = k[l];
        } else {
#pragma unroll
            for (int l = 0; l < V; l++) {
                m[l] = mean_f[c0 + l];
                rm[l] = relu ? rc[c0 + l] : 0.0f;
                ra[l] = relu ? rc[C + c0 + l] : 0.0f;
                rb[l] = relu ? rc[2 * C + c0 + l] : 0.0f;
            }
        }
        /* RED_GRADM: g = gy where the output ym > 0, else +0, written to gz */
        auto add = [&](const uint4 &ux, const uint4 &ug, const uint4 &uy, long long o) {
            float xv[V];
            unpack<T>(ux, xv);
            if (MODE == RED_SUM) {
#pragma unroll
                for (int l = 0; l < V; l++) {
                    double d = (double)xv[l] - m[l];
                    a[l] += d;
                    b[l] = fma(d, d, b[l]);
                }
            } else {
                float gv[V], yv[V];
                unpack<T>(ug, gv);
                if (MODE == RED_GRADM) unpack<T>(uy, yv);
#pragma unroll
                for (int l = 0; l < V; l++) {
                    float g = gv[l];
                    if (relu && !relu_pos<T>(xv[l], rm[l], ra[l], rb[l])) g = 0.0f;
                    if (MODE == RED_GRADM && !(yv[l] > 0.0f)) g = 0.0f;
                    gv[l] = g;
                    a[l] += (double)g;
                    b[l] = fma((double)g, (double)xv[l] - m[l], b[l]);
                }
                if (MODE == RED_GRADM) *reinterpret_cast<uint4 *>(gz + o) = pack<T>(gv);
            }
        };
        int r = (int)min((long long)M, (long long)p * chunk) + ty;
        for (; r + 3 * TY < r1; r += 4 * TY) {
            uint4 ux[4], ug[4], uy[4];
            long long o[4];
#pragma unroll
            for (int q = 0; q < 4; q++) {
                o[q] = (long long)(r + q * TY) * C + c0;
                ux[q] = ld16(x + o[q]);
                ug[q] = GRAD ? ld16(gy + o[q]) : ux[q];
                uy[q] = MODE == RED_GRADM ? ld16(ym + o[q]) : ux[q];
            }
#pragma unroll
            for (int q = 0; q < 4; q++) add(ux[q], ug[q], uy[q], o[q]);
        }
        for (; r < r1; r += TY) {
            long long o = (long long)r * C + c0;
            uint4 ux = ld16(x + o), ug = GRAD ? ld16(gy + o) : ux, uy = MODE == RED_GRADM ? ld16(ym + o) : ux;
            add(ux, ug, uy, o);
        }
    }
    __shared__ double sa[256 * 8], sb[256 * 8];
#pragma unroll
    for (int l = 0; l < V; l++) sa[threadIdx.x * V + l] = a[l], sb[threadIdx.x * V + l] = b[l];
    __syncthreads();
    const int width = TX * V;   /* channels of the block: sa[(ty * TX + tx) * V + l] = sa[ty * width + j] */
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        long long c = (long long)blockIdx.x * width + j;
        if (c >= C) break;
        double ta = 0, tb = 0;
        for (int k = 0; k < TY; k++) ta += sa[k * width + j], tb += sb[k * width + j];
        out[((long long)p * C + c) * 2] = ta;
        out[((long long)p * C + c) * 2 + 1] = tb;
    }
}

/* The elementwise passes of channels-last batch norm: block (TX * TY threads, grid (ceil(CV /
   TX), gy)) as reduce_vec; thread (tx, ty) keeps its V channels' coefficients in registers and
   streams rows ty + TY * blockIdx.y, then every TY * gy rows, four loads (per input) in flight. */
template <bool TWO, class T, class F>
__device__ __forceinline__ void stream_rows(long long M, int C, int c0, int TY, int ty, const T *x, const T *gy, F body) {
    const long long step = (long long)TY * gridDim.y;
    long long r = (long long)blockIdx.y * TY + ty;
    for (; r + 3 * step < M; r += 4 * step) {
        uint4 ux[4], ug[4];
        long long o[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            o[q] = (r + q * step) * C + c0;
            ux[q] = ld16(x + o[q]);
            ug[q] = TWO ? ld16(gy + o[q]) : ux[q];
        }
#pragma unroll
        for (int q = 0; q < 4; q++) body(ux[q], ug[q], o[q]);
    }
    for (; r < M; r += step) {
        long long o = r * C + c0;
        uint4 ux = ld16(x + o), ug = TWO ? ld16(gy + o) : ux;
        body(ux, ug, o);
    }
}

/* y = fma(x - m, scale, shift) per element as bn_apply_kernel (z: plus the residual z) */
template <class T>
__global__ void __launch_bounds__(256) bn_apply_rows(int M, int C, int TX, int TY, const T *x, T *y, const float *coef, bool relu,
                                                     const T *z) {
    constexpr int V = vec_of<T>::V;
    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX, cv = blockIdx.x * TX + tx;
    if (ty >= TY || cv >= C / V) return;
    const int c0 = cv * V;
    float m[V], sc[V], sh[V];
#pragma unroll
    for (int l = 0; l < V; l++) m[l] = coef[c0 + l], sc[l] = coef[C + c0 + l], sh[l] = coef[2 * C + c0 + l];
    auto body = [&](const uint4 &ux, const uint4 &uz, long long o, bool add) {
        float f[V], fz[V];
        unpack<T>(ux, f);
        if (add) unpack<T>(uz, fz);
#pragma unroll
        for (int l = 0; l < V; l++) {
            float v = to_f<T>(from_f<T>(__fmaf_rn(f[l] - m[l], sc[l], sh[l])));
            if (add) v = to_f<T>(from_f<T>(v + fz[l]));
            f[l] = relu && v < 0.0f ? 0.0f : v;
        }
        *reinterpret_cast<uint4 *>(y + o) = pack<T>(f);
    };
    if (z)
        stream_rows<true>(M, C, c0, TY, ty, x, z, [&](const uint4 &ux, const uint4 &uz, long long o) { body(ux, uz, o, true); });
    else
        stream_rows<false>(M, C, c0, TY, ty, x, x, [&](const uint4 &ux, const uint4 &uz, long long o) { body(ux, uz, o, false); });
}

/* gx = fma(k, g, fma(a, x - mean, b)) per element as bn_grad_apply_kernel */
template <class T>
__global__ void __launch_bounds__(256) bn_grad_apply_rows(int M, int C, int TX, int TY, const T *x, const T *gy, T *gx,
                                                          const float *mean, const float *kab, const float *rc) {
    constexpr int V = vec_of<T>::V;
    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX, cv = blockIdx.x * TX + tx;
    if (ty >= TY || cv >= C / V) return;
    const int c0 = cv * V;
    float mn[V], k[V], a[V], b[V], rm[V], ra[V], rb[V];
#pragma unroll
    for (int l = 0; l < V; l++) {
        mn[l] = mean[c0 + l], k[l] = kab[c0 + l], a[l] = kab[C + c0 + l], b[l] = kab[2 * C + c0 + l];
        rm[l] = rc ? rc[c0 + l] : 0.0f, ra[l] = rc ? rc[C + c0 + l] : 0.0f, rb[l] = rc ? rc[2 * C + c0 + l] : 0.0f;
    }
    stream_rows<true>(M, C, c0, TY, ty, x, gy, [&](const uint4 &ux, const uint4 &ug, long long o) {
        float xv[V], gv[V];
        unpack<T>(ux, xv);
        unpack<T>(ug, gv);
#pragma unroll
        for (int l = 0; l < V; l++) {
            float g = gv[l];
            if (rc && !relu_pos<T>(xv[l], rm[l], ra[l], rb[l])) g = 0.0f;
            gv[l] = __fmaf_rn(k[l], g, __fmaf_rn(a[l], xv[l] - mn[l], b[l]));
        }
        *reinterpret_cast<uint4 *>(gx + o) = pack<T>(gv);
    });
}

unsigned chan_blocks(int64_t C) { return blocks_for(C, 128); }

/* Whether channels-last data of M rows of C channels in dt takes the vector kernels. */
bool vec_ok(const ampc_cu_chan_geom *g, ampc_dtype dt) {
    int V = dt == AMPC_F32 ? 4 : 8;
    return g->cl && g->C % V == 0 && g->N * g->S < ((int64_t)1 << 31) && g->C < ((int64_t)1 << 31) && g->N * g->S > 0;
}

/* Launch shape of reduce_vec: TX channel vectors x TY rows per block, grid (gx, P'), P' <= P
   (the scratch's partitions) and at least four rows per thread. */
struct vec_launch {
    int TX, TY, gx, P;
};
vec_launch vec_shape(const ampc_cu_chan_geom *g, ampc_dtype dt, int P) {
    int V = dt == AMPC_F32 ? 4 : 8, CV = (int)(g->C / V);
    vec_launch l;
    l.TX = CV < 32 ? CV : 32;
    l.TY = 256 / l.TX;
    l.gx = (CV + l.TX - 1) / l.TX;
    int64_t most = (g->N * g->S + 4 * l.TY - 1) / (4 * l.TY);
    l.P = (int)(most < P ? most : P);
    if (l.P < 1) l.P = 1;
    return l;
}

template <class T, int MODE>
void launch_reduce_vec(const ampc_cu_chan_geom *g, const vec_launch &l, const T *x, const T *gy, const float *mean_f,
                       const float *rc, double *out, cudaStream_t s, const T *ym = nullptr, T *gz = nullptr) {
    reduce_vec<T, MODE><<<dim3((unsigned)l.gx, (unsigned)l.P), l.TX * l.TY, 0, s>>>((int)(g->N * g->S), (int)g->C, l.TX, l.TY, x, gy,
                                                                                  mean_f, rc, out, ym, gz);
}

/* grid of the elementwise row kernels: the reduction's channel blocks, about 8 blocks per
   multiprocessor, at least 4 rows per thread */
dim3 rows_grid(const ampc_cu_chan_geom *g, const vec_launch &l) {
    int64_t want = (8 * (int64_t)ampc__cu_sm_count() + l.gx - 1) / l.gx, most = (g->N * g->S + 4 * l.TY - 1) / (4 * l.TY);
    int64_t gy = want < most ? want : most;
    if (gy < 1) gy = 1;
    if (gy > 65535) gy = 65535;
    return dim3((unsigned)l.gx, (unsigned)gy);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

extern "C" int ampc_cu_chan_parts(const ampc_cu_chan_geom *g, int sm_count) {
    int64_t M = g->N * g->S, target = (g->cl ? 4 : 8) * (int64_t)(sm_count > 0 ? sm_count : 1);
    if (M <= 0 || g->C <= 0) return 1;
    /* blocks per partition row, and the fewest elements (planar) or rows (channels-last) a
       block should get */
    int64_t row = g->cl ? (g->C + 255) / 256 : g->C, least = g->cl ? 64 : 4096;
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
    AMPC_CU_FLOAT_TYPES(out_dt, D, chan_total_warp<D><<<(unsigned)((g->C + 7) / 8), 256, 0, s>>>(g->C, part, P, (D *)out));
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
    const bool vec = vec_ok(g, dt) && al16(x) && al16(y) && (!a->z || al16(a->z));
    const bool pass = a->training && !a->stats_in;   /* this process's statistics pass */
    ampc_cu_bn_fwd_args b = *a;
    vec_launch l = vec ? vec_shape(g, dt, pass ? a->P : 1) : vec_launch{};
    if (pass && vec) {
        b.P = l.P;
        AMPC_CU_FLOAT_TYPES(dt, T, launch_reduce_vec<T, RED_SUM>(g, l, (const T *)x, nullptr, nullptr, nullptr, a->part, s));
        if (a->stats_out) {
            AMPC_CU_FLOAT_TYPES(dt, T,
                                bn_stats_shift<T><<<(unsigned)((g->C + 7) / 8), 256, 0, s>>>(g->C, M, (const T *)x, a->part, b.P,
                                                                                            a->stats_out));
        } else {
            AMPC_CU_FLOAT_TYPES(dt, T, bn_finish_fwd_shift<T><<<(unsigned)((g->C + 7) / 8), 256, 0, s>>>(g->C, M, (const T *)x, b));
        }
    } else if (pass) {
        if (M <= 0 && !a->stats_out) return cudaErrorInvalidValue;
        double *p1 = a->part, *p2 = a->part + 2 * (int64_t)a->P * g->C;
        if (M > 0) {
            AMPC_CU_FLOAT_TYPES(dt, T, launch_reduce<T, RED_SUM>(*g, (const T *)x, nullptr, nullptr, nullptr, nullptr, p1, a->P, s);
                                launch_reduce<T, RED_SQDEV>(*g, (const T *)x, nullptr, p1, nullptr, nullptr, p2, a->P, s));
        }
        if (a->stats_out)
            bn_stats_planar<<<chan_blocks(g->C), 128, 0, s>>>(g->C, M, a->part, a->P, a->stats_out);
        else
            bn_finish_fwd<<<chan_blocks(g->C), 128, 0, s>>>(g->C, M, b);
    } else if (a->stats_in) {
        bn_finish_fwd_world<<<chan_blocks(g->C), 128, 0, s>>>(g->C, a->stats_in, b);
    } else {
        bn_finish_fwd<<<chan_blocks(g->C), 128, 0, s>>>(g->C, M, b);   /* evaluation: the running statistics */
    }
    if (a->stats_out && pass) return cudaGetLastError();
    if (vec) {
        dim3 grid = rows_grid(g, l);
        AMPC_CU_FLOAT_TYPES(dt, T,
                            bn_apply_rows<T><<<grid, l.TX * l.TY, 0, s>>>((int)M, (int)g->C, l.TX, l.TY, (const T *)x, (T *)y,
                                                                          a->coef, a->relu, (const T *)a->z));
    } else if (total > 0) {
        AMPC_CU_FLOAT_TYPES(dt, T,
                            AMPC_CU_INDEX(total, I,
                                          bn_apply_kernel<T, I><<<blocks_for(total), 256, 0, s>>>(
                                              (I)total, (I)g->C, (I)g->S, g->cl, (const T *)x, (T *)y, a->coef, a->relu,
                                              (const T *)a->z)));
    }
    return cudaGetLastError();
}

extern "C" cudaError_t ampc_cu_bn_backward(const ampc_cu_chan_geom *g, ampc_dtype dt, const void *x, const void *gy, void *gx,
                                           const ampc_cu_bn_bwd_args *a, cudaStream_t s) {
    int64_t total = g->N * g->C * g->S, M = g->N * g->S;
    if (g->C <= 0) return cudaSuccess;
    ampc_cu_bn_bwd_args b = *a;
    b.P = 0;   /* no sums: both 0 */
    const bool sums = a->gw || a->gb || (gx && a->training) || a->sums_out;
    const bool vec = vec_ok(g, dt) && al16(x) && al16(gy) && (!gx || al16(gx)) && (!a->ymask || (al16(a->ymask) && al16(a->gz)));
    const bool pass = !a->sums_in;   /* this process's pass (sums_in: the first call's did it) */
    vec_launch l = vec ? vec_shape(g, dt, pass && (sums || a->ymask) ? a->P : 1) : vec_launch{};
    if (!pass) {
        if (a->ymask) gy = a->gz;   /* masked by the first call */
        b.gw = b.gb = nullptr;
        bn_finish_bwd_world<<<chan_blocks(g->C), 128, 0, s>>>(g->C, a->sums_in, b);
    } else if (vec) {
        if (a->ymask) {   /* the masked gradient written as it is summed; the rest reads it */
            AMPC_CU_FLOAT_TYPES(dt, T,
                                launch_reduce_vec<T, RED_GRADM>(g, l, (const T *)x, (const T *)gy, a->mean, nullptr, a->part, s,
                                                                (const T *)a->ymask, (T *)a->gz));
            b.P = l.P;
            gy = a->gz;
        } else if (sums) {
            AMPC_CU_FLOAT_TYPES(dt, T,
                                launch_reduce_vec<T, RED_GRAD>(g, l, (const T *)x, (const T *)gy, a->mean, a->rc, a->part, s));
            b.P = l.P;
        }
        if (a->sums_out)
            bn_sums_out_warp<<<(unsigned)((g->C + 7) / 8), 256, 0, s>>>(g->C, M, b);
        else
            bn_finish_bwd_warp<<<(unsigned)((g->C + 7) / 8), 256, 0, s>>>(g->C, M, b);
    } else {
        if (a->ymask && total > 0) {   /* relu's backward first: gz, which the batch norm backward reads */
            AMPC_CU_FLOAT_TYPES(dt, T,
                                AMPC_CU_INDEX(total, I,
                                              relu_mask_kernel<T, I><<<blocks_for(total), 256, 0, s>>>(
                                                  (I)total, (const T *)a->ymask, (const T *)gy, (T *)a->gz)));
            gy = a->gz;
        }
        if (sums && M > 0) {
            AMPC_CU_FLOAT_TYPES(dt, T,
                                launch_reduce<T, RED_GRAD>(*g, (const T *)x, (const T *)gy, nullptr, a->mean, a->rc, a->part, a->P,
                                                           s));
            b.P = a->P;
        }
        if (a->sums_out)
            bn_sums_out<<<chan_blocks(g->C), 128, 0, s>>>(g->C, M, b);
        else
            bn_finish_bwd<<<chan_blocks(g->C), 128, 0, s>>>(g->C, M, b);
    }
    if (a->sums_out || !gx) return cudaGetLastError();
    if (vec) {
        dim3 grid = rows_grid(g, l);
        AMPC_CU_FLOAT_TYPES(dt, T,
                            bn_grad_apply_rows<T><<<grid, l.TX * l.TY, 0, s>>>((int)M, (int)g->C, l.TX, l.TY, (const T *)x,
                                                                               (const T *)gy, (T *)gx, a->mean, b.kab, a->rc));
    } else if (total > 0) {
        AMPC_CU_FLOAT_TYPES(dt, T,
                            AMPC_CU_INDEX(total, I,
                                          bn_grad_apply_kernel<T, I><<<blocks_for(total), 256, 0, s>>>(
                                              (I)total, (I)g->C, (I)g->S, g->cl, (const T *)x, (const T *)gy, (T *)gx, a->mean,
                                              b.kab, a->rc)));
    }
    return cudaGetLastError();
}
