/*
 * test_io.c - checkpoints (safetensors round trip, corruption, atomic replace, listing, a file
 * from an older version), the metrics CSV and ampc-train's PNG plots (tools/plot.c, built into
 * this test).
 *
 * A checkpoint is checked three ways: restored into a differently initialised copy it gives
 * bit-identical state and the next training step gives bit-identical weights; an independent
 * reader here (string search in the header, not the library's parser) finds every tensor with
 * the right dtype, shape and bytes; and, when /usr/bin/python3 has torch, PyTorch loads the
 * weights into the equivalent nn.Sequential (strict load_state_dict) and computes the same
 * forward pass (tests/fixtures/check_safetensors.py).
 */
#include "testutil.h"

#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <inttypes.h>
#include <libgen.h>
#include <math.h>
#include <png.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "amp/amp.h"
#include "io/safetensors.h"
#include "nn/nn.h"
#include "optim/optim.h"
#include "plot.h"   /* tools/ */

extern int ampc__checkpoint_fail_stage;   /* src/io/safetensors.c test hooks */
extern _Thread_local uint64_t ampc__checkpoint_key_compares, ampc__checkpoint_json_parses;

static char tmpdir[64];

static const char *tpath(const char *name) {
    static char buf[8][256];
    static int k;
    char *p = buf[k++ % 8];
    snprintf(p, 256, "%s/%s", tmpdir, name);
    return p;
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static int setup(void **state) {
    tu_group_setup(state);
    snprintf(tmpdir, sizeof tmpdir, "/tmp/ampc-test-io-XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **state) {
    if (getenv("AMPC_TEST_KEEP_FILES")) fprintf(stderr, "test_io: files kept in %s\n", tmpdir);
    else nftw(tmpdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return tu_group_teardown(state);
}

static unsigned char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    rewind(f);
    unsigned char *b = malloc((size_t)sz + 1);
    *n = fread(b, 1, (size_t)sz, f);
    b[*n] = 0;
    fclose(f);
    return b;
}

static void write_all(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(p, 1, n, f), n);
    fclose(f);
}

static bool file_exists(const char *p) { return access(p, F_OK) == 0; }

/* The header size N of a safetensors file (its first 8 bytes, little-endian). */
static uint64_t hn_of(const char *path) {
    unsigned char b[8] = {0};
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fread(b, 1, 8, f), 8);
    fclose(f);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | b[i];
    return n;
}

/* No "<anything>.tmp.<pid>" left in the directory. */
static int count_temp_files(void) {
    DIR *d = opendir(tmpdir);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) n += strstr(e->d_name, ".tmp.") != NULL;
    closedir(d);
    return n;
}

// ---------------------------------------------------------------------------------------------
// Models, training steps, state snapshots

#define D_IN 4
#define BATCH 6

static ampc_module *mlp(uint64_t seed, int64_t out) {
    ampc_manual_seed(seed);
    ampc_module *m = ampc_sequential(4, ampc_linear_new(D_IN, 8, true), ampc_relu_new(), ampc_dropout_new(0.2),
                                     ampc_linear_new(8, out, true));
    ASSERT_NOT_NULL_MSG(m);
    return m;
}

static ampc_scaler *scaler(void) {
    ampc_scaler_options o = ampc_scaler_defaults();
    o.init_scale = 0x1p19f;   /* overflows fp16 grads at first: skipped steps and backoffs */
    o.growth_interval = 2;
    o.hysteresis = 2;
    ampc_scaler *s = ampc_scaler_new(&o);
    ASSERT_NOT_NULL_MSG(s);
    return s;
}

typedef enum { OPT_SGD, OPT_ADAM, OPT_ADAMW } opt_kind;

static ampc_optimizer *optimizer(ampc_module *m, opt_kind k) {
    ampc_optimizer *o;
    if (k == OPT_SGD) {
        o = ampc_sgd_new(m, &(ampc_sgd_options){.lr = 0.05, .momentum = 0.9, .nesterov = true, .weight_decay = 1e-4});
    } else {
        ampc_adam_options a = k == OPT_ADAM ? ampc_adam_defaults() : ampc_adamw_defaults();
        a.lr = 0.01;
        a.amsgrad = k == OPT_ADAM;
        o = k == OPT_ADAM ? ampc_adam_new(m, &a) : ampc_adamw_new(m, &a);
    }
    ASSERT_NOT_NULL_MSG(o);
    return o;
}

static ampc_tensor *data_tensor(uint64_t seed, int64_t rows, int64_t cols) {
    double v[64];
    tu_fill_uniform(v, (size_t)(rows * cols), seed, -1, 1);
    ampc_tensor *t = ampc_tensor_from_f64(AMPC_F32, 2, (int64_t[]){rows, cols}, v);
    ASSERT_NOT_NULL_MSG(t);
    return t;
}

static void train_step(ampc_module *m, ampc_optimizer *opt, ampc_scaler *s, ampc_tensor *x, ampc_tensor *y) {
    ampc_scope_begin();
    ampc_autocast_enter(AMPC_F16, true);
    ampc_tensor *out = ampc_module_forward(m, x);
    ampc_tensor *loss = ampc_mse_loss(out, y, AMPC_REDUCTION_MEAN);
    ampc_autocast_exit();
    ASSERT_OK(ampc_backward(ampc_scaler_scale(s, loss)));
    ASSERT_OK(ampc_scaler_step(s, opt));
    ASSERT_OK(ampc_scaler_update(s));
    ampc_optimizer_zero_grad(opt);
    ampc_scope_end();
}

typedef struct {
    unsigned char *b;
    size_t n, cap;
} blob;

static void blob_add(blob *bl, const void *p, size_t n) {
    if (bl->n + n > bl->cap) {
        bl->cap = 2 * (bl->n + n) + 64;
        bl->b = realloc(bl->b, bl->cap);
    }
    if (n) memcpy(bl->b + bl->n, p, n);
    bl->n += n;
}

static void blob_tensor(blob *bl, const ampc_tensor *t) {
    blob_add(bl, &t->dtype, sizeof t->dtype);
    blob_add(bl, t->shape, sizeof(int64_t) * (size_t)t->ndim);
    blob_add(bl, ampc_tensor_cdata(t), (size_t)t->numel * ampc_dtype_size(t->dtype));
}

/* Everything a checkpoint restores, as bytes: model tensors, optimizer state (presence, bytes,
   steps, lr), scaler state, RNG state. */
static blob snapshot(ampc_module *m, ampc_optimizer *opt, ampc_scaler *s) {
    blob bl = {0};
    ampc_tensor **sd;
    int n = ampc_module_state_dict(m, &sd, NULL);
    assert_true(n > 0);
    for (int i = 0; i < n; i++) blob_tensor(&bl, sd[i]);
    if (opt) {
        for (int k = 0; k < 3; k++)
            for (int i = 0; i < opt->n; i++) {
                bool has = opt->state[k][i] != NULL;
                blob_add(&bl, &has, sizeof has);
                if (has) blob_tensor(&bl, opt->state[k][i]);
            }
        blob_add(&bl, opt->steps, sizeof(int64_t) * (size_t)opt->n);
        double lr = ampc_optimizer_get_lr(opt);
        blob_add(&bl, &lr, sizeof lr);
    }
    if (s) {
        double v[AMPC_SCALER_STATE_COUNT];
        assert_int_equal(ampc__scaler_export(s, v, AMPC_SCALER_STATE_COUNT), AMPC_SCALER_STATE_COUNT);
        blob_add(&bl, v, sizeof v);
    }
    uint64_t rng[2];
    ampc_rng_get_state(&rng[0], &rng[1]);
    blob_add(&bl, rng, sizeof rng);
    return bl;
}

static void assert_same(const char *what, blob a, blob b) {
    if (a.n != b.n || memcmp(a.b, b.b, a.n) != 0) fail_msg("%s: state differs (%zu vs %zu bytes)", what, a.n, b.n);
    free(a.b);
    free(b.b);
}

// ---------------------------------------------------------------------------------------------
// An independent reader: string search in the header, not the library's JSON parser

static const char *st_name(ampc_dtype dt) {
    switch (dt) {
    case AMPC_F32: return "F32";
    case AMPC_F16: return "F16";
    case AMPC_BF16: return "BF16";
    case AMPC_F64: return "F64";
    default: return "I64";
    }
}

typedef struct {
    uint64_t b, e;
} span;

static int cmp_span(const void *a, const void *b) {
    const span *x = a, *y = b;
    return x->b < y->b ? -1 : x->b > y->b;
}

/* Finds tensor `name` in the header, checks dtype/shape/bytes against t; records its span. */
static void check_entry(const unsigned char *file, const char *hdr, uint64_t hn, const char *name, const ampc_tensor *t,
                        span *sp) {
    char needle[300];
    snprintf(needle, sizeof needle, "\"%s\":{\"dtype\":\"", name);
    const char *p = strstr(hdr, needle);
    if (!p) fail_msg("independent reader: tensor '%s' not in the header", name);
    p += strlen(needle);
    assert_true(strncmp(p, st_name(t->dtype), strlen(st_name(t->dtype))) == 0 && p[strlen(st_name(t->dtype))] == '"');
    p = strstr(p, "\"shape\":[");
    assert_non_null(p);
    p += strlen("\"shape\":[");
    int nd = 0;
    while (*p != ']') {
        char *end;
        long long v = strtoll(p, &end, 10);
        assert_true(nd < t->ndim);
        assert_int_equal(v, t->shape[nd]);
        nd++;
        p = *end == ',' ? end + 1 : end;
    }
    assert_int_equal(nd, t->ndim);
    unsigned long long b, e;
    assert_int_equal(sscanf(p, "],\"data_offsets\":[%llu,%llu]}", &b, &e), 2);
    size_t nbytes = (size_t)t->numel * ampc_dtype_size(t->dtype);
    assert_int_equal(e - b, nbytes);
    assert_memory_equal(file + 8 + hn + b, ampc_tensor_cdata(t), nbytes);
    sp->b = b;
    sp->e = e;
}

static void independent_read(const char *path, ampc_module *m, ampc_optimizer *opt) {
    size_t size;
    unsigned char *file = read_all(path, &size);
    assert_non_null(file);
    assert_true(size >= 8);
    uint64_t hn = 0;
    for (int i = 7; i >= 0; i--) hn = hn << 8 | file[i];
    assert_true(hn % 8 == 0 && 8 + hn <= size);   /* data 8-byte aligned, as the reference writer */
    char *hdr = strndup((const char *)file + 8, hn);
    assert_int_equal(hdr[0], '{');
    char *last = strrchr(hdr, '}');
    for (char *q = last + 1; *q; q++) assert_int_equal(*q, ' ');   /* padding: spaces */
    assert_non_null(strstr(hdr, "\"__metadata__\":{"));
    assert_non_null(strstr(hdr, "\"format\":\"pt\""));

    ampc_tensor **sd;
    const char **names;
    int n = ampc_module_state_dict(m, &sd, &names);
    span sp[64];
    int ns = 0;
    for (int i = 0; i < n; i++) check_entry(file, hdr, hn, names[i], sd[i], &sp[ns++]);
    static const char *const sgd[] = {"momentum_buffer"}, *const adam[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    for (int i = 0; opt && i < opt->n; i++)
        for (int k = 0; k < (opt->kind == AMPC_OPTIM_SGD ? 1 : 3); k++) {
            if (!opt->state[k][i]) continue;
            const char *pn = NULL;
            for (int j = 0; j < n; j++)
                if (sd[j] == opt->params[i]) pn = names[j];
            char key[256];
            snprintf(key, sizeof key, "optimizer.%s.%s", pn, opt->kind == AMPC_OPTIM_SGD ? sgd[k] : adam[k]);
            check_entry(file, hdr, hn, key, opt->state[k][i], &sp[ns++]);
        }
    /* every tensor found, and together they tile the data buffer */
    int entries = 0;
    for (const char *q = hdr; (q = strstr(q, "\"data_offsets\"")); q++) entries++;
    assert_int_equal(entries, ns);
    qsort(sp, (size_t)ns, sizeof *sp, cmp_span);
    uint64_t at = 0;
    for (int i = 0; i < ns; i++) {
        assert_int_equal(sp[i].b, at);
        at = sp[i].e;
    }
    assert_int_equal(8 + hn + at, size);
    free(hdr);
    free(file);
}

// ---------------------------------------------------------------------------------------------
// Round trips

static void roundtrip(opt_kind kind) {
    ampc_scope_begin();
    ampc_tensor *x = data_tensor(7, BATCH, D_IN), *y = data_tensor(8, BATCH, 3);
    ampc_module *a = mlp(1, 3);
    ampc_optimizer *oa = optimizer(a, kind);
    ampc_scaler *sa = scaler();
    for (int i = 0; i < 8; i++) train_step(a, oa, sa, x, y);
    assert_true(ampc_scaler_steps_skipped(sa) > 0 && ampc_scaler_steps_applied(sa) > 0);
    ampc_optimizer_set_lr(oa, ampc_optimizer_get_lr(oa) * 0.5);   /* a scheduled lr is restored too */

    const char *path = tpath("roundtrip.safetensors");
    const char *kv[] = {"epoch", "3", "note", "a \"quoted\" value, with \\ and caf\xc3\xa9\nand a newline", NULL};
    ASSERT_OK(ampc_checkpoint_save(path, a, oa, sa, kv));
    assert_int_equal(count_temp_files(), 0);
    independent_read(path, a, oa);
    blob saved = snapshot(a, oa, sa);

    /* a different start: other weights, no optimizer state, fresh scaler, other RNG position */
    ampc_module *b = mlp(2, 3);
    ampc_optimizer *ob = optimizer(b, kind);
    ampc_scaler *sb = scaler();
    ampc_manual_seed(99);
    char *meta = NULL;
    ASSERT_OK(ampc_checkpoint_load(path, b, ob, sb, &meta));
    assert_same("restored", saved, snapshot(b, ob, sb));
    assert_float_equal(ampc_scaler_get_scale(sb), ampc_scaler_get_scale(sa), 0);
    assert_int_equal(ampc_scaler_growth_tracker(sb), ampc_scaler_growth_tracker(sa));

    char buf[128];
    assert_int_equal(ampc_checkpoint_meta_get(meta, "epoch", buf, sizeof buf), 1);
    assert_string_equal(buf, "3");
    assert_int_equal(ampc_checkpoint_meta_get(meta, "note", buf, sizeof buf), (int)strlen(kv[3]));
    assert_string_equal(buf, kv[3]);
    assert_int_equal(ampc_checkpoint_meta_get(meta, "optimizer.type", buf, sizeof buf), kind == OPT_SGD ? 3 : kind == OPT_ADAM ? 4 : 5);
    assert_int_equal(ampc_checkpoint_meta_get(meta, "note", buf, 5), (int)strlen(kv[3]));   /* truncated */
    assert_string_equal(buf, "a \"q");
    assert_int_equal(ampc_checkpoint_meta_get(meta, "missing", buf, sizeof buf), AMPC_ERR_INVALID);
    assert_non_null(strstr(ampc_last_error(), "missing"));
    free(meta);
    char *meta2 = NULL;
    ASSERT_OK(ampc_checkpoint_read_meta(path, &meta2));
    assert_int_equal(ampc_checkpoint_meta_get(meta2, "epoch", buf, sizeof buf), 1);
    free(meta2);

    /* one more step from each, from the same RNG position: bit-identical */
    uint64_t seed, off;
    ampc_rng_get_state(&seed, &off);
    train_step(b, ob, sb, x, y);
    ampc_rng_set_state(seed, off);
    train_step(a, oa, sa, x, y);
    assert_same("after one more step", snapshot(a, oa, sa), snapshot(b, ob, sb));

    ampc_optimizer_free(oa);
    ampc_optimizer_free(ob);
    ampc_scaler_free(sa);
    ampc_scaler_free(sb);
    ampc_module_free(a);
    ampc_module_free(b);
    ampc_scope_end();
}

static void test_roundtrip_sgd(void **state) {
    (void)state;
    roundtrip(OPT_SGD);
}
static void test_roundtrip_adam(void **state) {
    (void)state;
    roundtrip(OPT_ADAM);
}
static void test_roundtrip_adamw(void **state) {
    (void)state;
    roundtrip(OPT_ADAMW);
}

/* Conv(1->2, 3x3, no bias), BatchNorm2d(2), ReLU, Flatten, Linear(32->3) for 2x1x4x4 inputs:
   parameters, running stats and an I64 buffer (num_batches_tracked). */
static ampc_module *conv_bn_net(uint64_t seed) {
    ampc_manual_seed(seed);
    ampc_conv2d_options co = {.padding = {1, 1}};
    ampc_module *m = ampc_sequential(5, ampc_conv2d_new(1, 2, 3, &co, false), ampc_batchnorm2d_new(2), ampc_relu_new(),
                                     ampc_flatten_new(), ampc_linear_new(2 * 4 * 4, 3, true));
    ASSERT_NOT_NULL_MSG(m);
    return m;
}

static ampc_tensor *conv_bn_input(void) {
    double xv[2 * 16];
    tu_fill_uniform(xv, 32, 5, -1, 1);
    ampc_tensor *x = ampc_tensor_from_f64(AMPC_F32, 4, (int64_t[]){2, 1, 4, 4}, xv);
    ASSERT_NOT_NULL_MSG(x);
    return x;
}

/* A conv net with BatchNorm: buffers (running stats, an I64 counter) round-trip too. */
static void test_roundtrip_batchnorm(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_module *a = conv_bn_net(3);
    ampc_optimizer *oa = ampc_sgd_new(a, &(ampc_sgd_options){.lr = 0.1, .momentum = 0.5});
    ampc_tensor *x = conv_bn_input(), *y = data_tensor(6, 2, 3);
    for (int i = 0; i < 2; i++) {
        ampc_scope_begin();
        ampc_tensor *loss = ampc_mse_loss(ampc_module_forward(a, x), y, AMPC_REDUCTION_MEAN);
        ASSERT_OK(ampc_backward(loss));
        ASSERT_OK(ampc_optimizer_step(oa));
        ampc_optimizer_zero_grad(oa);
        ampc_scope_end();
    }
    ampc_tensor *nbt = ampc__module_buffer(ampc_module_child(a, 1), "num_batches_tracked");
    assert_int_equal(*(const int64_t *)ampc_tensor_cdata(nbt), 2);
    const char *path = tpath("bn.safetensors");
    ASSERT_OK(ampc_checkpoint_save(path, a, oa, NULL, NULL));
    independent_read(path, a, oa);
    size_t n;
    unsigned char *file = read_all(path, &n);
    assert_non_null(strstr((char *)file + 8, "\"1.num_batches_tracked\":{\"dtype\":\"I64\",\"shape\":[]"));
    assert_non_null(strstr((char *)file + 8, "\"1.running_var\":{\"dtype\":\"F32\",\"shape\":[2]"));
    free(file);

    ampc_module *b = conv_bn_net(4);
    ampc_optimizer *ob = ampc_sgd_new(b, &(ampc_sgd_options){.lr = 0.1, .momentum = 0.5});
    ASSERT_OK(ampc_checkpoint_load(path, b, ob, NULL, NULL));
    assert_same("batchnorm model", snapshot(a, oa, NULL), snapshot(b, ob, NULL));
    ampc_optimizer_free(oa);
    ampc_optimizer_free(ob);
    ampc_module_free(a);
    ampc_module_free(b);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// A checkpoint written before the safetensors code moved to jansson still loads

/* tests/fixtures/checkpoint_v1.safetensors was written by write_v1_checkpoint with the library
   of commit 4d99f58 (the hand-written JSON writer), by
       AMPC_TEST_WRITE_V1=tests/fixtures/checkpoint_v1.safetensors build/test_io
   (see tests/fixtures/README.md). Its weights were set to exact values after three Adam
   (amsgrad) steps under a grad scaler, so that a load is checked against values known here. */
#define V1_STEPS 3

static float v1_value(int tensor, int64_t i) { return (float)(i % 13 - 6) / 64.0f + (float)tensor / 8.0f; }

static void write_v1_checkpoint(const char *path) {
    ampc_scope_begin();
    ampc_module *m = conv_bn_net(3);
    ampc_adam_options ao = ampc_adam_defaults();
    ao.lr = 0.01;
    ao.amsgrad = true;
    ampc_optimizer *o = ampc_adam_new(m, &ao);
    ampc_scaler *s = ampc_scaler_new(NULL);
    ASSERT_NOT_NULL_MSG(o && s);
    ampc_tensor *x = conv_bn_input(), *y = data_tensor(6, 2, 3);
    for (int i = 0; i < V1_STEPS; i++) {
        ampc_scope_begin();
        ampc_tensor *loss = ampc_mse_loss(ampc_module_forward(m, x), y, AMPC_REDUCTION_MEAN);
        ASSERT_OK(ampc_backward(ampc_scaler_scale(s, loss)));
        assert_int_equal(ampc_scaler_step(s, o), 1);
        ASSERT_OK(ampc_scaler_update(s));
        ampc_optimizer_zero_grad(o);
        ampc_scope_end();
    }
    ampc_optimizer_set_lr(o, 0.005);
    ampc_scaler_set_scale(s, 2048.0f);
    ampc_tensor **sd;
    int n = ampc_module_state_dict(m, &sd, NULL);
    for (int k = 0; k < n; k++)
        if (sd[k]->dtype == AMPC_F32)
            for (int64_t i = 0; i < sd[k]->numel; i++) ((float *)ampc_tensor_data(sd[k]))[i] = v1_value(k, i);
    ampc_manual_seed(1234);
    ASSERT_OK(ampc_checkpoint_save(path, m, o, s, (const char *[]){"epoch", "7", "note", "caf\xc3\xa9 \"v1\"", NULL}));
    ampc_optimizer_free(o);
    ampc_scaler_free(s);
    ampc_module_free(m);
    ampc_scope_end();
}

static void test_v1_checkpoint_loads(void **state) {
    (void)state;
    ampc_scope_begin();
    char path[512], dir[512];
    snprintf(dir, sizeof dir, "%s", __FILE__);
    snprintf(path, sizeof path, "%s/fixtures/checkpoint_v1.safetensors", dirname(dir));
    ampc_module *m = conv_bn_net(8);   /* other weights, no optimizer state, default scaler */
    ampc_adam_options ao = ampc_adam_defaults();
    ao.amsgrad = true;
    ampc_optimizer *o = ampc_adam_new(m, &ao);
    ampc_scaler *s = ampc_scaler_new(NULL);
    ASSERT_NOT_NULL_MSG(o && s);
    ampc_manual_seed(99);
    char *meta = NULL;
    ASSERT_OK(ampc_checkpoint_load(path, m, o, s, &meta));

    /* the model: the exact values written, and num_batches_tracked counted the steps */
    ampc_tensor **sd;
    const char **names;
    int n = ampc_module_state_dict(m, &sd, &names);
    assert_int_equal(n, 8);
    for (int k = 0; k < n; k++) {
        if (sd[k]->dtype == AMPC_I64) {
            assert_string_equal(names[k], "1.num_batches_tracked");
            assert_int_equal(*(const int64_t *)ampc_tensor_cdata(sd[k]), V1_STEPS);
            continue;
        }
        const float *v = ampc_tensor_cdata(sd[k]);
        for (int64_t i = 0; i < sd[k]->numel; i++)
            if (v[i] != v1_value(k, i)) fail_msg("%s[%" PRId64 "] is %g, written as %g", names[k], i, v[i], v1_value(k, i));
    }
    /* the optimizer: every slot of every parameter, bytes as the file holds them (the test's own
       reader), three steps, the lr set before saving */
    for (int i = 0; i < o->n; i++) {
        assert_int_equal(o->steps[i], V1_STEPS);
        for (int k = 0; k < 3; k++) assert_non_null(o->state[k][i]);
    }
    independent_read(path, m, o);
    assert_true(ampc_optimizer_get_lr(o) == 0.005);
    /* the scaler, the RNG and the caller's keys */
    assert_true(ampc_scaler_get_scale(s) == 2048.0f);
    ampc_scaler_options so = ampc_scaler_get_options(s);   /* not in the v1 file: the scaler's own */
    assert_true(so.growth_factor == 2.0 && so.backoff_factor == 0.5 && so.growth_interval == 2000);
    assert_int_equal(ampc_scaler_steps_applied(s), V1_STEPS);
    assert_int_equal(ampc_scaler_steps_skipped(s), 0);
    uint64_t seed, offset;
    ampc_rng_get_state(&seed, &offset);
    assert_true(seed == 1234 && offset == 0);
    char buf[64];
    assert_int_equal(ampc_checkpoint_meta_get(meta, "epoch", buf, sizeof buf), 1);
    assert_string_equal(buf, "7");
    assert_int_equal(ampc_checkpoint_meta_get(meta, "note", buf, sizeof buf), (int)strlen("caf\xc3\xa9 \"v1\""));
    assert_string_equal(buf, "caf\xc3\xa9 \"v1\"");
    assert_int_equal(ampc_checkpoint_meta_get(meta, "optimizer.1.weight.step", buf, sizeof buf), 1);
    assert_string_equal(buf, "3");
    free(meta);
    ampc_optimizer_free(o);
    ampc_scaler_free(s);
    ampc_module_free(m);
    ampc_scope_end();
}

/* A model file (ampc_checkpoint_save with no optimizer and no scaler: what ampc-train writes as
   model.safetensors) loads into torchvision's resnet18/resnet50 with strict=True as it is, and
   gives the same logits in eval mode (BatchNorm running statistics moved by two training-mode
   passes first): the small-input stem (1 channel, 28x28, 3x3 stride-1 conv, no max pooling)
   and the standard one (3 channels, 64x64). Within 1e-4 of the largest logit (fp32, other
   convolution algorithms). Skipped without /usr/bin/python3 with torch and torchvision. */
static void test_torchvision_reads_model(void **state) {
    (void)state;
    const struct { const char *arch; int64_t c, hw, classes; bool small; } cases[] = {
        {"resnet18", 1, 28, 10, true},
        {"resnet50", 3, 64, 7, false},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        ampc_scope_begin();
        ampc_model_options mo = {.num_classes = cases[k].classes, .in_channels = cases[k].c, .small_input = cases[k].small};
        ampc_module *m = ampc_model_new(cases[k].arch, &mo);
        ASSERT_NOT_NULL_MSG(m);
        const int64_t n = 2, shape[4] = {n, cases[k].c, cases[k].hw, cases[k].hw}, numel = n * cases[k].c * cases[k].hw * cases[k].hw;
        double *v = malloc((size_t)numel * sizeof *v);
        tu_fill_uniform(v, (size_t)numel, 90 + k, -1, 1);
        ampc_tensor *x = ampc_tensor_from_f64(AMPC_F32, 4, shape, v);
        free(v);
        ampc_module_train(m, true);
        for (int i = 0; i < 2; i++) {   /* the running statistics move */
            ampc_no_grad_enter();
            ASSERT_NOT_NULL_MSG(ampc_module_forward(m, x));
            ampc_no_grad_exit();
        }
        ampc_module_train(m, false);
        ampc_tensor *out = ampc_module_forward(m, x);
        ASSERT_NOT_NULL_MSG(out);
        char mp[256], xp[256], yp[256];
        snprintf(mp, sizeof mp, "%s", tpath("model.safetensors"));
        snprintf(xp, sizeof xp, "%s", tpath("tv_x.f32"));
        snprintf(yp, sizeof yp, "%s", tpath("tv_y.f32"));
        ASSERT_OK(ampc_checkpoint_save(mp, m, NULL, NULL, NULL));
        write_all(xp, ampc_tensor_cdata(x), sizeof(float) * (size_t)numel);
        char script[512], cmd[2048];
        snprintf(script, sizeof script, "%s", __FILE__);
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/fixtures/check_torchvision.py %s %s %s %lld %lld %lld %lld %s", dirname(script), mp,
                 cases[k].arch, xp, (long long)n, (long long)cases[k].c, (long long)cases[k].hw, (long long)cases[k].hw, yp);
        int rc = system(cmd);
        if (rc == -1 || !WIFEXITED(rc) || WEXITSTATUS(rc) == 77 || WEXITSTATUS(rc) == 127) {
            ampc_module_free(m);
            ampc_scope_end();
            skip();
        }
        if (WEXITSTATUS(rc) != 0) fail_msg("torchvision cross-check failed (exit %d): %s", WEXITSTATUS(rc), cmd);
        size_t nb;
        float *ref = (float *)read_all(yp, &nb);
        assert_int_equal(nb, sizeof(float) * (size_t)(n * cases[k].classes));
        double got[64], amax = 0, d = 0;
        ASSERT_OK(ampc_tensor_to_f64(out, got, (size_t)(n * cases[k].classes)));
        for (int64_t i = 0; i < n * cases[k].classes; i++) {
            amax = fmax(amax, fabs((double)ref[i]));
            d = fmax(d, fabs(got[i] - (double)ref[i]));
        }
        print_message("torchvision %s (%s stem): strict load, logits within %.2g of max |logit| %.3g\n", cases[k].arch,
                      cases[k].small ? "small-input" : "standard", d, amax);
        if (!(d <= 1e-4 * amax)) fail_msg("%s: logits differ by %g (max |logit| %g)", cases[k].arch, d, amax);
        free(ref);
        ampc_module_free(m);
        ampc_scope_end();
    }
}

/* PyTorch reads the weights (strict load_state_dict) and computes the same forward pass. */
static void test_pytorch_reads_checkpoint(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_module *m = mlp(11, 3);
    ampc_optimizer *o = optimizer(m, OPT_ADAM);
    ampc_scaler *s = scaler();
    ampc_tensor *x = data_tensor(12, BATCH, D_IN), *y = data_tensor(13, BATCH, 3);
    for (int i = 0; i < 4; i++) train_step(m, o, s, x, y);
    const char *ck = tpath("torch.safetensors"), *xp = tpath("x.f32"), *yp = tpath("y.f32");
    ASSERT_OK(ampc_checkpoint_save(ck, m, o, s, NULL));
    write_all(xp, ampc_tensor_cdata(x), sizeof(float) * BATCH * D_IN);
    char script[512], cmd[2048];
    snprintf(script, sizeof script, "%s", __FILE__);
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/fixtures/check_safetensors.py %s %s %d %d %s", dirname(script), ck, xp, BATCH,
             D_IN, yp);
    int rc = system(cmd);
    if (rc == -1 || !WIFEXITED(rc) || WEXITSTATUS(rc) == 77 || WEXITSTATUS(rc) == 127) {
        /* optional: needs /usr/bin/python3 with torch (Debian python3-torch) */
        ampc_optimizer_free(o);
        ampc_scaler_free(s);
        ampc_module_free(m);
        ampc_scope_end();
        skip();
    }
    if (WEXITSTATUS(rc) != 0) fail_msg("PyTorch cross-check failed (exit %d): %s", WEXITSTATUS(rc), cmd);
    size_t n;
    float *ref = (float *)read_all(yp, &n);
    assert_int_equal(n, sizeof(float) * BATCH * 3);
    ampc_module_train(m, false);
    ampc_tensor *out = ampc_module_forward(m, x);
    ASSERT_NOT_NULL_MSG(out);
    double got[BATCH * 3], want[BATCH * 3];
    ASSERT_OK(ampc_tensor_to_f64(out, got, BATCH * 3));
    for (int i = 0; i < BATCH * 3; i++) want[i] = ref[i];
    /* two fp32 evaluations with reductions of length <= 8 in possibly different orders */
    double tol = 2 * 8 * tu_eps(AMPC_F32) * 4;
    tu_assert_close("torch vs ampc forward", got, want, BATCH * 3, tol, tol);
    free(ref);
    ampc_optimizer_free(o);
    ampc_scaler_free(s);
    ampc_module_free(m);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Bad files: one clear error, nothing changed

typedef struct {
    ampc_module *m;
    ampc_optimizer *o;
    ampc_scaler *s;
} victim;

static victim victim_new(void) {
    victim v = {mlp(21, 3), NULL, scaler()};
    v.o = optimizer(v.m, OPT_SGD);
    ampc_tensor *x = data_tensor(22, BATCH, D_IN), *y = data_tensor(23, BATCH, 3);
    for (int i = 0; i < 3; i++) train_step(v.m, v.o, v.s, x, y);
    return v;
}

static void victim_free(victim v) {
    ampc_optimizer_free(v.o);
    ampc_scaler_free(v.s);
    ampc_module_free(v.m);
}

/* The model's state_dict tensors alone, as bytes. */
static blob weights_blob(ampc_module *m) {
    blob bl = {0};
    ampc_tensor **sd;
    int n = ampc_module_state_dict(m, &sd, NULL);
    for (int i = 0; i < n; i++) blob_tensor(&bl, sd[i]);
    return bl;
}

/* ampc_load_state_dict, as PyTorch's load_state_dict: strict loads every tensor (an ampc
   checkpoint's optimizer tensors are not the model's and are passed over); a head of another
   size is refused strictly, with nothing changed, and not strictly leaves the head as it was
   and loads the rest; the report names each missing, unexpected and mismatched tensor. */
static void test_load_state_dict(void **state) {
    (void)state;
    ampc_scope_begin();
    victim v = victim_new();   /* mlp(21, 3) after three SGD steps */
    const char *p = tpath("pretrained.safetensors");
    char path[256];
    snprintf(path, sizeof path, "%s", p);
    ASSERT_OK(ampc_checkpoint_save(path, v.m, v.o, v.s, NULL));
    blob want = weights_blob(v.m);
    ampc_module *same = mlp(99, 3);
    ampc_load_report r;
    ASSERT_OK(ampc_load_state_dict(path, same, true, NULL, &r));
    assert_true(r.loaded == 4 && r.missing == 0 && r.unexpected == 0 && r.mismatched == 0);
    blob got = weights_blob(same);
    assert_true(got.n == want.n && memcmp(got.b, want.b, want.n) == 0);
    free(got.b);

    ampc_module *other = mlp(98, 5);   /* another head: 5 classes */
    blob before = weights_blob(other);
    char *text = NULL;
    size_t n = 0;
    FILE *rep = open_memstream(&text, &n);
    assert_int_equal(ampc_load_state_dict(path, other, true, rep, &r), AMPC_ERR_SHAPE);
    fclose(rep);
    assert_true(r.loaded == 2 && r.mismatched == 2 && r.missing == 0 && r.unexpected == 0);
    if (!strstr(text, "mismatched: 3.weight: (3, 8) in the file, (5, 8) in the model") || !strstr(ampc_last_error(), "2 mismatched"))
        fail_msg("report '%s', error '%s'", text, ampc_last_error());
    free(text);
    got = weights_blob(other);
    assert_true(got.n == before.n && memcmp(got.b, before.b, before.n) == 0);   /* strict: nothing changed */
    free(got.b);
    ASSERT_OK(ampc_load_state_dict(path, other, false, NULL, &r));   /* not strict: the rest loads */
    ampc_tensor **sa, **sb;
    assert_int_equal(ampc_module_state_dict(v.m, &sa, NULL), 4);
    assert_int_equal(ampc_module_state_dict(other, &sb, NULL), 4);
    for (int i = 0; i < 2; i++) assert_memory_equal(ampc_tensor_cdata(sa[i]), ampc_tensor_cdata(sb[i]), ampc__nbytes(sa[i]));
    got = weights_blob(other);   /* the head as it was: the last 5*8 + 5 floats */
    assert_memory_equal(got.b + got.n - 45 * sizeof(float), before.b + before.n - 45 * sizeof(float), 45 * sizeof(float));
    free(got.b);
    free(before.b);
    free(want.b);
    /* a model with a tensor the file lacks and the file's one the model lacks */
    ampc_module *wider = ampc_sequential(2, ampc_linear_new(D_IN, 8, true), ampc_linear_new(8, 3, false));
    ASSERT_OK(ampc_load_state_dict(path, wider, false, NULL, &r));
    assert_true(r.loaded == 2 && r.missing == 1 && r.unexpected == 2 && r.mismatched == 0);   /* 1.weight; 3.weight, 3.bias */
    ampc_module_free(wider);
    ampc_module_free(other);
    ampc_module_free(same);
    victim_free(v);
    ampc_scope_end();
}

/* A state_dict of F64 tensors (PyTorch's .double() weights) loads into an f32 model, each value
   the double rounded once to f32 (it used to be refused: the CPU device holds no f64 tensors). */
static void test_load_state_dict_f64(void **state) {
    (void)state;
    static const char *names[] = {"0.weight", "0.bias", "3.weight", "3.bias"};
    static const char *shapes[] = {"[8,4]", "[8]", "[3,8]", "[3]"};
    static const int counts[] = {32, 8, 24, 3};
    char h[1024];
    size_t k = (size_t)snprintf(h, sizeof h, "{");
    uint64_t at = 0;
    for (int i = 0; i < 4; i++) {
        k += (size_t)snprintf(h + k, sizeof h - k, "%s\"%s\":{\"dtype\":\"F64\",\"shape\":%s,\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}",
                              i ? "," : "", names[i], shapes[i], at, at + 8u * (uint64_t)counts[i]);
        at += 8u * (uint64_t)counts[i];
    }
    snprintf(h + k, sizeof h - k, "}");
    size_t jn = strlen(h), hn = (jn + 7) / 8 * 8, total = 8 + hn + (size_t)at;
    unsigned char *b = malloc(total);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)hn >> (8 * i));
    memcpy(b + 8, h, jn);
    memset(b + 8 + jn, ' ', hn - jn);
    double v[67];
    for (int i = 0; i < 67; i++) v[i] = (i - 33) * 0.0123456789012345 + 1e-12 * i;   /* no f32 holds these */
    memcpy(b + 8 + hn, v, sizeof v);
    const char *path = tpath("f64.safetensors");
    write_all(path, b, total);
    free(b);
    ampc_module *m = mlp(51, 3);
    ampc_load_report r;
    ASSERT_OK(ampc_load_state_dict(path, m, true, NULL, &r));
    assert_int_equal(r.loaded, 4);
    ampc_tensor **sd;
    assert_int_equal(ampc_module_state_dict(m, &sd, NULL), 4);
    int at_v = 0;
    for (int i = 0; i < 4; i++) {
        const float *got = ampc_tensor_cdata(sd[i]);
        for (int j = 0; j < counts[i]; j++, at_v++)
            if (got[j] != (float)tu_round_to(AMPC_F32, v[at_v])) fail_msg("%s[%d]: %.9g, want %.9g", names[i], j, got[j], v[at_v]);
    }
    ampc_module_free(m);
}

/* Loading path into v fails with status (0: any) and a message holding each of the strings. */
static void expect_load_error(victim v, const char *path, int status, const char *s1, const char *s2, const char *s3) {
    blob before = snapshot(v.m, v.o, v.s);
    char *meta = (char *)"untouched";
    int rc = ampc_checkpoint_load(path, v.m, v.o, v.s, &meta);
    if (rc >= 0) fail_msg("loading %s succeeded", path);
    if (status && rc != status) fail_msg("loading %s: status %d, expected %d: %s", path, rc, status, ampc_last_error());
    assert_null(meta);
    const char *msg = ampc_last_error();
    const char *want[3] = {s1, s2, s3};
    for (int i = 0; i < 3; i++)
        if (want[i] && !strstr(msg, want[i])) fail_msg("error for %s lacks \"%s\": %s", path, want[i], msg);
    assert_same("after a failed load", before, snapshot(v.m, v.o, v.s));
}

static void test_truncated_and_foreign_files(void **state) {
    (void)state;
    ampc_scope_begin();
    victim v = victim_new();
    const char *good = tpath("good.safetensors"), *bad = tpath("bad.safetensors");
    ampc_module *other = mlp(31, 3);
    ASSERT_OK(ampc_checkpoint_save(good, other, NULL, NULL, NULL));
    size_t n;
    unsigned char *f = read_all(good, &n);
    uint64_t hn = 0;
    for (int i = 7; i >= 0; i--) hn = hn << 8 | f[i];
    size_t cuts[] = {0, 3, 8, 8 + (size_t)hn / 2, 8 + (size_t)hn, 8 + (size_t)hn + 7, n - 1};
    for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
        write_all(bad, f, cuts[k]);
        const char *why = cuts[k] < 8 ? "too short" : cuts[k] < 8 + hn ? "exceeds the file size" : "truncated";
        expect_load_error(v, bad, AMPC_ERR_FORMAT, why, NULL, NULL);
    }
    /* header size larger than the file, and implausibly large */
    unsigned char *g = malloc(n);
    memcpy(g, f, n);
    uint64_t big = n;
    for (int i = 0; i < 8; i++) g[i] = (unsigned char)(big >> (8 * i));
    write_all(bad, g, n);
    expect_load_error(v, bad, AMPC_ERR_FORMAT, "exceeds the file size", NULL, NULL);
    /* foreign files: a PNG, a text file, a directory, nothing */
    static const unsigned char png[] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n', 0, 0, 0, 13, 'I', 'H', 'D', 'R'};
    write_all(bad, png, sizeof png);
    expect_load_error(v, bad, AMPC_ERR_FORMAT, "not a safetensors file", NULL, NULL);
    write_all(bad, "hello, world\n", 13);
    expect_load_error(v, bad, AMPC_ERR_FORMAT, NULL, NULL, NULL);
    expect_load_error(v, tmpdir, AMPC_ERR_IO, "not a regular file", NULL, NULL);
    expect_load_error(v, tpath("nonexistent.safetensors"), AMPC_ERR_IO, "cannot open", "nonexistent.safetensors", NULL);
    /* a flipped byte in the header's JSON */
    memcpy(g, f, n);
    g[8 + 1] = '!';
    write_all(bad, g, n);
    expect_load_error(v, bad, AMPC_ERR_FORMAT, "malformed header", NULL, NULL);
    free(g);
    free(f);
    ampc_module_free(other);
    victim_free(v);
    ampc_scope_end();
}

/* A file with this header text and data_bytes zero bytes of data. */
static void write_crafted(const char *path, const char *json, uint64_t data_bytes) {
    size_t jn = strlen(json), hn = (jn + 7) / 8 * 8;
    size_t total = 8 + hn + (size_t)data_bytes;
    unsigned char *b = calloc(1, total);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)hn >> (8 * i));
    memcpy(b + 8, json, jn);
    memset(b + 8 + jn, ' ', hn - jn);
    write_all(path, b, total);
    free(b);
}

/* The header of a valid file for the 4-8-3 MLP, with one entry changed by the arguments:
   entry `which` gets dtype/shape text and a byte shift of its begin offset; skip drops it. */
static uint64_t mlp_header(char *out, size_t cap, int which, const char *dtype, const char *shape, int64_t shift, bool skip,
                           const char *extra) {
    static const char *names[] = {"0.weight", "0.bias", "3.weight", "3.bias"};
    static const char *shapes[] = {"[8,4]", "[8]", "[3,8]", "[3]"};
    static const uint64_t bytes[] = {128, 32, 96, 12};
    size_t k = (size_t)snprintf(out, cap, "{\"__metadata__\":{\"format\":\"pt\"}");
    uint64_t at = 0;
    for (int i = 0; i < 4; i++) {
        if (i == which && skip) continue;
        uint64_t nb = bytes[i];
        if (i == which && dtype && strcmp(dtype, "F16") == 0) nb /= 2;
        uint64_t b = at + (uint64_t)(i == which ? shift : 0);
        k += (size_t)snprintf(out + k, cap - k, ",\"%s\":{\"dtype\":\"%s\",\"shape\":%s,\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}",
                              names[i], i == which && dtype ? dtype : "F32", i == which && shape ? shape : shapes[i], b, b + nb);
        at = b + nb;
    }
    if (extra) k += (size_t)snprintf(out + k, cap - k, ",%s", extra);
    snprintf(out + k, cap - k, "}");
    return at;
}

static void test_bad_headers(void **state) {
    (void)state;
    ampc_scope_begin();
    victim v = victim_new();
    const char *bad = tpath("crafted.safetensors");
    char h[2048];
    /* the crafted header itself is valid: loading it (weights only) works */
    {
        ampc_module *m = mlp(41, 3);
        write_crafted(bad, h, mlp_header(h, sizeof h, -1, NULL, NULL, 0, false, NULL));
        ASSERT_OK(ampc_checkpoint_load(bad, m, NULL, NULL, NULL));
        ampc_module_free(m);
    }
    static const char *garbage[] = {
        "{\"0.weight\":",
        "{]",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}} x",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[01],\"data_offsets\":[0,4]}}",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]}}",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"extra\":1}}",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}",
        "{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
        "{\"a\xff\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
        "{\"a\\ud800\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
        "{\"__metadata__\":{\"k\":1}}",
        "{\"__metadata__\":{\"k\":\"v\",\"k\":\"w\"}}",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
    };
    for (size_t i = 0; i < sizeof garbage / sizeof garbage[0]; i++) {
        write_crafted(bad, garbage[i], 8);
        expect_load_error(v, bad, AMPC_ERR_FORMAT, "malformed header", NULL, NULL);
    }
    write_crafted(bad, "[1,2]", 8);
    expect_load_error(v, bad, AMPC_ERR_FORMAT, "does not start with '{'", NULL, NULL);
    /* overlapping offsets, a gap, trailing bytes */
    uint64_t end = mlp_header(h, sizeof h, 1, NULL, NULL, -4, false, NULL);
    write_crafted(bad, h, end);
    expect_load_error(v, bad, AMPC_ERR_FORMAT, "'0.weight' [0, 128)", "'0.bias' [124, 156)", "overlap");
    end = mlp_header(h, sizeof h, 2, NULL, NULL, 8, false, NULL);
    write_crafted(bad, h, end);
    expect_load_error(v, bad, AMPC_ERR_FORMAT, "belong to no tensor", NULL, NULL);
    end = mlp_header(h, sizeof h, -1, NULL, NULL, 0, false, NULL);
    write_crafted(bad, h, end + 4);
    expect_load_error(v, bad, AMPC_ERR_FORMAT, "trailing data", NULL, NULL);
    /* offsets that don't match dtype and shape */
    end = mlp_header(h, sizeof h, 0, NULL, "[8,3]", 0, false, NULL);
    write_crafted(bad, h, end);
    expect_load_error(v, bad, AMPC_ERR_FORMAT, "'0.weight'", "needs 96 bytes", NULL);
    /* an unknown dtype string, and a known one that is not the model's */
    end = mlp_header(h, sizeof h, 1, "F33", NULL, 0, false, NULL);
    write_crafted(bad, h, end);
    expect_load_error(v, bad, AMPC_ERR_FORMAT, "unknown dtype \"F33\"", NULL, NULL);
    end = mlp_header(h, sizeof h, 1, "F16", NULL, 0, false, NULL);
    write_crafted(bad, h, end);
    expect_load_error(v, bad, AMPC_ERR_SHAPE, "'0.bias'", "F16", "F32");
    /* a missing tensor, a wrong shape, an unexpected tensor */
    end = mlp_header(h, sizeof h, 3, NULL, NULL, 0, true, NULL);
    write_crafted(bad, h, end);
    expect_load_error(v, bad, AMPC_ERR_SHAPE, "lacks the model tensor '3.bias'", "(3,)", NULL);
    end = mlp_header(h, sizeof h, 2, NULL, "[4,6]", 0, false, NULL);
    write_crafted(bad, h, end);
    expect_load_error(v, bad, AMPC_ERR_SHAPE, "'3.weight'", "(4, 6)", "(3, 8)");
    end = mlp_header(h, sizeof h, -1, NULL, NULL, 0, false, "\"9.weight\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[268,268]}");
    write_crafted(bad, h, end);
    expect_load_error(v, bad, AMPC_ERR_SHAPE, "'9.weight'", "the model lacks", NULL);
    victim_free(v);
    ampc_scope_end();
}

/* A refused file leaves nothing behind: the parsed header is released (the ASan build's leak
   check failed here), and the model keeps its weights. */
static void test_load_state_dict_refused_file(void **state) {
    (void)state;
    const char *bad = tpath("refused.safetensors");
    char h[2048];
    ampc_module *m = mlp(61, 3);
    blob before = weights_blob(m);
    uint64_t end = mlp_header(h, sizeof h, -1, NULL, NULL, 0, false, NULL);
    write_crafted(bad, h, end + 4);   /* a parsed header, then trailing data */
    assert_int_equal(ampc_load_state_dict(bad, m, true, NULL, NULL), AMPC_ERR_FORMAT);
    if (!strstr(ampc_last_error(), "trailing data")) fail_msg("%s", ampc_last_error());
    write_crafted(bad, h, end - 4);   /* truncated */
    assert_int_equal(ampc_load_state_dict(bad, m, true, NULL, NULL), AMPC_ERR_FORMAT);
    ampc_clear_error();
    blob after = weights_blob(m);
    assert_true(after.n == before.n && memcmp(after.b, before.b, before.n) == 0);
    free(after.b);
    free(before.b);
    ampc_module_free(m);
}

/* A file truncated (or rewritten shorter) under an open reader: the reader mapped the data, and
   touching a page past the new end was a SIGBUS that killed the process. It now reads the data
   once into memory, so it still holds every byte it validated. */
static void test_truncated_under_reader(void **state) {
    (void)state;
    const char *path = tpath("shrinking.safetensors");
    ampc_module *m = ampc_linear_new(128, 256, true);   /* 129 KiB: pages wholly past the new end */
    ASSERT_OK(ampc_checkpoint_save(path, m, NULL, NULL, NULL));
    st_file f;
    ASSERT_OK(st_open(&f, path, true));
    assert_int_equal(truncate(path, (off_t)(8 + f.header_bytes)), 0);   /* every data page gone */
    ampc_tensor **sd;
    const char **names;
    assert_int_equal(ampc_module_state_dict(m, &sd, &names), 2);
    for (int i = 0; i < 2; i++) {
        const st_entry *e = st_find(&f, names[i]);
        ASSERT_NOT_NULL_MSG(e);
        assert_int_equal(e->end - e->begin, ampc__nbytes(sd[i]));
        assert_memory_equal(f.data + e->begin, ampc_tensor_cdata(sd[i]), ampc__nbytes(sd[i]));
    }
    st_close(&f);
    ampc_module_free(m);
}

/* Real checkpoints of another model, optimizer or scaler setup. */
static void test_mismatched_checkpoints(void **state) {
    (void)state;
    ampc_scope_begin();
    victim v = victim_new();
    const char *p = tpath("other.safetensors");
    /* a different head: 5 outputs */
    ampc_module *m5 = mlp(51, 5);
    ampc_optimizer *o5 = optimizer(m5, OPT_SGD);
    ASSERT_OK(ampc_checkpoint_save(p, m5, o5, v.s, NULL));
    expect_load_error(v, p, AMPC_ERR_SHAPE, "'3.weight'", "(5, 8)", "(3, 8)");
    /* a deeper model: tensors the victim lacks; and the reverse */
    ampc_module *deep = ampc_sequential(6, ampc_linear_new(D_IN, 8, true), ampc_relu_new(), ampc_dropout_new(0.2),
                                        ampc_linear_new(8, 3, true), ampc_relu_new(), ampc_linear_new(3, 2, true));
    ASSERT_OK(ampc_checkpoint_save(p, deep, NULL, NULL, NULL));
    expect_load_error(v, p, AMPC_ERR_SHAPE, "'5.bias'", "the model lacks", NULL);
    ASSERT_OK(ampc_checkpoint_save(p, v.m, v.o, v.s, NULL));
    blob before = snapshot(deep, NULL, NULL);
    assert_true(ampc_checkpoint_load(p, deep, NULL, NULL, NULL) < 0);
    assert_non_null(strstr(ampc_last_error(), "lacks the model tensor '5.weight'"));
    assert_same("deep model after a failed load", before, snapshot(deep, NULL, NULL));
    /* same model, other optimizer kind; no optimizer state; no scaler state */
    ampc_module *same = mlp(52, 3);
    ampc_optimizer *adam = optimizer(same, OPT_ADAM);
    ASSERT_OK(ampc_checkpoint_save(p, same, adam, v.s, NULL));
    expect_load_error(v, p, AMPC_ERR_INVALID, "holds Adam state", "optimizer is SGD", NULL);
    ASSERT_OK(ampc_checkpoint_save(p, same, NULL, v.s, NULL));
    expect_load_error(v, p, AMPC_ERR_FORMAT, "no optimizer state", NULL, NULL);
    ampc_optimizer *sgd = optimizer(same, OPT_SGD);
    ASSERT_OK(ampc_checkpoint_save(p, same, sgd, NULL, NULL));
    expect_load_error(v, p, AMPC_ERR_FORMAT, "no grad scaler state", NULL, NULL);
    /* a negative scale in the metadata (same length, so the header stays valid) */
    ASSERT_OK(ampc_checkpoint_save(p, same, sgd, v.s, NULL));
    size_t n;
    unsigned char *f = read_all(p, &n);
    char *val = strstr((char *)f + 8, "\"scaler.scale\":\"");
    assert_non_null(val);
    val[strlen("\"scaler.scale\":\"")] = '-';
    write_all(p, f, n);
    free(f);
    expect_load_error(v, p, AMPC_ERR_FORMAT, "scaler", "not a positive finite float", NULL);
    /* ...but weights only (no optimizer, no scaler) from any of these works */
    ASSERT_OK(ampc_checkpoint_load(p, v.m, NULL, NULL, NULL));
    assert_same("weights only", snapshot(same, NULL, NULL), snapshot(v.m, NULL, NULL));
    ampc_optimizer_free(o5);
    ampc_optimizer_free(adam);
    ampc_optimizer_free(sgd);
    ampc_module_free(m5);
    ampc_module_free(deep);
    ampc_module_free(same);
    victim_free(v);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Hostile files: FIFOs, huge or deeply nested headers, values out of range, missing state

/* A FIFO with no writer and a character device are refused at once (opening a FIFO would
   block forever; alarm() bounds the test if it did). */
static void test_fifo_and_device(void **state) {
    (void)state;
    ampc_scope_begin();
    victim v = victim_new();
    const char *fifo = tpath("fifo.safetensors");
    assert_int_equal(mkfifo(fifo, 0600), 0);
    alarm(20);
    expect_load_error(v, fifo, AMPC_ERR_IO, "FIFO", fifo, NULL);
    char *meta = NULL;
    assert_int_equal(ampc_checkpoint_read_meta(fifo, &meta), AMPC_ERR_IO);
    assert_null(meta);
    const char *good = tpath("fifo_good.safetensors");
    ASSERT_OK(ampc_checkpoint_save(good, v.m, NULL, NULL, NULL));
    assert_int_equal(ampc_checkpoint_compare(good, fifo, NULL), AMPC_ERR_IO);
    assert_non_null(strstr(ampc_last_error(), "FIFO"));
    alarm(0);
    expect_load_error(v, "/dev/null", AMPC_ERR_IO, "character device", "/dev/null", NULL);
    unlink(fifo);
    victim_free(v);
    ampc_scope_end();
}

/* n distinct names "k<7 digits>", in a scattered order (the sort has work to do). */
static void scattered_name(char *buf, size_t cap, int i, int n) {
    snprintf(buf, cap, "k%07d", (int)(((int64_t)i * 7919) % n));
}

/* A header of n metadata keys (values "v<i>") and no tensors. */
static char *many_keys_header(int n) {
    blob b = {0};
    blob_add(&b, "{\"__metadata__\":{", 17);
    for (int i = 0; i < n; i++) {
        char k[64], e[128];
        scattered_name(k, sizeof k, i, n);
        int len = snprintf(e, sizeof e, "%s\"%s\":\"v%s\"", i ? "," : "", k, k + 1);
        blob_add(&b, e, (size_t)len);
    }
    blob_add(&b, "}}", 3);   /* with the NUL */
    return (char *)b.b;
}

/* Linearity is asserted by counting (test hooks in safetensors.c), not by timing: name
   comparisons in the sorted tensor index (a quadratic step would make billions where n log n
   makes a few million), and JSON parses, each linear in its text (jansson's objects are hash
   tables): one per file read, one per metadata lookup, never one per key. */
static void test_large_headers(void **state) {
    (void)state;
    const int n = 100000;
    const char *p = tpath("large.safetensors");
    /* 100,000 metadata keys: read, then 60 lookups (as ampc-train --resume does) */
    char *json = many_keys_header(n);
    write_crafted(p, json, 0);
    free(json);
    char *meta = NULL;
    ampc__checkpoint_key_compares = ampc__checkpoint_json_parses = 0;
    ASSERT_OK(ampc_checkpoint_read_meta(p, &meta));
    uint64_t c = ampc__checkpoint_key_compares;
    if (c > 25ull * (uint64_t)n) fail_msg("reading %d metadata keys took %" PRIu64 " comparisons: not n log n", n, c);
    assert_int_equal(ampc__checkpoint_json_parses, 1);
    ampc__checkpoint_key_compares = ampc__checkpoint_json_parses = 0;
    for (int j = 0; j < 60; j++) {
        char k[64], buf[64], want[64];
        scattered_name(k, sizeof k, n - 1 - j, n);   /* the last keys of the text: the longest lookups */
        snprintf(want, sizeof want, "v%s", k + 1);
        assert_int_equal(ampc_checkpoint_meta_get(meta, k, buf, sizeof buf), (int)strlen(want));
        assert_string_equal(buf, want);
    }
    c = ampc__checkpoint_key_compares;
    if (c > 60ull * (uint64_t)n) fail_msg("60 lookups among %d keys took %" PRIu64 " comparisons: not linear", n, c);
    assert_int_equal(ampc__checkpoint_json_parses, 60);
    assert_int_equal(ampc_checkpoint_meta_get(meta, "k", NULL, 0), AMPC_ERR_INVALID);
    free(meta);

    /* 100,000 one-byte tensors: validated, and compared with themselves */
    blob b = {0};
    blob_add(&b, "{", 1);
    for (int i = 0; i < n; i++) {
        char k[64], e[160];
        scattered_name(k, sizeof k, i, n);
        int at = atoi(k + 1);
        int len = snprintf(e, sizeof e, "%s\"%s\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[%d,%d]}", i ? "," : "", k, at, at + 1);
        blob_add(&b, e, (size_t)len);
    }
    blob_add(&b, "}", 2);
    write_crafted(p, (char *)b.b, (uint64_t)n);
    free(b.b);
    ampc__checkpoint_key_compares = ampc__checkpoint_json_parses = 0;
    ASSERT_OK(ampc_checkpoint_read_meta(p, &meta));
    c = ampc__checkpoint_key_compares;
    if (c > 25ull * (uint64_t)n) fail_msg("reading %d tensors took %" PRIu64 " comparisons: not n log n", n, c);
    assert_int_equal(ampc__checkpoint_json_parses, 1);
    assert_string_equal(meta, "{}");
    free(meta);
    /* listed in name order, each at the offset its name says */
    ampc_checkpoint_tensor *list = NULL;
    ampc__checkpoint_key_compares = 0;
    assert_int_equal(ampc_checkpoint_list(p, &list), n);
    c = ampc__checkpoint_key_compares;
    if (c > 25ull * (uint64_t)n) fail_msg("listing %d tensors took %" PRIu64 " comparisons: not n log n", n, c);
    for (int i = 0; i < n; i++) {
        if (i) assert_true(strcmp(list[i - 1].name, list[i].name) < 0);
        assert_true(list[i].ampc_dtype == -1 && strcmp(list[i].dtype, "U8") == 0 && list[i].nbytes == 1);
        assert_int_equal(list[i].offset, 8 + hn_of(p) + (uint64_t)atoi(list[i].name + 1));
    }
    free(list);
    char *out = NULL;
    size_t out_n = 0;
    FILE *rep = open_memstream(&out, &out_n);
    assert_int_equal(ampc_checkpoint_compare(p, p, rep), 0);
    fclose(rep);
    assert_string_equal(out, "identical: 100000 tensors, 100,000 bytes of tensor data\n");
    free(out);

    /* one key past the limit on metadata keys */
    json = many_keys_header(1000001);
    write_crafted(p, json, 0);
    free(json);
    assert_int_equal(ampc_checkpoint_read_meta(p, &meta), AMPC_ERR_FORMAT);
    assert_non_null(strstr(ampc_last_error(), "more than 1000000 metadata keys (the limit)"));

    /* nested 10,000 deep: refused by the depth check, without recursion */
    const int depth = 10000;
    static const char *const opens[] = {"{\"__metadata__\":", "{\"t\":{\"dtype\":\"F32\",\"shape\":"};
    for (int k = 0; k < 2; k++) {
        blob d = {0};
        blob_add(&d, opens[k], strlen(opens[k]));
        for (int i = 0; i < depth; i++) blob_add(&d, k ? "[" : "{\"a\":", k ? 1 : 5);
        blob_add(&d, k ? "1" : "\"x\"", k ? 1 : 3);
        for (int i = 0; i < depth + 1 + k; i++) blob_add(&d, k && i < depth ? "]" : "}", 1);
        blob_add(&d, "", 1);
        write_crafted(p, (char *)d.b, 0);
        free(d.b);
        assert_int_equal(ampc_checkpoint_read_meta(p, &meta), AMPC_ERR_FORMAT);
        assert_non_null(strstr(ampc_last_error(), "nested deeper than 3 levels"));
    }
    /* and meta_get on such text stops at the first value that is not a string */
    blob d = {0};
    for (int i = 0; i < depth; i++) blob_add(&d, "{\"a\":", 5);
    blob_add(&d, "", 1);
    assert_int_equal(ampc_checkpoint_meta_get((char *)d.b, "a", NULL, 0), AMPC_ERR_FORMAT);
    assert_non_null(strstr(ampc_last_error(), "metadata values must be strings"));
    free(d.b);
}

/* The checkpoint at src with the first `from` in its header replaced by `to`, written to dst
   (the header re-padded; offsets are relative to the data, so the data stays valid). */
static void edit_header(const char *src, const char *dst, const char *from, const char *to) {
    size_t n;
    unsigned char *f = read_all(src, &n);
    assert_non_null(f);
    uint64_t hn = 0;
    for (int i = 7; i >= 0; i--) hn = hn << 8 | f[i];
    char *hdr = strndup((const char *)f + 8, hn);
    char *at = strstr(hdr, from);
    if (!at) fail_msg("edit_header: \"%s\" is not in the header of %s", from, src);
    blob j = {0};
    blob_add(&j, hdr, (size_t)(at - hdr));
    blob_add(&j, to, strlen(to));
    blob_add(&j, at + strlen(from), strlen(at + strlen(from)) + 1);
    size_t jn = strlen((char *)j.b), padded = (jn + 7) / 8 * 8;
    blob out = {0};
    unsigned char n8[8];
    for (int i = 0; i < 8; i++) n8[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    blob_add(&out, n8, 8);
    blob_add(&out, j.b, jn);
    for (size_t i = jn; i < padded; i++) blob_add(&out, " ", 1);
    blob_add(&out, f + 8 + hn, n - 8 - (size_t)hn);
    write_all(dst, out.b, out.n);
    free(out.b);
    free(j.b);
    free(hdr);
    free(f);
}

/* "\"key\":\"value\"" of a checkpoint's metadata (to edit it). */
static const char *meta_pair(const char *path, const char *key) {
    static char pair[256];
    char *meta = NULL, val[128];
    ASSERT_OK(ampc_checkpoint_read_meta(path, &meta));
    assert_true(ampc_checkpoint_meta_get(meta, key, val, sizeof val) >= 0);
    free(meta);
    snprintf(pair, sizeof pair, "\"%s\":\"%s\"", key, val);
    return pair;
}

/* Loading `good` with key's value set to each of values fails, the message holding `names`
   (the key, or the scaler field). */
static void expect_bad_values(victim v, const char *good, const char *key, const char *const *values, const char *names) {
    char bad[256], from[256];
    snprintf(bad, sizeof bad, "%s", tpath("hostile_value.safetensors"));
    snprintf(from, sizeof from, "%s", meta_pair(good, key));
    for (int i = 0; values[i]; i++) {
        char to[256];
        snprintf(to, sizeof to, "\"%s\":\"%s\"", key, values[i]);
        edit_header(good, bad, from, to);
        expect_load_error(v, bad, AMPC_ERR_FORMAT, names, NULL, NULL);
    }
}

/* The scaler's growth and backoff factors and growth interval travel with the checkpoint and
   are restored on load, as GradScaler.load_state_dict restores them, into a scaler made with
   other options (exactly: 1.1 and 0.37 are doubles); the restored scaler then goes on as the
   saved one. The v1 fixture (test_v1_checkpoint_loads), saved before they were, keeps the
   loading scaler's options. */
static void test_scaler_options_restored(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_scaler_options so = ampc_scaler_defaults();
    so.init_scale = 1024.0;
    so.growth_factor = 1.1;
    so.backoff_factor = 0.37;
    so.growth_interval = 3;
    victim v = {mlp(81, 3), NULL, ampc_scaler_new(&so)};
    ASSERT_NOT_NULL_MSG(v.s);
    v.o = optimizer(v.m, OPT_SGD);
    ampc_tensor *x = data_tensor(82, BATCH, D_IN), *y = data_tensor(83, BATCH, 3);
    for (int i = 0; i < 4; i++) train_step(v.m, v.o, v.s, x, y);
    const char *path = tpath("scaler_options.safetensors");
    ASSERT_OK(ampc_checkpoint_save(path, v.m, v.o, v.s, NULL));
    char *meta = NULL, val[64];
    ASSERT_OK(ampc_checkpoint_read_meta(path, &meta));
    assert_true(ampc_checkpoint_meta_get(meta, "scaler.growth_factor", val, sizeof val) > 0 && strtod(val, NULL) == 1.1);
    assert_true(ampc_checkpoint_meta_get(meta, "scaler.backoff_factor", val, sizeof val) > 0 && strtod(val, NULL) == 0.37);
    assert_true(ampc_checkpoint_meta_get(meta, "scaler.growth_interval", val, sizeof val) > 0 && strcmp(val, "3") == 0);
    free(meta);
    ampc_module *m = mlp(84, 3);
    ampc_optimizer *o = optimizer(m, OPT_SGD);
    ampc_scaler *s = ampc_scaler_new(NULL);   /* defaults: 2.0, 0.5, 2000 */
    ASSERT_OK(ampc_checkpoint_load(path, m, o, s, NULL));
    ampc_scaler_options got = ampc_scaler_get_options(s);
    assert_true(got.growth_factor == 1.1 && got.backoff_factor == 0.37 && got.growth_interval == 3);
    assert_true(ampc_scaler_get_scale(s) == ampc_scaler_get_scale(v.s));
    assert_int_equal(ampc_scaler_growth_tracker(s), ampc_scaler_growth_tracker(v.s));
    for (int i = 0; i < 6; i++) {   /* the same steps: the same scales */
        train_step(v.m, v.o, v.s, x, y);
        train_step(m, o, s, x, y);
        assert_true(ampc_scaler_get_scale(s) == ampc_scaler_get_scale(v.s));
    }
    ampc_scaler_free(s);
    ampc_optimizer_free(o);
    ampc_module_free(m);
    victim_free(v);
    ampc_scope_end();
}

static void test_hostile_values(void **state) {
    (void)state;
    ampc_scope_begin();
    /* an Adam (amsgrad) victim that has taken steps */
    victim v = {mlp(71, 3), NULL, scaler()};
    v.o = optimizer(v.m, OPT_ADAM);
    ampc_tensor *x = data_tensor(72, BATCH, D_IN), *y = data_tensor(73, BATCH, 3);
    for (int i = 0; i < 8; i++) train_step(v.m, v.o, v.s, x, y);
    assert_true(v.o->steps[0] > 0);
    char good[256], bad[256];   /* tpath's buffers are reused */
    snprintf(good, sizeof good, "%s", tpath("hostile_good.safetensors"));
    snprintf(bad, sizeof bad, "%s", tpath("hostile.safetensors"));
    ASSERT_OK(ampc_checkpoint_save(good, v.m, v.o, v.s, NULL));
    ASSERT_OK(ampc_checkpoint_load(good, v.m, v.o, v.s, NULL));   /* unedited, it loads */

    /* step counts: a negative one, INT64_MAX (an overflow on the next step), past 2^53, text */
    static const char *const steps[] = {"-1", "9223372036854775807", "9007199254740993", "1e3", "", " 1", NULL};
    expect_bad_values(v, good, "optimizer.0.weight.step", steps, "metadata 'optimizer.0.weight.step'");
    edit_header(good, bad, "\"optimizer.0.weight.step\"", "\"optimizer.0.weight.steps\"");
    expect_load_error(v, bad, AMPC_ERR_FORMAT, "lacks the metadata 'optimizer.0.weight.step'", NULL, NULL);
    static const char *const counts[] = {"-1", "99999999999999999999", "x", NULL};
    expect_bad_values(v, good, "optimizer.num_params", counts, "metadata 'optimizer.num_params'");
    /* the scaler: a scale that is not a positive finite float, counters out of range */
    static const char *const scales[] = {"inf", "nan", "0", "-1", "1e39", "1e-50", "", "2x", NULL};
    expect_bad_values(v, good, "scaler.scale", scales, "scaler");
    static const char *const trackers[] = {"-1", "2147483648", "9223372036854775807", "0.5", NULL};
    expect_bad_values(v, good, "scaler.growth_tracker", trackers, "growth");
    static const char *const hyst[] = {"0", "-1", "2147483648", NULL};
    expect_bad_values(v, good, "scaler.hysteresis_counter", hyst, "hysteresis");
    static const char *const applied[] = {"-1", "9007199254740993", "9223372036854775807", NULL};
    expect_bad_values(v, good, "scaler.steps_applied", applied, "scaler");
    expect_bad_values(v, good, "scaler.steps_skipped", applied, "scaler");
    /* the options GradScaler.state_dict holds: a growth factor <= 1, a backoff outside (0, 1),
       an interval < 1, text */
    static const char *const growths[] = {"1", "0.5", "-2", "nan", "inf", "1e400", "", "2x", NULL};
    expect_bad_values(v, good, "scaler.growth_factor", growths, "growth");
    static const char *const backoffs[] = {"1", "0", "1.5", "-0.5", "nan", "", NULL};
    expect_bad_values(v, good, "scaler.backoff_factor", backoffs, "backoff");
    static const char *const intervals[] = {"0", "-1", "2147483648", "1.5", NULL};
    expect_bad_values(v, good, "scaler.growth_interval", intervals, "growth");

    /* missing state: a moment of a parameter that has taken steps; max_exp_avg_sq is needed
       only by amsgrad */
    ampc_module *m = mlp(74, 3);
    ampc_optimizer *o = optimizer(m, OPT_ADAM);
    for (int i = 0; i < 8; i++) train_step(m, o, v.s, x, y);
    assert_true(o->steps[2] > 0 && o->state[0][2] && o->state[2][2]);
    ampc_tensor *keep = o->state[0][2];
    o->state[0][2] = NULL;
    ASSERT_OK(ampc_checkpoint_save(bad, m, o, v.s, NULL));
    o->state[0][2] = keep;
    expect_load_error(v, bad, AMPC_ERR_FORMAT, "has the Adam step count of '3.weight'", "but not its 'exp_avg'",
                      "'optimizer.3.weight.exp_avg'");
    keep = o->state[2][2];
    o->state[2][2] = NULL;
    ASSERT_OK(ampc_checkpoint_save(bad, m, o, v.s, NULL));
    o->state[2][2] = keep;
    expect_load_error(v, bad, AMPC_ERR_FORMAT, "'3.weight'", "but not its 'max_exp_avg_sq'", NULL);
    ampc_adam_options ao = ampc_adam_defaults();   /* no amsgrad: that slot is not needed */
    ampc_optimizer *plain = ampc_adam_new(m, &ao);
    ASSERT_NOT_NULL_MSG(plain);
    ASSERT_OK(ampc_checkpoint_load(bad, m, plain, NULL, NULL));
    assert_int_equal(plain->steps[2], o->steps[2]);
    /* state without a step count */
    int64_t st = o->steps[1];
    o->steps[1] = 0;
    ASSERT_OK(ampc_checkpoint_save(bad, m, o, v.s, NULL));
    o->steps[1] = st;
    expect_load_error(v, bad, AMPC_ERR_FORMAT, "'optimizer.0.bias.exp_avg'", "step count of '0.bias' is 0", NULL);
    /* a fresh optimizer (no steps, no state) round-trips; a weights-only file is refused with
       an optimizer, as before */
    ampc_optimizer *fresh = optimizer(m, OPT_ADAM);
    ASSERT_OK(ampc_checkpoint_save(bad, m, fresh, v.s, NULL));
    ASSERT_OK(ampc_checkpoint_load(bad, m, o, v.s, NULL));
    for (int i = 0; i < o->n; i++) assert_true(o->steps[i] == 0 && !o->state[0][i] && !o->state[1][i] && !o->state[2][i]);
    ASSERT_OK(ampc_checkpoint_save(bad, m, NULL, NULL, NULL));
    expect_load_error(v, bad, AMPC_ERR_FORMAT, "holds no optimizer state", NULL, NULL);
    ampc_optimizer_free(fresh);
    ampc_optimizer_free(plain);
    ampc_optimizer_free(o);
    ampc_module_free(m);
    victim_free(v);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Comparing checkpoints

/* ampc_checkpoint_compare(a, b) returns rc, and the report (or the error) holds each string. */
static void expect_compare(const char *a, const char *b, int rc, const char *s1, const char *s2) {
    char *out = NULL;
    size_t n = 0;
    FILE *rep = open_memstream(&out, &n);
    int got = ampc_checkpoint_compare(a, b, rep);
    fclose(rep);
    if (got != rc) fail_msg("compare %s %s: %d, expected %d (%s); report: %s", a, b, got, rc, ampc_last_error(), out);
    const char *want[2] = {s1, s2};
    for (int i = 0; i < 2; i++)
        if (want[i] && !strstr(rc < 0 ? ampc_last_error() : out, want[i]))
            fail_msg("compare %s %s lacks \"%s\": %s", a, b, want[i], rc < 0 ? ampc_last_error() : out);
    free(out);
}

static void test_compare(void **state) {
    (void)state;
    ampc_scope_begin();
    victim v = victim_new();
    char a[256], b[256];
    snprintf(a, sizeof a, "%s", tpath("cmp_a.safetensors"));
    snprintf(b, sizeof b, "%s", tpath("cmp_b.safetensors"));
    ASSERT_OK(ampc_checkpoint_save(a, v.m, v.o, v.s, (const char *[]){"epoch", "1", NULL}));
    /* identical tensors, other metadata */
    ASSERT_OK(ampc_checkpoint_save(b, v.m, v.o, v.s, (const char *[]){"epoch", "2", NULL}));
    expect_compare(a, b, 0, "identical: 8 tensors, ", " bytes of tensor data\n");
    /* one element of one tensor changed */
    ampc_tensor **sd;
    int n_sd = ampc_module_state_dict(v.m, &sd, NULL);
    assert_true(n_sd == 4);
    float *w = ampc_tensor_data(sd[0]), before = w[5];
    double amax = 0;   /* a's largest magnitude: the relative difference's denominator */
    for (int i = 0; i < 32; i++) amax = fmax(amax, fabs((double)w[i]));
    w[5] += 1.0f;
    ASSERT_OK(ampc_checkpoint_save(b, v.m, v.o, v.s, NULL));
    char diff[128];
    const double d = fabs((double)w[5] - (double)before);
    snprintf(diff, sizeof diff, " of 128 bytes differ, max |a-b| %.3g (relative %.3g)\ncheckpoints differ: 1 tensor(s)\n", d, d / amax);
    expect_compare(a, b, 1, "differ: tensor '0.weight': ", diff);
    /* tensors missing (no optimizer state), another shape */
    ASSERT_OK(ampc_checkpoint_save(b, v.m, NULL, NULL, NULL));
    expect_compare(a, b, 1, "differ: tensor 'optimizer.0.bias.momentum_buffer' is only in ", "checkpoints differ: 5 tensor(s)\n");
    ampc_module *m5 = mlp(81, 5);
    ASSERT_OK(ampc_checkpoint_save(b, m5, NULL, NULL, NULL));
    expect_compare(b, a, 1, "differ: tensor '3.weight': F32 (5, 8) vs F32 (3, 8)\n", "differ: tensor '3.bias': F32 (5,) vs F32 (3,)\n");
    /* errors: a corrupt file, a missing one */
    size_t n;
    unsigned char *f = read_all(a, &n);
    f[9] = '[';
    write_all(b, f, n);
    free(f);
    expect_compare(a, b, AMPC_ERR_FORMAT, "checkpoint '", "malformed header");
    expect_compare(tpath("missing.safetensors"), a, AMPC_ERR_IO, "missing.safetensors", NULL);
    assert_int_equal(ampc_checkpoint_compare(a, a, NULL), 0);
    ampc_module_free(m5);
    victim_free(v);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Listing a file's tensors

static void test_list(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_module *m = conv_bn_net(9);
    ampc_optimizer *o = ampc_sgd_new(m, &(ampc_sgd_options){.lr = 0.1, .momentum = 0.5});
    ASSERT_NOT_NULL_MSG(o);
    ampc_tensor *x = conv_bn_input(), *y = data_tensor(6, 2, 3);
    ampc_tensor *loss = ampc_mse_loss(ampc_module_forward(m, x), y, AMPC_REDUCTION_MEAN);
    ASSERT_OK(ampc_backward(loss));
    ASSERT_OK(ampc_optimizer_step(o));
    const char *p = tpath("list.safetensors");
    ASSERT_OK(ampc_checkpoint_save(p, m, o, NULL, NULL));

    /* every state_dict tensor and momentum buffer, by name, with its dtype, shape and the bytes
       at its offset in the file */
    ampc_tensor **sd;
    const char **names;
    int n_sd = ampc_module_state_dict(m, &sd, &names);
    ampc_checkpoint_tensor *list = NULL;
    int n = ampc_checkpoint_list(p, &list);
    assert_int_equal(n, n_sd + o->n);
    size_t size;
    unsigned char *file = read_all(p, &size);
    for (int i = 0; i < n; i++) {
        const ampc_checkpoint_tensor *e = &list[i];
        if (i) assert_true(strcmp(list[i - 1].name, e->name) < 0);
        const ampc_tensor *t = NULL;
        for (int k = 0; k < n_sd && !t; k++) {
            char slot[256];
            snprintf(slot, sizeof slot, "optimizer.%s.momentum_buffer", names[k]);
            if (strcmp(e->name, names[k]) == 0) t = sd[k];
            for (int j = 0; j < o->n && !t; j++)
                if (o->params[j] == sd[k] && strcmp(e->name, slot) == 0) t = o->state[0][j];
        }
        if (!t) fail_msg("listed tensor '%s' is neither the model's nor the optimizer's", e->name);
        assert_int_equal(e->ampc_dtype, t->dtype);
        assert_string_equal(e->dtype, st_name(t->dtype));
        assert_int_equal(e->ndim, t->ndim);
        for (int d = 0; d < t->ndim; d++) assert_int_equal(e->shape[d], t->shape[d]);
        size_t nb = (size_t)t->numel * ampc_dtype_size(t->dtype);
        assert_int_equal(e->nbytes, nb);
        assert_true(e->offset % ampc_dtype_size(t->dtype) == 0 && e->offset + nb <= size);   /* aligned */
        if (t->dtype == AMPC_I64) assert_int_equal(e->offset, 8 + hn_of(p));   /* 8-byte dtypes first */
        assert_memory_equal(file + e->offset, ampc_tensor_cdata(t), nb);
    }
    assert_string_equal(list[0].name, "0.weight");
    assert_int_equal(list[0].ndim, 4);
    free(file);
    free(list);

    /* a file of another program's dtypes, no tensors, and errors */
    write_crafted(p, "{\"ids\":{\"dtype\":\"I32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}", 24);
    assert_int_equal(ampc_checkpoint_list(p, &list), 1);
    assert_true(strcmp(list[0].name, "ids") == 0 && strcmp(list[0].dtype, "I32") == 0 && list[0].ampc_dtype == -1);
    assert_true(list[0].ndim == 2 && list[0].shape[0] == 2 && list[0].shape[1] == 3);
    assert_true(list[0].offset == 8 + hn_of(p) && list[0].nbytes == 24);
    free(list);
    write_crafted(p, "{\"__metadata__\":{\"k\":\"v\"}}", 0);
    list = (ampc_checkpoint_tensor *)p;
    assert_int_equal(ampc_checkpoint_list(p, &list), 0);
    assert_null(list);
    write_crafted(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8);
    list = (ampc_checkpoint_tensor *)p;
    assert_int_equal(ampc_checkpoint_list(p, &list), AMPC_ERR_FORMAT);
    assert_non_null(strstr(ampc_last_error(), "trailing data"));
    assert_null(list);
    assert_int_equal(ampc_checkpoint_list(tpath("missing.safetensors"), &list), AMPC_ERR_IO);
    assert_int_equal(ampc_checkpoint_list(NULL, &list), AMPC_ERR_INVALID);
    ampc_optimizer_free(o);
    ampc_module_free(m);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Atomic replacement

static void test_failed_save_keeps_previous(void **state) {
    (void)state;
    ampc_scope_begin();
    victim v = victim_new();
    const char *p = tpath("atomic.safetensors");
    ASSERT_OK(ampc_checkpoint_save(p, v.m, v.o, v.s, (const char *[]){"epoch", "1", NULL}));
    size_t n0;
    unsigned char *good = read_all(p, &n0);
    ampc_module *other = mlp(61, 3);
    ampc_optimizer *oo = optimizer(other, OPT_SGD);
    /* a directory that doesn't exist: nothing is created */
    char missing[300];
    snprintf(missing, sizeof missing, "%s/no/such/dir/x.safetensors", tmpdir);
    assert_int_equal(ampc_checkpoint_save(missing, other, oo, NULL, NULL), AMPC_ERR_IO);
    assert_non_null(strstr(ampc_last_error(), "can't create"));
    assert_false(file_exists(missing));
    /* failures while writing, at fsync and at rename: the old file survives, no temp is left */
    for (int stage = 1; stage <= 3; stage++) {
        ampc__checkpoint_fail_stage = stage;
        int rc = ampc_checkpoint_save(p, other, oo, NULL, (const char *[]){"epoch", "2", NULL});
        ampc__checkpoint_fail_stage = 0;
        assert_int_equal(rc, AMPC_ERR_IO);
        assert_non_null(strstr(ampc_last_error(), "unchanged"));
        size_t n1;
        unsigned char *now = read_all(p, &n1);
        assert_int_equal(n1, n0);
        assert_memory_equal(now, good, n0);
        free(now);
        assert_int_equal(count_temp_files(), 0);
    }
    /* bad metadata is refused before any file is touched */
    assert_int_equal(ampc_checkpoint_save(p, other, oo, NULL, (const char *[]){"scaler.scale", "1", NULL}), AMPC_ERR_INVALID);
    assert_int_equal(ampc_checkpoint_save(p, other, oo, NULL, (const char *[]){"k", "v", "k", "w", NULL}), AMPC_ERR_INVALID);
    assert_int_equal(ampc_checkpoint_save(p, other, oo, NULL, (const char *[]){"k", "\xc3(", NULL}), AMPC_ERR_INVALID);
    size_t n1;
    unsigned char *now = read_all(p, &n1);
    assert_true(n1 == n0 && memcmp(now, good, n0) == 0);
    free(now);
    /* and a successful save replaces it */
    ASSERT_OK(ampc_checkpoint_save(p, other, oo, NULL, (const char *[]){"epoch", "2", NULL}));
    assert_int_equal(count_temp_files(), 0);
    char *meta;
    ASSERT_OK(ampc_checkpoint_read_meta(p, &meta));
    char buf[8];
    assert_int_equal(ampc_checkpoint_meta_get(meta, "epoch", buf, sizeof buf), 1);
    assert_string_equal(buf, "2");
    free(meta);
    /* malformed text anywhere is an error (the whole text is parsed: a key given twice, a
       value that is not a string, text missing or extra after the object) */
    assert_int_equal(ampc_checkpoint_meta_get("{\"a\":\"b\"", "z", buf, sizeof buf), AMPC_ERR_FORMAT);
    assert_int_equal(ampc_checkpoint_meta_get("{\"a\":\"b\"} x", "z", buf, sizeof buf), AMPC_ERR_FORMAT);
    assert_int_equal(ampc_checkpoint_meta_get("{\"a\":1,\"z\":\"b\"}", "z", buf, sizeof buf), AMPC_ERR_FORMAT);
    assert_int_equal(ampc_checkpoint_meta_get("[\"z\"]", "z", buf, sizeof buf), AMPC_ERR_FORMAT);
    assert_int_equal(ampc_checkpoint_meta_get("{}", "z", buf, sizeof buf), AMPC_ERR_INVALID);
    assert_int_equal(ampc_checkpoint_meta_get("{\"z\":\"b\",\"a\":1}", "z", buf, sizeof buf), AMPC_ERR_FORMAT);
    assert_int_equal(ampc_checkpoint_meta_get("{\"z\":\"b\",\"z\":\"c\"}", "z", buf, sizeof buf), AMPC_ERR_FORMAT);
    assert_non_null(strstr(ampc_last_error(), "duplicate"));
    assert_int_equal(ampc_checkpoint_meta_get(" { \"a\" : \"b\" , \"z\":\"\\u00e9\"", "z", buf, sizeof buf), AMPC_ERR_FORMAT);
    assert_int_equal(ampc_checkpoint_meta_get(" { \"a\" : \"b\" , \"z\":\"\\u00e9\" } ", "z", buf, sizeof buf), 2);
    assert_string_equal(buf, "\xc3\xa9");
    /* parsed once for many lookups: the same checks, values owned by the object */
    assert_null(ampc_checkpoint_meta_parse("{\"z\":\"b\",\"z\":\"c\"}"));
    assert_int_equal(ampc_last_status(), AMPC_ERR_FORMAT);
    ampc_checkpoint_meta *pm = ampc_checkpoint_meta_parse("{\"a\":\"b\",\"z\":\"\"}");
    assert_non_null(pm);
    assert_string_equal(ampc_checkpoint_meta_find(pm, "a"), "b");
    assert_string_equal(ampc_checkpoint_meta_find(pm, "z"), "");
    assert_null(ampc_checkpoint_meta_find(pm, "y"));
    ampc_checkpoint_meta_free(pm);
    ampc_checkpoint_meta_free(NULL);
    free(good);
    ampc_optimizer_free(oo);
    ampc_module_free(other);
    victim_free(v);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Metrics

static void assert_file_text(const char *path, const char *want) {
    size_t n;
    char *got = (char *)read_all(path, &n);
    assert_non_null(got);
    if (strcmp(got, want) != 0) fail_msg("%s holds\n%s\nexpected\n%s", path, got, want);
    free(got);
}

static void test_metrics_csv(void **state) {
    (void)state;
    const char *p = tpath("metrics.csv");
    const char *cols[] = {"epoch", "train_loss", "val acc", "a,\"b\""};
    ampc_metrics *m = ampc_metrics_open(p, cols, 4, false);
    ASSERT_NOT_NULL_MSG(m);
    assert_int_equal(ampc_metrics_num_columns(m), 4);
    ASSERT_OK(ampc_metrics_row(m, (double[]){1, 0.5, 0.1, NAN}));
    /* flushed per row: readable before close */
    assert_file_text(p, "epoch,train_loss,val acc,\"a,\"\"b\"\"\"\n1,0.5,0.1,nan\n");
    ASSERT_OK(ampc_metrics_row(m, (double[]){2, 1.0 / 3.0, 1e-300, -INFINITY}));
    ASSERT_OK(ampc_metrics_row(m, (double[]){3, 2.5e10, INFINITY, -0.0}));
    ASSERT_OK(ampc_metrics_close(m));
    const char *three = "epoch,train_loss,val acc,\"a,\"\"b\"\"\"\n1,0.5,0.1,nan\n2,0.3333333333333333,1e-300,-inf\n"
                        "3,2.5e+10,inf,-0\n";
    assert_file_text(p, three);
    /* whole numbers as integers (a step column stays integers), unless much longer */
    const char *ip = tpath("integers.csv");
    ampc_metrics *mi = ampc_metrics_open(ip, cols, 4, false);
    ASSERT_NOT_NULL_MSG(mi);
    ASSERT_OK(ampc_metrics_row(mi, (double[]){10, 1e6, 123456789, 1e20}));
    ASSERT_OK(ampc_metrics_close(mi));
    assert_file_text(ip, "epoch,train_loss,val acc,\"a,\"\"b\"\"\"\n10,1000000,123456789,1e+20\n");
    /* the numbers read back exactly */
    assert_true(strtod("0.3333333333333333", NULL) == 1.0 / 3.0);

    /* append (resume): same header kept, rows added */
    m = ampc_metrics_open(p, cols, 4, true);
    ASSERT_NOT_NULL_MSG(m);
    ASSERT_OK(ampc_metrics_row(m, (double[]){4, 0.25, 0.75, 1}));
    ASSERT_OK(ampc_metrics_close(m));
    char want[512];
    snprintf(want, sizeof want, "%s4,0.25,0.75,1\n", three);
    assert_file_text(p, want);
    /* a row torn by a crash is dropped */
    FILE *f = fopen(p, "ab");
    fputs("5,0.2", f);
    fclose(f);
    m = ampc_metrics_open(p, cols, 4, true);
    ASSERT_NOT_NULL_MSG(m);
    ASSERT_OK(ampc_metrics_row(m, (double[]){5, 0.125, 0.875, 2}));
    ASSERT_OK(ampc_metrics_close(m));
    snprintf(want, sizeof want, "%s4,0.25,0.75,1\n5,0.125,0.875,2\n", three);
    assert_file_text(p, want);
    /* a different header: refused, file untouched */
    const char *other[] = {"epoch", "loss"};
    assert_null(ampc_metrics_open(p, other, 2, true));
    assert_non_null(strstr(ampc_last_error(), "existing header"));
    assert_file_text(p, want);
    /* append to a new file writes the header */
    const char *q = tpath("fresh.csv");
    m = ampc_metrics_open(q, other, 2, true);
    ASSERT_NOT_NULL_MSG(m);
    ASSERT_OK(ampc_metrics_row(m, (double[]){1, 2}));
    ASSERT_OK(ampc_metrics_close(m));
    assert_file_text(q, "epoch,loss\n1,2\n");
    /* errors */
    assert_null(ampc_metrics_open(tpath("no/dir.csv"), other, 2, false));
    assert_null(ampc_metrics_open(q, (const char *[]){"a", ""}, 2, false));
    assert_null(ampc_metrics_open(q, other, 0, false));
    assert_file_text(q, "epoch,loss\n1,2\n");
}

// ---------------------------------------------------------------------------------------------
// Plots

/* Decodes the PNG with libpng; returns RGBA pixels (caller frees). */
static unsigned char *decode_png(const char *path, unsigned *w, unsigned *h) {
    size_t n;
    unsigned char *f = read_all(path, &n);
    assert_non_null(f);
    static const unsigned char sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    assert_true(n > 8 && memcmp(f, sig, 8) == 0);
    free(f);
    png_image img;
    memset(&img, 0, sizeof img);
    img.version = PNG_IMAGE_VERSION;
    if (!png_image_begin_read_from_file(&img, path)) fail_msg("libpng: %s", img.message);
    img.format = PNG_FORMAT_RGBA;
    unsigned char *px = malloc(PNG_IMAGE_SIZE(img));
    if (!png_image_finish_read(&img, NULL, px, 0, NULL)) fail_msg("libpng: %s", img.message);
    *w = img.width;
    *h = img.height;
    return px;
}

/* Pixels within 40 of an RGB colour (in box b, or anywhere when b is NULL). */
typedef struct { int x0, y0, x1, y1; } pbox;   /* pixels, inclusive */
static int count_color_in(const unsigned char *px, unsigned w, unsigned h, int r, int g, int b, const pbox *in) {
    int n = 0;
    for (unsigned y = 0; y < h; y++)
        for (unsigned x = 0; x < w; x++) {
            const unsigned char *p = px + 4 * ((size_t)y * w + x);
            bool inside = !in || ((int)x >= in->x0 && (int)x <= in->x1 && (int)y >= in->y0 && (int)y <= in->y1);
            n += inside && abs(p[0] - r) + abs(p[1] - g) + abs(p[2] - b) < 40;
        }
    return n;
}
static int count_color(const unsigned char *px, unsigned w, unsigned h, int r, int g, int b) {
    return count_color_in(px, w, h, r, g, b, NULL);
}

/* Bounding box of the pixels within 15 of an RGB colour strictly inside box in (anywhere: NULL);
   false if there are none. */
static bool color_bbox(const unsigned char *px, unsigned w, unsigned h, int r, int g, int b, const pbox *in, pbox *out) {
    *out = (pbox){(int)w, (int)h, -1, -1};
    for (unsigned y = 0; y < h; y++)
        for (unsigned x = 0; x < w; x++) {
            if (in && ((int)x <= in->x0 || (int)x >= in->x1 || (int)y <= in->y0 || (int)y >= in->y1)) continue;
            const unsigned char *p = px + 4 * ((size_t)y * w + x);
            if (abs(p[0] - r) + abs(p[1] - g) + abs(p[2] - b) >= 15) continue;
            if ((int)x < out->x0) out->x0 = (int)x;
            if ((int)x > out->x1) out->x1 = (int)x;
            if ((int)y < out->y0) out->y0 = (int)y;
            if ((int)y > out->y1) out->y1 = (int)y;
        }
    return out->x1 >= 0;
}

static bool is_black(const unsigned char *px, unsigned w, unsigned x, unsigned y) {
    const unsigned char *p = px + 4 * ((size_t)y * w + x);
    return p[0] + p[1] + p[2] < 60;
}

/* The panels' frames, top to bottom: black rows longer than half the image (top and bottom
   edges, in pairs), then in each pair's span the columns black for more than half of it. */
static int find_frames(const unsigned char *px, unsigned w, unsigned h, pbox *out, int max) {
    int rows[2 * 16], nr = 0;
    for (unsigned y = 0; y < h && nr < 2 * max; y++) {
        unsigned n = 0;
        for (unsigned x = 0; x < w; x++) n += is_black(px, w, x, y);
        if (n > w / 2) rows[nr++] = (int)y;
    }
    int nf = 0;
    for (int i = 0; i + 1 < nr; i += 2) {
        pbox f = {-1, rows[i], -1, rows[i + 1]};
        for (unsigned x = 0; x < w; x++) {
            int n = 0;
            for (int y = f.y0; y <= f.y1; y++) n += is_black(px, w, x, (unsigned)y);
            if (n > (f.y1 - f.y0) / 2) {
                if (f.x0 < 0) f.x0 = (int)x;
                f.x1 = (int)x;
            }
        }
        out[nf++] = f;
    }
    return nf;
}

/* Whether a pixel within 1 of where data point (x, y) falls in frame f (its 1 px edges outside the
   plot area) has the colour, for axes ranged [x0, x1] by [y0, y1]. */
static bool color_at(const unsigned char *px, unsigned w, const pbox *f, double x, double y, double x0, double x1,
                     double y0, double y1, int r, int g, int b) {
    double X = f->x0 + 1 + (x - x0) / (x1 - x0) * (f->x1 - f->x0 - 1), Y = f->y1 - (y - y0) / (y1 - y0) * (f->y1 - f->y0 - 1);
    for (int dy = -1; dy <= 1; dy++)
        for (int dx = -1; dx <= 1; dx++) {
            const unsigned char *p = px + 4 * ((size_t)(lround(Y) + dy) * w + (size_t)(lround(X) + dx));
            if (abs(p[0] - r) + abs(p[1] - g) + abs(p[2] - b) < 40) return true;
        }
    return false;
}

#define BLUE 31, 119, 180     /* tab10's first two colours */
#define ORANGE 255, 127, 14
#define LEGEND_EDGE 204, 204, 204

static void test_plot_png(void **state) {
    (void)state;
    double x[12], loss[12], val[12], one_x = 5, one_y = 0.7;
    for (int i = 0; i < 12; i++) {
        x[i] = i + 1;
        loss[i] = 2.0 * exp(-0.3 * i) + 0.1;
        val[i] = 0.9;   /* constant */
    }
    loss[5] = NAN;   /* a gap */
    val[11] = INFINITY;
    plot_series s[3] = {{"train loss", x, loss, 12, false}, {"val loss #1 (const)", x, val, 12, false}, {"single", &one_x, &one_y, 1, true}};
    const char *p = tpath("curves.png");
    ASSERT_OK(plot_curves(p, "Training curves", "epoch", "loss", s, 3));
    assert_int_equal(count_temp_files(), 0);
    unsigned w, h;
    unsigned char *px = decode_png(p, &w, &h);
    assert_int_equal(w, 800);
    assert_int_equal(h, 600);
    assert_true(count_color(px, w, h, 255, 255, 255) > (int)(w * h / 2));   /* white background */
    assert_true(count_color(px, w, h, BLUE) > 200);                           /* series 1 (blue) drawn */
    assert_true(count_color(px, w, h, ORANGE) > 200);                         /* series 2 (orange) */
    assert_true(count_color(px, w, h, 44, 160, 44) > 20);                    /* the single point's marker */
    pbox fr;
    assert_int_equal(find_frames(px, w, h, &fr, 1), 1);
    /* axes: x over [1, 12] padded by 2 %, y over the train loss' range padded by 5 %; the constant
       line at 0.9 runs through x = 6, where the train loss has its gap */
    double lo = 2.0 * exp(-0.3 * 11) + 0.1, hi = 2.1, dx = 11 * 0.02, dy = (hi - lo) * 0.05;
    assert_true(color_at(px, w, &fr, 6, 0.9, 1 - dx, 12 + dx, lo - dy, hi + dy, ORANGE));
    assert_true(color_at(px, w, &fr, 1, 2.1, 1 - dx, 12 + dx, lo - dy, hi + dy, BLUE));
    /* the gap: no blue halfway between x = 5 and 7 on the line that would join them */
    assert_false(color_at(px, w, &fr, 6, (loss[4] + loss[6]) / 2, 1 - dx, 12 + dx, lo - dy, hi + dy, BLUE));
    free(px);

    /* degenerate inputs still give a PNG */
    ASSERT_OK(plot_curves(tpath("single.png"), "one point", "x", "y", &s[2], 1));
    double nan2[2] = {NAN, INFINITY};
    plot_series empty = {"nothing", nan2, nan2, 2, false};
    ASSERT_OK(plot_curves(tpath("empty.png"), NULL, NULL, NULL, &empty, 1));
    px = decode_png(tpath("empty.png"), &w, &h);
    assert_int_equal(find_frames(px, w, h, &fr, 1), 1);   /* empty axes */
    free(px);
    /* text that is not UTF-8 is drawn with '?' for the bad bytes (cairo would fail the figure) */
    plot_series latin1 = {"caf\xe9", x, loss, 12, false};
    ASSERT_OK(plot_curves(tpath("latin1.png"), "r\xe9sum\xe9 \xf0\x9f", "\xc0\xaf", "ok \xc3\xa9", &latin1, 1));
}

/* A diagonal from (0, 0) to (10, 1): every marker where the axes (padded 2 % and 5 %) put it,
   the line inside the plot area and nowhere else; the legend in the empty top-left corner. */
static void test_plot_geometry(void **state) {
    (void)state;
    double x[11], y[11];
    for (int i = 0; i <= 10; i++) x[i] = i, y[i] = i / 10.0;
    plot_series s = {"diagonal", x, y, 11, false};
    const char *p = tpath("diagonal.png");
    ASSERT_OK(plot_curves(p, "diagonal", "x", "y", &s, 1));
    unsigned w, h;
    unsigned char *px = decode_png(p, &w, &h);
    pbox fr, blue, legend;
    assert_int_equal(find_frames(px, w, h, &fr, 1), 1);
    assert_true(fr.x0 > 40 && fr.x1 < 790 && fr.y0 > 10 && fr.y1 < 570 && fr.x1 - fr.x0 > 500 && fr.y1 - fr.y0 > 400);
    for (int i = 0; i <= 10; i++) assert_true(color_at(px, w, &fr, x[i], y[i], -0.2, 10.2, -0.05, 1.05, BLUE));
    assert_false(color_at(px, w, &fr, 2, 0.8, -0.2, 10.2, -0.05, 1.05, BLUE));   /* off the line: nothing */
    assert_true(color_bbox(px, w, h, BLUE, NULL, &blue));
    assert_true(blue.x0 > fr.x0 && blue.x1 < fr.x1 && blue.y0 > fr.y0 && blue.y1 < fr.y1);
    assert_int_equal(count_color(px, w, h, BLUE) - count_color_in(px, w, h, BLUE, &fr), 0);
    assert_true(blue.x1 - blue.x0 > 0.9 * (fr.x1 - fr.x0));   /* the data spans 96 % of the width */
    assert_true(color_bbox(px, w, h, LEGEND_EDGE, &fr, &legend));
    assert_true(legend.x1 < (fr.x0 + fr.x1) / 2 && legend.y1 < (fr.y0 + fr.y1) / 2);   /* top left */
    free(px);

    /* points top-left, top-right and bottom-right: the legend goes bottom-left */
    double cx[3] = {0, 1, 1}, cy[3] = {1, 1, 0};
    plot_series c = {"corner", cx, cy, 3, false};
    ASSERT_OK(plot_curves(p, NULL, NULL, NULL, &c, 1));
    px = decode_png(p, &w, &h);
    assert_int_equal(find_frames(px, w, h, &fr, 1), 1);
    assert_true(color_bbox(px, w, h, LEGEND_EDGE, &fr, &legend));
    assert_true(legend.x1 < (fr.x0 + fr.x1) / 2 && legend.y0 > (fr.y0 + fr.y1) / 2);
    free(px);

    /* 1000 points on a line: about 60 markers (squares, reaching 3 px off the line), the last kept */
    double lx[1000], ly[1000];
    for (int i = 0; i < 1000; i++) lx[i] = i, ly[i] = 0.5;
    plot_series sq[2] = {{NULL, lx, ly, 0, false}, {NULL, lx, ly, 1000, false}};   /* the second: orange */
    ASSERT_OK(plot_curves(p, NULL, NULL, NULL, sq, 2));
    px = decode_png(p, &w, &h);
    assert_int_equal(find_frames(px, w, h, &fr, 1), 1);
    int line_y = (int)lround(fr.y1 - 0.5 * (fr.y1 - fr.y0 - 1));   /* 0.5 in the middle of [0.45, 0.55] */
    pbox on = {fr.x0, line_y, fr.x1, line_y}, off = {fr.x0, line_y - 3, fr.x1, line_y - 3};
    assert_true(count_color_in(px, w, h, ORANGE, &on) > 0.9 * (fr.x1 - fr.x0));   /* the line */
    int marked = count_color_in(px, w, h, ORANGE, &off);
    assert_true(marked > 120 && marked < 0.8 * (fr.x1 - fr.x0));   /* markers, not one per point */
    assert_true(color_at(px, w, &fr, 999, 0.5 + 3 * 0.1 / (fr.y1 - fr.y0), -19.98, 1018.98, 0.45, 0.55, ORANGE));
    free(px);
}

/* Two panels, the top one on a log10 y axis: 800 x 1000, each series in its panel, 1, 10 and
   100 evenly spaced on the log axis (a non-positive point skipped, not ranging x). */
static void test_plot_figure(void **state) {
    (void)state;
    double lx[4] = {0, 1, 2, 3}, ly[4] = {1, 10, 100, -1};
    double ex[3] = {1, 2, 3}, tl[3] = {3, 2, 1}, vl[3] = {3.5, 2.5, 2};
    plot_series top = {"per step", lx, ly, 4, false};
    plot_series bottom[2] = {{"train", ex, tl, 3, false}, {"validation", ex, vl, 3, false}};
    plot_panel pn[2] = {{"per step", "step", "loss", &top, 1, true}, {"per epoch", "epoch", "loss", bottom, 2, false}};
    const char *p = tpath("figure.png");
    ASSERT_OK(plot_figure(p, "fp32 vs AMP", pn, 2));
    assert_int_equal(count_temp_files(), 0);
    unsigned w, h;
    unsigned char *px = decode_png(p, &w, &h);
    assert_int_equal(w, 800);
    assert_int_equal(h, 1000);
    pbox fr[3];
    assert_int_equal(find_frames(px, w, h, fr, 3), 2);
    assert_true(fr[0].y1 < 500 && fr[1].y0 > 500);
    assert_int_equal(fr[0].x0, fr[1].x0);   /* one left edge */
    assert_int_equal(count_color_in(px, w, h, ORANGE, &fr[1]), count_color(px, w, h, ORANGE));
    assert_true(count_color_in(px, w, h, ORANGE, &fr[1]) > 100);
    assert_true(count_color_in(px, w, h, BLUE, &fr[0]) > 100 && count_color_in(px, w, h, BLUE, &fr[1]) > 100);
    double xr0 = -0.04, xr1 = 2.04, yr0 = -0.1, yr1 = 2.1;   /* log10 units, padded */
    for (int i = 0; i < 3; i++) assert_true(color_at(px, w, &fr[0], lx[i], log10(ly[i]), xr0, xr1, yr0, yr1, BLUE));
    assert_false(color_at(px, w, &fr[0], 1, yr0 + 9.0 / 99 * (yr1 - yr0), xr0, xr1, yr0, yr1, BLUE));   /* a linear axis' 10 */
    assert_true(color_at(px, w, &fr[1], 3, 2, 1 - 0.04, 3 + 0.04, 1 - 0.125, 3.5 + 0.125, ORANGE));
    free(px);

    /* plot_curves is the one-panel figure: the same pixels */
    ASSERT_OK(plot_curves(tpath("a.png"), "per epoch", "epoch", "loss", bottom, 2));
    ASSERT_OK(plot_figure(tpath("b.png"), NULL, &pn[1], 1));
    size_t na, nb;
    unsigned char *a = read_all(tpath("a.png"), &na), *b = read_all(tpath("b.png"), &nb);
    assert_true(na == nb && memcmp(a, b, na) == 0);
    free(a);
    free(b);
}

static void test_plot_errors(void **state) {
    (void)state;
    double x[3] = {1, 2, 3};
    plot_series s = {"s", x, x, 3, false};
    plot_panel pn = {"t", "x", "y", &s, 1, false};
    /* unwritable: a missing folder, and a path that is a folder (the rename fails: the temporary goes) */
    char missing[300];
    snprintf(missing, sizeof missing, "%s/no/such/dir/plot.png", tmpdir);
    assert_int_equal(plot_curves(missing, "t", "x", "y", &s, 1), AMPC_ERR_IO);
    assert_non_null(strstr(ampc_last_error(), missing));
    assert_false(file_exists(missing));
    const char *dir = tpath("a_folder.png");
    assert_int_equal(mkdir(dir, 0700), 0);
    assert_int_equal(plot_figure(dir, NULL, &pn, 1), AMPC_ERR_IO);
    assert_non_null(strstr(ampc_last_error(), dir));
    assert_int_equal(count_temp_files(), 0);
    rmdir(dir);
    /* bad arguments: nothing written */
    const char *bad = tpath("bad.png");
    plot_series nodata = {"bad", NULL, NULL, 3, false}, negative = {"neg", x, x, -1, false};
    plot_panel panels[PLOT_MAX_PANELS + 1];
    for (int i = 0; i <= PLOT_MAX_PANELS; i++) panels[i] = pn;
    assert_int_equal(plot_curves(bad, "t", "x", "y", &nodata, 1), AMPC_ERR_INVALID);
    assert_int_equal(plot_curves(bad, "t", "x", "y", &negative, 1), AMPC_ERR_INVALID);
    assert_int_equal(plot_curves(bad, "t", "x", "y", &s, 0), AMPC_ERR_INVALID);
    assert_int_equal(plot_curves(bad, "t", "x", "y", NULL, 1), AMPC_ERR_INVALID);
    assert_int_equal(plot_curves(NULL, "t", "x", "y", &s, 1), AMPC_ERR_INVALID);
    assert_int_equal(plot_figure(bad, NULL, panels, 0), AMPC_ERR_INVALID);
    assert_int_equal(plot_figure(bad, NULL, NULL, 1), AMPC_ERR_INVALID);
    assert_int_equal(plot_figure(bad, NULL, panels, PLOT_MAX_PANELS + 1), AMPC_ERR_INVALID);
    panels[1].series = &nodata;
    assert_int_equal(plot_figure(bad, NULL, panels, 2), AMPC_ERR_INVALID);
    assert_false(file_exists(bad));
    panels[1].series = &s;
    ASSERT_OK(plot_figure(bad, NULL, panels, PLOT_MAX_PANELS));   /* the most panels: 800 x 6600 */
    unsigned w, h;
    free(decode_png(bad, &w, &h));
    assert_int_equal(h, 600 + 400 * (PLOT_MAX_PANELS - 1));
    /* values near DBL_MAX, and denormals: a PNG, no overflow into NaN pixels */
    double big[2] = {-1.7e308, 1.7e308}, tiny[2] = {5e-324, 1e-320};
    plot_series edge[2] = {{"big", big, big, 2, false}, {"tiny", tiny, tiny, 2, true}};
    ASSERT_OK(plot_curves(bad, "edges", "x", "y", edge, 1));   /* too wide to pad: markers on the frame, clipped */
    pbox fr;
    unsigned char *px = decode_png(bad, &w, &h);
    assert_int_equal(find_frames(px, w, h, &fr, 1), 1);
    assert_true(count_color_in(px, w, h, BLUE, &fr) > 100);
    assert_int_equal(count_color(px, w, h, BLUE), count_color_in(px, w, h, BLUE, &fr));
    free(px);
    ASSERT_OK(plot_curves(bad, "edges", "x", "y", edge + 1, 1));
    plot_panel logtiny = {"log", "x", "y", edge + 1, 1, true};
    ASSERT_OK(plot_figure(bad, NULL, &logtiny, 1));
    assert_int_equal(count_temp_files(), 0);
}

/* Figures drawn from several threads at once, two of them to one path: all complete. */
typedef struct { char path[256]; int rc; } plot_job;
static void *plot_thread(void *arg) {
    plot_job *j = arg;
    double x[200], y[200];
    for (int i = 0; i < 200; i++) x[i] = i, y[i] = sin(i * 0.1);
    plot_series s = {"sin", x, y, 200, false};
    plot_panel pn[2] = {{"a", "x", "y", &s, 1, false}, {"b", "x", "y", &s, 1, false}};
    j->rc = 0;
    for (int k = 0; k < 3 && j->rc == 0; k++) j->rc = plot_figure(j->path, "threads", pn, 2);
    return NULL;
}

static void test_plot_threads(void **state) {
    (void)state;
    enum { N = 4 };
    plot_job jobs[N];
    pthread_t th[N];
    for (int i = 0; i < N; i++) {
        snprintf(jobs[i].path, sizeof jobs[i].path, "%s/thread%d.png", tmpdir, i % 3);   /* 0 and 3 share */
        assert_int_equal(pthread_create(&th[i], NULL, plot_thread, &jobs[i]), 0);
    }
    for (int i = 0; i < N; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < N; i++) {
        assert_int_equal(jobs[i].rc, 0);
        unsigned w, h;
        free(decode_png(jobs[i].path, &w, &h));
        assert_int_equal(h, 1000);
    }
    assert_int_equal(count_temp_files(), 0);
}

int main(void) {
    if (getenv("AMPC_TEST_WRITE_V1")) {   /* how tests/fixtures/checkpoint_v1.safetensors was made */
        tu_group_setup(NULL);
        write_v1_checkpoint(getenv("AMPC_TEST_WRITE_V1"));
        return tu_group_teardown(NULL);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_sgd),
        cmocka_unit_test(test_roundtrip_adam),
        cmocka_unit_test(test_roundtrip_adamw),
        cmocka_unit_test(test_roundtrip_batchnorm),
        cmocka_unit_test(test_v1_checkpoint_loads),
        cmocka_unit_test(test_pytorch_reads_checkpoint),
        cmocka_unit_test(test_torchvision_reads_model),
        cmocka_unit_test(test_load_state_dict),
        cmocka_unit_test(test_load_state_dict_f64),
        cmocka_unit_test(test_load_state_dict_refused_file),
        cmocka_unit_test(test_truncated_under_reader),
        cmocka_unit_test(test_truncated_and_foreign_files),
        cmocka_unit_test(test_bad_headers),
        cmocka_unit_test(test_mismatched_checkpoints),
        cmocka_unit_test(test_fifo_and_device),
        cmocka_unit_test(test_large_headers),
        cmocka_unit_test(test_hostile_values), cmocka_unit_test(test_scaler_options_restored),
        cmocka_unit_test(test_compare),
        cmocka_unit_test(test_list),
        cmocka_unit_test(test_failed_save_keeps_previous),
        cmocka_unit_test(test_metrics_csv),
        cmocka_unit_test(test_plot_png),
        cmocka_unit_test(test_plot_geometry),
        cmocka_unit_test(test_plot_figure),
        cmocka_unit_test(test_plot_errors),
        cmocka_unit_test(test_plot_threads),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
