/*
 * finite.c - counting non-finite values (NaN, +-inf) in a tensor: the check a training program
 * makes before it replaces a good checkpoint with new weights.
 */
#include "core/core.h"

#include <math.h>
#include <stdint.h>

int64_t ampc_tensor_count_nonfinite(const ampc_tensor *t) {
    int rc = ampc__check_tensor(t, "ampc_tensor_count_nonfinite");
    if (rc < 0) return rc;
    const ampc_dtype_traits *dt = ampc__dt(t->dtype);
    if (!dt->is_float || t->numel == 0) return 0;
    if (!ampc__device(t->device)->host_memory) {   /* counted on a CPU copy */
        ampc_tensor *h = ampc__host_copy(t);
        int64_t n = h ? ampc_tensor_count_nonfinite(h) : ampc_last_status();
        ampc__release(h);
        return n;
    }
    const char *p = ampc__data(t);
    /* by bit pattern: an all-ones exponent is NaN or inf; integer loads the compiler
       vectorises, in parallel for large tensors (the doctor checks every op's output) */
    const int64_t n = t->numel;
    int64_t bad = 0;
    switch (t->dtype) {
    case AMPC_F32: {
        const uint32_t *u = (const uint32_t *)p;
#pragma omp parallel for reduction(+ : bad) schedule(static) if (n > (1 << 16))
        for (int64_t i = 0; i < n; i++) bad += (u[i] & 0x7f800000u) == 0x7f800000u;
        break;
    }
    case AMPC_F16: {
        const uint16_t *u = (const uint16_t *)p;
#pragma omp parallel for reduction(+ : bad) schedule(static) if (n > (1 << 16))
        for (int64_t i = 0; i < n; i++) bad += (u[i] & 0x7c00u) == 0x7c00u;
        break;
    }
    case AMPC_BF16: {
        const uint16_t *u = (const uint16_t *)p;
#pragma omp parallel for reduction(+ : bad) schedule(static) if (n > (1 << 16))
        for (int64_t i = 0; i < n; i++) bad += (u[i] & 0x7f80u) == 0x7f80u;
        break;
    }
    default: {   /* f64 and any other float dtype: through its exact f64 conversion */
        double buf[1024];
        for (int64_t at = 0; at < n; at += 1024) {
            size_t m = (size_t)(n - at < 1024 ? n - at : 1024);
            dt->to_f64(p + (size_t)at * dt->size, buf, m);
            for (size_t i = 0; i < m; i++) bad += !isfinite(buf[i]);
        }
    }
    }
    return bad;
}
