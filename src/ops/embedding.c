/*
 * embedding.c - ops: embedding (the rows of a weight table picked by integer indices).
 *
 * The output has the weight's dtype: autocast lists no policy for it (PyTorch's neither), so
 * an fp32 table gives fp32 rows, which the next op casts as its own policy says. The node
 * saves the indices only; the weight's gradient is dense, (V, D) in the weight's dtype.
 */
#include "ops/ops.h"

#include <string.h>

static int embedding_backward_fn(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    ampc_tensor *gw = ampc__tensor_new(n->in[0].dtype, gy->device, 2, n->in[0].shape);
    if (!gw) return ampc_last_status();
    int rc = ampc__k_embedding_backward(gy, n->saved[0], gw);
    if (rc < 0) {
        ampc__release(gw);
        return rc;
    }
    gx[0] = gw;
    return AMPC_OK;
}

ampc_tensor *ampc_embedding(ampc_tensor *indices, ampc_tensor *weight) {
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_EMBEDDING, &a, 2, (ampc_tensor *[]){weight, indices}, 0) < 0) return NULL;
    ampc_tensor *w = a.in[0], *idx = a.in[1], *y = NULL;
    char s1[96];
    if (ampc__check_float(w, "embedding", "weight") < 0) return ampc__op_finish(&a, NULL, NULL);
    if (w->ndim != 2) {
        ampc__err(AMPC_ERR_SHAPE, "embedding: weight %s must be 2-D (num_embeddings, embedding_dim)", ampc__shape_str(w, s1, sizeof s1));
        return ampc__op_finish(&a, NULL, NULL);
    }
    if (idx->dtype != AMPC_I64) {
        ampc__err(AMPC_ERR_DTYPE, "embedding: indices must be i64, not %s", ampc_dtype_name(idx->dtype));
        return ampc__op_finish(&a, NULL, NULL);
    }
    if (idx->ndim >= AMPC_MAX_DIMS) {
        ampc__err(AMPC_ERR_SHAPE, "embedding: indices of %d dims leave no room for the embedding dim", idx->ndim);
        return ampc__op_finish(&a, NULL, NULL);
    }
    int64_t shape[AMPC_MAX_DIMS];
    memcpy(shape, idx->shape, sizeof(int64_t) * (size_t)idx->ndim);
    shape[idx->ndim] = w->shape[1];
    y = ampc__tensor_new(w->dtype, w->device, idx->ndim + 1, shape);
    if (!y || ampc__k_embedding(w, idx, y) < 0) {
        ampc__release(y);
        return ampc__op_finish(&a, NULL, NULL);
    }
    ampc_node *node = NULL;
    if (ampc__needs_grad(a.in, 1)) {
        node = ampc__node_new(ampc_op_grad_fn(AMPC_OP_EMBEDDING), embedding_backward_fn, a.in, 1);
        if (!node) {
            ampc__release(y);
            return ampc__op_finish(&a, NULL, NULL);
        }
        ampc__node_save(node, 0, idx);
    }
    return ampc__op_finish(&a, y, node);
}
