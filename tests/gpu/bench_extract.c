/* bench_extract.c: hidden-state extraction throughput of a Qwen3-8B-shaped
 * target through the op table: 36-layer config (hidden 4096, 32/8 heads of
 * 128, intermediate 12288, vocab 151936), run only up to the deepest tap
 * (taps 1, 9, 17, 25, 33: layers 0..33), on packed batches of 2048-token
 * samples. Random weights in the real shapes, distinct per layer, made on
 * the device from a random pool.
 *
 * The layer is the Qwen3 decoder layer of targets-extraction.md §1.1 as
 * lib/target.c runs it: RMSNorm, q/k/v projections, per-head q/k RMSNorm
 * and RoPE (theta 1e6) at per-sample positions in one pass (qk_norm_rope),
 * causal attention over the packed samples (cu offsets), o projection,
 * residual, RMSNorm, SwiGLU MLP, residual (each residual add fused into
 * its projection: matmul with accumulate, which saves a pass over the
 * stream per add). The tapped layers' outputs are copied out as the stream
 * needs them; with --download they are also brought to host memory (bf16),
 * which the tool must do before compressing and writing.
 *
 * FLOPs: 2·M·K·N per projection, 4·D per (query, visible key, head) for
 * attention. Anchors (performance-anchors.md §3.2): SGLang capture ~27K
 * tok/s on one H200; the goal here is >= 45K.
 *
 *   bench_extract [--device cuda] [--samples 8] [--seq 2048] [--iters 3] [--download] [--tiny] */
#include "bench_util.h"
#include "cli.h"

int main(int argc, char **argv) {
    const char *device = "cuda";
    int64_t nsamp = 8, seq = 2048, iters = 3;
    int tiny = 0, download = 0;
    const dfl_opt opts[] = {
        {"device", 0, DFL_OPT_STR, &device, "DEV", "cpu, cuda or cuda:N", NULL},
        {"samples", 0, DFL_OPT_INT, &nsamp, "N", "samples packed into one forward call", NULL},
        {"seq", 0, DFL_OPT_INT, &seq, "T", "tokens per sample", NULL},
        {"iters", 0, DFL_OPT_INT, &iters, "N", "timed calls (after one warm-up call)", NULL},
        {"download", 0, DFL_OPT_FLAG, &download, NULL, "also copy the tapped states to host memory", NULL},
        {"tiny", 0, DFL_OPT_FLAG, &tiny, NULL, "tiny shapes: a smoke test of this program", NULL},
        {0},
    };
    const dfl_cli cli = {"bench_extract", "time hidden-state extraction of a Qwen3-8B-shaped target",
                                "[OPTIONS]", opts};
    char **pos;
    if (dfl_cli_parse(&cli, argc, argv, &pos) != 0) dfl_cli_usage_error(&cli, "no arguments expected");
    if (iters < 1 || nsamp < 1 || seq < 1) dfl_cli_usage_error(&cli, "--iters, --samples and --seq must be >= 1");
    if (dfl_ops_get(device, &OPS) != 0) dfl_die_last("bench_extract");

    int64_t H = 4096, HQ = 32, HKV = 8, D = 128, I = 12288, V = 151936;
    int taps[5] = {1, 9, 17, 25, 33}, ntap = 5;
    if (tiny) {
        H = 64, HQ = 4, HKV = 2, D = 16, I = 96, V = 500;
        taps[0] = 0, taps[1] = 2, ntap = 2;
        nsamp = 3, seq = 40;
    }
    const int L = taps[ntap - 1] + 1; /* layers run: up to the deepest tap */
    const int64_t T = nsamp * seq, QD = HQ * D, KD = HKV * D;
    const float eps = 1e-6f;
    pool_init(43);

    /* weights: per layer q, k, v, o, gate, up, down, and the four norms */
    void **wq = dfl_calloc((size_t)L, sizeof(void *)), **wk = dfl_calloc((size_t)L, sizeof(void *));
    void **wv = dfl_calloc((size_t)L, sizeof(void *)), **wo = dfl_calloc((size_t)L, sizeof(void *));
    void **wg = dfl_calloc((size_t)L, sizeof(void *)), **wu = dfl_calloc((size_t)L, sizeof(void *));
    void **wd = dfl_calloc((size_t)L, sizeof(void *));
    for (int l = 0; l < L; l++) {
        wq[l] = act_rand(QD * H, POOL_WT), wk[l] = act_rand(KD * H, POOL_WT), wv[l] = act_rand(KD * H, POOL_WT);
        wo[l] = act_rand(H * QD, POOL_WT), wg[l] = act_rand(I * H, POOL_WT), wu[l] = act_rand(I * H, POOL_WT);
        wd[l] = act_rand(H * I, POOL_WT);
    }
    void *n_in = act_ones(H), *n_post = act_ones(H), *n_q = act_ones(D), *n_k = act_ones(D);
    void *embed_w = act_rand(V * H, POOL_WT);
    float *inv_freq = inv_freq_new(D, 1e6);

    /* one packed batch: ids, positions 0..seq-1 per sample, cu offsets */
    dfl_rng r;
    dfl_rng_seed(&r, 11);
    int32_t *ids = dfl_malloc((size_t)T * 4), *posn = dfl_malloc((size_t)T * 4), *cu = dfl_malloc((size_t)(nsamp + 1) * 4);
    for (int64_t t = 0; t < T; t++) ids[t] = (int32_t)dfl_rng_below(&r, (uint64_t)V), posn[t] = (int32_t)(t % seq);
    for (int64_t s = 0; s <= nsamp; s++) cu[s] = (int32_t)(s * seq);
    void *d_ids = i32_put(ids, T), *d_pos = i32_put(posn, T), *d_cu = i32_put(cu, nsamp + 1);

    void *x = act_new(T * H), *h = act_new(T * H), *q = act_new(T * QD), *k = act_new(T * KD), *v = act_new(T * KD);
    void *qn = act_new(T * QD), *kn = act_new(T * KD), *att = act_new(T * QD);
    void *gate = act_new(T * I), *up = act_new(T * I);
    void *tap = act_new((int64_t)ntap * T * H); /* [ntap][T][H]: the stream concatenates per token */
    uint16_t *host = download ? dfl_malloc((size_t)ntap * T * H * 2) : NULL;
    const double keys = (double)nsamp * (double)seq * (double)(seq + 1) / 2.0; /* causal: sum of (pos + 1) */

    double t_start = 0, flops = 0;
    for (int64_t it = 0; it <= iters; it++) {
        if (it == 1) t_start = now_synced();
        FLOPS = 0;
        OPS->embed(x, d_ids, embed_w, T, H);
        for (int l = 0, ti = 0; l < L; l++) {
            OPS->rmsnorm(h, NULL, x, n_in, T, H, eps);
            MM(q, h, wq[l], T, H, QD, 0);
            MM(k, h, wk[l], T, H, KD, 0);
            MM(v, h, wv[l], T, H, KD, 0);
            OPS->qk_norm_rope(qn, NULL, q, n_q, 0, d_pos, inv_freq, 1.0f, T, HQ, D, eps);
            OPS->qk_norm_rope(kn, NULL, k, n_k, 0, d_pos, inv_freq, 1.0f, T, HKV, D, eps);
            OPS->attn_causal(att, NULL, qn, kn, v, d_cu, nsamp, T, HQ, HKV, D, 0);
            FLOPS += 4.0 * keys * (double)D * (double)HQ;
            MM(x, att, wo[l], T, QD, H, 1); /* the residual add fused: accumulate into x */
            OPS->rmsnorm(h, NULL, x, n_post, T, H, eps);
            MM(gate, h, wg[l], T, H, I, 0);
            MM(up, h, wu[l], T, H, I, 0);
            OPS->swiglu(gate, gate, up, T * I);
            MM(x, gate, wd[l], T, I, H, 1);
            if (ti < ntap && l == taps[ti]) OPS->copy(DFL_AT(OPS, tap, (int64_t)ti++ * T * H), x, (size_t)(T * H) * OPS->act_bytes);
        }
        if (download) OPS->act_to_bf16(host, tap, (int64_t)ntap * T * H);
        flops = FLOPS;
    }
    double el = now_synced() - t_start;
    print_kv("tokens per call", "%.0f", (double)T);
    print_kv("time per call s", "%.4f", el / (double)iters);
    print_kv(download ? "tokens/s (incl. D2H of taps)" : "tokens/s (device, taps on GPU)", "%.0f",
             (double)T * (double)iters / el);
    print_kv("model TFLOP per call", "%.2f", flops / 1e12);
    print_kv("achieved TFLOP/s", "%.1f", flops * (double)iters / el / 1e12);
    print_kv("MFU vs 989 TFLOP/s %", "%.1f", 100.0 * flops * (double)iters / el / 989e12);
    if (download) { /* the states are finite numbers */
        int64_t bad = 0;
        for (int64_t i = 0; i < (int64_t)ntap * T * H; i += 4099) bad += !isfinite(dfl_bf16_to_f32(host[i]));
        print_kv("non-finite sampled tap values", "%.0f", (double)bad);
    }
    printf("bench_extract: %s, %lld samples x %lld tokens, layers 0..%d, H=%lld\n", OPS->name, (long long)nsamp,
           (long long)seq, L - 1, (long long)H);
    free(ids), free(posn), free(cu), free(host);
    free(wq), free(wk), free(wv), free(wo), free(wg), free(wu), free(wd);
    return 0;
}
