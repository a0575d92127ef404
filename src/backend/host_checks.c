/*
 * host_checks.c - what the backends share on the host side: for the backends whose memory the
 * CPU reads, the data-dependent validation that must look at tensor contents (cross-entropy's
 * targets); broadcast strides; the optimizers' constants. Argument checks are the door's
 * (dispatch.c).
 */
#include "backend/backend.h"

#include <math.h>

ampc_sgd_consts ampc__sgd_consts(const ampc_sgd_hparams *h) {
    return (ampc_sgd_consts){(float)h->weight_decay, (float)h->momentum, (float)(1.0 - h->dampening), (float)-h->lr,
                             h->grad_scale};
}

ampc_adam_consts ampc__adam_consts(const ampc_adam_hparams *h, int64_t step) {
    double bc1 = 1.0 - pow(h->beta1, (double)step), bc2 = 1.0 - pow(h->beta2, (double)step);
    return (ampc_adam_consts){
        .decay = h->decoupled ? (float)(1.0 - h->lr * h->weight_decay) : 1.0f,
        .l2 = h->decoupled ? 0.0f : (float)h->weight_decay,
        .b1 = (float)h->beta1, .omb1 = (float)(1.0 - h->beta1),
        .b2 = (float)h->beta2, .omb2 = (float)(1.0 - h->beta2),
        .eps = (float)h->eps, .bc2_sqrt = (float)sqrt(bc2), .neg_step_size = (float)(-h->lr / bc1),
        .gs = h->grad_scale,
    };
}

int ampc__host_indices(const ampc_tensor *idx, int64_t n, const char *who) {
    const int64_t *v = ampc__data(idx);
    for (int64_t i = 0; i < idx->numel; i++)
        if (v[i] < 0 || v[i] >= n)
            return ampc__err(AMPC_ERR_INVALID, "%s: index %lld at position %lld is out of range [0, %lld)", who, (long long)v[i],
                             (long long)i, (long long)n);
    return AMPC_OK;
}

int ampc__host_ce_targets(const ampc_tensor *logits, const ampc_tensor *targets, const ampc_cross_entropy_options *o,
                          int64_t *count) {
    int64_t N = logits->shape[0], C = logits->shape[1], k = 0;
    const int64_t *tg = ampc__data(targets);
    for (int64_t i = 0; i < N; i++) {
        if (tg[i] == o->ignore_index) continue;
        if (tg[i] < 0 || tg[i] >= C)
            return ampc__err(AMPC_ERR_INVALID, "cross_entropy: target %lld in row %lld is out of range [0, %lld)",
                             (long long)tg[i], (long long)i, (long long)C);
        k++;
    }
    *count = k;
    return AMPC_OK;
}

void ampc__broadcast_strides(const ampc_tensor *t, int nd, int64_t *st) {
    int64_t s = 1;
    for (int i = nd - 1; i >= 0; i--) {
        int j = t->ndim - nd + i;
        int64_t d = j >= 0 ? t->shape[j] : 1;
        st[i] = d == 1 ? 0 : s;
        s *= d;
    }
}
