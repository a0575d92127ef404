/*
 * attention.c - CPU kernels of scaled-dot-product attention, row by row with an online softmax
 * (flash attention's scheme, unblocked): the forward keeps per query row only its running max,
 * sum and output accumulator, and saves the row's log-sum-exp; the backward recomputes each
 * probability from it. Every head's q, k, v (and o, do) are staged to f32 once; heads run in
 * parallel, each head's sums in one order whatever the thread count.
 */
#include "backend/cpu/cpu.h"

#include <math.h>
#include <omp.h>
#include <string.h>

static float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy(float a, const float *x, float *y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* Rows [r0, r0 + n) of t (rows of `width` elements) as f32 into dst. */
static void stage(const ampc_tensor *t, int64_t r0, int64_t n, int64_t width, float *dst) {
    const ampc_dtype_traits *tr = ampc__dt(t->dtype);
    tr->to_f32((const char *)ampc__data(t) + (size_t)(r0 * width) * tr->size, dst, (size_t)(n * width));
}
static void unstage(ampc_tensor *t, int64_t r0, int64_t n, int64_t width, const float *src) {
    const ampc_dtype_traits *tr = ampc__dt(t->dtype);
    tr->from_f32(src, (char *)ampc__data(t) + (size_t)(r0 * width) * tr->size, (size_t)(n * width));
}

/* Keys query i sees: [0, last_key(i)) */
static int64_t keys_of(const ampc_attn_desc *d, int64_t i) { return d->causal ? (i + 1 < d->Tk ? i + 1 : d->Tk) : d->Tk; }

static int cpu_attention(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                         ampc_tensor *o, ampc_tensor *lse) {
    const int64_t Tq = d->Tq, Tk = d->Tk, E = d->E, Ev = d->Ev;
    if (d->batch == 0 || Tq == 0) return AMPC_OK;
    const float scale = (float)d->scale;
    int nt = ampc__threads_for(d->batch * Tq * Tk * (E + Ev));
    if (nt > d->batch) nt = (int)d->batch;
    const size_t per = (size_t)(Tq * E + Tk * E + Tk * Ev + Tq * Ev);
    size_t block = 0;
    float *ws = ampc__alloc(AMPC_DEVICE_CPU, (size_t)nt * per * sizeof(float), AMPC_MEM_WORKSPACE, &block);
    if (!ws) return ampc_last_status();
    float *L = lse ? ampc__data(lse) : NULL;
#pragma omp parallel num_threads(nt)
    {
        float *qs = ws + (size_t)omp_get_thread_num() * per, *ks = qs + Tq * E, *vs = ks + Tk * E, *os = vs + Tk * Ev;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < d->batch; b++) {
            stage(q, b * Tq, Tq, E, qs);
            stage(k, b * Tk, Tk, E, ks);
            stage(v, b * Tk, Tk, Ev, vs);
            for (int64_t i = 0; i < Tq; i++) {
                float m = -INFINITY, l = 0.0f, *acc = os + i * Ev;
                memset(acc, 0, (size_t)Ev * sizeof(float));
                for (int64_t j = 0, nj = keys_of(d, i); j < nj; j++) {
                    float s = dot(qs + i * E, ks + j * E, E) * scale;
                    if (s > m) {   /* a new maximum: what was summed is rescaled to it */
                        float c = expf(m - s);
                        l = l * c + 1.0f;
#pragma omp simd
                        for (int64_t e = 0; e < Ev; e++) acc[e] = acc[e] * c + vs[j * Ev + e];
                        m = s;
                    } else {
                        float p = expf(s - m);
                        l += p;
                        axpy(p, vs + j * Ev, acc, Ev);
                    }
                }
                float inv = l > 0.0f ? 1.0f / l : 0.0f;
                for (int64_t e = 0; e < Ev; e++) acc[e] *= inv;
                if (L) L[b * Tq + i] = l > 0.0f ? m + logf(l) : -INFINITY;
            }
            unstage(o, b * Tq, Tq, Ev, os);
        }
    }
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return AMPC_OK;
}

/* dv_j += p do_i; ds = p (do_i . v_j - do_i . o_i); dq_i += ds scale k_j; dk_j += ds scale q_i */
static int cpu_attention_backward(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                                  const ampc_tensor *o, const ampc_tensor *lse, const ampc_tensor *dout, ampc_tensor *dq,
                                  ampc_tensor *dk, ampc_tensor *dv) {
    const int64_t Tq = d->Tq, Tk = d->Tk, E = d->E, Ev = d->Ev;
    if (d->batch == 0) return AMPC_OK;
    const float scale = (float)d->scale;
    int nt = ampc__threads_for(d->batch * Tq * Tk * (E + Ev));
    if (nt > d->batch) nt = (int)d->batch;
    /* per thread: q, k, v, o, do staged, then the gradients dq, dk, dv */
    const size_t per = (size_t)(2 * Tq * E + 2 * Tk * E + 2 * Tk * Ev + 2 * Tq * Ev);
    size_t block = 0;
    float *ws = ampc__alloc(AMPC_DEVICE_CPU, (size_t)nt * per * sizeof(float), AMPC_MEM_WORKSPACE, &block);
    if (!ws) return ampc_last_status();
    const float *L = ampc__data(lse);
#pragma omp parallel num_threads(nt)
    {
        float *qs = ws + (size_t)omp_get_thread_num() * per, *ks = qs + Tq * E, *vs = ks + Tk * E, *os = vs + Tk * Ev;
        float *gs = os + Tq * Ev, *gq = gs + Tq * Ev, *gk = gq + Tq * E, *gv = gk + Tk * E;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < d->batch; b++) {
            stage(q, b * Tq, Tq, E, qs);
            stage(k, b * Tk, Tk, E, ks);
            stage(v, b * Tk, Tk, Ev, vs);
            stage(o, b * Tq, Tq, Ev, os);
            stage(dout, b * Tq, Tq, Ev, gs);
            memset(gq, 0, (size_t)(Tq * E + Tk * E + Tk * Ev) * sizeof(float));
            for (int64_t i = 0; i < Tq; i++) {
                const float *qi = qs + i * E, *gi = gs + i * Ev, li = L[b * Tq + i];
                float Di = dot(gi, os + i * Ev, Ev);
                for (int64_t j = 0, nj = keys_of(d, i); j < nj; j++) {
                    float p = expf(dot(qi, ks + j * E, E) * scale - li);
                    axpy(p, gi, gv + j * Ev, Ev);
                    float ds = p * (dot(gi, vs + j * Ev, Ev) - Di) * scale;
                    axpy(ds, ks + j * E, gq + i * E, E);
                    axpy(ds, qi, gk + j * E, E);
                }
            }
            unstage(dq, b * Tq, Tq, E, gq);
            unstage(dk, b * Tk, Tk, E, gk);
            unstage(dv, b * Tk, Tk, Ev, gv);
        }
    }
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return AMPC_OK;
}

void ampc__cpu_register_attention(ampc_backend *be) {
    be->attention = cpu_attention;
    be->attention_backward = cpu_attention_backward;
}
