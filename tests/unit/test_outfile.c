/* test_outfile: the signal cleanup of temporary outputs (lib/outfile.c),
 * in forked children that are killed by the signal they raise. */
#include "../../lib/common.h"
#include "../../lib/outfile.h"
#include "../test.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
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
        int status = 0;
        T_CHECK(waitpid(pid, &status, 0) == pid);
        T_CHECKF(WIFSIGNALED(status) && WTERMSIG(status) == sig, "round %d: status 0x%x, expected death by signal %d",
                 round, status, sig);
        T_CHECKF(count_entries(parent) == 0, "round %d (signal %d): %d entries left in %s", round, sig,
                 count_entries(parent), parent);
        t_rm_rf(parent);
    }
}

/* The main thread's own signal: the same cleanup, in place. */
static void test_signal_on_the_writer_cleans_up(void) {
    char parent[] = "/tmp/dflash-outfile.XXXXXX";
    T_CHECK(mkdtemp(parent) != NULL);
    pid_t pid = fork();
    if (pid == 0) {
        char final[PATH_MAX], tmp[PATH_MAX];
        snprintf(final, sizeof final, "%s/ck", parent);
        if (dfl_tmpdir_create(final, tmp, sizeof tmp)) _exit(3);
        dfl_out *o;
        snprintf(final, sizeof final, "%s/out.dfs", parent);
        if (dfl_out_open(&o, final, 1)) _exit(4);
        fputs("partial", dfl_out_file(o));
        fflush(dfl_out_file(o));
        raise(SIGTERM);
        _exit(5);
    }
    int status = 0;
    T_CHECK(waitpid(pid, &status, 0) == pid);
    T_CHECKF(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM, "status 0x%x", status);
    T_CHECKF(count_entries(parent) == 0, "%d entries left in %s", count_entries(parent), parent);
    t_rm_rf(parent);
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
    int status = 0;
    T_CHECK(waitpid(pid, &status, 0) == pid);
    T_CHECKF(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM, "status 0x%x (exit %d)", status,
             WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    T_CHECKF(count_entries(parent) == 0, "%d entries left in %s", count_entries(parent), parent);
    t_rm_rf(parent);
}

int main(void) {
    T_RUN(test_signal_on_the_writer_cleans_up);
    T_RUN(test_signal_on_another_thread_cleans_up);
    T_RUN(test_registry_holds_every_shard);
    return t_exit();
}
