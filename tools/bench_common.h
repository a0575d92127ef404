/*
 * bench_common.h - what the pieces of ampc-bench share: the machine-peak measurement
 * (bench_peak.c) and the per-kernel profiler (bench_profile.c). ampc-bench.c holds the
 * workloads, the timing loop, the tables and the JSON.
 */
#ifndef AMPC_BENCH_COMMON_H
#define AMPC_BENCH_COMMON_H

#include <stdbool.h>
#include <stdio.h>

double bench_now(void);   /* monotonic seconds */

// ---------------------------------------------------------------------------------------------
// Machine peak (bench_peak.c)

/* GFLOP/s of this machine's widest fp32 FMA (AVX-512 vfmadd231ps) and bf16 dot products
   (AVX512_BF16 vdpbf16ps; AMX tdpbf16ps where the CPU has AMX), on one thread and on `threads`
   OpenMP threads. A rate is 0 when the instruction is missing (the message says which). */
typedef struct {
    bool have_fp32, have_bf16, have_amx;
    int threads;
    double fp32_1t, fp32_all;   /* GFLOP/s */
    double bf16_1t, bf16_all;   /* vdpbf16ps */
    double amx_1t, amx_all;     /* tdpbf16ps */
    char message[160];          /* why a rate is missing, or "" */
} bench_peak;

/* Measures for about seconds_each per figure (best of a few repeats). */
void bench_peak_measure(bench_peak *p, int threads, double seconds_each);
/* The bf16 peak of one thread: the faster of vdpbf16ps and AMX (oneDNN uses AMX where it can). */
double bench_peak_bf16_1t(const bench_peak *p);

// ---------------------------------------------------------------------------------------------
// Per-kernel profile (bench_profile.c): wraps the CPU backend's kernel table with timers.

void bench_profile_install(void);     /* idempotent; kernels are timed from here on */
void bench_profile_uninstall(void);   /* the original kernels again */
void bench_profile_reset(void);
/* Prints the breakdown of the kernels run since the reset, over `steps` steps that took
   step_seconds in all (the difference is op/autograd/allocator overhead outside kernels). */
void bench_profile_print(FILE *f, int steps, double step_seconds);
/* FLOPs the gemm and convolution kernels did since the reset (a check of the analytic count). */
double bench_profile_flops(void);

#endif /* AMPC_BENCH_COMMON_H */
