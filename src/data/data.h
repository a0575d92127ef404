/*
 * data.h - the dataset object behind ampc_dataset: a small vtable so IDX files, image folders
 * and subsets (train/validation splits) look the same to transforms and the data loader.
 *
 * A dataset yields samples one at a time as f32 CHW images (values in [0, 1] before
 * normalisation) and an int64 class label. get() must be safe to call from several loader
 * threads at once (no shared mutable state, or its own lock).
 */
#ifndef AMPC_DATA_INTERNAL_H
#define AMPC_DATA_INTERNAL_H

#include "core/core.h"

typedef struct {
    const char *type;   /* "idx", "folder", "subset" */
    /* Sample i: image into img (channels*height*width f32, CHW) and its label. Raw (untransformed)
       pixels scaled to [0, 1]; for folders, decoded and resized to the dataset's size. */
    int (*get)(ampc_dataset *ds, int64_t i, float *img, int64_t *label);
    void (*free)(ampc_dataset *ds);
} ampc_dataset_vtable;

struct ampc_dataset {
    const ampc_dataset_vtable *vt;
    int64_t size;
    int64_t num_classes;
    int64_t channels, height, width;   /* of every sample after decoding/resizing */
    char **class_names;                /* num_classes strings (owned) or NULL */
    void *impl;
};

#endif /* AMPC_DATA_INTERNAL_H */
