/*
 * random.cu - CUDA kernels of the ops that draw random numbers: dropout, one thread per Philox
 * block of 4 elements, the stream of the CPU and REF kernels (src/backend/cpu/random.c), in f32,
 * rounded once on store.
 */
#include "backend/cuda/reduce.cuh"

using namespace ampc_cu;

// ---------------------------------------------------------------------------------------------
// Dropout: one thread per Philox block of 4 elements, the CPU's and REF's stream.

/* x * 0 gives NaN for a dropped inf, as PyTorch */
template <class TI, class TO>
__global__ void dropout_kernel(const TI *x, TO *y, uint8_t *mask, int64_t n, uint64_t seed, uint64_t offset, uint32_t thr,
                               float scale, bool vec) {
    int64_t nb = (n + 3) / 4;
    AMPC_CU_LOOP(b, nb) {
        uint4 r = philox4x32_10(seed, offset + (uint64_t)b);
        bool keep[4] = {(r.x >> 8) >= thr, (r.y >> 8) >= thr, (r.z >> 8) >= thr, (r.w >> 8) >= thr};
        if (vec && 4 * b + 4 <= n) {
            float f[4];
            load4(x, b, f);
            for (int l = 0; l < 4; l++) f[l] *= keep[l] ? scale : 0.0f;
            store4(y, b, f);
            ((uchar4 *)mask)[b] = make_uchar4(keep[0], keep[1], keep[2], keep[3]);
            continue;
        }
        for (int l = 0; l < 4 && 4 * b + l < n; l++) {
            int64_t i = 4 * b + l;
            mask[i] = keep[l];
            y[i] = from_f<TO>(to_f<TI>(x[i]) * (keep[l] ? scale : 0.0f));
        }
    }
}

extern "C" cudaError_t ampc_cu_dropout(const void *x, ampc_dtype xdt, void *y, ampc_dtype ydt, uint8_t *mask, int64_t n,
                                       uint64_t seed, uint64_t offset, uint32_t thr, float scale, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    AMPC_CU_FLOAT_TYPES(xdt, TI, AMPC_CU_FLOAT_TYPES(ydt, TO,
        bool vec = aligned4(x, sizeof(TI)) && aligned4(y, sizeof(TO)) && aligned4(mask, 1);
        dropout_kernel<TI, TO><<<blocks_for((n + 3) / 4), 256, 0, s>>>((const TI *)x, (TO *)y, mask, n, seed, offset, thr, scale, vec)));
    return cudaGetLastError();
}

template <class TI, class TO>
__global__ void dropout_backward_kernel(const TI *gy, const uint8_t *mask, TO *gx, int64_t n, float scale, bool vec) {
    loop4(
        n, vec,
        [&](int64_t q) {
            float f[4];
            uchar4 m = ((const uchar4 *)mask)[q];
            load4(gy, q, f);
            f[0] *= m.x ? scale : 0.0f;
            f[1] *= m.y ? scale : 0.0f;
            f[2] *= m.z ? scale : 0.0f;
            f[3] *= m.w ? scale : 0.0f;
            store4(gx, q, f);
        },
        [&](int64_t i) { gx[i] = from_f<TO>(to_f<TI>(gy[i]) * (mask[i] ? scale : 0.0f)); });
}

extern "C" cudaError_t ampc_cu_dropout_backward(const void *gy, ampc_dtype gdt, const uint8_t *mask, void *gx,
                                                ampc_dtype odt, int64_t n, float scale, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    AMPC_CU_FLOAT_TYPES(gdt, TI, AMPC_CU_FLOAT_TYPES(odt, TO,
        bool vec = aligned4(gy, sizeof(TI)) && aligned4(gx, sizeof(TO)) && aligned4(mask, 1);
        dropout_backward_kernel<TI, TO><<<blocks_vec(n, vec), 256, 0, s>>>((const TI *)gy, mask, (TO *)gx, n, scale, vec)));
    return cudaGetLastError();
}
