/* test_ops_cuda.c: the CUDA op table against the CPU reference, op by op
 * (tests/ops_agree.h says what is compared and with which limits).
 *
 * Linked three ways (Makefile): with the real CUDA backend (a GPU runs the
 * agreement tests; without a GPU or driver, the one check is that asking
 * for "cuda" fails cleanly with exit code 69 and CUDA's reason, and the
 * CPU still works), and as test_ops_cuda_emu with the kernels compiled for
 * the CPU against tests/emu, which runs the agreement tests everywhere.
 * DFLASH_TEST_BIG=1 adds the real-size shapes (tests/gpu/run.sh). */
#include "ops_agree.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static int unavail_code;
static char unavail_msg[1024];

static void cuda_unavailable_reported_cleanly(void) {
    T_CHECKF(unavail_code == DFL_EX_UNAVAIL, "dfl_ops_get(\"cuda\") returned %d, not %d", unavail_code,
             DFL_EX_UNAVAIL);
    T_CHECKF(strstr(unavail_msg, "cuda") != NULL && strlen(unavail_msg) > 20, "message: '%s'", unavail_msg);
    const dfl_ops *o = NULL;
    T_CHECK(dfl_ops_get("cuda:1", &o) == DFL_EX_UNAVAIL && o == NULL);
    T_CHECK(dfl_ops_get("cpu", &o) == 0 && o && !strcmp(o->name, "cpu"));
}

/* ---- the emulation's own checks (test_ops_cuda_emu only) ------------------------
 * Defined by tests/emu (cuda_emu.cpp, emu_toys.cpp); NULL (weak) in the
 * builds against the real CUDA backend or none, where these tests are
 * skipped. */
extern void dfl_emu_set_schedule(unsigned seed) __attribute__((weak));
extern void dfl_emu_race_fatal(int on) __attribute__((weak));
extern unsigned long dfl_emu_races(void) __attribute__((weak));
extern int dfl_emu_toy(const char *name, int fixed, float *out, int n) __attribute__((weak));

/* bytes of device outputs, appended */
typedef struct {
    unsigned char *p;
    size_t n;
} bytes;

static void take(bytes *b, const void *dev, int64_t n, ag_kind kind) {
    size_t sz = (size_t)n * (kind == AG_ACT ? 2 : 4);
    b->p = dfl_realloc(b->p, b->n + sz + 1);
    if (kind == AG_ACT) DEV->act_to_bf16((uint16_t *)(b->p + b->n), dev, n);
    else DEV->download(b->p + b->n, dev, sz);
    b->n += sz;
}

static void *dput(const void *host, int64_t n, ag_kind kind) { return ag_put(DEV, host, n, kind); }

/* Every op with shared memory, warp collectives or a cross-thread order, on
 * fixed inputs, under the emulation's current schedule: all output bytes. */
static bytes schedule_run(void) {
    bytes b = {NULL, 0};
    dfl_rng_seed(&AG_RNG, 77);
    /* DFlash attention forward and backward: tensor cores (D 64) and simple (D 40) */
    const int32_t ctx[] = {100, 80}, anc[] = {5, 3};
    for (int pass = 0; pass < 2; pass++) {
        dflash_shape s = dflash_layout(ctx, 2, anc, pass ? 5 : 16, 8, 2, pass ? 40 : 64);
        const int64_t nq = s.nblk * s.B, QN = nq * s.Hq * s.D, KN = s.NK * s.Hkv * s.D;
        float *hq = ag_randn(QN, 1), *hk = ag_randn(KN, 1), *hv = ag_randn(KN, 1), *hd = ag_randn(QN, 1);
        void *q = dput(hq, QN, AG_ACT), *k = dput(hk, KN, AG_ACT), *v = dput(hv, KN, AG_ACT);
        void *dout = dput(hd, QN, AG_ACT), *blk = dput(s.blocks, s.nblk * 3, AG_I32);
        void *out = dput(NULL, QN, AG_ACT), *lse = dput(NULL, nq * s.Hq, AG_F32);
        void *dq = dput(NULL, QN, AG_ACT), *dk = dput(NULL, KN, AG_ACT), *dv = dput(NULL, KN, AG_ACT);
        DEV->attn_dflash(out, lse, q, k, v, blk, s.nblk, s.B, s.NK, s.Hq, s.Hkv, s.D);
        DEV->attn_dflash_bwd(dq, dk, dv, dout, out, lse, q, k, v, blk, s.nblk, s.B, s.NK, s.Hq, s.Hkv, s.D);
        take(&b, out, QN, AG_ACT), take(&b, lse, nq * s.Hq, AG_F32);
        take(&b, dq, QN, AG_ACT), take(&b, dk, KN, AG_ACT), take(&b, dv, KN, AG_ACT);
        void *bufs[] = {q, k, v, dout, blk, out, lse, dq, dk, dv};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) DEV->free(bufs[i]);
        free(hq), free(hk), free(hv), free(hd), free(s.blocks);
    }
    /* causal attention, tensor cores, G = 3 */
    {
        const int32_t cu[] = {0, 17, 20, 84, 150};
        const int64_t T = 150, Hq = 6, Hkv = 2, D = 64;
        float *hq = ag_randn(T * Hq * D, 1), *hk = ag_randn(T * Hkv * D, 1), *hv = ag_randn(T * Hkv * D, 1);
        void *q = dput(hq, T * Hq * D, AG_ACT), *k = dput(hk, T * Hkv * D, AG_ACT), *v = dput(hv, T * Hkv * D, AG_ACT);
        void *c = dput(cu, 5, AG_I32), *out = dput(NULL, T * Hq * D, AG_ACT);
        DEV->attn_causal(out, q, k, v, c, 4, T, Hq, Hkv, D);
        take(&b, out, T * Hq * D, AG_ACT);
        DEV->free(q), DEV->free(k), DEV->free(v), DEV->free(c), DEV->free(out);
        free(hq), free(hk), free(hv);
    }
    /* RMSNorm backward (per-warp shared rows), vector and scalar paths */
    for (int64_t dim = 37; dim <= 96; dim += 59) {
        const int64_t rows = 45;
        float *hx = ag_randn(rows * dim, 2), *hw = ag_randn(dim, 1), *hd = ag_randn(rows * dim, 1);
        void *x = dput(hx, rows * dim, AG_ACT), *w = dput(hw, dim, AG_ACT), *d = dput(hd, rows * dim, AG_ACT);
        void *out = dput(NULL, rows * dim, AG_ACT), *rstd = dput(NULL, rows, AG_F32);
        void *din = dput(NULL, rows * dim, AG_ACT), *dw = dput(NULL, dim, AG_F32);
        DEV->rmsnorm(out, rstd, x, w, rows, dim, 1e-6f);
        DEV->rmsnorm_bwd(din, dw, d, x, rstd, w, rows, dim);
        take(&b, out, rows * dim, AG_ACT), take(&b, din, rows * dim, AG_ACT), take(&b, dw, dim, AG_F32);
        DEV->free(x), DEV->free(w), DEV->free(d), DEV->free(out), DEV->free(rstd), DEV->free(din), DEV->free(dw);
        free(hx), free(hw), free(hd);
    }
    /* LM head: block reductions of the softmax statistics */
    {
        const int64_t N = 21, H = 40, V = 333;
        float *hh = ag_randn(N * H, 1), *ht = ag_randn(N * H, 1), *hw = ag_randn(V * H, 0.3);
        int32_t lab[21];
        for (int i = 0; i < 21; i++) lab[i] = (int32_t)dfl_rng_below(&AG_RNG, (uint64_t)V);
        void *h = dput(hh, N * H, AG_ACT), *th = dput(ht, N * H, AG_ACT), *w = dput(hw, V * H, AG_ACT);
        void *l = dput(lab, N, AG_I32), *loss = dput(NULL, N, AG_F32), *pred = dput(NULL, N, AG_I32);
        void *dh = dput(NULL, N * H, AG_ACT);
        DEV->lmhead_ce(loss, pred, dh, h, w, l, NULL, N, H, V);
        take(&b, loss, N, AG_F32), take(&b, pred, N, AG_I32), take(&b, dh, N * H, AG_ACT);
        DEV->lmhead_kl(loss, pred, NULL, dh, h, th, w, NULL, N, H, V);
        take(&b, loss, N, AG_F32), take(&b, pred, N, AG_I32), take(&b, dh, N * H, AG_ACT);
        DEV->free(h), DEV->free(th), DEV->free(w), DEV->free(l), DEV->free(loss), DEV->free(pred), DEV->free(dh);
        free(hh), free(ht), free(hw);
    }
    /* sum of squares (block tree reductions) */
    {
        float *hx = ag_randn(5000, 1);
        void *x = dput(hx, 5000, AG_F32);
        double ss = DEV->sumsq(x, 5000);
        b.p = dfl_realloc(b.p, b.n + sizeof ss);
        memcpy(b.p + b.n, &ss, sizeof ss);
        b.n += sizeof ss;
        DEV->free(x);
        free(hx);
    }
    return b;
}

/* The emulation runs the threads of a block in other orders (tests/emu/
 * cuda_emu.h, "Schedules"); race-free kernels give the same bits in every
 * one. */
static void emu_schedules_give_identical_bits(void) {
    dfl_emu_set_schedule(0);
    bytes ref = schedule_run();
    T_CHECK(ref.n > 100000);
    const unsigned scheds[] = {1, 2, 3, 8};
    for (size_t i = 0; i < sizeof scheds / sizeof scheds[0]; i++) {
        dfl_emu_set_schedule(scheds[i]);
        bytes got = schedule_run();
        T_CHECKF(got.n == ref.n && memcmp(got.p, ref.p, ref.n) == 0, "schedule %u: outputs differ from schedule 0",
                 scheds[i]);
        free(got.p);
    }
    dfl_emu_set_schedule(0);
    free(ref.p);
}

/* Every kernel the agreement tests ran (with races fatal) was race-free. */
static void emu_kernels_race_free(void) { T_CHECKF(dfl_emu_races() == 0, "%lu races", dfl_emu_races()); }

/* the value toy row r, column c of stage i holds (emu_toys.cpp) */
static float toy_val(int i, int r, int c) {
    int idx = i * 512 + r * 8 + c;
    return bf16_round((float)(idx / 8) + (float)(idx % 8) / 8.0f);
}

/* expected toy outputs: lane L of warp w, register m, half j reads row
 * (w*32 + 8m + L/4) % 64, column 2(L%4) + j, summed over `stages` */
static void toy_expect(float *e, int stages) {
    for (int w = 0; w < 4; w++)
        for (int L = 0; L < 32; L++)
            for (int m = 0; m < 4; m++)
                for (int j = 0; j < 2; j++) {
                    float acc = 0;
                    for (int i = 0; i < stages; i++) acc += toy_val(i, (w * 32 + 8 * m + L / 4) % 64, 2 * (L % 4) + j);
                    e[(w * 32 + L) * 8 + 2 * m + j] = acc;
                }
}

/* The race detector finds the missing wait, the missing barrier after a
 * wait, and the missing barrier before a double buffer is overwritten, in
 * toy kernels built with the same cp.async/ldmatrix primitives, under every
 * schedule; their correct twins have no race and the right values. */
static void emu_race_detector_catches_toys(void) {
    static float out[1024], want[1024];
    const char *toys[] = {"cp_async_wait", "cp_async_barrier", "double_buffer"};
    dfl_emu_race_fatal(0);
    for (unsigned sched = 0; sched < 3; sched++) {
        dfl_emu_set_schedule(sched);
        for (int t = 0; t < 3; t++) {
            unsigned long r0 = dfl_emu_races();
            T_CHECK(dfl_emu_toy(toys[t], 0, out, 1024) == 1024);
            T_CHECKF(dfl_emu_races() > r0, "%s (schedule %u): the race was not reported", toys[t], sched);
            r0 = dfl_emu_races();
            T_CHECK(dfl_emu_toy(toys[t], 1, out, 1024) == 1024);
            T_CHECKF(dfl_emu_races() == r0, "%s fixed (schedule %u): %lu races reported", toys[t], sched,
                     dfl_emu_races() - r0);
            toy_expect(want, t == 2 ? 4 : 1);
            T_CHECKF(memcmp(out, want, sizeof want) == 0, "%s fixed (schedule %u): wrong values", toys[t], sched);
        }
    }
    dfl_emu_set_schedule(0);
    dfl_emu_race_fatal(1);
}

/* A race in plain shared-memory code (no cp.async or ldmatrix for the
 * detector to see): a neighbour exchange without its barrier gives
 * different bits under different schedules, and wrong values under some;
 * with the barrier, the right values under all. */
static void emu_schedules_expose_plain_races(void) {
    float want[256], got[256], first[256];
    for (int i = 0; i < 256; i++) want[i] = (float)((i / 64) * 64 + (i % 64 + 1) % 64 + 1);
    int differ = 0, wrong = 0;
    for (unsigned sched = 0; sched < 6; sched++) {
        dfl_emu_set_schedule(sched);
        T_CHECK(dfl_emu_toy("exchange", 0, sched ? got : first, 256) == 256);
        if (sched) differ |= memcmp(got, first, sizeof got) != 0;
        wrong |= memcmp(sched ? got : first, want, sizeof want) != 0;
        T_CHECK(dfl_emu_toy("exchange", 1, got, 256) == 256);
        T_CHECKF(memcmp(got, want, sizeof want) == 0, "exchange fixed (schedule %u): wrong values", sched);
    }
    dfl_emu_set_schedule(0);
    T_CHECKF(differ && wrong, "the racy exchange gave %s under 6 schedules", differ ? "right values" : "the same bits");
}

/* fork, run toy `name` (the buggy version) in the child; true if the child
 * aborted with `msg` in what it wrote to stderr */
static int toy_aborts(const char *name, const char *msg) {
    int fd[2];
    if (pipe(fd) != 0) return 0;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd[1], 2);
        close(fd[0]);
        float out[64];
        dfl_emu_toy(name, 0, out, 64);
        _exit(0);
    }
    close(fd[1]);
    char buf[4096];
    size_t n = 0;
    ssize_t k;
    while (n < sizeof buf - 1 && (k = read(fd[0], buf + n, sizeof buf - 1 - n)) > 0) n += (size_t)k;
    buf[n] = 0;
    close(fd[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    int ok = WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT && strstr(buf, msg) != NULL;
    if (!ok) fprintf(stderr, "  %s: child status %d, stderr: %s\n", name, st, buf);
    return ok;
}

/* What fails a launch or faults on the GPU aborts the emulation too: shared
 * memory over 48 KiB without the kernel's attribute raised, a 16-byte
 * access that is not 16-byte aligned. The correct versions run. */
static void emu_launch_checks_abort(void) {
    float out[64];
    T_CHECK(toy_aborts("big_smem", "over 48 KiB without cudaFuncSetAttribute"));
    T_CHECK(toy_aborts("misaligned", "not 16-byte aligned"));
    T_CHECK(dfl_emu_toy("big_smem", 1, out, 64) == 32);
    T_CHECK(dfl_emu_toy("misaligned", 1, out, 64) == 8);
    for (int i = 0; i < 8; i++) T_CHECK(out[i] == (float)(8 + i));
}

int main(void) {
    setenv("DFLASH_CUDA_LMHEAD_ROWS", "16", 0); /* several LM-head chunks at test sizes */
    const dfl_ops *cuda = NULL;
    int rc = dfl_ops_get("cuda", &cuda);
    if (rc != 0) {
        unavail_code = rc;
        snprintf(unavail_msg, sizeof unavail_msg, "%s", dfl_errmsg());
        printf("no CUDA backend here (exit code %d): %s\n", rc, unavail_msg);
        T_RUN(cuda_unavailable_reported_cleanly);
        return t_exit();
    }
    REF = dfl_ops_cpu();
    DEV = cuda;
    AG_BIG = getenv("DFLASH_TEST_BIG") && strcmp(getenv("DFLASH_TEST_BIG"), "0") != 0;
    const char *simple = getenv("DFLASH_CUDA_SIMPLE");
    printf("CUDA backend%s%s\n", simple && strcmp(simple, "0") ? " (simple attention kernels)" : "",
           AG_BIG ? ", with the real-size shapes" : "");
    ops_agree_all(20261130);
    if (dfl_emu_set_schedule && dfl_emu_toy && !getenv("DFLASH_TEST_ONLY")) {
        T_RUN(emu_kernels_race_free);
        T_RUN(emu_schedules_give_identical_bits);
        T_RUN(emu_race_detector_catches_toys);
        T_RUN(emu_schedules_expose_plain_races);
        T_RUN(emu_launch_checks_abort);
    }
    return t_exit();
}
