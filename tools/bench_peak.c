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
 * The multi-thread figure runs the same loop on every OpenMP thread at once and divides all
 * threads' FLOPs by the wall time of the parallel region: what the machine sustains when the
 * other cores are busy too (clock and power limits included).
 */
#include "bench_common.h"

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

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
}
