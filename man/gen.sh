#!/bin/sh
# man/gen.sh SRC.scd OUT: render a man page with scdoc. A line "%OPTIONS%"
# in SRC is replaced by the tool's own option table (`TOOL --help-scd`), so
# the man page lists exactly what the parser accepts and --help prints.
set -eu
src=$1 out=$2
tool=$(basename "$src" | sed 's/\.[0-9]\.scd$//')
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
if grep -q '^%OPTIONS%$' "$src"; then
    opts=$(mktemp)
    "${BIN:-bin}/$tool" --help-scd >"$opts"
    sed -e "/^%OPTIONS%\$/{r $opts" -e 'd}' "$src" >"$tmp"
    rm -f "$opts"
else
    cp "$src" "$tmp"
fi
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1764460800} scdoc <"$tmp" >"$out.tmp"
mv "$out.tmp" "$out"
