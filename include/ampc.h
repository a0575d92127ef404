/*
 * ampc.h - automatic mixed precision (AMP) training in C: the whole public API.
 *
 * A training step reads like the PyTorch loop it replaces:
 *
 *     ampc_module *net = ampc_sequential(3, ampc_linear_new(8, 16, true),
 *                                        ampc_relu_new(), ampc_linear_new(16, 1, true));
 *     ampc_optimizer *opt = ampc_sgd_new(net, &(ampc_sgd_options){.lr = 1e-3});
 *     ampc_scaler_options so = ampc_scaler_defaults();
 *     so.enabled = use_amp;
 *     ampc_scaler *scaler = ampc_scaler_new(&so);
 *     for (int step = 0; step < n; step++) {
 *         ampc_scope_begin();                        // intermediates of this step live here
 *         ampc_autocast_enter(AMPC_F16, use_amp);
 *         ampc_tensor *out  = ampc_module_forward(net, x);
 *         ampc_tensor *loss = ampc_mse_loss(out, y, AMPC_REDUCTION_MEAN);
 *         ampc_autocast_exit();
 *         if (ampc_backward(ampc_scaler_scale(scaler, loss)) < 0) fail(ampc_last_error());
 *         ampc_scaler_step(scaler, opt);
 *         ampc_scaler_update(scaler);
 *         ampc_optimizer_zero_grad(opt);
 *         ampc_scope_end();                          // ...and are released here
 *     }
 *
 * Memory model (who owns what):
 * - Every tensor returned by an ampc function belongs to the innermost open scope of the
 *   calling thread (ampc_scope_begin/ampc_scope_end); outside any scope it belongs to the
 *   thread's root scope, released by ampc_tensor_free or at thread exit/ampc_shutdown.
 *   The user never frees intermediates one by one.
 * - ampc_tensor_keep moves a tensor to the enclosing scope (a function "returning" it);
 *   ampc_tensor_own takes it out of every scope: the caller then frees it with ampc_tensor_free.
 * - The autograd graph holds its own references: tensors saved for backward stay alive
 *   until backward has used them, and are released right after, even if their scope is open.
 * - Parameters belong to their module; optimizer state to its optimizer.
 *
 * Errors: functions that can fail return NULL or a negative ampc_status and leave a message
 * in ampc_last_error() (thread-local). Ops given a NULL input return NULL and keep the first
 * error, so a chain of ops can be checked once at its end. Nothing calls exit() or abort().
 *
 * Stale handles: every handle (tensor, module, optimizer, scaler, dataset, transforms, loader,
 * metrics log, data-parallel wrapper) carries a generation checked by every call that takes it
 * (release builds too, O(1) per call): every ampc_tensor_* accessor, ampc_tensor_free/keep/own,
 * every ampc_module_*, ampc_optimizer_*, ampc_scaler_*, ampc_dataset_*, ampc_transforms_*,
 * ampc_loader_*, ampc_metrics_* and ampc_ddp_* function, ops and checkpoints. A NULL tensor
 * records "<call>: tensor is NULL" (AMPC_ERR_INVALID) unless an earlier error is pending,
 * which is kept, as ops do; a handle that was freed, or whose scope ended, records AMPC_ERR_STATE
 * "<call>: tensor handle is stale (freed, or its scope ended)". Each call documents what it
 * returns then (-1, NULL, AMPC_DTYPE_COUNT, ...). ampc_tensor_free is accepted once per
 * reference the caller holds: freeing a tensor twice, or freeing one that a module, an
 * optimizer or another tensor (as its grad) holds, is an AMPC_ERR_STATE error that changes
 * nothing. The other handle types record "<call>: <what> handle is stale (freed)" the same way
 * and change nothing (a double free included): calls returning a status return AMPC_ERR_STATE,
 * the others what they return for NULL (NULL, 0, a scale of 1, the default options). A dataset
 * is stale once its user freed it, even while a subset or loader still reads it. No address is
 * ever handed out twice, so a freed handle never names a new object, however many were made
 * since: headers come from reserved address space, and the memory of freed ones goes back to
 * the system, page tables included, but not their addresses (about 200 bytes of address space
 * per tensor ever made: some 10^11 tensors fit in a 47-bit address space; past that, making one
 * fails with AMPC_ERR_OOM). So memory stays flat over a long run: what stays is a 4 KiB page
 * table and a memory mapping or two (Linux allows 65530) per 2 MiB stretch of headers that
 * holds a live object (a parameter, say), and per GiB of headers (~5 million tensors) that does.
 * A tensor whose scope ended while autograd still holds it (saved for backward)
 * stays readable until backward releases it; only ampc_tensor_free/keep/own reject it then. An optimizer refuses to step (AMPC_ERR_STATE)
 * once the module its parameters belong to was freed or replaced (ampc_module_replace).
 */
#ifndef AMPC_H
#define AMPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// ---------------------------------------------------------------------------------------------
// Errors

#define AMPC_STATUS_LIST(X)                                                                    \
    X(AMPC_OK, 0, "success")                                                                   \
    X(AMPC_ERR_INVALID, -1, "invalid argument")                                                \
    X(AMPC_ERR_SHAPE, -2, "shape mismatch")                                                    \
    X(AMPC_ERR_DTYPE, -3, "unsupported or mismatched dtype")                                   \
    X(AMPC_ERR_OOM, -4, "out of memory")                                                       \
    X(AMPC_ERR_STATE, -5, "call not valid in the current state")                               \
    X(AMPC_ERR_UNSUPPORTED, -6, "not supported by this backend")                               \
    X(AMPC_ERR_BACKEND, -7, "backend library failure")                                         \
    X(AMPC_ERR_IO, -8, "input/output error")                                                   \
    X(AMPC_ERR_FORMAT, -9, "malformed data")                                                   \
    X(AMPC_ERR_TIMEOUT, -10, "timed out")

typedef enum {
#define AMPC_X_ENUM(name, value, text) name = value,
    AMPC_STATUS_LIST(AMPC_X_ENUM)
#undef AMPC_X_ENUM
} ampc_status;

const char *ampc_strerror(int status);   /* static text for a status code */
const char *ampc_last_error(void);       /* message of the last failure on this thread */
int ampc_last_status(void);              /* status code of the last failure on this thread */
void ampc_clear_error(void);

// ---------------------------------------------------------------------------------------------
// Library, threads, RNG

/* The library's version, "major.minor.patch" (static), as AMPC_VERSION_STRING in <ampc/version.h>
   says at compile time: a program can compare the library it runs with the one it was built for. */
const char *ampc_version(void);
/* Optional: called implicitly by the first ampc call. Picks kernels from CPU features. */
int ampc_init(void);
/* Releases every scope, cached block and backend resource. Safe to call once at exit. */
void ampc_shutdown(void);
void ampc_set_num_threads(int n);        /* OpenMP threads for kernels (and oneDNN) */
int ampc_get_num_threads(void);
const char *ampc_cpu_features(void);     /* e.g. "avx512_bf16 avx512f f16c avx2 amx_bf16" (static) */
void ampc_manual_seed(uint64_t seed);    /* seeds init and dropout; same seed, same numbers */
/* The global generator's state (seed and position), for checkpoints: restoring it replays the
   same random numbers (init, dropout, shuffling) from that point. */
void ampc_rng_get_state(uint64_t *seed, uint64_t *offset);
void ampc_rng_set_state(uint64_t seed, uint64_t offset);

// ---------------------------------------------------------------------------------------------
// Dtypes and devices

typedef enum {
    AMPC_F32 = 0,
    AMPC_F16,
    AMPC_BF16,
    AMPC_F64,   /* reference computations; the REF device's float type */
    AMPC_I64,   /* class labels */
    AMPC_DTYPE_COUNT
} ampc_dtype;

const char *ampc_dtype_name(ampc_dtype dt);   /* "f32", "f16", ... */
size_t ampc_dtype_size(ampc_dtype dt);
bool ampc_dtype_is_float(ampc_dtype dt);

/* Scalar conversions: round to nearest even, subnormals kept, inf/NaN kept, overflow -> inf. */
uint16_t ampc_f32_to_f16(float x);
float ampc_f16_to_f32(uint16_t h);
uint16_t ampc_f32_to_bf16(float x);
float ampc_bf16_to_f32(uint16_t h);
/* Bulk conversions (vectorized, runtime CPU dispatch); same results as the scalar ones. */
void ampc_convert_f32_to_f16(const float *src, uint16_t *dst, size_t n);
void ampc_convert_f16_to_f32(const uint16_t *src, float *dst, size_t n);
void ampc_convert_f32_to_bf16(const float *src, uint16_t *dst, size_t n);
void ampc_convert_bf16_to_f32(const uint16_t *src, float *dst, size_t n);

/* A device is a backend: CPU (oneDNN + vectorized C), REF (plain fp64 C, the test oracle) or
   CUDA (an NVIDIA GPU: cuBLASLt, cuDNN and ampc's kernels; present in builds with AMPC_CUDA and
   usable where a GPU is found). Every op runs on the device of its inputs (all on one device,
   else an error); move tensors with ampc_tensor_to and models with ampc_module_to. */
typedef enum { AMPC_DEVICE_CPU = 0, AMPC_DEVICE_REF, AMPC_DEVICE_CUDA, AMPC_DEVICE_COUNT } ampc_device;
const char *ampc_device_name(ampc_device d);
/* "cpu", "ref", "cuda" -> the device; AMPC_DEVICE_COUNT for anything else */
ampc_device ampc_device_from_name(const char *name);
/* Whether dev can hold tensors in this process: false for CUDA in a build without it or on a
   machine without a usable GPU; then ampc_device_unavailable_reason says why (else NULL). */
bool ampc_device_available(ampc_device dev);
const char *ampc_device_unavailable_reason(ampc_device dev);
/* Waits until every kernel queued on dev has finished (a no-op on host devices); for timing. */
int ampc_device_synchronize(ampc_device dev);
/* TF32 tensor-core arithmetic for fp32 matmuls on CUDA (PyTorch's
   torch.backends.cuda.matmul.allow_tf32): off by default, as PyTorch's matmul. */
void ampc_set_allow_tf32(bool on);
bool ampc_allow_tf32(void);
/* cuDNN convolution algorithms chosen by timing them on the first call of each shape (PyTorch's
   torch.backends.cudnn.benchmark) instead of by cuDNN's heuristics; deterministic algorithms
   only, so a run repeats its own bits. Off unless set here or by $AMPC_CUDNN_BENCHMARK=1: on an
   H100 (2026-11-27) the timed choice made resnet50's amp-fp16 convolutions slower (18.7 ms a step
   against the heuristics' 16.1; bench/RESULTS.md). */
void ampc_set_cudnn_benchmark(bool on);
bool ampc_cudnn_benchmark(void);
/* fp32 (and fp16, computed in fp32) 3x3 stride-1 convolutions on the CPU through oneDNN's
   Winograd F(4x4, 3x3) kernels where the CPU has them (AVX-512) and their workspace stays
   small (input and output channels multiples of 16, at most 128 x 128, no bias): 4x fewer
   multiplications, rounding a few times the direct sum's (test_conv_cl holds them to a bound
   derived from the transforms). On unless set off here or by $AMPC_CONV_WINOGRAD=0 (oneDNN's
   direct kernels, as PyTorch's CPU convolutions). bf16 never takes it. */
void ampc_set_conv_winograd(bool on);
bool ampc_conv_winograd(void);
/* Which of the machine's GPUs the cuda device is (index as CUDA numbers them, after
   CUDA_VISIBLE_DEVICES; 0 by default). Set it before the process's first CUDA tensor or op:
   AMPC_ERR_STATE once another GPU is in use, AMPC_ERR_INVALID for index < 0 (an index past the
   GPUs found is reported when the device starts). Under an MPI launcher each process picks its
   own (ampc-train: --device cuda:N, else its local rank modulo the GPUs). */
int ampc_cuda_set_device(int index);
/* The GPU the cuda device is, or will be at its start. */
int ampc_cuda_device(void);
/* The CUDA GPUs this process sees (0 without a CUDA build, a driver or a GPU). */
int ampc_cuda_device_count(void);
/* Whether dev's matmuls and convolutions run in dt, so autocast to dt works there: on the CPU,
   bf16 needs oneDNN's AVX-512 kernels (not on AVX2-only CPUs, nor under ONEDNN_MAX_CPU_ISA=AVX2);
   fp16 always works (computed in fp32 and rounded once, as tensor cores do). Ops on bf16 tensors
   given by the caller work on every CPU: without oneDNN's bf16 kernels they are computed in fp32
   and rounded once, as fp16's are. */
bool ampc_dtype_supported(ampc_device dev, ampc_dtype dt);
/* Whether dev computes dt on arithmetic of dt's own width (so autocast to dt is faster than fp32
   there): on the CPU, bf16 with AVX512-BF16 or AMX; plain AVX-512 runs bf16 emulated in fp32,
   several times slower than fp32 (supported, not native). */
bool ampc_dtype_native(ampc_device dev, ampc_dtype dt);
void ampc_set_default_device(ampc_device d);  /* thread-local; for new tensors */
ampc_device ampc_default_device(void);

// ---------------------------------------------------------------------------------------------
// Memory

typedef enum {
    AMPC_MEM_PARAMETERS = 0,
    AMPC_MEM_GRADIENTS,
    AMPC_MEM_OPTIMIZER,
    AMPC_MEM_ACTIVATIONS,   /* op outputs, saved tensors, inputs, activation gradients */
    AMPC_MEM_WORKSPACE,     /* kernel scratch */
    AMPC_MEM_CASTS,         /* autocast's 16-bit copies of fp32 weights (the cast cache and
                               the copies kept across regions) */
    AMPC_MEM_KIND_COUNT
} ampc_mem_kind;

typedef struct {
    size_t current[AMPC_MEM_KIND_COUNT];   /* bytes in use, by kind */
    size_t peak[AMPC_MEM_KIND_COUNT];      /* peak of each kind since the last reset */
    size_t current_total, peak_total;      /* all kinds together */
    size_t cached;                         /* freed blocks kept for reuse */
    size_t limit;                          /* 0: none */
    uint64_t n_alloc, n_malloc;            /* allocations served; of them, new system blocks */
} ampc_memory_stats_t;

ampc_memory_stats_t ampc_memory_stats(void);
const char *ampc_mem_kind_name(ampc_mem_kind k);
void ampc_memory_reset_peak(void);
/* Budget in bytes for memory in use (0: none). An allocation past it fails with AMPC_ERR_OOM. */
void ampc_memory_set_limit(size_t bytes);
void ampc_memory_empty_cache(void);   /* returns cached blocks to the system */
/* Bytes this process may still allocate on the host: the least of /proc/meminfo's MemAvailable,
   the room under its cgroup's limits (v2 memory.max, v1 memory.limit_in_bytes, ancestors'
   included) and $AMPC_MEMORY_AVAILABLE ("3G": a limit emulated, for tests); UINT64_MAX when none
   is known. *what (NULL ok) names the least ("MemAvailable (/proc/meminfo)"; static text). */
uint64_t ampc_memory_available(const char **what);

// ---------------------------------------------------------------------------------------------
// Tensors (contiguous, row-major, up to AMPC_MAX_DIMS dimensions; 4-D ones may be channels-last)

#define AMPC_MAX_DIMS 8
typedef struct ampc_tensor ampc_tensor;

/* How a tensor's elements lie in storage (PyTorch's torch.contiguous_format and
   torch.channels_last). The shape is the same either way: a channels-last (N, C, H, W) tensor
   stores element (n, c, h, w) at ((n * H + h) * W + w) * C + c, the layout oneDNN's
   convolutions run in without reordering. Only 4-D tensors can be channels-last. */
typedef enum { AMPC_CONTIGUOUS_FORMAT = 0, AMPC_CHANNELS_LAST = 1 } ampc_memory_format;

/* New tensors belong to the current scope. Shape values must be >= 0. */
ampc_tensor *ampc_tensor_empty(ampc_dtype dt, int ndim, const int64_t *shape);
ampc_tensor *ampc_tensor_zeros(ampc_dtype dt, int ndim, const int64_t *shape);
ampc_tensor *ampc_tensor_full(ampc_dtype dt, int ndim, const int64_t *shape, double value);
/* Copies n = numel values from data, converting from f32 (rounding to nearest even). */
ampc_tensor *ampc_tensor_from_f32(ampc_dtype dt, int ndim, const int64_t *shape, const float *data);
ampc_tensor *ampc_tensor_from_f64(ampc_dtype dt, int ndim, const int64_t *shape, const double *data);
ampc_tensor *ampc_tensor_from_i64(int ndim, const int64_t *shape, const int64_t *data);
/* Uniform [lo, hi) / normal(mean, std) from the global generator. */
ampc_tensor *ampc_tensor_rand(ampc_dtype dt, int ndim, const int64_t *shape, double lo, double hi);
ampc_tensor *ampc_tensor_randn(ampc_dtype dt, int ndim, const int64_t *shape, double mean, double std);

/* Drops the reference the caller holds (its scope's, or its own after ampc_tensor_own) now.
   NULL: no-op, AMPC_OK. AMPC_ERR_STATE, changing nothing, for a stale tensor (freed twice) or
   one the caller holds no reference to (a module's parameter, a grad, one whose scope ended). */
int ampc_tensor_free(ampc_tensor *t);
/* Moves t to the enclosing scope; returns t (one the user or a module owns stays as it is).
   NULL + error for NULL or a stale t. */
ampc_tensor *ampc_tensor_keep(ampc_tensor *t);
/* Takes t out of all scopes: the caller frees it with ampc_tensor_free; returns t. NULL + error
   for NULL, a stale t, or one no scope holds (a module's parameter, a grad). */
ampc_tensor *ampc_tensor_own(ampc_tensor *t);

/* Accessors. A NULL or stale t records an error naming the call (see "Stale handles") and
   returns: dtype AMPC_DTYPE_COUNT, device AMPC_DEVICE_COUNT, ndim/dim/numel -1, shape/data/
   cdata NULL, memory_format AMPC_CONTIGUOUS_FORMAT. dim of a dimension out of range: -1 with
   no error. */
ampc_dtype ampc_tensor_dtype(const ampc_tensor *t);
ampc_device ampc_tensor_device(const ampc_tensor *t);
int ampc_tensor_ndim(const ampc_tensor *t);
int64_t ampc_tensor_dim(const ampc_tensor *t, int i);   /* negative i counts from the end */
const int64_t *ampc_tensor_shape(const ampc_tensor *t);
int64_t ampc_tensor_numel(const ampc_tensor *t);
ampc_memory_format ampc_tensor_memory_format(const ampc_tensor *t);
void *ampc_tensor_data(ampc_tensor *t);                 /* raw storage, in the tensor's dtype (CUDA: a device pointer) */
const void *ampc_tensor_cdata(const ampc_tensor *t);
/* Copy out converting to f32/f64 (n must be >= numel). A negative status on error. */
int ampc_tensor_to_f32(const ampc_tensor *t, float *dst, size_t n);
int ampc_tensor_to_f64(const ampc_tensor *t, double *dst, size_t n);
int ampc_tensor_copy_from_f32(ampc_tensor *t, const float *src, size_t n);   /* in place */
/* dst's values become src's, in place (PyTorch's Tensor.copy_): the same shape; dtypes, devices and
   memory formats converted. Records no autograd history, so a dst that requires grad is refused
   unless under no-grad (a snapshot restored, as load_state_dict does). */
int ampc_tensor_copy_(ampc_tensor *dst, const ampc_tensor *src);
double ampc_tensor_item(const ampc_tensor *t);          /* single-element tensor; NaN on error */
/* Number of NaN/inf values (0 for integer tensors), or a negative status. */
int64_t ampc_tensor_count_nonfinite(const ampc_tensor *t);
/* New tensor (in the current scope) on device/dtype; no autograd history. NULL on error. */
ampc_tensor *ampc_tensor_to(const ampc_tensor *t, ampc_device dev, ampc_dtype dt);

/* Autograd flags. Only leaf tensors (not produced by a recorded op) can change requires_grad.
   A NULL or stale t: requires_grad/is_leaf false, grad/detach/grad_fn_name NULL (with the
   error recorded; a NULL grad or grad_fn_name of a live tensor is no error). */
int ampc_tensor_set_requires_grad(ampc_tensor *t, bool on);
bool ampc_tensor_requires_grad(const ampc_tensor *t);
bool ampc_tensor_is_leaf(const ampc_tensor *t);
ampc_tensor *ampc_tensor_grad(const ampc_tensor *t);     /* accumulated fp32 grad or NULL; owned by t */
void ampc_tensor_zero_grad(ampc_tensor *t);              /* sets the grad to none */
ampc_tensor *ampc_tensor_detach(ampc_tensor *t);         /* shares storage, no history */
const char *ampc_tensor_grad_fn_name(const ampc_tensor *t); /* "LinearBackward", NULL for leaves */

// ---------------------------------------------------------------------------------------------
// Scopes

void ampc_scope_begin(void);
/* Releases every tensor created in the scope (that was not kept or owned). */
void ampc_scope_end(void);
int ampc_scope_depth(void);

// ---------------------------------------------------------------------------------------------
// Autograd

/* Backpropagates from a single-element loss (or with an explicit grad of the same shape),
   accumulating fp32 gradients into leaves that require grad. The graph is freed as it goes:
   a second backward through the same graph is an error. */
int ampc_backward(ampc_tensor *loss);
int ampc_backward_with_grad(ampc_tensor *out, ampc_tensor *grad);
void ampc_no_grad_enter(void);   /* nestable, thread-local: ops record no history */
void ampc_no_grad_exit(void);
bool ampc_grad_enabled(void);

// ---------------------------------------------------------------------------------------------
// Ops: each works in fp32/fp16/bf16 (and f64 on REF), records itself for backward, and obeys
// autocast (see ampc_op_policy). Outputs belong to the current scope.

typedef enum { AMPC_REDUCTION_MEAN = 0, AMPC_REDUCTION_SUM, AMPC_REDUCTION_NONE } ampc_reduction;

/* The same values in memory format fmt (a copy; x itself when it already has it), recorded
   for autograd: the gradient comes back in x's format. Conv nets run fastest channels-last:
   convert the input batch once and conv2d, batch norm, pooling and elementwise ops keep the
   format; ops without channels-last kernels (reshape, linear, losses, ...) convert their
   input back to contiguous themselves, so any op takes either format. */
ampc_tensor *ampc_to_memory_format(ampc_tensor *x, ampc_memory_format fmt);

ampc_tensor *ampc_add(ampc_tensor *a, ampc_tensor *b);   /* broadcasting, numpy rules */
ampc_tensor *ampc_sub(ampc_tensor *a, ampc_tensor *b);
ampc_tensor *ampc_mul(ampc_tensor *a, ampc_tensor *b);
ampc_tensor *ampc_add_scalar(ampc_tensor *a, double s);
ampc_tensor *ampc_mul_scalar(ampc_tensor *a, double s);
ampc_tensor *ampc_relu(ampc_tensor *x);
ampc_tensor *ampc_gelu(ampc_tensor *x);
/* GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): PyTorch's
   F.gelu(x, approximate='tanh'), GPT-2's. */
ampc_tensor *ampc_gelu_tanh(ampc_tensor *x);     /* exact (erf) form, PyTorch's default */
ampc_tensor *ampc_silu(ampc_tensor *x);     /* x * sigmoid(x) (swish) */
ampc_tensor *ampc_tanh(ampc_tensor *x);
ampc_tensor *ampc_sigmoid(ampc_tensor *x);
ampc_tensor *ampc_exp(ampc_tensor *x);
ampc_tensor *ampc_log(ampc_tensor *x);
ampc_tensor *ampc_pow(ampc_tensor *x, double exponent);
/* Sum of all elements (dim == AMPC_ALL_DIMS) or over one dim. */
#define AMPC_ALL_DIMS 127
ampc_tensor *ampc_sum(ampc_tensor *x, int dim, bool keepdim);
ampc_tensor *ampc_mean(ampc_tensor *x, int dim, bool keepdim);
ampc_tensor *ampc_reshape(ampc_tensor *x, int ndim, const int64_t *shape); /* one -1 allowed */
ampc_tensor *ampc_flatten(ampc_tensor *x, int start_dim, int end_dim);
/* x with its dims reordered: dim i of the result is dim dims[i] of x (dims: a permutation of
   0 .. ndim-1, negative counting from the end), as PyTorch's permute, but a new contiguous
   tensor (ampc has no strided views; PyTorch users call .contiguous() after it anyway). */
ampc_tensor *ampc_permute(ampc_tensor *x, const int *dims);
/* ampc_permute swapping two dims (PyTorch's transpose). */
ampc_tensor *ampc_transpose(ampc_tensor *x, int dim0, int dim1);
ampc_tensor *ampc_cast(ampc_tensor *x, ampc_dtype dt);   /* differentiable */
ampc_tensor *ampc_softmax(ampc_tensor *x, int dim);
ampc_tensor *ampc_log_softmax(ampc_tensor *x, int dim);
/* a (..., M, K) @ b (K, N) or batched (..., K, N); 1-d operands as numpy. */
ampc_tensor *ampc_matmul(ampc_tensor *a, ampc_tensor *b);
/* x (..., in) @ w(out, in)^T + b(out); b may be NULL. */
ampc_tensor *ampc_linear(ampc_tensor *x, ampc_tensor *w, ampc_tensor *b);
ampc_tensor *ampc_mse_loss(ampc_tensor *input, ampc_tensor *target, ampc_reduction r);
typedef struct {
    ampc_reduction reduction;   /* default MEAN (over non-ignored targets) */
    double label_smoothing;     /* default 0 */
    int64_t ignore_index;       /* default -100 */
} ampc_cross_entropy_options;
ampc_cross_entropy_options ampc_cross_entropy_defaults(void);
/* logits (N, C), targets int64 (N); opts NULL: defaults. */
ampc_tensor *ampc_cross_entropy(ampc_tensor *logits, ampc_tensor *targets,
                                const ampc_cross_entropy_options *opts);
/* Zeroes each element with probability p and scales the rest by 1/(1-p) when training. */
ampc_tensor *ampc_dropout(ampc_tensor *x, double p, bool training);

/* Convolutional-network ops. Activations are NCHW as the user sees them; the CPU backend runs
   oneDNN in whatever memory layout is fastest and reorders inside the op. */
typedef struct {
    int stride[2], padding[2], dilation[2];   /* (h, w); zeros mean the defaults 1, 0, 1 */
    int groups;                               /* 0 means 1 */
} ampc_conv2d_options;
/* x (N, C, H, W), w (O, C/groups, kh, kw), b (O) or NULL; opts NULL: stride 1, no padding. */
ampc_tensor *ampc_conv2d(ampc_tensor *x, ampc_tensor *w, ampc_tensor *b, const ampc_conv2d_options *opts);
typedef struct {
    int kernel[2], stride[2], padding[2];   /* stride 0: = kernel (PyTorch's default) */
    bool ceil_mode;
    bool exclude_pad;   /* avg pool: divide by the unpadded window (count_include_pad=False) */
} ampc_pool2d_options;
ampc_tensor *ampc_max_pool2d(ampc_tensor *x, const ampc_pool2d_options *opts);
ampc_tensor *ampc_avg_pool2d(ampc_tensor *x, const ampc_pool2d_options *opts);
ampc_tensor *ampc_adaptive_avg_pool2d(ampc_tensor *x, int out_h, int out_w);
/* Batch norm over (N, H, W) per channel of x (N, C, H, W). weight/bias (C) may be NULL.
   running_mean/var (C, fp32, may be NULL when training) are updated in place when training
   (unbiased variance, PyTorch's momentum rule); evaluation normalises with them. Statistics are
   computed in fp32 whatever x's dtype; the output has x's dtype. */
ampc_tensor *ampc_batch_norm2d(ampc_tensor *x, ampc_tensor *weight, ampc_tensor *bias,
                               ampc_tensor *running_mean, ampc_tensor *running_var,
                               bool training, double momentum, double eps);
/* ampc_batch_norm2d with the batch statistics of every process of the job (PyTorch's
   SyncBatchNorm; see ampc/dist.h): in training, the mean and variance are those of all
   processes' batches together (and so are the running statistics' updates), and the backward
   exchanges its per-channel sums likewise, so N processes with batch B normalise as one with
   batch N*B. Every process must call it at the same point of its step. Evaluation, or a job
   of one process: exactly ampc_batch_norm2d. CPU and REF devices. */
ampc_tensor *ampc_sync_batch_norm2d(ampc_tensor *x, ampc_tensor *weight, ampc_tensor *bias,
                                    ampc_tensor *running_mean, ampc_tensor *running_var,
                                    bool training, double momentum, double eps);
/* Normalises over the last norm_ndim dims; weight/bias have those dims' shape or are NULL. */
ampc_tensor *ampc_layer_norm(ampc_tensor *x, int norm_ndim, ampc_tensor *weight, ampc_tensor *bias,
                             double eps);
/* Concatenation along dim; inputs of different float dtypes are promoted to the widest. */
ampc_tensor *ampc_cat(ampc_tensor *const *xs, int n, int dim);
/* x's elements start .. start + length - 1 along dim (PyTorch's narrow, as a new tensor): split a
   fused projection into its parts (GPT's q, k, v) with one call per part; the gradient flows
   back into that block of x's gradient (zeros elsewhere). */
ampc_tensor *ampc_narrow(ampc_tensor *x, int dim, int64_t start, int64_t length);
/* The rows of weight (V, D) that indices (i64, any shape, each in [0, V)) pick: a tensor of
   indices' shape + (D) in weight's dtype (autocast leaves it there, as PyTorch's does). The
   gradient reaches weight only: gy's rows summed into the rows their indices name, in index
   order, the same bits for any thread count (PyTorch's F.embedding without padding_idx). */
ampc_tensor *ampc_embedding(ampc_tensor *indices, ampc_tensor *weight);
/* Attention dropout(softmax(q k^T * scale + attn_mask [causal])) v in one op, PyTorch's
   F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale):
   - q (..., Tq, E), k (..., Tk, E), v (..., Tk, Ev), the leading dims equal; scale 0: 1/sqrt(E);
   - is_causal hides key j > query i (PyTorch's top-left alignment);
   - attn_mask: NULL, or an additive float mask that broadcasts to the scores (..., Tq, Tk)
     (e.g. (Tq, Tk), or (B, 1, 1, Tk) for padding): -inf hides a key; it may be given with
     is_causal; it gets a gradient when it requires one (a learned bias);
   - dropout_p in [0, 1]: each probability dropped with that chance and the rest scaled by
     1 / (1 - p), the draws taken from ampc's rng stream (ampc_manual_seed); pass it only in
     training, as nanoGPT does (the op has no training flag).
   A query row whose keys are all hidden or -inf gives 0. Computed row by row with an online
   softmax in f32 (f64 on REF): neither pass keeps a Tq x Tk matrix; the node saves q, k, v, each
   row's log-sum-exp and the mask, and the backward recomputes the probabilities and redraws the
   dropout (flash attention's scheme). On CPUs with bf16 units, bf16 attention multiplies on them
   (oneDNN's bf16 matmuls) with each block's probabilities rounded to bf16 for P v. Autocast: lower precision, as PyTorch's CUDA
   list (the mask too). */
ampc_tensor *ampc_scaled_dot_product_attention(ampc_tensor *q, ampc_tensor *k, ampc_tensor *v, ampc_tensor *attn_mask,
                                               double dropout_p, bool is_causal, double scale);

// ---------------------------------------------------------------------------------------------
// Autocast: thread-local, nestable. enabled=false makes a region run in fp32.

typedef enum {
    AMPC_POLICY_UNSET = 0,   /* never in the table: a test checks every op has a policy */
    AMPC_POLICY_LOWER,       /* cast floating inputs to the autocast dtype (matmul, linear) */
    AMPC_POLICY_FP32,        /* cast floating inputs to fp32 (softmax, sum, losses, ...) */
    AMPC_POLICY_PROMOTE,     /* cast all floating inputs to the widest among them */
    AMPC_POLICY_PASSTHROUGH, /* run in the inputs' dtype (elementwise, shape ops) */
} ampc_policy;

/* What an op's backward reads of its values (shapes and dtypes are always kept). */
typedef enum {
    AMPC_READS_NONE = 0,   /* nothing: the gradient is linear in gy (add, sum, cast) */
    AMPC_READS_X,          /* its inputs (gelu, log, mul, matmul, conv, losses, norms) */
    AMPC_READS_Y,          /* its output (relu, tanh, sigmoid, exp, softmax) */
} ampc_backward_reads;

/* The op table: one row per op holding every fact about it, read by the op front door, by
   autocast, by the kernels and by the profiler (src/ops/op_table.c expands it). A new op is
   one row here plus its own code.
     OP(ID, name, autocast policy under f16, under bf16,
       channels-last inputs: bit i set when input i may stay channels-last on a backend with
         channels-last kernels (the others are converted to contiguous first),
       what its backward reads: the op saves exactly that and its backward kernel reads it,
       the name of its backward node, its grad_fn: PyTorch's without the trailing 0,
       its kernels: UNARY (the backends' unary and unary_backward kernels, with alpha), BINARY
         (their broadcasting binary kernel) or OWN (kernels of its own)) */
#define AMPC_OP_TABLE(OP)                                                                                                 \
    OP(CAST, "cast", PASSTHROUGH, PASSTHROUGH, 0x1, NONE, "CastBackward", OWN)                                            \
    OP(ADD, "add", PASSTHROUGH, PASSTHROUGH, 0x3, NONE, "AddBackward", BINARY)                                            \
    OP(SUB, "sub", PASSTHROUGH, PASSTHROUGH, 0x3, NONE, "SubBackward", BINARY)                                            \
    OP(MUL, "mul", PASSTHROUGH, PASSTHROUGH, 0x3, X, "MulBackward", BINARY)                                               \
    OP(ADD_SCALAR, "add_scalar", PASSTHROUGH, PASSTHROUGH, 0x1, NONE, "AddBackward", UNARY)                               \
    OP(MUL_SCALAR, "mul_scalar", PASSTHROUGH, PASSTHROUGH, 0x1, NONE, "MulBackward", UNARY)                               \
    OP(RELU, "relu", PASSTHROUGH, PASSTHROUGH, 0x1, Y, "ReluBackward", UNARY)                                             \
    OP(GELU, "gelu", PASSTHROUGH, PASSTHROUGH, 0x1, X, "GeluBackward", UNARY)                                             \
    OP(TANH, "tanh", PASSTHROUGH, PASSTHROUGH, 0x1, Y, "TanhBackward", UNARY)                                             \
    OP(SIGMOID, "sigmoid", PASSTHROUGH, PASSTHROUGH, 0x1, Y, "SigmoidBackward", UNARY)                                    \
    OP(EXP, "exp", FP32, FP32, 0x1, Y, "ExpBackward", UNARY)                                                              \
    OP(LOG, "log", FP32, FP32, 0x1, X, "LogBackward", UNARY)                                                              \
    OP(POW, "pow", FP32, FP32, 0x1, X, "PowBackward", UNARY)                                                              \
    OP(SUM, "sum", FP32, FP32, 0x0, NONE, "SumBackward", OWN)                                                             \
    OP(MEAN, "mean", PASSTHROUGH, PASSTHROUGH, 0x0, NONE, "MeanBackward", OWN)                                            \
    OP(RESHAPE, "reshape", PASSTHROUGH, PASSTHROUGH, 0x0, NONE, "ReshapeBackward", OWN)                                   \
    OP(SOFTMAX, "softmax", FP32, FP32, 0x0, Y, "SoftmaxBackward", OWN)                                                    \
    OP(LOG_SOFTMAX, "log_softmax", FP32, FP32, 0x0, Y, "LogSoftmaxBackward", OWN)                                         \
    OP(MATMUL, "matmul", LOWER, LOWER, 0x0, X, "MatmulBackward", OWN)                                                     \
    OP(LINEAR, "linear", LOWER, LOWER, 0x0, X, "LinearBackward", OWN)                                                     \
    OP(MSE_LOSS, "mse_loss", FP32, FP32, 0x0, X, "MseLossBackward", OWN)                                                  \
    OP(CROSS_ENTROPY, "cross_entropy", FP32, FP32, 0x0, X, "CrossEntropyBackward", OWN)                                   \
    OP(DROPOUT, "dropout", PASSTHROUGH, PASSTHROUGH, 0x1, NONE, "DropoutBackward", OWN)                                   \
    OP(CONV2D, "conv2d", LOWER, LOWER, 0x1, X, "ConvolutionBackward", OWN)                                                \
    OP(MAX_POOL2D, "max_pool2d", PASSTHROUGH, PASSTHROUGH, 0x1, NONE, "MaxPool2DWithIndicesBackward", OWN)                \
    OP(AVG_POOL2D, "avg_pool2d", PASSTHROUGH, PASSTHROUGH, 0x1, NONE, "AvgPool2DBackward", OWN)                           \
    OP(ADAPTIVE_AVG_POOL2D, "adaptive_avg_pool2d", PASSTHROUGH, PASSTHROUGH, 0x1, NONE, "AdaptiveAvgPool2DBackward", OWN) \
    OP(BATCH_NORM, "batch_norm", PASSTHROUGH, PASSTHROUGH, 0x1, X, "NativeBatchNormBackward", OWN)                        \
    OP(LAYER_NORM, "layer_norm", FP32, FP32, 0x0, X, "NativeLayerNormBackward", OWN)                                      \
    OP(CAT, "cat", PROMOTE, PROMOTE, 0x0, NONE, "CatBackward", OWN)                                                       \
    OP(SILU, "silu", PASSTHROUGH, PASSTHROUGH, 0x1, X, "SiluBackward", UNARY)                                             \
    OP(EMBEDDING, "embedding", PASSTHROUGH, PASSTHROUGH, 0x0, NONE, "EmbeddingBackward", OWN)                             \
    OP(GELU_TANH, "gelu_tanh", PASSTHROUGH, PASSTHROUGH, 0x1, X, "GeluBackward", UNARY)                                   \
    OP(PERMUTE, "permute", PASSTHROUGH, PASSTHROUGH, 0x0, NONE, "PermuteBackward", OWN)                                   \
    OP(SDPA, "scaled_dot_product_attention", LOWER, LOWER, 0x0, X, "ScaledDotProductAttentionBackward", OWN)              \
    OP(NARROW, "narrow", PASSTHROUGH, PASSTHROUGH, 0x0, NONE, "SliceBackward", OWN)
/* Policies follow PyTorch's CUDA autocast lists (aten/src/ATen/autocast_mode.cpp) for the ops
   ampc has, for fp16 and bf16 alike: matmul-like ops run in the lower precision; reductions
   PyTorch lists as fp32 (sum, softmax, log_softmax, exp, log, pow), layer_norm and every loss
   in fp32; ops PyTorch lists nowhere (elementwise, mean, reshape, dropout, pooling) run in the
   inputs' dtype, with ordinary type promotion for binary ops. batch_norm is in no list either:
   it runs on the 16-bit input with fp32 weights and fp32 statistics. max_pool2d saves its
   argmax and dropout its mask, not values (NONE). embedding is in no list: it runs in its
   weight's dtype and saves its indices (NONE). */

typedef enum {
#define AMPC_OP_ENUM_(id, name, f16, bf16, channels_last, reads, grad_fn, kind) AMPC_OP_##id,
    AMPC_OP_TABLE(AMPC_OP_ENUM_)
#undef AMPC_OP_ENUM_
    AMPC_OP_COUNT
} ampc_op;

ampc_policy ampc_op_policy(ampc_op op, ampc_dtype autocast_dtype);
const char *ampc_policy_name(ampc_policy p);
/* The table's columns (inline: every layer reads the one table, the kernels below the op
   layer too): the op's name ("linear"; "?" out of range), the inputs that may stay
   channels-last (bit i: input i), and what its backward reads. */
static inline const char *ampc_op_name(ampc_op op) {
    switch (op) {
#define AMPC_OP_NAME_(id, name, f16, bf16, channels_last, reads, grad_fn, kind) case AMPC_OP_##id: return name;
        AMPC_OP_TABLE(AMPC_OP_NAME_)
#undef AMPC_OP_NAME_
    default: return "?";
    }
}
/* The name of the op's backward node (its grad_fn): "ConvolutionBackward". */
static inline const char *ampc_op_grad_fn(ampc_op op) {
    switch (op) {
#define AMPC_OP_GRAD_FN_(id, name, f16, bf16, channels_last, reads, grad_fn, kind) case AMPC_OP_##id: return grad_fn;
        AMPC_OP_TABLE(AMPC_OP_GRAD_FN_)
#undef AMPC_OP_GRAD_FN_
    default: return "?";
    }
}
static inline unsigned ampc_op_channels_last_inputs(ampc_op op) {
    switch (op) {
#define AMPC_OP_CL_(id, name, f16, bf16, channels_last, reads, grad_fn, kind) case AMPC_OP_##id: return channels_last;
        AMPC_OP_TABLE(AMPC_OP_CL_)
#undef AMPC_OP_CL_
    default: return 0;
    }
}
/* Which kernels an op runs on (the op table's kind column). */
typedef enum { AMPC_KIND_UNARY = 0, AMPC_KIND_BINARY, AMPC_KIND_OWN } ampc_op_kind;
static inline ampc_op_kind ampc_op_kind_of(ampc_op op) {
    switch (op) {
#define AMPC_OP_KIND_(id, name, f16, bf16, channels_last, reads, grad_fn, kind) case AMPC_OP_##id: return AMPC_KIND_##kind;
        AMPC_OP_TABLE(AMPC_OP_KIND_)
#undef AMPC_OP_KIND_
    default: return AMPC_KIND_OWN;
    }
}
static inline ampc_backward_reads ampc_op_backward_reads(ampc_op op) {
    switch (op) {
#define AMPC_OP_READS_(id, name, f16, bf16, channels_last, reads, grad_fn, kind) case AMPC_OP_##id: return AMPC_READS_##reads;
        AMPC_OP_TABLE(AMPC_OP_READS_)
#undef AMPC_OP_READS_
    default: return AMPC_READS_NONE;
    }
}

void ampc_autocast_enter(ampc_dtype dtype, bool enabled);  /* AMPC_F16 or AMPC_BF16 */
void ampc_autocast_exit(void);  /* leaving the outermost region clears the weight-cast cache */
bool ampc_autocast_is_enabled(void);
ampc_dtype ampc_autocast_dtype(void);
int ampc_autocast_cache_size(void);   /* weight casts cached in this thread */
/* Weight casts kept across regions (default on). The 16-bit copy autocast makes of an fp32
   leaf that requires grad stays with the tensor after the region; the next region uses it as
   long as nothing wrote the tensor since, and the optimizer's step rewrites it in its own pass
   over the parameter, so a training step casts no weight (PyTorch recasts every weight in
   every region). Writes are seen through every ampc write path (ops, optimizers, checkpoint
   loads, ampc_tensor_copy_from_f32, ampc_tensor_data: writing through a pointer it returned
   earlier, after autocast has used the tensor, needs a new ampc_tensor_data call). The kept
   copies count as AMPC_MEM_CASTS and go with their tensor; off: copies live only within a
   region, as in PyTorch. Process-wide. */
void ampc_autocast_keep_weight_casts(bool on);
/* Per-module precision (Keras' per-layer float32 policy): under autocast, ops inside the
   modules whose path matches one of these comma-separated fnmatch(3) patterns ("layer4.*",
   "fc2", "layer4" and all inside it) run in fp32 where the op table says lower precision (their
   16-bit inputs cast up). NULL or "": none. Process-wide; the module paths it needs cost a
   string append per module forward while set. */
int ampc_autocast_fp32_modules(const char *patterns);
bool ampc_autocast_keeps_weight_casts(void);

// ---------------------------------------------------------------------------------------------
// The numerics doctor (src/amp/doctor.c): what each op did to precision. Both tools watch every
// op, forward and backward, with the module path it ran under ("layer3.1.conv2"); off, they
// cost nothing measurable.

/* Explain: every op that runs between begin and end (one training step, say). */
typedef struct {
    bool backward;
    const char *module;        /* "conv1", "layer1.0.conv2" ("" outside any module); valid until exit */
    const char *op;            /* forward: the op table's name ("conv2d"); backward: the node's ("ConvBackward") */
    ampc_policy policy;        /* forward under autocast: the op table's for the autocast dtype; else UNSET */
    int n_in;                  /* forward: the op's tensor inputs; backward: 1 (the incoming gradient) */
    ampc_dtype in_dtype[8];    /* forward: the caller's dtypes (AMPC_DTYPE_COUNT: input absent); backward: the incoming gradient's */
    ampc_dtype run_dtype[8];   /* forward: what the kernel read, after autocast's casts; backward: as in_dtype */
    ampc_dtype out_dtype;      /* forward: the output's; backward: the first input gradient's (AMPC_DTYPE_COUNT: none) */
    int64_t cast_bytes;        /* bytes autocast wrote for this op's inputs (0 for a copy already made: a
                                  weight cast reused within the region, or one kept across steps) */
} ampc_explain_row;
/* Starts recording (AMPC_ERR_STATE if already recording). */
int ampc_explain_begin(void);
/* Stops; *rows receives the rows in the order the ops ran (malloc'd: free() it). Returns the
   count or a negative status. */
int ampc_explain_end(ampc_explain_row **rows);

/* Doctor: the first op of a step whose output went non-finite, and why. */
typedef enum {
    AMPC_DOCTOR_CLEAN,          /* every output finite */
    AMPC_DOCTOR_SCALE_INDUCED,  /* a backward op overflowed from finite inputs at a loss scale > 1: its values are
                                   proportional to the scale, so a smaller scale fixes it */
    AMPC_DOCTOR_INTRINSIC       /* non-finite in the forward (no scale there: log of 0, exploding activations, bad
                                   data, an overflow of the 16-bit type), or in the backward at scale <= 1, or a NaN
                                   a backward op made from finite inputs */
} ampc_doctor_verdict;
typedef struct {
    ampc_doctor_verdict verdict;
    bool backward;
    const char *module, *op;   /* as in ampc_explain_row (NULL when CLEAN) */
    int64_t nonfinite, numel;  /* NaN/inf values in that output, of its numel */
    double scale;              /* the step's loss scale */
} ampc_doctor_finding;
/* Watches every op output for NaN/inf: a pass over each output, until the first find of a step. */
void ampc_doctor_enable(bool on);
bool ampc_doctor_is_enabled(void);
/* Starts a step (before its forward): forgets the last finding; scale is the loss scale its
   backward will carry (1: none). */
void ampc_doctor_step_begin(double scale);
/* The first non-finite output since ampc_doctor_step_begin. */
ampc_doctor_finding ampc_doctor_finding_get(void);
const char *ampc_doctor_verdict_name(ampc_doctor_verdict v);   /* "clean", "scale-induced", "intrinsic" */

/* Numerics statistics: per op (module, op, pass), over the steps sampled between begin and end,
   what its outputs kept in 16 bits (forward: activations; backward: gradients, which carry the
   loss scale, measured as the op computed them, before the cast to the input's 16-bit dtype)
   lose in the 16-bit type `target`; outputs kept wider (a loss, fp32 weight gradients) are
   not counted. A value v of a wider tensor counts as flushed when it is
   nonzero and rounds to 0 in target (|v| below half the smallest subnormal), subnormal when it
   lands among target's subnormals, saturated when it rounds to inf (|v| from max + half an ulp;
   inf itself too); a 16-bit tensor's own subnormals and infs count alike (its flushed values are
   already 0 and cannot be told from exact zeros, counted apart). */
typedef struct {
    const char *module, *op;   /* as in ampc_explain_row */
    bool backward;
    int64_t outputs;           /* output tensors seen (a row's op may run several times a step) */
    int64_t values;            /* their elements */
    int64_t zeros, flushed, subnormal, saturated, nonfinite;   /* counts among values */
    double amax;               /* the largest finite |v| */
} ampc_numerics_row;
/* Starts collecting (target AMPC_F16 or AMPC_BF16); AMPC_ERR_STATE if already on. The rows
   accumulate over every step until ampc_numerics_end: sample by calling begin/end around the
   steps to sample (ampc_numerics_pause/resume skip steps without losing the rows). */
int ampc_numerics_begin(ampc_dtype target);
void ampc_numerics_pause(bool paused);
/* Stops; *rows receives the rows in the order first seen (malloc'd: free()); the count. */
int ampc_numerics_end(ampc_numerics_row **rows);

// ---------------------------------------------------------------------------------------------
// Modules

typedef struct ampc_module ampc_module;

/* Constructors initialise like PyTorch's defaults from the global generator (ampc_manual_seed).
   Parameters are fp32 on the default device. */
ampc_module *ampc_linear_new(int64_t in_features, int64_t out_features, bool bias);
ampc_module *ampc_relu_new(void);
ampc_module *ampc_gelu_new(void);
ampc_module *ampc_silu_new(void);
ampc_module *ampc_tanh_new(void);
ampc_module *ampc_sigmoid_new(void);
ampc_module *ampc_dropout_new(double p);
ampc_module *ampc_flatten_new(void);
/* Takes ownership of the n children (named "0".."n-1"); NULL child: NULL result, all freed. */
ampc_module *ampc_sequential(int n, ...);
ampc_module *ampc_sequential_from(int n, ampc_module **children);

/* Output in the current scope. Each module's forward runs in its own scope, so its
   intermediates are held only by the autograd graph and freed as backward consumes them. */
ampc_tensor *ampc_module_forward(ampc_module *m, ampc_tensor *x);
void ampc_module_train(ampc_module *m, bool training);    /* recursive */
bool ampc_module_is_training(const ampc_module *m);
const char *ampc_module_type(const ampc_module *m);       /* "Linear", "Sequential", ... */
int ampc_module_num_children(const ampc_module *m);
ampc_module *ampc_module_child(ampc_module *m, int i);
/* Parameters in state_dict order with PyTorch names ("0.weight", "2.bias", "1.0.weight" for
   nested modules), frozen ones included. Returns the count (or a negative status); params and
   names (either may be NULL) receive arrays owned by the module, valid until it changes. */
int ampc_module_parameters(ampc_module *m, ampc_tensor ***params, const char ***names);
int64_t ampc_module_num_parameters(ampc_module *m, bool trainable_only);
void ampc_module_requires_grad(ampc_module *m, bool on);  /* freeze / unfreeze recursively */
/* With its children, parameters and their grads. A child of another module is not freed
   (AMPC_ERR_STATE: free the root, or ampc_module_replace the child); neither is a stale m.
   Functions given a NULL or stale module record an error naming the call and return NULL,
   false, a negative status (ampc_module_parameters/state_dict), or 0 (num_children of NULL). */
void ampc_module_free(ampc_module *m);
/* Moves m's parameters, buffers and their grads to dev in place (PyTorch's module.to(device)):
   the handles stay valid, their storage moves; optimizer state made before the move does not
   (make the optimizer after moving the model). */
int ampc_module_to(ampc_module *m, ampc_device dev);
/* PyTorch's nn.SyncBatchNorm.convert_sync_batchnorm, in place: every BatchNorm2d in m becomes a
   SyncBatchNorm (ampc_sync_batch_norm2d: batch statistics of all processes), with the same
   parameters, buffers and state_dict names. Returns how many were converted, or a negative
   status. */
int ampc_module_convert_sync_batchnorm(ampc_module *m);

/* Convolutional layers (PyTorch's default initialisation: kaiming_uniform(a=sqrt(5)) weights,
   U(+-1/sqrt(fan_in)) bias; BatchNorm: weight 1, bias 0, running_mean 0, running_var 1). */
ampc_module *ampc_conv2d_new(int64_t in_channels, int64_t out_channels, int kernel_size,
                             const ampc_conv2d_options *opts, bool bias);
ampc_module *ampc_batchnorm2d_new(int64_t num_features);   /* eps 1e-5, momentum 0.1 */
ampc_module *ampc_maxpool2d_new(const ampc_pool2d_options *opts);
ampc_module *ampc_avgpool2d_new(const ampc_pool2d_options *opts);
ampc_module *ampc_adaptive_avgpool2d_new(int out_h, int out_w);
ampc_module *ampc_layernorm_new(int norm_ndim, const int64_t *normalized_shape);
/* Embedding: its forward takes i64 indices (any shape) and gives their rows of "weight"
   (num_embeddings, embedding_dim), drawn from N(0, 1) as PyTorch's nn.Embedding does. */
ampc_module *ampc_embedding_new(int64_t num_embeddings, int64_t embedding_dim);
/* nanoGPT's CausalSelfAttention: x (B, T, n_embd) -> c_attn (Linear n_embd -> 3 n_embd: q, k, v)
   -> n_head heads of causal scaled-dot-product attention -> c_proj (Linear n_embd -> n_embd)
   -> dropout in training; its state_dict is nanoGPT's (c_attn.weight, c_attn.bias, c_proj...). */
ampc_module *ampc_causal_self_attention_new(int64_t n_embd, int64_t n_head, bool bias, double dropout);
/* nanoGPT's Block: x + attn(ln_1(x)), then + mlp(ln_2(.)), mlp = c_fc (n_embd -> 4 n_embd), exact
   GELU, c_proj (-> n_embd), dropout; without bias, no Linear or LayerNorm has one. */
ampc_module *ampc_gpt_block_new(int64_t n_embd, int64_t n_head, bool bias, double dropout);

/* nanoGPT's GPTConfig; a 0 (false) field takes GPT-2 124M's value (in brackets). */
typedef struct {
    int64_t vocab_size;   /* [50257] tokens */
    int64_t block_size;   /* [1024] the longest sequence (positions of wpe) */
    int64_t n_layer;      /* [12] Blocks */
    int64_t n_head;       /* [12] attention heads; n_embd a multiple of it */
    int64_t n_embd;       /* [768] width */
    double dropout;       /* [0] after the embeddings, in attention's and the MLP's outputs */
    bool no_bias;         /* [false] true: no bias in any Linear or LayerNorm (nanoGPT's bias=False) */
} ampc_gpt_config;

/* Model zoo by name: "mlp" (in_channels*28*28 -> 128 -> ReLU -> num_classes), "cnn" (PyTorch's
   MNIST example: conv 1->32 3x3, ReLU, conv 32->64 3x3, ReLU, maxpool 2, dropout 0.25,
   flatten, fc 9216->128, ReLU, dropout 0.5, fc 128->10, for 28x28 inputs), "resnet18",
   "resnet50" (torchvision's architecture and state_dict names), "gpt" (nanoGPT's GPT: i64 token
   indices (B, T), T <= block_size, to logits (B, T, vocab_size); children transformer.{wte,
   wpe, drop, h.0 .. h.<n_layer - 1>, ln_f} and lm_head, whose weight is wte's (tied: the
   state_dict holds it as transformer.wte.weight and lm_head.weight, the parameter list once);
   nanoGPT's initialisation: N(0, 0.02) for Linear and Embedding weights, N(0, 0.02 /
   sqrt(2 n_layer)) for each block's c_proj weights, zero biases, unit LayerNorm weights).
   small_input: for 28x28/32x32 images, ResNets use a 3x3 stride-1 stem without max pooling.
   NULL + error for an unknown name. */
typedef struct {
    int64_t num_classes;   /* 0: 10 for mlp/cnn, 1000 for resnets */
    int64_t in_channels;   /* 0: 1 for mlp/cnn, 3 for resnets */
    bool small_input;
    /* CHANNELS_LAST: cnn and the ResNets convert their input to channels-last once and run
       their convolutions, norms and pooling in it (faster on CPU: no layout reorders); the
       values computed are the same up to summation order. Default: contiguous, as PyTorch. */
    ampc_memory_format memory_format;
    ampc_gpt_config gpt;   /* "gpt" only */
} ampc_model_options;
ampc_module *ampc_model_new(const char *name, const ampc_model_options *opts);
/* Child by dotted path ("fc", "layer1.0.conv1"; "" is m itself, as get_submodule), or NULL
   with an error naming the missing component. */
ampc_module *ampc_module_find(ampc_module *m, const char *path);
/* Replaces the child at a dotted path (e.g. the classifier head "fc"), freeing the old one;
   the name and the place in the state_dict order stay. Takes ownership of replacement: on an
   error it is freed too, unless it already belongs to a module tree (AMPC_ERR_STATE). Arrays
   from ampc_module_parameters/state_dict are invalidated; build optimizers after replacing. */
int ampc_module_replace(ampc_module *m, const char *path, ampc_module *replacement);
/* Parameters and buffers in state_dict order ("bn1.running_mean", "layer1.0.conv1.weight").
   Same ownership rules as ampc_module_parameters. */
int ampc_module_state_dict(ampc_module *m, ampc_tensor ***tensors, const char ***names);

// ---------------------------------------------------------------------------------------------
// Optimizers: update fp32 master weights in place from their fp32 grads; params without a
// grad (frozen or unused) are skipped, like PyTorch.

typedef struct ampc_optimizer ampc_optimizer;
typedef struct {
    double lr, momentum, dampening, weight_decay;
    bool nesterov;
} ampc_sgd_options;
typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    bool amsgrad;
} ampc_adam_options;
ampc_sgd_options ampc_sgd_defaults(void);     /* lr 1e-3, rest 0 */
ampc_adam_options ampc_adam_defaults(void);   /* lr 1e-3, betas (0.9, 0.999), eps 1e-8, wd 0 */
ampc_adam_options ampc_adamw_defaults(void);  /* as Adam, wd 1e-2 */
/* Over every parameter of m (trainable at step time). opts NULL: defaults. */
ampc_optimizer *ampc_sgd_new(ampc_module *m, const ampc_sgd_options *opts);
ampc_optimizer *ampc_adam_new(ampc_module *m, const ampc_adam_options *opts);
ampc_optimizer *ampc_adamw_new(ampc_module *m, const ampc_adam_options *opts);
/* Over an explicit parameter list (fp32 leaf tensors, not owned). */
ampc_optimizer *ampc_sgd_new_params(ampc_tensor **params, int n, const ampc_sgd_options *opts);
ampc_optimizer *ampc_adam_new_params(ampc_tensor **params, int n, const ampc_adam_options *opts);
ampc_optimizer *ampc_adamw_new_params(ampc_tensor **params, int n, const ampc_adam_options *opts);
/* AMPC_ERR_STATE, nothing written, once the module a parameter belongs to was freed or one of
   its children replaced (the optimizer's own references keep the parameters readable): free
   the optimizer before its module, or build a new one. A NULL or stale optimizer records an
   error naming the call in every ampc_optimizer_* function: get_lr gives NaN, num_params 0 for
   NULL and a negative status for a stale one, param NULL. */
int ampc_optimizer_step(ampc_optimizer *opt);
void ampc_optimizer_zero_grad(ampc_optimizer *opt);        /* grads to none */
/* Parameter groups for weight decay: parameter i gets weight_decay instead of the options'
   (AdamW: decoupled; SGD, Adam: added to the gradient), as a PyTorch param group of its own. */
int ampc_optimizer_set_weight_decay(ampc_optimizer *opt, int i, double weight_decay);
/* The transformer recipe (minGPT's groups): weight decay stays on the weights of m's Linear and
   Conv2d layers only; biases, the norms' parameters and embeddings (a weight tied to an
   embedding, as GPT's lm_head, included) get none. opt's parameters must be m's. */
int ampc_optimizer_decay_only_weights(ampc_optimizer *opt, ampc_module *m);
double ampc_optimizer_get_lr(const ampc_optimizer *opt);
void ampc_optimizer_set_lr(ampc_optimizer *opt, double lr);
int ampc_optimizer_num_params(const ampc_optimizer *opt);
/* Optimizer steps taken (applied: a step the GradScaler skipped is none), the most of any
   parameter's count (PyTorch's state['step']); restored with the optimizer's state. */
int64_t ampc_optimizer_steps_taken(const ampc_optimizer *opt);

/* Learning-rate schedules by optimizer step, PyTorch's torch.optim.lr_scheduler in closed form:
   CONSTANT, STEP (StepLR: base * gamma^floor(t / step_size)) or COSINE (CosineAnnealingLR:
   eta_min + (base - eta_min) * (1 + cos(pi * t / t_max)) / 2, periodic past t_max), after an
   optional linear warm-up (LinearLR(start_factor, 1.0, total_iters = warmup_steps) then the
   schedule from 0, as SequentialLR with milestones [warmup_steps]). t counts applied optimizer
   steps (ampc_optimizer_steps_taken), so steps the GradScaler skips do not advance it. */
typedef enum { AMPC_LR_CONSTANT = 0, AMPC_LR_STEP, AMPC_LR_COSINE } ampc_lr_kind;
typedef struct {
    ampc_lr_kind kind;
    int64_t step_size;             /* STEP: steps per decay (>= 1) */
    double gamma;                  /* STEP: the factor (0.1 as PyTorch's default) */
    int64_t t_max;                 /* COSINE: the steps of the half cosine (>= 1) */
    double eta_min;                /* COSINE: the rate it ends at */
    int64_t warmup_steps;          /* 0: none */
    double warmup_start_factor;    /* the first warm-up step's share of the rate, in (0, 1] */
} ampc_lr_schedule;
/* The rate at step t (>= 0) for base rate base_lr; NaN + error for invalid settings. */
double ampc_lr_at(const ampc_lr_schedule *s, double base_lr, int64_t t);
ampc_tensor *ampc_optimizer_param(const ampc_optimizer *opt, int i);
/* Number of NaN/inf values in the parameters and the state (momentum buffers, Adam moments), or
   a negative status: the check before saving a checkpoint over a good one. */
int64_t ampc_optimizer_count_nonfinite(const ampc_optimizer *opt);
void ampc_optimizer_free(ampc_optimizer *opt);

/* torch.nn.utils.clip_grad_norm_ (p=2): returns the total norm before clipping (may be inf/NaN),
   or a negative status. With a scaler, call it after ampc_scaler_unscale. */
double ampc_clip_grad_norm(ampc_optimizer *opt, double max_norm);

// ---------------------------------------------------------------------------------------------
// GradScaler. Defaults: init_scale 65536, growth 2.0, backoff 0.5, interval 2000, enabled;
// min_scale 0, max_scale inf (no clamp), hysteresis 1 (back off at the first overflow): with
// these defaults it behaves exactly like PyTorch's GradScaler.

typedef struct ampc_scaler ampc_scaler;
typedef struct {
    /* doubles, as PyTorch's Python floats: the scale itself is a float (init_scale rounded to
       float once), and each growth or backoff is computed in double and rounded to float */
    double init_scale, growth_factor, backoff_factor;
    int growth_interval;
    bool enabled;
    double min_scale, max_scale;   /* clamp the scale when backing off / growing */
    int hysteresis;   /* DeepSpeed-style (non-consecutive): a counter starts at hysteresis; an
                         overflowing update with counter > 1 only decrements it (step skipped,
                         growth tracker reset, scale kept), one with counter <= 1 backs off;
                         each completed growth interval resets it to hysteresis */
} ampc_scaler_options;

ampc_scaler_options ampc_scaler_defaults(void);
ampc_scaler *ampc_scaler_new(const ampc_scaler_options *opts);   /* NULL: defaults */
/* loss * scale, in fp32 (pass-through when disabled). */
ampc_tensor *ampc_scaler_scale(ampc_scaler *s, ampc_tensor *loss);
int ampc_scaler_unscale(ampc_scaler *s, ampc_optimizer *opt);   /* once per step; <0 error */
/* 1 applied, 0 skipped (an inf/NaN gradient), <0 error. Afterwards the grads read unscaled,
   as after PyTorch's scaler.step, whether the step was applied or skipped. Without a prior
   ampc_scaler_unscale the unscale is fused into the optimizer's update (as PyTorch's fused
   optimizers), which writes each unscaled gradient back in the same pass; a skipped step
   unscales them in a pass of its own. */
int ampc_scaler_step(ampc_scaler *s, ampc_optimizer *opt);
int ampc_scaler_update(ampc_scaler *s);                         /* <0: no step recorded */
/* The options in force: those given to ampc_scaler_new, with the growth and backoff factors
   and the growth interval a checkpoint restored (as GradScaler.load_state_dict). */
ampc_scaler_options ampc_scaler_get_options(const ampc_scaler *s);
void ampc_scaler_set_scale(ampc_scaler *s, float new_scale);
float ampc_scaler_get_scale(const ampc_scaler *s);     /* 1.0 when disabled */
int ampc_scaler_growth_tracker(const ampc_scaler *s);
bool ampc_scaler_is_enabled(const ampc_scaler *s);
int64_t ampc_scaler_steps_applied(const ampc_scaler *s);
int64_t ampc_scaler_steps_skipped(const ampc_scaler *s);
/* Whether the last unscale of opt found an inf/NaN gradient. */
bool ampc_scaler_found_inf(const ampc_scaler *s, const ampc_optimizer *opt);
void ampc_scaler_free(ampc_scaler *s);

#ifdef __cplusplus
}
#endif

#include "ampc/data.h"
#include "ampc/io.h"

#endif /* AMPC_H */
