/*
 * fuzz_tokens.c - token files (src/data/tokens.c): a text read as bytes or llm.c's .bin, through
 * ampc_dataset_tokens_open, and the data loader's windows of it.
 *
 * Input: flags (1 byte), then the file. Flags: bits 0-4 the block size minus 1 (1..32); bit 5
 * opens the held-out tail [0.9, 1) instead of the head [0, 0.9); bit 6 a shuffled loader
 * (cutting the windows at an epoch's shift). An opened dataset is read back: every window's first
 * and last token at the largest shift must lie in the vocabulary, and one epoch of the loader's
 * batches holds every window once.
 */
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_begin();
    unsigned flags = size ? data[0] : 0;
    if (size) data++, size--;
    char path[600];
    fuzz_path(path, sizeof path, "tokens.bin");
    fuzz_write(path, data, size);
    const int64_t T = (int64_t)(flags & 31) + 1;
    const bool tail = flags & 32, shuffle = flags & 64;
    ampc_tokens_options o = {.block_size = T, .begin = tail ? 0.9 : 0.0, .end = tail ? 1.0 : 0.9};
    ampc_dataset *ds = ampc_dataset_tokens_open(path, &o);
    fuzz_report("tokens_open", ds);
    if (!ds) {
        if (!ampc_last_error()[0]) abort();   /* a failure must say why */
        return 0;
    }
    const int64_t n = ampc_dataset_size(ds), V = ampc_dataset_num_classes(ds);
    if (n < 1 || ampc_dataset_block_size(ds) != T || (V != 256 && V != 50257 && V != 128256)) abort();
    int64_t x[32], y[32];
    for (int64_t i = 0; i < n; i++) {
        if (ampc_dataset_get_window(ds, i, T - 1, x, y) < 0) abort();
        if (x[0] < 0 || x[0] >= V || y[T - 1] < 0 || y[T - 1] >= V || (T > 1 && y[0] != x[1])) abort();
    }
    ampc_loader_options lo = ampc_loader_defaults();
    lo.batch_size = 7;
    lo.shuffle = shuffle;
    ampc_loader *ld = ampc_loader_new(ds, &lo);
    if (!ld) abort();
    ampc_tensor *bx, *by;
    int64_t seen = 0;
    int rc;
    ampc_scope_begin();
    while ((rc = ampc_loader_next(ld, &bx, &by)) == 1) seen += ampc_tensor_dim(bx, 0);
    ampc_scope_end();
    if (rc < 0 || seen != n) abort();
    ampc_loader_free(ld);
    ampc_dataset_free(ds);
    return 0;
}
