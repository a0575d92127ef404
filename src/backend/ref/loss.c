/*
 * loss.c - REF kernels: loss (filled in by the kernel work).
 */
#include "backend/backend.h"

void ampc__ref_register_loss(ampc_backend *be) { (void)be; }
