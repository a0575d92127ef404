/*
 * steplog.c - what each optimizer step did, for the run's numerics: steps.csv (--step-log), the
 * plots drawn from it (steps.png: loss and throughput per step; scale.png: the loss scale;
 * --compare's compare.png: fp32 and AMP overlaid), and a line on stdout for each step the GradScaler skips (at most
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

static const char *const STEP_COLS[] = {"step", "epoch", "batch", "loss", "scale", "skipped", "lr", "samples_per_s"};
enum { N_STEP_COLS = sizeof STEP_COLS / sizeof *STEP_COLS };
/* steps.csv as ampc-train wrote it before samples_per_s: resuming such a run adds the column
   ("nan" in the rows before) */
static const char OLD_HEADER[] = "step,epoch,batch,loss,scale,skipped,lr\n";
#define SKIP_LINE_INTERVAL 2.0   /* seconds between skipped-step lines */

int64_t steps_so_far(const run *r) {
    return ampc_optimizer_steps_taken(r->m.opt) + ampc_scaler_steps_skipped(r->m.scaler);
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
    bool upgrade = false;
    for (int64_t n = 0; (len = getline(&line, &cap, in)) > 0; n++) {
        if (line[len - 1] != '\n') break;   /* cut short by a kill */
        if (n == 0 && (size_t)len == sizeof OLD_HEADER - 1 && !memcmp(line, OLD_HEADER, (size_t)len)) {
            upgrade = true;
            for (int k = 0; k < N_STEP_COLS; k++) fprintf(out, "%s%c", STEP_COLS[k], k + 1 < N_STEP_COLS ? ',' : '\n');
            continue;
        }
        char *end;
        long long step = strtoll(line, &end, 10);
        /* fwrite: a NUL byte in a line would end fputs there and join it to the next */
        if (n == 0 || (end != line && *end == ',' && step >= 1 && step <= keep)) {
            fwrite(line, 1, (size_t)len - (n > 0 && upgrade), out);
            if (n > 0 && upgrade) fputs(",nan\n", out);
        }
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
    r->out.skip_printed_at = -INFINITY;
    if (r->rank > 0 || !yes(r->s, OPT_STEP_LOG)) return 0;
    char *path = path_join(r->out.dir, "steps.csv");
    if (!path) return -1;
    bool resumed = *sval(r->s, OPT_RESUME) != '\0';
    int rc = resumed ? steplog_cut_back(path, steps_so_far(r)) : 0;
    if (rc == 0 && !(r->out.steps = ampc_metrics_open(path, STEP_COLS, N_STEP_COLS, resumed))) rc = fail_lib("steps.csv");
    free(path);
    return rc;
}

int steplog_step(run *r, int64_t epoch, int64_t batch, double loss, double scale, bool skipped, double samples_per_s) {
    if (r->rank > 0) return 0;
    if (skipped) {
        double now = progress_now();
        if (now - r->out.skip_printed_at >= SKIP_LINE_INTERVAL) {
            char more[96] = "";
            if (r->out.skips_unprinted)
                snprintf(more, sizeof more, " (and %" PRId64 " more since the last such line)", r->out.skips_unprinted);
            char blame[520];
            printf("skipped step %" PRId64 " (epoch %" PRId64 ", batch %" PRId64 "): inf/NaN gradients at loss scale %g; the scale is now %g%s%s\n",
                   steps_so_far(r), epoch + 1, batch, scale, (double)ampc_scaler_get_scale(r->m.scaler), doctor_blame(blame, sizeof blame), more);
            fflush(stdout);
            r->out.skip_printed_at = now;
            r->out.skips_unprinted = 0;
        } else {
            r->out.skips_unprinted++;
        }
    }
    if (!r->out.steps) return 0;
    double row[N_STEP_COLS] = {(double)steps_so_far(r), (double)(epoch + 1), (double)batch, loss, scale, skipped ? 1.0 : 0.0,
                               ampc_optimizer_get_lr(r->m.opt), samples_per_s};
    return ampc_metrics_row(r->out.steps, row) < 0 ? fail_lib("steps.csv") : 0;
}

// ---------------------------------------------------------------------------------------------
// Plots from steps.csv: scale.png, steps.png, and --compare's compare.png

/* steps.csv's rows as columns, in one malloc'd block (x: the step) */
typedef struct {
    int n;
    double *x, *loss, *scale, *skipped, *sps;
} step_rows;

/* Reads steps.csv at path (rows that do not parse are skipped; an older file's missing
   samples_per_s reads as NaN). 0, 1 when the file does not exist, or -1 with the error kept. */
static int read_steps(const char *path, step_rows *d) {
    memset(d, 0, sizeof *d);
    FILE *f = ampc_output_fopen(path, "steps.csv", "r");   /* a FIFO or a link there: refused, not read */
    if (!f) return errno == ENOENT ? 1 : fail_lib("steps.csv");
    char line[512];
    int rows = 0;
    while (fgets(line, sizeof line, f)) rows++;   /* the header and a line per step: room for all */
    rewind(f);
    if (!(d->x = malloc((size_t)(rows + 1) * 5 * sizeof *d->x))) {
        fclose(f);
        return fail("out of memory");
    }
    d->loss = d->x + rows + 1, d->scale = d->loss + rows + 1, d->skipped = d->scale + rows + 1, d->sps = d->skipped + rows + 1;
    for (int k = 0; k <= rows && fgets(line, sizeof line, f); k++) {
        double v[N_STEP_COLS];
        v[7] = NAN;
        int got = k ? sscanf(line, "%lf,%lf,%lf,%lf,%lf,%lf,%lf,%lf", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]) : 0;
        if (got < 7) continue;
        d->x[d->n] = v[0], d->loss[d->n] = v[3], d->scale[d->n] = v[4], d->skipped[d->n] = v[5], d->sps[d->n] = v[7];
        d->n++;
    }
    fclose(f);
    return 0;
}

/* out[i]: the mean of y over the k steps ending at i (the finite ones), a trend through noisy
   per-step values; k grows with the run so that the curve has about 40 independent stretches */
static int trailing_mean(const double *y, int n, double *out) {
    int k = n / 40 < 2 ? 2 : n / 40 > 500 ? 500 : n / 40, m = 0;
    double sum = 0;
    for (int i = 0; i < n; i++) {
        if (isfinite(y[i])) sum += y[i], m++;
        if (i >= k && isfinite(y[i - k])) sum -= y[i - k], m--;
        out[i] = m ? sum / m : NAN;
    }
    return k;
}

/* scale.png: log2 of the loss scale per step, the skipped steps marked */
static int plot_scale(const step_rows *d, const char *png) {
    double *y = malloc((size_t)(d->n + 1) * 3 * sizeof *y), *sx = y ? y + d->n + 1 : NULL, *sy = sx ? sx + d->n + 1 : NULL;
    if (!y) return fail("out of memory");
    int ns = 0;
    for (int i = 0; i < d->n; i++) {
        y[i] = d->scale[i] > 0 ? log2(d->scale[i]) : NAN;
        if (d->skipped[i] != 0) sx[ns] = d->x[i], sy[ns++] = y[i];
    }
    char title[64];
    snprintf(title, sizeof title, "loss scale: %d skipped of %d steps", ns, d->n);
    plot_series s[2] = {{"scale", d->x, y, d->n, false}, {"skipped step", sx, sy, ns, true}};
    int rc = plot_curves(png, title, "optimizer step", "log2(loss scale)", s, ns ? 2 : 1) < 0 ? fail_lib("scale.png") : 0;
    free(y);
    return rc;
}

/* steps.png (one run) or compare.png (runs side by side): the training loss and the throughput
   per optimizer step, each run's raw values and a trailing mean (one run), or the trailing
   means overlaid (several: raw per-step values of two runs hide each other) */
static int plot_steps(const step_rows *d, const char *const *names, int n_runs, const char *png, const char *title) {
    int total = 0;
    for (int k = 0; k < n_runs; k++) total += d[k].n + 1;
    double *mean = malloc((size_t)total * 2 * sizeof *mean);
    if (!mean) return fail("out of memory");
    plot_series loss[2 * 2], sps[2 * 2];
    char label[2][1][64];
    int nl = 0, at = 0;
    for (int k = 0; k < n_runs && k < 2; k++) {
        double *lm = mean + at, *sm = mean + total + at;
        int w = trailing_mean(d[k].loss, d[k].n, lm);
        trailing_mean(d[k].sps, d[k].n, sm);
        at += d[k].n + 1;
        if (n_runs == 1) {
            loss[nl] = (plot_series){"per step", d[k].x, d[k].loss, d[k].n, false};
            sps[nl++] = (plot_series){"per step", d[k].x, d[k].sps, d[k].n, false};
        }
        if (n_runs == 1) snprintf(label[k][0], sizeof label[k][0], "mean of %d steps", w);
        else snprintf(label[k][0], sizeof label[k][0], "%s (mean of %d steps)", names[k], w);
        loss[nl] = (plot_series){label[k][0], d[k].x, lm, d[k].n, false};
        sps[nl++] = (plot_series){label[k][0], d[k].x, sm, d[k].n, false};
    }
    plot_panel p[2] = {{"training loss per optimizer step", "optimizer step", "cross-entropy loss", loss, nl, false},
                       {"throughput per optimizer step (data loading included)", "optimizer step", "samples/s", sps, nl, false}};
    int rc = plot_figure(png, title, p, 2) < 0 ? fail_lib(png) : 0;
    free(mean);
    return rc;
}

int steplog_plot(run *r, const char *title) {
    if (!r->out.steps) return 0;
    char *path = path_join(r->out.dir, "steps.csv"), *scale_png = path_join(r->out.dir, "scale.png"), *steps_png = path_join(r->out.dir, "steps.png");
    step_rows d = {0};
    int rc = path && scale_png && steps_png ? read_steps(path, &d) : -1;
    if (rc == 0 && ampc_scaler_is_enabled(r->m.scaler)) rc = plot_scale(&d, scale_png);
    if (rc == 0) rc = plot_steps(&d, NULL, 1, steps_png, title);
    free(d.x);   /* the other columns are parts of it */
    free(path);
    free(scale_png);
    free(steps_png);
    return rc < 0 ? -1 : 0;
}

int steplog_compare_plot(const char *dir, const char *const names[2], const char *title) {
    step_rows d[2] = {{0}, {0}};
    char *p0 = path_join(dir, "fp32/steps.csv"), *p1 = path_join(dir, "amp/steps.csv"), *png = path_join(dir, "compare.png");
    int rc = p0 && p1 && png ? read_steps(p0, &d[0]) : -1;
    if (rc == 0) rc = read_steps(p1, &d[1]);
    if (rc == 0) rc = plot_steps(d, names, 2, png, title);
    free(d[0].x);
    free(d[1].x);
    free(p0);
    free(p1);
    free(png);
    return rc < 0 ? -1 : 0;   /* 0 too when a run has no steps.csv (--step-log no): no plot */
}

void steplog_close(run *r) {
    if (r->out.steps && ampc_metrics_close(r->out.steps) < 0) warn("steps.csv: %s", ampc_last_error());
    r->out.steps = NULL;
}
