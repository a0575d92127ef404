/*
 * embedding.c - REF kernels of the embedding in f64: the rows the indices pick, and the
 * gradient summed into the rows of gw in index order; the oracle of the CPU kernels
 * (src/backend/cpu/embedding.c).
 */
#include "backend/ref/ref.h"

#include <string.h>

static int ref_embedding(const ampc_tensor *w, const ampc_tensor *idx, ampc_tensor *y) {
    const int64_t V = w->shape[0], D = w->shape[1];
    int rc = ampc__host_indices(idx, V, "embedding");
    if (rc < 0) return rc;
    const int64_t *ix = ampc__data(idx);
    const double *src = ampc__data(w);
    double *dst = ampc__data(y);
    for (int64_t i = 0; i < idx->numel; i++)
        for (int64_t c = 0; c < D; c++) dst[i * D + c] = src[ix[i] * D + c];
    return AMPC_OK;
}

static int ref_embedding_backward(const ampc_tensor *gy, const ampc_tensor *idx, ampc_tensor *gw) {
    const int64_t V = gw->shape[0], D = gw->shape[1];
    int rc = ampc__host_indices(idx, V, "embedding_backward");
    if (rc < 0) return rc;
    const int64_t *ix = ampc__data(idx);
    const double *g = ampc__data(gy);
    double *a = ampc__data(gw);
    memset(a, 0, (size_t)(V * D) * sizeof(double));
    for (int64_t i = 0; i < idx->numel; i++)
        for (int64_t c = 0; c < D; c++) a[ix[i] * D + c] += g[i * D + c];
    return AMPC_OK;
}

void ampc__ref_register_embedding(ampc_backend *be) {
    be->embedding = ref_embedding;
    be->embedding_backward = ref_embedding_backward;
}
