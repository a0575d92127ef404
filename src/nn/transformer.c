/*
 * transformer.c - the transformer's layers, with nanoGPT's names and layouts so that state_dicts
 * load both ways: CausalSelfAttention (c_attn: one Linear C -> 3C for q, k and v; c_proj: C -> C),
 * its heads split with narrow/reshape/permute and attended by the fused causal attention op;
 * the MLP (c_fc: C -> 4C, exact GELU, c_proj: 4C -> C); the pre-LayerNorm Block of the two.
 */
#include "nn/nn.h"

// ---------------------------------------------------------------------------------------------
// CausalSelfAttention: x (B, T, C) -> c_attn -> q, k, v (B, n_head, T, C / n_head) -> causal
// attention -> heads joined (B, T, C) -> c_proj -> dropout (training)

static ampc_tensor *csa_forward(ampc_module *m, ampc_tensor *x) {
    if (!x) return NULL;
    const int64_t C = m->config.attention.n_embd, H = m->config.attention.n_head;
    if (ampc_tensor_ndim(x) != 3 || ampc_tensor_dim(x, 2) != C)
        return ampc__err_null(AMPC_ERR_SHAPE, "CausalSelfAttention: input of %d dims (last %lld); expected (B, T, %lld)",
                              ampc_tensor_ndim(x), (long long)ampc_tensor_dim(x, -1), (long long)C);
    const int64_t B = ampc_tensor_dim(x, 0), T = ampc_tensor_dim(x, 1);
    ampc_tensor *qkv = ampc__child_forward(m, "c_attn", x), *h[3];
    static const int heads_first[4] = {0, 2, 1, 3};
    for (int i = 0; i < 3; i++)
        h[i] = ampc_permute(ampc_reshape(ampc_narrow(qkv, 2, i * C, C), 4, (int64_t[]){B, T, H, C / H}), heads_first);
    ampc_tensor *y = ampc_scaled_dot_product_attention(h[0], h[1], h[2], true, 0);
    y = ampc_reshape(ampc_permute(y, heads_first), 3, (int64_t[]){B, T, C});
    y = ampc__child_forward(m, "c_proj", y);
    double p = m->config.attention.dropout;
    return p > 0 ? ampc_dropout(y, p, m->training) : y;
}

static const ampc_module_vtable csa_vtable = {"CausalSelfAttention", csa_forward, NULL};

ampc_module *ampc_causal_self_attention_new(int64_t n_embd, int64_t n_head, bool bias, double dropout) {
    if (n_embd <= 0 || n_head <= 0 || n_embd % n_head)
        return ampc__err_null(AMPC_ERR_INVALID, "CausalSelfAttention(n_embd %lld, n_head %lld): n_embd must be a positive multiple of n_head",
                              (long long)n_embd, (long long)n_head);
    if (!(dropout >= 0 && dropout < 1)) return ampc__err_null(AMPC_ERR_INVALID, "CausalSelfAttention: dropout %g outside [0, 1)", dropout);
    ampc_module *m = ampc__module_new(&csa_vtable);
    if (!m) return NULL;
    m->config.attention.n_embd = n_embd;
    m->config.attention.n_head = n_head;
    m->config.attention.dropout = dropout;
    int rc = ampc__module_add_child(m, "c_attn", ampc_linear_new(n_embd, 3 * n_embd, bias));
    if (rc >= 0) rc = ampc__module_add_child(m, "c_proj", ampc_linear_new(n_embd, n_embd, bias));
    if (rc < 0) {
        ampc_module_free(m);
        return NULL;
    }
    return m;
}

// ---------------------------------------------------------------------------------------------
// MLP: c_fc (C -> 4C), GELU (exact, as nanoGPT), c_proj (4C -> C), dropout in training

static ampc_tensor *mlp_forward(ampc_module *m, ampc_tensor *x) {
    ampc_tensor *y = ampc__child_forward(m, "c_proj", ampc_gelu(ampc__child_forward(m, "c_fc", x)));
    double p = m->config.attention.dropout;
    return p > 0 ? ampc_dropout(y, p, m->training) : y;
}

static const ampc_module_vtable mlp_vtable = {"MLP", mlp_forward, NULL};

static ampc_module *mlp_new(int64_t n_embd, bool bias, double dropout) {
    ampc_module *m = ampc__module_new(&mlp_vtable);
    if (!m) return NULL;
    m->config.attention.n_embd = n_embd;
    m->config.attention.dropout = dropout;
    int rc = ampc__module_add_child(m, "c_fc", ampc_linear_new(n_embd, 4 * n_embd, bias));
    if (rc >= 0) rc = ampc__module_add_child(m, "c_proj", ampc_linear_new(4 * n_embd, n_embd, bias));
    if (rc < 0) {
        ampc_module_free(m);
        return NULL;
    }
    return m;
}

// ---------------------------------------------------------------------------------------------
// Block: x + attn(ln_1(x)), then + mlp(ln_2(.))

static ampc_tensor *block_forward(ampc_module *m, ampc_tensor *x) {
    x = ampc_add(x, ampc__child_forward(m, "attn", ampc__child_forward(m, "ln_1", x)));
    return ampc_add(x, ampc__child_forward(m, "mlp", ampc__child_forward(m, "ln_2", x)));
}

static const ampc_module_vtable block_vtable = {"Block", block_forward, NULL};

ampc_module *ampc_gpt_block_new(int64_t n_embd, int64_t n_head, bool bias, double dropout) {
    ampc_module *attn = ampc_causal_self_attention_new(n_embd, n_head, bias, dropout);
    if (!attn) return NULL;
    ampc_module *m = ampc__module_new(&block_vtable);
    if (!m) {
        ampc_module_free(attn);
        return NULL;
    }
    const int64_t shape[1] = {n_embd};
    int rc = ampc__module_add_child(m, "ln_1", ampc__layernorm_make(1, shape, bias));
    if (rc >= 0) rc = ampc__module_add_child(m, "attn", attn);
    else ampc_module_free(attn);
    if (rc >= 0) rc = ampc__module_add_child(m, "ln_2", ampc__layernorm_make(1, shape, bias));
    if (rc >= 0) rc = ampc__module_add_child(m, "mlp", mlp_new(n_embd, bias, dropout));
    if (rc < 0) {
        ampc_module_free(m);
        return NULL;
    }
    return m;
}
