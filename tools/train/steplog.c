/*
 * steplog.c - what each optimizer step did, for the run's numerics: steps.csv (--step-log), the
 * loss-scale plot scale.png, and a line on stdout for each step the GradScaler skips (at most
 * one per 2 s; the ones in between are counted in the next line and in the epoch's line).
 *
 * steps.csv never runs ahead of the checkpoint a resume continues from: on --resume its rows
 * after the checkpoint's optimizer steps (applied + skipped, both restored) are dropped first.
 */
#include "plot.h"
#include "progress.h"
#include "train.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <unistd.h>

static const char *const STEP_COLS[] = {"step", "epoch", "batch", "loss", "scale", "skipped", "lr"};
enum { N_STEP_COLS = sizeof STEP_COLS / sizeof *STEP_COLS };
#define SKIP_LINE_INTERVAL 2.0   /* seconds between skipped-step lines */

/* Optimizer steps the run has taken: applied ones (the optimizer's count) and skipped ones. */
static int64_t steps_so_far(const run *r) {
    return ampc_optimizer_steps_taken(r->opt) + ampc_scaler_steps_skipped(r->scaler);
}

int steplog_cut_back(const char *path, int64_t keep) {
    FILE *in = ampc_output_fopen(path, "steps.csv", "r");   /* a FIFO or a link there: refused, not read */
    if (!in) return errno == ENOENT ? 0 : fail_lib("--step-log");
    char *tmp = NULL;
    if (asprintf(&tmp, "%s.tmp.%ld", path, (long)getpid()) < 0) {
        fclose(in);
        return fail("out of memory");
    }
    unlink(tmp);   /* a new file, never one placed there */
    FILE *out = ampc_output_fopen(tmp, "steps.csv", "wx");
    if (!out) {
        fclose(in);
        free(tmp);
        return fail_lib("--step-log");
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    for (int64_t n = 0; (len = getline(&line, &cap, in)) > 0; n++) {
        if (line[len - 1] != '\n') break;   /* cut short by a kill */
        char *end;
        long long step = strtoll(line, &end, 10);
        /* fwrite: a NUL byte in a line would end fputs there and join it to the next */
        if (n == 0 || (end != line && *end == ',' && step >= 1 && step <= keep)) fwrite(line, 1, (size_t)len, out);
    }
    free(line);
    fclose(in);
    int rc = 0;
    if (fclose(out) != 0 || rename(tmp, path) != 0) rc = fail("steps.csv: can't replace '%s': %s", path, strerror(errno));
    if (rc < 0) unlink(tmp);
    free(tmp);
    return rc;
}

int steplog_open(run *r) {
    r->skip_printed_at = -INFINITY;
    if (r->rank > 0 || !yes(r->s, OPT_STEP_LOG)) return 0;
    char *path = path_join(r->out, "steps.csv");
    if (!path) return -1;
    bool resumed = *sval(r->s, OPT_RESUME) != '\0';
    int rc = resumed ? steplog_cut_back(path, steps_so_far(r)) : 0;
    if (rc == 0 && !(r->steps = ampc_metrics_open(path, STEP_COLS, N_STEP_COLS, resumed))) rc = fail_lib("steps.csv");
    free(path);
    return rc;
}

int steplog_step(run *r, int64_t epoch, int64_t batch, double loss, double scale, bool skipped) {
    if (r->rank > 0) return 0;
    if (skipped) {
        double now = progress_now();
        if (now - r->skip_printed_at >= SKIP_LINE_INTERVAL) {
            char more[96] = "";
            if (r->skips_unprinted)
                snprintf(more, sizeof more, " (and %" PRId64 " more since the last such line)", r->skips_unprinted);
            char blame[520];
            printf("skipped step %" PRId64 " (epoch %" PRId64 ", batch %" PRId64 "): inf/NaN gradients at loss scale %g; the scale is now %g%s%s\n",
                   steps_so_far(r), epoch + 1, batch, scale, (double)ampc_scaler_get_scale(r->scaler), doctor_blame(blame, sizeof blame), more);
            fflush(stdout);
            r->skip_printed_at = now;
            r->skips_unprinted = 0;
        } else {
            r->skips_unprinted++;
        }
    }
    if (!r->steps) return 0;
    double row[N_STEP_COLS] = {(double)steps_so_far(r), (double)(epoch + 1), (double)batch, loss, scale, skipped ? 1.0 : 0.0,
                               ampc_optimizer_get_lr(r->opt)};
    return ampc_metrics_row(r->steps, row) < 0 ? fail_lib("steps.csv") : 0;
}

int steplog_plot(run *r) {
    if (!r->steps || !ampc_scaler_is_enabled(r->scaler)) return 0;
    char *path = path_join(r->out, "steps.csv"), *png = path_join(r->out, "scale.png");
    FILE *f = path ? ampc_output_fopen(path, "steps.csv", "r") : NULL;
    double *x = NULL, *y = NULL, *sx = NULL, *sy = NULL;
    int n = 0, ns = 0, rows = 0, rc = 0;
    if (!path || !png) rc = -1;
    else if (!f) rc = fail_lib("--step-log");
    char line[512];
    while (rc == 0 && fgets(line, sizeof line, f)) rows++;   /* the header and a line per step: room for all */
    if (rc == 0) {
        rewind(f);
        x = malloc((size_t)(rows + 1) * 4 * sizeof *x);
        if (!x) rc = fail("out of memory");
        else y = x + rows + 1, sx = y + rows + 1, sy = sx + rows + 1;
    }
    for (int k = 0; rc == 0 && k <= rows && fgets(line, sizeof line, f); k++) {
        double v[N_STEP_COLS];
        if (k == 0 || sscanf(line, "%lf,%lf,%lf,%lf,%lf,%lf,%lf", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6]) != 7) continue;
        x[n] = v[0];
        y[n] = v[4] > 0 ? log2(v[4]) : NAN;
        n++;
        if (v[5] != 0) {
            sx[ns] = v[0];
            sy[ns++] = v[4] > 0 ? log2(v[4]) : NAN;
        }
    }
    if (f) fclose(f);
    if (rc == 0) {
        char title[64];
        snprintf(title, sizeof title, "loss scale: %d skipped of %d steps", ns, n);
        plot_series s[2] = {{"scale", x, y, n, false}, {"skipped step", sx, sy, ns, true}};
        if (plot_curves(png, title, "optimizer step", "log2(loss scale)", s, ns ? 2 : 1) < 0) rc = fail_lib("scale.png");
    }
    free(x);   /* y, sx and sy are parts of it */
    free(path);
    free(png);
    return rc;
}

void steplog_close(run *r) {
    if (r->steps && ampc_metrics_close(r->steps) < 0) warn("steps.csv: %s", ampc_last_error());
    r->steps = NULL;
}
