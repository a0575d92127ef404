/*
 * fuzz_train_args.c - ampc-train's command line: parse_args (getopt_long) and the option table's
 * checks, linked from tools/train/options.c and report.c (AMPC_FUZZ_SOURCES_train_args).
 *
 * Input: the arguments after the program name, separated by NUL bytes (at most 32). Besides the
 * sanitizers, the harness checks what the tool promises: a rejected command line has a message;
 * an accepted one holds only canonical values (canonical(v) == v, defaults included), since the
 * checkpoint stores them and --resume accepts nothing else.
 */
#include "fuzz_common.h"

#include "train/train.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_begin();
    char *buf = malloc(size + 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    buf[size] = '\0';
    char *argv[34];
    int argc = 0;
    argv[argc++] = (char *)PROG;
    for (char *p = buf; p <= buf + size && argc < 33; p += strlen(p) + 1) argv[argc++] = p;
    argv[argc] = NULL;
    error_reset();
    settings s;
    const char *cmp_a = NULL, *cmp_b = NULL;
    int rc = parse_args(argc, argv, &s, &cmp_a, &cmp_b);
    fuzz_report("parse_args", rc >= 0);
    if (rc < 0 && !g_err[0]) abort();                 /* a rejection says why */
    if (rc < 0 && g_usage && g_exit != 2) abort();    /* usage errors exit 2 */
    if (rc == 0) {
        for (int i = 0; i < OPT_COUNT; i++) {
            char canon[4096], why[256];
            if (!s.val[i]) abort();
            if (canonical(i, s.val[i], canon, sizeof canon, why, sizeof why) < 0) {
                if ((i == OPT_RESUME || i == OPT_PRETRAINED) && !*s.val[i]) continue;   /* "": not given */
                abort();
            }
            if (strcmp(canon, s.val[i]) != 0) abort();
        }
        if ((cmp_a == NULL) != (cmp_b == NULL)) abort();
    }
    settings_free(&s);
    free(buf);
    return 0;
}
