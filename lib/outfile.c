/* outfile.c: temporary-name outputs renamed on commit, with signal cleanup. */
#include "outfile.h"

#include "common.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio_ext.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

struct dfl_out {
    FILE *f;
    char *final_path;
    char *tmp_path; /* NULL for stdout, devices and staged files */
    int own_f;      /* a device or a staged file opened here: fclose on commit */
    int staged;     /* in a temporary directory: no rename, no fsync of its own */
    int finished;   /* dfl_out_finish ran: f is closed (unless stdout) */
};

/* The cleanup registry. The signal handler reads it, so it is never
 * reallocated: a fixed table of pointers, each to an entry filled in full
 * before its pointer is stored (atomically), so the handler sees either no
 * entry or a complete one. Unregistering takes the pointer out before
 * freeing the entry. Registration and unregistration happen on the writing
 * thread, the only one that runs the cleanup (on_signal). */
typedef struct {
    int levels; /* 0: a file; else a directory, for remove_tree */
    char path[];
} cleanup_entry;
_Static_assert(ATOMIC_POINTER_LOCK_FREE == 2, "the signal handler reads these pointers: they must be lock-free");
static _Atomic(cleanup_entry *) cleanup[DFL_CLEANUP_MAX];
static int cleanup_top; /* slots at and past it were never used: unregister stops there */

static int set_up;
static pthread_t cleanup_thread; /* the thread that opens and writes the outputs */
static mode_t process_umask;     /* read once, by set_up_once() */

static int is_dot_or_dotdot(const char *name) {
    return name[0] == '.' && (name[1] == 0 || (name[1] == '.' && name[2] == 0));
}

/* Removing a temporary directory: its entries, and with `levels` > 1 the
 * directories in it, `levels` - 1 deep (a checkpoint is flat: 1; an export
 * holds record directories of files: 2). The depth is bounded, so the
 * recursion and its stack are (one buffer a level), and a directory
 * nested deeper than an output of ours writes stays (rmdir fails).
 * The signal handler runs this, so it uses only async-signal-safe calls:
 * opendir and readdir allocate, and a signal that lands inside malloc
 * would deadlock on its lock. getdents64 reads the names into a buffer on
 * the stack; as unlinking while reading may skip a name, the directory is
 * read again until a pass removes nothing. A directory entry fails
 * unlinkat without AT_REMOVEDIR (EISDIR), and is then emptied and removed
 * (O_NOFOLLOW: a symbolic link is unlinked, never followed). */
static void empty_dir_at(int fd, int levels);

static int remove_subdir_at(int parent, const char *name, int levels) {
    int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return -1;
    empty_dir_at(fd, levels);
    close(fd);
    return unlinkat(parent, name, AT_REMOVEDIR);
}

static void empty_dir_at(int fd, int levels) {
    _Alignas(struct dirent64) char buf[8192];
    for (int pass = 0, removed = 1; removed && pass < 64; pass++) {
        removed = 0;
        if (lseek(fd, 0, SEEK_SET) < 0) break;
        long n;
        while ((n = syscall(SYS_getdents64, fd, buf, sizeof buf)) > 0) {
            for (long off = 0; off < n;) {
                const struct dirent64 *e = (const struct dirent64 *)(buf + off);
                off += e->d_reclen;
                if (is_dot_or_dotdot(e->d_name)) continue;
                if (unlinkat(fd, e->d_name, 0) == 0 || (levels > 1 && remove_subdir_at(fd, e->d_name, levels - 1) == 0))
                    removed = 1;
            }
        }
    }
}

static void remove_tree(const char *path, int levels) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        empty_dir_at(fd, levels);
        close(fd);
    }
    rmdir(path);
}

/* The entries stay in the table (the process is ending): still reachable,
 * so a leak checker at exit does not report them. */
static void run_cleanup(void) {
    for (int i = 0; i < DFL_CLEANUP_MAX; i++) {
        const cleanup_entry *e = atomic_load(&cleanup[i]);
        if (!e) continue;
        if (e->levels) remove_tree(e->path, e->levels);
        else unlink(e->path);
    }
}

/* A signal lands on any thread that does not block it: an OpenMP worker of
 * the CPU ops, the read-ahead thread. Cleaning up there would remove a
 * temporary directory while the writing thread still creates files in it
 * (left behind, not empty). So the signal goes on to the thread that
 * registered the outputs, whose handler then interrupts the writing
 * itself; pthread_self and pthread_kill are async-signal-safe. */
static void on_signal(int sig) {
    if (!pthread_equal(pthread_self(), cleanup_thread)) {
        pthread_kill(cleanup_thread, sig);
        return;
    }
    run_cleanup();
    signal(sig, SIG_DFL);
    raise(sig);
}

/* The signals whose default action ends the process and that a user, a
 * shell or the system sends: Ctrl-C and Ctrl-\ (SIGINT, SIGQUIT), kill and
 * timeout (SIGTERM, and SIGALRM, SIGUSR1, SIGUSR2, SIGVTALRM by name, as
 * batch schedulers send USR1/USR2 before a job's end), a closed terminal
 * (SIGHUP), a closed pipe (SIGPIPE, as `| head` gives), and the limits of
 * ulimit -t and -f (SIGXCPU, SIGXFSZ: a write past the file-size limit).
 * Each kills as before, after the temporary outputs are removed.
 * Not SIGPROF: a profiler (gprof's profil, gperftools) catches its ticks
 * with its own handler, which ours would replace, ending the run at the
 * first tick. Nor the signals of a fault (SIGSEGV, SIGBUS, SIGFPE, SIGILL,
 * SIGTRAP, SIGSYS): a bug, whose state a cleanup should not trust, and
 * which debuggers and sanitizers want; SIGABRT is dfl_abort's hook.
 * A signal ignored when the tool starts stays ignored: under nohup
 * (SIGHUP) or as a script's background job (SIGINT) the caller asked for
 * the run to survive it, as GNU tools and zstd let it; an ignored SIGPIPE
 * or SIGXFSZ makes the write fail (EPIPE, EFBIG), which the tool reports
 * as an I/O error. A handler that is already there (not the default) is
 * left too: whoever installed it handles that signal. */
static const int handled_signals[] = {SIGINT,  SIGTERM, SIGHUP,  SIGPIPE,   SIGQUIT, SIGALRM,
                                      SIGXCPU, SIGXFSZ, SIGUSR1, SIGUSR2, SIGVTALRM};

static void install_handlers(void) {
    atexit(run_cleanup);
    dfl_set_abort_hook(run_cleanup);
    for (size_t i = 0; i < sizeof handled_signals / sizeof handled_signals[0]; i++) {
        struct sigaction sa, old;
        if (sigaction(handled_signals[i], NULL, &old) != 0 || old.sa_handler != SIG_DFL) continue;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_signal;
        sigemptyset(&sa.sa_mask);
        sigaction(handled_signals[i], &sa, NULL);
    }
}

/* On the first output, from the writing thread (main). umask() is read by
 * setting it, for the whole process: set to the strictest value meanwhile,
 * a file another thread might create then is never more open. */
static void set_up_once(void) {
    if (set_up) return;
    set_up = 1;
    cleanup_thread = pthread_self();
    process_umask = umask(077);
    umask(process_umask);
    install_handlers();
}

/* Block the handled signals on this thread (until release_signals): one
 * that lands meanwhile, here or forwarded from another thread, waits, and
 * is handled once they are let in again. */
static void hold_signals(sigset_t *prev) {
    sigset_t held;
    sigemptyset(&held);
    for (size_t i = 0; i < sizeof handled_signals / sizeof handled_signals[0]; i++) sigaddset(&held, handled_signals[i]);
    pthread_sigmask(SIG_BLOCK, &held, prev);
}

static void release_signals(const sigset_t *prev) { pthread_sigmask(SIG_SETMASK, prev, NULL); }

/* The mode open(2) and mkdir(2) would give: mkstemp and mkdtemp create
 * 0600 and 0700, private whatever the umask, and a rename keeps that. As
 * lz4 and zstd do, an output gets 0666 (a directory 0777) less the umask. */
static mode_t creation_mode(mode_t full) {
    set_up_once();
    return full & ~process_umask;
}

int dfl_cleanup_register(const char *path, int levels) {
    set_up_once();
    size_t n = strlen(path) + 1;
    cleanup_entry *e = dfl_malloc(sizeof *e + n);
    e->levels = levels;
    memcpy(e->path, path, n);
    for (int i = 0; i < DFL_CLEANUP_MAX; i++) {
        cleanup_entry *none = NULL;
        if (atomic_load_explicit(&cleanup[i], memory_order_relaxed)) continue; /* taken: skip the locked exchange */
        if (!atomic_compare_exchange_strong(&cleanup[i], &none, e)) continue;
        if (i >= cleanup_top) cleanup_top = i + 1;
        return 0;
    }
    free(e);
    return dfl_err(DFL_EX_CANTCREAT, "%s: too many temporary outputs at once (at most %d)", path, DFL_CLEANUP_MAX);
}

int dfl_cleanup_mktemp(char *tmpl, int levels, int *fd) {
    set_up_once(); /* the handlers in place before anything exists to remove */
    sigset_t prev;
    hold_signals(&prev);
    int made = levels ? (mkdtemp(tmpl) ? 0 : -1) : (*fd = mkstemp(tmpl)) >= 0 ? 0 : -1;
    int rc = made ? -1 : dfl_cleanup_register(tmpl, levels);
    if (rc > 0) {
        if (levels) rmdir(tmpl);
        else close(*fd), unlink(tmpl);
    }
    int err = errno;
    release_signals(&prev);
    errno = err;
    return rc;
}

void dfl_cleanup_unregister(const char *path) {
    for (int i = 0; i < cleanup_top; i++) {
        cleanup_entry *e = atomic_load(&cleanup[i]);
        if (e && !strcmp(e->path, path) && atomic_compare_exchange_strong(&cleanup[i], &e, NULL)) free(e);
    }
}

/* ".NAME.TAG.XXXXXX" in the directory of `final` (TAG "tmp": an output
 * being written; "old": one being replaced). */
static int tmp_name_for(const char *final, const char *tag, char *buf, size_t n) {
    const char *slash = strrchr(final, '/');
    int dirlen = slash ? (int)(slash - final + 1) : 0;
    const char *base = slash ? slash + 1 : final;
    int k = snprintf(buf, n, "%.*s.%s.%s.XXXXXX", dirlen, final, base, tag);
    return k > 0 && (size_t)k < n ? 0 : -1;
}

/* sync (fsync or syncfs) on the file or directory at `path`: 0, or -1
 * with errno set. */
static int sync_path(const char *path, int (*sync)(int)) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    int rc = sync(fd);
    int err = errno;
    close(fd);
    errno = err;
    return rc;
}

static int fsync_path(const char *path) { return sync_path(path, fsync); }

/* After a rename into a directory, that directory (its entries are its
 * data, as fsync(2) says): else a power loss can undo the rename. Best
 * effort: the output is complete and in place whatever this returns. */
static void fsync_parent(const char *path) {
    char dir[PATH_MAX];
    const char *slash = strrchr(path, '/');
    size_t n = !slash ? 0 : slash == path ? 1 : (size_t)(slash - path);
    if (n >= sizeof dir) return;
    memcpy(dir, path, n);
    dir[n] = 0;
    fsync_path(n ? dir : ".");
}

static int empty_path(const char *opt) { return dfl_empty_path_err(DFL_EX_CANTCREAT, opt); }

int dfl_out_check_name(const char *opt, const char *path) { return path && !*path ? empty_path(opt) : 0; }

/* `path` split into its directory (".", or "/" for a name right under the
 * root) and its last component; a trailing '/' names the same directory. */
static void split_path(const char *path, char parent[PATH_MAX], char last[PATH_MAX]) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    size_t slash = n;
    while (slash > 0 && path[slash - 1] != '/') slash--;
    size_t plen = slash == 0 ? 0 : slash == 1 ? 1 : slash - 1;
    snprintf(parent, PATH_MAX, "%.*s", (int)plen, plen ? path : ".");
    snprintf(last, PATH_MAX, "%.*s", (int)(n - slash), path + slash);
}

static int same_inode(const struct stat *a, const struct stat *b) {
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

/* Whether directory `dir` exists and is the directory `path` lies in. */
static int lies_in(const char *path, const char *dir) {
    char parent[PATH_MAX], last[PATH_MAX];
    split_path(path, parent, last);
    struct stat sp, sd;
    return stat(parent, &sp) == 0 && stat(dir, &sd) == 0 && S_ISDIR(sd.st_mode) && same_inode(&sp, &sd);
}

/* Two paths naming one file: the same inode where both exist; where one
 * does not, the same last component in the same directory. */
static int same_path(const char *a, const char *b) {
    struct stat sa, sb;
    int ha = stat(a, &sa) == 0, hb = stat(b, &sb) == 0;
    if (ha && hb) return same_inode(&sa, &sb);
    if (ha != hb) return 0;
    char pa[PATH_MAX], la[PATH_MAX], pb[PATH_MAX], lb[PATH_MAX];
    split_path(a, pa, la);
    split_path(b, pb, lb);
    return strcmp(la, lb) == 0 && lies_in(a, pb);
}

/* 1 if `name` is longer than `ext` and ends with it. */
static int ends_with(const char *name, const char *ext) {
    size_t n = strlen(name), k = ext ? strlen(ext) : 0;
    return ext && n > k && !strcmp(name + n - k, ext);
}

int dfl_out_check_input(const char *opt, const char *out, const char *in_opt, const char *in, dfl_in_kind kind) {
    if (!out || !in || !*out || !*in || !strcmp(out, "-") || !strcmp(in, "-")) return 0;
    struct stat si;
    if (same_path(out, in))
        return dfl_err(DFL_EX_USAGE, "%s %s is the %s %s", opt, out, in_opt,
                       kind == DFL_IN_OUT_DIR || (stat(in, &si) == 0 && S_ISDIR(si.st_mode)) ? "directory" : "file");
    if (kind == DFL_IN_FILE || !lies_in(out, in)) return 0;
    char parent[PATH_MAX], name[PATH_MAX];
    split_path(out, parent, name);
    struct stat so;
    if (kind == DFL_IN_OUT_DIR)
        return dfl_err(DFL_EX_USAGE, "%s %s is inside the %s directory %s, which the run replaces", opt, out, in_opt,
                       in);
    if (stat(out, &so) == 0 && S_ISREG(so.st_mode) && (ends_with(name, ".json") || ends_with(name, ".safetensors")))
        return dfl_err(DFL_EX_USAGE, "%s %s would replace a file of the %s directory %s", opt, out, in_opt, in);
    return 0;
}

int dfl_out_open(dfl_out **out, const char *path, int binary) {
    *out = NULL;
    if (!*path) return empty_path(NULL);
    if (!strcmp(path, "-")) {
        if (binary && isatty(STDOUT_FILENO))
            return dfl_err(DFL_EX_USAGE, "refusing to write binary data to a terminal; redirect stdout or use -o FILE");
        dfl_out *o = dfl_calloc(1, sizeof *o);
        o->f = stdout;
        o->final_path = dfl_strdup("-");
        *out = o;
        return 0;
    }
    /* An existing device or FIFO (-o /dev/null) is written in place: a rename
     * over it would replace the device with a regular file. */
    struct stat st;
    /* refused now, not by the rename once the work is done */
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) return dfl_err(DFL_EX_CANTCREAT, "%s: is a directory", path);
    if (stat(path, &st) == 0 && (S_ISCHR(st.st_mode) || S_ISFIFO(st.st_mode))) {
        FILE *f = fopen(path, "wb");
        if (!f) return dfl_err(DFL_EX_CANTCREAT, "%s: cannot open: %s", path, strerror(errno));
        if (binary && isatty(fileno(f))) {
            fclose(f);
            return dfl_err(DFL_EX_USAGE, "%s: refusing to write binary data to a terminal", path);
        }
        dfl_out *o = dfl_calloc(1, sizeof *o);
        o->f = f;
        o->own_f = 1;
        o->final_path = dfl_strdup(path);
        *out = o;
        return 0;
    }
    char tmp[PATH_MAX];
    if (tmp_name_for(path, "tmp", tmp, sizeof tmp)) return dfl_err(DFL_EX_CANTCREAT, "%s: path too long", path);
    int fd = -1, rc = dfl_cleanup_mktemp(tmp, 0, &fd);
    if (rc < 0) return dfl_err(DFL_EX_CANTCREAT, "%s: cannot create: %s", path, strerror(errno));
    if (rc) return rc;
    fchmod(fd, creation_mode(0666));
    dfl_out *o = dfl_calloc(1, sizeof *o);
    o->f = fdopen(fd, "wb");
    if (!o->f) {
        close(fd);
        unlink(tmp);
        dfl_cleanup_unregister(tmp);
        free(o);
        return dfl_err(DFL_EX_CANTCREAT, "%s: cannot open: %s", path, strerror(errno));
    }
    o->final_path = dfl_strdup(path);
    o->tmp_path = dfl_strdup(tmp);
    *out = o;
    return 0;
}

int dfl_out_open_staged(dfl_out **out, const char *path, int binary) {
    (void)binary; /* never stdout nor a terminal: a new file in our directory */
    *out = NULL;
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, creation_mode(0666));
    if (fd < 0) return dfl_err(DFL_EX_CANTCREAT, "%s: cannot create: %s", path, strerror(errno));
    FILE *f = fdopen(fd, "wb");
    if (!f) {
        int err = errno;
        close(fd);
        unlink(path);
        return dfl_err(DFL_EX_CANTCREAT, "%s: cannot open: %s", path, strerror(err));
    }
    dfl_out *o = dfl_calloc(1, sizeof *o);
    o->f = f;
    o->own_f = 1;
    o->staged = 1;
    o->final_path = dfl_strdup(path);
    *out = o;
    return 0;
}

FILE *dfl_out_file(dfl_out *o) { return o->f; }
const char *dfl_out_path(const dfl_out *o) { return o->final_path; }

static void out_free(dfl_out *o) {
    free(o->final_path);
    free(o->tmp_path);
    free(o);
}

/* What the output is called in messages. */
static const char *out_name(const dfl_out *o) { return o->tmp_path || o->own_f ? o->final_path : "stdout"; }

int dfl_out_finish(dfl_out *o) {
    if (o->finished) return 0;
    o->finished = 1;
    int rc = 0;
    if (fflush(o->f) != 0 || ferror(o->f) || (o->tmp_path && fsync(fileno(o->f)) != 0))
        rc = dfl_err(DFL_EX_IOERR, "%s: write failed: %s", out_name(o), strerror(errno));
    if (o->own_f || o->tmp_path) { /* ours to close: stdout stays open for dfl_close_stdout */
        if (fclose(o->f) != 0 && !rc) rc = dfl_err(DFL_EX_IOERR, "%s: close failed: %s", out_name(o), strerror(errno));
        o->f = NULL;
    }
    return rc;
}

int dfl_out_commit(dfl_out *o) {
    int rc = dfl_out_finish(o);
    if (rc) {
        dfl_out_abort(o);
        return rc;
    }
    if (o->tmp_path) {
        if (rename(o->tmp_path, o->final_path) != 0) {
            rc = dfl_err(DFL_EX_CANTCREAT, "%s: cannot rename into place: %s", o->final_path, strerror(errno));
            unlink(o->tmp_path);
        } else {
            fsync_parent(o->final_path);
        }
        dfl_cleanup_unregister(o->tmp_path);
    }
    out_free(o);
    return rc;
}

void dfl_out_abort(dfl_out *o) {
    if (!o) return;
    if (o->f && (o->own_f || o->tmp_path)) fclose(o->f);
    else if (o->f) fflush(o->f);
    if (o->staged) {
        unlink(o->final_path);
    } else if (o->tmp_path) {
        unlink(o->tmp_path);
        dfl_cleanup_unregister(o->tmp_path);
    }
    out_free(o);
}

/* "ckpt/" -> "ckpt" (shell completion adds the slash): the temporary and
 * the moved-aside names go beside the directory, not inside it. */
static int strip_slashes(const char *path, char *buf, size_t n) {
    size_t len = strlen(path);
    while (len > 1 && path[len - 1] == '/') len--;
    if (len >= n) return dfl_err(DFL_EX_CANTCREAT, "%s: path too long", path);
    memcpy(buf, path, len);
    buf[len] = 0;
    return 0;
}

/* The cleanup depth of an output of this layout: its record directories
 * are removed with it. */
static int layout_levels(const dfl_dir_layout *l) { return l && l->is_subdir ? 2 : 1; }

static int tmpdir_create(const char *final_path, char *tmp_path, size_t n, int levels) {
    if (!*final_path) return empty_path(NULL);
    char buf[PATH_MAX];
    if (strip_slashes(final_path, buf, sizeof buf)) return DFL_EX_CANTCREAT;
    if (tmp_name_for(buf, "tmp", tmp_path, n)) return dfl_err(DFL_EX_CANTCREAT, "%s: path too long", final_path);
    int rc = dfl_cleanup_mktemp(tmp_path, levels, NULL);
    if (rc < 0) return dfl_err(DFL_EX_CANTCREAT, "%s: cannot create directory: %s", final_path, strerror(errno));
    if (!rc) chmod(tmp_path, creation_mode(0777));
    return rc;
}

int dfl_tmpdir_create(const char *final_path, char *tmp_path, size_t n) {
    return tmpdir_create(final_path, tmp_path, n, 1);
}

int dfl_tmpdir_create_layout(const char *final_path, char *tmp_path, size_t n, const dfl_dir_layout *layout) {
    return tmpdir_create(final_path, tmp_path, n, layout_levels(layout));
}

/* The files of a checkpoint (a few, some of them gigabytes) are synced one
 * by one, the JSON ones included, then the directory, whose entries are
 * its data (fsync(2)): all before the rename, so the name never points at
 * a directory whose files a power loss could leave empty. */
static int fsync_files(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    char p[PATH_MAX + 256];
    struct dirent *e;
    int rc = 0;
    while (!rc && (e = readdir(d)))
        if (!is_dot_or_dotdot(e->d_name)) {
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            rc = fsync_path(p);
        }
    int err = errno;
    closedir(d);
    errno = err;
    return rc ? rc : fsync_path(dir);
}

/* An export holds three files a record: one fsync each is one journal
 * commit each on ext4 (20,000 records: 80,002 fsyncs). syncfs(2) writes
 * the whole filesystem's data in one go: the export's and, since it cannot
 * tell them apart, any other process's (as sync -f does). */
/* Everything a temporary directory holds, on disk before it is renamed. */
static int sync_tmpdir(const char *tmp_path, const char *final_path, int levels) {
    int rc = levels > 1 ? sync_path(tmp_path, syncfs) : fsync_files(tmp_path);
    if (rc == 0 || errno == EINVAL || errno == EROFS) return 0; /* a filesystem that does not sync: nothing to wait for */
    return dfl_err(DFL_EX_IOERR, "%s: cannot sync the new output to disk: %s", final_path, strerror(errno));
}

/* 1 if `name` is one of the NULL-terminated `names`. */
static int name_in(const char *name, const char *const *names) {
    for (; names && *names; names++)
        if (!strcmp(name, *names)) return 1;
    return 0;
}

static int refuse_entry(const char *final_path, const char *sub, const char *name) {
    return dfl_err(DFL_EX_CANTCREAT,
                   "%s: exists and holds '%s%s%s', which is not part of this output; refusing to replace the "
                   "directory (remove it or choose another name)",
                   final_path, sub ? sub : "", sub ? "/" : "", name);
}

/* An existing final directory may be replaced only if it holds nothing but
 * what an output of this kind writes (`l`): replacing it deletes it all. A
 * directory the user keeps other things in (`--out .`, `--out data`) is
 * refused, never emptied; so is a symbolic link or anything else that is
 * not a plain file where one is expected. `sub` is NULL for final_path
 * itself, else the name of one of its record directories. */
static int check_entries(const char *final_path, const char *sub, const dfl_dir_layout *l) {
    char dir[PATH_MAX], p[PATH_MAX + 256];
    int k = sub ? snprintf(dir, sizeof dir, "%s/%s", final_path, sub) : snprintf(dir, sizeof dir, "%s", final_path);
    if (k < 0 || (size_t)k >= sizeof dir) return dfl_err(DFL_EX_CANTCREAT, "%s: path too long", final_path);
    DIR *d = opendir(dir);
    if (!d) return dfl_err(DFL_EX_CANTCREAT, "%s: cannot read the existing directory: %s", dir, strerror(errno));
    struct dirent *e;
    struct stat st;
    int rc = 0;
    while (!rc && (e = readdir(d))) {
        if (is_dot_or_dotdot(e->d_name)) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        if (lstat(p, &st) != 0) rc = refuse_entry(final_path, sub, e->d_name);
        else if (S_ISREG(st.st_mode) && (sub ? ends_with(e->d_name, l->sub_ext) : name_in(e->d_name, l->names)))
            continue;
        else if (!sub && S_ISDIR(st.st_mode) && l->is_subdir && l->is_subdir(e->d_name))
            rc = check_entries(final_path, e->d_name, l);
        else rc = refuse_entry(final_path, sub, e->d_name);
    }
    closedir(d);
    return rc;
}

static int check_replaceable(const char *final_path, const dfl_dir_layout *l) {
    struct stat st;
    if (lstat(final_path, &st) != 0) return 0; /* nothing to replace */
    if (S_ISLNK(st.st_mode))
        return dfl_err(DFL_EX_CANTCREAT, "%s: is a symbolic link; refusing to replace it (give the real path)", final_path);
    if (!S_ISDIR(st.st_mode)) return dfl_err(DFL_EX_CANTCREAT, "%s: exists and is not a directory", final_path);
    return check_entries(final_path, NULL, l);
}

/* "." and ".." (also "out/.."): a directory that cannot be renamed, so
 * the commit would fail once the work is done (and "." would hold the
 * temporary directory by then). */
static int refuse_dot(const char *final_path) {
    const char *slash = strrchr(final_path, '/');
    if (!is_dot_or_dotdot(slash ? slash + 1 : final_path)) return 0;
    return dfl_err(DFL_EX_CANTCREAT, "%s: the current or parent directory cannot be replaced; name the output "
                   "directory itself", final_path);
}

int dfl_tmpdir_check_layout(const char *final_arg, const dfl_dir_layout *layout) {
    /* "" would pass the checks below (lstat fails: nothing to replace; the
     * probe goes beside it, in the current directory) and fail at the rename */
    if (!*final_arg) return empty_path(NULL);
    char final_path[PATH_MAX];
    if (strip_slashes(final_arg, final_path, sizeof final_path)) return DFL_EX_CANTCREAT;
    int rc = refuse_dot(final_path);
    if (!rc) rc = check_replaceable(final_path, layout);
    if (rc) return rc;
    char probe[PATH_MAX];
    if ((rc = dfl_tmpdir_create(final_path, probe, sizeof probe))) return rc;
    dfl_tmpdir_abort(probe);
    return 0;
}

int dfl_tmpdir_check(const char *final_path, const char *const *names) {
    const dfl_dir_layout l = {names, NULL, NULL};
    return dfl_tmpdir_check_layout(final_path, &l);
}

/* Where renameat2's exchange is missing (EINVAL: a filesystem without it),
 * two renames: the old directory aside as ".NAME.old.XXXXXX", the new one
 * in. Between them NAME does not exist; the handled signals are held off
 * meanwhile, so only a crash (SIGKILL, power loss) can stop the run there,
 * leaving both whole under their hidden names. The old one is registered
 * before the signals are let in again, so one landing while it is removed
 * finishes the removal. */
static int swap_by_renames(const char *tmp_path, const char *final_path, int levels) {
    char old[PATH_MAX];
    if (tmp_name_for(final_path, "old", old, sizeof old)) return dfl_err(DFL_EX_CANTCREAT, "%s: path too long", final_path);
    sigset_t prev;
    hold_signals(&prev); /* from here: even the free name's directory is never left behind */
    if (!mkdtemp(old)) {
        int err = errno;
        release_signals(&prev);
        return dfl_err(DFL_EX_CANTCREAT, "%s: %s", final_path, strerror(err));
    }
    rmdir(old); /* a free name, for the rename */
    int rc = 0, registered = 0;
    if (rename(final_path, old) != 0) {
        rc = dfl_err(DFL_EX_CANTCREAT, "%s: cannot replace: %s", final_path, strerror(errno));
    } else if (rename(tmp_path, final_path) != 0) {
        rc = dfl_err(DFL_EX_CANTCREAT, "%s: cannot rename into place: %s", final_path, strerror(errno));
        rename(old, final_path);
    } else {
        registered = dfl_cleanup_register(old, levels) == 0;
    }
    release_signals(&prev);
    if (rc) return rc;
    fsync_parent(final_path); /* both renames on disk before the old output's files go */
    remove_tree(old, levels);
    if (registered) dfl_cleanup_unregister(old);
    return 0;
}

/* Put the complete new directory in place of an old one. renameat2's
 * RENAME_EXCHANGE swaps the two in one step: NAME is at every moment the
 * whole old output or the whole new one, never absent nor a mix. The old
 * one then lies under the temporary name, still registered, so a signal
 * from here on removes it; a crash leaves it there, hidden, beside the new
 * NAME. */
static int swap_in(const char *tmp_path, const char *final_path, int levels) {
    if (renameat2(AT_FDCWD, tmp_path, AT_FDCWD, final_path, RENAME_EXCHANGE) == 0) {
        /* the exchange on disk before the old output's files are unlinked:
         * else a power loss could keep the unlinks and undo the exchange,
         * leaving NAME the old directory emptied */
        fsync_parent(final_path);
        remove_tree(tmp_path, levels);
        return 0;
    }
    if (errno != EINVAL && errno != ENOSYS)
        return dfl_err(DFL_EX_CANTCREAT, "%s: cannot replace: %s", final_path, strerror(errno));
    return swap_by_renames(tmp_path, final_path, levels);
}

int dfl_tmpdir_commit_layout(const char *tmp_path, const char *final_arg, const dfl_dir_layout *layout) {
    char final_path[PATH_MAX];
    if (strip_slashes(final_arg, final_path, sizeof final_path)) return DFL_EX_CANTCREAT;
    int rc = refuse_dot(final_path);
    if (!rc) rc = sync_tmpdir(tmp_path, final_path, layout_levels(layout));
    if (rc) return rc;
    struct stat st;
    if (lstat(final_path, &st) == 0) {
        /* checked again: it may have changed since dfl_tmpdir_check */
        rc = check_replaceable(final_path, layout);
        if (!rc) rc = swap_in(tmp_path, final_path, layout_levels(layout));
    } else if (rename(tmp_path, final_path) != 0) {
        rc = dfl_err(DFL_EX_CANTCREAT, "%s: cannot rename into place: %s", final_path, strerror(errno));
    } else {
        fsync_parent(final_path); /* swap_in syncs it itself, before removing the old output */
    }
    if (!rc) dfl_cleanup_unregister(tmp_path);
    return rc;
}

int dfl_tmpdir_commit(const char *tmp_path, const char *final_path, const char *const *names) {
    const dfl_dir_layout l = {names, NULL, NULL};
    return dfl_tmpdir_commit_layout(tmp_path, final_path, &l);
}

/* A temporary directory is ours whole: removed with one level of
 * subdirectories, whatever its layout. */
void dfl_tmpdir_abort(const char *tmp_path) {
    remove_tree(tmp_path, 2);
    dfl_cleanup_unregister(tmp_path);
}

int dfl_tmpdir_name_err(int rc, const char *tmp_path, const char *final_path) {
    const char *msg = dfl_errmsg();
    const size_t n = strlen(tmp_path);
    if (strncmp(msg, tmp_path, n) || msg[n] != '/') return rc;
    char *rest = dfl_strdup(msg + n + 1);
    size_t len = strlen(final_path);
    while (len > 1 && final_path[len - 1] == '/') len--;
    rc = dfl_err(rc, "%.*s/%s", (int)len, final_path, rest);
    free(rest);
    return rc;
}

int dfl_close_stdout(void) {
    /* As gnulib's close_stream: a stdout that was closed when the tool
     * started (>&-) fails fclose with EBADF, which is no error when nothing
     * was ever to be written there (-o FILE wrote its output); bytes pending
     * or an earlier write error are. */
    int pending = __fpending(stdout) != 0, bad = ferror(stdout) != 0;
    if (fclose(stdout) != 0 && (pending || errno != EBADF)) bad = 1;
    /* named as every other output's error is, "FILE: what failed" */
    if (bad) return dfl_err(DFL_EX_IOERR, "stdout: write failed: %s", strerror(errno));
    return 0;
}
