/*
 * ref.h - what the REF kernel files share: optional per-element parameters.
 */
#ifndef AMPC_REF_H
#define AMPC_REF_H

#include "backend/backend.h"

/* Element i of an optional f64 parameter, or dflt without one. */
static inline double at_or(const ampc_tensor *t, int64_t i, double dflt) {
    return t ? ((const double *)ampc__data(t))[i] : dflt;
}

#endif /* AMPC_REF_H */
