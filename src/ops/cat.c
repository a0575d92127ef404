/*
 * cat.c - ampc_cat: concatenation along one dim, PyTorch's torch.cat; and its inverse,
 * ampc_narrow (one block along a dim, the copy and its gradient one copy_block each).
 *
 * With every tensor viewed as (outer, size_along_dim * inner) rows, input i is a column block
 * of the output: one backend copy_block per input, and the backward is the same blocks copied
 * out of gy. Mixed float dtypes are promoted to the widest (f16 + bf16 -> f32) through
 * recorded casts, so each input's gradient comes back in its own dtype; under autocast the
 * PROMOTE policy has done that already. Nothing is saved for backward.
 */
#include "ops/ops.h"

#include <stdio.h>

/* outer: product of dims before d; inner: after d */
static void split(int ndim, const int64_t *shape, int d, int64_t *outer, int64_t *inner) {
    *outer = *inner = 1;
    for (int i = 0; i < d; i++) *outer *= shape[i];
    for (int i = d + 1; i < ndim; i++) *inner *= shape[i];
}

/* args.cat.dim: the dim */
static int cat_backward(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    int d = n->args.cat.dim;
    int64_t outer, inner, off = 0;
    split(gy->ndim, gy->shape, d, &outer, &inner);
    int64_t total = gy->shape[d] * inner;
    for (int i = 0; i < n->n_inputs; i++) {
        const ampc_meta *m = &n->in[i];
        int64_t cols = m->shape[d] * inner;
        if (n->next[i]) {
            gx[i] = ampc__tensor_new(gy->dtype, gy->device, m->ndim, m->shape);
            if (!gx[i] || ampc__k_copy_block(gy, off, total, gx[i], 0, cols, outer, cols, 1.0) < 0) return ampc_last_status();
        }
        off += cols;
    }
    return AMPC_OK;
}

/* args.narrow: the dim and the block's start; gx is zero outside the block */
static int narrow_backward(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    const ampc_meta *m = &n->in[0];
    int d = n->args.narrow.dim;
    int64_t outer, inner;
    split(m->ndim, m->shape, d, &outer, &inner);
    int64_t total = m->shape[d] * inner, cols = gy->shape[d] * inner;
    gx[0] = ampc__tensor_new(gy->dtype, gy->device, m->ndim, m->shape);
    if (!gx[0] || ampc__device(gy->device)->fill(gx[0], 0.0) < 0 ||
        ampc__k_copy_block(gy, 0, cols, gx[0], n->args.narrow.start * inner, total, outer, cols, 1.0) < 0)
        return ampc_last_status();
    return AMPC_OK;
}

ampc_tensor *ampc_narrow(ampc_tensor *x, int dim, int64_t start, int64_t length) {
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_NARROW, &a, 1, &x, 0) < 0) return NULL;
    ampc_tensor *in = a.in[0], *out = NULL;
    ampc_node *node = NULL;
    int d;
    char s1[96];
    if (in->ndim == 0) {
        ampc__err(AMPC_ERR_SHAPE, "narrow: a zero-dimensional tensor has no dim to narrow");
        return ampc__op_finish(&a, NULL, NULL);
    }
    if (ampc__norm_dim(dim, in->ndim, &d) < 0) return ampc__op_finish(&a, NULL, NULL);
    if (start < 0 || length < 0 || start > in->shape[d] - length) {
        ampc__err(AMPC_ERR_SHAPE, "narrow: elements [%lld, %lld) of dim %d of %s", (long long)start, (long long)(start + length), d,
                  ampc__shape_str(in, s1, sizeof s1));
        return ampc__op_finish(&a, NULL, NULL);
    }
    int64_t shape[AMPC_MAX_DIMS], outer, inner;
    for (int j = 0; j < in->ndim; j++) shape[j] = in->shape[j];
    shape[d] = length;
    split(in->ndim, in->shape, d, &outer, &inner);
    out = ampc__tensor_new(in->dtype, in->device, in->ndim, shape);
    if (!out || ampc__k_copy_block(in, start * inner, in->shape[d] * inner, out, 0, length * inner, outer, length * inner, 1.0) < 0) {
        ampc__release(out);
        return ampc__op_finish(&a, NULL, NULL);
    }
    if (ampc__needs_grad(a.in, 1)) {
        node = ampc__node_new(ampc_op_grad_fn(AMPC_OP_NARROW), narrow_backward, a.in, 1);
        if (!node) {
            ampc__release(out);
            return ampc__op_finish(&a, NULL, NULL);
        }
        node->args.narrow.dim = d;
        node->args.narrow.start = start;
    }
    return ampc__op_finish(&a, out, node);
}

ampc_tensor *ampc_cat(ampc_tensor *const *xs, int n, int dim) {
    if (!xs || n < 1) return ampc__err_null(AMPC_ERR_INVALID, "cat: expected a non-empty list of tensors, got %d", xs ? n : 0);
    if (n > AMPC_NODE_MAX_INPUTS)
        return ampc__err_null(AMPC_ERR_INVALID, "cat: %d tensors, at most %d in one call (cat in steps)", n, AMPC_NODE_MAX_INPUTS);
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_CAT, &a, n, xs, 0) < 0) return NULL;
    ampc_tensor *c[AMPC_NODE_MAX_INPUTS] = {0}, *out = NULL;
    ampc_node *node = NULL;
    const ampc_tensor *x0 = a.in[0];
    char s1[96], s2[96];
    int d;
    if (x0->ndim == 0) {
        ampc__err(AMPC_ERR_SHAPE, "cat: zero-dimensional tensor (input 0) cannot be concatenated");
        goto done;
    }
    if (ampc__norm_dim(dim, x0->ndim, &d) < 0) goto done;
    ampc_dtype dt = x0->dtype;
    int64_t shape[AMPC_MAX_DIMS];
    for (int j = 0; j < x0->ndim; j++) shape[j] = x0->shape[j];
    for (int i = 1; i < n; i++) {
        const ampc_tensor *t = a.in[i];
        bool same = t->ndim == x0->ndim;
        for (int j = 0; same && j < t->ndim; j++) same = j == d || t->shape[j] == x0->shape[j];
        if (!same) {
            ampc__err(AMPC_ERR_SHAPE, "cat: sizes must match except in dimension %d: input 0 is %s, input %d is %s", d,
                      ampc__shape_str(x0, s1, sizeof s1), i, ampc__shape_str(t, s2, sizeof s2));
            goto done;
        }
        if (t->dtype != dt && (!ampc__dt(t->dtype)->is_float || !ampc__dt(dt)->is_float)) {
            ampc__err(AMPC_ERR_DTYPE, "cat: input %d is %s, which does not mix with %s", i, ampc_dtype_name(t->dtype), ampc_dtype_name(dt));
            goto done;
        }
        dt = ampc__promote(dt, t->dtype);
        shape[d] += t->shape[d];
    }
    for (int i = 0; i < n; i++)
        if (!(c[i] = ampc__cast_record(a.in[i], dt))) goto done;
    if (!(out = ampc__tensor_new(dt, x0->device, x0->ndim, shape))) goto done;
    int64_t outer, inner, off = 0;
    split(x0->ndim, shape, d, &outer, &inner);
    for (int i = 0; i < n; i++) {
        int64_t cols = c[i]->shape[d] * inner;
        if (ampc__k_copy_block(c[i], 0, cols, out, off, shape[d] * inner, outer, cols, 1.0) < 0) {
            ampc__release(out);
            out = NULL;
            goto done;
        }
        off += cols;
    }
    if (ampc__needs_grad(c, n)) {
        if ((node = ampc__node_new(ampc_op_grad_fn(AMPC_OP_CAT), cat_backward, c, n))) {
            node->args.cat.dim = d;
        } else {
            ampc__release(out);
            out = NULL;
        }
    }
done:
    for (int i = 0; i < n; i++) ampc__release(c[i]);
    return ampc__op_finish(&a, out, node);
}
