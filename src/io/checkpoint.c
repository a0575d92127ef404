/*
 * checkpoint.c - checkpoints as safetensors files (model, optimizer, scaler, RNG, user keys).
 *
 * Format (https://github.com/huggingface/safetensors): 8 bytes little-endian header size N,
 * N bytes of JSON
 *     {"__metadata__": {"format": "pt", ...}, "fc.weight": {"dtype": "F32", "shape": [10, 128],
 *      "data_offsets": [0, 5120]}, ...}
 * padded with spaces to a multiple of 8, then the data buffer; offsets are relative to the
 * buffer, and the tensors cover it contiguously without overlap. Tensors are written in order of
 * decreasing element size (8-byte dtypes first), as the reference writer does, so every tensor
 * is aligned to its element size in a memory-mapped file.
 *
 * What is stored:
 *   <state_dict name>                        model parameters and buffers, dtype as in memory
 *   optimizer.<param name>.<slot>            SGD momentum_buffer; Adam exp_avg, exp_avg_sq,
 *                                            max_exp_avg_sq (only slots that exist)
 *   __metadata__ (all values are strings):
 *     format "pt", ampc.version "1"
 *     optimizer.type ("SGD", "Adam", "AdamW"), optimizer.lr, optimizer.num_params,
 *     optimizer.<param name>.step             steps taken (Adam's bias correction)
 *     scaler.enabled, scaler.scale, scaler.growth_tracker, scaler.hysteresis_counter,
 *     scaler.steps_applied, scaler.steps_skipped
 *     rng.seed, rng.offset                    the global generator (ampc_rng_get_state)
 *     the caller's keys
 * A parameter of the optimizer that is not in the module is named "#<index>".
 *
 * Loading validates the whole file before changing anything: the reader is a strict JSON parser
 * for this schema only (objects, strings, non-negative integers; duplicate keys, unknown fields,
 * invalid UTF-8 and trailing garbage are errors). The data is memory-mapped and copied only once
 * every check has passed, so a bad file leaves model, optimizer, scaler and RNG as they were.
 * A hostile file costs bounded time and memory: the header's size, tensor count, metadata key
 * count and nesting depth are limited, names are sorted once and binary-searched (n log n in
 * the header), and every value read is range-checked (step counts, scaler state), as is the
 * presence of the optimizer state that the step counts imply.
 */
#include "amp/amp.h"
#include "nn/nn.h"
#include "optim/optim.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* safetensors data is little-endian; tensors are written and read as their raw bytes */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoint.c assumes a little-endian host"
#endif

/* Test hook: makes a save fail at a stage (1 writing data, 2 fsync, 3 rename), to check that
   the temporary file is removed and the previous checkpoint survives. 0: off. */
int ampc__checkpoint_fail_stage = 0;

/* Test hook: name comparisons made by this thread while parsing headers and looking up
   tensors and metadata keys, so that a test can check that loading stays n log n in the header
   size by counting instead of timing. */
_Thread_local uint64_t ampc__checkpoint_key_compares = 0;

/* Limits on a header, so that a hostile file costs bounded time and memory (each a FORMAT error
   naming it): */
#define MAX_HEADER_BYTES 100000000ull   /* the reference reader's limit */
#define MAX_TENSORS 1000000             /* tensors in a header (a 100 MB header holds ~2 million) */
#define MAX_META_KEYS 1000000           /* metadata keys: one step count per parameter, and more */
#define MAX_DEPTH 3                     /* {"name": {"shape": [..]}}: no header nests deeper */

// ---------------------------------------------------------------------------------------------
// Dtypes: every safetensors dtype (to validate any file), and which ampc dtype each one is

typedef struct {
    const char *name;
    size_t size;
    int ampc;   /* ampc_dtype, or -1: not an ampc dtype */
} st_dtype;

static const st_dtype st_dtypes[] = {
    {"BOOL", 1, -1}, {"U8", 1, -1},  {"I8", 1, -1},  {"F8_E5M2", 1, -1}, {"F8_E4M3", 1, -1},
    {"I16", 2, -1},  {"U16", 2, -1}, {"F16", 2, AMPC_F16}, {"BF16", 2, AMPC_BF16}, {"I32", 4, -1},
    {"U32", 4, -1},  {"F32", 4, AMPC_F32}, {"F64", 8, AMPC_F64}, {"I64", 8, AMPC_I64}, {"U64", 8, -1},
};
#define N_ST_DTYPES ((int)(sizeof st_dtypes / sizeof st_dtypes[0]))

static int st_dtype_of(ampc_dtype dt) {
    for (int i = 0; i < N_ST_DTYPES; i++)
        if (st_dtypes[i].ampc == (int)dt) return i;
    return -1;
}

static const char *opt_kind_name(ampc_optim_kind k) {
    return k == AMPC_OPTIM_SGD ? "SGD" : k == AMPC_OPTIM_ADAM ? "Adam" : "AdamW";
}

static const char *const sgd_slots[] = {"momentum_buffer"};
static const char *const adam_slots[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};

static int opt_slots(const ampc_optimizer *opt, const char *const **names) {
    if (opt->kind == AMPC_OPTIM_SGD) {
        *names = sgd_slots;
        return 1;
    }
    *names = adam_slots;
    return 3;
}

// ---------------------------------------------------------------------------------------------
// Small helpers: growable text, UTF-8, shapes

typedef struct {
    char *s;
    size_t n, cap;
    bool oom;
} sbuf;

static void sb_add(sbuf *b, const char *p, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (cap < b->n + n + 1) cap *= 2;
        char *s = realloc(b->s, cap);
        if (!s) {
            b->oom = true;
            return;
        }
        b->s = s;
        b->cap = cap;
    }
    memcpy(b->s + b->n, p, n);
    b->n += n;
    b->s[b->n] = '\0';
}

static void sb_puts(sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k > 0) sb_add(b, tmp, (size_t)k < sizeof tmp ? (size_t)k : sizeof tmp - 1);
}

/* A JSON string literal (the input is valid UTF-8: checked by the caller). */
static void sb_json_string(sbuf *b, const char *s) {
    sb_add(b, "\"", 1);
    for (const char *p = s; *p; p++) {
        unsigned char c = (unsigned char)*p;
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            sb_add(b, e, 2);
        } else if (c < 0x20) {
            sb_printf(b, "\\u%04x", c);
        } else {
            sb_add(b, p, 1);
        }
    }
    sb_add(b, "\"", 1);
}

/* Length of the valid UTF-8 sequence at s (n bytes available), 0 if invalid. */
static size_t utf8_seq(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t len;
    unsigned min;
    if (c >= 0xc2 && c <= 0xdf) len = 2, min = 0x80;
    else if (c >= 0xe0 && c <= 0xef) len = 3, min = 0x800;
    else if (c >= 0xf0 && c <= 0xf4) len = 4, min = 0x10000;
    else return 0;
    if (n < len) return 0;
    unsigned cp = c & (0x3f >> (len - 1));
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
    return len;
}

static bool utf8_valid(const char *s) {
    size_t n = strlen(s);
    for (size_t i = 0; i < n;) {
        size_t k = utf8_seq((const unsigned char *)s + i, n - i);
        if (!k) return false;
        i += k;
    }
    return true;
}

static const char *fmt_shape(int ndim, const int64_t *shape, char *buf, size_t n) {
    size_t k = (size_t)snprintf(buf, n, "(");
    for (int d = 0; d < ndim && k < n; d++) k += (size_t)snprintf(buf + k, n - k, d ? ", %" PRId64 : "%" PRId64, shape[d]);
    if (k < n) snprintf(buf + k, n - k, ndim == 1 ? ",)" : ")");
    return buf;
}

static bool starts_with(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

// ---------------------------------------------------------------------------------------------
// The header: a strict parser for the safetensors schema

typedef struct {
    char *name;
    int dtype;   /* index into st_dtypes */
    int ndim;
    int64_t shape[AMPC_MAX_DIMS];
    uint64_t begin, end;
    bool used;   /* matched by the loader */
} st_entry;

typedef struct {
    char *key, *val;
} kv_pair;

typedef struct {
    kv_pair *a;
    int n, cap;
} kv_list;

typedef struct {
    st_entry *e;
    int n, cap;
    bool has_meta;
    kv_list meta;
    size_t meta_begin, meta_end;   /* the "__metadata__" object's text in the header */
} st_header;

typedef struct {
    const char *s;
    size_t n, i;
    char err[160];
    sbuf tmp;   /* the string being read (reused: one allocation per parse, not per string) */
} jparser;

static bool jfail(jparser *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool jfail(jparser *p, const char *fmt, ...) {
    if (p->err[0]) return false;   /* keep the first (innermost) error */
    char msg[128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(p->err, sizeof p->err, "%s at byte %zu of the header", msg, p->i);
    return false;
}

static void jws(jparser *p) {
    while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t' || p->s[p->i] == '\n' || p->s[p->i] == '\r')) p->i++;
}

static bool jexpect(jparser *p, char c) {
    jws(p);
    if (p->i < p->n && p->s[p->i] == c) {
        p->i++;
        return true;
    }
    if (p->i >= p->n) return jfail(p, "expected '%c' but the header ended", c);
    return jfail(p, "expected '%c'", c);
}

static bool jpeek(jparser *p, char c) {
    jws(p);
    return p->i < p->n && p->s[p->i] == c;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static bool jhex4(jparser *p, unsigned *out) {
    if (p->n - p->i < 4) return jfail(p, "truncated \\u escape");
    unsigned v = 0;
    for (int k = 0; k < 4; k++) {
        int h = hexval(p->s[p->i + (size_t)k]);
        if (h < 0) return jfail(p, "bad \\u escape");
        v = v * 16 + (unsigned)h;
    }
    p->i += 4;
    *out = v;
    return true;
}

/* A JSON string, unescaped into p->tmp (false + error). \u0000 is refused: names and values
   are C strings. */
static bool jstring_tmp(jparser *p) {
    if (!jexpect(p, '"')) return false;
    sbuf *b = &p->tmp;
    b->n = 0;
    sb_add(b, "", 0);
    while (!b->oom) {
        if (p->i >= p->n) {
            jfail(p, "unterminated string");
            break;
        }
        unsigned char c = (unsigned char)p->s[p->i];
        if (c == '"') {
            p->i++;
            return true;
        }
        if (c < 0x20) {
            jfail(p, "control character 0x%02x in a string", c);
            break;
        }
        if (c != '\\') {
            size_t k = utf8_seq((const unsigned char *)p->s + p->i, p->n - p->i);
            if (!k) {
                jfail(p, "invalid UTF-8 in a string");
                break;
            }
            sb_add(b, p->s + p->i, k);
            p->i += k;
            continue;
        }
        if (++p->i >= p->n) {
            jfail(p, "unterminated escape");
            break;
        }
        char e = p->s[p->i++];
        const char *simple = strchr("\"\\/bfnrt", e);
        if (simple && e) {
            static const char out[] = "\"\\/\b\f\n\r\t";
            sb_add(b, &out[simple - "\"\\/bfnrt"], 1);
            continue;
        }
        if (e != 'u') {
            jfail(p, "bad escape '\\%c'", e);
            break;
        }
        unsigned cp;
        if (!jhex4(p, &cp)) break;
        if (cp >= 0xd800 && cp <= 0xdbff) {   /* a surrogate pair */
            unsigned lo;
            if (p->n - p->i < 2 || p->s[p->i] != '\\' || p->s[p->i + 1] != 'u') {
                jfail(p, "unpaired surrogate in a \\u escape");
                break;
            }
            p->i += 2;
            if (!jhex4(p, &lo)) break;
            if (lo < 0xdc00 || lo > 0xdfff) {
                jfail(p, "unpaired surrogate in a \\u escape");
                break;
            }
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        } else if (cp >= 0xdc00 && cp <= 0xdfff) {
            jfail(p, "unpaired surrogate in a \\u escape");
            break;
        }
        if (cp == 0) {
            jfail(p, "\\u0000 in a string");
            break;
        }
        char u[4];
        size_t k;
        if (cp < 0x80) u[0] = (char)cp, k = 1;
        else if (cp < 0x800) u[0] = (char)(0xc0 | (cp >> 6)), u[1] = (char)(0x80 | (cp & 0x3f)), k = 2;
        else if (cp < 0x10000)
            u[0] = (char)(0xe0 | (cp >> 12)), u[1] = (char)(0x80 | ((cp >> 6) & 0x3f)), u[2] = (char)(0x80 | (cp & 0x3f)), k = 3;
        else
            u[0] = (char)(0xf0 | (cp >> 18)), u[1] = (char)(0x80 | ((cp >> 12) & 0x3f)),
            u[2] = (char)(0x80 | ((cp >> 6) & 0x3f)), u[3] = (char)(0x80 | (cp & 0x3f)), k = 4;
        sb_add(b, u, k);
    }
    if (b->oom) jfail(p, "out of memory");
    return false;
}

/* The same as a malloc'd C string of its own length (NULL + error). */
static char *jstring(jparser *p) {
    if (!jstring_tmp(p)) return NULL;
    char *s = malloc(p->tmp.n + 1);
    if (!s) {
        jfail(p, "out of memory");
        return NULL;
    }
    memcpy(s, p->tmp.s, p->tmp.n + 1);
    return s;
}

static void jparser_free(jparser *p) {
    free(p->tmp.s);
    p->tmp = (sbuf){0};
}

/* A '{' or '[' beyond depth MAX_DEPTH anywhere in text: refused in one pass, before any
   parsing (the schema parser never recurses; this names the problem for a deeply nested file). */
static bool jdepth_ok(jparser *p) {
    int depth = 0;
    bool in_str = false;
    for (size_t i = 0; i < p->n; i++) {
        char c = p->s[i];
        if (in_str) {
            if (c == '\\') i++;
            else if (c == '"') in_str = false;
        } else if (c == '"') {
            in_str = true;
        } else if (c == '{' || c == '[') {
            if (++depth > MAX_DEPTH) {
                p->i = i;
                return jfail(p, "JSON nested deeper than %d levels (the most a safetensors header has)", MAX_DEPTH);
            }
        } else if ((c == '}' || c == ']') && depth > 0) {
            depth--;
        }
    }
    return true;
}

/* A non-negative integer (no sign, fraction, exponent or leading zeros). */
static bool ju64(jparser *p, uint64_t max, uint64_t *out) {
    jws(p);
    size_t start = p->i;
    uint64_t v = 0;
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
        unsigned d = (unsigned)(p->s[p->i] - '0');
        if (v > (max - d) / 10) return jfail(p, "integer too large");
        v = v * 10 + d;
        p->i++;
    }
    if (p->i == start) return jfail(p, "expected a non-negative integer");
    if (p->i - start > 1 && p->s[start] == '0') return jfail(p, "integer with a leading zero");
    if (p->i < p->n && (p->s[p->i] == '.' || p->s[p->i] == 'e' || p->s[p->i] == 'E'))
        return jfail(p, "expected an integer, not a fraction");
    *out = v;
    return true;
}

static void kv_free(kv_list *l) {
    for (int i = 0; i < l->n; i++) {
        free(l->a[i].key);
        free(l->a[i].val);
    }
    free(l->a);
    *l = (kv_list){0};
}

static bool kv_push(kv_list *l, char *k, char *v) {
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 16;
        kv_pair *a = realloc(l->a, (size_t)cap * sizeof *a);
        if (!a) return false;
        l->a = a;
        l->cap = cap;
    }
    l->a[l->n++] = (kv_pair){k, v};
    return true;
}

static int cmp_kv(const void *a, const void *b) {
    ampc__checkpoint_key_compares++;
    return strcmp(((const kv_pair *)a)->key, ((const kv_pair *)b)->key);
}

/* Sorts n pairs by key (for kv_get); returns the first key that occurs twice, or NULL. */
static const char *kv_sort(kv_pair *a, int n) {
    if (n > 1) qsort(a, (size_t)n, sizeof *a, cmp_kv);
    for (int i = 1; i < n; i++)
        if (cmp_kv(&a[i - 1], &a[i]) == 0) return a[i].key;
    return NULL;
}

/* Value of key in a list sorted by kv_sort, or NULL. */
static const char *kv_get(const kv_list *l, const char *key) {
    kv_pair k = {(char *)key, NULL};
    const kv_pair *hit = l->n ? bsearch(&k, l->a, (size_t)l->n, sizeof *l->a, cmp_kv) : NULL;
    return hit ? hit->val : NULL;
}

/* {"key": "value", ...} with string values and no duplicate keys; out ends sorted by key. */
static bool jstring_object(jparser *p, kv_list *out) {
    if (!jexpect(p, '{')) return false;
    if (jpeek(p, '}')) {
        p->i++;
        return true;
    }
    for (;;) {
        if (out->n == MAX_META_KEYS) return jfail(p, "more than %d metadata keys (the limit)", MAX_META_KEYS);
        char *k = jstring(p);
        if (!k) return false;
        char *v = NULL;
        if (!jexpect(p, ':') || !(jpeek(p, '"') ? (v = jstring(p)) != NULL : jfail(p, "metadata values must be strings")) ||
            !kv_push(out, k, v)) {
            if (!p->err[0]) jfail(p, "out of memory");
            free(k);
            free(v);
            return false;
        }
        if (jpeek(p, ',')) {
            p->i++;
            continue;
        }
        if (!jexpect(p, '}')) return false;
        const char *dup = kv_sort(out->a, out->n);
        if (dup) snprintf(p->err, sizeof p->err, "duplicate metadata key \"%.60s\"", dup);
        return !dup;
    }
}

/* {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, each field exactly once. */
static bool jtensor_info(jparser *p, st_entry *e) {
    if (!jexpect(p, '{')) return false;
    bool seen[3] = {false, false, false};
    for (;;) {
        size_t at = p->i;
        char *k = jstring(p);
        if (!k) return false;
        int f = strcmp(k, "dtype") == 0 ? 0 : strcmp(k, "shape") == 0 ? 1 : strcmp(k, "data_offsets") == 0 ? 2 : -1;
        if (f < 0 || seen[f]) {
            p->i = at;
            jfail(p, f < 0 ? "unknown field \"%.40s\" in tensor \"%.60s\"" : "duplicate field \"%.40s\" in tensor \"%.60s\"", k,
                  e->name);
            free(k);
            return false;
        }
        free(k);
        seen[f] = true;
        if (!jexpect(p, ':')) return false;
        if (f == 0) {
            at = p->i;
            char *d = jstring(p);
            if (!d) return false;
            e->dtype = -1;
            for (int i = 0; i < N_ST_DTYPES; i++)
                if (strcmp(d, st_dtypes[i].name) == 0) e->dtype = i;
            if (e->dtype < 0) {
                p->i = at;
                jfail(p, "unknown dtype \"%.20s\" of tensor \"%.60s\"", d, e->name);
                free(d);
                return false;
            }
            free(d);
        } else if (f == 1) {
            if (!jexpect(p, '[')) return false;
            e->ndim = 0;
            if (jpeek(p, ']')) {
                p->i++;
            } else {
                for (;;) {
                    uint64_t v;
                    if (e->ndim == AMPC_MAX_DIMS) return jfail(p, "tensor \"%.60s\" has more than %d dimensions", e->name, AMPC_MAX_DIMS);
                    if (!ju64(p, (uint64_t)INT64_MAX, &v)) return false;
                    e->shape[e->ndim++] = (int64_t)v;
                    if (jpeek(p, ',')) {
                        p->i++;
                        continue;
                    }
                    if (!jexpect(p, ']')) return false;
                    break;
                }
            }
        } else {
            if (!jexpect(p, '[') || !ju64(p, UINT64_MAX, &e->begin) || !jexpect(p, ',') || !ju64(p, UINT64_MAX, &e->end) ||
                !jexpect(p, ']'))
                return false;
        }
        if (jpeek(p, ',')) {
            p->i++;
            continue;
        }
        if (!jexpect(p, '}')) return false;
        break;
    }
    if (!seen[0] || !seen[1] || !seen[2])
        return jfail(p, "tensor \"%.60s\" lacks \"%s\"", e->name, !seen[0] ? "dtype" : !seen[1] ? "shape" : "data_offsets");
    return true;
}

static void header_free(st_header *h) {
    for (int i = 0; i < h->n; i++) free(h->e[i].name);
    free(h->e);
    kv_free(&h->meta);
    *h = (st_header){0};
}

static int cmp_entry_name(const void *a, const void *b) {
    ampc__checkpoint_key_compares++;
    return strcmp(((const st_entry *)a)->name, ((const st_entry *)b)->name);
}

/* Parses the header JSON into h (entries sorted by name). Error text in p->err. */
static bool parse_header(jparser *p, st_header *h) {
    if (!jdepth_ok(p)) return false;
    jws(p);
    if (p->i >= p->n || p->s[p->i] != '{') return jfail(p, "the header is not a JSON object");
    p->i++;
    if (jpeek(p, '}')) {
        p->i++;
    } else {
        for (;;) {
            char *k = jstring(p);
            if (!k) return false;
            if (!jexpect(p, ':')) {
                free(k);
                return false;
            }
            if (strcmp(k, "__metadata__") == 0) {
                free(k);
                if (h->has_meta) return jfail(p, "duplicate \"__metadata__\"");
                h->has_meta = true;
                jws(p);
                h->meta_begin = p->i;
                if (!jstring_object(p, &h->meta)) return false;
                h->meta_end = p->i;
            } else {
                if (h->n == MAX_TENSORS) {
                    free(k);
                    return jfail(p, "more than %d tensors (the limit)", MAX_TENSORS);
                }
                if (h->n == h->cap) {
                    int cap = h->cap ? 2 * h->cap : 64;
                    st_entry *e = realloc(h->e, (size_t)cap * sizeof *e);
                    if (!e) {
                        free(k);
                        return jfail(p, "out of memory");
                    }
                    h->e = e;
                    h->cap = cap;
                }
                st_entry *e = &h->e[h->n++];
                *e = (st_entry){.name = k};
                if (!jtensor_info(p, e)) return false;
            }
            if (jpeek(p, ',')) {
                p->i++;
                continue;
            }
            if (!jexpect(p, '}')) return false;
            break;
        }
    }
    jws(p);
    if (p->i != p->n) return jfail(p, "unexpected data after the JSON object");
    if (h->n > 1) qsort(h->e, (size_t)h->n, sizeof *h->e, cmp_entry_name);
    for (int i = 1; i < h->n; i++)
        if (cmp_entry_name(&h->e[i - 1], &h->e[i]) == 0) {
            snprintf(p->err, sizeof p->err, "duplicate tensor \"%.60s\"", h->e[i].name);
            return false;
        }
    return true;
}

static st_entry *header_find(st_header *h, const char *name) {
    st_entry key = {.name = (char *)name};
    return h->n ? bsearch(&key, h->e, (size_t)h->n, sizeof *h->e, cmp_entry_name) : NULL;
}

static int cmp_by_offset(const void *a, const void *b, void *ctx) {
    const st_header *h = ctx;
    const st_entry *x = &h->e[*(const int *)a], *y = &h->e[*(const int *)b];
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* The reference reader's checks: each tensor's byte count matches dtype and shape, and the
   tensors tile the data buffer [0, data_bytes) without gap or overlap. */
static int validate_layout(const char *path, st_header *h, uint64_t data_bytes) {
    for (int i = 0; i < h->n; i++) {
        st_entry *e = &h->e[i];
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
                             path, e->name, e->begin, e->end, st_dtypes[e->dtype].name, fmt_shape(e->ndim, e->shape, sh, sizeof sh),
                             numel * sz);
    }
    int *order = malloc((h->n > 0 ? (size_t)h->n : 1) * sizeof *order);
    if (!order) return ampc__err(AMPC_ERR_OOM, "checkpoint '%s': out of memory", path);
    for (int i = 0; i < h->n; i++) order[i] = i;
    if (h->n > 1) qsort_r(order, (size_t)h->n, sizeof *order, cmp_by_offset, h);
    uint64_t at = 0;
    int rc = AMPC_OK;
    for (int k = 0; k < h->n && rc == AMPC_OK; k++) {
        const st_entry *e = &h->e[order[k]];
        if (e->begin < at) {
            const st_entry *prev = &h->e[order[k - 1]];
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
// Reading a file: header parsed and checked, data mapped

typedef struct {
    const char *path;
    int fd;
    st_header h;
    char *text;              /* the header JSON */
    uint64_t header_bytes;
    const unsigned char *data;   /* the data buffer */
    void *map;
    size_t map_len;
    unsigned char *copy;     /* data read into memory when mmap is unavailable */
} st_file;

static void st_close(st_file *f) {
    header_free(&f->h);
    free(f->text);
    if (f->map) munmap(f->map, f->map_len);
    free(f->copy);
    if (f->fd >= 0) close(f->fd);
    f->fd = -1;
}

static int pread_all(int fd, void *buf, size_t n, off_t off) {
    unsigned char *p = buf;
    while (n) {
        ssize_t k = pread(fd, p, n, off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
        off += k;
    }
    return 0;
}

static int st_open(st_file *f, const char *path) {
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
    if (n > MAX_HEADER_BYTES)
        return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s' is not a safetensors file: header size %" PRIu64 " is implausible", path, n);
    if (n > size - 8)
        return ampc__err(AMPC_ERR_FORMAT,
                         "checkpoint '%s': header size %" PRIu64 " exceeds the file size %" PRIu64 " (truncated or not a safetensors file)",
                         path, n, size);
    f->header_bytes = n;
    f->text = malloc(n ? n : 1);
    if (!f->text) return ampc__err(AMPC_ERR_OOM, "checkpoint '%s': out of memory for a %" PRIu64 "-byte header", path, n);
    if (pread_all(f->fd, f->text, n, 8) < 0) return ampc__err(AMPC_ERR_IO, "checkpoint '%s': read error", path);
    if (n == 0 || f->text[0] != '{')
        return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s' is not a safetensors file: the header does not start with '{'", path);
    jparser p = {.s = f->text, .n = n};
    bool ok = parse_header(&p, &f->h);
    jparser_free(&p);
    if (!ok) return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': malformed header: %s", path, p.err);
    uint64_t data_bytes = size - 8 - n;
    int rc = validate_layout(path, &f->h, data_bytes);
    if (rc < 0) return rc;
    if (data_bytes == 0) {
        f->data = (const unsigned char *)"";
        return AMPC_OK;
    }
    /* map the whole file: the data is copied only after every check has passed */
    void *m = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, f->fd, 0);
    if (m != MAP_FAILED) {
        f->map = m;
        f->map_len = (size_t)size;
        f->data = (const unsigned char *)m + 8 + n;
        return AMPC_OK;
    }
    f->copy = malloc((size_t)data_bytes);
    if (!f->copy) return ampc__err(AMPC_ERR_OOM, "checkpoint '%s': out of memory for %" PRIu64 " bytes of data", path, data_bytes);
    if (pread_all(f->fd, f->copy, (size_t)data_bytes, (off_t)(8 + n)) < 0)
        return ampc__err(AMPC_ERR_IO, "checkpoint '%s': read error", path);
    f->data = f->copy;
    return AMPC_OK;
}

static char *meta_json_copy(const st_file *f) {
    size_t n = f->h.has_meta ? f->h.meta_end - f->h.meta_begin : 2;
    char *s = malloc(n + 1);
    if (!s) return ampc__err_null(AMPC_ERR_OOM, "checkpoint: out of memory for the metadata");
    memcpy(s, f->h.has_meta ? f->text + f->h.meta_begin : "{}", n);
    s[n] = '\0';
    return s;
}

// ---------------------------------------------------------------------------------------------
// Parsing metadata values

static bool parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    if (!s || !*s || (*s != '-' && (*s < '0' || *s > '9'))) return false;
    errno = 0;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

#define MAX_COUNT ((int64_t)1 << 53)   /* step counts: exact in a double, and never reached */

/* The integer metadata value of key, from lo to hi, into *out; else an error naming the key,
   the value and the range. */
static int meta_int(const char *path, const kv_list *meta, const char *key, int64_t lo, int64_t hi, int64_t *out) {
    const char *v = kv_get(meta, key);
    if (!v) return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s' lacks the metadata '%s'", path, key);
    if (!parse_i64(v, lo, hi, out))
        return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': metadata '%s' is \"%.40s\", not an integer from %" PRId64 " to %" PRId64,
                         path, key, v, lo, hi);
    return AMPC_OK;
}

static bool parse_u64(const char *s, uint64_t *out) {
    if (!s || *s < '0' || *s > '9') return false;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end) return false;
    *out = v;
    return true;
}

static bool parse_f64(const char *s, double *out) {
    if (!s || !*s) return false;
    char *end;
    double v = strtod(s, &end);
    if (*end) return false;
    *out = v;
    return true;
}

// ---------------------------------------------------------------------------------------------
// Names of optimizer parameters

/* The state_dict name of opt's parameter i in m, or "#i" (buf) if m doesn't hold it. */
static const char *param_name(ampc_tensor **sd, const char **names, int n_sd, const ampc_tensor *p, int i, char *buf, size_t n) {
    for (int k = 0; k < n_sd; k++)
        if (sd[k] == p) return names[k];
    snprintf(buf, n, "#%d", i);
    return buf;
}

// ---------------------------------------------------------------------------------------------
// Save

typedef struct {
    char *name;
    const ampc_tensor *t;
    uint64_t begin, end;
} save_item;

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

static int add_item(save_item **items, int *n, int *cap, char *name, const ampc_tensor *t) {
    if (!name) return AMPC_ERR_OOM;
    if (*n == *cap) {
        int c = *cap ? 2 * *cap : 64;
        save_item *v = realloc(*items, (size_t)c * sizeof *v);
        if (!v) {
            free(name);
            return AMPC_ERR_OOM;
        }
        *items = v;
        *cap = c;
    }
    (*items)[(*n)++] = (save_item){.name = name, .t = t};
    return AMPC_OK;
}

static char *str_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *str_printf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (k < 0) return NULL;
    char *s = malloc((size_t)k + 1);
    if (!s) return NULL;
    va_start(ap, fmt);
    vsnprintf(s, (size_t)k + 1, fmt, ap);
    va_end(ap);
    return s;
}

static bool reserved_key(const char *k) {
    return strcmp(k, "format") == 0 || starts_with(k, "ampc.") || starts_with(k, "optimizer.") || starts_with(k, "scaler.") ||
           starts_with(k, "rng.");
}

/* Metadata entries: ours, then the caller's (checked: not reserved, unique, UTF-8). */
static int build_meta(kv_list *meta, ampc_optimizer *opt, ampc_scaler *s, ampc_tensor **sd, const char **names, int n_sd,
                      const char *const *meta_kv) {
#define PUT(k, ...)                                                                                                            \
    do {                                                                                                                       \
        char *k_ = (k), *v_ = str_printf(__VA_ARGS__);                                                                         \
        if (!k_ || !v_ || !kv_push(meta, k_, v_)) {                                                                            \
            free(k_);                                                                                                          \
            free(v_);                                                                                                          \
            return ampc__err(AMPC_ERR_OOM, "checkpoint save: out of memory for the metadata");                                 \
        }                                                                                                                      \
    } while (0)
    PUT(strdup("format"), "pt");
    PUT(strdup("ampc.version"), "1");
    if (opt) {
        PUT(strdup("optimizer.type"), "%s", opt_kind_name(opt->kind));
        PUT(strdup("optimizer.lr"), "%.17g", ampc_optimizer_get_lr(opt));
        PUT(strdup("optimizer.num_params"), "%d", opt->n);
        for (int i = 0; i < opt->n; i++) {
            char buf[32];
            const char *pn = param_name(sd, names, n_sd, opt->params[i], i, buf, sizeof buf);
            PUT(str_printf("optimizer.%s.step", pn), "%" PRId64, opt->steps[i]);
        }
    }
    if (s) {
        double v[AMPC_SCALER_STATE_COUNT];
        int rc = ampc__scaler_export(s, v, AMPC_SCALER_STATE_COUNT);
        if (rc < 0) return rc;
        PUT(strdup("scaler.enabled"), "%d", v[AMPC_SCALER_STATE_ENABLED] != 0);
        PUT(strdup("scaler.scale"), "%.9g", v[AMPC_SCALER_STATE_SCALE]);   /* 9 digits: any float exactly */
        PUT(strdup("scaler.growth_tracker"), "%.0f", v[AMPC_SCALER_STATE_GROWTH_TRACKER]);
        PUT(strdup("scaler.hysteresis_counter"), "%.0f", v[AMPC_SCALER_STATE_HYSTERESIS]);
        PUT(strdup("scaler.steps_applied"), "%.0f", v[AMPC_SCALER_STATE_APPLIED]);
        PUT(strdup("scaler.steps_skipped"), "%.0f", v[AMPC_SCALER_STATE_SKIPPED]);
    }
    uint64_t seed, offset;
    ampc_rng_get_state(&seed, &offset);
    PUT(strdup("rng.seed"), "%" PRIu64, seed);
    PUT(strdup("rng.offset"), "%" PRIu64, offset);
    for (int i = 0; meta_kv && meta_kv[i]; i += 2) {
        const char *k = meta_kv[i], *v = meta_kv[i + 1];
        if (!v) return ampc__err(AMPC_ERR_INVALID, "checkpoint save: metadata key '%s' has no value (pairs end with one NULL)", k);
        if (reserved_key(k)) return ampc__err(AMPC_ERR_INVALID, "checkpoint save: metadata key '%s' is reserved", k);
        if (!utf8_valid(k) || !utf8_valid(v))
            return ampc__err(AMPC_ERR_INVALID, "checkpoint save: metadata key '%s' or its value is not valid UTF-8", k);
        PUT(strdup(k), "%s", v);
    }
    /* the caller's keys are unique: sorted in a copy (the file keeps this order) */
    kv_pair *sorted = malloc((size_t)meta->n * sizeof *sorted);
    if (!sorted) return ampc__err(AMPC_ERR_OOM, "checkpoint save: out of memory for the metadata");
    memcpy(sorted, meta->a, (size_t)meta->n * sizeof *sorted);
    const char *dup = kv_sort(sorted, meta->n);
    int rc = dup ? ampc__err(AMPC_ERR_INVALID, "checkpoint save: metadata key '%s' given twice", dup) : AMPC_OK;
    free(sorted);
    return rc;
#undef PUT
}

static int elem_size(const save_item *it) { return (int)ampc__dt(it->t->dtype)->size; }

/* Sorts by decreasing element size, stable (state_dict order within a size). */
static void order_items(save_item *items, int n) {
    for (int i = 1; i < n; i++) {   /* insertion sort: stable, and n is a few hundred */
        save_item x = items[i];
        int j = i - 1;
        while (j >= 0 && elem_size(&items[j]) < elem_size(&x)) {
            items[j + 1] = items[j];
            j--;
        }
        items[j + 1] = x;
    }
}

static int write_file(const char *path, const char *tmp, const sbuf *hdr, const save_item *items, int n_items) {
    unlink(tmp);   /* a new file, never one placed there (O_EXCL: not a FIFO or a link to follow) */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return ampc__err(AMPC_ERR_IO, "checkpoint save '%s': can't create '%s': %s", path, tmp, strerror(errno));
    unsigned char n8[8];
    uint64_t n = hdr->n;
    for (int i = 0; i < 8; i++) n8[i] = (unsigned char)(n >> (8 * i));
    int rc = AMPC_OK;
    const char *what = "write";
    if (write_all(fd, n8, 8) < 0 || write_all(fd, hdr->s, hdr->n) < 0) rc = AMPC_ERR_IO;
    for (int i = 0; i < n_items && rc == AMPC_OK; i++) {
        if (ampc__checkpoint_fail_stage == 1 && i == n_items / 2) {
            errno = ENOSPC;
            rc = AMPC_ERR_IO;
            break;
        }
        /* CPU and REF tensors live in host memory; a device backend would copy to host here */
        const ampc_tensor *t = items[i].t;
        if (ampc__nbytes(t) && write_all(fd, ampc__data(t), ampc__nbytes(t)) < 0) rc = AMPC_ERR_IO;
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

int ampc_checkpoint_save(const char *path, ampc_module *m, ampc_optimizer *opt, ampc_scaler *s, const char *const *meta_kv) {
    ampc__ensure_init();
    if (!path || !m) return ampc__err(AMPC_ERR_INVALID, "checkpoint save: NULL %s", path ? "module" : "path");
    ampc_tensor **sd;
    const char **names;
    int n_sd = ampc_module_state_dict(m, &sd, &names);
    if (n_sd < 0) return n_sd;

    save_item *items = NULL;
    int n_items = 0, cap = 0, rc = AMPC_OK;
    kv_list meta = {0};
    sbuf hdr = {0};
    char *tmp = NULL;
    for (int i = 0; i < n_sd && rc == AMPC_OK; i++) {
        if (starts_with(names[i], "optimizer.") || strcmp(names[i], "__metadata__") == 0 || !utf8_valid(names[i]))
            rc = ampc__err(AMPC_ERR_INVALID, "checkpoint save: the model tensor name '%s' can't be stored", names[i]);
        else if (add_item(&items, &n_items, &cap, strdup(names[i]), sd[i]) < 0)
            rc = ampc__err(AMPC_ERR_OOM, "checkpoint save: out of memory");
    }
    if (opt) {
        const char *const *slots;
        int n_slots = opt_slots(opt, &slots);
        for (int i = 0; i < opt->n && rc == AMPC_OK; i++) {
            char buf[32];
            const char *pn = param_name(sd, names, n_sd, opt->params[i], i, buf, sizeof buf);
            for (int k = 0; k < n_slots && rc == AMPC_OK; k++)
                if (opt->state[k][i] && add_item(&items, &n_items, &cap, str_printf("optimizer.%s.%s", pn, slots[k]), opt->state[k][i]) < 0)
                    rc = ampc__err(AMPC_ERR_OOM, "checkpoint save: out of memory");
        }
    }
    if (rc == AMPC_OK) rc = build_meta(&meta, opt, s, sd, names, n_sd, meta_kv);
    if (rc == AMPC_OK) {
        order_items(items, n_items);
        uint64_t at = 0;
        sb_puts(&hdr, "{\"__metadata__\":{");
        for (int i = 0; i < meta.n; i++) {
            if (i) sb_puts(&hdr, ",");
            sb_json_string(&hdr, meta.a[i].key);
            sb_puts(&hdr, ":");
            sb_json_string(&hdr, meta.a[i].val);
        }
        sb_puts(&hdr, "}");
        for (int i = 0; i < n_items; i++) {
            const ampc_tensor *t = items[i].t;
            int dt = st_dtype_of(t->dtype);
            if (dt < 0) {
                rc = ampc__err(AMPC_ERR_DTYPE, "checkpoint save: tensor '%s' is %s", items[i].name, ampc_dtype_name(t->dtype));
                break;
            }
            items[i].begin = at;
            items[i].end = at += ampc__nbytes(t);
            sb_puts(&hdr, ",");
            sb_json_string(&hdr, items[i].name);
            sb_printf(&hdr, ":{\"dtype\":\"%s\",\"shape\":[", st_dtypes[dt].name);
            for (int d = 0; d < t->ndim; d++) sb_printf(&hdr, d ? ",%" PRId64 : "%" PRId64, t->shape[d]);
            sb_printf(&hdr, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", items[i].begin, items[i].end);
        }
        sb_puts(&hdr, "}");
        while (hdr.n % 8) sb_puts(&hdr, " ");   /* 8-byte aligned data, as the reference writer pads */
        if (hdr.oom) rc = ampc__err(AMPC_ERR_OOM, "checkpoint save: out of memory for the header");
    }
    if (rc == AMPC_OK) {
        tmp = str_printf("%s.tmp.%ld", path, (long)getpid());
        ampc__remove_stale_temps(path);   /* what killed writers left: full-size, never renamed */
        rc = tmp ? write_file(path, tmp, &hdr, items, n_items) : ampc__err(AMPC_ERR_OOM, "checkpoint save: out of memory");
    }
    for (int i = 0; i < n_items; i++) free(items[i].name);
    free(items);
    kv_free(&meta);
    free(hdr.s);
    free(tmp);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Load

typedef struct {
    int n_slots;
    const char *const *slots;
    st_entry **src;           /* [slot * n + i]: the file's tensor, or NULL: no state */
    ampc_tensor **fresh;      /* [slot * n + i]: newly allocated state (owned until commit) */
    int64_t *steps;
    double lr;
} opt_plan;

static void plan_free(opt_plan *pl, int n) {
    if (pl->fresh)
        for (int i = 0; i < pl->n_slots * n; i++) ampc__release(pl->fresh[i]);
    free(pl->src);
    free(pl->fresh);
    free(pl->steps);
}

static bool entry_matches(const st_entry *e, const ampc_tensor *t) {
    if (st_dtypes[e->dtype].ampc != (int)t->dtype || e->ndim != t->ndim) return false;
    for (int d = 0; d < t->ndim; d++)
        if (e->shape[d] != t->shape[d]) return false;
    return true;
}

static int mismatch(const char *path, const st_entry *e, const ampc_tensor *t, const char *what) {
    char a[160], b[160];
    return ampc__err(AMPC_ERR_SHAPE, "checkpoint '%s': %s '%s' is %s %s in the checkpoint but %s %s in the %s", path, what,
                     e->name, fmt_shape(e->ndim, e->shape, a, sizeof a), st_dtypes[e->dtype].name,
                     fmt_shape(t->ndim, t->shape, b, sizeof b), st_dtypes[st_dtype_of(t->dtype)].name,
                     strcmp(what, "tensor") == 0 ? "model" : "optimizer");
}

static int plan_optimizer(st_file *f, ampc_optimizer *opt, ampc_tensor **sd, const char **names, int n_sd, opt_plan *pl) {
    const char *path = f->path;
    const kv_list *meta = &f->h.meta;
    const char *type = kv_get(meta, "optimizer.type");
    if (!type) return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s' holds no optimizer state (saved without an optimizer)", path);
    if (strcmp(type, opt_kind_name(opt->kind)) != 0)
        return ampc__err(AMPC_ERR_INVALID, "checkpoint '%s' holds %s state but the optimizer is %s", path, type,
                         opt_kind_name(opt->kind));
    int64_t np;
    int rc = meta_int(path, meta, "optimizer.num_params", 0, MAX_TENSORS, &np);
    if (rc < 0) return rc;
    if (np != opt->n)
        return ampc__err(AMPC_ERR_SHAPE, "checkpoint '%s' holds state for %" PRId64 " parameters but the optimizer has %d", path, np,
                         opt->n);
    if (!parse_f64(kv_get(meta, "optimizer.lr"), &pl->lr) || !(pl->lr >= 0) || !isfinite(pl->lr))
        return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': bad or missing optimizer.lr", path);
    pl->n_slots = opt_slots(opt, &pl->slots);
    size_t cells = (size_t)pl->n_slots * (size_t)(opt->n ? opt->n : 1);
    pl->src = calloc(cells, sizeof *pl->src);
    pl->fresh = calloc(cells, sizeof *pl->fresh);
    pl->steps = calloc((size_t)(opt->n ? opt->n : 1), sizeof *pl->steps);
    if (!pl->src || !pl->fresh || !pl->steps) return ampc__err(AMPC_ERR_OOM, "checkpoint '%s': out of memory", path);
    char key[512];
    for (int i = 0; i < opt->n; i++) {
        char buf[32];
        ampc_tensor *p = opt->params[i];
        const char *pn = param_name(sd, names, n_sd, p, i, buf, sizeof buf);
        snprintf(key, sizeof key, "optimizer.%s.step", pn);
        if ((rc = meta_int(path, meta, key, 0, MAX_COUNT, &pl->steps[i])) < 0) return rc;
        for (int k = 0; k < pl->n_slots; k++) {
            snprintf(key, sizeof key, "optimizer.%s.%s", pn, pl->slots[k]);
            st_entry *e = header_find(&f->h, key);
            /* state exists from a parameter's first step on: with steps, every slot this
               optimizer uses must be there (else it would restart silently); before, none */
            if (!e && pl->steps[i] > 0 && k < ampc__optimizer_slots_used(opt))
                return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s' has the %s step count of '%s' (%" PRId64 ") but not its '%s' (tensor '%s')",
                                 path, opt_kind_name(opt->kind), pn, pl->steps[i], pl->slots[k], key);
            if (!e) continue;
            if (pl->steps[i] == 0)
                return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s' has the tensor '%s' but the step count of '%s' is 0", path, key, pn);
            if (!entry_matches(e, p)) return mismatch(path, e, p, "optimizer state");
            e->used = true;
            pl->src[k * opt->n + i] = e;
        }
    }
    for (int i = 0; i < f->h.n; i++)
        if (!f->h.e[i].used && starts_with(f->h.e[i].name, "optimizer."))
            return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': unexpected optimizer tensor '%s' (no such %s parameter or slot)", path,
                             f->h.e[i].name, opt_kind_name(opt->kind));
    /* state the optimizer doesn't have yet, allocated now so that the commit can't fail */
    for (int k = 0; k < pl->n_slots; k++)
        for (int i = 0; i < opt->n; i++) {
            if (!pl->src[k * opt->n + i] || opt->state[k][i]) continue;
            ampc_mem_kind prev = ampc__mem_kind_push(AMPC_MEM_OPTIMIZER);
            ampc_tensor *t = ampc__tensor_like(opt->params[i], opt->params[i]->dtype);
            ampc__mem_kind_pop(prev);
            if (!t) return ampc_last_status();
            pl->fresh[k * opt->n + i] = t;
        }
    return AMPC_OK;
}

static int plan_scaler(st_file *f, ampc_scaler *s, double *v) {
    const char *path = f->path;
    const kv_list *meta = &f->h.meta;
    const char *en = kv_get(meta, "scaler.enabled");
    if (!en || strcmp(en, "1") != 0)
        return ampc__err(AMPC_ERR_FORMAT,
                         "checkpoint '%s' holds no grad scaler state (saved %s); the scaler is enabled", path,
                         en ? "from a disabled scaler" : "without a scaler");
    static const char *const keys[AMPC_SCALER_STATE_COUNT] = {
        [AMPC_SCALER_STATE_SCALE] = "scaler.scale",
        [AMPC_SCALER_STATE_GROWTH_TRACKER] = "scaler.growth_tracker",
        [AMPC_SCALER_STATE_HYSTERESIS] = "scaler.hysteresis_counter",
        [AMPC_SCALER_STATE_APPLIED] = "scaler.steps_applied",
        [AMPC_SCALER_STATE_SKIPPED] = "scaler.steps_skipped",
    };
    v[AMPC_SCALER_STATE_ENABLED] = 1;
    for (int k = 0; k < AMPC_SCALER_STATE_COUNT; k++) {
        if (!keys[k]) continue;
        const char *txt = kv_get(meta, keys[k]);
        if (k == AMPC_SCALER_STATE_SCALE) {
            char *end;
            float x = txt && *txt ? strtof(txt, &end) : 0.0f;   /* strtof: correctly rounded to float */
            if (!txt || !*txt || *end) return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': bad or missing metadata '%s'", path, keys[k]);
            v[k] = (double)x;
        } else {
            int64_t x;   /* the scaler checks the finer ranges */
            int rc = meta_int(path, meta, keys[k], 0, MAX_COUNT, &x);
            if (rc < 0) return rc;
            v[k] = (double)x;
        }
    }
    int rc = ampc__scaler_import(s, v, AMPC_SCALER_STATE_COUNT, true);
    if (rc < 0) {
        char msg[256];
        snprintf(msg, sizeof msg, "%s", ampc_last_error());
        return ampc__err(rc, "checkpoint '%s': %s", path, msg);
    }
    return AMPC_OK;
}

int ampc_checkpoint_load(const char *path, ampc_module *m, ampc_optimizer *opt, ampc_scaler *s, char **meta_json_out) {
    ampc__ensure_init();
    if (meta_json_out) *meta_json_out = NULL;
    if (!path || !m) return ampc__err(AMPC_ERR_INVALID, "checkpoint load: NULL %s", path ? "module" : "path");
    ampc_tensor **sd;
    const char **names;
    int n_sd = ampc_module_state_dict(m, &sd, &names);
    if (n_sd < 0) return n_sd;

    st_file f;
    opt_plan pl = {0};
    int rc = st_open(&f, path);
    /* the model: every tensor present with its dtype and shape, nothing unexpected */
    for (int i = 0; i < n_sd && rc == AMPC_OK; i++) {
        st_entry *e = header_find(&f.h, names[i]);
        if (!e) {
            char b[160];
            rc = ampc__err(AMPC_ERR_SHAPE, "checkpoint '%s' lacks the model tensor '%s' (%s %s): a different model?", path, names[i],
                           fmt_shape(sd[i]->ndim, sd[i]->shape, b, sizeof b), ampc_dtype_name(sd[i]->dtype));
        } else if (!entry_matches(e, sd[i])) {
            rc = mismatch(path, e, sd[i], "tensor");
        }
        if (e) e->used = true;
    }
    for (int i = 0; i < f.h.n && rc == AMPC_OK; i++)
        if (!f.h.e[i].used && !starts_with(f.h.e[i].name, "optimizer."))
            rc = ampc__err(AMPC_ERR_SHAPE, "checkpoint '%s' has the tensor '%s' that the model lacks: a different model?", path,
                           f.h.e[i].name);
    if (rc == AMPC_OK && opt) rc = plan_optimizer(&f, opt, sd, names, n_sd, &pl);
    double sv[AMPC_SCALER_STATE_COUNT];
    bool load_scaler = s && ampc_scaler_is_enabled(s);
    if (rc == AMPC_OK && load_scaler) rc = plan_scaler(&f, s, sv);
    uint64_t seed = 0, offset = 0;
    if (rc == AMPC_OK && opt &&
        (!parse_u64(kv_get(&f.h.meta, "rng.seed"), &seed) || !parse_u64(kv_get(&f.h.meta, "rng.offset"), &offset)))
        rc = ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': bad or missing metadata 'rng.seed'/'rng.offset'", path);
    char *meta = NULL;
    if (rc == AMPC_OK && meta_json_out && !(meta = meta_json_copy(&f))) rc = ampc_last_status();

    if (rc == AMPC_OK) {
        /* commit: nothing below can fail */
        for (int i = 0; i < n_sd; i++) {
            const st_entry *e = header_find(&f.h, names[i]);
            ampc__mark_written(sd[i]);
            if (e->end > e->begin) memcpy(ampc__data(sd[i]), f.data + e->begin, (size_t)(e->end - e->begin));
        }
        if (opt) {
            for (int k = 0; k < pl.n_slots; k++)
                for (int i = 0; i < opt->n; i++) {
                    const st_entry *e = pl.src[k * opt->n + i];
                    if (!e) {
                        ampc__release(opt->state[k][i]);
                        opt->state[k][i] = NULL;
                        continue;
                    }
                    if (!opt->state[k][i]) {
                        opt->state[k][i] = pl.fresh[k * opt->n + i];
                        pl.fresh[k * opt->n + i] = NULL;
                    }
                    if (e->end > e->begin) memcpy(ampc__data(opt->state[k][i]), f.data + e->begin, (size_t)(e->end - e->begin));
                }
            for (int i = 0; i < opt->n; i++) opt->steps[i] = pl.steps[i];
            ampc_optimizer_set_lr(opt, pl.lr);
            ampc_rng_set_state(seed, offset);
        }
        if (load_scaler) ampc__scaler_import(s, sv, AMPC_SCALER_STATE_COUNT, false);
        if (meta_json_out) *meta_json_out = meta;
        meta = NULL;
    }
    free(meta);
    if (opt) plan_free(&pl, opt->n);
    st_close(&f);
    return rc;
}

int ampc_checkpoint_remove_stale_temps(const char *path) {
    if (!path) return ampc__err(AMPC_ERR_INVALID, "checkpoint: NULL path");
    return ampc__remove_stale_temps(path);
}

int ampc_checkpoint_read_meta(const char *path, char **meta_json_out) {
    ampc__ensure_init();
    if (!path || !meta_json_out) return ampc__err(AMPC_ERR_INVALID, "checkpoint read_meta: NULL argument");
    *meta_json_out = NULL;
    st_file f;
    int rc = st_open(&f, path);
    if (rc == AMPC_OK && !(*meta_json_out = meta_json_copy(&f))) rc = ampc_last_status();
    st_close(&f);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Comparing two files' tensors

/* A byte count with thousands separators: "1,234,567". */
static const char *fmt_thousands(uint64_t v, char *buf, size_t n) {
    char digits[32];
    snprintf(digits, sizeof digits, "%" PRIu64, v);
    size_t len = strlen(digits), at = 0;
    for (size_t i = 0; i < len && at + 2 < n; i++) {
        if (i && (len - i) % 3 == 0) buf[at++] = ',';
        buf[at++] = digits[i];
    }
    buf[at] = '\0';
    return buf;
}

static void entry_desc(const st_entry *e, char *buf, size_t n) {
    char sh[160];
    snprintf(buf, n, "%s %s", st_dtypes[e->dtype].name, fmt_shape(e->ndim, e->shape, sh, sizeof sh));
}

int ampc_checkpoint_compare(const char *path_a, const char *path_b, FILE *report) {
    ampc__ensure_init();
    if (!path_a || !path_b) return ampc__err(AMPC_ERR_INVALID, "checkpoint compare: NULL path");
    st_file a, b;
    int rc = st_open(&a, path_a);
    if (rc == AMPC_OK) rc = st_open(&b, path_b);
    else b = (st_file){.fd = -1};
    if (rc < 0) {
        st_close(&a);
        st_close(&b);
        return rc;
    }
    int diffs = 0;
    uint64_t bytes = 0;
    /* both entry lists are sorted by name: one merge */
    for (int i = 0, k = 0; i < a.h.n || k < b.h.n;) {
        int c = i >= a.h.n ? 1 : k >= b.h.n ? -1 : cmp_entry_name(&a.h.e[i], &b.h.e[k]);
        if (c) {
            const st_entry *e = c < 0 ? &a.h.e[i++] : &b.h.e[k++];
            if (diffs++ < 20 && report) fprintf(report, "differ: tensor '%s' is only in %s\n", e->name, c < 0 ? path_a : path_b);
            continue;
        }
        const st_entry *x = &a.h.e[i++], *y = &b.h.e[k++];
        char dx[200], dy[200];
        entry_desc(x, dx, sizeof dx);
        entry_desc(y, dy, sizeof dy);
        uint64_t n = x->end - x->begin;
        if (strcmp(dx, dy) != 0) {   /* the same dtype and shape: the same byte count */
            if (diffs++ < 20 && report) fprintf(report, "differ: tensor '%s': %s vs %s\n", x->name, dx, dy);
            continue;
        }
        const unsigned char *p = a.data + x->begin, *q = b.data + y->begin;
        if (n && memcmp(p, q, (size_t)n) != 0) {
            uint64_t nd = 0;
            for (uint64_t t = 0; t < n; t++) nd += p[t] != q[t];
            if (diffs++ < 20 && report) fprintf(report, "differ: tensor '%s': %" PRIu64 " of %" PRIu64 " bytes differ\n", x->name, nd, n);
        }
        bytes += n;
    }
    if (report) {
        char c1[40];
        if (diffs) fprintf(report, "checkpoints differ: %d tensor(s)\n", diffs);
        else fprintf(report, "identical: %d tensors, %s bytes of tensor data\n", a.h.n, fmt_thousands(bytes, c1, sizeof c1));
    }
    st_close(&a);
    st_close(&b);
    return diffs ? 1 : 0;
}

int ampc_checkpoint_meta_get(const char *meta_json, const char *key, char *buf, size_t n) {
    if (!meta_json || !key) return ampc__err(AMPC_ERR_INVALID, "checkpoint meta_get: NULL %s", key ? "metadata" : "key");
    /* one pass that stops at the key: no list is built, so a lookup is linear in the text */
    jparser p = {.s = meta_json, .n = strlen(meta_json)};
    int rc = AMPC_ERR_INVALID;
    if (jexpect(&p, '{') && !jpeek(&p, '}')) {
        for (int found = 0; !found;) {
            if (!jstring_tmp(&p)) break;
            ampc__checkpoint_key_compares++;
            found = strcmp(p.tmp.s, key) == 0;
            if (!jexpect(&p, ':') || !(jpeek(&p, '"') ? jstring_tmp(&p) : jfail(&p, "metadata values must be strings"))) break;
            if (found) {
                size_t len = p.tmp.n;
                if (buf && n) {
                    size_t k = len < n - 1 ? len : n - 1;
                    memcpy(buf, p.tmp.s, k);
                    buf[k] = '\0';
                }
                rc = len > (size_t)INT32_MAX ? INT32_MAX : (int)len;
            } else if (jpeek(&p, ',')) {
                p.i++;
            } else {
                break;
            }
        }
    }
    if (rc == AMPC_ERR_INVALID && !p.err[0]) {   /* the end: '}' and nothing after it */
        if (jexpect(&p, '}') && (jws(&p), p.i != p.n)) jfail(&p, "unexpected data after the JSON object");
    }
    if (p.err[0]) rc = ampc__err(AMPC_ERR_FORMAT, "checkpoint metadata: %s", p.err);
    else if (rc == AMPC_ERR_INVALID) ampc__err(rc, "checkpoint metadata has no key '%s'", key);
    jparser_free(&p);
    return rc;
}
