/* fuzz_anchors: dflash-score --anchors-from (dfl_score_load_anchors) on
 * arbitrary bytes. The loader takes a path, so each input is written to a
 * memfd opened as /proc/self/fd/N. Every input must give success or
 * DFL_EX_DATA. After a success the map is an object of id -> list of
 * integer positions in [0, 2^24), one entry per non-blank line.
 */
#include "common.h"
#include "score.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(c)                                                            \
    do {                                                                    \
        if (!(c)) {                                                         \
            fprintf(stderr, "fuzz_anchors: invariant failed: %s\n", #c);    \
            abort();                                                        \
        }                                                                   \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int fd = memfd_create("fuzz_anchors", 0);
    if (fd < 0) abort();
    if (size && write(fd, data, size) != (ssize_t)size) abort();
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    json_t *map = NULL;
    int rc = dfl_score_load_anchors(path, &map);
    if (rc == 0) {
        CHECK(json_is_object(map));
        /* at most one entry per line */
        size_t lines = 1;
        for (size_t i = 0; i < size; i++) lines += data[i] == '\n';
        CHECK(json_object_size(map) <= lines);
        const char *id;
        json_t *arr;
        json_object_foreach(map, id, arr) {
            CHECK(json_is_array(arr));
            size_t i;
            json_t *v;
            json_array_foreach(arr, i, v) {
                CHECK(json_is_integer(v) && json_integer_value(v) >= 0 && json_integer_value(v) < (INT64_C(1) << 24));
            }
        }
        json_decref(map);
    } else {
        CHECK(rc == DFL_EX_DATA && map == NULL);
    }
    close(fd);
    return 0;
}
