/*
 * trace.c - the op observer and the module path of the running forward (see core.h).
 *
 * The path is a thread-local string: a module's forward appends ".name" and takes it off again
 * (the token is the length before), so reading it costs nothing and a forward on another
 * thread keeps its own. Interned paths are kept in a small hash set for the life of the process:
 * a model has a few hundred modules, and a node points at its module's path after the forward.
 */
#include "core/core.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define PATH_MAX_LEN 512

static _Atomic(ampc__trace_fn) trace_fn;
static void *_Atomic trace_ctx;
static _Thread_local char path[PATH_MAX_LEN];
static _Thread_local size_t path_len;

void ampc__trace_set(ampc__trace_fn fn, void *ctx) {
    atomic_store(&trace_ctx, ctx);
    atomic_store(&trace_fn, fn);
}

bool ampc__trace_on(void) { return atomic_load_explicit(&trace_fn, memory_order_relaxed) != NULL; }

void ampc__trace_emit(const ampc__trace_event *e) {
    ampc__trace_fn fn = atomic_load(&trace_fn);
    if (fn) fn(e, atomic_load(&trace_ctx));
}

static atomic_int path_wanters;

void ampc__trace_want_paths(bool on) { atomic_fetch_add(&path_wanters, on ? 1 : -1); }

bool ampc__trace_paths_on(void) { return ampc__trace_on() || atomic_load_explicit(&path_wanters, memory_order_relaxed) > 0; }

size_t ampc__trace_module_push(const char *name) {
    if (!ampc__trace_paths_on()) return SIZE_MAX;
    size_t before = path_len, n = name ? strlen(name) : 0;
    if (n == 0) return before;
    size_t need = before + (before > 0) + n;
    if (need >= PATH_MAX_LEN) return before;   /* absurdly deep: the path stops growing */
    if (before > 0) path[path_len++] = '.';
    memcpy(path + path_len, name, n);
    path_len += n;
    path[path_len] = '\0';
    return before;
}

void ampc__trace_module_pop(size_t token) {
    if (token == SIZE_MAX || token > path_len) return;
    path_len = token;
    path[path_len] = '\0';
}

const char *ampc__trace_module_path(void) { return path; }

// ---------------------------------------------------------------------------------------------
// Interned strings: an open-addressing set, grown at half full; never freed (process lifetime)

static pthread_mutex_t intern_lock = PTHREAD_MUTEX_INITIALIZER;
static char **slots;
static size_t cap, used;

static size_t hash(const char *s) {
    size_t h = 1469598103934665603u;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211u;
    return h;
}

const char *ampc__trace_intern(const char *s) {
    if (!s) return "";
    pthread_mutex_lock(&intern_lock);
    const char *r = NULL;
    if (2 * (used + 1) > cap) {   /* grow (and rehash) */
        size_t nc = cap ? 2 * cap : 256;
        char **ns = calloc(nc, sizeof *ns);
        if (ns) {
            for (size_t i = 0; i < cap; i++)
                if (slots[i]) {
                    size_t k = hash(slots[i]) & (nc - 1);
                    while (ns[k]) k = (k + 1) & (nc - 1);
                    ns[k] = slots[i];
                }
            free(slots);
            slots = ns;
            cap = nc;
        }
    }
    if (cap && 2 * (used + 1) <= cap) {
        size_t k = hash(s) & (cap - 1);
        while (slots[k] && strcmp(slots[k], s) != 0) k = (k + 1) & (cap - 1);
        if (!slots[k] && (slots[k] = strdup(s))) used++;
        r = slots[k];
    }
    pthread_mutex_unlock(&intern_lock);
    return r ? r : "?";   /* out of memory: the path is lost, not the op */
}
