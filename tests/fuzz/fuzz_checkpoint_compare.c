/*
 * fuzz_checkpoint_compare.c - ampc-train --compare-checkpoints: ampc_checkpoint_compare
 * (src/io/checkpoint.c) on two safetensors files, with a report.
 *
 * Input: a length byte pair (little-endian) of the first file, the first file, the second file.
 * Besides the sanitizers, the harness checks what the API promises: 0 (identical), 1 (differ) or
 * a negative status with a message; the answer is the same both ways round; a file that
 * validates is identical to itself; the report ends with its verdict line.
 */
#include "fuzz_common.h"

/* Compares a with b; *last: the report's last line starts as the verdict does. */
static int compare(const char *a, const char *b, bool *verdict) {
    char *text = NULL;
    size_t n = 0;
    FILE *rep = open_memstream(&text, &n);
    if (!rep) abort();
    int rc = ampc_checkpoint_compare(a, b, rep);
    fclose(rep);
    const char *last = text ? text : "";
    for (const char *p = last; *p; p++)
        if (p[0] == '\n' && p[1]) last = p + 1;
    *verdict = !strncmp(last, "identical: ", 11) || !strncmp(last, "checkpoints differ: ", 20);
    free(text);
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_begin();
    if (size < 2) return 0;
    size_t na = (size_t)data[0] | (size_t)data[1] << 8;
    if (na > size - 2) na = size - 2;
    static char a[512], b[512];
    if (!a[0]) fuzz_path(a, sizeof a, "a.safetensors"), fuzz_path(b, sizeof b, "b.safetensors");
    fuzz_write(a, data + 2, na);
    fuzz_write(b, data + 2 + na, size - 2 - na);
    bool v1, v2, v3;
    int ab = compare(a, b, &v1);
    fuzz_report("compare a b", ab >= 0);
    if (ab > 1 || (ab < 0 && !ampc_last_error()[0]) || (ab >= 0 && !v1)) abort();
    ampc_clear_error();
    int ba = compare(b, a, &v2);
    if ((ab < 0) != (ba < 0) || (ab >= 0 && ab != ba) || (ba >= 0 && !v2)) abort();   /* symmetric */
    ampc_clear_error();
    int aa = compare(a, a, &v3);
    fuzz_report("compare a a", aa >= 0);
    if (aa == 1 || (aa == 0 && !v3)) abort();   /* a valid file is identical to itself */
    return 0;
}
