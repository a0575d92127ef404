/*
 * optim.cu - the optimizer steps and the GradScaler's unscale-and-check on the GPU, many
 * tensors per launch. The arithmetic is the CPU's (src/backend/cpu/optim.c, amp.c): the same
 * f32 operations in the same order per element (no FMA contraction: --fmad=false is not
 * global, so each product is rounded explicitly with __fmul_rn / __fadd_rn where the CPU
 * rounds it), so a GPU step gives the CPU's bits.
 */
#include "backend/cuda/common.cuh"
#include "backend/cuda/optim_kernels.h"

using namespace ampc_cu;

#define OPT_THREADS 256
#define OPT_ELEMS 4096   /* elements per block */

/* Which job and offset block b handles: blocks are numbered job after job. */
__device__ static int job_of(const ampc_cu_optim_jobs &J, int64_t b, int64_t *base) {
    int64_t first = 0;
    for (int j = 0; j < J.n; j++) {
        int64_t nb = (J.job[j].n + OPT_ELEMS - 1) / OPT_ELEMS;
        if (b < first + nb) {
            *base = (b - first) * OPT_ELEMS;
            return j;
        }
        first += nb;
    }
    return -1;
}

static int64_t total_blocks(const int64_t *n, int count) {
    int64_t t = 0;
    for (int j = 0; j < count; j++) t += (n[j] + OPT_ELEMS - 1) / OPT_ELEMS;
    return t;
}

__device__ __forceinline__ void store_copy(void *out, int dt, int64_t i, float v) {
    if (dt == AMPC_BF16) ((__nv_bfloat16 *)out)[i] = __float2bfloat16_rn(v);
    else ((__half *)out)[i] = __float2half_rn(v);
}

__global__ void sgd_kernel(const __grid_constant__ ampc_cu_optim_jobs J) {
    int64_t base;
    int j = job_of(J, blockIdx.x, &base);
    if (j < 0) return;
    const ampc_cu_optim_job &jb = J.job[j];
    const ampc_sgd_consts c = jb.c.sgd;
    int64_t end = base + OPT_ELEMS < jb.n ? base + OPT_ELEMS : jb.n;
    bool has_wd = jb.variant & 1, has_m = jb.variant & 2, first = jb.variant & 4, nesterov = jb.variant & 8, scaled = jb.variant & 16;
    for (int64_t i = base + threadIdx.x; i < end; i += blockDim.x) {
        float pi = jb.param[i], d = jb.grad[i];
        if (scaled) jb.grad[i] = d = __fmul_rn(d, c.gs);   /* the unscaled gradient, written back as read */
        if (has_wd) d = __fadd_rn(d, __fmul_rn(c.wd, pi));
        if (has_m) {
            float b = first ? d : __fadd_rn(__fmul_rn(c.m, jb.state[0][i]), __fmul_rn(c.keep, d));
            jb.state[0][i] = b;
            d = nesterov ? __fadd_rn(d, __fmul_rn(c.m, b)) : b;
        }
        float np = __fadd_rn(pi, __fmul_rn(c.neg_lr, d));
        jb.param[i] = np;
        if (jb.out) store_copy(jb.out, jb.out_dtype, i, np);
    }
}

__global__ void adam_kernel(const __grid_constant__ ampc_cu_optim_jobs J) {
    int64_t base;
    int j = job_of(J, blockIdx.x, &base);
    if (j < 0) return;
    const ampc_cu_optim_job &jb = J.job[j];
    const ampc_adam_consts c = jb.c.adam;
    bool amsgrad = jb.variant & 1, scaled = jb.variant & 2;
    int64_t end = base + OPT_ELEMS < jb.n ? base + OPT_ELEMS : jb.n;
    for (int64_t i = base + threadIdx.x; i < end; i += blockDim.x) {
        float pi = __fmul_rn(jb.param[i], c.decay);
        float gu = jb.grad[i];
        if (scaled) jb.grad[i] = gu = __fmul_rn(gu, c.gs);   /* the unscaled gradient, written back as read */
        float gi = __fadd_rn(gu, __fmul_rn(c.l2, pi));
        float mi = __fadd_rn(__fmul_rn(c.b1, jb.state[0][i]), __fmul_rn(c.omb1, gi));
        float vi = __fadd_rn(__fmul_rn(c.b2, jb.state[1][i]), __fmul_rn(__fmul_rn(c.omb2, gi), gi));
        jb.state[0][i] = mi;
        jb.state[1][i] = vi;
        if (amsgrad) {
            float old = jb.state[2][i];
            vi = old > vi ? old : vi;   /* NaN in v propagates, as torch.maximum */
            jb.state[2][i] = vi;
        }
        float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bc2_sqrt), c.eps);
        float np = __fadd_rn(pi, __fdiv_rn(__fmul_rn(c.neg_step_size, mi), denom));
        jb.param[i] = np;
        if (jb.out) store_copy(jb.out, jb.out_dtype, i, np);
    }
}

static cudaError_t launch_optim(const ampc_cu_optim_jobs *J, bool adam, cudaStream_t s) {
    int64_t n[AMPC_CU_OPTIM_GROUP];
    for (int j = 0; j < J->n; j++) n[j] = J->job[j].n;
    int64_t nb = total_blocks(n, J->n);
    if (nb == 0) return cudaSuccess;
    if (adam) adam_kernel<<<(unsigned)nb, OPT_THREADS, 0, s>>>(*J);
    else sgd_kernel<<<(unsigned)nb, OPT_THREADS, 0, s>>>(*J);
    return cudaGetLastError();
}

extern "C" cudaError_t ampc_cu_sgd(const ampc_cu_optim_jobs *J, cudaStream_t s) { return launch_optim(J, false, s); }
extern "C" cudaError_t ampc_cu_adam(const ampc_cu_optim_jobs *J, cudaStream_t s) { return launch_optim(J, true, s); }

// ---------------------------------------------------------------------------------------------
// unscale and check

template <class T> __device__ static int unscale_range(void *p, int64_t a, int64_t b, float inv, bool mul) {
    T *x = (T *)p;
    int bad = 0;
    for (int64_t i = a + threadIdx.x; i < b; i += blockDim.x) {
        float v = to_f<T>(x[i]);
        bad |= !(fabsf(v) <= 3.402823466e38f);   /* NaN fails the compare */
        if (mul) x[i] = from_f<T>(__fmul_rn(v, inv));
    }
    return bad;
}

__global__ void unscale_kernel(const __grid_constant__ ampc_cu_unscale_jobs J, float inv, bool mul, int *found) {
    int64_t b = blockIdx.x, first = 0;
    int j = 0;
    for (; j < J.n; j++) {
        int64_t nb = (J.numel[j] + OPT_ELEMS - 1) / OPT_ELEMS;
        if (b < first + nb) break;
        first += nb;
    }
    if (j == J.n) return;
    int64_t a = (b - first) * OPT_ELEMS, e = a + OPT_ELEMS < J.numel[j] ? a + OPT_ELEMS : J.numel[j];
    int bad;
    if (J.dtype[j] == AMPC_F32) bad = unscale_range<float>(J.ptr[j], a, e, inv, mul);
    else if (J.dtype[j] == AMPC_F16) bad = unscale_range<__half>(J.ptr[j], a, e, inv, mul);
    else bad = unscale_range<__nv_bfloat16>(J.ptr[j], a, e, inv, mul);
    if (__syncthreads_or(bad) && threadIdx.x == 0) *found = 1;
}

extern "C" cudaError_t ampc_cu_unscale(const ampc_cu_unscale_jobs *J, float inv_scale, bool mul, int *found, cudaStream_t s) {
    int64_t nb = total_blocks(J->numel, J->n);
    if (nb == 0) return cudaSuccess;
    unscale_kernel<<<(unsigned)nb, OPT_THREADS, 0, s>>>(*J, inv_scale, mul, found);
    return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// sum of squares (double accumulation; the square of a float is exact in double)

template <class T> __global__ void sumsq_kernel(const T *x, int64_t n, double *partial) {
    double acc = 0;
    AMPC_CU_LOOP(i, n) {
        double v = to_f<T>(x[i]);
        acc += v * v;
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    __shared__ double warp[32];
    if ((threadIdx.x & 31) == 0) warp[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += warp[w];
        partial[blockIdx.x] = s;
    }
}

extern "C" cudaError_t ampc_cu_sum_squares(const void *x, ampc_dtype dt, int64_t n, double *partial, int nblocks, cudaStream_t s) {
    AMPC_CU_FLOAT_TYPES(dt, T, sumsq_kernel<T><<<(unsigned)nblocks, 256, 0, s>>>((const T *)x, n, partial));
    return cudaGetLastError();
}
