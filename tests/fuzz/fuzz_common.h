/*
 * fuzz_common.h - helpers shared by the libFuzzer harnesses (tests/fuzz/fuzz_*.c).
 *
 * Every harness is one LLVMFuzzerTestOneInput and compiles two ways: with clang and libFuzzer
 * (cmake -DAMPC_FUZZ=ON, `make fuzz`), and with gcc without libFuzzer, linked to
 * tests/fuzz/replay.c, which runs it over the seed corpus and the committed crash inputs
 * (ctest fuzz_replay_<reader>). Readers that take a path get the bytes written to a file in one
 * temporary folder per process (in /dev/shm when there is one), made on first use and removed at
 * exit. Each input starts from the same library state: error cleared, generator reseeded.
 */
#ifndef AMPC_FUZZ_COMMON_H
#define AMPC_FUZZ_COMMON_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif
#include "ampc.h"

#include <fcntl.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char fuzz_dir_[256];

static inline int fuzz_rm_(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    remove(path);
    return 0;
}

static inline void fuzz_cleanup_(void) {
    if (fuzz_dir_[0]) nftw(fuzz_dir_, fuzz_rm_, 8, FTW_DEPTH | FTW_PHYS);
}

/* The process's temporary folder (exits the harness, not the library, if none can be made). */
static inline const char *fuzz_dir(void) {
    if (fuzz_dir_[0]) return fuzz_dir_;
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(fuzz_dir_, sizeof fuzz_dir_, "%s/ampc-fuzz-XXXXXX", base);
    if (!mkdtemp(fuzz_dir_)) {
        perror("fuzz: mkdtemp");
        exit(2);
    }
    atexit(fuzz_cleanup_);
    return fuzz_dir_;
}

/* dir/name into buf (PATH_MAX-sized buffers are enough: names are short constants). */
static inline const char *fuzz_path(char *buf, size_t n, const char *name) {
    snprintf(buf, n, "%s/%s", fuzz_dir(), name);
    return buf;
}

/* Writes n bytes to path (replacing it); exits the harness on failure (a broken /dev/shm is not
   a finding). */
static inline void fuzz_write(const char *path, const void *data, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    const char *p = data;
    while (fd >= 0 && n) {
        ssize_t k = write(fd, p, n);
        if (k <= 0) break;
        p += k;
        n -= (size_t)k;
    }
    if (fd < 0 || n || close(fd) != 0) {
        perror(path);
        exit(2);
    }
}

/* The whole file at path, malloc'd (the caller frees it), its size in *n; exits the harness when
   it cannot be read (as fuzz_write). */
static inline uint8_t *fuzz_read(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    long k = f && fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    uint8_t *b = k >= 0 ? malloc((size_t)k + 1) : NULL;
    if (f) rewind(f);
    if (!b || fread(b, 1, (size_t)k, f) != (size_t)k) {
        perror(path);
        exit(2);
    }
    fclose(f);
    *n = (size_t)k;
    return b;
}

/* Per input: the library initialised once, then the same state for every input. */
static inline void fuzz_begin(void) {
    static int done;
    if (!done) {
        ampc_init();
        ampc_set_num_threads(1);
        done = 1;
    }
    ampc_clear_error();
    ampc_manual_seed(0);
}

/* With AMPC_FUZZ_VERBOSE=1 in the environment, one line per call: what was read and the
   outcome (to check that the seeds reach the success paths: `AMPC_FUZZ_VERBOSE=1 ctest -V`). */
static inline void fuzz_report(const char *what, bool ok) {
    static int verbose = -1;
    if (verbose < 0) verbose = getenv("AMPC_FUZZ_VERBOSE") && getenv("AMPC_FUZZ_VERBOSE")[0] == '1';
    if (verbose) fprintf(stderr, "  %s: %s\n", what, ok ? "ok" : ampc_last_error());
}

#endif /* AMPC_FUZZ_COMMON_H */
