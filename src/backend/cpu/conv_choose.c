/*
 * conv_choose.c - which strategy runs each convolution pass: the rules (from the measurements
 * in bench/NOTES.md, "Convolutions") that fill a pass's key, and the dispatch on it.
 */
#include "backend/cpu/conv.h"

#include <omp.h>
#include <string.h>

/* Whether pass `family` runs on plain NCHW (measured: bench/NOTES.md, "Convolutions", the 1x1 table): ungrouped unpadded
   1x1 convolutions are gemms over NCHW, faster than the blocked kernels with their reorders
   on maps of 10x10 and more; strided, the gemm needs an im2col copy first, which only the data
   gradient (a scatter) and the bf16 weight gradient still win. On small maps (7x7: 49-column
   gemms per image) the blocked kernels win, and oneDNN's gemm weight gradient would take
   48-96 MiB of scratchpad there. */
static bool plain_1x1(int family, const ampc_conv_desc *d, ampc_dtype dt) {
    if (d->KH != 1 || d->KW != 1 || d->groups != 1 || d->padding[0] || d->padding[1]) return false;
    bool unit_stride = d->stride[0] == 1 && d->stride[1] == 1;
    if (d->OH * d->OW < 100) return false;
    return family == AMPC_DNNL_CONV_BWD_DATA || unit_stride || (family == AMPC_DNNL_CONV_BWD_WEIGHTS && dt == AMPC_BF16);
}

// Channels-last choices, per pass (measured: bench/NOTES.md, "Convolutions", the NHWC table). Activations stay NHWC
// (no reorder) but where noted; weights are reordered to oneDNN's choice as on the NCHW path.

static bool is_1x1_s1(const ampc_conv_desc *d) {
    return d->KH == 1 && d->KW == 1 && d->groups == 1 && !d->padding[0] && !d->padding[1] && d->stride[0] == 1 &&
           d->stride[1] == 1;
}

/* Stride-1 1x1: one gemm (gemm_pd), faster than oneDNN's NHWC 1x1 kernels in f32 and as fast in
   bf16 - but for bf16 weight gradients on maps above 28x28 (64->256 56x56: 5.9 vs 8.1 ms, 256->64
   3.3 vs 4.0), where the gemm reduces over all N*H*W pixels. A bias gradient needs the
   convolution. */
static bool cl_gemm(int family, const ampc_conv_desc *d, bool bf16, bool has_bias) {
    if (!is_1x1_s1(d)) return false;
    if (family != AMPC_DNNL_CONV_BWD_WEIGHTS) return true;
    return !has_bias && (!bf16 || d->OH * d->OW <= 28 * 28);
}

/* Forward: oneDNN 2.6 picks brgconv for NHWC; its jit kernels (the NCHW path's, which take
   NHWC too) are faster for bf16 everywhere (4x4: 4.3 vs 7.9 ms) and for f32 on small output
   maps, strided 1x1 and few input values per output (cnn's 1-channel conv1); brgconv is faster
   for f32 on larger maps (3x3 56x56: 8.8 vs 9.3, 3x3 s2 56x56: 9.2 vs 12.5 ms). */
static bool cl_no_brg(const ampc_conv_desc *d, bool bf16) {
    bool strided_1x1 = d->KH == 1 && d->KW == 1 && (d->stride[0] > 1 || d->stride[1] > 1);
    return bf16 || d->OH * d->OW < 64 || strided_1x1 || d->C / d->groups * d->KH * d->KW < 16;
}

/* The f32 passes whose NHWC kernels lose to the blocked ones by more than the reorders cost:
   backward data on 4x4 maps (11.6 vs 9.6 ms), backward weights of strided or unpadded spatial
   kernels on output maps of 24x24 and more (3x3 s2 56x56: 22.7 vs 15.4 ms; cnn conv2: 14.7 vs
   11.3 ms) - but the 3-channel stems (16.5 vs 21.5 ms the other way). */
static bool cl_reorder(int family, const ampc_conv_desc *d, bool bf16) {
    if (bf16) return false;
    bool strided = d->stride[0] > 1 || d->stride[1] > 1, unpadded = !d->padding[0] && !d->padding[1];
    if (family == AMPC_DNNL_CONV_BWD_DATA) return d->H * d->W <= 16;
    if (family == AMPC_DNNL_CONV_BWD_WEIGHTS)
        return d->KH * d->KW > 1 && d->OH * d->OW >= 24 * 24 && (unpadded || (strided && d->C >= 16));
    return false;
}

/* im2col + matmul for pass family (see ampc__conv_run_im2col)? -1: by cl_im2col, 0: never, 1: wherever it
   applies (ungrouped, channels-last, not a 1x1 gemm). For benchmarks and tests (declared in
   cpu.h); not thread-safe, not part of the API. */
int ampc__cpu_conv_im2col = -1;

/* Backward weights as im2col + matmul (ampc__conv_run_im2col) where oneDNN's direct kernels are weak: many
   output channels on small output maps (at most 14x14), strided (3x3 s2 256->512 8x8 bf16:
   7.1 vs 3.3 ms) or with many input channels (3x3 512->512 4x4 bf16: 10.8 vs 8.5 ms); in f32
   only strided with at least 256 input channels and K = KH*KW*C >= 1024 (the others within
   10% or slower). Forward and backward data lose everywhere on AVX-512 (oneDNN's direct
   kernels run near peak; building cols, and col2im, cost more than they could save). See the
   im2col table in bench/NOTES.md, "Convolutions".
   On AMX (bf16), oneDNN 2.6's direct tile kernels are weak on small maps and its matmul is not:
   forward and backward data with 4x4 outputs (3x3 512->512 backward data 97.7 vs 40.8 ms, 3x3
   s2 256->512 28.7 vs 8.0) and backward weights with >= 128 output channels on outputs up to
   8x8 (3x3 256->256 8x8: 80.1 vs 38.2 ms) go through the matmul too (bench/NOTES.md,
   "Convolutions on AMX"). */
static bool cl_im2col(int family, const ampc_conv_desc *d, bool bf16) {
    if (d->groups != 1 || is_1x1_s1(d)) return false;
    if (ampc__cpu_conv_im2col >= 0) return ampc__cpu_conv_im2col;
    bool amx = bf16 && ampc__dnnl_amx();
    if (family != AMPC_DNNL_CONV_BWD_WEIGHTS)
        return amx && d->OH * d->OW <= 16 && (family == AMPC_DNNL_CONV_BWD_DATA || d->KH * d->KW > 1);
    if (amx && d->O >= 128 && d->OH * d->OW <= 64) return true;
    if (family != AMPC_DNNL_CONV_BWD_WEIGHTS || d->O < 256 || d->OH * d->OW > 14 * 14) return false;
    bool strided = d->stride[0] > 1 || d->stride[1] > 1;
    int64_t K = d->KH * d->KW * d->C;
    if (bf16) return K >= 256 && (strided || d->C >= 512);
    return strided && d->C >= 256 && K >= 1024;
}

int ampc__cpu_conv_winograd = -1;

/* oneDNN's Winograd F(4x4, 3x3) kernels (f32 on AVX-512: 3x3, stride 1, padding 1, channels in
   multiples of 16) for f32 and f16 (computed in f32), without a bias (ResNets' convolutions).
   Faster for every pass of every ResNet-18 3x3 layer (bench/NOTES.md, "Winograd"), but their
   scratchpad holds the transformed weights, 4x the weights, and the weight gradient's holds a
   copy per thread (125 MiB for 512->512 at batch 64), so only small weights take them, keeping
   the step's peak memory where it was: C x O <= 128 x 128 for every pass, and up to 256 x 256
   for the forward and backward data passes (ResNet-18's 256->256 layers: 0.95x the fp32 step,
   allocator peak +3.2 MiB with the 2 MiB chunks of conv_wino.c, RSS and reserved lower;
   their weight gradient too would add 45 MiB). */
static bool use_wino(int family, const ampc_conv_desc *d, ampc_dtype dt, bool has_bias) {
    int mode = ampc__cpu_conv_winograd;
    if (!mode || (mode < 0 && !ampc_conv_winograd()) || ampc__cpu_conv_im2col > 0) return false;   /* im2col forced */
    if (dt == AMPC_BF16 || has_bias || d->KH != 3 || d->KW != 3 || d->stride[0] != 1 || d->stride[1] != 1) return false;
    if (d->dilation[0] != 1 || d->dilation[1] != 1 || d->padding[0] != 1 || d->padding[1] != 1 || d->groups != 1) return false;
    if (d->C % 16 || d->O % 16 || !ampc__dnnl_wino()) return false;
    int64_t most = family == AMPC_DNNL_CONV_BWD_WEIGHTS ? 128 : 256;
    return mode > 0 || d->C * d->O <= most * most;
}

/* grad_dt: the dtype of gw/gb for the backward weights pass (dt elsewhere). */
conv_key ampc__conv_make_key(int family, const ampc_conv_desc *d, ampc_dtype dt, ampc_dtype grad_dt, bool has_bias) {
    conv_key k;
    memset(&k, 0, sizeof k);
    k.dt = dt == AMPC_BF16 ? dnnl_bf16 : dnnl_f32;
    k.grad_f32 = dt == AMPC_BF16 && grad_dt == AMPC_F32;   /* f16 runs in f32 anyway */
    k.has_bias = has_bias;
    k.wino = use_wino(family, d, dt, has_bias);
    if (k.wino) {   /* blocked activations and weights, reordered from and to the user's */
        k.cl = d->channels_last;
        k.blocked = 1;
    } else if (d->channels_last) {
        bool bf16 = dt == AMPC_BF16;
        k.cl = 1;
        k.gemm = cl_gemm(family, d, bf16, has_bias);
        k.im2col = !k.gemm && cl_im2col(family, d, bf16);
        k.blocked = !k.gemm && !k.im2col;   /* weights: oneDNN's layout */
        k.no_brg = k.blocked && family == AMPC_DNNL_CONV_FWD && cl_no_brg(d, bf16);
        k.cl_reorder = k.blocked && cl_reorder(family, d, bf16);
    } else {
        k.blocked = !plain_1x1(family, d, dt);
    }
    k.nthr = omp_get_max_threads();
    k.N = d->N, k.C = d->C, k.H = d->H, k.W = d->W, k.O = d->O, k.KH = d->KH, k.KW = d->KW, k.OH = d->OH, k.OW = d->OW;
    k.groups = d->groups;
    const int64_t in[2] = {d->H, d->W}, ker[2] = {d->KH, d->KW}, out[2] = {d->OH, d->OW};
    for (int i = 0; i < 2; i++) {
        k.stride[i] = d->stride[i];
        k.dil[i] = d->dilation[i] - 1;
        k.pad_l[i] = d->padding[i];
        /* oneDNN needs (in + pad_l + pad_r - extent) / stride + 1 == out. The exact remainder
           may make the right padding negative (rows the floor drops); any value up to
           stride - 1 above it gives the same output, and nothing reads the extra padding. */
        int64_t extent = (ker[i] - 1) * d->dilation[i] + 1, r = (out[i] - 1) * d->stride[i] + extent - in[i] - d->padding[i];
        k.pad_r[i] = r < 0 ? 0 : r;
    }
    return k;
}

/* Runs pass family of k on the user's plain buffers (ampc__conv_run_dnnl, or split for bf16 weights). */
int ampc__conv_exec(int family, const conv_key *k, void *const *user) {
    if (k->gemm) return ampc__conv_run_gemm(family, k, user);
    if (k->im2col) return ampc__conv_run_im2col(family, k, user);
    if (k->wino) return ampc__conv_run_wino(family, k, user);
    if (family == AMPC_DNNL_CONV_BWD_WEIGHTS && k->dt == dnnl_bf16 && k->blocked) {
        int rc = ampc__conv_run_split(k, user);
        if (rc != 1) return rc;
    }
    return ampc__conv_run_dnnl(family, k, user);
}
