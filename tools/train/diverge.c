/*
 * diverge.c - a run that trains on garbage stops instead of overwriting its good checkpoint: the
 * checks after each training step and epoch (the loss, --max-loss, the grad scaler's guard rails),
 * the checkpoint that replaces the last one only when the weights and optimizer state are finite,
 * and, where the grad scaler gave up, the save to diverged.safetensors with the remedies to
 * resume it with (exit status 3).
 */
#include "train.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>

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
int diverged(run *r, int64_t epoch, int64_t step, int64_t n_steps, const char *fmt, ...) {
    char why[640];
    va_list ap;
    va_start(ap, fmt);
    where_why(why, sizeof why, epoch, step, n_steps, fmt, ap);
    va_end(ap);
    fail("training diverged %s; stopped without saving: %s%s (try a lower --lr)", why,
         r->stop.last_good[0] ? "the last good checkpoint is " : "no checkpoint was written", r->stop.last_good);
    g_exit = EXIT_DIVERGED;
    g_job_error = r->world > 1;   /* the job's loss and the replicas' weights: every rank stops here together */
    return -1;
}

/* The grad scaler's guard rails tripped: the scaler's state is the job's, the same on every rank,
   so all stop at this step. Records where and why (r->stop.diverged_why) and returns 1: the pass ends
   after this batch and the run saves where it stopped (diverged_save). */
static int scaler_diverged(run *r, int64_t epoch, int64_t step, int64_t n_steps, const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static int scaler_diverged(run *r, int64_t epoch, int64_t step, int64_t n_steps, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    where_why(r->stop.diverged_why, sizeof r->stop.diverged_why, epoch, step, n_steps, fmt, ap);
    va_end(ap);
    return 1;
}

/* After a training batch: the loss and, when it ended an optimizer step, the grad scaler's skips
   and scale. x is the batch. Returns 0, 1 when the scaler's guard rails stop the run (see
   scaler_diverged), or -1 (an error, or a divergence that stops without saving). */
int check_step(run *r, int64_t epoch, int64_t step, int64_t n_steps, double loss, ampc_tensor *x, bool stepped) {
    int64_t sk = ampc_scaler_steps_skipped(r->m.scaler);
    r->stop.skipped_in_a_row = sk > r->stop.skipped_seen ? r->stop.skipped_in_a_row + (sk - r->stop.skipped_seen) : 0;
    r->stop.skipped_seen = sk;
    bool scaled = ampc_scaler_is_enabled(r->m.scaler);
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
    float scale = ampc_scaler_get_scale(r->m.scaler);
    double min_scale = rval(r->s, OPT_MIN_LOSS_SCALE);
    char blame[520];   /* what the doctor blames: computed only for a run that stops */
    if (max_skip > 0 && r->stop.skipped_in_a_row >= max_skip)
        return scaler_diverged(r, epoch, step, n_steps, "the grad scaler skipped %" PRId64 " steps in a row (inf/NaN gradients down to scale %g; "
                               "--max-skipped-steps %" PRId64 ")%s", r->stop.skipped_in_a_row, (double)scale, max_skip,
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
int check_epoch_applied(run *r, int64_t epoch, const pass_stats *tr) {
    const int64_t accum = ival(r->s, OPT_ACCUMULATE), steps = (tr->steps + accum - 1) / accum;
    const int64_t skipped = ampc_scaler_steps_skipped(r->m.scaler) - r->stop.epoch_skipped0;
    if (!ampc_scaler_is_enabled(r->m.scaler) || steps == 0 || skipped < steps) return 0;
    char blame[520];
    scaler_diverged(r, epoch, 0, 0, "the grad scaler skipped all %" PRId64 " optimizer step(s) of the epoch (inf/NaN "
                    "gradients down to scale %g): not one was applied%s", steps, (double)ampc_scaler_get_scale(r->m.scaler),
                    doctor_blame(blame, sizeof blame));
    return 2;
}

/* NaN/inf values in the weights and buffers (*model) and in the optimizer's state (*opt). */
static int count_nonfinite_state(run *r, int64_t *model, int64_t *opt) {
    ampc_tensor **sd;
    int n = ampc_module_state_dict(r->m.net, &sd, NULL);
    if (n < 0) return fail_lib("checking the weights");
    *model = 0;
    for (int i = 0; i < n; i++) {
        int64_t b = ampc_tensor_count_nonfinite(sd[i]);
        if (b < 0) return fail_lib("checking the weights");
        *model += b;
    }
    *opt = ampc_optimizer_count_nonfinite(r->m.opt);
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
    const bool fp16 = r->m.use_amp && r->m.amp_dtype == AMPC_F16, bf16_ok = ampc_dtype_supported(r->m.device, AMPC_BF16);
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
    if (r->m.use_amp) remedy(buf, n, &at, first, fn, "--use-amp no", "--use-amp no (fp32 throughout)");
    return buf;
}

/* The grad scaler's guard rails stopped the run, every rank at the same step. Skipped steps change
   nothing but the scaler, so the weights and optimizer state are those of the last applied step:
   unless they hold NaN/inf they are saved where training stopped, to diverged.safetensors beside
   the last good checkpoint (which stays as it was), and the message says what to resume it with.
   Exit status 3. */
int diverged_save(run *r, int64_t epoch, const pass_stats *tr, double epoch_seconds) {
    int64_t model, opt;
    if (count_nonfinite_state(r, &model, &opt) < 0) return -1;
    const char *path = r->out.diverged_path;
    const bool finite = model == 0 && opt == 0;
    if (finite && r->m.zero_all > 0 && ampc_zero_consolidate(r->m.opt) < 0) return fail_lib("gathering the sharded optimizer state");
    if (finite && r->rank == 0 && checkpoint_save(r, path, r->stop.diverged_why, epoch, tr->steps, tr, epoch_seconds) < 0) return -1;
    char saved[4400], rem[1024], first[320], example[4800] = "";
    if (finite) snprintf(saved, sizeof saved, "saved where it stopped to %s (the weights of the last applied step)", path);
    else snprintf(saved, sizeof saved, "not saved: the weights and buffers hold %" PRId64 " NaN/inf value(s) (the optimizer's "
                  "state %" PRId64 ")", model, opt);
    remedies(r, rem, sizeof rem, first, sizeof first);
    if (finite) snprintf(example, sizeof example, ", e.g. " PROG " --resume %s %s", path, first);
    fail("training diverged %s; %s; %s%s. Remedies: %s. They may be given on --resume%s", r->stop.diverged_why, saved,
         r->stop.last_good[0] ? "the last good checkpoint is " : "no good checkpoint was written before", r->stop.last_good, rem, example);
    g_exit = EXIT_DIVERGED;
    g_job_error = true;
    return -1;
}

/* The checkpoint replaces the last one (meta.c) unless the weights or optimizer state hold NaN/inf
   (diverged): the epoch just trained is checked. */
int save_checkpoint(run *r, int64_t epochs_done, int64_t step, const pass_stats *partial, double epoch_seconds) {
    if (check_finite_state(r, step > 0 || epochs_done == 0 ? epochs_done : epochs_done - 1) < 0) return -1;
    /* --zero 1: the whole optimizer state on rank 0 for the file (any number of ranks resumes it) */
    if (r->m.zero_all > 0 && ampc_zero_consolidate(r->m.opt) < 0) return fail_lib("gathering the sharded optimizer state");
    /* data-parallel: rank 0 writes, the replicas are the same */
    int rc = r->rank > 0 ? 0 : checkpoint_save(r, r->out.ckpt_path, NULL, epochs_done, step, partial, epoch_seconds);
    /* the model's state_dict alone beside it, as PyTorch's torch.save(model.state_dict()):
       load_state_dict(strict=True) takes it as it is (--resume reads the checkpoint) */
    if (rc == 0 && r->rank == 0 && ampc_checkpoint_save(r->out.model_path, r->m.net, NULL, NULL, NULL) < 0) rc = fail_lib("saving model.safetensors");
    if (r->m.zero_all > 0 && ampc_zero_shard(r->m.opt, NULL, NULL) < 0 && rc == 0) rc = fail_lib("sharding the optimizer state");
    return rc;
}
