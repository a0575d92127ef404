/*
 * dispatch.c - kernel calls that return owned tensors: each allocates its output on the
 * input's device and runs that device's kernel (no autograd, no autocast). The op layer and
 * the autograd engine call these instead of the tables.
 */
#include "backend/backend.h"

#include <string.h>

int ampc__broadcast_shapes(const ampc_tensor *a, const ampc_tensor *b, int *ndim_out, int64_t *out) {
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    for (int i = 0; i < nd; i++) {
        int ia = a->ndim - nd + i, ib = b->ndim - nd + i;
        int64_t da = ia >= 0 ? a->shape[ia] : 1, db = ib >= 0 ? b->shape[ib] : 1;
        if (da != db && da != 1 && db != 1) {
            char s1[96], s2[96];
            return ampc__err(AMPC_ERR_SHAPE, "shapes %s and %s do not broadcast (dim %d: %lld vs %lld)",
                             ampc__shape_str(a, s1, sizeof s1), ampc__shape_str(b, s2, sizeof s2), i,
                             (long long)da, (long long)db);
        }
        out[i] = da == 1 ? db : da;
    }
    *ndim_out = nd;
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Kernel wrappers

#define BACKEND_CALL(t, kernel, ...)                                                               \
    (ampc__backend((t)->device)->kernel                                                            \
         ? ampc__backend((t)->device)->kernel(__VA_ARGS__)                                         \
         : ampc__err(AMPC_ERR_UNSUPPORTED, "%s on device %s", #kernel, ampc_device_name((t)->device)))

static ampc_tensor *finish_kernel(ampc_tensor *out, int rc) {
    if (rc < 0) {
        ampc__release(out);
        return NULL;
    }
    return out;
}

ampc_tensor *ampc__k_convert(ampc_tensor *x, ampc_dtype dt, ampc_memory_format fmt) {
    if (x->dtype == dt && x->format == fmt) return ampc__retain(x);
    /* (n, c, h, w) and (n, h, w, c) order alike when one of the two is a single element */
    if (x->dtype == dt && x->ndim == 4 && (x->shape[1] == 1 || x->shape[2] * x->shape[3] == 1)) {
        ampc_tensor *v = ampc__tensor_view(x, x->ndim, x->shape);   /* same storage, relabelled */
        if (v) v->format = fmt;
        return v;
    }
    ampc_tensor *y = ampc__tensor_new_fmt(dt, x->device, x->ndim, x->shape, fmt);
    if (!y) return NULL;
    return finish_kernel(y, ampc__device(x->device)->copy(x, y));
}

ampc_tensor *ampc__k_cast(ampc_tensor *x, ampc_dtype dt) { return ampc__k_convert(x, dt, x->format); }

ampc_tensor *ampc__k_unary(ampc_op op, ampc_tensor *x, double alpha) {
    ampc_tensor *y = ampc__tensor_like(x, x->dtype);
    if (!y) return NULL;
    return finish_kernel(y, BACKEND_CALL(x, unary, op, x, y, alpha));
}

ampc_tensor *ampc__k_unary_backward(ampc_op op, ampc_tensor *x, ampc_tensor *y, ampc_tensor *gy, double alpha) {
    ampc_tensor *gx = ampc__tensor_like(gy, gy->dtype);
    if (!gx) return NULL;
    return finish_kernel(gx, BACKEND_CALL(gy, unary_backward, op, x, y, gy, gx, alpha));
}

ampc_tensor *ampc__k_unary_backward_over(ampc_op op, ampc_tensor *x, ampc_tensor *y, ampc_tensor *gy, double alpha) {
    int rc = BACKEND_CALL(gy, unary_backward, op, x, y, gy, gy, alpha);
    return rc < 0 ? NULL : ampc__retain(gy);
}

ampc_tensor *ampc__k_binary(ampc_op op, ampc_tensor *a, ampc_tensor *b) {
    int nd;
    int64_t shape[AMPC_MAX_DIMS];
    if (ampc__broadcast_shapes(a, b, &nd, shape) < 0) return NULL;
    if (a->dtype != b->dtype) return ampc__err_null(AMPC_ERR_DTYPE, "binary kernel on %s and %s", ampc_dtype_name(a->dtype), ampc_dtype_name(b->dtype));
    /* channels-last only elementwise over one shape and format (the kernel walks storage) */
    bool cl = ampc__is_cl(a) || ampc__is_cl(b);
    if (cl && (a->format != b->format || !ampc__same_shape(a, b)))
        return ampc__err_null(AMPC_ERR_INVALID, "binary kernel on channels-last tensors of different shapes or formats");
    ampc_tensor *out = ampc__tensor_new_fmt(a->dtype, a->device, nd, shape, a->format);
    if (!out) return NULL;
    return finish_kernel(out, BACKEND_CALL(a, binary, op, a, b, out));
}

/* A channels-last x changing shape is read in contiguous order (sum_to/expand index by shape);
   one keeping its shape keeps its format. */
static ampc_tensor *shape_walk(ampc_tensor *x, int ndim, const int64_t *shape, ampc_memory_format *out_fmt) {
    bool same = ndim == x->ndim && !memcmp(shape, x->shape, sizeof(int64_t) * (size_t)ndim);
    *out_fmt = same ? x->format : AMPC_CONTIGUOUS_FORMAT;
    return same ? ampc__retain(x) : ampc__k_convert(x, x->dtype, AMPC_CONTIGUOUS_FORMAT);
}

ampc_tensor *ampc__k_sum_to_as(ampc_tensor *x_, ampc_dtype out_dt, int ndim, const int64_t *shape, double alpha) {
    ampc_memory_format fmt;
    ampc_tensor *x = shape_walk(x_, ndim, shape, &fmt);
    ampc_tensor *out = x ? ampc__tensor_new_fmt(out_dt, x->device, ndim, shape, fmt) : NULL;
    if (out) out = finish_kernel(out, BACKEND_CALL(x, sum_to, x, out, alpha));
    ampc__release(x);
    return out;
}
ampc_tensor *ampc__k_expand(ampc_tensor *x_, int ndim, const int64_t *shape, double alpha) {
    ampc_memory_format fmt;
    ampc_tensor *x = shape_walk(x_, ndim, shape, &fmt);
    ampc_tensor *out = x ? ampc__tensor_new_fmt(x->dtype, x->device, ndim, shape, fmt) : NULL;
    if (out) out = finish_kernel(out, BACKEND_CALL(x, expand, x, out, alpha));
    ampc__release(x);
    return out;
}

ampc_tensor *ampc__k_sum_to(ampc_tensor *x, int ndim, const int64_t *shape, double alpha) {
    return ampc__k_sum_to_as(x, x->dtype, ndim, shape, alpha);
}

ampc_tensor *ampc__k_gemm_as(const ampc_gemm_desc *d, ampc_tensor *a, ampc_tensor *b, ampc_tensor *bias,
                             ampc_dtype out_dt, int ndim, const int64_t *out_shape) {
    if (ampc__is_cl(a) || ampc__is_cl(b) || (bias && ampc__is_cl(bias)))
        return ampc__err_null(AMPC_ERR_INVALID, "gemm on a channels-last tensor (the op must convert it)");
    ampc_tensor *c = ampc__tensor_new(out_dt, a->device, ndim, out_shape);
    if (!c) return NULL;
    return finish_kernel(c, BACKEND_CALL(a, gemm, d, a, b, bias, c));
}

ampc_tensor *ampc__k_gemm(const ampc_gemm_desc *d, ampc_tensor *a, ampc_tensor *b, ampc_tensor *bias, int ndim,
                          const int64_t *out_shape) {
    return ampc__k_gemm_as(d, a, b, bias, a->dtype, ndim, out_shape);
}

