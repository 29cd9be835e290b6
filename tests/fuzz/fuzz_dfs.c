/* fuzz_dfs.c: libFuzzer target for the DFS stream reader.
 *
 * Reads the input as a stream, decodes every tensor, and runs the
 * hidden-state checks when the meta announces a hidden-state stream: the
 * paths a consumer of untrusted streams takes. `make fuzz` builds it with
 * -fsanitize=fuzzer; tests/unit/test_fuzz_dfs.c replays the committed corpus
 * through the same entry point in `make check`.
 */
#include "common.h"
#include "dfs.h"

#include <stdint.h>
#include <stdio.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    FILE *f = size ? fmemopen((void *)data, size, "rb") : fopen("/dev/null", "rb");
    if (!f) return 0;
    dfs_reader *r;
    if (dfs_reader_open_stream(&r, f, "fuzz") == 0) {
        dfs_hs_meta hs;
        int is_hs = json_object_get(dfs_reader_meta(r), "target") &&
                    dfs_hs_meta_from_json(dfs_reader_meta(r), &hs, "fuzz") == 0;
        dfs_sample *s;
        while (dfs_read(r, &s) == 1) {
            int bad = 0;
            for (int i = 0; i < s->ntensors && !bad; i++) bad = dfs_decode(r, &s->t[i]);
            if (!bad && is_hs) dfs_hs_check_sample(&hs, s, "fuzz");
        }
        dfs_reader_close(r);
    }
    fclose(f);
    return 0;
}
