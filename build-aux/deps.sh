#!/bin/sh
# Install the Debian packages dflash needs, only those that are missing.
# msgpack-c is libmsgpack-c-dev from Debian 13 on and libmsgpack-dev before.
set -eu

need="liblz4-dev libjansson-dev libxxhash-dev libopenblas-openmp-dev pkg-config
      parallel scdoc clang lz4 zstd man-db gnuplot-nox jq bsdextrautils
      python3 python3-msgpack python3-lz4 python3-numpy"

missing=""
for p in $need; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
have_msgpack=0
for p in libmsgpack-c-dev libmsgpack-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" && have_msgpack=1
done

[ -z "$missing" ] && [ $have_msgpack = 1 ] && { echo "deps: all present"; exit 0; }

SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
echo "deps: installing:$missing$([ $have_msgpack = 1 ] || echo ' msgpack-c')"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
[ -n "$missing" ] && $SUDO apt-get install -y -qq --no-install-recommends $missing
if [ $have_msgpack = 0 ]; then
    if apt-cache show libmsgpack-c-dev >/dev/null 2>&1; then
        $SUDO apt-get install -y -qq --no-install-recommends libmsgpack-c-dev
    else
        $SUDO apt-get install -y -qq --no-install-recommends libmsgpack-dev
    fi
fi
echo "deps: done"
