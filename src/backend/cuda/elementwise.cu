/*
 * elementwise.cu - CUDA kernels of the unary ops and their derivatives, broadcasting binary
 * ops and expand, and sum_to (broadcast-reduce). The formulas are the CPU backend's
 * (src/backend/cpu/elementwise.c) in f32, rounded once on store.
 */
#include "backend/cuda/reduce.cuh"

using namespace ampc_cu;

// ---------------------------------------------------------------------------------------------
// Unary

#define INV_SQRT2 0.70710678118654752440f
#define INV_SQRT2PI 0.39894228040143267794f
#define SQRT_2_PI 0.79788456080286535588f   /* GELU's tanh approximation */
#define GELU_K 0.044715f

__device__ __forceinline__ float unary_f(ampc_op op, float v, float a) {
    switch (op) {
    case AMPC_OP_RELU: return v < 0.0f ? 0.0f : v;   /* NaN stays NaN */
    case AMPC_OP_GELU: return 0.5f * v * (1.0f + erff(v * INV_SQRT2));
    case AMPC_OP_GELU_TANH: return 0.5f * v * (1.0f + tanhf(SQRT_2_PI * (v + GELU_K * v * v * v)));
    case AMPC_OP_TANH: return tanhf(v);
    case AMPC_OP_SILU: return v / (1.0f + expf(-v));
    case AMPC_OP_SIGMOID: return 1.0f / (1.0f + expf(-v));
    case AMPC_OP_EXP: return expf(v);
    case AMPC_OP_LOG: return logf(v);
    case AMPC_OP_POW: return powf(v, a);
    case AMPC_OP_MUL_SCALAR: return a * v;
    default: return v + a;   /* ADD_SCALAR (the C side admits no other op) */
    }
}

template <class TI, class TO> __global__ void unary_kernel(ampc_op op, const TI *x, TO *y, int64_t n, float a, bool vec) {
    loop4(
        n, vec,
        [&](int64_t q) {
            float f[4];
            load4(x, q, f);
            for (int l = 0; l < 4; l++) f[l] = unary_f(op, f[l], a);
            store4(y, q, f);
        },
        [&](int64_t i) { y[i] = from_f<TO>(unary_f(op, to_f<TI>(x[i]), a)); });
}

extern "C" cudaError_t ampc_cu_unary(ampc_op op, const void *x, ampc_dtype xdt, void *y, ampc_dtype ydt, int64_t n,
                                     float alpha, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    AMPC_CU_FLOAT_TYPES(xdt, TI, AMPC_CU_FLOAT_TYPES(ydt, TO,
        bool vec = aligned4(x, sizeof(TI)) && aligned4(y, sizeof(TO));
        unary_kernel<TI, TO><<<blocks_vec(n, vec), 256, 0, s>>>(op, (const TI *)x, (TO *)y, n, alpha, vec)));
    return cudaGetLastError();
}

__global__ void add_scalar_i64_kernel(const int64_t *x, int64_t *y, int64_t n, int64_t a) {
    AMPC_CU_LOOP(i, n) y[i] = x[i] + a;
}

extern "C" cudaError_t ampc_cu_add_scalar_i64(const int64_t *x, int64_t *y, int64_t n, int64_t a, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    add_scalar_i64_kernel<<<blocks_for(n), 256, 0, s>>>(x, y, n, a);
    return cudaGetLastError();
}

/* gy * f'(v), v the value the op's backward reads: x for GELU, GELU_TANH, SILU, LOG, POW; y for TANH,
   SIGMOID, EXP; either for RELU, whose y > 0 exactly when x > 0; none (0) for MUL_SCALAR and
   ADD_SCALAR */
__device__ __forceinline__ float unary_df(ampc_op op, float v, float g, float a) {
    switch (op) {
    case AMPC_OP_RELU: return v > 0.0f ? g : 0.0f;
    case AMPC_OP_GELU: /* Phi(x) + x phi(x) */
        return g * (0.5f * (1.0f + erff(v * INV_SQRT2)) + v * INV_SQRT2PI * expf(-0.5f * v * v));
    case AMPC_OP_GELU_TANH: { /* 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3k x^2) */
        float t = tanhf(SQRT_2_PI * (v + GELU_K * v * v * v));
        return g * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * SQRT_2_PI * (1.0f + 3.0f * GELU_K * v * v));
    }
    case AMPC_OP_TANH: return g * (1.0f - v * v);
    case AMPC_OP_SILU: { /* s (1 + x (1 - s)), s = sigmoid(x) */
        float sg = 1.0f / (1.0f + expf(-v));
        return g * (sg * (1.0f + v * (1.0f - sg)));
    }
    case AMPC_OP_SIGMOID: return g * (v * (1.0f - v));
    case AMPC_OP_EXP: return g * v;
    case AMPC_OP_LOG: return g / v;
    case AMPC_OP_POW: return g * (a * powf(v, a - 1.0f));
    case AMPC_OP_MUL_SCALAR: return g * a;
    default: return g;   /* ADD_SCALAR */
    }
}

template <class TV, class TG>
__global__ void unary_backward_kernel(ampc_op op, const TV *v, const TG *gy, TG *gx, int64_t n, float a, bool vec) {
    loop4(
        n, vec,
        [&](int64_t q) {
            float fv[4] = {0.0f, 0.0f, 0.0f, 0.0f}, fg[4];
            if (v) load4(v, q, fv);
            load4(gy, q, fg);
            for (int l = 0; l < 4; l++) fg[l] = unary_df(op, fv[l], fg[l], a);
            store4(gx, q, fg);
        },
        [&](int64_t i) { gx[i] = from_f<TG>(unary_df(op, v ? to_f<TV>(v[i]) : 0.0f, to_f<TG>(gy[i]), a)); });
}

extern "C" cudaError_t ampc_cu_unary_backward(ampc_op op, const void *v, ampc_dtype vdt, const void *gy, void *gx,
                                              ampc_dtype gdt, int64_t n, float alpha, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    if (!v) vdt = gdt;
    AMPC_CU_FLOAT_TYPES(vdt, TV, AMPC_CU_FLOAT_TYPES(gdt, TG,
        bool vec = aligned4(v, sizeof(TV)) && aligned4(gy, sizeof(TG)) && aligned4(gx, sizeof(TG));
        unary_backward_kernel<TV, TG><<<blocks_vec(n, vec), 256, 0, s>>>(op, (const TV *)v, (const TG *)gy, (TG *)gx, n, alpha, vec)));
    return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Binary and expand: out[i] = a[off_a(i)] op b[off_b(i)]. Operands contiguous like the output
// or single values take the flat path (offset i or 0); other broadcasts compute their offsets
// from the merged dims, in 32-bit arithmetic when the output has fewer than 2^31 elements.

__device__ __forceinline__ float bin_op(ampc_op op, float x, float y) {
    return op == AMPC_OP_ADD ? x + y : op == AMPC_OP_SUB ? x - y : x * y;
}

/* both operands contiguous like the output or single values (NULL b: the constant bc) */
template <class T>
__global__ void binary_flat_kernel(ampc_op op, const T *a, bool a_dense, const T *b, bool b_dense, float bc, T *out,
                                   int64_t n, bool vec) {
    float sa = a_dense ? 0.0f : to_f<T>(a[0]), sb = b && !b_dense ? to_f<T>(b[0]) : bc;
    loop4(
        n, vec,
        [&](int64_t q) {
            float fa[4] = {sa, sa, sa, sa}, fb[4] = {sb, sb, sb, sb};
            if (a_dense) load4(a, q, fa);
            if (b_dense) load4(b, q, fb);
            for (int l = 0; l < 4; l++) fa[l] = bin_op(op, fa[l], fb[l]);
            store4(out, q, fa);
        },
        [&](int64_t i) { out[i] = from_f<T>(bin_op(op, a_dense ? to_f<T>(a[i]) : sa, b_dense ? to_f<T>(b[i]) : sb)); });
}

template <class T, class I>
__global__ void binary_bcast_kernel(ampc_op op, ampc_cu_bplan p, const T *a, const T *b, float bc, T *out, int64_t n) {
    AMPC_CU_LOOP(i, n) {
        I r = (I)i, oa = 0, ob = 0;
        for (int d = p.nd - 1; d >= 0; d--) {
            I sz = (I)p.shape[d], c = r % sz;
            r /= sz;
            oa += c * (I)p.st[0][d];
            ob += c * (I)p.st[1][d];
        }
        float y = b ? to_f<T>(b[ob]) : bc;
        out[i] = from_f<T>(bin_op(op, to_f<T>(a[oa]), y));
    }
}

/* operand k is contiguous like the output (1), one value (0), or neither (-1) */
static int operand_walk(const ampc_cu_bplan *p, int k) {
    bool dense = true, zero = true;
    int64_t sz = 1;
    for (int d = p->nd - 1; d >= 0; d--) {
        dense = dense && p->st[k][d] == sz;
        zero = zero && p->st[k][d] == 0;
        sz *= p->shape[d];
    }
    return dense ? 1 : zero ? 0 : -1;
}

extern "C" cudaError_t ampc_cu_binary(ampc_op op, const ampc_cu_bplan *p, const void *a, const void *b, float bc,
                                      void *out, ampc_dtype dt, int64_t n, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    int wa = operand_walk(p, 0), wb = b ? operand_walk(p, 1) : 0;
    if (wa >= 0 && wb >= 0) {
        AMPC_CU_FLOAT_TYPES(dt, T,
            bool vec = aligned4(out, sizeof(T)) && (wa == 0 || aligned4(a, sizeof(T))) && (wb == 0 || aligned4(b, sizeof(T)));
            binary_flat_kernel<T><<<blocks_vec(n, vec), 256, 0, s>>>(op, (const T *)a, wa == 1, (const T *)b, wb == 1, bc,
                                                                     (T *)out, n, vec));
    } else if (n < ((int64_t)1 << 31)) {
        AMPC_CU_FLOAT_TYPES(dt, T, binary_bcast_kernel<T, uint32_t><<<blocks_for(n), 256, 0, s>>>(
            op, *p, (const T *)a, (const T *)b, bc, (T *)out, n));
    } else {
        AMPC_CU_FLOAT_TYPES(dt, T, binary_bcast_kernel<T, int64_t><<<blocks_for(n), 256, 0, s>>>(
            op, *p, (const T *)a, (const T *)b, bc, (T *)out, n));
    }
    return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// sum_to. Output j and reduced index k address x at koff(j) + roff(k). When x's innermost dim
// is reduced (sums of 64 values or more), a warp sums each output (lanes along contiguous
// memory); else the threads of a
// block row take consecutive outputs and its 8 rows share the reduced range, combined in
// shared memory. Long ranges with few outputs are cut into slices whose partial sums go to
// scratch, added in slice order by a last kernel: no atomics, results independent of timing.

__device__ __forceinline__ int64_t plan_off(int nd, const int64_t *shape, const int64_t *st, int64_t i) {
    int64_t off = 0;
    for (int d = nd - 1; d >= 0; d--) {
        off += (i % shape[d]) * st[d];
        i /= shape[d];
    }
    return off;
}

/* a warp per output when x's innermost dim is reduced and the sums are long enough for 32
   lanes; else threads along the outputs (short sums read adjacent memory across a warp) */
static bool warp_per_output(const ampc_cu_rplan *p) { return p->nr > 0 && p->rst[p->nr - 1] == 1 && p->nred >= 64; }

/* [k0, k1) of slice `sl` of n values cut into `splits` */
__device__ __forceinline__ void slice_of(int64_t n, int64_t splits, int64_t sl, int64_t *k0, int64_t *k1) {
    int64_t len = (n + splits - 1) / splits;
    *k0 = sl * len;
    *k1 = *k0 + len < n ? *k0 + len : n;
}

template <class TI, class TO>
__global__ void sum_rows_kernel(ampc_cu_rplan p, const TI *x, TO *out, float alpha, int64_t splits, float *part) {
    int64_t j = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (j >= p.nout) return;   /* whole warps */
    int64_t k0, k1;
    slice_of(p.nred, splits, blockIdx.y, &k0, &k1);
    const TI *xj = x + plan_off(p.nk, p.kshape, p.kst, j);
    float acc = 0.0f;
    if (p.nr == 1) {
        for (int64_t k = k0 + lane; k < k1; k += 32) acc += to_f<TI>(xj[k]);
    } else {
        for (int64_t k = k0 + lane; k < k1; k += 32) acc += to_f<TI>(xj[plan_off(p.nr, p.rshape, p.rst, k)]);
    }
    acc = warp_sum(acc);
    if (lane) return;
    if (splits == 1) out[j] = from_f<TO>(alpha * acc);
    else part[blockIdx.y * p.nout + j] = acc;
}

#define COL_ROWS 8
template <class TI, class TO>
__global__ void sum_cols_kernel(ampc_cu_rplan p, const TI *x, TO *out, float alpha, int64_t splits, float *part) {
    __shared__ float sh[COL_ROWS][33];
    int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x, k0, k1;
    slice_of(p.nred, splits, blockIdx.y, &k0, &k1);
    float acc = 0.0f;
    if (j < p.nout) {
        const TI *xj = x + plan_off(p.nk, p.kshape, p.kst, j);
        for (int64_t k = k0 + threadIdx.y; k < k1; k += COL_ROWS) acc += to_f<TI>(xj[plan_off(p.nr, p.rshape, p.rst, k)]);
    }
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y || j >= p.nout) return;
    acc = 0.0f;
    for (int r = 0; r < COL_ROWS; r++) acc += sh[r][threadIdx.x];
    if (splits == 1) out[j] = from_f<TO>(alpha * acc);
    else part[blockIdx.y * p.nout + j] = acc;
}

template <class TO> __global__ void sum_slices_kernel(const float *part, int64_t splits, int64_t nout, TO *out, float alpha) {
    AMPC_CU_LOOP(j, nout) {
        float acc = 0.0f;
        for (int64_t sl = 0; sl < splits; sl++) acc += part[sl * nout + j];
        out[j] = from_f<TO>(alpha * acc);
    }
}

extern "C" int64_t ampc_cu_sum_to_splits(const ampc_cu_rplan *p, int sm_count) {
    int64_t want, cap;
    if (warp_per_output(p)) {   /* warps: 64 per SM; slices of at least 256 values */
        want = (int64_t)sm_count * 64 / (p->nout > 0 ? p->nout : 1);
        cap = p->nred / 256;
    } else {   /* blocks of 256 threads: 8 per SM; slices of at least 64 rows */
        int64_t blocks = (p->nout + 31) / 32;
        want = (int64_t)sm_count * 8 / (blocks > 0 ? blocks : 1);
        cap = p->nred / 64;
    }
    int64_t k = want < cap ? want : cap;
    return k < 1 ? 1 : k > 1024 ? 1024 : k;
}

extern "C" cudaError_t ampc_cu_sum_to(const ampc_cu_rplan *p, const void *x, ampc_dtype xdt, void *out, ampc_dtype odt,
                                      float alpha, int64_t splits, float *scratch, cudaStream_t s) {
    if (p->nout <= 0 || p->nred <= 0) return cudaSuccess;
    if (warp_per_output(p)) {
        dim3 grid((unsigned)((p->nout + 7) / 8), (unsigned)splits);
        AMPC_CU_FLOAT_TYPES(xdt, TI, AMPC_CU_FLOAT_TYPES(odt, TO,
            sum_rows_kernel<TI, TO><<<grid, 256, 0, s>>>(*p, (const TI *)x, (TO *)out, alpha, splits, scratch)));
    } else {
        dim3 grid((unsigned)((p->nout + 31) / 32), (unsigned)splits), block(32, COL_ROWS);
        AMPC_CU_FLOAT_TYPES(xdt, TI, AMPC_CU_FLOAT_TYPES(odt, TO,
            sum_cols_kernel<TI, TO><<<grid, block, 0, s>>>(*p, (const TI *)x, (TO *)out, alpha, splits, scratch)));
    }
    if (splits > 1) {
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
        AMPC_CU_FLOAT_TYPES(odt, TO,
            sum_slices_kernel<TO><<<blocks_for(p->nout), 256, 0, s>>>(scratch, splits, p->nout, (TO *)out, alpha));
    }
    return cudaGetLastError();
}
