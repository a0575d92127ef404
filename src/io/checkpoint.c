/*
 * checkpoint.c - checkpoints: a module's state_dict, an optimizer's state, a grad scaler's state,
 * the RNG state and the caller's keys as one safetensors file (src/io/safetensors.c does the
 * format), and back; comparing and listing files; reading their metadata.
 *
 * What is stored:
 *   <state_dict name>                        model parameters and buffers, dtype as in memory
 *   optimizer.<param name>.<slot>            SGD momentum_buffer; Adam exp_avg, exp_avg_sq,
 *                                            max_exp_avg_sq (only slots that exist)
 *   __metadata__ (all values are strings):
 *     format "pt", ampc.version "1"
 *     optimizer.type ("SGD", "Adam", "AdamW"), optimizer.lr, optimizer.num_params,
 *     optimizer.<param name>.step             steps taken (Adam's bias correction)
 *     scaler.enabled, scaler.scale, scaler.growth_tracker, scaler.hysteresis_counter,
 *     scaler.steps_applied, scaler.steps_skipped, scaler.growth_factor, scaler.backoff_factor,
 *     scaler.growth_interval                  (GradScaler.state_dict's options; absent before
 *                                              2026-11-25: the loading scaler keeps its own)
 *     rng.seed, rng.offset                    the global generator (ampc_rng_get_state)
 *     the caller's keys
 * A parameter of the optimizer that is not in the module is named "#<index>".
 *
 * Loading validates the whole file before changing anything (the format by st_open; here every
 * model tensor present with its dtype and shape, nothing unexpected, every value read
 * range-checked: step counts, scaler state, and the presence of the optimizer state that the
 * step counts imply). The data is read into memory once (never mapped: a file truncated meanwhile
 * is an error, not a SIGBUS) and copied only after every check has passed, so a bad file leaves
 * model, optimizer, scaler and RNG as they were. Lookups are binary searches (tensors) and hash
 * lookups (metadata): a load is n log n in the header size.
 */
#include "amp/amp.h"
#include "io/safetensors.h"
#include "nn/nn.h"
#include "optim/optim.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Names: optimizer kinds and slots, parameters

static const char *opt_kind_name(ampc_optim_kind k) {
    return k == AMPC_OPTIM_SGD ? "SGD" : k == AMPC_OPTIM_ADAM ? "Adam" : "AdamW";
}

static const char *const sgd_slots[] = {"momentum_buffer"};
static const char *const adam_slots[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};

static int opt_slots(const ampc_optimizer *opt, const char *const **names) {
    if (opt->kind == AMPC_OPTIM_SGD) {
        *names = sgd_slots;
        return 1;
    }
    *names = adam_slots;
    return 3;
}

static bool starts_with(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

/* The state_dict name of opt's parameter i in m, or "#i" (buf) if m doesn't hold it. */
static const char *param_name(ampc_tensor **sd, const char **names, int n_sd, const ampc_tensor *p, int i, char *buf, size_t n) {
    for (int k = 0; k < n_sd; k++)
        if (sd[k] == p) return names[k];
    snprintf(buf, n, "#%d", i);
    return buf;
}

// ---------------------------------------------------------------------------------------------
// Parsing metadata values

static bool parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    if (!s || !*s || (*s != '-' && (*s < '0' || *s > '9'))) return false;
    errno = 0;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

#define MAX_COUNT ((int64_t)1 << 53)   /* step counts: exact in a double, and never reached */

/* The integer metadata value of key, from lo to hi, into *out; else an error naming the key,
   the value and the range. */
static int meta_int(const char *path, const st_meta *meta, const char *key, int64_t lo, int64_t hi, int64_t *out) {
    const char *v = st_meta_get(meta, key);
    if (!v) return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s' lacks the metadata '%s'", path, key);
    if (!parse_i64(v, lo, hi, out))
        return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': metadata '%s' is \"%.40s\", not an integer from %" PRId64 " to %" PRId64,
                         path, key, v, lo, hi);
    return AMPC_OK;
}

static bool parse_u64(const char *s, uint64_t *out) {
    if (!s || *s < '0' || *s > '9') return false;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end) return false;
    *out = v;
    return true;
}

static bool parse_f64(const char *s, double *out) {
    if (!s || !*s) return false;
    char *end;
    double v = strtod(s, &end);
    if (*end) return false;
    *out = v;
    return true;
}

// ---------------------------------------------------------------------------------------------
// Save

/* Key/value strings, malloc'd: s[2i] the key, s[2i+1] its value. */
typedef struct {
    char **s;
    int n, cap;   /* n pairs */
} kv_list;

static void kv_free(kv_list *l) {
    for (int i = 0; i < 2 * l->n; i++) free(l->s[i]);
    free(l->s);
    *l = (kv_list){0};
}

static bool kv_push(kv_list *l, char *k, char *v) {
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 16;
        char **s = realloc(l->s, 2 * (size_t)cap * sizeof *s);
        if (!s) return false;
        l->s = s;
        l->cap = cap;
    }
    l->s[2 * l->n] = k;
    l->s[2 * l->n + 1] = v;
    l->n++;
    return true;
}

static char *str_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *str_printf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (k < 0) return NULL;
    char *s = malloc((size_t)k + 1);
    if (!s) return NULL;
    va_start(ap, fmt);
    vsnprintf(s, (size_t)k + 1, fmt, ap);
    va_end(ap);
    return s;
}

static bool reserved_key(const char *k) {
    return strcmp(k, "format") == 0 || starts_with(k, "ampc.") || starts_with(k, "optimizer.") || starts_with(k, "scaler.") ||
           starts_with(k, "rng.");
}

/* Metadata entries: ours, then the caller's (checked: not reserved, UTF-8). */
static int build_meta(kv_list *meta, ampc_optimizer *opt, ampc_scaler *s, ampc_tensor **sd, const char **names, int n_sd,
                      const char *const *meta_kv) {
#define PUT(k, ...)                                                                                                            \
    do {                                                                                                                       \
        char *k_ = (k), *v_ = str_printf(__VA_ARGS__);                                                                         \
        if (!k_ || !v_ || !kv_push(meta, k_, v_)) {                                                                            \
            free(k_);                                                                                                          \
            free(v_);                                                                                                          \
            return ampc__err(AMPC_ERR_OOM, "checkpoint save: out of memory for the metadata");                                 \
        }                                                                                                                      \
    } while (0)
    PUT(strdup("format"), "pt");
    PUT(strdup("ampc.version"), "1");
    if (opt) {
        PUT(strdup("optimizer.type"), "%s", opt_kind_name(opt->kind));
        PUT(strdup("optimizer.lr"), "%.17g", ampc_optimizer_get_lr(opt));
        PUT(strdup("optimizer.num_params"), "%d", opt->n);
        for (int i = 0; i < opt->n; i++) {
            char buf[32];
            const char *pn = param_name(sd, names, n_sd, opt->params[i], i, buf, sizeof buf);
            PUT(str_printf("optimizer.%s.step", pn), "%" PRId64, opt->steps[i]);
        }
    }
    if (s) {
        double v[AMPC_SCALER_STATE_COUNT];
        int rc = ampc__scaler_export(s, v, AMPC_SCALER_STATE_COUNT);
        if (rc < 0) return rc;
        PUT(strdup("scaler.enabled"), "%d", v[AMPC_SCALER_STATE_ENABLED] != 0);
        PUT(strdup("scaler.scale"), "%.9g", v[AMPC_SCALER_STATE_SCALE]);   /* 9 digits: any float exactly */
        PUT(strdup("scaler.growth_tracker"), "%.0f", v[AMPC_SCALER_STATE_GROWTH_TRACKER]);
        PUT(strdup("scaler.hysteresis_counter"), "%.0f", v[AMPC_SCALER_STATE_HYSTERESIS]);
        PUT(strdup("scaler.steps_applied"), "%.0f", v[AMPC_SCALER_STATE_APPLIED]);
        PUT(strdup("scaler.steps_skipped"), "%.0f", v[AMPC_SCALER_STATE_SKIPPED]);
        PUT(strdup("scaler.growth_factor"), "%.17g", v[AMPC_SCALER_STATE_GROWTH_FACTOR]);   /* 17 digits: any double exactly */
        PUT(strdup("scaler.backoff_factor"), "%.17g", v[AMPC_SCALER_STATE_BACKOFF_FACTOR]);
        PUT(strdup("scaler.growth_interval"), "%.0f", v[AMPC_SCALER_STATE_GROWTH_INTERVAL]);
    }
    uint64_t seed, offset;
    ampc_rng_get_state(&seed, &offset);
    PUT(strdup("rng.seed"), "%" PRIu64, seed);
    PUT(strdup("rng.offset"), "%" PRIu64, offset);
    for (int i = 0; meta_kv && meta_kv[i]; i += 2) {
        const char *k = meta_kv[i], *v = meta_kv[i + 1];
        if (!v) return ampc__err(AMPC_ERR_INVALID, "checkpoint save: metadata key '%s' has no value (pairs end with one NULL)", k);
        if (reserved_key(k)) return ampc__err(AMPC_ERR_INVALID, "checkpoint save: metadata key '%s' is reserved", k);
        if (!st_utf8_valid(k) || !st_utf8_valid(v))
            return ampc__err(AMPC_ERR_INVALID, "checkpoint save: metadata key '%s' or its value is not valid UTF-8", k);
        PUT(strdup(k), "%s", v);
    }
    return AMPC_OK;   /* a key given twice: st_write says so */
#undef PUT
}

/* Copies of the optimizer's state names ("optimizer.<param>.<slot>"), to free after the save. */
typedef struct {
    char **a;
    int n;
} name_list;

/* A tensor to write: its bytes where the CPU reads them (t itself, or a host copy of a device
   tensor), held in host[] until the file is written. A failed copy gives no data pointer, which
   the save reports before writing. */
static st_tensor item_of(const char *name, ampc_tensor *t, ampc_tensor **host, int *n_host) {
    ampc_tensor *h = ampc__host_copy(t);
    if (h) host[(*n_host)++] = h;
    return (st_tensor){name, t->dtype, t->ndim, t->shape, h ? ampc__data(h) : NULL, ampc__nbytes(t)};
}

int ampc_checkpoint_save(const char *path, ampc_module *m, ampc_optimizer *opt, ampc_scaler *s, const char *const *meta_kv) {
    ampc__ensure_init();
    if (!path || !m) return ampc__err(AMPC_ERR_INVALID, "checkpoint save: NULL %s", path ? "module" : "path");
    if (opt && ampc__optimizer_check(opt, "ampc_checkpoint_save") < 0) return ampc_last_status();
    if (ampc__scaler_check(s, "ampc_checkpoint_save") < 0) return AMPC_ERR_STATE;   /* before opt->params */
    ampc_tensor **sd;
    const char **names;
    int n_sd = ampc_module_state_dict(m, &sd, &names);
    if (n_sd < 0) return n_sd;
    for (int i = 0; opt && i < opt->n; i++)   /* ZeRO: this rank's parts are not the state */
        for (int k = 0; k < 3; k++)
            if (opt->state[k][i] && opt->state[k][i]->numel != opt->params[i]->numel)
                return ampc__err(AMPC_ERR_INVALID, "checkpoint save: the optimizer's state is sharded over the ranks (ZeRO): "
                                 "gather it with ampc_zero_consolidate, then save on rank 0");

    const char *const *slots = NULL;
    int n_slots = opt ? opt_slots(opt, &slots) : 0, n_opt = opt ? opt->n : 0, n = 0, rc = AMPC_OK;
    size_t cap = (size_t)n_sd + (size_t)n_slots * (size_t)n_opt;
    st_tensor *items = malloc((cap ? cap : 1) * sizeof *items);
    name_list owned = {calloc(cap ? cap : 1, sizeof(char *)), 0};
    kv_list meta = {0};
    /* tensors of a device the CPU cannot read (CUDA) are written from host copies (item_of) */
    ampc_tensor **host = calloc(cap ? cap : 1, sizeof *host);
    int n_host = 0;
    if (!items || !owned.a || !host) rc = ampc__err(AMPC_ERR_OOM, "checkpoint save: out of memory");
#define ITEM(nm, t) item_of((nm), (t), host, &n_host)
    for (int i = 0; i < n_sd && rc == AMPC_OK; i++) {
        if (starts_with(names[i], "optimizer.") || strcmp(names[i], "__metadata__") == 0 || !st_utf8_valid(names[i]))
            rc = ampc__err(AMPC_ERR_INVALID, "checkpoint save: the model tensor name '%s' can't be stored", names[i]);
        else items[n++] = ITEM(names[i], sd[i]);
    }
    for (int i = 0; i < n_opt && rc == AMPC_OK; i++) {
        char buf[32];
        const char *pn = param_name(sd, names, n_sd, opt->params[i], i, buf, sizeof buf);
        for (int k = 0; k < n_slots && rc == AMPC_OK; k++) {
            if (!opt->state[k][i]) continue;
            char *nm = owned.a[owned.n++] = str_printf("optimizer.%s.%s", pn, slots[k]);
            if (!nm) rc = ampc__err(AMPC_ERR_OOM, "checkpoint save: out of memory");
            else items[n++] = ITEM(nm, opt->state[k][i]);
        }
    }
#undef ITEM
    for (int i = 0; i < n && rc == AMPC_OK; i++)
        if (!items[i].data && items[i].nbytes) rc = ampc_last_status() < 0 ? ampc_last_status() : AMPC_ERR_BACKEND;   /* a device copy failed */
    if (rc == AMPC_OK) rc = build_meta(&meta, opt, s, sd, names, n_sd, meta_kv);
    if (rc == AMPC_OK) rc = st_write(path, items, n, (const char *const *)meta.s, meta.n);
    for (int i = 0; i < owned.n; i++) free(owned.a[i]);
    for (int i = 0; i < n_host; i++) ampc__release(host[i]);
    free(host);
    free(owned.a);
    free(items);
    kv_free(&meta);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Load

typedef struct {
    int n_slots;
    const char *const *slots;
    st_entry **src;           /* [slot * n + i]: the file's tensor, or NULL: no state */
    ampc_tensor **fresh;      /* [slot * n + i]: newly allocated state (owned until commit) */
    int64_t *steps;
    double lr;
} opt_plan;

static void plan_free(opt_plan *pl, int n) {
    if (pl->fresh)
        for (int i = 0; i < pl->n_slots * n; i++) ampc__release(pl->fresh[i]);
    free(pl->src);
    free(pl->fresh);
    free(pl->steps);
}

static bool same_shape(const st_entry *e, const ampc_tensor *t) {
    if (e->ndim != t->ndim) return false;
    for (int d = 0; d < t->ndim; d++)
        if (e->shape[d] != t->shape[d]) return false;
    return true;
}

static bool entry_matches(const st_entry *e, const ampc_tensor *t) {
    return st_dtypes[e->dtype].ampc == (int)t->dtype && same_shape(e, t);
}

static int mismatch(const char *path, const st_entry *e, const ampc_tensor *t, const char *what) {
    char a[160], b[160];
    return ampc__err(AMPC_ERR_SHAPE, "checkpoint '%s': %s '%s' is %s %s in the checkpoint but %s %s in the %s", path, what,
                     e->name, st_fmt_shape(e->ndim, e->shape, a, sizeof a), st_dtypes[e->dtype].name,
                     st_fmt_shape(t->ndim, t->shape, b, sizeof b), st_dtypes[st_dtype_of(t->dtype)].name,
                     strcmp(what, "tensor") == 0 ? "model" : "optimizer");
}

static int plan_optimizer(st_file *f, ampc_optimizer *opt, ampc_tensor **sd, const char **names, int n_sd, opt_plan *pl) {
    const char *path = f->path;
    const st_meta *meta = f->meta;
    const char *type = st_meta_get(meta, "optimizer.type");
    if (!type) return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s' holds no optimizer state (saved without an optimizer)", path);
    if (strcmp(type, opt_kind_name(opt->kind)) != 0)
        return ampc__err(AMPC_ERR_INVALID, "checkpoint '%s' holds %s state but the optimizer is %s", path, type,
                         opt_kind_name(opt->kind));
    int64_t np;
    int rc = meta_int(path, meta, "optimizer.num_params", 0, ST_MAX_TENSORS, &np);
    if (rc < 0) return rc;
    if (np != opt->n)
        return ampc__err(AMPC_ERR_SHAPE, "checkpoint '%s' holds state for %" PRId64 " parameters but the optimizer has %d", path, np,
                         opt->n);
    if (!parse_f64(st_meta_get(meta, "optimizer.lr"), &pl->lr) || !(pl->lr >= 0) || !isfinite(pl->lr))
        return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': bad or missing optimizer.lr", path);
    pl->n_slots = opt_slots(opt, &pl->slots);
    size_t cells = (size_t)pl->n_slots * (size_t)(opt->n ? opt->n : 1);
    pl->src = calloc(cells, sizeof *pl->src);
    pl->fresh = calloc(cells, sizeof *pl->fresh);
    pl->steps = calloc((size_t)(opt->n ? opt->n : 1), sizeof *pl->steps);
    if (!pl->src || !pl->fresh || !pl->steps) return ampc__err(AMPC_ERR_OOM, "checkpoint '%s': out of memory", path);
    char key[512];
    for (int i = 0; i < opt->n; i++) {
        char buf[32];
        ampc_tensor *p = opt->params[i];
        const char *pn = param_name(sd, names, n_sd, p, i, buf, sizeof buf);
        snprintf(key, sizeof key, "optimizer.%s.step", pn);
        if ((rc = meta_int(path, meta, key, 0, MAX_COUNT, &pl->steps[i])) < 0) return rc;
        for (int k = 0; k < pl->n_slots; k++) {
            snprintf(key, sizeof key, "optimizer.%s.%s", pn, pl->slots[k]);
            st_entry *e = st_find(f, key);
            /* state exists from a parameter's first step on: with steps, every slot this
               optimizer uses must be there (else it would restart silently); before, none */
            if (!e && pl->steps[i] > 0 && k < ampc__optimizer_slots_used(opt))
                return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s' has the %s step count of '%s' (%" PRId64 ") but not its '%s' (tensor '%s')",
                                 path, opt_kind_name(opt->kind), pn, pl->steps[i], pl->slots[k], key);
            if (!e) continue;
            if (pl->steps[i] == 0)
                return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s' has the tensor '%s' but the step count of '%s' is 0", path, key, pn);
            if (!entry_matches(e, p)) return mismatch(path, e, p, "optimizer state");
            e->used = true;
            pl->src[k * opt->n + i] = e;
        }
    }
    for (int i = 0; i < f->n; i++)
        if (!f->e[i].used && starts_with(f->e[i].name, "optimizer."))
            return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': unexpected optimizer tensor '%s' (no such %s parameter or slot)", path,
                             f->e[i].name, opt_kind_name(opt->kind));
    /* state the optimizer doesn't have yet, allocated now so that the commit can't fail */
    for (int k = 0; k < pl->n_slots; k++)
        for (int i = 0; i < opt->n; i++) {
            if (!pl->src[k * opt->n + i] || opt->state[k][i]) continue;
            ampc_mem_kind prev = ampc__mem_kind_push(AMPC_MEM_OPTIMIZER);
            ampc_tensor *t = ampc__tensor_like(opt->params[i], opt->params[i]->dtype);
            ampc__mem_kind_pop(prev);
            if (!t) return ampc_last_status();
            pl->fresh[k * opt->n + i] = t;
        }
    return AMPC_OK;
}

static int plan_scaler(st_file *f, ampc_scaler *s, double *v) {
    const char *path = f->path;
    const st_meta *meta = f->meta;
    const char *en = st_meta_get(meta, "scaler.enabled");
    if (!en || strcmp(en, "1") != 0)
        return ampc__err(AMPC_ERR_FORMAT,
                         "checkpoint '%s' holds no grad scaler state (saved %s); the scaler is enabled", path,
                         en ? "from a disabled scaler" : "without a scaler");
    static const char *const keys[AMPC_SCALER_STATE_COUNT] = {
        [AMPC_SCALER_STATE_SCALE] = "scaler.scale",
        [AMPC_SCALER_STATE_GROWTH_TRACKER] = "scaler.growth_tracker",
        [AMPC_SCALER_STATE_HYSTERESIS] = "scaler.hysteresis_counter",
        [AMPC_SCALER_STATE_APPLIED] = "scaler.steps_applied",
        [AMPC_SCALER_STATE_SKIPPED] = "scaler.steps_skipped",
        [AMPC_SCALER_STATE_GROWTH_FACTOR] = "scaler.growth_factor",
        [AMPC_SCALER_STATE_BACKOFF_FACTOR] = "scaler.backoff_factor",
        [AMPC_SCALER_STATE_GROWTH_INTERVAL] = "scaler.growth_interval",
    };
    v[AMPC_SCALER_STATE_ENABLED] = 1;
    for (int k = 0; k < AMPC_SCALER_STATE_COUNT; k++) {
        if (!keys[k]) continue;
        const char *txt = st_meta_get(meta, keys[k]);
        const bool option = k >= AMPC_SCALER_STATE_GROWTH_FACTOR;   /* checkpoints before 2026-11-25 lack these */
        if (option && !txt) {
            v[k] = NAN;
        } else if (k == AMPC_SCALER_STATE_GROWTH_FACTOR || k == AMPC_SCALER_STATE_BACKOFF_FACTOR) {
            char *end;
            double x = *txt ? strtod(txt, &end) : NAN;
            if (!*txt || *end || isnan(x)) return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': bad metadata '%s'", path, keys[k]);
            v[k] = x;
        } else if (k == AMPC_SCALER_STATE_SCALE) {
            char *end;
            float x = txt && *txt ? strtof(txt, &end) : 0.0f;   /* strtof: correctly rounded to float */
            if (!txt || !*txt || *end) return ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': bad or missing metadata '%s'", path, keys[k]);
            v[k] = (double)x;
        } else {
            int64_t x;   /* the scaler checks the finer ranges */
            int rc = meta_int(path, meta, keys[k], 0, MAX_COUNT, &x);
            if (rc < 0) return rc;
            v[k] = (double)x;
        }
    }
    int rc = ampc__scaler_import(s, v, AMPC_SCALER_STATE_COUNT, true);
    if (rc < 0) {
        char msg[256];
        snprintf(msg, sizeof msg, "%s", ampc_last_error());
        return ampc__err(rc, "checkpoint '%s': %s", path, msg);
    }
    return AMPC_OK;
}

int ampc_checkpoint_load(const char *path, ampc_module *m, ampc_optimizer *opt, ampc_scaler *s, char **meta_json_out) {
    ampc__ensure_init();
    if (meta_json_out) *meta_json_out = NULL;
    if (!path || !m) return ampc__err(AMPC_ERR_INVALID, "checkpoint load: NULL %s", path ? "module" : "path");
    if (opt && ampc__optimizer_check(opt, "ampc_checkpoint_load") < 0) return ampc_last_status();
    if (ampc__scaler_check(s, "ampc_checkpoint_load") < 0) return AMPC_ERR_STATE;   /* before opt->flat */
    if (opt && opt->flat)   /* ZeRO: the file holds whole state; the shard cuts it into parts */
        return ampc__err(AMPC_ERR_INVALID, "checkpoint load: the optimizer's state is sharded over the ranks (ZeRO): load "
                         "before ampc_zero_shard");
    ampc_tensor **sd;
    const char **names;
    int n_sd = ampc_module_state_dict(m, &sd, &names);
    if (n_sd < 0) return n_sd;

    st_file f;
    opt_plan pl = {0};
    int rc = st_open(&f, path, true);
    /* the model: every tensor present with its dtype and shape, nothing unexpected */
    for (int i = 0; i < n_sd && rc == AMPC_OK; i++) {
        st_entry *e = st_find(&f, names[i]);
        if (!e) {
            char b[160];
            rc = ampc__err(AMPC_ERR_SHAPE, "checkpoint '%s' lacks the model tensor '%s' (%s %s): a different model?", path, names[i],
                           st_fmt_shape(sd[i]->ndim, sd[i]->shape, b, sizeof b), ampc_dtype_name(sd[i]->dtype));
        } else if (!entry_matches(e, sd[i])) {
            rc = mismatch(path, e, sd[i], "tensor");
        }
        if (e) e->used = true;
    }
    for (int i = 0; i < f.n && rc == AMPC_OK; i++)
        if (!f.e[i].used && !starts_with(f.e[i].name, "optimizer."))
            rc = ampc__err(AMPC_ERR_SHAPE, "checkpoint '%s' has the tensor '%s' that the model lacks: a different model?", path,
                           f.e[i].name);
    if (rc == AMPC_OK && opt) rc = plan_optimizer(&f, opt, sd, names, n_sd, &pl);
    double sv[AMPC_SCALER_STATE_COUNT];
    bool load_scaler = s && ampc_scaler_is_enabled(s);
    if (rc == AMPC_OK && load_scaler) rc = plan_scaler(&f, s, sv);
    uint64_t seed = 0, offset = 0;
    if (rc == AMPC_OK && opt &&
        (!parse_u64(st_meta_get(f.meta, "rng.seed"), &seed) || !parse_u64(st_meta_get(f.meta, "rng.offset"), &offset)))
        rc = ampc__err(AMPC_ERR_FORMAT, "checkpoint '%s': bad or missing metadata 'rng.seed'/'rng.offset'", path);
    char *meta = NULL;
    if (rc == AMPC_OK && meta_json_out && !(meta = st_meta_dump(f.meta))) rc = ampc_last_status();

    if (rc == AMPC_OK) {
        /* commit: nothing below can fail, except a copy onto a device (CUDA: a fault or out of
           memory there); host tensors are written whatever happens */
        for (int i = 0; i < n_sd; i++) {
            const st_entry *e = st_find(&f, names[i]);
            ampc__mark_written(sd[i]);
            if (ampc__write_bytes(sd[i], f.data + e->begin, (size_t)(e->end - e->begin)) < 0) rc = ampc_last_status();   /* device only */
        }
        if (opt) {
            for (int k = 0; k < pl.n_slots; k++)
                for (int i = 0; i < opt->n; i++) {
                    const st_entry *e = pl.src[k * opt->n + i];
                    if (!e) {
                        ampc__release(opt->state[k][i]);
                        opt->state[k][i] = NULL;
                        continue;
                    }
                    if (!opt->state[k][i]) {
                        opt->state[k][i] = pl.fresh[k * opt->n + i];
                        pl.fresh[k * opt->n + i] = NULL;
                    }
                    if (ampc__write_bytes(opt->state[k][i], f.data + e->begin, (size_t)(e->end - e->begin)) < 0) rc = ampc_last_status();
                }
            for (int i = 0; i < opt->n; i++) opt->steps[i] = pl.steps[i];
            ampc_optimizer_set_lr(opt, pl.lr);
            ampc_rng_set_state(seed, offset);
        }
        if (load_scaler) ampc__scaler_import(s, sv, AMPC_SCALER_STATE_COUNT, false);
        if (meta_json_out) *meta_json_out = meta;
        meta = NULL;
    }
    free(meta);
    if (opt) plan_free(&pl, opt->n);
    st_close(&f);
    return rc;
}

int ampc_checkpoint_remove_stale_temps(const char *path) {
    if (!path) return ampc__err(AMPC_ERR_INVALID, "checkpoint: NULL path");
    return ampc__remove_stale_temps(path);
}

int ampc_checkpoint_read_meta(const char *path, char **meta_json_out) {
    ampc__ensure_init();
    if (!path || !meta_json_out) return ampc__err(AMPC_ERR_INVALID, "checkpoint read_meta: NULL argument");
    *meta_json_out = NULL;
    st_file f;
    int rc = st_open(&f, path, false);
    if (rc == AMPC_OK && !(*meta_json_out = st_meta_dump(f.meta))) rc = ampc_last_status();
    st_close(&f);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Listing and comparing files' tensors

_Static_assert(sizeof ((ampc_checkpoint_tensor *)0)->shape == AMPC_MAX_DIMS * sizeof(int64_t), "io.h's shape is AMPC_MAX_DIMS long");

int ampc_checkpoint_list(const char *path, ampc_checkpoint_tensor **out) {
    ampc__ensure_init();
    if (!path || !out) return ampc__err(AMPC_ERR_INVALID, "checkpoint list: NULL argument");
    *out = NULL;
    st_file f;
    int rc = st_open(&f, path, false);
    size_t bytes = (size_t)f.n * sizeof **out;   /* the array, then the names */
    for (int i = 0; i < f.n && rc == AMPC_OK; i++) bytes += strlen(f.e[i].name) + 1;
    ampc_checkpoint_tensor *list = rc == AMPC_OK && f.n ? malloc(bytes) : NULL;
    if (rc == AMPC_OK && f.n && !list) rc = ampc__err(AMPC_ERR_OOM, "checkpoint '%s': out of memory for the list of %d tensors", path, f.n);
    char *names = list ? (char *)(list + f.n) : NULL;
    for (int i = 0; i < f.n && rc == AMPC_OK; i++) {
        const st_entry *e = &f.e[i];
        size_t len = strlen(e->name) + 1;
        list[i] = (ampc_checkpoint_tensor){.name = memcpy(names, e->name, len), .dtype = st_dtypes[e->dtype].name,
                                           .ampc_dtype = st_dtypes[e->dtype].ampc, .ndim = e->ndim,
                                           .offset = 8 + f.header_bytes + e->begin, .nbytes = e->end - e->begin};
        memcpy(list[i].shape, e->shape, sizeof e->shape);
        names += len;
    }
    if (rc == AMPC_OK) {
        *out = list;
        rc = f.n;
    }
    st_close(&f);
    return rc;
}

/* A byte count with thousands separators: "1,234,567". */
static const char *fmt_thousands(uint64_t v, char *buf, size_t n) {
    char digits[32];
    snprintf(digits, sizeof digits, "%" PRIu64, v);
    size_t len = strlen(digits), at = 0;
    for (size_t i = 0; i < len && at + 2 < n; i++) {
        if (i && (len - i) % 3 == 0) buf[at++] = ',';
        buf[at++] = digits[i];
    }
    buf[at] = '\0';
    return buf;
}

static void entry_desc(const st_entry *e, char *buf, size_t n) {
    char sh[160];
    snprintf(buf, n, "%s %s", st_dtypes[e->dtype].name, st_fmt_shape(e->ndim, e->shape, sh, sizeof sh));
}

/* Element t of floating-point tensor data as a double, read by the dtype table's converter from
   an aligned copy (the file's data need not be aligned); false for other dtypes. */
static bool float_at(const unsigned char *p, int st_dtype, uint64_t t, double *v) {
    const int dt = st_dtypes[st_dtype].ampc;
    if (dt < 0 || !ampc__dt((ampc_dtype)dt)->is_float) return false;
    const size_t es = st_dtypes[st_dtype].size;
    double aligned;   /* room for any float dtype's element */
    memcpy(&aligned, p + es * t, es);
    ampc__dt((ampc_dtype)dt)->to_f64(&aligned, v, 1);
    return true;
}

/* For a floating-point tensor that differs: ", max |a-b| D (relative R: D over max |a|)". */
static void float_diff(const unsigned char *p, const unsigned char *q, int st_dtype, uint64_t n_bytes, char *buf, size_t n) {
    double d = 0, m = 0, x, y;
    buf[0] = '\0';
    uint64_t count = n_bytes / st_dtypes[st_dtype].size;
    for (uint64_t t = 0; t < count; t++) {
        if (!float_at(p, st_dtype, t, &x) || !float_at(q, st_dtype, t, &y)) return;
        double e = x == y ? 0 : fabs(x - y);   /* inf == inf: no difference; NaN anywhere: NaN */
        d = isnan(e) || e > d ? e : d;
        m = fmax(m, fabs(x));
        if (isnan(d)) break;
    }
    snprintf(buf, n, ", max |a-b| %.3g (relative %.3g)", d, m > 0 ? d / m : d);
}

int ampc_checkpoint_compare(const char *path_a, const char *path_b, FILE *report) {
    ampc__ensure_init();
    if (!path_a || !path_b) return ampc__err(AMPC_ERR_INVALID, "checkpoint compare: NULL path");
    st_file a, b;
    int rc = st_open(&a, path_a, true);
    if (rc == AMPC_OK) rc = st_open(&b, path_b, true);
    else b = (st_file){.fd = -1};
    if (rc < 0) {
        st_close(&a);
        st_close(&b);
        return rc;
    }
    int diffs = 0;
    uint64_t bytes = 0;
    /* both tensor lists are sorted by name (as ampc_checkpoint_list gives them): one merge */
    for (int i = 0, k = 0; i < a.n || k < b.n;) {
        int c = i >= a.n ? 1 : k >= b.n ? -1 : strcmp(a.e[i].name, b.e[k].name);
        if (c) {
            const st_entry *e = c < 0 ? &a.e[i++] : &b.e[k++];
            if (diffs++ < 20 && report) fprintf(report, "differ: tensor '%s' is only in %s\n", e->name, c < 0 ? path_a : path_b);
            continue;
        }
        const st_entry *x = &a.e[i++], *y = &b.e[k++];
        char dx[200], dy[200];
        entry_desc(x, dx, sizeof dx);
        entry_desc(y, dy, sizeof dy);
        uint64_t n = x->end - x->begin;
        if (strcmp(dx, dy) != 0) {   /* the same dtype and shape: the same byte count */
            if (diffs++ < 20 && report) fprintf(report, "differ: tensor '%s': %s vs %s\n", x->name, dx, dy);
            continue;
        }
        const unsigned char *p = a.data + x->begin, *q = b.data + y->begin;
        if (n && memcmp(p, q, (size_t)n) != 0) {
            uint64_t nd = 0;
            for (uint64_t t = 0; t < n; t++) nd += p[t] != q[t];
            char fd[96];
            float_diff(p, q, x->dtype, n, fd, sizeof fd);
            if (diffs++ < 20 && report)
                fprintf(report, "differ: tensor '%s': %" PRIu64 " of %" PRIu64 " bytes differ%s\n", x->name, nd, n, fd);
        }
        bytes += n;
    }
    if (report) {
        char c1[40];
        if (diffs) fprintf(report, "checkpoints differ: %d tensor(s)\n", diffs);
        else fprintf(report, "identical: %d tensors, %s bytes of tensor data\n", a.n, fmt_thousands(bytes, c1, sizeof c1));
    }
    st_close(&a);
    st_close(&b);
    return diffs ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------
// Metadata text

ampc_checkpoint_meta *ampc_checkpoint_meta_parse(const char *meta_json) {
    if (!meta_json) return ampc__err_null(AMPC_ERR_INVALID, "checkpoint meta_parse: NULL metadata");
    st_meta *m;
    return st_meta_parse(meta_json, &m) < 0 ? NULL : (ampc_checkpoint_meta *)m;
}

const char *ampc_checkpoint_meta_find(const ampc_checkpoint_meta *m, const char *key) {
    return m && key ? st_meta_get((const st_meta *)m, key) : NULL;
}

void ampc_checkpoint_meta_free(ampc_checkpoint_meta *m) { st_meta_free((st_meta *)m); }

int ampc_checkpoint_meta_get(const char *meta_json, const char *key, char *buf, size_t n) {
    if (!meta_json || !key) return ampc__err(AMPC_ERR_INVALID, "checkpoint meta_get: NULL %s", key ? "metadata" : "key");
    ampc_checkpoint_meta *m = ampc_checkpoint_meta_parse(meta_json);   /* linear in the text: one parse, one hash lookup */
    if (!m) return ampc_last_status();
    const char *v = ampc_checkpoint_meta_find(m, key);
    int rc;
    if (v) {
        size_t len = strlen(v);
        if (buf && n) {
            size_t k = len < n - 1 ? len : n - 1;
            memcpy(buf, v, k);
            buf[k] = '\0';
        }
        rc = len > (size_t)INT32_MAX ? INT32_MAX : (int)len;
    } else {
        rc = ampc__err(AMPC_ERR_INVALID, "checkpoint metadata has no key '%s'", key);
    }
    ampc_checkpoint_meta_free(m);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Weights alone, as load_state_dict (pretrained files)

/* n values of dtype `from` at p (the file's bytes: any alignment) into dst in dtype `to`, through
   the dtype table's f64 (exact for every float dtype), so rounded once, as copy_; in chunks, so
   no whole-tensor f64 copy and no dtype the CPU device cannot hold (F64) is needed. */
static void convert_values(const unsigned char *p, ampc_dtype from, void *dst, ampc_dtype to, size_t n) {
    enum { CHUNK = 512 };
    uint64_t raw[CHUNK];   /* aligned for any dtype */
    double v[CHUNK];
    const size_t fs = ampc__dt(from)->size, ts = ampc__dt(to)->size;
    for (size_t k = 0; k < n; k += CHUNK) {
        size_t m = n - k < CHUNK ? n - k : CHUNK;
        memcpy(raw, p + k * fs, m * fs);
        ampc__dt(from)->to_f64(raw, v, m);
        ampc__dt(to)->from_f64(v, (unsigned char *)dst + k * ts, m);
    }
}

int ampc_load_state_dict(const char *path, ampc_module *m, bool strict, FILE *report, ampc_load_report *out) {
    ampc__ensure_init();
    if (out) *out = (ampc_load_report){0};
    if (!path || !m) return ampc__err(AMPC_ERR_INVALID, "load_state_dict: NULL %s", path ? "module" : "path");
    ampc_tensor **sd;
    const char **names;
    int n_sd = ampc_module_state_dict(m, &sd, &names);
    if (n_sd < 0) return n_sd;
    st_file f;
    int rc = st_open(&f, path, true);
    if (rc < 0) {
        st_close(&f);   /* a refused file may hold a parsed header */
        return rc;
    }
    ampc_load_report r = {0};
    ampc_tensor **src = calloc((size_t)(n_sd ? n_sd : 1), sizeof *src);   /* host copies in the model's dtype */
    if (!src) rc = ampc__err(AMPC_ERR_OOM, "load_state_dict: out of memory");
    char a[160], b[160];
    for (int i = 0; i < n_sd && rc == AMPC_OK; i++) {
        st_entry *e = st_find(&f, names[i]);
        const ampc_tensor *t = sd[i];
        if (!e) {
            r.missing++;
            if (report) fprintf(report, "missing: %s %s\n", names[i], st_fmt_shape(t->ndim, t->shape, a, sizeof a));
            continue;
        }
        e->used = true;
        if (!same_shape(e, t)) {
            r.mismatched++;
            if (report)
                fprintf(report, "mismatched: %s: %s in the file, %s in the model\n", names[i], st_fmt_shape(e->ndim, e->shape, a, sizeof a),
                        st_fmt_shape(t->ndim, t->shape, b, sizeof b));
            continue;
        }
        const int fdt = st_dtypes[e->dtype].ampc;
        const bool both_float = fdt >= 0 && ampc__dt((ampc_dtype)fdt)->is_float && ampc__dt(t->dtype)->is_float;
        if (fdt != (int)t->dtype && !both_float) {
            rc = ampc__err(AMPC_ERR_DTYPE, "load_state_dict '%s': tensor '%s' is %s in the file but %s in the model", path, names[i],
                           st_dtypes[e->dtype].name, ampc_dtype_name(t->dtype));
            break;
        }
        ampc_tensor *h = ampc__tensor_new(t->dtype, AMPC_DEVICE_CPU, e->ndim, e->shape);
        if (!h) {
            rc = ampc_last_status();
            break;
        }
        if (fdt == (int)t->dtype) memcpy(ampc__data(h), f.data + e->begin, (size_t)(e->end - e->begin));
        else convert_values(f.data + e->begin, (ampc_dtype)fdt, ampc__data(h), t->dtype, (size_t)h->numel);
        src[i] = h;
        r.loaded++;
    }
    for (int i = 0; i < f.n && rc == AMPC_OK; i++) {
        if (f.e[i].used || starts_with(f.e[i].name, "optimizer.")) continue;
        r.unexpected++;
        if (report) fprintf(report, "unexpected: %s %s\n", f.e[i].name, st_fmt_shape(f.e[i].ndim, f.e[i].shape, a, sizeof a));
    }
    if (rc == AMPC_OK && strict && (r.missing || r.unexpected || r.mismatched))
        rc = ampc__err(AMPC_ERR_SHAPE, "load_state_dict '%s' (strict): %d missing, %d unexpected and %d mismatched tensor(s) of %d",
                       path, r.missing, r.unexpected, r.mismatched, n_sd);
    for (int i = 0; i < n_sd && rc == AMPC_OK; i++) {   /* commit: host writes cannot fail */
        if (!src[i]) continue;
        ampc__mark_written(sd[i]);
        if (ampc__write_bytes(sd[i], ampc__data(src[i]), ampc__nbytes(sd[i])) < 0) rc = ampc_last_status();   /* a device copy */
    }
    for (int i = 0; src && i < n_sd; i++) ampc__release(src[i]);
    free(src);
    st_close(&f);
    if (out) *out = r;
    return rc;
}

bool ampc_checkpoint_meta_text_valid(const char *text) { return text && st_utf8_valid(text); }
