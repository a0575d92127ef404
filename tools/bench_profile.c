/*
 * bench_profile.c - `ampc-bench --profile`: where a training step's time goes, per kernel.
 *
 * Every op reaches its kernels through the CPU backend's table of function pointers
 * (backend.h), and no CPU kernel calls another through the table, so wrapping each entry
 * with a timer measures every kernel exactly once. The table is a static, writable object in
 * src/backend/backend.c; ampc__backend() hands it out as const only to keep ops from changing it, so the
 * bench may patch it (a tool's privilege, never done by the library itself). Install only
 * between steps: the wrappers are swapped in while no kernel runs.
 *
 * Entries are keyed by kernel, sub-op (unary/binary kind, conv pass) and dtype; gemm and
 * convolution entries also by shape, and count their FLOPs (2 x MACs), so the print-out
 * shows the achieved GFLOP/s of each matmul/convolution shape and which oneDNN
 * implementation runs it. Timer overhead: two clock_gettime per kernel call (~50 ns).
 */
#include "bench_common.h"

#include "backend/backend.h"
#include "backend/cpu/cpu.h"

#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Accumulators

enum { MAX_ENTRIES = 512 };

typedef struct {
    const char *kernel;   /* table entry name ("conv2d_backward_weights") */
    int sub;              /* unary/binary op, or -1 */
    ampc_dtype dt;
    bool has_shape;       /* gemm/conv: keyed by shape too */
    ampc_gemm_desc g;     /* gemm shape (kernel "gemm") */
    ampc_conv_desc c;     /* conv shape */
    bool has_bias;
    int64_t calls;
    double seconds, flops;
} entry;

static entry entries[MAX_ENTRIES];
static int n_entries;
static ampc_backend saved;   /* the original table */
static bool installed;

static bool gemm_eq(const ampc_gemm_desc *a, const ampc_gemm_desc *b) {
    return a->batch == b->batch && a->M == b->M && a->N == b->N && a->K == b->K && a->ta == b->ta && a->tb == b->tb &&
           a->stride_a == b->stride_a && a->stride_b == b->stride_b && a->stride_c == b->stride_c;
}

static bool conv_eq(const ampc_conv_desc *a, const ampc_conv_desc *b) {
    bool same = a->N == b->N && a->C == b->C && a->H == b->H && a->W == b->W && a->O == b->O && a->KH == b->KH &&
                a->KW == b->KW && a->OH == b->OH && a->OW == b->OW && a->groups == b->groups;
    for (int i = 0; i < 2; i++)
        same = same && a->stride[i] == b->stride[i] && a->padding[i] == b->padding[i] && a->dilation[i] == b->dilation[i];
    return same;
}

static void account(const char *kernel, int sub, ampc_dtype dt, const ampc_gemm_desc *g, const ampc_conv_desc *c,
                    bool has_bias, double seconds, double flops) {
    entry *e = NULL;
    for (int i = 0; i < n_entries && !e; i++) {
        entry *x = &entries[i];
        if (!strcmp(x->kernel, kernel) && x->sub == sub && x->dt == dt && x->has_bias == has_bias && (!g || gemm_eq(&x->g, g)) &&
            (!c || conv_eq(&x->c, c)))
            e = x;
    }
    if (!e) {
        if (n_entries == MAX_ENTRIES) return;   /* more shapes than we keep: not counted */
        e = &entries[n_entries++];
        memset(e, 0, sizeof *e);
        e->kernel = kernel;
        e->sub = sub;
        e->dt = dt;
        e->has_bias = has_bias;
        e->has_shape = g || c;
        if (g) e->g = *g;
        if (c) e->c = *c;
    }
    e->calls++;
    e->seconds += seconds;
    e->flops += flops;
}

#define TIMED(kernel, sub, dt, g, c, has_bias, flops, call)                                    \
    do {                                                                                       \
        double t0_ = bench_now();                                                              \
        int rc_ = (call);                                                                      \
        account(kernel, sub, dt, g, c, has_bias, bench_now() - t0_, flops);                    \
        return rc_;                                                                            \
    } while (0)

static double conv_flops(const ampc_conv_desc *d) {
    int g = d->groups > 0 ? d->groups : 1;
    return 2.0 * (double)d->N * (double)d->O * (double)d->OH * (double)d->OW * (double)(d->C / g) * (double)d->KH *
           (double)d->KW;
}

// ---------------------------------------------------------------------------------------------
// Wrappers: one per table entry that a training step uses

static int w_copy(const ampc_tensor *s, ampc_tensor *d) { TIMED("copy/cast", -1, d->dtype, NULL, NULL, false, 0, saved.device.copy(s, d)); }
static int w_fill(ampc_tensor *t, double v) { TIMED("fill", -1, t->dtype, NULL, NULL, false, 0, saved.device.fill(t, v)); }
static int w_unary(ampc_op op, const ampc_tensor *x, ampc_tensor *y, double a) {
    TIMED("unary", op, x->dtype, NULL, NULL, false, 0, saved.unary(op, x, y, a));
}
static int w_unary_backward(ampc_op op, const ampc_tensor *x, const ampc_tensor *y, const ampc_tensor *gy,
                            ampc_tensor *gx, double a) {
    TIMED("unary_backward", op, gy->dtype, NULL, NULL, false, 0, saved.unary_backward(op, x, y, gy, gx, a));
}
static int w_binary(ampc_op op, const ampc_tensor *a, const ampc_tensor *b, ampc_tensor *out) {
    TIMED("binary", op, out->dtype, NULL, NULL, false, 0, saved.binary(op, a, b, out));
}
static int w_sum_to(const ampc_tensor *x, ampc_tensor *out, double a) {
    TIMED("sum_to", -1, x->dtype, NULL, NULL, false, 0, saved.sum_to(x, out, a));
}
static int w_expand(const ampc_tensor *x, ampc_tensor *out, double a) {
    TIMED("expand", -1, out->dtype, NULL, NULL, false, 0, saved.expand(x, out, a));
}
static int w_softmax(const ampc_tensor *x, ampc_tensor *y, ampc_axis_desc ax, bool log) {
    TIMED("softmax", log, x->dtype, NULL, NULL, false, 0, saved.softmax(x, y, ax, log));
}
static int w_softmax_backward(const ampc_tensor *y, const ampc_tensor *gy, ampc_tensor *gx, ampc_axis_desc ax, bool log) {
    TIMED("softmax_backward", log, gy->dtype, NULL, NULL, false, 0, saved.softmax_backward(y, gy, gx, ax, log));
}
static int w_gemm(const ampc_gemm_desc *d, const ampc_tensor *a, const ampc_tensor *b, const ampc_tensor *bias,
                  ampc_tensor *c) {
    double fl = 2.0 * (double)d->batch * (double)d->M * (double)d->N * (double)d->K;
    /* keyed by the operands' dtype; sub 1: a 16-bit product into an f32 output */
    TIMED("gemm", c->dtype != a->dtype, a->dtype, d, NULL, bias != NULL, fl, saved.gemm(d, a, b, bias, c));
}
static int w_cross_entropy(const ampc_tensor *l, const ampc_tensor *t, const ampc_cross_entropy_options *o,
                           ampc_tensor *out, double *w) {
    TIMED("cross_entropy", -1, l->dtype, NULL, NULL, false, 0, saved.cross_entropy(l, t, o, out, w));
}
static int w_cross_entropy_backward(const ampc_tensor *l, const ampc_tensor *t, const ampc_tensor *gy,
                                    const ampc_cross_entropy_options *o, double w, ampc_tensor *gx) {
    TIMED("cross_entropy_backward", -1, l->dtype, NULL, NULL, false, 0, saved.cross_entropy_backward(l, t, gy, o, w, gx));
}
static int w_dropout(const ampc_tensor *x, ampc_tensor *y, uint8_t *mask, double p, ampc_rng_state rng) {
    TIMED("dropout", -1, x->dtype, NULL, NULL, false, 0, saved.dropout(x, y, mask, p, rng));
}
static int w_dropout_backward(const ampc_tensor *gy, const uint8_t *mask, double p, ampc_tensor *gx) {
    TIMED("dropout_backward", -1, gy->dtype, NULL, NULL, false, 0, saved.dropout_backward(gy, mask, p, gx));
}
static int w_unscale_check(ampc_tensor **g, int n, float inv, float *found) {
    TIMED("unscale_check", -1, AMPC_F32, NULL, NULL, false, 0, saved.unscale_check(g, n, inv, found));
}
static int w_sgd_step(const ampc_optim_item *items, int n, const ampc_sgd_hparams *h) {
    TIMED("sgd_step", -1, AMPC_F32, NULL, NULL, false, 0, saved.sgd_step(items, n, h));
}
static int w_adam_step(const ampc_optim_item *items, int n, const ampc_adam_hparams *h) {
    TIMED("adam_step", -1, AMPC_F32, NULL, NULL, false, 0, saved.adam_step(items, n, h));
}
static int w_conv2d(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *w, const ampc_tensor *b,
                    ampc_tensor *y) {
    TIMED("conv2d", 0, x->dtype, NULL, d, b != NULL, conv_flops(d), saved.conv2d(d, x, w, b, y));
}
static int w_conv2d_backward_data(const ampc_conv_desc *d, const ampc_tensor *gy, const ampc_tensor *w, ampc_tensor *gx) {
    TIMED("conv2d", 1, gy->dtype, NULL, d, false, conv_flops(d), saved.conv2d_backward_data(d, gy, w, gx));
}
static int w_conv2d_backward_weights(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *gy,
                                     ampc_tensor *gw, ampc_tensor *gb) {
    TIMED("conv2d", 2, x->dtype, NULL, d, gb != NULL, conv_flops(d), saved.conv2d_backward_weights(d, x, gy, gw, gb));
}
static int w_pool2d(const ampc_pool_desc *d, const ampc_tensor *x, ampc_tensor *y, void *ws) {
    TIMED("pool2d", d->kind, x->dtype, NULL, NULL, false, 0, saved.pool2d(d, x, y, ws));
}
static int w_pool2d_backward(const ampc_pool_desc *d, const ampc_tensor *gy, ampc_tensor *gx, const void *ws) {
    TIMED("pool2d_backward", d->kind, gy->dtype, NULL, NULL, false, 0, saved.pool2d_backward(d, gy, gx, ws));
}
static int w_batch_norm(const ampc_tensor *x, const ampc_tensor *w, const ampc_tensor *b, ampc_tensor *rm,
                        ampc_tensor *rv, ampc_tensor *y, ampc_tensor *sm, ampc_tensor *si, bool tr, double mom, double eps,
                        bool sync) {
    TIMED("batch_norm", -1, x->dtype, NULL, NULL, false, 0, saved.batch_norm(x, w, b, rm, rv, y, sm, si, tr, mom, eps, sync));
}
static int w_batch_norm_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *w, const ampc_tensor *sm,
                                 const ampc_tensor *si, bool tr, bool sync, ampc_tensor *gx, ampc_tensor *gw,
                                 ampc_tensor *gb) {
    TIMED("batch_norm_backward", -1, x->dtype, NULL, NULL, false, 0,
          saved.batch_norm_backward(x, gy, w, sm, si, tr, sync, gx, gw, gb));
}
static int w_batch_norm_relu(const ampc_tensor *x, const ampc_tensor *w, const ampc_tensor *b, ampc_tensor *rm,
                             ampc_tensor *rv, ampc_tensor *y, ampc_tensor *st, bool tr, double mom, double eps,
                             bool sync) {
    TIMED("batch_norm_relu", -1, x->dtype, NULL, NULL, false, 0, saved.batch_norm_relu(x, w, b, rm, rv, y, st, tr, mom, eps, sync));
}
static int w_batch_norm_relu_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *w,
                                      const ampc_tensor *st, bool tr, bool sync, ampc_tensor *gx, ampc_tensor *gw,
                                      ampc_tensor *gb) {
    TIMED("batch_norm_relu_backward", -1, x->dtype, NULL, NULL, false, 0,
          saved.batch_norm_relu_backward(x, gy, w, st, tr, sync, gx, gw, gb));
}

static int w_layer_norm(const ampc_tensor *x, const ampc_tensor *w, const ampc_tensor *b, ampc_tensor *y, ampc_tensor *m,
                        ampc_tensor *r, double eps) {
    TIMED("layer_norm", -1, x->dtype, NULL, NULL, false, 0, saved.layer_norm(x, w, b, y, m, r, eps));
}
static int w_layer_norm_backward(const ampc_tensor *x, const ampc_tensor *gy, const ampc_tensor *w, const ampc_tensor *m,
                                 const ampc_tensor *r, ampc_tensor *gx, ampc_tensor *gw, ampc_tensor *gb) {
    TIMED("layer_norm_backward", -1, x->dtype, NULL, NULL, false, 0, saved.layer_norm_backward(x, gy, w, m, r, gx, gw, gb));
}
/* attention's multiply-adds: q k^T and p v over every (query, key) pair (the causal half not discounted) */
static double attn_flops(const ampc_attn_desc *d) { return 2.0 * (double)d->batch * (double)d->Tq * (double)d->Tk * (double)(d->E + d->Ev); }
static int w_attention(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                       const ampc_tensor *mask, ampc_tensor *o, ampc_tensor *lse) {
    TIMED("attention", -1, q->dtype, NULL, NULL, false, attn_flops(d), saved.attention(d, q, k, v, mask, o, lse));
}
static int w_attention_backward(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                                const ampc_tensor *mask, const ampc_tensor *lse, const ampc_tensor *dout, ampc_tensor *dq,
                                ampc_tensor *dk, ampc_tensor *dv, ampc_tensor *dmask) {
    TIMED("attention_backward", -1, q->dtype, NULL, NULL, false, 2.0 * attn_flops(d),
          saved.attention_backward(d, q, k, v, mask, lse, dout, dq, dk, dv, dmask));
}
static int w_permute(const ampc_tensor *x, const int *perm, ampc_tensor *y) {
    TIMED("permute", -1, x->dtype, NULL, NULL, false, 0, saved.permute(x, perm, y));
}
static int w_embedding(const ampc_tensor *w, const ampc_tensor *idx, ampc_tensor *y) {
    TIMED("embedding", -1, w->dtype, NULL, NULL, false, 0, saved.embedding(w, idx, y));
}
static int w_embedding_backward(const ampc_tensor *gy, const ampc_tensor *idx, ampc_tensor *gw) {
    TIMED("embedding_backward", -1, gy->dtype, NULL, NULL, false, 0, saved.embedding_backward(gy, idx, gw));
}
static int w_copy_block(const ampc_tensor *src, int64_t so, int64_t sl, ampc_tensor *dst, int64_t d_off, int64_t dl, int64_t rows,
                        int64_t cols, double scale) {
    TIMED("copy_block", -1, src->dtype, NULL, NULL, false, 0, saved.copy_block(src, so, sl, dst, d_off, dl, rows, cols, scale));
}

// ---------------------------------------------------------------------------------------------
// Install / uninstall

static ampc_backend *table(void) {
    /* the table is a writable static in src/backend/backend.c (see the file comment) */
    return (ampc_backend *)ampc__backend(AMPC_DEVICE_CPU);
}

void bench_profile_install(void) {
    if (installed) return;
    ampc_backend *be = table();
    saved = *be;
    /* wrap only entries the backend has: a NULL entry must stay NULL (unsupported) */
#define WRAP(field, fn) if (be->field) be->field = fn
    WRAP(device.copy, w_copy);
    WRAP(device.fill, w_fill);
    WRAP(unary, w_unary);
    WRAP(unary_backward, w_unary_backward);
    WRAP(binary, w_binary);
    WRAP(sum_to, w_sum_to);
    WRAP(expand, w_expand);
    WRAP(softmax, w_softmax);
    WRAP(softmax_backward, w_softmax_backward);
    WRAP(gemm, w_gemm);
    WRAP(cross_entropy, w_cross_entropy);
    WRAP(cross_entropy_backward, w_cross_entropy_backward);
    WRAP(dropout, w_dropout);
    WRAP(dropout_backward, w_dropout_backward);
    WRAP(unscale_check, w_unscale_check);
    WRAP(sgd_step, w_sgd_step);
    WRAP(adam_step, w_adam_step);
    WRAP(conv2d, w_conv2d);
    WRAP(conv2d_backward_data, w_conv2d_backward_data);
    WRAP(conv2d_backward_weights, w_conv2d_backward_weights);
    WRAP(pool2d, w_pool2d);
    WRAP(pool2d_backward, w_pool2d_backward);
    WRAP(batch_norm, w_batch_norm);
    WRAP(batch_norm_backward, w_batch_norm_backward);
    WRAP(batch_norm_relu, w_batch_norm_relu);
    WRAP(batch_norm_relu_backward, w_batch_norm_relu_backward);
    WRAP(layer_norm, w_layer_norm);
    WRAP(layer_norm_backward, w_layer_norm_backward);
    WRAP(attention, w_attention);
    WRAP(attention_backward, w_attention_backward);
    WRAP(permute, w_permute);
    WRAP(embedding, w_embedding);
    WRAP(embedding_backward, w_embedding_backward);
    WRAP(copy_block, w_copy_block);
#undef WRAP
    installed = true;
}

void bench_profile_uninstall(void) {
    if (!installed) return;
    *table() = saved;
    installed = false;
}

void bench_profile_reset(void) { n_entries = 0; }

double bench_profile_flops(void) {
    double f = 0;
    for (int i = 0; i < n_entries; i++) f += entries[i].flops;
    return f;
}

// ---------------------------------------------------------------------------------------------
// Print-out

static const char *pass_names[] = {"fwd", "bwd_data", "bwd_weights"};
static const char *pool_names[] = {[AMPC_POOL_MAX] = "max", [AMPC_POOL_AVG_INCLUDE_PAD] = "avg",
                                   [AMPC_POOL_AVG_EXCLUDE_PAD] = "avg_excl", [AMPC_POOL_ADAPTIVE_AVG] = "adaptive_avg"};

/* "unary(relu)", "conv2d(bwd_data)", "pool2d(max)", "log_softmax" ... */
static void entry_name(const entry *e, char *buf, size_t n) {
    const char *sub = NULL;
    if ((!strncmp(e->kernel, "unary", 5) || !strcmp(e->kernel, "binary")) && e->sub >= 0)
        sub = ampc_op_name((ampc_op)e->sub);   /* the op table's names */
    else if (!strcmp(e->kernel, "conv2d") && e->sub >= 0 && e->sub < 3) sub = pass_names[e->sub];
    else if (!strncmp(e->kernel, "pool2d", 6) && e->sub >= 0 && e->sub < 4) sub = pool_names[e->sub];
    else if (!strncmp(e->kernel, "softmax", 7) && e->sub == 1) sub = "log";
    else if (!strcmp(e->kernel, "gemm") && e->sub == 1) sub = "f32 out";
    if (sub) snprintf(buf, n, "%s(%s)", e->kernel, sub);
    else snprintf(buf, n, "%s", e->kernel);
}

static void shape_name(const entry *e, char *buf, size_t n) {
    if (!strcmp(e->kernel, "gemm"))
        snprintf(buf, n, "%s%lldx%lldx%lld%s%s%s", e->g.batch > 1 ? "batched " : "", (long long)e->g.M, (long long)e->g.N,
                 (long long)e->g.K, e->g.ta ? " ta" : "", e->g.tb ? " tb" : "", e->has_bias ? " +bias" : "");
    else {
        const ampc_conv_desc *c = &e->c;
        snprintf(buf, n, "%lldx%lld s%d %lld->%lld %lldx%lld", (long long)c->KH, (long long)c->KW, c->stride[0],
                 (long long)c->C, (long long)c->O, (long long)c->H, (long long)c->W);
    }
}

typedef struct {
    char name[64];
    ampc_dtype dt;
    int64_t calls;
    double seconds, flops;
} row;

static int by_time(const void *a, const void *b) {
    double x = ((const row *)a)->seconds, y = ((const row *)b)->seconds;
    return (x < y) - (x > y);
}
static int entries_by_time(const void *a, const void *b) {
    double x = (*(const entry *const *)a)->seconds, y = (*(const entry *const *)b)->seconds;
    return (x < y) - (x > y);
}

void bench_profile_print(FILE *f, int steps, double step_seconds) {
    if (steps < 1) steps = 1;
    /* families: entries merged over shapes */
    static row rows[MAX_ENTRIES];
    int nr = 0;
    double kernel_total = 0;
    for (int i = 0; i < n_entries; i++) {
        char name[64];
        entry_name(&entries[i], name, sizeof name);
        int j = 0;
        while (j < nr && (strcmp(rows[j].name, name) || rows[j].dt != entries[i].dt)) j++;
        if (j == nr) {
            memset(&rows[nr], 0, sizeof rows[nr]);
            snprintf(rows[nr].name, sizeof rows[nr].name, "%s", name);
            rows[nr++].dt = entries[i].dt;
        }
        rows[j].calls += entries[i].calls;
        rows[j].seconds += entries[i].seconds;
        rows[j].flops += entries[i].flops;
        kernel_total += entries[i].seconds;
    }
    qsort(rows, (size_t)nr, sizeof *rows, by_time);
    const double per = 1e3 / steps, step_ms = step_seconds * per;
    fprintf(f, "    %-30s %-5s %7s %10s %6s %9s\n", "kernel", "dtype", "calls", "ms/step", "%step", "GFLOP/s");
    for (int j = 0; j < nr; j++) {
        fprintf(f, "    %-30s %-5s %7lld %10.2f %5.1f%%", rows[j].name, ampc_dtype_name(rows[j].dt),
                (long long)(rows[j].calls / steps), rows[j].seconds * per, 100 * rows[j].seconds / step_seconds);
        if (rows[j].flops > 0) fprintf(f, " %9.1f", rows[j].flops / rows[j].seconds * 1e-9);
        fputc('\n', f);
    }
    fprintf(f, "    %-30s %-5s %7s %10.2f %5.1f%%\n", "(outside kernels)", "", "", step_ms - kernel_total * per,
            100 * (step_seconds - kernel_total) / step_seconds);
    fprintf(f, "    %-30s %-5s %7s %10.2f\n", "(step)", "", "", step_ms);

    /* the costliest gemm/conv shapes, with the oneDNN implementation behind each */
    static const entry *shaped[MAX_ENTRIES];
    int ns = 0;
    for (int i = 0; i < n_entries; i++)
        if (entries[i].has_shape) shaped[ns++] = &entries[i];
    qsort(shaped, (size_t)ns, sizeof *shaped, entries_by_time);
    if (ns) fprintf(f, "    top gemm/conv shapes (M x N x K; conv k s C->O HxW in):\n");
    for (int i = 0; i < ns && i < 12; i++) {
        const entry *e = shaped[i];
        char name[64], shape[96], impl[96] = "?";
        entry_name(e, name, sizeof name);
        shape_name(e, shape, sizeof shape);
        ampc_dtype dt = e->dt == AMPC_F16 ? AMPC_F32 : e->dt;   /* f16 runs widened to f32 */
        int rc = e->c.N ? ampc__cpu_conv_impl(&e->c, dt, e->sub, e->has_bias, impl, sizeof impl)
                        : ampc__cpu_gemm_impl(&e->g, dt, e->has_bias, impl, sizeof impl);
        if (rc < 0) snprintf(impl, sizeof impl, "?");
        fprintf(f, "    %-22s %-5s %-34s %7.2f ms/step %7.1f GFLOP/s  %s\n", name, ampc_dtype_name(e->dt), shape,
                e->seconds * per, e->flops / e->seconds * 1e-9, impl);
    }
}
