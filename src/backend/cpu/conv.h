/*
 * conv.h - what the CPU convolution's files share (conv.c's overview says how they divide the
 * work): the key that identifies a pass's primitives, the argument tables, and each
 * strategy's entry points. Internal to src/backend/cpu/conv*.c.
 */
#ifndef AMPC_CPU_CONV_H
#define AMPC_CPU_CONV_H

#include "backend/backend.h"
#include "backend/cpu/cpu.h"
#include "backend/cpu/dnnl_cache.h"

/* Everything that makes two calls need different primitives; zeroed before filling so it can
   be compared bytewise. The pass is the cache family (AMPC_DNNL_CONV_FWD, ...). */
typedef struct {
    dnnl_data_type_t dt;   /* src/weights/dst: f32 or bf16 (f16 runs as f32) */
    int32_t has_bias, blocked, nthr;
    int32_t grad_f32;      /* backward weights of bf16: the user's gw/gb are f32 (not rounded) */
    int32_t slot;          /* split backward weights: 1.. the one-thread primitive of a slice, -1 its reorders */
    int32_t cl;            /* activations (src, dst and their gradients) NHWC, never reordered */
    int32_t gemm;          /* channels-last 1x1: a matmul primitive instead (see gemm_pd) */
    int32_t no_brg;        /* channels-last forward: skip oneDNN's brgconv implementations */
    int32_t cl_reorder;    /* channels-last, but the activations reordered to oneDNN's choice */
    int32_t im2col;        /* channels-last: im2col + a matmul primitive (see i2c_pd); N = images per chunk */
    int32_t accum;         /* im2col backward weights: the matmul adds to its dst (later chunks) */
    int32_t wino;          /* f32 3x3 stride 1: oneDNN's Winograd F(4x4, 3x3) kernels (blocked activations) */
    int64_t N, C, H, W, O, KH, KW, OH, OW;
    int64_t stride[2], dil[2], pad_l[2], pad_r[2], groups;   /* oneDNN's: dilation d-1 */
} conv_key;

/* A reorder is identified by the convolution it serves and the argument it converts. */
typedef struct {
    conv_key conv;
    int32_t family, arg;
} reorder_key;

typedef enum { ROLE_SRC, ROLE_WEI, ROLE_DST, ROLE_BIAS } arg_role;

/* The arguments of each pass, in the order of the handles given to conv_run. Gradients of
   weights and bias are produced in f32 (oneDNN's faster bf16 backward-weights variant). */
typedef struct {
    int arg;
    arg_role role;
    bool output, f32;
} arg_spec;

static inline size_t ampc__conv_align64(size_t n) { return (n + 63) & ~(size_t)63; }

/* Images per chunk of a batch of N whose images take per bytes each: the fewest equal chunks
   that fit cap (at least one image; per 0: the whole batch). */
static inline int64_t ampc__conv_chunk(int64_t N, size_t per, size_t cap) {
    int64_t fit = per ? (int64_t)(cap / per) : N, nb = fit < 1 ? 1 : fit > N ? N : fit;
    int64_t chunks = (N + nb - 1) / nb;
    return (N + chunks - 1) / chunks;
}

// ---------------------------------------------------------------------------------------------
// The choice (conv_choose.c)

/* The key of pass family (AMPC_DNNL_CONV_FWD, ...) of d on dt operands, with the strategy
   chosen for it; grad_dt: the dtype of gw/gb for the backward weights pass (dt elsewhere). */
conv_key ampc__conv_make_key(int family, const ampc_conv_desc *d, ampc_dtype dt, ampc_dtype grad_dt, bool has_bias);
/* Runs pass family of k on the user's plain buffers (arg_spec order) with k's strategy. Lock
   held. */
int ampc__conv_exec(int family, const conv_key *k, void *const *user);

// ---------------------------------------------------------------------------------------------
// oneDNN convolution primitives (conv_dnnl.c)

/* The arguments of pass family (n of them: the bias only with k->has_bias). */
const arg_spec *ampc__conv_family_args(int family, int *n, const conv_key *k);
/* The user's side of argument a: plain layout in the kernel's dtype. */
dnnl_status_t ampc__conv_user_md(dnnl_memory_desc_t *md, const conv_key *k, const arg_spec *a);
/* The builder of pass family's primitive for k (convolution, gemm or im2col matmul). */
ampc_dnnl_build_fn ampc__conv_builder(int family, const conv_key *k);
int ampc__conv_build_bwd_weights(ampc_dnnl_entry *e, const void *key);
/* The cached reorder from -> to for argument arg of pass family of k. Lock held. */
ampc_dnnl_entry *ampc__conv_reorder_entry(const conv_key *k, int family, int arg, const dnnl_memory_desc_t *from,
                                          const dnnl_memory_desc_t *to);
/* Pass family of k on the convolution primitive, with reorders around it where oneDNN wants
   other layouts or dtypes. Lock held. */
int ampc__conv_run_dnnl(int family, const conv_key *k, void *const *user);

// ---------------------------------------------------------------------------------------------
// The other strategies

/* conv_gemm.c: channels-last stride-1 1x1 as one matmul. */
dnnl_status_t ampc__conv_mat_md(dnnl_memory_desc_t *md, dnnl_data_type_t dt, int64_t rows, int64_t cols, bool trans);
ampc_dnnl_build_fn ampc__conv_gemm_builder(int family);
int ampc__conv_run_gemm(int family, const conv_key *k, void *const *user);

/* conv_im2col.c: channels-last im2col + one matmul; a chunk's images (the matmul's batch). */
ampc_dnnl_build_fn ampc__conv_i2c_builder(int family);
int64_t ampc__conv_i2c_chunk(int family, const conv_key *k);
int ampc__conv_run_im2col(int family, const conv_key *k, void *const *user);

/* conv_wino.c: oneDNN's Winograd kernels over chunks of the batch. */
int ampc__conv_run_wino(int family, const conv_key *k, void *const *user);

/* conv_split.c: bf16 backward weights split over threads; 1 when it does not apply. */
int ampc__conv_run_split(const conv_key *k, void *const *user);

#endif /* AMPC_CPU_CONV_H */
