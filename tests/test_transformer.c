/*
 * test_transformer.c - the transformer's own ops.
 * ampc_scaled_dot_product_attention: forward and backward against REF (computed there from the
 * definition, with the T x T probabilities) in every CPU dtype, and on CUDA where a GPU is
 * present, with finite differences on REF: causal and not, Tq != Tk, masks broadcast every way,
 * dropout, blocks of rows; against the same attention composed of other ops; against PyTorch
 * 1.13's values of the composed formula.
 * ampc_embedding: forward and backward against REF in every CPU dtype (and CUDA) with finite
 * differences on REF; repeated indices summed in index order to the same bits on 1 and 3
 * threads; the weight's dtype kept under autocast; bad indices refused by name.
 */
#include "testutil.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "ops/ops.h"

static ampc_tensor *op_embedding(ampc_tensor **in, const void *ctx) {
    (void)ctx;
    return ampc_embedding(in[1], in[0]);
}

/* weight (V, D) first (the input with a gradient), then the indices of shape ish */
static void check_embedding(const char *name, int64_t V, int64_t D, int ind, const int64_t *ish, int64_t n) {
    tu_op_case c = {.name = name, .n_inputs = 2, .ndim = {2, ind}, .is_label = {false, true}, .n_classes = V,
                    .lo = -2, .hi = 2, .fn = op_embedding, .k = 1, .k_backward = (double)n};
    c.shape[0][0] = V, c.shape[0][1] = D;
    memcpy(c.shape[1], ish, sizeof(int64_t) * (size_t)ind);
    tu_check_op(&c);
}

static void test_embedding_op_check(void **state) {
    (void)state;
    check_embedding("embedding 7x5, (3, 4) indices", 7, 5, 2, (int64_t[]){3, 4}, 12);
    check_embedding("embedding 3x70, (40) indices (repeats)", 3, 70, 1, (int64_t[]){40}, 40);
    check_embedding("embedding 50x129, (2, 3, 5) indices", 50, 129, 3, (int64_t[]){2, 3, 5}, 30);
}

/* Many repeats of a few tokens: the weight gradient is the same bits on 1 and 3 threads, and
   each row is gy's rows of its token summed in index order (an f32 sum made here). */
static void test_embedding_deterministic(void **state) {
    (void)state;
    const int64_t V = 4, D = 200, n = 3000;
    int64_t *ix = malloc((size_t)n * sizeof *ix);
    float *g = malloc((size_t)(n * D) * sizeof *g), *want = calloc((size_t)(V * D), sizeof *want);
    uint64_t s = 12345;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        ix[i] = (int64_t)((s >> 33) % (uint64_t)V);
        for (int64_t c = 0; c < D; c++) g[i * D + c] = (float)((int64_t)((s >> (c % 17)) & 1023) - 511) / 97.0f;
        for (int64_t c = 0; c < D; c++) want[ix[i] * D + c] += g[i * D + c];
    }
    ampc_scope_begin();
    ampc_tensor *idx = ampc_tensor_from_i64(1, &n, ix), *gy = ampc_tensor_from_f32(AMPC_F32, 2, (int64_t[]){n, D}, g);
    ampc_tensor *g1 = ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){V, D}), *g3 = ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){V, D});
    ASSERT_NOT_NULL_MSG(idx && gy && g1 && g3);
    int nt = omp_get_max_threads();
    omp_set_num_threads(1);
    ASSERT_OK(ampc__k_embedding_backward(gy, idx, g1));
    omp_set_num_threads(3);
    ASSERT_OK(ampc__k_embedding_backward(gy, idx, g3));
    omp_set_num_threads(nt);
    assert_memory_equal(ampc_tensor_cdata(g1), ampc_tensor_cdata(g3), (size_t)(V * D) * sizeof(float));
    assert_memory_equal(ampc_tensor_cdata(g1), want, (size_t)(V * D) * sizeof(float));
    ampc_scope_end();
    free(ix), free(g), free(want);
}

/* Autocast leaves the rows in the weight's dtype (fp32), and the gradient reaches the weight. */
static void test_embedding_autocast(void **state) {
    (void)state;
    ampc_scope_begin();
    float wv[6] = {1, 2, 3, 4, 5, 6};
    ampc_tensor *w = ampc_tensor_from_f32(AMPC_F32, 2, (int64_t[]){3, 2}, wv);
    ampc_tensor *idx = ampc_tensor_from_i64(1, (int64_t[]){3}, (int64_t[]){2, 0, 2});
    ASSERT_NOT_NULL_MSG(w && idx);
    ASSERT_OK(ampc_tensor_set_requires_grad(w, true));
    ampc_autocast_enter(AMPC_BF16, true);
    ampc_tensor *y = ampc_embedding(idx, w);
    ampc_autocast_exit();
    ASSERT_NOT_NULL_MSG(y);
    assert_int_equal(ampc_tensor_dtype(y), AMPC_F32);
    const float *yv = ampc_tensor_cdata(y);
    const float want[6] = {5, 6, 1, 2, 5, 6};
    assert_memory_equal(yv, want, sizeof want);
    ampc_tensor *loss = ampc_sum(y, AMPC_ALL_DIMS, false);
    ASSERT_NOT_NULL_MSG(loss);
    ASSERT_OK(ampc_backward(loss));
    const float *gw = ampc_tensor_cdata(ampc_tensor_grad(w));
    const float gwant[6] = {1, 1, 0, 0, 2, 2};
    assert_memory_equal(gw, gwant, sizeof gwant);
    ampc_scope_end();
}

static void test_embedding_errors(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *w = ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){3, 2});
    ampc_tensor *w1 = ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){3});
    ampc_tensor *bad = ampc_tensor_from_i64(1, (int64_t[]){2}, (int64_t[]){1, 3});
    ampc_tensor *neg = ampc_tensor_from_i64(1, (int64_t[]){2}, (int64_t[]){-1, 0});
    ampc_tensor *fidx = ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){2});
    ASSERT_NOT_NULL_MSG(w && w1 && bad && neg && fidx);
    assert_null(ampc_embedding(bad, w));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    assert_non_null(strstr(ampc_last_error(), "index 3 at position 1 is out of range [0, 3)"));
    assert_null(ampc_embedding(neg, w));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    assert_null(ampc_embedding(fidx, w));
    assert_int_equal(ampc_last_status(), AMPC_ERR_DTYPE);
    assert_null(ampc_embedding(bad, w1));
    assert_int_equal(ampc_last_status(), AMPC_ERR_SHAPE);
    ampc_clear_error();
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// Attention

typedef struct {
    bool causal;
    double scale, dropout;
    int mask_nd;                      /* 0: no mask; else the mask (the fourth input) has this shape */
    int64_t mask_shape[AMPC_MAX_DIMS];
    bool skip_fd;                     /* large cases: REF against the CPU only */
} attn_ctx;

/* With dropout every call draws from one fixed rng state, so the op is a function of its inputs
   (finite differences) and REF and the CPU drop the same elements */
static ampc_tensor *op_attention(ampc_tensor **in, const void *ctx) {
    const attn_ctx *c = ctx;
    uint64_t seed, offset;
    ampc_rng_get_state(&seed, &offset);
    ampc_rng_set_state(1234, 77);
    ampc_tensor *o = ampc_scaled_dot_product_attention(in[0], in[1], in[2], c->mask_nd ? in[3] : NULL, c->dropout, c->causal, c->scale);
    ampc_rng_set_state(seed, offset);
    return o;
}

static void check_attention(const char *name, int nd, const int64_t *lead, int64_t Tq, int64_t Tk, int64_t E, int64_t Ev,
                            attn_ctx ctx) {
    tu_op_case c = {.name = name, .n_inputs = ctx.mask_nd ? 4 : 3, .ndim = {nd, nd, nd, ctx.mask_nd}, .lo = -1.5, .hi = 1.5,
                    .fn = op_attention, .ctx = &ctx, .k = (double)(E + Tk), .k_backward = (double)(Tq + Tk + E + Ev),
                    .skip_fd = ctx.skip_fd};
    for (int i = 0; i < nd - 2; i++) c.shape[0][i] = c.shape[1][i] = c.shape[2][i] = lead[i];
    c.shape[0][nd - 2] = Tq, c.shape[0][nd - 1] = E;
    c.shape[1][nd - 2] = Tk, c.shape[1][nd - 1] = E;
    c.shape[2][nd - 2] = Tk, c.shape[2][nd - 1] = Ev;
    memcpy(c.shape[3], ctx.mask_shape, sizeof ctx.mask_shape);
    tu_check_op(&c);
}

static void test_attention_op_check(void **state) {
    (void)state;
    check_attention("attention (2,3) heads, 5x5, E 4", 4, (int64_t[]){2, 3}, 5, 5, 4, 4, (attn_ctx){.causal = false});
    check_attention("attention causal, 1x2 heads, 7x7, E 8", 4, (int64_t[]){1, 2}, 7, 7, 8, 8, (attn_ctx){.causal = true});
    check_attention("attention causal, Tq 6 > Tk 4, Ev 3, scale 0.3", 3, (int64_t[]){2}, 6, 4, 5, 3, (attn_ctx){.causal = true, .scale = 0.3});
    check_attention("attention, Tq 3 < Tk 9, one head", 2, NULL, 3, 9, 6, 2, (attn_ctx){.causal = false});
}

/* The additive mask (its gradient included) broadcast every way the layout allows, and dropout
   (the same draws on REF and the CPU; finite differences through fixed draws) */
static void test_attention_mask_dropout_op_check(void **state) {
    (void)state;
    check_attention("attention + mask (5,6) over (2,3) heads", 4, (int64_t[]){2, 3}, 5, 6, 4, 3,
                    (attn_ctx){.mask_nd = 2, .mask_shape = {5, 6}});
    check_attention("attention causal + padding-style mask (2,1,1,7)", 4, (int64_t[]){2, 2}, 7, 7, 4, 4,
                    (attn_ctx){.causal = true, .mask_nd = 4, .mask_shape = {2, 1, 1, 7}});
    check_attention("attention + mask (3,1,5) per head and key, Tq 4, Tk 5", 3, (int64_t[]){3}, 4, 5, 6, 2,
                    (attn_ctx){.scale = 0.4, .mask_nd = 3, .mask_shape = {3, 1, 5}});
    check_attention("attention dropout 0.3, (2,2) heads, 6x6", 4, (int64_t[]){2, 2}, 6, 6, 4, 5, (attn_ctx){.dropout = 0.3});
    check_attention("attention causal dropout 0.5 + mask (9,9), 9x9, E 3", 3, (int64_t[]){2}, 9, 9, 3, 3,
                    (attn_ctx){.causal = true, .dropout = 0.5, .mask_nd = 2, .mask_shape = {9, 9}});
    /* several blocks of query rows (the CPU kernels' blocks are 128 rows; causal ones see
       different key counts), where bf16 takes oneDNN's bf16 matmuls on CPUs with bf16 units */
    check_attention("attention causal dropout 0.2 + mask (200,200), 2 heads, 200x200, E 16", 3, (int64_t[]){2}, 200, 200, 16, 8,
                    (attn_ctx){.causal = true, .dropout = 0.2, .mask_nd = 2, .mask_shape = {200, 200}, .skip_fd = true});
    check_attention("attention, Tq 300 > Tk 130, E 8, Ev 24", 3, (int64_t[]){3}, 300, 130, 8, 24, (attn_ctx){.skip_fd = true});
}

/* The fused op against the same attention composed from other ops - matmul, scale, add the mask,
   causal -inf, softmax, ampc_dropout (whose element (b, i, j) of the (batch, Tq, Tk) probabilities
   takes the same draw (b Tq + i) Tk + j when the rng stands at the same place), matmul - forward
   and the gradients of q, k, v and the mask, on REF (1e-12) and the CPU's f32 (1e-5). A mask of
   -inf on keys >= L gives the attention over the first L keys only, and a row with all keys at
   -inf gives 0. */
static ampc_tensor *composed_attention(ampc_tensor *q, ampc_tensor *k, ampc_tensor *v, ampc_tensor *mask, double p, bool causal,
                                       int64_t Tq, int64_t Tk) {
    ampc_tensor *s = ampc_mul_scalar(ampc_matmul(q, ampc_transpose(k, -1, -2)), 1.0 / sqrt((double)ampc_tensor_dim(q, -1)));
    if (mask) s = ampc_add(s, mask);
    if (causal) {
        double *tri = calloc((size_t)(Tq * Tk), sizeof *tri);
        for (int64_t i = 0; i < Tq; i++)
            for (int64_t j = i + 1; j < Tk; j++) tri[i * Tk + j] = -INFINITY;
        s = ampc_add(s, ampc_tensor_from_f64(ampc_tensor_dtype(q), 2, (int64_t[]){Tq, Tk}, tri));
        free(tri);
    }
    ampc_tensor *pr = ampc_softmax(s, -1);
    if (p > 0) pr = ampc_dropout(pr, p, true);
    return ampc_matmul(pr, v);
}

static void test_attention_composed(void **state) {
    (void)state;
    const ampc_device devs[2] = {AMPC_DEVICE_REF, AMPC_DEVICE_CPU};
    const int64_t B = 2, H = 3, T = 8, E = 4;
    for (int dv = 0; dv < 2; dv++)
        for (int cs = 0; cs < 3; cs++) {
            const bool causal = cs != 1;
            const double p = cs == 0 ? 0.25 : cs == 1 ? 0.6 : 0.0;
            ampc_scope_begin();
            ampc_set_default_device(devs[dv]);
            const ampc_dtype dt = dv ? AMPC_F32 : AMPC_F64;
            ampc_tensor *x[4] = {ampc_tensor_rand(dt, 4, (int64_t[]){B, H, T, E}, -1.5, 1.5), ampc_tensor_rand(dt, 4, (int64_t[]){B, H, T, E}, -1.5, 1.5),
                                 ampc_tensor_rand(dt, 4, (int64_t[]){B, H, T, E}, -1.5, 1.5), ampc_tensor_rand(dt, 4, (int64_t[]){B, 1, T, T}, -2, 2)};
            ampc_tensor *g[2][4], *o[2];
            for (int way = 0; way < 2; way++) {
                for (int i = 0; i < 4; i++) {
                    ASSERT_OK(ampc_tensor_set_requires_grad(x[i], true));
                    ampc_tensor_zero_grad(x[i]);
                }
                ampc_rng_set_state(99, 5);
                o[way] = way ? composed_attention(x[0], x[1], x[2], x[3], p, causal, T, T)
                             : ampc_scaled_dot_product_attention(x[0], x[1], x[2], x[3], p, causal, 0);
                ASSERT_NOT_NULL_MSG(o[way]);
                ampc_tensor *w = ampc_tensor_rand(dt, 4, (int64_t[]){B, H, T, E}, -1, 1);
                ASSERT_OK(ampc_backward(ampc_sum(ampc_mul(o[way], w), AMPC_ALL_DIMS, false)));
                for (int i = 0; i < 4; i++) ASSERT_NOT_NULL_MSG(g[way][i] = ampc_tensor_detach(ampc_tensor_grad(x[i])));
            }
            const double tol = dv ? 1e-5 : 1e-12;
            const char *what[5] = {"o", "dq", "dk", "dv", "dmask"};
            for (int t = 0; t < 5; t++) {
                double *a = tu_values(t ? g[0][t - 1] : o[0]), *b = tu_values(t ? g[1][t - 1] : o[1]), m = 0;
                int64_t n = ampc_tensor_numel(t ? g[0][t - 1] : o[0]);
                for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(b[i]));
                for (int64_t i = 0; i < n; i++)
                    if (!(fabs(a[i] - b[i]) <= tol * m))
                        fail_msg("%s case %d %s[%lld]: fused %.17g, composed %.17g", dv ? "cpu" : "ref", cs, what[t], (long long)i, a[i], b[i]);
                free(a), free(b);
            }
            ampc_set_default_device(AMPC_DEVICE_CPU);
            ampc_scope_end();
        }
}

/* The packed form (q, k, v the parts of one (3, ..., T, E) tensor, GPT's attention) gives the
   unpacked op's output and gradient bit for bit (REF f64, CPU f32 and bf16; causal with dropout,
   two blocks of rows), and refuses a tensor that is not (3, ..., T, E); the door refuses a packed
   descriptor over distinct tensors. */
static void test_attention_packed(void **state) {
    (void)state;
    const ampc_device devs[3] = {AMPC_DEVICE_REF, AMPC_DEVICE_CPU, AMPC_DEVICE_CPU};
    const ampc_dtype dts[3] = {AMPC_F64, AMPC_F32, AMPC_BF16};
    const int64_t shape[5] = {3, 2, 3, 150, 8}, part[4] = {2, 3, 150, 8};
    for (int c = 0; c < 3; c++) {
        ampc_scope_begin();
        ampc_set_default_device(devs[c]);
        ampc_tensor *x = ampc_tensor_rand(dts[c], 5, shape, -1.5, 1.5), *w = ampc_tensor_rand(dts[c], 4, part, -1, 1);
        ASSERT_NOT_NULL_MSG(x && w);
        ASSERT_OK(ampc_tensor_set_requires_grad(x, true));
        ampc_tensor *o[2], *g[2];
        for (int way = 0; way < 2; way++) {
            ampc_tensor_zero_grad(x);
            ampc_rng_set_state(7, 3);
            if (way == 0) {
                o[0] = ampc__attention_packed(x, 0.3, true, 0);
            } else {
                ampc_tensor *qkv[3];
                for (int i = 0; i < 3; i++) qkv[i] = ampc_reshape(ampc_narrow(x, 0, i, 1), 4, part);
                o[1] = ampc_scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], NULL, 0.3, true, 0);
            }
            ASSERT_NOT_NULL_MSG(o[way]);
            ASSERT_OK(ampc_backward(ampc_sum(ampc_mul(o[way], w), AMPC_ALL_DIMS, false)));
            ASSERT_NOT_NULL_MSG(g[way] = ampc_tensor_detach(ampc_tensor_grad(x)));
        }
        for (int t = 0; t < 2; t++) {
            ampc_tensor *a = t ? g[0] : o[0], *b = t ? g[1] : o[1];
            size_t bytes = (size_t)ampc_tensor_numel(a) * ampc_dtype_size(ampc_tensor_dtype(a));
            assert_int_equal(ampc_tensor_numel(a), ampc_tensor_numel(b));
            if (memcmp(ampc_tensor_cdata(a), ampc_tensor_cdata(b), bytes))
                fail_msg("%s %s: the packed %s differs from the unpacked one's", ampc_device_name(devs[c]), ampc_dtype_name(dts[c]),
                         t ? "gradient" : "output");
        }
        ampc_set_default_device(AMPC_DEVICE_CPU);
        ampc_scope_end();
    }
    ampc_scope_begin();
    ampc_tensor *bad = ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){2, 3, 5, 4});
    ASSERT_NOT_NULL_MSG(bad);
    assert_null(ampc__attention_packed(bad, 0, true, 0));
    assert_int_equal(ampc_last_status(), AMPC_ERR_SHAPE);
    assert_non_null(strstr(ampc_last_error(), "expected (3, ..., T, E)"));
    ampc_tensor *q = ampc_tensor_zeros(AMPC_F32, 3, (int64_t[]){2, 5, 4}), *o = ampc_tensor_zeros(AMPC_F32, 3, (int64_t[]){2, 5, 4});
    ampc_tensor *k = ampc_tensor_zeros(AMPC_F32, 3, (int64_t[]){2, 5, 4});
    ampc_attn_desc d = {.batch = 2, .Tq = 5, .Tk = 5, .E = 4, .Ev = 4, .scale = 0.5, .packed = true};
    ASSERT_NOT_NULL_MSG(q && o && k);
    assert_int_equal(ampc__k_attention(&d, q, k, q, NULL, o, NULL), AMPC_ERR_INVALID);
    assert_non_null(strstr(ampc_last_error(), "packed attention takes one tensor"));
    ampc_clear_error();
    ampc_scope_end();
}

/* -inf in the mask hides keys exactly: the attention over the first L keys, and 0 for a row
   that sees none (REF and CPU) */
static void test_attention_mask_hides(void **state) {
    (void)state;
    const ampc_device devs[2] = {AMPC_DEVICE_REF, AMPC_DEVICE_CPU};
    const int64_t Tq = 5, Tk = 7, L = 4, E = 3;
    for (int dv = 0; dv < 2; dv++) {
        ampc_scope_begin();
        ampc_set_default_device(devs[dv]);
        const ampc_dtype dt = dv ? AMPC_F32 : AMPC_F64;
        double mk[5 * 7];
        for (int64_t i = 0; i < Tq; i++)
            for (int64_t j = 0; j < Tk; j++) mk[i * Tk + j] = i == 2 ? -INFINITY : j >= L ? -INFINITY : 0.0;
        ampc_tensor *q = ampc_tensor_rand(dt, 3, (int64_t[]){2, Tq, E}, -1, 1), *k = ampc_tensor_rand(dt, 3, (int64_t[]){2, Tk, E}, -1, 1);
        ampc_tensor *v = ampc_tensor_rand(dt, 3, (int64_t[]){2, Tk, E}, -1, 1);
        ampc_tensor *mask = ampc_tensor_from_f64(dt, 2, (int64_t[]){Tq, Tk}, mk);
        ampc_tensor *o = ampc_scaled_dot_product_attention(q, k, v, mask, 0, false, 0);
        ampc_tensor *oL = ampc_scaled_dot_product_attention(q, ampc_narrow(k, 1, 0, L), ampc_narrow(v, 1, 0, L), NULL, 0, false, 0);
        ASSERT_NOT_NULL_MSG(o && oL);
        double *a = tu_values(o), *b = tu_values(oL);
        for (int64_t h = 0; h < 2; h++)
            for (int64_t i = 0; i < Tq; i++)
                for (int64_t e = 0; e < E; e++) {
                    int64_t at = (h * Tq + i) * E + e;
                    double want = i == 2 ? 0.0 : b[at];
                    if (!(fabs(a[at] - want) <= (dv ? 1e-6 : 1e-15)))
                        fail_msg("%s head %lld row %lld [%lld]: %.9g, expected %.9g", dv ? "cpu" : "ref", (long long)h, (long long)i,
                                 (long long)e, a[at], want);
                }
        free(a), free(b);
        ampc_set_default_device(AMPC_DEVICE_CPU);
        ampc_scope_end();
    }
}

/* Against PyTorch 1.13 (Debian's python3-torch; no F.scaled_dot_product_attention there, so the
   formula composed), q, k, v = sin(a (i + 1)) over their elements, a = 0.7, 1.3, 0.4:
     s = q @ k.transpose(-1, -2) / math.sqrt(2)
     if causal: s = s.masked_fill(~torch.ones(3, 4).tril().bool(), float('-inf'))
     o = torch.softmax(s, -1) @ v        # q (1,2,3,2), k (1,2,4,2), v (1,2,4,3), float64
   The default scale and the causal mask's top-left alignment (Tq 3 < Tk 4) as PyTorch's; REF to
   1e-14, the CPU's f32 within 2^-24 times the reduction length (4 keys, 2-wide dots) and 10. */
static void test_attention_pytorch(void **state) {
    (void)state;
    static const double want[2][18] = {
        {0.2755195268929044, 0.22007023599746128, 0.12987669374363797, 0.21019299085747722, 0.1815087026581347, 0.12416818132347418,
         0.27280969689837187, 0.16615724672654147, 0.033272220763089944, 0.30792599231420553, 0.39772378013967113, 0.4247297282338549,
         0.15103459485946139, 0.1860868822581384, 0.19176014262769583, 0.2525001715652093, 0.25804046425510613, 0.22284184143433836},
        {0.3894183423086505, 0.7173560908995228, 0.9320390859672264, 0.5161008050020741, 0.7572075888585605, 0.8787679439191133,
         0.7790538848463198, 0.7157419970527562, 0.5394301856637232, -0.8834546557201531, -0.6312666378723208, -0.27941549819892586,
         -0.4144986841657316, -0.10351500918024253, 0.22381140966618696, -0.021543315176697345, 0.2870184608898552, 0.5502663329454732},
    };
    double qv[12], kv[16], vv[24];
    for (int i = 0; i < 24; i++) {
        if (i < 12) qv[i] = sin(0.7 * (i + 1));
        if (i < 16) kv[i] = sin(1.3 * (i + 1));
        vv[i] = sin(0.4 * (i + 1));
    }
    const ampc_device devs[2] = {AMPC_DEVICE_REF, AMPC_DEVICE_CPU};
    for (int dv = 0; dv < 2; dv++)
        for (int causal = 0; causal < 2; causal++) {
            ampc_scope_begin();
            ampc_set_default_device(devs[dv]);
            ampc_dtype dt = dv ? AMPC_F32 : AMPC_F64;
            ampc_tensor *q = ampc_tensor_from_f64(dt, 4, (int64_t[]){1, 2, 3, 2}, qv);
            ampc_tensor *k = ampc_tensor_from_f64(dt, 4, (int64_t[]){1, 2, 4, 2}, kv);
            ampc_tensor *v = ampc_tensor_from_f64(dt, 4, (int64_t[]){1, 2, 4, 3}, vv);
            ampc_tensor *o = ampc_scaled_dot_product_attention(q, k, v, NULL, 0, causal, 0);
            ASSERT_NOT_NULL_MSG(o);
            double *got = tu_values(o), tol = dv ? 10 * 0x1p-24 * 6 : 1e-14;
            for (int i = 0; i < 18; i++)
                if (fabs(got[i] - want[causal][i]) > tol)
                    fail_msg("%s causal %d [%d]: %.17g, PyTorch %.17g", dv ? "cpu" : "ref", causal, i, got[i], want[causal][i]);
            free(got);
            ampc_set_default_device(AMPC_DEVICE_CPU);
            ampc_scope_end();
        }
}

/* Bad shapes and dtypes are named; autocast runs it in the lower precision. */
static void test_attention_errors_autocast(void **state) {
    (void)state;
    ampc_scope_begin();
    ampc_tensor *q = ampc_tensor_rand(AMPC_F32, 3, (int64_t[]){2, 4, 8}, -1, 1), *k = ampc_tensor_rand(AMPC_F32, 3, (int64_t[]){2, 5, 8}, -1, 1);
    ampc_tensor *v = ampc_tensor_rand(AMPC_F32, 3, (int64_t[]){2, 5, 3}, -1, 1), *kb = ampc_tensor_rand(AMPC_F32, 3, (int64_t[]){2, 4, 7}, -1, 1);
    ampc_tensor *vh = ampc_tensor_rand(AMPC_BF16, 3, (int64_t[]){2, 5, 3}, -1, 1);
    ASSERT_NOT_NULL_MSG(q && k && v && kb && vh);
    assert_null(ampc_scaled_dot_product_attention(q, kb, v, NULL, 0, false, 0));
    assert_int_equal(ampc_last_status(), AMPC_ERR_SHAPE);
    assert_null(ampc_scaled_dot_product_attention(q, k, vh, NULL, 0, false, 0));
    assert_int_equal(ampc_last_status(), AMPC_ERR_DTYPE);
    assert_null(ampc_scaled_dot_product_attention(q, k, v, NULL, 0, false, -1));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    assert_null(ampc_scaled_dot_product_attention(q, k, v, NULL, 1.5, false, 0));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    assert_non_null(strstr(ampc_last_error(), "dropout_p 1.5"));
    /* masks that do not broadcast to the scores (2, 4, 5), or are not float */
    ampc_tensor *bad_masks[] = {ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){4, 4}), ampc_tensor_zeros(AMPC_F32, 3, (int64_t[]){3, 4, 5}),
                                ampc_tensor_zeros(AMPC_F32, 4, (int64_t[]){1, 2, 4, 5}), ampc_tensor_zeros(AMPC_I64, 1, (int64_t[]){5})};
    for (int i = 0; i < 4; i++) {
        ASSERT_NOT_NULL_MSG(bad_masks[i]);
        assert_null(ampc_scaled_dot_product_attention(q, k, v, bad_masks[i], 0, false, 0));
        assert_int_equal(ampc_last_status(), i < 3 ? AMPC_ERR_SHAPE : AMPC_ERR_DTYPE);
        assert_non_null(strstr(ampc_last_error(), "attn_mask"));
    }
    /* the door: a descriptor that does not fit the tensors, a backward without the statistics */
    ampc_attn_desc d = {.batch = 2, .Tq = 4, .Tk = 5, .E = 8, .Ev = 3, .scale = 0.5}, bad = d, lay = d;
    bad.Tk = 6;
    lay.nlead = 1, lay.lead[0] = 2, lay.mask_lead[0] = 20, lay.mask_si = 5, lay.mask_sj = 1;
    ampc_tensor *out = ampc_tensor_zeros(AMPC_F32, 3, (int64_t[]){2, 4, 3});
    ASSERT_NOT_NULL_MSG(out);
    ASSERT_OK(ampc__k_attention(&d, q, k, v, NULL, out, NULL));
    assert_int_equal(ampc__k_attention(&bad, q, k, v, NULL, out, NULL), AMPC_ERR_SHAPE);
    assert_non_null(strstr(ampc_last_error(), "k has 80 elements, expected 96"));
    assert_int_equal(ampc__k_attention_backward(&d, q, k, v, NULL, NULL, out, q, k, v, NULL), AMPC_ERR_INVALID);
    assert_non_null(strstr(ampc_last_error(), "lse missing"));
    /* a mask smaller than its layout reads, a layout that is not the batch's, a mask in f16 */
    ampc_tensor *m39 = ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){39}), *m40 = ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){40});
    ampc_tensor *m40h = ampc_tensor_zeros(AMPC_F16, 1, (int64_t[]){40});
    ASSERT_NOT_NULL_MSG(m39 && m40 && m40h);
    ASSERT_OK(ampc__k_attention(&lay, q, k, v, m40, out, NULL));
    assert_int_equal(ampc__k_attention(&lay, q, k, v, m39, out, NULL), AMPC_ERR_SHAPE);
    assert_non_null(strstr(ampc_last_error(), "reads element 39"));
    assert_int_equal(ampc__k_attention(&d, q, k, v, m40, out, NULL), AMPC_ERR_INVALID);
    assert_non_null(strstr(ampc_last_error(), "does not describe 2 heads"));
    assert_int_equal(ampc__k_attention(&lay, q, k, v, m40h, out, NULL), AMPC_ERR_DTYPE);
    ampc_clear_error();
    ampc_autocast_enter(AMPC_BF16, true);
    ampc_tensor *o = ampc_scaled_dot_product_attention(q, k, vh, NULL, 0, true, 0);
    ampc_autocast_exit();
    ASSERT_NOT_NULL_MSG(o);
    assert_int_equal(ampc_tensor_dtype(o), AMPC_BF16);
    assert_int_equal(ampc_tensor_dim(o, 2), 3);
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// narrow: GPT's split of the fused q, k, v projection

typedef struct {
    int dim;
    int64_t start, length;
} narrow_ctx;

static ampc_tensor *op_narrow(ampc_tensor **in, const void *ctx) {
    const narrow_ctx *c = ctx;
    return ampc_narrow(in[0], c->dim, c->start, c->length);
}

static void test_narrow(void **state) {
    (void)state;
    const struct { const char *name; int nd; int64_t shape[3]; narrow_ctx c; } cs[] = {
        {"narrow (4,6,9) dim 2 [3, 6)", 3, {4, 6, 9}, {2, 3, 3}}, {"narrow (4,6,9) dim 0 [1, 4)", 3, {4, 6, 9}, {0, 1, 3}},
        {"narrow (5,7) dim -1 [0, 7)", 2, {5, 7}, {-1, 0, 7}},   {"narrow (5,7) dim 1 [2, 2)", 2, {5, 7}, {1, 2, 0}},
    };
    for (size_t i = 0; i < sizeof cs / sizeof *cs; i++) {
        tu_op_case c = {.name = cs[i].name, .n_inputs = 1, .ndim = {cs[i].nd}, .lo = -2, .hi = 2, .fn = op_narrow, .ctx = &cs[i].c, .k = 1};
        memcpy(c.shape[0], cs[i].shape, sizeof cs[i].shape);
        tu_check_op(&c);
    }
    ampc_scope_begin();
    ampc_tensor *x = ampc_tensor_from_f32(AMPC_F32, 2, (int64_t[]){2, 4}, (const float[]){0, 1, 2, 3, 4, 5, 6, 7});
    ampc_tensor *y = ampc_narrow(x, 1, 1, 2);
    ASSERT_NOT_NULL_MSG(x && y);
    assert_memory_equal(ampc_tensor_cdata(y), ((const float[]){1, 2, 5, 6}), 4 * sizeof(float));
    assert_null(ampc_narrow(x, 1, 3, 2));
    assert_int_equal(ampc_last_status(), AMPC_ERR_SHAPE);
    assert_null(ampc_narrow(x, 2, 0, 1));
    ampc_clear_error();
    ampc_scope_end();
}

// ---------------------------------------------------------------------------------------------
// CausalSelfAttention against nanoGPT's, run by PyTorch 1.13 (tests/fixtures/make_causal_attention.py)

/* Runs m (its parameters set) on x = sin(0.11 (i + 1)) of shape (2, 5, 8) on dev, backward of the
   loss sum(y * r), r = cos(0.05 (i + 1)), and compares y, x's gradient and each of the np
   parameters' (names) with the fixture's sections in that order: REF within 1e-12 of each
   section's largest value, the CPU's f32 within 1e-5 of it (issue 30's bound for fp32 logits). */
static void check_module_fixture(ampc_module *m, ampc_device dev, const char *fixture, ampc_tensor **p, const char **names,
                                 int np) {
    const bool ref = dev == AMPC_DEVICE_REF;
    ampc_scope_begin();
    ampc_dtype dt = ref ? AMPC_F64 : AMPC_F32;
    ampc_set_default_device(dev);
    ampc_tensor *x = ampc_tensor_zeros(dt, 3, (int64_t[]){2, 5, 8}), *r = ampc_tensor_zeros(dt, 3, (int64_t[]){2, 5, 8});
    ampc_set_default_device(AMPC_DEVICE_CPU);
    ASSERT_NOT_NULL_MSG(x && r);
    tu_fill_formula(x, 0.11, 1.0, false);
    tu_fill_formula(r, 0.05, 1.0, true);
    ASSERT_OK(ampc_tensor_set_requires_grad(x, true));
    ampc_tensor *y = ampc_module_forward(m, x);
    ASSERT_NOT_NULL_MSG(y);
    ASSERT_OK(ampc_backward(ampc_sum(ampc_mul(y, r), AMPC_ALL_DIMS, false)));
    FILE *f = tu_open_fixture(fixture);
    for (int s = -2; s < np; s++) {
        const ampc_tensor *t = s == -2 ? y : s == -1 ? ampc_tensor_grad(x) : ampc_tensor_grad(p[s]);
        const char *name = s == -2 ? "y" : s == -1 ? "gx" : names[s];
        ASSERT_NOT_NULL_MSG(t);
        int64_t n = ampc_tensor_numel(t);
        double *want = tu_read_section(f, name, n), *g = tu_values(t), big = 0;
        for (int64_t i = 0; i < n; i++) big = fabs(want[i]) > big ? fabs(want[i]) : big;
        for (int64_t i = 0; i < n; i++)
            if (fabs(g[i] - want[i]) > (ref ? 1e-12 : 1e-5) * big)
                fail_msg("%s %s[%lld]: %.10g, PyTorch %.10g", ref ? "ref" : "cpu", name, (long long)i, g[i], want[i]);
        free(want), free(g);
    }
    fclose(f);
    ampc_scope_end();
}

/* The module's output, the input's gradient and every parameter's against PyTorch's (f64
   there), by check_module_fixture. */
static void test_causal_self_attention_pytorch(void **state) {
    (void)state;
    const ampc_device devs[2] = {AMPC_DEVICE_REF, AMPC_DEVICE_CPU};
    for (int dv = 0; dv < 2; dv++) {
        ampc_set_default_device(devs[dv]);
        ampc_module *m = ampc_causal_self_attention_new(8, 2, true, 0.0);
        ampc_set_default_device(AMPC_DEVICE_CPU);
        ASSERT_NOT_NULL_MSG(m);
        assert_string_equal(ampc_module_type(m), "CausalSelfAttention");
        ampc_tensor **p;
        const char **names;
        assert_int_equal(ampc_module_parameters(m, &p, &names), 4);
        static const char *const want_names[4] = {"c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias"};
        static const double a[4] = {0.37, 0.23, 0.53, 0.31}, amp[4] = {0.3, 0.1, 0.3, 0.1};
        for (int i = 0; i < 4; i++) {
            assert_string_equal(names[i], want_names[i]);
            tu_fill_formula(p[i], a[i], amp[i], i % 2 == 1);
        }
        check_module_fixture(m, devs[dv], "causal_attention.txt", p, names, 4);
        ampc_module_free(m);
    }
    assert_null(ampc_causal_self_attention_new(10, 3, true, 0));
    assert_int_equal(ampc_last_status(), AMPC_ERR_INVALID);
    ampc_clear_error();
}

/* nanoGPT's Block (tests/fixtures/make_gpt_block.py): parameter k of the state_dict is
   0.2 sin((0.17 + 0.09 k) (i + 1)), plus 1 for the LayerNorm weights; bounds as above. */
static void test_gpt_block_pytorch(void **state) {
    (void)state;
    const ampc_device devs[2] = {AMPC_DEVICE_REF, AMPC_DEVICE_CPU};
    for (int dv = 0; dv < 2; dv++) {
        ampc_set_default_device(devs[dv]);
        ampc_module *m = ampc_gpt_block_new(8, 2, true, 0.0);
        ampc_set_default_device(AMPC_DEVICE_CPU);
        ASSERT_NOT_NULL_MSG(m);
        ampc_tensor **p;
        const char **names;
        int np = ampc_module_parameters(m, &p, &names);
        assert_int_equal(np, 12);
        for (int k = 0; k < np; k++) {
            tu_fill_formula(p[k], 0.17 + 0.09 * k, 0.2, false);
            if (!strncmp(names[k], "ln_", 3) && strstr(names[k], "weight")) {
                ampc_scope_begin();
                ampc_tensor *one = ampc_add_scalar(p[k], 1.0);
                memcpy(ampc_tensor_data(p[k]), ampc_tensor_cdata(one), (size_t)ampc_tensor_numel(p[k]) * ampc_dtype_size(ampc_tensor_dtype(p[k])));
                ampc_scope_end();
            }
        }
        check_module_fixture(m, devs[dv], "gpt_block.txt", p, names, np);
        ampc_module_free(m);
    }
    ampc_module *nb = ampc_gpt_block_new(8, 2, false, 0.0);   /* bias off: no bias anywhere */
    ASSERT_NOT_NULL_MSG(nb);
    assert_int_equal(ampc_module_parameters(nb, NULL, NULL), 6);
    ampc_module_free(nb);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_embedding_op_check),
        cmocka_unit_test(test_embedding_deterministic),
        cmocka_unit_test(test_embedding_autocast),
        cmocka_unit_test(test_embedding_errors),
        cmocka_unit_test(test_attention_op_check),
        cmocka_unit_test(test_attention_mask_dropout_op_check),
        cmocka_unit_test(test_attention_composed),
        cmocka_unit_test(test_attention_mask_hides),
        cmocka_unit_test(test_attention_packed),
        cmocka_unit_test(test_attention_pytorch),
        cmocka_unit_test(test_attention_errors_autocast),
        cmocka_unit_test(test_narrow),
        cmocka_unit_test(test_causal_self_attention_pytorch),
        cmocka_unit_test(test_gpt_block_pytorch),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
