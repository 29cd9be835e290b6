/* bench_train.c: one training step of the Qwen3-8B DFlash drafter through
 * the op table: forward, chunked LM-head cross-entropy, backward, gradient
 * norm, AdamW, the bf16 cast of the master weights. Random weights in the
 * real shapes (5 layers, hidden 4096, 32/8 heads of 128, intermediate
 * 12288, vocab 151936, 5 taps), one 3072-token sample, 512 anchors of 16.
 *
 * It is written like the model code will be (dflash-spec.md §1.3-1.4,
 * §2.3-2.6): the context K/V come from hidden_norm(fc(taps)) through each
 * layer's own k_proj/v_proj/k_norm, queries only from the blocks, the
 * DFlash mask as dfl_block ranges, the loss weights exp(-(k-1)/7) on slots
 * k >= 1. Until lib/train.c lands this is the step the MFU is measured on.
 *
 * MFU counts model FLOPs, honestly: 2·M·K·N for every matrix product the
 * step issues (forward, and each gradient it needs: both for trainable
 * projections, dh only for the frozen LM head, dW only for fc, whose
 * input needs no gradient), plus attention at 4·D per (query, visible key,
 * head) forward and 8·D backward (no recomputation counted), over the
 * 989 TFLOP/s dense bf16 peak of an H100/H200 SXM.
 *
 * With --grad-out it is a whole-step agreement check instead: one step,
 * its gradient written, to compare --device cpu with cuda (compare.py).
 *
 * --window W: the layers but the last slide (spec 2.5, Qwen3.6-27B's
 * drafter: sliding x4 then full, W 2048): attn_dflash's window, and the
 * attention FLOPs counted over the keys each row then sees.
 *
 *   bench_train [--device cuda] [--steps 3] [--tiny | --small] [--window W] [--grad-out FILE] */
#include "bench_util.h"
#include "cli.h"

typedef struct {
    int64_t S, NA, B, Q, NK, H, HQ, HKV, D, I, V, K, L;
} dims;

/* one layer's weights: offsets into the flat parameter arrays */
enum { W_Q, W_K, W_V, W_O, W_G, W_U, W_D, N_QN, N_KN, N_IN, N_POST, LAYER_TENSORS };
typedef struct {
    int64_t off[LAYER_TENSORS], n[LAYER_TENSORS];
} layer_w;

typedef struct {
    void *x, *q_pre, *q, *k_pre, *k, *v, *att, *h_mid, *x2, *gate, *up, *act;
    float *rstd_in, *rstd_q, *rstd_k, *lse, *rstd_post;
} layer_a;

static dims dm;
static int64_t window; /* --window: layers 0 .. L-2 slide */
static layer_w LW[8];
static int64_t OFF_FC, OFF_HN, OFF_NORM, NPARAM;
static float *master, *grad, *mom1, *mom2;
static void *wt; /* compute weights, the layout of master */
static void *embed_w, *lm_w; /* frozen target embedding and LM head [V, H] */

#define WT(off) DFL_WAT(OPS, wt, off)
#define GR(off) (grad + (off))

static int64_t param(int64_t n) {
    int64_t o = NPARAM;
    NPARAM += n;
    return o;
}

/* layer l's sliding window: --window on every layer but the last */
static int64_t layer_window(int l) { return l < dm.L - 1 ? window : 0; }

static void layout(void) {
    const int64_t H = dm.H, QD = dm.HQ * dm.D, KD = dm.HKV * dm.D, I = dm.I;
    for (int l = 0; l < dm.L; l++) {
        int64_t n[LAYER_TENSORS] = {QD * H, KD * H, KD * H, H * QD, I * H, I * H, H * I, dm.D, dm.D, H, H};
        for (int t = 0; t < LAYER_TENSORS; t++) LW[l].n[t] = n[t], LW[l].off[t] = param(n[t]);
    }
    OFF_FC = param(H * dm.K * H);
    OFF_HN = param(H);
    OFF_NORM = param(H);
}

int main(int argc, char **argv) {
    const char *device = "cuda";
    int64_t steps = 3;
    int tiny = 0, small = 0;
    const char *grad_out = NULL;
    const dfl_opt opts[] = {
        {"device", 0, DFL_OPT_STR, &device, "DEV", "cpu, cuda or cuda:N", NULL},
        {"steps", 0, DFL_OPT_INT, &steps, "N", "timed steps (after one warm-up step)", NULL},
        {"tiny", 0, DFL_OPT_FLAG, &tiny, NULL, "tiny shapes: a smoke test of this program", NULL},
        {"small", 0, DFL_OPT_FLAG, &small, NULL, "small shapes with head dim 64 (the tensor-core attention)", NULL},
        {"window", 0, DFL_OPT_INT, &window, "W",
         "a sliding window of W keys on every layer but the last (Qwen3.6-27B's drafter: 2048); 0: none", "0"},
        {"grad-out", 0, DFL_OPT_STR, &grad_out, "FILE",
         "make one step only and write its gradient (f32, the flat parameter layout; tensors listed in "
         "FILE.json) to FILE, to compare devices",
         NULL},
        {0},
    };
    const dfl_cli cli = {"bench_train", "time one DFlash drafter training step", "[OPTIONS]", opts};
    char **pos;
    if (dfl_cli_parse(&cli, argc, argv, &pos) != 0) dfl_cli_usage_error(&cli, "no arguments expected");
    if (steps < 1) dfl_cli_usage_error(&cli, "--steps must be at least 1");
    if (window < 0) dfl_cli_usage_error(&cli, "--window must be at least 0");
    if (dfl_ops_get(device, &OPS) != 0) dfl_die_last("bench_train");

    if (tiny) dm = (dims){64, 4, 4, 0, 0, 64, 4, 2, 16, 96, 500, 2, 2};
    else if (small) dm = (dims){150, 6, 16, 0, 0, 128, 4, 2, 64, 96, 700, 2, 2};
    else dm = (dims){3072, 512, 16, 0, 0, 4096, 32, 8, 128, 12288, 151936, 5, 5};
    dm.Q = dm.NA * dm.B;
    dm.NK = dm.S + dm.Q;
    const int64_t S = dm.S, Q = dm.Q, NK = dm.NK, H = dm.H, HQ = dm.HQ, HKV = dm.HKV, D = dm.D, I = dm.I, V = dm.V;
    const int64_t QD = HQ * D, KD = HKV * D;
    const float eps = 1e-6f;
    pool_init(42);
    layout();

    /* parameters: f32 master, gradient, moments; bf16 compute copy */
    master = f32_new(NPARAM), grad = f32_new(NPARAM), mom1 = f32_new(NPARAM), mom2 = f32_new(NPARAM);
    if (grad_out) { /* the gradient starts as NaN: --grad-out shows any element the step did not write */
        float *nan = dfl_malloc((size_t)NPARAM * 4);
        for (int64_t i = 0; i < NPARAM; i++) nan[i] = NAN;
        OPS->upload(grad, nan, (size_t)NPARAM * 4);
        free(nan);
    }
    wt = OPS->alloc((size_t)NPARAM * OPS->wt_bytes);
    pool_fill(master, NPARAM, POOL_MASTER);
    OPS->master_to_wt(wt, master, NPARAM);
    for (int l = 0; l < dm.L; l++) /* norm weights 1 */
        for (int t = N_QN; t <= N_POST; t++) {
            void *ones = act_ones(LW[l].n[t]);
            OPS->copy(WT(LW[l].off[t]), ones, (size_t)LW[l].n[t] * OPS->wt_bytes);
            OPS->free(ones);
        }
    embed_w = act_rand(V * H, POOL_WT);
    lm_w = act_rand(V * H, POOL_WT);
    float *inv_freq = inv_freq_new(D, 1e6);

    /* one sample: taps [S, K*H], anchors, blocks, positions, labels, weights */
    void *taps = act_rand(S * dm.K * H, POOL_ACT);
    dfl_rng r;
    dfl_rng_seed(&r, 7);
    int32_t *anchor = dfl_malloc((size_t)dm.NA * 4), *ids = dfl_malloc((size_t)Q * 4), *lab = dfl_malloc((size_t)Q * 4);
    int32_t *qpos = dfl_malloc((size_t)Q * 4), *kpos = dfl_malloc((size_t)NK * 4);
    float *gs = dfl_malloc((size_t)Q * 4);
    dfl_block *blk = dfl_malloc((size_t)dm.NA * sizeof(dfl_block));
    { /* NA distinct sorted anchors in [1, S - B] (selection sampling) */
        int64_t left = S - dm.B, need = dm.NA, j = 0;
        for (int64_t a = 1; a <= S - dm.B && need > 0; a++, left--)
            if ((int64_t)dfl_rng_below(&r, (uint64_t)left) < need) anchor[j++] = (int32_t)a, need--;
        DFL_ASSERT(j == dm.NA);
    }
    double wsum = 0;
    for (int64_t j = 0; j < dm.NA; j++)
        for (int64_t k = 0; k < dm.B; k++) {
            int64_t i = j * dm.B + k;
            ids[i] = k == 0 ? (int32_t)dfl_rng_below(&r, (uint64_t)(V > 151669 ? 151669 : V)) /* the anchor's token */
                           : (int32_t)(V > 151669 ? 151669 : V - 1); /* the mask token */
            lab[i] = (int32_t)dfl_rng_below(&r, (uint64_t)V);
            qpos[i] = anchor[j] + (int32_t)k;
            gs[i] = k == 0 ? 0.0f : (float)exp(-(double)(k - 1) / 7.0);
            wsum += gs[i];
        }
    for (int64_t i = 0; i < Q; i++) gs[i] = (float)(gs[i] / wsum); /* the weighted mean */
    for (int64_t t = 0; t < S; t++) kpos[t] = (int32_t)t;
    for (int64_t i = 0; i < Q; i++) kpos[S + i] = qpos[i];
    /* sum over query rows of the keys each sees: in a full layer the whole
     * context and block; in a sliding one (ops.h attn_dflash) slot o sees
     * the context keys from anchor + o + 1 - W on and its block's 0 .. o */
    double attn_keys = 0, attn_keys_win = 0;
    for (int64_t j = 0; j < dm.NA; j++) {
        blk[j].ctx_off = 0, blk[j].ctx_len = anchor[j], blk[j].blk_off = (int32_t)(S + j * dm.B);
        attn_keys += (double)dm.B * (double)(anchor[j] + dm.B);
        for (int64_t o = 0; o < dm.B && window; o++) {
            const int64_t first = anchor[j] + o + 1 - window > 0 ? anchor[j] + o + 1 - window : 0;
            attn_keys_win += (double)(anchor[j] > first ? anchor[j] - first : 0) + (double)(o + 1);
        }
    }
    void *d_ids = i32_put(ids, Q), *d_lab = i32_put(lab, Q), *d_qpos = i32_put(qpos, Q), *d_kpos = i32_put(kpos, NK);
    void *d_blk = i32_put((const int32_t *)blk, dm.NA * 3);
    float *d_gs = f32_new(Q);
    OPS->upload(d_gs, gs, (size_t)Q * 4);

    /* activations */
    void *fcout = act_new(S * H), *ctx = act_new(S * H);
    float *rstd_hn = f32_new(S);
    void **hres = dfl_calloc((size_t)dm.L + 1, sizeof(void *));
    for (int l = 0; l <= dm.L; l++) hres[l] = act_new(Q * H);
    layer_a *A = dfl_calloc((size_t)dm.L, sizeof(layer_a));
    for (int l = 0; l < dm.L; l++) {
        layer_a *a = &A[l];
        a->x = act_new(Q * H), a->q_pre = act_new(Q * QD), a->q = act_new(Q * QD);
        a->k_pre = act_new(NK * KD), a->k = act_new(NK * KD), a->v = act_new(NK * KD), a->att = act_new(Q * QD);
        a->h_mid = act_new(Q * H), a->x2 = act_new(Q * H);
        a->gate = act_new(Q * I), a->up = act_new(Q * I), a->act = act_new(Q * I);
        a->rstd_in = f32_new(Q), a->rstd_q = f32_new(Q * HQ), a->rstd_k = f32_new(NK * HKV), a->lse = f32_new(Q * HQ);
        a->rstd_post = f32_new(Q);
    }
    void *hout = act_new(Q * H), *tmp = act_new(Q * H);
    float *rstd_f = f32_new(Q), *loss = f32_new(Q);
    int32_t *pred = OPS->alloc((size_t)Q * 4);
    /* gradients of activations */
    void *dh = act_new(Q * H), *dhout = act_new(Q * H), *dx = act_new(Q * H), *dx2 = act_new(Q * H);
    void *datt = act_new(Q * QD), *dq = act_new(Q * QD), *dq_pre = act_new(Q * QD);
    void *dk = act_new(NK * KD), *dv = act_new(NK * KD), *dk_pre = act_new(NK * KD);
    void *dact = act_new(Q * I), *dgate = act_new(Q * I), *dup = act_new(Q * I);
    void *dctx = act_new(S * H), *dfc = act_new(S * H);

#define AAT(p, row, width) DFL_AT(OPS, p, (int64_t)(row) * (width))
    double t_fwd = 0, t_head = 0, t_bwd = 0, t_opt = 0, flops_step = 0;
    float loss0 = 0;
    /* with --grad-out: one step, its gradient written, no timing */
    for (int64_t step = 0; step <= (grad_out ? 0 : steps + 1); step++) {
        const int instrument = step == steps + 1; /* the last step: synced phases */
        double t0 = instrument ? now_synced() : 0;
        if (step == 1) t_fwd = now_synced(); /* timed steps start */
        FLOPS = 0;
        /* the gradient's start (dfl_drafter_start_grad): the norm weights' zeroed,
         * the matrices' written by their first products below */
        for (int l = 0; l < dm.L; l++) OPS->zero(GR(LW[l].off[N_QN]), (size_t)(2 * dm.D + 2 * H) * 4);
        OPS->zero(GR(OFF_HN), (size_t)(2 * H) * 4);
        /* ---- forward ---- */
        MM(fcout, taps, WT(OFF_FC), S, dm.K * H, H, 0);
        OPS->rmsnorm(ctx, rstd_hn, fcout, WT(OFF_HN), S, H, eps);
        OPS->embed(hres[0], d_ids, embed_w, Q, H);
        for (int l = 0; l < dm.L; l++) {
            layer_a *a = &A[l];
            const int64_t *o = LW[l].off, W = layer_window(l);
            OPS->rmsnorm(a->x, a->rstd_in, hres[l], WT(o[N_IN]), Q, H, eps);
            MM(a->q_pre, a->x, WT(o[W_Q]), Q, H, QD, 0);
            OPS->qk_norm_rope(a->q, a->rstd_q, a->q_pre, WT(o[N_QN]), 0, d_qpos, inv_freq, 1.0f, Q, HQ, D, eps);
            MM(a->k_pre, ctx, WT(o[W_K]), S, H, KD, 0); /* context rows [0, S) */
            MM(AAT(a->k_pre, S, KD), a->x, WT(o[W_K]), Q, H, KD, 0); /* block rows */
            MM(a->v, ctx, WT(o[W_V]), S, H, KD, 0);
            MM(AAT(a->v, S, KD), a->x, WT(o[W_V]), Q, H, KD, 0);
            OPS->qk_norm_rope(a->k, a->rstd_k, a->k_pre, WT(o[N_KN]), 0, d_kpos, inv_freq, 1.0f, NK, HKV, D, eps);
            OPS->attn_dflash(a->att, a->lse, a->q, a->k, a->v, d_blk, dm.NA, dm.B, NK, HQ, HKV, D, W);
            FLOPS += 4.0 * (W ? attn_keys_win : attn_keys) * (double)D * (double)HQ;
            MM(tmp, a->att, WT(o[W_O]), Q, QD, H, 0);
            OPS->add(a->h_mid, hres[l], tmp, Q * H);
            OPS->rmsnorm(a->x2, a->rstd_post, a->h_mid, WT(o[N_POST]), Q, H, eps);
            MM(a->gate, a->x2, WT(o[W_G]), Q, H, I, 0);
            MM(a->up, a->x2, WT(o[W_U]), Q, H, I, 0);
            OPS->swiglu(a->act, a->gate, a->up, Q * I);
            MM(tmp, a->act, WT(o[W_D]), Q, I, H, 0);
            OPS->add(hres[l + 1], a->h_mid, tmp, Q * H);
        }
        OPS->rmsnorm(hout, rstd_f, hres[dm.L], WT(OFF_NORM), Q, H, eps);
        double t1 = instrument ? now_synced() : 0;
        /* ---- LM head: loss and dh, the logits a chunk at a time ---- */
        zero_act(dhout, Q * H);
        OPS->lmhead_ce(loss, pred, dhout, hout, lm_w, d_lab, d_gs, Q, H, V);
        FLOPS += 2.0 * 2.0 * (double)Q * (double)H * (double)V;
        double t2 = instrument ? now_synced() : 0;
        /* ---- backward ---- */
        zero_act(dh, Q * H);
        OPS->rmsnorm_bwd(dh, GR(OFF_NORM), dhout, hres[dm.L], rstd_f, WT(OFF_NORM), Q, H);
        zero_act(dctx, S * H);
        for (int l = dm.L - 1; l >= 0; l--) {
            layer_a *a = &A[l];
            const int64_t *o = LW[l].off, W = layer_window(l);
            /* hres[l+1] = h_mid + down(act): dh is also d h_mid's residual part */
            /* the first product into each gradient, input or weight, overwrites it (as lib/drafter.c
             * after dfl_drafter_start_grad) */
            MM_BWD(dact, GR(o[W_D]), dh, a->act, WT(o[W_D]), Q, I, H, 0);
            OPS->swiglu_bwd(dgate, dup, dact, a->gate, a->up, Q * I, 0);
            MM_BWD(dx2, GR(o[W_G]), dgate, a->x2, WT(o[W_G]), Q, H, I, 0);
            MM_BWD(dx2, GR(o[W_U]), dup, a->x2, WT(o[W_U]), Q, H, I, DFL_ACC_DIN);
            OPS->rmsnorm_bwd(dh, GR(o[N_POST]), dx2, a->h_mid, a->rstd_post, WT(o[N_POST]), Q, H);
            /* h_mid = hres[l] + o(att) */
            MM_BWD(datt, GR(o[W_O]), dh, a->att, WT(o[W_O]), Q, QD, H, 0);
            OPS->attn_dflash_bwd(dq, dk, dv, datt, a->att, a->lse, a->q, a->k, a->v, d_blk, dm.NA, dm.B, NK, HQ,
                                 HKV, D, W);
            FLOPS += 8.0 * (W ? attn_keys_win : attn_keys) * (double)D * (double)HQ;
            OPS->qk_norm_rope_bwd(dq_pre, GR(o[N_QN]), dq, a->q_pre, a->rstd_q, WT(o[N_QN]), d_qpos, inv_freq, 1.0f, Q, HQ,
                                  D);
            OPS->qk_norm_rope_bwd(dk_pre, GR(o[N_KN]), dk, a->k_pre, a->rstd_k, WT(o[N_KN]), d_kpos, inv_freq, 1.0f, NK,
                                  HKV, D);
            MM_BWD(dx, GR(o[W_Q]), dq_pre, a->x, WT(o[W_Q]), Q, H, QD, 0);
            MM_BWD(dctx, GR(o[W_K]), dk_pre, ctx, WT(o[W_K]), S, H, KD, DFL_ACC_DIN);
            MM_BWD(dx, GR(o[W_K]), AAT(dk_pre, S, KD), a->x, WT(o[W_K]), Q, H, KD, DFL_ACC_DIN | DFL_ACC_DW);
            MM_BWD(dctx, GR(o[W_V]), dv, ctx, WT(o[W_V]), S, H, KD, DFL_ACC_DIN);
            MM_BWD(dx, GR(o[W_V]), AAT(dv, S, KD), a->x, WT(o[W_V]), Q, H, KD, DFL_ACC_DIN | DFL_ACC_DW);
            /* the first layer's input is the frozen embedding: no din */
            OPS->rmsnorm_bwd(l ? dh : NULL, GR(o[N_IN]), dx, hres[l], a->rstd_in, WT(o[N_IN]), Q, H);
        }
        zero_act(dfc, S * H);
        OPS->rmsnorm_bwd(dfc, GR(OFF_HN), dctx, fcout, rstd_hn, WT(OFF_HN), S, H);
        MM_BWD(NULL, GR(OFF_FC), dfc, taps, WT(OFF_FC), S, dm.K * H, H, 0);
        double t3 = instrument ? now_synced() : 0;
        if (step == 0 && grad_out) {
            float *g = dfl_malloc((size_t)NPARAM * 4);
            OPS->download(g, grad, (size_t)NPARAM * 4);
            FILE *f = fopen(grad_out, "wb");
            if (!f || fwrite(g, 4, (size_t)NPARAM, f) != (size_t)NPARAM || fclose(f) != 0)
                dfl_die("bench_train", DFL_EX_CANTCREAT, "%s: cannot write", grad_out);
            free(g);
            /* beside it, FILE.json: every tensor's name, offset and size */
            static const char *tn[LAYER_TENSORS] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj", "q_norm", "k_norm", "input_layernorm",
                                                     "post_attention_layernorm"};
            char path[4096];
            snprintf(path, sizeof path, "%s.json", grad_out);
            FILE *j = fopen(path, "w");
            if (!j) dfl_die("bench_train", DFL_EX_CANTCREAT, "%s: cannot write", path);
            fprintf(j, "{\"fc\": [%lld, %lld], \"hidden_norm\": [%lld, %lld], \"norm\": [%lld, %lld]",
                    (long long)OFF_FC, (long long)(H * dm.K * H), (long long)OFF_HN, (long long)H, (long long)OFF_NORM,
                    (long long)H);
            for (int l = 0; l < dm.L; l++)
                for (int t = 0; t < LAYER_TENSORS; t++)
                    fprintf(j, ", \"layers.%d.%s\": [%lld, %lld]", l, tn[t], (long long)LW[l].off[t],
                            (long long)LW[l].n[t]);
            fprintf(j, "}\n");
            fclose(j);
        }
        /* ---- optimizer: clip to norm 1, AdamW, bf16 weights ---- */
        double norm = sqrt(OPS->sumsq(grad, NPARAM));
        float clip = norm > 1.0 ? (float)(1.0 / (norm + 1e-6)) : 1.0f;
        OPS->adamw(master, wt, grad, mom1, mom2, NPARAM, 6e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, clip, step + 1);
        if (instrument) {
            double t4 = now_synced();
            t_head = t2 - t1, t_bwd = t3 - t2, t_opt = t4 - t3;
            print_kv("phase forward (incl. context) s", "%.4f", t1 - t0);
            print_kv("phase LM head CE + dh s", "%.4f", t_head);
            print_kv("phase backward s", "%.4f", t_bwd);
            print_kv("phase optimizer s", "%.4f", t_opt);
        }
        if (step == 0) {
            float *hl = dfl_malloc((size_t)Q * 4);
            OPS->download(hl, loss, (size_t)Q * 4);
            double sum = 0;
            for (int64_t i = 0; i < Q; i++) sum += hl[i] * (double)gs[i];
            loss0 = (float)sum;
            free(hl);
            printf("%-34s %.4f (ln V = %.4f), grad norm %.4g\n", "step 0 weighted loss", loss0, log((double)V), norm);
        }
        if (step == steps) {
            double el = now_synced() - t_fwd;
            flops_step = FLOPS;
            print_kv("step time s", "%.4f", el / (double)steps);
            print_kv("model TFLOP per step", "%.2f", flops_step / 1e12);
            print_kv("achieved TFLOP/s", "%.1f", flops_step * (double)steps / el / 1e12);
            print_kv("MFU vs 989 TFLOP/s %", "%.1f", 100.0 * flops_step * (double)steps / el / 989e12);
            print_kv("samples/s", "%.2f", (double)steps / el);
        }
    }
    printf("bench_train: %s, S=%lld anchors=%lld B=%lld H=%lld layers=%lld V=%lld params=%lld, attention keys a row %.1f",
           OPS->name, (long long)S, (long long)dm.NA, (long long)dm.B, (long long)H, (long long)dm.L, (long long)V,
           (long long)NPARAM, attn_keys / (double)Q);
    if (window)
        printf(", window=%lld on layers 0..%lld (%.1f keys a row there)", (long long)window, (long long)(dm.L - 2),
               attn_keys_win / (double)Q);
    printf("\n");
    free(anchor), free(ids), free(lab), free(qpos), free(kpos), free(gs), free(blk), free(A), free(hres);
    (void)loss0;
    return 0;
}
