/*
 * outputs.c - what a run writes in --out: the folder itself (dated, runs/latest pointed at it,
 * never one that holds another run unless --overwrite yes, locked while the run writes there),
 * metrics.csv, loss.png and accuracy.png (and steplog.c's plots), confusion.csv, and the
 * per-class accuracy table of the summary.
 */
#include "plot.h"
#include "train.h"

#include <errno.h>
#include <glob.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

static int mkdir_p(const char *path) {
    char *p = strdup(path);
    if (!p) return fail("out of memory");
    for (char *c = p + 1;; c++) {
        if (*c == '/' || *c == '\0') {
            char save = *c;
            *c = '\0';
            if (mkdir(p, 0777) != 0 && errno != EEXIST) {
                int e = errno;
                free(p);
                return fail("--out: can't create '%s': %s", path, strerror(e));
            }
            *c = save;
            if (!save) break;
        }
    }
    free(p);
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode)) return fail("--out '%s' is not a folder", path);
    return 0;
}

static void link_latest(const char *out) {
    const char *slash = strrchr(out, '/'), *base = slash ? slash + 1 : out;
    char *parent = path_dir(out), *link = NULL, *tmp = NULL;
    struct stat st;
    if (!parent || !(link = path_join(parent, "latest")) || asprintf(&tmp, "%s.tmp.%ld", link, (long)getpid()) < 0) {
        tmp = NULL;
        warn("out of memory: %s/latest not updated", parent ? parent : ".");
    } else if (lstat(link, &st) == 0 && !S_ISLNK(st.st_mode)) {
        warn("%s is not a link (an older ampc-train's run?): left as it is; this run is %s", link, out);
    } else if ((unlink(tmp), symlink(base, tmp)) != 0 || rename(tmp, link) != 0) {
        warn("can't point %s at %s: %s", link, out, strerror(errno));
        unlink(tmp);
    }
    free(tmp);
    free(link);
    free(parent);
}

int out_make(settings *s) {
    int rc = 0;
    if (s->dated) {   /* runs/<date>-<time>[-k]: mkdir(2) fails on a folder that exists */
        const char *stamp = sval(s, OPT_OUT);
        char *root = path_dir(stamp), *dir = NULL;
        if (!root) return -1;
        rc = mkdir_p(root);
        for (int k = 1; rc == 0; k++) {
            free(dir);
            if (asprintf(&dir, k == 1 ? "%s" : "%s-%d", stamp, k) < 0) {
                dir = NULL;
                rc = fail("out of memory");
            } else if (mkdir(dir, 0777) == 0) {
                rc = set_val(s, OPT_OUT, dir);
                break;
            } else if (errno != EEXIST || k == 1000) {
                rc = fail("--out: can't create '%s': %s", dir, strerror(errno));
            }
        }
        free(dir);
        free(root);
        s->dated = false;
    } else {
        rc = mkdir_p(sval(s, OPT_OUT));
    }
    if (rc == 0 && s->link_latest) link_latest(sval(s, OPT_OUT));
    s->link_latest = false;
    return rc;
}

/* What an ampc-train run writes in --out; a folder with any of the first N_RUN_MARKS holds a run. */
static const char *const RUN_FILES[] = {"metrics.csv", "checkpoint.safetensors", "model.safetensors", "diverged.safetensors",
                                        "steps.csv", "numerics.csv", "confusion.csv", "loss.png", "accuracy.png", "scale.png",
                                        "steps.png", "events.out.tfevents.*"};
enum { N_RUN_MARKS = 5, N_RUN_FILES = sizeof RUN_FILES / sizeof *RUN_FILES };

/* A new run (or one resumed into another folder) never takes over a folder that holds a run,
   unless --overwrite yes deletes that run's files first. Only regular files count and go: a link
   or a FIFO planted under such a name is refused later, by the code that opens it. Called with
   the folder locked. */
static int out_check(const settings *s, const char *out) {
    struct stat a, b;
    const char *res = sval(s, OPT_RESUME);
    if (*res) {   /* resuming in the checkpoint's own folder: that run is this one */
        char *dir = path_dir(res);
        bool same = dir && stat(dir, &a) == 0 && stat(out, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
        free(dir);
        if (same) return 0;
    }
    const bool overwrite = yes(s, OPT_OVERWRITE);
    for (int i = 0; i < N_RUN_FILES; i++) {
        char *pat = path_join(out, RUN_FILES[i]);
        if (!pat) return -1;
        glob_t g;
        int found = glob(pat, GLOB_NOSORT, NULL, &g) == 0 ? (int)g.gl_pathc : 0, rc = 0;
        free(pat);
        for (int k = 0; k < found && rc == 0; k++) {
            if (lstat(g.gl_pathv[k], &a) != 0 || !S_ISREG(a.st_mode)) continue;
            if (!overwrite && i < N_RUN_MARKS)
                rc = fail("--out '%s' holds an earlier run (%s): give a new --out or --name, --resume its checkpoint to "
                          "continue it, or --overwrite yes to replace it",
                          out, RUN_FILES[i]);
            else if (overwrite && unlink(g.gl_pathv[k]) != 0 && errno != ENOENT)
                rc = fail("--overwrite: can't delete '%s': %s", g.gl_pathv[k], strerror(errno));
        }
        if (found) globfree(&g);
        if (rc < 0) return rc;
    }
    return 0;
}

/* Two runs writing one --out would mix their files: the first takes an exclusive flock(2) on
   <out>/ampc-train.lock (released however the process ends; the file stays) and writes its pid
   there; the second says who holds it. Rank 0 alone writes --out, so it alone locks. */
static int lock_out(run_outputs *o) {
    char *path = path_join(o->dir, "ampc-train.lock");
    if (!path) return -1;
    FILE *f = ampc_output_fopen(path, "--out lock", "a+");   /* never truncated before it is ours */
    int rc = 0;
    if (!f) {
        rc = fail_lib("--out");
    } else if (flock(fileno(f), LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        long pid = 0;
        rewind(f);
        if (fscanf(f, "%ld", &pid) != 1) pid = 0;   /* the holder may not have written it yet */
        char who[48] = "another process";
        if (pid > 0) snprintf(who, sizeof who, "another " PROG " (pid %ld)", pid);
        rc = e == EWOULDBLOCK ? fail("--out '%s' is in use: %s holds %s; give another --out or wait for it to end", o->dir, who, path)
                              : fail("--out '%s': can't lock %s: %s", o->dir, path, strerror(e));
        fclose(f);
    } else if (ftruncate(fileno(f), 0) != 0 || fprintf(f, "%ld\n", (long)getpid()) < 0 || fflush(f) != 0) {
        rc = fail("--out '%s': can't write %s: %s", o->dir, path, strerror(errno));
        fclose(f);
    } else {
        o->lock = f;
    }
    free(path);
    return rc;
}

char *path_dir(const char *path) {
    const char *slash = strrchr(path, '/');
    char *p = !slash ? strdup(".") : slash == path ? strdup("/") : strndup(path, (size_t)(slash - path));
    if (!p) fail("out of memory");
    return p;
}

char *path_join(const char *dir, const char *name) {
    char *p = NULL;
    if (asprintf(&p, "%s/%s", dir, name) < 0) {
        fail("out of memory");
        return NULL;
    }
    return p;
}

int draw_plots(run *r) {
    if (r->rank > 0) return 0;
    int n = r->out.hist.n;
    double *x = malloc((size_t)(n ? n : 1) * 5 * sizeof *x);
    if (!x) return fail("out of memory");
    double *tl = x + n, *vl = x + 2 * n, *ta = x + 3 * n, *va = x + 4 * n;
    for (int e = 0; e < n; e++) {
        x[e] = r->out.hist.rows[e][COL_EPOCH];
        tl[e] = r->out.hist.rows[e][COL_TRAIN_LOSS];
        vl[e] = r->out.hist.rows[e][COL_VAL_LOSS];
        ta[e] = 100 * r->out.hist.rows[e][COL_TRAIN_ACC];
        va[e] = 100 * r->out.hist.rows[e][COL_VAL_ACC];
    }
    char title[256];
    const char *prec = r->m.use_amp ? (r->m.amp_dtype == AMPC_BF16 ? "AMP bf16" : "AMP fp16") : "fp32";
    const char *what = r->d.folder ? "image folder" : strstr(r->d.desc, "Fashion") ? "Fashion-MNIST" : "IDX data";
    int rc = 0;
    char *loss_png = path_join(r->out.dir, "loss.png"), *acc_png = path_join(r->out.dir, "accuracy.png");
    if (!loss_png || !acc_png) rc = -1;
    snprintf(title, sizeof title, "%s on %s (%s): loss", sval(r->s, OPT_MODEL), what, prec);
    plot_series ls[2] = {{"train", x, tl, n, false}, {"validation", x, vl, n, false}};
    if (rc == 0 && plot_curves(loss_png, title, "epoch", "cross-entropy loss", ls, 2) < 0) rc = fail_lib("loss.png");
    snprintf(title, sizeof title, "%s on %s (%s): accuracy", sval(r->s, OPT_MODEL), what, prec);
    plot_series as[2] = {{"train", x, ta, n, false}, {"validation", x, va, n, false}};
    if (rc == 0 && plot_curves(acc_png, title, "epoch", "accuracy (%)", as, 2) < 0) rc = fail_lib("accuracy.png");
    snprintf(title, sizeof title, "%s on %s (%s)", sval(r->s, OPT_MODEL), what, prec);
    if (rc == 0) rc = steplog_plot(r, title);
    free(loss_png);
    free(acc_png);
    free(x);
    return rc;
}

/* metrics.csv (rank 0's) with the header and the history so far: on --resume the rows of the finished
   epochs come from the checkpoint, so the file matches the weights even if it was lost. */
static int open_metrics(run_outputs *o) {
    char *path = path_join(o->dir, "metrics.csv");
    if (!path) return -1;
    o->metrics = ampc_metrics_open(path, COLS, N_COLS, false);
    free(path);
    if (!o->metrics) return fail_lib("metrics.csv");
    for (int e = 0; e < o->hist.n; e++)
        if (ampc_metrics_row(o->metrics, o->hist.rows[e]) < 0) return fail_lib("metrics.csv");
    return 0;
}

int outputs_open(run *r) {
    const bool first = r->rank == 0;   /* rank 0 alone writes --out */
    run_outputs *o = &r->out;
    if (first && out_make(r->s) < 0) return -1;
    if (!(o->dir = strdup(sval(r->s, OPT_OUT)))) return fail("out of memory");
    if (first && (lock_out(o) < 0 || out_check(r->s, o->dir) < 0)) return -1;
    if (!(o->ckpt_path = path_join(o->dir, "checkpoint.safetensors")) || !(o->model_path = path_join(o->dir, "model.safetensors")) ||
        !(o->diverged_path = path_join(o->dir, "diverged.safetensors")) || (first && open_metrics(o) < 0) || steplog_open(r) < 0 ||
        tensorboard_open(r) < 0)
        return -1;
    if (first) {   /* a kill mid-save left them: never renamed */
        ampc_checkpoint_remove_stale_temps(o->ckpt_path);
        ampc_checkpoint_remove_stale_temps(o->model_path);
        ampc_checkpoint_remove_stale_temps(o->diverged_path);
    }
    printf("outputs: %s/{metrics.csv,loss.png,accuracy.png,checkpoint.safetensors,model.safetensors}\n", o->dir);
    fflush(stdout);
    return 0;
}


// ---------------------------------------------------------------------------------------------
// The last validation's confusion matrix: confusion.csv and the per-class accuracy

/* Validation samples of class t in the confusion matrix, and the class's name (NULL: none). */
static double class_samples(const run *r, int64_t t) {
    double n = 0;
    for (int64_t k = 0; k < r->d.num_classes; k++) n += r->tally.confusion[t * r->d.num_classes + k];
    return n;
}
static const char *class_name(const run *r, int64_t t) { return ampc_dataset_class_name(r->d.val ? r->d.val : r->d.train, t); }

/* After a validation pass: confusion.csv in the output folder (rank 0; the job's counts), rows
   the true class, columns the predicted one, with the classes' names where the data has them. */
int write_confusion(run *r) {
    if (r->rank != 0) return 0;
    int64_t C = r->d.num_classes;
    char *path = path_join(r->out.dir, "confusion.csv");
    FILE *f = path ? ampc_output_fopen(path, "confusion.csv", "w") : NULL;
    free(path);
    if (!f) return fail_lib("confusion.csv");
    fprintf(f, "true\\predicted");
    for (int64_t k = 0; k < C; k++) fprintf(f, ",%" PRId64, k);
    fprintf(f, ",samples,accuracy,class\n");
    for (int64_t t = 0; t < C; t++) {
        fprintf(f, "%" PRId64, t);
        for (int64_t k = 0; k < C; k++) fprintf(f, ",%.0f", r->tally.confusion[t * C + k]);
        double n = class_samples(r, t);
        const char *name = class_name(r, t);
        fprintf(f, ",%.0f,%.6f,", n, n > 0 ? r->tally.confusion[t * C + t] / n : NAN);
        for (const char *q = name ? name : ""; *q; q++) fputc(*q == ',' || *q == '\n' ? ' ' : *q, f);   /* a name as one CSV field */
        fputc('\n', f);
    }
    return fclose(f) == 0 ? 0 : fail("writing confusion.csv: %s", strerror(errno));
}

/* The last validation's per-class accuracy: every class when there are at most 20, else the five
   with the lowest (ties: the lower index; classes without samples left out). */
void print_per_class(run *r) {
    int64_t C = r->d.num_classes, show = C <= 20 ? C : 5;
    printf("  per-class validation accuracy (%s; confusion.csv has the matrix):\n", C <= 20 ? "every class" : "the 5 lowest");
    double *acc = malloc((size_t)C * sizeof *acc);
    if (!acc) return;
    for (int64_t t = 0; t < C; t++) {
        double n = class_samples(r, t);
        acc[t] = n > 0 ? r->tally.confusion[t * C + t] / n : 2;   /* 2: no samples */
    }
    for (int64_t i = 0; i < show; i++) {
        int64_t pick = C > 20 ? 0 : i;
        if (C > 20) {   /* the lowest not printed yet (printed ones are set to 3) */
            for (int64_t t = 1; t < C; t++)
                if (acc[t] < acc[pick]) pick = t;
            if (acc[pick] >= 2) break;   /* the rest have no samples or were printed */
        }
        const char *name = class_name(r, pick);
        double n = class_samples(r, pick);
        printf("    %3" PRId64 " %-24.24s %6.2f%% of %.0f\n", pick, name ? name : "", n > 0 ? 100 * r->tally.confusion[pick * C + pick] / n : NAN, n);
        if (C > 20) acc[pick] = 3;
    }
    free(acc);
}
