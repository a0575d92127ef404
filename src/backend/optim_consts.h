/*
 * optim_consts.h - the per-parameter f32 constants of the optimizer kernels (PyTorch computes
 * them in Python floats: here in double, rounded to f32 once). One definition for every
 * backend, so the CPU and CUDA steps apply the same numbers and give the same bits. Plain C
 * without ampc's internal headers: the CUDA kernels (C++) read it too.
 */
#ifndef AMPC_OPTIM_CONSTS_H
#define AMPC_OPTIM_CONSTS_H

typedef struct {
    float wd, m, keep, neg_lr;   /* weight decay, momentum, 1 - dampening, -lr */
    float gs;                    /* the fused GradScaler unscale (0: none): g * gs is rounded on its
                                    own, the same bits as a separate unscale pass */
} ampc_sgd_consts;

typedef struct {
    float decay;       /* 1 - lr * wd for AdamW, else 1 (exact identity) */
    float l2;          /* wd for Adam, else 0 */
    float b1, omb1, b2, omb2, eps, bc2_sqrt, neg_step_size;
    float gs;          /* the fused GradScaler unscale (0: none) */
} ampc_adam_consts;

#endif /* AMPC_OPTIM_CONSTS_H */
