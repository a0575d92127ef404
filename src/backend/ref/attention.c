/*
 * attention.c - REF kernels of scaled-dot-product attention in f64, from the definition: each
 * query row's scores s = q k^T scale + mask, its softmax P (two passes: max, then sum), the
 * dropped probabilities Pd = P keep / (1 - p), o = Pd v; the backward as dV = Pd^T dO,
 * dP = (dO V^T) keep / (1 - p), dS = P (dP - rowsum(P dP)), dmask = dS, dQ = dS K scale,
 * dK = dS^T Q scale. The oracle of the CPU kernels (src/backend/cpu/attention.c), which take
 * another route; the keep decisions are the same draws (ampc__rng_uniform).
 */
#include "backend/ref/ref.h"

#include <math.h>
#include <string.h>

/* Row i of head b: p[j] for its keys (the rest 0); returns the log-sum-exp (-inf, and p all 0,
   when every key is hidden or masked by -inf) */
static double probs(const ampc_attn_desc *d, const double *q, const double *k, const double *mask, int64_t b, int64_t i,
                    double *p) {
    const int64_t nj = ampc__attn_keys(d, i);
    const double *m_row = mask ? mask + ampc__attn_mask_offset(d, b) + i * d->mask_si : NULL;
    double m = -INFINITY, sum = 0;
    for (int64_t j = 0; j < d->Tk; j++) {
        p[j] = 0;
        if (j >= nj) continue;
        double s = 0;
        for (int64_t e = 0; e < d->E; e++) s += q[(b * d->Tq + i) * d->E + e] * k[(b * d->Tk + j) * d->E + e];
        p[j] = s * d->scale + (m_row ? m_row[j * d->mask_sj] : 0.0);
        m = p[j] > m ? p[j] : m;
    }
    if (m == -INFINITY) {
        memset(p, 0, (size_t)d->Tk * sizeof *p);
        return -INFINITY;
    }
    for (int64_t j = 0; j < nj; j++) sum += exp(p[j] - m);
    for (int64_t j = 0; j < nj; j++) p[j] = exp(p[j] - m) / sum;
    return m + log(sum);
}

/* The dropout factor of element (b, i, j): 1 / (1 - p) kept, 0 dropped (1 without dropout) */
static double keep(const ampc_attn_desc *d, int64_t b, int64_t i, int64_t j) {
    if (d->dropout <= 0) return 1.0;
    bool kept = !(ampc__rng_uniform(d->rng, (uint64_t)((b * d->Tq + i) * d->Tk + j)) < d->dropout);
    return kept && d->dropout < 1 ? 1.0 / (1.0 - d->dropout) : 0.0;
}

static int ref_attention(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                         const ampc_tensor *mask, ampc_tensor *o, ampc_tensor *lse) {
    size_t block = 0;
    double *p = ampc__alloc(AMPC_DEVICE_REF, (size_t)(d->Tk + 1) * sizeof *p, AMPC_MEM_WORKSPACE, &block);
    if (!p) return ampc_last_status();
    int64_t ko, vo;
    ampc__attn_offsets(d, &ko, &vo);
    const double *qp = ampc__data(q), *kp = (const double *)ampc__data(k) + ko, *vp = (const double *)ampc__data(v) + vo;
    const double *mp = mask ? ampc__data(mask) : NULL;
    double *op = ampc__data(o), *L = lse ? ampc__data(lse) : NULL;
    for (int64_t b = 0; b < d->batch; b++)
        for (int64_t i = 0; i < d->Tq; i++) {
            double l = probs(d, qp, kp, mp, b, i, p);
            if (L) L[b * d->Tq + i] = l;
            for (int64_t j = 0; j < d->Tk; j++) p[j] *= keep(d, b, i, j);
            for (int64_t e = 0; e < d->Ev; e++) {
                double s = 0;
                for (int64_t j = 0; j < d->Tk; j++) s += p[j] * vp[(b * d->Tk + j) * d->Ev + e];
                op[(b * d->Tq + i) * d->Ev + e] = s;
            }
        }
    ampc__free(AMPC_DEVICE_REF, p, block, AMPC_MEM_WORKSPACE);
    return AMPC_OK;
}

static int ref_attention_backward(const ampc_attn_desc *d, const ampc_tensor *q, const ampc_tensor *k, const ampc_tensor *v,
                                  const ampc_tensor *mask, const ampc_tensor *lse, const ampc_tensor *dout, ampc_tensor *dq,
                                  ampc_tensor *dk, ampc_tensor *dv, ampc_tensor *dmask) {
    (void)lse;   /* recomputed from the definition */
    size_t block = 0;
    double *p = ampc__alloc(AMPC_DEVICE_REF, (size_t)(3 * d->Tk + 1) * sizeof *p, AMPC_MEM_WORKSPACE, &block);
    if (!p) return ampc_last_status();
    double *dp = p + d->Tk, *kf = dp + d->Tk;
    int64_t ko, vo;
    ampc__attn_offsets(d, &ko, &vo);
    const double *qp = ampc__data(q), *kp = (const double *)ampc__data(k) + ko, *vp = (const double *)ampc__data(v) + vo;
    const double *g = ampc__data(dout), *mp = mask ? ampc__data(mask) : NULL;
    double *gq = ampc__data(dq), *gk = (double *)ampc__data(dk) + ko, *gv = (double *)ampc__data(dv) + vo;
    double *gm = dmask ? ampc__data(dmask) : NULL;
    memset(gq, 0, (size_t)(d->batch * d->Tq * d->E) * sizeof(double));
    memset(gk, 0, (size_t)(d->batch * d->Tk * d->E) * sizeof(double));
    memset(gv, 0, (size_t)(d->batch * d->Tk * d->Ev) * sizeof(double));
    for (int64_t b = 0; b < d->batch; b++)
        for (int64_t i = 0; i < d->Tq; i++) {
            probs(d, qp, kp, mp, b, i, p);
            const double *gi = g + (b * d->Tq + i) * d->Ev;
            double rs = 0;
            for (int64_t j = 0; j < d->Tk; j++) {
                const double *vj = vp + (b * d->Tk + j) * d->Ev;
                kf[j] = keep(d, b, i, j);
                dp[j] = 0;
                for (int64_t e = 0; e < d->Ev; e++) {
                    dp[j] += gi[e] * vj[e];
                    gv[(b * d->Tk + j) * d->Ev + e] += p[j] * kf[j] * gi[e];
                }
                dp[j] *= kf[j];
                rs += p[j] * dp[j];
            }
            for (int64_t j = 0; j < d->Tk; j++) {
                double ds = p[j] * (dp[j] - rs);
                if (gm) gm[(b * d->Tq + i) * d->Tk + j] = ds;
                for (int64_t e = 0; e < d->E; e++) {
                    gq[(b * d->Tq + i) * d->E + e] += ds * d->scale * kp[(b * d->Tk + j) * d->E + e];
                    gk[(b * d->Tk + j) * d->E + e] += ds * d->scale * qp[(b * d->Tq + i) * d->E + e];
                }
            }
        }
    ampc__free(AMPC_DEVICE_REF, p, block, AMPC_MEM_WORKSPACE);
    return AMPC_OK;
}

void ampc__ref_register_attention(ampc_backend *be) {
    be->attention = ref_attention;
    be->attention_backward = ref_attention_backward;
}
