/*
 * ampc/data.h - datasets, transforms and the data loader (included by ampc.h).
 */
#ifndef AMPC_DATA_H
#define AMPC_DATA_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A dataset of labelled images (f32 CHW samples in [0, 1], int64 labels). */
typedef struct ampc_dataset ampc_dataset;
int64_t ampc_dataset_size(const ampc_dataset *ds);
int64_t ampc_dataset_num_classes(const ampc_dataset *ds);
/* Shape of every sample: channels, height, width. */
void ampc_dataset_sample_shape(const ampc_dataset *ds, int64_t *c, int64_t *h, int64_t *w);
/* Sample i (raw, untransformed) into img (c*h*w floats) and *label. */
int ampc_dataset_get(ampc_dataset *ds, int64_t i, float *img, int64_t *label);
void ampc_dataset_free(ampc_dataset *ds);

#ifdef __cplusplus
}
#endif

#endif /* AMPC_DATA_H */
