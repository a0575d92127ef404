/*
 * conv.c - REF 2-D convolution: direct f64 loops over NCHW / OIHW, written from the definition
 * (independent of the CPU code): the oracle the oneDNN kernels are tested against.
 *
 *   y[n, o, oh, ow] = b[o] + sum_{c, i, j} x[n, g*Cg + c, oh*s - p + i*d, ow*s - p + j*d] * w[o, c, i, j]
 *
 * with g = o / (O/groups), Cg = C/groups and out-of-range input positions reading zero. The
 * data gradient scatters each gy element back along the same index map; the weight gradient
 * gathers gy * x over (n, oh, ow); the bias gradient sums gy over (n, oh, ow).
 */
#include "backend/backend.h"


/* Input row/column read by output position o and kernel tap k; may be outside [0, n). */
static int64_t in_pos(int64_t o, int64_t k, int s, int p, int dil) { return o * s - p + k * dil; }

static int ref_conv2d(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *w, const ampc_tensor *b, ampc_tensor *y) {
    const double *X = ampc__data(x), *Wt = ampc__data(w), *B = b ? ampc__data(b) : NULL;
    double *Y = ampc__data(y);
    int64_t Cg = d->C / d->groups, Og = d->O / d->groups;
    for (int64_t n = 0; n < d->N; n++)
        for (int64_t o = 0; o < d->O; o++) {
            int64_t g = o / Og;
            for (int64_t oh = 0; oh < d->OH; oh++)
                for (int64_t ow = 0; ow < d->OW; ow++) {
                    double s = B ? B[o] : 0.0;
                    for (int64_t c = 0; c < Cg; c++)
                        for (int64_t i = 0; i < d->KH; i++) {
                            int64_t ih = in_pos(oh, i, d->stride[0], d->padding[0], d->dilation[0]);
                            if (ih < 0 || ih >= d->H) continue;
                            for (int64_t j = 0; j < d->KW; j++) {
                                int64_t iw = in_pos(ow, j, d->stride[1], d->padding[1], d->dilation[1]);
                                if (iw < 0 || iw >= d->W) continue;
                                s += X[((n * d->C + g * Cg + c) * d->H + ih) * d->W + iw] * Wt[((o * Cg + c) * d->KH + i) * d->KW + j];
                            }
                        }
                    Y[((n * d->O + o) * d->OH + oh) * d->OW + ow] = s;
                }
        }
    return AMPC_OK;
}

static int ref_conv2d_backward_data(const ampc_conv_desc *d, const ampc_tensor *gy, const ampc_tensor *w, ampc_tensor *gx) {
    const double *GY = ampc__data(gy), *Wt = ampc__data(w);
    double *GX = ampc__data(gx);
    int64_t Cg = d->C / d->groups, Og = d->O / d->groups;
    for (int64_t i = 0; i < gx->numel; i++) GX[i] = 0.0;
    for (int64_t n = 0; n < d->N; n++)
        for (int64_t o = 0; o < d->O; o++) {
            int64_t g = o / Og;
            for (int64_t oh = 0; oh < d->OH; oh++)
                for (int64_t ow = 0; ow < d->OW; ow++) {
                    double gv = GY[((n * d->O + o) * d->OH + oh) * d->OW + ow];
                    for (int64_t c = 0; c < Cg; c++)
                        for (int64_t i = 0; i < d->KH; i++) {
                            int64_t ih = in_pos(oh, i, d->stride[0], d->padding[0], d->dilation[0]);
                            if (ih < 0 || ih >= d->H) continue;
                            for (int64_t j = 0; j < d->KW; j++) {
                                int64_t iw = in_pos(ow, j, d->stride[1], d->padding[1], d->dilation[1]);
                                if (iw < 0 || iw >= d->W) continue;
                                GX[((n * d->C + g * Cg + c) * d->H + ih) * d->W + iw] += gv * Wt[((o * Cg + c) * d->KH + i) * d->KW + j];
                            }
                        }
                }
        }
    return AMPC_OK;
}

static int ref_conv2d_backward_weights(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *gy, ampc_tensor *gw,
                                       ampc_tensor *gb) {
    const double *X = ampc__data(x), *GY = ampc__data(gy);
    double *GW = ampc__data(gw), *GB = gb ? ampc__data(gb) : NULL;
    int64_t Cg = d->C / d->groups, Og = d->O / d->groups;
    for (int64_t o = 0; o < d->O; o++) {
        int64_t g = o / Og;
        for (int64_t c = 0; c < Cg; c++)
            for (int64_t i = 0; i < d->KH; i++)
                for (int64_t j = 0; j < d->KW; j++) {
                    double s = 0.0;
                    for (int64_t n = 0; n < d->N; n++)
                        for (int64_t oh = 0; oh < d->OH; oh++) {
                            int64_t ih = in_pos(oh, i, d->stride[0], d->padding[0], d->dilation[0]);
                            if (ih < 0 || ih >= d->H) continue;
                            for (int64_t ow = 0; ow < d->OW; ow++) {
                                int64_t iw = in_pos(ow, j, d->stride[1], d->padding[1], d->dilation[1]);
                                if (iw < 0 || iw >= d->W) continue;
                                s += GY[((n * d->O + o) * d->OH + oh) * d->OW + ow] * X[((n * d->C + g * Cg + c) * d->H + ih) * d->W + iw];
                            }
                        }
                    GW[((o * Cg + c) * d->KH + i) * d->KW + j] = s;
                }
        if (GB) {
            double s = 0.0;
            for (int64_t n = 0; n < d->N; n++)
                for (int64_t p = 0; p < d->OH * d->OW; p++) s += GY[(n * d->O + o) * d->OH * d->OW + p];
            GB[o] = s;
        }
    }
    return AMPC_OK;
}

void ampc__ref_register_conv(ampc_backend *be) {
    be->conv2d = ref_conv2d;
    be->conv2d_backward_data = ref_conv2d_backward_data;
    be->conv2d_backward_weights = ref_conv2d_backward_weights;
}
