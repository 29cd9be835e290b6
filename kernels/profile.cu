// profile.cu: DFLASH_CUDA_PROFILE=1, where the GPU time of a run goes: the
// device time of every op of the table, of every cuBLAS product (by shape)
// and of the stages ops mark (cuda_prof_scope), summed per key and printed
// to stderr when the process exits.
// defines: cuda_prof_init, cuda_prof_begin, cuda_prof_end, cuda_prof_wrap
//
// Each timed call is a pair of CUDA events around the work it queues on the
// stream, so the launches stay asynchronous; the pairs are read back in
// batches (one wait on the last event of a batch). Nested keys (an op and
// the products it issues) are both counted: the report lists ops and
// products apart. The timing events cost a few microseconds of host time a
// call, which matters only to launch-bound loops (decoding), never to the
// large products a profile is for.
#include "common.cuh"

#include <string.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#ifndef DFLASH_EMU

namespace {

struct timed_call {
    cudaEvent_t start, stop;
    int key;
};

// The first call of a key is kept apart: it pays for loading its kernels
// (CUDA loads modules lazily) and for cuBLAS's heuristics, once a process.
struct key_total {
    std::string name;
    double ms = 0, first_ms = -1;
    long calls = 0;
};

struct profile {
    int on = 0;
    int open = 0; // calls begun and not yet ended (an op around its products)
    std::vector<timed_call> pending;
    std::vector<cudaEvent_t> spare;
    std::vector<key_total> keys;
    std::unordered_map<std::string, int> index;
};

profile g_prof;
const size_t kBatch = 2048;

cudaEvent_t event_get() {
    if (!g_prof.spare.empty()) {
        cudaEvent_t e = g_prof.spare.back();
        g_prof.spare.pop_back();
        return e;
    }
    cudaEvent_t e;
    cudaCheck(cudaEventCreate(&e));
    return e;
}

// Read back every pending pair (the last one's wait covers the others: one
// stream, recorded in order).
void harvest() {
    if (g_prof.pending.empty()) return;
    cudaCheck(cudaEventSynchronize(g_prof.pending.back().stop));
    for (const timed_call &c : g_prof.pending) {
        float ms = 0;
        cudaCheck(cudaEventElapsedTime(&ms, c.start, c.stop));
        key_total &k = g_prof.keys[c.key];
        if (k.first_ms < 0) k.first_ms = ms;
        else k.ms += ms, k.calls++;
        g_prof.spare.push_back(c.start);
        g_prof.spare.push_back(c.stop);
    }
    g_prof.pending.clear();
}

void print_group(const char *title, char tag) {
    std::vector<const key_total *> rows;
    double sum = 0;
    for (const key_total &k : g_prof.keys)
        if (k.name[0] == tag) rows.push_back(&k), sum += k.ms;
    if (rows.empty()) return;
    std::sort(rows.begin(), rows.end(), [](const key_total *a, const key_total *b) { return a->ms > b->ms; });
    fprintf(stderr, "dflash profile: %s, %.3f ms in all (first calls apart)\n", title, sum);
    fprintf(stderr, "%12s %6s %8s %11s %11s  %s\n", "ms", "%", "calls", "us/call", "first us", "key");
    for (const key_total *k : rows)
        fprintf(stderr, "%12.3f %6.2f %8ld %11.1f %11.1f  %s\n", k->ms, sum > 0 ? 100.0 * k->ms / sum : 0.0,
                k->calls, k->calls ? 1000.0 * k->ms / (double)k->calls : 0.0, 1000.0 * k->first_ms,
                k->name.c_str() + 2);
}

void print_report() {
    harvest();
    print_group("ops of the table (device time between the op's first and last launch)", 'o');
    print_group("cuBLAS products (row-major M x N x K, layout, output type, beta)", 'g');
    print_group("stages inside ops (the kernels of one step of an op)", 'k');
}

} // namespace

void cuda_prof_init(void) {
    g_prof.on = 1;
    atexit(print_report);
}

int cuda_prof_begin(void) {
    if (!g_prof.on) return -1;
    timed_call c;
    c.start = event_get();
    c.stop = event_get();
    c.key = -1;
    cudaCheck(cudaEventRecord(c.start, g_cuda.stream));
    g_prof.pending.push_back(c);
    g_prof.open++;
    return (int)g_prof.pending.size() - 1;
}

void cuda_prof_end(int slot, const char *key) {
    if (slot < 0) return;
    timed_call &c = g_prof.pending[(size_t)slot];
    auto it = g_prof.index.find(key);
    if (it == g_prof.index.end()) {
        it = g_prof.index.emplace(key, (int)g_prof.keys.size()).first;
        g_prof.keys.push_back(key_total{key});
    }
    c.key = it->second;
    cudaCheck(cudaEventRecord(c.stop, g_cuda.stream));
    // a batch is read back only when nothing is open (an op's products
    // end before the op does), so no open call's slot moves
    if (--g_prof.open == 0 && g_prof.pending.size() >= kBatch) harvest();
}

#else // the emulation has no events: profiling is a no-op there

void cuda_prof_init(void) {}
int cuda_prof_begin(void) { return -1; }
void cuda_prof_end(int, const char *) {}

#endif

// ---------------------------------------------------------------------------
// the op table's entries wrapped, one instantiation per member of dfl_ops

namespace {

template <auto M> struct prof_wrap;
template <typename R, typename... A, R (*dfl_ops::*M)(A...)> struct prof_wrap<M> {
    static inline R (*raw)(A...);
    static inline const char *name;
    static R call(A... a) {
        const int s = cuda_prof_begin();
        if constexpr (std::is_void_v<R>) {
            raw(a...);
            cuda_prof_end(s, name);
        } else {
            R r = raw(a...);
            cuda_prof_end(s, name);
            return r;
        }
    }
};

template <auto M> void wrap_entry(dfl_ops *t, const char *key) {
    if (!(t->*M)) return;
    prof_wrap<M>::raw = t->*M;
    prof_wrap<M>::name = key;
    t->*M = prof_wrap<M>::call;
}

} // namespace

#define PROF_WRAP(f) wrap_entry<&dfl_ops::f>(t, "o " #f)

void cuda_prof_wrap(dfl_ops *t) {
    // memory and conversions stay unwrapped but for the device-side ones
    PROF_WRAP(zero);
    PROF_WRAP(copy);
    PROF_WRAP(copy_2d);
    PROF_WRAP(master_to_wt);
    PROF_WRAP(matmul);
    PROF_WRAP(matmul_bwd);
    PROF_WRAP(matmul_grouped);
    PROF_WRAP(rmsnorm);
    PROF_WRAP(rmsnorm_bwd);
    PROF_WRAP(rmsnorm1p);
    PROF_WRAP(rope);
    PROF_WRAP(qk_norm_rope);
    PROF_WRAP(qk_norm_rope_bwd);
    PROF_WRAP(swiglu);
    PROF_WRAP(swiglu_bwd);
    PROF_WRAP(swiglu_oss);
    PROF_WRAP(add);
    PROF_WRAP(add_bias);
    PROF_WRAP(embed);
    PROF_WRAP(sigmoid_mul);
    PROF_WRAP(conv1d_silu);
    PROF_WRAP(gated_delta);
    PROF_WRAP(moe_route);
    PROF_WRAP(gather_rows);
    PROF_WRAP(moe_combine);
    PROF_WRAP(attn_causal);
    PROF_WRAP(attn_dflash);
    PROF_WRAP(attn_dflash_bwd);
    PROF_WRAP(attn_sinks);
    PROF_WRAP(lmhead_ce);
    PROF_WRAP(lmhead_kl);
    PROF_WRAP(lmhead_argmax);
    PROF_WRAP(lmhead_sample);
    PROF_WRAP(sumsq);
    PROF_WRAP(adamw);
}
