/*
 * test_models.c - the convolutional layers and the model zoo: state_dict keys, dtypes and
 * shapes line by line against torchvision/PyTorch (tests/fixtures/torchvision_state_dicts.txt,
 * written by make_torchvision_keys.py), parameter counts, initialisation, memory kinds,
 * find/replace/freeze, BatchNorm's running statistics in train and eval mode, each model's
 * forward bit-identical to the architecture written out here with the ops (from torchvision's
 * and PyTorch's code), forward+backward of ResNets in fp32 and under autocast (finite losses,
 * finite fp32 gradients on every trainable parameter), and a frozen-backbone fine-tuning step.
 *
 * Under AddressSanitizer the ResNet-50 forward/backward is skipped (slow); set
 * AMPC_TEST_RESNET50=1 to run it anyway.
 */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "nn/nn.h"

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#else
#define UNDER_ASAN 0
#endif

// ---------------------------------------------------------------------------------------------
// Helpers

static const char *torch_dtype(ampc_dtype dt) {
    switch (dt) {
    case AMPC_F32: return "float32";
    case AMPC_I64: return "int64";
    case AMPC_F64: return "float64";
    default: return "?";
    }
}

/* "key dtype [d0, d1]" as the fixture writes it. */
static void entry_line(char *buf, size_t n, const char *name, const ampc_tensor *t) {
    int k = snprintf(buf, n, "%s %s [", name, torch_dtype(ampc_tensor_dtype(t)));
    for (int d = 0; d < ampc_tensor_ndim(t); d++)
        k += snprintf(buf + k, n - (size_t)k, "%s%lld", d ? ", " : "", (long long)ampc_tensor_dim(t, d));
    snprintf(buf + k, n - (size_t)k, "]");
}

/* State_dict entry by full name (fails the test if absent). */
static ampc_tensor *sd(ampc_module *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static ampc_tensor *sd(ampc_module *m, const char *fmt, ...) {
    char name[128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    ampc_tensor **t;
    const char **names;
    int n = ampc_module_state_dict(m, &t, &names);
    for (int i = 0; i < n; i++)
        if (!strcmp(names[i], name)) return t[i];
    fail_msg("no state_dict entry %s", name);
    return NULL;
}

static void assert_shape(const ampc_tensor *t, int ndim, const int64_t *shape) {
    assert_non_null(t);
    assert_int_equal(ampc_tensor_ndim(t), ndim);
    for (int d = 0; d < ndim; d++) assert_int_equal(ampc_tensor_dim(t, d), shape[d]);
}

static bool all_finite(const ampc_tensor *t) {
    double *v = tu_values(t);
    bool ok = true;
    for (int64_t i = 0; i < ampc_tensor_numel(t) && ok; i++) ok = isfinite(v[i]);
    free(v);
    return ok;
}

static bool bits_equal(const ampc_tensor *a, const ampc_tensor *b) {
    return ampc_tensor_dtype(a) == ampc_tensor_dtype(b) && ampc_tensor_numel(a) == ampc_tensor_numel(b) &&
           !memcmp(ampc_tensor_cdata(a), ampc_tensor_cdata(b), (size_t)ampc_tensor_numel(a) * ampc_dtype_size(ampc_tensor_dtype(a)));
}

/* Malloc'd copy of a tensor's bytes. */
static void *snapshot(const ampc_tensor *t) {
    size_t n = (size_t)ampc_tensor_numel(t) * ampc_dtype_size(ampc_tensor_dtype(t));
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    memcpy(p, ampc_tensor_cdata(t), n);
    return p;
}

static bool same_as_snapshot(const ampc_tensor *t, const void *snap) {
    return !memcmp(ampc_tensor_cdata(t), snap, (size_t)ampc_tensor_numel(t) * ampc_dtype_size(ampc_tensor_dtype(t)));
}

/* The big models are shared by the tests (their construction draws millions of normals):
   created on first use, freed by the test that changes them or at the group's teardown. */
static ampc_module *g_r18;    /* resnet18, 1000 classes */
static ampc_module *g_r18s;   /* resnet18, CIFAR stem, 10 classes */
static ampc_module *g_r50;    /* resnet50, 1000 classes */

static ampc_module *shared(ampc_module **slot, const char *name, const ampc_model_options *o) {
    if (!*slot) *slot = ampc_model_new(name, o);
    ASSERT_NOT_NULL_MSG(*slot);
    return *slot;
}
static ampc_module *r18(void) { return shared(&g_r18, "resnet18", NULL); }
static ampc_module *r18s(void) { return shared(&g_r18s, "resnet18", &(ampc_model_options){.num_classes = 10, .small_input = true}); }
static ampc_module *r50(void) { return shared(&g_r50, "resnet50", NULL); }

static void free_shared(ampc_module **slot) {
    ampc_module_free(*slot);
    *slot = NULL;
}

static int group_teardown(void **state) {
    free_shared(&g_r18);
    free_shared(&g_r18s);
    free_shared(&g_r50);
    return tu_group_teardown(state);
}

/* Bytes of m's state_dict in the allocator's size classes. */
static size_t state_bytes(ampc_module *m) {
    ampc_tensor **t;
    int n = ampc_module_state_dict(m, &t, NULL);
    size_t bytes = 0;
    for (int i = 0; i < n; i++)
        bytes += ampc__mem_block_size((size_t)ampc_tensor_numel(t[i]) * ampc_dtype_size(ampc_tensor_dtype(t[i])));
    return bytes;
}

static const char *fixture_path(void) {
    static char path[1024];
    const char *dir = getenv("AMPC_FIXTURE_DIR");
    if (dir) {
        snprintf(path, sizeof path, "%s/torchvision_state_dicts.txt", dir);
    } else {   /* next to this source file (CMake compiles it by absolute path) */
        snprintf(path, sizeof path, "%s", __FILE__);
        char *slash = strrchr(path, '/');
        size_t at = slash ? (size_t)(slash - path + 1) : 0;
        snprintf(path + at, sizeof path - at, "fixtures/torchvision_state_dicts.txt");
    }
    return path;
}

// ---------------------------------------------------------------------------------------------
// State dicts against torchvision

/* Compares m's state_dict with the fixture's section for `model`, line by line, and the
   parameter count; returns the count. */
static int64_t check_against_fixture(ampc_module *m, const char *model) {
    FILE *f = fopen(fixture_path(), "r");
    if (!f) fail_msg("cannot open %s (regenerate with tests/fixtures/make_torchvision_keys.py)", fixture_path());
    char line[512], want[512], header[128];
    snprintf(header, sizeof header, "model %s", model);
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        found = !strcmp(line, header);
    }
    if (!found) fail_msg("%s: no section '%s'", fixture_path(), header);
    ampc_tensor **t;
    const char **names;
    int n = ampc_module_state_dict(m, &t, &names);
    assert_true(n > 0);
    for (int i = 0; i < n; i++) {
        if (!fgets(line, sizeof line, f)) fail_msg("%s: fixture ends before entry %d (%s)", model, i, names[i]);
        line[strcspn(line, "\n")] = 0;
        entry_line(want, sizeof want, names[i], t[i]);
        if (strcmp(line, want)) fail_msg("%s entry %d: ampc '%s', torchvision '%s'", model, i, want, line);
    }
    long long count = -1;
    if (!fgets(line, sizeof line, f) || sscanf(line, "parameters %lld", &count) != 1)
        fail_msg("%s: ampc has %d entries, torchvision more (next: %s)", model, n, line);
    fclose(f);
    assert_int_equal(ampc_module_num_parameters(m, false), count);
    assert_int_equal(ampc_module_num_parameters(m, true), count);
    /* ampc_module_parameters lists the state_dict's parameters, in the same order */
    ampc_tensor **p;
    const char **pn;
    int np = ampc_module_parameters(m, &p, &pn);
    int j = 0;
    for (int i = 0; i < n; i++)
        if (j < np && t[i] == p[j]) {
            assert_string_equal(names[i], pn[j]);
            j++;
        }
    assert_int_equal(j, np);
    return count;
}

static void test_state_dicts_match_torchvision(void **state) {
    (void)state;
    /* the counts torchvision publishes, independently of the fixture */
    ampc_module *m = ampc_model_new("cnn", NULL);
    ASSERT_NOT_NULL_MSG(m);
    assert_int_equal(check_against_fixture(m, "cnn"), 1199882);
    ampc_module_free(m);
    assert_int_equal(check_against_fixture(r18(), "resnet18"), 11689512);
    assert_int_equal(check_against_fixture(r50(), "resnet50"), 25557032);
    /* the parameters are fp32 leaves requiring grad; the buffers are not parameters */
    m = r18();
    assert_string_equal(ampc_module_type(m), "ResNet");
    assert_string_equal(ampc_module_type(ampc_module_find(m, "layer1")), "Sequential");
    assert_string_equal(ampc_module_type(ampc_module_find(m, "layer1.0")), "BasicBlock");
    assert_string_equal(ampc_module_type(ampc_module_find(m, "layer2.0.downsample.1")), "BatchNorm2d");
    assert_string_equal(ampc_module_type(ampc_module_find(m, "maxpool")), "MaxPool2d");
    assert_string_equal(ampc_module_type(ampc_module_find(m, "avgpool")), "AdaptiveAvgPool2d");
    assert_null(ampc__module_get_child(ampc_module_find(m, "layer1.0"), "downsample"));
    ampc_tensor **p;
    int n = ampc_module_parameters(m, &p, NULL);
    for (int i = 0; i < n; i++)
        assert_true(ampc_tensor_dtype(p[i]) == AMPC_F32 && ampc_tensor_requires_grad(p[i]) && ampc_tensor_is_leaf(p[i]));
    assert_false(ampc_tensor_requires_grad(sd(m, "bn1.running_mean")));
    assert_string_equal(ampc_module_type(ampc_module_find(r50(), "layer3.5")), "Bottleneck");
    assert_non_null(ampc__module_get_child(ampc_module_find(r50(), "layer1.0"), "downsample"));   /* 64 -> 256 */
    assert_null(ampc_module_find(r50(), "layer3.6"));
}

/* num_classes, in_channels and small_input change only the layers they should. */
static void test_model_options(void **state) {
    (void)state;
    /* the CIFAR stem: conv1 3x3 stride 1 padding 1 without bias, the max pooling an Identity;
       10 classes (ResNet-50 goes through the same code for num_classes; not built a second
       time here because its construction draws 23.5M normals) */
    ampc_module *m = r18s();
    assert_shape(sd(m, "conv1.weight"), 4, (int64_t[]){64, 3, 3, 3});
    assert_string_equal(ampc_module_type(ampc_module_find(m, "maxpool")), "Identity");
    assert_shape(sd(m, "fc.weight"), 2, (int64_t[]){10, 512});
    assert_shape(sd(m, "fc.bias"), 1, (int64_t[]){10});
    assert_int_equal(ampc_module_num_parameters(m, true), 11689512 - 990 * 513 - 64 * 3 * (49 - 9));
    m = ampc_model_new("cnn", &(ampc_model_options){.num_classes = 7, .in_channels = 3});
    ASSERT_NOT_NULL_MSG(m);
    assert_shape(sd(m, "conv1.weight"), 4, (int64_t[]){32, 3, 3, 3});
    assert_shape(sd(m, "fc2.weight"), 2, (int64_t[]){7, 128});
    assert_string_equal(ampc_module_type(m), "Net");
    ampc_module_free(m);
    /* mlp: Flatten, Linear(C*28*28, 128), ReLU, Linear(128, classes) */
    m = ampc_model_new("mlp", NULL);
    ASSERT_NOT_NULL_MSG(m);
    const char **names;
    ampc_tensor **t;
    assert_int_equal(ampc_module_state_dict(m, &t, &names), 4);
    assert_string_equal(names[0], "1.weight");
    assert_shape(t[0], 2, (int64_t[]){128, 784});
    assert_string_equal(names[3], "3.bias");
    assert_shape(t[3], 1, (int64_t[]){10});
    ampc_module_free(m);
    /* errors */
    ampc_clear_error();
    assert_null(ampc_model_new("vgg16", NULL));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    assert_non_null(strstr(ampc_last_error(), "vgg16"));
    assert_null(ampc_model_new(NULL, NULL));
    assert_null(ampc_model_new("cnn", &(ampc_model_options){.num_classes = -3}));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
}

/* PyTorch's defaults: Conv2d U(+-1/sqrt(fan_in)) weight and bias; torchvision's ResNet convs
   N(0, 2/fan_out); BatchNorm weight 1, bias 0, running_mean 0, running_var 1, counter 0. */
static void test_init(void **state) {
    (void)state;
    ampc_module *m = r18();   /* untouched so far: no forward has run */
    /* kaiming_normal_(fan_out, relu): std sqrt(2 / (O k k)); the sample std of n draws is within
       6 standard errors std*sqrt(1/(2n)) of it, the mean within 6 std/sqrt(n) of 0 */
    static const struct { const char *name; double fan_out; } convs[] = {
        {"conv1.weight", 64 * 49}, {"layer1.0.conv1.weight", 64 * 9}, {"layer4.1.conv2.weight", 512 * 9},
        {"layer3.0.downsample.0.weight", 256}};
    for (size_t c = 0; c < sizeof convs / sizeof convs[0]; c++) {
        ampc_tensor *w = sd(m, "%s", convs[c].name);
        double *v = tu_values(w);
        double n = (double)ampc_tensor_numel(w), s = 0, s2 = 0;
        for (int64_t i = 0; i < ampc_tensor_numel(w); i++) {
            s += v[i];
            s2 += v[i] * v[i];
        }
        free(v);
        double std = sqrt(2.0 / convs[c].fan_out), mean = s / n, sample = sqrt(s2 / n - mean * mean);
        if (fabs(mean) > 6 * std / sqrt(n) || fabs(sample - std) > 6 * std / sqrt(2 * n))
            fail_msg("%s: mean %g, std %g, expected N(0, %g^2) over %g draws", convs[c].name, mean, sample, std, n);
    }
    static const char *const bn[] = {"bn1", "layer1.0.bn2", "layer2.0.downsample.1", "layer4.1.bn1"};
    for (size_t b = 0; b < 4; b++) {
        static const struct { const char *suffix; double value; } want[] = {
            {"weight", 1}, {"bias", 0}, {"running_mean", 0}, {"running_var", 1}};
        for (int k = 0; k < 4; k++) {
            double *v = tu_values(sd(m, "%s.%s", bn[b], want[k].suffix));
            for (int64_t i = 0; i < ampc_tensor_dim(sd(m, "%s.%s", bn[b], want[k].suffix), 0); i++)
                assert_true(v[i] == want[k].value);
            free(v);
        }
        ampc_tensor *nbt = sd(m, "%s.num_batches_tracked", bn[b]);
        assert_int_equal(ampc_tensor_dtype(nbt), AMPC_I64);
        assert_int_equal(ampc_tensor_ndim(nbt), 0);
        assert_int_equal(*(const int64_t *)ampc_tensor_cdata(nbt), 0);
    }
    /* fc keeps Linear's default U(+-1/sqrt(512)) */
    double *v = tu_values(sd(m, "fc.weight"));
    float bound = (float)(1 / sqrt(512.0));
    for (int64_t i = 0; i < 1000 * 512; i++) assert_true(fabs(v[i]) <= bound);
    free(v);

    /* Conv2d default: fan_in = C/groups * k * k = 4 * 9 here; same seed, same draws */
    const ampc_conv2d_options o = {.groups = 2};
    ampc_manual_seed(3);
    ampc_module *a = ampc_conv2d_new(8, 6, 3, &o, true);
    ampc_manual_seed(3);
    ampc_module *b = ampc_conv2d_new(8, 6, 3, &o, true);
    ASSERT_NOT_NULL_MSG(a && b);
    assert_string_equal(ampc_module_type(a), "Conv2d");
    assert_shape(sd(a, "weight"), 4, (int64_t[]){6, 4, 3, 3});
    assert_shape(sd(a, "bias"), 1, (int64_t[]){6});
    assert_true(bits_equal(sd(a, "weight"), sd(b, "weight")) && bits_equal(sd(a, "bias"), sd(b, "bias")));
    float cb = (float)(1 / sqrt(36.0));
    double lo = 1, hi = -1;
    for (int k = 0; k < 2; k++) {
        ampc_tensor *t = sd(a, k ? "bias" : "weight");
        v = tu_values(t);
        for (int64_t i = 0; i < ampc_tensor_numel(t); i++) {
            assert_true(fabs(v[i]) <= cb);
            lo = fmin(lo, v[i]);
            hi = fmax(hi, v[i]);
        }
        free(v);
    }
    /* 222 uniform draws: none in the outer 15% of one side has probability 0.85^222 */
    assert_true(hi > 0.85 * cb && lo < -0.85 * cb);
    ampc_module_free(a);
    ampc_module_free(b);
    /* no bias */
    a = ampc_conv2d_new(3, 4, 1, NULL, false);
    ASSERT_NOT_NULL_MSG(a);
    ampc_tensor **t;
    assert_int_equal(ampc_module_state_dict(a, &t, NULL), 1);
    ampc_module_free(a);
}

/* Parameters and buffers are AMPC_MEM_PARAMETERS memory, out of every scope, freed with the
   model; on the REF device they are f64 (the counter stays int64). */
static void test_memory_and_devices(void **state) {
    (void)state;
    free_shared(&g_r18s);   /* built here, so the counts see its construction */
    ampc_memory_stats_t s0 = ampc_memory_stats();
    ampc_module *m = r18s();
    ampc_memory_stats_t s1 = ampc_memory_stats();
    assert_int_equal(s1.current[AMPC_MEM_PARAMETERS] - s0.current[AMPC_MEM_PARAMETERS], state_bytes(m));
    assert_int_equal(s1.current[AMPC_MEM_ACTIVATIONS], s0.current[AMPC_MEM_ACTIVATIONS]);
    ampc_scope_begin();
    ampc_scope_end();
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_PARAMETERS], s1.current[AMPC_MEM_PARAMETERS]);
    /* (test_resnet18_step checks that freeing it gives the bytes back) */
    ampc_tensor **t;

    ampc_set_default_device(AMPC_DEVICE_REF);
    ampc_module *bn = ampc_batchnorm2d_new(5);
    ampc_module *ln = ampc_layernorm_new(2, (int64_t[]){3, 4});
    ampc_set_default_device(AMPC_DEVICE_CPU);
    ASSERT_NOT_NULL_MSG(bn && ln);
    const char **names;
    assert_int_equal(ampc_module_state_dict(bn, &t, &names), 5);
    static const char *const want[] = {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"};
    for (int i = 0; i < 5; i++) {
        assert_string_equal(names[i], want[i]);
        assert_int_equal(ampc_tensor_device(t[i]), AMPC_DEVICE_REF);
        assert_int_equal(ampc_tensor_dtype(t[i]), i == 4 ? AMPC_I64 : AMPC_F64);
    }
    assert_int_equal(ampc_module_parameters(bn, NULL, NULL), 2);
    assert_int_equal(ampc_module_state_dict(ln, &t, &names), 2);
    assert_string_equal(ampc_module_type(ln), "LayerNorm");
    assert_shape(t[0], 2, (int64_t[]){3, 4});
    assert_int_equal(ampc_tensor_dtype(t[1]), AMPC_F64);
    ampc_module_free(bn);
    ampc_module_free(ln);
    /* Embedding: one parameter "weight" (V, D) from N(0, 1); its forward picks rows of it */
    ampc_module *emb = ampc_embedding_new(1000, 8);
    ASSERT_NOT_NULL_MSG(emb);
    assert_string_equal(ampc_module_type(emb), "Embedding");
    assert_int_equal(ampc_module_state_dict(emb, &t, &names), 1);
    assert_string_equal(names[0], "weight");
    assert_shape(t[0], 2, (int64_t[]){1000, 8});
    double *w = tu_values(t[0]), m1 = 0, m2 = 0;
    for (int i = 0; i < 8000; i++) m1 += w[i], m2 += w[i] * w[i];
    m1 /= 8000, m2 = m2 / 8000 - m1 * m1;
    assert_true(fabs(m1) < 0.05 && fabs(m2 - 1) < 0.1);   /* 8000 draws: 4.5 and 6.3 standard errors */
    ampc_scope_begin();
    ampc_tensor *ix = ampc_tensor_from_i64(2, (int64_t[]){1, 2}, (const int64_t[]){999, 3});
    ampc_tensor *y = ampc_module_forward(emb, ix);
    ASSERT_NOT_NULL_MSG(y);
    assert_shape(y, 3, (int64_t[]){1, 2, 8});
    double *yv = tu_values(y);
    for (int c = 0; c < 8; c++) assert_true(yv[c] == w[999 * 8 + c] && yv[8 + c] == w[3 * 8 + c]);
    free(w), free(yv);
    ampc_scope_end();
    ampc_module_free(emb);
    assert_null(ampc_embedding_new(0, 4));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    ampc_clear_error();
}

/* Constructor argument checks name the layer and the problem. */
static void test_layer_errors(void **state) {
    (void)state;
    ampc_clear_error();
    assert_null(ampc_conv2d_new(6, 4, 3, &(ampc_conv2d_options){.groups = 4}, true));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    assert_non_null(strstr(ampc_last_error(), "groups"));
    assert_null(ampc_conv2d_new(0, 4, 3, NULL, true));
    assert_null(ampc_conv2d_new(3, 4, 0, NULL, true));
    assert_null(ampc_conv2d_new(3, 4, 3, &(ampc_conv2d_options){.padding = {-1, 0}}, true));
    assert_null(ampc_batchnorm2d_new(0));
    assert_non_null(strstr(ampc_last_error(), "BatchNorm2d"));
    assert_null(ampc_maxpool2d_new(NULL));
    assert_null(ampc_avgpool2d_new(&(ampc_pool2d_options){.kernel = {0, 2}}));
    assert_null(ampc_maxpool2d_new(&(ampc_pool2d_options){.kernel = {3, 3}, .padding = {2, 2}}));
    assert_non_null(strstr(ampc_last_error(), "half"));
    assert_null(ampc_adaptive_avgpool2d_new(0, 1));
    assert_null(ampc_layernorm_new(0, NULL));
    assert_null(ampc_layernorm_new(1, (int64_t[]){0}));
    ampc_module *p = ampc_maxpool2d_new(&(ampc_pool2d_options){.kernel = {2, 2}});
    ampc_module *q = ampc_avgpool2d_new(&(ampc_pool2d_options){.kernel = {2, 2}});
    ampc_module *r = ampc_adaptive_avgpool2d_new(1, 1);
    ASSERT_NOT_NULL_MSG(p && q && r);
    assert_string_equal(ampc_module_type(p), "MaxPool2d");
    assert_string_equal(ampc_module_type(q), "AvgPool2d");
    assert_string_equal(ampc_module_type(r), "AdaptiveAvgPool2d");
    assert_int_equal(ampc_module_parameters(p, NULL, NULL), 0);
    ampc_module_free(p);
    ampc_module_free(q);
    ampc_module_free(r);
}

// ---------------------------------------------------------------------------------------------
// find / replace / freeze

static void test_find_replace(void **state) {
    (void)state;
    ampc_module *m = r18();   /* changed here, freed at the end */
    ampc_module *c = ampc_module_find(m, "layer4.1.conv2");
    ASSERT_NOT_NULL_MSG(c);
    assert_string_equal(ampc_module_type(c), "Conv2d");
    assert_ptr_equal(sd(c, "weight"), sd(m, "layer4.1.conv2.weight"));
    assert_ptr_equal(ampc_module_find(m, ""), m);   /* get_submodule("") */
    static const char *const bad[] = {"layer9", "layer4.2", "layer4.1.conv9", "fc.", ".fc", "layer4..1", "fc.weight"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ampc_clear_error();
        if (ampc_module_find(m, bad[i])) fail_msg("found '%s'", bad[i]);
        assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
        if (!strstr(ampc_last_error(), bad[i])) fail_msg("message for '%s': %s", bad[i], ampc_last_error());
    }
    assert_null(ampc_module_find(NULL, "fc"));
    assert_null(ampc_module_find(m, NULL));

    /* replace the head: the old one is freed, the name and the order stay */
    size_t mem0 = ampc_memory_stats().current[AMPC_MEM_PARAMETERS];
    const char **names;
    ampc_tensor **t;
    int n = ampc_module_state_dict(m, &t, &names);
    int np = ampc_module_parameters(m, NULL, NULL);
    ASSERT_OK(ampc_module_replace(m, "fc", ampc_linear_new(512, 10, true)));
    size_t freed = ampc__mem_block_size(1000 * 512 * 4) + ampc__mem_block_size(1000 * 4);
    size_t added = ampc__mem_block_size(10 * 512 * 4) + ampc__mem_block_size(10 * 4);
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_PARAMETERS], mem0 - freed + added);
    const char **names2;
    assert_int_equal(ampc_module_state_dict(m, &t, &names2), n);   /* the flat lists were rebuilt */
    assert_string_equal(names2[n - 2], "fc.weight");
    assert_shape(t[n - 2], 2, (int64_t[]){10, 512});
    assert_int_equal(ampc_module_parameters(m, NULL, NULL), np);
    assert_string_equal(ampc_module_type(ampc_module_child(m, 9)), "Linear");
    /* a nested replacement, and the parents' lists are invalidated all the way up */
    ASSERT_OK(ampc_module_replace(m, "layer1.0.relu", ampc_gelu_new()));
    assert_string_equal(ampc_module_type(ampc_module_find(m, "layer1.0.relu")), "GELU");
    ASSERT_OK(ampc_module_replace(m, "layer2.0.downsample.0", ampc_conv2d_new(64, 128, 1, NULL, true)));
    ampc_module_state_dict(m, &t, &names2);
    assert_string_equal(names2[0], "conv1.weight");
    sd(m, "layer2.0.downsample.0.bias");   /* the new conv's bias is listed */

    /* errors: the replacement is freed (it was given), except when it belongs to a tree */
    mem0 = ampc_memory_stats().current[AMPC_MEM_PARAMETERS];
    static const char *const badr[] = {"fc2", "layer9.0", "layer1.0.conv9", "", "fc."};
    for (size_t i = 0; i < sizeof badr / sizeof badr[0]; i++) {
        ampc_clear_error();
        int rc = ampc_module_replace(m, badr[i], ampc_linear_new(512, 10, true));
        assert_true(rc < 0);
        assert_int_equal(rc, ampc_last_status());
        if (*badr[i] && !strstr(ampc_last_error(), badr[i])) fail_msg("message for '%s': %s", badr[i], ampc_last_error());
        assert_int_equal(ampc_memory_stats().current[AMPC_MEM_PARAMETERS], mem0);
    }
    ampc_clear_error();
    assert_true(ampc_module_replace(m, "fc", ampc_linear_new(-1, 10, true)) < 0);   /* constructor's error kept */
    assert_non_null(strstr(ampc_last_error(), "Linear"));
    assert_int_equal(ampc_module_replace(m, "fc", ampc_module_find(m, "layer1")), AMPC_ERR_STATE);   /* has a parent */
    assert_int_equal(ampc_module_replace(m, "layer1.0", m), AMPC_ERR_STATE);                          /* a cycle */
    assert_string_equal(ampc_module_type(ampc_module_find(m, "layer1.0")), "BasicBlock");
    assert_true(ampc_module_replace(NULL, "fc", ampc_relu_new()) < 0);
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_PARAMETERS], mem0);

    /* freezing a child, then the model */
    const int64_t total = ampc_module_num_parameters(m, false);
    ampc_module_requires_grad(ampc_module_find(m, "layer4"), false);
    assert_int_equal(ampc_module_num_parameters(m, true), total - ampc_module_num_parameters(ampc_module_find(m, "layer4"), false));
    assert_false(ampc_tensor_requires_grad(sd(m, "layer4.0.bn1.weight")));
    ampc_module_requires_grad(m, false);
    assert_int_equal(ampc_module_num_parameters(m, true), 0);
    free_shared(&g_r18);
}

// ---------------------------------------------------------------------------------------------
// Forward: the model against the architecture written out with ops (bit-identical)

static ampc_tensor *ref_conv(ampc_module *m, const char *name, ampc_tensor *x, int stride, int pad, bool bias) {
    ampc_conv2d_options o = {.stride = {stride, stride}, .padding = {pad, pad}};
    return ampc_conv2d(x, sd(m, "%s.weight", name), bias ? sd(m, "%s.bias", name) : NULL, &o);
}

/* BatchNorm with the model's parameters; in training mode the running statistics are not
   passed (the model's own forward updates them; the output does not depend on them). */
static ampc_tensor *ref_bn(ampc_module *m, const char *name, ampc_tensor *x, bool training) {
    return ampc_batch_norm2d(x, sd(m, "%s.weight", name), sd(m, "%s.bias", name),
                             training ? NULL : sd(m, "%s.running_mean", name),
                             training ? NULL : sd(m, "%s.running_var", name), training, 0.1, 1e-5);
}

/* torchvision's BasicBlock.forward / Bottleneck.forward */
static ampc_tensor *ref_block(ampc_module *m, bool bottleneck, int layer, int b, ampc_tensor *x, int stride, bool tr) {
    char p[64], q[80];
    snprintf(p, sizeof p, "layer%d.%d", layer, b);
#define NAME(s) (snprintf(q, sizeof q, "%s.%s", p, s), q)
    ampc_tensor *h;
    if (bottleneck) {
        h = ampc_relu(ref_bn(m, NAME("bn1"), ref_conv(m, NAME("conv1"), x, 1, 0, false), tr));
        h = ampc_relu(ref_bn(m, NAME("bn2"), ref_conv(m, NAME("conv2"), h, stride, 1, false), tr));
        h = ref_bn(m, NAME("bn3"), ref_conv(m, NAME("conv3"), h, 1, 0, false), tr);
    } else {
        h = ampc_relu(ref_bn(m, NAME("bn1"), ref_conv(m, NAME("conv1"), x, stride, 1, false), tr));
        h = ref_bn(m, NAME("bn2"), ref_conv(m, NAME("conv2"), h, 1, 1, false), tr);
    }
    bool ds = b == 0 && (layer > 1 || bottleneck);   /* stride 2, or 64 -> 256 channels */
    ampc_tensor *id = ds ? ref_bn(m, NAME("downsample.1"), ref_conv(m, NAME("downsample.0"), x, stride, 0, false), tr) : x;
#undef NAME
    return ampc_relu(ampc_add(h, id));
}

/* torchvision's ResNet._forward_impl (with the CIFAR stem when small) */
static ampc_tensor *ref_resnet(ampc_module *m, bool bottleneck, bool small, ampc_tensor *x, bool tr) {
    static const int blocks[2][4] = {{2, 2, 2, 2}, {3, 4, 6, 3}};   /* resnet18, resnet50 */
    ampc_tensor *h = ampc_relu(ref_bn(m, "bn1", ref_conv(m, "conv1", x, small ? 1 : 2, small ? 1 : 3, false), tr));
    if (!small) h = ampc_max_pool2d(h, &(ampc_pool2d_options){.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}});
    for (int l = 1; l <= 4; l++)
        for (int b = 0; b < blocks[bottleneck][l - 1]; b++)
            h = ref_block(m, bottleneck, l, b, h, b == 0 && l > 1 ? 2 : 1, tr);
    h = ampc_flatten(ampc_adaptive_avg_pool2d(h, 1, 1), 1, -1);
    return ampc_linear(h, sd(m, "fc.weight"), sd(m, "fc.bias"));
}

/* examples/mnist Net.forward without the log_softmax (dropout: eval mode) */
static ampc_tensor *ref_cnn(ampc_module *m, ampc_tensor *x) {
    ampc_tensor *h = ampc_relu(ref_conv(m, "conv1", x, 1, 0, true));
    h = ampc_relu(ref_conv(m, "conv2", h, 1, 0, true));
    h = ampc_flatten(ampc_max_pool2d(h, &(ampc_pool2d_options){.kernel = {2, 2}}), 1, -1);
    h = ampc_relu(ampc_linear(h, sd(m, "fc1.weight"), sd(m, "fc1.bias")));
    return ampc_linear(h, sd(m, "fc2.weight"), sd(m, "fc2.bias"));
}

static const ampc_dtype MODES[] = {AMPC_F32, AMPC_BF16, AMPC_F16};

static void autocast_begin(ampc_dtype mode) {
    if (mode != AMPC_F32) ampc_autocast_enter(mode, true);
}
static void autocast_end(ampc_dtype mode) {
    if (mode != AMPC_F32) ampc_autocast_exit();
}

static void assert_bit_identical(const char *what, ampc_dtype mode, ampc_tensor *y, ampc_tensor *r) {
    ASSERT_NOT_NULL_MSG(y);
    ASSERT_NOT_NULL_MSG(r);
    if (!bits_equal(y, r)) fail_msg("%s (%s): the model's output differs from the architecture's", what, ampc_dtype_name(mode));
}

static void test_cnn_forward(void **state) {
    (void)state;
    ampc_module *m = ampc_model_new("cnn", NULL);
    ASSERT_NOT_NULL_MSG(m);
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_rand(AMPC_F32, 4, (int64_t[]){2, 1, 28, 28}, 0, 1);
    ampc_tensor *y = ampc_module_forward(m, x);
    ASSERT_NOT_NULL_MSG(y);
    assert_shape(y, 2, (int64_t[]){2, 10});
    assert_true(all_finite(y));
    /* training mode: dropout makes two forwards differ; eval: the architecture, bit for bit */
    ampc_module_train(m, false);
    for (size_t k = 0; k < 3; k++) {
        autocast_begin(MODES[k]);
        y = ampc_module_forward(m, x);
        ampc_tensor *r = ref_cnn(m, x);
        autocast_end(MODES[k]);
        assert_bit_identical("cnn", MODES[k], y, r);
        assert_int_equal(ampc_tensor_dtype(y), MODES[k]);
    }
    ampc_scope_end();
    ampc_module_free(m);
}

/* ResNets: eval mode (running statistics) and train mode (batch statistics), fp32 and bf16. */
static void test_resnet_forward_matches_architecture(void **state) {
    (void)state;
    const struct { ampc_module *m; bool bottleneck, small; int64_t hw; } cases[] = {
        {r18s(), false, true, 16}, {r18(), false, false, 64}, {r50(), true, false, 32}};
    for (size_t c = 0; c < 3; c++) {
        ampc_module *m = cases[c].m;
        const char *what = cases[c].bottleneck ? "resnet50" : cases[c].small ? "resnet18 small_input" : "resnet18";
        const int64_t classes = ampc_tensor_dim(sd(m, "fc.weight"), 0);
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_randn(AMPC_F32, 4, (int64_t[]){2, 3, cases[c].hw, cases[c].hw}, 0, 1);
        for (int tr = 0; tr < 2; tr++) {
            ampc_module_train(m, tr);
            for (size_t k = 0; k < 2; k++) {
                autocast_begin(MODES[k]);
                ampc_tensor *y = ampc_module_forward(m, x);
                ampc_tensor *r = ref_resnet(m, cases[c].bottleneck, cases[c].small, x, tr);
                autocast_end(MODES[k]);
                assert_bit_identical(what, MODES[k], y, r);
                assert_shape(y, 2, (int64_t[]){2, classes});
                assert_true(all_finite(y));
            }
        }
        ampc_scope_end();
    }
}

// ---------------------------------------------------------------------------------------------
// BatchNorm2d: running statistics in train and eval mode

static void test_batchnorm_train_eval(void **state) {
    (void)state;
    enum { N = 4, C = 3, HW = 25 };
    ampc_module *bn = ampc_batchnorm2d_new(C);
    ASSERT_NOT_NULL_MSG(bn);
    ampc_tensor *rm = sd(bn, "running_mean"), *rv = sd(bn, "running_var"), *nbt = sd(bn, "num_batches_tracked");
    ampc_scope_begin();
    double xs[N * C * HW];
    tu_fill_uniform(xs, N * C * HW, 5, -1, 2);
    ampc_tensor *x = ampc_tensor_from_f64(AMPC_F32, 4, (int64_t[]){N, C, 5, 5}, xs);
    double *xv = tu_values(x);   /* the fp32 values the kernel sees */
    ASSERT_NOT_NULL_MSG(ampc_module_forward(bn, x));
    assert_int_equal(*(const int64_t *)ampc_tensor_cdata(nbt), 1);
    /* momentum 0.1 from mean 0 / var 1, unbiased variance. Bound: a sum of n = N*HW terms in
       fp32 errs by n u32 times the sum of magnitudes (mean: sum|x|/n, variance computed in any
       one- or two-pass form: sum x^2/(n-1) + n mean^2/(n-1)), then a few roundings of the
       momentum update (3 u32 of the result). */
    const double n = N * HW, u = tu_eps(AMPC_F32);
    double *m1 = tu_values(rm), *v1 = tu_values(rv);
    for (int c = 0; c < C; c++) {
        double s = 0, sa = 0, s2 = 0;
        for (int i = 0; i < N; i++)
            for (int k = 0; k < HW; k++) {
                double v = xv[(i * C + c) * HW + k];
                s += v;
                sa += fabs(v);
                s2 += v * v;
            }
        double mean = s / n, var = (s2 - n * mean * mean) / (n - 1);
        double em = 0.1 * mean, ev = 0.9 + 0.1 * var;
        double tm = 0.1 * (n + 1) * u * sa / n + 3 * u * fabs(em);
        double tv = 0.1 * (n + 3) * u * (s2 + n * mean * mean) / (n - 1) + 3 * u * ev;
        if (!(fabs(m1[c] - em) <= tm) || !(fabs(v1[c] - ev) <= tv))
            fail_msg("channel %d: running_mean %.9g (expect %.9g +- %.2g), running_var %.9g (expect %.9g +- %.2g)", c,
                     m1[c], em, tm, v1[c], ev, tv);
    }
    /* training forwards count without grad too, as in PyTorch */
    ampc_no_grad_enter();
    ASSERT_NOT_NULL_MSG(ampc_module_forward(bn, x));
    ampc_no_grad_exit();
    assert_int_equal(*(const int64_t *)ampc_tensor_cdata(nbt), 2);
    /* eval: statistics untouched, the counter too, and y = (x - rm) / sqrt(rv + eps) */
    void *rm2 = snapshot(rm), *rv2 = snapshot(rv);
    double *m2 = tu_values(rm), *v2 = tu_values(rv);
    ampc_module_train(bn, false);
    ampc_tensor *y = ampc_module_forward(bn, x);
    ASSERT_NOT_NULL_MSG(y);
    assert_true(same_as_snapshot(rm, rm2) && same_as_snapshot(rv, rv2));
    assert_int_equal(*(const int64_t *)ampc_tensor_cdata(nbt), 2);
    double *yv = tu_values(y);
    for (int i = 0; i < N; i++)
        for (int c = 0; c < C; c++)
            for (int k = 0; k < HW; k++) {
                size_t j = (size_t)((i * C + c) * HW + k);
                double e = (xv[j] - m2[c]) / sqrt(v2[c] + 1e-5);
                /* about 8 fp32 roundings (sub, add eps, sqrt, divide, scale, shift) */
                double tol = 8 * u * (fabs(xv[j]) + fabs(m2[c])) / sqrt(v2[c] + 1e-5);
                if (!(fabs(yv[j] - e) <= tol)) fail_msg("eval y[%zu] = %.9g, expect %.9g", j, yv[j], e);
            }
    /* a 3D input is an error naming the layer */
    ampc_clear_error();
    assert_null(ampc_module_forward(bn, ampc_tensor_zeros(AMPC_F32, 3, (int64_t[]){2, 3, 4})));
    assert_non_null(strstr(ampc_last_error(), "BatchNorm2d"));
    free(m1), free(v1), free(m2), free(v2), free(yv), free(xv), free(rm2), free(rv2);
    ampc_scope_end();
    ampc_module_free(bn);
}

// ---------------------------------------------------------------------------------------------
// Training steps

/* Asserts every trainable parameter of m has a finite fp32 grad (and frozen ones none). */
static void assert_finite_grads(ampc_module *m, const char *what) {
    ampc_tensor **p;
    const char **names;
    int n = ampc_module_parameters(m, &p, &names);
    for (int i = 0; i < n; i++) {
        ampc_tensor *g = ampc_tensor_grad(p[i]);
        if (!ampc_tensor_requires_grad(p[i])) {
            if (g) fail_msg("%s: frozen %s has a grad", what, names[i]);
            continue;
        }
        if (!g) fail_msg("%s: %s has no grad", what, names[i]);
        assert_int_equal(ampc_tensor_dtype(g), AMPC_F32);
        if (!all_finite(g)) fail_msg("%s: %s has a non-finite grad", what, names[i]);
    }
}

static int forwards;   /* forward passes run by fwd_bwd (BatchNorm counts them in training mode) */

static void zero_grads(ampc_module *m) {
    ampc_tensor **p;
    int n = ampc_module_parameters(m, &p, NULL);
    for (int i = 0; i < n; i++) ampc_tensor_zero_grad(p[i]);
}

/* One forward+backward of m on (B, C, hw, hw) in mode; returns the loss. fp16 goes through a
   GradScaler with its defaults and, like a training loop, backs off and retries while the
   scaled gradients overflow (ResNet-50 on one image has weight gradients near 1e3: scale <= 64). */
static double fwd_bwd(ampc_module *m, ampc_dtype mode, int64_t B, int64_t C, int64_t hw, int64_t classes) {
    ampc_scaler *s = mode == AMPC_F16 ? ampc_scaler_new(NULL) : NULL;
    ampc_optimizer *opt = mode == AMPC_F16 ? ampc_sgd_new(m, NULL) : NULL;
    if (mode == AMPC_F16) ASSERT_NOT_NULL_MSG(s && opt);
    double l = NAN;
    for (int attempt = 0; attempt < 17; attempt++) {   /* 65536 down to 1 */
        zero_grads(m);
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_randn(AMPC_F32, 4, (int64_t[]){B, C, hw, hw}, 0, 1);
        int64_t labels[8];
        for (int64_t i = 0; i < B; i++) labels[i] = (i * 7 + 3) % classes;
        ampc_tensor *y = ampc_tensor_from_i64(1, (int64_t[]){B}, labels);
        autocast_begin(mode);
        ampc_tensor *out = ampc_module_forward(m, x);
        ampc_tensor *loss = ampc_cross_entropy(out, y, NULL);
        autocast_end(mode);
        forwards++;
        ASSERT_NOT_NULL_MSG(loss);
        assert_int_equal(ampc_tensor_dtype(out), mode);
        assert_int_equal(ampc_tensor_dtype(loss), AMPC_F32);
        l = ampc_tensor_item(loss);
        bool retry = false;
        if (s) {
            ASSERT_OK(ampc_backward(ampc_scaler_scale(s, loss)));
            ASSERT_OK(ampc_scaler_unscale(s, opt));
            retry = ampc_scaler_found_inf(s, opt);
            if (retry) {   /* skipped step, smaller scale */
                assert_int_equal(ampc_scaler_step(s, opt), 0);
                ASSERT_OK(ampc_scaler_update(s));
            }
        } else {
            ASSERT_OK(ampc_backward(loss));
        }
        ampc_scope_end();
        if (!retry) break;
        if (attempt == 16) fail_msg("fp16: gradients still overflow at scale %g", ampc_scaler_get_scale(s));
    }
    ampc_optimizer_free(opt);
    ampc_scaler_free(s);
    return l;
}

/* ResNet-18 (CIFAR stem, 10 classes, batch 2 of 3x32x32) in fp32, bf16 and fp16 + scaler;
   BatchNorm buffers move only in training mode. */
static void test_resnet18_step(void **state) {
    (void)state;
    ampc_module *m = r18s();
    ampc_tensor **t;
    const char **names;
    int n = ampc_module_state_dict(m, &t, &names);
    int64_t counted = *(const int64_t *)ampc_tensor_cdata(sd(m, "bn1.num_batches_tracked"));   /* earlier tests' */
    void **before = calloc((size_t)n, sizeof *before);
    for (int i = 0; i < n; i++) before[i] = snapshot(t[i]);
    /* eval: nothing in the state_dict moves */
    ampc_module_train(m, false);
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_randn(AMPC_F32, 4, (int64_t[]){2, 3, 32, 32}, 0, 1);
    ASSERT_NOT_NULL_MSG(ampc_module_forward(m, x));
    ampc_scope_end();
    for (int i = 0; i < n; i++)
        if (!same_as_snapshot(t[i], before[i])) fail_msg("eval forward changed %s", names[i]);
    ampc_module_train(m, true);
    forwards = 0;
    for (size_t k = 0; k < 3; k++) {
        double loss = fwd_bwd(m, MODES[k], 2, 3, 32, 10);
        if (!isfinite(loss)) fail_msg("resnet18 %s: loss %g", ampc_dtype_name(MODES[k]), loss);
        char what[64];
        snprintf(what, sizeof what, "resnet18 %s", ampc_dtype_name(MODES[k]));
        assert_finite_grads(m, what);
        zero_grads(m);
    }
    /* training moved every running statistic and counted every batch; parameters untouched */
    int n_bn = 0;
    for (int i = 0; i < n; i++) {
        const char *nm = names[i];
        size_t len = strlen(nm);
        if (len > 19 && !strcmp(nm + len - 19, "num_batches_tracked")) {
            assert_int_equal(*(const int64_t *)ampc_tensor_cdata(t[i]), counted + forwards);
            n_bn++;
        } else if (strstr(nm, "running_")) {
            if (same_as_snapshot(t[i], before[i])) fail_msg("training did not update %s", nm);
        } else if (!same_as_snapshot(t[i], before[i])) {
            fail_msg("backward changed parameter %s", nm);
        }
    }
    assert_int_equal(n_bn, 20);   /* 1 + 8 blocks * 2 + 3 downsamples */
    for (int i = 0; i < n; i++) free(before[i]);
    free(before);
    /* freeing the model gives back its parameters' and buffers' bytes (the grads' too) */
    size_t bytes = state_bytes(m), params0 = ampc_memory_stats().current[AMPC_MEM_PARAMETERS];
    free_shared(&g_r18s);
    assert_int_equal(params0 - ampc_memory_stats().current[AMPC_MEM_PARAMETERS], bytes);
}

/* ResNet-50, 1000 classes, one image: fp32, bf16 and fp16 + scaler (skipped under ASan unless
   asked). */
static void test_resnet50_step(void **state) {
    (void)state;
    const char *env = getenv("AMPC_TEST_RESNET50");
    if (UNDER_ASAN && !(env && *env == '1')) {
        print_message("skipped under AddressSanitizer (AMPC_TEST_RESNET50=1 runs it)\n");
        skip();
    }
    ampc_module *m = r50();
    ampc_module_train(m, true);
    const int64_t hw = env && *env == '1' && !UNDER_ASAN ? 224 : 64;   /* adaptive pooling takes any size >= 32 */
    for (size_t k = 0; k < 3; k++) {
        double loss = fwd_bwd(m, MODES[k], 1, 3, hw, 1000);
        if (!isfinite(loss)) fail_msg("resnet50 %s: loss %g", ampc_dtype_name(MODES[k]), loss);
        char what[64];
        snprintf(what, sizeof what, "resnet50 %s", ampc_dtype_name(MODES[k]));
        assert_finite_grads(m, what);
        zero_grads(m);
    }
}

/* Transfer learning: freeze a ResNet-50, give it a new 10-class head, one SGD momentum step
   through fp16 autocast and a GradScaler: the backbone stays bit-identical and grad-free, the
   head moves. */
static void test_frozen_backbone_step(void **state) {
    (void)state;
    ampc_module *m = r50();   /* changed here, freed at the end */
    ampc_module_train(m, true);
    ampc_module_requires_grad(m, false);
    ASSERT_OK(ampc_module_replace(m, "fc", ampc_linear_new(2048, 10, true)));
    assert_int_equal(ampc_module_num_parameters(m, true), 2048 * 10 + 10);
    ampc_tensor **p;
    const char **names;
    int n = ampc_module_parameters(m, &p, &names);
    void **before = calloc((size_t)n, sizeof *before);
    for (int i = 0; i < n; i++) before[i] = snapshot(p[i]);
    ampc_optimizer *opt = ampc_sgd_new(m, &(ampc_sgd_options){.lr = 0.1, .momentum = 0.9});
    ampc_scaler *s = ampc_scaler_new(NULL);
    ASSERT_NOT_NULL_MSG(opt && s);
    /* a real loop retries after an overflow (the scaler backs off): so does this, a few times */
    int applied = 0;
    for (int attempt = 0; attempt < 8 && applied == 0; attempt++) {
        ampc_scope_begin();
        ampc_tensor *x = ampc_tensor_randn(AMPC_F32, 4, (int64_t[]){2, 3, 32, 32}, 0, 1);
        ampc_tensor *y = ampc_tensor_from_i64(1, (int64_t[]){2}, (int64_t[]){3, 8});
        ampc_autocast_enter(AMPC_F16, true);
        ampc_tensor *loss = ampc_cross_entropy(ampc_module_forward(m, x), y, NULL);
        ampc_autocast_exit();
        ASSERT_NOT_NULL_MSG(loss);
        assert_true(isfinite(ampc_tensor_item(loss)));
        ASSERT_OK(ampc_backward(ampc_scaler_scale(s, loss)));
        for (int i = 0; i < n - 2; i++)
            if (ampc_tensor_grad(p[i])) fail_msg("frozen %s got a grad", names[i]);
        applied = ampc_scaler_step(s, opt);
        ASSERT_OK(applied);
        ASSERT_OK(ampc_scaler_update(s));
        ampc_optimizer_zero_grad(opt);
        ampc_scope_end();
    }
    assert_int_equal(applied, 1);
    for (int i = 0; i < n; i++) {
        bool same = same_as_snapshot(p[i], before[i]);
        if (i < n - 2 && !same) fail_msg("frozen %s changed", names[i]);
        if (i >= n - 2 && same) fail_msg("head %s did not change", names[i]);
    }
    assert_string_equal(names[n - 2], "fc.weight");
    for (int i = 0; i < n; i++) free(before[i]);
    free(before);
    ampc_scaler_free(s);
    ampc_optimizer_free(opt);
    free_shared(&g_r50);
}

// ---------------------------------------------------------------------------------------------
// The small layers' forwards (options reach the ops)

static void test_layer_forwards(void **state) {
    (void)state;
    ampc_scope_begin();
    /* Conv2d stride 2, padding 1: output (N, O, floor((H + 2 - 3) / 2) + 1, ...); one output
       element against a direct sum in f64 (K = 2*9 terms + bias in fp32) */
    ampc_module *conv = ampc_conv2d_new(2, 3, 3, &(ampc_conv2d_options){.stride = {2, 2}, .padding = {1, 1}}, true);
    ASSERT_NOT_NULL_MSG(conv);
    ampc_tensor *x = ampc_tensor_randn(AMPC_F32, 4, (int64_t[]){1, 2, 7, 6}, 0, 1);
    ampc_tensor *y = ampc_module_forward(conv, x);
    ASSERT_NOT_NULL_MSG(y);
    assert_shape(y, 4, (int64_t[]){1, 3, 4, 3});
    double *xv = tu_values(x), *yv = tu_values(y), *w = tu_values(sd(conv, "weight")), *b = tu_values(sd(conv, "bias"));
    for (int o = 0; o < 3; o++)
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 3; j++) {
                double s = b[o], mag = fabs(b[o]);
                for (int c = 0; c < 2; c++)
                    for (int ki = 0; ki < 3; ki++)
                        for (int kj = 0; kj < 3; kj++) {
                            int r = 2 * i - 1 + ki, q = 2 * j - 1 + kj;
                            if (r < 0 || r >= 7 || q < 0 || q >= 6) continue;
                            double t = w[((o * 2 + c) * 3 + ki) * 3 + kj] * xv[(c * 7 + r) * 6 + q];
                            s += t;
                            mag += fabs(t);
                        }
                double got = yv[(o * 4 + i) * 3 + j];
                if (!(fabs(got - s) <= 20 * tu_eps(AMPC_F32) * mag))
                    fail_msg("conv y[%d,%d,%d] = %.9g, expect %.9g", o, i, j, got, s);
            }
    free(yv);
    /* pools on the same x: max 3x3 stride 2 pad 1, avg 2x2, adaptive to (1, 1) */
    ampc_module *mp = ampc_maxpool2d_new(&(ampc_pool2d_options){.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}});
    ampc_module *ap = ampc_avgpool2d_new(&(ampc_pool2d_options){.kernel = {2, 2}});
    ampc_module *aap = ampc_adaptive_avgpool2d_new(1, 1);
    ASSERT_NOT_NULL_MSG(mp && ap && aap);
    y = ampc_module_forward(mp, x);
    ASSERT_NOT_NULL_MSG(y);
    assert_shape(y, 4, (int64_t[]){1, 2, 4, 3});
    yv = tu_values(y);
    for (int c = 0; c < 2; c++)
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 3; j++) {
                double mx = -INFINITY;
                for (int r = 2 * i - 1; r <= 2 * i + 1; r++)
                    for (int q = 2 * j - 1; q <= 2 * j + 1; q++)
                        if (r >= 0 && r < 7 && q >= 0 && q < 6) mx = fmax(mx, xv[(c * 7 + r) * 6 + q]);
                assert_true(yv[(c * 4 + i) * 3 + j] == mx);
            }
    free(yv);
    y = ampc_module_forward(ap, x);
    ASSERT_NOT_NULL_MSG(y);
    assert_shape(y, 4, (int64_t[]){1, 2, 3, 3});   /* floor((7 - 2) / 2) + 1 */
    yv = tu_values(y);
    for (int c = 0; c < 2; c++)
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 3; j++) {
                double s = 0, mag = 0;
                for (int r = 2 * i; r < 2 * i + 2; r++)
                    for (int q = 2 * j; q < 2 * j + 2; q++) s += xv[(c * 7 + r) * 6 + q], mag += fabs(xv[(c * 7 + r) * 6 + q]);
                assert_true(fabs(yv[(c * 3 + i) * 3 + j] - s / 4) <= 6 * tu_eps(AMPC_F32) * mag / 4);
            }
    free(yv);
    y = ampc_module_forward(aap, x);
    ASSERT_NOT_NULL_MSG(y);
    assert_shape(y, 4, (int64_t[]){1, 2, 1, 1});
    yv = tu_values(y);
    for (int c = 0; c < 2; c++) {
        double s = 0, mag = 0;
        for (int k = 0; k < 42; k++) s += xv[c * 42 + k], mag += fabs(xv[c * 42 + k]);
        assert_true(fabs(yv[c] - s / 42) <= 44 * tu_eps(AMPC_F32) * mag / 42);
    }
    free(yv);
    /* LayerNorm over the last 2 dims (7, 6): each (n, c) slice to mean 0, biased variance 1 */
    ampc_module *ln = ampc_layernorm_new(2, (int64_t[]){7, 6});
    ASSERT_NOT_NULL_MSG(ln);
    y = ampc_module_forward(ln, x);
    ASSERT_NOT_NULL_MSG(y);
    assert_shape(y, 4, (int64_t[]){1, 2, 7, 6});
    yv = tu_values(y);
    const double u = tu_eps(AMPC_F32), n = 42;
    for (int c = 0; c < 2; c++) {
        const double *xc = xv + c * 42;
        double s = 0, sa = 0, sq = 0, s2 = 0;
        for (int k = 0; k < 42; k++) s += xc[k], sa += fabs(xc[k]), sq += xc[k] * xc[k];
        double mean = s / n;
        for (int k = 0; k < 42; k++) s2 += (xc[k] - mean) * (xc[k] - mean);
        double var = s2 / n, inv = 1 / sqrt(var + 1e-5);
        /* fp32 statistics over n terms, in one or two passes: the mean errs by at most
           dm = (n+1) u sum|x|/n, the biased variance by dv = (n+3) u (sum x^2/n + mean^2) + 2|mean| dm;
           1/sqrt(var + eps) then errs relatively by dv/(2(var+eps)) and a few roundings, and
           (x - mean) * inv * 1 + 0 adds a few more */
        double dm = (n + 1) * u * sa / n, dv = (n + 3) * u * (sq / n + mean * mean) + 2 * fabs(mean) * dm;
        for (int k = 0; k < 42; k++) {
            double e = (xc[k] - mean) * inv;
            double tol = (dm + 2 * u * (fabs(xc[k]) + fabs(mean))) * inv + fabs(e) * (dv / (2 * (var + 1e-5)) + 6 * u);
            if (!(fabs(yv[c * 42 + k] - e) <= tol)) fail_msg("layer norm y[%d] = %.9g, expect %.9g +- %.2g", c * 42 + k, yv[c * 42 + k], e, tol);
        }
    }
    free(yv);
    free(xv), free(w), free(b);
    ampc_scope_end();
    ampc_module_free(conv), ampc_module_free(mp), ampc_module_free(ap), ampc_module_free(aap), ampc_module_free(ln);
}

int main(void) {
    const struct CMUnitTest tests[] = {   /* in this order: the shared models pass along */
        cmocka_unit_test(test_memory_and_devices),
        cmocka_unit_test(test_state_dicts_match_torchvision),
        cmocka_unit_test(test_model_options),
        cmocka_unit_test(test_init),
        cmocka_unit_test(test_layer_errors),
        cmocka_unit_test(test_layer_forwards),
        cmocka_unit_test(test_batchnorm_train_eval),
        cmocka_unit_test(test_cnn_forward),
        cmocka_unit_test(test_resnet_forward_matches_architecture),
        cmocka_unit_test(test_resnet18_step),
        cmocka_unit_test(test_resnet50_step),
        cmocka_unit_test(test_find_replace),
        cmocka_unit_test(test_frozen_backbone_step),
    };
    if (getenv("AMPC_TEST_FILTER")) cmocka_set_test_filter(getenv("AMPC_TEST_FILTER"));   /* e.g. "*resnet50*" */
    return cmocka_run_group_tests(tests, tu_group_setup, group_teardown);
}
