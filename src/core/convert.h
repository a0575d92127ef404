/*
 * convert.h - the bulk-conversion dispatch table (plain C by default; convert_x86.c swaps in
 * F16C / AVX-512 versions at init when the CPU has them).
 */
#ifndef AMPC_CONVERT_H
#define AMPC_CONVERT_H

#include "core/core.h"

typedef struct {
    const char *name;   /* "c", "avx2+f16c", "avx512" */
    void (*f32_to_f16)(const float *src, uint16_t *dst, size_t n);
    void (*f16_to_f32)(const uint16_t *src, float *dst, size_t n);
    void (*f32_to_bf16)(const float *src, uint16_t *dst, size_t n);
    void (*bf16_to_f32)(const uint16_t *src, float *dst, size_t n);
} ampc_convert_fns;

extern ampc_convert_fns ampc__convert;

/* Forces a conversion level for tests: "c", "avx2", "avx512" (falls back if unsupported).
   Returns the name now in use. */
const char *ampc__convert_select(const char *level);

#endif /* AMPC_CONVERT_H */
