/*
 * models.c - the model zoo behind ampc_model_new: "mlp", "cnn" (PyTorch's examples/mnist Net)
 * and torchvision's ResNet-18/ResNet-50 (v1.5: the stride sits on the 3x3 conv of Bottleneck)
 * with torchvision's structure, initialisation and state_dict names, so a checkpoint's keys
 * line up with `torchvision.models.resnet18().state_dict()` one for one.
 *
 * Composite modules (Net, BasicBlock, Bottleneck, ResNet) find their children by name at each
 * forward, like PyTorch's attribute lookups, so ampc_module_replace(net, "fc", ...) or
 * replacing "layer1.0.relu" takes effect.
 *
 * relu(bn(x)) (the ResNet stem, and bn1/bn2 of the blocks) runs as one fused op,
 * ampc__batch_norm2d_relu, when the two children are still the library's BatchNorm2d and ReLU
 * (or SyncBatchNorm; checked at each forward by type name): the same bits as the two modules, without the ReLU's
 * own passes over the activation (forward and backward). Likewise the end of each block,
 * relu(bn(x) + identity), is ampc__batch_norm2d_add_relu: one op where the backend has the kernels
 * (CUDA), the three ops elsewhere.
 */
#include "nn/nn.h"
#include "ops/ops.h"

#include <math.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Helpers

/* Adds (name, child) pairs in order; stops at the first failure (remaining children freed). */
static int add_children(ampc_module *m, int n, const char *const *names, ampc_module **children) {
    int rc = AMPC_OK;
    for (int i = 0; i < n; i++) {
        if (rc < 0) ampc_module_free(children[i]);
        else rc = ampc__module_add_child(m, names[i], children[i]);   /* frees children[i] on failure */
    }
    return rc;
}

/* A composite module of vtable vt over its n children (a NULL child: all freed, its error kept). */
static ampc_module *assemble(const ampc_module_vtable *vt, int n, const char *const *names, ampc_module **c) {
    bool ok = true;
    for (int i = 0; i < n; i++) ok = ok && c[i];
    ampc_module *m = ok ? ampc__module_new(vt) : NULL;
    if (!m) {
        for (int i = 0; i < n; i++) ampc_module_free(c[i]);
        return NULL;
    }
    if (add_children(m, n, names, c) < 0) {
        ampc_module_free(m);
        return NULL;
    }
    return m;
}

bool ampc__fuse_bn_relu = true;

/* relu(bn(x)) through the children bn_name and "relu": BatchNorm2d's own forward with the ReLU
   fused when they are the standard BatchNorm2d and ReLU (by type name, at each forward); else
   (either replaced, or the switch off) the two modules' forwards. */
static ampc_tensor *bn_relu(ampc_module *m, const char *bn_name, ampc_tensor *x) {
    ampc_module *bn = ampc__module_get_child(m, bn_name), *relu = ampc__module_get_child(m, "relu");
    bool std_bn = bn && (!strcmp(bn->vt->type, "BatchNorm2d") || !strcmp(bn->vt->type, "SyncBatchNorm"));
    if (!x || !ampc__fuse_bn_relu || !std_bn || !relu || strcmp(relu->vt->type, "ReLU"))
        return ampc__child_forward(m, "relu", ampc__child_forward(m, bn_name, x));   /* the modules' own errors, too */
    return ampc__batchnorm2d_forward(bn, x, true);
}

/* relu(bn(x) + identity) through the children bn_name and "relu": one op (batch norm, the
   residual add and the ReLU in the same kernels where the backend has them) under the same
   conditions as bn_relu; else the modules' forwards and ampc_add. */
static ampc_tensor *bn_add_relu(ampc_module *m, const char *bn_name, ampc_tensor *x, ampc_tensor *identity) {
    ampc_module *bn = ampc__module_get_child(m, bn_name), *relu = ampc__module_get_child(m, "relu");
    bool std_bn = bn && (!strcmp(bn->vt->type, "BatchNorm2d") || !strcmp(bn->vt->type, "SyncBatchNorm"));
    if (!x || !ampc__fuse_bn_relu || !std_bn || !relu || strcmp(relu->vt->type, "ReLU"))
        return ampc__child_forward(m, "relu", ampc_add(ampc__child_forward(m, bn_name, x), identity));
    return ampc__batchnorm2d_forward_add_relu(bn, x, identity);
}

/* Identity: stands where the CIFAR adaptation removes ResNet's max pooling. */
static ampc_tensor *identity_forward(ampc_module *m, ampc_tensor *x) {
    (void)m;
    return x;
}
static const ampc_module_vtable identity_vtable = {"Identity", identity_forward, NULL};

// ---------------------------------------------------------------------------------------------
// "cnn": PyTorch's examples/mnist Net. Children in its __init__ order: conv1, conv2, dropout1,
// dropout2, fc1, fc2 (state_dict: conv1.*, conv2.*, fc1.*, fc2.*). Its forward ends with
// log_softmax; here the logits are returned, as the training program uses cross_entropy.

/* The model's input in its memory format (config.model: ampc_model_options.memory_format). */
static ampc_tensor *model_input(ampc_module *m, ampc_tensor *x) {
    bool cl = m->config.model.memory_format == AMPC_CHANNELS_LAST && x && x->ndim == 4;
    return cl ? ampc_to_memory_format(x, AMPC_CHANNELS_LAST) : x;
}

static ampc_tensor *net_forward(ampc_module *m, ampc_tensor *x) {
    ampc_tensor *h = ampc_relu(ampc__child_forward(m, "conv1", model_input(m, x)));
    h = ampc_relu(ampc__child_forward(m, "conv2", h));
    h = ampc_max_pool2d(h, &(ampc_pool2d_options){.kernel = {2, 2}});
    h = ampc__child_forward(m, "dropout1", h);
    h = ampc_flatten(h, 1, -1);
    h = ampc_relu(ampc__child_forward(m, "fc1", h));
    h = ampc__child_forward(m, "dropout2", h);
    return ampc__child_forward(m, "fc2", h);
}

static const ampc_module_vtable net_vtable = {"Net", net_forward, NULL};

static ampc_module *cnn_new(int64_t in_channels, int64_t num_classes) {
    static const char *const names[] = {"conv1", "conv2", "dropout1", "dropout2", "fc1", "fc2"};
    /* constructed in this order so the init draws come in PyTorch's order */
    ampc_module *c[6];
    c[0] = ampc_conv2d_new(in_channels, 32, 3, NULL, true);
    c[1] = ampc_conv2d_new(32, 64, 3, NULL, true);
    c[2] = ampc_dropout_new(0.25);
    c[3] = ampc_dropout_new(0.5);
    c[4] = ampc_linear_new(9216, 128, true);   /* 64 * 12 * 12 for 28x28 inputs */
    c[5] = ampc_linear_new(128, num_classes, true);
    return assemble(&net_vtable, 6, names, c);
}

// ---------------------------------------------------------------------------------------------
// "mlp": Flatten, Linear(in_channels*28*28, 128), ReLU, Linear(128, num_classes)

static ampc_module *mlp_new(int64_t in_channels, int64_t num_classes) {
    return ampc_sequential(4, ampc_flatten_new(), ampc_linear_new(in_channels * 28 * 28, 128, true), ampc_relu_new(),
                           ampc_linear_new(128, num_classes, true));
}

// ---------------------------------------------------------------------------------------------
// ResNet (torchvision.models.resnet)

/* torchvision's init for every Conv2d: kaiming_normal_(mode="fan_out", nonlinearity="relu"),
   std = gain / sqrt(fan_out) with gain sqrt(2) and fan_out = O * k * k. No bias. */
static ampc_module *resnet_conv(int64_t in, int64_t out, int k, int stride, int padding) {
    ampc_conv2d_options o = {.stride = {stride, stride}, .padding = {padding, padding}};
    return ampc__conv2d_make(in, out, k, &o, false, sqrt(2.0 / (double)(out * k * k)));
}

/* out = relu(bn2(conv2(relu(bn1(conv1(x))))) + identity), identity = downsample(x) if any */
static ampc_tensor *basic_block_forward(ampc_module *m, ampc_tensor *x) {
    ampc_tensor *h = bn_relu(m, "bn1", ampc__child_forward(m, "conv1", x));
    h = ampc__child_forward(m, "conv2", h);
    ampc_tensor *identity = ampc__module_get_child(m, "downsample") ? ampc__child_forward(m, "downsample", x) : x;
    return bn_add_relu(m, "bn2", h, identity);
}

/* 1x1 reduce, 3x3 (with the stride: v1.5), 1x1 expand by 4, then the residual add */
static ampc_tensor *bottleneck_forward(ampc_module *m, ampc_tensor *x) {
    ampc_tensor *h = bn_relu(m, "bn1", ampc__child_forward(m, "conv1", x));
    h = bn_relu(m, "bn2", ampc__child_forward(m, "conv2", h));
    h = ampc__child_forward(m, "conv3", h);
    ampc_tensor *identity = ampc__module_get_child(m, "downsample") ? ampc__child_forward(m, "downsample", x) : x;
    return bn_add_relu(m, "bn3", h, identity);
}

static const ampc_module_vtable basic_block_vtable = {"BasicBlock", basic_block_forward, NULL};
static const ampc_module_vtable bottleneck_vtable = {"Bottleneck", bottleneck_forward, NULL};

/* One block of a layer: children in torchvision's __init__ order (which is the state_dict's);
   downsample = Sequential(conv1x1 with the stride, BatchNorm) when the shape changes. */
static ampc_module *block_new(bool bottleneck, int64_t inplanes, int64_t planes, int stride) {
    const int64_t out = planes * (bottleneck ? 4 : 1);
    ampc_module *c[8];
    int n = 0;
    if (bottleneck) {
        c[n++] = resnet_conv(inplanes, planes, 1, 1, 0);
        c[n++] = ampc_batchnorm2d_new(planes);
        c[n++] = resnet_conv(planes, planes, 3, stride, 1);   /* v1.5: the stride is here */
        c[n++] = ampc_batchnorm2d_new(planes);
        c[n++] = resnet_conv(planes, out, 1, 1, 0);
        c[n++] = ampc_batchnorm2d_new(out);
        c[n++] = ampc_relu_new();
    } else {
        c[n++] = resnet_conv(inplanes, planes, 3, stride, 1);
        c[n++] = ampc_batchnorm2d_new(planes);
        c[n++] = ampc_relu_new();
        c[n++] = resnet_conv(planes, planes, 3, 1, 1);
        c[n++] = ampc_batchnorm2d_new(planes);
    }
    if (stride != 1 || inplanes != out)
        c[n++] = ampc_sequential(2, resnet_conv(inplanes, out, 1, stride, 0), ampc_batchnorm2d_new(out));
    static const char *const bottleneck_names[] = {"conv1", "bn1", "conv2", "bn2", "conv3", "bn3", "relu", "downsample"};
    static const char *const basic_names[] = {"conv1", "bn1", "relu", "conv2", "bn2", "downsample"};
    return bottleneck ? assemble(&bottleneck_vtable, n, bottleneck_names, c)
                      : assemble(&basic_block_vtable, n, basic_names, c);
}

/* torchvision's _make_layer: a Sequential of `blocks` blocks, the first with the stride (and
   the downsample); *inplanes advances to planes * expansion. */
static ampc_module *make_layer(bool bottleneck, int64_t *inplanes, int64_t planes, int blocks, int stride) {
    ampc_module *b[8] = {0};
    for (int i = 0; i < blocks; i++) {
        b[i] = block_new(bottleneck, *inplanes, planes, i == 0 ? stride : 1);
        *inplanes = planes * (bottleneck ? 4 : 1);
    }
    return ampc_sequential_from(blocks, b);   /* a NULL block: all freed, its error kept */
}

static ampc_tensor *resnet_forward(ampc_module *m, ampc_tensor *x) {
    ampc_tensor *h = bn_relu(m, "bn1", ampc__child_forward(m, "conv1", model_input(m, x)));
    h = ampc__child_forward(m, "maxpool", h);
    static const char *const layers[4] = {"layer1", "layer2", "layer3", "layer4"};
    for (int i = 0; i < 4; i++) h = ampc__child_forward(m, layers[i], h);
    h = ampc_flatten(ampc__child_forward(m, "avgpool", h), 1, -1);
    return ampc__child_forward(m, "fc", h);
}

static const ampc_module_vtable resnet_vtable = {"ResNet", resnet_forward, NULL};

static ampc_module *resnet_new(bool bottleneck, const int layers[4], int64_t in_channels, int64_t num_classes,
                               bool small_input) {
    static const char *const names[] = {"conv1", "bn1", "relu", "maxpool", "layer1", "layer2",
                                        "layer3", "layer4", "avgpool", "fc"};
    ampc_module *c[10];
    int64_t inplanes = 64;
    /* the CIFAR adaptation keeps the names: a 3x3 stride-1 conv1 and an Identity maxpool */
    c[0] = small_input ? resnet_conv(in_channels, 64, 3, 1, 1) : resnet_conv(in_channels, 64, 7, 2, 3);
    c[1] = ampc_batchnorm2d_new(64);
    c[2] = ampc_relu_new();
    c[3] = small_input ? ampc__module_new(&identity_vtable)
                       : ampc_maxpool2d_new(&(ampc_pool2d_options){.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}});
    c[4] = make_layer(bottleneck, &inplanes, 64, layers[0], 1);
    c[5] = make_layer(bottleneck, &inplanes, 128, layers[1], 2);
    c[6] = make_layer(bottleneck, &inplanes, 256, layers[2], 2);
    c[7] = make_layer(bottleneck, &inplanes, 512, layers[3], 2);
    c[8] = ampc_adaptive_avgpool2d_new(1, 1);
    c[9] = ampc_linear_new(512 * (bottleneck ? 4 : 1), num_classes, true);   /* default Linear init */
    return assemble(&resnet_vtable, 10, names, c);
}

// ---------------------------------------------------------------------------------------------
// The zoo

ampc_module *ampc_model_new(const char *name, const ampc_model_options *opts) {
    ampc_model_options o = opts ? *opts : (ampc_model_options){0};
    if (!name) return ampc__err_null(AMPC_ERR_INVALID, "ampc_model_new: name is NULL");
    bool resnet = !strcmp(name, "resnet18") || !strcmp(name, "resnet50");
    if (!strcmp(name, "gpt")) {
        ampc_gpt_config c = o.gpt;   /* GPT-2 124M where zero */
        if (!c.vocab_size) c.vocab_size = 50257;
        if (!c.block_size) c.block_size = 1024;
        if (!c.n_layer) c.n_layer = 12;
        if (!c.n_head) c.n_head = 12;
        if (!c.n_embd) c.n_embd = 768;
        return ampc__gpt_new(&c);
    }
    if (!resnet && strcmp(name, "mlp") && strcmp(name, "cnn"))
        return ampc__err_null(AMPC_ERR_INVALID, "unknown model '%s' (known: mlp, cnn, resnet18, resnet50, gpt)", name);
    if (o.num_classes < 0 || o.in_channels < 0)
        return ampc__err_null(AMPC_ERR_INVALID, "%s: num_classes %lld and in_channels %lld must be positive", name,
                              (long long)o.num_classes, (long long)o.in_channels);
    if (!o.num_classes) o.num_classes = resnet ? 1000 : 10;
    if (!o.in_channels) o.in_channels = resnet ? 3 : 1;
    if (o.memory_format != AMPC_CONTIGUOUS_FORMAT && o.memory_format != AMPC_CHANNELS_LAST)
        return ampc__err_null(AMPC_ERR_INVALID, "%s: unknown memory format %d", name, (int)o.memory_format);
    if (!strcmp(name, "mlp")) return mlp_new(o.in_channels, o.num_classes);   /* no 4-D activations */
    static const int r18[4] = {2, 2, 2, 2}, r50[4] = {3, 4, 6, 3};
    bool bottleneck = !strcmp(name, "resnet50");
    ampc_module *m = !strcmp(name, "cnn") ? cnn_new(o.in_channels, o.num_classes)
                                          : resnet_new(bottleneck, bottleneck ? r50 : r18, o.in_channels, o.num_classes, o.small_input);
    if (m) m->config.model.memory_format = o.memory_format;
    return m;
}
