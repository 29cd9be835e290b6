/* test_safetensors.c: the safetensors reader's validation and the writer. */
#include "common.h"
#include "safetensors.h"
#include "test.h"

#include <math.h>

#include <jansson.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[] = "/tmp/dflash-st-XXXXXX";

static void path_in(char *buf, const char *name) { snprintf(buf, 512, "%s/%s", dir, name); }

/* Write raw bytes: u64 header length, header text, then `data_len` bytes. */
static void write_raw(const char *path, const char *header, size_t data_len) {
    FILE *f = fopen(path, "wb");
    uint64_t n = strlen(header);
    fwrite(&n, 8, 1, f);
    fputs(header, f);
    for (size_t i = 0; i < data_len; i++) fputc((int)i, f);
    fclose(f);
}

static void test_round_trip(void) {
    char path[512];
    path_in(path, "rt.safetensors");
    float a[6] = {1, 2, 3, 4, 5, 6};
    uint16_t b[3] = {0x3f80, 0x4000, 0xbf80};
    dfl_st_in in[2] = {{"w.a", DFL_F32, 2, {2, 3}, a}, {"w.b", DFL_BF16, 1, {3}, b}};
    json_t *meta = json_pack("{ss}", "format", "pt");
    T_CHECK(dfl_st_write(path, in, 2, meta) == 0);
    json_decref(meta);
    dfl_st *st;
    T_CHECK(dfl_st_open(&st, path) == 0);
    if (!st) return;
    T_CHECK(dfl_st_count(st) == 2);
    const dfl_st_tensor *t;
    int64_t shape[2] = {2, 3};
    T_CHECK(dfl_st_get(st, "w.a", 2, shape, &t) == 0 && t && !memcmp(t->data, a, sizeof a));
    int64_t bad[2] = {3, 2};
    T_CHECK(dfl_st_get(st, "w.a", 2, bad, &t) == DFL_EX_DATA && strstr(dfl_errmsg(), "[2, 3]"));
    T_CHECK(dfl_st_get(st, "nope", 2, shape, &t) == DFL_EX_DATA && strstr(dfl_errmsg(), "missing"));
    float f[3];
    dfl_st_to_f32(dfl_st_find(st, "w.b"), f);
    T_CHECK(f[0] == 1 && f[1] == 2 && f[2] == -1);
    T_CHECK(!strcmp(dfl_st_meta(st, "format"), "pt"));
    dfl_st_close(st);
}

/* dfl_st_find over many tensors (a MoE checkpoint's ~10^4 per file, found
 * through a name index): every name finds its own tensor (mixed dtypes, so
 * the file's order is not the names' order), names between, before and
 * after them, prefixes and extensions of them find nothing. */
static void test_find_many(void) {
    enum { N = 600 };
    char path[512], (*names)[48] = dfl_malloc(N * sizeof *names);
    float *vals = dfl_malloc(N * sizeof *vals);
    dfl_st_in *in = dfl_calloc(N, sizeof *in);
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof names[i], "model.layers.%d.mlp.experts.%d.up_proj.weight", i % 7, i);
        vals[i] = (float)i;
        in[i] = (dfl_st_in){names[i], i % 3 ? DFL_F32 : DFL_BF16, 1, {1}, &vals[i]};
        if (!(i % 3)) { /* bf16 of i (exact below 256, and these only need to differ) */
            uint32_t u;
            memcpy(&u, &vals[i], 4);
            ((uint16_t *)&vals[i])[0] = (uint16_t)(u >> 16);
        }
    }
    path_in(path, "many.safetensors");
    T_CHECK(dfl_st_write(path, in, N, NULL) == 0);
    dfl_st *st;
    T_CHECK(dfl_st_open(&st, path) == 0);
    if (!st) return;
    int wrong = 0;
    for (int i = 0; i < N; i++) {
        const dfl_st_tensor *t = dfl_st_find(st, names[i]);
        float f;
        if (t) dfl_st_to_f32(t, &f);
        wrong += !t || strcmp(t->name, names[i]) || (i % 3 && f != (float)i);
    }
    T_CHECKF(wrong == 0, "%d names not found or wrong", wrong);
    static const char *absent[] = {"", "a", "model.layers.", "model.layers.0.mlp.experts.0.up_proj.weigh",
                                   "model.layers.0.mlp.experts.0.up_proj.weightx", "model.layers.3.mlp.experts.0.up_proj.weight",
                                   "zzz"};
    for (size_t i = 0; i < sizeof absent / sizeof absent[0]; i++)
        T_CHECKF(dfl_st_find(st, absent[i]) == NULL, "'%s' found", absent[i]);
    dfl_st_close(st);
    free(in);
    free(vals);
    free(names);
}

/* Each malformed file is refused with DFL_EX_DATA and a message naming it. */
static void test_rejects(void) {
    static const struct {
        const char *header;
        size_t data;
        const char *why;
    } cases[] = {
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, "truncated"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12, "trailing"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "need"},
        {"{\"a\":{\"dtype\":\"Q4\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "unknown dtype"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8, "overlap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, "gap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, "duplicate"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,8]}}", 8, "overflow"},
        {"[1,2]", 0, "not a JSON object"},
        {"{\"a\":", 0, "JSON"},
    };
    char path[512];
    path_in(path, "bad.safetensors");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_raw(path, cases[i].header, cases[i].data);
        dfl_st *st;
        int rc = dfl_st_open(&st, path);
        T_CHECKF(rc == DFL_EX_DATA && st == NULL, "case %zu: rc %d", i, rc);
        T_CHECKF(strstr(dfl_errmsg(), cases[i].why) != NULL, "case %zu: '%s' lacks '%s'", i, dfl_errmsg(), cases[i].why);
        T_CHECKF(strstr(dfl_errmsg(), "bad.safetensors") != NULL, "case %zu names the file", i);
    }
    /* A header length beyond the file. */
    FILE *f = fopen(path, "wb");
    uint64_t huge = 1ull << 40;
    fwrite(&huge, 8, 1, f);
    fclose(f);
    dfl_st *st;
    T_CHECK(dfl_st_open(&st, path) == DFL_EX_DATA && strstr(dfl_errmsg(), "100 MB"));
    /* A header length equal to the file's size: short by the 8-byte prefix.
     * The message said "header length 100 but the file has 100 bytes". */
    f = fopen(path, "wb");
    uint64_t hundred = 100;
    fwrite(&hundred, 8, 1, f);
    for (int i = 0; i < 92; i++) fputc(' ', f);
    fclose(f);
    T_CHECKF(dfl_st_open(&st, path) == DFL_EX_DATA &&
                 strstr(dfl_errmsg(), "truncated: header length 100 needs 108 bytes with its 8-byte prefix, the file has 100"),
             "%s", dfl_errmsg());
    path_in(path, "missing.safetensors");
    T_CHECK(dfl_st_open(&st, path) == DFL_EX_NOINPUT);
}

/* FP4 E2M1 from its fields (OCP MX spec): sign, 2 exponent bits (bias 1), 1
 * mantissa bit; exponent 0 is subnormal (m * 0.5). Independent of the table
 * in safetensors.c. */
static float e2m1(int c) {
    int s = c >> 3, e = (c >> 1) & 3, m = c & 1;
    float v = e ? (1.0f + 0.5f * (float)m) * ldexpf(1.0f, e - 1) : 0.5f * (float)m;
    return s ? -v : v;
}

/* Every byte (both nibbles) under scales 2^-127 .. 2^127, and the order:
 * the low nibble is the first value of the pair (transformers'
 * convert_moe_packed_tensors; the gpt-oss-mxfp4 fixture checks it end to
 * end against transformers). */
static void test_mxfp4(void) {
    enum { NB = 16 }; /* 16 blocks = 256 bytes: every byte once */
    uint8_t blocks[NB * 16], scales[NB];
    float out[NB * 32];
    for (int i = 0; i < NB * 16; i++) blocks[i] = (uint8_t)i;
    const int exps[NB] = {-127, -20, -8, -2, -1, 0, 0, 1, 2, 3, 7, 15, 30, 64, 100, 127};
    for (int b = 0; b < NB; b++) scales[b] = (uint8_t)(exps[b] + 127);
    dfl_mxfp4_to_f32(blocks, scales, NB, out);
    int bad = 0;
    for (int i = 0; i < NB * 16; i++) {
        const int b = i / 16;
        const float lo = ldexpf(e2m1(i & 15), exps[b]), hi = ldexpf(e2m1(i >> 4), exps[b]);
        if (memcmp(&out[2 * i], &lo, 4) || memcmp(&out[2 * i + 1], &hi, 4)) bad++;
    }
    T_CHECKF(bad == 0, "%d bytes decoded wrong", bad);
    T_CHECK(out[2 * 0x21] == 0.5f * ldexpf(1, exps[2]) && out[2 * 0x21 + 1] == 1.0f * ldexpf(1, exps[2]));
    T_CHECK(signbit(out[2 * 0x08]) && out[2 * 0x08] == 0.0f); /* -0 */
    /* into bf16: the same values, exactly (bf16 back to f32 gives the f32
     * decode's bits, subnormals, infinities and -0 included) */
    uint16_t out16[NB * 32];
    dfl_mxfp4_to_bf16(blocks, scales, NB, out16);
    int inexact = 0;
    for (int i = 0; i < NB * 32; i++) {
        const float back = dfl_bf16_to_f32(out16[i]);
        inexact += memcmp(&back, &out[i], 4) != 0;
    }
    T_CHECKF(inexact == 0, "%d values not exact in bf16", inexact);
}

/* A FIFO where a model's file should be is refused (66, named as a FIFO),
 * not opened: a plain open() waits for a writer forever. An alarm ends
 * the test as a failure if a reader hangs. */
static void test_fifo_refused(void) {
    char sub[512], path[512];
    path_in(sub, "fifo");
    T_CHECK(mkdir(sub, 0755) == 0);
    path_in(path, "fifo/model.safetensors");
    T_CHECK(mkfifo(path, 0644) == 0);
    alarm(20);
    dfl_st *st = NULL;
    int rc = dfl_st_open(&st, path);
    T_CHECKF(rc == DFL_EX_NOINPUT && !st && strstr(dfl_errmsg(), "model.safetensors: is a pipe or FIFO, not a regular file"),
             "rc %d, '%s'", rc, dfl_errmsg());
    rc = dfl_st_open_dir(&st, sub);
    T_CHECKF(rc == DFL_EX_NOINPUT && !st && strstr(dfl_errmsg(), "pipe or FIFO"), "dir: rc %d, '%s'", rc, dfl_errmsg());
    /* the index of a sharded model, and a small file read whole (config.json) */
    path_in(path, "fifo/model.safetensors.index.json");
    T_CHECK(mkfifo(path, 0644) == 0);
    rc = dfl_st_open_dir(&st, sub);
    T_CHECKF(rc == DFL_EX_NOINPUT && !st && strstr(dfl_errmsg(), "index.json: is a pipe or FIFO"), "index: rc %d, '%s'",
             rc, dfl_errmsg());
    char *text = NULL;
    size_t len;
    rc = dfl_read_file(path, 1 << 20, "config.json", &text, &len);
    T_CHECKF(rc == DFL_EX_NOINPUT && !text && strstr(dfl_errmsg(), "pipe or FIFO"), "read_file: rc %d, '%s'", rc,
             dfl_errmsg());
    json_t *j = NULL;
    rc = dfl_load_json(path, DFL_JSON_FILE_MAX, "trainer_state.json", &j);
    T_CHECKF(rc == DFL_EX_NOINPUT && !j && strstr(dfl_errmsg(), "pipe or FIFO"), "load_json: rc %d, '%s'", rc,
             dfl_errmsg());
    rc = dfl_read_file(sub, 1 << 20, "config.json", &text, &len);
    T_CHECKF(rc == DFL_EX_NOINPUT && strstr(dfl_errmsg(), "fifo: is a directory"), "directory: rc %d, '%s'", rc,
             dfl_errmsg());
    alarm(0);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    T_RUN(test_round_trip);
    T_RUN(test_rejects);
    T_RUN(test_find_many);
    T_RUN(test_mxfp4);
    T_RUN(test_fifo_refused);
    if (t_rm_rf(dir)) return 1;
    return t_exit();
}
