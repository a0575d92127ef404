/*
 * op_table.c - the op table's autocast policies, expanded from AMPC_OP_TABLE (include/ampc.h),
 * the one place an op's facts are written (its other columns are read inline there).
 */
#include "ops/ops.h"

typedef struct { ampc_policy f16, bf16; } policy_row;

static const policy_row policies[AMPC_OP_COUNT] = {
#define POLICY_(id, name, f16, bf16, channels_last, reads, grad_fn, kind) [AMPC_OP_##id] = {AMPC_POLICY_##f16, AMPC_POLICY_##bf16},
    AMPC_OP_TABLE(POLICY_)
#undef POLICY_
};

ampc_policy ampc_op_policy(ampc_op op, ampc_dtype autocast_dtype) {
    if ((unsigned)op >= AMPC_OP_COUNT) return AMPC_POLICY_UNSET;
    return autocast_dtype == AMPC_BF16 ? policies[op].bf16 : policies[op].f16;
}

const char *ampc_policy_name(ampc_policy p) {
    switch (p) {
    case AMPC_POLICY_LOWER: return "lower_precision";
    case AMPC_POLICY_FP32: return "fp32";
    case AMPC_POLICY_PROMOTE: return "promote";
    case AMPC_POLICY_PASSTHROUGH: return "passthrough";
    default: return "unset";
    }
}
