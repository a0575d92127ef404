/*
 * elementwise.c - REF kernels: unary ops and their derivatives, broadcasting binary ops,
 * sum_to (broadcast-reduce) and expand, in f64 with plain loops. The oracle the CPU kernels
 * are tested against, so it favours the obvious formula over speed or cleverness.
 */
#include "backend/backend.h"

#include <math.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Broadcast indexing: every kernel walks one "iteration shape" in row-major order and reads
// or writes each tensor through strides that are 0 along its broadcast dims.

typedef struct {
    int nd;
    int64_t shape[AMPC_MAX_DIMS];
    int64_t idx[AMPC_MAX_DIMS];
} odometer;

/* Advances the multi-index by one element, updating the k offsets with their strides. */
static void odo_next(odometer *o, int k, int64_t *off, int64_t st[][AMPC_MAX_DIMS]) {
    for (int d = o->nd - 1; d >= 0; d--) {
        if (++o->idx[d] < o->shape[d]) {
            for (int j = 0; j < k; j++) off[j] += st[j][d];
            return;
        }
        for (int j = 0; j < k; j++) off[j] -= st[j][d] * (o->shape[d] - 1);
        o->idx[d] = 0;
    }
}

static void odo_init(odometer *o, int nd, const int64_t *shape) {
    o->nd = nd;
    memcpy(o->shape, shape, sizeof(int64_t) * (size_t)nd);
    memset(o->idx, 0, sizeof o->idx);
}

static const double *cdat(const ampc_tensor *t) { return t ? (const double *)ampc__data(t) : NULL; }

// ---------------------------------------------------------------------------------------------
// Unary

static const double inv_sqrt2 = 0.70710678118654752440, inv_sqrt2pi = 0.39894228040143267794;
static const double sqrt_2_pi = 0.79788456080286535588;   /* GELU's tanh approximation */

static double unary_f(ampc_op op, double x, double a) {
    switch (op) {
    case AMPC_OP_RELU: return x < 0 ? 0.0 : x;   /* NaN stays NaN, like torch.relu */
    case AMPC_OP_GELU: return 0.5 * x * (1.0 + erf(x * inv_sqrt2));
    case AMPC_OP_GELU_TANH: return 0.5 * x * (1.0 + tanh(sqrt_2_pi * (x + 0.044715 * x * x * x)));
    case AMPC_OP_TANH: return tanh(x);
    case AMPC_OP_SILU: return x / (1.0 + exp(-x));
    case AMPC_OP_SIGMOID: return 1.0 / (1.0 + exp(-x));
    case AMPC_OP_EXP: return exp(x);
    case AMPC_OP_LOG: return log(x);
    case AMPC_OP_POW: return pow(x, a);
    case AMPC_OP_MUL_SCALAR: return a * x;
    case AMPC_OP_ADD_SCALAR: return x + a;
    default: return NAN;
    }
}

static int ref_unary(ampc_op op, const ampc_tensor *x, ampc_tensor *y, double alpha) {
    if (x->dtype == AMPC_I64) {   /* add_scalar on a counter */
        for (int64_t i = 0; i < x->numel; i++) ((int64_t *)ampc__data(y))[i] = ((const int64_t *)ampc__data(x))[i] + (int64_t)alpha;
        return AMPC_OK;
    }
    const double *xp = cdat(x);
    double *yp = ampc__data(y);
    for (int64_t i = 0; i < x->numel; i++) yp[i] = unary_f(op, xp[i], alpha);
    return AMPC_OK;
}

/* f'(x) (or in terms of y = f(x) where that is how PyTorch computes it) */
static double unary_df(ampc_op op, double x, double y, double a) {
    switch (op) {
    case AMPC_OP_RELU: return x > 0 ? 1.0 : 0.0;
    case AMPC_OP_GELU: return 0.5 * (1.0 + erf(x * inv_sqrt2)) + x * inv_sqrt2pi * exp(-0.5 * x * x);
    case AMPC_OP_GELU_TANH: {
        double t = tanh(sqrt_2_pi * (x + 0.044715 * x * x * x));
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * sqrt_2_pi * (1.0 + 3.0 * 0.044715 * x * x);
    }
    case AMPC_OP_TANH: return 1.0 - y * y;
    case AMPC_OP_SILU: {
        double sg = 1.0 / (1.0 + exp(-x));
        return sg * (1.0 + x * (1.0 - sg));
    }
    case AMPC_OP_SIGMOID: return y * (1.0 - y);
    case AMPC_OP_EXP: return y;
    case AMPC_OP_LOG: return 1.0 / x;
    case AMPC_OP_POW: return a * pow(x, a - 1.0);
    case AMPC_OP_MUL_SCALAR: return a;
    case AMPC_OP_ADD_SCALAR: return 1.0;
    default: return NAN;   /* no kernel */
    }
}

/* Reads x or y, the one the op table's backward-reads column names (the door passes NULL for
   the other). */
static int ref_unary_backward(ampc_op op, const ampc_tensor *x, const ampc_tensor *y, const ampc_tensor *gy,
                              ampc_tensor *gx, double alpha) {
    const double *xp = cdat(x), *yp = cdat(y), *gp = cdat(gy);
    double *out = ampc__data(gx);
    if (op == AMPC_OP_RELU) {   /* y > 0 exactly when x > 0 */
        for (int64_t i = 0; i < gx->numel; i++) out[i] = yp[i] > 0 ? gp[i] : 0.0;
        return AMPC_OK;
    }
    for (int64_t i = 0; i < gx->numel; i++)
        out[i] = gp[i] * unary_df(op, xp ? xp[i] : 0.0, yp ? yp[i] : 0.0, alpha);
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Binary with broadcasting

static int ref_binary(ampc_op op, const ampc_tensor *a, const ampc_tensor *b, ampc_tensor *out) {
    int64_t st[2][AMPC_MAX_DIMS], off[2] = {0, 0};
    ampc__broadcast_strides(a, out->ndim, st[0]);
    ampc__broadcast_strides(b, out->ndim, st[1]);
    odometer o;
    odo_init(&o, out->ndim, out->shape);
    const double *ap = cdat(a), *bp = cdat(b);
    double *op_ = ampc__data(out);
    /* out may alias a (same shape): element i of a is read before out[i] is written */
    for (int64_t i = 0; i < out->numel; i++) {
        double x = ap[off[0]], y = bp[off[1]];
        op_[i] = op == AMPC_OP_ADD ? x + y : op == AMPC_OP_SUB ? x - y : x * y;
        odo_next(&o, 2, off, st);
    }
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// sum_to and expand

static int ref_sum_to(const ampc_tensor *x, ampc_tensor *out, double alpha) {
    /* walk x's shape (padded with leading 1s if out has more dims); out strides are 0 along
       the summed dims */
    int nd = x->ndim > out->ndim ? x->ndim : out->ndim;
    int64_t shape[AMPC_MAX_DIMS], st[1][AMPC_MAX_DIMS], off[1] = {0};
    for (int i = 0; i < nd; i++) {
        int j = x->ndim - nd + i;
        shape[i] = j >= 0 ? x->shape[j] : 1;
    }
    ampc__broadcast_strides(out, nd, st[0]);
    const double *xp = cdat(x);
    double *op = ampc__data(out);
    for (int64_t i = 0; i < out->numel; i++) op[i] = 0.0;
    odometer o;
    odo_init(&o, nd, shape);
    for (int64_t i = 0; i < x->numel; i++) {
        op[off[0]] += xp[i];
        odo_next(&o, 1, off, st);
    }
    for (int64_t i = 0; i < out->numel; i++) op[i] *= alpha;
    return AMPC_OK;
}

static int ref_expand(const ampc_tensor *x, ampc_tensor *out, double alpha) {
    int64_t st[1][AMPC_MAX_DIMS], off[1] = {0};
    ampc__broadcast_strides(x, out->ndim, st[0]);
    const double *xp = cdat(x);
    double *op = ampc__data(out);
    odometer o;
    odo_init(&o, out->ndim, out->shape);
    for (int64_t i = 0; i < out->numel; i++) {
        op[i] = alpha * xp[off[0]];
        odo_next(&o, 1, off, st);
    }
    return AMPC_OK;
}

void ampc__ref_register_elementwise(ampc_backend *be) {
    be->unary = ref_unary;
    be->unary_backward = ref_unary_backward;
    be->binary = ref_binary;
    be->sum_to = ref_sum_to;
    be->expand = ref_expand;
}
