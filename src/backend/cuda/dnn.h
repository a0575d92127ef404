/*
 * dnn.h - what the CUDA backend's dnn files (dnn.c: pooling, batch norm and the table entries;
 * conv.c: convolution on cuDNN) share.
 */
#ifndef AMPC_CUDA_DNN_H
#define AMPC_CUDA_DNN_H

#include "backend/cuda/cuda.h"
#include "backend/cuda/dnn_kernels.h"

/* conv2d, conv2d_backward_data, conv2d_backward_weights (conv.c) */
void ampc__cuda_register_conv(ampc_backend *be);

/* f32, f16 or bf16 */
static inline bool ampc__cu_is_float(ampc_dtype dt) { return dt == AMPC_F32 || dt == AMPC_F16 || dt == AMPC_BF16; }

/* Scratch for the per-channel reductions (dnn_kernels.h): `passes` * 2 * P * C doubles followed
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

#endif /* AMPC_CUDA_DNN_H */
