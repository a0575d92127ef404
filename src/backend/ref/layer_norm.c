/*
 * layer_norm.c - REF kernels of layer norm: the textbook formulas in f64, one element at a time
 * (two-pass statistics), the oracle of the CPU kernels (src/backend/cpu/layer_norm.c). x is
 * viewed as (rows, cols), statistics per row, w/b per column.
 */
#include "backend/ref/ref.h"

#include <math.h>

// ---------------------------------------------------------------------------------------------
// Layer norm

static int ref_layer_norm(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias, ampc_tensor *y,
                          ampc_tensor *mean, ampc_tensor *rstd, double eps) {
    int64_t rows, cols;
    ampc__layer_norm_dims(x, mean, &rows, &cols);
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
    int64_t rows, cols;
    ampc__layer_norm_dims(x, mean, &rows, &cols);
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

void ampc__ref_register_layer_norm(ampc_backend *be) {
    be->layer_norm = ref_layer_norm;
    be->layer_norm_backward = ref_layer_norm_backward;
}
