/*
 * loader.c - the data loader: shuffled batches of (images f32 (B, C, H, W), labels i64 (B)),
 * made on the calling thread (num_workers = 0) or by background pthreads ahead of use; for a
 * token dataset (tokens.c), batches of windows x (B, T) i64, y (B, T) i64 on the calling thread.
 *
 * Determinism: the epoch's order is a Philox permutation of (seed, epoch) made in
 * start_epoch, batch b is always the same positions of it (batch_span), and a sample's random
 * transforms depend on (seed, epoch, sample index) only. So which worker makes which batch,
 * and in what order they finish, cannot change a single bit of the output.
 *
 * Shards (data-parallel ranks; this file knows no MPI): with W = shard_count ranks of B samples
 * each, global batch s is positions [start + s*W*B, start + (s+1)*W*B) of the permutation and
 * rank r takes the r-th slice of it, so the ranks' batches s, concatenated in rank order, are
 * the batch s of one loader with batch size W*B. W = 1 is the single-process loader.
 *
 * Threads: `prefetch` slots, each a batch buffer malloc'd once (no allocation per batch).
 * Batch b lives in slot b % prefetch. A worker claims the next batch number under the mutex
 * once its slot is free, fills it without the lock (reading only the dataset, the permutation
 * and its own scratch), then marks it ready; ampc_loader_next waits for batch `cur` in its
 * slot, copies it into two new tensors made on the calling thread (scopes are thread-local),
 * and frees the slot. start_epoch and free bump a generation counter that workers check
 * between samples, so they drop stale work quickly; both wait until no fill is in flight
 * before touching the permutation or the buffers.
 *
 * A device (options.device) without host memory and with a copy queue (CUDA), and workers: the
 * slots' image buffers are page-locked once, and a ready batch is copied straight from its slot
 * into a new device tensor on the device's copy queue (upload); the slot stays UPLOADING, not
 * to be refilled, until the copy is done (reap; only the calling thread touches UPLOADING
 * slots). ampc_loader_next hands out the batch whose upload it started before (the device's
 * work from then on waits for that copy, the host does not) and starts the next batch's upload
 * when that batch is ready, so the copy runs beside the step that uses this one. Other devices:
 * one copy of the batch after it is made.
 */
#include "data/data.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define LOADER_MAX_WORKERS 64

typedef enum { SLOT_FREE, SLOT_FILLING, SLOT_READY, SLOT_UPLOADING } slot_state;

typedef struct {
    float *images;      /* (batch_size, C, H, W) */
    int64_t *labels;    /* (batch_size) */
    int64_t batch;      /* batch number held (FILLING/READY) */
    slot_state state;
    int status;         /* < 0: the fill failed, msg says why */
    char msg[512];
    void *fence;        /* UPLOADING: the device's handle of the copy from images */
    bool pinned;        /* images page-locked for the device (host_unpin at free) */
} slot;

typedef struct ampc_loader ampc_loader;

typedef struct {
    ampc_loader *ld;
    float *raw;         /* one untransformed sample (C, H, W) */
    float *s0, *s1;     /* transform scratch */
} worker_buf;

struct ampc_loader {
    ampc_dataset *ds;            /* our reference */
    ampc_loader_options o;
    ampc_transforms *tf;         /* our copy, or NULL */
    int64_t c, h, w;             /* dataset sample shape */
    int64_t oc, oh, ow;          /* after transforms */
    int64_t n, n_batches;        /* n_batches: this rank's batches of the current epoch */
    int64_t full_batches;        /* this rank's batches of a whole epoch */
    int64_t global_batch;        /* shard_count * batch_size */
    int64_t start;               /* the epoch's first sample (position in perm) */
    int64_t *perm;               /* (n) this epoch's order */
    int64_t epoch;
    int64_t block_size;          /* token windows (x, y (B, T) i64, made on the calling thread); 0: images */
    int64_t shift;               /* token windows: this epoch's cut, in [0, block_size) */
    bool started;
    int64_t cur;                 /* next batch to hand out */
    int64_t global_rows;         /* all ranks' samples in the batch handed out last */
    int failed;                  /* sticky error of this epoch */
    char failed_msg[512];

    int n_workers;
    pthread_t *threads;
    worker_buf *bufs;            /* n_bufs: one per worker (one for the synchronous path) */
    int n_bufs;
    int n_slots;
    slot *slots;
    pthread_mutex_t mu;
    pthread_cond_t work, ready, idle;
    int64_t next_claim;          /* next batch a worker may take */
    int n_filling;
    bool active, stop;
    atomic_int gen;              /* bumped when in-flight fills become stale */
    bool async;                  /* uploads from page-locked slots (see the top) */
    ampc_tensor *ahead_x, *ahead_y;   /* batch cur, its upload started (owned until handed out) */
    void *ahead_fence;           /* its copy, while not yet reaped (NULL: done) */
    uint64_t handle_gen;         /* the handle's generation while live, 0 once freed */
};

static ampc_handle_pool loader_pool = {.obj_size = sizeof(ampc_loader)};

/* True (the error recorded) when ld is a stale handle; NULL is each call's own case. */
static bool stale(const ampc_loader *ld, const char *call) {
    return ld && ampc__check_handle(ld, ld->handle_gen, call, "loader", "freed") < 0;
}

ampc_loader_options ampc_loader_defaults(void) {
    return (ampc_loader_options){.batch_size = 64, .shuffle = true, .drop_last = false, .seed = 0,
                                 .num_workers = 0, .prefetch = 0, .transforms = NULL, .shard_rank = 0,
                                 .shard_count = 1, .device = AMPC_DEVICE_CPU};
}

// ---------------------------------------------------------------------------------------------
// Filling a batch (any thread)

/* The message of the last error on this thread without its "<status text>: " prefix. */
static const char *bare_message(int status) {
    const char *m = ampc_last_error(), *p = ampc_strerror(status);
    size_t k = strlen(p);
    return strncmp(m, p, k) == 0 && m[k] == ':' && m[k + 1] == ' ' ? m + k + 2 : m;
}

/* This rank's batches in an epoch whose samples start at position `start`: the full global
   batches, plus the last partial one unless drop_last, or drop_short_tail and it has fewer samples
   than ranks (otherwise the ranks past its samples get a batch of none). */
static int64_t count_batches(const ampc_loader *ld, int64_t start) {
    const int64_t left = ld->n - start, full = left / ld->global_batch, rest = left - full * ld->global_batch;
    return full + (rest > 0 && !ld->o.drop_last && !(ld->o.drop_short_tail && rest < ld->o.shard_count));
}

/* Batch b of this rank is perm[*first, *first + *rows). The last partial global batch of R
   samples is split in rank order: the first R % W ranks get R / W + 1, the others R / W. */
static void batch_span(const ampc_loader *ld, int64_t b, int64_t *first, int64_t *rows) {
    const int64_t g = ld->start + b * ld->global_batch, left = ld->n - g, r = ld->o.shard_rank;
    if (left >= ld->global_batch) {
        *first = g + r * ld->o.batch_size;
        *rows = ld->o.batch_size;
        return;
    }
    const int64_t q = left / ld->o.shard_count, m = left % ld->o.shard_count;
    *first = g + r * q + (r < m ? r : m);
    *rows = q + (r < m);
}

/* Fills batch b into images/labels. gen >= 0: give up (return 1) once the generation moves on. */
static int fill_batch(ampc_loader *ld, worker_buf *wb, int64_t b, float *images, int64_t *labels, int gen) {
    const int64_t per = ld->oc * ld->oh * ld->ow;
    int64_t first, rows;
    batch_span(ld, b, &first, &rows);
    ampc_dataset *ds = ld->ds;
    for (int64_t k = 0; k < rows; k++) {
        if (gen >= 0 && atomic_load_explicit(&ld->gen, memory_order_relaxed) != gen) return 1;
        int64_t idx = ld->perm[first + k];
        float *dst = images + k * per;
        int rc = ds->vt->get(ds, idx, ld->tf ? wb->raw : dst, &labels[k]);
        if (rc >= 0 && ld->tf)
            rc = ampc__transforms_run(ld->tf, ld->c, ld->h, ld->w, wb->raw, dst, wb->s0, wb->s1, ld->o.seed,
                                      ld->epoch, idx);
        if (rc >= 0 && (labels[k] < 0 || labels[k] >= ds->num_classes))
            rc = ampc__err(AMPC_ERR_FORMAT, "label %lld not in [0, %lld)", (long long)labels[k],
                           (long long)ds->num_classes);
        if (rc < 0) {
            char why[512];   /* copied: the message lives in the buffer ampc__err rewrites */
            snprintf(why, sizeof why, "%s", bare_message(rc));
            return ampc__err(rc, "loader: sample %lld (batch %lld of epoch %lld): %s", (long long)idx, (long long)b,
                             (long long)ld->epoch, why);
        }
    }
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Workers

static void *worker_main(void *arg) {
    worker_buf *wb = arg;
    ampc_loader *ld = wb->ld;
    pthread_mutex_lock(&ld->mu);
    for (;;) {
        while (!ld->stop && !(ld->active && ld->next_claim < ld->n_batches &&
                              ld->slots[ld->next_claim % ld->n_slots].state == SLOT_FREE))
            pthread_cond_wait(&ld->work, &ld->mu);
        if (ld->stop) break;
        int64_t b = ld->next_claim++;
        slot *s = &ld->slots[b % ld->n_slots];
        s->state = SLOT_FILLING;
        s->batch = b;
        ld->n_filling++;
        int gen = atomic_load(&ld->gen);
        pthread_mutex_unlock(&ld->mu);

        int rc = fill_batch(ld, wb, b, s->images, s->labels, gen);
        char msg[512] = "";
        if (rc < 0) snprintf(msg, sizeof msg, "%s", bare_message(rc));

        pthread_mutex_lock(&ld->mu);
        ld->n_filling--;
        if (rc != 1 && gen == atomic_load(&ld->gen)) {
            s->state = SLOT_READY;
            s->status = rc < 0 ? rc : AMPC_OK;
            memcpy(s->msg, msg, sizeof msg);
            pthread_cond_broadcast(&ld->ready);
        } else {
            s->state = SLOT_FREE;   /* stale: start_epoch resets every slot anyway */
        }
        if (ld->n_filling == 0) pthread_cond_broadcast(&ld->idle);
    }
    pthread_mutex_unlock(&ld->mu);
    return NULL;
}

/* Stops the current epoch's work: no new claims, and waits for fills in flight. Under mu. */
static void quiesce_locked(ampc_loader *ld) {
    ld->active = false;
    atomic_fetch_add(&ld->gen, 1);
    while (ld->n_filling > 0) pthread_cond_wait(&ld->idle, &ld->mu);
}

/* A batch that could not be made: the failure is sticky until the next epoch (the batch is gone
   from its slot), with the fill's own message if it left one in failed_msg, else rc's. */
static int fail_batch(ampc_loader *ld, int rc) {
    if (!ld->failed_msg[0]) snprintf(ld->failed_msg, sizeof ld->failed_msg, "%s", bare_message(rc));
    ld->failed = rc;
    return ampc__err(rc, "%s", ld->failed_msg);
}

/* Batch b handed out: images x, labels y. */
static int hand_out(ampc_loader *ld, int64_t b, ampc_tensor *x, ampc_tensor *y, ampc_tensor **images, ampc_tensor **labels) {
    ld->cur = b + 1;
    const int64_t left = ld->n - (ld->start + b * ld->global_batch);
    ld->global_rows = left < ld->global_batch ? left : ld->global_batch;
    *images = ampc__scope_adopt(x);
    *labels = ampc__scope_adopt(y);
    return 1;
}

// ---------------------------------------------------------------------------------------------
// Uploads (calling thread; see the top)

/* UPLOADING slots whose copy is done (wait: every one, waiting for it) become FREE. */
static void reap(ampc_loader *ld, bool wait) {
    const ampc_device_ops *dev = ampc__device(ld->o.device);
    for (int i = 0; i < ld->n_slots; i++) {
        slot *s = &ld->slots[i];
        pthread_mutex_lock(&ld->mu);
        void *f = s->state == SLOT_UPLOADING ? s->fence : NULL;
        bool up = s->state == SLOT_UPLOADING;
        pthread_mutex_unlock(&ld->mu);
        if (!up || (!wait && f && dev->fence_done(f) == 0)) continue;
        dev->fence_free(f);
        if (f == ld->ahead_fence) ld->ahead_fence = NULL;
        pthread_mutex_lock(&ld->mu);
        s->fence = NULL;
        s->state = SLOT_FREE;
        pthread_cond_broadcast(&ld->work);
        pthread_mutex_unlock(&ld->mu);
    }
}

/* Every upload finished and the batch ahead, if any, dropped (before a new epoch or free). */
static void drop_uploads(ampc_loader *ld) {
    reap(ld, true);
    ampc__release(ld->ahead_x);
    ampc__release(ld->ahead_y);
    ld->ahead_x = ld->ahead_y = NULL;
    ld->ahead_fence = NULL;
}

/* Waits for batch b in its slot (an older batch's finished upload freed first), then starts its
   upload into a new device tensor: the batch ahead. < 0 with failed_msg set on failure. */
static int start_upload(ampc_loader *ld, int64_t b) {
    const ampc_device_ops *dev = ampc__device(ld->o.device);
    slot *s = &ld->slots[b % ld->n_slots];
    for (;;) {
        pthread_mutex_lock(&ld->mu);
        while (!(s->state == SLOT_READY && s->batch == b) && s->state != SLOT_UPLOADING) pthread_cond_wait(&ld->ready, &ld->mu);
        bool ready = s->state == SLOT_READY;
        pthread_mutex_unlock(&ld->mu);
        if (ready) break;
        reap(ld, true);   /* the slot still holds an older batch's copy: let it finish */
    }
    int64_t first, rows;
    batch_span(ld, b, &first, &rows);
    const int64_t xs[4] = {rows, ld->oc, ld->oh, ld->ow};
    int rc = s->status;
    ampc_tensor *x = NULL, *y = NULL;
    void *fence = NULL;
    if (rc < 0) {
        memcpy(ld->failed_msg, s->msg, sizeof s->msg);
    } else if (!(x = ampc__tensor_new(AMPC_F32, ld->o.device, 4, xs)) || !(y = ampc__tensor_new(AMPC_I64, AMPC_DEVICE_CPU, 1, xs))) {
        rc = ampc_last_status();
    } else {
        memcpy(ampc__data(y), s->labels, (size_t)rows * sizeof(int64_t));
        size_t bytes = ampc__nbytes(x);
        if (bytes) rc = dev->upload(x, s->images, bytes, &fence);
    }
    if (rc < 0 && !ld->failed_msg[0]) snprintf(ld->failed_msg, sizeof ld->failed_msg, "%s", bare_message(rc));
    pthread_mutex_lock(&ld->mu);
    s->fence = fence;
    s->state = fence ? SLOT_UPLOADING : SLOT_FREE;
    if (!fence) pthread_cond_broadcast(&ld->work);
    pthread_mutex_unlock(&ld->mu);
    if (rc < 0) {
        ampc__release(x);
        ampc__release(y);
        return rc;
    }
    ld->ahead_x = x;
    ld->ahead_y = y;
    ld->ahead_fence = fence;
    return AMPC_OK;
}

/* ampc_loader_next's asynchronous path: the batch ahead (always batch cur: it is started for
   cur just after cur moves, and dropped with a new epoch) handed out, the next one's upload
   started if it is ready. */
static int next_async(ampc_loader *ld, ampc_tensor **images, ampc_tensor **labels) {
    const ampc_device_ops *dev = ampc__device(ld->o.device);
    const int64_t b = ld->cur;
    reap(ld, false);
    int rc = ld->ahead_x ? AMPC_OK : start_upload(ld, b);
    if (rc >= 0 && ld->ahead_fence) rc = dev->fence_order(ld->ahead_fence);
    if (rc < 0) return fail_batch(ld, rc);
    ampc_tensor *x = ld->ahead_x, *y = ld->ahead_y;
    ld->ahead_x = ld->ahead_y = NULL;
    ld->ahead_fence = NULL;
    if (b + 1 < ld->n_batches) {   /* the next batch's copy beside this one's step, if it is made already */
        slot *n = &ld->slots[(b + 1) % ld->n_slots];
        pthread_mutex_lock(&ld->mu);
        bool ready = n->state == SLOT_READY && n->batch == b + 1;
        pthread_mutex_unlock(&ld->mu);
        int up = ready ? start_upload(ld, b + 1) : AMPC_OK;
        if (up < 0) ld->failed = up;   /* the next call reports it (this batch is handed out) */
    }
    return hand_out(ld, b, x, y, images, labels);
}

// ---------------------------------------------------------------------------------------------
// Life cycle

void ampc_loader_free(ampc_loader *ld) {
    if (!ld || stale(ld, "ampc_loader_free")) return;
    if (ld->async) drop_uploads(ld);
    if (ld->threads) {
        pthread_mutex_lock(&ld->mu);
        ld->stop = true;
        atomic_fetch_add(&ld->gen, 1);
        pthread_cond_broadcast(&ld->work);
        pthread_mutex_unlock(&ld->mu);
        for (int i = 0; i < ld->n_workers; i++) pthread_join(ld->threads[i], NULL);
        free(ld->threads);
    }
    if (ld->bufs) {
        for (int i = 0; i < ld->n_bufs; i++) {
            free(ld->bufs[i].raw);
            free(ld->bufs[i].s0);
            free(ld->bufs[i].s1);
        }
        free(ld->bufs);
    }
    for (int i = 0; ld->slots && i < ld->n_slots; i++) {
        if (ld->slots[i].pinned) ampc__device(ld->o.device)->host_unpin(ld->slots[i].images);
        free(ld->slots[i].images);
        free(ld->slots[i].labels);
    }
    free(ld->slots);
    free(ld->perm);
    ampc_transforms_free(ld->tf);
    ampc__dataset_release(ld->ds);   /* our reference */
    pthread_mutex_destroy(&ld->mu);
    pthread_cond_destroy(&ld->work);
    pthread_cond_destroy(&ld->ready);
    pthread_cond_destroy(&ld->idle);
    ld->handle_gen = 0;
    ampc__handle_pool_put(&loader_pool, ld);
}

ampc_loader *ampc_loader_new(ampc_dataset *ds, const ampc_loader_options *opts) {
    if (!ds) return ampc__err_null(AMPC_ERR_INVALID, "loader_new: NULL dataset");
    if (ampc__dataset_stale(ds, "ampc_loader_new")) return NULL;
    ampc_loader_options o = opts ? *opts : ampc_loader_defaults();
    if (o.batch_size < 1) return ampc__err_null(AMPC_ERR_INVALID, "loader_new: batch_size %lld < 1", (long long)o.batch_size);
    if (o.num_workers < 0 || o.num_workers > LOADER_MAX_WORKERS)
        return ampc__err_null(AMPC_ERR_INVALID, "loader_new: num_workers %d not in [0, %d]", o.num_workers,
                              LOADER_MAX_WORKERS);
    if (o.prefetch < 0) return ampc__err_null(AMPC_ERR_INVALID, "loader_new: prefetch %d < 0", o.prefetch);
    if (o.shard_count < 1)
        return ampc__err_null(AMPC_ERR_INVALID, "loader_new: shard_count %d < 1 (the number of ranks; 1 without sharding)",
                              o.shard_count);
    if (o.shard_rank < 0 || o.shard_rank >= o.shard_count)
        return ampc__err_null(AMPC_ERR_INVALID, "loader_new: shard_rank %d not in [0, %d) (shard_count %d)", o.shard_rank,
                              o.shard_count, o.shard_count);
    if (o.batch_size > INT64_MAX / o.shard_count)
        return ampc__err_null(AMPC_ERR_INVALID, "loader_new: batch_size %lld times shard_count %d overflows",
                              (long long)o.batch_size, o.shard_count);
    int64_t oc, oh, ow;
    if (ampc_transforms_output_shape(o.transforms, ds->channels, ds->height, ds->width, &oc, &oh, &ow) < 0) return NULL;
    if (ds->block_size && o.transforms)
        return ampc__err_null(AMPC_ERR_INVALID, "loader_new: transforms apply to images, not to a token dataset's windows");
    if (ds->block_size) o.num_workers = 0;   /* a window is a copy of T + 1 tokens: no worker would gain */
    if ((unsigned)o.device >= AMPC_DEVICE_COUNT) return ampc__err_null(AMPC_ERR_INVALID, "loader_new: unknown device %d", (int)o.device);
    const char *why = ampc_device_unavailable_reason(o.device);
    if (why) return ampc__err_null(AMPC_ERR_UNSUPPORTED, "loader_new: device %s: %s", ampc_device_name(o.device), why);

    ampc_loader *ld = ampc__handle_pool_get(&loader_pool);
    if (!ld) return NULL;
    ld->handle_gen = ampc__new_gen();
    pthread_mutex_init(&ld->mu, NULL);
    pthread_cond_init(&ld->work, NULL);
    pthread_cond_init(&ld->ready, NULL);
    pthread_cond_init(&ld->idle, NULL);
    atomic_init(&ld->gen, 0);
    atomic_fetch_add(&ds->refs, 1);
    ld->ds = ds;
    ld->o = o;
    ld->c = ds->channels;
    ld->h = ds->height;
    ld->w = ds->width;
    ld->oc = oc;
    ld->oh = oh;
    ld->ow = ow;
    ld->n = ds->size;
    ld->block_size = ds->block_size;
    ld->global_batch = o.batch_size * o.shard_count;
    ld->n_batches = ld->full_batches = count_batches(ld, 0);
    ld->n_workers = o.num_workers;
    ld->n_slots = o.num_workers == 0 ? 0 : o.prefetch > 0 ? o.prefetch : 2 * o.num_workers;

    bool ok = (ld->perm = malloc((size_t)(ld->n > 0 ? ld->n : 1) * sizeof *ld->perm)) != NULL;
    if (ok && o.transforms) ok = (ld->tf = ampc__transforms_clone(o.transforms)) != NULL;
    int nb = ld->n_workers > 0 ? ld->n_workers : 1;
    if (ok) ok = (ld->bufs = calloc((size_t)nb, sizeof *ld->bufs)) != NULL;
    if (ok) ld->n_bufs = nb;
    const size_t raw = (size_t)(ld->c * ld->h * ld->w), scratch = (size_t)ampc__transforms_scratch_floats(ld->tf, ld->c, ld->h, ld->w);
    for (int i = 0; ok && i < nb; i++) {
        ld->bufs[i].ld = ld;
        if (!ld->tf) continue;
        ok = (ld->bufs[i].raw = malloc(raw * sizeof(float))) && (ld->bufs[i].s0 = malloc(scratch * sizeof(float))) &&
             (ld->bufs[i].s1 = malloc(scratch * sizeof(float)));
    }
    if (ok && ld->n_slots) ok = (ld->slots = calloc((size_t)ld->n_slots, sizeof *ld->slots)) != NULL;
    const size_t per_batch = (size_t)(o.batch_size * oc * oh * ow);
    for (int i = 0; ok && i < ld->n_slots; i++)
        ok = (ld->slots[i].images = malloc(per_batch * sizeof(float))) &&
             (ld->slots[i].labels = malloc((size_t)o.batch_size * sizeof(int64_t)));
    if (ok && ld->n_workers) ok = (ld->threads = calloc((size_t)ld->n_workers, sizeof *ld->threads)) != NULL;
    if (!ok) {
        ampc_loader_free(ld);
        return ampc__err_null(AMPC_ERR_OOM, "loader_new: out of memory for %d batch buffers of %zu floats", ld->n_slots,
                              per_batch);
    }
    const ampc_device_ops *dev = ampc__device(o.device);
    ld->async = ld->n_workers > 0 && !dev->host_memory && dev->upload && dev->host_pin && dev->host_unpin;
    for (int i = 0; ld->async && i < ld->n_slots; i++)
        ld->async = ld->slots[i].pinned = dev->host_pin(ld->slots[i].images, per_batch * sizeof(float));
    for (int i = 0; !ld->async && i < ld->n_slots; i++)   /* some could not be pinned: copies per batch */
        if (ld->slots[i].pinned) dev->host_unpin(ld->slots[i].images), ld->slots[i].pinned = false;
    for (int i = 0; i < ld->n_workers; i++) {
        if (pthread_create(&ld->threads[i], NULL, worker_main, &ld->bufs[i]) != 0) {
            ld->n_workers = i;   /* join only those that started */
            ampc_loader_free(ld);
            return ampc__err_null(AMPC_ERR_STATE, "loader_new: cannot start worker thread %d", i);
        }
    }
    return ld;
}

/* Starts epoch `epoch` with its samples from position start, handing out batch first_batch
   next (arguments checked by the callers). */
static int start_epoch(ampc_loader *ld, int64_t epoch, int64_t start, int64_t first_batch) {
    if (ld->async) drop_uploads(ld);
    if (ld->n_workers) {
        pthread_mutex_lock(&ld->mu);
        quiesce_locked(ld);
    }
    if (ld->o.shuffle)
        ampc__data_permutation(ampc__data_key(ld->o.seed, AMPC__DOMAIN_SHUFFLE, epoch), ld->n, ld->perm);
    else
        for (int64_t i = 0; i < ld->n; i++) ld->perm[i] = i;
    ld->epoch = epoch;
    ld->shift = ld->block_size && ld->o.shuffle ? (int64_t)(ampc__data_key(ld->o.seed, AMPC__DOMAIN_WINDOW_SHIFT, epoch) % (uint64_t)ld->block_size) : 0;
    ld->started = true;
    ld->start = start;
    ld->n_batches = count_batches(ld, start);
    ld->cur = first_batch;
    ld->global_rows = 0;
    ld->failed = 0;
    if (ld->n_workers) {
        for (int i = 0; i < ld->n_slots; i++) ld->slots[i].state = SLOT_FREE;
        ld->next_claim = first_batch;
        ld->active = true;
        pthread_cond_broadcast(&ld->work);
        pthread_mutex_unlock(&ld->mu);
    }
    return AMPC_OK;
}

int ampc_loader_start_epoch(ampc_loader *ld, int64_t epoch) { return ampc_loader_start_epoch_at(ld, epoch, 0); }

int ampc_loader_start_epoch_at(ampc_loader *ld, int64_t epoch, int64_t first_batch) {
    if (!ld) return ampc__err(AMPC_ERR_INVALID, "loader_start_epoch: NULL loader");
    if (stale(ld, "ampc_loader_start_epoch")) return AMPC_ERR_STATE;
    if (epoch < 0) return ampc__err(AMPC_ERR_INVALID, "loader_start_epoch: epoch %lld < 0", (long long)epoch);
    if (first_batch < 0 || first_batch > ld->full_batches)
        return ampc__err(AMPC_ERR_INVALID, "loader_start_epoch: first batch %lld not in [0, %lld]", (long long)first_batch,
                         (long long)ld->full_batches);
    return start_epoch(ld, epoch, 0, first_batch);
}

int ampc_loader_start_epoch_at_sample(ampc_loader *ld, int64_t epoch, int64_t first_sample) {
    if (!ld) return ampc__err(AMPC_ERR_INVALID, "loader_start_epoch_at_sample: NULL loader");
    if (stale(ld, "ampc_loader_start_epoch_at_sample")) return AMPC_ERR_STATE;
    if (epoch < 0) return ampc__err(AMPC_ERR_INVALID, "loader_start_epoch_at_sample: epoch %lld < 0", (long long)epoch);
    if (first_sample < 0 || first_sample > ld->n)
        return ampc__err(AMPC_ERR_INVALID,
                         "loader_start_epoch_at_sample: first sample %lld not in [0, %lld] (the dataset's size)",
                         (long long)first_sample, (long long)ld->n);
    return start_epoch(ld, epoch, first_sample, 0);
}

/* A stale loader reads as NULL does (0, -1), with the error recorded. */
int64_t ampc_loader_num_batches(const ampc_loader *ld) { return ld && !stale(ld, "ampc_loader_num_batches") ? ld->n_batches : 0; }

int64_t ampc_loader_count_batches(const ampc_loader *ld, int64_t first_sample) {
    if (!ld) {
        ampc__err(AMPC_ERR_INVALID, "loader_count_batches: NULL loader");
        return -1;
    }
    if (stale(ld, "ampc_loader_count_batches")) return -1;
    if (first_sample < 0 || first_sample > ld->n) {
        ampc__err(AMPC_ERR_INVALID, "loader_count_batches: first sample %lld not in [0, %lld] (the dataset's size)",
                  (long long)first_sample, (long long)ld->n);
        return -1;
    }
    return count_batches(ld, first_sample);
}

int64_t ampc_loader_epoch_position(const ampc_loader *ld) {
    if (!ld || stale(ld, "ampc_loader_epoch_position") || !ld->started) return 0;
    const int64_t left = ld->n - ld->start;   /* cur * G, capped: the last global batch may be short */
    return ld->start + (ld->cur > left / ld->global_batch ? left : ld->cur * ld->global_batch);
}

int64_t ampc_loader_global_rows(const ampc_loader *ld) { return ld && !stale(ld, "ampc_loader_global_rows") ? ld->global_rows : 0; }

void ampc_loader_sample_shape(const ampc_loader *ld, int64_t *c, int64_t *h, int64_t *w) {
    if (stale(ld, "ampc_loader_sample_shape")) ld = NULL;
    if (c) *c = ld ? ld->oc : 0;
    if (h) *h = ld ? ld->oh : 0;
    if (w) *w = ld ? ld->ow : 0;
}

// ---------------------------------------------------------------------------------------------
// Handing out batches (calling thread)

int ampc_loader_next(ampc_loader *ld, ampc_tensor **images, ampc_tensor **labels) {
    if (images) *images = NULL;
    if (labels) *labels = NULL;
    if (!ld || !images || !labels) return ampc__err(AMPC_ERR_INVALID, "loader_next: NULL argument");
    if (stale(ld, "ampc_loader_next")) return AMPC_ERR_STATE;
    if (!ld->started) {
        int rc = ampc_loader_start_epoch(ld, 0);
        if (rc < 0) return rc;
    }
    if (ld->failed) return ampc__err(ld->failed, "%s", ld->failed_msg);
    if (ld->cur >= ld->n_batches) return 0;
    ld->failed_msg[0] = 0;   /* a failure below writes it (fail_batch) */
    if (ld->async) return next_async(ld, images, labels);

    const int64_t b = ld->cur;
    int64_t first, rows;
    batch_span(ld, b, &first, &rows);
    const int64_t T = ld->block_size, xs[4] = {rows, ld->oc, ld->oh, ld->ow}, ys[2] = {rows, T};
    ampc_tensor *x = T ? ampc__tensor_new(AMPC_I64, AMPC_DEVICE_CPU, 2, ys) : ampc__tensor_new(AMPC_F32, AMPC_DEVICE_CPU, 4, xs);
    ampc_tensor *y = x ? ampc__tensor_new(AMPC_I64, AMPC_DEVICE_CPU, T ? 2 : 1, ys) : NULL;
    if (!y) {
        ampc__release(x);
        return ampc_last_status();
    }
    int rc = AMPC_OK;
    if (T) {   /* token windows, cut at this epoch's shift */
        int64_t *xd = ampc__data(x), *yd = ampc__data(y);
        for (int64_t k = 0; k < rows && rc >= 0; k++)
            rc = ld->ds->vt->get_window(ld->ds, ld->perm[first + k], ld->shift, xd + k * T, yd + k * T);
    } else if (ld->n_workers == 0) {
        rc = fill_batch(ld, &ld->bufs[0], b, ampc__data(x), ampc__data(y), -1);
    } else {
        slot *s = &ld->slots[b % ld->n_slots];
        pthread_mutex_lock(&ld->mu);
        while (!(s->state == SLOT_READY && s->batch == b)) pthread_cond_wait(&ld->ready, &ld->mu);
        pthread_mutex_unlock(&ld->mu);
        /* READY slots are ours until we free them: copy without the lock. */
        rc = s->status;
        if (rc < 0) {
            memcpy(ld->failed_msg, s->msg, sizeof s->msg);
        } else {
            memcpy(ampc__data(x), s->images, (size_t)(rows * ld->oc * ld->oh * ld->ow) * sizeof(float));
            memcpy(ampc__data(y), s->labels, (size_t)rows * sizeof(int64_t));
        }
        pthread_mutex_lock(&ld->mu);
        s->state = SLOT_FREE;
        pthread_cond_broadcast(&ld->work);
        pthread_mutex_unlock(&ld->mu);
    }
    if (rc >= 0 && ld->o.device != AMPC_DEVICE_CPU) {   /* one copy to the device (REF: its f64 for images) */
        ampc_dtype dt = ampc__device(ld->o.device)->dtypes[x->dtype] ? x->dtype : AMPC_F64;
        ampc_tensor *xd = ampc__tensor_new(dt, ld->o.device, x->ndim, x->shape);
        rc = xd ? ampc__copy(x, xd) : ampc_last_status();
        ampc__release(x);
        x = xd;
    }
    if (rc < 0) {
        ampc__release(x);
        ampc__release(y);
        return fail_batch(ld, rc);
    }
    return hand_out(ld, b, x, y, images, labels);
}
