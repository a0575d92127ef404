/*
 * transformer.c - the transformer's layers, with nanoGPT's names and layouts so that state_dicts
 * load both ways: CausalSelfAttention (c_attn: one Linear C -> 3C for q, k and v; c_proj: C -> C),
 * its heads split with narrow/reshape/permute and attended by the fused causal attention op;
 * the MLP (c_fc: C -> 4C, exact GELU, c_proj: 4C -> C); the pre-LayerNorm Block of the two;
 * the GPT of those Blocks (the zoo's "gpt"), its output head tied to the token embedding.
 */
#include "nn/nn.h"
#include "ops/ops.h"

#include <math.h>
#include <stdio.h>

/* How a transformer's Linear layers start: std 0 is PyTorch's default (the public constructors);
   std > 0 is nanoGPT's N(0, std) weights with zero biases, proj_std for the c_proj layers. */
typedef struct {
    double std, proj_std;
} tf_init;

// ---------------------------------------------------------------------------------------------
// CausalSelfAttention: x (B, T, C) -> c_attn -> q, k, v (B, n_head, T, C / n_head) -> causal
// attention (dropout on its probabilities in training) -> heads joined (B, T, C) -> c_proj ->
// dropout (training), as nanoGPT's

static ampc_tensor *csa_forward(ampc_module *m, ampc_tensor *x) {
    if (!x) return NULL;
    const int64_t C = m->config.attention.n_embd, H = m->config.attention.n_head;
    if (ampc_tensor_ndim(x) != 3 || ampc_tensor_dim(x, 2) != C)
        return ampc__err_null(AMPC_ERR_SHAPE, "CausalSelfAttention: input of %d dims (last %lld); expected (B, T, %lld)",
                              ampc_tensor_ndim(x), (long long)ampc_tensor_dim(x, -1), (long long)C);
    const int64_t B = ampc_tensor_dim(x, 0), T = ampc_tensor_dim(x, 1);
    ampc_tensor *qkv = ampc__child_forward(m, "c_attn", x);
    /* q, k, v as the parts of one (3, B, H, T, D) tensor, attended to without splitting it */
    static const int parts_first[5] = {2, 0, 3, 1, 4}, heads_first[4] = {0, 2, 1, 3};
    ampc_tensor *parts = ampc_permute(ampc_reshape(qkv, 5, (int64_t[]){B, T, 3, H, C / H}), parts_first);
    double p = m->config.attention.dropout;
    ampc_tensor *y = ampc__attention_packed(parts, m->training ? p : 0.0, true, 0);
    y = ampc_reshape(ampc_permute(y, heads_first), 3, (int64_t[]){B, T, C});
    y = ampc__child_forward(m, "c_proj", y);
    return p > 0 ? ampc_dropout(y, p, m->training) : y;
}

static const ampc_module_vtable csa_vtable = {"CausalSelfAttention", csa_forward, NULL};

static ampc_module *csa_make(int64_t n_embd, int64_t n_head, bool bias, double dropout, tf_init init) {
    if (n_embd <= 0 || n_head <= 0 || n_embd % n_head)
        return ampc__err_null(AMPC_ERR_INVALID, "CausalSelfAttention(n_embd %lld, n_head %lld): n_embd must be a positive multiple of n_head",
                              (long long)n_embd, (long long)n_head);
    if (!(dropout >= 0 && dropout < 1)) return ampc__err_null(AMPC_ERR_INVALID, "CausalSelfAttention: dropout %g outside [0, 1)", dropout);
    ampc_module *m = ampc__module_new(&csa_vtable);
    if (!m) return NULL;
    m->config.attention.n_embd = n_embd;
    m->config.attention.n_head = n_head;
    m->config.attention.dropout = dropout;
    int rc = ampc__module_add_child(m, "c_attn", ampc__linear_make(n_embd, 3 * n_embd, bias, init.std));
    if (rc >= 0) rc = ampc__module_add_child(m, "c_proj", ampc__linear_make(n_embd, n_embd, bias, init.proj_std));
    if (rc < 0) {
        ampc_module_free(m);
        return NULL;
    }
    return m;
}

ampc_module *ampc_causal_self_attention_new(int64_t n_embd, int64_t n_head, bool bias, double dropout) {
    return csa_make(n_embd, n_head, bias, dropout, (tf_init){0, 0});
}

// ---------------------------------------------------------------------------------------------
// MLP: c_fc (C -> 4C), GELU (exact, as nanoGPT), c_proj (4C -> C), dropout in training

static ampc_tensor *mlp_forward(ampc_module *m, ampc_tensor *x) {
    ampc_tensor *y = ampc__child_forward(m, "c_proj", ampc_gelu(ampc__child_forward(m, "c_fc", x)));
    double p = m->config.attention.dropout;
    return p > 0 ? ampc_dropout(y, p, m->training) : y;
}

static const ampc_module_vtable mlp_vtable = {"MLP", mlp_forward, NULL};

static ampc_module *mlp_make(int64_t n_embd, bool bias, double dropout, tf_init init) {
    ampc_module *m = ampc__module_new(&mlp_vtable);
    if (!m) return NULL;
    m->config.attention.n_embd = n_embd;
    m->config.attention.dropout = dropout;
    int rc = ampc__module_add_child(m, "c_fc", ampc__linear_make(n_embd, 4 * n_embd, bias, init.std));
    if (rc >= 0) rc = ampc__module_add_child(m, "c_proj", ampc__linear_make(4 * n_embd, n_embd, bias, init.proj_std));
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

static ampc_module *block_make(int64_t n_embd, int64_t n_head, bool bias, double dropout, tf_init init) {
    ampc_module *attn = csa_make(n_embd, n_head, bias, dropout, init);
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
    if (rc >= 0) rc = ampc__module_add_child(m, "mlp", mlp_make(n_embd, bias, dropout, init));
    if (rc < 0) {
        ampc_module_free(m);
        return NULL;
    }
    return m;
}

ampc_module *ampc_gpt_block_new(int64_t n_embd, int64_t n_head, bool bias, double dropout) {
    return block_make(n_embd, n_head, bias, dropout, (tf_init){0, 0});
}

// ---------------------------------------------------------------------------------------------
// Containers: ModuleDict and ModuleList hold children under names ("wte", "0", ...) for the
// state_dict's paths; their owner runs the children.

static ampc_tensor *container_forward(ampc_module *m, ampc_tensor *x) {
    (void)x;
    return ampc__err_null(AMPC_ERR_STATE, "%s has no forward of its own: the module holding it runs its children", m->vt->type);
}

static const ampc_module_vtable module_dict_vtable = {"ModuleDict", container_forward, NULL};
static const ampc_module_vtable module_list_vtable = {"ModuleList", container_forward, NULL};

// ---------------------------------------------------------------------------------------------
// GPT: idx (B, T) -> wte(idx) + wpe(0 .. T-1) -> drop -> h.0 .. h.(L-1) -> ln_f -> lm_head

static ampc_tensor *gpt_forward(ampc_module *m, ampc_tensor *idx) {
    if (!idx) return NULL;
    const int64_t block = m->config.gpt.block_size;
    if (ampc_tensor_dtype(idx) != AMPC_I64 || ampc_tensor_ndim(idx) != 2)
        return ampc__err_null(AMPC_ERR_SHAPE, "GPT: the input must be token indices (B, T) of i64, not %d dims of %s", ampc_tensor_ndim(idx),
                              ampc_dtype_name(ampc_tensor_dtype(idx)));
    const int64_t T = ampc_tensor_dim(idx, 1);
    if (T > block) return ampc__err_null(AMPC_ERR_SHAPE, "GPT: cannot run a sequence of length %lld: the block size is %lld", (long long)T, (long long)block);
    ampc_module *tr = ampc__module_get_child(m, "transformer"), *wpe = tr ? ampc__module_get_child(tr, "wpe") : NULL;
    ampc_module *h = tr ? ampc__module_get_child(tr, "h") : NULL;
    if (!wpe || !h) return ampc__err_null(AMPC_ERR_STATE, "GPT: transformer.wpe or transformer.h was removed");
    /* wpe(arange(T)) is wpe.weight's first T rows: a block of the table, its gradient the same */
    ampc_tensor *pos = ampc_narrow(ampc__module_param(wpe, "weight"), 0, 0, T);
    ampc_tensor *x = ampc__child_forward(tr, "drop", ampc_add(ampc__child_forward(tr, "wte", idx), pos));
    for (int i = 0; i < ampc_module_num_children(h); i++) x = ampc_module_forward(ampc_module_child(h, i), x);
    return ampc__child_forward(m, "lm_head", ampc__child_forward(tr, "ln_f", x));
}

static const ampc_module_vtable gpt_vtable = {"GPT", gpt_forward, NULL};

ampc_module *ampc__gpt_new(const ampc_gpt_config *c) {
    const bool bias = !c->no_bias;
    if (c->vocab_size <= 0 || c->block_size <= 0 || c->n_layer <= 0 || c->n_head <= 0 || c->n_embd <= 0 || c->n_embd % c->n_head)
        return ampc__err_null(AMPC_ERR_INVALID,
                              "gpt: vocab_size %lld, block_size %lld, n_layer %lld, n_head %lld and n_embd %lld must be positive, "
                              "n_embd a multiple of n_head",
                              (long long)c->vocab_size, (long long)c->block_size, (long long)c->n_layer, (long long)c->n_head,
                              (long long)c->n_embd);
    if (!(c->dropout >= 0 && c->dropout < 1)) return ampc__err_null(AMPC_ERR_INVALID, "gpt: dropout %g outside [0, 1)", c->dropout);
    ampc_module *m = ampc__module_new(&gpt_vtable), *tr = ampc__module_new(&module_dict_vtable), *h = ampc__module_new(&module_list_vtable);
    int rc = m && tr && h ? AMPC_OK : ampc_last_status();
    if (rc < 0) {
        ampc_module_free(m);
        ampc_module_free(tr);
        ampc_module_free(h);
        return NULL;
    }
    m->config.gpt.block_size = c->block_size;
    const int64_t shape[1] = {c->n_embd};
    /* nanoGPT's initialisation: N(0, 0.02) for Linear and Embedding weights, zero biases, and the
       residual projections (c_proj) scaled by 1/sqrt(2 n_layer) */
    const tf_init init = {0.02, 0.02 / sqrt(2.0 * (double)c->n_layer)};
    for (int64_t i = 0; i < c->n_layer && rc >= 0; i++) {
        char name[24];
        snprintf(name, sizeof name, "%lld", (long long)i);
        rc = ampc__module_add_child(h, name, block_make(c->n_embd, c->n_head, bias, c->dropout, init));
    }
    /* the children in nanoGPT's order, which is its state_dict's */
    if (rc >= 0) rc = ampc__module_add_child(tr, "wte", ampc__embedding_make(c->vocab_size, c->n_embd, init.std));
    if (rc >= 0) rc = ampc__module_add_child(tr, "wpe", ampc__embedding_make(c->block_size, c->n_embd, init.std));
    if (rc >= 0) rc = ampc__module_add_child(tr, "drop", ampc_dropout_new(c->dropout));
    if (rc >= 0) rc = ampc__module_add_child(tr, "h", h);
    else ampc_module_free(h);
    if (rc >= 0) rc = ampc__module_add_child(tr, "ln_f", ampc__layernorm_make(1, shape, bias));
    if (rc >= 0) rc = ampc__module_add_child(m, "transformer", tr);
    else ampc_module_free(tr);
    if (rc >= 0) rc = ampc__module_add_child(m, "lm_head", ampc__linear_make(c->n_embd, c->vocab_size, false, init.std));
    if (rc >= 0)
        rc = ampc__module_tie_param(ampc__module_get_child(m, "lm_head"), "weight",
                                    ampc__module_param(ampc__module_get_child(tr, "wte"), "weight"));
    if (rc < 0) {
        ampc_module_free(m);
        return NULL;
    }
    return m;
}
