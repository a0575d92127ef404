/*
 * tokens.c - token streams for language models as datasets of windows: a text file read as bytes
 * (vocabulary 256) or llm.c's pre-tokenised .bin files (a header of 256 int32: magic 20240520,
 * version 1 with uint16 GPT-2 tokens (vocabulary 50257) or version 2 with uint32 LLaMA-3 tokens
 * (128256), the token count; then the tokens), mapped read-only.
 *
 * A part [begin, end) of the stream (fractions: the training head, the held-out tail) is cut into
 * windows of T + 1 tokens that overlap by one: window i starts at shift + i T, its inputs are
 * tokens start .. start + T - 1 and its targets start + 1 .. start + T. The loader draws the shift
 * in [0, T) from (seed, epoch) when it shuffles, so each epoch sees the text cut at other places
 * (random windows, as nanoGPT's get_batch, without repeats within an epoch); unshuffled it is 0.
 */
#include "data/data.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define LLMC_MAGIC 20240520
#define LLMC_HEADER_BYTES 1024

typedef struct {
    void *map;            /* the whole file, mapped */
    size_t map_bytes;
    const unsigned char *tokens;   /* the first token of the stream */
    int width;            /* bytes per token: 1 (text), 2 (llm.c v1), 4 (llm.c v2) */
    int64_t first, count; /* the part: tokens [first, first + count) of the stream */
} tokens_impl;

static inline int64_t token_at(const tokens_impl *t, int64_t i) {
    const unsigned char *p = t->tokens + (size_t)i * (size_t)t->width;
    if (t->width == 1) return p[0];
    if (t->width == 2) return (int64_t)p[0] | (int64_t)p[1] << 8;
    return (int64_t)p[0] | (int64_t)p[1] << 8 | (int64_t)p[2] << 16 | (int64_t)p[3] << 24;
}

static int tokens_get_image(ampc_dataset *ds, int64_t i, float *img, int64_t *label) {
    (void)i, (void)img, (void)label;
    return ampc__err(AMPC_ERR_INVALID, "a token dataset (block size %lld) has windows of tokens, not images: the loader gives them as "
                     "(B, T) i64 batches", (long long)ds->block_size);
}

static int tokens_get_window(ampc_dataset *ds, int64_t i, int64_t shift, int64_t *x, int64_t *y) {
    const tokens_impl *t = ds->impl;
    const int64_t T = ds->block_size, start = t->first + shift + i * T;
    for (int64_t j = 0; j < T; j++) x[j] = token_at(t, start + j);
    for (int64_t j = 0; j < T; j++) y[j] = token_at(t, start + j + 1);
    return AMPC_OK;
}

static void tokens_free(ampc_dataset *ds) {
    tokens_impl *t = ds->impl;
    if (!t) return;
    if (t->map) munmap(t->map, t->map_bytes);
    free(t);
}

static const ampc_dataset_vtable tokens_vt = {"tokens", tokens_get_image, tokens_free, tokens_get_window};

/* Reads the file's format: an llm.c header (width 2 or 4, the vocabulary, *n tokens after it) or
   plain bytes. */
static int read_format(const char *path, const unsigned char *p, size_t bytes, int *width, int64_t *vocab, size_t *offset, int64_t *n) {
    int32_t h[3] = {0, 0, 0};
    if (bytes >= sizeof h) memcpy(h, p, sizeof h);
    if (bytes < LLMC_HEADER_BYTES || h[0] != LLMC_MAGIC) {   /* text: one token per byte */
        *width = 1, *vocab = 256, *offset = 0, *n = (int64_t)bytes;
        return AMPC_OK;
    }
    if (h[1] != 1 && h[1] != 2)
        return ampc__err(AMPC_ERR_FORMAT, "'%s': an llm.c token file of version %d (known: 1, uint16 GPT-2 tokens; 2, uint32 LLaMA-3 tokens)", path,
                         (int)h[1]);
    *width = h[1] == 1 ? 2 : 4;
    *vocab = h[1] == 1 ? 50257 : 128256;
    *offset = LLMC_HEADER_BYTES;
    *n = h[2];
    const size_t want = LLMC_HEADER_BYTES + (size_t)(h[2] < 0 ? 0 : h[2]) * (size_t)*width;
    if (h[2] < 0 || want != bytes)
        return ampc__err(AMPC_ERR_FORMAT, "'%s': the llm.c header says %d tokens (%zu bytes with the header), but the file has %zu bytes: "
                         "truncated or not a token file", path, (int)h[2], want, bytes);
    return AMPC_OK;
}

ampc_dataset *ampc_dataset_tokens_open(const char *path, const ampc_tokens_options *o) {
    if (!path || !o) return ampc__err_null(AMPC_ERR_INVALID, "dataset_tokens_open: NULL %s", path ? "options" : "path");
    const int64_t T = o->block_size;
    if (T < 1) return ampc__err_null(AMPC_ERR_INVALID, "dataset_tokens_open: block_size %lld < 1", (long long)T);
    if (!(o->begin >= 0 && o->begin < o->end && o->end <= 1))
        return ampc__err_null(AMPC_ERR_INVALID, "dataset_tokens_open: the part [%g, %g) is not within [0, 1]", o->begin, o->end);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ampc__err_null(AMPC_ERR_IO, "'%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        int e = errno;
        close(fd);
        return ampc__err_null(AMPC_ERR_IO, "'%s': %s", path, S_ISREG(st.st_mode) ? strerror(e) : "not a regular file");
    }
    size_t bytes = (size_t)st.st_size;
    void *map = bytes ? mmap(NULL, bytes, PROT_READ, MAP_PRIVATE, fd, 0) : NULL;
    close(fd);
    if (bytes && map == MAP_FAILED) return ampc__err_null(AMPC_ERR_IO, "'%s': cannot map it: %s", path, strerror(errno));
    tokens_impl *t = calloc(1, sizeof *t);
    ampc_dataset *ds = t ? ampc__dataset_alloc(&tokens_vt) : NULL;
    if (!ds) {
        free(t);
        if (map) munmap(map, bytes);
        return ampc__err_null(AMPC_ERR_OOM, "dataset_tokens_open");
    }
    t->map = map;
    t->map_bytes = bytes;
    ds->impl = t;
    int64_t vocab = 0, n = 0;
    size_t offset = 0;
    if (read_format(path, map, bytes, &t->width, &vocab, &offset, &n) < 0) {
        ampc__dataset_release(ds);
        return NULL;
    }
    t->tokens = map ? (const unsigned char *)map + offset : NULL;   /* an empty file maps nothing: refused below */
    t->first = (int64_t)floor(o->begin * (double)n);
    t->count = (int64_t)floor(o->end * (double)n) - t->first;
    /* window i, cut at shift s <= T - 1, reads tokens s + i T .. s + i T + T: all of them fit
       when (i + 2) T <= count */
    const int64_t usable = t->count / T - 1;
    if (usable < 1) {
        ampc__err(AMPC_ERR_FORMAT, "'%s': the part [%g, %g) holds %lld tokens, fewer than the %lld (twice the block size %lld) a window needs",
                  path, o->begin, o->end, (long long)t->count, (long long)(2 * T), (long long)T);
        ampc__dataset_release(ds);
        return NULL;
    }
    uint64_t h = ampc__fnv(AMPC__FNV_START, &t->width, sizeof t->width);
    int64_t top = 0;
    for (int64_t i = 0; i < t->count; i++) {
        int64_t v = token_at(t, t->first + i);
        top = v > top ? v : top;
    }
    if (top >= vocab) {
        ampc__err(AMPC_ERR_FORMAT, "'%s': token %lld is outside the vocabulary of %lld of this format", path, (long long)top, (long long)vocab);
        ampc__dataset_release(ds);
        return NULL;
    }
    h = ampc__fnv(h, t->tokens + (size_t)t->first * (size_t)t->width, (size_t)t->count * (size_t)t->width);
    ds->size = usable;
    ds->num_classes = vocab;
    ds->channels = ds->height = 1;
    ds->width = T;
    ds->block_size = T;
    ds->fingerprint = h;
    return ds;
}

int64_t ampc_dataset_block_size(const ampc_dataset *ds) {
    return ds && !ampc__dataset_stale(ds, "ampc_dataset_block_size") ? ds->block_size : 0;
}

int ampc_dataset_get_window(ampc_dataset *ds, int64_t i, int64_t shift, int64_t *x, int64_t *y) {
    if (!ds || !x || !y) return ampc__err(AMPC_ERR_INVALID, "dataset_get_window: NULL argument");
    if (ampc__dataset_stale(ds, "ampc_dataset_get_window")) return AMPC_ERR_STATE;
    if (!ds->block_size) return ampc__err(AMPC_ERR_INVALID, "dataset_get_window: a dataset of images has no token windows");
    if (i < 0 || i >= ds->size || shift < 0 || shift >= ds->block_size)
        return ampc__err(AMPC_ERR_INVALID, "dataset_get_window: window %lld (of %lld) with shift %lld (of block size %lld) is out of range",
                         (long long)i, (long long)ds->size, (long long)shift, (long long)ds->block_size);
    return ds->vt->get_window(ds, i, shift, x, y);
}
