// cuda_emu.cpp: the CPU emulation behind cuda_emu.h (what it covers and
// what it does not is said there).
#include "cuda_emu.h"

#include <setjmp.h>
#include <ucontext.h>

#include <map>
#include <unordered_map>
#include <vector>

namespace emu {

enum { RUN, WAIT_BLOCK, WAIT_WARP, WAIT_WG, DONE };
enum { OP_NONE, OP_SYNC, OP_SHFL, OP_BALLOT, OP_LDSM, OP_LDSM_T, OP_MMA };

// One cp.async in flight: it lands when its thread waits for its group.
struct Copy {
    unsigned char *dst;
    const unsigned char *src; // NULL: 16 zero bytes
    int group;
};

// A fiber starts once through setcontext (on its own stack) and from then
// on switches with _setjmp/_longjmp, which save no signal mask: no system
// call per switch, unlike swapcontext.
struct Fiber {
    ucontext_t ctx;
    jmp_buf jb;
    bool started;
    char *stack;
    emu_uint3 tid;
    int warp, lane, state;
    std::vector<Copy> copies; // issued, not yet landed
    int committed;            // cp.async groups committed so far
    int wg_commits;           // wgmma groups committed so far
    std::vector<uint32_t> unfenced; // granules its cp.async wrote since its last fence.proxy.async
};

// One warp's pending collective: every live lane deposits its operands and
// where its result goes; the last lane to arrive computes all results.
struct Warp {
    int size, arrived, done, op;
    uint32_t wsync; // __syncwarp count of this block (an ordering point for the race detector)
    uint32_t in[32][6];
    const void *ptr[32];
    void *out[32][4];
};

// One wgmma of a warpgroup: its shape, flags and descriptors, the A
// registers of each of its 128 threads (copied at issue), where each
// thread's accumulators are, and the commit group it belongs to.
struct WgOp {
    int N, group;
    bool tnsp_a, tnsp_b, scale_d, a_smem;
    uint64_t a_desc, b_desc;
    uint32_t a[128][4];
    float *d[128];
};

// Accumulators that a wgmma in flight owns: their values when it was
// issued; meanwhile the registers hold POISON, so that a read before the
// wait sees NaN and a write before it is seen at the wait.
struct Held {
    int n;
    std::vector<float> saved;
};
// a signalling NaN: arithmetic on it (even x * 1) gives a quiet NaN, other
// bits, so a write in flight is seen even when it is a rescaling
static const uint32_t POISON = 0x7f80deadu;

// A warpgroup: the collective being gathered (an issue or a wait), and its
// wgmma in flight, which run when a wait covers their group.
enum { WG_ISSUE = 1, WG_WAIT };
struct WGroup {
    int arrived, op, wait_n, commits;
    WgOp next;
    std::vector<WgOp> flight;
    std::unordered_map<float *, Held> held;
};

Fiber *cur;
emu_uint3 g_block;
dim3 g_blockdim, g_griddim;

static const size_t STACK = 256 << 10;
static std::vector<Fiber> fibers;
static std::vector<Warp> warps;
static std::vector<WGroup> wgroups;
static jmp_buf sched;
static int nthreads, block_arrived, done_count;
static Body *body;
static unsigned char *smem_buf;
static const size_t SMEM_MAX = 228 << 10, SMEM_OPTIN = 227 << 10, SMEM_DEFAULT = 48 << 10;

[[noreturn]] static void die(const char *msg) {
    fprintf(stderr, "cuda_emu: block (%u,%u,%u) thread %u: %s\n", g_block.x, g_block.y, g_block.z,
            cur ? cur->tid.x : 0u, msg);
    abort();
}

// a launch the runtime would refuse (no block runs yet)
[[noreturn]] static void launch_die(const char *msg) {
    fprintf(stderr, "cuda_emu: kernel launch: %s\n", msg);
    abort();
}

emu_uint3 &cur_tid() { return cur->tid; }
void *dyn_smem() { return smem_buf; }

static void yield() {
    if (_setjmp(cur->jb) == 0) _longjmp(sched, 1);
}

// ---- schedules ------------------------------------------------------------------

static unsigned g_sched;
static bool g_sched_set;

static uint64_t mix64(uint64_t x) { // splitmix64
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// a seeded Fisher-Yates shuffle of v
static void shuffle(std::vector<int> &v, uint64_t &st) {
    for (size_t i = v.size(); i > 1; i--) {
        st = mix64(st);
        std::swap(v[i - 1], v[st % i]);
    }
}

// An extra switch point (schedules s != 0): let the other threads run.
static void maybe_yield() {
    if (g_sched && cur) yield();
}

// ---- race detector over dynamic shared memory -----------------------------------
//
// Epochs: a counter that every completed __syncthreads (and every new block)
// advances, so two accesses with the same stamp are not ordered by a block
// barrier. Per 16-byte granule: the last cp.async (thread, epoch of issue,
// epoch it landed or PENDING, the writer warp's __syncwarp count then),
// the warps that read it by ldmatrix in the latest epoch, and the thread
// whose landed cp.async wrote it with no fence.proxy.async by that thread
// since (-1: none), with the block it was in.

static const uint64_t PENDING = ~0ull;
struct Granule {
    int w_tid;
    uint64_t w_done;
    uint32_t w_wsync;
    uint64_t r_epoch;
    uint32_t r_warps;
    int nf_tid;
    uint64_t nf_block;
};
static std::vector<Granule> shadow(SMEM_MAX / 16, Granule{-1, 0, 0, 0, 0, -1, 0});
static uint64_t g_epoch = 1;
static uint64_t g_block_serial; // blocks run so far
static unsigned long g_races;
static bool g_race_fatal = true;

static void race(const char *what, int other_tid) {
    g_races++;
    char msg[512];
    snprintf(msg, sizeof msg, "shared-memory race: %s (the other thread: %d)", what, other_tid);
    if (g_race_fatal) die(msg);
    if (g_races <= 5)
        fprintf(stderr, "cuda_emu: block (%u,%u,%u) thread %u: %s\n", g_block.x, g_block.y, g_block.z,
                cur ? cur->tid.x : 0u, msg);
}

static int fiber_index(const Fiber *f) { return (int)(f - fibers.data()); }

// the granule of a dynamic shared-memory address, or NULL for any other
// address (static __shared__ arrays are not tracked)
static Granule *granule(const void *p) {
    const unsigned char *c = (const unsigned char *)p;
    if (!smem_buf || c < smem_buf || c >= smem_buf + SMEM_MAX) return NULL;
    return &shadow[(size_t)(c - smem_buf) / 16];
}

static void land(Fiber *f, const Copy &c) {
    if (c.src) memcpy(c.dst, c.src, 16);
    else memset(c.dst, 0, 16);
    if (Granule *g = granule(c.dst)) {
        g->w_done = g_epoch;
        g->w_wsync = warps[f->warp].wsync;
        g->nf_tid = fiber_index(f), g->nf_block = g_block_serial;
        f->unfenced.push_back((uint32_t)(g - shadow.data()));
    }
}

// the copies of f in groups < upto land (upto INT_MAX: all, committed or not)
static void land_groups(Fiber *f, int upto) {
    size_t keep = 0;
    for (size_t i = 0; i < f->copies.size(); i++) {
        if (f->copies[i].group < upto) land(f, f->copies[i]);
        else f->copies[keep++] = f->copies[i];
    }
    f->copies.resize(keep);
}

void cp_async16(void *smem, const void *gmem, bool valid) {
    if ((uintptr_t)smem % 16 || (valid && (uintptr_t)gmem % 16)) die("cp.async of 16 bytes at an address not 16-byte aligned");
    if (Granule *g = granule(smem)) {
        const int me = fiber_index(cur), w = cur->warp;
        if (g->w_done == PENDING) race("cp.async into bytes whose earlier cp.async has not landed", g->w_tid);
        else if (g->w_done == g_epoch && g->w_tid != me)
            race("cp.async over bytes another thread's cp.async wrote in this barrier interval", g->w_tid);
        if (g->r_epoch == g_epoch && (g->r_warps & ~(1u << w)))
            race("cp.async over bytes another warp read in this barrier interval: a __syncthreads is missing "
                 "between that read and this overwrite",
                 -1);
        g->w_tid = me;
        g->w_done = PENDING;
    }
    cur->copies.push_back(Copy{(unsigned char *)smem, valid ? (const unsigned char *)gmem : NULL, cur->committed});
    maybe_yield();
}

void cp_async_commit() { cur->committed++; }

// fence.proxy.async.shared::cta: this thread's writes so far become visible
// to the async proxy, through which wgmma reads shared memory
void fence_proxy_async() {
    const int me = fiber_index(cur);
    for (uint32_t i : cur->unfenced)
        if (shadow[i].nf_tid == me && shadow[i].nf_block == g_block_serial) shadow[i].nf_tid = -1;
    cur->unfenced.clear();
    maybe_yield();
}

void cp_async_wait(int n) {
    land_groups(cur, cur->committed - n);
    maybe_yield();
}

// warp w reads the 16 bytes at p (with ldmatrix, or as one of a warpgroup's
// four warps whose wgmma reads them)
static void check_read(const void *p, int w, const char *who = "ldmatrix") {
    char msg[256];
    if ((uintptr_t)p % 16) {
        snprintf(msg, sizeof msg, "%s row address not 16-byte aligned", who);
        die(msg);
    }
    Granule *g = granule(p);
    if (!g) return;
    if (g->w_done == PENDING) {
        snprintf(msg, sizeof msg, "%s reads bytes whose cp.async has not landed (no cp.async.wait_group covers it yet)",
                 who);
        race(msg, g->w_tid);
    } else if (g->w_done == g_epoch) {
        const int ww = fibers[g->w_tid].warp;
        if (ww != w || g->w_wsync == warps[w].wsync) {
            snprintf(msg, sizeof msg, "%s reads another thread's cp.async data in the barrier interval of its wait: a "
                     "__syncthreads (or __syncwarp) is missing after the wait", who);
            race(msg, g->w_tid);
        }
    }
    if (g->r_epoch != g_epoch) g->r_epoch = g_epoch, g->r_warps = 0;
    g->r_warps |= 1u << w;
}

// ---- blocks, warps, barriers ------------------------------------------------------

static void release_block() {
    for (auto &f : fibers)
        if (f.state == WAIT_BLOCK) f.state = RUN;
    block_arrived = 0;
    g_epoch++;
}

static void compute_warp(Warp &w, int wi);

static void complete_warp_if_ready(int wi) {
    Warp &w = warps[wi];
    if (w.arrived == 0 || w.arrived + w.done < w.size) return;
    if (w.done) die("a full-mask warp collective with exited lanes");
    compute_warp(w, wi);
    for (int l = 0; l < w.size; l++) {
        Fiber &f = fibers[wi * 32 + l];
        if (f.state == WAIT_WARP) f.state = RUN;
    }
    w.arrived = 0;
    w.op = OP_NONE;
}

static void fiber_main() {
    body->run();
    land_groups(cur, INT_MAX); // a thread's copies land even if it never waited
    const size_t wg = (size_t)fiber_index(cur) / 128;
    if (wg < wgroups.size() && !wgroups[wg].flight.empty())
        die("a thread ended with a wgmma in flight (no wgmma.wait_group covers its group)");
    cur->state = DONE;
    done_count++;
    warps[cur->warp].done++;
    if (block_arrived) die("a thread exited while others wait at a __syncthreads it never reaches");
    complete_warp_if_ready(cur->warp);
    _longjmp(sched, 1); // never resumed
}

void syncthreads() {
    if (done_count) die("__syncthreads after some threads of the block exited");
    cur->state = WAIT_BLOCK;
    if (++block_arrived == nthreads) release_block();
    yield();
}

// Deposit this lane's part of collective `op` and wait for the warp.
static void collective(int op) {
    Warp &w = warps[cur->warp];
    if (w.op != OP_NONE && w.op != op) die("lanes of a warp in different collectives");
    w.op = op;
    cur->state = WAIT_WARP;
    w.arrived++;
    complete_warp_if_ready(cur->warp);
    yield();
}

void syncwarp() { collective(OP_SYNC); }

uint32_t shfl_xor(uint32_t v, int o) {
    Warp &w = warps[cur->warp];
    uint32_t r;
    w.in[cur->lane][0] = v;
    w.in[cur->lane][1] = (uint32_t)o;
    w.out[cur->lane][0] = &r;
    collective(OP_SHFL);
    return r;
}

uint32_t ballot(bool p) {
    Warp &w = warps[cur->warp];
    uint32_t r;
    w.in[cur->lane][0] = p;
    w.out[cur->lane][0] = &r;
    collective(OP_BALLOT);
    return r;
}

void ldmatrix_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p, bool trans) {
    Warp &w = warps[cur->warp];
    check_read(p, cur->warp);
    w.ptr[cur->lane] = p;
    w.out[cur->lane][0] = &r0, w.out[cur->lane][1] = &r1, w.out[cur->lane][2] = &r2, w.out[cur->lane][3] = &r3;
    collective(trans ? OP_LDSM_T : OP_LDSM);
}

void mma_m16n8k16(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
    Warp &w = warps[cur->warp];
    uint32_t *in = w.in[cur->lane];
    in[0] = a[0], in[1] = a[1], in[2] = a[2], in[3] = a[3], in[4] = b0, in[5] = b1;
    w.out[cur->lane][0] = c;
    collective(OP_MMA);
}

static float bf(uint16_t h) {
    __nv_bfloat16 b;
    b.x = h;
    return __bfloat162float(b);
}

// ---- wgmma ------------------------------------------------------------------------

uint32_t smem_addr(const void *p) {
    const unsigned char *c = (const unsigned char *)p;
    if (!smem_buf || c < smem_buf || c >= smem_buf + SMEM_MAX) die("a shared-memory address outside dynamic shared memory");
    return (uint32_t)(c - smem_buf);
}

// Element (r, k) of an operand whose 8x8 core matrices (8 rows of 16 bytes)
// a descriptor places: r along M or N, k along K. K-major (canonical
// ((8,m),(8,2k)):((8,SBO),(1,LBO)) in bf16 elements): a core matrix's rows
// are 8 values of r, each holding 8 consecutive k; MN-major
// (((8,1,m),(8,k)):((1,8,SBO),(8,LBO))): its rows are 8 values of k, each
// holding 8 consecutive r. Either way SBO steps r by 8 and LBO steps k by 8.
// the byte offset in shared memory of element (r, k) of a descriptor's
// operand (r: its M or N index)
static uint32_t desc_off(uint64_t desc, bool mn_major, int r, int k) {
    if (desc >> 62) die("wgmma: a swizzled shared-memory layout (only no-swizzle is emulated)");
    if ((desc >> 49) & 7) die("wgmma: a non-zero matrix base offset");
    const uint32_t start = (uint32_t)(desc & 0x3fff) << 4, lbo = (uint32_t)((desc >> 16) & 0x3fff) << 4,
                   sbo = (uint32_t)((desc >> 32) & 0x3fff) << 4;
    uint32_t off = start + (uint32_t)(r / 8) * sbo + (uint32_t)(k / 8) * lbo;
    off += mn_major ? (uint32_t)(k % 8) * 16 + (uint32_t)(r % 8) * 2 : (uint32_t)(r % 8) * 16 + (uint32_t)(k % 8) * 2;
    if (off + 2 > SMEM_MAX) die("wgmma: an operand past the end of shared memory");
    return off;
}

static float desc_elem(uint64_t desc, bool mn_major, int r, int k, int warp0) {
    const uint32_t off = desc_off(desc, mn_major, r, k);
    const unsigned char *p = smem_buf + off;
    for (int w = 0; w < 4; w++) check_read(p - (off % 16), warp0 + w, "wgmma"); // its 16-byte row, all four warps
    uint16_t h;
    memcpy(&h, p, 2);
    return bf(h);
}

// At a wgmma's issue: no byte of its shared-memory operand (rows x 16) may
// still be a cp.async's write that its thread has not fenced for the async
// proxy (fence.proxy.async after the wait, before the barrier, as CUTLASS
// does it). Plain stores to shared memory are not followed.
static void check_fenced(uint64_t desc, bool mn_major, int rows) {
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < 16; k++) {
            const Granule *g = granule(smem_buf + desc_off(desc, mn_major, r, k));
            if (g && g->nf_tid >= 0 && g->nf_block == g_block_serial)
                race("wgmma reads bytes that a cp.async wrote with no fence.proxy.async by its thread between "
                     "that cp.async's wait and the wgmma",
                     g->nf_tid);
        }
}

static void compute_wgroup(WgOp &g, int wg) {
    const int N = g.N;
    std::vector<float> A(64 * 16), B(16 * N), D(64 * N);
    for (int t = 0; t < 128; t++) { // the accumulator and register layouts: mma.sync's, warp w on rows 16w..
        const int w = t / 32, l = t % 32, r = 16 * w + l / 4, c = l % 4;
        if (!g.a_smem) {
            const uint32_t *a = g.a[t];
            A[r * 16 + 2 * c] = bf(a[0] & 0xffff), A[r * 16 + 2 * c + 1] = bf(a[0] >> 16);
            A[(r + 8) * 16 + 2 * c] = bf(a[1] & 0xffff), A[(r + 8) * 16 + 2 * c + 1] = bf(a[1] >> 16);
            A[r * 16 + 2 * c + 8] = bf(a[2] & 0xffff), A[r * 16 + 2 * c + 9] = bf(a[2] >> 16);
            A[(r + 8) * 16 + 2 * c + 8] = bf(a[3] & 0xffff), A[(r + 8) * 16 + 2 * c + 9] = bf(a[3] >> 16);
        }
        for (int i = 0; i < N / 8; i++)
            for (int e = 0; e < 4; e++)
                D[(r + 8 * (e / 2)) * N + 8 * i + 2 * c + e % 2] = g.scale_d ? g.d[t][4 * i + e] : 0.0f;
    }
    if (g.a_smem)
        for (int m = 0; m < 64; m++)
            for (int k = 0; k < 16; k++) A[m * 16 + k] = desc_elem(g.a_desc, g.tnsp_a, m, k, 4 * wg);
    for (int k = 0; k < 16; k++)
        for (int n = 0; n < N; n++) B[k * N + n] = desc_elem(g.b_desc, g.tnsp_b, n, k, 4 * wg);
    for (int m = 0; m < 64; m++)
        for (int n = 0; n < N; n++) {
            float s = D[m * N + n];
            for (int k = 0; k < 16; k++) s += A[m * 16 + k] * B[k * N + n];
            D[m * N + n] = s;
        }
    for (int t = 0; t < 128; t++) {
        const int w = t / 32, l = t % 32, r = 16 * w + l / 4, c = l % 4;
        for (int i = 0; i < N / 8; i++)
            for (int e = 0; e < 4; e++) g.d[t][4 * i + e] = D[(r + 8 * (e / 2)) * N + 8 * i + 2 * c + e % 2];
    }
}

// accumulators held by a wgmma in flight must still be POISON: anything
// else was written before the wait
static void require_poisoned(const float *d, int n) {
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, d + i, 4);
        if (u != POISON)
            die("wgmma: accumulator registers written while a wgmma on them is in flight (before the "
                "wgmma.wait_group that covers it)");
    }
}

// d becomes owned by a wgmma in flight: keep its values, poison it
static void hold(WGroup &g, float *d, int n) {
    auto it = g.held.find(d);
    if (it != g.held.end()) {
        if (it->second.n != n) die("wgmma: accumulators of two sizes at one address");
        require_poisoned(d, n);
        return;
    }
    Held h{n, std::vector<float>(d, d + n)};
    for (int i = 0; i < n; i++) memcpy(d + i, &POISON, 4);
    g.held.emplace(d, std::move(h));
}

// d is given back by the wgmma in flight: it must still be poisoned
static void release(WGroup &g, float *d) {
    auto it = g.held.find(d);
    if (it == g.held.end()) return; // already released for an earlier op of this wait
    require_poisoned(d, it->second.n);
    memcpy(d, it->second.saved.data(), (size_t)it->second.n * 4);
    g.held.erase(it);
}

// Gather thread t of warpgroup g into the collective `op` (all 128 threads
// must take part in the same one, with the same committed groups).
static bool gather(WGroup &g, int op, const char *what) {
    if (g.arrived == 0) g.op = op, g.commits = cur->wg_commits;
    else if (g.op != op) die("wgmma: some threads of a warpgroup issue a wgmma while others wait for one");
    else if (g.commits != cur->wg_commits) {
        char msg[160];
        snprintf(msg, sizeof msg, "wgmma: the threads of a warpgroup disagree on their committed groups (at a %s)",
                 what);
        die(msg);
    }
    cur->state = WAIT_WG;
    return ++g.arrived == 128;
}

static void release_wgroup(int wg) {
    wgroups[wg].arrived = 0;
    for (int i = 128 * wg; i < 128 * wg + 128; i++)
        if (fibers[i].state == WAIT_WG) fibers[i].state = RUN;
}

void wgmma_m64k16(float *d, int N, const uint32_t *a, uint64_t a_desc, uint64_t b_desc, bool tnsp_a, bool tnsp_b,
                  bool scale_d) {
    if (a && tnsp_a) die("wgmma: a transposed A in registers (only shared-memory A may be M-major)");
    if (N < 8 || N > 256 || N % 8) die("wgmma: N not a multiple of 8 in [8, 256]");
    const int t = fiber_index(cur), wg = t / 128;
    if ((size_t)(wg + 1) * 128 > (size_t)nthreads) die("wgmma in a partial warpgroup");
    WGroup &g = wgroups[wg];
    WgOp &o = g.next;
    const bool first = g.arrived == 0;
    if (first) {
        o.N = N, o.tnsp_a = tnsp_a, o.tnsp_b = tnsp_b, o.scale_d = scale_d, o.a_smem = a == NULL, o.a_desc = a_desc;
        o.b_desc = b_desc;
    } else if (g.op == WG_ISSUE &&
               (o.N != N || o.tnsp_a != tnsp_a || o.tnsp_b != tnsp_b || o.scale_d != scale_d ||
                o.a_smem != (a == NULL) || (a == NULL && o.a_desc != a_desc) || o.b_desc != b_desc)) {
        die("wgmma: the threads of a warpgroup disagree on its shape, flags or descriptors");
    }
    if (a) memcpy(o.a[t % 128], a, sizeof o.a[0]);
    o.d[t % 128] = d;
    if (gather(g, WG_ISSUE, "wgmma")) { // issued: it runs at the wait that covers its group
        o.group = g.commits;
        if (o.a_smem) check_fenced(o.a_desc, o.tnsp_a, 64);
        check_fenced(o.b_desc, o.tnsp_b, N);
        for (int i = 0; i < 128; i++) hold(g, o.d[i], N / 2);
        g.flight.push_back(o);
        release_wgroup(wg);
    }
    yield();
}

void wgmma_commit() { cur->wg_commits++; }

// wgmma.wait_group n: the warpgroup's wgmma in groups older than its n most
// recent committed ones run now, in issue order (their shared-memory
// operands read now, the latest the hardware may read them)
void wgmma_wait(int n) {
    const int t = fiber_index(cur), wg = t / 128;
    if (n < 0) die("wgmma.wait_group with a negative count");
    if ((size_t)(wg + 1) * 128 > (size_t)nthreads) die("wgmma.wait_group in a partial warpgroup");
    WGroup &g = wgroups[wg];
    if (g.arrived && g.op == WG_WAIT && g.wait_n != n) die("wgmma: the threads of a warpgroup wait for different counts");
    g.wait_n = n;
    if (gather(g, WG_WAIT, "wgmma.wait_group")) {
        const int upto = g.commits - n;
        size_t ndone = 0;
        while (ndone < g.flight.size() && g.flight[ndone].group < upto) ndone++;
        for (size_t k = 0; k < ndone; k++)
            for (int i = 0; i < 128; i++) release(g, g.flight[k].d[i]);
        for (size_t k = 0; k < ndone; k++) compute_wgroup(g.flight[k], wg);
        g.flight.erase(g.flight.begin(), g.flight.begin() + (ptrdiff_t)ndone);
        for (auto &o : g.flight) // a later op in flight on the same accumulators keeps them
            for (int i = 0; i < 128; i++)
                if (!g.held.count(o.d[i])) hold(g, o.d[i], o.N / 2);
        release_wgroup(wg);
    }
    yield();
}

static void compute_warp(Warp &w, int wi) {
    (void)wi;
    if ((w.op == OP_LDSM || w.op == OP_LDSM_T || w.op == OP_MMA || w.op == OP_SHFL) && w.size != 32)
        die("a fragment collective in a partial warp");
    switch (w.op) {
    case OP_SYNC:
        w.wsync++;
        break;
    case OP_SHFL:
        for (int l = 0; l < w.size; l++) *(uint32_t *)w.out[l][0] = w.in[l ^ w.in[l][1]][0];
        break;
    case OP_BALLOT: {
        uint32_t m = 0;
        for (int l = 0; l < w.size; l++) m |= (w.in[l][0] ? 1u : 0u) << l;
        for (int l = 0; l < w.size; l++) *(uint32_t *)w.out[l][0] = m;
        break;
    }
    case OP_LDSM:
    case OP_LDSM_T:
        // lanes 8m..8m+7 give the row addresses of matrix m (8 rows of 8 b16)
        for (int l = 0; l < 32; l++)
            for (int m = 0; m < 4; m++) {
                uint16_t lo, hi;
                if (w.op == OP_LDSM) { // (row l/4, cols 2(l%4), +1)
                    const uint16_t *row = (const uint16_t *)w.ptr[8 * m + l / 4];
                    lo = row[2 * (l % 4)], hi = row[2 * (l % 4) + 1];
                } else { // (rows 2(l%4), +1; col l/4)
                    lo = ((const uint16_t *)w.ptr[8 * m + 2 * (l % 4)])[l / 4];
                    hi = ((const uint16_t *)w.ptr[8 * m + 2 * (l % 4) + 1])[l / 4];
                }
                *(uint32_t *)w.out[l][m] = (uint32_t)lo | (uint32_t)hi << 16;
            }
        break;
    case OP_MMA: {
        float A[16][16], B[16][8], C[16][8];
        for (int l = 0; l < 32; l++) {
            int g = l / 4, c = l % 4;
            const uint32_t *in = w.in[l];
            const float *acc = (const float *)w.out[l][0];
            A[g][2 * c] = bf(in[0] & 0xffff), A[g][2 * c + 1] = bf(in[0] >> 16);
            A[g + 8][2 * c] = bf(in[1] & 0xffff), A[g + 8][2 * c + 1] = bf(in[1] >> 16);
            A[g][2 * c + 8] = bf(in[2] & 0xffff), A[g][2 * c + 9] = bf(in[2] >> 16);
            A[g + 8][2 * c + 8] = bf(in[3] & 0xffff), A[g + 8][2 * c + 9] = bf(in[3] >> 16);
            B[2 * c][g] = bf(in[4] & 0xffff), B[2 * c + 1][g] = bf(in[4] >> 16);
            B[2 * c + 8][g] = bf(in[5] & 0xffff), B[2 * c + 9][g] = bf(in[5] >> 16);
            C[g][2 * c] = acc[0], C[g][2 * c + 1] = acc[1], C[g + 8][2 * c] = acc[2], C[g + 8][2 * c + 1] = acc[3];
        }
        float D[16][8];
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 8; j++) {
                float s = C[i][j];
                for (int k = 0; k < 16; k++) s += A[i][k] * B[k][j];
                D[i][j] = s;
            }
        for (int l = 0; l < 32; l++) {
            int g = l / 4, c = l % 4;
            float *acc = (float *)w.out[l][0];
            acc[0] = D[g][2 * c], acc[1] = D[g][2 * c + 1], acc[2] = D[g + 8][2 * c], acc[3] = D[g + 8][2 * c + 1];
        }
        break;
    }
    default:
        die("unknown collective");
    }
}

// Run fiber f until it yields or ends (in a frame of its own: nothing
// here changes between the _setjmp and the _longjmp back).
__attribute__((noinline)) static void resume(Fiber *f) {
    cur = f;
    if (_setjmp(sched) == 0) {
        if (!f->started) f->started = true, setcontext(&f->ctx);
        else _longjmp(f->jb, 1);
    }
}

// Resume every runnable fiber of `order` once (true if any ran).
static bool sweep(const std::vector<int> &order) {
    bool ran = false;
    for (int i : order)
        if (fibers[i].state == RUN) resume(&fibers[i]), ran = true;
    return ran;
}

static void run_block() {
    block_arrived = done_count = 0;
    g_epoch++; // nothing of the previous block is in this block's epochs
    g_block_serial++;
    for (size_t i = 0; i < warps.size(); i++)
        warps[i].arrived = warps[i].done = 0, warps[i].op = OP_NONE, warps[i].wsync = 0;
    for (auto &g : wgroups) g.arrived = 0, g.flight.clear(), g.held.clear();
    for (int i = 0; i < nthreads; i++) {
        Fiber &f = fibers[i];
        f.state = RUN;
        f.started = false;
        f.copies.clear();
        f.unfenced.clear();
        f.committed = 0;
        f.wg_commits = 0;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = NULL;
        makecontext(&f.ctx, fiber_main, 0);
    }
    memset(smem_buf, 0xff, SMEM_MAX);
    // The order. Default: warps one at a time, each as far as it can go (to
    // a block barrier or its end) before the next, starting from a different
    // warp in each block: a warp that overwrites shared memory another warp
    // still reads, or reads what another has not written yet, for want of a
    // barrier, then computes a wrong result instead of getting lucky. Other
    // schedules: see cuda_emu.h.
    const int nw = (int)warps.size();
    const uint64_t bid = g_block.x + ((uint64_t)g_block.y << 21) + ((uint64_t)g_block.z << 42);
    uint64_t st = mix64(g_sched * 0x2545f4914f6cdd1dull ^ bid);
    std::vector<int> worder(nw);
    const int first = (int)((g_block.x + 3u * g_block.y + 5u * g_block.z) % (unsigned)nw);
    for (int k = 0; k < nw; k++) worder[k] = (first + k) % nw;
    if (g_sched) shuffle(worder, st);
    std::vector<std::vector<int>> lanes(nw);
    std::vector<int> all;
    for (int w : worder) {
        for (int i = 32 * w; i < 32 * w + warps[w].size; i++) lanes[w].push_back(i);
        if (g_sched) shuffle(lanes[w], st);
        all.insert(all.end(), lanes[w].begin(), lanes[w].end());
    }
    const bool round_robin = g_sched && g_sched % 2 == 0;
    if (round_robin) shuffle(all, st);
    for (;;) {
        bool ran = false;
        if (round_robin) ran = sweep(all);
        else
            for (int w : worder)
                while (sweep(lanes[w])) ran = true;
        if (done_count == nthreads) break;
        if (!ran) die("deadlock: a barrier that not every live thread reaches");
    }
    cur = NULL;
}

static std::map<const void *, size_t> g_max_dyn_smem; // cudaFuncSetAttribute, per kernel

int set_max_dyn_smem(const void *fn, int bytes) {
    if (bytes < 0 || (size_t)bytes > SMEM_OPTIN) return 0;
    g_max_dyn_smem[fn] = (size_t)bytes;
    return 1;
}

void check_align(const void *p, size_t a, const char *file, int line) {
    if ((uintptr_t)p % a == 0) return;
    char msg[512];
    snprintf(msg, sizeof msg, "%s:%d: a %zu-byte vector access at %p, not %zu-byte aligned (the GPU faults: "
             "misaligned address)", file, line, a, p, a);
    die(msg);
}

void run_grid(dim3 grid, dim3 block, size_t smem, Body *b, const void *fn) {
    if (!g_sched_set) {
        const char *e = getenv("DFLASH_EMU_SCHED");
        g_sched = e ? (unsigned)strtoul(e, NULL, 10) : 0;
        g_sched_set = true;
    }
    // the launch checks of the runtime (cudaErrorInvalidConfiguration, or
    // "too many resources requested" for shared memory)
    if (smem > SMEM_OPTIN) launch_die("dynamic shared memory over 227 KiB (the opt-in limit per block)");
    if (smem > SMEM_DEFAULT) {
        auto it = g_max_dyn_smem.find(fn);
        if (it == g_max_dyn_smem.end() || it->second < smem)
            launch_die("dynamic shared memory over 48 KiB without cudaFuncSetAttribute(kernel, "
                "cudaFuncAttributeMaxDynamicSharedMemorySize, >= that) first");
    }
    if (!smem_buf) smem_buf = (unsigned char *)aligned_alloc(128, SMEM_MAX);
    int64_t n = (int64_t)block.x * block.y * block.z;
    if (n <= 0 || n > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > (unsigned)INT_MAX ||
        grid.y > 65535 || grid.z > 65535)
        launch_die("invalid launch configuration (block over 1024 threads, or a grid dimension 0, or over 2^31-1 in x "
            "or 65535 in y, z)");
    if ((int)fibers.size() < n) {
        size_t old = fibers.size();
        fibers.resize(n);
        for (size_t i = old; i < (size_t)n; i++) fibers[i].stack = (char *)malloc(STACK);
    }
    nthreads = (int)n;
    warps.assign((n + 31) / 32, Warp());
    wgroups.resize((size_t)(n / 128));
    for (int i = 0; i < n; i++) {
        Fiber &f = fibers[i];
        f.tid.x = (unsigned)i % block.x;
        f.tid.y = (unsigned)i / block.x % block.y;
        f.tid.z = (unsigned)i / (block.x * block.y);
        f.warp = i / 32, f.lane = i % 32;
    }
    for (int i = 0; i < (int)warps.size(); i++) warps[i].size = n - 32 * i < 32 ? (int)n - 32 * i : 32;
    g_blockdim = block, g_griddim = grid;
    body = b;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                g_block.x = x, g_block.y = y, g_block.z = z;
                run_block();
            }
}

} // namespace emu

// ---- runtime ----------------------------------------------------------------

extern "C" void dfl_emu_set_schedule(unsigned seed) {
    emu::g_sched = seed;
    emu::g_sched_set = true;
}
extern "C" void dfl_emu_race_fatal(int on) { emu::g_race_fatal = on != 0; }
extern "C" unsigned long dfl_emu_races(void) { return emu::g_races; }

const char *cudaGetErrorString(cudaError_t e) {
    return e == cudaSuccess ? "no error" : e == cudaErrorInvalidValue ? "invalid argument" : "emulated error";
}
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int) {
    *v = a == cudaDevAttrMemoryPoolsSupported && !getenv("DFLASH_EMU_NO_POOLS");
    return cudaSuccess;
}
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaGetDeviceCount(int *n) {
    *n = 1;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev) {
    (void)dev;
    memset(p, 0, sizeof *p);
    strcpy(p->name, "dflash CPU emulation of an H200");
    p->major = 9, p->minor = 0, p->multiProcessorCount = 132;
    p->sharedMemPerBlockOptin = 227 << 10;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) {
    *s = NULL;
    return cudaSuccess;
}
static unsigned long g_stream_syncs;
cudaError_t cudaStreamSynchronize(cudaStream_t) {
    g_stream_syncs++;
    return cudaSuccess;
}
extern "C" unsigned long dfl_emu_stream_syncs(void) { return g_stream_syncs; }

// An event only needs to exist: the stream is idle whenever the host runs.
struct emu_event {
    int recorded;
};
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) {
    *e = new emu_event{0};
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
    if (!e) return cudaErrorInvalidValue;
    e->recorded = 1;
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) { return e ? cudaSuccess : cudaErrorInvalidValue; }
// The live device allocations, start -> bytes: what the grouped GEMM checks
// its pointers against (the GPU faults on a host pointer where it reads
// device memory, and on an address past an allocation).
static std::map<const char *, size_t> g_dev_allocs;

// Is [p, p + n) inside one live device allocation?
static bool in_device_memory(const void *p, size_t n) {
    auto it = g_dev_allocs.upper_bound((const char *)p);
    if (it == g_dev_allocs.begin()) return false;
    --it;
    return (const char *)p + n <= it->first + it->second;
}

// dfl_emu_alloc_limit: allocations over this many bytes fail, as on a
// device without the memory (0: no limit); g_alloc_refused counts them.
static size_t g_alloc_limit;
static unsigned long g_alloc_refused;

// The emulated device's memory: an H100's 80 GiB, or DFLASH_EMU_DEVICE_BYTES
// (for a tool's test of running out of it): cudaMalloc fails where the
// allocations live would pass it, and cudaMemGetInfo reports what is left.
static size_t device_bytes() {
    static const char *env = getenv("DFLASH_EMU_DEVICE_BYTES");
    return env ? (size_t)strtoull(env, NULL, 10) : (size_t)80 << 30;
}

static size_t g_dev_used; // the sizes in g_dev_allocs, summed

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b) {
    size_t used = g_dev_used, total = device_bytes();
    *free_b = used < total ? total - used : 0, *total_b = total;
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t n) {
    if ((g_alloc_limit && n > g_alloc_limit) || g_dev_used + n > device_bytes()) {
        g_alloc_refused++;
        *p = NULL;
        return cudaErrorMemoryAllocation;
    }
    *p = aligned_alloc(256, (n + 255) / 256 * 256);
    if (*p) g_dev_allocs[(const char *)*p] = n, g_dev_used += n;
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void *p) {
    auto it = g_dev_allocs.find((const char *)p);
    if (it != g_dev_allocs.end()) g_dev_used -= it->second, g_dev_allocs.erase(it);
    free(p);
    return cudaSuccess;
}
// Page-locked host memory: plain memory here, refused over the same limit
// as device memory (so a test can see a caller fall back)
cudaError_t cudaMallocHost(void **p, size_t n) {
    if (g_alloc_limit && n > g_alloc_limit) {
        g_alloc_refused++;
        *p = NULL;
        return cudaErrorMemoryAllocation;
    }
    *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096); // whole pages, as the driver's
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void *p) {
    free(p);
    return cudaSuccess;
}
cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t) {
    cudaError_t e = cudaMalloc(p, n);
    if (e == cudaSuccess) memset(*p, 0xff, n); // uninitialised, as on a GPU
    return e;
}
cudaError_t cudaFreeAsync(void *p, cudaStream_t) { return cudaFree(p); }
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t) {
    memset(p, v, n);
    return cudaSuccess;
}
cudaError_t cudaMemset2DAsync(void *p, size_t pitch, int v, size_t w, size_t h, cudaStream_t) {
    for (size_t r = 0; r < h; r++) memset((char *)p + r * pitch, v, w);
    return cudaSuccess;
}
cudaError_t cudaMemcpy2DAsync(void *d, size_t dpitch, const void *s, size_t spitch, size_t w, size_t h,
                              cudaMemcpyKind, cudaStream_t) {
    if (w > dpitch || w > spitch) return cudaErrorInvalidValue; // as the runtime refuses them
    for (size_t r = 0; r < h; r++) memcpy((char *)d + r * dpitch, (const char *)s + r * spitch, w);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind, cudaStream_t) {
    // overlapping copies are undefined on the GPU (memcpy, not memmove)
    if (n && (const char *)d < (const char *)s + n && (const char *)s < (const char *)d + n) {
        fprintf(stderr, "cuda_emu: cudaMemcpyAsync of %zu bytes between overlapping ranges\n", n);
        abort();
    }
    memcpy(d, s, n);
    return cudaSuccess;
}

// ---- cuBLAS -----------------------------------------------------------------

cublasStatus_t cublasCreate(cublasHandle_t *h) {
    *h = NULL;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetWorkspace(cublasHandle_t, void *, size_t) { return CUBLAS_STATUS_SUCCESS; }
const char *cublasGetStatusString(cublasStatus_t s) {
    return s == CUBLAS_STATUS_SUCCESS         ? "success"
           : s == CUBLAS_STATUS_NOT_SUPPORTED ? "CUBLAS_STATUS_NOT_SUPPORTED"
                                              : "CUBLAS_STATUS_INVALID_VALUE";
}

static bool g_grouped_not_supported;
static unsigned long g_gemm_calls, g_grouped_calls;
extern "C" void dfl_emu_grouped_not_supported(int on) { g_grouped_not_supported = on != 0; }
extern "C" void dfl_emu_alloc_limit(size_t bytes) { g_alloc_limit = bytes; }
extern "C" unsigned long dfl_emu_alloc_refused(void) { return g_alloc_refused; }
extern "C" void dfl_emu_blas_calls(unsigned long *gemm, unsigned long *grouped) {
    *gemm = g_gemm_calls;
    *grouped = g_grouped_calls;
}

static float load_el(const void *p, cudaDataType t, size_t i) {
    if (t == CUDA_R_32F) return ((const float *)p)[i];
    return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}

static size_t el_size(cudaDataType t) { return t == CUDA_R_32F ? 4 : 2; }

// C = alpha op(A) op(B) + beta C, column-major: element (i,j) of an
// m-row matrix with leading dimension ld is at i + j*ld. The callers have
// checked the arguments.
static void gemm_col_major(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float al, const void *A,
                           cudaDataType at, int lda, const void *B, cudaDataType bt, int ldb, float be, void *C,
                           cudaDataType ct, int ldc) {
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float s = 0.0f;
            for (int p = 0; p < k; p++) {
                float a = load_el(A, at, ta == CUBLAS_OP_N ? (size_t)i + (size_t)p * lda : (size_t)p + (size_t)i * lda);
                float b = load_el(B, bt, tb == CUBLAS_OP_N ? (size_t)p + (size_t)j * ldb : (size_t)j + (size_t)p * ldb);
                s += a * b;
            }
            size_t ci = (size_t)i + (size_t)j * ldc;
            float old = be != 0.0f ? load_el(C, ct, ci) : 0.0f;
            float r = al * s + be * old;
            if (ct == CUDA_R_32F) ((float *)C)[ci] = r;
            else ((__nv_bfloat16 *)C)[ci] = __float2bfloat16_rn(r);
        }
}

cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType at, int lda, const void *B,
                            cudaDataType bt, int ldb, const void *beta, void *C, cudaDataType ct, int ldc,
                            cublasComputeType_t, cublasGemmAlgo_t) {
    if (at != CUDA_R_16BF || bt != CUDA_R_16BF) return CUBLAS_STATUS_INVALID_VALUE;
    if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
    if (lda < (ta == CUBLAS_OP_N ? m : k) || ldb < (tb == CUBLAS_OP_N ? k : n) || ldc < m)
        return CUBLAS_STATUS_INVALID_VALUE;
    g_gemm_calls++;
    gemm_col_major(ta, tb, m, n, k, *(const float *)alpha, A, at, lda, B, bt, ldb, *(const float *)beta, C, ct, ldc);
    return CUBLAS_STATUS_SUCCESS;
}

// What the GPU would fault on, checked before anything is computed: a
// pointer array or a matrix outside device memory, a bf16 matrix not
// aligned as the cuBLAS documentation of cublasGemmGroupedBatchedEx asks
// (16 bytes where k elements make a multiple of 16 bytes, else 4 where they
// make a multiple of 4; the documentation states it by k for every
// pointer, C's included).
[[noreturn]] static void grouped_die(const char *what, int problem) {
    fprintf(stderr, "cuda_emu: cublasGemmGroupedBatchedEx, problem %d: %s\n", problem, what);
    abort();
}

static void grouped_check_matrix(const void *p, cudaDataType t, int rows, int cols, int ld, int k, int problem) {
    const size_t es = el_size(t);
    if (rows > 0 && cols > 0 && !in_device_memory(p, ((size_t)(cols - 1) * ld + rows) * es))
        grouped_die("a matrix not inside one device allocation (the GPU faults: illegal address)", problem);
    if (t == CUDA_R_16BF) {
        const size_t row_bytes = (size_t)k * es, a = row_bytes % 16 == 0 ? 16 : row_bytes % 4 == 0 ? 4 : 1;
        if ((uintptr_t)p % a)
            grouped_die("a bf16 matrix pointer not aligned as documented (the GPU faults: misaligned address)",
                        problem);
    }
}

cublasStatus_t cublasGemmGroupedBatchedEx(cublasHandle_t, const cublasOperation_t transa_array[],
                                          const cublasOperation_t transb_array[], const int m_array[],
                                          const int n_array[], const int k_array[], const void *alpha_array,
                                          const void *const Aarray[], cudaDataType at, const int lda_array[],
                                          const void *const Barray[], cudaDataType bt, const int ldb_array[],
                                          const void *beta_array, void *const Carray[], cudaDataType ct,
                                          const int ldc_array[], int group_count, const int group_size[],
                                          cublasComputeType_t) {
    // CUBLAS_COMPUTE_32F's documented combinations: bf16, f16 or f32
    // throughout, scale type f32 (f16 is not emulated)
    if (at != bt || at != ct) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (g_grouped_not_supported) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (!transa_array || !transb_array || !m_array || !n_array || !k_array || !alpha_array || !lda_array ||
        !ldb_array || !beta_array || !ldc_array || !group_size || group_count < 0)
        return CUBLAS_STATUS_INVALID_VALUE;
    int64_t problems = 0;
    for (int g = 0; g < group_count; g++) {
        const int m = m_array[g], n = n_array[g], k = k_array[g];
        if (m < 0 || n < 0 || k < 0 || group_size[g] < 0) return CUBLAS_STATUS_INVALID_VALUE;
        const int lda_min = transa_array[g] == CUBLAS_OP_N ? m : k, ldb_min = transb_array[g] == CUBLAS_OP_N ? k : n;
        if (lda_array[g] < (lda_min > 1 ? lda_min : 1) || ldb_array[g] < (ldb_min > 1 ? ldb_min : 1) ||
            ldc_array[g] < (m > 1 ? m : 1))
            return CUBLAS_STATUS_INVALID_VALUE;
        problems += group_size[g];
    }
    const size_t ptrs = (size_t)problems * sizeof(void *);
    if (problems &&
        (!in_device_memory(Aarray, ptrs) || !in_device_memory(Barray, ptrs) || !in_device_memory(Carray, ptrs)))
        grouped_die("a pointer array not in device memory (the GPU faults: illegal address)", 0);
    for (int g = 0, idx = 0; g < group_count; g++)
        for (int i = 0; i < group_size[g]; i++, idx++) {
            const bool na = transa_array[g] == CUBLAS_OP_N, nb = transb_array[g] == CUBLAS_OP_N;
            const int m = m_array[g], n = n_array[g], k = k_array[g];
            grouped_check_matrix(Aarray[idx], at, na ? m : k, na ? k : m, lda_array[g], k, idx);
            grouped_check_matrix(Barray[idx], bt, nb ? k : n, nb ? n : k, ldb_array[g], k, idx);
            grouped_check_matrix(Carray[idx], ct, m, n, ldc_array[g], k, idx);
        }
    const float *alpha = (const float *)alpha_array, *beta = (const float *)beta_array;
    for (int g = 0, idx = 0; g < group_count; g++)
        for (int i = 0; i < group_size[g]; i++, idx++)
            gemm_col_major(transa_array[g], transb_array[g], m_array[g], n_array[g], k_array[g], alpha[g],
                           Aarray[idx], at, lda_array[g], Barray[idx], bt, ldb_array[g], beta[g], Carray[idx], ct,
                           ldc_array[g]);
    g_grouped_calls++;
    return CUBLAS_STATUS_SUCCESS;
}
