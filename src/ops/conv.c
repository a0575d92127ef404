/*
 * conv.c - ampc_conv2d: 2-D convolution of NCHW activations with (O, C/groups, kh, kw) weights,
 * PyTorch's F.conv2d (symmetric zero padding, stride, dilation, groups).
 *
 * The op checks shapes and builds an ampc_conv_desc; the backend runs it (the CPU backend in
 * whatever layout oneDNN is fastest, reordering inside). A channels-last input (on a backend
 * that takes it) gives a channels-last output and gradient, with no reorder of activations. Under autocast (policy LOWER) x, w and
 * b arrive as 16-bit casts, and those casts are what the node saves for backward: half the
 * activation memory of fp32 (the input batch itself is saved uncast and recast in backward:
 * ampc__input_to_save). Backward computes only the gradients some input needs: gx from gy
 * and w, gw (with gb in the same pass) from x and gy, and gb alone as a sum of gy when w needs
 * no gradient.
 */
#include "ops/ops.h"

#include <stdio.h>

// ---------------------------------------------------------------------------------------------
// Options and descriptor

/* Options with PyTorch's defaults for zeros; error for negative values. */
static int normalize_options(const ampc_conv2d_options *opts, ampc_conv2d_options *o) {
    *o = opts ? *opts : (ampc_conv2d_options){0};
    for (int i = 0; i < 2; i++) {
        if (o->stride[i] < 0 || o->padding[i] < 0 || o->dilation[i] < 0)
            return ampc__err(AMPC_ERR_INVALID, "conv2d: negative stride (%d, %d), padding (%d, %d) or dilation (%d, %d)",
                             o->stride[0], o->stride[1], o->padding[0], o->padding[1], o->dilation[0], o->dilation[1]);
        if (o->stride[i] == 0) o->stride[i] = 1;
        if (o->dilation[i] == 0) o->dilation[i] = 1;
    }
    if (o->groups < 0) return ampc__err(AMPC_ERR_INVALID, "conv2d: negative groups %d", o->groups);
    if (o->groups == 0) o->groups = 1;
    return AMPC_OK;
}

/* PyTorch's output size; negative numerator (kernel beyond the padded input) gives <= 0. */
static int64_t out_size(int64_t in, int64_t k, int s, int p, int d) {
    int64_t num = in + 2 * (int64_t)p - (int64_t)d * (k - 1) - 1;
    return num < 0 ? 0 : num / s + 1;
}

static ampc_conv_desc make_desc(const int64_t *xs, const int64_t *ws, const ampc_conv2d_options *o) {
    ampc_conv_desc d = {.N = xs[0], .C = xs[1], .H = xs[2], .W = xs[3], .O = ws[0], .KH = ws[2], .KW = ws[3],
                        .groups = o->groups};
    for (int i = 0; i < 2; i++) {
        d.stride[i] = o->stride[i];
        d.padding[i] = o->padding[i];
        d.dilation[i] = o->dilation[i];
    }
    d.OH = out_size(d.H, d.KH, d.stride[0], d.padding[0], d.dilation[0]);
    d.OW = out_size(d.W, d.KW, d.stride[1], d.padding[1], d.dilation[1]);
    return d;
}

/* Float inputs of one dtype (bias may be NULL): outside autocast nothing converts them, as in
   PyTorch, so a mix is the caller's error. */
static int check_dtypes(ampc_tensor *const *in) {
    static const char *names[3] = {"input", "weight", "bias"};
    for (int i = 0; i < 3; i++) {
        if (!in[i]) continue;
        if (ampc__check_float(in[i], "conv2d", names[i]) < 0) return ampc_last_status();
        if (in[i]->dtype != in[0]->dtype)
            return ampc__err(AMPC_ERR_DTYPE, "conv2d: input is %s but %s is %s (cast one of them, or run under autocast)",
                             ampc_dtype_name(in[0]->dtype), names[i], ampc_dtype_name(in[i]->dtype));
    }
    return AMPC_OK;
}

static int check_shapes(const ampc_tensor *x, const ampc_tensor *w, const ampc_tensor *b, const ampc_conv2d_options *o) {
    char s1[96], s2[96];
    if (x->ndim != 4)
        return ampc__err(AMPC_ERR_SHAPE, "conv2d: input must be 4-D (N, C, H, W), got %s", ampc__shape_str(x, s1, sizeof s1));
    if (w->ndim != 4)
        return ampc__err(AMPC_ERR_SHAPE, "conv2d: weight must be 4-D (out_channels, in_channels/groups, kh, kw), got %s",
                         ampc__shape_str(w, s1, sizeof s1));
    if (x->shape[1] == 0 || x->shape[2] == 0 || x->shape[3] == 0)   /* as PyTorch: only the batch may be empty */
        return ampc__err(AMPC_ERR_SHAPE, "conv2d: input %s has an empty non-batch dimension", ampc__shape_str(x, s1, sizeof s1));
    int64_t C = x->shape[1], O = w->shape[0], g = o->groups;
    if (C % g)
        return ampc__err(AMPC_ERR_SHAPE, "conv2d: input %s has %lld channels, not divisible by groups %lld",
                         ampc__shape_str(x, s1, sizeof s1), (long long)C, (long long)g);
    if (O % g)
        return ampc__err(AMPC_ERR_SHAPE, "conv2d: weight %s has %lld output channels, not divisible by groups %lld",
                         ampc__shape_str(w, s1, sizeof s1), (long long)O, (long long)g);
    if (w->shape[1] != C / g)
        return ampc__err(AMPC_ERR_SHAPE, "conv2d: weight %s expects %lld input channels per group but input %s has %lld / %lld = %lld",
                         ampc__shape_str(w, s1, sizeof s1), (long long)w->shape[1], ampc__shape_str(x, s2, sizeof s2),
                         (long long)C, (long long)g, (long long)(C / g));
    if (w->shape[2] < 1 || w->shape[3] < 1)
        return ampc__err(AMPC_ERR_SHAPE, "conv2d: weight %s has an empty kernel", ampc__shape_str(w, s1, sizeof s1));
    if (b && (b->ndim != 1 || b->shape[0] != O))
        return ampc__err(AMPC_ERR_SHAPE, "conv2d: bias %s does not match weight %s: expected (%lld,)", ampc__shape_str(b, s1, sizeof s1),
                         ampc__shape_str(w, s2, sizeof s2), (long long)O);
    for (int i = 0; i < 2; i++) {
        int64_t in = x->shape[2 + i], k = w->shape[2 + i], ext = (int64_t)o->dilation[i] * (k - 1) + 1;
        if (in + 2 * (int64_t)o->padding[i] < ext)
            return ampc__err(AMPC_ERR_SHAPE,
                             "conv2d: kernel %s (dilated extent %lld) is larger than the padded input %s (%s %lld + 2 * padding %d)",
                             ampc__shape_str(w, s1, sizeof s1), (long long)ext, ampc__shape_str(x, s2, sizeof s2),
                             i ? "width" : "height", (long long)in, o->padding[i]);
    }
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Backward

/* saved[0] = x (for gw), saved[1] = w (for gx) */
static int conv2d_backward(ampc_node *n, ampc_tensor *gy_in, ampc_tensor **gx) {
    ampc_conv2d_options o = n->args.conv;
    ampc_conv_desc d = make_desc(n->in[0].shape, n->in[1].shape, &o);
    d.channels_last = n->in[0].format == AMPC_CHANNELS_LAST;   /* gy arrives in it too */
    ampc_dtype dt = n->in[1].dtype;
    ampc_tensor *gy = ampc__k_cast(gy_in, dt);
    if (!gy) return ampc_last_status();
    int rc = AMPC_OK;
    if (n->next[0]) {   /* gx (N, C, H, W) from gy and w */
        gx[0] = ampc__tensor_new_fmt(dt, gy->device, 4, n->in[0].shape, n->in[0].format);
        if (!gx[0]) rc = ampc_last_status();
        else rc = ampc__k_conv2d_backward_data(&d, gy, n->saved[1], gx[0]);
    }
    if (rc >= 0 && n->next[1]) {   /* gw (and gb in the same pass) from x and gy */
        /* under autocast straight into fp32 (both or neither: one kernel call writes them),
           allocated as the gradients they become */
        ampc_dtype gdt = ampc__wgrad_dtype(n, 1, dt);
        if (n->next[2] && ampc__wgrad_dtype(n, 2, dt) != gdt) gdt = dt;
        ampc_mem_kind prev = ampc__mem_kind_push(ampc__grad_kind(n, 1));
        gx[1] = ampc__tensor_new(gdt, gy->device, 4, n->in[1].shape);
        if (n->next[2] && gx[1]) gx[2] = ampc__tensor_new(gdt, gy->device, 1, n->in[2].shape);
        ampc__mem_kind_pop(prev);
        if (!gx[1] || (n->next[2] && !gx[2])) rc = ampc_last_status();
        else {
            ampc_tensor *x = ampc__k_cast(n->saved[0], n->in[0].dtype);   /* saved uncast: ampc__input_to_save */
            rc = x ? ampc__k_conv2d_backward_weights(&d, x, gy, gx[1], gx[2]) : ampc_last_status();
            ampc__release(x);
        }
    } else if (rc >= 0 && n->next[2]) {   /* gb alone: gy summed over (N, OH, OW) */
        ampc_tensor *s = ampc__k_wgrad_sum_to(n, 2, gy, 3, (int64_t[]){d.O, 1, 1});
        gx[2] = s ? ampc__tensor_view(s, 1, (int64_t[]){d.O}) : NULL;
        ampc__release(s);
        if (!gx[2]) rc = ampc_last_status();
    }
    ampc__release(gy);
    return rc;   /* on failure the engine releases whatever gx holds */
}

// ---------------------------------------------------------------------------------------------
// Forward

static ampc_tensor *fail_args(ampc_op_args *a) {
    ampc__op_args_release(a);
    return NULL;
}

ampc_tensor *ampc_conv2d(ampc_tensor *x, ampc_tensor *w, ampc_tensor *b, const ampc_conv2d_options *opts) {
    ampc_op_args a;
    ampc_conv2d_options o;
    if (ampc__op_prepare(AMPC_OP_CONV2D, &a, 3, (ampc_tensor *[]){x, w, b}, 1u << 2) < 0) return NULL;
    ampc_tensor *X = a.in[0], *W = a.in[1], *B = a.in[2];
    if (normalize_options(opts, &o) < 0 || check_dtypes(a.in) < 0 || check_shapes(X, W, B, &o) < 0) return fail_args(&a);
    ampc_conv_desc d = make_desc(X->shape, W->shape, &o);
    d.channels_last = ampc__is_cl(X);   /* the output keeps the input's memory format */
    ampc_tensor *y = ampc__tensor_new_fmt(X->dtype, X->device, 4, (int64_t[]){d.N, d.O, d.OH, d.OW}, X->format);
    if (y && ampc__k_conv2d(&d, X, W, B, y) < 0) {
        ampc__release(y);
        y = NULL;
    }
    ampc_node *node = NULL;
    if (y && ampc__needs_grad(a.in, 3)) {
        node = ampc__node_new(ampc_op_grad_fn(AMPC_OP_CONV2D), conv2d_backward, a.in, 3);
        if (!node) {
            ampc__release(y);
            return fail_args(&a);
        }
        if (node->next[1]) ampc__node_save(node, 0, ampc__input_to_save(&a, 0));
        if (node->next[0]) ampc__node_save(node, 1, W);
        node->args.conv = o;
    }
    return ampc__op_finish(&a, y, node);
}
