/*
 * batch_norm.c - REF kernels of batch norm (and batch norm + ReLU): the textbook formulas in
 * f64, one element at a time (two-pass statistics), the oracle of the CPU kernels
 * (src/backend/cpu/batch_norm.c).
 *
 *   x (N, C, S...) per channel c over the M = N * S elements x[n, c, s];
 *   y = (x - mean) * invstd * w + b, invstd = 1 / sqrt(var + eps) with the biased variance;
 *   running stats r = (1 - m) r + m stat with the unbiased variance.
 */
#include "backend/ref/ref.h"

#include <math.h>

// ---------------------------------------------------------------------------------------------
// Dimensions and workspace

/* x (N, C, S...) as N, C and S (the product of the trailing dims). */
static void bn_dims(const ampc_tensor *x, int64_t *N, int64_t *C, int64_t *S) {   /* the door checked x */
    *N = x->shape[0];
    *C = x->shape[1];
    *S = 1;
    for (int i = 2; i < x->ndim; i++) *S *= x->shape[i];
}

/* n doubles of workspace on the REF device (released with ws_put) */
static double *ws_get(int64_t n, size_t *bytes) {
    return ampc__alloc(AMPC_DEVICE_REF, (size_t)(n > 0 ? n : 1) * sizeof(double), AMPC_MEM_WORKSPACE, bytes);
}
static void ws_put(double *p, size_t bytes) {
    if (p) ampc__free(AMPC_DEVICE_REF, p, bytes, AMPC_MEM_WORKSPACE);
}

// ---------------------------------------------------------------------------------------------
// Batch norm

/* batch_norm, or batch_norm_relu when stats is given (relu): y = relu((x - mean) * invstd * w + b)
   and stats (AMPC_BN_RELU_STAT_ROWS, C) = mean, invstd, w, b, unused (what the backward's mask
   needs to recompute the pre-activation: the same f64 operations) */
static int ref_bn(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                  ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *save_mean,
                  ampc_tensor *save_invstd, bool relu, ampc_tensor *stats, bool training, double momentum, double eps,
                  bool sync) {
    int64_t N = 0, C = 0, S = 0;
    int rc;
    bn_dims(x, &N, &C, &S);
    double *st = stats ? ampc__data(stats) : NULL;
    int64_t M = N * S;
    const double *xp = ampc__data(x);
    double *yp = ampc__data(y);
    size_t ws_bytes = 0;
    double *bs = training ? ws_get(3 * C + 1, &ws_bytes) : NULL;   /* batch statistics, ampc__bn_sync_stats's layout */
    if (training && !bs) return ampc_last_status();
    for (int64_t c = 0; training && c < C; c++) {
        double s = 0, q = 0;
        for (int64_t n = 0; n < N; n++)
            for (int64_t i = 0; i < S; i++) s += xp[(n * C + c) * S + i];
        double mean = s / (double)M;
        for (int64_t n = 0; n < N; n++)
            for (int64_t i = 0; i < S; i++) {
                double d = xp[(n * C + c) * S + i] - mean;
                q += d * d;
            }
        bs[c] = mean;
        bs[C + 1 + c] = q;
    }
    if (training) {
        bs[C] = (double)M;
        if (sync && (rc = ampc__bn_sync_stats(C, bs)) < 0) {
            ws_put(bs, ws_bytes);
            return rc;
        }
        M = (int64_t)bs[C];   /* the world's count with sync */
    }
    for (int64_t c = 0; c < C; c++) {
        double mean, var;
        if (training) {
            double q = bs[C + 1 + c];
            mean = bs[c];
            var = q / (double)M;
            double unbiased = M > 1 ? q / (double)(M - 1) : NAN;   /* the op refuses M == 1 */
            if (running_mean) {
                double *rm = ampc__data(running_mean);
                rm[c] = (1 - momentum) * rm[c] + momentum * mean;
            }
            if (running_var) {
                double *rv = ampc__data(running_var);
                rv[c] = (1 - momentum) * rv[c] + momentum * unbiased;
            }
        } else {
            mean = at_or(running_mean, c, 0);
            var = at_or(running_var, c, 1);
        }
        double invstd = 1 / sqrt(var + eps), w = at_or(weight, c, 1), b = at_or(bias, c, 0);
        if (save_mean) ((double *)ampc__data(save_mean))[c] = mean;
        if (save_invstd) ((double *)ampc__data(save_invstd))[c] = invstd;
        if (st) st[c] = mean, st[C + c] = invstd, st[2 * C + c] = w, st[3 * C + c] = b, st[4 * C + c] = 0;
        for (int64_t n = 0; n < N; n++)
            for (int64_t i = 0; i < S; i++) {
                int64_t j = (n * C + c) * S + i;
                double v = (xp[j] - mean) * invstd * w + b;
                yp[j] = relu && v < 0 ? 0.0 : v;   /* NaN stays NaN, like ampc_relu */
            }
    }
    ws_put(bs, ws_bytes);
    return AMPC_OK;
}

static int ref_batch_norm(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                          ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *save_mean,
                          ampc_tensor *save_invstd, bool training, double momentum, double eps, bool sync) {
    return ref_bn(x, weight, bias, running_mean, running_var, y, save_mean, save_invstd, false, NULL,
                  training, momentum, eps, sync);
}

static int ref_batch_norm_relu(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                               ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *stats,
                               bool training, double momentum, double eps, bool sync) {
    return ref_bn(x, weight, bias, running_mean, running_var, y, NULL, NULL, true, stats, training,
                  momentum, eps, sync);
}

/* With the fused ReLU, stats (the forward's mean, invstd, w, b): gy is first masked where the
   forward's output was not positive (relu's backward), recomputed by the forward's operations.
   Else save_mean / save_invstd. */
static int ref_bn_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                           const ampc_tensor *save_mean, const ampc_tensor *save_invstd, const ampc_tensor *stats,
                           bool training, bool sync, ampc_tensor *gx, ampc_tensor *gw, ampc_tensor *gb) {
    int64_t N = 0, C = 0, S = 0;
    int rc;
    bn_dims(x, &N, &C, &S);
    int64_t n = x->numel;
    const double *xp = ampc__data(x), *gin = ampc__data(gy), *st = stats ? ampc__data(stats) : NULL;
    size_t gm_bytes = 0, ws_bytes = 0;
    double *gm = st ? ws_get(n, &gm_bytes) : NULL;   /* the masked gy */
    double *sums = ws_get(2 * C + 1, &ws_bytes);      /* sum(gy), sum(gy * xhat) per channel, the count */
    if ((st && !gm) || !sums) {
        ws_put(gm, gm_bytes);
        ws_put(sums, ws_bytes);
        return ampc_last_status();
    }
    const double *g = st ? gm : gin;
#define MEAN_INVSTD(c)                                                                          \
    double mean = st ? st[c] : at_or(save_mean, c, 0), invstd = st ? st[C + (c)] : at_or(save_invstd, c, 1)
    for (int64_t c = 0; c < C; c++) {
        MEAN_INVSTD(c);
        double sg = 0, sgx = 0;
        for (int64_t n = 0; st && n < N; n++)
            for (int64_t i = 0; i < S; i++) {
                int64_t j = (n * C + c) * S + i;
                gm[j] = (xp[j] - mean) * invstd * st[2 * C + c] + st[3 * C + c] > 0 ? gin[j] : 0.0;
            }
        for (int64_t n = 0; n < N; n++)
            for (int64_t i = 0; i < S; i++) {
                int64_t j = (n * C + c) * S + i;
                sg += g[j];
                sgx += g[j] * (xp[j] - mean) * invstd;
            }
        if (gw) ((double *)ampc__data(gw))[c] = sgx;   /* this process's own, with sync too */
        if (gb) ((double *)ampc__data(gb))[c] = sg;
        sums[c] = sg;
        sums[C + c] = sgx;
    }
    sums[2 * C] = (double)(N * S);
    rc = sync && training && gx ? ampc__bn_sync_sums(sums, 2 * C + 1) : AMPC_OK;
    double M = sums[2 * C];
    for (int64_t c = 0; rc >= 0 && gx && c < C; c++) {
        MEAN_INVSTD(c);
        double w = at_or(weight, c, 1), sg = sums[c], sgx = sums[C + c], *o = ampc__data(gx);
        for (int64_t n = 0; n < N; n++)
            for (int64_t i = 0; i < S; i++) {
                int64_t j = (n * C + c) * S + i;
                double xhat = (xp[j] - mean) * invstd;
                /* training: mean and variance depend on x too */
                o[j] = training ? w * invstd / M * (M * g[j] - sg - xhat * sgx) : g[j] * w * invstd;
            }
    }
#undef MEAN_INVSTD
    ws_put(gm, gm_bytes);
    ws_put(sums, ws_bytes);
    return rc;
}

static int ref_batch_norm_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                   const ampc_tensor *save_mean, const ampc_tensor *save_invstd, bool training,
                                   bool sync, ampc_tensor *gx, ampc_tensor *gw, ampc_tensor *gb) {
    return ref_bn_backward(x, gy, weight, save_mean, save_invstd, NULL, training, sync, gx, gw, gb);
}

static int ref_batch_norm_relu_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                        const ampc_tensor *stats, bool training, bool sync, ampc_tensor *gx,
                                        ampc_tensor *gw, ampc_tensor *gb) {
    return ref_bn_backward(x, gy, weight, NULL, NULL, stats, training, sync, gx, gw, gb);
}

// ---------------------------------------------------------------------------------------------

void ampc__ref_register_batch_norm(ampc_backend *be) {
    be->batch_norm = ref_batch_norm;
    be->batch_norm_backward = ref_batch_norm_backward;
    be->batch_norm_relu = ref_batch_norm_relu;
    be->batch_norm_relu_backward = ref_batch_norm_relu_backward;
}
