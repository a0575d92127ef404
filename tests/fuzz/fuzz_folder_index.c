/*
 * fuzz_folder_index.c - the CSV index of an image folder (src/data/folder.c, read_index), through
 * ampc_dataset_folder_open with .index_csv.
 *
 * Input: the CSV file. The root is a folder made once per process with two classes and one
 * 2x2 PNG each (cat/a.png, dog/b.png), so an index naming them opens. An opened dataset is read
 * back: sizes, class names, every path; sample 0 is decoded only when it is one of those two
 * images (the index may name any file on the machine: decoding is fuzz_image's job).
 */
#include "fuzz_common.h"

static const unsigned char png_2x2[] = {
    0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44, 0x52, 0x00, 0x00, 0x00,
    0x02, 0x00, 0x00, 0x00, 0x02, 0x08, 0x02, 0x00, 0x00, 0x00, 0xfd, 0xd4, 0x9a, 0x73, 0x00, 0x00, 0x00, 0x11, 0x49,
    0x44, 0x41, 0x54, 0x78, 0x9c, 0x63, 0xf8, 0xcf, 0xc0, 0xc0, 0xf0, 0x1f, 0x8c, 0x80, 0x18, 0x00, 0x1d, 0xf0, 0x03,
    0xfd, 0xd3, 0xd0, 0x7d, 0x26, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45, 0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
};

static char root[512], image_a[600], image_b[600], csv[600];

static void make_root(void) {
    if (root[0]) return;
    char d[600];
    fuzz_path(root, sizeof root, "root");
    mkdir(root, 0700);
    snprintf(d, sizeof d, "%s/cat", root);
    mkdir(d, 0700);
    snprintf(d, sizeof d, "%s/dog", root);
    mkdir(d, 0700);
    snprintf(image_a, sizeof image_a, "%s/cat/a.png", root);
    snprintf(image_b, sizeof image_b, "%s/dog/b.png", root);
    fuzz_write(image_a, png_2x2, sizeof png_2x2);
    fuzz_write(image_b, png_2x2, sizeof png_2x2);
    fuzz_path(csv, sizeof csv, "index.csv");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_begin();
    make_root();
    fuzz_write(csv, data, size);   /* always there: a missing index would make the open scan and write one */
    ampc_folder_options o = {.height = 3, .width = 3, .channels = size % 2 ? 1 : 3, .index_csv = csv};
    ampc_dataset *ds = ampc_dataset_folder_open(root, &o);
    fuzz_report("folder_open", ds);
    if (!ds) {
        if (!ampc_last_error()[0]) abort();   /* a failure must say why */
        return 0;
    }
    int64_t n = ampc_dataset_size(ds), k = ampc_dataset_num_classes(ds), c, h, w;
    ampc_dataset_sample_shape(ds, &c, &h, &w);
    if (n < 1 || k < 1 || c != o.channels || h != 3 || w != 3) abort();
    for (int64_t i = 0; i < k; i++) (void)ampc_dataset_class_name(ds, i);
    for (int64_t i = 0; i < n; i++)
        if (!ampc_dataset_folder_path(ds, i)) abort();
    const char *p0 = ampc_dataset_folder_path(ds, 0);
    if (!strcmp(p0, image_a) || !strcmp(p0, image_b)) {
        float img[3 * 3 * 3];
        int64_t label;
        if (ampc_dataset_get(ds, 0, img, &label) < 0 || label < 0 || label >= k) abort();
    }
    ampc_dataset_free(ds);
    return 0;
}
