/* replay.h: run a fuzz target's committed corpus through its entry point
 * without libFuzzer, so `make check` (and its ASan build) exercises every
 * corpus file. A unit test includes the target's .c file, then this, and
 * calls fuzz_replay("tests/fuzz/corpus/NAME"); it returns the number of
 * files replayed (a crash fails the test by itself). */
#ifndef DFLASH_FUZZ_REPLAY_H
#define DFLASH_FUZZ_REPLAY_H

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int fuzz_replay(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "rb");
        if (!f) continue;
        uint8_t *buf = NULL;
        size_t len = 0, cap = 0, k;
        do {
            if (len == cap) buf = realloc(buf, cap = cap ? 2 * cap : 65536);
            k = fread(buf + len, 1, cap - len, f);
            len += k;
        } while (k);
        fclose(f);
        LLVMFuzzerTestOneInput(buf, len);
        free(buf);
        n++;
    }
    closedir(d);
    return n;
}

#endif
