/*
 * linear.c - the matmul-like ops: ampc_linear (x @ w^T + b) and ampc_matmul (numpy rules).
 *
 * Both flatten what they can into one backend gemm: linear folds every leading dim of x into
 * M; matmul folds a's batch into M when b is a single matrix, and otherwise runs a batched
 * gemm (b or a broadcast with batch stride 0). Backward is two more gemms with transposes
 * given as flags (no transposed copies); gradients of a broadcast operand are the sum over
 * the batch, which a folded gemm computes by itself (its K runs over the whole batch).
 * Under autocast (policy LOWER, applied by ampc__op_prepare) the inputs arrive as 16-bit casts,
 * and those casts are what the node saves: half the activation memory of fp32 - except linear's
 * input batch, saved uncast and recast in backward (ampc__input_to_save).
 */
#include "ops/ops.h"

#include <stdio.h>

// ---------------------------------------------------------------------------------------------
// Shared checks

static const char *shape_str(int ndim, const int64_t *shape, char *buf, size_t n) {
    size_t k = (size_t)snprintf(buf, n, "(");
    for (int i = 0; i < ndim && k < n; i++) k += (size_t)snprintf(buf + k, n - k, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (k < n) snprintf(buf + k, n - k, "%s)", ndim == 1 ? "," : "");   /* as ampc__shape_str */
    return buf;
}

/* Float inputs of one dtype (NULL entries skipped); outside autocast nothing converts them,
   as in PyTorch, so a mix is the caller's error. */
static int check_dtypes(const char *op, ampc_tensor *const *in, const char *const *names, int n) {
    const ampc_tensor *first = NULL;
    const char *first_name = NULL;
    for (int i = 0; i < n; i++) {
        if (!in[i]) continue;
        if (ampc__check_float(in[i], op, names[i]) < 0) return ampc_last_status();
        if (!first) {
            first = in[i];
            first_name = names[i];
        } else if (in[i]->dtype != first->dtype) {
            return ampc__err(AMPC_ERR_DTYPE, "%s: %s is %s but %s is %s (cast one of them, or run under autocast)", op,
                             first_name, ampc_dtype_name(first->dtype), names[i], ampc_dtype_name(in[i]->dtype));
        }
    }
    return AMPC_OK;
}

/* gy in the op's compute dtype (the engine hands it in the output's dtype already). */
static ampc_tensor *grad_in(ampc_tensor *gy, ampc_dtype dt) { return ampc__k_cast(gy, dt); }

static ampc_tensor *fail_args(ampc_op_args *a) {
    ampc__op_args_release(a);
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// linear: x (..., in) @ w (out, in)^T + b (out)

/* saved[0] = x (for dw), saved[1] = w (for dx); args.linear.rows = M (rows of x flattened) */
static int linear_backward(ampc_node *n, ampc_tensor *gy_in, ampc_tensor **gx) {
    int64_t out = n->in[1].shape[0], in = n->in[1].shape[1], M = n->args.linear.rows;
    ampc_tensor *gy = grad_in(gy_in, n->in[1].dtype);
    if (!gy) return ampc_last_status();
    int rc = AMPC_OK;
    if (n->next[0]) {   /* dx (M, in) = gy (M, out) @ w (out, in) */
        ampc_gemm_desc d = {.batch = 1, .M = M, .N = in, .K = out};
        gx[0] = ampc__k_gemm(&d, gy, n->saved[1], NULL, n->in[0].ndim, n->in[0].shape);
        if (!gx[0]) rc = ampc_last_status();
    }
    /* dw and db: straight into fp32 under autocast, allocated as the gradients they become */
    if (rc >= 0 && n->next[1]) {   /* dw (out, in) = gy^T (out, M) @ x (M, in) */
        ampc_gemm_desc d = {.batch = 1, .M = out, .N = in, .K = M, .ta = true};
        ampc_tensor *x = ampc__k_cast(n->saved[0], n->in[0].dtype);   /* saved uncast: ampc__input_to_save */
        gx[1] = x ? ampc__k_wgrad_gemm(n, 1, &d, gy, x, 2, (int64_t[]){out, in}) : NULL;
        ampc__release(x);
        if (!gx[1]) rc = ampc_last_status();
    }
    if (rc >= 0 && n->next[2]) {   /* db (out) = gy summed over rows */
        gx[2] = ampc__k_wgrad_sum_to(n, 2, gy, 1, (int64_t[]){out});
        if (!gx[2]) rc = ampc_last_status();
    }
    ampc__release(gy);
    return rc;
}

ampc_tensor *ampc_linear(ampc_tensor *x, ampc_tensor *w, ampc_tensor *b) {
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_LINEAR, &a, 3, (ampc_tensor *[]){x, w, b}, 1u << 2) < 0) return NULL;
    ampc_tensor *X = a.in[0], *W = a.in[1], *B = a.in[2];
    char s1[96], s2[96];
    if (check_dtypes("linear", a.in, (const char *[]){"input", "weight", "bias"}, 3) < 0) return fail_args(&a);
    if (W->ndim != 2) {
        ampc__err(AMPC_ERR_SHAPE, "linear: weight must be 2-D (out_features, in_features), got %s", ampc__shape_str(W, s1, sizeof s1));
        return fail_args(&a);
    }
    int64_t out = W->shape[0], in = W->shape[1];
    if (X->ndim < 1 || X->shape[X->ndim - 1] != in) {
        if (X->ndim < 1) ampc__err(AMPC_ERR_SHAPE, "linear: input must have at least 1 dimension, weight %s expects %lld features",
                                   ampc__shape_str(W, s2, sizeof s2), (long long)in);
        else ampc__err(AMPC_ERR_SHAPE, "linear: input %s has %lld features but weight %s expects %lld",
                       ampc__shape_str(X, s1, sizeof s1), (long long)X->shape[X->ndim - 1], ampc__shape_str(W, s2, sizeof s2),
                       (long long)in);
        return fail_args(&a);
    }
    if (B && (B->ndim != 1 || B->shape[0] != out)) {
        ampc__err(AMPC_ERR_SHAPE, "linear: bias %s does not match weight %s: expected (%lld)", ampc__shape_str(B, s1, sizeof s1),
                  ampc__shape_str(W, s2, sizeof s2), (long long)out);
        return fail_args(&a);
    }
    int64_t shape[AMPC_MAX_DIMS], M = 1;
    for (int i = 0; i < X->ndim - 1; i++) M *= shape[i] = X->shape[i];
    shape[X->ndim - 1] = out;
    ampc_gemm_desc d = {.batch = 1, .M = M, .N = out, .K = in, .tb = true};
    ampc_tensor *y = ampc__k_gemm(&d, X, W, B, X->ndim, shape);
    ampc_node *node = NULL;
    if (y && ampc__needs_grad(a.in, 3)) {
        node = ampc__node_new(ampc_op_grad_fn(AMPC_OP_LINEAR), linear_backward, a.in, 3);
        if (!node) {
            ampc__release(y);
            return fail_args(&a);
        }
        if (node->next[1]) ampc__node_save(node, 0, ampc__input_to_save(&a, 0));
        if (node->next[0]) ampc__node_save(node, 1, W);
        node->args.linear.rows = M;
    }
    return ampc__op_finish(&a, y, node);
}

// ---------------------------------------------------------------------------------------------
// matmul: numpy semantics

typedef enum {
    MM_FOLD,      /* b is one matrix: a's batch folds into M, one plain gemm */
    MM_BCAST_A,   /* a is one matrix, b batched: batch stride 0 for a */
    MM_SAME,      /* both batched over the same batch */
} mm_mode;

typedef struct {
    mm_mode mode;
    int64_t M, N, K, batch, a_batch;   /* batch: products run; a_batch: matrices in a */
    int out_ndim;
    int64_t out_shape[AMPC_MAX_DIMS];
} mm_plan;

static int64_t prod(const int64_t *s, int n) {
    int64_t p = 1;
    for (int i = 0; i < n; i++) p *= s[i];
    return p;
}

/* Shapes, broadcasting and the gemm layout of a (nda dims) @ b (ndb dims). */
static int mm_plan_make(int nda, const int64_t *sa, int ndb, const int64_t *sb, mm_plan *p) {
    char s1[96], s2[96];
    if (nda < 1 || ndb < 1)
        return ampc__err(AMPC_ERR_SHAPE, "matmul: both arguments need at least 1 dimension, got %s and %s",
                         shape_str(nda, sa, s1, sizeof s1), shape_str(ndb, sb, s2, sizeof s2));
    p->K = sa[nda - 1];
    p->M = nda >= 2 ? sa[nda - 2] : 1;
    p->N = ndb >= 2 ? sb[ndb - 1] : 1;
    int64_t kb = ndb >= 2 ? sb[ndb - 2] : sb[0];
    if (kb != p->K)
        return ampc__err(AMPC_ERR_SHAPE, "matmul: a %s and b %s: inner dimensions %lld and %lld differ",
                         shape_str(nda, sa, s1, sizeof s1), shape_str(ndb, sb, s2, sizeof s2), (long long)p->K, (long long)kb);
    int bna = nda > 2 ? nda - 2 : 0, bnb = ndb > 2 ? ndb - 2 : 0, bn = bna > bnb ? bna : bnb;
    for (int i = 0; i < bn; i++) {
        int ia = bna - bn + i, ib = bnb - bn + i;
        int64_t da = ia >= 0 ? sa[ia] : 1, db = ib >= 0 ? sb[ib] : 1;
        if (da != db && da != 1 && db != 1)
            return ampc__err(AMPC_ERR_SHAPE, "matmul: batch dimensions of a %s and b %s do not broadcast",
                             shape_str(nda, sa, s1, sizeof s1), shape_str(ndb, sb, s2, sizeof s2));
        p->out_shape[i] = da == 1 ? db : da;
    }
    int64_t na = prod(sa, bna), nb = prod(sb, bnb), nout = prod(p->out_shape, bn);
    p->a_batch = na;
    if (nb == 1) {
        p->mode = MM_FOLD;
        p->batch = 1;
    } else if (na == 1) {
        p->mode = MM_BCAST_A;
        p->batch = nb;
    } else if (na == nb && nb == nout) {
        p->mode = MM_SAME;
        p->batch = nout;
    } else {
        return ampc__err(AMPC_ERR_UNSUPPORTED,
                         "matmul: a %s and b %s broadcast their batch dimensions against each other; supported are equal "
                         "batch shapes or one operand with a single matrix",
                         shape_str(nda, sa, s1, sizeof s1), shape_str(ndb, sb, s2, sizeof s2));
    }
    int nd = bn;
    if (nda >= 2) p->out_shape[nd++] = p->M;
    if (ndb >= 2) p->out_shape[nd++] = p->N;
    p->out_ndim = nd;
    return AMPC_OK;
}

/* saved[0] = a (for gb), saved[1] = b (for ga) */
static int matmul_backward(ampc_node *n, ampc_tensor *gy_in, ampc_tensor **gx) {
    mm_plan p;
    int rc = mm_plan_make(n->in[0].ndim, n->in[0].shape, n->in[1].ndim, n->in[1].shape, &p);
    if (rc < 0) return rc;
    ampc_tensor *gy = grad_in(gy_in, n->in[0].dtype);
    if (!gy) return ampc_last_status();
    int64_t M = p.M, N = p.N, K = p.K;
    if (n->next[0]) {   /* ga = gy @ b^T, summed over the batch when a was broadcast */
        if (p.mode == MM_FOLD) {
            ampc_gemm_desc d = {.batch = 1, .M = p.a_batch * M, .N = K, .K = N, .tb = true};
            gx[0] = ampc__k_gemm(&d, gy, n->saved[1], NULL, n->in[0].ndim, n->in[0].shape);
        } else if (p.mode == MM_SAME) {
            ampc_gemm_desc d = {p.batch, M, K, N, false, true, M * N, K * N, M * K};
            gx[0] = ampc__k_gemm(&d, gy, n->saved[1], NULL, n->in[0].ndim, n->in[0].shape);
        } else {
            ampc_gemm_desc d = {p.batch, M, K, N, false, true, M * N, K * N, M * K};
            ampc_tensor *per = ampc__k_gemm(&d, gy, n->saved[1], NULL, 3, (int64_t[]){p.batch, M, K});
            ampc_tensor *sum = per ? ampc__k_sum_to(per, 2, (int64_t[]){M, K}, 1.0) : NULL;
            gx[0] = sum ? ampc__tensor_view(sum, n->in[0].ndim, n->in[0].shape) : NULL;
            ampc__release(per);
            ampc__release(sum);
        }
        if (!gx[0]) rc = ampc_last_status();
    }
    if (rc >= 0 && n->next[1]) {   /* gb = a^T @ gy; folded, K runs over the whole batch */
        ampc_gemm_desc d;
        if (p.mode == MM_FOLD) d = (ampc_gemm_desc){.batch = 1, .M = K, .N = N, .K = p.a_batch * M, .ta = true};
        else d = (ampc_gemm_desc){p.batch, K, N, M, true, false, p.mode == MM_SAME ? M * K : 0, M * N, K * N};
        gx[1] = ampc__k_wgrad_gemm(n, 1, &d, n->saved[0], gy, n->in[1].ndim, n->in[1].shape);
        if (!gx[1]) rc = ampc_last_status();
    }
    ampc__release(gy);
    return rc;
}

ampc_tensor *ampc_matmul(ampc_tensor *a_in, ampc_tensor *b_in) {
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_MATMUL, &a, 2, (ampc_tensor *[]){a_in, b_in}, 0) < 0) return NULL;
    ampc_tensor *A = a.in[0], *B = a.in[1];
    mm_plan p;
    if (check_dtypes("matmul", a.in, (const char *[]){"a", "b"}, 2) < 0 ||
        mm_plan_make(A->ndim, A->shape, B->ndim, B->shape, &p) < 0)
        return fail_args(&a);
    ampc_gemm_desc d;
    if (p.mode == MM_FOLD) d = (ampc_gemm_desc){.batch = 1, .M = p.a_batch * p.M, .N = p.N, .K = p.K};
    else d = (ampc_gemm_desc){p.batch, p.M, p.N, p.K, false, false, p.mode == MM_SAME ? p.M * p.K : 0, p.K * p.N, p.M * p.N};
    ampc_tensor *y = ampc__k_gemm(&d, A, B, NULL, p.out_ndim, p.out_shape);
    ampc_node *node = NULL;
    if (y && ampc__needs_grad(a.in, 2)) {
        node = ampc__node_new(ampc_op_grad_fn(AMPC_OP_MATMUL), matmul_backward, a.in, 2);
        if (!node) {
            ampc__release(y);
            return fail_args(&a);
        }
        if (node->next[1]) ampc__node_save(node, 0, A);
        if (node->next[0]) ampc__node_save(node, 1, B);
    }
    return ampc__op_finish(&a, y, node);
}
