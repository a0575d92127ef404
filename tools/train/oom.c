/*
 * oom.c - after running out of memory in training under --max-memory: what took the memory
 * (weights, gradients, optimizer state, autocast's weight copies, each sample's activations,
 * measured) and the largest batch that fits, as the advice the error line ends with.
 */
#include "train.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>

/* Bytes above the fixed state (weights, optimizer state, weight casts) at the peak of one forward
   and backward pass of a batch of b zero images, with the run's autocast setting. */
static double probe_step_bytes(run *r, int64_t b, double grad_bytes) {
    ampc_optimizer_zero_grad(r->m.opt);
    ampc_memory_stats_t m0 = ampc_memory_stats();
    double fixed = (double)(m0.current[AMPC_MEM_PARAMETERS] + m0.current[AMPC_MEM_OPTIMIZER] + m0.current[AMPC_MEM_CASTS]);
    ampc_memory_reset_peak();
    ampc_scope_begin();
    ampc_tensor *x, *y;
    ampc_autocast_enter(r->m.amp_dtype, r->m.use_amp);
    ampc_tensor *loss = zero_batch(r, b, &x, &y) == 0 ? model_loss(r, x, y, NULL, NULL) : NULL;
    ampc_autocast_exit();
    int rc = loss ? ampc_backward(loss) : -1;
    ampc_scope_end();
    ampc_memory_stats_t m1 = ampc_memory_stats();
    ampc_optimizer_zero_grad(r->m.opt);
    /* the casts a forward pass makes are fixed state too (kept across steps) */
    fixed += (double)(m1.current[AMPC_MEM_CASTS] - m0.current[AMPC_MEM_CASTS]);
    return rc < 0 ? -1 : (double)m1.peak_total - fixed - grad_bytes;
}

/* After an out-of-memory error in training under a limit: measure a step's activations at two
   batch sizes (limit lifted for the probe; the run is over anyway), then name the fixed state and
   the largest batch that fits. */
void oom_advice(run *r, double limit) {
    static char advice[1024];   /* g_oom_hint points here once measured */
    const char *optname = sval(r->s, OPT_OPTIMIZER);
    /* fp32 master weights, all of them (frozen ones too); gradients and optimizer state for the
       trainable ones only (--freeze) */
    double W = 4.0 * (double)ampc_module_num_parameters(r->m.net, false), P = 4.0 * (double)ampc_module_num_parameters(r->m.net, true);
    double opt = strcmp(optname, "sgd") == 0 ? (rval(r->s, OPT_MOMENTUM) > 0 ? P : 0) : 2 * P;
    ampc_memory_set_limit((size_t)r->m.host_limit);   /* the probes may go past the limit, not past the machine */
    double cast0 = (double)ampc_memory_stats().current[AMPC_MEM_CASTS];
    double t2 = probe_step_bytes(r, 2, P), t4 = probe_step_bytes(r, 4, P);
    double casts = (double)ampc_memory_stats().current[AMPC_MEM_CASTS];
    if (casts < cast0) casts = cast0;
    ampc_memory_set_limit((size_t)limit);
    if (t2 < 0 || t4 <= t2) return;   /* no measurement: keep the plain hint */
    double per = (t4 - t2) / 2, fixed = W + P + opt + casts, room = limit - fixed;
    /* the linear estimate from batches 2 and 4 is only a start: allocator rounding and kernels'
       workspaces grow unevenly (a ResNet-50 needed 12% more per sample at 80 than at 4), so probe
       the candidate and narrow down between the largest batch that fitted and the smallest that
       did not, along the line through the last two probes */
    int64_t good = t4 <= room ? 4 : t2 <= room ? 2 : 0, bad = INT64_MAX;
    int64_t pb = 4, fit = good;
    double pt = t4;
    int64_t cand = per > 0 && room > pt ? pb + (int64_t)floor((room - pt) / per) : 0;
    if (good >= 4) fprintf(stderr, PROG ": out of memory: measuring the largest batch that fits --max-memory ...\n");
    for (int probes = 0; good >= 4 && probes < 5 && cand > good && cand < bad; probes++) {
        ampc_memory_set_limit((size_t)r->m.host_limit);
        double t = probe_step_bytes(r, cand, P);
        ampc_memory_set_limit((size_t)limit);
        if (t < 0) break;
        if (t <= room) good = cand;
        else bad = cand;
        double slope = (t - pt) / (double)(cand - pb);
        pb = cand;
        pt = t;
        if (bad - good <= 1 + good / 64) break;   /* within 1.5% */
        int64_t next = slope > 0 ? pb + (int64_t)floor((room - pt) / slope) : good + 1;
        cand = next <= good ? good + 1 : next >= bad ? bad - 1 : next;
    }
    fit = good;
    char a[32], b[32], c[32], d[32], e[32], f[32];
    int n = snprintf(advice, sizeof advice,
                     "of --max-memory %s, the weights take %s, %s gradients %s, %s's state %s%s%s, and each sample about %s of "
                     "activations (measured)",
                     fmt_bytes(limit, a, sizeof a), fmt_bytes(W, b, sizeof b), P < W ? "the trainable ones'" : "their",
                     fmt_bytes(P, c, sizeof c), optname,
                     fmt_bytes(opt, d, sizeof d), casts > 0 ? ", autocast's weight copies " : "", casts > 0 ? fmt_bytes(casts, e, sizeof e) : "",
                     fmt_bytes(per, f, sizeof f));
    if (n < 0 || (size_t)n >= sizeof advice) return;
    if (fit >= 1)
        snprintf(advice + n, sizeof advice - (size_t)n, ": the largest batch that fits is %" PRId64 " (--batch-size %" PRId64 ", measured)%s",
                 fit, fit, r->m.use_amp ? "" : ", or more with --use-amp yes (16-bit activations)");
    else
        snprintf(advice + n, sizeof advice - (size_t)n, ": not even a batch of 1 fits; %s",
                 opt >= P && opt > 0 ? "the optimizer's state is the largest part: try --optimizer sgd --momentum 0 (no state), or raise --max-memory"
                                     : "raise --max-memory or choose a smaller --model");
    g_oom_hint = advice;
}
