/*
 * batch_norm.h - what batch_norm.c shares with conv.c: the scratch of the per-channel reductions
 * (batch_norm_kernels.h), which convolution's bias gradient runs too.
 */
#ifndef AMPC_CUDA_BATCH_NORM_H
#define AMPC_CUDA_BATCH_NORM_H

#include "backend/cuda/batch_norm_kernels.h"
#include "backend/cuda/cuda.h"

/* Scratch for the per-channel reductions (batch_norm_kernels.h): `passes` * 2 * P * C doubles followed
   by `floats` floats (8-byte aligned). NULL with the error set on failure. */
typedef struct {
    void *p;
    size_t bytes;
    double *part;
    float *f;
    int P;
} ampc_cu_chan_scratch;
int ampc__cu_chan_scratch(ampc_cu_chan_scratch *s, const ampc_cu_chan_geom *g, int passes, int64_t floats);
void ampc__cu_chan_scratch_free(ampc_cu_chan_scratch *s);

#endif /* AMPC_CUDA_BATCH_NORM_H */
