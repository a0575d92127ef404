/*
 * embedding.c - REF kernels that move rows: the embedding in f64 (the rows the indices pick,
 * and the gradient summed into the rows of gw in index order) and permute (element by
 * element); the oracle of the CPU kernels (src/backend/cpu/embedding.c).
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

/* Every element of y in order, its place in x from the permuted multi-index (any dtype). */
static int ref_permute(const ampc_tensor *x, const int *perm, ampc_tensor *y) {
    const int nd = x->ndim;
    const size_t es = ampc__dt(x->dtype)->size;
    int64_t idx[AMPC_MAX_DIMS] = {0}, xs[AMPC_MAX_DIMS], s = 1;
    for (int i = nd - 1; i >= 0; i--) {
        xs[i] = s;
        s *= x->shape[i];
    }
    for (int64_t e = 0; e < y->numel; e++) {
        int64_t off = 0;
        for (int i = 0; i < nd; i++) off += idx[i] * xs[perm[i]];
        memcpy((char *)ampc__data(y) + (size_t)e * es, (const char *)ampc__data(x) + (size_t)off * es, es);
        for (int i = nd - 1; i >= 0 && ++idx[i] == y->shape[i]; i--) idx[i] = 0;
    }
    return AMPC_OK;
}

void ampc__ref_register_embedding(ampc_backend *be) {
    be->permute = ref_permute;
    be->embedding = ref_embedding;
    be->embedding_backward = ref_embedding_backward;
}
