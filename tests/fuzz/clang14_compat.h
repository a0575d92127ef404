/*
 * clang14_compat.h - forced into the library's sources in the fuzz build only (clang < 16), for
 * two things clang 14 can't compile or link in src/ as gcc does:
 * - __builtin_cpu_supports does not know "f16c" (a compile error in src/core/init.c and
 *   src/core/convert_x86.c): the builtin is routed through a function that asks CPUID for F16C
 *   (leaf 1, ECX bit 29; usable only with AVX's OS support) and the builtin for the rest;
 * - target_clones on static functions gives their resolvers global names, so two files with a
 *   static sum_f32 (src/backend/cpu/elementwise.c, norm.h) clash at link time: the attribute
 *   becomes `unused`, and the kernels run their default (plain x86-64) versions.
 */
#ifndef AMPC_FUZZ_CLANG14_COMPAT_H
#define AMPC_FUZZ_CLANG14_COMPAT_H

#include <cpuid.h>

static inline int ampc_fuzz_cpu_supports(const char *f) {
#define AMPC_FUZZ_ASK(name) \
    if (!__builtin_strcmp(f, name)) return __builtin_cpu_supports(name);
    AMPC_FUZZ_ASK("avx512bf16") AMPC_FUZZ_ASK("avx512bw") AMPC_FUZZ_ASK("avx512f") AMPC_FUZZ_ASK("avx2")
    AMPC_FUZZ_ASK("fma") AMPC_FUZZ_ASK("avx")
#undef AMPC_FUZZ_ASK
    if (!__builtin_strcmp(f, "f16c")) {
        unsigned a, b, c, d;
        return __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1) && __builtin_cpu_supports("avx");
    }
    return 0;   /* a feature this list lacks: the plain C kernels are always correct */
}
#define __builtin_cpu_supports(name) ampc_fuzz_cpu_supports(name)
#define target_clones(...) unused

#endif
