/*
 * test_conv_cl.c - the CPU convolution kernels on channels-last (NHWC) activations, called
 * through the backend table: forward (+bias), backward data and backward weights (+bias) of
 * NHWC tensors against the same kernels on contiguous (NCHW) tensors and against the REF
 * backend in f64, for f32, bf16, f16 and 16-bit x/gy with f32 gw/gb (autocast), on 1 and 3
 * threads (bf16 weight gradients are split over threads); the im2col + matmul path forced on
 * every ungrouped case (all three passes, cols capped so that the batch is split in chunks,
 * and uncapped); the empty-input fallbacks, format errors, the steady state (no new
 * allocations) and which oneDNN kernels run.
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

/* |got - want| <= scale * bound(K, S, eps, eta) elementwise, bound as in the top comment (want:
   the exact values, or another kernel's with scale 2). */
static void check_close(const char *what, const double *got, const double *want, const double *exact, const double *S,
                        size_t n, double K, double eps, double eta, double scale) {
    double g = gamma_f32(K);
    for (size_t i = 0; i < n; i++) {
        double bound = scale * (g * S[i] + eps * (fabs(exact[i]) + g * S[i]) + eta);
        if (!(fabs(got[i] - want[i]) <= bound))
            fail_msg("%s [%zu]: got %.9g want %.9g (exact %.9g), error %.3g > bound %.3g", what, i, got[i], want[i], exact[i],
                     fabs(got[i] - want[i]), bound);
    }
}

// ---------------------------------------------------------------------------------------------
// Channels-last against contiguous and REF

/* Every case of cs against contiguous and REF; im2col: the im2col override (-1: by rule). */
static void check_cases(const cl_case *cs, size_t ncases, int im2col) {
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
                    const double *cl, *plain, *exact, *S;
                    size_t n;
                    double K, eps, eta;
                } outs[] = {
                    {"y", nhwc.y, nchw.y, ref.y, mag.y, ny, Kf, e, h},
                    {"gx", nhwc.gx, nchw.gx, ref.gx, mag.gx, nx, Kd, e, h},
                    {"gw", nhwc.gw, nchw.gw, ref.gw, mag.gw, nw, Kw, ew, hw},
                    {"gb", nhwc.gb, nchw.gb, ref.gb, mag.gb, c->bias ? no : 0, Kw, ew, hw},
                };
                for (int o = 0; o < 4; o++) {
                    if (!outs[o].n) continue;
                    snprintf(what, sizeof what, "%s%s, %s (gw %s), %d threads: %s channels-last vs contiguous", c->name,
                             im2col > 0 ? " (im2col)" : "", ampc_dtype_name(dt), ampc_dtype_name(gdt), threads[ti], outs[o].name);
                    check_close(what, outs[o].cl, outs[o].plain, outs[o].exact, outs[o].S, outs[o].n, outs[o].K, outs[o].eps, outs[o].eta, 2);
                    snprintf(what, sizeof what, "%s%s, %s (gw %s), %d threads: %s channels-last vs REF", c->name,
                             im2col > 0 ? " (im2col)" : "", ampc_dtype_name(dt), ampc_dtype_name(gdt), threads[ti], outs[o].name);
                    check_close(what, outs[o].cl, outs[o].exact, outs[o].exact, outs[o].S, outs[o].n, outs[o].K, outs[o].eps, outs[o].eta, 1);
                }
                io_free(&nchw), io_free(&nhwc);
            }
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
    const bool amx = ampc__dnnl_amx();
    for (size_t ci = 0; ci < sizeof rule_cases / sizeof *rule_cases; ci++) {
        ampc_conv_desc d = make_desc(&rule_cases[ci], true);
        for (int di = 0; di < 2; di++)
            for (int pass = 0; pass < 3; pass++) {
                char name[128];
                ASSERT_OK(ampc__cpu_conv_impl(&d, di ? AMPC_BF16 : AMPC_F32, pass, rule_cases[ci].bias, name, sizeof name));
                bool want = di && amx ? amx_bf16[ci] >> pass & 1 : pass == 2 && (chosen[ci] >> di & 1);
                bool got = strncmp(name, "im2col+", 7) == 0;
                if (got != want) fail_msg("%s, %s, pass %d: %s", rule_cases[ci].name, di ? "bf16" : "f32", pass, name);
            }
    }
    check_cases(rule_cases, sizeof rule_cases / sizeof *rule_cases, -1);
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
    size_t cap0 = ampc__cpu_conv_im2col_cap;
    for (int forced = 0; forced < 2; forced++)
    for (size_t di = 0; di < 3; di++)
        for (int k = 1; k <= 3; k += 2) {
            ampc_dtype dt = dts[di];
            ampc__cpu_conv_im2col = forced ? 1 : -1;
            ampc__cpu_conv_im2col_cap = forced ? 8 << 10 : cap0;
            cl_case c = {"steady", 4, 16, 10, 10, 24, k, k, 1, k / 2, 1, 1, false};
            ampc_conv_desc d = make_desc(&c, true);
            int64_t xs[4] = {4, 16, 10, 10}, ys[4] = {4, 24, 10, 10}, ws[4] = {24, 16, k, k};
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
                         forced ? " (im2col)" : "", (unsigned long long)(after - before));
            ampc_scope_end();
        }
    ampc__cpu_conv_im2col = -1;
    ampc__cpu_conv_im2col_cap = cap0;
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
    bool has_bf16 = strstr(ampc_cpu_features(), "avx512_bf16") != NULL;
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
        cmocka_unit_test(test_cl_empty_input),
        cmocka_unit_test(test_cl_format_errors),
        cmocka_unit_test(test_cl_steady_state),
        cmocka_unit_test(test_cl_impl_names),
    };
    return cmocka_run_group_tests_name("conv_cl", tests, tu_group_setup, tu_group_teardown);
}
