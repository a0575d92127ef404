/*
 * attention.c - ops: scaled-dot-product attention as one op (the kernels' online softmax keeps
 * no Tq x Tk matrix). The node saves q, k, v, the output (through a view without grad_fn, as
 * softmax does: the output itself would make a cycle) and each query row's log-sum-exp; the
 * backward recomputes the probabilities from them.
 */
#include "ops/ops.h"

#include <math.h>
#include <string.h>

static int attention_backward_fn(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    ampc_tensor *q = n->saved[0], *k = n->saved[1], *v = n->saved[2];
    const ampc_attn_desc d = {n->args.attention.batch, n->args.attention.Tq, n->args.attention.Tk, n->args.attention.E,
                              n->args.attention.Ev, n->args.attention.causal, n->args.attention.scale};
    ampc_tensor *g = ampc__k_convert(gy, q->dtype, AMPC_CONTIGUOUS_FORMAT);
    ampc_tensor *dq = g ? ampc__tensor_like(q, q->dtype) : NULL, *dk = dq ? ampc__tensor_like(k, k->dtype) : NULL;
    ampc_tensor *dv = dk ? ampc__tensor_like(v, v->dtype) : NULL;
    int rc = dv ? ampc__k_attention_backward(&d, q, k, v, n->saved[3], n->saved[4], g, dq, dk, dv) : ampc_last_status();
    ampc__release(g);
    if (rc < 0) {
        ampc__release(dq), ampc__release(dk), ampc__release(dv);
        return rc;
    }
    gx[0] = dq, gx[1] = dk, gx[2] = dv;
    return AMPC_OK;
}

static bool same_lead(const ampc_tensor *a, const ampc_tensor *b) {
    if (a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim - 2; i++)
        if (a->shape[i] != b->shape[i]) return false;
    return true;
}

ampc_tensor *ampc_scaled_dot_product_attention(ampc_tensor *q_, ampc_tensor *k_, ampc_tensor *v_, bool is_causal, double scale) {
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_SDPA, &a, 3, (ampc_tensor *[]){q_, k_, v_}, 0) < 0) return NULL;
    ampc_tensor *q = a.in[0], *k = a.in[1], *v = a.in[2], *o = NULL, *lse = NULL;
    const char *name = "scaled_dot_product_attention";
    char s1[96], s2[96], s3[96];
    if (ampc__check_float(q, name, "q") < 0 || ampc__check_float(k, name, "k") < 0 || ampc__check_float(v, name, "v") < 0)
        return ampc__op_finish(&a, NULL, NULL);
    if (q->dtype != k->dtype || q->dtype != v->dtype) {
        ampc__err(AMPC_ERR_DTYPE, "%s: q, k and v are %s, %s and %s (one dtype; autocast casts them)", name, ampc_dtype_name(q->dtype),
                  ampc_dtype_name(k->dtype), ampc_dtype_name(v->dtype));
        return ampc__op_finish(&a, NULL, NULL);
    }
    if (q->ndim < 2 || !same_lead(q, k) || !same_lead(q, v) || k->shape[k->ndim - 2] != v->shape[v->ndim - 2] ||
        q->shape[q->ndim - 1] != k->shape[k->ndim - 1]) {
        ampc__err(AMPC_ERR_SHAPE, "%s: q %s, k %s, v %s; expected (..., Tq, E), (..., Tk, E), (..., Tk, Ev)", name,
                  ampc__shape_str(q, s1, sizeof s1), ampc__shape_str(k, s2, sizeof s2), ampc__shape_str(v, s3, sizeof s3));
        return ampc__op_finish(&a, NULL, NULL);
    }
    if (!isfinite(scale) || scale < 0) {
        ampc__err(AMPC_ERR_INVALID, "%s: scale %g (0: 1/sqrt(E))", name, scale);
        return ampc__op_finish(&a, NULL, NULL);
    }
    const int nd = q->ndim;
    ampc_attn_desc d = {1, q->shape[nd - 2], k->shape[nd - 2], q->shape[nd - 1], v->shape[nd - 1], is_causal, scale};
    for (int i = 0; i < nd - 2; i++) d.batch *= q->shape[i];
    if (d.scale == 0) d.scale = d.E > 0 ? 1.0 / sqrt((double)d.E) : 1.0;
    int64_t oshape[AMPC_MAX_DIMS];
    memcpy(oshape, q->shape, sizeof(int64_t) * (size_t)nd);
    oshape[nd - 1] = d.Ev;
    const ampc_dtype sdt = ampc__device(q->device)->dtypes[AMPC_F32] ? AMPC_F32 : AMPC_F64;
    int64_t nl = d.batch * d.Tq;
    bool grad = ampc__needs_grad(a.in, 3);
    o = ampc__tensor_new(q->dtype, q->device, nd, oshape);
    lse = o && grad ? ampc__tensor_new(sdt, q->device, 1, &nl) : NULL;
    if (!o || (grad && !lse) || ampc__k_attention(&d, q, k, v, o, lse) < 0) {
        ampc__release(o), ampc__release(lse);
        return ampc__op_finish(&a, NULL, NULL);
    }
    ampc_node *node = NULL;
    if (grad) {
        node = ampc__node_new(ampc_op_grad_fn(AMPC_OP_SDPA), attention_backward_fn, a.in, 3);
        ampc_tensor *saved = node ? ampc__tensor_view(o, o->ndim, o->shape) : NULL;
        if (!saved) {
            ampc__release(o), ampc__release(lse);
            return ampc__op_finish(&a, NULL, node);
        }
        for (int i = 0; i < 3; i++) ampc__node_save(node, i, a.in[i]);
        ampc__node_save(node, 3, saved);
        ampc__node_save(node, 4, lse);
        ampc__release(saved);
        node->args.attention.batch = d.batch, node->args.attention.Tq = d.Tq, node->args.attention.Tk = d.Tk;
        node->args.attention.E = d.E, node->args.attention.Ev = d.Ev;
        node->args.attention.causal = d.causal, node->args.attention.scale = d.scale;
    }
    ampc__release(lse);
    return ampc__op_finish(&a, o, node);
}
