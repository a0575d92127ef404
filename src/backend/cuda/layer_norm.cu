/*
 * layer_norm.cu - CUDA kernels of layer norm: the CPU backend's formulas
 * (src/backend/cpu/layer_norm.c) in f32, one rounding on store.
 *
 * Rows run a warp or a block per row (reduce.cuh: row_shape), reducing with warp shuffles and
 * one shared-memory step. Column sums (the weight and bias gradients) cut the rows into slices
 * whose partial sums are added in order by a last kernel: no atomics, results independent of
 * timing.
 */
#include "backend/cuda/reduce.cuh"

using namespace ampc_cu;

// ---------------------------------------------------------------------------------------------
// Layer norm of x (rows, cols): mean and variance per row (two passes), y = ((x - mh) - ml) r w
// + b with the mean as a float mh plus its remainder ml, as the CPU kernel applies it.

template <bool BLOCK, class TX, class TY>
__global__ void layer_norm_kernel(const TX *x, const float *w, const float *b, TY *y, float *mean, float *rstd, int64_t rows,
                                  int64_t cols, double eps) {
    __shared__ float sh[32];
    AMPC_CU_ROWS(BLOCK, r, t, nt, rows) {
        const TX *xr = x + r * cols;
        TY *yr = y + r * cols;
        float sx = 0.0f, q = 0.0f;
        for (int64_t i = t; i < cols; i += nt) sx += to_f<TX>(xr[i]);
        double mu = (double)row_sum<BLOCK>(sx, sh) / (double)cols;
        float mh = (float)mu, ml = (float)(mu - (double)mh);
        for (int64_t i = t; i < cols; i += nt) {
            float d = (to_f<TX>(xr[i]) - mh) - ml;
            q += d * d;
        }
        double rs = 1.0 / sqrt((double)row_sum<BLOCK>(q, sh) / (double)cols + eps);
        float rf = (float)rs;
        if (t == 0) {
            mean[r] = mh;
            if (rstd) rstd[r] = rf;
        }
        for (int64_t i = t; i < cols; i += nt)
            yr[i] = from_f<TY>(((to_f<TX>(xr[i]) - mh) - ml) * rf * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f));
    }
}

extern "C" cudaError_t ampc_cu_layer_norm(const void *x, ampc_dtype xdt, const float *w, const float *b, void *y, ampc_dtype ydt,
                                         float *mean, float *rstd, int64_t rows, int64_t cols, double eps, cudaStream_t s) {
    if (rows <= 0 || cols <= 0) return cudaSuccess;
    row_launch l = row_shape(rows, cols);
    AMPC_CU_FLOAT_TYPES(xdt, TX, AMPC_CU_FLOAT_TYPES(ydt, TY,
        if (l.block) layer_norm_kernel<true, TX, TY><<<l.grid, l.threads, 0, s>>>((const TX *)x, w, b, (TY *)y, mean, rstd, rows, cols, eps);
        else layer_norm_kernel<false, TX, TY><<<l.grid, l.threads, 0, s>>>((const TX *)x, w, b, (TY *)y, mean, rstd, rows, cols, eps)));
    return cudaGetLastError();
}

/* gx = r w g + A (x - m) + B with A = -r^2 sum(g w xhat) / cols, B = -r sum(g w) / cols;
   gx may be gy's array (each element read and written by one thread, after the sums) */
template <bool BLOCK, class T>
__global__ void layer_norm_bwd_kernel(const T *x, const T *gy, const float *w, const float *mean, const float *rstd, T *gx,
                                      int64_t rows, int64_t cols) {
    __shared__ float sh[32];
    AMPC_CU_ROWS(BLOCK, r, t, nt, rows) {
        const T *xr = x + r * cols, *gr = gy + r * cols;
        T *or_ = gx + r * cols;
        float m = mean[r], rs = rstd[r], sa = 0.0f, sb = 0.0f;
        for (int64_t i = t; i < cols; i += nt) {
            float gw = to_f<T>(gr[i]) * (w ? w[i] : 1.0f);
            sa += gw;
            sb += gw * ((to_f<T>(xr[i]) - m) * rs);
        }
        double a = row_sum<BLOCK>(sa, sh), bsum = row_sum<BLOCK>(sb, sh);
        float A = (float)(-(double)rs * rs * bsum / (double)cols), B = (float)(-(double)rs * a / (double)cols);
        for (int64_t i = t; i < cols; i += nt)
            or_[i] = from_f<T>(rs * (w ? w[i] : 1.0f) * to_f<T>(gr[i]) + A * (to_f<T>(xr[i]) - m) + B);
    }
}

/* Partial column sums over slice blockIdx.y of the rows: part[(slice * 2) * cols + j] = sum g
   xhat, part[(slice * 2 + 1) * cols + j] = sum g */
#define LN_COL_ROWS 8
template <class T>
__global__ void layer_norm_cols_kernel(const T *x, const T *gy, const float *mean, const float *rstd, int64_t rows,
                                       int64_t cols, int64_t splits, float *part) {
    __shared__ float sw[LN_COL_ROWS][33], sb[LN_COL_ROWS][33];
    int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x, len = (rows + splits - 1) / splits;
    int64_t r0 = blockIdx.y * len, r1 = r0 + len < rows ? r0 + len : rows;
    float aw = 0.0f, ab = 0.0f;
    if (j < cols) {
        for (int64_t r = r0 + threadIdx.y; r < r1; r += LN_COL_ROWS) {
            float g = to_f<T>(gy[r * cols + j]);
            aw += g * ((to_f<T>(x[r * cols + j]) - mean[r]) * rstd[r]);
            ab += g;
        }
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y || j >= cols) return;
    aw = ab = 0.0f;
    for (int k = 0; k < LN_COL_ROWS; k++) {
        aw += sw[k][threadIdx.x];
        ab += sb[k][threadIdx.x];
    }
    part[(blockIdx.y * 2) * cols + j] = aw;
    part[(blockIdx.y * 2 + 1) * cols + j] = ab;
}

__global__ void layer_norm_cols_finish_kernel(const float *part, int64_t splits, int64_t cols, void *gw, ampc_dtype gwdt,
                                              void *gb, ampc_dtype gbdt) {
    AMPC_CU_LOOP(j, cols) {
        float aw = 0.0f, ab = 0.0f;
        for (int64_t sl = 0; sl < splits; sl++) {
            aw += part[(sl * 2) * cols + j];
            ab += part[(sl * 2 + 1) * cols + j];
        }
        if (gw) store_any(gw, gwdt, j, aw);
        if (gb) store_any(gb, gbdt, j, ab);
    }
}

extern "C" int64_t ampc_cu_layer_norm_splits(int64_t rows, int64_t cols, int sm_count) {
    int64_t blocks = (cols + 31) / 32, want = (int64_t)sm_count * 8 / (blocks > 0 ? blocks : 1), cap = rows / 64;
    int64_t k = want < cap ? want : cap;
    return k < 1 ? 1 : k > 1024 ? 1024 : k;
}

extern "C" cudaError_t ampc_cu_layer_norm_backward(const void *x, const void *gy, ampc_dtype dt, const float *w, const float *mean,
                                                  const float *rstd, void *gx, void *gw, ampc_dtype gwdt, void *gb,
                                                  ampc_dtype gbdt, int64_t rows, int64_t cols, int64_t splits, float *scratch,
                                                  cudaStream_t s) {
    if (cols <= 0) return cudaSuccess;
    if (gw || gb) {   /* first: gx may be written over gy */
        dim3 grid((unsigned)((cols + 31) / 32), (unsigned)splits), block(32, LN_COL_ROWS);
        AMPC_CU_FLOAT_TYPES(dt, T, layer_norm_cols_kernel<T><<<grid, block, 0, s>>>((const T *)x, (const T *)gy, mean, rstd,
                                                                                  rows, cols, splits, scratch));
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
        layer_norm_cols_finish_kernel<<<blocks_for(cols), 256, 0, s>>>(scratch, splits, cols, gw, gwdt, gb, gbdt);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    if (gx && rows > 0) {
        row_launch l = row_shape(rows, cols);
        AMPC_CU_FLOAT_TYPES(dt, T,
            if (l.block) layer_norm_bwd_kernel<true, T><<<l.grid, l.threads, 0, s>>>((const T *)x, (const T *)gy, w, mean, rstd, (T *)gx, rows, cols);
            else layer_norm_bwd_kernel<false, T><<<l.grid, l.threads, 0, s>>>((const T *)x, (const T *)gy, w, mean, rstd, (T *)gx, rows, cols));
    }
    return cudaGetLastError();
}
