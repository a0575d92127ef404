/*
 * optim.c - the CUDA table's optimizer steps (SGD, Adam, AdamW), the GradScaler's
 * unscale-and-check and the sum of squares (gradient clipping), checked here and run by
 * optim.cu over many tensors per launch. Per-tensor constants are computed in double and
 * rounded to f32 once, by the function the CPU uses too (backend/optim_consts.h), so both
 * devices give the same bits.
 */
#include "backend/cuda/cuda.h"
#include "backend/cuda/optim_kernels.h"

#include <string.h>

/* The item's streams (the door checked the item). */
static void job_init(ampc_cu_optim_job *j, const ampc_optim_item *it) {
    memset(j, 0, sizeof *j);
    if (it->cast_out) {
        j->out = ampc__data(it->cast_out);
        j->out_dtype = it->cast_out->dtype;
    }
    j->param = (float *)ampc__data(it->param) + it->begin;
    j->grad = (float *)ampc__data(it->grad) + it->begin;
    j->n = ampc__item_count(it);
}

static void sgd_job(ampc_cu_optim_job *j, const ampc_optim_item *it, const void *hp) {
    const ampc_sgd_hparams *h = hp;
    job_init(j, it);
    bool has_m = h->momentum != 0;
    j->state[0] = has_m ? ampc__data(it->state[0]) : NULL;
    j->c.sgd = ampc__sgd_consts(h);
    j->variant = (h->weight_decay != 0) | has_m << 1 | (has_m && it->first) << 2 | (has_m && h->nesterov) << 3 |
                 (h->grad_scale != 0) << 4;
}

static void adam_job(ampc_cu_optim_job *j, const ampc_optim_item *it, const void *hp) {
    const ampc_adam_hparams *h = hp;
    job_init(j, it);
    j->c.adam = ampc__adam_consts(h, it->step);
    j->variant = h->amsgrad | (h->grad_scale != 0) << 1;
    for (int k = 0; k < 3; k++) j->state[k] = it->state[k] && (k < 2 || h->amsgrad) ? ampc__data(it->state[k]) : NULL;
}

/* The items launched AMPC_CU_OPTIM_GROUP at a time (the door checked every item before any is
   written). */
static int run_items(const ampc_optim_item *items, int n, void (*make)(ampc_cu_optim_job *, const ampc_optim_item *, const void *),
                     const void *h, cudaError_t (*launch)(const ampc_cu_optim_jobs *, cudaStream_t)) {
    int rc = ampc__cu_ready();
    if (rc < 0) return rc;
    static _Thread_local ampc_cu_optim_jobs jobs;   /* 11 KiB: off the stack */
    for (int at = 0; at < n; at += AMPC_CU_OPTIM_GROUP) {
        jobs.n = n - at < AMPC_CU_OPTIM_GROUP ? n - at : AMPC_CU_OPTIM_GROUP;
        for (int j = 0; j < jobs.n; j++) make(&jobs.job[j], &items[at + j], h);
        if ((rc = ampc__cu_check(launch(&jobs, ampc__cu_stream()), "optimizer step")) < 0) return rc;
    }
    return AMPC_OK;
}

static int cu_sgd_step(const ampc_optim_item *items, int n, const ampc_sgd_hparams *h) {
    return run_items(items, n, sgd_job, h, ampc_cu_sgd);
}

static int cu_adam_step(const ampc_optim_item *items, int n, const ampc_adam_hparams *h) {
    return run_items(items, n, adam_job, h, ampc_cu_adam);
}

/* One launch per AMPC_CU_OPTIM_GROUP gradients into one device flag, read back once: the
   caller needs found_inf on the host to decide whether the optimizer steps (PyTorch's
   GradScaler.step reads it back the same way, found_inf.item()). */
static int cu_unscale_check(ampc_tensor **grads, int n, float inv_scale, float *found_inf) {
    int rc = ampc__cu_ready();
    if (rc < 0) return rc;
    static _Thread_local ampc_cu_unscale_jobs jobs;
    size_t fb;
    int *flag = ampc__cu_scratch(sizeof(int), &fb);
    if (!flag) return ampc_last_status();
    rc = ampc__cu_check(cudaMemsetAsync(flag, 0, sizeof(int), ampc__cu_stream()), "unscale");
    for (int at = 0; at < n && rc >= 0; at += AMPC_CU_OPTIM_GROUP) {
        jobs.n = 0;
        for (int k = at; k < n && k < at + AMPC_CU_OPTIM_GROUP; k++) {
            if (!grads[k] || grads[k]->numel == 0) continue;
            jobs.ptr[jobs.n] = ampc__data(grads[k]);
            jobs.dtype[jobs.n] = grads[k]->dtype;
            jobs.numel[jobs.n++] = grads[k]->numel;
        }
        rc = ampc__cu_check(ampc_cu_unscale(&jobs, inv_scale, inv_scale != 1.0f, flag, ampc__cu_stream()), "unscale");
    }
    int found = 0;
    if (rc >= 0) rc = ampc__cu_check(cudaMemcpyAsync(&found, flag, sizeof found, cudaMemcpyDeviceToHost, ampc__cu_stream()), "unscale");
    if (rc >= 0) rc = ampc__cu_check(cudaStreamSynchronize(ampc__cu_stream()), "unscale");
    ampc__cu_scratch_free(flag, fb);
    if (rc >= 0 && found) *found_inf = 1.0f;   /* never cleared here, as on the CPU */
    return rc;
}

#define SUMSQ_BLOCKS 264   /* two per multiprocessor of an H100 */

static int cu_sum_squares(const ampc_tensor *t, double *out) {
    int rc = ampc__cu_ready();
    if (rc < 0) return rc;
    if (t->numel == 0) {
        *out = 0;
        return AMPC_OK;
    }
    size_t pb;
    double *part = ampc__cu_scratch(SUMSQ_BLOCKS * sizeof(double), &pb), host[SUMSQ_BLOCKS];
    if (!part) return ampc_last_status();
    rc = ampc__cu_check(ampc_cu_sum_squares(ampc__data(t), t->dtype, t->numel, part, SUMSQ_BLOCKS, ampc__cu_stream()), "sum_squares");
    if (rc >= 0) rc = ampc__cu_check(cudaMemcpyAsync(host, part, sizeof host, cudaMemcpyDeviceToHost, ampc__cu_stream()), "sum_squares");
    if (rc >= 0) rc = ampc__cu_check(cudaStreamSynchronize(ampc__cu_stream()), "sum_squares");
    ampc__cu_scratch_free(part, pb);
    if (rc < 0) return rc;
    double s = 0;
    for (int b = 0; b < SUMSQ_BLOCKS; b++) s += host[b];   /* fixed order: the same sum every run */
    *out = s;
    return AMPC_OK;
}

void ampc__cuda_register_optim(ampc_backend *be) {
    be->sgd_step = cu_sgd_step;
    be->adam_step = cu_adam_step;
    be->unscale_check = cu_unscale_check;
    be->sum_squares = cu_sum_squares;
}
