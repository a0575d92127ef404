/*
 * gemm_skinny.c - AVX-512 gemms with one small dimension (M, N or K <= SKINNY_DIM), which
 * oneDNN 2.6's brgemm runs far below the machine's speed (a classifier head: forward
 * 256x10x2048 tb, backward data 256x2048x10, backward weights 10x2048x256 ta).
 *
 * Two kernels over f32 or bf16 storage, f32 accumulation, one rounding at the end (after the
 * bias, added in f32):
 *   rows: C[i, :] = sum_k a(i, k) * B[k, :], each row of C a combination of the K rows of B,
 *         for a small K (short sums) or a small M (all rows of C in registers while B streams
 *         by once). Vectors along N. A is packed first (small); B's rows must be contiguous,
 *         so a tb B is transposed into workspace, which is only done when K is small.
 *   dots: C[i, j] = A[i, :] . Bt[j, :], dot products along K for a small N: vectors along K
 *         and one horizontal sum per element. A's rows must be contiguous (!ta); a !tb B is
 *         transposed into workspace (N x K, small).
 * f32 runs on FMAs. bf16 runs on VDPBF16PS (AVX512_BF16): f32 sums of exact bf16 products, two
 * per lane and step, twice the FMA's rate; like oneDNN's bf16 kernels it treats subnormal
 * inputs, products and sums as zero. In dots, both operands pair consecutive k by themselves;
 * rows pairs rows 2k and 2k+1 of B with VPUNPCK[LH]WD, which leaves the columns permuted in
 * 128-bit lanes, undone by one VPERMT2PS per 16 results at the store.
 * The operand that streams (B in rows, the next task's strip; A in dots, 1 KB ahead) is
 * prefetched: in a training step it comes from L3 or memory, where the strided reads of rows
 * otherwise waited on every load (rows 10x2048x256 f32: 0.55 ms a step without, 0.10 with).
 * Every element of C is one task's fixed sequence of operations whatever the thread count, so
 * results are deterministic.
 */
#include "backend/backend.h"
#include "backend/cpu/cpu.h"

#include <omp.h>

int ampc__cpu_gemm_skinny = -1;

#define SKINNY_DIM 16   /* the largest "small" M, N or K */

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target)
#define SKINNY_X86 1
#endif
#endif

#ifdef SKINNY_X86
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define KERNEL_INLINE static inline __attribute__((always_inline)) TARGET

/* __builtin_cpu_supports checks the OS enabled the ZMM state too. */
static bool cpu_has(bool bf16) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && (!bf16 || __builtin_cpu_supports("avx512bf16"));
}

/* Mask of the first n - j of 32 lanes. */
static inline __mmask32 mask32(int64_t j, int64_t n) {
    return j >= n ? 0 : n - j >= 32 ? 0xffffffffu : (__mmask32)((1u << (n - j)) - 1u);
}

/* 32 results (v0: the first 16) into f32 or bf16 storage, lanes in m. */
KERNEL_INLINE void store32(void *c, int64_t i, __mmask32 m, __m512 v0, __m512 v1, bool c16) {
    if (c16) {
        _mm512_mask_storeu_epi16((uint16_t *)c + i, m, ampc__round_bf16_x32(v0, v1));
    } else {
        _mm512_mask_storeu_ps((float *)c + i, (__mmask16)m, v0);
        _mm512_mask_storeu_ps((float *)c + i + 16, (__mmask16)(m >> 16), v1);
    }
}

/* 16 values of f32 or bf16 storage as f32, lanes in m (others 0). */
KERNEL_INLINE __m512 load16(const void *p, int64_t i, __mmask16 m, bool b16) {
    if (!b16) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// ---------------------------------------------------------------------------------------------
// rows: C[i0 .. i0+R-1, j0 .. j0+32*NG-1], the sums in registers over a panel of B's rows

/* Rows of B per panel for a long K (small M): each task's sums go to memory between panels, so
   that B is read row by row panel after panel (ROWS_KB streams of consecutive lines) rather
   than one 32-column strip down all K rows at a time. Even, for bf16's pairs. */
#define ROWS_KB 32

typedef struct {
    int64_t M, N, K, R, ns, w;   /* ns strips of w = 32*NG columns */
    /* A packed by blocks of R rows (the last padded with copies of row M-1): f32, a(rb*R + r, k)
       at ap[(rb*K + k)*R + r]; bf16, the pair a(., 2p), a(., 2p+1) as one 32-bit word at
       ap[(rb*ceil(K/2) + p)*R + r] (an odd K's last pair padded with 0) */
    const void *ap;
    const void *b;           /* (K, N) row-major in a's dtype */
    const void *bias;        /* (N) in a's dtype, or NULL */
    void *c;                 /* (M, N), c16: bf16 else f32 */
    bool c16;
    float *part;             /* K > ROWS_KB: each task's R*2*NG partial sums between panels */
} rows_args;

/* Stores rows i0.. (those below M) of 32-column groups plus bias: acc[r][2g], acc[r][2g+1]
   hold columns j0 + 32g + (0..15, 16..31), in order for f32, in unpack order for bf16. */
KERNEL_INLINE void rows_store(const rows_args *g, __m512 acc[12][4], int R, int NG, bool b16, int64_t i0, int64_t j0) {
    /* unpack order: lo lane 4q+t holds column 8q+t, hi lane 4q+t column 8q+4+t (q, t < 4) */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    int64_t rows = g->M - i0 < R ? g->M - i0 : R;
#pragma GCC unroll 2
    for (int gi = 0; gi < NG; gi++) {
        int64_t j = j0 + 32 * gi;
        __mmask32 m = mask32(j, g->N);
        __m512 bias0 = _mm512_setzero_ps(), bias1 = bias0;
        if (g->bias) {
            bias0 = load16(g->bias, j, (__mmask16)m, b16);
            bias1 = load16(g->bias, j + 16, (__mmask16)(m >> 16), b16);
        }
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            if (r >= rows) break;
            __m512 v0 = acc[r][2 * gi], v1 = acc[r][2 * gi + 1];
            if (b16) {
                v0 = _mm512_permutex2var_ps(acc[r][2 * gi], first, acc[r][2 * gi + 1]);
                v1 = _mm512_permutex2var_ps(acc[r][2 * gi], second, acc[r][2 * gi + 1]);
            }
            store32(g->c, (i0 + r) * g->N + j, m, _mm512_add_ps(v0, bias0), _mm512_add_ps(v1, bias1), g->c16);
        }
    }
}

/* The sums start at 0 (k0 == 0) or where the previous panel left them, and end in C (k1 == K)
   or in the partial sums. */
KERNEL_INLINE void rows_begin(const rows_args *g, __m512 acc[12][4], int R, int NG, int64_t t, int64_t k0) {
    const float *p = g->part ? g->part + t * R * 2 * NG * 16 : NULL;
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < 2 * NG; v++) acc[r][v] = k0 ? _mm512_loadu_ps(p + (r * 2 * NG + v) * 16) : _mm512_setzero_ps();
}

KERNEL_INLINE void rows_end(const rows_args *g, __m512 acc[12][4], int R, int NG, bool b16, int64_t t, int64_t k1) {
    if (k1 == g->K) {
        rows_store(g, acc, R, NG, b16, t / g->ns * R, t % g->ns * g->w);
        return;
    }
    float *p = g->part + t * R * 2 * NG * 16;
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < 2 * NG; v++) _mm512_storeu_ps(p + (r * 2 * NG + v) * 16, acc[r][v]);
}

/* Task t (row block t / ns, strip t % ns) over B's rows k0 .. k1-1. */
KERNEL_INLINE void rows_block_f32(const rows_args *g, int R, int NG, int64_t t, int64_t k0, int64_t k1) {
    const int64_t N = g->N, j0 = t % g->ns * g->w;
    const float *ap = (const float *)g->ap + (t / g->ns * g->K + k0) * R, *bp = (const float *)g->b + k0 * N + j0;
    __m512 acc[12][4];
    __mmask16 m[4];
#pragma GCC unroll 2
    for (int gi = 0; gi < NG; gi++) {
        __mmask32 mg = mask32(j0 + 32 * gi, N);
        m[2 * gi] = (__mmask16)mg, m[2 * gi + 1] = (__mmask16)(mg >> 16);
    }
    rows_begin(g, acc, R, NG, t, k0);
    for (int64_t k = k0; k < k1; k++, ap += R, bp += N) {
        __m512 bv[4];
#pragma GCC unroll 4
        for (int v = 0; v < 2 * NG; v++) {
            _mm_prefetch((const char *)(bp + g->w + 16 * v), _MM_HINT_T0);   /* the next task's strip */
            bv[v] = _mm512_maskz_loadu_ps(m[v], bp + 16 * v);
        }
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            __m512 av = _mm512_set1_ps(ap[r]);
#pragma GCC unroll 4
            for (int v = 0; v < 2 * NG; v++) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
        }
    }
    rows_end(g, acc, R, NG, false, t, k1);
}

/* One pair of k: rows b0 and b1 of B (b1 NULL: zeros), pairs of A at ap; w: the strip width. */
KERNEL_INLINE void rows_pair_bf16(__m512 acc[12][4], int R, int NG, const uint32_t *ap, const uint16_t *b0,
                                  const uint16_t *b1, const __mmask32 *m, int64_t w) {
    __m512bh lo[2], hi[2];
#pragma GCC unroll 2
    for (int gi = 0; gi < NG; gi++) {
        _mm_prefetch((const char *)(b0 + w + 32 * gi), _MM_HINT_T0);   /* the next task's strip */
        if (b1) _mm_prefetch((const char *)(b1 + w + 32 * gi), _MM_HINT_T0);
        __m512i x0 = _mm512_maskz_loadu_epi16(m[gi], b0 + 32 * gi);
        __m512i x1 = b1 ? _mm512_maskz_loadu_epi16(m[gi], b1 + 32 * gi) : _mm512_setzero_si512();
        lo[gi] = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
        hi[gi] = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; r++) {
        __m512bh av = (__m512bh)_mm512_set1_epi32((int)ap[r]);
#pragma GCC unroll 2
        for (int gi = 0; gi < NG; gi++) {
            acc[r][2 * gi] = _mm512_dpbf16_ps(acc[r][2 * gi], av, lo[gi]);
            acc[r][2 * gi + 1] = _mm512_dpbf16_ps(acc[r][2 * gi + 1], av, hi[gi]);
        }
    }
}

/* As rows_block_f32; k0 is even. */
KERNEL_INLINE void rows_block_bf16(const rows_args *g, int R, int NG, int64_t t, int64_t k0, int64_t k1) {
    const int64_t N = g->N, j0 = t % g->ns * g->w;
    const uint32_t *ap = (const uint32_t *)g->ap + (t / g->ns * ((g->K + 1) / 2) + k0 / 2) * R;
    const uint16_t *bp = (const uint16_t *)g->b + k0 * N + j0;
    __m512 acc[12][4];
    __mmask32 m[2];
#pragma GCC unroll 2
    for (int gi = 0; gi < NG; gi++) m[gi] = mask32(j0 + 32 * gi, N);
    rows_begin(g, acc, R, NG, t, k0);
    int64_t k = k0;
    for (; k + 2 <= k1; k += 2, ap += R, bp += 2 * N) rows_pair_bf16(acc, R, NG, ap, bp, bp + N, m, g->w);
    if (k < k1) rows_pair_bf16(acc, R, NG, ap, bp, NULL, m, g->w);
    rows_end(g, acc, R, NG, true, t, k1);
}

/* Blocks of R rows by 32*NG columns, at most 24 sums. */
#define ROWS_NG(R) ((R) <= 6 ? 2 : 1)
#define ROWS_INSTANCE(R)                                                                           \
    TARGET static void rows_##R(const rows_args *g, bool b16, int64_t t, int64_t k0, int64_t k1) { \
        if (b16) rows_block_bf16(g, R, ROWS_NG(R), t, k0, k1);                                     \
        else rows_block_f32(g, R, ROWS_NG(R), t, k0, k1);                                          \
    }
ROWS_INSTANCE(1) ROWS_INSTANCE(2) ROWS_INSTANCE(4) ROWS_INSTANCE(8) ROWS_INSTANCE(12)
typedef void (*rows_fn)(const rows_args *g, bool b16, int64_t t, int64_t k0, int64_t k1);

/* Block height for M rows: the fewest padding rows up to 16, else 12 (24 sums of 16 columns). */
static int rows_height(int64_t M) { return M <= 1 ? 1 : M <= 2 ? 2 : M <= 4 ? 4 : M <= 8 ? 8 : M <= 12 ? 12 : M <= 16 ? 8 : 12; }

/* Packs a(i, k) = p[i*rs + k*ks] (f32 or bf16 storage) as rows_args.ap. */
static void rows_pack(void *ap, const void *p, bool b16, int64_t M, int64_t K, int64_t R, int64_t rs, int64_t ks) {
    int64_t nrb = (M + R - 1) / R, P = (K + 1) / 2;
    for (int64_t rb = 0; rb < nrb; rb++)
        for (int64_t r = 0; r < R; r++) {
            int64_t i = rb * R + r < M ? rb * R + r : M - 1;
            if (!b16) {
                for (int64_t k = 0; k < K; k++) ((float *)ap)[(rb * K + k) * R + r] = ((const float *)p)[i * rs + k * ks];
                continue;
            }
            const uint16_t *a = p;
            for (int64_t q = 0; q < P; q++) {
                uint32_t hi = 2 * q + 1 < K ? a[i * rs + (2 * q + 1) * ks] : 0;
                ((uint32_t *)ap)[(rb * P + q) * R + r] = a[i * rs + 2 * q * ks] | hi << 16;
            }
        }
}

/* Tasks (row block, strip) split evenly over the threads in order; each thread runs its tasks
   over one panel of B's rows after the other. */
static void rows_run(const rows_args *g, bool b16, int nthr) {
    rows_fn fn = g->R == 1 ? rows_1 : g->R == 2 ? rows_2 : g->R == 4 ? rows_4 : g->R == 8 ? rows_8 : rows_12;
    int64_t tasks = (g->M + g->R - 1) / g->R * g->ns;
#pragma omp parallel num_threads(nthr) if (nthr > 1)
    {
        int64_t th = omp_get_thread_num(), nt = omp_get_num_threads(), t0 = tasks * th / nt, t1 = tasks * (th + 1) / nt;
        for (int64_t k0 = 0; k0 < g->K; k0 += ROWS_KB)
            for (int64_t t = t0; t < t1; t++) fn(g, b16, t, k0, g->K - k0 < ROWS_KB ? g->K : k0 + ROWS_KB);
    }
}

// ---------------------------------------------------------------------------------------------
// dots: C[i0 .. i0+R-1, j0 .. j0+NB-1] as R*NB dot products along K

typedef struct {
    int64_t M, N, K, R, NB, ncb;   /* blocks of R rows by NB columns, ncb of them per row */
    const void *a, *bt;      /* (M, K) and (N, K) row-major, in one dtype */
    const void *bias;        /* (N) in a's dtype, or NULL */
    void *c;                 /* (M, N), c16: bf16 else f32 */
    bool c16;
} dots_args;

/* acc[r][n] += the products of one step along K (16 f32 or 32 bf16 values), lanes in m. */
KERNEL_INLINE void dots_step(__m512 acc[8][6], int R, int NB, bool b16, const char *const *ar, const char *const *br,
                             int64_t k, __mmask32 m) {
    __m512 bv[6];
#pragma GCC unroll 6
    for (int n = 0; n < NB; n++)
        bv[n] = b16 ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(m, (const uint16_t *)br[n] + k))
                    : _mm512_maskz_loadu_ps((__mmask16)m, (const float *)br[n] + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        _mm_prefetch(ar[r] + k * (b16 ? 2 : 4) + 1024, _MM_HINT_T0);   /* A streams from memory */
        if (b16) {
            __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)ar[r] + k);
#pragma GCC unroll 6
            for (int n = 0; n < NB; n++) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], av, (__m512bh)bv[n]);
        } else {
            __m512 av = _mm512_maskz_loadu_ps((__mmask16)m, (const float *)ar[r] + k);
#pragma GCC unroll 6
            for (int n = 0; n < NB; n++) acc[r][n] = _mm512_fmadd_ps(av, bv[n], acc[r][n]);
        }
    }
}

/* Task t: row block t / ncb, column block t % ncb. */
KERNEL_INLINE void dots_block(const dots_args *g, int R, int NB, bool b16, int64_t t) {
    const int64_t K = g->K, step = b16 ? 32 : 16, sz = b16 ? 2 : 4, i0 = t / g->ncb * R, j0 = t % g->ncb * NB;
    const char *ar[8], *br[6];   /* rows and columns past the end recompute the last one */
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) ar[r] = (const char *)g->a + (i0 + r < g->M ? i0 + r : g->M - 1) * K * sz;
#pragma GCC unroll 6
    for (int n = 0; n < NB; n++) br[n] = (const char *)g->bt + (j0 + n < g->N ? j0 + n : g->N - 1) * K * sz;
    __m512 acc[8][6];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 6
        for (int n = 0; n < NB; n++) acc[r][n] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + step <= K; k += step) dots_step(acc, R, NB, b16, ar, br, k, 0xffffffffu);
    if (k < K) dots_step(acc, R, NB, b16, ar, br, k, mask32(k, K));
    float s[8][6];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 6
        for (int n = 0; n < NB; n++) s[r][n] = _mm512_reduce_add_ps(acc[r][n]);
    for (int r = 0; r < R && i0 + r < g->M; r++)
        for (int n = 0; n < NB && j0 + n < g->N; n++) {
            float v = s[r][n] + (g->bias ? ampc__cpu_ld(g->bias, (size_t)(j0 + n), b16) : 0.0f);
            ampc__cpu_st(g->c, (size_t)((i0 + r) * g->N + j0 + n), v, g->c16);
        }
}

/* Blocks of NB (1..6) columns by R rows, R*NB <= 24 sums (R at most 8): with the operands of
   the NB columns and of one row, at most 31 registers. */
#define DOTS_R(NB) ((NB) <= 3 ? 8 : 24 / (NB))
#define DOTS_INSTANCE(NB)                                                                          \
    TARGET static void dots_##NB(const dots_args *g, bool b16, int64_t t) {                        \
        if (b16) dots_block(g, DOTS_R(NB), NB, true, t);                                           \
        else dots_block(g, DOTS_R(NB), NB, false, t);                                              \
    }
DOTS_INSTANCE(1) DOTS_INSTANCE(2) DOTS_INSTANCE(3) DOTS_INSTANCE(4) DOTS_INSTANCE(5) DOTS_INSTANCE(6)
typedef void (*dots_fn)(const dots_args *g, bool b16, int64_t t);
static const dots_fn dots_fns[7] = {NULL, dots_1, dots_2, dots_3, dots_4, dots_5, dots_6};

/* Column blocks of equal width, at most 6. */
static int64_t dots_width(int64_t N) { return (N + (N + 5) / 6 - 1) / ((N + 5) / 6); }

static void dots_run(const dots_args *g, bool b16, int nthr) {
    dots_fn fn = dots_fns[g->NB];
    int64_t tasks = (g->M + g->R - 1) / g->R * g->ncb;
#pragma omp parallel for num_threads(nthr) if (nthr > 1) schedule(static)
    for (int64_t t = 0; t < tasks; t++) fn(g, b16, t);
}

/* dst (cols, rows) = src (rows, cols) transposed, elements of 2 or 4 bytes (bits copied). */
static void transpose(const void *src, void *dst, int64_t rows, int64_t cols, size_t sz) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++)
            if (sz == 2) ((uint16_t *)dst)[j * rows + i] = ((const uint16_t *)src)[i * cols + j];
            else ((uint32_t *)dst)[j * rows + i] = ((const uint32_t *)src)[i * cols + j];
}
#endif /* SKINNY_X86 */

// ---------------------------------------------------------------------------------------------
// Dispatch

typedef enum { SKINNY_NONE = 0, SKINNY_ROWS, SKINNY_DOTS } skinny_kind;

/* The rule (ampc__cpu_gemm_skinny -1) comes from per-call times on this machine (Zen 5, 2
   threads, OMP_WAIT_POLICY=passive, 16 MB written between calls as the other kernels of a
   training step would; min of 3x60 calls):
   - one thread beats oneDNN's two on the mlp head (f32 1.2-1.7x, bf16 1.7-2.3x) and matches or
     beats it on the other skinny shapes tried below SKINNY_THREADED MACs: oneDNN's parallel
     region alone takes 5-50 us to wake its sleeping threads; from there on both split the work;
   - with a small dimension of 32, oneDNN wins most shapes (at 24 it is mixed): SKINNY_DIM 16;
   - f32 dots loses from N 13 on (three column blocks, A read three times; 256x13x2048: 100 vs
     86 us) and on large problems (streaming A from memory), which stay with oneDNN. */
#define SKINNY_THREADED ((int64_t)1 << 24)
#define DOTS_F32_MAX_N 12

/* Which kernel takes the normalised d for operands of dtype dt, if any. */
static skinny_kind choose(const ampc_gemm_desc *d, ampc_dtype dt) {
#ifdef SKINNY_X86
    if (ampc__cpu_gemm_skinny == 0 || d->batch != 1 || (dt != AMPC_F32 && dt != AMPC_BF16) || !cpu_has(dt == AMPC_BF16))
        return SKINNY_NONE;
    bool slow_f32 = ampc__cpu_gemm_skinny < 0 && dt == AMPC_F32 &&
                    (d->N > DOTS_F32_MAX_N || d->M * d->N * d->K >= SKINNY_THREADED);
    if (d->K <= SKINNY_DIM) return SKINNY_ROWS;                        /* a tb B is transposed: K x N */
    if (d->N <= SKINNY_DIM && !d->ta && !slow_f32) return SKINNY_DOTS;   /* a !tb B is transposed: N x K */
    if (d->M <= SKINNY_DIM && !d->tb) return SKINNY_ROWS;
#else
    (void)d, (void)dt;
#endif
    return SKINNY_NONE;
}

bool ampc__cpu_gemm_skinny_takes(const ampc_gemm_desc *d, ampc_dtype dt, const char **name) {
    skinny_kind k = choose(d, dt);
    if (name) *name = k == SKINNY_ROWS ? "skinny:rows:avx512" : "skinny:dots:avx512";
    return k != SKINNY_NONE;
}

int ampc__cpu_gemm_skinny_run(const ampc_gemm_desc *d, const ampc_tensor *a, const ampc_tensor *b, const ampc_tensor *bias,
                              ampc_tensor *c) {
#ifdef SKINNY_X86
    skinny_kind kind = choose(d, a->dtype);
    bool b16 = a->dtype == AMPC_BF16, pack_b = kind == SKINNY_ROWS ? d->tb : !d->tb;
    size_t sz = b16 ? 2 : 4;
    /* workspace: the packed A of rows (ceil(K/2) words of two bf16 a row), the sums kept
       between panels of a long K, B transposed */
    int64_t R = kind == SKINNY_ROWS ? rows_height(d->M) : DOTS_R(dots_width(d->N)), kw = b16 ? (d->K + 1) / 2 : d->K;
    int64_t w = kind == SKINNY_ROWS ? 32 * ROWS_NG(R) : dots_width(d->N), ns = (d->N + w - 1) / w, mp = (d->M + R - 1) / R * R;
    size_t nap = kind == SKINNY_ROWS ? (size_t)(mp * kw) * 4 : 0, npart = 0;
    if (kind == SKINNY_ROWS && d->K > ROWS_KB) npart = (size_t)(mp * ns * w) * 4;
    size_t nbt = pack_b ? (size_t)(d->K * d->N) * sz : 0, block = 0;
    char *ws = NULL;
    if (nap + npart + nbt && !(ws = ampc__alloc(AMPC_DEVICE_CPU, nap + npart + nbt, AMPC_MEM_WORKSPACE, &block)))
        return ampc_last_status();
    const void *bp = ampc__data(b);
    if (pack_b) {   /* rows wants B as (K, N), dots as (N, K) */
        char *p = ws + nap + npart;
        if (kind == SKINNY_ROWS) transpose(bp, p, d->N, d->K, sz);
        else transpose(bp, p, d->K, d->N, sz);
        bp = p;
    }
    /* ampc__threads_for counts light elements: a MAC as 1/512 of one makes 2^24 MACs its 32768 */
    int64_t work = d->M * d->N * d->K;
    int nthr = work < SKINNY_THREADED ? 1 : ampc__threads_for(work / 512);
    const void *bs = bias ? ampc__data(bias) : NULL;
    bool c16 = c->dtype == AMPC_BF16;
    if (kind == SKINNY_ROWS) {
        rows_pack(ws, ampc__data(a), b16, d->M, d->K, R, d->ta ? 1 : d->K, d->ta ? d->M : 1);
        rows_args g = {.M = d->M, .N = d->N, .K = d->K, .R = R, .ns = ns, .w = w, .ap = ws, .b = bp, .bias = bs,
                       .c = ampc__data(c), .c16 = c16, .part = npart ? (float *)(ws + nap) : NULL};
        rows_run(&g, b16, nthr);
    } else {
        dots_args g = {.M = d->M, .N = d->N, .K = d->K, .R = R, .NB = w, .ncb = ns, .a = ampc__data(a), .bt = bp, .bias = bs,
                       .c = ampc__data(c), .c16 = c16};
        dots_run(&g, b16, nthr);
    }
    if (ws) ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return AMPC_OK;
#else
    (void)d, (void)a, (void)b, (void)bias, (void)c;
    return ampc__err(AMPC_ERR_UNSUPPORTED, "skinny gemm: not built for this CPU");
#endif
}
