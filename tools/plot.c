/*
 * plot.c - training curves as PNG files, drawn with cairo into an image surface (headless), for
 * ampc-train (the library itself draws nothing and does not link cairo). Errors are recorded as
 * the library records its own (ampc_last_error), through its internal core.h.
 *
 * Every figure has its own surface and context (cairo keeps no current state, and fontconfig,
 * behind cairo's toy text API, is thread-safe), so figures draw concurrently; only the file step
 * is serialized, as the temporary name is one per process. cairo records a failure in the
 * context or surface instead of crashing: both statuses are checked before anything is written.
 * The PNG goes to "<path>.tmp.<pid>", is checked (signature and IEND chunk), then renamed.
 * Sizes follow matplotlib's defaults at 100 dpi: 10 pt text, 1.5 pt lines, 6 pt markers.
 */
#include "plot.h"

#include "core/core.h"

#include <cairo.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FIG_W 800
#define FIG_H1 600       /* a figure of one panel */
#define FIG_H_MORE 400   /* each panel beyond the first */
#define MAX_MARKERS 60   /* per series: more would hide the line */
#define FONT "sans-serif"
enum { FS_TICK = 13, FS_LABEL = 14, FS_TITLE = 16, FS_SUPTITLE = 17 };   /* pixels */
#define TICK_LEN 5.0
#define LINE_W 2.0
#define MARKER_R 3.5
#define SUPTITLE_BAND 40.0   /* pixels above the panels for the figure's title */

static pthread_mutex_t file_lock = PTHREAD_MUTEX_INITIALIZER;

#ifdef __SANITIZE_ADDRESS__
/* LeakSanitizer: fontconfig (behind cairo's text) keeps its font cache for the life of the
   process by design. Weak, so that a program's own suppression list wins. */
__attribute__((weak)) const char *__lsan_default_suppressions(void);
__attribute__((weak)) const char *__lsan_default_suppressions(void) { return "leak:libfontconfig.so\n"; }
#endif

/* matplotlib's "tab10" colours, cycled */
static const unsigned char palette[10][3] = {
    {31, 119, 180}, {255, 127, 14}, {44, 160, 44}, {214, 39, 40}, {148, 103, 189},
    {140, 86, 75},  {227, 119, 194}, {127, 127, 127}, {188, 189, 34}, {23, 190, 207},
};
enum { N_SHAPES = 5 };   /* circle, square, triangle up, diamond, triangle down */

typedef struct { double lo, hi; } range;              /* data units (log10 of y on a log axis) */
typedef struct { double x0, y0, x1, y1; } box;        /* pixels: left, top, right, bottom */
typedef struct { box a; range rx, ry; bool log_y; } frame;   /* a panel's plot area and its axes */
#define MAX_TICKS 24
typedef struct { double pos; char text[32], sup[8]; } tick;   /* sup: the exponent of "10^sup" */
typedef struct { tick t[MAX_TICKS]; int n; } ticks;

// ---------------------------------------------------------------------------------------------
// Data and axes

/* Point i of s in axis units; false for a point that is skipped (non-finite, or <= 0 on log y). */
static bool point(const plot_series *s, int i, bool log_y, double *x, double *y) {
    *x = s->x[i];
    *y = log_y ? (s->y[i] > 0 ? log10(s->y[i]) : NAN) : s->y[i];
    return isfinite(*x) && isfinite(*y);
}

/* Range padded by frac of its width; a single value gets a window around it. */
static void pad_range(range *r, double frac, bool log) {
    double w = r->hi - r->lo;
    if (w > 0 && isfinite(w)) {
        r->lo -= frac * w;
        r->hi += frac * w;
        return;
    }
    if (w > 0) return;   /* too wide to pad */
    double d = log ? 0.5 : r->lo != 0 ? fabs(r->lo) * 0.1 : 1.0;   /* half a decade on a log axis */
    r->lo -= d;
    r->hi += d;
}

static void data_ranges(const plot_panel *p, range *rx, range *ry) {
    *rx = *ry = (range){INFINITY, -INFINITY};
    for (int s = 0; s < p->n_series; s++)
        for (int i = 0; i < p->series[s].n; i++) {
            double x, y;
            if (!point(&p->series[s], i, p->log_y, &x, &y)) continue;
            rx->lo = fmin(rx->lo, x), rx->hi = fmax(rx->hi, x);
            ry->lo = fmin(ry->lo, y), ry->hi = fmax(ry->hi, y);
        }
    if (rx->lo > rx->hi) *rx = *ry = (range){0, 1};   /* nothing to draw: empty axes */
    pad_range(rx, 0.02, false);
    pad_range(ry, 0.05, p->log_y);
}

/* Axis units to pixels; halved first so that ranges near DBL_MAX don't overflow. */
static double px(const frame *f, double x) {
    return f->a.x0 + (x * 0.5 - f->rx.lo * 0.5) / (f->rx.hi * 0.5 - f->rx.lo * 0.5) * (f->a.x1 - f->a.x0);
}
static double py(const frame *f, double y) {
    return f->a.y1 - (y * 0.5 - f->ry.lo * 0.5) / (f->ry.hi * 0.5 - f->ry.lo * 0.5) * (f->a.y1 - f->a.y0);
}

/* The smallest step of 1, 2 or 5 times a power of ten that cuts span into at most target parts. */
static double nice_step(double span, int target) {
    double raw = span / target, mag = pow(10, floor(log10(raw)));
    static const double m[3] = {1, 2, 5};
    for (int k = 0; k < 3; k++)
        if (m[k] * mag >= raw * (1 - 1e-9)) return m[k] * mag;
    return 10 * mag;
}

static void linear_ticks(range r, int target, ticks *out) {
    out->n = 0;
    double span = r.hi - r.lo, step = span > 0 && isfinite(span) ? nice_step(span, target) : NAN;
    if (!(step > 0) || !isfinite(step)) return;
    double first = ceil(r.lo / step - 1e-9) * step, maxabs = fmax(fabs(r.lo), fabs(r.hi));
    int step_exp = (int)floor(log10(step) + 1e-9), dec = step_exp < 0 ? -step_exp : 0;
    int sig = (int)floor(log10(maxabs)) - step_exp + 1;
    bool fixed = maxabs < 1e6 && dec <= 6;   /* else %g: "1.5e+07", "2e-08" */
    sig = sig < 1 ? 1 : sig > 15 ? 15 : sig;
    for (int i = 0; out->n < MAX_TICKS; i++) {
        double v = first + i * step;
        if (v > r.hi + 1e-9 * step) break;
        if (fabs(v) < 1e-9 * step) v = 0;   /* not "-0.0" */
        tick *t = &out->t[out->n++];
        t->pos = v;
        t->sup[0] = '\0';
        snprintf(t->text, sizeof t->text, fixed ? "%.*f" : "%.*g", fixed ? dec : sig, v);
    }
}

/* r in decades: powers of ten when two or more fit, else 1, 2 and 5 times them, else linear steps. */
static void log_ticks(range r, int target, ticks *out) {
    out->n = 0;
    if (!(r.hi > r.lo)) return;
    if (floor(r.hi) - ceil(r.lo) >= 1) {
        double step = fmax(1, nice_step(r.hi - r.lo, target));   /* 1, 2, 5, 10... decades */
        for (double k = ceil(r.lo / step) * step; k <= r.hi && out->n < MAX_TICKS; k += step) {
            tick *t = &out->t[out->n++];
            t->pos = k;
            snprintf(t->text, sizeof t->text, "10");
            snprintf(t->sup, sizeof t->sup, "%d", (int)k);
        }
        return;
    }
    static const double m[3] = {1, 2, 5};
    for (int k = (int)floor(r.lo); k <= (int)ceil(r.hi); k++)
        for (int j = 0; j < 3 && out->n < MAX_TICKS; j++) {
            double pos = k + log10(m[j]);
            if (pos < r.lo || pos > r.hi) continue;
            tick *t = &out->t[out->n++];
            t->pos = pos;
            t->sup[0] = '\0';
            snprintf(t->text, sizeof t->text, "%g", m[j] * pow(10, k));
        }
    if (out->n >= 3) return;
    linear_ticks((range){pow(10, r.lo), pow(10, r.hi)}, target, out);
    int n = 0;
    for (int i = 0; i < out->n; i++)
        if (out->t[i].pos > 0) {
            out->t[n] = out->t[i];
            out->t[n++].pos = log10(out->t[i].pos);
        }
    out->n = n;
}

/* The corner of the plot area with the fewest points near it: 0 top-right, 1 top-left,
   2 bottom-right, 3 bottom-left. */
static int legend_corner(const plot_panel *p, const frame *f) {
    int count[4] = {0, 0, 0, 0};
    for (int s = 0; s < p->n_series; s++)
        for (int i = 0; i < p->series[s].n; i++) {
            double x, y;
            if (!point(&p->series[s], i, p->log_y, &x, &y)) continue;
            double u = (px(f, x) - f->a.x0) / (f->a.x1 - f->a.x0), v = (f->a.y1 - py(f, y)) / (f->a.y1 - f->a.y0);
            if (u > 0.55 && v > 0.6) count[0]++;
            if (u < 0.45 && v > 0.6) count[1]++;
            if (u > 0.55 && v < 0.4) count[2]++;
            if (u < 0.45 && v < 0.4) count[3]++;
        }
    int best = 0;
    for (int k = 1; k < 4; k++)
        if (count[k] < count[best]) best = k;
    return best;
}

// ---------------------------------------------------------------------------------------------
// Text

/* s as valid UTF-8 in buf (cap bytes): cairo refuses anything else, and its refusal would fail
   the whole figure, so invalid bytes become '?'. Long text is cut. */
static const char *utf8_clean(const char *s, char *buf, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; s && s[i] && o + 5 < cap;) {
        unsigned char c = (unsigned char)s[i];
        int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        unsigned cp = len == 1 ? c : len ? c & (0x7fu >> len) : 0;
        bool ok = len > 0;
        for (int k = 1; ok && k < len; k++) {
            ok = ((unsigned char)s[i + k] >> 6) == 2;   /* stops at the NUL too */
            cp = cp << 6 | ((unsigned char)s[i + k] & 0x3f);
        }
        static const unsigned min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};   /* shorter forms are invalid */
        ok = ok && cp >= min_cp[len] && cp <= 0x10ffff && (cp < 0xd800 || cp > 0xdfff);
        if (!ok) len = 1;
        for (int k = 0; k < len; k++) buf[o++] = ok ? s[i + k] : '?';
        i += (size_t)len;
    }
    buf[o] = '\0';
    return buf;
}

static double text_width(cairo_t *cr, const char *s, double size) {
    char b[256];
    cairo_text_extents_t e;
    cairo_set_font_size(cr, size);
    cairo_text_extents(cr, utf8_clean(s, b, sizeof b), &e);
    return e.x_advance;
}

/* s with its baseline at y, its left (ax 0), centre (0.5) or right end (1) at x. */
static void text_at(cairo_t *cr, const char *s, double size, double x, double y, double ax) {
    char b[256];
    double w = text_width(cr, s, size);
    cairo_move_to(cr, x - ax * w, y);
    cairo_show_text(cr, utf8_clean(s, b, sizeof b));
}

#define SUP_SCALE 0.7   /* an exponent's size, raised by half the text's */
static double tick_width(cairo_t *cr, const tick *t) {
    return text_width(cr, t->text, FS_TICK) + (t->sup[0] ? text_width(cr, t->sup, FS_TICK * SUP_SCALE) : 0);
}

static void tick_label(cairo_t *cr, const tick *t, double x, double y, double ax) {
    double w = tick_width(cr, t), base = text_width(cr, t->text, FS_TICK);
    text_at(cr, t->text, FS_TICK, x - ax * w, y, 0);
    if (t->sup[0]) text_at(cr, t->sup, FS_TICK * SUP_SCALE, x - ax * w + base, y - 0.5 * FS_TICK, 0);
}

// ---------------------------------------------------------------------------------------------
// Drawing

static void set_rgb(cairo_t *cr, const unsigned char c[3]) { cairo_set_source_rgb(cr, c[0] / 255.0, c[1] / 255.0, c[2] / 255.0); }

static void marker_path(cairo_t *cr, int shape, double x, double y) {
    const double r = MARKER_R;
    cairo_new_sub_path(cr);
    switch (shape) {
    case 0: cairo_arc(cr, x, y, r, 0, 2 * M_PI); return;
    case 1: cairo_rectangle(cr, x - 0.9 * r, y - 0.9 * r, 1.8 * r, 1.8 * r); return;
    case 2: case 4: {
        double s = shape == 2 ? 1 : -1;   /* apex up or down */
        cairo_move_to(cr, x, y - s * 1.2 * r);
        cairo_line_to(cr, x + 1.1 * r, y + s * 0.8 * r);
        cairo_line_to(cr, x - 1.1 * r, y + s * 0.8 * r);
        break;
    }
    default:
        cairo_move_to(cr, x, y - 1.25 * r);
        cairo_line_to(cr, x + r, y);
        cairo_line_to(cr, x, y + 1.25 * r);
        cairo_line_to(cr, x - r, y);
    }
    cairo_close_path(cr);
}

/* Series k of the panel: lines through runs of drawn points, then markers (every stride-th
   point and the last, or all of a points_only series). */
static void draw_series(cairo_t *cr, const plot_panel *p, int k, const frame *f) {
    const plot_series *s = &p->series[k];
    set_rgb(cr, palette[k % 10]);
    int n_drawn = 0;
    bool in_run = false;
    for (int i = 0; i < s->n; i++) {
        double x, y;
        bool ok = point(s, i, p->log_y, &x, &y);
        n_drawn += ok;
        if (ok && !s->points_only) (in_run ? cairo_line_to : cairo_move_to)(cr, px(f, x), py(f, y));
        in_run = ok;
    }
    cairo_set_line_width(cr, LINE_W);
    cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
    cairo_stroke(cr);
    int stride = n_drawn > MAX_MARKERS && !s->points_only ? (n_drawn + MAX_MARKERS - 1) / MAX_MARKERS : 1;
    for (int i = 0, m = 0; i < s->n; i++) {
        double x, y;
        if (!point(s, i, p->log_y, &x, &y)) continue;
        if (m++ % stride == 0 || m == n_drawn) marker_path(cr, k % N_SHAPES, px(f, x), py(f, y));
    }
    cairo_fill(cr);
}

static void draw_legend(cairo_t *cr, const plot_panel *p, const frame *f) {
    enum { PAD = 8, SAMPLE = 28, GAP = 8, ROW = 20, INSET = 10 };
    double text_w = 0;
    int n = 0;
    for (int s = 0; s < p->n_series; s++)
        if (p->series[s].name && p->series[s].name[0]) {
            text_w = fmax(text_w, text_width(cr, p->series[s].name, FS_TICK));
            n++;
        }
    if (n == 0) return;
    double w = 2 * PAD + SAMPLE + GAP + text_w, h = 2 * PAD + n * ROW - (ROW - FS_TICK);
    int corner = legend_corner(p, f);
    double x = corner % 2 == 0 ? f->a.x1 - INSET - w : f->a.x0 + INSET, y = corner < 2 ? f->a.y0 + INSET : f->a.y1 - INSET - h;
    x = round(x) + 0.5, y = round(y) + 0.5;
    const double r = 4;   /* matplotlib's rounded box: white at 0.8 alpha, light grey edge */
    cairo_new_sub_path(cr);
    cairo_arc(cr, x + w - r, y + r, r, -M_PI / 2, 0);
    cairo_arc(cr, x + w - r, y + h - r, r, 0, M_PI / 2);
    cairo_arc(cr, x + r, y + h - r, r, M_PI / 2, M_PI);
    cairo_arc(cr, x + r, y + r, r, M_PI, 1.5 * M_PI);
    cairo_close_path(cr);
    cairo_set_source_rgba(cr, 1, 1, 1, 0.8);
    cairo_fill_preserve(cr);
    cairo_set_source_rgb(cr, 0.8, 0.8, 0.8);
    cairo_set_line_width(cr, 1);
    cairo_stroke(cr);
    double row_y = y + PAD + FS_TICK / 2.0;   /* the middle of the first row */
    for (int s = 0; s < p->n_series; s++) {
        const plot_series *sr = &p->series[s];
        if (!sr->name || !sr->name[0]) continue;
        set_rgb(cr, palette[s % 10]);
        if (!sr->points_only) {
            cairo_move_to(cr, x + PAD, row_y);
            cairo_line_to(cr, x + PAD + SAMPLE, row_y);
            cairo_set_line_width(cr, LINE_W);
            cairo_stroke(cr);
        }
        marker_path(cr, s % N_SHAPES, x + PAD + SAMPLE / 2.0, row_y);
        cairo_fill(cr);
        cairo_set_source_rgb(cr, 0, 0, 0);
        text_at(cr, sr->name, FS_TICK, x + PAD + SAMPLE + GAP, row_y + 0.36 * FS_TICK, 0);
        row_y += ROW;
    }
}

static void draw_panel(cairo_t *cr, const plot_panel *p, const frame *f, const ticks *xt, const ticks *yt) {
    const box *a = &f->a;
    cairo_set_line_width(cr, 1);   /* grid: 1 px lines on pixel centres */
    cairo_set_source_rgb(cr, 0.88, 0.88, 0.88);
    for (int i = 0; i < xt->n; i++) {
        double x = round(px(f, xt->t[i].pos)) + 0.5;
        cairo_move_to(cr, x, a->y0);
        cairo_line_to(cr, x, a->y1);
    }
    for (int i = 0; i < yt->n; i++) {
        double y = round(py(f, yt->t[i].pos)) + 0.5;
        cairo_move_to(cr, a->x0, y);
        cairo_line_to(cr, a->x1, y);
    }
    cairo_stroke(cr);

    cairo_save(cr);
    cairo_rectangle(cr, a->x0, a->y0, a->x1 - a->x0, a->y1 - a->y0);
    cairo_clip(cr);
    for (int s = 0; s < p->n_series; s++) draw_series(cr, p, s, f);
    cairo_restore(cr);

    cairo_set_source_rgb(cr, 0, 0, 0);   /* frame, ticks outward, labels */
    cairo_set_line_width(cr, 1);
    cairo_rectangle(cr, a->x0 - 0.5, a->y0 - 0.5, a->x1 - a->x0 + 1, a->y1 - a->y0 + 1);
    for (int i = 0; i < xt->n; i++) {
        double x = round(px(f, xt->t[i].pos)) + 0.5;
        cairo_move_to(cr, x, a->y1 + 0.5);
        cairo_line_to(cr, x, a->y1 + 0.5 + TICK_LEN);
    }
    for (int i = 0; i < yt->n; i++) {
        double y = round(py(f, yt->t[i].pos)) + 0.5;
        cairo_move_to(cr, a->x0 - 0.5, y);
        cairo_line_to(cr, a->x0 - 0.5 - TICK_LEN, y);
    }
    cairo_stroke(cr);
    double digit_h = 0.72 * FS_TICK;   /* DejaVu Sans' figure height */
    for (int i = 0; i < xt->n; i++) tick_label(cr, &xt->t[i], round(px(f, xt->t[i].pos)) + 0.5, a->y1 + TICK_LEN + 4 + digit_h, 0.5);
    for (int i = 0; i < yt->n; i++) tick_label(cr, &yt->t[i], a->x0 - TICK_LEN - 4, round(py(f, yt->t[i].pos)) + 0.5 + digit_h / 2, 1);
    double mid_x = (a->x0 + a->x1) / 2, mid_y = (a->y0 + a->y1) / 2;
    if (p->xlabel) text_at(cr, p->xlabel, FS_LABEL, mid_x, a->y1 + TICK_LEN + 4 + FS_TICK + 10 + FS_LABEL, 0.5);
    if (p->title) text_at(cr, p->title, FS_TITLE, mid_x, a->y0 - 12, 0.5);
    if (p->ylabel) {
        cairo_save(cr);
        cairo_translate(cr, 14 + FS_LABEL * 0.8, mid_y);
        cairo_rotate(cr, -M_PI / 2);
        text_at(cr, p->ylabel, FS_LABEL, 0, 0, 0.5);
        cairo_restore(cr);
    }
    draw_legend(cr, p, f);
}

/* The whole figure; its failures stay in cr's status. */
static void draw_figure(cairo_t *cr, const char *title, const plot_panel *panels, int n_panels, double height) {
    enum { MAXP = PLOT_MAX_PANELS };
    frame f[MAXP];
    ticks xt[MAXP], yt[MAXP];
    cairo_set_source_rgb(cr, 1, 1, 1);
    cairo_paint(cr);
    cairo_select_font_face(cr, FONT, CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    double top = title && title[0] ? SUPTITLE_BAND : 0, panel_h = (height - top) / n_panels, left = 0;
    for (int i = 0; i < n_panels; i++) {   /* rows first: the y ticks' widths set the common left edge */
        double y0 = top + i * panel_h;
        f[i].a.y0 = round(y0 + (panels[i].title ? 44 : 20));
        f[i].a.y1 = round(y0 + panel_h - 62);
        f[i].log_y = panels[i].log_y;
        data_ranges(&panels[i], &f[i].rx, &f[i].ry);
        int target = (int)fmin(10, fmax(3, (f[i].a.y1 - f[i].a.y0) / 60));
        (panels[i].log_y ? log_ticks : linear_ticks)(f[i].ry, target, &yt[i]);
        for (int k = 0; k < yt[i].n; k++) left = fmax(left, tick_width(cr, &yt[i].t[k]));
    }
    left = round(14 + FS_LABEL * 1.2 + 10 + left + 4 + TICK_LEN);
    for (int i = 0; i < n_panels; i++) {
        f[i].a.x0 = left;
        f[i].a.x1 = FIG_W - 28;
        linear_ticks(f[i].rx, (int)fmin(10, fmax(3, (f[i].a.x1 - f[i].a.x0) / 90)), &xt[i]);
        draw_panel(cr, &panels[i], &f[i], &xt[i], &yt[i]);
    }
    cairo_set_source_rgb(cr, 0, 0, 0);
    if (top > 0) text_at(cr, title, FS_SUPTITLE, FIG_W / 2.0, 27, 0.5);
}

// ---------------------------------------------------------------------------------------------
// The file

static int cairo_failed(const char *png_path, cairo_status_t st) {
    return ampc__err(st == CAIRO_STATUS_NO_MEMORY ? AMPC_ERR_OOM : AMPC_ERR_BACKEND, "plot '%s': cairo: %s", png_path,
                     cairo_status_to_string(st));
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

typedef struct { FILE *f; int err; } png_sink;

static cairo_status_t sink_write(void *closure, const unsigned char *data, unsigned int len) {
    png_sink *s = closure;
    errno = 0;
    if (fwrite(data, 1, len, s->f) == len) return CAIRO_STATUS_SUCCESS;
    s->err = errno ? errno : EIO;
    return CAIRO_STATUS_WRITE_ERROR;
}

/* The surface as a PNG at png_path, through "<png_path>.tmp.<pid>" (removed on failure). */
static int write_png(cairo_surface_t *sf, const char *png_path) {
    char *tmp = NULL;
    if (asprintf(&tmp, "%s.tmp.%ld", png_path, (long)getpid()) < 0) return ampc__err(AMPC_ERR_OOM, "plot '%s': out of memory", png_path);
    ampc__remove_stale_temps(png_path);   /* left by a process killed while writing */
    int rc = AMPC_OK;
    pthread_mutex_lock(&file_lock);
    FILE *f = (unlink(tmp), fopen(tmp, "wbx"));   /* a new file, never one placed there */
    if (!f) {
        rc = ampc__err(AMPC_ERR_IO, "plot '%s': can't create '%s': %s", png_path, tmp, strerror(errno));
    } else {
        png_sink sink = {f, 0};
        cairo_status_t st = cairo_surface_write_to_png_stream(sf, sink_write, &sink);
        int close_err = fclose(f) != 0 ? errno : 0;
        if (sink.err || close_err)
            rc = ampc__err(AMPC_ERR_IO, "plot '%s': can't write '%s': %s", png_path, tmp, strerror(sink.err ? sink.err : close_err));
        else if (st != CAIRO_STATUS_SUCCESS)
            rc = cairo_failed(png_path, st);
        else if (!png_complete(tmp))
            rc = ampc__err(AMPC_ERR_IO, "plot '%s': '%s' is not a complete PNG after writing (disk full?)", png_path, tmp);
        else if (rename(tmp, png_path) != 0)
            rc = ampc__err(AMPC_ERR_IO, "plot '%s': can't rename '%s' to it: %s", png_path, tmp, strerror(errno));
        if (rc < 0) unlink(tmp);
    }
    pthread_mutex_unlock(&file_lock);
    free(tmp);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// API

int plot_figure(const char *png_path, const char *title, const plot_panel *panels, int n_panels) {
    ampc__ensure_init();
    if (!png_path || !panels || n_panels < 1 || n_panels > PLOT_MAX_PANELS)
        return ampc__err(AMPC_ERR_INVALID, "plot: need a path and 1 to %d panels (got %d)", PLOT_MAX_PANELS, n_panels);
    for (int p = 0; p < n_panels; p++) {
        const plot_panel *pn = &panels[p];
        if (!pn->series || pn->n_series < 1)
            return ampc__err(AMPC_ERR_INVALID, "plot '%s': panel %d needs at least one series (got %d)", png_path, p,
                             pn->series ? pn->n_series : 0);
        for (int s = 0; s < pn->n_series; s++) {
            const plot_series *sr = &pn->series[s];
            if (sr->n < 0 || (sr->n > 0 && (!sr->x || !sr->y)))
                return ampc__err(AMPC_ERR_INVALID, "plot '%s': panel %d series %d ('%s') has %d points and %s data", png_path,
                                 p, s, sr->name ? sr->name : "", sr->n, sr->x && sr->y ? "its" : "NULL");
        }
    }
    int height = FIG_H1 + FIG_H_MORE * (n_panels - 1);
    cairo_surface_t *sf = cairo_image_surface_create(CAIRO_FORMAT_RGB24, FIG_W, height);
    cairo_t *cr = cairo_create(sf);   /* on a failed surface: a context in the error state */
    draw_figure(cr, title, panels, n_panels, height);
    cairo_surface_flush(sf);
    cairo_status_t st = cairo_status(cr);
    if (st == CAIRO_STATUS_SUCCESS) st = cairo_surface_status(sf);
    int rc = st == CAIRO_STATUS_SUCCESS ? write_png(sf, png_path) : cairo_failed(png_path, st);
    cairo_destroy(cr);
    cairo_surface_destroy(sf);
    return rc;
}

int plot_curves(const char *png_path, const char *title, const char *xlabel, const char *ylabel,
                const plot_series *series, int n_series) {
    plot_panel p = {title, xlabel, ylabel, series, n_series, false};
    return plot_figure(png_path, NULL, &p, 1);
}
