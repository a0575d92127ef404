/*
 * dataset.c - the dataset front door (size, shape, get, free over the vtable in data.h), subsets
 * and reproducible train/validation splits, and the Philox streams the data layer shares.
 *
 * Reproducibility: splits, shuffles and random transforms draw from ampc__philox under keys
 * derived from the user's seed, never from the global generator, so the same seed gives the
 * same numbers on every machine, for every thread count, whatever else the program drew.
 */
#include "data/data.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Philox streams

uint64_t ampc__data_key(uint64_t seed, uint32_t domain, int64_t a) {
    uint32_t out[4];
    /* The domain in the counter's top byte keeps split, shuffle and transform streams apart. */
    ampc__philox(seed, ((uint64_t)domain << 56) ^ (uint64_t)a, out);
    return (uint64_t)out[0] | (uint64_t)out[1] << 32;
}

void ampc__data_permutation(uint64_t key, int64_t n, int64_t *perm) {
    for (int64_t i = 0; i < n; i++) perm[i] = i;
    uint32_t out[4];
    for (int64_t i = n - 1; i > 0; i--) {
        /* Step i uses one 64-bit draw (half a Philox block); j = floor(r * (i+1) / 2^64) has a
           bias below n / 2^64, far under anything measurable, and needs no rejection loop. */
        if ((i & 1) || i == n - 1) ampc__philox(key, (uint64_t)i >> 1, out);
        uint64_t r = (uint64_t)out[(i & 1) * 2] | (uint64_t)out[(i & 1) * 2 + 1] << 32;
        int64_t j = (int64_t)(((unsigned __int128)r * (uint64_t)(i + 1)) >> 64);
        int64_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
}

// ---------------------------------------------------------------------------------------------
// Front door

static ampc_handle_pool dataset_pool = {.obj_size = sizeof(ampc_dataset)};

ampc_dataset *ampc__dataset_alloc(const ampc_dataset_vtable *vt) {
    ampc_dataset *ds = ampc__handle_pool_get(&dataset_pool);
    if (!ds) return NULL;
    ds->vt = vt;
    atomic_init(&ds->refs, 0);
    ds->gen = ampc__new_gen();
    return ds;
}

bool ampc__dataset_stale(const ampc_dataset *ds, const char *call) {
    return ds && ampc__check_handle(ds, ds->gen, call, "dataset", "freed") < 0;
}

/* A stale dataset reads as NULL does (0, NULL), with the error recorded. */
int64_t ampc_dataset_size(const ampc_dataset *ds) { return ds && !ampc__dataset_stale(ds, "ampc_dataset_size") ? ds->size : 0; }
int64_t ampc_dataset_num_classes(const ampc_dataset *ds) {
    return ds && !ampc__dataset_stale(ds, "ampc_dataset_num_classes") ? ds->num_classes : 0;
}

uint64_t ampc__fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

uint64_t ampc_dataset_fingerprint(const ampc_dataset *ds) {
    if (!ds || ampc__dataset_stale(ds, "ampc_dataset_fingerprint")) return 0;
    const int64_t v[6] = {ds->size, ds->num_classes, ds->channels, ds->height, ds->width, (int64_t)ds->fingerprint};
    uint64_t h = ampc__fnv(AMPC__FNV_START, v, sizeof v);
    for (int64_t k = 0; ds->class_names && k < ds->num_classes; k++)
        if (ds->class_names[k]) h = ampc__fnv(h, ds->class_names[k], strlen(ds->class_names[k]) + 1);
    return h;
}

void ampc_dataset_sample_shape(const ampc_dataset *ds, int64_t *c, int64_t *h, int64_t *w) {
    if (ampc__dataset_stale(ds, "ampc_dataset_sample_shape")) ds = NULL;
    if (c) *c = ds ? ds->channels : 0;
    if (h) *h = ds ? ds->height : 0;
    if (w) *w = ds ? ds->width : 0;
}

const char *ampc_dataset_class_name(const ampc_dataset *ds, int64_t i) {
    if (!ds || ampc__dataset_stale(ds, "ampc_dataset_class_name") || !ds->class_names || i < 0 || i >= ds->num_classes) return NULL;
    return ds->class_names[i];
}

int ampc_dataset_get(ampc_dataset *ds, int64_t i, float *img, int64_t *label) {
    if (!ds || !img || !label) return ampc__err(AMPC_ERR_INVALID, "dataset_get: NULL argument");
    if (ampc__dataset_stale(ds, "ampc_dataset_get")) return AMPC_ERR_STATE;
    if (i < 0 || i >= ds->size)
        return ampc__err(AMPC_ERR_INVALID, "dataset_get: index %lld out of range [0, %lld)",
                         (long long)i, (long long)ds->size);
    return ds->vt->get(ds, i, img, label);
}

void ampc__dataset_release(ampc_dataset *ds) {
    if (!ds) return;
    /* Another holder (a subset, a loader) still uses it: the last one frees it. */
    if (atomic_fetch_sub(&ds->refs, 1) > 0) return;
    if (ds->impl && ds->vt && ds->vt->free) ds->vt->free(ds);
    if (ds->class_names) {
        for (int64_t i = 0; i < ds->num_classes; i++) free(ds->class_names[i]);
        free(ds->class_names);
    }
    ds->gen = 0;
    ampc__handle_pool_put(&dataset_pool, ds);
}

void ampc_dataset_free(ampc_dataset *ds) {
    if (!ds || ampc__dataset_stale(ds, "ampc_dataset_free")) return;
    ds->gen = 0;   /* the user's handle: stale from here on, whoever else holds the object */
    ampc__dataset_release(ds);
}

// ---------------------------------------------------------------------------------------------
// Subsets: a list of parent indices and a reference on the parent

typedef struct {
    ampc_dataset *parent;
    int64_t *idx;   /* (size) */
} subset_impl;

static int subset_get(ampc_dataset *ds, int64_t i, float *img, int64_t *label) {
    subset_impl *s = ds->impl;
    return s->parent->vt->get(s->parent, s->idx[i], img, label);
}

static int subset_get_window(ampc_dataset *ds, int64_t i, int64_t shift, int64_t *x, int64_t *y) {
    subset_impl *s = ds->impl;
    return s->parent->vt->get_window(s->parent, s->idx[i], shift, x, y);
}

static void subset_free(ampc_dataset *ds) {
    subset_impl *s = ds->impl;
    if (!s) return;
    ampc__dataset_release(s->parent);   /* drops our reference */
    free(s->idx);
    free(s);
}

static const ampc_dataset_vtable subset_vt = {"subset", subset_get, subset_free, subset_get_window};

static char **copy_names(char *const *names, int64_t n) {
    char **out = calloc((size_t)n, sizeof *out);
    if (!out) return NULL;
    for (int64_t i = 0; i < n; i++) {
        if (!names[i]) continue;
        if (!(out[i] = strdup(names[i]))) {
            for (int64_t k = 0; k < i; k++) free(out[k]);
            free(out);
            return NULL;
        }
    }
    return out;
}

ampc_dataset *ampc_dataset_subset(ampc_dataset *ds, const int64_t *indices, int64_t n) {
    if (!ds || (n > 0 && !indices) || n < 0)
        return ampc__err_null(AMPC_ERR_INVALID, "dataset_subset: NULL dataset/indices or n < 0");
    if (ampc__dataset_stale(ds, "ampc_dataset_subset")) return NULL;
    for (int64_t k = 0; k < n; k++)
        if (indices[k] < 0 || indices[k] >= ds->size)
            return ampc__err_null(AMPC_ERR_INVALID, "dataset_subset: indices[%lld] = %lld out of range [0, %lld)",
                                  (long long)k, (long long)indices[k], (long long)ds->size);
    ampc_dataset *sub = ampc__dataset_alloc(&subset_vt);
    subset_impl *s = calloc(1, sizeof *s);
    int64_t *idx = malloc((size_t)(n > 0 ? n : 1) * sizeof *idx);
    char **names = ds->class_names ? copy_names(ds->class_names, ds->num_classes) : NULL;
    if (!sub || !s || !idx || (ds->class_names && !names)) {
        if (names)
            for (int64_t i = 0; i < ds->num_classes; i++) free(names[i]);
        free(names);
        free(idx);
        free(s);
        ampc__dataset_release(sub);
        return ampc__err_null(AMPC_ERR_OOM, "dataset_subset: out of memory for %lld indices", (long long)n);
    }
    if (n > 0) memcpy(idx, indices, (size_t)n * sizeof *idx);
    atomic_fetch_add(&ds->refs, 1);
    s->parent = ds;
    s->idx = idx;
    sub->impl = s;
    sub->size = n;
    sub->num_classes = ds->num_classes;
    sub->channels = ds->channels;
    sub->height = ds->height;
    sub->width = ds->width;
    sub->block_size = ds->block_size;
    sub->class_names = names;
    const uint64_t parent = ampc_dataset_fingerprint(ds);
    sub->fingerprint = ampc__fnv(ampc__fnv(AMPC__FNV_START, &parent, sizeof parent), idx, (size_t)n * sizeof *idx);
    return sub;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int ampc_dataset_split(ampc_dataset *ds, double val_fraction, uint64_t seed, ampc_dataset **train,
                       ampc_dataset **val) {
    if (train) *train = NULL;
    if (val) *val = NULL;
    if (!ds || !train || !val) return ampc__err(AMPC_ERR_INVALID, "dataset_split: NULL argument");
    if (ampc__dataset_stale(ds, "ampc_dataset_split")) return AMPC_ERR_STATE;
    if (!(val_fraction >= 0.0 && val_fraction <= 1.0))
        return ampc__err(AMPC_ERR_INVALID, "dataset_split: val_fraction %g not in [0, 1]", val_fraction);
    int64_t n = ds->size;
    int64_t n_val = (int64_t)llround(val_fraction * (double)n);
    int64_t *perm = malloc((size_t)(n > 0 ? n : 1) * sizeof *perm);
    if (!perm) return ampc__err(AMPC_ERR_OOM, "dataset_split: out of memory for %lld indices", (long long)n);
    ampc__data_permutation(ampc__data_key(seed, AMPC__DOMAIN_SPLIT, n), n, perm);
    /* Each part in the parent's order: reading stays sequential, and the split is a set. */
    qsort(perm, (size_t)n_val, sizeof *perm, cmp_i64);
    qsort(perm + n_val, (size_t)(n - n_val), sizeof *perm, cmp_i64);
    ampc_dataset *v = ampc_dataset_subset(ds, perm, n_val);
    ampc_dataset *t = v ? ampc_dataset_subset(ds, perm + n_val, n - n_val) : NULL;
    free(perm);
    if (!t) {
        ampc_dataset_free(v);
        return ampc_last_status();
    }
    *train = t;
    *val = v;
    return AMPC_OK;
}
