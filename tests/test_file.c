/*
 * test_file.c - src/core/file.c: opening outside files (FIFOs, devices and directories refused at
 * once, symlinks to regular files followed) and removing the temporaries that a killed writer
 * leaves behind (only those of dead processes).
 */
#include "testutil.h"

#include "core/core.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[256];

static int setup(void **state) {
    (void)state;
    snprintf(dir, sizeof dir, "%s/ampc_test_file.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    return mkdtemp(dir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) == 0 ? 0 : -1;
}

static void path_of(char *buf, size_t n, const char *name) { snprintf(buf, n, "%s/%s", dir, name); }

static void touch(const char *name, const char *text) {
    char p[512];
    path_of(p, sizeof p, name);
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* A FIFO with no writer: open() would block forever without O_NONBLOCK. alarm() turns a
   regression into a failure instead of a hang. */
static void test_open_regular(void **state) {
    (void)state;
    char p[512], l[512];
    alarm(20);
    touch("plain", "abc");
    struct stat st;
    path_of(p, sizeof p, "plain");
    int fd = ampc__open_regular(p, "test", &st);
    assert_true(fd >= 0);
    char buf[8] = {0};
    assert_int_equal(read(fd, buf, sizeof buf), 3);   /* blocking reads work: O_NONBLOCK was cleared */
    assert_string_equal(buf, "abc");
    assert_int_equal(st.st_size, 3);
    close(fd);

    path_of(l, sizeof l, "link");   /* a symlink to a regular file is fine */
    assert_int_equal(symlink(p, l), 0);
    FILE *f = ampc__fopen_regular(l, "test", NULL);
    assert_non_null(f);
    assert_int_equal(fgetc(f), 'a');
    fclose(f);

    path_of(p, sizeof p, "fifo");
    assert_int_equal(mkfifo(p, 0600), 0);
    assert_int_equal(ampc__open_regular(p, "IDX file", NULL), AMPC_ERR_IO);
    const char *m = ampc_last_error();
    if (!strstr(m, "IDX file") || !strstr(m, p) || !strstr(m, "FIFO")) fail_msg("message: '%s'", m);
    path_of(l, sizeof l, "fifolink");   /* nor through a link */
    assert_int_equal(symlink(p, l), 0);
    assert_null(ampc__fopen_regular(l, "checkpoint", NULL));
    assert_int_equal(ampc_last_status(), AMPC_ERR_IO);
    assert_non_null(strstr(ampc_last_error(), "FIFO"));

    assert_int_equal(ampc__open_regular(dir, "data", NULL), AMPC_ERR_IO);
    assert_non_null(strstr(ampc_last_error(), "directory"));
    assert_int_equal(ampc__open_regular("/dev/null", "data", NULL), AMPC_ERR_IO);
    assert_non_null(strstr(ampc_last_error(), "character device"));
    path_of(p, sizeof p, "missing");
    assert_int_equal(ampc__open_regular(p, "data", NULL), AMPC_ERR_IO);
    assert_non_null(strstr(ampc_last_error(), "No such file"));
    alarm(0);
}

/* A pid that is certainly gone: a child that has exited and been reaped. */
static pid_t dead_pid(void) {
    pid_t pid = fork();
    if (pid == 0) _exit(0);
    assert_true(pid > 0);
    waitpid(pid, NULL, 0);
    return pid;
}

static bool exists(const char *name) {
    char p[512];
    path_of(p, sizeof p, name);
    return access(p, F_OK) == 0;
}

static void test_remove_stale_temps(void **state) {
    (void)state;
    char dead[64], live[64], self[64], target[512];
    snprintf(dead, sizeof dead, "ck.safetensors.tmp.%ld", (long)dead_pid());
    snprintf(live, sizeof live, "ck.safetensors.tmp.%ld", (long)getppid());   /* a live process: a concurrent writer */
    snprintf(self, sizeof self, "ck.safetensors.tmp.%ld", (long)getpid());
    touch("ck.safetensors", "good");
    touch(dead, "torn");
    touch(live, "in progress");
    touch(self, "ours");
    touch("ck.safetensors.tmp.notapid", "x");
    touch("other.safetensors.tmp.1", "x");   /* another file's temporary */
    path_of(target, sizeof target, "ck.safetensors");
    assert_int_equal(ampc__remove_stale_temps(target), 1);
    assert_false(exists(dead));
    assert_true(exists("ck.safetensors") && exists(live) && exists(self) && exists("ck.safetensors.tmp.notapid") &&
                exists("other.safetensors.tmp.1"));
    assert_int_equal(ampc__remove_stale_temps(target), 0);
    assert_int_equal(ampc__remove_stale_temps(NULL), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_open_regular),
        cmocka_unit_test(test_remove_stale_temps),
    };
    return cmocka_run_group_tests_name("file", tests, setup, teardown);
}
