/* cli.c: table-driven option parser, --help, man-page OPTIONS and progress. */
#include "cli.h"

#include "common.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const dfl_opt builtin_help = {"help", 'h', DFL_OPT_FLAG, NULL, NULL,
                                     "Print this help to stdout and exit 0.", NULL};
static const dfl_opt builtin_version = {"version", 'V', DFL_OPT_FLAG, NULL, NULL,
                                        "Print the version and exit 0.", NULL};

void dfl_cli_usage_error(const dfl_cli *cli, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", cli->prog);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\nTry '%s --help' for more information.\n", cli->prog);
    exit(DFL_EX_USAGE);
}

/* The default as the user should read it, from the table or the variable. */
static const char *default_text(const dfl_opt *o, char *buf, size_t n) {
    if (o->defval) return o->defval[0] ? o->defval : NULL;
    if (!o->dest) return NULL;
    switch (o->type) {
    case DFL_OPT_STR:
    case DFL_OPT_CHOICE: return *(const char **)o->dest;
    case DFL_OPT_INT: snprintf(buf, n, "%lld", (long long)*(int64_t *)o->dest); return buf;
    case DFL_OPT_DOUBLE: snprintf(buf, n, "%g", *(double *)o->dest); return buf;
    case DFL_OPT_SIZE: snprintf(buf, n, "%llu", (unsigned long long)*(uint64_t *)o->dest); return buf;
    default: return NULL;
    }
}

static void format_names(const dfl_opt *o, char *buf, size_t n) {
    const char *arg = o->type == DFL_OPT_FLAG ? NULL : (o->arg ? o->arg : "ARG");
    int k = 0;
    if (o->short_name) k = snprintf(buf, n, "-%c, ", o->short_name);
    else k = snprintf(buf, n, "    ");
    snprintf(buf + k, n - (size_t)k, "--%s%s%s", o->name, arg ? " " : "", arg ? arg : "");
}

static void help_line(const dfl_opt *o, FILE *f) {
    char names[128], dbuf[64];
    format_names(o, names, sizeof names);
    const char *d = default_text(o, dbuf, sizeof dbuf);
    if (strlen(names) > 26) fprintf(f, "  %s\n  %-26s  ", names, "");
    else fprintf(f, "  %-26s  ", names);
    fprintf(f, "%s", o->help);
    if (d) fprintf(f, " (default: %s)", d);
    if (o->type == DFL_OPT_LIST) fprintf(f, " [repeatable]");
    fputc('\n', f);
}

static int has_option(const dfl_cli *cli, const char *name) {
    for (const dfl_opt *o = cli->opts; o->name; o++)
        if (!strcmp(o->name, name)) return 1;
    return 0;
}

/* The codes this tool can give: 69 comes only from choosing a device
 * (--device cuda without one), so a tool without --device never exits 69.
 * A signal ends a tool as it ends cat: 128+N is the shell's number. */
static void exit_status_help(const dfl_cli *cli, FILE *f) {
    fprintf(f, "\nexit status: 0 ok, 1 (reserved), 2 usage, 65 bad input data, 66 cannot open input,\n%s70 internal error, "
               "73 cannot create output, 74 I/O error;\nkilled by signal N: 128+N, e.g. 130 for Ctrl-C (temporary outputs "
               "removed first), 141 for a closed pipe (the same).\n",
            has_option(cli, "device") ? "69 no CUDA device, " : "");
}

void dfl_cli_help(const dfl_cli *cli, FILE *f) {
    fprintf(f, "%s - %s\n\nusage:", cli->prog, cli->summary);
    const char *s = cli->synopsis;
    while (s && *s) {
        const char *nl = strchr(s, '\n');
        size_t len = nl ? (size_t)(nl - s) : strlen(s);
        fprintf(f, "\n  %s %.*s", cli->prog, (int)len, s);
        s = nl ? nl + 1 : NULL;
    }
    fprintf(f, "\n\noptions:\n");
    for (const dfl_opt *o = cli->opts; o->name; o++) help_line(o, f);
    help_line(&builtin_help, f);
    help_line(&builtin_version, f);
    exit_status_help(cli, f);
    fprintf(f, "See man %s.\n", cli->prog);
}

/* scdoc needs '*', '_' and '\' escaped in running text. */
static void scd_text(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '*' || *s == '_' || *s == '\\') fputc('\\', f);
        fputc(*s, f);
    }
}

static void scd_option(const dfl_opt *o, FILE *f) {
    char dbuf[64];
    const char *d = default_text(o, dbuf, sizeof dbuf);
    const char *arg = o->type == DFL_OPT_FLAG ? NULL : (o->arg ? o->arg : "ARG");
    if (o->short_name) fprintf(f, "*-%c*, ", o->short_name);
    fprintf(f, "*--%s*", o->name);
    if (arg) {
        fputs(" _", f);
        scd_text(f, arg);
        fputc('_', f);
    }
    fputs("\n\t", f);
    scd_text(f, o->help);
    if (d) {
        fputs(" Default: ", f);
        scd_text(f, d);
        fputc('.', f);
    }
    if (o->type == DFL_OPT_LIST) fputs(" May be given more than once.", f);
    fputs("\n\n", f);
}

void dfl_cli_scd_options(const dfl_cli *cli, FILE *f) {
    for (const dfl_opt *o = cli->opts; o->name; o++) scd_option(o, f);
    scd_option(&builtin_help, f);
    scd_option(&builtin_version, f);
}

static const dfl_opt *find_long(const dfl_cli *cli, const char *name, size_t len) {
    for (const dfl_opt *o = cli->opts; o->name; o++)
        if (strlen(o->name) == len && !strncmp(o->name, name, len)) return o;
    return NULL;
}

static const dfl_opt *find_short(const dfl_cli *cli, char c) {
    for (const dfl_opt *o = cli->opts; o->name; o++)
        if (o->short_name == c) return o;
    return NULL;
}

int dfl_cli_choice_ok(const char *choices, const char *v) {
    size_t n = strlen(v);
    for (const char *s = choices; s && *s;) {
        const char *bar = strchr(s, '|');
        size_t len = bar ? (size_t)(bar - s) : strlen(s);
        if (len == n && !strncmp(s, v, n)) return 1;
        s = bar ? bar + 1 : NULL;
    }
    return 0;
}

const char *dfl_cli_choices(const dfl_cli *cli, const char *name) {
    for (const dfl_opt *o = cli->opts; o->name; o++)
        if (o->type == DFL_OPT_CHOICE && !strcmp(o->name, name)) return o->arg;
    DFL_ASSERT(!"no such choice option");
    return NULL;
}

static void set_value(const dfl_cli *cli, const dfl_opt *o, const char *v) {
    switch (o->type) {
    case DFL_OPT_FLAG: *(int *)o->dest = 1; return;
    case DFL_OPT_STR: *(const char **)o->dest = v; return;
    case DFL_OPT_LIST: {
        dfl_strlist *l = o->dest;
        l->v = dfl_realloc(l->v, sizeof(char *) * (size_t)(l->n + 1));
        l->v[l->n++] = v;
        return;
    }
    case DFL_OPT_INT:
        if (dfl_parse_i64(v, o->dest)) dfl_cli_usage_error(cli, "--%s: '%s' is not an integer", o->name, v);
        return;
    case DFL_OPT_DOUBLE:
        if (dfl_parse_double(v, o->dest)) dfl_cli_usage_error(cli, "--%s: '%s' is not a number", o->name, v);
        return;
    case DFL_OPT_SIZE:
        if (dfl_parse_size(v, o->dest)) dfl_cli_usage_error(cli, "--%s: '%s' is not a size (e.g. 512M)", o->name, v);
        return;
    case DFL_OPT_CHOICE:
        if (!dfl_cli_choice_ok(o->arg, v)) dfl_cli_usage_error(cli, "--%s: '%s' is not one of %s", o->name, v, o->arg);
        *(const char **)o->dest = v;
        return;
    }
}

static void builtin(const dfl_cli *cli, const char *name) {
    if (!strcmp(name, "help")) {
        dfl_cli_help(cli, stdout);
    } else if (!strcmp(name, "version")) {
        printf("%s %s\n", cli->prog, DFLASH_VERSION);
    } else {
        dfl_cli_scd_options(cli, stdout);
    }
    int bad = fflush(stdout) != 0 || ferror(stdout);
    exit(bad ? DFL_EX_IOERR : DFL_EX_OK);
}

/* Long option at argv[*i]; consumes its value from the next argument if needed. */
static void parse_long(const dfl_cli *cli, int argc, char **argv, int *i) {
    const char *a = argv[*i] + 2, *eq = strchr(a, '=');
    size_t len = eq ? (size_t)(eq - a) : strlen(a);
    const dfl_opt *o = find_long(cli, a, len);
    if (!o) {
        if (!eq && (!strcmp(a, "help") || !strcmp(a, "version") || !strcmp(a, "help-scd"))) builtin(cli, a);
        dfl_cli_usage_error(cli, "unknown option '--%.*s'", (int)len, a);
    }
    if (o->type == DFL_OPT_FLAG) {
        if (eq) dfl_cli_usage_error(cli, "--%s takes no value", o->name);
        set_value(cli, o, NULL);
    } else if (eq) {
        set_value(cli, o, eq + 1);
    } else {
        if (*i + 1 >= argc) dfl_cli_usage_error(cli, "--%s needs a value (%s)", o->name, o->arg ? o->arg : "ARG");
        set_value(cli, o, argv[++*i]);
    }
}

static void parse_short(const dfl_cli *cli, int argc, char **argv, int *i) {
    const char *a = argv[*i] + 1;
    const dfl_opt *o = find_short(cli, a[0]);
    if (!o) {
        if (a[0] == 'h' && !a[1]) builtin(cli, "help");
        if (a[0] == 'V' && !a[1]) builtin(cli, "version");
        dfl_cli_usage_error(cli, "unknown option '-%c'", a[0]);
    }
    if (o->type == DFL_OPT_FLAG) {
        if (a[1]) dfl_cli_usage_error(cli, "-%c takes no value (write flags separately)", a[0]);
        set_value(cli, o, NULL);
    } else if (a[1]) {
        set_value(cli, o, a + 1);
    } else {
        if (*i + 1 >= argc) dfl_cli_usage_error(cli, "-%c needs a value (%s)", a[0], o->arg ? o->arg : "ARG");
        set_value(cli, o, argv[++*i]);
    }
}

int dfl_cli_parse(const dfl_cli *cli, int argc, char **argv, char ***pos) {
    dfl_stdin_reserve(); /* before any file is opened */
    char **out = dfl_calloc((size_t)argc + 1, sizeof(char *));
    int n = 0, only_pos = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (only_pos || a[0] != '-' || !a[1]) out[n++] = argv[i];
        else if (!strcmp(a, "--")) only_pos = 1;
        else if (a[1] == '-') parse_long(cli, argc, argv, &i);
        else parse_short(cli, argc, argv, &i);
    }
    *pos = out;
    return n;
}

void dfl_progress_init(dfl_progress *p, int force, double total, const char *unit) {
    p->enabled = force || isatty(STDERR_FILENO);
    p->start = p->last = dfl_now();
    p->total = total;
    p->unit = unit;
}

static void progress_draw(dfl_progress *p, double done, const char *extra, int final) {
    double now = dfl_now(), el = now - p->start, rate = el > 0 ? done / el : 0;
    fprintf(stderr, "\r%.0f %s  %.1f %s/s  %.0fs", done, p->unit, rate, p->unit, el);
    if (p->total > 0 && rate > 0 && !final)
        fprintf(stderr, "  %.0f%%  ETA %.0fs", 100.0 * done / p->total, (p->total - done) / rate);
    if (extra) fprintf(stderr, "  %s", extra);
    fputs("\033[K", stderr);
    if (final) fputc('\n', stderr);
    fflush(stderr);
    p->last = now;
}

void dfl_progress_update(dfl_progress *p, double done, const char *extra) {
    if (!p->enabled || dfl_now() - p->last < 0.2) return;
    progress_draw(p, done, extra, 0);
}

void dfl_progress_end(dfl_progress *p, double done, const char *extra) {
    if (p->enabled) progress_draw(p, done, extra, 1);
}
