/*
 * layer_norm.c - CPU kernels of layer norm, written by hand (the f32 vector loops of norm.h,
 * OpenMP), for f32/f16/bf16 activations with f32 statistics: x viewed as (rows, cols), rows
 * split over threads and staged through f32 buffers; the weight/bias gradients are column sums
 * over fixed blocks of rows, combined in block order, so results do not depend on the number of
 * threads. Statistics and gradient sums accumulate in f64, the variance is the centred second
 * pass, as in batch_norm.c.
 */
#include "backend/cpu/norm.h"

// ---------------------------------------------------------------------------------------------
// Layer norm: x (rows, cols)

/* y = ((x - mh) - ml) * r * w + b: the mean as a float mh plus a remainder ml, so x - mh is
   exact for x near the mean (no precision lost to a large common offset). */
AMPC_CPU_VEC static void ln_apply(const float *x, float *y, size_t n, float mh, float ml, float r, const float *w,
                                const float *b) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) y[i] = ((x[i] - mh) - ml) * r * w[i] + b[i];
}

/* *a += sum(g w), *b += sum(g w xhat); gw_acc[i] += g xhat, gb_acc[i] += g (when not NULL) */
AMPC_CPU_VEC static void ln_grad_sums(const float *g, const float *x, const float *w, size_t n, double m, double r,
                                    double *a, double *b, double *gw_acc, double *gb_acc) {
    double sa = 0, sb = 0;
#pragma omp simd reduction(+ : sa, sb)
    for (size_t i = 0; i < n; i++) {
        double gw = (double)g[i] * (double)w[i], xhat = ((double)x[i] - m) * r;
        sa += gw;
        sb += gw * xhat;
    }
    if (gw_acc) {
#pragma omp simd
        for (size_t i = 0; i < n; i++) gw_acc[i] += (double)g[i] * (((double)x[i] - m) * r);
    }
    if (gb_acc) {
#pragma omp simd
        for (size_t i = 0; i < n; i++) gb_acc[i] += (double)g[i];
    }
    *a += sa;
    *b += sb;
}

/* gx = r w g + A (x - m) + B */
AMPC_CPU_VEC static void ln_grad_apply(const float *g, const float *x, const float *w, float *o, size_t n, float r, float m,
                                     float A, float B) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) o[i] = r * w[i] * g[i] + A * (x[i] - m) + B;
}

#define FOR_COL_CHUNKS(cols, r, j, i, len)                                                         \
    for (size_t j = 0, i = (size_t)((r) * (cols)), len;                                            \
         j < (size_t)(cols) && (len = min_sz(CHUNK, (size_t)(cols) - j), 1); j += len, i += len)


/* w and b (cols) as f32 arrays: the tensor's own f32 data, or converted into dst, or ones /
   zeros when absent. */
static const float *ln_param(const ampc_tensor *t, float *dst, int64_t cols, float dflt) {
    if (t && t->dtype == AMPC_F32) return ampc__data(t);
    if (t) ampc__dt(t->dtype)->to_f32(ampc__data(t), dst, (size_t)cols);
    else
        for (int64_t i = 0; i < cols; i++) dst[i] = dflt;
    return dst;
}

static int cpu_layer_norm(const ampc_tensor *x, const ampc_tensor *weight, const ampc_tensor *bias, ampc_tensor *y,
                          ampc_tensor *mean, ampc_tensor *rstd, double eps) {
    int64_t rows, cols;
    ampc__layer_norm_dims(x, mean, &rows, &cols);
    if (x->numel == 0) return AMPC_OK;
    ws_block wsb = {0};
    float *pbuf = ws_get(&wsb, 2 * (size_t)cols * sizeof(float));
    if (!pbuf) return ampc_last_status();
    const float *w = ln_param(weight, pbuf, cols, 1.0f), *b = ln_param(bias, pbuf + cols, cols, 0.0f);
    float *mp = ampc__data(mean), *rp = rstd ? ampc__data(rstd) : NULL;
    int nt = threads_for_items(rows, x->numel);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float bx[CHUNK], by[CHUNK];
        double s = 0, q = 0;
        FOR_COL_CHUNKS(cols, r, j, i, len) s += fns_f32.sum(ampc__cpu_load(x, i, len, bx), 1, 0, (int64_t)len);
        double mu = s / (double)cols;
        FOR_COL_CHUNKS(cols, r, j, i, len) q += fns_f32.sq_dev(ampc__cpu_load(x, i, len, bx), 1, 0, (int64_t)len, mu);
        double rs = 1 / sqrt(q / (double)cols + eps);
        mp[r] = (float)mu;
        if (rp) rp[r] = (float)rs;
        FOR_COL_CHUNKS(cols, r, j, i, len) {
            float *out = ampc__cpu_out(y, i, by);
            ln_apply(ampc__cpu_load(x, i, len, bx), out, len, (float)mu, (float)(mu - (double)(float)mu), (float)rs, w + j,
                     b + j);
            ampc__cpu_store(y, i, len, out);
        }
    }
    ws_put(&wsb);
    return AMPC_OK;
}

/* Stores acc (n doubles) into a float tensor of any CPU dtype, through f32. */
static void store_f64(ampc_tensor *t, const double *acc, float *tmp, int64_t n) {
    for (int64_t i = 0; i < n; i++) tmp[i] = (float)acc[i];
    if (t->dtype == AMPC_F32) memcpy(ampc__data(t), tmp, (size_t)n * sizeof(float));
    else ampc__dt(t->dtype)->from_f32(tmp, ampc__data(t), (size_t)n);
}

static int cpu_layer_norm_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *weight,
                                   const ampc_tensor *mean, const ampc_tensor *rstd, ampc_tensor *gx, ampc_tensor *gw,
                                   ampc_tensor *gb) {
    int64_t rows, cols, n = x->numel;
    ampc__layer_norm_dims(x, mean, &rows, &cols);
    int64_t nb = rows < ROW_BLOCKS ? (rows > 0 ? rows : 1) : ROW_BLOCKS;
    int64_t nacc = (gw ? 1 : 0) + (gb ? 1 : 0);
    ws_block wsb = {0};
    /* per-block column sums (nb, nacc, cols) doubles | weight and a store buffer (cols) floats */
    double *part = ws_get(&wsb, (size_t)(nb * nacc * cols) * sizeof(double) + 2 * (size_t)cols * sizeof(float));
    if (!part) return ampc_last_status();
    float *wbuf = (float *)(part + nb * nacc * cols), *tmp = wbuf + cols;
    const float *w = ln_param(weight, wbuf, cols, 1.0f), *mp = ampc__data(mean), *rp = ampc__data(rstd);
    int nt = threads_for_items(nb, n);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t bi = 0; bi < nb; bi++) {
        float bx[CHUNK], bg[CHUNK];
        double *gwa = gw ? part + bi * nacc * cols : NULL, *gba = gb ? part + (bi * nacc + (gw ? 1 : 0)) * cols : NULL;
        if (nacc) memset(part + bi * nacc * cols, 0, (size_t)(nacc * cols) * sizeof(double));
        int64_t r0, r1;
        row_block(rows, nb, bi, &r0, &r1);
        for (int64_t r = r0; r < r1; r++) {
            double m = mp[r], rs = rp[r], a = 0, b = 0;
            FOR_COL_CHUNKS(cols, r, j, i, len) {
                ln_grad_sums(ampc__cpu_load(gy, i, len, bg), ampc__cpu_load(x, i, len, bx), w + j, len, m, rs, &a, &b,
                             gwa ? gwa + j : NULL, gba ? gba + j : NULL);
            }
            if (!gx) continue;
            /* gx = rs (g w - a/n - xhat b/n) = rs w g + A (x - m) + B */
            double A = -rs * rs * b / (double)cols, B = -rs * a / (double)cols;
            FOR_COL_CHUNKS(cols, r, j, i, len) {
                const float *gp = ampc__cpu_load(gy, i, len, bg), *xp = ampc__cpu_load(x, i, len, bx);
                float *out = ampc__cpu_out(gx, i, bg);
                ln_grad_apply(gp, xp, w + j, out, len, (float)rs, mp[r], (float)A, (float)B);
                ampc__cpu_store(gx, i, len, out);
            }
        }
    }
    for (int t = 0; t < (int)nacc; t++) {   /* combine the blocks in order */
        double *acc = part + t * cols;
        for (int64_t bi = 1; bi < nb; bi++)
            for (int64_t i = 0; i < cols; i++) acc[i] += part[(bi * nacc + t) * cols + i];
        store_f64(t == 0 && gw ? gw : gb, acc, tmp, cols);
    }
    ws_put(&wsb);
    return AMPC_OK;
}


void ampc__cpu_register_layer_norm(ampc_backend *be) {
    be->layer_norm = cpu_layer_norm;
    be->layer_norm_backward = cpu_layer_norm_backward;
}
