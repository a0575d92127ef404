/*
 * doctor.c - ampc-train's use of the numerics doctor (--doctor) and of explain (--explain),
 * both from the library (ampc_doctor_*, ampc_explain_*; src/amp/doctor.c).
 */
#include "train.h"

#include <inttypes.h>
#include <stdio.h>

void doctor_step_begin(run *r) {
    if (!ampc_doctor_is_enabled()) return;
    ampc_doctor_step_begin(ampc_scaler_is_enabled(r->scaler) ? (double)ampc_scaler_get_scale(r->scaler) : 1.0);
}

const char *doctor_blame(char *buf, size_t n) {
    buf[0] = '\0';
    if (!ampc_doctor_is_enabled()) return buf;
    ampc_doctor_finding f = ampc_doctor_finding_get();
    if (f.verdict == AMPC_DOCTOR_CLEAN) return buf;
    snprintf(buf, n, "the first non-finite output: %s in '%s' (%s, %" PRId64 " of %" PRId64 " values), %s%s", f.op,
             f.module && *f.module ? f.module : "(model)", f.backward ? "backward" : "forward", f.nonfinite, f.numel,
             ampc_doctor_verdict_name(f.verdict),
             f.verdict == AMPC_DOCTOR_SCALE_INDUCED ? " (a smaller loss scale fixes it)"
                                                    : " (no loss scale fixes it: try bf16, a lower --lr, or fp32 for that module)");
    return buf;
}

int explain_begin(run *r) {
    if (!yes(r->s, OPT_EXPLAIN) || r->rank > 0) return 0;
    if (ampc_explain_begin() < 0) return fail_lib("--explain");
    r->explaining = true;
    return 0;
}

static const char *dtypes(const ampc_dtype *d, int n, char *buf, size_t cap) {
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && at < cap; i++) {
        const char *name = d[i] == AMPC_DTYPE_COUNT ? "-" : ampc_dtype_name(d[i]);
        int w = snprintf(buf + at, cap - at, "%s%s", i ? "," : "", name);
        if (w < 0) break;
        at += (size_t)w;
    }
    return buf;
}

int explain_print(run *r) {
    if (!r->explaining) return 0;
    r->explaining = false;
    ampc_explain_row *rows;
    int n = ampc_explain_end(&rows);
    if (n < 0) return fail_lib("--explain");
    printf("explain: the first training step's %d ops, %s (policies from the op table)\n", n,
           r->use_amp ? (r->amp_dtype == AMPC_BF16 ? "under bf16 autocast" : "under fp16 autocast") : "without autocast");
    printf("  %4s  %-8s  %-18s  %-28s  %-15s  %-30s  %-6s  %s\n", "#", "pass", "module", "op", "policy", "inputs given -> run",
           "output", "cast bytes");
    int64_t cast = 0, fwd = 0;
    for (int k = 0; k < n; k++) {
        const ampc_explain_row *x = &rows[k];
        char a[96], b[96], io[200], c[32];
        if (x->backward) snprintf(io, sizeof io, "%s", dtypes(x->in_dtype, x->n_in, a, sizeof a));
        else snprintf(io, sizeof io, "%s -> %s", dtypes(x->in_dtype, x->n_in, a, sizeof a), dtypes(x->run_dtype, x->n_in, b, sizeof b));
        printf("  %4d  %-8s  %-18s  %-28s  %-15s  %-30s  %-6s  %s\n", k + 1, x->backward ? "backward" : "forward",
               *x->module ? x->module : "(model)", x->op, x->policy == AMPC_POLICY_UNSET ? "-" : ampc_policy_name(x->policy), io,
               x->out_dtype == AMPC_DTYPE_COUNT ? "-" : ampc_dtype_name(x->out_dtype), x->cast_bytes ? fmt_count(x->cast_bytes, c, sizeof c) : "0");
        cast += x->cast_bytes;
        fwd += !x->backward;
    }
    char c1[32];
    printf("  %" PRId64 " forward and %" PRId64 " backward ops; autocast wrote %s for casts in this step (not counted: the "
           "16-bit weight copies kept across steps, which the optimizer's pass rewrites)\n", fwd, (int64_t)n - fwd, fmt_bytes((double)cast, c1, sizeof c1));
    fflush(stdout);
    free(rows);
    return 0;
}
