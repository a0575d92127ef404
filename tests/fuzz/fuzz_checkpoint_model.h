/*
 * fuzz_checkpoint_model.h - the small model, optimizer and scaler that fuzz_checkpoint loads
 * into and tests/fuzz/make_corpus.c saves from (so the seeds are valid checkpoints for it).
 */
#ifndef AMPC_FUZZ_CHECKPOINT_MODEL_H
#define AMPC_FUZZ_CHECKPOINT_MODEL_H

#include "ampc.h"

typedef struct {
    ampc_module *m;
    ampc_optimizer *opt;
    ampc_scaler *s;
} fuzz_model;

static inline void fuzz_model_free(fuzz_model *f) {
    ampc_optimizer_free(f->opt);
    ampc_scaler_free(f->s);
    ampc_module_free(f->m);
    *f = (fuzz_model){0};
}

/* Sequential(Linear(4,3), ReLU, Linear(3,2), BatchNorm2d(2)), Adam with amsgrad, scaler on. */
static inline int fuzz_model_new(fuzz_model *f) {
    *f = (fuzz_model){0};
    f->m = ampc_sequential(4, ampc_linear_new(4, 3, true), ampc_relu_new(), ampc_linear_new(3, 2, true),
                           ampc_batchnorm2d_new(2));
    ampc_adam_options a = ampc_adam_defaults();
    a.amsgrad = true;
    if (f->m) f->opt = ampc_adam_new(f->m, &a);
    f->s = ampc_scaler_new(NULL);
    if (!f->m || !f->opt || !f->s) {
        fuzz_model_free(f);
        return -1;
    }
    return 0;
}

#endif /* AMPC_FUZZ_CHECKPOINT_MODEL_H */
