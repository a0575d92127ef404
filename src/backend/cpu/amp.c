/*
 * amp.c - CPU kernels of the grad scaler and gradient clipping:
 *   unscale_check: one fused pass per gradient that flags non-finite values (checked on the
 *                  value before scaling, like PyTorch's _amp_foreach_non_finite_check_and_unscale_)
 *                  and multiplies by inv_scale in place (skipped when inv_scale == 1);
 *   sum_squares:   sum of x^2 in double, blockwise so the result does not depend on the
 *                  number of threads.
 * f32 and bf16 are read in place (bf16 converted in registers; AVX-512/AVX2 clones, cpu.h);
 * f16 goes through f32 staging chunks.
 */
#include "backend/cpu/cpu.h"

#include <float.h>
#include <math.h>

// ---------------------------------------------------------------------------------------------
// unscale_check

#define AMP_BLOCK 8192   /* elements per parallel work item */

/* Non-finite test as a float compare (NaN fails every compare), so the loop vectorizes. */
static inline int nonfinite(float v) { return !(fabsf(v) <= FLT_MAX); }

/* Flags non-finite values of n elements of f32 or bf16 storage and, when mul, scales them in
   place (one rounding for bf16). */
AMPC_CPU_INLINE int unscale_body(void *x, size_t n, float inv_scale, bool mul, bool bf) {
    int bad = 0;
    if (!mul) {
#pragma omp simd reduction(| : bad)
        for (size_t i = 0; i < n; i++) bad |= nonfinite(ampc__cpu_ld(x, i, bf));
        return bad;
    }
#pragma omp simd reduction(| : bad)
    for (size_t i = 0; i < n; i++) {
        float v = ampc__cpu_ld(x, i, bf);
        bad |= nonfinite(v);
        ampc__cpu_st(x, i, v * inv_scale, bf);
    }
    return bad;
}
AMPC_CPU_VEC static int unscale_f32(void *x, size_t n, float inv_scale, bool mul) {
    return unscale_body(x, n, inv_scale, mul, false);
}
AMPC_CPU_VEC static int unscale_bf16(void *x, size_t n, float inv_scale, bool mul) {
    return unscale_body(x, n, inv_scale, mul, true);
}

/* Block [b, b + m) of one gradient: checked, and scaled when mul; f16 staged through f32
   chunks (load, check, scale, store). */
static int unscale_block(ampc_tensor *t, size_t b, size_t m, float inv_scale, bool mul) {
    if (ampc__cpu_direct(t->dtype))
        return (t->dtype == AMPC_BF16 ? unscale_bf16 : unscale_f32)(ampc__cpu_at(t, b), m, inv_scale, mul);
    int bad = 0;
    for (size_t c = 0; c < m; c += AMPC_CPU_CHUNK) {
        float buf[AMPC_CPU_CHUNK];
        size_t k = m - c < AMPC_CPU_CHUNK ? m - c : AMPC_CPU_CHUNK;
        ampc__cpu_load(t, b + c, k, buf);   /* t is 16-bit here: always into buf */
        bad |= unscale_f32(buf, k, inv_scale, mul);
        if (mul) ampc__cpu_store(t, b + c, k, buf);
    }
    return bad;
}

#define UNSCALE_GROUP 64   /* gradients per parallel region (the plan lives on the stack) */

/* All gradients' blocks in one parallel region per UNSCALE_GROUP gradients. */
static int cpu_unscale_check(ampc_tensor **grads, int n, float inv_scale, float *found_inf) {
    bool mul = inv_scale != 1.0f;
    int bad = 0;
    for (int at = 0; at < n; at += UNSCALE_GROUP) {
        int k = n - at < UNSCALE_GROUP ? n - at : UNSCALE_GROUP;
        ampc_tensor *const *g = grads + at;
        size_t sz[UNSCALE_GROUP], first[UNSCALE_GROUP + 1];
        for (int j = 0; j < k; j++) sz[j] = g[j] ? (size_t)g[j]->numel : 0;
        size_t elems = ampc__cpu_blocks_plan(sz, k, AMP_BLOCK, first), nblk = first[k];
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)elems)) reduction(| : bad) schedule(static)
        for (size_t b = 0; b < nblk; b++) {
            size_t base, len;
            int j = ampc__cpu_block_at(first, k, b, AMP_BLOCK, sz, &base, &len);
            bad |= unscale_block(g[j], base, len, inv_scale, mul);
        }
    }
    if (bad) *found_inf = 1.0f;   /* never cleared here: the caller zeroes it once per optimizer */
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// sum_squares

/* Eight independent double lanes (vectorizable without reassociation flags, the same sums at
   every vector width); a square of a float is exact in double, so only the additions round. */
AMPC_CPU_VEC static double sumsq_block_f32(const float *restrict x, int64_t n) {
    double acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) {
            double v = x[i + j];
            acc[j] += v * v;
        }
    double tail = 0;
    for (; i < n; i++) tail += (double)x[i] * x[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

static double sumsq_block(const ampc_tensor *t, int64_t b, int64_t m) {
    if (t->dtype == AMPC_F32) return sumsq_block_f32((const float *)ampc__data(t) + b, m);
    double s = 0;
    for (int64_t c = 0; c < m; c += AMPC_CPU_CHUNK) {
        float buf[AMPC_CPU_CHUNK];
        size_t k = (size_t)(m - c < AMPC_CPU_CHUNK ? m - c : AMPC_CPU_CHUNK);
        s += sumsq_block_f32(ampc__cpu_load(t, (size_t)(b + c), k, buf), (int64_t)k);
    }
    return s;
}

static int cpu_sum_squares(const ampc_tensor *t, double *out) {
    int64_t n = t->numel, nb = (n + AMP_BLOCK - 1) / AMP_BLOCK;
    if (nb <= 1) {
        *out = n ? sumsq_block(t, 0, n) : 0.0;
        return AMPC_OK;
    }
    /* per-block partial sums added in block order: the same result for any thread count */
    double stack_part[256], *part = stack_part;
    size_t bytes = 0;
    if (nb > 256) {
        part = ampc__alloc(AMPC_DEVICE_CPU, (size_t)nb * sizeof *part, AMPC_MEM_WORKSPACE, &bytes);
        if (!part) return ampc_last_status();
    }
#pragma omp parallel for num_threads(ampc__threads_for(n)) schedule(static)
    for (int64_t k = 0; k < nb; k++) {
        int64_t b = k * AMP_BLOCK;
        part[k] = sumsq_block(t, b, n - b < AMP_BLOCK ? n - b : AMP_BLOCK);
    }
    double s = 0;
    for (int64_t k = 0; k < nb; k++) s += part[k];
    if (part != stack_part) ampc__free(AMPC_DEVICE_CPU, part, bytes, AMPC_MEM_WORKSPACE);
    *out = s;
    return AMPC_OK;
}

void ampc__cpu_register_amp(ampc_backend *be) {
    be->unscale_check = cpu_unscale_check;
    be->sum_squares = cpu_sum_squares;
}
