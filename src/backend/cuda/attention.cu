/*
 * attention.cu - the row passes of CUDA attention between its cuBLASLt products (attention.c):
 * the scores of a block of query rows into probabilities (scale, mask, causal, softmax or the
 * saved log-sum-exp, dropout) and the score gradients (dropout, dS = P (dP - rowsum(P dP))). A
 * warp or a block per row (reduce.cuh's row kernels), f32 throughout, one rounding on store.
 * Dropout keeps element (b, i, j) iff draw (b Tq + i) Tk + j of the rng stream is kept, as the
 * CPU's and REF's kernels do.
 */
#include "backend/cuda/reduce.cuh"

using namespace ampc_cu;

/* The keys row i sees */
__device__ __forceinline__ int64_t keys_seen(const ampc_cu_attn_rows &a, int64_t i) {
    return a.causal ? (i + 1 < a.Tk ? i + 1 : a.Tk) : a.Tk;
}

__device__ __forceinline__ int64_t mask_offset(const ampc_cu_attn_rows &a, int64_t b) {
    int64_t off = 0;
    for (int d = a.nlead - 1; d >= 0; d--) {
        off += b % a.lead[d] * a.mask_lead[d];
        b /= a.lead[d];
    }
    return off;
}

/* dropout's factor for element (b, i, j): drop_factor kept, 0 dropped, 1 without dropout */
__device__ __forceinline__ float keep_factor(const ampc_cu_attn_rows &a, int64_t b, int64_t i, int64_t j) {
    if (!a.drop_thr) return 1.0f;
    uint64_t k = (uint64_t)((b * a.Tq + i) * a.Tk + j);
    uint4 r = philox4x32_10(a.seed, a.offset + k / 4);
    uint32_t w = k % 4 == 0 ? r.x : k % 4 == 1 ? r.y : k % 4 == 2 ? r.z : r.w;
    return (w >> 8) >= a.drop_thr ? a.drop_factor : 0.0f;
}

template <bool BLOCK, class TP>
__global__ void probs_kernel(ampc_cu_attn_rows a, float *S, const float *mask, float *lse, bool forward, TP *P) {
    __shared__ float sh[32];
    AMPC_CU_ROWS(BLOCK, r, t, nt, a.batch * a.n) {
        const int64_t b = r / a.n, i = a.i0 + r % a.n, nj = keys_seen(a, i), kn = a.kn;
        float *s = S + r * kn;
        TP *p = P + r * kn;
        const float *m = mask ? mask + mask_offset(a, b) + i * a.mask_si : NULL;
        /* x_j = s_j scale + mask_j for the keys seen, -inf past them */
        for (int64_t j = t; j < kn; j += nt) s[j] = j < nj ? s[j] * a.scale + (m ? m[j * a.mask_sj] : 0.0f) : -INFINITY;
        row_barrier<BLOCK>();
        float mx, l;
        if (forward) {
            mx = -INFINITY;
            for (int64_t j = t; j < kn; j += nt) mx = max_nan_ignored(mx, s[j]);
            mx = row_max<BLOCK>(mx, sh);
            float sum = 0.0f;
            if (mx != -INFINITY)
                for (int64_t j = t; j < kn; j += nt) sum += expf(s[j] - mx);
            sum = row_sum<BLOCK>(sum, sh);
            l = mx == -INFINITY ? -INFINITY : mx + logf(sum);
            if (lse && t == 0) lse[b * a.Tq + i] = l;
        } else {
            l = lse[b * a.Tq + i];
        }
        row_barrier<BLOCK>();
        for (int64_t j = t; j < kn; j += nt) {
            float pj = l == -INFINITY ? 0.0f : expf(s[j] - l);
            s[j] = pj;
            p[j] = from_f<TP>(pj * keep_factor(a, b, i, j));
        }
    }
}

extern "C" cudaError_t ampc_cu_attn_probs(const ampc_cu_attn_rows *a, float *S, const float *mask, float *lse, bool forward, void *P,
                                          ampc_dtype pdt, cudaStream_t s) {
    const int64_t rows = a->batch * a->n;
    if (rows <= 0 || a->kn <= 0) return cudaSuccess;
    row_launch l = row_shape(rows, a->kn);
    AMPC_CU_FLOAT_TYPES(pdt, TP,
        if (l.block) probs_kernel<true, TP><<<l.grid, l.threads, 0, s>>>(*a, S, mask, lse, forward, (TP *)P);
        else probs_kernel<false, TP><<<l.grid, l.threads, 0, s>>>(*a, S, mask, lse, forward, (TP *)P));
    return cudaGetLastError();
}

template <bool BLOCK, class TS>
__global__ void dscores_kernel(ampc_cu_attn_rows a, const float *P, float *dP, TS *dS, float *dmask) {
    __shared__ float sh[32];
    AMPC_CU_ROWS(BLOCK, r, t, nt, a.batch * a.n) {
        const int64_t b = r / a.n, i = a.i0 + r % a.n, kn = a.kn;
        const float *p = P + r * kn;
        float *dp = dP + r * kn;
        float D = 0.0f;
        for (int64_t j = t; j < kn; j += nt) {
            dp[j] *= keep_factor(a, b, i, j);
            D += p[j] * dp[j];
        }
        D = row_sum<BLOCK>(D, sh);
        float *gm = dmask ? dmask + (b * a.Tq + i) * a.Tk : NULL;
        for (int64_t j = t; j < kn; j += nt) {
            float ds = p[j] * (dp[j] - D);
            dS[r * kn + j] = from_f<TS>(ds);
            if (gm) gm[j] = ds;
        }
        if (gm)
            for (int64_t j = kn + t; j < a.Tk; j += nt) gm[j] = 0.0f;
    }
}

extern "C" cudaError_t ampc_cu_attn_dscores(const ampc_cu_attn_rows *a, const float *P, float *dP, void *dSo, ampc_dtype sdt,
                                            float *dmask, cudaStream_t s) {
    const int64_t rows = a->batch * a->n;
    if (rows <= 0 || a->kn <= 0) return cudaSuccess;
    row_launch l = row_shape(rows, a->kn);
    AMPC_CU_FLOAT_TYPES(sdt, TS,
        if (l.block) dscores_kernel<true, TS><<<l.grid, l.threads, 0, s>>>(*a, P, dP, (TS *)dSo, dmask);
        else dscores_kernel<false, TS><<<l.grid, l.threads, 0, s>>>(*a, P, dP, (TS *)dSo, dmask));
    return cudaGetLastError();
}
