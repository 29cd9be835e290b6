/* fuzz_jsonl: the tokenized-sample line parser on arbitrary bytes. Every
 * input must give a sample or DFL_EX_DATA, never a crash or a leak. */
#include "common.h"
#include "jsonl.h"

#include <stdint.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    dfl_jsonl_sample s;
    int rc = dfl_jsonl_parse(&s, (const char *)data, size, 1000, "fuzz", 1);
    if (rc == 0) {
        for (int64_t i = 0; i < s.n; i++)
            if (s.input_ids[i] < 0 || s.input_ids[i] >= 1000 || s.loss_mask[i] > 1) abort();
        dfl_jsonl_sample_free(&s);
    } else if (rc != DFL_EX_DATA) {
        abort();
    }
    return 0;
}
