/*
 * metrics.c - the training log: a CSV file (RFC 4180) with one header line and one row of
 * numbers per call, flushed per row so that a crash loses at most the row being written.
 *
 * Numbers are written in the shortest form that reads back to the same double (like Python's
 * repr: 0.1, not 0.10000000000000001; 3, not 3.0000000000000000), so the file is both exact and
 * readable; non-finite values are "nan", "inf", "-inf" (what pandas and numpy read).
 * Append mode (a resumed run) checks the existing header against the columns and drops an
 * incomplete last line (a row cut by a crash) before appending.
 */
#include "core/core.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct ampc_metrics {
    uint64_t gen;   /* generation while live, 0 once closed (a handle pool's object) */
    FILE *f;
    char *path;
    int n;
};

static ampc_handle_pool metrics_pool = {.obj_size = sizeof(ampc_metrics)};

/* True (the error recorded) when m is a stale handle; NULL is each call's own case. */
static bool stale(const ampc_metrics *m, const char *call) {
    return m && ampc__check_handle(m, m->gen, call, "metrics log", "closed") < 0;
}

// ---------------------------------------------------------------------------------------------
// Formatting

/* The header line (without the newline), malloc'd: fields quoted when they hold a comma, a
   quote, CR/LF or edge spaces, with quotes doubled (RFC 4180). */
static char *header_line(const char *const *columns, int n) {
    size_t cap = 1;
    for (int i = 0; i < n; i++) cap += 2 * strlen(columns[i]) + 3;
    char *buf = malloc(cap), *o = buf;
    if (!buf) return NULL;
    for (int i = 0; i < n; i++) {
        const char *s = columns[i];
        size_t len = strlen(s);
        bool quote = strpbrk(s, ",\"\r\n") != NULL || s[0] == ' ' || s[len - 1] == ' ';
        if (i) *o++ = ',';
        if (quote) *o++ = '"';
        for (const char *p = s; *p; p++) {
            if (*p == '"') *o++ = '"';
            *o++ = *p;
        }
        if (quote) *o++ = '"';
    }
    *o = '\0';
    return buf;
}

/* Shortest "%.Ng" (N = 1..17) that parses back to x, or the integer when x is one. */
static void format_double(double x, char *out, size_t n) {
    if (isnan(x)) {
        snprintf(out, n, "nan");
        return;
    }
    if (isinf(x)) {
        snprintf(out, n, x > 0 ? "inf" : "-inf");
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(out, n, "%.*g", prec, x);
        if (strtod(out, NULL) == x) break;
    }
    /* whole numbers as integers unless that is much longer: step 10 is "10", not "1e+01" (an
       integer column stays integers for a reader such as strtoll); 2.5e+10 stays so */
    char whole[32];
    if (x == trunc(x) && fabs(x) < 1e15 && (size_t)snprintf(whole, sizeof whole, "%.0f", x) <= strlen(out) + 3)
        snprintf(out, n, "%s", whole);
}

// ---------------------------------------------------------------------------------------------
// Append mode: check the header, drop a torn last line

static int prepare_append(FILE *f, const char *path, const char *header) {
    if (fseek(f, 0, SEEK_END) != 0) return ampc__err(AMPC_ERR_IO, "metrics '%s': can't seek: %s", path, strerror(errno));
    long size = ftell(f);
    if (size < 0) return ampc__err(AMPC_ERR_IO, "metrics '%s': can't tell the size: %s", path, strerror(errno));
    if (size == 0) {
        if (fprintf(f, "%s\n", header) < 0 || fflush(f) != 0)
            return ampc__err(AMPC_ERR_IO, "metrics '%s': write failed: %s", path, strerror(errno));
        return AMPC_OK;
    }
    /* the first line must be exactly our header */
    size_t hl = strlen(header);
    char *first = malloc(hl + 2);
    if (!first) return ampc__err(AMPC_ERR_OOM, "metrics '%s': out of memory", path);
    rewind(f);
    size_t got = fread(first, 1, hl + 1, f);
    bool same = got == hl + 1 && memcmp(first, header, hl) == 0 && first[hl] == '\n';
    if (!same) {
        /* show the file's first line in the message */
        rewind(f);
        char line[256] = "";
        if (!fgets(line, sizeof line, f)) line[0] = '\0';
        line[strcspn(line, "\r\n")] = '\0';
        free(first);
        return ampc__err(AMPC_ERR_FORMAT, "metrics '%s': the existing header \"%s\" is not \"%s\"; refusing to append", path, line,
                         header);
    }
    free(first);
    /* the last complete line ends with '\n'; cut anything after it (a row torn by a crash) */
    long keep = size;
    char c;
    while (keep > 0) {
        if (fseek(f, keep - 1, SEEK_SET) != 0 || fread(&c, 1, 1, f) != 1)
            return ampc__err(AMPC_ERR_IO, "metrics '%s': read failed: %s", path, strerror(errno));
        if (c == '\n') break;
        keep--;
    }
    if (keep < size) {
        fflush(f);
        if (ftruncate(fileno(f), keep) != 0)
            return ampc__err(AMPC_ERR_IO, "metrics '%s': can't drop the incomplete last line: %s", path, strerror(errno));
    }
    if (fseek(f, 0, SEEK_END) != 0) return ampc__err(AMPC_ERR_IO, "metrics '%s': can't seek: %s", path, strerror(errno));
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// API

ampc_metrics *ampc_metrics_open(const char *csv_path, const char *const *columns, int n, bool append) {
    ampc__ensure_init();
    if (!csv_path || !columns || n < 1) return ampc__err_null(AMPC_ERR_INVALID, "metrics_open: need a path and at least one column");
    for (int i = 0; i < n; i++)
        if (!columns[i] || !columns[i][0]) return ampc__err_null(AMPC_ERR_INVALID, "metrics_open: column %d has no name", i);
    char *header = header_line(columns, n);
    char *path = strdup(csv_path);
    if (!header || !path) {
        free(header);
        free(path);
        return ampc__err_null(AMPC_ERR_OOM, "metrics_open: out of memory");
    }
    /* "a+" would force every write to the end but forbids the truncation of a torn line; the
       file sits in an output folder: a FIFO or a link there is refused (ampc_output_fopen) */
    FILE *f = NULL;
    if (append) {
        f = ampc_output_fopen(csv_path, "metrics", "r+");
        if (!f && errno == ENOENT) f = ampc_output_fopen(csv_path, "metrics", "w+");
    } else {
        f = ampc_output_fopen(csv_path, "metrics", "w");
    }
    int rc = !f ? ampc_last_status() : append ? prepare_append(f, csv_path, header) : AMPC_OK;
    if (f && !append && (fprintf(f, "%s\n", header) < 0 || fflush(f) != 0))
        rc = ampc__err(AMPC_ERR_IO, "metrics '%s': write failed: %s", csv_path, strerror(errno));
    free(header);
    ampc_metrics *m = rc == AMPC_OK ? ampc__handle_pool_get(&metrics_pool) : NULL;
    if (!m) {
        if (f) fclose(f);
        free(path);
        return NULL;
    }
    m->gen = ampc__new_gen();
    m->f = f;
    m->path = path;
    m->n = n;
    return m;
}

int ampc_metrics_row(ampc_metrics *m, const double *values) {
    if (!m || !values) return ampc__err(AMPC_ERR_INVALID, "metrics_row: NULL %s", m ? "values" : "log");
    if (stale(m, "ampc_metrics_row")) return AMPC_ERR_STATE;
    /* one buffered write per row: a row reaches the file whole or not at all (short of a crash) */
    char *line = malloc((size_t)m->n * 32 + 2);
    if (!line) return ampc__err(AMPC_ERR_OOM, "metrics '%s': out of memory", m->path);
    size_t len = 0;
    for (int i = 0; i < m->n; i++) {
        if (i) line[len++] = ',';
        format_double(values[i], line + len, 32);
        len += strlen(line + len);
    }
    line[len++] = '\n';
    int rc = AMPC_OK;
    if (fwrite(line, 1, len, m->f) != len || fflush(m->f) != 0)
        rc = ampc__err(AMPC_ERR_IO, "metrics '%s': write failed: %s", m->path, strerror(errno));
    free(line);
    return rc;
}

/* A closed log reads as NULL does (0), with the error recorded. */
int ampc_metrics_num_columns(const ampc_metrics *m) { return m && !stale(m, "ampc_metrics_num_columns") ? m->n : 0; }

int ampc_metrics_close(ampc_metrics *m) {
    if (!m) return AMPC_OK;
    if (stale(m, "ampc_metrics_close")) return AMPC_ERR_STATE;
    int rc = AMPC_OK;
    if (fclose(m->f) != 0) rc = ampc__err(AMPC_ERR_IO, "metrics '%s': close failed: %s", m->path, strerror(errno));
    free(m->path);
    m->gen = 0;
    ampc__handle_pool_put(&metrics_pool, m);
    return rc;
}
