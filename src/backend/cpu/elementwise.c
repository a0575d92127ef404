/*
 * elementwise.c - CPU kernels: unary ops and their derivatives, broadcasting binary ops,
 * sum_to (broadcast-reduce) and expand.
 *
 * Storage is f32/f16/bf16, compute is f32, one rounding on store. Two paths (cpu.h):
 *   - in registers, when the tensors of a call are all f32 or all bf16: relu (and its
 *     derivative), scale, add_scalar, add/sub/mul, expand and sum_to read and write the
 *     storage in place, bf16 converted in the loop; threads take blocks of BLK elements, or
 *     whole rows of a broadcast;
 *   - staged, for f16, mixed dtypes, the transcendental ops and short broadcast rows: chunks
 *     of AMPC_CPU_CHUNK elements loaded as f32 (no copy for f32), computed, stored. Broadcast
 *     operands are gathered chunk by chunk into f32 buffers, so those loops never see strides.
 * Reductions accumulate in f32, in LANES accumulators over chunks and blocks whose sizes depend
 * only on the shape, so results depend neither on the number of threads nor on the vector
 * width of the clone that runs.
 */
#include "backend/cpu/cpu.h"

#include <math.h>
#include <string.h>

#define CHUNK AMPC_CPU_CHUNK
/* elements per reduction block: partial sums of this many values are combined at the end */
#define RBLK 65536
#define BLK 8192     /* elements per call of a register-path loop (threads take whole blocks) */
#define ROW_MIN 64   /* broadcast rows at least this long take the register path */
#define LANES 32     /* independent accumulators of a sum (two AVX-512 registers) */
#define MCOLS 4096   /* columns of a sum over rows per work unit (16 KiB of accumulators) */

static inline size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

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

/* the memory-bound ops of the register path (the activations below have theirs; exp, log and
   pow call libm per element) */
static bool simple_unary(ampc_op op) {
    return op == AMPC_OP_RELU || op == AMPC_OP_MUL_SCALAR || op == AMPC_OP_ADD_SCALAR;
}

/* relu, scale and add_scalar over f32 or bf16 storage; x and y may be the same array (every
   iteration reads x[i] before writing y[i]) */
AMPC_CPU_INLINE void simple_body(ampc_op op, const void *x, void *y, size_t n, float a, bool bf) {
    switch (op) {
    case AMPC_OP_RELU:   /* NaN stays NaN, like torch.relu */
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            float v = ampc__cpu_ld(x, i, bf);
            ampc__cpu_st(y, i, v < 0.0f ? 0.0f : v, bf);
        }
        break;
    case AMPC_OP_MUL_SCALAR:
#pragma omp simd
        for (size_t i = 0; i < n; i++) ampc__cpu_st(y, i, a * ampc__cpu_ld(x, i, bf), bf);
        break;
    default:   /* ADD_SCALAR */
#pragma omp simd
        for (size_t i = 0; i < n; i++) ampc__cpu_st(y, i, ampc__cpu_ld(x, i, bf) + a, bf);
        break;
    }
}
AMPC_CPU_VEC static void simple_f32(ampc_op op, const void *x, void *y, size_t n, float a) {
    simple_body(op, x, y, n, a, false);
}
AMPC_CPU_VEC static void simple_bf16(ampc_op op, const void *x, void *y, size_t n, float a) {
    simple_body(op, x, y, n, a, true);
}

/* relu's derivative, threshold_backward: gx = gy where v > 0, else 0 (v: x or y; y > 0
   exactly when x > 0); gx may be gy's array */
AMPC_CPU_INLINE void relu_bwd_body(const void *v, const void *gy, void *gx, size_t n, bool bf) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        float g = ampc__cpu_ld(gy, i, bf);   /* loaded unconditionally, so the select vectorizes */
        ampc__cpu_st(gx, i, ampc__cpu_ld(v, i, bf) > 0.0f ? g : 0.0f, bf);
    }
}
AMPC_CPU_VEC static void relu_bwd_f32(const void *v, const void *gy, void *gx, size_t n) { relu_bwd_body(v, gy, gx, n, false); }
AMPC_CPU_VEC static void relu_bwd_bf16(const void *v, const void *gy, void *gx, size_t n) { relu_bwd_body(v, gy, gx, n, true); }

static const float inv_sqrt2pi = 0.39894228040143267794f;
static const float sqrt_2_pi = 0.79788456080286535588f, gelu_k = 0.044715f;   /* GELU's tanh approximation */

/* The activations (exact GELU, its tanh form, SiLU, sigmoid, tanh) over f32 or bf16 storage in
   registers (cpu.h's exp, Phi, sigmoid, tanh), x and y possibly the same array. Exact GELU is
   x Phi(x); GELU's tanh form is computed as x sigmoid(2u), u = sqrt(2/pi) (x + k x^3): the same
   function as 0.5 x (1 + tanh u) without 1 + tanh u's cancellation for negative x. */
static bool activation(ampc_op op) {
    return op == AMPC_OP_GELU || op == AMPC_OP_GELU_TANH || op == AMPC_OP_SILU || op == AMPC_OP_SIGMOID || op == AMPC_OP_TANH;
}
AMPC_CPU_INLINE void activation_body(ampc_op op, const void *x, void *y, size_t n, bool bf) {
    switch (op) {
    case AMPC_OP_GELU:
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            const float v = ampc__cpu_ld(x, i, bf);
            ampc__cpu_st(y, i, v * ampc__cpu_phi(v), bf);
        }
        break;
    case AMPC_OP_GELU_TANH:
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            const float v = ampc__cpu_ld(x, i, bf);
            ampc__cpu_st(y, i, v * ampc__cpu_sigmoid(2.0f * sqrt_2_pi * fmaf(gelu_k * v * v, v, v)), bf);
        }
        break;
    case AMPC_OP_TANH:
#pragma omp simd
        for (size_t i = 0; i < n; i++) ampc__cpu_st(y, i, ampc__cpu_tanh(ampc__cpu_ld(x, i, bf)), bf);
        break;
    case AMPC_OP_SILU:
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            const float v = ampc__cpu_ld(x, i, bf);
            ampc__cpu_st(y, i, v * ampc__cpu_sigmoid(v), bf);
        }
        break;
    default:   /* SIGMOID */
#pragma omp simd
        for (size_t i = 0; i < n; i++) ampc__cpu_st(y, i, ampc__cpu_sigmoid(ampc__cpu_ld(x, i, bf)), bf);
        break;
    }
}
AMPC_CPU_VEC static void activation_f32(ampc_op op, const void *x, void *y, size_t n) { activation_body(op, x, y, n, false); }
AMPC_CPU_VEC static void activation_bf16(ampc_op op, const void *x, void *y, size_t n) { activation_body(op, x, y, n, true); }

/* Their derivatives, gx = gy f': GELU Phi(x) + x phi(x); GELU_TANH s + 2 x s (1 - s) u' (s =
   sigmoid(2u), u' = sqrt(2/pi) (1 + 3k x^2)); TANH 1 - y^2; SILU s (1 + x (1 - s)); SIGMOID
   y (1 - y); 1 - s as sigmoid(-.), not a difference. x or y is NULL where not read; gx may be
   gy's array. */
AMPC_CPU_INLINE void activation_bwd_body(ampc_op op, const void *x, const void *y, const void *gy, void *gx, size_t n, bool bf) {
    switch (op) {
    case AMPC_OP_GELU:
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            const float v = ampc__cpu_ld(x, i, bf);
            ampc__cpu_st(gx, i, ampc__cpu_ld(gy, i, bf) * (ampc__cpu_phi(v) + v * inv_sqrt2pi * ampc__cpu_exp(-0.5f * v * v)), bf);
        }
        break;
    case AMPC_OP_GELU_TANH:
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            float v = ampc__cpu_ld(x, i, bf), rest, sg = ampc__cpu_sigmoid2(2.0f * sqrt_2_pi * fmaf(gelu_k * v * v, v, v), &rest);
            ampc__cpu_st(gx, i, ampc__cpu_ld(gy, i, bf) * fmaf(2.0f * v * sg * rest, sqrt_2_pi * fmaf(3.0f * gelu_k * v, v, 1.0f), sg), bf);
        }
        break;
    case AMPC_OP_TANH:
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            const float t = ampc__cpu_ld(y, i, bf);
            ampc__cpu_st(gx, i, ampc__cpu_ld(gy, i, bf) * (1.0f - t * t), bf);
        }
        break;
    case AMPC_OP_SILU:
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            float v = ampc__cpu_ld(x, i, bf), rest, sg = ampc__cpu_sigmoid2(v, &rest);
            ampc__cpu_st(gx, i, ampc__cpu_ld(gy, i, bf) * (sg * fmaf(v, rest, 1.0f)), bf);
        }
        break;
    default:   /* SIGMOID */
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            const float s = ampc__cpu_ld(y, i, bf);
            ampc__cpu_st(gx, i, ampc__cpu_ld(gy, i, bf) * (s * (1.0f - s)), bf);
        }
        break;
    }
}
AMPC_CPU_VEC static void activation_bwd_f32(ampc_op op, const void *x, const void *y, const void *gy, void *gx, size_t n) {
    activation_bwd_body(op, x, y, gy, gx, n, false);
}
AMPC_CPU_VEC static void activation_bwd_bf16(ampc_op op, const void *x, const void *y, const void *gy, void *gx, size_t n) {
    activation_bwd_body(op, x, y, gy, gx, n, true);
}

/* The other ops on f32 chunks; x and y may be the same array */
static void unary_chunk(ampc_op op, const float *x, float *y, size_t n, float a) {
    switch (op) {
    case AMPC_OP_GELU:
    case AMPC_OP_GELU_TANH:
    case AMPC_OP_TANH:
    case AMPC_OP_SILU:
    case AMPC_OP_SIGMOID:
        activation_f32(op, x, y, n);
        break;
    case AMPC_OP_EXP:
        for (size_t i = 0; i < n; i++) y[i] = expf(x[i]);
        break;
    case AMPC_OP_LOG:
        for (size_t i = 0; i < n; i++) y[i] = logf(x[i]);
        break;
    case AMPC_OP_POW:
        for (size_t i = 0; i < n; i++) y[i] = powf(x[i], a);
        break;
    default:
        simple_f32(op, x, y, n, a);
        break;
    }
}

static int cpu_unary(ampc_op op, const ampc_tensor *x, ampc_tensor *y, double alpha) {
    size_t n = (size_t)x->numel;
    if (x->dtype == AMPC_I64) {   /* add_scalar on a counter */
        for (size_t i = 0; i < n; i++) ((int64_t *)ampc__data(y))[i] = ((const int64_t *)ampc__data(x))[i] + (int64_t)alpha;
        return AMPC_OK;
    }
    float a = (float)alpha;
    if ((simple_unary(op) || activation(op)) && ampc__cpu_direct(x->dtype) && x->dtype == y->dtype) {
        bool bf = x->dtype == AMPC_BF16, act = activation(op);
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)n)) schedule(static)
        for (size_t base = 0; base < n; base += BLK) {
            size_t m = min_sz(BLK, n - base);
            if (act) (bf ? activation_bf16 : activation_f32)(op, ampc__cpu_at(x, base), ampc__cpu_at(y, base), m);
            else (bf ? simple_bf16 : simple_f32)(op, ampc__cpu_at(x, base), ampc__cpu_at(y, base), m, a);
        }
        return AMPC_OK;
    }
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

/* The derivatives on f32 chunks: x or y is NULL when the derivative does not read it; gx may
   be the same array as gy */
static void unary_backward_chunk(ampc_op op, const float *x, const float *y, const float *gy, float *gx, size_t n,
                                 float a) {
    switch (op) {
    case AMPC_OP_RELU:
        relu_bwd_f32(x ? x : y, gy, gx, n);
        break;
    case AMPC_OP_GELU:
    case AMPC_OP_GELU_TANH:
    case AMPC_OP_TANH:
    case AMPC_OP_SILU:
    case AMPC_OP_SIGMOID:
        activation_bwd_f32(op, x, y, gy, gx, n);
        break;
    case AMPC_OP_EXP:
#pragma omp simd
        for (size_t i = 0; i < n; i++) gx[i] = gy[i] * y[i];
        break;
    case AMPC_OP_LOG:
#pragma omp simd
        for (size_t i = 0; i < n; i++) gx[i] = gy[i] / x[i];
        break;
    case AMPC_OP_POW:
        for (size_t i = 0; i < n; i++) gx[i] = gy[i] * (a * powf(x[i], a - 1.0f));
        break;
    case AMPC_OP_MUL_SCALAR:
#pragma omp simd
        for (size_t i = 0; i < n; i++) gx[i] = gy[i] * a;
        break;
    default:   /* ADD_SCALAR */
#pragma omp simd
        for (size_t i = 0; i < n; i++) gx[i] = gy[i];
        break;
    }
}

/* Reads x or y, the one the op table's backward-reads column names (the door passes NULL for
   the other). */
static int cpu_unary_backward(ampc_op op, const ampc_tensor *x, const ampc_tensor *y, const ampc_tensor *gy,
                              ampc_tensor *gx, double alpha) {
    size_t n = (size_t)gx->numel;
    float a = (float)alpha;
    const ampc_tensor *v = x ? x : y;
    if (op == AMPC_OP_RELU && ampc__cpu_direct(gx->dtype) && v->dtype == gx->dtype && gy->dtype == gx->dtype) {
        bool bf = gx->dtype == AMPC_BF16;
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)n)) schedule(static)
        for (size_t base = 0; base < n; base += BLK) {
            size_t m = min_sz(BLK, n - base);
            (bf ? relu_bwd_bf16 : relu_bwd_f32)(ampc__cpu_at(v, base), ampc__cpu_at(gy, base), ampc__cpu_at(gx, base), m);
        }
        return AMPC_OK;
    }
    const ampc_dtype dt = gx->dtype;
    if (activation(op) && ampc__cpu_direct(dt) && gy->dtype == dt && (!x || x->dtype == dt) && (!y || y->dtype == dt)) {
        bool bf = dt == AMPC_BF16;
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)n)) schedule(static)
        for (size_t base = 0; base < n; base += BLK) {
            size_t m = min_sz(BLK, n - base);
            (bf ? activation_bwd_bf16 : activation_bwd_f32)(op, x ? ampc__cpu_at(x, base) : NULL, y ? ampc__cpu_at(y, base) : NULL,
                                                            ampc__cpu_at(gy, base), ampc__cpu_at(gx, base), m);
        }
        return AMPC_OK;
    }
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
// Binary: out = a op b. Both operands are streams of values or scalars (NULL pointer).

#define BIN_LOOP(expr)                                                                             \
    do {                                                                                           \
        _Pragma("omp simd") for (size_t i = 0; i < n; i++) ampc__cpu_st(o, i, (expr), bf);        \
    } while (0)
#define LX ampc__cpu_ld(x, i, bf)
#define LY ampc__cpu_ld(y, i, bf)

/* o = x op y over f32 or bf16 storage (the staged path passes f32 chunks); o may be the same
   array as x or y */
AMPC_CPU_INLINE void binary_body(ampc_op op, const void *x, float xs, const void *y, float ys, void *o, size_t n,
                                 bool bf) {
    if (!x && !y) {   /* both scalars (single elements, or expand of one value) */
        float v = op == AMPC_OP_ADD ? xs + ys : op == AMPC_OP_SUB ? xs - ys : xs * ys;
        BIN_LOOP(v);
        return;
    }
    switch (op) {
    case AMPC_OP_ADD:
        if (!x) BIN_LOOP(xs + LY);
        else if (!y) BIN_LOOP(LX + ys);
        else BIN_LOOP(LX + LY);
        break;
    case AMPC_OP_SUB:
        if (!x) BIN_LOOP(xs - LY);
        else if (!y) BIN_LOOP(LX - ys);
        else BIN_LOOP(LX - LY);
        break;
    default:
        if (!x) BIN_LOOP(xs * LY);
        else if (!y) BIN_LOOP(LX * ys);
        else BIN_LOOP(LX * LY);
        break;
    }
}
AMPC_CPU_VEC static void binary_f32(ampc_op op, const void *x, float xs, const void *y, float ys, void *o, size_t n) {
    binary_body(op, x, xs, y, ys, o, n, false);
}
AMPC_CPU_VEC static void binary_bf16(ampc_op op, const void *x, float xs, const void *y, float ys, void *o, size_t n) {
    binary_body(op, x, xs, y, ys, o, n, true);
}
#undef BIN_LOOP
#undef LX
#undef LY

/* Element offset of operand k at the start of row r of the plan (rows: its last dim). */
static int64_t row_offset(const bplan *p, int k, int64_t r) {
    int64_t off = 0;
    for (int d = p->nd - 2; d >= 0; d--) {
        off += (r % p->shape[d]) * p->st[k][d];
        r /= p->shape[d];
    }
    return off;
}

/* Register path of broadcast_run (all tensors f32, or all bf16). Operands dense or scalar
   everywhere: blocks of the flat index space. Otherwise the plan's rows (last dim, >= ROW_MIN
   long): in every row each operand is either contiguous or one value. */
static void binary_direct(ampc_op op, const ampc_tensor *const *t, const walk_kind *w, const float *sc,
                          const bplan *p, ampc_tensor *out) {
    size_t n = (size_t)out->numel;
    bool bf = out->dtype == AMPC_BF16;
    void (*kern)(ampc_op, const void *, float, const void *, float, void *, size_t) = bf ? binary_bf16 : binary_f32;
    if ((w[0] == WALK_DENSE || w[0] == WALK_SCALAR) && (w[1] == WALK_DENSE || w[1] == WALK_SCALAR)) {
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)n)) schedule(static)
        for (size_t base = 0; base < n; base += BLK) {
            const void *src[2] = {NULL, NULL};
            for (int k = 0; k < 2; k++)
                if (w[k] == WALK_DENSE) src[k] = ampc__cpu_at(t[k], base);
            kern(op, src[0], sc[0], src[1], sc[1], ampc__cpu_at(out, base), min_sz(BLK, n - base));
        }
        return;
    }
    int64_t L = p->shape[p->nd - 1], rows = (int64_t)n / L;
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)n)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const void *src[2] = {NULL, NULL};
        float s[2] = {sc[0], sc[1]};
        for (int k = 0; k < 2; k++) {
            if (w[k] == WALK_SCALAR) continue;
            int64_t off = row_offset(p, k, r);
            if (p->st[k][p->nd - 1]) src[k] = ampc__cpu_at(t[k], (size_t)off);
            else s[k] = load_one(t[k], off);
        }
        kern(op, src[0], s[0], src[1], s[1], ampc__cpu_at(out, (size_t)(r * L)), (size_t)L);
    }
}

/* out = t[0] op t[1] over the broadcast plan of out's shape; t[1] NULL: the constant c1 */
static int broadcast_run(ampc_op op, const ampc_tensor *t0, const ampc_tensor *t1, float c1, ampc_tensor *out) {
    const ampc_tensor *t[2] = {t0, t1};
    int nops = t1 ? 2 : 1;
    bplan p = {.nd = out->ndim};
    memcpy(p.shape, out->shape, sizeof(int64_t) * (size_t)out->ndim);
    for (int k = 0; k < nops; k++)
        ampc__broadcast_strides(t[k], out->ndim, p.st[k]);
    size_t n = (size_t)out->numel;
    if (n == 0) return AMPC_OK;
    plan_collapse(&p, nops);

    walk_kind w[2] = {WALK_SCALAR, WALK_SCALAR};
    float sc[2] = {0, c1};
    bool direct = ampc__cpu_direct(out->dtype), flat = true;
    for (int k = 0; k < nops; k++) {
        w[k] = walk_of(&p, k);
        if (w[k] == WALK_SCALAR) sc[k] = load_one(t[k], 0);
        direct = direct && t[k]->dtype == out->dtype;
        flat = flat && (w[k] == WALK_DENSE || w[k] == WALK_SCALAR);
    }
    if (direct && (flat || p.shape[p.nd - 1] >= ROW_MIN)) {
        binary_direct(op, t, w, sc, &p, out);
        return AMPC_OK;
    }
    /* tiled operands: the row repeated to fill T = L * floor(CHUNK / L) values, so chunks of T
       start at row starts and every chunk reads the same buffer */
    float tile[2][CHUNK];
    size_t cs = CHUNK;
    for (int k = 0; k < nops; k++) {
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
        binary_f32(op, src[0], sc[0], src[1], sc[1], o, m);
        ampc__cpu_store(out, base, m, o);
    }
    return AMPC_OK;
}

static int cpu_binary(ampc_op op, const ampc_tensor *a, const ampc_tensor *b, ampc_tensor *out) {
    return broadcast_run(op, a, b, 0.0f, out);
}

static int cpu_expand(const ampc_tensor *x, ampc_tensor *out, double alpha) {
    return broadcast_run(AMPC_OP_MUL, x, NULL, (float)alpha, out);
}

// ---------------------------------------------------------------------------------------------
// sum_to: x summed down to out's shape, times alpha. The plan walks x's shape with out's
// strides (0 along summed dims); after merging, the summed and kept dims alternate, and the
// common patterns are one summed axis viewed as (outer, dim, inner).

/* Sum of n values with LANES accumulators combined pairwise: the same association at every
   vector width, and a value passes through at most n / LANES + log2(LANES) + 1 additions.
   ahead (or NULL): n values of the same storage prefetched alongside, the next run of a
   strided walk (the hardware prefetcher starts over at every run). */
AMPC_CPU_INLINE float sum_body(const void *x, size_t n, const void *ahead, bool bf) {
    float acc[LANES] = {0}, tail = 0.0f;
    size_t i = 0, es = bf ? 2 : 4;
    for (; i + LANES <= n; i += LANES) {
        if (ahead) {
            __builtin_prefetch((const char *)ahead + i * es);
            __builtin_prefetch((const char *)ahead + i * es + 64);
        }
#pragma omp simd
        for (int j = 0; j < LANES; j++) acc[j] += ampc__cpu_ld(x, i + j, bf);
    }
    for (; i < n; i++) tail += ampc__cpu_ld(x, i, bf);
    for (int h = LANES / 2; h > 0; h /= 2)
        for (int j = 0; j < h; j++) acc[j] += acc[j + h];
    return acc[0] + tail;
}
AMPC_CPU_VEC static float sum_f32(const void *x, size_t n, const void *ahead) { return sum_body(x, n, ahead, false); }
AMPC_CPU_VEC static float sum_bf16(const void *x, size_t n, const void *ahead) { return sum_body(x, n, ahead, true); }

/* acc[i] += x[i] */
AMPC_CPU_INLINE void acc_body(float *restrict acc, const void *restrict x, size_t n, bool bf) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) acc[i] += ampc__cpu_ld(x, i, bf);
}
AMPC_CPU_VEC static void acc_f32(float *restrict acc, const void *restrict x, size_t n) { acc_body(acc, x, n, false); }
AMPC_CPU_VEC static void acc_bf16(float *restrict acc, const void *restrict x, size_t n) { acc_body(acc, x, n, true); }

/* Sum of x's elements [i, i+m), m <= CHUNK: read in place (f32, bf16) or through buf (f16);
   for the in-place reads, elements [pf, pf+m) are prefetched alongside (pf == i: none). */
static float seg_sum(const ampc_tensor *x, size_t i, size_t m, size_t pf, float *buf) {
    const void *ahead = pf != i && ampc__cpu_direct(x->dtype) ? ampc__cpu_at(x, pf) : NULL;
    if (x->dtype == AMPC_BF16) return sum_bf16(ampc__cpu_at(x, i), m, ahead);
    return sum_f32(ampc__cpu_load(x, i, m, buf), m, ahead);
}

/* acc[j] += x[i + j] for j < m (any length), read as seg_sum reads; buf holds CHUNK values. */
static void seg_acc(float *acc, const ampc_tensor *x, size_t i, size_t m, float *buf) {
    if (x->dtype == AMPC_BF16) {
        acc_bf16(acc, ampc__cpu_at(x, i), m);
        return;
    }
    for (size_t j = 0; j < m; j += CHUNK) {
        size_t k = min_sz(CHUNK, m - j);
        acc_f32(acc + j, ampc__cpu_load(x, i + j, k, buf), k);
    }
}

/* Stores the f32 results res (out's numel) into out, unless res is out's own storage. */
static void store_results(ampc_tensor *out, const float *res) {
    if (out->dtype != AMPC_F32) ampc__dt(out->dtype)->from_f32(res, ampc__data(out), (size_t)out->numel);
}

/* x as (outer, dim) rows, each summed: res[o] = alpha * sum_d x[o, d], in chunks of CHUNK
   values whose sums are added in order. Long rows split into RBLK blocks, summed in parallel,
   whose partial sums are added in order at the end. */
static int reduce_rows(const ampc_tensor *x, int64_t outer, int64_t dim, float alpha, float *res) {
    if (dim <= RBLK) {
#pragma omp parallel for num_threads(ampc__threads_for(outer * dim)) schedule(static)
        for (int64_t o = 0; o < outer; o++) {
            float buf[CHUNK], acc = 0.0f;
            for (int64_t c = 0; c < dim; c += CHUNK) {
                size_t i = (size_t)(o * dim + c);
                acc += seg_sum(x, i, min_sz(CHUNK, (size_t)(dim - c)), i, buf);
            }
            res[o] = alpha * acc;
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
            size_t i = (size_t)(o * dim + c);
            acc += seg_sum(x, i, min_sz(CHUNK, (size_t)(e - c)), i, buf);
        }
        part[u] = acc;
    }
    for (int64_t o = 0; o < outer; o++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nblk; b++) acc += part[o * nblk + b];
        res[o] = alpha * acc;
    }
    ampc__free(AMPC_DEVICE_CPU, part, block, AMPC_MEM_WORKSPACE);
    return AMPC_OK;
}

/* x as (outer, dim, inner), inner > 1: res[o, i] = alpha * sum_d x[o, d, i], vectorized over
   i (the bias gradient of (N, C) is outer 1, dim N, inner C). Work units are (o, column
   block of up to MCOLS, block of rows): whole rows of a bias gradient, so a unit reads
   contiguous memory. Blocks of long dims write partial sums added in order afterwards. */
static int reduce_middle(const ampc_tensor *x, int64_t outer, int64_t dim, int64_t inner, float alpha, float *res) {
    int64_t cw = inner < MCOLS ? inner : MCOLS, ncol = (inner + MCOLS - 1) / MCOLS;
    int64_t rows_blk = RBLK / cw > 0 ? RBLK / cw : 1, nblk = (dim + rows_blk - 1) / rows_blk;
    int64_t n_units = outer * ncol * nblk;
    size_t block = 0;
    float *part = NULL;
    if (nblk > 1) {
        part = ampc__alloc(AMPC_DEVICE_CPU, (size_t)(outer * nblk * inner) * sizeof(float), AMPC_MEM_WORKSPACE, &block);
        if (!part) return ampc_last_status();
    }
#pragma omp parallel for num_threads(ampc__threads_for(outer * dim * inner)) schedule(static)
    for (int64_t u = 0; u < n_units; u++) {
        float acc[MCOLS], buf[CHUNK];
        int64_t o = u / (ncol * nblk), c = (u / nblk) % ncol, b = u % nblk;
        int64_t c0 = c * MCOLS, m = inner - c0 < MCOLS ? inner - c0 : MCOLS;
        int64_t d0 = b * rows_blk, d1 = d0 + rows_blk < dim ? d0 + rows_blk : dim;
        for (int64_t i = 0; i < m; i++) acc[i] = 0.0f;
        for (int64_t d = d0; d < d1; d++) seg_acc(acc, x, (size_t)((o * dim + d) * inner + c0), (size_t)m, buf);
        float *dst = part ? part + (o * nblk + b) * inner + c0 : res + o * inner + c0;
        float scale = part ? 1.0f : alpha;
        for (int64_t i = 0; i < m; i++) dst[i] = scale * acc[i];
    }
    if (part) {   /* the blocks' partial sums in block order, MCOLS columns at a time */
        int64_t n_cols = outer * ncol;
#pragma omp parallel for num_threads(ampc__threads_for(outer * inner * nblk)) schedule(static)
        for (int64_t u = 0; u < n_cols; u++) {
            int64_t o = u / ncol, c0 = (u % ncol) * MCOLS, m = inner - c0 < MCOLS ? inner - c0 : MCOLS;
            float acc[MCOLS];
            memcpy(acc, part + o * nblk * inner + c0, (size_t)m * sizeof(float));
            for (int64_t b = 1; b < nblk; b++) acc_f32(acc, part + (o * nblk + b) * inner + c0, (size_t)m);
            for (int64_t i = 0; i < m; i++) res[o * inner + c0 + i] = alpha * acc[i];
        }
        ampc__free(AMPC_DEVICE_CPU, part, block, AMPC_MEM_WORKSPACE);
    }
    return AMPC_OK;
}

/* x as (outer, C, inner), summed over outer and inner: res[c] = alpha * sum x[:, c, :] (the
   bias gradient of an NCHW convolution). One thread per channel adds the chunk sums of its
   runs in order, prefetching the run some 4 KiB ahead while it reads one. */
static void reduce_channels(const ampc_tensor *x, int64_t outer, int64_t C, int64_t inner, float alpha, float *res) {
    int nt = ampc__threads_for(x->numel);
    int64_t run_bytes = inner * (int64_t)ampc__dt(x->dtype)->size, k = run_bytes >= 4096 ? 1 : 4096 / run_bytes;
#pragma omp parallel for num_threads(C < nt ? (int)C : nt) schedule(static)
    for (int64_t ch = 0; ch < C; ch++) {
        float buf[CHUNK], acc = 0.0f;
        for (int64_t o = 0; o < outer; o++) {
            size_t run = (size_t)((o * C + ch) * inner), ahead = (size_t)(((o + k < outer ? o + k : o) * C + ch) * inner);
            for (int64_t c = 0; c < inner; c += CHUNK)
                acc += seg_sum(x, run + (size_t)c, min_sz(CHUNK, (size_t)(inner - c)), ahead + (size_t)c, buf);
        }
        res[ch] = alpha * acc;
    }
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
    bplan p = {.nd = x->ndim > out->ndim ? x->ndim : out->ndim};
    for (int i = 0; i < p.nd; i++) {
        int j = x->ndim - p.nd + i;
        p.shape[i] = j >= 0 ? x->shape[j] : 1;
    }
    ampc__broadcast_strides(out, p.nd, p.st[0]);
    if (x->numel == out->numel) return cpu_unary(AMPC_OP_MUL_SCALAR, x, out, alpha);   /* nothing summed */
    float a = (float)alpha;
    plan_collapse(&p, 1);
    /* f32 results go straight into an f32 out (also for a 16-bit x: a bias gradient in fp32,
       unrounded), else into scratch converted at the end */
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
    } else if (p.nd == 3 && p.st[0][0] == 0 && p.st[0][2] == 0) {   /* (N, C, S) -> (C) */
        reduce_channels(x, p.shape[0], p.shape[1], p.shape[2], a, res);
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
