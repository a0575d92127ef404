/*
 * tensorboard.c - --tensorboard: the run's scalars as a TensorBoard event file in --out
 * (tools/tbevents.c), so `tensorboard --logdir runs` shows every run. Rank 0 writes, as it writes
 * steps.csv and metrics.csv, and a write error stops the run as theirs do (exit 1, the file named).
 *
 * Per optimizer step, at its global step (steps.csv's `step`: applied + skipped steps, from 1):
 * train/loss (steps.csv's loss), train/lr, train/skipped_steps (the run's total so far),
 * train/samples_per_s (that step's own throughput, its samples over the time since the previous
 * step ended, data loading included: TensorBoard's smoothing slider averages it) and, with the
 * GradScaler, train/loss_scale (the scale the step's gradients carried, steps.csv's scale).
 * Per epoch, at the global step of the epoch's last optimizer step: metrics.csv's row as
 * epoch/train_loss, epoch/val_loss, epoch/train_accuracy, epoch/val_accuracy (fractions),
 * epoch/samples_per_s, epoch/skipped_steps (the epoch's), and epoch/lr (the rate of its last step).
 *
 * Each session writes a new file. A resumed one first writes SessionLog START at the step it
 * continues with, the checkpoint's step + 1: TensorBoard then drops the events a killed run wrote
 * past its checkpoint (PyTorch SummaryWriter's purge_step), and the curves show one run.
 */
#include "tbevents.h"
#include "train.h"

static const char *const STEP_TAGS[] = {"train/loss", "train/lr", "train/skipped_steps", "train/samples_per_s",
                                        "train/loss_scale"};
enum { N_STEP_TAGS = sizeof STEP_TAGS / sizeof *STEP_TAGS };
static const char *const EPOCH_TAGS[] = {"epoch/train_loss", "epoch/val_loss", "epoch/train_accuracy", "epoch/val_accuracy",
                                         "epoch/lr", "epoch/samples_per_s", "epoch/skipped_steps"};
enum { N_EPOCH_TAGS = sizeof EPOCH_TAGS / sizeof *EPOCH_TAGS };

int tensorboard_open(run *r) {
    if (r->rank > 0 || !yes(r->s, OPT_TENSORBOARD)) return 0;
    char err[1200];
    if (!(r->out.tb = tb_writer_open(r->out.dir, err, sizeof err))) return fail("--tensorboard: %s", err);
    if (*sval(r->s, OPT_RESUME) && tb_writer_session_start(r->out.tb, steps_so_far(r) + 1) < 0)
        return fail("--tensorboard: %s", tb_writer_error(r->out.tb));
    return 0;
}

int tensorboard_step(run *r, double loss, double scale, double samples, double seconds) {
    if (!r->out.tb) return 0;
    const double v[N_STEP_TAGS] = {loss, ampc_optimizer_get_lr(r->m.opt), (double)ampc_scaler_steps_skipped(r->m.scaler),
                                   seconds > 0 ? samples / seconds : 0, scale};
    const int n = ampc_scaler_is_enabled(r->m.scaler) ? N_STEP_TAGS : N_STEP_TAGS - 1;   /* loss_scale last */
    return tb_writer_scalars(r->out.tb, steps_so_far(r), n, STEP_TAGS, v) < 0 ? fail("--tensorboard: %s", tb_writer_error(r->out.tb)) : 0;
}

int tensorboard_epoch(run *r, const double *row) {
    if (!r->out.tb) return 0;
    const double v[N_EPOCH_TAGS] = {row[COL_TRAIN_LOSS], row[COL_VAL_LOSS], row[COL_TRAIN_ACC], row[COL_VAL_ACC],
                                    ampc_optimizer_get_lr(r->m.opt), row[COL_SPS], row[COL_SKIPPED]};
    if (tb_writer_scalars(r->out.tb, steps_so_far(r), N_EPOCH_TAGS, EPOCH_TAGS, v) < 0 || tb_writer_flush(r->out.tb) < 0)
        return fail("--tensorboard: %s", tb_writer_error(r->out.tb));
    return 0;
}

void tensorboard_close(run *r) {
    char err[1200];
    const bool said = r->out.tb && tb_writer_error(r->out.tb)[0];   /* the run's error already: once is enough */
    if (tb_writer_close(r->out.tb, err, sizeof err) < 0 && !said) warn("--tensorboard: %s", err);
    r->out.tb = NULL;
}
