/* dfs_pack.h: what dflash-pack does, as library calls: merge, shuffle,
 * split and shard DFS streams, and inspect, summarise, verify and export
 * them. The tool parses options and calls these; man dflash-pack(1) is the
 * user-facing description of each. */
#ifndef DFLASH_DFS_PACK_H
#define DFLASH_DFS_PACK_H

#include "dfs.h"

#include <stdint.h>
#include <stdio.h>

#define DFS_PACK_MAX_SPLITS 16
#define DFS_PACK_MAX_SHARDS 4096
#define DFS_PACK_MAX_WIDTH  32 /* of the %d in a --shards pattern (%032d) */

typedef struct {
    const char *const *inputs;   /* paths, "-" = stdin */
    int         ninputs;
    const char *output;          /* a path, "-", or a pattern with %s (split) or %d (shards) */
    int         shuffle;
    uint64_t    seed;
    uint64_t    mem;             /* bytes of records held in memory when shuffling */
    const char *tmpdir;          /* where shuffle buckets go */
    int         nsplits;         /* 0: no split */
    char        split_name[DFS_PACK_MAX_SPLITS][64];
    double      split_frac[DFS_PACK_MAX_SPLITS];
    int         shards;          /* 0: no sharding */
    int         reencode;        /* 0: copy every tensor as stored */
    dfs_encoding enc;            /* the encoding when reencode is set */
    int         progress;        /* force the progress line */
    const char *producer;        /* "dflash-pack 0.1.0" */
} dfs_pack_opts;

/* Parse "train=0.99,val=0.01" into o->split_*. Returns 0, or -1 with the
 * reason recorded (dfl_errmsg). */
int dfs_pack_parse_split(const char *spec, dfs_pack_opts *o);
/* Check that an output pattern holds exactly one conversion of `kind`
 * ('s' or 'd'; "%%" is a literal %). Returns 0 or -1. */
int dfs_pack_pattern_ok(const char *pattern, char kind);
/* Can the shuffle's bucket directory be made in `dir`: an existing,
 * writable directory, its path short enough? 0, or DFL_EX_CANTCREAT with
 * "DIR: --tmpdir: why" recorded. Checked before any input is read, since
 * the buckets are first needed only once --mem is full. */
int dfs_pack_check_tmpdir(const char *dir);
/* The split a sample id falls in: u = (XXH64(id) >> 11) * 2^-53 against the
 * cumulative normalised fractions. */
int dfs_pack_split_of(const dfs_pack_opts *o, const char *id);

/* 0, or DFL_EX_USAGE (error recorded) when "-" is among the inputs more
 * than once, or two inputs name the same file that can be read only once
 * (not a regular file: "-" and /dev/stdin on one pipe, a FIFO named twice;
 * the second read found the pipe empty, or waited for a writer), naming
 * both. Every mode checks this before it reads anything. */
int dfs_pack_check_read_once(const char *const *inputs, int n);

/* Run fn on each input in turn, in order ("-" at most once), after checking
 * that its stream header agrees with the first input's on every identity
 * field (dfs_meta_diff), as merging does: every mode but --inspect takes
 * the inputs as one whole. With check_first, every input is checked before
 * fn runs on any (for --export, which writes); an input that cannot be
 * opened twice (stdin, a pipe or FIFO by name) then stays open from its
 * check to its turn. Other inputs are opened one at a time (the first stays
 * open), so thousands of shards need few descriptors.
 * Returns 0, fn's error, or an exit code (65 naming both files and each
 * differing field). */
typedef int (*dfs_pack_input_fn)(dfs_reader *r, void *ctx);
int dfs_pack_each_input(const char *const *inputs, int n, int check_first, dfs_pack_input_fn fn, void *ctx);

/* Merge (and shuffle, split, shard) the inputs into the outputs. Returns 0
 * or an exit code with the error recorded; outputs appear only on success. */
int dfs_pack_run(const dfs_pack_opts *o);

/* Read-only modes over the inputs. Each returns 0 or an exit code. Progress
 * (records) goes to stderr when it is a terminal, or always with progress. */
int dfs_pack_inspect(const char *const *inputs, int n, int progress, FILE *out);
int dfs_pack_stats(const char *const *inputs, int n, int as_json, int progress, FILE *out);
int dfs_pack_verify(const char *const *inputs, int n, int progress, FILE *out);
int dfs_pack_export(const char *const *inputs, int n, const char *dir, int progress);
/* An export's record directories are named INDEX-ID with INDEX 6 digits as
 * they are written, as many as the last index needs once all are: past
 * 999,999 records, those already written are renamed with their INDEX
 * zero-padded to that width, so the names sort (ls, sorted()) in record
 * order. Returns 0 or DFL_EX_CANTCREAT with the error recorded. */
int dfs_export_pad_indices(const char *dir, uint64_t records);

#endif
