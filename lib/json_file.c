/* json_file.c: dfl_load_json (common.h), apart from common.c so that what
 * links common.c alone (the GPU run's wgmma probe) needs no jansson. */
#include "common.h"

#include <jansson.h>
#include <stdlib.h>

int dfl_load_json(const char *path, size_t max, const char *what, json_t **out) {
    *out = NULL;
    char *text;
    size_t len;
    int rc = dfl_read_file(path, max, what, &text, &len);
    if (rc) return rc;
    json_error_t je;
    *out = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    free(text);
    if (!*out) return dfl_err(DFL_EX_DATA, "%s: not JSON: %s (line %d)", path, je.text, je.line);
    return 0;
}
