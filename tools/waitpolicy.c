/*
 * waitpolicy.c - see waitpolicy.h.
 */
#include "waitpolicy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SPIN "10000"
#define MARK "AMPC_WAIT_POLICY_SET"   /* in the environment of the re-executed program */

void ampc_tool_wait_policy(char **argv) {
    const char *keep = getenv("AMPC_KEEP_WAIT_POLICY");
    if (getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT") || getenv(MARK) || (keep && strcmp(keep, "0"))) return;
    if (setenv("GOMP_SPINCOUNT", SPIN, 1) < 0 || setenv(MARK, "1", 1) < 0) return;
    execv("/proc/self/exe", argv);
    /* no re-execution (no /proc, say): the default policy, and say so in the configuration */
    unsetenv("GOMP_SPINCOUNT");
    setenv(MARK, "failed", 1);
}

const char *ampc_tool_wait_policy_desc(void) {
    static char buf[160];
    const char *mark = getenv(MARK), *spin = getenv("GOMP_SPINCOUNT"), *pol = getenv("OMP_WAIT_POLICY");
    if (mark && !strcmp(mark, "failed")) return "libgomp's default (could not re-execute with GOMP_SPINCOUNT=" SPIN ")";
    if (mark && spin && !strcmp(spin, SPIN)) return "GOMP_SPINCOUNT=" SPIN " (ampc's default; AMPC_KEEP_WAIT_POLICY=1: libgomp's)";
    if (pol || spin) {
        snprintf(buf, sizeof buf, "%s%s%s%s%s (set by the user)", pol ? "OMP_WAIT_POLICY=" : "", pol ? pol : "",
                 pol && spin ? " " : "", spin ? "GOMP_SPINCOUNT=" : "", spin ? spin : "");
        return buf;
    }
    return "libgomp's default (AMPC_KEEP_WAIT_POLICY)";
}
