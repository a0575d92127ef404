/*
 * test_cl_kernels.c - the CPU batch-norm and pooling kernels on channels-last (NHWC) tensors,
 * called through the backend table: every result against the same kernel on contiguous (NCHW)
 * tensors holding the same values and against the REF backend in f64, for f32/bf16/f16, odd
 * sizes (C not a multiple of 16, fewer rows than row blocks, rows longer than a staging chunk),
 * plus the centred variance under a large offset and thread-count independence.
 * The NHWC permutation is written here, independently of the library's copy kernels.
 */
#include "testutil.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"

static const ampc_dtype cpu_dtypes[] = {AMPC_F32, AMPC_BF16, AMPC_F16};
static const double U32 = 0x1p-24;   /* f32 unit roundoff: the kernels compute in f32 */

// ---------------------------------------------------------------------------------------------
// Tensors from logical (n, c, h, w) values, stored contiguous or channels-last

/* Storage index of logical element i of an (N, C, H, W) tensor. */
static int64_t store_at(const int64_t *sh, bool cl, int64_t i) {
    if (!cl) return i;
    int64_t C = sh[1], HW = sh[2] * sh[3], n = i / (C * HW), c = i / HW % C, hw = i % HW;
    return (n * HW + hw) * C + c;
}

/* A tensor of dtype dt on dev (in the current scope) holding v (logical order, numel values,
   exact in dt) in the given layout; v NULL: zeros. */
static ampc_tensor *mk(ampc_device dev, ampc_dtype dt, int nd, const int64_t *sh, bool cl, const double *v);

/* On CUDA: made on the CPU and copied (ampc_tensor_to keeps the memory format). */
static ampc_tensor *mk_dev(ampc_device dev, ampc_dtype dt, int nd, const int64_t *sh, bool cl, const double *v) {
    if (dev != AMPC_DEVICE_CUDA) return mk(dev, dt, nd, sh, cl, v);
    ampc_tensor *t = ampc_tensor_to(mk(AMPC_DEVICE_CPU, dt, nd, sh, cl, v), AMPC_DEVICE_CUDA, dt);
    ASSERT_NOT_NULL_MSG(t);
    assert_int_equal(ampc_tensor_memory_format(t), cl ? AMPC_CHANNELS_LAST : AMPC_CONTIGUOUS_FORMAT);
    return t;
}

static ampc_tensor *mk(ampc_device dev, ampc_dtype dt, int nd, const int64_t *sh, bool cl, const double *v) {
    if (dev == AMPC_DEVICE_CUDA) return mk_dev(dev, dt, nd, sh, cl, v);
    ampc_tensor *t = ampc__scope_adopt(ampc__tensor_new_fmt(dt, dev, nd, sh, cl ? AMPC_CHANNELS_LAST : AMPC_CONTIGUOUS_FORMAT));
    ASSERT_NOT_NULL_MSG(t);
    size_t n = (size_t)ampc_tensor_numel(t);
    if (dt == AMPC_F64) {
        double *p = ampc__data(t);
        for (size_t i = 0; i < n; i++) p[store_at(sh, cl, (int64_t)i)] = v ? v[i] : 0;
        return t;
    }
    float *f = malloc((n ? n : 1) * sizeof *f);
    for (size_t i = 0; i < n; i++) f[store_at(sh, cl, (int64_t)i)] = v ? (float)v[i] : 0;
    ampc__dt(dt)->from_f32(f, ampc__data(t), n);
    free(f);
    return t;
}

/* Values of t in logical order (malloc'd), read from its storage by hand. */
static double *vals(const ampc_tensor *t) {
    if (ampc_tensor_device(t) == AMPC_DEVICE_CUDA) {
        t = ampc_tensor_to(t, AMPC_DEVICE_CPU, ampc_tensor_dtype(t));
        ASSERT_NOT_NULL_MSG(t);
    }
    size_t n = (size_t)ampc_tensor_numel(t);
    double *v = malloc((n ? n : 1) * sizeof *v);
    bool cl = ampc_tensor_memory_format(t) == AMPC_CHANNELS_LAST;
    const int64_t *sh = ampc_tensor_shape(t);
    if (ampc_tensor_dtype(t) == AMPC_F64) {
        const double *p = ampc__data(t);
        for (size_t i = 0; i < n; i++) v[i] = p[store_at(sh, cl, (int64_t)i)];
        return v;
    }
    float *f = malloc((n ? n : 1) * sizeof *f);
    ampc__dt(ampc_tensor_dtype(t))->to_f32(ampc__data(t), f, n);
    for (size_t i = 0; i < n; i++) v[i] = f[store_at(sh, cl, (int64_t)i)];
    free(f);
    return v;
}

static double max_abs(const double *v, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs(v[i]));
    return m;
}

/* n values uniform in [lo, hi), rounded to dt */
static double *rand_vals(size_t n, uint64_t seed, double lo, double hi, ampc_dtype dt) {
    double *v = malloc((n ? n : 1) * sizeof *v);
    tu_fill_uniform(v, n, seed, lo, hi);
    for (size_t i = 0; i < n; i++) v[i] = tu_round_to(dt, v[i]);
    return v;
}

// ---------------------------------------------------------------------------------------------
// Batch norm

typedef struct {
    bool training, weight, bias;
} bn_cfg;

/* Outputs of one batch norm forward + backward on one device/layout: y, gx (numel), then
   save_mean, save_invstd, running mean, running var, gw, gb (C each), all logical order. */
typedef struct {
    double *y, *gx, *stat[6];
} bn_out;

static void bn_out_free(bn_out *o) {
    free(o->y), free(o->gx);
    for (int i = 0; i < 6; i++) free(o->stat[i]);
}

static bn_out run_bn(ampc_device dev, ampc_dtype dt, const int64_t *sh, bool cl, const bn_cfg *cfg, const double *x,
                     const double *gy, const double *w, const double *b) {
    const ampc_backend *be = ampc__backend(dev);
    ampc_dtype sdt = dev == AMPC_DEVICE_REF ? AMPC_F64 : AMPC_F32;
    int64_t C = sh[1];
    double *rm0 = malloc((size_t)C * sizeof *rm0), *rv0 = malloc((size_t)C * sizeof *rv0);
    for (int64_t c = 0; c < C; c++) rm0[c] = 0.1 * (double)(c % 7) - 0.2, rv0[c] = 0.5 + 0.25 * (double)(c % 5);
    ampc_scope_begin();
    ampc_tensor *xt = mk(dev, dt, 4, sh, cl, x), *gyt = mk(dev, dt, 4, sh, cl, gy);
    ampc_tensor *y = mk(dev, dt, 4, sh, cl, NULL), *gx = mk(dev, dt, 4, sh, cl, NULL);
    ampc_tensor *wt = cfg->weight ? mk(dev, sdt, 1, &C, false, w) : NULL, *bt = cfg->bias ? mk(dev, sdt, 1, &C, false, b) : NULL;
    ampc_tensor *rm = mk(dev, sdt, 1, &C, false, rm0), *rv = mk(dev, sdt, 1, &C, false, rv0);
    ampc_tensor *sm = mk(dev, sdt, 1, &C, false, NULL), *si = mk(dev, sdt, 1, &C, false, NULL);
    ampc_tensor *gw = mk(dev, sdt, 1, &C, false, NULL), *gb = mk(dev, sdt, 1, &C, false, NULL);
    ASSERT_OK(be->batch_norm(xt, wt, bt, rm, rv, y, sm, si, cfg->training, 0.1, 1e-5, false));
    ASSERT_OK(be->batch_norm_backward(xt, gyt, wt, sm, si, cfg->training, false, gx, gw, gb));
    bn_out o = {vals(y), vals(gx), {vals(sm), vals(si), vals(rm), vals(rv), vals(gw), vals(gb)}};
    ampc_scope_end();
    free(rm0), free(rv0);
    return o;
}

static const char *stat_names[] = {"save_mean", "save_invstd", "running_mean", "running_var", "gw", "gb"};

/* got against ref (both bn_out) with tolerances derived from the formulas. x, gy: the inputs. */
static void check_bn(const char *what, const bn_out *got, const bn_out *ref, ampc_dtype dt, const int64_t *sh,
                     const bn_cfg *cfg, const double *x, const double *gy, const double *w, const double *b) {
    int64_t N = sh[0], C = sh[1], HW = sh[2] * sh[3], n = N * C * HW;
    double M = (double)(N * HW), e = tu_eps(dt);
    char msg[192];
    /* statistics: f64 sums rounded to f32 (invstd: a sqrt and a division more); the running
       ones start from buffers rounded to f32 (REF's are exact), a relative 2^-24 of the largest */
    for (int s = 0; s < 4; s++) {
        snprintf(msg, sizeof msg, "%s %s", what, stat_names[s]);
        tu_assert_close(msg, got->stat[s], ref->stat[s], (size_t)C, 4 * U32 * max_abs(ref->stat[s], (size_t)C), 4 * U32);
    }
    /* y = (x - m) a + b in f32 with coefficients rounded to f32, one rounding to dt: each term
       bounded by |y| + 2 |b| */
    double ty = 16 * U32 * (max_abs(ref->y, (size_t)n) + 2 * (b && cfg->bias ? max_abs(b, (size_t)C) : 0));
    snprintf(msg, sizeof msg, "%s y", what);
    tu_assert_close(msg, got->y, ref->y, (size_t)n, ty, 2 * e);
    /* gx = k gy + a (x - m) + c: f32 terms each bounded by T (from the reference's statistics
       and sums), one rounding to dt */
    double T = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t c = i / HW % C;
        /* |x - m| + |m|: the backward's mean is the saved f32 one (off by 2^-24 |m|) */
        double is = ref->stat[1][c], wc = cfg->weight ? w[c] : 1, k = wc * is;
        double xm = fabs(x[i] - ref->stat[0][c]) + fabs(ref->stat[0][c]);
        double a = cfg->training ? k * is * fabs(ref->stat[4][c]) / M : 0, c0 = cfg->training ? k * fabs(ref->stat[5][c]) / M : 0;
        T = fmax(T, fabs(k * gy[i]) + a * xm + c0);
    }
    snprintf(msg, sizeof msg, "%s gx", what);
    tu_assert_close(msg, got->gx, ref->gx, (size_t)n, 32 * U32 * T, 2 * e);
    /* gw = sum(gy (x - m)) invstd with the mean in f32: off by (m32 - m) sum(gy) invstd;
       gb = sum(gy): f64 sums of exact products, one f32 rounding */
    for (int64_t c = 0; c < C; c++) {
        double sa = 0, sx = 0, is = ref->stat[1][c], m = ref->stat[0][c];
        for (int64_t r = 0; r < N; r++)
            for (int64_t i = 0; i < HW; i++) {
                int64_t j = (r * C + c) * HW + i;
                sa += fabs(gy[j]), sx += fabs(gy[j] * (x[j] - m));
            }
        double tw = 4 * U32 * fabs(ref->stat[4][c]) + (U32 * fabs(m) * sa + M * 0x1p-50 * sx) * is * 2;
        double tb = 4 * U32 * fabs(ref->stat[5][c]) + M * 0x1p-50 * sa;
        if (fabs(got->stat[4][c] - ref->stat[4][c]) > tw || fabs(got->stat[5][c] - ref->stat[5][c]) > tb)
            fail_msg("%s channel %lld: gw %.9g vs %.9g (tol %.3g), gb %.9g vs %.9g (tol %.3g)", what, (long long)c,
                     got->stat[4][c], ref->stat[4][c], tw, got->stat[5][c], ref->stat[5][c], tb);
    }
}

static void bn_case(ampc_dtype dt, const int64_t *sh, const bn_cfg *cfg, uint64_t seed) {
    int64_t C = sh[1], n = sh[0] * C * sh[2] * sh[3];
    double *x = rand_vals((size_t)n, seed, -1, 3, dt), *gy = rand_vals((size_t)n, seed + 1, -1, 1, dt);
    double *w = rand_vals((size_t)C, seed + 2, 0.5, 1.5, AMPC_F32), *b = rand_vals((size_t)C, seed + 3, -1, 1, AMPC_F32);
    bn_out cl = run_bn(AMPC_DEVICE_CPU, dt, sh, true, cfg, x, gy, w, b);
    bn_out nchw = run_bn(AMPC_DEVICE_CPU, dt, sh, false, cfg, x, gy, w, b);
    bn_out ref = run_bn(AMPC_DEVICE_REF, AMPC_F64, sh, false, cfg, x, gy, w, b);
    char what[160];
    snprintf(what, sizeof what, "bn %s (%lld,%lld,%lld,%lld) train %d w %d b %d", ampc_dtype_name(dt), (long long)sh[0],
             (long long)sh[1], (long long)sh[2], (long long)sh[3], cfg->training, cfg->weight, cfg->bias);
    char w1[192], w2[192];
    snprintf(w1, sizeof w1, "%s: cl vs ref", what);
    snprintf(w2, sizeof w2, "%s: cl vs nchw", what);
    check_bn(w1, &cl, &ref, dt, sh, cfg, x, gy, w, b);
    check_bn(w2, &cl, &nchw, dt, sh, cfg, x, gy, w, b);
    bn_out_free(&cl), bn_out_free(&nchw), bn_out_free(&ref);
    free(x), free(gy), free(w), free(b);
}

static void test_batch_norm_cl(void **state) {
    (void)state;
    const int64_t shapes[][4] = {
        {2, 3, 5, 7},     /* M 70: C far below a vector */
        {3, 19, 4, 5},    /* C 19 */
        {1, 37, 3, 3},    /* M 9: fewer rows than row blocks */
        {4, 40, 9, 11},   /* several tiles per block */
        {2, 5, 1, 1},     /* M 2 */
        {3, 33, 30, 30},  /* 2700 rows (threads when the machine has them) */
    };
    const bn_cfg cfgs[] = {{true, true, true}, {true, false, false}, {true, true, false}, {false, true, true}, {false, false, false}};
    for (size_t d = 0; d < sizeof cpu_dtypes / sizeof *cpu_dtypes; d++)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
            for (size_t c = 0; c < sizeof cfgs / sizeof *cfgs; c++) bn_case(cpu_dtypes[d], shapes[s], &cfgs[c], 10 * s + c);
}

/* Rows longer than a staging chunk (C > 1024 values: f16 stages parts of a row) */
static void test_batch_norm_cl_long_rows(void **state) {
    (void)state;
    const int64_t sh[] = {2, 1100, 2, 3};
    const bn_cfg train = {true, true, true}, eval = {false, true, true};
    for (size_t d = 0; d < sizeof cpu_dtypes / sizeof *cpu_dtypes; d++) {
        ampc_dtype dt = cpu_dtypes[d];
        int64_t C = sh[1], n = sh[0] * C * sh[2] * sh[3];
        double *x = rand_vals((size_t)n, 5, -1, 3, dt), *gy = rand_vals((size_t)n, 6, -1, 1, dt);
        double *w = rand_vals((size_t)C, 7, 0.5, 1.5, AMPC_F32), *b = rand_vals((size_t)C, 8, -1, 1, AMPC_F32);
        for (int k = 0; k < 2; k++) {
            const bn_cfg *cfg = k ? &eval : &train;
            bn_out cl = run_bn(AMPC_DEVICE_CPU, dt, sh, true, cfg, x, gy, w, b);
            bn_out nchw = run_bn(AMPC_DEVICE_CPU, dt, sh, false, cfg, x, gy, w, b);
            bn_out ref = run_bn(AMPC_DEVICE_REF, AMPC_F64, sh, false, cfg, x, gy, w, b);
            char what[96];
            snprintf(what, sizeof what, "bn long rows %s train %d: cl vs nchw", ampc_dtype_name(dt), cfg->training);
            check_bn(what, &cl, &nchw, dt, sh, cfg, x, gy, w, b);
            snprintf(what, sizeof what, "bn long rows %s train %d: cl vs ref", ampc_dtype_name(dt), cfg->training);
            check_bn(what, &cl, &ref, dt, sh, cfg, x, gy, w, b);
            bn_out_free(&cl), bn_out_free(&nchw), bn_out_free(&ref);
        }
        free(x), free(gy), free(w), free(b);
    }
}

/* x = 1000 + noise (f32; channel c's noise scaled by 1 + c) of an (N, C, HW) tensor, logical
   order; outlier >= 0: that channel's first value is 1000.5. The batch mean, unbiased and biased
   variances per channel, in f64, into want_m, want_v, want_vb. */
static double *offset_input(int64_t N, int64_t C, int64_t HW, int outlier, double *want_m, double *want_v, double *want_vb) {
    int64_t n = N * C * HW;
    double *x = malloc((size_t)n * sizeof *x);
    tu_fill_uniform(x, (size_t)n, 11, -0.01, 0.01);
    for (int64_t i = 0; i < n; i++) x[i] = tu_round_to(AMPC_F32, 1000 + x[i] * (1 + (double)(i / HW % C)));
    if (outlier >= 0) x[outlier * HW] = 1000.5;
    for (int64_t c = 0; c < C; c++) {
        double s = 0, q = 0;
        for (int64_t r = 0; r < N; r++)
            for (int64_t i = 0; i < HW; i++) s += x[(r * C + c) * HW + i];
        want_m[c] = s / (double)(N * HW);
        for (int64_t r = 0; r < N; r++)
            for (int64_t i = 0; i < HW; i++) q += (x[(r * C + c) * HW + i] - want_m[c]) * (x[(r * C + c) * HW + i] - want_m[c]);
        want_v[c] = q / (double)(N * HW - 1);
        want_vb[c] = q / (double)(N * HW);
    }
    return x;
}

/* x = 1000 + noise per channel: the variance (~1e-5) survives (centred sums at every merge of
   tiles and blocks); many tiles and all row blocks in use. */
static void test_batch_norm_cl_offset(void **state) {
    (void)state;
    const int64_t sh[] = {8, 5, 40, 40}, C = 5, HW = 1600, N = 8, n = 8 * 5 * 1600;
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_CPU);
    double want_m[5], want_v[5], want_vb[5], *x = offset_input(N, C, HW, -1, want_m, want_v, want_vb);
    ampc_scope_begin();
    ampc_tensor *xt = mk(AMPC_DEVICE_CPU, AMPC_F32, 4, sh, true, x), *y = mk(AMPC_DEVICE_CPU, AMPC_F32, 4, sh, true, NULL);
    ampc_tensor *rm = mk(AMPC_DEVICE_CPU, AMPC_F32, 1, &C, false, NULL), *rv = mk(AMPC_DEVICE_CPU, AMPC_F32, 1, &C, false, NULL);
    /* momentum 1: the buffers receive the batch mean and unbiased variance */
    ASSERT_OK(be->batch_norm(xt, NULL, NULL, rm, rv, y, NULL, NULL, true, 1.0, 0.0, false));
    double *gm = vals(rm), *gv = vals(rv), *gy = vals(y), *want = malloc((size_t)n * sizeof *want);
    for (int64_t i = 0; i < n; i++) want[i] = (x[i] - want_m[i / HW % C]) / sqrt(want_vb[i / HW % C]);
    tu_assert_close("cl offset running_mean", gm, want_m, (size_t)C, 0, 8 * U32);
    tu_assert_close("cl offset running_var", gv, want_v, (size_t)C, 0, 8 * U32);
    /* x - m exact, the mean's f32 rounding compensated in the shift; |y| <= ~1.8 */
    tu_assert_close("cl offset y", gy, want, (size_t)n, 16 * U32 * 1.8, 16 * U32);
    free(x), free(gm), free(gv), free(gy), free(want);
    ampc_scope_end();
}

/* Same bits with 1 and 2 threads: row blocks and tiles depend only on the shape. */
static void test_batch_norm_cl_threads(void **state) {
    (void)state;
    const int64_t sh[] = {4, 24, 33, 31};
    const bn_cfg cfg = {true, true, true};
    int saved = omp_get_max_threads();
    for (size_t d = 0; d < sizeof cpu_dtypes / sizeof *cpu_dtypes; d++) {
        ampc_dtype dt = cpu_dtypes[d];
        int64_t C = sh[1], n = sh[0] * C * sh[2] * sh[3];
        double *x = rand_vals((size_t)n, 21, -1, 3, dt), *gy = rand_vals((size_t)n, 22, -1, 1, dt);
        double *w = rand_vals((size_t)C, 23, 0.5, 1.5, AMPC_F32), *b = rand_vals((size_t)C, 24, -1, 1, AMPC_F32);
        omp_set_num_threads(1);
        bn_out a = run_bn(AMPC_DEVICE_CPU, dt, sh, true, &cfg, x, gy, w, b);
        omp_set_num_threads(2);
        bn_out o = run_bn(AMPC_DEVICE_CPU, dt, sh, true, &cfg, x, gy, w, b);
        if (memcmp(a.y, o.y, (size_t)n * sizeof *a.y) || memcmp(a.gx, o.gx, (size_t)n * sizeof *a.gx))
            fail_msg("%s: y or gx differ between 1 and 2 threads", ampc_dtype_name(dt));
        for (int s = 0; s < 6; s++)
            if (memcmp(a.stat[s], o.stat[s], (size_t)C * sizeof(double)))
                fail_msg("%s: %s differs between 1 and 2 threads", ampc_dtype_name(dt), stat_names[s]);
        bn_out_free(&a), bn_out_free(&o);
        free(x), free(gy), free(w), free(b);
    }
    omp_set_num_threads(saved);
}

/* Mixed layouts are refused (by the door, for every device). */
static void test_batch_norm_cl_mixed_formats(void **state) {
    (void)state;
    const int64_t sh[] = {2, 3, 4, 4}, C = 3;
    ampc_scope_begin();
    ampc_tensor *x = mk(AMPC_DEVICE_CPU, AMPC_F32, 4, sh, true, NULL), *y = mk(AMPC_DEVICE_CPU, AMPC_F32, 4, sh, false, NULL);
    ampc_tensor *sm = mk(AMPC_DEVICE_CPU, AMPC_F32, 1, &C, false, NULL), *si = mk(AMPC_DEVICE_CPU, AMPC_F32, 1, &C, false, NULL);
    assert_int_equal(ampc__k_batch_norm(x, NULL, NULL, NULL, NULL, y, sm, si, true, 0.1, 1e-5, false), AMPC_ERR_INVALID);
    ampc_clear_error();
    assert_int_equal(ampc__k_batch_norm_backward(x, y, NULL, sm, si, true, false, x, NULL, NULL), AMPC_ERR_INVALID);
    ampc_clear_error();
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Pooling

typedef struct {
    const char *name;
    ampc_pool_kind kind;
    int k[2], s[2], p[2];
    bool ceil_mode;
    int64_t OH, OW;   /* adaptive output size */
} pool_cfg;

/* PyTorch's output size (pooling_output_shape); *pad_end: the padding after the last row. */
static int64_t out_size(int64_t H, int k, int s, int p, bool ceil_mode, int *pad_end) {
    int64_t num = H + 2 * p - k, o = (ceil_mode ? (num + s - 1) / s : num / s) + 1;
    if (ceil_mode && (o - 1) * s >= H + p) o--;
    *pad_end = (int)((o - 1) * s + k - H - p);
    if (*pad_end < p) *pad_end = p;   /* floor mode may leave part of the padding unused */
    return o;
}

static ampc_pool_desc pool_desc(const pool_cfg *c, const int64_t *sh, bool cl) {
    ampc_pool_desc d = {.kind = c->kind, .N = sh[0], .C = sh[1], .H = sh[2], .W = sh[3], .channels_last = cl};
    if (c->kind == AMPC_POOL_ADAPTIVE_AVG) {
        d.OH = c->OH, d.OW = c->OW;
        return d;
    }
    for (int a = 0; a < 2; a++) {
        d.kernel[a] = c->k[a], d.stride[a] = c->s[a], d.pad_begin[a] = c->p[a];
        int64_t o = out_size(a ? sh[3] : sh[2], c->k[a], c->s[a], c->p[a], c->ceil_mode, &d.pad_end[a]);
        if (a) d.OW = o;
        else d.OH = o;
    }
    return d;
}

/* y (forward) and gx (backward of gy) of one pooling on one device/layout, logical order. */
static void run_pool(ampc_device dev, ampc_dtype dt, const pool_cfg *c, const int64_t *sh, bool cl, const double *x,
                     const double *gy, double **y_out, double **gx_out) {
    const ampc_backend *be = ampc__backend(dev);
    ampc_pool_desc d = pool_desc(c, sh, cl);
    int64_t osh[4] = {sh[0], sh[1], d.OH, d.OW};
    ampc_scope_begin();
    ampc_tensor *xt = mk(dev, dt, 4, sh, cl, x), *y = mk(dev, dt, 4, osh, cl, NULL);
    ampc_tensor *gyt = mk(dev, dt, 4, osh, cl, gy), *gx = mk(dev, dt, 4, sh, cl, NULL);
    size_t wsz = be->pool2d_workspace_size(&d, dt);
    void *ws = NULL, *host_ws = NULL;
    if (wsz && dev == AMPC_DEVICE_CUDA) {   /* device memory: a tensor of the allocator's */
        int64_t nw = (int64_t)(wsz / 4 + 1);
        ws = ampc__data(mk(dev, AMPC_F32, 1, &nw, false, NULL));
    } else if (wsz) {
        ws = host_ws = aligned_alloc(64, (wsz + 63) / 64 * 64);
    }
    ASSERT_OK(be->pool2d(&d, xt, y, ws));
    ASSERT_OK(be->pool2d_backward(&d, gyt, gx, ws));
    *y_out = vals(y);
    *gx_out = vals(gx);
    free(host_ws);
    ampc_scope_end();
}

/* Values distinct within a plane of up to 251 elements and exact in every dtype (integers up to
   251, scaled by 1/64), so that max pooling has no ties. */
static double *pool_input(const int64_t *sh) {
    int64_t n = sh[0] * sh[1] * sh[2] * sh[3], HW = sh[2] * sh[3];
    double *v = malloc((size_t)n * sizeof *v);
    assert_true(HW <= 251);
    for (int64_t i = 0; i < n; i++) v[i] = (double)(((i % HW) * 37 + (i / HW) * 11) % 251 - 125) / 64;
    return v;
}

/* A pooling's y and gx (logical order) against another run's, "<what> y <pair>" / "<what> gx
   <pair>" in the messages. k: values summed into an output (window area) or into an input
   gradient (overlapping windows); f32 sums of k terms bounded by max|x| or max|gy|, one rounding
   to dt. */
static void check_pool(const char *what, const char *pair, ampc_dtype dt, const pool_cfg *c, const int64_t *sh, const double *x,
                       const double *gy, const double *y, const double *gx, const double *y_want, const double *gx_want) {
    ampc_pool_desc d = pool_desc(c, sh, false);
    int64_t n = sh[0] * sh[1] * sh[2] * sh[3], no = sh[0] * sh[1] * d.OH * d.OW;
    double k = c->kind == AMPC_POOL_ADAPTIVE_AVG ? (double)((sh[2] / d.OH + 2) * (sh[3] / d.OW + 2)) : c->k[0] * c->k[1];
    double kb = c->kind == AMPC_POOL_ADAPTIVE_AVG ? 4 : (double)((c->k[0] + c->s[0] - 1) / c->s[0] * ((c->k[1] + c->s[1] - 1) / c->s[1]));
    double e = tu_eps(dt), ty = 2 * k * U32 * max_abs(x, (size_t)n), tg = 2 * kb * U32 * max_abs(gy, (size_t)no);
    char msg[200];
    snprintf(msg, sizeof msg, "%s y %s", what, pair);
    tu_assert_close(msg, y, y_want, (size_t)no, ty, 2 * e);
    snprintf(msg, sizeof msg, "%s gx %s", what, pair);
    tu_assert_close(msg, gx, gx_want, (size_t)n, tg, 2 * e);
}

static void pool_case(ampc_dtype dt, const pool_cfg *c, const int64_t *sh) {
    ampc_pool_desc d = pool_desc(c, sh, false);
    int64_t no = sh[0] * sh[1] * d.OH * d.OW;
    double *x = pool_input(sh), *gy = rand_vals((size_t)no, 99, -1, 1, dt);
    double *ycl, *gcl, *y0, *g0, *yr, *gr;
    run_pool(AMPC_DEVICE_CPU, dt, c, sh, true, x, gy, &ycl, &gcl);
    run_pool(AMPC_DEVICE_CPU, dt, c, sh, false, x, gy, &y0, &g0);
    run_pool(AMPC_DEVICE_REF, AMPC_F64, c, sh, false, x, gy, &yr, &gr);
    char what[160];
    snprintf(what, sizeof what, "pool %s %s (%lld,%lld,%lld,%lld)", c->name, ampc_dtype_name(dt), (long long)sh[0],
             (long long)sh[1], (long long)sh[2], (long long)sh[3]);
    check_pool(what, "cl vs ref", dt, c, sh, x, gy, ycl, gcl, yr, gr);
    check_pool(what, "cl vs nchw", dt, c, sh, x, gy, ycl, gcl, y0, g0);
    if (c->kind == AMPC_POOL_MAX)   /* the same maxima, the same routing: exact */
        for (int64_t i = 0; i < no; i++)
            if (ycl[i] != y0[i] || ycl[i] != yr[i]) fail_msg("%s: max y[%lld] %g, nchw %g, ref %g", what, (long long)i, ycl[i], y0[i], yr[i]);
    free(x), free(gy), free(ycl), free(gcl), free(y0), free(g0), free(yr), free(gr);
}

static void test_pool_cl(void **state) {
    (void)state;
    const pool_cfg cfgs[] = {
        {"max_2x2", AMPC_POOL_MAX, {2, 2}, {2, 2}, {0, 0}, false, 0, 0},
        {"max_3x3_s2_p1", AMPC_POOL_MAX, {3, 3}, {2, 2}, {1, 1}, false, 0, 0},
        {"max_3x3_s2_ceil", AMPC_POOL_MAX, {3, 3}, {2, 2}, {0, 0}, true, 0, 0},
        {"max_3x2_rect", AMPC_POOL_MAX, {3, 2}, {1, 2}, {1, 0}, false, 0, 0},
        {"avg_incl_3x3_s2_p1", AMPC_POOL_AVG_INCLUDE_PAD, {3, 3}, {2, 2}, {1, 1}, false, 0, 0},
        {"avg_excl_3x3_s2_p1", AMPC_POOL_AVG_EXCLUDE_PAD, {3, 3}, {2, 2}, {1, 1}, false, 0, 0},
        {"avg_incl_ceil", AMPC_POOL_AVG_INCLUDE_PAD, {3, 3}, {2, 2}, {1, 1}, true, 0, 0},   /* rescaled edge */
        {"avg_excl_ceil", AMPC_POOL_AVG_EXCLUDE_PAD, {3, 3}, {2, 2}, {1, 1}, true, 0, 0},
        {"avg_2x2_ceil", AMPC_POOL_AVG_INCLUDE_PAD, {2, 2}, {2, 2}, {0, 0}, true, 0, 0},
        {"adaptive_3x2", AMPC_POOL_ADAPTIVE_AVG, {0, 0}, {0, 0}, {0, 0}, false, 3, 2},   /* overlapping windows */
        {"adaptive_4x5", AMPC_POOL_ADAPTIVE_AVG, {0, 0}, {0, 0}, {0, 0}, false, 4, 5},
        {"adaptive_1x1", AMPC_POOL_ADAPTIVE_AVG, {0, 0}, {0, 0}, {0, 0}, false, 1, 1},
    };
    const int64_t shapes[][4] = {{2, 3, 7, 9}, {3, 19, 8, 8}, {1, 37, 5, 7}, {2, 40, 11, 13}};
    for (size_t d = 0; d < sizeof cpu_dtypes / sizeof *cpu_dtypes; d++)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
            for (size_t c = 0; c < sizeof cfgs / sizeof *cfgs; c++) pool_case(cpu_dtypes[d], &cfgs[c], shapes[s]);
    /* the global pool of the ResNets: an average over the whole map (kernel = stride = H) */
    const int64_t g[] = {4, 24, 7, 7};
    const pool_cfg global = {"global_avg_7x7", AMPC_POOL_AVG_INCLUDE_PAD, {7, 7}, {7, 7}, {0, 0}, false, 0, 0};
    for (size_t d = 0; d < sizeof cpu_dtypes / sizeof *cpu_dtypes; d++) pool_case(cpu_dtypes[d], &global, g);
}

/* A layout that does not match the descriptor is refused (by the door, for every device). */
static void test_pool_cl_mismatch(void **state) {
    (void)state;
    const int64_t sh[] = {1, 2, 4, 4}, osh[] = {1, 2, 2, 2};
    const pool_cfg c = {"max", AMPC_POOL_MAX, {2, 2}, {2, 2}, {0, 0}, false, 0, 0};
    ampc_pool_desc d = pool_desc(&c, sh, false);
    ampc_scope_begin();
    ampc_tensor *x = mk(AMPC_DEVICE_CPU, AMPC_F32, 4, sh, true, NULL), *y = mk(AMPC_DEVICE_CPU, AMPC_F32, 4, osh, true, NULL);
    assert_int_equal(ampc__k_pool2d(&d, x, y, NULL), AMPC_ERR_INVALID);   /* the door checks */
    ampc_clear_error();
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// The CUDA backend's channels-last kernels (where a GPU is present): C a multiple of the 16-byte
// vector (8 halves, 4 floats) takes the vector kernels, other C the per-element ones; both
// against REF in f64 with the tolerances above.

static void bn_case_cuda(ampc_dtype dt, const int64_t *sh, const bn_cfg *cfg, uint64_t seed, double lo, double hi) {
    int64_t C = sh[1], n = sh[0] * C * sh[2] * sh[3];
    double *x = rand_vals((size_t)n, seed, lo, hi, dt), *gy = rand_vals((size_t)n, seed + 1, -1, 1, dt);
    double *w = rand_vals((size_t)C, seed + 2, 0.5, 1.5, AMPC_F32), *b = rand_vals((size_t)C, seed + 3, -1, 1, AMPC_F32);
    bn_out got = run_bn(AMPC_DEVICE_CUDA, dt, sh, true, cfg, x, gy, w, b);
    bn_out ref = run_bn(AMPC_DEVICE_REF, AMPC_F64, sh, false, cfg, x, gy, w, b);
    char what[160];
    snprintf(what, sizeof what, "cuda bn %s (%lld,%lld,%lld,%lld) train %d w %d b %d x in [%g, %g): cl vs ref", ampc_dtype_name(dt),
             (long long)sh[0], (long long)sh[1], (long long)sh[2], (long long)sh[3], cfg->training, cfg->weight, cfg->bias, lo, hi);
    check_bn(what, &got, &ref, dt, sh, cfg, x, gy, w, b);
    bn_out_free(&got), bn_out_free(&ref);
    free(x), free(gy), free(w), free(b);
}

static void test_batch_norm_cl_cuda(void **state) {
    (void)state;
    if (!tu_cuda_available()) skip();
    const int64_t shapes[][4] = {
        {2, 8, 5, 7},      /* one f16 vector per row */
        {3, 24, 4, 5},     /* 3 vectors: a block of 3 x 85 threads */
        {4, 64, 9, 11},
        {2, 264, 3, 5},    /* 33 (f16) / 66 (f32) vectors: a partial second block column */
        {16, 64, 30, 30},  /* 14,400 rows: many partitions */
        {3, 2048, 2, 3},   /* layer4's width */
        {2, 19, 4, 5},     /* not a multiple of a vector: per-element kernels */
        {2, 1, 1, 1},      /* M 2, one channel */
    };
    const bn_cfg cfgs[] = {{true, true, true}, {true, false, false}, {false, true, true}};
    for (size_t d = 0; d < sizeof cpu_dtypes / sizeof *cpu_dtypes; d++)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
            for (size_t c = 0; c < sizeof cfgs / sizeof *cfgs; c++)
                bn_case_cuda(cpu_dtypes[d], shapes[s], &cfgs[c], 100 + 10 * s + c, -1, 3);
    /* values far from zero: the one-pass sums about the channel's first value keep the variance */
    const bn_cfg train = {true, true, true};
    const int64_t sh[] = {8, 16, 20, 20};
    for (size_t d = 0; d < sizeof cpu_dtypes / sizeof *cpu_dtypes; d++) bn_case_cuda(cpu_dtypes[d], sh, &train, 7, 60, 64);
}

/* x = 1000 + noise (f32, variance ~1e-5), channels-last with C = 8 on the vector kernels: the
   running statistics against f64 sums made here. */
static void test_batch_norm_cl_cuda_offset(void **state) {
    (void)state;
    if (!tu_cuda_available()) skip();
    const int64_t N = 8, C = 8, HW = 1600, sh[] = {8, 8, 40, 40};
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_CUDA);
    double want_m[8], want_v[8], want_vb[8], *x = offset_input(N, C, HW, 3, want_m, want_v, want_vb);
    ampc_scope_begin();
    ampc_tensor *xt = mk(AMPC_DEVICE_CUDA, AMPC_F32, 4, sh, true, x), *y = mk(AMPC_DEVICE_CUDA, AMPC_F32, 4, sh, true, NULL);
    ampc_tensor *rm = mk(AMPC_DEVICE_CUDA, AMPC_F32, 1, &C, false, NULL), *rv = mk(AMPC_DEVICE_CUDA, AMPC_F32, 1, &C, false, NULL);
    ASSERT_OK(be->batch_norm(xt, NULL, NULL, rm, rv, y, NULL, NULL, true, 1.0, 0.0, false));
    double *gm = vals(rm), *gv = vals(rv);
    tu_assert_close("cuda cl offset running_mean", gm, want_m, (size_t)C, 0, 8 * U32);
    tu_assert_close("cuda cl offset running_var", gv, want_v, (size_t)C, 0, 8 * U32);
    free(x), free(gm), free(gv);
    ampc_scope_end();
}

/* batch_norm_relu on the vector kernels equals batch_norm followed by a ReLU, bit for bit: the
   same coefficients, and a backward whose mask is the forward's stored output (gy zeroed where
   y <= 0, then the plain backward). */
static void test_batch_norm_relu_cl_cuda(void **state) {
    (void)state;
    if (!tu_cuda_available()) skip();
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_CUDA);
    const int64_t shapes[][4] = {{4, 64, 9, 11}, {2, 264, 3, 5}, {2, 19, 4, 5}};
    for (size_t d = 0; d < sizeof cpu_dtypes / sizeof *cpu_dtypes; d++)
        for (size_t k = 0; k < sizeof shapes / sizeof *shapes; k++) {
            ampc_dtype dt = cpu_dtypes[d];
            const int64_t *sh = shapes[k];
            int64_t C = sh[1], n = sh[0] * C * sh[2] * sh[3], C3 = AMPC_BN_RELU_STAT_ROWS * C;
            double *x = rand_vals((size_t)n, 31 + k, -2, 2, dt), *gy = rand_vals((size_t)n, 32 + k, -1, 1, dt);
            double *w = rand_vals((size_t)C, 33, 0.5, 1.5, AMPC_F32), *b = rand_vals((size_t)C, 34, -1, 1, AMPC_F32);
            ampc_scope_begin();
            ampc_tensor *xt = mk(AMPC_DEVICE_CUDA, dt, 4, sh, true, x), *gyt = mk(AMPC_DEVICE_CUDA, dt, 4, sh, true, gy);
            ampc_tensor *wt = mk(AMPC_DEVICE_CUDA, AMPC_F32, 1, &C, false, w), *bt = mk(AMPC_DEVICE_CUDA, AMPC_F32, 1, &C, false, b);
            ampc_tensor *y1 = mk(AMPC_DEVICE_CUDA, dt, 4, sh, true, NULL), *y2 = mk(AMPC_DEVICE_CUDA, dt, 4, sh, true, NULL);
            ampc_tensor *st = mk(AMPC_DEVICE_CUDA, AMPC_F32, 1, &C3, false, NULL);
            ampc_tensor *sm = mk(AMPC_DEVICE_CUDA, AMPC_F32, 1, &C, false, NULL), *si = mk(AMPC_DEVICE_CUDA, AMPC_F32, 1, &C, false, NULL);
            ampc_tensor *g1[3], *g2[3];
            for (int j = 0; j < 3; j++) {
                g1[j] = j ? mk(AMPC_DEVICE_CUDA, AMPC_F32, 1, &C, false, NULL) : mk(AMPC_DEVICE_CUDA, dt, 4, sh, true, NULL);
                g2[j] = j ? mk(AMPC_DEVICE_CUDA, AMPC_F32, 1, &C, false, NULL) : mk(AMPC_DEVICE_CUDA, dt, 4, sh, true, NULL);
            }
            ASSERT_OK(be->batch_norm_relu(xt, wt, bt, NULL, NULL, y1, st, true, 0.1, 1e-5, false));
            ASSERT_OK(be->batch_norm(xt, wt, bt, NULL, NULL, y2, sm, si, true, 0.1, 1e-5, false));
            double *v1 = vals(y1), *v2 = vals(y2), *gm = malloc((size_t)n * sizeof *gm);
            for (int64_t i = 0; i < n; i++) {
                double r = v2[i] < 0 ? 0 : v2[i];   /* relu of the stored plain output */
                if (v1[i] != r && !(isnan(v1[i]) && isnan(r)))
                    fail_msg("cuda bn_relu %s shape %zu: y[%lld] %.9g, relu(bn) %.9g", ampc_dtype_name(dt), k, (long long)i, v1[i], r);
                gm[i] = v1[i] > 0 ? gy[i] : 0;
            }
            ampc_tensor *gmt = mk(AMPC_DEVICE_CUDA, dt, 4, sh, true, gm);
            ASSERT_OK(be->batch_norm_relu_backward(xt, gyt, wt, st, true, false, g1[0], g1[1], g1[2]));
            ASSERT_OK(be->batch_norm_backward(xt, gmt, wt, sm, si, true, false, g2[0], g2[1], g2[2]));
            for (int j = 0; j < 3; j++) {
                double *a = vals(g1[j]), *o = vals(g2[j]);
                int64_t m = j ? C : n;
                for (int64_t i = 0; i < m; i++)
                    if (a[i] != o[i])
                        fail_msg("cuda bn_relu %s shape %zu: %s[%lld] %.9g, masked plain backward %.9g", ampc_dtype_name(dt), k,
                                 j == 0 ? "gx" : j == 1 ? "gw" : "gb", (long long)i, a[i], o[i]);
                free(a), free(o);
            }
            free(v1), free(v2), free(gm);
            ampc_scope_end();
            free(x), free(gy), free(w), free(b);
        }
}

static void pool_case_cuda(ampc_dtype dt, const pool_cfg *c, const int64_t *sh, bool ties) {
    ampc_pool_desc d = pool_desc(c, sh, false);
    int64_t n = sh[0] * sh[1] * sh[2] * sh[3], no = sh[0] * sh[1] * d.OH * d.OW, HW = sh[2] * sh[3];
    double *x = pool_input(sh), *gy = rand_vals((size_t)no, 98, -1, 1, dt);
    if (ties)   /* runs of 3 equal values along w: the first of a tie wins */
        for (int64_t i = 0; i < n; i++) x[i] = (double)((i % HW) / 3 % 97 - 48) / 16;
    double *yg, *gg, *yr, *gr;
    run_pool(AMPC_DEVICE_CUDA, dt, c, sh, true, x, gy, &yg, &gg);
    run_pool(AMPC_DEVICE_REF, AMPC_F64, c, sh, false, x, gy, &yr, &gr);
    char what[160];
    snprintf(what, sizeof what, "cuda pool %s %s (%lld,%lld,%lld,%lld)%s", c->name, ampc_dtype_name(dt), (long long)sh[0],
             (long long)sh[1], (long long)sh[2], (long long)sh[3], ties ? " ties" : "");
    check_pool(what, "vs ref", dt, c, sh, x, gy, yg, gg, yr, gr);
    if (c->kind == AMPC_POOL_MAX)
        for (int64_t i = 0; i < no; i++)
            if (yg[i] != yr[i]) fail_msg("%s: max y[%lld] %g, ref %g", what, (long long)i, yg[i], yr[i]);
    free(x), free(gy), free(yg), free(gg), free(yr), free(gr);
}

static void test_pool_cl_cuda(void **state) {
    (void)state;
    if (!tu_cuda_available()) skip();
    const pool_cfg cfgs[] = {
        {"max_2x2", AMPC_POOL_MAX, {2, 2}, {2, 2}, {0, 0}, false, 0, 0},
        {"max_3x3_s2_p1", AMPC_POOL_MAX, {3, 3}, {2, 2}, {1, 1}, false, 0, 0},
        {"max_3x3_s2_ceil", AMPC_POOL_MAX, {3, 3}, {2, 2}, {0, 0}, true, 0, 0},
        {"max_3x2_rect", AMPC_POOL_MAX, {3, 2}, {1, 2}, {1, 0}, false, 0, 0},
        {"max_3x3_s1_p1", AMPC_POOL_MAX, {3, 3}, {1, 1}, {1, 1}, false, 0, 0},
        {"avg_incl_3x3_s2_p1", AMPC_POOL_AVG_INCLUDE_PAD, {3, 3}, {2, 2}, {1, 1}, false, 0, 0},
        {"adaptive_1x1", AMPC_POOL_ADAPTIVE_AVG, {0, 0}, {0, 0}, {0, 0}, false, 1, 1},
    };
    const int64_t shapes[][4] = {{2, 8, 7, 9}, {3, 24, 8, 8}, {2, 64, 11, 13}, {2, 40, 11, 13}, {1, 19, 5, 7}};
    for (size_t d = 0; d < sizeof cpu_dtypes / sizeof *cpu_dtypes; d++)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
            for (size_t c = 0; c < sizeof cfgs / sizeof *cfgs; c++) {
                pool_case_cuda(cpu_dtypes[d], &cfgs[c], shapes[s], false);
                if (cfgs[c].kind == AMPC_POOL_MAX) pool_case_cuda(cpu_dtypes[d], &cfgs[c], shapes[s], true);
            }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_norm_cl),
        cmocka_unit_test(test_batch_norm_cl_long_rows),
        cmocka_unit_test(test_batch_norm_cl_offset),
        cmocka_unit_test(test_batch_norm_cl_threads),
        cmocka_unit_test(test_batch_norm_cl_mixed_formats),
        cmocka_unit_test(test_pool_cl),
        cmocka_unit_test(test_pool_cl_mismatch),
        cmocka_unit_test(test_batch_norm_cl_cuda),
        cmocka_unit_test(test_batch_norm_cl_cuda_offset),
        cmocka_unit_test(test_batch_norm_relu_cl_cuda),
        cmocka_unit_test(test_pool_cl_cuda),
    };
    return cmocka_run_group_tests_name("cl_kernels", tests, tu_group_setup, tu_group_teardown);
}
