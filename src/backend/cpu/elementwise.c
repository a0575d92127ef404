/*
 * elementwise.c - CPU kernels: unary ops and their derivatives, broadcasting binary ops,
 * sum_to (broadcast-reduce) and expand.
 *
 * Storage is f32/f16/bf16, compute is f32: each kernel loads a chunk of AMPC_CPU_CHUNK
 * elements as f32 (no copy for f32), computes with a flat loop the compiler vectorizes, and
 * stores once (one rounding). Chunks are split over OpenMP threads. Broadcast operands are
 * gathered chunk by chunk into f32 buffers, so the compute loops never see strides.
 * Reductions accumulate in f32 over blocks whose sizes depend only on the shape, so results
 * do not depend on the number of threads.
 */
#include "backend/cpu/cpu.h"

#include <math.h>
#include <string.h>

#define CHUNK AMPC_CPU_CHUNK
/* elements per reduction block: partial sums of this many values are combined at the end */
#define RBLK 65536

static inline size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

static int check_float(const ampc_tensor *t, const char *kernel) {
    if (t && t->dtype != AMPC_F32 && t->dtype != AMPC_F16 && t->dtype != AMPC_BF16)
        return ampc__err(AMPC_ERR_DTYPE, "cpu %s on %s", kernel, ampc_dtype_name(t->dtype));
    return AMPC_OK;
}

/* k elements of t from element off, as f32 into dst (always a copy) */
static void load_into(const ampc_tensor *t, int64_t off, size_t k, float *dst) {
    const ampc_dtype_traits *tr = ampc__dt(t->dtype);
    const char *src = (const char *)ampc__data(t) + (size_t)off * tr->size;
    if (t->dtype == AMPC_F32) memcpy(dst, src, k * sizeof(float));
    else tr->to_f32(src, dst, k);
}

static float load_one(const ampc_tensor *t, int64_t off) {
    float v;
    load_into(t, off, 1, &v);
    return v;
}

// ---------------------------------------------------------------------------------------------
// Unary: y = f(x), and gx = gy * f'(x)

static const float inv_sqrt2 = 0.70710678118654752440f, inv_sqrt2pi = 0.39894228040143267794f;

/* x and y may be the same array: every iteration reads x[i] before writing y[i] */
static void unary_chunk(ampc_unary_op op, const float *x, float *y, size_t n, float a) {
    switch (op) {
    case AMPC_UNARY_RELU:   /* NaN stays NaN, like torch.relu */
#pragma omp simd
        for (size_t i = 0; i < n; i++) y[i] = x[i] < 0.0f ? 0.0f : x[i];
        break;
    case AMPC_UNARY_GELU:
#pragma omp simd
        for (size_t i = 0; i < n; i++) y[i] = 0.5f * x[i] * (1.0f + erff(x[i] * inv_sqrt2));
        break;
    case AMPC_UNARY_TANH:
        for (size_t i = 0; i < n; i++) y[i] = tanhf(x[i]);
        break;
    case AMPC_UNARY_SIGMOID:
        for (size_t i = 0; i < n; i++) y[i] = 1.0f / (1.0f + expf(-x[i]));
        break;
    case AMPC_UNARY_EXP:
        for (size_t i = 0; i < n; i++) y[i] = expf(x[i]);
        break;
    case AMPC_UNARY_LOG:
        for (size_t i = 0; i < n; i++) y[i] = logf(x[i]);
        break;
    case AMPC_UNARY_POW:
        for (size_t i = 0; i < n; i++) y[i] = powf(x[i], a);
        break;
    case AMPC_UNARY_SCALE:
#pragma omp simd
        for (size_t i = 0; i < n; i++) y[i] = a * x[i];
        break;
    case AMPC_UNARY_ADD_SCALAR:
#pragma omp simd
        for (size_t i = 0; i < n; i++) y[i] = x[i] + a;
        break;
    default:
        break;
    }
}

static int cpu_unary(ampc_unary_op op, const ampc_tensor *x, ampc_tensor *y, double alpha) {
    if (check_float(x, "unary") < 0 || check_float(y, "unary") < 0) return ampc_last_status();
    if ((unsigned)op >= AMPC_UNARY_COUNT) return ampc__err(AMPC_ERR_INVALID, "cpu unary: unknown op %d", (int)op);
    if (x->numel != y->numel)
        return ampc__err(AMPC_ERR_SHAPE, "cpu unary: %lld inputs, %lld outputs", (long long)x->numel, (long long)y->numel);
    size_t n = (size_t)x->numel;
    float a = (float)alpha;
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)n)) schedule(static)
    for (size_t base = 0; base < n; base += CHUNK) {
        float bx[CHUNK], by[CHUNK];
        size_t m = min_sz(CHUNK, n - base);
        const float *xp = ampc__cpu_load(x, base, m, bx);
        float *yp = ampc__cpu_out(y, base, by);
        unary_chunk(op, xp, yp, m, a);
        ampc__cpu_store(y, base, m, yp);
    }
    return AMPC_OK;
}

/* x or y is NULL when the derivative does not read it; gx may be the same array as gy */
static void unary_backward_chunk(ampc_unary_op op, const float *x, const float *y, const float *gy, float *gx, size_t n,
                                 float a) {
    switch (op) {
    case AMPC_UNARY_RELU: {   /* threshold_backward: 0 where x <= 0; y > 0 exactly when x > 0 */
        const float *v = x ? x : y;
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            float g = gy[i];   /* loaded unconditionally, so the select vectorizes */
            gx[i] = v[i] > 0.0f ? g : 0.0f;
        }
        break;
    }
    case AMPC_UNARY_GELU:   /* Phi(x) + x phi(x) */
#pragma omp simd
        for (size_t i = 0; i < n; i++)
            gx[i] = gy[i] * (0.5f * (1.0f + erff(x[i] * inv_sqrt2)) + x[i] * inv_sqrt2pi * expf(-0.5f * x[i] * x[i]));
        break;
    case AMPC_UNARY_TANH:
#pragma omp simd
        for (size_t i = 0; i < n; i++) gx[i] = gy[i] * (1.0f - y[i] * y[i]);
        break;
    case AMPC_UNARY_SIGMOID:
#pragma omp simd
        for (size_t i = 0; i < n; i++) gx[i] = gy[i] * (y[i] * (1.0f - y[i]));
        break;
    case AMPC_UNARY_EXP:
#pragma omp simd
        for (size_t i = 0; i < n; i++) gx[i] = gy[i] * y[i];
        break;
    case AMPC_UNARY_LOG:
#pragma omp simd
        for (size_t i = 0; i < n; i++) gx[i] = gy[i] / x[i];
        break;
    case AMPC_UNARY_POW:
        for (size_t i = 0; i < n; i++) gx[i] = gy[i] * (a * powf(x[i], a - 1.0f));
        break;
    case AMPC_UNARY_SCALE:
#pragma omp simd
        for (size_t i = 0; i < n; i++) gx[i] = gy[i] * a;
        break;
    default:   /* ADD_SCALAR */
#pragma omp simd
        for (size_t i = 0; i < n; i++) gx[i] = gy[i];
        break;
    }
}

/* ReLU reads x when given, else y; GELU, log and pow read x; tanh, sigmoid and exp read y. */
static int cpu_unary_backward(ampc_unary_op op, const ampc_tensor *x, const ampc_tensor *y, const ampc_tensor *gy,
                              ampc_tensor *gx, double alpha) {
    if ((unsigned)op >= AMPC_UNARY_COUNT) return ampc__err(AMPC_ERR_INVALID, "cpu unary_backward: unknown op %d", (int)op);
    bool need_x = op == AMPC_UNARY_GELU || op == AMPC_UNARY_LOG || op == AMPC_UNARY_POW || (op == AMPC_UNARY_RELU && !y);
    bool need_y = op == AMPC_UNARY_TANH || op == AMPC_UNARY_SIGMOID || op == AMPC_UNARY_EXP || (op == AMPC_UNARY_RELU && !x);
    if ((need_x && !x) || (need_y && !y))
        return ampc__err(AMPC_ERR_INVALID, "cpu unary_backward of op %d needs its saved %s", (int)op, need_x ? "input" : "output");
    if (!need_x) x = NULL;
    if (!need_y) y = NULL;
    const ampc_tensor *ts[4] = {x, y, gy, gx};
    for (int k = 0; k < 4; k++) {
        if (check_float(ts[k], "unary_backward") < 0) return ampc_last_status();
        if (ts[k] && ts[k]->numel != gx->numel) return ampc__err(AMPC_ERR_SHAPE, "cpu unary_backward: sizes differ");
    }
    size_t n = (size_t)gx->numel;
    float a = (float)alpha;
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)n)) schedule(static)
    for (size_t base = 0; base < n; base += CHUNK) {
        float bx[CHUNK], by[CHUNK], bg[CHUNK], bo[CHUNK];
        size_t m = min_sz(CHUNK, n - base);
        const float *xp = x ? ampc__cpu_load(x, base, m, bx) : NULL;
        const float *yp = y ? ampc__cpu_load(y, base, m, by) : NULL;
        const float *gp = ampc__cpu_load(gy, base, m, bg);
        float *op_ = ampc__cpu_out(gx, base, bo);
        unary_backward_chunk(op, xp, yp, gp, op_, m, a);
        ampc__cpu_store(gx, base, m, op_);
    }
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Broadcast plans: the output's shape with adjacent dims merged wherever every operand
// allows it, so (N, C) + (C,) becomes 2 dims, (2, 3) + (1,) 1 dim with a stride-0 operand.

typedef struct {
    int nd;                               /* >= 1 */
    int64_t shape[AMPC_MAX_DIMS];
    int64_t st[2][AMPC_MAX_DIMS];         /* element strides of each operand (0: broadcast) */
} bplan;

/* Strides of t along the nd dims of shape, right-aligned, 0 where t has size 1 or lacks the
   dim. Fails unless every dim of t is 1 or equal to shape's (extra leading dims must be 1). */
static int bcast_strides(const ampc_tensor *t, int nd, const int64_t *shape, int64_t *st) {
    for (int j = 0; j < t->ndim - nd; j++)
        if (t->shape[j] != 1) return ampc__err(AMPC_ERR_SHAPE, "cpu: tensor of %d dims does not broadcast to %d dims", t->ndim, nd);
    int64_t s = 1;
    for (int i = nd - 1; i >= 0; i--) {
        int j = t->ndim - nd + i;
        int64_t d = j >= 0 ? t->shape[j] : 1;
        if (d != 1 && d != shape[i])
            return ampc__err(AMPC_ERR_SHAPE, "cpu: size %lld does not broadcast to %lld in dim %d", (long long)d,
                             (long long)shape[i], i);
        st[i] = d == 1 ? 0 : s;
        s *= d;
    }
    return AMPC_OK;
}

/* Drops size-1 dims and merges dim i into the one before it when, for every operand, the
   outer stride is the inner stride times the inner size (both contiguous, or both 0). */
static void plan_collapse(bplan *p, int nops) {
    int m = 0;
    for (int i = 0; i < p->nd; i++) {
        if (p->shape[i] == 1) continue;
        bool merge = m > 0;
        for (int k = 0; k < nops && merge; k++) merge = p->st[k][m - 1] == p->st[k][i] * p->shape[i];
        if (merge) {
            p->shape[m - 1] *= p->shape[i];
            for (int k = 0; k < nops; k++) p->st[k][m - 1] = p->st[k][i];
        } else {
            p->shape[m] = p->shape[i];
            for (int k = 0; k < nops; k++) p->st[k][m] = p->st[k][i];
            m++;
        }
    }
    if (m == 0) {   /* a single element */
        p->shape[0] = 1;
        for (int k = 0; k < nops; k++) p->st[k][0] = 0;
        m = 1;
    }
    p->nd = m;
}

/* Operand k walked over the plan: */
typedef enum {
    WALK_DENSE,    /* contiguous like the output: read directly */
    WALK_SCALAR,   /* one value for every element */
    WALK_TILE,     /* (rows, L) with every row the same L <= CHUNK values: one tiled buffer */
    WALK_GATHER,   /* anything else: gathered chunk by chunk */
} walk_kind;

static walk_kind walk_of(const bplan *p, int k) {
    bool dense = true, zero = true;
    int64_t s = 1;
    for (int i = p->nd - 1; i >= 0; i--) {
        dense = dense && p->st[k][i] == s;
        zero = zero && p->st[k][i] == 0;
        s *= p->shape[i];
    }
    if (dense) return WALK_DENSE;
    if (zero) return WALK_SCALAR;
    if (p->nd == 2 && p->st[k][0] == 0 && p->st[k][1] == 1 && p->shape[1] <= CHUNK) return WALK_TILE;
    return WALK_GATHER;
}

/* Values [s, s+m) of the plan's flat index space read from operand k (tensor t), as f32. */
static void gather(const ampc_tensor *t, const bplan *p, int k, int64_t s, size_t m, float *buf) {
    int nd = p->nd;
    const int64_t *shape = p->shape, *st = p->st[k];
    int64_t idx[AMPC_MAX_DIMS], off = 0, r = s;
    for (int d = nd - 1; d >= 0; d--) {
        idx[d] = r % shape[d];
        r /= shape[d];
        if (d < nd - 1) off += idx[d] * st[d];   /* offset of the row; the column adds below */
    }
    int64_t L = shape[nd - 1], sI = st[nd - 1], j = idx[nd - 1];
    size_t done = 0;
    while (done < m) {
        size_t len = min_sz((size_t)(L - j), m - done);
        if (sI) {
            load_into(t, off + j * sI, len, buf + done);
        } else {
            float v = load_one(t, off);
            for (size_t i = 0; i < len; i++) buf[done + i] = v;
        }
        done += len;
        j = 0;
        for (int d = nd - 2; d >= 0; d--) {   /* next row */
            off += st[d];
            if (++idx[d] < shape[d]) break;
            off -= st[d] * shape[d];
            idx[d] = 0;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Binary: out = a op b. Both operands are streams of f32 values or scalars (NULL pointer).

#define SIMD_LOOP(expr)                                                                            \
    do {                                                                                           \
        _Pragma("omp simd") for (size_t i = 0; i < n; i++) o[i] = (expr);                         \
    } while (0)

/* o may be the same array as x or y */
static void binary_chunk(ampc_binary_op op, const float *x, float xs, const float *y, float ys, float *o, size_t n) {
    if (!x && !y) {   /* both scalars (single elements, or expand of one value) */
        float v = op == AMPC_BINARY_ADD ? xs + ys : op == AMPC_BINARY_SUB ? xs - ys : xs * ys;
        SIMD_LOOP(v);
        return;
    }
    switch (op) {
    case AMPC_BINARY_ADD:
        if (!x) SIMD_LOOP(xs + y[i]);
        else if (!y) SIMD_LOOP(x[i] + ys);
        else SIMD_LOOP(x[i] + y[i]);
        break;
    case AMPC_BINARY_SUB:
        if (!x) SIMD_LOOP(xs - y[i]);
        else if (!y) SIMD_LOOP(x[i] - ys);
        else SIMD_LOOP(x[i] - y[i]);
        break;
    default:
        if (!x) SIMD_LOOP(xs * y[i]);
        else if (!y) SIMD_LOOP(x[i] * ys);
        else SIMD_LOOP(x[i] * y[i]);
        break;
    }
}

/* out = t[0] op t[1] over the broadcast plan of out's shape; t[1] NULL: the constant c1 */
static int broadcast_run(ampc_binary_op op, const ampc_tensor *t0, const ampc_tensor *t1, float c1, ampc_tensor *out) {
    const ampc_tensor *t[2] = {t0, t1};
    int nops = t1 ? 2 : 1;
    bplan p = {.nd = out->ndim};
    memcpy(p.shape, out->shape, sizeof(int64_t) * (size_t)out->ndim);
    for (int k = 0; k < nops; k++)
        if (bcast_strides(t[k], out->ndim, out->shape, p.st[k]) < 0) return ampc_last_status();
    size_t n = (size_t)out->numel;
    if (n == 0) return AMPC_OK;
    plan_collapse(&p, nops);

    walk_kind w[2] = {WALK_SCALAR, WALK_SCALAR};
    float sc[2] = {0, c1};
    /* tiled operands: the row repeated to fill T = L * floor(CHUNK / L) values, so chunks of T
       start at row starts and every chunk reads the same buffer */
    float tile[2][CHUNK];
    size_t cs = CHUNK;
    for (int k = 0; k < nops; k++) {
        w[k] = walk_of(&p, k);
        if (w[k] == WALK_SCALAR) sc[k] = load_one(t[k], 0);
        if (w[k] == WALK_TILE) {
            size_t L = (size_t)p.shape[1];
            cs = L * (CHUNK / L);
            load_into(t[k], 0, L, tile[k]);
            for (size_t i = L; i < cs; i++) tile[k][i] = tile[k][i - L];
        }
    }
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)n)) schedule(static)
    for (size_t base = 0; base < n; base += cs) {
        float buf[2][CHUNK], bo[CHUNK];
        const float *src[2] = {NULL, NULL};
        size_t m = min_sz(cs, n - base);
        for (int k = 0; k < nops; k++) {
            switch (w[k]) {
            case WALK_DENSE: src[k] = ampc__cpu_load(t[k], base, m, buf[k]); break;
            case WALK_TILE: src[k] = tile[k]; break;
            case WALK_GATHER: gather(t[k], &p, k, (int64_t)base, m, buf[k]); src[k] = buf[k]; break;
            default: break;
            }
        }
        float *o = ampc__cpu_out(out, base, bo);
        binary_chunk(op, src[0], sc[0], src[1], sc[1], o, m);
        ampc__cpu_store(out, base, m, o);
    }
    return AMPC_OK;
}

static int cpu_binary(ampc_binary_op op, const ampc_tensor *a, const ampc_tensor *b, ampc_tensor *out) {
    if (check_float(a, "binary") < 0 || check_float(b, "binary") < 0 || check_float(out, "binary") < 0)
        return ampc_last_status();
    if ((unsigned)op >= AMPC_BINARY_COUNT) return ampc__err(AMPC_ERR_INVALID, "cpu binary: unknown op %d", (int)op);
    return broadcast_run(op, a, b, 0.0f, out);
}

static int cpu_expand(const ampc_tensor *x, ampc_tensor *out, double alpha) {
    if (check_float(x, "expand") < 0 || check_float(out, "expand") < 0) return ampc_last_status();
    return broadcast_run(AMPC_BINARY_MUL, x, NULL, (float)alpha, out);
}

// ---------------------------------------------------------------------------------------------
// sum_to: x summed down to out's shape, times alpha. The plan walks x's shape with out's
// strides (0 along summed dims); after merging, the summed and kept dims alternate, and the
// common patterns are one summed axis viewed as (outer, dim, inner).

static float sum_f32(const float *x, size_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (size_t i = 0; i < n; i++) s += x[i];
    return s;
}

/* Stores the f32 results res (out's numel) into out, unless res is out's own storage. */
static void store_results(ampc_tensor *out, const float *res) {
    if (out->dtype != AMPC_F32) ampc__dt(out->dtype)->from_f32(res, ampc__data(out), (size_t)out->numel);
}

/* x as (outer, dim) rows, each summed: res[o] = alpha * sum_d x[o, d]. Short rows go several
   per chunk; long rows split into RBLK blocks whose partial sums are added in order. */
static int reduce_rows(const ampc_tensor *x, int64_t outer, int64_t dim, float alpha, float *res) {
    if (dim <= CHUNK) {
        size_t rows_per = (size_t)(CHUNK / dim), n_units = ((size_t)outer + rows_per - 1) / rows_per;
#pragma omp parallel for num_threads(ampc__threads_for(outer * dim)) schedule(static)
        for (size_t u = 0; u < n_units; u++) {
            float buf[CHUNK];
            size_t r0 = u * rows_per, nr = min_sz(rows_per, (size_t)outer - r0);
            const float *v = ampc__cpu_load(x, r0 * (size_t)dim, nr * (size_t)dim, buf);
            for (size_t r = 0; r < nr; r++) res[r0 + r] = alpha * sum_f32(v + r * (size_t)dim, (size_t)dim);
        }
        return AMPC_OK;
    }
    int64_t nblk = (dim + RBLK - 1) / RBLK, n_units = outer * nblk;
    size_t block = 0;
    float *part = ampc__alloc(AMPC_DEVICE_CPU, (size_t)n_units * sizeof(float), AMPC_MEM_WORKSPACE, &block);
    if (!part) return ampc_last_status();
#pragma omp parallel for num_threads(ampc__threads_for(outer * dim)) schedule(static)
    for (int64_t u = 0; u < n_units; u++) {
        float buf[CHUNK];
        int64_t o = u / nblk, s = (u % nblk) * RBLK, e = s + RBLK < dim ? s + RBLK : dim;
        float acc = 0.0f;
        for (int64_t c = s; c < e; c += CHUNK) {
            size_t m = min_sz(CHUNK, (size_t)(e - c));
            acc += sum_f32(ampc__cpu_load(x, (size_t)(o * dim + c), m, buf), m);
        }
        part[u] = acc;
    }
    for (int64_t o = 0; o < outer; o++) res[o] = alpha * sum_f32(part + o * nblk, (size_t)nblk);
    ampc__free(AMPC_DEVICE_CPU, part, block, AMPC_MEM_WORKSPACE);
    return AMPC_OK;
}

/* x as (outer, dim, inner), inner > 1: res[o, i] = alpha * sum_d x[o, d, i], vectorized over
   i. Work units are (o, column chunk, block of rows); blocks of long dims write partial sums
   that are added in order afterwards. */
static int reduce_middle(const ampc_tensor *x, int64_t outer, int64_t dim, int64_t inner, float alpha, float *res) {
    int64_t cw = inner < CHUNK ? inner : CHUNK, ncol = (inner + CHUNK - 1) / CHUNK;
    int64_t rows_blk = RBLK / cw > 0 ? RBLK / cw : 1, nblk = (dim + rows_blk - 1) / rows_blk;
    int64_t n_units = outer * ncol * nblk;
    size_t block = 0;
    float *part = NULL;
    if (nblk > 1) {
        part = ampc__alloc(AMPC_DEVICE_CPU, (size_t)(outer * nblk * inner) * sizeof(float), AMPC_MEM_WORKSPACE, &block);
        if (!part) return ampc_last_status();
    }
    /* whole rows fit in a chunk: load several consecutive rows (contiguous) at once */
    int64_t rows_per_load = ncol == 1 ? CHUNK / inner : 1;
#pragma omp parallel for num_threads(ampc__threads_for(outer * dim * inner)) schedule(static)
    for (int64_t u = 0; u < n_units; u++) {
        float acc[CHUNK], buf[CHUNK];
        int64_t o = u / (ncol * nblk), c = (u / nblk) % ncol, b = u % nblk;
        int64_t c0 = c * CHUNK, m = inner - c0 < CHUNK ? inner - c0 : CHUNK;
        int64_t d0 = b * rows_blk, d1 = d0 + rows_blk < dim ? d0 + rows_blk : dim;
        for (int64_t i = 0; i < m; i++) acc[i] = 0.0f;
        for (int64_t d = d0; d < d1; d += rows_per_load) {
            int64_t nr = d1 - d < rows_per_load ? d1 - d : rows_per_load;
            size_t start = (size_t)((o * dim + d) * inner + c0);
            const float *v = ampc__cpu_load(x, start, (size_t)(nr == 1 ? m : nr * inner), buf);
            for (int64_t r = 0; r < nr; r++) {
                const float *row = v + r * inner;
#pragma omp simd
                for (int64_t i = 0; i < m; i++) acc[i] += row[i];
            }
        }
        float *dst = part ? part + (o * nblk + b) * inner + c0 : res + o * inner + c0;
        float scale = part ? 1.0f : alpha;
        for (int64_t i = 0; i < m; i++) dst[i] = scale * acc[i];
    }
    if (part) {
#pragma omp parallel for num_threads(ampc__threads_for(outer * inner * nblk)) schedule(static)
        for (int64_t k = 0; k < outer * inner; k++) {
            int64_t o = k / inner, i = k % inner;
            float s = 0.0f;
            for (int64_t b = 0; b < nblk; b++) s += part[(o * nblk + b) * inner + i];
            res[k] = alpha * s;
        }
        ampc__free(AMPC_DEVICE_CPU, part, block, AMPC_MEM_WORKSPACE);
    }
    return AMPC_OK;
}

/* Two or more separate summed groups (e.g. (4, 5, 3) -> (5, 1)): one thread adds every
   element into its output slot. Only gradients of unusual broadcasts come here. */
static void reduce_general(const ampc_tensor *x, const bplan *p, float alpha, float *res, size_t n_out) {
    int64_t idx[AMPC_MAX_DIMS] = {0}, off = 0;
    const int64_t *st = p->st[0];
    for (size_t i = 0; i < n_out; i++) res[i] = 0.0f;
    size_t n = (size_t)x->numel;
    for (size_t base = 0; base < n; base += CHUNK) {
        float buf[CHUNK];
        size_t m = min_sz(CHUNK, n - base);
        const float *v = ampc__cpu_load(x, base, m, buf);
        for (size_t i = 0; i < m; i++) {
            res[off] += v[i];
            for (int d = p->nd - 1; d >= 0; d--) {
                off += st[d];
                if (++idx[d] < p->shape[d]) break;
                off -= st[d] * p->shape[d];
                idx[d] = 0;
            }
        }
    }
    for (size_t i = 0; i < n_out; i++) res[i] *= alpha;
}

static int cpu_sum_to(const ampc_tensor *x, ampc_tensor *out, double alpha) {
    if (check_float(x, "sum_to") < 0 || check_float(out, "sum_to") < 0) return ampc_last_status();
    bplan p = {.nd = x->ndim > out->ndim ? x->ndim : out->ndim};
    for (int i = 0; i < p.nd; i++) {
        int j = x->ndim - p.nd + i;
        p.shape[i] = j >= 0 ? x->shape[j] : 1;
    }
    if (bcast_strides(out, p.nd, p.shape, p.st[0]) < 0) return ampc_last_status();
    if (x->numel == out->numel) return cpu_unary(AMPC_UNARY_SCALE, x, out, alpha);   /* nothing summed */
    float a = (float)alpha;
    plan_collapse(&p, 1);
    /* f32 results go straight into an f32 out, else into scratch converted at the end */
    size_t block = 0, n_out = (size_t)out->numel;
    float *res = out->dtype == AMPC_F32 ? ampc__data(out)
                                        : ampc__alloc(AMPC_DEVICE_CPU, n_out * sizeof(float), AMPC_MEM_WORKSPACE, &block);
    if (!res) return ampc_last_status();
    /* count the summed groups; with one, x is (outer, dim, inner) around it */
    int groups = 0, g = -1;
    for (int i = 0; i < p.nd; i++)
        if (p.st[0][i] == 0) {
            groups++;
            g = i;
        }
    int rc = AMPC_OK;
    if (x->numel == 0) {   /* empty sums are 0 (times alpha: the mean of nothing is NaN) */
        for (size_t i = 0; i < n_out; i++) res[i] = 0.0f * a;
    } else if (groups == 1) {
        int64_t outer = 1, inner = 1;
        for (int i = 0; i < g; i++) outer *= p.shape[i];
        for (int i = g + 1; i < p.nd; i++) inner *= p.shape[i];
        rc = inner == 1 ? reduce_rows(x, outer, p.shape[g], a, res) : reduce_middle(x, outer, p.shape[g], inner, a, res);
    } else {
        reduce_general(x, &p, a, res, n_out);
    }
    if (rc >= 0) store_results(out, res);
    if (out->dtype != AMPC_F32) ampc__free(AMPC_DEVICE_CPU, res, block, AMPC_MEM_WORKSPACE);
    return rc;
}

void ampc__cpu_register_elementwise(ampc_backend *be) {
    be->unary = cpu_unary;
    be->unary_backward = cpu_unary_backward;
    be->binary = cpu_binary;
    be->sum_to = cpu_sum_to;
    be->expand = cpu_expand;
}
