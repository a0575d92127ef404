/*
 * file.c - opening files that come from outside (datasets, checkpoints, CSV indexes).
 *
 * A path may name a FIFO, a character device or a directory: opening a FIFO for reading blocks
 * until a writer appears, forever if none does. So every reader opens with O_NONBLOCK (which
 * makes open() itself return at once on a FIFO), checks with fstat() on the descriptor it holds
 * (no window between the check and the use) that it is a regular file, and only then clears
 * O_NONBLOCK. Symbolic links to regular files are followed as usual.
 *
 * Outputs (ampc_output_fopen) go into folders others may write to: the same without blocking,
 * and a symbolic link is refused rather than followed, so a link planted there never makes a
 * write land outside the folder.
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
    if (S_ISLNK(m)) return "a symbolic link";
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
// Outputs

FILE *ampc_output_fopen(const char *path, const char *what, const char *mode) {
    if (!path || !what || !mode) return ampc__err_null(AMPC_ERR_INVALID, "output_fopen: NULL path, what or mode");
    int fl;
    bool trunc = false;
    switch (mode[0]) {
    case 'r': fl = mode[1] == '+' ? O_RDWR : O_RDONLY; break;
    case 'w': fl = (mode[1] == '+' ? O_RDWR : O_WRONLY) | O_CREAT, trunc = true; break;
    case 'a': fl = (mode[1] == '+' ? O_RDWR : O_WRONLY) | O_CREAT | O_APPEND; break;
    default: return ampc__err_null(AMPC_ERR_INVALID, "output_fopen: mode '%s'", mode);
    }
    if (strchr(mode, 'x')) fl |= O_EXCL;
    int fd = open(path, fl | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY, 0666);
    struct stat st;
    if (fd < 0) {
        int e = errno;
        /* ELOOP (a link), ENXIO (a FIFO without a reader), EISDIR...: say what is there */
        if (lstat(path, &st) == 0 && !S_ISREG(st.st_mode) && !(fl & O_EXCL))
            ampc__err(AMPC_ERR_IO, "%s: '%s' is %s, not a regular file", what, path, ampc__file_type_name(st.st_mode));
        else
            ampc__err(AMPC_ERR_IO, "%s: can't open '%s': %s", what, path, strerror(e));
        errno = e;   /* the caller may test for ENOENT */
        return NULL;
    }
    const char *fail = NULL;
    if (fstat(fd, &st) != 0) fail = "stat";
    else if (!S_ISREG(st.st_mode)) {   /* a FIFO opened for reading: not one byte read from it */
        close(fd);
        return ampc__err_null(AMPC_ERR_IO, "%s: '%s' is %s, not a regular file", what, path, ampc__file_type_name(st.st_mode));
    } else if (trunc && ftruncate(fd, 0) != 0) fail = "truncate";   /* only once it is known to be a file */
    else {
        int f = fcntl(fd, F_GETFL);
        if (f < 0 || fcntl(fd, F_SETFL, f & ~O_NONBLOCK) < 0) fail = "fcntl";
    }
    FILE *fp = fail ? NULL : fdopen(fd, mode);   /* fdopen never truncates: done above */
    if (!fp) {
        int e = errno;
        close(fd);
        return ampc__err_null(AMPC_ERR_IO, "%s: '%s': %s failed: %s", what, path, fail ? fail : "fdopen", strerror(e));
    }
    return fp;
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
