/*
 * loss.c - CPU kernels of softmax / log-softmax and fused cross-entropy (dropout: random.c).
 *
 *   softmax:        x viewed as (outer, dim, inner); max-subtracted, f32 compute. Rows
 *                   (inner == 1) are contiguous; otherwise tiles of up to 64 columns of the
 *                   (dim, inner) block are done together so the inner loops run along
 *                   contiguous memory and vectorize.
 *   cross_entropy:  log-softmax and NLL fused per row of (N, C) logits, label smoothing and
 *                   ignore_index as PyTorch; the backward recomputes the softmax from the
 *                   logits instead of saving it.
 *
 * Storage may be f32/f16/bf16; 16-bit data goes through per-thread f32 buffers taken from the
 * workspace allocator (one rounding on store). Rows are spread over OpenMP threads; per-row
 * results do not depend on the number of threads.
 */
#include "backend/cpu/cpu.h"

#include <math.h>
#include <omp.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Helpers

/* nt * per_thread floats of scratch (NULL with the error set on failure). */
static float *ws_alloc(int nt, size_t per_thread, size_t *bytes) {
    size_t n = (size_t)nt * per_thread;
    return ampc__alloc(AMPC_DEVICE_CPU, (n ? n : 1) * sizeof(float), AMPC_MEM_WORKSPACE, bytes);
}
static void ws_free(float *p, size_t bytes) {
    if (p) ampc__free(AMPC_DEVICE_CPU, p, bytes, AMPC_MEM_WORKSPACE);
}

static int threads_for_rows(int64_t rows, int64_t numel) {
    int nt = ampc__threads_for(numel);
    return rows < nt ? (int)(rows > 0 ? rows : 1) : nt;
}

/* Max of x[0, n) (NaN ignored; a NaN still turns its row to NaN through the sum). Lane-wise
   partial maxima rather than a max reduction clause, which clang cannot vectorize with NaNs. */
static inline float row_max(const float *x, int64_t n) {
    float mv[16], m = -INFINITY;
    for (int k = 0; k < 16; k++) mv[k] = -INFINITY;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
#pragma omp simd
        for (int k = 0; k < 16; k++) mv[k] = x[i + k] > mv[k] ? x[i + k] : mv[k];
    }
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    for (int k = 0; k < 16; k++) m = mv[k] > m ? mv[k] : m;
    return m;
}

// ---------------------------------------------------------------------------------------------
// Softmax on f32 arrays. Rows: contiguous x[n]. Columns: x (dim, T) with row stride xs; the
// T columns are independent softmaxes. y may alias x (same stride).

AMPC_CPU_VEC static void softmax_row(const float *x, float *y, int64_t n, bool is_log) {
    float m = row_max(x, n), s = 0.0f;
    if (is_log) {
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < n; i++) s += ampc__cpu_exp(x[i] - m);
        float ls = logf(s);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) y[i] = (x[i] - m) - ls;
    } else {
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < n; i++) {
            float e = ampc__cpu_exp(x[i] - m);
            y[i] = e;
            s += e;
        }
#pragma omp simd
        for (int64_t i = 0; i < n; i++) y[i] = y[i] / s;
    }
}

#define SOFTMAX_TILE 64   /* columns per tile */

AMPC_CPU_VEC static void softmax_cols(const float *x, int64_t xs, float *y, int64_t ys, int64_t dim, int64_t T, bool is_log) {
    float m[SOFTMAX_TILE], s[SOFTMAX_TILE];
    for (int64_t j = 0; j < T; j++) {
        m[j] = -INFINITY;
        s[j] = 0.0f;
    }
    for (int64_t d = 0; d < dim; d++) {
        const float *xr = x + d * xs;
#pragma omp simd
        for (int64_t j = 0; j < T; j++) m[j] = xr[j] > m[j] ? xr[j] : m[j];
    }
    if (is_log) {
        for (int64_t d = 0; d < dim; d++) {
            const float *xr = x + d * xs;
#pragma omp simd
            for (int64_t j = 0; j < T; j++) s[j] += ampc__cpu_exp(xr[j] - m[j]);
        }
        for (int64_t j = 0; j < T; j++) s[j] = logf(s[j]);
        for (int64_t d = 0; d < dim; d++) {
            const float *xr = x + d * xs;
            float *yr = y + d * ys;
#pragma omp simd
            for (int64_t j = 0; j < T; j++) yr[j] = (xr[j] - m[j]) - s[j];
        }
    } else {
        for (int64_t d = 0; d < dim; d++) {
            const float *xr = x + d * xs;
            float *yr = y + d * ys;
#pragma omp simd
            for (int64_t j = 0; j < T; j++) {
                float e = ampc__cpu_exp(xr[j] - m[j]);
                yr[j] = e;
                s[j] += e;
            }
        }
        for (int64_t d = 0; d < dim; d++) {
            float *yr = y + d * ys;
#pragma omp simd
            for (int64_t j = 0; j < T; j++) yr[j] = yr[j] / s[j];
        }
    }
}

/* softmax: gx = y * (gy - sum(gy * y)); log-softmax: gx = gy - exp(y) * sum(gy).
   gx may alias g. */
AMPC_CPU_VEC static void softmax_bwd_row(const float *y, const float *g, float *gx, int64_t n, bool is_log) {
    float s = 0.0f;
    if (is_log) {
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < n; i++) s += g[i];
#pragma omp simd
        for (int64_t i = 0; i < n; i++) gx[i] = g[i] - ampc__cpu_exp(y[i]) * s;
    } else {
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < n; i++) s += g[i] * y[i];
#pragma omp simd
        for (int64_t i = 0; i < n; i++) gx[i] = y[i] * (g[i] - s);
    }
}

AMPC_CPU_VEC static void softmax_bwd_cols(const float *y, int64_t ys, const float *g, int64_t gs, float *gx, int64_t gxs,
                             int64_t dim, int64_t T, bool is_log) {
    float s[SOFTMAX_TILE];
    for (int64_t j = 0; j < T; j++) s[j] = 0.0f;
    for (int64_t d = 0; d < dim; d++) {
        const float *yr = y + d * ys, *gr = g + d * gs;
        if (is_log) {
#pragma omp simd
            for (int64_t j = 0; j < T; j++) s[j] += gr[j];
        } else {
#pragma omp simd
            for (int64_t j = 0; j < T; j++) s[j] += gr[j] * yr[j];
        }
    }
    for (int64_t d = 0; d < dim; d++) {
        const float *yr = y + d * ys, *gr = g + d * gs;
        float *xr = gx + d * gxs;
        if (is_log) {
#pragma omp simd
            for (int64_t j = 0; j < T; j++) xr[j] = gr[j] - ampc__cpu_exp(yr[j]) * s[j];
        } else {
#pragma omp simd
            for (int64_t j = 0; j < T; j++) xr[j] = yr[j] * (gr[j] - s[j]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Softmax drivers: load/convert, compute, store.

/* Columns per tile: up to 64, fewer when dim is long so a tile buffer stays ~256 KiB. */
static int64_t tile_width(ampc_axis_desc ax) {
    int64_t t = ax.inner < SOFTMAX_TILE ? ax.inner : SOFTMAX_TILE;
    int64_t cap = 65536 / (ax.dim > 0 ? ax.dim : 1);
    if (t > cap) t = cap;
    return t > 0 ? t : 1;
}

/* Where a tile (dim rows of tw values from element base, row stride inner) of t is read
   from: t's storage for f32, else converted into buf (row stride tw). */
static const float *tile_load(const ampc_tensor *t, int64_t base, int64_t dim, int64_t inner, int64_t tw,
                              float *buf, int64_t *stride) {
    if (t->dtype == AMPC_F32) {
        *stride = inner;
        return (const float *)ampc__data(t) + base;
    }
    for (int64_t d = 0; d < dim; d++) ampc__cpu_load(t, (size_t)(base + d * inner), (size_t)tw, buf + d * tw);
    *stride = tw;
    return buf;
}

static float *tile_out(ampc_tensor *t, int64_t base, int64_t inner, int64_t tw, float *buf, int64_t *stride) {
    *stride = t->dtype == AMPC_F32 ? inner : tw;
    return t->dtype == AMPC_F32 ? (float *)ampc__data(t) + base : buf;
}

static void tile_store(ampc_tensor *t, int64_t base, int64_t dim, int64_t inner, int64_t tw, const float *buf) {
    if (t->dtype == AMPC_F32) return;
    for (int64_t d = 0; d < dim; d++) ampc__cpu_store(t, (size_t)(base + d * inner), (size_t)tw, buf + d * tw);
}

static int cpu_softmax(const ampc_tensor *x, ampc_tensor *y, ampc_axis_desc ax, bool is_log) {
    if (x->numel == 0 || ax.dim == 0) return AMPC_OK;
    bool staged = x->dtype != AMPC_F32 || y->dtype != AMPC_F32;
    size_t bytes = 0;
    float *ws = NULL;
    if (ax.inner == 1) {
        int64_t rows = ax.outer, n = ax.dim;
        int nt = threads_for_rows(rows, x->numel);
        if (staged && !(ws = ws_alloc(nt, (size_t)n, &bytes))) return ampc_last_status();
#pragma omp parallel num_threads(nt)
        {
            float *buf = ws ? ws + (size_t)omp_get_thread_num() * (size_t)n : NULL;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                const float *xr = ampc__cpu_load(x, (size_t)(r * n), (size_t)n, buf);
                float *yr = ampc__cpu_out(y, (size_t)(r * n), buf);
                softmax_row(xr, yr, n, is_log);
                ampc__cpu_store(y, (size_t)(r * n), (size_t)n, yr);
            }
        }
    } else {
        int64_t T = tile_width(ax), tiles = (ax.inner + T - 1) / T, items = ax.outer * tiles;
        int nt = threads_for_rows(items, x->numel);
        if (staged && !(ws = ws_alloc(nt, (size_t)(ax.dim * T), &bytes))) return ampc_last_status();
#pragma omp parallel num_threads(nt)
        {
            float *buf = ws ? ws + (size_t)omp_get_thread_num() * (size_t)(ax.dim * T) : NULL;
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items; it++) {
                int64_t o = it / tiles, j0 = (it % tiles) * T, tw = ax.inner - j0 < T ? ax.inner - j0 : T;
                int64_t base = o * ax.dim * ax.inner + j0, xs, ys;
                const float *xp = tile_load(x, base, ax.dim, ax.inner, tw, buf, &xs);
                float *yp = tile_out(y, base, ax.inner, tw, buf, &ys);
                softmax_cols(xp, xs, yp, ys, ax.dim, tw, is_log);
                tile_store(y, base, ax.dim, ax.inner, tw, yp);
            }
        }
    }
    ws_free(ws, bytes);
    return AMPC_OK;
}

static int cpu_softmax_backward(const ampc_tensor *y, const ampc_tensor *gy, ampc_tensor *gx, ampc_axis_desc ax,
                                bool is_log) {
    if (y->numel == 0 || ax.dim == 0) return AMPC_OK;
    bool staged = y->dtype != AMPC_F32 || gy->dtype != AMPC_F32 || gx->dtype != AMPC_F32;
    size_t bytes = 0;
    float *ws = NULL;
    /* two buffers per thread: y, and gy (which gx overwrites in place) */
    if (ax.inner == 1) {
        int64_t rows = ax.outer, n = ax.dim;
        int nt = threads_for_rows(rows, y->numel);
        if (staged && !(ws = ws_alloc(nt, (size_t)(2 * n), &bytes))) return ampc_last_status();
#pragma omp parallel num_threads(nt)
        {
            float *by = ws ? ws + (size_t)omp_get_thread_num() * (size_t)(2 * n) : NULL, *bg = by ? by + n : NULL;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                size_t i = (size_t)(r * n);
                const float *yr = ampc__cpu_load(y, i, (size_t)n, by);
                const float *gr = ampc__cpu_load(gy, i, (size_t)n, bg);
                float *xr = ampc__cpu_out(gx, i, bg);
                softmax_bwd_row(yr, gr, xr, n, is_log);
                ampc__cpu_store(gx, i, (size_t)n, xr);
            }
        }
    } else {
        int64_t T = tile_width(ax), tiles = (ax.inner + T - 1) / T, items = ax.outer * tiles, tb = ax.dim * T;
        int nt = threads_for_rows(items, y->numel);
        if (staged && !(ws = ws_alloc(nt, (size_t)(2 * tb), &bytes))) return ampc_last_status();
#pragma omp parallel num_threads(nt)
        {
            float *by = ws ? ws + (size_t)omp_get_thread_num() * (size_t)(2 * tb) : NULL, *bg = by ? by + tb : NULL;
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items; it++) {
                int64_t o = it / tiles, j0 = (it % tiles) * T, tw = ax.inner - j0 < T ? ax.inner - j0 : T;
                int64_t base = o * ax.dim * ax.inner + j0, ys, gs, xs;
                const float *yp = tile_load(y, base, ax.dim, ax.inner, tw, by, &ys);
                const float *gp = tile_load(gy, base, ax.dim, ax.inner, tw, bg, &gs);
                float *xp = tile_out(gx, base, ax.inner, tw, bg, &xs);
                softmax_bwd_cols(yp, ys, gp, gs, xp, xs, ax.dim, tw, is_log);
                tile_store(gx, base, ax.dim, ax.inner, tw, xp);
            }
        }
    }
    ws_free(ws, bytes);
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

/* Loss of one row: (1 - eps) * nll + eps * mean_c(-logp_c), with logp = (x - m) - log(s). */
AMPC_CPU_VEC static float ce_row(const float *x, int64_t C, int64_t t, float eps) {
    float m = row_max(x, C), s = 0.0f, sd = 0.0f;
#pragma omp simd reduction(+ : s, sd)
    for (int64_t c = 0; c < C; c++) {
        s += ampc__cpu_exp(x[c] - m);
        sd += x[c] - m;
    }
    float ls = logf(s), nll = ls - (x[t] - m);
    return eps > 0.0f ? (1.0f - eps) * nll + eps * (ls - sd / (float)C) : nll;
}

static int cpu_cross_entropy(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_cross_entropy_options *o,
                             ampc_tensor *out, double *weight_out) {
    int64_t count;
    int rc = ampc__host_ce_targets(logits, targets, o, &count);
    if (rc < 0) return rc;
    int64_t N = logits->shape[0], C = logits->shape[1];
    if (weight_out) *weight_out = (double)count;
    const int64_t *tg = ampc__data(targets);
    float eps = (float)o->label_smoothing;
    bool staged = logits->dtype != AMPC_F32;
    int nt = threads_for_rows(N, logits->numel);
    /* per-row losses first, then one reduction in double in row order: thread-count independent */
    size_t bytes = 0;
    size_t per = staged ? (size_t)C : 0;
    float *ws = ws_alloc(1, (size_t)N + (size_t)nt * per, &bytes);
    if (!ws) return ampc_last_status();
    float *loss = ws;
#pragma omp parallel num_threads(nt)
    {
        float *buf = staged ? ws + N + (size_t)omp_get_thread_num() * per : NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < N; i++) {
            if (tg[i] == o->ignore_index || C == 0) {
                loss[i] = 0.0f;
                continue;
            }
            const float *x = ampc__cpu_load(logits, (size_t)(i * C), (size_t)C, buf);
            loss[i] = ce_row(x, C, tg[i], eps);
        }
    }
    if (o->reduction == AMPC_REDUCTION_NONE) {
        if (N) ampc__dt(out->dtype)->from_f32(loss, ampc__data(out), (size_t)N);
    } else {
        double sum = 0;
        for (int64_t i = 0; i < N; i++) sum += loss[i];
        if (o->reduction == AMPC_REDUCTION_MEAN) sum = count ? sum / (double)count : NAN;   /* PyTorch: 0/0 */
        ampc__dt(out->dtype)->from_f64(&sum, ampc__data(out), 1);
    }
    ws_free(ws, bytes);
    return AMPC_OK;
}

/* gx = (softmax(x) - q) * g with q = eps/C off target, 1 - eps + eps/C on it; gx may alias x. */
AMPC_CPU_VEC static void ce_row_backward(const float *x, float *gx, int64_t C, int64_t t, float eps, float g) {
    float m = row_max(x, C), s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < C; c++) {
        float e = ampc__cpu_exp(x[c] - m);
        gx[c] = e;
        s += e;
    }
    float q_off = eps / (float)C, q_on = (1.0f - eps) + q_off;
    float pt = gx[t] / s;
#pragma omp simd
    for (int64_t c = 0; c < C; c++) gx[c] = (gx[c] / s - q_off) * g;
    gx[t] = (pt - q_on) * g;
}

static int cpu_cross_entropy_backward(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_tensor *gy,
                                      const ampc_cross_entropy_options *o, double weight, ampc_tensor *gx) {
    int64_t count;
    int rc = ampc__host_ce_targets(logits, targets, o, &count);
    if (rc < 0) return rc;
    int64_t N = logits->shape[0], C = logits->shape[1];
    bool none = o->reduction == AMPC_REDUCTION_NONE;
    const int64_t *tg = ampc__data(targets);
    float eps = (float)o->label_smoothing;
    bool staged = logits->dtype != AMPC_F32 || gx->dtype != AMPC_F32;
    int nt = threads_for_rows(N, logits->numel);
    size_t bytes = 0, per = staged ? (size_t)C : 0;
    float *ws = ws_alloc(1, (size_t)gy->numel + (size_t)nt * per, &bytes);
    if (!ws) return ampc_last_status();
    float *g = ws;
    ampc__dt(gy->dtype)->to_f32(ampc__data(gy), g, (size_t)gy->numel);
#pragma omp parallel num_threads(nt)
    {
        float *buf = staged ? ws + gy->numel + (size_t)omp_get_thread_num() * per : NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < N; i++) {
            size_t at = (size_t)(i * C);
            float *xr = ampc__cpu_out(gx, at, buf);
            if (tg[i] == o->ignore_index) {
                memset(xr, 0, (size_t)C * sizeof *xr);
            } else {
                /* 16-bit logits are converted straight into gx's f32 destination */
                const float *x = ampc__cpu_load(logits, at, (size_t)C, xr);
                ce_row_backward(x, xr, C, tg[i], eps, (float)((double)g[none ? i : 0] / weight));
            }
            ampc__cpu_store(gx, at, (size_t)C, xr);
        }
    }
    ws_free(ws, bytes);
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------

void ampc__cpu_register_loss(ampc_backend *be) {
    be->softmax = cpu_softmax;
    be->softmax_backward = cpu_softmax_backward;
    be->cross_entropy = cpu_cross_entropy;
    be->cross_entropy_backward = cpu_cross_entropy_backward;
}
