/* test_dfs_pack.c: dflash-pack's library side: is --shuffle uniform, and
 * the split rule and output patterns.
 *
 * Uniformity: an 8-record stream is shuffled with seeds 1..400 (every other
 * one through the external-memory path, --mem 1 byte), and the position of
 * every record is tallied in an 8x8 table. A uniform shuffle expects 50 per
 * cell; Pearson's chi-square over the 64 cells, whose row and column sums
 * are fixed, has (8-1)*(8-1) = 49 degrees of freedom, and
 * P(chi2_49 > 85.35) = 0.001. With fixed seeds the statistic is one fixed
 * number, so the test is deterministic; a uniform shuffle fails it for only
 * 0.1% of seed ranges, while a biased one (records staying near their input
 * position, a first record never moving) fails by a wide margin.
 *
 * Export names past 999,999 records: the record directories are widened
 * so that their names sort in record order.
 */
#include "common.h"
#include "dfs.h"
#include "dfs_pack.h"
#include "test.h"

#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

/* On tmpfs when there is one: every output is fsync'ed, which is slow on
 * a shared disk and pointless here. */
static char dir[64];

static void path_in(char *buf, const char *name) { snprintf(buf, 600, "%s/%s", dir, name); }

static void write_records(const char *path, int n) {
    FILE *f = fopen(path, "wb");
    json_t *meta = json_object();
    dfs_writer *w;
    T_CHECK(dfs_writer_open(&w, f, path, meta, "test", (dfs_encoding){DFS_CODEC_NONE, 0, 1}) == 0);
    for (int i = 0; i < n; i++) {
        char id[16];
        int32_t v = i;
        snprintf(id, sizeof id, "%d", i);
        dfs_tensor_in t = {"v", DFL_I32, 1, {1}, &v, NULL};
        T_CHECK(dfs_write(w, id, 1, &t) == 0);
    }
    T_CHECK(dfs_writer_close(w) == 0);
    json_decref(meta);
    fclose(f);
}

/* The ids of a stream, in order, as integers. */
static int read_order(const char *path, int *order, int max) {
    dfs_reader *r;
    if (dfs_reader_open(&r, path)) return -1;
    dfs_sample *s;
    int n = 0;
    while (n < max && dfs_read(r, &s) == 1) order[n++] = atoi(s->id);
    dfs_reader_close(r);
    return n;
}

static void test_shuffle_uniform(void) {
    char in[600], out[600];
    path_in(in, "8.dfs");
    path_in(out, "out.dfs");
    write_records(in, 8);
    const char *inputs[1] = {in};
    int count[8][8] = {{0}}, bad = 0;
    for (int seed = 1; seed <= 400; seed++) {
        dfs_pack_opts o;
        memset(&o, 0, sizeof o);
        o.inputs = inputs;
        o.ninputs = 1;
        o.output = out;
        o.shuffle = 1;
        o.seed = (uint64_t)seed;
        o.mem = seed % 2 ? 1ull << 30 : 1;
        o.tmpdir = dir;
        o.producer = "test";
        if (dfs_pack_run(&o)) {
            bad++;
            continue;
        }
        int order[8], seen = 0;
        if (read_order(out, order, 8) != 8) bad++;
        for (int p = 0; p < 8; p++) {
            count[order[p]][p]++;
            seen |= 1 << order[p];
        }
        bad += seen != 0xff;
    }
    T_CHECKF(bad == 0, "%d runs failed or lost records: %s", bad, dfl_errmsg());
    double chi2 = 0, e = 400.0 / 8;
    for (int i = 0; i < 8; i++)
        for (int p = 0; p < 8; p++) chi2 += (count[i][p] - e) * (count[i][p] - e) / e;
    printf("  chi2 = %.2f (49 dof; critical value 85.35 at p = 0.001)\n", chi2);
    T_CHECKF(chi2 < 85.35, "chi2 %.2f", chi2);
}

/* The split rule, recomputed here from its definition. */
static void test_split_rule(void) {
    dfs_pack_opts o;
    memset(&o, 0, sizeof o);
    T_CHECK(dfs_pack_parse_split("train=3,val=1", &o) == 0 && o.nsplits == 2);
    T_CHECK(!strcmp(o.split_name[1], "val") && o.split_frac[0] == 3);
    int n[2] = {0, 0};
    for (int i = 0; i < 4000; i++) {
        char id[32];
        snprintf(id, sizeof id, "sample-%d", i);
        double u = (double)(XXH64(id, strlen(id), 0) >> 11) / 9007199254740992.0;
        int want = u < 0.75 ? 0 : 1, got = dfs_pack_split_of(&o, id);
        T_CHECK(got == want);
        n[got]++;
    }
    T_CHECKF(n[1] > 900 && n[1] < 1100, "val got %d of 4000", n[1]);
    T_CHECK(dfs_pack_parse_split("a=1,,b=2", &o) != 0);
    T_CHECK(dfs_pack_parse_split("a/b=1", &o) != 0);
    T_CHECK(dfs_pack_parse_split("a=-1", &o) != 0);
    /* a fraction longer than 63 characters is read whole: the junk past a
     * 64-byte buffer was dropped, and this was 1 */
    char longer[200];
    snprintf(longer, sizeof longer, "a=1.%070djunk,b=1", 0);
    T_CHECKF(dfs_pack_parse_split(longer, &o) == DFL_EX_USAGE && strstr(dfl_errmsg(), "--split: 'a=1.000") &&
                 strstr(dfl_errmsg(), "junk': the fraction is not a positive number"),
             "%s", dfl_errmsg());
    snprintf(longer, sizeof longer, "a=1.%0100d,b=1", 0);
    T_CHECKF(dfs_pack_parse_split(longer, &o) == 0 && o.split_frac[0] == 1, "%s", dfl_errmsg());
    /* a trailing ',' is an empty part, as in the middle */
    T_CHECK(dfs_pack_parse_split("a=1,b=1,", &o) == DFL_EX_USAGE && strstr(dfl_errmsg(), "'' is not NAME=FRACTION"));
    /* finite fractions whose sum is not: every part but the last got 0 */
    T_CHECK(dfs_pack_parse_split("a=1e308,b=1e308", &o) == DFL_EX_USAGE && strstr(dfl_errmsg(), "add up to more"));
    /* large but summable: the ratios are kept */
    T_CHECK(dfs_pack_parse_split("a=8e307,b=8e307", &o) == 0);
    int k[2] = {0, 0};
    for (int i = 0; i < 400; i++) {
        char id[32];
        snprintf(id, sizeof id, "sample-%d", i);
        k[dfs_pack_split_of(&o, id)]++;
    }
    T_CHECKF(k[0] > 150 && k[1] > 150, "a %d, b %d of 400", k[0], k[1]);
}

static void test_patterns(void) {
    T_CHECK(dfs_pack_pattern_ok("out-%s.dfs", 's') == 0);
    T_CHECK(dfs_pack_pattern_ok("out-%s-%s.dfs", 's') != 0);
    T_CHECK(dfs_pack_pattern_ok("out.dfs", 's') != 0);
    T_CHECK(dfs_pack_pattern_ok("100%%-%s.dfs", 's') == 0);
    T_CHECK(dfs_pack_pattern_ok("%03s", 's') != 0);
    T_CHECK(dfs_pack_pattern_ok("train-%03d.dfs", 'd') == 0);
    T_CHECK(dfs_pack_pattern_ok("train-%d-%n.dfs", 'd') != 0);
    T_CHECK(dfs_pack_pattern_ok("train-%s.dfs", 'd') != 0);
    /* A width that does not fit the number's buffer was cut short, and with
     * it the digits that tell the shards apart: one name for all of them. */
    T_CHECK(dfs_pack_pattern_ok("train-%032d.dfs", 'd') == 0);
    T_CHECK(dfs_pack_pattern_ok("train-%033d.dfs", 'd') != 0);
    T_CHECK(dfs_pack_pattern_ok("train-%0150d.dfs", 'd') != 0);
    T_CHECK(dfs_pack_pattern_ok("train-%-200d.dfs", 'd') != 0);
    T_CHECK(dfs_pack_pattern_ok("train-%0999d.dfs", 'd') != 0);
}

/* The entries of d, sorted as `ls` and Python's sorted() sort them (bytes),
 * joined by spaces. */
static const char *sorted_listing(const char *d) {
    static char out[1024];
    struct dirent **names;
    int n = scandir(d, &names, NULL, alphasort), at = 0;
    out[0] = 0;
    for (int i = 0; i < n; i++) {
        if (names[i]->d_name[0] != '.')
            at += snprintf(out + at, sizeof out - (size_t)at, "%s%s", at ? " " : "", names[i]->d_name);
        free(names[i]);
    }
    free(n >= 0 ? names : NULL);
    return out;
}

static void make_dirs(const char *d, const char *const *names) {
    char p[512];
    T_CHECK(mkdir(d, 0777) == 0);
    for (; *names; names++) {
        snprintf(p, sizeof p, "%s/%s", d, *names);
        T_CHECK(mkdir(p, 0777) == 0);
    }
}

/* Past 999,999 records, every record directory narrower than the last
 * index is zero-padded to its width ("1000000-c" sorted before "999999-b"
 * and "100000-a"); stream.json and anything not a record directory stay;
 * up to 1,000,000 records (last index 999999), nothing is renamed. */
static void test_export_pad_indices(void) {
    char d[400];
    snprintf(d, sizeof d, "%s/export-wide", dir);
    static const char *const names[] = {"000000-s_0", "100000-a", "999999-b", "1000000-c", "1000001-", "12-short", NULL};
    make_dirs(d, names);
    T_CHECK(dfs_export_pad_indices(d, 1000002) == 0);
    const char *got = sorted_listing(d);
    T_CHECKF(!strcmp(got, "0000000-s_0 0100000-a 0999999-b 1000000-c 1000001- 12-short"), "%s", got);
    t_rm_rf(d);

    static const char *const small[] = {"000000-a", "999999-b", NULL};
    make_dirs(d, small);
    T_CHECK(dfs_export_pad_indices(d, 1000000) == 0);
    got = sorted_listing(d);
    T_CHECKF(!strcmp(got, "000000-a 999999-b"), "%s", got);
    t_rm_rf(d);
}

int main(void) {
    snprintf(dir, sizeof dir, "%s/dflash-pack-XXXXXX", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
    if (!mkdtemp(dir)) return 1;
    T_RUN(test_shuffle_uniform);
    T_RUN(test_split_rule);
    T_RUN(test_patterns);
    T_RUN(test_export_pad_indices);
    if (t_rm_rf(dir) != 0) return 1;
    return t_exit();
}
