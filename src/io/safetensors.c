/*
 * safetensors.c - the safetensors file format: reading (validated) and writing (atomic).
 *
 * Format (https://github.com/huggingface/safetensors): 8 bytes little-endian header size N,
 * N bytes of JSON
 *     {"__metadata__": {"format": "pt", ...}, "fc.weight": {"dtype": "F32", "shape": [10, 128],
 *      "data_offsets": [0, 5120]}, ...}
 * padded with spaces to a multiple of 8, then the data buffer; offsets are relative to the
 * buffer, and the tensors cover it contiguously without overlap. Tensors are written in order of
 * decreasing element size (8-byte dtypes first), as the reference writer does, so every tensor
 * is aligned to its element size in a memory-mapped file (PyTorch's reader maps it).
 *
 * The JSON is jansson's (parsed with duplicate keys refused; its input is checked to be UTF-8,
 * strings with \u0000 are refused): this file checks the schema on top, strictly (the header is
 * an object of tensors and one "__metadata__" object of strings; a tensor has exactly dtype,
 * shape and data_offsets; integers are non-negative and not fractions). A hostile file costs
 * bounded time and memory: the header's size, tensor count, metadata key count and nesting depth
 * are limited (the depth by one pass before jansson, which has a deeper limit of its own),
 * jansson's objects are hash tables, and tensor names are sorted once and binary-searched
 * (n log n in the header). jansson holds the whole header as values while it is checked: about
 * 17 bytes of memory per header byte at worst (1 GB for a header of a million tensors), so the
 * 100 MB header limit bounds it. The data is read into memory once (pread), not mapped: a file
 * truncated or rewritten while it is read is then a read error, where a mapping gave SIGBUS.
 */
#include "io/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* safetensors data is little-endian; tensors are written and read as their raw bytes */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c assumes a little-endian host"
#endif

/* Test hook: makes a save fail at a stage (1 writing data, 2 fsync, 3 rename), to check that
   the temporary file is removed and the previous checkpoint survives. 0: off. */
int ampc__checkpoint_fail_stage = 0;

/* Test hooks, so that a test can check that loading stays n log n in the header size by
   counting instead of timing: name comparisons made by this thread in the sorted tensor index
   (sort, lookups, merges), and JSON texts it parsed (each parse is linear in its text). */
_Thread_local uint64_t ampc__checkpoint_key_compares = 0;
_Thread_local uint64_t ampc__checkpoint_json_parses = 0;

// ---------------------------------------------------------------------------------------------
// Dtypes, shapes, UTF-8

const st_dtype st_dtypes[] = {
    {"BOOL", 1, -1}, {"U8", 1, -1},  {"I8", 1, -1},  {"F8_E5M2", 1, -1}, {"F8_E4M3", 1, -1},
    {"I16", 2, -1},  {"U16", 2, -1}, {"F16", 2, AMPC_F16}, {"BF16", 2, AMPC_BF16}, {"I32", 4, -1},
    {"U32", 4, -1},  {"F32", 4, AMPC_F32}, {"F64", 8, AMPC_F64}, {"I64", 8, AMPC_I64}, {"U64", 8, -1},
};
#define N_ST_DTYPES ((int)(sizeof st_dtypes / sizeof st_dtypes[0]))

int st_dtype_of(ampc_dtype dt) {
    for (int i = 0; i < N_ST_DTYPES; i++)
        if (st_dtypes[i].ampc == (int)dt) return i;
    return -1;
}

const char *st_fmt_shape(int ndim, const int64_t *shape, char *buf, size_t n) {
    size_t k = (size_t)snprintf(buf, n, "(");
    for (int d = 0; d < ndim && k < n; d++) k += (size_t)snprintf(buf + k, n - k, d ? ", %" PRId64 : "%" PRId64, shape[d]);
    if (k < n) snprintf(buf + k, n - k, ndim == 1 ? ",)" : ")");
    return buf;
}

bool st_utf8_valid(const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        unsigned c = *p, len, min;
        if (c < 0x80) {
            p++;
            continue;
        }
        if (c >= 0xc2 && c <= 0xdf) len = 2, min = 0x80;
        else if (c >= 0xe0 && c <= 0xef) len = 3, min = 0x800;
        else if (c >= 0xf0 && c <= 0xf4) len = 4, min = 0x10000;
        else return false;
        unsigned cp = c & (0x7f >> len);
        for (unsigned i = 1; i < len; i++) {   /* a NUL ends the string: not a continuation byte */
            if ((p[i] & 0xc0) != 0x80) return false;
            cp = (cp << 6) | (p[i] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
        p += len;
    }
    return true;
}

// ---------------------------------------------------------------------------------------------
// JSON text: depth check and parse

static json_t *J(const st_meta *m) { return (json_t *)m; }

/* Offset of the first '{' or '[' nested deeper than max in text (strings skipped), or -1: one
   pass without recursion, so that a deeply nested file is refused with its own message. */
static long long too_deep(const char *s, size_t n, int max) {
    int depth = 0;
    bool in_str = false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (in_str) {
            if (c == '\\') i++;
            else if (c == '"') in_str = false;
        } else if (c == '"') {
            in_str = true;
        } else if (c == '{' || c == '[') {
            if (++depth > max) return (long long)i;
        } else if ((c == '}' || c == ']') && depth > 0) {
            depth--;
        }
    }
    return -1;
}

/* text[0, n) parsed by jansson (duplicate keys refused), or NULL with the reason in err and
   *status set (AMPC_ERR_OOM or AMPC_ERR_FORMAT). */
static json_t *parse_json(const char *text, size_t n, const char *where, int *status, char *err, size_t err_n) {
    json_error_t je;
    ampc__checkpoint_json_parses++;
    json_t *root = json_loadb(text, n, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        *status = json_error_code(&je) == json_error_out_of_memory ? AMPC_ERR_OOM : AMPC_ERR_FORMAT;
        snprintf(err, err_n, "%s at byte %d of the %s", je.text, je.position, where);
    }
    return root;
}

static bool fail(char *err, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool fail(char *err, size_t n, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, n, fmt, ap);
    va_end(ap);
    return false;
}

/* A metadata object: string values, at most ST_MAX_META_KEYS keys. */
static bool meta_ok(json_t *m, char *err, size_t n) {
    if (!json_is_object(m)) return fail(err, n, "the metadata is not a JSON object");
    if (json_object_size(m) > ST_MAX_META_KEYS) return fail(err, n, "more than %d metadata keys (the limit)", ST_MAX_META_KEYS);
    const char *k;
    json_t *v;
    json_object_foreach(m, k, v) {
        if (!json_is_string(v)) return fail(err, n, "metadata values must be strings (key \"%.60s\")", k);
    }
    return true;
}

// ---------------------------------------------------------------------------------------------
// The header: the safetensors schema on jansson's values

/* A non-negative JSON integer (field `what` of tensor `name`) into *out. */
static bool u64_of(json_t *v, const char *what, const char *name, uint64_t *out, char *err, size_t n) {
    if (json_is_real(v)) return fail(err, n, "%s of tensor \"%.60s\": expected an integer, not a fraction", what, name);
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return fail(err, n, "%s of tensor \"%.60s\": expected a non-negative integer", what, name);
    *out = (uint64_t)json_integer_value(v);
    return true;
}

/* {"dtype": "F32", "shape": [..], "data_offsets": [b, e]} into e, each field exactly once
   (jansson refused duplicates). */
static bool tensor_ok(const char *name, json_t *info, st_entry *e, char *err, size_t n) {
    if (!json_is_object(info)) return fail(err, n, "tensor \"%.60s\" is not a JSON object", name);
    static const char *const fields[] = {"dtype", "shape", "data_offsets"};
    const char *k;
    json_t *v;
    json_object_foreach(info, k, v) {
        if (strcmp(k, fields[0]) && strcmp(k, fields[1]) && strcmp(k, fields[2]))
            return fail(err, n, "unknown field \"%.40s\" in tensor \"%.60s\"", k, name);
    }
    for (int f = 0; f < 3; f++)
        if (!json_object_get(info, fields[f])) return fail(err, n, "tensor \"%.60s\" lacks \"%s\"", name, fields[f]);
    *e = (st_entry){.name = name, .dtype = -1};
    const char *d = json_string_value(json_object_get(info, "dtype"));
    for (int i = 0; d && i < N_ST_DTYPES; i++)
        if (strcmp(d, st_dtypes[i].name) == 0) e->dtype = i;
    if (e->dtype < 0)
        return d ? fail(err, n, "unknown dtype \"%.20s\" of tensor \"%.60s\"", d, name)
                 : fail(err, n, "the dtype of tensor \"%.60s\" is not a string", name);
    json_t *shape = json_object_get(info, "shape"), *offs = json_object_get(info, "data_offsets");
    if (!json_is_array(shape)) return fail(err, n, "the shape of tensor \"%.60s\" is not an array", name);
    if (json_array_size(shape) > AMPC_MAX_DIMS)
        return fail(err, n, "tensor \"%.60s\" has more than %d dimensions", name, AMPC_MAX_DIMS);
    e->ndim = (int)json_array_size(shape);
    for (int i = 0; i < e->ndim; i++) {
        uint64_t s;
        if (!u64_of(json_array_get(shape, (size_t)i), "shape", name, &s, err, n)) return false;
        e->shape[i] = (int64_t)s;   /* json_int_t: at most INT64_MAX */
    }
    if (!json_is_array(offs) || json_array_size(offs) != 2)
        return fail(err, n, "the data_offsets of tensor \"%.60s\" are not [begin, end]", name);
    return u64_of(json_array_get(offs, 0), "data_offsets", name, &e->begin, err, n) &&
           u64_of(json_array_get(offs, 1), "data_offsets", name, &e->end, err, n);
}

static int cmp_entry_name(const void *a, const void *b) {
    ampc__checkpoint_key_compares++;
    return strcmp(((const st_entry *)a)->name, ((const st_entry *)b)->name);
}

/* The parsed header f->root into f->e (sorted by name) and f->meta. Error text in err. */
static bool header_ok(st_file *f, char *err, size_t n) {
    json_t *root = f->root;
    json_t *meta = json_object_get(root, "__metadata__");
    if (meta && !meta_ok(meta, err, n)) return false;
    f->meta = (st_meta *)meta;
    size_t count = json_object_size(root) - (meta != NULL);
    if (count > ST_MAX_TENSORS) return fail(err, n, "more than %d tensors (the limit)", ST_MAX_TENSORS);
    f->e = malloc((count ? count : 1) * sizeof *f->e);
    if (!f->e) return fail(err, n, "out of memory");
    const char *k;
    json_t *v;
    json_object_foreach(root, k, v) {
        if (v != meta && !tensor_ok(k, v, &f->e[f->n++], err, n)) return false;
    }
    if (f->n > 1) qsort(f->e, (size_t)f->n, sizeof *f->e, cmp_entry_name);
    return true;
}

st_entry *st_find(st_file *f, const char *name) {
    st_entry key = {.name = name};
    return f->n ? bsearch(&key, f->e, (size_t)f->n, sizeof *f->e, cmp_entry_name) : NULL;
}

static int cmp_by_offset(const void *a, const void *b, void *ctx) {
    const st_entry *e = ctx;
    const st_entry *x = &e[*(const int *)a], *y = &e[*(const int *)b];
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* The reference reader's checks: each tensor's byte count matches dtype and shape, and the
   tensors tile the data buffer [0, data_bytes) without gap or overlap. */
static int validate_layout(const char *path, const st_entry *es, int n, uint64_t data_bytes) {
    for (int i = 0; i < n; i++) {
        const st_entry *e = &es[i];
        uint64_t numel = 1;
        bool overflow = false;
        for (int d = 0; d < e->ndim; d++) {
            uint64_t s = (uint64_t)e->shape[d];
            if (s && numel > UINT64_MAX / s) overflow = true;
            numel *= s;
        }
        size_t sz = st_dtypes[e->dtype].size;
        if (overflow || numel > UINT64_MAX / sz)
            return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': tensor '%s' has an impossibly large shape", path, e->name);
        char sh[160];
        if (e->end < e->begin || e->end - e->begin != numel * sz)
            return ampc__err(AMPC_ERR_FORMAT,
                             "checkpoint '%s': tensor '%s' has data_offsets [%" PRIu64 ", %" PRIu64 ") but %s %s needs %" PRIu64
                             " bytes",
                             path, e->name, e->begin, e->end, st_dtypes[e->dtype].name, st_fmt_shape(e->ndim, e->shape, sh, sizeof sh),
                             numel * sz);
    }
    int *order = malloc((n > 0 ? (size_t)n : 1) * sizeof *order);
    if (!order) return ampc__err(AMPC_ERR_OOM, "checkpoint '%s': out of memory", path);
    for (int i = 0; i < n; i++) order[i] = i;
    if (n > 1) qsort_r(order, (size_t)n, sizeof *order, cmp_by_offset, (void *)es);
    uint64_t at = 0;
    int rc = AMPC_OK;
    for (int k = 0; k < n && rc == AMPC_OK; k++) {
        const st_entry *e = &es[order[k]];
        if (e->begin < at) {
            const st_entry *prev = &es[order[k - 1]];
            rc = ampc__err(AMPC_ERR_FORMAT,
                           "checkpoint '%s': tensors '%s' [%" PRIu64 ", %" PRIu64 ") and '%s' [%" PRIu64 ", %" PRIu64 ") overlap",
                           path, prev->name, prev->begin, prev->end, e->name, e->begin, e->end);
        } else if (e->begin > at) {
            rc = ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': bytes [%" PRIu64 ", %" PRIu64 ") of the data belong to no tensor",
                           path, at, e->begin);
        }
        at = e->end;
    }
    free(order);
    if (rc < 0) return rc;
    if (at > data_bytes)
        return ampc__err(AMPC_ERR_FORMAT,
                         "checkpoint '%s' is truncated: its tensors need %" PRIu64 " bytes of data after the header, the file has %" PRIu64,
                         path, at, data_bytes);
    if (at < data_bytes)
        return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': %" PRIu64 " bytes of trailing data after the last tensor", path,
                         data_bytes - at);
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Reading a file: header parsed and checked, data read

void st_close(st_file *f) {
    free(f->e);
    json_decref(f->root);   /* meta and the names belong to it */
    free(f->copy);
    if (f->fd >= 0) close(f->fd);
    *f = (st_file){.fd = -1};
}

/* -1 with errno set on a read error, or 0 at an early end of the file (it shrank). */
static int pread_all(int fd, void *buf, size_t n, off_t off) {
    unsigned char *p = buf;
    while (n) {
        ssize_t k = pread(fd, p, n, off);
        if (k < 0 && errno == EINTR) continue;
        if (k == 0) errno = 0;
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
        off += k;
    }
    return 0;
}

/* The n-byte header text at offset 8 of f, parsed into f->root, f->e and f->meta. */
static int read_header(st_file *f, uint64_t n) {
    const char *path = f->path;
    char *text = malloc(n ? n : 1);
    if (!text) return ampc__err(AMPC_ERR_OOM, "checkpoint '%s': out of memory for a %" PRIu64 "-byte header", path, n);
    int rc = AMPC_OK;
    char err[256] = "";
    long long deep;
    if (pread_all(f->fd, text, n, 8) < 0) {
        rc = ampc__err(AMPC_ERR_IO, "checkpoint '%s': read error", path);
    } else if (n == 0 || text[0] != '{') {
        rc = ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s' is not a safetensors file: the header does not start with '{'", path);
    } else if ((deep = too_deep(text, n, ST_MAX_DEPTH)) >= 0) {
        rc = ampc__err(AMPC_ERR_FORMAT,
                       "checkpoint '%s': malformed header: JSON nested deeper than %d levels (the most a safetensors header has) at byte %lld of the header",
                       path, ST_MAX_DEPTH, deep);
    } else if (!(f->root = parse_json(text, n, "header", &rc, err, sizeof err))) {
        rc = ampc__err(rc, "checkpoint '%s': malformed header: %s", path, err);
    } else if (!header_ok(f, err, sizeof err)) {
        rc = ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': malformed header: %s", path, err);
    }
    free(text);
    return rc;
}

int st_open(st_file *f, const char *path, bool read_data) {
    *f = (st_file){.path = path, .fd = -1};
    struct stat st;
    f->fd = ampc__open_regular(path, "checkpoint", &st);   /* a FIFO or device: refused at once */
    if (f->fd < 0) return ampc_last_status();
    uint64_t size = (uint64_t)st.st_size;
    unsigned char n8[8];
    if (size < 8 || pread_all(f->fd, n8, 8, 0) < 0)
        return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s' is too short to be a safetensors file (%" PRIu64 " bytes)", path, size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | n8[i];
    if (n > ST_MAX_HEADER_BYTES)
        return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s' is not a safetensors file: header size %" PRIu64 " is implausible", path, n);
    if (n > size - 8)
        return ampc__err(AMPC_ERR_FORMAT,
                         "checkpoint '%s': header size %" PRIu64 " exceeds the file size %" PRIu64 " (truncated or not a safetensors file)",
                         path, n, size);
    f->header_bytes = n;
    int rc = read_header(f, n);
    if (rc < 0) return rc;
    uint64_t data_bytes = size - 8 - n;
    rc = validate_layout(path, f->e, f->n, data_bytes);
    if (rc < 0) return rc;
    if (data_bytes == 0 || !read_data) {
        f->data = data_bytes == 0 ? (const unsigned char *)"" : NULL;
        return AMPC_OK;
    }
    /* the caller copies data only after every check has passed, from this one read */
    f->copy = malloc((size_t)data_bytes);
    if (!f->copy) return ampc__err(AMPC_ERR_OOM, "checkpoint '%s': out of memory for %" PRIu64 " bytes of data", path, data_bytes);
    if (pread_all(f->fd, f->copy, (size_t)data_bytes, (off_t)(8 + n)) < 0)
        return ampc__err(AMPC_ERR_IO, "checkpoint '%s': %s", path,
                         errno ? strerror(errno) : "the file shrank while it was read (written to by another process?)");
    f->data = f->copy;
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Metadata objects

const char *st_meta_get(const st_meta *m, const char *key) { return json_string_value(json_object_get(J(m), key)); }

char *st_meta_dump(const st_meta *m) {
    char *s = m ? json_dumps(J(m), JSON_COMPACT) : strdup("{}");
    return s ? s : ampc__err_null(AMPC_ERR_OOM, "checkpoint: out of memory for the metadata");
}

int st_meta_parse(const char *text, st_meta **out) {
    *out = NULL;
    size_t n = strlen(text);
    char err[256];
    int rc = AMPC_ERR_FORMAT;
    long long deep = too_deep(text, n, 1);   /* {"key": "value"}: any deeper value is no string */
    if (deep >= 0) return ampc__err(rc, "checkpoint metadata: metadata values must be strings at byte %lld", deep);
    json_t *m = parse_json(text, n, "metadata", &rc, err, sizeof err);
    if (!m) return ampc__err(rc, "checkpoint metadata: %s", err);
    if (!meta_ok(m, err, sizeof err)) {
        json_decref(m);
        return ampc__err(AMPC_ERR_FORMAT, "checkpoint metadata: %s", err);
    }
    *out = (st_meta *)m;
    return AMPC_OK;
}

void st_meta_free(st_meta *m) { json_decref(J(m)); }

// ---------------------------------------------------------------------------------------------
// Writing

static int write_all(int fd, const void *buf, size_t n) {
    const unsigned char *p = buf;
    while (n) {
        ssize_t k = write(fd, p, n > ((size_t)1 << 30) ? (size_t)1 << 30 : n);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static size_t elem_size(const st_tensor *t) { return ampc__dt(t->dtype)->size; }

/* Sorts by decreasing element size, stable (the caller's order within a size). */
static void order_tensors(st_tensor *t, int n) {
    for (int i = 1; i < n; i++) {   /* insertion sort: stable, and n is a few hundred */
        st_tensor x = t[i];
        int j = i - 1;
        while (j >= 0 && elem_size(&t[j]) < elem_size(&x)) {
            t[j + 1] = t[j];
            j--;
        }
        t[j + 1] = x;
    }
}

/* The header JSON, padded with spaces to a multiple of 8 (*len bytes, malloc'd), with the
   tensors' offsets in order; NULL + error. */
static char *header_text(const st_tensor *t, int n, const char *const *meta_kv, int n_meta, size_t *len) {
    json_t *root = json_object(), *meta = json_object();
    int rc = root && meta && json_object_set(root, "__metadata__", meta) == 0 ? AMPC_OK : AMPC_ERR_OOM;
    for (int i = 0; i < n_meta && rc == AMPC_OK; i++) {
        const char *k = meta_kv[2 * i], *v = meta_kv[2 * i + 1];
        if (json_object_get(meta, k)) rc = ampc__err(AMPC_ERR_INVALID, "checkpoint save: metadata key '%s' given twice", k);
        else if (json_object_set_new(meta, k, json_string(v))) rc = AMPC_ERR_OOM;
    }
    uint64_t at = 0;
    for (int i = 0; i < n && rc == AMPC_OK; i++) {
        int dt = st_dtype_of(t[i].dtype);
        if (dt < 0) {
            rc = ampc__err(AMPC_ERR_DTYPE, "checkpoint save: tensor '%s' is %s", t[i].name, ampc_dtype_name(t[i].dtype));
            break;
        }
        if (json_object_get(root, t[i].name)) {
            rc = ampc__err(AMPC_ERR_INVALID, "checkpoint save: tensor name '%s' given twice", t[i].name);
            break;
        }
        json_t *info = json_object(), *shape = json_array(), *offs = json_array();
        bool ok = info && shape && offs && !json_object_set_new(root, t[i].name, json_incref(info)) &&
                  !json_object_set_new(info, "dtype", json_string(st_dtypes[dt].name)) && !json_object_set(info, "shape", shape) &&
                  !json_object_set(info, "data_offsets", offs);
        for (int d = 0; ok && d < t[i].ndim; d++) ok = !json_array_append_new(shape, json_integer(t[i].shape[d]));
        ok = ok && !json_array_append_new(offs, json_integer((json_int_t)at));
        at += t[i].nbytes;
        ok = ok && !json_array_append_new(offs, json_integer((json_int_t)at));
        json_decref(info);
        json_decref(shape);
        json_decref(offs);
        if (!ok) rc = AMPC_ERR_OOM;
    }
    char *text = rc == AMPC_OK ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(meta);
    json_decref(root);
    if (rc == AMPC_ERR_OOM || (rc == AMPC_OK && !text)) return ampc__err_null(AMPC_ERR_OOM, "checkpoint save: out of memory for the header");
    if (rc < 0) return NULL;
    size_t k = strlen(text), padded = (k + 7) / 8 * 8;   /* 8-byte aligned data, as the reference writer pads */
    char *p = realloc(text, padded + 1);
    if (!p) {
        free(text);
        return ampc__err_null(AMPC_ERR_OOM, "checkpoint save: out of memory for the header");
    }
    memset(p + k, ' ', padded - k);
    p[padded] = '\0';
    *len = padded;
    return p;
}

static int write_file(const char *path, const char *tmp, const char *hdr, size_t hdr_len, const st_tensor *t, int n) {
    unlink(tmp);   /* a new file, never one placed there (O_EXCL: not a FIFO or a link to follow) */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return ampc__err(AMPC_ERR_IO, "checkpoint save '%s': can't create '%s': %s", path, tmp, strerror(errno));
    unsigned char n8[8];
    for (int i = 0; i < 8; i++) n8[i] = (unsigned char)((uint64_t)hdr_len >> (8 * i));
    int rc = AMPC_OK;
    const char *what = "write";
    if (write_all(fd, n8, 8) < 0 || write_all(fd, hdr, hdr_len) < 0) rc = AMPC_ERR_IO;
    for (int i = 0; i < n && rc == AMPC_OK; i++) {
        if (ampc__checkpoint_fail_stage == 1 && i == n / 2) {
            errno = ENOSPC;
            rc = AMPC_ERR_IO;
            break;
        }
        if (t[i].nbytes && write_all(fd, t[i].data, t[i].nbytes) < 0) rc = AMPC_ERR_IO;
    }
    if (rc == AMPC_OK) {
        what = "fsync";
        if (ampc__checkpoint_fail_stage == 2) errno = EIO, rc = AMPC_ERR_IO;
        else if (fsync(fd) < 0) rc = AMPC_ERR_IO;
    }
    int err = errno;
    if (close(fd) < 0 && rc == AMPC_OK) what = "close", err = errno, rc = AMPC_ERR_IO;
    if (rc == AMPC_OK) {
        what = "rename";
        if (ampc__checkpoint_fail_stage == 3) err = EXDEV, rc = AMPC_ERR_IO;
        else if (rename(tmp, path) < 0) err = errno, rc = AMPC_ERR_IO;
    }
    if (rc < 0) {
        unlink(tmp);
        return ampc__err(AMPC_ERR_IO, "checkpoint save '%s': %s of '%s' failed: %s (the previous file, if any, is unchanged)", path,
                         what, tmp, strerror(err));
    }
    /* make the rename durable; best effort (some filesystems can't fsync a directory) */
    const char *slash = strrchr(path, '/');
    char *dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
    int dfd = dir ? open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
    if (dfd >= 0) {
        (void)fsync(dfd);
        close(dfd);
    }
    free(dir);
    return AMPC_OK;
}

int st_write(const char *path, st_tensor *t, int n, const char *const *meta_kv, int n_meta) {
    order_tensors(t, n);
    size_t hdr_len = 0;
    char *hdr = header_text(t, n, meta_kv, n_meta, &hdr_len);
    if (!hdr) return ampc_last_status();
    size_t tn = strlen(path) + 32;
    char *tmp = malloc(tn);
    int rc;
    if (tmp) {
        snprintf(tmp, tn, "%s.tmp.%ld", path, (long)getpid());
        ampc__remove_stale_temps(path);   /* what killed writers left: full-size, never renamed */
        rc = write_file(path, tmp, hdr, hdr_len, t, n);
    } else {
        rc = ampc__err(AMPC_ERR_OOM, "checkpoint save: out of memory");
    }
    free(tmp);
    free(hdr);
    return rc;
}
