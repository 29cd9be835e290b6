/* rng.c: xoshiro256** (Blackman & Vigna), seeded by splitmix64. */
#include "rng.h"

#include <math.h>

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void dfl_rng_seed(dfl_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t dfl_rng_u64(dfl_rng *r) {
    uint64_t *s = r->s, result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

uint64_t dfl_rng_below(dfl_rng *r, uint64_t n) {
    __uint128_t m = (__uint128_t)dfl_rng_u64(r) * n;
    uint64_t lo = (uint64_t)m;
    if (lo < n) {
        uint64_t threshold = -n % n;
        while (lo < threshold) {
            m = (__uint128_t)dfl_rng_u64(r) * n;
            lo = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

double dfl_rng_uniform(dfl_rng *r) { return (double)(dfl_rng_u64(r) >> 11) * 0x1.0p-53; }

double dfl_rng_normal(dfl_rng *r) {
    double u1 = dfl_rng_uniform(r), u2 = dfl_rng_uniform(r);
    if (u1 < 0x1.0p-60) u1 = 0x1.0p-60; /* log(0) guard */
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
