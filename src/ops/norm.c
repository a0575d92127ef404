/*
 * norm.c - the normalisation ops: ampc_batch_norm2d and ampc_layer_norm.
 *
 * batch norm follows PyTorch's mixed-precision rule: the activation keeps its dtype (16-bit
 * under autocast, policy PASSTHROUGH) while weight, bias and the running statistics stay fp32
 * (f64 on the REF device: its only float dtype), and the statistics are computed in fp32 or
 * better. Training normalises with the batch statistics and updates the running ones in place
 * (unbiased variance, r = (1 - momentum) r + momentum stat); the running statistics are
 * buffers, never part of the graph. The node saves x, weight and the per-channel mean and
 * 1/sqrt(var + eps) the forward used (in evaluation: copies of the running statistics taken
 * at forward time, so a later training step cannot change this step's gradient).
 *
 * ampc__batch_norm2d_relu is ampc_relu(ampc_batch_norm2d(...)) in one op (one node,
 * "NativeBatchNormReluBackward"), bit for bit: the backend's batch_norm_relu kernels write
 * relu(y) and mask the incoming gradient where that output was not positive, recomputing the
 * pre-activation from x and per-channel coefficients saved with the statistics, so no ReLU pass
 * over the activation runs in either direction and no pre-activation tensor is allocated.
 *
 * layer norm normalises over the last norm_ndim dims (autocast runs it in fp32, the table's
 * FP32 policy); outside autocast x, weight and bias share one float dtype.
 */
#include "ops/ops.h"

static ampc_tensor *fail_args(ampc_op_args *a) {
    ampc__op_args_release(a);
    return NULL;
}

/* The gradients a norm node (inputs x, weight, bias) must produce: gx like x, gw/gb with their
   input's metadata; NULL where no gradient is needed. */
static int alloc_grads(const ampc_node *n, const ampc_tensor *x, ampc_tensor *out[3]) {
    if (n->next[0] && !(out[0] = ampc__tensor_like(x, x->dtype))) return ampc_last_status();
    for (int i = 1; i < 3; i++)
        if (n->next[i] && !(out[i] = ampc__tensor_new(n->in[i].dtype, x->device, n->in[i].ndim, n->in[i].shape)))
            return ampc_last_status();
    return AMPC_OK;
}

/* Gives the gradients to the engine, or releases them all when rc is an error. */
static int hand_over(int rc, ampc_tensor *out[3], ampc_tensor **gx) {
    for (int i = 0; i < 3; i++) {
        if (rc < 0) ampc__release(out[i]);
        else gx[i] = out[i];
    }
    return rc < 0 ? rc : AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Batch norm

/* batch_norm_add_relu's node (inputs x, weight, bias, z): saved x, weight, the statistics (2, C)
   and a view of the output y (whose sign masks the gradient) */
static int batch_norm_add_relu_backward(ampc_node *n, ampc_tensor *gy_in, ampc_tensor **gx) {
    ampc_tensor *x = n->saved[0], *w = n->saved[1], *stats = n->saved[2], *y = n->saved[3];
    ampc_tensor *gy = ampc__k_cast(gy_in, x->dtype);
    if (!gy) return ampc_last_status();
    ampc_tensor *out[3] = {NULL, NULL, NULL}, *gz = ampc__tensor_like(x, x->dtype);   /* the kernel always writes gz */
    int rc = gz ? alloc_grads(n, x, out) : ampc_last_status();
    if (rc >= 0) rc = ampc__k_batch_norm_add_relu_backward(x, gy, y, w, stats, n->args.batch_norm.training, out[0], gz, out[1], out[2]);
    ampc__release(gy);
    if (rc < 0 || !n->next[3]) ampc__release(gz);
    else gx[3] = gz;
    return hand_over(rc, out, gx);
}

/* saved: x, weight (NULL if none), then mean, invstd, or with the fused ReLU (args.batch_norm.relu)
   the statistics tensor of batch_norm_relu */
static int batch_norm_backward(ampc_node *n, ampc_tensor *gy_in, ampc_tensor **gx) {
    ampc_tensor *x = n->saved[0], *w = n->saved[1], *mean = n->saved[2], *invstd = n->saved[3];
    bool relu = n->args.batch_norm.relu, sync = n->args.batch_norm.sync, training = n->args.batch_norm.training;
    ampc_tensor *gy = ampc__k_cast(gy_in, x->dtype);
    if (!gy) return ampc_last_status();
    ampc_tensor *out[3] = {NULL, NULL, NULL};
    int rc = alloc_grads(n, x, out);
    if (rc >= 0 && relu) rc = ampc__k_batch_norm_relu_backward(x, gy, w, mean, training, sync, out[0], out[1], out[2]);
    else if (rc >= 0) rc = ampc__k_batch_norm_backward(x, gy, w, mean, invstd, training, sync, out[0], out[1], out[2]);
    ampc__release(gy);
    return hand_over(rc, out, gx);
}

/* weight, bias, running_mean or running_var: (C) in the statistics dtype, on x's device. */
static int check_channel_param(const ampc_tensor *x, const ampc_tensor *p, const char *what, ampc_dtype sdt) {
    char s1[96], s2[96];
    if (!p) return AMPC_OK;
    if (p->device != x->device)
        return ampc__err(AMPC_ERR_INVALID, "batch_norm2d: %s is on device %s but input on %s", what, ampc_device_name(p->device),
                         ampc_device_name(x->device));
    if (p->dtype != sdt)
        return ampc__err(AMPC_ERR_DTYPE, "batch_norm2d: %s is %s; weight, bias and running statistics must be %s on device %s "
                         "(statistics stay in full precision whatever the input's dtype)",
                         what, ampc_dtype_name(p->dtype), ampc_dtype_name(sdt), ampc_device_name(x->device));
    if (p->ndim != 1 || p->shape[0] != x->shape[1])
        return ampc__err(AMPC_ERR_SHAPE, "batch_norm2d: %s has shape %s, expected (%lld,) for input %s", what,
                         ampc__shape_str(p, s1, sizeof s1), (long long)x->shape[1], ampc__shape_str(x, s2, sizeof s2));
    return AMPC_OK;
}

/* z as the batch_norm_add_relu kernels take it: x's device, dtype, shape and memory format */
static bool like(const ampc_tensor *z, const ampc_tensor *x) {
    return z->device == x->device && z->dtype == x->dtype && ampc__same_shape(z, x) && z->format == x->format;
}

/* ampc_batch_norm2d, followed by ReLU in the same kernels when relu, with the statistics of all
   processes when sync; z (then relu, not sync): relu(batch_norm(x) + z) in the backend's
   batch_norm_add_relu kernels */
static ampc_tensor *bn_op(ampc_tensor *x, ampc_tensor *weight, ampc_tensor *bias, ampc_tensor *running_mean,
                          ampc_tensor *running_var, ampc_tensor *z, bool training, double momentum, double eps, bool relu,
                          bool sync) {
    ampc_op_args a;
    /* z stays out of the front door, which would make a channels-last z contiguous (the op
       table lets batch norm keep only x's format) and has no cast for it (PASSTHROUGH): the
       fusable check (add_relu_fusable) made sure it is live and like x */
    if (ampc__op_prepare(AMPC_OP_BATCH_NORM, &a, 3, (ampc_tensor *[]){x, weight, bias}, 6u) < 0) return NULL;
    ampc_tensor *X = a.in[0], *W = a.in[1], *B = a.in[2], *Z = z;
    char s1[96];
    if (ampc__check_float(X, "batch_norm2d", "input") < 0) return fail_args(&a);
    if (X->ndim < 2 || X->ndim > 4) {
        ampc__err(AMPC_ERR_SHAPE, "batch_norm2d: input must be (N, C, H, W) (or (N, C), (N, C, L)), got %s",
                  ampc__shape_str(X, s1, sizeof s1));
        return fail_args(&a);
    }
    ampc_dtype sdt = ampc__device_float(X->device);
    if (check_channel_param(X, W, "weight", sdt) < 0 || check_channel_param(X, B, "bias", sdt) < 0 ||
        check_channel_param(X, running_mean, "running_mean", sdt) < 0 ||
        check_channel_param(X, running_var, "running_var", sdt) < 0)
        return fail_args(&a);
    if (!running_mean != !running_var) {
        ampc__err(AMPC_ERR_INVALID, "batch_norm2d: running_mean and running_var must be given together");
        return fail_args(&a);
    }
    if (!training && !running_mean) {
        ampc__err(AMPC_ERR_INVALID, "batch_norm2d: evaluation mode needs running_mean and running_var");
        return fail_args(&a);
    }
    int64_t M = X->numel / (X->shape[1] ? X->shape[1] : 1);
    if (training && (M <= 1 || X->shape[1] == 0)) {
        ampc__err(AMPC_ERR_INVALID, "batch_norm2d: Expected more than 1 value per channel when training, got input size %s",
                  ampc__shape_str(X, s1, sizeof s1));
        return fail_args(&a);
    }
    if (!(eps >= 0) || !(momentum >= 0 && momentum <= 1)) {
        ampc__err(AMPC_ERR_INVALID, "batch_norm2d: eps %g must be >= 0 and momentum %g in [0, 1]", eps, momentum);
        return fail_args(&a);
    }
    sync = sync && training && ampc__comm()->size > 1;   /* else nothing to exchange: the plain kernels */
    if (Z && !like(Z, X)) {
        char s2[96];
        ampc__err(AMPC_ERR_INVALID, "batch_norm_add_relu: z %s %s does not match x %s %s (dtype, shape, memory format)",
                  ampc_dtype_name(Z->dtype), ampc__shape_str(Z, s1, sizeof s1), ampc_dtype_name(X->dtype), ampc__shape_str(X, s2, sizeof s2));
        return fail_args(&a);
    }
    if (Z && sync) {
        ampc__err(AMPC_ERR_UNSUPPORTED, "batch_norm_add_relu with SyncBatchNorm (compose batch_norm, add and relu)");
        return fail_args(&a);
    }
    int nin = Z ? 4 : 3;
    bool grad = ampc__needs_grad((ampc_tensor *[]){X, W, B, Z}, nin);
    int64_t C = X->shape[1], stat_shape[2] = {Z ? 2 : AMPC_BN_RELU_STAT_ROWS, C};
    ampc_tensor *y = ampc__tensor_like(X, X->dtype), *mean = NULL, *invstd = NULL;
    ampc_node *node = NULL;
    int rc = y ? AMPC_OK : ampc_last_status();
    if (rc >= 0 && grad && (relu || Z)) {   /* one tensor: mean, invstd (and the mask's coefficients) */
        if (!(mean = ampc__tensor_new(sdt, X->device, 2, stat_shape))) rc = ampc_last_status();
    } else if (rc >= 0 && grad) {   /* the statistics only matter to the backward */
        mean = ampc__tensor_new(sdt, X->device, 1, &C);
        invstd = mean ? ampc__tensor_new(sdt, X->device, 1, &C) : NULL;
        if (!invstd) rc = ampc_last_status();
    }
    if (rc >= 0 && Z) rc = ampc__k_batch_norm_add_relu(X, W, B, running_mean, running_var, Z, y, mean, training, momentum, eps);
    else if (rc >= 0 && relu) rc = ampc__k_batch_norm_relu(X, W, B, running_mean, running_var, y, mean, training, momentum, eps, sync);
    else if (rc >= 0) rc = ampc__k_batch_norm(X, W, B, running_mean, running_var, y, mean, invstd, training, momentum, eps, sync);
    if (rc >= 0 && grad) {
        node = ampc__node_new(Z ? "NativeBatchNormAddReluBackward" : relu ? "NativeBatchNormReluBackward" : ampc_op_grad_fn(AMPC_OP_BATCH_NORM),
                              Z ? batch_norm_add_relu_backward : batch_norm_backward, (ampc_tensor *[]){X, W, B, Z}, nin);
        if (node) {
            ampc__node_save(node, 0, X);
            if (W) ampc__node_save(node, 1, W);
            ampc__node_save(node, 2, mean);
            if (invstd) ampc__node_save(node, 3, invstd);
            if (Z) {
                /* a header of its own over y's storage: saving y itself would make y own its node
                   and the node own y, a cycle that leaks when backward never runs */
                ampc_tensor *v = ampc__tensor_view(y, y->ndim, y->shape);
                if (v) ampc__node_save(node, 3, v);
                else rc = ampc_last_status();
                ampc__release(v);
            }
            node->args.batch_norm.training = training;
            node->args.batch_norm.relu = relu;
            node->args.batch_norm.sync = sync;
        } else {
            rc = ampc_last_status();
        }
    }
    ampc__release(mean);
    ampc__release(invstd);
    if (rc < 0) {
        if (node) ampc__node_release(node);
        node = NULL;
        ampc__release(y);
        y = NULL;
    }
    return ampc__op_finish(&a, y, node);
}

ampc_tensor *ampc__batch_norm2d_ex(ampc_tensor *x, ampc_tensor *weight, ampc_tensor *bias, ampc_tensor *running_mean,
                                   ampc_tensor *running_var, bool training, double momentum, double eps, bool relu,
                                   bool sync) {
    return bn_op(x, weight, bias, running_mean, running_var, NULL, training, momentum, eps, relu, sync);
}

/* Whether relu(batch_norm(x) + z) runs as one op: a backend with the kernels, no statistics to
   exchange, z like x (the dtype, shape and memory format the kernels take; under autocast batch
   norm passes the activation through, so x's dtype is the one it runs in). */
static bool add_relu_fusable(const ampc_tensor *x, const ampc_tensor *z, bool training, bool sync) {
    if (!x || !z || !x->gen || !z->gen) return false;   /* the composite reports it */
    return ampc__backend_supports(AMPC_K_batch_norm_add_relu, x->dtype, x->device) && !(sync && training && ampc__comm()->size > 1) && like(z, x);
}

ampc_tensor *ampc__batch_norm2d_add_relu(ampc_tensor *x, ampc_tensor *weight, ampc_tensor *bias, ampc_tensor *running_mean,
                                         ampc_tensor *running_var, ampc_tensor *z, bool training, double momentum, double eps,
                                         bool sync) {
    if (!add_relu_fusable(x, z, training, sync))   /* the composite: the same bits in three ops */
        return ampc_relu(ampc_add(ampc__batch_norm2d_ex(x, weight, bias, running_mean, running_var, training, momentum, eps, false,
                                                        sync),
                                  z));
    return bn_op(x, weight, bias, running_mean, running_var, z, training, momentum, eps, true, sync);
}

ampc_tensor *ampc_batch_norm2d(ampc_tensor *x, ampc_tensor *weight, ampc_tensor *bias, ampc_tensor *running_mean,
                               ampc_tensor *running_var, bool training, double momentum, double eps) {
    return ampc__batch_norm2d_ex(x, weight, bias, running_mean, running_var, training, momentum, eps, false, false);
}

ampc_tensor *ampc_sync_batch_norm2d(ampc_tensor *x, ampc_tensor *weight, ampc_tensor *bias, ampc_tensor *running_mean,
                                    ampc_tensor *running_var, bool training, double momentum, double eps) {
    return ampc__batch_norm2d_ex(x, weight, bias, running_mean, running_var, training, momentum, eps, false, true);
}

ampc_tensor *ampc__batch_norm2d_relu(ampc_tensor *x, ampc_tensor *weight, ampc_tensor *bias, ampc_tensor *running_mean,
                                     ampc_tensor *running_var, bool training, double momentum, double eps) {
    return ampc__batch_norm2d_ex(x, weight, bias, running_mean, running_var, training, momentum, eps, true, false);
}

// ---------------------------------------------------------------------------------------------
// Layer norm

/* saved: x, weight (NULL if none), mean, rstd */
static int layer_norm_backward(ampc_node *n, ampc_tensor *gy_in, ampc_tensor **gx) {
    ampc_tensor *x = n->saved[0], *w = n->saved[1], *mean = n->saved[2], *rstd = n->saved[3];
    ampc_tensor *gy = ampc__k_cast(gy_in, x->dtype);
    if (!gy) return ampc_last_status();
    ampc_tensor *out[3] = {NULL, NULL, NULL};
    int rc = alloc_grads(n, x, out);
    if (rc >= 0) rc = ampc__k_layer_norm_backward(x, gy, w, mean, rstd, out[0], out[1], out[2]);
    ampc__release(gy);
    return hand_over(rc, out, gx);
}

/* weight or bias: the shape of x's last nd dims, x's dtype. */
static int check_ln_param(const ampc_tensor *x, const ampc_tensor *p, int nd, const char *what) {
    char s1[96], s2[96];
    if (!p) return AMPC_OK;
    if (ampc__check_float(p, "layer_norm", what) < 0) return ampc_last_status();
    if (p->dtype != x->dtype)
        return ampc__err(AMPC_ERR_DTYPE, "layer_norm: input is %s but %s is %s (cast one of them, or run under autocast)",
                         ampc_dtype_name(x->dtype), what, ampc_dtype_name(p->dtype));
    bool ok = p->ndim == nd;
    for (int i = 0; ok && i < nd; i++) ok = p->shape[i] == x->shape[x->ndim - nd + i];
    if (!ok)
        return ampc__err(AMPC_ERR_SHAPE, "layer_norm: %s has shape %s, expected the last %d dims of input %s", what,
                         ampc__shape_str(p, s1, sizeof s1), nd, ampc__shape_str(x, s2, sizeof s2));
    return AMPC_OK;
}

ampc_tensor *ampc_layer_norm(ampc_tensor *x, int norm_ndim, ampc_tensor *weight, ampc_tensor *bias, double eps) {
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_LAYER_NORM, &a, 3, (ampc_tensor *[]){x, weight, bias}, 6u) < 0) return NULL;
    ampc_tensor *X = a.in[0], *W = a.in[1], *B = a.in[2];
    char s1[96];
    if (ampc__check_float(X, "layer_norm", "input") < 0) return fail_args(&a);
    if (norm_ndim < 1 || norm_ndim > X->ndim) {
        ampc__err(AMPC_ERR_SHAPE, "layer_norm: cannot normalise over the last %d dims of input %s", norm_ndim,
                  ampc__shape_str(X, s1, sizeof s1));
        return fail_args(&a);
    }
    if (check_ln_param(X, W, norm_ndim, "weight") < 0 || check_ln_param(X, B, norm_ndim, "bias") < 0) return fail_args(&a);
    if (!(eps >= 0)) {
        ampc__err(AMPC_ERR_INVALID, "layer_norm: eps %g must be >= 0", eps);
        return fail_args(&a);
    }
    int64_t rows = 1;
    for (int i = 0; i < X->ndim - norm_ndim; i++) rows *= X->shape[i];
    ampc_dtype sdt = ampc__device_float(X->device);
    ampc_tensor *y = ampc__tensor_like(X, X->dtype), *mean = NULL, *rstd = NULL;
    ampc_node *node = NULL;
    int rc = AMPC_OK;
    if (!y || !(mean = ampc__tensor_new(sdt, X->device, 1, &rows)) || !(rstd = ampc__tensor_new(sdt, X->device, 1, &rows)))
        rc = ampc_last_status();
    if (rc >= 0) rc = ampc__k_layer_norm(X, W, B, y, mean, rstd, eps);
    if (rc >= 0 && ampc__needs_grad(a.in, 3)) {
        node = ampc__node_new(ampc_op_grad_fn(AMPC_OP_LAYER_NORM), layer_norm_backward, a.in, 3);
        if (node) {
            ampc__node_save(node, 0, X);
            if (W) ampc__node_save(node, 1, W);
            ampc__node_save(node, 2, mean);
            ampc__node_save(node, 3, rstd);
        } else {
            rc = ampc_last_status();
        }
    }
    ampc__release(mean);
    ampc__release(rstd);
    if (rc < 0) {
        ampc__release(y);
        y = NULL;
    }
    return ampc__op_finish(&a, y, node);
}

int ampc__batch_norm_count(ampc_tensor *t) {
    if (t->dtype != AMPC_I64 || t->numel != 1)
        return ampc__err(AMPC_ERR_INVALID, "BatchNorm2d: num_batches_tracked must be one i64, not %lld %s",
                         (long long)t->numel, ampc_dtype_name(t->dtype));
    int rc = ampc__k_unary_into(AMPC_OP_ADD_SCALAR, t, t, 1.0);   /* counted where it lives: no copy, no wait */
    if (rc >= 0) ampc__mark_written(t);
    return rc;
}
