/*
 * bench_peak.c - this machine's arithmetic peak, the denominator of ampc-bench's "% of peak".
 *
 * fp32: a loop of independent AVX-512 FMAs (vfmadd231ps, 16 lanes x 2 FLOPs). bf16: a loop of
 * AVX512_BF16 dot products (vdpbf16ps: each f32 lane accumulates 2 bf16 products, so 16 x 2 x 2
 * = 64 FLOPs per instruction). Each loop keeps NACC accumulators in flight so that the
 * instruction latency (4-6 cycles) times the number of pipes (2) is covered; 24 accumulators
 * plus two operands fit in the 32 zmm registers, so nothing spills. The kernels are compiled
 * for AVX-512 through target attributes and run only after a __builtin_cpu_supports check,
 * so the program still starts on a machine without them.
 *
 * bf16 on a CPU with AMX (Sapphire Rapids and later): a loop of tile dot products (tdpbf16ps:
 * a 16x16 f32 tile += a 16x32 bf16 tile times a 32x16 one, 16 x 16 x 32 x 2 = 16384 FLOPs per
 * instruction) on four accumulator tiles, since oneDNN runs bf16 matmuls and convolutions there:
 * the bf16 peak is the larger of the two. Linux hands a process the tile state only when asked
 * (arch_prctl ARCH_REQ_XCOMP_PERM); without it, or without AMX, that loop is not run.
 *
 * The multi-thread figure runs the same loop on every OpenMP thread at once and divides all
 * threads' FLOPs by the wall time of the parallel region: what the machine sustains when the
 * other cores are busy too (clock and power limits included).
 */
#include "bench_common.h"

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

double bench_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define NACC 24
/* Repeats X(i) for i = 0..23 with literal indices, so the accumulators stay in registers. */
#define REP24(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) \
                 X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)

/* The loops must be compiled with optimisation even in Debug/sanitizer builds (at -O0 every
   accumulator lives on the stack and the "peak" drops several-fold). */
#if defined(__GNUC__) && !defined(__clang__)
#define PEAK_OPT __attribute__((optimize("O2")))
#else
#define PEAK_OPT
#endif

static volatile float sink;   /* keeps the loops' results alive */

// ---------------------------------------------------------------------------------------------
// Kernels

/* iters x NACC FMAs: acc = acc * a + b; with a < 1 the values settle near b / (1 - a) (no
   overflow, no subnormals, whatever iters is). */
PEAK_OPT __attribute__((target("avx512f"))) static float fma_loop(int64_t iters) {
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
#define DECL(i) __m512 acc##i = _mm512_set1_ps((float)(i));
    REP24(DECL)
#undef DECL
    for (int64_t it = 0; it < iters; it++) {
#define STEP(i) acc##i = _mm512_fmadd_ps(acc##i, a, b);
        REP24(STEP)
#undef STEP
    }
    __m512 s = _mm512_setzero_ps();
#define SUM(i) s = _mm512_add_ps(s, acc##i);
    REP24(SUM)
#undef SUM
    return _mm512_reduce_add_ps(s);
}

/* iters x NACC dot products: acc += a[2i] b[2i] + a[2i+1] b[2i+1] per lane, with products of
   1e-3 the sums grow by 2e-6 per step: finite for any realistic iters. */
PEAK_OPT __attribute__((target("avx512f,avx512bf16"))) static float dpbf16_loop(int64_t iters) {
    const __m512 v = _mm512_set1_ps(1e-3f);
    const __m512bh a = _mm512_cvtne2ps_pbh(v, v), b = _mm512_cvtne2ps_pbh(v, v);
#define DECL(i) __m512 acc##i = _mm512_set1_ps((float)(i));
    REP24(DECL)
#undef DECL
    for (int64_t it = 0; it < iters; it++) {
#define STEP(i) acc##i = _mm512_dpbf16_ps(acc##i, a, b);
        REP24(STEP)
#undef STEP
    }
    __m512 s = _mm512_setzero_ps();
#define SUM(i) s = _mm512_add_ps(s, acc##i);
    REP24(SUM)
#undef SUM
    return _mm512_reduce_add_ps(s);
}

/* iters x 4 tile dot products into tiles 0-3 from A tiles 4, 5 and B tiles 6, 7 (all 16 rows
   of 64 bytes); the inputs are zero, so the sums stay 0 and finite. Per thread: the tile
   configuration is a thread's own state. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

PEAK_OPT __attribute__((target("amx-tile,amx-bf16"))) static float amx_loop(int64_t iters) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t it = 0; it < iters; it++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    float out[16 * 16];
    _tile_stored(0, out, 64);
    _tile_release();
    return out[0];
}

/* AMX usable: the CPU has it and Linux grants this process the tile data state. */
static bool amx_usable(void) {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
#ifdef SYS_arch_prctl
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
}

// ---------------------------------------------------------------------------------------------
// Timing

typedef float (*loop_fn)(int64_t iters);

/* Seconds for iters iterations on each of `threads` threads (the wall time of the region). */
static double run(loop_fn f, int64_t iters, int threads) {
    double t0 = bench_now();
    if (threads <= 1) {
        sink = f(iters);
    } else {
#pragma omp parallel num_threads(threads)
        {
            float r = f(iters);
#pragma omp critical
            sink += r;
        }
    }
    return bench_now() - t0;
}

/* GFLOP/s: iterations sized from a probe to last about `seconds`, best of 3 runs (the least
   disturbed by other processes on a shared machine). */
static double rate(loop_fn f, double flops_per_iter, int threads, double seconds) {
    int64_t iters = 1 << 14;
    double t;
    while ((t = run(f, iters, threads)) < 0.01 && iters < ((int64_t)1 << 40)) iters *= 4;   /* also warms the clock up */
    iters = (int64_t)((double)iters * (seconds / 3) / t) + 1;
    double best = 1e30;
    for (int r = 0; r < 3; r++) {
        t = run(f, iters, threads);
        if (t < best) best = t;
    }
    return flops_per_iter * (double)iters * (double)(threads < 1 ? 1 : threads) / best * 1e-9;
}

void bench_peak_measure(bench_peak *p, int threads, double seconds_each) {
    memset(p, 0, sizeof *p);
    p->threads = threads < 1 ? 1 : threads;
    __builtin_cpu_init();
    p->have_fp32 = __builtin_cpu_supports("avx512f");
    p->have_bf16 = p->have_fp32 && __builtin_cpu_supports("avx512bf16");
    if (!p->have_fp32)
        snprintf(p->message, sizeof p->message, "no AVX-512 on this CPU: the fp32 and bf16 peaks are not measured");
    else if (!p->have_bf16)
        snprintf(p->message, sizeof p->message, "no AVX512_BF16 on this CPU: the bf16 peak is not measured");
    const double fma_flops = NACC * 16 * 2, dp_flops = NACC * 16 * 2 * 2;
    if (p->have_fp32) {
        p->fp32_1t = rate(fma_loop, fma_flops, 1, seconds_each);
        p->fp32_all = p->threads > 1 ? rate(fma_loop, fma_flops, p->threads, seconds_each) : p->fp32_1t;
    }
    if (p->have_bf16) {
        p->bf16_1t = rate(dpbf16_loop, dp_flops, 1, seconds_each);
        p->bf16_all = p->threads > 1 ? rate(dpbf16_loop, dp_flops, p->threads, seconds_each) : p->bf16_1t;
    }
    if ((p->have_amx = amx_usable())) {
        const double amx_flops = 4.0 * 16 * 16 * 32 * 2;
        p->amx_1t = rate(amx_loop, amx_flops, 1, seconds_each);
        p->amx_all = p->threads > 1 ? rate(amx_loop, amx_flops, p->threads, seconds_each) : p->amx_1t;
    }
}

double bench_peak_bf16_1t(const bench_peak *p) { return p->amx_1t > p->bf16_1t ? p->amx_1t : p->bf16_1t; }
