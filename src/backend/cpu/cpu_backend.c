/*
 * cpu_backend.c - the CPU table: host memory, f32/f16/bf16 (and i64 labels) storage, f32
 * compute. Copy and fill live here; the other kernels in one file per family.
 */
#include "backend/backend.h"
#include "backend/cpu/cpu.h"
#include "backend/cpu/dnnl_cache.h"

#include <stdlib.h>
#include <string.h>

static void *cpu_alloc(size_t n) { return aligned_alloc(64, (n + 63) & ~(size_t)63); }
static void cpu_free(void *p) { free(p); }

/* Copy between memory formats: each image is a (C, S) matrix in one format and an (S, C) one
   in the other (S = H * W), transposed in tiles of TILE x TILE, float dtypes converted through
   f32 (vectorized row conversions), integers moved as bytes. */
#define TILE 64
static int permuting_copy(const ampc_tensor *src, ampc_tensor *dst) {
    if (src->ndim != 4 || !ampc__same_shape(src, dst))
        return ampc__err(AMPC_ERR_SHAPE, "copy between memory formats needs two 4-D tensors of one shape");
    const ampc_dtype_traits *ts = ampc__dt(src->dtype), *td = ampc__dt(dst->dtype);
    if (ts->is_float != td->is_float || (!ts->is_float && src->dtype != dst->dtype))
        return ampc__err(AMPC_ERR_DTYPE, "copy between memory formats from %s to %s", ts->name, td->name);
    int64_t N = src->shape[0], C = src->shape[1], S = src->shape[2] * src->shape[3];
    /* rows/cols of the source matrix of each image: (C, S) when src is contiguous */
    bool from_cl = ampc__is_cl(src);
    int64_t R = from_cl ? S : C, K = from_cl ? C : S;
    int64_t rt = (R + TILE - 1) / TILE, kt = (K + TILE - 1) / TILE, tiles = N * rt * kt;
    const char *s = ampc__data(src);
    char *d = ampc__data(dst);
    size_t es = ts->size, ed = td->size;
    int nt = ampc__threads_for(src->numel);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n = t / (rt * kt), r0 = t / kt % rt * TILE, k0 = t % kt * TILE;
        int64_t rb = R - r0 < TILE ? R - r0 : TILE, kb = K - k0 < TILE ? K - k0 : TILE;
        const char *sp = s + (size_t)(n * R * K) * es;
        char *dp = d + (size_t)(n * R * K) * ed;
        if (!ts->is_float) {
            for (int64_t r = r0; r < r0 + rb; r++)
                for (int64_t k = k0; k < k0 + kb; k++) memcpy(dp + (size_t)(k * R + r) * ed, sp + (size_t)(r * K + k) * es, es);
            continue;
        }
        float in[TILE][TILE], out[TILE][TILE];
        for (int64_t r = 0; r < rb; r++) ts->to_f32(sp + (size_t)((r0 + r) * K + k0) * es, in[r], (size_t)kb);
        for (int64_t k = 0; k < kb; k++)
            for (int64_t r = 0; r < rb; r++) out[k][r] = in[r][k];
        for (int64_t k = 0; k < kb; k++) td->from_f32(out[k], dp + (size_t)((k0 + k) * R + r0) * ed, (size_t)rb);
    }
    return AMPC_OK;
}

/* Converting copy: through f32 chunks for float dtypes, memcpy when dtypes agree. */
static int cpu_copy(const ampc_tensor *src, ampc_tensor *dst) {
    if (src->format != dst->format && src->numel) return permuting_copy(src, dst);
    size_t n = (size_t)src->numel;
    const ampc_dtype_traits *ts = ampc__dt(src->dtype), *td = ampc__dt(dst->dtype);
    const char *s = ampc__data(src);
    char *d = ampc__data(dst);
    if (src->dtype == dst->dtype) {
        if (s != d) memcpy(d, s, n * ts->size);
        return AMPC_OK;
    }
    int nt = ampc__threads_for((int64_t)n);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (size_t base = 0; base < n; base += AMPC_CPU_CHUNK) {
        float buf[AMPC_CPU_CHUNK];
        size_t m = n - base < AMPC_CPU_CHUNK ? n - base : AMPC_CPU_CHUNK;
        /* an f32 side is converted from/into directly (one pass instead of two) */
        if (src->dtype == AMPC_F32) {
            td->from_f32((const float *)s + base, d + base * td->size, m);
        } else if (dst->dtype == AMPC_F32) {
            ts->to_f32(s + base * ts->size, (float *)d + base, m);
        } else {
            ts->to_f32(s + base * ts->size, buf, m);
            td->from_f32(buf, d + base * td->size, m);
        }
    }
    return AMPC_OK;
}

static int cpu_fill(ampc_tensor *t, double value) {
    size_t n = (size_t)t->numel, sz = ampc__dt(t->dtype)->size;
    char *d = ampc__data(t);
    if (n == 0) return AMPC_OK;
    char one[8];
    if (t->dtype == AMPC_I64) {
        int64_t v = (int64_t)value;
        memcpy(one, &v, 8);
    } else {
        ampc__dt(t->dtype)->from_f64(&value, one, 1);
    }
    if (!memcmp(one, (char[8]){0}, sz)) {   /* zero is all-zero bits in every dtype */
        memset(d, 0, n * sz);
        return AMPC_OK;
    }
    if (sz == 2) {   /* typed stores the compiler vectorizes (f16, bf16) */
        uint16_t v, *p = (uint16_t *)(void *)d;
        memcpy(&v, one, 2);
        for (size_t i = 0; i < n; i++) p[i] = v;
    } else if (sz == 4) {
        uint32_t v, *p = (uint32_t *)(void *)d;
        memcpy(&v, one, 4);
        for (size_t i = 0; i < n; i++) p[i] = v;
    } else {
        for (size_t i = 0; i < n; i++) memcpy(d + i * sz, one, sz);
    }
    return AMPC_OK;
}

/* Autocast's dtypes: bf16 where oneDNN has bf16 kernels (AVX-512), fp16 everywhere (computed in
   f32 and rounded once, as tensor cores do). The kernels take bf16 tensors on every CPU (without
   oneDNN's bf16 kernels through f32 copies, ampc__dnnl_via_f32), but autocast does not offer a
   bf16 that runs slower than fp32 and is no smaller at its peak than fp16. */
static bool cpu_computes(ampc_dtype dt) { return dt != AMPC_BF16 || ampc__dnnl_bf16_ok(); }
/* f32 always; bf16 with AVX512-BF16/AMX; fp16 never (no fp16 arithmetic in oneDNN 2.6 here) */
static bool cpu_native(ampc_dtype dt) { return dt == AMPC_F32 || (dt == AMPC_BF16 && ampc__dnnl_bf16_native()); }

void ampc__cpu_backend_init(ampc_backend *be) {
    memset(be, 0, sizeof *be);
    be->device.name = "cpu";
    be->device.host_memory = true;
    be->channels_last = true;   /* conv (conv.c), pooling (pool.c) and batch norm (batch_norm.c) take NHWC */
    be->device.dtypes[AMPC_F32] = be->device.dtypes[AMPC_F16] = be->device.dtypes[AMPC_BF16] = be->device.dtypes[AMPC_I64] = true;
    be->computes = cpu_computes;
    be->native = cpu_native;
    be->device.raw_alloc = cpu_alloc;
    be->device.raw_free = cpu_free;
    be->device.copy = cpu_copy;
    be->device.fill = cpu_fill;
    ampc__cpu_register_elementwise(be);
    ampc__cpu_register_gemm(be);
    ampc__cpu_register_loss(be);
    ampc__cpu_register_random(be);
    ampc__cpu_register_optim(be);
    ampc__cpu_register_amp(be);
    ampc__cpu_register_conv(be);
    ampc__cpu_register_pool(be);
    ampc__cpu_register_batch_norm(be);
    ampc__cpu_register_layer_norm(be);
    ampc__cpu_register_embedding(be);
    ampc__cpu_register_attention(be);
}
