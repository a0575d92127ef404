/*
 * ampc-train.c - the training program: PyTorch's train.py for image classifiers, in C.
 *
 *     ampc-train                                   the cnn on Fashion-MNIST, bf16 autocast
 *     ampc-train --model resnet18 --data ~/256_ObjectCategories --image-size 64 --epochs 10
 *     ampc-train --resume runs/latest/checkpoint.safetensors --epochs 8
 *     ampc-train --compare --epochs 1              fp32 vs AMP side by side (make demo)
 *     ampc-train --compare-checkpoints A B         are two checkpoints' tensors bit-identical?
 *
 * Each epoch trains under autocast with one GradScaler for the whole run (fp16: enabled, bf16:
 * off unless --grad-scaler yes), then validates in eval mode under no-grad and autocast (no
 * scaler), appends a row to <out>/metrics.csv, redraws <out>/loss.png and <out>/accuracy.png
 * and replaces <out>/checkpoint.safetensors atomically. The checkpoint's metadata holds the epoch,
 * the whole configuration and the metrics history, so --resume restores the run exactly:
 * model, optimizer, scaler and RNG state come back bit for bit, the loader's order depends only
 * on (seed, epoch) and dropout draws from the restored global generator, so N epochs straight
 * and k epochs + resume + N-k epochs end with the same weights, bit for bit.
 *
 * Defaults, chosen to pass 91% test accuracy on Fashion-MNIST within a few epochs: the cnn, Adam
 * lr 0.001, batch 64 (PyTorch's MNIST example's), 5 epochs, bf16 autocast, seed 1 (measured:
 * 91.89% under AMP, 92.11% in fp32 after 5 epochs; SGD lr 0.01 momentum 0.9 at batch 128 stayed
 * under 90%).
 *
 * Errors in the input (flags, dataset, checkpoint, out of memory under --max-memory) print one
 * line "ampc-train: error: ..." on stderr and exit with status 1 (2 for usage errors). A run that
 * diverges (a non-finite loss, a loss above --max-loss, --max-skipped-steps skipped steps in a
 * row, a collapsed loss scale, NaN/inf weights) stops with status 3 and never replaces its last
 * good checkpoint. SIGINT/SIGTERM stop at the next step boundary with a checkpoint that records
 * the position inside the epoch (resumed bit-exactly) and exit 128 + the signal; a second one
 * stops at once. The checkpoint is written before the metrics row, so after a kill metrics.csv
 * (rebuilt from the checkpoint on resume) never runs ahead of it.
 *
 * The file: configuration (one table of options: parsing, defaults, printing, the checkpoint's
 * metadata, the checks on --resume), datasets, training and validation, outputs, the run,
 * then the comparison modes and main. The progress bar lives in progress.c.
 */
#include "ampc.h"
#include "plot.h"
#include "progress.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#define PROG "ampc-train"

/* Fashion-MNIST's and MNIST's pixel statistics (training sets), for Normalize as in PyTorch's
   examples; ImageNet's for image folders, as torchvision's reference scripts use. */
static const float FASHION_MEAN = 0.2860f, FASHION_STD = 0.3530f;
static const float MNIST_MEAN = 0.1307f, MNIST_STD = 0.3081f;
static const float IMAGENET_MEAN[3] = {0.485f, 0.456f, 0.406f}, IMAGENET_STD[3] = {0.229f, 0.224f, 0.225f};

// ---------------------------------------------------------------------------------------------
// Errors: the first one is kept and printed once, by main, as the program's only error line

static char g_err[2048];
static int g_err_status;   /* ampc status of a library failure (AMPC_ERR_OOM gets a hint), or 0 */
static int g_exit = 1;     /* 2: a usage error */
static bool g_usage;       /* the error is about the command line: point at --help */
static bool g_interrupt;   /* not an error: a signal stopped the run after saving ("interrupted: ...") */
/* What to try after running out of memory, by phase: building the model or training it. */
static const char *g_oom_hint = "try a smaller --batch-size or --use-amp yes";
static char g_oom_advice[1024];   /* the measured advice of oom_advice(), when there is one */

static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...) {
    if (g_err[0]) return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    for (char *c = g_err; *c; c++)   /* one line, whatever a message holds */
        if (*c == '\n' || *c == '\r') *c = ' ';
    return -1;
}

/* A library call failed: "what: <ampc_last_error()>". */
static int fail_lib(const char *what) {
    if (!g_err[0]) g_err_status = ampc_last_status();
    return fail("%s: %s", what, ampc_last_error());
}

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_error(const char *fmt, ...) {
    if (g_err[0]) return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    g_exit = 2;
    g_usage = true;
    return -1;
}

static void warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void warn(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fflush(stdout);
    fputs(PROG ": warning: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

// ---------------------------------------------------------------------------------------------
// Formatting

/* 25557032 -> "25,557,032" */
static const char *fmt_count(int64_t v, char *buf, size_t n) {
    char digits[32];
    snprintf(digits, sizeof digits, "%" PRId64, v < 0 ? -v : v);
    size_t len = strlen(digits), at = 0;
    char out[48];
    if (v < 0) out[at++] = '-';
    for (size_t i = 0; i < len; i++) {
        if (i && (len - i) % 3 == 0) out[at++] = ',';
        out[at++] = digits[i];
    }
    out[at] = '\0';
    snprintf(buf, n, "%s", out);
    return buf;
}

static const char *fmt_bytes(double b, char *buf, size_t n) {
    if (b >= 1024.0 * 1024 * 1024) snprintf(buf, n, "%.2f GiB", b / (1024.0 * 1024 * 1024));
    else if (b >= 1024.0 * 1024) snprintf(buf, n, "%.1f MiB", b / (1024.0 * 1024));
    else if (b >= 1024.0) snprintf(buf, n, "%.1f KiB", b / 1024.0);
    else snprintf(buf, n, "%.0f B", b);
    return buf;
}

/* The shortest text that reads back as the same double ("0.01", not "0.01000000000000000021"). */
static const char *fmt_real(double v, char *buf, size_t n) {
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, n, "%.*g", p, v);
        if (strtod(buf, NULL) == v) break;
    }
    return buf;
}

// ---------------------------------------------------------------------------------------------
// Options: one table drives parsing, defaults, --help, the printed configuration, the
// checkpoint's metadata and the checks of --resume.

typedef enum { V_CHOICE, V_YESNO, V_INT, V_REAL, V_SIZE, V_TEXT } vkind;

enum {
    O_SAVE = 1,      /* written to the checkpoint's metadata (the full configuration) */
    O_RUN = 2,       /* defines the run: on --resume it comes from the checkpoint; given, it must agree */
    O_RESTORE = 4,   /* on --resume, taken from the checkpoint unless given (may differ) */
    O_AUTO = 8,      /* accepts "auto": resolved once the data and model are known */
};

typedef enum {
    OPT_MODEL, OPT_DATA, OPT_BATCH_SIZE, OPT_USE_AMP, OPT_AMP_DTYPE, OPT_GRAD_SCALER, OPT_EPOCHS, OPT_LR,
    OPT_OPTIMIZER, OPT_MOMENTUM, OPT_WEIGHT_DECAY, OPT_SEED, OPT_VAL_SPLIT, OPT_IMAGE_SIZE, OPT_INDEX_CSV, OPT_LIMIT_TRAIN,
    OPT_LIMIT_VAL, OPT_THREADS, OPT_NUM_WORKERS, OPT_MAX_MEMORY, OPT_OUT, OPT_RESUME, OPT_PROGRESS, OPT_CHANNELS_LAST,
    OPT_KEEP_CASTS, OPT_MAX_SKIPPED, OPT_MAX_LOSS, OPT_COUNT
} opt_id;

typedef struct {
    const char *name;      /* the flag without "--"; the metadata key "ampc_train.config.<name>" */
    vkind kind;
    const char *def;       /* default text */
    const char *choices;   /* V_CHOICE: "a|b|c" */
    double lo, hi;         /* V_INT/V_REAL: allowed range (inclusive; V_REAL lo exclusive if lo_open) */
    bool lo_open;
    unsigned flags;
    const char *metavar, *help;
} opt_def;

#define BIG 9.2e18
static const opt_def OPTS[OPT_COUNT] = {
    [OPT_MODEL] = {"model", V_CHOICE, "cnn", "mlp|cnn|resnet18|resnet50", 0, 0, false, O_SAVE | O_RUN, "NAME",
                   "mlp, cnn (PyTorch's MNIST example net), resnet18 or resnet50 (torchvision's)"},
    [OPT_DATA] = {"data", V_TEXT, "", NULL, 0, 0, false, O_SAVE | O_RESTORE, "DIR",
                  "a folder with IDX files ({train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]) or an image folder "
                  "(one subfolder of .jpg/.png images per class); default: Fashion-MNIST from Debian's "
                  "dataset-fashion-mnist (or $AMPC_FASHION_MNIST_DIR)"},
    [OPT_BATCH_SIZE] = {"batch-size", V_INT, "64", NULL, 1, 1 << 20, false, O_SAVE | O_RUN, "N", "samples per step"},
    [OPT_USE_AMP] = {"use-amp", V_YESNO, "yes", NULL, 0, 0, false, O_SAVE | O_RUN, "yes|no",
                     "automatic mixed precision (autocast) for training and validation"},
    [OPT_AMP_DTYPE] = {"amp-dtype", V_CHOICE, "auto", "bf16|fp16", 0, 0, false, O_SAVE | O_RUN | O_AUTO, "bf16|fp16",
                       "autocast's lower precision (auto: bf16 where the CPU has bf16 arithmetic, AVX512-BF16 or AMX; "
                       "fp16 elsewhere)"},
    [OPT_GRAD_SCALER] = {"grad-scaler", V_YESNO, "auto", NULL, 0, 0, false, O_SAVE | O_RUN | O_AUTO, "yes|no",
                         "loss scaling (auto: yes for fp16 autocast, no for bf16 and fp32)"},
    [OPT_EPOCHS] = {"epochs", V_INT, "5", NULL, 0, 1e9, false, O_SAVE | O_RESTORE, "N",
                    "epochs in all (with --resume: the total, including the finished ones; 0: print the setup "
                    "and stop)"},
    [OPT_LR] = {"lr", V_REAL, "auto", NULL, 0, 1e6, true, O_SAVE | O_RUN | O_AUTO, "X",
                "learning rate (auto: 0.01 for sgd, 0.001 for adam/adamw)"},
    [OPT_OPTIMIZER] = {"optimizer", V_CHOICE, "adam", "sgd|adam|adamw", 0, 0, false, O_SAVE | O_RUN, "NAME",
                       "sgd (with --momentum), adam or adamw"},
    [OPT_MOMENTUM] = {"momentum", V_REAL, "0.9", NULL, 0, 1, false, O_SAVE | O_RUN, "X", "SGD momentum, in [0, 1)"},
    [OPT_WEIGHT_DECAY] = {"weight-decay", V_REAL, "auto", NULL, 0, 1e6, false, O_SAVE | O_RUN | O_AUTO, "X",
                          "L2 penalty (auto: 0, or 0.01 for adamw as in PyTorch)"},
    [OPT_SEED] = {"seed", V_INT, "1", NULL, 0, BIG, false, O_SAVE | O_RUN, "N",
                  "seeds initialisation, dropout, shuffling and the validation split"},
    [OPT_VAL_SPLIT] = {"val-split", V_REAL, "0.1", NULL, 0, 1, true, O_SAVE | O_RUN, "X",
                       "fraction held out for validation when the data has no test set (image folders)"},
    [OPT_IMAGE_SIZE] = {"image-size", V_INT, "auto", NULL, 8, 4096, false, O_SAVE | O_RUN | O_AUTO, "N",
                        "images are resized to N x N (auto: 28 for IDX data and for mlp/cnn, 64 for ResNets on "
                        "folders; ResNets use the small-input stem for N <= 64)"},
    [OPT_INDEX_CSV] = {"index-csv", V_TEXT, "", NULL, 0, 0, false, O_SAVE | O_RESTORE, "FILE",
                       "image folders: CSV index (image_path,target) read instead of scanning; written after "
                       "the scan when FILE does not exist (the usual preprocess step)"},
    [OPT_LIMIT_TRAIN] = {"limit-train", V_INT, "0", NULL, 0, BIG, false, O_SAVE | O_RUN, "N",
                         "use only the first N training samples (0: all)"},
    [OPT_LIMIT_VAL] = {"limit-val", V_INT, "0", NULL, 0, BIG, false, O_SAVE | O_RUN, "N",
                       "use only the first N validation samples (0: all)"},
    [OPT_THREADS] = {"threads", V_INT, "auto", NULL, 1, 1024, false, O_SAVE | O_AUTO, "N",
                     "compute threads (auto: OpenMP's default, $OMP_NUM_THREADS or the cores)"},
    [OPT_NUM_WORKERS] = {"num-workers", V_INT, "auto", NULL, 0, 64, false, O_SAVE | O_AUTO, "N",
                         "data loader threads (auto: 0 for IDX data, 2 for image folders)"},
    [OPT_MAX_MEMORY] = {"max-memory", V_SIZE, "none", NULL, 0, 0, false, O_SAVE, "SIZE",
                        "memory budget emulating a device of that size, e.g. 512M, 2G, 1.5GiB (K, M, G, T are "
                        "powers of 1024; none: no limit)"},
    [OPT_OUT] = {"out", V_TEXT, "runs/latest", NULL, 0, 0, false, O_SAVE, "DIR",
                 "output folder, created if needed (with --resume: the checkpoint's folder)"},
    [OPT_RESUME] = {"resume", V_TEXT, "", NULL, 0, 0, false, 0, "FILE", "continue the run saved in this checkpoint"},
    [OPT_PROGRESS] = {"progress", V_CHOICE, "auto", "auto|bar|lines|off", 0, 0, false, 0, "MODE",
                      "progress display (auto: a bar on a terminal, a line per 10% otherwise)"},
    [OPT_CHANNELS_LAST] = {"channels-last", V_YESNO, "yes", NULL, 0, 0, false, O_SAVE, "yes|no",
                           "cnn/ResNet activations in channels-last memory format (faster: no layout reorders "
                           "around the convolutions; the same results up to summation order)"},
    [OPT_KEEP_CASTS] = {"keep-casts", V_YESNO, "yes", NULL, 0, 0, false, O_SAVE, "yes|no",
                        "keep autocast's 16-bit weight copies across steps, rewritten by the optimizer's pass "
                        "(faster, bit-identical results; no: recast every step as PyTorch does, 2 bytes per "
                        "parameter less while the optimizer steps)"},
    [OPT_MAX_SKIPPED] = {"max-skipped-steps", V_INT, "30", NULL, 0, 1e9, false, O_SAVE, "N",
                         "stop as diverged when the grad scaler skips N steps in a row (inf/NaN gradients at every "
                         "scale it tried; 0: never)"},
    [OPT_MAX_LOSS] = {"max-loss", V_REAL, "1e+04", NULL, 0, 1e300, true, O_SAVE, "X",
                      "stop as diverged when a training step's loss exceeds X (cross-entropy starts near ln(classes))"},
};

typedef struct {
    char *val[OPT_COUNT];   /* canonical text of each option (malloc'd) */
    bool given[OPT_COUNT];  /* on the command line */
    bool compare;           /* --compare: fp32 then AMP, side by side */
} settings;

static void settings_free(settings *s) {
    for (int i = 0; i < OPT_COUNT; i++) free(s->val[i]);
    memset(s, 0, sizeof *s);
}

static int set_val(settings *s, int i, const char *text) {
    char *c = strdup(text);
    if (!c) return fail("out of memory");
    free(s->val[i]);
    s->val[i] = c;
    return 0;
}

static int settings_copy(settings *dst, const settings *src) {
    memset(dst, 0, sizeof *dst);
    for (int i = 0; i < OPT_COUNT; i++)
        if (set_val(dst, i, src->val[i]) < 0) return -1;
    memcpy(dst->given, src->given, sizeof dst->given);
    dst->compare = src->compare;
    return 0;
}

/* "512M" -> bytes; K, M, G, T (optionally followed by "iB" or "B") are powers of 1024. */
static bool parse_size(const char *s, double *bytes) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno || !isfinite(v) || v < 0) return false;
    double mul = 1;
    static const char units[] = "KMGT";
    const char *u = *end ? strchr(units, toupper((unsigned char)*end)) : NULL;
    if (u) {
        mul = pow(1024, (double)(u - units) + 1);
        end++;
        if (strcasecmp(end, "iB") == 0) end += 2;
    }
    if (strcasecmp(end, "B") == 0) end++;
    if (*end) return false;
    *bytes = floor(v * mul);
    return *bytes < 9.0e18;
}

/* Checks text against option i and writes its canonical form to out; on a bad value, -1 and the
   reason in err. */
static int canonical(int i, const char *text, char *out, size_t n, char *err, size_t errn) {
    const opt_def *o = &OPTS[i];
    if ((o->flags & O_AUTO) && strcmp(text, "auto") == 0) {
        snprintf(out, n, "auto");
        return 0;
    }
    switch (o->kind) {
    case V_CHOICE: {
        size_t len = strlen(text);
        for (const char *c = o->choices; *c;) {
            const char *bar = strchr(c, '|');
            size_t l = bar ? (size_t)(bar - c) : strlen(c);
            if (l == len && strncmp(c, text, l) == 0) {
                snprintf(out, n, "%s", text);
                return 0;
            }
            c += l + (bar ? 1 : 0);
        }
        return snprintf(err, errn, "--%s takes %s, not '%s'", o->name, o->choices, text), -1;
    }
    case V_YESNO:
        if (!strcmp(text, "yes") || !strcmp(text, "true") || !strcmp(text, "on") || !strcmp(text, "1")) snprintf(out, n, "yes");
        else if (!strcmp(text, "no") || !strcmp(text, "false") || !strcmp(text, "off") || !strcmp(text, "0")) snprintf(out, n, "no");
        else return snprintf(err, errn, "--%s takes yes or no, not '%s'", o->name, text), -1;
        return 0;
    case V_INT: {
        char *end;
        errno = 0;
        long long v = strtoll(text, &end, 10);
        if (!*text || *end || errno || (double)v < o->lo || (double)v > o->hi)
            return snprintf(err, errn, "--%s takes an integer in [%.0f, %.0f], not '%s'", o->name, o->lo, o->hi, text), -1;
        snprintf(out, n, "%lld", v);
        return 0;
    }
    case V_REAL: {
        char *end;
        errno = 0;
        double v = strtod(text, &end);
        bool ok = *text && !*end && !errno && isfinite(v) && (o->lo_open ? v > o->lo : v >= o->lo) &&
                  (i == OPT_MOMENTUM || i == OPT_VAL_SPLIT ? v < o->hi : v <= o->hi);
        if (!ok) {
            char lo[32], hi[32];
            bool hi_open = i == OPT_MOMENTUM || i == OPT_VAL_SPLIT;
            return snprintf(err, errn, "--%s takes a number in %c%s, %s%c, not '%s'", o->name, o->lo_open ? '(' : '[',
                               fmt_real(o->lo, lo, sizeof lo), fmt_real(o->hi, hi, sizeof hi), hi_open ? ')' : ']', text), -1;
        }
        fmt_real(v, out, n);
        return 0;
    }
    case V_SIZE: {
        double b;
        if (strcmp(text, "none") == 0 || strcmp(text, "0") == 0) {
            snprintf(out, n, "none");
            return 0;
        }
        if (!parse_size(text, &b) || b < 1)
            return snprintf(err, errn, "--%s takes a size like 512M, 2G or 1.5GiB (or none), not '%s'", o->name, text), -1;
        snprintf(out, n, "%.0f", b);
        return 0;
    }
    case V_TEXT:
        if (i != OPT_DATA && i != OPT_INDEX_CSV && !*text) return snprintf(err, errn, "--%s needs a value", o->name), -1;
        snprintf(out, n, "%s", text);
        return 0;
    }
    return snprintf(err, errn, "--%s: internal error", o->name), -1;
}

static const char *sval(const settings *s, int i) { return s->val[i]; }
static bool is_auto(const settings *s, int i) { return strcmp(s->val[i], "auto") == 0; }
static int64_t ival(const settings *s, int i) { return strtoll(s->val[i], NULL, 10); }
static double rval(const settings *s, int i) { return strtod(s->val[i], NULL); }
static bool yes(const settings *s, int i) { return strcmp(s->val[i], "yes") == 0; }

/* "  --flag METAVAR   help text" with the text wrapped at 100 columns under its first line. */
static void print_option(const char *flag, const char *text) {
    printf("  %-26s ", flag);
    int col = 29;
    for (const char *w = text; *w;) {
        while (*w == ' ') w++;
        size_t len = strcspn(w, " ");
        if (col > 29 && col + 1 + (int)len > 100) {
            printf("\n%29s", "");
            col = 29;
        }
        printf("%s%.*s", col > 29 ? " " : "", (int)len, w);
        col += (col > 29) + (int)len;
        w += len;
    }
    printf("\n");
}

static void print_help(void) {
    printf("usage: " PROG " [options]\n"
           "Trains an image classifier with automatic mixed precision: the cnn on Fashion-MNIST by default.\n\n");
    for (int i = 0; i < OPT_COUNT; i++) {
        const opt_def *o = &OPTS[i];
        char flag[64], text[1024];
        snprintf(flag, sizeof flag, "--%s %s", o->name, o->metavar);
        snprintf(text, sizeof text, "%s%s%s%s", o->help, *o->def && strcmp(o->def, "auto") != 0 ? " [default: " : "",
                 *o->def && strcmp(o->def, "auto") != 0 ? o->def : "", *o->def && strcmp(o->def, "auto") != 0 ? "]" : "");
        print_option(flag, text);
    }
    print_option("--compare", "train twice, fp32 then AMP (--amp-dtype), into <out>/fp32 and <out>/amp, and print both "
                              "side by side (make demo)");
    print_option("--compare-checkpoints A B", "exit 0 if the two checkpoints hold bit-identical tensors (weights, "
                                              "buffers and optimizer state), 1 if not");
    print_option("--help", "this text");
    printf("\nDefaults: the cnn, Adam lr 0.001, batch 64 (PyTorch's MNIST example's batch), 5 epochs, bf16 autocast:\n"
           "about 91-92%% test accuracy on Fashion-MNIST. Data is normalised (Fashion-MNIST's or MNIST's mean/std;\n"
           "ImageNet's for image folders, whose training images are also mirrored at random).\n"
           "\nEach epoch prints one line: losses and accuracies, the epoch's and the training loop's wall time,\n"
           "the training throughput, the mean time per step and the data wait, the share of the training loop's\n"
           "time spent getting batches from the data loader (decoding them with --num-workers 0, waiting for the\n"
           "workers otherwise).\n"
           "\nOutputs in --out: metrics.csv (per epoch: epoch, train_loss, train_acc, val_loss, val_acc, seconds,\n"
           "samples_per_s, scale, skipped_steps, data_wait; accuracies are fractions, seconds the epoch's wall\n"
           "time, samples_per_s the training throughput, scale and skipped_steps the grad scaler's scale at the\n"
           "end of the epoch and the steps it skipped in it, data_wait the data wait as a fraction; nan for\n"
           "epochs resumed from a checkpoint that did not record it), loss.png, accuracy.png,\n"
           "checkpoint.safetensors (replaced after every epoch). Flags take '--flag value' or '--flag=value'.\n"
           "Errors print one line \"" PROG ": error: ...\" on stderr; exit status 1 (2: bad command line, 3: the run\n"
           "diverged). SIGINT/SIGTERM save a checkpoint at the next step and exit 128 + signal (130, 143).\n");
}

/* Command line -> settings (defaults for what is not given). Returns 0, 1 for --help, or -1. */
static int parse_args(int argc, char **argv, settings *s, const char **cmp_a, const char **cmp_b) {
    memset(s, 0, sizeof *s);
    char canon[4096];
    for (int i = 0; i < OPT_COUNT; i++)
        if (set_val(s, i, OPTS[i].def) < 0) return -1;
    for (int a = 1; a < argc; a++) {
        const char *arg = argv[a];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) return 1;
        if (!strcmp(arg, "--compare")) {
            s->compare = true;
            continue;
        }
        if (!strcmp(arg, "--compare-checkpoints")) {
            if (a + 2 >= argc) return usage_error("--compare-checkpoints needs two files");
            *cmp_a = argv[a + 1];
            *cmp_b = argv[a + 2];
            a += 2;
            continue;
        }
        if (strncmp(arg, "--", 2) != 0) return usage_error("unexpected argument '%s'", arg);
        const char *eq = strchr(arg, '=');
        size_t len = eq ? (size_t)(eq - arg - 2) : strlen(arg + 2);
        int id = -1;
        for (int i = 0; i < OPT_COUNT; i++)
            if (strlen(OPTS[i].name) == len && strncmp(OPTS[i].name, arg + 2, len) == 0) id = i;
        if (id < 0) return usage_error("unknown option '%.*s'", (int)(len + 2), arg);
        const char *v = eq ? eq + 1 : NULL;
        if (!v) {
            if (a + 1 >= argc) return usage_error("--%s needs a value (%s)", OPTS[id].name, OPTS[id].metavar);
            v = argv[++a];
        }
        if (s->given[id]) return usage_error("--%s given twice", OPTS[id].name);
        char why[256];
        if (canonical(id, v, canon, sizeof canon, why, sizeof why) < 0) return usage_error("%s", why);
        if (set_val(s, id, canon) < 0) return -1;
        s->given[id] = true;
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Metrics history: one row per finished epoch, kept in the checkpoint to redraw the plots

/* New columns go at the end (scripts read columns by position); one that checkpoints of an
   older ampc-train lack reads back as NaN on --resume (see resume_state). */
enum { COL_EPOCH, COL_TRAIN_LOSS, COL_TRAIN_ACC, COL_VAL_LOSS, COL_VAL_ACC, COL_SECONDS, COL_SPS, COL_SCALE, COL_SKIPPED,
       COL_DATA_WAIT, N_COLS };
static const char *const COLS[N_COLS] = {"epoch",   "train_loss",    "train_acc", "val_loss",      "val_acc",
                                         "seconds", "samples_per_s", "scale",     "skipped_steps", "data_wait"};

typedef struct {
    double (*rows)[N_COLS];
    int n, cap;
} history;

static int history_push(history *h, const double *row) {
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
// Datasets

typedef struct {
    ampc_dataset *train, *val;
    char desc[512];          /* "Fashion-MNIST (/usr/share/datasets/fashion-mnist)" */
    const char *val_name;    /* "t10k test set" or "held-out split" */
    bool folder;
    int64_t c, h, w;         /* sample shape after transforms */
    int64_t num_classes;
    int64_t full_train, full_val;   /* before --limit-* */
    ampc_transforms *tf_train, *tf_val;
} data;

static void data_free(data *d) {
    ampc_dataset_free(d->train);
    ampc_dataset_free(d->val);
    ampc_transforms_free(d->tf_train);
    ampc_transforms_free(d->tf_val);
    memset(d, 0, sizeof *d);
}

static bool file_exists(const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static bool has_idx(const char *dir, const char *prefix) {
    char a[64], b[64];
    snprintf(a, sizeof a, "%s-images-idx3-ubyte", prefix);
    snprintf(b, sizeof b, "%s-images-idx3-ubyte.gz", prefix);
    return file_exists(dir, a) || file_exists(dir, b);
}

static ampc_dataset *first_n(ampc_dataset *ds, int64_t limit) {
    int64_t n = ampc_dataset_size(ds);
    if (limit <= 0 || limit >= n) return ds;
    int64_t *idx = malloc((size_t)limit * sizeof *idx);
    if (!idx) {
        ampc_dataset_free(ds);
        fail("out of memory");
        return NULL;
    }
    for (int64_t i = 0; i < limit; i++) idx[i] = i;
    ampc_dataset *sub = ampc_dataset_subset(ds, idx, limit);
    free(idx);
    ampc_dataset_free(ds);   /* the subset holds its own reference */
    if (!sub) fail_lib("taking the first samples");
    return sub;
}

/* Resolves --image-size and --num-workers ("auto") for the kind of data, then opens it. */
static int data_open(settings *s, data *d) {
    memset(d, 0, sizeof *d);
    const char *model = sval(s, OPT_MODEL);
    bool resnet = strncmp(model, "resnet", 6) == 0;
    const char *path = sval(s, OPT_DATA);
    const char *dir = path;
    bool fashion = false;
    if (!*path) {
        dir = ampc_fashion_mnist_dir();
        if (!dir)
            return fail("Fashion-MNIST not found: install Debian's dataset-fashion-mnist (scripts/install-deps.sh), "
                        "set AMPC_FASHION_MNIST_DIR, or give --data DIR");
        fashion = true;
    } else {
        struct stat st;
        if (stat(path, &st) != 0) return fail("--data '%s': %s", path, strerror(errno));
        if (!S_ISDIR(st.st_mode))
            return fail("--data '%s' is not a folder (expected IDX files or one subfolder of images per class)", path);
    }
    bool idx = fashion || has_idx(dir, "train");
    d->folder = !idx;
    if (is_auto(s, OPT_NUM_WORKERS) && set_val(s, OPT_NUM_WORKERS, idx ? "0" : "2") < 0) return -1;
    if (is_auto(s, OPT_IMAGE_SIZE) && set_val(s, OPT_IMAGE_SIZE, idx || !resnet ? "28" : "64") < 0) return -1;
    int64_t size = ival(s, OPT_IMAGE_SIZE);
    uint64_t seed = (uint64_t)ival(s, OPT_SEED);
    d->tf_train = ampc_transforms_new();
    d->tf_val = ampc_transforms_new();
    if (!d->tf_train || !d->tf_val) return fail_lib("transforms");

    ampc_dataset *all = NULL;
    if (idx) {
        if (fashion) {
            d->train = ampc_dataset_fashion_mnist_open(dir, true);
            snprintf(d->desc, sizeof d->desc, "Fashion-MNIST (%s)", dir);
        } else {
            d->train = ampc_dataset_mnist_open(dir, true);
            snprintf(d->desc, sizeof d->desc, "IDX files in %s", dir);
        }
        if (!d->train) return fail_lib("--data");
        if (fashion || has_idx(dir, "t10k")) {
            d->val = fashion ? ampc_dataset_fashion_mnist_open(dir, false) : ampc_dataset_mnist_open(dir, false);
            if (!d->val) return fail_lib("--data");
            d->val_name = "t10k test set";
        } else {
            all = d->train;
            d->train = NULL;
        }
        bool fashion_names = fashion || (ampc_dataset_class_name(d->train ? d->train : all, 0) != NULL);
        float mean = fashion_names ? FASHION_MEAN : MNIST_MEAN, sd = fashion_names ? FASHION_STD : MNIST_STD;
        for (int k = 0; k < 2; k++) {
            ampc_transforms *t = k ? d->tf_val : d->tf_train;
            if ((size != 28 && ampc_transforms_add_resize(t, size, size) < 0) || ampc_transforms_add_normalize(t, 1, &mean, &sd) < 0)
                return fail_lib("transforms");
        }
    } else {
        ampc_folder_options fo = {.height = size, .width = size, .channels = 3,
                                  .index_csv = *sval(s, OPT_INDEX_CSV) ? sval(s, OPT_INDEX_CSV) : NULL};
        all = ampc_dataset_folder_open(dir, &fo);
        if (!all) return fail_lib("--data");
        int64_t skipped = ampc_dataset_folder_skipped(all);
        char extra[96] = "";
        if (skipped) snprintf(extra, sizeof extra, "; skipped %" PRId64 " file(s) that are not readable images", skipped);
        snprintf(d->desc, sizeof d->desc, "image folder %s (%" PRId64 " classes%s)", dir, ampc_dataset_num_classes(all), extra);
        /* torchvision's usual recipe: random mirror for training, ImageNet normalisation */
        if (ampc_transforms_add_hflip(d->tf_train, 0.5) < 0 || ampc_transforms_add_normalize(d->tf_train, 3, IMAGENET_MEAN, IMAGENET_STD) < 0 ||
            ampc_transforms_add_normalize(d->tf_val, 3, IMAGENET_MEAN, IMAGENET_STD) < 0)
            return fail_lib("transforms");
    }
    if (all) {   /* no test set: a reproducible split keyed by --seed */
        int rc = ampc_dataset_split(all, rval(s, OPT_VAL_SPLIT), seed, &d->train, &d->val);
        d->num_classes = ampc_dataset_num_classes(all);
        ampc_dataset_free(all);
        if (rc < 0) return fail_lib("--val-split");
        d->val_name = "held-out split";
        if (ampc_dataset_size(d->val) == 0 || ampc_dataset_size(d->train) == 0)
            return fail("--data '%s': %" PRId64 " samples are too few for --val-split %s", dir,
                        ampc_dataset_size(d->val) + ampc_dataset_size(d->train), sval(s, OPT_VAL_SPLIT));
    } else {
        d->num_classes = ampc_dataset_num_classes(d->train);
    }
    d->full_train = ampc_dataset_size(d->train);
    d->full_val = ampc_dataset_size(d->val);
    if (!(d->train = first_n(d->train, ival(s, OPT_LIMIT_TRAIN)))) return -1;
    if (!(d->val = first_n(d->val, ival(s, OPT_LIMIT_VAL)))) return -1;
    int64_t c, h, w;
    ampc_dataset_sample_shape(d->train, &c, &h, &w);
    if (ampc_transforms_output_shape(d->tf_train, c, h, w, &d->c, &d->h, &d->w) < 0) return fail_lib("transforms");
    /* every split must give the model the same images: a mismatch found now, not after an epoch */
    int64_t vc, vh, vw;
    ampc_dataset_sample_shape(d->val, &c, &h, &w);
    if (ampc_transforms_output_shape(d->tf_val, c, h, w, &vc, &vh, &vw) < 0) return fail_lib("transforms");
    if (vc != d->c || vh != d->h || vw != d->w)
        return fail("--data '%s': the validation images (%s) are %" PRId64 "x%" PRId64 "x%" PRId64 " but the training images are %" PRId64
                    "x%" PRId64 "x%" PRId64 " (channels x height x width); give both splits one shape, or --image-size to resize both",
                    dir, d->val_name, vc, vh, vw, d->c, d->h, d->w);
    if (!resnet && (d->h != 28 || d->w != 28))
        return fail("--model %s needs 28x28 images, not %" PRId64 "x%" PRId64 " (--image-size 28)", model, d->h, d->w);
    if (d->num_classes < 2) return fail("--data: %" PRId64 " class(es); a classifier needs at least 2", d->num_classes);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// A training run: everything one run owns

typedef struct {
    double seconds, train_seconds, samples_per_s, peak_total, peak[AMPC_MEM_KIND_COUNT];
    double data_seconds;   /* of train_seconds, the time spent waiting for the training loader */
    double train_loss, train_acc, val_loss, val_acc, scale;
    int64_t skipped, epochs_run, samples;
    bool ok;
} run_result;

/* One pass's running totals; a pass interrupted by a signal saves them in the checkpoint so a
   resumed run prints and records the same epoch. */
typedef struct {
    double loss, acc, seconds;
    double data_seconds;   /* of seconds, the time spent in ampc_loader_next (waiting for a batch) */
    double loss_sum;       /* sum of per-sample losses */
    int64_t correct, samples, steps;
} pass_stats;

typedef struct {
    settings *s;
    data d;
    ampc_module *net;
    ampc_optimizer *opt;
    ampc_scaler *scaler;
    ampc_loader *train_ld, *val_ld;
    ampc_metrics *metrics;
    history hist;
    int64_t epoch0;          /* epochs finished before this session (from --resume) */
    bool use_amp;
    ampc_dtype amp_dtype;
    char *out;               /* output folder */
    char *ckpt_path;
    float *logits_buf;       /* (batch, classes) f32 copy of the logits, to count correct answers */
    /* --resume of a checkpoint written mid-epoch (after a signal): epoch epoch0 + 1 continues at
       training step resume_step (== its batch count: only validation is left) with these totals */
    int64_t resume_step;
    pass_stats resume_train;
    double resume_epoch_seconds;
    /* divergence checks: the scaler's skipped-step count last seen, and the run of skips */
    int64_t skipped_seen, skipped_in_a_row;
    int64_t epoch_skipped0;   /* the scaler's skipped-step count when the current epoch began */
    char last_good[4200];    /* "<path> (after epoch N)" of the last checkpoint written or resumed, or "" */
} run;

static void run_free(run *r) {
    ampc_loader_free(r->train_ld);
    ampc_loader_free(r->val_ld);
    ampc_metrics_close(r->metrics);
    ampc_scaler_free(r->scaler);
    ampc_optimizer_free(r->opt);
    ampc_module_free(r->net);
    data_free(&r->d);
    free(r->hist.rows);
    free(r->out);
    free(r->ckpt_path);
    free(r->logits_buf);
    memset(r, 0, sizeof *r);
}

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

static char *path_join(const char *dir, const char *name) {
    char *p = NULL;
    if (asprintf(&p, "%s/%s", dir, name) < 0) {
        fail("out of memory");
        return NULL;
    }
    return p;
}

// ---------------------------------------------------------------------------------------------
// Signals: SIGINT/SIGTERM stop the run at the next step boundary with a checkpoint that resumes
// exactly; a second one stops at once (the signal's default action). Handlers are installed only
// while epochs run: during the setup there is nothing to save.

static volatile sig_atomic_t g_signal;

static void on_stop_signal(int sig) {
    if (g_signal) {   /* the second: at once */
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    g_signal = sig;
    static const char msg[] = "\n" PROG ": stopping at the end of this step to save a checkpoint (signal again to stop at once)\n";
    ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)w;
}

static void stop_signals_install(bool on) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on ? on_stop_signal : SIG_DFL;
    sa.sa_flags = SA_RESTART;   /* reads, writes and fsync in flight go on */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

// ---------------------------------------------------------------------------------------------
// Divergence: a run that trains on garbage stops instead of overwriting its good checkpoint

#define EXIT_DIVERGED 3
#define MIN_LOSS_SCALE 5.9604644775390625e-08   /* 2^-24: below it every fp16 gradient of a loss <= 1 underflows */

static int diverged(run *r, int64_t epoch, int64_t step, int64_t n_steps, const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static int diverged(run *r, int64_t epoch, int64_t step, int64_t n_steps, const char *fmt, ...) {
    char why[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    char where[96] = "";
    if (step > 0) snprintf(where, sizeof where, " at step %" PRId64 " of %" PRId64, step, n_steps);
    fail("training diverged in epoch %" PRId64 "%s: %s; stopped without saving: %s%s (try a lower --lr)", epoch + 1, where, why,
         r->last_good[0] ? "the last good checkpoint is " : "no checkpoint was written", r->last_good);
    g_exit = EXIT_DIVERGED;
    return -1;
}

/* After a training step: the loss, and the grad scaler's skips and scale. x is the step's batch. */
static int check_step(run *r, int64_t epoch, int64_t step, int64_t n_steps, double loss, ampc_tensor *x) {
    int64_t sk = ampc_scaler_steps_skipped(r->scaler);
    r->skipped_in_a_row = sk > r->skipped_seen ? r->skipped_in_a_row + (sk - r->skipped_seen) : 0;
    r->skipped_seen = sk;
    bool scaled = ampc_scaler_is_enabled(r->scaler);
    if (!isfinite(loss)) {
        int64_t bad = ampc_tensor_count_nonfinite(x);
        if (bad > 0)
            return fail("the training batch of epoch %" PRId64 ", step %" PRId64 " holds %" PRId64 " NaN/inf input value(s): the data "
                        "is corrupt", epoch + 1, step, bad);
        if (!scaled) return diverged(r, epoch, step, n_steps, "the loss is %g", loss);
    } else if (loss > rval(r->s, OPT_MAX_LOSS)) {
        return diverged(r, epoch, step, n_steps, "the loss %g exceeds --max-loss %s", loss, sval(r->s, OPT_MAX_LOSS));
    }
    if (!scaled) return 0;
    int64_t max_skip = ival(r->s, OPT_MAX_SKIPPED);
    float scale = ampc_scaler_get_scale(r->scaler);
    if (max_skip > 0 && r->skipped_in_a_row >= max_skip)
        return diverged(r, epoch, step, n_steps, "the grad scaler skipped %" PRId64 " steps in a row (inf/NaN gradients down to scale %g; "
                        "--max-skipped-steps %" PRId64 ")", r->skipped_in_a_row, (double)scale, max_skip);
    if (scale < MIN_LOSS_SCALE)
        return diverged(r, epoch, step, n_steps, "the loss scale collapsed to %g (below 2^-24, where every fp16 gradient underflows)",
                        (double)scale);
    return 0;
}

/* Before a checkpoint replaces the last one: no NaN/inf in the weights, buffers or optimizer state
   (epoch: the 0-based epoch that made them, for the message). */
static int check_finite_state(run *r, int64_t epoch) {
    ampc_tensor **sd;
    int n = ampc_module_state_dict(r->net, &sd, NULL);
    if (n < 0) return fail_lib("checking the weights");
    int64_t model = 0;
    for (int i = 0; i < n; i++) {
        int64_t b = ampc_tensor_count_nonfinite(sd[i]);
        if (b < 0) return fail_lib("checking the weights");
        model += b;
    }
    int64_t opt = ampc_optimizer_count_nonfinite(r->opt);
    if (opt < 0) return fail_lib("checking the optimizer state");
    if (model == 0 && opt == 0) return 0;
    return diverged(r, epoch, 0, 0, "the weights and buffers hold %" PRId64 " NaN/inf value(s) (with the optimizer's state: %" PRId64 ")",
                    model, opt);
}

// ---------------------------------------------------------------------------------------------
// Checkpoint metadata: "ampc_train.*" keys (the library reserves "ampc.*")

#define META_PREFIX "ampc_train."

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
    if (step > 0) snprintf(r->last_good, sizeof r->last_good, "%s (in epoch %" PRId64 ", after step %" PRId64 ")", path, epochs_done + 1, step);
    else snprintf(r->last_good, sizeof r->last_good, "%s (after epoch %" PRId64 ")", path, epochs_done);
}

/* The run after epochs_done epochs and, when a signal stopped epoch epochs_done + 1, `step` of its
   training steps (its batch count: training done, validation not) with the totals so far in
   *partial and the epoch's wall time so far. Refuses (diverged) to replace the last checkpoint
   with NaN/inf weights or optimizer state. */
static int save_checkpoint(run *r, int64_t epochs_done, int64_t step, const pass_stats *partial, double epoch_seconds) {
    if (check_finite_state(r, step > 0 || epochs_done == 0 ? epochs_done : epochs_done - 1) < 0) return -1;   /* the epoch just trained */
    kv_list kv = {0};
    char key[128], buf[64];
    int rc = kv_add(&kv, META_PREFIX "version", "1");
    snprintf(buf, sizeof buf, "%" PRId64, epochs_done);
    rc = rc < 0 ? rc : kv_add(&kv, META_PREFIX "epoch", buf);
    snprintf(buf, sizeof buf, "%" PRId64, step);
    rc = rc < 0 ? rc : kv_add(&kv, META_PREFIX "step", buf);
    if (rc == 0 && step > 0) {   /* the interrupted epoch's totals, each read back exactly */
        char text[512], v[7][40];
        fmt_real(partial->loss_sum, v[0], sizeof v[0]);
        snprintf(v[1], sizeof v[1], "%" PRId64, partial->correct);
        snprintf(v[2], sizeof v[2], "%" PRId64, partial->samples);
        fmt_real(partial->data_seconds, v[3], sizeof v[3]);
        fmt_real(partial->seconds, v[4], sizeof v[4]);
        snprintf(v[5], sizeof v[5], "%" PRId64, ampc_scaler_steps_skipped(r->scaler) - r->epoch_skipped0);
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
        size_t cap = (size_t)r->hist.n * 26 + 1, at = 0;
        char *text = malloc(cap);
        if (!text) {
            rc = fail("out of memory");
            break;
        }
        text[0] = '\0';
        for (int e = 0; e < r->hist.n; e++) at += (size_t)snprintf(text + at, cap - at, "%s%s", e ? "," : "", fmt_real(r->hist.rows[e][c], buf, sizeof buf));
        snprintf(key, sizeof key, META_PREFIX "history.%s", COLS[c]);
        rc = kv_add(&kv, key, text);
        free(text);
    }
    if (rc == 0 && ampc_checkpoint_save(r->ckpt_path, r->net, r->opt, r->scaler, (const char *const *)kv.kv) < 0)
        rc = fail_lib("saving the checkpoint");
    kv_free(&kv);
    if (rc == 0) set_last_good(r, r->ckpt_path, epochs_done, step);
    return rc;
}

static int meta_get(const char *meta, const char *path, const char *key, char **out) {
    int len = ampc_checkpoint_meta_get(meta, key, NULL, 0);
    if (len < 0) {
        if (ampc_last_status() == AMPC_ERR_INVALID)
            return fail("--resume '%s': not a checkpoint of " PROG " (its metadata lacks '%s')", path, key);
        return fail_lib("--resume");
    }
    *out = malloc((size_t)len + 1);
    if (!*out) return fail("out of memory");
    ampc_checkpoint_meta_get(meta, key, *out, (size_t)len + 1);
    return 0;
}

/* An integer in [lo, hi]: every number read from a checkpoint is range-checked before use. */
static int meta_int(const char *meta, const char *path, const char *key, int64_t lo, int64_t hi, int64_t *v) {
    char *t;
    if (meta_get(meta, path, key, &t) < 0) return -1;
    char *end;
    errno = 0;
    long long x = strtoll(t, &end, 10);
    bool ok = *t && !*end && !errno && x >= lo && x <= hi;
    if (!ok) fail("--resume '%s': bad metadata '%s' = '%.40s' (want an integer in [%" PRId64 ", %" PRId64 "])", path, key, t, lo, hi);
    free(t);
    if (!ok) return -1;
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
static int resume_partial(run *r, const char *meta, const char *path) {
    char *text;
    if (meta_get(meta, path, META_PREFIX "partial", &text) < 0) return -1;
    double v[7];
    int n = 0;
    bool ok = true;
    for (char *p = text; *p && ok;) {
        char *end;
        double x = strtod(p, &end);
        ok = end != p && (*end == ',' || !*end) && n < 7 && isfinite(x) && x >= 0;
        if (ok) v[n++] = x;
        p = *end ? end + 1 : end;
    }
    free(text);
    int64_t bs = ival(r->s, OPT_BATCH_SIZE), n_train = ampc_dataset_size(r->d.train);
    int64_t want = r->resume_step * bs < n_train ? r->resume_step * bs : n_train;
    if (!ok || n != 7 || v[2] != (double)want || v[1] > v[2] || v[1] != floor(v[1]) || v[5] != floor(v[5]) || v[5] > (double)r->resume_step)
        return fail("--resume '%s': bad metadata '" META_PREFIX "partial' for step %" PRId64, path, r->resume_step);
    r->resume_train = (pass_stats){.loss_sum = v[0], .correct = (int64_t)v[1], .samples = (int64_t)v[2], .data_seconds = v[3],
                                   .seconds = v[4], .steps = r->resume_step};
    r->epoch_skipped0 = ampc_scaler_steps_skipped(r->scaler) - (int64_t)v[5];
    r->resume_epoch_seconds = v[6];
    return 0;
}

/* --resume, before anything is built: the run's settings from the checkpoint's metadata (a flag
   given on the command line must agree where it defines the run). */
static int resume_settings(settings *s) {
    const char *path = sval(s, OPT_RESUME);
    char *meta = NULL, *v = NULL, key[128], canon[4096];
    if (ampc_checkpoint_read_meta(path, &meta) < 0) return fail_lib("--resume");
    int rc = meta_get(meta, path, META_PREFIX "version", &v);
    if (rc == 0 && strcmp(v, "1") != 0) rc = fail("--resume '%s': unknown " PROG " checkpoint version '%s'", path, v);
    free(v);
    for (int i = 0; i < OPT_COUNT && rc == 0; i++) {
        if (!(OPTS[i].flags & (O_RUN | O_RESTORE))) continue;
        snprintf(key, sizeof key, META_PREFIX "config.%s", OPTS[i].name);
        if ((rc = meta_get(meta, path, key, &v)) < 0) break;
        /* what the checkpoint says must itself be a valid value */
        char why[256];
        if (canonical(i, v, canon, sizeof canon, why, sizeof why) < 0 || strcmp(canon, v) != 0 || strcmp(v, "auto") == 0) {
            rc = fail("--resume '%s': bad metadata '%s' = '%s'", path, key, v);
        } else if (s->given[i] && (OPTS[i].flags & O_RUN) && strcmp(s->val[i], v) != 0 &&
                   !(strcmp(s->val[i], "auto") == 0)) {
            rc = fail("--%s %s differs from the checkpoint's --%s %s (a resumed run keeps its configuration)", OPTS[i].name,
                      s->val[i], OPTS[i].name, v);
        } else if (!s->given[i] || (OPTS[i].flags & O_RUN)) {
            rc = set_val(s, i, v);
        }
        free(v);
    }
    free(meta);
    return rc;
}

/* Restores model, optimizer, scaler and RNG, then the epoch counter and the metrics history. */
static int resume_state(run *r) {
    const char *path = sval(r->s, OPT_RESUME);
    char *meta = NULL, key[128];
    if (ampc_checkpoint_load(path, r->net, r->opt, r->scaler, &meta) < 0) return fail_lib("--resume");
    int64_t n_train, n_val, n_classes;
    const int64_t max_epochs = (int64_t)OPTS[OPT_EPOCHS].hi, max_size = INT64_C(1) << 48;
    int rc = meta_int(meta, path, META_PREFIX "epoch", 0, max_epochs, &r->epoch0);
    if (rc == 0) rc = meta_int(meta, path, META_PREFIX "train_size", 0, max_size, &n_train);
    if (rc == 0) rc = meta_int(meta, path, META_PREFIX "val_size", 0, max_size, &n_val);
    if (rc == 0) rc = meta_int(meta, path, META_PREFIX "num_classes", 0, max_size, &n_classes);
    r->resume_step = 0;   /* checkpoints written at an epoch's end before signals were handled have no step */
    if (rc == 0 && ampc_checkpoint_meta_get(meta, META_PREFIX "step", NULL, 0) != AMPC_ERR_INVALID)
        rc = meta_int(meta, path, META_PREFIX "step", 0, ampc_loader_num_batches(r->train_ld), &r->resume_step);
    if (rc == 0 && (n_train != ampc_dataset_size(r->d.train) || n_val != ampc_dataset_size(r->d.val) || n_classes != r->d.num_classes))
        rc = fail("--resume '%s' was trained on %" PRId64 " + %" PRId64 " samples of %" PRId64 " classes, but the data has %" PRId64
                  " + %" PRId64 " of %" PRId64,
                  path, n_train, n_val, n_classes, ampc_dataset_size(r->d.train), ampc_dataset_size(r->d.val), r->d.num_classes);
    if (rc == 0 && r->resume_step > 0) rc = resume_partial(r, meta, path);
    /* the history has one value per finished epoch: count them before trusting the epoch number */
    char *first = NULL;
    snprintf(key, sizeof key, META_PREFIX "history.%s", COLS[0]);
    if (rc == 0 && (rc = meta_get(meta, path, key, &first)) == 0 && count_values(first) != r->epoch0)
        rc = fail("--resume '%s': metadata '%s' has %" PRId64 " values for %" PRId64 " epochs", path, key, count_values(first), r->epoch0);
    free(first);
    double (*cols)[N_COLS] = NULL;
    if (rc == 0 && r->epoch0 > 0 && !(cols = calloc((size_t)r->epoch0, sizeof *cols))) rc = fail("out of memory");
    for (int c = 0; c < N_COLS && rc == 0; c++) {
        char *text;
        snprintf(key, sizeof key, META_PREFIX "history.%s", COLS[c]);
        if (c == COL_DATA_WAIT && ampc_checkpoint_meta_get(meta, key, NULL, 0) == AMPC_ERR_INVALID) {   /* older checkpoint: not measured */
            for (int64_t e = 0; e < r->epoch0; e++) cols[e][c] = NAN;
            continue;
        }
        if ((rc = meta_get(meta, path, key, &text)) < 0) break;
        int64_t n = 0;
        for (char *p = text; *p && rc == 0;) {
            char *end;
            double v = strtod(p, &end);
            if (end == p || (*end && *end != ',') || n >= r->epoch0) rc = fail("--resume '%s': bad metadata '%s'", path, key);
            else cols[n++][c] = v;
            p = *end ? end + 1 : end;
        }
        if (rc == 0 && n != r->epoch0)
            rc = fail("--resume '%s': metadata '%s' has %" PRId64 " values for %" PRId64 " epochs", path, key, n, r->epoch0);
        free(text);
    }
    for (int64_t e = 0; e < r->epoch0 && rc == 0; e++) rc = history_push(&r->hist, cols[e]);
    free(cols);
    free(meta);
    if (rc == 0) set_last_good(r, path, r->epoch0, r->resume_step);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Training and validation

/* Number of rows of logits (B, C) whose argmax (the first maximum) equals the label. */
static int count_correct(run *r, ampc_tensor *logits, ampc_tensor *labels, int64_t *correct) {
    int64_t b = ampc_tensor_dim(logits, 0), c = ampc_tensor_dim(logits, 1);
    if (ampc_tensor_to_f32(logits, r->logits_buf, (size_t)(b * c)) < 0) return fail_lib("reading the logits");
    const int64_t *y = ampc_tensor_cdata(labels);
    for (int64_t i = 0; i < b; i++) {
        const float *row = r->logits_buf + i * c;
        int64_t best = 0;
        for (int64_t k = 1; k < c; k++)
            if (row[k] > row[best]) best = k;
        *correct += best == y[i];
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Passes

/* One pass over a loader: training (autocast forward, scaled backward, scaler step) or
   validation (eval mode, no-grad, autocast, no scaler). A training pass may continue one that a
   signal stopped (first_batch > 0, totals in *carry). Returns 0 at the end of the pass, 1 when a
   signal stopped it (st holds the totals so far), -1 on an error. */
static int run_pass(run *r, bool training, int64_t epoch, pass_stats *st, int64_t first_batch, const pass_stats *carry) {
    ampc_loader *ld = training ? r->train_ld : r->val_ld;
    int64_t n_epochs = ival(r->s, OPT_EPOCHS);
    char label[64];
    snprintf(label, sizeof label, "epoch %" PRId64 "/%" PRId64 " %s", epoch + 1, n_epochs, training ? "train" : "val  ");
    memset(st, 0, sizeof *st);
    if (carry) *st = *carry;
    ampc_module_train(r->net, training);
    if (ampc_loader_start_epoch_at(ld, epoch, first_batch) < 0) return fail_lib("data loader");
    int64_t n_batches = ampc_loader_num_batches(ld), done = first_batch;
    double t0 = progress_now() - st->seconds;
    progress p;
    progress_begin(&p, label, n_batches);
    if (!training && p.mode == PROGRESS_LINES) p.mode = PROGRESS_OFF;   /* a log gets the epoch's line only */
    if (!training) ampc_no_grad_enter();
    int depth = ampc_scope_depth(), rc = 0;
    for (;;) {
        if (g_signal) {
            rc = 1;
            break;
        }
        ampc_scope_begin();   /* the step's tensors are released at its end */
        ampc_tensor *x, *y;
        double tw = progress_now();
        int more = ampc_loader_next(ld, &x, &y);
        st->data_seconds += progress_now() - tw;   /* the loader's cost as the step sees it: decode or wait */
        if (more <= 0) {
            if (more < 0) rc = fail_lib("data loader");
            break;
        }
        ampc_autocast_enter(r->amp_dtype, r->use_amp);
        ampc_tensor *logits = ampc_module_forward(r->net, x);
        ampc_tensor *loss = ampc_cross_entropy(logits, y, NULL);
        ampc_autocast_exit();
        if (!loss) {
            rc = fail_lib(training ? "training (forward)" : "validation");
            break;
        }
        if (training) {
            if (ampc_backward(ampc_scaler_scale(r->scaler, loss)) < 0) {
                rc = fail_lib("training (backward)");
                break;
            }
            if (ampc_scaler_step(r->scaler, r->opt) < 0 || ampc_scaler_update(r->scaler) < 0) {
                rc = fail_lib("training (optimizer step)");
                break;
            }
            ampc_optimizer_zero_grad(r->opt);
        }
        int64_t b = ampc_tensor_dim(y, 0);
        double lv = ampc_tensor_item(loss);
        if (training && (rc = check_step(r, epoch, done + 1, n_batches, lv, x)) < 0) break;
        st->loss_sum += lv * (double)b;
        if ((rc = count_correct(r, logits, y, &st->correct)) < 0) break;
        st->samples += b;
        ampc_scope_end();
        done++;
        /* a bar keeps room for its cells on an 80-column terminal: the running loss only */
        double run_loss = st->loss_sum / (double)st->samples, run_acc = 100.0 * (double)st->correct / (double)st->samples;
        if (p.mode == PROGRESS_BAR) progress_update(&p, done, "loss=%.4f", run_loss);
        else progress_update(&p, done, "loss=%.4f acc=%.2f%%", run_loss, run_acc);
    }
    while (ampc_scope_depth() > depth) ampc_scope_end();
    if (!training) ampc_no_grad_exit();
    if (rc != 0 && p.mode == PROGRESS_BAR) fputc('\n', p.out);   /* the next line starts on its own line */
    if (rc < 0) return rc;
    if (rc == 0) progress_end(&p);
    st->seconds = progress_now() - t0;
    st->steps = done;
    st->loss = st->samples ? st->loss_sum / (double)st->samples : NAN;
    st->acc = st->samples ? (double)st->correct / (double)st->samples : NAN;
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Outputs: metrics.csv, loss.png, accuracy.png

static int draw_plots(run *r) {
    int n = r->hist.n;
    double *x = malloc((size_t)(n ? n : 1) * 5 * sizeof *x);
    if (!x) return fail("out of memory");
    double *tl = x + n, *vl = x + 2 * n, *ta = x + 3 * n, *va = x + 4 * n;
    for (int e = 0; e < n; e++) {
        x[e] = r->hist.rows[e][COL_EPOCH];
        tl[e] = r->hist.rows[e][COL_TRAIN_LOSS];
        vl[e] = r->hist.rows[e][COL_VAL_LOSS];
        ta[e] = 100 * r->hist.rows[e][COL_TRAIN_ACC];
        va[e] = 100 * r->hist.rows[e][COL_VAL_ACC];
    }
    char title[256];
    const char *prec = r->use_amp ? (r->amp_dtype == AMPC_BF16 ? "AMP bf16" : "AMP fp16") : "fp32";
    const char *what = r->d.folder ? "image folder" : strstr(r->d.desc, "Fashion") ? "Fashion-MNIST" : "IDX data";
    int rc = 0;
    char *loss_png = path_join(r->out, "loss.png"), *acc_png = path_join(r->out, "accuracy.png");
    if (!loss_png || !acc_png) rc = -1;
    snprintf(title, sizeof title, "%s on %s (%s): loss", sval(r->s, OPT_MODEL), what, prec);
    plot_series ls[2] = {{"train", x, tl, n}, {"validation", x, vl, n}};
    if (rc == 0 && plot_curves(loss_png, title, "epoch", "cross-entropy loss", ls, 2) < 0) rc = fail_lib("loss.png");
    snprintf(title, sizeof title, "%s on %s (%s): accuracy", sval(r->s, OPT_MODEL), what, prec);
    plot_series as[2] = {{"train", x, ta, n}, {"validation", x, va, n}};
    if (rc == 0 && plot_curves(acc_png, title, "epoch", "accuracy (%)", as, 2) < 0) rc = fail_lib("accuracy.png");
    if (rc < 0 && g_err_status == AMPC_ERR_UNSUPPORTED) {   /* no pngcairo driver: keep training */
        warn("no plots: %s", g_err);
        g_err[0] = '\0';
        g_err_status = 0;
        rc = 0;
    }
    free(loss_png);
    free(acc_png);
    free(x);
    return rc;
}

/* metrics.csv with the header and the history so far: on --resume the rows of the finished
   epochs come from the checkpoint, so the file matches the weights even if it was lost. */
static int open_metrics(run *r) {
    char *path = path_join(r->out, "metrics.csv");
    if (!path) return -1;
    r->metrics = ampc_metrics_open(path, COLS, N_COLS, false);
    free(path);
    if (!r->metrics) return fail_lib("metrics.csv");
    for (int e = 0; e < r->hist.n; e++)
        if (ampc_metrics_row(r->metrics, r->hist.rows[e]) < 0) return fail_lib("metrics.csv");
    return 0;
}

// ---------------------------------------------------------------------------------------------
// The run

static void print_setup(run *r) {
    settings *s = r->s;
    char b1[32], b2[32], b3[64];
    printf("configuration:\n");
    for (int i = 0; i < OPT_COUNT; i++) {
        if (i == OPT_PROGRESS) continue;
        const char *v = s->val[i];
        if (i == OPT_DATA) v = r->d.desc;
        if (i == OPT_RESUME && !*v) v = "no";
        if (i == OPT_MAX_MEMORY && strcmp(v, "none") != 0) {
            snprintf(b3, sizeof b3, "%s (%s bytes)", fmt_bytes(strtod(v, NULL), b1, sizeof b1), fmt_count(ival(s, i), b2, sizeof b2));
            v = b3;
        }
        const char *note = "";
        if (i == OPT_MOMENTUM && strcmp(sval(s, OPT_OPTIMIZER), "sgd") != 0) note = "  (unused: not sgd)";
        if (i == OPT_AMP_DTYPE && !r->use_amp) note = "  (unused: --use-amp no)";
        if ((i == OPT_LIMIT_TRAIN || i == OPT_LIMIT_VAL) && ival(s, i) == 0) v = "all";
        printf("  %-14s %s%s\n", OPTS[i].name, v, note);
    }
    printf("  %-14s %s, %d threads\n", "cpu", ampc_cpu_features(), ampc_get_num_threads());
    int64_t ntr = ampc_dataset_size(r->d.train), nva = ampc_dataset_size(r->d.val);
    char c1[32], c2[32], c3[32], c4[32];
    printf("data: %s training samples", fmt_count(ntr, c1, sizeof c1));
    if (ntr != r->d.full_train) printf(" (first of %s)", fmt_count(r->d.full_train, c3, sizeof c3));
    printf(", %s validation samples (%s", fmt_count(nva, c2, sizeof c2), r->d.val_name);
    if (nva != r->d.full_val) printf(", first of %s", fmt_count(r->d.full_val, c4, sizeof c4));
    printf("); %" PRId64 " classes, %" PRId64 "x%" PRId64 "x%" PRId64 " images\n", r->d.num_classes, r->d.c, r->d.h, r->d.w);
    printf("%s total parameters.\n", fmt_count(ampc_module_num_parameters(r->net, false), c1, sizeof c1));
    printf("%s trainable parameters.\n", fmt_count(ampc_module_num_parameters(r->net, true), c1, sizeof c1));
    fflush(stdout);
}

/* The images fit the model: one forward pass of a batch of one before any training, in eval mode,
   without autograd and in fp32 (no random draws, no weight casts: the run is unchanged). */
static int check_model_input(run *r) {
    const int64_t shape[4] = {1, r->d.c, r->d.h, r->d.w};
    ampc_scope_begin();
    ampc_no_grad_enter();
    ampc_module_train(r->net, false);
    ampc_tensor *x = ampc_tensor_zeros(AMPC_F32, 4, shape);
    ampc_tensor *y = x ? ampc_module_forward(r->net, x) : NULL;
    int rc = 0;
    if (!y)
        rc = ampc_last_status() == AMPC_ERR_OOM
                 ? fail_lib("building the model")
                 : fail("--model %s does not take the data's %" PRId64 "x%" PRId64 "x%" PRId64 " images: %s", sval(r->s, OPT_MODEL),
                        r->d.c, r->d.h, r->d.w, ampc_last_error());
    else if (ampc_tensor_ndim(y) != 2 || ampc_tensor_dim(y, 0) != 1 || ampc_tensor_dim(y, 1) != r->d.num_classes)
        rc = fail("--model %s gives %d-dimensional outputs for %" PRId64 " classes", sval(r->s, OPT_MODEL), ampc_tensor_ndim(y),
                  r->d.num_classes);
    ampc_no_grad_exit();
    ampc_scope_end();
    return rc;
}

static int build(run *r) {
    settings *s = r->s;
    const char *model = sval(s, OPT_MODEL), *optname = sval(s, OPT_OPTIMIZER);
    bool sgd = strcmp(optname, "sgd") == 0;
    r->use_amp = yes(s, OPT_USE_AMP);
    bool bf16_ok = ampc_dtype_supported(AMPC_DEVICE_CPU, AMPC_BF16), bf16_fast = ampc_dtype_native(AMPC_DEVICE_CPU, AMPC_BF16);
    bool auto_dtype = is_auto(s, OPT_AMP_DTYPE);
    if (auto_dtype && set_val(s, OPT_AMP_DTYPE, bf16_fast ? "bf16" : "fp16") < 0) return -1;
    r->amp_dtype = strcmp(sval(s, OPT_AMP_DTYPE), "fp16") == 0 ? AMPC_F16 : AMPC_BF16;
    if (r->use_amp && r->amp_dtype == AMPC_BF16 && !bf16_ok)
        return fail("--amp-dtype bf16: this CPU has no bf16 kernels (oneDNN's need AVX-512; cpu: %s%s): use --amp-dtype fp16 "
                    "(the default here) or --use-amp no", ampc_cpu_features(),
                    getenv("ONEDNN_MAX_CPU_ISA") ? ", ONEDNN_MAX_CPU_ISA set" : "");
    if (r->use_amp && r->amp_dtype == AMPC_BF16 && !bf16_fast)
        warn("bf16 is emulated on this CPU (no AVX512-BF16): expect it several times slower than fp32; --amp-dtype fp16 "
             "(the default here) or --use-amp no run faster");
    if (r->use_amp && auto_dtype && !bf16_fast)
        printf("note: --amp-dtype fp16, since this CPU has no bf16 arithmetic (AVX512-BF16); fp16 is computed in fp32 here\n");
    if (is_auto(s, OPT_GRAD_SCALER) && set_val(s, OPT_GRAD_SCALER, r->use_amp && r->amp_dtype == AMPC_F16 ? "yes" : "no") < 0) return -1;
    if (is_auto(s, OPT_LR) && set_val(s, OPT_LR, sgd ? "0.01" : "0.001") < 0) return -1;
    if (is_auto(s, OPT_WEIGHT_DECAY) && set_val(s, OPT_WEIGHT_DECAY, strcmp(optname, "adamw") == 0 ? "0.01" : "0") < 0) return -1;
    if (is_auto(s, OPT_THREADS)) {
        char t[16];
        snprintf(t, sizeof t, "%d", ampc_get_num_threads());
        if (set_val(s, OPT_THREADS, t) < 0) return -1;
    } else {
        ampc_set_num_threads((int)ival(s, OPT_THREADS));
    }
    if (data_open(s, &r->d) < 0) return -1;

    g_oom_hint = "the model and its optimizer state need more than --max-memory: raise it or choose a smaller --model";
    ampc_manual_seed((uint64_t)ival(s, OPT_SEED));
    ampc_model_options mo = {.num_classes = r->d.num_classes, .in_channels = r->d.c,
                             .small_input = strncmp(model, "resnet", 6) == 0 && r->d.h <= 64 && r->d.w <= 64,
                             .memory_format = yes(s, OPT_CHANNELS_LAST) ? AMPC_CHANNELS_LAST : AMPC_CONTIGUOUS_FORMAT};
    if (!(r->net = ampc_model_new(model, &mo))) return fail_lib("--model");
    if (check_model_input(r) < 0) return -1;
    double lr = rval(s, OPT_LR), wd = rval(s, OPT_WEIGHT_DECAY);
    if (sgd) {
        ampc_sgd_options o = ampc_sgd_defaults();
        o.lr = lr;
        o.momentum = rval(s, OPT_MOMENTUM);
        o.weight_decay = wd;
        r->opt = ampc_sgd_new(r->net, &o);
    } else {
        bool w = strcmp(optname, "adamw") == 0;
        ampc_adam_options o = w ? ampc_adamw_defaults() : ampc_adam_defaults();
        o.lr = lr;
        o.weight_decay = wd;
        r->opt = w ? ampc_adamw_new(r->net, &o) : ampc_adam_new(r->net, &o);
    }
    if (!r->opt) return fail_lib("--optimizer");
    ampc_scaler_options so = ampc_scaler_defaults();
    so.enabled = yes(s, OPT_GRAD_SCALER);
    if (!(r->scaler = ampc_scaler_new(&so))) return fail_lib("grad scaler");

    int64_t bs = ival(s, OPT_BATCH_SIZE);
    ampc_loader_options lo = ampc_loader_defaults();
    lo.batch_size = bs;
    lo.seed = (uint64_t)ival(s, OPT_SEED);
    lo.num_workers = (int)ival(s, OPT_NUM_WORKERS);
    lo.shuffle = true;
    lo.transforms = r->d.tf_train;
    if (!(r->train_ld = ampc_loader_new(r->d.train, &lo))) return fail_lib("data loader");
    lo.shuffle = false;
    lo.transforms = r->d.tf_val;
    if (!(r->val_ld = ampc_loader_new(r->d.val, &lo))) return fail_lib("data loader");
    if (!(r->logits_buf = malloc((size_t)(bs * r->d.num_classes) * sizeof *r->logits_buf))) return fail("out of memory");
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Out of memory under --max-memory: what took the memory, and the largest batch that fits

/* Bytes above the fixed state (weights, optimizer state, weight casts) at the peak of one forward
   and backward pass of a batch of b zero images, with the run's autocast setting. */
static double probe_step_bytes(run *r, int64_t b, double grad_bytes) {
    ampc_optimizer_zero_grad(r->opt);
    ampc_memory_stats_t m0 = ampc_memory_stats();
    double fixed = (double)(m0.current[AMPC_MEM_PARAMETERS] + m0.current[AMPC_MEM_OPTIMIZER] + m0.current[AMPC_MEM_CASTS]);
    ampc_memory_reset_peak();
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){b, r->d.c, r->d.h, r->d.w});
    ampc_tensor *y = ampc_tensor_zeros(AMPC_I64, 1, (int64_t[]){b});
    ampc_autocast_enter(r->amp_dtype, r->use_amp);
    ampc_tensor *loss = x && y ? ampc_cross_entropy(ampc_module_forward(r->net, x), y, NULL) : NULL;
    ampc_autocast_exit();
    int rc = loss ? ampc_backward(loss) : -1;
    ampc_scope_end();
    ampc_memory_stats_t m1 = ampc_memory_stats();
    ampc_optimizer_zero_grad(r->opt);
    /* the casts a forward pass makes are fixed state too (kept across steps) */
    fixed += (double)(m1.current[AMPC_MEM_CASTS] - m0.current[AMPC_MEM_CASTS]);
    return rc < 0 ? -1 : (double)m1.peak_total - fixed - grad_bytes;
}

/* After an out-of-memory error in training under a limit: measure a step's activations at two
   batch sizes (limit lifted for the probe; the run is over anyway), then name the fixed state and
   the largest batch that fits. */
static void oom_advice(run *r, double limit) {
    const char *optname = sval(r->s, OPT_OPTIMIZER);
    double P = 4.0 * (double)ampc_module_num_parameters(r->net, true);
    double opt = strcmp(optname, "sgd") == 0 ? (rval(r->s, OPT_MOMENTUM) > 0 ? P : 0) : 2 * P;
    ampc_memory_set_limit(0);
    double cast0 = (double)ampc_memory_stats().current[AMPC_MEM_CASTS];
    double t2 = probe_step_bytes(r, 2, P), t4 = probe_step_bytes(r, 4, P);
    double casts = (double)ampc_memory_stats().current[AMPC_MEM_CASTS];
    if (casts < cast0) casts = cast0;
    ampc_memory_set_limit((size_t)limit);
    if (t2 < 0 || t4 <= t2) return;   /* no measurement: keep the plain hint */
    double per = (t4 - t2) / 2, base = t2 - 2 * per, fixed = 2 * P + opt + casts;
    double room = limit - fixed - base;
    int64_t fit = room > 0 ? (int64_t)floor(room / per) : 0;
    char a[32], b[32], c[32], d[32], e[32], f[32];
    int n = snprintf(g_oom_advice, sizeof g_oom_advice,
                     "of --max-memory %s, the weights take %s, their gradients %s, %s's state %s%s%s, and each sample about %s of "
                     "activations (measured)",
                     fmt_bytes(limit, a, sizeof a), fmt_bytes(P, b, sizeof b), fmt_bytes(P, c, sizeof c), optname,
                     fmt_bytes(opt, d, sizeof d), casts > 0 ? ", autocast's weight copies " : "", casts > 0 ? fmt_bytes(casts, e, sizeof e) : "",
                     fmt_bytes(per, f, sizeof f));
    if (n < 0 || (size_t)n >= sizeof g_oom_advice) return;
    if (fit >= 1)
        snprintf(g_oom_advice + n, sizeof g_oom_advice - (size_t)n, ": the largest batch that fits is about %" PRId64 " (--batch-size %" PRId64 ")%s",
                 fit, fit, r->use_amp ? "" : ", or more with --use-amp yes (16-bit activations)");
    else
        snprintf(g_oom_advice + n, sizeof g_oom_advice - (size_t)n, ": not even a batch of 1 fits; %s",
                 opt >= P && opt > 0 ? "the optimizer's state is the largest part: try --optimizer sgd --momentum 0 (no state), or raise --max-memory"
                                     : "raise --max-memory or choose a smaller --model");
    g_oom_hint = g_oom_advice;
}

/* A signal stopped the run after its checkpoint was saved: one line saying where, and how to go on;
   exit status 128 + the signal's number, as a shell reports a process the signal ended. */
static int interrupted(run *r) {
    const int sig = g_signal;
    fail("%s: saved %s; continue with: " PROG " --resume %s", sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "signal",
         r->last_good, r->ckpt_path);
    g_interrupt = true;
    g_exit = 128 + sig;
    return -1;
}

static void print_memory(const ampc_memory_stats_t *ms, const char *indent) {
    char b[32];
    printf("%speak memory: %s (", indent, fmt_bytes((double)ms->peak_total, b, sizeof b));
    for (int k = 0; k < AMPC_MEM_KIND_COUNT; k++)
        printf("%s%s %s", k ? ", " : "", ampc_mem_kind_name((ampc_mem_kind)k), fmt_bytes((double)ms->peak[k], b, sizeof b));
    printf(")\n");
}

/* A whole run: build, optionally resume, train the remaining epochs, write the outputs. */
static int train_run(settings *s, run_result *res) {
    memset(res, 0, sizeof *res);
    run r = {.s = s};
    int rc = 0;
    if (*sval(s, OPT_RESUME) && (rc = resume_settings(s)) < 0) goto done;
    if ((rc = build(&r)) < 0) goto done;
    if (*sval(s, OPT_RESUME) && (rc = resume_state(&r)) < 0) goto done;
    g_oom_hint = "try a smaller --batch-size or --use-amp yes";
    print_setup(&r);
    int64_t n_epochs = ival(s, OPT_EPOCHS);
    if (*sval(s, OPT_RESUME)) {
        if (r.resume_step > 0)
            printf("resumed from %s in epoch %" PRId64 " after step %" PRId64 " of %" PRId64 "\n", sval(s, OPT_RESUME), r.epoch0 + 1,
                   r.resume_step, ampc_loader_num_batches(r.train_ld));
        else
            printf("resumed from %s after epoch %" PRId64 "\n", sval(s, OPT_RESUME), r.epoch0);
        if (n_epochs > 0 && n_epochs < r.epoch0 + (r.resume_step > 0)) {
            rc = r.resume_step > 0 ? fail("--epochs %" PRId64 ": the checkpoint is in epoch %" PRId64 " already", n_epochs, r.epoch0 + 1)
                                   : fail("--epochs %" PRId64 ": the checkpoint has finished %" PRId64 " epochs already", n_epochs, r.epoch0);
            goto done;
        }
    }
    if (n_epochs == 0) {
        res->ok = true;
        goto done;
    }
    if (!(r.out = strdup(sval(s, OPT_OUT)))) {
        rc = fail("out of memory");
        goto done;
    }
    if ((rc = mkdir_p(r.out)) < 0) goto done;
    if (!(r.ckpt_path = path_join(r.out, "checkpoint.safetensors")) || (rc = open_metrics(&r)) < 0) {
        rc = -1;
        goto done;
    }
    ampc_checkpoint_remove_stale_temps(r.ckpt_path);   /* a kill mid-save left it: never renamed */
    printf("outputs: %s/{metrics.csv,loss.png,accuracy.png,checkpoint.safetensors}\n", r.out);
    fflush(stdout);

    ampc_memory_reset_peak();
    double t0 = progress_now();
    r.skipped_seen = ampc_scaler_steps_skipped(r.scaler);
    stop_signals_install(true);
    for (int64_t e = r.epoch0; e < n_epochs; e++) {
        bool cont = e == r.epoch0 && r.resume_step > 0;   /* an epoch a signal interrupted */
        double te = progress_now() - (cont ? r.resume_epoch_seconds : 0);
        if (!cont) r.epoch_skipped0 = ampc_scaler_steps_skipped(r.scaler);
        pass_stats tr, va;
        int pr = run_pass(&r, true, e, &tr, cont ? r.resume_step : 0, cont ? &r.resume_train : NULL);
        if (pr == 0) pr = run_pass(&r, false, e, &va, 0, NULL);
        if (pr < 0) {
            if (g_err_status == AMPC_ERR_OOM && strcmp(sval(s, OPT_MAX_MEMORY), "none") != 0) oom_advice(&r, rval(s, OPT_MAX_MEMORY));
            rc = -1;
            goto done;
        }
        if (pr > 0) {   /* a signal: save where training stands (validation is redone on resume) */
            if ((rc = save_checkpoint(&r, e, tr.steps, &tr, progress_now() - te)) == 0) rc = interrupted(&r);
            goto done;
        }
        double secs = progress_now() - te;
        double row[N_COLS] = {[COL_EPOCH] = (double)(e + 1),
                              [COL_TRAIN_LOSS] = tr.loss,
                              [COL_TRAIN_ACC] = tr.acc,
                              [COL_VAL_LOSS] = va.loss,
                              [COL_VAL_ACC] = va.acc,
                              [COL_SECONDS] = secs,
                              [COL_SPS] = tr.seconds > 0 ? (double)tr.samples / tr.seconds : 0,
                              [COL_SCALE] = ampc_scaler_get_scale(r.scaler),
                              [COL_SKIPPED] = (double)(ampc_scaler_steps_skipped(r.scaler) - r.epoch_skipped0),
                              [COL_DATA_WAIT] = tr.seconds > 0 ? tr.data_seconds / tr.seconds : 0};
        char c1[32];
        printf("epoch %" PRId64 "/%" PRId64 ": train loss %.4f acc %.2f%% | val loss %.4f acc %.2f%% | %.1f s (train %.1f s, %s samples/s, "
               "%.1f ms/step, data wait %.1f%%)",
               e + 1, n_epochs, tr.loss, 100 * tr.acc, va.loss, 100 * va.acc, secs, tr.seconds, fmt_count((int64_t)row[COL_SPS], c1, sizeof c1),
               tr.steps ? 1e3 * tr.seconds / (double)tr.steps : 0.0, 100 * row[COL_DATA_WAIT]);
        if (ampc_scaler_is_enabled(r.scaler)) printf(" | scale %g, %.0f skipped", row[COL_SCALE], row[COL_SKIPPED]);
        printf("\n");
        fflush(stdout);
        /* the checkpoint first: after a kill between the two, resume rewrites metrics.csv from the
           checkpoint's history, so the file never runs ahead of what resume continues from */
        if ((rc = history_push(&r.hist, row)) < 0 || (rc = save_checkpoint(&r, e + 1, 0, NULL, 0)) < 0) goto done;
        if (ampc_metrics_row(r.metrics, row) < 0) {
            rc = fail_lib("metrics.csv");
            goto done;
        }
        if ((rc = draw_plots(&r)) < 0) goto done;
        res->epochs_run++;
        res->samples += tr.samples;
        res->train_seconds += tr.seconds;
        res->data_seconds += tr.data_seconds;
        if (g_signal && e + 1 < n_epochs) {   /* arrived during the save: it is done */
            rc = interrupted(&r);
            goto done;
        }
    }
    if (r.epoch0 >= n_epochs) {   /* nothing left to train: rewrite the outputs from the checkpoint */
        printf("nothing to train: the checkpoint has finished %" PRId64 " of %" PRId64 " epochs\n", r.epoch0, n_epochs);
        if ((rc = draw_plots(&r)) < 0 || (rc = save_checkpoint(&r, r.epoch0, 0, NULL, 0)) < 0) goto done;
    }
    res->seconds = progress_now() - t0;
    ampc_memory_stats_t ms = ampc_memory_stats();
    res->peak_total = (double)ms.peak_total;
    for (int k = 0; k < AMPC_MEM_KIND_COUNT; k++) res->peak[k] = (double)ms.peak[k];
    res->scale = ampc_scaler_get_scale(r.scaler);
    res->skipped = ampc_scaler_steps_skipped(r.scaler);
    res->samples_per_s = res->train_seconds > 0 ? (double)res->samples / res->train_seconds : 0;
    if (r.hist.n) {
        const double *last = r.hist.rows[r.hist.n - 1];
        res->train_loss = last[COL_TRAIN_LOSS];
        res->train_acc = last[COL_TRAIN_ACC];
        res->val_loss = last[COL_VAL_LOSS];
        res->val_acc = last[COL_VAL_ACC];
    }

    char t[32], c1[32];
    printf("summary: %" PRId64 " epoch(s) in %s (%.1f s/epoch), %s training samples/s, data wait %.1f%%\n", res->epochs_run,
           progress_format_time(res->seconds, t, sizeof t), res->epochs_run ? res->seconds / (double)res->epochs_run : 0.0,
           fmt_count((int64_t)res->samples_per_s, c1, sizeof c1),
           res->train_seconds > 0 ? 100 * res->data_seconds / res->train_seconds : 0.0);
    print_memory(&ms, "  ");
    if (ampc_scaler_is_enabled(r.scaler))
        printf("  grad scaler: %" PRId64 " skipped steps of %" PRId64 ", final scale %g\n", ampc_scaler_steps_skipped(r.scaler),
               ampc_scaler_steps_applied(r.scaler) + ampc_scaler_steps_skipped(r.scaler), (double)res->scale);
    else
        printf("  grad scaler: off (0 skipped steps, scale 1)\n");
    printf("  final: train loss %.4f acc %.2f%% | validation loss %.4f acc %.2f%%\n", res->train_loss, 100 * res->train_acc,
           res->val_loss, 100 * res->val_acc);
    printf("  outputs: %s\n", r.out);
    res->ok = true;
done:
    stop_signals_install(false);
    run_free(&r);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// --compare: fp32, then AMP, from the same seed, side by side

static int compare_runs(const settings *base) {
    run_result rr[2];
    const char *names[2] = {"fp32", "amp"};
    for (int k = 0; k < 2; k++) {
        settings s;
        if (settings_copy(&s, base) < 0) return -1;
        char *out = NULL;
        int rc = asprintf(&out, "%s/%s", sval(base, OPT_OUT), names[k]) < 0 ? fail("out of memory") : 0;
        if (rc == 0) rc = set_val(&s, OPT_OUT, out);
        if (rc == 0) rc = set_val(&s, OPT_USE_AMP, k ? "yes" : "no");
        free(out);
        if (rc == 0) {
            printf("==== %s ====\n", k ? "AMP" : "fp32");
            ampc_memory_empty_cache();
            rc = train_run(&s, &rr[k]);
        }
        char dt[16];
        snprintf(dt, sizeof dt, "%s", sval(&s, OPT_AMP_DTYPE));
        settings_free(&s);
        if (rc < 0) return rc;
        if (k) names[1] = strcmp(dt, "fp16") == 0 ? "AMP (fp16)" : "AMP (bf16)";
    }
    if (!rr[0].ok || rr[0].epochs_run == 0) return 0;
    char a[32], b[32];
    printf("\n%-26s %16s %16s\n", "", "fp32", names[1]);
    printf("%-26s %16.1f %16.1f\n", "time (s)", rr[0].seconds, rr[1].seconds);
    printf("%-26s %16s %16s\n", "training samples/s", fmt_count((int64_t)rr[0].samples_per_s, a, sizeof a),
           fmt_count((int64_t)rr[1].samples_per_s, b, sizeof b));
    double dw[2];
    for (int k = 0; k < 2; k++) dw[k] = rr[k].train_seconds > 0 ? 100 * rr[k].data_seconds / rr[k].train_seconds : 0;
    printf("%-26s %15.1f%% %15.1f%%\n", "data wait (training)", dw[0], dw[1]);
    printf("%-26s %16s %16s\n", "peak memory", fmt_bytes(rr[0].peak_total, a, sizeof a), fmt_bytes(rr[1].peak_total, b, sizeof b));
    printf("%-26s %16s %16s\n", "  of it activations", fmt_bytes(rr[0].peak[AMPC_MEM_ACTIVATIONS], a, sizeof a),
           fmt_bytes(rr[1].peak[AMPC_MEM_ACTIVATIONS], b, sizeof b));
    printf("%-26s %15.2f%% %15.2f%%\n", "test accuracy", 100 * rr[0].val_acc, 100 * rr[1].val_acc);
    printf("%-26s %16.4f %16.4f\n", "test loss", rr[0].val_loss, rr[1].val_loss);
    printf("%-26s %16s %15.2fx\n", "speed-up", "", rr[0].seconds > 0 && rr[1].seconds > 0 ? rr[0].seconds / rr[1].seconds : 0.0);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// --compare-checkpoints A B: are the tensors (weights, buffers, optimizer state) bit-identical?
// The metadata (timings, paths) may differ; the tensors, by name, must not.

/* Returns 0 identical, 1 different, -1 error (the library validates both files). */
static int compare_checkpoints(const char *pa, const char *pb) {
    int rc = ampc_checkpoint_compare(pa, pb, stdout);
    return rc < 0 ? fail_lib("--compare-checkpoints") : rc;
}

// ---------------------------------------------------------------------------------------------

int main(int argc, char **argv) {
    settings s;
    const char *cmp_a = NULL, *cmp_b = NULL;
    int prc = parse_args(argc, argv, &s, &cmp_a, &cmp_b), rc = prc < 0 ? -1 : 0;
    if (prc == 1) {
        print_help();
        settings_free(&s);
        return 0;
    }
    if (rc == 0 && ampc_init() < 0) rc = fail_lib("init");
    if (rc == 0) {
        const char *pm = sval(&s, OPT_PROGRESS);
        progress_set_mode(!strcmp(pm, "bar") ? PROGRESS_BAR : !strcmp(pm, "lines") ? PROGRESS_LINES : !strcmp(pm, "off") ? PROGRESS_OFF : PROGRESS_AUTO);
        if (strcmp(sval(&s, OPT_MAX_MEMORY), "none") != 0) ampc_memory_set_limit((size_t)strtod(sval(&s, OPT_MAX_MEMORY), NULL));
        ampc_autocast_keep_weight_casts(yes(&s, OPT_KEEP_CASTS));
    }
    if (rc == 0 && cmp_a) {
        rc = compare_checkpoints(cmp_a, cmp_b);
        if (rc < 0) g_exit = 2;   /* as cmp(1): 0 same, 1 different, 2 trouble */
        if (rc > 0) {   /* a result, not an error */
            settings_free(&s);
            ampc_shutdown();
            return 1;
        }
    } else if (rc == 0 && s.compare) {
        if (*sval(&s, OPT_RESUME)) rc = usage_error("--compare starts fresh runs: it does not take --resume");
        else rc = compare_runs(&s);
    } else if (rc == 0) {
        if (*sval(&s, OPT_RESUME) && !s.given[OPT_OUT]) {   /* continue in the checkpoint's folder */
            const char *res = sval(&s, OPT_RESUME), *slash = strrchr(res, '/');
            char *dir = slash ? strndup(res, (size_t)(slash - res)) : strdup(".");
            rc = dir ? set_val(&s, OPT_OUT, *dir ? dir : "/") : fail("out of memory");
            free(dir);
        }
        run_result res;
        if (rc == 0) rc = train_run(&s, &res);
    }
    settings_free(&s);
    ampc_shutdown();
    if (rc < 0) {
        fflush(stdout);
        if (g_interrupt)
            fprintf(stderr, PROG ": interrupted by %s\n", g_err);
        else if (g_err_status == AMPC_ERR_OOM || strstr(g_err, "out of memory"))
            fprintf(stderr, PROG ": error: %s; %s\n", g_err, g_oom_hint);
        else
            fprintf(stderr, PROG ": error: %s%s\n", g_err, g_usage ? " (see --help)" : "");
        return g_exit;
    }
    return 0;
}
