/*
 * tensor.c - tensor headers (pooled), reference counting, scopes, views, converting copies,
 * accessors and random initialisation.
 */
#include "core/core.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Scopes: a thread-local stack; each scope holds one reference to each tensor made in it.

#define MAX_SCOPES 256

struct ampc_scope_rec {
    ampc_tensor *head;
    int depth;
};

static _Thread_local ampc_scope_rec scopes[MAX_SCOPES];
static _Thread_local int scope_top;        /* index of the innermost scope; 0 is the root */
static _Thread_local int scope_overflow;   /* begins past MAX_SCOPES, ignored with their ends */
static _Thread_local ampc_device default_device = AMPC_DEVICE_CPU;

static void scope_link(ampc_scope_rec *s, ampc_tensor *t) {
    t->scope = s;
    t->scope_prev = NULL;
    t->scope_next = s->head;
    if (s->head) s->head->scope_prev = t;
    s->head = t;
}

static void scope_unlink(ampc_tensor *t) {
    ampc_scope_rec *s = t->scope;
    if (!s) return;
    if (t->scope_prev) t->scope_prev->scope_next = t->scope_next;
    else s->head = t->scope_next;
    if (t->scope_next) t->scope_next->scope_prev = t->scope_prev;
    t->scope = NULL;
    t->scope_prev = t->scope_next = NULL;
}

void ampc_scope_begin(void) {
    if (scope_top + 1 >= MAX_SCOPES) {
        scope_overflow++;
        return;
    }
    scope_top++;
    scopes[scope_top].head = NULL;
    scopes[scope_top].depth = scope_top;
}

static void scope_clear(ampc_scope_rec *s) {
    while (s->head) {
        ampc_tensor *t = s->head;
        scope_unlink(t);
        ampc__release(t);
    }
}

void ampc_scope_end(void) {
    if (scope_overflow) {
        scope_overflow--;
        return;
    }
    if (scope_top == 0) return;   /* unbalanced end: the root scope is never closed */
    scope_clear(&scopes[scope_top]);
    scope_top--;
}

int ampc_scope_depth(void) { return scope_top + scope_overflow; }

/* Releases every scope of this thread (ampc_shutdown). */
void ampc__scopes_clear_all(void) {
    while (scope_top > 0) ampc_scope_end();
    scope_clear(&scopes[0]);
}

ampc_tensor *ampc__scope_adopt(ampc_tensor *t) {
    if (!t) return NULL;
    if (t->scope || t->user_owned) {   /* an op returned its input: one list entry per tensor */
        ampc__release(t);
        return t;
    }
    scope_link(&scopes[scope_top], t);
    return t;
}

ampc_tensor *ampc_tensor_keep(ampc_tensor *t) {
    if (ampc__check_tensor(t, "ampc_tensor_keep") < 0) return NULL;   /* NULL: the first error kept */
    if (!t->scope) return t;   /* owned by the user or a module: already outlives the scope */
    int d = t->scope->depth;
    scope_unlink(t);
    scope_link(&scopes[d > 0 ? d - 1 : 0], t);
    return t;
}

/* The message for a live tensor that no scope holds and the user does not own. */
static int not_held(const char *call) {
    return ampc__err(AMPC_ERR_STATE,
                     "%s: the caller holds no reference to this tensor (freed already, its scope ended, or it "
                     "belongs to a module, an optimizer or another tensor as its grad)", call);
}

ampc_tensor *ampc_tensor_own(ampc_tensor *t) {
    if (ampc__check_tensor(t, "ampc_tensor_own") < 0) return NULL;
    if (t->scope) {
        scope_unlink(t);
        t->user_owned = true;
    } else if (!t->user_owned) {
        not_held("ampc_tensor_own");
        return NULL;
    }
    return t;
}

ampc_tensor *ampc__tensor_take(ampc_tensor *t) {
    if (t) {
        scope_unlink(t);
        t->user_owned = false;
    }
    return t;
}

int ampc_tensor_free(ampc_tensor *t) {
    if (!t) return AMPC_OK;
    int rc = ampc__check_tensor(t, "ampc_tensor_free");
    if (rc < 0) return rc;
    if (t->scope) scope_unlink(t);
    else if (t->user_owned) t->user_owned = false;
    else return not_held("ampc_tensor_free");
    ampc__release(t);
    return AMPC_OK;
}

void ampc_set_default_device(ampc_device d) {
    if ((unsigned)d < AMPC_DEVICE_COUNT) default_device = d;
}
ampc_device ampc_default_device(void) { return default_device; }
ampc_device ampc__default_device(void) { return default_device; }

// ---------------------------------------------------------------------------------------------
// Headers and reference counts

/* A freed header is never reused: a stale handle reads as stale for good (ampc.h, "Stale
   handles"). */
static ampc_handle_pool tensor_pool = {.obj_size = sizeof(ampc_tensor)};

/* Back to the pool, marked dead first. */
static void header_free(ampc_tensor *t) {
    t->gen = 0;
    ampc__handle_pool_put(&tensor_pool, t);
}

int64_t ampc__numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    return n;
}

static ampc_tensor *header_new(ampc_dtype dt, ampc_device dev, int ndim, const int64_t *shape) {
    if ((unsigned)dt >= AMPC_DTYPE_COUNT) return ampc__err_null(AMPC_ERR_DTYPE, "unknown dtype %d", (int)dt);
    if ((unsigned)dev >= AMPC_DEVICE_COUNT) return ampc__err_null(AMPC_ERR_INVALID, "unknown device %d", (int)dev);
    if (!ampc__device(dev)->raw_alloc)
        return ampc__err_null(AMPC_ERR_UNSUPPORTED, "device %s has no backend registered (is libampc's backend layer linked?)",
                              ampc_device_name(dev));
    const char *why = ampc__device(dev)->available ? ampc__device(dev)->available() : NULL;
    if (why) return ampc__err_null(AMPC_ERR_UNSUPPORTED, "device %s: %s", ampc_device_name(dev), why);
    if (!ampc__device(dev)->dtypes[dt])
        return ampc__err_null(AMPC_ERR_DTYPE, "device %s does not hold %s tensors",
                              ampc_device_name(dev), ampc_dtype_name(dt));
    if (ndim < 0 || ndim > AMPC_MAX_DIMS)
        return ampc__err_null(AMPC_ERR_SHAPE, "%d dimensions (0..%d allowed)", ndim, AMPC_MAX_DIMS);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return ampc__err_null(AMPC_ERR_SHAPE, "negative size %lld in dim %d", (long long)shape[i], i);
        if (shape[i] && n > INT64_MAX / 16 / shape[i]) return ampc__err_null(AMPC_ERR_SHAPE, "tensor too large");
        n *= shape[i];
    }
    ampc_tensor *t = ampc__handle_pool_get(&tensor_pool);
    if (!t) return NULL;
    t->dtype = dt;
    t->device = dev;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->numel = n;
    atomic_init(&t->refcount, 1);
    t->gen = ampc__new_gen();
    return t;
}

ampc_tensor *ampc__tensor_new(ampc_dtype dt, ampc_device dev, int ndim, const int64_t *shape) {
    ampc__ensure_init();
    ampc_tensor *t = header_new(dt, dev, ndim, shape);
    if (!t) return NULL;
    t->storage = ampc__storage_new(dev, ampc__nbytes(t), ampc__current_mem_kind());
    if (!t->storage) {
        header_free(t);
        return NULL;
    }
    return t;
}

ampc_tensor *ampc__tensor_new_fmt(ampc_dtype dt, ampc_device dev, int ndim, const int64_t *shape, ampc_memory_format fmt) {
    if (fmt != AMPC_CONTIGUOUS_FORMAT && (fmt != AMPC_CHANNELS_LAST || ndim != 4))
        return ampc__err_null(AMPC_ERR_INVALID, "memory format %d for a %d-D tensor (channels-last needs 4-D)", (int)fmt, ndim);
    ampc_tensor *t = ampc__tensor_new(dt, dev, ndim, shape);
    if (t) t->format = fmt;
    return t;
}

ampc_tensor *ampc__tensor_like(const ampc_tensor *t, ampc_dtype dt) {
    return ampc__tensor_new_fmt(dt, t->device, t->ndim, t->shape, t->format);
}

ampc_tensor *ampc__tensor_view(ampc_tensor *t, int ndim, const int64_t *shape) {
    bool same = ndim == t->ndim && !memcmp(shape, t->shape, sizeof(int64_t) * (size_t)ndim);
    /* another shape over channels-last storage would read it in the wrong order */
    if (ampc__is_cl(t) && !same) return ampc__err_null(AMPC_ERR_INVALID, "reshaping view of a channels-last tensor (convert it first)");
    ampc_tensor *v = header_new(t->dtype, t->device, ndim, shape);
    if (!v) return NULL;
    v->format = t->format;
    if (v->numel != t->numel) {
        header_free(v);
        return ampc__err_null(AMPC_ERR_SHAPE, "view of %lld elements from %lld", (long long)v->numel, (long long)t->numel);
    }
    v->storage = t->storage;
    ampc__storage_retain(t->storage);
    return v;
}

ampc_tensor *ampc__retain(ampc_tensor *t) {
    if (t) atomic_fetch_add(&t->refcount, 1);
    return t;
}

void ampc__release(ampc_tensor *t) {
    if (!t || atomic_fetch_sub(&t->refcount, 1) != 1) return;
    ampc__grad_fn_release(t->grad_fn);
    if (t->grad) ampc__release(t->grad);
    if (t->shadow) ampc__release(t->shadow);
    ampc__storage_release(t->storage);
    header_free(t);
}

bool ampc__same_shape(const ampc_tensor *a, const ampc_tensor *b) {
    if (a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return false;
    return true;
}

const char *ampc__shape_str(const ampc_tensor *t, char *buf, size_t n) {
    size_t k = 0;
    k += (size_t)snprintf(buf + k, n - k, "(");
    for (int i = 0; i < t->ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, i ? ", %lld" : "%lld", (long long)t->shape[i]);
    if (k < n) snprintf(buf + k, n - k, "%s)", t->ndim == 1 ? "," : "");
    return buf;
}

// ---------------------------------------------------------------------------------------------
// Creation

#define CHUNK 1024

ampc_tensor *ampc_tensor_empty(ampc_dtype dt, int ndim, const int64_t *shape) {
    return ampc__scope_adopt(ampc__tensor_new(dt, ampc__default_device(), ndim, shape));
}

ampc_tensor *ampc_tensor_full(ampc_dtype dt, int ndim, const int64_t *shape, double value) {
    ampc_tensor *t = ampc__tensor_new(dt, ampc__default_device(), ndim, shape);
    if (!t) return NULL;
    if (ampc__device(t->device)->fill(t, value) < 0) {
        ampc__release(t);
        return NULL;
    }
    return ampc__scope_adopt(t);
}

ampc_tensor *ampc_tensor_zeros(ampc_dtype dt, int ndim, const int64_t *shape) {
    return ampc_tensor_full(dt, ndim, shape, 0.0);
}

static bool on_host(const ampc_tensor *t) { return ampc__device(t->device)->host_memory; }

/* For t on a device the CPU cannot address: a CPU tensor of t's dtype, shape and format to fill
   on the host and then move with finish_staged (one transfer). For a host t: t itself. */
static ampc_tensor *staging_for(ampc_tensor *t) {
    if (on_host(t)) return t;
    return ampc__tensor_new_fmt(t->dtype, AMPC_DEVICE_CPU, t->ndim, t->shape, t->format);
}
/* Moves the staged values into t and frees the staging tensor; rc < 0 passes through. */
static int finish_staged(ampc_tensor *staged, ampc_tensor *t, int rc) {
    if (staged == t) return rc;
    if (rc >= 0) rc = ampc__copy(staged, t);
    ampc__release(staged);
    return rc;
}
/* t's values on the host (a new reference: t itself on a host device, else a CPU copy). */
ampc_tensor *ampc__host_copy(const ampc_tensor *t) {
    if (on_host(t)) return ampc__retain((ampc_tensor *)t);
    ampc_tensor *h = ampc__tensor_new_fmt(t->dtype, AMPC_DEVICE_CPU, t->ndim, t->shape, t->format);
    if (h && ampc__copy(t, h) < 0) {
        ampc__release(h);
        return NULL;
    }
    return h;
}

ampc_tensor *ampc_tensor_from_f32(ampc_dtype dt, int ndim, const int64_t *shape, const float *data) {
    ampc_tensor *t = ampc__tensor_new(dt, ampc__default_device(), ndim, shape);
    if (!t) return NULL;
    if (ampc_tensor_copy_from_f32(t, data, (size_t)t->numel) < 0) {
        ampc__release(t);
        return NULL;
    }
    return ampc__scope_adopt(t);
}

ampc_tensor *ampc_tensor_from_f64(ampc_dtype dt, int ndim, const int64_t *shape, const double *data) {
    ampc_tensor *t = ampc__tensor_new(dt, ampc__default_device(), ndim, shape);
    if (!t) return NULL;
    ampc_tensor *h = staging_for(t);
    if (h) ampc__dt(dt)->from_f64(data, ampc__data(h), (size_t)t->numel);
    if (finish_staged(h, t, h ? AMPC_OK : ampc_last_status()) < 0) {
        ampc__release(t);
        return NULL;
    }
    return ampc__scope_adopt(t);
}

int ampc__write_bytes(ampc_tensor *t, const void *bytes, size_t n) {
    if (!n) return AMPC_OK;
    ampc_tensor *h = staging_for(t);
    if (h) memcpy(ampc__data(h), bytes, n);
    return finish_staged(h, t, h ? AMPC_OK : ampc_last_status());
}

ampc_tensor *ampc_tensor_from_i64(int ndim, const int64_t *shape, const int64_t *data) {
    ampc_tensor *t = ampc__tensor_new(AMPC_I64, ampc__default_device(), ndim, shape);
    if (!t) return NULL;
    if (ampc__write_bytes(t, data, ampc__nbytes(t)) < 0) {
        ampc__release(t);
        return NULL;
    }
    return ampc__scope_adopt(t);
}

/* Fills t with f(i) computed in f64 chunk by chunk (host-memory devices); the draws of value i
   depend only on (st, i), so the threads don't change the numbers. */
static void fill_random(ampc_tensor *t, ampc_rng_state st, int normal, double a, double b) {
    const ampc_dtype_traits *tr = ampc__dt(t->dtype);
    char *dst = ampc__data(t);
    int64_t n = t->numel;
#pragma omp parallel for num_threads(ampc__threads_for(n * 8)) schedule(static)
    for (int64_t base = 0; base < n; base += CHUNK) {
        double buf[CHUNK];
        int64_t m = n - base < CHUNK ? n - base : CHUNK;
        uint32_t blk[4];
        uint64_t blk_id = UINT64_MAX;
        for (int64_t j = 0; j < m; j++) {
            uint64_t i = (uint64_t)(base + j), d = normal ? 2 * i : i;   /* first draw of value i */
            if (d / 4 != blk_id) {   /* one Philox block serves four draws (ampc__rng_u32's order) */
                blk_id = d / 4;
                ampc__philox(st.seed, st.offset + blk_id, blk);
            }
            double u = (double)(blk[d % 4] >> 8) * 0x1p-24;
            if (normal) {   /* Box-Muller on draws 2i and 2i+1 (same block: 2i is even) */
                double u2 = (double)(blk[d % 4 + 1] >> 8) * 0x1p-24;
                buf[j] = a + b * sqrt(-2.0 * log(1.0 - u)) * cos(2.0 * M_PI * u2);
            } else {
                buf[j] = a + (b - a) * u;
            }
        }
        tr->from_f64(buf, dst + (size_t)base * tr->size, (size_t)m);
    }
}

static ampc_tensor *rand_common(ampc_dtype dt, int ndim, const int64_t *shape, int normal, double a, double b) {
    ampc_tensor *t = ampc__tensor_new(dt, ampc__default_device(), ndim, shape);
    if (!t) return NULL;
    if (!ampc__dt(dt)->is_float) {
        ampc__release(t);
        return ampc__err_null(AMPC_ERR_DTYPE, "random values need a float dtype, not %s", ampc_dtype_name(dt));
    }
    ampc_tensor *h = staging_for(t);   /* the same numbers on every device */
    if (h) fill_random(h, ampc__rng_reserve((uint64_t)t->numel * (normal ? 2 : 1)), normal, a, b);
    if (finish_staged(h, t, h ? AMPC_OK : ampc_last_status()) < 0) {
        ampc__release(t);
        return NULL;
    }
    return ampc__scope_adopt(t);
}

ampc_tensor *ampc_tensor_rand(ampc_dtype dt, int ndim, const int64_t *shape, double lo, double hi) {
    return rand_common(dt, ndim, shape, 0, lo, hi);
}
ampc_tensor *ampc_tensor_randn(ampc_dtype dt, int ndim, const int64_t *shape, double mean, double std) {
    return rand_common(dt, ndim, shape, 1, mean, std);
}

// ---------------------------------------------------------------------------------------------
// Copies and accessors

int ampc__copy(const ampc_tensor *src, ampc_tensor *dst) {
    if (src->numel != dst->numel)
        return ampc__err(AMPC_ERR_SHAPE, "copy of %lld elements into %lld", (long long)src->numel, (long long)dst->numel);
    ampc__mark_written(dst);
    if (src->device == dst->device) return ampc__device(src->device)->copy(src, dst);
    if (!on_host(src) || !on_host(dst)) {
        /* one side on a device the CPU cannot address: its transfer moves bytes of one dtype
           and format; conversions happen on a CPU tensor beside it */
        const ampc_tensor *dev_side = on_host(src) ? dst : src;
        const ampc_device_ops *ops = ampc__device(dev_side->device);
        if (!on_host(src) && !on_host(dst))
            return ampc__err(AMPC_ERR_UNSUPPORTED, "copy between %s and %s", ampc_device_name(src->device), ampc_device_name(dst->device));
        if (!ops->transfer) return ampc__err(AMPC_ERR_UNSUPPORTED, "device %s has no transfer", ops->name);
        if (src->dtype == dst->dtype && src->format == dst->format && src->ndim == dst->ndim &&
            (src->device == AMPC_DEVICE_CPU || dst->device == AMPC_DEVICE_CPU))
            return ops->transfer(src, dst);
        int rc;
        ampc_tensor *tmp;
        if (on_host(src)) {   /* converted on the host, then uploaded */
            tmp = ampc__tensor_new_fmt(dst->dtype, AMPC_DEVICE_CPU, dst->ndim, dst->shape, dst->format);
            rc = tmp ? ampc__copy(src, tmp) : ampc_last_status();
            if (rc >= 0) rc = ops->transfer(tmp, dst);
        } else {              /* downloaded as it is, then converted on the host */
            tmp = ampc__tensor_new_fmt(src->dtype, AMPC_DEVICE_CPU, src->ndim, src->shape, src->format);
            rc = tmp ? ops->transfer(src, tmp) : ampc_last_status();
            if (rc >= 0) rc = ampc__copy(tmp, dst);
        }
        ampc__release(tmp);
        return rc;
    }
    if (src->format != dst->format) {   /* across in src's format, then permuted on dst's device */
        ampc_tensor *tmp = ampc__tensor_new_fmt(dst->dtype, dst->device, src->ndim, src->shape, src->format);
        int rc = tmp ? ampc__copy(src, tmp) : ampc_last_status();
        if (rc >= 0) rc = ampc__copy(tmp, dst);
        ampc__release(tmp);
        return rc;
    }
    double buf[CHUNK];
    const ampc_dtype_traits *ts = ampc__dt(src->dtype), *td = ampc__dt(dst->dtype);
    const char *s = ampc__data(src);
    char *d = ampc__data(dst);
    for (int64_t base = 0; base < src->numel; base += CHUNK) {
        size_t m = (size_t)(src->numel - base < CHUNK ? src->numel - base : CHUNK);
        ts->to_f64(s + (size_t)base * ts->size, buf, m);
        td->from_f64(buf, d + (size_t)base * td->size, m);
    }
    return AMPC_OK;
}

int ampc__tensor_move(ampc_tensor *t, ampc_device dev) {
    if (t->device == dev) return AMPC_OK;
    ampc_mem_kind prev = ampc__mem_kind_push(t->storage ? t->storage->kind : ampc__current_mem_kind());
    ampc_tensor *n = ampc__tensor_new_fmt(t->dtype, dev, t->ndim, t->shape, t->format);
    ampc__mem_kind_pop(prev);
    if (!n) return ampc_last_status();
    int rc = ampc__copy(t, n);
    if (rc >= 0) {   /* swap the storages: t gets the new one, n takes the old one away */
        ampc_storage *old = t->storage;
        t->storage = n->storage;
        n->storage = old;
        n->device = t->device;
        t->device = dev;
        ampc__mark_written(t);
        ampc__shadow_lock();
        ampc_tensor *shadow = t->shadow;
        t->shadow = NULL;
        ampc__shadow_unlock();
        ampc__release(shadow);
    }
    ampc__release(n);
    return rc;
}

ampc_tensor *ampc_tensor_to(const ampc_tensor *t, ampc_device dev, ampc_dtype dt) {
    if (ampc__check_tensor(t, "ampc_tensor_to") < 0) return NULL;
    ampc_tensor *o = ampc__tensor_new_fmt(dt, dev, t->ndim, t->shape, t->format);   /* keeps the format, as PyTorch's .to */
    if (!o) return NULL;
    if (ampc__copy(t, o) < 0) {
        ampc__release(o);
        return NULL;
    }
    return ampc__scope_adopt(o);
}

/* A contiguous copy of a channels-last t (same dtype and device), or a new reference to t. */
static ampc_tensor *logical(const ampc_tensor *t) {
    ampc_tensor *c = ampc__tensor_new(t->dtype, t->device, t->ndim, t->shape);
    if (c && ampc__copy(t, c) < 0) {
        ampc__release(c);
        return NULL;
    }
    return c;
}

/* t is live and buf (n values) can hold its elements. */
static int check_buffer(const ampc_tensor *t, const void *buf, size_t n, const char *call) {
    int rc = ampc__check_tensor(t, call);
    if (rc < 0) return rc;
    if (!buf) return ampc__err(AMPC_ERR_INVALID, "%s: buffer is NULL", call);
    if (n < (size_t)t->numel) return ampc__err(AMPC_ERR_INVALID, "%s: buffer of %zu for %lld elements", call, n, (long long)t->numel);
    return AMPC_OK;
}

int ampc_tensor_to_f32(const ampc_tensor *t, float *dst, size_t n) {
    int rc = check_buffer(t, dst, n, "ampc_tensor_to_f32");
    if (rc < 0) return rc;
    if (!on_host(t)) {   /* through a CPU copy */
        ampc_tensor *h = ampc__host_copy(t);
        rc = h ? ampc_tensor_to_f32(h, dst, n) : ampc_last_status();
        ampc__release(h);
        return rc;
    }
    if (ampc__is_cl(t)) {   /* values in the shape's (logical) order */
        ampc_tensor *c = logical(t);
        rc = c ? ampc_tensor_to_f32(c, dst, n) : ampc_last_status();
        ampc__release(c);
        return rc;
    }
    ampc__dt(t->dtype)->to_f32(ampc__data(t), dst, (size_t)t->numel);
    return AMPC_OK;
}

int ampc_tensor_to_f64(const ampc_tensor *t, double *dst, size_t n) {
    int rc = check_buffer(t, dst, n, "ampc_tensor_to_f64");
    if (rc < 0) return rc;
    if (!on_host(t)) {   /* through a CPU copy */
        ampc_tensor *h = ampc__host_copy(t);
        rc = h ? ampc_tensor_to_f64(h, dst, n) : ampc_last_status();
        ampc__release(h);
        return rc;
    }
    if (ampc__is_cl(t)) {
        ampc_tensor *c = logical(t);
        rc = c ? ampc_tensor_to_f64(c, dst, n) : ampc_last_status();
        ampc__release(c);
        return rc;
    }
    ampc__dt(t->dtype)->to_f64(ampc__data(t), dst, (size_t)t->numel);
    return AMPC_OK;
}

int ampc_tensor_copy_from_f32(ampc_tensor *t, const float *src, size_t n) {
    int rc = check_buffer(t, src, n, "ampc_tensor_copy_from_f32");
    if (rc < 0) return rc;
    ampc__mark_written(t);
    if (!on_host(t)) {   /* through a CPU tensor */
        ampc_tensor *h = staging_for(t);
        rc = h ? ampc_tensor_copy_from_f32(h, src, n) : ampc_last_status();
        return finish_staged(h, t, rc);
    }
    if (ampc__is_cl(t)) {   /* src in logical order, permuted into place */
        ampc_tensor *c = ampc__tensor_new(t->dtype, t->device, t->ndim, t->shape);
        rc = c ? ampc_tensor_copy_from_f32(c, src, n) : ampc_last_status();
        if (rc >= 0) rc = ampc__copy(c, t);
        ampc__release(c);
        return rc;
    }
    ampc__dt(t->dtype)->from_f32(src, ampc__data(t), (size_t)t->numel);
    return AMPC_OK;
}

double ampc_tensor_item(const ampc_tensor *t) {
    double v = NAN;
    if (ampc__check_tensor(t, "ampc_tensor_item") < 0) return v;
    if (t->numel != 1) {
        ampc__err(AMPC_ERR_SHAPE, "ampc_tensor_item: item() of a tensor with %lld elements", (long long)t->numel);
        return v;
    }
    ampc_tensor_to_f64(t, &v, 1);
    return v;
}

/* Accessors: a NULL or stale tensor records an error naming the call (ampc__check_tensor) and
   gives the value documented in ampc.h. */
#define CHECKED(call, fail) \
    if (ampc__check_tensor(t, call) < 0) return fail

ampc_dtype ampc_tensor_dtype(const ampc_tensor *t) {
    CHECKED("ampc_tensor_dtype", AMPC_DTYPE_COUNT);
    return t->dtype;
}
ampc_device ampc_tensor_device(const ampc_tensor *t) {
    CHECKED("ampc_tensor_device", AMPC_DEVICE_COUNT);
    return t->device;
}
int ampc_tensor_ndim(const ampc_tensor *t) {
    CHECKED("ampc_tensor_ndim", -1);
    return t->ndim;
}
int64_t ampc_tensor_dim(const ampc_tensor *t, int i) {
    CHECKED("ampc_tensor_dim", -1);
    if (i < 0) i += t->ndim;
    return (i >= 0 && i < t->ndim) ? t->shape[i] : -1;
}
const int64_t *ampc_tensor_shape(const ampc_tensor *t) {
    CHECKED("ampc_tensor_shape", NULL);
    return t->shape;
}
int64_t ampc_tensor_numel(const ampc_tensor *t) {
    CHECKED("ampc_tensor_numel", -1);
    return t->numel;
}
ampc_memory_format ampc_tensor_memory_format(const ampc_tensor *t) {
    CHECKED("ampc_tensor_memory_format", AMPC_CONTIGUOUS_FORMAT);
    return t->format;
}
static pthread_mutex_t shadow_mutex = PTHREAD_MUTEX_INITIALIZER;
void ampc__shadow_lock(void) { pthread_mutex_lock(&shadow_mutex); }
void ampc__shadow_unlock(void) { pthread_mutex_unlock(&shadow_mutex); }

static atomic_bool shadows_on = true;
bool ampc__shadows_on(void) { return atomic_load(&shadows_on); }
void ampc__set_shadows_on(bool on) { atomic_store(&shadows_on, on); }

/* The caller may write through the pointer: copies made from the data so far are stale. */
void *ampc_tensor_data(ampc_tensor *t) {
    CHECKED("ampc_tensor_data", NULL);
    ampc__mark_written(t);
    return ampc__data(t);
}
const void *ampc_tensor_cdata(const ampc_tensor *t) {
    CHECKED("ampc_tensor_cdata", NULL);
    return ampc__data(t);
}

bool ampc_tensor_requires_grad(const ampc_tensor *t) {
    CHECKED("ampc_tensor_requires_grad", false);
    return t->requires_grad;
}
bool ampc_tensor_is_leaf(const ampc_tensor *t) {
    CHECKED("ampc_tensor_is_leaf", false);
    return !t->grad_fn;
}
ampc_tensor *ampc_tensor_grad(const ampc_tensor *t) {
    CHECKED("ampc_tensor_grad", NULL);
    return t->grad;
}
void ampc_tensor_zero_grad(ampc_tensor *t) {
    CHECKED("ampc_tensor_zero_grad", );
    ampc__tensor_zero_grad(t);
}
void ampc__tensor_zero_grad(ampc_tensor *t) {
    if (!t->grad) return;
    ampc__release(t->grad);
    t->grad = NULL;
}
ampc_tensor *ampc_tensor_detach(ampc_tensor *t) {
    CHECKED("ampc_tensor_detach", NULL);
    return ampc__scope_adopt(ampc__tensor_view(t, t->ndim, t->shape));
}
