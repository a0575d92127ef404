/*
 * cuda_backend.c - the CUDA device: start-up, memory, copies between dtypes and layouts,
 * transfers to and from the host, and the table of kernels (filled by the other files here).
 */
#include "backend/cuda/cuda.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

static struct {
    pthread_once_t once;
    int status;               /* AMPC_OK once started */
    char why[256];            /* why not, else "" */
    cudaStream_t stream;
    cudaStream_t copies;      /* the uploads' own stream (cu_upload) */
    int sm_count;
    int gpu;                  /* which GPU (ampc_cuda_set_device) */
} G = {.once = PTHREAD_ONCE_INIT};

/* The runtime's current GPU is per host thread: each thread that reaches the device makes it
   this process's GPU once (the stream and every allocation belong to it). */
static _Thread_local bool thread_bound;
static void bind_thread(void) {
    if (!thread_bound && G.gpu != 0) cudaSetDevice(G.gpu);
    thread_bound = true;
}

int ampc__cu_device_count(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

static void start(void) {
    int n = 0;
    G.gpu = ampc__cuda_gpu_take();
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        snprintf(G.why, sizeof G.why, "no CUDA GPU found (%s)", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        G.status = AMPC_ERR_UNSUPPORTED;
        return;
    }
    if (G.gpu >= n) {
        snprintf(G.why, sizeof G.why, "GPU %d asked for, and this process sees %d (0 to %d; CUDA_VISIBLE_DEVICES may hide some)",
                 G.gpu, n, n - 1);
        G.status = AMPC_ERR_INVALID;
        return;
    }
    if ((e = cudaSetDevice(G.gpu)) == cudaSuccess) e = cudaStreamCreateWithFlags(&G.stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&G.copies, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&G.sm_count, cudaDevAttrMultiProcessorCount, G.gpu);
    if (e != cudaSuccess) {
        snprintf(G.why, sizeof G.why, "CUDA GPU %d could not be started (%s)", G.gpu, cudaGetErrorString(e));
        G.status = AMPC_ERR_BACKEND;
        return;
    }
    thread_bound = true;   /* start's own thread is bound by the cudaSetDevice above */
    G.status = AMPC_OK;
}

static const char *cu_available(void) {
    pthread_once(&G.once, start);
    return G.status == AMPC_OK ? NULL : G.why;
}

int ampc__cu_ready(void) {
    const char *why = cu_available();
    if (why) return ampc__err(G.status, "device cuda: %s", why);
    bind_thread();
    return AMPC_OK;
}

cudaStream_t ampc__cu_stream(void) {
    bind_thread();
    return G.stream;
}
int ampc__cu_sm_count(void) { return G.sm_count; }

int ampc__cu_check(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return AMPC_OK;
    cudaGetLastError();   /* clears a non-sticky error */
    return ampc__err(e == cudaErrorMemoryAllocation ? AMPC_ERR_OOM : AMPC_ERR_BACKEND, "cuda: %s: %s", what,
                     cudaGetErrorString(e));
}

void *ampc__cu_scratch(size_t nbytes, size_t *block_bytes) {
    return ampc__alloc(AMPC_DEVICE_CUDA, nbytes ? nbytes : 1, AMPC_MEM_WORKSPACE, block_bytes);
}

void ampc__cu_scratch_free(void *p, size_t block_bytes) {
    if (p) ampc__free(AMPC_DEVICE_CUDA, p, block_bytes, AMPC_MEM_WORKSPACE);
}

// ---------------------------------------------------------------------------------------------
// Memory, copies, fill

static void *cu_alloc(size_t nbytes) {
    if (ampc__cu_ready() < 0) return NULL;
    void *p = NULL;
    if (cudaMalloc(&p, nbytes) != cudaSuccess) {
        cudaGetLastError();
        return NULL;   /* core's allocator reports AMPC_ERR_OOM */
    }
    return p;
}

static void cu_free(void *p) {
    if (p) cudaFree(p);   /* synchronises the device: blocks are only freed when the cache is emptied */
}

static int cu_copy(const ampc_tensor *src, ampc_tensor *dst) {
    int rc = ampc__cu_ready();
    if (rc < 0) return rc;
    if (src->numel == 0) return AMPC_OK;
    if (src->format != dst->format && src->ndim == 4 && dst->ndim == 4) {
        int64_t N = src->shape[0], C = src->shape[1], HW = src->shape[2] * src->shape[3];
        return ampc__cu_check(ampc_cu_convert_permute(ampc__data(src), src->dtype, ampc__data(dst), dst->dtype, N, C, HW,
                                                      dst->format == AMPC_CHANNELS_LAST, G.stream),
                              "copy with a layout change");
    }
    if (src->dtype == dst->dtype)
        return ampc__cu_check(cudaMemcpyAsync(ampc__data(dst), ampc__data(src), ampc__nbytes(src), cudaMemcpyDeviceToDevice, G.stream),
                              "device copy");
    return ampc__cu_check(ampc_cu_convert(ampc__data(src), src->dtype, ampc__data(dst), dst->dtype, src->numel, G.stream),
                          "dtype conversion");
}

static int cu_fill(ampc_tensor *t, double value) {
    int rc = ampc__cu_ready();
    if (rc < 0) return rc;
    return ampc__cu_check(ampc_cu_fill(ampc__data(t), t->dtype, t->numel, value, G.stream), "fill");
}

/* One of src, dst on the host, the other here; same dtype, format and numel (core checks). */
static int cu_transfer(const ampc_tensor *src, ampc_tensor *dst) {
    int rc = ampc__cu_ready();
    if (rc < 0) return rc;
    if (src->dtype != dst->dtype || src->format != dst->format || src->numel != dst->numel)
        return ampc__err(AMPC_ERR_INVALID, "cuda transfer between unlike tensors");
    size_t n = ampc__nbytes(src);
    if (n == 0) return AMPC_OK;
    if (dst->device == AMPC_DEVICE_CUDA) {
        /* from pageable memory the copy is staged by the driver and the call returns once the
           source was read: the caller may reuse its buffer at once */
        return ampc__cu_check(cudaMemcpyAsync(ampc__data(dst), ampc__data(src), n, cudaMemcpyHostToDevice, G.stream), "copy to the GPU");
    }
    rc = ampc__cu_check(cudaMemcpyAsync(ampc__data(dst), ampc__data(src), n, cudaMemcpyDeviceToHost, G.stream), "copy from the GPU");
    if (rc >= 0) rc = ampc__cu_check(cudaStreamSynchronize(G.stream), "copy from the GPU (a kernel queued before it failed)");
    return rc;
}

static int cu_synchronize(void) {
    int rc = ampc__cu_ready();
    return rc < 0 ? rc : ampc__cu_check(cudaStreamSynchronize(G.stream), "synchronize");
}

static bool cu_host_pin(void *p, size_t nbytes) {
    if (ampc__cu_ready() < 0 || nbytes == 0) return false;
    if (cudaHostRegister(p, nbytes, cudaHostRegisterDefault) == cudaSuccess) return true;
    cudaGetLastError();   /* not pinned: transfers stage through the driver as before */
    return false;
}

static void cu_host_unpin(void *p) {
    if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
}

/* The loader's uploads: the copy stream waits for the work queued so far (an event recorded
   on the compute stream: dst's block may have served kernels still queued there, the caching
   allocator being one-stream), copies, and records the fence, an event the compute stream
   waits on (cu_fence_order) before the work that reads dst. */
static int cu_upload(ampc_tensor *dst, const void *src, size_t n, void **fence) {
    *fence = NULL;
    int rc = ampc__cu_ready();
    if (rc < 0) return rc;
    cudaEvent_t before = NULL, done = NULL;
    cudaError_t e = cudaEventCreateWithFlags(&before, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(before, G.stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(G.copies, before, 0);
    if (e == cudaSuccess) e = cudaMemcpyAsync(ampc__data(dst), src, n, cudaMemcpyHostToDevice, G.copies);
    if (e == cudaSuccess) e = cudaEventRecord(done, G.copies);
    if (before) cudaEventDestroy(before);   /* released once the wait on it is done */
    if (e != cudaSuccess) {
        if (done) cudaEventDestroy(done);
        return ampc__cu_check(e, "upload to the GPU");
    }
    *fence = done;
    return AMPC_OK;
}

static int cu_fence_order(void *fence) {
    int rc = ampc__cu_ready();
    return rc < 0 ? rc : ampc__cu_check(cudaStreamWaitEvent(G.stream, (cudaEvent_t)fence, 0), "ordering after an upload");
}

static int cu_fence_done(void *fence) {
    cudaError_t e = cudaEventQuery((cudaEvent_t)fence);
    if (e == cudaErrorNotReady) {
        cudaGetLastError();
        return 0;
    }
    return e == cudaSuccess ? 1 : ampc__cu_check(e, "upload to the GPU");
}

static void cu_fence_free(void *fence) {
    if (!fence) return;
    if (cudaEventSynchronize((cudaEvent_t)fence) != cudaSuccess) cudaGetLastError();
    cudaEventDestroy((cudaEvent_t)fence);
}

static void cu_shutdown(void) {
    if (G.status == AMPC_OK && G.stream) cudaStreamSynchronize(G.stream);
    if (G.status == AMPC_OK && G.copies) cudaStreamSynchronize(G.copies);
}

/* tensor cores for every float dtype: matmuls and convolutions compute in any of them */
static bool cu_computes(ampc_dtype dt) { return dt == AMPC_F32 || dt == AMPC_F16 || dt == AMPC_BF16; }
static bool cu_native(ampc_dtype dt) { return cu_computes(dt); }

void ampc__cuda_backend_init(ampc_backend *be) {
    memset(be, 0, sizeof *be);
    be->device.name = "cuda";
    be->device.host_memory = false;
    be->device.dtypes[AMPC_F32] = be->device.dtypes[AMPC_F16] = be->device.dtypes[AMPC_BF16] = be->device.dtypes[AMPC_I64] = true;
    be->device.raw_alloc = cu_alloc;
    be->device.raw_free = cu_free;
    be->device.copy = cu_copy;
    be->device.fill = cu_fill;
    be->device.shutdown = cu_shutdown;
    be->device.available = cu_available;
    be->device.transfer = cu_transfer;
    be->device.synchronize = cu_synchronize;
    be->device.host_pin = cu_host_pin;
    be->device.host_unpin = cu_host_unpin;
    be->device.upload = cu_upload;
    be->device.fence_order = cu_fence_order;
    be->device.fence_done = cu_fence_done;
    be->device.fence_free = cu_fence_free;
    be->computes = cu_computes;
    be->native = cu_native;
    be->channels_last = true;   /* conv (conv.c), pooling (pool.c) and batch norm (batch_norm.c) take NHWC */
    ampc__cuda_register_elementwise(be);
    ampc__cuda_register_loss(be);
    ampc__cuda_register_random(be);
    ampc__cuda_register_gemm(be);
    ampc__cuda_register_optim(be);
    ampc__cuda_register_conv(be);
    ampc__cuda_register_pool(be);
    ampc__cuda_register_batch_norm(be);
    ampc__cuda_register_layer_norm(be);
    ampc__cuda_register_embedding(be);
    ampc__cuda_register_attention(be);
}
