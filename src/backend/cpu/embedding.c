/*
 * embedding.c - CPU kernels that move rows: the embedding, whose forward copies the rows the
 * indices pick (any float dtype, bit for bit) and whose backward sums gy's rows into the rows
 * of gw their indices name, in f32, threads splitting the columns so that each column's sum
 * runs in index order whatever the thread count (the same bits on 1 or 16 threads, repeated
 * tokens included); and permute, which copies the blocks of the dims that stay innermost.
 */
#include "backend/cpu/cpu.h"

#include <omp.h>
#include <string.h>

static int cpu_embedding(const ampc_tensor *w, const ampc_tensor *idx, ampc_tensor *y) {
    const int64_t V = w->shape[0], D = w->shape[1], n = idx->numel;
    int rc = ampc__host_indices(idx, V, "embedding");
    if (rc < 0) return rc;
    const size_t row = (size_t)D * ampc__dt(w->dtype)->size;
    const int64_t *ix = ampc__data(idx);
    const char *src = ampc__data(w);
    char *dst = ampc__data(y);
#pragma omp parallel for num_threads(ampc__threads_for(n * D)) schedule(static)
    for (int64_t i = 0; i < n; i++) memcpy(dst + (size_t)i * row, src + (size_t)ix[i] * row, row);
    return AMPC_OK;
}

/* Columns per thread at least this many (a cache line of f32 and more). */
#define EMB_MIN_COLS 64

static int cpu_embedding_backward(const ampc_tensor *gy, const ampc_tensor *idx, ampc_tensor *gw) {
    const int64_t V = gw->shape[0], D = gw->shape[1], n = idx->numel;
    int rc = ampc__host_indices(idx, V, "embedding_backward");
    if (rc < 0) return rc;
    int nt = ampc__threads_for(n * D);
    int64_t most = (D + EMB_MIN_COLS - 1) / EMB_MIN_COLS;
    if (nt > most) nt = (int)(most > 0 ? most : 1);
    const bool direct = gw->dtype == AMPC_F32, g32 = gy->dtype == AMPC_F32;
    /* scratch: the f32 sums when gw is 16-bit (V, D), then one row slice of gy per thread */
    size_t nacc = direct ? 0 : (size_t)(V * D), nbuf = g32 ? 0 : (size_t)nt * (size_t)D, block = 0;
    float *ws = nacc + nbuf ? ampc__alloc(AMPC_DEVICE_CPU, (nacc + nbuf) * sizeof(float), AMPC_MEM_WORKSPACE, &block) : NULL;
    if (nacc + nbuf && !ws) return ampc_last_status();
    float *acc = direct ? ampc__data(gw) : ws;
    memset(acc, 0, (size_t)(V * D) * sizeof(float));
    const int64_t *ix = ampc__data(idx);
    const ampc_dtype_traits *tr = ampc__dt(gy->dtype);
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num();
        int64_t c0 = D * t / nt, c1 = D * (t + 1) / nt, len = c1 - c0;
        float *buf = g32 ? NULL : ws + nacc + (size_t)t * (size_t)D;
        for (int64_t i = 0; i < n; i++) {
            const float *g;
            if (g32) {
                g = (const float *)ampc__data(gy) + i * D + c0;
            } else {
                tr->to_f32((const char *)ampc__data(gy) + (size_t)(i * D + c0) * tr->size, buf, (size_t)len);
                g = buf;
            }
            float *a = acc + ix[i] * D + c0;
#pragma omp simd
            for (int64_t c = 0; c < len; c++) a[c] += g[c];
        }
    }
    if (!direct) ampc__dt(gw->dtype)->from_f32(acc, ampc__data(gw), (size_t)(V * D));
    if (ws) ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return AMPC_OK;
}

// ---------------------------------------------------------------------------------------------
// Permute: y's element (i_0, .., i_n) is x's at (i_perm^-1 ...); the trailing dims that keep
// their place form blocks copied whole (attention's (B, T, H, D) -> (B, H, T, D) copies rows
// of D), one block per step of the outer odometer.

static int cpu_permute(const ampc_tensor *x, const int *perm, ampc_tensor *y) {
    const int nd = x->ndim;
    if (y->numel == 0) return AMPC_OK;
    const size_t es = ampc__dt(x->dtype)->size;
    int k = nd;
    int64_t inner = 1, xs[AMPC_MAX_DIMS], s = 1;
    while (k > 0 && perm[k - 1] == k - 1) inner *= x->shape[--k];
    for (int i = nd - 1; i >= 0; i--) {
        xs[i] = s;
        s *= x->shape[i];
    }
    const int64_t outer = y->numel / inner;
    const size_t blk = (size_t)inner * es;
    const char *src = ampc__data(x);
    char *dst = ampc__data(y);
#pragma omp parallel for num_threads(ampc__threads_for(y->numel)) schedule(static)
    for (int64_t o = 0; o < outer; o++) {
        int64_t r = o, off = 0;
        for (int i = k - 1; i >= 0; i--) {
            off += r % y->shape[i] * xs[perm[i]];
            r /= y->shape[i];
        }
        memcpy(dst + (size_t)o * blk, src + (size_t)off * es, blk);
    }
    return AMPC_OK;
}

void ampc__cpu_register_embedding(ampc_backend *be) {
    be->permute = cpu_permute;
    be->embedding = cpu_embedding;
    be->embedding_backward = cpu_embedding_backward;
}
