/*
 * sysmem.c - what this process may still allocate on the host: the least of the kernel's
 * MemAvailable, the room under its cgroup's limit (v2 memory.max, v1 memory.limit_in_bytes, each
 * ancestor's too) and $AMPC_MEMORY_AVAILABLE (a limit emulated for tests). Readers of files that
 * announce their size compare it with this before allocating, so that a file too large for the
 * machine is an error with the figures rather than the kernel's OOM killer.
 */
#include "core/core.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

/* The first number in the file at path (after `key` when given), in bytes (kB for meminfo); -1
   when absent or "max". */
static int64_t read_number(const char *path, const char *key, int64_t scale) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[256];
    int64_t v = -1;
    while (v < 0 && fgets(line, sizeof line, f)) {
        const char *p = line;
        if (key) {
            if (strncmp(line, key, strlen(key)) != 0) continue;
            p += strlen(key);
        }
        char *end;
        long long x = strtoll(p, &end, 10);
        if (end != p && x >= 0) v = x > INT64_MAX / scale ? INT64_MAX : x * scale;
        if (!key) break;
    }
    fclose(f);
    return v;
}

/* The room under the cgroup limits of dir (under root) and its ancestors, with limit and usage
   file names; INT64_MAX when none is set. */
static int64_t cgroup_room(const char *root, const char *dir, const char *limit_name, const char *usage_name) {
    char path[4096], sub[2048];
    snprintf(sub, sizeof sub, "%s", dir);
    int64_t room = INT64_MAX;
    for (;;) {
        snprintf(path, sizeof path, "%s%s/%s", root, sub, limit_name);
        int64_t lim = read_number(path, NULL, 1);
        snprintf(path, sizeof path, "%s%s/%s", root, sub, usage_name);
        int64_t use = read_number(path, NULL, 1);
        /* v1 writes "no limit" as a huge number: only limits under 2^60 count */
        if (lim >= 0 && lim < (INT64_C(1) << 60)) {
            int64_t r = use < 0 ? lim : use >= lim ? 0 : lim - use;
            if (r < room) room = r;
        }
        char *slash = strrchr(sub, '/');
        if (!slash || (slash == sub && !sub[1])) break;
        *(slash == sub ? slash + 1 : slash) = '\0';
    }
    return room;
}

/* "3G", "512M", "1.5GiB", plain bytes: a size in bytes, or -1. */
static int64_t parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || !(v >= 0)) return -1;
    double mul = 1;
    if (*end == 'K' || *end == 'k') mul = 1024.0, end++;
    else if (*end == 'M' || *end == 'm') mul = 1048576.0, end++;
    else if (*end == 'G' || *end == 'g') mul = 1073741824.0, end++;
    else if (*end == 'T' || *end == 't') mul = 1099511627776.0, end++;
    if (*end == 'i') end++;
    if (*end == 'B' || *end == 'b') end++;
    return *end || v * mul >= 9.0e18 ? -1 : (int64_t)(v * mul);
}

uint64_t ampc_memory_available(const char **what) {
    const char *src = NULL;
    int64_t best = INT64_MAX, v;
    const char *env = getenv("AMPC_MEMORY_AVAILABLE");
    if (env && *env && (v = parse_size(env)) >= 0 && v < best) best = v, src = "$AMPC_MEMORY_AVAILABLE";
    if ((v = read_number("/proc/meminfo", "MemAvailable:", 1024)) >= 0 && v < best) best = v, src = "MemAvailable (/proc/meminfo)";
    FILE *f = fopen("/proc/self/cgroup", "r");
    char line[2048];
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) continue;
        *c2 = '\0';
        const char *ctrl = c1 + 1, *dir = c2 + 1;
        if (!*ctrl && (v = cgroup_room("/sys/fs/cgroup", dir, "memory.max", "memory.current")) < best)
            best = v, src = "the cgroup's memory.max";
        else if (strstr(ctrl, "memory") &&
                 (v = cgroup_room("/sys/fs/cgroup/memory", dir, "memory.limit_in_bytes", "memory.usage_in_bytes")) < best)
            best = v, src = "the cgroup's memory.limit_in_bytes";
    }
    if (f) fclose(f);
    if (what) *what = src ? src : "nothing";
    return best == INT64_MAX ? UINT64_MAX : (uint64_t)best;
}

/* "5.5 GiB" */
static const char *fmt_size(uint64_t b, char *buf, size_t n) {
    static const char *u[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int k = 0;
    while (v >= 1024 && k < 4) v /= 1024, k++;
    snprintf(buf, n, k ? "%.1f %s" : "%.0f %s", v, u[k]);
    return buf;
}

int ampc__memory_fits(uint64_t need, const char *what, uint64_t unit, const char *units) {
    const char *src;
    const uint64_t avail = ampc_memory_available(&src);
    if (need <= avail) return AMPC_OK;
    char a[32], b[32], fit[96] = "";
    if (unit && units) snprintf(fit, sizeof fit, ": at most %" PRIu64 " %s fit", avail / unit, units);
    return ampc__err(AMPC_ERR_OOM, "%s needs %s of memory, more than the %s that %s allows%s", what, fmt_size(need, a, sizeof a),
                     fmt_size(avail, b, sizeof b), src, fit);
}
