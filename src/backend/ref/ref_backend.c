/*
 * ref_backend.c - the reference table: f64 storage (and i64 labels), plain loops, no
 * vectorization or threads: the oracle every CPU kernel is tested against.
 */
#include "backend/backend.h"

#include <stdlib.h>
#include <string.h>

static void *ref_alloc(size_t n) { return aligned_alloc(64, (n + 63) & ~(size_t)63); }
static void ref_free(void *p) { free(p); }

/* Element (n, c, s) of a 4-D tensor (s = h * W + w): its index in storage. */
static int64_t at(const ampc_tensor *t, int64_t n, int64_t c, int64_t s) {
    int64_t C = t->shape[1], S = t->shape[2] * t->shape[3];
    return ampc__is_cl(t) ? (n * S + s) * C + c : (n * C + c) * S + s;
}

static int ref_copy(const ampc_tensor *src, ampc_tensor *dst) {
    if (src->format != dst->format && src->numel) {   /* permuting copy, element by element */
        if (src->ndim != 4 || !ampc__same_shape(src, dst))
            return ampc__err(AMPC_ERR_SHAPE, "copy between memory formats needs two 4-D tensors of one shape");
        const ampc_dtype_traits *ts = ampc__dt(src->dtype), *td = ampc__dt(dst->dtype);
        for (int64_t n = 0; n < src->shape[0]; n++)
            for (int64_t c = 0; c < src->shape[1]; c++)
                for (int64_t s = 0; s < src->shape[2] * src->shape[3]; s++) {
                    double v;
                    ts->to_f64((const char *)ampc__data(src) + (size_t)at(src, n, c, s) * ts->size, &v, 1);
                    td->from_f64(&v, (char *)ampc__data(dst) + (size_t)at(dst, n, c, s) * td->size, 1);
                }
        return AMPC_OK;
    }
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
    be->device.name = "ref";
    be->device.host_memory = true;
    be->device.dtypes[AMPC_F64] = be->device.dtypes[AMPC_I64] = true;
    be->device.raw_alloc = ref_alloc;
    be->device.raw_free = ref_free;
    be->device.copy = ref_copy;
    be->device.fill = ref_fill;
    ampc__ref_register_elementwise(be);
    ampc__ref_register_gemm(be);
    ampc__ref_register_loss(be);
    ampc__ref_register_random(be);
    ampc__ref_register_optim(be);
    ampc__ref_register_amp(be);
    ampc__ref_register_conv(be);
    ampc__ref_register_pool(be);
    ampc__ref_register_batch_norm(be);
    ampc__ref_register_layer_norm(be);
    ampc__ref_register_embedding(be);
    ampc__ref_register_attention(be);
}
