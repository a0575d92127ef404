/*
 * ddp.c - data-parallel models (PyTorch's DistributedDataParallel): gradients averaged across
 * ranks during backward, in buckets whose all-reduce overlaps the rest of backward.
 *
 * Buckets. The trainable parameters, in reverse state_dict order (backward produces the last
 * layers' gradients first), are packed into buckets of about bucket_bytes of fp32 (the first,
 * the last layers, smaller: first_bucket_bytes). Each bucket owns a flat tensor of the
 * gradients' dtype (f32; f64 on REF, which holds no f32) on the parameters' device, allocated
 * once when the model is wrapped, and a wire tensor that the collective reads and writes when it
 * is not the flat one itself: the 16-bit copy for a 16-bit wire, on the device where it holds
 * that dtype and the collectives read its memory, else in host memory (staging: a device whose
 * memory the communication library cannot read, as MPI cannot read a GPU's). A staged wire is
 * page-locked for the device's transfers where the device can (CUDA: cudaHostRegister), so the
 * two copies a step make move by DMA without the driver's bounce buffer.
 *
 * One backward. The engine calls leaf_ready when a parameter's gradient is final (its
 * AccumulateGrad node ran); the gradient times 1/world is copied into its slot by one kernel on
 * its device (copy_block with a scale).
 * When a bucket's last slot is filled the bucket is ready, and ready buckets start their
 * non-blocking all-reduce strictly in bucket order, so every rank issues the same collectives
 * in the same order whatever order its gradients arrive in (MPI requires it). finish (after
 * the last node) starts the buckets not yet started (a parameter that got no gradient on this
 * rank sends zeros), waits for all of them, and writes the averages into the parameters'
 * .grad (creating a zero .grad first where there is none, so every rank's optimizer sees the
 * same set of gradients).
 *
 * Progress. Open MPI (like most MPIs without an asynchronous progress thread) advances a
 * non-blocking collective only inside MPI calls made by the program. The engine calls node_done
 * after every backward node, and node_done tests every collective in flight (MPI_Test): the
 * bytes of a started bucket move between two nodes of backward, a few milliseconds apart,
 * while the kernels of the next node compute. No extra thread competes with the kernels' cores.
 *
 * The hooks act only on the thread that wrapped the model (the thread MPI was initialised
 * for); backward passes of other graphs or on other threads pass through untouched.
 */
#include "ampc/dist.h"
#include "autograd/autograd.h"
#include "backend/backend.h"
#include "core/core.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    ampc_tensor *p;     /* the module's (not owned) */
    int bucket;
    int64_t offset;     /* elements into the bucket */
    bool ready;         /* its gradient is in the bucket (this backward) */
} ddp_param;

typedef struct {
    ampc_tensor *flat;  /* count elements of the gradients' dtype on the parameters' device */
    ampc_tensor *wire;  /* what the collective reduces, when not flat (see the top), else NULL */
    int64_t count;
    int first, n;       /* its parameters: params[first .. first+n) */
    int pending;        /* parameters not ready this backward */
    ampc_comm_req *req;
    bool started, done;
    bool pinned;        /* the host wire is page-locked for dev's transfers (ddp_release unpins) */
} ddp_bucket;

struct ampc_ddp {
    uint64_t gen;       /* generation while live, 0 once freed (a handle pool's object) */
    ampc_module *model;
    ampc_ddp_options o;
    const ampc_comm_ops *comm;
    ampc_device dev;    /* the trainable parameters' device */
    ampc_dtype gdt;     /* their dtype and their gradients': f32 (f64 on a device without f32) */
    bool stage;         /* the collectives cannot read dev's memory: the wire is in host memory */
    ampc_tensor *zeros; /* a slot's worth of zeros, made when a parameter first has no gradient */
    pthread_t owner;
    ddp_param *params;
    int n_params;
    int *by_ptr;        /* param indices sorted by tensor address: leaf_ready's lookup */
    ddp_bucket *buckets;
    int n_buckets;
    int next_start;     /* buckets start in order: the next one to start */
    int any_ready;      /* parameters ready this backward */
    bool sync;
    ampc_ddp_stats stats;
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

ampc_ddp_options ampc_ddp_defaults(void) {
    return (ampc_ddp_options){.bucket_bytes = (size_t)25 << 20, .first_bucket_bytes = (size_t)1 << 20, .comm_dtype = AMPC_F32};
}

static bool model_alive(const ampc_ddp *d) { return d->n_params == 0 || ampc__owner_alive(d->params[0].p); }

static ampc_handle_pool ddp_pool = {.obj_size = sizeof(ampc_ddp)};

static int check_ddp(const ampc_ddp *d, const char *call) {
    if (!d) return ampc__err(AMPC_ERR_INVALID, "%s: NULL model wrapper", call);
    if (!d->gen) return ampc__check_handle(d, 0, call, "model wrapper", "freed");
    if (!model_alive(d)) return ampc__err(AMPC_ERR_STATE, "%s: the wrapped model was freed (free the wrapper first)", call);
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Buckets

/* Zeros into parameter q's slot (no gradient on this rank). */
static int zero_slot(ampc_ddp *d, ddp_param *q) {
    ddp_bucket *b = &d->buckets[q->bucket];
    if (!d->zeros) {
        int64_t most = 0;
        for (int i = 0; i < d->n_params; i++) most = d->params[i].p->numel > most ? d->params[i].p->numel : most;
        ampc_mem_kind prev = ampc__mem_kind_push(AMPC_MEM_GRADIENTS);
        d->zeros = ampc__tensor_new(d->gdt, d->dev, 1, &most);
        ampc__mem_kind_pop(prev);
        if (!d->zeros) return ampc_last_status();
        int rc = ampc__device(d->dev)->fill(d->zeros, 0.0);
        if (rc < 0) return rc;
    }
    return ampc__k_copy_block(d->zeros, 0, q->p->numel, b->flat, q->offset, b->count, 1, q->p->numel, 1.0);
}

static int start_bucket(ampc_ddp *d, ddp_bucket *b) {
    int rc = AMPC_OK;
    for (int i = b->first; i < b->first + b->n && rc >= 0; i++)   /* no gradient on this rank: zeros */
        if (!d->params[i].ready) rc = zero_slot(d, &d->params[i]);
    ampc_tensor *w = b->wire ? b->wire : b->flat;
    if (rc >= 0 && b->wire) rc = ampc__copy(b->flat, b->wire);   /* to the wire's dtype and memory */
    if (rc >= 0 && d->stage && ampc__device(d->dev)->synchronize) rc = ampc__device(d->dev)->synchronize();
    if (rc >= 0) rc = d->comm->iallreduce(ampc__data(w), b->count, w->dtype, AMPC_COMM_SUM, &b->req);
    if (rc < 0) return rc;
    b->started = true;
    b->done = b->req == NULL;   /* a one-process world completes at once */
    d->stats.allreduces++;
    d->stats.bytes_sent += b->count * (int64_t)ampc__dt(w->dtype)->size;
    return AMPC_OK;
}

/* Starts every ready bucket that is next in order. */
static int start_ready(ampc_ddp *d) {
    while (d->next_start < d->n_buckets && d->buckets[d->next_start].pending == 0) {
        int rc = start_bucket(d, &d->buckets[d->next_start]);
        if (rc < 0) return rc;
        d->next_start++;
    }
    return AMPC_OK;
}

static int progress(ampc_ddp *d) {
    for (int k = 0; k < d->next_start; k++) {
        ddp_bucket *b = &d->buckets[k];
        if (b->done) continue;
        int rc = d->comm->test(b->req, &b->done);
        if (rc < 0) return rc;
    }
    return AMPC_OK;
}

/* Copies the bucket's averages into its parameters' grads. */
static int bucket_out(ampc_ddp *d, ddp_bucket *b) {
    int rc = b->wire ? ampc__copy(b->wire, b->flat) : AMPC_OK;
    for (int i = b->first; i < b->first + b->n && rc >= 0; i++) {
        ampc_tensor *p = d->params[i].p;
        if (!p->grad) {
            ampc_mem_kind prev = ampc__mem_kind_push(AMPC_MEM_GRADIENTS);
            p->grad = ampc__tensor_like(p, d->gdt);
            ampc__mem_kind_pop(prev);
            if (!p->grad) return ampc_last_status();
        }
        rc = ampc__k_copy_block(b->flat, d->params[i].offset, b->count, p->grad, 0, p->numel, 1, p->numel, 1.0);
        if (rc >= 0) ampc__mark_written(p->grad);
    }
    return rc;
}

static void reset_backward(ampc_ddp *d) {
    for (int i = 0; i < d->n_params; i++) d->params[i].ready = false;
    for (int k = 0; k < d->n_buckets; k++) {
        ddp_bucket *b = &d->buckets[k];
        b->pending = b->n;
        b->req = NULL;
        b->started = b->done = false;
    }
    d->next_start = 0;
    d->any_ready = 0;
}

/* Puts parameter q's gradient, divided by the world size, into its bucket slot (zeros when it has
   none) and marks it ready. */
static int fill_slot(ampc_ddp *d, ddp_param *q) {
    double t0 = now();
    ddp_bucket *b = &d->buckets[q->bucket];
    ampc_tensor *g = q->p->grad;
    int rc;
    if (g) {
        if (g->dtype != d->gdt || g->numel != q->p->numel || g->device != d->dev)
            return ampc__err(AMPC_ERR_DTYPE, "data-parallel: a parameter's gradient must be %s with the parameter's shape, on %s",
                             ampc_dtype_name(d->gdt), ampc_device_name(d->dev));
        rc = ampc__k_copy_block(g, 0, g->numel, b->flat, q->offset, b->count, 1, g->numel, 1.0 / (double)d->comm->size);
    } else {
        rc = zero_slot(d, q);
    }
    if (rc < 0) return rc;
    d->stats.copy_seconds += now() - t0;
    q->ready = true;
    d->any_ready++;
    b->pending--;
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// The engine's hooks

static bool ours(const ampc_ddp *d) { return d->sync && pthread_equal(pthread_self(), d->owner) && model_alive(d); }

static int find_param(const ampc_ddp *d, const ampc_tensor *leaf) {
    int lo = 0, hi = d->n_params - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        const ampc_tensor *p = d->params[d->by_ptr[mid]].p;
        if (p == leaf) return d->by_ptr[mid];
        if ((uintptr_t)p < (uintptr_t)leaf) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

static int on_leaf_ready(void *ctx, ampc_tensor *leaf) {
    ampc_ddp *d = ctx;
    if (!ours(d)) return AMPC_OK;
    int i = find_param(d, leaf);
    if (i < 0 || d->params[i].ready) return AMPC_OK;
    ddp_param *q = &d->params[i];
    ddp_bucket *b = &d->buckets[q->bucket];
    if (b->started)   /* a second backward through the parameter before finish: cannot happen */
        return ampc__err(AMPC_ERR_STATE, "data-parallel: gradient of a parameter whose bucket was already sent");
    if (!leaf->grad) return ampc__err(AMPC_ERR_STATE, "data-parallel: a parameter reported ready has no gradient");
    int rc = fill_slot(d, q);
    if (rc < 0) return rc;
    int64_t before = d->stats.allreduces;
    rc = start_ready(d);
    d->stats.started_in_backward += d->stats.allreduces - before;
    return rc < 0 ? rc : progress(d);
}

static int on_node_done(void *ctx) {
    ampc_ddp *d = ctx;
    if (!ours(d) || !d->any_ready) return AMPC_OK;
    return progress(d);
}

/* The end of a synchronised backward (or a join): starts what is left, waits for every bucket
   and writes the averages into the grads. rc: the backward's status so far. */
static int finish_sync(ampc_ddp *d, int rc) {
    /* the rest of the buckets (parameters this rank got no gradient for send zeros) */
    for (int k = d->next_start; k < d->n_buckets && rc >= 0; k++) d->buckets[k].pending = 0;
    if (rc >= 0) rc = start_ready(d);
    double t0 = now();
    int wrc = AMPC_OK;
    for (int k = 0; k < d->next_start; k++) {   /* started ones complete even after an error */
        ddp_bucket *b = &d->buckets[k];
        if (b->done) continue;
        int r = d->comm->wait(b->req);
        if (r < 0 && wrc >= 0) wrc = r;
        b->done = true;
    }
    d->stats.exposed_seconds += now() - t0;
    if (rc >= 0) rc = wrc;
    double t1 = now();
    for (int k = 0; k < d->n_buckets && rc >= 0; k++) rc = bucket_out(d, &d->buckets[k]);
    d->stats.copy_seconds += now() - t1;
    reset_backward(d);
    return rc;
}

static int on_finish(void *ctx, int rc) {
    ampc_ddp *d = ctx;
    if (!ours(d) || !d->any_ready) return rc;
    return finish_sync(d, rc);
}

// ---------------------------------------------------------------------------------------------
// Wrapping

static int by_address(const void *a, const void *b, void *ctx) {
    const ampc_ddp *d = ctx;
    uintptr_t x = (uintptr_t)d->params[*(const int *)a].p, y = (uintptr_t)d->params[*(const int *)b].p;
    return x < y ? -1 : x > y;
}

static void ddp_release(ampc_ddp *d) {
    for (int k = 0; k < d->n_buckets; k++) {
        ddp_bucket *b = &d->buckets[k];
        if (b->pinned) ampc__device(d->dev)->host_unpin(ampc__data(b->wire));
        ampc__release(b->flat);
        ampc__release(b->wire);
    }
    ampc__release(d->zeros);
    d->zeros = NULL;
    free(d->buckets);
    free(d->params);
    free(d->by_ptr);
    d->gen = 0;
    ampc__handle_pool_put(&ddp_pool, d);
}

/* Every rank must hold the same architecture: compare counts and shapes with rank 0's. */
static int check_same_model(ampc_ddp *d, ampc_tensor **st, int n) {
    /* a fingerprint: count, then per tensor its dtype, ndim and shape, hashed in order */
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) {
        uint64_t v[2 + AMPC_MAX_DIMS] = {(uint64_t)st[i]->dtype, (uint64_t)st[i]->ndim};
        for (int k = 0; k < st[i]->ndim; k++) v[2 + k] = (uint64_t)st[i]->shape[k];
        for (int k = 0; k < 2 + AMPC_MAX_DIMS; k++) h = (h ^ v[k]) * 1099511628211ull;
    }
    double mine[2] = {(double)n, (double)(h >> 11)}, theirs[2] = {mine[0], mine[1]};
    int rc = d->comm->broadcast(theirs, sizeof theirs, 0);
    if (rc < 0) return rc;
    double bad = mine[0] != theirs[0] || mine[1] != theirs[1];
    rc = d->comm->allreduce(&bad, 1, AMPC_F64, AMPC_COMM_MAX);
    if (rc < 0) return rc;
    if (bad != 0)
        return ampc__err(AMPC_ERR_SHAPE, "data-parallel: rank %d's model differs from rank 0's (%d state tensors here, %.0f there, "
                                         "or another shape): every rank must build the same architecture",
                         d->comm->rank, n, theirs[0]);
    return AMPC_OK;
}

static int broadcast_tensors(ampc_ddp *d, ampc_tensor **st, int n, bool buffers_only) {
    for (int i = 0; i < n; i++) {
        if (buffers_only && st[i]->requires_grad) continue;
        ampc_tensor *h = ampc__host_copy(st[i]);
        if (!h) return ampc_last_status();
        int rc = d->comm->broadcast(ampc__data(h), ampc__nbytes(h), 0);
        if (rc >= 0 && d->comm->rank != 0) {
            rc = h == st[i] ? AMPC_OK : ampc__write_bytes(st[i], ampc__data(h), ampc__nbytes(h));
            ampc__mark_written(st[i]);
        }
        ampc__release(h);
        if (rc < 0) return rc;
    }
    return AMPC_OK;
}

ampc_ddp *ampc_ddp_new(ampc_module *model, const ampc_ddp_options *opts) {
    ampc_ddp_options o = opts ? *opts : ampc_ddp_defaults();
    if (o.comm_dtype != AMPC_F32 && o.comm_dtype != AMPC_BF16 && o.comm_dtype != AMPC_F16)
        return ampc__err_null(AMPC_ERR_DTYPE, "ddp_new: gradients travel as f32, bf16 or f16, not %s", ampc_dtype_name(o.comm_dtype));
    if (o.bucket_bytes < 4 || o.first_bucket_bytes < 4)
        return ampc__err_null(AMPC_ERR_INVALID, "ddp_new: bucket sizes must be at least 4 bytes (got %zu and %zu)", o.bucket_bytes,
                              o.first_bucket_bytes);
    ampc_tensor **params = NULL, **st = NULL;
    int n_all = model ? ampc_module_parameters(model, &params, NULL) : ampc__err(AMPC_ERR_INVALID, "ddp_new: NULL model");
    if (n_all < 0) return NULL;
    int n_st = ampc_module_state_dict(model, &st, NULL);
    if (n_st < 0) return NULL;
    ampc_ddp *d = ampc__handle_pool_get(&ddp_pool);
    if (!d) return NULL;
    d->gen = ampc__new_gen();
    d->model = model;
    d->o = o;
    d->comm = ampc__comm();
    d->owner = pthread_self();
    d->sync = true;
    d->dev = AMPC_DEVICE_CPU;
    d->gdt = AMPC_F32;
    d->stage = false;
    d->zeros = NULL;
    int n = 0;
    for (int i = 0; i < n_all; i++) n += params[i]->requires_grad;
    d->params = calloc((size_t)(n ? n : 1), sizeof *d->params);
    d->by_ptr = calloc((size_t)(n ? n : 1), sizeof *d->by_ptr);
    d->buckets = calloc((size_t)(n ? n : 1), sizeof *d->buckets);
    if (!d->params || !d->by_ptr || !d->buckets) {
        ddp_release(d);
        return ampc__err_null(AMPC_ERR_OOM, "ddp_new: parameter lists");
    }
    /* reverse order: the last layers' gradients come first in backward */
    for (int i = n_all - 1; i >= 0; i--) {
        if (!params[i]->requires_grad) continue;
        if (!d->n_params) {
            d->dev = params[i]->device;
            d->gdt = ampc__device_float(d->dev);
        }
        if (params[i]->device != d->dev) {
            ampc_device other = params[i]->device;
            ddp_release(d);
            return ampc__err_null(AMPC_ERR_INVALID, "ddp_new: parameter %d is on %s, others on %s: move the whole model to one device",
                                  i, ampc_device_name(other), ampc_device_name(d->dev));
        }
        if (params[i]->dtype != d->gdt) {
            ampc_dtype dt = params[i]->dtype, want = d->gdt;
            ddp_release(d);
            return ampc__err_null(AMPC_ERR_DTYPE, "ddp_new: parameter %d is %s; data-parallel models keep %s parameters "
                                                  "(autocast makes the 16-bit copies)", i, ampc_dtype_name(dt), ampc_dtype_name(want));
        }
        d->params[d->n_params++].p = params[i];
    }
    d->stage = !ampc__comm_reads(d->dev);   /* else the wire is staged in host memory */
    int rc = check_same_model(d, st, n_st);
    /* buckets: fill up to the cap, the first one to the smaller cap */
    for (int i = 0; i < d->n_params && rc >= 0; i++) {
        ddp_bucket *b = &d->buckets[d->n_buckets ? d->n_buckets - 1 : 0];
        size_t cap = d->n_buckets <= 1 ? o.first_bucket_bytes : o.bucket_bytes;
        if (!d->n_buckets || (size_t)b->count * 4 >= cap) {
            b = &d->buckets[d->n_buckets++];
            b->first = i;
        }
        d->params[i].bucket = (int)(b - d->buckets);
        d->params[i].offset = b->count;
        b->count += d->params[i].p->numel;
        b->n++;
    }
    /* the wire: on the device when it holds the wire's dtype and the collectives read it there */
    ampc_device wire_dev = !d->stage && ampc__device(d->dev)->dtypes[o.comm_dtype] ? d->dev : AMPC_DEVICE_CPU;
    bool wired = o.comm_dtype != d->gdt || wire_dev != d->dev;
    ampc_mem_kind prev = ampc__mem_kind_push(AMPC_MEM_GRADIENTS);
    for (int k = 0; k < d->n_buckets && rc >= 0; k++) {
        ddp_bucket *b = &d->buckets[k];
        b->flat = ampc__tensor_new(d->gdt, d->dev, 1, &b->count);
        if (b->flat && wired) b->wire = ampc__tensor_new(o.comm_dtype, wire_dev, 1, &b->count);
        if (!b->flat || (wired && !b->wire)) rc = ampc_last_status();
        else if (d->stage && ampc__device(d->dev)->host_pin)   /* staged: copied both ways every step */
            b->pinned = ampc__device(d->dev)->host_pin(ampc__data(b->wire), ampc__nbytes(b->wire));
    }
    ampc__mem_kind_pop(prev);
    d->stats.buckets = d->n_buckets;
    for (int i = 0; i < d->n_params; i++) d->by_ptr[i] = i;
    qsort_r(d->by_ptr, (size_t)d->n_params, sizeof *d->by_ptr, by_address, d);
    if (rc >= 0) rc = broadcast_tensors(d, st, n_st, false);
    if (rc >= 0) {
        reset_backward(d);
        rc = ampc__backward_hooks_add(&(ampc_backward_hooks){on_leaf_ready, on_node_done, on_finish, d});
    }
    if (rc < 0) {
        ddp_release(d);
        return NULL;
    }
    for (int i = 0; i < d->n_params; i++) d->params[i].p->replicated = d->comm->size > 1;
    return d;
}

void ampc_ddp_free(ampc_ddp *d) {
    if (!d || ampc__check_handle(d, d->gen, "ampc_ddp_free", "model wrapper", "freed") < 0) return;
    ampc__backward_hooks_remove(d);
    if (model_alive(d))
        for (int i = 0; i < d->n_params; i++) d->params[i].p->replicated = false;
    ddp_release(d);
}

int ampc_ddp_set_sync(ampc_ddp *d, bool sync) {
    int rc = check_ddp(d, "ddp_set_sync");
    if (rc < 0) return rc;
    d->sync = sync;
    return AMPC_OK;
}

int ampc_ddp_join(ampc_ddp *d) {
    int rc = check_ddp(d, "ddp_join");
    if (rc < 0 || d->comm->size == 1 || !d->sync) return rc;   /* no-sync: nothing is reduced now */
    if (!pthread_equal(pthread_self(), d->owner)) return ampc__err(AMPC_ERR_STATE, "ddp_join: not the thread that wrapped the model");
    if (d->any_ready) return ampc__err(AMPC_ERR_STATE, "ddp_join: inside a backward pass");
    for (int i = 0; i < d->n_params && rc >= 0; i++) rc = fill_slot(d, &d->params[i]);
    if (rc < 0) {
        reset_backward(d);
        return rc;
    }
    return finish_sync(d, rc);
}

int ampc_ddp_sync_buffers(ampc_ddp *d) {
    int rc = check_ddp(d, "ddp_sync_buffers");
    if (rc < 0 || d->comm->size == 1) return rc;
    ampc_tensor **st = NULL;
    int n = ampc_module_state_dict(d->model, &st, NULL);
    if (n < 0) return n;
    return broadcast_tensors(d, st, n, true);
}

int ampc_ddp_get_stats(const ampc_ddp *d, ampc_ddp_stats *s) {
    int rc = check_ddp(d, "ddp_get_stats");
    if (rc < 0) return rc;
    if (!s) return ampc__err(AMPC_ERR_INVALID, "ddp_get_stats: NULL stats");
    *s = d->stats;
    return AMPC_OK;
}
