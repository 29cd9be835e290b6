/* bench_attn.c: a target's attention layer over a packed prefill, timed
 * the way the model code runs it and the way it ran before: attn_causal
 * with the layer's sliding window and the lse (gpt-oss's sinks need it),
 * against attn_dflash on blocks of one row (each row's window as the
 * block's context), which lib/target.c used for gpt-oss and for sliding
 * layers until attn_causal took a window. Both must give the same output:
 * their nmse is printed, and a difference beyond rounding fails the run.
 *
 * Defaults: gpt-oss-20b's heads (64 query and 8 KV heads of 64), 16
 * sequences of 2048 tokens, no window (its full layers); --window 128 for
 * its sliding ones. Model FLOPs: 4 D Hq per (row, key it sees).
 *
 *   bench_attn [--device cuda] [--seqs 16] [--seq 2048] [--heads 64] [--kv-heads 8] [--head-dim 64]
 *              [--window W] [--no-lse] [--iters 5] [--tiny] */
#include "bench_util.h"
#include "cli.h"
#include "outfile.h"

typedef struct {
    int64_t nseq, seq, T, Hq, Hkv, D, W;
    void *q, *k, *v, *out;
    float *lse;
    int32_t *cu;
    dfl_block *blk;
} attn_layer;

static void run_causal(void *p) {
    attn_layer *a = p;
    OPS->attn_causal(a->out, a->lse, a->q, a->k, a->v, a->cu, a->nseq, a->T, a->Hq, a->Hkv, a->D, a->W);
}

static void run_rows(void *p) {
    attn_layer *a = p;
    OPS->attn_dflash(a->out, a->lse, a->q, a->k, a->v, a->blk, a->T, 1, a->T, a->Hq, a->Hkv, a->D, 0);
}

/* Row r of a sequence starting at key c0 sees keys max(c0, c0 + r - W + 1)
 * .. c0 + r (W = 0: from c0): as blocks of one query, the upload of
 * lib/target.c's former row blocks; returns the keys all rows see. */
static double row_blocks(attn_layer *a) {
    dfl_block *h = dfl_malloc((size_t)a->T * sizeof *h);
    double keys = 0;
    for (int64_t s = 0; s < a->nseq; s++)
        for (int64_t r = 0; r < a->seq; r++) {
            const int64_t c0 = s * a->seq, lo = a->W && r - a->W + 1 > 0 ? r - a->W + 1 : 0;
            h[c0 + r] = (dfl_block){.ctx_off = (int32_t)(c0 + lo), .ctx_len = (int32_t)(r - lo),
                                    .blk_off = (int32_t)(c0 + r)};
            keys += (double)(r - lo + 1);
        }
    a->blk = OPS->alloc((size_t)a->T * sizeof *h);
    OPS->upload(a->blk, h, (size_t)a->T * sizeof *h);
    free(h);
    return keys;
}

static double nmse(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), den += (double)b[i] * b[i];
    return den > 0 ? num / den : num;
}

static float *to_host(const void *act, int64_t n) {
    float *h = dfl_malloc((size_t)n * sizeof *h);
    OPS->act_to_f32(h, act, n);
    return h;
}

int main(int argc, char **argv) {
    const char *device = "cuda";
    int64_t nseq = 16, seq = 2048, Hq = 64, Hkv = 8, D = 64, W = 0, iters = 5;
    int tiny = 0, no_lse = 0;
    const dfl_opt opts[] = {
        {"device", 0, DFL_OPT_STR, &device, "DEV", "cpu, cuda or cuda:N", NULL},
        {"seqs", 0, DFL_OPT_INT, &nseq, "N", "sequences packed into the prefill", "16"},
        {"seq", 0, DFL_OPT_INT, &seq, "T", "tokens per sequence", "2048"},
        {"heads", 0, DFL_OPT_INT, &Hq, "N", "query heads", "64"},
        {"kv-heads", 0, DFL_OPT_INT, &Hkv, "N", "KV heads (a divisor of --heads)", "8"},
        {"head-dim", 0, DFL_OPT_INT, &D, "D", "head dimension", "64"},
        {"window", 0, DFL_OPT_INT, &W, "W", "sliding window (a row sees itself and the W - 1 keys before it); 0: none",
         "0"},
        {"no-lse", 0, DFL_OPT_FLAG, &no_lse, NULL, "do not write the lse (a target without sinks)", NULL},
        {"iters", 0, DFL_OPT_INT, &iters, "N", "timed calls of each way (after one warm-up call)", "5"},
        {"tiny", 0, DFL_OPT_FLAG, &tiny, NULL, "tiny shapes: a smoke test of this program", NULL},
        {0},
    };
    const dfl_cli cli = {"bench_attn", "time a target's windowed causal attention against one-row blocks",
                         "[OPTIONS]", opts};
    char **pos;
    if (dfl_cli_parse(&cli, argc, argv, &pos) != 0) dfl_cli_usage_error(&cli, "no arguments expected");
    if (tiny) nseq = 3, seq = 70, Hq = 4, Hkv = 2, D = 64;
    if (iters < 1 || nseq < 1 || seq < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv || D < 2 || W < 0)
        dfl_cli_usage_error(&cli, "sizes must be positive, --heads a multiple of --kv-heads, --window at least 0");
    if (dfl_ops_get(device, &OPS) != 0) dfl_die_last("bench_attn");
    pool_init(45);

    attn_layer a = {.nseq = nseq, .seq = seq, .T = nseq * seq, .Hq = Hq, .Hkv = Hkv, .D = D, .W = W};
    a.cu = cu_even(nseq, seq);
    const int64_t nq = a.T * Hq * D;
    a.q = act_rand(nq, POOL_ACT), a.out = act_new(nq);
    a.k = act_rand(a.T * Hkv * D, POOL_ACT), a.v = act_rand(a.T * Hkv * D, POOL_ACT);
    a.lse = no_lse ? NULL : f32_new(a.T * Hq);
    const double flops = 4.0 * (double)D * (double)Hq * row_blocks(&a);

    double tc = time_calls(run_causal, &a, iters);
    float *oc = to_host(a.out, nq);
    double tr = time_calls(run_rows, &a, iters);
    float *orow = to_host(a.out, nq);
    const double e = nmse(oc, orow, nq);
    printf("attention: %lld x %lld tokens, %lld/%lld heads of %lld, window %lld%s\n", (long long)nseq, (long long)seq,
           (long long)Hq, (long long)Hkv, (long long)D, (long long)W, no_lse ? "" : ", with the lse");
    print_kv("attn_causal ms", "%.3f", tc * 1e3);
    print_kv("attn_causal TFLOP/s", "%.1f", flops / tc / 1e12);
    print_kv("one-row blocks ms", "%.3f", tr * 1e3);
    print_kv("one-row blocks TFLOP/s", "%.1f", flops / tr / 1e12);
    print_kv("speed-up", "%.2f", tr / tc);
    print_kv("outputs nmse", "%.2e", e);
    free(oc), free(orow);
    void *bufs[] = {a.q, a.k, a.v, a.out, a.lse, a.cu, a.blk};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) OPS->free(bufs[i]);
    /* the two kernels round P differently (bf16 in both, other tiles): far
     * below this; a mask apart would be far above */
    if (!(e < 1e-4)) dfl_die("bench_attn", 1, "the two ways disagree: nmse %.3g", e);
    return dfl_close_stdout();
}
