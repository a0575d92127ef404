/*
 * test_tbevents.c - ampc-train's TensorBoard event files (tools/tbevents.c) byte by byte: CRC32C
 * against its published check values and a bitwise reference written here from the definition,
 * TFRecord's masked CRC against the header every TensorFlow event file starts with, the records
 * against protobuf encodings written out by hand (TensorBoard's field numbers, not protoc-c's
 * output), and the errors: a folder that can't be written, a write that fails mid-run.
 * tests/e2e_tensorboard.sh reads ampc-train's files with protobuf's own Python parser.
 */
#include "testutil.h"

#include "tbevents.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static char tmpdir[] = "/tmp/ampc_tbevents_XXXXXX";

// ---------------------------------------------------------------------------------------------
// The references: CRC-32C bit by bit (reflected polynomial 0x82F63B78) and the record's parts

static uint32_t ref_crc32c(const uint8_t *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (c & 1 ? 0x82F63B78u : 0);
    }
    return ~c;
}

static uint64_t get_le(const uint8_t *p, int bytes) {
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* The file's bytes (*n); the caller frees them. */
static uint8_t *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("can't open %s: %s", path, strerror(errno));
    uint8_t *buf = malloc(1 << 16);
    assert_non_null(buf);
    *n = fread(buf, 1, 1 << 16, f);
    fclose(f);
    return buf;
}

/* The record at *at of buf (n bytes): checks both masked CRCs against the reference, returns its
   data and length, and moves *at past it. */
static const uint8_t *record(const uint8_t *buf, size_t n, size_t *at, size_t *len) {
    if (*at + 16 > n) fail_msg("no record at byte %zu of %zu", *at, n);
    const uint8_t *p = buf + *at;
    *len = (size_t)get_le(p, 8);
    if (*at + 16 + *len > n) fail_msg("a record of %zu bytes at byte %zu of %zu", *len, *at, n);
    assert_int_equal(get_le(p + 8, 4), tb_crc_mask(ref_crc32c(p, 8)));
    assert_int_equal(get_le(p + 12 + *len, 4), tb_crc_mask(ref_crc32c(p + 12, *len)));
    *at += 16 + *len;
    return p + 12;
}

/* The one event file in tmpdir (its path in a static buffer), or fails. */
static const char *event_file(void) {
    static char path[512];
    DIR *d = opendir(tmpdir);
    assert_non_null(d);
    int found = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (strncmp(e->d_name, "events.out.tfevents.", 20) == 0) {
            snprintf(path, sizeof path, "%s/%s", tmpdir, e->d_name);
            found++;
        }
    closedir(d);
    assert_int_equal(found, 1);
    return path;
}

static void remove_events(void) {
    DIR *d = opendir(tmpdir);
    assert_non_null(d);
    char path[512];
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.') {
            snprintf(path, sizeof path, "%s/%s", tmpdir, e->d_name);
            unlink(path);
        }
    closedir(d);
}

// ---------------------------------------------------------------------------------------------
// CRC32C and the masked CRC

/* The check value of CRC-32C ("123456789", as every CRC catalogue lists it), RFC 3720's iSCSI
   vectors (32 zero bytes, bytes 0..31), and the reference over lengths 0..300 of varied bytes
   (ISA-L's code takes other paths for short, unaligned and long buffers). */
static void test_crc32c(void **state) {
    (void)state;
    assert_int_equal(tb_crc32c("123456789", 9), 0xE3069283u);
    uint8_t b[300] = {0};
    assert_int_equal(tb_crc32c(b, 32), 0x8A9136AAu);
    for (int i = 0; i < 32; i++) b[i] = (uint8_t)i;
    assert_int_equal(tb_crc32c(b, 32), 0x46DD794Eu);
    assert_int_equal(tb_crc32c(b, 0), 0u);
    uint64_t s = 7;
    for (size_t i = 0; i < sizeof b; i++) b[i] = (uint8_t)(tu_uniform(&s, 0, 256));
    for (size_t n = 0; n <= sizeof b; n++)
        for (size_t off = 0; off < 3 && off <= n; off++)
            if (tb_crc32c(b + off, n - off) != ref_crc32c(b + off, n - off)) fail_msg("length %zu at offset %zu", n - off, off);
}

/* A record of 24 bytes (the first Event of every TensorFlow event file: wall_time and
   file_version "brain.Event:2") has the header 18 00 00 00 00 00 00 00 a3 7f 4b 22: its masked
   CRC is 0x224B7FA3. */
static void test_masked_crc(void **state) {
    (void)state;
    const uint8_t len24[8] = {0x18};
    assert_int_equal(tb_crc_mask(tb_crc32c(len24, 8)), 0x224B7FA3u);
    /* the mask is a rotation plus a constant: different CRCs stay different */
    assert_int_equal(tb_crc_mask(0), 0xa282ead8u);
    assert_int_equal(tb_crc_mask(1), 0xa282ead8u + (1u << 17));
}

// ---------------------------------------------------------------------------------------------
// The records

/* The file's name and its first record, byte for byte: Event{wall_time = 1 (fixed64), file_version
   = 3 (length-delimited) "brain.Event:2"}, step 0 left out as proto3 does; then a SessionLog START
   and a summary of two scalars, decoded by hand. */
static void test_records(void **state) {
    (void)state;
    char err[1200];
    double t0 = (double)time(NULL);
    tb_writer *w = tb_writer_open(tmpdir, err, sizeof err);
    if (!w) fail_msg("%s", err);
    const char *name = strrchr(tb_writer_path(w), '/') + 1;
    char host[256] = "", expect[512];
    long long secs = 0;
    gethostname(host, sizeof host);
    assert_int_equal(sscanf(name, "events.out.tfevents.%lld.", &secs), 1);
    snprintf(expect, sizeof expect, "events.out.tfevents.%lld.%s.%ld.0", secs, host, (long)getpid());
    assert_string_equal(name, expect);
    assert_true(secs >= (long long)t0 && secs <= (long long)time(NULL));
    assert_int_equal(tb_writer_session_start(w, 9), 0);
    static const char *const tags[] = {"a/b", "loss"};
    const double values[] = {0.5, 1.0 / 3.0};
    assert_int_equal(tb_writer_scalars(w, 300, 2, tags, values), 0);
    assert_int_equal(tb_writer_close(w, err, sizeof err), 0);
    double t1 = (double)time(NULL) + 1;

    size_t n, at = 0, len;
    uint8_t *buf = slurp(event_file(), &n);
    static const uint8_t head[12] = {0x18, 0, 0, 0, 0, 0, 0, 0, 0xa3, 0x7f, 0x4b, 0x22};
    assert_memory_equal(buf, head, 12);
    const uint8_t *ev = record(buf, n, &at, &len);
    assert_int_equal(len, 24);
    assert_int_equal(ev[0], 0x09);   /* field 1, 64-bit */
    double wall;
    memcpy(&wall, ev + 1, 8);        /* little-endian, as this machine */
    assert_true(wall >= t0 && wall <= t1);
    assert_int_equal(ev[9], 0x1a);   /* field 3, length-delimited */
    assert_int_equal(ev[10], 13);
    assert_memory_equal(ev + 11, "brain.Event:2", 13);

    /* Event{wall_time, step = 2: 9, session_log = 7: {status = 1: START (1)}} */
    ev = record(buf, n, &at, &len);
    static const uint8_t start[] = {0x10, 9, 0x3a, 2, 0x08, 1};
    assert_int_equal(len, 9 + sizeof start);
    assert_int_equal(ev[0], 0x09);
    assert_memory_equal(ev + 9, start, sizeof start);

    /* Event{wall_time, step: 300 (varint ac 02), summary = 5: {value = 1: {tag = 1, simple_value = 2 (32-bit)}, ...}} */
    ev = record(buf, n, &at, &len);
    const float third = (float)(1.0 / 3.0);
    uint8_t summary[] = {0x10, 0xac, 0x02, 0x2a, 25,
                         0x0a, 10, 0x0a, 3, 'a', '/', 'b', 0x15, 0x00, 0x00, 0x00, 0x3f,
                         0x0a, 11, 0x0a, 4, 'l', 'o', 's', 's', 0x15, 0, 0, 0, 0};
    memcpy(summary + sizeof summary - 4, &third, 4);
    assert_int_equal(len, 9 + sizeof summary);
    assert_memory_equal(ev + 9, summary, sizeof summary);
    assert_int_equal(at, n);   /* nothing else */
    free(buf);
    remove_events();
}

/* A new file sorts after the event files already in the folder (TensorBoard reads them in name
   order): one dated 100 s ahead gets the next second. */
static void test_name_order(void **state) {
    (void)state;
    char path[512], err[1200];
    long long ahead = (long long)time(NULL) + 100;
    snprintf(path, sizeof path, "%s/events.out.tfevents.%lld.elsewhere.1.0", tmpdir, ahead);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fclose(f);
    tb_writer *w = tb_writer_open(tmpdir, err, sizeof err);
    if (!w) fail_msg("%s", err);
    long long secs = 0;
    assert_int_equal(sscanf(strrchr(tb_writer_path(w), '/') + 1, "events.out.tfevents.%lld.", &secs), 1);
    assert_int_equal(secs, ahead + 1);
    assert_true(strcmp(strrchr(tb_writer_path(w), '/') + 1, strrchr(path, '/') + 1) > 0);
    assert_int_equal(tb_writer_close(w, err, sizeof err), 0);
    remove_events();
}

// ---------------------------------------------------------------------------------------------
// Errors

/* A folder that does not exist, or a file in its place: NULL and a message naming the file and
   the reason; too many scalars for one event: refused. */
static void test_open_errors(void **state) {
    (void)state;
    char dir[600], err[1200] = "";
    snprintf(dir, sizeof dir, "%s/missing", tmpdir);
    assert_null(tb_writer_open(dir, err, sizeof err));
    print_message("%s\n", err);
    assert_non_null(strstr(err, "TensorBoard events: can't create '"));
    assert_non_null(strstr(err, "/missing/events.out.tfevents."));
    assert_non_null(strstr(err, strerror(ENOENT)));
    snprintf(dir, sizeof dir, "%s/plain", tmpdir);
    FILE *f = fopen(dir, "w");
    assert_non_null(f);
    fclose(f);
    assert_null(tb_writer_open(dir, err, sizeof err));
    assert_non_null(strstr(err, strerror(ENOTDIR)));
    unlink(dir);

    tb_writer *w = tb_writer_open(tmpdir, err, sizeof err);
    if (!w) fail_msg("%s", err);
    const char *tags[TB_MAX_VALUES + 1];
    double v[TB_MAX_VALUES + 1] = {0};
    for (int i = 0; i <= TB_MAX_VALUES; i++) tags[i] = "t";
    assert_int_equal(tb_writer_scalars(w, 1, TB_MAX_VALUES + 1, tags, v), -1);
    assert_non_null(strstr(tb_writer_error(w), "17 scalars in one event"));
    assert_int_equal(tb_writer_close(w, err, sizeof err), -1);
    remove_events();
}

/* A write that fails (the file size limit, as a full disk would): the error names the file and
   the reason, stays the first one, later calls write nothing, and close reports it. */
static void test_write_error(void **state) {
    (void)state;
    char err[1200];
    tb_writer *w = tb_writer_open(tmpdir, err, sizeof err);
    if (!w) fail_msg("%s", err);
    struct rlimit old, small = {.rlim_cur = 200, .rlim_max = RLIM_INFINITY};
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
    small.rlim_max = old.rlim_max;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);   /* EFBIG instead of the signal */
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &small), 0);
    static const char *const tags[] = {"train/loss"};
    const double v[] = {1};
    int rc = 0;
    for (int i = 0; i < 100 && rc == 0; i++) rc = tb_writer_scalars(w, i, 1, tags, v);   /* buffered: may succeed */
    if (rc == 0) rc = tb_writer_flush(w);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    assert_int_equal(rc, -1);
    print_message("%s\n", tb_writer_error(w));
    assert_non_null(strstr(tb_writer_error(w), "TensorBoard events: can't write '"));
    assert_non_null(strstr(tb_writer_error(w), strerror(EFBIG)));
    assert_int_equal(tb_writer_scalars(w, 200, 1, tags, v), -1);
    assert_int_equal(tb_writer_close(w, err, sizeof err), -1);
    assert_non_null(strstr(err, strerror(EFBIG)));
    remove_events();
}

static int setup(void **state) {
    (void)state;
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    remove_events();
    return rmdir(tmpdir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crc32c),
        cmocka_unit_test(test_masked_crc),
        cmocka_unit_test(test_records),
        cmocka_unit_test(test_name_order),
        cmocka_unit_test(test_open_errors),
        cmocka_unit_test(test_write_error),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
