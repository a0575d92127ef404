/*
 * nn.h - the module object behind ampc_module: a small vtable, named children, named
 * parameters and buffers, a training flag, and lazily built flat lists in state_dict order.
 *
 * A layer is a struct ampc_module with its vtable and whatever it registered:
 *     m = ampc__module_new(&linear_vtable);
 *     ampc__module_add_param(m, "weight", ampc__param_uniform(m, 2, (int64_t[]){out, in}, b));
 * and a forward that calls public ops (they obey autocast and record autograd nodes).
 * ampc_module_forward runs each forward in its own scope and keeps only the output, so the
 * forward's intermediates live only as long as the autograd graph needs them.
 *
 * Tensors a module holds:
 * - parameters: fp32 leaves that require grad (unless frozen), counted as AMPC_MEM_PARAMETERS,
 *   owned by the module (out of every scope), listed by ampc_module_parameters;
 * - buffers: state that belongs in a checkpoint but is not trained (BatchNorm's running_mean,
 *   running_var, num_batches_tracked): no grad, not given to optimizers, and listed with the
 *   parameters by ampc__module_state_dict in PyTorch's order (a module's own parameters, then
 *   its own buffers, then each child's entries under "<child>.").
 * Conv2d/BatchNorm2d/ResNet blocks are more layers of this kind: a vtable, their parameters and
 * buffers, hyperparameters in `config` or in `impl`, and children for composite blocks.
 */
#ifndef AMPC_NN_H
#define AMPC_NN_H

#include "core/core.h"

typedef struct {
    const char *type;   /* PyTorch's class name: "Linear", "Sequential", ... */
    /* Output for input x, in the current scope (or x itself for an identity); NULL + error. */
    ampc_tensor *(*forward)(ampc_module *m, ampc_tensor *x);
    /* Releases `impl` and anything else layer-specific (NULL: nothing to do). Parameters,
       buffers and children are freed by ampc_module_free itself. */
    void (*free)(ampc_module *m);
} ampc_module_vtable;

/* A growable list of owned, named entries. */
typedef struct {
    int n, cap;
    char **names;
    void **items;   /* ampc_tensor * (owned refs) or ampc_module * (owned) */
} ampc_named_list;

/* Flat lists in state_dict order with dotted names, rebuilt when stale. */
typedef struct {
    bool valid;
    int n, cap;
    ampc_tensor **tensors;   /* borrowed from the modules */
    char **names;            /* owned strings */
} ampc_flat_list;

struct ampc_module {
    const ampc_module_vtable *vt; /* first: the pool links free headers through it */
    uint64_t gen;                 /* generation while live, 0 once freed (pooled header) */
    bool training;                /* true after construction, like PyTorch */
    ampc_module *parent;          /* weak; set when added as a child (to invalidate flat lists) */
    ampc_named_list children;     /* ampc_module * */
    ampc_named_list params;       /* ampc_tensor *: this module's own parameters */
    ampc_named_list buffers;      /* ampc_tensor *: this module's own buffers (no grad) */
    union {                       /* hyperparameters: the member of the layer's type */
        struct { int64_t in_features, out_features; } linear;
        struct {
            int64_t in_channels, out_channels;
            int kernel_size, groups;   /* the rest of the options is in impl */
        } conv2d;
        struct {
            int64_t num_features;      /* channels C */
            double momentum;           /* running stats += momentum * (batch stats - running) */
            double eps;                /* added to the variance */
            bool sync;                 /* SyncBatchNorm: statistics of all processes */
        } batchnorm2d;
        struct {
            int norm_ndim;             /* normalized over the last norm_ndim dims */
            double eps;
        } layernorm;
        struct { double p; } dropout;  /* probability of zeroing an element */
        struct { int64_t num_embeddings, embedding_dim; } embedding;
        struct {
            int64_t n_embd, n_head;
            double dropout;            /* on the output projection, in training */
        } attention;
        struct { int out_h, out_w; } adaptive_avgpool2d;
        struct { int64_t block_size; } gpt;   /* the longest sequence */
        struct { ampc_memory_format memory_format; } model;   /* zoo models: of the input */
    } config;
    void *impl;                   /* layer-specific data, freed by vt->free */
    ampc_flat_list flat_params;   /* ampc_module_parameters */
    ampc_flat_list flat_state;    /* ampc__module_state_dict: parameters and buffers */
};

/* New module of the given kind, training mode, nothing registered (NULL + error on OOM). */
ampc_module *ampc__module_new(const ampc_module_vtable *vt);
/* Registers t as a parameter: takes it out of its scope (the module owns it from here on) and
   sets requires_grad. t must be a float leaf. On failure t is freed. */
int ampc__module_add_param(ampc_module *m, const char *name, ampc_tensor *t);
/* Registers t as a buffer (owned, no grad). On failure t is freed. */
int ampc__module_add_buffer(ampc_module *m, const char *name, ampc_tensor *t);
/* Adds child under name, taking ownership. On failure child is freed, unless it already had a
   parent (an error too: a module has one parent). */
int ampc__module_add_child(ampc_module *m, const char *name, ampc_module *child);
/* m's parameter `name` becomes t, a parameter another module owns (weight tying: nanoGPT's
   lm_head.weight is transformer.wte.weight): same shape and dtype; the state_dict lists it
   under both names, ampc_module_parameters once, under the first. */
int ampc__module_tie_param(ampc_module *m, const char *name, ampc_tensor *t);
/* This module's own parameter/buffer by local name ("weight"), or NULL. */
ampc_tensor *ampc__module_param(const ampc_module *m, const char *name);
ampc_tensor *ampc__module_buffer(const ampc_module *m, const char *name);
/* Marks the flat lists of m and its ancestors stale (after registering something). */
void ampc__module_invalidate(ampc_module *m);

/* Float dtype for parameters on the default device: f32, or f64 on devices without f32 (REF). */
ampc_dtype ampc__param_dtype(void);
/* New parameter-kind tensor (in the current scope) ~ U(-bound, bound) from the global
   generator, for ampc__module_add_param. */
ampc_tensor *ampc__param_uniform(int ndim, const int64_t *shape, double bound);
/* The same ~ N(0, std^2), or zeros for std 0. */
ampc_tensor *ampc__param_normal(int ndim, const int64_t *shape, double std);
/* Linear as ampc_linear_new, except weight_std > 0 draws the weight from N(0, weight_std^2) and
   zeroes the bias (nanoGPT's _init_weights) instead of PyTorch's default uniform. */
ampc_module *ampc__linear_make(int64_t in_features, int64_t out_features, bool bias, double weight_std);
/* Embedding as ampc_embedding_new with its weight ~ N(0, std^2) (PyTorch's default: std 1). */
ampc_module *ampc__embedding_make(int64_t num_embeddings, int64_t embedding_dim, double std);

/* Parameters and buffers in PyTorch's state_dict order with dotted names; the arrays are owned
   by m and valid until m changes. Returns the count or a negative status. */
int ampc__module_state_dict(ampc_module *m, ampc_tensor ***tensors, const char ***names);

/* LayerNorm with or without its bias (nanoGPT's bias=False has none). */
ampc_module *ampc__layernorm_make(int norm_ndim, const int64_t *normalized_shape, bool bias);
/* m's direct child by local name ("conv1", "downsample"), or NULL without setting an error. */
ampc_module *ampc__module_get_child(const ampc_module *m, const char *name);
/* The forward of m's child `name` on x (AMPC_ERR_STATE if it is missing: someone removed it). */
ampc_tensor *ampc__child_forward(ampc_module *m, const char *name, ampc_tensor *x);

/* The zoo's "gpt" (transformer.c) from a config whose zeros were filled in. */
ampc_module *ampc__gpt_new(const ampc_gpt_config *c);

/* Conv2d as ampc_conv2d_new, except weight_std > 0 draws the weight from N(0, weight_std^2)
   instead of PyTorch's default uniform (torchvision ResNets' kaiming_normal_ fan_out init). */
ampc_module *ampc__conv2d_make(int64_t in_channels, int64_t out_channels, int kernel_size,
                               const ampc_conv2d_options *opts, bool bias, double weight_std);

/* models.c: relu(bn(x)) in the zoo's ResNets as one fused op (default true); tests turn it off
   to compare with the two modules. */
extern bool ampc__fuse_bn_relu;
/* BatchNorm2d m's forward (its parameters, buffers, momentum, eps, num_batches_tracked), with
   the ReLU fused into the op when relu (models.c's relu(bn(x))). */
ampc_tensor *ampc__batchnorm2d_forward(ampc_module *m, ampc_tensor *x, bool relu);
/* relu(bn(x) + z) with the BatchNorm2d module m (ampc__batch_norm2d_add_relu: one op on CUDA) */
ampc_tensor *ampc__batchnorm2d_forward_add_relu(ampc_module *m, ampc_tensor *x, ampc_tensor *z);

#endif /* AMPC_NN_H */
