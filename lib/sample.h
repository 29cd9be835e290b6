/* sample.h: the random draws of sampling at a temperature, shared by the
 * CPU op table and the CUDA kernels (plain C, header only).
 *
 * A token is drawn from softmax(z / T) by the Gumbel-max rule:
 *   token = argmax_v (z_v / T + g(key, v)),  g standard Gumbel noise.
 * The noise is a pure function of a 64-bit key and the vocabulary index, so
 * a draw depends on nothing else: not the batch it runs in, the backend, the
 * thread count or the order of evaluation. dflash-score keys each draw by
 * (seed, prompt id, position of the token drawn): the speculative loop
 * verifying a block and plain decoding producing one token at a time then
 * make the same draw for the same position, so at T > 0 as at T = 0 the
 * speculative output equals plain decoding's token for token (the lossless
 * check), and every drafter scored on a prompt sees the same draws. The
 * sequence number dflash-score gives is a hash of the prompt's id, so a
 * prompt with an id draws the same tokens in any shard or order of the
 * prompts file (one without is named by its line number).
 *
 * The uniform has 23 random bits, u = (k + 1/2) 2^-23, so that u and 1 - u
 * are exact in f32 and -log(-log u) is finite: g lies in [-2.81, 16.64]
 * (a Gumbel variable exceeds 16.64 with probability 6e-8).
 */
#ifndef DFLASH_SAMPLE_H
#define DFLASH_SAMPLE_H

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define DFL_HOST_DEVICE __host__ __device__
#else
#define DFL_HOST_DEVICE
#endif

/* splitmix64's finaliser (Steele, Lea, Flood 2014): a bijection of 64-bit
 * words whose outputs pass BigCrush for counter inputs. */
DFL_HOST_DEVICE static inline uint64_t dfl_mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The key of one sequence: a seed and the sequence's number. */
DFL_HOST_DEVICE static inline uint64_t dfl_sample_seq_key(uint64_t seed, uint64_t seq) {
    return dfl_mix64(dfl_mix64(seed) ^ (seq * 0xD1B54A32D192ED03ull));
}

/* The key of the draw of the token at position pos of a sequence. */
DFL_HOST_DEVICE static inline uint64_t dfl_sample_key(uint64_t seq_key, int64_t pos) {
    return dfl_mix64(seq_key ^ dfl_mix64((uint64_t)pos));
}

/* Standard Gumbel noise of vocabulary entry v under a draw's key. */
DFL_HOST_DEVICE static inline float dfl_gumbel(uint64_t key, int64_t v) {
    uint64_t x = dfl_mix64(key + (uint64_t)v * 0x9E3779B97F4A7C15ull);
    float u = ((float)(x >> 41) + 0.5f) * 0x1p-23f;
    return -logf(-logf(u));
}

/* ---- top-k and top-p (nucleus) filtering ----------------------------------
 *
 * With the scaled logits s_v = z_v (1/T), a row keeps the tokens whose
 * s_v is at least a cut, and draws among them (Gumbel-max over the kept):
 *   top-k (k >= 1): the cut is the k-th largest s;
 *   top-p (0 < p < 1), within the top-k set: the cut is the largest value u
 *   such that the tokens with s >= u hold at least p of the top-k set's
 *   softmax mass.
 * Tokens tied with the cut are all kept (transformers' sort would break the
 * tie by index). The mass is counted in fixed point, exp(s - max) 2^32
 * truncated, so that every sum is an exact integer: the cut is the same
 * whatever the order of summation, on any thread count or backend. Both
 * cuts are "the largest u with F(u) >= target" for a non-increasing F(u) =
 * sum over v with key(s_v) >= u of a weight (1, or the mass), on the
 * order-preserving integer key of the float. */
typedef struct {
    float   temperature; /* > 0 */
    int32_t top_k;       /* 0: off */
    float   top_p;       /* 0 or 1: off */
} dfl_sampling;

DFL_HOST_DEVICE static inline int dfl_sampling_filters(const dfl_sampling *s) {
    return s->top_k > 0 || (s->top_p > 0 && s->top_p < 1);
}

/* A finite float's order-preserving key: x < y exactly when key(x) < key(y). */
DFL_HOST_DEVICE static inline uint32_t dfl_float_key(float x) {
    union {
        float f;
        uint32_t u;
    } b = {x};
    return (b.u & 0x80000000u) ? ~b.u : (b.u | 0x80000000u);
}

/* A token's top-p mass in fixed point: exp(s - max) 2^32, truncated. */
DFL_HOST_DEVICE static inline uint64_t dfl_top_p_mass(float s, float max) {
    return (uint64_t)(expf(s - max) * 4294967296.0f);
}

/* The top-p target: p of the top-k set's mass Q, rounded up (at least 1). */
DFL_HOST_DEVICE static inline uint64_t dfl_top_p_target(float p, uint64_t Q) {
    uint64_t t = (uint64_t)ceil((double)p * (double)Q);
    return t ? t : 1;
}

#endif
