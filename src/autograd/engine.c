/*
 * engine.c - graph nodes, grad mode and the backward pass.
 */
#include "autograd/autograd.h"
#include "backend/backend.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local int no_grad_depth;

void ampc_no_grad_enter(void) { no_grad_depth++; }
void ampc_no_grad_exit(void) {
    if (no_grad_depth > 0) no_grad_depth--;
}
bool ampc_grad_enabled(void) { return no_grad_depth == 0; }

/* In place, without a record: under autograd only a tensor that needs no gradient, or any under
   no-grad (a snapshot restored). */
int ampc_tensor_copy_(ampc_tensor *dst, const ampc_tensor *src) {
    int rc = ampc__check_tensor(dst, "ampc_tensor_copy_");
    if (rc >= 0) rc = ampc__check_tensor(src, "ampc_tensor_copy_");
    if (rc < 0) return rc;
    bool same = dst->ndim == src->ndim;
    for (int i = 0; same && i < dst->ndim; i++) same = dst->shape[i] == src->shape[i];
    if (!same) return ampc__err(AMPC_ERR_SHAPE, "ampc_tensor_copy_: the source's shape differs from the destination's");
    if (ampc_tensor_requires_grad(dst) && ampc_grad_enabled())
        return ampc__err(AMPC_ERR_INVALID, "ampc_tensor_copy_: the destination requires grad: copy into it under no-grad");
    return ampc__copy(src, dst);
}

// ---------------------------------------------------------------------------------------------
// A tensor's autograd properties

int ampc_tensor_set_requires_grad(ampc_tensor *t, bool on) {
    int rc = ampc__check_tensor(t, "ampc_tensor_set_requires_grad");
    if (rc < 0) return rc;
    if (t->grad_fn) return ampc__err(AMPC_ERR_STATE, "requires_grad can only be changed on leaf tensors (this one comes from %s)", t->grad_fn->name);
    if (on && !ampc__dt(t->dtype)->is_float) return ampc__err(AMPC_ERR_DTYPE, "only float tensors can require grad, not %s", ampc_dtype_name(t->dtype));
    t->requires_grad = on;
    return AMPC_OK;
}

const char *ampc_tensor_grad_fn_name(const ampc_tensor *t) {
    if (ampc__check_tensor(t, "ampc_tensor_grad_fn_name") < 0) return NULL;
    return t->grad_fn ? t->grad_fn->name : NULL;
}

// ---------------------------------------------------------------------------------------------
// Nodes

static ampc_pool node_pool = {sizeof(ampc_node), NULL};
static void node_pool_drain(void) { ampc__pool_drain(&node_pool); }

ampc_node *ampc__node_retain(ampc_node *n) {
    if (n) atomic_fetch_add(&n->refcount, 1);
    return n;
}

static void node_free_saved(ampc_node *n) {
    for (int i = 0; i < AMPC_NODE_MAX_SAVED; i++) {
        ampc__release(n->saved[i]);
        n->saved[i] = NULL;
    }
    if (n->extra) {
        ampc__free(n->extra_device, n->extra, n->extra_bytes, AMPC_MEM_ACTIVATIONS);
        n->extra = NULL;
    }
}

void ampc__node_release(ampc_node *n) {
    /* iterative over chains, so freeing a deep graph does not recurse deeply */
    while (n && atomic_fetch_sub(&n->refcount, 1) == 1) {
        node_free_saved(n);
        ampc__release(n->grad);
        if (n->leaf) {
            if (n->leaf->grad_acc == n) n->leaf->grad_acc = NULL;
            ampc__release(n->leaf);
        }
        ampc_node *tail = NULL;
        for (int i = 0; i < n->n_inputs; i++) {
            if (!n->next[i]) continue;
            if (!tail) tail = n->next[i];
            else ampc__node_release(n->next[i]);
        }
        ampc__pool_put(&node_pool, n);
        n = tail;
    }
}

static ampc_node *grad_acc_for(ampc_tensor *leaf) {
    if (leaf->grad_acc) return ampc__node_retain(leaf->grad_acc);
    ampc_node *a = ampc__pool_get(&node_pool);
    if (!a) return NULL;
    atomic_init(&a->refcount, 1);
    a->name = "AccumulateGrad";
    a->backward = NULL;   /* the engine accumulates into a->leaf itself (run_node) */
    a->leaf = ampc__retain(leaf);
    leaf->grad_acc = a;
    return a;
}

bool ampc__needs_grad(ampc_tensor *const *inputs, int n) {
    if (no_grad_depth) return false;
    for (int i = 0; i < n; i++)
        if (inputs[i] && inputs[i]->requires_grad) return true;
    return false;
}

/* What core calls for autograd (registered before the first node exists, so before any tensor
   has a grad_fn): releasing a tensor's grad_fn, and emptying the node pool at shutdown. */
static void register_with_core(void) {
    ampc__set_grad_fn_release(ampc__node_release);
    ampc__on_shutdown(AMPC_SHUTDOWN_DRAIN, node_pool_drain);
}

ampc_node *ampc__node_new(const char *name, ampc_backward_fn fn, ampc_tensor *const *inputs, int n) {
    static pthread_once_t registered = PTHREAD_ONCE_INIT;
    pthread_once(&registered, register_with_core);
    ampc_node *node = ampc__pool_get(&node_pool);
    if (!node) return NULL;
    atomic_init(&node->refcount, 1);
    node->name = name;
    node->module = ampc__trace_on() ? ampc__trace_intern(ampc__trace_module_path()) : NULL;
    node->backward = fn;
    node->n_inputs = n;
    for (int i = 0; i < n; i++) {
        ampc_tensor *t = inputs[i];
        if (!t) continue;
        node->in[i].ndim = t->ndim;
        memcpy(node->in[i].shape, t->shape, sizeof t->shape);
        node->in[i].dtype = t->dtype;
        node->in[i].format = t->format;
        if (!t->requires_grad) continue;
        node->next[i] = t->grad_fn ? ampc__node_retain(t->grad_fn) : grad_acc_for(t);
        if (!node->next[i]) {
            ampc__node_release(node);
            return NULL;
        }
    }
    return node;
}

void ampc__node_save(ampc_node *n, int slot, ampc_tensor *t) {
    ampc__release(n->saved[slot]);
    n->saved[slot] = ampc__retain(t);
}

void ampc__node_attach(ampc_node *n, ampc_tensor *out) {
    out->grad_fn = n;
    out->requires_grad = true;
}

// ---------------------------------------------------------------------------------------------
// Gradient accumulation

ampc_dtype ampc__grad_dtype(const ampc_node *n, int i) {
    const ampc_node *m = n->next[i];
    return m && m->pass_wide ? m->in[0].dtype : n->in[i].dtype;
}

ampc_mem_kind ampc__grad_kind(const ampc_node *n, int i) {
    const ampc_node *m = n->next[i];
    if (m && m->pass_wide) m = m->next[0];
    return m && m->leaf ? AMPC_MEM_GRADIENTS : AMPC_MEM_ACTIVATIONS;
}

/* Only the engine holds g (and its storage): it may be reused or modified in place. */
bool ampc__grad_exclusive(const ampc_tensor *g) {
    return atomic_load(&g->refcount) == 1 && atomic_load(&g->storage->refcount) == 1;
}

/* *acc += g; takes the caller's reference to g. */
static int accumulate_into(ampc_tensor **acc, ampc_tensor *g, ampc_mem_kind kind) {
    if (!*acc) {
        if (ampc__grad_exclusive(g)) {
            ampc__storage_set_kind(g->storage, kind);
            *acc = g;
            return AMPC_OK;
        }
        ampc_mem_kind prev = ampc__mem_kind_push(kind);
        ampc_tensor *c = ampc__tensor_like(g, g->dtype);
        ampc__mem_kind_pop(prev);
        int rc = c ? ampc__device(c->device)->copy(g, c) : ampc_last_status();
        ampc__release(g);
        if (rc < 0) {
            ampc__release(c);
            return rc;
        }
        *acc = c;
        return AMPC_OK;
    }
    ampc_tensor *a = *acc;
    if (!ampc__same_shape(a, g) || a->dtype != g->dtype) {
        char s1[96], s2[96];
        ampc__release(g);
        return ampc__err(AMPC_ERR_SHAPE, "gradient %s %s accumulated into %s %s", ampc__shape_str(g, s1, sizeof s1),
                         ampc_dtype_name(g->dtype), ampc__shape_str(a, s2, sizeof s2), ampc_dtype_name(a->dtype));
    }
    int rc;
    if (ampc__grad_exclusive(a)) {
        rc = ampc__k_binary_into(AMPC_OP_ADD, a, g, a);
    } else {   /* someone else sees a: add out of place */
        ampc_mem_kind prev = ampc__mem_kind_push(kind);
        ampc_tensor *s = ampc__tensor_like(a, a->dtype);
        ampc__mem_kind_pop(prev);
        rc = s ? ampc__k_binary_into(AMPC_OP_ADD, a, g, s) : ampc_last_status();
        if (rc >= 0) {
            ampc__release(a);
            *acc = s;
        } else {
            ampc__release(s);
        }
    }
    ampc__release(g);
    return rc;
}

int ampc__accumulate_grad(ampc_tensor *leaf, ampc_tensor *g) {
    return accumulate_into(&leaf->grad, ampc__retain(g), AMPC_MEM_GRADIENTS);
}

// ---------------------------------------------------------------------------------------------
// Backward

static ampc_backward_hooks hooks[AMPC_BACKWARD_MAX_HOOKS];
static int n_hooks;
static pthread_mutex_t hooks_lock = PTHREAD_MUTEX_INITIALIZER;

int ampc__backward_hooks_add(const ampc_backward_hooks *h) {
    pthread_mutex_lock(&hooks_lock);
    int rc = AMPC_OK;
    if (n_hooks == AMPC_BACKWARD_MAX_HOOKS)
        rc = ampc__err(AMPC_ERR_STATE, "backward hooks: all %d places are taken (free a distributed model first)",
                       AMPC_BACKWARD_MAX_HOOKS);
    else
        hooks[n_hooks++] = *h;
    pthread_mutex_unlock(&hooks_lock);
    return rc;
}

void ampc__backward_hooks_remove(void *ctx) {
    pthread_mutex_lock(&hooks_lock);
    int k = 0;
    for (int i = 0; i < n_hooks; i++)
        if (hooks[i].ctx != ctx) hooks[k++] = hooks[i];
    n_hooks = k;
    pthread_mutex_unlock(&hooks_lock);
}

/* The hooks are registered and removed between steps (wrapping a model, freeing it), never
   while a backward pass runs, so the passes read them without the lock. */
static int hooks_leaf_ready(ampc_tensor *leaf) {
    for (int i = 0; i < n_hooks; i++) {
        int rc = hooks[i].leaf_ready ? hooks[i].leaf_ready(hooks[i].ctx, leaf) : AMPC_OK;
        if (rc < 0) return rc;
    }
    return AMPC_OK;
}
static int hooks_node_done(void) {
    for (int i = 0; i < n_hooks; i++) {
        int rc = hooks[i].node_done ? hooks[i].node_done(hooks[i].ctx) : AMPC_OK;
        if (rc < 0) return rc;
    }
    return AMPC_OK;
}
static int hooks_finish(int rc) {
    for (int i = 0; i < n_hooks; i++)
        if (hooks[i].finish) rc = hooks[i].finish(hooks[i].ctx, rc);
    return rc;
}

typedef struct { ampc_node **v; size_t n, cap; } node_vec;
static _Thread_local node_vec visited, stack, ready;

static int vec_push(node_vec *a, ampc_node *n) {
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 256;
        ampc_node **v = realloc(a->v, cap * sizeof *v);
        if (!v) return ampc__err(AMPC_ERR_OOM, "backward bookkeeping");
        a->v = v;
        a->cap = cap;
        ampc__free_at_thread_exit((void **)&a->v);
    }
    a->v[a->n++] = n;
    return AMPC_OK;
}

/* Counts, for each node reachable from root, how many edges point to it. */
static int count_deps(ampc_node *root) {
    visited.n = stack.n = 0;
    root->deps = 0;
    if (vec_push(&visited, root) < 0 || vec_push(&stack, root) < 0) return AMPC_ERR_OOM;
    root->deps = -1;   /* marks visited; fixed below */
    while (stack.n) {
        ampc_node *n = stack.v[--stack.n];
        for (int i = 0; i < n->n_inputs; i++) {
            ampc_node *m = n->next[i];
            if (!m) continue;
            if (m->deps == 0 && m != root) {   /* first time seen */
                if (vec_push(&visited, m) < 0 || vec_push(&stack, m) < 0) return AMPC_ERR_OOM;
                m->deps = -1;
            }
        }
    }
    for (size_t k = 0; k < visited.n; k++) visited.v[k]->deps = 0;
    for (size_t k = 0; k < visited.n; k++) {
        ampc_node *n = visited.v[k];
        for (int i = 0; i < n->n_inputs; i++)
            if (n->next[i]) n->next[i]->deps++;
    }
    return AMPC_OK;
}

static void cleanup(void) {
    for (size_t k = 0; k < visited.n; k++) {
        ampc_node *n = visited.v[k];
        ampc__release(n->grad);
        n->grad = NULL;
        n->deps = 0;
    }
    visited.n = stack.n = ready.n = 0;
}

static int run_node(ampc_node *n) {
    ampc_tensor *gy = n->grad;
    n->grad = NULL;
    if (!gy) return AMPC_OK;   /* no gradient flowed here (e.g. unused output) */
    /* a leaf takes the engine's reference: a gradient nobody else holds becomes .grad without
       a copy */
    if (n->leaf) {
        int rc = accumulate_into(&n->leaf->grad, gy, AMPC_MEM_GRADIENTS);
        return rc < 0 ? rc : hooks_leaf_ready(n->leaf);
    }
    if (n->released && !n->leaf) {
        ampc__release(gy);
        return ampc__err(AMPC_ERR_STATE, "backward through %s a second time: its saved tensors were already freed", n->name);
    }
    ampc_tensor *gx[AMPC_NODE_MAX_INPUTS] = {0};
    ampc_no_grad_enter();
    int rc = n->backward(n, gy, gx);
    ampc_no_grad_exit();
    /* tracing: the observer sees the incoming gradient and the input gradients as the next
       nodes receive them (cast to the inputs' dtypes: an overflow of that cast is this op's) */
    ampc_tensor *traced_gy = rc >= 0 && ampc__trace_on() ? ampc__retain(gy) : NULL, *raw[AMPC_NODE_MAX_INPUTS] = {0};
    ampc__release(gy);
    if (!n->leaf) {
        /* like PyTorch, only a node that saved something refuses a second pass */
        for (int i = 0; i < AMPC_NODE_MAX_SAVED; i++) n->released |= n->saved[i] != NULL;
        n->released |= n->extra != NULL;
        node_free_saved(n);
    }
    for (int i = 0; i < n->n_inputs; i++) {   /* each input's gradient as that input's node takes it */
        ampc_node *m = n->next[i];
        ampc_tensor *g = gx[i];
        gx[i] = NULL;
        if (rc < 0 || !m || !g) {
            ampc__release(g);
            continue;
        }
        /* the gradient of an input has the input's dtype (PyTorch casts it the same way), or
           the wider dtype a pass_wide cast keeps (every gradient it receives is widened, so
           its sum is taken in that dtype) */
        ampc_dtype gdt = ampc__grad_dtype(n, i);
        /* and the input's memory format: each backward receives its output's gradient in the
           output's format, whatever format the consumer's kernels produced */
        if (g->dtype != gdt || g->format != n->in[i].format) {
            ampc_tensor *c = ampc__k_convert(g, gdt, n->in[i].format);
            if (traced_gy && c) raw[i] = ampc__retain(g);   /* the value before the cast, for the statistics */
            ampc__release(g);
            if (!c) { rc = ampc_last_status(); continue; }
            g = c;
        }
        if (g->ndim != n->in[i].ndim || memcmp(g->shape, n->in[i].shape, sizeof(int64_t) * (size_t)g->ndim)) {
            char s[96];
            rc = ampc__err(AMPC_ERR_SHAPE, "%s produced a gradient of shape %s for input %d", n->name,
                           ampc__shape_str(g, s, sizeof s), i);
            ampc__release(g);
            continue;
        }
        gx[i] = g;
    }
    if (traced_gy) {   /* borrowed: the gradients are accumulated (and perhaps consumed) after */
        ampc__trace_event e = {.backward = true, .name = n->name, .op = -1, .module = n->module ? n->module : "", .n_in = 1,
                               .in = {traced_gy}, .n_out = n->n_inputs < AMPC_TRACE_MAX ? n->n_inputs : AMPC_TRACE_MAX};
        for (int i = 0; i < e.n_out; i++) e.raw[i] = raw[i] ? raw[i] : (e.out[i] = gx[i]);
        for (int i = 0; i < e.n_out; i++) e.out[i] = gx[i];
        if (rc >= 0) ampc__trace_emit(&e);
        for (int i = 0; i < n->n_inputs; i++) ampc__release(raw[i]);
        ampc__release(traced_gy);
    }
    for (int i = 0; i < n->n_inputs; i++) {
        ampc_tensor *g = gx[i];
        gx[i] = NULL;
        if (!g) continue;
        if (rc < 0) {
            ampc__release(g);
            continue;
        }
        rc = accumulate_into(&n->next[i]->grad, g, ampc__grad_kind(n, i));   /* a leaf's: counted as gradients */
    }
    if (rc < 0) return rc;
    for (int i = 0; i < n->n_inputs; i++) {
        ampc_node *m = n->next[i];
        if (m && --m->deps == 0 && vec_push(&ready, m) < 0) return AMPC_ERR_OOM;
    }
    return AMPC_OK;
}

int ampc_backward_with_grad(ampc_tensor *out, ampc_tensor *grad) {
    if (!out) return ampc_last_status() ? ampc_last_status() : ampc__err(AMPC_ERR_INVALID, "backward of NULL");
    if (!grad) return ampc__err(AMPC_ERR_INVALID, "backward with a NULL gradient");
    if (!out->requires_grad)
        return ampc__err(AMPC_ERR_STATE, "backward of a tensor that does not require grad and has no grad_fn");
    if (!ampc__same_shape(out, grad)) {
        char s1[96], s2[96];
        return ampc__err(AMPC_ERR_SHAPE, "gradient of shape %s for an output of shape %s",
                         ampc__shape_str(grad, s1, sizeof s1), ampc__shape_str(out, s2, sizeof s2));
    }
    ampc_tensor *g = ampc__k_convert(grad, out->dtype, out->format);
    if (!g) return ampc_last_status();
    if (!out->grad_fn) {   /* a leaf: its gradient is the given one */
        int rc = ampc__accumulate_grad(out, g);
        ampc__release(g);
        if (rc >= 0) rc = hooks_leaf_ready(out);
        return hooks_finish(rc);
    }
    ampc_node *root = out->grad_fn;
    int rc = count_deps(root);
    if (rc < 0) {
        ampc__release(g);
        cleanup();
        return hooks_finish(rc);
    }
    root->grad = g;
    ready.n = 0;
    vec_push(&ready, root);
    while (ready.n && rc >= 0) {
        ampc_node *n = ready.v[--ready.n];
        rc = run_node(n);
        if (rc >= 0 && n_hooks) rc = hooks_node_done();
    }
    cleanup();
    rc = hooks_finish(rc);
    return rc < 0 ? rc : AMPC_OK;
}

int ampc_backward(ampc_tensor *loss) {
    if (!loss) return ampc_last_status() ? ampc_last_status() : ampc__err(AMPC_ERR_INVALID, "backward of NULL");
    if (loss->numel != 1)
        return ampc__err(AMPC_ERR_SHAPE, "backward() without a gradient needs a single-element loss, not %lld elements",
                         (long long)loss->numel);
    ampc_tensor *one = ampc__tensor_like(loss, loss->dtype);
    if (!one) return ampc_last_status();
    int rc = ampc__device(one->device)->fill(one, 1.0);
    if (rc >= 0) rc = ampc_backward_with_grad(loss, one);
    ampc__release(one);
    return rc;
}
