/* test_outfile: the signal cleanup of temporary outputs (lib/outfile.c),
 * in forked children that are killed by the signal they raise (or exit 70
 * on a failed assertion). */
#include "../../lib/common.h"
#include "../../lib/outfile.h"
#include "../test.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Entries of `dir` other than "." and "..", -1 if it cannot be read. */
static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

/* waitpid, but a child still running after 30 s is killed (SIGKILL): a
 * cleanup that hangs fails the test instead of hanging it. The watchdog is
 * the parent's, as every signal a child could set itself (alarm's SIGALRM)
 * is one the cleanup now handles. */
static pid_t wait_or_kill(pid_t pid, int *status) {
    const struct timespec tick = {0, 10 * 1000 * 1000};
    for (int i = 0; i < 3000; i++) {
        pid_t r = waitpid(pid, status, WNOHANG);
        if (r != 0) return r;
        nanosleep(&tick, NULL);
    }
    kill(pid, SIGKILL);
    return waitpid(pid, status, 0);
}

/* Waits for the child forked to work in `parent`; checks that it ended by
 * `sig` (0: exited with status 0) and left `parent` empty, then removes
 * `parent`. `round` (>= 0) goes into the messages. */
static void reap_and_check(pid_t pid, int sig, const char *parent, int round) {
    int status = 0;
    T_CHECK(wait_or_kill(pid, &status) == pid);
    if (sig)
        T_CHECKF(WIFSIGNALED(status) && WTERMSIG(status) == sig,
                 "round %d: status 0x%x (exit %d), expected death by signal %d (SIGKILL %d: the cleanup hung)", round,
                 status, WIFEXITED(status) ? WEXITSTATUS(status) : -1, sig, SIGKILL);
    else
        T_CHECKF(WIFEXITED(status) && WEXITSTATUS(status) == 0, "round %d: status 0x%x (exit %d)", round, status,
                 WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    T_CHECKF(count_entries(parent) == 0, "round %d: %d entries left in %s", round, count_entries(parent), parent);
    t_rm_rf(parent);
}

static void *signal_this_thread(void *arg) {
    const struct timespec wait = {0, 200 * 1000 * 1000}; /* the directory fills: a long cleanup */
    nanosleep(&wait, NULL);
    pthread_kill(pthread_self(), *(int *)arg);
    for (;;) pause();
    return NULL;
}

/* The child: a checkpoint directory being filled by the main thread, as
 * the trainer fills one, while a signal lands on another thread. */
static void child_fills_while_signalled(const char *parent, int sig) {
    char final[PATH_MAX], tmp[PATH_MAX], f[PATH_MAX + 32];
    snprintf(final, sizeof final, "%s/ck", parent);
    if (dfl_tmpdir_create(final, tmp, sizeof tmp)) _exit(3);
    pthread_t th;
    if (pthread_create(&th, NULL, signal_this_thread, &sig)) _exit(4);
    for (long i = 0; i < 50L * 1000 * 1000; i++) {
        snprintf(f, sizeof f, "%s/file-%ld", tmp, i);
        int fd = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) close(fd);
    }
    _exit(5); /* the signal never came */
}

/* A signal that lands on a thread other than the writer's: the writer is
 * interrupted, the temporary directory removed whole, and the process ends
 * by that signal. When the cleanup ran on the signalled thread, the writer
 * went on creating files while the directory was emptied, and it stayed. */
static void test_signal_on_another_thread_cleans_up(void) {
    const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
    for (int round = 0; round < 12; round++) { /* ~1 in 3 left a directory behind */
        const int sig = sigs[round % 3];
        char parent[] = "/tmp/dflash-outfile.XXXXXX";
        T_CHECK(mkdtemp(parent) != NULL);
        pid_t pid = fork();
        if (pid == 0) child_fills_while_signalled(parent, sig);
        reap_and_check(pid, sig, parent, round);
    }
}

/* No core file in the working directory from a child's SIGQUIT, SIGXCPU
 * or SIGXFSZ (their default action dumps core). */
static void no_core(void) {
    const struct rlimit none = {0, 0};
    setrlimit(RLIMIT_CORE, &none);
}

/* The child: a temporary checkpoint directory and a temporary file with
 * bytes in it, in `parent`. */
static void child_opens_outputs(const char *parent, dfl_out **o) {
    char final[PATH_MAX], tmp[PATH_MAX];
    no_core();
    snprintf(final, sizeof final, "%s/ck", parent);
    if (dfl_tmpdir_create(final, tmp, sizeof tmp)) _exit(3);
    snprintf(final, sizeof final, "%s/out.dfs", parent);
    if (dfl_out_open(o, final, 1)) _exit(4);
    fputs("partial", dfl_out_file(*o));
    fflush(dfl_out_file(*o));
}

/* The main thread's own signal: the same cleanup, in place, for every
 * signal that ends a process and that a user or the system sends. Only
 * SIGINT, SIGTERM, SIGHUP and SIGPIPE were handled: the others (a
 * Ctrl-\, kill -USR1 from a batch system, ...) left the outputs behind. */
static void test_signal_on_the_writer_cleans_up(void) {
    static const int sigs[] = {SIGTERM, SIGINT,  SIGHUP,  SIGQUIT, SIGALRM,
                               SIGXCPU, SIGXFSZ, SIGUSR1, SIGUSR2, SIGVTALRM};
    for (int round = 0; round < (int)(sizeof sigs / sizeof sigs[0]); round++) {
        char parent[] = "/tmp/dflash-outfile.XXXXXX";
        T_CHECK(mkdtemp(parent) != NULL);
        pid_t pid = fork();
        if (pid == 0) {
            dfl_out *o;
            child_opens_outputs(parent, &o);
            raise(sigs[round]);
            _exit(5);
        }
        reap_and_check(pid, sigs[round], parent, round);
    }
}

/* The signals as the system sends them: a write past `ulimit -f` (SIGXFSZ,
 * `(ulimit -f 4; dflash-extract ...)` left .NAME.tmp.* behind) and an
 * alarm that goes off (SIGALRM). */
static void test_system_signals_clean_up(void) {
    char parent[] = "/tmp/dflash-outfile.XXXXXX";
    T_CHECK(mkdtemp(parent) != NULL);
    pid_t pid = fork();
    if (pid == 0) {
        dfl_out *o;
        child_opens_outputs(parent, &o);
        const struct rlimit fsize = {4096, 4096};
        if (setrlimit(RLIMIT_FSIZE, &fsize)) _exit(6);
        static char block[8192];
        fwrite(block, 1, sizeof block, dfl_out_file(o));
        fflush(dfl_out_file(o)); /* past the limit: SIGXFSZ */
        _exit(7);
    }
    reap_and_check(pid, SIGXFSZ, parent, 0);
    T_CHECK(mkdtemp(strcpy(parent, "/tmp/dflash-outfile.XXXXXX")) != NULL);
    pid = fork();
    if (pid == 0) {
        dfl_out *o;
        child_opens_outputs(parent, &o);
        alarm(1);
        for (;;) pause();
    }
    reap_and_check(pid, SIGALRM, parent, 1);
}

static int accept_any(const char *name) { return name[0] != '.'; }

/* An export's temporary directory holds record directories of files (and
 * each file's own temporary name while it is written): a signal removes it
 * whole. The cleanup removed plain files only, so the record directories,
 * and the directory itself, stayed. */
static void test_signal_removes_nested_tmpdir(void) {
    char parent[] = "/tmp/dflash-outfile.XXXXXX";
    T_CHECK(mkdtemp(parent) != NULL);
    pid_t pid = fork();
    if (pid == 0) {
        static const char *const names[] = {"stream.json", NULL};
        const dfl_dir_layout l = {names, accept_any, ".npy"};
        char final[PATH_MAX], tmp[PATH_MAX], p[PATH_MAX + 64];
        snprintf(final, sizeof final, "%s/ex", parent);
        if (dfl_tmpdir_create_layout(final, tmp, sizeof tmp, &l)) _exit(3);
        for (int r = 0; r < 300; r++) { /* more names than one getdents64 buffer holds */
            snprintf(p, sizeof p, "%s/%06d-record-with-a-longish-id", tmp, r);
            if (mkdir(p, 0777)) _exit(4);
            for (int i = 0; i < 3; i++) {
                snprintf(p, sizeof p, "%s/%06d-record-with-a-longish-id/t%d.npy", tmp, r, i);
                int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
                if (fd < 0) _exit(5);
                close(fd);
            }
        }
        dfl_out *o, *staged; /* files being written inside a record directory */
        snprintf(p, sizeof p, "%s/000299-record-with-a-longish-id/open.npy", tmp);
        if (dfl_out_open(&o, p, 1)) _exit(6);
        snprintf(p, sizeof p, "%s/000299-record-with-a-longish-id/staged.npy", tmp);
        if (dfl_out_open_staged(&staged, p, 1)) _exit(6);
        fputs("partial", dfl_out_file(staged));
        if (count_entries(parent) != 1) _exit(7);
        raise(SIGTERM);
        _exit(8);
    }
    reap_and_check(pid, SIGTERM, parent, 0);
}

/* renameat2 as the library sees it: with `no_exchange` set, a filesystem
 * without RENAME_EXCHANGE (EINVAL), so the two-rename way is taken. */
static int no_exchange;
int renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags) {
    if (no_exchange && (flags & RENAME_EXCHANGE)) {
        errno = EINVAL;
        return -1;
    }
    return (int)syscall(SYS_renameat2, olddirfd, oldpath, newdirfd, newpath, flags);
}

/* mkdtemp and mkstemp as the library sees them: with `signal_in_mktemp`
 * set, the next one raises it once the path exists, on this thread, as if
 * a Ctrl-C landed right there, before the caller could register the path. */
static int signal_in_mktemp;

static void raise_once_made(void) {
    int sig = signal_in_mktemp;
    signal_in_mktemp = 0;
    if (sig) raise(sig);
}

char *mkdtemp(char *tmpl) {
    char *(*real)(char *) = (char *(*)(char *))dlsym(RTLD_NEXT, "mkdtemp");
    char *r = real(tmpl);
    if (r) raise_once_made();
    return r;
}

int mkstemp(char *tmpl) {
    int (*real)(char *) = (int (*)(char *))dlsym(RTLD_NEXT, "mkstemp");
    int fd = real(tmpl);
    if (fd >= 0) raise_once_made();
    return fd;
}

/* A signal that lands between a temporary path's creation and its
 * registration: the path is removed all the same (the signals are held
 * off between the two). Each kind of temporary: an output file, an output
 * directory, dflash-pack's bucket directory (through the same call); in a
 * fresh process (the first output: the handlers were not even installed,
 * so the signal killed it at once) and in one that has registered outputs
 * before. Without the hold, each round left its path behind. */
static void child_signalled_in_mktemp(const char *parent, int kind, int warm, int sig) {
    char path[PATH_MAX], tmp[PATH_MAX];
    if (warm) { /* an output made and committed before: the handlers are in */
        dfl_out *o;
        snprintf(path, sizeof path, "%s/before", parent);
        if (dfl_out_open(&o, path, 0) || dfl_out_commit(o)) _exit(3);
        unlink(path);
    }
    signal_in_mktemp = sig;
    if (kind == 0) {
        dfl_out *o;
        snprintf(path, sizeof path, "%s/out.txt", parent);
        dfl_out_open(&o, path, 0);
    } else if (kind == 1) {
        snprintf(path, sizeof path, "%s/ckpt", parent);
        dfl_tmpdir_create(path, tmp, sizeof tmp);
    } else {
        snprintf(tmp, sizeof tmp, "%s/bucketsXXXXXX", parent);
        dfl_cleanup_mktemp(tmp, 1, NULL);
    }
    _exit(4); /* the signal was lost */
}

static void test_signal_between_create_and_register(void) {
    const int sigs[2] = {SIGINT, SIGTERM};
    for (int round = 0; round < 12; round++) {
        char parent[] = "/tmp/dflash-outfile.XXXXXX";
        T_CHECK(mkdtemp(parent) != NULL);
        fflush(NULL);
        pid_t pid = fork();
        if (pid == 0) {
            no_core();
            child_signalled_in_mktemp(parent, round % 3, round / 3 % 2, sigs[round / 6]);
        }
        reap_and_check(pid, sigs[round / 6], parent, round);
    }
}

/* dir/stream.json and `n` record directories dir/00000R-tag/t.npy. */
static void make_export(const char *dir, int n, const char *tag) {
    char p[PATH_MAX + 64];
    snprintf(p, sizeof p, "%s/stream.json", dir);
    FILE *f = fopen(p, "w");
    T_CHECK(f != NULL);
    fputs(tag, f);
    fclose(f);
    for (int r = 0; r < n; r++) {
        snprintf(p, sizeof p, "%s/%06d-%s", dir, r, tag);
        T_CHECK(mkdir(p, 0777) == 0);
        snprintf(p, sizeof p, "%s/%06d-%s/t.npy", dir, r, tag);
        f = fopen(p, "w");
        T_CHECK(f != NULL);
        fclose(f);
    }
}

/* A new export replaces a larger earlier one whole (no record of the old
 * one left beside it, nothing left beside DIR), by the exchange and by the
 * two renames; a directory holding anything else is refused, untouched. */
static void test_commit_replaces_nested_whole(void) {
    static const char *const names[] = {"stream.json", NULL};
    const dfl_dir_layout l = {names, accept_any, ".npy"};
    for (no_exchange = 0; no_exchange < 2; no_exchange++) {
        char parent[] = "/tmp/dflash-outfile.XXXXXX", final[PATH_MAX], tmp[PATH_MAX], p[PATH_MAX + 64];
        T_CHECK(mkdtemp(parent) != NULL);
        snprintf(final, sizeof final, "%s/ex", parent);
        T_CHECK(mkdir(final, 0777) == 0);
        make_export(final, 5, "old");
        T_CHECK(dfl_tmpdir_check_layout(final, &l) == 0);
        T_CHECK(dfl_tmpdir_create_layout(final, tmp, sizeof tmp, &l) == 0);
        make_export(tmp, 2, "new");
        T_CHECKF(dfl_tmpdir_commit_layout(tmp, final, &l) == 0, "no_exchange %d: %s", no_exchange, dfl_errmsg());
        T_CHECKF(count_entries(parent) == 1 && count_entries(final) == 3, "no_exchange %d: %d beside, %d in DIR",
                 no_exchange, count_entries(parent), count_entries(final));
        snprintf(p, sizeof p, "%s/000001-new/t.npy", final);
        T_CHECK(access(p, F_OK) == 0);
        /* anything else in DIR: refused at the check and at the commit */
        snprintf(p, sizeof p, "%s/000001-new/notes.txt", final);
        FILE *f = fopen(p, "w");
        T_CHECK(f != NULL);
        fclose(f);
        T_CHECK(dfl_tmpdir_check_layout(final, &l) == DFL_EX_CANTCREAT);
        T_CHECKF(strstr(dfl_errmsg(), "holds '000001-new/notes.txt'") != NULL, "%s", dfl_errmsg());
        T_CHECK(dfl_tmpdir_create_layout(final, tmp, sizeof tmp, &l) == 0);
        T_CHECK(dfl_tmpdir_commit_layout(tmp, final, &l) == DFL_EX_CANTCREAT);
        dfl_tmpdir_abort(tmp);
        T_CHECK(count_entries(parent) == 1 && count_entries(final) == 3 && access(p, F_OK) == 0);
        t_rm_rf(parent);
    }
    no_exchange = 0;
}

/* The registry holds DFL_CLEANUP_MAX temporary outputs at once (dflash-pack
 * --shards 4096 and its buckets); one more is a clean error that leaves no
 * file, and a signal removes every one registered. It held 64, and the 65th
 * aborted on an assertion, leaving them all. */
static void child_fills_the_registry(const char *parent) {
    char p[PATH_MAX];
    for (int i = 0; i < DFL_CLEANUP_MAX - 1; i++) {
        snprintf(p, sizeof p, "%s/f-%d", parent, i);
        int fd = open(p, O_WRONLY | O_CREAT | O_EXCL, 0644);
        if (fd < 0) _exit(3);
        close(fd);
        if (dfl_cleanup_register(p, 0)) _exit(4);
    }
    dfl_out *last, *over;
    snprintf(p, sizeof p, "%s/last.dfs", parent);
    if (dfl_out_open(&last, p, 1)) _exit(5);
    snprintf(p, sizeof p, "%s/over.dfs", parent);
    if (dfl_out_open(&over, p, 1) != DFL_EX_CANTCREAT || over) _exit(6);
    if (count_entries(parent) != DFL_CLEANUP_MAX) _exit(7); /* no temporary file of the refused one */
    raise(SIGTERM);
    _exit(8);
}

static void test_registry_holds_every_shard(void) {
    T_CHECK(DFL_CLEANUP_MAX > 4096 + 1);
    char parent[] = "/tmp/dflash-outfile.XXXXXX";
    T_CHECK(mkdtemp(parent) != NULL);
    pid_t pid = fork();
    if (pid == 0) child_fills_the_registry(parent);
    reap_and_check(pid, SIGTERM, parent, 0);
}

static pthread_t main_thread;

static void *signal_main_soon(void *arg) {
    (void)arg;
    const struct timespec wait = {0, 2 * 1000 * 1000};
    nanosleep(&wait, NULL);
    pthread_kill(main_thread, SIGTERM);
    for (;;) pause();
    return NULL;
}

/* The child: a full checkpoint directory, and the main thread busy in
 * malloc and free (sizes past the thread cache, so the arena lock is
 * taken) when SIGTERM lands on it. A cleanup that allocates (opendir)
 * deadlocks on that lock; the parent kills such a child (wait_or_kill). */
static void child_in_malloc_when_signalled(const char *parent) {
    char final[PATH_MAX], tmp[PATH_MAX], f[PATH_MAX + 32];
    snprintf(final, sizeof final, "%s/ck", parent);
    if (dfl_tmpdir_create(final, tmp, sizeof tmp)) _exit(3);
    for (int i = 0; i < 300; i++) {
        snprintf(f, sizeof f, "%s/file-%d", tmp, i);
        int fd = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0) _exit(4);
        close(fd);
    }
    main_thread = pthread_self();
    pthread_t th;
    if (pthread_create(&th, NULL, signal_main_soon, NULL)) _exit(5);
    for (unsigned long i = 0;; i++) {
        volatile char *p = malloc(40000 + (i % 7) * 4096);
        if (!p) _exit(6);
        p[0] = (char)i;
        free((void *)p);
    }
}

/* The cleanup runs in the signal handler, so it must not allocate: it
 * used opendir/readdir, and a signal that landed inside malloc hung the
 * tool forever (found by review; now getdents64 into a stack buffer). */
static void test_signal_inside_malloc_cleans_up(void) {
    for (int round = 0; round < 20; round++) {
        char parent[] = "/tmp/dflash-outfile.XXXXXX";
        T_CHECK(mkdtemp(parent) != NULL);
        pid_t pid = fork();
        if (pid == 0) child_in_malloc_when_signalled(parent);
        reap_and_check(pid, SIGTERM, parent, round);
        if (t_failed_now) break;
    }
}

/* Writes to a pipe whose reader is gone, with one output open. */
static int write_to_a_closed_pipe(const char *parent, dfl_out **o) {
    char final[PATH_MAX];
    snprintf(final, sizeof final, "%s/out.dfs", parent);
    if (dfl_out_open(o, final, 1)) return -2;
    fputs("partial", dfl_out_file(*o));
    fflush(dfl_out_file(*o));
    int fds[2];
    if (pipe(fds)) return -2;
    close(fds[0]);
    return (int)write(fds[1], "x", 1);
}

/* `dflash-pack --stats ... | head`: SIGPIPE kills the tool, as it kills
 * any tool, but the temporary outputs go first; they were left behind. */
static void test_sigpipe_cleans_up(void) {
    char parent[] = "/tmp/dflash-outfile.XXXXXX";
    T_CHECK(mkdtemp(parent) != NULL);
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGPIPE, SIG_DFL);
        dfl_out *o;
        write_to_a_closed_pipe(parent, &o);
        _exit(5);
    }
    reap_and_check(pid, SIGPIPE, parent, 0);
}

/* SIGPIPE ignored by the caller stays ignored: the write fails with EPIPE
 * (the tool reports it and removes its outputs on the error path). */
static void test_ignored_sigpipe_stays_ignored(void) {
    char parent[] = "/tmp/dflash-outfile.XXXXXX";
    T_CHECK(mkdtemp(parent) != NULL);
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGPIPE, SIG_IGN);
        dfl_out *o;
        int n = write_to_a_closed_pipe(parent, &o);
        if (n != -1 || errno != EPIPE) _exit(3);
        if (count_entries(parent) != 1) _exit(4); /* the temporary output is still there */
        dfl_out_abort(o);
        _exit(0);
    }
    reap_and_check(pid, 0, parent, 0);
}

/* The whole content of a small file, or "" if it cannot be read. */
static const char *slurp(const char *path) {
    static char buf[256];
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    return buf;
}

/* Staged files (an export's) go straight under their names in a temporary
 * directory: committed they are there, whole, with nothing beside them;
 * aborted or failing to write they are gone; an existing name is refused,
 * never truncated. Then the directory is committed with them in it. */
static void test_staged_files(void) {
    char parent[] = "/tmp/dflash-outfile.XXXXXX", final[PATH_MAX], tmp[PATH_MAX], p[PATH_MAX + 32];
    T_CHECK(mkdtemp(parent) != NULL);
    snprintf(final, sizeof final, "%s/ex", parent);
    T_CHECK(dfl_tmpdir_create(final, tmp, sizeof tmp) == 0);
    dfl_out *o = NULL;
    snprintf(p, sizeof p, "%s/kept.npy", tmp);
    T_CHECK(dfl_out_open_staged(&o, p, 1) == 0);
    fputs("kept", dfl_out_file(o));
    T_CHECK(dfl_out_commit(o) == 0);
    T_CHECK(!strcmp(slurp(p), "kept"));
    T_CHECK(count_entries(tmp) == 1);

    T_CHECK(dfl_out_open_staged(&o, p, 1) == DFL_EX_CANTCREAT && o == NULL);
    T_CHECK(!strcmp(slurp(p), "kept"));

    snprintf(p, sizeof p, "%s/aborted.npy", tmp);
    T_CHECK(dfl_out_open_staged(&o, p, 1) == 0);
    fputs("aborted", dfl_out_file(o));
    dfl_out_abort(o);
    T_CHECK(access(p, F_OK) != 0 && count_entries(tmp) == 1);

    snprintf(p, sizeof p, "%s/failed.npy", tmp); /* its descriptor closed under it: the flush fails */
    T_CHECK(dfl_out_open_staged(&o, p, 1) == 0);
    fputs("never written", dfl_out_file(o));
    close(fileno(dfl_out_file(o)));
    T_CHECK(dfl_out_commit(o) == DFL_EX_IOERR);
    T_CHECK(access(p, F_OK) != 0 && count_entries(tmp) == 1);

    static const char *const names[] = {"kept.npy", NULL};
    T_CHECK(dfl_tmpdir_commit(tmp, final, names) == 0);
    snprintf(p, sizeof p, "%s/kept.npy", final);
    T_CHECK(!strcmp(slurp(p), "kept"));
    T_CHECK(count_entries(parent) == 1);
    t_rm_rf(parent);
}

/* Makes the assertion fail without the compiler seeing that it must. */
static volatile int one = 1;

static void *assert_on_this_thread(void *arg) {
    (void)arg;
    DFL_ASSERT(one == 0);
    return NULL;
}

/* The child of an assertion test: an output file being written and a
 * checkpoint directory holding a file, in `parent`, then an assertion that
 * fails on the main (writing) thread or on another one. stderr goes to
 * `errfd`. */
static void child_asserts(const char *parent, int on_another_thread, int errfd) {
    dup2(errfd, 2);
    char final[PATH_MAX], tmp[PATH_MAX], f[PATH_MAX + 8];
    snprintf(final, sizeof final, "%s/ck", parent);
    if (dfl_tmpdir_create(final, tmp, sizeof tmp)) _exit(3);
    snprintf(f, sizeof f, "%s/a", tmp);
    int fd = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) _exit(4);
    close(fd);
    dfl_out *o;
    snprintf(final, sizeof final, "%s/out.dfs", parent);
    if (dfl_out_open(&o, final, 1)) _exit(5);
    fputs("partial", dfl_out_file(o));
    fflush(dfl_out_file(o));
    if (on_another_thread) {
        pthread_t th;
        if (pthread_create(&th, NULL, assert_on_this_thread, NULL)) _exit(6);
        for (;;) pause();
    }
    assert_on_this_thread(NULL);
    _exit(7);
}

/* A failed assertion is an internal error: exit 70 (the exit table's, not
 * abort's SIGABRT), its file and line on stderr, and the temporary
 * outputs removed as a signal removes them, whichever thread it failed on. */
static void test_assertion_exits_70_and_cleans_up(void) {
    for (int other = 0; other < 2; other++) {
        char parent[] = "/tmp/dflash-outfile.XXXXXX";
        T_CHECK(mkdtemp(parent) != NULL);
        int fd[2];
        T_CHECK(pipe(fd) == 0);
        fflush(NULL);
        pid_t pid = fork();
        if (pid == 0) {
            close(fd[0]);
            child_asserts(parent, other, fd[1]);
        }
        close(fd[1]);
        char buf[4096];
        t_read_pipe(fd[0], buf, sizeof buf);
        int status = 0;
        T_CHECK(wait_or_kill(pid, &status) == pid);
        T_CHECKF(WIFEXITED(status) && WEXITSTATUS(status) == DFL_EX_SOFTWARE,
                 "thread %s: status 0x%x (exit %d), expected exit 70", other ? "other" : "writer", status,
                 WIFEXITED(status) ? WEXITSTATUS(status) : -1);
        T_CHECKF(strstr(buf, "internal error at") && strstr(buf, "test_outfile.c:") && strstr(buf, "one == 0"),
                 "stderr: %s", buf);
        T_CHECKF(count_entries(parent) == 0, "thread %s: %d entries left in %s", other ? "other" : "writer",
                 count_entries(parent), parent);
        t_rm_rf(parent);
    }
}

int main(void) {
    T_RUN(test_signal_on_the_writer_cleans_up);
    T_RUN(test_system_signals_clean_up);
    T_RUN(test_signal_on_another_thread_cleans_up);
    T_RUN(test_assertion_exits_70_and_cleans_up);
    T_RUN(test_signal_removes_nested_tmpdir);
    T_RUN(test_registry_holds_every_shard);
    T_RUN(test_signal_inside_malloc_cleans_up);
    T_RUN(test_signal_between_create_and_register);
    T_RUN(test_sigpipe_cleans_up);
    T_RUN(test_ignored_sigpipe_stays_ignored);
    /* last: these run in this process, whose handlers they install (the tests
     * above install theirs in forked children, after setting SIGPIPE) */
    T_RUN(test_commit_replaces_nested_whole);
    T_RUN(test_staged_files);
    return t_exit();
}
