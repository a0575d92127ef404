/*
 * optim.c - CPU optimizer kernels: one fused pass per parameter over fp32 master weights, their
 * fp32 grads and fp32 state (PyTorch 1.13 torch/optim/{sgd,adam,adamw}.py, single-tensor path,
 * where each tensor op rounds to fp32 once; we do the same ops in the same order per element).
 *
 * Per-tensor scalars (bias corrections, step size) are computed once in double and rounded to
 * fp32, as PyTorch computes them in Python floats. Loops are split by the options so each inner
 * loop is branch-free and vectorizable; OpenMP splits big tensors over threads.
 */
#include "backend/cpu/cpu.h"

#include <math.h>

static int check_f32(const ampc_tensor *t, const char *what) {
    if (t->dtype != AMPC_F32)
        return ampc__err(AMPC_ERR_DTYPE, "optimizer step: %s is %s, the CPU kernels update fp32 master weights", what,
                         ampc_dtype_name(t->dtype));
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// SGD
//   d_p = g + wd * p                         (if wd != 0)
//   buf = d_p (first step) | m * buf + (1 - dampening) * d_p
//   d_p = d_p + m * buf (nesterov) | buf     (if m != 0)
//   p  -= lr * d_p

static int cpu_sgd_step(ampc_tensor *param, const ampc_tensor *grad, ampc_tensor *momentum_buf, bool first,
                        const ampc_sgd_hparams *h) {
    if (check_f32(param, "parameter") < 0 || check_f32(grad, "grad") < 0) return ampc_last_status();
    if (h->momentum != 0 && (!momentum_buf || check_f32(momentum_buf, "momentum buffer") < 0))
        return momentum_buf ? ampc_last_status() : ampc__err(AMPC_ERR_INVALID, "SGD with momentum needs a buffer");
    int64_t n = param->numel;
    float *p = ampc__data(param);
    const float *g = (const float *)ampc__data(grad);
    float *buf = momentum_buf ? ampc__data(momentum_buf) : NULL;
    const float wd = (float)h->weight_decay, m = (float)h->momentum, keep = (float)(1.0 - h->dampening);
    const float neg_lr = (float)-h->lr;
    const bool has_wd = h->weight_decay != 0, has_m = h->momentum != 0, nesterov = h->nesterov;
    int nt = ampc__threads_for(n);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t base = 0; base < n; base += AMPC_CPU_CHUNK) {
        const int64_t len = n - base < AMPC_CPU_CHUNK ? n - base : AMPC_CPU_CHUNK;
        float *pc = p + base, *bc = buf ? buf + base : NULL, d[AMPC_CPU_CHUNK];
        const float *gc = g + base;
        /* `omp simd`: -O2's cheap cost model would leave these loops scalar */
        if (has_wd) {
#pragma omp simd
            for (int64_t i = 0; i < len; i++) d[i] = gc[i] + wd * pc[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < len; i++) d[i] = gc[i];
        }
        if (has_m) {
            if (first) {
#pragma omp simd
                for (int64_t i = 0; i < len; i++) bc[i] = d[i];
            } else {
#pragma omp simd
                for (int64_t i = 0; i < len; i++) bc[i] = m * bc[i] + keep * d[i];
            }
            if (nesterov) {
#pragma omp simd
                for (int64_t i = 0; i < len; i++) d[i] = d[i] + m * bc[i];
            } else {
#pragma omp simd
                for (int64_t i = 0; i < len; i++) d[i] = bc[i];
            }
        }
#pragma omp simd
        for (int64_t i = 0; i < len; i++) pc[i] = pc[i] + neg_lr * d[i];
    }
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Adam / AdamW, step t >= 1
//   AdamW: p *= 1 - lr * wd              Adam: g = g + wd * p   (if wd != 0)
//   m = b1 * m + (1 - b1) * g
//   v = b2 * v + (1 - b2) * g * g
//   vmax = max(vmax, v)                  (amsgrad; the denominator uses vmax instead of v)
//   denom = sqrt(v) / sqrt(1 - b2^t) + eps
//   p -= lr / (1 - b1^t) * m / denom

typedef struct {
    float decay;       /* 1 - lr * wd for AdamW, else 1 (exact identity) */
    float l2;          /* wd for Adam, else 0 */
    float b1, omb1, b2, omb2, eps, bc2_sqrt, neg_step_size;
} adam_consts;

static inline __attribute__((always_inline)) void adam_range(float *p, const float *g, float *m, float *v, float *vmax,
                                                             int64_t base, int64_t end, const adam_consts *c,
                                                             bool amsgrad) {
#pragma omp simd
    for (int64_t i = base; i < end; i++) {
        float pi = p[i] * c->decay;
        float gi = g[i] + c->l2 * pi;
        float mi = c->b1 * m[i] + c->omb1 * gi;
        float vi = c->b2 * v[i] + c->omb2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        if (amsgrad) {
            float old = vmax[i];
            vi = old > vi ? old : vi;   /* NaN in v propagates, as torch.maximum */
            vmax[i] = vi;
        }
        float denom = sqrtf(vi) / c->bc2_sqrt + c->eps;
        p[i] = pi + c->neg_step_size * mi / denom;   /* addcdiv: (value * t1) / t2 */
    }
}

static int cpu_adam_step(ampc_tensor *param, const ampc_tensor *grad, ampc_tensor *exp_avg, ampc_tensor *exp_avg_sq,
                         ampc_tensor *max_exp_avg_sq, const ampc_adam_hparams *h) {
    if (check_f32(param, "parameter") < 0 || check_f32(grad, "grad") < 0 || check_f32(exp_avg, "exp_avg") < 0 ||
        check_f32(exp_avg_sq, "exp_avg_sq") < 0)
        return ampc_last_status();
    if (h->amsgrad && (!max_exp_avg_sq || check_f32(max_exp_avg_sq, "max_exp_avg_sq") < 0))
        return max_exp_avg_sq ? ampc_last_status() : ampc__err(AMPC_ERR_INVALID, "amsgrad needs max_exp_avg_sq");
    if (h->step < 1) return ampc__err(AMPC_ERR_INVALID, "Adam step %lld (steps count from 1)", (long long)h->step);
    double bc1 = 1.0 - pow(h->beta1, (double)h->step), bc2 = 1.0 - pow(h->beta2, (double)h->step);
    adam_consts c = {
        .decay = h->decoupled ? (float)(1.0 - h->lr * h->weight_decay) : 1.0f,
        .l2 = h->decoupled ? 0.0f : (float)h->weight_decay,
        .b1 = (float)h->beta1, .omb1 = (float)(1.0 - h->beta1),
        .b2 = (float)h->beta2, .omb2 = (float)(1.0 - h->beta2),
        .eps = (float)h->eps, .bc2_sqrt = (float)sqrt(bc2), .neg_step_size = (float)(-h->lr / bc1),
    };
    int64_t n = param->numel;
    float *p = ampc__data(param), *m = ampc__data(exp_avg), *v = ampc__data(exp_avg_sq);
    float *vmax = h->amsgrad ? ampc__data(max_exp_avg_sq) : NULL;
    const float *g = (const float *)ampc__data(grad);
    const bool amsgrad = h->amsgrad;
    int nt = ampc__threads_for(n);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t base = 0; base < n; base += AMPC_CPU_CHUNK) {
        int64_t end = n - base < AMPC_CPU_CHUNK ? n : base + AMPC_CPU_CHUNK;
        if (amsgrad) adam_range(p, g, m, v, vmax, base, end, &c, true);
        else adam_range(p, g, m, v, NULL, base, end, &c, false);
    }
    return AMPC_OK;
}

void ampc__cpu_register_optim(ampc_backend *be) {
    be->sgd_step = cpu_sgd_step;
    be->adam_step = cpu_adam_step;
}
