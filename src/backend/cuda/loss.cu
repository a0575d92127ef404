/*
 * loss.cu - CUDA kernels of softmax / log-softmax and fused cross-entropy: the CPU backend's
 * formulas (src/backend/cpu/loss.c) in f32, one rounding on store.
 *
 * Rows (softmax with inner == 1, cross-entropy) run a warp or a block per row (reduce.cuh:
 * row_shape), reducing with warp shuffles and one shared-memory step; softmax along a middle
 * axis runs a thread per column, reading along contiguous memory.
 */
#include <limits.h>

#include "backend/cuda/reduce.cuh"

using namespace ampc_cu;

// ---------------------------------------------------------------------------------------------
// Softmax: max-subtracted; softmax y = exp(x - m) / s, log-softmax y = (x - m) - log(s).

template <bool BLOCK, class TI, class TO>
__global__ void softmax_rows_kernel(const TI *x, TO *y, int64_t rows, int64_t n, bool lg) {
    __shared__ float sh[32];
    AMPC_CU_ROWS(BLOCK, r, t, nt, rows) {
        const TI *xr = x + r * n;
        TO *yr = y + r * n;
        float m = -INFINITY, s = 0.0f;
        for (int64_t i = t; i < n; i += nt) m = max_nan_ignored(m, to_f<TI>(xr[i]));
        m = row_max<BLOCK>(m, sh);
        for (int64_t i = t; i < n; i += nt) s += expf(to_f<TI>(xr[i]) - m);
        s = row_sum<BLOCK>(s, sh);
        if (lg) {
            float ls = logf(s);
            for (int64_t i = t; i < n; i += nt) yr[i] = from_f<TO>((to_f<TI>(xr[i]) - m) - ls);
        } else {
            for (int64_t i = t; i < n; i += nt) yr[i] = from_f<TO>(expf(to_f<TI>(xr[i]) - m) / s);
        }
    }
}

template <class TI, class TO>
__global__ void softmax_cols_kernel(const TI *x, TO *y, int64_t outer, int64_t dim, int64_t inner, bool lg) {
    AMPC_CU_LOOP(c, outer * inner) {
        int64_t base = (c / inner) * dim * inner + c % inner;
        const TI *xc = x + base;
        TO *yc = y + base;
        float m = -INFINITY, s = 0.0f;
        for (int64_t d = 0; d < dim; d++) m = max_nan_ignored(m, to_f<TI>(xc[d * inner]));
        for (int64_t d = 0; d < dim; d++) s += expf(to_f<TI>(xc[d * inner]) - m);
        if (lg) {
            float ls = logf(s);
            for (int64_t d = 0; d < dim; d++) yc[d * inner] = from_f<TO>((to_f<TI>(xc[d * inner]) - m) - ls);
        } else {
            for (int64_t d = 0; d < dim; d++) yc[d * inner] = from_f<TO>(expf(to_f<TI>(xc[d * inner]) - m) / s);
        }
    }
}

extern "C" cudaError_t ampc_cu_softmax(const void *x, ampc_dtype xdt, void *y, ampc_dtype ydt, int64_t outer, int64_t dim,
                                      int64_t inner, bool lg, cudaStream_t s) {
    if (outer <= 0 || dim <= 0 || inner <= 0) return cudaSuccess;
    if (inner == 1) {
        row_launch l = row_shape(outer, dim);
        AMPC_CU_FLOAT_TYPES(xdt, TI, AMPC_CU_FLOAT_TYPES(ydt, TO,
            if (l.block) softmax_rows_kernel<true, TI, TO><<<l.grid, l.threads, 0, s>>>((const TI *)x, (TO *)y, outer, dim, lg);
            else softmax_rows_kernel<false, TI, TO><<<l.grid, l.threads, 0, s>>>((const TI *)x, (TO *)y, outer, dim, lg)));
    } else {
        AMPC_CU_FLOAT_TYPES(xdt, TI, AMPC_CU_FLOAT_TYPES(ydt, TO, softmax_cols_kernel<TI, TO><<<blocks_for(outer * inner), 256, 0, s>>>(
            (const TI *)x, (TO *)y, outer, dim, inner, lg)));
    }
    return cudaGetLastError();
}

/* softmax: gx = y (g - sum(g y)); log-softmax: gx = g - exp(y) sum(g). gx (y's dtype) may be
   gy's array: every element is read and written by one thread, after the sums. */
template <bool BLOCK, class TY, class TG>
__global__ void softmax_bwd_rows_kernel(const TY *y, const TG *gy, TY *gx, int64_t rows, int64_t n, bool lg) {
    __shared__ float sh[32];
    AMPC_CU_ROWS(BLOCK, r, t, nt, rows) {
        const TY *yr = y + r * n;
        const TG *gr = gy + r * n;
        TY *xr = gx + r * n;
        float s = 0.0f;
        for (int64_t i = t; i < n; i += nt) s += lg ? to_f<TG>(gr[i]) : to_f<TG>(gr[i]) * to_f<TY>(yr[i]);
        s = row_sum<BLOCK>(s, sh);
        for (int64_t i = t; i < n; i += nt) {
            float g = to_f<TG>(gr[i]), v = to_f<TY>(yr[i]);
            xr[i] = from_f<TY>(lg ? g - expf(v) * s : v * (g - s));
        }
    }
}

template <class TY, class TG>
__global__ void softmax_bwd_cols_kernel(const TY *y, const TG *gy, TY *gx, int64_t outer, int64_t dim, int64_t inner, bool lg) {
    AMPC_CU_LOOP(c, outer * inner) {
        int64_t base = (c / inner) * dim * inner + c % inner;
        float s = 0.0f;
        for (int64_t d = 0; d < dim; d++) {
            int64_t i = base + d * inner;
            s += lg ? to_f<TG>(gy[i]) : to_f<TG>(gy[i]) * to_f<TY>(y[i]);
        }
        for (int64_t d = 0; d < dim; d++) {
            int64_t i = base + d * inner;
            float g = to_f<TG>(gy[i]), v = to_f<TY>(y[i]);
            gx[i] = from_f<TY>(lg ? g - expf(v) * s : v * (g - s));
        }
    }
}

extern "C" cudaError_t ampc_cu_softmax_backward(const void *y, ampc_dtype ydt, const void *gy, ampc_dtype gdt, void *gx,
                                               int64_t outer, int64_t dim, int64_t inner, bool lg, cudaStream_t s) {
    if (outer <= 0 || dim <= 0 || inner <= 0) return cudaSuccess;
    if (inner == 1) {
        row_launch l = row_shape(outer, dim);
        AMPC_CU_FLOAT_TYPES(ydt, TY, AMPC_CU_FLOAT_TYPES(gdt, TG,
            if (l.block) softmax_bwd_rows_kernel<true, TY, TG><<<l.grid, l.threads, 0, s>>>((const TY *)y, (const TG *)gy, (TY *)gx, outer, dim, lg);
            else softmax_bwd_rows_kernel<false, TY, TG><<<l.grid, l.threads, 0, s>>>((const TY *)y, (const TG *)gy, (TY *)gx, outer, dim, lg)));
    } else {
        AMPC_CU_FLOAT_TYPES(ydt, TY, AMPC_CU_FLOAT_TYPES(gdt, TG, softmax_bwd_cols_kernel<TY, TG><<<blocks_for(outer * inner), 256, 0, s>>>(
            (const TY *)y, (const TG *)gy, (TY *)gx, outer, dim, inner, lg)));
    }
    return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy: per row (1 - eps) nll + eps mean_c(-logp_c), logp = (x - m) - log(s); the
// backward recomputes the softmax from the logits.

__device__ __forceinline__ bool target_ok(int64_t t, int64_t C) { return t >= 0 && t < C; }

template <bool BLOCK, class T, class TO>
__global__ void ce_rows_kernel(const T *x, const int64_t *tg, int64_t N, int64_t C, int64_t ignore, float eps, TO *out,
                               float *loss) {
    __shared__ float sh[32];
    AMPC_CU_ROWS(BLOCK, r, t, nt, N) {
        int64_t target = tg[r];   /* the same for every thread of the row: branches stay uniform */
        float v = 0.0f;
        if (target != ignore && !target_ok(target, C)) {
            v = NAN;
        } else if (target != ignore) {
            const T *xr = x + r * C;
            float m = -INFINITY, se = 0.0f, sd = 0.0f;
            for (int64_t c = t; c < C; c += nt) m = max_nan_ignored(m, to_f<T>(xr[c]));
            m = row_max<BLOCK>(m, sh);
            for (int64_t c = t; c < C; c += nt) {
                float d = to_f<T>(xr[c]) - m;
                se += expf(d);
                sd += d;
            }
            se = row_sum<BLOCK>(se, sh);
            float ls = logf(se), nll = ls - (to_f<T>(xr[target]) - m);
            if (eps > 0.0f) {
                sd = row_sum<BLOCK>(sd, sh);
                v = (1.0f - eps) * nll + eps * (ls - sd / (float)C);
            } else {
                v = nll;
            }
        }
        if (t == 0) {
            if (out) out[r] = from_f<TO>(v);
            else loss[r] = v;
        }
    }
}

/* One block: the count of targets not ignored, the first out-of-range one, and for MEAN/SUM
   the sum of the row losses in f64, rounded once into out[0]. */
#define CE_FINISH_THREADS 1024
__global__ void ce_finish_kernel(const int64_t *tg, int64_t N, int64_t C, int64_t ignore, const float *loss, bool mean,
                                 void *out, ampc_dtype odt, int64_t *info) {
    __shared__ double ssum[32];
    __shared__ long long scnt[32], sbad[32];
    double sum = 0.0;
    long long cnt = 0, bad = LLONG_MAX;
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
        int64_t t = tg[i];
        if (t == ignore) continue;
        if (!target_ok(t, C)) {
            bad = i < bad ? i : bad;
            continue;
        }
        cnt++;
        if (loss) sum += loss[i];
    }
    for (int o = 16; o > 0; o >>= 1) {
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
        cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
        long long b = __shfl_xor_sync(0xffffffffu, bad, o);
        bad = b < bad ? b : bad;
    }
    unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) {
        ssum[w] = sum;
        scnt[w] = cnt;
        sbad[w] = bad;
    }
    __syncthreads();
    if (threadIdx.x) return;
    for (unsigned k = 1; k < (blockDim.x >> 5); k++) {
        sum += ssum[k];
        cnt += scnt[k];
        bad = sbad[k] < bad ? sbad[k] : bad;
    }
    info[0] = cnt;
    info[1] = bad == LLONG_MAX ? -1 : bad;
    info[2] = bad == LLONG_MAX ? 0 : tg[bad];
    if (loss) store_any_f64(out, odt, 0, mean ? (cnt ? sum / (double)cnt : (double)NAN) : sum);   /* PyTorch: 0/0 */
}

extern "C" cudaError_t ampc_cu_cross_entropy(const void *logits, ampc_dtype dt, const int64_t *targets, int64_t N, int64_t C,
                                            ampc_reduction red, int64_t ignore_index, float eps, void *out, ampc_dtype odt,
                                            float *loss, int64_t *info, cudaStream_t s) {
    bool none = red == AMPC_REDUCTION_NONE;
    if (N > 0) {
        row_launch l = row_shape(N, C);
        AMPC_CU_FLOAT_TYPES(dt, T, AMPC_CU_FLOAT_TYPES(none ? odt : AMPC_F32, TO,
            TO *o = none ? (TO *)out : NULL;
            if (l.block) ce_rows_kernel<true, T, TO><<<l.grid, l.threads, 0, s>>>((const T *)logits, targets, N, C, ignore_index, eps, o, loss);
            else ce_rows_kernel<false, T, TO><<<l.grid, l.threads, 0, s>>>((const T *)logits, targets, N, C, ignore_index, eps, o, loss)));
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    ce_finish_kernel<<<1, CE_FINISH_THREADS, 0, s>>>(targets, N, C, ignore_index, none ? NULL : loss,
                                                     red == AMPC_REDUCTION_MEAN, out, odt, info);
    return cudaGetLastError();
}

/* gx = (softmax(x) - q) g, q = eps/C off the target and 1 - eps + eps/C on it, g = gy / weight;
   every element is read and written by one thread (gx may be x's array) */
template <bool BLOCK, class T, class TO>
__global__ void ce_bwd_rows_kernel(const T *x, const int64_t *tg, int64_t N, int64_t C, const void *gy, ampc_dtype gdt,
                                   bool per_row, double weight, int64_t ignore, float eps, TO *gx) {
    __shared__ float sh[32];
    AMPC_CU_ROWS(BLOCK, r, t, nt, N) {
        int64_t target = tg[r];
        const T *xr = x + r * C;
        TO *gr = gx + r * C;
        if (target == ignore || !target_ok(target, C)) {
            float v = target == ignore ? 0.0f : NAN;
            for (int64_t c = t; c < C; c += nt) gr[c] = from_f<TO>(v);
            continue;
        }
        float g = (float)((double)load_any(gy, gdt, per_row ? r : 0) / weight);
        float m = -INFINITY, se = 0.0f;
        for (int64_t c = t; c < C; c += nt) m = max_nan_ignored(m, to_f<T>(xr[c]));
        m = row_max<BLOCK>(m, sh);
        for (int64_t c = t; c < C; c += nt) se += expf(to_f<T>(xr[c]) - m);
        se = row_sum<BLOCK>(se, sh);
        float q_off = eps / (float)C, q_on = (1.0f - eps) + q_off;
        for (int64_t c = t; c < C; c += nt) gr[c] = from_f<TO>((expf(to_f<T>(xr[c]) - m) / se - (c == target ? q_on : q_off)) * g);
    }
}

extern "C" cudaError_t ampc_cu_cross_entropy_backward(const void *logits, ampc_dtype dt, const int64_t *targets, int64_t N,
                                                     int64_t C, const void *gy, ampc_dtype gdt, bool per_row, double weight,
                                                     int64_t ignore_index, float eps, void *gx, ampc_dtype odt, cudaStream_t s) {
    if (N <= 0 || C <= 0) return cudaSuccess;
    row_launch l = row_shape(N, C);
    AMPC_CU_FLOAT_TYPES(dt, T, AMPC_CU_FLOAT_TYPES(odt, TO,
        if (l.block) ce_bwd_rows_kernel<true, T, TO><<<l.grid, l.threads, 0, s>>>((const T *)logits, targets, N, C, gy, gdt, per_row, weight, ignore_index, eps, (TO *)gx);
        else ce_bwd_rows_kernel<false, T, TO><<<l.grid, l.threads, 0, s>>>((const T *)logits, targets, N, C, gy, gdt, per_row, weight, ignore_index, eps, (TO *)gx)));
    return cudaGetLastError();
}
