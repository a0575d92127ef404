/*
 * cuda.h - the C side of the CUDA backend (the .c files of src/backend/cuda): one device (the first GPU),
 * one stream on which every kernel, cuBLASLt call and cuDNN call of the process is queued in
 * order (so the caching allocator in core can reuse a freed block at once, as PyTorch's does on
 * one stream), lazily started on first use so that programs that never touch the GPU pay
 * nothing. Host copies synchronise that stream; everything else is asynchronous.
 */
#ifndef AMPC_CUDA_H
#define AMPC_CUDA_H

#include "backend/backend.h"
#include "backend/cuda/kernels.h"

/* The stream (after ampc__cu_ready() succeeded). */
cudaStream_t ampc__cu_stream(void);
/* AMPC_OK once the GPU is usable (started on the first call), else the error recorded. */
int ampc__cu_ready(void);
/* AMPC_OK for cudaSuccess; else records "cuda: <what>: <CUDA's message>" (AMPC_ERR_OOM for an
   allocation failure, else AMPC_ERR_BACKEND) and returns it. */
int ampc__cu_check(cudaError_t e, const char *what);
/* Checks that t is on the CUDA device (who names the kernel in the error). */
int ampc__cu_on_device(const ampc_tensor *t, const char *who);
/* Scratch device memory for a kernel (AMPC_MEM_WORKSPACE, through core's caching allocator):
   freed at once after queueing is safe on the one stream. */
void *ampc__cu_scratch(size_t nbytes, size_t *block_bytes);
void ampc__cu_scratch_free(void *p, size_t block_bytes);

/* Each kernel file fills its part of the table. */
void ampc__cuda_register_elementwise(ampc_backend *be);  /* unary, binary, sum_to, expand, copy_block, dropout */
void ampc__cuda_register_loss(ampc_backend *be);         /* softmax, cross_entropy, layer_norm */
void ampc__cuda_register_gemm(ampc_backend *be);         /* gemm on cuBLASLt */
void ampc__cuda_register_optim(ampc_backend *be);        /* sgd_step, adam_step, unscale_check, sum_squares */
void ampc__cuda_register_dnn(ampc_backend *be);          /* conv2d, pooling, batch_norm on cuDNN */

#endif /* AMPC_CUDA_H */
