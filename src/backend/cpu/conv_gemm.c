/*
 * conv_gemm.c - channels-last stride-1 1x1 convolutions as one oneDNN matmul (no reorder).
 *
 * An ungrouped, unpadded, stride-1 1x1 convolution of NHWC activations is one matrix product
 * over the M = N*H*W pixels: x is (M, C) row-major, y (M, O), and the OIHW weights are (O, C)
 * row-major, so every operand is used in place by a matmul primitive (transposes are strides):
 *   forward          y  (M, O) = x (M, C)  @ w^T (C, O)   (+ bias)
 *   backward data    gx (M, C) = gy (M, O) @ w   (O, C)
 *   backward weights gw (O, C) = gy^T (O, M) @ x (M, C)  (into the f32 or 16-bit gw directly)
 * The bias gradient is a column sum, which a matmul cannot add: with a bias, backward weights
 * stays a convolution.
 */
#include "backend/cpu/conv.h"

/* (rows, cols), stored row-major or (trans) as its row-major transpose. */
dnnl_status_t ampc__conv_mat_md(dnnl_memory_desc_t *md, dnnl_data_type_t dt, int64_t rows, int64_t cols, bool trans) {
    dnnl_dims_t dims = {rows, cols}, strides = {trans ? 1 : cols, trans ? rows : 1};
    return dnnl_memory_desc_init_by_strides(md, 2, dims, dt, strides);
}

/* The matmul of pass family; arguments src, weights, dst[, bias] as ampc__conv_run_gemm passes them. */
static int gemm_pd(ampc_dnnl_entry *e, const conv_key *k, int family) {
    int rc = AMPC_OK;
    int64_t M = k->N * k->OH * k->OW;
    bool bias = family == AMPC_DNNL_CONV_FWD && k->has_bias;
    dnnl_memory_desc_t a, b, c, bmd;
    switch (family) {
    case AMPC_DNNL_CONV_FWD:
        AMPC_DNNL_TRY(ampc__conv_mat_md(&a, k->dt, M, k->C, false), "x descriptor");
        AMPC_DNNL_TRY(ampc__conv_mat_md(&b, k->dt, k->C, k->O, true), "w descriptor");
        AMPC_DNNL_TRY(ampc__conv_mat_md(&c, k->dt, M, k->O, false), "y descriptor");
        AMPC_DNNL_TRY(ampc__conv_mat_md(&bmd, k->dt, 1, k->O, false), "bias descriptor");
        break;
    case AMPC_DNNL_CONV_BWD_DATA:
        AMPC_DNNL_TRY(ampc__conv_mat_md(&a, k->dt, M, k->O, false), "gy descriptor");
        AMPC_DNNL_TRY(ampc__conv_mat_md(&b, k->dt, k->O, k->C, false), "w descriptor");
        AMPC_DNNL_TRY(ampc__conv_mat_md(&c, k->dt, M, k->C, false), "gx descriptor");
        break;
    default:
        AMPC_DNNL_TRY(ampc__conv_mat_md(&a, k->dt, k->O, M, true), "gy descriptor");
        AMPC_DNNL_TRY(ampc__conv_mat_md(&b, k->dt, M, k->C, false), "x descriptor");
        AMPC_DNNL_TRY(ampc__conv_mat_md(&c, k->grad_f32 ? dnnl_f32 : k->dt, k->O, k->C, false), "gw descriptor");
    }
    dnnl_matmul_desc_t op;
    AMPC_DNNL_TRY(dnnl_matmul_desc_init(&op, &a, &b, bias ? &bmd : NULL, &c), "matmul_desc_init");
    AMPC_DNNL_TRY(dnnl_primitive_desc_create(&e->pd, &op, ampc__dnnl_attr(), ampc__dnnl_engine(), NULL),
                  "convolution as matmul primitive_desc_create");
    if ((rc = ampc__dnnl_add_arg(e, DNNL_ARG_SRC, &a)) < 0 || (rc = ampc__dnnl_add_arg(e, DNNL_ARG_WEIGHTS, &b)) < 0 ||
        (rc = ampc__dnnl_add_arg(e, DNNL_ARG_DST, &c)) < 0)
        return rc;
    return bias ? ampc__dnnl_add_arg(e, DNNL_ARG_BIAS, &bmd) : AMPC_OK;
fail:
    return rc;
}

static int build_gemm_fwd(ampc_dnnl_entry *e, const void *key) { return gemm_pd(e, key, AMPC_DNNL_CONV_FWD); }
static int build_gemm_bwd_data(ampc_dnnl_entry *e, const void *key) { return gemm_pd(e, key, AMPC_DNNL_CONV_BWD_DATA); }
static int build_gemm_bwd_weights(ampc_dnnl_entry *e, const void *key) { return gemm_pd(e, key, AMPC_DNNL_CONV_BWD_WEIGHTS); }

ampc_dnnl_build_fn ampc__conv_gemm_builder(int family) {
    return family == AMPC_DNNL_CONV_FWD ? build_gemm_fwd : family == AMPC_DNNL_CONV_BWD_DATA ? build_gemm_bwd_data
                                                                                            : build_gemm_bwd_weights;
}

/* Runs the gemm of pass family on the user's buffers (arg_spec order; lock held). */
int ampc__conv_run_gemm(int family, const conv_key *k, void *const *user) {
    ampc_dnnl_entry *e = ampc__dnnl_get(family, k, sizeof *k, ampc__conv_gemm_builder(family));
    if (!e) return ampc_last_status();
    if (family != AMPC_DNNL_CONV_BWD_WEIGHTS) return ampc__dnnl_run(e, user);
    return ampc__dnnl_run(e, (void *[]){user[1], user[0], user[2]});   /* gy^T @ x */
}
