/*
 * core.h - internal core of ampc: dtype table, storage and caching allocator, tensor struct,
 * scopes, errors and the random generator. Everything above src/core/ includes this.
 */
#ifndef AMPC_CORE_H
#define AMPC_CORE_H

#include "ampc.h"

#include <stdatomic.h>
#include <stdio.h>

// ---------------------------------------------------------------------------------------------
// Errors

/* Records a failure (printf-style message) and returns status, for `return ampc__err(...)`. */
int ampc__err(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Same, for functions that return a pointer. */
void *ampc__err_null(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void ampc__ensure_init(void);
/* need bytes fit in ampc_memory_available (sysmem.c): AMPC_OK, or AMPC_ERR_OOM with "<what> needs
   N of memory, more than the M that <source> allows[: at most K <units> fit]" (unit: bytes each). */
int ampc__memory_fits(uint64_t need, const char *what, uint64_t unit, const char *units);

// ---------------------------------------------------------------------------------------------
// Files from outside (file.c)

struct stat;
/* Opens path read-only (O_CLOEXEC), refusing at once, without blocking, what is not a regular
   file (FIFO, device, directory, socket); symlinks to regular files are followed. Returns the
   descriptor (the caller closes it), or -1 with "<what>: '<path>' is a FIFO ..." recorded.
   st_out (may be NULL) receives the file's stat. */
int ampc__open_regular(const char *path, const char *what, struct stat *st_out);
/* The same as a FILE opened "rb" (the caller fcloses it); NULL on failure. */
FILE *ampc__fopen_regular(const char *path, const char *what, struct stat *st_out);
/* Removes "<path>.tmp.<pid>" files (the temporaries of an atomic replace of path) whose process is
   gone: what a kill during a write leaves. Returns how many were removed. */
int ampc__remove_stale_temps(const char *path);
/* What a st_mode is, for messages: "a directory", "a FIFO (named pipe)", "a character device"... */
const char *ampc__file_type_name(unsigned mode);

// ---------------------------------------------------------------------------------------------
// Dtypes: one table, the only place dtype facts live.

typedef struct {
    const char *name;
    size_t size;
    bool is_float;
    /* n values of this dtype to/from f32 and f64 (round to nearest even when narrowing) */
    void (*to_f32)(const void *src, float *dst, size_t n);
    void (*from_f32)(const float *src, void *dst, size_t n);
    void (*to_f64)(const void *src, double *dst, size_t n);
    void (*from_f64)(const double *src, void *dst, size_t n);
    double unit_roundoff;   /* 2^-24, 2^-11, 2^-8, 2^-53; 0 for integers */
    double max_finite;
} ampc_dtype_traits;

extern const ampc_dtype_traits ampc__dtype_traits[AMPC_DTYPE_COUNT];
static inline const ampc_dtype_traits *ampc__dt(ampc_dtype dt) { return &ampc__dtype_traits[dt]; }
/* Plain C scalar loops (the fallback and the reference for the vectorized ones). */
void ampc__f32_to_f16_c(const float *src, uint16_t *dst, size_t n);
void ampc__f16_to_f32_c(const uint16_t *src, float *dst, size_t n);
void ampc__f32_to_bf16_c(const float *src, uint16_t *dst, size_t n);
void ampc__bf16_to_f32_c(const uint16_t *src, float *dst, size_t n);
void ampc__convert_init(void);   /* picks vectorized conversions from CPU features */

/* Wider of two float dtypes (PyTorch promotion: f16+bf16 -> f32). */
ampc_dtype ampc__promote(ampc_dtype a, ampc_dtype b);

// ---------------------------------------------------------------------------------------------
// Storage and the caching allocator

typedef struct ampc_storage {
    void *data;
    size_t nbytes;          /* bytes requested */
    size_t block_bytes;     /* bytes of the cached block (rounded up) */
    ampc_mem_kind kind;
    ampc_device device;
    atomic_int refcount;
    atomic_uint_fast64_t version;   /* bumped by every write to existing data (PyTorch's
                                       version counter): a copy made at version v is stale
                                       once it moves */
} ampc_storage;

/* Raw blocks (64-byte aligned) counted under kind; NULL + AMPC_ERR_OOM past the limit. */
void *ampc__alloc(ampc_device dev, size_t nbytes, ampc_mem_kind kind, size_t *block_bytes);
void ampc__free(ampc_device dev, void *p, size_t block_bytes, ampc_mem_kind kind);
/* The bytes a request of nbytes occupies (what the stats count for it). */
size_t ampc__mem_block_size(size_t nbytes);
/* Moves an allocation's bytes from one kind's count to another's. */
void ampc__mem_retag(size_t block_bytes, ampc_mem_kind from, ampc_mem_kind to);

ampc_storage *ampc__storage_new(ampc_device dev, size_t nbytes, ampc_mem_kind kind);
void ampc__storage_retain(ampc_storage *s);
void ampc__storage_release(ampc_storage *s);
void ampc__storage_set_kind(ampc_storage *s, ampc_mem_kind kind);

/* Fixed-size header pools (storages, nodes): no malloc once warm. put links the object
   through its first pointer-sized bytes and leaves the rest as it is. */
typedef struct { size_t obj_size; void *free_list; } ampc_pool;
void *ampc__pool_get(ampc_pool *pool);   /* zeroed object */
void ampc__pool_put(ampc_pool *pool, void *p);
void ampc__pool_drain(ampc_pool *pool);

/* Pools of user-visible handles (tensors, modules, optimizers, scalers, datasets, loaders,
   transforms, metrics logs, data-parallel wrappers; handles.c): no address is handed out twice, so a freed handle
   never names a live object, and stays readable (a marker written before put stays, or reads
   as zero once its slab, or its 2 MiB region, is given back). Only the obj_size field is set by the owner. */
typedef struct {
    size_t obj_size;
    size_t slab_bytes;   /* set at the first get */
    void *slab;          /* the slab objects are cut from now */
    size_t next;         /* offset of the next object in it */
} ampc_handle_pool;
/* A zeroed object, at an address never handed out before; NULL + AMPC_ERR_OOM. */
void *ampc__handle_pool_get(ampc_handle_pool *hp);
/* Frees p (from hp's get) for good: its address is never handed out again. */
void ampc__handle_pool_put(ampc_handle_pool *hp, void *p);

// ---------------------------------------------------------------------------------------------
// Handles: every handle type carries a generation, unique and nonzero while the object is
// live, 0 once it is freed (their headers come from handle pools, never reused).

/* A new generation (process-wide counter, never 0). */
uint64_t ampc__new_gen(void);
/* AMPC_OK if handle h (whose generation field holds gen) is live; otherwise the error,
   naming call and what ("tensor", "module", ...): NULL records "<call>: <what> is NULL"
   unless an earlier error is pending (the first error is kept, as ops do); a freed handle
   records AMPC_ERR_STATE "<call>: <what> handle is stale (<why>)". */
int ampc__check_handle(const void *h, uint64_t gen, const char *call, const char *what, const char *why);

/* Kind given to new tensors on this thread (activations unless a module/optimizer says). */
ampc_mem_kind ampc__mem_kind_push(ampc_mem_kind k);   /* returns the previous kind */
void ampc__mem_kind_pop(ampc_mem_kind prev);
ampc_mem_kind ampc__current_mem_kind(void);

// ---------------------------------------------------------------------------------------------
// Tensors

typedef struct ampc_node ampc_node;
typedef struct ampc_scope_rec ampc_scope_rec;

struct ampc_tensor {
    ampc_storage *storage;
    uint64_t gen;             /* generation while live, 0 once released (ampc__check_tensor) */
    /* a module's parameter or buffer: the module is alive while *owner_gen == owner_gen_val
       (modules are pooled, so the pointer stays readable after the module is freed) */
    const uint64_t *owner_gen;
    uint64_t owner_gen_val;
    ampc_dtype dtype;
    ampc_device device;
    int ndim;
    int64_t shape[AMPC_MAX_DIMS];
    int64_t numel;
    ampc_memory_format format;   /* CHANNELS_LAST only for 4-D tensors */
    atomic_int refcount;
    bool requires_grad;
    /* a parameter of a data-parallel model (the dist layer): every rank holds a replica, so
       the GradScaler agrees on its gradient's non-finite check across ranks */
    bool replicated;
    bool user_owned;          /* ampc_tensor_own took it out of its scope: the user holds the
                                 reference that ampc_tensor_free drops */
    ampc_node *grad_fn;       /* owning ref; NULL for leaves */
    ampc_node *grad_acc;      /* weak: the AccumulateGrad node of a leaf, if one exists */
    ampc_tensor *grad;        /* owning ref: accumulated gradient of a leaf */
    /* owning ref: a 16-bit copy of this fp32 leaf made by autocast (no history), equal to the
       data while storage->version == shadow_version; the optimizer's pass refreshes it. Read
       and written under ampc__shadow_lock (threads may share a model). */
    ampc_tensor *shadow;
    uint64_t shadow_version;
    /* scope membership (the scope's reference) */
    ampc_scope_rec *scope;
    ampc_tensor *scope_prev, *scope_next;
};

static inline void *ampc__data(const ampc_tensor *t) { return t->storage ? t->storage->data : NULL; }
/* Marks t's storage as written (every view of it, every copy made from it, is stale). */
static inline void ampc__mark_written(ampc_tensor *t) {
    if (t && t->storage) atomic_fetch_add_explicit(&t->storage->version, 1, memory_order_relaxed);
}
static inline uint64_t ampc__version(const ampc_tensor *t) {
    return atomic_load_explicit(&t->storage->version, memory_order_relaxed);
}
/* Guards every tensor's shadow / shadow_version. */
void ampc__shadow_lock(void);
void ampc__shadow_unlock(void);
/* Whether shadows are kept and refreshed (ampc_autocast_keep_weight_casts; default on). */
bool ampc__shadows_on(void);
void ampc__set_shadows_on(bool on);
static inline size_t ampc__nbytes(const ampc_tensor *t) { return (size_t)t->numel * ampc__dt(t->dtype)->size; }

/* New tensor with refcount 1 owned by the caller (in no scope), storage uninitialised. */
ampc_tensor *ampc__tensor_new(ampc_dtype dt, ampc_device dev, int ndim, const int64_t *shape);
/* New header sharing t's storage with another shape of the same numel (a view). */
ampc_tensor *ampc__tensor_view(ampc_tensor *t, int ndim, const int64_t *shape);
/* New tensor with t's shape, device and memory format, in dtype dt. */
ampc_tensor *ampc__tensor_like(const ampc_tensor *t, ampc_dtype dt);
/* New tensor like ampc__tensor_new, in memory format fmt (CHANNELS_LAST needs 4 dims). */
ampc_tensor *ampc__tensor_new_fmt(ampc_dtype dt, ampc_device dev, int ndim, const int64_t *shape, ampc_memory_format fmt);
static inline bool ampc__is_cl(const ampc_tensor *t) { return t->format == AMPC_CHANNELS_LAST; }
/* AMPC_OK for a live tensor; else the error naming call (see ampc__check_handle). */
static inline int ampc__check_tensor(const ampc_tensor *t, const char *call) {
    if (t && t->gen) return AMPC_OK;
    return ampc__check_handle(t, 0, call, "tensor", "freed, or its scope ended");
}
/* Whether the module t was registered in (if any) is still alive. */
static inline bool ampc__owner_alive(const ampc_tensor *t) { return !t->owner_gen || *t->owner_gen == t->owner_gen_val; }
/* Hands the caller's reference (its scope's, or the user's after ampc_tensor_own) to an
   internal holder (a module): ampc_tensor_free/own on t are errors from here on. Returns t. */
ampc_tensor *ampc__tensor_take(ampc_tensor *t);
ampc_tensor *ampc__retain(ampc_tensor *t);   /* returns t */
void ampc__tensor_zero_grad(ampc_tensor *t);   /* ampc_tensor_zero_grad without the handle check */
void ampc__release(ampc_tensor *t);          /* NULL: no-op */
/* Gives the caller's reference to the current scope; returns t (NULL passes through). An op
   that returns its input (an extra reference to a tensor already held by a scope or the user)
   gets it back as it was: the extra reference is dropped, the tensor keeps its holder. */
ampc_tensor *ampc__scope_adopt(ampc_tensor *t);
int64_t ampc__numel(int ndim, const int64_t *shape);
bool ampc__same_shape(const ampc_tensor *a, const ampc_tensor *b);
/* "(2, 3, 4)" into buf. */
const char *ampc__shape_str(const ampc_tensor *t, char *buf, size_t n);
/* t's values where the CPU can read them: a new reference to t on a host-memory device, else a
   new CPU tensor of its dtype, shape and format (NULL with the error set on failure). */
ampc_tensor *ampc__host_copy(const ampc_tensor *t);
/* Writes n bytes from host memory into t's storage from its start, in storage order (a memcpy on
   a host-memory device, else through a CPU tensor and one transfer). */
int ampc__write_bytes(ampc_tensor *t, const void *bytes, size_t n);
/* Moves t's values to device dev in place (new storage of the same memory kind there; the
   handle stays): what ampc_module_to does to parameters and buffers. Drops t's 16-bit shadow. */
int ampc__tensor_move(ampc_tensor *t, ampc_device dev);
/* Converting copy between any dtypes/devices with the same numel. */
int ampc__copy(const ampc_tensor *src, ampc_tensor *dst);
ampc_device ampc__default_device(void);

// ---------------------------------------------------------------------------------------------
// Name patterns (patterns.c): the comma-separated fnmatch(3) lists that pick classes or modules
// by name ("clutter,*-101"); how a name matches is the caller's.

#define AMPC_MAX_PATTERNS 64
typedef struct {
    int n;
    char *pat[AMPC_MAX_PATTERNS];
} ampc_patterns;
/* Splits text into *p (NULL or "": none). An empty pattern between commas, or more than max
   (<= AMPC_MAX_PATTERNS), is AMPC_ERR_INVALID with a message starting with `who`; *p is then
   empty. Free with ampc__patterns_free. */
int ampc__patterns_parse(ampc_patterns *p, const char *text, int max, const char *who);
void ampc__patterns_free(ampc_patterns *p);

// ---------------------------------------------------------------------------------------------
// Random numbers: Philox4x32-10, counter based, so results don't depend on thread count.

typedef struct { uint64_t seed, offset; } ampc_rng_state;
/* Reserves n 32-bit draws from the global generator: returns (seed, offset) to use them. */
ampc_rng_state ampc__rng_reserve(uint64_t n);
/* The 4 32-bit outputs of block `counter` for key seed. */
void ampc__philox(uint64_t seed, uint64_t counter, uint32_t out[4]);
/* Draw i of a reserved stream, as a uniform float in [0, 1) with 24 random bits. */
float ampc__rng_uniform(ampc_rng_state st, uint64_t i);
uint32_t ampc__rng_u32(ampc_rng_state st, uint64_t i);

// ---------------------------------------------------------------------------------------------
// Threads

/* Number of OpenMP threads worth using for n elements of light work. */
int ampc__threads_for(int64_t n);
/* *slot, a thread-local malloc'd buffer, is freed (and set to NULL) when the calling thread
   exits; call after each (re)allocation. */
void ampc__free_at_thread_exit(void **slot);

// ---------------------------------------------------------------------------------------------
// Hooks: core names no layer above it; those layers register what core must call (init.c).

/* What core needs of a device to hold tensors: its memory and the copy and fill that tensor
   constructors use. The backend layer registers one per device when it starts (before main:
   src/backend/backend.c); a device nobody registered holds nothing. */
typedef struct {
    const char *name;
    bool host_memory;                  /* storage readable by the CPU (true for CPU and REF) */
    bool dtypes[AMPC_DTYPE_COUNT];     /* storage dtypes this device holds */
    void *(*raw_alloc)(size_t nbytes); /* 64-byte aligned */
    void (*raw_free)(void *p);
    /* dst = src converted (same numel; any dtypes the device holds); when src and dst are
       4-D of one shape in different memory formats, the elements are permuted too */
    int (*copy)(const ampc_tensor *src, ampc_tensor *dst);
    int (*fill)(ampc_tensor *t, double value);
    void (*shutdown)(void);            /* ampc_shutdown: release the device's caches (may be NULL) */
    /* Devices whose memory the CPU cannot read (host_memory false) also have these: */
    /* NULL when the device can be used, else why not ("no CUDA GPU found: ..."); may be NULL */
    const char *(*available)(void);
    /* bytes between this device and host memory: src and dst of one dtype, numel and memory
       format, one of them on this device and the other on a host-memory device */
    int (*transfer)(const ampc_tensor *src, ampc_tensor *dst);
    int (*synchronize)(void);          /* waits for the device's queued work (may be NULL) */
    /* Page-locks nbytes of host memory at p for this device's transfers (direct DMA, no
       driver staging), until host_unpin(p); the memory must stay allocated until then. An
       optimisation: false when it could not (the memory stays usable as it was). May be NULL. */
    bool (*host_pin)(void *p, size_t nbytes);
    void (*host_unpin)(void *p);
    /* Uploads that overlap the device's work (the data loader's; NULL where the device has no
       copy queue of its own: transfer serves). upload queues a copy of nbytes from page-locked
       host memory (host_pin) at src into dst (on this device, dense) on the copy queue, after
       the work queued on the device so far (dst's memory may have served it) and alongside what
       is queued later; *fence gets its handle. fence_order makes the device's work queued from
       then on wait for that copy (the host does not wait); fence_done: 1 once the copy finished
       (src may be rewritten), 0 not yet, < 0 an error; fence_free waits for it, then frees it. */
    int (*upload)(ampc_tensor *dst, const void *src, size_t nbytes, void **fence);
    int (*fence_order)(void *fence);
    int (*fence_done)(void *fence);
    void (*fence_free)(void *fence);
} ampc_device_ops;
void ampc__device_register(ampc_device dev, const ampc_device_ops *ops);
/* dev's table (never NULL: an unregistered or out-of-range device gets an empty one). */
const ampc_device_ops *ampc__device(ampc_device dev);
/* The full-precision float dtype of dev: f32, or f64 on a device without f32 (REF, whose
   kernels compute in f64): the dtype of statistics, master weights and gradient buckets. */
static inline ampc_dtype ampc__device_float(ampc_device dev) {
    return ampc__device(dev)->dtypes[AMPC_F32] ? AMPC_F32 : AMPC_F64;
}

/* ampc_shutdown calls the RELEASE hooks first (they drop references: autocast's cast cache),
   then clears scopes, shuts the devices down and empties the allocator's cache, then calls the
   DRAIN hooks (pools of freed objects: autograd's nodes). Registering twice is harmless. */
typedef enum { AMPC_SHUTDOWN_RELEASE = 0, AMPC_SHUTDOWN_DRAIN } ampc_shutdown_phase;
void ampc__on_shutdown(ampc_shutdown_phase phase, void (*fn)(void));

/* How a tensor's grad_fn is released (autograd registers it when it makes its first node, so
   no tensor has a grad_fn before). */
void ampc__set_grad_fn_release(void (*release)(ampc_node *node));
void ampc__grad_fn_release(ampc_node *node);   /* NULL: nothing */

// ---------------------------------------------------------------------------------------------
// Collectives: the one seam between ampc and a communication library (core/comm.c). The dist
// layer registers MPI's (src/dist/mpi.c); a GPU library (NCCL) would register its own table
// the same way, saying by `reads` that it takes device memory. Without a registration every call sees a world of one process: size 1, rank 0,
// reductions and broadcasts leave the buffer as it is.

typedef enum { AMPC_COMM_SUM = 0, AMPC_COMM_MAX } ampc_comm_op;
/* A collective in flight (ampc_comm_ops.iallreduce); owned by the table that made it. */
typedef struct ampc_comm_req ampc_comm_req;
typedef struct {
    const char *name;            /* "mpi" */
    int rank, size;
    /* In place over count elements of host memory (or of a device the table reads): F32, F64
       and I64 with op; BF16 and F16 (SUM only) are added in f32 and rounded once per addition.
       Blocking. */
    int (*allreduce)(void *buf, int64_t count, ampc_dtype dt, ampc_comm_op op);
    /* The same, non-blocking: *req receives the collective, completed by test or wait. buf must
       not be touched until then. Progress happens inside test and wait calls. */
    int (*iallreduce)(void *buf, int64_t count, ampc_dtype dt, ampc_comm_op op, ampc_comm_req **req);
    int (*test)(ampc_comm_req *req, bool *done);   /* *done: complete (req is then freed) */
    int (*wait)(ampc_comm_req *req);               /* completes and frees req */
    int (*broadcast)(void *buf, size_t nbytes, int root);
    int (*barrier)(void);
    /* Whether the buffers may be in dev's memory (NCCL: CUDA's); NULL: host-memory devices only,
       and the callers stage other devices' data through host memory (MPI). */
    bool (*reads)(ampc_device dev);
} ampc_comm_ops;
/* ops NULL: back to one process. The table must outlive its registration. */
void ampc__comm_register(const ampc_comm_ops *ops);
const ampc_comm_ops *ampc__comm(void);   /* never NULL */
/* Whether the registered table reads dev's memory itself (else: stage through host memory). */
bool ampc__comm_reads(ampc_device dev);
/* t's bytes broadcast from rank root into every rank's t, on any device: in place where the
   table reads t's memory, else through a host copy of t. */
int ampc__comm_broadcast_tensor(ampc_tensor *t, int root);

// ---------------------------------------------------------------------------------------------
// Op tracing (trace.c): an observer of every op, forward and backward, with the module path it
// ran under; the numerics doctor and --explain (src/amp/doctor.c) install it. Off, it costs a
// relaxed atomic load per op and per module forward.

#define AMPC_TRACE_MAX 8
typedef struct {
    bool backward;
    const char *name;        /* forward: the op table's name ("conv2d"); backward: the node's ("ConvBackward") */
    int op;                  /* forward: the ampc_op; backward: -1 */
    const char *module;      /* the module path the op ran under ("layer3.1.conv2"; "" outside any) */
    int n_in;
    const ampc_tensor *src[AMPC_TRACE_MAX];   /* forward: the caller's inputs, before autocast (NULL: none) */
    const ampc_tensor *in[AMPC_TRACE_MAX];    /* forward: what the kernel read; backward: in[0] the incoming gradient */
    int n_out;
    const ampc_tensor *out[AMPC_TRACE_MAX];   /* forward: out[0]; backward: each input's gradient (NULL: none) */
    const ampc_tensor *raw[AMPC_TRACE_MAX];   /* backward: out[i] as the op computed it, before the engine cast it
                                                 to the input's dtype (the same tensor when not cast) */
} ampc__trace_event;
typedef void (*ampc__trace_fn)(const ampc__trace_event *e, void *ctx);

/* Installs the observer (NULL: off); one at a time, process-wide. */
void ampc__trace_set(ampc__trace_fn fn, void *ctx);
bool ampc__trace_on(void);
void ampc__trace_emit(const ampc__trace_event *e);
/* Module paths: push a module's own name around its forward (a token to pop with; nothing is
   kept while tracing is off); the current path, and a copy that lives until exit (interned:
   the backward nodes record where they were made). */
/* Module paths are kept while tracing, or while some reader wants them (autocast's fp32
   modules): a count of wanters. */
void ampc__trace_want_paths(bool on);
bool ampc__trace_paths_on(void);
size_t ampc__trace_module_push(const char *name);
void ampc__trace_module_pop(size_t token);
const char *ampc__trace_module_path(void);
const char *ampc__trace_intern(const char *s);

#endif /* AMPC_CORE_H */
