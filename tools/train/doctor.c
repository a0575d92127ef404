/*
 * doctor.c - ampc-train's use of the numerics doctor (--doctor) and of explain (--explain),
 * both from the library (ampc_doctor_*, ampc_explain_*; src/amp/doctor.c).
 */
#include "train.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

void doctor_step_begin(run *r) {
    if (!ampc_doctor_is_enabled()) return;
    ampc_doctor_step_begin(ampc_scaler_is_enabled(r->m.scaler) ? (double)ampc_scaler_get_scale(r->m.scaler) : 1.0);
}

const char *doctor_blame(char *buf, size_t n) {
    buf[0] = '\0';
    if (!ampc_doctor_is_enabled()) return buf;
    ampc_doctor_finding f = ampc_doctor_finding_get();
    if (f.verdict == AMPC_DOCTOR_CLEAN) return buf;
    snprintf(buf, n, "; the first non-finite output: %s in '%s' (%s, %" PRId64 " of %" PRId64 " values), %s%s", f.op,
             f.module && *f.module ? f.module : "(model)", f.backward ? "backward" : "forward", f.nonfinite, f.numel,
             ampc_doctor_verdict_name(f.verdict),
             f.verdict == AMPC_DOCTOR_SCALE_INDUCED ? " (a smaller loss scale fixes it)"
                                                    : " (no loss scale fixes it: try bf16, a lower --lr, or fp32 for that module)");
    return buf;
}

int explain_begin(run *r) {
    if (!yes(r->s, OPT_EXPLAIN) || r->rank > 0) return 0;
    if (ampc_explain_begin() < 0) return fail_lib("--explain");
    r->diag.explaining = true;
    return 0;
}

static const char *dtypes(const ampc_dtype *d, int n, char *buf, size_t cap) {
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < n; i++) appendf(buf, cap, &at, "%s%s", i ? "," : "", d[i] == AMPC_DTYPE_COUNT ? "-" : ampc_dtype_name(d[i]));
    return buf;
}

int explain_print(run *r) {
    if (!r->diag.explaining) return 0;
    r->diag.explaining = false;
    ampc_explain_row *rows;
    int n = ampc_explain_end(&rows);
    if (n < 0) return fail_lib("--explain");
    printf("explain: the first training step's %d ops, %s (policies from the op table)\n", n,
           r->m.use_amp ? (r->m.amp_dtype == AMPC_BF16 ? "under bf16 autocast" : "under fp16 autocast") : "without autocast");
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

// ---------------------------------------------------------------------------------------------
// --numerics-every

int numerics_open(run *r) {
    if (ival(r->s, OPT_NUMERICS_EVERY) <= 0) return 0;
    if (ampc_numerics_begin(r->m.use_amp ? r->m.amp_dtype : AMPC_F16) < 0) return fail_lib("--numerics-every");
    ampc_numerics_pause(true);
    r->diag.numerics = true;
    return 0;
}

void numerics_step_begin(run *r) {
    if (!r->diag.numerics) return;
    bool sample = r->stop.steps_run % ival(r->s, OPT_NUMERICS_EVERY) == 0;
    ampc_numerics_pause(!sample);
    r->diag.numerics_steps += sample;
}

static double share(int64_t k, int64_t n) { return n ? 100.0 * (double)k / (double)n : 0.0; }

int numerics_report(run *r) {
    if (!r->diag.numerics) return 0;
    r->diag.numerics = false;
    ampc_numerics_row *rows;
    int n = ampc_numerics_end(&rows);
    if (n < 0) return fail_lib("--numerics-every");
    int rc = 0;
    if (r->rank == 0 && n > 0) {
        const char *t = r->m.use_amp && r->m.amp_dtype == AMPC_BF16 ? "bf16" : "fp16";
        /* the table: the rows losing most (flushed + subnormal + saturated), at most 15 */
        int *order = malloc((size_t)n * sizeof *order);
        if (!order) {
            free(rows);
            return fail("out of memory");
        }
        for (int i = 0; i < n; i++) order[i] = i;
        for (int i = 1; i < n; i++)   /* insertion sort by loss share, stable */
            for (int j = i; j > 0; j--) {
                const ampc_numerics_row *a = &rows[order[j - 1]], *b = &rows[order[j]];
                double la = share(a->flushed + a->subnormal + a->saturated, a->values), lb = share(b->flushed + b->subnormal + b->saturated, b->values);
                if (lb <= la) break;
                int tmp = order[j];
                order[j] = order[j - 1];
                order[j - 1] = tmp;
            }
        printf("numerics: %" PRId64 " sampled step(s), %d ops; what %s would lose, the ops losing most first (all in numerics.csv):\n",
               r->diag.numerics_steps, n, t);
        printf("  %-8s  %-20s  %-28s  %11s  %8s  %10s  %9s  %8s\n", "pass", "module", "op", "amax", "flushed", "subnormal", "saturated",
               "zeros");
        for (int k = 0; k < n && k < 15; k++) {
            const ampc_numerics_row *x = &rows[order[k]];
            printf("  %-8s  %-20s  %-28s  %11.4g  %7.2f%%  %9.2f%%  %8.2f%%  %7.2f%%\n", x->backward ? "backward" : "forward",
                   *x->module ? x->module : "(model)", x->op, x->amax, share(x->flushed, x->values), share(x->subnormal, x->values),
                   share(x->saturated, x->values), share(x->zeros, x->values));
        }
        free(order);
        char *path = path_join(r->out.dir, "numerics.csv");
        FILE *f = path ? ampc_output_fopen(path, "numerics.csv", "w") : NULL;   /* a FIFO or a link there: refused */
        if (!path) rc = -1;
        else if (!f) rc = fail_lib("--numerics-every");
        else {
            fprintf(f, "pass,module,op,outputs,values,amax,flushed,subnormal,saturated,zeros,nonfinite\n");
            for (int i = 0; i < n; i++) {
                const ampc_numerics_row *x = &rows[i];
                fprintf(f, "%s,%s,%s,%" PRId64 ",%" PRId64 ",%.9g,%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 "\n",
                        x->backward ? "backward" : "forward", x->module, x->op, x->outputs, x->values, x->amax, x->flushed, x->subnormal,
                        x->saturated, x->zeros, x->nonfinite);
            }
            if (fclose(f) != 0) rc = fail("numerics.csv: write failed");
        }
        free(path);
        fflush(stdout);
    }
    free(rows);
    return rc;
}
