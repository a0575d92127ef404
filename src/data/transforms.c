/*
 * transforms.c - per-sample image transforms on f32 CHW buffers: resize, random horizontal
 * flip, random affine (torchvision's RandomAffine, albumentations' ShiftScaleRotate), normalize;
 * applied in the order they were added.
 *
 * Reproducibility: op j of the pipeline on sample `index` in epoch `epoch` takes its four
 * random numbers from Philox block (index * AMPC__TF_MAX_OPS + j) under the key for
 * (seed, epoch); an affine op applied with probability p < 1 draws that choice from block
 * (2^63 | that counter). Nothing depends on which thread runs the sample or in what order, so any
 * number of loader workers produces bit-identical batches.
 *
 * Interpolation uses the form a + f*(b - a), so a constant region stays exactly constant and
 * an identity affine (f = 0 everywhere) returns its input bit for bit.
 */
#include "data/data.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define AMPC__TF_MAX_OPS 64
#define AMPC__TF_MAX_SIDE 32768
/* Philox counters of the affine ops' apply-or-not draws: a half of the counter space of their own */
#define AFFINE_P_COUNTER (UINT64_C(1) << 63)

typedef enum { TF_RESIZE, TF_HFLIP, TF_AFFINE, TF_NORMALIZE } tf_kind;

typedef struct {
    tf_kind kind;
    int64_t h, w;                    /* resize */
    double p;                        /* hflip, affine: the probability of applying it */
    double shift, smin, smax, deg;   /* affine */
    ampc_border border;              /* affine: what fills points from outside the image */
    bool ccw;                        /* affine: positive angles turn counter-clockwise (OpenCV's) */
    int n;                           /* normalize: channel count (1 = all) */
    float *mean, *std;               /* (n) */
} tf_op;

struct ampc_transforms {
    uint64_t gen;   /* generation while live, 0 once freed (a handle pool's object) */
    int n;
    tf_op ops[AMPC__TF_MAX_OPS];
};

// ---------------------------------------------------------------------------------------------
// Building

static ampc_handle_pool transforms_pool = {.obj_size = sizeof(ampc_transforms)};

/* True (the error recorded) when t is a stale handle; NULL is each call's own case. */
static bool stale(const ampc_transforms *t, const char *call) {
    return t && ampc__check_handle(t, t->gen, call, "transforms", "freed") < 0;
}

ampc_transforms *ampc_transforms_new(void) {
    ampc_transforms *t = ampc__handle_pool_get(&transforms_pool);
    if (t) t->gen = ampc__new_gen();
    return t;
}

void ampc_transforms_free(ampc_transforms *t) {
    if (!t || stale(t, "ampc_transforms_free")) return;
    for (int j = 0; j < t->n; j++) {
        free(t->ops[j].mean);
        free(t->ops[j].std);
    }
    t->gen = 0;
    ampc__handle_pool_put(&transforms_pool, t);
}

static tf_op *push(ampc_transforms *t, tf_kind kind) {
    if (!t) return ampc__err_null(AMPC_ERR_INVALID, "transforms: NULL pipeline");
    if (t->n == AMPC__TF_MAX_OPS)
        return ampc__err_null(AMPC_ERR_INVALID, "transforms: more than %d ops", AMPC__TF_MAX_OPS);
    tf_op *op = &t->ops[t->n];
    memset(op, 0, sizeof *op);
    op->kind = kind;
    return op;
}

int ampc_transforms_add_resize(ampc_transforms *t, int64_t h, int64_t w) {
    if (stale(t, "ampc_transforms_add_resize")) return AMPC_ERR_STATE;
    if (h < 1 || w < 1 || h > AMPC__TF_MAX_SIDE || w > AMPC__TF_MAX_SIDE)
        return ampc__err(AMPC_ERR_INVALID, "transforms_add_resize: size %lld x %lld not in [1, %d]", (long long)h,
                         (long long)w, AMPC__TF_MAX_SIDE);
    tf_op *op = push(t, TF_RESIZE);
    if (!op) return ampc_last_status();
    op->h = h;
    op->w = w;
    t->n++;
    return AMPC_OK;
}

int ampc_transforms_add_hflip(ampc_transforms *t, double p) {
    if (stale(t, "ampc_transforms_add_hflip")) return AMPC_ERR_STATE;
    if (!(p >= 0.0 && p <= 1.0)) return ampc__err(AMPC_ERR_INVALID, "transforms_add_hflip: p = %g not in [0, 1]", p);
    tf_op *op = push(t, TF_HFLIP);
    if (!op) return ampc_last_status();
    op->p = p;
    t->n++;
    return AMPC_OK;
}

static int add_affine(ampc_transforms *t, const char *who, double p, double max_shift, double scale_min,
                      double scale_max, double degrees, ampc_border border, bool ccw) {
    if (!(p >= 0.0 && p <= 1.0)) return ampc__err(AMPC_ERR_INVALID, "%s: p = %g not in [0, 1]", who, p);
    if (!(max_shift >= 0.0 && max_shift <= 1.0))
        return ampc__err(AMPC_ERR_INVALID, "%s: shift %g not in [0, 1]", who, max_shift);
    if (!(scale_min > 0.0 && scale_min <= scale_max && isfinite(scale_max)))
        return ampc__err(AMPC_ERR_INVALID, "%s: scale range [%g, %g] must satisfy 0 < min <= max", who, scale_min, scale_max);
    if (!(degrees >= 0.0 && degrees <= 180.0))
        return ampc__err(AMPC_ERR_INVALID, "%s: degrees %g not in [0, 180]", who, degrees);
    if (border != AMPC_BORDER_ZERO && border != AMPC_BORDER_REFLECT_101)
        return ampc__err(AMPC_ERR_INVALID, "%s: unknown border mode %d", who, (int)border);
    tf_op *op = push(t, TF_AFFINE);
    if (!op) return ampc_last_status();
    op->p = p;
    op->shift = max_shift;
    op->smin = scale_min;
    op->smax = scale_max;
    op->deg = degrees;
    op->border = border;
    op->ccw = ccw;
    t->n++;
    return AMPC_OK;
}

int ampc_transforms_add_affine(ampc_transforms *t, double max_shift, double scale_min, double scale_max,
                               double degrees) {
    if (stale(t, "ampc_transforms_add_affine")) return AMPC_ERR_STATE;
    return add_affine(t, "transforms_add_affine", 1.0, max_shift, scale_min, scale_max, degrees, AMPC_BORDER_ZERO, false);
}

int ampc_transforms_add_shift_scale_rotate(ampc_transforms *t, double p, double shift_limit, double scale_limit,
                                           double rotate_limit, ampc_border border) {
    if (stale(t, "ampc_transforms_add_shift_scale_rotate")) return AMPC_ERR_STATE;
    if (!(scale_limit >= 0.0 && scale_limit < 1.0))
        return ampc__err(AMPC_ERR_INVALID, "transforms_add_shift_scale_rotate: scale_limit %g not in [0, 1)", scale_limit);
    return add_affine(t, "transforms_add_shift_scale_rotate", p, shift_limit, 1.0 - scale_limit, 1.0 + scale_limit,
                      rotate_limit, border, true);
}

int ampc_transforms_add_normalize(ampc_transforms *t, int n, const float *mean, const float *std) {
    if (stale(t, "ampc_transforms_add_normalize")) return AMPC_ERR_STATE;
    if (n < 1 || !mean || !std) return ampc__err(AMPC_ERR_INVALID, "transforms_add_normalize: n = %d, mean/std NULL?", n);
    for (int k = 0; k < n; k++)
        if (!isfinite(mean[k]) || !(std[k] > 0.0f) || !isfinite(std[k]))
            return ampc__err(AMPC_ERR_INVALID, "transforms_add_normalize: channel %d has mean %g, std %g (need finite, std > 0)",
                             k, (double)mean[k], (double)std[k]);
    float *m = malloc((size_t)n * sizeof *m), *s = malloc((size_t)n * sizeof *s);
    tf_op *op = m && s ? push(t, TF_NORMALIZE) : NULL;
    if (!op) {
        free(m);
        free(s);
        return m && s ? ampc_last_status() : ampc__err(AMPC_ERR_OOM, "transforms_add_normalize: out of memory");
    }
    memcpy(m, mean, (size_t)n * sizeof *m);
    memcpy(s, std, (size_t)n * sizeof *s);
    op->n = n;
    op->mean = m;
    op->std = s;
    t->n++;
    return AMPC_OK;
}

ampc_transforms *ampc__transforms_clone(const ampc_transforms *t) {
    ampc_transforms *c = ampc_transforms_new();
    if (!c || !t) return c;
    const uint64_t gen = c->gen;
    *c = *t;
    c->gen = gen;
    for (int j = 0; j < c->n; j++) {
        tf_op *op = &c->ops[j];
        if (op->kind != TF_NORMALIZE) continue;
        float *m = malloc((size_t)op->n * sizeof *m), *s = malloc((size_t)op->n * sizeof *s);
        if (m) memcpy(m, op->mean, (size_t)op->n * sizeof *m);
        if (s) memcpy(s, op->std, (size_t)op->n * sizeof *s);
        op->mean = m;
        op->std = s;
        if (!m || !s) {
            for (int k = j + 1; k < c->n; k++) c->ops[k].mean = c->ops[k].std = NULL;   /* not ours */
            ampc_transforms_free(c);
            return ampc__err_null(AMPC_ERR_OOM, "transforms: out of memory");
        }
    }
    return c;
}

// ---------------------------------------------------------------------------------------------
// Shapes

int ampc_transforms_output_shape(const ampc_transforms *t, int64_t c, int64_t h, int64_t w, int64_t *oc,
                                 int64_t *oh, int64_t *ow) {
    if (stale(t, "ampc_transforms_output_shape")) return AMPC_ERR_STATE;
    if (c < 1 || h < 1 || w < 1)
        return ampc__err(AMPC_ERR_SHAPE, "transforms: input shape (%lld, %lld, %lld) has an empty dimension",
                         (long long)c, (long long)h, (long long)w);
    for (int j = 0; t && j < t->n; j++) {
        const tf_op *op = &t->ops[j];
        if (op->kind == TF_RESIZE) {
            h = op->h;
            w = op->w;
        } else if (op->kind == TF_NORMALIZE && op->n != 1 && op->n != c) {
            return ampc__err(AMPC_ERR_SHAPE, "transforms: normalize (op %d) has %d channels, the image has %lld", j,
                             op->n, (long long)c);
        }
    }
    if (oc) *oc = c;
    if (oh) *oh = h;
    if (ow) *ow = w;
    return AMPC_OK;
}

int64_t ampc__transforms_scratch_floats(const ampc_transforms *t, int64_t c, int64_t h, int64_t w) {
    int64_t most = c * h * w;
    for (int j = 0; t && j < t->n; j++)
        if (t->ops[j].kind == TF_RESIZE && c * t->ops[j].h * t->ops[j].w > most) most = c * t->ops[j].h * t->ops[j].w;
    return most;
}

// ---------------------------------------------------------------------------------------------
// Kernels (one sample, CHW)

static void resize(const float *in, int64_t c, int64_t h, int64_t w, float *out, int64_t oh, int64_t ow) {
    /* Half-pixel centres, source clamped at 0 and the last row/column (align_corners=False). */
    const float sh = (float)h / (float)oh, sw = (float)w / (float)ow;
    for (int64_t y = 0; y < oh; y++) {
        float fy = ((float)y + 0.5f) * sh - 0.5f;
        if (fy < 0.0f) fy = 0.0f;
        int64_t y0 = (int64_t)fy;
        if (y0 > h - 1) y0 = h - 1;
        int64_t y1 = y0 + (y0 < h - 1);
        float ly = fy - (float)y0;
        for (int64_t x = 0; x < ow; x++) {
            float fx = ((float)x + 0.5f) * sw - 0.5f;
            if (fx < 0.0f) fx = 0.0f;
            int64_t x0 = (int64_t)fx;
            if (x0 > w - 1) x0 = w - 1;
            int64_t x1 = x0 + (x0 < w - 1);
            float lx = fx - (float)x0;
            for (int64_t ch = 0; ch < c; ch++) {
                const float *p = in + ch * h * w;
                float top = p[y0 * w + x0] + lx * (p[y0 * w + x1] - p[y0 * w + x0]);
                float bot = p[y1 * w + x0] + lx * (p[y1 * w + x1] - p[y1 * w + x0]);
                out[(ch * oh + y) * ow + x] = top + ly * (bot - top);
            }
        }
    }
}

static void hflip(const float *in, int64_t c, int64_t h, int64_t w, float *out, bool flip) {
    if (!flip) {
        memcpy(out, in, (size_t)(c * h * w) * sizeof *out);
        return;
    }
    for (int64_t r = 0; r < c * h; r++)
        for (int64_t x = 0; x < w; x++) out[r * w + x] = in[r * w + (w - 1 - x)];
}

static inline float pixel_or_zero(const float *p, int64_t h, int64_t w, int64_t y, int64_t x) {
    return (y >= 0 && y < h && x >= 0 && x < w) ? p[y * w + x] : 0.0f;
}

/* OpenCV's BORDER_REFLECT_101 (gfedcb|abcdefgh|gfedcba) of an integral coordinate i, any size:
   period 2(n - 1), reduced in double so a point far outside cannot overflow. */
static inline int64_t reflect_101(double i, int64_t n) {
    if (n == 1) return 0;
    const double period = 2.0 * (double)(n - 1);
    double r = fmod(fabs(i), period);   /* the reflection is symmetric about 0 */
    int64_t k = (int64_t)r;
    return k < n ? k : 2 * (n - 1) - k;
}

void ampc__affine(const float *in, int64_t c, int64_t h, int64_t w, float *out, double angle_deg, double scale, double tx,
                  double ty, ampc_border border) {
    /* out(x, y) = in(A^-1 (x - c - t) + c), A = rotation(angle) * scale, bilinear */
    const double a = angle_deg * (M_PI / 180.0);
    const double ca = cos(a) / scale, sa = sin(a) / scale;
    const double cx = (double)(w - 1) * 0.5, cy = (double)(h - 1) * 0.5;
    const int64_t plane = h * w;
    const bool zero = border == AMPC_BORDER_ZERO;
    for (int64_t y = 0; y < h; y++) {
        const double dy = (double)y - cy - ty;
        /* source point of (x, y) = row origin + x * (ca, -sa): exact for the identity map */
        const double ox = ca * (-cx - tx) + sa * dy + cx, oy = -sa * (-cx - tx) + ca * dy + cy;
        for (int64_t x = 0; x < w; x++) {
            const double sx = ox + (double)x * ca, sy = oy - (double)x * sa;
            const double flx = floor(sx), fly = floor(sy);
            float *o = out + y * w + x;
            const float lx = (float)(sx - flx), ly = (float)(sy - fly);
            if (!zero) {   /* every neighbour is some pixel of the image */
                const int64_t x0 = reflect_101(flx, w), x1 = reflect_101(flx + 1.0, w);
                const int64_t y0 = reflect_101(fly, h), y1 = reflect_101(fly + 1.0, h);
                for (int64_t ch = 0; ch < c; ch++) {
                    const float *p = in + ch * plane;
                    const float v00 = p[y0 * w + x0], v01 = p[y0 * w + x1], v10 = p[y1 * w + x0], v11 = p[y1 * w + x1];
                    const float top = v00 + lx * (v01 - v00), bot = v10 + lx * (v11 - v10);
                    o[ch * plane] = top + ly * (bot - top);
                }
                continue;
            }
            if (!(flx > -2.0 && flx < (double)w && fly > -2.0 && fly < (double)h)) {
                for (int64_t ch = 0; ch < c; ch++) o[ch * plane] = 0.0f;
                continue;
            }
            const int64_t x0 = (int64_t)flx, y0 = (int64_t)fly;
            const bool inside = x0 >= 0 && y0 >= 0 && x0 + 1 < w && y0 + 1 < h;
            for (int64_t ch = 0; ch < c; ch++) {
                const float *p = in + ch * plane;
                float v00, v01, v10, v11;
                if (inside) {
                    const float *q = p + y0 * w + x0;
                    v00 = q[0], v01 = q[1], v10 = q[w], v11 = q[w + 1];
                } else {
                    v00 = pixel_or_zero(p, h, w, y0, x0), v01 = pixel_or_zero(p, h, w, y0, x0 + 1);
                    v10 = pixel_or_zero(p, h, w, y0 + 1, x0), v11 = pixel_or_zero(p, h, w, y0 + 1, x0 + 1);
                }
                const float top = v00 + lx * (v01 - v00), bot = v10 + lx * (v11 - v10);
                o[ch * plane] = top + ly * (bot - top);
            }
        }
    }
}

static void normalize(const float *in, int64_t c, int64_t h, int64_t w, float *out, const tf_op *op) {
    for (int64_t ch = 0; ch < c; ch++) {
        const float m = op->mean[op->n == 1 ? 0 : ch], s = op->std[op->n == 1 ? 0 : ch];
        const float *p = in + ch * h * w;
        float *q = out + ch * h * w;
        for (int64_t k = 0; k < h * w; k++) q[k] = (p[k] - m) / s;
    }
}

// ---------------------------------------------------------------------------------------------
// Running a pipeline

static inline double unit(uint32_t u) { return (double)(u >> 8) * 0x1p-24; }   /* [0, 1) */

int ampc__transforms_run(const ampc_transforms *t, int64_t c, int64_t h, int64_t w, const float *in, float *out,
                         float *scratch0, float *scratch1, uint64_t seed, int64_t epoch, int64_t index) {
    if (!t || t->n == 0) {
        memmove(out, in, (size_t)(c * h * w) * sizeof *out);
        return AMPC_OK;
    }
    int rc = ampc_transforms_output_shape(t, c, h, w, NULL, NULL, NULL);
    if (rc < 0) return rc;
    const uint64_t key = ampc__data_key(seed, AMPC__DOMAIN_TRANSFORM, epoch);
    const float *src = in;
    for (int j = 0; j < t->n; j++) {
        const tf_op *op = &t->ops[j];
        float *dst = j == t->n - 1 ? out : (src == scratch0 ? scratch1 : scratch0);
        uint32_t r[4];
        ampc__philox(key, (uint64_t)index * AMPC__TF_MAX_OPS + (uint64_t)j, r);
        switch (op->kind) {
        case TF_RESIZE:
            resize(src, c, h, w, dst, op->h, op->w);
            h = op->h;
            w = op->w;
            break;
        case TF_HFLIP: hflip(src, c, h, w, dst, unit(r[0]) < op->p); break;
        case TF_AFFINE: {
            if (op->p < 1.0) {   /* applied or not: a draw of its own, after the four of the parameters */
                uint32_t q[4];
                ampc__philox(key, AFFINE_P_COUNTER | ((uint64_t)index * AMPC__TF_MAX_OPS + (uint64_t)j), q);
                if (!(unit(q[0]) < op->p)) {
                    memmove(dst, src, (size_t)(c * h * w) * sizeof *dst);
                    break;
                }
            }
            double angle = op->deg * (2.0 * unit(r[0]) - 1.0);
            double scale = op->smin + (op->smax - op->smin) * unit(r[1]);
            double tx = op->shift * (double)w * (2.0 * unit(r[2]) - 1.0);
            double ty = op->shift * (double)h * (2.0 * unit(r[3]) - 1.0);
            ampc__affine(src, c, h, w, dst, op->ccw ? -angle : angle, scale, tx, ty, op->border);
            break;
        }
        case TF_NORMALIZE: normalize(src, c, h, w, dst, op); break;
        }
        src = dst;
    }
    return AMPC_OK;
}

int ampc_transforms_apply(const ampc_transforms *t, int64_t c, int64_t h, int64_t w, const float *in, float *out,
                          uint64_t seed, int64_t epoch, int64_t index) {
    if (!in || !out) return ampc__err(AMPC_ERR_INVALID, "transforms_apply: NULL buffer");
    if (stale(t, "ampc_transforms_apply")) return AMPC_ERR_STATE;
    int rc = ampc_transforms_output_shape(t, c, h, w, NULL, NULL, NULL);
    if (rc < 0) return rc;
    int64_t n = ampc__transforms_scratch_floats(t, c, h, w);
    float *s = t && t->n > 1 ? malloc(2 * (size_t)n * sizeof *s) : NULL;
    if (t && t->n > 1 && !s) return ampc__err(AMPC_ERR_OOM, "transforms_apply: out of memory");
    rc = ampc__transforms_run(t, c, h, w, in, out, s, s ? s + n : NULL, seed, epoch, index);
    free(s);
    return rc;
}
