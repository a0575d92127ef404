/*
 * setup.c - a run built from its settings: the "auto" values resolved for this CPU, data and
 * optimizer (--amp-dtype, --grad-scaler, --lr, --weight-decay, --threads), then the data, the
 * model (checked against the images before any training), the optimizer, the grad scaler and the
 * loaders; and the setup printed before the first epoch. --amp-dtype fastest times the model's
 * training step in each precision before the grad scaler is made.
 */
#include "train.h"
#include "progress.h"
#include "waitpolicy.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>

void run_free(run *r) {
    ampc_ddp_free(r->m.ddp);
    ampc_loader_free(r->d.train_ld);
    ampc_loader_free(r->d.val_ld);
    ampc_metrics_close(r->out.metrics);
    steplog_close(r);
    tensorboard_close(r);
    ampc_scaler_free(r->m.scaler);
    ampc_optimizer_free(r->m.opt);
    ampc_module_free(r->m.net);
    data_free(&r->d);
    free(r->out.hist.rows);
    free(r->out.dir);
    if (r->out.lock) fclose(r->out.lock);   /* and the lock with it */
    free(r->out.ckpt_path);
    free(r->out.model_path);
    free(r->out.diverged_path);
    ampc_checkpoint_meta_free(r->resume.meta);
    free(r->tally.logits_buf);
    free(r->tally.confusion);
    memset(r, 0, sizeof *r);
}

/* The classifier head's parameter names start with this: what --freeze backbone trains and
   --pretrained-strict head lets differ (a head for another number of classes). */
static const char *head_prefix(const char *model) {
    return strncmp(model, "resnet", 6) == 0 ? "fc." : strcmp(model, "cnn") == 0 ? "fc2." : "3.";
}

/* The report's "missing: NAME ..." and "mismatched: NAME: ..." lines outside the classifier head,
   joined into names ("; "): the backbone tensors that kept their new values. Returns how many;
   *stem: conv1.weight is one of them. */
static int backbone_misses(const char *model, const char *report, char *names, size_t cap, bool *stem) {
    const char *head = head_prefix(model);
    size_t at = 0;
    int n = 0;
    names[0] = '\0';
    *stem = false;
    for (const char *line = report; line && *line;) {
        const char *eol = strchr(line, '\n'), *name = NULL;
        size_t len = eol ? (size_t)(eol - line) : strlen(line);
        if (strncmp(line, "missing: ", 9) == 0) name = line + 9;
        else if (strncmp(line, "mismatched: ", 12) == 0) name = line + 12;
        if (name && strncmp(name, head, strlen(head)) != 0) {
            *stem |= strncmp(name, "conv1.weight", 12) == 0 && strchr(": ", name[12]);
            appendf(names, cap, &at, "%s%.*s", n++ ? "; " : "", (int)(len - (size_t)(name - line)), name);
        }
        line = eol ? eol + 1 : NULL;
    }
    return n;
}

/* --pretrained: the weights of a state_dict file, strictly (yes), all but the head (head: a
   backbone tensor that does not load is an error, since a frozen backbone of random weights
   learns nothing), or what matches (no: such tensors are named in a warning); the report is
   kept for the setup lines (each missing, unexpected or mismatched name on stdout, rank 0's). */
static int load_pretrained(run *r) {
    const char *path = sval(r->s, OPT_PRETRAINED), *strict = sval(r->s, OPT_PRETRAINED_STRICT), *model = sval(r->s, OPT_MODEL);
    char *text = NULL, names[1024];
    size_t n = 0;
    FILE *rep = open_memstream(&text, &n);
    if (!rep) return fail("out of memory");
    ampc_load_report lr;
    int rc = ampc_load_state_dict(path, r->m.net, strcmp(strict, "yes") == 0, rep, &lr);
    fclose(rep);
    bool stem = false;
    const int misses = rc < 0 ? 0 : backbone_misses(model, text, names, sizeof names, &stem);
    const char *stem_why = stem ? " (conv1 is the stem: it takes the images' channels, and its kernel is the file's)" : "";
    if (rc < 0) rc = fail_lib("--pretrained");
    else if (misses && strcmp(strict, "head") == 0)
        rc = fail("--pretrained '%s': %d backbone tensor(s) do not load: %s%s; --pretrained-strict head lets only the head %s* differ, "
                  "no keeps them new",
                  path, misses, names, stem_why, head_prefix(model));
    if (text && *text) fprintf(rc < 0 ? stderr : stdout, "%s", text);
    free(text);
    if (rc < 0) return rc;
    if (lr.loaded == 0)   /* not strict, nothing matched: training from scratch is not what was asked */
        return fail("--pretrained '%s': none of its tensors matched the model's (%d missing, %d unexpected, %d of another shape): "
                    "a file for another --model than %s?", path, lr.missing, lr.unexpected, lr.mismatched, model);
    if (misses) warn("--pretrained-strict no: %d backbone tensor(s) keep new values: %s%s", misses, names, stem_why);
    snprintf(r->m.pretrained_note, sizeof r->m.pretrained_note, "%s: %d tensors loaded, %d missing, %d unexpected, %d of another shape (kept new)",
             path, lr.loaded, lr.missing, lr.unexpected, lr.mismatched);
    return 0;
}

/* --pretrained into a ResNet: the stem the file was trained with, from its conv1.weight (7x7:
   torchvision's, stride 2 with max-pool, which PyTorch's tutorial keeps at 64 px; 3x3: the small
   one), so that every backbone tensor fits; otherwise the stem the image size asks for. */
static int choose_stem(run *r, const char *model, bool *small) {
    *small = r->d.h <= 64 && r->d.w <= 64;
    const char *why = *small ? "images of 64 px or less" : "images over 64 px";
    char shape[64] = "";
    if (*sval(r->s, OPT_PRETRAINED) && !*sval(r->s, OPT_RESUME)) {
        ampc_checkpoint_tensor *t = NULL;
        int n = ampc_checkpoint_list(sval(r->s, OPT_PRETRAINED), &t);
        if (n < 0) return fail_lib("--pretrained");
        for (int i = 0; i < n; i++) {
            const int64_t *d = t[i].shape;
            if (strcmp(t[i].name, "conv1.weight") != 0 || t[i].ndim != 4 || d[2] != d[3] || (d[2] != 7 && d[2] != 3)) continue;
            *small = d[2] == 3;
            snprintf(shape, sizeof shape, "[%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "]", d[0], d[1], d[2], d[3]);
            why = "the --pretrained file's conv1.weight";
        }
        free(t);
    }
    snprintf(r->m.stem_note, sizeof r->m.stem_note, "%s: %s, as %s%s%s", model,
             *small ? "3x3 stride 1, no max-pool (the small-input stem)" : "7x7 stride 2 with max-pool (torchvision's)", why,
             *shape ? " " : "", shape);
    return 0;
}

/* --freeze backbone: requires_grad off for every parameter but the classifier head's (the setup
   lines count total and trainable parameters, as the seed prints them). */
static int freeze(run *r, const char *model) {
    const char *head = head_prefix(model);
    if (strcmp(sval(r->s, OPT_FREEZE), "backbone") != 0) return 0;
    ampc_tensor **p;
    const char **names;
    int n = ampc_module_parameters(r->m.net, &p, &names);
    if (n < 0) return fail_lib("--freeze");
    for (int i = 0; i < n; i++)
        if (strncmp(names[i], head, strlen(head)) != 0 && ampc_tensor_set_requires_grad(p[i], false) < 0) return fail_lib("--freeze");
    return 0;
}

void print_setup(run *r) {
    print_config(r->s, r->d.desc, r->m.use_amp);
    printf("  %-14s %s, %d threads, wait policy %s\n", "cpu", ampc_cpu_features(), ampc_get_num_threads(),
           ampc_tool_wait_policy_desc());
    if (r->world > 1)
        printf("  %-14s %d processes (MPI), batch %" PRId64 " each: global batch %" PRId64 "\n", "world", r->world,
               ival(r->s, OPT_BATCH_SIZE), r->world * ival(r->s, OPT_BATCH_SIZE));
    if (ival(r->s, OPT_ACCUMULATE) > 1)
        printf("  %-14s %" PRId64 " batches per optimizer step: %" PRId64 " samples a step\n", "accumulate", ival(r->s, OPT_ACCUMULATE),
               ival(r->s, OPT_ACCUMULATE) * ival(r->s, OPT_BATCH_SIZE) * r->world);
    if (r->m.zero_all > 0) {
        char b1[32], b2[32];
        printf("  %-14s optimizer state shared out by element over %d processes: %s on rank 0 of %s\n", "zero", r->world,
               fmt_bytes((double)r->m.zero_here, b1, sizeof b1), fmt_bytes((double)r->m.zero_all, b2, sizeof b2));
    }
    if (r->m.scheduled) {
        printf("  %-14s %s", "lr schedule", r->m.sched.kind == AMPC_LR_STEP ? "step" : r->m.sched.kind == AMPC_LR_COSINE ? "cosine" : "constant");
        if (r->m.sched.kind == AMPC_LR_STEP) printf(": x %g every %" PRId64 " steps", r->m.sched.gamma, r->m.sched.step_size);
        if (r->m.sched.kind == AMPC_LR_COSINE) printf(" to 0 over %" PRId64 " steps", r->m.sched.t_max);
        if (r->m.sched.warmup_steps) printf(", after a linear warm-up over %" PRId64 " steps from a third", r->m.sched.warmup_steps);
        printf(" (by applied optimizer steps)\n");
    }
    if (r->m.stem_note[0]) printf("  %-14s %s\n", "stem", r->m.stem_note);
    if (r->m.pretrained_note[0]) printf("  %-14s %s\n", "weights", r->m.pretrained_note);
    if (r->m.sync_bn > 0)
        printf("  %-14s %d BatchNorm layers with the statistics of all %d processes' batches\n", "sync-bn", r->m.sync_bn, r->world);
    int64_t ntr = ampc_dataset_size(r->d.train), nva = ampc_dataset_size(r->d.val);
    char c1[32], c2[32], c3[32], c4[32];
    printf("data: %s training samples", fmt_count(ntr, c1, sizeof c1));
    if (ntr != r->d.full_train) printf(" (first of %s)", fmt_count(r->d.full_train, c3, sizeof c3));
    printf(", %s validation samples (%s", fmt_count(nva, c2, sizeof c2), r->d.val_name);
    if (nva != r->d.full_val) printf(", first of %s", fmt_count(r->d.full_val, c4, sizeof c4));
    if (r->d.block)
        printf("); windows of %" PRId64 " + 1 tokens, vocabulary %" PRId64 "; unigram baseline: validation loss %.4f\n", r->d.block,
               r->d.num_classes, r->d.unigram);
    else
        printf("); %" PRId64 " classes, %" PRId64 "x%" PRId64 "x%" PRId64 " images\n", r->d.num_classes, r->d.c, r->d.h, r->d.w);
    printf("%s total parameters.\n", fmt_count(ampc_module_num_parameters(r->m.net, false), c1, sizeof c1));
    printf("%s trainable parameters.\n", fmt_count(ampc_module_num_parameters(r->m.net, true), c1, sizeof c1));
    fflush(stdout);
}

int zero_batch(run *r, int64_t b, ampc_tensor **x, ampc_tensor **y) {
    *x = r->d.block ? ampc_tensor_zeros(AMPC_I64, 2, (int64_t[]){b, r->d.block}) : ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){b, r->d.c, r->d.h, r->d.w});
    *y = *x ? (r->d.block ? ampc_tensor_zeros(AMPC_I64, 2, (int64_t[]){b, r->d.block}) : ampc_tensor_zeros(AMPC_I64, 1, &b)) : NULL;
    return *y ? 0 : -1;
}

/* The images fit the model: one forward pass of a batch of one before any training, in eval mode,
   without autograd and in fp32 (no random draws, no weight casts: the run is unchanged). */
static int check_model_input(run *r) {
    ampc_scope_begin();
    ampc_no_grad_enter();
    ampc_module_train(r->m.net, false);
    ampc_tensor *x, *t;
    ampc_tensor *y = zero_batch(r, 1, &x, &t) == 0 ? ampc_module_forward(r->m.net, x) : NULL;
    int rc = 0;
    const int want_nd = r->d.block ? 3 : 2;
    if (!y)
        rc = ampc_last_status() == AMPC_ERR_OOM
                 ? fail_lib("building the model")
                 : fail("--model %s does not take the data's %" PRId64 "x%" PRId64 "x%" PRId64 " %s: %s", sval(r->s, OPT_MODEL),
                        r->d.c, r->d.h, r->d.w, r->d.block ? "token windows" : "images", ampc_last_error());
    else if (ampc_tensor_ndim(y) != want_nd || ampc_tensor_dim(y, 0) != 1 || ampc_tensor_dim(y, -1) != r->d.num_classes)
        rc = fail("--model %s gives %d-dimensional outputs for %" PRId64 " classes", sval(r->s, OPT_MODEL), ampc_tensor_ndim(y),
                  r->d.num_classes);
    ampc_no_grad_exit();
    ampc_scope_end();
    return rc;
}

// ---------------------------------------------------------------------------------------------
// --amp-dtype fastest: the training step timed in each precision the device offers

#define FASTEST_ROUNDS 3   /* timed rounds after one of warm-up; the median of each precision */
_Static_assert(FASTEST_ROUNDS == 3, "amp_fastest takes the median of exactly 3 rounds");

/* Seconds of one training step's forward and backward pass (the optimizer's step costs about the
   same in every precision) on a batch of b zero images, or -1 when it fails: out of memory under
   --max-memory means that precision does not fit. */
static double probe_step(run *r, bool amp, ampc_dtype dt, int64_t b) {
    ampc_scope_begin();
    double t0 = progress_now();
    ampc_tensor *x, *y;
    ampc_autocast_enter(dt, amp);
    ampc_tensor *loss = zero_batch(r, b, &x, &y) == 0 ? model_loss(r, x, y, NULL, NULL) : NULL;
    ampc_autocast_exit();
    int rc = loss ? ampc_backward(loss) : -1;
    if (rc >= 0) rc = ampc_device_synchronize(r->m.device);
    double t = progress_now() - t0;
    ampc_scope_end();
    ampc_optimizer_zero_grad(r->m.opt);
    if (rc < 0) ampc_clear_error();
    return rc < 0 ? -1 : t;
}

/* Times fp32, bf16 (where the device has bf16 kernels) and fp16 in alternating rounds and keeps the
   fastest: --use-amp and --amp-dtype are set to it (fp32: --use-amp no). The model is as it was
   before: its buffers (BatchNorm's statistics) are restored, the random stream rewound (dropout's
   draws) and the gradients dropped. Under mpirun every rank takes the slowest rank's times, so
   all choose the same. */
static int amp_fastest(run *r, const char *hw_dtype) {
    struct {
        const char *name;
        bool amp;
        ampc_dtype dt;
        double t[FASTEST_ROUNDS];
    } c[3] = {{"fp32", false, AMPC_F32, {0}}, {"bf16", true, AMPC_BF16, {0}}, {"fp16", true, AMPC_F16, {0}}};
    bool offered[3] = {true, ampc_dtype_supported(r->m.device, AMPC_BF16), ampc_dtype_supported(r->m.device, AMPC_F16)};
    const int64_t b = ival(r->s, OPT_BATCH_SIZE);
    ampc_tensor **sd;
    int n_sd = ampc_module_state_dict(r->m.net, &sd, NULL);
    if (n_sd < 0) return fail_lib("--amp-dtype fastest");
    uint64_t seed, offset;
    ampc_rng_get_state(&seed, &offset);
    const bool keep = ampc_autocast_keeps_weight_casts();
    ampc_autocast_keep_weight_casts(false);   /* no 16-bit weight copies left behind */
    ampc_scope_begin();
    ampc_tensor **saved = calloc((size_t)(n_sd ? n_sd : 1), sizeof *saved);
    int rc = saved ? 0 : fail("out of memory");
    for (int i = 0; i < n_sd && rc == 0; i++)   /* the buffers: what a forward pass in training mode writes */
        if (!ampc_tensor_requires_grad(sd[i]) && !(saved[i] = ampc_tensor_to(sd[i], r->m.device, ampc_tensor_dtype(sd[i]))))
            rc = fail_lib("--amp-dtype fastest");
    printf("amp-dtype fastest: timing a training step's forward and backward pass (batch %" PRId64 ") in fp32%s%s ...\n", b,
           offered[1] ? ", bf16" : "", offered[2] ? ", fp16" : "");
    fflush(stdout);
    ampc_module_train(r->m.net, true);
    for (int round = -1; round < FASTEST_ROUNDS && rc == 0; round++)   /* round -1: warm-up (kernels, allocator) */
        for (int k = 0; k < 3; k++) {
            if (!offered[k]) continue;
            double t = probe_step(r, c[k].amp, c[k].dt, b);
            if (t < 0) offered[k] = false;   /* does not run here: out of memory */
            else if (round >= 0) c[k].t[round] = t;
        }
    ampc_rng_set_state(seed, offset);
    ampc_no_grad_enter();
    for (int i = 0; i < n_sd && rc == 0; i++)
        if (saved[i] && ampc_tensor_copy_(sd[i], saved[i]) < 0) rc = fail_lib("--amp-dtype fastest");
    ampc_no_grad_exit();
    ampc_scope_end();
    free(saved);
    ampc_autocast_keep_weight_casts(keep);
    if (rc < 0) return rc;
    double med[3];
    for (int k = 0; k < 3; k++) {   /* the median of 3 */
        double *t = c[k].t, lo = t[0] < t[1] ? t[0] : t[1], hi = t[0] < t[1] ? t[1] : t[0];
        med[k] = !offered[k] ? INFINITY : t[2] < lo ? lo : t[2] > hi ? hi : t[2];
    }
    if (ampc_dist_world_size() > 1 && ampc_dist_max_f64(med, 3) < 0) return fail_lib("--amp-dtype fastest: agreeing on the times");
    int best = -1;
    for (int k = 0; k < 3; k++)
        if (med[k] < INFINITY && (best < 0 || med[k] < med[best])) best = k;
    if (best < 0) return fail("--amp-dtype fastest: no precision ran a training step of batch %" PRId64, b);
    printf("amp-dtype fastest:");
    for (int k = 0; k < 3; k++)
        if (med[k] < INFINITY) printf(" %s %.3f ms,", c[k].name, 1e3 * med[k]);
        else printf(" %s %s,", c[k].name, k == 0 || ampc_dtype_supported(r->m.device, c[k].dt) ? "out of memory" : "not on this device");
    printf(" per step (median of %d) -> %s%s\n", FASTEST_ROUNDS, c[best].name, best == 0 ? " (--use-amp no)" : "");
    fflush(stdout);
    r->m.use_amp = c[best].amp;
    if (r->m.use_amp) r->m.amp_dtype = c[best].dt;
    if (set_val(r->s, OPT_USE_AMP, r->m.use_amp ? "yes" : "no") < 0) return -1;
    return set_val(r->s, OPT_AMP_DTYPE, r->m.use_amp ? c[best].name : hw_dtype);
}

/* The memory the run may use: --max-memory, or else what the machine or its cgroup allows, made
   the allocator's limit, so that a run too large for the machine ends in an out-of-memory error
   with figures rather than the kernel's OOM killer. */
static void memory_limit(run *r) {
    const char *host_src;
    const uint64_t host = ampc_memory_available(&host_src);
    r->m.host_limit = host == UINT64_MAX ? 0 : (double)host;
    if (strcmp(sval(r->s, OPT_MAX_MEMORY), "none") != 0) {
        r->m.mem_limit = rval(r->s, OPT_MAX_MEMORY);   /* main() set it */
        r->m.limit_src = "--max-memory";
    } else {
        r->m.mem_limit = r->m.host_limit;
        r->m.limit_src = host_src;
        if (host != UINT64_MAX) ampc_memory_set_limit((size_t)host);
    }
}

/* A batch of input images in f32 is the least a training step holds: a batch over the memory
   limit (--image-size 4096) is an error now, with the --batch-size that fits. */
static int batch_fits(run *r) {
    const double per = 4.0 * (double)(r->d.c * r->d.h * r->d.w), bs = (double)ival(r->s, OPT_BATCH_SIZE);
    if (r->m.mem_limit <= 0 || per * bs <= r->m.mem_limit) return 0;
    char a[32], b[32];
    const int64_t fit = (int64_t)(r->m.mem_limit / per);
    char how[96] = "not even one image fits: a smaller --image-size";
    if (fit >= 1) snprintf(how, sizeof how, "--batch-size %" PRId64 " at most, or a smaller --image-size", fit);
    return fail("a batch of %.0f images of %" PRId64 "x%" PRId64 "x%" PRId64 " takes %s in f32 before any activation, more than the %s that %s "
                "allows: %s",
                bs, r->d.c, r->d.h, r->d.w, fmt_bytes(per * bs, a, sizeof a), fmt_bytes(r->m.mem_limit, b, sizeof b), r->m.limit_src, how);
}

/* --device, --use-amp and --amp-dtype: auto resolved (under mpirun, rank 0 decides for the job)
   and checked against the device's kernels. *hw_dtype: auto's choice (fastest's until measured);
   *fastest: --amp-dtype fastest is to time the precisions once the model is built. */
static int choose_precision(run *r, const char **hw_dtype, bool *fastest) {
    settings *s = r->s;
    r->m.use_amp = yes(s, OPT_USE_AMP);
    const char *dev = sval(s, OPT_DEVICE);
    r->m.device = strncmp(dev, "cuda", 4) == 0 ? AMPC_DEVICE_CUDA : ampc_device_from_name(dev);
    if (r->m.device == AMPC_DEVICE_CUDA) {   /* which GPU: cuda:N, else the rank's on its machine */
        const int n = ampc_cuda_device_count(), local = ampc_dist_local_rank();
        const int gpu = dev[4] == ':' ? atoi(dev + 5) : n > 0 ? local % n : 0;
        if (ampc_cuda_set_device(gpu) < 0) return fail_lib("--device");
        if (!dev[4] && ampc_dist_local_size() > n && n > 0 && local == 0)
            warn("%d processes on this machine share its %d GPU(s) (process k takes GPU k mod %d)", ampc_dist_local_size(), n, n);
    }
    if (!ampc_device_available(r->m.device))
        return fail("--device %s: %s", sval(s, OPT_DEVICE), ampc_device_unavailable_reason(r->m.device));
    bool bf16_ok = ampc_dtype_supported(r->m.device, AMPC_BF16), bf16_fast = ampc_dtype_native(r->m.device, AMPC_BF16);
    bool auto_dtype = is_auto(s, OPT_AMP_DTYPE);
    *fastest = strcmp(sval(s, OPT_AMP_DTYPE), "fastest") == 0;
    bool job_bf16 = bf16_fast;   /* auto's choice for the job */
    if ((auto_dtype || *fastest) && ampc_dist_world_size() > 1) {   /* decided once, on rank 0, for the whole job */
        int fast0 = bf16_fast;
        if (ampc_dist_broadcast(&fast0, sizeof fast0, 0) < 0) return fail_lib("agreeing on --amp-dtype");
        if (fast0 && !bf16_ok && r->m.use_amp)
            return fail("--amp-dtype auto: rank 0 chose bf16 for the job (its CPU has bf16 arithmetic), but this process's CPU has "
                        "no bf16 kernels (cpu: %s%s): give every process --amp-dtype fp16", ampc_cpu_features(),
                        getenv("ONEDNN_MAX_CPU_ISA") ? ", ONEDNN_MAX_CPU_ISA set" : "");
        job_bf16 = fast0;
    }
    *hw_dtype = job_bf16 ? "bf16" : "fp16";   /* auto's choice; fastest's until measured */
    if ((auto_dtype || *fastest) && set_val(s, OPT_AMP_DTYPE, *hw_dtype) < 0) return -1;
    *fastest = *fastest && r->m.use_amp;   /* --use-amp no: nothing to choose */
    r->m.amp_dtype = strcmp(sval(s, OPT_AMP_DTYPE), "fp16") == 0 ? AMPC_F16 : AMPC_BF16;
    if (r->m.use_amp && r->m.amp_dtype == AMPC_BF16 && !bf16_ok)
        return fail("--amp-dtype bf16: this CPU has no bf16 kernels (oneDNN's need AVX-512; cpu: %s%s): use --amp-dtype fp16 "
                    "(the default here) or --use-amp no", ampc_cpu_features(),
                    getenv("ONEDNN_MAX_CPU_ISA") ? ", ONEDNN_MAX_CPU_ISA set" : "");
    if (r->m.use_amp && r->m.amp_dtype == AMPC_BF16 && !bf16_fast)
        warn("bf16 is emulated on this CPU (no AVX512-BF16): expect it several times slower than fp32; --amp-dtype fp16 "
             "(the default here) or --use-amp no run faster");
    if (r->m.use_amp && auto_dtype && !job_bf16)
        printf("note: --amp-dtype fp16, since this CPU has no bf16 arithmetic (AVX512-BF16); fp16 is computed in fp32 here, so AMP saves memory but likely not time (--amp-dtype fastest measures it)\n");
    return 0;
}

/* --optimizer with --lr, --momentum and --weight-decay, over the model's trainable parameters. */
static int make_optimizer(run *r) {
    const settings *s = r->s;
    const char *optname = sval(s, OPT_OPTIMIZER);
    double lr = rval(s, OPT_LR), wd = rval(s, OPT_WEIGHT_DECAY);
    if (strcmp(optname, "sgd") == 0) {
        ampc_sgd_options o = ampc_sgd_defaults();
        o.lr = lr;
        o.momentum = rval(s, OPT_MOMENTUM);
        o.weight_decay = wd;
        r->m.opt = ampc_sgd_new(r->m.net, &o);
    } else {
        bool w = strcmp(optname, "adamw") == 0;
        ampc_adam_options o = w ? ampc_adamw_defaults() : ampc_adam_defaults();
        o.lr = lr;
        o.weight_decay = wd;
        r->m.opt = w ? ampc_adamw_new(r->m.net, &o) : ampc_adam_new(r->m.net, &o);
    }
    if (!r->m.opt) return fail_lib("--optimizer");
    /* a transformer's recipe (nanoGPT's, minGPT's): weight decay on the Linear weights only */
    if (!strcmp(sval(s, OPT_MODEL), "gpt") && ampc_optimizer_decay_only_weights(r->m.opt, r->m.net) < 0) return fail_lib("--weight-decay");
    return 0;
}

/* The training loader (shuffled, --num-workers, this rank's shard) and the validation one, and
   the buffers that count correct answers. */
static int make_loaders(run *r) {
    const settings *s = r->s;
    int64_t bs = ival(s, OPT_BATCH_SIZE);
    ampc_loader_options lo = ampc_loader_defaults();
    lo.batch_size = bs;
    lo.seed = (uint64_t)ival(s, OPT_SEED);
    lo.num_workers = (int)ival(s, OPT_NUM_WORKERS);
    lo.device = yes(s, OPT_PIN_MEMORY) ? r->m.device : AMPC_DEVICE_CPU;   /* batches made on the device (--pin-memory) */
    lo.shuffle = true;
    lo.transforms = r->d.tf_train;
    lo.shard_rank = r->rank = ampc_dist_rank();   /* data-parallel: each rank its shard of every epoch */
    lo.shard_count = r->world = ampc_dist_world_size();
    /* SyncBatchNorm needs a sample on every rank in every training step: an epoch's last global
       batch smaller than the world is left out, and said so (validation keeps it: eval mode does
       not communicate) */
    lo.drop_short_tail = r->m.sync_bn > 0;
    const int64_t tail = ampc_dataset_size(r->d.train) % (bs * r->world);
    if (r->m.sync_bn > 0 && tail > 0 && tail < r->world)
        printf("note: --sync-bn: each epoch's last %" PRId64 " training sample(s), fewer than the %d processes, are left out (SyncBatchNorm "
               "needs a sample on every process)\n", tail, r->world);
    if (!(r->d.train_ld = ampc_loader_new(r->d.train, &lo))) return fail_lib("data loader");
    lo.shuffle = false;
    lo.drop_short_tail = false;
    lo.transforms = r->d.tf_val;
    if (!(r->d.val_ld = ampc_loader_new(r->d.val, &lo))) return fail_lib("data loader");
    /* the logits are read in blocks of at most 4M values (a batch of images' at once) */
    const int64_t rows = bs * answers_per_sample(&r->d), cap = (4 << 20) / r->d.num_classes;
    r->tally.logits_rows = rows < cap ? rows : cap > 1 ? cap : 1;
    if (!(r->tally.logits_buf = malloc((size_t)(r->tally.logits_rows * r->d.num_classes) * sizeof *r->tally.logits_buf)))
        return fail("out of memory");
    /* a confusion matrix for classes (a language model's vocabulary has none: next-token accuracy only) */
    if (!r->d.block && !(r->tally.confusion = calloc((size_t)(r->d.num_classes * r->d.num_classes), sizeof *r->tally.confusion)))
        return fail("out of memory");
    return 0;
}

/* The learning-rate schedule, in optimizer steps. */
static void make_schedule(run *r) {
    const settings *s = r->s;
    /* the learning rate by optimizer step: epochs in optimizer steps of this run's loader (one per
       --accumulate batches, the last group of an epoch perhaps shorter) */
    const int64_t nb = ampc_loader_num_batches(r->d.train_ld), acc = ival(s, OPT_ACCUMULATE);
    const int64_t per_epoch = nb > 0 ? (nb + acc - 1) / acc : 1;
    const char *sk = sval(s, OPT_LR_SCHEDULE);
    /* in optimizer steps, saturated: a product past INT64_MAX is a step never reached */
    int64_t all, step_size;
    if (__builtin_mul_overflow(ival(s, OPT_EPOCHS), per_epoch, &all)) all = INT64_MAX;
    if (__builtin_mul_overflow(ival(s, OPT_LR_STEP_SIZE), per_epoch, &step_size)) step_size = INT64_MAX;
    const int64_t warm = ival(s, OPT_WARMUP_STEPS);
    r->m.sched = (ampc_lr_schedule){.kind = !strcmp(sk, "step") ? AMPC_LR_STEP : !strcmp(sk, "cosine") ? AMPC_LR_COSINE : AMPC_LR_CONSTANT,
                                  .step_size = step_size,
                                  .gamma = rval(s, OPT_LR_GAMMA),
                                  .t_max = all - warm > 1 ? all - warm : 1,
                                  .eta_min = 0,
                                  .warmup_steps = warm,
                                  .warmup_start_factor = 1.0 / 3};
    r->m.scheduled = r->m.sched.kind != AMPC_LR_CONSTANT || warm > 0;
}

int run_build(run *r) {
    settings *s = r->s;
    const char *model = sval(s, OPT_MODEL);
    const bool gpt = strcmp(model, "gpt") == 0;
    if (ival(s, OPT_SAMPLE) > 0 && !gpt) return usage_error("--sample generates text with a language model (--model gpt), not --model %s", model);
    if (gpt && (strcmp(sval(s, OPT_FREEZE), "none") || !strcmp(sval(s, OPT_PRETRAINED_STRICT), "head")))
        return usage_error("--freeze backbone and --pretrained-strict head work on a classifier's head; --model gpt's output head is its "
                           "token embedding (tied), so neither applies");
    if (is_auto(s, OPT_OPTIMIZER) && set_val(s, OPT_OPTIMIZER, gpt ? "adamw" : "adam") < 0) return -1;
    const char *optname = sval(s, OPT_OPTIMIZER);
    bool sgd = strcmp(optname, "sgd") == 0;
    const char *hw_dtype = NULL;
    bool fastest = false;
    if (choose_precision(r, &hw_dtype, &fastest) < 0) return -1;
    if (is_auto(s, OPT_LR) && set_val(s, OPT_LR, sgd ? "0.01" : "0.001") < 0) return -1;
    if (is_auto(s, OPT_WEIGHT_DECAY) && set_val(s, OPT_WEIGHT_DECAY, strcmp(optname, "adamw") == 0 ? (gpt ? "0.1" : "0.01") : "0") < 0) return -1;
    if (is_auto(s, OPT_THREADS)) {
        char t[16];
        snprintf(t, sizeof t, "%d", ampc_get_num_threads());
        if (set_val(s, OPT_THREADS, t) < 0) return -1;
    } else {
        ampc_set_num_threads((int)ival(s, OPT_THREADS));
    }
    memory_limit(r);
    g_oom_hint = "IDX data and an image folder's index are read into memory whole";
    if (data_open(s, &r->d) < 0 || batch_fits(r) < 0) return -1;

    static char hint[256];
    snprintf(hint, sizeof hint, "the model and its optimizer state need more than %s allows: %s or choose a smaller --model", r->m.limit_src,
             strcmp(r->m.limit_src, "--max-memory") == 0 ? "raise it" : "free memory");
    g_oom_hint = hint;
    ampc_manual_seed((uint64_t)ival(s, OPT_SEED));
    bool small = false;
    if (strncmp(model, "resnet", 6) == 0 && choose_stem(r, model, &small) < 0) return -1;
    ampc_model_options mo = {.num_classes = r->d.num_classes, .in_channels = r->d.c, .small_input = small,
                             .memory_format = yes(s, OPT_CHANNELS_LAST) ? AMPC_CHANNELS_LAST : AMPC_CONTIGUOUS_FORMAT};
    if (gpt)
        mo.gpt = (ampc_gpt_config){.vocab_size = r->d.num_classes, .block_size = r->d.block, .n_layer = ival(s, OPT_N_LAYER),
                                   .n_head = ival(s, OPT_N_HEAD), .n_embd = ival(s, OPT_N_EMBD), .dropout = rval(s, OPT_DROPOUT),
                                   .no_bias = !yes(s, OPT_BIAS)};
    ampc_set_default_device(r->m.device);   /* the model's tensors are made there (same values as on the CPU) */
    if (!(r->m.net = ampc_model_new(model, &mo))) return fail_lib("--model");
    if (check_model_input(r) < 0) return -1;
    if (*sval(s, OPT_PRETRAINED) && !*sval(s, OPT_RESUME) && load_pretrained(r) < 0) return -1;   /* resume has its own weights */
    if (freeze(r, model) < 0) return -1;
    if (yes(s, OPT_SYNC_BN) && (r->m.sync_bn = ampc_module_convert_sync_batchnorm(r->m.net)) < 0) return fail_lib("--sync-bn");
    if (yes(s, OPT_SYNC_BN) && r->m.sync_bn == 0) warn("--sync-bn: --model %s has no BatchNorm layers", model);
    if (make_optimizer(r) < 0) return -1;
    if (fastest && amp_fastest(r, hw_dtype) < 0) return -1;
    if (is_auto(s, OPT_GRAD_SCALER) && set_val(s, OPT_GRAD_SCALER, r->m.use_amp && r->m.amp_dtype == AMPC_F16 ? "yes" : "no") < 0) return -1;
    ampc_scaler_options so = ampc_scaler_defaults();
    so.enabled = yes(s, OPT_GRAD_SCALER);
    if (!(r->m.scaler = ampc_scaler_new(&so))) return fail_lib("grad scaler");

    if (make_loaders(r) < 0) return -1;
    make_schedule(r);
    return 0;
}
