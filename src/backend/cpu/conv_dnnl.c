/*
 * conv_dnnl.c - convolution passes on oneDNN's convolution primitives: the keys' descriptors,
 * the primitive builders, the cached reorders between the user's layouts and the ones oneDNN
 * picks, and running a pass with them (conv.c's overview says when each layout is used).
 */
#include "backend/cpu/conv.h"

#include <string.h>

// ---------------------------------------------------------------------------------------------
// Descriptors

static const arg_spec FWD_ARGS[] = {{DNNL_ARG_SRC, ROLE_SRC, false, false}, {DNNL_ARG_WEIGHTS, ROLE_WEI, false, false},
                                    {DNNL_ARG_DST, ROLE_DST, true, false}, {DNNL_ARG_BIAS, ROLE_BIAS, false, false}};
static const arg_spec BWD_DATA_ARGS[] = {{DNNL_ARG_DIFF_DST, ROLE_DST, false, false},
                                         {DNNL_ARG_WEIGHTS, ROLE_WEI, false, false},
                                         {DNNL_ARG_DIFF_SRC, ROLE_SRC, true, false}};
static const arg_spec BWD_WEIGHTS_ARGS[] = {{DNNL_ARG_SRC, ROLE_SRC, false, false}, {DNNL_ARG_DIFF_DST, ROLE_DST, false, false},
                                            {DNNL_ARG_DIFF_WEIGHTS, ROLE_WEI, true, true},
                                            {DNNL_ARG_DIFF_BIAS, ROLE_BIAS, true, true}};

const arg_spec *ampc__conv_family_args(int family, int *n, const conv_key *k) {
    switch (family) {
    case AMPC_DNNL_CONV_FWD: *n = k->has_bias ? 4 : 3; return FWD_ARGS;
    case AMPC_DNNL_CONV_BWD_DATA: *n = 3; return BWD_DATA_ARGS;
    default: *n = k->has_bias ? 4 : 3; return BWD_WEIGHTS_ARGS;
    }
}

/* Activations: NHWC as the user stores them when channels-last (the kernels take it as is),
   else plain NCHW or "any". */
static dnnl_format_tag_t act_tag(const conv_key *k, bool any) {
    if (k->cl && (k->cl_reorder || k->wino)) return any ? dnnl_format_tag_any : dnnl_nhwc;
    return k->cl ? dnnl_nhwc : any ? dnnl_format_tag_any : dnnl_nchw;
}

/* Descriptor of an operand with the given role: plain NCHW / OIHW / GOIHW / (O) when tag is
   not any, else "any" (oneDNN chooses; the bias stays plain). */
static dnnl_status_t role_md(dnnl_memory_desc_t *md, const conv_key *k, arg_role role, dnnl_data_type_t dt, bool any) {
    dnnl_dims_t dims = {0};
    switch (role) {
    case ROLE_SRC:
        dims[0] = k->N, dims[1] = k->C, dims[2] = k->H, dims[3] = k->W;
        return dnnl_memory_desc_init_by_tag(md, 4, dims, dt, act_tag(k, any));
    case ROLE_DST:
        dims[0] = k->N, dims[1] = k->O, dims[2] = k->OH, dims[3] = k->OW;
        return dnnl_memory_desc_init_by_tag(md, 4, dims, dt, act_tag(k, any));
    case ROLE_WEI:
        if (k->groups > 1) {
            dims[0] = k->groups, dims[1] = k->O / k->groups, dims[2] = k->C / k->groups, dims[3] = k->KH, dims[4] = k->KW;
            return dnnl_memory_desc_init_by_tag(md, 5, dims, dt, any ? dnnl_format_tag_any : dnnl_goihw);
        }
        dims[0] = k->O, dims[1] = k->C, dims[2] = k->KH, dims[3] = k->KW;
        return dnnl_memory_desc_init_by_tag(md, 4, dims, dt, any ? dnnl_format_tag_any : dnnl_oihw);
    default:
        dims[0] = k->O;
        return dnnl_memory_desc_init_by_tag(md, 1, dims, dt, dnnl_a);
    }
}

/* The user's side of an argument: plain layout in the kernel's dtype (f32 weight and bias
   gradients when the caller gave f32 ones). */
dnnl_status_t ampc__conv_user_md(dnnl_memory_desc_t *md, const conv_key *k, const arg_spec *a) {
    return role_md(md, k, a->role, a->f32 && k->grad_f32 ? dnnl_f32 : k->dt, false);
}

// ---------------------------------------------------------------------------------------------
// Primitive builders

/* Winograd where the key asks for it (and oneDNN has it for the shape: the builders try
   conv_alg(k->wino) and then conv_alg(0)), else direct. */
static dnnl_alg_kind_t conv_alg(int wino) { return wino ? dnnl_convolution_winograd : dnnl_convolution_direct; }

/* The key's geometry as the whole dnnl_dims_t arrays the C API reads. */
typedef struct {
    dnnl_dims_t stride, dil, pad_l, pad_r;
} conv_geom;

static conv_geom geom(const conv_key *k) {
    conv_geom g;
    memset(&g, 0, sizeof g);
    for (int i = 0; i < 2; i++) g.stride[i] = k->stride[i], g.dil[i] = k->dil[i], g.pad_l[i] = k->pad_l[i], g.pad_r[i] = k->pad_r[i];
    return g;
}

/* The primitive descriptor of op: oneDNN's first implementation, or with no_brg the first that
   is neither brgconv nor the reference one (and the first if there is none such). */
static dnnl_status_t create_pd(dnnl_primitive_desc_t *pd, const_dnnl_op_desc_t op, const_dnnl_primitive_desc_t hint,
                               bool no_brg) {
    if (!no_brg) return dnnl_primitive_desc_create(pd, op, ampc__dnnl_attr(), ampc__dnnl_engine(), hint);
    dnnl_primitive_desc_iterator_t it;
    dnnl_status_t st = dnnl_primitive_desc_iterator_create(&it, op, ampc__dnnl_attr(), ampc__dnnl_engine(), hint);
    if (st != dnnl_success) return st;
    dnnl_primitive_desc_t first = NULL;
    *pd = NULL;
    do {
        dnnl_primitive_desc_t p = dnnl_primitive_desc_iterator_fetch(it);
        const char *name = NULL;
        if (!p) break;
        if (dnnl_primitive_desc_query(p, dnnl_query_impl_info_str, 0, &name) == dnnl_success && name &&
            strncmp(name, "brg", 3) && strncmp(name, "ref", 3)) {
            *pd = p;
            break;
        }
        if (first) dnnl_primitive_desc_destroy(p);
        else first = p;
    } while (dnnl_primitive_desc_iterator_next(it) == dnnl_success);
    dnnl_primitive_desc_iterator_destroy(it);
    if (*pd) {
        if (first) dnnl_primitive_desc_destroy(first);
        return dnnl_success;
    }
    *pd = first;
    return first ? dnnl_success : dnnl_unimplemented;
}

/* Forward descriptor (also the hint the backward passes need). */
static int fwd_pd(dnnl_primitive_desc_t *pd, const conv_key *k, bool with_bias) {
    int rc = AMPC_OK;
    bool any = k->blocked;
    dnnl_memory_desc_t src, wei, dst, bias;
    conv_geom g = geom(k);
    AMPC_DNNL_TRY(role_md(&src, k, ROLE_SRC, k->dt, any), "conv src descriptor");
    AMPC_DNNL_TRY(role_md(&wei, k, ROLE_WEI, k->dt, any), "conv weights descriptor");
    AMPC_DNNL_TRY(role_md(&dst, k, ROLE_DST, k->dt, any), "conv dst descriptor");
    AMPC_DNNL_TRY(role_md(&bias, k, ROLE_BIAS, k->dt, false), "conv bias descriptor");
    dnnl_status_t st = dnnl_unimplemented;
    for (int w = k->wino; w >= 0 && st != dnnl_success; w--) {
        dnnl_convolution_desc_t op;
        AMPC_DNNL_TRY(dnnl_dilated_convolution_forward_desc_init(&op, dnnl_forward_training, conv_alg(w), &src, &wei,
                                                                 with_bias ? &bias : NULL, &dst, g.stride, g.dil, g.pad_l,
                                                                 g.pad_r),
                      "convolution_forward_desc_init");
        st = create_pd(pd, &op, NULL, k->no_brg);
    }
    AMPC_DNNL_TRY(st, "convolution forward primitive_desc_create");
    return AMPC_OK;
fail:
    return rc;
}

/* Declares the entry's arguments with the descriptors the primitive chose. */
static int add_args(ampc_dnnl_entry *e, int family, const conv_key *k) {
    int n, rc;
    const arg_spec *args = ampc__conv_family_args(family, &n, k);
    for (int i = 0; i < n; i++) {
        const dnnl_memory_desc_t *md = dnnl_primitive_desc_query_md(e->pd, dnnl_query_exec_arg_md, args[i].arg);
        if (!md) return ampc__err(AMPC_ERR_BACKEND, "oneDNN convolution: no descriptor for argument %d", args[i].arg);
        if ((rc = ampc__dnnl_add_arg(e, args[i].arg, md)) < 0) return rc;
    }
    return AMPC_OK;
}

static int build_fwd(ampc_dnnl_entry *e, const void *key) {
    const conv_key *k = key;
    int rc = fwd_pd(&e->pd, k, k->has_bias);
    return rc < 0 ? rc : add_args(e, AMPC_DNNL_CONV_FWD, k);
}

static int build_bwd_data(ampc_dnnl_entry *e, const void *key) {
    const conv_key *k = key;
    int rc = AMPC_OK;
    dnnl_primitive_desc_t hint = NULL;
    dnnl_memory_desc_t src, wei, dst;
    conv_geom g = geom(k);
    if ((rc = fwd_pd(&hint, k, false)) < 0) return rc;
    AMPC_DNNL_TRY(role_md(&src, k, ROLE_SRC, k->dt, k->blocked), "conv diff_src descriptor");
    AMPC_DNNL_TRY(role_md(&wei, k, ROLE_WEI, k->dt, k->blocked), "conv weights descriptor");
    AMPC_DNNL_TRY(role_md(&dst, k, ROLE_DST, k->dt, k->blocked), "conv diff_dst descriptor");
    dnnl_status_t st = dnnl_unimplemented;
    for (int w = k->wino; w >= 0 && st != dnnl_success; w--) {
        dnnl_convolution_desc_t op;
        AMPC_DNNL_TRY(dnnl_dilated_convolution_backward_data_desc_init(&op, conv_alg(w), &src, &wei, &dst, g.stride, g.dil,
                                                                       g.pad_l, g.pad_r),
                      "convolution_backward_data_desc_init");
        st = dnnl_primitive_desc_create(&e->pd, &op, ampc__dnnl_attr(), ampc__dnnl_engine(), hint);
    }
    AMPC_DNNL_TRY(st, "convolution backward data primitive_desc_create");
    rc = add_args(e, AMPC_DNNL_CONV_BWD_DATA, k);
fail:
    dnnl_primitive_desc_destroy(hint);
    return rc;
}

int ampc__conv_build_bwd_weights(ampc_dnnl_entry *e, const void *key) {
    const conv_key *k = key;
    int rc = AMPC_OK;
    dnnl_primitive_desc_t hint = NULL;
    dnnl_memory_desc_t src, dwei, dst, dbias;
    conv_geom g = geom(k);
    if ((rc = fwd_pd(&hint, k, k->has_bias)) < 0) return rc;
    AMPC_DNNL_TRY(role_md(&src, k, ROLE_SRC, k->dt, k->blocked), "conv src descriptor");
    AMPC_DNNL_TRY(role_md(&dwei, k, ROLE_WEI, dnnl_f32, k->blocked), "conv diff_weights descriptor");
    AMPC_DNNL_TRY(role_md(&dst, k, ROLE_DST, k->dt, k->blocked), "conv diff_dst descriptor");
    AMPC_DNNL_TRY(role_md(&dbias, k, ROLE_BIAS, dnnl_f32, false), "conv diff_bias descriptor");
    dnnl_status_t st = dnnl_unimplemented;
    for (int w = k->wino; w >= 0 && st != dnnl_success; w--) {
        dnnl_convolution_desc_t op;
        AMPC_DNNL_TRY(dnnl_dilated_convolution_backward_weights_desc_init(&op, conv_alg(w), &src, &dwei,
                                                                          k->has_bias ? &dbias : NULL, &dst, g.stride, g.dil,
                                                                          g.pad_l, g.pad_r),
                      "convolution_backward_weights_desc_init");
        st = dnnl_primitive_desc_create(&e->pd, &op, ampc__dnnl_attr(), ampc__dnnl_engine(), hint);
    }
    AMPC_DNNL_TRY(st, "convolution backward weights primitive_desc_create");
    rc = add_args(e, AMPC_DNNL_CONV_BWD_WEIGHTS, k);
fail:
    dnnl_primitive_desc_destroy(hint);
    return rc;
}

/* The reorder's two descriptors come from the convolution entry; the key (conv key + argument)
   identifies them but cannot hold them, so the caller parks them here (lock held). */
static const dnnl_memory_desc_t *reorder_from, *reorder_to;

static int build_reorder(ampc_dnnl_entry *e, const void *key) {
    (void)key;
    int rc = AMPC_OK;
    AMPC_DNNL_TRY(dnnl_reorder_primitive_desc_create(&e->pd, reorder_from, ampc__dnnl_engine(), reorder_to,
                                                     ampc__dnnl_engine(), ampc__dnnl_attr()),
                  "reorder primitive_desc_create");
    if ((rc = ampc__dnnl_add_arg(e, DNNL_ARG_FROM, reorder_from)) < 0) return rc;
    return ampc__dnnl_add_arg(e, DNNL_ARG_TO, reorder_to);
fail:
    return rc;
}

/* The builder of pass family's primitive for k: im2col's or the gemm's matmul, or the
   convolution. */
ampc_dnnl_build_fn ampc__conv_builder(int family, const conv_key *k) {
    if (k->im2col) return ampc__conv_i2c_builder(family);
    if (k->gemm) return ampc__conv_gemm_builder(family);
    return family == AMPC_DNNL_CONV_FWD ? build_fwd : family == AMPC_DNNL_CONV_BWD_DATA ? build_bwd_data : ampc__conv_build_bwd_weights;
}

// ---------------------------------------------------------------------------------------------
// Running a pass

/* The cached reorder from -> to for argument arg of pass family of k. Lock held. */
ampc_dnnl_entry *ampc__conv_reorder_entry(const conv_key *k, int family, int arg, const dnnl_memory_desc_t *from,
                                      const dnnl_memory_desc_t *to) {
    reorder_key rk;
    memset(&rk, 0, sizeof rk);
    rk.conv = *k;
    rk.family = family;
    rk.arg = arg;
    reorder_from = from;
    reorder_to = to;
    return ampc__dnnl_get(AMPC_DNNL_REORDER, &rk, sizeof rk, build_reorder);
}

/* Runs pass `family` of k on the user's plain buffers (one per argument, in arg_spec order):
   inputs reordered into workspace where the primitive wants another layout or dtype, outputs
   reordered back. Lock held. */
int ampc__conv_run_dnnl(int family, const conv_key *k, void *const *user) {
    int n, rc = AMPC_OK;
    const arg_spec *args = ampc__conv_family_args(family, &n, k);
    ampc_dnnl_entry *e = ampc__dnnl_get(family, k, sizeof *k, ampc__conv_builder(family, k));
    if (!e) return ampc_last_status();
    dnnl_memory_desc_t pmd[AMPC_DNNL_MAX_ARGS], umd[AMPC_DNNL_MAX_ARGS];
    ampc_dnnl_entry *reo[AMPC_DNNL_MAX_ARGS] = {0};
    size_t off[AMPC_DNNL_MAX_ARGS] = {0}, total = 0, block = 0;
    for (int i = 0; i < n; i++) {
        const dnnl_memory_desc_t *md;
        AMPC_DNNL_TRY(dnnl_memory_get_memory_desc(e->mem[i], &md), "memory_get_memory_desc");
        pmd[i] = *md;
        AMPC_DNNL_TRY(ampc__conv_user_md(&umd[i], k, &args[i]), "user descriptor");
        if (dnnl_memory_desc_equal(&pmd[i], &umd[i])) continue;
        off[i] = total;
        total += ampc__conv_align64(dnnl_memory_desc_get_size(&pmd[i]));
    }
    /* reorders (entries touched after e; e stays the most recent but them, so not evicted) */
    for (int i = 0; i < n; i++) {
        if (dnnl_memory_desc_equal(&pmd[i], &umd[i])) continue;
        reo[i] = args[i].output ? ampc__conv_reorder_entry(k, family, args[i].arg, &pmd[i], &umd[i])
                                : ampc__conv_reorder_entry(k, family, args[i].arg, &umd[i], &pmd[i]);
        if (!reo[i]) return ampc_last_status();
    }
    char *ws = NULL;
    if (total) {
        ws = ampc__alloc(AMPC_DEVICE_CPU, total, AMPC_MEM_WORKSPACE, &block);
        if (!ws) return ampc_last_status();
    }
    void *handles[AMPC_DNNL_MAX_ARGS];
    for (int i = 0; i < n && rc >= 0; i++) {
        handles[i] = reo[i] ? ws + off[i] : user[i];
        if (reo[i] && !args[i].output) rc = ampc__dnnl_run(reo[i], (void *[]){user[i], handles[i]});
    }
    if (rc >= 0) rc = ampc__dnnl_run(e, handles);
    for (int i = 0; i < n && rc >= 0; i++)
        if (reo[i] && args[i].output) rc = ampc__dnnl_run(reo[i], (void *[]){handles[i], user[i]});
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return rc;
fail:
    return rc;
}
