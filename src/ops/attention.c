/*
 * attention.c - ops: scaled-dot-product attention as one op (the kernels' online softmax keeps
 * no Tq x Tk matrix). The node saves q, k, v and each query row's log-sum-exp; the backward
 * recomputes the probabilities from them (not the output: the kernels take each row's
 * rowsum(P dP) from the row itself). An additive mask is widened to the statistics
 * dtype once and saved so (viewed at q's rank); dropout's decisions are draws of the rng stream
 * reserved by the forward (node args), drawn again by the backward. The packed form takes q, k, v
 * as the three parts of one tensor (the kernels' packed descriptor) and gives one gradient.
 */
#include "ops/ops.h"

#include <math.h>
#include <string.h>

/* The descriptor of attention over q, k, v (q's rank, leading dims equal): heads, sizes, and the
   layout of mask (NULL or contiguous at q's rank, each dim 1 or q's/(Tq, Tk)'s) */
static ampc_attn_desc make_desc(const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v, const ampc_tensor *mask,
                                bool causal, double scale, double dropout) {
    const int nd = q->ndim;
    ampc_attn_desc d = {.batch = 1, .Tq = q->shape[nd - 2], .Tk = k->shape[nd - 2], .E = q->shape[nd - 1],
                        .Ev = v->shape[nd - 1], .causal = causal, .scale = scale, .dropout = dropout, .nlead = nd - 2};
    for (int i = 0; i < nd - 2; i++) d.batch *= d.lead[i] = q->shape[i];
    if (mask) {
        int64_t st = 1, stride[AMPC_MAX_DIMS];
        for (int i = nd - 1; i >= 0; i--) {
            stride[i] = mask->shape[i] == 1 ? 0 : st;
            st *= mask->shape[i];
        }
        memcpy(d.mask_lead, stride, sizeof(int64_t) * (size_t)(nd - 2));
        d.mask_si = stride[nd - 2], d.mask_sj = stride[nd - 1];
    }
    return d;
}

static int attention_backward_fn(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    ampc_tensor *q = n->saved[0], *k = n->saved[1], *v = n->saved[2], *mask = n->saved[4];
    ampc_attn_desc d = make_desc(q, k, v, mask, n->args.attention.causal, n->args.attention.scale, n->args.attention.dropout);
    d.rng = (ampc_rng_state){n->args.attention.rng_seed, n->args.attention.rng_offset};
    ampc_tensor *g = ampc__k_convert(gy, q->dtype, AMPC_CONTIGUOUS_FORMAT);
    ampc_tensor *dq = g ? ampc__tensor_like(q, q->dtype) : NULL, *dk = dq ? ampc__tensor_like(k, k->dtype) : NULL;
    ampc_tensor *dv = dk ? ampc__tensor_like(v, v->dtype) : NULL, *ds = NULL, *dm = NULL;
    int rc = dv ? AMPC_OK : ampc_last_status();
    if (rc >= 0 && mask && n->next[3]) {   /* the scores' gradient, at q's rank, summed down to the mask's shape */
        int64_t full[AMPC_MAX_DIMS];
        memcpy(full, q->shape, sizeof(int64_t) * (size_t)q->ndim);
        full[q->ndim - 1] = d.Tk;
        if (!(ds = ampc__tensor_new(mask->dtype, mask->device, q->ndim, full))) rc = ampc_last_status();
    }
    if (rc >= 0) rc = ampc__k_attention_backward(&d, q, k, v, mask, n->saved[3], g, dq, dk, dv, ds);
    if (rc >= 0 && ds) {
        ampc_tensor *sum = ampc__k_sum_to(ds, mask->ndim, mask->shape, 1.0);
        ampc_tensor *cast = sum ? ampc__k_cast(sum, ampc__grad_dtype(n, 3)) : NULL;
        dm = cast ? ampc__tensor_view(cast, n->in[3].ndim, n->in[3].shape) : NULL;
        ampc__release(sum), ampc__release(cast);
        if (!dm) rc = ampc_last_status();
    }
    ampc__release(g), ampc__release(ds);
    if (rc < 0) {
        ampc__release(dq), ampc__release(dk), ampc__release(dv), ampc__release(dm);
        return rc;
    }
    gx[0] = dq, gx[1] = dk, gx[2] = dv, gx[3] = dm;
    return AMPC_OK;
}

static bool same_lead(const ampc_tensor *a, const ampc_tensor *b) {
    if (a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim - 2; i++)
        if (a->shape[i] != b->shape[i]) return false;
    return true;
}

/* The mask widened to the statistics dtype sdt and viewed at q's rank (leading 1s), after
   checking it broadcasts to (..., Tq, Tk); owned, or NULL with the error set. */
static ampc_tensor *mask_for_kernels(const ampc_tensor *q, ampc_tensor *mask, int64_t Tk, ampc_dtype sdt, const char *name) {
    char s1[96], s2[96];
    const int nd = q->ndim;
    int64_t want[AMPC_MAX_DIMS], padded[AMPC_MAX_DIMS];
    memcpy(want, q->shape, sizeof(int64_t) * (size_t)nd);
    want[nd - 1] = Tk;
    if (ampc__check_float(mask, name, "attn_mask") < 0) return NULL;
    bool ok = mask->ndim >= 1 && mask->ndim <= nd;
    for (int i = 0; ok && i < nd; i++) {
        int mi = i - (nd - mask->ndim);
        padded[i] = mi < 0 ? 1 : mask->shape[mi];
        ok = padded[i] == 1 || padded[i] == want[i];
    }
    if (!ok) {
        ampc__err(AMPC_ERR_SHAPE, "%s: attn_mask %s does not broadcast to the scores of q %s: (..., %lld, %lld)", name,
                  ampc__shape_str(mask, s1, sizeof s1), ampc__shape_str(q, s2, sizeof s2), (long long)want[nd - 2], (long long)Tk);
        return NULL;
    }
    ampc_tensor *wide = ampc__k_convert(mask, sdt, AMPC_CONTIGUOUS_FORMAT);
    ampc_tensor *view = wide ? ampc__tensor_view(wide, nd, padded) : NULL;
    ampc__release(wide);
    return view;
}

/* scale >= 0 (0: 1/sqrt(E)) and finite, dropout_p in [0, 1]; else the error, naming the op */
static int check_settings(const char *name, double scale, double dropout_p) {
    if (!isfinite(scale) || scale < 0) return ampc__err(AMPC_ERR_INVALID, "%s: scale %g (0: 1/sqrt(E))", name, scale);
    if (!(dropout_p >= 0 && dropout_p <= 1)) return ampc__err(AMPC_ERR_INVALID, "%s: dropout_p %g outside [0, 1]", name, dropout_p);
    return AMPC_OK;
}

/* What both forms share once their inputs are checked: the default scale and dropout's draws in
   d, the output (nd dims of oshape, q's dtype) and the log-sum-exps, the kernel, and the node
   (backward fn bwd over a's inputs, saving the first three of them (q, k, v; or the packed one),
   the statistics and the mask (owned here; NULL: none)). */
static ampc_tensor *run_attention(ampc_op_args *a, ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k,
                                  const ampc_tensor *v, ampc_tensor *mask, int nd, const int64_t *oshape, ampc_backward_fn bwd) {
    if (d->scale == 0) d->scale = d->E > 0 ? 1.0 / sqrt((double)d->E) : 1.0;
    if (d->dropout > 0) d->rng = ampc__rng_reserve((uint64_t)(d->batch * d->Tq * d->Tk));
    const ampc_dtype sdt = ampc__device_float(q->device);
    int64_t nl = d->batch * d->Tq;
    bool grad = ampc__needs_grad(a->in, a->n);
    ampc_tensor *o = ampc__tensor_new(q->dtype, q->device, nd, oshape);
    ampc_tensor *lse = o && grad ? ampc__tensor_new(sdt, q->device, 1, &nl) : NULL;
    ampc_node *node = NULL;
    if (!o || (grad && !lse) || ampc__k_attention(d, q, k, v, mask, o, lse) < 0 ||
        (grad && !(node = ampc__node_new(ampc_op_grad_fn(AMPC_OP_SDPA), bwd, a->in, a->n)))) {
        ampc__release(o), ampc__release(lse), ampc__release(mask);
        return ampc__op_finish(a, NULL, NULL);
    }
    if (node) {
        for (int i = 0; i < a->n && i < 3; i++) ampc__node_save(node, i, a->in[i]);
        ampc__node_save(node, 3, lse);
        if (mask) ampc__node_save(node, 4, mask);
        node->args.attention.causal = d->causal, node->args.attention.scale = d->scale;
        node->args.attention.dropout = d->dropout;
        node->args.attention.rng_seed = d->rng.seed, node->args.attention.rng_offset = d->rng.offset;
    }
    ampc__release(lse), ampc__release(mask);
    return ampc__op_finish(a, o, node);
}

ampc_tensor *ampc_scaled_dot_product_attention(ampc_tensor *q_, ampc_tensor *k_, ampc_tensor *v_, ampc_tensor *attn_mask,
                                               double dropout_p, bool is_causal, double scale) {
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_SDPA, &a, 4, (ampc_tensor *[]){q_, k_, v_, attn_mask}, 1u << 3) < 0) return NULL;
    ampc_tensor *q = a.in[0], *k = a.in[1], *v = a.in[2], *mask = NULL;
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
    if (check_settings(name, scale, dropout_p) < 0) return ampc__op_finish(&a, NULL, NULL);
    const int nd = q->ndim;
    const ampc_dtype sdt = ampc__device_float(q->device);
    if (a.in[3] && !(mask = mask_for_kernels(q, a.in[3], k->shape[nd - 2], sdt, name))) return ampc__op_finish(&a, NULL, NULL);
    ampc_attn_desc d = make_desc(q, k, v, mask, is_causal, scale, dropout_p);
    int64_t oshape[AMPC_MAX_DIMS];
    memcpy(oshape, q->shape, sizeof(int64_t) * (size_t)nd);
    oshape[nd - 1] = d.Ev;
    return run_attention(&a, &d, q, k, v, mask, nd, oshape, attention_backward_fn);
}

// ---------------------------------------------------------------------------------------------
// Packed q, k, v: one input (3, ..., T, E)

/* The packed descriptor of qkv (3, lead..., T, E) */
static ampc_attn_desc packed_desc(const ampc_tensor *qkv, bool causal, double scale, double dropout) {
    const int nd = qkv->ndim;
    ampc_attn_desc d = {.batch = 1, .Tq = qkv->shape[nd - 2], .Tk = qkv->shape[nd - 2], .E = qkv->shape[nd - 1],
                        .Ev = qkv->shape[nd - 1], .causal = causal, .scale = scale, .dropout = dropout, .nlead = nd - 3,
                        .packed = true};
    for (int i = 1; i < nd - 2; i++) d.batch *= d.lead[i - 1] = qkv->shape[i];
    return d;
}

static int attention_packed_backward_fn(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    ampc_tensor *qkv = n->saved[0];
    ampc_attn_desc d = packed_desc(qkv, n->args.attention.causal, n->args.attention.scale, n->args.attention.dropout);
    d.rng = (ampc_rng_state){n->args.attention.rng_seed, n->args.attention.rng_offset};
    ampc_tensor *g = ampc__k_convert(gy, qkv->dtype, AMPC_CONTIGUOUS_FORMAT);
    ampc_tensor *dqkv = g ? ampc__tensor_like(qkv, qkv->dtype) : NULL;
    int rc = dqkv ? ampc__k_attention_backward(&d, qkv, qkv, qkv, NULL, n->saved[3], g, dqkv, dqkv, dqkv, NULL) : ampc_last_status();
    ampc__release(g);
    if (rc < 0) {
        ampc__release(dqkv);
        return rc;
    }
    gx[0] = dqkv;
    return AMPC_OK;
}

ampc_tensor *ampc__attention_packed(ampc_tensor *qkv_, double dropout_p, bool is_causal, double scale) {
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_SDPA, &a, 1, &qkv_, 0) < 0) return NULL;
    ampc_tensor *qkv = a.in[0];
    const char *name = "scaled_dot_product_attention (packed q, k, v)";
    char s1[96];
    if (ampc__check_float(qkv, name, "qkv") < 0) return ampc__op_finish(&a, NULL, NULL);
    if (qkv->ndim < 3 || qkv->shape[0] != 3) {
        ampc__err(AMPC_ERR_SHAPE, "%s: qkv %s; expected (3, ..., T, E)", name, ampc__shape_str(qkv, s1, sizeof s1));
        return ampc__op_finish(&a, NULL, NULL);
    }
    if (check_settings(name, scale, dropout_p) < 0) return ampc__op_finish(&a, NULL, NULL);
    ampc_attn_desc d = packed_desc(qkv, is_causal, scale, dropout_p);
    return run_attention(&a, &d, qkv, qkv, qkv, NULL, qkv->ndim - 1, qkv->shape + 1, attention_packed_backward_fn);
}
