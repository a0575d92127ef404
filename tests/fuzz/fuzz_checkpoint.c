/*
 * fuzz_checkpoint.c - safetensors checkpoints (src/io/safetensors.c, src/io/checkpoint.c):
 * ampc_checkpoint_read_meta, ampc_checkpoint_meta_get on the metadata it returns,
 * ampc_checkpoint_list (the same validation: it succeeds exactly when read_meta does, and its
 * tensors are sorted and lie inside the file), and ampc_checkpoint_load into a small model with
 * an Adam optimizer (amsgrad: three state slots) and an enabled grad scaler.
 *
 * Input: the checkpoint file. The model (tests/fuzz/make_corpus.c saves the same one for the
 * seeds) is Sequential(Linear(4,3), ReLU, Linear(3,2), BatchNorm2d(2)): f32 weights and an i64
 * buffer (num_batches_tracked); it is never run. Model, optimizer and scaler are made afresh per
 * input, so a load that succeeded cannot change how the next input is read. Every input is also
 * loaded as weights only (no optimizer, no scaler: optimizer entries are then ignored).
 */
#include "fuzz_common.h"

#include "fuzz_checkpoint_model.h"

static void query(const char *meta) {
    static const char *const keys[] = {"format", "ampc.version", "optimizer.type", "scaler.scale", "rng.seed", "epoch", ""};
    char buf[8];
    for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
        int len = ampc_checkpoint_meta_get(meta, keys[i], buf, sizeof buf);
        if (len >= 0 && strlen(buf) != (size_t)(len < (int)sizeof buf ? len : (int)sizeof buf - 1)) abort();
        (void)ampc_checkpoint_meta_get(meta, keys[i], NULL, 0);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_begin();
    static char path[512];
    if (!path[0]) fuzz_path(path, sizeof path, "checkpoint.safetensors");
    fuzz_write(path, data, size);

    char *meta = NULL;
    int rc_meta = ampc_checkpoint_read_meta(path, &meta);
    fuzz_report("read_meta", rc_meta == 0);
    if (rc_meta == 0) {
        if (!meta || meta[0] != '{') abort();
        query(meta);
    } else if (meta || !ampc_last_error()[0]) {
        abort();   /* a failure leaves no metadata and says why */
    }
    free(meta);
    meta = NULL;

    ampc_checkpoint_tensor *list = NULL;
    int n = ampc_checkpoint_list(path, &list);
    if ((n >= 0) != (rc_meta == 0) || (n <= 0 && list)) abort();
    for (int i = 0; i < n; i++) {
        if (i && strcmp(list[i - 1].name, list[i].name) >= 0) abort();
        if (list[i].ndim < 0 || list[i].ndim > AMPC_MAX_DIMS || list[i].offset + list[i].nbytes > size) abort();
    }
    free(list);

    fuzz_model fm;
    if (fuzz_model_new(&fm) < 0) abort();
    int rc = ampc_checkpoint_load(path, fm.m, fm.opt, fm.s, &meta);
    fuzz_report("load", rc == 0);
    if (rc == 0) {
        if (rc_meta != 0 || !meta) abort();   /* loadable but its metadata unreadable */
        query(meta);
    } else if (meta || !ampc_last_error()[0]) {
        abort();
    }
    free(meta);
    ampc_clear_error();
    rc = ampc_checkpoint_load(path, fm.m, NULL, NULL, NULL);
    fuzz_report("load weights only", rc == 0);
    if (rc < 0 && !ampc_last_error()[0]) abort();
    fuzz_model_free(&fm);
    return 0;
}
