/*
 * test_embedding.c - ampc_embedding: forward and backward against REF in every CPU dtype with
 * finite differences on REF (CUDA has no embedding kernels yet: the op refuses there); repeated indices summed in
 * index order to the same bits on 1 and 3 threads; the weight's dtype kept under autocast; bad
 * indices refused by name.
 */
#include "testutil.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"

static ampc_tensor *op_embedding(ampc_tensor **in, const void *ctx) {
    (void)ctx;
    return ampc_embedding(in[1], in[0]);
}

/* weight (V, D) first (the input with a gradient), then the indices of shape ish */
static void check_embedding(const char *name, int64_t V, int64_t D, int ind, const int64_t *ish, int64_t n) {
    tu_op_case c = {.name = name, .n_inputs = 2, .ndim = {2, ind}, .is_label = {false, true}, .n_classes = V,
                    .lo = -2, .hi = 2, .fn = op_embedding, .k = 1, .k_backward = (double)n,
                    .no_cuda = "the CUDA embedding kernels come with the next GPU session (issue 30)"};
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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_embedding_op_check),
        cmocka_unit_test(test_embedding_deterministic),
        cmocka_unit_test(test_embedding_autocast),
        cmocka_unit_test(test_embedding_errors),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
