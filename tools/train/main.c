/*
 * main.c - ampc-train, the training program: PyTorch's train.py for image classifiers, in C.
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
 * Data-parallel: started by an MPI launcher (`mpirun -np 4 ampc-train ...`, a hostfile for several
 * machines) every process trains one replica on its shard of each epoch (--batch-size per
 * process), gradients averaged during backward (ampc/dist.h). Rank 0 alone prints, draws and
 * writes checkpoints and metrics.csv; the other ranks print only their errors, prefixed with their
 * rank. An error on any rank ends the whole job (MPI_Abort) with that rank's exit status.
 * Without a launcher nothing of MPI is touched.
 *
 * This file: main, --compare and --compare-checkpoints; train.h lists the other files of tools/train/.
 */
#include "train.h"
#include "progress.h"
#include "waitpolicy.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <time.h>

// ---------------------------------------------------------------------------------------------
// The run's folder: --out, or runs/<--name>, or a new runs/<date>-<time>

#define RUNS_ROOT "runs"

static bool good_name(const char *n) {
    if (!*n || strlen(n) > 200 || !strcmp(n, ".") || !strcmp(n, "..") || !strcmp(n, "latest")) return false;
    for (const char *c = n; *c; c++)
        if (!(isalnum((unsigned char)*c) || *c == '.' || *c == '-' || *c == '_')) return false;
    return true;
}

/* Sets --out where the command line leaves it to us (out_make, when the run first writes, makes
   the folder; a dated one may then take a suffix). */
static int choose_out(settings *s) {
    const bool named = !is_auto(s, OPT_NAME), resume = *sval(s, OPT_RESUME) != '\0';
    if (named && !good_name(sval(s, OPT_NAME)))
        return usage_error("--name '%s': a folder name of letters, digits, '.', '-' and '_' (not 'latest')", sval(s, OPT_NAME));
    if (s->given[OPT_OUT] && !is_auto(s, OPT_OUT)) return named ? usage_error("--out and --name both name the run's folder: give one") : 0;
    if (resume) {   /* continue in the checkpoint's folder */
        if (named) return usage_error("--resume continues in the checkpoint's folder: --name does not apply (--out moves the run)");
        char *dir = path_dir(sval(s, OPT_RESUME));
        int rc = dir ? set_val(s, OPT_OUT, dir) : -1;
        free(dir);
        return rc;
    }
    char stamp[32];
    time_t now = time(NULL);
    struct tm tm;
    strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", localtime_r(&now, &tm));
    char *dir = path_join(RUNS_ROOT, named ? sval(s, OPT_NAME) : stamp);
    int rc = dir ? set_val(s, OPT_OUT, dir) : -1;
    free(dir);
    s->link_latest = rc == 0;
    s->dated = rc == 0 && !named;
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
        s.link_latest = s.dated = false;   /* the pair's folder is the run's (runs/latest: it) */
        char *out = path_join(sval(base, OPT_OUT), names[k]);
        int rc = out ? set_val(&s, OPT_OUT, out) : -1;
        if (rc == 0) rc = set_val(&s, OPT_USE_AMP, k ? "yes" : "no");
        free(out);
        if (rc == 0) {
            printf("==== %s ====\n", k ? "AMP" : "fp32");
            ampc_memory_empty_cache();
            rc = train_run(&s, &rr[k]);
        }
        char dt[16];
        snprintf(dt, sizeof dt, "%s", yes(&s, OPT_USE_AMP) ? sval(&s, OPT_AMP_DTYPE) : "fp32");   /* fastest may keep fp32 */
        settings_free(&s);
        if (rc < 0) return rc;
        if (k) names[1] = strcmp(dt, "fp16") == 0 ? "AMP (fp16)" : strcmp(dt, "bf16") == 0 ? "AMP (bf16)" : "fp32 (fastest)";
    }
    if (!rr[0].ok || rr[0].epochs_run == 0) return 0;
    if (ampc_dist_rank() == 0) {   /* the two runs' loss and throughput per step, overlaid */
        const char *legend[2] = {"fp32", names[1]};
        char title[160];
        snprintf(title, sizeof title, "%s: fp32 vs %s", sval(base, OPT_MODEL), names[1]);
        if (steplog_compare_plot(sval(base, OPT_OUT), legend, title) < 0) return -1;
    }
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

/* libgomp takes $OMP_NUM_THREADS as it is and crashes creating 100000 threads at the first
   parallel region; --threads has a bound, the variable gets the same one, before any such region. */
static int check_omp_env(void) {
    const char *v = getenv("OMP_NUM_THREADS");
    if (!v) return 0;
    char *end;
    errno = 0;
    long long n = strtoll(v, &end, 10);   /* "8" or a list "8,4": the outer level's count */
    if (end != v && (errno == ERANGE || n > (long long)OPTS[OPT_THREADS].hi))   /* what libgomp would not read is its to ignore */
        return fail("OMP_NUM_THREADS=%.40s is more threads than the %.0f " PROG " allows (--threads): unset it or lower it",
                    v, OPTS[OPT_THREADS].hi);
    return 0;
}

int main(int argc, char **argv) {
    ampc_tool_wait_policy(argv);   /* first: it may execute the program again */
    if (ampc_dist_launched() && ampc_dist_init(&argc, &argv) < 0) {
        fprintf(stderr, PROG ": error: starting MPI: %s\n", ampc_last_error());
        return 1;
    }
    const int rank = ampc_dist_rank(), world = ampc_dist_world_size();
    if (rank > 0 && !freopen("/dev/null", "w", stdout)) return 1;   /* rank 0 speaks for the job */
    settings s;
    const char *cmp_a = NULL, *cmp_b = NULL;
    int prc = parse_args(argc, argv, &s, &cmp_a, &cmp_b), rc = prc < 0 ? -1 : 0;
    if (prc == 1 || prc == 2) {
        if (prc == 1) print_help();
        else printf(PROG " (ampc) %s\nLicence: MIT (see LICENSE)\n", ampc_version());
        settings_free(&s);
        return 0;
    }
    if (rc == 0) rc = check_omp_env();
    if (rc == 0 && ampc_init() < 0) rc = fail_lib("init");
    if (rc == 0 && ampc_dist_set_timeout(rval(&s, OPT_COLLECTIVE_TIMEOUT)) < 0) rc = fail_lib("--collective-timeout");
    if (rc == 0) {
        const char *pm = sval(&s, OPT_PROGRESS);
        /* under mpirun rank 0's stdout is the launcher's pty (Open MPI), a terminal to isatty
           wherever mpirun's own output goes (a log file as often as not): lines, never a bar */
        const bool launched = ampc_dist_launched();
        if (rank == 0 && launched && !strcmp(pm, "bar"))
            fprintf(stderr, PROG ": --progress bar under mpirun: a line per 10%% instead (its output may be a file)\n");
        progress_set_mode(rank > 0 || !strcmp(pm, "off")          ? PROGRESS_OFF
                          : launched || !strcmp(pm, "lines")     ? PROGRESS_LINES
                          : !strcmp(pm, "bar")                   ? PROGRESS_BAR
                                                                 : PROGRESS_AUTO);
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
        else if ((rc = choose_out(&s)) == 0 && (rank > 0 || (rc = out_make(&s)) == 0)) rc = compare_runs(&s);
    } else if (rc == 0) {
        rc = choose_out(&s);
        run_result res;
        if (rc == 0) rc = train_run(&s, &res);
    }
    settings_free(&s);
    ampc_shutdown();
    if (rc < 0) {
        fflush(stdout);
        char who[32] = "";
        if (world > 1) snprintf(who, sizeof who, "rank %d: ", rank);
        if (g_interrupt) {
            if (rank == 0) fprintf(stderr, PROG ": interrupted by %s\n", g_err);
        } else if (g_job_error) {
            if (rank == 0) fprintf(stderr, PROG ": error: %s\n", g_err);
        } else if (g_err_status == AMPC_ERR_OOM || strstr(g_err, "out of memory")) {
            fprintf(stderr, PROG ": %serror: %s; %s\n", who, g_err, g_oom_hint);
        } else {
            fprintf(stderr, PROG ": %serror: %s%s\n", who, g_err, g_usage ? " (see --help)" : "");
        }
        fflush(stderr);
        /* a signal or the guard rails stop every rank at the same step (they agree), so they leave
           together; an error on one rank ends the others, wherever they wait */
        if (world > 1 && !g_interrupt && !g_job_error) ampc_dist_abort(g_exit);
        ampc_dist_finalize();
        return g_exit;
    }
    ampc_dist_finalize();
    return 0;
}
