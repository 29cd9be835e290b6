/* cli.h: one option table per tool feeds the parser, --help and the man page.
 *
 * A tool declares `static const dfl_opt opts[]` whose entries point at the
 * variables they set, and calls dfl_cli_parse(). Where a variable starts at
 * its default, leave the entry's `defval` NULL: --help reads the default from
 * the variable itself, so help and behaviour cannot drift. Where it does not
 * (dflash-train-step and dflash-score start most variables at a "not given"
 * value, UNSET or NAN, so that --resume or the mode can tell a given value
 * from the default; some defaults depend on the input, as --gamma's on the
 * block size; others read better as words, as "1G" or "all cores"), the
 * default is written in `defval` by hand and can drift from the value the
 * code sets: keep the two in step. tests/cli/test_train.sh and
 * test_score.sh compare those texts of dflash-train-step and dflash-score
 * that a run records (trainer_state.json, the score columns) with the
 * values used; the others are checked by nothing but review. The man page's
 * OPTIONS section is generated from the same table (--help-scd, used by the
 * Makefile), so it always says what --help says.
 *
 * Conventions (lz4, zstd, jq): `--name value` and `--name=value`; `-x value`
 * and `-xvalue`; `--` ends the options; `-` alone is a positional argument
 * (stdin or stdout). --help prints to stdout and exits 0; a usage error prints
 * to stderr and exits 2 (DFL_EX_USAGE).
 */
#ifndef DFLASH_CLI_H
#define DFLASH_CLI_H

#include <stdint.h>
#include <stdio.h>

#include "common.h"

typedef enum {
    DFL_OPT_FLAG,   /* int: set to 1 */
    DFL_OPT_STR,    /* const char *: the argument */
    DFL_OPT_LIST,   /* dfl_strlist: repeatable, each use appends */
    DFL_OPT_INT,    /* int64_t */
    DFL_OPT_DOUBLE, /* double */
    DFL_OPT_SIZE,   /* uint64_t, with K/M/G/T suffixes (powers of 1024) */
    DFL_OPT_CHOICE, /* const char *: one of the '|'-separated words in `arg` */
} dfl_opt_type;

typedef struct {
    int n;
    const char **v;
} dfl_strlist;

typedef struct {
    const char  *name;       /* long name without "--"; NULL ends the table */
    char         short_name; /* 0 if none */
    dfl_opt_type type;
    void        *dest;
    const char  *arg;        /* metavar ("N", "FILE"); for CHOICE the words "a|b|c" */
    const char  *help;       /* one sentence or more; no trailing newline */
    const char  *defval;     /* default shown in help, by hand (see above); NULL: read from *dest; "": none shown */
} dfl_opt;

typedef struct {
    const char    *prog;      /* "dflash-pack" */
    const char    *summary;   /* one line: what the tool does */
    const char    *synopsis;  /* usage lines, '\n'-separated, without the prog name */
    const dfl_opt *opts;
} dfl_cli;

/* Parse argv. Positional arguments are returned in *pos (pointers into argv),
 * their count as the return value. Exits 0 after --help/--version/--help-scd,
 * exits 2 with a message on a usage error. Called first, before any file is
 * opened, it also notes a closed stdin (dfl_stdin_reserve). */
int dfl_cli_parse(const dfl_cli *cli, int argc, char **argv, char ***pos);

/* The '|'-separated words of the DFL_OPT_CHOICE option `name` ("ce|kl"),
 * and whether v is one of them: a value read back from a file (the options
 * a checkpoint stores) is held to the same choices as the command line. */
const char *dfl_cli_choices(const dfl_cli *cli, const char *name);
int dfl_cli_choice_ok(const char *choices, const char *v);

/* Print the --help text. */
void dfl_cli_help(const dfl_cli *cli, FILE *f);

/* Print the OPTIONS section of the man page in scdoc syntax. */
void dfl_cli_scd_options(const dfl_cli *cli, FILE *f);

/* Print "prog: message\nTry 'prog --help' for more information." and exit 2. */
DFL_NORETURN void dfl_cli_usage_error(const dfl_cli *cli, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Progress line on stderr, drawn only when enabled (stderr is a terminal or
 * --progress was given). Redrawn at most every 0.2 s; "\r" keeps it on one line. */
typedef struct {
    int    enabled;
    double start, last;
    double total;      /* expected units, 0 if unknown */
    const char *unit;  /* "tok", "rec", "step" */
} dfl_progress;

void dfl_progress_init(dfl_progress *p, int force, double total, const char *unit);
void dfl_progress_update(dfl_progress *p, double done, const char *extra);
void dfl_progress_end(dfl_progress *p, double done, const char *extra);

#endif
