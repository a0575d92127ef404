/*
 * optim.c - REF optimizer kernels: the SGD and Adam/AdamW updates in plain f64 loops, the
 * same formulas as the CPU kernels (PyTorch 1.13 torch/optim, single-tensor path), one
 * parameter after another; the 16-bit copy (cast_out) is rounded from the updated f64
 * parameter after its loop.
 */
#include "backend/backend.h"

#include <math.h>

static int check_f64(const ampc_tensor *t, const char *what) {
    if (t->dtype != AMPC_F64)
        return ampc__err(AMPC_ERR_DTYPE, "optimizer step: %s is %s, the REF kernels take f64", what, ampc_dtype_name(t->dtype));
    return AMPC_OK;
}

static int ref_sgd_one(const ampc_optim_item *it, const ampc_sgd_hparams *h) {
    ampc_tensor *param = it->param, *momentum_buf = it->state[0];
    const ampc_tensor *grad = it->grad;
    if (check_f64(param, "parameter") < 0 || check_f64(grad, "grad") < 0) return ampc_last_status();
    if (h->momentum != 0 && (!momentum_buf || check_f64(momentum_buf, "momentum buffer") < 0))
        return momentum_buf ? ampc_last_status() : ampc__err(AMPC_ERR_INVALID, "SGD with momentum needs a buffer");
    double *p = ampc__data(param), *buf = momentum_buf ? ampc__data(momentum_buf) : NULL;
    const double *g = ampc__data(grad);
    for (int64_t i = 0; i < param->numel; i++) {
        double d = h->grad_scale != 0 ? g[i] * (double)h->grad_scale : g[i];
        if (h->weight_decay != 0) d += h->weight_decay * p[i];
        if (h->momentum != 0) {
            buf[i] = it->first ? d : h->momentum * buf[i] + (1.0 - h->dampening) * d;
            d = h->nesterov ? d + h->momentum * buf[i] : buf[i];
        }
        p[i] -= h->lr * d;
    }
    return AMPC_OK;
}

static int ref_adam_one(const ampc_optim_item *it, const ampc_adam_hparams *h) {
    ampc_tensor *param = it->param, *exp_avg = it->state[0], *exp_avg_sq = it->state[1], *max_exp_avg_sq = it->state[2];
    const ampc_tensor *grad = it->grad;
    if (!exp_avg || !exp_avg_sq) return ampc__err(AMPC_ERR_INVALID, "Adam needs exp_avg and exp_avg_sq");
    if (check_f64(param, "parameter") < 0 || check_f64(grad, "grad") < 0 || check_f64(exp_avg, "exp_avg") < 0 ||
        check_f64(exp_avg_sq, "exp_avg_sq") < 0)
        return ampc_last_status();
    if (h->amsgrad && (!max_exp_avg_sq || check_f64(max_exp_avg_sq, "max_exp_avg_sq") < 0))
        return max_exp_avg_sq ? ampc_last_status() : ampc__err(AMPC_ERR_INVALID, "amsgrad needs max_exp_avg_sq");
    if (it->step < 1) return ampc__err(AMPC_ERR_INVALID, "Adam step %lld (steps count from 1)", (long long)it->step);
    double bc1 = 1.0 - pow(h->beta1, (double)it->step), bc2 = 1.0 - pow(h->beta2, (double)it->step);
    double step_size = h->lr / bc1, bc2_sqrt = sqrt(bc2);
    double *p = ampc__data(param), *m = ampc__data(exp_avg), *v = ampc__data(exp_avg_sq);
    double *vmax = h->amsgrad ? ampc__data(max_exp_avg_sq) : NULL;
    const double *g = ampc__data(grad);
    for (int64_t i = 0; i < param->numel; i++) {
        double gi = h->grad_scale != 0 ? g[i] * (double)h->grad_scale : g[i];
        if (h->decoupled) p[i] *= 1.0 - h->lr * h->weight_decay;
        else if (h->weight_decay != 0) gi += h->weight_decay * p[i];
        m[i] = h->beta1 * m[i] + (1.0 - h->beta1) * gi;
        v[i] = h->beta2 * v[i] + (1.0 - h->beta2) * gi * gi;
        double vi = v[i];
        if (h->amsgrad) vi = vmax[i] = fmax(vmax[i], vi);
        p[i] -= step_size * m[i] / (sqrt(vi) / bc2_sqrt + h->eps);
    }
    return AMPC_OK;
}

/* The items' 16-bit copies are checked before any update. */
static int check_cast_outs(const ampc_optim_item *items, int n) {
    for (int i = 0; i < n; i++)
        if (ampc__host_cast_out(items[i].param, items[i].cast_out) < 0) return ampc_last_status();
    return AMPC_OK;
}

/* The 16-bit copy, rounded from the updated f64 parameter. */
static void write_cast_out(const ampc_optim_item *it) {
    if (it->cast_out)
        ampc__dt(it->cast_out->dtype)->from_f64(ampc__data(it->param), ampc__data(it->cast_out), (size_t)it->param->numel);
}

static int ref_sgd_step(const ampc_optim_item *items, int n, const ampc_sgd_hparams *h) {
    int rc = check_cast_outs(items, n);
    for (int i = 0; i < n && rc >= 0; i++)
        if ((rc = ref_sgd_one(&items[i], h)) >= 0) write_cast_out(&items[i]);
    return rc;
}

static int ref_adam_step(const ampc_optim_item *items, int n, const ampc_adam_hparams *h) {
    int rc = check_cast_outs(items, n);
    for (int i = 0; i < n && rc >= 0; i++)
        if ((rc = ref_adam_one(&items[i], h)) >= 0) write_cast_out(&items[i]);
    return rc;
}

void ampc__ref_register_optim(ampc_backend *be) {
    be->sgd_step = ref_sgd_step;
    be->adam_step = ref_adam_step;
}
