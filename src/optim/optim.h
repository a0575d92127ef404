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
    /* ZeRO stage 1 (ampc__optimizer_shard): owner[i] is the rank that keeps the state of
       parameter i and steps it; after a step every parameter is broadcast from its owner. NULL:
       this process steps all. */
    int *owner;
    int shard_rank;
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

/* ZeRO stage 1 over the processes of the collectives seam (src/dist/zero.c decides owner, one
   rank per parameter, n entries, copied): from here on this process steps only the parameters it
   owns and keeps only their state (the state of the others is released now), and every step ends
   with each stepped parameter broadcast from its owner (host memory only). owner NULL: back to
   stepping everything (the state of the parameters this process did not own starts empty). */
int ampc__optimizer_shard(ampc_optimizer *opt, const int *owner, int rank);
/* State slot s of parameter i, allocated zero-filled if absent (NULL + error on OOM). */
ampc_tensor *ampc__optimizer_state(ampc_optimizer *opt, int s, int i);

#endif /* AMPC_OPTIM_H */
