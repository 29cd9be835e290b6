/* outfile.h: outputs that never exist half-written under their real name.
 *
 * A file output is written to a hidden temporary name in the same directory
 * (".NAME.tmp.XXXXXX") and renamed over NAME on commit, as zstd and
 * safetensors do, with mode 0666 less the umask (a directory: 0777). The
 * temporary path is registered for cleanup: SIGINT, SIGTERM, SIGHUP,
 * SIGPIPE, SIGQUIT, SIGALRM, SIGUSR1, SIGUSR2, SIGVTALRM, SIGXCPU, SIGXFSZ
 * and exit() before commit remove it (a signal ignored when the process
 * starts, as under nohup, stays ignored; see handled_signals). "-" writes
 * to stdout, which is refused when it is a terminal and the output is
 * binary.
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

/* What an output must not replace (dfl_out_check_input). */
typedef enum {
    DFL_IN_FILE,      /* an input file: the output must not be that file */
    DFL_IN_MODEL_DIR, /* a model or checkpoint directory read: the output must not be one of its .json or
                       * .safetensors files (a new file there, or another one, is left alone) */
    DFL_IN_OUT_DIR,   /* a directory output that replaces a directory: nothing may be written inside it */
} dfl_in_kind;

/* An output given to `opt` ("-o", "--log") must not replace what the tool
 * reads or writes elsewhere (`in`, given to `in_opt`): written through a
 * temporary name and renamed, it would replace a model's weights or the
 * samples being read once the run ends, or be lost with a checkpoint
 * directory replaced after it. Paths are compared by inode where both
 * exist, else by their parent directory's inode and their last component.
 * "-" and NULL never match. Returns 0 or DFL_EX_USAGE with the error
 * recorded (naming both options). */
int dfl_out_check_input(const char *opt, const char *out, const char *in_opt, const char *in, dfl_in_kind kind);

/* Open `path` for writing ("-" is stdout). Returns 0 or an exit code
 * (DFL_EX_CANTCREAT, DFL_EX_USAGE for binary output to a terminal) with the
 * error recorded. */
int dfl_out_open(dfl_out **out, const char *path, int binary);
/* A new file inside a temporary directory of ours (dfl_tmpdir_create):
 * written under its own name, since the directory is what appears
 * atomically, and synced by dfl_tmpdir_commit with the rest of the
 * directory rather than alone. Removed on abort, or on commit when a write
 * failed. Returns 0 or DFL_EX_CANTCREAT with the error recorded. */
int dfl_out_open_staged(dfl_out **out, const char *path, int binary);
FILE *dfl_out_file(dfl_out *o);
const char *dfl_out_path(const dfl_out *o);   /* the final name ("-" for stdout) */
/* Flush, check for write errors, fsync and close, without renaming: what
 * a full or failing disk can make fail, fails here. An output of several
 * files (dflash-pack's shards) finishes every file before it commits any,
 * so such an error replaces none of them. Returns 0 or DFL_EX_IOERR with
 * the error recorded; either way `o` is then committed or aborted. */
int dfl_out_finish(dfl_out *o);
/* Finish (if not done yet) and rename into place, then fsync the directory
 * that holds it (best effort: a rename is durable only once its directory
 * is); frees `o`. Returns 0, DFL_EX_IOERR or DFL_EX_CANTCREAT (the
 * temporary file is then removed). */
int dfl_out_commit(dfl_out *o);
/* Discard: remove the temporary file; frees `o`. Safe with NULL. */
void dfl_out_abort(dfl_out *o);

/* Temporary directories (checkpoints, exports): created as
 * ".NAME.tmp.XXXXXX" beside NAME and put in place by dfl_tmpdir_commit(),
 * which replaces an existing NAME directory only after the new one is
 * complete, and only if it holds nothing but what an output of this kind
 * writes (else DFL_EX_CANTCREAT). The replacement is one atomic exchange
 * (renameat2 RENAME_EXCHANGE): NAME is always the whole old output or the
 * whole new one; the old one is then removed from the temporary name (a
 * crash there leaves it, hidden, beside the new NAME). Where a filesystem
 * cannot exchange, two renames (the old one aside as ".NAME.old.XXXXXX")
 * with the signals held off between them: only a crash there leaves NAME
 * absent and both outputs whole under their hidden names. Before the
 * rename the new directory's files and entries are synced to disk (a
 * checkpoint file by file, an export, thousands of files, with one
 * syncfs(2)); a failure there is DFL_EX_IOERR and nothing is replaced.
 * After it, and before an old NAME is removed, the parent directory is
 * synced (best effort).
 *
 * What an existing NAME may hold to be replaced: plain files named in
 * `names` (NULL-terminated) and, when `is_subdir` is set, directories whose
 * names it accepts, each holding only plain files whose names end in
 * `sub_ext` (an export: NNNNNN-ID/NAME.npy). */
typedef struct {
    const char *const *names;
    int (*is_subdir)(const char *name);
    const char *sub_ext;
} dfl_dir_layout;

/* A temporary directory of files (dfl_tmpdir_create) or of one level of
 * subdirectories of files (a layout with is_subdir), removed whole by the
 * signal cleanup. */
int dfl_tmpdir_create(const char *final_path, char *tmp_path, size_t n);
int dfl_tmpdir_create_layout(const char *final_path, char *tmp_path, size_t n, const dfl_dir_layout *layout);
int dfl_tmpdir_commit(const char *tmp_path, const char *final_path, const char *const *names);
int dfl_tmpdir_commit_layout(const char *tmp_path, const char *final_path, const dfl_dir_layout *layout);
/* Remove the temporary directory, with one level of subdirectories. */
void dfl_tmpdir_abort(const char *tmp_path);
/* Before a long run: can an output directory be committed at final_path?
 * It may not exist yet, or be a directory holding only what the output
 * writes (`names`, or `layout`; anything else is never replaced), and a
 * temporary directory must be creatable beside it. Returns 0 or
 * DFL_EX_CANTCREAT with the error recorded, naming what is in the way. */
int dfl_tmpdir_check(const char *final_path, const char *const *names);
int dfl_tmpdir_check_layout(const char *final_path, const dfl_dir_layout *layout);
/* An error recorded about a file in the temporary directory names it under
 * the final path instead (the temporary one is gone when the user reads
 * it). Returns rc. */
int dfl_tmpdir_name_err(int rc, const char *tmp_path, const char *final_path);

/* The cleanup registry used by the above: paths removed if the process is
 * interrupted or exits before they are unregistered. The first registration
 * names the thread that writes the outputs (main): a signal landing on any
 * other thread is forwarded to it, so the cleanup interrupts the writing.
 * It holds DFL_CLEANUP_MAX paths at once: every output of dflash-pack's
 * largest --shards, its shuffle's bucket directory, and a margin. Returns 0,
 * or DFL_EX_CANTCREAT with the error recorded when it is full. */
#define DFL_CLEANUP_MAX (4096 + 64)
/* levels: 0 a file; 1 a directory of files; 2 a directory of files and
 * directories of files (deeper ones are left: the cleanup is bounded). */
int dfl_cleanup_register(const char *path, int levels);
void dfl_cleanup_unregister(const char *path);
/* mkdtemp(tmpl) (levels >= 1) or mkstemp(tmpl) (levels 0, its descriptor
 * in *fd) and the new path's registration, with the handled signals held
 * off from before the one to after the other: a signal landing between
 * them would leave the new path behind (make's Ctrl-C did, at a tool's
 * start). Returns 0; -1 with errno set where mkdtemp or mkstemp fails; or
 * the registration's code, the new path removed. */
int dfl_cleanup_mktemp(char *tmpl, int levels, int *fd);

/* Check stdout at exit, as jq does: flush, ferror and fclose (a stdout
 * closed from the start is no error if nothing was written to it). Returns 0
 * or DFL_EX_IOERR with the error recorded. Call once, last, from main. */
int dfl_close_stdout(void);

#endif
