/*
 * norm.c - REF kernels of batch norm and layer norm: the textbook formulas in f64, one
 * element at a time (two-pass statistics), the oracle of the CPU kernels
 * (src/backend/cpu/norm.c).
 *
 *   batch norm: x (N, C, S...) per channel c over the M = N * S elements x[n, c, s];
 *               y = (x - mean) * invstd * w + b, invstd = 1 / sqrt(var + eps) with the biased
 *               variance; running stats r = (1 - m) r + m stat with the unbiased variance.
 *   layer norm: x viewed as (rows, cols), statistics per row, w/b per column.
 */
#include "backend/backend.h"

#include <math.h>

// ---------------------------------------------------------------------------------------------
// Checks

static int check_f64(const ampc_tensor *t, const char *kernel, const char *what) {
    if (t && t->dtype != AMPC_F64)
        return ampc__err(AMPC_ERR_DTYPE, "%s: %s is %s, the ref device computes in f64", kernel, what,
                         ampc_dtype_name(t->dtype));
    return AMPC_OK;
}

static int check_numel(const ampc_tensor *t, int64_t n, const char *kernel, const char *what) {
    if (t && t->numel != n)
        return ampc__err(AMPC_ERR_SHAPE, "%s: %s has %lld elements, expected %lld", kernel, what, (long long)t->numel,
                         (long long)n);
    return AMPC_OK;
}

/* Each tensor ts[i] (NULL allowed) is f64 with want[i] elements. */
static int check_all(const ampc_tensor *const *ts, const char *const *names, const int64_t *want, int n, const char *k) {
    int rc;
    for (int i = 0; i < n; i++)
        if ((rc = check_f64(ts[i], k, names[i])) < 0 || (rc = check_numel(ts[i], want[i], k, names[i])) < 0) return rc;
    return AMPC_OK;
}

/* x (N, C, S...) as N, C and S (the product of the trailing dims). */
static int bn_dims(const ampc_tensor *x, const char *kernel, int64_t *N, int64_t *C, int64_t *S) {
    if (x->ndim < 2) return ampc__err(AMPC_ERR_SHAPE, "%s: x needs at least 2 dimensions (N, C, ...)", kernel);
    *N = x->shape[0];
    *C = x->shape[1];
    *S = 1;
    for (int i = 2; i < x->ndim; i++) *S *= x->shape[i];
    return AMPC_OK;
}

static double at_or(const ampc_tensor *t, int64_t i, double dflt) { return t ? ((const double *)ampc__data(t))[i] : dflt; }

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
static int ref_bn(const char *k, const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                  ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *save_mean,
                  ampc_tensor *save_invstd, bool relu, ampc_tensor *stats, bool training, double momentum, double eps,
                  bool sync) {
    int64_t N = 0, C = 0, S = 0;
    int rc;
    if ((rc = bn_dims(x, k, &N, &C, &S)) < 0) return rc;
    const ampc_tensor *ts[] = {x, weight, bias, running_mean, running_var, y, save_mean, save_invstd, stats};
    const char *names[] = {"x", "weight", "bias", "running_mean", "running_var", "y", "save_mean", "save_invstd", "stats"};
    int64_t want[] = {x->numel, C, C, C, C, x->numel, C, C, AMPC_BN_RELU_STAT_ROWS * C};
    if ((rc = check_all(ts, names, want, 9, k)) < 0) return rc;
    double *st = stats ? ampc__data(stats) : NULL;
    if (!training && (!running_mean || !running_var))
        return ampc__err(AMPC_ERR_INVALID, "%s: evaluation needs running_mean and running_var", k);
    int64_t M = N * S;
    if (training && M < 1) return ampc__err(AMPC_ERR_INVALID, "%s: no values per channel", k);
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
    return ref_bn("batch_norm", x, weight, bias, running_mean, running_var, y, save_mean, save_invstd, false, NULL,
                  training, momentum, eps, sync);
}

static int ref_batch_norm_relu(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias,
                               ampc_tensor *running_mean, ampc_tensor *running_var, ampc_tensor *y, ampc_tensor *stats,
                               bool training, double momentum, double eps, bool sync) {
    return ref_bn("batch_norm_relu", x, weight, bias, running_mean, running_var, y, NULL, NULL, true, stats, training,
                  momentum, eps, sync);
}

/* With the fused ReLU, stats (the forward's mean, invstd, w, b): gy is first masked where the
   forward's output was not positive (relu's backward), recomputed by the forward's operations.
   Else save_mean / save_invstd. */
static int ref_bn_backward(const char *k, const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                           const ampc_tensor *save_mean, const ampc_tensor *save_invstd, const ampc_tensor *stats,
                           bool training, bool sync, ampc_tensor *gx, ampc_tensor *gw, ampc_tensor *gb) {
    int64_t N = 0, C = 0, S = 0;
    int rc;
    if ((rc = bn_dims(x, k, &N, &C, &S)) < 0) return rc;
    const ampc_tensor *ts[] = {x, gy, weight, save_mean, save_invstd, gx, gw, gb, stats};
    const char *names[] = {"x", "gy", "weight", "save_mean", "save_invstd", "gx", "gw", "gb", "stats"};
    int64_t n = x->numel;
    if ((rc = check_all(ts, names, (int64_t[]){n, n, C, C, C, n, C, C, AMPC_BN_RELU_STAT_ROWS * C}, 9, k)) < 0) return rc;
    if (!stats && (!save_mean || !save_invstd)) return ampc__err(AMPC_ERR_INVALID, "%s: statistics missing", k);
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
    return ref_bn_backward("batch_norm_backward", x, gy, weight, save_mean, save_invstd, NULL, training, sync, gx, gw, gb);
}

static int ref_batch_norm_relu_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                        const ampc_tensor *stats, bool training, bool sync, ampc_tensor *gx,
                                        ampc_tensor *gw, ampc_tensor *gb) {
    if (!stats) return ampc__err(AMPC_ERR_INVALID, "batch_norm_relu_backward: statistics missing");
    return ref_bn_backward("batch_norm_relu_backward", x, gy, weight, NULL, NULL, stats, training, sync, gx, gw, gb);
}

// ---------------------------------------------------------------------------------------------
// Layer norm

static int ref_layer_norm(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias, ampc_tensor *y,
                          ampc_tensor *mean, ampc_tensor *rstd, double eps) {
    const char *k = "layer_norm";
    int64_t rows = 0, cols = 0;
    int rc;
    if ((rc = ampc__layer_norm_dims(x, mean, "", k, &rows, &cols)) < 0) return rc;
    const ampc_tensor *ts[] = {x, weight, bias, y, mean, rstd};
    const char *names[] = {"x", "weight", "bias", "y", "mean", "rstd"};
    if ((rc = check_all(ts, names, (int64_t[]){x->numel, cols, cols, x->numel, rows, rows}, 6, k)) < 0) return rc;
    const double *xp = ampc__data(x);
    double *yp = ampc__data(y);
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = xp + r * cols;
        double s = 0, q = 0;
        for (int64_t i = 0; i < cols; i++) s += xr[i];
        double mu = s / (double)cols;
        for (int64_t i = 0; i < cols; i++) q += (xr[i] - mu) * (xr[i] - mu);
        double rs = 1 / sqrt(q / (double)cols + eps);
        ((double *)ampc__data(mean))[r] = mu;
        if (rstd) ((double *)ampc__data(rstd))[r] = rs;
        for (int64_t i = 0; i < cols; i++) yp[r * cols + i] = (xr[i] - mu) * rs * at_or(weight, i, 1) + at_or(bias, i, 0);
    }
    return AMPC_OK;
}

static int ref_layer_norm_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                   const ampc_tensor *mean, const ampc_tensor *rstd, ampc_tensor *gx, ampc_tensor *gw,
                                   ampc_tensor *gb) {
    const char *k = "layer_norm_backward";
    int64_t rows = 0, cols = 0;
    int rc;
    if ((rc = ampc__layer_norm_dims(x, mean, "", k, &rows, &cols)) < 0) return rc;
    const ampc_tensor *ts[] = {x, gy, weight, mean, rstd, gx, gw, gb};
    const char *names[] = {"x", "gy", "weight", "mean", "rstd", "gx", "gw", "gb"};
    int64_t n = x->numel;
    if ((rc = check_all(ts, names, (int64_t[]){n, n, cols, rows, rows, n, cols, cols}, 8, k)) < 0) return rc;
    if (!rstd) return ampc__err(AMPC_ERR_INVALID, "%s: rstd missing", k);
    const double *xp = ampc__data(x), *g = ampc__data(gy);
    double *gwp = gw ? ampc__data(gw) : NULL, *gbp = gb ? ampc__data(gb) : NULL;
    for (int64_t i = 0; i < cols; i++) {
        if (gwp) gwp[i] = 0;
        if (gbp) gbp[i] = 0;
    }
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = xp + r * cols, *gr = g + r * cols;
        double mu = at_or(mean, r, 0), rs = at_or(rstd, r, 1), a = 0, b = 0;   /* a = sum(gy w), b = sum(gy w xhat) */
        for (int64_t i = 0; i < cols; i++) {
            double xhat = (xr[i] - mu) * rs, gw_i = gr[i] * at_or(weight, i, 1);
            a += gw_i;
            b += gw_i * xhat;
            if (gwp) gwp[i] += gr[i] * xhat;
            if (gbp) gbp[i] += gr[i];
        }
        if (!gx) continue;
        double *o = (double *)ampc__data(gx) + r * cols, n = (double)cols;
        for (int64_t i = 0; i < cols; i++) {
            double xhat = (xr[i] - mu) * rs;
            o[i] = rs / n * (n * gr[i] * at_or(weight, i, 1) - a - xhat * b);
        }
    }
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------

void ampc__ref_register_norm(ampc_backend *be) {
    be->batch_norm = ref_batch_norm;
    be->batch_norm_backward = ref_batch_norm_backward;
    be->batch_norm_relu = ref_batch_norm_relu;
    be->batch_norm_relu_backward = ref_batch_norm_relu_backward;
    be->layer_norm = ref_layer_norm;
    be->layer_norm_backward = ref_layer_norm_backward;
}
