/*
 * gemm.c - REF gemm: the plain f64 triple loop the CPU gemm is tested against, with the same
 * descriptor semantics (transposes, batch strides, 0 stride = broadcast, optional bias).
 */
#include "backend/backend.h"

static int ref_gemm(const ampc_gemm_desc *d, const ampc_tensor *a, const ampc_tensor *b, const ampc_tensor *bias,
                    ampc_tensor *c) {
    const double *A = ampc__data(a), *B = ampc__data(b), *bs = bias ? ampc__data(bias) : NULL;
    double *C = ampc__data(c);
    for (int64_t t = 0; t < d->batch; t++) {
        const double *At = A + t * d->stride_a, *Bt = B + t * d->stride_b;
        double *Ct = C + t * d->stride_c;
        for (int64_t i = 0; i < d->M; i++)
            for (int64_t j = 0; j < d->N; j++) {
                double s = 0;
                for (int64_t k = 0; k < d->K; k++) {
                    double x = d->ta ? At[k * d->M + i] : At[i * d->K + k];   /* A (K, M) or (M, K) */
                    double y = d->tb ? Bt[j * d->K + k] : Bt[k * d->N + j];   /* B (N, K) or (K, N) */
                    s += x * y;
                }
                Ct[i * d->N + j] = bs ? s + bs[j] : s;
            }
    }
    return AMPC_OK;
}

void ampc__ref_register_gemm(ampc_backend *be) { be->gemm = ref_gemm; }
