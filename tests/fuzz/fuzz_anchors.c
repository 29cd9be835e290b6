/* fuzz_anchors: dflash-score --anchors-from (dfl_score_load_anchors) on
 * arbitrary bytes. The loader takes a path, so each input is written to a
 * memfd opened as /proc/self/fd/N. Every input must give success or
 * DFL_EX_DATA. After a success the map is an object of id -> list of
 * integer positions in [0, 2^24), one entry per non-blank line.
 */
#include "common.h"
#include "fuzz_util.h"
#include "score.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char path[64];
    int fd = fuzz_memfd("fuzz_anchors", data, size, path, sizeof path);
    json_t *map = NULL;
    int rc = dfl_score_load_anchors(path, &map);
    if (rc == 0) {
        FUZZ_CHECK(json_is_object(map));
        /* at most one entry per line */
        size_t lines = 1;
        for (size_t i = 0; i < size; i++) lines += data[i] == '\n';
        FUZZ_CHECK(json_object_size(map) <= lines);
        const char *id;
        json_t *arr;
        json_object_foreach(map, id, arr) {
            FUZZ_CHECK(json_is_array(arr));
            size_t i;
            json_t *v;
            json_array_foreach(arr, i, v) {
                FUZZ_CHECK(json_is_integer(v) && json_integer_value(v) >= 0 && json_integer_value(v) < (INT64_C(1) << 24));
                /* strictly increasing, as scoring takes them */
                FUZZ_CHECK(i == 0 || json_integer_value(v) > json_integer_value(json_array_get(arr, i - 1)));
            }
        }
        json_decref(map);
    } else {
        FUZZ_CHECK(rc == DFL_EX_DATA && map == NULL);
    }
    close(fd);
    return 0;
}
