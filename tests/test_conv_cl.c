/*
 * test_conv_cl.c - the CPU convolution kernels on channels-last (NHWC) activations, called
 * through the backend table: forward (+bias), backward data and backward weights (+bias) of
 * NHWC tensors against the same kernels on contiguous (NCHW) tensors and against the REF
 * backend in f64, for f32, bf16, f16 and 16-bit x/gy with f32 gw/gb (autocast), on 1 and 3
 * threads (bf16 weight gradients are split over threads); the im2col + matmul path forced on
 * every ungrouped case (all three passes, cols capped so that the batch is split in chunks,
 * and uncapped); oneDNN's Winograd kernels (by rule and forced) against a bound derived from
 * their transforms (the Winograd section below); the empty-input fallbacks, format errors, the
 * steady state (no new allocations) and which oneDNN kernels run.
 *
 * Tolerance (derived, as in test_conv.c): inputs are exact in the dtype, every kernel sums its
 * K terms in f32 in some order and rounds once to the output dtype, so
 *   |got - exact| <= gamma(K) * S + eps * (|exact| + gamma(K) * S) + eta,   gamma(K) = K u / (1 - K u)
 * with u = 2^-24, S the sum of the terms' magnitudes (the same pass run on REF with |inputs|),
 * eps the output dtype's unit roundoff and eta half its smallest subnormal (rounding a result
 * below the normal range is exact only to that: f16 2^-25, bf16 2^-134, f32 2^-150; f16 weight
 * gradients of a few cancelling terms reach it); two kernels summing in different orders differ by
 * at most twice that. K: C/groups*KH*KW (+1 with bias) forward, O/groups*KH*KW backward data,
 * N*OH*OW backward weights and bias.
 */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu.h"
#include "backend/cpu/dnnl_cache.h"
#include "core/core.h"

/* conv.c's im2col override and cols cap (not in a header: for benchmarks and tests only) */

// ---------------------------------------------------------------------------------------------
// Configurations

typedef struct {
    const char *name;
    int64_t N, C, H, W, O, KH, KW;
    int stride, pad, dil, groups;
    bool bias;
} cl_case;

static const cl_case cases[] = {
    {"3x3 s1 pad 1", 2, 24, 6, 5, 20, 3, 3, 1, 1, 1, 1, true},
    {"3x3 s2 pad 1, odd batch", 3, 16, 9, 7, 32, 3, 3, 2, 1, 1, 1, false},
    {"3x3 more weights than inputs", 2, 32, 4, 4, 48, 3, 3, 1, 1, 1, 1, false},
    {"1x1 s1 10x12 (bias)", 2, 32, 10, 12, 48, 1, 1, 1, 0, 1, 1, true},
    {"1x1 s1 7x7, batch 1", 1, 24, 7, 7, 40, 1, 1, 1, 0, 1, 1, false},
    {"1x1 s2 11x10", 2, 16, 11, 10, 32, 1, 1, 2, 0, 1, 1, false},
    {"7x7 s2 pad 3 stem", 2, 3, 20, 18, 16, 7, 7, 2, 3, 1, 1, false},
    {"3x3 3-channel stem (bias), odd batch", 3, 3, 8, 8, 16, 3, 3, 1, 1, 1, 1, true},
    {"3x3 groups 2", 2, 16, 6, 6, 32, 3, 3, 1, 1, 1, 2, false},
    {"3x3 depthwise (bias)", 2, 32, 8, 7, 32, 3, 3, 1, 1, 1, 32, true},
    {"3x3 dilation 2", 1, 16, 9, 11, 16, 3, 3, 1, 2, 2, 1, true},
};

/* x dtype and gw/gb dtype */
typedef struct {
    ampc_dtype dt, gdt;
} cl_dtypes;

static const cl_dtypes dtypes[] = {
    {AMPC_F32, AMPC_F32}, {AMPC_BF16, AMPC_BF16}, {AMPC_F16, AMPC_F16}, {AMPC_BF16, AMPC_F32}, {AMPC_F16, AMPC_F32},
};

static ampc_conv_desc make_desc(const cl_case *c, bool cl) {
    ampc_conv_desc d = {.N = c->N, .C = c->C, .H = c->H, .W = c->W, .O = c->O, .KH = c->KH, .KW = c->KW,
                        .stride = {c->stride, c->stride}, .padding = {c->pad, c->pad}, .dilation = {c->dil, c->dil},
                        .groups = c->groups, .channels_last = cl};
    d.OH = (d.H + 2 * c->pad - c->dil * (d.KH - 1) - 1) / c->stride + 1;
    d.OW = (d.W + 2 * c->pad - c->dil * (d.KW - 1) - 1) / c->stride + 1;
    return d;
}

// ---------------------------------------------------------------------------------------------
// Tensors written and read element by element (NCHW values v[((n*C + c)*H + h)*W + w]), so the
// NHWC permutation is the test's own

/* Storage index of logical NCHW element i of a (N, C, H, W) tensor. */
static size_t storage_index(const int64_t *s, size_t i, bool cl) {
    if (!cl) return i;
    size_t w = i % (size_t)s[3], h = i / (size_t)s[3] % (size_t)s[2], c = i / (size_t)(s[3] * s[2]) % (size_t)s[1],
           n = i / (size_t)(s[3] * s[2] * s[1]);
    return ((n * (size_t)s[2] + h) * (size_t)s[3] + w) * (size_t)s[1] + c;
}

/* A new CPU tensor of dt in the scope, holding v (NaN for a NULL v: outputs must be written). */
static ampc_tensor *cpu_tensor(ampc_dtype dt, int ndim, const int64_t *shape, bool cl, const double *v) {
    ampc_tensor *t = ampc__scope_adopt(
        ampc__tensor_new_fmt(dt, AMPC_DEVICE_CPU, ndim, shape, cl ? AMPC_CHANNELS_LAST : AMPC_CONTIGUOUS_FORMAT));
    ASSERT_NOT_NULL_MSG(t);
    size_t n = (size_t)t->numel, sz = ampc__dt(dt)->size;
    for (size_t i = 0; i < n; i++) {
        float f = v ? (float)v[i] : NAN;
        ampc__dt(dt)->from_f32(&f, (char *)ampc__data(t) + storage_index(shape, i, cl && ndim == 4) * sz, 1);
    }
    return t;
}

/* t's values in NCHW order (malloc'd). */
static double *cpu_values(const ampc_tensor *t) {
    size_t n = (size_t)t->numel, sz = ampc__dt(t->dtype)->size;
    double *v = malloc((n ? n : 1) * sizeof *v);
    for (size_t i = 0; i < n; i++) {
        float f;
        ampc__dt(t->dtype)->to_f32((const char *)ampc__data(t) + storage_index(t->shape, i, ampc__is_cl(t)) * sz, &f, 1);
        v[i] = f;
    }
    return v;
}

// ---------------------------------------------------------------------------------------------
// The three passes

/* Inputs (NCHW order, exact in the dtype) and outputs of one configuration. */
typedef struct {
    double *x, *w, *b, *gy;    /* inputs */
    double *y, *gx, *gw, *gb;  /* results */
} conv_io;

static void io_free(conv_io *io) {
    free(io->y), free(io->gx), free(io->gw), free(io->gb);
    memset(&io->y, 0, 4 * sizeof io->y);
}

/* Runs the three passes on the CPU in dt (gw/gb in gdt), NHWC when cl; results into io. */
static void run_cpu(const cl_case *c, bool cl, ampc_dtype dt, ampc_dtype gdt, conv_io *io) {
    ampc_conv_desc d = make_desc(c, cl);
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_CPU);
    int64_t xs[4] = {d.N, d.C, d.H, d.W}, ys[4] = {d.N, d.O, d.OH, d.OW}, ws[4] = {d.O, d.C / d.groups, d.KH, d.KW};
    ampc_scope_begin();
    ampc_tensor *x = cpu_tensor(dt, 4, xs, cl, io->x), *w = cpu_tensor(dt, 4, ws, false, io->w);
    ampc_tensor *b = c->bias ? cpu_tensor(dt, 1, (int64_t[]){d.O}, false, io->b) : NULL;
    ampc_tensor *gy = cpu_tensor(dt, 4, ys, cl, io->gy);
    ampc_tensor *y = cpu_tensor(dt, 4, ys, cl, NULL), *gx = cpu_tensor(dt, 4, xs, cl, NULL);
    ampc_tensor *gw = cpu_tensor(gdt, 4, ws, false, NULL);
    ampc_tensor *gb = c->bias ? cpu_tensor(gdt, 1, (int64_t[]){d.O}, false, NULL) : NULL;
    ASSERT_OK(be->conv2d(&d, x, w, b, y));
    ASSERT_OK(be->conv2d_backward_data(&d, gy, w, gx));
    ASSERT_OK(be->conv2d_backward_weights(&d, x, gy, gw, gb));
    io->y = cpu_values(y), io->gx = cpu_values(gx), io->gw = cpu_values(gw);
    io->gb = c->bias ? cpu_values(gb) : NULL;
    ampc_scope_end();
}

/* The same passes on REF in f64 (contiguous); abs: on the magnitudes of the inputs (S). */
static void run_ref(const cl_case *c, const conv_io *in, bool abs, conv_io *out) {
    ampc_conv_desc d = make_desc(c, false);
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_REF);
    int64_t xs[4] = {d.N, d.C, d.H, d.W}, ys[4] = {d.N, d.O, d.OH, d.OW}, ws[4] = {d.O, d.C / d.groups, d.KH, d.KW};
    size_t nx = (size_t)(d.N * d.C * d.H * d.W), ny = (size_t)(d.N * d.O * d.OH * d.OW), nw = (size_t)(ws[0] * ws[1] * d.KH * d.KW);
    double *ax = malloc(nx * sizeof *ax), *agy = malloc(ny * sizeof *agy), *aw = malloc(nw * sizeof *aw);
    double *ab = malloc((size_t)d.O * sizeof *ab + 1);
    for (size_t i = 0; i < nx; i++) ax[i] = abs ? fabs(in->x[i]) : in->x[i];
    for (size_t i = 0; i < ny; i++) agy[i] = abs ? fabs(in->gy[i]) : in->gy[i];
    for (size_t i = 0; i < nw; i++) aw[i] = abs ? fabs(in->w[i]) : in->w[i];
    for (int64_t i = 0; c->bias && i < d.O; i++) ab[i] = abs ? fabs(in->b[i]) : in->b[i];
    ampc_set_default_device(AMPC_DEVICE_REF);
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_from_f64(AMPC_F64, 4, xs, ax), *w = ampc_tensor_from_f64(AMPC_F64, 4, ws, aw);
    ampc_tensor *gy = ampc_tensor_from_f64(AMPC_F64, 4, ys, agy);
    ampc_tensor *b = c->bias ? ampc_tensor_from_f64(AMPC_F64, 1, (int64_t[]){d.O}, ab) : NULL;
    ampc_tensor *y = ampc_tensor_zeros(AMPC_F64, 4, ys), *gx = ampc_tensor_zeros(AMPC_F64, 4, xs);
    ampc_tensor *gw = ampc_tensor_zeros(AMPC_F64, 4, ws), *gb = c->bias ? ampc_tensor_zeros(AMPC_F64, 1, (int64_t[]){d.O}) : NULL;
    ASSERT_OK(be->conv2d(&d, x, w, b, y));
    ASSERT_OK(be->conv2d_backward_data(&d, gy, w, gx));
    ASSERT_OK(be->conv2d_backward_weights(&d, x, gy, gw, gb));
    out->y = tu_values(y), out->gx = tu_values(gx), out->gw = tu_values(gw);
    out->gb = c->bias ? tu_values(gb) : NULL;
    ampc_scope_end();
    ampc_set_default_device(AMPC_DEVICE_CPU);
    free(ax), free(agy), free(aw), free(ab);
}

static double gamma_f32(double k) { return k * 0x1p-24 / (1 - k * 0x1p-24); }

/* Half the smallest subnormal of dt (the absolute part of rounding to it). */
static double half_subnormal(ampc_dtype dt) { return dt == AMPC_F16 ? 0x1p-25 : dt == AMPC_BF16 ? 0x1p-134 : 0x1p-150; }

/* A kernel's error model: the magnitudes M (S for a direct sum, T for Winograd), the sum's
   length K and a scale (Winograd: 2, see below). */
typedef struct {
    const double *M;
    double K, scale;
} err_model;

/* The bound of the top comment for element i under model m. */
static double bound_of(const err_model *m, size_t i, double exact, double eps, double eta) {
    double g = gamma_f32(m->K);
    return m->scale * (g * m->M[i] + eps * (fabs(exact) + g * m->M[i]) + eta);
}

/* |got - want| <= bound(a) elementwise (want: the exact values), or bound(a) + bound(b) (want:
   another kernel's results, b its model). */
static void check_close(const char *what, const double *got, const double *want, const double *exact, size_t n, double eps,
                        double eta, const err_model *a, const err_model *b) {
    for (size_t i = 0; i < n; i++) {
        double bound = bound_of(a, i, exact[i], eps, eta) + (b ? bound_of(b, i, exact[i], eps, eta) : 0);
        if (!(fabs(got[i] - want[i]) <= bound))
            fail_msg("%s [%zu]: got %.9g want %.9g (exact %.9g), error %.3g > bound %.3g", what, i, got[i], want[i], exact[i],
                     fabs(got[i] - want[i]), bound);
    }
}

// ---------------------------------------------------------------------------------------------
// Winograd F(4x4, 3x3): the bound oneDNN's Winograd kernels are held to
//
// oneDNN's jit_wino_4x3 kernels compute a 3x3 stride-1 correlation (padding 1) tile by tile as
// Y = A^T [(G g G^T) . (B^T d B)] A: 4x4 output tiles from 6x6 input tiles, the products summed
// over the channels in the transformed domain (Lavin and Gray's F(4x4, 3x3)); their constants
// (0.625, 1.5, 2.25 = 1.5^2, 0.390625 = 0.625^2, 2.640625 = 1.5^2 + 0.625^2) are those of the
// Toom-Cook points 0, +-5/8, +-3/2 and infinity, built below. Every value the kernel computes is
// a sum of products of inputs and the transforms' coefficients, computed in f32 in some order,
// so to first order its error is at most gamma(K + 64) times the same computation on |A|, |G|,
// |B| and the inputs' magnitudes (T, below); K is the sum's length in the transformed domain (C
// forward, O backward data, N x tiles backward weights) and 64 covers the transforms' own sums
// (6 terms in each direction, input, weights and output) and their coefficients' rounding to
// f32; checks take twice that, for oneDNN's factored evaluation of the transforms (partial
// sums shared between rows). T does not change when rows of G are scaled against B^T's or A's
// columns against G's, so it does not depend on how oneDNN normalises the matrices; and T >= S
// elementwise (the signed coefficients of each direct term sum to 1), so the bound contains the
// direct one. The construction (matrices, tiling, the dual forms of the two gradients) is checked
// first: the same computation in f64 on the signed inputs equals REF's exact results.

static double WAT[4][6], WG[6][3], WBT[6][6];   /* A^T, G, B^T */

static void wino_matrices(void) {
    const double p[5] = {0, 0.625, -0.625, 1.5, -1.5};
    memset(WAT, 0, sizeof WAT), memset(WG, 0, sizeof WG), memset(WBT, 0, sizeof WBT);
    for (int i = 0; i < 4; i++) {
        for (int j = 0; j < 5; j++) WAT[i][j] = pow(p[j], i);
        WAT[i][5] = i == 3;   /* infinity: the leading coefficient */
    }
    for (int j = 0; j < 5; j++)
        for (int k = 0; k < 3; k++) WG[j][k] = pow(p[j], k);
    WG[5][2] = 1;
    /* B^T row j: the coefficients of Lagrange's L_j over the finite points (j < 5), of their
       product M (j = 5): the interpolation s(x) = sum_j s(p_j) L_j(x) + s_inf M(x), transposed */
    for (int j = 0; j < 6; j++) {
        double poly[7] = {1}, denom = 1;
        int deg = 0;
        for (int l = 0; l < 5; l++) {
            if (l == j) continue;
            for (int i = deg + 1; i > 0; i--) poly[i] = poly[i - 1] - p[l] * poly[i];
            poly[0] *= -p[l];
            deg++;
            if (j < 5) denom *= p[j] - p[l];
        }
        for (int i = 0; i < 6; i++) WBT[j][i] = poly[i] / denom;
    }
}

/* c (n x m) = a (n x k) b (k x m), with |a| |b| when ab; strides: a's row sa, b's row sb, and
   transposes read a[i][t] as a[t][i] (ta) or b[t][j] as b[j][t] (tb). */
static void wmm(const double *a, int sa, bool ta, const double *b, int sb, bool tb, double *c, int n, int k, int m, bool ab) {
    for (int i = 0; i < n; i++)
        for (int j = 0; j < m; j++) {
            double acc = 0;
            for (int t = 0; t < k; t++) {
                double x = ta ? a[t * sa + i] : a[i * sa + t], y = tb ? b[j * sb + t] : b[t * sb + j];
                acc += ab ? fabs(x) * fabs(y) : x * y;
            }
            c[i * m + j] = acc;
        }
}

/* V[((n*C + c)*T + t)*36]: B^T d B of the 6x6 input tiles of x (N, C, H, W; padding 1, tile t =
   ty*TW + tx starting at row 4 ty - 1, column 4 tx - 1). */
static double *wino_input(const double *x, int64_t N, int64_t C, int64_t H, int64_t W, bool ab) {
    int64_t TH = (H + 3) / 4, TW = (W + 3) / 4, T = TH * TW;
    double *V = malloc((size_t)(N * C * T) * 36 * sizeof *V);
    for (int64_t nc = 0; nc < N * C; nc++)
        for (int64_t t = 0; t < T; t++) {
            double d[36], tmp[36];
            for (int r = 0; r < 6; r++)
                for (int q = 0; q < 6; q++) {
                    int64_t h = t / TW * 4 - 1 + r, w = t % TW * 4 - 1 + q;
                    d[r * 6 + q] = h >= 0 && h < H && w >= 0 && w < W ? x[(nc * H + h) * W + w] : 0;
                }
            wmm(&WBT[0][0], 6, false, d, 6, false, tmp, 6, 6, 6, ab);
            wmm(tmp, 6, false, &WBT[0][0], 6, true, V + (nc * T + t) * 36, 6, 6, 6, ab);
        }
    return V;
}

/* y (N, O, H, W) = the correlation of x (N, C, H, W) with w (O, C, 3, 3), padding 1, by
   Winograd (ab: on magnitudes: T). */
static void wino_corr(const double *x, const double *w, int64_t N, int64_t C, int64_t H, int64_t W, int64_t O, bool ab,
                      double *y) {
    int64_t TH = (H + 3) / 4, TW = (W + 3) / 4, T = TH * TW;
    double *V = wino_input(x, N, C, H, W, ab), *U = malloc((size_t)(O * C) * 36 * sizeof *U);
    for (int64_t oc = 0; oc < O * C; oc++) {
        double tmp[18];
        wmm(&WG[0][0], 3, false, w + oc * 9, 3, false, tmp, 6, 3, 3, ab);
        wmm(tmp, 3, false, &WG[0][0], 3, true, U + oc * 36, 6, 3, 6, ab);
    }
    for (int64_t n = 0; n < N; n++)
        for (int64_t o = 0; o < O; o++)
            for (int64_t t = 0; t < T; t++) {
                double P[36] = {0}, tmp[24], Y[16];
                for (int64_t c = 0; c < C; c++) {
                    const double *u = U + (o * C + c) * 36, *v = V + ((n * C + c) * T + t) * 36;
                    for (int i = 0; i < 36; i++) P[i] += u[i] * v[i];
                }
                wmm(&WAT[0][0], 6, false, P, 6, false, tmp, 4, 6, 6, ab);
                wmm(tmp, 6, false, &WAT[0][0], 6, true, Y, 4, 6, 4, ab);
                for (int a = 0; a < 4; a++)
                    for (int b = 0; b < 4; b++) {
                        int64_t h = t / TW * 4 + a, wc = t % TW * 4 + b;
                        if (h < H && wc < W) y[((n * O + o) * H + h) * W + wc] = Y[a * 4 + b];
                    }
            }
    free(V), free(U);
}

/* gw (O, C, 3, 3) = the weight gradient of that correlation for gy (N, O, H, W): the dual form,
   G^T [sum over images and tiles of (B^T d B) . (A gy A^T)] G (gy's 4x4 tiles zero past the map). */
static void wino_wgrad(const double *x, const double *gy, int64_t N, int64_t C, int64_t H, int64_t W, int64_t O, bool ab,
                       double *gw) {
    int64_t TH = (H + 3) / 4, TW = (W + 3) / 4, T = TH * TW;
    double *V = wino_input(x, N, C, H, W, ab), *Q = malloc((size_t)(N * O * T) * 36 * sizeof *Q);
    for (int64_t no = 0; no < N * O; no++)
        for (int64_t t = 0; t < T; t++) {
            double g[16], tmp[24];
            for (int a = 0; a < 4; a++)
                for (int b = 0; b < 4; b++) {
                    int64_t h = t / TW * 4 + a, w = t % TW * 4 + b;
                    g[a * 4 + b] = h < H && w < W ? gy[(no * H + h) * W + w] : 0;
                }
            wmm(&WAT[0][0], 6, true, g, 4, false, tmp, 6, 4, 4, ab);
            wmm(tmp, 4, false, &WAT[0][0], 6, false, Q + (no * T + t) * 36, 6, 4, 6, ab);
        }
    for (int64_t o = 0; o < O; o++)
        for (int64_t c = 0; c < C; c++) {
            double P[36] = {0}, tmp[18];
            for (int64_t n = 0; n < N; n++)
                for (int64_t t = 0; t < T; t++) {
                    const double *q = Q + ((n * O + o) * T + t) * 36, *v = V + ((n * C + c) * T + t) * 36;
                    for (int i = 0; i < 36; i++) P[i] += q[i] * v[i];
                }
            wmm(&WG[0][0], 3, true, P, 6, false, tmp, 3, 6, 6, ab);
            wmm(tmp, 6, false, &WG[0][0], 3, false, gw + (o * C + c) * 9, 3, 6, 3, ab);
        }
    free(V), free(Q);
}

/* The three passes of case c by Winograd in f64 (ab: T, on the magnitudes); backward data is
   the forward correlation of gy with the weights flipped and transposed. */
static void wino_passes(const cl_case *c, const conv_io *in, bool ab, conv_io *out) {
    int64_t N = c->N, C = c->C, H = c->H, W = c->W, O = c->O;
    out->y = malloc((size_t)(N * O * H * W) * sizeof(double));
    out->gx = malloc((size_t)(N * C * H * W) * sizeof(double));
    out->gw = malloc((size_t)(O * C * 9) * sizeof(double));
    out->gb = NULL;
    double *wt = malloc((size_t)(O * C * 9) * sizeof *wt);
    for (int64_t o = 0; o < O; o++)
        for (int64_t ci = 0; ci < C; ci++)
            for (int k = 0; k < 9; k++) wt[(ci * O + o) * 9 + 8 - k] = in->w[(o * C + ci) * 9 + k];
    wino_corr(in->x, in->w, N, C, H, W, O, ab, out->y);
    wino_corr(in->gy, wt, N, O, H, W, C, ab, out->gx);
    wino_wgrad(in->x, in->gy, N, C, H, W, O, ab, out->gw);
    free(wt);
}

/* Whether case c's Winograd shape (3x3, stride 1, padding 1, dilation 1, ungrouped) */
static bool wino_shape(const cl_case *c) {
    return c->KH == 3 && c->KW == 3 && c->stride == 1 && c->pad == 1 && c->dil == 1 && c->groups == 1;
}

/* Whether pass `pass` of case c in dt runs on oneDNN's Winograd kernels (NHWC when cl), under
   the switches as they are set now. */
static bool runs_wino(const cl_case *c, bool cl, ampc_dtype dt, int pass) {
    ampc_conv_desc d = make_desc(c, cl);
    char name[128];
    ASSERT_OK(ampc__cpu_conv_impl(&d, dt, pass, c->bias, name, sizeof name));
    return strstr(name, "wino") != NULL;
}

/* T of case c on in (NULL where no pass needs it), after checking the construction: Winograd
   on the signed values in f64 equals REF's exact results ref to 1e-9 T. */
static void wino_bounds(const cl_case *c, const conv_io *in, const conv_io *ref, bool needed, conv_io *T) {
    memset(T, 0, sizeof *T);
    if (!needed) return;
    conv_io signed_io;
    wino_matrices();
    wino_passes(c, in, false, &signed_io);
    wino_passes(c, in, true, T);
    size_t n[3] = {(size_t)(c->N * c->O * c->H * c->W), (size_t)(c->N * c->C * c->H * c->W), (size_t)(c->O * c->C * 9)};
    const double *got[3] = {signed_io.y, signed_io.gx, signed_io.gw}, *want[3] = {ref->y, ref->gx, ref->gw};
    const double *mag[3] = {T->y, T->gx, T->gw};
    for (int o = 0; o < 3; o++)
        for (size_t i = 0; i < n[o]; i++)
            if (!(fabs(got[o][i] - want[o][i]) <= 1e-9 * mag[o][i]))
                fail_msg("%s: Winograd in f64, output %d [%zu]: %.17g, exact %.17g (T %.3g)", c->name, o, i, got[o][i],
                         want[o][i], mag[o][i]);
    io_free(&signed_io);
}

// ---------------------------------------------------------------------------------------------
// Channels-last against contiguous and REF

/* Every case of cs against contiguous and REF; im2col: the im2col override (-1: by rule). */
/* Only the dtypes computed in f32 (Winograd's: f32 and f16) when f32_only. */
static void check_cases_in(const cl_case *cs, size_t ncases, int im2col, bool f32_only);

static void check_cases(const cl_case *cs, size_t ncases, int im2col) { check_cases_in(cs, ncases, im2col, false); }

static void check_cases_in(const cl_case *cs, size_t ncases, int im2col, bool f32_only) {
    const int threads[] = {1, 3};
    int nthr = ampc_get_num_threads();
    char what[256];
    for (size_t ci = 0; ci < ncases; ci++) {
        const cl_case *c = &cs[ci];
        ampc_conv_desc d = make_desc(c, false);
        size_t nx = (size_t)(d.N * d.C * d.H * d.W), ny = (size_t)(d.N * d.O * d.OH * d.OW);
        size_t nw = (size_t)(d.O * (d.C / d.groups) * d.KH * d.KW), no = (size_t)d.O;
        double Kf = (double)(d.C / d.groups * d.KH * d.KW) + (c->bias ? 1 : 0), Kd = (double)(d.O / d.groups * d.KH * d.KW),
               Kw = (double)(d.N * d.OH * d.OW);
        for (size_t di = 0; di < sizeof dtypes / sizeof *dtypes; di++) {
            ampc_dtype dt = dtypes[di].dt, gdt = dtypes[di].gdt;
            if (f32_only && dt == AMPC_BF16) continue;
            conv_io in = {0}, ref = {0}, mag = {0};
            in.x = malloc(nx * sizeof(double)), in.gy = malloc(ny * sizeof(double)), in.w = malloc(nw * sizeof(double));
            in.b = malloc(no * sizeof(double));
            tu_fill_uniform(in.x, nx, 10 + ci, -1, 1);
            tu_fill_uniform(in.gy, ny, 20 + ci, -1, 1);
            tu_fill_uniform(in.w, nw, 30 + ci, -1, 1);
            tu_fill_uniform(in.b, no, 40 + ci, -1, 1);
            for (size_t i = 0; i < nx; i++) in.x[i] = tu_round_to(dt, in.x[i]);
            for (size_t i = 0; i < ny; i++) in.gy[i] = tu_round_to(dt, in.gy[i]);
            for (size_t i = 0; i < nw; i++) in.w[i] = tu_round_to(dt, in.w[i]);
            for (size_t i = 0; i < no; i++) in.b[i] = tu_round_to(dt, in.b[i]);
            run_ref(c, &in, false, &ref);
            run_ref(c, &in, true, &mag);
            /* which passes run Winograd, contiguous and channels-last (im2col, when forced, takes
               the channels-last passes) */
            bool wino[2][3], any = false;
            for (int p = 0; p < 3; p++) {
                wino[0][p] = wino_shape(c) && runs_wino(c, false, dt, p);
                ampc__cpu_conv_im2col = im2col;
                wino[1][p] = wino_shape(c) && runs_wino(c, true, dt, p);
                ampc__cpu_conv_im2col = -1;
                any = any || wino[0][p] || wino[1][p];
            }
            conv_io T;
            wino_bounds(c, &in, &ref, any, &T);
            int64_t tiles = (d.OH + 3) / 4 * ((d.OW + 3) / 4);
            for (size_t ti = 0; ti < sizeof threads / sizeof *threads; ti++) {
                conv_io nchw = in, nhwc = in;
                ampc_set_num_threads(threads[ti]);
                run_cpu(c, false, dt, gdt, &nchw);
                ampc__cpu_conv_im2col = im2col;
                run_cpu(c, true, dt, gdt, &nhwc);
                ampc__cpu_conv_im2col = -1;
                ampc_set_num_threads(nthr);
                double e = tu_eps(dt), ew = tu_eps(gdt), h = half_subnormal(dt), hw = half_subnormal(gdt);
                const struct {
                    const char *name;
                    const double *cl, *plain, *exact, *S, *T;
                    size_t n;
                    double K, Kw, eps, eta;
                    int pass;
                } outs[] = {
                    {"y", nhwc.y, nchw.y, ref.y, mag.y, T.y, ny, Kf, (double)d.C, e, h, 0},
                    {"gx", nhwc.gx, nchw.gx, ref.gx, mag.gx, T.gx, nx, Kd, (double)d.O, e, h, 1},
                    {"gw", nhwc.gw, nchw.gw, ref.gw, mag.gw, T.gw, nw, Kw, (double)(d.N * tiles), ew, hw, 2},
                    {"gb", nhwc.gb, nchw.gb, ref.gb, mag.gb, NULL, c->bias ? no : 0, Kw, 0, ew, hw, 2},
                };
                for (int o = 0; o < 4; o++) {
                    if (!outs[o].n) continue;
                    /* each side's model: the direct sum's, or Winograd's (gb never) */
                    err_model m[2];
                    for (int side = 0; side < 2; side++) {
                        bool w = outs[o].T && wino[side][outs[o].pass];
                        m[side] = w ? (err_model){outs[o].T, outs[o].Kw + 64, 2} : (err_model){outs[o].S, outs[o].K, 1};
                    }
                    snprintf(what, sizeof what, "%s%s, %s (gw %s), %d threads: %s channels-last vs contiguous%s", c->name,
                             im2col > 0 ? " (im2col)" : "", ampc_dtype_name(dt), ampc_dtype_name(gdt), threads[ti], outs[o].name,
                             wino[0][outs[o].pass] || wino[1][outs[o].pass] ? " (Winograd)" : "");
                    check_close(what, outs[o].cl, outs[o].plain, outs[o].exact, outs[o].n, outs[o].eps, outs[o].eta, &m[1], &m[0]);
                    snprintf(what, sizeof what, "%s%s, %s (gw %s), %d threads: %s channels-last vs REF%s", c->name,
                             im2col > 0 ? " (im2col)" : "", ampc_dtype_name(dt), ampc_dtype_name(gdt), threads[ti], outs[o].name,
                             wino[1][outs[o].pass] ? " (Winograd)" : "");
                    check_close(what, outs[o].cl, outs[o].exact, outs[o].exact, outs[o].n, outs[o].eps, outs[o].eta, &m[1], NULL);
                    snprintf(what, sizeof what, "%s, %s (gw %s), %d threads: %s contiguous vs REF%s", c->name,
                             ampc_dtype_name(dt), ampc_dtype_name(gdt), threads[ti], outs[o].name,
                             wino[0][outs[o].pass] ? " (Winograd)" : "");
                    check_close(what, outs[o].plain, outs[o].exact, outs[o].exact, outs[o].n, outs[o].eps, outs[o].eta, &m[0], NULL);
                }
                io_free(&nchw), io_free(&nhwc);
            }
            io_free(&T);
            io_free(&ref), io_free(&mag);
            free(in.x), free(in.gy), free(in.w), free(in.b);
        }
    }
}

static void test_cl_cases(void **state) {
    (void)state;
    check_cases(cases, sizeof cases / sizeof *cases, -1);
}

// ---------------------------------------------------------------------------------------------
// im2col + matmul (conv.c's i2c_run), forced on every ungrouped case and on the shapes around
// the rule's thresholds, with cols capped at one image's then at a few images' rows (chunks
// of the batch, a smaller last one, accumulating weight gradients) and uncapped

static void test_cl_im2col(void **state) {
    (void)state;
    static const cl_case extra[] = {
        {"3x3 s2 pad 1, 5 images", 5, 24, 8, 8, 40, 3, 3, 2, 1, 1, 1, true},
        {"5x5 pad 2 (bias)", 3, 8, 7, 9, 12, 5, 5, 1, 2, 1, 1, true},
        {"3x3 unpadded", 3, 16, 6, 6, 8, 3, 3, 1, 0, 1, 1, false},
        {"3x3 s2 dilation 2 pad 2", 2, 8, 11, 9, 8, 3, 3, 2, 2, 2, 1, false},
        {"1x1 s2 (bias)", 3, 24, 9, 8, 16, 1, 1, 2, 0, 1, 1, true},
        {"1-channel 3x3 (cnn conv1)", 4, 1, 10, 10, 16, 3, 3, 1, 0, 1, 1, true},
    };
    const size_t caps[] = {1, 8 << 10, (size_t)1 << 30};
    size_t cap0 = ampc__cpu_conv_im2col_cap;
    for (size_t i = 0; i < sizeof caps / sizeof *caps; i++) {
        ampc__cpu_conv_im2col_cap = caps[i];
        for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++)
            if (cases[ci].groups == 1) check_cases(&cases[ci], 1, 1);
        check_cases(extra, sizeof extra / sizeof *extra, 1);
    }
    ampc__cpu_conv_im2col_cap = cap0;
}

/* The rule (cl_im2col) on both sides of its thresholds: im2col for bf16 and f32, bf16 only,
   neither (255 output channels; a 15x15 output map; a stride-1 256-channel input). Where oneDNN
   runs AMX, bf16 takes the matmul for forward and backward data on outputs up to 4x4 (forward
   with a spatial kernel) and for backward weights with >= 128 output channels on outputs up to
   8x8 as well (the last two cases: a 5x5 output with 127 channels, an 8x8 one with 128). */
static void test_cl_im2col_rule(void **state) {
    (void)state;
    static const cl_case rule_cases[] = {
        {"rule: 3x3 s2 256->256 4x4 (both, bias)", 2, 256, 4, 4, 256, 3, 3, 2, 1, 1, 1, true},
        {"rule: 3x3 s1 512->256 3x3 (bf16)", 1, 512, 3, 3, 256, 3, 3, 1, 1, 1, 1, false},
        {"rule: 3x3 s2 128->256 4x4 (bf16)", 2, 128, 4, 4, 256, 3, 3, 2, 1, 1, 1, false},
        {"rule: 1x1 s2 256->256 4x4 (bf16)", 2, 256, 4, 4, 256, 1, 1, 2, 0, 1, 1, false},
        {"rule: 3x3 s2 256->255 4x4 (neither)", 1, 256, 4, 4, 255, 3, 3, 2, 1, 1, 1, false},
        {"rule: 1x1 s2 256->256 29x29 (neither)", 1, 256, 29, 29, 256, 1, 1, 2, 0, 1, 1, false},
        {"rule: 3x3 s1 256->256 3x3 (neither)", 1, 256, 3, 3, 256, 3, 3, 1, 1, 1, 1, false},
        {"rule: 3x3 s1 128->127 5x5 (neither)", 1, 128, 5, 5, 127, 3, 3, 1, 1, 1, 1, false},
        {"rule: 3x3 s1 64->128 8x8 (amx: weights)", 1, 64, 8, 8, 128, 3, 3, 1, 1, 1, 1, false},
    };
    const int chosen[] = {3, 2, 2, 2, 0, 0, 0, 0, 0};   /* backward weights on im2col: bit 0 f32, bit 1 bf16 */
    const int amx_bf16[] = {7, 7, 7, 6, 7, 0, 7, 0, 4};   /* with AMX: bf16 passes on im2col, bit p pass p */
    const bool amx = ampc__dnnl_amx(), bf16_as_f32 = ampc__dnnl_via_f32(AMPC_BF16);   /* no bf16 kernels: f32's rule */
    for (size_t ci = 0; ci < sizeof rule_cases / sizeof *rule_cases; ci++) {
        ampc_conv_desc d = make_desc(&rule_cases[ci], true);
        for (int di = 0; di < 2; di++)
            for (int pass = 0; pass < 3; pass++) {
                char name[128];
                ASSERT_OK(ampc__cpu_conv_impl(&d, di ? AMPC_BF16 : AMPC_F32, pass, rule_cases[ci].bias, name, sizeof name));
                bool want = di && amx ? amx_bf16[ci] >> pass & 1 : pass == 2 && (chosen[ci] >> (di && !bf16_as_f32) & 1);
                bool got = strncmp(name, "im2col+", 7) == 0;
                if (got != want) fail_msg("%s, %s, pass %d: %s", rule_cases[ci].name, di ? "bf16" : "f32", pass, name);
            }
    }
    check_cases(rule_cases, sizeof rule_cases / sizeof *rule_cases, -1);
}

// ---------------------------------------------------------------------------------------------
// Winograd forced on every shape oneDNN's kernels take (partial tiles, one-row maps, several
// images), over chunks of the batch (a smaller last one; weight gradients added up) and whole,
// and the rule: 3x3
// stride-1 f32/f16 without bias, channels multiples of 16, C x O <= 128 x 128 (forward and
// backward data: 256 x 256), switched by
// ampc_set_conv_winograd; bf16 never

static const cl_case wino_cases[] = {
    {"wino 3x3 32->48 6x5, partial tiles", 2, 32, 6, 5, 48, 3, 3, 1, 1, 1, 1, false},
    {"wino 3x3 32->32 9x9, 3 images", 3, 32, 9, 9, 32, 3, 3, 1, 1, 1, 1, false},
    {"wino 3x3 16->32 1x7", 2, 16, 1, 7, 32, 3, 3, 1, 1, 1, 1, false},
    {"wino 3x3 128->128 5x5", 1, 128, 5, 5, 128, 3, 3, 1, 1, 1, 1, false},
};

static void test_cl_winograd(void **state) {
    (void)state;
    if (!ampc__dnnl_wino()) {
        print_message("oneDNN has no Winograd kernels on this CPU (%s): the rule's refusal checked only\n", ampc__dnnl_isa_name());
        for (size_t ci = 0; ci < sizeof wino_cases / sizeof *wino_cases; ci++)
            for (int p = 0; p < 3; p++) assert_false(runs_wino(&wino_cases[ci], true, AMPC_F32, p));
        return;
    }
    ampc__cpu_conv_winograd = 1;
    for (size_t ci = 0; ci < sizeof wino_cases / sizeof *wino_cases; ci++)
        for (int cl = 0; cl < 2; cl++)
            for (int p = 0; p < 3; p++)
                if (!runs_wino(&wino_cases[ci], cl, AMPC_F32, p) || !runs_wino(&wino_cases[ci], cl, AMPC_F16, p) ||
                    runs_wino(&wino_cases[ci], cl, AMPC_BF16, p))
                    fail_msg("%s, %s, pass %d: Winograd for f32 and f16 only", wino_cases[ci].name, cl ? "NHWC" : "NCHW", p);
    check_cases_in(wino_cases, sizeof wino_cases / sizeof *wino_cases, -1, true);
    /* the 3-image case in chunks of 2 + 1 images (2 x 20,736 bytes of blocked copies each) */
    size_t cap0 = ampc__cpu_conv_wino_cap;
    ampc__cpu_conv_wino_cap = 45000;
    check_cases_in(&wino_cases[1], 1, -1, true);
    ampc__cpu_conv_wino_cap = cap0;
    ampc__cpu_conv_winograd = -1;
}

static void test_cl_winograd_rule(void **state) {
    (void)state;
    static const cl_case rule[] = {
        {"wino rule: 128->128 (yes)", 2, 128, 8, 8, 128, 3, 3, 1, 1, 1, 1, false},
        {"wino rule: 64->64 (yes)", 2, 64, 8, 8, 64, 3, 3, 1, 1, 1, 1, false},
        {"wino rule: 128->144 (weight gradient's workspace)", 2, 128, 8, 8, 144, 3, 3, 1, 1, 1, 1, false},
        {"wino rule: 256->256 (but the weight gradient)", 1, 256, 4, 4, 256, 3, 3, 1, 1, 1, 1, false},
        {"wino rule: 256->272 (workspace)", 1, 256, 4, 4, 272, 3, 3, 1, 1, 1, 1, false},
        {"wino rule: 64->64 bias", 2, 64, 8, 8, 64, 3, 3, 1, 1, 1, 1, true},
        {"wino rule: 64->56", 2, 64, 8, 8, 56, 3, 3, 1, 1, 1, 1, false},
        {"wino rule: 64->64 stride 2", 2, 64, 8, 8, 64, 3, 3, 2, 1, 1, 1, false},
        {"wino rule: 64->64 padding 2, dilation 2", 2, 64, 8, 8, 64, 3, 3, 1, 2, 2, 1, false},
    };
    /* per case: the passes (bit p) that take Winograd */
    const int want[] = {7, 7, 3, 3, 0, 0, 0, 0, 0};
    const bool has = ampc__dnnl_wino();
    ampc__cpu_conv_winograd = -1;   /* the rule (a failed test above may have left it forced) */
    for (int on = 0; on < 2; on++) {
        ampc_set_conv_winograd(on);
        for (size_t ci = 0; ci < sizeof rule / sizeof *rule; ci++)
            for (int p = 0; p < 3; p++) {
                /* backward data has no bias: a biased layer's data gradient may take it */
                bool w = on && has && ((want[ci] >> p & 1) || (p == 1 && rule[ci].bias));
                if (runs_wino(&rule[ci], true, AMPC_F32, p) != w || runs_wino(&rule[ci], false, AMPC_F32, p) != w ||
                    runs_wino(&rule[ci], true, AMPC_BF16, p))
                    fail_msg("%s, Winograd %s, pass %d: want %s", rule[ci].name, on ? "on" : "off", p, w ? "Winograd" : "direct");
            }
    }
    ampc_set_conv_winograd(true);
}

// ---------------------------------------------------------------------------------------------
// Empty input under padding (the kernels' own fallbacks): y is the bias broadcast over each
// pixel's channels, gw is zero and gb[o] the sum of channel o of gy

static void test_cl_empty_input(void **state) {
    (void)state;
    const ampc_conv_desc d = {.N = 2, .C = 3, .H = 0, .W = 2, .O = 3, .KH = 1, .KW = 1, .OH = 2, .OW = 4,
                              .stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1, .channels_last = true};
    const ampc_dtype dts[] = {AMPC_F32, AMPC_BF16, AMPC_F16};
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_CPU);
    for (size_t di = 0; di < 3; di++) {
        ampc_dtype dt = dts[di];
        ampc_scope_begin();
        double gyv[48];
        for (int i = 0; i < 48; i++) gyv[i] = (double)(i / 8 % 3 + 1);   /* NCHW: channel o holds o + 1 */
        ampc_tensor *x = cpu_tensor(dt, 4, (int64_t[]){2, 3, 0, 2}, true, NULL);
        ampc_tensor *w = cpu_tensor(dt, 4, (int64_t[]){3, 3, 1, 1}, false, (double[]){1, 1, 1, 1, 1, 1, 1, 1, 1});
        ampc_tensor *b = cpu_tensor(dt, 1, (int64_t[]){3}, false, (double[]){0.5, -2, 4});
        ampc_tensor *y = cpu_tensor(dt, 4, (int64_t[]){2, 3, 2, 4}, true, NULL);
        ampc_tensor *gy = cpu_tensor(dt, 4, (int64_t[]){2, 3, 2, 4}, true, gyv);
        ampc_tensor *gw = cpu_tensor(dt, 4, (int64_t[]){3, 3, 1, 1}, false, NULL);
        ampc_tensor *gb = cpu_tensor(dt, 1, (int64_t[]){3}, false, NULL);
        ASSERT_OK(be->conv2d(&d, x, w, b, y));
        ASSERT_OK(be->conv2d_backward_weights(&d, x, gy, gw, gb));
        double *vy = cpu_values(y), *vw = cpu_values(gw), *vb = cpu_values(gb);
        const double bias[3] = {0.5, -2, 4};
        for (int i = 0; i < 48; i++) assert_true(vy[i] == bias[i / 8 % 3]);
        for (int i = 0; i < 9; i++) assert_true(vw[i] == 0.0);
        for (int o = 0; o < 3; o++) assert_true(vb[o] == 16.0 * (o + 1));   /* 2 images * 8 pixels */
        free(vy), free(vw), free(vb);
        ampc_scope_end();
    }
}

// ---------------------------------------------------------------------------------------------
// Formats that disagree with the descriptor are refused

/* the door (dispatch.c) refuses formats other than the descriptor's, for every device */
static void test_cl_format_errors(void **state) {
    (void)state;
    ampc_conv_desc d = {.N = 1, .C = 4, .H = 3, .W = 3, .O = 4, .KH = 1, .KW = 1, .OH = 3, .OW = 3,
                        .stride = {1, 1}, .padding = {0, 0}, .dilation = {1, 1}, .groups = 1, .channels_last = true};
    int64_t as[4] = {1, 4, 3, 3}, ws[4] = {4, 4, 1, 1};
    ampc_scope_begin();
    ampc_tensor *xc = cpu_tensor(AMPC_F32, 4, as, true, NULL), *xp = cpu_tensor(AMPC_F32, 4, as, false, NULL);
    ampc_tensor *yc = cpu_tensor(AMPC_F32, 4, as, true, NULL), *yp = cpu_tensor(AMPC_F32, 4, as, false, NULL);
    ampc_tensor *w = cpu_tensor(AMPC_F32, 4, ws, false, NULL), *wc = cpu_tensor(AMPC_F32, 4, ws, true, NULL);
    assert_int_equal(ampc__k_conv2d(&d, xp, w, NULL, yc), AMPC_ERR_INVALID);   /* contiguous x, channels-last descriptor */
    assert_int_equal(ampc__k_conv2d(&d, xc, w, NULL, yp), AMPC_ERR_INVALID);
    assert_int_equal(ampc__k_conv2d(&d, xc, wc, NULL, yc), AMPC_ERR_INVALID);   /* weights stay OIHW */
    assert_int_equal(ampc__k_conv2d_backward_data(&d, yp, w, xc), AMPC_ERR_INVALID);
    assert_int_equal(ampc__k_conv2d_backward_weights(&d, xc, yp, w, NULL), AMPC_ERR_INVALID);
    d.channels_last = false;
    assert_int_equal(ampc__k_conv2d(&d, xc, w, NULL, yc), AMPC_ERR_INVALID);
    ampc_clear_error();
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Steady state: the third identical round of the three passes makes no system allocation, on
// the paths the rule picks and on im2col + matmul in chunks (forced, cols capped at 8 KiB)

static void test_cl_steady_state(void **state) {
    (void)state;
    const ampc_dtype dts[] = {AMPC_F32, AMPC_BF16, AMPC_F16};
    const ampc_backend *be = ampc__backend(AMPC_DEVICE_CPU);
    size_t cap0 = ampc__cpu_conv_im2col_cap, wcap0 = ampc__cpu_conv_wino_cap;
    for (int forced = 0; forced < 3; forced++)   /* by rule (Winograd for f32/f16 3x3), im2col, Winograd off */
    for (size_t di = 0; di < 3; di++)
        for (int k = 1; k <= 3; k += 2) {
            ampc_dtype dt = dts[di];
            ampc__cpu_conv_im2col = forced == 1 ? 1 : -1;
            ampc__cpu_conv_im2col_cap = forced == 1 ? 8 << 10 : cap0;
            ampc__cpu_conv_winograd = forced == 2 ? 0 : -1;
            ampc__cpu_conv_wino_cap = 40000;   /* Winograd in chunks of 2 images */
            cl_case c = {"steady", 4, 16, 10, 10, 32, k, k, 1, k / 2, 1, 1, false};
            ampc_conv_desc d = make_desc(&c, true);
            int64_t xs[4] = {4, 16, 10, 10}, ys[4] = {4, 32, 10, 10}, ws[4] = {32, 16, k, k};
            ampc_scope_begin();
            ampc_tensor *x = cpu_tensor(dt, 4, xs, true, NULL), *gx = cpu_tensor(dt, 4, xs, true, NULL);
            ampc_tensor *y = cpu_tensor(dt, 4, ys, true, NULL), *gy = cpu_tensor(dt, 4, ys, true, NULL);
            ampc_tensor *w = cpu_tensor(dt, 4, ws, false, NULL), *gw = cpu_tensor(AMPC_F32, 4, ws, false, NULL);
            uint64_t before = 0;
            for (int step = 0; step < 3; step++) {
                if (step == 2) before = ampc_memory_stats().n_malloc;
                ASSERT_OK(be->conv2d(&d, x, w, NULL, y));
                ASSERT_OK(be->conv2d_backward_data(&d, gy, w, gx));
                ASSERT_OK(be->conv2d_backward_weights(&d, x, gy, gw, NULL));
            }
            uint64_t after = ampc_memory_stats().n_malloc;
            if (after != before)
                fail_msg("%s %dx%d%s: round 3 made %llu new system allocations", ampc_dtype_name(dt), k, k,
                         forced == 1 ? " (im2col)" : forced == 2 ? " (Winograd off)" : "", (unsigned long long)(after - before));
            ampc_scope_end();
        }
    ampc__cpu_conv_im2col = -1;
    ampc__cpu_conv_im2col_cap = cap0;
    ampc__cpu_conv_winograd = -1;
    ampc__cpu_conv_wino_cap = wcap0;
}

// ---------------------------------------------------------------------------------------------
// Which oneDNN kernels run on channels-last ResNet layers: never the reference ones, bf16 on
// the AVX512_BF16 kernels where the CPU has them

static void test_cl_impl_names(void **state) {
    (void)state;
    /* N, C, H, W, O, k, stride, groups */
    const int64_t layers[][8] = {
        {64, 3, 32, 32, 64, 3, 1, 1},     {64, 64, 32, 32, 64, 3, 1, 1},    {64, 64, 32, 32, 128, 3, 2, 1},
        {64, 64, 32, 32, 128, 1, 2, 1},   {64, 512, 4, 4, 512, 3, 1, 1},    {16, 3, 224, 224, 64, 7, 2, 1},
        {16, 256, 56, 56, 64, 1, 1, 1},   {16, 2048, 7, 7, 512, 1, 1, 1},   {16, 1024, 14, 14, 2048, 1, 2, 1},
        {8, 32, 16, 16, 32, 3, 1, 32},    {128, 1, 28, 28, 32, 3, 1, 1},
    };
    static const char *passes[3] = {"forward", "backward data", "backward weights"};
    bool has_bf16 = ampc_dtype_native(AMPC_DEVICE_CPU, AMPC_BF16);   /* oneDNN runs bf16 on bf16 units here */
    for (size_t i = 0; i < sizeof layers / sizeof *layers; i++) {
        const int64_t *l = layers[i];
        int pad = (int)(l[5] / 2);
        cl_case c = {"impl", l[0], l[1], l[2], l[3], l[4], l[5], l[5], (int)l[6], pad, 1, (int)l[7], false};
        ampc_conv_desc d = make_desc(&c, true);
        for (int di = 0; di < 2; di++)
            for (int p = 0; p < 6; p++) {   /* the three passes without, then with bias */
                char name[128];
                ampc_dtype dt = di ? AMPC_BF16 : AMPC_F32;
                ASSERT_OK(ampc__cpu_conv_impl(&d, dt, p % 3, p >= 3, name, sizeof name));
                print_message("conv NHWC %s %lldx%lld s%d g%d %lld->%lld %s%s: %s\n", ampc_dtype_name(dt), (long long)d.KH,
                              (long long)d.KW, d.stride[0], d.groups, (long long)d.C, (long long)d.O, passes[p % 3],
                              p >= 3 ? " (bias)" : "", name);
                assert_null(strstr(name, "ref"));
                if (dt == AMPC_BF16 && has_bf16) assert_true(tu_impl_bf16_native(name));
            }
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cl_cases),
        cmocka_unit_test(test_cl_im2col),
        cmocka_unit_test(test_cl_im2col_rule),
        cmocka_unit_test(test_cl_winograd),
        cmocka_unit_test(test_cl_winograd_rule),
        cmocka_unit_test(test_cl_empty_input),
        cmocka_unit_test(test_cl_format_errors),
        cmocka_unit_test(test_cl_steady_state),
        cmocka_unit_test(test_cl_impl_names),
    };
    return cmocka_run_group_tests_name("conv_cl", tests, tu_group_setup, tu_group_teardown);
}
