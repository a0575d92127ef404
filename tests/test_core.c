/*
 * test_core.c - tensors, scopes, views, errors and the caching allocator's accounting.
 */
#include "testutil.h"

#include <math.h>
#include <string.h>

#include "core/core.h"

static void ampc__philox_public_kat(uint32_t out[4]) { ampc__philox(0, 0, out); }

static void test_create_and_read(void **state) {
    (void)state;
    ampc_scope_begin();
    float data[6] = {1, -2, 3.5f, 0, 1e-3f, 65504};
    for (int dt = AMPC_F32; dt <= AMPC_BF16; dt++) {
        ampc_tensor *t = ampc_tensor_from_f32((ampc_dtype)dt, 2, (int64_t[]){2, 3}, data);
        ASSERT_NOT_NULL_MSG(t);
        assert_int_equal(ampc_tensor_numel(t), 6);
        assert_int_equal(ampc_tensor_dim(t, -1), 3);
        float out[6];
        ASSERT_OK(ampc_tensor_to_f32(t, out, 6));
        for (int i = 0; i < 6; i++) {
            assert_true(out[i] == (float)tu_round_to((ampc_dtype)dt, data[i]));
        }
    }
    ampc_tensor *z = ampc_tensor_full(AMPC_BF16, 1, (int64_t[]){5}, 2.5);
    double v[5];
    ASSERT_OK(ampc_tensor_to_f64(z, v, 5));
    for (int i = 0; i < 5; i++) assert_true(v[i] == 2.5);
    ampc_scope_end();
}

static void test_scope_releases(void **state) {
    (void)state;
    size_t base = ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS];
    ampc_scope_begin();
    ampc_tensor *a = ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){100, 100});
    ASSERT_NOT_NULL_MSG(a);
    ampc_tensor *kept = NULL;
    ampc_scope_begin();
    ampc_tensor_zeros(AMPC_F32, 1, (int64_t[]){1000});
    kept = ampc_tensor_keep(ampc_tensor_full(AMPC_F32, 1, (int64_t[]){10}, 7.0));
    assert_int_equal(ampc_scope_depth(), 2);
    ampc_scope_end();
    assert_true(ampc_tensor_item(ampc_reshape(kept, 2, (int64_t[]){1, -1})) != 0); /* kept is alive */
    assert_true(ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS] >= base + 40000);
    ampc_scope_end();
    assert_int_equal(ampc_memory_stats().current[AMPC_MEM_ACTIVATIONS], base);
}

static void test_own_and_free(void **state) {
    (void)state;
    size_t base = ampc_memory_stats().current_total;
    ampc_tensor *t = ampc_tensor_own(ampc_tensor_zeros(AMPC_F16, 1, (int64_t[]){4096}));
    ampc_scope_begin();
    ampc_scope_end();   /* not in this scope, nor in any: still alive */
    assert_int_equal(ampc_memory_stats().current_total, base + 8192);
    ampc_tensor_free(t);
    assert_int_equal(ampc_memory_stats().current_total, base);
}

static void test_allocator_caches_and_counts_peak(void **state) {
    (void)state;
    ampc_memory_reset_peak();
    ampc_memory_stats_t s0 = ampc_memory_stats();
    for (int i = 0; i < 5; i++) {
        ampc_scope_begin();
        ampc_tensor_empty(AMPC_F32, 1, (int64_t[]){1 << 16});
        ampc_tensor_empty(AMPC_F32, 1, (int64_t[]){1 << 16});
        ampc_scope_end();
    }
    ampc_memory_stats_t s1 = ampc_memory_stats();
    assert_int_equal(s1.n_alloc - s0.n_alloc, 10);
    assert_true(s1.n_malloc - s0.n_malloc <= 2);   /* steady state: served from the cache */
    assert_int_equal(s1.peak_total - s0.current_total, 2 * 4 * (1 << 16));
    assert_int_equal(s1.current_total, s0.current_total);
}

/* Large blocks are carved from segments: memory freed by one size serves requests of other
   sizes (split), neighbours merge back, and emptying the cache returns whole segments. */
static void test_allocator_large_blocks_reuse(void **state) {
    (void)state;
    const ampc_device dev = AMPC_DEVICE_CPU;
    const size_t MiB = (size_t)1 << 20;
    ampc_memory_empty_cache();
    ampc_memory_stats_t s0 = ampc_memory_stats();
    size_t b6 = 0, b3a = 0, b3b = 0, b2 = 0;
    void *p6 = ampc__alloc(dev, 6 * MiB, AMPC_MEM_WORKSPACE, &b6);
    ASSERT_NOT_NULL_MSG(p6);
    assert_int_equal(b6, ampc__mem_block_size(6 * MiB));
    ampc__free(dev, p6, b6, AMPC_MEM_WORKSPACE);
    uint64_t m1 = ampc_memory_stats().n_malloc;
    /* two 3 MiB blocks and a 2 MiB one fit in the freed segment: no new system memory */
    void *p3a = ampc__alloc(dev, 3 * MiB, AMPC_MEM_WORKSPACE, &b3a);
    void *p3b = ampc__alloc(dev, 3 * MiB, AMPC_MEM_WORKSPACE, &b3b);
    void *p2 = ampc__alloc(dev, 2 * MiB, AMPC_MEM_WORKSPACE, &b2);
    ASSERT_NOT_NULL_MSG(p3a);
    ASSERT_NOT_NULL_MSG(p3b);
    ASSERT_NOT_NULL_MSG(p2);
    assert_int_equal(ampc_memory_stats().n_malloc, m1);
    /* disjoint */
    char *lo[3] = {p3a, p3b, p2};
    size_t len[3] = {3 * MiB, 3 * MiB, 2 * MiB};
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++)
            if (i != j) assert_true(lo[i] + len[i] <= lo[j] || lo[j] + len[j] <= lo[i]);
    memset(p3a, 1, 3 * MiB);
    memset(p3b, 2, 3 * MiB);
    memset(p2, 3, 2 * MiB);
    ampc__free(dev, p3a, b3a, AMPC_MEM_WORKSPACE);
    ampc__free(dev, p3b, b3b, AMPC_MEM_WORKSPACE);
    /* the two neighbours merged: a 6 MiB request fits again without a new segment */
    void *p6b = ampc__alloc(dev, 6 * MiB, AMPC_MEM_WORKSPACE, &b6);
    ASSERT_NOT_NULL_MSG(p6b);
    assert_int_equal(ampc_memory_stats().n_malloc, m1);
    ampc__free(dev, p6b, b6, AMPC_MEM_WORKSPACE);
    ampc__free(dev, p2, b2, AMPC_MEM_WORKSPACE);
    ampc_memory_stats_t s1 = ampc_memory_stats();
    assert_int_equal(s1.current_total, s0.current_total);
    assert_true(s1.cached > 0);
    ampc_memory_empty_cache();
    assert_int_equal(ampc_memory_stats().cached, 0);
}

/* Random sizes from 64 B to 24 MiB, allocated and freed in random order: every live block
   keeps its own fill pattern (no two blocks overlap), and the counts return to where they
   started. */
static void test_allocator_random_stress(void **state) {
    (void)state;
    enum { SLOTS = 24, OPS = 600 };
    const ampc_device dev = AMPC_DEVICE_CPU;
    void *p[SLOTS] = {0};
    size_t bytes[SLOTS] = {0}, req[SLOTS] = {0};
    uint64_t rs = 12345;
    ampc_memory_stats_t s0 = ampc_memory_stats();
    for (int op = 0; op < OPS; op++) {
        int i = (int)tu_uniform(&rs, 0, SLOTS);
        if (p[i]) {
            const unsigned char *c = p[i];
            /* first, last and a middle byte carry the slot's pattern */
            assert_int_equal(c[0], (unsigned char)(i + 1));
            assert_int_equal(c[req[i] - 1], (unsigned char)(i + 1));
            assert_int_equal(c[req[i] / 2], (unsigned char)(i + 1));
            ampc__free(dev, p[i], bytes[i], AMPC_MEM_WORKSPACE);
            p[i] = NULL;
        } else {
            double e = tu_uniform(&rs, 6, 24.6);   /* log2 of the size */
            req[i] = (size_t)exp2(e);
            p[i] = ampc__alloc(dev, req[i], AMPC_MEM_WORKSPACE, &bytes[i]);
            ASSERT_NOT_NULL_MSG(p[i]);
            assert_true(bytes[i] >= req[i]);
            assert_int_equal((uintptr_t)p[i] % 64, 0);
            memset(p[i], i + 1, req[i]);
        }
    }
    for (int i = 0; i < SLOTS; i++)
        if (p[i]) ampc__free(dev, p[i], bytes[i], AMPC_MEM_WORKSPACE);
    assert_int_equal(ampc_memory_stats().current_total, s0.current_total);
    ampc_memory_empty_cache();
    assert_int_equal(ampc_memory_stats().cached, 0);
}

static void test_memory_limit(void **state) {
    (void)state;
    size_t in_use = ampc_memory_stats().current_total;
    ampc_memory_set_limit(in_use + (1 << 20));
    ampc_scope_begin();
    ampc_tensor *ok = ampc_tensor_empty(AMPC_F32, 1, (int64_t[]){1 << 17});   /* 512 KiB */
    ASSERT_NOT_NULL_MSG(ok);
    ampc_tensor *too_big = ampc_tensor_empty(AMPC_F32, 1, (int64_t[]){1 << 18});  /* 1 MiB more */
    assert_null(too_big);
    assert_int_equal(ampc_last_status(), AMPC_ERR_OOM);
    assert_non_null(strstr(ampc_last_error(), "out of memory"));
    assert_non_null(strstr(ampc_last_error(), "limit"));
    ampc_scope_end();
    ampc_memory_set_limit(0);
    ampc_clear_error();
}

static void test_bad_shapes_and_views(void **state) {
    (void)state;
    ampc_scope_begin();
    assert_null(ampc_tensor_empty(AMPC_F32, 2, (int64_t[]){-1, 3}));
    assert_int_equal(ampc_last_status(), AMPC_ERR_SHAPE);
    assert_null(ampc_tensor_empty(AMPC_F64, 1, (int64_t[]){3}));   /* CPU holds no f64 */
    assert_int_equal(ampc_last_status(), AMPC_ERR_DTYPE);
    ampc_tensor *a = ampc_tensor_rand(AMPC_F32, 2, (int64_t[]){4, 6}, -1, 1);
    ampc_tensor *r = ampc_reshape(a, 3, (int64_t[]){2, -1, 3});
    ASSERT_NOT_NULL_MSG(r);
    assert_int_equal(ampc_tensor_dim(r, 1), 4);
    assert_ptr_equal(ampc_tensor_data(r), ampc_tensor_data(a));   /* a view */
    assert_null(ampc_reshape(a, 2, (int64_t[]){5, 5}));
    assert_int_equal(ampc_last_status(), AMPC_ERR_SHAPE);
    assert_non_null(strstr(ampc_last_error(), "(4, 6)"));
    ampc_tensor *f = ampc_flatten(r, 1, -1);
    assert_int_equal(ampc_tensor_ndim(f), 2);
    assert_int_equal(ampc_tensor_dim(f, 1), 12);
    assert_null(ampc_reshape(NULL, 1, (int64_t[]){1}));   /* keeps the earlier error */
    assert_int_equal(ampc_last_status(), AMPC_ERR_SHAPE);
    ampc_clear_error();
    ampc_scope_end();
}

static void test_rng_reproducible(void **state) {
    (void)state;
    ampc_scope_begin();
    double a[64], b[64], c[64];
    ampc_manual_seed(7);
    ampc_tensor_to_f64(ampc_tensor_randn(AMPC_F32, 1, (int64_t[]){64}, 0, 1), a, 64);
    ampc_manual_seed(7);
    ampc_tensor_to_f64(ampc_tensor_randn(AMPC_F32, 1, (int64_t[]){64}, 0, 1), b, 64);
    ampc_tensor_to_f64(ampc_tensor_randn(AMPC_F32, 1, (int64_t[]){64}, 0, 1), c, 64);
    double mean = 0;
    for (int i = 0; i < 64; i++) {
        assert_true(a[i] == b[i]);
        mean += c[i] / 64;
    }
    assert_true(memcmp(b, c, sizeof b) != 0);
    assert_true(fabs(mean) < 0.5);   /* 4 sigma for 64 standard normals */
    ampc_scope_end();
}

/* ampc_tensor_copy_: values converted as ampc_f32_to_f16/bf16 round them, across memory formats
   (the logical order kept) and from i64; a wrong shape, and a destination that requires grad
   outside no-grad, refused with dst untouched. */
static void test_copy_in_place(void **state) {
    (void)state;
    ampc_scope_begin();
    float data[24];
    for (int i = 0; i < 24; i++) data[i] = (float)(i - 11) * 1.37f + 1e-3f * (float)i;
    const int64_t shape[4] = {1, 4, 2, 3};
    ampc_tensor *src = ampc_tensor_from_f32(AMPC_F32, 4, shape, data);
    for (int dt = AMPC_F32; dt <= AMPC_BF16; dt++) {
        for (int cl = 0; cl < 2; cl++) {
            ampc_tensor *dst = ampc_tensor_zeros((ampc_dtype)dt, 4, shape);
            if (cl) dst = ampc_to_memory_format(dst, AMPC_CHANNELS_LAST);
            ASSERT_NOT_NULL_MSG(dst);
            ASSERT_OK(ampc_tensor_copy_(dst, src));
            float out[24];
            ASSERT_OK(ampc_tensor_to_f32(dst, out, 24));
            for (int i = 0; i < 24; i++) {
                assert_true(out[i] == (float)tu_round_to((ampc_dtype)dt, data[i]));
            }
        }
    }
    int64_t counts[3] = {0, 7, (INT64_C(1) << 40) + 3};   /* beyond f32's integers: copied as integers */
    ampc_tensor *ci = ampc_tensor_from_i64(1, (int64_t[]){3}, counts);
    ampc_tensor *di = ampc_tensor_from_i64(1, (int64_t[]){3}, (int64_t[]){5, 5, 5});
    ASSERT_OK(ampc_tensor_copy_(di, ci));
    assert_memory_equal(ampc_tensor_cdata(di), counts, sizeof counts);
    ampc_tensor *small = ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){4, 6});
    assert_true(ampc_tensor_copy_(small, src) == AMPC_ERR_SHAPE);
    ampc_clear_error();
    ampc_tensor *w = ampc_tensor_zeros(AMPC_F32, 4, shape);
    ASSERT_OK(ampc_tensor_set_requires_grad(w, true));
    assert_true(ampc_tensor_copy_(w, src) == AMPC_ERR_INVALID);
    ampc_clear_error();
    double v[24];
    ASSERT_OK(ampc_tensor_to_f64(w, v, 24));
    for (int i = 0; i < 24; i++) assert_true(v[i] == 0);
    ampc_no_grad_enter();
    ASSERT_OK(ampc_tensor_copy_(w, src));
    ampc_no_grad_exit();
    ASSERT_OK(ampc_tensor_to_f64(w, v, 24));
    for (int i = 0; i < 24; i++) assert_true(v[i] == (double)data[i]);
    ampc_scope_end();
}

static void test_philox_known_answer(void **state) {
    (void)state;
    /* Random123's published known-answer vector for philox4x32-10: counter 0, key 0 */
    uint32_t out[4];
    ampc__philox_public_kat(out);
    assert_int_equal(out[0], 0x6627e8d5u);
    assert_int_equal(out[1], 0xe169c58du);
    assert_int_equal(out[2], 0xbc57ac4cu);
    assert_int_equal(out[3], 0x9b00dbd8u);
}

/* The GPU of the cuda device: chosen before its start, fixed after; a bad index refused */
static void test_cuda_device_choice(void **state) {
    (void)state;
    assert_int_equal(ampc_cuda_set_device(-1), AMPC_ERR_INVALID);
    assert_non_null(strstr(ampc_last_error(), "GPU -1"));
    assert_int_equal(ampc_cuda_device(), 0);   /* the default, unchanged by the refusal */
    assert_int_equal(ampc_cuda_set_device(0), AMPC_OK);
    const int n = ampc_cuda_device_count();
    assert_true(n >= 0);
    if (n == 0) assert_false(ampc_device_available(AMPC_DEVICE_CUDA));
    /* asking whether cuda is available starts it in a CUDA build (on GPU 0): another GPU is
       then refused; without a CUDA backend nothing starts and any index may be chosen */
    const bool started = ampc_device_available(AMPC_DEVICE_CUDA) || n > 0 ||
                         !strstr(ampc_device_unavailable_reason(AMPC_DEVICE_CUDA), "no CUDA backend");
    int rc = ampc_cuda_set_device(1);
    if (started) {
        assert_int_equal(rc, AMPC_ERR_STATE);
        assert_non_null(strstr(ampc_last_error(), "GPU 0 is in use"));
        assert_int_equal(ampc_cuda_device(), 0);
        assert_int_equal(ampc_cuda_set_device(0), AMPC_OK);   /* the one in use: fine */
    } else {
        assert_int_equal(rc, AMPC_OK);
        assert_int_equal(ampc_cuda_device(), 1);
        assert_int_equal(ampc_cuda_set_device(0), AMPC_OK);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_device_choice),
        cmocka_unit_test(test_create_and_read),
        cmocka_unit_test(test_scope_releases),
        cmocka_unit_test(test_own_and_free),
        cmocka_unit_test(test_allocator_caches_and_counts_peak),
        cmocka_unit_test(test_allocator_large_blocks_reuse),
        cmocka_unit_test(test_allocator_random_stress),
        cmocka_unit_test(test_memory_limit),
        cmocka_unit_test(test_bad_shapes_and_views),
        cmocka_unit_test(test_rng_reproducible),
        cmocka_unit_test(test_philox_known_answer),
        cmocka_unit_test(test_copy_in_place),
    };
    return cmocka_run_group_tests_name("core", tests, tu_group_setup, tu_group_teardown);
}
