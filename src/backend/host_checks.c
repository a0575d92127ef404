/*
 * host_checks.c - what the backends share on the host side: checks of kernel arguments
 * (copy_block's blocks, layer norm's shape, the optimizer items' tensors; for the backends whose
 * memory the CPU reads, the data-dependent validation that must look at tensor contents), which
 * saved tensor a unary backward reads, broadcast strides, and the optimizers' constants.
 */
#include "backend/backend.h"

#include <math.h>

ampc_sgd_consts ampc__sgd_consts(const ampc_sgd_hparams *h) {
    return (ampc_sgd_consts){(float)h->weight_decay, (float)h->momentum, (float)(1.0 - h->dampening), (float)-h->lr,
                             h->grad_scale};
}

ampc_adam_consts ampc__adam_consts(const ampc_adam_hparams *h, int64_t step) {
    double bc1 = 1.0 - pow(h->beta1, (double)step), bc2 = 1.0 - pow(h->beta2, (double)step);
    return (ampc_adam_consts){
        .decay = h->decoupled ? (float)(1.0 - h->lr * h->weight_decay) : 1.0f,
        .l2 = h->decoupled ? 0.0f : (float)h->weight_decay,
        .b1 = (float)h->beta1, .omb1 = (float)(1.0 - h->beta1),
        .b2 = (float)h->beta2, .omb2 = (float)(1.0 - h->beta2),
        .eps = (float)h->eps, .bc2_sqrt = (float)sqrt(bc2), .neg_step_size = (float)(-h->lr / bc1),
        .gs = h->grad_scale,
    };
}

int ampc__layer_norm_dims(const ampc_tensor *x, const ampc_tensor *stat, const char *who, const char *k, int64_t *rows,
                          int64_t *cols) {
    if (!stat) return ampc__err(AMPC_ERR_INVALID, "%s%s: mean/rstd missing", who, k);
    *rows = stat->numel;
    if (*rows == 0 ? x->numel != 0 : x->numel % *rows != 0)
        return ampc__err(AMPC_ERR_SHAPE, "%s%s: %lld elements do not make %lld rows", who, k, (long long)x->numel,
                         (long long)*rows);
    *cols = *rows ? x->numel / *rows : 0;
    return AMPC_OK;
}

int ampc__host_ce_targets(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_cross_entropy_options *o,
                          int64_t *count) {
    if (targets->dtype != AMPC_I64)
        return ampc__err(AMPC_ERR_DTYPE, "cross_entropy: targets are %s, not i64", ampc_dtype_name(targets->dtype));
    if (logits->ndim != 2 || targets->ndim != 1 || targets->shape[0] != logits->shape[0])
        return ampc__err(AMPC_ERR_SHAPE, "cross_entropy: logits must be (N, C) and targets (N)");
    int64_t N = logits->shape[0], C = logits->shape[1], k = 0;
    const int64_t *tg = ampc__data(targets);
    for (int64_t i = 0; i < N; i++) {
        if (tg[i] == o->ignore_index) continue;
        if (tg[i] < 0 || tg[i] >= C)
            return ampc__err(AMPC_ERR_INVALID, "cross_entropy: target %lld in row %lld is out of range [0, %lld)",
                             (long long)tg[i], (long long)i, (long long)C);
        k++;
    }
    *count = k;
    return AMPC_OK;
}

static int check_dtype(const ampc_tensor *t, const char *what, ampc_dtype dt, const char *kernels) {
    if (t->dtype != dt)
        return ampc__err(AMPC_ERR_DTYPE, "optimizer step: %s is %s, %s", what, ampc_dtype_name(t->dtype), kernels);
    return AMPC_OK;
}

/* What every item needs: param, grad and the 16-bit copy. */
static int check_item(const ampc_optim_item *it, ampc_dtype dt, const char *kernels) {
    if (check_dtype(it->param, "parameter", dt, kernels) < 0 || check_dtype(it->grad, "grad", dt, kernels) < 0)
        return ampc_last_status();
    if (it->grad->numel != it->param->numel) return ampc__err(AMPC_ERR_SHAPE, "optimizer step: grad and parameter sizes differ");
    if (it->begin < 0 || it->count < 0 || it->begin > it->param->numel - it->count || (it->count == 0 && it->begin != 0))
        return ampc__err(AMPC_ERR_SHAPE, "optimizer step: part [%lld, +%lld) of a parameter of %lld elements", (long long)it->begin,
                         (long long)it->count, (long long)it->param->numel);
    const int64_t n = ampc__item_count(it);
    for (int k = 0; k < 3; k++)
        if (it->state[k] && it->state[k]->numel != n)
            return ampc__err(AMPC_ERR_SHAPE, "optimizer step: state %d has %lld elements for %lld", k, (long long)it->state[k]->numel,
                             (long long)n);
    const ampc_tensor *out = it->cast_out;
    if (!out) return AMPC_OK;
    if (it->count) return ampc__err(AMPC_ERR_INVALID, "optimizer step: a part of a parameter has no 16-bit copy to write");
    if (out->dtype != AMPC_BF16 && out->dtype != AMPC_F16)
        return ampc__err(AMPC_ERR_DTYPE, "optimizer step: the parameter's copy is %s, not f16/bf16", ampc_dtype_name(out->dtype));
    if (out->numel != it->param->numel || out->format != it->param->format)
        return ampc__err(AMPC_ERR_SHAPE, "optimizer step: the parameter's 16-bit copy has another shape or format");
    return AMPC_OK;
}

int ampc__check_sgd_item(const ampc_optim_item *it, const ampc_sgd_hparams *h, ampc_dtype dt, const char *kernels) {
    int rc = check_item(it, dt, kernels);
    if (rc < 0 || h->momentum == 0) return rc;
    if (!it->state[0]) return ampc__err(AMPC_ERR_INVALID, "SGD with momentum needs a buffer");
    return check_dtype(it->state[0], "momentum buffer", dt, kernels);
}

int ampc__check_adam_item(const ampc_optim_item *it, const ampc_adam_hparams *h, ampc_dtype dt, const char *kernels) {
    int rc = check_item(it, dt, kernels);
    if (rc < 0) return rc;
    if (!it->state[0] || !it->state[1]) return ampc__err(AMPC_ERR_INVALID, "Adam needs exp_avg and exp_avg_sq");
    if (check_dtype(it->state[0], "exp_avg", dt, kernels) < 0 || check_dtype(it->state[1], "exp_avg_sq", dt, kernels) < 0)
        return ampc_last_status();
    if (h->amsgrad && !it->state[2]) return ampc__err(AMPC_ERR_INVALID, "amsgrad needs max_exp_avg_sq");
    if (h->amsgrad && check_dtype(it->state[2], "max_exp_avg_sq", dt, kernels) < 0) return ampc_last_status();
    if (it->step < 1) return ampc__err(AMPC_ERR_INVALID, "Adam step %lld (steps count from 1)", (long long)it->step);
    return AMPC_OK;
}

int ampc__unary_backward_operands(ampc_op op, const ampc_tensor **x, const ampc_tensor **y, const char *who) {
    ampc_backward_reads reads = ampc_op_backward_reads(op);
    if (reads != AMPC_READS_X) *x = NULL;
    if (reads != AMPC_READS_Y) *y = NULL;
    if (reads != AMPC_READS_NONE && !*x && !*y)
        return ampc__err(AMPC_ERR_INVALID, "%s unary_backward of %s needs its saved %s", who, ampc_op_name(op),
                         reads == AMPC_READS_X ? "input" : "output");
    return AMPC_OK;
}

int ampc__broadcast_strides(const ampc_tensor *t, int nd, const int64_t *shape, int64_t *st, const char *who) {
    for (int j = 0; j < t->ndim - nd; j++)
        if (t->shape[j] != 1)
            return ampc__err(AMPC_ERR_SHAPE, "%s: tensor of %d dims does not broadcast to %d dims", who, t->ndim, nd);
    int64_t s = 1;
    for (int i = nd - 1; i >= 0; i--) {
        int j = t->ndim - nd + i;
        int64_t d = j >= 0 ? t->shape[j] : 1;
        if (d != 1 && d != shape[i])
            return ampc__err(AMPC_ERR_SHAPE, "%s: size %lld does not broadcast to %lld in dim %d", who, (long long)d,
                             (long long)shape[i], i);
        st[i] = d == 1 ? 0 : s;
        s *= d;
    }
    return AMPC_OK;
}
