/*
 * conv_wino.c - convolution passes on oneDNN's Winograd kernels (keys with wino, conv_choose.c's
 * use_wino) over chunks of the batch: those kernels want blocked activations, so each pass
 * reorders its inputs and outputs (conv_dnnl.c), and on the whole batch of a 64-channel 32x32
 * layer at batch 64 those copies alone are 32 MiB besides oneDNN's scratchpad. A chunk's
 * copies stay under ampc__cpu_conv_wino_cap (2 MiB: oneDNN's scratchpad for the transformed
 * tiles grows with the chunk too; with 8 MiB chunks the 256->256 passes raised ResNet-18's fp32
 * peak by 23 MiB, with 2 MiB by 3.2, and no pass measured slower); weight gradients of later
 * chunks are added to the first's (the same sum, in another order).
 */
#include "backend/cpu/conv.h"

size_t ampc__cpu_conv_wino_cap = (size_t)2 << 20;

/* Runs pass family of k (f32, no bias) on the user's buffers (arg_spec order), a chunk of
   images at a time. Lock held. */
int ampc__conv_run_wino(int family, const conv_key *k, void *const *user) {
    size_t xsz = (size_t)(k->C * k->H * k->W) * sizeof(float), ysz = (size_t)(k->O * k->OH * k->OW) * sizeof(float);
    int64_t nb = ampc__conv_chunk(k->N, xsz + ysz, ampc__cpu_conv_wino_cap);   /* an image's blocked copies */
    if (nb >= k->N) return ampc__conv_run_dnnl(family, k, user);
    size_t nw = (size_t)(k->O * (k->C / k->groups) * k->KH * k->KW), block = 0;
    bool bwd_w = family == AMPC_DNNL_CONV_BWD_WEIGHTS;
    float *part = NULL;   /* a later chunk's weight gradient */
    if (bwd_w && !(part = ampc__alloc(AMPC_DEVICE_CPU, nw * sizeof(float), AMPC_MEM_WORKSPACE, &block))) return ampc_last_status();
    int rc = AMPC_OK;
    for (int64_t n0 = 0; n0 < k->N && rc >= 0; n0 += nb) {
        conv_key kc = *k;
        kc.N = k->N - n0 < nb ? k->N - n0 : nb;
        char *in0 = user[0], *in1 = user[1], *out = user[2];
        void *u[3];
        if (family == AMPC_DNNL_CONV_FWD) u[0] = in0 + n0 * xsz, u[1] = in1, u[2] = out + n0 * ysz;   /* x, w, y */
        else if (!bwd_w) u[0] = in0 + n0 * ysz, u[1] = in1, u[2] = out + n0 * xsz;                   /* gy, w, gx */
        else u[0] = in0 + n0 * xsz, u[1] = in1 + n0 * ysz, u[2] = n0 ? (void *)part : out;          /* x, gy, gw */
        rc = ampc__conv_run_dnnl(family, &kc, u);
        if (rc >= 0 && bwd_w && n0) {
            float *gw = user[2];
            for (size_t i = 0; i < nw; i++) gw[i] += part[i];
        }
    }
    if (part) ampc__free(AMPC_DEVICE_CPU, part, block, AMPC_MEM_WORKSPACE);
    return rc;
}
