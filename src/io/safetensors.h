/*
 * safetensors.h - the safetensors file format (src/io/safetensors.c), internal to src/io:
 * open a file (header parsed with jansson and validated, data read), list and find its
 * tensors and metadata, and write a file atomically from named tensors and metadata pairs.
 * It knows nothing of modules or optimizers: src/io/checkpoint.c maps those to names.
 */
#ifndef AMPC_IO_SAFETENSORS_H
#define AMPC_IO_SAFETENSORS_H

#include "core/core.h"

/* Limits on a header, so that a hostile file costs bounded time and memory (each a FORMAT error
   naming it): */
#define ST_MAX_HEADER_BYTES 100000000ull   /* the reference reader's limit */
#define ST_MAX_TENSORS 1000000             /* tensors in a header (a 100 MB header holds ~2 million) */
#define ST_MAX_META_KEYS 1000000           /* metadata keys: one step count per parameter, and more */
#define ST_MAX_DEPTH 3                     /* {"name": {"shape": [..]}}: no header nests deeper */

// ---------------------------------------------------------------------------------------------
// Dtypes: every safetensors dtype (to validate any file), and which ampc dtype each one is

typedef struct {
    const char *name;   /* "F32", "BF16", "U8", ... */
    size_t size;        /* bytes per element */
    int ampc;           /* ampc_dtype, or -1: not an ampc dtype */
} st_dtype;

extern const st_dtype st_dtypes[];
int st_dtype_of(ampc_dtype dt);   /* index into st_dtypes, or -1 */

/* "(2, 3)", "(3,)", "()" into buf. */
const char *st_fmt_shape(int ndim, const int64_t *shape, char *buf, size_t n);
/* Is s valid UTF-8 (no overlong forms, surrogates or code points past U+10FFFF)? */
bool st_utf8_valid(const char *s);

// ---------------------------------------------------------------------------------------------
// Reading

typedef struct {
    const char *name;   /* owned by the st_file */
    int dtype;          /* index into st_dtypes */
    int ndim;
    int64_t shape[AMPC_MAX_DIMS];
    uint64_t begin, end;   /* bytes [begin, end) of the data buffer */
    bool used;             /* free for the caller's bookkeeping (the loader marks what it matched) */
} st_entry;

typedef struct st_meta st_meta;   /* a metadata object: string keys to string values */

typedef struct {
    const char *path;
    int fd;
    st_entry *e;            /* n tensors, sorted by name */
    int n;
    st_meta *meta;          /* the "__metadata__" object, NULL when there is none */
    void *root;             /* the parsed header (owns the names) */
    uint64_t header_bytes;
    const unsigned char *data;   /* the data buffer (NULL when not read) */
    unsigned char *copy;    /* owns it */
} st_file;

/* Opens and validates the safetensors file at path: header JSON (strict schema, limits above),
   dtypes, shapes, and offsets tiling the data buffer; read_data: the data buffer is read into
   memory too (pread, never mapped: a file that shrinks meanwhile is an AMPC_ERR_IO, not a
   SIGBUS). On error (a negative status, message naming path) f holds nothing more than st_close
   releases. */
int st_open(st_file *f, const char *path, bool read_data);
void st_close(st_file *f);
/* The tensor called name, or NULL (binary search: O(log n) name comparisons). */
st_entry *st_find(st_file *f, const char *name);

/* Value of key in a metadata object (m NULL: none), or NULL. */
const char *st_meta_get(const st_meta *m, const char *key);
/* m as compact JSON text, malloc'd ("{}" for NULL); NULL + error when out of memory. */
char *st_meta_dump(const st_meta *m);
/* Parses text (a metadata JSON object, as st_meta_dump writes) into *out, to free with
   st_meta_free. Returns 0, or a negative status with the message "checkpoint metadata: ...". */
int st_meta_parse(const char *text, st_meta **out);
void st_meta_free(st_meta *m);

// ---------------------------------------------------------------------------------------------
// Writing

typedef struct {
    const char *name;
    ampc_dtype dtype;
    int ndim;
    const int64_t *shape;
    const void *data;   /* nbytes in host memory */
    size_t nbytes;
} st_tensor;

/* Writes the n tensors (reordered in place: by decreasing element size, stable, so that every
   tensor is aligned to its element size in a mapped file) and the metadata pairs meta_kv[2i],
   meta_kv[2i+1] (i < n_meta, in that order) to path atomically: "<path>.tmp.<pid>", fsync,
   rename, fsync of the directory. On failure the temporary file is removed and path is as it
   was. Names and metadata must be valid UTF-8 (the caller checks, to name the culprit); a
   metadata key given twice is an error. Returns 0 or a negative status. */
int st_write(const char *path, st_tensor *t, int n, const char *const *meta_kv, int n_meta);

#endif /* AMPC_IO_SAFETENSORS_H */
