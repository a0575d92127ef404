/*
 * ref_backend.c - the reference table: f64 storage (and i64 labels), plain loops, no
 * vectorization or threads: the oracle every CPU kernel is tested against.
 */
#include "backend/backend.h"

#include <stdlib.h>
#include <string.h>

static void *ref_alloc(size_t n) { return aligned_alloc(64, (n + 63) & ~(size_t)63); }
static void ref_free(void *p) { free(p); }

static int ref_copy(const ampc_tensor *src, ampc_tensor *dst) {
    if (src->dtype == dst->dtype) {
        memmove(ampc__data(dst), ampc__data(src), ampc__nbytes(src));
        return AMPC_OK;
    }
    size_t n = (size_t)src->numel;
    if (src->dtype == AMPC_I64 && dst->dtype == AMPC_F64) {
        for (size_t i = 0; i < n; i++) ((double *)ampc__data(dst))[i] = (double)((const int64_t *)ampc__data(src))[i];
    } else {
        for (size_t i = 0; i < n; i++) ((int64_t *)ampc__data(dst))[i] = (int64_t)((const double *)ampc__data(src))[i];
    }
    return AMPC_OK;
}

static int ref_fill(ampc_tensor *t, double value) {
    size_t n = (size_t)t->numel;
    if (t->dtype == AMPC_I64)
        for (size_t i = 0; i < n; i++) ((int64_t *)ampc__data(t))[i] = (int64_t)value;
    else
        for (size_t i = 0; i < n; i++) ((double *)ampc__data(t))[i] = value;
    return AMPC_OK;
}

void ampc__ref_backend_init(ampc_backend *be) {
    memset(be, 0, sizeof *be);
    be->name = "ref";
    be->host_memory = true;
    be->dtypes[AMPC_F64] = be->dtypes[AMPC_I64] = true;
    be->raw_alloc = ref_alloc;
    be->raw_free = ref_free;
    be->copy = ref_copy;
    be->fill = ref_fill;
    ampc__ref_register_elementwise(be);
    ampc__ref_register_gemm(be);
    ampc__ref_register_loss(be);
    ampc__ref_register_optim(be);
    ampc__ref_register_amp(be);
    ampc__ref_register_conv(be);
    ampc__ref_register_pool(be);
    ampc__ref_register_norm(be);
}
