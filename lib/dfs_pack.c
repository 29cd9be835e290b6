/* dfs_pack.c: merge, shuffle, split and shard DFS streams.
 *
 * Records are copied as stored (no decode) unless a re-encoding is asked
 * for. Every output is written under a temporary name and renamed only when
 * the whole run succeeded.
 *
 * The shuffle. Each record, in input order, draws a 64-bit key from the
 * seeded RNG; the output order is the records sorted by key, ties (p ~
 * n^2/2^65) broken by input order. Keys drawn independently and uniformly
 * make every order of the records equally likely, which is the whole
 * argument for uniformity. Memory stays bounded by --mem: while the records
 * seen so far fit, they are held in memory and sorted at the end; once they
 * do not, every record goes to one of 64 temporary bucket files chosen by
 * the top 6 bits of its key (with its key in a side file), and each bucket,
 * taken in key order, is sorted in memory if it fits or split again by the
 * next 6 bits. Sorting by key within buckets taken in order of their key
 * ranges is sorting by key, so the output depends on the seed and the input
 * only, not on --mem: a run with a tiny --mem gives the same bytes as one
 * held wholly in memory (the tests check this).
 */
#include "dfs_pack.h"

#include "cli.h"
#include "common.h"
#include "outfile.h"
#include "rng.h"

#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define BUCKET_BITS 6
#define NBUCKETS (1 << BUCKET_BITS)
#define BUCKET_DIR "/dflash-pack.XXXXXX" /* made in --tmpdir */
#define TMP_MAX_LEN (PATH_MAX - 64)      /* the bucket directory's path: room for its files' names */

/* ---- options ------------------------------------------------------------- */

static int name_ok(const char *s, size_t n) {
    if (n == 0 || n > 63) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
              c == '.'))
            return 0;
    }
    return 1;
}

/* One NAME=FRACTION part of --split, the bytes [s, end), appended to o. */
static int split_part(const char *s, const char *end, dfs_pack_opts *o) {
    const char *eq = memchr(s, '=', (size_t)(end - s));
    if (!eq || !name_ok(s, (size_t)(eq - s)))
        return dfl_err(DFL_EX_USAGE, "--split: '%.*s' is not NAME=FRACTION (NAME of letters, digits, . _ -)",
                       (int)(end - s), s);
    if (o->nsplits == DFS_PACK_MAX_SPLITS)
        return dfl_err(DFL_EX_USAGE, "--split: at most %d parts", DFS_PACK_MAX_SPLITS);
    /* The fraction whole, however long: a fixed buffer cut a long one short,
     * and "1.000...0junk" was read as 1 with the junk never seen. */
    size_t nlen = (size_t)(end - eq - 1);
    char *num = dfl_malloc(nlen + 1);
    memcpy(num, eq + 1, nlen);
    num[nlen] = 0;
    double f;
    int bad = dfl_parse_double(num, &f) || !(f > 0);
    free(num);
    if (bad)
        return dfl_err(DFL_EX_USAGE, "--split: '%.*s': the fraction is not a positive number", (int)(end - s), s);
    int k = o->nsplits++;
    snprintf(o->split_name[k], sizeof o->split_name[k], "%.*s", (int)(eq - s), s);
    o->split_frac[k] = f;
    for (int j = 0; j < k; j++)
        if (!strcmp(o->split_name[j], o->split_name[k]))
            return dfl_err(DFL_EX_USAGE, "--split: '%s' named twice", o->split_name[k]);
    return 0;
}

int dfs_pack_parse_split(const char *spec, dfs_pack_opts *o) {
    o->nsplits = 0;
    for (const char *s = spec;;) {
        /* every ',' starts a part: a trailing one gives an empty part, refused */
        const char *comma = strchr(s, ','), *end = comma ? comma : s + strlen(s);
        int rc = split_part(s, end, o);
        if (rc) return rc;
        if (!comma) break;
        s = comma + 1;
    }
    /* dfs_pack_split_of divides by the sum: past DBL_MAX it is inf, every
     * fraction 0, and every record would go to the last part */
    double sum = 0;
    for (int i = 0; i < o->nsplits; i++) sum += o->split_frac[i];
    if (!isfinite(sum))
        return dfl_err(DFL_EX_USAGE, "--split: the fractions add up to more than %g; only their ratios matter, so "
                                     "give smaller numbers", DBL_MAX);
    return 0;
}

int dfs_pack_split_of(const dfs_pack_opts *o, const char *id) {
    double sum = 0, acc = 0;
    for (int i = 0; i < o->nsplits; i++) sum += o->split_frac[i];
    double u = (double)(XXH64(id, strlen(id), 0) >> 11) * 0x1.0p-53;
    for (int i = 0; i < o->nsplits; i++) {
        acc += o->split_frac[i] / sum;
        if (u < acc) return i;
    }
    return o->nsplits - 1;
}

/* The one conversion in a pattern: its start, end, and for %d the flags. */
typedef struct {
    size_t start, end;
    int zero, left, width;
} conv;

static int find_conv(const char *p, char kind, conv *c) {
    int found = 0;
    for (size_t i = 0; p[i]; i++) {
        if (p[i] != '%') continue;
        if (p[i + 1] == '%') {
            i++;
            continue;
        }
        size_t j = i + 1;
        conv k = {i, 0, 0, 0, 0};
        for (; p[j] == '0' || p[j] == '-'; j++) p[j] == '0' ? (k.zero = 1) : (k.left = 1);
        for (; p[j] >= '0' && p[j] <= '9'; j++)
            if ((k.width = k.width * 10 + (p[j] - '0')) > DFS_PACK_MAX_WIDTH) return -1;
        if (p[j] != kind || found || (kind == 's' && j != i + 1)) return -1;
        k.end = j + 1;
        *c = k;
        found = 1;
        i = j;
    }
    return found ? 0 : -1;
}

int dfs_pack_pattern_ok(const char *pattern, char kind) {
    conv c;
    return find_conv(pattern, kind, &c);
}

/* Fill the pattern's conversion with s (kind 's') or d (kind 'd'). */
static void pattern_fill(char *out, size_t n, const char *pat, char kind, const char *s, long long d) {
    conv c;
    char piece[128];
    /* a piece cut short would lose the digits that tell shards apart */
    _Static_assert(DFS_PACK_MAX_WIDTH < sizeof piece && sizeof((dfs_pack_opts *)0)->split_name[0] < sizeof piece,
                   "a filled conversion fits its buffer");
    DFL_ASSERT(find_conv(pat, kind, &c) == 0);
    if (kind == 's') snprintf(piece, sizeof piece, "%s", s);
    else if (c.left) snprintf(piece, sizeof piece, "%-*lld", c.width, d);
    else if (c.zero) snprintf(piece, sizeof piece, "%0*lld", c.width, d);
    else snprintf(piece, sizeof piece, "%*lld", c.width, d);
    size_t k = 0;
    for (size_t i = 0; pat[i] && k + 1 < n; i++) {
        if (i == c.start) {
            for (const char *q = piece; *q && k + 1 < n; q++) out[k++] = *q;
            i = c.end - 1;
        } else {
            out[k++] = pat[i];
            if (pat[i] == '%' && pat[i + 1] == '%') i++;
        }
    }
    out[k] = 0;
}

/* ---- inputs and outputs ---------------------------------------------------- */

typedef struct {
    const dfs_pack_opts *o;
    dfs_reader **in;
    int          nout;
    dfl_out    **out;
    dfs_writer **w;
    uint64_t     emitted;     /* records written, for round-robin shards */
    dfl_progress prog;
    uint64_t     seen;        /* records read */
    char         tmp[TMP_MAX_LEN]; /* shuffle bucket directory, "" if none */
    int          tmp_files;   /* bucket files created so far (for names) */
} pack;

/* The file behind input `path` ("-": descriptor 0) into *st, if it can be
 * read only once: a pipe, FIFO, character device or socket. 0, or -1 for a
 * regular file or directory (read again from the start, or refused when
 * opened) and for a path that cannot be looked at (its open says why). */
static int read_once_file(const char *path, struct stat *st) {
    int ok = !strcmp(path, "-") ? !dfl_stdin_check("stdin") && fstat(STDIN_FILENO, st) == 0 : stat(path, st) == 0;
    return ok && !S_ISREG(st->st_mode) && !S_ISDIR(st->st_mode) ? 0 : -1;
}

static const char *read_once_kind(mode_t m) {
    return S_ISFIFO(m) ? "pipe or FIFO" : S_ISCHR(m) ? "character device" : S_ISSOCK(m) ? "socket" : "file";
}

static const char *arg_name(const char *path) { return strcmp(path, "-") ? path : "stdin ('-')"; }

int dfs_pack_check_read_once(const char *const *inputs, int n) {
    int nstdin = 0;
    for (int i = 0; i < n; i++) nstdin += !strcmp(inputs[i], "-");
    if (nstdin > 1) return dfl_err(DFL_EX_USAGE, "stdin ('-') can be read only once");
    /* One stat per input; only those that can be read once are compared,
     * so thousands of shards (regular files) cost no more. */
    struct stat *st = dfl_calloc((size_t)n, sizeof *st);
    int *once = dfl_calloc((size_t)n, sizeof *once), nonce = 0, rc = 0;
    for (int i = 0; i < n; i++)
        if (read_once_file(inputs[i], &st[nonce]) == 0) once[nonce++] = i;
    for (int a = 0; a < nonce && !rc; a++)
        for (int b = a + 1; b < nonce && !rc; b++)
            if (st[a].st_dev == st[b].st_dev && st[a].st_ino == st[b].st_ino)
                rc = dfl_err(DFL_EX_USAGE, "%s and %s are the same %s, which can be read only once",
                             arg_name(inputs[once[a]]), arg_name(inputs[once[b]]), read_once_kind(st[a].st_mode));
    free(st);
    free(once);
    return rc;
}

/* Open `path` and check that its stream header agrees with that of `first`
 * on every identity field (dfs_meta_diff); first NULL: path is the first.
 * Returns 0, or an exit code (65 naming both files and each differing
 * field) with *r NULL. */
static int open_like(dfs_reader **r, const char *path, const dfs_reader *first) {
    char diff[900];
    int rc = dfs_reader_open(r, path);
    if (rc || !first || !dfs_meta_diff(dfs_reader_meta(first), dfs_reader_meta(*r), diff, sizeof diff)) return rc;
    rc = dfl_err(DFL_EX_DATA, "%s: stream header differs from that of %s (values there vs here): %s",
                 dfs_reader_path(*r), dfs_reader_path(first), diff);
    dfs_reader_close(*r);
    *r = NULL;
    return rc;
}

/* Every output stays a registered temporary file until the end, beside the
 * shuffle's bucket directory. */
_Static_assert(DFS_PACK_MAX_SHARDS + 1 < DFL_CLEANUP_MAX, "the cleanup registry must hold every output of --shards");

/* Each output keeps a descriptor open for the whole run, a shuffle's
 * buckets too (and inputs that are pipes): --shards 4096 needs more than the usual soft limit
 * of 1024, so it is raised as far as the hard limit allows (what is still
 * missing is then an output that cannot be created, exit 73). */
static void allow_open_files(const pack *p) {
    struct rlimit rl;
    rlim_t want = (rlim_t)p->nout + (rlim_t)p->o->ninputs + 2 * NBUCKETS + 64;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= want) return;
    rl.rlim_cur = rl.rlim_max != RLIM_INFINITY && rl.rlim_max < want ? rl.rlim_max : want;
    setrlimit(RLIMIT_NOFILE, &rl);
}

/* Can `path` be opened a second time and read from its start? Only a
 * regular file: standard input, a pipe given by name (<(cmd), /dev/fd/N, a
 * named FIFO) or a device would give what follows the bytes already read,
 * or block for a writer that is gone. */
static int reopenable(const char *path) {
    struct stat st;
    return strcmp(path, "-") != 0 && stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* Check inputs 1.. against the first before any is read: each opened and
 * closed, but those that cannot be opened twice (reopenable) are kept in
 * held[i]; the others' held[i] stay NULL. */
static int check_inputs(const char *const *inputs, int n, const dfs_reader *first, dfs_reader **held) {
    int rc = 0;
    for (int i = 1; i < n && !rc; i++) {
        dfs_reader *r;
        if ((rc = open_like(&r, inputs[i], first))) break;
        if (!reopenable(inputs[i])) held[i] = r;
        else dfs_reader_close(r);
    }
    return rc;
}

/* Check every input's identity against the first before anything is
 * written. Only the first, and those that cannot be opened twice, stay open
 * (p->in[i]); input_open opens the others in their turn, so merging
 * thousands of shards needs few descriptors. */
static int open_inputs(pack *p) {
    const dfs_pack_opts *o = p->o;
    int rc = dfs_pack_check_read_once(o->inputs, o->ninputs);
    if (rc) return rc;
    p->in = dfl_calloc((size_t)o->ninputs, sizeof *p->in);
    rc = open_like(&p->in[0], o->inputs[0], NULL);
    return rc ? rc : check_inputs(o->inputs, o->ninputs, p->in[0], p->in);
}

/* Input i, opened now if open_inputs closed it. */
static int input_open(pack *p, int i) {
    return p->in[i] ? 0 : open_like(&p->in[i], p->o->inputs[i], p->in[0]);
}

/* Done with input i: closed, but the first, whose meta the outputs use. */
static void input_done(pack *p, int i) {
    if (i == 0) return;
    dfs_reader_close(p->in[i]);
    p->in[i] = NULL;
}

int dfs_pack_each_input(const char *const *inputs, int n, int check_first, dfs_pack_input_fn fn, void *ctx) {
    DFL_ASSERT(n >= 1);
    dfs_reader *first = NULL, **held = dfl_calloc((size_t)n, sizeof *held);
    int rc = dfs_pack_check_read_once(inputs, n);
    if (!rc) rc = open_like(&first, inputs[0], NULL);
    if (!rc && check_first) rc = check_inputs(inputs, n, first, held);
    for (int i = 0; i < n && !rc; i++) {
        dfs_reader *r = i == 0 ? first : held[i];
        held[i] = NULL;
        if (!r && (rc = open_like(&r, inputs[i], first))) break;
        rc = fn(r, ctx);
        if (i > 0) dfs_reader_close(r); /* the first stays open: the others are compared with it */
    }
    for (int i = 1; i < n; i++) dfs_reader_close(held[i]);
    free(held);
    dfs_reader_close(first);
    return rc;
}

static int open_outputs(pack *p) {
    const dfs_pack_opts *o = p->o;
    p->nout = o->nsplits ? o->nsplits : o->shards ? o->shards : 1;
    allow_open_files(p);
    p->out = dfl_calloc((size_t)p->nout, sizeof *p->out);
    p->w = dfl_calloc((size_t)p->nout, sizeof *p->w);
    const json_t *meta = dfs_reader_meta(p->in[0]);
    for (int i = 0; i < p->nout; i++) {
        char path[PATH_MAX];
        if (o->nsplits) pattern_fill(path, sizeof path, o->output, 's', o->split_name[i], 0);
        else if (o->shards) pattern_fill(path, sizeof path, o->output, 'd', NULL, i);
        else snprintf(path, sizeof path, "%s", o->output);
        int rc = dfl_out_open(&p->out[i], path, 1);
        if (rc) return rc;
        rc = dfs_writer_open(&p->w[i], dfl_out_file(p->out[i]), strcmp(path, "-") ? path : "stdout", meta,
                             o->producer, o->enc);
        if (rc) return rc;
    }
    return 0;
}

/* Write one record to the output it is routed to. */
static int emit(pack *p, dfs_reader *from, dfs_sample *s) {
    const dfs_pack_opts *o = p->o;
    int k = o->nsplits ? dfs_pack_split_of(o, s->id) : o->shards ? (int)(p->emitted % (uint64_t)o->shards) : 0;
    p->emitted++;
    return dfs_write_sample(p->w[k], from, s, !o->reencode);
}

static int finish(pack *p, int rc) {
    for (int i = 0; i < p->nout; i++) {
        if (!rc && p->w[i]) rc = dfs_writer_close(p->w[i]);
        else dfs_writer_abort(p->w[i]);
        p->w[i] = NULL;
    }
    /* Every output on disk before any is renamed: a full or failing disk
     * then replaces none of a set of shards or splits, rather than the
     * first few, beside the rest of an earlier run's. */
    for (int i = 0; i < p->nout && !rc; i++) rc = dfl_out_finish(p->out[i]);
    for (int i = 0; i < p->nout; i++) {
        if (!rc) rc = dfl_out_commit(p->out[i]);
        else dfl_out_abort(p->out[i]);
    }
    for (int i = 0; p->in && i < p->o->ninputs; i++) dfs_reader_close(p->in[i]);
    if (p->tmp[0]) dfl_tmpdir_abort(p->tmp);
    free(p->in);
    free(p->out);
    free(p->w);
    return rc;
}

/* ---- shuffle ------------------------------------------------------------- */

typedef struct {
    uint64_t    key, seq;
    dfs_sample *s;
} held;

static int held_cmp(const void *a, const void *b) {
    const held *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* Sort held records by key and emit them; frees them. */
static int emit_sorted(pack *p, held *h, size_t n) {
    qsort(h, n, sizeof *h, held_cmp);
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        if (!rc) rc = emit(p, NULL, h[i].s);
        dfs_sample_free(h[i].s);
    }
    return rc;
}

/* A set of bucket files: records (a DFS stream) and their keys. */
typedef struct {
    int         shift;                 /* key bits already used by parents */
    char        dfs[NBUCKETS][PATH_MAX], keys[NBUCKETS][PATH_MAX];
    FILE       *fd[NBUCKETS], *fk[NBUCKETS];
    dfs_writer *w[NBUCKETS];
    uint64_t    count[NBUCKETS], bytes[NBUCKETS];
} buckets;

static int tmp_error(const char *path) {
    return dfl_err(DFL_EX_CANTCREAT, "%s: cannot write temporary file: %s", path, strerror(errno));
}

int dfs_pack_check_tmpdir(const char *dir) {
    struct stat st;
    int e = 0;
    if (strlen(dir) + sizeof BUCKET_DIR > TMP_MAX_LEN) e = ENAMETOOLONG;
    else if (stat(dir, &st) != 0) e = errno;
    else if (!S_ISDIR(st.st_mode)) e = ENOTDIR;
    else if (access(dir, W_OK | X_OK) != 0) e = errno;
    return e ? dfl_err(DFL_EX_CANTCREAT, "%s: --tmpdir: %s", dir, strerror(e)) : 0;
}

static int buckets_open(pack *p, buckets *b, int shift) {
    memset(b, 0, sizeof *b);
    b->shift = shift;
    if (!p->tmp[0]) {
        const char *dir = p->o->tmpdir;
        int rc = snprintf(p->tmp, sizeof p->tmp, "%s" BUCKET_DIR, dir) >= (int)sizeof p->tmp ? (errno = ENAMETOOLONG, -1)
                                                                                           : dfl_cleanup_mktemp(p->tmp, 1, NULL);
        if (rc < 0) rc = dfl_err(DFL_EX_CANTCREAT, "%s: cannot create a temporary directory: %s", dir, strerror(errno));
        if (rc) {
            p->tmp[0] = 0;
            return rc;
        }
    }
    json_t *meta = json_object();
    int rc = 0;
    for (int i = 0; i < NBUCKETS && !rc; i++) {
        int id = p->tmp_files++;
        snprintf(b->dfs[i], PATH_MAX, "%s/bucket-%d.dfs", p->tmp, id);
        snprintf(b->keys[i], PATH_MAX, "%s/bucket-%d.keys", p->tmp, id);
        b->fd[i] = fopen(b->dfs[i], "wb");
        b->fk[i] = fopen(b->keys[i], "wb");
        if (!b->fd[i] || !b->fk[i]) rc = tmp_error(b->dfs[i]);
        else rc = dfs_writer_open(&b->w[i], b->fd[i], b->dfs[i], meta, "dflash-pack bucket", p->o->enc);
    }
    json_decref(meta);
    return rc;
}

static int bucket_of(const buckets *b, uint64_t key) {
    int take = 64 - b->shift < BUCKET_BITS ? 64 - b->shift : BUCKET_BITS;
    return (int)((key << b->shift) >> (64 - take));
}

static int buckets_put(buckets *b, uint64_t key, dfs_sample *s) {
    int i = bucket_of(b, key);
    int rc = dfs_write_sample(b->w[i], NULL, s, 1);
    if (rc) return rc;
    if (fwrite(&key, sizeof key, 1, b->fk[i]) != 1) return tmp_error(b->keys[i]);
    b->count[i]++;
    b->bytes[i] += dfs_sample_size(s);
    return 0;
}

/* Close the writers and files; on error just drop them. */
static int buckets_close(buckets *b, int rc) {
    for (int i = 0; i < NBUCKETS; i++) {
        if (b->w[i]) {
            if (!rc) rc = dfs_writer_close(b->w[i]);
            else dfs_writer_abort(b->w[i]);
        }
        if (b->fd[i] && fclose(b->fd[i]) && !rc) rc = tmp_error(b->dfs[i]);
        if (b->fk[i] && fclose(b->fk[i]) && !rc) rc = tmp_error(b->keys[i]);
        b->w[i] = NULL;
        b->fd[i] = b->fk[i] = NULL;
    }
    return rc;
}

static int bucket_drain(pack *p, const char *dfs, const char *keys, uint64_t count, uint64_t bytes, int shift);

/* Emit every bucket in key order, then remove its files. */
static int buckets_drain(pack *p, buckets *b) {
    int rc = 0;
    for (int i = 0; i < NBUCKETS && !rc; i++) {
        if (b->count[i]) rc = bucket_drain(p, b->dfs[i], b->keys[i], b->count[i], b->bytes[i], b->shift + BUCKET_BITS);
        unlink(b->dfs[i]);
        unlink(b->keys[i]);
    }
    return rc;
}

/* Read a bucket's next record and its key. Returns 1, 0 at the end, or an error. */
static int bucket_next(dfs_reader *r, FILE *fk, const char *keys, uint64_t *key, dfs_sample **s) {
    int rc = dfs_read(r, s);
    if (rc != 1) return rc;
    if (fread(key, sizeof *key, 1, fk) != 1) return dfl_err(DFL_EX_IOERR, "%s: short read of a temporary file", keys);
    return 1;
}

/* One bucket: sort it in memory if it fits (or cannot be split further),
 * else split it by the next key bits. */
static int bucket_drain(pack *p, const char *dfs, const char *keys, uint64_t count, uint64_t bytes, int shift) {
    dfs_reader *r;
    int rc = dfs_reader_open(&r, dfs);
    if (rc) return rc;
    FILE *fk = fopen(keys, "rb");
    if (!fk) {
        dfs_reader_close(r);
        return dfl_err(DFL_EX_IOERR, "%s: cannot reopen a temporary file: %s", keys, strerror(errno));
    }
    uint64_t key;
    dfs_sample *s;
    if (bytes <= p->o->mem || count <= 1 || shift >= 64) {
        held *h = dfl_calloc((size_t)count, sizeof *h);
        size_t n = 0;
        while (n < count && (rc = bucket_next(r, fk, keys, &key, &s)) == 1) {
            h[n] = (held){key, n, dfs_sample_clone(s)};
            n++;
        }
        if (rc >= 0 && rc != 1) { /* error, or an end before `count` records */
            for (size_t i = 0; i < n; i++) dfs_sample_free(h[i].s);
            if (!rc) rc = dfl_err(DFL_EX_IOERR, "%s: temporary file lost records", dfs);
        } else {
            rc = emit_sorted(p, h, n);
        }
        free(h);
    } else {
        buckets *b = dfl_malloc(sizeof *b);
        rc = buckets_open(p, b, shift);
        while (!rc && (rc = bucket_next(r, fk, keys, &key, &s)) == 1) rc = buckets_put(b, key, s);
        rc = buckets_close(b, rc);
        dfs_reader_close(r);
        r = NULL;
        fclose(fk);
        fk = NULL;
        unlink(dfs);
        unlink(keys);
        if (!rc) rc = buckets_drain(p, b);
        free(b);
    }
    dfs_reader_close(r);
    if (fk) fclose(fk);
    return rc;
}

static int run_shuffle(pack *p) {
    const dfs_pack_opts *o = p->o;
    dfl_rng rng;
    dfl_rng_seed(&rng, o->seed);
    size_t cap = 1024, n = 0;
    held *h = dfl_malloc(cap * sizeof *h);
    uint64_t held_bytes = 0;
    buckets *b = NULL;
    int rc = 0;
    for (int i = 0; i < o->ninputs && !rc; i++) {
        dfs_sample *s;
        if ((rc = input_open(p, i))) break;
        while (!rc && (rc = dfs_read(p->in[i], &s)) == 1) {
            uint64_t key = dfl_rng_u64(&rng);
            rc = 0;
            dfl_progress_update(&p->prog, (double)++p->seen, "read");
            if (b) {
                rc = buckets_put(b, key, s);
                continue;
            }
            if (n == cap) h = dfl_realloc(h, (cap *= 2) * sizeof *h);
            h[n] = (held){key, n, dfs_sample_clone(s)};
            held_bytes += dfs_sample_size(s);
            n++;
            if (held_bytes <= o->mem) continue;
            /* Memory is full: from now on every record goes to a bucket file. */
            b = dfl_malloc(sizeof *b);
            rc = buckets_open(p, b, 0);
            for (size_t k = 0; k < n; k++) {
                if (!rc) rc = buckets_put(b, h[k].key, h[k].s);
                dfs_sample_free(h[k].s);
            }
            n = 0;
        }
        input_done(p, i); /* the records held are clones */
    }
    if (!b) {
        if (!rc) rc = emit_sorted(p, h, n);
        else
            for (size_t k = 0; k < n; k++) dfs_sample_free(h[k].s);
    } else {
        rc = buckets_close(b, rc);
        if (!rc) rc = buckets_drain(p, b);
        free(b);
    }
    free(h);
    return rc;
}

/* ---- the run --------------------------------------------------------------- */

static int run_stream(pack *p) {
    for (int i = 0; i < p->o->ninputs; i++) {
        dfs_sample *s;
        int rc = input_open(p, i);
        if (rc) return rc;
        while ((rc = dfs_read(p->in[i], &s)) == 1) {
            if ((rc = emit(p, p->in[i], s))) return rc;
            dfl_progress_update(&p->prog, (double)++p->seen, NULL);
        }
        if (rc) return rc;
        input_done(p, i);
    }
    return 0;
}

int dfs_pack_run(const dfs_pack_opts *o) {
    pack p;
    memset(&p, 0, sizeof p);
    p.o = o;
    dfl_progress_init(&p.prog, o->progress, 0, "rec");
    int rc = open_inputs(&p);
    if (!rc) rc = open_outputs(&p);
    if (!rc) rc = o->shuffle ? run_shuffle(&p) : run_stream(&p);
    rc = finish(&p, rc);
    if (!rc) dfl_progress_end(&p.prog, (double)p.seen, NULL);
    return rc;
}
