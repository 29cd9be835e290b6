/* rng.h: the one random number generator of dflash (xoshiro256**).
 *
 * Everything random (anchors, shuffles, noise, initial weights) draws from
 * a dfl_rng seeded by --seed, so the same seed, data and options give the
 * same result bit for bit. The state is four words, saved in checkpoints.
 */
#ifndef DFLASH_RNG_H
#define DFLASH_RNG_H

#include <stdint.h>

typedef struct {
    uint64_t s[4];
} dfl_rng;

/* Seed through splitmix64, so nearby seeds give unrelated streams. */
void dfl_rng_seed(dfl_rng *r, uint64_t seed);
uint64_t dfl_rng_u64(dfl_rng *r);
/* Uniform integer in [0, n), unbiased (Lemire's method); n > 0. */
uint64_t dfl_rng_below(dfl_rng *r, uint64_t n);
/* Uniform double in [0, 1) with 53 random bits. */
double dfl_rng_uniform(dfl_rng *r);
/* Standard normal (Box-Muller on two uniforms; no cached second value, so
 * the state alone determines the sequence). */
double dfl_rng_normal(dfl_rng *r);

#endif
