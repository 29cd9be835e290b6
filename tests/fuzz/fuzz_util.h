/* fuzz_util.h: what the fuzz targets share. FUZZ_CHECK(c) aborts with the
 * failed invariant named, so libFuzzer reports it as a crash; fuzz_memfd
 * gives a reader that only takes paths the input as a file. */
#ifndef DFLASH_FUZZ_UTIL_H
#define DFLASH_FUZZ_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

#define FUZZ_CHECK(c)                                                                       \
    do {                                                                                    \
        if (!(c)) {                                                                         \
            fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #c);       \
            abort();                                                                        \
        }                                                                                   \
    } while (0)

/* The input in an anonymous in-memory file; `path` (n >= 32 bytes) names it
 * as /proc/self/fd/N. Returns the descriptor, which the caller closes. */
static inline int fuzz_memfd(const char *name, const uint8_t *data, size_t size, char *path, size_t n) {
    int fd = memfd_create(name, 0);
    if (fd < 0) abort();
    if (size && write(fd, data, size) != (ssize_t)size) abort();
    snprintf(path, n, "/proc/self/fd/%d", fd);
    return fd;
}

#endif
