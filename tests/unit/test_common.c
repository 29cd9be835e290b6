/* test_common.c: number formats, parsing and the RNG. */
#include "common.h"
#include "rng.h"
#include "test.h"

static void test_bf16_round_trip(void) {
    /* Every bf16 bit pattern that is not NaN survives f32 and back. */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = dfl_bf16_to_f32((uint16_t)h);
        if (isnan(f)) continue;
        T_CHECKF(dfl_f32_to_bf16(f) == h, "0x%04x", h);
    }
}

static void test_bf16_rounds_to_nearest_even(void) {
    T_CHECK(dfl_f32_to_bf16(1.0f) == 0x3f80);
    /* 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to even (1.0). */
    T_CHECK(dfl_f32_to_bf16(1.00390625f) == 0x3f80);
    /* 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6: up to even. */
    T_CHECK(dfl_f32_to_bf16(1.01171875f) == 0x3f82);
    T_CHECK(dfl_f32_to_bf16(NAN) == 0x7fc0);
}

static void test_f16_round_trip(void) {
    for (uint32_t h = 0; h < 65536; h++) {
        float f = dfl_f16_to_f32((uint16_t)h);
        if (isnan(f)) continue;
        T_CHECKF(dfl_f32_to_f16(f) == h, "0x%04x -> %g -> 0x%04x", h, f, dfl_f32_to_f16(f));
    }
    T_CHECK(dfl_f16_to_f32(0x3c00) == 1.0f);
    T_CHECK(dfl_f32_to_f16(65520.0f) == 0x7c00); /* rounds to inf */
}

static void test_parse_size(void) {
    uint64_t v;
    T_CHECK(dfl_parse_size("512M", &v) == 0 && v == 512ull << 20);
    T_CHECK(dfl_parse_size("1GiB", &v) == 0 && v == 1ull << 30);
    T_CHECK(dfl_parse_size("64k", &v) == 0 && v == 65536);
    T_CHECK(dfl_parse_size("100", &v) == 0 && v == 100);
    T_CHECK(dfl_parse_size("12X", &v) != 0);
    T_CHECK(dfl_parse_size("-1", &v) != 0);
    T_CHECK(dfl_parse_size("", &v) != 0);
}

/* The sizes of the out-of-memory message: bytes below 1 KiB, then one
 * decimal in the largest binary unit that keeps the number >= 1. */
static void test_human_bytes(void) {
    static const struct {
        double n;
        const char *s;
    } cases[] = {{0, "0 bytes"},          {100, "100 bytes"},          {1023, "1023 bytes"},
                 {1024, "1.0 KiB"},       {1536, "1.5 KiB"},           {67108864, "64.0 MiB"},
                 {1610612736, "1.5 GiB"}, {1099511627776.0, "1.0 TiB"}, {1152921504606846976.0, "1024.0 PiB"}};
    char buf[32];
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        T_CHECKF(!strcmp(dfl_human_bytes(buf, cases[i].n), cases[i].s), "%.0f bytes: '%s', want '%s'", cases[i].n,
                 buf, cases[i].s);
}

static void test_rng_deterministic_and_uniform(void) {
    dfl_rng a, b;
    dfl_rng_seed(&a, 42);
    dfl_rng_seed(&b, 42);
    for (int i = 0; i < 1000; i++) T_CHECK(dfl_rng_u64(&a) == dfl_rng_u64(&b));
    /* chi-square of 100000 draws over 10 bins: 99.9% quantile (9 dof) is 27.9 */
    int bins[10] = {0};
    for (int i = 0; i < 100000; i++) bins[dfl_rng_below(&a, 10)]++;
    double chi = 0;
    for (int i = 0; i < 10; i++) chi += (bins[i] - 10000.0) * (bins[i] - 10000.0) / 10000.0;
    T_CHECKF(chi < 27.9, "chi2 %.2f", chi);
    double s = 0, s2 = 0;
    for (int i = 0; i < 100000; i++) {
        double x = dfl_rng_normal(&a);
        s += x;
        s2 += x * x;
    }
    T_CHECK(fabs(s / 1e5) < 0.02 && fabs(s2 / 1e5 - 1) < 0.03);
}

int main(void) {
    T_RUN(test_bf16_round_trip);
    T_RUN(test_bf16_rounds_to_nearest_even);
    T_RUN(test_f16_round_trip);
    T_RUN(test_parse_size);
    T_RUN(test_human_bytes);
    T_RUN(test_rng_deterministic_and_uniform);
    return t_exit();
}
