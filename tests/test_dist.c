/*
 * test_dist.c - data-parallel training (ampc/dist.h) against single-process training.
 *
 * Run alone it is one process of a world of one; ctest also runs it as `mpirun -np 2`
 * (test_dist_mpi2). Every rank builds the reference itself: the same model trained in one process
 * on the whole global batch of 64, to which DDP training with 64/world samples per rank must
 * come. An assertion that fails on one rank ends the whole job (MPI_Abort) so that no rank waits
 * in a collective for a rank that left.
 */
#include "testutil.h"

#include "ampc/dist.h"
#include "core/core.h"
#include "ops/ops.h"
#include "optim/optim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { GLOBAL = 64, PIX = 28 * 28, STEPS = 4 };
#define LR 0.05
static int rank, world;
static ampc_device g_dev = AMPC_DEVICE_CPU;   /* where run_new's models and batch's tensors live */

#define D_ASSERT(cond, ...)                                                                        \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "rank %d: %s:%d: %s: ", rank, __FILE__, __LINE__, #cond);              \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, " (%s)\n", ampc_last_error());                                         \
            if (world > 1) ampc_dist_abort(1);                                                     \
            fail();                                                                                \
        }                                                                                          \
    } while (0)

typedef enum { FP32, BF16, FP16 } mode;
static const char *MODE_NAMES[] = {"fp32", "amp-bf16", "amp-fp16"};

/* Rows [lo, hi) of step's global batch: pixels U(-1, 1), labels 0..9, both from the step alone
   (xorshift, not the library's generator); `poison` puts 1e30 into the first pixel (inf in
   fp16, so the scaled gradients overflow). */
static void batch(int step, int lo, int hi, bool poison, ampc_tensor **x, ampc_tensor **y) {
    double *v = malloc(sizeof(double) * GLOBAL * PIX);
    tu_fill_uniform(v, (size_t)GLOBAL * PIX, 1000 + (uint64_t)step, -1, 1);
    float *xf = malloc(sizeof(float) * (size_t)(hi - lo) * PIX);
    int64_t lab[GLOBAL];
    uint64_t s = 77 + (uint64_t)step;
    for (int i = 0; i < GLOBAL; i++) lab[i] = (int64_t)tu_uniform(&s, 0, 10) % 10;
    for (int64_t i = 0; i < (int64_t)(hi - lo) * PIX; i++) xf[i] = (float)v[(int64_t)lo * PIX + i];
    if (poison) xf[0] = 1e30f;
    *x = ampc_tensor_from_f32(AMPC_F32, 4, (int64_t[]){hi - lo, 1, 28, 28}, xf);
    *y = ampc_tensor_from_i64(1, (int64_t[]){hi - lo}, lab + lo);
    if (g_dev != AMPC_DEVICE_CPU)
        *x = ampc_tensor_to(*x, g_dev, g_dev == AMPC_DEVICE_REF ? AMPC_F64 : AMPC_F32), *y = ampc_tensor_to(*y, g_dev, AMPC_I64);
    free(v);
    free(xf);
}

typedef struct {
    ampc_module *net;
    ampc_optimizer *opt;
    ampc_scaler *sc;
    ampc_ddp *ddp;
} run;

static const ampc_ddp_options *dflt(void) {
    static ampc_ddp_options o;
    o = ampc_ddp_defaults();
    return &o;
}

/* "bn": two conv + BatchNorm + ReLU stages and a linear head; the BatchNorms as
   SyncBatchNorm when sync_bn. In training mode (it has no dropout). */
static ampc_module *bn_model(bool sync_bn) {
    const ampc_conv2d_options s2 = {.stride = {2, 2}};
    ampc_module *m = ampc_sequential(8, ampc_conv2d_new(1, 8, 3, &s2, false), ampc_batchnorm2d_new(8), ampc_relu_new(),
                                     ampc_conv2d_new(8, 16, 3, &s2, false), ampc_batchnorm2d_new(16), ampc_relu_new(),
                                     ampc_flatten_new(), ampc_linear_new(16 * 6 * 6, 10, true));
    if (m && sync_bn) D_ASSERT(ampc_module_convert_sync_batchnorm(m) == 2, "convert_sync_batchnorm");
    return m;
}

static run run_new(const char *model, mode m, const ampc_ddp_options *ddp) {
    run r = {0};
    ampc_manual_seed(7);
    bool bn = !strncmp(model, "bn", 2);   /* "bn" (per-process statistics) or "bn-sync" */
    ampc_set_default_device(g_dev);   /* REF: f64 parameters */
    r.net = bn ? bn_model(!strcmp(model, "bn-sync")) : ampc_model_new(model, &(ampc_model_options){0});
    ampc_set_default_device(AMPC_DEVICE_CPU);
    ampc_module_train(r.net, bn);   /* no dropout: its masks depend on which rank draws them */
    r.opt = ampc_sgd_new(r.net, &(ampc_sgd_options){.lr = LR, .momentum = 0.9});
    ampc_scaler_options so = ampc_scaler_defaults();
    so.enabled = m == FP16;
    so.growth_interval = 2;   /* the scale moves during the run */
    r.sc = ampc_scaler_new(&so);
    D_ASSERT(r.net && r.opt && r.sc, "model");
    if (ddp) {
        r.ddp = ampc_ddp_new(r.net, ddp);
        D_ASSERT(r.ddp, "ddp_new");
    }
    return r;
}

static void run_free(run *r) {
    ampc_ddp_free(r->ddp);
    ampc_scaler_free(r->sc);
    ampc_optimizer_free(r->opt);
    ampc_module_free(r->net);
}

/* forward + backward of rows [lo, hi) of step's batch, the loss times factor */
static void backward(run *r, mode m, int step, int lo, int hi, double factor, bool poison) {
    ampc_scope_begin();
    ampc_tensor *x, *y;
    batch(step, lo, hi, poison, &x, &y);
    ampc_autocast_enter(m == BF16 ? AMPC_BF16 : AMPC_F16, m != FP32);
    ampc_tensor *loss = ampc_cross_entropy(ampc_module_forward(r->net, x), y, NULL);
    ampc_autocast_exit();
    if (factor != 1) loss = ampc_mul_scalar(loss, factor);
    D_ASSERT(loss, "forward");
    D_ASSERT(ampc_backward(ampc_scaler_scale(r->sc, loss)) == AMPC_OK, "backward");
    ampc_scope_end();
}

static int step(run *r) {
    int applied = ampc_scaler_step(r->sc, r->opt);
    D_ASSERT(applied >= 0, "step");
    D_ASSERT(ampc_scaler_update(r->sc) == AMPC_OK, "update");
    ampc_optimizer_zero_grad(r->opt);
    return applied;
}

static int my_lo(void) { return rank * GLOBAL / world; }
static int my_hi(void) { return (rank + 1) * GLOBAL / world; }

/* All parameters, flattened (caller frees) */
static float *weights(ampc_module *net, int64_t *n) {
    ampc_tensor **p;
    int np = ampc_module_parameters(net, &p, NULL);
    int64_t total = 0;
    for (int i = 0; i < np; i++) total += ampc_tensor_numel(p[i]);
    float *w = malloc(sizeof(float) * (size_t)total), *at = w;
    for (int i = 0; i < np; i++) {
        D_ASSERT(ampc_tensor_to_f32(p[i], at, (size_t)ampc_tensor_numel(p[i])) == AMPC_OK, "weights");
        at += ampc_tensor_numel(p[i]);
    }
    *n = total;
    return w;
}

/* Every rank holds rank 0's weights bit for bit. */
static void assert_replicas_equal(ampc_module *net) {
    int64_t n;
    float *w = weights(net, &n);
    float *w0 = malloc(sizeof(float) * (size_t)n);
    memcpy(w0, w, sizeof(float) * (size_t)n);
    D_ASSERT(ampc_dist_broadcast(w0, sizeof(float) * (size_t)n, 0) == AMPC_OK, "broadcast");
    D_ASSERT(memcmp(w, w0, sizeof(float) * (size_t)n) == 0, "rank %d's weights differ from rank 0's", rank);
    free(w);
    free(w0);
}

/* max |a - b| over max |b - init| (the size of what training changed) */
static double rel_update_diff(ampc_module *a, ampc_module *b, const float *init) {
    int64_t n, m;
    float *wa = weights(a, &n), *wb = weights(b, &m);
    D_ASSERT(n == m, "parameter counts");
    double diff = 0, upd = 0;
    for (int64_t i = 0; i < n; i++) {
        diff = fmax(diff, fabs((double)wa[i] - wb[i]));
        upd = fmax(upd, fabs((double)wb[i] - init[i]));
    }
    free(wa);
    free(wb);
    return diff / upd;
}

/* The scale is the same on every rank. */
static void assert_same_scale(const ampc_scaler *sc) {
    double v[2] = {ampc_scaler_get_scale(sc), -ampc_scaler_get_scale(sc)};
    D_ASSERT(ampc_dist_max_f64(v, 2) == AMPC_OK, "max");
    D_ASSERT(v[0] == -v[1], "the scale differs between ranks (%g .. %g)", -v[1], v[0]);
}

// ---------------------------------------------------------------------------------------------

/* max |a - b| / max |b| over n values */
static double rel_max_diff(const double *a, const double *b, size_t n) {
    double d = 0, m = 0;
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs(a[i] - b[i])), m = fmax(m, fabs(b[i]));
    return m > 0 ? d / m : d;
}

/* STEPS steps of DDP (64/world per rank) against one process on all 64. Bound on the difference,
   relative to the change training made: fp32: the batch's gradient is summed in another order
   (two halves, then their average) - a few ulps of fp32 per gradient, which the steps carry
   linearly: 1e-4 of the update leaves room for 2^-24 x the ~10^2 terms' condition. Under
   autocast the 16-bit roundings of activations can flip where an fp32 sum differed by an ulp:
   one rounding of the 16-bit type (2^-8, 2^-11) in a few elements; bounded by 4u. With one
   rank the runs are the same computation: equal bit for bit. */
static double equivalence_steps(const char *model, mode m, ampc_ddp_options o, int steps, bool replicated) {
    /* the reference of a SyncBatchNorm model: BatchNorm over the whole batch in one process */
    run ref = run_new(strcmp(model, "bn-sync") ? model : "bn", m, NULL), dd = run_new(model, m, &o);
    int64_t n;
    float *init = weights(ref.net, &n);
    for (int s = 0; s < steps; s++) {
        backward(&ref, m, s, 0, GLOBAL, 1, false);
        int a = step(&ref);
        backward(&dd, m, s, replicated ? 0 : my_lo(), replicated ? GLOBAL : my_hi(), 1, false);
        int b = step(&dd);
        D_ASSERT(a == b, "%s %s step %d: applied %d vs %d", model, MODE_NAMES[m], s, a, b);
        assert_same_scale(dd.sc);
    }
    assert_replicas_equal(dd.net);
    double d = rel_update_diff(dd.net, ref.net, init);
    free(init);
    run_free(&ref);
    run_free(&dd);
    return d;
}

static double equivalence(const char *model, mode m, ampc_ddp_options o) { return equivalence_steps(model, m, o, STEPS, false); }

/* The buckets on the parameters' device: the mlp on the REF device (f64 parameters, standing in
   for a GPU: the gradients are scaled into the device's buckets by its own kernel, and the wire,
   f32 or bf16, is a converted copy in host memory) trains as one REF process on the whole batch;
   on a GPU the same on CUDA (f32 parameters: the f32 wire staged through page-locked host memory,
   every rank on the one GPU when there is one). Any world size (ctest also runs 3 ranks): a
   rank's loss is weighted by its share of the batch. The wire rounds each gradient to f32 (2^-24)
   or bf16 (2^-8) once per step, one rank too, bounded as test_equivalence's fp32 and 16-bit
   cases. */
static void test_device_buckets(void **state) {
    (void)state;
    const ampc_dtype wires[] = {AMPC_F32, AMPC_BF16};
    const ampc_device devs[] = {AMPC_DEVICE_REF, AMPC_DEVICE_CUDA};
    for (int d = 0; d < 2; d++) {
        if (devs[d] == AMPC_DEVICE_CUDA && !ampc_device_available(AMPC_DEVICE_CUDA)) {
            if (rank == 0) print_message("device buckets: no GPU here, CUDA skipped\n");
            continue;
        }
        for (int k = 0; k < 2; k++) {
            g_dev = devs[d];
            ampc_ddp_options o = ampc_ddp_defaults();
            o.comm_dtype = wires[k];
            o.bucket_bytes = o.first_bucket_bytes = 4096;   /* two buckets (see test_buckets) */
            run ref = run_new("mlp", FP32, NULL), dd = run_new("mlp", FP32, &o);
            int64_t n;
            float *init = weights(ref.net, &n);
            const double share = (double)(my_hi() - my_lo()) * world / GLOBAL;
            for (int s = 0; s < 2; s++) {
                backward(&ref, FP32, s, 0, GLOBAL, 1, false);
                step(&ref);
                backward(&dd, FP32, s, my_lo(), my_hi(), share, false);
                step(&dd);
            }
            ampc_ddp_stats st;
            D_ASSERT(ampc_ddp_get_stats(dd.ddp, &st) == AMPC_OK && st.buckets > 1, "buckets: %lld", (long long)st.buckets);
            assert_replicas_equal(dd.net);
            double dif = rel_update_diff(dd.net, ref.net, init);
            double tol = wires[k] == AMPC_F32 ? 1e-4 : 4 * tu_eps(AMPC_BF16);
            if (rank == 0)
                print_message("%s device, %d ranks, %s wire: weights differ by %.3g of the update (bound %.3g)\n",
                              ampc_device_name(g_dev), world, ampc_dtype_name(wires[k]), dif, tol);
            D_ASSERT(dif <= tol, "%s %s wire: %.3g > %.3g", ampc_device_name(g_dev), ampc_dtype_name(wires[k]), dif, tol);
            free(init);
            run_free(&ref);
            run_free(&dd);
            g_dev = AMPC_DEVICE_CPU;
        }
    }
}

static void test_equivalence(void **state) {
    (void)state;
    const char *models[] = {"mlp", "cnn"};
    for (int k = 0; k < 2; k++)
        for (int m = FP32; m <= FP16; m++) {
            double d = equivalence(models[k], (mode)m, ampc_ddp_defaults());
            double tol = world == 1 ? 0 : m == FP32 ? 1e-4 : 4 * tu_eps(m == BF16 ? AMPC_BF16 : AMPC_F16);
            if (rank == 0) print_message("%d ranks x %d vs 1 x %d: %s %s: weights differ by %.3g of the update (bound %.3g)\n",
                                         world, GLOBAL / world, GLOBAL, models[k], MODE_NAMES[m], d, tol);
            D_ASSERT(d <= tol, "%s %s: %.3g > %.3g", models[k], MODE_NAMES[m], d, tol);
        }
}

/* A BatchNorm model: with SyncBatchNorm, DDP normalises each layer with the statistics of the
   whole global batch, as one process does. Bounds as above, after STEPS steps in fp32 and bf16
   AMP. In fp16 AMP the first step is within them too (measured 4e-6 of the update), but in this
   model the split batch's rounding differences then grow step by step (1e-4 after two steps,
   6e-3 after four) where bf16 and fp32 stay at 1e-6: the exchange is not the cause, as every
   rank given the whole batch shows - then all three modes train exactly one process's weights,
   bit for bit, for STEPS steps (the statistics of world copies of a batch are the batch's own,
   and every exchanged sum is a sum of equal values). With per-process BatchNorm each rank
   normalises with its own batch's statistics, which trains another model: far outside the
   bound (the comparison can fail). */
static void test_sync_bn_equivalence(void **state) {
    (void)state;
    for (int m = FP32; m <= FP16; m++) {
        double tol = world == 1 ? 0 : m == FP32 ? 1e-4 : 4 * tu_eps(m == BF16 ? AMPC_BF16 : AMPC_F16);
        int k = m == FP16 ? 1 : STEPS;
        double d = equivalence_steps("bn-sync", (mode)m, ampc_ddp_defaults(), k, false);
        double r = equivalence_steps("bn-sync", (mode)m, ampc_ddp_defaults(), STEPS, true);
        if (rank == 0)
            print_message("%d ranks x %d vs 1 x %d: bn %s with SyncBatchNorm: %.3g of the update after %d step%s (bound %.3g); "
                          "whole batch on every rank: %.3g\n",
                          world, GLOBAL / world, GLOBAL, MODE_NAMES[m], d, k, k > 1 ? "s" : "", tol, r);
        D_ASSERT(d <= tol, "bn %s: %.3g > %.3g", MODE_NAMES[m], d, tol);
        D_ASSERT(r == 0, "bn %s, whole batch on every rank: %.3g, not the same weights", MODE_NAMES[m], r);
        if (m != FP32) continue;
        double local = equivalence("bn", (mode)m, ampc_ddp_defaults());
        if (rank == 0) print_message("  (per-process BatchNorm instead: %.3g)\n", local);
        if (world > 1) D_ASSERT(local > 100 * tol, "per-process statistics trained the same model (%.3g)", local);
    }
}

/* One batch norm in training (SyncBatchNorm when sync) forward + backward over rows [lo, hi) of
   a global batch (NB, C, H, W), upstream gradient G: out = y and gx of those rows, then gw, gb,
   running mean and running var (C each). dev REF computes in f64. */
enum { NB = 8, BN_CMAX = 16 };
static size_t bn_case(ampc_device dev, ampc_dtype dt, int64_t C, int hw, bool cl, bool relu, bool sync, int lo, int hi,
                      double *out) {
    const int64_t per = C * hw * hw, sh[4] = {hi - lo, C, hw, hw};
    double *x = malloc(sizeof(double) * NB * (size_t)per), *g = malloc(sizeof(double) * NB * (size_t)per), prm[4 * BN_CMAX];
    tu_fill_uniform(x, (size_t)(NB * per), 5 + (uint64_t)hw, -1, 2);   /* mean 0.5: the centring matters */
    for (int64_t i = 0; i < NB * per; i++) x[i] += 0.25 * (double)(i / per);   /* each sample shifted: ranks' means differ */
    tu_fill_uniform(g, (size_t)(NB * per), 6 + (uint64_t)hw, -1, 1);
    tu_fill_uniform(prm, (size_t)(4 * C), 7, 0.5, 1.5);   /* weight, bias, running mean, running var */
    /* made on the CPU (f32 for REF, then moved and widened) */
    bool ref = dev == AMPC_DEVICE_REF;
    ampc_dtype sdt = ref ? AMPC_F64 : AMPC_F32, adt = ref ? AMPC_F64 : dt, hdt = ref ? AMPC_F32 : dt;
    ampc_scope_begin();
    ampc_tensor *xt = ampc_tensor_to(ampc_tensor_from_f64(hdt, 4, sh, x + lo * per), dev, adt);
    ampc_tensor *gt = ampc_tensor_to(ampc_tensor_from_f64(hdt, 4, sh, g + lo * per), dev, adt);
    ampc_tensor *p[4];
    for (int i = 0; i < 4; i++) p[i] = ampc_tensor_to(ampc_tensor_from_f64(AMPC_F32, 1, &C, prm + i * C), dev, sdt);
    D_ASSERT(xt && gt && p[0] && p[1] && p[2] && p[3], "tensors");
    D_ASSERT(ampc_tensor_set_requires_grad(xt, true) == AMPC_OK && ampc_tensor_set_requires_grad(p[0], true) == AMPC_OK &&
                 ampc_tensor_set_requires_grad(p[1], true) == AMPC_OK,
             "requires_grad");
    ampc_tensor *xin = cl ? ampc_to_memory_format(xt, AMPC_CHANNELS_LAST) : xt;
    ampc_tensor *y = ampc__batch_norm2d_ex(xin, p[0], p[1], p[2], p[3], true, 0.1, 1e-5, relu, sync);
    D_ASSERT(y, "batch_norm");
    D_ASSERT(ampc_backward_with_grad(y, cl ? ampc_to_memory_format(gt, AMPC_CHANNELS_LAST) : gt) == AMPC_OK, "backward");
    size_t n = (size_t)((hi - lo) * per);
    const ampc_tensor *res[6] = {y, ampc_tensor_grad(xt), ampc_tensor_grad(p[0]), ampc_tensor_grad(p[1]), p[2], p[3]};
    size_t at = 0;
    for (int i = 0; i < 6; i++) {
        double *v = tu_values(res[i]);
        size_t k = i < 2 ? n : (size_t)C;
        memcpy(out + at, v, k * sizeof *v);
        at += k;
        free(v);
    }
    ampc_scope_end();
    free(x);
    free(g);
    return at;
}

/* SyncBatchNorm, op by op: each rank's y and gx equal the rows of one batch norm over the whole
   batch (gx is the gradient of the sum of all ranks' losses, as PyTorch's SyncBatchNorm), the
   running statistics equal that batch norm's on every rank, and gw, gb are each rank's own
   share (summed over the ranks: the whole batch's). Every walk of the CPU kernels (a channel's
   runs: H*W >= 32; columns: small H*W; channels-last), with and without the fused ReLU, f32 and
   bf16, and the REF kernels in f64; on a GPU the CUDA kernels (per element, planar and
   channels-last, and the vector kernels: channels-last with C a multiple of 8). Bounds: f64:
   1e-12; f32: 1e-5 of the largest value (sums in another order); 16-bit y and gx: one rounding
   (2 eps relative) where the f32 values before it differ in the last bits; 16-bit statistics as
   f32. Without sync the outputs differ by far more (checked: the comparison can fail). */
static void test_sync_bn_op(void **state) {
    (void)state;
    const struct { ampc_device dev; ampc_dtype dt; int64_t C; int hw; bool cl; } cs[] = {
        {AMPC_DEVICE_CPU, AMPC_F32, 3, 12, false},   {AMPC_DEVICE_CPU, AMPC_F32, 3, 2, false},
        {AMPC_DEVICE_CPU, AMPC_F32, 3, 6, true},     {AMPC_DEVICE_CPU, AMPC_BF16, 3, 12, false},
        {AMPC_DEVICE_CPU, AMPC_BF16, 3, 2, false},   {AMPC_DEVICE_CPU, AMPC_BF16, 3, 6, true},
        {AMPC_DEVICE_CPU, AMPC_F16, 3, 12, false},   {AMPC_DEVICE_CPU, AMPC_F16, 3, 2, false},
        {AMPC_DEVICE_CPU, AMPC_F16, 3, 6, true},     {AMPC_DEVICE_REF, AMPC_F64, 3, 5, false},
        {AMPC_DEVICE_CUDA, AMPC_F32, 3, 12, false},  {AMPC_DEVICE_CUDA, AMPC_F32, 3, 6, true},
        {AMPC_DEVICE_CUDA, AMPC_F32, 8, 6, true},    {AMPC_DEVICE_CUDA, AMPC_BF16, 3, 12, false},
        {AMPC_DEVICE_CUDA, AMPC_BF16, 16, 4, true},  {AMPC_DEVICE_CUDA, AMPC_F16, 8, 6, true},
    };
    int lo = rank * NB / world, hi = (rank + 1) * NB / world;
    bool gpu = ampc_device_available(AMPC_DEVICE_CUDA);
    if (rank == 0 && !gpu) print_message("sync batch_norm: no GPU here, the CUDA cases skipped\n");
    for (size_t k = 0; k < sizeof cs / sizeof cs[0]; k++) {
        if (cs[k].dev == AMPC_DEVICE_CUDA && !gpu) continue;
        const int64_t C = cs[k].C;
        for (int relu = 0; relu < 2; relu++) {
            size_t per = (size_t)(C * cs[k].hw * cs[k].hw), cap = NB * per * 2 + 4 * (size_t)C;
            double *full = malloc(cap * sizeof(double)), *mine = malloc(cap * sizeof(double)), *loc = malloc(cap * sizeof(double));
            bn_case(cs[k].dev, cs[k].dt, C, cs[k].hw, cs[k].cl, relu, false, 0, NB, full);
            size_t nm = bn_case(cs[k].dev, cs[k].dt, C, cs[k].hw, cs[k].cl, relu, true, lo, hi, mine);
            bn_case(cs[k].dev, cs[k].dt, C, cs[k].hw, cs[k].cl, relu, false, lo, hi, loc);
            size_t n = (size_t)(hi - lo) * per, NF = NB * per;
            D_ASSERT(nm == 2 * n + 4 * (size_t)C, "sizes");
            double *fy = full + lo * per, *fgx = full + NF + lo * per, *fst = full + 2 * NF, *st = mine + 2 * n;
            D_ASSERT(ampc_dist_allreduce_sum_f64(st, 2 * C) == AMPC_OK, "allreduce");   /* gw, gb */
            double tol = cs[k].dt == AMPC_F64 ? 1e-12 : 1e-5, tol16 = cs[k].dt == AMPC_BF16 || cs[k].dt == AMPC_F16 ? 2 * tu_eps(cs[k].dt) : tol;
            double dy = rel_max_diff(mine, fy, n), dgx = rel_max_diff(mine + n, fgx, n);
            double dst = rel_max_diff(st, fst, 4 * (size_t)C), dloc = rel_max_diff(loc, fy, n);
            if (rank == 0 && relu)
                print_message("sync batch_norm %s %s C %lld %dx%d%s: y %.2g, gx %.2g, gw/gb/running %.2g (bound %.2g/%.2g); "
                              "per-process y %.2g\n",
                              ampc_device_name(cs[k].dev), ampc_dtype_name(cs[k].dt), (long long)C, cs[k].hw, cs[k].hw,
                              cs[k].cl ? " channels-last" : "", dy, dgx, dst, tol16, tol, dloc);
            D_ASSERT(dy <= tol16 && dgx <= tol16 && dst <= tol, "case %zu relu %d: y %.3g gx %.3g stats %.3g", k, relu, dy, dgx,
                     dst);
            if (world > 1) D_ASSERT(dloc > 10 * tol16, "case %zu: per-process statistics gave the whole batch's", k);
            free(full), free(mine), free(loc);
        }
    }
}

/* a and b hold the same values bit for bit (on any device) */
static bool same_values(const ampc_tensor *a, const ampc_tensor *b) {
    if (ampc_tensor_numel(a) != ampc_tensor_numel(b)) return false;
    double *va = tu_values(a), *vb = tu_values(b);
    bool same = memcmp(va, vb, sizeof(double) * (size_t)ampc_tensor_numel(a)) == 0;
    free(va), free(vb);
    return same;
}

/* Bytes of optimizer state this rank holds. */
static int64_t held_state(const ampc_optimizer *opt) {
    int64_t b = 0;
    for (int s = 0; s < 3; s++)
        for (int i = 0; i < opt->n; i++)
            if (opt->state[s][i]) b += opt->state[s][i]->numel * (int64_t)ampc__dt(opt->state[s][i]->dtype)->size;
    return b;
}

/* ZeRO-1: DDP with the optimizer state sharded reaches the weights of DDP without it bit for
   bit (the same averaged gradients, each element updated by the same kernel arithmetic on the
   rank whose range holds it, then broadcast), for SGD with momentum and Adam, fp32 and fp16 AMP
   with the GradScaler (which skips or steps on all ranks together). The partition is by element,
   so each rank holds 1/world of the state up to the 16-element alignment of the boundaries, the
   cnn's fc1 (96% of the parameters) split between ranks too; ampc_zero_consolidate gathers on
   rank 0 a state equal to the unsharded optimizer's, step counts included; a sharded state is
   neither saved nor loaded into. */
static void zero_case(const char *model, int adam, int m) {
    run a = run_new(model, (mode)m, dflt()), b = run_new(model, (mode)m, dflt());
    if (adam) {
        ampc_optimizer_free(a.opt);
        ampc_optimizer_free(b.opt);
        ampc_adam_options o = ampc_adam_defaults();
        a.opt = ampc_adam_new(a.net, &o);
        b.opt = ampc_adam_new(b.net, &o);
        D_ASSERT(a.opt && b.opt, "adam");
    }
    int64_t here = -1, all = -1;
    D_ASSERT(ampc_zero_shard(b.opt, &here, &all) == AMPC_OK, "zero_shard");
    for (int s = 0; s < STEPS; s++) {
        backward(&a, (mode)m, s, my_lo(), my_hi(), 1, s == 1 && rank == world - 1 && m == FP16);
        backward(&b, (mode)m, s, my_lo(), my_hi(), 1, s == 1 && rank == world - 1 && m == FP16);
        int ra = ampc_scaler_step(a.sc, a.opt), rb = ampc_scaler_step(b.sc, b.opt);
        D_ASSERT(ra >= 0 && ra == rb, "step %d applied %d vs %d", s, ra, rb);
        /* the grads after the step: unscaled on every rank as unsharded, the other ranks' parts included */
        for (int i = 0; i < a.opt->n; i++) {
            const ampc_tensor *ga = a.opt->params[i]->grad, *gb = b.opt->params[i]->grad;
            D_ASSERT(ga && gb && same_values(ga, gb),
                     "%s %s step %d: grad of parameter %d differs after the sharded step", adam ? "adam" : "sgd",
                     MODE_NAMES[m], s, i);
        }
        D_ASSERT(ampc_scaler_update(a.sc) == AMPC_OK && ampc_scaler_update(b.sc) == AMPC_OK, "update");
        ampc_optimizer_zero_grad(a.opt);
        ampc_optimizer_zero_grad(b.opt);
    }
    int64_t n;
    float *wa = weights(a.net, &n), *wb = weights(b.net, &n);
    D_ASSERT(memcmp(wa, wb, sizeof(float) * (size_t)n) == 0, "%s %s: sharded weights differ", adam ? "adam" : "sgd",
             MODE_NAMES[m]);

    assert_replicas_equal(b.net);
    int64_t full = held_state(a.opt), mine = held_state(b.opt), sum = mine;
    double v = (double)mine;
    D_ASSERT(ampc_dist_allreduce_sum_f64(&v, 1) == AMPC_OK, "allreduce");
    sum = (int64_t)v;
    if (rank == 0)
        print_message("zero-1 %s %s %s: weights equal to unsharded DDP; optimizer state %.2f MiB on rank 0, %.2f MiB "
                      "unsharded\n",
                      ampc_device_name(g_dev), adam ? "adam" : "sgd", MODE_NAMES[m], (double)mine / 1048576,
                      (double)full / 1048576);
    D_ASSERT(mine == here && all == full && sum == full, "state bytes %lld (said %lld), all %lld (said %lld, full %lld)",
             (long long)mine, (long long)here, (long long)sum, (long long)all, (long long)full);
    /* by element: 1/world of the state, up to 16 elements of each slot at either boundary */
    const int64_t slack = 2 * 16 * (int64_t)ampc__dt(a.opt->params[0]->dtype)->size * ampc__optimizer_slots_used(a.opt);
    D_ASSERT(llabs(mine - full / world) <= slack, "rank %d holds %lld of %lld (slack %lld)", rank, (long long)mine,
             (long long)full, (long long)slack);
    if (world > 1) {   /* a part is no checkpoint, and a sharded optimizer takes none */
        D_ASSERT(ampc_checkpoint_save("/dev/null", b.net, b.opt, NULL, NULL) == AMPC_ERR_INVALID &&
                     strstr(ampc_last_error(), "ampc_zero_consolidate"),
                 "save of a sharded state: %s", ampc_last_error());
        D_ASSERT(ampc_checkpoint_load("/dev/null", b.net, b.opt, NULL, NULL) == AMPC_ERR_INVALID &&
                     strstr(ampc_last_error(), "before ampc_zero_shard"),
                 "load into a sharded optimizer: %s", ampc_last_error());
    }
    D_ASSERT(ampc_zero_consolidate(b.opt) == AMPC_OK, "consolidate");
    if (rank == 0) {
        D_ASSERT(held_state(b.opt) == full, "consolidated %lld of %lld", (long long)held_state(b.opt), (long long)full);
        for (int i = 0; i < a.opt->n; i++) {
            D_ASSERT(a.opt->steps[i] == b.opt->steps[i], "steps of %d", i);
            for (int k = 0; k < 3; k++) {
                ampc_tensor *x = a.opt->state[k][i], *y = b.opt->state[k][i];
                D_ASSERT(!x == !y, "state %d of %d", k, i);
                if (x)
                    D_ASSERT(same_values(x, y),
                             "consolidated state %d of parameter %d differs", k, i);
            }
        }
    }
    D_ASSERT(ampc_zero_shard(b.opt, NULL, NULL) == AMPC_OK && held_state(b.opt) == mine, "re-shard");
    free(wa), free(wb);
    run_free(&a);
    run_free(&b);
}

/* ...on the CPU (the cnn, SGD and Adam, fp32 and fp16 AMP), on the REF device standing in for
   a GPU (the mlp in fp32: f64 parameters, parts moved by the device's copy kernel), and on a GPU
   where there is one (the mlp in fp32 and fp16 AMP on CUDA) */
static void test_zero(void **state) {
    (void)state;
    for (int adam = 0; adam < 2; adam++)
        for (int m = FP32; m <= FP16; m += FP16 - FP32) zero_case("cnn", adam, m);
    g_dev = AMPC_DEVICE_REF;
    for (int adam = 0; adam < 2; adam++) zero_case("mlp", adam, FP32);
    g_dev = AMPC_DEVICE_CUDA;
    if (ampc_device_available(AMPC_DEVICE_CUDA))
        for (int adam = 0; adam < 2; adam++)
            for (int m = FP32; m <= FP16; m += FP16 - FP32) zero_case("mlp", adam, m);
    else if (rank == 0)
        print_message("zero-1: no GPU here, CUDA skipped\n");
    g_dev = AMPC_DEVICE_CPU;
}

/* Small buckets (many all-reduces, started during backward) give the same bits as one bucket:
   a sum of two ranks' values does not depend on how the elements are grouped. */
static void test_buckets(void **state) {
    (void)state;
    ampc_ddp_options small = ampc_ddp_defaults();
    small.bucket_bytes = small.first_bucket_bytes = 4096;
    run a = run_new("mlp", FP32, &small), b = run_new("mlp", FP32, NULL);
    ampc_ddp_options big = ampc_ddp_defaults();
    big.bucket_bytes = big.first_bucket_bytes = (size_t)1 << 30;
    b.ddp = ampc_ddp_new(b.net, &big);
    D_ASSERT(b.ddp, "ddp_new");
    for (int s = 0; s < STEPS; s++) {
        backward(&a, FP32, s, my_lo(), my_hi(), 1, false);
        step(&a);
        backward(&b, FP32, s, my_lo(), my_hi(), 1, false);
        step(&b);
    }
    ampc_ddp_stats sa, sb;
    D_ASSERT(ampc_ddp_get_stats(a.ddp, &sa) == AMPC_OK && ampc_ddp_get_stats(b.ddp, &sb) == AMPC_OK, "stats");
    /* mlp, last layer first: 10 + 1280 floats pass 4 KiB (1024 floats) and close the first
       bucket, 128 + 100352 the second */
    D_ASSERT(sb.buckets == 1 && sa.buckets == 2, "buckets %lld and %lld", (long long)sa.buckets, (long long)sb.buckets);
    D_ASSERT(sa.allreduces == STEPS * sa.buckets, "%lld all-reduces", (long long)sa.allreduces);
    /* every bucket started as its gradients became final, none left for the end of backward */
    D_ASSERT(sa.started_in_backward == sa.allreduces, "%lld of %lld started in backward", (long long)sa.started_in_backward,
             (long long)sa.allreduces);
    if (world <= 2) {
        int64_t n;
        float *wa = weights(a.net, &n), *wb = weights(b.net, &n);
        D_ASSERT(memcmp(wa, wb, sizeof(float) * (size_t)n) == 0, "bucket sizes changed the result");
        free(wa);
        free(wb);
    }
    run_free(&a);
    run_free(&b);
}

/* Gradient accumulation: two micro-batches per rank, the first inside a no-sync region, each
   loss halved, reach the single-process run on the whole batch (bound as fp32 above). */
static void test_no_sync_accumulation(void **state) {
    (void)state;
    run ref = run_new("mlp", FP32, NULL), dd = run_new("mlp", FP32, dflt());
    int64_t n;
    float *init = weights(ref.net, &n);
    ampc_ddp_stats st;
    for (int s = 0; s < STEPS; s++) {
        backward(&ref, FP32, s, 0, GLOBAL, 1, false);
        step(&ref);
        int lo = my_lo(), hi = my_hi(), mid = (lo + hi) / 2;
        D_ASSERT(ampc_ddp_set_sync(dd.ddp, false) == AMPC_OK, "no_sync");
        backward(&dd, FP32, s, lo, mid, 0.5, false);
        D_ASSERT(ampc_ddp_get_stats(dd.ddp, &st) == AMPC_OK && st.allreduces == s, "no-sync backward communicated");
        D_ASSERT(ampc_ddp_set_sync(dd.ddp, true) == AMPC_OK, "sync");
        backward(&dd, FP32, s, mid, hi, 0.5, false);
        step(&dd);
    }
    assert_replicas_equal(dd.net);
    double d = rel_update_diff(dd.net, ref.net, init);
    if (rank == 0) print_message("no-sync accumulation: differs by %.3g of the update\n", d);
    D_ASSERT(d <= (world == 1 ? 1e-6 : 1e-4), "accumulation: %.3g", d);
    free(init);
    run_free(&ref);
    run_free(&dd);
}

/* Uneven global batches (the epoch's last: n rows split as the loader does, the first n % world
   ranks one more, some ranks none when n < world): each rank weights its mean loss by its share
   (rows * world / n) and a rank without rows joins the all-reduce (ampc_ddp_join) with what it
   accumulated in a no-sync region before, so every step equals one process on the n rows. Steps:
   batches of 64, 37 and 1 rows, then a no-sync half batch (32 rows, loss x 0.5) followed by a
   synchronised batch of 1 row (x 0.5) that only rank 0 has. Bound as test_equivalence's fp32. */
static void test_uneven_join(void **state) {
    (void)state;
    run ref = run_new("mlp", FP32, NULL), dd = run_new("mlp", FP32, dflt());
    int64_t n_w;
    float *init = weights(ref.net, &n_w);
    const int rows[] = {64, 37, 1};
    for (int s = 0; s < 4; s++) {
        const bool accum = s == 3;
        const int n = accum ? 1 : rows[s];
        const int q = n / world, m = n % world, lo = rank * q + (rank < m ? rank : m), hi = lo + q + (rank < m);
        const double share = (double)(hi - lo) * world / n, g = accum ? 0.5 : 1;
        if (accum) {   /* the group's first batch, full and even: no-sync */
            backward(&ref, FP32, s, 0, 32, g, false);
            D_ASSERT(ampc_ddp_set_sync(dd.ddp, false) == AMPC_OK, "no_sync");
            backward(&dd, FP32, s, rank * 32 / world, (rank + 1) * 32 / world, g, false);
            D_ASSERT(ampc_ddp_set_sync(dd.ddp, true) == AMPC_OK, "sync");
        }
        backward(&ref, FP32, s + 10, 0, n, g, false);
        step(&ref);
        if (hi > lo) backward(&dd, FP32, s + 10, lo, hi, g * share, false);
        else D_ASSERT(ampc_ddp_join(dd.ddp) == AMPC_OK, "join");
        step(&dd);
    }
    assert_replicas_equal(dd.net);
    double d = rel_update_diff(dd.net, ref.net, init);
    if (rank == 0) print_message("uneven batches (64, 37, 1, accumulated 32 + 1) on %d ranks: %.3g of the update\n", world, d);
    D_ASSERT(d <= (world == 1 ? 1e-6 : 1e-4), "uneven batches: %.3g", d);
    /* outside a backward only: a join while gradients are being sent is an error */
    D_ASSERT(ampc_ddp_join(NULL) == AMPC_ERR_INVALID, "join(NULL)");
    free(init);
    run_free(&ref);
    run_free(&dd);
}

/* A collective that not every rank joins in time fails with AMPC_ERR_TIMEOUT naming it, instead
   of waiting for ever: rank 0 waits in a barrier that the others reach only after 1.5 s, under a
   0.2 s limit. The others' late barrier completes the one rank 0 gave up on, so a second barrier
   (no limit) leaves every rank in step again. */
static void test_collective_timeout(void **state) {
    (void)state;
    const double was = ampc_dist_get_timeout();
    D_ASSERT(was == AMPC_DIST_DEFAULT_TIMEOUT, "default %g", was);
    D_ASSERT(ampc_dist_set_timeout(-1) == AMPC_ERR_INVALID && ampc_dist_set_timeout(NAN) == AMPC_ERR_INVALID, "bad limits");
    if (world == 1) return;   /* a world of one never waits */
    D_ASSERT(ampc_dist_set_timeout(0.2) == AMPC_OK, "set");
    if (rank == 0) {
        int rc = ampc_dist_barrier();
        D_ASSERT(rc == AMPC_ERR_TIMEOUT, "barrier: %d", rc);
        D_ASSERT(strstr(ampc_last_error(), "barrier on rank 0") && strstr(ampc_last_error(), "time limit of 0.2 s"), "message");
    } else {
        nanosleep(&(struct timespec){1, 500000000}, NULL);
        D_ASSERT(ampc_dist_barrier() == AMPC_OK, "late barrier");
    }
    D_ASSERT(ampc_dist_set_timeout(0) == AMPC_OK, "no limit");
    D_ASSERT(ampc_dist_barrier() == AMPC_OK, "barrier again");
    D_ASSERT(ampc_dist_set_timeout(was) == AMPC_OK, "restore");
}

/* fp16 AMP with a GradScaler: an input that overflows on the last rank only makes every rank
   skip that step and back off, with one scale everywhere at every step: in a synchronised
   step, inside a no-sync accumulation, and in a step taken inside a no-sync region (where no
   gradient was averaged: the scaler's own agreement decides). */
static void test_scaler_agrees(void **state) {
    (void)state;
    run r = run_new("mlp", FP16, dflt());
    bool last = rank == world - 1;
    for (int s = 0; s < 8; s++) {
        float before = ampc_scaler_get_scale(r.sc);
        int kind = s % 4;   /* 0 clean; 1 poisoned; 2 poisoned inside no-sync, then clean; 3 step inside no-sync */
        if (kind == 2 || kind == 3) D_ASSERT(ampc_ddp_set_sync(r.ddp, false) == AMPC_OK, "no_sync");
        backward(&r, FP16, s, my_lo(), my_hi(), 1, kind != 0 && last);
        if (kind == 2) {
            D_ASSERT(ampc_ddp_set_sync(r.ddp, true) == AMPC_OK, "sync");
            backward(&r, FP16, s + 100, my_lo(), my_hi(), 1, false);
        }
        int applied = step(&r);
        if (kind == 3) D_ASSERT(ampc_ddp_set_sync(r.ddp, true) == AMPC_OK, "sync");
        D_ASSERT(applied == (kind == 0), "step %d (case %d): applied %d on rank %d", s, kind, applied, rank);
        if (kind != 0) D_ASSERT(ampc_scaler_get_scale(r.sc) == before / 2, "step %d: no backoff", s);
        assert_same_scale(r.sc);
    }
    D_ASSERT(ampc_scaler_steps_skipped(r.sc) == 6, "%lld skipped", (long long)ampc_scaler_steps_skipped(r.sc));
    assert_replicas_equal(r.net);
    run_free(&r);
}

/* Gradients sent as bf16 or fp16: half the bytes; each gradient rounded once to 16 bits
   before the sum and the sum once after: within 2 u of the f32 wire's update. */
static void test_16bit_wire(void **state) {
    (void)state;
    const ampc_dtype wires[] = {AMPC_BF16, AMPC_F16};
    for (int k = 0; k < 2; k++) {
        ampc_dtype wire = wires[k];
        ampc_ddp_options o = ampc_ddp_defaults();
        o.comm_dtype = wire;
        run ref = run_new("mlp", FP32, dflt()), dd = run_new("mlp", FP32, &o);
        int64_t n;
        float *init = weights(ref.net, &n);
        for (int s = 0; s < STEPS; s++) {
            backward(&ref, FP32, s, my_lo(), my_hi(), 1, false);
            step(&ref);
            backward(&dd, FP32, s, my_lo(), my_hi(), 1, false);
            step(&dd);
        }
        ampc_ddp_stats a, b;
        D_ASSERT(ampc_ddp_get_stats(ref.ddp, &a) == AMPC_OK && ampc_ddp_get_stats(dd.ddp, &b) == AMPC_OK, "stats");
        D_ASSERT(2 * b.bytes_sent == a.bytes_sent, "bytes %lld vs %lld", (long long)b.bytes_sent, (long long)a.bytes_sent);
        assert_replicas_equal(dd.net);
        double d = rel_update_diff(dd.net, ref.net, init), tol = 2 * tu_eps(wire);
        if (rank == 0) print_message("%s wire: differs by %.3g of the update (bound %.3g)\n", ampc_dtype_name(wire), d, tol);
        D_ASSERT(d > 0 && d <= tol, "%s wire: %.3g", ampc_dtype_name(wire), d);
        free(init);
        run_free(&ref);
        run_free(&dd);
    }
}

/* The seam's 16-bit sums: rank r contributes v_r(i); two ranks' sum is round16(f32(a) + f32(b)),
   computed here from the dtype's own conversions (one rank: the values unchanged). */
static void test_allreduce_16bit(void **state) {
    (void)state;
    enum { N = 4099 };   /* not a multiple of the conversion chunk */
    const ampc_dtype dts[] = {AMPC_BF16, AMPC_F16};
    for (int k = 0; k < 2; k++) {
        double v[2][N];
        for (int r = 0; r < 2; r++) tu_fill_uniform(v[r], N, 5 + (uint64_t)r, -100, 100);
        float f[2][N];
        for (int r = 0; r < 2; r++)
            for (int i = 0; i < N; i++) f[r][i] = (float)v[r][i];
        /* each rank's values rounded to the 16-bit dtype through a tensor, and back */
        uint16_t mine[N], other[N];
        ampc_scope_begin();
        for (int r = 0; r < 2; r++) {
            ampc_tensor *t = ampc_tensor_from_f32(dts[k], 1, (int64_t[]){N}, f[r]);
            D_ASSERT(t, "tensor");
            memcpy(r == rank % 2 ? mine : other, ampc_tensor_data(t), sizeof mine);
        }
        uint16_t got[N];
        memcpy(got, mine, sizeof got);
        D_ASSERT(ampc__comm()->allreduce(got, N, dts[k], AMPC_COMM_SUM) == AMPC_OK, "allreduce");
        if (world == 1) {
            D_ASSERT(memcmp(got, mine, sizeof got) == 0, "a world of one changed the values");
        } else if (world == 2) {
            float a[N], b[N];
            ampc_tensor *ta = ampc_tensor_from_f32(dts[k], 1, (int64_t[]){N}, f[0]);
            ampc_tensor *tb = ampc_tensor_from_f32(dts[k], 1, (int64_t[]){N}, f[1]);
            D_ASSERT(ampc_tensor_to_f32(ta, a, N) == AMPC_OK && ampc_tensor_to_f32(tb, b, N) == AMPC_OK, "to_f32");
            for (int i = 0; i < N; i++) a[i] += b[i];
            ampc_tensor *sum = ampc_tensor_from_f32(dts[k], 1, (int64_t[]){N}, a);
            D_ASSERT(memcmp(got, ampc_tensor_data(sum), sizeof got) == 0, "%s sums differ", ampc_dtype_name(dts[k]));
        }
        (void)other;
        ampc_scope_end();
    }
}

/* Buffers: BatchNorm's running statistics follow each rank's own batches (as DDP without
   SyncBatchNorm) until ampc_ddp_sync_buffers copies rank 0's to every rank. */
static void test_sync_buffers(void **state) {
    (void)state;
    ampc_manual_seed(3);
    ampc_module *net = ampc_sequential(2, ampc_conv2d_new(1, 4, 3, NULL, false), ampc_batchnorm2d_new(4));
    D_ASSERT(net, "model");
    ampc_ddp *ddp = ampc_ddp_new(net, NULL);
    D_ASSERT(ddp, "ddp_new");
    ampc_scope_begin();
    ampc_tensor *x, *y;
    batch(0, my_lo(), my_hi(), false, &x, &y);
    D_ASSERT(ampc_module_forward(net, x), "forward");
    ampc_tensor *mean = NULL;
    ampc_tensor **st;
    const char **names;
    int n = ampc_module_state_dict(net, &st, &names);
    for (int i = 0; i < n; i++)
        if (!strcmp(names[i], "1.running_mean")) mean = st[i];
    D_ASSERT(mean, "running_mean");
    float m[4], m0[4];
    D_ASSERT(ampc_tensor_to_f32(mean, m, 4) == AMPC_OK, "to_f32");
    memcpy(m0, m, sizeof m);
    D_ASSERT(ampc_dist_broadcast(m0, sizeof m0, 0) == AMPC_OK, "broadcast");
    if (world > 1 && rank > 0) D_ASSERT(memcmp(m, m0, sizeof m) != 0, "ranks' batches gave the same statistics");
    D_ASSERT(ampc_ddp_sync_buffers(ddp) == AMPC_OK, "sync_buffers");
    D_ASSERT(ampc_tensor_to_f32(mean, m, 4) == AMPC_OK, "to_f32");
    D_ASSERT(memcmp(m, m0, sizeof m) == 0, "rank %d's running_mean is not rank 0's after sync_buffers", rank);
    ampc_scope_end();
    ampc_ddp_free(ddp);
    ampc_module_free(net);
}

/* Wrapping: every rank starts from rank 0's weights; a rank with another architecture makes
   ampc_ddp_new fail on every rank with a message naming it; bad options are refused. */
static void test_wrap(void **state) {
    (void)state;
    ampc_manual_seed(100 + (uint64_t)rank);   /* different initial weights per rank */
    ampc_module *net = ampc_model_new("mlp", NULL);
    ampc_ddp *ddp = ampc_ddp_new(net, NULL);
    D_ASSERT(ddp, "ddp_new");
    assert_replicas_equal(net);
    ampc_ddp_free(ddp);
    ampc_module_free(net);
    if (world > 1) {
        net = ampc_model_new(rank == world - 1 ? "cnn" : "mlp", NULL);
        ddp = ampc_ddp_new(net, NULL);
        D_ASSERT(!ddp && strstr(ampc_last_error(), "differs from rank 0"), "a different model was accepted");
        ampc_clear_error();
        ampc_module_free(net);
    }
    net = ampc_model_new("mlp", NULL);
    ampc_ddp_options o = ampc_ddp_defaults();
    o.comm_dtype = AMPC_F64;
    tu_expect_error(ampc_ddp_new(net, &o), AMPC_ERR_DTYPE, "f32, bf16 or f16");
    o = ampc_ddp_defaults();
    o.bucket_bytes = 0;
    tu_expect_error(ampc_ddp_new(net, &o), AMPC_ERR_INVALID, "bucket sizes");
    tu_expect_error(ampc_ddp_new(NULL, NULL), AMPC_ERR_INVALID, "NULL model");
    ampc_module_free(net);
}

/* The machine-local rank against the launcher's own word for it (Open MPI sets
   OMPI_COMM_WORLD_LOCAL_RANK/_SIZE): alone, 0 of 1 */
static void test_local_rank(void **state) {
    (void)state;
    const int lr = ampc_dist_local_rank(), ls = ampc_dist_local_size();
    assert_in_range(ls, 1, world);
    assert_in_range(lr, 0, ls - 1);
    const char *er = getenv("OMPI_COMM_WORLD_LOCAL_RANK"), *es = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    if (world > 1 && er && es) {
        assert_int_equal(lr, atoi(er));
        assert_int_equal(ls, atoi(es));
    } else if (world == 1) {
        assert_int_equal(lr, 0);
        assert_int_equal(ls, 1);
    }
    double firsts = lr == 0;   /* one local rank 0 per machine: at most one per process, at least one */
    assert_int_equal(ampc_dist_allreduce_sum_f64(&firsts, 1), AMPC_OK);
    assert_in_range((int)firsts, 1, world);
}

int main(int argc, char **argv) {
    if (ampc_dist_launched() && ampc_dist_init(&argc, &argv) < 0) {
        fprintf(stderr, "dist_init: %s\n", ampc_last_error());
        return 1;
    }
    rank = ampc_dist_rank();
    world = ampc_dist_world_size();
    /* TEST_DIST_FILTER: the tests to run (cmocka's pattern); the world-size rule is then theirs */
    const char *filter = getenv("TEST_DIST_FILTER");
    if (filter) cmocka_set_test_filter(filter);
    if (GLOBAL % world && !filter) {
        fprintf(stderr, "test_dist needs a world size dividing %d\n", GLOBAL);
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wrap),          cmocka_unit_test(test_allreduce_16bit), cmocka_unit_test(test_equivalence),
        cmocka_unit_test(test_buckets),       cmocka_unit_test(test_no_sync_accumulation),
        cmocka_unit_test(test_scaler_agrees), cmocka_unit_test(test_16bit_wire),      cmocka_unit_test(test_sync_buffers),
        cmocka_unit_test(test_sync_bn_op),    cmocka_unit_test(test_sync_bn_equivalence), cmocka_unit_test(test_zero),
        cmocka_unit_test(test_uneven_join),   cmocka_unit_test(test_collective_timeout), cmocka_unit_test(test_local_rank),
        cmocka_unit_test(test_device_buckets),
    };
    int failed = cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
    ampc_dist_finalize();
    return failed;
}
