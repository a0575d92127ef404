/*
 * optim.h - the optimizer object shared by src/optim and src/amp (the scaler unscales and
 * checks the gradients of an optimizer's parameters).
 */
#ifndef AMPC_OPTIM_H
#define AMPC_OPTIM_H

#include "backend/backend.h"
#include "core/core.h"

typedef enum { AMPC_OPTIM_SGD = 0, AMPC_OPTIM_ADAM, AMPC_OPTIM_ADAMW } ampc_optim_kind;

struct ampc_optimizer {
    ampc_optim_kind kind;        /* first: the pool links free headers through it */
    uint64_t gen;                /* generation while live, 0 once freed (pooled header) */
    int n;                       /* parameters: they belong to the module/caller; the optimizer
                                    holds one reference to each (freeing the module first
                                    is memory-safe; the step then refuses) */
    ampc_tensor **params;
    ampc_tensor **state[3];      /* per param, NULL until its first step: SGD momentum buffer;
                                    Adam exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad) */
    int64_t *steps;              /* per param: steps taken (Adam bias correction; PyTorch's
                                    state['step']), counted only for steps with a grad */
    ampc_optim_item *items;      /* a step's backend call (n entries, reused every step) */
    int *item_param;             /* the parameter of items[k] */
    ampc_sgd_options sgd;
    ampc_adam_options adam;
    double *weight_decay;        /* per param: its group's weight decay, or < 0: the options' */
    /* ZeRO stage 1 (ampc__optimizer_shard): the partitioned parameters' elements, laid end to
       end in parameter order (parameter i at flat[i] .. flat[i + 1]; flat[n]: the total; an
       unpartitioned parameter has flat[i] == flat[i + 1] and is stepped whole on every rank),
       are cut into one contiguous range per rank, bounds[r] .. bounds[r + 1]. This rank keeps
       the state of its range only (1-D tensors of that part of each parameter) and steps only
       it; after a step every rank's parts are broadcast from it. NULL: this process steps all. */
    int64_t *flat, *bounds;
    int shard_rank, shard_world;
};

/* How many state slots this optimizer's settings use (state[0..n)): PyTorch keeps no SGD buffer
   without momentum, and max_exp_avg_sq only with amsgrad. */
static inline int ampc__optimizer_slots_used(const ampc_optimizer *opt) {
    return opt->kind == AMPC_OPTIM_SGD ? opt->sgd.momentum != 0 : opt->adam.amsgrad ? 3 : 2;
}

/* AMPC_OK if opt is live and every parameter's module (if it came from one) is alive; else
   the error naming call. O(parameters), no allocation: the step's checks. */
int ampc__optimizer_check(const ampc_optimizer *opt, const char *call);

/* ampc_optimizer_step with every gradient multiplied by grad_scale inside the update kernels
   (the GradScaler's unscale fused into the step; the grads themselves are left as they are).
   0: no scaling. */
int ampc__optimizer_step_scaled(ampc_optimizer *opt, float grad_scale);

/* ZeRO stage 1 over the processes of the collectives seam (src/dist/zero.c decides the
   partition: flat, n + 1 entries, and bounds, world + 1, as in struct ampc_optimizer; copied):
   from here on this process steps only its range and keeps only its state (a whole parameter's
   state, as a checkpoint load or ampc_zero_consolidate leaves it, is cut down to this rank's
   part; state of another size is released), and every step ends with each stepped parameter's
   parts broadcast from their ranks (any device: staged through host memory where the
   collectives cannot read the device's). flat NULL: back to stepping everything
   (state that is not whole is released). */
int ampc__optimizer_shard(ampc_optimizer *opt, const int64_t *flat, const int64_t *bounds, int world, int rank);
/* Rank r's part of parameter i: elements [*lo, *lo + *count) (*count 0: none); the whole
   parameter when unsharded or when i is not partitioned. */
void ampc__optimizer_part(const ampc_optimizer *opt, int i, int r, int64_t *lo, int64_t *count);
/* Elements [lo, lo + count) of t broadcast from rank root, on any device (staged through a
   part-sized tensor and host memory where the collectives do not read t's memory). */
int ampc__broadcast_range(ampc_tensor *t, int64_t lo, int64_t count, int root);
/* State slot s of parameter i, allocated zero-filled if absent (NULL + error on OOM): the
   parameter's shape, or under ZeRO a 1-D tensor of this rank's part. */
ampc_tensor *ampc__optimizer_state(ampc_optimizer *opt, int s, int i);

#endif /* AMPC_OPTIM_H */
