/*
 * testutil.c - shared test helpers.
 */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

double tu_uniform(uint64_t *s, double lo, double hi) {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    uint64_t r = *s * 0x2545F4914F6CDD1Dull;
    return lo + (hi - lo) * (double)(r >> 11) * 0x1p-53;
}

void tu_fill_uniform(double *x, size_t n, uint64_t seed, double lo, double hi) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) x[i] = tu_uniform(&s, lo, hi);
}

double tu_eps(ampc_dtype dt) {
    switch (dt) {
    case AMPC_F32: return 0x1p-24;
    case AMPC_F16: return 0x1p-11;
    case AMPC_BF16: return 0x1p-8;
    default: return 0x1p-53;
    }
}

void tu_assert_close(const char *what, const double *got, const double *ref, size_t n, double atol, double rtol) {
    size_t worst = 0;
    double worst_excess = -1;
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(ref[i]) || isnan(got[i])) {
            if (isnan(ref[i]) != isnan(got[i])) { bad++; worst = i; worst_excess = INFINITY; }
            continue;
        }
        if (isinf(ref[i]) || isinf(got[i])) {
            if (got[i] != ref[i]) { bad++; worst = i; worst_excess = INFINITY; }
            continue;
        }
        double err = fabs(got[i] - ref[i]), tol = atol + rtol * fabs(ref[i]);
        if (err > tol) {
            bad++;
            if (err - tol > worst_excess) { worst_excess = err - tol; worst = i; }
        }
    }
    if (bad)
        fail_msg("%s: %zu of %zu values out of tolerance; worst [%zu] got %.9g ref %.9g (atol %.3g rtol %.3g)", what, bad,
                 n, worst, got[worst], ref[worst], atol, rtol);
}

double *tu_values(const ampc_tensor *t) {
    size_t n = (size_t)ampc_tensor_numel(t);
    double *v = malloc((n ? n : 1) * sizeof *v);
    if (!v || ampc_tensor_to_f64(t, v, n) < 0) fail_msg("tu_values: %s", ampc_last_error());
    return v;
}

int tu_group_setup(void **state) {
    (void)state;
    ampc_init();
    ampc_manual_seed(1234);
    return 0;
}

int tu_group_teardown(void **state) {
    (void)state;
    ampc_shutdown();
    return 0;
}
