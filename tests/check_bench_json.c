/*
 * check_bench_json.c - reads back the file `ampc-bench --json` wrote, with jansson, for
 * tests/bench_json.sh: the document parses, has the keys readers use (bench/pytorch_peer.py,
 * bench/scaling.sh), and a failed config's error is exactly the text that failed it.
 *
 *     check_bench_json FILE ok STEPS        one config that ran STEPS timed steps
 *     check_bench_json FILE error TEXT      one config that failed with the error TEXT
 *
 * Exits 0 when all holds, else 1 with what did not on stderr.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fails;

static void check(int cond, const char *what) {
    if (!cond) {
        fprintf(stderr, "check_bench_json: %s\n", what);
        fails++;
    }
}

/* The keys every document has, whatever its results. */
static void check_head(json_t *doc) {
    json_error_t e;
    const char *tool;
    int steps, warmup, keep;
    check(json_unpack_ex(doc, &e, 0, "{s:s, s:{s:s, s:i, s:s, s:s, s:s, s:s, s:s}, s:{s:i, s:i, s:s, s:s, s:b}, s:n, s:[]}",
                         "tool", &tool, "machine", "cpu_features", &(const char *){0}, "threads", &(int){0},
                         "omp_wait_policy", &(const char *){0}, "omp_num_threads_env", &(const char *){0}, "onednn",
                         &(const char *){0}, "loadavg_start", &(const char *){0}, "loadavg_end", &(const char *){0},
                         "settings", "steps", &steps, "warmup", &warmup, "optimizer", &(const char *){0},
                         "conv_memory_format", &(const char *){0}, "keep_weight_casts", &keep, "peak", "results") == 0,
          e.text);
    check(!strcmp(tool, "ampc-bench"), "tool is not ampc-bench");
}

int main(int argc, char **argv) {
    if (argc != 4 || (strcmp(argv[2], "ok") && strcmp(argv[2], "error"))) {
        fprintf(stderr, "usage: check_bench_json FILE ok STEPS | FILE error TEXT\n");
        return 2;
    }
    json_error_t e;
    json_t *doc = json_load_file(argv[1], JSON_REJECT_DUPLICATES, &e);
    if (!doc) {
        fprintf(stderr, "check_bench_json: %s: line %d: %s\n", argv[1], e.line, e.text);
        return 1;
    }
    check_head(doc);
    json_t *results = json_object_get(doc, "results");
    check(json_array_size(results) == 1, "not one result");
    json_t *r = json_array_get(results, 0);
    const char *workload = "", *mode = "";
    int ok = 0;
    json_int_t batch = 0;
    check(json_unpack_ex(r, &e, 0, "{s:s, s:s, s:I, s:b}", "workload", &workload, "mode", &mode, "batch", &batch, "ok", &ok) == 0,
          e.text);
    if (!strcmp(argv[2], "error")) {
        const char *error = NULL;
        check(!ok, "a failed config says ok");
        check(json_unpack_ex(r, &e, 0, "{s:s}", "error", &error) == 0, e.text);
        check(error && !strcmp(error, argv[3]), "the error is not the text that failed the config");
        if (error && strcmp(error, argv[3])) fprintf(stderr, "  got  [%s]\n  want [%s]\n", error, argv[3]);
    } else {
        json_t *ms_steps = NULL, *mem = NULL;
        double f;
        json_int_t n;
        check(ok, "the config did not run");
        check(json_unpack_ex(r, &e, 0,
                             "{s:F, s:F, s:F, s:F, s:F, s:F, s:i, s:F, s:F, s:o, s:I, s:I, s:I, s:F, s:F, s:F, s:I, s:o}",
                             "gflop_per_step", &f, "ms_median", &f, "ms_min", &f, "ms_max", &f, "samples_per_s", &f,
                             "gflops", &f, "world", &(int){0}, "ddp_exposed_ms", &f, "ddp_copy_ms", &f, "mem_peak_bytes",
                             &mem, "activations_step_bytes", &n, "reserved_bytes", &n, "rss_growth_bytes", &n,
                             "mallocs_per_step", &f, "final_loss", &f, "scaler_scale", &f, "steps_skipped", &n,
                             "ms_steps", &ms_steps) == 0,
              e.text);
        check(json_is_integer(json_object_get(mem, "total")) && json_is_integer(json_object_get(mem, "parameters")),
              "mem_peak_bytes has no total or parameters");
        check(json_is_array(ms_steps) && json_array_size(ms_steps) == (size_t)atoi(argv[3]), "ms_steps is not one time per step");
    }
    json_decref(doc);
    return fails ? 1 : 0;
}
