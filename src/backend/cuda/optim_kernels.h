/*
 * optim_kernels.h - launchers of optim.cu: the optimizer steps and the GradScaler's unscale
 * over many tensors in one launch (the jobs travel as kernel parameters: no host-to-device
 * copy, so the launch never waits for the stream).
 */
#ifndef AMPC_CUDA_OPTIM_KERNELS_H
#define AMPC_CUDA_OPTIM_KERNELS_H

#include "backend/cuda/kernels.h"
#include "backend/optim_consts.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AMPC_CU_OPTIM_GROUP 96   /* tensors per launch (kernel parameters stay under 32 KiB) */



typedef struct {
    float *param;
    float *grad;        /* written back unscaled when the variant is scaled */
    float *state[3];
    void *out;          /* 16-bit copy of the updated parameter, or NULL */
    int out_dtype;      /* AMPC_F16 / AMPC_BF16 */
    int64_t n;
    /* SGD: bits 0 wd, 1 momentum, 2 first step, 3 nesterov, 4 scaled (as the CPU's variants);
       Adam: bit 0 amsgrad, bit 1 scaled */
    int variant;
    union {
        ampc_sgd_consts sgd;
        ampc_adam_consts adam;
    } c;
} ampc_cu_optim_job;

typedef struct {
    int n;
    ampc_cu_optim_job job[AMPC_CU_OPTIM_GROUP];
} ampc_cu_optim_jobs;

cudaError_t ampc_cu_sgd(const ampc_cu_optim_jobs *jobs, cudaStream_t s);
cudaError_t ampc_cu_adam(const ampc_cu_optim_jobs *jobs, cudaStream_t s);

typedef struct {
    int n;
    void *ptr[AMPC_CU_OPTIM_GROUP];
    int dtype[AMPC_CU_OPTIM_GROUP];
    int64_t numel[AMPC_CU_OPTIM_GROUP];
} ampc_cu_unscale_jobs;
/* found (device int): set to 1 where a value is non-finite; x *= inv_scale when mul */
cudaError_t ampc_cu_unscale(const ampc_cu_unscale_jobs *jobs, float inv_scale, bool mul, int *found, cudaStream_t s);
/* out (device double, nblocks entries): per-block sums of x^2; returns the block count used */
cudaError_t ampc_cu_sum_squares(const void *x, ampc_dtype dt, int64_t n, double *partial, int nblocks, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif /* AMPC_CUDA_OPTIM_KERNELS_H */
