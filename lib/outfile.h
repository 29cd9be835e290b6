/* outfile.h: outputs that never exist half-written under their real name.
 *
 * A file output is written to a hidden temporary name in the same directory
 * (".NAME.tmp.XXXXXX") and renamed over NAME on commit, as zstd and
 * safetensors do, with mode 0666 less the umask (a directory: 0777). The
 * temporary path is registered for cleanup: SIGINT, SIGTERM, SIGHUP and
 * exit() before commit remove it (a signal ignored when the process starts,
 * as under nohup, stays ignored). "-" writes to stdout, which is refused
 * when it is a terminal and the output is binary.
 */
#ifndef DFLASH_OUTFILE_H
#define DFLASH_OUTFILE_H

#include <stdio.h>

typedef struct dfl_out dfl_out;

/* An output path given to option `opt` ("--out", "-o") must not be "": an
 * unset shell variable (--out "$CKPT") names no file, and the work would be
 * done and then lost when the rename into place fails. Tools call this for
 * every output option before the work (dfl_out_open and the tmpdir
 * functions refuse "" too, without the option's name). Returns 0 or
 * DFL_EX_CANTCREAT with the error recorded. */
int dfl_out_check_name(const char *opt, const char *path);

/* Open `path` for writing ("-" is stdout). Returns 0 or an exit code
 * (DFL_EX_CANTCREAT, DFL_EX_USAGE for binary output to a terminal) with the
 * error recorded. */
int dfl_out_open(dfl_out **out, const char *path, int binary);
FILE *dfl_out_file(dfl_out *o);
const char *dfl_out_path(const dfl_out *o);   /* the final name ("-" for stdout) */
/* Flush, check for write errors, fsync and rename into place; frees `o`.
 * Returns 0 or DFL_EX_IOERR (the temporary file is then removed). */
int dfl_out_commit(dfl_out *o);
/* Discard: remove the temporary file; frees `o`. Safe with NULL. */
void dfl_out_abort(dfl_out *o);

/* Temporary directories (checkpoints): created as ".NAME.tmp.XXXXXX" beside
 * NAME and renamed into place by dfl_tmpdir_commit(), which replaces an
 * existing NAME directory only after the new one is complete, and only if it
 * holds nothing but plain files named in `names` (NULL-terminated: the files
 * an output of this kind writes; else DFL_EX_CANTCREAT). */
int dfl_tmpdir_create(const char *final_path, char *tmp_path, size_t n);
int dfl_tmpdir_commit(const char *tmp_path, const char *final_path, const char *const *names);
void dfl_tmpdir_abort(const char *tmp_path);
/* Before a long run: can an output directory be committed at final_path?
 * It may not exist yet, or be a directory holding only plain files named in
 * `names` (NULL-terminated: what the output writes; anything else is never
 * replaced), and a temporary directory must be creatable beside it.
 * Returns 0 or DFL_EX_CANTCREAT with the error recorded. */
int dfl_tmpdir_check(const char *final_path, const char *const *names);

/* The cleanup registry used by the above: paths removed if the process is
 * interrupted or exits before they are unregistered. The first registration
 * names the thread that writes the outputs (main): a signal landing on any
 * other thread is forwarded to it, so the cleanup interrupts the writing.
 * It holds DFL_CLEANUP_MAX paths at once: every output of dflash-pack's
 * largest --shards, its shuffle's bucket directory, and a margin. Returns 0,
 * or DFL_EX_CANTCREAT with the error recorded when it is full. */
#define DFL_CLEANUP_MAX (4096 + 64)
int dfl_cleanup_register(const char *path, int is_dir);
void dfl_cleanup_unregister(const char *path);

/* Check stdout at exit, as jq does: flush, ferror and fclose (a stdout
 * closed from the start is no error if nothing was written to it). Returns 0
 * or DFL_EX_IOERR with the error recorded. Call once, last, from main. */
int dfl_close_stdout(void);

#endif
