/*
 * doctor.c - the numerics doctor and --explain: one observer of the op trace (core/trace.c)
 * serves both.
 *
 * Explain records a row per op: its policy (the op table's, for the autocast dtype in force),
 * the dtypes the caller gave and the kernel read, the output's, and the bytes autocast wrote to
 * cast its inputs (each cast counted once: a weight cast the region reuses, or a copy kept across
 * steps (AMPC_MEM_CASTS), writes nothing new).
 *
 * The doctor counts NaN/inf in each op's outputs until the first find of a step, and classifies
 * it: in the forward no loss scale is involved, so it is intrinsic; in the backward every value
 * is the loss scale times the true one, so an inf an op makes from a finite incoming gradient at
 * a scale above 1 is scale-induced (a smaller scale fixes it), while one at scale <= 1, or a NaN
 * from finite inputs (0/0, inf - inf inside the op), is intrinsic.
 */
#include "amp/amp.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static struct {
    bool on;
    ampc_explain_row *rows;
    int n, cap;
    const void **seen;   /* storages of casts already counted */
    int n_seen, cap_seen;
    bool oom;
} ex;

static struct {
    bool on;
    double scale;
    ampc_doctor_finding found;
} doc;

static void observe(const ampc__trace_event *e, void *ctx);

static struct {
    bool on, paused;
    ampc_dtype target;
    ampc_numerics_row *rows;
    int n, cap;
    bool oom;
} nm;

static void update_hook(void) { ampc__trace_set(ex.on || doc.on || (nm.on && !nm.paused) ? observe : NULL, NULL); }

// ---------------------------------------------------------------------------------------------
// Explain

/* p (an array of n elements of `size` bytes, *cap of them allocated) with room for one more:
   p itself, or grown (doubled, from 64); NULL when out of memory (p is then unchanged). */
static void *room_for_one(void *p, int n, int *cap, size_t size) {
    if (n < *cap) return p;
    int nc = *cap ? 2 * *cap : 64;
    void *np = realloc(p, (size_t)nc * size);
    if (np) *cap = nc;
    return np;
}

static bool seen_before(const void *storage) {
    for (int i = 0; i < ex.n_seen; i++)
        if (ex.seen[i] == storage) return true;
    const void **ns = room_for_one(ex.seen, ex.n_seen, &ex.cap_seen, sizeof *ns);
    if (!ns) return (ex.oom = true);
    ex.seen = ns;
    ex.seen[ex.n_seen++] = storage;
    return false;
}

static void explain_row(const ampc__trace_event *e) {
    ampc_explain_row *nr = room_for_one(ex.rows, ex.n, &ex.cap, sizeof *nr);
    if (!nr) {
        ex.oom = true;
        return;
    }
    ex.rows = nr;
    ampc_explain_row *r = &ex.rows[ex.n++];
    memset(r, 0, sizeof *r);
    r->backward = e->backward;
    r->module = ampc__trace_intern(e->module);
    r->op = e->name;
    r->policy = !e->backward && ampc_autocast_is_enabled() ? ampc__autocast_policy((ampc_op)e->op, ampc_autocast_dtype()) : AMPC_POLICY_UNSET;
    r->n_in = e->n_in < 8 ? e->n_in : 8;
    for (int i = 0; i < 8; i++) r->in_dtype[i] = r->run_dtype[i] = AMPC_DTYPE_COUNT;
    for (int i = 0; i < r->n_in; i++) {
        const ampc_tensor *src = e->backward ? e->in[i] : e->src[i], *in = e->in[i];
        if (src) r->in_dtype[i] = src->dtype;
        if (in) r->run_dtype[i] = in->dtype;
        if (!e->backward && src && in && src->dtype != in->dtype && in->storage->kind != AMPC_MEM_CASTS &&
            !seen_before(in->storage))
            r->cast_bytes += (int64_t)in->numel * (int64_t)ampc__dt(in->dtype)->size;
    }
    r->out_dtype = AMPC_DTYPE_COUNT;
    for (int i = 0; i < e->n_out; i++)
        if (e->out[i]) {
            r->out_dtype = e->out[i]->dtype;
            break;
        }
}

int ampc_explain_begin(void) {
    pthread_mutex_lock(&lock);
    int rc = AMPC_OK;
    if (ex.on) rc = ampc__err(AMPC_ERR_STATE, "explain_begin: already recording");
    else {
        ex.on = true;
        ex.n = ex.n_seen = 0;
        ex.oom = false;
        update_hook();
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

int ampc_explain_end(ampc_explain_row **rows) {
    if (!rows) return ampc__err(AMPC_ERR_INVALID, "explain_end: NULL rows");
    *rows = NULL;
    pthread_mutex_lock(&lock);
    int rc;
    if (!ex.on) rc = ampc__err(AMPC_ERR_STATE, "explain_end without explain_begin");
    else if (ex.oom) rc = ampc__err(AMPC_ERR_OOM, "explain: out of memory while recording");
    else {
        rc = ex.n;
        *rows = ex.rows;
        ex.rows = NULL;
        ex.cap = 0;
    }
    ex.on = false;
    free(ex.rows);
    ex.rows = NULL;
    ex.cap = ex.n = 0;
    free(ex.seen);
    ex.seen = NULL;
    ex.cap_seen = ex.n_seen = 0;
    update_hook();
    pthread_mutex_unlock(&lock);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Doctor

static void doctor_check(const ampc__trace_event *e) {
    if (doc.found.verdict != AMPC_DOCTOR_CLEAN) return;   /* the first find of the step only */
    for (int i = 0; i < e->n_out; i++) {
        const ampc_tensor *t = e->out[i];
        if (!t || !ampc__dt(t->dtype)->is_float) continue;
        int64_t bad = ampc_tensor_count_nonfinite(t);
        if (bad <= 0) continue;
        ampc_doctor_verdict v = AMPC_DOCTOR_INTRINSIC;
        if (e->backward && doc.scale > 1) {
            const ampc_tensor *gy = e->in[0];
            bool finite_in = gy && ampc_tensor_count_nonfinite(gy) == 0;
            bool has_inf = false;   /* an overflow, not a NaN from finite values */
            if (finite_in) {
                int64_t n = t->numel;
                double *v64 = malloc((size_t)(n ? n : 1) * sizeof *v64);
                if (v64 && ampc_tensor_to_f64(t, v64, (size_t)n) >= 0)
                    for (int64_t k = 0; k < n && !has_inf; k++) has_inf = isinf(v64[k]);
                free(v64);
            }
            if (finite_in && has_inf) v = AMPC_DOCTOR_SCALE_INDUCED;
        }
        doc.found = (ampc_doctor_finding){.verdict = v, .backward = e->backward, .module = ampc__trace_intern(e->module),
                                          .op = e->name, .nonfinite = bad, .numel = t->numel, .scale = doc.scale};
        return;
    }
}

void ampc_doctor_enable(bool on) {
    pthread_mutex_lock(&lock);
    doc.on = on;
    update_hook();
    pthread_mutex_unlock(&lock);
}

bool ampc_doctor_is_enabled(void) { return doc.on; }

void ampc_doctor_step_begin(double scale) {
    pthread_mutex_lock(&lock);
    doc.scale = scale;
    doc.found = (ampc_doctor_finding){.verdict = AMPC_DOCTOR_CLEAN, .scale = scale};
    pthread_mutex_unlock(&lock);
}

ampc_doctor_finding ampc_doctor_finding_get(void) {
    pthread_mutex_lock(&lock);
    ampc_doctor_finding f = doc.found;
    pthread_mutex_unlock(&lock);
    return f;
}

const char *ampc_doctor_verdict_name(ampc_doctor_verdict v) {
    switch (v) {
    case AMPC_DOCTOR_CLEAN: return "clean";
    case AMPC_DOCTOR_SCALE_INDUCED: return "scale-induced";
    case AMPC_DOCTOR_INTRINSIC: return "intrinsic";
    }
    return "?";
}

// ---------------------------------------------------------------------------------------------
// Numerics statistics

static ampc_numerics_row *nm_row(const char *module, const char *op, bool backward) {
    for (int i = nm.n - 1; i >= 0; i--)   /* interned module strings: compare pointers */
        if (nm.rows[i].module == module && nm.rows[i].backward == backward && !strcmp(nm.rows[i].op, op)) return &nm.rows[i];
    ampc_numerics_row *nr = room_for_one(nm.rows, nm.n, &nm.cap, sizeof *nr);
    if (!nr) {
        nm.oom = true;
        return NULL;
    }
    nm.rows = nr;
    ampc_numerics_row *r = &nm.rows[nm.n++];
    *r = (ampc_numerics_row){.module = module, .op = op, .backward = backward};
    return r;
}

static void nm_count(ampc_numerics_row *r, const ampc_tensor *t) {
    const int64_t n = t->numel;
    double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    if (!v || ampc_tensor_to_f64(t, v, (size_t)n) < 0) {
        free(v);
        ampc_clear_error();
        return;
    }
    /* target's thresholds: half the smallest subnormal (below: rounds to 0), the smallest
       normal, and max + half an ulp (from there: rounds to inf) */
    const bool f16 = nm.target == AMPC_F16;
    const double half_sub = f16 ? 0x1p-25 : 0x1p-134, min_normal = f16 ? 0x1p-14 : 0x1p-126;
    const double sat = f16 ? 65520.0 : 0x1.ff8p+127;
    for (int64_t i = 0; i < n; i++) {
        const double a = fabs(v[i]);
        if (isnan(a)) {
            r->nonfinite++;
            continue;
        }
        if (isinf(a)) {
            r->nonfinite++;
            r->saturated++;
            continue;
        }
        if (a > r->amax) r->amax = a;
        if (a == 0) r->zeros++;
        else if (a < half_sub) r->flushed++;
        else if (a < min_normal) r->subnormal++;
        else if (a >= sat) r->saturated++;
    }
    r->outputs++;
    r->values += n;
    free(v);
}

static void nm_observe(const ampc__trace_event *e) {
    const char *module = ampc__trace_intern(e->module);
    for (int i = 0; i < e->n_out; i++) {
        /* only what is kept in 16 bits (a loss, its scaling, fp32 weight gradients never are),
           measured before the cast that makes it so */
        const ampc_tensor *kept = e->out[i], *t = e->backward && e->raw[i] ? e->raw[i] : kept;
        if (!kept || (kept->dtype != AMPC_F16 && kept->dtype != AMPC_BF16) || !ampc__dt(t->dtype)->is_float) continue;
        /* a cast's backward narrows its incoming gradient itself: that is the value before */
        const ampc_tensor *gy = e->in[0];
        if (e->backward && !strcmp(e->name, ampc_op_grad_fn(AMPC_OP_CAST)) && gy && gy->numel == kept->numel && gy->dtype == AMPC_F32) t = gy;
        ampc_numerics_row *r = nm_row(module, e->name, e->backward);
        if (r) nm_count(r, t);
    }
}

int ampc_numerics_begin(ampc_dtype target) {
    if (target != AMPC_F16 && target != AMPC_BF16)
        return ampc__err(AMPC_ERR_DTYPE, "numerics_begin: target must be f16 or bf16, not %s", ampc_dtype_name(target));
    pthread_mutex_lock(&lock);
    int rc = AMPC_OK;
    if (nm.on) rc = ampc__err(AMPC_ERR_STATE, "numerics_begin: already collecting");
    else {
        nm.on = true;
        nm.paused = false;
        nm.target = target;
        nm.n = 0;
        nm.oom = false;
        update_hook();
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

void ampc_numerics_pause(bool paused) {
    pthread_mutex_lock(&lock);
    nm.paused = paused;
    update_hook();
    pthread_mutex_unlock(&lock);
}

int ampc_numerics_end(ampc_numerics_row **rows) {
    if (!rows) return ampc__err(AMPC_ERR_INVALID, "numerics_end: NULL rows");
    *rows = NULL;
    pthread_mutex_lock(&lock);
    int rc;
    if (!nm.on) rc = ampc__err(AMPC_ERR_STATE, "numerics_end without numerics_begin");
    else if (nm.oom) rc = ampc__err(AMPC_ERR_OOM, "numerics: out of memory while collecting");
    else {
        rc = nm.n;
        *rows = nm.rows;
        nm.rows = NULL;
    }
    free(nm.rows);
    nm.rows = NULL;
    nm.n = nm.cap = 0;
    nm.on = nm.paused = false;
    update_hook();
    pthread_mutex_unlock(&lock);
    return rc;
}

// ---------------------------------------------------------------------------------------------

static void observe(const ampc__trace_event *e, void *ctx) {
    (void)ctx;
    static _Thread_local bool inside;   /* the checks' own work is not observed */
    if (inside) return;
    inside = true;
    pthread_mutex_lock(&lock);
    if (ex.on) explain_row(e);
    if (doc.on) doctor_check(e);
    if (nm.on && !nm.paused) nm_observe(e);
    pthread_mutex_unlock(&lock);
    inside = false;
}
