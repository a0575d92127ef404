/*
 * fuzz_idx.c - IDX image/label files (src/data/idx.c), plain or gzip, through
 * ampc_dataset_idx_open and ampc_dataset_mnist_open.
 *
 * Input: flags (1 byte), the images file's length (2 bytes, little-endian), the images file,
 * then the labels file (the rest). Shorter inputs: all of it is the images file, no labels.
 * Flags: bit 0 opens through ampc_dataset_mnist_open on a folder with the standard names
 * (10 classes); bit 1 names the files *.gz there (the content still decides gzip); bit 2 picks
 * the test split's names (t10k-*) and a folder named "fashion-mnist" (class names).
 * An opened dataset is read back: sizes, class names, the first and last sample.
 */
#include "fuzz_common.h"

static void check_dataset(ampc_dataset *ds) {
    int64_t n = ampc_dataset_size(ds), k = ampc_dataset_num_classes(ds), c, h, w;
    ampc_dataset_sample_shape(ds, &c, &h, &w);
    for (int64_t i = 0; i < k; i++) (void)ampc_dataset_class_name(ds, i);
    float *img = malloc((size_t)(c * h * w) * sizeof *img);
    int64_t label;
    if (img && n > 0) {
        if (ampc_dataset_get(ds, 0, img, &label) == 0 && (label < 0 || label >= k)) abort();   /* label out of range */
        if (ampc_dataset_get(ds, n - 1, img, &label) == 0 && (label < 0 || label >= k)) abort();
    }
    free(img);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_begin();
    unsigned flags = 0;
    size_t n_img = size;
    if (size >= 3) {
        flags = data[0];
        n_img = (size_t)data[1] | (size_t)data[2] << 8;
        data += 3;
        size -= 3;
        if (n_img > size) n_img = size;
    }
    bool mnist = flags & 1, gz = flags & 2, test = flags & 4;
    char dir[512], img[600], lbl[600];
    snprintf(dir, sizeof dir, "%s/%s", fuzz_dir(), test ? "fashion-mnist" : "mnist");
    mkdir(dir, 0700);
    const char *split = test ? "t10k" : "train", *ext = gz ? ".gz" : "";
    for (int z = 0; z < 2; z++) {   /* mnist_open prefers the plain name: remove the other one */
        snprintf(img, sizeof img, "%s/%s-images-idx3-ubyte%s", dir, split, z ? ".gz" : "");
        snprintf(lbl, sizeof lbl, "%s/%s-labels-idx1-ubyte%s", dir, split, z ? ".gz" : "");
        unlink(img);
        unlink(lbl);
    }
    snprintf(img, sizeof img, "%s/%s-images-idx3-ubyte%s", dir, split, ext);
    snprintf(lbl, sizeof lbl, "%s/%s-labels-idx1-ubyte%s", dir, split, ext);
    fuzz_write(img, data, n_img);
    fuzz_write(lbl, data + n_img, size - n_img);

    ampc_dataset *ds = mnist ? ampc_dataset_mnist_open(dir, !test) : ampc_dataset_idx_open(img, lbl);
    fuzz_report(mnist ? "mnist_open" : "idx_open", ds);
    if (ds) check_dataset(ds);
    else if (!ampc_last_error()[0]) abort();   /* a failure must say why */
    ampc_dataset_free(ds);
    return 0;
}
