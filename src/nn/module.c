/*
 * module.c - the module object: registration of parameters, buffers and children, the flat
 * state_dict-ordered lists, forward in a scope, train/eval, freezing, Sequential.
 *
 * This file calls no op, so programs that only use optimizers over explicit tensors do not
 * pull the op library in (layers live in layers.c).
 */
#include "nn/nn.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Named lists

static int list_push(ampc_named_list *l, const char *name, void *item) {
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 4;
        char **names = realloc(l->names, (size_t)cap * sizeof *names);
        if (!names) return ampc__err(AMPC_ERR_OOM, "module registry");
        l->names = names;
        void **items = realloc(l->items, (size_t)cap * sizeof *items);
        if (!items) return ampc__err(AMPC_ERR_OOM, "module registry");
        l->items = items;
        l->cap = cap;
    }
    char *copy = strdup(name);
    if (!copy) return ampc__err(AMPC_ERR_OOM, "module registry");
    l->names[l->n] = copy;
    l->items[l->n] = item;
    l->n++;
    return AMPC_OK;
}

static void *list_find(const ampc_named_list *l, const char *name) {
    for (int i = 0; i < l->n; i++)
        if (!strcmp(l->names[i], name)) return l->items[i];
    return NULL;
}

static void list_free_names(ampc_named_list *l) {
    for (int i = 0; i < l->n; i++) free(l->names[i]);
    free(l->names);
    free(l->items);
    memset(l, 0, sizeof *l);
}

// ---------------------------------------------------------------------------------------------
// Flat lists (state_dict order, dotted names)

static void flat_clear(ampc_flat_list *f) {
    for (int i = 0; i < f->n; i++) free(f->names[i]);
    f->n = 0;
    f->valid = false;
}

static void flat_free(ampc_flat_list *f) {
    flat_clear(f);
    free(f->names);
    free(f->tensors);
    memset(f, 0, sizeof *f);
}

static int flat_push(ampc_flat_list *f, const char *prefix, const char *name, ampc_tensor *t) {
    if (f->n == f->cap) {
        int cap = f->cap ? f->cap * 2 : 8;
        char **names = realloc(f->names, (size_t)cap * sizeof *names);
        if (!names) return ampc__err(AMPC_ERR_OOM, "parameter list");
        f->names = names;
        ampc_tensor **ts = realloc(f->tensors, (size_t)cap * sizeof *ts);
        if (!ts) return ampc__err(AMPC_ERR_OOM, "parameter list");
        f->tensors = ts;
        f->cap = cap;
    }
    size_t len = strlen(prefix) + strlen(name) + 1;
    char *full = malloc(len);
    if (!full) return ampc__err(AMPC_ERR_OOM, "parameter list");
    snprintf(full, len, "%s%s", prefix, name);
    f->names[f->n] = full;
    f->tensors[f->n] = t;
    f->n++;
    return AMPC_OK;
}

static bool flat_holds(const ampc_flat_list *f, const ampc_tensor *t) {
    for (int i = 0; i < f->n; i++)
        if (f->tensors[i] == t) return true;
    return false;
}

/* Appends m's entries under prefix: own parameters, own buffers (if wanted), then children. A
   parameter shared by two modules (tied weights) is in the state_dict under both names, as in
   PyTorch's, but in the parameter list once, under its first name (named_parameters). */
static int flat_collect(ampc_flat_list *f, const ampc_module *m, const char *prefix, bool buffers) {
    for (int i = 0; i < m->params.n; i++)
        if ((buffers || !flat_holds(f, m->params.items[i])) && flat_push(f, prefix, m->params.names[i], m->params.items[i]) < 0)
            return AMPC_ERR_OOM;
    if (buffers)
        for (int i = 0; i < m->buffers.n; i++)
            if (flat_push(f, prefix, m->buffers.names[i], m->buffers.items[i]) < 0) return AMPC_ERR_OOM;
    for (int c = 0; c < m->children.n; c++) {
        const char *cn = m->children.names[c];
        size_t len = strlen(prefix) + strlen(cn) + 2;
        char *sub = malloc(len);
        if (!sub) return ampc__err(AMPC_ERR_OOM, "parameter list");
        snprintf(sub, len, "%s%s.", prefix, cn);
        int rc = flat_collect(f, m->children.items[c], sub, buffers);
        free(sub);
        if (rc < 0) return rc;
    }
    return AMPC_OK;
}

static int flat_get(ampc_module *m, ampc_flat_list *f, bool buffers, ampc_tensor ***tensors, const char ***names) {
    if (!f->valid) {
        flat_clear(f);
        if (flat_collect(f, m, "", buffers) < 0) {
            flat_clear(f);
            return ampc_last_status();
        }
        f->valid = true;
    }
    if (tensors) *tensors = f->tensors;
    if (names) *names = (const char **)f->names;
    return f->n;
}

void ampc__module_invalidate(ampc_module *m) {
    for (; m; m = m->parent) {
        m->flat_params.valid = false;
        m->flat_state.valid = false;
    }
}

// ---------------------------------------------------------------------------------------------
// Construction and registration

/* A handle pool, so that a stale handle, and the owner_gen pointer of a parameter the module
   registered, stay readable and never name a new module. */
static ampc_handle_pool module_pool = {.obj_size = sizeof(ampc_module)};

/* AMPC_OK for a live module; else the error naming call (see ampc__check_handle). */
static int check_module(const ampc_module *m, const char *call) {
    return ampc__check_handle(m, m ? m->gen : 0, call, "module", "freed");
}

ampc_module *ampc__module_new(const ampc_module_vtable *vt) {
    ampc__ensure_init();
    ampc_module *m = ampc__handle_pool_get(&module_pool);
    if (!m) return ampc__err_null(AMPC_ERR_OOM, "module %s", vt->type);
    m->vt = vt;
    m->gen = ampc__new_gen();
    m->training = true;
    return m;
}

/* The caller's reference to t becomes m's; t's optimizers check that m is still alive. */
static void adopt_tensor(ampc_module *m, ampc_tensor *t) {
    ampc__tensor_take(t);
    t->owner_gen = &m->gen;
    t->owner_gen_val = m->gen;
}

int ampc__module_add_param(ampc_module *m, const char *name, ampc_tensor *t) {
    if (!t) return ampc_last_status() ? ampc_last_status() : ampc__err(AMPC_ERR_INVALID, "parameter %s is NULL", name);
    adopt_tensor(m, t);
    /* t is a float leaf (nn.h; every caller passes a fresh ampc__param_dtype() tensor): the flag is
       set directly, as ampc_module_requires_grad does, so nn calls nothing of autograd's */
    t->requires_grad = true;
    int rc = list_find(&m->params, name) ? ampc__err(AMPC_ERR_INVALID, "parameter %s registered twice", name)
                                         : list_push(&m->params, name, t);
    if (rc < 0) {
        ampc__release(t);
        return rc;
    }
    ampc__module_invalidate(m);
    return AMPC_OK;
}

int ampc__module_add_buffer(ampc_module *m, const char *name, ampc_tensor *t) {
    if (!t) return ampc_last_status() ? ampc_last_status() : ampc__err(AMPC_ERR_INVALID, "buffer %s is NULL", name);
    adopt_tensor(m, t);
    int rc = list_find(&m->buffers, name) ? ampc__err(AMPC_ERR_INVALID, "buffer %s registered twice", name)
                                          : list_push(&m->buffers, name, t);
    if (rc < 0) {
        ampc__release(t);
        return rc;
    }
    ampc__module_invalidate(m);
    return AMPC_OK;
}

int ampc__module_add_child(ampc_module *m, const char *name, ampc_module *child) {
    if (!child) return ampc_last_status() ? ampc_last_status() : ampc__err(AMPC_ERR_INVALID, "child %s is NULL", name);
    if (child->parent)   /* not freed: it belongs to its parent */
        return ampc__err(AMPC_ERR_STATE, "%s %s is already a child of another module", child->vt->type, name);
    int rc = list_push(&m->children, name, child);
    if (rc < 0) {
        ampc_module_free(child);
        return rc;
    }
    child->parent = m;
    ampc__module_invalidate(m);
    return AMPC_OK;
}

int ampc__module_tie_param(ampc_module *m, const char *name, ampc_tensor *t) {
    for (int i = 0; i < m->params.n; i++)
        if (!strcmp(m->params.names[i], name)) {
            ampc_tensor *old = m->params.items[i];
            if (!ampc__same_shape(old, t) || old->dtype != t->dtype)
                return ampc__err(AMPC_ERR_SHAPE, "%s: the tied parameter %s differs in shape or dtype", m->vt->type, name);
            m->params.items[i] = ampc__retain(t);
            ampc__release(old);
            ampc__module_invalidate(m);
            return AMPC_OK;
        }
    return ampc__err(AMPC_ERR_INVALID, "%s has no parameter %s to tie", m->vt->type, name);
}

ampc_tensor *ampc__module_param(const ampc_module *m, const char *name) { return list_find(&m->params, name); }
ampc_tensor *ampc__module_buffer(const ampc_module *m, const char *name) { return list_find(&m->buffers, name); }

ampc_dtype ampc__param_dtype(void) {
    return ampc__device_float(ampc__default_device());
}

ampc_tensor *ampc__param_uniform(int ndim, const int64_t *shape, double bound) {
    ampc_mem_kind prev = ampc__mem_kind_push(AMPC_MEM_PARAMETERS);
    ampc_tensor *t = ampc_tensor_rand(ampc__param_dtype(), ndim, shape, -bound, bound);
    ampc__mem_kind_pop(prev);
    return t;
}

ampc_tensor *ampc__param_normal(int ndim, const int64_t *shape, double std) {
    ampc_mem_kind prev = ampc__mem_kind_push(AMPC_MEM_PARAMETERS);
    ampc_tensor *t = std > 0 ? ampc_tensor_randn(ampc__param_dtype(), ndim, shape, 0.0, std) : ampc_tensor_zeros(ampc__param_dtype(), ndim, shape);
    ampc__mem_kind_pop(prev);
    return t;
}

void ampc_module_free(ampc_module *m) {
    if (!m || check_module(m, "ampc_module_free") < 0) return;
    if (m->parent) {   /* its parent would keep a dangling child */
        ampc__err(AMPC_ERR_STATE, "ampc_module_free: this %s is a child of a %s; free the root module (or replace the child)",
                  m->vt->type, m->parent->vt->type);
        return;
    }
    if (m->vt->free) m->vt->free(m);
    for (int i = 0; i < m->children.n; i++) {
        ampc_module *c = m->children.items[i];
        c->parent = NULL;
        ampc_module_free(c);
    }
    for (int i = 0; i < m->params.n; i++) ampc__release(m->params.items[i]);
    for (int i = 0; i < m->buffers.n; i++) ampc__release(m->buffers.items[i]);
    list_free_names(&m->children);
    list_free_names(&m->params);
    list_free_names(&m->buffers);
    flat_free(&m->flat_params);
    flat_free(&m->flat_state);
    m->gen = 0;
    ampc__handle_pool_put(&module_pool, m);
}

// ---------------------------------------------------------------------------------------------
// Public accessors

ampc_tensor *ampc_module_forward(ampc_module *m, ampc_tensor *x) {
    if (!m) return ampc__err_null(AMPC_ERR_INVALID, "forward of a NULL module");
    if (check_module(m, "ampc_module_forward") < 0) return NULL;
    if (!x) {   /* keep the error that produced the NULL input */
        if (!ampc_last_status()) ampc__err(AMPC_ERR_INVALID, "%s: input is NULL", m->vt->type);
        return NULL;
    }
    if (ampc__check_tensor(x, "ampc_module_forward") < 0) return NULL;
    /* The forward's intermediates belong to this scope; only the output leaves it. Whatever
       the autograd graph saved stays alive through the graph's own references. */
    /* tracing (the numerics doctor, --explain): the ops below run under this module's path */
    size_t token = SIZE_MAX;
    if (m->parent && ampc__trace_paths_on())
        for (int i = 0; i < m->parent->children.n; i++)
            if (m->parent->children.items[i] == m) token = ampc__trace_module_push(m->parent->children.names[i]);
    ampc_scope_begin();
    ampc_tensor *y = m->vt->forward(m, x);
    if (y && y != x) ampc_tensor_keep(y);
    ampc_scope_end();
    ampc__trace_module_pop(token);
    return y;
}

void ampc_module_train(ampc_module *m, bool training) {
    if (check_module(m, "ampc_module_train") < 0) return;
    m->training = training;
    for (int i = 0; i < m->children.n; i++) ampc_module_train(m->children.items[i], training);
}

bool ampc_module_is_training(const ampc_module *m) { return check_module(m, "ampc_module_is_training") >= 0 && m->training; }
const char *ampc_module_type(const ampc_module *m) { return check_module(m, "ampc_module_type") < 0 ? NULL : m->vt->type; }
int ampc_module_num_children(const ampc_module *m) {
    int rc = check_module(m, "ampc_module_num_children");
    return rc < 0 ? (m ? rc : 0) : m->children.n;   /* NULL: 0 children, as before */
}

ampc_module *ampc_module_child(ampc_module *m, int i) {
    if (check_module(m, "ampc_module_child") < 0 || i < 0 || i >= m->children.n) return NULL;
    return m->children.items[i];
}

int ampc_module_parameters(ampc_module *m, ampc_tensor ***params, const char ***names) {
    int rc = check_module(m, "ampc_module_parameters");
    return rc < 0 ? rc : flat_get(m, &m->flat_params, false, params, names);
}

int ampc__module_state_dict(ampc_module *m, ampc_tensor ***tensors, const char ***names) {
    int rc = check_module(m, "ampc_module_state_dict");
    return rc < 0 ? rc : flat_get(m, &m->flat_state, true, tensors, names);
}

int64_t ampc_module_num_parameters(ampc_module *m, bool trainable_only) {
    ampc_tensor **p;
    int n = ampc_module_parameters(m, &p, NULL);
    if (n < 0) return n;
    int64_t total = 0;
    for (int i = 0; i < n; i++)
        if (!trainable_only || p[i]->requires_grad) total += p[i]->numel;
    return total;
}

void ampc_module_requires_grad(ampc_module *m, bool on) {
    if (check_module(m, "ampc_module_requires_grad") < 0) return;
    for (int i = 0; i < m->params.n; i++) ((ampc_tensor *)m->params.items[i])->requires_grad = on;
    for (int i = 0; i < m->children.n; i++) ampc_module_requires_grad(m->children.items[i], on);
}

// ---------------------------------------------------------------------------------------------
// Paths: find, replace, state_dict (transfer learning: freeze a backbone, swap its head)

ampc_module *ampc__module_get_child(const ampc_module *m, const char *name) { return list_find(&m->children, name); }

ampc_tensor *ampc__child_forward(ampc_module *m, const char *name, ampc_tensor *x) {
    ampc_module *c = ampc__module_get_child(m, name);
    if (!c) return ampc__err_null(AMPC_ERR_STATE, "%s has no submodule '%s'", m->vt->type, name);
    return ampc_module_forward(c, x);
}

/* The submodule at path[0..len) (dotted), or NULL + error naming the missing component. */
static ampc_module *find_prefix(ampc_module *m, const char *path, size_t len) {
    ampc_module *cur = m;
    size_t start = 0;
    while (start < len) {
        size_t end = start;
        while (end < len && path[end] != '.') end++;
        char name[256];
        if (end == start || end - start >= sizeof name)
            return ampc__err_null(AMPC_ERR_INVALID, "bad module path '%s': %s component", path,
                                  end == start ? "empty" : "over-long");
        memcpy(name, path + start, end - start);
        name[end - start] = '\0';
        ampc_module *next = list_find(&cur->children, name);
        if (!next)
            return ampc__err_null(AMPC_ERR_INVALID, "%s has no submodule '%s' (in module path '%s')", cur->vt->type, name, path);
        cur = next;
        start = end + 1;
        if (end + 1 == len)   /* a trailing dot */
            return ampc__err_null(AMPC_ERR_INVALID, "bad module path '%s': empty component", path);
    }
    return cur;
}

/* Like PyTorch's get_submodule: "" is m itself. */
ampc_module *ampc_module_find(ampc_module *m, const char *path) {
    if (!m || !path) return ampc__err_null(AMPC_ERR_INVALID, "ampc_module_find: %s is NULL", m ? "path" : "module");
    if (check_module(m, "ampc_module_find") < 0) return NULL;
    return find_prefix(m, path, strlen(path));
}

/* Takes ownership of replacement: on error it is freed too, unless it already belongs to a
   module tree (it has a parent, or is an ancestor of the place it would go). */
int ampc_module_replace(ampc_module *m, const char *path, ampc_module *replacement) {
    if (!replacement) {   /* keep the error of the constructor that returned NULL */
        if (!ampc_last_status()) ampc__err(AMPC_ERR_INVALID, "ampc_module_replace: replacement is NULL");
        return ampc_last_status();
    }
    if (check_module(replacement, "ampc_module_replace") < 0 || (m && check_module(m, "ampc_module_replace") < 0))
        return ampc_last_status();   /* nothing freed: a stale handle is no module to free */
    if (replacement->parent)
        return ampc__err(AMPC_ERR_STATE, "ampc_module_replace: the %s replacement is already a child of another module",
                         replacement->vt->type);
    int rc = AMPC_OK;
    ampc_module *parent = NULL;
    const char *leaf = NULL;
    if (!m || !path || !*path) {
        rc = ampc__err(AMPC_ERR_INVALID, "ampc_module_replace: %s", !m ? "module is NULL" : "empty path (cannot replace the root)");
    } else {
        const char *dot = strrchr(path, '.');
        parent = dot ? find_prefix(m, path, (size_t)(dot - path)) : m;
        leaf = dot ? dot + 1 : path;
        if (!parent) rc = ampc_last_status();
    }
    int idx = -1;
    if (rc >= 0) {
        for (int i = 0; i < parent->children.n; i++)
            if (!strcmp(parent->children.names[i], leaf)) idx = i;
        if (idx < 0)
            rc = ampc__err(AMPC_ERR_INVALID, "%s has no submodule '%s' (in module path '%s')", parent->vt->type,
                           *leaf ? leaf : "(empty)", path);
    }
    if (rc >= 0)
        for (ampc_module *a = parent; a; a = a->parent)
            if (a == replacement)   /* would make a cycle; it is in use, so not freed */
                return ampc__err(AMPC_ERR_STATE, "ampc_module_replace: the replacement contains '%s'", path);
    if (rc < 0) {
        ampc_module_free(replacement);
        return rc;
    }
    ampc_module *old = parent->children.items[idx];
    old->parent = NULL;
    ampc_module_free(old);
    parent->children.items[idx] = replacement;   /* same name, same place in the order */
    replacement->parent = parent;
    ampc__module_invalidate(parent);
    return AMPC_OK;
}

int ampc_module_state_dict(ampc_module *m, ampc_tensor ***tensors, const char ***names) {
    return ampc__module_state_dict(m, tensors, names);
}

int ampc_module_to(ampc_module *m, ampc_device dev) {
    int rc = check_module(m, "ampc_module_to");
    if (rc < 0) return rc;
    const char *why = ampc_device_unavailable_reason(dev);
    if (why) return ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_module_to: device %s: %s", ampc_device_name(dev), why);
    ampc_tensor **ts;
    int n = ampc__module_state_dict(m, &ts, NULL);
    for (int i = 0; i < n && rc >= 0; i++) {
        rc = ampc__tensor_move(ts[i], dev);
        if (rc >= 0 && ts[i]->grad) rc = ampc__tensor_move(ts[i]->grad, dev);
    }
    return n < 0 ? n : rc;
}

// ---------------------------------------------------------------------------------------------
// Sequential

/* Each intermediate is dropped as soon as the next child has consumed it (what the graph saved
   stays alive through the graph): the forward's peak holds the saved tensors plus one layer's
   input and output, not every intermediate of the sequence. */
static ampc_tensor *sequential_forward(ampc_module *m, ampc_tensor *x) {
    ampc_tensor *h = x;
    for (int i = 0; i < m->children.n && h; i++) {
        ampc_tensor *next = ampc_module_forward(m->children.items[i], h);
        if (h != x && next != h) ampc_tensor_free(h);
        h = next;
    }
    return h;
}

static const ampc_module_vtable sequential_vtable = {"Sequential", sequential_forward, NULL};

ampc_module *ampc_sequential_from(int n, ampc_module **children) {
    int bad = -1;
    if (n < 0 || (n > 0 && !children)) {
        ampc__err(AMPC_ERR_INVALID, "Sequential of %d children", n);
        bad = 0;
    }
    for (int i = 0; bad < 0 && i < n; i++)
        if (!children[i]) bad = i;
    ampc_module *m = NULL;
    if (bad < 0) {
        m = ampc__module_new(&sequential_vtable);
        if (!m) bad = 0;
    } else if (!ampc_last_status()) {
        ampc__err(AMPC_ERR_INVALID, "Sequential: child %d is NULL", bad);
    }
    if (bad >= 0) {   /* the first error stays; every child given is freed */
        for (int i = 0; i < n && children; i++) ampc_module_free(children[i]);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        char name[16];
        snprintf(name, sizeof name, "%d", i);
        if (ampc__module_add_child(m, name, children[i]) < 0) {   /* it freed children[i] */
            for (int j = i + 1; j < n; j++) ampc_module_free(children[j]);
            ampc_module_free(m);
            return NULL;
        }
    }
    return m;
}

ampc_module *ampc_sequential(int n, ...) {
    if (n < 0) return ampc__err_null(AMPC_ERR_INVALID, "Sequential of %d children", n);
    ampc_module **c = malloc((size_t)(n ? n : 1) * sizeof *c);
    va_list ap;
    va_start(ap, n);
    for (int i = 0; i < n; i++) {
        ampc_module *x = va_arg(ap, ampc_module *);
        if (c) c[i] = x;
        else ampc_module_free(x);
    }
    va_end(ap);
    if (!c) return ampc__err_null(AMPC_ERR_OOM, "Sequential of %d children", n);
    ampc_module *m = ampc_sequential_from(n, c);
    free(c);
    return m;
}
