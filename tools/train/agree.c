/*
 * agree.c - under mpirun, what every rank of the job must share, checked before training (what
 * PyTorch users get from TORCH_DISTRIBUTED_DEBUG, and more). Ranks started with other flags,
 * other data, another checkpoint or another precision would otherwise issue different collectives
 * and hang, die in MPI_ERR_TRUNCATE, or train replicas that drift apart in silence.
 *
 * Each rank lists facts (a name and its value as text); rank 0 broadcasts the hashes of its own,
 * every rank finds the first fact where it differs, an all-reduce tells every rank which ranks
 * differ, and the first of them broadcasts its value, so that rank 0 can name both. Every rank
 * then fails together (the job's error: one line from rank 0, exit 1, no MPI_Abort).
 */
#include "train.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>

#define MAX_FACTS (OPT_COUNT + 8)
#define FACT_TEXT 240

typedef struct {
    char what[64];             /* "--lr", "the training data" */
    char text[FACT_TEXT];      /* the value, as the message shows it */
} fact;

typedef struct {
    fact f[MAX_FACTS];
    int n;
} facts;

static void add(facts *fs, const char *what, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void add(facts *fs, const char *what, const char *fmt, ...) {
    if (fs->n >= MAX_FACTS) return;
    fact *f = &fs->f[fs->n++];
    snprintf(f->what, sizeof f->what, "%s", what);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f->text, sizeof f->text, fmt, ap);
    va_end(ap);
}

static uint64_t hash_bytes(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* A file's size and a hash of its bytes (8 at a time): "N bytes, hash H". */
static int file_fact(facts *fs, const char *what, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return fail("%s '%s': %s", what, path, strerror(errno));
    static uint64_t buf[1 << 14];
    uint64_t h = 1469598103934665603ull, size = 0;
    size_t got;
    while ((got = fread(buf, 1, sizeof buf, f)) > 0) {
        size_t words = got / 8;
        for (size_t i = 0; i < words; i++) h = (h ^ buf[i]) * 1099511628211ull;
        h = hash_bytes(h, (const char *)buf + words * 8, got - words * 8);
        size += got;
    }
    const bool bad = ferror(f);
    fclose(f);
    if (bad) return fail("%s '%s': read error", what, path);
    add(fs, what, "%" PRIu64 " bytes, content hash %016" PRIx64, size, h);
    return 0;
}

/* The job agrees on every fact, or fails on every rank naming the first difference. */
static int agree(const facts *mine, const char *stage) {
    const int world = ampc_dist_world_size(), rank = ampc_dist_rank();
    if (world <= 1) return 0;
    uint64_t h0[MAX_FACTS + 1] = {(uint64_t)mine->n};
    for (int i = 0; i < mine->n; i++) h0[i + 1] = hash_bytes(1469598103934665603ull, mine->f[i].text, strlen(mine->f[i].text));
    if (ampc_dist_broadcast(h0, sizeof h0, 0) < 0) return fail_lib(stage);
    int first = -1;   /* this rank's first fact that differs from rank 0's */
    for (int i = 0; i < mine->n && first < 0; i++)
        if (i >= (int)h0[0] || hash_bytes(1469598103934665603ull, mine->f[i].text, strlen(mine->f[i].text)) != h0[i + 1]) first = i;
    if (first < 0 && (uint64_t)mine->n != h0[0]) first = mine->n;
    double *diff = calloc((size_t)world, sizeof *diff);   /* per rank: its first differing fact + 1, or 0 */
    if (!diff) return fail("out of memory");
    diff[rank] = first + 1;
    if (ampc_dist_allreduce_sum_f64(diff, world) < 0) {
        free(diff);
        return fail_lib(stage);
    }
    int odd = -1, n_odd = 0;
    char ranks[256] = "";
    size_t at = 0;
    for (int k = 0; k < world; k++) {
        if (diff[k] == 0) continue;
        if (odd < 0) odd = k;
        if (n_odd++ < 8) appendf(ranks, sizeof ranks, &at, "%s%d", n_odd > 1 ? ", " : "", k);
    }
    if (n_odd > 8) appendf(ranks, sizeof ranks, &at, " and %d more", n_odd - 8);
    const int which = odd < 0 ? 0 : (int)diff[odd] - 1;
    free(diff);
    if (odd < 0) return 0;
    /* the odd rank's value and rank 0's, for one message */
    char theirs[FACT_TEXT] = "", ours[FACT_TEXT] = "";
    if (rank == odd) snprintf(theirs, sizeof theirs, "%s", which < mine->n ? mine->f[which].text : "(nothing)");
    if (rank == 0) snprintf(ours, sizeof ours, "%s", which < mine->n ? mine->f[which].text : "(nothing)");
    if (ampc_dist_broadcast(theirs, sizeof theirs, odd) < 0) return fail_lib(stage);
    const char *what = which < mine->n ? mine->f[which].what : "the number of facts";
    fail("the processes disagree %s: rank%s %s differ%s from rank 0 (first in %s: '%s' on rank %d, '%s' on rank 0); every process of "
         "a job must be started with the same flags, data and files",
         stage, n_odd > 1 ? "s" : "", ranks, n_odd > 1 ? "" : "s", what, theirs, odd, rank == 0 ? ours : "");
    g_job_error = true;   /* every rank fails here together: rank 0 says it */
    return -1;
}

/* The flags that may differ from process to process: paths and names (the files' contents are
   compared instead; rank 0 alone writes --out), threads, devices, memory budgets and the display. */
static bool per_process(int i) {
    return i == OPT_DATA || i == OPT_INDEX_CSV || i == OPT_THREADS || i == OPT_DEVICE || i == OPT_NUM_WORKERS || i == OPT_PIN_MEMORY || i == OPT_MAX_MEMORY ||
           i == OPT_OUT || i == OPT_NAME || i == OPT_OVERWRITE || i == OPT_RESUME || i == OPT_PROGRESS || i == OPT_PRETRAINED || i == OPT_EXPLAIN;
}

int agree_settings(run *r) {
    if (ampc_dist_world_size() <= 1) return 0;
    static facts fs;   /* large: off the stack */
    fs.n = 0;
    char flag[64];
    for (int i = 0; i < OPT_COUNT; i++) {
        if (per_process(i)) continue;
        snprintf(flag, sizeof flag, "--%s", OPTS[i].name);
        add(&fs, flag, "%s", sval(r->s, i));
    }
    if (*sval(r->s, OPT_RESUME) && file_fact(&fs, "the --resume checkpoint", sval(r->s, OPT_RESUME)) < 0) return -1;
    if (*sval(r->s, OPT_PRETRAINED) && file_fact(&fs, "the --pretrained file", sval(r->s, OPT_PRETRAINED)) < 0) return -1;
    return agree(&fs, "on the run's settings");
}

int agree_built(run *r) {
    if (r->world <= 1) return 0;
    static facts fs;
    fs.n = 0;
    add(&fs, "the precision", "%s", r->m.use_amp ? (r->m.amp_dtype == AMPC_BF16 ? "bf16 autocast" : "fp16 autocast") : "fp32");
    add(&fs, "the grad scaler", "%s", ampc_scaler_is_enabled(r->m.scaler) ? "on" : "off");
    add(&fs, "the training data", "%" PRId64 " samples, fingerprint %016" PRIx64, ampc_dataset_size(r->d.train),
        ampc_dataset_fingerprint(r->d.train));
    add(&fs, "the validation data", "%" PRId64 " samples, fingerprint %016" PRIx64, ampc_dataset_size(r->d.val),
        ampc_dataset_fingerprint(r->d.val));
    add(&fs, "the classes", "%" PRId64, r->d.num_classes);
    add(&fs, "the sample shape", "%" PRId64 "x%" PRId64 "x%" PRId64, r->d.c, r->d.h, r->d.w);
    add(&fs, "the model", "%" PRId64 " parameters, %" PRId64 " trainable", ampc_module_num_parameters(r->m.net, false),
        ampc_module_num_parameters(r->m.net, true));
    add(&fs, "the starting epoch", "%" PRId64 " step %" PRId64, r->resume.epoch0, r->resume.step);
    return agree(&fs, "on what they built");
}
