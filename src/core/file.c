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

#include <errno.h>
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
