/*
 * fuzz_resume_meta.c - ampc-train --resume's reading of a checkpoint's metadata
 * (tools/train/meta.c, with report.c and options.c: AMPC_FUZZ_SOURCES_resume_meta):
 * resume_settings (the flags it defines, each value checked) and resume_state (the epoch, the
 * interrupted epoch's totals and the metrics history), through a checkpoint of the small model
 * of fuzz_checkpoint_model.h whose metadata the fuzzer writes; the data: 8 samples, 10 classes.
 *
 * Input: the metadata's keys and values, each ended by a NUL byte ("ampc_train.epoch\0" "1\0"
 * ...). Besides the sanitizers, the harness checks what the tool promises: a refusal says why;
 * a resume that succeeds holds one history row per finished epoch and a step within the data.
 */
#include "fuzz_common.h"

#include "fuzz_checkpoint_model.h"
#include "train/train.h"

#define N_SAMPLES 8

/* 8 IDX samples of 2x2 pixels, labels 0..7, written once */
static ampc_dataset *dataset(void) {
    static char img[512], lbl[512];
    if (!img[0]) {
        fuzz_path(img, sizeof img, "images.idx");
        fuzz_path(lbl, sizeof lbl, "labels.idx");
        uint8_t i[16 + N_SAMPLES * 4] = {0, 0, 8, 3, 0, 0, 0, N_SAMPLES, 0, 0, 0, 2, 0, 0, 0, 2};
        uint8_t l[8 + N_SAMPLES] = {0, 0, 8, 1, 0, 0, 0, N_SAMPLES, 0, 1, 2, 3, 4, 5, 6, 7};
        fuzz_write(img, i, sizeof i);
        fuzz_write(lbl, l, sizeof l);
        if (!freopen("/dev/null", "w", stdout)) exit(2);   /* the resume's notes */
    }
    return ampc_dataset_idx_open(img, lbl);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_begin();
    static char path[512];
    if (!path[0]) fuzz_path(path, sizeof path, "checkpoint.safetensors");
    /* the key/value list: NUL-ended strings, pairs, at most 128 */
    char *buf = malloc(size + 1), *kv[2 * 128 + 1];
    if (!buf) return 0;
    memcpy(buf, data, size);
    buf[size] = '\0';
    int n = 0;
    for (char *p = buf; p < buf + size && n < 2 * 128; p += strlen(p) + 1) kv[n++] = p;
    kv[n & ~1] = NULL;
    fuzz_model fm;
    if (fuzz_model_new(&fm) < 0) abort();
    int rc = ampc_checkpoint_save(path, fm.m, fm.opt, fm.s, (const char *const *)kv);
    fuzz_report("checkpoint_save", rc == 0);
    free(buf);
    ampc_dataset *ds = rc == 0 ? dataset() : NULL;
    if (rc < 0 || !ds) {
        fuzz_model_free(&fm);
        return 0;   /* metadata the library will not write (reserved keys, bad UTF-8) */
    }

    error_reset();
    settings s;
    char *argv[] = {(char *)PROG, (char *)"--resume", path, NULL};
    if (parse_args(3, argv, &s, &(const char *){NULL}, &(const char *){NULL}) != 0) abort();
    run r = {.s = &s, .m = {.net = fm.m, .opt = fm.opt, .scaler = fm.s}};
    r.d.train = r.d.val = ds;
    r.d.num_classes = 10;
    rc = resume_settings(&s, &r.resume.meta);
    fuzz_report("resume_settings", rc == 0);
    if (rc == 0) {
        rc = resume_state(&r);
        fuzz_report("resume_state", rc == 0);
    }
    if (rc < 0 && !g_err[0]) abort();   /* a refusal says why */
    if (rc == 0 && (r.out.hist.n != r.resume.epoch0 || r.resume.step < 0 || r.resume.step > N_SAMPLES)) abort();
    ampc_checkpoint_meta_free(r.resume.meta);
    free(r.out.hist.rows);
    settings_free(&s);
    ampc_dataset_free(ds);
    fuzz_model_free(&fm);
    return 0;
}
