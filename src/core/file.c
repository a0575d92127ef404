/*
 * file.c - opening files that come from outside (datasets, checkpoints, CSV indexes).
 *
 * A path may name a FIFO, a character device or a directory: opening a FIFO for reading blocks
 * until a writer appears, forever if none does. So every reader opens with O_NONBLOCK (which
 * makes open() itself return at once on a FIFO), checks with fstat() on the descriptor it holds
 * (no window between the check and the use) that it is a regular file, and only then clears
 * O_NONBLOCK. Symbolic links to regular files are followed as usual.
 */
#include "core/core.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

const char *ampc__file_type_name(unsigned mode) {
    mode_t m = (mode_t)mode;
    if (S_ISDIR(m)) return "a directory";
    if (S_ISFIFO(m)) return "a FIFO (named pipe)";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISSOCK(m)) return "a socket";
    return "not a regular file";
}

int ampc__open_regular(const char *path, const char *what, struct stat *st_out) {
    if (!path) return ampc__err(AMPC_ERR_INVALID, "%s: no path", what);
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) return ampc__err(AMPC_ERR_IO, "%s: cannot open '%s': %s", what, path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return ampc__err(AMPC_ERR_IO, "%s: cannot stat '%s': %s", what, path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return ampc__err(AMPC_ERR_IO, "%s: '%s' is %s, not a regular file", what, path, ampc__file_type_name(st.st_mode));
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0) {
        int e = errno;
        close(fd);
        return ampc__err(AMPC_ERR_IO, "%s: '%s': %s", what, path, strerror(e));
    }
    if (st_out) *st_out = st;
    return fd;
}

FILE *ampc__fopen_regular(const char *path, const char *what, struct stat *st_out) {
    int fd = ampc__open_regular(path, what, st_out);
    if (fd < 0) return NULL;
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        int e = errno;
        close(fd);
        return ampc__err_null(AMPC_ERR_IO, "%s: '%s': %s", what, path, strerror(e));
    }
    return f;
}

// ---------------------------------------------------------------------------------------------
// Temporaries of atomic writes

/* A file is replaced atomically by writing "<path>.tmp.<pid>" and renaming it over path. A process
   killed in between leaves its temporary behind: full-size, and never renamed. Such a file is
   stale once its process is gone (kill(pid, 0) fails with ESRCH); one of a live process (a
   concurrent writer) is left alone. */
int ampc__remove_stale_temps(const char *path) {
    if (!path || !*path) return 0;
    const char *slash = strrchr(path, '/');
    char dir[4096];
    const char *base = slash ? slash + 1 : path;
    int dl = slash ? snprintf(dir, sizeof dir, "%.*s", (int)(slash == path ? 1 : slash - path), path) : snprintf(dir, sizeof dir, ".");
    if (dl < 0 || (size_t)dl >= sizeof dir) return 0;
    DIR *d = opendir(dir);
    if (!d) return 0;
    size_t bl = strlen(base);
    int removed = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *n = e->d_name;
        if (strncmp(n, base, bl) != 0 || strncmp(n + bl, ".tmp.", 5) != 0) continue;
        char *end;
        errno = 0;
        long pid = strtol(n + bl + 5, &end, 10);
        if (*end || errno || pid <= 0 || pid > INT32_MAX || pid == (long)getpid()) continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;   /* alive, or not ours to judge */
        char full[8192];
        if (snprintf(full, sizeof full, "%s/%s", dir, n) >= (int)sizeof full) continue;
        struct stat st;
        if (lstat(full, &st) == 0 && S_ISREG(st.st_mode) && unlink(full) == 0) removed++;
    }
    closedir(d);
    return removed;
}
