/*
 * dnnl_cache.h - what every oneDNN-backed CPU kernel shares: the engine and stream, one lock,
 * and a cache of primitives keyed by a plain struct (shape, layout, dtype, thread count).
 *
 * Primitive creation costs far more than a small execution, so each kernel builds a key,
 * asks ampc__dnnl_get for the entry (built on a miss by the kernel's build function), and
 * runs it with data handles. Memory objects are created once without data; scratchpads are
 * user-managed and come from the caching allocator, so a steady-state call does no malloc.
 * Callers hold ampc__dnnl_lock() around get and run (the stream and the entries are shared).
 * ampc__dnnl_exec runs entries from the threads of a parallel region (each its own entry,
 * stream and scratchpad), for kernels that split work over threads themselves (conv.c).
 */
#ifndef AMPC_DNNL_CACHE_H
#define AMPC_DNNL_CACHE_H

#include "backend/backend.h"

#include <dnnl.h>
#include <dnnl_debug.h>

#define AMPC_DNNL_KEY_BYTES 256
#define AMPC_DNNL_MAX_ARGS 8
#define AMPC_DNNL_MAX_STREAMS 64

/* One kernel family per primitive kind the cache holds, so keys of two families never meet. */
typedef enum {
    AMPC_DNNL_MATMUL = 1, AMPC_DNNL_REORDER, AMPC_DNNL_CONV_FWD, AMPC_DNNL_CONV_BWD_DATA,
    AMPC_DNNL_CONV_BWD_WEIGHTS, AMPC_DNNL_POOL_FWD, AMPC_DNNL_POOL_BWD, AMPC_DNNL_BNORM_FWD,
    AMPC_DNNL_BNORM_BWD, AMPC_DNNL_LNORM_FWD, AMPC_DNNL_LNORM_BWD, AMPC_DNNL_FAMILY_COUNT
} ampc_dnnl_family;

typedef struct ampc_dnnl_entry {
    int family;
    uint64_t hash;
    unsigned char key[AMPC_DNNL_KEY_BYTES];
    bool used;
    uint64_t last_use;
    dnnl_primitive_desc_t pd;
    dnnl_primitive_t prim;
    int n_args;
    int arg[AMPC_DNNL_MAX_ARGS];              /* DNNL_ARG_SRC, ... in the order of run()'s handles */
    dnnl_memory_t mem[AMPC_DNNL_MAX_ARGS];    /* created without data */
    size_t scratch_bytes;
    dnnl_memory_t scratch;
} ampc_dnnl_entry;

/* Builds e->pd (with ampc__dnnl_attr() as attributes) and declares its arguments with
   ampc__dnnl_add_arg; the cache then creates the primitive. key is the caller's key struct. */
typedef int (*ampc_dnnl_build_fn)(ampc_dnnl_entry *e, const void *key);

void ampc__dnnl_lock(void);
void ampc__dnnl_unlock(void);
/* Engine, created on first use (lock held). NULL + error on failure. */
dnnl_engine_t ampc__dnnl_engine(void);
/* Attributes with a user-managed scratchpad, for building primitive descriptors. Owned by the
   cache (lock held); don't destroy. */
const_dnnl_primitive_attr_t ampc__dnnl_attr(void);
/* The entry for (family, key), built on a miss; key_len <= AMPC_DNNL_KEY_BYTES and the key
   must be zero-initialised before filling (compared bytewise). Lock held. */
ampc_dnnl_entry *ampc__dnnl_get(ampc_dnnl_family family, const void *key, size_t key_len, ampc_dnnl_build_fn build);
/* Declares the next argument of the entry's primitive with descriptor md. */
int ampc__dnnl_add_arg(ampc_dnnl_entry *e, int arg, const dnnl_memory_desc_t *md);
/* Descriptor of argument `what` (dnnl_query_src_md, ...) chosen by the primitive. */
const dnnl_memory_desc_t *ampc__dnnl_query_md(const ampc_dnnl_entry *e, dnnl_query_t what);
/* Executes the entry with one data handle per declared argument (in declaration order) and
   a scratchpad from the allocator; waits for completion. Lock held. */
int ampc__dnnl_run(ampc_dnnl_entry *e, void *const *handles);
/* Makes streams 0..n-1 available to ampc__dnnl_exec (n <= AMPC_DNNL_MAX_STREAMS; lock held). */
int ampc__dnnl_reserve_streams(int n);
/* Executes the entry on stream `slot` with the caller's scratchpad (e->scratch_bytes bytes) and
   waits. For use from the threads of a parallel region, each on its own entry and slot: takes
   no lock, allocates nothing and records no error (returns oneDNN's status). */
dnnl_status_t ampc__dnnl_exec(ampc_dnnl_entry *e, void *const *handles, void *scratch, int slot);
/* gemm.c's cached matmul primitive of d (batch 1; no bias) for dt operands and a dst_dt result,
   one per slot and sized for one thread: for kernels that run small gemms from the threads of a
   parallel region, each thread on its own entries with ampc__dnnl_exec(e, {a, b, c}, scratch,
   slot). Lock held; the caller has set OpenMP's thread count to 1 while getting them. */
ampc_dnnl_entry *ampc__cpu_gemm_entry(const ampc_gemm_desc *d, ampc_dtype dt, ampc_dtype dst_dt, int slot);
/* oneDNN implementation name of the entry ("brg:avx512_core_bf16"). */
const char *ampc__dnnl_impl(const ampc_dnnl_entry *e);
void ampc__dnnl_shutdown(void);

static inline dnnl_data_type_t ampc__dnnl_dt(ampc_dtype dt) {
    return dt == AMPC_BF16 ? dnnl_bf16 : dt == AMPC_F16 ? dnnl_f16 : dnnl_f32;
}

/* Records a failed oneDNN call: "oneDNN <what>: <status>", and for "unimplemented" why (the CPU's
   effective ISA) and what to do. Returns AMPC_ERR_BACKEND. */
int ampc__dnnl_fail(dnnl_status_t st, const char *what);
/* oneDNN's effective ISA ("avx2", "avx512_core_bf16", ...; ONEDNN_MAX_CPU_ISA lowers it). */
const char *ampc__dnnl_isa_name(void);
/* Whether oneDNN runs bf16 matmuls on this CPU (probed once: a small bf16 matmul primitive). */
bool ampc__dnnl_bf16_ok(void);
/* Whether it runs them on bf16 hardware (AVX512-BF16 or AMX); plain AVX-512 emulates bf16 with
   f32 arithmetic, several times slower than f32 itself. */
bool ampc__dnnl_bf16_native(void);
/* oneDNN runs AMX (tile) kernels on this CPU (its effective ISA includes avx512_core_amx). */
bool ampc__dnnl_amx(void);
/* Whether the CPU kernels compute dt (a 16-bit dtype) through f32 copies: f16 always (oneDNN 2.6
   has no f16 kernels on these CPUs), bf16 where oneDNN has no bf16 kernels (AVX2-only CPUs, or
   ONEDNN_MAX_CPU_ISA below AVX-512): widened, computed in f32 and rounded once, like f16. */
bool ampc__dnnl_via_f32(ampc_dtype dt);
/* The dtype oneDNN's primitives run for dt's tensors: f32 for those, else dt. */
ampc_dtype ampc__dnnl_compute_dt(ampc_dtype dt);
/* Whether oneDNN has Winograd f32 convolutions on this CPU (probed once: a small descriptor). */
bool ampc__dnnl_wino(void);

/* for `int rc` + a `fail:` label */
#define AMPC_DNNL_TRY(call, what)                                                                  \
    do {                                                                                           \
        dnnl_status_t st_ = (call);                                                                \
        if (st_ != dnnl_success) {                                                                 \
            rc = ampc__dnnl_fail(st_, what);                                                       \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

#endif /* AMPC_DNNL_CACHE_H */
