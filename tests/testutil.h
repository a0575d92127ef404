/*
 * testutil.h - shared test helpers: cmocka, deterministic random data, derived tolerances.
 */
#ifndef AMPC_TESTUTIL_H
#define AMPC_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "ampc.h"

#define ASSERT_OK(expr)                                                                            \
    do {                                                                                           \
        int rc_ = (expr);                                                                          \
        if (rc_ < 0) fail_msg("%s -> %d: %s", #expr, rc_, ampc_last_error());                      \
    } while (0)
#define ASSERT_NOT_NULL_MSG(p)                                                                     \
    do {                                                                                           \
        if (!(p)) fail_msg("%s is NULL: %s", #p, ampc_last_error());                               \
    } while (0)

/* xorshift64*: test data independent of the library's generator */
double tu_uniform(uint64_t *state, double lo, double hi);
void tu_fill_uniform(double *x, size_t n, uint64_t seed, double lo, double hi);

/* Unit roundoff of a dtype (2^-24, 2^-11, 2^-8, 2^-53). */
double tu_eps(ampc_dtype dt);

/* Asserts |got - ref| <= atol + rtol*|ref| elementwise (NaN must match NaN); names the worst. */
void tu_assert_close(const char *what, const double *got, const double *ref, size_t n, double atol, double rtol);

/* Tensor contents as a malloc'd f64 array (caller frees). */
double *tu_values(const ampc_tensor *t);

/* cmocka group setup/teardown: init, seed, scope; shutdown. */
int tu_group_setup(void **state);
int tu_group_teardown(void **state);

#endif
