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
/* Scratch device memory for a kernel (AMPC_MEM_WORKSPACE, through core's caching allocator):
   freed at once after queueing is safe on the one stream. */
void *ampc__cu_scratch(size_t nbytes, size_t *block_bytes);
void ampc__cu_scratch_free(void *p, size_t block_bytes);

/* gemm.c: C = alpha op(A) op(B) + beta C (beta 0 or 1) on device pointers, row-major as
   ampc_gemm_desc says (batch strides included), in_dt operands and an out_dt C, on cuBLASLt with
   the plans of the table's gemm; for kernels that multiply parts of tensors (attention). Every
   size must be positive (AMPC_ERR_INVALID otherwise). */
int ampc__cu_gemm_ptr(const ampc_gemm_desc *d, ampc_dtype in_dt, ampc_dtype out_dt, const void *a, const void *b, void *c,
                      float alpha, float beta);

/* Each kernel file fills its part of the table. */
void ampc__cuda_register_elementwise(ampc_backend *be);  /* unary, binary, sum_to, expand, copy_block */
void ampc__cuda_register_loss(ampc_backend *be);         /* softmax, cross_entropy */
void ampc__cuda_register_random(ampc_backend *be);       /* dropout */
void ampc__cuda_register_gemm(ampc_backend *be);         /* gemm on cuBLASLt */
void ampc__cuda_register_optim(ampc_backend *be);        /* sgd_step, adam_step, unscale_check, sum_squares */
void ampc__cuda_register_conv(ampc_backend *be);         /* conv2d and its backward passes on cuDNN */
void ampc__cuda_register_pool(ampc_backend *be);         /* pooling (own kernels) */
void ampc__cuda_register_batch_norm(ampc_backend *be);   /* batch_norm, _relu, _add_relu (own kernels) */
void ampc__cuda_register_layer_norm(ampc_backend *be);   /* layer_norm (own kernels) */
void ampc__cuda_register_embedding(ampc_backend *be);    /* embedding, permute (own kernels) */
void ampc__cuda_register_attention(ampc_backend *be);    /* attention: cuBLASLt products, own softmax kernels */

#endif /* AMPC_CUDA_H */
