/*
 * tbevents.c - TensorBoard event files (see tbevents.h): Events packed by protobuf-c (the C that
 * protoc-c generates at build time from tools/tensorboard/) into one reusable buffer, framed as
 * TFRecords with ISA-L's CRC32C (Debian has no package of Google's crc32c library), written
 * through stdio's buffer and flushed every TB_FLUSH_SECONDS and on request.
 */
#include "tbevents.h"

#include "event.pb-c.h"
#include "summary.pb-c.h"

#include <isa-l/crc.h>

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct tb_writer {
    FILE *f;
    char *path;
    uint8_t *buf;        /* the packed Event, reused: (cap) bytes */
    size_t cap;
    double flushed_at;   /* CLOCK_MONOTONIC seconds of the last flush */
    char err[1024];      /* the first error, or "" */
};

// ---------------------------------------------------------------------------------------------
// CRC32C and the TFRecord framing

uint32_t tb_crc32c(const void *data, size_t n) {
    /* crc32_iscsi keeps the register as it is (no inversion in or out) and takes an int length;
       it only reads the buffer, which its prototype does not say */
    unsigned int crc = 0xFFFFFFFFu;
    for (const unsigned char *p = data; n > 0;) {
        int len = n > (size_t)INT_MAX ? INT_MAX : (int)n;
        crc = crc32_iscsi((unsigned char *)p, len, crc);
        p += len;
        n -= (size_t)len;
    }
    return ~crc;
}

uint32_t tb_crc_mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

static void put_le(uint8_t *out, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) out[i] = (uint8_t)(v >> (8 * i));
}

static double clock_seconds(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Keeps the first error of w and returns -1. */
static int fail_w(tb_writer *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail_w(tb_writer *w, const char *fmt, ...) {
    if (!w->err[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(w->err, sizeof w->err, fmt, ap);
        va_end(ap);
    }
    return -1;
}

/* Writes ev, with its step and the wall time now, as one record. */
static int write_event(tb_writer *w, int64_t step, Tensorboard__Event *ev) {
    if (w->err[0]) return -1;
    ev->wall_time = clock_seconds(CLOCK_REALTIME);
    ev->step = step;
    size_t n = tensorboard__event__get_packed_size(ev);
    if (n > w->cap) {
        size_t cap = n > 2 * w->cap ? n : 2 * w->cap;
        uint8_t *b = realloc(w->buf, cap);
        if (!b) return fail_w(w, "TensorBoard events: out of memory");
        w->buf = b;
        w->cap = cap;
    }
    tensorboard__event__pack(ev, w->buf);
    uint8_t head[12], foot[4];
    put_le(head, n, 8);
    put_le(head + 8, tb_crc_mask(tb_crc32c(head, 8)), 4);
    put_le(foot, tb_crc_mask(tb_crc32c(w->buf, n)), 4);
    if (fwrite(head, 1, sizeof head, w->f) != sizeof head || fwrite(w->buf, 1, n, w->f) != n ||
        fwrite(foot, 1, sizeof foot, w->f) != sizeof foot)
        return fail_w(w, "TensorBoard events: can't write '%s': %s", w->path, strerror(errno));
    if (clock_seconds(CLOCK_MONOTONIC) - w->flushed_at >= TB_FLUSH_SECONDS) return tb_writer_flush(w);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// The writer

/* The seconds for a new file's name: now, or one more than the latest event file in dir has, so
   that it sorts after them (a resumed run started within the killed one's second). */
static long long name_seconds(const char *dir) {
    long long t = (long long)time(NULL);
    DIR *d = opendir(dir);
    if (!d) return t;
    static const char prefix[] = "events.out.tfevents.";
    for (struct dirent *e; (e = readdir(d));) {
        if (strncmp(e->d_name, prefix, sizeof prefix - 1) != 0) continue;
        char *end;
        long long s = strtoll(e->d_name + sizeof prefix - 1, &end, 10);
        if (*end == '.' && s >= t && s < LLONG_MAX) t = s + 1;
    }
    closedir(d);
    return t;
}

tb_writer *tb_writer_open(const char *dir, char *err, size_t errn) {
    char host[256] = "localhost";
    if (gethostname(host, sizeof host) != 0 || !host[0]) snprintf(host, sizeof host, "localhost");
    host[sizeof host - 1] = '\0';
    for (char *c = host; *c; c++)   /* a name part, never a path */
        if (!isalnum((unsigned char)*c) && *c != '-' && *c != '.' && *c != '_') *c = '_';
    tb_writer *w = calloc(1, sizeof *w);
    if (!w || asprintf(&w->path, "%s/events.out.tfevents.%lld.%s.%ld.0", dir, name_seconds(dir), host, (long)getpid()) < 0) {
        if (w) w->path = NULL;
        snprintf(err, errn, "TensorBoard events: out of memory");
        tb_writer_close(w, NULL, 0);
        return NULL;
    }
    /* "x": O_EXCL, so a file or a link planted at the name is refused rather than followed */
    if (!(w->f = fopen(w->path, "wbxe"))) {
        snprintf(err, errn, "TensorBoard events: can't create '%s': %s", w->path, strerror(errno));
        tb_writer_close(w, NULL, 0);
        return NULL;
    }
    w->flushed_at = clock_seconds(CLOCK_MONOTONIC);
    Tensorboard__Event ev = TENSORBOARD__EVENT__INIT;
    ev.what_case = TENSORBOARD__EVENT__WHAT_FILE_VERSION;
    ev.file_version = "brain.Event:2";
    if (write_event(w, 0, &ev) < 0 || tb_writer_flush(w) < 0) {
        snprintf(err, errn, "%s", w->err);
        tb_writer_close(w, NULL, 0);
        return NULL;
    }
    return w;
}

const char *tb_writer_path(const tb_writer *w) { return w->path; }
const char *tb_writer_error(const tb_writer *w) { return w->err; }

int tb_writer_session_start(tb_writer *w, int64_t step) {
    Tensorboard__SessionLog log = TENSORBOARD__SESSION_LOG__INIT;
    log.status = TENSORBOARD__SESSION_LOG__SESSION_STATUS__START;
    Tensorboard__Event ev = TENSORBOARD__EVENT__INIT;
    ev.what_case = TENSORBOARD__EVENT__WHAT_SESSION_LOG;
    ev.session_log = &log;
    return write_event(w, step, &ev);
}

int tb_writer_scalars(tb_writer *w, int64_t step, int n, const char *const *tags, const double *values) {
    if (n < 0 || n > TB_MAX_VALUES)
        return fail_w(w, "TensorBoard events: %d scalars in one event (at most %d)", n, TB_MAX_VALUES);
    Tensorboard__Summary__Value v[TB_MAX_VALUES], *vp[TB_MAX_VALUES];
    for (int i = 0; i < n; i++) {
        tensorboard__summary__value__init(&v[i]);
        v[i].tag = (char *)tags[i];   /* read only: packing copies it */
        v[i].value_case = TENSORBOARD__SUMMARY__VALUE__VALUE_SIMPLE_VALUE;
        v[i].simple_value = (float)values[i];
        vp[i] = &v[i];
    }
    Tensorboard__Summary sum = TENSORBOARD__SUMMARY__INIT;
    sum.n_value = (size_t)n;
    sum.value = vp;
    Tensorboard__Event ev = TENSORBOARD__EVENT__INIT;
    ev.what_case = TENSORBOARD__EVENT__WHAT_SUMMARY;
    ev.summary = &sum;
    return write_event(w, step, &ev);
}

int tb_writer_flush(tb_writer *w) {
    if (w->err[0]) return -1;
    if (fflush(w->f) != 0) return fail_w(w, "TensorBoard events: can't write '%s': %s", w->path, strerror(errno));
    w->flushed_at = clock_seconds(CLOCK_MONOTONIC);
    return 0;
}

int tb_writer_close(tb_writer *w, char *err, size_t errn) {
    if (!w) return 0;
    if (w->f) {
        tb_writer_flush(w);
        if (fclose(w->f) != 0) fail_w(w, "TensorBoard events: can't write '%s': %s", w->path, strerror(errno));
    }
    int rc = w->err[0] ? -1 : 0;
    if (rc < 0 && err) snprintf(err, errn, "%s", w->err);
    free(w->path);
    free(w->buf);
    free(w);
    return rc;
}
