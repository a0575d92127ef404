/*
 * embedding.c - the CUDA table's row movers, embedding and permute: launches here (the door checked
 * the arguments), the kernels in embedding.cu. Semantics are the CPU backend's
 * (src/backend/cpu/embedding.c). The indices live on the GPU: the kernels flag one outside [0, V)
 * (and never read through it), and the flag is read back (one small copy and a stream
 * synchronisation per call) to report it as the CPU does.
 */
#include "backend/cuda/cuda.h"
#include "backend/cuda/ew_kernels.h"

/* Reads the kernels' flag back: the error naming the op when an index was out of range */
static int check_flag(int *bad, cudaStream_t s, const char *who, int64_t V) {
    int h = 0;
    int rc = ampc__cu_check(cudaMemcpyAsync(&h, bad, sizeof h, cudaMemcpyDeviceToHost, s), who);
    if (rc >= 0) rc = ampc__cu_check(cudaStreamSynchronize(s), who);
    if (rc >= 0 && h) rc = ampc__err(AMPC_ERR_INVALID, "%s: an index is out of range [0, %lld)", who, (long long)V);
    return rc;
}

static int cu_embedding(const ampc_tensor *w, const ampc_tensor *idx, ampc_tensor *y) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    const int64_t V = w->shape[0], D = w->shape[1], n = idx->numel;
    if (n == 0 || D == 0) return AMPC_OK;
    cudaStream_t s = ampc__cu_stream();
    size_t block = 0;
    int *bad = ampc__cu_scratch(sizeof(int), &block);
    if (!bad) return ampc_last_status();
    rc = ampc__cu_check(cudaMemsetAsync(bad, 0, sizeof(int), s), "embedding");
    if (rc >= 0)
        rc = ampc__cu_check(ampc_cu_embedding(ampc__data(w), w->dtype, ampc__data(idx), ampc__data(y), n, V, D, bad, s), "embedding");
    if (rc >= 0) rc = check_flag(bad, s, "embedding", V);
    ampc__cu_scratch_free(bad, block);
    return rc;
}

static int cu_embedding_backward(const ampc_tensor *gy, const ampc_tensor *idx, ampc_tensor *gw) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    const int64_t V = gw->shape[0], D = gw->shape[1], n = idx->numel;
    cudaStream_t s = ampc__cu_stream();
    const bool direct = gw->dtype == AMPC_F32;
    /* scratch: the flag, then the f32 sums when gw is 16-bit */
    size_t block = 0;
    int *bad = ampc__cu_scratch(256 + (direct ? 0 : (size_t)(V * D) * sizeof(float)), &block);
    if (!bad) return ampc_last_status();
    float *acc = direct ? ampc__data(gw) : (float *)((char *)bad + 256);
    rc = ampc__cu_check(cudaMemsetAsync(bad, 0, sizeof(int), s), "embedding_backward");
    if (rc >= 0) rc = ampc__cu_check(cudaMemsetAsync(acc, 0, (size_t)(V * D) * sizeof(float), s), "embedding_backward");
    if (rc >= 0)
        rc = ampc__cu_check(ampc_cu_embedding_backward(ampc__data(gy), gy->dtype, ampc__data(idx), acc, AMPC_F32, n, V, D, bad, s),
                            "embedding_backward");
    if (rc >= 0 && !direct)
        rc = ampc__cu_check(ampc_cu_convert(acc, AMPC_F32, ampc__data(gw), gw->dtype, V * D, s), "embedding_backward");
    if (rc >= 0) rc = check_flag(bad, s, "embedding_backward", V);
    ampc__cu_scratch_free(bad, block);
    return rc;
}

static int cu_permute(const ampc_tensor *x, const int *perm, ampc_tensor *y) {
    int rc;
    if ((rc = ampc__cu_ready()) < 0) return rc;
    return ampc__cu_check(ampc_cu_permute(ampc__data(x), ampc__data(y), ampc__dt(x->dtype)->size, x->ndim, x->shape, perm, y->numel,
                                          ampc__cu_stream()),
                          "permute");
}

void ampc__cuda_register_embedding(ampc_backend *be) {
    be->permute = cu_permute;
    be->embedding = cu_embedding;
    be->embedding_backward = cu_embedding_backward;
}
