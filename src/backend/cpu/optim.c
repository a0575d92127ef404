/*
 * optim.c - CPU optimizer kernels: one fused pass over fp32 master weights, their fp32 grads
 * and fp32 state (PyTorch 1.13 torch/optim/{sgd,adam,adamw}.py, single-tensor path,
 * where each tensor op rounds to fp32 once; we do the same ops in the same order per element).
 *
 * Per-tensor scalars (bias corrections, step size) are computed once in double and rounded to
 * fp32, as PyTorch computes them in Python floats. Each update is one pass over its streams
 * (memory-bound: SGD with momentum moves 5 floats per element), compiled per combination of
 * options so the loop is branch-free (always_inline with constant flags), with AVX-512/AVX2
 * clones (cpu.h). One call updates many parameters in one OpenMP region: their blocks of BLK
 * elements are numbered one after another and split over the threads statically (one wake-up
 * of the thread team per step instead of one per parameter, which costs 0.1-0.3 ms each on
 * this VM's vCPUs with OMP_WAIT_POLICY=passive; small tensors share the work). The
 * 16-bit copy (cast_out) is converted block by block right after each block's update, while
 * the block is still in cache: the pass reads the streams once and writes 2 bytes more per
 * element, where a cast of its own would read the parameter again.
 */
#include "backend/cpu/cpu.h"

#include <math.h>
#include <string.h>

#define BLK 16384   /* elements per call of an update loop (threads take whole blocks) */
#define GROUP 64    /* parameters per parallel region (the per-call tables live on the stack) */


/* The converter for the optional 16-bit copy of the parameter (NULL: none): the dtype's own,
   the one every cast from f32 goes through. */
typedef void (*narrow_fn)(const float *, void *, size_t);

// ---------------------------------------------------------------------------------------------
// Many parameters in one region

typedef struct job job;
typedef void (*block_fn)(const job *j, size_t base, size_t len);


/* One parameter's update, resolved: streams, the loop for its option set, its constants. */
struct job {
    block_fn run;
    float *param, *state[3];
    float *grad;      /* written back unscaled by the scaled variants */
    void *out;        /* the 16-bit copy, converted by narrow; NULL: none */
    narrow_fn narrow;
    size_t n;
    int variant;
    ampc_sgd_consts sgd;
    ampc_adam_consts adam;
};

/* Runs the jobs' blocks in one parallel region. */
static void run_jobs(const job *jobs, int nj) {
    size_t n[GROUP], first[GROUP + 1];
    for (int j = 0; j < nj; j++) n[j] = jobs[j].n;
    size_t elems = ampc__cpu_blocks_plan(n, nj, BLK, first), nblk = first[nj];
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)elems)) schedule(static)
    for (size_t b = 0; b < nblk; b++) {
        size_t base, len;
        const job *j = &jobs[ampc__cpu_block_at(first, nj, b, BLK, n, &base, &len)];
        j->run(j, base, len);
        if (j->narrow) j->narrow(j->param + base, (uint16_t *)j->out + base, len);
    }
}

/* The item's streams (the door checked the item). */
static void job_init(job *j, const ampc_optim_item *it) {
    memset(j, 0, sizeof *j);
    j->narrow = it->cast_out ? ampc__dt(it->cast_out->dtype)->from_f32 : NULL;
    j->param = (float *)ampc__data(it->param) + it->begin;
    j->grad = (float *)ampc__data(it->grad) + it->begin;
    j->out = j->narrow ? ampc__data(it->cast_out) : NULL;   /* the whole parameter only */
    j->n = (size_t)ampc__item_count(it);
}

/* The items as jobs, run GROUP at a time (the door checked every item before any is written). */
static int run_items(const ampc_optim_item *items, int n, void (*make)(job *, const ampc_optim_item *, const void *),
                     const void *h) {
    job jobs[GROUP];
    for (int at = 0; at < n; at += GROUP) {
        int nj = n - at < GROUP ? n - at : GROUP;
        for (int j = 0; j < nj; j++) make(&jobs[j], &items[at + j], h);
        run_jobs(jobs, nj);
    }
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// SGD
//   d_p = g + wd * p                         (if wd != 0)
//   buf = d_p (first step) | m * buf + (1 - dampening) * d_p
//   d_p = d_p + m * buf (nesterov) | buf     (if m != 0)
//   p  -= lr * d_p



/* The SGD update of n elements, one pass; has_wd, has_m, first and nesterov are constants in
   every caller, so each gets a branch-free loop. */
AMPC_CPU_INLINE void sgd_body(float *restrict p, float *restrict g, float *restrict buf, size_t n, ampc_sgd_consts c,
                              bool has_wd, bool has_m, bool first, bool nesterov, bool scaled) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        float pi = p[i], d = g[i];
        if (scaled) g[i] = d = d * c.gs;   /* the unscaled gradient, written back as read */
        if (has_wd) d = d + c.wd * pi;
        if (has_m) {
            float b = first ? d : c.m * buf[i] + c.keep * d;
            buf[i] = b;
            d = nesterov ? d + c.m * b : b;
        }
        p[i] = pi + c.neg_lr * d;
    }
}

/* One clone set per option combination: bits 0 wd, 1 momentum, 2 first step, 3 nesterov
   (the last two only with momentum), 4 scaled gradient (the fused GradScaler unscale). */
#define SGD_FN(k)                                                                                  \
    AMPC_CPU_VEC static void sgd_##k(float *p, float *g, float *buf, size_t n, ampc_sgd_consts c) {       \
        sgd_body(p, g, buf, n, c, (k) & 1, (k) & 2, (k) & 4, (k) & 8, (k) & 16);                    \
    }
SGD_FN(0) SGD_FN(1) SGD_FN(2) SGD_FN(3) SGD_FN(6) SGD_FN(7) SGD_FN(10) SGD_FN(11) SGD_FN(14) SGD_FN(15)
SGD_FN(16) SGD_FN(17) SGD_FN(18) SGD_FN(19) SGD_FN(22) SGD_FN(23) SGD_FN(26) SGD_FN(27) SGD_FN(30) SGD_FN(31)
#undef SGD_FN

typedef void (*sgd_fn)(float *, float *, float *, size_t, ampc_sgd_consts);
static const sgd_fn sgd_fns[32] = {[0] = sgd_0,   [1] = sgd_1,   [2] = sgd_2,   [3] = sgd_3,   [6] = sgd_6,
                                   [7] = sgd_7,   [10] = sgd_10, [11] = sgd_11, [14] = sgd_14, [15] = sgd_15,
                                   [16] = sgd_16, [17] = sgd_17, [18] = sgd_18, [19] = sgd_19, [22] = sgd_22,
                                   [23] = sgd_23, [26] = sgd_26, [27] = sgd_27, [30] = sgd_30, [31] = sgd_31};

static void sgd_block(const job *j, size_t base, size_t len) {
    sgd_fns[j->variant](j->param + base, j->grad + base, j->state[0] ? j->state[0] + base : NULL, len, j->sgd);
}

static void sgd_job(job *j, const ampc_optim_item *it, const void *hp) {
    const ampc_sgd_hparams *h = hp;
    job_init(j, it);
    bool has_m = h->momentum != 0;
    j->run = sgd_block;
    j->state[0] = has_m ? ampc__data(it->state[0]) : NULL;
    j->sgd = ampc__sgd_consts(h);
    j->variant = (h->weight_decay != 0) | has_m << 1 | (has_m && it->first) << 2 | (has_m && h->nesterov) << 3 |
                 (h->grad_scale != 0) << 4;
}

static int cpu_sgd_step(const ampc_optim_item *items, int n, const ampc_sgd_hparams *h) {
    return run_items(items, n, sgd_job, h);
}

// ---------------------------------------------------------------------------------------------
// Adam / AdamW, step t >= 1
//   AdamW: p *= 1 - lr * wd              Adam: g = g + wd * p   (if wd != 0)
//   m = b1 * m + (1 - b1) * g
//   v = b2 * v + (1 - b2) * g * g
//   vmax = max(vmax, v)                  (amsgrad; the denominator uses vmax instead of v)
//   denom = sqrt(v) / sqrt(1 - b2^t) + eps
//   p -= lr / (1 - b1^t) * m / denom


/* The Adam update of n elements, one pass (vmax only with amsgrad, a constant in each caller) */
AMPC_CPU_INLINE void adam_body(float *restrict p, float *restrict g, float *restrict m, float *restrict v,
                               float *restrict vmax, size_t n, const ampc_adam_consts *c, bool amsgrad, bool scaled) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        float pi = p[i] * c->decay, gu = g[i];
        if (scaled) g[i] = gu = gu * c->gs;   /* the unscaled gradient, written back as read */
        float gi = gu + c->l2 * pi;
        float mi = c->b1 * m[i] + c->omb1 * gi;
        float vi = c->b2 * v[i] + c->omb2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        if (amsgrad) {
            float old = vmax[i];
            vi = old > vi ? old : vi;   /* NaN in v propagates, as torch.maximum */
            vmax[i] = vi;
        }
        float denom = sqrtf(vi) / c->bc2_sqrt + c->eps;
        p[i] = pi + c->neg_step_size * mi / denom;   /* addcdiv: (value * t1) / t2 */
    }
}
#define ADAM_FN(name, ams, scaled)                                                                \
    AMPC_CPU_VEC static void name(float *p, float *g, float *m, float *v, float *vmax, size_t n,       \
                                  const ampc_adam_consts *c) {                                          \
        adam_body(p, g, m, v, vmax, n, c, ams, scaled);                                            \
    }
ADAM_FN(adam_plain, false, false) ADAM_FN(adam_amsgrad, true, false)
ADAM_FN(adam_plain_scaled, false, true) ADAM_FN(adam_amsgrad_scaled, true, true)
#undef ADAM_FN

typedef void (*adam_fn)(float *, float *, float *, float *, float *, size_t, const ampc_adam_consts *);
static const adam_fn adam_fns[4] = {adam_plain, adam_amsgrad, adam_plain_scaled, adam_amsgrad_scaled};

static void adam_block(const job *j, size_t base, size_t len) {
    adam_fns[j->variant](j->param + base, j->grad + base, j->state[0] + base, j->state[1] + base,
                         j->state[2] ? j->state[2] + base : NULL, len, &j->adam);
}

static void adam_job(job *j, const ampc_optim_item *it, const void *hp) {
    const ampc_adam_hparams *h = hp;
    job_init(j, it);
    j->adam = ampc__adam_consts(h, it->step);
    j->run = adam_block;
    for (int k = 0; k < 3; k++) j->state[k] = it->state[k] && (k < 2 || h->amsgrad) ? ampc__data(it->state[k]) : NULL;
    j->variant = h->amsgrad | (h->grad_scale != 0) << 1;
}

static int cpu_adam_step(const ampc_optim_item *items, int n, const ampc_adam_hparams *h) {
    return run_items(items, n, adam_job, h);
}

void ampc__cpu_register_optim(ampc_backend *be) {
    be->sgd_step = cpu_sgd_step;
    be->adam_step = cpu_adam_step;
}
