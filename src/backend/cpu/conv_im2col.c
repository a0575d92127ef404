/*
 * conv_im2col.c - channels-last convolutions as im2col + one oneDNN matmul.
 *
 * In NHWC each output pixel's receptive field is KH*KW runs of C contiguous input values, so
 * the columns matrix cols (R = N*OH*OW rows, K = KH*KW*C) is a copy of runs (zeros for the
 * padding), and with the weights as W (O, K) in OHWI order every pass is one matmul:
 *   forward          y       (R, O) = cols (R, K) @ W^T (K, O)   (+ bias), into y in place
 *   backward data    gx_cols (R, K) = gy   (R, O) @ W   (O, K),  then col2im sums into gx
 *   backward weights dW      (O, K) = gy^T (O, R) @ cols (R, K)  (gy^T is a stride, no copy)
 * W is the OIHW weights reordered to OHWI, dW is reordered back to OIHW (f32 accumulation,
 * rounded once for 16-bit gradients), the bias gradient is the column sums of gy. cols (and
 * gx_cols, f32) are bounded by a cap: the batch is split into equal chunks of images, whose
 * backward-weights matmuls accumulate into dW (a sum post-op). Only cl_im2col's shapes
 * (conv_choose.c) run it.
 */
#include "backend/cpu/conv.h"

#include <string.h>

/* The cap on cols' bytes (16 MiB: what splitting costs, bench/NOTES.md, "Convolutions"; at 32 MiB
   the AMX passes' cols raised ResNet-18's peak memory by 5 MiB). Tests lower it to split small
   batches; not thread-safe, not part of the API. */
size_t ampc__cpu_conv_im2col_cap = (size_t)16 << 20;

/* The element size of cols: the operands' dtype, f32 for gx_cols (the matmul's output). */
static size_t i2c_cols_esz(int family, const conv_key *k) {
    return family == AMPC_DNNL_CONV_BWD_DATA || k->dt == dnnl_f32 ? 4 : 2;
}

/* Images per chunk: the fewest equal chunks whose cols fit the cap (at least one image). */
int64_t ampc__conv_i2c_chunk(int family, const conv_key *k) {
    size_t per = (size_t)(k->OH * k->OW * k->KH * k->KW * k->C) * i2c_cols_esz(family, k);
    return ampc__conv_chunk(k->N, per, ampc__cpu_conv_im2col_cap);
}

/* The matmul of pass family for a chunk of k->N images (see above); arguments in run order:
   forward cols, W^T, y[, bias]; backward data gy, W, gx_cols; backward weights gy^T, cols, dW. */
static int i2c_pd(ampc_dnnl_entry *e, const conv_key *k, int family) {
    int rc = AMPC_OK;
    int64_t R = k->N * k->OH * k->OW, K = k->KH * k->KW * k->C;
    bool bias = family == AMPC_DNNL_CONV_FWD && k->has_bias;
    dnnl_memory_desc_t a, b, c, bmd;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    switch (family) {
    case AMPC_DNNL_CONV_FWD:
        AMPC_DNNL_TRY(ampc__conv_mat_md(&a, k->dt, R, K, false), "cols descriptor");
        AMPC_DNNL_TRY(ampc__conv_mat_md(&b, k->dt, K, k->O, true), "w descriptor");
        AMPC_DNNL_TRY(ampc__conv_mat_md(&c, k->dt, R, k->O, false), "y descriptor");
        AMPC_DNNL_TRY(ampc__conv_mat_md(&bmd, k->dt, 1, k->O, false), "bias descriptor");
        break;
    case AMPC_DNNL_CONV_BWD_DATA:
        AMPC_DNNL_TRY(ampc__conv_mat_md(&a, k->dt, R, k->O, false), "gy descriptor");
        AMPC_DNNL_TRY(ampc__conv_mat_md(&b, k->dt, k->O, K, false), "w descriptor");
        AMPC_DNNL_TRY(ampc__conv_mat_md(&c, dnnl_f32, R, K, false), "gx cols descriptor");
        break;
    default:
        AMPC_DNNL_TRY(ampc__conv_mat_md(&a, k->dt, k->O, R, true), "gy descriptor");
        AMPC_DNNL_TRY(ampc__conv_mat_md(&b, k->dt, R, K, false), "cols descriptor");
        AMPC_DNNL_TRY(ampc__conv_mat_md(&c, dnnl_f32, k->O, K, false), "dw descriptor");
    }
    AMPC_DNNL_TRY(dnnl_primitive_attr_create(&attr), "attr_create");
    AMPC_DNNL_TRY(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user), "set_scratchpad_mode");
    if (k->accum) {
        AMPC_DNNL_TRY(dnnl_post_ops_create(&po), "post_ops_create");
        AMPC_DNNL_TRY(dnnl_post_ops_append_sum(po, 1.0f), "post_ops_append_sum");
        AMPC_DNNL_TRY(dnnl_primitive_attr_set_post_ops(attr, po), "set_post_ops");
    }
    dnnl_matmul_desc_t op;
    AMPC_DNNL_TRY(dnnl_matmul_desc_init(&op, &a, &b, bias ? &bmd : NULL, &c), "matmul_desc_init");
    AMPC_DNNL_TRY(dnnl_primitive_desc_create(&e->pd, &op, attr, ampc__dnnl_engine(), NULL),
                  "convolution as im2col matmul primitive_desc_create");
    if ((rc = ampc__dnnl_add_arg(e, DNNL_ARG_SRC, &a)) < 0 || (rc = ampc__dnnl_add_arg(e, DNNL_ARG_WEIGHTS, &b)) < 0 ||
        (rc = ampc__dnnl_add_arg(e, DNNL_ARG_DST, &c)) < 0)
        goto fail;
    if (bias) rc = ampc__dnnl_add_arg(e, DNNL_ARG_BIAS, &bmd);
fail:
    if (po) dnnl_post_ops_destroy(po);
    if (attr) dnnl_primitive_attr_destroy(attr);
    return rc;
}

static int build_i2c_fwd(ampc_dnnl_entry *e, const void *key) { return i2c_pd(e, key, AMPC_DNNL_CONV_FWD); }
static int build_i2c_bwd_data(ampc_dnnl_entry *e, const void *key) { return i2c_pd(e, key, AMPC_DNNL_CONV_BWD_DATA); }
static int build_i2c_bwd_weights(ampc_dnnl_entry *e, const void *key) { return i2c_pd(e, key, AMPC_DNNL_CONV_BWD_WEIGHTS); }

ampc_dnnl_build_fn ampc__conv_i2c_builder(int family) {
    return family == AMPC_DNNL_CONV_FWD ? build_i2c_fwd : family == AMPC_DNNL_CONV_BWD_DATA ? build_i2c_bwd_data
                                                                                          : build_i2c_bwd_weights;
}

/* Input row (h) or column of tap t of output index o, or -1 in the padding. */
static int64_t i2c_in(int64_t o, int64_t t, const conv_key *k, int i, int64_t size) {
    int64_t v = o * k->stride[i] - k->pad_l[i] + t * (k->dil[i] + 1);
    return v >= 0 && v < size ? v : -1;
}

/* cols (nb*OH*OW, KH*KW*C) of images [0, nb) of x (NHWC, esz-byte elements). */
static void im2col(const conv_key *k, int64_t nb, const char *x, char *cols, size_t esz) {
    int64_t R = nb * k->OH * k->OW;
    size_t run = (size_t)k->C * esz;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        int64_t n = r / (k->OH * k->OW), oh = r / k->OW % k->OH, ow = r % k->OW;
        char *dst = cols + (size_t)r * (size_t)(k->KH * k->KW) * run;
        for (int64_t kh = 0; kh < k->KH; kh++) {
            int64_t ih = i2c_in(oh, kh, k, 0, k->H);
            for (int64_t kw = 0; kw < k->KW; kw++, dst += run) {
                int64_t iw = ih < 0 ? -1 : i2c_in(ow, kw, k, 1, k->W);
                if (iw < 0) memset(dst, 0, run);
                else memcpy(dst, x + (size_t)((n * k->H + ih) * k->W + iw) * run, run);
            }
        }
    }
}

/* gx (images [0, nb), NHWC, f32 or bf16) = the sums of gx_cols (f32) over the taps that read
   each input pixel; each pixel gathers its taps, so threads never write the same value. */
static void col2im(const conv_key *k, int64_t nb, const float *gcols, void *gx, bool bf16) {
    int64_t P = nb * k->H * k->W, C = k->C, K = k->KH * k->KW * C;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++) {
        int64_t n = p / (k->H * k->W), ih = p / k->W % k->H, iw = p % k->W;
        for (int64_t c0 = 0; c0 < C; c0 += 256) {
            int64_t m = C - c0 < 256 ? C - c0 : 256;
            float acc[256] = {0};
            for (int64_t kh = 0; kh < k->KH; kh++) {
                int64_t th = ih + k->pad_l[0] - kh * (k->dil[0] + 1), oh = th / k->stride[0];
                if (th < 0 || th % k->stride[0] || oh >= k->OH) continue;
                for (int64_t kw = 0; kw < k->KW; kw++) {
                    int64_t tw = iw + k->pad_l[1] - kw * (k->dil[1] + 1), ow = tw / k->stride[1];
                    if (tw < 0 || tw % k->stride[1] || ow >= k->OW) continue;
                    const float *src = gcols + ((n * k->OH + oh) * k->OW + ow) * K + (kh * k->KW + kw) * C + c0;
                    for (int64_t c = 0; c < m; c++) acc[c] += src[c];
                }
            }
            for (int64_t c = 0; c < m; c++) ampc__cpu_st(gx, (size_t)(p * C + c0 + c), acc[c], bf16);
        }
    }
}

/* gb[o] (f32, or rounded to bf16) = the sum of column o of gy (R, O). */
static void i2c_bias_grad(const conv_key *k, const void *gy, void *gb, bool gb_bf16) {
    int64_t R = k->N * k->OH * k->OW, O = k->O;
    bool bf16 = k->dt == dnnl_bf16;
#pragma omp parallel for schedule(static)
    for (int64_t o0 = 0; o0 < O; o0 += 64) {
        int64_t m = O - o0 < 64 ? O - o0 : 64;
        float acc[64] = {0};
        for (int64_t r = 0; r < R; r++)
            for (int64_t o = 0; o < m; o++) acc[o] += ampc__cpu_ld(gy, (size_t)(r * O + o0 + o), bf16);
        for (int64_t o = 0; o < m; o++) ampc__cpu_st(gb, (size_t)(o0 + o), acc[o], gb_bf16);
    }
}

/* The reorder of the weights (or their gradient) between the user's OIHW in dt and OHWI in
   ohwi_dt; to_ohwi gives its direction. Lock held. */
static ampc_dnnl_entry *i2c_wei_reorder(const conv_key *k, int family, bool to_ohwi, dnnl_data_type_t dt,
                                        dnnl_data_type_t ohwi_dt) {
    dnnl_memory_desc_t oihw, ohwi;
    dnnl_dims_t dims = {k->O, k->C, k->KH, k->KW};
    if (dnnl_memory_desc_init_by_tag(&oihw, 4, dims, dt, dnnl_oihw) != dnnl_success ||
        dnnl_memory_desc_init_by_tag(&ohwi, 4, dims, ohwi_dt, dnnl_ohwi) != dnnl_success)
        return ampc__err_null(AMPC_ERR_BACKEND, "oneDNN: weight descriptors");
    conv_key kr = *k;
    kr.N = 0;   /* one reorder for every chunk size */
    return to_ohwi ? ampc__conv_reorder_entry(&kr, family, DNNL_ARG_WEIGHTS, &oihw, &ohwi)
                   : ampc__conv_reorder_entry(&kr, family, DNNL_ARG_DIFF_WEIGHTS, &ohwi, &oihw);
}

/* Runs pass family of k (ungrouped, channels-last, f32 or bf16) as im2col + matmul on the
   user's buffers (arg_spec order). Lock held. */
int ampc__conv_run_im2col(int family, const conv_key *k, void *const *user) {
    int rc = AMPC_OK;
    size_t esz = k->dt == dnnl_bf16 ? 2 : 4, cesz = i2c_cols_esz(family, k);
    int64_t K = k->KH * k->KW * k->C, nb = ampc__conv_i2c_chunk(family, k), xpix = k->H * k->W, ypix = k->OH * k->OW;
    bool bwd_w = family == AMPC_DNNL_CONV_BWD_WEIGHTS, gf32 = k->dt == dnnl_f32 || k->grad_f32;
    ampc_dnnl_entry *wr = i2c_wei_reorder(k, family, !bwd_w, bwd_w ? (gf32 ? dnnl_f32 : dnnl_bf16) : k->dt,
                                          bwd_w ? dnnl_f32 : k->dt);
    if (!wr) return ampc_last_status();
    /* workspace: W (OHWI, dt) or dW (f32), then one chunk's cols */
    size_t wbytes = ampc__conv_align64((size_t)(k->O * K) * (bwd_w ? 4 : esz)), block = 0;
    char *ws = ampc__alloc(AMPC_DEVICE_CPU, wbytes + (size_t)(nb * ypix * K) * cesz, AMPC_MEM_WORKSPACE, &block);
    if (!ws) return ampc_last_status();
    char *wbuf = ws, *cols = ws + wbytes;
    if (!bwd_w) rc = ampc__dnnl_run(wr, (void *[]){user[1], wbuf});
    for (int64_t n0 = 0; n0 < k->N && rc >= 0; n0 += nb) {
        /* the chunk's matmul: its own key (a smaller last chunk; later ones accumulate into dW) */
        conv_key kc = *k;
        kc.N = k->N - n0 < nb ? k->N - n0 : nb;
        kc.accum = bwd_w && n0 > 0;
        ampc_dnnl_entry *e = ampc__dnnl_get(family, &kc, sizeof kc, ampc__conv_i2c_builder(family));
        if (!e) {
            rc = ampc_last_status();
            break;
        }
        /* offsets of image n0 in x (or gx) and y (or gy), NHWC */
        size_t xoff = (size_t)(n0 * xpix * k->C) * esz, yoff = (size_t)(n0 * ypix * k->O) * esz;
        if (family == AMPC_DNNL_CONV_FWD) {
            im2col(k, kc.N, (const char *)user[0] + xoff, cols, esz);
            rc = ampc__dnnl_run(e, (void *[]){cols, wbuf, (char *)user[2] + yoff, k->has_bias ? user[3] : NULL});
        } else if (family == AMPC_DNNL_CONV_BWD_DATA) {
            rc = ampc__dnnl_run(e, (void *[]){(char *)user[0] + yoff, wbuf, cols});
            if (rc >= 0) col2im(k, kc.N, (const float *)cols, (char *)user[2] + xoff, esz == 2);
        } else {
            im2col(k, kc.N, (const char *)user[0] + xoff, cols, esz);
            rc = ampc__dnnl_run(e, (void *[]){(char *)user[1] + yoff, cols, wbuf});
        }
    }
    if (bwd_w && rc >= 0) {
        rc = ampc__dnnl_run(wr, (void *[]){wbuf, user[2]});
        if (rc >= 0 && k->has_bias) i2c_bias_grad(k, user[1], user[3], !gf32);
    }
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return rc;
}
