/*
 * embedding.cu - CUDA kernels that move rows: the embedding (the forward copies the rows the
 * indices pick; the backward sums gy's rows into the rows of gw their indices name, one thread per
 * column walking the indices in order, so every column's sum runs in index order: the same bits
 * every run, repeated tokens included, as the CPU's), and permute (one thread per output element).
 */
#include "backend/cuda/reduce.cuh"

using namespace ampc_cu;

// ---------------------------------------------------------------------------------------------
// Embedding

/* one block per index row, threads over its D elements (bits copied as units of E bytes) */
template <class E>
__global__ void embedding_kernel(const E *w, const int64_t *idx, E *y, int64_t n, int64_t V, int64_t D, int *bad) {
    for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
        const int64_t r = idx[i];
        const bool ok = r >= 0 && r < V;
        if (!ok && threadIdx.x == 0) *bad = 1;
        for (int64_t c = threadIdx.x; c < D; c += blockDim.x) y[i * D + c] = ok ? w[r * D + c] : E(0);
    }
}

extern "C" cudaError_t ampc_cu_embedding(const void *w, ampc_dtype dt, const int64_t *idx, void *y, int64_t n, int64_t V, int64_t D,
                                         int *bad, cudaStream_t s) {
    if (n <= 0 || D <= 0) return cudaSuccess;
    unsigned grid = (unsigned)(n < 65535 * 8 ? n : 65535 * 8), threads = D >= 256 ? 256 : 64;
    switch (ampc_dtype_size(dt)) {   /* any float dtype: its bits */
    case 2: embedding_kernel<uint16_t><<<grid, threads, 0, s>>>((const uint16_t *)w, idx, (uint16_t *)y, n, V, D, bad); break;
    case 4: embedding_kernel<uint32_t><<<grid, threads, 0, s>>>((const uint32_t *)w, idx, (uint32_t *)y, n, V, D, bad); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

/* acc (V, D) f32, zeroed: column c's thread adds row i of gy into row idx[i], i = 0, 1, ... */
template <class TG>
__global__ void embedding_backward_kernel(const TG *gy, const int64_t *idx, float *acc, int64_t n, int64_t V, int64_t D, int *bad) {
    AMPC_CU_LOOP(c, D) {
        for (int64_t i = 0; i < n; i++) {
            const int64_t r = idx[i];
            if (r < 0 || r >= V) {
                *bad = 1;
                continue;
            }
            acc[r * D + c] += to_f<TG>(gy[i * D + c]);
        }
    }
}

extern "C" cudaError_t ampc_cu_embedding_backward(const void *gy, ampc_dtype gdt, const int64_t *idx, void *gw, ampc_dtype wdt,
                                                  int64_t n, int64_t V, int64_t D, int *bad, cudaStream_t s) {
    (void)wdt;   /* gw is f32 here: the C side converts a 16-bit gw after (one rounding) */
    if (n <= 0 || D <= 0) return cudaSuccess;
    AMPC_CU_FLOAT_TYPES(gdt, TG,
        embedding_backward_kernel<TG><<<blocks_for(D, 64), 64, 0, s>>>((const TG *)gy, idx, (float *)gw, n, V, D, bad));
    return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Permute

typedef struct {
    int nd;
    int64_t yshape[8], xstride[8];   /* y's shape, and x's stride along each of y's dims */
} perm_plan;

template <class E>
__global__ void permute_kernel(const E *x, E *y, perm_plan p, int64_t n) {
    AMPC_CU_LOOP(i, n) {
        int64_t rest = i, off = 0;
        for (int d = p.nd - 1; d >= 0; d--) {
            off += rest % p.yshape[d] * p.xstride[d];
            rest /= p.yshape[d];
        }
        y[i] = x[off];
    }
}

extern "C" cudaError_t ampc_cu_permute(const void *x, void *y, size_t esize, int nd, const int64_t *xshape, const int *perm, int64_t n,
                                       cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    if (nd < 1 || nd > 8) return cudaErrorInvalidValue;
    perm_plan p;
    p.nd = nd;
    int64_t xs[8], st = 1;
    for (int d = nd - 1; d >= 0; d--) {
        xs[d] = st;
        st *= xshape[d];
    }
    for (int d = 0; d < nd; d++) {
        p.yshape[d] = xshape[perm[d]];
        p.xstride[d] = xs[perm[d]];
    }
    switch (esize) {
    case 2: permute_kernel<uint16_t><<<blocks_for(n), 256, 0, s>>>((const uint16_t *)x, (uint16_t *)y, p, n); break;
    case 4: permute_kernel<uint32_t><<<blocks_for(n), 256, 0, s>>>((const uint32_t *)x, (uint32_t *)y, p, n); break;
    case 8: permute_kernel<uint64_t><<<blocks_for(n), 256, 0, s>>>((const uint64_t *)x, (uint64_t *)y, p, n); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}
