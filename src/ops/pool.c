/*
 * pool.c - the pooling ops: ampc_max_pool2d, ampc_avg_pool2d and ampc_adaptive_avg_pool2d on
 * 4-D NCHW float tensors, with PyTorch's shapes, checks and gradients.
 *
 * Each op turns its options into one ampc_pool_desc (ceil_mode becomes extra end padding) and
 * calls the backend. Max pooling for training keeps the backend's workspace (the argmax) in
 * node->extra instead of saving the input: a byte per output on CPU rather than a copy of x.
 * Average pooling saves nothing. Adaptive average pooling whose windows tile the input
 * (H % OH == 0, W % OW == 0; the ResNet global pool) is a plain average pool with kernel =
 * stride = H/OH; other sizes use the backend's ADAPTIVE_AVG windows (a direct loop on CPU).
 * Pooling runs in the input's dtype (autocast policy PASSTHROUGH).
 */
#include "ops/ops.h"

#include <stdio.h>

// ---------------------------------------------------------------------------------------------
// Shapes

/* PyTorch's pooling_output_shape: floor or ceil division, and in ceil mode the last window
   must start inside the input or the left padding. */
static int64_t out_size(int64_t in, int k, int s, int p, bool ceil_mode) {
    int64_t num = in + 2 * (int64_t)p - k + (ceil_mode ? s - 1 : 0);
    int64_t o = (num >= 0 ? num / s : -((-num + s - 1) / s)) + 1;   /* floor division */
    if (ceil_mode && (o - 1) * s >= in + p) o--;
    return o;
}

static ampc_pool_desc make_desc(const ampc_pool_args *pp, const int64_t *xs, int64_t oh, int64_t ow) {
    ampc_pool_desc d = {.kind = pp->kind, .N = xs[0], .C = xs[1], .H = xs[2], .W = xs[3], .OH = oh, .OW = ow};
    int64_t out[2] = {oh, ow};
    for (int i = 0; i < 2; i++) {
        d.kernel[i] = pp->kernel[i];
        d.stride[i] = pp->stride[i];
        d.pad_begin[i] = pp->padding[i];
        /* what the last window needs past the input: more than p when ceil_mode added it */
        int64_t need = (out[i] - 1) * pp->stride[i] + pp->kernel[i] - xs[2 + i] - pp->padding[i];
        d.pad_end[i] = pp->kind == AMPC_POOL_ADAPTIVE_AVG || need < pp->padding[i] ? pp->padding[i] : (int)need;
    }
    return d;
}

/* x: 4-D float with non-empty channel and spatial dims (the batch may be empty). */
static int check_input(const ampc_tensor *x, const char *op) {
    char buf[96];
    if (ampc__check_float(x, op, "input") < 0) return ampc_last_status();
    if (x->ndim != 4 || x->shape[1] == 0 || x->shape[2] == 0 || x->shape[3] == 0)
        return ampc__err(AMPC_ERR_SHAPE, "%s: expected a 4-D (N, C, H, W) input with non-zero C, H, W, got %s", op,
                         ampc__shape_str(x, buf, sizeof buf));
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Forward and backward shared by the three ops

/* args.pool: what rebuilds the descriptor (the shapes come from in[0] and gy); extra: the workspace */
static int pool_backward(ampc_node *n, ampc_tensor *gy_in, ampc_tensor **gx) {
    const ampc_meta *m = &n->in[0];
    ampc_pool_args pp = n->args.pool;
    ampc_tensor *gy = ampc__k_cast(gy_in, m->dtype);
    if (!gy) return ampc_last_status();
    ampc_pool_desc d = make_desc(&pp, m->shape, gy->shape[2], gy->shape[3]);
    d.channels_last = m->format == AMPC_CHANNELS_LAST;   /* gy arrives in it too */
    int rc = AMPC_OK;
    gx[0] = ampc__tensor_new_fmt(m->dtype, gy->device, m->ndim, m->shape, m->format);
    if (!gx[0]) rc = ampc_last_status();
    else if (gx[0]->numel) rc = ampc__k_pool2d_backward(&d, gy, gx[0], n->extra);
    ampc__release(gy);
    return rc;
}

/* Pools a->in[0] (checked) into (N, C, oh, ow), recording op's backward node; consumes a. */
static ampc_tensor *pool_run(ampc_op_args *a, const ampc_pool_args *pp, int64_t oh, int64_t ow, ampc_op op) {
    ampc_tensor *x = a->in[0], *y = NULL;
    ampc_node *node = NULL;
    /* the backward's kernels too: a node that could not run is not recorded */
    if (ampc__backend_check(AMPC_K_pool2d, x->dtype, x->device) < 0 ||
        ampc__backend_check(AMPC_K_pool2d_backward, x->dtype, x->device) < 0 ||
        ampc__backend_check(AMPC_K_pool2d_workspace_size, x->dtype, x->device) < 0)
        goto fail;
    ampc_pool_desc d = make_desc(pp, x->shape, oh, ow);
    d.channels_last = ampc__is_cl(x);   /* the output keeps the input's memory format */
    y = ampc__tensor_new_fmt(x->dtype, x->device, 4, (int64_t[]){x->shape[0], x->shape[1], oh, ow}, x->format);
    if (!y) goto fail;
    void *ws = NULL;
    if (ampc__needs_grad(&x, 1)) {
        if (!(node = ampc__node_new(ampc_op_grad_fn(op), pool_backward, &x, 1))) goto fail;
        node->args.pool = *pp;
        size_t bytes = y->numel ? ampc__k_pool2d_workspace_size(x->device, &d, x->dtype) : 0;
        if (pp->kind == AMPC_POOL_MAX && y->numel && !bytes) {
            ampc__err(AMPC_ERR_BACKEND, "%s: no workspace size from backend %s (%s)", ampc_op_name(a->op), ampc_device_name(x->device), ampc_last_error());
            goto fail;
        }
        if (bytes) {
            /* freed by the engine once backward ran (or with the node) */
            node->extra = ampc__alloc(x->device, bytes, AMPC_MEM_ACTIVATIONS, &node->extra_bytes);
            node->extra_device = x->device;
            if (!node->extra) goto fail;
            ws = node->extra;
        }
    }
    if (y->numel && ampc__k_pool2d(&d, x, y, ws) < 0) goto fail;
    return ampc__op_finish(a, y, node);
fail:
    ampc__release(y);
    ampc__node_release(node);
    ampc__op_args_release(a);
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// Ops

static ampc_tensor *pool_op(ampc_op op, ampc_tensor *x_, const ampc_pool2d_options *o, bool max) {
    ampc_op_args a;
    if (ampc__op_prepare(op, &a, 1, &x_, 0) < 0) return NULL;
    const char *name = ampc_op_name(op);
    ampc_tensor *x = a.in[0];
    ampc_pool_args pp = {.kind = max ? AMPC_POOL_MAX : o && o->exclude_pad ? AMPC_POOL_AVG_EXCLUDE_PAD : AMPC_POOL_AVG_INCLUDE_PAD};
    char buf[96];
    if (!o) {
        ampc__err(AMPC_ERR_INVALID, "%s: options with a kernel size are required", name);
        goto fail;
    }
    for (int i = 0; i < 2; i++) {
        pp.kernel[i] = o->kernel[i];
        pp.stride[i] = o->stride[i] ? o->stride[i] : o->kernel[i];
        pp.padding[i] = o->padding[i];
    }
    if (pp.kernel[0] <= 0 || pp.kernel[1] <= 0 || pp.stride[0] <= 0 || pp.stride[1] <= 0 || pp.padding[0] < 0 ||
        pp.padding[1] < 0) {
        ampc__err(AMPC_ERR_INVALID, "%s: kernel (%d, %d) and stride (%d, %d) must be positive, padding (%d, %d) non-negative", name,
                  pp.kernel[0], pp.kernel[1], o->stride[0], o->stride[1], pp.padding[0], pp.padding[1]);
        goto fail;
    }
    if (pp.padding[0] > pp.kernel[0] / 2 || pp.padding[1] > pp.kernel[1] / 2) {
        ampc__err(AMPC_ERR_INVALID, "%s: padding (%d, %d) should be at most half of kernel size (%d, %d)", name,
                  pp.padding[0], pp.padding[1], pp.kernel[0], pp.kernel[1]);
        goto fail;
    }
    if (check_input(x, name) < 0) goto fail;
    int64_t oh = out_size(x->shape[2], pp.kernel[0], pp.stride[0], pp.padding[0], o->ceil_mode);
    int64_t ow = out_size(x->shape[3], pp.kernel[1], pp.stride[1], pp.padding[1], o->ceil_mode);
    if (oh < 1 || ow < 1) {
        ampc__err(AMPC_ERR_SHAPE, "%s: input %s with kernel (%d, %d), stride (%d, %d), padding (%d, %d) gives output size (%lld, %lld): too small",
                  name, ampc__shape_str(x, buf, sizeof buf), pp.kernel[0], pp.kernel[1], pp.stride[0], pp.stride[1],
                  pp.padding[0], pp.padding[1], (long long)oh, (long long)ow);
        goto fail;
    }
    return pool_run(&a, &pp, oh, ow, max ? AMPC_OP_MAX_POOL2D : AMPC_OP_AVG_POOL2D);
fail:
    ampc__op_args_release(&a);
    return NULL;
}

ampc_tensor *ampc_max_pool2d(ampc_tensor *x, const ampc_pool2d_options *opts) {
    return pool_op(AMPC_OP_MAX_POOL2D, x, opts, true);
}

ampc_tensor *ampc_avg_pool2d(ampc_tensor *x, const ampc_pool2d_options *opts) {
    return pool_op(AMPC_OP_AVG_POOL2D, x, opts, false);
}

ampc_tensor *ampc_adaptive_avg_pool2d(ampc_tensor *x_, int out_h, int out_w) {
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_ADAPTIVE_AVG_POOL2D, &a, 1, &x_, 0) < 0) return NULL;
    ampc_tensor *x = a.in[0];
    if (out_h < 0 || out_w < 0) {
        ampc__err(AMPC_ERR_INVALID, "adaptive_avg_pool2d: output size (%d, %d) must be non-negative", out_h, out_w);
        ampc__op_args_release(&a);
        return NULL;
    }
    if (check_input(x, "adaptive_avg_pool2d") < 0) {
        ampc__op_args_release(&a);
        return NULL;
    }
    int64_t H = x->shape[2], W = x->shape[3];
    ampc_pool_args pp = {.kind = AMPC_POOL_ADAPTIVE_AVG, .kernel = {1, 1}, .stride = {1, 1}};
    if (out_h > 0 && out_w > 0 && H % out_h == 0 && W % out_w == 0) {
        /* the windows tile the input: a plain average pool, which oneDNN runs */
        pp.kind = AMPC_POOL_AVG_EXCLUDE_PAD;
        pp.kernel[0] = pp.stride[0] = (int)(H / out_h);
        pp.kernel[1] = pp.stride[1] = (int)(W / out_w);
    }
    return pool_run(&a, &pp, out_h, out_w, AMPC_OP_ADAPTIVE_AVG_POOL2D);
}
