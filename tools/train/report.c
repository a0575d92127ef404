/*
 * report.c - how ampc-train tells the user what went wrong: the first error is kept and printed
 * once, by main, as the program's only error line ("ampc-train: error: ..."); warnings go to
 * stderr at once. And the formatting of numbers those lines and the tables share.
 */
#include "train.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>

char g_err[2048];
int g_err_status;
int g_exit = 1;
bool g_usage;
bool g_interrupt;
bool g_job_error;
const char *g_oom_hint = "try a smaller --batch-size or --use-amp yes";

// ---------------------------------------------------------------------------------------------
// Errors

static void keep(const char *fmt, va_list ap) {
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    for (char *c = g_err; *c; c++)   /* one line, whatever a message holds */
        if (*c == '\n' || *c == '\r') *c = ' ';
}

int fail(const char *fmt, ...) {
    if (g_err[0]) return -1;
    va_list ap;
    va_start(ap, fmt);
    keep(fmt, ap);
    va_end(ap);
    return -1;
}

void error_where(const char *fmt, ...) {
    char where[256], was[sizeof g_err];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(where, sizeof where, fmt, ap);
    va_end(ap);
    memcpy(was, g_err, sizeof was);
    size_t at = 0;
    appendf(g_err, sizeof g_err, &at, "%s: ", where);
    appendf(g_err, sizeof g_err, &at, "%s", was);
}

int fail_lib(const char *what) {
    if (!g_err[0]) g_err_status = ampc_last_status();
    return fail("%s: %s", what, ampc_last_error());
}

int usage_error(const char *fmt, ...) {
    if (g_err[0]) return -1;
    va_list ap;
    va_start(ap, fmt);
    keep(fmt, ap);
    va_end(ap);
    g_exit = 2;
    g_usage = true;
    return -1;
}

void error_reset(void) {
    g_err[0] = '\0';
    g_err_status = 0;
    g_exit = 1;
    g_usage = false;
    g_interrupt = false;
    g_job_error = false;
}

void warn(const char *fmt, ...) {
    if (ampc_dist_rank() > 0) return;   /* data-parallel: rank 0 speaks for the job */
    va_list ap;
    va_start(ap, fmt);
    fflush(stdout);
    fputs(PROG ": warning: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

// ---------------------------------------------------------------------------------------------
// Formatting

const char *fmt_count(int64_t v, char *buf, size_t n) {
    char digits[32];
    snprintf(digits, sizeof digits, "%" PRId64, v < 0 ? -v : v);
    size_t len = strlen(digits), at = 0;
    char out[48];
    if (v < 0) out[at++] = '-';
    for (size_t i = 0; i < len; i++) {
        if (i && (len - i) % 3 == 0) out[at++] = ',';
        out[at++] = digits[i];
    }
    out[at] = '\0';
    snprintf(buf, n, "%s", out);
    return buf;
}

const char *fmt_bytes(double b, char *buf, size_t n) {
    if (b >= 1024.0 * 1024 * 1024) snprintf(buf, n, "%.2f GiB", b / (1024.0 * 1024 * 1024));
    else if (b >= 1024.0 * 1024) snprintf(buf, n, "%.1f MiB", b / (1024.0 * 1024));
    else if (b >= 1024.0) snprintf(buf, n, "%.1f KiB", b / 1024.0);
    else snprintf(buf, n, "%.0f B", b);
    return buf;
}

void appendf(char *buf, size_t n, size_t *at, const char *fmt, ...) {
    if (*at >= n) return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(buf + *at, n - *at, fmt, ap);
    va_end(ap);
    if (w > 0) *at = *at + (size_t)w < n ? *at + (size_t)w : n - 1;
}

/* "0.01", not "0.01000000000000000021" */
const char *fmt_real(double v, char *buf, size_t n) {
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, n, "%.*g", p, v);
        if (strtod(buf, NULL) == v) break;
    }
    return buf;
}
