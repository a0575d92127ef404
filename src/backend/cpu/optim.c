/*
 * optim.c - CPU optimizer kernels: one fused pass per parameter over fp32 master weights, their
 * fp32 grads and fp32 state (PyTorch 1.13 torch/optim/{sgd,adam,adamw}.py, single-tensor path,
 * where each tensor op rounds to fp32 once; we do the same ops in the same order per element).
 *
 * Per-tensor scalars (bias corrections, step size) are computed once in double and rounded to
 * fp32, as PyTorch computes them in Python floats. Each update is one pass over its streams
 * (memory-bound: SGD with momentum moves 5 floats per element), compiled per combination of
 * options so the loop is branch-free (always_inline with constant flags), with AVX-512/AVX2
 * clones (cpu.h); OpenMP splits big tensors over threads in blocks of BLK elements. The
 * 16-bit copy (cast_out) is converted block by block right after each block's update, while
 * the block is still in cache: the pass reads the streams once and writes 2 bytes more per
 * element, where a cast of its own would read the parameter again.
 */
#include "backend/cpu/cpu.h"

#include <math.h>

#define BLK 16384   /* elements per call of an update loop (threads take whole blocks) */

static int check_f32(const ampc_tensor *t, const char *what) {
    if (t->dtype != AMPC_F32)
        return ampc__err(AMPC_ERR_DTYPE, "optimizer step: %s is %s, the CPU kernels update fp32 master weights", what,
                         ampc_dtype_name(t->dtype));
    return AMPC_OK;
}

/* The converter for the optional 16-bit copy of the parameter (NULL: none): the dtype's own,
   the one every cast from f32 goes through. */
typedef void (*narrow_fn)(const float *, void *, size_t);
static int cast_out_fn(const ampc_tensor *param, const ampc_tensor *out, narrow_fn *f) {
    *f = NULL;
    if (!out) return AMPC_OK;
    if (out->dtype != AMPC_BF16 && out->dtype != AMPC_F16)
        return ampc__err(AMPC_ERR_DTYPE, "optimizer step: the parameter's copy is %s, not f16/bf16", ampc_dtype_name(out->dtype));
    if (out->numel != param->numel || out->format != param->format)
        return ampc__err(AMPC_ERR_SHAPE, "optimizer step: the parameter's 16-bit copy has another shape or format");
    *f = ampc__dt(out->dtype)->from_f32;
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// SGD
//   d_p = g + wd * p                         (if wd != 0)
//   buf = d_p (first step) | m * buf + (1 - dampening) * d_p
//   d_p = d_p + m * buf (nesterov) | buf     (if m != 0)
//   p  -= lr * d_p

typedef struct {
    float wd, m, keep, neg_lr;   /* weight decay, momentum, 1 - dampening, -lr */
    float gs;                    /* the fused GradScaler unscale (bit 4 of the variant): g * gs is
                                    rounded on its own (-std=c17: no FMA contraction), the same
                                    bits as a separate unscale pass */
} sgd_consts;


/* The SGD update of n elements, one pass; has_wd, has_m, first and nesterov are constants in
   every caller, so each gets a branch-free loop. */
AMPC_CPU_INLINE void sgd_body(float *restrict p, const float *restrict g, float *restrict buf, size_t n, sgd_consts c,
                              bool has_wd, bool has_m, bool first, bool nesterov, bool scaled) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        float pi = p[i], d = scaled ? g[i] * c.gs : g[i];
        if (has_wd) d = d + c.wd * pi;
        if (has_m) {
            float b = first ? d : c.m * buf[i] + c.keep * d;
            buf[i] = b;
            d = nesterov ? d + c.m * b : b;
        }
        p[i] = pi + c.neg_lr * d;
    }
}

/* One clone set per option combination: bits 0 wd, 1 momentum, 2 first step, 3 nesterov
   (the last two only with momentum), 4 scaled gradient (the fused GradScaler unscale). */
#define SGD_FN(k)                                                                                  \
    AMPC_CPU_VEC static void sgd_##k(float *p, const float *g, float *buf, size_t n, sgd_consts c) { \
        sgd_body(p, g, buf, n, c, (k) & 1, (k) & 2, (k) & 4, (k) & 8, (k) & 16);                    \
    }
SGD_FN(0) SGD_FN(1) SGD_FN(2) SGD_FN(3) SGD_FN(6) SGD_FN(7) SGD_FN(10) SGD_FN(11) SGD_FN(14) SGD_FN(15)
SGD_FN(16) SGD_FN(17) SGD_FN(18) SGD_FN(19) SGD_FN(22) SGD_FN(23) SGD_FN(26) SGD_FN(27) SGD_FN(30) SGD_FN(31)
#undef SGD_FN

typedef void (*sgd_fn)(float *, const float *, float *, size_t, sgd_consts);
static const sgd_fn sgd_fns[32] = {[0] = sgd_0,   [1] = sgd_1,   [2] = sgd_2,   [3] = sgd_3,   [6] = sgd_6,
                                   [7] = sgd_7,   [10] = sgd_10, [11] = sgd_11, [14] = sgd_14, [15] = sgd_15,
                                   [16] = sgd_16, [17] = sgd_17, [18] = sgd_18, [19] = sgd_19, [22] = sgd_22,
                                   [23] = sgd_23, [26] = sgd_26, [27] = sgd_27, [30] = sgd_30, [31] = sgd_31};

static int cpu_sgd_step(ampc_tensor *param, const ampc_tensor *grad, ampc_tensor *momentum_buf, bool first,
                        const ampc_sgd_hparams *h) {
    if (check_f32(param, "parameter") < 0 || check_f32(grad, "grad") < 0) return ampc_last_status();
    if (h->momentum != 0 && (!momentum_buf || check_f32(momentum_buf, "momentum buffer") < 0))
        return momentum_buf ? ampc_last_status() : ampc__err(AMPC_ERR_INVALID, "SGD with momentum needs a buffer");
    size_t n = (size_t)param->numel;
    float *p = ampc__data(param), *buf = h->momentum != 0 ? ampc__data(momentum_buf) : NULL;
    const float *g = (const float *)ampc__data(grad);
    sgd_consts c = {(float)h->weight_decay, (float)h->momentum, (float)(1.0 - h->dampening), (float)-h->lr,
                    h->grad_scale};
    bool has_m = h->momentum != 0;
    int k = (h->weight_decay != 0) | has_m << 1 | (has_m && first) << 2 | (has_m && h->nesterov) << 3 |
            (h->grad_scale != 0) << 4;
    sgd_fn f = sgd_fns[k];
    narrow_fn nf;
    if (cast_out_fn(param, h->cast_out, &nf) < 0) return ampc_last_status();
    uint16_t *out = nf ? ampc__data(h->cast_out) : NULL;
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)n)) schedule(static)
    for (size_t base = 0; base < n; base += BLK) {
        size_t len = n - base < BLK ? n - base : BLK;
        f(p + base, g + base, buf ? buf + base : NULL, len, c);
        if (nf) nf(p + base, out + base, len);
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
    float gs;          /* the fused GradScaler unscale, when `scaled` */
} adam_consts;

/* The Adam update of n elements, one pass (vmax only with amsgrad, a constant in each caller) */
AMPC_CPU_INLINE void adam_body(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                               float *restrict vmax, size_t n, const adam_consts *c, bool amsgrad, bool scaled) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        float pi = p[i] * c->decay;
        float gi = (scaled ? g[i] * c->gs : g[i]) + c->l2 * pi;
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
#define ADAM_FN(name, ams, scaled)                                                                \
    AMPC_CPU_VEC static void name(float *p, const float *g, float *m, float *v, float *vmax, size_t n, \
                                  const adam_consts *c) {                                          \
        adam_body(p, g, m, v, vmax, n, c, ams, scaled);                                            \
    }
ADAM_FN(adam_plain, false, false) ADAM_FN(adam_amsgrad, true, false)
ADAM_FN(adam_plain_scaled, false, true) ADAM_FN(adam_amsgrad_scaled, true, true)
#undef ADAM_FN

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
        .gs = h->grad_scale,
    };
    size_t n = (size_t)param->numel;
    float *p = ampc__data(param), *m = ampc__data(exp_avg), *v = ampc__data(exp_avg_sq);
    float *vmax = h->amsgrad ? ampc__data(max_exp_avg_sq) : NULL;
    const float *g = (const float *)ampc__data(grad);
    void (*f)(float *, const float *, float *, float *, float *, size_t, const adam_consts *) =
        h->grad_scale != 0 ? (h->amsgrad ? adam_amsgrad_scaled : adam_plain_scaled) : (h->amsgrad ? adam_amsgrad : adam_plain);
    narrow_fn nf;
    if (cast_out_fn(param, h->cast_out, &nf) < 0) return ampc_last_status();
    uint16_t *out = nf ? ampc__data(h->cast_out) : NULL;
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)n)) schedule(static)
    for (size_t base = 0; base < n; base += BLK) {
        size_t len = n - base < BLK ? n - base : BLK;
        f(p + base, g + base, m + base, v + base, vmax ? vmax + base : NULL, len, &c);
        if (nf) nf(p + base, out + base, len);
    }
    return AMPC_OK;
}

void ampc__cpu_register_optim(ampc_backend *be) {
    be->sgd_step = cpu_sgd_step;
    be->adam_step = cpu_adam_step;
}
