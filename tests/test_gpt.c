/*
 * test_gpt.c - the zoo's "gpt" (nanoGPT's GPT) against PyTorch 1.13 running nanoGPT's model
 * (tests/fixtures/make_gpt.py -> gpt.txt): its state_dict (names, order, shapes, the tied
 * lm_head.weight), the logits, the loss and every parameter's gradient from the same weights, and
 * 20 AdamW steps with weight-decay groups, gradient clipping and a warm-up + cosine schedule;
 * autocast in bf16 and fp16 against the same fixture within their roundings; refusals.
 */
#include "testutil.h"

#include "io/safetensors.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { V = 37, BLOCK = 8, B = 3, T = 7 };

static ampc_module *make_gpt(ampc_device dev) {
    ampc_model_options o = {0};
    o.gpt = (ampc_gpt_config){.vocab_size = V, .block_size = BLOCK, .n_layer = 2, .n_head = 2, .n_embd = 16};
    ampc_set_default_device(dev);
    ampc_module *m = ampc_model_new("gpt", &o);
    ampc_set_default_device(AMPC_DEVICE_CPU);
    ASSERT_NOT_NULL_MSG(m);
    return m;
}

/* make_gpt.py's weights: parameter k, element i: 0.2 sin((0.17 + 0.09 k) (i + 1)), + 1 for the
   LayerNorm weights. */
static void fill_weights(ampc_module *m) {
    ampc_tensor **p;
    const char **names;
    int np = ampc_module_parameters(m, &p, &names);
    assert_int_equal(np, 28);
    for (int k = 0; k < np; k++) {
        tu_fill_formula(p[k], 0.17 + 0.09 * k, 0.2, false);
        size_t len = strlen(names[k]);
        if (strstr(names[k], ".ln_") && !strcmp(names[k] + len - 6, "weight")) {
            ampc_scope_begin();
            ampc_tensor *one = ampc_add_scalar(p[k], 1.0);
            ampc_no_grad_enter();
            ASSERT_OK(ampc_tensor_copy_(p[k], one));
            ampc_no_grad_exit();
            ampc_scope_end();
        }
    }
}

/* Step s's batch on dev: idx = (7 i + 3 + 11 s) mod V, targets = (5 i + 1 + 3 s) mod V, element 4 -1. */
static void make_batch(int s, ampc_device dev, ampc_tensor **idx, ampc_tensor **tgt) {
    int64_t ix[B * T], tg[B * T];
    for (int i = 0; i < B * T; i++) {
        ix[i] = (7 * i + 3 + 11 * s) % V;
        tg[i] = (5 * i + 1 + 3 * s) % V;
    }
    tg[4] = -1;
    ampc_set_default_device(dev);
    *idx = ampc_tensor_from_i64(2, (int64_t[]){B, T}, ix);
    *tgt = ampc_tensor_from_i64(1, (int64_t[]){B * T}, tg);
    ampc_set_default_device(AMPC_DEVICE_CPU);
    ASSERT_NOT_NULL_MSG(*idx && *tgt);
}

/* nanoGPT's loss: cross-entropy over (B T, V), ignore_index -1. */
static ampc_tensor *gpt_loss(ampc_module *m, ampc_tensor *idx, ampc_tensor *tgt, ampc_tensor **logits) {
    ampc_tensor *y = ampc_module_forward(m, idx);
    ASSERT_NOT_NULL_MSG(y);
    if (logits) *logits = y;
    ampc_cross_entropy_options o = ampc_cross_entropy_defaults();
    o.ignore_index = -1;
    ampc_tensor *loss = ampc_cross_entropy(ampc_reshape(y, 2, (int64_t[]){B * T, V}), tgt, &o);
    ASSERT_NOT_NULL_MSG(loss);
    return loss;
}

/* got (n values) against the fixture's next section `name`: every element within tol of the
   section's largest magnitude; elements [loose_lo, loose_hi) within loose (absolute). */
static void check_values_loose(FILE *f, const char *name, const double *got, int64_t n, double tol, const char *what, int64_t loose_lo,
                               int64_t loose_hi, double loose) {
    double *want = tu_read_section(f, name, n), big = 0;
    for (int64_t i = 0; i < n; i++) big = fmax(big, fabs(want[i]));
    for (int64_t i = 0; i < n; i++) {
        const bool lo = i >= loose_lo && i < loose_hi;
        double e = lo ? fabs(got[i] - want[i]) / loose * tol : fabs(got[i] - want[i]) / (big > 0 ? big : 1);
        if (!(e <= tol)) fail_msg("%s %s[%lld]: %.10g, PyTorch %.10g (error %.3g of the largest, allowed %.3g)", what, name, (long long)i,
                                  got[i], want[i], e, tol);
    }
    free(want);
}

static void check_values(FILE *f, const char *name, const double *got, int64_t n, double tol, const char *what) {
    check_values_loose(f, name, got, n, tol, what, 0, 0, 0);
}

static void check_section(FILE *f, const char *name, const ampc_tensor *t, double tol, const char *what) {
    ASSERT_NOT_NULL_MSG(t);
    double *got = tu_values(t);
    check_values(f, name, got, ampc_tensor_numel(t), tol, what);
    free(got);
}

/* The fixture's "state" section against m's state_dict: the same names in the same order with
   the same shapes, lm_head.weight the very tensor of transformer.wte.weight. */
static void check_state_dict(FILE *f, ampc_module *m) {
    ampc_tensor **sd;
    const char **names;
    int n = ampc_module_state_dict(m, &sd, &names), want_n;
    char tag[16];
    assert_int_equal(fscanf(f, "%15s %d", tag, &want_n), 2);
    assert_string_equal(tag, "state");
    assert_int_equal(n, want_n);
    for (int i = 0; i < n; i++) {
        char name[128];
        int nd;
        assert_int_equal(fscanf(f, "%127s %d", name, &nd), 2);
        assert_string_equal(names[i], name);
        assert_int_equal(ampc_tensor_ndim(sd[i]), nd);
        for (int d = 0; d < nd; d++) {
            long long sz;
            assert_int_equal(fscanf(f, "%lld", &sz), 1);
            assert_int_equal(ampc_tensor_dim(sd[i], d), sz);
        }
    }
    assert_ptr_equal(sd[0], sd[n - 1]);   /* transformer.wte.weight is lm_head.weight */
}

/* Step 0's batch through m on dev (under autocast in amp unless it is AMPC_F32), the loss's
   backward, then against the fixture's sections from "logits" on: the logits and the loss within
   tol_out, each parameter's gradient within tol_grad (check_section's units). */
static void check_forward_backward(FILE *f, ampc_module *m, ampc_device dev, ampc_dtype amp, double tol_out, double tol_grad,
                                   const char *what) {
    ampc_scope_begin();
    ampc_tensor *idx, *tgt, *logits;
    make_batch(0, dev, &idx, &tgt);
    const bool autocast = amp != AMPC_F32;
    if (autocast) ampc_autocast_enter(amp, true);
    ampc_tensor *loss = gpt_loss(m, idx, tgt, &logits);
    if (autocast) ampc_autocast_exit();
    if (autocast) {
        assert_int_equal(ampc_tensor_dtype(logits), amp);
        assert_int_equal(ampc_tensor_dtype(loss), AMPC_F32);
    }
    ASSERT_OK(ampc_backward(loss));
    check_section(f, "logits", logits, tol_out, what);
    check_section(f, "loss", loss, tol_out, what);
    ampc_tensor **p;
    const char **names;
    int np = ampc_module_parameters(m, &p, &names);
    for (int k = 0; k < np; k++) check_section(f, names[k], ampc_tensor_grad(p[k]), tol_grad, what);
    ampc_scope_end();
}

/* One forward and backward from make_gpt.py's weights: logits, loss and each parameter's
   gradient (the tied weight's collects both uses), REF within 1e-12 and the CPU's f32 within
   1e-5 of each section's largest value (issue 30's bound for fp32). */
static void test_gpt_pytorch(void **state) {
    (void)state;
    const ampc_device devs[2] = {AMPC_DEVICE_REF, AMPC_DEVICE_CPU};
    for (int dv = 0; dv < 2; dv++) {
        const double tol = devs[dv] == AMPC_DEVICE_REF ? 1e-12 : 1e-5;
        const char *what = devs[dv] == AMPC_DEVICE_REF ? "ref" : "cpu";
        ampc_module *m = make_gpt(devs[dv]);
        assert_string_equal(ampc_module_type(m), "GPT");
        fill_weights(m);
        FILE *f = tu_open_fixture("gpt.txt");
        check_state_dict(f, m);
        check_forward_backward(f, m, devs[dv], AMPC_F32, tol, tol, what);
        fclose(f);
        ampc_module_free(m);
    }
}

/* Skips the fixture up to (not including) the section `name`. */
static void seek_section(FILE *f, const char *name) {
    char line[256];
    long at = ftell(f);
    size_t len = strlen(name);
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, name, len) && line[len] == ' ') {
            fseek(f, at, SEEK_SET);
            return;
        }
        at = ftell(f);
    }
    fail_msg("fixture: no section %s", name);
}

/* make_gpt.py's training: AdamW (lr 3e-3, betas 0.9/0.95, eps 1e-6 (why: make_gpt.py), weight decay 0.1 on the
   Linear weights alone: ampc_optimizer_decay_only_weights), clip_grad_norm 1.0, LinearLR(0.2, 5)
   then cosine (T_max 15, eta_min 3e-4), 20 steps on changing batches: each step's loss and every
   parameter afterwards, REF within 1e-9 and the CPU's f32 within 1e-4 (issue 30's bound). */
static void test_gpt_adamw_pytorch(void **state) {
    (void)state;
    const ampc_device devs[2] = {AMPC_DEVICE_REF, AMPC_DEVICE_CPU};
    for (int dv = 0; dv < 2; dv++) {
        const double tol = devs[dv] == AMPC_DEVICE_REF ? 1e-9 : 1e-4;
        const char *what = devs[dv] == AMPC_DEVICE_REF ? "ref" : "cpu";
        ampc_module *m = make_gpt(devs[dv]);
        fill_weights(m);
        ampc_adam_options ao = ampc_adamw_defaults();
        ao.lr = 3e-3, ao.beta2 = 0.95, ao.eps = 1e-6, ao.weight_decay = 0.1;
        ampc_optimizer *opt = ampc_adamw_new(m, &ao);
        ASSERT_NOT_NULL_MSG(opt);
        ASSERT_OK(ampc_optimizer_decay_only_weights(opt, m));
        const ampc_lr_schedule sch = {.kind = AMPC_LR_COSINE, .t_max = 15, .eta_min = 3e-4, .warmup_steps = 5, .warmup_start_factor = 0.2};
        double losses[20];
        for (int s = 0; s < 20; s++) {
            ampc_scope_begin();
            ampc_optimizer_zero_grad(opt);
            ampc_optimizer_set_lr(opt, ampc_lr_at(&sch, ao.lr, ampc_optimizer_steps_taken(opt)));
            ampc_tensor *idx, *tgt;
            make_batch(s, devs[dv], &idx, &tgt);
            ampc_tensor *loss = gpt_loss(m, idx, tgt, NULL);
            losses[s] = ampc_tensor_item(loss);
            ASSERT_OK(ampc_backward(loss));
            assert_true(ampc_clip_grad_norm(opt, 1.0) >= 0);
            ASSERT_OK(ampc_optimizer_step(opt));
            ampc_scope_end();
        }
        FILE *f = tu_open_fixture("gpt.txt");
        seek_section(f, "losses");
        check_values(f, "losses", losses, 20, tol, what);
        ampc_tensor **p;
        const char **names;
        int np = ampc_module_parameters(m, &p, &names);
        for (int k = 0; k < np; k++) {
            char sec[160];
            snprintf(sec, sizeof sec, "final.%s", names[k]);
            double *got = tu_values(p[k]);
            /* The keys' bias (c_attn.bias[C, 2C)) adds q.b_k to a whole row of scores, which the
               softmax ignores: its exact gradient is 0, f64's is ~1e-17 and f32's ~1e-8 of noise,
               and Adam scales noise to steps of up to lr (3e-3) as it would a real gradient. Those
               16 values per layer are held only to 20 such steps on the CPU. */
            const bool kb = devs[dv] == AMPC_DEVICE_CPU && strstr(names[k], "c_attn.bias");
            check_values_loose(f, sec, got, ampc_tensor_numel(p[k]), tol, what, kb ? 16 : 0, kb ? 32 : 0, 20 * 3e-3);
            free(got);
        }
        fclose(f);
        ampc_optimizer_free(opt);
        ampc_module_free(m);
    }
}

/* Under autocast (bf16 and fp16 on the CPU: the gemms and attention in 16 bits, layer norm,
   softmax and the loss in f32) the logits, loss and gradients against PyTorch's f64, relative to
   each section's largest value. Every gemm and attention input is rounded once to 16 bits
   (relative error u), so the logits and the loss are held to 4 u (measured: 1.4 u). A weight's
   gradient sums the B T = 21 positions' products, each a few u off, and those sums cancel (a
   LayerNorm weight's gradient is far smaller than its terms): 8 u sqrt(B T) (measured: 21 u in
   bf16, 17 u in fp16, both on the first LayerNorm's weight). */
static void test_gpt_autocast(void **state) {
    (void)state;
    const ampc_dtype dts[2] = {AMPC_BF16, AMPC_F16};
    for (int d = 0; d < 2; d++) {
        if (!ampc_dtype_supported(AMPC_DEVICE_CPU, dts[d])) continue;
        const double u = tu_eps(dts[d]), tol_out = 4 * u, tol_grad = 8 * u * sqrt((double)(B * T));
        const char *what = ampc_dtype_name(dts[d]);
        ampc_module *m = make_gpt(AMPC_DEVICE_CPU);
        fill_weights(m);
        FILE *f = tu_open_fixture("gpt.txt");
        seek_section(f, "logits");
        check_forward_backward(f, m, AMPC_DEVICE_CPU, dts[d], tol_out, tol_grad, what);
        fclose(f);
        ampc_module_free(m);
    }
}

/* Weights saved with both names of the tied weight, as PyTorch's state_dict has them, load
   strictly into a fresh model (the tie kept: one tensor); a file without lm_head.weight (as
   Hugging Face's GPT-2 files) is one missing tensor for strict loading, and a non-strict load
   still gives the head the embedding's values through the tie. The parameter count holds the
   tied weight once (PyTorch's sum of numel over parameters()). */
static void test_gpt_state_dict_roundtrip(void **state) {
    (void)state;
    ampc_module *a = make_gpt(AMPC_DEVICE_CPU), *b = make_gpt(AMPC_DEVICE_CPU);
    fill_weights(a);
    ampc_tensor **sa, **sb;
    const char **names;
    int n = ampc_module_state_dict(a, &sa, &names);
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += ampc_tensor_numel(sa[i]);
    assert_int_equal(ampc_module_num_parameters(a, false), total - V * 16);
    char path[] = "/tmp/ampc_gpt_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    ASSERT_OK(ampc_checkpoint_save(path, a, NULL, NULL, NULL));
    ASSERT_OK(ampc_load_state_dict(path, b, true, NULL, NULL));
    assert_int_equal(ampc_module_state_dict(b, &sb, NULL), n);
    for (int i = 0; i < n; i++)
        assert_memory_equal(ampc_tensor_cdata(sa[i]), ampc_tensor_cdata(sb[i]), (size_t)ampc_tensor_numel(sa[i]) * sizeof(float));
    assert_ptr_equal(sb[0], sb[n - 1]);

    /* the same weights without lm_head.weight */
    st_tensor *items = calloc((size_t)n, sizeof *items);
    for (int i = 0; i < n - 1; i++)
        items[i] = (st_tensor){names[i], ampc_tensor_dtype(sa[i]), ampc_tensor_ndim(sa[i]), ampc_tensor_shape(sa[i]), ampc_tensor_cdata(sa[i]),
                               (size_t)ampc_tensor_numel(sa[i]) * sizeof(float)};
    assert_string_equal(names[n - 1], "lm_head.weight");
    ASSERT_OK(st_write(path, items, n - 1, NULL, 0));
    free(items);
    ampc_module *c = make_gpt(AMPC_DEVICE_CPU);
    ampc_load_report rep;
    assert_int_equal(ampc_load_state_dict(path, c, true, NULL, &rep), AMPC_ERR_SHAPE);
    ampc_clear_error();
    assert_int_equal(rep.missing, 1);
    ASSERT_OK(ampc_load_state_dict(path, c, false, NULL, &rep));
    assert_int_equal(rep.loaded, n - 1);
    ampc_tensor **sc;
    assert_int_equal(ampc_module_state_dict(c, &sc, NULL), n);
    assert_memory_equal(ampc_tensor_cdata(sc[n - 1]), ampc_tensor_cdata(sa[0]), (size_t)ampc_tensor_numel(sa[0]) * sizeof(float));
    ampc_module_free(c);
    unlink(path);
    ampc_module_free(a);
    ampc_module_free(b);
}

/* Refusals, each naming the problem: inputs that are not (B, T) indices, sequences past the
   block size, impossible configurations, running a container, and weight-decay groups over
   another module's parameters or with bad values. */
static void test_gpt_errors(void **state) {
    (void)state;
    ampc_module *m = make_gpt(AMPC_DEVICE_CPU);
    ampc_scope_begin();
    tu_expect_error(ampc_module_forward(m, ampc_tensor_zeros(AMPC_F32, 2, (int64_t[]){2, 3})), AMPC_ERR_SHAPE, "token indices (B, T) of i64");
    tu_expect_error(ampc_module_forward(m, ampc_tensor_zeros(AMPC_I64, 1, (int64_t[]){3})), AMPC_ERR_SHAPE, "token indices");
    tu_expect_error(ampc_module_forward(m, ampc_tensor_zeros(AMPC_I64, 2, (int64_t[]){1, BLOCK + 1})), AMPC_ERR_SHAPE,
                    "length 9: the block size is 8");
    int64_t bad[2] = {0, V};
    tu_expect_error(ampc_module_forward(m, ampc_tensor_from_i64(2, (int64_t[]){1, 2}, bad)), AMPC_ERR_INVALID, "index 37 at position 1 is out of range [0, 37)");
    tu_expect_error(ampc_module_forward(ampc_module_find(m, "transformer"), ampc_tensor_zeros(AMPC_I64, 2, (int64_t[]){1, 2})),
                    AMPC_ERR_STATE, "ModuleDict has no forward");
    ampc_scope_end();
    ampc_model_options o = {0};
    o.gpt = (ampc_gpt_config){.vocab_size = V, .block_size = BLOCK, .n_layer = 1, .n_head = 3, .n_embd = 16};
    tu_expect_error(ampc_model_new("gpt", &o), AMPC_ERR_INVALID, "n_embd a multiple of n_head");
    o.gpt.n_head = 2, o.gpt.dropout = 1.0;
    tu_expect_error(ampc_model_new("gpt", &o), AMPC_ERR_INVALID, "dropout 1 outside [0, 1)");
    o.gpt.dropout = 0, o.gpt.vocab_size = -1;
    tu_expect_error(ampc_model_new("gpt", &o), AMPC_ERR_INVALID, "must be positive");
    o.gpt.vocab_size = V, o.gpt.no_bias = true;
    ampc_module *nb = ampc_model_new("gpt", &o);   /* bias=False: weights only, and the LayerNorms' */
    ASSERT_NOT_NULL_MSG(nb);
    const char **names;
    int np = ampc_module_parameters(nb, NULL, &names);
    assert_int_equal(np, 2 + 6 + 1);   /* wte, wpe; ln_1, c_attn, c_proj, ln_2, c_fc, c_proj; ln_f */
    for (int i = 0; i < np; i++) assert_null(strstr(names[i], "bias"));

    ampc_optimizer *other = ampc_adamw_new(nb, NULL);
    ASSERT_NOT_NULL_MSG(other);
    assert_int_equal(ampc_optimizer_decay_only_weights(other, m), AMPC_ERR_INVALID);
    ampc_clear_error();
    assert_int_equal(ampc_optimizer_set_weight_decay(other, np, 0.1), AMPC_ERR_INVALID);
    ampc_clear_error();
    assert_int_equal(ampc_optimizer_set_weight_decay(other, 0, -1.0), AMPC_ERR_INVALID);
    ampc_clear_error();
    ampc_optimizer_free(other);
    ampc_module_free(nb);
    ampc_module_free(m);
}

/* nanoGPT's initialisation: Linear and Embedding weights ~ N(0, 0.02), each block's c_proj
   weights ~ N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm weights 1: each weight tensor's
   sample standard deviation within 6% of its std (its standard error is std / sqrt(2 n), under
   1.2% for the smallest tensor here, 4096 values: 5 standard errors) and its mean within
   5 std / sqrt(n). */
static void test_gpt_init(void **state) {
    (void)state;
    ampc_model_options o = {0};
    o.gpt = (ampc_gpt_config){.vocab_size = 500, .block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 64};
    ampc_module *m = ampc_model_new("gpt", &o);
    ASSERT_NOT_NULL_MSG(m);
    ampc_tensor **p;
    const char **names;
    int np = ampc_module_parameters(m, &p, &names);
    assert_int_equal(np, 2 + 4 * 12 + 2);
    for (int k = 0; k < np; k++) {
        double *v = tu_values(p[k]), sum = 0, sq = 0;
        int64_t n = ampc_tensor_numel(p[k]);
        for (int64_t i = 0; i < n; i++) sum += v[i], sq += v[i] * v[i];
        const double mean = sum / (double)n, sd = sqrt(sq / (double)n - mean * mean);
        size_t len = strlen(names[k]);
        if (strstr(names[k], ".ln_")) {
            const double want = strstr(names[k], "weight") ? 1.0 : 0.0;
            for (int64_t i = 0; i < n; i++) assert_true(v[i] == want);
        } else if (!strcmp(names[k] + len - 5, ".bias")) {
            for (int64_t i = 0; i < n; i++) assert_true(v[i] == 0.0);
        } else {
            const double want = strstr(names[k], "c_proj.weight") ? 0.02 / sqrt(8.0) : 0.02;
            if (fabs(sd / want - 1) > 0.06 || fabs(mean) > 5 * want / sqrt((double)n))
                fail_msg("%s: mean %g, standard deviation %g; nanoGPT's N(0, %g)", names[k], mean, sd, want);
        }
        free(v);
    }
    ampc_module_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gpt_pytorch),
        cmocka_unit_test(test_gpt_adamw_pytorch),
        cmocka_unit_test(test_gpt_autocast),
        cmocka_unit_test(test_gpt_state_dict_roundtrip),
        cmocka_unit_test(test_gpt_errors),
        cmocka_unit_test(test_gpt_init),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
