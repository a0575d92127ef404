/*
 * backend.c - the backend tables: filled once, each device's memory part registered with core
 * (before main, so core can make tensors before any op runs), and handed to the layers above.
 */
#include "backend/backend.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* cuDNN algorithms timed per shape unless asked otherwise (ampc_set_cudnn_benchmark) */
#define AMPC_CUDNN_BENCHMARK_DEFAULT 0

static ampc_backend backends[AMPC_DEVICE_COUNT];
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

#ifndef AMPC_HAVE_CUDA
static const char *no_cuda(void) { return "this build of ampc has no CUDA backend (configure with -DAMPC_CUDA=on where CUDA is installed)"; }
#endif

static _Atomic bool allow_tf32 = false;
void ampc_set_allow_tf32(bool on) { allow_tf32 = on; }
bool ampc_allow_tf32(void) { return allow_tf32; }
/* A switch that is -1 until set: then the environment variable env (0 off, anything else on)
   decides, else dflt. */
static bool env_switch(_Atomic int *sw, const char *env, bool dflt) {
    int v = *sw;
    if (v < 0) {
        const char *e = getenv(env);
        v = e && *e ? strcmp(e, "0") != 0 : dflt;
        *sw = v;
    }
    return v;
}

static _Atomic int cudnn_benchmark = -1;
void ampc_set_cudnn_benchmark(bool on) { cudnn_benchmark = on; }
bool ampc_cudnn_benchmark(void) { return env_switch(&cudnn_benchmark, "AMPC_CUDNN_BENCHMARK", AMPC_CUDNN_BENCHMARK_DEFAULT); }

/* oneDNN's Winograd kernels for small fp32 3x3 convolutions unless asked otherwise */
static _Atomic int conv_winograd = -1;
void ampc_set_conv_winograd(bool on) { conv_winograd = on; }
bool ampc_conv_winograd(void) { return env_switch(&conv_winograd, "AMPC_CONV_WINOGRAD", true); }

static _Atomic int cuda_gpu = 0;          /* the GPU the cuda device is */
static _Atomic bool cuda_gpu_taken = false;   /* the CUDA backend started on it */
int ampc_cuda_set_device(int index) {
    if (index < 0) return ampc__err(AMPC_ERR_INVALID, "cuda_set_device: GPU %d (want >= 0)", index);
    if (cuda_gpu_taken && index != cuda_gpu)
        return ampc__err(AMPC_ERR_STATE, "cuda_set_device: GPU %d is in use already; choose the GPU before the first CUDA tensor or op",
                         (int)cuda_gpu);
    cuda_gpu = index;
    return AMPC_OK;
}
int ampc_cuda_device(void) { return cuda_gpu; }
int ampc__cuda_gpu_take(void) {
    cuda_gpu_taken = true;
    return cuda_gpu;
}
int ampc_cuda_device_count(void) {
#ifdef AMPC_HAVE_CUDA
    return ampc__cu_device_count();
#else
    return 0;
#endif
}

static void fill_tables(void) {
    ampc__ensure_init();   /* CPU features and conversions first: the kernels use them */
    ampc__cpu_backend_init(&backends[AMPC_DEVICE_CPU]);
    ampc__ref_backend_init(&backends[AMPC_DEVICE_REF]);
#ifdef AMPC_HAVE_CUDA
    ampc__cuda_backend_init(&backends[AMPC_DEVICE_CUDA]);
#else
    backends[AMPC_DEVICE_CUDA].device.name = "cuda";
    backends[AMPC_DEVICE_CUDA].device.available = no_cuda;
#endif
    for (int d = 0; d < AMPC_DEVICE_COUNT; d++) ampc__device_register((ampc_device)d, &backends[d].device);
}

/* Any program that runs an op links this file (the door in dispatch.c calls ampc__backend), hence the tables. */
__attribute__((constructor)) static void register_devices(void) { pthread_once(&tables_once, fill_tables); }

const ampc_backend *ampc__backend(ampc_device dev) {
    pthread_once(&tables_once, fill_tables);
    if ((unsigned)dev >= AMPC_DEVICE_COUNT) return ampc__err_null(AMPC_ERR_INVALID, "unknown device %d", (int)dev);
    return &backends[dev];
}

bool ampc__backend_channels_last(ampc_device dev) {
    pthread_once(&tables_once, fill_tables);
    return (unsigned)dev < AMPC_DEVICE_COUNT && backends[dev].channels_last;
}

bool ampc_dtype_supported(ampc_device dev, ampc_dtype dt) {
    if ((unsigned)dev >= AMPC_DEVICE_COUNT || (unsigned)dt >= AMPC_DTYPE_COUNT || !ampc__dt(dt)->is_float) return false;
    const ampc_backend *be = ampc__backend(dev);
    return be->device.dtypes[dt] && (!be->computes || be->computes(dt));
}

bool ampc_dtype_native(ampc_device dev, ampc_dtype dt) {
    if (!ampc_dtype_supported(dev, dt)) return false;
    const ampc_backend *be = ampc__backend(dev);
    return be->native ? be->native(dt) : dt == AMPC_F32 || dt == AMPC_F64;
}
