/*
 * conv.c - the CUDA backend's convolution on cuDNN 9's legacy convolution API (cudnn_cnn):
 * cudnnConvolutionForward / BackwardData / BackwardFilter on 4-D descriptors in NCHW or, for
 * channels-last tensors, NHWC. One cuDNN handle (created on first use, bound to the backend's
 * stream), used under one lock.
 *
 * Layouts: with NHWC tensors cuDNN's tensor-core kernels want the filter in NHWC too (KRSC):
 * w (always OIHW in ampc) is permuted into scratch for the forward and backward-data passes,
 * and the weight gradient is computed in KRSC and permuted back (with its dtype conversion, in
 * one pass). Groups, stride, padding and dilation go straight into the descriptor.
 *
 * Numerics: compute type f32 for every dtype (f16/bf16 storage, f32 accumulation); math type
 * CUDNN_TENSOR_OP_MATH for f16/bf16; for f32 CUDNN_FMA_MATH (no TF32: since cuDNN 8 the default
 * math type lets f32 convolutions use TF32) unless ampc_allow_tf32(), then CUDNN_DEFAULT_MATH,
 * as PyTorch does. The f32 weight gradient of 16-bit x and gy (autocast): cuDNN's dw has the
 * data type of x and dy, so it is computed in that dtype into scratch and widened to f32 -
 * the gradient PyTorch's autocast gets too (the 16-bit weight copy's gradient, cast back).
 * The bias (forward: added to y after the convolution, a second rounding for 16-bit y) and the
 * bias gradient (sum of gy over N, H, W per channel in f64) are batch_norm.cu's kernels.
 *
 * Algorithms: cuDNN's heuristics (cudnnGet*Algorithm_v7, what PyTorch uses without
 * cudnn.benchmark), the first one that cuDNN reports usable with the requested math type, cached
 * per (shape, dtype, format, pass, math) in a small table; workspace through core's caching
 * allocator (freed after queueing: one stream).
 */
#include "backend/cuda/batch_norm.h"

#include <cudnn.h>
#include <limits.h>
#include <pthread.h>
#include <string.h>

static struct {
    pthread_once_t once;
    cudnnStatus_t status;
    cudnnHandle_t handle;
} H = {.once = PTHREAD_ONCE_INIT};
static pthread_mutex_t conv_lock = PTHREAD_MUTEX_INITIALIZER;

static void handle_start(void) {
    H.status = cudnnCreate(&H.handle);
    if (H.status == CUDNN_STATUS_SUCCESS) H.status = cudnnSetStream(H.handle, ampc__cu_stream());
}

static int dnn_check(cudnnStatus_t st, const char *what) {
    if (st == CUDNN_STATUS_SUCCESS) return AMPC_OK;
    return ampc__err(st == CUDNN_STATUS_ALLOC_FAILED ? AMPC_ERR_OOM : AMPC_ERR_BACKEND, "cudnn: %s: %s", what,
                     cudnnGetErrorString(st));
}

/* The handle (after ampc__cu_ready()). */
static int handle_get(cudnnHandle_t *h) {
    pthread_once(&H.once, handle_start);
    *h = H.handle;
    return dnn_check(H.status, "cudnnCreate/cudnnSetStream (the cuDNN library could not start)");
}

typedef enum { PASS_FWD = 0, PASS_BWD_DATA, PASS_BWD_FILTER } conv_pass;

static const char *pass_name(conv_pass p) {
    return p == PASS_FWD ? "conv2d" : p == PASS_BWD_DATA ? "conv2d_backward_data" : "conv2d_backward_weights";
}

// ---------------------------------------------------------------------------------------------
// Descriptors

typedef struct {
    cudnnTensorDescriptor_t x, y;
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv;
} conv_descs;

static void descs_free(conv_descs *c) {
    if (c->x) cudnnDestroyTensorDescriptor(c->x);
    if (c->y) cudnnDestroyTensorDescriptor(c->y);
    if (c->w) cudnnDestroyFilterDescriptor(c->w);
    if (c->conv) cudnnDestroyConvolutionDescriptor(c->conv);
    memset(c, 0, sizeof *c);
}

static cudnnDataType_t dnn_dt(ampc_dtype dt) {
    return dt == AMPC_F16 ? CUDNN_DATA_HALF : dt == AMPC_BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
}

/* math type requested for dt: f16/bf16 tensor cores; f32 plain FMA unless TF32 is allowed */
static cudnnMathType_t wanted_math(ampc_dtype dt) {
    if (dt != AMPC_F32) return CUDNN_TENSOR_OP_MATH;
    return ampc_allow_tf32() ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
}

static int descs_make(const ampc_conv_desc *d, ampc_dtype dt, cudnnMathType_t math, conv_descs *c, const char *k) {
    memset(c, 0, sizeof *c);
    const int64_t dims[] = {d->N, d->C, d->H, d->W, d->O, d->OH, d->OW, d->KH, d->KW};
    for (size_t i = 0; i < sizeof dims / sizeof *dims; i++)
        if (dims[i] > INT_MAX)
            return ampc__err(AMPC_ERR_UNSUPPORTED, "cuda %s: dimension %lld exceeds cuDNN's int range", k, (long long)dims[i]);
    cudnnTensorFormat_t fmt = d->channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
    cudnnDataType_t t = dnn_dt(dt);
    int rc, n, ch, h, w;
    if ((rc = dnn_check(cudnnCreateTensorDescriptor(&c->x), "cudnnCreateTensorDescriptor")) < 0 ||
        (rc = dnn_check(cudnnCreateTensorDescriptor(&c->y), "cudnnCreateTensorDescriptor")) < 0 ||
        (rc = dnn_check(cudnnCreateFilterDescriptor(&c->w), "cudnnCreateFilterDescriptor")) < 0 ||
        (rc = dnn_check(cudnnCreateConvolutionDescriptor(&c->conv), "cudnnCreateConvolutionDescriptor")) < 0 ||
        (rc = dnn_check(cudnnSetTensor4dDescriptor(c->x, fmt, t, (int)d->N, (int)d->C, (int)d->H, (int)d->W),
                        "cudnnSetTensor4dDescriptor (input)")) < 0 ||
        (rc = dnn_check(cudnnSetTensor4dDescriptor(c->y, fmt, t, (int)d->N, (int)d->O, (int)d->OH, (int)d->OW),
                        "cudnnSetTensor4dDescriptor (output)")) < 0 ||
        (rc = dnn_check(cudnnSetFilter4dDescriptor(c->w, t, fmt, (int)d->O, (int)(d->C / d->groups), (int)d->KH, (int)d->KW),
                        "cudnnSetFilter4dDescriptor")) < 0 ||
        (rc = dnn_check(cudnnSetConvolution2dDescriptor(c->conv, d->padding[0], d->padding[1], d->stride[0], d->stride[1],
                                                        d->dilation[0], d->dilation[1], CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT),
                        "cudnnSetConvolution2dDescriptor")) < 0 ||
        (rc = dnn_check(cudnnSetConvolutionGroupCount(c->conv, d->groups), "cudnnSetConvolutionGroupCount")) < 0 ||
        (rc = dnn_check(cudnnSetConvolutionMathType(c->conv, math), "cudnnSetConvolutionMathType")) < 0 ||
        (rc = dnn_check(cudnnGetConvolution2dForwardOutputDim(c->conv, c->x, c->w, &n, &ch, &h, &w),
                        "cudnnGetConvolution2dForwardOutputDim")) < 0)
        goto fail;
    if (n != d->N || ch != d->O || h != d->OH || w != d->OW) {
        rc = ampc__err(AMPC_ERR_INVALID, "cuda %s: cuDNN computes an output of (%d, %d, %d, %d), the descriptor says (%lld, %lld, "
                       "%lld, %lld)", k, n, ch, h, w, (long long)d->N, (long long)d->O, (long long)d->OH, (long long)d->OW);
        goto fail;
    }
    return AMPC_OK;
fail:
    descs_free(c);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Algorithm choice, cached (under conv_lock)

#define KEY_LEN 20
typedef struct {
    int64_t key[KEY_LEN];
    int algo;
    cudnnMathType_t math;
    size_t ws;
} algo_entry;

#define ALGO_CACHE 256
static algo_entry cache[ALGO_CACHE];
static int cache_n, cache_next;

/* timed: a choice by timing (ampc_cudnn_benchmark) is kept apart from a heuristic one */
static void make_key(const ampc_conv_desc *d, ampc_dtype dt, conv_pass pass, cudnnMathType_t math, bool timed, int64_t *k) {
    const int64_t v[KEY_LEN] = {d->N, d->C, d->H, d->W, d->O, d->KH, d->KW, d->OH, d->OW, d->stride[0], d->stride[1],
                                d->padding[0], d->padding[1], d->dilation[0], d->dilation[1], d->groups, d->channels_last,
                                dt, pass, (int64_t)math * 2 + timed};
    memcpy(k, v, sizeof v);
}

/* The first of cuDNN's heuristic choices that it reports usable (with plain FMA math when
   strict), with its math type. */
#define PICK_FIRST(PERF_T, COUNT, CALL)                                                            \
    do {                                                                                           \
        PERF_T perf[COUNT];                                                                        \
        int got = 0;                                                                               \
        if ((rc = dnn_check(CALL, #CALL)) < 0) return rc;                                          \
        for (int i = 0; i < got && !found; i++)                                                    \
            if (perf[i].status == CUDNN_STATUS_SUCCESS && (!strict || perf[i].mathType == CUDNN_FMA_MATH)) { \
                e->algo = (int)perf[i].algo;                                                       \
                e->math = perf[i].mathType;                                                        \
                found = true;                                                                      \
            }                                                                                      \
    } while (0)

static int pick_algo(cudnnHandle_t h, const conv_descs *c, conv_pass pass, bool strict, algo_entry *e, const char *k) {
    bool found = false;
    int rc;
    if (pass == PASS_FWD)
        PICK_FIRST(cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
                   cudnnGetConvolutionForwardAlgorithm_v7(h, c->x, c->w, c->conv, c->y, CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &got, perf));
    else if (pass == PASS_BWD_DATA)
        PICK_FIRST(cudnnConvolutionBwdDataAlgoPerf_t, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
                   cudnnGetConvolutionBackwardDataAlgorithm_v7(h, c->w, c->y, c->conv, c->x, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
                                                               &got, perf));
    else
        PICK_FIRST(cudnnConvolutionBwdFilterAlgoPerf_t, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT,
                   cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, c->x, c->y, c->conv, c->w,
                                                                 CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &got, perf));
    if (!found)
        return ampc__err(AMPC_ERR_UNSUPPORTED, "cuda %s: cuDNN has no algorithm for this convolution%s", k,
                         strict ? " without TF32 (ampc_set_allow_tf32(true) may find one)" : "");
    if ((rc = dnn_check(cudnnSetConvolutionMathType(c->conv, e->math), "cudnnSetConvolutionMathType")) < 0) return rc;
    if (pass == PASS_FWD)
        rc = dnn_check(cudnnGetConvolutionForwardWorkspaceSize(h, c->x, c->w, c->conv, c->y, (cudnnConvolutionFwdAlgo_t)e->algo, &e->ws),
                       "cudnnGetConvolutionForwardWorkspaceSize");
    else if (pass == PASS_BWD_DATA)
        rc = dnn_check(cudnnGetConvolutionBackwardDataWorkspaceSize(h, c->w, c->y, c->conv, c->x,
                                                                    (cudnnConvolutionBwdDataAlgo_t)e->algo, &e->ws),
                       "cudnnGetConvolutionBackwardDataWorkspaceSize");
    else
        rc = dnn_check(cudnnGetConvolutionBackwardFilterWorkspaceSize(h, c->x, c->y, c->conv, c->w,
                                                                      (cudnnConvolutionBwdFilterAlgo_t)e->algo, &e->ws),
                       "cudnnGetConvolutionBackwardFilterWorkspaceSize");
    return rc;
}

/* ampc_cudnn_benchmark(): the fastest deterministic algorithm (with plain FMA math when strict)
   of cuDNN's timed trials on the real operands a, b into out (written by the trials; the pass
   writes it again), with as much workspace as the allocator gives up to 256 MiB. */
#define PICK_TIMED(PERF_T, COUNT, CALL)                                                            \
    do {                                                                                           \
        PERF_T perf[COUNT];                                                                        \
        int got = 0;                                                                               \
        rc = dnn_check(CALL, #CALL);                                                               \
        for (int i = 0; rc >= 0 && i < got && !found; i++)                                         \
            if (perf[i].status == CUDNN_STATUS_SUCCESS && perf[i].determinism == CUDNN_DETERMINISTIC && \
                perf[i].memory <= ws_bytes && (!strict || perf[i].mathType == CUDNN_FMA_MATH)) {   \
                e->algo = (int)perf[i].algo;                                                       \
                e->math = perf[i].mathType;                                                        \
                e->ws = perf[i].memory;                                                            \
                found = true;                                                                      \
            }                                                                                      \
    } while (0)

static int time_algo(cudnnHandle_t h, const conv_descs *c, conv_pass pass, bool strict, const void *a, const void *b, void *out,
                     algo_entry *e, bool *found_out) {
    bool found = false;
    int rc = AMPC_OK;
    size_t ws_bytes = (size_t)256 << 20, block = 0;
    void *ws = NULL;
    while (ws_bytes >= ((size_t)1 << 20) && !(ws = ampc__cu_scratch(ws_bytes, &block))) {
        ampc_clear_error();
        ws_bytes /= 2;
    }
    if (!ws) ws_bytes = 0;
    if (pass == PASS_FWD)
        PICK_TIMED(cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
                   cudnnFindConvolutionForwardAlgorithmEx(h, c->x, a, c->w, b, c->conv, c->y, out, CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
                                                          &got, perf, ws, ws_bytes));
    else if (pass == PASS_BWD_DATA)
        PICK_TIMED(cudnnConvolutionBwdDataAlgoPerf_t, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
                   cudnnFindConvolutionBackwardDataAlgorithmEx(h, c->w, b, c->y, a, c->conv, c->x, out,
                                                               CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &got, perf, ws, ws_bytes));
    else
        PICK_TIMED(cudnnConvolutionBwdFilterAlgoPerf_t, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT,
                   cudnnFindConvolutionBackwardFilterAlgorithmEx(h, c->x, a, c->y, b, c->conv, c->w, out,
                                                                 CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &got, perf, ws, ws_bytes));
    ampc__cu_scratch_free(ws, block);
    if (rc >= 0 && found) rc = dnn_check(cudnnSetConvolutionMathType(c->conv, e->math), "cudnnSetConvolutionMathType");
    *found_out = found;
    return rc;
}

/* The cached choice for (d, dt, pass), picked on first use (timed when ampc_cudnn_benchmark(),
   else cuDNN's heuristics; the heuristics too when no timed one qualifies); sets the
   descriptor's math type. a, b, out: the pass's operands (the timed trials run on them). */
static int algo_get(cudnnHandle_t h, const conv_descs *c, const ampc_conv_desc *d, ampc_dtype dt, conv_pass pass,
                    cudnnMathType_t math, const void *a, const void *b, void *out_ptr, algo_entry *out) {
    int64_t key[KEY_LEN];
    bool bench = ampc_cudnn_benchmark();
    make_key(d, dt, pass, math, bench, key);
    for (int i = 0; i < cache_n; i++)
        if (!memcmp(cache[i].key, key, sizeof key)) {
            *out = cache[i];
            return dnn_check(cudnnSetConvolutionMathType(c->conv, out->math), "cudnnSetConvolutionMathType");
        }
    algo_entry e;
    memcpy(e.key, key, sizeof key);
    bool strict = dt == AMPC_F32 && math == CUDNN_FMA_MATH, timed = false;
    int rc = bench ? time_algo(h, c, pass, strict, a, b, out_ptr, &e, &timed) : AMPC_OK;
    if (rc >= 0 && !timed) rc = pick_algo(h, c, pass, strict, &e, pass_name(pass));
    if (rc < 0) return rc;
    int slot = cache_n < ALGO_CACHE ? cache_n++ : cache_next++ % ALGO_CACHE;
    cache[slot] = e;
    *out = e;
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// One cuDNN pass: PASS_FWD y = conv(a = x, b = w); PASS_BWD_DATA gx = (a = gy, b = w);
// PASS_BWD_FILTER dw = (a = x, b = gy). w / dw in the filter layout of the format (KRSC for NHWC).

static int run_pass(const ampc_conv_desc *d, ampc_dtype dt, conv_pass pass, const void *a, const void *b, void *out) {
    const char *k = pass_name(pass);
    cudnnHandle_t h;
    int rc = handle_get(&h);
    if (rc < 0) return rc;
    conv_descs c;
    cudnnMathType_t math = wanted_math(dt);
    if ((rc = descs_make(d, dt, math, &c, k)) < 0) return rc;
    algo_entry e;
    void *ws = NULL;
    size_t ws_bytes = 0;
    const float one = 1.0f, zero = 0.0f;
    if ((rc = algo_get(h, &c, d, dt, pass, math, a, b, out, &e)) < 0) goto out;
    if (e.ws && !(ws = ampc__cu_scratch(e.ws, &ws_bytes))) {
        rc = ampc_last_status();
        goto out;
    }
    if (pass == PASS_FWD)
        rc = dnn_check(cudnnConvolutionForward(h, &one, c.x, a, c.w, b, c.conv, (cudnnConvolutionFwdAlgo_t)e.algo, ws, e.ws, &zero,
                                               c.y, out),
                       "cudnnConvolutionForward");
    else if (pass == PASS_BWD_DATA)
        rc = dnn_check(cudnnConvolutionBackwardData(h, &one, c.w, b, c.y, a, c.conv, (cudnnConvolutionBwdDataAlgo_t)e.algo, ws, e.ws,
                                                    &zero, c.x, out),
                       "cudnnConvolutionBackwardData");
    else
        rc = dnn_check(cudnnConvolutionBackwardFilter(h, &one, c.x, a, c.y, b, c.conv, (cudnnConvolutionBwdFilterAlgo_t)e.algo, ws,
                                                      e.ws, &zero, c.w, out),
                       "cudnnConvolutionBackwardFilter");
    ampc__cu_scratch_free(ws, ws_bytes);
out:
    descs_free(&c);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// The filter layout

/* w as cuDNN wants it: OIHW as it is, or permuted into KRSC scratch for NHWC (*tmp to free) */
static int filter_in(const ampc_conv_desc *d, const ampc_tensor *w, const void **wp, void **tmp, size_t *tmp_bytes) {
    *tmp = NULL;
    *wp = ampc__data(w);
    if (!d->channels_last) return AMPC_OK;
    if (!(*tmp = ampc__cu_scratch(ampc__nbytes(w), tmp_bytes))) return ampc_last_status();
    *wp = *tmp;
    return ampc__cu_check(ampc_cu_convert_permute(ampc__data(w), w->dtype, *tmp, w->dtype, d->O, d->C / d->groups, d->KH * d->KW,
                                                  true, ampc__cu_stream()),
                          "conv2d filter to KRSC");
}

/* run_pass of PASS_FWD (a = x, out = y) or PASS_BWD_DATA (a = gy, out = gx) with w in cuDNN's
   filter layout */
static int run_with_filter(const ampc_conv_desc *d, conv_pass pass, const ampc_tensor *a, const ampc_tensor *w, ampc_tensor *out) {
    const void *wp;
    void *tmp;
    size_t tmp_bytes = 0;
    int rc = filter_in(d, w, &wp, &tmp, &tmp_bytes);
    if (rc >= 0) rc = run_pass(d, a->dtype, pass, ampc__data(a), wp, ampc__data(out));
    ampc__cu_scratch_free(tmp, tmp_bytes);
    return rc;
}

static int zero_fill(ampc_tensor *t, const char *k) {
    return ampc__cu_check(cudaMemsetAsync(ampc__data(t), 0, ampc__nbytes(t), ampc__cu_stream()), k);   /* +0 in every float dtype */
}

// ---------------------------------------------------------------------------------------------
// Kernels

static int cu_conv2d(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *w, const ampc_tensor *b, ampc_tensor *y) {
    const char *k = "conv2d";
    int rc = ampc__cu_ready();   /* the arguments: checked by the door (dispatch.c) */
    if (rc < 0 || y->numel == 0) return rc;
    pthread_mutex_lock(&conv_lock);
    if (x->numel == 0 || w->numel == 0) {
        rc = zero_fill(y, k);   /* no input channels: y is the bias */
    } else {
        rc = run_with_filter(d, PASS_FWD, x, w, y);
    }
    if (rc >= 0 && b) {
        ampc_cu_chan_geom g = {.N = d->N, .C = d->O, .S = d->OH * d->OW, .cl = d->channels_last};
        rc = ampc__cu_check(ampc_cu_bias_add(&g, y->dtype, ampc__data(y), ampc__data(b), ampc__cu_stream()), "conv2d bias");
    }
    pthread_mutex_unlock(&conv_lock);
    return rc;
}

static int cu_conv2d_backward_data(const ampc_conv_desc *d, const ampc_tensor *gy, const ampc_tensor *w, ampc_tensor *gx) {
    const char *k = "conv2d_backward_data";
    int rc = ampc__cu_ready();
    if (rc < 0 || gx->numel == 0) return rc;
    pthread_mutex_lock(&conv_lock);
    if (gy->numel == 0 || w->numel == 0) {
        rc = zero_fill(gx, k);
    } else {
        rc = run_with_filter(d, PASS_BWD_DATA, gy, w, gx);
    }
    pthread_mutex_unlock(&conv_lock);
    return rc;
}

static int cu_conv2d_backward_weights(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *gy, ampc_tensor *gw,
                                      ampc_tensor *gb) {
    const char *k = "conv2d_backward_weights";
    int rc = ampc__cu_ready();
    if (rc < 0) return rc;
    ampc_dtype dt = x->dtype;   /* gw / gb: dt, or f32 for 16-bit data (the autocast weight gradient) */
    pthread_mutex_lock(&conv_lock);
    if (gw->numel > 0 && (x->numel == 0 || gy->numel == 0)) {
        rc = zero_fill(gw, k);
    } else if (gw->numel > 0) {
        /* cuDNN writes dw in the data dtype and the format's filter layout: into gw directly when
           both agree, else into scratch converted (and permuted from KRSC) into gw */
        bool direct = !d->channels_last && gw->dtype == dt;
        void *dw = ampc__data(gw);
        size_t bytes = 0;
        if (!direct && !(dw = ampc__cu_scratch((size_t)gw->numel * ampc__dt(dt)->size, &bytes))) {
            rc = ampc_last_status();
        } else {
            rc = run_pass(d, dt, PASS_BWD_FILTER, ampc__data(x), ampc__data(gy), dw);
            if (rc >= 0 && !direct)
                rc = ampc__cu_check(d->channels_last
                                        ? ampc_cu_convert_permute(dw, dt, ampc__data(gw), gw->dtype, d->O, d->C / d->groups, d->KH * d->KW,
                                                                  false, ampc__cu_stream())
                                        : ampc_cu_convert(dw, dt, ampc__data(gw), gw->dtype, gw->numel, ampc__cu_stream()),
                                    "conv2d weight gradient to OIHW");
            if (!direct) ampc__cu_scratch_free(dw, bytes);
        }
    }
    if (rc >= 0 && gb && d->O > 0) {
        ampc_cu_chan_geom g = {.N = d->N, .C = d->O, .S = d->OH * d->OW, .cl = d->channels_last};
        ampc_cu_chan_scratch s;
        if ((rc = ampc__cu_chan_scratch(&s, &g, 1, 0)) >= 0) {
            rc = ampc__cu_check(ampc_cu_chan_sum(&g, dt, ampc__data(gy), s.part, s.P, ampc__data(gb), gb->dtype, ampc__cu_stream()),
                                "conv2d bias gradient");
            ampc__cu_chan_scratch_free(&s);
        }
    }
    pthread_mutex_unlock(&conv_lock);
    return rc;
}

void ampc__cuda_register_conv(ampc_backend *be) {
    be->conv2d = cu_conv2d;
    be->conv2d_backward_data = cu_conv2d_backward_data;
    be->conv2d_backward_weights = cu_conv2d_backward_weights;
}
