/* bench_gdn.c: the Gated DeltaNet ops of one Qwen3.5-27B linear-attention
 * layer (Hk 16, Hv 48, dk = dv = 128, conv kernel 4 over the 10240 qkv
 * channels): a packed prefill (16 sequences x 2048 tokens by default:
 * conv1d_silu, then gated_delta from zero states) and a verify step of a
 * speculative block (one sequence of 16 rows: conv1d_silu with its history,
 * gated_delta from a state, as lib/target_kv.c runs it; a crop into the
 * block runs gated_delta again over the rows kept).
 *
 * Also the causal attention of the model's full-attention layers over the
 * same prefill (24 query and 4 KV heads of 256): its FLOP rate, and alone
 * with --attn-only (run.sh runs that again with DFLASH_CUDA_SIMPLE=1: the
 * tensor-core kernel against the simple one it replaced at head dim 256).
 *
 * Floors printed beside the times (kernels/gdn.cu explains the design and
 * the prediction, ~7-10 ms per prefill layer and ~15-25 us per verify):
 * the recurrence's 4 dk dv f32 operations per (row, value head) at the
 * CUDA cores' 33.5 T FMA/s, and each op's bytes (inputs read once, outputs
 * written once) at 4.3 TB/s.
 *
 *   bench_gdn [--device cuda] [--seqs 16] [--seq 2048] [--block 16] [--iters 5] [--tiny] [--attn-only] */
#include "bench_util.h"
#include "cli.h"
#include "outfile.h"

typedef struct {
    int64_t nseq, T, Hk, Hv, dk, dv, C, K;
    void *x, *qkv, *ba, *w, *hist, *out;
    float *A_log, *dt_bias, *state, *steps;
    int32_t *cu;
} gdn_layer;

static void run_conv(void *p) {
    gdn_layer *g = p;
    OPS->conv1d_silu(g->qkv, g->x, g->hist, g->w, g->cu, g->nseq, g->T, g->C, g->K);
}
static void run_delta(void *p) {
    gdn_layer *g = p;
    OPS->gated_delta(g->out, g->state, g->steps, g->qkv, g->ba, g->A_log, g->dt_bias, g->cu, g->nseq, g->T, g->Hk,
                     g->Hv, g->dk, g->dv);
}

/* buffers for nseq sequences of `len` rows; verify: one sequence with a
 * history and a start state */
static gdn_layer layer_new(int64_t nseq, int64_t len, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int verify) {
    gdn_layer g = {.nseq = nseq, .T = nseq * len, .Hk = Hk, .Hv = Hv, .dk = dk, .dv = dv, .C = 2 * Hk * dk + Hv * dv, .K = 4};
    g.cu = cu_even(nseq, len);
    g.x = act_rand(g.T * g.C, POOL_ACT);
    g.qkv = act_new(g.T * g.C);
    g.ba = act_rand(g.T * 2 * Hv, POOL_ACT);
    g.w = act_rand(g.C * g.K, POOL_ACT);
    g.out = act_new(g.T * Hv * dv);
    g.hist = verify ? act_rand((g.K - 1) * g.C, POOL_ACT) : NULL;
    /* A_log = log U(1,16), dt_bias ~ 1 (the initialisation of transformers) */
    dfl_rng r;
    dfl_rng_seed(&r, 7);
    float *h = dfl_malloc((size_t)Hv * 4);
    for (int64_t j = 0; j < Hv; j++) h[j] = logf((float)(1.0 + 15.0 * dfl_rng_uniform(&r)));
    g.A_log = f32_new(Hv);
    OPS->upload(g.A_log, h, (size_t)Hv * 4);
    for (int64_t j = 0; j < Hv; j++) h[j] = 1.0f;
    g.dt_bias = f32_new(Hv);
    OPS->upload(g.dt_bias, h, (size_t)Hv * 4);
    free(h);
    g.state = verify ? f32_new(Hv * dk * dv) : NULL;
    if (verify) pool_fill(g.state, Hv * dk * dv, POOL_MASTER);
    g.steps = NULL;
    return g;
}

static void layer_free(gdn_layer *g) {
    void *p[] = {g->x, g->qkv, g->ba, g->w, g->hist, g->out, g->A_log, g->dt_bias, g->state, g->steps, g->cu};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        if (p[i]) OPS->free(p[i]);
}

/* causal attention over nseq packed sequences of len rows */
typedef struct {
    int64_t nseq, T, Hq, Hkv, D;
    void *q, *k, *v, *out;
    int32_t *cu;
} attn_layer;

static void run_attn(void *p) {
    attn_layer *a = p;
    OPS->attn_causal(a->out, NULL, a->q, a->k, a->v, a->cu, a->nseq, a->T, a->Hq, a->Hkv, a->D, 0);
}

/* model FLOPs of causal attention: 4 D Hq per (row, key it sees) */
static double attn_flops(const attn_layer *a) {
    double len = (double)(a->T / a->nseq);
    return 4.0 * (double)a->D * (double)a->Hq * (double)a->nseq * len * (len + 1) / 2;
}

/* non-finite values among the first n act values of p (a check that the
 * timed calls computed something) */
static int64_t nonfinite(const void *p, int64_t n) {
    float *h = dfl_malloc((size_t)n * sizeof(float));
    OPS->act_to_f32(h, p, n);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += !isfinite(h[i]);
    free(h);
    return bad;
}

int main(int argc, char **argv) {
    const char *device = "cuda";
    int64_t nseq = 16, seq = 2048, block = 16, iters = 5;
    int tiny = 0, attn_only = 0;
    const dfl_opt opts[] = {
        {"device", 0, DFL_OPT_STR, &device, "DEV", "cpu, cuda or cuda:N", NULL},
        {"seqs", 0, DFL_OPT_INT, &nseq, "N", "sequences packed into the prefill", NULL},
        {"seq", 0, DFL_OPT_INT, &seq, "T", "tokens per prefill sequence", NULL},
        {"block", 0, DFL_OPT_INT, &block, "B", "rows of the verify step", NULL},
        {"iters", 0, DFL_OPT_INT, &iters, "N", "timed calls of each op (after one warm-up call)", NULL},
        {"tiny", 0, DFL_OPT_FLAG, &tiny, NULL, "tiny shapes: a smoke test of this program", NULL},
        {"attn-only", 0, DFL_OPT_FLAG, &attn_only, NULL, "time the attention alone", NULL},
        {0},
    };
    const dfl_cli cli = {"bench_gdn", "time the Gated DeltaNet ops of a Qwen3.5-27B layer", "[OPTIONS]", opts};
    char **pos;
    if (dfl_cli_parse(&cli, argc, argv, &pos) != 0) dfl_cli_usage_error(&cli, "no arguments expected");
    if (iters < 1 || nseq < 1 || seq < 1 || block < 1)
        dfl_cli_usage_error(&cli, "--iters, --seqs, --seq and --block must be >= 1");
    if (dfl_ops_get(device, &OPS) != 0) dfl_die_last("bench_gdn");
    int64_t Hk = 16, Hv = 48, dk = 128, dv = 128;
    if (tiny) Hk = 2, Hv = 6, dk = 16, dv = 24, nseq = 3, seq = 40, block = 4;
    pool_init(44);
    const double fma_rate = 33.5e12, bw = 4.3e12;

    /* the full-attention layer: Qwen3.5-27B's heads at every size (tiny: 6/1) */
    attn_layer a = {.nseq = nseq, .T = nseq * seq, .Hq = tiny ? 6 : 24, .Hkv = tiny ? 1 : 4, .D = 256};
    a.cu = cu_even(nseq, seq);
    a.q = act_rand(a.T * a.Hq * a.D, POOL_ACT), a.out = act_new(a.T * a.Hq * a.D);
    a.k = act_rand(a.T * a.Hkv * a.D, POOL_ACT), a.v = act_rand(a.T * a.Hkv * a.D, POOL_ACT);
    double ta = time_calls(run_attn, &a, iters);
    printf("attention: %lld x %lld tokens, causal, %lld/%lld heads of %lld\n", (long long)nseq, (long long)seq,
           (long long)a.Hq, (long long)a.Hkv, (long long)a.D);
    print_kv("attn_causal ms", "%.3f", ta * 1e3);
    print_kv("  TFLOP/s", "%.1f", attn_flops(&a) / ta / 1e12);
    print_kv("  non-finite outputs", "%.0f", (double)nonfinite(a.out, a.T * a.Hq * a.D));
    void *ap[] = {a.q, a.k, a.v, a.out, a.cu};
    for (size_t i = 0; i < sizeof ap / sizeof ap[0]; i++) OPS->free(ap[i]);
    if (attn_only) return dfl_close_stdout();

    gdn_layer p = layer_new(nseq, seq, Hk, Hv, dk, dv, 0);
    const double steps = (double)p.T * (double)Hv;
    double tc = time_calls(run_conv, &p, iters), td = time_calls(run_delta, &p, iters);
    printf("prefill: %lld x %lld tokens, Hk %lld, Hv %lld, %lld x %lld state\n", (long long)nseq, (long long)seq,
           (long long)Hk, (long long)Hv, (long long)dk, (long long)dv);
    print_kv("conv1d_silu ms", "%.3f", tc * 1e3);
    print_kv("  byte floor ms", "%.3f", 2.0 * (double)p.T * (double)p.C * 2 / bw * 1e3);
    print_kv("gated_delta ms", "%.3f", td * 1e3);
    print_kv("  f32 floor ms", "%.3f", 4.0 * steps * (double)dk * (double)dv / fma_rate * 1e3);
    print_kv("  (row, head) steps per s", "%.4g", steps / td);
    print_kv("  non-finite outputs", "%.0f", (double)nonfinite(p.out, p.T * Hv * dv));
    layer_free(&p);

    gdn_layer v = layer_new(1, block, Hk, Hv, dk, dv, 1);
    tc = time_calls(run_conv, &v, iters);
    td = time_calls(run_delta, &v, iters);
    printf("verify: %lld rows, from a state\n", (long long)block);
    print_kv("conv1d_silu us", "%.2f", tc * 1e6);
    print_kv("gated_delta us", "%.2f", td * 1e6);
    print_kv("  byte floor us", "%.2f",
             (2.0 * (double)Hv * (double)dk * (double)dv * 4 + (double)block * (double)v.C * 2) / bw * 1e6);
    print_kv("  non-finite outputs", "%.0f", (double)nonfinite(v.out, v.T * Hv * dv));
    layer_free(&v);
    return dfl_close_stdout();
}
