/*
 * host_checks.c - checks shared by the backends whose memory the CPU reads (CPU and REF):
 * data-dependent validation that must look at tensor contents, and the optimizer kernels'
 * check of a parameter's 16-bit copy, and which saved tensor a unary backward reads.
 */
#include "backend/backend.h"

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
