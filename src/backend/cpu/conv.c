/*
 * conv.c - CPU 2-D convolution on oneDNN 2.6 primitives: forward (with bias), backward data,
 * backward weights (with the bias gradient).
 *
 * The user sees NCHW activations and OIHW weights (GOIHW with groups). oneDNN's fast kernels
 * want blocked layouts, so each pass describes its operands with format_tag_any, lets oneDNN
 * choose (nChw16c activations, OIhw16i16o-like weights), and reorders from/to NCHW around the
 * primitive in workspace buffers. Reorders are cached primitives like the convolutions; they
 * also convert dtypes where the primitive wants another one: weight and bias gradients are
 * computed in f32 for bf16 too (faster: bf16* in bench/NOTES.md) and rounded once by the
 * reorder back to OIHW bf16 - or not at all when the caller gives f32 gw/gb for 16-bit x and
 * gy (autocast: the gradients of the f32 master weights); f16 runs in f32 and then needs no
 * narrowing either.
 * Ungrouped unpadded 1x1 convolutions are gemms over NCHW and mostly run on plain descriptors,
 * no reorder (plain_1x1). bf16 weight gradients on the blocked path are split over threads by
 * conv_split.c: oneDNN's own threading of that kernel spins and collapses when the machine is
 * loaded. f16: oneDNN 2.6 has no f16 convolution on these CPUs, so f16 operands are widened to
 * f32 workspace copies, convolved in f32 and the results rounded once to f16 (as gemm.c does).
 *
 * Channels-last (d->channels_last: x, y, gx, gy stored NHWC; weights OIHW as above). oneDNN
 * takes NHWC activations (dnnl_nhwc) in its jit, jit_1x1 and brgconv kernels, so the
 * activations are used in place - no reorder around any pass - and only the weights (and
 * their gradients) are reordered to the layout oneDNN picks, as on the NCHW path (plain OIHW
 * weights with NHWC activations get oneDNN's reference kernel). Choices, per pass (cl_* in
 * conv_choose.c):
 * - stride-1 1x1 convolutions are one gemm over the N*H*W pixels (gemm_pd): no reorder at all;
 *   bf16 weight gradients on maps above 28x28 and bias gradients stay convolutions;
 * - forward runs oneDNN's jit kernels instead of its first choice, brgconv, for bf16 and for
 *   small f32 maps, strided 1x1 and the 1-channel conv;
 * - f32 backward data on 4x4 maps and f32 backward weights of strided or unpadded spatial
 *   kernels on maps of 24x24 and more reorder the activations after all (faster kernels);
 * - bf16 weight gradients are split over threads as above: by images (the batch is outermost
 *   in NHWC), by output channels where the weights outnumber the inputs (each slice's channels
 *   of gy copied out: 4x4 512->512 15.8 vs 18.4 ms by images);
 * - weight gradients with many output channels on small maps are im2col + one matmul instead
 *   (cl_im2col).
 * On either layout, f32 (and f16) 3x3 stride-1 convolutions without bias whose weights are small
 * (channels multiples of 16, C x O <= 128 x 128; forward and backward data up to 256 x 256) run
 * on oneDNN's Winograd F(4x4, 3x3) kernels
 * (use_wino; blocked activations, reordered from and to the user's, a chunk of the batch at a
 * time: conv_wino.c), unless switched off by ampc_set_conv_winograd.
 *
 * Files: conv.c (this: f16 through f32 copies, the backend's entry points),
 * conv_choose.c (the strategy of each pass), conv_dnnl.c (oneDNN convolution primitives and
 * reorders), conv_gemm.c (1x1 as a matmul), conv_im2col.c (im2col + matmul), conv_wino.c
 * (Winograd over chunks of the batch), conv_split.c (bf16 weight gradients split over threads);
 * conv.h what they share.
 * The measurements behind the choices are in bench/NOTES.md, "Convolutions".
 */
#include "backend/cpu/conv.h"

#include <string.h>

// ---------------------------------------------------------------------------------------------
// Kernels

/* f16 operands as f32 workspace: n values of each f16 tensor converted in (inputs) or
   allocated (outputs), one block; f32 tensors (f32 weight gradients) are used in place. */
typedef struct {
    float *p[4];
    void *block;
    size_t bytes;
} f32_copies;

static int widen(f32_copies *c, const ampc_tensor *const *t, const bool *is_input, int n) {
    size_t total = 0, off[4];
    for (int i = 0; i < n; i++) {
        off[i] = total;
        total += t[i] && t[i]->dtype != AMPC_F32 ? ampc__conv_align64((size_t)t[i]->numel * sizeof(float)) : 0;
    }
    memset(c, 0, sizeof *c);
    c->block = ampc__alloc(AMPC_DEVICE_CPU, total ? total : 64, AMPC_MEM_WORKSPACE, &c->bytes);
    if (!c->block) return ampc_last_status();
    for (int i = 0; i < n; i++) {
        if (!t[i]) continue;
        if (t[i]->dtype == AMPC_F32) {
            c->p[i] = ampc__data(t[i]);
            continue;
        }
        c->p[i] = (float *)((char *)c->block + off[i]);
        if (is_input[i]) ampc__dt(t[i]->dtype)->to_f32(ampc__data(t[i]), c->p[i], (size_t)t[i]->numel);
    }
    return AMPC_OK;
}

static void narrow(f32_copies *c, ampc_tensor *const *t, const bool *is_output, int n, int rc) {
    for (int i = 0; i < n && rc >= 0; i++)
        if (t[i] && is_output[i] && t[i]->dtype != AMPC_F32)
            ampc__dt(t[i]->dtype)->from_f32(c->p[i], ampc__data(t[i]), (size_t)t[i]->numel);
    ampc__free(AMPC_DEVICE_CPU, c->block, c->bytes, AMPC_MEM_WORKSPACE);
}

/* Runs pass family with tensors t (arg_spec order; NULL bias allowed at the end), going
   through f32 copies for f16 (and bf16 where oneDNN has no bf16 kernels). */
static int run_tensors(int family, const ampc_conv_desc *d, ampc_tensor *const *t, int n, bool has_bias) {
    int nargs;
    ampc_dtype grad_dt = family == AMPC_DNNL_CONV_BWD_WEIGHTS ? t[2]->dtype : t[0]->dtype;
    conv_key k = ampc__conv_make_key(family, d, ampc__dnnl_compute_dt(t[0]->dtype), ampc__dnnl_compute_dt(grad_dt), has_bias);
    const arg_spec *args = ampc__conv_family_args(family, &nargs, &k);
    void *user[4];
    int rc;
    if (!ampc__dnnl_via_f32(t[0]->dtype)) {
        for (int i = 0; i < n; i++) user[i] = t[i] ? ampc__data(t[i]) : NULL;
        ampc__dnnl_lock();
        rc = ampc__conv_exec(family, &k, user);
        ampc__dnnl_unlock();
        return rc;
    }
    bool in[4], out[4];
    for (int i = 0; i < n; i++) in[i] = !args[i].output, out[i] = args[i].output;
    f32_copies c;
    if ((rc = widen(&c, (const ampc_tensor *const *)t, in, n)) < 0) return rc;
    for (int i = 0; i < n; i++) user[i] = c.p[i];
    ampc__dnnl_lock();
    rc = ampc__conv_exec(family, &k, user);
    ampc__dnnl_unlock();
    narrow(&c, t, out, n, rc);
    return rc;
}

/* Empty reductions (no input channels, no batch): outputs are the bias or zero. */
static int fill_zero(ampc_tensor *t) {
    if (t) memset(ampc__data(t), 0, ampc__nbytes(t));   /* all-zero bits are 0.0 in f32/f16/bf16 */
    return AMPC_OK;
}

/* gb[o] = sum of gy[:, o] in f32, for inputs oneDNN cannot take (an empty x under padding). */
static int bias_grad(const ampc_conv_desc *d, const ampc_tensor *gy, ampc_tensor *gb) {
    size_t plane = (size_t)(d->OH * d->OW), O = (size_t)d->O;
    for (size_t o = 0; o < O; o++) {
        float s = 0, buf[AMPC_CPU_CHUNK], one[1];
        for (size_t n = 0; n < (size_t)d->N; n++)
            for (size_t j = 0; j < plane; j += d->channels_last ? 1 : AMPC_CPU_CHUNK) {
                if (d->channels_last) {   /* channel o of pixel j: one value, O apart (a rare path) */
                    s += *ampc__cpu_load(gy, (n * plane + j) * O + o, 1, buf);
                    continue;
                }
                size_t m = plane - j < AMPC_CPU_CHUNK ? plane - j : AMPC_CPU_CHUNK;
                const float *v = ampc__cpu_load(gy, (n * O + o) * plane + j, m, buf);
                for (size_t i = 0; i < m; i++) s += v[i];
            }
        *ampc__cpu_out(gb, (size_t)o, one) = s;
        ampc__cpu_store(gb, (size_t)o, 1, one);
    }
    return AMPC_OK;
}

static int cpu_conv2d(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *w, const ampc_tensor *b,
                      ampc_tensor *y) {
    if (y->numel == 0) return AMPC_OK;
    if (x->numel == 0) {   /* C == 0: y = bias broadcast over (N, OH, OW) */
        size_t sz = ampc__dt(y->dtype)->size, plane = (size_t)(d->OH * d->OW), O = (size_t)d->O;
        char *out = ampc__data(y);
        for (size_t p = 0; p < (size_t)y->numel; p++) {
            size_t o = d->channels_last ? p % O : p / plane % O;
            if (b) memcpy(out + p * sz, (const char *)ampc__data(b) + o * sz, sz);
            else memset(out + p * sz, 0, sz);
        }
        return AMPC_OK;
    }
    return run_tensors(AMPC_DNNL_CONV_FWD, d, (ampc_tensor *[]){(ampc_tensor *)x, (ampc_tensor *)w, y, (ampc_tensor *)b},
                       b ? 4 : 3, b != NULL);
}

static int cpu_conv2d_backward_data(const ampc_conv_desc *d, const ampc_tensor *gy, const ampc_tensor *w, ampc_tensor *gx) {
    if (gx->numel == 0) return AMPC_OK;
    if (gy->numel == 0) return fill_zero(gx);   /* O == 0 */
    return run_tensors(AMPC_DNNL_CONV_BWD_DATA, d, (ampc_tensor *[]){(ampc_tensor *)gy, (ampc_tensor *)w, gx}, 3, false);
}

static int cpu_conv2d_backward_weights(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *gy, ampc_tensor *gw,
                                       ampc_tensor *gb) {
    if (gy->numel == 0 || x->numel == 0) {   /* N == 0, O == 0, or an empty input: empty sums */
        if (gb && gy->numel) bias_grad(d, gy, gb);
        else fill_zero(gb);
        return fill_zero(gw);
    }
    return run_tensors(AMPC_DNNL_CONV_BWD_WEIGHTS, d, (ampc_tensor *[]){(ampc_tensor *)x, (ampc_tensor *)gy, gw, gb},
                       gb ? 4 : 3, gb != NULL);
}

// ---------------------------------------------------------------------------------------------
// Introspection and registration

int ampc__cpu_conv_impl(const ampc_conv_desc *d, ampc_dtype dt, int pass, bool has_bias, char *buf, size_t n) {
    static const int families[3] = {AMPC_DNNL_CONV_FWD, AMPC_DNNL_CONV_BWD_DATA, AMPC_DNNL_CONV_BWD_WEIGHTS};
    if (pass < 0 || pass > 2) return ampc__err(AMPC_ERR_INVALID, "conv pass %d", pass);
    conv_key k = ampc__conv_make_key(families[pass], d, ampc__dnnl_compute_dt(dt), ampc__dnnl_compute_dt(dt), has_bias && pass != 1);
    if (k.im2col) k.N = ampc__conv_i2c_chunk(families[pass], &k);   /* the matmul of a chunk */
    ampc__dnnl_lock();
    ampc_dnnl_entry *e = ampc__dnnl_get(families[pass], &k, sizeof k, ampc__conv_builder(families[pass], &k));
    snprintf(buf, n, "%s%s", k.im2col ? "im2col+" : "", e ? ampc__dnnl_impl(e) : "?");
    ampc__dnnl_unlock();
    return e ? AMPC_OK : ampc_last_status();
}

void ampc__cpu_register_conv(ampc_backend *be) {
    be->conv2d = cpu_conv2d;
    be->conv2d_backward_data = cpu_conv2d_backward_data;
    be->conv2d_backward_weights = cpu_conv2d_backward_weights;
}
