/*
 * fuzz_metrics_append.c - appending to an existing metrics log, as a resumed ampc-train run does
 * with metrics.csv: ampc_metrics_open(append) (src/io/metrics.c) on any file, then a row.
 *
 * Input: a selector byte (bit 0: ampc-train's metrics.csv columns, or two whose names CSV must
 * quote), then the existing file. Besides the sanitizers, the harness checks what the API
 * promises: a refusal says why and leaves the file as it was; an append keeps the file's
 * complete lines (its header exactly ours: an empty file gets it), drops a torn last line, and
 * ends with the new row.
 */
#include "fuzz_common.h"

#include <math.h>

static const char *const METRICS[] = {"epoch",   "train_loss",    "train_acc", "val_loss",      "val_acc",
                                      "seconds", "samples_per_s", "scale",     "skipped_steps", "data_wait"};
static const char *const QUOTED[] = {"a,b", "say \"hi\""};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_begin();
    if (size < 1) return 0;
    const bool train = data[0] & 1;
    const char *const *cols = train ? METRICS : QUOTED;
    const int nc = train ? 10 : 2;
    static char path[512], ref[512];
    if (!path[0]) fuzz_path(path, sizeof path, "metrics.csv"), fuzz_path(ref, sizeof ref, "header.csv");
    const uint8_t *old = data + 1;
    const size_t n_old = size - 1;
    fuzz_write(path, old, n_old);

    ampc_metrics *h = ampc_metrics_open(ref, cols, nc, false);   /* our header, written afresh */
    if (!h || ampc_metrics_close(h) < 0) abort();
    size_t hl;
    uint8_t *header = fuzz_read(ref, &hl);

    ampc_metrics *m = ampc_metrics_open(path, cols, nc, true);
    fuzz_report("metrics_open append", m != NULL);
    size_t n;
    if (!m) {
        uint8_t *now = fuzz_read(path, &n);
        if (!ampc_last_error()[0] || n != n_old || memcmp(now, old, n)) abort();   /* refused: untouched */
        free(now);
        free(header);
        return 0;
    }
    const double row[10] = {3, 0.25, 0.5, -1e300, NAN, INFINITY, 1e-7, 65536, 0, 2.5};
    if (ampc_metrics_row(m, row) < 0 || ampc_metrics_close(m) < 0) abort();
    uint8_t *now = fuzz_read(path, &n);
    size_t kept = 0;   /* the input's complete lines */
    for (size_t i = 0; i < n_old; i++)
        if (old[i] == '\n') kept = i + 1;
    const uint8_t *prefix = n_old ? old : header;
    if (!n_old) kept = hl;
    if (kept < hl || memcmp(prefix, header, hl) != 0) abort();   /* the header was ours */
    if (n <= kept || memcmp(now, prefix, kept) != 0 || now[n - 1] != '\n' || memchr(now + kept, '\n', n - kept - 1)) abort();
    free(now);
    free(header);
    return 0;
}
