/*
 * dispatch.c - the one door to the kernels: every kernel call from the layers above
 * src/backend/ comes through here. Each call checks once what is common to every kernel (the
 * device is known, its table has the kernel, it holds the dtype: ampc__backend_check) and
 * then runs that device's kernel, which trusts what it is given (no autograd, no autocast).
 * The ampc__k_<kernel> functions take a table entry's arguments; the wrappers further down
 * allocate their output on the input's device first.
 */
#include "backend/backend.h"

#include <string.h>

int ampc__broadcast_shapes(const ampc_tensor *a, const ampc_tensor *b, int *ndim_out, int64_t *out) {
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    for (int i = 0; i < nd; i++) {
        int ia = a->ndim - nd + i, ib = b->ndim - nd + i;
        int64_t da = ia >= 0 ? a->shape[ia] : 1, db = ib >= 0 ? b->shape[ib] : 1;
        if (da != db && da != 1 && db != 1) {
            char s1[96], s2[96];
            return ampc__err(AMPC_ERR_SHAPE, "shapes %s and %s do not broadcast (dim %d: %lld vs %lld)",
                             ampc__shape_str(a, s1, sizeof s1), ampc__shape_str(b, s2, sizeof s2), i,
                             (long long)da, (long long)db);
        }
        out[i] = da == 1 ? db : da;
    }
    *ndim_out = nd;
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// The checks

const char *ampc__kernel_name(ampc_kernel k) {
    switch (k) {
#define KERNEL_NAME_(k) case AMPC_K_##k: return #k;
        AMPC_KERNEL_TABLE(KERNEL_NAME_)
#undef KERNEL_NAME_
    default: return "?";
    }
}

static bool has_kernel(const ampc_backend *be, ampc_kernel k) {
    switch (k) {
#define HAS_KERNEL_(k) case AMPC_K_##k: return be->k != NULL;
        AMPC_KERNEL_TABLE(HAS_KERNEL_)
#undef HAS_KERNEL_
    default: return false;
    }
}

static bool supported(const ampc_backend *be, ampc_kernel k, ampc_dtype dt) {
    return has_kernel(be, k) && (unsigned)dt < AMPC_DTYPE_COUNT && be->device.dtypes[dt];
}

bool ampc__backend_supports(ampc_kernel k, ampc_dtype dt, ampc_device dev) {
    return (unsigned)dev < AMPC_DEVICE_COUNT && supported(ampc__backend(dev), k, dt);
}

int ampc__backend_check(ampc_kernel k, ampc_dtype dt, ampc_device dev) {
    const ampc_backend *be = ampc__backend(dev);
    if (!be) return ampc_last_status();
    if (!supported(be, k, dt))
        return ampc__err(AMPC_ERR_UNSUPPORTED, "kernel %s on %s is not supported on device %s%s", ampc__kernel_name(k),
                         (unsigned)dt < AMPC_DTYPE_COUNT ? ampc_dtype_name(dt) : "an unknown dtype", ampc_device_name(dev),
                         has_kernel(be, k) ? " (the device does not hold that dtype)" : "");
    return AMPC_OK;
}

/* Kernel k of tensor t's device with the arguments, after the door's checks. */
#define BACKEND_CALL(t, k, ...)                                                                    \
    (ampc__backend_check(AMPC_K_##k, (t)->dtype, (t)->device) < 0 ? ampc_last_status()              \
                                                                  : ampc__backend((t)->device)->k(__VA_ARGS__))

// ---------------------------------------------------------------------------------------------
// One function per table entry

int ampc__k_unary_into(ampc_op op, const ampc_tensor *x, ampc_tensor *y, double alpha) {
    return BACKEND_CALL(x, unary, op, x, y, alpha);
}
int ampc__k_binary_into(ampc_op op, const ampc_tensor *a, const ampc_tensor *b, ampc_tensor *out) {
    return BACKEND_CALL(a, binary, op, a, b, out);
}
int ampc__k_softmax(const ampc_tensor *x, ampc_tensor *y, ampc_axis_desc ax, bool log) {
    return BACKEND_CALL(x, softmax, x, y, ax, log);
}
int ampc__k_softmax_backward(const ampc_tensor *y, const ampc_tensor *gy, ampc_tensor *gx, ampc_axis_desc ax, bool log) {
    return BACKEND_CALL(y, softmax_backward, y, gy, gx, ax, log);
}
int ampc__k_cross_entropy(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_cross_entropy_options *o,
                          ampc_tensor *out, double *weight_out) {
    return BACKEND_CALL(logits, cross_entropy, logits, targets, o, out, weight_out);
}
int ampc__k_cross_entropy_backward(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_tensor *gy,
                                   const ampc_cross_entropy_options *o, double weight, ampc_tensor *gx) {
    return BACKEND_CALL(logits, cross_entropy_backward, logits, targets, gy, o, weight, gx);
}
int ampc__k_dropout(const ampc_tensor *x, ampc_tensor *y, uint8_t *mask, double p, ampc_rng_state rng) {
    return BACKEND_CALL(x, dropout, x, y, mask, p, rng);
}
int ampc__k_dropout_backward(const ampc_tensor *gy, const uint8_t *mask, double p, ampc_tensor *gx) {
    return BACKEND_CALL(gy, dropout_backward, gy, mask, p, gx);
}
int ampc__k_unscale_check(ampc_tensor **grads, int n, float inv_scale, float *found_inf) {
    if (n <= 0) return AMPC_OK;
    for (int i = 1; i < n; i++)
        if (ampc__backend_check(AMPC_K_unscale_check, grads[i]->dtype, grads[0]->device) < 0) return ampc_last_status();
    return BACKEND_CALL(grads[0], unscale_check, grads, n, inv_scale, found_inf);
}
int ampc__k_sum_squares(const ampc_tensor *t, double *out) { return BACKEND_CALL(t, sum_squares, t, out); }
int ampc__k_sgd_step(const ampc_optim_item *items, int n, const ampc_sgd_hparams *h) {
    return n <= 0 ? AMPC_OK : BACKEND_CALL(items[0].param, sgd_step, items, n, h);
}
int ampc__k_adam_step(const ampc_optim_item *items, int n, const ampc_adam_hparams *h) {
    return n <= 0 ? AMPC_OK : BACKEND_CALL(items[0].param, adam_step, items, n, h);
}
static int64_t conv_out(int64_t in, int64_t k, int s, int p, int d) { return (in + 2 * p - (int64_t)d * (k - 1) - 1) / s + 1; }

/* A convolution's arguments, for every device: x (or gx), w (or gw), y (or gy) and b (or gb,
   may be NULL) on one device; one float dtype, except that grads (the weight pass) may write w
   and b in f32 for 16-bit data (both then); activations in the descriptor's memory format,
   weights OIHW; a valid descriptor whose output size follows from its input; every size the
   descriptor's. Then the device's table (kernel k, the dtype). */
static int check_conv(ampc_kernel kern, const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *w, const ampc_tensor *y,
                      const ampc_tensor *b, bool grads) {
    const char *what = ampc__kernel_name(kern);
    if (!w) return ampc__err(AMPC_ERR_INVALID, "%s: no weight%s tensor", what, grads ? " gradient" : "");
    if (w->device != x->device || y->device != x->device || (b && b->device != x->device))
        return ampc__err(AMPC_ERR_INVALID, "%s: tensors on more than one device (x on %s)", what, ampc_device_name(x->device));
    ampc_dtype dt = x->dtype, wdt = grads && w->dtype == AMPC_F32 ? AMPC_F32 : dt;
    if (dt == AMPC_I64) return ampc__err(AMPC_ERR_DTYPE, "%s on %s tensors", what, ampc_dtype_name(dt));
    if (w->dtype != wdt || y->dtype != dt || (b && b->dtype != wdt))
        return ampc__err(AMPC_ERR_DTYPE, "%s: operands of different dtypes", what);
    if (ampc__is_cl(x) != d->channels_last || ampc__is_cl(y) != d->channels_last || ampc__is_cl(w))
        return ampc__err(AMPC_ERR_INVALID, "%s: activations must be %s as the descriptor says, weights OIHW", what,
                         d->channels_last ? "channels-last" : "contiguous");
    if (d->N < 0 || d->C < 0 || d->H < 0 || d->W < 0 || d->O < 0 || d->KH < 1 || d->KW < 1 || d->groups < 1 ||
        d->C % d->groups || d->O % d->groups)
        return ampc__err(AMPC_ERR_INVALID, "%s: invalid descriptor", what);
    for (int i = 0; i < 2; i++)
        if (d->stride[i] < 1 || d->dilation[i] < 1 || d->padding[i] < 0)
            return ampc__err(AMPC_ERR_INVALID, "%s: invalid stride, dilation or padding", what);
    if (d->OH != conv_out(d->H, d->KH, d->stride[0], d->padding[0], d->dilation[0]) ||
        d->OW != conv_out(d->W, d->KW, d->stride[1], d->padding[1], d->dilation[1]) || d->OH < 1 || d->OW < 1)
        return ampc__err(AMPC_ERR_INVALID, "%s: output size %lldx%lld does not match the descriptor", what, (long long)d->OH,
                         (long long)d->OW);
    if (x->numel != d->N * d->C * d->H * d->W || w->numel != d->O * (d->C / d->groups) * d->KH * d->KW ||
        y->numel != d->N * d->O * d->OH * d->OW || (b && b->numel != d->O))
        return ampc__err(AMPC_ERR_INVALID, "%s: a tensor's size does not match the descriptor", what);
    return ampc__backend_check(kern, dt, x->device);
}

int ampc__k_conv2d(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *w, const ampc_tensor *b,
                   ampc_tensor *y) {
    return check_conv(AMPC_K_conv2d, d, x, w, y, b, false) < 0 ? ampc_last_status() : ampc__backend(x->device)->conv2d(d, x, w, b, y);
}
int ampc__k_conv2d_backward_data(const ampc_conv_desc *d, const ampc_tensor *gy, const ampc_tensor *w, ampc_tensor *gx) {
    return check_conv(AMPC_K_conv2d_backward_data, d, gx, w, gy, NULL, false) < 0
               ? ampc_last_status()
               : ampc__backend(gy->device)->conv2d_backward_data(d, gy, w, gx);
}
int ampc__k_conv2d_backward_weights(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *gy, ampc_tensor *gw,
                                    ampc_tensor *gb) {
    return check_conv(AMPC_K_conv2d_backward_weights, d, x, gw, gy, gb, true) < 0
               ? ampc_last_status()
               : ampc__backend(x->device)->conv2d_backward_weights(d, x, gy, gw, gb);
}
size_t ampc__k_pool2d_workspace_size(ampc_device dev, const ampc_pool_desc *d, ampc_dtype dt) {
    if (ampc__backend_check(AMPC_K_pool2d_workspace_size, dt, dev) < 0) return 0;
    return ampc__backend(dev)->pool2d_workspace_size(d, dt);
}
/* pooling's arguments, for every device: x (input or gx) and y (output or gy) on one device, of
   one float dtype, of the descriptor's sizes and memory format; the window valid; max pooling's
   backward with its forward's workspace */
static int check_pool(const ampc_pool_desc *d, const ampc_tensor *x, const ampc_tensor *y, const void *ws, bool backward) {
    const char *k = backward ? "pool2d_backward" : "pool2d";
    if (x->device != y->device)
        return ampc__err(AMPC_ERR_INVALID, "%s: tensors on %s and %s", k, ampc_device_name(x->device), ampc_device_name(y->device));
    if (x->dtype != y->dtype || x->dtype == AMPC_I64)
        return ampc__err(AMPC_ERR_DTYPE, "%s on %s and %s", k, ampc_dtype_name(x->dtype), ampc_dtype_name(y->dtype));
    if (x->numel != d->N * d->C * d->H * d->W || y->numel != d->N * d->C * d->OH * d->OW)
        return ampc__err(AMPC_ERR_INVALID, "%s: tensor sizes do not match the descriptor", k);
    if (ampc__is_cl(x) != d->channels_last || ampc__is_cl(y) != d->channels_last)
        return ampc__err(AMPC_ERR_INVALID, "%s: tensor memory formats do not match the descriptor", k);
    if (d->kind != AMPC_POOL_ADAPTIVE_AVG &&
        (d->stride[0] < 1 || d->stride[1] < 1 || d->kernel[0] < 1 || d->kernel[1] < 1 || d->pad_begin[0] < 0 || d->pad_begin[1] < 0))
        return ampc__err(AMPC_ERR_INVALID, "%s: kernel %dx%d, stride %dx%d, padding %dx%d: kernel and stride must be >= 1, padding >= 0",
                         k, d->kernel[0], d->kernel[1], d->stride[0], d->stride[1], d->pad_begin[0], d->pad_begin[1]);
    if (backward && d->kind == AMPC_POOL_MAX && !ws && y->numel > 0)
        return ampc__err(AMPC_ERR_INVALID, "max pool backward without the forward's workspace");
    return ampc__backend_check(backward ? AMPC_K_pool2d_backward : AMPC_K_pool2d, x->dtype, x->device);
}
int ampc__k_pool2d(const ampc_pool_desc *d, const ampc_tensor *x, ampc_tensor *y, void *ws) {
    return check_pool(d, x, y, ws, false) < 0 ? ampc_last_status() : ampc__backend(x->device)->pool2d(d, x, y, ws);
}
int ampc__k_pool2d_backward(const ampc_pool_desc *d, const ampc_tensor *gy, ampc_tensor *gx, const void *ws) {
    return check_pool(d, gx, gy, ws, true) < 0 ? ampc_last_status() : ampc__backend(gy->device)->pool2d_backward(d, gy, gx, ws);
}
/* One argument of a batch norm kernel: rows 0 for a tensor shaped as x (y, gy, gx, z, the
   saved output), else a per-channel tensor of rows x C elements (weight, bias, the running and
   saved statistics, gw, gb; batch_norm_relu's stats). need: it must be there. */
typedef struct {
    const ampc_tensor *t;
    const char *name;
    int rows;
    bool need;
} bn_arg;

/* Batch norm's arguments, every variant on every device: x (N, C, ...) of a float dtype held by
   its device; the tensors shaped as x in x's dtype, size and memory format; the per-channel ones
   in the device's statistics dtype (f32; f64 where the device holds no f32: REF); all on x's
   device; a forward in evaluation mode with running statistics, in training with values per
   channel. Then the device's table. */
static int check_bn(ampc_kernel kern, const ampc_tensor *x, const bn_arg *a, int n, bool forward, bool training) {
    const char *k = ampc__kernel_name(kern);
    int rc = ampc__backend_check(kern, x->dtype, x->device);
    if (rc < 0) return rc;
    if (x->ndim < 2) return ampc__err(AMPC_ERR_SHAPE, "%s: x needs at least 2 dimensions (N, C, ...)", k);
    if (x->dtype == AMPC_I64) return ampc__err(AMPC_ERR_DTYPE, "%s: x is %s, expected a float dtype", k, ampc_dtype_name(x->dtype));
    const ampc_dtype sdt = ampc__device(x->device)->dtypes[AMPC_F32] ? AMPC_F32 : AMPC_F64;
    const int64_t C = x->shape[1], M = x->numel / (C ? C : 1);
    for (int i = 0; i < n; i++) {
        const ampc_tensor *t = a[i].t;
        if (!t) {
            if (a[i].need) return ampc__err(AMPC_ERR_INVALID, "%s: %s missing", k, a[i].name);
            continue;
        }
        ampc_dtype want = a[i].rows ? sdt : x->dtype;
        int64_t numel = a[i].rows ? a[i].rows * C : x->numel;
        if (t->device != x->device)
            return ampc__err(AMPC_ERR_INVALID, "%s: %s on %s, x on %s", k, a[i].name, ampc_device_name(t->device),
                             ampc_device_name(x->device));
        if (t->dtype != want)
            return ampc__err(AMPC_ERR_DTYPE, "%s: %s is %s, expected %s", k, a[i].name, ampc_dtype_name(t->dtype), ampc_dtype_name(want));
        if (t->numel != numel)
            return ampc__err(AMPC_ERR_SHAPE, "%s: %s has %lld elements, expected %lld", k, a[i].name, (long long)t->numel,
                             (long long)numel);
        if (!a[i].rows && ampc__is_cl(t) != ampc__is_cl(x))
            return ampc__err(AMPC_ERR_INVALID, "%s: x and %s in different memory formats", k, a[i].name);
    }
    if (forward && !training && (!a[2].t || !a[3].t))   /* the forwards list weight, bias, running_mean, running_var first */
        return ampc__err(AMPC_ERR_INVALID, "%s: evaluation needs running_mean and running_var", k);
    if (forward && training && C > 0 && M < 1)
        return ampc__err(AMPC_ERR_INVALID, "%s: no values per channel", k);
    return AMPC_OK;
}

#define BN_CHECK(kern, forward, ...)                                                               \
    (check_bn(AMPC_K_##kern, x, (const bn_arg[]){__VA_ARGS__}, (int)(sizeof((const bn_arg[]){__VA_ARGS__}) / sizeof(bn_arg)), \
              forward, training) < 0)

int ampc__k_batch_norm(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias, ampc_tensor *running_mean,
                       ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *save_mean, ampc_tensor *save_invstd,
                       bool training, double momentum, double eps, bool sync) {
    if (BN_CHECK(batch_norm, true, {weight, "weight", 1, false}, {bias, "bias", 1, false}, {running_mean, "running_mean", 1, false},
                 {running_var, "running_var", 1, false}, {y, "y", 0, true}, {save_mean, "save_mean", 1, false},
                 {save_invstd, "save_invstd", 1, false}))
        return ampc_last_status();
    return ampc__backend(x->device)->batch_norm(x, weight, bias, running_mean, running_var, y, save_mean, save_invstd, training,
                                                momentum, eps, sync);
}
int ampc__k_batch_norm_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                const ampc_tensor *save_mean, const ampc_tensor *save_invstd, bool training, bool sync,
                                ampc_tensor *gx, ampc_tensor *gw, ampc_tensor *gb) {
    if (BN_CHECK(batch_norm_backward, false, {gy, "gy", 0, true}, {gx, "gx", 0, false}, {weight, "weight", 1, false},
                 {save_mean, "statistics (save_mean)", 1, true}, {save_invstd, "statistics (save_invstd)", 1, true},
                 {gw, "gw", 1, false}, {gb, "gb", 1, false}))
        return ampc_last_status();
    return ampc__backend(x->device)->batch_norm_backward(x, gy, weight, save_mean, save_invstd, training, sync, gx, gw, gb);
}
int ampc__k_batch_norm_relu(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                            ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *stats,
                            bool training, double momentum, double eps, bool sync) {
    if (BN_CHECK(batch_norm_relu, true, {weight, "weight", 1, false}, {bias, "bias", 1, false},
                 {running_mean, "running_mean", 1, false}, {running_var, "running_var", 1, false}, {y, "y", 0, true},
                 {stats, "stats", AMPC_BN_RELU_STAT_ROWS, false}))
        return ampc_last_status();
    return ampc__backend(x->device)->batch_norm_relu(x, weight, bias, running_mean, running_var, y, stats, training, momentum, eps,
                                                     sync);
}
int ampc__k_batch_norm_relu_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                     const ampc_tensor *stats, bool training, bool sync, ampc_tensor *gx, ampc_tensor *gw,
                                     ampc_tensor *gb) {
    if (BN_CHECK(batch_norm_relu_backward, false, {gy, "gy", 0, true}, {gx, "gx", 0, false}, {weight, "weight", 1, false},
                 {stats, "statistics (stats)", AMPC_BN_RELU_STAT_ROWS, true}, {gw, "gw", 1, false}, {gb, "gb", 1, false}))
        return ampc_last_status();
    return ampc__backend(x->device)->batch_norm_relu_backward(x, gy, weight, stats, training, sync, gx, gw, gb);
}
int ampc__k_batch_norm_add_relu(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                                ampc_tensor *running_mean, ampc_tensor *running_var, const ampc_tensor *z, ampc_tensor *y,
                                ampc_tensor *stats, bool training, double momentum, double eps) {
    if (BN_CHECK(batch_norm_add_relu, true, {weight, "weight", 1, false}, {bias, "bias", 1, false},
                 {running_mean, "running_mean", 1, false}, {running_var, "running_var", 1, false}, {z, "z", 0, true},
                 {y, "y", 0, true}, {stats, "stats", 2, false}))
        return ampc_last_status();
    return ampc__backend(x->device)->batch_norm_add_relu(x, weight, bias, running_mean, running_var, z, y, stats, training,
                                                         momentum, eps);
}
int ampc__k_batch_norm_add_relu_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *y,
                                         const ampc_tensor *weight, const ampc_tensor *stats, bool training,
                                         ampc_tensor *gx, ampc_tensor *gz, ampc_tensor *gw, ampc_tensor *gb) {
    if (BN_CHECK(batch_norm_add_relu_backward, false, {gy, "gy", 0, true}, {y, "y", 0, true}, {gx, "gx", 0, false},
                 {gz, "gz", 0, true}, {weight, "weight", 1, false}, {stats, "statistics (stats)", 2, true},
                 {gw, "gw", 1, false}, {gb, "gb", 1, false}))
        return ampc_last_status();
    return ampc__backend(x->device)->batch_norm_add_relu_backward(x, gy, y, weight, stats, training, gx, gz, gw, gb);
}
int ampc__k_layer_norm(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias, ampc_tensor *y,
                       ampc_tensor *mean, ampc_tensor *rstd, double eps) {
    return BACKEND_CALL(x, layer_norm, x, weight, bias, y, mean, rstd, eps);
}
int ampc__k_layer_norm_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                const ampc_tensor *mean, const ampc_tensor *rstd, ampc_tensor *gx, ampc_tensor *gw,
                                ampc_tensor *gb) {
    return BACKEND_CALL(x, layer_norm_backward, x, gy, weight, mean, rstd, gx, gw, gb);
}
/* copy_block's arguments (same dtype, the blocks inside both tensors, a scale other than 1 on
   f32 and f64 only): AMPC_OK, 1 when there is nothing to copy, else the error */
static int check_copy_block(const ampc_tensor *src, int64_t src_off, int64_t src_ld, const ampc_tensor *dst,
                            int64_t dst_off, int64_t dst_ld, int64_t rows, int64_t cols, double scale) {
    if (src->dtype != dst->dtype)
        return ampc__err(AMPC_ERR_DTYPE, "copy_block between %s and %s", ampc_dtype_name(src->dtype), ampc_dtype_name(dst->dtype));
    if (scale != 1.0 && src->dtype != AMPC_F32 && src->dtype != AMPC_F64)
        return ampc__err(AMPC_ERR_DTYPE, "copy_block with a scale (%g) on %s: f32 and f64 only", scale, ampc_dtype_name(src->dtype));
    if (rows <= 0 || cols <= 0) return 1;
    if (src_off < 0 || dst_off < 0 || src_off + (rows - 1) * src_ld + cols > src->numel ||
        dst_off + (rows - 1) * dst_ld + cols > dst->numel)
        return ampc__err(AMPC_ERR_INVALID, "copy_block of %lld x %lld outside its tensors", (long long)rows, (long long)cols);
    return AMPC_OK;
}

int ampc__k_copy_block(const ampc_tensor *src, int64_t src_off, int64_t src_ld, ampc_tensor *dst, int64_t dst_off,
                       int64_t dst_ld, int64_t rows, int64_t cols, double scale) {
    int rc = ampc__backend_check(AMPC_K_copy_block, dst->dtype, dst->device);
    if (rc >= 0 && src->device != dst->device)
        rc = ampc__err(AMPC_ERR_INVALID, "copy_block from %s to %s", ampc_device_name(src->device), ampc_device_name(dst->device));
    if (rc >= 0) rc = check_copy_block(src, src_off, src_ld, dst, dst_off, dst_ld, rows, cols, scale);
    if (rc != AMPC_OK) return rc < 0 ? rc : AMPC_OK;   /* 1: nothing to copy */
    return ampc__backend(dst->device)->copy_block(src, src_off, src_ld, dst, dst_off, dst_ld, rows, cols, scale);
}

// ---------------------------------------------------------------------------------------------
// Wrappers that allocate the output

static ampc_tensor *finish_kernel(ampc_tensor *out, int rc) {
    if (rc < 0) {
        ampc__release(out);
        return NULL;
    }
    return out;
}

ampc_tensor *ampc__k_convert(ampc_tensor *x, ampc_dtype dt, ampc_memory_format fmt) {
    if (x->dtype == dt && x->format == fmt) return ampc__retain(x);
    /* (n, c, h, w) and (n, h, w, c) order alike when one of the two is a single element */
    if (x->dtype == dt && x->ndim == 4 && (x->shape[1] == 1 || x->shape[2] * x->shape[3] == 1)) {
        ampc_tensor *v = ampc__tensor_view(x, x->ndim, x->shape);   /* same storage, relabelled */
        if (v) v->format = fmt;
        return v;
    }
    ampc_tensor *y = ampc__tensor_new_fmt(dt, x->device, x->ndim, x->shape, fmt);
    if (!y) return NULL;
    return finish_kernel(y, ampc__device(x->device)->copy(x, y));
}

ampc_tensor *ampc__k_cast(ampc_tensor *x, ampc_dtype dt) { return ampc__k_convert(x, dt, x->format); }

ampc_tensor *ampc__k_unary(ampc_op op, ampc_tensor *x, double alpha) {
    ampc_tensor *y = ampc__tensor_like(x, x->dtype);
    if (!y) return NULL;
    return finish_kernel(y, ampc__k_unary_into(op, x, y, alpha));
}

ampc_tensor *ampc__k_unary_backward(ampc_op op, ampc_tensor *x, ampc_tensor *y, ampc_tensor *gy, double alpha) {
    ampc_tensor *gx = ampc__tensor_like(gy, gy->dtype);
    if (!gx) return NULL;
    return finish_kernel(gx, BACKEND_CALL(gy, unary_backward, op, x, y, gy, gx, alpha));
}

ampc_tensor *ampc__k_unary_backward_over(ampc_op op, ampc_tensor *x, ampc_tensor *y, ampc_tensor *gy, double alpha) {
    int rc = BACKEND_CALL(gy, unary_backward, op, x, y, gy, gy, alpha);
    return rc < 0 ? NULL : ampc__retain(gy);
}

ampc_tensor *ampc__k_binary(ampc_op op, ampc_tensor *a, ampc_tensor *b) {
    int nd;
    int64_t shape[AMPC_MAX_DIMS];
    if (ampc__broadcast_shapes(a, b, &nd, shape) < 0) return NULL;
    if (a->dtype != b->dtype) return ampc__err_null(AMPC_ERR_DTYPE, "binary kernel on %s and %s", ampc_dtype_name(a->dtype), ampc_dtype_name(b->dtype));
    /* channels-last only elementwise over one shape and format (the kernel walks storage) */
    bool cl = ampc__is_cl(a) || ampc__is_cl(b);
    if (cl && (a->format != b->format || !ampc__same_shape(a, b)))
        return ampc__err_null(AMPC_ERR_INVALID, "binary kernel on channels-last tensors of different shapes or formats");
    ampc_tensor *out = ampc__tensor_new_fmt(a->dtype, a->device, nd, shape, a->format);
    if (!out) return NULL;
    return finish_kernel(out, ampc__k_binary_into(op, a, b, out));
}

/* A channels-last x changing shape is read in contiguous order (sum_to/expand index by shape);
   one keeping its shape keeps its format. */
static ampc_tensor *shape_walk(ampc_tensor *x, int ndim, const int64_t *shape, ampc_memory_format *out_fmt) {
    bool same = ndim == x->ndim && !memcmp(shape, x->shape, sizeof(int64_t) * (size_t)ndim);
    *out_fmt = same ? x->format : AMPC_CONTIGUOUS_FORMAT;
    return same ? ampc__retain(x) : ampc__k_convert(x, x->dtype, AMPC_CONTIGUOUS_FORMAT);
}

ampc_tensor *ampc__k_sum_to_as(ampc_tensor *x_, ampc_dtype out_dt, int ndim, const int64_t *shape, double alpha) {
    ampc_memory_format fmt;
    ampc_tensor *x = shape_walk(x_, ndim, shape, &fmt);
    ampc_tensor *out = x ? ampc__tensor_new_fmt(out_dt, x->device, ndim, shape, fmt) : NULL;
    if (out) out = finish_kernel(out, BACKEND_CALL(x, sum_to, x, out, alpha));
    ampc__release(x);
    return out;
}
ampc_tensor *ampc__k_expand(ampc_tensor *x_, int ndim, const int64_t *shape, double alpha) {
    ampc_memory_format fmt;
    ampc_tensor *x = shape_walk(x_, ndim, shape, &fmt);
    ampc_tensor *out = x ? ampc__tensor_new_fmt(x->dtype, x->device, ndim, shape, fmt) : NULL;
    if (out) out = finish_kernel(out, BACKEND_CALL(x, expand, x, out, alpha));
    ampc__release(x);
    return out;
}

ampc_tensor *ampc__k_sum_to(ampc_tensor *x, int ndim, const int64_t *shape, double alpha) {
    return ampc__k_sum_to_as(x, x->dtype, ndim, shape, alpha);
}

ampc_tensor *ampc__k_gemm_as(const ampc_gemm_desc *d, ampc_tensor *a, ampc_tensor *b, ampc_tensor *bias,
                             ampc_dtype out_dt, int ndim, const int64_t *out_shape) {
    if (ampc__is_cl(a) || ampc__is_cl(b) || (bias && ampc__is_cl(bias)))
        return ampc__err_null(AMPC_ERR_INVALID, "gemm on a channels-last tensor (the op must convert it)");
    ampc_tensor *c = ampc__tensor_new(out_dt, a->device, ndim, out_shape);
    if (!c) return NULL;
    return finish_kernel(c, BACKEND_CALL(a, gemm, d, a, b, bias, c));
}

ampc_tensor *ampc__k_gemm(const ampc_gemm_desc *d, ampc_tensor *a, ampc_tensor *b, ampc_tensor *bias, int ndim,
                          const int64_t *out_shape) {
    return ampc__k_gemm_as(d, a, b, bias, a->dtype, ndim, out_shape);
}

