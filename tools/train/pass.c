/*
 * pass.c - one pass over a loader: training (autocast forward, scaled backward, the optimizer step
 * through the grad scaler, --accumulate groups, data-parallel gradients) or validation (eval mode,
 * no-grad, autocast), counting correct answers and, in validation, the confusion matrix. A pass
 * stops at a step boundary for a signal or --stop-after-steps, and after the batch where the
 * grad scaler's guard rails trip.
 */
#include "train.h"
#include "progress.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>

ampc_tensor *model_loss(run *r, ampc_tensor *x, ampc_tensor *y, const ampc_cross_entropy_options *o, ampc_tensor **logits) {
    ampc_tensor *out = ampc_module_forward(r->m.net, x);
    if (out && r->d.block) {   /* every position's next-token loss */
        out = ampc_reshape(out, 2, (int64_t[]){ampc_tensor_dim(out, 0) * ampc_tensor_dim(out, 1), ampc_tensor_dim(out, 2)});
        y = ampc_reshape(y, 1, (int64_t[]){ampc_tensor_numel(y)});
    }
    if (logits) *logits = out;
    return out ? ampc_cross_entropy(out, y, o) : NULL;
}

/* Number of rows of logits (N, C) whose argmax (the first maximum) equals the label (labels: N
   values on the CPU); with confusion (C, C), each row also counted at (label, argmax). The rows
   are read t->logits_rows at a time (a language model's N x vocabulary would not fit). */
static int count_correct(run_tally *t, ampc_tensor *logits, ampc_tensor *labels, int64_t *correct, double *confusion) {
    const int64_t n = ampc_tensor_dim(logits, 0), c = ampc_tensor_dim(logits, 1);
    const int64_t *y = ampc_tensor_cdata(labels);
    int rc = 0;
    ampc_no_grad_enter();   /* the blocks read below record no history */
    for (int64_t at = 0; at < n && rc == 0; at += t->logits_rows) {
        const int64_t m = n - at < t->logits_rows ? n - at : t->logits_rows;
        ampc_scope_begin();
        ampc_tensor *part = m == n ? logits : ampc_narrow(logits, 0, at, m);
        if (!part || ampc_tensor_to_f32(part, t->logits_buf, (size_t)(m * c)) < 0) rc = fail_lib("reading the logits");
        ampc_scope_end();
        for (int64_t i = 0; i < m && rc == 0; i++) {
            const float *row = t->logits_buf + i * c;
            const int64_t want = y[at + i];
            int64_t best = 0;
            for (int64_t k = 1; k < c; k++)
                if (row[k] > row[best]) best = k;
            *correct += best == want;
            if (confusion && want >= 0 && want < c) confusion[want * c + best] += 1;
        }
    }
    ampc_no_grad_exit();
    return rc;
}

// ---------------------------------------------------------------------------------------------
// A pass, batch by batch

/* One pass in progress: what run_pass's steps share. */
typedef struct {
    run *r;
    bool training;
    int64_t epoch;
    ampc_loader *ld;
    pass_stats *st;           /* the totals so far */
    int64_t done, n_batches;  /* batches taken and in the epoch (a continued pass counts its carry's) */
    /* --accumulate: groups of `accum` batches (the epoch's last one perhaps shorter), one optimizer
       step each; a stop (signal, --stop-after-steps) waits for the end of its group, so a
       checkpoint never holds half-accumulated gradients */
    int64_t accum, group_start;
    double group_loss;        /* the sum of the group's batch losses, for steps.csv */
    double group_rows, group_t0;   /* the job's samples in the group, since when: --tensorboard */
    ampc_cross_entropy_options ce;
    const ampc_cross_entropy_options *ce_opts;   /* &ce, or NULL: the plain call */
} pass;

/* At a step boundary (validation: every batch): 1 when the pass stops here, for a signal (seen by
   any rank) or --stop-after-steps, else 0; -1 on an error. */
static int pass_stops(pass *ps) {
    run *r = ps->r;
    if (r->world > 1) {   /* every rank stops at the same step: a signal seen by any of them counts */
        double sig = g_signal;
        if (ampc_dist_max_f64(&sig, 1) < 0) return fail_lib("agreeing on a stop");
        if (sig > 0 && !g_signal) g_signal = (int)sig;
    }
    if (g_signal) return 1;
    /* every rank takes the same steps: they stop together without a word */
    if (ps->training && ival(r->s, OPT_STOP_AFTER_STEPS) > 0 && r->stop.steps_run >= ival(r->s, OPT_STOP_AFTER_STEPS)) {
        r->stop.asked = true;
        return 1;
    }
    return 0;
}

/* The batch on the model's device (*x, *y replaced; the labels stay readable on the CPU for
   counting), BatchNorm's statistics synced, and the forward pass under autocast: *logits and
   *loss (NULL both for an empty batch, a data-parallel rank with none of the last one). */
static int batch_forward(pass *ps, ampc_tensor **x, ampc_tensor **y, ampc_tensor **logits, ampc_tensor **loss) {
    run *r = ps->r;
    if (r->m.device != AMPC_DEVICE_CPU && ampc_tensor_dim(*y, 0) > 0 &&
        ((ampc_tensor_device(*x) != r->m.device && !(*x = ampc_tensor_to(*x, r->m.device, ampc_tensor_dtype(*x)))) ||
         !(*y = ampc_tensor_to(*y, r->m.device, AMPC_I64))))
        return fail_lib("copying the batch to the device");
    if (ps->training && r->m.ddp && ampc_ddp_sync_buffers(r->m.ddp) < 0)   /* rank 0's BatchNorm statistics, as DDP */
        return fail_lib("data-parallel buffers");
    *logits = *loss = NULL;
    if (ampc_tensor_dim(*y, 0) == 0) return 0;
    ampc_autocast_enter(r->m.amp_dtype, r->m.use_amp);
    *loss = model_loss(r, *x, *y, ps->ce_opts, logits);
    ampc_autocast_exit();
    return *loss ? 0 : fail_lib(ps->training ? "training (forward)" : "validation");
}

/* The backward pass of a training batch of b rows, the g-th part of its group (last: it ends it).
   Data-parallel: the epoch's last global batch may be split unevenly, some ranks with none of
   it: each rank's mean loss is weighted by its share, so that the gradient DDP averages is the
   global batch's mean, as one process computes it. */
static int batch_backward(pass *ps, ampc_tensor *loss, int64_t b, int64_t g, bool last) {
    run *r = ps->r;
    const int64_t global_rows = ampc_loader_global_rows(ps->ld);
    if (r->m.ddp && ps->accum > 1 && ampc_ddp_set_sync(r->m.ddp, last) < 0)   /* no_sync() but for the last */
        return fail_lib("data-parallel --accumulate");
    if (b > 0) {   /* a group's loss is the mean over its batches, as loss / iters_to_accumulate */
        const double share = b * r->world == global_rows ? 1.0 : (double)(b * r->world) / (double)global_rows;
        ampc_tensor *part = g > 1 || share != 1.0 ? ampc_mul_scalar(loss, share / (double)g) : loss;
        if (!part || ampc_backward(ampc_scaler_scale(r->m.scaler, part)) < 0) return fail_lib("training (backward)");
    } else if (r->m.ddp && ampc_ddp_join(r->m.ddp) < 0) {   /* none of the batch here: the all-reduce all the same */
        return fail_lib("training (data-parallel join)");
    }
    return 0;
}

/* The optimizer step that ends a group: its learning rate, --clip-grad-norm, the grad scaler's
   step and update. *scale: the scale the step's gradients carried; *skipped: the scaler skipped it. */
static int optimizer_step(pass *ps, double *scale, bool *skipped) {
    run *r = ps->r;
    if (r->m.scheduled) {   /* the rate of this optimizer step: applied steps so far */
        double lr = ampc_lr_at(&r->m.sched, rval(r->s, OPT_LR), ampc_optimizer_steps_taken(r->m.opt));
        if (isnan(lr)) return fail_lib("--lr-schedule");
        ampc_optimizer_set_lr(r->m.opt, lr);
    }
    /* --clip-grad-norm: PyTorch's recipe, unscale_ then clip_grad_norm_ then step (which then
       reads the unscaled grads); the norm of non-finite grads is non-finite and the
       scaler skips the step */
    const double clip = rval(r->s, OPT_CLIP_GRAD_NORM);
    if (clip > 0 && (ampc_scaler_unscale(r->m.scaler, r->m.opt) < 0 || ampc_clip_grad_norm(r->m.opt, clip) < 0))
        return fail_lib("--clip-grad-norm");
    *scale = ampc_scaler_get_scale(r->m.scaler);
    const int64_t skipped0 = ampc_scaler_steps_skipped(r->m.scaler);
    if (ampc_scaler_step(r->m.scaler, r->m.opt) < 0 || ampc_scaler_update(r->m.scaler) < 0) return fail_lib("training (optimizer step)");
    ampc_optimizer_zero_grad(r->m.opt);
    *skipped = ampc_scaler_steps_skipped(r->m.scaler) > skipped0;
    ps->group_start = ps->done + 1;
    r->stop.steps_run++;
    return 0;
}

/* A training batch's loss lv (b rows here) as the job's: every rank's samples (what the guard
   rails and steps.csv see), added to its group's; once the group ended with a step (stepped; g
   batches, the scale its gradients carried, skipped or not), its steps.csv row, TensorBoard
   scalars and --explain's table. */
static int account_step(pass *ps, double lv, int64_t b, int64_t g, bool stepped, double step_scale, bool step_skipped, double *job_lv) {
    run *r = ps->r;
    *job_lv = lv;
    if (r->world > 1) {
        double v[2] = {lv * (double)b, (double)b};
        if (ampc_dist_allreduce_sum_f64(v, 2) < 0) return fail_lib("summing the job's loss");
        *job_lv = v[0] / v[1];
    }
    ps->group_loss += *job_lv;
    ps->group_rows += (double)ampc_loader_global_rows(ps->ld);
    if (!stepped) return 0;
    const double group_s = progress_now() - ps->group_t0;
    if (steplog_step(r, ps->epoch, ps->done + 1, ps->group_loss / (double)g, step_scale, step_skipped,
                     group_s > 0 ? ps->group_rows / group_s : NAN) < 0 ||
        tensorboard_step(r, ps->group_loss / (double)g, step_scale, ps->group_rows, group_s) < 0)
        return -1;
    ps->group_loss = ps->group_rows = 0;
    ps->group_t0 = progress_now();
    return r->diag.explaining ? explain_print(r) : 0;
}

/* One batch x, y (inside its scope, which it ends): forward, and in training backward, the
   optimizer step that ends a group and the checks after it; then the totals and the progress
   line. Returns 0, 2 when the grad scaler's guard rails stop the pass after this batch, or -1. */
static int pass_batch(pass *ps, ampc_tensor *x, ampc_tensor *y, progress *p) {
    run *r = ps->r;
    pass_stats *st = ps->st;
    const bool training = ps->training;
    if (training && ps->done == ps->group_start) {   /* an optimizer step begins */
        doctor_step_begin(r);
        numerics_step_begin(r);
        if (r->stop.steps_run == 0 && yes(r->s, OPT_EXPLAIN) && !r->diag.explaining && explain_begin(r) < 0) return -1;
    }
    ampc_tensor *y_cpu = y, *logits = NULL, *loss = NULL;   /* the labels stay readable here for counting */
    if (batch_forward(ps, &x, &y, &logits, &loss) < 0) return -1;
    const int64_t b = ampc_tensor_dim(y, 0);
    /* this batch's place in its accumulation group of g batches */
    const int64_t g = ps->accum < ps->n_batches - ps->group_start ? ps->accum : ps->n_batches - ps->group_start;
    const bool last = ps->done + 1 >= ps->group_start + g;
    if (training && batch_backward(ps, loss, b, g, last) < 0) return -1;
    bool stepped = false, step_skipped = false;   /* this batch ended its group with an optimizer step */
    double step_scale = 0;                        /* the scale that step's gradients carried */
    if (training && last) {
        if (optimizer_step(ps, &step_scale, &step_skipped) < 0) return -1;
        stepped = true;
    }
    double lv = b > 0 ? ampc_tensor_item(loss) : 0, job_lv = lv;
    if (training && account_step(ps, lv, b, g, stepped, step_scale, step_skipped, &job_lv) < 0) return -1;
    const int cs = training ? check_step(r, ps->epoch, ps->done + 1, ps->n_batches, job_lv, x, stepped) : 0;
    if (cs < 0) return cs;
    st->loss_sum += lv * (double)b;
    if (b > 0 && count_correct(&r->tally, logits, y_cpu, &st->correct, training ? NULL : r->tally.confusion) < 0) return -1;
    st->samples += b;
    ampc_scope_end();
    ps->done++;
    /* a bar keeps room for its cells on an 80-column terminal: the running loss only */
    const double seen = st->samples > 0 ? (double)st->samples : 1;
    double run_loss = st->loss_sum / seen, run_acc = 100.0 * (double)st->correct / (seen * (double)answers_per_sample(&r->d));
    if (p->mode == PROGRESS_BAR) progress_update(p, ps->done, "loss=%.4f", run_loss);
    else progress_update(p, ps->done, "loss=%.4f acc=%.2f%%", run_loss, run_acc);
    return cs > 0 ? 2 : 0;   /* the grad scaler's guard rails: this batch counted, the pass ends */
}

/* Data-parallel: the pass's figures (and validation's confusion matrix) summed over the ranks;
   carry's totals, the same on every rank, counted once. */
static int pass_sum_ranks(pass *ps, const pass_stats *carry, bool finished) {
    run *r = ps->r;
    pass_stats *st = ps->st;
    pass_stats c0 = carry ? *carry : (pass_stats){0};
    double v[3] = {st->loss_sum - c0.loss_sum, (double)(st->correct - c0.correct), (double)(st->samples - c0.samples)};
    if (ampc_dist_allreduce_sum_f64(v, 3) < 0) return fail_lib("summing the ranks' figures");
    st->loss_sum = c0.loss_sum + v[0];
    st->correct = c0.correct + (int64_t)v[1];
    st->samples = c0.samples + (int64_t)v[2];
    if (!ps->training && finished && r->tally.confusion &&
        ampc_dist_allreduce_sum_f64(r->tally.confusion, r->d.num_classes * r->d.num_classes) < 0)
        return fail_lib("summing the ranks' confusion matrices");
    return 0;
}

/* What it returns and how it continues a pass a signal stopped: train.h. */
int run_pass(run *r, bool training, int64_t epoch, pass_stats *st, const pass_stats *carry) {
    pass ps = {.r = r, .training = training, .epoch = epoch, .ld = training ? r->d.train_ld : r->d.val_ld, .st = st};
    char label[64];
    snprintf(label, sizeof label, "epoch %" PRId64 "/%" PRId64 " %s", epoch + 1, ival(r->s, OPT_EPOCHS), training ? "train" : "val  ");
    memset(st, 0, sizeof *st);
    if (carry) *st = *carry;
    ampc_module_train(r->m.net, training);
    if ((carry ? ampc_loader_start_epoch_at_sample(ps.ld, epoch, carry->samples) : ampc_loader_start_epoch(ps.ld, epoch)) < 0)
        return fail_lib("data loader");
    ps.done = carry ? carry->steps : 0;
    ps.n_batches = ps.done + ampc_loader_num_batches(ps.ld);
    ps.accum = training ? ival(r->s, OPT_ACCUMULATE) : 1;
    /* --label-smoothing: the training loss only (validation's stays comparable between runs);
       0 passes no options, the very call of a run without the flag */
    ps.ce = ampc_cross_entropy_defaults();
    ps.ce.label_smoothing = rval(r->s, OPT_LABEL_SMOOTHING);
    ps.ce_opts = training && ps.ce.label_smoothing > 0 ? &ps.ce : NULL;
    ps.group_start = ps.done;
    ps.group_t0 = progress_now();
    double t0 = progress_now() - st->seconds;
    progress p;
    progress_begin(&p, label, ps.n_batches, ps.done);
    if (!training && p.mode == PROGRESS_LINES) p.mode = PROGRESS_OFF;   /* a log gets the epoch's line only */
    if (!training) {
        ampc_no_grad_enter();
        if (r->tally.confusion) memset(r->tally.confusion, 0, (size_t)(r->d.num_classes * r->d.num_classes) * sizeof *r->tally.confusion);
    }
    int depth = ampc_scope_depth(), rc = 0;
    for (;;) {
        if ((!training || ps.done == ps.group_start) && (rc = pass_stops(&ps)) != 0) break;   /* at a step boundary */
        ampc_scope_begin();   /* the step's tensors are released at its end */
        ampc_tensor *x, *y;
        double tw = progress_now();
        int more = ampc_loader_next(ps.ld, &x, &y);
        st->data_seconds += progress_now() - tw;   /* the loader's cost as the step sees it: decode or wait */
        if (more <= 0) {
            if (more < 0) rc = fail_lib("data loader");
            break;
        }
        if ((rc = pass_batch(&ps, x, y, &p)) != 0) break;
    }
    while (ampc_scope_depth() > depth) ampc_scope_end();
    if (!training) ampc_no_grad_exit();
    if (rc < 0 && g_err_status == AMPC_ERR_TIMEOUT)   /* a collective ran out of time: say where the job stood */
        error_where("in epoch %" PRId64 " (%s) at step %" PRId64 " of %" PRId64, epoch + 1, training ? "training" : "validation",
                    ps.done + 1, ps.n_batches);
    if (rc != 0 && p.mode == PROGRESS_BAR) fputc('\n', p.out);   /* the next line starts on its own line */
    if (rc < 0) return rc;
    if (r->world > 1 && pass_sum_ranks(&ps, carry, rc == 0) < 0) return -1;
    if (rc == 0) progress_end(&p);
    st->seconds = progress_now() - t0;
    st->steps = ps.done;
    st->loss = st->samples ? st->loss_sum / (double)st->samples : NAN;
    /* token windows: the share of tokens whose next token the model ranks first */
    st->acc = st->samples ? (double)st->correct / ((double)st->samples * (double)answers_per_sample(&r->d)) : NAN;
    return rc;
}
