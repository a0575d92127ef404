/*
 * trainer.c - a run from start to end: the run built (and resumed), the epoch loop (each epoch
 * trains and validates (pass.c), replaces the checkpoint (diverge.c) before the metrics row, so
 * metrics.csv never runs ahead of it, and redraws the plots (outputs.c)), signals (SIGINT/SIGTERM
 * save where training stands and exit 128 + signal) and the summary.
 */
#include "train.h"
#include "progress.h"

#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

// ---------------------------------------------------------------------------------------------
// Signals: SIGINT/SIGTERM stop the run at the next step boundary with a checkpoint that resumes
// exactly; a second one stops at once (the signal's default action). Handlers are installed only
// while epochs run: during the setup there is nothing to save.

volatile sig_atomic_t g_signal;

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
// The run

/* A signal stopped the run after its checkpoint was saved: one line saying where, and how to go on;
   exit status 128 + the signal's number, as a shell reports a process the signal ended. */
static int interrupted(run *r) {
    const int sig = g_signal;
    fail("%s: saved %s; continue with: " PROG " --resume %s", sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "signal",
         r->stop.last_good, r->out.ckpt_path);
    g_interrupt = true;
    g_exit = 128 + sig;
    return -1;
}

/* --stop-after-steps: the same checkpoint as for a signal, and a clean exit. */
static int stopped(run *r) {
    printf("stopped after %" PRId64 " training step(s) (--stop-after-steps): saved %s; continue with: " PROG " --resume %s\n",
           r->stop.steps_run, r->stop.last_good, r->out.ckpt_path);
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

/* What the run starts from: --pretrained and --resume exclude each other, and --eval-only needs
   one of them. */
static int check_start(const settings *s) {
    /* the checkpoint holds the run's own weights: a --pretrained file would be ignored or would
       overwrite them, neither of which a user means */
    if (*sval(s, OPT_RESUME) && *sval(s, OPT_PRETRAINED))
        return usage_error("--pretrained starts a new run from those weights; --resume continues from the checkpoint's own: give one of them");
    if (yes(s, OPT_EVAL_ONLY) && !*sval(s, OPT_RESUME) && !*sval(s, OPT_PRETRAINED))
        return usage_error("--eval-only evaluates a trained model: give its checkpoint (--resume FILE) or its weights (--pretrained FILE)");
    return 0;
}

/* The run built (setup.c) from the settings (--resume: the checkpoint's) and restored from the
   checkpoint, with every rank agreeing on it; then data parallelism and --zero. */
static int build(run *r) {
    const settings *s = r->s;
    if (*sval(s, OPT_RESUME) && resume_settings(r->s, &r->resume.meta) < 0) return -1;
    if (agree_settings(r) < 0 || run_build(r) < 0) return -1;
    if (ampc_autocast_fp32_modules(sval(s, OPT_FP32_MODULES)) < 0) return usage_error("--fp32-modules: %s", ampc_last_error());
    if (*sval(s, OPT_RESUME) && resume_state(r) < 0) return -1;
    if (agree_built(r) < 0) return -1;
    /* data-parallel: rank 0's weights and buffers everywhere, and gradients averaged from here on */
    if (r->world > 1 && !(r->m.ddp = ampc_ddp_new(r->m.net, NULL))) return fail_lib("data-parallel model");
    if (ival(s, OPT_ZERO) == 1 && r->world == 1) warn("--zero 1: one process, nothing to shard");
    if (ival(s, OPT_ZERO) == 1 && r->world > 1 && ampc_zero_shard(r->m.opt, &r->m.zero_here, &r->m.zero_all) < 0)
        return fail_lib("--zero 1");
    return 0;
}

/* A language model's perplexity exp(loss) as " (perplexity X)"; "" for classifiers. */
static const char *ppl(const run *r, double loss) {
    static char buf[48];
    if (!r->d.block) return "";
    snprintf(buf, sizeof buf, " (perplexity %.2f)", exp(loss));
    return buf;
}

/* --eval-only: the model as loaded, on the validation data, and nothing else. */
static int evaluate(run *r, run_result *res) {
    pass_stats va;
    int pr = run_pass(r, false, r->resume.epoch0, &va, NULL);
    if (pr != 0) return pr < 0 ? -1 : interrupted(r);
    printf("evaluation: %" PRId64 " validation samples, loss %.4f%s, accuracy %.2f%%\n", va.samples, va.loss, ppl(r, va.loss), 100 * va.acc);
    r->tally.valid = va.samples > 0 && r->tally.confusion;
    if (r->tally.valid) print_per_class(r);
    res->val_loss = va.loss;
    res->val_acc = va.acc;
    res->ok = true;
    return 0;
}

/* --resume: where the run continues, and a note when the global batch is not the checkpoint's;
   an error when the checkpoint is past --epochs already. */
static int print_resumed(const run *r, int64_t n_epochs) {
    const settings *s = r->s;
    const run_resume *rs = &r->resume;
    if (rs->step > 0)
        printf("resumed from %s in epoch %" PRId64 " after step %" PRId64 " of %" PRId64 " (sample %" PRId64 " of %" PRId64 ")\n",
               sval(s, OPT_RESUME), rs->epoch0 + 1, rs->step, rs->step + ampc_loader_count_batches(r->d.train_ld, rs->train.samples),
               rs->train.samples, ampc_dataset_size(r->d.train));
    else
        printf("resumed from %s after epoch %" PRId64 "\n", sval(s, OPT_RESUME), rs->epoch0);
    int64_t global = ival(s, OPT_BATCH_SIZE) * r->world;
    if (global != rs->saved_global_batch) {
        char hint[96] = "";
        if (rs->saved_global_batch % r->world == 0)
            snprintf(hint, sizeof hint, " (--batch-size %" PRId64 " keeps it)", rs->saved_global_batch / r->world);
        printf("note: global batch %" PRId64 " on %d process(es), the checkpoint's was %" PRId64 " on %" PRId64
               ": the steps from here are not those the run took so far%s\n",
               global, r->world, rs->saved_global_batch, rs->saved_world, hint);
    }
    if (n_epochs > 0 && n_epochs < rs->epoch0 + (rs->step > 0))
        return rs->step > 0 ? fail("--epochs %" PRId64 ": the checkpoint is in epoch %" PRId64 " already", n_epochs, rs->epoch0 + 1)
                            : fail("--epochs %" PRId64 ": the checkpoint has finished %" PRId64 " epochs already", n_epochs, rs->epoch0);
    return 0;
}

/* An epoch's metrics.csv row (COLS), and its line on stdout. */
static void epoch_row(const run *r, int64_t e, int64_t n_epochs, const pass_stats *tr, const pass_stats *va, double secs,
                      double row[N_COLS]) {
    ampc_scaler *sc = r->m.scaler;
    const double sps = tr->seconds > 0 ? (double)tr->samples / tr->seconds : 0;
    const double wait = tr->seconds > 0 ? tr->data_seconds / tr->seconds : 0;
    const double skipped = (double)(ampc_scaler_steps_skipped(sc) - r->stop.epoch_skipped0);
    double v[N_COLS] = {[COL_EPOCH] = (double)(e + 1), [COL_TRAIN_LOSS] = tr->loss, [COL_TRAIN_ACC] = tr->acc,
                        [COL_VAL_LOSS] = va->loss,     [COL_VAL_ACC] = va->acc,     [COL_SECONDS] = secs,
                        [COL_SPS] = sps,               [COL_SCALE] = ampc_scaler_get_scale(sc),
                        [COL_SKIPPED] = skipped,       [COL_DATA_WAIT] = wait};
    memcpy(row, v, sizeof v);
    char c1[32];
    printf("epoch %" PRId64 "/%" PRId64 ": train loss %.4f acc %.2f%% | val loss %.4f%s acc %.2f%% | %.1f s (train %.1f s, %s samples/s, "
           "%.1f ms/step, data wait %.1f%%)",
           e + 1, n_epochs, tr->loss, 100 * tr->acc, va->loss, ppl(r, va->loss), 100 * va->acc, secs, tr->seconds, fmt_count((int64_t)row[COL_SPS], c1, sizeof c1),
           tr->steps ? 1e3 * tr->seconds / (double)tr->steps : 0.0, 100 * row[COL_DATA_WAIT]);
    if (ampc_scaler_is_enabled(sc)) printf(" | scale %g, %.0f skipped", row[COL_SCALE], row[COL_SKIPPED]);
    if (r->m.scheduled) printf(" | lr %.4g", ampc_optimizer_get_lr(r->m.opt));
    printf("\n");
    fflush(stdout);
}

/* One epoch, or the rest of one a signal interrupted: train, validate, then the checkpoint, the
   metrics row and the plots. Returns 0 or -1; *over: the run ends here (an error, a divergence, a
   signal or --stop-after-steps; the checkpoint saved where one is due). */
static int run_epoch(run *r, int64_t e, int64_t n_epochs, run_result *res, bool *over) {
    *over = true;
    const bool cont = e == r->resume.epoch0 && r->resume.step > 0;   /* an epoch a signal interrupted */
    double te = progress_now() - (cont ? r->resume.epoch_seconds : 0);
    if (!cont) r->stop.epoch_skipped0 = ampc_scaler_steps_skipped(r->m.scaler);
    pass_stats tr, va;
    int pr = run_pass(r, true, e, &tr, cont ? &r->resume.train : NULL);
    if (pr == 0) pr = check_epoch_applied(r, e, &tr);
    if (pr == 0) pr = run_pass(r, false, e, &va, NULL);
    if (pr == 0 && va.samples > 0 && r->tally.confusion) {
        if (write_confusion(r) < 0) pr = -1;
        else r->tally.valid = true;
    }
    /* the weights give NaN on the validation data: they are not a good checkpoint */
    if (pr == 0 && va.samples > 0 && !isfinite(va.loss)) pr = diverged(r, e, 0, 0, "the validation loss is %g", va.loss);
    if (pr < 0) {
        if (g_err_status == AMPC_ERR_OOM && strcmp(sval(r->s, OPT_MAX_MEMORY), "none") != 0) oom_advice(r, rval(r->s, OPT_MAX_MEMORY));
        return -1;
    }
    /* the grad scaler gave up: save where it stopped, apart from the last good checkpoint */
    if (pr == 2) return diverged_save(r, e, &tr, progress_now() - te);
    if (pr > 0) {   /* a signal: save where training stands (validation is redone on resume) */
        if (save_checkpoint(r, e, tr.steps, &tr, progress_now() - te) < 0) return -1;
        return r->stop.asked ? stopped(r) : interrupted(r);
    }
    double row[N_COLS];
    epoch_row(r, e, n_epochs, &tr, &va, progress_now() - te, row);
    /* the checkpoint first: after a kill between the two, resume rewrites metrics.csv from the
       checkpoint's history, so the file never runs ahead of what resume continues from */
    if (history_push(&r->out.hist, row) < 0 || save_checkpoint(r, e + 1, 0, NULL, 0) < 0) return -1;
    if (r->rank == 0 && ampc_metrics_row(r->out.metrics, row) < 0) return fail_lib("metrics.csv");
    if (tensorboard_epoch(r, row) < 0 || draw_plots(r) < 0) return -1;
    res->epochs_run++;
    res->samples += tr.samples;
    res->train_seconds += tr.seconds;
    res->data_seconds += tr.data_seconds;
    if (g_signal && e + 1 < n_epochs) return interrupted(r);   /* arrived during the save: it is done */
    *over = false;
    return 0;
}

/* After the last epoch: the run's figures in *res and the summary lines. */
static void summarize(run *r, run_result *res, double t0) {
    ampc_scaler *sc = r->m.scaler;
    res->seconds = progress_now() - t0;
    ampc_memory_stats_t ms = ampc_memory_stats();
    res->peak_total = (double)ms.peak_total;
    for (int k = 0; k < AMPC_MEM_KIND_COUNT; k++) res->peak[k] = (double)ms.peak[k];
    res->scale = ampc_scaler_get_scale(sc);
    res->skipped = ampc_scaler_steps_skipped(sc);
    res->samples_per_s = res->train_seconds > 0 ? (double)res->samples / res->train_seconds : 0;
    if (r->out.hist.n) {
        const double *last = r->out.hist.rows[r->out.hist.n - 1];
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
    if (ampc_scaler_is_enabled(sc))
        printf("  grad scaler: %" PRId64 " skipped steps of %" PRId64 ", final scale %g\n", ampc_scaler_steps_skipped(sc),
               ampc_scaler_steps_applied(sc) + ampc_scaler_steps_skipped(sc), (double)res->scale);
    else
        printf("  grad scaler: off (0 skipped steps, scale 1)\n");
    printf("  final: train loss %.4f acc %.2f%% | validation loss %.4f%s acc %.2f%%\n", res->train_loss, 100 * res->train_acc,
           res->val_loss, ppl(r, res->val_loss), 100 * res->val_acc);
    if (r->tally.valid) print_per_class(r);
    printf("  outputs: %s\n", r->out.dir);
    res->ok = true;
}

/* The epochs left, with the outputs open: then the summary (rewriting the outputs from the
   checkpoint when it has finished them all). */
static int train_epochs(run *r, int64_t n_epochs, run_result *res) {
    if (yes(r->s, OPT_DOCTOR)) ampc_doctor_enable(true);
    if (numerics_open(r) < 0) return -1;
    ampc_memory_reset_peak();
    double t0 = progress_now();
    r->stop.skipped_seen = ampc_scaler_steps_skipped(r->m.scaler);
    stop_signals_install(true);
    for (int64_t e = r->resume.epoch0; e < n_epochs; e++) {
        bool over;
        int rc = run_epoch(r, e, n_epochs, res, &over);
        if (over) return rc;
    }
    if (r->resume.epoch0 >= n_epochs) {   /* nothing left to train: rewrite the outputs from the checkpoint */
        printf("nothing to train: the checkpoint has finished %" PRId64 " of %" PRId64 " epochs\n", r->resume.epoch0, n_epochs);
        if (draw_plots(r) < 0 || save_checkpoint(r, r->resume.epoch0, 0, NULL, 0) < 0) return -1;
    }
    if (numerics_report(r) < 0) return -1;
    summarize(r, res, t0);
    return 0;
}

/* Whatever the run stopped at: recordings ended unprinted, the process-wide switches off, the
   run freed. */
static void run_end(run *r) {
    if (r->diag.explaining) {   /* stopped inside the explained step: the recording ends unprinted */
        ampc_explain_row *rows = NULL;
        ampc_explain_end(&rows);
        free(rows);
    }
    if (r->diag.numerics) {   /* an error or a stop: the collection ends unreported */
        ampc_numerics_row *rows = NULL;
        ampc_numerics_end(&rows);
        free(rows);
    }
    ampc_doctor_enable(false);
    ampc_autocast_fp32_modules(NULL);
    stop_signals_install(false);
    run_free(r);
}

int train_run(settings *s, run_result *res) {
    memset(res, 0, sizeof *res);
    run r = {.s = s};
    int rc = check_start(s);
    if (rc == 0) rc = build(&r);
    if (rc < 0) goto done;
    g_oom_hint = "try a smaller --batch-size or --use-amp yes";
    print_setup(&r);
    if (yes(s, OPT_EVAL_ONLY)) {
        rc = evaluate(&r, res);
        if (rc == 0 && ival(s, OPT_SAMPLE) > 0 && r.rank == 0) rc = sample_print(&r);
        goto done;
    }
    const int64_t n_epochs = ival(s, OPT_EPOCHS);
    if (*sval(s, OPT_RESUME) && (rc = print_resumed(&r, n_epochs)) < 0) goto done;
    if (n_epochs == 0) {
        res->ok = true;
        goto done;
    }
    if ((rc = outputs_open(&r)) == 0) rc = train_epochs(&r, n_epochs, res);
    if (rc == 0 && res->ok && ival(s, OPT_SAMPLE) > 0 && r.rank == 0) rc = sample_print(&r);
done:
    run_end(&r);
    return rc;
}
