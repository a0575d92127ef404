/*
 * test_progress.c - the progress display of the tools (tools/progress.c): after a resume, the rate
 * and the time left count only this session's steps, with the session's time set by the test
 * (the start moved back), so no timing of the machine enters.
 */
#include "testutil.h"

#include "progress.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The line progress_update prints at `done` of an epoch of `total` steps begun at `initial`, the
   session having run for `seconds`; its rate (it/s) and time left (seconds, the line's mm:ss). */
static void line_at(int64_t total, int64_t initial, int64_t done, double seconds, double *rate, double *left) {
    progress_set_mode(PROGRESS_LINES);
    progress p;
    progress_begin(&p, "epoch 1/1 train", total, initial);
    char *text = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&text, &n);
    assert_non_null(f);
    p.out = f;
    p.t0 -= seconds;
    progress_update(&p, done, "loss=%.4f", 1.0);
    fclose(f);
    int mm = -1, ss = -1;
    const char *at = text ? strstr(text, "elapsed, ") : NULL;
    if (!at || sscanf(at, "elapsed, %d:%d left, %lf it/s", &mm, &ss, rate) != 3) fail_msg("no rate in '%s'", text ? text : "");
    *left = 60.0 * mm + ss;
    free(text);
}

/* Stopped at step 560 of 640 and resumed: the 90% line (576) after 2 s of this session shows 16
   steps in 2 s, 8 it/s (at most: the test's own time adds to the 2 s), and 64 steps left at that
   rate, 8 s. Counting the resumed 560 steps as done in no time showed 288 it/s and 00:00 left. */
static void test_resumed_rate(void **state) {
    (void)state;
    double rate, left;
    line_at(640, 560, 576, 2.0, &rate, &left);
    print_message("resumed at 560 of 640: %.2f it/s, %.0f s left at step 576 after 2 s\n", rate, left);
    assert_true(rate > 4 && rate <= 8.0);
    assert_true(left >= 7 && left <= 16.5);
    /* a whole epoch: the same rule, initial 0 (576 steps in 2 s) */
    line_at(640, 0, 576, 2.0, &rate, &left);
    assert_true(rate > 144 && rate <= 288.0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_resumed_rate),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
