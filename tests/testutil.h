/*
 * testutil.h - shared test helpers: cmocka, deterministic random data, derived tolerances.
 */
#ifndef AMPC_TESTUTIL_H
#define AMPC_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
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

/* v rounded to dt as the library's conversions round it (ampc_f32_to_f16/bf16, through f32);
   f64 and the integer dtypes: v as it is. */
double tu_round_to(ampc_dtype dt, double v);
/* Whether a oneDNN implementation name ("brgconv:avx512_core_amx_bf16", "jit:avx512_core_bf16")
   runs on bf16 arithmetic: AVX512-BF16 or AMX, whichever the CPU has (never assert one of them). */
bool tu_impl_bf16_native(const char *impl);

/* Asserts |got - ref| <= atol + rtol*|ref| elementwise (NaN must match NaN); names the worst. */
void tu_assert_close(const char *what, const double *got, const double *ref, size_t n, double atol, double rtol);

/* Asserts t (any pointer result) is NULL with the given status and a message containing fragment (if not NULL);
   clears the error. */
void tu_expect_error(const void *t, int status, const char *fragment);

/* Tensor contents as a malloc'd f64 array (caller frees). */
double *tu_values(const ampc_tensor *t);

/* cmocka group setup/teardown: init, seed, scope; shutdown. */
/* tests/fixtures/<name> (a file or folder, located from this source file's path) as a path in a
   static buffer; tu_open_fixture opens a file of it for reading or fails the test naming it. */
const char *tu_fixture(const char *name);
FILE *tu_open_fixture(const char *name);
/* The fixture's next section, which must be `name` followed by its count n, then n values as C99
   hex floats (the make_*.py scripts' float.hex); malloc'd, or the test fails. */
double *tu_read_section(FILE *f, const char *name, int64_t n);
/* t's element i (row-major) becomes amp sin(a (i + 1)) (cos with cosine), rounded to t's dtype,
   on t's device: the fixture scripts' formula weights. */
void tu_fill_formula(ampc_tensor *t, double a, double amp, bool cosine);
int tu_group_setup(void **state);
int tu_group_teardown(void **state);

// ---------------------------------------------------------------------------------------------
// Op checks (ggml's test-backend-ops pattern): one description per op case drives
// 1) a finite-difference gradient check of the op on the REF device in f64, and
// 2) for each CPU dtype, forward and backward against REF run on the same (rounded) inputs,
//    within a tolerance derived from the dtype's unit roundoff and the reduction length.

#define TU_MAX_IN 4
typedef struct {
    const char *name;
    int n_inputs;
    int ndim[TU_MAX_IN];
    int64_t shape[TU_MAX_IN][AMPC_MAX_DIMS];
    bool is_label[TU_MAX_IN];   /* int64 labels in [0, n_classes) (no gradient) */
    int64_t n_classes;
    bool no_grad[TU_MAX_IN];    /* float input that does not require grad */
    double lo, hi;              /* input values uniform in [lo, hi) */
    double avoid;               /* and |x| >= avoid (kinks at 0), when > 0 */
    /* runs the op; ctx passes parameters */
    ampc_tensor *(*fn)(ampc_tensor **in, const void *ctx);
    const void *ctx;
    double k;                   /* longest reduction/accumulation length (1 for elementwise) */
    double k_backward;          /* same for the backward pass (0: = k) */
    unsigned skip_dtypes;       /* bit (1 << dtype) skips that CPU dtype */
    bool skip_fd;               /* random ops: no finite differences */
    const char *no_cuda;        /* why CUDA is not checked (the op has no CUDA kernels yet), or NULL */
} tu_op_case;

/* Whether the CUDA device can be used (says once on stdout what runs or why it is skipped). */
bool tu_cuda_available(void);
/* Runs both checks (the second on the CPU and, where a GPU is present, on CUDA); fails the test
   with a message naming op, device, dtype, input and element. */
void tu_check_op(const tu_op_case *c);
/* Only the finite-difference check on REF (returns the max abs error seen). */
double tu_gradcheck_ref(const tu_op_case *c);

#endif /* AMPC_TESTUTIL_H */
