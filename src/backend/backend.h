/*
 * backend.h - the device seam: a table of kernel function pointers per device.
 *
 * One door: every layer above src/backend/ reaches a kernel through the dispatch functions of
 * dispatch.c (ampc__k_*), never through a table. The door checks every argument once for all
 * devices: a known device (else AMPC_ERR_INVALID), an entry in that device's table and a dtype
 * that device holds (else AMPC_ERR_UNSUPPORTED naming the kernel, dtype and device), then each
 * tensor's device, dtype, size and storage order and the kernel's other arguments, as each
 * entry below describes; ampc__backend_supports asks the first question without calling. The
 * kernels trust what they are given. A NULL entry means "not supported here". All tensors given to
 * kernels are dense, row-major unless a 4-D one is channels-last (format) where the kernel
 * says it takes that; kernels never allocate tensors, only scratch through
 * ampc__alloc(..., AMPC_MEM_WORKSPACE, ...).
 *
 * CPU (src/backend/cpu): f32/f16/bf16 storage, f32 compute, oneDNN for matmul.
 * REF (src/backend/ref): f64 only, plain loops: the oracle of the tests.
 * CUDA (src/backend/cuda): f32/f16/bf16 storage on an NVIDIA GPU, f32 compute, cuBLASLt for
 * matmul, cuDNN for convolution, ampc's kernels for the rest (pooling and batch norm included).
 *
 * The three backend folders share one file map, a file per op family (elementwise, loss:
 * softmax and cross-entropy, random: dropout, gemm, conv, pool, batch_norm, layer_norm, optim),
 * each filling its part of the table (ampc__<device>_register_<family>); cuda/ puts ampc's own
 * kernels of a family in the .cu file of the same name.
 */
#ifndef AMPC_BACKEND_H
#define AMPC_BACKEND_H

#include "backend/optim_consts.h"
#include "core/core.h"

#include <math.h>

/* The elementwise kernels take an op of the op table (include/ampc.h) of the kind they run:
   unary and unary_backward those of kind UNARY (POW is x^alpha, MUL_SCALAR alpha * x,
   ADD_SCALAR x + alpha, also on i64: a counter), binary those of kind BINARY. */

/* C[b] = op(A[b]) @ op(B[b]) (+ bias over columns), b < batch; op = transpose if ta/tb.
   A is (M, K) or (K, M) when ta; B is (K, N) or (N, K) when tb; C is (M, N), all row-major.
   stride_* are batch strides in elements, 0 to broadcast one matrix to every batch. */
typedef struct {
    int64_t batch, M, N, K;
    bool ta, tb;
    int64_t stride_a, stride_b, stride_c;
} ampc_gemm_desc;

typedef struct {
    int64_t outer, dim, inner;   /* x viewed as (outer, dim, inner); reduce along dim */
} ampc_axis_desc;

/* Attention over batch independent heads: q (batch, Tq, E), k (batch, Tk, E), v (batch, Tk, Ev),
   o (batch, Tq, Ev), lse (batch, Tq) in the statistics dtype: each query row's
   log(sum_j exp(s_ij)), s = q k^T * scale + mask, hidden (j > i) when causal. */
typedef struct {
    int64_t batch, Tq, Tk, E, Ev;
    bool causal;
    double scale;
    /* Dropout of the probabilities (p in [0, 1]; 0: none): element (b, i, j) is kept, and scaled
       by 1 / (1 - p), iff draw (b Tq + i) Tk + j of rng is not below p (ampc__rng_uniform), on
       every device; the backward draws the same elements again. */
    double dropout;
    ampc_rng_state rng;
    /* The additive mask's layout, read when the kernels are given a mask (in the statistics
       dtype): element (b, i, j) at ampc__attn_mask_offset(d, b) + i mask_si + j mask_sj, where b
       splits row-major over the leading dims lead[0 .. nlead) and mask_lead[] are the mask's
       strides along them (0 where it is broadcast; mask_si, mask_sj likewise). */
    int nlead;
    int64_t lead[AMPC_MAX_DIMS], mask_lead[AMPC_MAX_DIMS], mask_si, mask_sj;
    /* q, k, v are one tensor (3, batch, T, E) (Tq = Tk, E = Ev), passed as each of the three, and
       so are dq, dk, dv: k's and v's first elements are ampc__attn_offsets' in. */
    bool packed;
} ampc_attn_desc;

/* The keys query row i sees: [0, ampc__attn_keys(d, i)) (causal: key j <= i) */
static inline int64_t ampc__attn_keys(const ampc_attn_desc *d, int64_t i) {
    return d->causal ? (i + 1 < d->Tk ? i + 1 : d->Tk) : d->Tk;
}

/* Dropout's rule on every device (the draws of core/rng.c): an element is kept iff its draw's
   top 24 bits are >= ampc__dropout_threshold(p) = ceil(p 2^24) (its uniform is not below p), and
   a kept one is scaled by ampc__dropout_scale(p) = 1 / (1 - p) in f32 (0 for p = 1). */
static inline uint32_t ampc__dropout_threshold(double p) { return (uint32_t)ceil(p * 0x1p24); }
static inline float ampc__dropout_scale(double p) { return p < 1.0 ? (float)(1.0 / (1.0 - p)) : 0.0f; }

/* Where k and v (and dk, dv) start in their tensors: 0, or N and 2N (N = batch T E) packed */
static inline void ampc__attn_offsets(const ampc_attn_desc *d, int64_t *k_off, int64_t *v_off) {
    const int64_t n = d->packed ? d->batch * d->Tq * d->E : 0;
    *k_off = n, *v_off = 2 * n;
}

static inline int64_t ampc__attn_mask_offset(const ampc_attn_desc *d, int64_t b) {
    int64_t off = 0;
    for (int i = d->nlead - 1; i >= 0; i--) {
        off += b % d->lead[i] * d->mask_lead[i];
        b /= d->lead[i];
    }
    return off;
}

/* Hyperparameters shared by the parameters of one optimizer call. grad_scale (both
   optimizers): the gradient is first multiplied by it in f32, as a separate unscale pass would
   (the GradScaler's 1/scale fused into the step), and the product written back to the grad as
   it is read (as PyTorch's fused optimizers: the grads read unscaled after the step); 0 means
   none. */
typedef struct {
    double lr, momentum, dampening, weight_decay;
    bool nesterov;
    float grad_scale;
} ampc_sgd_hparams;

typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    bool amsgrad, decoupled;   /* decoupled: AdamW */
    float grad_scale;
} ampc_adam_hparams;

/* One parameter's update in an optimizer call (the kernels take many: one pass, one parallel
   region over all of them). */
typedef struct {
    ampc_tensor *param;
    ampc_tensor *grad;   /* with a grad_scale, the kernel writes the unscaled gradient back */
    /* SGD: [0] the momentum buffer (NULL without momentum). Adam: exp_avg, exp_avg_sq,
       max_exp_avg_sq (amsgrad only, else NULL). */
    ampc_tensor *state[3];
    /* optional: an f16/bf16 tensor of the parameter's shape and format that gets the updated
       parameter rounded to its dtype in the same pass, bit for bit what a cast after the step
       would give (autocast's 16-bit weight copy kept across steps); NULL: none */
    ampc_tensor *cast_out;
    bool first;      /* SGD: the buffer's first step (it starts as the gradient) */
    int64_t step;    /* Adam: this parameter's step count including this one (>= 1) */
    /* ZeRO: only elements [begin, begin + count) of param and grad are updated, and the state
       tensors hold those count elements (no cast_out then); count 0: the whole parameter */
    int64_t begin, count;
} ampc_optim_item;

/* The elements an item updates: its part, or the whole parameter. */
static inline int64_t ampc__item_count(const ampc_optim_item *it) { return it->count ? it->count : it->param->numel; }

/* 2-D convolution of x (N, C, H, W) with w (O, C/groups, KH, KW) into y (N, O, OH, OW), NCHW
   as the user sees it (a backend may compute in another layout and reorder inside). */
typedef struct {
    int64_t N, C, H, W, O, KH, KW, OH, OW;
    int stride[2], padding[2], dilation[2], groups;
    bool channels_last;   /* x, y, gx, gy stored N, H, W, C (w stays OIHW) */
} ampc_conv_desc;

/* 2-D pooling of x (N, C, H, W) into y (N, C, OH, OW). Window o covers rows
   [o*stride - pad_begin, o*stride - pad_begin + kernel); pad_end is the padding after the last
   row/column, larger than pad_begin when ceil_mode adds windows (OH = (H + pad_begin +
   pad_end - kernel) / stride + 1 in integer division). Max pooling ignores padding;
   AVG_EXCLUDE_PAD divides by the window's part inside the input; AVG_INCLUDE_PAD (PyTorch's
   rule) by its part inside [-pad_begin, H + pad_begin): ceil_mode's extra end padding is never
   counted.
   ADAPTIVE_AVG: PyTorch's adaptive windows, rows [floor(o*H/OH), ceil((o+1)*H/OH)) (same for
   columns); kernel, stride and padding are unused. */
typedef enum { AMPC_POOL_MAX = 0, AMPC_POOL_AVG_INCLUDE_PAD, AMPC_POOL_AVG_EXCLUDE_PAD, AMPC_POOL_ADAPTIVE_AVG } ampc_pool_kind;
typedef struct {
    ampc_pool_kind kind;
    int64_t N, C, H, W, OH, OW;
    int kernel[2], stride[2], pad_begin[2], pad_end[2];
    bool channels_last;   /* x, y, gx, gy stored N, H, W, C */
} ampc_pool_desc;

/* rows of batch_norm_relu's statistics tensor (C columns each) */
#define AMPC_BN_RELU_STAT_ROWS 5

typedef struct ampc_backend {
    /* memory, copy and fill: the part core uses, registered with it (ampc__device_register) */
    ampc_device_ops device;
    /* conv2d, pooling and batch_norm (4-D) take channels-last tensors (ampc_tensor.format);
       elsewhere, and on backends without it, the ops convert them to contiguous first */
    bool channels_last;
    /* matmul and convolution compute in dt (NULL: every float dtype); the CPU probes oneDNN */
    bool (*computes)(ampc_dtype dt);
    /* ... on arithmetic units of dt's own width, faster than f32 (NULL: none) */
    bool (*native)(ampc_dtype dt);

    /* y = f(x); x and y may be the same tensor */
    int (*unary)(ampc_op op, const ampc_tensor *x, ampc_tensor *y, double alpha);
    /* gx = gy * f'(x) from what the op's backward reads (ampc_op_backward_reads: x or
       y = f(x); the other may be NULL); gx may be gy */
    int (*unary_backward)(ampc_op op, const ampc_tensor *x, const ampc_tensor *y,
                          const ampc_tensor *gy, ampc_tensor *gx, double alpha);
    /* out = a op b with numpy broadcasting; out has the broadcast shape; same dtype */
    int (*binary)(ampc_op op, const ampc_tensor *a, const ampc_tensor *b, ampc_tensor *out);
    /* out = alpha * (x summed down to out's shape): out's shape right-aligned against x's,
       each out dim 1 or equal; f32 accumulation (f64 on REF). out has x's dtype, or f32 when
       x is 16-bit (a bias gradient straight into the fp32 master's dtype: no rounding). */
    int (*sum_to)(const ampc_tensor *x, ampc_tensor *out, double alpha);
    /* out = alpha * x broadcast up to out's shape (the inverse of sum_to) */
    int (*expand)(const ampc_tensor *x, ampc_tensor *out, double alpha);
    /* softmax / log-softmax along the axis */
    int (*softmax)(const ampc_tensor *x, ampc_tensor *y, ampc_axis_desc ax, bool log);
    int (*softmax_backward)(const ampc_tensor *y, const ampc_tensor *gy, ampc_tensor *gx,
                            ampc_axis_desc ax, bool log);
    /* c = a @ b (+ bias); a, b, bias, c share one dtype; accumulation in f32, one rounding.
       c (with no bias) may be f32 when a and b are 16-bit: the f32 accumulator unrounded (the
       weight gradient of an autocast layer, written in its fp32 master's dtype). */
    int (*gemm)(const ampc_gemm_desc *d, const ampc_tensor *a, const ampc_tensor *b,
                const ampc_tensor *bias, ampc_tensor *c);
    /* logits (N, C) float, targets (N) i64. out: (N) per-sample losses (reduction NONE) or a
       single value (MEAN/SUM). *weight_out: the divisor used by MEAN (count of non-ignored). */
    int (*cross_entropy)(const ampc_tensor *logits, const ampc_tensor *targets,
                         const ampc_cross_entropy_options *o, ampc_tensor *out,
                         double *weight_out);
    /* gx = d loss / d logits given gy (scalar or (N)) */
    int (*cross_entropy_backward)(const ampc_tensor *logits, const ampc_tensor *targets,
                                  const ampc_tensor *gy, const ampc_cross_entropy_options *o,
                                  double weight, ampc_tensor *gx);
    /* y = x * mask / (1 - p), mask (numel bytes, 0/1) written from the rng stream */
    int (*dropout)(const ampc_tensor *x, ampc_tensor *y, uint8_t *mask, double p, ampc_rng_state rng);
    int (*dropout_backward)(const ampc_tensor *gy, const uint8_t *mask, double p, ampc_tensor *gx);

    /* GradScaler: for every grad g: if any element non-finite, *found_inf = 1; g *= inv_scale
       (skipped when inv_scale == 1). One pass over all gradients. */
    int (*unscale_check)(ampc_tensor **grads, int n, float inv_scale, float *found_inf);
    /* sum of squares of all elements, in double */
    int (*sum_squares)(const ampc_tensor *t, double *out);
    /* optimizer updates of fp32 master weights, n parameters at once */
    int (*sgd_step)(const ampc_optim_item *items, int n, const ampc_sgd_hparams *h);
    int (*adam_step)(const ampc_optim_item *items, int n, const ampc_adam_hparams *h);
    /* Convolution: y = conv(x, w) + b (b NULL or (O)); gx from gy and w; gw (and gb if not
       NULL) from x and gy. x, w, y, gx, gw share a dtype; b/gb have it too. Exception: gw and
       gb may be f32 when x and gy are 16-bit (the autocast weight gradient, unrounded). */
    int (*conv2d)(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *w,
                  const ampc_tensor *b, ampc_tensor *y);
    int (*conv2d_backward_data)(const ampc_conv_desc *d, const ampc_tensor *gy, const ampc_tensor *w,
                                ampc_tensor *gx);
    int (*conv2d_backward_weights)(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *gy,
                                   ampc_tensor *gw, ampc_tensor *gb);
    /* Pooling. ws: backend-defined workspace of pool2d_workspace_size(d, dtype) bytes that the
       forward fills (max pooling's argmax) and the backward reads; gx is fully written. A size
       of 0 means the backward needs none; ws NULL: inference, no workspace written. */
    size_t (*pool2d_workspace_size)(const ampc_pool_desc *d, ampc_dtype dt);
    int (*pool2d)(const ampc_pool_desc *d, const ampc_tensor *x, ampc_tensor *y, void *ws);
    int (*pool2d_backward)(const ampc_pool_desc *d, const ampc_tensor *gy, ampc_tensor *gx, const void *ws);
    /* Batch norm of x (N, C, spatial...) per channel (x, y, gx, gy channels-last when x is). Training: batch statistics into
       save_mean/save_invstd (C, f32; f64 on REF) and running stats updated with momentum
       (unbiased variance); else running stats used (and copied into save_mean and
       1/sqrt(var+eps) into save_invstd). weight/bias (C) f32 or NULL; save_* may be NULL.
       sync (training only; SyncBatchNorm): the statistics are those of the values of every
       process of the collectives seam (ampc__bn_sync_stats), and so are the running stats'
       updates; the backward's sums likewise (ampc__bn_sync_sums) for gx, while gw and gb stay
       this process's own (data-parallel training averages them as any other gradient). A
       backend that cannot returns AMPC_ERR_UNSUPPORTED. */
    int (*batch_norm)(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                      ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y,
                      ampc_tensor *save_mean, ampc_tensor *save_invstd, bool training,
                      double momentum, double eps, bool sync);
    /* gx, gw, gb (each may be NULL) from gy, x and the saved statistics (training mode, or
       evaluation when training is false: then save_* are the running mean and 1/sqrt(var+eps)) */
    int (*batch_norm_backward)(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                               const ampc_tensor *save_mean, const ampc_tensor *save_invstd,
                               bool training, bool sync, ampc_tensor *gx, ampc_tensor *gw, ampc_tensor *gb);
    /* Batch norm followed by ReLU in one pass: y = relu(batch_norm(x)), bit for bit the
       composite (the normalised value rounded once to y's dtype, then relu with NaN kept), and
       its backward, which masks gy where that output was not positive (relu's backward: gy
       where y > 0, else 0) by recomputing the pre-activation from x and stats in registers.
       Arguments as batch_norm / batch_norm_backward, y and gx in x's dtype, except that the
       statistics are one tensor stats (AMPC_BN_RELU_STAT_ROWS, C) in the statistics dtype (or
       NULL when no backward follows): row 0 the mean, row 1 1/sqrt(var+eps) (the save_mean /
       save_invstd of batch_norm), rows 2.. whatever the backend needs to recompute the
       forward's pre-activation exactly (CPU: the f32 mean, scale and shift it applied). */
    int (*batch_norm_relu)(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                           ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y,
                           ampc_tensor *stats, bool training, double momentum, double eps, bool sync);
    int (*batch_norm_relu_backward)(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                    const ampc_tensor *stats, bool training, bool sync, ampc_tensor *gx,
                                    ampc_tensor *gw, ampc_tensor *gb);
    /* The end of a ResNet block in one pass: y = relu(batch_norm(x) + z), bit for bit the
       composite (the normalised value rounded once to y's dtype, the add in f32 rounded once,
       then relu with NaN kept); z has x's dtype, shape and memory format. stats (2, C) in the
       statistics dtype, or NULL when no backward follows: row 0 the mean, row 1 1/sqrt(var+eps)
       (batch_norm's save_mean / save_invstd). No SyncBatchNorm (the op composes then). The
       backward masks gy where the forward's output y was not positive (relu's backward), writes
       that masked gradient to gz (required: the add passes it on unchanged) and gx, gw, gb (each
       may be NULL) as batch_norm_backward of it. Optional: where NULL, the op composes
       batch_norm, add and relu (the CPU and REF backends). */
    int (*batch_norm_add_relu)(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                               ampc_tensor *running_mean, ampc_tensor *running_var, const ampc_tensor *z,
                               ampc_tensor *y, ampc_tensor *stats, bool training, double momentum, double eps);
    int (*batch_norm_add_relu_backward)(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *y,
                                        const ampc_tensor *weight, const ampc_tensor *stats, bool training,
                                        ampc_tensor *gx, ampc_tensor *gz, ampc_tensor *gw, ampc_tensor *gb);
    /* Layer norm of x viewed as (rows, cols); mean/rstd (rows) f32 (f64 on REF); weight/bias
       (cols) in any float dtype or NULL. Backward: gx, gw, gb each may be NULL. */
    int (*layer_norm)(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                      ampc_tensor *y, ampc_tensor *mean, ampc_tensor *rstd, double eps);
    int (*layer_norm_backward)(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                               const ampc_tensor *mean, const ampc_tensor *rstd, ampc_tensor *gx,
                               ampc_tensor *gw, ampc_tensor *gb);
    /* Attention (ampc_attn_desc): o and lse from q, k, v (one float dtype; lse in the
       statistics dtype) and the additive mask (NULL: none); the backward dq, dk, dv (q's dtype)
       from do, lse and q, k, v, mask, recomputing the probabilities, and when dmask is given
       the scores' gradient (batch, Tq, Tk) in the statistics dtype (the mask's gradient before
       its broadcast is summed away; 0 where a key is hidden). A query row with every key hidden
       or masked by -inf gives 0 (lse -inf). */
    int (*attention)(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                     const ampc_tensor *mask, ampc_tensor *o, ampc_tensor *lse);
    int (*attention_backward)(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                              const ampc_tensor *mask, const ampc_tensor *lse, const ampc_tensor *dout, ampc_tensor *dq,
                              ampc_tensor *dk, ampc_tensor *dv, ampc_tensor *dmask);
    /* y = x with its dims reordered: y's dim i is x's dim perm[i] (a permutation of x's ndim
       dims; y's shape follows); any dtype, the bits copied; x and y contiguous. */
    int (*permute)(const ampc_tensor *x, const int *perm, ampc_tensor *y);
    /* Embedding: y (n, D) = the rows idx[i] of w (V, D), idx n i64 values; y in w's dtype. The
       kernels check that every index is in [0, V) where they can read them (an out-of-range
       one: AMPC_ERR_INVALID). Backward: gw (V, D) = gy's row i added into row idx[i], for i
       in order, summed in f32 (f64 on REF) and rounded once: the same bits for any thread
       count; gw in gy's dtype or f32. */
    int (*embedding)(const ampc_tensor *w, const ampc_tensor *idx, ampc_tensor *y);
    int (*embedding_backward)(const ampc_tensor *gy, const ampc_tensor *idx, ampc_tensor *gw);
    /* dst[r * dst_ld + dst_off + c] = src[r * src_ld + src_off + c] * scale for r < rows,
       c < cols (elements; same dtype): the slices of cat and of its backward (scale 1: the bits
       as they are, any dtype), the data-parallel gradient buckets (scale 1 / world: f32 or f64,
       one rounding per element) */
    int (*copy_block)(const ampc_tensor *src, int64_t src_off, int64_t src_ld, ampc_tensor *dst,
                      int64_t dst_off, int64_t dst_ld, int64_t rows, int64_t cols, double scale);
} ampc_backend;

/* dev's table, or NULL with AMPC_ERR_INVALID ("unknown device N") for a device out of range.
   For src/backend, the kernel tests and ampc-bench's profiler only: the layers above go through
   the door below. */
const ampc_backend *ampc__backend(ampc_device dev);
/* Whether dev's kernels may keep 4-D tensors channels-last (ampc_backend.channels_last). */
bool ampc__backend_channels_last(ampc_device dev);

// ---------------------------------------------------------------------------------------------
// The door (dispatch.c): the kernel calls of the op layer, autograd, amp and optim

/* The table's kernel entries, one name each (the door's checks and messages use them). */
#define AMPC_KERNEL_TABLE(K)                                                                      \
    K(unary) K(unary_backward) K(binary) K(sum_to) K(expand) K(softmax) K(softmax_backward) K(gemm)  \
    K(cross_entropy) K(cross_entropy_backward) K(dropout) K(dropout_backward) K(unscale_check)     \
    K(sum_squares) K(sgd_step) K(adam_step) K(conv2d) K(conv2d_backward_data)                      \
    K(conv2d_backward_weights) K(pool2d_workspace_size) K(pool2d) K(pool2d_backward) K(batch_norm) \
    K(batch_norm_backward) K(batch_norm_relu) K(batch_norm_relu_backward) K(batch_norm_add_relu)   \
    K(batch_norm_add_relu_backward) K(layer_norm) K(layer_norm_backward) K(permute) K(attention) K(attention_backward) K(embedding) K(embedding_backward) \
    K(copy_block)
typedef enum {
#define AMPC_KERNEL_ENUM_(k) AMPC_K_##k,
    AMPC_KERNEL_TABLE(AMPC_KERNEL_ENUM_)
#undef AMPC_KERNEL_ENUM_
    AMPC_K_COUNT
} ampc_kernel;
const char *ampc__kernel_name(ampc_kernel k);   /* "softmax"; "?" out of range */
/* Whether dev's table has kernel k and dev holds dtype dt (its device.dtypes: the one dtype
   mask per backend). False for an unknown device. Sets no error. */
bool ampc__backend_supports(ampc_kernel k, ampc_dtype dt, ampc_device dev);
/* The same as a status: AMPC_OK, AMPC_ERR_INVALID "unknown device N", or AMPC_ERR_UNSUPPORTED
   naming the kernel, dtype and device (the error set). */
int ampc__backend_check(ampc_kernel k, ampc_dtype dt, ampc_device dev);

/* One dispatch function per table entry, with the entry's arguments and status: the door's
   checks on the device and dtype of the first tensor argument, then the kernel. */
int ampc__k_unary_into(ampc_op op, const ampc_tensor *x, ampc_tensor *y, double alpha);
int ampc__k_binary_into(ampc_op op, const ampc_tensor *a, const ampc_tensor *b, ampc_tensor *out);
int ampc__k_softmax(const ampc_tensor *x, ampc_tensor *y, ampc_axis_desc ax, bool log);
int ampc__k_softmax_backward(const ampc_tensor *y, const ampc_tensor *gy, ampc_tensor *gx, ampc_axis_desc ax, bool log);
int ampc__k_cross_entropy(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_cross_entropy_options *o,
                          ampc_tensor *out, double *weight_out);
int ampc__k_cross_entropy_backward(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_tensor *gy,
                                   const ampc_cross_entropy_options *o, double weight, ampc_tensor *gx);
int ampc__k_dropout(const ampc_tensor *x, ampc_tensor *y, uint8_t *mask, double p, ampc_rng_state rng);
int ampc__k_dropout_backward(const ampc_tensor *gy, const uint8_t *mask, double p, ampc_tensor *gx);
/* grads all on one device (checked: each grad's dtype) */
int ampc__k_unscale_check(ampc_tensor **grads, int n, float inv_scale, float *found_inf);
int ampc__k_sum_squares(const ampc_tensor *t, double *out);
/* items (n >= 1) all on one device; the door checks items[0].param */
int ampc__k_sgd_step(const ampc_optim_item *items, int n, const ampc_sgd_hparams *h);
int ampc__k_adam_step(const ampc_optim_item *items, int n, const ampc_adam_hparams *h);
int ampc__k_conv2d(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *w, const ampc_tensor *b,
                   ampc_tensor *y);
int ampc__k_conv2d_backward_data(const ampc_conv_desc *d, const ampc_tensor *gy, const ampc_tensor *w, ampc_tensor *gx);
int ampc__k_conv2d_backward_weights(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *gy, ampc_tensor *gw,
                                    ampc_tensor *gb);
/* pool2d_workspace_size on dev; 0 with the error set when the door refuses */
size_t ampc__k_pool2d_workspace_size(ampc_device dev, const ampc_pool_desc *d, ampc_dtype dt);
int ampc__k_pool2d(const ampc_pool_desc *d, const ampc_tensor *x, ampc_tensor *y, void *ws);
int ampc__k_pool2d_backward(const ampc_pool_desc *d, const ampc_tensor *gy, ampc_tensor *gx, const void *ws);
int ampc__k_batch_norm(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias, ampc_tensor *running_mean,
                       ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *save_mean, ampc_tensor *save_invstd,
                       bool training, double momentum, double eps, bool sync);
int ampc__k_batch_norm_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                const ampc_tensor *save_mean, const ampc_tensor *save_invstd, bool training, bool sync,
                                ampc_tensor *gx, ampc_tensor *gw, ampc_tensor *gb);
int ampc__k_batch_norm_relu(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                            ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *stats,
                            bool training, double momentum, double eps, bool sync);
int ampc__k_batch_norm_relu_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                     const ampc_tensor *stats, bool training, bool sync, ampc_tensor *gx, ampc_tensor *gw,
                                     ampc_tensor *gb);
int ampc__k_batch_norm_add_relu(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                                ampc_tensor *running_mean, ampc_tensor *running_var, const ampc_tensor *z, ampc_tensor *y,
                                ampc_tensor *stats, bool training, double momentum, double eps);
int ampc__k_batch_norm_add_relu_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *y,
                                         const ampc_tensor *weight, const ampc_tensor *stats, bool training,
                                         ampc_tensor *gx, ampc_tensor *gz, ampc_tensor *gw, ampc_tensor *gb);
int ampc__k_layer_norm(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias, ampc_tensor *y,
                       ampc_tensor *mean, ampc_tensor *rstd, double eps);
int ampc__k_layer_norm_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                const ampc_tensor *mean, const ampc_tensor *rstd, ampc_tensor *gx, ampc_tensor *gw,
                                ampc_tensor *gb);
int ampc__k_permute(const ampc_tensor *x, const int *perm, ampc_tensor *y);
int ampc__k_attention(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                      const ampc_tensor *mask, ampc_tensor *o, ampc_tensor *lse);
int ampc__k_attention_backward(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                               const ampc_tensor *mask, const ampc_tensor *lse, const ampc_tensor *dout, ampc_tensor *dq,
                               ampc_tensor *dk, ampc_tensor *dv, ampc_tensor *dmask);
int ampc__k_embedding(const ampc_tensor *w, const ampc_tensor *idx, ampc_tensor *y);
int ampc__k_embedding_backward(const ampc_tensor *gy, const ampc_tensor *idx, ampc_tensor *gw);
/* rows or cols 0: nothing to copy, AMPC_OK */
int ampc__k_copy_block(const ampc_tensor *src, int64_t src_off, int64_t src_ld, ampc_tensor *dst, int64_t dst_off,
                       int64_t dst_ld, int64_t rows, int64_t cols, double scale);

/* The elementwise, sum_to/expand and gemm entries through wrappers that allocate the output:
   new owned tensor or NULL with the error set. */
ampc_tensor *ampc__k_cast(ampc_tensor *x, ampc_dtype dt);   /* same dtype: new ref to x */
/* x in dtype dt and memory format fmt, in one pass (a new ref to x when both agree; a view
   relabelled when the two formats order the elements alike: H * W == 1 or C == 1). */
ampc_tensor *ampc__k_convert(ampc_tensor *x, ampc_dtype dt, ampc_memory_format fmt);
ampc_tensor *ampc__k_unary(ampc_op op, ampc_tensor *x, double alpha);
ampc_tensor *ampc__k_unary_backward(ampc_op op, ampc_tensor *x, ampc_tensor *y,
                                    ampc_tensor *gy, double alpha);
/* The same written over gy (which the caller must hold exclusively); returns a new ref to gy */
ampc_tensor *ampc__k_unary_backward_over(ampc_op op, ampc_tensor *x, ampc_tensor *y, ampc_tensor *gy,
                                         double alpha);
ampc_tensor *ampc__k_binary(ampc_op op, ampc_tensor *a, ampc_tensor *b);
/* x summed down to shape (broadcast-compatible), times alpha, in x's dtype */
ampc_tensor *ampc__k_sum_to(ampc_tensor *x, int ndim, const int64_t *shape, double alpha);
ampc_tensor *ampc__k_expand(ampc_tensor *x, int ndim, const int64_t *shape, double alpha);
ampc_tensor *ampc__k_gemm(const ampc_gemm_desc *d, ampc_tensor *a, ampc_tensor *b,
                          ampc_tensor *bias, int ndim, const int64_t *out_shape);
/* The same two with the output in out_dt (f32 from 16-bit operands: the unrounded accumulator) */
ampc_tensor *ampc__k_gemm_as(const ampc_gemm_desc *d, ampc_tensor *a, ampc_tensor *b, ampc_tensor *bias,
                             ampc_dtype out_dt, int ndim, const int64_t *out_shape);
ampc_tensor *ampc__k_sum_to_as(ampc_tensor *x, ampc_dtype out_dt, int ndim, const int64_t *shape, double alpha);
/* numpy broadcast of two shapes into out (ndim_out receives the rank); error if incompatible */
int ampc__broadcast_shapes(const ampc_tensor *a, const ampc_tensor *b, int *ndim_out, int64_t *out);

/* Strides (elements) of t along nd dims it broadcasts to (the door checked that it does),
   right-aligned, 0 where t has size 1 or lacks the dim. */
void ampc__broadcast_strides(const ampc_tensor *t, int nd, int64_t *st);

/* For backends with host memory: every one of idx's values in [0, n) (else AMPC_ERR_INVALID
   naming who, the value and its place). */
int ampc__host_indices(const ampc_tensor *idx, int64_t n, const char *who);
/* For backends with host memory: cross_entropy's targets (the door checked their shape), each
   in [0, C) or equal to ignore_index; *count receives the number of targets not ignored. */
int ampc__host_ce_targets(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_cross_entropy_options *o,
                          int64_t *count);
/* The optimizer kernels' per-parameter constants (backend/optim_consts.h); step >= 1. */
ampc_sgd_consts ampc__sgd_consts(const ampc_sgd_hparams *h);
ampc_adam_consts ampc__adam_consts(const ampc_adam_hparams *h, int64_t step);
/* Layer norm's x viewed as (rows, cols), rows the statistics' length (the door checked that
   they divide x). */
static inline void ampc__layer_norm_dims(const ampc_tensor *x, const ampc_tensor *mean, int64_t *rows, int64_t *cols) {
    *rows = mean->numel;
    *cols = *rows ? x->numel / *rows : 0;
}
/* SyncBatchNorm's exchanges (src/backend/bn_sync.c), on host arrays, through the collectives
   seam (ampc__comm): the same calls in the same order on every process.
   st (3C + 1 doubles): in, this process's per-channel mean (st[0..C)), its count of values per
   channel (st[C]) and sum of squared deviations from that mean (st[C+1..2C+1)); out, the same
   for the values of all processes; st[2C+1..3C+1) is scratch. Two all-reduces: the sums (with the count), then each
   process's squared deviations moved to the world's mean, q + n (mean - world mean)^2 (Chan's
   identity: no cancellation). */
int ampc__bn_sync_stats(int64_t C, double *st);
/* The backward's per-channel sums (n doubles) summed over all processes. */
int ampc__bn_sync_sums(double *sums, int64_t n);

/* Each backend file fills its table (called once, from src/backend/backend.c). */
void ampc__cpu_backend_init(ampc_backend *be);
void ampc__ref_backend_init(ampc_backend *be);
void ampc__cuda_backend_init(ampc_backend *be);   /* src/backend/cuda, in builds with AMPC_CUDA */
int ampc__cu_device_count(void);                  /* likewise: the GPUs the CUDA runtime sees */
/* The GPU ampc_cuda_set_device chose, now fixed: the CUDA backend's start calls it once. */
int ampc__cuda_gpu_take(void);
/* The CPU table is assembled from these, one per kernel file. */
void ampc__cpu_register_elementwise(ampc_backend *be);  /* unary, binary, sum_to, expand */
void ampc__cpu_register_loss(ampc_backend *be);         /* softmax, cross_entropy */
void ampc__cpu_register_random(ampc_backend *be);       /* dropout */
void ampc__cpu_register_gemm(ampc_backend *be);
void ampc__cpu_register_optim(ampc_backend *be);        /* sgd_step, adam_step */
void ampc__cpu_register_amp(ampc_backend *be);          /* unscale_check, sum_squares */
void ampc__cpu_register_conv(ampc_backend *be);         /* conv2d and its backward passes */
void ampc__cpu_register_pool(ampc_backend *be);         /* pooling, copy_block */
void ampc__cpu_register_batch_norm(ampc_backend *be);   /* batch_norm, batch_norm_relu */
void ampc__cpu_register_layer_norm(ampc_backend *be);
void ampc__cpu_register_embedding(ampc_backend *be);   /* embedding, permute */
void ampc__cpu_register_attention(ampc_backend *be);
void ampc__ref_register_elementwise(ampc_backend *be);
void ampc__ref_register_loss(ampc_backend *be);
void ampc__ref_register_random(ampc_backend *be);
void ampc__ref_register_gemm(ampc_backend *be);
void ampc__ref_register_optim(ampc_backend *be);
void ampc__ref_register_amp(ampc_backend *be);
void ampc__ref_register_conv(ampc_backend *be);
void ampc__ref_register_pool(ampc_backend *be);
void ampc__ref_register_batch_norm(ampc_backend *be);
void ampc__ref_register_layer_norm(ampc_backend *be);
void ampc__ref_register_embedding(ampc_backend *be);   /* embedding, permute */
void ampc__ref_register_attention(ampc_backend *be);

#endif /* AMPC_BACKEND_H */
