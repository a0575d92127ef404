/*
 * ops.h - what every op file shares: the front door (NULL/device checks, autocast casts), the
 * weight-gradient kernel calls and the recorded one-input ops. Kernels are called through
 * backend.h's owned-result calls (ampc__k_*).
 *
 * An op reads:
 *     ampc_op_args a;
 *     if (ampc__op_prepare(AMPC_OP_X, &a, 2, (ampc_tensor *[]){x, w}, 0) < 0) return NULL;
 *     // a.in[] are owned refs, already cast per the autocast policy
 *     ... checks, out = ampc__k_...(a.in[0], ...)
 *     if (ampc__needs_grad(a.in, a.n)) { node = ampc__node_new(ampc_op_grad_fn(AMPC_OP_X), x_backward, a.in, a.n); save ...}
 *     return ampc__op_finish(&a, out, node);   // attaches node, releases a.in, adopts out into scope
 */
#ifndef AMPC_OPS_H
#define AMPC_OPS_H

#include "autograd/autograd.h"
#include "backend/backend.h"

typedef struct {
    ampc_op op;
    int n;
    ampc_tensor *in[AMPC_NODE_MAX_INPUTS];   /* owned references (after autocast casts) */
    ampc_tensor *src[AMPC_NODE_MAX_INPUTS];  /* borrowed: the caller's inputs, before them */
} ampc_op_args;

/* Checks the n inputs (NULL -> keeps the earlier error and fails, unless bit i of
   optional_mask allows input i to be NULL), same device, then applies the op's autocast
   policy. On failure nothing is held. */
int ampc__op_prepare(ampc_op op, ampc_op_args *a, int n, ampc_tensor *const *inputs, unsigned optional_mask);
/* The tensor a node should save of input i: a->in[i], or - when autocast cast a caller's
   tensor that needs no gradient and whose storage another tensor holds too (the input batch,
   or a view of it, which the caller keeps through backward anyway) - that uncast original, so
   the graph keeps no 16-bit copy of it alive; the backward recasts it (ampc__k_cast to the
   input's recorded dtype, n->in[i].dtype), a cheap pass next to the matmul that reads it. */
ampc_tensor *ampc__input_to_save(const ampc_op_args *a, int i);

/* Attaches node (may be NULL) to out, releases the inputs, adopts out into the scope.
   out NULL: releases node and inputs, returns NULL. */
ampc_tensor *ampc__op_finish(ampc_op_args *a, ampc_tensor *out, ampc_node *node);
void ampc__op_args_release(ampc_op_args *a);

/* Records a differentiable cast (CastBackward) when x requires grad; owned result.
   Same dtype: returns a new reference to x. */
ampc_tensor *ampc__cast_record(ampc_tensor *x, ampc_dtype dt);
/* The same with the cast already computed: y (a new reference, taken over) holds x's values in
   a float dtype, e.g. autocast's kept copy of a weight; NULL y: NULL. */
ampc_tensor *ampc__cast_record_done(ampc_tensor *x, ampc_tensor *y);

/* A view of x with another shape of the same numel, recording `name` (NULL: "AliasBackward";
   gradient: gy viewed back) when x requires grad; owned result. */
ampc_tensor *ampc__alias_record(ampc_tensor *x, int ndim, const int64_t *shape, const char *name);

/* Records a differentiable change of memory format (the engine converts the gradient back);
   owned result; same format: a new reference to x. */
ampc_tensor *ampc__format_record(ampc_tensor *x, ampc_memory_format fmt);

/* ampc__k_gemm and ampc__k_sum_to (backend.h) producing the gradient of input i of node n (a weight or a bias): in
   ampc__wgrad_dtype (f32 straight from the accumulator under autocast) and allocated as the
   memory kind it ends as (ampc__grad_kind). */
ampc_tensor *ampc__k_wgrad_gemm(const ampc_node *n, int i, const ampc_gemm_desc *d, ampc_tensor *a, ampc_tensor *b,
                                int ndim, const int64_t *out_shape);
ampc_tensor *ampc__k_wgrad_sum_to(const ampc_node *n, int i, ampc_tensor *x, int ndim, const int64_t *shape);

/* The dtype for the gradient of input i of node n computed from `compute`-dtype operands: f32
   when the engine keeps it in f32 (ampc__grad_dtype) and compute is 16-bit (the kernels write
   their f32 accumulators unrounded), else compute (the engine casts it). */
ampc_dtype ampc__wgrad_dtype(const ampc_node *n, int i, ampc_dtype compute);

/* Normalises a possibly negative dim against ndim; error if out of range. */
int ampc__norm_dim(int dim, int ndim, int *out);
/* Float-dtype check for an op's input. */
int ampc__check_float(const ampc_tensor *t, const char *op, const char *what);

/* num_batches_tracked += 1: BatchNorm's counter of training forwards (an i64 scalar in host
   memory; PyTorch counts them whatever the grad mode). */
int ampc__batch_norm_count(ampc_tensor *num_batches_tracked);

/* ampc_relu(ampc_batch_norm2d(...)) as one op, bit for bit the same output, gradients and
   running statistics (src/ops/norm.c); for the model code, not public API. */
ampc_tensor *ampc__batch_norm2d_relu(ampc_tensor *x, ampc_tensor *weight, ampc_tensor *bias, ampc_tensor *running_mean,
                                     ampc_tensor *running_var, bool training, double momentum, double eps);
/* ampc_relu(ampc_add(ampc_batch_norm2d(x, ...), z)) as one op where the backend has the kernels
   (batch_norm_add_relu: the CUDA backend) and z is like x, bit for bit the composite, which runs
   elsewhere (CPU, REF, SyncBatchNorm across processes, mismatched z); for the model code. */
ampc_tensor *ampc__batch_norm2d_add_relu(ampc_tensor *x, ampc_tensor *weight, ampc_tensor *bias, ampc_tensor *running_mean,
                                         ampc_tensor *running_var, ampc_tensor *z, bool training, double momentum, double eps,
                                         bool sync);
/* ampc_scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], NULL, dropout_p, is_causal, scale)
   on q, k, v packed in one tensor qkv (3, ..., T, E), without splitting it: the kernels read the
   three parts in place and the backward writes one gradient of qkv's shape (no zero-filled part
   gradients to add up). GPT's attention: c_attn's output viewed (B, T, 3, H, D) and permuted to
   (3, B, H, T, D). For the model code (src/ops/attention.c). */
ampc_tensor *ampc__attention_packed(ampc_tensor *qkv, double dropout_p, bool is_causal, double scale);
/* The four batch norms in one call: ReLU fused (relu), statistics of all processes (sync). */
ampc_tensor *ampc__batch_norm2d_ex(ampc_tensor *x, ampc_tensor *weight, ampc_tensor *bias, ampc_tensor *running_mean,
                                   ampc_tensor *running_var, bool training, double momentum, double eps, bool relu,
                                   bool sync);

// ---------------------------------------------------------------------------------------------
// The autocast hook: the front door calls it with each op's inputs (owned refs), which it may
// replace by their casts per the op's policy. The amp layer registers it when a program first
// enters an autocast region (before that, no op can be under autocast); none: no casts.

typedef int (*ampc_autocast_hook)(ampc_op op, ampc_tensor **in, int n);
void ampc__ops_set_autocast_hook(ampc_autocast_hook hook);

#endif /* AMPC_OPS_H */
