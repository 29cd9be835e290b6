/* checkpoint.c: writing and reading drafter checkpoint directories. */
#include "checkpoint.h"

#include "common.h"
#include "outfile.h"
#include "safetensors.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define STATE_FORMAT "dflash-trainer-state"

static void join(char *buf, size_t n, const char *dir, const char *name) { snprintf(buf, n, "%s/%s", dir, name); }

/* config.json: written with 15 significant digits, so 1e-06 stays 1e-6,
 * and a trailing newline, as Python's writers leave it. A failed write (a
 * full disk) is an I/O error (74), like the tensors'; only the open is 73. */
static int write_json(const char *path, const json_t *j, size_t flags) {
    FILE *f = fopen(path, "w");
    if (!f) return dfl_err(DFL_EX_CANTCREAT, "%s: cannot create: %s", path, strerror(errno));
    int bad = json_dumpf(j, f, flags | JSON_INDENT(2)) != 0 || fputc('\n', f) == EOF || fflush(f) != 0;
    int err = errno;
    if (fclose(f) != 0 && !bad) bad = 1, err = errno;
    if (bad) return dfl_err(DFL_EX_IOERR, "%s: write failed: %s", path, strerror(err));
    return 0;
}

static int write_model(const char *path, const dfl_drafter *d, const float *master) {
    int n = d->ntensors;
    dfl_st_in *in = dfl_calloc((size_t)n, sizeof *in);
    uint16_t *bf = dfl_malloc((size_t)d->nparams * 2);
    for (int64_t i = 0; i < d->nparams; i++) bf[i] = dfl_f32_to_bf16(master[i]);
    for (int t = 0; t < n; t++) {
        const dfl_param_info *p = &d->info[t];
        in[t].name = p->name;
        in[t].dtype = DFL_BF16;
        in[t].ndim = p->ndim;
        in[t].shape[0] = p->shape[0];
        in[t].shape[1] = p->shape[1];
        in[t].data = bf + p->offset;
    }
    json_t *meta = json_pack("{ss}", "format", "pt");
    int rc = dfl_st_write(path, in, n, meta);
    json_decref(meta);
    free(bf);
    free(in);
    return rc;
}

static int write_state_tensors(const char *path, const dfl_drafter *d, const float *master) {
    const dfl_ops *ops = d->ops;
    size_t bytes = (size_t)d->nparams * 4;
    float *m = dfl_malloc(bytes), *v = dfl_malloc(bytes);
    ops->download(m, d->m, bytes);
    ops->download(v, d->v, bytes);
    dfl_st_in in[3] = {
        {"master", DFL_F32, 1, {d->nparams}, master},
        {"adam_m", DFL_F32, 1, {d->nparams}, m},
        {"adam_v", DFL_F32, 1, {d->nparams}, v},
    };
    char np[32];
    snprintf(np, sizeof np, "%lld", (long long)d->nparams);
    json_t *meta = json_pack("{ssss}", "format", STATE_FORMAT, "nparams", np);
    int rc = dfl_st_write(path, in, 3, meta);
    json_decref(meta);
    free(m);
    free(v);
    return rc;
}

static const char *const ckpt_files[] = {"config.json", "model.safetensors", "trainer_state.safetensors",
                                         "trainer_state.json", NULL};

int dfl_ckpt_check_out(const char *dir) { return dfl_tmpdir_check(dir, ckpt_files); }

int dfl_ckpt_save(const char *dir, const dfl_drafter *d, const json_t *state) {
    char tmp[4096], path[4200];
    int rc = dfl_tmpdir_create(dir, tmp, sizeof tmp);
    if (rc) return rc;
    float *master = dfl_malloc((size_t)d->nparams * 4);
    dfl_drafter_get_master(d, master);
    json_t *cfg = dfl_drafter_config_json(&d->cfg);
    join(path, sizeof path, tmp, "config.json");
    rc = write_json(path, cfg, JSON_REAL_PRECISION(15));
    json_decref(cfg);
    if (!rc) {
        join(path, sizeof path, tmp, "model.safetensors");
        rc = write_model(path, d, master);
    }
    if (!rc && state) {
        join(path, sizeof path, tmp, "trainer_state.safetensors");
        rc = write_state_tensors(path, d, master);
        if (!rc) {
            join(path, sizeof path, tmp, "trainer_state.json");
            rc = write_json(path, state, JSON_REAL_PRECISION(17));
        }
    }
    free(master);
    if (!rc) rc = dfl_tmpdir_commit(tmp, dir, ckpt_files);
    else {
        rc = dfl_tmpdir_name_err(rc, tmp, dir);
        dfl_tmpdir_abort(tmp);
    }
    return rc;
}

int dfl_ckpt_load_config(const char *dir, dfl_drafter_config *c) {
    char path[4200];
    struct stat sb;
    if (stat(dir, &sb) != 0) return dfl_err(DFL_EX_NOINPUT, "%s: cannot open: %s", dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode)) return dfl_err(DFL_EX_NOINPUT, "%s: not a checkpoint directory", dir);
    join(path, sizeof path, dir, "config.json");
    return dfl_drafter_config_load(c, path);
}

int dfl_ckpt_has_state(const char *dir) {
    char path[4200];
    join(path, sizeof path, dir, "trainer_state.json");
    return access(path, F_OK) == 0;
}

/* Tensors a speculators-format checkpoint adds; not ours, skipped. */
static int foreign_tensor(const char *name) {
    static const char *names[] = {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i])) return 1;
    return 0;
}

/* model.safetensors's tensors against the drafter's (info[n]): each present
 * once with its shape, none unknown. Reads the header only; with `master`
 * ([nparams] f32) also converts the weights into it. */
static int match_weights(const dfl_st *st, const char *path, const dfl_param_info *info, int n, float *master) {
    int rc = 0;
    uint8_t *seen = dfl_calloc((size_t)n, 1);
    for (int i = 0; i < dfl_st_count(st) && !rc; i++) {
        const dfl_st_tensor *t = dfl_st_at(st, i);
        const char *name = strncmp(t->name, "model.", 6) ? t->name : t->name + 6;
        int k = -1;
        for (int j = 0; j < n; j++)
            if (!strcmp(info[j].name, name)) k = j;
        if (k < 0) {
            if (!foreign_tensor(name)) rc = dfl_err(DFL_EX_DATA, "%s: tensor \"%s\" is not a drafter tensor", path, t->name);
            continue;
        }
        if (seen[k]) {
            rc = dfl_err(DFL_EX_DATA, "%s: tensor \"%s\" appears twice (with and without \"model.\")", path, name);
            break;
        }
        const dfl_st_tensor *got;
        rc = dfl_st_get(st, t->name, info[k].ndim, info[k].shape, &got);
        if (rc) break;
        if (master) dfl_st_to_f32(got, master + info[k].offset);
        seen[k] = 1;
    }
    for (int j = 0; j < n && !rc; j++)
        if (!seen[j]) rc = dfl_err(DFL_EX_DATA, "%s: tensor \"%s\" is missing", path, info[j].name);
    free(seen);
    return rc;
}

/* The drafter's tensor table for config c (info[*n], owned by the caller). */
static dfl_param_info *param_table(const dfl_drafter_config *c, int *n, int64_t *nparams) {
    *n = dfl_drafter_params(c, NULL);
    dfl_param_info *info = dfl_calloc((size_t)*n, sizeof *info);
    dfl_drafter_params(c, info);
    *nparams = info[*n - 1].offset + info[*n - 1].numel;
    return info;
}

int dfl_ckpt_check_weights(const char *dir, const dfl_drafter_config *c) {
    char path[4200];
    join(path, sizeof path, dir, "model.safetensors");
    dfl_st *st;
    int rc = dfl_st_open(&st, path);
    if (rc) return rc;
    int n;
    int64_t np;
    dfl_param_info *info = param_table(c, &n, &np);
    rc = match_weights(st, path, info, n, NULL);
    free(info);
    dfl_st_close(st);
    return rc;
}

int dfl_ckpt_load_weights(const char *dir, dfl_drafter *d) {
    char path[4200];
    join(path, sizeof path, dir, "model.safetensors");
    dfl_st *st;
    int rc = dfl_st_open(&st, path);
    if (rc) return rc;
    float *master = dfl_malloc((size_t)d->nparams * 4);
    rc = match_weights(st, path, d->info, d->ntensors, master);
    if (!rc) dfl_drafter_set_master(d, master);
    free(master);
    dfl_st_close(st);
    return rc;
}

static const char *const state_names[3] = {"master", "adam_m", "adam_v"};

/* The trainer state of DIR for a drafter of nparams parameters: the JSON
 * (its "format" checked) in *state and trainer_state.safetensors in *st,
 * whose tensors state_names[i] (in tensor[i]) are F32 [nparams]. Reads
 * headers only. On error nothing is left open. */
static int open_state(const char *dir, int64_t nparams, json_t **state, dfl_st **st, const dfl_st_tensor *tensor[3]) {
    char path[4200];
    *state = NULL;
    *st = NULL;
    join(path, sizeof path, dir, "trainer_state.json");
    if (access(path, F_OK) != 0)
        return dfl_err(DFL_EX_NOINPUT, "%s: no trainer state (a model-only checkpoint: use --init-from)", dir);
    json_t *j;
    int rc = dfl_load_json(path, DFL_JSON_FILE_MAX, "trainer_state.json", &j);
    if (rc) return rc;
    const char *fmt = json_string_value(json_object_get(j, "format"));
    if (!json_is_object(j) || !fmt || strcmp(fmt, STATE_FORMAT)) {
        json_decref(j);
        return dfl_err(DFL_EX_DATA, "%s: \"format\" is not \"%s\"", path, STATE_FORMAT);
    }
    join(path, sizeof path, dir, "trainer_state.safetensors");
    rc = dfl_st_open(st, path);
    int64_t shape[1] = {nparams};
    for (int i = 0; i < 3 && !rc; i++) {
        rc = dfl_st_get(*st, state_names[i], 1, shape, &tensor[i]);
        if (!rc && tensor[i]->dtype != DFL_F32) rc = dfl_err(DFL_EX_DATA, "%s: tensor \"%s\" is not F32", path, state_names[i]);
    }
    if (rc) {
        if (*st) dfl_st_close(*st);
        *st = NULL;
        json_decref(j);
        return rc;
    }
    *state = j;
    return 0;
}

int dfl_ckpt_check_state(const char *dir, const dfl_drafter_config *c) {
    int n;
    int64_t np;
    free(param_table(c, &n, &np));
    json_t *j;
    dfl_st *st;
    const dfl_st_tensor *t[3];
    int rc = open_state(dir, np, &j, &st, t);
    if (rc) return rc;
    dfl_st_close(st);
    json_decref(j);
    return 0;
}

int dfl_ckpt_load_state(const char *dir, dfl_drafter *d, json_t **state) {
    dfl_st *st;
    const dfl_st_tensor *t[3];
    int rc = open_state(dir, d->nparams, state, &st, t);
    if (rc) return rc;
    float *dst[3] = {d->master, d->m, d->v};
    for (int i = 0; i < 3; i++) {
        float *host = dfl_malloc((size_t)d->nparams * 4);
        memcpy(host, t[i]->data, (size_t)d->nparams * 4);
        d->ops->upload(dst[i], host, (size_t)d->nparams * 4);
        free(host);
    }
    dfl_st_close(st);
    dfl_drafter_sync_weights(d);
    return 0;
}
