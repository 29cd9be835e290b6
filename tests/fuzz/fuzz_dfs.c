/* fuzz_dfs.c: libFuzzer target for the DFS stream reader.
 *
 * Reads the input as a stream, decodes every tensor, and runs the
 * hidden-state checks when the meta announces a hidden-state stream; then
 * reads it again as training and scoring do (dfl_record_read: checks,
 * decoding, buffers taken from the reader and reused): the paths a consumer
 * of untrusted streams takes. `make fuzz` builds it with
 * -fsanitize=fuzzer; tests/unit/test_fuzz_dfs.c replays the committed corpus
 * through the same entry point in `make check`.
 */
#include "common.h"
#include "dfs.h"
#include "records.h"

#include <stdint.h>
#include <stdio.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static FILE *open_bytes(const uint8_t *data, size_t size) {
    return size ? fmemopen((void *)data, size, "rb") : fopen("/dev/null", "rb");
}

/* The records as dflash-train-step and dflash-score take them. */
static void read_as_training(const uint8_t *data, size_t size) {
    FILE *f = open_bytes(data, size);
    if (!f) return;
    dfs_reader *r;
    dfs_hs_meta hs;
    if (dfs_reader_open_stream(&r, f, "fuzz") == 0) {
        if (json_object_get(dfs_reader_meta(r), "target") && dfs_hs_meta_from_json(dfs_reader_meta(r), &hs, "fuzz") == 0) {
            dfl_record o = {0};
            while (dfl_record_read(r, &hs, "fuzz", hs.has_target_ids, hs.has_last_hidden, &o) == 1)
                for (int64_t i = 0; i < o.q.T; i++) /* what a record promises its users */
                    DFL_ASSERT(o.q.ids[i] >= 0 && o.q.ids[i] < hs.vocab_size && o.q.loss_mask[i] <= 1 &&
                               (!o.q.target_ids || (o.q.target_ids[i] >= 0 && o.q.target_ids[i] < hs.vocab_size)));
            dfl_record_free(&o);
        }
        dfs_reader_close(r);
    }
    fclose(f);
}

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
    read_as_training(data, size);
    return 0;
}
