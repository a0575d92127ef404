/*
 * ew_kernels.h - the launchers of the CUDA elementwise, reduction, softmax, loss, dropout and
 * layer-norm kernels (elementwise.cu, loss.cu, random.cu, layer_norm.cu), for their C sides (the
 * .c files of the same names).
 *
 * Same conventions as kernels.h: plain C types, device pointers, 64-bit element counts, work
 * queued on stream s, cudaGetLastError() returned. Float storage f32/f16/bf16 (the dtype is
 * passed beside each pointer), compute in f32, one rounding to nearest even on store.
 */
#ifndef AMPC_CUDA_EW_KERNELS_H
#define AMPC_CUDA_EW_KERNELS_H

#include <stdbool.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "ampc.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---------------------------------------------------------------------------------------------
// elementwise.cu

/* y[i] = op(x[i]) for the ops of kind UNARY (include/ampc.h); x and y may be the same array */
cudaError_t ampc_cu_unary(ampc_op op, const void *x, ampc_dtype xdt, void *y, ampc_dtype ydt, int64_t n, float alpha,
                          cudaStream_t s);
/* y[i] = x[i] + a on i64 (BatchNorm's num_batches_tracked) */
cudaError_t ampc_cu_add_scalar_i64(const int64_t *x, int64_t *y, int64_t n, int64_t a, cudaStream_t s);
/* gx[i] = gy[i] * op'(v[i]); v is what the op's backward reads (x or y; NULL when it reads
   neither, vdt then ignored); gx has gy's dtype and may be gy's array */
cudaError_t ampc_cu_unary_backward(ampc_op op, const void *v, ampc_dtype vdt, const void *gy, void *gx, ampc_dtype gdt,
                                   int64_t n, float alpha, cudaStream_t s);

/* A broadcast over the output's (merged) dims: element strides of operand k along each dim,
   0 where it broadcasts. */
typedef struct {
    int nd;
    int64_t shape[AMPC_MAX_DIMS];
    int64_t st[2][AMPC_MAX_DIMS];
} ampc_cu_bplan;
/* out = a op b (ADD, SUB, MUL) over the plan; b NULL: the constant bc. One dtype; n = out's numel. */
cudaError_t ampc_cu_binary(ampc_op op, const ampc_cu_bplan *p, const void *a, const void *b, float bc, void *out,
                           ampc_dtype dt, int64_t n, cudaStream_t s);

/* A reduction of x (contiguous) to out: x's merged dims split into kept ones (out's order,
   x strides kst) and reduced ones (x strides rst). nout = prod kshape, nred = prod rshape. */
typedef struct {
    int nk, nr;
    int64_t kshape[AMPC_MAX_DIMS], kst[AMPC_MAX_DIMS];
    int64_t rshape[AMPC_MAX_DIMS], rst[AMPC_MAX_DIMS];
    int64_t nout, nred;
} ampc_cu_rplan;
/* How many slices the reduced range is cut into (1: none; else the scratch holds
   splits * nout floats of partial sums). */
int64_t ampc_cu_sum_to_splits(const ampc_cu_rplan *p, int sm_count);
/* out[j] = alpha * sum_k x[j, k], f32 accumulation; out f32 or x's dtype; nred >= 1 */
cudaError_t ampc_cu_sum_to(const ampc_cu_rplan *p, const void *x, ampc_dtype xdt, void *out, ampc_dtype odt, float alpha,
                           int64_t splits, float *scratch, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// random.cu

/* Dropout: element i kept iff (Philox4x32-10 output i % 4 of counter offset + i / 4 under key
   seed) >> 8 >= thr; mask[i] = kept; y = x * (kept ? scale : 0). y may be x's array. */
cudaError_t ampc_cu_dropout(const void *x, ampc_dtype xdt, void *y, ampc_dtype ydt, uint8_t *mask, int64_t n,
                            uint64_t seed, uint64_t offset, uint32_t thr, float scale, cudaStream_t s);
/* gx = gy * (mask ? scale : 0) */
cudaError_t ampc_cu_dropout_backward(const void *gy, ampc_dtype gdt, const uint8_t *mask, void *gx, ampc_dtype odt,
                                     int64_t n, float scale, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// loss.cu

/* softmax / log-softmax of x viewed as (outer, dim, inner) along dim; y may be x's array */
cudaError_t ampc_cu_softmax(const void *x, ampc_dtype xdt, void *y, ampc_dtype ydt, int64_t outer, int64_t dim,
                            int64_t inner, bool log, cudaStream_t s);
/* gx from y and gy; gx has y's dtype and may be gy's array */
cudaError_t ampc_cu_softmax_backward(const void *y, ampc_dtype ydt, const void *gy, ampc_dtype gdt, void *gx,
                                     int64_t outer, int64_t dim, int64_t inner, bool log, cudaStream_t s);

/* Cross-entropy of logits (N, C) and targets (N, i64). Row losses into out (reduction NONE,
   odt) or into loss (f32 scratch of N) reduced into out[0] (MEAN: divided by the count, NaN
   for none). info (3 i64, device): the count of targets not ignored, the first row whose
   target is out of range (-1: none) and that target. Rows with such a target get NaN. */
cudaError_t ampc_cu_cross_entropy(const void *logits, ampc_dtype dt, const int64_t *targets, int64_t N, int64_t C,
                                  ampc_reduction red, int64_t ignore_index, float eps, void *out, ampc_dtype odt,
                                  float *loss, int64_t *info, cudaStream_t s);
/* gx = (softmax(x) - q) * gy / weight per row (gy scalar or (N), in gdt); ignored rows 0,
   out-of-range targets NaN; gx may be the logits' array */
cudaError_t ampc_cu_cross_entropy_backward(const void *logits, ampc_dtype dt, const int64_t *targets, int64_t N,
                                           int64_t C, const void *gy, ampc_dtype gdt, bool per_row, double weight,
                                           int64_t ignore_index, float eps, void *gx, ampc_dtype odt, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// layer_norm.cu

/* Layer norm of x (rows, cols): w and b f32 (cols) or NULL; mean (rows, f32), rstd (rows, f32
   or NULL) */
cudaError_t ampc_cu_layer_norm(const void *x, ampc_dtype xdt, const float *w, const float *b, void *y, ampc_dtype ydt,
                               float *mean, float *rstd, int64_t rows, int64_t cols, double eps, cudaStream_t s);
/* Slices of the rows in layer_norm_backward's column sums (scratch: splits * 2 * cols floats) */
int64_t ampc_cu_layer_norm_splits(int64_t rows, int64_t cols, int sm_count);
/* gx (x's dtype, may be gy's array), gw, gb (gwdt/gbdt, cols) each may be NULL; x, gy one dtype;
   w f32 or NULL */
cudaError_t ampc_cu_layer_norm_backward(const void *x, const void *gy, ampc_dtype dt, const float *w, const float *mean,
                                        const float *rstd, void *gx, void *gw, ampc_dtype gwdt, void *gb,
                                        ampc_dtype gbdt, int64_t rows, int64_t cols, int64_t splits, float *scratch,
                                        cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// embedding.cu

/* y (n, D) = rows idx[i] of w (V, D), any float dtype (bits copied); an index outside [0, V)
   gives a row of zeros and sets *bad (device memory, zeroed by the caller) to 1 */
cudaError_t ampc_cu_embedding(const void *w, ampc_dtype dt, const int64_t *idx, void *y, int64_t n, int64_t V, int64_t D,
                              int *bad, cudaStream_t s);
/* gw (V, D) = gy's rows summed into the rows their indices name, each column's sum taken in index
   order in f32 (the same bits every run), rounded once into gw's dtype; bad indices skipped and
   flagged in *bad */
cudaError_t ampc_cu_embedding_backward(const void *gy, ampc_dtype gdt, const int64_t *idx, void *gw, ampc_dtype wdt, int64_t n,
                                       int64_t V, int64_t D, int *bad, cudaStream_t s);
/* y = x with its dims reordered (y's dim i is x's dim perm[i]), elements of esize bytes */
cudaError_t ampc_cu_permute(const void *x, void *y, size_t esize, int nd, const int64_t *xshape, const int *perm, int64_t n,
                            cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// attention.cu: the row passes between the cuBLASLt products (attention.c)

/* A block of query rows [i0, i0 + n) of every head (batch heads), each seeing its first kn keys
   (causal: key j <= query i), as attention.c's passes see it; the mask's layout is backend.h's
   ampc_attn_desc's. */
typedef struct {
    int64_t batch, Tq, Tk, i0, n, kn;
    bool causal;
    float scale, drop_factor;   /* drop_factor 1 / (1 - p), 0 for p = 1 */
    uint32_t drop_thr;          /* kept iff a draw's 24 bits >= thr; 0: no dropout */
    uint64_t seed, offset;
    int nlead;
    int64_t lead[8], mask_lead[8], mask_si, mask_sj;
} ampc_cu_attn_rows;

/* S (batch, n, kn) f32 scores q k^T unscaled -> the probabilities in place (f32: scale, mask,
   causal, softmax; forward: lse (batch, Tq) written when not NULL; backward (lse given, forward
   false): exp(s - lse)); P (same shape, dtype pdt) = the probabilities through dropout */
cudaError_t ampc_cu_attn_probs(const ampc_cu_attn_rows *a, float *S, const float *mask, float *lse, bool forward, void *P,
                               ampc_dtype pdt, cudaStream_t s);
/* dP (batch, n, kn) f32 = do v^T -> through dropout; with P the f32 probabilities: dS = P (dP -
   rowsum(P dP)) into dSo (dtype sdt) and, when not NULL, into dmask's rows (batch, Tq, Tk; 0 past
   kn) */
cudaError_t ampc_cu_attn_dscores(const ampc_cu_attn_rows *a, const float *P, float *dP, void *dSo, ampc_dtype sdt, float *dmask,
                                 cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif /* AMPC_CUDA_EW_KERNELS_H */
