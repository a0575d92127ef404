/*
 * pool.c - CPU kernels: 2-D pooling on oneDNN's pooling_v2 primitive, adaptive average pooling
 * as a direct loop, and the strided block copy behind cat.
 *
 * Layout: oneDNN runs on the plain NCHW tensors. Blocked nChw16c with reorders in and out was
 * measured slower on this machine (2 threads, best of 3 x 60 runs on the shared machine,
 * forward + backward of max pool): (64,64,32,32) 2x2: f32 1.07 + 1.17 ms plain vs 1.23 + 1.43
 * ms blocked, bf16 0.82 + 0.75 vs 0.93 + 0.98; (16,64,112,112) 3x3 s2 p1: f32 4.0 + 4.1 vs
 * 6.7 + 6.5, bf16 2.4 + 3.0 vs 4.8 + 4.9. Pooling is memory bound, so the reorders cost more
 * than the blocked kernel saves; oneDNN picks its jit:avx512_core kernels for plain layouts too.
 *
 * Channels-last (desc->channels_last: x, y, gx, gy NHWC) runs oneDNN on dnnl_nhwc tensors: its
 * jit kernels vectorize along C, and no reorder is needed. ms, 2 threads, best of 20, NCHW ->
 * NHWC, fwd | bwd: cnn max 2x2 (128,64,28,28) f32 1.94 -> 1.17 | 2.38 -> 1.18, bf16 1.57 ->
 * 0.73 | 1.99 -> 0.60; (128,32,14,14) f32 0.19 -> 0.11 | 0.22 -> 0.07; ResNet-50 max 3x3 s2
 * (16,64,112,112) f32 3.56 -> 2.80 | 4.54 -> 2.57, bf16 4.60 -> 3.27 | 6.29 -> 7.06 (the f32
 * backward below; oneDNN's bf16 one: 2.3); global average (16,2048,7,7) f32 0.56 -> 0.15 | 0.90
 * -> 0.44. The adaptive loop and the include-pad rescale index NHWC directly (same bits as
 * the planar loops).
 *
 * f32 and bf16 run natively. oneDNN 2.6 has no f16 pooling on this CPU: f16 tensors are widened
 * to f32 workspace copies and the result rounded once (max pooling of f16 is exact in f32).
 * Max pooling for training writes oneDNN's workspace (the argmax, a byte per output for
 * kernels under 256 elements); ties go to the first maximum, as in PyTorch. Known differences
 * from PyTorch, both oneDNN's: NaN inputs are skipped rather than propagated, and a window of
 * only -inf gives the lowest finite value.
 *
 * Average pooling with count_include_pad and ceil_mode: PyTorch divides a window that reaches
 * past H + padding by its part inside that range, oneDNN by the whole kernel. Those (last row
 * and column) outputs are rescaled in f32, and their gradients scaled the same way before the
 * backward primitive.
 *
 * Adaptive average pooling with windows of varying size is a direct loop over planes: its
 * inputs are small (the last feature map of a network) and it runs once per step.
 */
#include "backend/cpu/cpu.h"
#include "backend/cpu/dnnl_cache.h"

#include <omp.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Helpers

/* Index of element (n, c, h, w) of an (N, C, H, W) tensor in the descriptor's layout. */
static inline int64_t at(const ampc_pool_desc *d, int64_t n, int64_t c, int64_t h, int64_t w, int64_t H, int64_t W) {
    return d->channels_last ? ((n * H + h) * W + w) * d->C + c : ((n * d->C + c) * H + h) * W + w;
}

#define CONVERT_BLOCK 65536

/* All of t as f32 into dst. */
static void load_f32(const ampc_tensor *t, float *dst) {
    const ampc_dtype_traits *tr = ampc__dt(t->dtype);
    size_t n = (size_t)t->numel;
    const char *src = ampc__data(t);
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)n)) schedule(static)
    for (size_t b = 0; b < n; b += CONVERT_BLOCK)
        tr->to_f32(src + b * tr->size, dst + b, n - b < CONVERT_BLOCK ? n - b : CONVERT_BLOCK);
}

/* All of src (t's numel values) stored into t, rounding once. */
static void store_f32(ampc_tensor *t, const float *src) {
    const ampc_dtype_traits *tr = ampc__dt(t->dtype);
    size_t n = (size_t)t->numel;
    char *dst = ampc__data(t);
#pragma omp parallel for num_threads(ampc__threads_for((int64_t)n)) schedule(static)
    for (size_t b = 0; b < n; b += CONVERT_BLOCK)
        tr->from_f32(src + b, dst + b * tr->size, n - b < CONVERT_BLOCK ? n - b : CONVERT_BLOCK);
}

/* f32 workspace of n_a + n_b floats (two arrays); NULL + error on failure. */
static float *scratch(size_t n_a, size_t n_b, size_t *block) {
    return ampc__alloc(AMPC_DEVICE_CPU, (n_a + n_b) * sizeof(float) + 64, AMPC_MEM_WORKSPACE, block);
}
/* second array of a scratch block, 64-byte aligned */
static float *scratch_b(float *a, size_t n_a) { return a + ((n_a + 15) & ~(size_t)15); }

// ---------------------------------------------------------------------------------------------
// PyTorch's include-pad divisor past the padding (ceil_mode)

static bool needs_rescale(const ampc_pool_desc *d) {
    return d->kind == AMPC_POOL_AVG_INCLUDE_PAD && (d->pad_end[0] > d->pad_begin[0] || d->pad_end[1] > d->pad_begin[1]);
}

/* Positions of window o that PyTorch counts: clipped at size + pad_begin. */
static int64_t counted(const ampc_pool_desc *d, int axis, int64_t o) {
    int64_t start = o * d->stride[axis] - d->pad_begin[axis], end = start + d->kernel[axis];
    int64_t lim = (axis ? d->W : d->H) + d->pad_begin[axis];
    return (end < lim ? end : lim) - start;
}

/* v (N, C, OH, OW outputs in the descriptor's layout) *= kernel area / counted area, where they
   differ. */
static void rescale(const ampc_pool_desc *d, float *v) {
    int64_t planes = d->N * d->C, area = (int64_t)d->kernel[0] * d->kernel[1];
#pragma omp parallel for num_threads(ampc__threads_for(planes * d->OH * d->OW)) schedule(static)
    for (int64_t p = 0; p < planes; p++)
        for (int64_t oh = 0; oh < d->OH; oh++) {
            int64_t ch = counted(d, 0, oh);
            for (int64_t ow = 0; ow < d->OW; ow++) {
                int64_t n = ch * counted(d, 1, ow);
                float *y = &v[at(d, p / d->C, p % d->C, oh, ow, d->OH, d->OW)];
                if (n != area) *y = (float)((double)*y * (double)area / (double)n);
            }
        }
}

// ---------------------------------------------------------------------------------------------
// oneDNN primitives

/* Zeroed before filling: compared bytewise by the cache. */
typedef struct {
    dnnl_data_type_t dt;
    int32_t alg;        /* dnnl_alg_kind_t */
    int32_t training;   /* max pooling that writes (forward) or reads (backward) a workspace */
    int32_t nthr;
    int32_t channels_last;   /* NHWC tensors */
    int64_t N, C, H, W, OH, OW;
    int64_t kernel[2], stride[2], pad_l[2], pad_r[2];
} pool_key;

static pool_key make_key(const ampc_pool_desc *d, ampc_dtype dt, bool training) {
    pool_key k;
    memset(&k, 0, sizeof k);
    k.dt = ampc__dnnl_dt(dt);
    k.alg = d->kind == AMPC_POOL_MAX ? dnnl_pooling_max
            : d->kind == AMPC_POOL_AVG_EXCLUDE_PAD ? dnnl_pooling_avg_exclude_padding
                                                    : dnnl_pooling_avg_include_padding;
    k.training = training && d->kind == AMPC_POOL_MAX;
    k.nthr = omp_get_max_threads();
    k.channels_last = d->channels_last;
    k.N = d->N, k.C = d->C, k.H = d->H, k.W = d->W, k.OH = d->OH, k.OW = d->OW;
    for (int i = 0; i < 2; i++) {
        k.kernel[i] = d->kernel[i];
        k.stride[i] = d->stride[i];
        k.pad_l[i] = d->pad_begin[i];
        k.pad_r[i] = d->pad_end[i];
    }
    return k;
}

static dnnl_status_t key_mds(const pool_key *k, dnnl_memory_desc_t *src, dnnl_memory_desc_t *dst) {
    dnnl_dims_t sd = {k->N, k->C, k->H, k->W}, dd = {k->N, k->C, k->OH, k->OW};
    dnnl_format_tag_t tag = k->channels_last ? dnnl_nhwc : dnnl_nchw;
    dnnl_status_t st = dnnl_memory_desc_init_by_tag(src, 4, sd, k->dt, tag);
    return st != dnnl_success ? st : dnnl_memory_desc_init_by_tag(dst, 4, dd, k->dt, tag);
}

static dnnl_status_t forward_pd(const pool_key *k, bool training, dnnl_primitive_desc_t *pd) {
    dnnl_memory_desc_t src, dst;
    dnnl_pooling_v2_desc_t op;
    dnnl_dims_t strides = {k->stride[0], k->stride[1]}, kernel = {k->kernel[0], k->kernel[1]}, dil = {0, 0};
    dnnl_dims_t pl = {k->pad_l[0], k->pad_l[1]}, pr = {k->pad_r[0], k->pad_r[1]};
    dnnl_status_t st = key_mds(k, &src, &dst);
    if (st == dnnl_success)
        st = dnnl_pooling_v2_forward_desc_init(&op, training ? dnnl_forward_training : dnnl_forward_inference,
                                               (dnnl_alg_kind_t)k->alg, &src, &dst, strides, kernel, dil, pl, pr);
    if (st == dnnl_success) st = dnnl_primitive_desc_create(pd, &op, ampc__dnnl_attr(), ampc__dnnl_engine(), NULL);
    return st;
}

/* Arguments: src, dst[, workspace]. */
static int build_forward(ampc_dnnl_entry *e, const void *key) {
    const pool_key *k = key;
    int rc = AMPC_OK;
    AMPC_DNNL_TRY(forward_pd(k, k->training, &e->pd), "pooling forward primitive_desc_create");
    if ((rc = ampc__dnnl_add_arg(e, DNNL_ARG_SRC, ampc__dnnl_query_md(e, dnnl_query_src_md))) < 0 ||
        (rc = ampc__dnnl_add_arg(e, DNNL_ARG_DST, ampc__dnnl_query_md(e, dnnl_query_dst_md))) < 0)
        return rc;
    if (k->training) return ampc__dnnl_add_arg(e, DNNL_ARG_WORKSPACE, ampc__dnnl_query_md(e, dnnl_query_workspace_md));
    return AMPC_OK;
fail:
    return rc;
}

/* Arguments: diff_dst, diff_src[, workspace]; the forward descriptor is the required hint. */
static int build_backward(ampc_dnnl_entry *e, const void *key) {
    const pool_key *k = key;
    int rc = AMPC_OK;
    dnnl_primitive_desc_t hint = NULL;
    dnnl_memory_desc_t src, dst;
    dnnl_pooling_v2_desc_t op;
    dnnl_dims_t strides = {k->stride[0], k->stride[1]}, kernel = {k->kernel[0], k->kernel[1]}, dil = {0, 0};
    dnnl_dims_t pl = {k->pad_l[0], k->pad_l[1]}, pr = {k->pad_r[0], k->pad_r[1]};
    AMPC_DNNL_TRY(forward_pd(k, true, &hint), "pooling forward hint");
    AMPC_DNNL_TRY(key_mds(k, &src, &dst), "pooling descriptors");
    AMPC_DNNL_TRY(dnnl_pooling_v2_backward_desc_init(&op, (dnnl_alg_kind_t)k->alg, &src, &dst, strides, kernel, dil, pl, pr),
                  "pooling backward desc_init");
    AMPC_DNNL_TRY(dnnl_primitive_desc_create(&e->pd, &op, ampc__dnnl_attr(), ampc__dnnl_engine(), hint),
                  "pooling backward primitive_desc_create");
    if ((rc = ampc__dnnl_add_arg(e, DNNL_ARG_DIFF_DST, ampc__dnnl_query_md(e, dnnl_query_diff_dst_md))) < 0 ||
        (rc = ampc__dnnl_add_arg(e, DNNL_ARG_DIFF_SRC, ampc__dnnl_query_md(e, dnnl_query_diff_src_md))) < 0)
        goto out;
    if (k->training) rc = ampc__dnnl_add_arg(e, DNNL_ARG_WORKSPACE, ampc__dnnl_query_md(e, dnnl_query_workspace_md));
    goto out;
fail:
out:
    if (hint) dnnl_primitive_desc_destroy(hint);
    return rc;
}

/* Runs the forward (ws != NULL: training max pooling) or backward primitive on raw pointers
   of dtype dt (f32 or bf16). */
static int run(const ampc_pool_desc *d, ampc_dtype dt, bool backward, const void *in, void *out, const void *ws) {
    pool_key k = make_key(d, dt, ws != NULL);
    ampc__dnnl_lock();
    ampc_dnnl_entry *e = ampc__dnnl_get(backward ? AMPC_DNNL_POOL_BWD : AMPC_DNNL_POOL_FWD, &k, sizeof k,
                                        backward ? build_backward : build_forward);
    int rc = e ? ampc__dnnl_run(e, (void *const[]){(void *)in, out, (void *)ws}) : ampc_last_status();
    ampc__dnnl_unlock();
    return rc;
}

/* oneDNN 2.6's channels-last bf16 backward adds the gradients of overlapping windows in bf16,
   a rounding per window (measured: 1.5 bf16 ulps off with 3x2 windows at stride 1), where the
   planar one adds in f32. Such backward passes run on f32 copies instead, provided the f32
   primitive reads the bf16 forward's workspace as it is (max pooling's argmax bytes). */
static bool backward_in_f32(const ampc_pool_desc *d, ampc_dtype dt) {
    bool overlap = d->kernel[0] > d->stride[0] || d->kernel[1] > d->stride[1];
    if (!d->channels_last || dt != AMPC_BF16 || ampc__dnnl_via_f32(dt) || d->kind == AMPC_POOL_ADAPTIVE_AVG || !overlap)
        return false;
    if (d->kind != AMPC_POOL_MAX) return true;
    pool_key kf = make_key(d, AMPC_BF16, true), kb = make_key(d, AMPC_F32, true);
    ampc__dnnl_lock();
    ampc_dnnl_entry *f = ampc__dnnl_get(AMPC_DNNL_POOL_FWD, &kf, sizeof kf, build_forward);
    ampc_dnnl_entry *b = f ? ampc__dnnl_get(AMPC_DNNL_POOL_BWD, &kb, sizeof kb, build_backward) : NULL;
    bool same = b && dnnl_memory_desc_equal(ampc__dnnl_query_md(f, dnnl_query_workspace_md),
                                            ampc__dnnl_query_md(b, dnnl_query_workspace_md));
    ampc__dnnl_unlock();
    if (!f || !b) ampc_clear_error();   /* then the bf16 primitive runs (and reports) */
    return same;
}

// ---------------------------------------------------------------------------------------------
// Adaptive average pooling: windows [floor(o*H/OH), ceil((o+1)*H/OH))

static void adaptive_window(int64_t o, int64_t size, int64_t out, int64_t *lo, int64_t *hi) {
    *lo = o * size / out;
    *hi = ((o + 1) * size + out - 1) / out;
}

static void adaptive_forward(const ampc_pool_desc *d, const float *x, float *y) {
    int64_t planes = d->N * d->C;
#pragma omp parallel for num_threads(ampc__threads_for(planes * d->H * d->W)) schedule(static)
    for (int64_t p = 0; p < planes; p++) {
        const float *plane = x + p * d->H * d->W;
        for (int64_t oh = 0; oh < d->OH; oh++) {
            int64_t h0, h1, w0, w1;
            adaptive_window(oh, d->H, d->OH, &h0, &h1);
            for (int64_t ow = 0; ow < d->OW; ow++) {
                adaptive_window(ow, d->W, d->OW, &w0, &w1);
                float s = 0;
                for (int64_t h = h0; h < h1; h++)
                    for (int64_t w = w0; w < w1; w++) s += plane[h * d->W + w];
                y[(p * d->OH + oh) * d->OW + ow] = s / (float)((h1 - h0) * (w1 - w0));
            }
        }
    }
}

/* Channels-last: an output pixel's C channels summed along contiguous rows of x, in the same
   order (h, then w) as the planar loop, so both layouts give the same bits. */
static void adaptive_forward_cl(const ampc_pool_desc *d, const float *x, float *y) {
    int64_t C = d->C, pixels = d->N * d->OH * d->OW;
#pragma omp parallel for num_threads(ampc__threads_for(d->N * C * d->H * d->W)) schedule(static)
    for (int64_t px = 0; px < pixels; px++) {
        int64_t n = px / (d->OH * d->OW), oh = px / d->OW % d->OH, ow = px % d->OW, h0, h1, w0, w1;
        adaptive_window(oh, d->H, d->OH, &h0, &h1);
        adaptive_window(ow, d->W, d->OW, &w0, &w1);
        float *yo = y + px * C, cnt = (float)((h1 - h0) * (w1 - w0));
        memset(yo, 0, (size_t)C * sizeof *yo);
        for (int64_t h = h0; h < h1; h++)
            for (int64_t w = w0; w < w1; w++) {
                const float *xr = x + ((n * d->H + h) * d->W + w) * C;
#pragma omp simd
                for (int64_t c = 0; c < C; c++) yo[c] += xr[c];
            }
#pragma omp simd
        for (int64_t c = 0; c < C; c++) yo[c] /= cnt;
    }
}

static void adaptive_backward(const ampc_pool_desc *d, const float *gy, float *gx) {
    int64_t planes = d->N * d->C;
#pragma omp parallel for num_threads(ampc__threads_for(planes * d->H * d->W)) schedule(static)
    for (int64_t p = 0; p < planes; p++) {
        float *plane = gx + p * d->H * d->W;
        memset(plane, 0, (size_t)(d->H * d->W) * sizeof(float));
        for (int64_t oh = 0; oh < d->OH; oh++) {
            int64_t h0, h1, w0, w1;
            adaptive_window(oh, d->H, d->OH, &h0, &h1);
            for (int64_t ow = 0; ow < d->OW; ow++) {
                adaptive_window(ow, d->W, d->OW, &w0, &w1);
                float g = gy[(p * d->OH + oh) * d->OW + ow] / (float)((h1 - h0) * (w1 - w0));
                for (int64_t h = h0; h < h1; h++)
                    for (int64_t w = w0; w < w1; w++) plane[h * d->W + w] += g;
            }
        }
    }
}

/* Channels-last: windows overlap when the sizes do not divide, so an image is one thread's;
   the additions into each gx element come in the planar loop's order (same bits). */
static void adaptive_backward_cl(const ampc_pool_desc *d, const float *gy, float *gx) {
    int64_t C = d->C, HWC = d->H * d->W * C;
#pragma omp parallel for num_threads(d->N > 1 ? ampc__threads_for(d->N * HWC) : 1) schedule(static)
    for (int64_t n = 0; n < d->N; n++) {
        float *img = gx + n * HWC;
        memset(img, 0, (size_t)HWC * sizeof *img);
        for (int64_t oh = 0; oh < d->OH; oh++) {
            int64_t h0, h1, w0, w1;
            adaptive_window(oh, d->H, d->OH, &h0, &h1);
            for (int64_t ow = 0; ow < d->OW; ow++) {
                adaptive_window(ow, d->W, d->OW, &w0, &w1);
                const float *go = gy + ((n * d->OH + oh) * d->OW + ow) * C;
                float cnt = (float)((h1 - h0) * (w1 - w0));
                for (int64_t h = h0; h < h1; h++)
                    for (int64_t w = w0; w < w1; w++) {
                        float *row = img + (h * d->W + w) * C;
#pragma omp simd
                        for (int64_t c = 0; c < C; c++) row[c] += go[c] / cnt;
                    }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Kernels

static size_t cpu_pool2d_workspace_size(const ampc_pool_desc *d, ampc_dtype dt) {
    if (d->kind != AMPC_POOL_MAX) return 0;
    pool_key k = make_key(d, ampc__dnnl_compute_dt(dt), true);
    ampc__dnnl_lock();
    ampc_dnnl_entry *e = ampc__dnnl_get(AMPC_DNNL_POOL_FWD, &k, sizeof k, build_forward);
    size_t n = e ? dnnl_memory_desc_get_size(ampc__dnnl_query_md(e, dnnl_query_workspace_md)) : 0;
    ampc__dnnl_unlock();
    return n;
}

static int cpu_pool2d(const ampc_pool_desc *d, const ampc_tensor *x, ampc_tensor *y, void *ws) {
    int rc = AMPC_OK;
    if (y->numel == 0) return rc;
    bool adaptive = d->kind == AMPC_POOL_ADAPTIVE_AVG, fix = needs_rescale(d);
    if (!adaptive && !fix && !ampc__dnnl_via_f32(x->dtype)) return run(d, x->dtype, false, ampc__data(x), ampc__data(y), ws);
    if (!adaptive && x->dtype == AMPC_F32) {
        rc = run(d, AMPC_F32, false, ampc__data(x), ampc__data(y), ws);
        if (rc >= 0) rescale(d, ampc__data(y));
        return rc;
    }
    /* through f32: f16 (and bf16 without oneDNN's bf16 kernels), a rescaled 16-bit average, or
       the adaptive loop on 16-bit data */
    bool wide = x->dtype == AMPC_F32;
    size_t nx = wide ? 0 : (size_t)x->numel, ny = wide ? 0 : (size_t)y->numel, block = 0;
    float *x32 = wide ? ampc__data(x) : NULL, *y32 = wide ? ampc__data(y) : NULL, *buf = NULL;
    if (!wide) {
        if (!(buf = scratch(nx, ny, &block))) return ampc_last_status();
        x32 = buf;
        y32 = scratch_b(buf, nx);
        load_f32(x, x32);
    }
    if (adaptive) {
        (d->channels_last ? adaptive_forward_cl : adaptive_forward)(d, x32, y32);
    } else {
        rc = run(d, AMPC_F32, false, x32, y32, ws);
        if (rc >= 0 && fix) rescale(d, y32);
    }
    if (rc >= 0 && !wide) store_f32(y, y32);
    ampc__free(AMPC_DEVICE_CPU, buf, block, AMPC_MEM_WORKSPACE);
    return rc;
}

static int cpu_pool2d_backward(const ampc_pool_desc *d, const ampc_tensor *gy, ampc_tensor *gx, const void *ws) {
    int rc = AMPC_OK;
    if (gx->numel == 0) return rc;
    if (gy->numel == 0) {
        memset(ampc__data(gx), 0, ampc__nbytes(gx));
        return AMPC_OK;
    }
    bool adaptive = d->kind == AMPC_POOL_ADAPTIVE_AVG, fix = needs_rescale(d), f32 = backward_in_f32(d, gy->dtype);
    if (!adaptive && !fix && !f32 && !ampc__dnnl_via_f32(gy->dtype))
        return run(d, gy->dtype, true, ampc__data(gy), ampc__data(gx), ws);
    /* through f32; gy is copied when it must be rescaled (it is the caller's) */
    bool wide = gy->dtype == AMPC_F32;
    size_t ngy = wide && !fix ? 0 : (size_t)gy->numel, ngx = wide ? 0 : (size_t)gx->numel, block = 0;
    float *gy32 = ampc__data(gy), *gx32 = ampc__data(gx), *buf = NULL;
    if (ngy + ngx) {
        if (!(buf = scratch(ngy, ngx, &block))) return ampc_last_status();
        if (ngy) {
            gy32 = buf;
            if (wide) memcpy(gy32, ampc__data(gy), ngy * sizeof(float));
            else load_f32(gy, gy32);
        }
        if (ngx) gx32 = scratch_b(buf, ngy);
    }
    if (adaptive) {
        (d->channels_last ? adaptive_backward_cl : adaptive_backward)(d, gy32, gx32);
    } else {
        if (fix) rescale(d, gy32);
        rc = run(d, AMPC_F32, true, gy32, gx32, ws);
    }
    if (rc >= 0 && !wide) store_f32(gx, gx32);
    ampc__free(AMPC_DEVICE_CPU, buf, block, AMPC_MEM_WORKSPACE);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Block copy: a row per memcpy, rows split over threads when there are many

static int cpu_copy_block(const ampc_tensor *src, int64_t src_off, int64_t src_ld, ampc_tensor *dst, int64_t dst_off,
                          int64_t dst_ld, int64_t rows, int64_t cols, double scale) {
    size_t sz = ampc__dt(src->dtype)->size, row = (size_t)cols * sz;
    const char *s = (const char *)ampc__data(src) + (size_t)src_off * sz;
    char *t = (char *)ampc__data(dst) + (size_t)dst_off * sz;
    if (scale != 1.0) {   /* f32 or f64 (checked): one rounding of the product each */
        const float k = (float)scale;
        const bool f32 = src->dtype == AMPC_F32;
        int nt = ampc__threads_for(rows * cols);
#pragma omp parallel for num_threads(nt) schedule(static) collapse(2)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++) {
                if (f32) ((float *)t)[r * dst_ld + c] = ((const float *)s)[r * src_ld + c] * k;
                else ((double *)t)[r * dst_ld + c] = ((const double *)s)[r * src_ld + c] * scale;
            }
        return AMPC_OK;
    }
    int nt = rows > 1 ? ampc__threads_for(rows * cols) : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) memcpy(t + (size_t)(r * dst_ld) * sz, s + (size_t)(r * src_ld) * sz, row);
    return AMPC_OK;
}

void ampc__cpu_register_pool(ampc_backend *be) {
    be->pool2d_workspace_size = cpu_pool2d_workspace_size;
    be->pool2d = cpu_pool2d;
    be->pool2d_backward = cpu_pool2d_backward;
    be->copy_block = cpu_copy_block;
}
