/*
 * idx.c - IDX image/label files (the MNIST and Fashion-MNIST format), plain or gzip-compressed.
 *
 * Both files are loaded into memory as bytes (Fashion-MNIST's training set is 47 MB) and each
 * sample is converted to f32 on demand, so get() only reads shared immutable memory and is safe
 * from any number of loader threads.
 *
 * Corrupt input must give an error, never a crash or a huge allocation: a header's counts are
 * checked against the file size for plain files, and gzip streams are read incrementally into a
 * buffer that grows only as data actually arrives, so a header claiming 10^9 images in a 1 kB
 * file fails at the first short read.
 */
#include "data/data.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#define IDX_IMAGES_MAGIC 0x00000803u   /* ubyte, 3 dimensions */
#define IDX_LABELS_MAGIC 0x00000801u   /* ubyte, 1 dimension */
#define IDX_MAX_SIDE 16384u            /* rows/cols beyond this are a corrupt header */
#define IDX_MAX_COUNT 0x7fffffffu

// ---------------------------------------------------------------------------------------------
// Reading a plain or gzip file through zlib

typedef struct {
    const char *path;
    gzFile gz;
    bool gzipped;       /* told by the content's first two bytes (1f 8b), not by the name */
    uint64_t size;      /* bytes on disk */
    uint64_t consumed;  /* bytes of content read so far */
} reader;

static int reader_open(reader *r, const char *path) {
    memset(r, 0, sizeof *r);
    r->path = path;
    struct stat st;
    int fd = ampc__open_regular(path, "IDX file", &st);   /* a FIFO would block gzopen forever */
    if (fd < 0) return fd;
    unsigned char m[2] = {0, 0};
    ssize_t got = read(fd, m, 2);
    if (got < 0 || lseek(fd, 0, SEEK_SET) != 0) {
        int rc = ampc__err(AMPC_ERR_IO, "IDX file: cannot read '%s': %s", path, strerror(errno));
        close(fd);
        return rc;
    }
    r->size = (uint64_t)st.st_size;
    r->gzipped = got == 2 && m[0] == 0x1f && m[1] == 0x8b;
    /* zlib reads plain files transparently, so one code path serves both; gzclose closes fd. */
    r->gz = gzdopen(fd, "rb");
    if (!r->gz) {
        close(fd);
        return ampc__err(AMPC_ERR_OOM, "IDX file '%s': zlib could not allocate its state", path);
    }
    gzbuffer(r->gz, 1 << 17);
    return AMPC_OK;
}

static void reader_close(reader *r) {
    if (r->gz) gzclose(r->gz);
    r->gz = NULL;
}

/* Reads exactly n bytes, the part of `what` (total bytes in all) after `before` bytes of it; a
   short read is a truncated file (or a corrupt gzip stream). */
static int reader_read(reader *r, void *buf, uint64_t n, const char *what, uint64_t before, uint64_t total) {
    uint64_t done = 0;
    while (done < n) {
        uint64_t left = n - done;
        unsigned chunk = left > (1u << 30) ? (1u << 30) : (unsigned)left;
        int k = gzread(r->gz, (char *)buf + done, chunk);
        if (k < 0) {
            int zerr = 0;
            const char *msg = gzerror(r->gz, &zerr);
            return ampc__err(AMPC_ERR_FORMAT, "'%s': truncated or corrupt %s: expected %llu bytes of %s, read error after %llu: %s",
                             r->path, r->gzipped ? "gzip stream" : "file", (unsigned long long)total, what,
                             (unsigned long long)(before + done), msg ? msg : "?");
        }
        if (k == 0)
            return ampc__err(AMPC_ERR_FORMAT, "'%s': truncated %s: expected %llu bytes of %s, only %llu present",
                             r->path, r->gzipped ? "gzip stream" : "file", (unsigned long long)total, what,
                             (unsigned long long)(before + done));
        done += (uint64_t)k;
    }
    r->consumed += n;
    return AMPC_OK;
}

/* Reads n bytes of payload into a new buffer grown as data arrives (see the file comment), after
   checking that they fit in memory (units of `unit` bytes each, for the message). */
static int reader_read_payload(reader *r, uint64_t n, const char *what, uint64_t unit, const char *units, uint8_t **out) {
    *out = NULL;
    if (!r->gzipped && n > r->size - (r->consumed < r->size ? r->consumed : r->size))
        return ampc__err(AMPC_ERR_FORMAT, "'%s': truncated file: the header announces %llu bytes of %s, the file has %llu after the header",
                         r->path, (unsigned long long)n, what,
                         (unsigned long long)(r->size > r->consumed ? r->size - r->consumed : 0));
    /* a payload larger than the machine allows is an error, not the OOM killer's (gzip: as announced) */
    char what_fits[4200];
    snprintf(what_fits, sizeof what_fits, "'%s' (%llu bytes of %s)", r->path, (unsigned long long)n, what);
    int fits = ampc__memory_fits(n, what_fits, unit, units);
    if (fits < 0) return fits;
    uint64_t cap = r->gzipped ? (n < (1u << 20) ? n : (1u << 20)) : n, have = 0;
    uint8_t *buf = malloc(cap ? cap : 1);
    if (!buf) return ampc__err(AMPC_ERR_OOM, "'%s': out of memory for %llu bytes", r->path, (unsigned long long)cap);
    while (have < n) {
        if (have == cap) {
            uint64_t ncap = cap * 2 < n ? cap * 2 : n;
            uint8_t *nb = realloc(buf, ncap);
            if (!nb) {
                free(buf);
                return ampc__err(AMPC_ERR_OOM, "'%s': out of memory for %llu bytes", r->path, (unsigned long long)ncap);
            }
            buf = nb;
            cap = ncap;
        }
        int rc = reader_read(r, buf + have, cap - have, what, have, n);
        if (rc < 0) {
            free(buf);
            return rc;
        }
        have = cap;
    }
    *out = buf;
    return AMPC_OK;
}

static int reader_expect_end(reader *r) {
    unsigned char extra;
    int k = gzread(r->gz, &extra, 1);
    if (k > 0)
        return ampc__err(AMPC_ERR_FORMAT, "'%s': unexpected data after the %llu bytes the header describes",
                         r->path, (unsigned long long)r->consumed);
    if (k < 0) {
        int zerr = 0;
        const char *msg = gzerror(r->gz, &zerr);
        return ampc__err(AMPC_ERR_FORMAT, "'%s': corrupt gzip stream after the data: %s", r->path, msg ? msg : "?");
    }
    return AMPC_OK;
}

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* Header: magic then ndim big-endian u32 sizes, each in [1, max[d]]. */
static int read_header(reader *r, uint32_t magic, int ndim, uint32_t *dims, const uint32_t *max, const char *kind) {
    unsigned char h[16];
    const uint64_t len = 4 + 4 * (uint64_t)ndim;
    int rc = reader_read(r, h, 4, "header", 0, len);   /* the magic first: the best diagnosis */
    if (rc < 0) return rc;
    uint32_t m = be32(h);
    if (m != magic)
        return ampc__err(AMPC_ERR_FORMAT, "'%s': wrong magic 0x%08x, expected 0x%08x (IDX %s: unsigned bytes, %d dimension%s)",
                         r->path, m, magic, kind, ndim, ndim > 1 ? "s" : "");
    if ((rc = reader_read(r, h + 4, len - 4, "header", 4, len)) < 0) return rc;
    static const char *names[3] = {"count", "rows", "columns"};
    for (int d = 0; d < ndim; d++) {
        dims[d] = be32(h + 4 + 4 * d);
        if (dims[d] == 0 || dims[d] > max[d])
            return ampc__err(AMPC_ERR_FORMAT, "'%s': absurd %s %u in the header (allowed 1 to %u)", r->path,
                             names[d], dims[d], max[d]);
    }
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// The dataset

typedef struct {
    uint8_t *pixels;   /* (N, rows, cols) */
    uint8_t *labels;   /* (N) */
    float lut[256];    /* k / 255, as torchvision's ToTensor computes it */
} idx_impl;

static int idx_get(ampc_dataset *ds, int64_t i, float *img, int64_t *label) {
    const idx_impl *d = ds->impl;
    size_t n = (size_t)(ds->height * ds->width);
    const uint8_t *px = d->pixels + (size_t)i * n;
    for (size_t k = 0; k < n; k++) img[k] = d->lut[px[k]];
    *label = d->labels[i];
    return AMPC_OK;
}

static void idx_free(ampc_dataset *ds) {
    idx_impl *d = ds->impl;
    if (!d) return;
    free(d->pixels);
    free(d->labels);
    free(d);
}

static const ampc_dataset_vtable idx_vt = {"idx", idx_get, idx_free, NULL};

static int load_images(const char *path, uint32_t dims[3], uint8_t **pixels) {
    reader r;
    int rc = reader_open(&r, path);
    static const uint32_t max[3] = {IDX_MAX_COUNT, IDX_MAX_SIDE, IDX_MAX_SIDE};
    if (rc >= 0) rc = read_header(&r, IDX_IMAGES_MAGIC, 3, dims, max, "images");
    if (rc >= 0) rc = reader_read_payload(&r, (uint64_t)dims[0] * dims[1] * dims[2], "pixels", (uint64_t)dims[1] * dims[2], "images", pixels);
    if (rc >= 0) rc = reader_expect_end(&r);
    reader_close(&r);
    if (rc < 0) {
        free(*pixels);
        *pixels = NULL;
    }
    return rc;
}

static int load_labels(const char *path, uint32_t *count, uint8_t **labels) {
    reader r;
    int rc = reader_open(&r, path);
    static const uint32_t max[1] = {IDX_MAX_COUNT};
    if (rc >= 0) rc = read_header(&r, IDX_LABELS_MAGIC, 1, count, max, "labels");
    if (rc >= 0) rc = reader_read_payload(&r, *count, "labels", 1, "labels", labels);
    if (rc >= 0) rc = reader_expect_end(&r);
    reader_close(&r);
    if (rc < 0) {
        free(*labels);
        *labels = NULL;
    }
    return rc;
}

/* classes > 0: a declared class count that every label must respect; 0: max label + 1. */
static ampc_dataset *idx_open(const char *images_path, const char *labels_path, int classes,
                              const char *const *names) {
    if (!images_path || !labels_path) return ampc__err_null(AMPC_ERR_INVALID, "dataset_idx_open: NULL path");
    uint32_t dims[3] = {0, 0, 0}, n_labels = 0;
    uint8_t *pixels = NULL, *labels = NULL;
    if (load_images(images_path, dims, &pixels) < 0) return NULL;
    if (load_labels(labels_path, &n_labels, &labels) < 0) {
        free(pixels);
        return NULL;
    }
    ampc_dataset *ds = NULL;
    if (n_labels != dims[0]) {
        ampc__err(AMPC_ERR_FORMAT, "count mismatch: '%s' has %u images but '%s' has %u labels", images_path,
                  dims[0], labels_path, n_labels);
        goto fail;
    }
    int max_label = 0;
    for (uint32_t i = 0; i < n_labels; i++) {
        if (classes > 0 && labels[i] >= classes) {
            ampc__err(AMPC_ERR_FORMAT, "'%s': label %d of sample %u out of range for %d classes", labels_path,
                      labels[i], i, classes);
            goto fail;
        }
        if (labels[i] > max_label) max_label = labels[i];
    }
    idx_impl *d = calloc(1, sizeof *d);
    if (!d || !(ds = ampc__dataset_alloc(&idx_vt))) {
        free(d);
        ampc__err(AMPC_ERR_OOM, "dataset_idx_open: out of memory");
        goto fail;
    }
    d->pixels = pixels;
    d->labels = labels;
    for (int k = 0; k < 256; k++) d->lut[k] = (float)k / 255.0f;
    ds->impl = d;
    ds->size = dims[0];
    ds->num_classes = classes > 0 ? classes : max_label + 1;
    ds->channels = 1;
    ds->height = dims[1];
    ds->width = dims[2];
    ds->fingerprint = ampc__fnv(ampc__fnv(AMPC__FNV_START, dims, sizeof dims), labels, n_labels);   /* headers and labels */
    if (names) {
        ds->class_names = calloc((size_t)ds->num_classes, sizeof *ds->class_names);
        for (int64_t k = 0; ds->class_names && k < ds->num_classes; k++)
            if (!(ds->class_names[k] = strdup(names[k]))) {
                ampc_dataset_free(ds);   /* frees the names made so far, pixels and labels */
                return ampc__err_null(AMPC_ERR_OOM, "dataset_idx_open: out of memory");
            }
        if (!ds->class_names) {
            ampc_dataset_free(ds);
            return ampc__err_null(AMPC_ERR_OOM, "dataset_idx_open: out of memory");
        }
    }
    return ds;
fail:
    free(pixels);
    free(labels);
    return NULL;
}

ampc_dataset *ampc_dataset_idx_open(const char *images_path, const char *labels_path) {
    return idx_open(images_path, labels_path, 0, NULL);
}

// ---------------------------------------------------------------------------------------------
// MNIST and Fashion-MNIST

static const char *const fashion_names[10] = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                              "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};

/* dir/base, or dir/base.gz when only that exists. */
static int find_file(const char *dir, const char *base, char *path, size_t n) {
    snprintf(path, n, "%s/%s", dir, base);
    if (access(path, F_OK) == 0) return AMPC_OK;
    int len = snprintf(path, n, "%s/%s.gz", dir, base);
    if (len < 0 || (size_t)len >= n) return ampc__err(AMPC_ERR_INVALID, "path too long: '%s/%s.gz'", dir, base);
    if (access(path, F_OK) == 0) return AMPC_OK;
    return ampc__err(AMPC_ERR_IO, "'%s': neither %s nor %s.gz found", dir, base, base);
}

static ampc_dataset *mnist_open(const char *dir, bool train, bool fashion) {
    if (!dir) return ampc__err_null(AMPC_ERR_INVALID, "dataset_mnist_open: NULL directory");
    char img[4096], lbl[4096];
    const char *pre = train ? "train" : "t10k";
    char base_img[64], base_lbl[64];
    snprintf(base_img, sizeof base_img, "%s-images-idx3-ubyte", pre);
    snprintf(base_lbl, sizeof base_lbl, "%s-labels-idx1-ubyte", pre);
    if (find_file(dir, base_img, img, sizeof img) < 0 || find_file(dir, base_lbl, lbl, sizeof lbl) < 0) return NULL;
    return idx_open(img, lbl, 10, fashion ? fashion_names : NULL);
}

ampc_dataset *ampc_dataset_mnist_open(const char *dir, bool train) {
    /* The directory's own name decides ("/usr/share/datasets/fashion-mnist"), ignoring a
       trailing slash. */
    bool fashion = false;
    if (dir) {
        size_t len = strlen(dir);
        while (len > 1 && dir[len - 1] == '/') len--;
        size_t start = len;
        while (start > 0 && dir[start - 1] != '/') start--;
        for (size_t i = start; i + 7 <= len && !fashion; i++) fashion = strncasecmp(dir + i, "fashion", 7) == 0;
    }
    return mnist_open(dir, train, fashion);
}

ampc_dataset *ampc_dataset_fashion_mnist_open(const char *dir, bool train) {
    if (!dir && !(dir = ampc_fashion_mnist_dir()))
        return ampc__err_null(AMPC_ERR_IO, "Fashion-MNIST not found: install Debian's dataset-fashion-mnist or set AMPC_FASHION_MNIST_DIR");
    return mnist_open(dir, train, true);
}

const char *ampc_fashion_mnist_dir(void) {
    static const char *debian = "/usr/share/datasets/fashion-mnist";   /* dataset-fashion-mnist */
    const char *env = getenv("AMPC_FASHION_MNIST_DIR");
    if (env && env[0]) return env;
    struct stat st;
    if (stat(debian, &st) == 0 && S_ISDIR(st.st_mode)) return debian;
    return NULL;
}
