/*
 * progress.c - the progress report of progress.h: a tqdm-style bar on a terminal
 *
 *     epoch 1/3 train  43%|█████▏      | 203/469 [00:12<00:16, 16.52it/s, loss=0.4123]
 *
 * redrawn in place with '\r' at most 10 times a second, or, when stdout is not a terminal (a log
 * file, a pipe, mpirun's forwarding), one plain line at each 10% of the loop so that the log stays
 * short and holds no '\r' or escape codes.
 */
#include "progress.h"

#include <errno.h>   /* program_invocation_short_name */
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

static progress_mode g_mode = PROGRESS_AUTO;

double progress_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* stdout decides: a log of it (tee, a file, mpirun) must not fill with redrawn bars, even when
   stderr, where the bar would go, is a terminal. */
progress_mode progress_detect(void) { return isatty(STDOUT_FILENO) ? PROGRESS_BAR : PROGRESS_LINES; }

void progress_set_mode(progress_mode mode) { g_mode = mode; }

/* The locale's charset as the environment names it (LC_ALL > LC_CTYPE > LANG), as a terminal
   that shows UTF-8 is configured; no setlocale, which would change the process's number format. */
static bool env_utf8(void) {
    const char *vars[] = {"LC_ALL", "LC_CTYPE", "LANG"};
    for (int i = 0; i < 3; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return strcasestr(v, "utf-8") || strcasestr(v, "utf8");
    }
    return false;
}

static int term_width(FILE *f) {
    struct winsize ws;
    if (ioctl(fileno(f), TIOCGWINSZ, &ws) == 0 && ws.ws_col >= 40) return ws.ws_col;
    const char *c = getenv("COLUMNS");
    int n = c ? atoi(c) : 0;
    return n >= 40 ? n : 80;
}

const char *progress_format_time(double s, char *buf, size_t n) {
    if (!(s >= 0) || !isfinite(s) || s > 1e9) {
        snprintf(buf, n, "?");
        return buf;
    }
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, n, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else snprintf(buf, n, "%02ld:%02ld", t / 60, t % 60);
    return buf;
}

void progress_begin(progress *p, const char *label, int64_t total, int64_t initial) {
    static bool noted;
    memset(p, 0, sizeof *p);
    p->mode = g_mode == PROGRESS_AUTO ? progress_detect() : g_mode;
    p->out = isatty(STDERR_FILENO) ? stderr : stdout;
    /* an explicit bar with no terminal to redraw it on would fill a file with '\r' and escape codes */
    if (p->mode == PROGRESS_BAR && !isatty(fileno(p->out))) {
        if (!noted)
            fprintf(stderr, "%s: --progress bar: neither stderr nor stdout is a terminal; a line per 10%% instead\n",
                    program_invocation_short_name);
        noted = true;
        p->mode = PROGRESS_LINES;
    }
    if (p->mode == PROGRESS_LINES) p->out = stdout;   /* lines belong to the log */
    snprintf(p->label, sizeof p->label, "%s", label);
    p->total = total > 0 ? total : 0;
    p->initial = initial < 0 ? 0 : initial < p->total ? initial : p->total;
    p->done = p->initial;
    p->t0 = progress_now();
    p->last_draw = -1;
    p->last_decile = p->total ? (int)(10 * p->initial / p->total) : 0;   /* the next line at the next 10% */
    p->utf8 = env_utf8();
}

/* This process's rate (steps per second since progress_begin) and the seconds left at it: the
   steps done before a resume took no time here, so they count in neither. */
static void rate_eta(const progress *p, double el, double *rate, double *eta) {
    *rate = el > 0 ? (double)(p->done - p->initial) / el : 0;
    *eta = *rate > 0 ? (double)(p->total - p->done) / *rate : -1;
}

/* The bar: "label  43%|█████▏     | 203/469 [00:12<00:16, 16.52it/s, loss=0.4123]" */
static void draw_bar(progress *p, double now) {
    double el = now - p->t0, rate, eta;
    rate_eta(p, el, &rate, &eta);
    double frac = p->total ? (double)p->done / (double)p->total : 1;
    char e1[32], e2[32], tail[256];
    snprintf(tail, sizeof tail, "| %lld/%lld [%s<%s, %.2fit/s%s%s]", (long long)p->done, (long long)p->total,
             progress_format_time(el, e1, sizeof e1), progress_format_time(eta, e2, sizeof e2), rate, p->postfix[0] ? ", " : "",
             p->postfix);
    char head[96];
    snprintf(head, sizeof head, "%s %3d%%|", p->label, (int)(100 * frac));
    int width = term_width(p->out) - 1;   /* the last column would wrap on some terminals */
    int bar = width - (int)strlen(head) - (int)strlen(tail);
    if (bar > 40) bar = 40;
    if (bar < 5) bar = 5;
    /* eighths of a cell, as tqdm draws them: U+2589..U+258F are 7/8..1/8 blocks */
    static const char *const eighths[8] = {" ", "\u258f", "\u258e", "\u258d", "\u258c", "\u258b", "\u258a", "\u2589"};
    char cells[40 * 4 + 1];
    size_t at = 0;
    int filled8 = (int)(frac * bar * 8);
    for (int i = 0; i < bar; i++) {
        int k = filled8 - 8 * i;
        const char *c = k >= 8 ? (p->utf8 ? "\u2588" : "#") : k <= 0 ? " " : (p->utf8 ? eighths[k] : " ");
        size_t l = strlen(c);
        memcpy(cells + at, c, l);
        at += l;
    }
    cells[at] = '\0';
    /* \x1b[K clears what a longer previous line left at the end */
    fprintf(p->out, "\r%s%s%s\x1b[K", head, cells, tail);
    fflush(p->out);
    p->last_draw = now;
}

static void draw_line(progress *p, double now) {
    double el = now - p->t0, rate, eta;
    rate_eta(p, el, &rate, &eta);
    char e1[32], e2[32];
    fprintf(p->out, "%s %3d%% %lld/%lld [%s elapsed, %s left, %.2f it/s]%s%s\n", p->label,
            p->total ? (int)(100 * p->done / p->total) : 100, (long long)p->done, (long long)p->total,
            progress_format_time(el, e1, sizeof e1), progress_format_time(eta, e2, sizeof e2), rate, p->postfix[0] ? " " : "",
            p->postfix);
    fflush(p->out);
}

void progress_update(progress *p, int64_t done, const char *fmt, ...) {
    if (p->mode == PROGRESS_OFF) return;
    p->done = done < p->total ? done : p->total;
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(p->postfix, sizeof p->postfix, fmt, ap);
        va_end(ap);
    }
    double now = progress_now();
    if (p->mode == PROGRESS_BAR) {
        if (p->done == p->total || p->last_draw < 0 || now - p->last_draw >= 0.1) draw_bar(p, now);
    } else {
        int decile = p->total ? (int)(10 * p->done / p->total) : 10;
        if (decile > p->last_decile && decile < 10) {   /* 100% is the epoch's own summary line */
            p->last_decile = decile;
            draw_line(p, now);
        }
    }
}

void progress_end(progress *p) {
    if (p->mode != PROGRESS_BAR) return;
    draw_bar(p, progress_now());
    fputc('\n', p->out);
    fflush(p->out);
}
