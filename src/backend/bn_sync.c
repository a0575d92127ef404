/*
 * bn_sync.c - SyncBatchNorm's exchanges of per-channel statistics (backend.h), shared by the
 * backends whose batch-norm kernels take `sync`. The kernels compute this process's statistics,
 * call these between their statistics pass and their normalisation pass, and carry on with the
 * world's. Blocking all-reduces in f64 through the collectives seam: every process must make
 * the same calls in the same order, which the same model running the same step guarantees.
 */
#include "backend/backend.h"

int ampc__bn_sync_stats(int64_t C, double *st) {
    const ampc_comm_ops *comm = ampc__comm();
    if (comm->size == 1) return AMPC_OK;
    double n = st[C], *mean = st, *q = st + C + 1, *local = st + 2 * C + 1;
    for (int64_t c = 0; c < C; c++) local[c] = mean[c], mean[c] *= n;   /* sums */
    int rc = comm->allreduce(st, C + 1, AMPC_F64, AMPC_COMM_SUM);
    if (rc < 0) return rc;
    double total = st[C];
    if (!(total >= 1))
        return ampc__err(AMPC_ERR_INVALID, "sync batch_norm: no values per channel on any of the %d processes", comm->size);
    for (int64_t c = 0; c < C; c++) {
        mean[c] /= total;
        double d = local[c] - mean[c];
        if (n > 0) q[c] += n * d * d;
    }
    return comm->allreduce(q, C, AMPC_F64, AMPC_COMM_SUM);
}

int ampc__bn_sync_sums(double *sums, int64_t n) {
    const ampc_comm_ops *comm = ampc__comm();
    return comm->size == 1 ? AMPC_OK : comm->allreduce(sums, n, AMPC_F64, AMPC_COMM_SUM);
}
