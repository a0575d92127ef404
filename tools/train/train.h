/*
 * train.h - what the files of ampc-train share (internal to the tool; see main.c for the program).
 *
 *     report.c    the one error line, warnings, number formatting
 *     options.c   the option table: values, getopt_long parsing, --help, the printed configuration
 *     datasets.c  --data: IDX files or an image folder, transforms, splits and limits
 *     meta.c      the checkpoint's "ampc_train.*" metadata: written after each epoch, read on --resume
 *     setup.c     a run built from the settings: model, optimizer, scaler, loaders
 *     agree.c     data-parallel: what every rank of an mpirun job must share
 *     pass.c      one training or validation pass over a loader
 *     diverge.c   divergence checks, the checkpoint saved after each epoch, diverged.safetensors
 *     outputs.c   --out: the folder and its lock, metrics.csv, the plots, confusion.csv
 *     steplog.c   --step-log (steps.csv, steps.png, scale.png) and skipped-step lines
 *     tensorboard.c  --tensorboard's event file
 *     doctor.c    --doctor, --explain and --numerics-every
 *     oom.c       after running out of memory under --max-memory: what fits
 *     trainer.c   a run from start to end: build, resume, the epoch loop, signals, the summary
 *     main.c      main, --compare and --compare-checkpoints
 */
#ifndef AMPC_TRAIN_H
#define AMPC_TRAIN_H

#include "ampc.h"
#include "ampc/dist.h"

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROG "ampc-train"
/* --epochs' most, so that the metrics history a checkpoint's metadata holds (N_COLS values of at
   most 26 bytes an epoch) stays well under META_MAX_BYTES, the most --resume reads. */
#define MAX_EPOCHS 100000
#define META_MAX_BYTES (32 << 20)

// ---------------------------------------------------------------------------------------------
// Errors (report.c): the first one is kept and printed once, by main, as the program's only error line

extern char g_err[2048];
extern int g_err_status;   /* ampc status of a library failure (AMPC_ERR_OOM gets a hint), or 0 */
extern int g_exit;         /* the exit status of the error: 1, 2 (a usage error), 3 (diverged), 128 + signal */
extern bool g_usage;       /* the error is about the command line: point at --help */
extern bool g_interrupt;   /* not an error: a signal stopped the run after saving ("interrupted: ...") */
extern bool g_job_error;   /* every rank met this error at the same step (the grad scaler's guard rails): rank 0 says it */
extern const char *g_oom_hint;   /* what to try after running out of memory, by phase */

/* Keeps the first error ("fmt" made one line) and returns -1. */
int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* A library call failed: "what: <ampc_last_error()>". */
int fail_lib(const char *what);
/* A bad command line: exit status 2, and the message points at --help. */
int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Puts where the run stood ("in epoch 2 at step 5 of 16") before the error kept. */
void error_where(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Forgets the error (the fuzz harness between inputs; a warning that replaced an error). */
void error_reset(void);
void warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

const char *fmt_count(int64_t v, char *buf, size_t n);   /* 25557032 -> "25,557,032" */
const char *fmt_bytes(double b, char *buf, size_t n);    /* "1.5 MiB" */
const char *fmt_real(double v, char *buf, size_t n);     /* the shortest text that reads back as v */
/* Appends to buf (n bytes, its text *at long), cut at its end; *at stays within it. */
void appendf(char *buf, size_t n, size_t *at, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

// ---------------------------------------------------------------------------------------------
// Options (options.c): one table drives parsing, defaults, --help, the printed configuration,
// the checkpoint's metadata and the checks of --resume.

typedef enum { V_CHOICE, V_YESNO, V_INT, V_REAL, V_SIZE, V_TEXT } vkind;

enum {
    O_SAVE = 1,      /* written to the checkpoint's metadata (the full configuration) */
    O_RUN = 2,       /* defines the run: on --resume it comes from the checkpoint; given, it must agree */
    O_RESTORE = 4,   /* on --resume, taken from the checkpoint unless given (may differ) */
    O_AUTO = 8,      /* accepts "auto": resolved once the data and model are known */
    O_REMEDY = 16,   /* with O_RUN: may still be given differently on --resume, as a remedy for a run that
                        diverged (precision, learning rate, clipping); the change is noted, and a change of
                        precision starts the grad scaler afresh */
};

typedef enum {
    OPT_MODEL, OPT_DATA, OPT_BATCH_SIZE, OPT_USE_AMP, OPT_AMP_DTYPE, OPT_GRAD_SCALER, OPT_EPOCHS, OPT_LR,
    OPT_OPTIMIZER, OPT_MOMENTUM, OPT_WEIGHT_DECAY, OPT_SEED, OPT_VAL_SPLIT, OPT_IMAGE_SIZE, OPT_INDEX_CSV, OPT_LIMIT_TRAIN,
    OPT_LIMIT_VAL, OPT_THREADS, OPT_DEVICE, OPT_NUM_WORKERS, OPT_PIN_MEMORY, OPT_MAX_MEMORY, OPT_OUT, OPT_NAME, OPT_OVERWRITE, OPT_RESUME, OPT_PROGRESS, OPT_CHANNELS_LAST,
    OPT_KEEP_CASTS, OPT_MAX_SKIPPED, OPT_MAX_LOSS, OPT_SYNC_BN, OPT_ZERO, OPT_LR_SCHEDULE, OPT_LR_STEP_SIZE, OPT_LR_GAMMA,
    OPT_WARMUP_STEPS, OPT_CLIP_GRAD_NORM, OPT_PRETRAINED, OPT_PRETRAINED_STRICT, OPT_FREEZE, OPT_STOP_AFTER_STEPS, OPT_AUGMENT, OPT_EXCLUDE_CLASS, OPT_ACCUMULATE, OPT_STEP_LOG, OPT_DOCTOR, OPT_EXPLAIN, OPT_FP32_MODULES, OPT_NUMERICS_EVERY, OPT_MIN_LOSS_SCALE, OPT_COLLECTIVE_TIMEOUT, OPT_LABEL_SMOOTHING, OPT_EVAL_ONLY, OPT_TENSORBOARD, OPT_BLOCK_SIZE, OPT_N_LAYER, OPT_N_HEAD, OPT_N_EMBD, OPT_DROPOUT, OPT_BIAS, OPT_SAMPLE,
    OPT_TEMPERATURE, OPT_TOP_K, OPT_PROMPT, OPT_COUNT
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

extern const opt_def OPTS[OPT_COUNT];

typedef struct {
    char *val[OPT_COUNT];   /* canonical text of each option (malloc'd) */
    bool given[OPT_COUNT];  /* on the command line */
    bool compare;           /* --compare: fp32 then AMP, side by side */
    bool link_latest;       /* --out was chosen (runs/<name>): the run points runs/latest at it */
    bool dated;             /* ... and named by the date and time: a suffix where that folder exists */
} settings;

void settings_free(settings *s);
/* Whether option i means anything for --model `model`: the image options (--image-size,
   --augment, --channels-last) for the classifiers, the language model's (--block-size ..
   --prompt) for gpt. */
bool option_applies(const char *model, int i);
int set_val(settings *s, int i, const char *text);
int settings_copy(settings *dst, const settings *src);
/* Checks text against option i and writes its canonical form to out; on a bad value, -1 and the
   reason in err. */
int canonical(int i, const char *text, char *out, size_t n, char *err, size_t errn);
/* Command line -> settings (defaults for what is not given). Returns 0, 1 for --help, 2 for --version, or -1
   (usage_error). Callable any number of times: it resets getopt_long's state. */
int parse_args(int argc, char **argv, settings *s, const char **cmp_a, const char **cmp_b);
void print_help(void);
/* "configuration:" and one line per option (the data's description in place of --data). */
void print_config(const settings *s, const char *data_desc, bool use_amp);

static inline const char *sval(const settings *s, int i) { return s->val[i]; }
static inline bool is_auto(const settings *s, int i) { return strcmp(s->val[i], "auto") == 0; }
static inline int64_t ival(const settings *s, int i) { return strtoll(s->val[i], NULL, 10); }
static inline double rval(const settings *s, int i) { return strtod(s->val[i], NULL); }
static inline bool yes(const settings *s, int i) { return strcmp(s->val[i], "yes") == 0; }

// ---------------------------------------------------------------------------------------------
// Datasets (datasets.c)

typedef struct {
    ampc_dataset *train, *val;
    char desc[512];          /* "Fashion-MNIST (/usr/share/datasets/fashion-mnist)" */
    const char *val_name;    /* "t10k test set" or "held-out split" */
    bool folder;
    int64_t c, h, w;         /* sample shape after transforms (token windows: 1, 1, T) */
    int64_t block;           /* token windows (--model gpt): T tokens per sample; 0 for images */
    bool text;               /* the tokens are a text file's bytes: samples print as text */
    double unigram;          /* token windows: the validation targets' cross-entropy under the training targets'
                                frequencies (add-one smoothed), the loss a model that ignores context gets */
    int64_t num_classes;
    int64_t full_train, full_val;   /* before --limit-* */
    ampc_transforms *tf_train, *tf_val;
    ampc_loader *train_ld, *val_ld;   /* made by run_build (setup.c), freed by run_free */
} data;

/* Answers a sample holds for the accuracy count: 1 label for an image, T next tokens for a window. */
static inline int64_t answers_per_sample(const data *d) { return d->block ? d->block : 1; }

/* Resolves --image-size and --num-workers ("auto") for the kind of data, then opens it: images
   for the classifiers, a token file's windows for --model gpt. */
int data_open(settings *s, data *d);
void data_free(data *d);

// ---------------------------------------------------------------------------------------------
// Metrics history: one row per finished epoch, kept in the checkpoint to redraw the plots

/* New columns go at the end (scripts read columns by position); one that checkpoints of an
   older ampc-train lack reads back as NaN on --resume (see resume_state). */
enum { COL_EPOCH, COL_TRAIN_LOSS, COL_TRAIN_ACC, COL_VAL_LOSS, COL_VAL_ACC, COL_SECONDS, COL_SPS, COL_SCALE, COL_SKIPPED,
       COL_DATA_WAIT, N_COLS };
extern const char *const COLS[N_COLS];

typedef struct {
    double (*rows)[N_COLS];
    int n, cap;
} history;

int history_push(history *h, const double *row);

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

/* A run's state, split by job; each piece is filled by the file named and read where needed.
   Functions take the narrowest piece that serves them (a run_outputs, a run_tally), or the run. */

/* The model and how it learns (setup.c; resume_state restores it from a checkpoint). */
typedef struct {
    ampc_module *net;
    ampc_optimizer *opt;
    ampc_scaler *scaler;
    ampc_ddp *ddp;           /* data-parallel (under mpirun): gradients averaged over the ranks */
    int sync_bn;             /* --sync-bn: BatchNorm layers made SyncBatchNorm */
    int64_t zero_here, zero_all;   /* --zero 1: optimizer state bytes this rank keeps, all ranks (0: unsharded) */
    bool use_amp;
    ampc_dtype amp_dtype;
    ampc_device device;   /* --device: the model and each batch live there (the loader works on the CPU) */
    ampc_lr_schedule sched;  /* --lr-schedule, --warmup-steps: the rate of each optimizer step */
    bool scheduled;          /* a schedule or a warm-up: the rate changes */
    /* the memory the run may use: --max-memory, or else what the machine or its cgroup has
       (ampc_memory_available, made the allocator's limit); limit_src names it. host_limit: the
       machine's alone (0: unknown), which out-of-memory probes never go past */
    double mem_limit, host_limit;
    const char *limit_src;
    char pretrained_note[512];   /* --pretrained: what was loaded, for the setup lines */
    char stem_note[256];     /* a ResNet's stem and what chose it, for the setup lines */
} run_model;

/* What the run writes in --out (outputs.c opens it; rank 0 alone writes, the other ranks hold
   NULLs but for the paths), and the metrics history the plots and the checkpoint are made from. */
typedef struct {
    char *dir;               /* the output folder */
    FILE *lock;              /* <out>/ampc-train.lock, flock'd while the run writes there (rank 0) */
    char *ckpt_path;
    char *model_path;        /* model.safetensors: the state_dict alone, for load_state_dict(strict=True) */
    char *diverged_path;     /* diverged.safetensors: where the grad scaler's guard rails stopped the run */
    ampc_metrics *metrics;   /* metrics.csv, one row per epoch */
    ampc_metrics *steps;     /* --step-log: steps.csv, one row per optimizer step (rank 0) */
    struct tb_writer *tb;    /* --tensorboard: the session's event file (rank 0; tools/tbevents.h) */
    history hist;            /* one row per finished epoch, this session's and the checkpoint's */
    double skip_printed_at;  /* when the last skipped-step line was printed (progress_now), or -inf */
    int64_t skips_unprinted; /* skipped steps since then that got no line of their own */
} run_outputs;

/* --resume (meta.c): what the checkpoint says about where the run stands. A checkpoint written
   mid-epoch (after a signal): epoch epoch0 + 1 continues after training step `step` at global
   sample train.samples (the dataset's size or its last drop: only validation is left) with these
   totals, on any number of ranks. */
typedef struct {
    ampc_checkpoint_meta *meta;   /* the checkpoint's metadata, parsed once */
    int64_t epoch0;          /* epochs finished before this session (0 without --resume) */
    int64_t step;
    pass_stats train;
    double epoch_seconds;
    int64_t saved_world, saved_global_batch;   /* the processes that wrote it, their global batch */
} run_resume;

/* When the run stops (diverge.c, pass.c): the divergence checks, --stop-after-steps and the last
   good checkpoint. */
typedef struct {
    /* divergence checks: the scaler's skipped-step count last seen, and the run of skips */
    int64_t skipped_seen, skipped_in_a_row;
    char diverged_why[1024];  /* a divergence the grad scaler saw (consistent on every rank): why, for the message */
    int64_t epoch_skipped0;   /* the scaler's skipped-step count when the current epoch began */
    char last_good[4200];    /* "<path> (after epoch N)" of the last checkpoint written or resumed, or "" */
    int64_t steps_run;       /* training steps in this session, for --stop-after-steps */
    bool asked;              /* --stop-after-steps reached: the pass stopped as for a signal */
} run_stops;

/* --explain and --numerics-every (doctor.c). */
typedef struct {
    bool explaining;         /* --explain: the first step of this session is being recorded */
    bool numerics;           /* --numerics-every: collecting */
    int64_t numerics_steps;  /* optimizer steps sampled */
} run_diag;

/* Counting correct answers (pass.c) and the last validation's confusion matrix (outputs.c). */
typedef struct {
    float *logits_buf;       /* (logits_rows, classes) f32 copy of the logits, to count correct answers */
    int64_t logits_rows;     /* rows read at a time: the batch's, or fewer for a language model's vocabulary */
    double *confusion;       /* (classes, classes): validation rows = true class, columns = predicted, this epoch */
    bool valid;              /* a validation pass of this run filled confusion */
} run_tally;

typedef struct {
    settings *s;
    int rank, world;         /* this process's rank and the number of processes (0, 1 alone) */
    data d;                  /* the datasets and their loaders */
    run_model m;
    run_outputs out;
    run_resume resume;
    run_stops stop;
    run_diag diag;
    run_tally tally;
} run;

// The per-step log and skipped-step lines (steplog.c)

/* --step-log yes on rank 0: <out>/steps.csv, on resume cut back to the checkpoint's optimizer
   steps and appended to. */
int steplog_open(run *r);
/* steps.csv at path keeps its header and the rows whose step is at most `keep` (a crash's partial
   line goes too); written to a temporary and renamed. A missing file is fine. */
int steplog_cut_back(const char *path, int64_t keep);
/* After an optimizer step (every rank: the skipped-step line is rank 0's): its row and, when the
   scaler skipped it, a line on stdout (at most one per 2 s; the others counted in the next).
   scale: the scale the step's gradients carried; loss: the mean of its batches' losses. */
int steplog_step(run *r, int64_t epoch, int64_t batch, double loss, double scale, bool skipped, double samples_per_s);
/* From steps.csv (nothing without --step-log): steps.png, the training loss and the throughput
   per optimizer step (each raw and as a trailing mean) under the figure title `title`; with the
   scaler, scale.png, log2 of the loss scale per step with the skipped ones marked. */
int steplog_plot(run *r, const char *title);
/* --compare: <dir>/compare.png, the two runs' (<dir>/fp32, <dir>/amp) loss and throughput per
   step overlaid, from their steps.csv; names: the two runs' legend names. Nothing (0) when a
   run has no steps.csv. */
int steplog_compare_plot(const char *dir, const char *const names[2], const char *title);
void steplog_close(run *r);
/* Optimizer steps the run has taken: applied ones (the optimizer's count) and skipped ones. */
int64_t steps_so_far(const run *r);
/* --doctor: a step starts (its loss scale); what the doctor blames, as a clause to append to a
   message ("; the first non-finite output: ..."; "" when off or clean), written into buf. */
void doctor_step_begin(run *r);
const char *doctor_blame(char *buf, size_t n);
/* --explain: recording starts before the session's first training step; after it, the table. */
int explain_begin(run *r);
int explain_print(run *r);
/* --numerics-every K: collecting starts paused; each optimizer step begins sampled or not; at
   the end of the run the table (the ops losing most) and <out>/numerics.csv. */
int numerics_open(run *r);
void numerics_step_begin(run *r);
int numerics_report(run *r);

// TensorBoard event files (tensorboard.c; the tags are listed there)

/* --tensorboard yes on rank 0: a new event file in --out; on resume it starts with SessionLog
   START at the step the run continues with, so TensorBoard drops a killed run's later events. */
int tensorboard_open(run *r);
/* After an optimizer step (after steplog_step): loss as steps.csv's, scale the scale its
   gradients carried, samples the job's samples in it, seconds since the previous step ended. */
int tensorboard_step(run *r, double loss, double scale, double samples, double seconds);
/* After an epoch's metrics.csv row (COLS), at the global step of its last optimizer step; flushes. */
int tensorboard_epoch(run *r, const double *row);
/* Flushes and closes the file (a failure is a warning); nothing when none is open. */
void tensorboard_close(run *r);

// Checkpoint metadata (meta.c)

/* Writes r's checkpoint to path after epochs_done epochs and, when a signal (or a divergence)
   stopped epoch epochs_done + 1, `step` of its training steps with the totals so far in *partial
   and the epoch's wall time. diverged: NULL, or why the run diverged (recorded; such a file is not
   the last good checkpoint). */
int checkpoint_save(run *r, const char *path, const char *diverged, int64_t epochs_done, int64_t step, const pass_stats *partial,
                    double epoch_seconds);
/* --resume, before anything is built: the run's settings from the checkpoint's metadata, parsed
   into *meta_out (the caller frees it) for resume_state. */
int resume_settings(settings *s, ampc_checkpoint_meta **meta_out);
/* --resume, once built: model, optimizer, scaler and RNG, the epoch counter and the history. */
int resume_state(run *r);

// Data-parallel agreement (agree.c): what every rank of an mpirun job must share

/* Before the run is built: the options that shape the job's arithmetic and steps, and the bytes
   of the --resume and --pretrained files. Once built: the precision, the data sets (size and
   fingerprint), the classes, the sample shape and the model. A difference ends the job on every
   rank at once (exit 1, one line from rank 0 naming the ranks and the difference). Nothing alone. */
int agree_settings(run *r);
int agree_built(run *r);

// Setting up (setup.c)

/* Resolves the "auto" values and builds data, model, optimizer, scaler, loaders and the learning-rate schedule. */
int run_build(run *r);
void run_free(run *r);
void print_setup(run *r);

// One pass (pass.c)

/* One pass over a loader: training (autocast forward, scaled backward, scaler step) or
   validation (eval mode, no-grad, autocast, no scaler; it fills r->tally.confusion). A training
   pass may continue one that a signal stopped (the totals so far in *carry): at sample
   carry->samples of the epoch, which all ranks together had taken in carry->steps steps, on this
   or any other number of ranks. Returns 0 at the end of the pass, 1 when a signal or
   --stop-after-steps stopped it (st holds the totals so far), 2 when the grad scaler's guard rails
   did (r->stop.diverged_why; every rank alike), -1 on an error. */
int run_pass(run *r, bool training, int64_t epoch, pass_stats *st, const pass_stats *carry);
/* The model's forward on x and its cross-entropy against y (o NULL: the plain call), under whatever
   autocast the caller set; *logits (may be NULL) gets the logits as rows of classes: (B, classes),
   or (B T, vocabulary) for token windows, whose targets (B, T) are flattened alike. NULL + the
   library's error. */
ampc_tensor *model_loss(run *r, ampc_tensor *x, ampc_tensor *y, const ampc_cross_entropy_options *o, ampc_tensor **logits);
/* A batch of b zero samples of the data's kind: images f32 (b, C, H, W) with labels (b), or token
   windows i64 (b, T) with targets (b, T); on the default device. 0 or -1 (the library's error). */
int zero_batch(run *r, int64_t b, ampc_tensor **x, ampc_tensor **y);

// Sampling (sample.c)

/* --sample N: N tokens generated by the model from --prompt (nanoGPT's generate: the last
   block_size tokens in, the last position's logits / --temperature, the --top-k largest kept, a
   draw from their softmax), printed (as text for a byte vocabulary, else token ids). 0 or -1. */
int sample_print(run *r);

// Divergence and checkpoints (diverge.c)

/* After a training batch: the loss and, when it ended an optimizer step, the grad scaler's skips
   and scale. x is the batch. Returns 0, 1 when the scaler's guard rails stop the run (why in
   r->stop.diverged_why), or -1 (an error, or a divergence that stops without saving). */
int check_step(run *r, int64_t epoch, int64_t step, int64_t n_steps, double loss, ampc_tensor *x, bool stepped);
/* After an epoch's training pass: an epoch whose optimizer steps the grad scaler all skipped stops
   the run as the guard rails do (2, as run_pass), or 0. */
int check_epoch_applied(run *r, int64_t epoch, const pass_stats *tr);
/* A divergence seen in one process ("in epoch E at step S of N: <why>", no step when 0): stops
   without saving, naming the last good checkpoint; -1 with exit status 3. */
int diverged(run *r, int64_t epoch, int64_t step, int64_t n_steps, const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* The grad scaler's guard rails stopped the run: saves diverged.safetensors where it stopped
   (unless the weights hold NaN/inf) and keeps the error with the remedies; -1, exit status 3. */
int diverged_save(run *r, int64_t epoch, const pass_stats *tr, double epoch_seconds);
/* The checkpoint (and model.safetensors) replaces the last one after epochs_done epochs and `step`
   steps of the next (partial: its totals so far), unless the weights or optimizer state hold NaN/inf. */
int save_checkpoint(run *r, int64_t epochs_done, int64_t step, const pass_stats *partial, double epoch_seconds);

// Outputs (outputs.c)

/* "dir/name", malloc'd; NULL (with the error kept) when out of memory. */
char *path_join(const char *dir, const char *name);
/* The folder path is in: "." for a bare name, "/" for one in the root; malloc'd, NULL (with the
   error kept) when out of memory. */
char *path_dir(const char *path);
/* Makes --out (rank 0, before the run's first file): a dated folder exclusively, with a suffix
   -2, -3, ... where it exists (two runs started in the same second get two), then points
   runs/latest at it where the name was chosen (a "latest" that is not a link is left as it is,
   with a warning). 0 or -1 with the error kept. */
int out_make(settings *s);
/* Before the first epoch: --out made (rank 0), locked and checked, its paths set in r->out,
   metrics.csv, steps.csv and the TensorBoard file opened, stale temporaries removed, and the
   "outputs:" line printed. */
int outputs_open(run *r);
/* metrics.csv's history drawn (rank 0): loss.png, accuracy.png and steplog_plot's. */
int draw_plots(run *r);
/* After a validation pass: confusion.csv (rank 0; the job's counts). */
int write_confusion(run *r);
/* The last validation's per-class accuracy, for the summary. */
void print_per_class(run *r);

// Out of memory (oom.c)

/* After an out-of-memory error in training under --max-memory `limit`: measures what fits and
   points g_oom_hint at the advice. */
void oom_advice(run *r, double limit);

// The run (trainer.c)

/* Set by SIGINT/SIGTERM while epochs run (the signal's number): the pass stops at the next step
   boundary and the run saves where it stands. */
extern volatile sig_atomic_t g_signal;

/* A whole run: build, optionally resume, train the remaining epochs, write the outputs. */
int train_run(settings *s, run_result *res);

#endif
