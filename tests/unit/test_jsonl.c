/* test_jsonl.c: the tokenized-sample reader: good samples, every error named
 * by line and field, and reading on after a bad sample. */
#include "common.h"
#include "jsonl.h"
#include "test.h"

#include <stdlib.h>
#include <unistd.h>

static char path[] = "/tmp/dflash-jsonl-XXXXXX";

static void write_file(const char *text) {
    FILE *f = fopen(path, "wb");
    fputs(text, f);
    fclose(f);
}

/* For text with NUL bytes, which fputs would end at. */
static void write_bytes(const char *bytes, size_t n) {
    FILE *f = fopen(path, "wb");
    fwrite(bytes, 1, n, f);
    fclose(f);
}

static void test_good_samples(void) {
    write_file("{\"id\": \"a\", \"input_ids\": [0, 5, 210], \"loss_mask\": [0, 1, 1]}\n"
               "\n"
               "   \n"
               "{\"input_ids\": [7], \"id\": 42, \"extra\": {\"x\": 1}}\r\n"
               "{\"input_ids\": [1, 2], \"loss_mask\": [true, false]}"); /* no final newline */
    dfl_jsonl *r;
    T_CHECK(dfl_jsonl_open(&r, path, 211) == 0);
    dfl_jsonl_sample s;
    T_CHECK(dfl_jsonl_next(r, &s) == 1);
    T_CHECK(!strcmp(s.id, "a") && s.n == 3 && s.line == 1);
    T_CHECK(s.input_ids[0] == 0 && s.input_ids[1] == 5 && s.input_ids[2] == 210);
    T_CHECK(s.loss_mask[0] == 0 && s.loss_mask[1] == 1 && s.loss_mask[2] == 1);
    T_CHECK(dfl_jsonl_next(r, &s) == 1);
    T_CHECK(!strcmp(s.id, "42") && s.n == 1 && s.input_ids[0] == 7 && s.loss_mask[0] == 1 && s.line == 4);
    T_CHECK(dfl_jsonl_next(r, &s) == 1);
    T_CHECK(!strcmp(s.id, "line-5") && s.n == 2 && s.loss_mask[0] == 1 && s.loss_mask[1] == 0);
    T_CHECK(dfl_jsonl_next(r, &s) == 0);
    T_CHECK(dfl_jsonl_next(r, &s) == 0);
    dfl_jsonl_close(r);
}

/* Each bad line gives DFL_EX_DATA with "file:line: field" in the message,
 * and the next call reads the following line. */
static void test_errors_and_resume(void) {
    static const struct {
        const char *line, *want;
    } bad[] = {
        {"{\"input_ids\": [1, 211]}", ":1: input_ids[1]: token id 211 is outside the vocabulary [0, 211)"},
        {"{\"input_ids\": [-1]}", ":2: input_ids[0]: token id -1"},
        {"{\"input_ids\": []}", ":3: input_ids: empty sample"},
        {"{\"input_ids\": [1, 2], \"loss_mask\": [1]}", ":4: loss_mask: 1 entries for 2 input_ids"},
        {"{\"input_ids\": [1, 2], \"loss_mask\": [1, 2]}", ":5: loss_mask[1]: must be 0 or 1"},
        {"{\"input_ids\": [1, 2", ":6: malformed JSON"},
        {"{\"id\": \"x\"}", ":7: input_ids: missing"},
        {"[1, 2, 3]", ":8: not a JSON object"},
        {"{\"input_ids\": [1.5]}", ":9: input_ids[0]: not an integer"},
        {"{\"input_ids\": \"abc\"}", ":10: input_ids: not an array"},
        {"{\"input_ids\": [1], \"id\": [1]}", ":11: id: must be a string or an integer"},
        {"{\"input_ids\": [1], \"input_ids\": [2]}", ":12: malformed JSON"},
        {"{\"input_ids\": [99999999999999999999]}", ":13: malformed JSON"},
    };
    size_t n = sizeof bad / sizeof bad[0];
    char *text = dfl_calloc(1, 65536);
    for (size_t i = 0; i < n; i++) {
        strcat(text, bad[i].line);
        strcat(text, "\n");
    }
    strcat(text, "{\"input_ids\": [3]}\n");
    write_file(text);
    free(text);
    dfl_jsonl *r;
    T_CHECK(dfl_jsonl_open(&r, path, 211) == 0);
    dfl_jsonl_sample s;
    for (size_t i = 0; i < n; i++) {
        int rc = dfl_jsonl_next(r, &s);
        T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), bad[i].want) && strstr(dfl_errmsg(), path),
                 "case %zu: rc %d, message '%s', wanted '%s'", i, rc, dfl_errmsg(), bad[i].want);
    }
    T_CHECK(dfl_jsonl_next(r, &s) == 1 && s.n == 1 && s.input_ids[0] == 3 && s.line == (int64_t)n + 1);
    T_CHECK(dfl_jsonl_next(r, &s) == 0);
    dfl_jsonl_close(r);
}

static void test_no_vocab_check_and_missing_file(void) {
    write_file("{\"input_ids\": [100000]}\n");
    dfl_jsonl *r;
    T_CHECK(dfl_jsonl_open(&r, path, 0) == 0);
    dfl_jsonl_sample s;
    T_CHECK(dfl_jsonl_next(r, &s) == 1 && s.input_ids[0] == 100000);
    dfl_jsonl_close(r);
    T_CHECK(dfl_jsonl_open(&r, "/nonexistent/x.jsonl", 10) == DFL_EX_NOINPUT && strstr(dfl_errmsg(), "x.jsonl"));
}

/* A line longer than the first buffer (64 KiB) is read whole. */
static void test_long_line(void) {
    int n = 50000;
    size_t cap = (size_t)n * 8 + 64;
    char *text = dfl_malloc(cap), *p = text;
    p += sprintf(p, "{\"input_ids\": [");
    for (int i = 0; i < n; i++) p += sprintf(p, "%s%d", i ? "," : "", i % 211);
    p += sprintf(p, "]}\n{\"input_ids\": [4]}\n");
    write_file(text);
    free(text);
    dfl_jsonl *r;
    T_CHECK(dfl_jsonl_open(&r, path, 211) == 0);
    dfl_jsonl_sample s;
    T_CHECK(dfl_jsonl_next(r, &s) == 1 && s.n == n && s.input_ids[n - 1] == (n - 1) % 211);
    T_CHECK(dfl_jsonl_next(r, &s) == 1 && s.n == 1 && s.line == 2);
    dfl_jsonl_close(r);
}

/* A NUL byte makes its line a bad sample, named by line and column; the
 * lines after it are read on their own (fgets and strlen glued the next
 * line onto the bad one, or skipped it after a NUL at a line's start). */
static void test_nul_byte(void) {
    static const char text[] = "{\"id\":\"a\",\"input_ids\":[1,2]}\0junk\n"
                               "{\"id\":\"b\",\"input_ids\":[3]}\n"
                               "\0{\"id\":\"c\",\"input_ids\":[4]}\n"
                               "{\"id\":\"d\",\"input_ids\":[5]}\n";
    write_bytes(text, sizeof text - 1);
    dfl_jsonl *r;
    T_CHECK(dfl_jsonl_open(&r, path, 211) == 0);
    dfl_jsonl_sample s;
    int rc = dfl_jsonl_next(r, &s);
    T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), path) && strstr(dfl_errmsg(), ":1: column 29: a NUL byte"),
             "rc %d, '%s'", rc, dfl_errmsg());
    rc = dfl_jsonl_next(r, &s);
    T_CHECKF(rc == 1 && !strcmp(s.id, "b") && s.line == 2, "rc %d, '%s'", rc, rc == 1 ? s.id : dfl_errmsg());
    rc = dfl_jsonl_next(r, &s);
    T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), ":3: column 1: a NUL byte"), "rc %d, '%s'", rc, dfl_errmsg());
    rc = dfl_jsonl_next(r, &s);
    T_CHECKF(rc == 1 && !strcmp(s.id, "d") && s.line == 4, "rc %d, '%s'", rc, rc == 1 ? s.id : dfl_errmsg());
    T_CHECK(dfl_jsonl_next(r, &s) == 0);
    dfl_jsonl_close(r);
}

int main(void) {
    int fd = mkstemp(path);
    if (fd < 0) return 1;
    close(fd);
    T_RUN(test_good_samples);
    T_RUN(test_errors_and_resume);
    T_RUN(test_no_vocab_check_and_missing_file);
    T_RUN(test_long_line);
    T_RUN(test_nul_byte);
    unlink(path);
    return t_exit();
}
