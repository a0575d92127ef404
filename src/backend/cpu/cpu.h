/*
 * cpu.h - shared helpers of the CPU kernels: chunked load-to-f32 / store-from-f32 so every
 * kernel computes in f32 whatever the storage dtype ("load, convert, compute, store").
 */
#ifndef AMPC_CPU_H
#define AMPC_CPU_H

#include "backend/backend.h"

#define AMPC_CPU_CHUNK 1024   /* elements per f32 staging buffer (4 KiB, on the stack) */

/* n elements of t starting at element i, as f32 into buf (no copy for f32: returns a pointer
   into t's storage). */
static inline const float *ampc__cpu_load(const ampc_tensor *t, size_t i, size_t n, float *buf) {
    if (t->dtype == AMPC_F32) return (const float *)ampc__data(t) + i;
    ampc__dt(t->dtype)->to_f32((const char *)ampc__data(t) + i * ampc__dt(t->dtype)->size, buf, n);
    return buf;
}

/* Where to compute n f32 results for elements [i, i+n) of t: t's storage for f32, else buf. */
static inline float *ampc__cpu_out(ampc_tensor *t, size_t i, float *buf) {
    return t->dtype == AMPC_F32 ? (float *)ampc__data(t) + i : buf;
}

/* Stores the n results computed by ampc__cpu_out (a no-op for f32). */
static inline void ampc__cpu_store(ampc_tensor *t, size_t i, size_t n, const float *buf) {
    if (t->dtype == AMPC_F32) return;
    ampc__dt(t->dtype)->from_f32(buf, (char *)ampc__data(t) + i * ampc__dt(t->dtype)->size, n);
}

/* Implementation name oneDNN picked for this gemm (e.g. "brg:avx512_core_bf16") into buf;
   creates and caches the primitive if needed (gemm.c). For benchmarks and tests. */
int ampc__cpu_gemm_impl(const ampc_gemm_desc *d, ampc_dtype dt, bool has_bias, char *buf, size_t n);
/* Same for a convolution pass (0 forward, 1 backward data, 2 backward weights; conv.c). */
int ampc__cpu_conv_impl(const ampc_conv_desc *d, ampc_dtype dt, int pass, bool has_bias, char *buf, size_t n);

#endif /* AMPC_CPU_H */
