/*
 * replay.c - runs one fuzz harness (linked in beside it) over every file of the folders or
 * files given, without libFuzzer: the seed corpus and the committed crash inputs of each
 * harness go through the normal and the ASan build as ctest tests (fuzz_replay_<reader>).
 *
 *     fuzz_replay_<reader> DIR_OR_FILE...
 *
 * Files are taken in name order; names starting with '.' and README files are skipped, so an
 * empty regress folder can hold a README. A missing folder is an error (a typo would otherwise
 * replay nothing). Exit 0 when every input ran (a crash ends the process, as under libFuzzer).
 */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    for (size_t k; buf && (k = fread(buf + n, 1, cap - n, f)) > 0;) {
        n += k;
        if (n == cap) {
            uint8_t *b = realloc(buf, cap *= 2);
            if (!b) free(buf);
            buf = b;
        }
    }
    fclose(f);
    if (!buf) {
        fprintf(stderr, "replay: %s: out of memory\n", path);
        return -1;
    }
    fprintf(stderr, "replay: %s (%zu bytes)\n", path, n);
    LLVMFuzzerTestOneInput(buf, n);
    free(buf);
    return 0;
}

static int skipped(const char *name) { return name[0] == '.' || !strncmp(name, "README", 6); }

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Every file of dir (not recursive), in name order; returns the count run or -1. */
static int run_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "replay: %s: %s\n", dir, strerror(errno));
        return -1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (skipped(e->d_name)) continue;
        if (n == cap) {
            char **v = realloc(names, (cap = cap ? 2 * cap : 64) * sizeof *names);
            if (!v) {
                rc = -1;
                break;
            }
            names = v;
        }
        if (!(names[n] = malloc(strlen(dir) + strlen(e->d_name) + 2))) {
            rc = -1;
            break;
        }
        sprintf(names[n++], "%s/%s", dir, e->d_name);
    }
    closedir(d);
    if (n) qsort(names, n, sizeof *names, cmp_names);
    int count = 0;
    for (size_t i = 0; i < n; i++) {
        struct stat st;
        if (rc == 0 && stat(names[i], &st) == 0 && S_ISREG(st.st_mode)) {
            if (run_file(names[i]) < 0) rc = -1;
            else count++;
        }
        free(names[i]);
    }
    free(names);
    return rc < 0 ? -1 : count;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s DIR_OR_FILE...\n", argv[0]);
        return 2;
    }
    int total = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        int k = stat(argv[i], &st) != 0 ? (fprintf(stderr, "replay: %s: %s\n", argv[i], strerror(errno)), -1)
                : S_ISDIR(st.st_mode)   ? run_dir(argv[i])
                                        : (run_file(argv[i]) < 0 ? -1 : 1);
        if (k < 0) return 1;
        total += k;
    }
    printf("replay: %d inputs ran\n", total);
    return 0;
}
