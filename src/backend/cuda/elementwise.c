/*
 * elementwise.c - the CUDA table's unary ops and derivatives, broadcasting binary ops,
 * sum_to, expand and copy_block: argument checks and broadcast plans here, the kernels in
 * elementwise.cu. Semantics are the CPU backend's (src/backend/cpu/elementwise.c):
 * f32 compute, one rounding on store, sums in f32.
 */
#include "backend/cuda/cuda.h"
#include "backend/cuda/ew_kernels.h"

#include <string.h>

// ---------------------------------------------------------------------------------------------
// Unary

static int cu_unary(ampc_op op, const ampc_tensor *x, ampc_tensor *y, double alpha) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    if (x->dtype == AMPC_I64)   /* add_scalar on a counter */
        return ampc__cu_check(ampc_cu_add_scalar_i64(ampc__data(x), ampc__data(y), x->numel, (int64_t)alpha, ampc__cu_stream()),
                              "add_scalar on i64");
    return ampc__cu_check(ampc_cu_unary(op, ampc__data(x), x->dtype, ampc__data(y), y->dtype, x->numel, (float)alpha,
                                        ampc__cu_stream()),
                          ampc_op_name(op));
}

static int cu_unary_backward(ampc_op op, const ampc_tensor *x, const ampc_tensor *y, const ampc_tensor *gy,
                             ampc_tensor *gx, double alpha) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    const ampc_tensor *v = x ? x : y;
    return ampc__cu_check(ampc_cu_unary_backward(op, v ? ampc__data(v) : NULL, v ? v->dtype : gy->dtype, ampc__data(gy),
                                                 ampc__data(gx), gx->dtype, gx->numel, (float)alpha, ampc__cu_stream()),
                          "unary_backward");
}

// ---------------------------------------------------------------------------------------------
// Broadcast plans over the output's dims, adjacent dims merged where every operand allows

/* Drops size-1 dims; merges a dim into the previous one where, for every operand, the outer
   stride is the inner stride times the inner size. At least one dim remains. */
static void plan_merge(ampc_cu_bplan *p, int nops) {
    int m = 0;
    for (int i = 0; i < p->nd; i++) {
        if (p->shape[i] == 1) continue;
        bool join = m > 0;
        for (int k = 0; k < nops && join; k++) join = p->st[k][m - 1] == p->st[k][i] * p->shape[i];
        int at = join ? m - 1 : m++;
        p->shape[at] = join ? p->shape[at] * p->shape[i] : p->shape[i];
        for (int k = 0; k < nops; k++) p->st[k][at] = p->st[k][i];
    }
    if (m == 0) {
        p->shape[0] = 1;
        for (int k = 0; k < nops; k++) p->st[k][0] = 0;
        m = 1;
    }
    p->nd = m;
}

/* out = t0 op t1 (t1 NULL: the constant c1) broadcast to out's shape, one dtype (the door's) */
static int broadcast_run(const char *kernel, ampc_op op, const ampc_tensor *t0, const ampc_tensor *t1, float c1,
                         ampc_tensor *out) {
    const ampc_tensor *t[2] = {t0, t1};
    int nops = t1 ? 2 : 1;
    ampc_cu_bplan p = {.nd = out->ndim};
    memcpy(p.shape, out->shape, sizeof(int64_t) * (size_t)out->ndim);
    for (int k = 0; k < nops; k++) ampc__broadcast_strides(t[k], out->ndim, p.st[k]);
    if (out->numel == 0) return AMPC_OK;
    plan_merge(&p, nops);
    return ampc__cu_check(ampc_cu_binary(op, &p, ampc__data(t0), t1 ? ampc__data(t1) : NULL, c1, ampc__data(out), out->dtype,
                                         out->numel, ampc__cu_stream()),
                          kernel);
}

static int cu_binary(ampc_op op, const ampc_tensor *a, const ampc_tensor *b, ampc_tensor *out) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    return broadcast_run("binary", op, a, b, 0.0f, out);
}

static int cu_expand(const ampc_tensor *x, ampc_tensor *out, double alpha) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    return broadcast_run("expand", AMPC_OP_MUL, x, NULL, (float)alpha, out);
}

// ---------------------------------------------------------------------------------------------
// sum_to: x's shape walked with out's strides (0 along summed dims), merged, then split into
// kept and reduced dims with x's own (contiguous) strides.

static int cu_sum_to(const ampc_tensor *x, ampc_tensor *out, double alpha) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    /* p.st[0]: out's strides over x's shape; p.st[1]: x's own */
    ampc_cu_bplan p = {.nd = x->ndim > out->ndim ? x->ndim : out->ndim};
    for (int i = 0; i < p.nd; i++) {
        int j = x->ndim - p.nd + i;
        p.shape[i] = j >= 0 ? x->shape[j] : 1;
    }
    ampc__broadcast_strides(out, p.nd, p.st[0]);
    if (x->numel == out->numel) return cu_unary(AMPC_OP_MUL_SCALAR, x, out, alpha);   /* nothing summed */
    float a = (float)alpha;
    if (x->numel == 0)   /* empty sums are 0 (times alpha: the mean of nothing is NaN) */
        return ampc__cu_check(ampc_cu_fill(ampc__data(out), out->dtype, out->numel, (double)(0.0f * a), ampc__cu_stream()),
                              "sum_to of nothing");
    int64_t step = 1;
    for (int i = p.nd - 1; i >= 0; i--) {
        p.st[1][i] = step;
        step *= p.shape[i];
    }
    plan_merge(&p, 2);
    ampc_cu_rplan r = {.nout = 1, .nred = 1};
    for (int i = 0; i < p.nd; i++) {
        bool kept = p.st[0][i] != 0;
        int64_t *shape = kept ? r.kshape : r.rshape, *st = kept ? r.kst : r.rst;
        int *n = kept ? &r.nk : &r.nr;
        shape[*n] = p.shape[i];
        st[(*n)++] = p.st[1][i];
        *(kept ? &r.nout : &r.nred) *= p.shape[i];
    }
    int64_t splits = ampc_cu_sum_to_splits(&r, ampc__cu_sm_count());
    size_t block = 0;
    float *part = NULL;
    if (splits > 1 && !(part = ampc__cu_scratch((size_t)(splits * r.nout) * sizeof(float), &block))) return ampc_last_status();
    rc = ampc__cu_check(ampc_cu_sum_to(&r, ampc__data(x), x->dtype, ampc__data(out), out->dtype, a, splits, part, ampc__cu_stream()),
                        "sum_to");
    ampc__cu_scratch_free(part, block);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// copy_block: rows of cols elements between strided places, one 2-D copy

static int cu_copy_block(const ampc_tensor *src, int64_t src_off, int64_t src_ld, ampc_tensor *dst, int64_t dst_off,
                         int64_t dst_ld, int64_t rows, int64_t cols, double scale) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    size_t sz = ampc__dt(src->dtype)->size, width = (size_t)cols * sz;
    const char *s = (const char *)ampc__data(src) + (size_t)src_off * sz;
    char *d = (char *)ampc__data(dst) + (size_t)dst_off * sz;
    if (scale != 1.0)   /* f32 (checked) */
        return ampc__cu_check(ampc_cu_scale_rows((const float *)s, src_ld, (float *)d, dst_ld, rows, cols, (float)scale,
                                                 ampc__cu_stream()),
                              "copy_block");
    if (rows == 1 || (src_ld == cols && dst_ld == cols))
        return ampc__cu_check(cudaMemcpyAsync(d, s, width * (size_t)rows, cudaMemcpyDeviceToDevice, ampc__cu_stream()), "copy_block");
    if (src_ld < cols || dst_ld < cols)
        return ampc__err(AMPC_ERR_INVALID, "cuda copy_block: rows of %lld overlap (strides %lld, %lld)", (long long)cols,
                         (long long)src_ld, (long long)dst_ld);
    return ampc__cu_check(cudaMemcpy2DAsync(d, (size_t)dst_ld * sz, s, (size_t)src_ld * sz, width, (size_t)rows,
                                            cudaMemcpyDeviceToDevice, ampc__cu_stream()),
                          "copy_block");
}

void ampc__cuda_register_elementwise(ampc_backend *be) {
    be->unary = cu_unary;
    be->unary_backward = cu_unary_backward;
    be->binary = cu_binary;
    be->sum_to = cu_sum_to;
    be->expand = cu_expand;
    be->copy_block = cu_copy_block;
}
