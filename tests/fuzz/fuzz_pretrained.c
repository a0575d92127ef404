/*
 * fuzz_pretrained.c - the pretrained-weights loader, ampc_load_state_dict (src/io/checkpoint.c),
 * as ampc-train's --pretrained calls it: strictly, then not strictly, into the small model of
 * fuzz_checkpoint_model.h, with a report.
 *
 * Input: the safetensors file. Besides the sanitizers, the harness checks what the API promises:
 * a failure says why; a success's report has one line per missing, unexpected and mismatched
 * tensor counted; a strict load succeeds only when every tensor matches, and then a lenient one
 * loads the same.
 */
#include "fuzz_common.h"

#include "fuzz_checkpoint_model.h"

/* Loads path into a fresh model; *lines: the report's "missing:", "unexpected:" and
   "mismatched:" lines. */
static int load(const char *path, bool strict, ampc_load_report *lr, int *lines) {
    fuzz_model fm;
    if (fuzz_model_new(&fm) < 0) abort();
    char *text = NULL;
    size_t n = 0;
    FILE *rep = open_memstream(&text, &n);
    if (!rep) abort();
    *lr = (ampc_load_report){-1, -1, -1, -1};
    int rc = ampc_load_state_dict(path, fm.m, strict, rep, lr);
    fclose(rep);
    *lines = 0;
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : "")
        *lines += !strncmp(p, "missing: ", 9) || !strncmp(p, "unexpected: ", 12) || !strncmp(p, "mismatched: ", 12);
    free(text);
    fuzz_model_free(&fm);
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_begin();
    static char path[512];
    if (!path[0]) fuzz_path(path, sizeof path, "pretrained.safetensors");
    fuzz_write(path, data, size);
    ampc_load_report s, l;
    int ls, ll;
    int rs = load(path, true, &s, &ls);
    fuzz_report("load_state_dict strict", rs == 0);
    if (rs < 0 && !ampc_last_error()[0]) abort();
    ampc_clear_error();
    int rl = load(path, false, &l, &ll);
    fuzz_report("load_state_dict lenient", rl == 0);
    if (rl < 0 && !ampc_last_error()[0]) abort();
    if (rs == 0 && (s.missing || s.unexpected || s.mismatched || ls)) abort();   /* strict: all match */
    if (rs == 0 && (rl != 0 || memcmp(&s, &l, sizeof s) != 0)) abort();        /* and lenient loads the same */
    if (rl == 0 && (l.loaded < 0 || l.missing < 0 || l.unexpected < 0 || l.mismatched < 0 || ll != l.missing + l.unexpected + l.mismatched))
        abort();
    return 0;
}
