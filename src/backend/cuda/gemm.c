/* placeholder: filled in by the gemm work */
#include "backend/cuda/cuda.h"
void ampc__cuda_register_gemm(ampc_backend *be) { (void)be; }
