/*
 * ref.h - what the REF kernel files share: the argument checks (f64 tensors, NULL allowed, with
 * the element counts expected) and optional per-element parameters.
 */
#ifndef AMPC_REF_H
#define AMPC_REF_H

#include "backend/backend.h"

// ---------------------------------------------------------------------------------------------
// Checks

static inline int check_f64(const ampc_tensor *t, const char *kernel, const char *what) {
    if (t && t->dtype != AMPC_F64)
        return ampc__err(AMPC_ERR_DTYPE, "%s: %s is %s, the ref device computes in f64", kernel, what,
                         ampc_dtype_name(t->dtype));
    return AMPC_OK;
}

static inline int check_numel(const ampc_tensor *t, int64_t n, const char *kernel, const char *what) {
    if (t && t->numel != n)
        return ampc__err(AMPC_ERR_SHAPE, "%s: %s has %lld elements, expected %lld", kernel, what, (long long)t->numel,
                         (long long)n);
    return AMPC_OK;
}

/* Each tensor ts[i] (NULL allowed) is f64 with want[i] elements. */
static inline int check_all(const ampc_tensor *const *ts, const char *const *names, const int64_t *want, int n,
                            const char *k) {
    int rc;
    for (int i = 0; i < n; i++)
        if ((rc = check_f64(ts[i], k, names[i])) < 0 || (rc = check_numel(ts[i], want[i], k, names[i])) < 0) return rc;
    return AMPC_OK;
}

/* Element i of an optional f64 parameter, or dflt without one. */
static inline double at_or(const ampc_tensor *t, int64_t i, double dflt) {
    return t ? ((const double *)ampc__data(t))[i] : dflt;
}

#endif /* AMPC_REF_H */
