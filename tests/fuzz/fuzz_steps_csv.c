/*
 * fuzz_steps_csv.c - ampc-train's steps.csv as a resumed run reads it (tools/train/steplog.c,
 * with report.c and options.c: AMPC_FUZZ_SOURCES_steps_csv): steplog_cut_back drops the rows past
 * the checkpoint (an older file's rows gaining samples_per_s, "nan"), ampc_metrics_open appends to
 * what is left, and steplog_plot parses it for scale.png and steps.png (plot_curves and
 * plot_figure are replaced here by checks of the series they are given).
 *
 * Input: the checkpoint's optimizer steps (2 bytes, little-endian), then the file. Besides the
 * sanitizers, the harness checks what the tool promises: the cut keeps the first line and only
 * whole lines, in order, whose step is at most the checkpoint's; the plot gets at most one point
 * per line, the skipped ones among them.
 */
#include "fuzz_common.h"

#include "plot.h"
#include "progress.h"
#include "train/train.h"

/* steplog.c's other neighbours in ampc-train, not under test */
double progress_now(void) { return 0; }
const char *doctor_blame(char *buf, size_t n) { return n ? (buf[0] = '\0', buf) : buf; }
char *path_join(const char *dir, const char *name) {
    char *p = NULL;
    return asprintf(&p, "%s/%s", dir, name) < 0 ? NULL : p;
}

static int g_lines;   /* lines of the file steplog_plot reads */

int plot_curves(const char *png_path, const char *title, const char *xlabel, const char *ylabel, const plot_series *series,
                int n_series) {
    (void)png_path, (void)title, (void)xlabel, (void)ylabel;
    if (n_series < 1 || n_series > 2 || series[0].n < 0 || series[0].n > g_lines) abort();
    if (n_series == 2 && (series[1].n < 1 || series[1].n > series[0].n)) abort();
    return 0;
}

/* steps.png: two panels of the same series count, each series at most one point per line */
int plot_figure(const char *png_path, const char *title, const plot_panel *panels, int n_panels) {
    (void)png_path, (void)title;
    if (n_panels != 2 || panels[0].n_series != panels[1].n_series || panels[0].n_series < 1) abort();
    for (int p = 0; p < n_panels; p++)
        for (int k = 0; k < panels[p].n_series; k++)
            if (panels[p].series[k].n < 0 || panels[p].series[k].n > g_lines) abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_begin();
    if (size < 2) return 0;
    const int64_t keep = (int64_t)data[0] | (int64_t)data[1] << 8;
    const uint8_t *old = data + 2;
    size_t n_old = size - 2;
    static char path[512];
    if (!path[0]) fuzz_path(path, sizeof path, "steps.csv");
    fuzz_write(path, old, n_old);
    /* an older ampc-train's steps.csv gains samples_per_s: the lines expected are the input's with
       the new header and ",nan" ending each whole row */
    static const char old_header[] = "step,epoch,batch,loss,scale,skipped,lr\n";
    uint8_t *upgraded = NULL;
    if (n_old >= sizeof old_header - 1 && !memcmp(old, old_header, sizeof old_header - 1)) {
        static const char new_header[] = "step,epoch,batch,loss,scale,skipped,lr,samples_per_s\n";
        upgraded = malloc(n_old * 5 + sizeof new_header);
        if (!upgraded) abort();
        size_t u = 0;
        memcpy(upgraded, new_header, sizeof new_header - 1);
        u = sizeof new_header - 1;
        for (size_t i = sizeof old_header - 1; i < n_old;) {
            const uint8_t *eol = memchr(old + i, '\n', n_old - i);
            const size_t len = eol ? (size_t)(eol - (old + i)) : n_old - i;
            memcpy(upgraded + u, old + i, len);
            u += len;
            if (eol) memcpy(upgraded + u, ",nan\n", 5), u += 5;
            i += len + (eol != NULL);
        }
        old = upgraded;
        n_old = u;
    }
    error_reset();
    int rc = steplog_cut_back(path, keep);
    fuzz_report("steplog_cut_back", rc == 0);
    if (rc < 0) {
        if (!g_err[0]) abort();
        return 0;
    }
    /* every line kept is a whole line of the input, in order; past the first, its step <= keep */
    size_t n;
    uint8_t *now = fuzz_read(path, &n);
    size_t at = 0;   /* the start of the next input line to match */
    g_lines = 0;
    for (size_t i = 0; i < n;) {
        const uint8_t *eol = memchr(now + i, '\n', n - i);
        if (!eol) abort();
        const size_t len = (size_t)(eol - (now + i)) + 1;
        for (;;) {   /* the input's lines from `at` on, whole: the first that equals it */
            const uint8_t *oe = at < n_old ? memchr(old + at, '\n', n_old - at) : NULL;
            if (!oe) abort();
            const size_t ol = (size_t)(oe - (old + at)) + 1, start = at;
            at += ol;
            if (ol == len && !memcmp(old + start, now + i, len)) {
                if ((i == 0) != (start == 0)) abort();   /* the header stays first */
                break;
            }
        }
        if (i) {
            char *end;
            long long step = strtoll((const char *)now + i, &end, 10);
            if (*end != ',' || step < 1 || step > keep) abort();
        }
        i += len;
        g_lines++;
    }
    free(now);
    free(upgraded);
    /* appended to (its header checked) and parsed for the plots, as a resumed run does */
    static const char *const cols[] = {"step", "epoch", "batch", "loss", "scale", "skipped", "lr", "samples_per_s"};
    run r = {0};
    r.out.dir = (char *)fuzz_dir();
    r.m.scaler = ampc_scaler_new(NULL);
    r.out.steps = ampc_metrics_open(path, cols, 8, true);
    fuzz_report("metrics_open append", r.out.steps != NULL);
    if (r.out.steps && r.m.scaler) {
        g_lines++;   /* the row appended */
        const double row[8] = {(double)keep + 1, 1, 1, 0.5, 65536, 1, 0.001, 1000};
        if (ampc_metrics_row(r.out.steps, row) < 0) abort();
        rc = steplog_plot(&r, "fuzz");
        fuzz_report("steplog_plot", rc == 0);
        if (rc < 0 && !g_err[0]) abort();
    }
    steplog_close(&r);
    ampc_scaler_free(r.m.scaler);
    return 0;
}
