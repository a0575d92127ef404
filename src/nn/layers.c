/*
 * layers.c - the simple layers: Linear, Embedding, the activations, Dropout and Flatten. Each is a
 * vtable and a forward that calls the public ops (which obey autocast and record autograd).
 */
#include "nn/nn.h"

#include <math.h>

// ---------------------------------------------------------------------------------------------
// Linear: y = x @ weight^T + bias, weight (out, in), bias (out)

static ampc_tensor *linear_forward(ampc_module *m, ampc_tensor *x) {
    return ampc_linear(x, ampc__module_param(m, "weight"), ampc__module_param(m, "bias"));
}

static const ampc_module_vtable linear_vtable = {"Linear", linear_forward, NULL};

ampc_module *ampc_linear_new(int64_t in_features, int64_t out_features, bool bias) {
    return ampc__linear_make(in_features, out_features, bias, 0.0);
}

ampc_module *ampc__linear_make(int64_t in_features, int64_t out_features, bool bias, double weight_std) {
    if (in_features < 0 || out_features < 0)
        return ampc__err_null(AMPC_ERR_INVALID, "Linear(%lld, %lld): negative size", (long long)in_features,
                              (long long)out_features);
    ampc_module *m = ampc__module_new(&linear_vtable);
    if (!m) return NULL;
    m->config.linear.in_features = in_features;
    m->config.linear.out_features = out_features;
    /* PyTorch's reset_parameters: kaiming_uniform_(a=sqrt(5)) on the weight gives the bound
       gain * sqrt(3 / fan_in) with gain = sqrt(2 / (1 + 5)), that is 1/sqrt(fan_in); the bias
       uses the same bound. The weight draws come first, then the bias, as in PyTorch. */
    double bound = in_features > 0 ? 1.0 / sqrt((double)in_features) : 0.0;
    const int64_t wshape[2] = {out_features, in_features};
    ampc_scope_begin();
    int rc = ampc__module_add_param(m, "weight", weight_std > 0 ? ampc__param_normal(2, wshape, weight_std) : ampc__param_uniform(2, wshape, bound));
    if (rc >= 0 && bias)
        rc = ampc__module_add_param(m, "bias", weight_std > 0 ? ampc__param_normal(1, &out_features, 0.0) : ampc__param_uniform(1, &out_features, bound));
    ampc_scope_end();
    if (rc < 0) {
        ampc_module_free(m);
        return NULL;
    }
    return m;
}

// ---------------------------------------------------------------------------------------------
// Embedding: the rows of weight (num_embeddings, embedding_dim) its i64 input picks

static ampc_tensor *embedding_forward(ampc_module *m, ampc_tensor *x) { return ampc_embedding(x, ampc__module_param(m, "weight")); }

static const ampc_module_vtable embedding_vtable = {"Embedding", embedding_forward, NULL};

ampc_module *ampc_embedding_new(int64_t num_embeddings, int64_t embedding_dim) {
    return ampc__embedding_make(num_embeddings, embedding_dim, 1.0);   /* PyTorch's reset_parameters: normal_(0, 1) */
}

ampc_module *ampc__embedding_make(int64_t num_embeddings, int64_t embedding_dim, double std) {
    if (num_embeddings <= 0 || embedding_dim <= 0)
        return ampc__err_null(AMPC_ERR_INVALID, "Embedding(%lld, %lld): sizes must be positive", (long long)num_embeddings,
                              (long long)embedding_dim);
    ampc_module *m = ampc__module_new(&embedding_vtable);
    if (!m) return NULL;
    m->config.embedding.num_embeddings = num_embeddings;
    m->config.embedding.embedding_dim = embedding_dim;
    ampc_scope_begin();
    int rc = ampc__module_add_param(m, "weight", ampc__param_normal(2, (int64_t[]){num_embeddings, embedding_dim}, std));
    ampc_scope_end();
    if (rc < 0) {
        ampc_module_free(m);
        return NULL;
    }
    return m;
}

// ---------------------------------------------------------------------------------------------
// Activations

static ampc_tensor *relu_forward(ampc_module *m, ampc_tensor *x) { (void)m; return ampc_relu(x); }
static ampc_tensor *gelu_forward(ampc_module *m, ampc_tensor *x) { (void)m; return ampc_gelu(x); }
static ampc_tensor *silu_forward(ampc_module *m, ampc_tensor *x) { (void)m; return ampc_silu(x); }
static ampc_tensor *tanh_forward(ampc_module *m, ampc_tensor *x) { (void)m; return ampc_tanh(x); }
static ampc_tensor *sigmoid_forward(ampc_module *m, ampc_tensor *x) { (void)m; return ampc_sigmoid(x); }

static const ampc_module_vtable relu_vtable = {"ReLU", relu_forward, NULL};
static const ampc_module_vtable gelu_vtable = {"GELU", gelu_forward, NULL};
static const ampc_module_vtable silu_vtable = {"SiLU", silu_forward, NULL};
static const ampc_module_vtable tanh_vtable = {"Tanh", tanh_forward, NULL};
static const ampc_module_vtable sigmoid_vtable = {"Sigmoid", sigmoid_forward, NULL};

ampc_module *ampc_relu_new(void) { return ampc__module_new(&relu_vtable); }
ampc_module *ampc_gelu_new(void) { return ampc__module_new(&gelu_vtable); }
ampc_module *ampc_silu_new(void) { return ampc__module_new(&silu_vtable); }
ampc_module *ampc_tanh_new(void) { return ampc__module_new(&tanh_vtable); }
ampc_module *ampc_sigmoid_new(void) { return ampc__module_new(&sigmoid_vtable); }

// ---------------------------------------------------------------------------------------------
// Dropout (config.dropout.p): the identity in eval mode, as PyTorch returns its input unchanged.

static ampc_tensor *dropout_forward(ampc_module *m, ampc_tensor *x) {
    if (!m->training || m->config.dropout.p == 0.0) return x;
    return ampc_dropout(x, m->config.dropout.p, true);
}

static const ampc_module_vtable dropout_vtable = {"Dropout", dropout_forward, NULL};

ampc_module *ampc_dropout_new(double p) {
    if (!(p >= 0.0 && p <= 1.0))
        return ampc__err_null(AMPC_ERR_INVALID, "Dropout probability has to be between 0 and 1, but got %g", p);
    ampc_module *m = ampc__module_new(&dropout_vtable);
    if (m) m->config.dropout.p = p;
    return m;
}

// ---------------------------------------------------------------------------------------------
// Flatten (start_dim 1, end_dim -1): (N, ...) -> (N, prod(...))

static ampc_tensor *flatten_forward(ampc_module *m, ampc_tensor *x) {
    (void)m;
    return ampc_flatten(x, 1, -1);
}

static const ampc_module_vtable flatten_vtable = {"Flatten", flatten_forward, NULL};

ampc_module *ampc_flatten_new(void) { return ampc__module_new(&flatten_vtable); }
