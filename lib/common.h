/* common.h: exit codes, error reporting, checked allocation, number formats.
 *
 * Every dflash library function that can fail on bad input returns an int
 * status: 0 on success, otherwise one of the DFL_EX_* exit codes below, after
 * recording a message with dfl_err(). Tools print that message, prefixed with
 * their name, and exit with the code. Internal invariants (programmer errors)
 * end the tool through DFL_ASSERT instead (exit 70): bad input must never
 * reach an assert.
 */
#ifndef DFLASH_COMMON_H
#define DFLASH_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

#define DFLASH_VERSION "0.1.0"

/* C11 _Noreturn is not C++; this spelling works in both (kernels/ include us). */
#define DFL_NORETURN __attribute__((noreturn))

/* The exit-code table, documented in every man page (EXIT STATUS). The
 * numbers follow sysexits.h where one fits, as jq and GNU tools do. */
enum {
    DFL_EX_OK       = 0,  /* success */
    DFL_EX_NEGATIVE = 1,  /* a requested check failed (e.g. a score threshold) */
    DFL_EX_USAGE    = 2,  /* bad command line */
    DFL_EX_DATA     = 65, /* malformed input: stream, safetensors, JSON, config */
    DFL_EX_NOINPUT  = 66, /* an input file or directory cannot be opened */
    DFL_EX_UNAVAIL  = 69, /* a requested facility is missing (no CUDA device) */
    DFL_EX_SOFTWARE = 70, /* internal error, CUDA/cuBLAS failure */
    DFL_EX_CANTCREAT = 73, /* an output cannot be created */
    DFL_EX_IOERR    = 74, /* read or write failure: full disk (a closed pipe kills by SIGPIPE unless ignored) */
};

/* Record an error message (printf-style) and return `code`. The message is
 * kept in a thread-local buffer until the next call; dfl_errmsg() returns it. */
int dfl_err(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *dfl_errmsg(void);
int dfl_errcode(void);

/* "" given for an input (an unset shell variable): refused, naming `what`
 * (the option, or "input"), with DFL_EX_NOINPUT. Left alone it read
 * "/config.json" for --target '' (the path joined with "/"), or failed
 * later with a message naming no option. 0 for NULL or a non-empty path. */
int dfl_in_check_name(const char *what, const char *path);
/* The error of an empty path, for inputs (DFL_EX_NOINPUT) and outputs
 * (DFL_EX_CANTCREAT, dfl_out_check_name) alike: "WHAT '': an empty path
 * names no file or directory (...)", without the prefix when `what` is NULL. */
int dfl_empty_path_err(int code, const char *what);

/* Print "prog: message" for the last recorded error and exit with its code. */
DFL_NORETURN void dfl_die_last(const char *prog);
/* Print "prog: message" and exit with `code`. */
DFL_NORETURN void dfl_die(const char *prog, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Out of memory, on the CPU (dfl_malloc and the rest below) or the GPU
 * (the CUDA backend): print "PROG: out of WHAT allocating 64.0 MiB
 * (67108864 bytes)[, DETAIL][; HINT]", remove the temporary outputs as
 * dfl_abort does and exit 70. A tool names itself and what sizes its
 * largest buffers (the option to lower) once its options are parsed, with
 * dfl_set_oom_hint; before that the message says "dflash" and no hint. */
void dfl_set_oom_hint(const char *prog, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
DFL_NORETURN void dfl_oom(const char *what, size_t bytes, const char *detail);
/* "1.5 GiB", "64.0 MiB", "12.0 KiB" or "100 bytes" into buf[32]. */
const char *dfl_human_bytes(char buf[32], double bytes);

/* Internal invariant: report file and line, remove the temporary outputs
 * (dfl_set_abort_hook) and exit 70, as an internal error. Never used for
 * input checks. */
#define DFL_ASSERT(x) \
    do { if (!(x)) dfl_abort(__FILE__, __LINE__, #x); } while (0)
DFL_NORETURN void dfl_abort(const char *file, int line, const char *what);
/* What dfl_abort runs before it exits: outfile.c's removal of temporary
 * outputs, set with the first output. */
void dfl_set_abort_hook(void (*hook)(void));

/* Allocation that aborts on failure (exit 70): used only for sizes that were
 * already validated against caps; untrusted sizes are checked first. */
void *dfl_malloc(size_t n);
void *dfl_calloc(size_t n, size_t size);
void *dfl_realloc(void *p, size_t n);
char *dfl_strdup(const char *s);
/* 64-byte aligned allocation, freed with free(). */
void *dfl_aligned_alloc(size_t n);

/* a*b with overflow detection: returns 0 and sets *out, or -1 on overflow. */
static inline int dfl_mul_overflow(uint64_t a, uint64_t b, uint64_t *out) {
    if (a != 0 && b > UINT64_MAX / a) return -1;
    *out = a * b;
    return 0;
}

/* bf16 <-> f32, round-to-nearest-even as PyTorch (c10/util/BFloat16.h). */
static inline float dfl_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t dfl_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* IEEE half <-> f32 (round-to-nearest-even). */
float dfl_f16_to_f32(uint16_t h);
uint16_t dfl_f32_to_f16(float f);

/* Parse helpers for option values; return 0 or -1. */
int dfl_parse_i64(const char *s, int64_t *out);
int dfl_parse_double(const char *s, double *out);
/* Sizes with optional K/M/G/T suffix (powers of 1024, "KiB" and "KB" alike). */
int dfl_parse_size(const char *s, uint64_t *out);

/* Open an input that must be a regular file (a model's or a checkpoint's
 * config.json, safetensors, index, trainer state) read-only, without
 * blocking: a FIFO, device, socket or directory in its place is refused
 * (a FIFO with no writer would hang open() itself). Returns 0 with the
 * descriptor in *fd and, if st is not NULL, its fstat in *st; or
 * DFL_EX_NOINPUT with "PATH: cannot open: ...", "PATH: is a directory" or
 * "PATH: is a pipe or FIFO, not a regular file". */
struct stat;
int dfl_open_regular(const char *path, int *fd, struct stat *st);
/* What a file of mode m is, for messages: "a pipe or FIFO", "a directory",
 * "a socket", "a character device", "a block device", "a special file". */
const char *dfl_file_kind(mode_t m);

/* Read a whole small regular file (a config.json) into a malloc'd buffer,
 * opened by dfl_open_regular. Files larger than `max` bytes are refused as
 * not what the caller expects. Returns 0, DFL_EX_NOINPUT, DFL_EX_DATA (too
 * large) or DFL_EX_IOERR. */
int dfl_read_file(const char *path, size_t max, const char *what, char **buf, size_t *len);

/* Parse the JSON of a regular file of at most `max` bytes (trainer_state.json,
 * a drafter's config.json read as plain JSON, a safetensors index), read by
 * dfl_read_file: a FIFO in its place is refused, not waited on. Duplicate
 * keys are refused. Returns 0 with the value in *out (json_decref it),
 * DFL_EX_NOINPUT, DFL_EX_IOERR, or DFL_EX_DATA with "PATH: not JSON: TEXT
 * (line N)". In json_file.c: common.c itself needs no jansson. */
#define DFL_JSON_FILE_MAX ((size_t)16 << 20) /* a config or a trainer state */
struct json_t;
int dfl_load_json(const char *path, size_t max, const char *what, struct json_t **out);

/* Standard input closed when the tool started (<&-). Reading "-" is then
 * "cannot open input" (66), not a read error (74) or, for JSONL, an empty
 * input (exit 0). dfl_stdin_reserve(), called first by dfl_cli_parse, notes
 * it and puts /dev/null on descriptor 0: the first file the tool opened
 * took descriptor 0 and was read again as "-" (a merge of FILE and "-"
 * read FILE's bytes from the middle). dfl_stdin_check(name) returns 0, or
 * DFL_EX_NOINPUT with "NAME: cannot open: standard input is closed". */
void dfl_stdin_reserve(void);
int dfl_stdin_check(const char *name);

/* Refuse an opened input that is a directory: fopen takes one, and only
 * the first read fails, as an I/O error (74) after outputs exist. Returns 0,
 * or DFL_EX_NOINPUT with "NAME: is a directory" recorded. */
int dfl_refuse_directory(FILE *f, const char *name);

/* Monotonic wall clock in seconds. */
double dfl_now(void);

#endif
