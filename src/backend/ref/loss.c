/*
 * loss.c - REF kernels of softmax / log-softmax and cross-entropy: the textbook formulas in f64,
 * one element at a time, the oracle of the CPU kernels (src/backend/cpu/loss.c).
 */
#include "backend/backend.h"

#include <math.h>

// ---------------------------------------------------------------------------------------------
// Softmax: x viewed as (outer, dim, inner); element (o, d, i) at (o * dim + d) * inner + i.

static int ref_softmax(const ampc_tensor *x, ampc_tensor *y, ampc_axis_desc ax, bool is_log) {
    const double *xp = ampc__data(x);
    double *yp = ampc__data(y);
    for (int64_t o = 0; o < ax.outer; o++)
        for (int64_t i = 0; i < ax.inner; i++) {
            const double *xr = xp + o * ax.dim * ax.inner + i;
            double *yr = yp + o * ax.dim * ax.inner + i;
            double m = -INFINITY, s = 0;
            for (int64_t d = 0; d < ax.dim; d++) m = xr[d * ax.inner] > m ? xr[d * ax.inner] : m;
            for (int64_t d = 0; d < ax.dim; d++) s += exp(xr[d * ax.inner] - m);
            for (int64_t d = 0; d < ax.dim; d++) {
                double v = xr[d * ax.inner] - m;
                yr[d * ax.inner] = is_log ? v - log(s) : exp(v) / s;
            }
        }
    return AMPC_OK;
}

static int ref_softmax_backward(const ampc_tensor *y, const ampc_tensor *gy, ampc_tensor *gx, ampc_axis_desc ax,
                                bool is_log) {
    const double *yp = ampc__data(y), *gp = ampc__data(gy);
    double *xp = ampc__data(gx);
    for (int64_t o = 0; o < ax.outer; o++)
        for (int64_t i = 0; i < ax.inner; i++) {
            int64_t at = o * ax.dim * ax.inner + i;
            double s = 0;
            /* softmax: d/dx_j = y_j (g_j - sum_k g_k y_k); log-softmax: g_j - exp(y_j) sum_k g_k */
            for (int64_t d = 0; d < ax.dim; d++) {
                int64_t k = at + d * ax.inner;
                s += is_log ? gp[k] : gp[k] * yp[k];
            }
            for (int64_t d = 0; d < ax.dim; d++) {
                int64_t k = at + d * ax.inner;
                xp[k] = is_log ? gp[k] - exp(yp[k]) * s : yp[k] * (gp[k] - s);
            }
        }
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy: loss_i = (1 - eps) * (-logp_{i,t_i}) + eps * mean_c(-logp_{i,c})

/* log(sum_c exp(x_c)), max-subtracted */
static double logsumexp(const double *x, int64_t C) {
    double m = -INFINITY, s = 0;
    for (int64_t c = 0; c < C; c++) m = x[c] > m ? x[c] : m;
    for (int64_t c = 0; c < C; c++) s += exp(x[c] - m);
    return m + log(s);
}

static int ref_cross_entropy(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_cross_entropy_options *o,
                             ampc_tensor *out, double *weight_out) {
    int64_t count;
    int rc = ampc__host_ce_targets(logits, targets, o, &count);
    if (rc < 0) return rc;
    int64_t N = logits->shape[0], C = logits->shape[1];
    if (weight_out) *weight_out = (double)count;
    const double *x = ampc__data(logits);
    const int64_t *tg = ampc__data(targets);
    double *op = ampc__data(out), eps = o->label_smoothing, sum = 0;
    for (int64_t i = 0; i < N; i++) {
        double loss = 0;
        if (tg[i] != o->ignore_index) {
            const double *xr = x + i * C;
            double lse = logsumexp(xr, C), smooth = 0;
            for (int64_t c = 0; c < C; c++) smooth += lse - xr[c];
            loss = (1 - eps) * (lse - xr[tg[i]]) + eps * smooth / (double)C;
        }
        if (o->reduction == AMPC_REDUCTION_NONE) op[i] = loss;
        sum += loss;
    }
    if (o->reduction == AMPC_REDUCTION_SUM) op[0] = sum;
    if (o->reduction == AMPC_REDUCTION_MEAN) op[0] = count ? sum / (double)count : NAN;
    return AMPC_OK;
}

static int ref_cross_entropy_backward(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_tensor *gy,
                                      const ampc_cross_entropy_options *o, double weight, ampc_tensor *gx) {
    int64_t count;
    int rc = ampc__host_ce_targets(logits, targets, o, &count);
    if (rc < 0) return rc;
    int64_t N = logits->shape[0], C = logits->shape[1];
    bool none = o->reduction == AMPC_REDUCTION_NONE;
    const double *x = ampc__data(logits), *g = ampc__data(gy);
    const int64_t *tg = ampc__data(targets);
    double *gp = ampc__data(gx), eps = o->label_smoothing;
    for (int64_t i = 0; i < N; i++) {
        const double *xr = x + i * C;
        double *gr = gp + i * C;
        if (tg[i] == o->ignore_index) {
            for (int64_t c = 0; c < C; c++) gr[c] = 0;
            continue;
        }
        double lse = logsumexp(xr, C), gi = g[none ? i : 0] / weight;
        for (int64_t c = 0; c < C; c++) {
            double q = eps / (double)C + (c == tg[i] ? 1 - eps : 0);
            gr[c] = (exp(xr[c] - lse) - q) * gi;
        }
    }
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------

void ampc__ref_register_loss(ampc_backend *be) {
    be->softmax = ref_softmax;
    be->softmax_backward = ref_softmax_backward;
    be->cross_entropy = ref_cross_entropy;
    be->cross_entropy_backward = ref_cross_entropy_backward;
}
