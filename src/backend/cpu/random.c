/*
 * random.c - CPU kernels of the ops that draw random numbers: dropout. The mask comes from the
 * counter-based Philox stream (core/rng.c; element i uses draw i), so it does not depend on the
 * thread count and equals the REF kernel's; the Philox rounds run on vectors of blocks, the mask
 * is applied in registers. Storage may be f32/f16/bf16: all-f32 or all-bf16 tensors are read
 * and written in place (cpu.h), others go through f32 chunks (one rounding on store).
 */
#include "backend/cpu/cpu.h"

#include <math.h>
#include <omp.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Dropout

#define DROP_BLK 8192   /* elements per work unit of a thread; a multiple of 4 (whole Philox blocks) */

/* A Philox4x32 state, each 32-bit word in a 64-bit lane so a 32x32->64 product is one 64-bit
   multiply per lane with no lane shuffles; passed by value so the simd loop keeps it in
   registers (a local array there becomes an array per lane, in memory). */
typedef struct {
    uint64_t c0, c1, c2, c3;
} philox4;

/* One Philox4x32 round under key (k0, k1), as ampc__philox (core/rng.c) does on uint32_t. */
AMPC_CPU_INLINE philox4 philox_round(philox4 s, uint64_t k0, uint64_t k1) {
    uint64_t p0 = 0xD2511F53u * s.c0, p1 = 0xCD9E8D57u * s.c2;
    return (philox4){(p1 >> 32) ^ s.c1 ^ k0, p1 & 0xffffffffu, (p0 >> 32) ^ s.c3 ^ k1, p0 & 0xffffffffu};
}

/* The 4 mask bytes of a block, stored as one uint32 (byte stores would make the vectorizer
   take 64 blocks per step and spill their state). */
typedef uint32_t mask4 __attribute__((aligned(1), may_alias));

/* b0..b3 as the uint32 whose bytes in memory are b0, b1, b2, b3 */
static inline uint32_t bytes4(uint32_t b0, uint32_t b1, uint32_t b2, uint32_t b3) {
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return b0 << 24 | b1 << 16 | b2 << 8 | b3;
#else
    return b0 | b1 << 8 | b2 << 16 | b3 << 24;
#endif
}

/* Mask of nb whole Philox blocks from block `block`, 4 elements each: element 4b + l is kept
   iff output l of Philox4x32-10 of counter block + b under key seed (ampc__rng_uniform's draw)
   gives a uniform (r >> 8) * 2^-24 not below p, i.e. iff (r >> 8) >= thr = ceil(p * 2^24)
   (p * 2^24 is exact in double). One block per simd lane, all ten rounds in registers. */
AMPC_CPU_VEC static void dropout_mask(uint64_t seed, uint64_t block, size_t nb, uint32_t thr, mask4 *mask) {
    uint64_t k0[10], k1[10];   /* the key of each round (Weyl sequence) */
    for (int r = 0; r < 10; r++) {
        k0[r] = (uint32_t)((uint32_t)seed + (uint32_t)r * 0x9E3779B9u);
        k1[r] = (uint32_t)((uint32_t)(seed >> 32) + (uint32_t)r * 0xBB67AE85u);
    }
#pragma omp simd
    for (size_t b = 0; b < nb; b++) {
        uint64_t ctr = block + b;
        philox4 c = {ctr & 0xffffffffu, ctr >> 32, 0, 0};
        c = philox_round(c, k0[0], k1[0]);
        c = philox_round(c, k0[1], k1[1]);
        c = philox_round(c, k0[2], k1[2]);
        c = philox_round(c, k0[3], k1[3]);
        c = philox_round(c, k0[4], k1[4]);
        c = philox_round(c, k0[5], k1[5]);
        c = philox_round(c, k0[6], k1[6]);
        c = philox_round(c, k0[7], k1[7]);
        c = philox_round(c, k0[8], k1[8]);
        c = philox_round(c, k0[9], k1[9]);
        mask[b] = bytes4((c.c0 >> 8) >= thr, (c.c1 >> 8) >= thr, (c.c2 >> 8) >= thr, (c.c3 >> 8) >= thr);
    }
}

/* Mask of elements [i, i + n) of a dropout with rng state rng; i is a multiple of 4. */
static void mask_range(ampc_rng_state rng, size_t i, size_t n, uint32_t thr, uint8_t *mask) {
    size_t nb = n / 4;
    dropout_mask(rng.seed, rng.offset + i / 4, nb, thr, (mask4 *)mask);
    if (n % 4) {   /* a last, partial block */
        uint32_t last;
        dropout_mask(rng.seed, rng.offset + i / 4 + nb, 1, thr, &last);
        memcpy(mask + 4 * nb, &last, n % 4);
    }
}

/* y = x * (mask ? scale : 0) over f32 or bf16 storage, rounded once; y may be x's array.
   x * 0 keeps PyTorch's NaN for a dropped inf. */
AMPC_CPU_INLINE void apply_body(const void *x, const uint8_t *mk, void *y, size_t n, float scale, bool bf) {
#pragma omp simd
    for (size_t k = 0; k < n; k++) ampc__cpu_st(y, k, ampc__cpu_ld(x, k, bf) * (mk[k] ? scale : 0.0f), bf);
}
AMPC_CPU_VEC static void apply_f32(const void *x, const uint8_t *mk, void *y, size_t n, float scale) {
    apply_body(x, mk, y, n, scale, false);
}
AMPC_CPU_VEC static void apply_bf16(const void *x, const uint8_t *mk, void *y, size_t n, float scale) {
    apply_body(x, mk, y, n, scale, true);
}

/* out[base, base + m) = in * (mask ? scale : 0): in place for all-f32 or all-bf16 storage,
   else through f32 chunks (f16, mixed dtypes). */
static void apply_range(const ampc_tensor *in, const uint8_t *mask, ampc_tensor *out, size_t base, size_t m,
                        float scale) {
    if (ampc__cpu_direct(in->dtype) && in->dtype == out->dtype) {
        (in->dtype == AMPC_BF16 ? apply_bf16 : apply_f32)(ampc__cpu_at(in, base), mask + base, ampc__cpu_at(out, base),
                                                          m, scale);
        return;
    }
    for (size_t j = base; j < base + m; j += AMPC_CPU_CHUNK) {
        float bi[AMPC_CPU_CHUNK], bo[AMPC_CPU_CHUNK];
        size_t c = base + m - j < AMPC_CPU_CHUNK ? base + m - j : AMPC_CPU_CHUNK;
        const float *iv = ampc__cpu_load(in, j, c, bi);
        float *ov = ampc__cpu_out(out, j, bo);
        apply_f32(iv, mask + j, ov, c, scale);
        ampc__cpu_store(out, j, c, ov);
    }
}


void ampc__cpu_dropout_keep(ampc_rng_state rng, uint64_t first, size_t n, double p, uint8_t *keep) {
    const uint32_t thr = ampc__dropout_threshold(p);
    size_t head = first % 4 ? 4 - first % 4 : 0;   /* draws before the next whole Philox block */
    head = head < n ? head : n;
    if (head) {
        uint32_t blk;
        dropout_mask(rng.seed, rng.offset + first / 4, 1, thr, &blk);
        memcpy(keep, (const uint8_t *)&blk + first % 4, head);
    }
    if (n > head) mask_range(rng, (size_t)(first + head), n - head, thr, keep + head);
}

/* Element i uses draw i of the stream (Philox block offset + i / 4, output i % 4), so the mask
   depends neither on the thread count nor on how the work is cut. */
static int cpu_dropout(const ampc_tensor *x, ampc_tensor *y, uint8_t *mask, double p, ampc_rng_state rng) {
    size_t n = (size_t)x->numel;
    uint32_t thr = ampc__dropout_threshold(p);
    float scale = ampc__dropout_scale(p);
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)n)) schedule(static)
    for (size_t base = 0; base < n; base += DROP_BLK) {
        size_t m = n - base < DROP_BLK ? n - base : DROP_BLK;
        mask_range(rng, base, m, thr, mask + base);
        apply_range(x, mask, y, base, m, scale);
    }
    return AMPC_OK;
}

static int cpu_dropout_backward(const ampc_tensor *gy, const uint8_t *mask, double p, ampc_tensor *gx) {
    size_t n = (size_t)gy->numel;
    float scale = ampc__dropout_scale(p);
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)n)) schedule(static)
    for (size_t base = 0; base < n; base += DROP_BLK) {
        size_t m = n - base < DROP_BLK ? n - base : DROP_BLK;
        apply_range(gy, mask, gx, base, m, scale);
    }
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------

void ampc__cpu_register_random(ampc_backend *be) {
    be->dropout = cpu_dropout;
    be->dropout_backward = cpu_dropout_backward;
}
