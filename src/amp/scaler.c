/*
 * scaler.c - the gradient scaler (PyTorch's torch.cuda.amp.GradScaler, in C).
 *
 * Same state machine as PyTorch: each optimizer seen since the last update() is READY,
 * UNSCALED or STEPPED.
 *   scale(loss)    loss * scale in fp32 (16-bit losses are cast to fp32 first), recorded for
 *                  backward: a cast and a mul_scalar op.
 *   unscale(opt)   READY only (twice -> error, after step -> error). inv_scale =
 *                  (float)(1.0 / (double)scale); one fused backend pass per device over the
 *                  optimizer's grads multiplies them by inv_scale and records found_inf (any
 *                  inf/NaN, checked before scaling). An fp16 grad is an error (PyTorch's
 *                  allow_fp16=False) and nothing is modified. An optimizer without grads
 *                  records no inf check (then step() fails, as in PyTorch).
 *   step(opt)      not twice before update(); skips the optimizer step if this optimizer's
 *                  found_inf is set. Returns 1 applied, 0 skipped. From READY the unscale is
 *                  fused into the step (PyTorch's path for optimizers that support AMP scaling,
 *                  e.g. fused Adam): a read-only inf check, then update kernels that multiply
 *                  each gradient by inv_scale as they read it and write the product back - the
 *                  same update bits and the same unscaled grads afterwards as unscale + step,
 *                  one read pass over every gradient less; a skipped step unscales them in a
 *                  pass of its own, so the grads read unscaled after every step() as after
 *                  PyTorch's. After an explicit unscale(opt) (e.g. for clipping) the step
 *                  reads the unscaled grads.
 *   update()       needs at least one inf check since the last update; found_inf is the sum
 *                  over every optimizer unscaled since then. Then every optimizer is READY.
 *
 * Update rule (PyTorch's _amp_update_scale_, products in double rounded once to float):
 *   found_inf:  scale = max((float)(scale * backoff), min_scale); tracker = 0
 *   otherwise:  tracker + 1 == growth_interval ?
 *                   g = (float)(scale * growth); if g is finite, scale = min(g, max_scale);
 *                   tracker = 0
 *               : tracker += 1
 * min_scale 0 and max_scale inf (the defaults) make the clamps no-ops: exactly PyTorch.
 *
 * Hysteresis H (DeepSpeed DynamicLossScaler with consecutive_hysteresis=False): a counter
 * `hyst` starts at H.
 *   found_inf with hyst > 1:   hyst -= 1; tracker = 0; the scale is kept.
 *   found_inf with hyst <= 1:  back off as above (hyst stays at 1, so every further overflow
 *                              backs off until the next growth point).
 *   growth point (tracker + 1 reaches growth_interval): hyst = H, whether or not the scale
 *                              could grow (fp32 overflow or max_scale).
 * H = 1 (the default) is PyTorch's rule. The optimizer step is skipped on every overflow,
 * absorbed by hysteresis or not.
 *
 * enabled=false: scale() returns the loss itself, get_scale() 1, unscale()/update() do nothing,
 * step() runs the optimizer unconditionally (counted as applied). The scale is created at
 * ampc_scaler_new, not lazily at the first scale() as in PyTorch, so unscale/step/update do not
 * require a prior scale() call.
 *
 * Data-parallel models (ampc/dist.h): when some parameter of the optimizer is a replica, the
 * inf check's result is the maximum over all ranks, so every rank skips the same steps and
 * holds the same scale.
 *
 * ampc_scaler_found_inf(opt) reports the last unscale of opt and stays readable after update().
 *
 * Per-optimizer states live in an array keyed by the optimizer pointer, and the grad list in
 * a scratch array; both only grow, so a steady-state step allocates nothing.
 */
#include "amp/amp.h"
#include "ops/ops.h"
#include "optim/optim.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

typedef enum { STAGE_READY = 0, STAGE_UNSCALED, STAGE_STEPPED } stage;

typedef struct {
    const ampc_optimizer *opt;
    stage stage;
    bool recorded;        /* an inf check ran since the last update (PyTorch: found_inf_per_device non-empty) */
    float found_inf;      /* sum over devices of this optimizer's found_inf since the last update */
    bool last_found_inf;  /* kept across update(): ampc_scaler_found_inf */
} opt_state;

struct ampc_scaler {
    uint64_t gen;         /* generation while live, 0 once freed (a handle pool's object) */
    ampc_scaler_options o;
    float scale;
    int tracker;          /* consecutive unskipped updates since the last growth/backoff */
    int hyst;             /* overflows still absorbed before a backoff */
    int64_t applied, skipped;
    opt_state *states;
    int n_states, cap_states;
    ampc_tensor **grads;  /* scratch: one device's grads for the backend kernel */
    int cap_grads;
};

ampc_scaler_options ampc_scaler_defaults(void) {
    return (ampc_scaler_options){
        .init_scale = 65536.0,
        .growth_factor = 2.0,
        .backoff_factor = 0.5,
        .growth_interval = 2000,
        .enabled = true,
        .min_scale = 0.0,
        .max_scale = INFINITY,
        .hysteresis = 1,
    };
}

static int check_options(const ampc_scaler_options *o) {
    if (!o->enabled) return AMPC_OK;   /* PyTorch checks factors only when enabled */
    if (!(o->growth_factor > 1.0 && o->growth_factor <= FLT_MAX))
        return ampc__err(AMPC_ERR_INVALID, "scaler: the growth factor must be > 1.0 (and finite), not %g", o->growth_factor);
    if (!(o->backoff_factor < 1.0 && o->backoff_factor > 0.0))
        return ampc__err(AMPC_ERR_INVALID, "scaler: the backoff factor must be in (0, 1), not %g", o->backoff_factor);
    if (o->growth_interval < 1)
        return ampc__err(AMPC_ERR_INVALID, "scaler: growth_interval must be >= 1, not %d", o->growth_interval);
    if (!(o->init_scale > 0.0 && (float)o->init_scale > 0.0f && isfinite((float)o->init_scale)))
        return ampc__err(AMPC_ERR_INVALID, "scaler: init_scale must be a positive finite float, not %g", o->init_scale);
    if (!(o->min_scale >= 0.0 && o->min_scale <= FLT_MAX) || !(o->max_scale >= o->min_scale))
        return ampc__err(AMPC_ERR_INVALID, "scaler: need 0 <= min_scale <= max_scale (min_scale a finite float), got min %g max %g",
                         o->min_scale, o->max_scale);
    if (o->hysteresis < 1)
        return ampc__err(AMPC_ERR_INVALID, "scaler: hysteresis must be >= 1, not %d", o->hysteresis);
    return AMPC_OK;
}

static ampc_handle_pool scaler_pool = {.obj_size = sizeof(ampc_scaler)};

/* True (with the error recorded) when s is a stale handle; NULL is each call's own case. */
static bool stale(const ampc_scaler *s, const char *call) {
    return s && ampc__check_handle(s, s->gen, call, "scaler", "freed") < 0;
}

int ampc__scaler_check(const ampc_scaler *s, const char *call) { return stale(s, call) ? AMPC_ERR_STATE : AMPC_OK; }

ampc_scaler *ampc_scaler_new(const ampc_scaler_options *opts) {
    ampc__ensure_init();
    ampc_scaler_options o = opts ? *opts : ampc_scaler_defaults();
    if (check_options(&o) < 0) return NULL;
    ampc_scaler *s = ampc__handle_pool_get(&scaler_pool);
    if (!s) return NULL;
    s->gen = ampc__new_gen();
    s->o = o;
    s->scale = (float)o.init_scale;   /* PyTorch: torch.full((1,), init_scale, dtype=float32) */
    s->hyst = o.hysteresis;
    return s;
}

void ampc_scaler_free(ampc_scaler *s) {
    if (!s || stale(s, "ampc_scaler_free")) return;
    free(s->states);
    free(s->grads);
    s->gen = 0;
    ampc__handle_pool_put(&scaler_pool, s);
}

// ---------------------------------------------------------------------------------------------
// Per-optimizer state

static opt_state *find_state(const ampc_scaler *s, const ampc_optimizer *opt) {
    for (int i = 0; i < s->n_states; i++)
        if (s->states[i].opt == opt) return &s->states[i];
    return NULL;
}

static opt_state *state_for(ampc_scaler *s, const ampc_optimizer *opt) {
    opt_state *st = find_state(s, opt);
    if (st) return st;
    if (s->n_states == s->cap_states) {
        int cap = s->cap_states ? 2 * s->cap_states : 4;
        opt_state *v = realloc(s->states, (size_t)cap * sizeof *v);
        if (!v) return ampc__err_null(AMPC_ERR_OOM, "scaler: out of memory for optimizer states");
        s->states = v;
        s->cap_states = cap;
    }
    st = &s->states[s->n_states++];
    *st = (opt_state){.opt = opt, .stage = STAGE_READY};
    return st;
}

// ---------------------------------------------------------------------------------------------
// scale

ampc_tensor *ampc_scaler_scale(ampc_scaler *s, ampc_tensor *loss) {
    if (!s) return ampc__err_null(AMPC_ERR_INVALID, "scaler_scale: NULL scaler");
    if (stale(s, "ampc_scaler_scale")) return NULL;
    if (!loss) {
        if (ampc_last_status() == 0) ampc__err(AMPC_ERR_INVALID, "scaler_scale: NULL loss");
        return NULL;
    }
    if (!s->o.enabled) return loss;
    ampc_tensor *x = loss;
    if (loss->dtype == AMPC_F16 || loss->dtype == AMPC_BF16) {
        x = ampc_cast(loss, AMPC_F32);
        if (!x) return NULL;
    } else if (!ampc__dt(loss->dtype)->is_float) {
        return ampc__err_null(AMPC_ERR_DTYPE, "scaler_scale: the loss is %s, not a float tensor",
                              ampc_dtype_name(loss->dtype));
    }
    return ampc_mul_scalar(x, (double)s->scale);
}

// ---------------------------------------------------------------------------------------------
// unscale

/* The non-finite check over opt's grads, and (unless check_only) their unscale in place. */
static int unscale_grads(ampc_scaler *s, ampc_optimizer *opt, opt_state *st, bool check_only) {
    /* validate everything first: an error leaves every gradient untouched, as in PyTorch */
    int n_grads = 0;
    for (int i = 0; i < opt->n; i++) {
        ampc_tensor *p = opt->params[i];
        if (!p || !p->grad) continue;
        if (p->grad->dtype == AMPC_F16)
            return ampc__err(AMPC_ERR_DTYPE, "scaler: Attempting to unscale FP16 gradients (parameter %d); "
                                             "master weights and their grads must be fp32", i);
        if (!ampc__dt(p->grad->dtype)->is_float)
            return ampc__err(AMPC_ERR_DTYPE, "scaler: gradient of parameter %d is %s", i, ampc_dtype_name(p->grad->dtype));
        n_grads++;
    }
    if (n_grads > s->cap_grads) {
        ampc_tensor **g = realloc(s->grads, (size_t)n_grads * sizeof *g);
        if (!g) return ampc__err(AMPC_ERR_OOM, "scaler: out of memory for the gradient list");
        s->grads = g;
        s->cap_grads = n_grads;
    }
    const float inv_scale = (float)(1.0 / (double)s->scale);   /* reciprocal in double, like PyTorch */
    float found_inf = 0.0f;
    bool recorded = false;
    for (int d = 0; d < AMPC_DEVICE_COUNT; d++) {
        int n = 0;
        for (int i = 0; i < opt->n; i++) {
            ampc_tensor *p = opt->params[i];
            if (p && p->grad && p->grad->device == (ampc_device)d) s->grads[n++] = p->grad;
        }
        if (!n) continue;
        float dev_found_inf = 0.0f;
        int rc = ampc__k_unscale_check(s->grads, n, check_only ? 1.0f : inv_scale, &dev_found_inf);
        if (rc < 0) return rc;
        found_inf += dev_found_inf;
        recorded = true;
    }
    /* a data-parallel model's ranks must step or skip together and keep one scale: agree on
       found_inf (a maximum over ranks; one float, a blocking all-reduce, once per step) even
       where the averaged gradients would not carry a rank's overflow to the others (a step
       inside a no-sync region, gradients that were never all-reduced) */
    const ampc_comm_ops *comm = ampc__comm();
    bool replicated = false;
    for (int i = 0; i < opt->n && comm->size > 1 && !replicated; i++) replicated = opt->params[i] && opt->params[i]->replicated;
    if (replicated) {
        int rc = comm->allreduce(&found_inf, 1, AMPC_F32, AMPC_COMM_MAX);
        if (rc < 0) return rc;
    }
    st->found_inf = found_inf;
    st->recorded = recorded;
    st->last_found_inf = found_inf != 0.0f;
    if (!check_only) st->stage = STAGE_UNSCALED;
    return AMPC_OK;
}

int ampc_scaler_unscale(ampc_scaler *s, ampc_optimizer *opt) {
    if (!s || !opt) return ampc__err(AMPC_ERR_INVALID, "scaler_unscale: NULL %s", s ? "optimizer" : "scaler");
    if (stale(s, "ampc_scaler_unscale")) return AMPC_ERR_STATE;
    int rc = ampc__optimizer_check(opt, "ampc_scaler_unscale");
    if (rc < 0) return rc;
    if (!s->o.enabled) return AMPC_OK;
    opt_state *st = state_for(s, opt);
    if (!st) return ampc_last_status();
    if (st->stage == STAGE_UNSCALED)
        return ampc__err(AMPC_ERR_STATE, "scaler: unscale() has already been called on this optimizer since the last update()");
    if (st->stage == STAGE_STEPPED)
        return ampc__err(AMPC_ERR_STATE, "scaler: unscale() is being called after step() (call update() first)");
    return unscale_grads(s, opt, st, false);
}

// ---------------------------------------------------------------------------------------------
// step

int ampc_scaler_step(ampc_scaler *s, ampc_optimizer *opt) {
    if (!s || !opt) return ampc__err(AMPC_ERR_INVALID, "scaler_step: NULL %s", s ? "optimizer" : "scaler");
    if (stale(s, "ampc_scaler_step")) return AMPC_ERR_STATE;
    int rc = ampc__optimizer_check(opt, "ampc_scaler_step");   /* before anything reads opt->params */
    if (rc < 0) return rc;
    if (!s->o.enabled) {
        rc = ampc_optimizer_step(opt);
        if (rc < 0) return rc;
        s->applied++;
        return 1;
    }
    opt_state *st = state_for(s, opt);
    if (!st) return ampc_last_status();
    if (st->stage == STAGE_STEPPED)
        return ampc__err(AMPC_ERR_STATE, "scaler: step() has already been called since the last update()");
    const bool fused = st->stage == STAGE_READY;
    if (fused) {
        rc = unscale_grads(s, opt, st, true);
        if (rc < 0) return rc;
    }
    if (!st->recorded)
        return ampc__err(AMPC_ERR_STATE, "scaler: No inf checks were recorded for this optimizer "
                                         "(none of its parameters has a gradient)");
    if (st->found_inf != 0.0f) {
        /* skipped: the grads still read unscaled afterwards, as after PyTorch's unscale_ (the
           check again, its answer already taken) */
        if (fused) {
            const float agreed = st->found_inf;
            rc = unscale_grads(s, opt, st, false);
            if (rc < 0) return rc;
            st->found_inf = agreed;
            st->last_found_inf = true;
        }
        st->stage = STAGE_STEPPED;
        s->skipped++;
        return 0;
    }
    rc = ampc__optimizer_step_scaled(opt, fused ? (float)(1.0 / (double)s->scale) : 0.0f);
    if (rc < 0) return rc;   /* the stage stays, as when PyTorch's optimizer.step() raises */
    st->stage = STAGE_STEPPED;
    s->applied++;
    return 1;
}

// ---------------------------------------------------------------------------------------------
// update

static void backoff(ampc_scaler *s) {
    float v = (float)((double)s->scale * s->o.backoff_factor);
    s->scale = v < s->o.min_scale ? (float)s->o.min_scale : v;
    s->tracker = 0;
}

static void update_scale(ampc_scaler *s, bool found_inf) {
    if (found_inf) {
        if (s->hyst > 1) {
            s->hyst--;
            s->tracker = 0;
        } else {
            backoff(s);
        }
        return;
    }
    int successful = s->tracker + 1;
    if (successful == s->o.growth_interval) {
        float g = (float)((double)s->scale * s->o.growth_factor);
        if (isfinite(g)) s->scale = g > s->o.max_scale ? (float)s->o.max_scale : g;   /* never grow to inf */
        s->tracker = 0;
        s->hyst = s->o.hysteresis;
    } else {
        s->tracker = successful;
    }
}

int ampc_scaler_update(ampc_scaler *s) {
    if (!s) return ampc__err(AMPC_ERR_INVALID, "scaler_update: NULL scaler");
    if (stale(s, "ampc_scaler_update")) return AMPC_ERR_STATE;
    if (!s->o.enabled) return AMPC_OK;
    float found_inf = 0.0f;
    bool any = false;
    for (int i = 0; i < s->n_states; i++) {
        if (!s->states[i].recorded) continue;
        any = true;
        found_inf += s->states[i].found_inf;
    }
    if (!any)
        return ampc__err(AMPC_ERR_STATE, "scaler: No inf checks were recorded prior to update() "
                                         "(call step() or unscale() on an optimizer with gradients first)");
    update_scale(s, found_inf != 0.0f);
    for (int i = 0; i < s->n_states; i++) {
        s->states[i].stage = STAGE_READY;
        s->states[i].recorded = false;
        s->states[i].found_inf = 0.0f;
    }
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Accessors

void ampc_scaler_set_scale(ampc_scaler *s, float new_scale) {
    if (!s || stale(s, "ampc_scaler_set_scale") || !s->o.enabled) return;
    if (!(new_scale > 0.0f) || !isfinite(new_scale)) {
        ampc__err(AMPC_ERR_INVALID, "scaler_set_scale: the scale must be positive and finite, not %g; kept %g",
                  (double)new_scale, (double)s->scale);
        return;
    }
    s->scale = new_scale;
}

/* A stale scaler reads as NULL does (the defaults, 1.0, 0, false), with the error recorded. */
ampc_scaler_options ampc_scaler_get_options(const ampc_scaler *s) {
    return s && !stale(s, "ampc_scaler_get_options") ? s->o : ampc_scaler_defaults();
}

float ampc_scaler_get_scale(const ampc_scaler *s) { return s && !stale(s, "ampc_scaler_get_scale") && s->o.enabled ? s->scale : 1.0f; }
int ampc_scaler_growth_tracker(const ampc_scaler *s) {
    return s && !stale(s, "ampc_scaler_growth_tracker") && s->o.enabled ? s->tracker : 0;
}
bool ampc_scaler_is_enabled(const ampc_scaler *s) { return s && !stale(s, "ampc_scaler_is_enabled") && s->o.enabled; }
int64_t ampc_scaler_steps_applied(const ampc_scaler *s) { return s && !stale(s, "ampc_scaler_steps_applied") ? s->applied : 0; }
int64_t ampc_scaler_steps_skipped(const ampc_scaler *s) { return s && !stale(s, "ampc_scaler_steps_skipped") ? s->skipped : 0; }

bool ampc_scaler_found_inf(const ampc_scaler *s, const ampc_optimizer *opt) {
    if (!s || stale(s, "ampc_scaler_found_inf") || !s->o.enabled) return false;
    const opt_state *st = find_state(s, opt);
    return st && st->last_found_inf;
}

// ---------------------------------------------------------------------------------------------
// State for checkpoints (src/io/checkpoint.c)

int ampc__scaler_export(const ampc_scaler *s, double *v, int n) {
    if (!s || !v || n < AMPC_SCALER_STATE_COUNT)
        return ampc__err(AMPC_ERR_INVALID, "scaler_export: need a scaler and %d values", AMPC_SCALER_STATE_COUNT);
    v[AMPC_SCALER_STATE_ENABLED] = s->o.enabled ? 1.0 : 0.0;
    v[AMPC_SCALER_STATE_SCALE] = (double)s->scale;
    v[AMPC_SCALER_STATE_GROWTH_TRACKER] = (double)s->tracker;
    v[AMPC_SCALER_STATE_HYSTERESIS] = (double)s->hyst;
    v[AMPC_SCALER_STATE_APPLIED] = (double)s->applied;
    v[AMPC_SCALER_STATE_SKIPPED] = (double)s->skipped;
    v[AMPC_SCALER_STATE_GROWTH_FACTOR] = s->o.growth_factor;
    v[AMPC_SCALER_STATE_BACKOFF_FACTOR] = s->o.backoff_factor;
    v[AMPC_SCALER_STATE_GROWTH_INTERVAL] = (double)s->o.growth_interval;
    return AMPC_SCALER_STATE_COUNT;
}

static bool is_count(double x, double max) { return x >= 0 && x <= max && x == floor(x); }

int ampc__scaler_import(ampc_scaler *s, const double *v, int n, bool dry_run) {
    if (!s || !v || n < AMPC_SCALER_STATE_COUNT)
        return ampc__err(AMPC_ERR_INVALID, "scaler_import: need a scaler and %d values", AMPC_SCALER_STATE_COUNT);
    double scale = v[AMPC_SCALER_STATE_SCALE];
    if (!(scale > 0 && scale <= FLT_MAX) || (double)(float)scale != scale)
        return ampc__err(AMPC_ERR_FORMAT, "scaler state: the scale %.17g is not a positive finite float", scale);
    const double max_int = 2147483647.0, max_count = 9007199254740992.0;   /* int; 2^53 */
    if (!is_count(v[AMPC_SCALER_STATE_GROWTH_TRACKER], max_int))
        return ampc__err(AMPC_ERR_FORMAT, "scaler state: bad growth tracker %.17g", v[AMPC_SCALER_STATE_GROWTH_TRACKER]);
    if (!is_count(v[AMPC_SCALER_STATE_HYSTERESIS], max_int) || v[AMPC_SCALER_STATE_HYSTERESIS] < 1)
        return ampc__err(AMPC_ERR_FORMAT, "scaler state: bad hysteresis counter %.17g", v[AMPC_SCALER_STATE_HYSTERESIS]);
    if (!is_count(v[AMPC_SCALER_STATE_APPLIED], max_count) || !is_count(v[AMPC_SCALER_STATE_SKIPPED], max_count))
        return ampc__err(AMPC_ERR_FORMAT, "scaler state: bad step counts %.17g applied, %.17g skipped",
                         v[AMPC_SCALER_STATE_APPLIED], v[AMPC_SCALER_STATE_SKIPPED]);
    /* the options of GradScaler.state_dict, checked as ampc_scaler_new checks them */
    ampc_scaler_options o = s->o;
    const double gf = v[AMPC_SCALER_STATE_GROWTH_FACTOR], bf = v[AMPC_SCALER_STATE_BACKOFF_FACTOR],
                 gi = v[AMPC_SCALER_STATE_GROWTH_INTERVAL];
    if (!isnan(gf)) o.growth_factor = gf;
    if (!isnan(bf)) o.backoff_factor = bf;
    if (!isnan(gi) && !is_count(gi, max_int))
        return ampc__err(AMPC_ERR_FORMAT, "scaler state: bad growth interval %.17g", gi);
    if (!isnan(gi)) o.growth_interval = (int)gi;
    o.enabled = true;
    if (check_options(&o) < 0) {
        char msg[256];
        snprintf(msg, sizeof msg, "%s", ampc_last_error());
        return ampc__err(AMPC_ERR_FORMAT, "scaler state: %s", msg);
    }
    if (dry_run) return AMPC_OK;
    s->o.growth_factor = o.growth_factor;
    s->o.backoff_factor = o.backoff_factor;
    s->o.growth_interval = o.growth_interval;
    s->scale = (float)scale;
    int tracker = (int)v[AMPC_SCALER_STATE_GROWTH_TRACKER], hyst = (int)v[AMPC_SCALER_STATE_HYSTERESIS];
    /* a run resumed with a shorter interval or less hysteresis: keep the state meaningful */
    s->tracker = s->o.growth_interval >= 1 && tracker >= s->o.growth_interval ? s->o.growth_interval - 1 : tracker;
    s->hyst = s->o.hysteresis >= 1 && hyst > s->o.hysteresis ? s->o.hysteresis : hyst;
    s->applied = (int64_t)v[AMPC_SCALER_STATE_APPLIED];
    s->skipped = (int64_t)v[AMPC_SCALER_STATE_SKIPPED];
    for (int i = 0; i < s->n_states; i++) {
        s->states[i].stage = STAGE_READY;
        s->states[i].recorded = false;
        s->states[i].found_inf = 0.0f;
    }
    return AMPC_OK;
}
