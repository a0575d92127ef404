/*
 * data.h - the dataset object behind ampc_dataset: a small vtable so IDX files, image folders
 * and subsets (train/validation splits) look the same to transforms and the data loader.
 *
 * A dataset yields samples one at a time as f32 CHW images (values in [0, 1] before
 * normalisation) and an int64 class label. get() must be safe to call from several loader
 * threads at once (no shared mutable state, or its own lock).
 *
 * Lifetime (see ampc__dataset_release in dataset.c): allocate the struct with
 * ampc__dataset_alloc; class_names and their strings with malloc. vt->free releases impl and
 * whatever impl holds, and nothing else: the last release then frees class_names[i],
 * class_names and the struct itself. Subsets and loaders hold a reference on their dataset
 * (refs), so a parent may be freed by its user before its subsets: it goes when the last holder
 * lets go, and its user's handle is stale from the user's free on.
 */
#ifndef AMPC_DATA_INTERNAL_H
#define AMPC_DATA_INTERNAL_H

#include "core/core.h"

typedef struct {
    const char *type;   /* "idx", "folder", "subset" */
    /* Sample i: image into img (channels*height*width f32, CHW) and its label. Raw (untransformed)
       pixels scaled to [0, 1]; for folders, decoded and resized to the dataset's size. */
    int (*get)(ampc_dataset *ds, int64_t i, float *img, int64_t *label);
    void (*free)(ampc_dataset *ds);   /* impl only (see above); may be NULL */
    /* Token datasets (block_size > 0): window i's T inputs into x and T targets into y, cut at
       shift in [0, T) (tokens.c); NULL for images. */
    int (*get_window)(ampc_dataset *ds, int64_t i, int64_t shift, int64_t *x, int64_t *y);
} ampc_dataset_vtable;

struct ampc_dataset {
    const ampc_dataset_vtable *vt;
    int64_t size;
    int64_t num_classes;
    int64_t channels, height, width;   /* of every sample after decoding/resizing (tokens: 1, 1, T) */
    int64_t block_size;                /* token windows: T tokens per sample (get_window); 0: images */
    char **class_names;                /* num_classes strings (owned) or NULL */
    uint64_t fingerprint;              /* what names the samples, set by the constructor (see
                                          ampc_dataset_fingerprint): IDX headers and labels, the
                                          folder's file list and targets, a subset's parent and indices */
    void *impl;
    atomic_int refs;                   /* holders besides the creator (subsets); 0 when fresh */
    uint64_t gen;                      /* generation while the creator's handle is live, 0 once
                                          its user freed it (holders may still use the object) */
};

/* FNV-1a over n bytes, continuing from h (AMPC__FNV_START for a fresh hash): fingerprints. */
#define AMPC__FNV_START 1469598103934665603ull
uint64_t ampc__fnv(uint64_t h, const void *p, size_t n);

/* Zeroed dataset with vtable vt, from a handle pool (NULL + AMPC_ERR_OOM on failure). */
ampc_dataset *ampc__dataset_alloc(const ampc_dataset_vtable *vt);
/* True (the error recorded) when ds is a stale handle: freed by its user. NULL is each call's
   own case. */
bool ampc__dataset_stale(const ampc_dataset *ds, const char *call);
/* Drops one reference (a holder's, or the creator's); the last frees ds (impl NULL: vt->free
   is not called, so a half-built dataset can be dropped too). */
void ampc__dataset_release(ampc_dataset *ds);

// ---------------------------------------------------------------------------------------------
// Transforms, as the loader runs them (transforms.c)

/* Floats each of the two scratch buffers of ampc__transforms_run needs for a c x h x w input. */
int64_t ampc__transforms_scratch_floats(const ampc_transforms *t, int64_t c, int64_t h, int64_t w);
/* Runs the pipeline on in (c x h x w) into out (the output shape); scratch0/1 as sized above.
   Random draws come from Philox keyed by (seed, epoch) at counters derived from index. */
int ampc__transforms_run(const ampc_transforms *t, int64_t c, int64_t h, int64_t w, const float *in,
                         float *out, float *scratch0, float *scratch1, uint64_t seed, int64_t epoch,
                         int64_t index);
/* Deep copy (the loader keeps its own). */
ampc_transforms *ampc__transforms_clone(const ampc_transforms *t);
/* The affine kernel with fixed parameters: out(x, y) = in(A^-1 ((x, y) - c - (tx, ty)) + c), A the
   rotation by angle_deg (positive: clockwise on screen, torchvision's sense) times scale, c the
   centre ((w - 1) / 2, (h - 1) / 2); bilinear, the border as given. */
void ampc__affine(const float *in, int64_t c, int64_t h, int64_t w, float *out, double angle_deg, double scale, double tx,
                  double ty, ampc_border border);

// ---------------------------------------------------------------------------------------------
// Reproducible random streams shared by split, shuffle and transforms

/* A 64-bit Philox key for (seed, domain, a): independent streams per purpose and epoch. */
uint64_t ampc__data_key(uint64_t seed, uint32_t domain, int64_t a);
enum { AMPC__DOMAIN_SPLIT = 1, AMPC__DOMAIN_SHUFFLE = 2, AMPC__DOMAIN_TRANSFORM = 3, AMPC__DOMAIN_WINDOW_SHIFT = 4 };
/* perm[0..n) = a permutation of 0..n-1 (Fisher-Yates) drawn from Philox under key. */
void ampc__data_permutation(uint64_t key, int64_t n, int64_t *perm);

#endif /* AMPC_DATA_INTERNAL_H */
