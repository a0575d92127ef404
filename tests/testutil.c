/*
 * testutil.c - shared test helpers.
 */
#include "testutil.h"

#include <libgen.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

double tu_round_to(ampc_dtype dt, double v) {
    switch (dt) {
    case AMPC_F32: return (float)v;
    case AMPC_F16: return ampc_f16_to_f32(ampc_f32_to_f16((float)v));
    case AMPC_BF16: return ampc_bf16_to_f32(ampc_f32_to_bf16((float)v));
    default: return v;
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

void tu_expect_error(const void *t, int status, const char *fragment) {
    assert_null(t);
    assert_int_equal(ampc_last_status(), status);
    if (fragment && !strstr(ampc_last_error(), fragment))
        fail_msg("error message \"%s\" does not mention \"%s\"", ampc_last_error(), fragment);
    ampc_clear_error();
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

// ---------------------------------------------------------------------------------------------
// Op checks

#include <string.h>

static const ampc_dtype cpu_dtypes[] = {AMPC_F32, AMPC_F16, AMPC_BF16};

/* Input data of case c, deterministic from the case name. */
static double *make_input(const tu_op_case *c, int i, int64_t *n_out) {
    int64_t n = 1;
    for (int d = 0; d < c->ndim[i]; d++) n *= c->shape[i][d];
    double *x = malloc((size_t)(n ? n : 1) * sizeof *x);
    uint64_t seed = 1469598103934665603ull;
    for (const char *p = c->name; *p; p++) seed = (seed ^ (uint64_t)*p) * 1099511628211ull;
    seed += (uint64_t)i * 7919;
    if (c->is_label[i]) {
        tu_fill_uniform(x, (size_t)n, seed, 0, (double)c->n_classes);
        for (int64_t j = 0; j < n; j++) x[j] = floor(x[j]);
    } else {
        tu_fill_uniform(x, (size_t)n, seed, c->lo, c->hi);
        for (int64_t j = 0; j < n && c->avoid > 0; j++)
            if (fabs(x[j]) < c->avoid) x[j] = x[j] < 0 ? x[j] - c->avoid : x[j] + c->avoid;
    }
    *n_out = n;
    return x;
}

static ampc_tensor *make_tensor(const tu_op_case *c, int i, const double *x, int64_t n, ampc_dtype dt) {
    ampc_tensor *t;
    if (c->is_label[i]) {
        int64_t *lab = malloc((size_t)(n ? n : 1) * sizeof *lab);
        for (int64_t j = 0; j < n; j++) lab[j] = (int64_t)x[j];
        t = ampc_tensor_from_i64(c->ndim[i], c->shape[i], lab);
        free(lab);
    } else {
        t = ampc_tensor_from_f64(dt, c->ndim[i], c->shape[i], x);
        if (t && !c->no_grad[i]) ampc_tensor_set_requires_grad(t, true);
    }
    if (!t) fail_msg("%s: input %d: %s", c->name, i, ampc_last_error());
    return t;
}

/* Rounds x in place to dtype dt (through the library's conversion). */
static void round_to(double *x, int64_t n, ampc_dtype dt) {
    if (dt == AMPC_F64) return;
    uint16_t h;
    float f;
    for (int64_t j = 0; j < n; j++) {
        f = (float)x[j];
        if (dt == AMPC_F16) { h = ampc_f32_to_f16(f); f = ampc_f16_to_f32(h); }
        if (dt == AMPC_BF16) { h = ampc_f32_to_bf16(f); f = ampc_bf16_to_f32(h); }
        x[j] = f;
    }
}

typedef struct {
    double *out, *gy, *grad[TU_MAX_IN];
    int64_t n_out;
    int out_ndim;
    int64_t out_shape[AMPC_MAX_DIMS];
} run_result;

static void free_result(run_result *r) {
    free(r->out);
    free(r->gy);
    for (int i = 0; i < TU_MAX_IN; i++) free(r->grad[i]);
}

/* Runs the op on device dev with inputs in dtype dt; upstream gradient gy (if given: reused,
   else drawn and rounded to the output's dtype). */
static run_result run_case(const tu_op_case *c, double **xs, int64_t *ns, ampc_device dev, ampc_dtype dt,
                           const double *gy_in, bool backward) {
    run_result r = {0};
    ampc_set_default_device(dev);
    ampc_scope_begin();
    ampc_tensor *in[TU_MAX_IN] = {0};
    for (int i = 0; i < c->n_inputs; i++) in[i] = make_tensor(c, i, xs[i], ns[i], dt);
    ampc_tensor *out = c->fn(in, c->ctx);
    if (!out) fail_msg("%s on %s/%s: %s", c->name, ampc_device_name(dev), ampc_dtype_name(dt), ampc_last_error());
    r.n_out = ampc_tensor_numel(out);
    r.out_ndim = ampc_tensor_ndim(out);
    memcpy(r.out_shape, ampc_tensor_shape(out), sizeof(int64_t) * (size_t)r.out_ndim);
    r.out = tu_values(out);
    r.gy = malloc((size_t)(r.n_out ? r.n_out : 1) * sizeof(double));
    if (gy_in) {
        memcpy(r.gy, gy_in, (size_t)r.n_out * sizeof(double));
    } else {
        tu_fill_uniform(r.gy, (size_t)r.n_out, 99, -1, 1);
    }
    if (backward && ampc_tensor_requires_grad(out)) {
        ampc_dtype odt = ampc_tensor_dtype(out);
        round_to(r.gy, r.n_out, odt);
        ampc_tensor *g = ampc_tensor_from_f64(odt, r.out_ndim, r.out_shape, r.gy);
        if (ampc_backward_with_grad(out, g) < 0)
            fail_msg("%s backward on %s/%s: %s", c->name, ampc_device_name(dev), ampc_dtype_name(dt), ampc_last_error());
        for (int i = 0; i < c->n_inputs; i++) {
            if (c->is_label[i] || c->no_grad[i]) continue;
            ampc_tensor *gi = ampc_tensor_grad(in[i]);
            if (!gi) fail_msg("%s on %s/%s: input %d got no gradient", c->name, ampc_device_name(dev), ampc_dtype_name(dt), i);
            r.grad[i] = tu_values(gi);
        }
    }
    ampc_scope_end();
    ampc_set_default_device(AMPC_DEVICE_CPU);
    return r;
}

/* sum(out * gy) of the op on REF in f64, without recording. */
static double ref_objective(const tu_op_case *c, double **xs, int64_t *ns, const double *gy) {
    ampc_set_default_device(AMPC_DEVICE_REF);
    ampc_no_grad_enter();
    ampc_scope_begin();
    ampc_tensor *in[TU_MAX_IN] = {0};
    for (int i = 0; i < c->n_inputs; i++) in[i] = make_tensor(c, i, xs[i], ns[i], AMPC_F64);
    ampc_tensor *out = c->fn(in, c->ctx);
    if (!out) fail_msg("%s on ref: %s", c->name, ampc_last_error());
    double *v = tu_values(out), L = 0;
    for (int64_t j = 0; j < ampc_tensor_numel(out); j++) L += v[j] * gy[j];
    free(v);
    ampc_scope_end();
    ampc_no_grad_exit();
    ampc_set_default_device(AMPC_DEVICE_CPU);
    return L;
}

double tu_gradcheck_ref(const tu_op_case *c) {
    double *xs[TU_MAX_IN] = {0};
    int64_t ns[TU_MAX_IN] = {0};
    for (int i = 0; i < c->n_inputs; i++) xs[i] = make_input(c, i, &ns[i]);
    run_result r = run_case(c, xs, ns, AMPC_DEVICE_REF, AMPC_F64, NULL, true);
    double worst = 0;
    for (int i = 0; i < c->n_inputs; i++) {
        if (c->is_label[i] || c->no_grad[i]) continue;
        for (int64_t j = 0; j < ns[i]; j++) {
            double x0 = xs[i][j], h = 1e-6 * (fabs(x0) > 1 ? fabs(x0) : 1);
            xs[i][j] = x0 + h;
            double lp = ref_objective(c, xs, ns, r.gy);
            xs[i][j] = x0 - h;
            double lm = ref_objective(c, xs, ns, r.gy);
            xs[i][j] = x0;
            double fd = (lp - lm) / (2 * h), an = r.grad[i][j], err = fabs(fd - an);
            /* central differences: truncation O(h^2), cancellation ~ 2^-53 |L| / h */
            double tol = 1e-6 * (1 + fabs(an)) + 1e-14 * (fabs(lp) + fabs(lm)) / h;
            if (err > tol)
                fail_msg("%s: gradient of input %d element %lld: analytic %.12g, finite difference %.12g", c->name, i,
                         (long long)j, an, fd);
            if (err > worst) worst = err;
        }
    }
    free_result(&r);
    for (int i = 0; i < c->n_inputs; i++) free(xs[i]);
    return worst;
}

static double mean_abs(const double *v, int64_t n) {
    double s = 0;
    for (int64_t j = 0; j < n; j++) s += isfinite(v[j]) ? fabs(v[j]) : 0;
    return n ? s / (double)n : 0;
}

bool tu_cuda_available(void) {
    static int state = -1;   /* -1: not asked yet */
    if (state < 0) {
        state = ampc_device_available(AMPC_DEVICE_CUDA);
        if (!state) printf("[  NOTE    ] CUDA op checks skipped: %s\n", ampc_device_unavailable_reason(AMPC_DEVICE_CUDA));
        else printf("[  NOTE    ] op checks run on CUDA too\n");
    }
    return state;
}

void tu_check_op(const tu_op_case *c) {
    if (!c->skip_fd) tu_gradcheck_ref(c);
    /* each float dtype on the CPU, then on CUDA where a GPU is present */
    size_t ndt = sizeof cpu_dtypes / sizeof *cpu_dtypes;
    for (size_t d = 0; d < 2 * ndt; d++) {
        ampc_device dev = d < ndt ? AMPC_DEVICE_CPU : AMPC_DEVICE_CUDA;
        ampc_dtype dt = cpu_dtypes[d % ndt];
        if (c->skip_dtypes & (1u << dt)) continue;
        if (dev == AMPC_DEVICE_CUDA && (c->no_cuda || !tu_cuda_available())) break;
        double *xs[TU_MAX_IN] = {0};
        int64_t ns[TU_MAX_IN] = {0};
        for (int i = 0; i < c->n_inputs; i++) {
            xs[i] = make_input(c, i, &ns[i]);
            if (!c->is_label[i]) round_to(xs[i], ns[i], dt);
        }
        run_result got = run_case(c, xs, ns, dev, dt, NULL, true);
        run_result ref = run_case(c, xs, ns, AMPC_DEVICE_REF, AMPC_F64, got.gy, true);
        char what[160];
        const char *dn = ampc_device_name(dev);
        if (got.out_ndim != ref.out_ndim || memcmp(got.out_shape, ref.out_shape, sizeof(int64_t) * (size_t)got.out_ndim))
            fail_msg("%s/%s/%s: output shape differs from ref (%d vs %d dims, %lld vs %lld elements)", c->name, dn,
                     ampc_dtype_name(dt), got.out_ndim, ref.out_ndim, (long long)got.n_out, (long long)ref.n_out);
        /* inputs are exact in dt; the output is rounded once to dt (or computed in f32 and
           rounded) after a k-term f32 accumulation: error <= (2 + k * 2^-24 / eps) eps |ref| */
        double eps = tu_eps(dt), tol = (2.0 + c->k * 0x1p-24 / eps) * eps * 2;
        double scale = mean_abs(ref.out, ref.n_out);
        snprintf(what, sizeof what, "%s/%s/%s forward", c->name, dn, ampc_dtype_name(dt));
        tu_assert_close(what, got.out, ref.out, (size_t)ref.n_out, tol * scale, tol);
        /* backward: intermediate values (y, gy) stored in dt add a few more roundings */
        double kb = c->k_backward > 0 ? c->k_backward : c->k;
        double tolb = (4.0 + kb * 0x1p-24 / eps) * eps * 2;
        for (int i = 0; i < c->n_inputs; i++) {
            if (!ref.grad[i]) continue;
            snprintf(what, sizeof what, "%s/%s/%s gradient of input %d", c->name, dn, ampc_dtype_name(dt), i);
            tu_assert_close(what, got.grad[i], ref.grad[i], (size_t)ns[i], tolb * mean_abs(ref.grad[i], ns[i]), tolb);
        }
        free_result(&got);
        free_result(&ref);
        for (int i = 0; i < c->n_inputs; i++) free(xs[i]);
    }
}

const char *tu_fixture(const char *name) {
    static char path[1024];
    char src[512];
    snprintf(src, sizeof src, "%s", __FILE__);
    snprintf(path, sizeof path, "%s/fixtures/%s", dirname(src), name);
    return path;
}

FILE *tu_open_fixture(const char *name) {
    const char *path = tu_fixture(name);
    FILE *f = fopen(path, "r");
    if (!f) fail_msg("can't open %s", path);
    return f;
}

double *tu_read_section(FILE *f, const char *name, int64_t n) {
    char got[128];
    long long cnt;
    if (fscanf(f, "%127s %lld", got, &cnt) != 2 || strcmp(got, name) || cnt != n)
        fail_msg("fixture: expected section %s of %lld values", name, (long long)n);
    double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    for (int64_t i = 0; i < n; i++)
        if (fscanf(f, "%la", &v[i]) != 1) fail_msg("fixture: section %s ends early", name);
    return v;
}

void tu_fill_formula(ampc_tensor *t, double a, double amp, bool cosine) {
    int64_t n = ampc_tensor_numel(t);
    double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    for (int64_t i = 0; i < n; i++) v[i] = amp * (cosine ? cos(a * (double)(i + 1)) : sin(a * (double)(i + 1)));
    ampc_scope_begin();
    ampc_device prev = ampc_default_device();
    ampc_set_default_device(ampc_tensor_device(t));
    ampc_tensor *src = ampc_tensor_from_f64(ampc_tensor_dtype(t), ampc_tensor_ndim(t), ampc_tensor_shape(t), v);
    ampc_set_default_device(prev);
    if (!src) fail_msg("tu_fill_formula: %s", ampc_last_error());
    ampc_no_grad_enter();   /* t may be a parameter */
    int rc = ampc_tensor_copy_(t, src);
    ampc_no_grad_exit();
    if (rc < 0) fail_msg("tu_fill_formula: %s", ampc_last_error());
    ampc_scope_end();
    free(v);
}

bool tu_impl_bf16_native(const char *impl) { return strstr(impl, "avx512_core_bf16") || strstr(impl, "avx512_core_amx"); }
