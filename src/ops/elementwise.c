/*
 * elementwise.c - the elementwise ops and the reductions sum and mean, with their backward.
 *
 * add/sub/mul broadcast like numpy and promote mixed float dtypes like PyTorch (f16 + f32 ->
 * f32, f16 + bf16 -> f32) through recorded casts, so each input's gradient comes back in its
 * own dtype. Each op saves only what its backward reads (the op table's column): add/sub
 * nothing, mul the other operand, relu/tanh/sigmoid/exp their output, gelu/log/pow their input.
 */
#include "ops/ops.h"

#include <string.h>

// ---------------------------------------------------------------------------------------------
// Helpers

/* Gradient g summed down to the shape of input i of n, times alpha; owned (g itself when
   nothing changes: the engine copies before modifying a shared gradient). */
static ampc_tensor *grad_for_input(ampc_node *n, int i, ampc_tensor *g, double alpha) {
    const ampc_meta *m = &n->in[i];
    if (alpha == 1.0 && g->ndim == m->ndim && !memcmp(g->shape, m->shape, sizeof(int64_t) * (size_t)m->ndim))
        return ampc__retain(g);
    return ampc__k_sum_to(g, m->ndim, m->shape, alpha);
}

static ampc_tensor *fail(ampc_op_args *a) {
    ampc__op_args_release(a);
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// add, sub, mul

/* args.add.b_sign: the sign of b's gradient (1 add, -1 sub) */
static int add_backward(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    for (int i = 0; i < 2; i++) {
        if (!n->next[i]) continue;
        gx[i] = grad_for_input(n, i, gy, i ? n->args.add.b_sign : 1.0);
        if (!gx[i]) return ampc_last_status();
    }
    return AMPC_OK;
}

/* saved[0] = a (for b's gradient), saved[1] = b (for a's gradient) */
static int mul_backward(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    for (int i = 0; i < 2; i++) {
        if (!n->next[i]) continue;
        ampc_tensor *t = ampc__k_binary(AMPC_OP_MUL, gy, n->saved[1 - i]);
        if (!t) return ampc_last_status();
        gx[i] = grad_for_input(n, i, t, 1.0);
        ampc__release(t);
        if (!gx[i]) return ampc_last_status();
    }
    return AMPC_OK;
}

static ampc_tensor *binary_op(ampc_op op, ampc_tensor *a_, ampc_tensor *b_) {
    ampc_op_args a;
    if (ampc__op_prepare(op, &a, 2, (ampc_tensor *[]){a_, b_}, 0) < 0) return NULL;
    const char *name = ampc_op_name(op);
    int nd;
    int64_t shape[AMPC_MAX_DIMS];
    if (ampc__check_float(a.in[0], name, "a") < 0 || ampc__check_float(a.in[1], name, "b") < 0 ||
        ampc__broadcast_shapes(a.in[0], a.in[1], &nd, shape) < 0)
        return fail(&a);
    /* type promotion: the casts are recorded, so gradients flow back in each input's dtype */
    ampc_dtype dt = ampc__promote(a.in[0]->dtype, a.in[1]->dtype);
    ampc_tensor *x = ampc__cast_record(a.in[0], dt);
    ampc_tensor *y = x ? ampc__cast_record(a.in[1], dt) : NULL;
    ampc_tensor *out = y ? ampc__k_binary(op, x, y) : NULL;
    ampc_node *node = NULL;
    ampc_tensor *xy[2] = {x, y};
    if (out && ampc__needs_grad(xy, 2)) {
        node = ampc__node_new(ampc_op_grad_fn(op), op == AMPC_OP_MUL ? mul_backward : add_backward, xy, 2);
        if (!node) {
            ampc__release(out);
            out = NULL;
        } else if (op == AMPC_OP_MUL) {
            if (node->next[0]) ampc__node_save(node, 1, y);
            if (node->next[1]) ampc__node_save(node, 0, x);
        } else {
            node->args.add.b_sign = op == AMPC_OP_SUB ? -1.0 : 1.0;
        }
    }
    ampc__release(x);
    ampc__release(y);
    return ampc__op_finish(&a, out, node);
}

ampc_tensor *ampc_add(ampc_tensor *a, ampc_tensor *b) { return binary_op(AMPC_OP_ADD, a, b); }
ampc_tensor *ampc_sub(ampc_tensor *a, ampc_tensor *b) { return binary_op(AMPC_OP_SUB, a, b); }
ampc_tensor *ampc_mul(ampc_tensor *a, ampc_tensor *b) { return binary_op(AMPC_OP_MUL, a, b); }

// ---------------------------------------------------------------------------------------------
// Unary ops (and the scalar add/mul): y = f(x) in x's dtype

/* args.unary: the op and its alpha; saved[0] = x or saved[1] = y */
static int unary_backward(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    ampc_op op = n->args.unary.op;
    double alpha = n->args.unary.alpha;
    if (op == AMPC_OP_ADD_SCALAR) gx[0] = ampc__retain(gy);
    else if (op == AMPC_OP_MUL_SCALAR) gx[0] = ampc__k_unary(AMPC_OP_MUL_SCALAR, gy, alpha);
    else if (ampc__grad_exclusive(gy) && gy->dtype == n->in[0].dtype) {
        /* nobody else sees gy: gx overwrites it (one activation-sized buffer less at the
           backward's peak) */
        gx[0] = ampc__k_unary_backward_over(op, n->saved[0], n->saved[1], gy, alpha);
    } else gx[0] = ampc__k_unary_backward(op, n->saved[0], n->saved[1], gy, alpha);
    return gx[0] ? AMPC_OK : ampc_last_status();
}

/* saves what the op table says its backward reads */
static ampc_tensor *unary_op(ampc_op op, double alpha, ampc_tensor *x_) {
    ampc_op_args a;
    if (ampc__op_prepare(op, &a, 1, &x_, 0) < 0) return NULL;
    ampc_tensor *x = a.in[0];
    if (ampc__check_float(x, ampc_op_name(op), "input") < 0) return fail(&a);
    ampc_tensor *y = ampc__k_unary(op, x, alpha);
    ampc_node *node = NULL;
    if (y && ampc__needs_grad(&x, 1)) {
        node = ampc__node_new(ampc_op_grad_fn(op), unary_backward, &x, 1);
        if (!node) {
            ampc__release(y);
            y = NULL;
        } else {
            node->args.unary.op = op;
            node->args.unary.alpha = alpha;
            ampc_backward_reads reads = ampc_op_backward_reads(op);
            if (reads == AMPC_READS_X) ampc__node_save(node, 0, x);
            if (reads == AMPC_READS_Y) {
                /* a header of its own over y's storage: saving y itself would make y own its
                   node and the node own y, a cycle that leaks when backward never runs */
                ampc_tensor *v = ampc__tensor_view(y, y->ndim, y->shape);
                if (v) ampc__node_save(node, 1, v);
                ampc__release(v);
                if (!v) {
                    ampc__node_release(node);
                    node = NULL;
                    ampc__release(y);
                    y = NULL;
                }
            }
        }
    }
    return ampc__op_finish(&a, y, node);
}

ampc_tensor *ampc_add_scalar(ampc_tensor *x, double s) {
    return unary_op(AMPC_OP_ADD_SCALAR, s, x);
}
ampc_tensor *ampc_mul_scalar(ampc_tensor *x, double s) {
    return unary_op(AMPC_OP_MUL_SCALAR, s, x);
}
ampc_tensor *ampc_relu(ampc_tensor *x) { return unary_op(AMPC_OP_RELU, 0, x); }
ampc_tensor *ampc_gelu(ampc_tensor *x) { return unary_op(AMPC_OP_GELU, 0, x); }
ampc_tensor *ampc_gelu_tanh(ampc_tensor *x) { return unary_op(AMPC_OP_GELU_TANH, 0, x); }
ampc_tensor *ampc_silu(ampc_tensor *x) { return unary_op(AMPC_OP_SILU, 0, x); }
ampc_tensor *ampc_tanh(ampc_tensor *x) { return unary_op(AMPC_OP_TANH, 0, x); }
ampc_tensor *ampc_sigmoid(ampc_tensor *x) {
    return unary_op(AMPC_OP_SIGMOID, 0, x);
}
ampc_tensor *ampc_exp(ampc_tensor *x) { return unary_op(AMPC_OP_EXP, 0, x); }
ampc_tensor *ampc_log(ampc_tensor *x) { return unary_op(AMPC_OP_LOG, 0, x); }
ampc_tensor *ampc_pow(ampc_tensor *x, double exponent) {
    return unary_op(AMPC_OP_POW, exponent, x);
}

// ---------------------------------------------------------------------------------------------
// sum and mean: f32 accumulation, one rounding to the input's dtype (mean scales the f32 sum
// by 1/count before that rounding, as PyTorch does for 16-bit inputs)

/* Shape of x with the reduced dims kept as 1 (d < 0: all dims). */
static void keep_shape(int ndim, const int64_t *shape, int d, int64_t *keep) {
    for (int i = 0; i < ndim; i++) keep[i] = d < 0 || i == d ? 1 : shape[i];
}

/* args.reduce: the reduced dim (-1: all) and alpha (1 or 1/count). gy viewed with the reduced
   dims kept is broadcast back over x's shape. */
static int reduce_backward(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    const ampc_meta *m = &n->in[0];
    int64_t keep[AMPC_MAX_DIMS];
    keep_shape(m->ndim, m->shape, n->args.reduce.dim, keep);
    ampc_tensor *g = ampc__tensor_view(gy, m->ndim, keep);
    if (!g) return ampc_last_status();
    gx[0] = ampc__k_expand(g, m->ndim, m->shape, n->args.reduce.alpha);
    ampc__release(g);
    return gx[0] ? AMPC_OK : ampc_last_status();
}

static ampc_tensor *reduce_op(ampc_op op, bool mean, ampc_tensor *x_, int dim, bool keepdim) {
    ampc_op_args a;
    if (ampc__op_prepare(op, &a, 1, &x_, 0) < 0) return NULL;
    ampc_tensor *x = a.in[0];
    if (ampc__check_float(x, ampc_op_name(op), "input") < 0) return fail(&a);
    int d = -1, nd_out = 0;
    int64_t keep[AMPC_MAX_DIMS], shape_out[AMPC_MAX_DIMS], count = x->numel;
    if (dim != AMPC_ALL_DIMS) {
        if (ampc__norm_dim(dim, x->ndim, &d) < 0) return fail(&a);
        if (x->ndim == 0) d = -1;   /* a 0-d tensor has one element: its only "dim" is all of it */
        else count = x->shape[d];
    }
    keep_shape(x->ndim, x->shape, d, keep);
    for (int i = 0; i < x->ndim; i++)
        if (keepdim || (d >= 0 && i != d)) shape_out[nd_out++] = keep[i];
    double alpha = mean ? 1.0 / (double)count : 1.0;   /* mean of nothing: 0 * inf = NaN */
    ampc_tensor *r = ampc__k_sum_to(x, x->ndim, keep, alpha), *out = r;
    if (r && nd_out != x->ndim) {
        out = ampc__tensor_view(r, nd_out, shape_out);
        ampc__release(r);
    }
    ampc_node *node = NULL;
    if (out && ampc__needs_grad(&x, 1)) {
        node = ampc__node_new(ampc_op_grad_fn(op), reduce_backward, &x, 1);
        if (!node) {
            ampc__release(out);
            out = NULL;
        } else {
            node->args.reduce.dim = d;
            node->args.reduce.alpha = alpha;
        }
    }
    return ampc__op_finish(&a, out, node);
}

ampc_tensor *ampc_sum(ampc_tensor *x, int dim, bool keepdim) {
    return reduce_op(AMPC_OP_SUM, false, x, dim, keepdim);
}
ampc_tensor *ampc_mean(ampc_tensor *x, int dim, bool keepdim) {
    return reduce_op(AMPC_OP_MEAN, true, x, dim, keepdim);
}
