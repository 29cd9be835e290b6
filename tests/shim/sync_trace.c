/* sync_trace.c: an LD_PRELOAD library for tests/cli/test_durability.sh. It
 * records, in order, the calls by which an output becomes durable (fsync,
 * fdatasync, syncfs with the path their descriptor names; rename,
 * renameat2; rmdir, by which a replaced output is removed) to the file
 * named by $SYNC_TRACE, one line each, and then makes the real call. The
 * test reads the order from the kernel's side of the library boundary: what
 * the tools asked for, not what they say. $SYNC_TRACE_FAIL ("syncfs", or
 * "fsync:PART" for the paths that contain PART) makes those calls fail with
 * EIO instead, as a failing disk does; "exchange" makes renameat2's
 * RENAME_EXCHANGE fail with EINVAL, as on a filesystem without it. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The real function behind `name`: the next definition after this one. */
static void *real(const char *name) {
    void *f = dlsym(RTLD_NEXT, name);
    if (!f) {
        fprintf(stderr, "sync_trace: no %s to wrap\n", name);
        abort();
    }
    return f;
}

/* One line, appended with one write(2) so lines never interleave. */
static void record(const char *what, const char *a, const char *b) {
    const char *out = getenv("SYNC_TRACE");
    if (!out) return;
    char line[2 * PATH_MAX + 64];
    int n = snprintf(line, sizeof line, "%s %s%s%s\n", what, a, b ? " " : "", b ? b : "");
    if (n < 0 || (size_t)n >= sizeof line) return;
    int fd = open(out, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return;
    if (write(fd, line, (size_t)n) != n) { /* a short trace fails the test that reads it */ }
    close(fd);
}

/* Does $SYNC_TRACE_FAIL ask this call on this path to fail? */
static int should_fail(const char *what, const char *path) {
    const char *spec = getenv("SYNC_TRACE_FAIL");
    size_t k = strlen(what);
    if (!spec || strncmp(spec, what, k) != 0) return 0;
    if (!spec[k]) return 1;
    if (spec[k] != ':') return 0;
    return strstr(path, spec + k + 1) != NULL;
}

/* Record a sync of descriptor fd; -1 (errno EIO) when it is to fail. */
static int record_fd(const char *what, int fd) {
    char link[64], path[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 0) n = 0;
    path[n] = 0;
    int failing = should_fail(what, path);
    record(failing ? "failed" : what, path, failing ? what : NULL);
    if (failing) errno = EIO;
    return failing ? -1 : 0;
}

int fsync(int fd) {
    if (record_fd("fsync", fd)) return -1;
    return ((int (*)(int))real("fsync"))(fd);
}

int fdatasync(int fd) {
    if (record_fd("fdatasync", fd)) return -1;
    return ((int (*)(int))real("fdatasync"))(fd);
}

int syncfs(int fd) {
    if (record_fd("syncfs", fd)) return -1;
    return ((int (*)(int))real("syncfs"))(fd);
}

int rename(const char *from, const char *to) {
    record("rename", from, to);
    return ((int (*)(const char *, const char *))real("rename"))(from, to);
}

int renameat2(int olddir, const char *from, int newdir, const char *to, unsigned flags) {
    if ((flags & RENAME_EXCHANGE) && should_fail("exchange", to)) {
        record("failed", from, "exchange");
        errno = EINVAL;
        return -1;
    }
    record(flags & RENAME_EXCHANGE ? "exchange" : "rename", from, to);
    return ((int (*)(int, const char *, int, const char *, unsigned))real("renameat2"))(olddir, from, newdir, to,
                                                                                       flags);
}

int rmdir(const char *path) {
    record("rmdir", path, NULL);
    return ((int (*)(const char *))real("rmdir"))(path);
}
