/* fuzz_trainer_state: trainer_state.json, read on --resume, on arbitrary
 * bytes.
 *
 * The input is parsed the way dfl_ckpt_load_state reads the file (jansson,
 * duplicate keys refused, "format" checked), then dfl_trainer_restore takes
 * step, RNG state and seed from it against a target config whose digest is
 * "0123456789abcdef". Every input must give success or DFL_EX_DATA. After a
 * success: the step is the file's count, in [0, 2^53], each RNG word is the
 * file's 16 hex digits exactly (nothing strtoull would also accept: signs,
 * spaces, "0x"), the state is not all zero (xoshiro256** would then give
 * zeros forever), and the seed, when given, is the file's decimal number
 * (digits only, below 2^64).
 */
#include "common.h"
#include "fuzz_util.h"
#include "model_config.h"
#include "trainer.h"

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    json_error_t je;
    json_t *j = json_loadb((const char *)data, size, JSON_REJECT_DUPLICATES, &je);
    const char *fmt = json_string_value(json_object_get(j, "format"));
    if (!json_is_object(j) || !fmt || strcmp(fmt, "dflash-trainer-state")) {
        json_decref(j);
        return 0;
    }
    dfl_model_config tcfg;
    memset(&tcfg, 0, sizeof tcfg);
    snprintf(tcfg.digest, sizeof tcfg.digest, "0123456789abcdef");
    dfl_trainer t;
    memset(&t, 0, sizeof t);
    t.tcfg = &tcfg;
    t.seed = 7;
    int rc = dfl_trainer_restore(&t, j, "fuzz");
    if (rc == 0) {
        json_t *step = json_object_get(j, "step");
        FUZZ_CHECK(json_is_integer(step) && t.step == json_integer_value(step) && t.step >= 0 &&
                   t.step <= DFL_TRAIN_MAX_STEPS);
        uint64_t any = 0;
        for (int i = 0; i < 4; i++) {
            char hex[32];
            snprintf(hex, sizeof hex, "%016" PRIx64, t.rng.s[i]);
            const char *h = json_string_value(json_array_get(json_object_get(j, "rng"), (size_t)i));
            FUZZ_CHECK(h && !strcasecmp(hex, h));
            any |= t.rng.s[i];
        }
        FUZZ_CHECK(any != 0);
        const char *seed = json_string_value(json_object_get(j, "seed"));
        if (seed) { /* decimal digits only, read here independently */
            uint64_t v = 0;
            FUZZ_CHECK(*seed);
            for (const char *c = seed; *c; c++) {
                FUZZ_CHECK(*c >= '0' && *c <= '9');
                FUZZ_CHECK(!__builtin_mul_overflow(v, 10, &v) && !__builtin_add_overflow(v, (uint64_t)(*c - '0'), &v));
            }
            FUZZ_CHECK(t.seed == v);
        } else {
            FUZZ_CHECK(t.seed == 7);
        }
    } else {
        FUZZ_CHECK(rc == DFL_EX_DATA);
    }
    json_decref(j);
    return 0;
}
