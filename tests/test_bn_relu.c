/*
 * test_bn_relu.c - the fused BatchNorm2d + ReLU (ampc__batch_norm2d_relu, the backends'
 * batch_norm_relu kernels, and the ResNets' use of it) against the composite
 * ampc_relu(ampc_batch_norm2d(...)), bit for bit: the fusion promises the same values, not close
 * ones, so every comparison is of bits (NaN payloads and signed zeros included).
 *   - op level: output, x/weight/bias gradients and running statistics, f32/f16/bf16 on CPU and
 *     f64 on REF, contiguous (both CPU walks: per channel and per column) and channels-last,
 *     training and evaluation, inputs with NaN, exact zeros and exact-zero pre-activations;
 *   - ResNet-18 (small input, batch 4, 16x16) forward + backward, fp32 and autocast bf16
 *     channels-last, fused against ampc__fuse_bn_relu = false; the number of fused kernel calls;
 *     and that replacing "layer1.0.relu" still takes effect (that block falls back).
 */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "nn/nn.h"
#include "ops/ops.h"

/* a and b (n doubles) identical bit for bit */
static void assert_same_bits(const char *what, const double *a, const double *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof *a))
            fail_msg("%s: element %zu differs: %.17g vs %.17g", what, i, a[i], b[i]);
}

// ---------------------------------------------------------------------------------------------
// Op level

typedef struct {
    int64_t shape[4];
    bool cl, training;
} bn_case;

/* Everything one run produces: y, x.grad, w.grad, b.grad, running mean and var, z.grad (values;
   z.grad only for the add variants). */
typedef struct {
    double *v[7];
} bn_run;

static const char *run_names[] = {"y", "x.grad", "weight.grad", "bias.grad", "running_mean", "running_var", "z.grad"};

/* What run_case computes: relu(bn(x)) as two ops or the fused op, relu(bn(x) + z) as three ops
   or ampc__batch_norm2d_add_relu */
enum { COMPOSITE, FUSED, ADD_COMPOSITE, ADD_FUSED };

/* x: uniform in [-2, 2] with, per channel 0, exact zeros, and NaN in the last channel's first
   element; running_mean[0] = 0 and bias[0] = 0, so in evaluation x = 0 gives a pre-activation
   of exactly 0 (relu keeps it, its backward masks it). */
static bn_run run_case(ampc_device dev, ampc_dtype dt, const bn_case *k, int mode) {
    bool fused = mode == FUSED, add = mode >= ADD_COMPOSITE;
    const int64_t *sh = k->shape, N = sh[0], C = sh[1], S = sh[2] * sh[3], n = N * C * S;
    ampc_dtype sdt = dev == AMPC_DEVICE_REF ? AMPC_F64 : AMPC_F32;
    double *x = malloc((size_t)n * sizeof *x), *g = malloc((size_t)n * sizeof *g);
    double *w = malloc((size_t)C * sizeof *w), *b = malloc((size_t)C * sizeof *b);
    double *rm = malloc((size_t)C * sizeof *rm), *rv = malloc((size_t)C * sizeof *rv), *z = malloc((size_t)n * sizeof *z);
    tu_fill_uniform(z, (size_t)n, 15, -1, 1);
    tu_fill_uniform(x, (size_t)n, 11, -2, 2);
    tu_fill_uniform(g, (size_t)n, 12, -1, 1);
    tu_fill_uniform(w, (size_t)C, 13, 0.5, 1.5);
    tu_fill_uniform(b, (size_t)C, 14, -0.5, 0.5);
    for (int64_t c = 0; c < C; c++) rm[c] = 0.1 * (double)(c % 7) - 0.3, rv[c] = 0.5 + 0.25 * (double)(c % 5);
    rm[0] = 0, b[0] = 0;
    for (int64_t i = 0; i < n; i += 3)
        if ((i / S) % C == 0) x[i] = 0;
    if (C > 1) x[(C - 1) * S] = NAN;
    ampc_set_default_device(dev);
    ampc_scope_begin();
    ampc_tensor *xt = ampc_tensor_from_f64(dt, 4, sh, x), *gt = ampc_tensor_from_f64(dt, 4, sh, g);
    ampc_tensor *wt = ampc_tensor_from_f64(sdt, 1, &C, w), *bt = ampc_tensor_from_f64(sdt, 1, &C, b);
    ampc_tensor *rmt = ampc_tensor_from_f64(sdt, 1, &C, rm), *rvt = ampc_tensor_from_f64(sdt, 1, &C, rv);
    ASSERT_OK(ampc_tensor_set_requires_grad(xt, true));
    ASSERT_OK(ampc_tensor_set_requires_grad(wt, true));
    ASSERT_OK(ampc_tensor_set_requires_grad(bt, true));
    ampc_tensor *zt = ampc_tensor_from_f64(dt, 4, sh, z);
    ASSERT_OK(ampc_tensor_set_requires_grad(zt, true));
    ampc_tensor *xin = k->cl ? ampc_to_memory_format(xt, AMPC_CHANNELS_LAST) : xt;
    ampc_tensor *gin = k->cl ? ampc_to_memory_format(gt, AMPC_CHANNELS_LAST) : gt;
    ampc_tensor *zin = k->cl ? ampc_to_memory_format(zt, AMPC_CHANNELS_LAST) : zt;
    ampc_tensor *y = mode == FUSED       ? ampc__batch_norm2d_relu(xin, wt, bt, rmt, rvt, k->training, 0.1, 1e-5)
                     : mode == ADD_FUSED ? ampc__batch_norm2d_add_relu(xin, wt, bt, rmt, rvt, zin, k->training, 0.1, 1e-5, false)
                     : add               ? ampc_relu(ampc_add(ampc_batch_norm2d(xin, wt, bt, rmt, rvt, k->training, 0.1, 1e-5), zin))
                                         : ampc_relu(ampc_batch_norm2d(xin, wt, bt, rmt, rvt, k->training, 0.1, 1e-5));
    ASSERT_NOT_NULL_MSG(y);
    assert_int_equal(ampc_tensor_memory_format(y), k->cl ? AMPC_CHANNELS_LAST : AMPC_CONTIGUOUS_FORMAT);
    /* the add is one op where the backend has the kernels (CUDA), three elsewhere */
    bool one_op = mode == ADD_FUSED && ampc__backend(dev)->batch_norm_add_relu;
    assert_string_equal(ampc_tensor_grad_fn_name(y), fused ? "NativeBatchNormReluBackward"
                                                     : one_op ? "NativeBatchNormAddReluBackward" : "ReluBackward");
    ASSERT_OK(ampc_backward_with_grad(y, gin));
    bn_run r = {{tu_values(y), tu_values(ampc_tensor_grad(xt)), tu_values(ampc_tensor_grad(wt)),
                 tu_values(ampc_tensor_grad(bt)), tu_values(rmt), tu_values(rvt), add ? tu_values(ampc_tensor_grad(zt)) : NULL}};
    ampc_scope_end();
    ampc_set_default_device(AMPC_DEVICE_CPU);
    free(x), free(g), free(w), free(b), free(rm), free(rv), free(z);
    return r;
}

/* the fused op against its composite (add: the residual variant) */
static void compare_case_add(ampc_device dev, ampc_dtype dt, const bn_case *k, bool add) {
    bn_run f = run_case(dev, dt, k, add ? ADD_FUSED : FUSED), c = run_case(dev, dt, k, add ? ADD_COMPOSITE : COMPOSITE);
    const int64_t *sh = k->shape;
    size_t n = (size_t)(sh[0] * sh[1] * sh[2] * sh[3]), C = (size_t)sh[1];
    size_t sizes[7] = {n, n, C, C, C, C, n};
    for (int i = 0; i < (add ? 7 : 6); i++) {
        char what[160];
        snprintf(what, sizeof what, "%s %s (%lld,%lld,%lld,%lld)%s %s%s: %s", ampc_device_name(dev), ampc_dtype_name(dt),
                 (long long)sh[0], (long long)sh[1], (long long)sh[2], (long long)sh[3], k->cl ? " cl" : "",
                 k->training ? "train" : "eval", add ? " + z" : "", run_names[i]);
        assert_same_bits(what, f.v[i], c.v[i], sizes[i]);
    }
    for (int i = 0; i < 7; i++) free(f.v[i]), free(c.v[i]);
}

static void compare_case(ampc_device dev, ampc_dtype dt, const bn_case *k) { compare_case_add(dev, dt, k, false); }

/* per channel (S >= 32), per column (S < 32), channels-last (long rows: C > the staging chunk) */
static const bn_case cases[] = {
    {{3, 4, 8, 8}, false, true},   {{3, 4, 8, 8}, false, false},  {{2, 5, 3, 3}, false, true},
    {{2, 5, 3, 3}, false, false},  {{3, 4, 6, 5}, true, true},    {{3, 4, 6, 5}, true, false},
    {{3, 1030, 2, 1}, true, true}, {{2, 70, 5, 7}, true, true},   {{2, 70, 5, 7}, true, false},
};

static void test_fused_equals_composite_cpu(void **state) {
    (void)state;
    const ampc_dtype dts[] = {AMPC_F32, AMPC_F16, AMPC_BF16};
    for (size_t d = 0; d < 3; d++)
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) compare_case(AMPC_DEVICE_CPU, dts[d], &cases[i]);
}

/* On the GPU: both fusions against their composites, on the vector kernels (channels-last, C a
   multiple of 8) and the per-element ones (the other cases). */
static void test_fused_equals_composite_cuda(void **state) {
    (void)state;
    if (!tu_cuda_available()) skip();
    static const bn_case vec_cases[] = {
        {{2, 64, 5, 7}, true, true}, {{2, 64, 5, 7}, true, false}, {{3, 16, 3, 3}, true, true}, {{2, 264, 3, 5}, true, true},
    };
    const ampc_dtype dts[] = {AMPC_F32, AMPC_F16, AMPC_BF16};
    for (size_t d = 0; d < 3; d++)
        for (int add = 0; add < 2; add++) {
            for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) compare_case_add(AMPC_DEVICE_CUDA, dts[d], &cases[i], add);
            for (size_t i = 0; i < sizeof vec_cases / sizeof *vec_cases; i++)
                compare_case_add(AMPC_DEVICE_CUDA, dts[d], &vec_cases[i], add);
        }
}

/* Where the backend has no add kernels (CPU, REF) the op is the composite itself. */
static void test_add_relu_composes_cpu_ref(void **state) {
    (void)state;
    const ampc_dtype dts[] = {AMPC_F32, AMPC_BF16};
    for (size_t d = 0; d < 2; d++) compare_case_add(AMPC_DEVICE_CPU, dts[d], &cases[4], true);
    compare_case_add(AMPC_DEVICE_REF, AMPC_F64, &cases[0], true);
}

static void test_fused_equals_composite_ref(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        if (!cases[i].cl) compare_case(AMPC_DEVICE_REF, AMPC_F64, &cases[i]);
}

/* Pre-activations that round to -0 in 16 bits: relu keeps -0 (not < 0), and its backward masks
   them (not > 0); in f32 they stay negative. Evaluation with x = -tiny, mean 0, scale 1. */
// ---------------------------------------------------------------------------------------------
// SyncBatchNorm's kernels in a world of one

/* The kernels of batch norm (relu: batch norm + ReLU) in training, forward then backward, called
   at the door with `sync` as given (the op passes sync only to a world of more than one): y, gx,
   gw, gb, the running statistics and the saved statistics, as values, into v[0..6). */
static void kernels_run(ampc_device dev, ampc_dtype dt, const bn_case *k, bool relu, bool sync, double *v[7]) {
    const int64_t *sh = k->shape, N = sh[0], C = sh[1], S = sh[2] * sh[3], n = N * C * S;
    ampc_dtype sdt = dev == AMPC_DEVICE_REF ? AMPC_F64 : AMPC_F32;
    double *x = malloc((size_t)n * sizeof *x), *g = malloc((size_t)n * sizeof *g), *w = malloc((size_t)C * sizeof *w);
    double *rs = malloc((size_t)(2 * C) * sizeof *rs);
    tu_fill_uniform(x, (size_t)n, 21, -1, 3);   /* mean 1: the centring matters */
    tu_fill_uniform(g, (size_t)n, 22, -1, 1);
    tu_fill_uniform(w, (size_t)C, 23, 0.5, 1.5);
    tu_fill_uniform(rs, (size_t)(2 * C), 24, 0.5, 1.5);
    ampc_set_default_device(dev);
    ampc_scope_begin();
    ampc_tensor *xt = ampc_tensor_from_f64(dt, 4, sh, x), *gt = ampc_tensor_from_f64(dt, 4, sh, g);
    ampc_tensor *wt = ampc_tensor_from_f64(sdt, 1, &C, w), *bt = ampc_tensor_from_f64(sdt, 1, &C, w);
    ampc_tensor *rmt = ampc_tensor_from_f64(sdt, 1, &C, rs), *rvt = ampc_tensor_from_f64(sdt, 1, &C, rs + C);
    ampc_tensor *xin = k->cl ? ampc_to_memory_format(xt, AMPC_CHANNELS_LAST) : xt;
    ampc_tensor *gin = k->cl ? ampc_to_memory_format(gt, AMPC_CHANNELS_LAST) : gt;
    ASSERT_NOT_NULL_MSG(xin && gin && wt && bt && rmt && rvt);
    ampc_tensor *y = ampc__tensor_like(xin, dt), *gx = ampc__tensor_like(xin, dt);
    ampc_tensor *gw = ampc__tensor_new(sdt, dev, 1, &C), *gb = ampc__tensor_new(sdt, dev, 1, &C);
    const int64_t rows[2] = {AMPC_BN_RELU_STAT_ROWS, C};
    ampc_tensor *stats = ampc__tensor_new(sdt, dev, 2, rows), *mean = ampc__tensor_new(sdt, dev, 1, &C);
    ampc_tensor *invstd = ampc__tensor_new(sdt, dev, 1, &C);
    ASSERT_NOT_NULL_MSG(y && gx && gw && gb && stats && mean && invstd);
    if (relu) {
        ASSERT_OK(ampc__k_batch_norm_relu(xin, wt, bt, rmt, rvt, y, stats, true, 0.1, 1e-5, sync));
        ASSERT_OK(ampc__k_batch_norm_relu_backward(xin, gin, wt, stats, true, sync, gx, gw, gb));
    } else {
        ASSERT_OK(ampc__k_batch_norm(xin, wt, bt, rmt, rvt, y, mean, invstd, true, 0.1, 1e-5, sync));
        ASSERT_OK(ampc__k_batch_norm_backward(xin, gin, wt, mean, invstd, true, sync, gx, gw, gb));
    }
    const ampc_tensor *res[7] = {y, gx, gw, gb, rmt, rvt, relu ? stats : mean};
    for (int i = 0; i < 7; i++) v[i] = tu_values(res[i]);
    ampc_tensor *own[7] = {y, gx, gw, gb, stats, mean, invstd};
    for (int i = 0; i < 7; i++) ampc__release(own[i]);
    ampc_scope_end();
    ampc_set_default_device(AMPC_DEVICE_CPU);
    free(x), free(g), free(w), free(rs);
}

/* With one process the exchange hands back this process's own statistics and sums, so the sync
   kernels (statistics pass, exchange, normalisation: two kernel sequences on CUDA) must give the
   plain kernels' bits: every device, dtype and walk (planar, columns, channels-last; on CUDA the
   vector kernels too, C a multiple of 8). Across processes test_dist's sync cases check them. */
static void test_sync_world_of_one(void **state) {
    (void)state;
    static const bn_case ks[] = {
        {{3, 4, 8, 8}, false, true}, {{2, 5, 3, 3}, false, true}, {{3, 4, 6, 5}, true, true}, {{2, 64, 5, 7}, true, true},
    };
    const ampc_device devs[] = {AMPC_DEVICE_CPU, AMPC_DEVICE_REF, AMPC_DEVICE_CUDA};
    const ampc_dtype dts[] = {AMPC_F32, AMPC_F16, AMPC_BF16};
    const char *names[7] = {"y", "gx", "gw", "gb", "running_mean", "running_var", "saved mean"};
    for (size_t d = 0; d < 3; d++) {
        if (devs[d] == AMPC_DEVICE_CUDA && !tu_cuda_available()) {
            print_message("sync kernels: no GPU here, CUDA skipped\n");
            continue;
        }
        for (size_t t = 0; t < (devs[d] == AMPC_DEVICE_REF ? 1 : 3); t++)
            for (size_t i = 0; i < sizeof ks / sizeof *ks; i++)
                for (int relu = 0; relu < 2; relu++) {
                    ampc_dtype dt = devs[d] == AMPC_DEVICE_REF ? AMPC_F64 : dts[t];
                    double *a[7], *b[7];
                    kernels_run(devs[d], dt, &ks[i], relu, true, a);
                    kernels_run(devs[d], dt, &ks[i], relu, false, b);
                    const int64_t *sh = ks[i].shape;
                    size_t n = (size_t)(sh[0] * sh[1] * sh[2] * sh[3]), C = (size_t)sh[1];
                    for (int r = 0; r < 7; r++) {
                        char what[160];
                        snprintf(what, sizeof what, "sync %s %s (%lld,%lld,%lld,%lld)%s%s: %s", ampc_device_name(devs[d]),
                                 ampc_dtype_name(dt), (long long)sh[0], (long long)sh[1], (long long)sh[2], (long long)sh[3],
                                 ks[i].cl ? " cl" : "", relu ? " relu" : "", names[r]);
                        assert_same_bits(what, a[r], b[r], r < 2 ? n : r == 6 && relu ? 2 * C : C);
                        free(a[r]), free(b[r]);
                    }
                }
    }
}

static void test_tiny_negatives(void **state) {
    (void)state;
    const ampc_dtype dts[] = {AMPC_F32, AMPC_F16, AMPC_BF16};
    const int64_t sh[4] = {2, 1, 6, 6}, C = 1, n = 72;
    for (size_t d = 0; d < 3; d++)
        for (int cl = 0; cl < 2; cl++) {
            double y[2][72], gx[2][72];
            for (int fused = 0; fused < 2; fused++) {
                double x[72], g[72];
                for (int64_t i = 0; i < n; i++) x[i] = (i % 3 == 0 ? -1e-30 : i % 3 == 1 ? 1e-30 : -0.0), g[i] = 1 + (double)i;
                ampc_scope_begin();
                ampc_tensor *xt = ampc_tensor_from_f64(dts[d], 4, sh, x), *gt = ampc_tensor_from_f64(dts[d], 4, sh, g);
                ampc_tensor *rm = ampc_tensor_zeros(AMPC_F32, 1, &C), *rv = ampc_tensor_full(AMPC_F32, 1, &C, 1.0);
                ASSERT_OK(ampc_tensor_set_requires_grad(xt, true));
                ampc_tensor *xin = cl ? ampc_to_memory_format(xt, AMPC_CHANNELS_LAST) : xt;
                ampc_tensor *gin = cl ? ampc_to_memory_format(gt, AMPC_CHANNELS_LAST) : gt;
                ampc_tensor *out = fused ? ampc__batch_norm2d_relu(xin, NULL, NULL, rm, rv, false, 0.1, 0.0)
                                         : ampc_relu(ampc_batch_norm2d(xin, NULL, NULL, rm, rv, false, 0.1, 0.0));
                ASSERT_OK(ampc_backward_with_grad(out, gin));
                ASSERT_OK(ampc_tensor_to_f64(out, y[fused], (size_t)n));
                ASSERT_OK(ampc_tensor_to_f64(ampc_tensor_grad(xt), gx[fused], (size_t)n));
                ampc_scope_end();
            }
            assert_same_bits("tiny y", y[1], y[0], (size_t)n);
            assert_same_bits("tiny gx", gx[1], gx[0], (size_t)n);
        }
}

// ---------------------------------------------------------------------------------------------
// ResNet-18

static int (*saved_bn_relu)(const ampc_tensor *, const ampc_tensor *, const ampc_tensor *, ampc_tensor *, ampc_tensor *,
                            ampc_tensor *, ampc_tensor *, bool, double, double, bool);
static int bn_relu_calls;

static int counting_bn_relu(const ampc_tensor *x, const ampc_tensor *w, const ampc_tensor *b, ampc_tensor *rm,
                            ampc_tensor *rv, ampc_tensor *y, ampc_tensor *st, bool tr, double mom, double eps, bool sync) {
    bn_relu_calls++;
    return saved_bn_relu(x, w, b, rm, rv, y, st, tr, mom, eps, sync);
}

/* The CPU table is a writable static (see tools/bench_profile.c); patched only while no kernel runs. */
static ampc_backend *cpu_table(void) { return (ampc_backend *)ampc__backend(AMPC_DEVICE_CPU); }

/* One training step of a fresh seeded ResNet-18 (4, 3, 16, 16): the logits, then every
   gradient and buffer in state_dict order, appended into vals (caller frees); *n values. */
static double *resnet_step(bool fuse, bool amp, ampc_memory_format fmt, const char *replace, int *calls, size_t *n) {
    ampc_manual_seed(7);
    ampc_module *net = ampc_model_new("resnet18", &(ampc_model_options){.num_classes = 10, .small_input = true,
                                                                       .memory_format = fmt});
    ASSERT_NOT_NULL_MSG(net);
    if (replace) ASSERT_OK(ampc_module_replace(net, replace, ampc_gelu_new()));
    const int64_t sh[4] = {4, 3, 16, 16}, C = 10;
    double *x = malloc(4 * 3 * 16 * 16 * sizeof *x);
    tu_fill_uniform(x, 4 * 3 * 16 * 16, 21, -1, 1);
    int64_t tg[4] = {1, 3, 5, 7}, nt = 4;
    bool prev = ampc__fuse_bn_relu;
    ampc__fuse_bn_relu = fuse;
    bn_relu_calls = 0;
    saved_bn_relu = cpu_table()->batch_norm_relu;
    cpu_table()->batch_norm_relu = counting_bn_relu;
    ampc_scope_begin();
    ampc_tensor *xt = ampc_tensor_from_f64(AMPC_F32, 4, sh, x), *t = ampc_tensor_from_i64(1, &nt, tg);
    ampc_autocast_enter(AMPC_BF16, amp);
    ampc_tensor *logits = ampc_module_forward(net, xt);
    ampc_autocast_exit();
    ASSERT_NOT_NULL_MSG(logits);
    ampc_tensor *loss = ampc_cross_entropy(logits, t, NULL);
    ASSERT_OK(ampc_backward(loss));
    ampc_tensor **ts;
    const char **names;
    int k = ampc_module_state_dict(net, &ts, &names);
    ASSERT_OK(k);
    size_t total = (size_t)(4 * C);
    for (int i = 0; i < k; i++) total += 2 * (size_t)ampc_tensor_numel(ts[i]);
    double *v = malloc(total * sizeof *v), *p = v;
    ASSERT_OK(ampc_tensor_to_f64(logits, p, (size_t)(4 * C)));
    p += 4 * C;
    for (int i = 0; i < k; i++) {
        size_t m = (size_t)ampc_tensor_numel(ts[i]);
        ASSERT_OK(ampc_tensor_to_f64(ts[i], p, m));   /* buffers: the running statistics after the step */
        ampc_tensor *g = ampc_tensor_grad(ts[i]);
        if (g) ASSERT_OK(ampc_tensor_to_f64(g, p + m, m));
        else memset(p + m, 0, m * sizeof *p);
        p += 2 * m;
    }
    ampc_scope_end();
    cpu_table()->batch_norm_relu = saved_bn_relu;
    ampc__fuse_bn_relu = prev;
    *calls = bn_relu_calls;
    *n = total;
    ampc_module_free(net);
    free(x);
    return v;
}

static void resnet_case(bool amp, ampc_memory_format fmt) {
    size_t nf, nc;
    int calls_f, calls_c;
    double *f = resnet_step(true, amp, fmt, NULL, &calls_f, &nf), *c = resnet_step(false, amp, fmt, NULL, &calls_c, &nc);
    assert_int_equal(calls_f, 9);   /* the stem and bn1 of each of the 8 blocks */
    assert_int_equal(calls_c, 0);
    assert_int_equal(nf, nc);
    assert_same_bits(amp ? "resnet18 amp-bf16" : "resnet18 fp32", f, c, nf);
    free(f), free(c);
}

static void test_resnet18_fp32(void **state) {
    (void)state;
    resnet_case(false, AMPC_CONTIGUOUS_FORMAT);
}

static void test_resnet18_amp_bf16_cl(void **state) {
    (void)state;
    resnet_case(true, AMPC_CHANNELS_LAST);
}

/* A replaced relu child is used: that block runs bn1 then the GELU module (both of its "relu"
   uses); the model differs from the plain one and equals the unfused run with the same
   replacement. */
static void test_resnet18_replaced_relu(void **state) {
    (void)state;
    size_t n1, n2, n3;
    int k1, k2, k3;
    double *f = resnet_step(true, false, AMPC_CHANNELS_LAST, "layer1.0.relu", &k1, &n1);
    double *c = resnet_step(false, false, AMPC_CHANNELS_LAST, "layer1.0.relu", &k2, &n2);
    double *plain = resnet_step(true, false, AMPC_CHANNELS_LAST, NULL, &k3, &n3);
    assert_int_equal(k1, 8);
    assert_int_equal(k3, 9);
    assert_same_bits("resnet18 with layer1.0.relu = GELU", f, c, n1);
    assert_true(memcmp(f, plain, 40 * sizeof *f) != 0);   /* the logits changed */
    free(f), free(c), free(plain);
}

int main(void) {
    /* the CUDA backend's fused add kernels (the default), even where the environment turns them off */
    setenv("AMPC_CUDA_BN_ADD_RELU", "1", 1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fused_equals_composite_cpu), cmocka_unit_test(test_fused_equals_composite_ref),
        cmocka_unit_test(test_fused_equals_composite_cuda), cmocka_unit_test(test_add_relu_composes_cpu_ref),
        cmocka_unit_test(test_tiny_negatives),             cmocka_unit_test(test_resnet18_fp32),
        cmocka_unit_test(test_resnet18_amp_bf16_cl),       cmocka_unit_test(test_resnet18_replaced_relu),
        cmocka_unit_test(test_sync_world_of_one),
    };
    return cmocka_run_group_tests_name("bn_relu", tests, tu_group_setup, tu_group_teardown);
}
