/*
 * comm.c - the collectives seam (core.h): which communication library serves the collectives,
 * and the one-process world used when none is registered.
 */
#include "core/core.h"

static int self_allreduce(void *buf, int64_t count, ampc_dtype dt, ampc_comm_op op) {
    (void)buf, (void)count, (void)dt, (void)op;
    return AMPC_OK;
}
/* a one-process collective is complete when it starts: no request is ever handed out */
static int self_iallreduce(void *buf, int64_t count, ampc_dtype dt, ampc_comm_op op, ampc_comm_req **req) {
    *req = NULL;
    return self_allreduce(buf, count, dt, op);
}
static int self_test(ampc_comm_req *req, bool *done) {
    (void)req;
    *done = true;
    return AMPC_OK;
}
static int self_wait(ampc_comm_req *req) {
    (void)req;
    return AMPC_OK;
}
static int self_broadcast(void *buf, size_t nbytes, int root) {
    (void)buf, (void)nbytes;
    return root == 0 ? AMPC_OK : ampc__err(AMPC_ERR_INVALID, "broadcast from rank %d in a world of one process", root);
}
static int self_barrier(void) { return AMPC_OK; }
static bool self_reads(ampc_device dev) {   /* a world of one touches no buffer */
    (void)dev;
    return true;
}

static const ampc_comm_ops self_comm = {
    .name = "self", .rank = 0, .size = 1,
    .allreduce = self_allreduce, .iallreduce = self_iallreduce, .test = self_test, .wait = self_wait,
    .broadcast = self_broadcast, .barrier = self_barrier, .reads = self_reads,
};

static const ampc_comm_ops *_Atomic registered;

void ampc__comm_register(const ampc_comm_ops *ops) { atomic_store(&registered, ops); }

const ampc_comm_ops *ampc__comm(void) {
    const ampc_comm_ops *ops = atomic_load(&registered);
    return ops ? ops : &self_comm;
}

bool ampc__comm_reads(ampc_device dev) {
    const ampc_comm_ops *c = ampc__comm();
    return c->reads ? c->reads(dev) : ampc__device(dev)->host_memory;
}

int ampc__comm_broadcast_tensor(ampc_tensor *t, int root) {
    const ampc_comm_ops *c = ampc__comm();
    if (ampc__comm_reads(t->device)) return c->broadcast(ampc__data(t), ampc__nbytes(t), root);
    ampc_tensor *h = ampc__host_copy(t);
    if (!h) return ampc_last_status();
    int rc = c->broadcast(ampc__data(h), ampc__nbytes(h), root);
    if (rc >= 0 && c->rank != root) rc = ampc__write_bytes(t, ampc__data(h), ampc__nbytes(h));
    ampc__release(h);
    return rc;
}
