/*
 * optimizer.c - SGD, Adam and AdamW over fp32 master weights (PyTorch 1.13 semantics).
 *
 * The update rules are those of torch/optim/{sgd,adam,adamw}.py (single-tensor path); one
 * fused backend call (sgd_step / adam_step) updates all parameters of a device that have a
 * grad, so the arithmetic lives in src/backend/{cpu,ref}/optim.c. Here: options, parameter
 * bookkeeping, lazy state. Every parameter is checked before any is written.
 *
 * State (momentum buffers, exp_avg, exp_avg_sq, max_exp_avg_sq) has the parameter's dtype
 * (fp32; f64 on the REF device), is allocated at a parameter's first step under
 * AMPC_MEM_OPTIMIZER, and is owned by the optimizer. Parameters whose grad is NULL (frozen,
 * unused, or zero_grad'ed) are skipped and their state is left alone, like PyTorch.
 * The optimizer holds a reference to each parameter, so freeing the module first frees no
 * memory the optimizer uses; the step then refuses (the parameters' module is checked alive).
 * A parameter's kept autocast copy (ampc_autocast_keep_weight_casts) is rewritten by the
 * update kernel in the same pass, so the next autocast region finds it current.
 */
#include "autograd/autograd.h"
#include "backend/backend.h"
#include "nn/nn.h"
#include "optim/optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *kind_name(ampc_optim_kind k) {
    return k == AMPC_OPTIM_SGD ? "SGD" : k == AMPC_OPTIM_ADAM ? "Adam" : "AdamW";
}

// ---------------------------------------------------------------------------------------------
// Options

ampc_sgd_options ampc_sgd_defaults(void) { return (ampc_sgd_options){.lr = 1e-3}; }

ampc_adam_options ampc_adam_defaults(void) {
    return (ampc_adam_options){.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0};
}

ampc_adam_options ampc_adamw_defaults(void) {
    ampc_adam_options o = ampc_adam_defaults();
    o.weight_decay = 1e-2;
    return o;
}

/* The checks of PyTorch's constructors (same messages, roughly). */
static int check_sgd(const ampc_sgd_options *o) {
    if (!(o->lr >= 0)) return ampc__err(AMPC_ERR_INVALID, "SGD: invalid learning rate: %g", o->lr);
    if (!(o->momentum >= 0)) return ampc__err(AMPC_ERR_INVALID, "SGD: invalid momentum value: %g", o->momentum);
    if (!(o->weight_decay >= 0)) return ampc__err(AMPC_ERR_INVALID, "SGD: invalid weight_decay value: %g", o->weight_decay);
    if (!isfinite(o->dampening)) return ampc__err(AMPC_ERR_INVALID, "SGD: invalid dampening value: %g", o->dampening);
    if (o->nesterov && (o->momentum <= 0 || o->dampening != 0))
        return ampc__err(AMPC_ERR_INVALID, "SGD: nesterov momentum requires a momentum and zero dampening");
    return AMPC_OK;
}

static int check_adam(const ampc_adam_options *o, const char *name) {
    if (!(o->lr >= 0)) return ampc__err(AMPC_ERR_INVALID, "%s: invalid learning rate: %g", name, o->lr);
    if (!(o->eps >= 0)) return ampc__err(AMPC_ERR_INVALID, "%s: invalid epsilon value: %g", name, o->eps);
    if (!(o->beta1 >= 0 && o->beta1 < 1)) return ampc__err(AMPC_ERR_INVALID, "%s: invalid beta parameter at index 0: %g", name, o->beta1);
    if (!(o->beta2 >= 0 && o->beta2 < 1)) return ampc__err(AMPC_ERR_INVALID, "%s: invalid beta parameter at index 1: %g", name, o->beta2);
    if (!(o->weight_decay >= 0)) return ampc__err(AMPC_ERR_INVALID, "%s: invalid weight_decay value: %g", name, o->weight_decay);
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Construction

/* Master weights: fp32, or f64 on a device that holds no fp32 (REF, the oracle). */
static int check_param(const ampc_tensor *p, ampc_optim_kind kind, int i) {
    if (!p) return ampc__err(AMPC_ERR_INVALID, "%s: parameter %d is NULL", kind_name(kind), i);
    bool master = p->dtype == AMPC_F32 || (p->dtype == AMPC_F64 && ampc__device_float(p->device) == AMPC_F64);
    if (!master)
        return ampc__err(AMPC_ERR_DTYPE, "%s: parameter %d is %s; optimizers update fp32 master weights", kind_name(kind), i,
                         ampc_dtype_name(p->dtype));
    if (p->grad_fn)
        return ampc__err(AMPC_ERR_INVALID, "%s: parameter %d is not a leaf (it comes from %s)", kind_name(kind), i,
                         p->grad_fn->name);
    return AMPC_OK;
}

/* A handle pool: a stale handle stays readable and never names a new optimizer. */
static ampc_handle_pool optimizer_pool = {.obj_size = sizeof(ampc_optimizer)};

static int check_live(const ampc_optimizer *opt, const char *call) {
    return ampc__check_handle(opt, opt ? opt->gen : 0, call, "optimizer", "freed");
}

int ampc__optimizer_check(const ampc_optimizer *opt, const char *call) {
    int rc = check_live(opt, call);
    if (rc < 0) return rc;
    for (int i = 0; i < opt->n; i++)
        if (!ampc__owner_alive(opt->params[i]))
            return ampc__err(AMPC_ERR_STATE, "%s: parameter %d belongs to a module that was freed or replaced; free the "
                             "optimizer first, or build a new one over the live module", call, i);
    return AMPC_OK;
}

static ampc_optimizer *optimizer_new(ampc_optim_kind kind, ampc_tensor **params, int n) {
    ampc__ensure_init();
    if (n < 0 || (n > 0 && !params)) return ampc__err_null(AMPC_ERR_INVALID, "%s over %d parameters", kind_name(kind), n);
    for (int i = 0; i < n; i++)
        if (check_param(params[i], kind, i) < 0) return NULL;
    ampc_optimizer *o = ampc__handle_pool_get(&optimizer_pool);
    size_t cnt = (size_t)(n ? n : 1);
    if (o) {
        o->gen = ampc__new_gen();
        o->params = calloc(cnt, sizeof *o->params);
        for (int s = 0; s < 3; s++) o->state[s] = calloc(cnt, sizeof *o->state[s]);
        o->steps = calloc(cnt, sizeof *o->steps);
        o->items = calloc(cnt, sizeof *o->items);
        o->item_param = calloc(cnt, sizeof *o->item_param);
        o->weight_decay = malloc(cnt * sizeof *o->weight_decay);
    }
    if (!o || !o->params || !o->state[0] || !o->state[1] || !o->state[2] || !o->steps || !o->items || !o->item_param ||
        !o->weight_decay) {
        ampc_optimizer_free(o);
        return ampc__err_null(AMPC_ERR_OOM, "%s over %d parameters", kind_name(kind), n);
    }
    o->kind = kind;
    o->n = n;
    o->flat = o->bounds = NULL;
    o->shard_rank = 0;
    o->shard_world = 1;
    for (int i = 0; i < n; i++) {
        o->params[i] = ampc__retain(params[i]);
        o->weight_decay[i] = -1;   /* the options' */
    }
    return o;
}

ampc_optimizer *ampc_sgd_new_params(ampc_tensor **params, int n, const ampc_sgd_options *opts) {
    ampc_sgd_options o = opts ? *opts : ampc_sgd_defaults();
    if (check_sgd(&o) < 0) return NULL;
    ampc_optimizer *opt = optimizer_new(AMPC_OPTIM_SGD, params, n);
    if (opt) opt->sgd = o;
    return opt;
}

static ampc_optimizer *adam_new(ampc_optim_kind kind, ampc_tensor **params, int n, const ampc_adam_options *opts) {
    ampc_adam_options o = opts ? *opts : kind == AMPC_OPTIM_ADAMW ? ampc_adamw_defaults() : ampc_adam_defaults();
    if (check_adam(&o, kind_name(kind)) < 0) return NULL;
    ampc_optimizer *opt = optimizer_new(kind, params, n);
    if (opt) opt->adam = o;
    return opt;
}

ampc_optimizer *ampc_adam_new_params(ampc_tensor **params, int n, const ampc_adam_options *opts) {
    return adam_new(AMPC_OPTIM_ADAM, params, n, opts);
}

ampc_optimizer *ampc_adamw_new_params(ampc_tensor **params, int n, const ampc_adam_options *opts) {
    return adam_new(AMPC_OPTIM_ADAMW, params, n, opts);
}

/* Every parameter of m, frozen ones included: whether one trains is decided at each step by
   whether it has a grad (PyTorch's optimizer(model.parameters()) behaves the same). */
static int module_params(ampc_module *m, ampc_tensor ***p) {
    if (!m) return ampc__err(AMPC_ERR_INVALID, "optimizer over a NULL module");
    return ampc_module_parameters(m, p, NULL);
}

ampc_optimizer *ampc_sgd_new(ampc_module *m, const ampc_sgd_options *opts) {
    ampc_tensor **p;
    int n = module_params(m, &p);
    return n < 0 ? NULL : ampc_sgd_new_params(p, n, opts);
}

ampc_optimizer *ampc_adam_new(ampc_module *m, const ampc_adam_options *opts) {
    ampc_tensor **p;
    int n = module_params(m, &p);
    return n < 0 ? NULL : ampc_adam_new_params(p, n, opts);
}

ampc_optimizer *ampc_adamw_new(ampc_module *m, const ampc_adam_options *opts) {
    ampc_tensor **p;
    int n = module_params(m, &p);
    return n < 0 ? NULL : ampc_adamw_new_params(p, n, opts);
}

int ampc_optimizer_set_weight_decay(ampc_optimizer *opt, int i, double weight_decay) {
    int rc = check_live(opt, "ampc_optimizer_set_weight_decay");
    if (rc < 0) return rc;
    if (i < 0 || i >= opt->n)
        return ampc__err(AMPC_ERR_INVALID, "ampc_optimizer_set_weight_decay: parameter %d of %d", i, opt->n);
    if (!(weight_decay >= 0)) return ampc__err(AMPC_ERR_INVALID, "%s: invalid weight_decay value: %g", kind_name(opt->kind), weight_decay);
    opt->weight_decay[i] = weight_decay;
    return AMPC_OK;
}

/* mark[i] for the optimizer's parameters found in m's tree: 1 the weight of a Linear or Conv2d, -1
   the weight of an Embedding (wins: a weight tied to an embedding is an embedding). */
static void mark_weights(const ampc_module *m, const ampc_optimizer *opt, signed char *mark) {
    const ampc_tensor *w = ampc__module_param(m, "weight");
    const char *type = m->vt->type;
    const int v = !strcmp(type, "Linear") || !strcmp(type, "Conv2d") ? 1 : !strcmp(type, "Embedding") ? -1 : 0;
    for (int i = 0; w && v && i < opt->n; i++)
        if (opt->params[i] == w && mark[i] != -1) mark[i] = (signed char)v;
    for (int c = 0; c < m->children.n; c++) mark_weights(m->children.items[c], opt, mark);
}

int ampc_optimizer_decay_only_weights(ampc_optimizer *opt, ampc_module *m) {
    int rc = check_live(opt, "ampc_optimizer_decay_only_weights");
    if (rc < 0) return rc;
    ampc_tensor **p;
    int n = m ? ampc_module_parameters(m, &p, NULL) : ampc__err(AMPC_ERR_INVALID, "ampc_optimizer_decay_only_weights: NULL module");
    if (n < 0) return n;
    for (int i = 0; i < opt->n; i++) {
        bool found = false;
        for (int j = 0; j < n && !found; j++) found = p[j] == opt->params[i];
        if (!found)
            return ampc__err(AMPC_ERR_INVALID, "ampc_optimizer_decay_only_weights: the optimizer's parameter %d is not one of this %s's", i,
                             m->vt->type);
    }
    signed char *mark = calloc((size_t)(opt->n ? opt->n : 1), 1);
    if (!mark) return ampc__err(AMPC_ERR_OOM, "ampc_optimizer_decay_only_weights");
    mark_weights(m, opt, mark);
    for (int i = 0; i < opt->n; i++)
        if (mark[i] != 1) opt->weight_decay[i] = 0;
    free(mark);
    return AMPC_OK;
}

void ampc_optimizer_free(ampc_optimizer *opt) {
    if (!opt || check_live(opt, "ampc_optimizer_free") < 0) return;
    for (int i = 0; i < opt->n; i++) {
        for (int s = 0; s < 3; s++)
            if (opt->state[s]) ampc__release(opt->state[s][i]);
        if (opt->params) ampc__release(opt->params[i]);
    }
    for (int s = 0; s < 3; s++) free(opt->state[s]);
    free(opt->params);
    free(opt->steps);
    free(opt->items);
    free(opt->item_param);
    free(opt->weight_decay);
    opt->weight_decay = NULL;
    free(opt->flat);
    free(opt->bounds);
    opt->flat = opt->bounds = NULL;
    opt->gen = 0;
    ampc__handle_pool_put(&optimizer_pool, opt);
}

// ---------------------------------------------------------------------------------------------
// Step

void ampc__optimizer_part(const ampc_optimizer *opt, int i, int r, int64_t *lo, int64_t *count) {
    const int64_t f0 = opt->flat ? opt->flat[i] : 0, f1 = opt->flat ? opt->flat[i + 1] : 0;
    if (f0 == f1) {   /* unsharded, or not partitioned: whole everywhere */
        *lo = 0;
        *count = opt->params[i]->numel;
        return;
    }
    const int64_t a = f0 > opt->bounds[r] ? f0 : opt->bounds[r], b = f1 < opt->bounds[r + 1] ? f1 : opt->bounds[r + 1];
    *lo = a - f0;
    *count = b > a ? b - a : 0;
}

/* State slot s of parameter i, allocated zero-filled on first use (optimizer memory): the
   parameter's shape, or a 1-D tensor of this rank's part under ZeRO. */
ampc_tensor *ampc__optimizer_state(ampc_optimizer *opt, int s, int i) {
    if (opt->state[s][i]) return opt->state[s][i];
    ampc_tensor *p = opt->params[i];
    int64_t lo, count;
    ampc__optimizer_part(opt, i, opt->shard_rank, &lo, &count);
    ampc_mem_kind prev = ampc__mem_kind_push(AMPC_MEM_OPTIMIZER);
    ampc_tensor *t = count == p->numel ? ampc__tensor_like(p, p->dtype) : ampc__tensor_new(p->dtype, p->device, 1, &count);
    ampc__mem_kind_pop(prev);
    if (!t) return NULL;
    if (ampc__device(t->device)->fill(t, 0.0) < 0) {
        ampc__release(t);
        return NULL;
    }
    opt->state[s][i] = t;
    return t;
}

/* The parameter's kept autocast copy when this step can rewrite it in its own pass: it still
   matches the data and nothing else holds it (a graph that saved it keeps the values it saw).
   Any other kept copy is dropped; autocast makes a new one when it next casts the parameter. */
static ampc_tensor *copy_to_refresh(ampc_tensor *p) {
    ampc__shadow_lock();
    ampc_tensor *c = p->shadow;
    bool ok = c && ampc__shadows_on() && p->shadow_version == ampc__version(p) &&
              atomic_load(&c->refcount) == 1 && atomic_load(&c->storage->refcount) == 1;
    if (c && !ok) p->shadow = NULL;
    ampc__shadow_unlock();
    if (ok) return c;
    ampc__release(c);
    return NULL;
}

/* After the kernel wrote p (and, when it succeeded, its copy c). */
static void mark_stepped(ampc_tensor *p, ampc_tensor *c, int rc) {
    ampc__mark_written(p);
    if (!c || rc < 0) return;
    ampc__shadow_lock();
    if (p->shadow == c) p->shadow_version = ampc__version(p);
    ampc__shadow_unlock();
}

/* Parameter i can be stepped: a leaf of the right dtype whose grad matches it. */
static int check_step(const ampc_optimizer *opt, int i) {
    ampc_tensor *p = opt->params[i], *g = p->grad;
    int rc = check_param(p, opt->kind, i);
    if (rc < 0) return rc;
    if (g->dtype != p->dtype || !ampc__same_shape(g, p) || g->device != p->device) {
        char s1[96], s2[96];
        return ampc__err(AMPC_ERR_SHAPE, "%s: parameter %d is %s %s but its grad is %s %s", kind_name(opt->kind), i,
                         ampc__shape_str(p, s1, sizeof s1), ampc_dtype_name(p->dtype), ampc__shape_str(g, s2, sizeof s2),
                         ampc_dtype_name(g->dtype));
    }
    return ampc__backend_check(opt->kind == AMPC_OPTIM_SGD ? AMPC_K_sgd_step : AMPC_K_adam_step, p->dtype, p->device);
}

/* Parameter i's update, its state allocated on first use; it->first tells that the state is
   new (SGD's first momentum step; undone by drop_new_state if the step does not happen). */
static int make_item(ampc_optimizer *opt, int i, ampc_optim_item *it) {
    ampc_tensor *p = opt->params[i];
    memset(it, 0, sizeof *it);
    it->param = p;
    it->grad = p->grad;
    ampc__optimizer_part(opt, i, opt->shard_rank, &it->begin, &it->count);
    if (it->count == p->numel) it->count = 0;   /* the whole parameter */
    it->first = opt->state[0][i] == NULL;
    for (int s = 0; s < ampc__optimizer_slots_used(opt); s++)
        if (!(it->state[s] = ampc__optimizer_state(opt, s, i))) return ampc_last_status();
    it->step = opt->steps[i] + 1;
    return AMPC_OK;
}

static void drop_new_state(ampc_optimizer *opt, const ampc_optim_item *items, const int *idx, int n) {
    for (int k = 0; k < n; k++)
        if (items[k].first)
            for (int s = 0; s < 3; s++) {
                ampc__release(opt->state[s][idx[k]]);
                opt->state[s][idx[k]] = NULL;
            }
}

/* Parameter i's weight decay: its group's (ampc_optimizer_set_weight_decay) or the options'. */
static double param_wd(const ampc_optimizer *opt, int i) {
    return opt->weight_decay[i] >= 0 ? opt->weight_decay[i] : opt->kind == AMPC_OPTIM_SGD ? opt->sgd.weight_decay : opt->adam.weight_decay;
}

/* One backend call over items[0..n) with weight decay wd. */
static int step_group(ampc_optimizer *opt, ampc_optim_item *items, int n, double wd, float grad_scale) {
    if (opt->kind == AMPC_OPTIM_SGD) {
        const ampc_sgd_options *o = &opt->sgd;
        ampc_sgd_hparams h = {o->lr, o->momentum, o->dampening, wd, o->nesterov, grad_scale};
        return ampc__k_sgd_step(items, n, &h);
    }
    const ampc_adam_options *o = &opt->adam;
    ampc_adam_hparams h = {o->lr, o->beta1, o->beta2, o->eps, wd, o->amsgrad, opt->kind == AMPC_OPTIM_ADAMW, grad_scale};
    return ampc__k_adam_step(items, n, &h);
}

/* The parameters of one device with a grad, in one backend call per weight-decay group. */
static int step_device(ampc_optimizer *opt, ampc_device dev, float grad_scale) {
    ampc_optim_item *items = opt->items;
    int *idx = opt->item_param, n = 0, rc = AMPC_OK;
    for (int i = 0; i < opt->n; i++) {
        ampc_tensor *p = opt->params[i];
        int64_t lo, count;
        ampc__optimizer_part(opt, i, opt->shard_rank, &lo, &count);
        if (p->grad && p->device == dev && count != 0) idx[n++] = i;
    }
    /* grouped by weight decay, each group in parameter order */
    for (int a = 0; a < n;) {
        const double w = param_wd(opt, idx[a]);
        int b = a + 1;
        for (int j = b; j < n; j++)
            if (param_wd(opt, idx[j]) == w) {
                int t = idx[j];
                memmove(&idx[b + 1], &idx[b], (size_t)(j - b) * sizeof *idx);
                idx[b++] = t;
            }
        a = b;
    }
    int built = 0;
    while (built < n && rc >= 0) {
        rc = make_item(opt, idx[built], &items[built]);
        if (rc >= 0 || items[built].first) built++;   /* a failed item's new state is dropped below too */
    }
    n = built;
    if (rc >= 0 && n == 0) return AMPC_OK;
    /* the 16-bit copy is rewritten in the step's pass when the whole parameter is stepped here;
       a part (ZeRO) leaves it to be recast */
    for (int k = 0; k < n && rc >= 0; k++) items[k].cast_out = items[k].count ? NULL : copy_to_refresh(items[k].param);
    for (int a = 0; a < n && rc >= 0;) {
        const double w = param_wd(opt, idx[a]);
        int b = a + 1;
        while (b < n && param_wd(opt, idx[b]) == w) b++;
        rc = step_group(opt, items + a, b - a, w, grad_scale);
        for (int k = a; k < b; k++) {
            mark_stepped(items[k].param, items[k].cast_out, rc);
            if (grad_scale != 0) ampc__mark_written(items[k].grad);   /* written back unscaled */
        }
        a = b;
    }
    if (rc < 0) {
        drop_new_state(opt, items, idx, n);
        return rc;
    }
    /* every parameter with a grad counts the step, its part here or not (ZeRO): the counts agree */
    for (int i = 0; i < opt->n; i++)
        if (opt->params[i]->grad && opt->params[i]->device == dev) opt->steps[i]++;
    return AMPC_OK;
}

/* ZeRO-1: every stepped parameter (it has a grad: the same set on every rank, whose DDP gives
   every parameter a grad) has each rank's part broadcast from that rank, in parameter order on
   every rank. Blocking: the next forward reads them. Memory another rank wrote is marked written,
   so autocast's kept 16-bit copy of the parameter is recast. */
int ampc__broadcast_range(ampc_tensor *t, int64_t lo, int64_t count, int root) {
    const ampc_comm_ops *comm = ampc__comm();
    if (ampc__comm_reads(t->device))
        return comm->broadcast((char *)ampc__data(t) + lo * (int64_t)ampc__dt(t->dtype)->size,
                               (size_t)count * ampc__dt(t->dtype)->size, root);
    ampc_tensor *part = ampc__tensor_new(t->dtype, t->device, 1, &count);
    if (!part) return ampc_last_status();
    int rc = comm->rank == root ? ampc__k_copy_block(t, lo, count, part, 0, count, 1, count, 1.0) : AMPC_OK;
    if (rc >= 0) rc = ampc__comm_broadcast_tensor(part, root);
    if (rc >= 0 && comm->rank != root) rc = ampc__k_copy_block(part, 0, count, t, lo, count, 1, count, 1.0);
    ampc__release(part);
    return rc;
}

static int publish(ampc_optimizer *opt) {
    for (int i = 0; i < opt->n; i++) {
        ampc_tensor *p = opt->params[i];
        if (!p->grad || opt->flat[i] == opt->flat[i + 1]) continue;
        for (int r = 0; r < opt->shard_world; r++) {
            int64_t lo, count;
            ampc__optimizer_part(opt, i, r, &lo, &count);
            if (count == 0) continue;
            int rc = ampc__broadcast_range(p, lo, count, r);
            if (rc < 0) return rc;
        }
        int64_t lo, mine;
        ampc__optimizer_part(opt, i, opt->shard_rank, &lo, &mine);
        if (mine != p->numel) ampc__mark_written(p);
    }
    return AMPC_OK;
}

static bool same_partition(const ampc_optimizer *opt, const int64_t *flat, const int64_t *bounds, int world) {
    return opt->flat && flat && opt->shard_world == world && !memcmp(opt->flat, flat, (size_t)(opt->n + 1) * sizeof *flat) &&
           !memcmp(opt->bounds, bounds, (size_t)(world + 1) * sizeof *bounds);
}

int ampc__optimizer_shard(ampc_optimizer *opt, const int64_t *flat, const int64_t *bounds, int world, int rank) {
    int rc = ampc__optimizer_check(opt, "ampc_zero_shard");
    if (rc < 0) return rc;
    if (flat && (world < 1 || rank < 0 || rank >= world))
        return ampc__err(AMPC_ERR_INVALID, "ZeRO: rank %d of a world of %d", rank, world);
    bool same = same_partition(opt, flat, bounds, world);
    int64_t *f = NULL, *b = NULL;
    if (flat) {
        /* a part kept from another partition would be another part of the parameter */
        for (int i = 0; i < opt->n && !same; i++)
            for (int k = 0; k < 3; k++)
                if (opt->state[k][i] && opt->state[k][i]->numel != opt->params[i]->numel)
                    return ampc__err(AMPC_ERR_INVALID, "ZeRO: parameter %d's state is a part of another partition; "
                                     "gather it with ampc_zero_consolidate before sharding anew", i);
        f = malloc((size_t)(opt->n + 1) * sizeof *f);
        b = malloc((size_t)(world + 1) * sizeof *b);
        if (!f || !b) {
            free(f), free(b);
            return ampc__err(AMPC_ERR_OOM, "ZeRO: out of memory");
        }
        memcpy(f, flat, (size_t)(opt->n + 1) * sizeof *f);
        memcpy(b, bounds, (size_t)(world + 1) * sizeof *b);
    }
    /* whole state is cut down to this rank's part under the new partition: every part is
       allocated first, so that a failure changes nothing */
    ampc_optimizer next = *opt;
    next.flat = f, next.bounds = b, next.shard_rank = flat ? rank : 0, next.shard_world = flat ? world : 1;
    ampc_tensor **cut = calloc((size_t)(3 * opt->n + 1), sizeof *cut);
    if (!cut) rc = ampc__err(AMPC_ERR_OOM, "ZeRO: out of memory");
    for (int i = 0; i < opt->n && rc >= 0; i++) {
        ampc_tensor *p = opt->params[i];
        int64_t lo, count;
        ampc__optimizer_part(&next, i, next.shard_rank, &lo, &count);
        for (int k = 0; k < 3 && rc >= 0; k++) {
            ampc_tensor *t = opt->state[k][i];
            if (!t || t->numel == count || count == 0 || t->numel != p->numel) continue;
            ampc_mem_kind prev = ampc__mem_kind_push(AMPC_MEM_OPTIMIZER);
            if (!(cut[3 * i + k] = ampc__tensor_new(p->dtype, p->device, 1, &count))) rc = ampc_last_status();
            ampc__mem_kind_pop(prev);
        }
    }
    if (rc < 0) {
        for (int k = 0; cut && k < 3 * opt->n; k++) ampc__release(cut[k]);
        free(cut), free(f), free(b);
        return rc;
    }
    for (int i = 0; i < opt->n; i++) {
        int64_t lo, count;
        ampc__optimizer_part(&next, i, next.shard_rank, &lo, &count);
        for (int k = 0; k < 3; k++) {
            ampc_tensor *t = opt->state[k][i], *part = cut[3 * i + k];
            if (!t || t->numel == count) continue;   /* nothing, or already this part */
            if (part && (rc = ampc__k_copy_block(t, lo, count, part, 0, count, 1, count, 1.0)) < 0) {
                /* not expected (checked shapes on one device); the state stays whole */
                for (int k2 = 0; k2 < 3 * opt->n; k2++) ampc__release(cut[k2]);
                free(cut), free(f), free(b);
                return rc;
            }
            /* else another rank's part, or one that cannot be whole again: released */
            ampc__release(t);
            opt->state[k][i] = part;
        }
    }
    free(cut);
    free(opt->flat);
    free(opt->bounds);
    opt->flat = f, opt->bounds = b, opt->shard_rank = next.shard_rank, opt->shard_world = next.shard_world;
    return AMPC_OK;
}

/* ZeRO with the GradScaler's unscale fused: the kernels wrote back the unscaled gradient of this
   rank's parts; the rest of every gradient, whole here too (DDP), gets the same product, so the
   grads read unscaled after the step on every rank, as unsharded: the same f32 product in place
   (copy_block with a scale), on the gradients' device. */
static int unscale_other_parts(ampc_optimizer *opt, float grad_scale) {
    int rc = AMPC_OK;
    for (int i = 0; i < opt->n && rc >= 0 && grad_scale != 1.0f; i++) {
        ampc_tensor *p = opt->params[i], *g = p->grad;
        int64_t lo, count;
        ampc__optimizer_part(opt, i, opt->shard_rank, &lo, &count);
        if (!g || count == p->numel) continue;
        /* before this rank's part, then after it (no part here: all of it; lo may lie past the end then) */
        const int64_t before = count ? lo : p->numel, after = count ? lo + count : p->numel;
        rc = ampc__k_copy_block(g, 0, before, g, 0, before, 1, before, grad_scale);
        if (rc >= 0) rc = ampc__k_copy_block(g, after, p->numel - after, g, after, p->numel - after, 1, p->numel - after, grad_scale);
        ampc__mark_written(g);
    }
    return rc;
}

/* The step of ampc_optimizer_step (call names the entry point in errors). */
static int step(ampc_optimizer *opt, float grad_scale, const char *call) {
    if (!opt) return ampc__err(AMPC_ERR_INVALID, "%s: optimizer is NULL", call);
    /* every parameter is checked before any is written */
    if (ampc__optimizer_check(opt, call) < 0) return ampc_last_status();
    for (int i = 0; i < opt->n; i++)
        if (opt->params[i]->grad && check_step(opt, i) < 0) return ampc_last_status();
    int rc;
    for (int d = 0; d < AMPC_DEVICE_COUNT; d++)
        if ((rc = step_device(opt, (ampc_device)d, grad_scale)) < 0) return rc;
    if (opt->flat && grad_scale != 0 && (rc = unscale_other_parts(opt, grad_scale)) < 0) return rc;
    return opt->flat ? publish(opt) : AMPC_OK;
}

int ampc__optimizer_step_scaled(ampc_optimizer *opt, float grad_scale) { return step(opt, grad_scale, "ampc_scaler_step"); }
int ampc_optimizer_step(ampc_optimizer *opt) { return step(opt, 0.0f, "ampc_optimizer_step"); }

void ampc_optimizer_zero_grad(ampc_optimizer *opt) {
    if (check_live(opt, "ampc_optimizer_zero_grad") < 0) return;
    for (int i = 0; i < opt->n; i++) ampc__tensor_zero_grad(opt->params[i]);
}

// ---------------------------------------------------------------------------------------------
// Accessors

double ampc_optimizer_get_lr(const ampc_optimizer *opt) {
    if (check_live(opt, "ampc_optimizer_get_lr") < 0) return NAN;
    return opt->kind == AMPC_OPTIM_SGD ? opt->sgd.lr : opt->adam.lr;
}

void ampc_optimizer_set_lr(ampc_optimizer *opt, double lr) {
    if (check_live(opt, "ampc_optimizer_set_lr") < 0) return;
    if (!(lr >= 0)) {
        ampc__err(AMPC_ERR_INVALID, "%s: invalid learning rate: %g", kind_name(opt->kind), lr);
        return;
    }
    if (opt->kind == AMPC_OPTIM_SGD) opt->sgd.lr = lr;
    else opt->adam.lr = lr;
}

int ampc_optimizer_num_params(const ampc_optimizer *opt) {
    int rc = check_live(opt, "ampc_optimizer_num_params");
    return rc < 0 ? (opt ? rc : 0) : opt->n;   /* NULL: 0 parameters, as before */
}

ampc_tensor *ampc_optimizer_param(const ampc_optimizer *opt, int i) {
    if (opt && check_live(opt, "ampc_optimizer_param") < 0) return NULL;
    if (!opt || i < 0 || i >= opt->n) return ampc__err_null(AMPC_ERR_INVALID, "optimizer parameter %d out of range", i);
    return opt->params[i];
}

int64_t ampc_optimizer_count_nonfinite(const ampc_optimizer *opt) {
    int rc = ampc__optimizer_check(opt, "ampc_optimizer_count_nonfinite");
    if (rc < 0) return rc;
    int64_t bad = 0;
    for (int i = 0; i < opt->n; i++) {
        ampc_tensor *ts[4] = {opt->params[i], opt->state[0] ? opt->state[0][i] : NULL, opt->state[1] ? opt->state[1][i] : NULL,
                              opt->state[2] ? opt->state[2][i] : NULL};
        for (int k = 0; k < 4; k++) {
            if (!ts[k]) continue;
            int64_t b = ampc_tensor_count_nonfinite(ts[k]);
            if (b < 0) return b;
            bad += b;
        }
    }
    return bad;
}

int64_t ampc_optimizer_steps_taken(const ampc_optimizer *opt) {
    if (check_live(opt, "ampc_optimizer_steps_taken") < 0) return 0;
    int64_t most = 0;
    for (int i = 0; i < opt->n; i++) most = opt->steps[i] > most ? opt->steps[i] : most;
    return most;
}

// ---------------------------------------------------------------------------------------------
// Learning-rate schedules

double ampc_lr_at(const ampc_lr_schedule *s, double base_lr, int64_t t) {
    if (!s || t < 0 || !(base_lr >= 0) || (unsigned)s->kind > AMPC_LR_COSINE || s->warmup_steps < 0 ||
        (s->warmup_steps > 0 && !(s->warmup_start_factor > 0 && s->warmup_start_factor <= 1)) ||
        (s->kind == AMPC_LR_STEP && (s->step_size < 1 || !(s->gamma >= 0))) ||
        (s->kind == AMPC_LR_COSINE && (s->t_max < 1 || !(s->eta_min >= 0)))) {
        ampc__err(AMPC_ERR_INVALID, "lr schedule: invalid settings or step %lld", (long long)t);
        return NAN;
    }
    if (t < s->warmup_steps) {   /* LinearLR: start_factor + (1 - start_factor) * t / total_iters */
        const double f = s->warmup_start_factor + (1.0 - s->warmup_start_factor) * (double)t / (double)s->warmup_steps;
        return base_lr * f;
    }
    t -= s->warmup_steps;
    switch (s->kind) {
    case AMPC_LR_STEP:
        return base_lr * pow(s->gamma, (double)(t / s->step_size));
    case AMPC_LR_COSINE: {   /* past t_max the cosine goes on, as PyTorch's */
        const double pi = 3.14159265358979323846;
        return s->eta_min + (base_lr - s->eta_min) * (1.0 + cos(pi * (double)t / (double)s->t_max)) / 2.0;
    }
    default:
        return base_lr;
    }
}
