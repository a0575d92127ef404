/*
 * finite.c - counting non-finite values (NaN, +-inf) in a tensor: the check a training program
 * makes before it replaces a good checkpoint with new weights.
 */
#include "core/core.h"

#include <math.h>

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
    double buf[1024];   /* f64 holds every float dtype's values exactly */
    int64_t bad = 0;
    for (int64_t at = 0; at < t->numel; at += 1024) {
        size_t n = (size_t)(t->numel - at < 1024 ? t->numel - at : 1024);
        dt->to_f64(p + (size_t)at * dt->size, buf, n);
        for (size_t i = 0; i < n; i++) bad += !isfinite(buf[i]);
    }
    return bad;
}
