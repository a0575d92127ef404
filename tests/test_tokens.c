/*
 * test_tokens.c - token datasets (src/data/tokens.c) and their batches from the data loader: text
 * files as bytes, llm.c's .bin files of both versions, the windows' contents against the stream,
 * each epoch's cut and order (every window once), sharding across ranks, subsets, fingerprints,
 * and the refusals of bad files and options.
 */
#include "testutil.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char g_dir[] = "/tmp/ampc_tokens_XXXXXX";

static int setup(void **state) {
    if (!mkdtemp(g_dir)) return -1;
    return tu_group_setup(state);
}

static int teardown(void **state) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0) return -1;
    return tu_group_teardown(state);
}

static const char *write_file(const char *name, const void *p, size_t n) {
    static char path[256];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(p, 1, n, f), n);
    fclose(f);
    return path;
}

/* An llm.c token file: the header (magic, version, count) and the tokens in width bytes each,
   little-endian; header_count overrides the count written (for a lying header). */
static const char *write_bin(const char *name, int version, const uint32_t *tok, int64_t n, int64_t header_count) {
    const int w = version == 1 ? 2 : 4;
    size_t bytes = 1024 + (size_t)n * (size_t)w;
    unsigned char *buf = calloc(1, bytes);
    int32_t h[3] = {20240520, version, (int32_t)header_count};
    memcpy(buf, h, sizeof h);
    for (int64_t i = 0; i < n; i++)
        for (int b = 0; b < w; b++) buf[1024 + i * w + b] = (unsigned char)(tok[i] >> (8 * b));
    const char *p = write_file(name, buf, bytes);
    free(buf);
    return p;
}

/* A text file: windows of bytes, the shift and the held-out tail. */
static void test_text_windows(void **state) {
    (void)state;
    char text[1000];
    for (int i = 0; i < 1000; i++) text[i] = (char)(32 + (i * 7) % 95);
    const char *path = write_file("a.txt", text, sizeof text);
    ampc_dataset *ds = ampc_dataset_tokens_open(path, &(ampc_tokens_options){.block_size = 8, .begin = 0, .end = 0.9});
    ASSERT_NOT_NULL_MSG(ds);
    assert_int_equal(ampc_dataset_num_classes(ds), 256);
    assert_int_equal(ampc_dataset_block_size(ds), 8);
    assert_int_equal(ampc_dataset_size(ds), 900 / 8 - 1);   /* 111: with a shift of 7 the last still fits */
    int64_t c, h, w;
    ampc_dataset_sample_shape(ds, &c, &h, &w);
    assert_true(c == 1 && h == 1 && w == 8);
    int64_t x[8], y[8];
    for (int64_t i = 0; i < ampc_dataset_size(ds); i += 37)
        for (int64_t s = 0; s < 8; s += 3) {
            ASSERT_OK(ampc_dataset_get_window(ds, i, s, x, y));
            for (int j = 0; j < 8; j++) {
                assert_int_equal(x[j], (unsigned char)text[s + i * 8 + j]);
                assert_int_equal(y[j], (unsigned char)text[s + i * 8 + j + 1]);
            }
        }
    assert_int_equal(ampc_dataset_get_window(ds, ampc_dataset_size(ds), 0, x, y), AMPC_ERR_INVALID);
    assert_int_equal(ampc_dataset_get_window(ds, 0, 8, x, y), AMPC_ERR_INVALID);
    ampc_clear_error();
    float img[8];
    int64_t label;
    assert_int_equal(ampc_dataset_get(ds, 0, img, &label), AMPC_ERR_INVALID);
    ampc_clear_error();
    ampc_dataset *val = ampc_dataset_tokens_open(path, &(ampc_tokens_options){.block_size = 8, .begin = 0.9, .end = 1});
    ASSERT_NOT_NULL_MSG(val);
    assert_int_equal(ampc_dataset_size(val), 100 / 8 - 1);
    ASSERT_OK(ampc_dataset_get_window(val, 0, 0, x, y));
    assert_int_equal(x[0], (unsigned char)text[900]);   /* the tail starts at token floor(0.9 n) */
    assert_true(ampc_dataset_fingerprint(ds) != ampc_dataset_fingerprint(val));
    ampc_dataset *again = ampc_dataset_tokens_open(path, &(ampc_tokens_options){.block_size = 8, .begin = 0, .end = 0.9});
    assert_true(ampc_dataset_fingerprint(ds) == ampc_dataset_fingerprint(again));
    text[5] ^= 1;
    write_file("b.txt", text, sizeof text);
    char pb[256];
    snprintf(pb, sizeof pb, "%s/b.txt", g_dir);
    ampc_dataset *other = ampc_dataset_tokens_open(pb, &(ampc_tokens_options){.block_size = 8, .begin = 0, .end = 0.9});
    assert_true(ampc_dataset_fingerprint(ds) != ampc_dataset_fingerprint(other));
    ampc_dataset_free(other);
    ampc_dataset_free(again);
    ampc_dataset_free(val);
    ampc_dataset_free(ds);
}

/* llm.c's .bin, versions 1 (uint16, vocabulary 50257) and 2 (uint32, 128256): values past a byte. */
static void test_llmc_bin(void **state) {
    (void)state;
    enum { N = 500 };
    uint32_t tok[N];
    for (int i = 0; i < N; i++) tok[i] = (uint32_t)(i * 97 + 11) % 50257;
    for (int version = 1; version <= 2; version++) {
        if (version == 2) tok[3] = 128000;
        const char *path = write_bin(version == 1 ? "v1.bin" : "v2.bin", version, tok, N, N);
        ampc_dataset *ds = ampc_dataset_tokens_open(path, &(ampc_tokens_options){.block_size = 16, .begin = 0, .end = 1});
        ASSERT_NOT_NULL_MSG(ds);
        assert_int_equal(ampc_dataset_num_classes(ds), version == 1 ? 50257 : 128256);
        assert_int_equal(ampc_dataset_size(ds), N / 16 - 1);
        int64_t x[16], y[16];
        for (int64_t i = 0; i < ampc_dataset_size(ds); i++) {
            ASSERT_OK(ampc_dataset_get_window(ds, i, 5, x, y));
            for (int j = 0; j < 16; j++) assert_true(x[j] == tok[5 + i * 16 + j] && y[j] == tok[6 + i * 16 + j]);
        }
        ampc_dataset_free(ds);
    }
}

/* The loader: (B, T) i64 batches; unshuffled, window k of the epoch in order; shuffled, each
   epoch's windows cut at one shift in [0, T), every window exactly once; two shards of batch B,
   concatenated, are one loader's batch of 2 B; a subset (--limit-train) gives its windows. */
static void test_loader_windows(void **state) {
    (void)state;
    enum { N = 2000, T = 10 };
    uint32_t tok[N];
    for (int i = 0; i < N; i++) tok[i] = (uint32_t)i;   /* a token tells its position */
    const char *path = write_bin("pos.bin", 2, tok, N, N);
    ampc_dataset *ds = ampc_dataset_tokens_open(path, &(ampc_tokens_options){.block_size = T, .begin = 0, .end = 1});
    ASSERT_NOT_NULL_MSG(ds);
    const int64_t n = ampc_dataset_size(ds);
    assert_int_equal(n, N / T - 1);
    ampc_loader_options lo = ampc_loader_defaults();
    lo.batch_size = 7;
    lo.shuffle = false;
    lo.num_workers = 2;   /* ignored: windows are made on the calling thread */
    ampc_loader *ld = ampc_loader_new(ds, &lo);
    ASSERT_NOT_NULL_MSG(ld);
    int64_t seen = 0;
    ampc_tensor *x, *y;
    ampc_scope_begin();
    while (ampc_loader_next(ld, &x, &y) == 1) {
        assert_int_equal(ampc_tensor_dtype(x), AMPC_I64);
        assert_int_equal(ampc_tensor_ndim(x), 2);
        assert_int_equal(ampc_tensor_dim(x, 1), T);
        const int64_t *xd = ampc_tensor_cdata(x), *yd = ampc_tensor_cdata(y);
        for (int64_t k = 0; k < ampc_tensor_dim(x, 0); k++, seen++)
            for (int j = 0; j < T; j++) assert_true(xd[k * T + j] == seen * T + j && yd[k * T + j] == seen * T + j + 1);
    }
    ampc_scope_end();
    assert_int_equal(seen, n);
    ampc_loader_free(ld);

    lo.shuffle = true;
    lo.seed = 5;
    int64_t shifts[3];
    for (int64_t epoch = 0; epoch < 3; epoch++) {
        ld = ampc_loader_new(ds, &lo);
        ASSERT_OK(ampc_loader_start_epoch(ld, epoch));
        char *hit = calloc((size_t)n, 1);
        int64_t shift = -1, got = 0;
        ampc_scope_begin();
        while (ampc_loader_next(ld, &x, &y) == 1) {
            const int64_t *xd = ampc_tensor_cdata(x), *yd = ampc_tensor_cdata(y);
            for (int64_t k = 0; k < ampc_tensor_dim(x, 0); k++, got++) {
                int64_t start = xd[k * T];
                if (shift < 0) shift = start % T;
                assert_int_equal(start % T, shift);
                assert_int_equal(hit[start / T], 0);
                hit[start / T] = 1;
                assert_int_equal(yd[k * T + T - 1], start + T);
            }
        }
        ampc_scope_end();
        assert_int_equal(got, n);
        shifts[epoch] = shift;
        free(hit);
        ampc_loader_free(ld);
    }
    assert_false(shifts[0] == shifts[1] && shifts[1] == shifts[2]);   /* the cut moves (seed 5: 3 draws of 10) */

    /* two ranks of batch 4 against one of batch 8 */
    lo.batch_size = 8;
    ampc_loader *one = ampc_loader_new(ds, &lo);
    lo.batch_size = 4, lo.shard_count = 2;
    ampc_loader *r0 = (lo.shard_rank = 0, ampc_loader_new(ds, &lo)), *r1 = (lo.shard_rank = 1, ampc_loader_new(ds, &lo));
    ASSERT_NOT_NULL_MSG(one && r0 && r1);
    ampc_scope_begin();
    ampc_tensor *xa, *ya, *x0, *y0, *x1, *y1;
    while (ampc_loader_next(one, &xa, &ya) == 1) {
        assert_int_equal(ampc_loader_next(r0, &x0, &y0), 1);
        assert_int_equal(ampc_loader_next(r1, &x1, &y1), 1);
        const int64_t r0n = ampc_tensor_dim(x0, 0);
        assert_int_equal(r0n + ampc_tensor_dim(x1, 0), ampc_tensor_dim(xa, 0));
        assert_memory_equal(ampc_tensor_cdata(xa), ampc_tensor_cdata(x0), (size_t)(r0n * T) * sizeof(int64_t));
        assert_memory_equal((const int64_t *)ampc_tensor_cdata(xa) + r0n * T, ampc_tensor_cdata(x1),
                            (size_t)(ampc_tensor_dim(x1, 0) * T) * sizeof(int64_t));
    }
    ampc_scope_end();
    ampc_loader_free(one);
    ampc_loader_free(r0);
    ampc_loader_free(r1);

    int64_t idx[3] = {4, 0, 9};
    ampc_dataset *sub = ampc_dataset_subset(ds, idx, 3);
    ASSERT_NOT_NULL_MSG(sub);
    assert_int_equal(ampc_dataset_block_size(sub), T);
    int64_t wx[T], wy[T];
    ASSERT_OK(ampc_dataset_get_window(sub, 2, 3, wx, wy));
    assert_int_equal(wx[0], 3 + 9 * T);
    ampc_transforms *tf = ampc_transforms_new();
    lo = ampc_loader_defaults();
    lo.transforms = tf;
    tu_expect_error(ampc_loader_new(sub, &lo), AMPC_ERR_INVALID, "transforms apply to images");
    ampc_transforms_free(tf);
    ampc_dataset_free(sub);
    ampc_dataset_free(ds);
}

/* Bad files and options: each refused, naming the file and the problem. */
static void test_token_errors(void **state) {
    (void)state;
    const ampc_tokens_options o = {.block_size = 8, .begin = 0, .end = 1};
    char missing[256];
    snprintf(missing, sizeof missing, "%s/none.txt", g_dir);
    tu_expect_error(ampc_dataset_tokens_open(missing, &o), AMPC_ERR_IO, "none.txt");
    tu_expect_error(ampc_dataset_tokens_open(g_dir, &o), AMPC_ERR_IO, "not a regular file");
    const char *tiny = write_file("tiny.txt", "hello world", 11);
    tu_expect_error(ampc_dataset_tokens_open(tiny, &o), AMPC_ERR_FORMAT, "holds 11 tokens, fewer than the 16");
    tu_expect_error(ampc_dataset_tokens_open(write_file("empty.txt", "", 0), &o), AMPC_ERR_FORMAT, "holds 0 tokens");
    uint32_t tok[100] = {0};
    tu_expect_error(ampc_dataset_tokens_open(write_bin("short.bin", 1, tok, 100, 120), &o), AMPC_ERR_FORMAT, "says 120 tokens");
    tu_expect_error(ampc_dataset_tokens_open(write_bin("v3.bin", 3, tok, 100, 100), &o), AMPC_ERR_FORMAT, "version 3");
    tok[50] = 60000;
    tu_expect_error(ampc_dataset_tokens_open(write_bin("big.bin", 1, tok, 100, 100), &o), AMPC_ERR_FORMAT, "token 60000 is outside the vocabulary of 50257");
    char text[100];
    memset(text, 'a', sizeof text);
    const char *ok = write_file("ok.txt", text, sizeof text);
    tu_expect_error(ampc_dataset_tokens_open(ok, &(ampc_tokens_options){.block_size = 0, .begin = 0, .end = 1}), AMPC_ERR_INVALID, "block_size 0");
    tu_expect_error(ampc_dataset_tokens_open(ok, &(ampc_tokens_options){.block_size = 4, .begin = 0.5, .end = 0.5}), AMPC_ERR_INVALID,
                    "not within [0, 1]");
    tu_expect_error(ampc_dataset_tokens_open(ok, NULL), AMPC_ERR_INVALID, NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_text_windows),
        cmocka_unit_test(test_llmc_bin),
        cmocka_unit_test(test_loader_windows),
        cmocka_unit_test(test_token_errors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
