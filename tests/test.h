/* test.h: the unit-test harness. Each test file defines test functions and
 * a main() that runs them with T_RUN(fn); each prints "PASS name" or
 * "FAIL name" and main returns t_exit(), non-zero on any failure. The runner
 * (tests/run.sh) counts the PASS/FAIL lines. */
#ifndef DFLASH_TEST_H
#define DFLASH_TEST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static int t_failed_now, t_failed_total, t_passed_total;

/* UNDER_ASAN: built with AddressSanitizer (gcc or clang), for the tests
 * that size allocations or limits around it. */
#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif

#define T_CHECK(c) \
    do { if (!(c)) { fprintf(stderr, "  %s:%d: check failed: %s\n", __FILE__, __LINE__, #c); t_failed_now = 1; } } while (0)
#define T_CHECKF(c, ...) \
    do { if (!(c)) { fprintf(stderr, "  %s:%d: check failed: %s: ", __FILE__, __LINE__, #c); \
                     fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); t_failed_now = 1; } } while (0)
#define T_RUN(fn) t_run(#fn, fn)

static inline void t_run(const char *name, void (*fn)(void)) {
    t_failed_now = 0;
    fn();
    if (t_failed_now) t_failed_total++;
    else t_passed_total++;
    printf("%s %s\n", t_failed_now ? "FAIL" : "PASS", name);
    fflush(stdout);
}

static inline int t_exit(void) { return t_failed_total ? 1 : 0; }

/* Remove a test's scratch directory and all in it; system()'s status. */
static inline int t_rm_rf(const char *dir) {
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd);
}

/* Read what a child writes to the pipe `fd` until it closes its end (or
 * `cap` - 1 bytes came), NUL-terminate it and close `fd`; the length. */
static inline size_t t_read_pipe(int fd, char *buf, size_t cap) {
    size_t n = 0;
    ssize_t k;
    while (n < cap - 1 && (k = read(fd, buf + n, cap - 1 - n)) > 0) n += (size_t)k;
    buf[n] = 0;
    close(fd);
    return n;
}

/* Normalised error sum (a-b)^2 / sum b^2 (b is the reference). */
static inline double t_nmse_f32(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    return den > 0 ? num / den : num;
}

#endif
