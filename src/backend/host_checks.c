/*
 * host_checks.c - what the backends share on the host side: checks of kernel arguments
 * (copy_block's blocks, layer norm's shape; for the backends whose memory the CPU reads, the
 * data-dependent validation that must look at tensor contents and the check of a parameter's
 * 16-bit copy), which saved tensor a unary backward reads, and the optimizers' constants.
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

int ampc__check_copy_block(const ampc_tensor *src, int64_t src_off, int64_t src_ld, const ampc_tensor *dst,
                           int64_t dst_off, int64_t dst_ld, int64_t rows, int64_t cols) {
    if (src->dtype != dst->dtype)
        return ampc__err(AMPC_ERR_DTYPE, "copy_block between %s and %s", ampc_dtype_name(src->dtype), ampc_dtype_name(dst->dtype));
    if (rows <= 0 || cols <= 0) return 1;
    if (src_off < 0 || dst_off < 0 || src_off + (rows - 1) * src_ld + cols > src->numel ||
        dst_off + (rows - 1) * dst_ld + cols > dst->numel)
        return ampc__err(AMPC_ERR_INVALID, "copy_block of %lld x %lld outside its tensors", (long long)rows, (long long)cols);
    return AMPC_OK;
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

int ampc__host_cast_out(const ampc_tensor *param, const ampc_tensor *out) {
    if (!out) return AMPC_OK;
    if (out->dtype != AMPC_BF16 && out->dtype != AMPC_F16)
        return ampc__err(AMPC_ERR_DTYPE, "optimizer step: the parameter's copy is %s, not f16/bf16", ampc_dtype_name(out->dtype));
    if (out->numel != param->numel || out->format != param->format)
        return ampc__err(AMPC_ERR_SHAPE, "optimizer step: the parameter's 16-bit copy has another shape or format");
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
