/*
 * loss.c - ops: softmax, log_softmax, mse_loss, cross_entropy, dropout.
 *
 * Softmax and the losses run in f32 whatever the storage (the kernels load 16-bit data to f32)
 * and return the input's dtype outside autocast; under autocast their FP32 policy has already
 * cast 16-bit inputs to f32. cross_entropy is one fused kernel (log-softmax + NLL); its backward
 * recomputes the softmax from the saved logits instead of keeping an (N, C) tensor alive.
 * mse_loss is composed from the elementwise kernels and records one node.
 */
#include "ops/ops.h"

// ---------------------------------------------------------------------------------------------
// Shared

/* The compute dtype of the float kernels on x's device: f64 on REF, f32 on CPU. */
static ampc_dtype compute_dtype(const ampc_tensor *x) { return x->dtype == AMPC_F64 ? AMPC_F64 : AMPC_F32; }

/* Error exit of an op: drops out (may be NULL) and node, releases the inputs, returns NULL. */
static ampc_tensor *fail(ampc_op_args *a, ampc_tensor *out, ampc_node *node) {
    ampc__release(out);
    return ampc__op_finish(a, NULL, node);
}

static ampc_axis_desc axis_of(const ampc_tensor *x, int d) {
    ampc_axis_desc ax = {1, x->ndim ? x->shape[d] : 1, 1};
    for (int i = 0; i < d; i++) ax.outer *= x->shape[i];
    for (int i = d + 1; i < x->ndim; i++) ax.inner *= x->shape[i];
    return ax;
}

// ---------------------------------------------------------------------------------------------
// Softmax / log-softmax. The node saves the output through a view without grad_fn: saving the
// output tensor itself would make a cycle (output -> node -> output).

static int softmax_backward_fn(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    ampc_tensor *y = n->saved[0];
    ampc_axis_desc ax = {n->args.softmax.outer, n->args.softmax.dim, n->args.softmax.inner};
    ampc_tensor *g = ampc__tensor_like(y, y->dtype);
    if (!g) return ampc_last_status();
    int rc = ampc__k_softmax_backward(y, gy, g, ax, n->args.softmax.log);
    if (rc < 0) {
        ampc__release(g);
        return rc;
    }
    gx[0] = g;
    return AMPC_OK;
}

static ampc_tensor *softmax_common(ampc_tensor *x, int dim, bool is_log) {
    ampc_op op = is_log ? AMPC_OP_LOG_SOFTMAX : AMPC_OP_SOFTMAX;
    const char *name = ampc_op_name(op);
    ampc_op_args a;
    if (ampc__op_prepare(op, &a, 1, &x, 0) < 0) return NULL;
    ampc_tensor *in = a.in[0];
    int d;
    if (ampc__check_float(in, name, "input") < 0 || ampc__norm_dim(dim, in->ndim, &d) < 0) return fail(&a, NULL, NULL);
    ampc_axis_desc ax = axis_of(in, d);
    ampc_tensor *y = ampc__tensor_like(in, in->dtype);
    if (!y || ampc__k_softmax(in, y, ax, is_log) < 0) return fail(&a, y, NULL);
    ampc_node *node = NULL;
    if (ampc__needs_grad(a.in, 1)) {
        node = ampc__node_new(ampc_op_grad_fn(is_log ? AMPC_OP_LOG_SOFTMAX : AMPC_OP_SOFTMAX), softmax_backward_fn, a.in, 1);
        ampc_tensor *saved = node ? ampc__tensor_view(y, y->ndim, y->shape) : NULL;
        if (!saved) return fail(&a, y, node);
        ampc__node_save(node, 0, saved);
        ampc__release(saved);
        node->args.softmax.outer = ax.outer;
        node->args.softmax.dim = ax.dim;
        node->args.softmax.inner = ax.inner;
        node->args.softmax.log = is_log;
    }
    return ampc__op_finish(&a, y, node);
}

ampc_tensor *ampc_softmax(ampc_tensor *x, int dim) { return softmax_common(x, dim, false); }
ampc_tensor *ampc_log_softmax(ampc_tensor *x, int dim) { return softmax_common(x, dim, true); }

// ---------------------------------------------------------------------------------------------
// MSE loss: mean/sum/none of (input - target)^2, computed in f32 (f64 on REF) and returned in
// the input's dtype. Gradients: 2 (input - target) * gy / n, and its negative for the target.

static bool valid_reduction(ampc_reduction r) {
    return r == AMPC_REDUCTION_MEAN || r == AMPC_REDUCTION_SUM || r == AMPC_REDUCTION_NONE;
}

/* input - target in the compute dtype; owned */
static ampc_tensor *mse_diff(ampc_tensor *input, ampc_tensor *target) {
    ampc_dtype cdt = compute_dtype(input);
    ampc_tensor *i32 = ampc__k_cast(input, cdt), *t32 = i32 ? ampc__k_cast(target, cdt) : NULL;
    ampc_tensor *d = t32 ? ampc__k_binary(AMPC_OP_SUB, i32, t32) : NULL;
    ampc__release(i32);
    ampc__release(t32);
    return d;
}

static int mse_backward_fn(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    ampc_reduction r = n->args.mse.reduction;
    double numel = n->args.mse.count;
    ampc_tensor *d = mse_diff(n->saved[0], n->saved[1]);
    ampc_tensor *g = d ? ampc__k_cast(gy, d->dtype) : NULL;
    ampc_tensor *g2 = g ? ampc__k_unary(AMPC_OP_MUL_SCALAR, g, r == AMPC_REDUCTION_MEAN ? 2.0 / numel : 2.0) : NULL;
    ampc_tensor *gi = g2 ? ampc__k_binary(AMPC_OP_MUL, d, g2) : NULL;   /* gy of a reduction broadcasts */
    ampc__release(d);
    ampc__release(g);
    ampc__release(g2);
    if (!gi) return ampc_last_status();
    if (n->next[1]) {
        gx[1] = ampc__k_unary(AMPC_OP_MUL_SCALAR, gi, -1.0);
        if (!gx[1]) {
            ampc__release(gi);
            return ampc_last_status();
        }
    }
    if (n->next[0]) gx[0] = gi;
    else ampc__release(gi);
    return AMPC_OK;
}

ampc_tensor *ampc_mse_loss(ampc_tensor *input, ampc_tensor *target, ampc_reduction r) {
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_MSE_LOSS, &a, 2, (ampc_tensor *[]){input, target}, 0) < 0) return NULL;
    ampc_tensor *in = a.in[0], *tg = a.in[1];
    if (ampc__check_float(in, "mse_loss", "input") < 0 || ampc__check_float(tg, "mse_loss", "target") < 0)
        return fail(&a, NULL, NULL);
    if (!valid_reduction(r)) {
        ampc__err(AMPC_ERR_INVALID, "mse_loss: unknown reduction %d", (int)r);
        return fail(&a, NULL, NULL);
    }
    if (!ampc__same_shape(in, tg)) {
        char s1[96], s2[96];
        ampc__err(AMPC_ERR_SHAPE, "mse_loss: input %s and target %s must have the same shape",
                  ampc__shape_str(in, s1, sizeof s1), ampc__shape_str(tg, s2, sizeof s2));
        return fail(&a, NULL, NULL);
    }
    ampc_tensor *d = mse_diff(in, tg);
    ampc_tensor *sq = d ? ampc__k_binary(AMPC_OP_MUL, d, d) : NULL;
    ampc__release(d);
    if (!sq) return fail(&a, NULL, NULL);
    ampc_tensor *loss = sq;
    if (r != AMPC_REDUCTION_NONE) {
        /* sum down to all-ones dims, then a 0-d view (PyTorch's scalar loss) */
        int64_t ones[AMPC_MAX_DIMS] = {1, 1, 1, 1, 1, 1, 1, 1};
        double alpha = r == AMPC_REDUCTION_MEAN ? 1.0 / (double)in->numel : 1.0;   /* 0 elements: NaN */
        ampc_tensor *s = ampc__k_sum_to(sq, sq->ndim, ones, alpha);
        ampc__release(sq);
        loss = s ? ampc__tensor_view(s, 0, ones) : NULL;
        ampc__release(s);
        if (!loss) return fail(&a, NULL, NULL);
    }
    ampc_tensor *out = ampc__k_cast(loss, in->dtype);
    ampc__release(loss);
    if (!out) return fail(&a, NULL, NULL);
    ampc_node *node = NULL;
    if (ampc__needs_grad(a.in, 2)) {
        node = ampc__node_new(ampc_op_grad_fn(AMPC_OP_MSE_LOSS), mse_backward_fn, a.in, 2);
        if (!node) return fail(&a, out, NULL);
        ampc__node_save(node, 0, in);
        ampc__node_save(node, 1, tg);
        node->args.mse.reduction = r;
        node->args.mse.count = (double)in->numel;
    }
    return ampc__op_finish(&a, out, node);
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy: logits (N, C) float, targets (N) i64. The node keeps the logits and targets
// and the MEAN divisor (count of non-ignored rows).

ampc_cross_entropy_options ampc_cross_entropy_defaults(void) {
    return (ampc_cross_entropy_options){.reduction = AMPC_REDUCTION_MEAN, .label_smoothing = 0.0, .ignore_index = -100};
}

static int cross_entropy_backward_fn(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    ampc_tensor *logits = n->saved[0], *targets = n->saved[1];
    ampc_cross_entropy_options o = n->args.cross_entropy.opts;
    ampc_tensor *g = ampc__tensor_like(logits, logits->dtype);
    if (!g) return ampc_last_status();
    int rc = ampc__k_cross_entropy_backward(logits, targets, gy, &o, n->args.cross_entropy.divisor, g);
    if (rc < 0) {
        ampc__release(g);
        return rc;
    }
    gx[0] = g;
    return AMPC_OK;
}

ampc_tensor *ampc_cross_entropy(ampc_tensor *logits, ampc_tensor *targets, const ampc_cross_entropy_options *opts) {
    ampc_cross_entropy_options o = opts ? *opts : ampc_cross_entropy_defaults();
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_CROSS_ENTROPY, &a, 2, (ampc_tensor *[]){logits, targets}, 0) < 0) return NULL;
    ampc_tensor *x = a.in[0], *t = a.in[1];
    char s1[96], s2[96];
    if (ampc__check_float(x, "cross_entropy", "logits") < 0) return fail(&a, NULL, NULL);
    if (t->dtype != AMPC_I64) {
        ampc__err(AMPC_ERR_DTYPE, "cross_entropy: targets must be i64 class indices, not %s", ampc_dtype_name(t->dtype));
        return fail(&a, NULL, NULL);
    }
    if (x->ndim != 2 || t->ndim != 1 || t->shape[0] != x->shape[0]) {
        ampc__err(AMPC_ERR_SHAPE, "cross_entropy: logits %s and targets %s; expected logits (N, C) and targets (N)",
                  ampc__shape_str(x, s1, sizeof s1), ampc__shape_str(t, s2, sizeof s2));
        return fail(&a, NULL, NULL);
    }
    if (!valid_reduction(o.reduction)) {
        ampc__err(AMPC_ERR_INVALID, "cross_entropy: unknown reduction %d", (int)o.reduction);
        return fail(&a, NULL, NULL);
    }
    if (!(o.label_smoothing >= 0.0 && o.label_smoothing <= 1.0)) {
        ampc__err(AMPC_ERR_INVALID, "cross_entropy: label_smoothing %g outside [0, 1]", o.label_smoothing);
        return fail(&a, NULL, NULL);
    }
    bool none = o.reduction == AMPC_REDUCTION_NONE;
    ampc_tensor *out = ampc__tensor_new(x->dtype, x->device, none ? 1 : 0, x->shape);
    double count = 0;
    if (!out || ampc__k_cross_entropy(x, t, &o, out, &count) < 0) return fail(&a, out, NULL);
    ampc_node *node = NULL;
    if (ampc__needs_grad(a.in, 1)) {
        node = ampc__node_new(ampc_op_grad_fn(AMPC_OP_CROSS_ENTROPY), cross_entropy_backward_fn, a.in, 1);
        if (!node) return fail(&a, out, NULL);
        ampc__node_save(node, 0, x);
        ampc__node_save(node, 1, t);
        node->args.cross_entropy.divisor = o.reduction == AMPC_REDUCTION_MEAN ? count : 1.0;
        node->args.cross_entropy.opts = o;
    }
    return ampc__op_finish(&a, out, node);
}

// ---------------------------------------------------------------------------------------------
// Dropout: the 0/1 mask (one byte per element) lives in node->extra until backward.

static int dropout_backward_fn(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    ampc_tensor *g = ampc__tensor_like(gy, gy->dtype);
    if (!g) return ampc_last_status();
    int rc = ampc__k_dropout_backward(gy, n->extra, n->args.dropout.p, g);
    if (rc < 0) {
        ampc__release(g);
        return rc;
    }
    gx[0] = g;
    return AMPC_OK;
}

ampc_tensor *ampc_dropout(ampc_tensor *x, double p, bool training) {
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_DROPOUT, &a, 1, &x, 0) < 0) return NULL;
    ampc_tensor *in = a.in[0];
    if (ampc__check_float(in, "dropout", "input") < 0) return fail(&a, NULL, NULL);
    if (!(p >= 0.0 && p <= 1.0)) {
        ampc__err(AMPC_ERR_INVALID, "dropout probability has to be between 0 and 1, but got %g", p);
        return fail(&a, NULL, NULL);
    }
    if (!training || p == 0.0)
        return ampc__op_finish(&a, ampc__alias_record(in, in->ndim, in->shape, NULL), NULL);
    if (ampc__backend_check(AMPC_K_dropout, in->dtype, in->device) < 0) return fail(&a, NULL, NULL);
    ampc_tensor *y = ampc__tensor_like(in, in->dtype);
    size_t mask_bytes = 0;
    uint8_t *mask = y ? ampc__alloc(in->device, (size_t)(in->numel ? in->numel : 1), AMPC_MEM_ACTIVATIONS,
                                    &mask_bytes)
                      : NULL;
    if (!mask) return fail(&a, y, NULL);
    ampc_rng_state st = ampc__rng_reserve((uint64_t)in->numel);
    ampc_node *node = NULL;
    if (ampc__k_dropout(in, y, mask, p, st) < 0 ||
        (ampc__needs_grad(a.in, 1) && !(node = ampc__node_new(ampc_op_grad_fn(AMPC_OP_DROPOUT), dropout_backward_fn, a.in, 1)))) {
        ampc__free(in->device, mask, mask_bytes, AMPC_MEM_ACTIVATIONS);
        return fail(&a, y, NULL);
    }
    if (node) {
        node->extra = mask;   /* the engine frees it after backward (or with the node) */
        node->extra_bytes = mask_bytes;
        node->extra_device = in->device;
        node->args.dropout.p = p;
    } else {
        ampc__free(in->device, mask, mask_bytes, AMPC_MEM_ACTIVATIONS);
    }
    return ampc__op_finish(&a, y, node);
}
