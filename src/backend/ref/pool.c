/*
 * pool.c - REF kernels: 2-D max/average/adaptive pooling and the strided block copy, plain f64
 * loops written from PyTorch's CPU kernels (the oracle the CPU backend is tested against).
 *
 * Max pooling follows PyTorch exactly: a value wins if it is greater than the running maximum
 * or NaN (so NaN propagates and ties go to the first maximum); the workspace holds the winner's
 * index within its (H, W) plane, int64 per output, and the backward scatters gy there.
 */
#include "backend/backend.h"

#include <math.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Windows

/* Rows [*lo, *hi) of x that window o reads, and *count, the divisor of average pooling. */
static void window(const ampc_pool_desc *d, int axis, int64_t o, int64_t *lo, int64_t *hi, int64_t *count) {
    int64_t size = axis ? d->W : d->H, out = axis ? d->OW : d->OH;
    if (d->kind == AMPC_POOL_ADAPTIVE_AVG) {
        *lo = o * size / out;                       /* floor */
        *hi = ((o + 1) * size + out - 1) / out;     /* ceil */
        *count = *hi - *lo;
        return;
    }
    int64_t start = o * d->stride[axis] - d->pad_begin[axis];
    int64_t end = start + d->kernel[axis];
    int64_t padded_end = end < size + d->pad_begin[axis] ? end : size + d->pad_begin[axis];
    *lo = start > 0 ? start : 0;
    *hi = end < size ? end : size;
    *count = d->kind == AMPC_POOL_AVG_INCLUDE_PAD ? padded_end - start : *hi - *lo;
}

// ---------------------------------------------------------------------------------------------
// Kernels

static size_t ref_pool2d_workspace_size(const ampc_pool_desc *d, ampc_dtype dt) {
    (void)dt;
    return d->kind == AMPC_POOL_MAX ? (size_t)(d->N * d->C * d->OH * d->OW) * sizeof(int64_t) : 0;
}

static int ref_pool2d(const ampc_pool_desc *d, const ampc_tensor *x, ampc_tensor *y, void *ws) {
    const double *X = ampc__data(x);
    double *Y = ampc__data(y);
    int64_t *idx = ws;
    for (int64_t p = 0; p < d->N * d->C; p++) {
        const double *plane = X + p * d->H * d->W;
        for (int64_t oh = 0; oh < d->OH; oh++) {
            int64_t h0, h1, ch;
            window(d, 0, oh, &h0, &h1, &ch);
            for (int64_t ow = 0; ow < d->OW; ow++) {
                int64_t w0, w1, cw, o = (p * d->OH + oh) * d->OW + ow;
                window(d, 1, ow, &w0, &w1, &cw);
                if (d->kind == AMPC_POOL_MAX) {
                    double m = -INFINITY;
                    int64_t at = h0 * d->W + w0;
                    for (int64_t h = h0; h < h1; h++)
                        for (int64_t w = w0; w < w1; w++) {
                            double v = plane[h * d->W + w];
                            if (v > m || isnan(v)) m = v, at = h * d->W + w;
                        }
                    Y[o] = m;
                    if (idx) idx[o] = at;
                } else {
                    double s = 0;
                    for (int64_t h = h0; h < h1; h++)
                        for (int64_t w = w0; w < w1; w++) s += plane[h * d->W + w];
                    Y[o] = h0 < h1 && w0 < w1 ? s / (double)(ch * cw) : 0.0;
                }
            }
        }
    }
    return AMPC_OK;
}

static int ref_pool2d_backward(const ampc_pool_desc *d, const ampc_tensor *gy, ampc_tensor *gx, const void *ws) {
    const double *GY = ampc__data(gy);
    double *GX = ampc__data(gx);
    const int64_t *idx = ws;
    memset(GX, 0, ampc__nbytes(gx));
    if (gy->numel == 0) return AMPC_OK;
    for (int64_t p = 0; p < d->N * d->C; p++) {
        double *plane = GX + p * d->H * d->W;
        for (int64_t oh = 0; oh < d->OH; oh++) {
            int64_t h0, h1, ch;
            window(d, 0, oh, &h0, &h1, &ch);
            for (int64_t ow = 0; ow < d->OW; ow++) {
                int64_t w0, w1, cw, o = (p * d->OH + oh) * d->OW + ow;
                window(d, 1, ow, &w0, &w1, &cw);
                if (d->kind == AMPC_POOL_MAX) {
                    plane[idx[o]] += GY[o];
                } else {
                    double g = GY[o] / (double)(ch * cw);
                    for (int64_t h = h0; h < h1; h++)
                        for (int64_t w = w0; w < w1; w++) plane[h * d->W + w] += g;
                }
            }
        }
    }
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Block copy

static int ref_copy_block(const ampc_tensor *src, int64_t src_off, int64_t src_ld, ampc_tensor *dst, int64_t dst_off,
                          int64_t dst_ld, int64_t rows, int64_t cols, double scale) {
    if (src->dtype == AMPC_I64) {
        const int64_t *s = ampc__data(src);
        int64_t *t = ampc__data(dst);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++) t[r * dst_ld + dst_off + c] = s[r * src_ld + src_off + c];
    } else {
        const double *s = ampc__data(src);
        double *t = ampc__data(dst);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++) t[r * dst_ld + dst_off + c] = s[r * src_ld + src_off + c] * scale;
    }
    return AMPC_OK;
}

void ampc__ref_register_pool(ampc_backend *be) {
    be->pool2d_workspace_size = ref_pool2d_workspace_size;
    be->pool2d = ref_pool2d;
    be->pool2d_backward = ref_pool2d_backward;
    be->copy_block = ref_copy_block;
}
