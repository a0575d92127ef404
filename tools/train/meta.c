/*
 * meta.c - the checkpoint's metadata, "ampc_train.*" keys (the library reserves "ampc.*"): written
 * with every checkpoint (the epoch, the step a signal stopped at and that epoch's totals, every
 * O_SAVE option, the data's sizes and the metrics history), and read back on --resume, where
 * every value is checked before use and the flags that define the run must agree with it.
 */
#include "train.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>

#define META_PREFIX "ampc_train."
/* the history, with room left for the options and the library's per-parameter keys */
_Static_assert((int64_t)MAX_EPOCHS * N_COLS * 26 + (4 << 20) <= META_MAX_BYTES, "a checkpoint's history fits the metadata --resume reads");

// ---------------------------------------------------------------------------------------------
// The metrics history: one row per finished epoch

const char *const COLS[N_COLS] = {"epoch",   "train_loss",    "train_acc", "val_loss",      "val_acc",
                                  "seconds", "samples_per_s", "scale",     "skipped_steps", "data_wait"};

int history_push(history *h, const double *row) {
    if (h->n == h->cap) {
        int cap = h->cap ? 2 * h->cap : 16;
        void *p = realloc(h->rows, (size_t)cap * sizeof *h->rows);
        if (!p) return fail("out of memory");
        h->rows = p;
        h->cap = cap;
    }
    memcpy(h->rows[h->n++], row, sizeof *h->rows);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Writing

typedef struct {
    char **kv;   /* key, value, ..., NULL */
    int n, cap;
} kv_list;

static int kv_add(kv_list *l, const char *key, const char *val) {
    if (l->n + 3 > l->cap) {
        int cap = l->cap ? 2 * l->cap : 64;
        void *p = realloc(l->kv, (size_t)cap * sizeof *l->kv);
        if (!p) return fail("out of memory");
        l->kv = p;
        l->cap = cap;
    }
    l->kv[l->n] = strdup(key);
    l->kv[l->n + 1] = strdup(val);
    l->n += 2;
    l->kv[l->n] = NULL;
    if (!l->kv[l->n - 2] || !l->kv[l->n - 1]) return fail("out of memory");
    return 0;
}

static void kv_free(kv_list *l) {
    for (int i = 0; i < l->n; i++) free(l->kv[i]);
    free(l->kv);
    memset(l, 0, sizeof *l);
}

/* Records the checkpoint a diverging run falls back to: path, after epochs_done epochs and `step`
   steps of the next one. */
static void set_last_good(run *r, const char *path, int64_t epochs_done, int64_t step) {
    if (step > 0) snprintf(r->stop.last_good, sizeof r->stop.last_good, "%s (in epoch %" PRId64 ", after step %" PRId64 ")", path, epochs_done + 1, step);
    else snprintf(r->stop.last_good, sizeof r->stop.last_good, "%s (after epoch %" PRId64 ")", path, epochs_done);
}

/* The run after epochs_done epochs and, when a signal stopped epoch epochs_done + 1, `step` of its
   training steps (its batch count: training done, validation not) with the totals so far in
   *partial and the epoch's wall time so far. */
int checkpoint_save(run *r, const char *path, const char *diverged, int64_t epochs_done, int64_t step, const pass_stats *partial,
                    double epoch_seconds) {
    kv_list kv = {0};
    char key[128], buf[64];
    int rc = kv_add(&kv, META_PREFIX "version", "1");
    if (diverged) rc = rc < 0 ? rc : kv_add(&kv, META_PREFIX "diverged", diverged);
    snprintf(buf, sizeof buf, "%" PRId64, epochs_done);
    rc = rc < 0 ? rc : kv_add(&kv, META_PREFIX "epoch", buf);
    snprintf(buf, sizeof buf, "%" PRId64, step);
    rc = rc < 0 ? rc : kv_add(&kv, META_PREFIX "step", buf);
    snprintf(buf, sizeof buf, "%d", r->world);   /* data-parallel: the processes that wrote it */
    rc = rc < 0 ? rc : kv_add(&kv, META_PREFIX "world_size", buf);
    if (rc == 0 && step > 0) {   /* the interrupted epoch's totals, each read back exactly */
        char text[512], v[7][40];
        fmt_real(partial->loss_sum, v[0], sizeof v[0]);
        snprintf(v[1], sizeof v[1], "%" PRId64, partial->correct);
        snprintf(v[2], sizeof v[2], "%" PRId64, partial->samples);
        fmt_real(partial->data_seconds, v[3], sizeof v[3]);
        fmt_real(partial->seconds, v[4], sizeof v[4]);
        snprintf(v[5], sizeof v[5], "%" PRId64, ampc_scaler_steps_skipped(r->m.scaler) - r->stop.epoch_skipped0);
        fmt_real(epoch_seconds, v[6], sizeof v[6]);
        snprintf(text, sizeof text, "%s,%s,%s,%s,%s,%s,%s", v[0], v[1], v[2], v[3], v[4], v[5], v[6]);
        rc = kv_add(&kv, META_PREFIX "partial", text);
    }
    for (int i = 0; i < OPT_COUNT && rc == 0; i++) {
        if (!(OPTS[i].flags & O_SAVE)) continue;
        snprintf(key, sizeof key, META_PREFIX "config.%s", OPTS[i].name);
        rc = kv_add(&kv, key, r->s->val[i]);
    }
    snprintf(buf, sizeof buf, "%" PRId64, ampc_dataset_size(r->d.train));
    rc = rc < 0 ? rc : kv_add(&kv, META_PREFIX "train_size", buf);
    snprintf(buf, sizeof buf, "%" PRId64, ampc_dataset_size(r->d.val));
    rc = rc < 0 ? rc : kv_add(&kv, META_PREFIX "val_size", buf);
    snprintf(buf, sizeof buf, "%" PRId64, r->d.num_classes);
    rc = rc < 0 ? rc : kv_add(&kv, META_PREFIX "num_classes", buf);
    for (int c = 0; c < N_COLS && rc == 0; c++) {   /* "0.51,0.32,0.29" per column */
        size_t cap = (size_t)r->out.hist.n * 26 + 1, at = 0;
        char *text = malloc(cap);
        if (!text) {
            rc = fail("out of memory");
            break;
        }
        text[0] = '\0';
        for (int e = 0; e < r->out.hist.n; e++) at += (size_t)snprintf(text + at, cap - at, "%s%s", e ? "," : "", fmt_real(r->out.hist.rows[e][c], buf, sizeof buf));
        snprintf(key, sizeof key, META_PREFIX "history.%s", COLS[c]);
        rc = kv_add(&kv, key, text);
        free(text);
    }
    if (rc == 0 && ampc_checkpoint_save(path, r->m.net, r->m.opt, r->m.scaler, (const char *const *)kv.kv) < 0)
        rc = fail_lib("saving the checkpoint");
    kv_free(&kv);
    if (rc == 0 && !diverged) set_last_good(r, path, epochs_done, step);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Reading back on --resume: every value is checked before use

/* The value of key; its absence is an error. */
static int meta_get(const ampc_checkpoint_meta *meta, const char *path, const char *key, const char **out) {
    if (!(*out = ampc_checkpoint_meta_find(meta, key)))
        return fail("--resume '%s': not a checkpoint of " PROG " (its metadata lacks '%s')", path, key);
    return 0;
}

/* An integer in [lo, hi]: every number read from a checkpoint is range-checked before use. */
static int meta_int(const ampc_checkpoint_meta *meta, const char *path, const char *key, int64_t lo, int64_t hi, int64_t *v) {
    const char *t;
    if (meta_get(meta, path, key, &t) < 0) return -1;
    char *end;
    errno = 0;
    long long x = strtoll(t, &end, 10);
    if (!*t || *end || errno || x < lo || x > hi)
        return fail("--resume '%s': bad metadata '%s' = '%.40s' (want an integer in [%" PRId64 ", %" PRId64 "])", path, key, t, lo, hi);
    *v = x;
    return 0;
}

/* "v1,v2,...": the number of values (commas + 1; 0 for ""). */
static int64_t count_values(const char *text) {
    if (!*text) return 0;
    int64_t n = 1;
    for (const char *p = text; *p; p++) n += *p == ',';
    return n;
}

/* The totals of an epoch a signal interrupted after `step` training steps: "loss_sum, correct,
   samples, data_seconds, seconds, skipped, epoch_seconds", each checked against the data. */
static int resume_partial(run *r, const ampc_checkpoint_meta *meta, const char *path) {
    const char *text;
    if (meta_get(meta, path, META_PREFIX "partial", &text) < 0) return -1;
    double v[7];
    int n = 0;
    bool ok = true;
    for (const char *p = text; *p && ok;) {
        char *end;
        double x = strtod(p, &end);
        /* the loss sum may be inf or NaN: steps the grad scaler skipped can have such losses */
        ok = end != p && (*end == ',' || !*end) && n < 7 && (n == 0 ? isnan(x) || x >= 0 : isfinite(x) && x >= 0);
        if (ok) v[n++] = x;
        p = *end ? end + 1 : end;
    }
    /* data-parallel: the totals are the job's, all ranks' samples: the sample the epoch goes on
       from, on any number of ranks. Each step took at least one; the steps before a change of
       the number of ranks took more per step than those after or fewer, so nothing tighter holds */
    const double n_train = (double)ampc_dataset_size(r->d.train);
    const double per = (double)answers_per_sample(&r->d);
    if (!ok || n != 7 || v[2] > n_train || v[2] != floor(v[2]) || v[2] < (double)r->resume.step || v[1] > v[2] * per || v[1] != floor(v[1]) ||
        v[5] != floor(v[5]) || v[5] > (double)r->resume.step)
        return fail("--resume '%s': bad metadata '" META_PREFIX "partial' for step %" PRId64, path, r->resume.step);
    r->resume.train = (pass_stats){.loss_sum = v[0], .correct = (int64_t)v[1], .samples = (int64_t)v[2], .data_seconds = v[3],
                                   .seconds = v[4], .steps = r->resume.step};
    r->stop.epoch_skipped0 = ampc_scaler_steps_skipped(r->m.scaler) - (int64_t)v[5];
    r->resume.epoch_seconds = v[6];
    return 0;
}

/* A value the run decides once built ("auto", --amp-dtype fastest): a resumed run keeps the
   decision its checkpoint records. */
static bool undecided(const char *v) { return strcmp(v, "auto") == 0 || strcmp(v, "fastest") == 0; }

/* The checkpoint's metadata, read and parsed once for the whole resume (each lookup a hash
   lookup), and no larger than META_MAX_BYTES: checkpoint_save never writes more. */
static int read_meta(const char *path, ampc_checkpoint_meta **out) {
    char *text = NULL;
    if (ampc_checkpoint_read_meta(path, &text) < 0) return fail_lib("--resume");
    const size_t n = strlen(text);
    int rc = 0;
    if (n > META_MAX_BYTES)
        rc = fail("--resume '%s': its metadata is %zu bytes, more than " PROG " writes (at most %d MiB)", path, n, META_MAX_BYTES >> 20);
    else if (!(*out = ampc_checkpoint_meta_parse(text)))
        rc = fail_lib("--resume");
    free(text);
    return rc;
}

/* A flag given on the command line must agree with the checkpoint where it defines the run. */
int resume_settings(settings *s, ampc_checkpoint_meta **meta_out) {
    const char *path = sval(s, OPT_RESUME), *v = NULL;
    char key[128], canon[4096];
    if (read_meta(path, meta_out) < 0) return -1;
    const ampc_checkpoint_meta *meta = *meta_out;
    int rc = meta_get(meta, path, META_PREFIX "version", &v);
    if (rc == 0 && strcmp(v, "1") != 0) rc = fail("--resume '%s': unknown " PROG " checkpoint version '%s'", path, v);
    int64_t saved_world = 1;   /* checkpoints from before data-parallel training: one process */
    bool precision_changed = false;   /* --use-amp or --amp-dtype given otherwise (options before --grad-scaler) */
    if (rc == 0 && ampc_checkpoint_meta_find(meta, META_PREFIX "world_size"))
        rc = meta_int(meta, path, META_PREFIX "world_size", 1, INT32_MAX, &saved_world);
    const char *model = ampc_checkpoint_meta_find(meta, META_PREFIX "config.model");   /* for option_applies */
    for (int i = 0; i < OPT_COUNT && rc == 0; i++) {
        if (!(OPTS[i].flags & (O_RUN | O_RESTORE))) continue;
        snprintf(key, sizeof key, META_PREFIX "config.%s", OPTS[i].name);
        /* an option newer than the checkpoint: its default is what that run did, so a flag that
           defines the run is held to it ("auto" is decided anew, as it was then) */
        const bool predates = !(v = ampc_checkpoint_meta_find(meta, key));
        if (predates && (!(OPTS[i].flags & O_RUN) || undecided(OPTS[i].def))) continue;
        if (predates) v = OPTS[i].def;
        /* what the checkpoint says must itself be a valid value */
        char why[256];
        /* an option of images in a language model's run, or the reverse, stays "auto": undecided */
        if (undecided(v) && model && !option_applies(model, i)) continue;
        if (canonical(i, v, canon, sizeof canon, why, sizeof why) < 0 || strcmp(canon, v) != 0 || undecided(v)) {
            rc = fail("--resume '%s': bad metadata '%s' = '%s'", path, key, v);
        } else if (i == OPT_BATCH_SIZE && s->given[i] && strcmp(s->val[i], v) != 0 &&
                   strtoll(s->val[i], NULL, 10) * ampc_dist_world_size() == strtoll(v, NULL, 10) * saved_world) {
            /* on another number of processes, the per-process batch that keeps the global batch
               (2 x 32 -> 1 x 64) goes on with the same steps, up to the reduction order */
            rc = 0;
        } else if (s->given[i] && (OPTS[i].flags & O_REMEDY) && strcmp(s->val[i], v) != 0 && !undecided(s->val[i])) {
            /* a remedy (resume_remedies notes it): the given value stands; a new precision
               re-derives the grad scaler's default unless it is given too */
            precision_changed |= i == OPT_USE_AMP || i == OPT_AMP_DTYPE;
            rc = 0;
        } else if (i == OPT_GRAD_SCALER && !s->given[i] && precision_changed) {
            rc = set_val(s, i, "auto");
        } else if (s->given[i] && (OPTS[i].flags & O_RUN) && strcmp(s->val[i], v) != 0 && !undecided(s->val[i])) {
            char hint[160] = "";
            const int64_t global = strtoll(v, NULL, 10) * saved_world, world = ampc_dist_world_size();
            if (i == OPT_BATCH_SIZE && global % world == 0)
                snprintf(hint, sizeof hint, "; on %" PRId64 " process(es), --batch-size %" PRId64 " keeps its global batch of %" PRId64,
                         world, global / world, global);
            if (predates) snprintf(hint, sizeof hint, "; the checkpoint predates --%s: its run had the default", OPTS[i].name);
            rc = fail("--%s %s differs from the checkpoint's --%s %s (a resumed run keeps its configuration%s)", OPTS[i].name,
                      s->val[i], OPTS[i].name, v, hint);
        } else if (!s->given[i] || (OPTS[i].flags & O_RUN)) {
            rc = set_val(s, i, v);
        }
    }
    return rc;
}

/* --resume: notes the remedies given (O_REMEDY options, resolved, that differ from the
   checkpoint's metadata, meta) and, for a checkpoint a diverged run saved, what it says. *fresh:
   the grad scaler starts afresh rather than with the checkpoint's state, as it must when the
   precision changed (another dtype's scale means nothing) or after a divergence (the scale had
   collapsed). */
static int resume_remedies(run *r, const ampc_checkpoint_meta *meta, const char *path, bool *fresh) {
    char key[128], changes[1024] = "";
    size_t at = 0;
    bool precision = false;
    for (int i = 0; i < OPT_COUNT; i++) {
        snprintf(key, sizeof key, META_PREFIX "config.%s", OPTS[i].name);
        /* an option newer than the checkpoint has nothing to differ from */
        const char *v = OPTS[i].flags & O_REMEDY ? ampc_checkpoint_meta_find(meta, key) : NULL;
        if (!v) continue;
        if (strcmp(v, r->s->val[i]) != 0) {
            precision |= i == OPT_USE_AMP || i == OPT_AMP_DTYPE || i == OPT_GRAD_SCALER;
            appendf(changes, sizeof changes, &at, "%s--%s %s (was %s)", at ? ", " : "", OPTS[i].name, *r->s->val[i] ? r->s->val[i] : "''",
                    *v ? v : "''");
        }
    }
    const char *why = ampc_checkpoint_meta_find(meta, META_PREFIX "diverged");
    const bool diverged = why != NULL;
    *fresh = ampc_scaler_is_enabled(r->m.scaler) && (precision || diverged);
    if (diverged)
        printf("note: %s was saved by a run that diverged (%.500s)\n", path, why);
    if (at)
        printf("note: changed on resume: %s\n", changes);
    else if (diverged)
        warn("resuming a diverged run as it was: it will likely diverge again; give a remedy: --amp-dtype bf16, a lower --lr, "
             "--fp32-modules for the module --doctor names, --clip-grad-norm or --use-amp no");
    if (*fresh) {
        char sc[32];
        printf("note: the grad scaler starts afresh at scale %s (%s)\n", fmt_real(ampc_scaler_get_scale(r->m.scaler), sc, sizeof sc),
               diverged ? "the checkpoint's had collapsed" : "the precision changed");
    }
    return 0;
}

int resume_state(run *r) {
    const char *path = sval(r->s, OPT_RESUME);
    const ampc_checkpoint_meta *meta = r->resume.meta;   /* resume_settings' */
    char key[128];
    /* the metadata first: whether the grad scaler's state is loaded depends on it */
    bool fresh_scaler = false;
    int rc = resume_remedies(r, meta, path, &fresh_scaler);
    if (rc == 0 && ampc_checkpoint_load(path, r->m.net, r->m.opt, fresh_scaler ? NULL : r->m.scaler, NULL) < 0) rc = fail_lib("--resume");
    /* the load restores the checkpoint's rate; a --lr given anew (the guard rails' remedy) is the
       rate from here on (a schedule derives each step's from it anyway) */
    if (rc == 0 && r->s->given[OPT_LR]) ampc_optimizer_set_lr(r->m.opt, rval(r->s, OPT_LR));
    if (rc < 0) return rc;
    int64_t n_train, n_val, n_classes;
    const int64_t max_epochs = (int64_t)OPTS[OPT_EPOCHS].hi, max_size = INT64_C(1) << 48;
    rc = meta_int(meta, path, META_PREFIX "epoch", 0, max_epochs, &r->resume.epoch0);
    if (rc == 0) rc = meta_int(meta, path, META_PREFIX "train_size", 0, max_size, &n_train);
    if (rc == 0) rc = meta_int(meta, path, META_PREFIX "val_size", 0, max_size, &n_val);
    if (rc == 0) rc = meta_int(meta, path, META_PREFIX "num_classes", 0, max_size, &n_classes);
    r->resume.step = 0;   /* checkpoints written at an epoch's end before signals were handled have no step */
    if (rc == 0 && ampc_checkpoint_meta_find(meta, META_PREFIX "step"))
        rc = meta_int(meta, path, META_PREFIX "step", 0, ampc_dataset_size(r->d.train), &r->resume.step);
    if (rc == 0 && (n_train != ampc_dataset_size(r->d.train) || n_val != ampc_dataset_size(r->d.val) || n_classes != r->d.num_classes))
        rc = fail("--resume '%s' was trained on %" PRId64 " + %" PRId64 " samples of %" PRId64 " classes, but the data has %" PRId64
                  " + %" PRId64 " of %" PRId64,
                  path, n_train, n_val, n_classes, ampc_dataset_size(r->d.train), ampc_dataset_size(r->d.val), r->d.num_classes);
    /* the global batch the checkpoint's processes took, for the note when it changes */
    int64_t saved_bs = 0;
    r->resume.saved_world = 1;   /* checkpoints from before data-parallel training: one process */
    if (rc == 0 && ampc_checkpoint_meta_find(meta, META_PREFIX "world_size"))
        rc = meta_int(meta, path, META_PREFIX "world_size", 1, INT32_MAX, &r->resume.saved_world);
    if (rc == 0) rc = meta_int(meta, path, META_PREFIX "config.batch-size", 1, INT32_MAX, &saved_bs);
    r->resume.saved_global_batch = saved_bs * r->resume.saved_world;
    if (rc == 0 && r->resume.step > 0) rc = resume_partial(r, meta, path);
    /* the history has one value per finished epoch: count them before trusting the epoch number */
    const char *first = NULL;
    snprintf(key, sizeof key, META_PREFIX "history.%s", COLS[0]);
    if (rc == 0 && (rc = meta_get(meta, path, key, &first)) == 0 && count_values(first) != r->resume.epoch0)
        rc = fail("--resume '%s': metadata '%s' has %" PRId64 " values for %" PRId64 " epochs", path, key, count_values(first), r->resume.epoch0);
    double (*cols)[N_COLS] = NULL;
    if (rc == 0 && r->resume.epoch0 > 0 && !(cols = calloc((size_t)r->resume.epoch0, sizeof *cols))) rc = fail("out of memory");
    for (int c = 0; c < N_COLS && rc == 0; c++) {
        const char *text;
        snprintf(key, sizeof key, META_PREFIX "history.%s", COLS[c]);
        if (c == COL_DATA_WAIT && !ampc_checkpoint_meta_find(meta, key)) {   /* older checkpoint: not measured */
            for (int64_t e = 0; e < r->resume.epoch0; e++) cols[e][c] = NAN;
            continue;
        }
        if ((rc = meta_get(meta, path, key, &text)) < 0) break;
        int64_t n = 0;
        for (const char *p = text; *p && rc == 0;) {
            char *end;
            double v = strtod(p, &end);
            if (end == p || (*end && *end != ',') || n >= r->resume.epoch0) rc = fail("--resume '%s': bad metadata '%s'", path, key);
            else cols[n++][c] = v;
            p = *end ? end + 1 : end;
        }
        if (rc == 0 && n != r->resume.epoch0)
            rc = fail("--resume '%s': metadata '%s' has %" PRId64 " values for %" PRId64 " epochs", path, key, n, r->resume.epoch0);
    }
    for (int64_t e = 0; e < r->resume.epoch0 && rc == 0; e++) rc = history_push(&r->out.hist, cols[e]);
    free(cols);
    if (rc == 0) set_last_good(r, path, r->resume.epoch0, r->resume.step);
    return rc;
}
