#!/usr/bin/env bash
# The man pages: one per tool (section 1) and one for the stream (section 5).
#   - every tool in $DFLASH_BIN has a page, rendered from man/TOOL.1.scd;
#   - every option that TOOL --help prints appears in the rendered page;
#   - the committed rendering equals a fresh one from the scdoc source and the
#     tool's own option table (man/gen.sh), so no page is stale;
#   - each page has the sections a reader looks for, and the exit-status table
#     lists the codes of common.h the tool can give, as its --help does, and
#     the status after a signal;
#   - groff renders every page without a warning, and man -l shows it;
#   - every option a page names in its text or EXAMPLES is one of the tool's own;
#   - make install PREFIX=... installs the tools and the pages, and man finds them.
. "$(dirname "$0")/lib.sh"

MAN=$here/man
export MANWIDTH=100
unset MAN_KEEP_FORMATTING
tools=()
for t in "$DFLASH_BIN"/dflash-*; do [ -x "$t" ] && tools+=("$(basename "$t")"); done
[ ${#tools[@]} -ge 3 ] || { fail "tools" "found ${#tools[@]} tools in $DFLASH_BIN"; exit 1; }

# The text of a roff page with its escapes undone: "\-" -> "-", fonts dropped.
plain_roff() { sed -e 's/\\-/-/g' -e 's/\\f[BIRP]//g' -e 's/\\(em/--/g' "$1"; }

# The long options (--name) that a tool's --help lists in its option lines.
help_options() {
    "$1" --help | grep -E '^ {2,}(-[A-Za-z0-9], )?--[a-z0-9]' | grep -oE -- '--[a-z0-9][a-z0-9-]*' | sort -u
}

for tool in "${tools[@]}"; do
    page=$MAN/$tool.1
    if [ ! -f "$page" ] || [ ! -f "$page.scd" ]; then
        fail "$tool: man page" "missing $page or $page.scd"
        continue
    fi
    # Every option of --help is in the page (an option with a one-letter
    # alias must show both).
    opts=$(help_options "$DFLASH_BIN/$tool")
    [ -n "$opts" ] || fail "$tool: --help lists options" "no option lines parsed"
    missing=""
    for o in $opts; do
        plain_roff "$page" | grep -qF -- "$o" || missing="$missing $o"
    done
    [ -z "$missing" ] && pass "$tool: every --help option is in the man page" ||
        fail "$tool: every --help option is in the man page" "missing:$missing"
    shorts=$("$DFLASH_BIN/$tool" --help | grep -oE '^ {2,}-[A-Za-z0-9], --[a-z0-9-]+' | sed 's/^ *//')
    missing=""
    while IFS= read -r pair; do
        [ -z "$pair" ] && continue
        plain_roff "$page" | grep -qF -- "$pair" || missing="$missing [$pair]"
    done <<<"$shorts"
    [ -z "$missing" ] && pass "$tool: short aliases in the man page" ||
        fail "$tool: short aliases in the man page" "missing:$missing"

    # The committed page is the rendering of its source and the tool's table.
    if BIN=$DFLASH_BIN "$MAN/gen.sh" "$page.scd" "$T/$tool.1" 2>"$T/gen.err"; then
        if cmp -s "$page" "$T/$tool.1"; then pass "$tool: committed page is up to date (make man)"
        else fail "$tool: committed page is up to date (make man)" "$(diff "$page" "$T/$tool.1" | head -5)"; fi
    else
        fail "$tool: man/gen.sh renders" "$(head -c 300 "$T/gen.err")"
    fi
    grep -q '^%OPTIONS%$' "$page.scd" && pass "$tool: options come from the tool's table (%OPTIONS%)" ||
        fail "$tool: options come from the tool's table (%OPTIONS%)"

    # Sections, and the exit codes of common.h in EXIT STATUS.
    missing=""
    for s in NAME SYNOPSIS DESCRIPTION OPTIONS "EXIT STATUS" EXAMPLES "SEE ALSO"; do
        grep -qE "^\.SH \"?$s\"?\$" "$page" || missing="$missing [$s]"
    done
    [ -z "$missing" ] && pass "$tool: sections" || fail "$tool: sections" "missing:$missing"
    # 69 (no CUDA device) only where there is a --device to ask for one
    # (dflash-pack documented it, and could never exit 69).
    exits=$(sed -n '/^\.SH "\?EXIT STATUS/,/^\.SH/p' "$page" | plain_roff /dev/stdin)
    codes=$(echo "$exits" | grep -oE '^[0-9]+$' | sort -n | tr '\n' ' ')
    want="0 1 2 65 66 69 70 73 74 "
    help_options "$DFLASH_BIN/$tool" | grep -qx -- --device || want="0 1 2 65 66 70 73 74 "
    [ "$codes" = "$want" ] && pass "$tool: exit status table has every code it can give" ||
        fail "$tool: exit status table has every code it can give" "found: $codes, want: $want"
    # --help's footer gives the same codes; both say what a signal gives.
    footer=$("$DFLASH_BIN/$tool" --help | sed -n '/^exit status:/,/^See man/p')
    help_codes=$(echo "$footer" | sed 's/killed by.*//' | grep -oE '(^|: |, )[0-9]+ ' | grep -oE '[0-9]+' | sort -n | tr '\n' ' ')
    [ "$help_codes" = "$want" ] && pass "$tool: --help gives the same exit codes" ||
        fail "$tool: --help gives the same exit codes" "found: $help_codes, want: $want"
    echo "$exits" | grep -qx '128+N' && echo "$exits" | grep -q 'SIGPIPE' && echo "$footer" | grep -q '128+N' &&
        pass "$tool: the exit status after a signal (128+N, SIGPIPE) is documented" ||
        fail "$tool: the exit status after a signal (128+N, SIGPIPE) is documented"
    grep -q "dflash-stream" "$page" && pass "$tool: SEE ALSO names the stream page" ||
        fail "$tool: SEE ALSO names the stream page"
done

# The options the pages name: every option of a dflash command in EXAMPLES
# (and in the stream page's) is one its tool's --help lists, and every *--option*
# a tool's page names elsewhere is its own, or another tool's on a line that
# names that tool. OPTIONS comes from the table; the prose and the examples are
# written by hand and would keep a renamed option.
for tool in "${tools[@]}"; do
    "$DFLASH_BIN/$tool" --help | grep -E '^ {2,}-' | grep -oE -- '(^|[ ,])--?[A-Za-z0-9][a-z0-9-]*' |
        tr -d ' ,' | sort -u >"$T/opts.$tool"
done
if python3 - "$T" "$MAN" "${tools[@]}" >"$T/optnames.out" 2>&1 <<'PY'
import re, sys
T, MAN, tools = sys.argv[1], sys.argv[2], sys.argv[3:]
opts = {t: set(open(f"{T}/opts.{t}").read().split()) for t in tools}
tool_re = re.compile(r"\b(" + "|".join(map(re.escape, tools)) + r")\b")
bad = []
pages = [(t, f"{MAN}/{t}.1.scd") for t in tools] + [(None, f"{MAN}/dflash-stream.5.scd")]
for own, page in pages:
    section = ""
    text = open(page).read().replace("\\\\\n", " ").replace("++\n", "\n")
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("# "):
            section = line[2:].strip()
            continue
        line = line.replace("\\*", "*").replace("\\\\", "\\")
        if section == "EXAMPLES":
            # each command of a pipeline or list: the words after the tool's name
            for cmd in re.split(r"\||;|&&|\$\(|:::", line):
                m = tool_re.search(cmd)
                if not m:
                    continue
                for o in re.findall(r"(?<![\w-])(--?[A-Za-z][a-z0-9-]*)", cmd[m.end():]):
                    if o not in opts[m.group(1)]:
                        bad.append(f"{page}:{n}: {m.group(1)} has no {o}")
        elif own and section not in ("OPTIONS",):
            others = set(tool_re.findall(line)) - {own}
            for o in re.findall(r"\*(--[a-z][a-z0-9-]*)", line):
                if o not in opts[own] and not any(o in opts[t] for t in others):
                    bad.append(f"{page}:{n}: {own} has no {o}")
print("\n".join(bad))
sys.exit(1 if bad else 0)
PY
then
    pass "the options named in the pages' text and EXAMPLES are the tools' own"
else
    fail "the options named in the pages' text and EXAMPLES are the tools' own" "$(head -5 "$T/optnames.out")"
fi

# Section 5: the stream.
page=$MAN/dflash-stream.5
missing=""
for s in NAME DESCRIPTION EXAMPLES "SEE ALSO"; do
    grep -qE "^\.SH \"?$s\"?\$" "$page" || missing="$missing [$s]"
done
[ -z "$missing" ] && pass "dflash-stream(5): sections" || fail "dflash-stream(5): sections" "missing:$missing"
if BIN=$DFLASH_BIN "$MAN/gen.sh" "$page.scd" "$T/dflash-stream.5" && cmp -s "$page" "$T/dflash-stream.5"; then
    pass "dflash-stream(5): committed page is up to date"
else
    fail "dflash-stream(5): committed page is up to date"
fi

# Every page renders without a groff warning, and man -l shows its NAME line.
for page in "$MAN"/*.1 "$MAN"/*.5; do
    name=$(basename "$page")
    if ! groff -man -Tutf8 -ww -z "$page" 2>"$T/groff.err" || [ -s "$T/groff.err" ]; then
        fail "$name: groff renders without warnings" "$(head -3 "$T/groff.err")"
    else
        pass "$name: groff renders without warnings"
    fi
    man --warnings -l "$page" >"$T/man.out" 2>"$T/man.err"
    if [ -s "$T/man.err" ] || ! grep -q "^NAME" "$T/man.out" || ! grep -q "${name%.*} - " "$T/man.out"; then
        fail "$name: man -l renders" "$(head -3 "$T/man.err")"
    else
        pass "$name: man -l renders"
    fi
done

# make install PREFIX=... (with the tools already built: -o all keeps make from
# rebuilding them, BUILD points its flag stamp into the scratch directory).
if make -C "$here" --no-print-directory -o all install PREFIX="$T/prefix" BIN="$DFLASH_BIN" \
        BUILD="$T/build" NO_CUDA=1 >"$T/install.out" 2>&1; then
    ok=1
    for tool in "${tools[@]}"; do
        [ -x "$T/prefix/bin/$tool" ] || { ok=0; echo "no $T/prefix/bin/$tool"; }
        [ -f "$T/prefix/share/man/man1/$tool.1" ] || { ok=0; echo "no man1/$tool.1"; }
    done
    [ -f "$T/prefix/share/man/man5/dflash-stream.5" ] || { ok=0; echo "no man5/dflash-stream.5"; }
    [ $ok = 1 ] && pass "make install PREFIX installs every tool and page" ||
        fail "make install PREFIX installs every tool and page"
    if MANPATH="$T/prefix/share/man" man 5 dflash-stream 2>/dev/null | grep -q "DFS tensor stream" &&
       MANPATH="$T/prefix/share/man" man 1 "${tools[0]}" 2>/dev/null | grep -q "^SYNOPSIS"; then
        pass "man finds the installed pages"
    else
        fail "man finds the installed pages"
    fi
    "$T/prefix/bin/${tools[0]}" --version >/dev/null && pass "the installed tool runs" || fail "the installed tool runs"
else
    fail "make install PREFIX" "$(tail -3 "$T/install.out")"
fi
