/*
 * trainer.c - the epoch loop. Each epoch trains under autocast with one GradScaler for the whole
 * run, validates in eval mode under no-grad and autocast, then replaces the checkpoint (before the
 * metrics row: metrics.csv never runs ahead of it) and redraws the plots. Around it: divergence
 * (a run training on garbage stops with status 3 and keeps its last good checkpoint), signals
 * (SIGINT/SIGTERM save where training stands and exit 128 + signal) and, after running out of
 * memory under --max-memory, measured advice on what fits.
 */
#include "plot.h"
#include "train.h"
#include "progress.h"

#include <errno.h>
#include <glob.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

// ---------------------------------------------------------------------------------------------
// Signals: SIGINT/SIGTERM stop the run at the next step boundary with a checkpoint that resumes
// exactly; a second one stops at once (the signal's default action). Handlers are installed only
// while epochs run: during the setup there is nothing to save.

static volatile sig_atomic_t g_signal;

static void on_stop_signal(int sig) {
    if (g_signal) {   /* the second: at once */
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    g_signal = sig;
    static const char msg[] = "\n" PROG ": stopping at the end of this step to save a checkpoint (signal again to stop at once)\n";
    ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)w;
}

static void stop_signals_install(bool on) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on ? on_stop_signal : SIG_DFL;
    sa.sa_flags = SA_RESTART;   /* reads, writes and fsync in flight go on */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

// ---------------------------------------------------------------------------------------------
// Divergence: a run that trains on garbage stops instead of overwriting its good checkpoint

#define EXIT_DIVERGED 3

/* "in epoch E at step S of N: <why>" (no step for a check between epochs) into buf. */
static void where_why(char *buf, size_t n, int64_t epoch, int64_t step, int64_t n_steps, const char *fmt, va_list ap) {
    size_t at = 0;
    appendf(buf, n, &at, "in epoch %" PRId64, epoch + 1);
    if (step > 0) appendf(buf, n, &at, " at step %" PRId64 " of %" PRId64, step, n_steps);
    appendf(buf, n, &at, ": ");
    if (at < n) vsnprintf(buf + at, n - at, fmt, ap);
}

/* A divergence seen in one process (the loss): stops without saving, naming the last good
   checkpoint. */
static int diverged(run *r, int64_t epoch, int64_t step, int64_t n_steps, const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static int diverged(run *r, int64_t epoch, int64_t step, int64_t n_steps, const char *fmt, ...) {
    char why[640];
    va_list ap;
    va_start(ap, fmt);
    where_why(why, sizeof why, epoch, step, n_steps, fmt, ap);
    va_end(ap);
    fail("training diverged %s; stopped without saving: %s%s (try a lower --lr)", why,
         r->last_good[0] ? "the last good checkpoint is " : "no checkpoint was written", r->last_good);
    g_exit = EXIT_DIVERGED;
    g_job_error = r->world > 1;   /* the job's loss and the replicas' weights: every rank stops here together */
    return -1;
}

/* The grad scaler's guard rails tripped: the scaler's state is the job's, the same on every rank,
   so all stop at this step. Records where and why (r->diverged_why) and returns 1: the pass ends
   after this batch and the run saves where it stopped (diverged_save). */
static int scaler_diverged(run *r, int64_t epoch, int64_t step, int64_t n_steps, const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static int scaler_diverged(run *r, int64_t epoch, int64_t step, int64_t n_steps, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    where_why(r->diverged_why, sizeof r->diverged_why, epoch, step, n_steps, fmt, ap);
    va_end(ap);
    return 1;
}

/* After a training batch: the loss and, when it ended an optimizer step, the grad scaler's skips
   and scale. x is the batch. Returns 0, 1 when the scaler's guard rails stop the run (see
   scaler_diverged), or -1 (an error, or a divergence that stops without saving). */
static int check_step(run *r, int64_t epoch, int64_t step, int64_t n_steps, double loss, ampc_tensor *x, bool stepped) {
    int64_t sk = ampc_scaler_steps_skipped(r->scaler);
    r->skipped_in_a_row = sk > r->skipped_seen ? r->skipped_in_a_row + (sk - r->skipped_seen) : 0;
    r->skipped_seen = sk;
    bool scaled = ampc_scaler_is_enabled(r->scaler);
    if (!isfinite(loss)) {
        int64_t bad = ampc_tensor_count_nonfinite(x);
        if (bad > 0)
            return fail("the training batch of epoch %" PRId64 ", step %" PRId64 " holds %" PRId64 " NaN/inf input value(s): the data "
                        "is corrupt", epoch + 1, step, bad);
        char blame[520];
        if (!scaled) return diverged(r, epoch, step, n_steps, "the loss is %g%s", loss, doctor_blame(blame, sizeof blame));
    } else if (loss > rval(r->s, OPT_MAX_LOSS)) {
        return diverged(r, epoch, step, n_steps, "the loss %g exceeds --max-loss %s", loss, sval(r->s, OPT_MAX_LOSS));
    }
    if (!scaled || !stepped) return 0;   /* the scale changes only at optimizer steps: stops wait for a group's end */
    int64_t max_skip = ival(r->s, OPT_MAX_SKIPPED);
    float scale = ampc_scaler_get_scale(r->scaler);
    double min_scale = rval(r->s, OPT_MIN_LOSS_SCALE);
    char blame[520];   /* what the doctor blames: computed only for a run that stops */
    if (max_skip > 0 && r->skipped_in_a_row >= max_skip)
        return scaler_diverged(r, epoch, step, n_steps, "the grad scaler skipped %" PRId64 " steps in a row (inf/NaN gradients down to scale %g; "
                               "--max-skipped-steps %" PRId64 ")%s", r->skipped_in_a_row, (double)scale, max_skip,
                               doctor_blame(blame, sizeof blame));
    if ((double)scale < min_scale)
        return scaler_diverged(r, epoch, step, n_steps, "the loss scale collapsed to %g (below --min-loss-scale %s%s)%s", (double)scale,
                               sval(r->s, OPT_MIN_LOSS_SCALE),
                               strcmp(sval(r->s, OPT_MIN_LOSS_SCALE), OPTS[OPT_MIN_LOSS_SCALE].def) == 0
                                   ? ", 2^-24, where every fp16 gradient of a loss <= 1 underflows" : "",
                               doctor_blame(blame, sizeof blame));
    return 0;
}

/* After an epoch's training pass: under the grad scaler, an epoch whose optimizer steps were all
   skipped changed nothing but the scale, however few they were (fewer than --max-skipped-steps);
   it stops as the guard rails do (returns 2, as run_pass when they stop it, or 0). */
static int check_epoch_applied(run *r, int64_t epoch, const pass_stats *tr) {
    const int64_t accum = ival(r->s, OPT_ACCUMULATE), steps = (tr->steps + accum - 1) / accum;
    const int64_t skipped = ampc_scaler_steps_skipped(r->scaler) - r->epoch_skipped0;
    if (!ampc_scaler_is_enabled(r->scaler) || steps == 0 || skipped < steps) return 0;
    char blame[520];
    scaler_diverged(r, epoch, 0, 0, "the grad scaler skipped all %" PRId64 " optimizer step(s) of the epoch (inf/NaN "
                    "gradients down to scale %g): not one was applied%s", steps, (double)ampc_scaler_get_scale(r->scaler),
                    doctor_blame(blame, sizeof blame));
    return 2;
}

/* NaN/inf values in the weights and buffers (*model) and in the optimizer's state (*opt). */
static int count_nonfinite_state(run *r, int64_t *model, int64_t *opt) {
    ampc_tensor **sd;
    int n = ampc_module_state_dict(r->net, &sd, NULL);
    if (n < 0) return fail_lib("checking the weights");
    *model = 0;
    for (int i = 0; i < n; i++) {
        int64_t b = ampc_tensor_count_nonfinite(sd[i]);
        if (b < 0) return fail_lib("checking the weights");
        *model += b;
    }
    *opt = ampc_optimizer_count_nonfinite(r->opt);
    return *opt < 0 ? fail_lib("checking the optimizer state") : 0;
}

/* Before a checkpoint replaces the last one: no NaN/inf in the weights, buffers or optimizer state
   (epoch: the 0-based epoch that made them, for the message). */
static int check_finite_state(run *r, int64_t epoch) {
    int64_t model, opt;
    if (count_nonfinite_state(r, &model, &opt) < 0) return -1;
    if (model == 0 && opt == 0) return 0;
    return diverged(r, epoch, 0, 0, "the weights and buffers hold %" PRId64 " NaN/inf value(s) (with the optimizer's state: %" PRId64 ")",
                    model, opt);
}

/* One remedy (why: the flag with its reason) appended to the list in buf; the first one's flag is
   kept in first (fn bytes) for the resume line. */
static void remedy(char *buf, size_t n, size_t *at, char *first, size_t fn, const char *flag, const char *why) {
    appendf(buf, n, at, "%s%s", *at ? "; " : "", why);
    if (!first[0]) snprintf(first, fn, "%s", flag);
}

/* What to change for a run the grad scaler gave up on, most specific first; *first: the flag of
   the first, for the resume line. */
static const char *remedies(run *r, char *buf, size_t n, char *first, size_t fn) {
    const bool fp16 = r->use_amp && r->amp_dtype == AMPC_F16, bf16_ok = ampc_dtype_supported(r->device, AMPC_BF16);
    ampc_doctor_finding f = {0};
    if (ampc_doctor_is_enabled()) f = ampc_doctor_finding_get();
    const bool named = f.verdict != AMPC_DOCTOR_CLEAN && f.module && *f.module;
    size_t at = 0;
    buf[0] = first[0] = '\0';
    char flag[300], why[400];
    if (named && f.verdict == AMPC_DOCTOR_INTRINSIC) {
        snprintf(flag, sizeof flag, "--fp32-modules '%s'", f.module);
        snprintf(why, sizeof why, "%s (fp32 where the doctor found the overflow)", flag);
        remedy(buf, n, &at, first, fn, flag, why);
    }
    if (fp16 && bf16_ok) remedy(buf, n, &at, first, fn, "--amp-dtype bf16", "--amp-dtype bf16 (fp32's range: no loss scaling needed)");
    snprintf(flag, sizeof flag, "--lr %g", rval(r->s, OPT_LR) / 10);
    snprintf(why, sizeof why, "a lower --lr (%s is a tenth of this run's)", flag);
    remedy(buf, n, &at, first, fn, flag, why);
    if (!named) remedy(buf, n, &at, first, fn, "--doctor yes", "--doctor yes to name the module that overflows, then --fp32-modules for it");
    if (rval(r->s, OPT_CLIP_GRAD_NORM) == 0) remedy(buf, n, &at, first, fn, "--clip-grad-norm 1", "--clip-grad-norm (e.g. 1)");
    if (r->use_amp) remedy(buf, n, &at, first, fn, "--use-amp no", "--use-amp no (fp32 throughout)");
    return buf;
}

/* The grad scaler's guard rails stopped the run, every rank at the same step. Skipped steps change
   nothing but the scaler, so the weights and optimizer state are those of the last applied step:
   unless they hold NaN/inf they are saved where training stopped, to diverged.safetensors beside
   the last good checkpoint (which stays as it was), and the message says what to resume it with.
   Exit status 3. */
static int diverged_save(run *r, int64_t epoch, const pass_stats *tr, double epoch_seconds) {
    int64_t model, opt;
    if (count_nonfinite_state(r, &model, &opt) < 0) return -1;
    const char *path = r->diverged_path;
    const bool finite = model == 0 && opt == 0;
    if (finite && r->zero_all > 0 && ampc_zero_consolidate(r->opt) < 0) return fail_lib("gathering the sharded optimizer state");
    if (finite && r->rank == 0 && checkpoint_save(r, path, r->diverged_why, epoch, tr->steps, tr, epoch_seconds) < 0) return -1;
    char saved[4400], rem[1024], first[320], example[4800] = "";
    if (finite) snprintf(saved, sizeof saved, "saved where it stopped to %s (the weights of the last applied step)", path);
    else snprintf(saved, sizeof saved, "not saved: the weights and buffers hold %" PRId64 " NaN/inf value(s) (the optimizer's "
                  "state %" PRId64 ")", model, opt);
    remedies(r, rem, sizeof rem, first, sizeof first);
    if (finite) snprintf(example, sizeof example, ", e.g. " PROG " --resume %s %s", path, first);
    fail("training diverged %s; %s; %s%s. Remedies: %s. They may be given on --resume%s", r->diverged_why, saved,
         r->last_good[0] ? "the last good checkpoint is " : "no good checkpoint was written before", r->last_good, rem, example);
    g_exit = EXIT_DIVERGED;
    g_job_error = true;
    return -1;
}

/* The checkpoint replaces the last one (meta.c) unless the weights or optimizer state hold NaN/inf
   (diverged): the epoch just trained is checked. */
static int save_checkpoint(run *r, int64_t epochs_done, int64_t step, const pass_stats *partial, double epoch_seconds) {
    if (check_finite_state(r, step > 0 || epochs_done == 0 ? epochs_done : epochs_done - 1) < 0) return -1;
    /* --zero 1: the whole optimizer state on rank 0 for the file (any number of ranks resumes it) */
    if (r->zero_all > 0 && ampc_zero_consolidate(r->opt) < 0) return fail_lib("gathering the sharded optimizer state");
    /* data-parallel: rank 0 writes, the replicas are the same */
    int rc = r->rank > 0 ? 0 : checkpoint_save(r, r->ckpt_path, NULL, epochs_done, step, partial, epoch_seconds);
    /* the model's state_dict alone beside it, as PyTorch's torch.save(model.state_dict()):
       load_state_dict(strict=True) takes it as it is (--resume reads the checkpoint) */
    if (rc == 0 && r->rank == 0 && ampc_checkpoint_save(r->model_path, r->net, NULL, NULL, NULL) < 0) rc = fail_lib("saving model.safetensors");
    if (r->zero_all > 0 && ampc_zero_shard(r->opt, NULL, NULL) < 0 && rc == 0) rc = fail_lib("sharding the optimizer state");
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Training and validation

/* Number of rows of logits (B, C) whose argmax (the first maximum) equals the label; with
   confusion (C, C), each row also counted at (label, argmax). */
static int count_correct(run *r, ampc_tensor *logits, ampc_tensor *labels, int64_t *correct, double *confusion) {
    int64_t b = ampc_tensor_dim(logits, 0), c = ampc_tensor_dim(logits, 1);
    if (ampc_tensor_to_f32(logits, r->logits_buf, (size_t)(b * c)) < 0) return fail_lib("reading the logits");
    const int64_t *y = ampc_tensor_cdata(labels);
    for (int64_t i = 0; i < b; i++) {
        const float *row = r->logits_buf + i * c;
        int64_t best = 0;
        for (int64_t k = 1; k < c; k++)
            if (row[k] > row[best]) best = k;
        *correct += best == y[i];
        if (confusion && y[i] >= 0 && y[i] < c) confusion[y[i] * c + best] += 1;
    }
    return 0;
}

/* Validation samples of class t in the confusion matrix, and the class's name (NULL: none). */
static double class_samples(const run *r, int64_t t) {
    double n = 0;
    for (int64_t k = 0; k < r->d.num_classes; k++) n += r->confusion[t * r->d.num_classes + k];
    return n;
}
static const char *class_name(const run *r, int64_t t) { return ampc_dataset_class_name(r->d.val ? r->d.val : r->d.train, t); }

/* After a validation pass: confusion.csv in the output folder (rank 0; the job's counts), rows
   the true class, columns the predicted one, with the classes' names where the data has them. */
static int write_confusion(run *r) {
    if (r->rank != 0) return 0;
    int64_t C = r->d.num_classes;
    char *path = path_join(r->out, "confusion.csv");
    FILE *f = path ? ampc_output_fopen(path, "confusion.csv", "w") : NULL;
    free(path);
    if (!f) return fail_lib("confusion.csv");
    fprintf(f, "true\\predicted");
    for (int64_t k = 0; k < C; k++) fprintf(f, ",%" PRId64, k);
    fprintf(f, ",samples,accuracy,class\n");
    for (int64_t t = 0; t < C; t++) {
        fprintf(f, "%" PRId64, t);
        for (int64_t k = 0; k < C; k++) fprintf(f, ",%.0f", r->confusion[t * C + k]);
        double n = class_samples(r, t);
        const char *name = class_name(r, t);
        fprintf(f, ",%.0f,%.6f,", n, n > 0 ? r->confusion[t * C + t] / n : NAN);
        for (const char *q = name ? name : ""; *q; q++) fputc(*q == ',' || *q == '\n' ? ' ' : *q, f);   /* a name as one CSV field */
        fputc('\n', f);
    }
    return fclose(f) == 0 ? 0 : fail("writing confusion.csv: %s", strerror(errno));
}

/* The last validation's per-class accuracy: every class when there are at most 20, else the five
   with the lowest (ties: the lower index; classes without samples left out). */
static void print_per_class(run *r) {
    int64_t C = r->d.num_classes, show = C <= 20 ? C : 5;
    printf("  per-class validation accuracy (%s; confusion.csv has the matrix):\n", C <= 20 ? "every class" : "the 5 lowest");
    double *acc = malloc((size_t)C * sizeof *acc);
    if (!acc) return;
    for (int64_t t = 0; t < C; t++) {
        double n = class_samples(r, t);
        acc[t] = n > 0 ? r->confusion[t * C + t] / n : 2;   /* 2: no samples */
    }
    for (int64_t i = 0; i < show; i++) {
        int64_t pick = C > 20 ? 0 : i;
        if (C > 20) {   /* the lowest not printed yet (printed ones are set to 3) */
            for (int64_t t = 1; t < C; t++)
                if (acc[t] < acc[pick]) pick = t;
            if (acc[pick] >= 2) break;   /* the rest have no samples or were printed */
        }
        const char *name = class_name(r, pick);
        double n = class_samples(r, pick);
        printf("    %3" PRId64 " %-24.24s %6.2f%% of %.0f\n", pick, name ? name : "", n > 0 ? 100 * r->confusion[pick * C + pick] / n : NAN, n);
        if (C > 20) acc[pick] = 3;
    }
    free(acc);
}

/* One pass over a loader: training (autocast forward, scaled backward, scaler step) or
   validation (eval mode, no-grad, autocast, no scaler). A training pass may continue one that a
   signal stopped (the totals so far in *carry): at sample carry->samples of the epoch, which all
   ranks together had taken in carry->steps steps, on this or any other number of ranks. Returns 0
   at the end of the pass, 1 when a signal stopped it (st holds the totals so far), 2 when the grad
   scaler's guard rails did (r->diverged_why; every rank alike), -1 on an error. */
static int run_pass(run *r, bool training, int64_t epoch, pass_stats *st, const pass_stats *carry) {
    ampc_loader *ld = training ? r->train_ld : r->val_ld;
    int64_t n_epochs = ival(r->s, OPT_EPOCHS);
    char label[64];
    snprintf(label, sizeof label, "epoch %" PRId64 "/%" PRId64 " %s", epoch + 1, n_epochs, training ? "train" : "val  ");
    memset(st, 0, sizeof *st);
    if (carry) *st = *carry;
    ampc_module_train(r->net, training);
    if ((carry ? ampc_loader_start_epoch_at_sample(ld, epoch, carry->samples) : ampc_loader_start_epoch(ld, epoch)) < 0)
        return fail_lib("data loader");
    int64_t done = carry ? carry->steps : 0, n_batches = done + ampc_loader_num_batches(ld);
    /* --accumulate: groups of `accum` batches (the epoch's last one perhaps shorter), one optimizer
       step each; a stop (signal, --stop-after-steps) waits for the end of its group, so a
       checkpoint never holds half-accumulated gradients */
    const int64_t accum = training ? ival(r->s, OPT_ACCUMULATE) : 1;
    /* --label-smoothing: the training loss only (validation's stays comparable between runs);
       0 passes no options, the very call of a run without the flag */
    ampc_cross_entropy_options ce = ampc_cross_entropy_defaults();
    ce.label_smoothing = rval(r->s, OPT_LABEL_SMOOTHING);
    const ampc_cross_entropy_options *ce_opts = training && ce.label_smoothing > 0 ? &ce : NULL;
    int64_t group_start = done;
    double group_loss = 0;   /* the sum of the group's batch losses, for steps.csv */
    double group_rows = 0, group_t0 = progress_now();   /* the job's samples in the group, since when: --tensorboard */
    double t0 = progress_now() - st->seconds;
    progress p;
    progress_begin(&p, label, n_batches, done);
    if (!training && p.mode == PROGRESS_LINES) p.mode = PROGRESS_OFF;   /* a log gets the epoch's line only */
    if (!training) {
        ampc_no_grad_enter();
        memset(r->confusion, 0, (size_t)(r->d.num_classes * r->d.num_classes) * sizeof *r->confusion);
    }
    int depth = ampc_scope_depth(), rc = 0;
    for (;;) {
        const bool boundary = !training || done == group_start;   /* validation: every batch */
        if (boundary && r->world > 1) {   /* every rank stops at the same step: a signal seen by any of them counts */
            double sig = g_signal;
            if (ampc_dist_max_f64(&sig, 1) < 0) {
                rc = fail_lib("agreeing on a stop");
                break;
            }
            if (sig > 0 && !g_signal) g_signal = (int)sig;
        }
        if (boundary && g_signal) {
            rc = 1;
            break;
        }
        /* every rank takes the same steps: they stop together without a word */
        if (boundary && training && ival(r->s, OPT_STOP_AFTER_STEPS) > 0 && r->steps_run >= ival(r->s, OPT_STOP_AFTER_STEPS)) {
            r->stop_asked = true;
            rc = 1;
            break;
        }
        ampc_scope_begin();   /* the step's tensors are released at its end */
        ampc_tensor *x, *y;
        double tw = progress_now();
        int more = ampc_loader_next(ld, &x, &y);
        st->data_seconds += progress_now() - tw;   /* the loader's cost as the step sees it: decode or wait */
        if (more <= 0) {
            if (more < 0) rc = fail_lib("data loader");
            break;
        }
        if (training && done == group_start) {   /* an optimizer step begins */
            doctor_step_begin(r);
            numerics_step_begin(r);
            if (r->steps_run == 0 && yes(r->s, OPT_EXPLAIN) && !r->explaining && (rc = explain_begin(r)) < 0) break;
        }
        ampc_tensor *y_cpu = y;   /* the labels stay readable here for counting */
        if (r->device != AMPC_DEVICE_CPU && ampc_tensor_dim(y, 0) > 0 && (!(x = ampc_tensor_to(x, r->device, AMPC_F32)) || !(y = ampc_tensor_to(y, r->device, AMPC_I64)))) {
            rc = fail_lib("copying the batch to the device");
            break;
        }
        if (training && r->ddp && ampc_ddp_sync_buffers(r->ddp) < 0) {   /* rank 0's BatchNorm statistics, as DDP */
            rc = fail_lib("data-parallel buffers");
            break;
        }
        /* data-parallel: the epoch's last global batch may be split unevenly, some ranks with
           none of it: each rank's mean loss is weighted by its share, so that the gradient DDP
           averages is the global batch's mean, as one process computes it */
        const int64_t b = ampc_tensor_dim(y, 0), global_rows = ampc_loader_global_rows(ld);
        ampc_tensor *logits = NULL, *loss = NULL;
        if (b > 0) {
            ampc_autocast_enter(r->amp_dtype, r->use_amp);
            logits = ampc_module_forward(r->net, x);
            loss = ampc_cross_entropy(logits, y, ce_opts);
            ampc_autocast_exit();
            if (!loss) {
                rc = fail_lib(training ? "training (forward)" : "validation");
                break;
            }
        }
        /* this batch's place in its accumulation group of g batches */
        const int64_t g = accum < n_batches - group_start ? accum : n_batches - group_start;
        const bool last = done + 1 >= group_start + g;
        if (training && r->ddp && accum > 1 && ampc_ddp_set_sync(r->ddp, last) < 0) {   /* no_sync() but for the last */
            rc = fail_lib("data-parallel --accumulate");
            break;
        }
        if (training && b > 0) {   /* a group's loss is the mean over its batches, as loss / iters_to_accumulate */
            const double share = b * r->world == global_rows ? 1.0 : (double)(b * r->world) / (double)global_rows;
            ampc_tensor *part = g > 1 || share != 1.0 ? ampc_mul_scalar(loss, share / (double)g) : loss;
            if (!part || ampc_backward(ampc_scaler_scale(r->scaler, part)) < 0) {
                rc = fail_lib("training (backward)");
                break;
            }
        } else if (training && r->ddp && ampc_ddp_join(r->ddp) < 0) {   /* none of the batch here: the all-reduce all the same */
            rc = fail_lib("training (data-parallel join)");
            break;
        }
        bool stepped = false, step_skipped = false;   /* this batch ended its group with an optimizer step */
        double step_scale = 0;                        /* the scale that step's gradients carried */
        if (training && last) {
            if (r->scheduled) {   /* the rate of this optimizer step: applied steps so far */
                double lr = ampc_lr_at(&r->sched, rval(r->s, OPT_LR), ampc_optimizer_steps_taken(r->opt));
                if (isnan(lr)) {
                    rc = fail_lib("--lr-schedule");
                    break;
                }
                ampc_optimizer_set_lr(r->opt, lr);
            }
            /* --clip-grad-norm: PyTorch's recipe, unscale_ then clip_grad_norm_ then step (which then
               reads the unscaled grads); the norm of non-finite grads is non-finite and the
               scaler skips the step */
            const double clip = rval(r->s, OPT_CLIP_GRAD_NORM);
            if (clip > 0 && (ampc_scaler_unscale(r->scaler, r->opt) < 0 || ampc_clip_grad_norm(r->opt, clip) < 0)) {
                rc = fail_lib("--clip-grad-norm");
                break;
            }
            step_scale = ampc_scaler_get_scale(r->scaler);
            const int64_t skipped0 = ampc_scaler_steps_skipped(r->scaler);
            if (ampc_scaler_step(r->scaler, r->opt) < 0 || ampc_scaler_update(r->scaler) < 0) {
                rc = fail_lib("training (optimizer step)");
                break;
            }
            ampc_optimizer_zero_grad(r->opt);
            step_skipped = ampc_scaler_steps_skipped(r->scaler) > skipped0;
            stepped = true;
            group_start = done + 1;
            r->steps_run++;
        }
        double lv = b > 0 ? ampc_tensor_item(loss) : 0, job_lv = lv;
        if (training && r->world > 1) {   /* the job's loss, every rank's samples: what the guard rails and steps.csv see */
            double v[2] = {lv * (double)b, (double)b};
            if (ampc_dist_allreduce_sum_f64(v, 2) < 0) {
                rc = fail_lib("summing the job's loss");
                break;
            }
            job_lv = v[0] / v[1];
        }
        if (training) {
            group_loss += job_lv;
            group_rows += (double)global_rows;
        }
        if (stepped) {
            const double group_s = progress_now() - group_t0;
            if ((rc = steplog_step(r, epoch, done + 1, group_loss / (double)g, step_scale, step_skipped,
                                   group_s > 0 ? group_rows / group_s : NAN)) < 0 ||
                (rc = tensorboard_step(r, group_loss / (double)g, step_scale, group_rows, group_s)) < 0)
                break;
            group_loss = group_rows = 0;
            group_t0 = progress_now();
            if (r->explaining && (rc = explain_print(r)) < 0) break;
        }
        const int cs = training ? check_step(r, epoch, done + 1, n_batches, job_lv, x, stepped) : 0;
        if (cs < 0) {
            rc = cs;
            break;
        }
        st->loss_sum += lv * (double)b;
        if (b > 0 && (rc = count_correct(r, logits, y_cpu, &st->correct, training ? NULL : r->confusion)) < 0) break;
        st->samples += b;
        ampc_scope_end();
        done++;
        /* a bar keeps room for its cells on an 80-column terminal: the running loss only */
        const double seen = st->samples > 0 ? (double)st->samples : 1;
        double run_loss = st->loss_sum / seen, run_acc = 100.0 * (double)st->correct / seen;
        if (p.mode == PROGRESS_BAR) progress_update(&p, done, "loss=%.4f", run_loss);
        else progress_update(&p, done, "loss=%.4f acc=%.2f%%", run_loss, run_acc);
        if (cs > 0) {   /* the grad scaler's guard rails: this batch counted, the pass ends */
            rc = 2;
            break;
        }
    }
    while (ampc_scope_depth() > depth) ampc_scope_end();
    if (!training) ampc_no_grad_exit();
    if (rc < 0 && g_err_status == AMPC_ERR_TIMEOUT)   /* a collective ran out of time: say where the job stood */
        error_where("in epoch %" PRId64 " (%s) at step %" PRId64 " of %" PRId64, epoch + 1, training ? "training" : "validation", done + 1,
                    n_batches);
    if (rc != 0 && p.mode == PROGRESS_BAR) fputc('\n', p.out);   /* the next line starts on its own line */
    if (rc < 0) return rc;
    if (r->world > 1) {   /* the pass's figures are the job's: every rank's samples summed */
        pass_stats c0 = carry ? *carry : (pass_stats){0};
        double v[3] = {st->loss_sum - c0.loss_sum, (double)(st->correct - c0.correct), (double)(st->samples - c0.samples)};
        if (ampc_dist_allreduce_sum_f64(v, 3) < 0) return fail_lib("summing the ranks' figures");
        st->loss_sum = c0.loss_sum + v[0];
        st->correct = c0.correct + (int64_t)v[1];
        st->samples = c0.samples + (int64_t)v[2];
        if (!training && rc == 0 && ampc_dist_allreduce_sum_f64(r->confusion, r->d.num_classes * r->d.num_classes) < 0)
            return fail_lib("summing the ranks' confusion matrices");
    }
    if (rc == 0) progress_end(&p);
    st->seconds = progress_now() - t0;
    st->steps = done;
    st->loss = st->samples ? st->loss_sum / (double)st->samples : NAN;
    st->acc = st->samples ? (double)st->correct / (double)st->samples : NAN;
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Outputs: the --out folder, metrics.csv, loss.png, accuracy.png

static int mkdir_p(const char *path) {
    char *p = strdup(path);
    if (!p) return fail("out of memory");
    for (char *c = p + 1;; c++) {
        if (*c == '/' || *c == '\0') {
            char save = *c;
            *c = '\0';
            if (mkdir(p, 0777) != 0 && errno != EEXIST) {
                int e = errno;
                free(p);
                return fail("--out: can't create '%s': %s", path, strerror(e));
            }
            *c = save;
            if (!save) break;
        }
    }
    free(p);
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode)) return fail("--out '%s' is not a folder", path);
    return 0;
}

static void link_latest(const char *out) {
    const char *slash = strrchr(out, '/');
    char *parent = slash ? strndup(out, (size_t)(slash - out)) : strdup("."), *link = NULL, *tmp = NULL;
    const char *base = slash ? slash + 1 : out;
    struct stat st;
    if (!parent || !(link = path_join(*parent ? parent : "/", "latest")) || asprintf(&tmp, "%s.tmp.%ld", link, (long)getpid()) < 0) {
        tmp = NULL;
        warn("out of memory: %s/latest not updated", parent ? parent : ".");
    } else if (lstat(link, &st) == 0 && !S_ISLNK(st.st_mode)) {
        warn("%s is not a link (an older ampc-train's run?): left as it is; this run is %s", link, out);
    } else if ((unlink(tmp), symlink(base, tmp)) != 0 || rename(tmp, link) != 0) {
        warn("can't point %s at %s: %s", link, out, strerror(errno));
        unlink(tmp);
    }
    free(tmp);
    free(link);
    free(parent);
}

int out_make(settings *s) {
    int rc = 0;
    if (s->dated) {   /* runs/<date>-<time>[-k]: mkdir(2) fails on a folder that exists */
        const char *stamp = sval(s, OPT_OUT), *slash = strrchr(stamp, '/');
        char *root = slash ? strndup(stamp, (size_t)(slash - stamp)) : strdup("."), *dir = NULL;
        if (!root) return fail("out of memory");
        rc = mkdir_p(root);
        for (int k = 1; rc == 0; k++) {
            free(dir);
            if (asprintf(&dir, k == 1 ? "%s" : "%s-%d", stamp, k) < 0) {
                dir = NULL;
                rc = fail("out of memory");
            } else if (mkdir(dir, 0777) == 0) {
                rc = set_val(s, OPT_OUT, dir);
                break;
            } else if (errno != EEXIST || k == 1000) {
                rc = fail("--out: can't create '%s': %s", dir, strerror(errno));
            }
        }
        free(dir);
        free(root);
        s->dated = false;
    } else {
        rc = mkdir_p(sval(s, OPT_OUT));
    }
    if (rc == 0 && s->link_latest) link_latest(sval(s, OPT_OUT));
    s->link_latest = false;
    return rc;
}

/* What an ampc-train run writes in --out; a folder with any of the first N_RUN_MARKS holds a run. */
static const char *const RUN_FILES[] = {"metrics.csv", "checkpoint.safetensors", "model.safetensors", "diverged.safetensors",
                                        "steps.csv", "numerics.csv", "confusion.csv", "loss.png", "accuracy.png", "scale.png",
                                        "steps.png", "events.out.tfevents.*"};
enum { N_RUN_MARKS = 5, N_RUN_FILES = sizeof RUN_FILES / sizeof *RUN_FILES };

/* A new run (or one resumed into another folder) never takes over a folder that holds a run,
   unless --overwrite yes deletes that run's files first. Only regular files count and go: a link
   or a FIFO planted under such a name is refused later, by the code that opens it. Called with
   the folder locked. */
static int out_check(run *r) {
    const settings *s = r->s;
    struct stat a, b;
    const char *res = sval(s, OPT_RESUME);
    if (*res) {   /* resuming in the checkpoint's own folder: that run is this one */
        const char *slash = strrchr(res, '/');
        char *dir = slash ? strndup(res, (size_t)(slash - res)) : strdup(".");
        bool same = dir && stat(*dir ? dir : "/", &a) == 0 && stat(r->out, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
        free(dir);
        if (same) return 0;
    }
    const bool overwrite = yes(s, OPT_OVERWRITE);
    for (int i = 0; i < N_RUN_FILES; i++) {
        char *pat = path_join(r->out, RUN_FILES[i]);
        if (!pat) return -1;
        glob_t g;
        int found = glob(pat, GLOB_NOSORT, NULL, &g) == 0 ? (int)g.gl_pathc : 0, rc = 0;
        free(pat);
        for (int k = 0; k < found && rc == 0; k++) {
            if (lstat(g.gl_pathv[k], &a) != 0 || !S_ISREG(a.st_mode)) continue;
            if (!overwrite && i < N_RUN_MARKS)
                rc = fail("--out '%s' holds an earlier run (%s): give a new --out or --name, --resume its checkpoint to "
                          "continue it, or --overwrite yes to replace it",
                          r->out, RUN_FILES[i]);
            else if (overwrite && unlink(g.gl_pathv[k]) != 0 && errno != ENOENT)
                rc = fail("--overwrite: can't delete '%s': %s", g.gl_pathv[k], strerror(errno));
        }
        if (found) globfree(&g);
        if (rc < 0) return rc;
    }
    return 0;
}

/* Two runs writing one --out would mix their files: the first takes an exclusive flock(2) on
   <out>/ampc-train.lock (released however the process ends; the file stays) and writes its pid
   there; the second says who holds it. Rank 0 alone writes --out, so it alone locks. */
static int lock_out(run *r) {
    char *path = path_join(r->out, "ampc-train.lock");
    if (!path) return -1;
    FILE *f = ampc_output_fopen(path, "--out lock", "a+");   /* never truncated before it is ours */
    int rc = 0;
    if (!f) {
        rc = fail_lib("--out");
    } else if (flock(fileno(f), LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        long pid = 0;
        rewind(f);
        if (fscanf(f, "%ld", &pid) != 1) pid = 0;   /* the holder may not have written it yet */
        char who[48] = "another process";
        if (pid > 0) snprintf(who, sizeof who, "another " PROG " (pid %ld)", pid);
        rc = e == EWOULDBLOCK ? fail("--out '%s' is in use: %s holds %s; give another --out or wait for it to end", r->out, who, path)
                              : fail("--out '%s': can't lock %s: %s", r->out, path, strerror(e));
        fclose(f);
    } else if (ftruncate(fileno(f), 0) != 0 || fprintf(f, "%ld\n", (long)getpid()) < 0 || fflush(f) != 0) {
        rc = fail("--out '%s': can't write %s: %s", r->out, path, strerror(errno));
        fclose(f);
    } else {
        r->out_lock = f;
    }
    free(path);
    return rc;
}

char *path_join(const char *dir, const char *name) {
    char *p = NULL;
    if (asprintf(&p, "%s/%s", dir, name) < 0) {
        fail("out of memory");
        return NULL;
    }
    return p;
}

static int draw_plots(run *r) {
    if (r->rank > 0) return 0;
    int n = r->hist.n;
    double *x = malloc((size_t)(n ? n : 1) * 5 * sizeof *x);
    if (!x) return fail("out of memory");
    double *tl = x + n, *vl = x + 2 * n, *ta = x + 3 * n, *va = x + 4 * n;
    for (int e = 0; e < n; e++) {
        x[e] = r->hist.rows[e][COL_EPOCH];
        tl[e] = r->hist.rows[e][COL_TRAIN_LOSS];
        vl[e] = r->hist.rows[e][COL_VAL_LOSS];
        ta[e] = 100 * r->hist.rows[e][COL_TRAIN_ACC];
        va[e] = 100 * r->hist.rows[e][COL_VAL_ACC];
    }
    char title[256];
    const char *prec = r->use_amp ? (r->amp_dtype == AMPC_BF16 ? "AMP bf16" : "AMP fp16") : "fp32";
    const char *what = r->d.folder ? "image folder" : strstr(r->d.desc, "Fashion") ? "Fashion-MNIST" : "IDX data";
    int rc = 0;
    char *loss_png = path_join(r->out, "loss.png"), *acc_png = path_join(r->out, "accuracy.png");
    if (!loss_png || !acc_png) rc = -1;
    snprintf(title, sizeof title, "%s on %s (%s): loss", sval(r->s, OPT_MODEL), what, prec);
    plot_series ls[2] = {{"train", x, tl, n, false}, {"validation", x, vl, n, false}};
    if (rc == 0 && plot_curves(loss_png, title, "epoch", "cross-entropy loss", ls, 2) < 0) rc = fail_lib("loss.png");
    snprintf(title, sizeof title, "%s on %s (%s): accuracy", sval(r->s, OPT_MODEL), what, prec);
    plot_series as[2] = {{"train", x, ta, n, false}, {"validation", x, va, n, false}};
    if (rc == 0 && plot_curves(acc_png, title, "epoch", "accuracy (%)", as, 2) < 0) rc = fail_lib("accuracy.png");
    snprintf(title, sizeof title, "%s on %s (%s)", sval(r->s, OPT_MODEL), what, prec);
    if (rc == 0) rc = steplog_plot(r, title);
    free(loss_png);
    free(acc_png);
    free(x);
    return rc;
}

/* metrics.csv with the header and the history so far: on --resume the rows of the finished
   epochs come from the checkpoint, so the file matches the weights even if it was lost. */
static int open_metrics(run *r) {
    if (r->rank > 0) return 0;
    char *path = path_join(r->out, "metrics.csv");
    if (!path) return -1;
    r->metrics = ampc_metrics_open(path, COLS, N_COLS, false);
    free(path);
    if (!r->metrics) return fail_lib("metrics.csv");
    for (int e = 0; e < r->hist.n; e++)
        if (ampc_metrics_row(r->metrics, r->hist.rows[e]) < 0) return fail_lib("metrics.csv");
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Out of memory under --max-memory: what took the memory, and the largest batch that fits

/* Bytes above the fixed state (weights, optimizer state, weight casts) at the peak of one forward
   and backward pass of a batch of b zero images, with the run's autocast setting. */
static double probe_step_bytes(run *r, int64_t b, double grad_bytes) {
    ampc_optimizer_zero_grad(r->opt);
    ampc_memory_stats_t m0 = ampc_memory_stats();
    double fixed = (double)(m0.current[AMPC_MEM_PARAMETERS] + m0.current[AMPC_MEM_OPTIMIZER] + m0.current[AMPC_MEM_CASTS]);
    ampc_memory_reset_peak();
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){b, r->d.c, r->d.h, r->d.w});
    ampc_tensor *y = ampc_tensor_zeros(AMPC_I64, 1, (int64_t[]){b});
    ampc_autocast_enter(r->amp_dtype, r->use_amp);
    ampc_tensor *loss = x && y ? ampc_cross_entropy(ampc_module_forward(r->net, x), y, NULL) : NULL;
    ampc_autocast_exit();
    int rc = loss ? ampc_backward(loss) : -1;
    ampc_scope_end();
    ampc_memory_stats_t m1 = ampc_memory_stats();
    ampc_optimizer_zero_grad(r->opt);
    /* the casts a forward pass makes are fixed state too (kept across steps) */
    fixed += (double)(m1.current[AMPC_MEM_CASTS] - m0.current[AMPC_MEM_CASTS]);
    return rc < 0 ? -1 : (double)m1.peak_total - fixed - grad_bytes;
}

/* After an out-of-memory error in training under a limit: measure a step's activations at two
   batch sizes (limit lifted for the probe; the run is over anyway), then name the fixed state and
   the largest batch that fits. */
static void oom_advice(run *r, double limit) {
    static char advice[1024];   /* g_oom_hint points here once measured */
    const char *optname = sval(r->s, OPT_OPTIMIZER);
    /* fp32 master weights, all of them (frozen ones too); gradients and optimizer state for the
       trainable ones only (--freeze) */
    double W = 4.0 * (double)ampc_module_num_parameters(r->net, false), P = 4.0 * (double)ampc_module_num_parameters(r->net, true);
    double opt = strcmp(optname, "sgd") == 0 ? (rval(r->s, OPT_MOMENTUM) > 0 ? P : 0) : 2 * P;
    ampc_memory_set_limit((size_t)r->host_limit);   /* the probes may go past the limit, not past the machine */
    double cast0 = (double)ampc_memory_stats().current[AMPC_MEM_CASTS];
    double t2 = probe_step_bytes(r, 2, P), t4 = probe_step_bytes(r, 4, P);
    double casts = (double)ampc_memory_stats().current[AMPC_MEM_CASTS];
    if (casts < cast0) casts = cast0;
    ampc_memory_set_limit((size_t)limit);
    if (t2 < 0 || t4 <= t2) return;   /* no measurement: keep the plain hint */
    double per = (t4 - t2) / 2, fixed = W + P + opt + casts, room = limit - fixed;
    /* the linear estimate from batches 2 and 4 is only a start: allocator rounding and kernels'
       workspaces grow unevenly (a ResNet-50 needed 12% more per sample at 80 than at 4), so probe
       the candidate and narrow down between the largest batch that fitted and the smallest that
       did not, along the line through the last two probes */
    int64_t good = t4 <= room ? 4 : t2 <= room ? 2 : 0, bad = INT64_MAX;
    int64_t pb = 4, fit = good;
    double pt = t4;
    int64_t cand = per > 0 && room > pt ? pb + (int64_t)floor((room - pt) / per) : 0;
    if (good >= 4) fprintf(stderr, PROG ": out of memory: measuring the largest batch that fits --max-memory ...\n");
    for (int probes = 0; good >= 4 && probes < 5 && cand > good && cand < bad; probes++) {
        ampc_memory_set_limit((size_t)r->host_limit);
        double t = probe_step_bytes(r, cand, P);
        ampc_memory_set_limit((size_t)limit);
        if (t < 0) break;
        if (t <= room) good = cand;
        else bad = cand;
        double slope = (t - pt) / (double)(cand - pb);
        pb = cand;
        pt = t;
        if (bad - good <= 1 + good / 64) break;   /* within 1.5% */
        int64_t next = slope > 0 ? pb + (int64_t)floor((room - pt) / slope) : good + 1;
        cand = next <= good ? good + 1 : next >= bad ? bad - 1 : next;
    }
    fit = good;
    char a[32], b[32], c[32], d[32], e[32], f[32];
    int n = snprintf(advice, sizeof advice,
                     "of --max-memory %s, the weights take %s, %s gradients %s, %s's state %s%s%s, and each sample about %s of "
                     "activations (measured)",
                     fmt_bytes(limit, a, sizeof a), fmt_bytes(W, b, sizeof b), P < W ? "the trainable ones'" : "their",
                     fmt_bytes(P, c, sizeof c), optname,
                     fmt_bytes(opt, d, sizeof d), casts > 0 ? ", autocast's weight copies " : "", casts > 0 ? fmt_bytes(casts, e, sizeof e) : "",
                     fmt_bytes(per, f, sizeof f));
    if (n < 0 || (size_t)n >= sizeof advice) return;
    if (fit >= 1)
        snprintf(advice + n, sizeof advice - (size_t)n, ": the largest batch that fits is %" PRId64 " (--batch-size %" PRId64 ", measured)%s",
                 fit, fit, r->use_amp ? "" : ", or more with --use-amp yes (16-bit activations)");
    else
        snprintf(advice + n, sizeof advice - (size_t)n, ": not even a batch of 1 fits; %s",
                 opt >= P && opt > 0 ? "the optimizer's state is the largest part: try --optimizer sgd --momentum 0 (no state), or raise --max-memory"
                                     : "raise --max-memory or choose a smaller --model");
    g_oom_hint = advice;
}

// ---------------------------------------------------------------------------------------------
// The run

/* A signal stopped the run after its checkpoint was saved: one line saying where, and how to go on;
   exit status 128 + the signal's number, as a shell reports a process the signal ended. */
static int interrupted(run *r) {
    const int sig = g_signal;
    fail("%s: saved %s; continue with: " PROG " --resume %s", sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "signal",
         r->last_good, r->ckpt_path);
    g_interrupt = true;
    g_exit = 128 + sig;
    return -1;
}

/* --stop-after-steps: the same checkpoint as for a signal, and a clean exit. */
static int stopped(run *r) {
    printf("stopped after %" PRId64 " training step(s) (--stop-after-steps): saved %s; continue with: " PROG " --resume %s\n",
           r->steps_run, r->last_good, r->ckpt_path);
    fflush(stdout);
    return 0;
}

static void print_memory(const ampc_memory_stats_t *ms, const char *indent) {
    char b[32];
    printf("%speak memory: %s (", indent, fmt_bytes((double)ms->peak_total, b, sizeof b));
    for (int k = 0; k < AMPC_MEM_KIND_COUNT; k++)
        printf("%s%s %s", k ? ", " : "", ampc_mem_kind_name((ampc_mem_kind)k), fmt_bytes((double)ms->peak[k], b, sizeof b));
    printf(")\n");
}

int train_run(settings *s, run_result *res) {
    memset(res, 0, sizeof *res);
    run r = {.s = s};
    int rc = 0;
    /* the checkpoint holds the run's own weights: a --pretrained file would be ignored or would
       overwrite them, neither of which a user means */
    if (*sval(s, OPT_RESUME) && *sval(s, OPT_PRETRAINED)) {
        rc = usage_error("--pretrained starts a new run from those weights; --resume continues from the checkpoint's own: give one of them");
        goto done;
    }
    if (yes(s, OPT_EVAL_ONLY) && !*sval(s, OPT_RESUME) && !*sval(s, OPT_PRETRAINED)) {
        rc = usage_error("--eval-only evaluates a trained model: give its checkpoint (--resume FILE) or its weights (--pretrained FILE)");
        goto done;
    }
    if (*sval(s, OPT_RESUME) && (rc = resume_settings(s, &r.meta)) < 0) goto done;
    if ((rc = agree_settings(&r)) < 0 || (rc = run_build(&r)) < 0) goto done;
    if (ampc_autocast_fp32_modules(sval(s, OPT_FP32_MODULES)) < 0) {
        rc = usage_error("--fp32-modules: %s", ampc_last_error());
        goto done;
    }
    if (*sval(s, OPT_RESUME) && (rc = resume_state(&r)) < 0) goto done;
    if ((rc = agree_built(&r)) < 0) goto done;
    /* data-parallel: rank 0's weights and buffers everywhere, and gradients averaged from here on */
    if (r.world > 1 && !(r.ddp = ampc_ddp_new(r.net, NULL))) {
        rc = fail_lib("data-parallel model");
        goto done;
    }
    if (ival(s, OPT_ZERO) == 1 && r.world == 1) warn("--zero 1: one process, nothing to shard");
    if (ival(s, OPT_ZERO) == 1 && r.world > 1 && ampc_zero_shard(r.opt, &r.zero_here, &r.zero_all) < 0) {
        rc = fail_lib("--zero 1");
        goto done;
    }
    g_oom_hint = "try a smaller --batch-size or --use-amp yes";
    print_setup(&r);
    if (yes(s, OPT_EVAL_ONLY)) {   /* the model as loaded, on the validation data, and nothing else */
        pass_stats va;
        int pr = run_pass(&r, false, r.epoch0, &va, NULL);
        if (pr != 0) {
            rc = pr < 0 ? -1 : interrupted(&r);
            goto done;
        }
        printf("evaluation: %" PRId64 " validation samples, loss %.4f, accuracy %.2f%%\n", va.samples, va.loss, 100 * va.acc);
        r.confusion_valid = va.samples > 0;
        if (r.confusion_valid) print_per_class(&r);
        res->val_loss = va.loss;
        res->val_acc = va.acc;
        res->ok = true;
        goto done;
    }
    int64_t n_epochs = ival(s, OPT_EPOCHS);
    if (*sval(s, OPT_RESUME)) {
        if (r.resume_step > 0)
            printf("resumed from %s in epoch %" PRId64 " after step %" PRId64 " of %" PRId64 " (sample %" PRId64 " of %" PRId64 ")\n",
                   sval(s, OPT_RESUME), r.epoch0 + 1, r.resume_step,
                   r.resume_step + ampc_loader_count_batches(r.train_ld, r.resume_train.samples), r.resume_train.samples,
                   ampc_dataset_size(r.d.train));
        else
            printf("resumed from %s after epoch %" PRId64 "\n", sval(s, OPT_RESUME), r.epoch0);
        int64_t global = ival(s, OPT_BATCH_SIZE) * r.world;
        if (global != r.saved_global_batch) {
            char hint[96] = "";
            if (r.saved_global_batch % r.world == 0)
                snprintf(hint, sizeof hint, " (--batch-size %" PRId64 " keeps it)", r.saved_global_batch / r.world);
            printf("note: global batch %" PRId64 " on %d process(es), the checkpoint's was %" PRId64 " on %" PRId64
                   ": the steps from here are not those the run took so far%s\n",
                   global, r.world, r.saved_global_batch, r.saved_world, hint);
        }
        if (n_epochs > 0 && n_epochs < r.epoch0 + (r.resume_step > 0)) {
            rc = r.resume_step > 0 ? fail("--epochs %" PRId64 ": the checkpoint is in epoch %" PRId64 " already", n_epochs, r.epoch0 + 1)
                                   : fail("--epochs %" PRId64 ": the checkpoint has finished %" PRId64 " epochs already", n_epochs, r.epoch0);
            goto done;
        }
    }
    if (n_epochs == 0) {
        res->ok = true;
        goto done;
    }
    if (r.rank == 0 && (rc = out_make(s)) < 0) goto done;
    if (!(r.out = strdup(sval(s, OPT_OUT)))) {
        rc = fail("out of memory");
        goto done;
    }
    if (r.rank == 0 && ((rc = lock_out(&r)) < 0 || (rc = out_check(&r)) < 0)) goto done;
    if (!(r.ckpt_path = path_join(r.out, "checkpoint.safetensors")) || !(r.model_path = path_join(r.out, "model.safetensors")) ||
        !(r.diverged_path = path_join(r.out, "diverged.safetensors")) ||
        (rc = open_metrics(&r)) < 0 || (rc = steplog_open(&r)) < 0 || (rc = tensorboard_open(&r)) < 0) {
        rc = -1;
        goto done;
    }
    if (r.rank == 0) {   /* a kill mid-save left them: never renamed */
        ampc_checkpoint_remove_stale_temps(r.ckpt_path);
        ampc_checkpoint_remove_stale_temps(r.model_path);
        ampc_checkpoint_remove_stale_temps(r.diverged_path);
    }
    printf("outputs: %s/{metrics.csv,loss.png,accuracy.png,checkpoint.safetensors,model.safetensors}\n", r.out);
    fflush(stdout);

    if (yes(s, OPT_DOCTOR)) ampc_doctor_enable(true);
    if ((rc = numerics_open(&r)) < 0) goto done;
    ampc_memory_reset_peak();
    double t0 = progress_now();
    r.skipped_seen = ampc_scaler_steps_skipped(r.scaler);
    stop_signals_install(true);
    for (int64_t e = r.epoch0; e < n_epochs; e++) {
        bool cont = e == r.epoch0 && r.resume_step > 0;   /* an epoch a signal interrupted */
        double te = progress_now() - (cont ? r.resume_epoch_seconds : 0);
        if (!cont) r.epoch_skipped0 = ampc_scaler_steps_skipped(r.scaler);
        pass_stats tr, va;
        int pr = run_pass(&r, true, e, &tr, cont ? &r.resume_train : NULL);
        if (pr == 0) pr = check_epoch_applied(&r, e, &tr);
        if (pr == 0) pr = run_pass(&r, false, e, &va, NULL);
        if (pr == 0 && va.samples > 0) {
            if (write_confusion(&r) < 0) pr = -1;
            else r.confusion_valid = true;
        }
        /* the weights give NaN on the validation data: they are not a good checkpoint */
        if (pr == 0 && va.samples > 0 && !isfinite(va.loss)) pr = diverged(&r, e, 0, 0, "the validation loss is %g", va.loss);
        if (pr < 0) {
            if (g_err_status == AMPC_ERR_OOM && strcmp(sval(s, OPT_MAX_MEMORY), "none") != 0) oom_advice(&r, rval(s, OPT_MAX_MEMORY));
            rc = -1;
            goto done;
        }
        if (pr == 2) {   /* the grad scaler gave up: save where it stopped, apart from the last good checkpoint */
            rc = diverged_save(&r, e, &tr, progress_now() - te);
            goto done;
        }
        if (pr > 0) {   /* a signal: save where training stands (validation is redone on resume) */
            if ((rc = save_checkpoint(&r, e, tr.steps, &tr, progress_now() - te)) == 0) rc = r.stop_asked ? stopped(&r) : interrupted(&r);
            goto done;
        }
        double secs = progress_now() - te;
        double row[N_COLS] = {[COL_EPOCH] = (double)(e + 1),
                              [COL_TRAIN_LOSS] = tr.loss,
                              [COL_TRAIN_ACC] = tr.acc,
                              [COL_VAL_LOSS] = va.loss,
                              [COL_VAL_ACC] = va.acc,
                              [COL_SECONDS] = secs,
                              [COL_SPS] = tr.seconds > 0 ? (double)tr.samples / tr.seconds : 0,
                              [COL_SCALE] = ampc_scaler_get_scale(r.scaler),
                              [COL_SKIPPED] = (double)(ampc_scaler_steps_skipped(r.scaler) - r.epoch_skipped0),
                              [COL_DATA_WAIT] = tr.seconds > 0 ? tr.data_seconds / tr.seconds : 0};
        char c1[32];
        printf("epoch %" PRId64 "/%" PRId64 ": train loss %.4f acc %.2f%% | val loss %.4f acc %.2f%% | %.1f s (train %.1f s, %s samples/s, "
               "%.1f ms/step, data wait %.1f%%)",
               e + 1, n_epochs, tr.loss, 100 * tr.acc, va.loss, 100 * va.acc, secs, tr.seconds, fmt_count((int64_t)row[COL_SPS], c1, sizeof c1),
               tr.steps ? 1e3 * tr.seconds / (double)tr.steps : 0.0, 100 * row[COL_DATA_WAIT]);
        if (ampc_scaler_is_enabled(r.scaler)) printf(" | scale %g, %.0f skipped", row[COL_SCALE], row[COL_SKIPPED]);
        if (r.scheduled) printf(" | lr %.4g", ampc_optimizer_get_lr(r.opt));
        printf("\n");
        fflush(stdout);
        /* the checkpoint first: after a kill between the two, resume rewrites metrics.csv from the
           checkpoint's history, so the file never runs ahead of what resume continues from */
        if ((rc = history_push(&r.hist, row)) < 0 || (rc = save_checkpoint(&r, e + 1, 0, NULL, 0)) < 0) goto done;
        if (r.rank == 0 && ampc_metrics_row(r.metrics, row) < 0) {
            rc = fail_lib("metrics.csv");
            goto done;
        }
        if ((rc = tensorboard_epoch(&r, row)) < 0 || (rc = draw_plots(&r)) < 0) goto done;
        res->epochs_run++;
        res->samples += tr.samples;
        res->train_seconds += tr.seconds;
        res->data_seconds += tr.data_seconds;
        if (g_signal && e + 1 < n_epochs) {   /* arrived during the save: it is done */
            rc = interrupted(&r);
            goto done;
        }
    }
    if (r.epoch0 >= n_epochs) {   /* nothing left to train: rewrite the outputs from the checkpoint */
        printf("nothing to train: the checkpoint has finished %" PRId64 " of %" PRId64 " epochs\n", r.epoch0, n_epochs);
        if ((rc = draw_plots(&r)) < 0 || (rc = save_checkpoint(&r, r.epoch0, 0, NULL, 0)) < 0) goto done;
    }
    if ((rc = numerics_report(&r)) < 0) goto done;
    res->seconds = progress_now() - t0;
    ampc_memory_stats_t ms = ampc_memory_stats();
    res->peak_total = (double)ms.peak_total;
    for (int k = 0; k < AMPC_MEM_KIND_COUNT; k++) res->peak[k] = (double)ms.peak[k];
    res->scale = ampc_scaler_get_scale(r.scaler);
    res->skipped = ampc_scaler_steps_skipped(r.scaler);
    res->samples_per_s = res->train_seconds > 0 ? (double)res->samples / res->train_seconds : 0;
    if (r.hist.n) {
        const double *last = r.hist.rows[r.hist.n - 1];
        res->train_loss = last[COL_TRAIN_LOSS];
        res->train_acc = last[COL_TRAIN_ACC];
        res->val_loss = last[COL_VAL_LOSS];
        res->val_acc = last[COL_VAL_ACC];
    }

    char t[32], c1[32];
    printf("summary: %" PRId64 " epoch(s) in %s (%.1f s/epoch), %s training samples/s, data wait %.1f%%\n", res->epochs_run,
           progress_format_time(res->seconds, t, sizeof t), res->epochs_run ? res->seconds / (double)res->epochs_run : 0.0,
           fmt_count((int64_t)res->samples_per_s, c1, sizeof c1),
           res->train_seconds > 0 ? 100 * res->data_seconds / res->train_seconds : 0.0);
    print_memory(&ms, "  ");
    if (ampc_scaler_is_enabled(r.scaler))
        printf("  grad scaler: %" PRId64 " skipped steps of %" PRId64 ", final scale %g\n", ampc_scaler_steps_skipped(r.scaler),
               ampc_scaler_steps_applied(r.scaler) + ampc_scaler_steps_skipped(r.scaler), (double)res->scale);
    else
        printf("  grad scaler: off (0 skipped steps, scale 1)\n");
    printf("  final: train loss %.4f acc %.2f%% | validation loss %.4f acc %.2f%%\n", res->train_loss, 100 * res->train_acc,
           res->val_loss, 100 * res->val_acc);
    if (r.confusion_valid) print_per_class(&r);
    printf("  outputs: %s\n", r.out);
    res->ok = true;
done:
    if (r.explaining) {   /* stopped inside the explained step: the recording ends unprinted */
        ampc_explain_row *rows = NULL;
        ampc_explain_end(&rows);
        free(rows);
    }
    if (r.numerics) {   /* an error or a stop: the collection ends unreported */
        ampc_numerics_row *rows = NULL;
        ampc_numerics_end(&rows);
        free(rows);
    }
    ampc_doctor_enable(false);
    ampc_autocast_fp32_modules(NULL);
    stop_signals_install(false);
    run_free(&r);
    return rc;
}

