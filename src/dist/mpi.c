/*
 * mpi.c - the collectives seam (core.h) on MPI, and the process calls of ampc/dist.h.
 *
 * ampc's world is a duplicate of MPI_COMM_WORLD (or of the communicator a program hands to
 * ampc_dist_adopt), with MPI_ERRORS_RETURN so that a failed collective becomes an ampc error
 * naming it. Collectives are called from one thread (MPI_THREAD_FUNNELED). bf16 and fp16
 * reductions use our own MPI operations (MPI has no 16-bit float type): each addition in f32,
 * rounded once with the dtype table's conversions.
 *
 * Time limit. MPI's collectives wait for ever for a process that never arrives (stopped, dead
 * without its launcher noticing, or on another code path). Every collective here is therefore
 * started non-blocking and completed by polling MPI_Test against a deadline (ampc_dist_set_timeout,
 * 1800 s by default, gloo's): past it the call fails with AMPC_ERR_TIMEOUT naming the collective,
 * and the world is then unusable (the program ends it with ampc_dist_abort). The poll spins for
 * the first millisecond, as MPI_Wait does, then sleeps 50 us between tests so that a rank waiting
 * on a slow peer leaves the cores to the threads that compute.
 */
#include "ampc/dist.h"
#include "core/core.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

static double g_timeout = AMPC_DIST_DEFAULT_TIMEOUT;   /* seconds a collective may wait; 0: for ever */

int ampc_dist_set_timeout(double seconds) {
    if (!(seconds >= 0) || seconds > 1e9) return ampc__err(AMPC_ERR_INVALID, "dist_set_timeout: %g s (want 0 for none, or up to 1e9)", seconds);
    g_timeout = seconds;
    return AMPC_OK;
}

double ampc_dist_get_timeout(void) { return g_timeout; }

bool ampc_dist_launched(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_RANK");
}

#ifdef AMPC_HAVE_MPI
#include <mpi.h>

struct ampc_comm_req {
    MPI_Request req;
    ampc_comm_req *next_free;
};

static struct {
    MPI_Comm comm;
    bool have;               /* comm is ours */
    bool we_initialized;     /* MPI_Init was ours: finalize calls MPI_Finalize */
    MPI_Op sum16[2];         /* bf16, f16 */
    ampc_comm_req *free_reqs;
    ampc_comm_ops ops;
    int local_rank, local_size;   /* among the world's processes on this machine */
} w = {.comm = MPI_COMM_NULL, .local_size = 1};

static int mpi_err(int code, const char *what) {
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(code, s, &len) != MPI_SUCCESS) snprintf(s, sizeof s, "MPI error %d", code);
    return ampc__err(AMPC_ERR_IO, "%s on rank %d: %s", what, w.ops.rank, s);
}

/* inout[i] = in[i] + inout[i] in f32, rounded once to the 16-bit dtype */
static void sum16(const void *in, void *inout, int n, ampc_dtype dt) {
    const ampc_dtype_traits *t = ampc__dt(dt);
    enum { CHUNK = 512 };
    float a[CHUNK], b[CHUNK];
    for (int i = 0; i < n; i += CHUNK) {
        size_t k = (size_t)(n - i < CHUNK ? n - i : CHUNK);
        t->to_f32((const uint16_t *)in + i, a, k);
        t->to_f32((uint16_t *)inout + i, b, k);
        for (size_t j = 0; j < k; j++) b[j] += a[j];
        t->from_f32(b, (uint16_t *)inout + i, k);
    }
}
static void sum_bf16(void *in, void *inout, int *len, MPI_Datatype *type) { (void)type; sum16(in, inout, *len, AMPC_BF16); }
static void sum_f16(void *in, void *inout, int *len, MPI_Datatype *type) { (void)type; sum16(in, inout, *len, AMPC_F16); }

static int mpi_type_op(ampc_dtype dt, ampc_comm_op op, MPI_Datatype *type, MPI_Op *mop) {
    bool sum = op == AMPC_COMM_SUM;
    switch (dt) {
    case AMPC_F32: *type = MPI_FLOAT; break;
    case AMPC_F64: *type = MPI_DOUBLE; break;
    case AMPC_I64: *type = MPI_INT64_T; break;
    case AMPC_BF16:
    case AMPC_F16:
        if (!sum) return ampc__err(AMPC_ERR_UNSUPPORTED, "all-reduce: only sums of %s", ampc_dtype_name(dt));
        *type = MPI_UINT16_T;
        *mop = w.sum16[dt == AMPC_F16];
        return AMPC_OK;
    default: return ampc__err(AMPC_ERR_DTYPE, "all-reduce of %s", ampc_dtype_name(dt));
    }
    *mop = sum ? MPI_SUM : MPI_MAX;
    return AMPC_OK;
}

static int count_ok(int64_t count) {
    return count >= 0 && count <= INT32_MAX ? AMPC_OK
                                            : ampc__err(AMPC_ERR_INVALID, "all-reduce of %lld elements (at most 2^31-1 at once)", (long long)count);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Completes *req by polling against the time limit; what names the collective for the errors. A
   request that timed out is left pending: the world is unusable (see the top of the file). */
static int complete(MPI_Request *req, const char *what) {
    const double t0 = now();
    for (long polls = 0;; polls++) {
        int flag = 0;
        int e = MPI_Test(req, &flag, MPI_STATUS_IGNORE);
        if (e != MPI_SUCCESS) return mpi_err(e, what);
        if (flag) return AMPC_OK;
        if ((polls & 63) != 63) continue;   /* the clock is read every 64 polls */
        const double waited = now() - t0;
        if (g_timeout > 0 && waited > g_timeout)
            return ampc__err(AMPC_ERR_TIMEOUT, "%s on rank %d: not every process took part within the collective time limit "
                                               "of %g s (a process is stopped, hung, dead, or on another path through the program)",
                             what, w.ops.rank, g_timeout);
        if (waited > 1e-3) nanosleep(&(struct timespec){0, 50000}, NULL);
    }
}

static int mpi_allreduce(void *buf, int64_t count, ampc_dtype dt, ampc_comm_op op) {
    MPI_Datatype type;
    MPI_Op mop;
    int rc = count_ok(count);
    if (rc >= 0) rc = mpi_type_op(dt, op, &type, &mop);
    if (rc < 0) return rc;
    MPI_Request req;
    int e = MPI_Iallreduce(MPI_IN_PLACE, buf, (int)count, type, mop, w.comm, &req);
    return e == MPI_SUCCESS ? complete(&req, "all-reduce") : mpi_err(e, "MPI_Iallreduce");
}

static void req_put(ampc_comm_req *r) {
    r->next_free = w.free_reqs;
    w.free_reqs = r;
}

static int mpi_iallreduce(void *buf, int64_t count, ampc_dtype dt, ampc_comm_op op, ampc_comm_req **req) {
    MPI_Datatype type;
    MPI_Op mop;
    int rc = count_ok(count);
    if (rc >= 0) rc = mpi_type_op(dt, op, &type, &mop);
    if (rc < 0) return rc;
    ampc_comm_req *r = w.free_reqs;   /* requests are recycled: a steady step allocates none */
    if (r) w.free_reqs = r->next_free;
    else if (!(r = calloc(1, sizeof *r))) return ampc__err(AMPC_ERR_OOM, "all-reduce request");
    int e = MPI_Iallreduce(MPI_IN_PLACE, buf, (int)count, type, mop, w.comm, &r->req);
    if (e != MPI_SUCCESS) {
        req_put(r);
        return mpi_err(e, "MPI_Iallreduce");
    }
    *req = r;
    return AMPC_OK;
}

static int mpi_test(ampc_comm_req *r, bool *done) {
    int flag = 0;
    int e = MPI_Test(&r->req, &flag, MPI_STATUS_IGNORE);
    if (e != MPI_SUCCESS) return mpi_err(e, "MPI_Test");
    *done = flag != 0;
    if (flag) req_put(r);
    return AMPC_OK;
}

static int mpi_wait(ampc_comm_req *r) {
    int rc = complete(&r->req, "waiting for an all-reduce");
    if (rc >= 0) req_put(r);   /* a timed-out request stays MPI's: it is never reused */
    return rc;
}

static int mpi_broadcast(void *buf, size_t nbytes, int root) {
    for (size_t off = 0; off < nbytes;) {   /* in pieces of at most 1 GiB: MPI counts are int */
        size_t k = nbytes - off < ((size_t)1 << 30) ? nbytes - off : (size_t)1 << 30;
        MPI_Request req;
        int e = MPI_Ibcast((char *)buf + off, (int)k, MPI_BYTE, root, w.comm, &req);
        int rc = e == MPI_SUCCESS ? complete(&req, "broadcast") : mpi_err(e, "MPI_Ibcast");
        if (rc < 0) return rc;
        off += k;
    }
    return AMPC_OK;
}

static int mpi_barrier(void) {
    MPI_Request req;
    int e = MPI_Ibarrier(w.comm, &req);
    return e == MPI_SUCCESS ? complete(&req, "barrier") : mpi_err(e, "MPI_Ibarrier");
}

static int start_world(MPI_Comm from) {
    int e = MPI_Comm_dup(from, &w.comm);
    if (e != MPI_SUCCESS) return mpi_err(e, "MPI_Comm_dup");
    MPI_Comm_set_errhandler(w.comm, MPI_ERRORS_RETURN);
    int rank = 0, size = 1;
    MPI_Comm_rank(w.comm, &rank);
    MPI_Comm_size(w.comm, &size);
    /* this machine's processes: those that can share memory with this one (MPI-3), ranked in
       world order, so that each can take its own GPU */
    MPI_Comm node;
    if ((e = MPI_Comm_split_type(w.comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node)) != MPI_SUCCESS) {
        MPI_Comm_free(&w.comm);
        return mpi_err(e, "MPI_Comm_split_type");
    }
    MPI_Comm_rank(node, &w.local_rank);
    MPI_Comm_size(node, &w.local_size);
    MPI_Comm_free(&node);
    MPI_Op_create(sum_bf16, 1, &w.sum16[0]);
    MPI_Op_create(sum_f16, 1, &w.sum16[1]);
    w.have = true;
    w.ops = (ampc_comm_ops){
        .name = "mpi", .rank = rank, .size = size,
        .allreduce = mpi_allreduce, .iallreduce = mpi_iallreduce, .test = mpi_test, .wait = mpi_wait,
        .broadcast = mpi_broadcast, .barrier = mpi_barrier,
    };
    ampc__comm_register(&w.ops);
    return AMPC_OK;
}

bool ampc_dist_available(void) { return true; }

int ampc_dist_init(int *argc, char ***argv) {
    if (w.have) return AMPC_OK;
    int inited = 0, provided = 0;
    MPI_Initialized(&inited);
    if (!inited) {
        if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
            return ampc__err(AMPC_ERR_IO, "MPI_Init_thread failed (is the launcher's environment complete?)");
        w.we_initialized = true;
    } else {
        MPI_Query_thread(&provided);
    }
    if (provided < MPI_THREAD_FUNNELED)
        return ampc__err(AMPC_ERR_UNSUPPORTED, "MPI provides thread level %d; ampc needs MPI_THREAD_FUNNELED", provided);
    return start_world(MPI_COMM_WORLD);
}

int ampc_dist_adopt(const void *mpi_comm) {
    if (!mpi_comm) return ampc__err(AMPC_ERR_INVALID, "dist_adopt: NULL communicator");
    int inited = 0, provided = 0;
    MPI_Initialized(&inited);
    if (!inited) return ampc__err(AMPC_ERR_STATE, "dist_adopt: MPI is not initialised");
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_FUNNELED)
        return ampc__err(AMPC_ERR_UNSUPPORTED, "dist_adopt: MPI was initialised at thread level %d; ampc needs MPI_THREAD_FUNNELED", provided);
    if (w.have) ampc_dist_finalize();
    return start_world(*(const MPI_Comm *)mpi_comm);
}

int ampc_dist_finalize(void) {
    if (w.have) {
        ampc__comm_register(NULL);
        MPI_Op_free(&w.sum16[0]);
        MPI_Op_free(&w.sum16[1]);
        MPI_Comm_free(&w.comm);
        w.have = false;
        w.local_rank = 0, w.local_size = 1;
    }
    while (w.free_reqs) {
        ampc_comm_req *r = w.free_reqs;
        w.free_reqs = r->next_free;
        free(r);
    }
    if (w.we_initialized) {
        int done = 0;
        MPI_Finalized(&done);
        if (!done) MPI_Finalize();
        w.we_initialized = false;
    }
    return AMPC_OK;
}

void ampc_dist_abort(int code) {
    if (w.have) MPI_Abort(w.comm, code);
    else if (w.we_initialized) MPI_Abort(MPI_COMM_WORLD, code);
}

int ampc_dist_local_rank(void) { return w.have ? w.local_rank : 0; }
int ampc_dist_local_size(void) { return w.have ? w.local_size : 1; }

#else   /* built without MPI */

bool ampc_dist_available(void) { return false; }
int ampc_dist_init(int *argc, char ***argv) {
    (void)argc, (void)argv;
    if (ampc_dist_launched())
        return ampc__err(AMPC_ERR_UNSUPPORTED, "started by an MPI launcher, but this ampc was built without MPI "
                                               "(install libopenmpi-dev and rebuild with AMPC_MPI=on)");
    return AMPC_OK;   /* a world of one */
}
int ampc_dist_adopt(const void *mpi_comm) {
    (void)mpi_comm;
    return ampc__err(AMPC_ERR_UNSUPPORTED, "dist_adopt: this ampc was built without MPI (AMPC_MPI=off)");
}
int ampc_dist_finalize(void) { return AMPC_OK; }
void ampc_dist_abort(int code) { (void)code; }
int ampc_dist_local_rank(void) { return 0; }
int ampc_dist_local_size(void) { return 1; }

#endif

int ampc_dist_rank(void) { return ampc__comm()->rank; }
int ampc_dist_world_size(void) { return ampc__comm()->size; }
int ampc_dist_allreduce_sum_f64(double *v, int64_t n) {
    if (!v && n) return ampc__err(AMPC_ERR_INVALID, "dist_allreduce_sum_f64: NULL values");
    return ampc__comm()->allreduce(v, n, AMPC_F64, AMPC_COMM_SUM);
}
int ampc_dist_max_f64(double *v, int64_t n) {
    if (!v && n) return ampc__err(AMPC_ERR_INVALID, "dist_max_f64: NULL values");
    return ampc__comm()->allreduce(v, n, AMPC_F64, AMPC_COMM_MAX);
}
int ampc_dist_broadcast(void *buf, size_t nbytes, int root) {
    if (!buf && nbytes) return ampc__err(AMPC_ERR_INVALID, "dist_broadcast: NULL buffer");
    if (root < 0 || root >= ampc__comm()->size)
        return ampc__err(AMPC_ERR_INVALID, "dist_broadcast: root %d not in a world of %d", root, ampc__comm()->size);
    return ampc__comm()->broadcast(buf, nbytes, root);
}
int ampc_dist_barrier(void) { return ampc__comm()->barrier(); }
