/*
 * optim.c - REF optimizer kernels: the SGD and Adam/AdamW updates in plain f64 loops, the
 * same formulas as the CPU kernels (PyTorch 1.13 torch/optim, single-tensor path), one
 * parameter after another; the 16-bit copy (cast_out) is rounded from the updated f64
 * parameter after its loop.
 */
#include "backend/backend.h"

#include <math.h>


/* One parameter's update (its item checked by the caller). */
static void ref_sgd_one(const ampc_optim_item *it, const ampc_sgd_hparams *h) {
    ampc_tensor *param = it->param, *momentum_buf = it->state[0];
    double *p = (double *)ampc__data(param) + it->begin, *buf = momentum_buf ? ampc__data(momentum_buf) : NULL;
    double *g = (double *)ampc__data(it->grad) + it->begin;
    for (int64_t i = 0; i < ampc__item_count(it); i++) {
        if (h->grad_scale != 0) g[i] *= (double)h->grad_scale;   /* the unscaled gradient, written back */
        double d = g[i];
        if (h->weight_decay != 0) d += h->weight_decay * p[i];
        if (h->momentum != 0) {
            buf[i] = it->first ? d : h->momentum * buf[i] + (1.0 - h->dampening) * d;
            d = h->nesterov ? d + h->momentum * buf[i] : buf[i];
        }
        p[i] -= h->lr * d;
    }
}

static void ref_adam_one(const ampc_optim_item *it, const ampc_adam_hparams *h) {
    ampc_tensor *param = it->param, *exp_avg = it->state[0], *exp_avg_sq = it->state[1], *max_exp_avg_sq = it->state[2];
    double bc1 = 1.0 - pow(h->beta1, (double)it->step), bc2 = 1.0 - pow(h->beta2, (double)it->step);
    double step_size = h->lr / bc1, bc2_sqrt = sqrt(bc2);
    double *p = (double *)ampc__data(param) + it->begin, *m = ampc__data(exp_avg), *v = ampc__data(exp_avg_sq);
    double *vmax = h->amsgrad ? ampc__data(max_exp_avg_sq) : NULL;
    double *g = (double *)ampc__data(it->grad) + it->begin;
    for (int64_t i = 0; i < ampc__item_count(it); i++) {
        if (h->grad_scale != 0) g[i] *= (double)h->grad_scale;   /* the unscaled gradient, written back */
        double gi = g[i];
        if (h->decoupled) p[i] *= 1.0 - h->lr * h->weight_decay;
        else if (h->weight_decay != 0) gi += h->weight_decay * p[i];
        m[i] = h->beta1 * m[i] + (1.0 - h->beta1) * gi;
        v[i] = h->beta2 * v[i] + (1.0 - h->beta2) * gi * gi;
        double vi = v[i];
        if (h->amsgrad) vi = vmax[i] = fmax(vmax[i], vi);
        p[i] -= step_size * m[i] / (sqrt(vi) / bc2_sqrt + h->eps);
    }
}

/* The 16-bit copy, rounded from the updated f64 parameter. */
static void write_cast_out(const ampc_optim_item *it) {
    if (it->cast_out)
        ampc__dt(it->cast_out->dtype)->from_f64(ampc__data(it->param), ampc__data(it->cast_out), (size_t)it->param->numel);
}

/* The door checked every item before any is updated. */
static int ref_sgd_step(const ampc_optim_item *items, int n, const ampc_sgd_hparams *h) {
    for (int i = 0; i < n; i++) {
        ref_sgd_one(&items[i], h);
        write_cast_out(&items[i]);
    }
    return AMPC_OK;
}

static int ref_adam_step(const ampc_optim_item *items, int n, const ampc_adam_hparams *h) {
    for (int i = 0; i < n; i++) {
        ref_adam_one(&items[i], h);
        write_cast_out(&items[i]);
    }
    return AMPC_OK;
}

void ampc__ref_register_optim(ampc_backend *be) {
    be->sgd_step = ref_sgd_step;
    be->adam_step = ref_adam_step;
}
