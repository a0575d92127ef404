/*
 * zero.c - sharded optimizer state (ZeRO stage 1; ampc/dist.h), on the optimizer's sharding
 * (src/optim: ampc__optimizer_shard steps only the owned parameters and broadcasts every
 * parameter from its owner after the step).
 *
 * Ownership is by whole parameter, as PyTorch's ZeroRedundancyOptimizer: the gradients are
 * already whole on every rank (DDP's all-reduce), each rank updates its parameters' fp32 weights
 * with their state, and the updated weights travel by one broadcast per parameter from its
 * owner - the all-gather of ZeRO, without a flat copy of the weights. (llm.c's form shards every
 * tensor and reduce-scatters the gradients instead of all-reducing them: half the gradient
 * traffic, at the price of flat buffers that split tensors across ranks.)
 */
#include "ampc/dist.h"
#include "optim/optim.h"

#include <stdlib.h>
#include <string.h>

/* Bytes of state per byte of parameter: SGD's momentum buffer, Adam's two (three) moments. */
static int64_t state_bytes(const ampc_optimizer *opt, int i) {
    const ampc_tensor *p = opt->params[i];
    return ampc__optimizer_slots_used(opt) * p->numel * (int64_t)ampc__dt(p->dtype)->size;
}

typedef struct {
    int64_t bytes;
    int i;
} by_size;

static int larger_first(const void *a, const void *b) {
    const by_size *x = a, *y = b;
    if (x->bytes != y->bytes) return x->bytes > y->bytes ? -1 : 1;
    return x->i - y->i;
}

int ampc_zero_shard(ampc_optimizer *opt, int64_t *bytes_here, int64_t *bytes_all) {
    int rc = ampc__optimizer_check(opt, "ampc_zero_shard");
    if (rc < 0) return rc;
    const ampc_comm_ops *comm = ampc__comm();
    int W = comm->size, n = opt->n;
    int *owner = malloc((size_t)(n ? n : 1) * sizeof *owner);
    by_size *order = malloc((size_t)(n ? n : 1) * sizeof *order);
    int64_t *load = calloc((size_t)W, sizeof *load);
    if (!owner || !order || !load) {
        free(owner), free(order), free(load);
        return ampc__err(AMPC_ERR_OOM, "ampc_zero_shard: out of memory");
    }
    for (int i = 0; i < n; i++) order[i] = (by_size){state_bytes(opt, i), i};
    qsort(order, (size_t)n, sizeof *order, larger_first);
    int64_t all = 0;
    for (int k = 0; k < n; k++) {
        int best = 0;
        for (int r = 1; r < W; r++)
            if (load[r] < load[best]) best = r;
        owner[order[k].i] = best;
        load[best] += order[k].bytes;
        all += order[k].bytes;
    }
    rc = ampc__optimizer_shard(opt, owner, comm->rank);
    if (bytes_here) *bytes_here = load[comm->rank];
    if (bytes_all) *bytes_all = all;
    free(owner), free(order), free(load);
    return rc;
}

int ampc_zero_consolidate(ampc_optimizer *opt) {
    int rc = ampc__optimizer_check(opt, "ampc_zero_consolidate");
    if (rc < 0 || !opt->owner) return rc;
    const ampc_comm_ops *comm = ampc__comm();
    const int me = comm->rank, slots = ampc__optimizer_slots_used(opt);
    void *scratch = NULL;
    size_t scratch_bytes = 0;
    for (int i = 0; i < opt->n && rc >= 0; i++) {
        const int from = opt->owner[i];
        /* the owner's step count and whether it has state yet (no step taken: none) */
        int64_t head[2] = {opt->steps[i], opt->state[0][i] != NULL};
        if ((rc = comm->broadcast(head, sizeof head, from)) < 0) break;
        opt->steps[i] = head[0];
        if (!head[1] || from == 0) continue;   /* nothing to move, or rank 0 has it */
        ampc_tensor *p = opt->params[i];
        size_t nb = (size_t)p->numel * ampc__dt(p->dtype)->size;
        for (int s = 0; s < slots && rc >= 0; s++) {
            void *buf;
            if (me == from) {
                buf = ampc__data(opt->state[s][i]);
            } else if (me == 0) {
                ampc_tensor *t = ampc__optimizer_state(opt, s, i);
                if (!t) {
                    rc = ampc_last_status();
                    break;
                }
                buf = ampc__data(t);
            } else {   /* a bystander of the broadcast */
                if (nb > scratch_bytes) {
                    void *q = realloc(scratch, nb);
                    if (!q) {
                        rc = ampc__err(AMPC_ERR_OOM, "ampc_zero_consolidate: out of memory");
                        break;
                    }
                    scratch = q;
                    scratch_bytes = nb;
                }
                buf = scratch;
            }
            rc = comm->broadcast(buf, nb, from);
        }
    }
    free(scratch);
    return rc;
}
