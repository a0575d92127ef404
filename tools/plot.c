/*
 * plot.c - training curves as PNG files, drawn with PLplot's pngcairo device (headless), for
 * ampc-train (the library itself draws nothing and does not link PLplot). Errors are recorded
 * as the library records its own (ampc_last_error), through its internal core.h.
 *
 * PLplot keeps global state (a current stream) and ends the process on fatal errors (plexit
 * calls exit), so this file is careful:
 * - one lock around everything, and a fresh stream per plot (plmkstrm ... plend1), the caller's
 *   current stream restored after;
 * - the driver is checked to exist (plgDevs) before plinit, which would otherwise prompt;
 * - the output file is opened here and handed over with plsfile (PLplot closes it), so an
 *   unwritable path is our error, not PLplot's exit;
 * - axis ranges are always non-empty and finite, so no call aborts on its arguments.
 * The PNG goes to "<path>.tmp.<pid>", is checked (signature and IEND chunk), then renamed.
 */
#include "plot.h"

#include "core/core.h"

#include <errno.h>
#include <math.h>
#include <plplot.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PLOT_W 800
#define PLOT_H 600
#define MAX_MARKERS 60   /* per series: more would hide the line */

static pthread_mutex_t plot_lock = PTHREAD_MUTEX_INITIALIZER;

#ifdef __SANITIZE_ADDRESS__
/* LeakSanitizer: fontconfig (loaded by the cairo/pango driver) keeps its font cache for the life
   of the process by design. Weak, so that a program's own suppression list wins. */
__attribute__((weak)) const char *__lsan_default_suppressions(void);
__attribute__((weak)) const char *__lsan_default_suppressions(void) { return "leak:libfontconfig.so\n"; }
#endif

/* matplotlib's "tab10" colours, cycled; cmap0 entries 2.. (0 background, 1 axes, 15 grid) */
static const unsigned char palette[10][3] = {
    {31, 119, 180}, {255, 127, 14}, {44, 160, 44}, {214, 39, 40}, {148, 103, 189},
    {140, 86, 75},  {227, 119, 194}, {127, 127, 127}, {188, 189, 34}, {23, 190, 207},
};
#define GRID_COLOR 15
static const char *const markers[] = {"●", "■", "▲", "◆", "▼"};
#define N_MARKERS ((int)(sizeof markers / sizeof markers[0]))

// ---------------------------------------------------------------------------------------------
// Helpers

/* PLplot treats '#' as its escape character: "##" is a literal '#'. */
static char *pl_text(const char *s) {
    if (!s) s = "";
    size_t n = strlen(s), extra = 0;
    for (size_t i = 0; i < n; i++) extra += s[i] == '#';
    char *o = malloc(n + extra + 1), *q = o;
    if (!o) return NULL;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '#') *q++ = '#';
        *q++ = s[i];
    }
    *q = '\0';
    return o;
}

static bool has_pngcairo(void) {
    enum { MAX_DEVS = 128 };
    const char *menu[MAX_DEVS], *names[MAX_DEVS];
    const char **pm = menu, **pn = names;   /* plgDevs fills the caller's arrays */
    int n = MAX_DEVS;
    plgDevs(&pm, &pn, &n);
    for (int i = 0; i < n; i++)
        if (names[i] && strcmp(names[i], "pngcairo") == 0) return true;
    return false;
}

/* Range [lo, hi] padded by frac of its width; a single value gets a window around it. */
static void pad_range(double *lo, double *hi, double frac) {
    double w = *hi - *lo;
    if (w > 0 && isfinite(w)) {
        *lo -= frac * w;
        *hi += frac * w;
        return;
    }
    if (w > 0) return;   /* too wide to pad */
    double d = *lo != 0 ? fabs(*lo) * 0.1 : 1.0;
    *lo -= d;
    *hi += d;
}

/* A PNG starts with its signature and ends with an IEND chunk. */
static bool png_complete(const char *path) {
    static const unsigned char sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    static const unsigned char iend[12] = {0, 0, 0, 0, 'I', 'E', 'N', 'D', 0xae, 0x42, 0x60, 0x82};
    FILE *f = ampc__fopen_regular(path, "plot", NULL);   /* our own temporary file, but never block on a FIFO */
    if (!f) return false;
    unsigned char head[8], tail[12];
    bool ok = fread(head, 1, 8, f) == 8 && memcmp(head, sig, 8) == 0 && fseek(f, -12, SEEK_END) == 0 &&
              fread(tail, 1, 12, f) == 12 && memcmp(tail, iend, 12) == 0;
    fclose(f);
    return ok;
}

/* The corner of the viewport with the fewest points near it, for the legend. */
static PLINT legend_corner(const plot_series *series, int n_series, double x0, double x1, double y0, double y1) {
    int count[4] = {0, 0, 0, 0};   /* top-right, top-left, bottom-right, bottom-left */
    for (int s = 0; s < n_series; s++)
        for (int i = 0; i < series[s].n; i++) {
            double x = series[s].x[i], y = series[s].y[i];
            if (!isfinite(x) || !isfinite(y)) continue;
            double u = (x - x0) / (x1 - x0), v = (y - y0) / (y1 - y0);
            if (u > 0.55 && v > 0.6) count[0]++;
            if (u < 0.45 && v > 0.6) count[1]++;
            if (u > 0.55 && v < 0.4) count[2]++;
            if (u < 0.45 && v < 0.4) count[3]++;
        }
    int best = 0;
    for (int k = 1; k < 4; k++)
        if (count[k] < count[best]) best = k;
    static const PLINT pos[4] = {PL_POSITION_TOP | PL_POSITION_RIGHT, PL_POSITION_TOP | PL_POSITION_LEFT,
                                 PL_POSITION_BOTTOM | PL_POSITION_RIGHT, PL_POSITION_BOTTOM | PL_POSITION_LEFT};
    return pos[best] | PL_POSITION_INSIDE | PL_POSITION_VIEWPORT;
}

// ---------------------------------------------------------------------------------------------
// Drawing (the lock is held and a fresh stream is current)

typedef struct {
    char *title, *xlabel, *ylabel;
    char **names;
    PLFLT *px, *py;   /* scratch for one run of finite points */
} plot_texts;

static void draw(const plot_series *series, int n_series, const plot_texts *t, double x0, double x1, double y0,
                 double y1) {
    pladv(0);
    plvsta();
    plwind(x0, x1, y0, y1);
    plwidth(1.0);
    plcol0(GRID_COLOR);
    plbox("g", 0.0, 0, "g", 0.0, 0);
    plcol0(1);
    plbox("bcnst", 0.0, 0, "bcnstv", 0.0, 0);
    pllab(t->xlabel, t->ylabel, t->title);

    for (int s = 0; s < n_series; s++) {
        const plot_series *sr = &series[s];
        plcol0(2 + s % 10);
        plwidth(2.0);
        int run = 0;
        for (int i = 0; !sr->points_only && i <= sr->n; i++) {   /* lines through runs of finite points */
            bool ok = i < sr->n && isfinite(sr->x[i]) && isfinite(sr->y[i]);
            if (ok) {
                t->px[run] = sr->x[i];
                t->py[run] = sr->y[i];
                run++;
            } else {
                if (run >= 2) plline(run, t->px, t->py);
                run = 0;
            }
        }
        int n_fin = 0;
        for (int i = 0; i < sr->n; i++)
            if (isfinite(sr->x[i]) && isfinite(sr->y[i])) n_fin++;
        int stride = n_fin > MAX_MARKERS && !sr->points_only ? (n_fin + MAX_MARKERS - 1) / MAX_MARKERS : 1;
        int k = 0, m = 0;
        for (int i = 0; i < sr->n; i++) {
            if (!isfinite(sr->x[i]) || !isfinite(sr->y[i])) continue;
            if (k++ % stride == 0 || k == n_fin) {   /* every stride-th point and the last */
                t->px[m] = sr->x[i];
                t->py[m] = sr->y[i];
                m++;
            }
        }
        if (m) plstring(m, t->px, t->py, markers[s % N_MARKERS]);
    }

    enum { MAXL = 64 };
    int nl = n_series < MAXL ? n_series : MAXL;
    PLINT opt_array[MAXL], text_colors[MAXL], line_colors[MAXL], line_styles[MAXL], symbol_colors[MAXL],
        symbol_numbers[MAXL];
    PLFLT line_widths[MAXL], symbol_scales[MAXL];
    const char *text[MAXL], *symbols[MAXL];
    for (int s = 0; s < nl; s++) {
        opt_array[s] = series[s].points_only ? PL_LEGEND_SYMBOL : PL_LEGEND_LINE | PL_LEGEND_SYMBOL;
        text_colors[s] = 1;
        text[s] = t->names[s];
        line_colors[s] = symbol_colors[s] = 2 + s % 10;
        line_styles[s] = 1;
        line_widths[s] = 2.0;
        symbol_scales[s] = 1.0;
        symbol_numbers[s] = 1;
        symbols[s] = markers[s % N_MARKERS];
    }
    PLFLT lw, lh;
    plwidth(1.0);
    pllegend(&lw, &lh, PL_LEGEND_BACKGROUND | PL_LEGEND_BOUNDING_BOX, legend_corner(series, n_series, x0, x1, y0, y1), 0.02,
             0.03, 0.08, 0, 1, 1, 0, 0, nl, opt_array, 1.0, 0.9, 2.0, 0.0, text_colors, text, NULL, NULL, NULL, NULL,
             line_colors, line_styles, line_widths, symbol_colors, symbol_scales, symbol_numbers, symbols);
}

// ---------------------------------------------------------------------------------------------
// API

int plot_curves(const char *png_path, const char *title, const char *xlabel, const char *ylabel,
                const plot_series *series, int n_series) {
    ampc__ensure_init();
    if (!png_path || !series || n_series < 1)
        return ampc__err(AMPC_ERR_INVALID, "plot: need a path and at least one series (got %d)", n_series);
    int max_n = 1;
    double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
    for (int s = 0; s < n_series; s++) {
        const plot_series *sr = &series[s];
        if (sr->n < 0 || (sr->n > 0 && (!sr->x || !sr->y)))
            return ampc__err(AMPC_ERR_INVALID, "plot '%s': series %d ('%s') has %d points and %s data", png_path, s,
                             sr->name ? sr->name : "", sr->n, sr->x && sr->y ? "its" : "NULL");
        if (sr->n > max_n) max_n = sr->n;
        for (int i = 0; i < sr->n; i++) {
            if (!isfinite(sr->x[i]) || !isfinite(sr->y[i])) continue;
            x0 = fmin(x0, sr->x[i]), x1 = fmax(x1, sr->x[i]);
            y0 = fmin(y0, sr->y[i]), y1 = fmax(y1, sr->y[i]);
        }
    }
    if (x0 > x1) x0 = 0, x1 = 1, y0 = 0, y1 = 1;   /* nothing finite: empty axes */
    pad_range(&x0, &x1, 0.02);
    pad_range(&y0, &y1, 0.05);

    plot_texts t = {pl_text(title), pl_text(xlabel), pl_text(ylabel), calloc((size_t)n_series, sizeof(char *)),
                    malloc((size_t)max_n * sizeof(PLFLT)), malloc((size_t)max_n * sizeof(PLFLT))};
    bool oom = !t.title || !t.xlabel || !t.ylabel || !t.names || !t.px || !t.py;
    for (int s = 0; s < n_series && !oom; s++) oom = !(t.names[s] = pl_text(series[s].name));
    char *tmp = NULL;
    int rc = AMPC_OK;
    if (oom || !(tmp = malloc(strlen(png_path) + 32))) rc = ampc__err(AMPC_ERR_OOM, "plot '%s': out of memory", png_path);
    if (rc == AMPC_OK) {
        sprintf(tmp, "%s.tmp.%ld", png_path, (long)getpid());
        ampc__remove_stale_temps(png_path);   /* left by a process killed while drawing */
        pthread_mutex_lock(&plot_lock);
        FILE *f = NULL;
        if (!has_pngcairo()) {
            rc = ampc__err(AMPC_ERR_UNSUPPORTED, "plot '%s': PLplot's pngcairo driver is not installed (plplot-driver-cairo)", png_path);
        } else if (!(unlink(tmp), f = fopen(tmp, "wbx"))) {
            rc = ampc__err(AMPC_ERR_IO, "plot '%s': can't create '%s': %s", png_path, tmp, strerror(errno));
        } else {
            PLINT old, strm = -1;
            plgstrm(&old);
            plmkstrm(&strm);
            if (strm < 0) {
                fclose(f);
                rc = ampc__err(AMPC_ERR_BACKEND, "plot '%s': PLplot can't create a new stream", png_path);
            } else {
                plsdev("pngcairo");
                plsfile(f);   /* PLplot closes it at plend1 */
                plspage(0.0, 0.0, PLOT_W, PLOT_H, 0, 0);
                plscolbg(255, 255, 255);
                plscol0(1, 0, 0, 0);
                for (int k = 0; k < 10; k++) plscol0(2 + k, palette[k][0], palette[k][1], palette[k][2]);
                plscol0(GRID_COLOR, 220, 220, 220);
                plinit();
                draw(series, n_series, &t, x0, x1, y0, y1);
                plend1();
            }
            plsstrm(old);
            if (rc == AMPC_OK && !png_complete(tmp))
                rc = ampc__err(AMPC_ERR_IO, "plot '%s': PLplot did not write a complete PNG (disk full?)", png_path);
            if (rc == AMPC_OK && rename(tmp, png_path) != 0)
                rc = ampc__err(AMPC_ERR_IO, "plot '%s': can't rename '%s' to it: %s", png_path, tmp, strerror(errno));
            if (rc < 0) unlink(tmp);
        }
        pthread_mutex_unlock(&plot_lock);
    }
    free(tmp);
    for (int s = 0; t.names && s < n_series; s++) free(t.names[s]);
    free(t.names);
    free(t.title);
    free(t.xlabel);
    free(t.ylabel);
    free(t.px);
    free(t.py);
    return rc;
}
