/*
 * clip.c - gradient clipping by total 2-norm (torch.nn.utils.clip_grad_norm_, PyTorch 1.13).
 *
 *   total     = sqrt(sum over every grad of sum(g^2))       (double, backend sum_squares)
 *   clip_coef = max_norm / (total + 1e-6)
 *   every grad *= clip_coef when clip_coef < 1 (or NaN)     (backend unary SCALE, in place)
 *
 * PyTorch multiplies by clamp(clip_coef, max=1), which is the identity when clip_coef >= 1
 * and propagates NaN: a NaN norm makes every grad NaN, an infinite one multiplies by 0. We skip
 * only the identity multiply. PyTorch reduces in the grads' dtype (fp32); we accumulate in
 * double, so the returned norm is at least as accurate. No grads: returns 0, like PyTorch.
 */
#include "backend/backend.h"
#include "optim/optim.h"

#include <math.h>

double ampc_clip_grad_norm(ampc_optimizer *opt, double max_norm) {
    int rc = ampc__optimizer_check(opt, "ampc_clip_grad_norm");
    if (rc < 0) return rc;
    double sumsq = 0.0;
    int n_grads = 0;
    for (int i = 0; i < opt->n; i++) {
        ampc_tensor *p = opt->params[i];
        if (!p || !p->grad) continue;
        double s;
        int rc = ampc__k_sum_squares(p->grad, &s);
        if (rc < 0) return rc;
        sumsq += s;
        n_grads++;
    }
    if (!n_grads) return 0.0;
    double total = sqrt(sumsq);
    double clip_coef = max_norm / (total + 1e-6);
    if (!(clip_coef >= 1.0)) {
        for (int i = 0; i < opt->n; i++) {
            ampc_tensor *p = opt->params[i];
            if (!p || !p->grad) continue;
            int rc = ampc__k_unary_into(AMPC_OP_MUL_SCALAR, p->grad, p->grad, clip_coef);
            if (rc < 0) return rc;
        }
    }
    return total;
}
