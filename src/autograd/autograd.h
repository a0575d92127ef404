/*
 * autograd.h - the define-by-run tape.
 *
 * Every recorded op makes one node, owned by its output tensor (grad_fn). A node holds edges
 * to the nodes of its inputs (their grad_fn, or an AccumulateGrad node for leaves that require
 * grad), the tensors it saved for backward, and the metadata (shape, dtype) of its inputs.
 * ampc_backward runs the nodes in topological order; each node's saved tensors are released
 * right after its backward ran, and each intermediate gradient once it has been propagated.
 */
#ifndef AMPC_AUTOGRAD_H
#define AMPC_AUTOGRAD_H

#include "core/core.h"

#define AMPC_NODE_MAX_INPUTS 8
#define AMPC_NODE_MAX_SAVED 5

/* Computes the gradient of each input i that needs one (n->next[i] != NULL) from gy, the
   gradient of the output. gx[i] receive new tensors owned by the engine (or NULL when not
   needed). Runs with grad mode off. Returns AMPC_OK or a negative status. */
typedef int (*ampc_backward_fn)(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx);

typedef struct {
    int ndim;
    int64_t shape[AMPC_MAX_DIMS];
    ampc_dtype dtype;
    ampc_memory_format format;   /* the engine hands the input's gradient over in this format */
} ampc_meta;

/* What a pooling node keeps to rebuild its kernel descriptor (ops/pool.c). */
typedef struct {
    int kind;                               /* ampc_pool_kind */
    int kernel[2], stride[2], padding[2];   /* (h, w), in elements */
} ampc_pool_args;

struct ampc_node {
    atomic_int refcount;
    const char *name;                 /* "LinearBackward" */
    const char *module;               /* the module path it was made under, while tracing (interned), or NULL */
    ampc_backward_fn backward;
    int n_inputs;
    ampc_node *next[AMPC_NODE_MAX_INPUTS];   /* owning; NULL: input needs no grad */
    ampc_meta in[AMPC_NODE_MAX_INPUTS];      /* metadata of each input */
    ampc_tensor *saved[AMPC_NODE_MAX_SAVED]; /* owning */
    /* The op's settings its backward reads: the member of the op that made the node. */
    union {
        struct { double b_sign; } add;   /* add/sub: factor on b's gradient (1 add, -1 sub) */
        struct {
            ampc_op op;                  /* a unary kernel op of the op table */
            double alpha;                /* its scalar: the exponent, factor or added constant */
        } unary;
        struct {
            int dim;                     /* the reduced dim, -1: all dims */
            double alpha;                /* 1 (sum) or 1/count (mean) */
        } reduce;
        struct { int dim; } cat;         /* the dim the inputs were joined along */
        struct { int dim; int64_t start; } narrow;   /* the block taken along dim from start */
        struct { int64_t rows; } linear; /* rows of x with its leading dims flattened (M) */
        ampc_conv2d_options conv;        /* with the defaults filled in */
        ampc_pool_args pool;
        struct { bool training, relu, sync; } batch_norm;   /* batch statistics used; ReLU fused; SyncBatchNorm */
        struct {
            int64_t outer, dim, inner;   /* x viewed as (outer, dim, inner), softmax along dim */
            bool log;                    /* log-softmax */
        } softmax;
        struct {
            ampc_reduction reduction;
            double count;                /* the input's element count (MEAN's divisor) */
        } mse;
        struct {
            ampc_cross_entropy_options opts;
            double divisor;              /* non-ignored rows for MEAN, else 1 */
        } cross_entropy;
        struct { double p; } dropout;    /* probability of zeroing an element */
        struct { int dims[AMPC_MAX_DIMS]; } permute;   /* the output's dim i is the input's dims[i] */
        struct {
            bool causal;
            double scale, dropout;           /* the scale applied; the probability of dropping */
            uint64_t rng_seed, rng_offset;   /* the draws dropout made (ampc_rng_state) */
        } attention;                         /* the sizes come from the saved q, k, v (and mask) */
    } args;
    void *extra;                      /* op-owned buffer (ampc__free'd with extra_bytes on extra_device) */
    size_t extra_bytes;
    ampc_device extra_device;         /* where extra lives (the device of the op's inputs) */
    ampc_tensor *leaf;                /* AccumulateGrad: the leaf (owning) */
    bool released;                    /* backward ran: saved tensors are gone */
    /* A narrowing cast (fp32 master weight -> 16-bit copy): its gradient is kept in the input's
       wider dtype, so producers may write it unrounded (ampc__grad_dtype) and the cast's
       backward passes it on without a copy. */
    bool pass_wide;
    /* backward bookkeeping */
    int deps;
    ampc_tensor *grad;                /* gradient of this node's output, accumulated */
    ampc_node *pool_next;
};

/* Should an op with these inputs record a node? (grad mode on and some input requires grad) */
bool ampc__needs_grad(ampc_tensor *const *inputs, int n);
/* New node for the op with the given inputs: edges to their grad nodes, metadata copied.
   Returns NULL on allocation failure (error set). */
ampc_node *ampc__node_new(const char *name, ampc_backward_fn fn, ampc_tensor *const *inputs, int n);
/* Saves t (takes a new reference). */
void ampc__node_save(ampc_node *n, int slot, ampc_tensor *t);
/* Makes out the node's output: out->grad_fn = n (takes the caller's reference to n),
   out->requires_grad = true. */
void ampc__node_attach(ampc_node *n, ampc_tensor *out);
void ampc__node_release(ampc_node *n);
ampc_node *ampc__node_retain(ampc_node *n);

/* The dtype in which a backward function should produce input i's gradient: the input's dtype,
   or the wider source dtype when the input is a narrowing cast's output (pass_wide): an
   autocast layer then writes its weight gradient in fp32 straight from the f32 accumulator. */
ampc_dtype ampc__grad_dtype(const ampc_node *n, int i);
/* The memory kind for input i's gradient: GRADIENTS when it becomes a leaf's .grad (directly
   or through a pass_wide cast), else ACTIVATIONS. */
ampc_mem_kind ampc__grad_kind(const ampc_node *n, int i);

/* True when only the engine holds g and its storage (a backward function may then write its
   result over g in place). */
bool ampc__grad_exclusive(const ampc_tensor *g);

/* Gradient accumulation into a leaf's .grad (fp32 for fp32 leaves), used by AccumulateGrad. */
int ampc__accumulate_grad(ampc_tensor *leaf, ampc_tensor *g);

/* What an upper layer (the dist layer's gradient all-reduce) runs inside ampc_backward. The
   engine runs nodes one at a time on the calling thread and calls, for every registered set:
     leaf_ready(ctx, leaf)  once leaf->grad holds everything this backward adds to it (its
                            AccumulateGrad node ran: every path into it is done);
     node_done(ctx)         after each node: a point at which communication can progress;
     finish(ctx, rc)        after the last node (also after a failed one, rc < 0), before
                            ampc_backward returns; its status becomes backward's.
   A negative status from leaf_ready or node_done ends the backward pass (finish still runs).
   Returns AMPC_OK, or AMPC_ERR_STATE when AMPC_BACKWARD_MAX_HOOKS sets are registered. */
#define AMPC_BACKWARD_MAX_HOOKS 8
typedef struct {
    int (*leaf_ready)(void *ctx, ampc_tensor *leaf);
    int (*node_done)(void *ctx);
    int (*finish)(void *ctx, int rc);
    void *ctx;
} ampc_backward_hooks;
int ampc__backward_hooks_add(const ampc_backward_hooks *h);
void ampc__backward_hooks_remove(void *ctx);   /* every set registered with ctx */

#endif /* AMPC_AUTOGRAD_H */
