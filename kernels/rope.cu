// rope.cu: rotary position embedding, NeoX pairing (i, i + d/2), in place.
// defines: cuda_rope, cuda_qk_norm_rope, cuda_qk_norm_rope_bwd
//
// One thread per (token, pair index): it computes the angle once, in f32
// exactly as the CPU reference does (pos as float times inv_freq, then a
// correctly range-reduced sincosf, each of sin and cos times the scale),
// and rotates that pair in every head.
#include "common.cuh"

// ---------------------------------------------------------------------------
// CUDA kernels

__global__ void rope_kernel(bf16 *x, const int32_t *pos, const float *inv_freq, float scale, int64_t T, int nh,
                            int d, float sign) {
    int half = d / 2;
    int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (idx >= T * half) return;
    int64_t t = idx / half;
    int i = (int)(idx % half);
    float th = (float)pos[t] * inv_freq[i];
    float s, c;
    sincosf(th, &s, &c);
    const float m = inv_freq[i] != 0.0f ? scale : 1.0f; // a pass-through pair: unscaled
    c *= m;
    s = s * m * sign;
    bf16 *row = x + t * (int64_t)nh * d;
    for (int h = 0; h < nh; h++) {
        bf16 *p = row + (int64_t)h * d;
        float a = bf2f(p[i]), b = bf2f(p[i + half]);
        p[i] = f2bf(a * c - b * s);
        p[i + half] = f2bf(b * c + a * s);
    }
}

// qk_norm_rope: one warp per (token, group of up to HEADS_PER_WARP heads);
// lane l holds the pairs (i, i + d/2) for i = V*l + 32*V*k (V = 2: two
// adjacent pairs, read and written as bf16 pairs, 4-byte aligned: the
// launcher checks). The angles of a lane's pairs are the same in every head
// of the token: their sines and cosines are computed once a warp (the same
// angle and sincosf as rope_kernel), for up to MAX_K of a lane's i (head
// dims up to 256 at V = 2), on the fly past that. Per head: the sum of
// squares over the row in f32, then per pair the norm as rmsnorm computes
// it (x * rstd * (w + w_add)) and the rotation, in f32, one rounding: the
// normed row is never stored in bf16 between the two; rstd, when wanted, as
// rmsnorm_kernel saves it. out may alias in: a lane writes only the pairs
// it read, after the warp's sum has used every element of the row.
constexpr int HEADS_PER_WARP = 8, MAX_K = 2;

// The angles of one lane's pairs at one token (the same in every head):
// those of its first MAX_K pair groups computed once (indices known at
// compile time: registers), any further ones on the fly. each(f) calls
// f(i, sin[V], cos[V]) for every pair group i of the lane.
template <int V>
struct LaneAngles {
    float sn[MAX_K][V], cs[MAX_K][V], p, scale;
    const float *inv_freq;
    int lane, half;
    __device__ LaneAngles(float p_, const float *inv_freq_, float scale_, int lane_, int half_)
        : p(p_), scale(scale_), inv_freq(inv_freq_), lane(lane_), half(half_) {
#pragma unroll
        for (int k = 0; k < MAX_K; k++)
#pragma unroll
            for (int v = 0; v < V; v++) {
                const int i = lane * V + 32 * V * k + v;
                if (i < half) angle(i, &sn[k][v], &cs[k][v]);
            }
    }
    // sin and cos of pair i's angle, each times the scale, but for a
    // pass-through pair (frequency 0), as rope_kernel
    __device__ __forceinline__ void angle(int i, float *s, float *c) const {
        const float f = inv_freq[i], m = f != 0.0f ? scale : 1.0f;
        sincosf(p * f, s, c);
        *s *= m;
        *c *= m;
    }
    template <typename F>
    __device__ __forceinline__ void each(F f) const {
#pragma unroll
        for (int k = 0; k < MAX_K; k++) {
            const int i = lane * V + 32 * V * k;
            if (i < half) f(i, sn[k], cs[k]);
        }
        for (int i = lane * V + 32 * V * MAX_K; i < half; i += 32 * V) {
            float s_[V], c_[V];
#pragma unroll
            for (int v = 0; v < V; v++) angle(i + v, &s_[v], &c_[v]);
            f(i, s_, c_);
        }
    }
};

// pairs (i + v, i + v + half), v < V, of one row: normed, rotated, stored
template <int V>
__device__ __forceinline__ void norm_rotate(bf16 *y, const bf16 *x, const bf16 *w, int i, int half, float r,
                                            float w_add, const float *sn, const float *cs) {
    float a[V], b[V], wa[V], wb[V], ya[V], yb[V];
    load_bf16s<V>(a, x + i);
    load_bf16s<V>(b, x + i + half);
    load_bf16s<V>(wa, w + i);
    load_bf16s<V>(wb, w + i + half);
#pragma unroll
    for (int v = 0; v < V; v++) {
        const float na = a[v] * r * (wa[v] + w_add), nb = b[v] * r * (wb[v] + w_add);
        ya[v] = na * cs[v] - nb * sn[v];
        yb[v] = nb * cs[v] + na * sn[v];
    }
    store_bf16s<V>(y + i, ya);
    store_bf16s<V>(y + i + half, yb);
}

// The same for a warp's heads (rows row0 .. row0+nh-1) when a lane's pairs
// are K of its cached angle groups (K <= MAX_K: head dims up to 128 at
// V = 1, 256 at V = 2): every head's pairs are loaded (kept as loaded, in
// bf16) before any head is reduced, so a lane has 2*K loads a head in
// flight for all the warp's heads, where the head loop waited a memory
// latency for each head's sum (~2x the byte floor at 16384 tokens x 32
// heads of 128). The weights are read once for the warp's heads. The same
// arithmetic in the same order as the loop.
template <int V, int K>
__device__ __forceinline__ void norm_rotate_heads(bf16 *out, float *rstd, const bf16 *in, const bf16 *w, float w_add,
                                                  const LaneAngles<V> &ang, int64_t row0, int nh, int d, float eps) {
    static_assert(K >= 1 && K <= MAX_K, "the lane's pair groups are among its cached angles");
    typedef typename bf16_vec<V>::type raw;
    const int lane = threadIdx.x % 32, half = d / 2;
    raw a[HEADS_PER_WARP][K], b[HEADS_PER_WARP][K];
#pragma unroll
    for (int h = 0; h < HEADS_PER_WARP; h++) {
        if (h >= nh) break;
        const bf16 *x = in + (row0 + h) * d;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int i = lane * V + 32 * V * k;
            if (i < half) a[h][k] = load_bf16_raw<V>(x + i), b[h][k] = load_bf16_raw<V>(x + i + half);
        }
    }
    float r[HEADS_PER_WARP];
#pragma unroll
    for (int h = 0; h < HEADS_PER_WARP; h++) {
        if (h >= nh) break;
        float ss = 0.0f;
#pragma unroll
        for (int k = 0; k < K; k++) {
            if (lane * V + 32 * V * k >= half) break;
            float fa[V], fb[V];
            unpack_bf16s<V>(fa, a[h][k]), unpack_bf16s<V>(fb, b[h][k]);
#pragma unroll
            for (int v = 0; v < V; v++) ss += fa[v] * fa[v] + fb[v] * fb[v];
        }
        r[h] = rsqrtf(warp_sum(ss) / (float)d + eps);
        if (rstd && lane == 0) rstd[row0 + h] = r[h];
    }
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int i = lane * V + 32 * V * k;
        if (i >= half) break;
        float wa[V], wb[V];
        load_bf16s<V>(wa, w + i);
        load_bf16s<V>(wb, w + i + half);
#pragma unroll
        for (int h = 0; h < HEADS_PER_WARP; h++) {
            if (h >= nh) break;
            float fa[V], fb[V], ya[V], yb[V];
            unpack_bf16s<V>(fa, a[h][k]), unpack_bf16s<V>(fb, b[h][k]);
#pragma unroll
            for (int v = 0; v < V; v++) {
                const float na = fa[v] * r[h] * (wa[v] + w_add), nb = fb[v] * r[h] * (wb[v] + w_add);
                ya[v] = na * ang.cs[k][v] - nb * ang.sn[k][v];
                yb[v] = nb * ang.cs[k][v] + na * ang.sn[k][v];
            }
            bf16 *y = out + (row0 + h) * d;
            store_bf16s<V>(y + i, ya);
            store_bf16s<V>(y + i + half, yb);
        }
    }
}

template <int V>
__global__ void qk_norm_rope_kernel(bf16 *out, float *rstd, const bf16 *in, const bf16 *w, float w_add,
                                    const int32_t *pos, const float *inv_freq, float scale, int64_t T, int nh, int d,
                                    float eps) {
    const int lane = threadIdx.x % 32, half = d / 2, groups = (nh + HEADS_PER_WARP - 1) / HEADS_PER_WARP;
    const int64_t wid = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    if (wid >= T * groups) return;
    const int64_t t = wid / groups;
    const int h0 = (int)(wid % groups) * HEADS_PER_WARP, h1 = h0 + HEADS_PER_WARP < nh ? h0 + HEADS_PER_WARP : nh;
    const LaneAngles<V> ang((float)pos[t], inv_freq, scale, lane, half);
    if (half <= 32 * V) {
        norm_rotate_heads<V, 1>(out, rstd, in, w, w_add, ang, t * nh + h0, h1 - h0, d, eps);
        return;
    }
    if (half <= 32 * V * MAX_K) {
        norm_rotate_heads<V, MAX_K>(out, rstd, in, w, w_add, ang, t * nh + h0, h1 - h0, d, eps);
        return;
    }
    for (int h = h0; h < h1; h++) {
        const int64_t row = t * nh + h;
        const bf16 *x = in + row * d;
        float ss = 0.0f;
        for (int i = lane * V; i < half; i += 32 * V) {
            float a[V], b[V];
            load_bf16s<V>(a, x + i);
            load_bf16s<V>(b, x + i + half);
#pragma unroll
            for (int v = 0; v < V; v++) ss += a[v] * a[v] + b[v] * b[v];
        }
        ss = warp_sum(ss);
        const float r = rsqrtf(ss / (float)d + eps);
        if (rstd && lane == 0) rstd[row] = r;
        bf16 *y = out + row * d;
        ang.each([&](int i, const float *sn, const float *cs) { norm_rotate<V>(y, x, w, i, half, r, w_add, sn, cs); });
    }
}

// The backward of a warp's heads at once (rows row0 .. row0+nh-1), when a
// lane's pairs are K of its cached angle groups, as norm_rotate_heads does
// for the forward: every head's dout and x pairs loaded (in bf16) before
// any head's sum, the weights once. The same arithmetic, and each dW
// column gets the heads' terms in the same order, as the head loop. Used
// for K = 1 (head dims up to 128 at V = 2, the drafters'): K = 2 took the
// kernel to 208 registers.
template <int V, int K>
__device__ __forceinline__ void norm_rotate_heads_bwd(bf16 *din, float *mydw, const bf16 *dout, const bf16 *in,
                                                      const float *rstd, const bf16 *w, const LaneAngles<V> &ang,
                                                      int64_t row0, int nh, int d) {
    static_assert(K >= 1 && K <= MAX_K, "the lane's pair groups are among its cached angles");
    typedef typename bf16_vec<V>::type raw;
    const int lane = threadIdx.x % 32, half = d / 2;
    raw ya[HEADS_PER_WARP][K], yb[HEADS_PER_WARP][K], xa[HEADS_PER_WARP][K], xb[HEADS_PER_WARP][K];
#pragma unroll
    for (int h = 0; h < HEADS_PER_WARP; h++) {
        if (h >= nh) break;
        const bf16 *x = in + (row0 + h) * d, *dy = dout + (row0 + h) * d;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int i = lane * V + 32 * V * k;
            if (i < half) {
                ya[h][k] = load_bf16_raw<V>(dy + i), yb[h][k] = load_bf16_raw<V>(dy + i + half);
                xa[h][k] = load_bf16_raw<V>(x + i), xb[h][k] = load_bf16_raw<V>(x + i + half);
            }
        }
    }
    float wa[K][V], wb[K][V];
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int i = lane * V + 32 * V * k;
        if (i < half) load_bf16s<V>(wa[k], w + i), load_bf16s<V>(wb[k], w + i + half);
    }
    // g of head h, pair group k: dout rotated back
    auto rotate_back = [&](int h, int k, float *ga, float *gb, float *a, float *b) {
        float fa[V], fb[V];
        unpack_bf16s<V>(fa, ya[h][k]), unpack_bf16s<V>(fb, yb[h][k]);
        unpack_bf16s<V>(a, xa[h][k]), unpack_bf16s<V>(b, xb[h][k]);
#pragma unroll
        for (int v = 0; v < V; v++)
            ga[v] = fa[v] * ang.cs[k][v] + fb[v] * ang.sn[k][v], gb[v] = fb[v] * ang.cs[k][v] - fa[v] * ang.sn[k][v];
    };
    float r[HEADS_PER_WARP], kk[HEADS_PER_WARP];
#pragma unroll
    for (int h = 0; h < HEADS_PER_WARP; h++) {
        if (h >= nh) break;
        r[h] = rstd[row0 + h];
        float gwx = 0.0f;
#pragma unroll
        for (int k = 0; k < K; k++) {
            if (lane * V + 32 * V * k >= half) break;
            float ga[V], gb[V], a[V], b[V];
            rotate_back(h, k, ga, gb, a, b);
#pragma unroll
            for (int v = 0; v < V; v++) gwx += ga[v] * wa[k][v] * a[v] + gb[v] * wb[k][v] * b[v];
        }
        gwx = warp_sum(gwx);
        kk[h] = r[h] * r[h] * r[h] * gwx / (float)d;
    }
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int i = lane * V + 32 * V * k;
        if (i >= half) break;
#pragma unroll
        for (int h = 0; h < HEADS_PER_WARP; h++) {
            if (h >= nh) break;
            float ga[V], gb[V], a[V], b[V];
            rotate_back(h, k, ga, gb, a, b);
            if (din) {
                float da[V], db[V];
#pragma unroll
                for (int v = 0; v < V; v++)
                    da[v] = r[h] * ga[v] * wa[k][v] - a[v] * kk[h], db[v] = r[h] * gb[v] * wb[k][v] - b[v] * kk[h];
                store_bf16s<V>(din + (row0 + h) * d + i, da);
                store_bf16s<V>(din + (row0 + h) * d + i + half, db);
            }
            if (mydw) add_dw_terms<V>(mydw + i, ga, a, r[h]), add_dw_terms<V>(mydw + i + half, gb, b, r[h]);
        }
    }
}

// qk_norm_rope's backward: per row, g = dout rotated back by -pos (rope's
// inverse, in f32: never rounded to bf16 in between), then with
// r = rstd[row]: din = r g w - x r^3 (sum g w x) / d (written), and
// dw += g x r. The warps and lanes of qk_norm_rope_kernel (angles once a
// unit); each warp sums dw for its columns in a shared-memory row, the
// block adds its warps' rows in warp order into its partial, and
// cuda_sum_partials adds the partials in block order: deterministic.
// Block b takes units [b*upb, (b+1)*upb), its warp k every nwarps-th.
template <int V>
__global__ void qk_norm_rope_bwd_kernel(bf16 *din, float *dw_part, const bf16 *dout, const bf16 *in,
                                        const float *rstd, const bf16 *w, const int32_t *pos, const float *inv_freq,
                                        float scale, int64_t T, int nh, int d, int64_t upb) {
    DYN_SMEM(float, sdw); // [nwarps][d]
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32, half = d / 2;
    const int groups = (nh + HEADS_PER_WARP - 1) / HEADS_PER_WARP;
    float *mydw = sdw + (int64_t)warp * d;
    if (dw_part)
        for (int c = lane; c < d; c += 32) mydw[c] = 0.0f;
    __syncwarp(); // lanes then add to columns another lane zeroed
    const int64_t units = T * groups, u0 = blockIdx.x * upb, u1 = u0 + upb < units ? u0 + upb : units;
    for (int64_t u = u0 + warp; u < u1; u += nwarps) {
        const int64_t t = u / groups;
        const int h0 = (int)(u % groups) * HEADS_PER_WARP, h1 = h0 + HEADS_PER_WARP < nh ? h0 + HEADS_PER_WARP : nh;
        const LaneAngles<V> ang((float)pos[t], inv_freq, scale, lane, half);
        float *dwrow = dw_part ? mydw : NULL;
        if (half <= 32 * V) {
            norm_rotate_heads_bwd<V, 1>(din, dwrow, dout, in, rstd, w, ang, t * nh + h0, h1 - h0, d);
            continue;
        }
        for (int h = h0; h < h1; h++) {
            const int64_t row = t * nh + h;
            const bf16 *x = in + row * d, *dy = dout + row * d;
            const float r = rstd[row];
            // f(i, ga, gb, a, b, wa, wb) for each of the lane's pair groups:
            // g rotated back, x and w, V pairs (i + v, i + v + half) each
            auto each_pair = [&](auto f) {
                ang.each([&](int i, const float *sn, const float *cs) {
                    float ya[V], yb[V], a[V], b[V], wa[V], wb[V], ga[V], gb[V];
                    load_bf16s<V>(ya, dy + i);
                    load_bf16s<V>(yb, dy + i + half);
                    load_bf16s<V>(a, x + i);
                    load_bf16s<V>(b, x + i + half);
                    load_bf16s<V>(wa, w + i);
                    load_bf16s<V>(wb, w + i + half);
#pragma unroll
                    for (int v = 0; v < V; v++) ga[v] = ya[v] * cs[v] + yb[v] * sn[v], gb[v] = yb[v] * cs[v] - ya[v] * sn[v];
                    f(i, ga, gb, a, b, wa, wb);
                });
            };
            float gwx = 0.0f;
            each_pair([&](int, const float *ga, const float *gb, const float *a, const float *b, const float *wa,
                          const float *wb) {
#pragma unroll
                for (int v = 0; v < V; v++) gwx += ga[v] * wa[v] * a[v] + gb[v] * wb[v] * b[v];
            });
            gwx = warp_sum(gwx);
            const float kk = r * r * r * gwx / (float)d;
            each_pair([&](int i, const float *ga, const float *gb, const float *a, const float *b, const float *wa,
                          const float *wb) {
                if (din) {
                    float da[V], db[V];
#pragma unroll
                    for (int v = 0; v < V; v++) da[v] = r * ga[v] * wa[v] - a[v] * kk, db[v] = r * gb[v] * wb[v] - b[v] * kk;
                    store_bf16s<V>(din + row * d + i, da);
                    store_bf16s<V>(din + row * d + i + half, db);
                }
                if (dw_part) add_dw_terms<V>(mydw + i, ga, a, r), add_dw_terms<V>(mydw + i + half, gb, b, r);
            });
        }
    }
    if (dw_part) warp_rows_to_partial(dw_part, sdw, d);
}

// ---------------------------------------------------------------------------
// kernel launchers

void cuda_rope(void *x, const int32_t *pos, const float *inv_freq, float scale, int64_t T, int64_t nh, int64_t d,
               int inverse) {
    CU_ASSERT(x && pos && inv_freq && T >= 0 && nh > 0 && d > 0 && d % 2 == 0 && nh <= INT32_MAX && d <= INT32_MAX);
    int64_t n = T * (d / 2);
    if (n == 0) return;
    KLAUNCH(rope_kernel, (unsigned)CEIL_DIV(n, (int64_t)256), 256, 0)(
        (bf16 *)x, pos, inv_freq, scale, T, (int)nh, (int)d, inverse ? -1.0f : 1.0f);
    LAUNCH_CHECK();
}

void cuda_qk_norm_rope(void *out, float *rstd, const void *in, const void *w, int plus_one, const int32_t *pos,
                       const float *inv_freq, float scale, int64_t T, int64_t nh, int64_t d, float eps) {
    CU_ASSERT(out && in && w && pos && inv_freq && T >= 0 && nh > 0 && d > 0 && d % 2 == 0);
    CU_ASSERT(nh <= INT32_MAX && d <= INT32_MAX);
    if (T == 0) return;
    const int warps = 8;
    const int64_t units = T * CEIL_DIV(nh, (int64_t)HEADS_PER_WARP);
    const unsigned grid = (unsigned)CEIL_DIV(units, (int64_t)warps);
    const float w_add = plus_one ? 1.0f : 0.0f;
    if ((d / 2) % 2 == 0 && is_aligned(out, 4) && is_aligned(in, 4) && is_aligned(w, 4))
        KLAUNCH(qk_norm_rope_kernel<2>, grid, warps * 32, 0)((bf16 *)out, rstd, (const bf16 *)in, (const bf16 *)w,
                                                             w_add, pos, inv_freq, scale, T, (int)nh, (int)d, eps);
    else
        KLAUNCH(qk_norm_rope_kernel<1>, grid, warps * 32, 0)((bf16 *)out, rstd, (const bf16 *)in, (const bf16 *)w,
                                                             w_add, pos, inv_freq, scale, T, (int)nh, (int)d, eps);
    LAUNCH_CHECK();
}

// One wave of blocks (one_wave_blocks), as the RMSNorm backward.
template <int V>
static void launch_qk_bwd(bf16 *din, float *dw, const bf16 *dout, const bf16 *in, const float *rstd, const bf16 *w,
                          const int32_t *pos, const float *inv_freq, float scale, int64_t T, int nh, int d) {
    const int warps = 4;
    const size_t smem = dw ? (size_t)warps * d * 4 : 0;
    static size_t smem_set = 48 << 10;
    if (smem > smem_set) {
        cudaCheck(cudaFuncSetAttribute(qk_norm_rope_bwd_kernel<V>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)smem));
        smem_set = smem;
    }
    const int64_t units = T * CEIL_DIV((int64_t)nh, (int64_t)HEADS_PER_WARP);
    int64_t upb;
    const int64_t nblk = one_wave_blocks(qk_norm_rope_bwd_kernel<V>, warps * 32, smem, units, warps, &upb);
    float *part = dw ? (float *)cuda_scratch(SCRATCH_OP, (size_t)nblk * d * 4) : NULL;
    KLAUNCH(qk_norm_rope_bwd_kernel<V>, (unsigned)nblk, warps * 32, smem)(din, part, dout, in, rstd, w, pos,
                                                                          inv_freq, scale, T, nh, d, upb);
    LAUNCH_CHECK();
    if (dw) cuda_sum_partials(dw, part, (int)nblk, d);
}

void cuda_qk_norm_rope_bwd(void *din, float *dw, const void *dout, const void *in, const float *rstd, const void *w,
                           const int32_t *pos, const float *inv_freq, float scale, int64_t T, int64_t nh,
                           int64_t d) {
    CU_ASSERT(dout && in && rstd && w && pos && inv_freq && T >= 0 && nh > 0 && d > 0 && d % 2 == 0);
    CU_ASSERT(nh <= INT32_MAX && d <= INT32_MAX);
    CU_ASSERT((size_t)4 * d * 4 <= g_cuda.smem_optin);
    if (T == 0 || (!din && !dw)) return;
    if ((d / 2) % 2 == 0 && (!din || is_aligned(din, 4)) && is_aligned(dout, 4) && is_aligned(in, 4) &&
        is_aligned(w, 4))
        launch_qk_bwd<2>((bf16 *)din, dw, (const bf16 *)dout, (const bf16 *)in, rstd, (const bf16 *)w, pos, inv_freq,
                         scale, T, (int)nh, (int)d);
    else
        launch_qk_bwd<1>((bf16 *)din, dw, (const bf16 *)dout, (const bf16 *)in, rstd, (const bf16 *)w, pos, inv_freq,
                         scale, T, (int)nh, (int)d);
}
