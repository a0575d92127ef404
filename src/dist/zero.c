/*
 * zero.c - sharded optimizer state (ZeRO stage 1; ampc/dist.h), on the optimizer's sharding
 * (src/optim: ampc__optimizer_shard steps only this rank's range of the parameters and
 * broadcasts every rank's range after the step).
 *
 * The partition is by element, as DeepSpeed's and llm.c's: the trainable parameters laid end to
 * end in the optimizer's order are cut into one contiguous range per rank (boundaries on 16
 * elements, a 64-byte line), so every rank keeps 1/W of the state whatever the sizes of the
 * tensors; a tensor that straddles a boundary is stepped in parts by two ranks. The gradients
 * are whole on every rank (DDP's all-reduce), each rank updates its range of the fp32 weights
 * with its state, and the updated weights travel by one broadcast per part from its rank - the
 * all-gather of ZeRO without a flat copy of the weights. (llm.c also reduce-scatters the
 * gradients instead of all-reducing them, half the gradient traffic; here DDP's overlapped
 * all-reduce stays, so that the GradScaler's inf check and the gradients every rank reads after
 * the step are those of unsharded training.)
 */
#include "ampc/dist.h"
#include "backend/backend.h"
#include "optim/optim.h"

#include <stdlib.h>
#include <string.h>

#define ALIGN 16   /* elements: range boundaries on 64-byte lines of f32 */

int ampc_zero_shard(ampc_optimizer *opt, int64_t *bytes_here, int64_t *bytes_all) {
    int rc = ampc__optimizer_check(opt, "ampc_zero_shard");
    if (rc < 0) return rc;
    const ampc_comm_ops *comm = ampc__comm();
    const int W = comm->size, n = opt->n;
    int64_t *flat = malloc((size_t)(n + 1) * sizeof *flat), *bounds = malloc((size_t)(W + 1) * sizeof *bounds);
    if (!flat || !bounds) {
        free(flat), free(bounds);
        return ampc__err(AMPC_ERR_OOM, "ampc_zero_shard: out of memory");
    }
    /* the trainable parameters: a frozen one has no state and is not partitioned */
    flat[0] = 0;
    for (int i = 0; i < n; i++) flat[i + 1] = flat[i] + (opt->params[i]->requires_grad ? opt->params[i]->numel : 0);
    const int64_t total = flat[n];
    bounds[0] = 0;
    for (int r = 1; r < W; r++) {
        int64_t b = (int64_t)((double)total * r / W) / ALIGN * ALIGN;   /* exact below 2^53 elements */
        bounds[r] = b < bounds[r - 1] ? bounds[r - 1] : b;
    }
    bounds[W] = total;
    rc = ampc__optimizer_shard(opt, flat, bounds, W, comm->rank);
    /* the state's slots, each of the parameters' dtype (f32; f64 on REF) */
    const int64_t per = ampc__optimizer_slots_used(opt) * (int64_t)(n ? ampc__dt(opt->params[0]->dtype)->size : sizeof(float));
    if (bytes_here) *bytes_here = per * (bounds[comm->rank + 1] - bounds[comm->rank]);
    if (bytes_all) *bytes_all = per * total;
    free(flat), free(bounds);
    return rc;
}

int ampc_zero_consolidate(ampc_optimizer *opt) {
    int rc = ampc__optimizer_check(opt, "ampc_zero_consolidate");
    if (rc < 0 || !opt->flat) return rc;
    const ampc_comm_ops *comm = ampc__comm();
    const int me = comm->rank, slots = ampc__optimizer_slots_used(opt);
    ampc_tensor *scratch = NULL;   /* a bystander's part */
    for (int i = 0; i < opt->n && rc >= 0; i++) {
        if (opt->flat[i] == opt->flat[i + 1]) continue;   /* whole on every rank already */
        ampc_tensor *p = opt->params[i];
        int first = 0;   /* the first rank with a part says whether there is state yet (no step: none) */
        int64_t lo, count;
        for (;; first++) {
            ampc__optimizer_part(opt, i, first, &lo, &count);
            if (count) break;
        }
        int64_t has = first == me && opt->state[0][i] != NULL;
        if ((rc = comm->broadcast(&has, sizeof has, first)) < 0 || !has) continue;
        for (int s = 0; s < slots && rc >= 0; s++) {
            ampc_tensor *whole = NULL;
            if (me == 0) {   /* the parameter's shape, this rank's part in place */
                ampc_mem_kind prev = ampc__mem_kind_push(AMPC_MEM_OPTIMIZER);
                whole = ampc__tensor_like(p, p->dtype);
                ampc__mem_kind_pop(prev);
                if (!whole) {
                    rc = ampc_last_status();
                    break;
                }
                ampc__optimizer_part(opt, i, 0, &lo, &count);
                if (count) rc = ampc__k_copy_block(opt->state[s][i], 0, count, whole, lo, count, 1, count, 1.0);
            }
            for (int r = 1; r < opt->shard_world && rc >= 0; r++) {
                ampc__optimizer_part(opt, i, r, &lo, &count);
                if (!count) continue;
                if (me == r) {   /* the state slot is the part */
                    rc = ampc__broadcast_range(opt->state[s][i], 0, count, r);
                } else if (me == 0) {
                    rc = ampc__broadcast_range(whole, lo, count, r);
                } else {   /* a bystander of the broadcast */
                    if (!scratch || scratch->numel < count) {
                        ampc__release(scratch);
                        if (!(scratch = ampc__tensor_new(p->dtype, p->device, 1, &count))) {
                            rc = ampc_last_status();
                            break;
                        }
                    }
                    rc = ampc__broadcast_range(scratch, 0, count, r);
                }
            }
            if (me == 0 && rc >= 0) {
                ampc__release(opt->state[s][i]);
                opt->state[s][i] = whole;
            } else {
                ampc__release(whole);
            }
        }
    }
    ampc__release(scratch);
    return rc;
}
