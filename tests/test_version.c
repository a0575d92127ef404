/*
 * test_version.c - ampc_version() (the library) reports the version of the generated
 * ampc/version.h (the header), and AMPC_VERSION_STRING is "MAJOR.MINOR.PATCH" of its macros.
 */
#include "testutil.h"

#include <stdio.h>
#include <string.h>

#include "ampc/version.h"

static void test_version_matches_header(void **state) {
    (void)state;
    char want[64];
    snprintf(want, sizeof want, "%d.%d.%d", AMPC_VERSION_MAJOR, AMPC_VERSION_MINOR, AMPC_VERSION_PATCH);
    assert_string_equal(AMPC_VERSION_STRING, want);
    assert_non_null(ampc_version());
    assert_string_equal(ampc_version(), want);
    assert_true(AMPC_VERSION_MAJOR >= 0 && AMPC_VERSION_MINOR >= 0 && AMPC_VERSION_PATCH >= 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_version_matches_header),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
