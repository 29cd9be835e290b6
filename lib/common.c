/* common.c: error buffer, checked allocation, number parsing, f16. */
#include "common.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static _Thread_local char err_buf[1024];
static _Thread_local int err_code;

int dfl_err(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err_buf, sizeof err_buf, fmt, ap);
    va_end(ap);
    err_code = code;
    return code;
}

const char *dfl_errmsg(void) { return err_buf[0] ? err_buf : "unknown error"; }
int dfl_errcode(void) { return err_code ? err_code : DFL_EX_SOFTWARE; }

int dfl_empty_path_err(int code, const char *what) {
    return dfl_err(code, "%s%san empty path names no file or directory (is a shell variable unset?)", what ? what : "",
                   what ? " '': " : "");
}

int dfl_in_check_name(const char *what, const char *path) {
    return path && !*path ? dfl_empty_path_err(DFL_EX_NOINPUT, what) : 0;
}

void dfl_die_last(const char *prog) {
    fprintf(stderr, "%s: %s\n", prog, dfl_errmsg());
    exit(dfl_errcode());
}

void dfl_die(const char *prog, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", prog);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(code);
}

static void (*_Atomic abort_hook)(void);

void dfl_set_abort_hook(void (*hook)(void)) { atomic_store(&abort_hook, hook); }

/* A bug, on whatever thread meets it: exit 70 as the exit table says, with
 * the temporary outputs removed as a signal would. _exit, not exit: other
 * threads (OpenMP's, the read-ahead) may be running, and atexit handlers
 * and library destructors under them can hang; the hook is all the
 * cleaning that matters. An assertion failing inside the hook (or on a
 * second thread meanwhile) exits at once. */
static DFL_NORETURN void exit_internal(void) {
    static atomic_flag exiting = ATOMIC_FLAG_INIT;
    void (*hook)(void) = atomic_load(&abort_hook);
    if (hook && !atomic_flag_test_and_set(&exiting)) hook();
    _exit(DFL_EX_SOFTWARE);
}

void dfl_abort(const char *file, int line, const char *what) {
    fprintf(stderr, "dflash: internal error at %s:%d: assertion '%s' failed\n", file, line, what);
    exit_internal();
}

/* Set once, before the work and its threads start. */
static const char *oom_prog = "dflash";
static char oom_hint[256];

void dfl_set_oom_hint(const char *prog, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(oom_hint, sizeof oom_hint, fmt, ap);
    va_end(ap);
    oom_prog = prog;
}

const char *dfl_human_bytes(char buf[32], double bytes) {
    static const char *const unit[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
    if (bytes < 1024) {
        snprintf(buf, 32, "%.0f bytes", bytes);
        return buf;
    }
    int u = 0;
    for (bytes /= 1024; bytes >= 1024 && u < 4; u++) bytes /= 1024;
    snprintf(buf, 32, "%.1f %s", bytes, unit[u]);
    return buf;
}

/* No allocation here: the message is printed straight to stderr. An
 * allocation fails on whatever thread needs it, possibly inside a parallel
 * region, so the end is dfl_abort's (the hook, then _exit), not exit(). */
void dfl_oom(const char *what, size_t bytes, const char *detail) {
    char size[32];
    fprintf(stderr, "%s: out of %s allocating %s (%zu bytes)%s%s%s%s\n", oom_prog, what,
            dfl_human_bytes(size, (double)bytes), bytes, detail ? ", " : "", detail ? detail : "",
            oom_hint[0] ? "; " : "", oom_hint);
    exit_internal();
}

static void *out_of_memory(size_t n) { dfl_oom("memory", n, NULL); }

void *dfl_malloc(size_t n) {
    void *p = malloc(n ? n : 1);
    return p ? p : out_of_memory(n);
}

void *dfl_calloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    return p ? p : out_of_memory(n * size);
}

void *dfl_realloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    return q ? q : out_of_memory(n);
}

char *dfl_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    return memcpy(dfl_malloc(n), s, n);
}

void *dfl_aligned_alloc(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0) return out_of_memory(n);
    return p;
}

float dfl_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        float f = ldexpf((float)man, -24); /* subnormal or zero */
        return sign ? -f : f;
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t dfl_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00;        /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00;       /* overflow -> inf */
    if (a < 0x38800000u) {                            /* subnormal or zero */
        float af;
        memcpy(&af, &a, 4);
        return sign | (uint16_t)lrintf(af * 16777216.0f); /* 2^24, RNE */
    }
    uint32_t r = a + 0x7ffu + ((a >> 13) & 1u) - 0x38000000u; /* rebias 127->15, RNE */
    return sign | (uint16_t)(r >> 13);
}

int dfl_parse_i64(const char *s, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end) return -1;
    *out = v;
    return 0;
}

int dfl_parse_double(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

int dfl_parse_size(const char *s, uint64_t *out) {
    char *end;
    errno = 0;
    if (!isdigit((unsigned char)*s)) return -1;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0) return -1;
    double mult = 1;
    switch (toupper((unsigned char)*end)) {
    case 'K': mult = 1024.0; end++; break;
    case 'M': mult = 1048576.0; end++; break;
    case 'G': mult = 1073741824.0; end++; break;
    case 'T': mult = 1099511627776.0; end++; break;
    default: break;
    }
    if (mult > 1) {
        if (*end == 'i' && toupper((unsigned char)end[1]) == 'B') end += 2;
        else if (toupper((unsigned char)*end) == 'B') end++;
    } else if (toupper((unsigned char)*end) == 'B') {
        end++;
    }
    if (*end) return -1;
    v *= mult;
    if (v >= 18446744073709551615.0) return -1;
    *out = (uint64_t)v;
    return 0;
}

double dfl_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int stdin_closed; /* descriptor 0 was closed at dfl_stdin_reserve */

static int fd0_closed(void) { return fcntl(STDIN_FILENO, F_GETFD) < 0 && errno == EBADF; }

void dfl_stdin_reserve(void) {
    if (!fd0_closed()) return;
    stdin_closed = 1;
    int fd = open("/dev/null", O_RDONLY); /* the lowest free descriptor: 0 */
    if (fd > STDIN_FILENO) close(fd);
}

int dfl_stdin_check(const char *name) {
    /* fd0_closed too: a program that never called dfl_stdin_reserve */
    if (stdin_closed || fd0_closed()) return dfl_err(DFL_EX_NOINPUT, "%s: cannot open: standard input is closed", name);
    return 0;
}

int dfl_refuse_directory(FILE *f, const char *name) {
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) return dfl_err(DFL_EX_NOINPUT, "%s: is a directory", name);
    return 0;
}

const char *dfl_file_kind(mode_t m) {
    return S_ISFIFO(m) ? "a pipe or FIFO" : S_ISDIR(m) ? "a directory" : S_ISSOCK(m) ? "a socket"
         : S_ISCHR(m) ? "a character device" : S_ISBLK(m) ? "a block device" : "a special file";
}

int dfl_open_regular(const char *path, int *fd_out, struct stat *st_out) {
    *fd_out = -1;
    /* O_NONBLOCK: a FIFO with no writer would block open() itself, before
     * fstat could refuse it (a tool hung on a FIFO put in place of a model's
     * file). On the regular file that passes, the flag changes nothing: a
     * regular file's reads and mmap never block in its sense. */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return dfl_err(DFL_EX_NOINPUT, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return dfl_err(DFL_EX_NOINPUT, "%s: cannot open: %s", path, strerror(e));
    }
    if (S_ISDIR(st.st_mode)) {
        close(fd);
        return dfl_err(DFL_EX_NOINPUT, "%s: is a directory", path);
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return dfl_err(DFL_EX_NOINPUT, "%s: is %s, not a regular file", path, dfl_file_kind(st.st_mode));
    }
    *fd_out = fd;
    if (st_out) *st_out = st;
    return 0;
}

int dfl_read_file(const char *path, size_t max, const char *what, char **buf, size_t *len) {
    int fd;
    int rc = dfl_open_regular(path, &fd, NULL);
    if (rc) return rc;
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return dfl_err(DFL_EX_SOFTWARE, "%s: fdopen: %s", path, strerror(errno)); /* out of memory */
    }
    size_t cap = 4096, n = 0;
    char *b = dfl_malloc(cap);
    for (;;) {
        if (n == cap) {
            if (cap > max) {
                fclose(f);
                free(b);
                return dfl_err(DFL_EX_DATA, "%s: larger than %zu bytes, not a %s", path, max, what);
            }
            b = dfl_realloc(b, cap *= 2);
        }
        size_t r = fread(b + n, 1, cap - n, f);
        if (r == 0) break;
        n += r;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(b);
        return dfl_err(DFL_EX_IOERR, "%s: read error", path);
    }
    *buf = b;
    *len = n;
    return 0;
}
