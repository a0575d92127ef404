/*
 * test_data.c - the data layer: IDX files (plain and gzip, and every kind of corruption),
 * subsets and splits, transforms against independent double-precision references, and the
 * loader (coverage, order, bit-identical output for any worker count, errors, early free,
 * shards for data-parallel ranks and resuming on another number of them);
 * then Debian's Fashion-MNIST when it is installed.
 */
#include "testutil.h"

#include <ftw.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "data/data.h"

// ---------------------------------------------------------------------------------------------
// Temporary IDX files

static char tmpdir[256];

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static int setup(void **state) {
    tu_group_setup(state);
    snprintf(tmpdir, sizeof tmpdir, "/tmp/ampc_test_data_XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **state) {
    nftw(tmpdir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    return tu_group_teardown(state);
}

static const char *tpath(const char *name) {
    static char buf[4][1024];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", tmpdir, name);
    return buf[k];
}

static void put_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24), p[1] = (unsigned char)(v >> 16), p[2] = (unsigned char)(v >> 8), p[3] = (unsigned char)v;
}

/* Writes an IDX file (header + payload), gzip'd or not, then drops the last `cut` bytes of the file. */
static void write_idx(const char *path, bool gz, uint32_t magic, int ndim, const uint32_t *dims,
                      const uint8_t *payload, size_t len, size_t cut) {
    unsigned char h[16];
    put_be32(h, magic);
    for (int d = 0; d < ndim; d++) put_be32(h + 4 + 4 * d, dims[d]);
    if (gz) {
        gzFile f = gzopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(gzwrite(f, h, 4 + 4 * (unsigned)ndim), 4 + 4 * ndim);
        if (len) assert_int_equal(gzwrite(f, payload, (unsigned)len), (int)len);
        assert_int_equal(gzclose(f), Z_OK);
    } else {
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(h, 1, 4 + 4 * (size_t)ndim, f), 4 + 4 * (size_t)ndim);
        if (len) assert_int_equal(fwrite(payload, 1, len, f), len);
        fclose(f);
    }
    if (cut) {
        FILE *f = fopen(path, "rb");
        fseek(f, 0, SEEK_END);
        long size = ftell(f);
        fclose(f);
        assert_true((long)cut < size);
        assert_int_equal(truncate(path, size - (long)cut), 0);
    }
}

enum { N_IMG = 7, ROWS = 3, COLS = 5 };
static uint8_t g_pixels[N_IMG * ROWS * COLS], g_labels[N_IMG];

static void make_payload(void) {
    for (int i = 0; i < N_IMG * ROWS * COLS; i++) g_pixels[i] = (uint8_t)((i * 37 + 11) % 256);
    g_pixels[0] = 0, g_pixels[1] = 255;
    const uint8_t lab[N_IMG] = {3, 0, 5, 1, 5, 2, 4};
    memcpy(g_labels, lab, sizeof lab);
}

static void write_images(const char *path, bool gz, uint32_t n, size_t cut) {
    write_idx(path, gz, 0x803, 3, (uint32_t[]){n, ROWS, COLS}, g_pixels, sizeof g_pixels, cut);
}
static void write_labels(const char *path, bool gz, uint32_t n, size_t cut) {
    write_idx(path, gz, 0x801, 1, (uint32_t[]){n}, g_labels, sizeof g_labels, cut);
}

static void check_payload(ampc_dataset *ds) {
    assert_int_equal(ampc_dataset_size(ds), N_IMG);
    assert_int_equal(ampc_dataset_num_classes(ds), 6);   /* max label 5 + 1 */
    int64_t c, h, w;
    ampc_dataset_sample_shape(ds, &c, &h, &w);
    assert_int_equal(c, 1);
    assert_int_equal(h, ROWS);
    assert_int_equal(w, COLS);
    for (int i = 0; i < N_IMG; i++) {
        float img[ROWS * COLS];
        int64_t label = -1;
        ASSERT_OK(ampc_dataset_get(ds, i, img, &label));
        assert_int_equal(label, g_labels[i]);
        for (int k = 0; k < ROWS * COLS; k++) assert_true(img[k] == (float)g_pixels[i * ROWS * COLS + k] / 255.0f);
    }
    float img[ROWS * COLS];
    int64_t label;
    assert_int_equal(ampc_dataset_get(ds, N_IMG, img, &label), AMPC_ERR_INVALID);
}

static void test_idx_plain_and_gzip(void **state) {
    (void)state;
    make_payload();
    write_images(tpath("img"), false, N_IMG, 0);
    write_labels(tpath("lab"), false, N_IMG, 0);
    write_images(tpath("img.gz"), true, N_IMG, 0);
    write_labels(tpath("lab.gz"), true, N_IMG, 0);
    write_images(tpath("img_gz_content.bin"), true, N_IMG, 0);   /* gzip told by content, not name */
    const char *pairs[][2] = {{"img", "lab"}, {"img.gz", "lab.gz"}, {"img_gz_content.bin", "lab"}, {"img", "lab.gz"}};
    for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++) {
        ampc_dataset *ds = ampc_dataset_idx_open(tpath(pairs[p][0]), tpath(pairs[p][1]));
        ASSERT_NOT_NULL_MSG(ds);
        check_payload(ds);
        assert_null(ampc_dataset_class_name(ds, 0));
        ampc_dataset_free(ds);
    }
}

/* Opening must fail with status and a message containing every one of the words. */
static void expect_fail(const char *img, const char *lab, int status, const char *w1, const char *w2) {
    ampc_clear_error();
    ampc_dataset *ds = ampc_dataset_idx_open(tpath(img), tpath(lab));
    if (ds) fail_msg("%s + %s opened, expected an error with '%s'", img, lab, w1);
    const char *m = ampc_last_error();
    if (ampc_last_status() != status || !strstr(m, w1) || (w2 && !strstr(m, w2)))
        fail_msg("%s + %s: status %d, message '%s'; expected %d with '%s' and '%s'", img, lab, ampc_last_status(), m,
                 status, w1, w2 ? w2 : "");
}

static void test_idx_corrupt(void **state) {
    (void)state;
    make_payload();
    write_images(tpath("ok_img"), false, N_IMG, 0);
    write_labels(tpath("ok_lab"), false, N_IMG, 0);
    write_labels(tpath("ok_lab.gz"), true, N_IMG, 0);

    expect_fail("missing_img", "ok_lab", AMPC_ERR_IO, "cannot open", "missing_img");
    expect_fail("ok_img", "missing_lab", AMPC_ERR_IO, "cannot open", "missing_lab");
    expect_fail("ok_lab", "ok_lab", AMPC_ERR_FORMAT, "wrong magic", "ok_lab");     /* labels as images */
    expect_fail("ok_img", "ok_img", AMPC_ERR_FORMAT, "wrong magic", "ok_img");     /* images as labels */
    write_idx(tpath("magic_img.gz"), true, 0x0803 | 0x10000, 3, (uint32_t[]){N_IMG, ROWS, COLS}, g_pixels,
              sizeof g_pixels, 0);
    expect_fail("magic_img.gz", "ok_lab", AMPC_ERR_FORMAT, "wrong magic", "magic_img.gz");

    write_images(tpath("trunc_img"), false, N_IMG, 9);
    expect_fail("trunc_img", "ok_lab", AMPC_ERR_FORMAT, "truncated", "trunc_img");
    write_labels(tpath("trunc_lab"), false, N_IMG, 2);
    expect_fail("ok_img", "trunc_lab", AMPC_ERR_FORMAT, "truncated", "trunc_lab");
    write_images(tpath("trunc_img.gz"), true, N_IMG, 12);   /* cut into the deflate data/trailer */
    expect_fail("trunc_img.gz", "ok_lab", AMPC_ERR_FORMAT, "truncated", "trunc_img.gz");
    write_idx(tpath("short_hdr"), false, 0x803, 1, (uint32_t[]){N_IMG}, NULL, 0, 0);   /* 8-byte file */
    expect_fail("short_hdr", "ok_lab", AMPC_ERR_FORMAT, "truncated", "header");
    fclose(fopen(tpath("empty"), "wb"));
    expect_fail("ok_img", "empty", AMPC_ERR_FORMAT, "truncated", "empty");

    write_labels(tpath("lab6"), false, N_IMG - 1, 1);   /* a consistent file of 6 labels */
    expect_fail("ok_img", "lab6", AMPC_ERR_FORMAT, "count mismatch", "lab6");

    /* Headers claiming 10^9 images: rejected from the file size / at the first short read,
       without allocating 15 GB (ASan would report an allocation that large). */
    write_images(tpath("huge_img"), false, 1000000000u, 0);
    expect_fail("huge_img", "ok_lab", AMPC_ERR_FORMAT, "truncated", "huge_img");
    write_images(tpath("huge_img.gz"), true, 1000000000u, 0);
    expect_fail("huge_img.gz", "ok_lab", AMPC_ERR_FORMAT, "truncated", "huge_img.gz");
    write_labels(tpath("huge_lab.gz"), true, 1000000000u, 0);
    expect_fail("ok_img", "huge_lab.gz", AMPC_ERR_FORMAT, "truncated", "huge_lab.gz");

    write_idx(tpath("zero_rows"), false, 0x803, 3, (uint32_t[]){N_IMG, 0, COLS}, g_pixels, sizeof g_pixels, 0);
    expect_fail("zero_rows", "ok_lab", AMPC_ERR_FORMAT, "absurd rows", "zero_rows");
    write_idx(tpath("wide"), false, 0x803, 3, (uint32_t[]){1, 1, 4000000000u}, g_pixels, sizeof g_pixels, 0);
    expect_fail("wide", "ok_lab", AMPC_ERR_FORMAT, "absurd columns", "wide");
    write_idx(tpath("no_images"), false, 0x803, 3, (uint32_t[]){0, ROWS, COLS}, NULL, 0, 0);
    expect_fail("no_images", "ok_lab", AMPC_ERR_FORMAT, "absurd count", "no_images");

    write_idx(tpath("trailing"), false, 0x803, 3, (uint32_t[]){N_IMG - 1, ROWS, COLS}, g_pixels, sizeof g_pixels, 0);
    expect_fail("trailing", "ok_lab", AMPC_ERR_FORMAT, "unexpected data after", "trailing");

    /* Garbage that starts like gzip */
    FILE *f = fopen(tpath("bad.gz"), "wb");
    fwrite("\x1f\x8b\x08\x00garbagegarbagegarbage", 1, 25, f);
    fclose(f);
    ampc_clear_error();
    assert_null(ampc_dataset_idx_open(tpath("bad.gz"), tpath("ok_lab")));
    assert_int_equal(ampc_last_status(), AMPC_ERR_FORMAT);
    assert_non_null(strstr(ampc_last_error(), "bad.gz"));

    /* A directory is not a file */
    expect_fail("", "ok_lab", AMPC_ERR_IO, "not a regular file", NULL);
}

/* A FIFO (as images, as labels, found by name in an MNIST folder) is refused at once, naming it:
   opening one for reading would block until a writer came (alarm() turns a hang into a
   failure). A symlink to a regular file still reads, plain or gzip. */
static void test_idx_fifo_and_links(void **state) {
    (void)state;
    alarm(10);
    make_payload();
    write_images(tpath("f_img"), false, N_IMG, 0);
    write_labels(tpath("f_lab.gz"), true, N_IMG, 0);
    assert_int_equal(mkfifo(tpath("fifo"), 0600), 0);
    expect_fail("fifo", "f_lab.gz", AMPC_ERR_IO, "is a FIFO (named pipe), not a regular file", tpath("fifo"));
    expect_fail("f_img", "fifo", AMPC_ERR_IO, "is a FIFO (named pipe), not a regular file", tpath("fifo"));
    mkdir(tpath("fifo_mnist"), 0700);
    assert_int_equal(mkfifo(tpath("fifo_mnist/t10k-images-idx3-ubyte"), 0600), 0);
    write_labels(tpath("fifo_mnist/t10k-labels-idx1-ubyte"), false, N_IMG, 0);
    assert_null(ampc_dataset_mnist_open(tpath("fifo_mnist"), false));
    assert_int_equal(ampc_last_status(), AMPC_ERR_IO);
    assert_non_null(strstr(ampc_last_error(), "t10k-images-idx3-ubyte' is a FIFO"));

    assert_int_equal(symlink(tpath("f_img"), tpath("link_img")), 0);
    assert_int_equal(symlink("f_lab.gz", tpath("link_lab")), 0);
    ampc_dataset *ds = ampc_dataset_idx_open(tpath("link_img"), tpath("link_lab"));
    ASSERT_NOT_NULL_MSG(ds);
    check_payload(ds);
    ampc_dataset_free(ds);
    alarm(0);
}

static void make_mnist_dir(const char *dir, bool gz, uint8_t bad_label) {
    char p[256];
    mkdir(tpath(dir), 0700);
    snprintf(p, sizeof p, "%s/t10k-images-idx3-ubyte%s", dir, gz ? ".gz" : "");
    write_images(tpath(p), gz, N_IMG, 0);
    uint8_t keep = g_labels[3];
    if (bad_label) g_labels[3] = bad_label;
    snprintf(p, sizeof p, "%s/t10k-labels-idx1-ubyte%s", dir, gz ? ".gz" : "");
    write_labels(tpath(p), gz, N_IMG, 0);
    g_labels[3] = keep;
}

static void test_mnist_open(void **state) {
    (void)state;
    make_payload();
    make_mnist_dir("digits", true, 0);
    make_mnist_dir("My-Fashion-set", false, 0);
    make_mnist_dir("badlabel", true, 12);

    ampc_dataset *ds = ampc_dataset_mnist_open(tpath("digits"), false);
    ASSERT_NOT_NULL_MSG(ds);
    assert_int_equal(ampc_dataset_num_classes(ds), 10);
    assert_null(ampc_dataset_class_name(ds, 0));
    ampc_dataset_free(ds);

    ds = ampc_dataset_mnist_open(tpath("My-Fashion-set/"), false);
    ASSERT_NOT_NULL_MSG(ds);
    assert_string_equal(ampc_dataset_class_name(ds, 0), "T-shirt/top");
    assert_string_equal(ampc_dataset_class_name(ds, 9), "Ankle boot");
    assert_null(ampc_dataset_class_name(ds, 10));
    assert_null(ampc_dataset_class_name(ds, -1));
    ampc_dataset_free(ds);

    ds = ampc_dataset_fashion_mnist_open(tpath("digits"), false);   /* explicit: names */
    ASSERT_NOT_NULL_MSG(ds);
    assert_string_equal(ampc_dataset_class_name(ds, 1), "Trouser");
    ampc_dataset_free(ds);

    assert_null(ampc_dataset_mnist_open(tpath("digits"), true));   /* no train-* files */
    assert_int_equal(ampc_last_status(), AMPC_ERR_IO);
    assert_non_null(strstr(ampc_last_error(), "train-images-idx3-ubyte"));

    assert_null(ampc_dataset_mnist_open(tpath("badlabel"), false));
    assert_int_equal(ampc_last_status(), AMPC_ERR_FORMAT);
    assert_non_null(strstr(ampc_last_error(), "label 12"));
    assert_non_null(strstr(ampc_last_error(), "out of range for 10 classes"));
    assert_non_null(strstr(ampc_last_error(), "t10k-labels-idx1-ubyte.gz"));
}

// ---------------------------------------------------------------------------------------------
// A synthetic dataset: sample i's pixel 0 is i (to identify it), the rest a hash of (i, k).

typedef struct {
    int64_t fail_at;   /* -1: never */
} synth_impl;

static float synth_pixel(int64_t i, int64_t k) {
    uint64_t x = (uint64_t)i * 0x9E3779B97F4A7C15ull ^ (uint64_t)k * 0xC2B2AE3D27D4EB4Full;
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    return (float)(x >> 40) * 0x1p-24f;
}

static int synth_get(ampc_dataset *ds, int64_t i, float *img, int64_t *label) {
    const synth_impl *s = ds->impl;
    if (i == s->fail_at) return ampc__err(AMPC_ERR_IO, "synthetic read failure at %lld", (long long)i);
    int64_t n = ds->channels * ds->height * ds->width;
    for (int64_t k = 0; k < n; k++) img[k] = synth_pixel(i, k);
    img[0] = (float)i;
    *label = i % ds->num_classes;
    return 0;
}

static void synth_free(ampc_dataset *ds) { free(ds->impl); }

static const ampc_dataset_vtable synth_vt = {"synthetic", synth_get, synth_free, NULL};

static ampc_dataset *synth_new(int64_t n, int64_t c, int64_t h, int64_t w, int64_t fail_at) {
    ampc_dataset *ds = ampc__dataset_alloc(&synth_vt);
    synth_impl *s = calloc(1, sizeof *s);
    s->fail_at = fail_at;
    ds->impl = s;
    ds->size = n;
    ds->num_classes = 10;
    ds->channels = c, ds->height = h, ds->width = w;
    return ds;
}

static int64_t sample_id(ampc_dataset *ds, int64_t i) {
    int64_t c, h, w, label;
    ampc_dataset_sample_shape(ds, &c, &h, &w);
    float *img = malloc((size_t)(c * h * w) * sizeof *img);
    ASSERT_OK(ampc_dataset_get(ds, i, img, &label));
    int64_t id = (int64_t)img[0];
    free(img);
    return id;
}

static void test_subset_and_split(void **state) {
    (void)state;
    ampc_dataset *all = synth_new(103, 1, 2, 2, -1);
    ampc_dataset *train, *val, *train2, *val2, *train3, *val3;
    ASSERT_OK(ampc_dataset_split(all, 0.2, 7, &train, &val));
    ASSERT_OK(ampc_dataset_split(all, 0.2, 7, &train2, &val2));
    ASSERT_OK(ampc_dataset_split(all, 0.2, 8, &train3, &val3));
    assert_int_equal(ampc_dataset_size(val), 21);   /* round(20.6) */
    assert_int_equal(ampc_dataset_size(train), 82);
    int seen[103] = {0};
    bool differs = false;
    for (int64_t i = 0; i < 21; i++) {
        int64_t a = sample_id(val, i);
        assert_int_equal(a, sample_id(val2, i));   /* same seed: same split */
        differs |= a != sample_id(val3, i);
        if (i) assert_true(a > sample_id(val, i - 1));   /* parent order */
        seen[a]++;
    }
    for (int64_t i = 0; i < 82; i++) seen[sample_id(train, i)]++;
    for (int i = 0; i < 103; i++) assert_int_equal(seen[i], 1);   /* disjoint and covering */
    assert_true(differs);
    /* Pinned: the split is a function of (seed, size) on every machine and must not drift. */
    const int64_t expect_val0[3] = {1, 2, 5};
    for (int i = 0; i < 3; i++) assert_int_equal(sample_id(val, i), expect_val0[i]);

    ampc_dataset_free(all);   /* subsets keep their parent alive */
    ampc_dataset *sub = ampc_dataset_subset(train, (int64_t[]){81, 0, 0}, 3);   /* subset of a subset */
    ASSERT_NOT_NULL_MSG(sub);
    assert_int_equal(sample_id(sub, 0), sample_id(train, 81));
    assert_int_equal(sample_id(sub, 2), sample_id(train, 0));
    assert_null(ampc_dataset_subset(train, (int64_t[]){82}, 1));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    ampc_dataset *bad_t, *bad_v;
    assert_int_equal(ampc_dataset_split(train, 1.5, 0, &bad_t, &bad_v), AMPC_ERR_INVALID);
    assert_true(bad_t == NULL && bad_v == NULL);
    ampc_dataset_free(val);
    ampc_dataset_free(val2);
    ampc_dataset_free(train2);
    ampc_dataset_free(train3);
    ampc_dataset_free(val3);
    ampc_dataset_free(train);   /* sub still holds it */
    assert_int_equal(ampc_dataset_size(sub), 3);
    ampc_dataset_free(sub);

    ampc_dataset *one = synth_new(10, 1, 1, 1, -1), *t, *v;
    ASSERT_OK(ampc_dataset_split(one, 0.0, 1, &t, &v));
    assert_int_equal(ampc_dataset_size(v), 0);
    assert_int_equal(ampc_dataset_size(t), 10);
    ampc_dataset_free(t);
    ampc_dataset_free(v);
    ampc_dataset_free(one);
}

// ---------------------------------------------------------------------------------------------
// Transforms against independent references

/* Bilinear sample of a (h, w) plane at (y, x) in double, zero outside. */
static double ref_sample_zero(const float *p, int64_t h, int64_t w, double y, double x) {
    double fy = floor(y), fx = floor(x), acc = 0;
    for (int dy = 0; dy < 2; dy++)
        for (int dx = 0; dx < 2; dx++) {
            int64_t yy = (int64_t)fy + dy, xx = (int64_t)fx + dx;
            double wgt = (dy ? y - fy : 1 - (y - fy)) * (dx ? x - fx : 1 - (x - fx));
            if (yy >= 0 && yy < h && xx >= 0 && xx < w) acc += wgt * p[yy * w + xx];
        }
    return acc;
}

static void test_transforms_exact(void **state) {
    (void)state;
    enum { C = 3, H = 6, W = 5 };
    float in[C * H * W], out[C * H * W];
    for (int k = 0; k < C * H * W; k++) in[k] = synth_pixel(5, k);

    ampc_transforms *t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_hflip(t, 1.0));
    ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, out, 1, 0, 3));
    for (int c = 0; c < C; c++)
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++) assert_true(out[(c * H + y) * W + x] == in[(c * H + y) * W + (W - 1 - x)]);
    ampc_transforms_free(t);

    t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_hflip(t, 0.0));
    ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, out, 1, 0, 3));
    assert_memory_equal(in, out, sizeof in);
    ampc_transforms_free(t);

    const float mean[C] = {0.5f, 0.25f, -1.0f}, std[C] = {0.3f, 2.0f, 0.7f};
    t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_normalize(t, C, mean, std));
    ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, out, 1, 0, 3));
    for (int c = 0; c < C; c++)
        for (int k = 0; k < H * W; k++) assert_true(out[c * H * W + k] == (in[c * H * W + k] - mean[c]) / std[c]);
    int64_t oc;
    assert_int_equal(ampc_transforms_output_shape(t, 2, H, W, &oc, NULL, NULL), AMPC_ERR_SHAPE);
    assert_int_equal(ampc_transforms_add_normalize(t, 1, (float[]){0}, (float[]){0}), AMPC_ERR_INVALID);
    ampc_transforms_free(t);

    /* Identity affine (no shift, scale 1, no rotation): bit-exact, whatever the draws */
    t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_affine(t, 0.0, 1.0, 1.0, 0.0));
    for (int64_t idx = 0; idx < 20; idx++) {
        ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, out, 9, 2, idx));
        assert_memory_equal(in, out, sizeof in);
    }
    ampc_transforms_free(t);

    /* Resize to the same size is the identity; of a constant image, constant */
    t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_resize(t, H, W));
    ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, out, 1, 0, 0));
    assert_memory_equal(in, out, sizeof in);
    ampc_transforms_free(t);
    float cst[C * H * W], big[C * 11 * 4];
    for (int k = 0; k < C * H * W; k++) cst[k] = 0.1f * (float)(1 + k / (H * W));
    t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_resize(t, 11, 4));
    int64_t oh, ow;
    ASSERT_OK(ampc_transforms_output_shape(t, C, H, W, &oc, &oh, &ow));
    assert_true(oc == C && oh == 11 && ow == 4);
    ASSERT_OK(ampc_transforms_apply(t, C, H, W, cst, big, 1, 0, 0));
    for (int k = 0; k < C * 11 * 4; k++) assert_true(big[k] == 0.1f * (float)(1 + k / 44));
    ampc_transforms_free(t);
}

static void test_transforms_reference(void **state) {
    (void)state;
    enum { C = 2, H = 7, W = 9 };
    float in[C * H * W];
    for (int k = 0; k < C * H * W; k++) in[k] = synth_pixel(11, k);
    /* Single-precision coordinates and lerps: a few roundings of values in [0, 1]. */
    const double tol = 8 * tu_eps(AMPC_F32);

    /* Resize (align_corners=False, clamped) against a double evaluation of the same formula */
    const int sizes[][2] = {{14, 20}, {3, 4}, {7, 13}, {1, 1}};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int oh = sizes[s][0], ow = sizes[s][1];
        float *out = malloc((size_t)(C * oh * ow) * sizeof *out);
        double *got = malloc((size_t)(C * oh * ow) * sizeof *got), *ref = malloc((size_t)(C * oh * ow) * sizeof *ref);
        ampc_transforms *t = ampc_transforms_new();
        ASSERT_OK(ampc_transforms_add_resize(t, oh, ow));
        ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, out, 1, 0, 0));
        for (int c = 0; c < C; c++)
            for (int y = 0; y < oh; y++)
                for (int x = 0; x < ow; x++) {
                    double sy = fmax(0.0, (y + 0.5) * H / oh - 0.5), sx = fmax(0.0, (x + 0.5) * W / ow - 0.5);
                    /* clamp to the last row/column: sample the edge-extended image */
                    double fy = floor(sy), fx = floor(sx), ly = sy - fy, lx = sx - fx;
                    int64_t y0 = (int64_t)fy, x0 = (int64_t)fx, y1 = y0 + 1 < H ? y0 + 1 : H - 1, x1 = x0 + 1 < W ? x0 + 1 : W - 1;
                    const float *p = in + c * H * W;
                    double v = (1 - ly) * ((1 - lx) * p[y0 * W + x0] + lx * p[y0 * W + x1]) +
                               ly * ((1 - lx) * p[y1 * W + x0] + lx * p[y1 * W + x1]);
                    int k = (c * oh + y) * ow + x;
                    ref[k] = v;
                    got[k] = out[k];
                }
        tu_assert_close("resize", got, ref, (size_t)(C * oh * ow), tol, tol);
        ampc_transforms_free(t);
        free(out), free(got), free(ref);
    }

    /* Deterministic affine (scale range of one value, no shift/rotation) against a double
       inverse map about the centre, bilinear with zero fill. */
    const double scales[] = {2.0, 0.5, 1.3};
    for (size_t s = 0; s < 3; s++) {
        float out[C * H * W];
        double got[C * H * W], ref[C * H * W];
        ampc_transforms *t = ampc_transforms_new();
        ASSERT_OK(ampc_transforms_add_affine(t, 0.0, scales[s], scales[s], 0.0));
        ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, out, 3, 1, 42));
        const double cy = (H - 1) / 2.0, cx = (W - 1) / 2.0;
        for (int c = 0; c < C; c++)
            for (int y = 0; y < H; y++)
                for (int x = 0; x < W; x++) {
                    int k = (c * H + y) * W + x;
                    ref[k] = ref_sample_zero(in + c * H * W, H, W, (y - cy) / scales[s] + cy, (x - cx) / scales[s] + cx);
                    got[k] = out[k];
                }
        tu_assert_close("affine scale", got, ref, C * H * W, tol, tol);
        ampc_transforms_free(t);
    }

    /* Random affine: reproducible per (seed, epoch, index), different across indices and epochs,
       and a convex combination of input pixels and zero (values within [0, max]). */
    ampc_transforms *t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_affine(t, 0.2, 0.8, 1.2, 30.0));
    ASSERT_OK(ampc_transforms_add_hflip(t, 0.5));
    float a[C * H * W], b[C * H * W], d[C * H * W], e[C * H * W];
    ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, a, 5, 1, 17));
    ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, b, 5, 1, 17));
    ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, d, 5, 1, 18));
    ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, e, 5, 2, 17));
    assert_memory_equal(a, b, sizeof a);
    assert_memory_not_equal(a, d, sizeof a);
    assert_memory_not_equal(a, e, sizeof a);
    for (int k = 0; k < C * H * W; k++) assert_true(a[k] >= 0.0f && a[k] <= 1.0f);
    ampc_transforms_free(t);

    /* hflip(0.5): flips about half the samples (binomial, 400 draws: 5 sigma = 50) */
    t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_hflip(t, 0.5));
    int flipped = 0;
    for (int64_t idx = 0; idx < 400; idx++) {
        ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, a, 0, 0, idx));
        flipped += memcmp(a, in, sizeof a) != 0;
    }
    assert_in_range(flipped, 150, 250);
    ampc_transforms_free(t);
}

/* tests/fixtures/affine_cv2.txt (make_affine_cv2.py): albumentations' ShiftScaleRotate matrix
   through cv2.warpAffine (bilinear; BORDER_CONSTANT 0 and BORDER_REFLECT_101) on a smooth image,
   six shift/scale/rotation cases. ampc's kernel, given the same parameters (OpenCV's angle is
   counter-clockwise: ampc__affine takes -angle), agrees within OpenCV's own error: it rounds the
   source point to 1/32 pixel, worth up to 0.003 on this image (measured) and 0.013 where the zero
   border meets it. A wrong angle sense, centre or shift sign is off by 0.1 or more. */
static void test_affine_matches_opencv(void **state) {
    (void)state;
    char line[256];
    FILE *f = tu_open_fixture("affine_cv2.txt");
    int h = 0, w = 0, cases = 0;
    assert_non_null(fgets(line, sizeof line, f));
    assert_int_equal(sscanf(line, "image %d %d", &h, &w), 2);
    assert_true(h > 0 && w > 0 && h * w <= 4096);
    float img[4096], want[4096], got[4096];
    for (int k = 0; k < h * w; k++) assert_int_equal(fscanf(f, "%f", &img[k]), 1);
    double worst = 0, sum = 0;
    double angle, scale, dx, dy;
    char border[32];
    while (fscanf(f, " case %lf %lf %lf %lf %31s", &angle, &scale, &dx, &dy, border) == 5) {
        for (int k = 0; k < h * w; k++) assert_int_equal(fscanf(f, "%f", &want[k]), 1);
        ampc_border b = strcmp(border, "zero") == 0 ? AMPC_BORDER_ZERO : AMPC_BORDER_REFLECT_101;
        ampc__affine(img, 1, h, w, got, -angle, scale, dx * w, dy * h, b);
        double case_worst = 0;
        for (int k = 0; k < h * w; k++) {
            double d = fabs((double)got[k] - (double)want[k]);
            case_worst = d > case_worst ? d : case_worst;
            sum += d;
        }
        if (case_worst > (b == AMPC_BORDER_ZERO ? 0.02 : 0.004))
            fail_msg("angle %g scale %g shift (%g, %g) border %s: max |ampc - cv2| = %g", angle, scale, dx, dy, border, case_worst);
        worst = case_worst > worst ? case_worst : worst;
        cases++;
    }
    fclose(f);
    assert_int_equal(cases, 12);
    double mean = sum / (cases * h * w);
    print_message("affine vs cv2.warpAffine: %d cases, max |diff| %.3g, mean %.3g\n", cases, worst, mean);
    assert_true(mean < 1e-3);
}

/* ShiftScaleRotate(p): applied to about p of the samples (the rest come out bit-identical),
   reproducible per (seed, epoch, index); reflect-101 borders keep every value inside the
   input's range and leave no zero-filled corners; bad arguments are refused. */
static void test_shift_scale_rotate(void **state) {
    (void)state;
    enum { C = 2, H = 12, W = 15 };
    float in[C * H * W], a[C * H * W], b[C * H * W];
    for (int k = 0; k < C * H * W; k++) in[k] = 0.25f + 0.5f * (float)((k * 37) % 101) / 100.0f;   /* in [0.25, 0.75] */
    ampc_transforms *t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_shift_scale_rotate(t, 0.5, 0.3, 0.3, 15.0, AMPC_BORDER_REFLECT_101));
    int applied = 0;
    for (int64_t idx = 0; idx < 400; idx++) {
        ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, a, 9, 3, idx));
        ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, b, 9, 3, idx));
        assert_memory_equal(a, b, sizeof a);
        applied += memcmp(a, in, sizeof a) != 0;
        for (int k = 0; k < C * H * W; k++) assert_true(a[k] >= 0.25f && a[k] <= 0.75f);
    }
    assert_in_range(applied, 150, 250);   /* binomial(400, 0.5): 5 sigma = 50 */
    ampc_transforms_free(t);

    /* p = 1 and zero borders: a shifted sample has zero-filled pixels; p = 0: the identity */
    t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_shift_scale_rotate(t, 1.0, 0.3, 0.0, 0.0, AMPC_BORDER_ZERO));
    int zeros = 0;
    for (int64_t idx = 0; idx < 20; idx++) {
        ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, a, 9, 0, idx));
        for (int k = 0; k < C * H * W; k++) zeros += a[k] == 0.0f;
    }
    assert_true(zeros > 0);
    ampc_transforms_free(t);
    t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_shift_scale_rotate(t, 0.0, 0.3, 0.3, 15.0, AMPC_BORDER_REFLECT_101));
    for (int64_t idx = 0; idx < 20; idx++) {
        ASSERT_OK(ampc_transforms_apply(t, C, H, W, in, a, 9, 0, idx));
        assert_memory_equal(a, in, sizeof a);
    }
    assert_int_equal(ampc_transforms_add_shift_scale_rotate(t, 1.5, 0.3, 0.3, 15.0, AMPC_BORDER_ZERO), AMPC_ERR_INVALID);
    assert_int_equal(ampc_transforms_add_shift_scale_rotate(t, 0.5, 0.3, 1.0, 15.0, AMPC_BORDER_ZERO), AMPC_ERR_INVALID);
    assert_int_equal(ampc_transforms_add_shift_scale_rotate(t, 0.5, 0.3, 0.3, 15.0, (ampc_border)7), AMPC_ERR_INVALID);
    ampc_transforms_free(t);

    /* reflect-101 against a direct double reference: a whole-pixel shift of 5 (x) and -4 (y)
       with no rotation or scale reads in(reflect(x - 5), reflect(y + 4)) exactly */
    float out[C * H * W];
    ampc__affine(in, C, H, W, out, 0.0, 1.0, 5.0, -4.0, AMPC_BORDER_REFLECT_101);
    for (int c = 0; c < C; c++)
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++) {
                int sx = x - 5, sy = y + 4;
                sx = sx < 0 ? -sx : sx >= W ? 2 * (W - 1) - sx : sx;
                sy = sy < 0 ? -sy : sy >= H ? 2 * (H - 1) - sy : sy;
                assert_float_equal(out[(c * H + y) * W + x], in[(c * H + sy) * W + sx], 0.0f);
            }
}

// ---------------------------------------------------------------------------------------------
// Loader

/* One epoch's images and labels, concatenated (caller frees); returns the batch count. */
static int64_t run_epoch(ampc_loader *ld, int64_t epoch, float **imgs, int64_t **labs, int64_t *n_out,
                         int64_t *last_rows) {
    ASSERT_OK(ampc_loader_start_epoch(ld, epoch));
    int64_t c, h, w, nb = 0, n = 0;
    ampc_loader_sample_shape(ld, &c, &h, &w);
    size_t cap = 64;
    *imgs = malloc(cap * (size_t)(c * h * w) * sizeof(float));
    *labs = malloc(cap * sizeof(int64_t));
    ampc_tensor *x, *y;
    int rc;
    ampc_scope_begin();
    while ((rc = ampc_loader_next(ld, &x, &y)) == 1) {
        assert_int_equal(ampc_tensor_dtype(x), AMPC_F32);
        assert_int_equal(ampc_tensor_dtype(y), AMPC_I64);
        assert_int_equal(ampc_tensor_ndim(x), 4);
        int64_t rows = ampc_tensor_dim(x, 0);
        assert_true(ampc_tensor_dim(x, 1) == c && ampc_tensor_dim(x, 2) == h && ampc_tensor_dim(x, 3) == w);
        assert_int_equal(ampc_tensor_dim(y, 0), rows);
        while ((size_t)(n + rows) > cap) {
            cap *= 2;
            *imgs = realloc(*imgs, cap * (size_t)(c * h * w) * sizeof(float));
            *labs = realloc(*labs, cap * sizeof(int64_t));
        }
        memcpy(*imgs + n * c * h * w, ampc_tensor_data(x), (size_t)(rows * c * h * w) * sizeof(float));
        memcpy(*labs + n, ampc_tensor_data(y), (size_t)rows * sizeof(int64_t));
        n += rows;
        nb++;
        *last_rows = rows;
        ampc_scope_end();
        ampc_scope_begin();
    }
    ampc_scope_end();
    ASSERT_OK(rc);
    assert_int_equal(ampc_loader_next(ld, &x, &y), 0);   /* stays at the end */
    *n_out = n;
    return nb;
}

static void test_loader_coverage(void **state) {
    (void)state;
    ampc_dataset *ds = synth_new(103, 1, 2, 3, -1);
    for (int workers = 0; workers <= 2; workers++) {
        ampc_loader_options o = ampc_loader_defaults();
        o.batch_size = 10;
        o.seed = 99;
        o.num_workers = workers;
        o.prefetch = workers == 1 ? 1 : 0;
        ampc_loader *ld = ampc_loader_new(ds, &o);
        ASSERT_NOT_NULL_MSG(ld);
        assert_int_equal(ampc_loader_num_batches(ld), 11);
        int64_t first[2][10];
        for (int64_t epoch = 0; epoch < 2; epoch++) {
            float *imgs;
            int64_t *labs, n, last;
            assert_int_equal(run_epoch(ld, epoch, &imgs, &labs, &n, &last), 11);
            assert_int_equal(n, 103);
            assert_int_equal(last, 3);   /* the partial last batch */
            int seen[103] = {0};
            for (int64_t k = 0; k < n; k++) {
                int64_t id = (int64_t)imgs[k * 6];
                assert_in_range(id, 0, 102);
                seen[id]++;
                assert_int_equal(labs[k], id % 10);
                for (int p = 1; p < 6; p++) assert_true(imgs[k * 6 + p] == synth_pixel(id, p));
            }
            for (int i = 0; i < 103; i++) assert_int_equal(seen[i], 1);   /* each sample once */
            for (int k = 0; k < 10; k++) first[epoch][k] = (int64_t)imgs[k * 6];
            free(imgs), free(labs);
        }
        assert_memory_not_equal(first[0], first[1], sizeof first[0]);   /* order depends on epoch */
        ampc_loader_free(ld);
    }

    /* drop_last, no shuffle: the identity order in full batches */
    ampc_loader_options o = ampc_loader_defaults();
    o.batch_size = 10;
    o.shuffle = false;
    o.drop_last = true;
    o.num_workers = 2;
    ampc_loader *ld = ampc_loader_new(ds, &o);
    assert_int_equal(ampc_loader_num_batches(ld), 10);
    float *imgs;
    int64_t *labs, n, last;
    assert_int_equal(run_epoch(ld, 3, &imgs, &labs, &n, &last), 10);
    assert_int_equal(n, 100);
    assert_int_equal(last, 10);
    for (int64_t k = 0; k < n; k++) assert_true(imgs[k * 6] == (float)k);
    free(imgs), free(labs);
    ampc_loader_free(ld);

    o.batch_size = 0;
    assert_null(ampc_loader_new(ds, &o));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    ampc_dataset_free(ds);
}

static void test_loader_workers_bit_exact(void **state) {
    (void)state;
    ampc_dataset *ds = synth_new(77, 3, 8, 6, -1);
    ampc_transforms *t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_affine(t, 0.1, 0.9, 1.1, 15.0));
    ASSERT_OK(ampc_transforms_add_hflip(t, 0.5));
    ASSERT_OK(ampc_transforms_add_resize(t, 10, 9));
    ASSERT_OK(ampc_transforms_add_normalize(t, 3, (float[]){0.5f, 0.4f, 0.3f}, (float[]){0.2f, 0.25f, 0.3f}));
    const int workers[] = {0, 2, 1, 2}, prefetch[] = {0, 0, 1, 5};
    const size_t per = 3 * 10 * 9;
    float *by_seed[2] = {NULL, NULL};
    for (int seed = 0; seed < 2; seed++) {
        float *ref_img = NULL;
        int64_t *ref_lab = NULL;
        for (size_t v = 0; v < 4; v++) {
            ampc_loader_options o = ampc_loader_defaults();
            o.batch_size = 8;
            o.seed = 1000 + (uint64_t)seed;
            o.num_workers = workers[v];
            o.prefetch = prefetch[v];
            o.transforms = t;
            ampc_loader *ld = ampc_loader_new(ds, &o);
            ASSERT_NOT_NULL_MSG(ld);
            int64_t c, h, w;
            ampc_loader_sample_shape(ld, &c, &h, &w);
            assert_true(c == 3 && h == 10 && w == 9);
            float *imgs;
            int64_t *labs, n, last;
            run_epoch(ld, 4, &imgs, &labs, &n, &last);
            assert_int_equal(n, 77);
            if (v == 0) {
                ref_img = imgs, ref_lab = labs;
            } else {
                /* bit-identical for every worker count and prefetch depth */
                assert_memory_equal(imgs, ref_img, 77 * per * sizeof(float));
                assert_memory_equal(labs, ref_lab, 77 * sizeof(int64_t));
                free(imgs), free(labs);
            }
            ampc_loader_free(ld);
        }
        by_seed[seed] = ref_img;
        free(ref_lab);
    }
    /* a different seed: different order and augmentations */
    assert_memory_not_equal(by_seed[0], by_seed[1], 77 * per * sizeof(float));
    free(by_seed[0]), free(by_seed[1]);
    ampc_transforms_free(t);   /* the loader kept its own copy */
    ampc_dataset_free(ds);
}

/* options.device: the images on the device (REF: in its f64; on a GPU: CUDA f32, with workers
   through the page-locked slots' asynchronous uploads), the labels on the CPU, each batch the
   CPU loader's values; with 0 and 2 workers, over an epoch, an epoch abandoned after 3 batches
   and the next one whole; a loader freed with an upload in flight. */
static void test_loader_device(void **state) {
    (void)state;
    ampc_dataset *ds = synth_new(77, 3, 8, 6, -1);
    const ampc_device devs[] = {AMPC_DEVICE_REF, AMPC_DEVICE_CUDA};
    for (int d = 0; d < 2; d++) {
        if (devs[d] == AMPC_DEVICE_CUDA && !tu_cuda_available()) {
            print_message("loader on a device: no GPU here, CUDA skipped\n");
            continue;
        }
        for (int workers = 0; workers <= 2; workers += 2) {
            ampc_loader_options o = ampc_loader_defaults();
            o.batch_size = 8;
            o.seed = 5;
            o.num_workers = workers;
            ampc_loader *cpu = ampc_loader_new(ds, &o);
            o.device = devs[d];
            ampc_loader *dl = ampc_loader_new(ds, &o);
            ASSERT_NOT_NULL_MSG(cpu && dl);
            for (int64_t epoch = 0; epoch < 3; epoch++) {
                ASSERT_OK(ampc_loader_start_epoch(cpu, epoch));
                ASSERT_OK(ampc_loader_start_epoch(dl, epoch));
                ampc_scope_begin();
                for (int k = 0; epoch != 1 || k < 3; k++) {
                    ampc_tensor *x, *y, *xd, *yd;
                    int a = ampc_loader_next(cpu, &x, &y), b = ampc_loader_next(dl, &xd, &yd);
                    assert_int_equal(a, b);
                    if (a != 1) break;
                    assert_int_equal(ampc_tensor_device(xd), devs[d]);
                    assert_int_equal(ampc_tensor_device(yd), AMPC_DEVICE_CPU);
                    assert_int_equal(ampc_tensor_numel(xd), ampc_tensor_numel(x));
                    double *vx = tu_values(x), *vd = tu_values(xd);
                    assert_memory_equal(vx, vd, (size_t)ampc_tensor_numel(x) * sizeof(double));
                    assert_memory_equal(ampc_tensor_data(y), ampc_tensor_data(yd), (size_t)ampc_tensor_numel(y) * sizeof(int64_t));
                    free(vx), free(vd);
                    ampc_scope_end();
                    ampc_scope_begin();
                }
                ampc_scope_end();
            }
            ampc_loader_free(cpu);
            ampc_loader_free(dl);
            /* freed with the next batch's upload started */
            ampc_loader *early = ampc_loader_new(ds, &o);
            ASSERT_NOT_NULL_MSG(early);
            ampc_tensor *x, *y;
            ampc_scope_begin();
            assert_int_equal(ampc_loader_next(early, &x, &y), 1);
            ampc_scope_end();
            ampc_loader_free(early);
        }
    }
    ampc_loader_options o = ampc_loader_defaults();
    o.device = AMPC_DEVICE_COUNT;
    assert_null(ampc_loader_new(ds, &o));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    ampc_dataset_free(ds);
}

static void test_loader_early_free_and_restart(void **state) {
    (void)state;
    ampc_dataset *ds = synth_new(3000, 3, 16, 16, -1);
    ampc_transforms *t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_affine(t, 0.1, 0.9, 1.1, 10.0));
    ampc_loader_options o = ampc_loader_defaults();
    o.batch_size = 32;
    o.num_workers = 2;
    o.prefetch = 4;
    o.transforms = t;
    for (int taken = 0; taken < 3; taken++) {
        ampc_loader *ld = ampc_loader_new(ds, &o);
        ASSERT_NOT_NULL_MSG(ld);
        ampc_tensor *x, *y;
        ampc_scope_begin();
        for (int k = 0; k < taken; k++) assert_int_equal(ampc_loader_next(ld, &x, &y), 1);   /* epoch 0 implied */
        ampc_scope_end();
        ampc_loader_free(ld);   /* workers are mid-epoch: must stop and join */
    }
    ampc_transforms_free(t);

    /* Restarting mid-epoch abandons the old one: the new epoch is complete and exact. */
    o.transforms = NULL;
    o.batch_size = 100;
    ampc_loader *ld = ampc_loader_new(ds, &o);
    ampc_dataset_free(ds);   /* the loader holds its own reference */
    ampc_tensor *x, *y;
    ampc_scope_begin();
    ASSERT_OK(ampc_loader_start_epoch(ld, 0));
    for (int k = 0; k < 5; k++) assert_int_equal(ampc_loader_next(ld, &x, &y), 1);
    ampc_scope_end();
    float *imgs;
    int64_t *labs, n, last;
    assert_int_equal(run_epoch(ld, 1, &imgs, &labs, &n, &last), 30);
    int *seen = calloc(3000, sizeof *seen);
    for (int64_t k = 0; k < n; k++) seen[(int64_t)imgs[k * 768]]++;
    for (int i = 0; i < 3000; i++) assert_int_equal(seen[i], 1);
    free(seen), free(imgs), free(labs);
    ampc_loader_free(ld);
}

static void test_loader_errors(void **state) {
    (void)state;
    ampc_dataset *ds = synth_new(50, 1, 2, 2, 37);
    for (int workers = 0; workers <= 2; workers += 2) {
        ampc_loader_options o = ampc_loader_defaults();
        o.batch_size = 4;
        o.num_workers = workers;
        o.seed = 5;
        ampc_loader *ld = ampc_loader_new(ds, &o);
        ASSERT_NOT_NULL_MSG(ld);
        for (int64_t epoch = 0; epoch < 2; epoch++) {
            ASSERT_OK(ampc_loader_start_epoch(ld, epoch));
            ampc_tensor *x, *y;
            int rc, good = 0;
            bool seen_bad = false;
            ampc_scope_begin();
            while ((rc = ampc_loader_next(ld, &x, &y)) == 1) {
                int64_t rows = ampc_tensor_dim(x, 0);
                const float *p = ampc_tensor_data(x);
                for (int64_t k = 0; k < rows; k++) seen_bad |= p[k * 4] == 37.0f;
                good++;
            }
            ampc_scope_end();
            assert_false(seen_bad);
            assert_int_equal(rc, AMPC_ERR_IO);
            assert_null(x);
            const char *m = ampc_last_error();
            if (!strstr(m, "synthetic read failure at 37") || !strstr(m, "sample 37"))
                fail_msg("worker error message lost: '%s'", m);
            assert_true(good < 13);
            assert_int_equal(ampc_loader_next(ld, &x, &y), AMPC_ERR_IO);   /* sticky */
        }
        ampc_loader_free(ld);
    }
    ampc_dataset_free(ds);
}

/* start_epoch_at(e, k) hands out exactly batches k.. of an uninterrupted epoch e (transforms
   included), with and without workers; k = num_batches gives an empty rest; k out of range is an
   error. */
static void test_loader_start_at(void **state) {
    (void)state;
    ampc_dataset *ds = synth_new(45, 1, 4, 4, -1);
    ampc_transforms *t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_hflip(t, 0.5));
    for (int workers = 0; workers <= 2; workers += 2) {
        ampc_loader_options o = ampc_loader_defaults();
        o.batch_size = 7;
        o.seed = 11;
        o.num_workers = workers;
        o.transforms = t;
        ampc_loader *ld = ampc_loader_new(ds, &o);
        ASSERT_NOT_NULL_MSG(ld);
        float *imgs;
        int64_t *labs, n, last;
        assert_int_equal(run_epoch(ld, 3, &imgs, &labs, &n, &last), 7);
        for (int64_t k = 0; k <= 7; k++) {
            ASSERT_OK(ampc_loader_start_epoch_at(ld, 3, k));
            ampc_tensor *x, *y;
            int64_t row = k < 7 ? k * 7 : 45;
            ampc_scope_begin();
            while (ampc_loader_next(ld, &x, &y) == 1) {
                int64_t rows = ampc_tensor_dim(x, 0);
                assert_memory_equal(ampc_tensor_data(x), imgs + row * 16, (size_t)(rows * 16) * sizeof(float));
                assert_memory_equal(ampc_tensor_data(y), labs + row, (size_t)rows * sizeof(int64_t));
                row += rows;
            }
            ampc_scope_end();
            assert_int_equal(row, 45);
        }
        assert_int_equal(ampc_loader_start_epoch_at(ld, 3, 8), AMPC_ERR_INVALID);
        assert_int_equal(ampc_loader_start_epoch_at(ld, 3, -1), AMPC_ERR_INVALID);
        free(imgs), free(labs);
        ampc_loader_free(ld);
    }
    ampc_transforms_free(t);
    ampc_dataset_free(ds);
}

// ---------------------------------------------------------------------------------------------
// Loader shards (data-parallel ranks)

enum { SH_MAX_BATCHES = 128, SH_PER = 9 };   /* samples are 1 x 3 x 3 */

/* The batches one loader handed out, concatenated, with each batch's rows and the epoch
   position after it. */
typedef struct {
    int64_t nb, n, cap;
    int64_t rows[SH_MAX_BATCHES], pos[SH_MAX_BATCHES], grows[SH_MAX_BATCHES];   /* grows: all ranks' rows */
    float *imgs;      /* (n, SH_PER) */
    int64_t *labs;    /* (n): the sample's index (num_classes is above the dataset size) */
} taken;

static void taken_init(taken *t, int64_t cap) {
    memset(t, 0, sizeof *t);
    t->cap = cap;
    t->imgs = malloc((size_t)(cap > 0 ? cap : 1) * SH_PER * sizeof(float));
    t->labs = malloc((size_t)(cap > 0 ? cap : 1) * sizeof(int64_t));
}

static void taken_free(taken *t) { free(t->imgs), free(t->labs); }

/* Appends up to max batches of ld (max < 0: to the end of the epoch) to t. */
static void take(ampc_loader *ld, int64_t max, taken *t) {
    ampc_tensor *x, *y;
    int rc = 1;
    ampc_scope_begin();
    while ((max < 0 || max-- > 0) && (rc = ampc_loader_next(ld, &x, &y)) == 1) {
        int64_t rows = ampc_tensor_dim(y, 0);
        assert_true(t->nb < SH_MAX_BATCHES && t->n + rows <= t->cap);
        assert_int_equal(ampc_tensor_numel(x), rows * SH_PER);
        memcpy(t->imgs + t->n * SH_PER, ampc_tensor_data(x), (size_t)(rows * SH_PER) * sizeof(float));
        memcpy(t->labs + t->n, ampc_tensor_data(y), (size_t)rows * sizeof(int64_t));
        t->rows[t->nb] = rows;
        t->grows[t->nb] = ampc_loader_global_rows(ld);
        t->pos[t->nb++] = ampc_loader_epoch_position(ld);
        t->n += rows;
        ampc_scope_end();
        ampc_scope_begin();
    }
    ampc_scope_end();
    if (rc < 0) fail_msg("loader_next: %s", ampc_last_error());
}

static ampc_dataset *shard_dataset(int64_t n) {
    ampc_dataset *ds = synth_new(n, 1, 3, 3, -1);
    ds->num_classes = 1 << 20;   /* label = sample index */
    return ds;
}

static ampc_loader *shard_loader(ampc_dataset *ds, const ampc_transforms *tf, int64_t batch, bool drop_last,
                                 int workers, int rank, int count) {
    ampc_loader_options o = ampc_loader_defaults();
    o.batch_size = batch;
    o.drop_last = drop_last;
    o.seed = 21;
    o.num_workers = workers;
    o.transforms = tf;
    o.shard_rank = rank;
    o.shard_count = count;
    ampc_loader *ld = ampc_loader_new(ds, &o);
    ASSERT_NOT_NULL_MSG(ld);
    return ld;
}

/* One whole epoch of a single-process loader with batch size `batch`. */
static void single_epoch(ampc_dataset *ds, const ampc_transforms *tf, int64_t batch, bool drop_last, int64_t epoch,
                         taken *t) {
    ampc_loader *ld = shard_loader(ds, tf, batch, drop_last, 0, 0, 1);
    taken_init(t, ampc_dataset_size(ds));
    ASSERT_OK(ampc_loader_start_epoch(ld, epoch));
    take(ld, -1, t);
    ampc_loader_free(ld);
}

/* The epoch's permutation and every sample's transformed image, in that order (batch size 1). */
static void epoch_perm(ampc_dataset *ds, const ampc_transforms *tf, int64_t epoch, taken *perm) {
    single_epoch(ds, tf, 1, false, epoch, perm);
    const int64_t n = ampc_dataset_size(ds);
    assert_int_equal(perm->n, n);
    int *seen = calloc((size_t)n + 1, sizeof *seen);
    for (int64_t k = 0; k < n; k++) seen[perm->labs[k]]++;
    for (int64_t i = 0; i < n; i++) assert_int_equal(seen[i], 1);
    free(seen);
}

/* Batches this rank should get, from the rules written out again: full global batches of
   W * B, then the rest R split in rank order unless drop_last (R < W: some ranks get none). */
static int64_t expected_batches(int64_t left, int w, int64_t b, bool drop_last) {
    const int64_t g = w * b, rest = left % g;
    return left / g + (rest > 0 && !drop_last);
}

/* Rows of rank r in global batch s when the epoch has `left` samples. */
static int64_t expected_rows(int64_t left, int w, int64_t b, int64_t s, int r) {
    const int64_t g = w * b, rest = left - s * g;
    return rest >= g ? b : rest / w + (r < rest % w);
}

/* Walks global batches 0..nb of w ranks (tk[r]), rank after rank, checking each batch's size
   against the rules, each sample (label and image, bit for bit) against ref's sample stream
   from position at, and the epoch position after each batch (start: the epoch's first sample).
   Returns the position in ref after the last sample. */
static int64_t check_concat(const taken *tk, int w, int64_t b, int64_t start, int64_t n, const taken *ref, int64_t at) {
    const int64_t nb = tk[0].nb;
    int64_t off[8] = {0};
    for (int64_t s = 0; s < nb; s++) {
        const int64_t pos = start + (s + 1) * w * b < n ? start + (s + 1) * w * b : n;
        for (int r = 0; r < w; r++) {
            assert_int_equal(tk[r].nb, nb);
            assert_int_equal(tk[r].rows[s], expected_rows(n - start, w, b, s, r));
            assert_int_equal(tk[r].grows[s], n - start - s * w * b < w * b ? n - start - s * w * b : w * b);
            assert_int_equal(tk[r].pos[s], pos);
            const int64_t rows = tk[r].rows[s];
            assert_true(at + rows <= ref->n);
            assert_memory_equal(tk[r].labs + off[r], ref->labs + at, (size_t)rows * sizeof(int64_t));
            assert_memory_equal(tk[r].imgs + off[r] * SH_PER, ref->imgs + at * SH_PER, (size_t)(rows * SH_PER) * sizeof(float));
            off[r] += rows;
            at += rows;
        }
    }
    for (int r = 0; r < w; r++) assert_int_equal(off[r], tk[r].n);
    return at;
}

/* Runs w ranks of batch b over one epoch of a dataset of n samples and checks them against a
   single-process loader of batch w * b and against the permutation. cover counts the cases met:
   n % G == 0, R >= W, 0 < R < W, n < G. */
static void check_shards(int64_t n, int w, int64_t b, bool drop_last, int workers, const ampc_transforms *tf,
                         int cover[4]) {
    ampc_dataset *ds = shard_dataset(n);
    const int64_t epoch = 2, g = w * b, rest = n % g, nb = expected_batches(n, w, b, drop_last);
    cover[0] += rest == 0, cover[1] += rest >= w, cover[2] += rest > 0 && rest < w, cover[3] += n < g;
    taken perm, big, tk[8];
    epoch_perm(ds, tf, epoch, &perm);
    single_epoch(ds, tf, g, drop_last, epoch, &big);
    for (int r = 0; r < w; r++) {
        ampc_loader *ld = shard_loader(ds, tf, b, drop_last, workers, r, w);
        assert_int_equal(ampc_loader_num_batches(ld), nb);
        assert_int_equal(ampc_loader_epoch_position(ld), 0);
        taken_init(&tk[r], n);
        ASSERT_OK(ampc_loader_start_epoch(ld, epoch));
        take(ld, -1, &tk[r]);
        assert_int_equal(tk[r].nb, nb);
        ampc_loader_free(ld);
    }
    /* ranks' batch s in rank order = the single-process batch s of size G, bit for bit */
    const int64_t kept = check_concat(tk, w, b, 0, n, &big, 0);
    for (int64_t s = 0; s < nb; s++) {
        int64_t sum = 0;
        for (int r = 0; r < w; r++) sum += tk[r].rows[s];
        assert_int_equal(big.rows[s], sum);
    }
    /* every sample once, except the permutation's tail drop_last drops */
    assert_int_equal(kept, n / g * g + (rest > 0 && !drop_last ? rest : 0));
    int *seen = calloc((size_t)n, sizeof *seen);
    for (int r = 0; r < w; r++)
        for (int64_t k = 0; k < tk[r].n; k++) seen[tk[r].labs[k]]++;
    for (int64_t k = 0; k < n; k++) assert_int_equal(seen[perm.labs[k]], k < kept);
    free(seen);
    for (int r = 0; r < w; r++) taken_free(&tk[r]);
    taken_free(&perm), taken_free(&big);
    ampc_dataset_free(ds);
}

static ampc_transforms *shard_transforms(void) {
    ampc_transforms *t = ampc_transforms_new();
    ASSERT_OK(ampc_transforms_add_hflip(t, 0.5));
    ASSERT_OK(ampc_transforms_add_affine(t, 0.2, 0.9, 1.1, 20.0));
    return t;
}

static void test_loader_shards(void **state) {
    (void)state;
    ampc_transforms *tf = shard_transforms();
    const int64_t ns[] = {1, 2, 7, 12, 23, 30, 31, 60}, bs[] = {1, 3, 4};
    int cover[4] = {0};
    for (int w = 1; w <= 5; w++)
        for (size_t bi = 0; bi < sizeof bs / sizeof bs[0]; bi++)
            for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
                for (int drop = 0; drop <= 1; drop++)
                    for (int workers = 0; workers <= 2; workers += 2)
                        check_shards(ns[ni], w, bs[bi], drop, workers, tf, cover);
    for (int k = 0; k < 4; k++) assert_true(cover[k] > 0);
    ampc_transforms_free(tf);
}

/* An epoch's last global batch with fewer samples than ranks: kept by default, the ranks past its
   samples getting a batch of none (global rows: all of it); left out on every rank with
   drop_short_tail (SyncBatchNorm needs a sample on each), which keeps a tail of W or more. */
static void test_loader_short_tail(void **state) {
    (void)state;
    for (int n = 26; n <= 29; n += 3) {   /* 4 ranks x 3: two global batches of 12, then 2 or 5 */
        ampc_dataset *ds = shard_dataset(n);
        for (int drop_short = 0; drop_short <= 1; drop_short++)
            for (int r = 0; r < 4; r++) {
                ampc_loader_options o = ampc_loader_defaults();
                o.batch_size = 3;
                o.shard_rank = r;
                o.shard_count = 4;
                o.drop_short_tail = drop_short;
                ampc_loader *ld = ampc_loader_new(ds, &o);
                ASSERT_NOT_NULL_MSG(ld);
                const bool short_tail = n - 24 < 4;
                assert_int_equal(ampc_loader_num_batches(ld), drop_short && short_tail ? 2 : 3);
                assert_int_equal(ampc_loader_global_rows(ld), 0);
                taken t;
                taken_init(&t, n);
                take(ld, -1, &t);
                assert_int_equal(t.nb, drop_short && short_tail ? 2 : 3);
                if (t.nb == 3) {
                    assert_int_equal(t.grows[2], n - 24);
                    assert_int_equal(t.rows[2], (n - 24) / 4 + (r < (n - 24) % 4));
                }
                taken_free(&t);
                ampc_loader_free(ld);
            }
        ampc_dataset_free(ds);
    }
}

/* shard_count 1 (and rank 0) is the loader as it was: the same batches as the defaults and
   as NULL options, batch b = permutation positions [b*B, b*B + B), the short last batch kept. */
static void test_loader_shard_one(void **state) {
    (void)state;
    ampc_dataset *ds = shard_dataset(29);
    taken perm, tk[3];
    epoch_perm(ds, NULL, 0, &perm);
    ampc_loader_options o = ampc_loader_defaults();
    assert_int_equal(o.shard_rank, 0);
    assert_int_equal(o.shard_count, 1);
    o.seed = 21;
    o.batch_size = 8;
    ampc_loader *lds[3] = {ampc_loader_new(ds, &o), shard_loader(ds, NULL, 8, false, 0, 0, 1),
                           shard_loader(ds, NULL, 8, false, 2, 0, 1)};
    for (int v = 0; v < 3; v++) {
        ASSERT_NOT_NULL_MSG(lds[v]);
        assert_int_equal(ampc_loader_num_batches(lds[v]), 4);
        taken_init(&tk[v], 29);
        take(lds[v], -1, &tk[v]);   /* epoch 0 implied */
        assert_int_equal(tk[v].nb, 4);
        assert_int_equal(tk[v].rows[3], 5);
        assert_int_equal(tk[v].n, 29);
        assert_memory_equal(tk[v].labs, perm.labs, 29 * sizeof(int64_t));
        assert_memory_equal(tk[v].imgs, perm.imgs, 29 * SH_PER * sizeof(float));
        ampc_loader_free(lds[v]);
        taken_free(&tk[v]);
    }
    /* NULL options: batch 64, seed 0, one batch of all 29 */
    ampc_loader *ld = ampc_loader_new(ds, NULL);
    taken t;
    taken_init(&t, 29);
    take(ld, -1, &t);
    assert_int_equal(t.nb, 1);
    assert_int_equal(t.n, 29);
    assert_int_equal(ampc_loader_epoch_position(ld), 29);
    ampc_loader_free(ld);
    taken_free(&t), taken_free(&perm);
    ampc_dataset_free(ds);
}

/* w1 ranks take k batches each; their common epoch position resumes the epoch on w2 ranks:
   before and after together are the permutation in order, each sample once, up to the tail
   drop_last drops after the resume. */
static void check_resume(int64_t n, int64_t b, int w1, int w2, int64_t k, bool drop_last, int workers,
                         const ampc_transforms *tf) {
    ampc_dataset *ds = shard_dataset(n);
    const int64_t epoch = 5;
    taken perm, pre[8], post[8];
    epoch_perm(ds, tf, epoch, &perm);
    int64_t pos = -1;
    for (int r = 0; r < w1; r++) {
        ampc_loader *ld = shard_loader(ds, tf, b, drop_last, workers, r, w1);
        taken_init(&pre[r], n);
        ASSERT_OK(ampc_loader_start_epoch(ld, epoch));
        assert_int_equal(ampc_loader_epoch_position(ld), 0);
        take(ld, k, &pre[r]);
        int64_t p = ampc_loader_epoch_position(ld);
        if (r == 0) pos = p;
        assert_int_equal(p, pos);   /* the same on every rank */
        ampc_loader_free(ld);
    }
    const int64_t taken_k = pre[0].nb, full = taken_k * w1 * b;
    assert_int_equal(taken_k, k < expected_batches(n, w1, b, drop_last) ? k : expected_batches(n, w1, b, drop_last));
    assert_int_equal(pos, full < n ? full : n);
    assert_int_equal(check_concat(pre, w1, b, 0, n, &perm, 0), pos);   /* before: exactly perm[0, pos) */

    const int64_t nb2 = expected_batches(n - pos, w2, b, drop_last);
    for (int r = 0; r < w2; r++) {
        ampc_loader *ld = shard_loader(ds, tf, b, drop_last, workers, r, w2);
        taken_init(&post[r], n);
        assert_int_equal(ampc_loader_count_batches(ld, pos), nb2);   /* told before the start */
        ASSERT_OK(ampc_loader_start_epoch_at_sample(ld, epoch, pos));
        assert_int_equal(ampc_loader_num_batches(ld), nb2);
        assert_int_equal(ampc_loader_epoch_position(ld), pos);
        take(ld, -1, &post[r]);
        assert_int_equal(post[r].nb, nb2);
        ampc_loader_free(ld);
    }
    const int64_t rest = (n - pos) % (w2 * b);
    const int64_t at = check_concat(post, w2, b, pos, n, &perm, pos);
    assert_int_equal(at, n - rest + (rest > 0 && !drop_last ? rest : 0));
    for (int r = 0; r < w1; r++) taken_free(&pre[r]);
    for (int r = 0; r < w2; r++) taken_free(&post[r]);
    taken_free(&perm);
    ampc_dataset_free(ds);
}

static void test_loader_shard_resume(void **state) {
    (void)state;
    ampc_transforms *tf = shard_transforms();
    const int pairs[][2] = {{2, 1}, {1, 2}, {3, 2}, {2, 3}, {4, 3}, {1, 5}};
    const int64_t ns[] = {31, 40, 17};
    for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++)
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
            for (int64_t k = 0; k <= 6; k++)
                for (int drop = 0; drop <= 1; drop++)
                    for (int workers = 0; workers <= 2; workers += 2)
                        check_resume(ns[ni], 3, pairs[p][0], pairs[p][1], k, drop, workers, tf);
    ampc_transforms_free(tf);
}

/* Prefetching workers run ahead, but the position counts only the batches handed out: the same
   as without workers after every batch, and after a start_epoch_at. */
static void test_loader_shard_position_workers(void **state) {
    (void)state;
    ampc_dataset *ds = shard_dataset(101);
    int64_t pos[2][40];
    for (int v = 0; v < 2; v++) {
        ampc_loader_options o = ampc_loader_defaults();
        o.batch_size = 4;
        o.shard_rank = 1;
        o.shard_count = 3;
        o.num_workers = 2 * v;
        o.prefetch = 6 * v;
        ampc_loader *ld = ampc_loader_new(ds, &o);
        ASSERT_NOT_NULL_MSG(ld);
        assert_int_equal(ampc_loader_num_batches(ld), 9);   /* 8 x 12, then 5 split 2 2 1 */
        ampc_tensor *x, *y;
        ampc_scope_begin();
        ASSERT_OK(ampc_loader_start_epoch(ld, 1));
        for (int k = 0; k < 3; k++) assert_int_equal(ampc_loader_next(ld, &x, &y), 1);
        usleep(20000);   /* let the workers fill every slot */
        int64_t k = 0;
        pos[v][k++] = ampc_loader_epoch_position(ld);
        int rc;
        while ((rc = ampc_loader_next(ld, &x, &y)) == 1) pos[v][k++] = ampc_loader_epoch_position(ld);
        assert_int_equal(rc, 0);
        assert_int_equal(k, 7);
        ampc_scope_end();
        ASSERT_OK(ampc_loader_start_epoch_at(ld, 1, 4));
        pos[v][k++] = ampc_loader_epoch_position(ld);
        ampc_loader_free(ld);
    }
    assert_memory_equal(pos[0], pos[1], 8 * sizeof(int64_t));
    const int64_t want[8] = {36, 48, 60, 72, 84, 96, 101, 48};
    assert_memory_equal(pos[0], want, sizeof want);
    ampc_dataset_free(ds);
}

/* Bad shard options and resume positions: a clear error naming the value, no crash. */
static void test_loader_shard_errors(void **state) {
    (void)state;
    ampc_dataset *ds = shard_dataset(20);
    const int bad[][2] = {{2, 2}, {5, 3}, {-1, 2}, {0, 0}, {0, -3}};
    const char *words[] = {"shard_rank 2 not in [0, 2)", "shard_rank 5 not in [0, 3)", "shard_rank -1 not in [0, 2)",
                           "shard_count 0 < 1", "shard_count -3 < 1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ampc_loader_options o = ampc_loader_defaults();
        o.shard_rank = bad[i][0];
        o.shard_count = bad[i][1];
        ampc_clear_error();
        assert_null(ampc_loader_new(ds, &o));
        assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
        if (!strstr(ampc_last_error(), words[i])) fail_msg("'%s' lacks '%s'", ampc_last_error(), words[i]);
    }
    ampc_loader_options o = ampc_loader_defaults();
    o.batch_size = INT64_MAX / 2;
    o.shard_count = 3;
    assert_null(ampc_loader_new(ds, &o));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);

    ampc_loader *ld = shard_loader(ds, NULL, 3, false, 2, 1, 2);   /* 20 = 3 x 6 + 2: 4 batches */
    assert_int_equal(ampc_loader_num_batches(ld), 4);
    const int64_t bad_sample[] = {-1, 21, INT64_MAX};
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(ampc_loader_start_epoch_at_sample(ld, 0, bad_sample[i]), AMPC_ERR_INVALID);
        char want[64];
        snprintf(want, sizeof want, "first sample %lld not in [0, 20]", (long long)bad_sample[i]);
        if (!strstr(ampc_last_error(), want)) fail_msg("'%s' lacks '%s'", ampc_last_error(), want);
        assert_int_equal(ampc_loader_count_batches(ld, bad_sample[i]), -1);
        if (!strstr(ampc_last_error(), want)) fail_msg("'%s' lacks '%s'", ampc_last_error(), want);
    }
    assert_int_equal(ampc_loader_count_batches(NULL, 0), -1);
    assert_int_equal(ampc_loader_start_epoch_at_sample(ld, -1, 0), AMPC_ERR_INVALID);
    assert_int_equal(ampc_loader_start_epoch_at_sample(NULL, 0, 0), AMPC_ERR_INVALID);
    /* a short epoch does not shorten what start_epoch_at accepts */
    ASSERT_OK(ampc_loader_start_epoch_at_sample(ld, 0, 13));
    assert_int_equal(ampc_loader_num_batches(ld), 2);   /* 7 left: 6, then 1 (rank 1 gets none of it) */
    ASSERT_OK(ampc_loader_start_epoch_at(ld, 0, 4));
    assert_int_equal(ampc_loader_num_batches(ld), 4);
    assert_int_equal(ampc_loader_epoch_position(ld), 20);
    assert_int_equal(ampc_loader_start_epoch_at(ld, 0, 5), AMPC_ERR_INVALID);
    ASSERT_OK(ampc_loader_start_epoch_at_sample(ld, 0, 20));
    assert_int_equal(ampc_loader_num_batches(ld), 0);
    ampc_tensor *x, *y;
    assert_int_equal(ampc_loader_next(ld, &x, &y), 0);
    assert_int_equal(ampc_loader_epoch_position(ld), 20);
    ampc_loader_free(ld);
    assert_int_equal(ampc_loader_epoch_position(NULL), 0);
    ampc_dataset_free(ds);
}

// ---------------------------------------------------------------------------------------------
// Debian's Fashion-MNIST (dataset-fashion-mnist)

static void test_fashion_mnist(void **state) {
    (void)state;
    const char *dir = ampc_fashion_mnist_dir();
    if (!dir) {
        print_message("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist): skipped\n");
        skip();
    }
    ampc_dataset *train = ampc_dataset_mnist_open(dir, true);
    ASSERT_NOT_NULL_MSG(train);
    assert_int_equal(ampc_dataset_size(train), 60000);
    assert_int_equal(ampc_dataset_num_classes(train), 10);
    int64_t c, h, w, label;
    ampc_dataset_sample_shape(train, &c, &h, &w);
    assert_true(c == 1 && h == 28 && w == 28);
    float img[784];
    ASSERT_OK(ampc_dataset_get(train, 0, img, &label));
    assert_int_equal(label, 9);
    assert_string_equal(ampc_dataset_class_name(train, label), "Ankle boot");
    float lo = 1, hi = 0;
    for (int k = 0; k < 784; k++) lo = fminf(lo, img[k]), hi = fmaxf(hi, img[k]);
    assert_true(lo == 0.0f && hi == 1.0f);
    ampc_dataset_free(train);
    ampc_dataset *test = ampc_dataset_fashion_mnist_open(NULL, false);
    ASSERT_NOT_NULL_MSG(test);
    assert_int_equal(ampc_dataset_size(test), 10000);
    ampc_dataset_free(test);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_idx_plain_and_gzip),
        cmocka_unit_test(test_idx_corrupt),
        cmocka_unit_test(test_idx_fifo_and_links),
        cmocka_unit_test(test_mnist_open),
        cmocka_unit_test(test_subset_and_split),
        cmocka_unit_test(test_transforms_exact),
        cmocka_unit_test(test_transforms_reference),
        cmocka_unit_test(test_affine_matches_opencv),
        cmocka_unit_test(test_shift_scale_rotate),
        cmocka_unit_test(test_loader_coverage),
        cmocka_unit_test(test_loader_workers_bit_exact),
        cmocka_unit_test(test_loader_device),
        cmocka_unit_test(test_loader_early_free_and_restart),
        cmocka_unit_test(test_loader_errors),
        cmocka_unit_test(test_loader_start_at),
        cmocka_unit_test(test_loader_shards),
        cmocka_unit_test(test_loader_shard_one),
        cmocka_unit_test(test_loader_short_tail),
        cmocka_unit_test(test_loader_shard_resume),
        cmocka_unit_test(test_loader_shard_position_workers),
        cmocka_unit_test(test_loader_shard_errors),
        cmocka_unit_test(test_fashion_mnist),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
