/*
 * common.c - the op front door, the weight-gradient kernel calls, and the recorded one-input
 * ops (cast, memory format, alias).
 */
#include "ops/ops.h"

#include <string.h>

// ---------------------------------------------------------------------------------------------
// Front door

/* Inputs the op table does not let stay channels-last (its channels-last column: kernels
   exist for that layout), and every input on a backend without channels-last kernels, are
   converted to contiguous first (a recorded conversion: gradients come back in the caller's
   format), so no kernel ever reads a layout it was not written for. Elementwise ops take
   channels-last only when every input has one shape and format (their kernels walk storage in
   order). */
static int channels_last_inputs(ampc_op op, ampc_op_args *a) {
    unsigned ok = 0, cl = 0;
    for (int i = 0; i < a->n; i++)
        if (a->in[i] && ampc__is_cl(a->in[i])) cl |= 1u << i;
    if (!cl) return AMPC_OK;
    const ampc_tensor *first = NULL;
    if (ampc__backend_channels_last(a->in[0] ? a->in[0]->device : AMPC_DEVICE_CPU)) {
        ok = ampc_op_channels_last_inputs(op);
        /* the elementwise ones: every input of one shape and format, or none stays */
        for (int i = 0; i < a->n && ok > 1; i++) {
            if (!a->in[i]) continue;
            if (!first) first = a->in[i];
            else if (!ampc__same_shape(first, a->in[i]) || first->format != a->in[i]->format) ok = 0;
        }
    }
    for (int i = 0; i < a->n; i++) {
        if (!(cl & ~ok & (1u << i))) continue;
        ampc_tensor *c = ampc__format_record(a->in[i], AMPC_CONTIGUOUS_FORMAT);
        if (!c) return ampc_last_status();
        ampc__release(a->in[i]);
        a->in[i] = c;
    }
    return AMPC_OK;
}

static _Atomic ampc_autocast_hook autocast_hook;

void ampc__ops_set_autocast_hook(ampc_autocast_hook hook) { atomic_store(&autocast_hook, hook); }

int ampc__op_prepare(ampc_op op, ampc_op_args *a, int n, ampc_tensor *const *inputs, unsigned optional_mask) {
    memset(a, 0, sizeof *a);
    a->op = op;
    a->n = n;
    const ampc_tensor *first = NULL;
    for (int i = 0; i < n; i++) {
        const ampc_tensor *t = inputs[i];
        if (!t) {
            if (optional_mask & (1u << i)) continue;
            if (ampc_last_status() == 0) ampc__err(AMPC_ERR_INVALID, "%s: input %d is NULL", ampc_op_name(op), i);
            return ampc_last_status();
        }
        if (!t->gen) return ampc__check_tensor(t, ampc_op_name(op));   /* a stale handle: freed, or its scope ended */
        if (first && t->device != first->device)
            return ampc__err(AMPC_ERR_INVALID, "%s: inputs on devices %s and %s", ampc_op_name(op),
                             ampc_device_name(first->device), ampc_device_name(t->device));
        if (!first) first = t;
    }
    for (int i = 0; i < n; i++) a->in[i] = ampc__retain(a->src[i] = inputs[i]);
    ampc_autocast_hook autocast = atomic_load(&autocast_hook);
    int rc = autocast ? autocast(op, a->in, n) : AMPC_OK;
    if (rc >= 0) rc = channels_last_inputs(op, a);
    if (rc < 0) ampc__op_args_release(a);
    return rc;
}

ampc_tensor *ampc__input_to_save(const ampc_op_args *a, int i) {
    const ampc_tensor *s = a->src[i], *t = a->in[i];
    bool recast = s && t && s != t && s->dtype != t->dtype && s->format == t->format && s->numel == t->numel &&
                  !s->requires_grad && !s->grad_fn && atomic_load(&s->storage->refcount) > 1;
    return recast ? a->src[i] : a->in[i];
}

void ampc__op_args_release(ampc_op_args *a) {
    for (int i = 0; i < a->n; i++) {
        ampc__release(a->in[i]);
        a->in[i] = NULL;
    }
}

ampc_tensor *ampc__op_finish(ampc_op_args *a, ampc_tensor *out, ampc_node *node) {
    if (out && ampc__trace_on()) {   /* the observer sees the op before its inputs go */
        ampc__trace_event e = {.backward = false, .name = ampc_op_name(a->op), .op = (int)a->op,
                               .module = ampc__trace_module_path(), .n_in = a->n, .n_out = 1, .out = {out}};
        for (int i = 0; i < a->n && i < AMPC_TRACE_MAX; i++) {
            e.src[i] = a->src[i];
            e.in[i] = a->in[i];
        }
        ampc__trace_emit(&e);
    }
    ampc__op_args_release(a);
    if (!out) {
        ampc__node_release(node);
        return NULL;
    }
    if (node) ampc__node_attach(node, out);
    return ampc__scope_adopt(out);
}

int ampc__norm_dim(int dim, int ndim, int *out) {
    int d = dim < 0 ? dim + ndim : dim;
    if (d < 0 || d >= (ndim ? ndim : 1))
        return ampc__err(AMPC_ERR_INVALID, "dim %d out of range for %d dimensions", dim, ndim);
    *out = d;
    return AMPC_OK;
}

int ampc__check_float(const ampc_tensor *t, const char *op, const char *what) {
    if (!ampc__dt(t->dtype)->is_float)
        return ampc__err(AMPC_ERR_DTYPE, "%s: %s must be a float tensor, not %s", op, what, ampc_dtype_name(t->dtype));
    return AMPC_OK;
}

ampc_dtype ampc__wgrad_dtype(const ampc_node *n, int i, ampc_dtype compute) {
    bool narrow = compute == AMPC_BF16 || compute == AMPC_F16;
    return narrow && ampc__grad_dtype(n, i) == AMPC_F32 ? AMPC_F32 : compute;
}

ampc_tensor *ampc__k_wgrad_gemm(const ampc_node *n, int i, const ampc_gemm_desc *d, ampc_tensor *a, ampc_tensor *b,
                                int ndim, const int64_t *out_shape) {
    ampc_mem_kind prev = ampc__mem_kind_push(ampc__grad_kind(n, i));
    ampc_tensor *c = ampc__k_gemm_as(d, a, b, NULL, ampc__wgrad_dtype(n, i, a->dtype), ndim, out_shape);
    ampc__mem_kind_pop(prev);
    return c;
}

ampc_tensor *ampc__k_wgrad_sum_to(const ampc_node *n, int i, ampc_tensor *x, int ndim, const int64_t *shape) {
    ampc_mem_kind prev = ampc__mem_kind_push(ampc__grad_kind(n, i));
    ampc_tensor *s = ampc__k_sum_to_as(x, ampc__wgrad_dtype(n, i, x->dtype), ndim, shape, 1.0);
    ampc__mem_kind_pop(prev);
    return s;
}

// ---------------------------------------------------------------------------------------------
// One-input recorded ops (cast, memory format, alias): y from x, and the node when x needs a
// gradient.

/* Attaches a node (name, fn) over x to y when x needs grad; y, or NULL (y released) when the
   node cannot be made. pass_wide: see ampc_node. y NULL passes through. */
static ampc_tensor *record_unary(ampc_tensor *x, ampc_tensor *y, const char *name, ampc_backward_fn fn, bool pass_wide) {
    if (!y || !ampc__needs_grad(&x, 1)) return y;
    ampc_node *node = ampc__node_new(name, fn, &x, 1);
    if (!node) {
        ampc__release(y);
        return NULL;
    }
    node->pass_wide = pass_wide;
    ampc__node_attach(node, y);
    return y;
}

// ---------------------------------------------------------------------------------------------
// Cast: differentiable; its backward casts the gradient back (fp32 for master weights). A
// narrowing cast keeps its gradient in the wider dtype (pass_wide): weight gradients arrive
// unrounded in fp32 and pass through without a copy.

static int cast_backward(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    gx[0] = ampc__k_cast(gy, n->in[0].dtype);
    return gx[0] ? AMPC_OK : ampc_last_status();
}

ampc_tensor *ampc__cast_record(ampc_tensor *x, ampc_dtype dt) {
    if (x->dtype == dt) return ampc__retain(x);
    if (!ampc__dt(x->dtype)->is_float || !ampc__dt(dt)->is_float)
        return ampc__err_null(AMPC_ERR_DTYPE, "cast from %s to %s", ampc_dtype_name(x->dtype), ampc_dtype_name(dt));
    return ampc__cast_record_done(x, ampc__k_cast(x, dt));
}

ampc_tensor *ampc__cast_record_done(ampc_tensor *x, ampc_tensor *y) {
    return y ? record_unary(x, y, ampc_op_grad_fn(AMPC_OP_CAST), cast_backward, ampc__dt(x->dtype)->size > ampc__dt(y->dtype)->size) : NULL;
}

// ---------------------------------------------------------------------------------------------
// Memory format: the conversion's gradient is gy as it comes; the engine converts it to the
// input's format (ampc_meta.format), as it does for every node.

static int format_backward(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    (void)n;
    gx[0] = ampc__retain(gy);
    return AMPC_OK;
}

ampc_tensor *ampc__format_record(ampc_tensor *x, ampc_memory_format fmt) {
    if (x->format == fmt) return ampc__retain(x);
    return record_unary(x, ampc__k_convert(x, x->dtype, fmt), "ToMemoryFormatBackward", format_backward, false);
}

ampc_tensor *ampc_to_memory_format(ampc_tensor *x, ampc_memory_format fmt) {
    if (!x) return ampc_last_status() ? NULL : ampc__err_null(AMPC_ERR_INVALID, "to_memory_format of NULL");
    if (fmt != AMPC_CONTIGUOUS_FORMAT && fmt != AMPC_CHANNELS_LAST)
        return ampc__err_null(AMPC_ERR_INVALID, "to_memory_format: unknown memory format %d", (int)fmt);
    if (fmt == AMPC_CHANNELS_LAST && x->ndim != 4) {
        char buf[96];
        return ampc__err_null(AMPC_ERR_SHAPE, "to_memory_format: channels-last needs a 4-D (N, C, H, W) tensor, got %s",
                              ampc__shape_str(x, buf, sizeof buf));
    }
    return ampc__scope_adopt(ampc__format_record(x, fmt));
}

// ---------------------------------------------------------------------------------------------
// Aliases: a new header over the same storage (reshape, same-dtype cast); the gradient is gy
// viewed with the input's shape.

static int alias_backward(ampc_node *n, ampc_tensor *gy, ampc_tensor **gx) {
    gx[0] = ampc__tensor_view(gy, n->in[0].ndim, n->in[0].shape);
    return gx[0] ? AMPC_OK : ampc_last_status();
}

ampc_tensor *ampc__alias_record(ampc_tensor *x, int ndim, const int64_t *shape, const char *name) {
    return record_unary(x, ampc__tensor_view(x, ndim, shape), name ? name : "AliasBackward", alias_backward, false);
}

ampc_tensor *ampc_cast(ampc_tensor *x, ampc_dtype dt) {
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_CAST, &a, 1, &x, 0) < 0) return NULL;
    if ((unsigned)dt >= AMPC_DTYPE_COUNT) {
        ampc__op_args_release(&a);
        return ampc__err_null(AMPC_ERR_DTYPE, "cast to unknown dtype %d", (int)dt);
    }
    if (!ampc__device(a.in[0]->device)->dtypes[dt]) {
        ampc__op_args_release(&a);
        return ampc__err_null(AMPC_ERR_DTYPE, "cast to %s on device %s", ampc_dtype_name(dt), ampc_device_name(x->device));
    }
    ampc_tensor *y;
    if (a.in[0]->dtype == dt) return ampc__op_finish(&a, ampc__alias_record(a.in[0], x->ndim, x->shape, NULL), NULL);
    if (!ampc__dt(dt)->is_float || !ampc__dt(a.in[0]->dtype)->is_float) {
        y = ampc__k_cast(a.in[0], dt);   /* no gradient through integer casts */
    } else {
        y = ampc__cast_record(a.in[0], dt);
    }
    return ampc__op_finish(&a, y, NULL);
}

// ---------------------------------------------------------------------------------------------
// Reshape and flatten (views)

ampc_tensor *ampc_reshape(ampc_tensor *x, int ndim, const int64_t *shape) {
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_RESHAPE, &a, 1, &x, 0) < 0) return NULL;
    int64_t s[AMPC_MAX_DIMS], known = 1;
    int infer = -1;
    if (ndim < 0 || ndim > AMPC_MAX_DIMS || !shape) {
        ampc__op_args_release(&a);
        return ampc__err_null(AMPC_ERR_SHAPE, "reshape to %d dimensions", ndim);
    }
    for (int i = 0; i < ndim; i++) {
        s[i] = shape[i];
        if (s[i] == -1 && infer < 0) infer = i;
        else if (s[i] < 0) {
            ampc__op_args_release(&a);
            return ampc__err_null(AMPC_ERR_SHAPE, "reshape: invalid size %lld in dim %d", (long long)s[i], i);
        } else known *= s[i];
    }
    if (infer >= 0) s[infer] = known ? x->numel / known : 0;
    if (ampc__numel(ndim, s) != x->numel) {
        char buf[96];
        ampc__op_args_release(&a);
        return ampc__err_null(AMPC_ERR_SHAPE, "cannot reshape %s (%lld elements) to %d dims of %lld elements",
                              ampc__shape_str(x, buf, sizeof buf), (long long)x->numel, ndim, (long long)ampc__numel(ndim, s));
    }
    return ampc__op_finish(&a, ampc__alias_record(a.in[0], ndim, s, ampc_op_grad_fn(AMPC_OP_RESHAPE)), NULL);
}

// ---------------------------------------------------------------------------------------------
// Permute and transpose (copies: ampc has no strided views); the backward permutes gy back.

static int permute_backward_fn(ampc_node *n, ampc_tensor *gy_in, ampc_tensor **gx) {
    const int nd = n->in[0].ndim;
    int inv[AMPC_MAX_DIMS];
    for (int i = 0; i < nd; i++) inv[n->args.permute.dims[i]] = i;
    ampc_tensor *gy = ampc__k_convert(gy_in, gy_in->dtype, AMPC_CONTIGUOUS_FORMAT);
    ampc_tensor *g = gy ? ampc__tensor_new(gy->dtype, gy->device, nd, n->in[0].shape) : NULL;
    int rc = g ? ampc__k_permute(gy, inv, g) : ampc_last_status();
    ampc__release(gy);
    if (rc < 0) {
        ampc__release(g);
        return rc;
    }
    gx[0] = g;
    return AMPC_OK;
}

ampc_tensor *ampc_permute(ampc_tensor *x, const int *dims) {
    ampc_op_args a;
    if (ampc__op_prepare(AMPC_OP_PERMUTE, &a, 1, &x, 0) < 0) return NULL;
    ampc_tensor *in = a.in[0], *y = NULL;
    int p[AMPC_MAX_DIMS];
    int64_t shape[AMPC_MAX_DIMS];
    unsigned seen = 0;
    for (int i = 0; i < in->ndim; i++) {
        int d = -1;
        if (!dims || ampc__norm_dim(dims[i], in->ndim, &d) < 0 || (seen >> d & 1u)) {
            if (dims && d >= 0) ampc__err(AMPC_ERR_INVALID, "permute: dim %d appears twice in dims", d);
            else if (!dims) ampc__err(AMPC_ERR_INVALID, "permute: no dims");
            return ampc__op_finish(&a, NULL, NULL);
        }
        seen |= 1u << d;
        p[i] = d;
        shape[i] = in->shape[d];
    }
    y = ampc__tensor_new(in->dtype, in->device, in->ndim, shape);
    if (!y || ampc__k_permute(in, p, y) < 0) {
        ampc__release(y);
        return ampc__op_finish(&a, NULL, NULL);
    }
    ampc_node *node = NULL;
    if (ampc__needs_grad(a.in, 1)) {
        node = ampc__node_new(ampc_op_grad_fn(AMPC_OP_PERMUTE), permute_backward_fn, a.in, 1);
        if (!node) {
            ampc__release(y);
            return ampc__op_finish(&a, NULL, NULL);
        }
        memcpy(node->args.permute.dims, p, sizeof(int) * (size_t)in->ndim);
    }
    return ampc__op_finish(&a, y, node);
}

ampc_tensor *ampc_transpose(ampc_tensor *x, int dim0, int dim1) {
    if (!x) return ampc__err_null(AMPC_ERR_INVALID, "transpose of NULL");
    int d0, d1, p[AMPC_MAX_DIMS];
    if (ampc__norm_dim(dim0, x->ndim, &d0) < 0 || ampc__norm_dim(dim1, x->ndim, &d1) < 0) return NULL;
    for (int i = 0; i < x->ndim; i++) p[i] = i;
    p[d0] = d1;
    p[d1] = d0;
    return ampc_permute(x, p);
}

ampc_tensor *ampc_flatten(ampc_tensor *x, int start_dim, int end_dim) {
    if (!x) return NULL;
    int s, e;
    if (x->ndim == 0) return ampc_reshape(x, 1, (int64_t[]){1});
    if (ampc__norm_dim(start_dim, x->ndim, &s) < 0 || ampc__norm_dim(end_dim, x->ndim, &e) < 0) return NULL;
    if (s > e) return ampc__err_null(AMPC_ERR_INVALID, "flatten: start_dim %d after end_dim %d", start_dim, end_dim);
    int64_t shape[AMPC_MAX_DIMS];
    int nd = 0;
    for (int i = 0; i < s; i++) shape[nd++] = x->shape[i];
    int64_t m = 1;
    for (int i = s; i <= e; i++) m *= x->shape[i];
    shape[nd++] = m;
    for (int i = e + 1; i < x->ndim; i++) shape[nd++] = x->shape[i];
    return ampc_reshape(x, nd, shape);
}
