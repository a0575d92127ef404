/*
 * ampc-bench.c - training-step throughput and memory of fixed workloads, fp32 against AMP.
 *
 *     ampc-bench                                  mlp, cnn, resnet18 in fp32, amp-bf16, amp-fp16
 *     ampc-bench --workloads resnet18 --modes fp32,amp-bf16 --steps 20 --json out.json
 *     ampc-bench --resnet50                       adds resnet50 (slow: ~seconds per step)
 *     ampc-bench --peak                           only this machine's fp32/bf16 peak GFLOP/s
 *     ampc-bench --profile                        also a per-kernel time breakdown per config
 *
 * A step is PyTorch's AMP recipe: forward under autocast, cross-entropy, scaled backward,
 * scaler step (SGD, momentum 0.9) and update, zero_grad; the step's tensors live in one scope.
 * fp32 runs with autocast and scaler disabled; amp-bf16 with the scaler disabled (as bf16 is
 * used with PyTorch's CPU autocast: bf16 has fp32's range); amp-fp16 with the scaler enabled.
 * Inputs and labels are random, made once per config from ampc_manual_seed(0), in fp32 (the
 * autocast casts them). After `warmup` untimed steps, `steps` steps are timed one by one: the
 * table shows the median (and min/max).
 *
 * Workloads (fixed: the PyTorch peer, bench/pytorch_peer.py, builds the same ones):
 *   mlp       784 -> 2048 -> 2048 -> 10 (ReLU), batch 256, input (256, 784)
 *   cnn       the zoo's "cnn" (PyTorch's MNIST example net, dropout active), batch 128, 1x28x28
 *   resnet18  the zoo's resnet18, small_input (3x3 stem, no max pool), 10 classes, batch 64, 3x32x32
 *   resnet50  the zoo's resnet50 (7x7 stem, max pool), 1000 classes, batch 16, 3x224x224
 *
 * FLOPs are counted analytically: the multiply-adds of the convolutions and linear layers
 * (nothing for norms, activations, pooling, adds, the loss or the optimizer), 2 FLOPs per MAC
 * for the forward pass and 3x that for a training step (backward = data + weight gradients,
 * each as costly as the forward; the first layer's data gradient, which training skips, is
 * counted too, as is usual). "% peak" divides the achieved rate by the machine's peak for the
 * threads used: the measured one-thread peak times the thread count (the all-thread
 * measurement, printed too, matches it on a quiet machine and drops under other load), of the
 * fp32 FMA for fp32, of the bf16 dot product for amp-bf16, and of the fp32 FMA for amp-fp16
 * (this CPU computes fp16 in f32).
 *
 * Memory: ampc's allocator peaks by kind over the timed steps (ampc_memory_reset_peak before
 * them), and the process's resident-set growth over the warm-up and timed steps (VmHWM after
 * them minus VmRSS before the first step; /proc/self/clear_refs resets the high-water mark).
 * The RSS figure is exact only for the first config of a process (later ones may reuse heap
 * pages an earlier one left to the C library), so it is reported for that one only;
 * bench/pytorch_peer.py --compare runs one config per process.
 */
#include "ampc.h"
#include "ampc/dist.h"
#include "bench_common.h"
#include "size.h"
#include "waitpolicy.h"

#include <dnnl.h>
#ifdef AMPC_HAVE_CUDA
#include <cuda_profiler_api.h>
#endif
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Workloads and modes

typedef struct {
    const char *name;
    int64_t batch;
    int ndim;
    int64_t shape[4];   /* input shape, batch first */
    int64_t classes;
    const char *about;
    ampc_gpt_config gpt;   /* language models: the zoo's gpt; input (batch, block_size) tokens, classes the vocabulary */
} workload;

static const workload WORKLOADS[] = {
    {"mlp", 256, 2, {256, 784}, 10, "784-2048-2048-10 MLP, ReLU", {0}},
    {"cnn", 128, 4, {128, 1, 28, 28}, 10, "zoo cnn (MNIST example net)", {0}},
    {"resnet18", 64, 4, {64, 3, 32, 32}, 10, "zoo resnet18, small_input", {0}},
    {"resnet50", 16, 4, {16, 3, 224, 224}, 1000, "zoo resnet50, 224x224", {0}},
    {"gpt", 16, 2, {16, 256}, 65, "zoo gpt: nanoGPT's shakespeare_char, 6 layers, 6 heads, 384 wide, block 256",
     {.vocab_size = 65, .block_size = 256, .n_layer = 6, .n_head = 6, .n_embd = 384}},
    {"gpt2", 1, 2, {1, 1024}, 50257, "zoo gpt: GPT-2 124M, block 1024",
     {.vocab_size = 50257, .block_size = 1024, .n_layer = 12, .n_head = 12, .n_embd = 768}},
};
enum { N_WORKLOADS = sizeof WORKLOADS / sizeof *WORKLOADS };

typedef struct {
    const char *name;
    bool amp;
    ampc_dtype dtype;
    bool scaler;
} mode;

static const mode MODES[] = {
    {"fp32", false, AMPC_BF16, false},
    {"tf32", false, AMPC_BF16, false},   /* fp32 with TF32 tensor-core matmuls and convolutions (CUDA) */
    {"amp-bf16", true, AMPC_BF16, false},
    {"amp-fp16", true, AMPC_F16, true},
};
enum { N_MODES = sizeof MODES / sizeof *MODES };

static bool g_channels_last = true;   /* --channels-last yes|no */
static ampc_device g_device = AMPC_DEVICE_CPU;   /* --device cpu|cuda */
static int64_t g_batch = 0;                      /* --batch N (0: each workload's own) */

static bool is_lm(const workload *w) { return w->gpt.n_layer > 0; }

static ampc_module *build(const workload *w) {
    if (is_lm(w)) {
        ampc_model_options o = {.gpt = w->gpt};
        return ampc_model_new("gpt", &o);
    }
    if (!strcmp(w->name, "mlp"))
        return ampc_sequential(6, ampc_flatten_new(), ampc_linear_new(784, 2048, true), ampc_relu_new(),
                               ampc_linear_new(2048, 2048, true), ampc_relu_new(), ampc_linear_new(2048, 10, true));
    ampc_model_options o = {.num_classes = w->classes, .in_channels = w->shape[1],
                            .memory_format = g_channels_last ? AMPC_CHANNELS_LAST : AMPC_CONTIGUOUS_FORMAT};
    o.small_input = !strcmp(w->name, "resnet18");
    return ampc_model_new(w->name, &o);
}

// ---------------------------------------------------------------------------------------------
// Analytic FLOP count: multiply-adds of convolutions and linear layers per sample

static int64_t conv_macs(int64_t cin, int64_t cout, int64_t k, int64_t out_hw) { return cin * cout * k * k * out_hw * out_hw; }
static int64_t out_size(int64_t in, int64_t k, int64_t stride, int64_t pad) { return (in + 2 * pad - k) / stride + 1; }

/* torchvision's ResNet (v1.5) on hw x hw inputs; small_input: 3x3 stride-1 stem, no max pool. */
static int64_t resnet_macs(bool bottleneck, const int layers[4], int64_t hw, bool small_input, int64_t classes) {
    int64_t macs, inplanes = 64;
    if (small_input) {
        macs = conv_macs(3, 64, 3, hw);
    } else {
        hw = out_size(hw, 7, 2, 3);
        macs = conv_macs(3, 64, 7, hw);
        hw = out_size(hw, 3, 2, 1);   /* max pool */
    }
    const int expansion = bottleneck ? 4 : 1;
    for (int s = 0; s < 4; s++) {
        const int64_t planes = 64 << s;
        for (int b = 0; b < layers[s]; b++) {
            const int stride = (s > 0 && b == 0) ? 2 : 1;
            const int64_t ohw = out_size(hw, 3, stride, 1);   /* = the 1x1 stride-s size too */
            if (bottleneck) {
                macs += conv_macs(inplanes, planes, 1, hw) + conv_macs(planes, planes, 3, ohw) +
                        conv_macs(planes, planes * 4, 1, ohw);
            } else {
                macs += conv_macs(inplanes, planes, 3, ohw) + conv_macs(planes, planes, 3, ohw);
            }
            if (stride != 1 || inplanes != planes * expansion) macs += conv_macs(inplanes, planes * expansion, 1, ohw);
            inplanes = planes * expansion;
            hw = ohw;
        }
    }
    return macs + inplanes * classes;   /* fc; the average pool is not counted */
}

static int64_t forward_macs_per_sample(const workload *w) {
    static const int r18[4] = {2, 2, 2, 2}, r50[4] = {3, 4, 6, 3};
    if (is_lm(w)) {   /* per token: every weight of a matmul once (the blocks' 12 C^2 each, the head V C), and
                         attention's q k^T and weights @ v over T positions each (PaLM's count: no causal discount) */
        const int64_t L = w->gpt.n_layer, C = w->gpt.n_embd, T = w->gpt.block_size;
        return T * (12 * L * C * C + w->gpt.vocab_size * C + 2 * L * T * C);
    }
    if (!strcmp(w->name, "mlp")) return 784 * 2048 + 2048 * 2048 + 2048 * 10;
    if (!strcmp(w->name, "cnn"))   /* conv 1->32 3x3 (26x26), conv 32->64 3x3 (24x24), fc 9216->128, fc 128->10 */
        return conv_macs(1, 32, 3, 26) + conv_macs(32, 64, 3, 24) + 9216 * 128 + 128 * 10;
    if (!strcmp(w->name, "resnet18")) return resnet_macs(false, r18, w->shape[2], true, w->classes);
    return resnet_macs(true, r50, w->shape[2], false, w->classes);
}

static double step_flops(const workload *w) { return 3.0 * 2.0 * (double)forward_macs_per_sample(w) * (double)w->batch; }

// ---------------------------------------------------------------------------------------------
// Process memory (Linux /proc)

static long proc_status_kib(const char *field) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long v = -1;
    size_t n = strlen(field);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, field, n) && line[n] == ':') {
            v = strtol(line + n + 1, NULL, 10);
            break;
        }
    fclose(f);
    return v;
}

/* Resets VmHWM to the current RSS (Linux >= 4.0); false if not possible. */
static bool reset_hwm(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return false;
    bool ok = fputs("5", f) >= 0;
    return fclose(f) == 0 && ok;
}

static void loadavg(char *buf, size_t n) {
    FILE *f = fopen("/proc/loadavg", "r");
    buf[0] = 0;
    if (f) {
        if (!fgets(buf, (int)n, f)) buf[0] = 0;
        fclose(f);
    }
    char *sp = buf;   /* keep the three averages */
    for (int i = 0; i < 3 && sp; i++) sp = strchr(sp + 1, ' ');
    if (sp) *sp = 0;
    if (!buf[0]) snprintf(buf, n, "?");
}

// ---------------------------------------------------------------------------------------------
// One config: workload x mode

typedef struct {
    const workload *w;
    const mode *m;
    bool ok;
    char error[256];
    int steps;
    double *ms;   /* steps timings */
    double median_ms, min_ms, max_ms;
    double samples_s, gflops, pct_peak;   /* pct_peak < 0: no peak */
    ampc_memory_stats_t mem;              /* peaks over the timed steps */
    size_t act_resident;                  /* activation bytes in use before a step: the input batch */
    double mallocs_per_step;              /* new system blocks during timed steps */
    long rss_growth_kib;                  /* -1: unknown */
    double final_loss;
    int world;                            /* processes (under mpirun: DDP, samples_s is the job's) */
    double exposed_ms, copy_ms;           /* DDP per timed step: backward's wait for collectives, bucket copies */
    int64_t skipped;                      /* timed steps the scaler skipped (inf/NaN grads) */
    float scale;
} result;

typedef struct {
    int steps, warmup;
    bool profile;
    bench_peak peak;
    bool have_peak;
} settings;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One training step; returns the loss value (NaN on error, with r->error set). */
static double train_step(ampc_module *net, ampc_optimizer *opt, ampc_scaler *scaler, const mode *m, ampc_tensor *x,
                         ampc_tensor *y, result *r) {
    double loss_value = NAN;
    ampc_scope_begin();
    ampc_autocast_enter(m->dtype, m->amp);
    ampc_tensor *out = ampc_module_forward(net, x);
    if (out && ampc_tensor_ndim(out) == 3)   /* a language model: every position's next-token loss */
        out = ampc_reshape(out, 2, (int64_t[]){ampc_tensor_dim(out, 0) * ampc_tensor_dim(out, 1), ampc_tensor_dim(out, 2)});
    if (ampc_tensor_ndim(y) == 2) y = ampc_reshape(y, 1, (int64_t[]){ampc_tensor_numel(y)});
    ampc_tensor *loss = ampc_cross_entropy(out, y, NULL);
    ampc_autocast_exit();
    const char *what = "forward";
    if (loss) {
        what = "backward";
        if (ampc_backward(ampc_scaler_scale(scaler, loss)) >= 0) {
            what = "scaler step";
            if (ampc_scaler_step(scaler, opt) >= 0) {
                what = "scaler update";
                if (ampc_scaler_update(scaler) >= 0) {
                    ampc_optimizer_zero_grad(opt);
                    loss_value = ampc_tensor_item(loss);
                    what = NULL;
                }
            }
        }
    }
    if (what) snprintf(r->error, sizeof r->error, "%s failed: %s", what, ampc_last_error());
    ampc_scope_end();
    return what ? NAN : loss_value;
}

/* Peak activation bytes above what was resident when the timed steps began (the input batch). */
static size_t step_activations(const result *r) {
    size_t pk = r->mem.peak[AMPC_MEM_ACTIVATIONS];
    return pk > r->act_resident ? pk - r->act_resident : 0;
}

static bool g_quiet;   /* --largest-batch's probes: a failed config says nothing */

static void run_workload(const workload *w, const mode *m, const settings *s, result *r);

static void run_config(const workload *w0, const mode *m, const settings *s, result *r) {
    static workload ws[N_WORKLOADS * 4];   /* a workload with --batch applied lives as long as its result */
    static int nws;
    const workload *w = w0;
    if (g_batch > 0 && nws < (int)(sizeof ws / sizeof *ws)) {
        ws[nws] = *w0;
        ws[nws].batch = ws[nws].shape[0] = g_batch;
        w = &ws[nws++];
    }
    run_workload(w, m, s, r);
}

/* One config as given (w's batch); r->w points at w. */
static void run_workload(const workload *w, const mode *m, const settings *s, result *r) {
    memset(r, 0, sizeof *r);
    ampc_set_allow_tf32(!strcmp(m->name, "tf32"));
    r->w = w;
    r->m = m;
    r->steps = s->steps;
    r->rss_growth_kib = -1;
    r->pct_peak = -1;
    r->ms = calloc((size_t)s->steps, sizeof *r->ms);
    if (!r->ms) {
        snprintf(r->error, sizeof r->error, "out of memory");
        return;
    }

    ampc_manual_seed(0);
    ampc_module *net = build(w);
    if (net && g_device != AMPC_DEVICE_CPU && ampc_module_to(net, g_device) < 0) {
        snprintf(r->error, sizeof r->error, "moving the model: %s", ampc_last_error());
        ampc_module_free(net);
        net = NULL;
    }
    /* under mpirun: data-parallel (each rank its own batch of w->batch, gradients averaged) */
    r->world = ampc_dist_world_size();
    ampc_ddp *ddp = net && r->world > 1 ? ampc_ddp_new(net, NULL) : NULL;
    if (net && r->world > 1 && !ddp) {
        snprintf(r->error, sizeof r->error, "data-parallel model: %s", ampc_last_error());
        ampc_module_free(net);
        net = NULL;
    }
    /* SGD with momentum; a GPT nanoGPT's AdamW (lr 6e-4, betas 0.9/0.95, decay 0.1 on the Linear weights) */
    ampc_adam_options ao = ampc_adamw_defaults();
    ao.lr = 6e-4, ao.beta2 = 0.95, ao.weight_decay = 0.1;
    ampc_optimizer *opt = !net ? NULL : is_lm(w) ? ampc_adamw_new(net, &ao) : ampc_sgd_new(net, &(ampc_sgd_options){.lr = 0.01, .momentum = 0.9});
    if (opt && is_lm(w) && ampc_optimizer_decay_only_weights(opt, net) < 0) {
        ampc_optimizer_free(opt);
        opt = NULL;
    }
    ampc_scaler_options so = ampc_scaler_defaults();
    so.enabled = m->scaler;
    ampc_scaler *scaler = opt ? ampc_scaler_new(&so) : NULL;
    /* fixed random data: inputs N(0, 1), labels uniform in [0, classes); a language model's
       inputs and targets tokens uniform in [0, vocabulary) */
    ampc_tensor *x = NULL, *u = NULL, *y = NULL;
    if (scaler && is_lm(w)) {
        const int64_t n = w->shape[0] * w->shape[1];
        int64_t *tok = malloc((size_t)(2 * n) * sizeof *tok);
        uint64_t state = 88172645463325252ull;
        for (int64_t i = 0; tok && i < 2 * n; i++) {
            state ^= state << 13, state ^= state >> 7, state ^= state << 17;
            tok[i] = (int64_t)(state % (uint64_t)w->classes);
        }
        x = tok ? ampc_tensor_own(ampc_tensor_from_i64(2, w->shape, tok)) : NULL;
        y = x ? ampc_tensor_own(ampc_tensor_from_i64(2, w->shape, tok + n)) : NULL;
        free(tok);
    } else if (scaler) {
        x = ampc_tensor_own(ampc_tensor_randn(AMPC_F32, w->ndim, w->shape, 0, 1));
        u = x ? ampc_tensor_own(ampc_tensor_rand(AMPC_F32, 1, &w->batch, 0, (double)w->classes)) : NULL;
    }
    if (u) {
        float uf[4096];
        int64_t labels[4096];
        if (w->batch <= 4096 && ampc_tensor_to_f32(u, uf, 4096) >= 0) {
            for (int64_t i = 0; i < w->batch; i++) {
                int64_t l = (int64_t)floorf(uf[i]);
                labels[i] = l < w->classes ? l : w->classes - 1;
            }
            y = ampc_tensor_own(ampc_tensor_from_i64(1, &w->batch, labels));
        }
    }
    if (y && g_device != AMPC_DEVICE_CPU) {   /* the batch lives on the device, as after a loader's copy */
        ampc_tensor *xd = ampc_tensor_own(ampc_tensor_to(x, g_device, ampc_tensor_dtype(x)));
        ampc_tensor *yd = xd ? ampc_tensor_own(ampc_tensor_to(y, g_device, AMPC_I64)) : NULL;
        ampc_tensor_free(x);
        ampc_tensor_free(y);
        x = xd;
        y = yd;
    }
    if (!y) {
        snprintf(r->error, sizeof r->error, "setting up: %s", ampc_last_error());
        goto done;
    }
    /* tests only (tests/bench_json.sh): the config fails with this text, quotes, backslashes,
       newlines and all, to show that an error reaches the JSON as it is */
    const char *injected = getenv("AMPC_BENCH_FAIL");
    if (injected) {
        snprintf(r->error, sizeof r->error, "%s", injected);
        goto done;
    }

    long rss0 = proc_status_kib("VmRSS");
    bool hwm = rss0 >= 0 && reset_hwm();
    for (int i = 0; i < s->warmup; i++)
        if (isnan(train_step(net, opt, scaler, m, x, y, r)) && r->error[0]) goto done;
    ampc_memory_reset_peak();
    ampc_memory_stats_t st0 = ampc_memory_stats();
    r->act_resident = st0.current[AMPC_MEM_ACTIVATIONS];
    const int64_t skipped0 = ampc_scaler_steps_skipped(scaler);
    ampc_ddp_stats d0 = {0}, d1 = {0};
    if (ddp) ampc_ddp_get_stats(ddp, &d0);
    /* AMPC_BENCH_CUDA_PROFILE_STEP=1: the first timed step between cudaProfilerStart and Stop,
       so that `ncu --profile-from-start off` times that step's kernels alone (scripts/gpu/run.sh
       profile); the step ends with the loss read back, so its kernels are done at Stop */
#ifdef AMPC_HAVE_CUDA
    bool cuda_profile = g_device == AMPC_DEVICE_CUDA && getenv("AMPC_BENCH_CUDA_PROFILE_STEP");
#endif
    for (int i = 0; i < s->steps; i++) {
#ifdef AMPC_HAVE_CUDA
        if (cuda_profile && i == 0) cudaProfilerStart();
#endif
        double t0 = bench_now();
        r->final_loss = train_step(net, opt, scaler, m, x, y, r);
        r->ms[i] = (bench_now() - t0) * 1e3;
#ifdef AMPC_HAVE_CUDA
        if (cuda_profile && i == 0) cudaProfilerStop();
#endif
        if (r->error[0]) goto done;
    }
    if (ddp) {
        ampc_ddp_get_stats(ddp, &d1);
        r->exposed_ms = (d1.exposed_seconds - d0.exposed_seconds) * 1e3 / s->steps;
        r->copy_ms = (d1.copy_seconds - d0.copy_seconds) * 1e3 / s->steps;
    }
    r->mem = ampc_memory_stats();
    r->mallocs_per_step = (double)(r->mem.n_malloc - st0.n_malloc) / s->steps;
    long hwm1 = proc_status_kib("VmHWM");
    if (hwm && hwm1 >= 0) r->rss_growth_kib = hwm1 - rss0;

    double *sorted = malloc((size_t)s->steps * sizeof *sorted);
    if (!sorted) goto done;
    memcpy(sorted, r->ms, (size_t)s->steps * sizeof *sorted);
    qsort(sorted, (size_t)s->steps, sizeof *sorted, cmp_double);
    int n = s->steps;
    r->median_ms = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
    r->min_ms = sorted[0];
    r->max_ms = sorted[n - 1];
    free(sorted);
    r->samples_s = (double)(w->batch * r->world) / (r->median_ms * 1e-3);
    r->gflops = step_flops(w) / (r->median_ms * 1e-3) * 1e-9;
    r->skipped = ampc_scaler_steps_skipped(scaler) - skipped0;
    r->scale = ampc_scaler_get_scale(scaler);
    r->ok = true;

    if (s->profile) {
        /* separate steps, so the timers never touch the figures above */
        bench_profile_install();
        bench_profile_reset();
        double t0 = bench_now();
        for (int i = 0; i < s->steps; i++)
            if (isnan(train_step(net, opt, scaler, m, x, y, r)) && r->error[0]) break;
        double t = bench_now() - t0;
        bench_profile_uninstall();
        printf("\nprofile: %s %s, %d steps (%.1f GFLOP counted by the kernels vs %.1f analytic per step)\n", w->name,
               m->name, s->steps, bench_profile_flops() / s->steps * 1e-9, step_flops(w) * 1e-9);
        bench_profile_print(stdout, s->steps, t);
        r->error[0] = 0;
    }

done:
    if (!r->ok && !g_quiet) fprintf(stderr, "ampc-bench: %s %s: %s\n", w->name, m->name, r->error);
    ampc_tensor_free(x);
    ampc_tensor_free(u);
    ampc_tensor_free(y);
    ampc_scaler_free(scaler);
    ampc_optimizer_free(opt);
    ampc_ddp_free(ddp);
    ampc_module_free(net);
    ampc_memory_empty_cache();   /* the next config starts from an empty cache */
}

// ---------------------------------------------------------------------------------------------
// Output

/* % of the peak for r's mode: per-core peak x threads. On a quiet machine the all-thread
   measurement gives the same (488 vs 2 x 243 GFLOP/s here); on a busy one it shows what the
   other processes leave, not the machine. */
/* The GPU's matmul rate per mode, measured with ampc's own matmul (cuBLASLt) on n x n x n
   products of random values: the ceiling "%peak" divides by on CUDA. */
static double g_gpu_peak[N_MODES];

static double gpu_matmul_gflops(ampc_dtype dt, bool tf32, int64_t n) {
    ampc_set_allow_tf32(tf32);
    ampc_device prev = ampc_default_device();
    ampc_set_default_device(g_device);
    ampc_no_grad_enter();
    int64_t shape[2] = {n, n};
    ampc_tensor *a = ampc_tensor_own(ampc_tensor_randn(dt, 2, shape, 0, 1));
    ampc_tensor *b = a ? ampc_tensor_own(ampc_tensor_randn(dt, 2, shape, 0, 1)) : NULL;
    double best = -1;
    for (int rep = 0; b && rep < 3; rep++) {   /* the best of three runs of 10 products after a warm-up */
        ampc_scope_begin();                    /* each run's products are freed at its end */
        bool ok = ampc_matmul(a, b) && ampc_device_synchronize(g_device) >= 0;
        double t0 = bench_now();
        for (int k = 0; ok && k < 10; k++) ok = ampc_matmul(a, b) != NULL;
        ok = ok && ampc_device_synchronize(g_device) >= 0;
        double g = 10 * 2.0 * (double)n * (double)n * (double)n / (bench_now() - t0) * 1e-9;
        if (ok && g > best) best = g;
        ampc_scope_end();
        if (!ok) break;
    }
    ampc_tensor_free(a);
    ampc_tensor_free(b);
    ampc_no_grad_exit();
    ampc_set_default_device(prev);
    ampc_set_allow_tf32(false);
    return best;
}

static void set_pct_peak(result *r, const settings *s) {
    if (g_device != AMPC_DEVICE_CPU) {
        double peak = g_gpu_peak[r->m - MODES];
        r->pct_peak = peak > 0 && r->ok ? 100 * r->gflops / peak : -1;
        return;
    }
    double peak = s->peak.threads * (r->m->amp && r->m->dtype == AMPC_BF16 ? bench_peak_bf16_1t(&s->peak) : s->peak.fp32_1t);
    r->pct_peak = s->have_peak && peak > 0 && r->ok ? 100 * r->gflops / peak : -1;
}

static double mib(size_t b) { return (double)b / (1024.0 * 1024.0); }

/* The fp32 result of the same workload, if it ran. */
static const result *fp32_of(const result *rs, int n, const result *r) {
    for (int i = 0; i < n; i++)
        if (rs[i].ok && rs[i].w == r->w && !rs[i].m->amp) return &rs[i];
    return NULL;
}

static void print_tables(const result *rs, int n) {
    printf("\nms per training step (median of the timed steps, min, max); GFLOP per step counted analytically;\n"
           "%%peak against the machine's peak for the mode; speedup = fp32 time / this mode's time\n");
    printf("%-9s %-9s %5s %8s %9s %9s %9s %10s %8s %7s %8s\n", "workload", "mode", "batch", "GFLOP", "ms/step",
           "min", "max", "samples/s", "GFLOP/s", "%peak", "speedup");
    for (int i = 0; i < n; i++) {
        const result *r = &rs[i];
        if (!r->ok) {
            printf("%-9s %-9s failed: %s\n", r->w->name, r->m->name, r->error);
            continue;
        }
        const result *base = fp32_of(rs, n, r);
        printf("%-9s %-9s %5lld %8.1f %9.2f %9.2f %9.2f %10.1f %8.1f", r->w->name, r->m->name, (long long)r->w->batch,
               step_flops(r->w) * 1e-9, r->median_ms, r->min_ms, r->max_ms, r->samples_s, r->gflops);
        if (r->pct_peak >= 0) printf(" %6.1f%%", r->pct_peak);
        else printf(" %7s", "-");
        if (base && r->m->amp) printf(" %7.2fx", base->median_ms / r->median_ms);
        else printf(" %8s", "-");
        if (r->skipped) printf("  (%lld of %d timed steps skipped by the scaler)", (long long)r->skipped, r->steps);
        printf("\n");
    }
    printf("\npeak memory over the timed steps, MiB: the allocator's peak in use by kind and in all (each kind's own\n"
           "peak: they need not coincide); casts = autocast's 16-bit weight copies; activ = activations the step\n"
           "creates (peak minus the input batch resident before it); reserved = in use + cached blocks after the\n"
           "steps, RSS = the process's resident-set growth (first config only); ratios to fp32; new system blocks\n"
           "per timed step\n");
    printf("%-9s %-9s %8s %8s %8s %8s %8s %8s %8s %8s %8s %9s %9s %8s\n", "workload", "mode", "params", "grads", "optim",
           "casts", "activ", "wkspace", "total", "reserved", "RSS", "total/32", "activ/32", "malloc/s");
    for (int i = 0; i < n; i++) {
        const result *r = &rs[i];
        if (!r->ok) continue;
        const result *base = fp32_of(rs, n, r);
        const size_t *pk = r->mem.peak;
        printf("%-9s %-9s %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f", r->w->name, r->m->name,
               mib(pk[AMPC_MEM_PARAMETERS]), mib(pk[AMPC_MEM_GRADIENTS]), mib(pk[AMPC_MEM_OPTIMIZER]),
               mib(pk[AMPC_MEM_CASTS]), mib(step_activations(r)),
               mib(pk[AMPC_MEM_WORKSPACE]), mib(r->mem.peak_total), mib(r->mem.current_total + r->mem.cached));
        if (r->rss_growth_kib >= 0) printf(" %8.1f", (double)r->rss_growth_kib / 1024.0);
        else printf(" %8s", "-");
        if (base && r->m->amp)
            printf(" %9.2f %9.2f", (double)r->mem.peak_total / (double)base->mem.peak_total,
                   (double)step_activations(r) / (double)step_activations(base));
        else printf(" %9s %9s", "-", "-");
        printf(" %8.1f\n", r->mallocs_per_step);
    }
}

// ---------------------------------------------------------------------------------------------
// JSON (jansson): strings escaped by the library, non-finite numbers as null (JSON has none)

/* A number, or null for NaN/inf (json_real refuses them). New reference. */
static json_t *jnum(double v) { return isfinite(v) ? json_real(v) : json_null(); }

/* A string; bytes that are not UTF-8 (jansson refuses them) become '?'. New reference. */
static json_t *jstr(const char *s) {
    json_t *j = json_string(s);
    if (j) return j;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *c = buf; *c; c++)
        if ((unsigned char)*c >= 0x80) *c = '?';
    return json_string(buf);
}

static json_t *json_peak(const bench_peak *p, bool have) {
    if (!have) return json_null();
    return json_pack("{s:i, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o}", "threads", p->threads, "fp32_gflops_1t",
                     jnum(p->fp32_1t), "fp32_gflops_all", jnum(p->fp32_all), "bf16_gflops_1t", jnum(p->bf16_1t),
                     "bf16_gflops_all", jnum(p->bf16_all), "amx_bf16_gflops_1t", jnum(p->amx_1t), "amx_bf16_gflops_all",
                     jnum(p->amx_all), "fp32_gflops_peak", jnum(p->threads * p->fp32_1t), "bf16_gflops_peak",
                     jnum(p->threads * bench_peak_bf16_1t(p)), "message", jstr(p->message));
}

/* One config's object: the failed ones carry their error instead of figures. New reference or NULL. */
static json_t *json_result(const result *r) {
    json_t *o = json_pack("{s:o, s:o, s:I, s:b}", "workload", jstr(r->w->name), "mode", jstr(r->m->name), "batch",
                          (json_int_t)r->w->batch, "ok", r->ok);
    if (!o || !r->ok) {
        if (o && json_object_set_new(o, "error", jstr(r->error)) < 0) json_decref(o), o = NULL;
        return o;
    }
    json_t *mem = json_object(), *ms = json_array();
    for (int k = 0; mem && k < AMPC_MEM_KIND_COUNT; k++)
        if (json_object_set_new(mem, ampc_mem_kind_name((ampc_mem_kind)k), json_integer((json_int_t)r->mem.peak[k])) < 0)
            json_decref(mem), mem = NULL;
    if (mem && json_object_set_new(mem, "total", json_integer((json_int_t)r->mem.peak_total)) < 0) json_decref(mem), mem = NULL;
    for (int k = 0; ms && k < r->steps; k++)
        if (json_array_append_new(ms, jnum(r->ms[k])) < 0) json_decref(ms), ms = NULL;
    json_t *more = json_pack(
        "{s:o, s:o, s:o, s:o, s:o, s:o, s:i, s:o, s:o}", "gflop_per_step", jnum(step_flops(r->w) * 1e-9), "ms_median",
        jnum(r->median_ms), "ms_min", jnum(r->min_ms), "ms_max", jnum(r->max_ms), "samples_per_s", jnum(r->samples_s),
        "gflops", jnum(r->gflops), "world", r->world, "ddp_exposed_ms", jnum(r->exposed_ms), "ddp_copy_ms", jnum(r->copy_ms));
    /* pct_peak only where there is a peak, as before; the keys in their old order */
    if (more && r->pct_peak >= 0 && json_object_set_new(more, "pct_peak", jnum(r->pct_peak)) < 0) json_decref(more), more = NULL;
    json_t *rest = json_pack(
        "{s:o, s:I, s:I, s:I, s:o, s:o, s:o, s:I, s:o}", "mem_peak_bytes", mem, "activations_step_bytes",
        (json_int_t)step_activations(r), "reserved_bytes", (json_int_t)(r->mem.current_total + r->mem.cached),
        "rss_growth_bytes", (json_int_t)(r->rss_growth_kib >= 0 ? r->rss_growth_kib * 1024 : -1), "mallocs_per_step",
        jnum(r->mallocs_per_step), "final_loss", jnum(r->final_loss), "scaler_scale", jnum((double)r->scale),
        "steps_skipped", (json_int_t)r->skipped, "ms_steps", ms);
    if (!more || !rest || json_object_update(o, more) < 0 || json_object_update(o, rest) < 0) json_decref(o), o = NULL;
    json_decref(more);
    json_decref(rest);
    return o;
}

/* Writes the results as JSON, indented; 0, or -1 with a message on stderr. */
static int write_json(const char *path, const result *rs, int n, const settings *s, const char *wait_policy,
                      const char *load0, const char *load1) {
    const dnnl_version_t *dv = dnnl_version();
    const char *omp_nt = getenv("OMP_NUM_THREADS");
    char onednn[48];
    snprintf(onednn, sizeof onednn, "%d.%d.%d", dv->major, dv->minor, dv->patch);
    json_t *results = json_array();
    for (int i = 0; results && i < n; i++)
        if (json_array_append_new(results, json_result(&rs[i])) < 0) json_decref(results), results = NULL;
    json_t *doc = json_pack(
        "{s:s, s:{s:o, s:i, s:o, s:o, s:s, s:o, s:o}, s:{s:i, s:i, s:s, s:s, s:b}, s:o, s:o}", "tool", "ampc-bench",
        "machine", "cpu_features", jstr(ampc_cpu_features()), "threads", ampc_get_num_threads(), "omp_wait_policy",
        jstr(wait_policy), "omp_num_threads_env", jstr(omp_nt ? omp_nt : "unset"), "onednn", onednn, "loadavg_start",
        jstr(load0), "loadavg_end", jstr(load1), "settings", "steps", s->steps, "warmup", s->warmup, "optimizer",
        "sgd lr 0.01 momentum 0.9", "conv_memory_format", g_channels_last ? "channels_last" : "contiguous",
        "keep_weight_casts", ampc_autocast_keeps_weight_casts(), "peak", json_peak(&s->peak, s->have_peak), "results",
        results);
    /* 10 significant digits: more than the figures' precision, without binary noise (0.1, not 0.10000000000000001) */
    int rc = doc ? json_dump_file(doc, path, JSON_INDENT(2) | JSON_REAL_PRECISION(10)) : -1;
    if (rc < 0) fprintf(stderr, "ampc-bench: cannot write %s%s\n", path, doc ? "" : " (building the JSON failed)");
    json_decref(doc);
    return rc < 0 ? -1 : 0;
}

static void print_peak(const bench_peak *p) {
    if (p->message[0]) printf("peak: %s\n", p->message);
    if (p->have_fp32)
        printf("peak fp32 (vfmadd231ps): %8.1f GFLOP/s on 1 thread, %8.1f measured on %d threads (%%peak uses %.1f)\n",
               p->fp32_1t, p->fp32_all, p->threads, p->threads * p->fp32_1t);
    if (p->have_bf16)
        printf("peak bf16 (vdpbf16ps):   %8.1f GFLOP/s on 1 thread, %8.1f measured on %d threads%s\n", p->bf16_1t,
               p->bf16_all, p->threads, p->have_amx ? "" : " (%peak uses their 1-thread x threads)");
    if (p->have_amx)
        printf("peak bf16 (AMX tdpbf16ps): %8.1f GFLOP/s on 1 thread, %8.1f measured on %d threads (bf16 %%peak uses %.1f)\n",
               p->amx_1t, p->amx_all, p->threads, p->threads * bench_peak_bf16_1t(p));
}

// ---------------------------------------------------------------------------------------------
// --largest-batch: the seed's memory claim, the largest batch whose training step fits the
// --max-memory budget, per mode (AMP should take about twice fp32's)

/* Whether a step of w at batch b trains under the budget (one warm-up step and one timed). */
static bool fits(const workload *w0, const mode *m, int64_t b, size_t *peak) {
    workload w = *w0;
    w.batch = w.shape[0] = b;
    settings s = {.steps = 1, .warmup = 1};
    result r;
    g_quiet = true;
    run_workload(&w, m, &s, &r);
    g_quiet = false;
    bool ok = r.ok;
    if (ok && peak) *peak = r.mem.peak_total;
    if (!ok && !strstr(r.error, "out of memory") && !strstr(r.error, "memory budget"))
        fprintf(stderr, "ampc-bench: %s %s batch %lld failed other than by memory: %s\n", w0->name, m->name, (long long)b, r.error);
    free(r.ms);
    return ok;
}

/* Doubling from 1, then bisection: the largest batch that fits (0: not even 1; at most 2^20).
   Every success raises lo and a failure leaves *peak alone, so *peak ends as lo's. */
static int64_t largest_batch(const workload *w, const mode *m, size_t *peak) {
    int64_t lo = 0, hi = 1;
    while (hi <= ((int64_t)1 << 20) && fits(w, m, hi, peak)) lo = hi, hi *= 2;
    if (hi > ((int64_t)1 << 20)) return lo;
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        if (fits(w, m, mid, peak)) lo = mid;
        else hi = mid;
    }
    return lo;
}

static int run_largest(const bool *wl_on, const bool *mode_on, size_t limit) {
    printf("largest batch whose training step (SGD momentum, cross-entropy) fits --max-memory %.1f MiB on %s:\n",
           mib(limit), ampc_device_name(g_device));
    printf("%-9s %-9s %9s %9s %12s\n", "workload", "mode", "batch", "x fp32", "peak MiB");
    int failed = 0;
    for (int wi = 0; wi < N_WORKLOADS; wi++) {
        int64_t base = 0;
        for (int mi = 0; mi < N_MODES; mi++) {
            if (!wl_on[wi] || !mode_on[mi]) continue;
            size_t peak = 0;
            int64_t b = largest_batch(&WORKLOADS[wi], &MODES[mi], &peak);
            if (!strcmp(MODES[mi].name, "fp32")) base = b;
            printf("%-9s %-9s %9lld", WORKLOADS[wi].name, MODES[mi].name, (long long)b);
            if (base > 0 && b > 0) printf(" %8.2fx", (double)b / (double)base);
            else printf(" %9s", "-");
            printf(" %12.1f\n", mib(peak));
            fflush(stdout);
            failed += b == 0;
        }
    }
    return failed ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------
// Command line

static void usage(FILE *f) {
    fprintf(f,
            "usage: ampc-bench [options]\n"
            "  --workloads a,b   of mlp, cnn, resnet18, resnet50, gpt (nanoGPT 6x384, block 256),\n"
            "                    gpt2 (GPT-2 124M, block 1024) (default mlp,cnn,resnet18)\n"
            "  --resnet50        add resnet50 to the workloads (slow)\n"
            "  --modes a,b       of fp32, tf32, amp-bf16, amp-fp16 (default fp32 and the AMP modes;\n"
            "                    tf32: fp32 with TF32 tensor cores, CUDA only)\n"
            "  --device NAME     cpu (default) or cuda: where the model and the batch live\n"
            "  --batch N         samples per step for every workload (default: each one's own)\n"
            "  --steps N         timed steps per config (default 10); the median is reported\n"
            "  --warmup N        untimed steps first (default 3)\n"
            "  --threads N       OpenMP threads (default: OMP_NUM_THREADS or all cores)\n"
            "  --peak            measure only the machine's fp32/bf16 peak GFLOP/s and exit\n"
            "  --activations     time each activation's forward and backward on (4096, 1536), f32 and\n"
            "                    bf16 (best of --steps calls), and exit\n"
            "  --no-peak         skip the peak measurement (no %%peak column)\n"
            "  --profile         after each config, time each kernel over extra steps\n"
            "  --json FILE       write the results as JSON (default: none)\n"
            "  --max-memory SIZE memory budget (512M, 2G, ...: powers of 1024): an allocation past it\n"
            "                    fails as out of memory (a device of that size emulated)\n"
            "  --largest-batch   with --max-memory: the largest batch whose step fits, per\n"
            "                    workload and mode, and each mode's against fp32's\n"
            "  --channels-last yes|no  cnn/ResNet activations channels-last (default yes)\n"
            "  --cudnn-benchmark yes|no  CUDA: cuDNN's convolution algorithms timed on each shape's first\n"
            "                    call (PyTorch's cudnn.benchmark; deterministic ones only; default no)\n"
            "  --winograd yes|no CPU: fp32 3x3 stride-1 convolutions with small weights on oneDNN's\n"
            "                    Winograd kernels (ampc_set_conv_winograd; default yes)\n"
            "  --doctor yes|no         the numerics doctor on: every op's output checked for NaN/inf\n"
            "                          (its cost; default no)\n"
            "  --keep-casts yes|no     autocast's weight copies kept across steps and rewritten by\n"
            "                    the optimizer's pass (default yes; no: recast in every step)\n"
            "  --help            this text\n"
            "  --version         ampc's and oneDNN's versions\n");
}

/* Parses a comma list against names[]; sets on[i]. Returns -1 on an unknown name. */
static int parse_list(const char *arg, const char *const *names, int n, bool *on) {
    memset(on, 0, (size_t)n * sizeof *on);
    char buf[256];
    snprintf(buf, sizeof buf, "%s", arg);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int k = 0;
        while (k < n && strcmp(names[k], tok)) k++;
        if (k == n) {
            fprintf(stderr, "ampc-bench: unknown name '%s' (known:", tok);
            for (int i = 0; i < n; i++) fprintf(stderr, " %s", names[i]);
            fprintf(stderr, ")\n");
            return -1;
        }
        on[k] = true;
    }
    return 0;
}

static int parse_int(const char *flag, const char *v, int lo, int *out) {
    char *end;
    long x = strtol(v, &end, 10);
    if (*end || x < lo || x > 1000000) {
        fprintf(stderr, "ampc-bench: %s takes an integer >= %d, not '%s'\n", flag, lo, v);
        return -1;
    }
    *out = (int)x;
    return 0;
}

static int parse_yes_no(const char *flag, const char *v, bool *out) {
    if (strcmp(v, "yes") && strcmp(v, "no")) {
        fprintf(stderr, "ampc-bench: %s takes yes or no, not '%s'\n", flag, v);
        return -1;
    }
    *out = !strcmp(v, "yes");
    return 0;
}

/* --activations: each elementwise activation forward and backward on a (4096, 1536) tensor (the
   gpt workload's MLP, batch 16 x block 256 rows of 4 x 384), f32 and bf16, best of `steps`
   calls, ms; the elementwise passes between a model's gemms */
static int run_activations(int steps) {
    ampc_tensor *(*fn[6])(ampc_tensor *) = {ampc_relu, ampc_gelu, ampc_gelu_tanh, ampc_silu, ampc_sigmoid, ampc_tanh};
    const char *name[6] = {"relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"};
    const ampc_dtype dts[2] = {AMPC_F32, AMPC_BF16};
    const int64_t shape[2] = {4096, 1536};
    printf("activations on (4096, 1536), best of %d calls, ms (%s):\n%-10s %10s %10s %10s %10s\n", steps,
           ampc_device_name(g_device), "op", "f32 fwd", "f32 bwd", "bf16 fwd", "bf16 bwd");
    for (int k = 0; k < 6; k++) {
        double best[2][2] = {{1e30, 1e30}, {1e30, 1e30}};
        for (int d = 0; d < 2; d++)
            for (int r = 0; r < steps; r++) {
                ampc_scope_begin();
                ampc_tensor *x = ampc_tensor_rand(dts[d], 2, shape, -4, 4), *g = ampc_tensor_rand(dts[d], 2, shape, -1, 1);
                if (x && g && g_device != AMPC_DEVICE_CPU) {   /* made on the CPU, moved where the ops run */
                    x = ampc_tensor_to(x, g_device, dts[d]);
                    g = x ? ampc_tensor_to(g, g_device, dts[d]) : NULL;
                }
                if (!x || !g || ampc_tensor_set_requires_grad(x, true) < 0) {
                    fprintf(stderr, "ampc-bench: --activations: %s\n", ampc_last_error());
                    return 1;
                }
                ampc_device_synchronize(g_device);
                double t0 = bench_now();
                ampc_tensor *y = fn[k](x);
                ampc_device_synchronize(g_device);
                double t1 = bench_now();
                int rc = y ? ampc_backward_with_grad(y, g) : -1;
                ampc_device_synchronize(g_device);
                double t2 = bench_now();
                ampc_scope_end();
                if (rc < 0) {
                    fprintf(stderr, "ampc-bench: --activations: %s: %s\n", name[k], ampc_last_error());
                    return 1;
                }
                best[d][0] = t1 - t0 < best[d][0] ? t1 - t0 : best[d][0];
                best[d][1] = t2 - t1 < best[d][1] ? t2 - t1 : best[d][1];
            }
        printf("%-10s %10.2f %10.2f %10.2f %10.2f\n", name[k], best[0][0] * 1e3, best[0][1] * 1e3, best[1][0] * 1e3, best[1][1] * 1e3);
    }
    return 0;
}

int main(int argc, char **argv) {
    ampc_tool_wait_policy(argv);
    bool wl_on[N_WORKLOADS] = {true, true, true, false}, mode_on[N_MODES] = {true, false, true, true};
    const char *wl_names[N_WORKLOADS], *mode_names[N_MODES];
    for (int i = 0; i < N_WORKLOADS; i++) wl_names[i] = WORKLOADS[i].name;
    for (int i = 0; i < N_MODES; i++) mode_names[i] = MODES[i].name;
    settings s = {.steps = 10, .warmup = 3};
    int threads = 0;
    bool peak_only = false, no_peak = false, largest = false, activations = false;
    size_t max_memory = 0;
    const char *json = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool takes = !strcmp(a, "--workloads") || !strcmp(a, "--modes") || !strcmp(a, "--steps") ||
                     !strcmp(a, "--warmup") || !strcmp(a, "--threads") || !strcmp(a, "--json") ||
                     !strcmp(a, "--channels-last") || !strcmp(a, "--keep-casts") || !strcmp(a, "--device") ||
                     !strcmp(a, "--batch") || !strcmp(a, "--doctor") || !strcmp(a, "--max-memory") ||
                     !strcmp(a, "--cudnn-benchmark") || !strcmp(a, "--winograd");
        if (takes && !v) {
            fprintf(stderr, "ampc-bench: %s needs a value\n", a);
            return 2;
        }
        int rc = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--version")) {
            const dnnl_version_t *dv = dnnl_version();
            printf("ampc-bench (ampc) %s, oneDNN %d.%d.%d\nLicence: MIT (see LICENSE)\n", ampc_version(), dv->major, dv->minor, dv->patch);
            return 0;
        } else if (!strcmp(a, "--workloads")) rc = parse_list(v, wl_names, N_WORKLOADS, wl_on);
        else if (!strcmp(a, "--resnet50")) wl_on[3] = true;
        else if (!strcmp(a, "--modes")) rc = parse_list(v, mode_names, N_MODES, mode_on);
        else if (!strcmp(a, "--steps")) rc = parse_int(a, v, 1, &s.steps);
        else if (!strcmp(a, "--warmup")) rc = parse_int(a, v, 0, &s.warmup);
        else if (!strcmp(a, "--threads")) rc = parse_int(a, v, 1, &threads);
        else if (!strcmp(a, "--device")) {
            g_device = ampc_device_from_name(v);
            if (g_device == AMPC_DEVICE_COUNT || g_device == AMPC_DEVICE_REF) {
                fprintf(stderr, "ampc-bench: --device takes cpu or cuda, not '%s'\n", v);
                rc = -1;
            }
        } else if (!strcmp(a, "--batch")) {
            int b = 0;
            rc = parse_int(a, v, 1, &b);
            g_batch = b;
        }
        else if (!strcmp(a, "--json")) json = v;
        else if (!strcmp(a, "--channels-last")) rc = parse_yes_no(a, v, &g_channels_last);
        else if (!strcmp(a, "--keep-casts")) {
            bool on = true;
            rc = parse_yes_no(a, v, &on);
            ampc_autocast_keep_weight_casts(on);
        }
        else if (!strcmp(a, "--cudnn-benchmark")) {   /* cuDNN's algorithms timed per shape (cudnn.benchmark) */
            bool on = false;
            rc = parse_yes_no(a, v, &on);
            ampc_set_cudnn_benchmark(on);
        }
        else if (!strcmp(a, "--winograd")) {   /* oneDNN's Winograd kernels for small fp32 3x3 convolutions */
            bool on = true;
            rc = parse_yes_no(a, v, &on);
            ampc_set_conv_winograd(on);
        }
        else if (!strcmp(a, "--doctor")) {   /* the numerics doctor watching every op's output */
            bool on = false;
            rc = parse_yes_no(a, v, &on);
            ampc_doctor_enable(on);
        }
        else if (!strcmp(a, "--max-memory")) {
            double bytes = 0;
            if (!tool_parse_size(v, &bytes) || bytes < 1) {
                fprintf(stderr, "ampc-bench: --max-memory takes a size such as 512M or 2G, not '%s'\n", v);
                rc = -1;
            } else {
                max_memory = (size_t)bytes;
            }
        }
        else if (!strcmp(a, "--largest-batch")) largest = true;
        else if (!strcmp(a, "--peak")) peak_only = true;
        else if (!strcmp(a, "--activations")) activations = true;
        else if (!strcmp(a, "--no-peak")) no_peak = true;
        else if (!strcmp(a, "--profile")) s.profile = true;
        else {
            fprintf(stderr, "ampc-bench: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
        if (rc < 0) return 2;
        if (takes) i++;
    }

    if (threads > 0) ampc_set_num_threads(threads);
    /* under mpirun: one rank of a data-parallel job; rank 0 alone prints and writes the JSON */
    if (ampc_dist_launched() && ampc_dist_init(&argc, &argv) < 0) {
        fprintf(stderr, "ampc-bench: MPI: %s\n", ampc_last_error());
        return 1;
    }
    if (ampc_dist_rank() > 0) {
        if (!freopen("/dev/null", "w", stdout)) return 1;
        json = NULL;
    }
    if (ampc_init() < 0) {
        fprintf(stderr, "ampc-bench: init failed: %s\n", ampc_last_error());
        return 1;
    }
    const char *wait_policy = ampc_tool_wait_policy_desc();
    char load0[64], load1[64];
    loadavg(load0, sizeof load0);
    printf("ampc-bench: %d threads, wait policy %s, cpu: %s, oneDNN %d.%d.%d, conv nets %s%s, load average %s\n",
           ampc_get_num_threads(), wait_policy, ampc_cpu_features(), dnnl_version()->major, dnnl_version()->minor,
           dnnl_version()->patch, g_channels_last ? "channels-last" : "contiguous (NCHW)",
           ampc_conv_winograd() ? "" : ", Winograd off", load0);

    if (g_device != AMPC_DEVICE_CPU) {
        if (!ampc_device_available(g_device)) {
            fprintf(stderr, "ampc-bench: --device %s: %s\n", ampc_device_name(g_device), ampc_device_unavailable_reason(g_device));
            return 1;
        }
        no_peak = true;   /* the CPU's peak means nothing here: the GPU's matmul rates instead */
        for (int i = 0; i < N_MODES; i++) {
            bool tf32 = !strcmp(MODES[i].name, "tf32");
            ampc_dtype dt = MODES[i].amp ? MODES[i].dtype : AMPC_F32;
            g_gpu_peak[i] = gpu_matmul_gflops(dt, tf32, 8192);
            printf("%s matmul peak: %.1f TFLOP/s (ampc_matmul, 8192^3, random values, best of 3 x 10)\n", MODES[i].name,
                   g_gpu_peak[i] * 1e-3);
        }
    }
    if (!no_peak || peak_only) {
        bench_peak_measure(&s.peak, ampc_get_num_threads(), peak_only ? 0.2 : 0.1);
        s.have_peak = s.peak.have_fp32;
        print_peak(&s.peak);
    }
    if (peak_only) {
        loadavg(load1, sizeof load1);
        return json && write_json(json, NULL, 0, &s, wait_policy, load0, load1) < 0 ? 1 : 0;
    }
    if (activations) {
        int arc = run_activations(s.steps);
        ampc_shutdown();
        return arc;
    }
    if (max_memory) ampc_memory_set_limit(max_memory);
    if (largest) {
        int lrc = max_memory ? run_largest(wl_on, mode_on, max_memory) : 2;
        if (!max_memory) fprintf(stderr, "ampc-bench: --largest-batch needs --max-memory SIZE (the budget to fit)\n");
        ampc_dist_finalize();
        ampc_shutdown();
        return lrc;
    }
    printf("steps: %d timed after %d warm-up; SGD lr 0.01 momentum 0.9; cross-entropy; fp16 with GradScaler\n",
           s.steps, s.warmup);

    result rs[N_WORKLOADS * N_MODES];
    int n = 0, failed = 0;
    for (int wi = 0; wi < N_WORKLOADS; wi++)
        for (int mi = 0; mi < N_MODES; mi++) {
            if (!wl_on[wi] || !mode_on[mi]) continue;
            fflush(stdout);
            run_config(&WORKLOADS[wi], &MODES[mi], &s, &rs[n]);
            if (n > 0) rs[n].rss_growth_kib = -1;   /* exact only for a process's first config */
            failed += !rs[n].ok;
            if (rs[n].ok && !s.profile)
                fprintf(stderr, "  %-9s %-9s %9.2f ms/step\n", rs[n].w->name, rs[n].m->name, rs[n].median_ms);
            if (rs[n].ok && rs[n].world > 1)
                printf("ddp %s %s: %d processes x batch %" PRId64 ": %.1f samples/s (the job's), step %.2f ms, communication "
                       "not hidden behind backward %.2f ms (%.1f%%), bucket copies %.2f ms\n",
                       rs[n].w->name, rs[n].m->name, rs[n].world, rs[n].w->batch, rs[n].samples_s, rs[n].median_ms,
                       rs[n].exposed_ms, 100 * rs[n].exposed_ms / rs[n].median_ms, rs[n].copy_ms);
            n++;
        }
    if (s.have_peak) {
        /* again at the end, keeping the larger figures: a process that shared a core during
           one of the two measurements lowers only that one */
        bench_peak again;
        bench_peak_measure(&again, s.peak.threads, 0.1);
        s.peak.fp32_1t = fmax(s.peak.fp32_1t, again.fp32_1t), s.peak.fp32_all = fmax(s.peak.fp32_all, again.fp32_all);
        s.peak.bf16_1t = fmax(s.peak.bf16_1t, again.bf16_1t), s.peak.bf16_all = fmax(s.peak.bf16_all, again.bf16_all);
        s.peak.amx_1t = fmax(s.peak.amx_1t, again.amx_1t), s.peak.amx_all = fmax(s.peak.amx_all, again.amx_all);
        printf("\npeak measured again at the end; the larger figures are kept:\n");
        print_peak(&s.peak);
    }
    for (int i = 0; i < n; i++) set_pct_peak(&rs[i], &s);
    print_tables(rs, n);
    loadavg(load1, sizeof load1);
    printf("load average at the end: %s\n", load1);
    int rc = failed ? 1 : 0;
    if (json && write_json(json, rs, n, &s, wait_policy, load0, load1) < 0) rc = 1;
    for (int i = 0; i < n; i++) free(rs[i].ms);
    ampc_dist_finalize();
    ampc_shutdown();
    return rc;
}
