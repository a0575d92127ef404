/*
 * conv_layers.c - the layers of convolutional networks: Conv2d, BatchNorm2d, MaxPool2d,
 * AvgPool2d, AdaptiveAvgPool2d and LayerNorm, with PyTorch's names, defaults and
 * initialisation. Each is a vtable and a forward that calls the public ops.
 */
#include "nn/nn.h"
#include "ops/ops.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Helpers

/* A parameter-kind tensor filled with value (BatchNorm's ones and zeros, its running stats). */
static ampc_tensor *param_full(ampc_dtype dt, int ndim, const int64_t *shape, double value) {
    ampc_mem_kind prev = ampc__mem_kind_push(AMPC_MEM_PARAMETERS);
    ampc_tensor *t = ampc_tensor_full(dt, ndim, shape, value);
    ampc__mem_kind_pop(prev);
    return t;
}

/* Copies opts into a malloc'd block for m->impl (freed by impl_free). */
static void *impl_copy(const void *opts, size_t size) {
    void *p = malloc(size);
    if (!p) return ampc__err_null(AMPC_ERR_OOM, "layer options");
    memcpy(p, opts, size);
    return p;
}

static void impl_free(ampc_module *m) {
    free(m->impl);
    m->impl = NULL;
}

/* "(N, C, H, W)" of x for messages. */
static const char *shape_of(const ampc_tensor *x, char *buf, size_t n) { return ampc__shape_str(x, buf, n); }

// ---------------------------------------------------------------------------------------------
// Conv2d: weight (O, C/groups, k, k), bias (O); impl holds the normalised ampc_conv2d_options.

static ampc_tensor *conv2d_forward(ampc_module *m, ampc_tensor *x) {
    return ampc_conv2d(x, ampc__module_param(m, "weight"), ampc__module_param(m, "bias"), m->impl);
}

static const ampc_module_vtable conv2d_vtable = {"Conv2d", conv2d_forward, impl_free};

ampc_module *ampc__conv2d_make(int64_t in_channels, int64_t out_channels, int kernel_size,
                               const ampc_conv2d_options *opts, bool bias, double weight_std) {
    ampc_conv2d_options o = opts ? *opts : (ampc_conv2d_options){0};
    for (int d = 0; d < 2; d++) {   /* zeros mean PyTorch's defaults */
        if (o.stride[d] == 0) o.stride[d] = 1;
        if (o.dilation[d] == 0) o.dilation[d] = 1;
    }
    if (o.groups == 0) o.groups = 1;
    if (in_channels <= 0 || out_channels <= 0 || kernel_size <= 0)
        return ampc__err_null(AMPC_ERR_INVALID, "Conv2d(%lld, %lld, kernel_size=%d): sizes must be positive",
                              (long long)in_channels, (long long)out_channels, kernel_size);
    for (int d = 0; d < 2; d++)
        if (o.stride[d] < 0 || o.padding[d] < 0 || o.dilation[d] < 0)
            return ampc__err_null(AMPC_ERR_INVALID, "Conv2d: negative stride (%d, %d), padding (%d, %d) or dilation (%d, %d)",
                                  o.stride[0], o.stride[1], o.padding[0], o.padding[1], o.dilation[0], o.dilation[1]);
    if (o.groups < 0 || in_channels % o.groups || out_channels % o.groups)
        return ampc__err_null(AMPC_ERR_INVALID, "Conv2d(%lld, %lld): channels must be divisible by groups=%d",
                              (long long)in_channels, (long long)out_channels, o.groups);
    ampc_module *m = ampc__module_new(&conv2d_vtable);
    if (!m) return NULL;
    m->impl = impl_copy(&o, sizeof o);
    if (!m->impl) {
        ampc_module_free(m);
        return NULL;
    }
    m->config.conv2d.in_channels = in_channels;
    m->config.conv2d.out_channels = out_channels;
    m->config.conv2d.kernel_size = kernel_size;
    m->config.conv2d.groups = o.groups;
    const int64_t k = kernel_size, cg = in_channels / o.groups;
    const int64_t wshape[4] = {out_channels, cg, k, k};
    /* PyTorch's reset_parameters: kaiming_uniform_(a=sqrt(5)) gives the bound 1/sqrt(fan_in),
       fan_in = C/groups * k * k, and the bias uses the same bound; weight draws come first. */
    double bound = 1.0 / sqrt((double)(cg * k * k));
    ampc_scope_begin();
    ampc_tensor *w = weight_std > 0 ? ampc__param_normal(4, wshape, weight_std) : ampc__param_uniform(4, wshape, bound);
    int rc = ampc__module_add_param(m, "weight", w);
    if (rc >= 0 && bias) rc = ampc__module_add_param(m, "bias", ampc__param_uniform(1, (int64_t[]){out_channels}, bound));
    ampc_scope_end();
    if (rc < 0) {
        ampc_module_free(m);
        return NULL;
    }
    return m;
}

ampc_module *ampc_conv2d_new(int64_t in_channels, int64_t out_channels, int kernel_size,
                             const ampc_conv2d_options *opts, bool bias) {
    return ampc__conv2d_make(in_channels, out_channels, kernel_size, opts, bias, 0.0);
}

// ---------------------------------------------------------------------------------------------
// BatchNorm2d: weight/bias (C), buffers running_mean/running_var (C) and num_batches_tracked
// (an int64 scalar); config.batchnorm2d: C, momentum, eps.

/* relu: relu(bn(x)); add: relu(bn(x) + z) (z NULL: the error of whatever failed to make it) */
static ampc_tensor *bn_forward(ampc_module *m, ampc_tensor *x, bool relu, bool add, ampc_tensor *z) {
    char buf[96];
    if (ampc_tensor_ndim(x) != 4)
        return ampc__err_null(AMPC_ERR_SHAPE, "BatchNorm2d(%lld): expected 4D input (got %s)", (long long)m->config.batchnorm2d.num_features,
                              shape_of(x, buf, sizeof buf));
    ampc_tensor *w = ampc__module_param(m, "weight"), *b = ampc__module_param(m, "bias");
    ampc_tensor *rm = ampc__module_buffer(m, "running_mean"), *rv = ampc__module_buffer(m, "running_var");
    double mom = m->config.batchnorm2d.momentum, eps = m->config.batchnorm2d.eps;
    bool sync = m->config.batchnorm2d.sync;
    ampc_tensor *y = add ? ampc__batch_norm2d_add_relu(x, w, b, rm, rv, z, m->training, mom, eps, sync)
                       : ampc__batch_norm2d_ex(x, w, b, rm, rv, m->training, mom, eps, relu, sync);
    if (y && m->training) {
        /* the counter lives in the buffer (not the module) so a loaded checkpoint continues
           from its value */
        if (ampc__batch_norm_count(ampc__module_buffer(m, "num_batches_tracked")) < 0) return NULL;
    }
    return y;
}

ampc_tensor *ampc__batchnorm2d_forward(ampc_module *m, ampc_tensor *x, bool relu) { return bn_forward(m, x, relu, false, NULL); }

ampc_tensor *ampc__batchnorm2d_forward_add_relu(ampc_module *m, ampc_tensor *x, ampc_tensor *z) {
    return bn_forward(m, x, true, true, z);
}

static ampc_tensor *batchnorm2d_forward(ampc_module *m, ampc_tensor *x) { return ampc__batchnorm2d_forward(m, x, false); }

static const ampc_module_vtable batchnorm2d_vtable = {"BatchNorm2d", batchnorm2d_forward, NULL};
/* PyTorch's class name for what convert_sync_batchnorm makes; the same parameters and buffers */
static const ampc_module_vtable sync_batchnorm_vtable = {"SyncBatchNorm", batchnorm2d_forward, NULL};

int ampc_module_convert_sync_batchnorm(ampc_module *m) {
    if (!ampc_module_type(m)) return ampc__err(AMPC_ERR_INVALID, "ampc_module_convert_sync_batchnorm: no module (NULL or freed)");
    int n = 0;
    if (m->vt == &batchnorm2d_vtable) {
        m->vt = &sync_batchnorm_vtable;
        m->config.batchnorm2d.sync = true;
        n++;
    }
    for (int i = 0; i < m->children.n; i++) {
        int rc = ampc_module_convert_sync_batchnorm(m->children.items[i]);
        if (rc < 0) return rc;
        n += rc;
    }
    return n;
}

ampc_module *ampc_batchnorm2d_new(int64_t num_features) {
    if (num_features <= 0)
        return ampc__err_null(AMPC_ERR_INVALID, "BatchNorm2d(%lld): num_features must be positive", (long long)num_features);
    ampc_module *m = ampc__module_new(&batchnorm2d_vtable);
    if (!m) return NULL;
    m->config.batchnorm2d.num_features = num_features;
    m->config.batchnorm2d.momentum = 0.1;
    m->config.batchnorm2d.eps = 1e-5;
    const ampc_dtype dt = ampc__param_dtype();
    const int64_t c[1] = {num_features};
    ampc_scope_begin();
    int rc = ampc__module_add_param(m, "weight", param_full(dt, 1, c, 1.0));
    if (rc >= 0) rc = ampc__module_add_param(m, "bias", param_full(dt, 1, c, 0.0));
    if (rc >= 0) rc = ampc__module_add_buffer(m, "running_mean", param_full(dt, 1, c, 0.0));
    if (rc >= 0) rc = ampc__module_add_buffer(m, "running_var", param_full(dt, 1, c, 1.0));
    if (rc >= 0) rc = ampc__module_add_buffer(m, "num_batches_tracked", param_full(AMPC_I64, 0, NULL, 0.0));
    ampc_scope_end();
    if (rc < 0) {
        ampc_module_free(m);
        return NULL;
    }
    return m;
}

// ---------------------------------------------------------------------------------------------
// Pooling: impl holds the ampc_pool2d_options (MaxPool2d, AvgPool2d); AdaptiveAvgPool2d keeps
// its output size in config.

static ampc_tensor *maxpool2d_forward(ampc_module *m, ampc_tensor *x) { return ampc_max_pool2d(x, m->impl); }
static ampc_tensor *avgpool2d_forward(ampc_module *m, ampc_tensor *x) { return ampc_avg_pool2d(x, m->impl); }
static ampc_tensor *adaptive_avgpool2d_forward(ampc_module *m, ampc_tensor *x) {
    return ampc_adaptive_avg_pool2d(x, m->config.adaptive_avgpool2d.out_h, m->config.adaptive_avgpool2d.out_w);
}

static const ampc_module_vtable maxpool2d_vtable = {"MaxPool2d", maxpool2d_forward, impl_free};
static const ampc_module_vtable avgpool2d_vtable = {"AvgPool2d", avgpool2d_forward, impl_free};
static const ampc_module_vtable adaptive_avgpool2d_vtable = {"AdaptiveAvgPool2d", adaptive_avgpool2d_forward, NULL};

static ampc_module *pool_new(const ampc_module_vtable *vt, const ampc_pool2d_options *opts) {
    if (!opts) return ampc__err_null(AMPC_ERR_INVALID, "%s: options (kernel size) are required", vt->type);
    ampc_pool2d_options o = *opts;
    for (int d = 0; d < 2; d++) {
        if (o.stride[d] == 0) o.stride[d] = o.kernel[d];   /* PyTorch: stride defaults to kernel_size */
        if (o.kernel[d] <= 0 || o.stride[d] <= 0 || o.padding[d] < 0)
            return ampc__err_null(AMPC_ERR_INVALID, "%s: kernel (%d, %d) and stride (%d, %d) must be positive, padding (%d, %d) >= 0",
                                  vt->type, o.kernel[0], o.kernel[1], o.stride[0], o.stride[1], o.padding[0], o.padding[1]);
        if (2 * o.padding[d] > o.kernel[d])   /* PyTorch's rule: pad at most half the kernel */
            return ampc__err_null(AMPC_ERR_INVALID, "%s: pad should be at most half of effective kernel size, but got pad=%d and kernel_size=%d",
                                  vt->type, o.padding[d], o.kernel[d]);
    }
    ampc_module *m = ampc__module_new(vt);
    if (!m) return NULL;
    m->impl = impl_copy(&o, sizeof o);
    if (!m->impl) {
        ampc_module_free(m);
        return NULL;
    }
    return m;
}

ampc_module *ampc_maxpool2d_new(const ampc_pool2d_options *opts) { return pool_new(&maxpool2d_vtable, opts); }
ampc_module *ampc_avgpool2d_new(const ampc_pool2d_options *opts) { return pool_new(&avgpool2d_vtable, opts); }

ampc_module *ampc_adaptive_avgpool2d_new(int out_h, int out_w) {
    if (out_h <= 0 || out_w <= 0)
        return ampc__err_null(AMPC_ERR_INVALID, "AdaptiveAvgPool2d((%d, %d)): output size must be positive", out_h, out_w);
    ampc_module *m = ampc__module_new(&adaptive_avgpool2d_vtable);
    if (!m) return NULL;
    m->config.adaptive_avgpool2d.out_h = out_h;
    m->config.adaptive_avgpool2d.out_w = out_w;
    return m;
}

// ---------------------------------------------------------------------------------------------
// LayerNorm over the last config.layernorm.norm_ndim dims: weight (ones) and bias (zeros) of
// normalized_shape.

static ampc_tensor *layernorm_forward(ampc_module *m, ampc_tensor *x) {
    return ampc_layer_norm(x, m->config.layernorm.norm_ndim, ampc__module_param(m, "weight"), ampc__module_param(m, "bias"),
                           m->config.layernorm.eps);
}

static const ampc_module_vtable layernorm_vtable = {"LayerNorm", layernorm_forward, NULL};

ampc_module *ampc_layernorm_new(int norm_ndim, const int64_t *normalized_shape) {
    return ampc__layernorm_make(norm_ndim, normalized_shape, true);
}

ampc_module *ampc__layernorm_make(int norm_ndim, const int64_t *normalized_shape, bool bias) {
    if (norm_ndim <= 0 || norm_ndim > AMPC_MAX_DIMS || !normalized_shape)
        return ampc__err_null(AMPC_ERR_INVALID, "LayerNorm: normalized_shape of %d dims (1..%d allowed)", norm_ndim, AMPC_MAX_DIMS);
    for (int d = 0; d < norm_ndim; d++)
        if (normalized_shape[d] <= 0)
            return ampc__err_null(AMPC_ERR_INVALID, "LayerNorm: normalized_shape[%d] = %lld must be positive", d,
                                  (long long)normalized_shape[d]);
    ampc_module *m = ampc__module_new(&layernorm_vtable);
    if (!m) return NULL;
    m->config.layernorm.norm_ndim = norm_ndim;
    m->config.layernorm.eps = 1e-5;
    const ampc_dtype dt = ampc__param_dtype();
    ampc_scope_begin();
    int rc = ampc__module_add_param(m, "weight", param_full(dt, norm_ndim, normalized_shape, 1.0));
    if (rc >= 0 && bias) rc = ampc__module_add_param(m, "bias", param_full(dt, norm_ndim, normalized_shape, 0.0));
    ampc_scope_end();
    if (rc < 0) {
        ampc_module_free(m);
        return NULL;
    }
    return m;
}
