/*
 * dnnl_cache.c - oneDNN engine, stream, lock and the primitive cache (see dnnl_cache.h).
 */
#include "backend/cpu/dnnl_cache.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define CACHE_SIZE 512   /* ResNet-50 needs ~250 (conv shapes x 3 passes, reorders, norms) */

static struct {
    pthread_mutex_t lock;
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    dnnl_stream_t streams[AMPC_DNNL_MAX_STREAMS];   /* ampc__dnnl_exec's; [0] is stream */
    dnnl_primitive_attr_t attr;
    ampc_dnnl_entry cache[CACHE_SIZE];
    uint64_t clock;
} D = {.lock = PTHREAD_MUTEX_INITIALIZER};

void ampc__dnnl_lock(void) { pthread_mutex_lock(&D.lock); }
void ampc__dnnl_unlock(void) { pthread_mutex_unlock(&D.lock); }

static int ensure_engine(void) {
    int rc = AMPC_OK;
    if (D.stream) return AMPC_OK;
    if (!D.engine) AMPC_DNNL_TRY(dnnl_engine_create(&D.engine, dnnl_cpu, 0), "engine_create");
    if (!D.attr) {
        AMPC_DNNL_TRY(dnnl_primitive_attr_create(&D.attr), "attr_create");
        AMPC_DNNL_TRY(dnnl_primitive_attr_set_scratchpad_mode(D.attr, dnnl_scratchpad_mode_user), "set_scratchpad_mode");
    }
    AMPC_DNNL_TRY(dnnl_stream_create(&D.stream, D.engine, dnnl_stream_default_flags), "stream_create");
    return AMPC_OK;
fail:
    return rc;
}

dnnl_engine_t ampc__dnnl_engine(void) { return ensure_engine() < 0 ? NULL : D.engine; }
const_dnnl_primitive_attr_t ampc__dnnl_attr(void) { return ensure_engine() < 0 ? NULL : D.attr; }

// ---------------------------------------------------------------------------------------------
// What this CPU runs: oneDNN's effective ISA and whether it has bf16 kernels

const char *ampc__dnnl_isa_name(void) {
    static const struct { dnnl_cpu_isa_t isa; const char *name; } names[] = {   /* widest first */
        {dnnl_cpu_isa_avx512_core_amx, "avx512_core_amx"}, {dnnl_cpu_isa_avx512_core_bf16, "avx512_core_bf16"},
        {dnnl_cpu_isa_avx512_core_vnni, "avx512_core_vnni"}, {dnnl_cpu_isa_avx512_core, "avx512_core"},
        {dnnl_cpu_isa_avx2_vnni, "avx2_vnni"}, {dnnl_cpu_isa_avx2, "avx2"}, {dnnl_cpu_isa_avx, "avx"},
        {dnnl_cpu_isa_sse41, "sse41"},
    };
    dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)   /* ISAs are bit sets: the first subset */
        if (((unsigned)isa & (unsigned)names[i].isa) == (unsigned)names[i].isa) return names[i].name;
    return "no vector ISA";
}

/* Whether oneDNN has an implementation of op on this CPU (a primitive descriptor made and freed). */
static bool implemented(const_dnnl_op_desc_t op) {
    dnnl_primitive_desc_t pd = NULL;
    bool ok = dnnl_primitive_desc_create(&pd, op, NULL, ampc__dnnl_engine(), NULL) == dnnl_success;
    if (pd) dnnl_primitive_desc_destroy(pd);
    return ok;
}

static bool bf16_ok;
static void probe_bf16(void) {
    dnnl_memory_desc_t a, b, c;
    dnnl_dims_t da = {16, 16};
    dnnl_matmul_desc_t op;
    bf16_ok = ampc__dnnl_engine() && dnnl_memory_desc_init_by_tag(&a, 2, da, dnnl_bf16, dnnl_ab) == dnnl_success &&
              dnnl_memory_desc_init_by_tag(&b, 2, da, dnnl_bf16, dnnl_ab) == dnnl_success &&
              dnnl_memory_desc_init_by_tag(&c, 2, da, dnnl_f32, dnnl_ab) == dnnl_success &&
              dnnl_matmul_desc_init(&op, &a, &b, NULL, &c) == dnnl_success && implemented(&op);
}

/* Whether oneDNN has a Winograd f32 convolution on this CPU (AVX-512; not under a lower
   ONEDNN_MAX_CPU_ISA): a small forward descriptor created once. */
static bool wino_ok;
static void probe_wino(void) {
    dnnl_memory_desc_t src, wei, dst;
    dnnl_dims_t ds = {1, 16, 8, 8}, dw = {16, 16, 3, 3}, st = {1, 1}, pad = {1, 1};
    dnnl_convolution_desc_t op;
    wino_ok = ampc__dnnl_engine() && dnnl_memory_desc_init_by_tag(&src, 4, ds, dnnl_f32, dnnl_format_tag_any) == dnnl_success &&
              dnnl_memory_desc_init_by_tag(&wei, 4, dw, dnnl_f32, dnnl_format_tag_any) == dnnl_success &&
              dnnl_memory_desc_init_by_tag(&dst, 4, ds, dnnl_f32, dnnl_format_tag_any) == dnnl_success &&
              dnnl_convolution_forward_desc_init(&op, dnnl_forward_training, dnnl_convolution_winograd, &src, &wei, NULL,
                                                 &dst, st, pad, pad) == dnnl_success &&
              implemented(&op);
}

bool ampc__dnnl_wino(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, probe_wino);
    return wino_ok;
}

bool ampc__dnnl_amx(void) {
    unsigned isa = (unsigned)dnnl_get_effective_cpu_isa(), want = (unsigned)dnnl_cpu_isa_avx512_core_amx;
    return (isa & want) == want;
}

bool ampc__dnnl_bf16_native(void) {
    unsigned isa = (unsigned)dnnl_get_effective_cpu_isa(), want = (unsigned)dnnl_cpu_isa_avx512_core_bf16;
    return ampc__dnnl_bf16_ok() && (isa & want) == want;
}

bool ampc__dnnl_via_f32(ampc_dtype dt) { return dt == AMPC_F16 || (dt == AMPC_BF16 && !ampc__dnnl_bf16_ok()); }
ampc_dtype ampc__dnnl_compute_dt(ampc_dtype dt) { return ampc__dnnl_via_f32(dt) ? AMPC_F32 : dt; }

bool ampc__dnnl_bf16_ok(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, probe_bf16);
    return bf16_ok;
}

int ampc__dnnl_fail(dnnl_status_t st, const char *what) {
    if (st == dnnl_unimplemented)
        return ampc__err(AMPC_ERR_BACKEND,
                         "oneDNN %s: unimplemented: oneDNN has no kernel for it on this CPU (effective ISA %s%s)", what,
                         ampc__dnnl_isa_name(), getenv("ONEDNN_MAX_CPU_ISA") ? ", limited by ONEDNN_MAX_CPU_ISA" : "");
    return ampc__err(AMPC_ERR_BACKEND, "oneDNN %s: %s", what, dnnl_status2str(st));
}

static void entry_destroy(ampc_dnnl_entry *e) {
    for (int i = 0; i < e->n_args; i++)
        if (e->mem[i]) dnnl_memory_destroy(e->mem[i]);
    if (e->scratch) dnnl_memory_destroy(e->scratch);
    if (e->prim) dnnl_primitive_destroy(e->prim);
    if (e->pd) dnnl_primitive_desc_destroy(e->pd);
    memset(e, 0, sizeof *e);
}

int ampc__dnnl_add_arg(ampc_dnnl_entry *e, int arg, const dnnl_memory_desc_t *md) {
    int rc = AMPC_OK;
    if (e->n_args == AMPC_DNNL_MAX_ARGS) return ampc__err(AMPC_ERR_BACKEND, "oneDNN primitive with too many arguments");
    AMPC_DNNL_TRY(dnnl_memory_create(&e->mem[e->n_args], md, D.engine, DNNL_MEMORY_NONE), "memory_create");
    e->arg[e->n_args++] = arg;
    return AMPC_OK;
fail:
    return rc;
}

const dnnl_memory_desc_t *ampc__dnnl_query_md(const ampc_dnnl_entry *e, dnnl_query_t what) {
    return dnnl_primitive_desc_query_md(e->pd, what, 0);
}

static uint64_t hash_key(int family, const unsigned char *k, size_t n) {
    uint64_t h = 1469598103934665603ull ^ (uint64_t)family;
    for (size_t i = 0; i < n; i++) h = (h ^ k[i]) * 1099511628211ull;
    return h;
}

static int entry_build(ampc_dnnl_entry *e, int family, uint64_t hash, const unsigned char *key, ampc_dnnl_build_fn build) {
    int rc;
    e->family = family;
    e->hash = hash;
    memcpy(e->key, key, AMPC_DNNL_KEY_BYTES);
    if ((rc = build(e, key)) < 0) goto fail;
    AMPC_DNNL_TRY(dnnl_primitive_create(&e->prim, e->pd), "primitive_create");
    const dnnl_memory_desc_t *sp = dnnl_primitive_desc_query_md(e->pd, dnnl_query_scratchpad_md, 0);
    e->scratch_bytes = sp ? dnnl_memory_desc_get_size(sp) : 0;
    if (e->scratch_bytes) AMPC_DNNL_TRY(dnnl_memory_create(&e->scratch, sp, D.engine, DNNL_MEMORY_NONE), "memory_create");
    e->used = true;
    return AMPC_OK;
fail:
    entry_destroy(e);
    return rc;
}

ampc_dnnl_entry *ampc__dnnl_get(ampc_dnnl_family family, const void *key, size_t key_len, ampc_dnnl_build_fn build) {
    if (ensure_engine() < 0) return NULL;
    if (key_len > AMPC_DNNL_KEY_BYTES) return ampc__err_null(AMPC_ERR_BACKEND, "oneDNN cache key of %zu bytes", key_len);
    unsigned char k[AMPC_DNNL_KEY_BYTES] = {0};
    memcpy(k, key, key_len);
    uint64_t h = hash_key(family, k, sizeof k);
    ampc_dnnl_entry *victim = &D.cache[0];
    for (int i = 0; i < CACHE_SIZE; i++) {
        ampc_dnnl_entry *e = &D.cache[i];
        if (e->used && e->hash == h && e->family == (int)family && !memcmp(e->key, k, sizeof k)) {
            e->last_use = ++D.clock;
            return e;
        }
        if (!e->used) {
            if (victim->used) victim = e;
        } else if (victim->used && e->last_use < victim->last_use) {
            victim = e;
        }
    }
    if (victim->used) entry_destroy(victim);
    if (entry_build(victim, (int)family, h, k, build) < 0) return NULL;
    victim->last_use = ++D.clock;
    return victim;
}

int ampc__dnnl_reserve_streams(int n) {
    int rc = ensure_engine();
    if (rc < 0) return rc;
    if (n > AMPC_DNNL_MAX_STREAMS) return ampc__err(AMPC_ERR_BACKEND, "oneDNN: %d streams (at most %d)", n, AMPC_DNNL_MAX_STREAMS);
    D.streams[0] = D.stream;
    for (int i = 1; i < n; i++)
        if (!D.streams[i]) AMPC_DNNL_TRY(dnnl_stream_create(&D.streams[i], D.engine, dnnl_stream_default_flags), "stream_create");
    return AMPC_OK;
fail:
    return rc;
}

/* Binds the handles (and the scratchpad, when the entry has one), executes on stream and waits. */
static dnnl_status_t exec_on(ampc_dnnl_entry *e, void *const *handles, void *scratch, dnnl_stream_t stream) {
    dnnl_exec_arg_t args[AMPC_DNNL_MAX_ARGS + 1];
    dnnl_status_t st = dnnl_success;
    for (int i = 0; i < e->n_args && st == dnnl_success; i++) {
        st = dnnl_memory_set_data_handle(e->mem[i], handles[i]);
        args[i] = (dnnl_exec_arg_t){e->arg[i], e->mem[i]};
    }
    int n = e->n_args;
    if (st == dnnl_success && e->scratch_bytes) {
        st = dnnl_memory_set_data_handle(e->scratch, scratch);
        args[n++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, e->scratch};
    }
    if (st == dnnl_success) st = dnnl_primitive_execute(e->prim, stream, n, args);
    return st == dnnl_success ? dnnl_stream_wait(stream) : st;
}

dnnl_status_t ampc__dnnl_exec(ampc_dnnl_entry *e, void *const *handles, void *scratch, int slot) {
    return exec_on(e, handles, scratch, D.streams[slot]);
}

int ampc__dnnl_run(ampc_dnnl_entry *e, void *const *handles) {
    void *scratch = NULL;
    size_t block = 0;
    if (e->scratch_bytes && !(scratch = ampc__alloc(AMPC_DEVICE_CPU, e->scratch_bytes, AMPC_MEM_WORKSPACE, &block)))
        return ampc_last_status();
    dnnl_status_t st = exec_on(e, handles, scratch, D.stream);
    ampc__free(AMPC_DEVICE_CPU, scratch, block, AMPC_MEM_WORKSPACE);
    return st == dnnl_success ? AMPC_OK : ampc__err(AMPC_ERR_BACKEND, "oneDNN execute: %s", dnnl_status2str(st));
}

const char *ampc__dnnl_impl(const ampc_dnnl_entry *e) {
    const char *name = NULL;
    if (!e || dnnl_primitive_desc_query(e->pd, dnnl_query_impl_info_str, 0, &name) != dnnl_success) return "?";
    return name ? name : "?";
}

void ampc__dnnl_shutdown(void) {
    pthread_mutex_lock(&D.lock);
    for (int i = 0; i < CACHE_SIZE; i++)
        if (D.cache[i].used) entry_destroy(&D.cache[i]);
    if (D.attr) dnnl_primitive_attr_destroy(D.attr);
    for (int i = 1; i < AMPC_DNNL_MAX_STREAMS; i++)
        if (D.streams[i]) dnnl_stream_destroy(D.streams[i]);
    memset(D.streams, 0, sizeof D.streams);
    if (D.stream) dnnl_stream_destroy(D.stream);
    if (D.engine) dnnl_engine_destroy(D.engine);
    D.attr = NULL;
    D.stream = NULL;
    D.engine = NULL;
    D.clock = 0;
    pthread_mutex_unlock(&D.lock);
}
