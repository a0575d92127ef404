/*
 * dispatch.c - the one door to the kernels: every kernel call from the layers above
 * src/backend/ comes through here, and every argument is checked here once, for every device:
 * the device is known and its table has the kernel for the dtype (ampc__backend_check); every
 * tensor is on that device, of the dtype and size the kernel takes, in a storage order the
 * kernel can walk; descriptors, axes, probabilities and optimizer items are valid; the op is of
 * the kind the kernel runs (the op table's kind column). Then the device's kernel runs and
 * trusts what it is given (no autograd, no autocast, no checks of its own, except what only it
 * can see: a GPU that failed to start, a target out of range in device memory). The
 * ampc__k_<kernel> functions take a table entry's arguments; the wrappers further down
 * allocate their output on the input's device first.
 */
#include "backend/backend.h"

#include <math.h>
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

// ---------------------------------------------------------------------------------------------
// A kernel's tensor arguments, checked from a list

/* What an argument's dtype must be (k_arg.dtype): one named dtype (>= 0), or a float dtype its
   device holds, the first argument's, the device's statistics dtype (f32; f64 on a device
   that holds no f32: REF; also the dtype its optimizers update), or any (the table's check of
   the first argument's dtype: one the device holds). */
enum { ANY_FLOAT = -1, FIRST = -2, STAT = -3, ANY_DTYPE = -4 };

/* One tensor argument: NULL allowed unless NEED; numel -1: any size; SAME_FORMAT: in the first
   argument's memory format. */
enum { NEED = 1, SAME_FORMAT = 2 };
typedef struct {
    const ampc_tensor *t;
    const char *name;
    int dtype;
    int64_t numel;
    unsigned need;   /* NEED | SAME_FORMAT (true: NEED) */
} k_arg;

static bool float_on(ampc_dtype dt, ampc_device dev) {
    return (unsigned)dt < AMPC_DTYPE_COUNT && ampc__dt(dt)->is_float && ampc__device(dev)->dtypes[dt];
}

/* The device's table (kernel kern, the first argument's dtype), then every argument on the
   first one's device, of its dtype and size. */
static int check_args(ampc_kernel kern, const k_arg *a, int n) {
    const char *k = ampc__kernel_name(kern);
    const ampc_tensor *t0 = a[0].t;
    if (!t0) return ampc__err(AMPC_ERR_INVALID, "%s: %s missing", k, a[0].name);
    int rc = ampc__backend_check(kern, t0->dtype, t0->device);
    for (int i = 0; i < n && rc >= 0; i++) {
        const ampc_tensor *t = a[i].t;
        ampc_dtype want = a[i].dtype == FIRST ? t0->dtype : a[i].dtype == STAT ? ampc__device_float(t0->device) : (ampc_dtype)a[i].dtype;
        if (!t)
            rc = a[i].need & NEED ? ampc__err(AMPC_ERR_INVALID, "%s: %s missing", k, a[i].name) : AMPC_OK;
        else if (t->device != t0->device)
            rc = ampc__err(AMPC_ERR_INVALID, "%s: %s on %s, %s on %s", k, a[i].name, ampc_device_name(t->device), a[0].name,
                           ampc_device_name(t0->device));
        else if (a[i].dtype == ANY_DTYPE ? false : a[i].dtype == ANY_FLOAT ? !float_on(t->dtype, t->device) : t->dtype != want)
            rc = ampc__err(AMPC_ERR_DTYPE, "%s: %s is %s, expected %s", k, a[i].name, ampc_dtype_name(t->dtype),
                           a[i].dtype == ANY_FLOAT ? "a float dtype its device holds" : ampc_dtype_name(want));
        else if (a[i].numel >= 0 && t->numel != a[i].numel)
            rc = ampc__err(AMPC_ERR_SHAPE, "%s: %s has %lld elements, expected %lld", k, a[i].name, (long long)t->numel,
                           (long long)a[i].numel);
        else if ((a[i].need & SAME_FORMAT) && ampc__is_cl(t) != ampc__is_cl(t0))
            rc = ampc__err(AMPC_ERR_INVALID, "%s: %s and %s in different memory formats", k, a[0].name, a[i].name);
    }
    return rc;
}

#define ARGS(kern, ...)                                                                                               \
    (check_args(kern, (const k_arg[]){__VA_ARGS__}, (int)(sizeof((const k_arg[]){__VA_ARGS__}) / sizeof(k_arg))) < 0)

// ---------------------------------------------------------------------------------------------
// Elementwise: unary, binary, sum_to, expand

/* A 4-D channels-last tensor whose storage order differs from the contiguous one (C > 1 and
   H * W > 1): the kernels walk storage, so it goes only with tensors of its shape and format. */
static bool cl_order(const ampc_tensor *t) {
    return t && t->ndim == 4 && t->format == AMPC_CHANNELS_LAST && t->shape[1] > 1 && t->shape[2] * t->shape[3] > 1;
}

/* a and b are walked in one storage order */
static int check_order(ampc_kernel kern, const ampc_tensor *a, const ampc_tensor *b) {
    if ((cl_order(a) || cl_order(b)) && !(ampc__same_shape(a, b) && a->format == b->format))
        return ampc__err(AMPC_ERR_INVALID, "%s on channels-last tensors of different shapes or formats", ampc__kernel_name(kern));
    return AMPC_OK;
}

/* small's shape broadcasts to big's (right-aligned: each of small's dims 1 or equal, extra
   leading dims 1), and the two are walked in one storage order. */
static int check_walk(ampc_kernel kern, const ampc_tensor *small, const ampc_tensor *big) {
    bool ok = true;
    for (int j = 0; j < small->ndim - big->ndim; j++) ok = ok && small->shape[j] == 1;
    for (int i = 0; i < big->ndim; i++) {
        int j = small->ndim - big->ndim + i;
        int64_t d = j >= 0 ? small->shape[j] : 1;
        ok = ok && (d == 1 || d == big->shape[i]);
    }
    if (!ok) {
        char s1[96], s2[96];
        return ampc__err(AMPC_ERR_SHAPE, "%s: shape %s does not broadcast to %s", ampc__kernel_name(kern),
                         ampc__shape_str(small, s1, sizeof s1), ampc__shape_str(big, s2, sizeof s2));
    }
    return check_order(kern, small, big);
}

int ampc__k_unary_into(ampc_op op, const ampc_tensor *x, ampc_tensor *y, double alpha) {
    if (ampc_op_kind_of(op) != AMPC_KIND_UNARY) return ampc__err(AMPC_ERR_UNSUPPORTED, "unary: no kernel for %s", ampc_op_name(op));
    int dt = op == AMPC_OP_ADD_SCALAR && x->dtype == AMPC_I64 ? AMPC_I64 : ANY_FLOAT;   /* a counter where it lives */
    if (ARGS(AMPC_K_unary, {x, "x", dt, -1, true}, {y, "y", dt, x->numel, true}) || check_order(AMPC_K_unary, x, y) < 0)
        return ampc_last_status();
    return ampc__backend(x->device)->unary(op, x, y, alpha);
}

/* unary_backward's arguments: of x and y, the one the op table's backward-reads column names
   (the other becomes NULL, and must be there); gy, gx and it of one size and storage order,
   gx in gy's dtype. */
static int check_unary_backward(ampc_op op, const ampc_tensor **x, const ampc_tensor **y, const ampc_tensor *gy,
                                const ampc_tensor *gx) {
    if (ampc_op_kind_of(op) != AMPC_KIND_UNARY)
        return ampc__err(AMPC_ERR_UNSUPPORTED, "unary_backward: no kernel for %s", ampc_op_name(op));
    ampc_backward_reads reads = ampc_op_backward_reads(op);
    if (reads != AMPC_READS_X) *x = NULL;
    if (reads != AMPC_READS_Y) *y = NULL;
    const ampc_tensor *v = *x ? *x : *y;
    if (reads != AMPC_READS_NONE && !v)
        return ampc__err(AMPC_ERR_INVALID, "unary_backward of %s needs its saved %s", ampc_op_name(op),
                         reads == AMPC_READS_X ? "input" : "output");
    if (ARGS(AMPC_K_unary_backward, {gy, "gy", ANY_FLOAT, -1, true}, {gx, "gx", FIRST, gy->numel, true},
             {v, reads == AMPC_READS_X ? "x" : "y", ANY_FLOAT, gy->numel, false}) ||
        check_order(AMPC_K_unary_backward, gy, gx) < 0 || (v && check_order(AMPC_K_unary_backward, v, gx) < 0))
        return ampc_last_status();
    return AMPC_OK;
}

int ampc__k_binary_into(ampc_op op, const ampc_tensor *a, const ampc_tensor *b, ampc_tensor *out) {
    if (ampc_op_kind_of(op) != AMPC_KIND_BINARY) return ampc__err(AMPC_ERR_UNSUPPORTED, "binary: no kernel for %s", ampc_op_name(op));
    if (ARGS(AMPC_K_binary, {out, "out", ANY_FLOAT, -1, true}, {a, "a", FIRST, -1, true}, {b, "b", FIRST, -1, true}) ||
        check_walk(AMPC_K_binary, a, out) < 0 || check_walk(AMPC_K_binary, b, out) < 0)
        return ampc_last_status();
    return ampc__backend(out->device)->binary(op, a, b, out);
}

/* out in x's dtype or f32 (a 16-bit bias gradient summed straight into fp32) */
static int sum_to_into(const ampc_tensor *x, ampc_tensor *out, double alpha) {
    if (ARGS(AMPC_K_sum_to, {x, "x", ANY_FLOAT, -1, true}, {out, "out", out->dtype == AMPC_F32 ? AMPC_F32 : FIRST, -1, true}) ||
        check_walk(AMPC_K_sum_to, out, x) < 0)
        return ampc_last_status();
    return ampc__backend(x->device)->sum_to(x, out, alpha);
}

static int expand_into(const ampc_tensor *x, ampc_tensor *out, double alpha) {
    if (ARGS(AMPC_K_expand, {x, "x", ANY_FLOAT, -1, true}, {out, "out", FIRST, -1, true}) || check_walk(AMPC_K_expand, x, out) < 0)
        return ampc_last_status();
    return ampc__backend(x->device)->expand(x, out, alpha);
}

// ---------------------------------------------------------------------------------------------
// Softmax, cross-entropy, dropout

static int check_axis(ampc_kernel kern, const ampc_tensor *t, ampc_axis_desc ax) {
    if (ax.outer < 0 || ax.dim < 0 || ax.inner < 0 || ax.outer * ax.dim * ax.inner != t->numel)
        return ampc__err(AMPC_ERR_SHAPE, "%s: axis (%lld, %lld, %lld) does not cover %lld elements", ampc__kernel_name(kern),
                         (long long)ax.outer, (long long)ax.dim, (long long)ax.inner, (long long)t->numel);
    return AMPC_OK;
}

int ampc__k_softmax(const ampc_tensor *x, ampc_tensor *y, ampc_axis_desc ax, bool log) {
    if (ARGS(AMPC_K_softmax, {x, "x", ANY_FLOAT, -1, true}, {y, "y", ANY_FLOAT, x->numel, true}) || check_axis(AMPC_K_softmax, x, ax) < 0)
        return ampc_last_status();
    return ampc__backend(x->device)->softmax(x, y, ax, log);
}
int ampc__k_softmax_backward(const ampc_tensor *y, const ampc_tensor *gy, ampc_tensor *gx, ampc_axis_desc ax, bool log) {
    if (ARGS(AMPC_K_softmax_backward, {y, "y", ANY_FLOAT, -1, true}, {gy, "gy", ANY_FLOAT, y->numel, true}, {gx, "gx", FIRST, y->numel, true}) ||
        check_axis(AMPC_K_softmax_backward, y, ax) < 0)
        return ampc_last_status();
    return ampc__backend(y->device)->softmax_backward(y, gy, gx, ax, log);
}

/* logits (N, C) of a float dtype, targets (N) i64 on their device (the kernels check the
   targets' values, where they can read them), the per-sample or reduced tensor g (the loss,
   or its gradient gy: N values for reduction NONE, else 1) */
static int check_ce(ampc_kernel kern, const ampc_tensor *logits, const ampc_tensor *targets, const ampc_cross_entropy_options *o,
                    const ampc_tensor *g, const char *g_name, const ampc_tensor *gx) {
    const char *k = ampc__kernel_name(kern);
    if (!o) return ampc__err(AMPC_ERR_INVALID, "%s: no options", k);
    int64_t N = logits->ndim == 2 ? logits->shape[0] : -1;
    if (ARGS(kern, {logits, "logits", ANY_FLOAT, -1, true}, {targets, "targets", AMPC_I64, N, true},
             {g, g_name, ANY_FLOAT, o->reduction == AMPC_REDUCTION_NONE ? N : 1, true}, {gx, "gx", ANY_FLOAT, logits->numel, false}))
        return ampc_last_status();
    if (logits->ndim != 2 || targets->ndim != 1)
        return ampc__err(AMPC_ERR_SHAPE, "%s: logits must be (N, C) and targets (N)", k);
    return AMPC_OK;
}

int ampc__k_cross_entropy(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_cross_entropy_options *o,
                          ampc_tensor *out, double *weight_out) {
    if (check_ce(AMPC_K_cross_entropy, logits, targets, o, out, "out", NULL) < 0) return ampc_last_status();
    return ampc__backend(logits->device)->cross_entropy(logits, targets, o, out, weight_out);
}
int ampc__k_cross_entropy_backward(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_tensor *gy,
                                   const ampc_cross_entropy_options *o, double weight, ampc_tensor *gx) {
    if (!gx) return ampc__err(AMPC_ERR_INVALID, "cross_entropy_backward: gx missing");
    if (check_ce(AMPC_K_cross_entropy_backward, logits, targets, o, gy, "gy", gx) < 0) return ampc_last_status();
    return ampc__backend(logits->device)->cross_entropy_backward(logits, targets, gy, o, weight, gx);
}

static int check_dropout(ampc_kernel kern, const ampc_tensor *x, const ampc_tensor *y, const uint8_t *mask, double p) {
    if (ARGS(kern, {x, "x", ANY_FLOAT, -1, true}, {y, "y", ANY_FLOAT, x->numel, true}) || check_order(kern, x, y) < 0)
        return ampc_last_status();
    if (!mask && x->numel) return ampc__err(AMPC_ERR_INVALID, "%s: no mask", ampc__kernel_name(kern));
    if (!(p >= 0 && p <= 1)) return ampc__err(AMPC_ERR_INVALID, "%s: probability %g outside [0, 1]", ampc__kernel_name(kern), p);
    return AMPC_OK;
}
int ampc__k_dropout(const ampc_tensor *x, ampc_tensor *y, uint8_t *mask, double p, ampc_rng_state rng) {
    return check_dropout(AMPC_K_dropout, x, y, mask, p) < 0 ? ampc_last_status() : ampc__backend(x->device)->dropout(x, y, mask, p, rng);
}
int ampc__k_dropout_backward(const ampc_tensor *gy, const uint8_t *mask, double p, ampc_tensor *gx) {
    return check_dropout(AMPC_K_dropout_backward, gy, gx, mask, p) < 0 ? ampc_last_status()
                                                                       : ampc__backend(gy->device)->dropout_backward(gy, mask, p, gx);
}

// ---------------------------------------------------------------------------------------------
// The GradScaler's and the optimizers' kernels

/* grads (NULL entries skipped) on the first one's device, each of a float dtype it holds */
int ampc__k_unscale_check(ampc_tensor **grads, int n, float inv_scale, float *found_inf) {
    const ampc_tensor *g0 = NULL;
    for (int i = 0; i < n && !g0; i++) g0 = grads[i];
    if (!g0) return AMPC_OK;
    for (int i = 0; i < n; i++)
        if (ARGS(AMPC_K_unscale_check, {g0, "the first gradient", ANY_FLOAT, -1, true}, {grads[i], "a gradient", ANY_FLOAT, -1, false}))
            return ampc_last_status();
    return ampc__backend(g0->device)->unscale_check(grads, n, inv_scale, found_inf);
}
int ampc__k_sum_squares(const ampc_tensor *t, double *out) {
    return ARGS(AMPC_K_sum_squares, {t, "t", ANY_FLOAT, -1, true}) ? ampc_last_status() : ampc__backend(t->device)->sum_squares(t, out);
}

/* What every item needs: param and grad of the device's master dtype and one size, a part
   inside the parameter, state of the part's size, a 16-bit copy of the parameter's shape and
   format (whole parameters only); every tensor on the first item's device. */
static int check_item(ampc_kernel kern, const ampc_optim_item *it, const ampc_tensor *p0) {
    const char *k = ampc__kernel_name(kern);
    if (!it->param || !it->grad) return ampc__err(AMPC_ERR_INVALID, "%s: an item without parameter or grad", k);
    const int64_t n = ampc__item_count(it);
    if (it->begin < 0 || it->count < 0 || it->begin > it->param->numel - it->count || (it->count == 0 && it->begin != 0))
        return ampc__err(AMPC_ERR_SHAPE, "%s: part [%lld, +%lld) of a parameter of %lld elements", k, (long long)it->begin,
                         (long long)it->count, (long long)it->param->numel);
    const ampc_tensor *out = it->cast_out;
    if (out && it->count) return ampc__err(AMPC_ERR_INVALID, "%s: a part of a parameter has no 16-bit copy to write", k);
    if (out && out->dtype != AMPC_F16 && out->dtype != AMPC_BF16)
        return ampc__err(AMPC_ERR_DTYPE, "%s: the parameter's 16-bit copy is %s, not f16/bf16", k, ampc_dtype_name(out->dtype));
    if (out && out->format != it->param->format)
        return ampc__err(AMPC_ERR_SHAPE, "%s: the parameter's 16-bit copy has another memory format", k);
    return check_args(kern,
                      (const k_arg[]){{p0, "parameter 0", STAT, -1, true}, {it->param, "parameter", STAT, -1, true},
                                      {it->grad, "grad", STAT, it->param->numel, true}, {it->state[0], "state 0", STAT, n, false},
                                      {it->state[1], "state 1", STAT, n, false}, {it->state[2], "state 2", STAT, n, false},
                                      {out, "16-bit copy", out ? (int)out->dtype : ANY_FLOAT, it->param->numel, false}},
                      7);
}

int ampc__k_sgd_step(const ampc_optim_item *items, int n, const ampc_sgd_hparams *h) {
    for (int i = 0; i < n; i++) {
        if (check_item(AMPC_K_sgd_step, &items[i], items[0].param) < 0) return ampc_last_status();
        if (h->momentum != 0 && !items[i].state[0]) return ampc__err(AMPC_ERR_INVALID, "SGD with momentum needs a buffer");
    }
    return n <= 0 ? AMPC_OK : ampc__backend(items[0].param->device)->sgd_step(items, n, h);
}
int ampc__k_adam_step(const ampc_optim_item *items, int n, const ampc_adam_hparams *h) {
    for (int i = 0; i < n; i++) {
        const ampc_optim_item *it = &items[i];
        if (check_item(AMPC_K_adam_step, it, items[0].param) < 0) return ampc_last_status();
        if (!it->state[0] || !it->state[1]) return ampc__err(AMPC_ERR_INVALID, "Adam needs exp_avg and exp_avg_sq");
        if (h->amsgrad && !it->state[2]) return ampc__err(AMPC_ERR_INVALID, "amsgrad needs max_exp_avg_sq");
        if (it->step < 1) return ampc__err(AMPC_ERR_INVALID, "Adam step %lld (steps count from 1)", (long long)it->step);
    }
    return n <= 0 ? AMPC_OK : ampc__backend(items[0].param->device)->adam_step(items, n, h);
}

// ---------------------------------------------------------------------------------------------
// Matrix products

/* elements a (batch, rows, cols) operand spans with batch stride s */
static int64_t extent(int64_t batch, int64_t s, int64_t rows, int64_t cols) { return (batch - 1) * s + rows * cols; }

/* a, b and bias of one float dtype, c too or f32 for 16-bit operands without bias (the
   unrounded accumulator); sizes and strides not negative, a batched output not broadcast,
   every tensor at least as large as the descriptor reaches */
static int check_gemm(const ampc_gemm_desc *d, const ampc_tensor *a, const ampc_tensor *b, const ampc_tensor *bias,
                      const ampc_tensor *c) {
    bool wide = c && c->dtype == AMPC_F32 && (a->dtype == AMPC_F16 || a->dtype == AMPC_BF16) && !bias;
    if (ARGS(AMPC_K_gemm, {a, "a", ANY_FLOAT, -1, true}, {b, "b", FIRST, -1, true}, {c, "c", wide ? AMPC_F32 : FIRST, -1, true},
             {bias, "bias", FIRST, -1, false}))
        return ampc_last_status();
    if (d->batch < 0 || d->M < 0 || d->N < 0 || d->K < 0 || d->stride_a < 0 || d->stride_b < 0 || d->stride_c < 0)
        return ampc__err(AMPC_ERR_INVALID, "gemm: negative size or stride");
    if (d->batch == 0 || d->M == 0 || d->N == 0) return AMPC_OK;
    if (d->batch > 1 && d->stride_c == 0) return ampc__err(AMPC_ERR_INVALID, "gemm: output batch stride 0");
    if ((d->K && (a->numel < extent(d->batch, d->stride_a, d->M, d->K) || b->numel < extent(d->batch, d->stride_b, d->K, d->N))) ||
        c->numel < extent(d->batch, d->stride_c, d->M, d->N) || (bias && bias->numel < d->N))
        return ampc__err(AMPC_ERR_INVALID, "gemm: a tensor is smaller than the descriptor (batch %lld, M %lld, N %lld, K %lld)",
                         (long long)d->batch, (long long)d->M, (long long)d->N, (long long)d->K);
    return AMPC_OK;
}

static int gemm_into(const ampc_gemm_desc *d, const ampc_tensor *a, const ampc_tensor *b, const ampc_tensor *bias, ampc_tensor *c) {
    return check_gemm(d, a, b, bias, c) < 0 ? ampc_last_status() : ampc__backend(a->device)->gemm(d, a, b, bias, c);
}

// ---------------------------------------------------------------------------------------------
// Convolution, pooling, batch norm, layer norm, copy_block

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
enum { BN_MAX_ARGS = 8 };

/* Batch norm's arguments, every variant on every device, through check_args: x (N, C, ...) of a
   float dtype held by its device; the tensors shaped as x in x's dtype, size and memory format;
   the per-channel ones in the device's statistics dtype; all on x's device. Then a forward in
   evaluation mode needs running statistics, one in training values per channel. */
static int check_bn(ampc_kernel kern, const ampc_tensor *x, const bn_arg *a, int n, bool forward, bool training) {
    const char *k = ampc__kernel_name(kern);
    int rc = ampc__backend_check(kern, x->dtype, x->device);
    if (rc < 0) return rc;
    if (x->ndim < 2) return ampc__err(AMPC_ERR_SHAPE, "%s: x needs at least 2 dimensions (N, C, ...)", k);
    const int64_t C = x->shape[1], M = x->numel / (C ? C : 1);
    if (n > BN_MAX_ARGS) return ampc__err(AMPC_ERR_STATE, "%s: %d arguments, more than check_bn holds (%d)", k, n, BN_MAX_ARGS);
    k_arg args[1 + BN_MAX_ARGS] = {{x, "x", ANY_FLOAT, -1, NEED}};
    for (int i = 0; i < n; i++)
        args[1 + i] = (k_arg){a[i].t, a[i].name, a[i].rows ? STAT : FIRST, a[i].rows ? a[i].rows * C : x->numel,
                              (a[i].need ? NEED : 0u) | (a[i].rows ? 0u : SAME_FORMAT)};
    if (check_args(kern, args, 1 + n) < 0) return ampc_last_status();
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
/* Layer norm's x viewed as (rows, cols), rows the statistics' length. */
static int ln_dims(ampc_kernel kern, const ampc_tensor *x, const ampc_tensor *mean, int64_t *rows, int64_t *cols) {
    if (!mean) return ampc__err(AMPC_ERR_INVALID, "%s: mean missing", ampc__kernel_name(kern));
    *rows = mean->numel;
    if (*rows == 0 ? x->numel != 0 : x->numel % *rows != 0)
        return ampc__err(AMPC_ERR_SHAPE, "%s: %lld elements do not make %lld rows", ampc__kernel_name(kern), (long long)x->numel,
                         (long long)*rows);
    *cols = *rows ? x->numel / *rows : 0;
    return AMPC_OK;
}

int ampc__k_layer_norm(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias, ampc_tensor *y,
                       ampc_tensor *mean, ampc_tensor *rstd, double eps) {
    int64_t rows, cols;
    if (ln_dims(AMPC_K_layer_norm, x, mean, &rows, &cols) < 0 ||
        ARGS(AMPC_K_layer_norm, {x, "x", ANY_FLOAT, -1, true}, {y, "y", ANY_FLOAT, x->numel, true},
             {weight, "weight", ANY_FLOAT, cols, false}, {bias, "bias", ANY_FLOAT, cols, false}, {mean, "mean", STAT, rows, true},
             {rstd, "rstd", STAT, rows, false}) ||
        check_order(AMPC_K_layer_norm, x, y) < 0)
        return ampc_last_status();
    return ampc__backend(x->device)->layer_norm(x, weight, bias, y, mean, rstd, eps);
}
int ampc__k_layer_norm_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                const ampc_tensor *mean, const ampc_tensor *rstd, ampc_tensor *gx, ampc_tensor *gw,
                                ampc_tensor *gb) {
    int64_t rows, cols, n = x->numel;
    if (ln_dims(AMPC_K_layer_norm_backward, x, mean, &rows, &cols) < 0 ||
        ARGS(AMPC_K_layer_norm_backward, {x, "x", ANY_FLOAT, -1, true}, {gy, "gy", FIRST, n, true}, {gx, "gx", FIRST, n, false},
             {weight, "weight", ANY_FLOAT, cols, false}, {mean, "mean", STAT, rows, true}, {rstd, "rstd", STAT, rows, true},
             {gw, "gw", ANY_FLOAT, cols, false}, {gb, "gb", ANY_FLOAT, cols, false}) ||
        check_order(AMPC_K_layer_norm_backward, x, gy) < 0 || (gx && check_order(AMPC_K_layer_norm_backward, x, gx) < 0))
        return ampc_last_status();
    return ampc__backend(x->device)->layer_norm_backward(x, gy, weight, mean, rstd, gx, gw, gb);
}
/* permute: x and y of one dtype on one device, contiguous, perm a permutation of x's dims and
   y of the permuted shape */
int ampc__k_permute(const ampc_tensor *x, const int *perm, ampc_tensor *y) {
    if (ARGS(AMPC_K_permute, {x, "x", ANY_DTYPE, -1, true}, {y, "y", FIRST, x->numel, true})) return ampc_last_status();
    if (!perm || y->ndim != x->ndim) return ampc__err(AMPC_ERR_SHAPE, "permute: %d dims into %d", x->ndim, y->ndim);
    unsigned seen = 0;
    for (int i = 0; i < x->ndim; i++) {
        if (perm[i] < 0 || perm[i] >= x->ndim || (seen >> perm[i] & 1u))
            return ampc__err(AMPC_ERR_INVALID, "permute: dims are not a permutation of 0..%d", x->ndim - 1);
        seen |= 1u << perm[i];
        if (y->shape[i] != x->shape[perm[i]]) return ampc__err(AMPC_ERR_SHAPE, "permute: y's dim %d is not x's dim %d", i, perm[i]);
    }
    if (ampc__is_cl(x) || ampc__is_cl(y)) return ampc__err(AMPC_ERR_INVALID, "permute of a channels-last tensor (the op converts it)");
    return ampc__backend(x->device)->permute(x, perm, y);
}

/* The additive mask's layout in the descriptor: leading dims that make the batch, strides not
   negative, and the largest offset it reads inside the mask */
static int check_attention_mask(ampc_kernel kern, const ampc_attn_desc *d, const ampc_tensor *mask) {
    int64_t heads = 1, last = (d->Tq ? d->Tq - 1 : 0) * d->mask_si + (d->Tk ? d->Tk - 1 : 0) * d->mask_sj;
    bool bad = d->nlead < 0 || d->nlead > AMPC_MAX_DIMS || d->mask_si < 0 || d->mask_sj < 0;
    for (int i = 0; !bad && i < d->nlead; i++) {
        bad = d->lead[i] < 0 || d->mask_lead[i] < 0;
        heads *= d->lead[i];
        last += (d->lead[i] ? d->lead[i] - 1 : 0) * d->mask_lead[i];
    }
    if (bad || heads != d->batch)
        return ampc__err(AMPC_ERR_INVALID, "%s: the mask's layout does not describe %lld heads", ampc__kernel_name(kern),
                         (long long)d->batch);
    if (d->batch && d->Tq && d->Tk && last >= mask->numel)
        return ampc__err(AMPC_ERR_SHAPE, "%s: the mask has %lld elements, its layout reads element %lld", ampc__kernel_name(kern),
                         (long long)mask->numel, (long long)last);
    return AMPC_OK;
}

/* Attention: q, k, v, o (and the gradients) of one float dtype and the descriptor's sizes (one
   tensor for q, k, v when packed), lse, the mask and dmask in the statistics dtype, all on q's
   device, the sizes not negative, a scale that is finite and a dropout probability in [0, 1]. */
static int check_attention(ampc_kernel kern, const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k,
                           const ampc_tensor *v, const ampc_tensor *mask, const ampc_tensor *o, const ampc_tensor *lse,
                           const ampc_tensor *dout, const ampc_tensor *dq, const ampc_tensor *dk, const ampc_tensor *dv,
                           const ampc_tensor *dmask) {
    if (!d || d->batch < 0 || d->Tq < 0 || d->Tk < 0 || d->E < 0 || d->Ev < 0 || !isfinite(d->scale) ||
        !(d->dropout >= 0 && d->dropout <= 1))
        return ampc__err(AMPC_ERR_INVALID, "%s: invalid descriptor", ampc__kernel_name(kern));
    const int64_t b = d->batch, no = b * d->Tq * d->Ev;
    int64_t nq = b * d->Tq * d->E, nk = b * d->Tk * d->E, nv = b * d->Tk * d->Ev;
    bool bwd = kern == AMPC_K_attention_backward;
    if (d->packed) {   /* one tensor (3, batch, T, E) for q, k, v, and one for dq, dk, dv */
        if (d->Tq != d->Tk || d->E != d->Ev || k != q || v != q || (bwd && (dk != dq || dv != dq)))
            return ampc__err(AMPC_ERR_INVALID, "%s: packed attention takes one tensor for q, k and v (and for their gradients), Tq = Tk, E = Ev",
                             ampc__kernel_name(kern));
        nq = nk = nv = 3 * nq;
    }
    if (ARGS(kern, {q, "q", ANY_FLOAT, nq, true}, {k, "k", FIRST, nk, true}, {v, "v", FIRST, nv, true}, {mask, "mask", STAT, -1, false},
             {o, "o", FIRST, no, !bwd}, {lse, "lse", STAT, b * d->Tq, bwd}, {dout, "dout", FIRST, no, bwd},
             {dq, "dq", FIRST, nq, bwd}, {dk, "dk", FIRST, nk, bwd}, {dv, "dv", FIRST, nv, bwd},
             {dmask, "dmask", STAT, b * d->Tq * d->Tk, false}))
        return ampc_last_status();
    if (dmask && !mask) return ampc__err(AMPC_ERR_INVALID, "%s: dmask without a mask", ampc__kernel_name(kern));
    if (mask && check_attention_mask(kern, d, mask) < 0) return ampc_last_status();
    const ampc_tensor *all[] = {q, k, v, mask, o, dout, dq, dk, dv};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        if (all[i] && ampc__is_cl(all[i])) return ampc__err(AMPC_ERR_INVALID, "%s on a channels-last tensor", ampc__kernel_name(kern));
    return AMPC_OK;
}
int ampc__k_attention(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                      const ampc_tensor *mask, ampc_tensor *o, ampc_tensor *lse) {
    if (check_attention(AMPC_K_attention, d, q, k, v, mask, o, lse, NULL, NULL, NULL, NULL, NULL) < 0) return ampc_last_status();
    return ampc__backend(q->device)->attention(d, q, k, v, mask, o, lse);
}
int ampc__k_attention_backward(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                               const ampc_tensor *mask, const ampc_tensor *lse, const ampc_tensor *dout, ampc_tensor *dq,
                               ampc_tensor *dk, ampc_tensor *dv, ampc_tensor *dmask) {
    if (check_attention(AMPC_K_attention_backward, d, q, k, v, mask, NULL, lse, dout, dq, dk, dv, dmask) < 0) return ampc_last_status();
    return ampc__backend(q->device)->attention_backward(d, q, k, v, mask, lse, dout, dq, dk, dv, dmask);
}

/* Embedding: w (V, D) of a float dtype, idx i64 on w's device, y (or gy) of idx's count of
   D-element rows (y in w's dtype), gw (V, D) in gy's dtype or f32. */
int ampc__k_embedding(const ampc_tensor *w, const ampc_tensor *idx, ampc_tensor *y) {
    int64_t D = w->ndim == 2 ? w->shape[1] : -1;
    if (ARGS(AMPC_K_embedding, {w, "weight", ANY_FLOAT, -1, true}, {idx, "indices", AMPC_I64, -1, true},
             {y, "y", FIRST, D < 0 ? -1 : idx->numel * D, true}))
        return ampc_last_status();
    if (D < 0) return ampc__err(AMPC_ERR_SHAPE, "embedding: weight must be 2-D (V, D), not %d-D", w->ndim);
    return ampc__backend(w->device)->embedding(w, idx, y);
}
int ampc__k_embedding_backward(const ampc_tensor *gy, const ampc_tensor *idx, ampc_tensor *gw) {
    int64_t D = gw && gw->ndim == 2 ? gw->shape[1] : -1;
    if (ARGS(AMPC_K_embedding_backward, {gy, "gy", ANY_FLOAT, D < 0 ? -1 : idx->numel * D, true},
             {idx, "indices", AMPC_I64, -1, true}, {gw, "gw", gw && gw->dtype == AMPC_F32 ? AMPC_F32 : FIRST, -1, true}))
        return ampc_last_status();
    if (D < 0) return ampc__err(AMPC_ERR_SHAPE, "embedding_backward: gw must be 2-D (V, D), not %d-D", gw->ndim);
    return ampc__backend(gy->device)->embedding_backward(gy, idx, gw);
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
    const ampc_tensor *cx = x, *cy = y;
    int rc = check_unary_backward(op, &cx, &cy, gy, gx);
    return finish_kernel(gx, rc < 0 ? rc : ampc__backend(gy->device)->unary_backward(op, cx, cy, gy, gx, alpha));
}

ampc_tensor *ampc__k_unary_backward_over(ampc_op op, ampc_tensor *x, ampc_tensor *y, ampc_tensor *gy, double alpha) {
    const ampc_tensor *cx = x, *cy = y;
    int rc = check_unary_backward(op, &cx, &cy, gy, gy);
    if (rc >= 0) rc = ampc__backend(gy->device)->unary_backward(op, cx, cy, gy, gy, alpha);
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
    if (out) out = finish_kernel(out, sum_to_into(x, out, alpha));
    ampc__release(x);
    return out;
}
ampc_tensor *ampc__k_expand(ampc_tensor *x_, int ndim, const int64_t *shape, double alpha) {
    ampc_memory_format fmt;
    ampc_tensor *x = shape_walk(x_, ndim, shape, &fmt);
    ampc_tensor *out = x ? ampc__tensor_new_fmt(x->dtype, x->device, ndim, shape, fmt) : NULL;
    if (out) out = finish_kernel(out, expand_into(x, out, alpha));
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
    return finish_kernel(c, gemm_into(d, a, b, bias, c));
}

ampc_tensor *ampc__k_gemm(const ampc_gemm_desc *d, ampc_tensor *a, ampc_tensor *b, ampc_tensor *bias, int ndim,
                          const int64_t *out_shape) {
    return ampc__k_gemm_as(d, a, b, bias, a->dtype, ndim, out_shape);
}

