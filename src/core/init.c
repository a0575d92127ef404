/*
 * init.c - library start-up (CPU features, conversion dispatch), the hooks through which upper
 * layers register what core calls (devices, shutdown, grad_fn release), shutdown, threads.
 */
#include "core/convert.h"

#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static char features[128];

static void do_init(void) {
    __builtin_cpu_init();
    /* __builtin_cpu_supports needs literal strings, hence one line per feature */
    struct { bool has; const char *name; } f[] = {
        {__builtin_cpu_supports("avx512bf16"), "avx512_bf16"}, {__builtin_cpu_supports("avx512bw"), "avx512bw"},
        {__builtin_cpu_supports("avx512f"), "avx512f"},        {__builtin_cpu_supports("f16c"), "f16c"},
        {__builtin_cpu_supports("avx2"), "avx2"},              {__builtin_cpu_supports("fma"), "fma"},
        {__builtin_cpu_supports("amx-bf16"), "amx_bf16"},      {__builtin_cpu_supports("avx512fp16"), "avx512_fp16"},
    };
    size_t k = 0;
    for (size_t i = 0; i < sizeof f / sizeof *f; i++)
        if (f[i].has && k < sizeof features)
            k += (size_t)snprintf(features + k, sizeof features - k, "%s%s", k ? " " : "", f[i].name);
    ampc__convert_init();
}

void ampc__ensure_init(void) { pthread_once(&init_once, do_init); }

int ampc_init(void) {
    ampc__ensure_init();
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Hooks

static const ampc_device_ops *_Atomic devices[AMPC_DEVICE_COUNT];
static void no_free(void *p) { (void)p; }
/* what an unregistered device offers: no dtypes and no memory (tensor constructors check) */
static const ampc_device_ops no_device = {.name = "unregistered", .raw_alloc = NULL, .raw_free = no_free};

void ampc__device_register(ampc_device dev, const ampc_device_ops *ops) {
    if ((unsigned)dev < AMPC_DEVICE_COUNT) atomic_store(&devices[dev], ops);
}

const ampc_device_ops *ampc__device(ampc_device dev) {
    ampc__ensure_init();
    const ampc_device_ops *ops = (unsigned)dev < AMPC_DEVICE_COUNT ? atomic_load(&devices[dev]) : NULL;
    return ops ? ops : &no_device;
}

#define MAX_HOOKS 8
static void (*_Atomic shutdown_hooks[2][MAX_HOOKS])(void);

void ampc__on_shutdown(ampc_shutdown_phase phase, void (*fn)(void)) {
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_HOOKS; i++) {
        void (*h)(void) = atomic_load(&shutdown_hooks[phase][i]);
        if (h == fn) break;
        if (!h) {
            atomic_store(&shutdown_hooks[phase][i], fn);
            break;
        }
    }
    pthread_mutex_unlock(&lock);
}

static void run_hooks(ampc_shutdown_phase phase) {
    for (int i = 0; i < MAX_HOOKS; i++) {
        void (*h)(void) = atomic_load(&shutdown_hooks[phase][i]);
        if (h) h();
    }
}

static void (*_Atomic grad_fn_release)(ampc_node *);

void ampc__set_grad_fn_release(void (*release)(ampc_node *node)) { atomic_store(&grad_fn_release, release); }

void ampc__grad_fn_release(ampc_node *node) {
    void (*release)(ampc_node *) = atomic_load(&grad_fn_release);
    if (node && release) release(node);
}

const char *ampc_device_name(ampc_device d) {
    switch (d) {
    case AMPC_DEVICE_CPU: return "cpu";
    case AMPC_DEVICE_REF: return "ref";
    case AMPC_DEVICE_CUDA: return "cuda";
    default: return "?";
    }
}

ampc_device ampc_device_from_name(const char *name) {
    for (int d = 0; name && d < AMPC_DEVICE_COUNT; d++)
        if (!strcmp(name, ampc_device_name((ampc_device)d))) return (ampc_device)d;
    return AMPC_DEVICE_COUNT;
}

const char *ampc_device_unavailable_reason(ampc_device dev) {
    if ((unsigned)dev >= AMPC_DEVICE_COUNT) return "unknown device";
    const ampc_device_ops *ops = ampc__device(dev);
    const char *why = ops->available ? ops->available() : NULL;
    return why || ops->raw_alloc ? why : "this build of ampc has no backend for it";
}

bool ampc_device_available(ampc_device dev) { return ampc_device_unavailable_reason(dev) == NULL; }

int ampc_device_synchronize(ampc_device dev) {
    const char *why = ampc_device_unavailable_reason(dev);
    if (why) return ampc__err(AMPC_ERR_UNSUPPORTED, "device %s: %s", ampc_device_name(dev), why);
    const ampc_device_ops *ops = ampc__device(dev);
    return ops->synchronize ? ops->synchronize() : AMPC_OK;
}

const char *ampc_cpu_features(void) {
    ampc__ensure_init();
    return features;
}

void ampc__scopes_clear_all(void);

void ampc_shutdown(void) {
    ampc__ensure_init();
    run_hooks(AMPC_SHUTDOWN_RELEASE);
    ampc__scopes_clear_all();
    for (int d = 0; d < AMPC_DEVICE_COUNT; d++)
        if (ampc__device((ampc_device)d)->shutdown) ampc__device((ampc_device)d)->shutdown();
    ampc_memory_empty_cache();
    /* tensor headers stay pooled (still reachable): a handle used after shutdown reads as
       stale instead of reading freed memory */
    run_hooks(AMPC_SHUTDOWN_DRAIN);
}

void ampc_set_num_threads(int n) {
    if (n > 0) omp_set_num_threads(n);
}
int ampc_get_num_threads(void) { return omp_get_max_threads(); }

int ampc__threads_for(int64_t n) {
    /* below ~32K light elements a parallel region costs more than it saves */
    if (n < 32768) return 1;
    int t = omp_get_max_threads();
    int64_t by_size = n / 16384;
    return by_size < t ? (int)by_size : t;
}

// ---------------------------------------------------------------------------------------------
// Thread-local buffers: freed when their thread exits (a pthread key's destructor runs while
// the thread's static TLS is still there). The main thread's stay reachable until exit.

#define TL_SLOTS 8
typedef struct { void **slot[TL_SLOTS]; int n; } tl_registry;

static pthread_key_t tl_key;
static pthread_once_t tl_once = PTHREAD_ONCE_INIT;

static void tl_destroy(void *p) {
    tl_registry *r = p;
    for (int i = 0; i < r->n; i++) {
        free(*r->slot[i]);
        *r->slot[i] = NULL;
    }
    free(r);
}

static void tl_make_key(void) { pthread_key_create(&tl_key, tl_destroy); }

void ampc__free_at_thread_exit(void **slot) {
    pthread_once(&tl_once, tl_make_key);
    tl_registry *r = pthread_getspecific(tl_key);
    if (!r) {
        if (!(r = calloc(1, sizeof *r))) return;   /* no registry: the buffer outlives its thread */
        pthread_setspecific(tl_key, r);
    }
    for (int i = 0; i < r->n; i++)
        if (r->slot[i] == slot) return;
    if (r->n < TL_SLOTS) r->slot[r->n++] = slot;
}
