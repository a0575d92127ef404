/*
 * autocast.c - the thread-local autocast state, the casts each op's policy asks for (the
 * policies are a column of the op table, AMPC_OP_TABLE in include/ampc.h) and the weight-cast
 * cache.
 */
#include "amp/amp.h"
#include "ops/ops.h"

#include <fnmatch.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Thread-local state

#define MAX_NEST 64
typedef struct { bool enabled; ampc_dtype dtype; } region;

static _Thread_local region stack[MAX_NEST];
static _Thread_local int depth;      /* regions entered (PyTorch's nesting counter) */

typedef struct { ampc_tensor *key, *value; } cache_entry;
static _Thread_local cache_entry *cache;
static _Thread_local int cache_n, cache_cap;

static int apply_policy(ampc_op op, ampc_tensor **in, int n);
static void clear_cache(void);

/* The op layer's autocast hook, and the cast cache's release at shutdown (it holds tensors). */
static void register_hooks(void) {
    ampc__ops_set_autocast_hook(apply_policy);
    ampc__on_shutdown(AMPC_SHUTDOWN_RELEASE, clear_cache);
}

void ampc_autocast_enter(ampc_dtype dtype, bool enabled) {
    static pthread_once_t registered = PTHREAD_ONCE_INIT;
    pthread_once(&registered, register_hooks);
    if (dtype != AMPC_F16 && dtype != AMPC_BF16) {
        ampc__err(AMPC_ERR_DTYPE, "autocast dtype must be f16 or bf16, not %s; autocast disabled in this region",
                  ampc_dtype_name(dtype));
        enabled = false;
        dtype = AMPC_BF16;
    }
    if (depth < MAX_NEST) stack[depth] = (region){enabled, dtype};
    depth++;
}

static void clear_cache(void) {
    for (int i = 0; i < cache_n; i++) {
        ampc__release(cache[i].value);
        ampc__release(cache[i].key);
    }
    cache_n = 0;
}

void ampc_autocast_exit(void) {
    if (depth == 0) {
        ampc__err(AMPC_ERR_STATE, "autocast_exit without a matching autocast_enter");
        return;
    }
    if (--depth == 0) clear_cache();
}

static const region *current(void) {
    if (depth == 0) return NULL;
    return &stack[(depth <= MAX_NEST ? depth : MAX_NEST) - 1];
}

bool ampc_autocast_is_enabled(void) {
    const region *r = current();
    return r && r->enabled;
}

ampc_dtype ampc_autocast_dtype(void) {
    const region *r = current();
    return r ? r->dtype : AMPC_F16;   /* PyTorch's default for CUDA autocast */
}

int ampc_autocast_cache_size(void) { return cache_n; }

// ---------------------------------------------------------------------------------------------
// Casting inputs

static bool eligible(const ampc_tensor *t) {
    return t && ampc__dt(t->dtype)->is_float && t->dtype != AMPC_F64;
}

// Casts kept across regions: x->shadow is a history-free header over the storage of the last
// cast of x; it stands for x while x's storage version is the one it was made (or refreshed
// by the optimizer) at.

void ampc_autocast_keep_weight_casts(bool on) { ampc__set_shadows_on(on); }
bool ampc_autocast_keeps_weight_casts(void) { return ampc__shadows_on(); }

/* x's kept copy in dtype dt as a recorded cast of x, or NULL (none, stale, or off). */
static ampc_tensor *kept_cast(ampc_tensor *x, ampc_dtype dt) {
    if (!ampc__shadows_on()) return NULL;
    ampc_tensor *v = NULL;
    ampc__shadow_lock();
    const ampc_tensor *s = x->shadow;
    if (s && s->dtype == dt && x->shadow_version == ampc__version(x)) v = ampc__tensor_view(x->shadow, s->ndim, s->shape);
    ampc__shadow_unlock();
    return v ? ampc__cast_record_done(x, v) : NULL;
}

/* Keeps y, a fresh cast of x, as x's copy (replacing any other). */
static void keep_cast(ampc_tensor *x, ampc_tensor *y) {
    if (!ampc__shadows_on()) return;
    ampc_tensor *v = ampc__tensor_view(y, y->ndim, y->shape);   /* same storage, no history */
    if (!v) {
        ampc_clear_error();   /* nothing kept: still correct */
        return;
    }
    ampc__shadow_lock();
    ampc_tensor *old = x->shadow;
    x->shadow = v;
    x->shadow_version = ampc__version(x);
    ampc__shadow_unlock();
    ampc__release(old);
}

/* Casts to the lower-precision dtype, through the cache for fp32 leaves that require grad. */
static ampc_tensor *cached_cast(ampc_tensor *x, ampc_dtype dt) {
    bool can_cache = x->dtype == AMPC_F32 && x->requires_grad && !x->grad_fn;
    /* keyed by tensor and target dtype: a bf16 region nested in an f16 one must not get the
       f16 cast of the same weight */
    int slot = -1;
    if (can_cache)
        for (int i = 0; i < cache_n && slot < 0; i++)
            if (cache[i].key == x && cache[i].value->dtype == dt) slot = i;
    /* A cast cached under no-grad has no history: with grad on it is redone, or the weight
       would silently get no gradient (PyTorch issues 65766/112583, fixed there in 2023). A cast
       whose CastBackward already ran (a backward inside the region) is redone too: the engine
       refuses a second pass through a released node, where PyTorch's ToCopyBackward, which
       saves nothing, would run again. */
    if (slot >= 0) {
        const ampc_node *h = cache[slot].value->grad_fn;
        if (h ? !h->released : !ampc__needs_grad(&x, 1)) return ampc__retain(cache[slot].value);
    }
    if (!can_cache) return ampc__cast_record(x, dt);
    ampc_tensor *y = kept_cast(x, dt);
    if (!y) {
        /* cached copies live until the region ends, like weights: their own memory kind */
        ampc_mem_kind prev = ampc__mem_kind_push(AMPC_MEM_CASTS);
        y = ampc__cast_record(x, dt);
        ampc__mem_kind_pop(prev);
        if (!y) return NULL;
        keep_cast(x, y);
    }
    if (slot >= 0) {
        ampc__release(cache[slot].value);
        cache[slot].value = ampc__retain(y);
        return y;
    }
    if (cache_n == cache_cap) {
        int cap = cache_cap ? 2 * cache_cap : 64;
        cache_entry *c = realloc(cache, (size_t)cap * sizeof *c);
        if (!c) return y;   /* no cache entry: still correct, just not shared */
        cache = c;
        cache_cap = cap;
        ampc__free_at_thread_exit((void **)&cache);
    }
    cache[cache_n++] = (cache_entry){ampc__retain(x), ampc__retain(y)};
    return y;
}

static int replace(ampc_tensor **slot, ampc_tensor *with) {
    if (!with) return ampc_last_status();
    ampc__release(*slot);
    *slot = with;
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// fp32 modules: under autocast, ops inside the named modules take fp32 where the table says
// lower precision (Keras' per-layer float32 policy)

#define MAX_FP32_PATTERNS 32
static pthread_mutex_t fp32_lock = PTHREAD_MUTEX_INITIALIZER;
static ampc_patterns fp32;          /* under fp32_lock */
static _Atomic int fp32_n;          /* fp32.n, read without the lock on every op */

int ampc_autocast_fp32_modules(const char *patterns) {
    ampc_patterns next;
    int rc = ampc__patterns_parse(&next, patterns, MAX_FP32_PATTERNS, "autocast_fp32_modules:");
    if (rc < 0) return rc;
    pthread_mutex_lock(&fp32_lock);
    const int old = fp32.n;
    ampc__patterns_free(&fp32);
    fp32 = next;
    atomic_store(&fp32_n, fp32.n);
    if ((old > 0) != (fp32.n > 0)) ampc__trace_want_paths(fp32.n > 0);
    pthread_mutex_unlock(&fp32_lock);
    return AMPC_OK;
}

/* The current module path is one of the fp32 modules or inside one. */
static bool in_fp32_module(void) {
    if (atomic_load_explicit(&fp32_n, memory_order_relaxed) == 0) return false;
    const char *path = ampc__trace_module_path();
    if (!*path) return false;
    bool hit = false;
    pthread_mutex_lock(&fp32_lock);
    for (int i = 0; i < fp32.n && !hit; i++) {
        if (fnmatch(fp32.pat[i], path, 0) == 0) hit = true;
        for (const char *dot = strchr(path, '.'); dot && !hit; dot = strchr(dot + 1, '.')) {   /* an ancestor matches */
            char head[512];
            size_t len = (size_t)(dot - path);
            if (len >= sizeof head) break;
            memcpy(head, path, len);
            head[len] = '\0';
            hit = fnmatch(fp32.pat[i], head, 0) == 0;
        }
    }
    pthread_mutex_unlock(&fp32_lock);
    return hit;
}

ampc_policy ampc__autocast_policy(ampc_op op, ampc_dtype dt) {
    ampc_policy p = ampc_op_policy(op, dt);
    return p == AMPC_POLICY_LOWER && in_fp32_module() ? AMPC_POLICY_FP32 : p;
}

static int apply_policy(ampc_op op, ampc_tensor **in, int n) {
    const region *r = current();
    if (!r || !r->enabled) return AMPC_OK;
    ampc_policy p = ampc__autocast_policy(op, r->dtype);
    int rc = AMPC_OK;
    switch (p) {
    case AMPC_POLICY_LOWER:
        for (int i = 0; i < n && rc >= 0; i++)
            if (eligible(in[i]) && in[i]->dtype != r->dtype) rc = replace(&in[i], cached_cast(in[i], r->dtype));
        break;
    case AMPC_POLICY_FP32:
        for (int i = 0; i < n && rc >= 0; i++)
            if (eligible(in[i]) && in[i]->dtype != AMPC_F32) rc = replace(&in[i], ampc__cast_record(in[i], AMPC_F32));
        break;
    case AMPC_POLICY_PROMOTE: {
        ampc_dtype widest = AMPC_DTYPE_COUNT;
        for (int i = 0; i < n; i++)
            if (eligible(in[i])) widest = widest == AMPC_DTYPE_COUNT ? in[i]->dtype : ampc__promote(widest, in[i]->dtype);
        for (int i = 0; i < n && rc >= 0; i++)
            if (eligible(in[i]) && in[i]->dtype != widest) rc = replace(&in[i], ampc__cast_record(in[i], widest));
        break;
    }
    case AMPC_POLICY_PASSTHROUGH:
        break;
    default:
        rc = ampc__err(AMPC_ERR_STATE, "op %s has no autocast policy", ampc_op_name(op));
    }
    return rc;
}
