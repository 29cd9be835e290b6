#!/usr/bin/env bash
# tests/gpu/pack-deps.sh: run HERE (the development machine), before a GPU run.
#
# The GPU machine's image has CUDA, gcc and Python but maybe not the Debian
# libraries dflash links (msgpack-c, lz4, jansson, xxhash, OpenBLAS), and no
# network to install them. This packs this machine's copies (headers, shared
# libraries with OpenBLAS's Fortran runtime, the link flags) into
# .gpu-deps/dflash-deps.tar.gz (about 15 MB), ignored by git; the device
# call carries it (carry [".gpu-deps"]) and tests/gpu/run.sh unpacks it into
# /tmp/dflash-deps only if pkg-config there cannot find the libraries.
set -eu
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu-deps/' "$exclude" 2>/dev/null || echo '/.gpu-deps/' >>"$exclude"

msgpack=$(pkg-config --exists msgpack-c && echo msgpack-c || echo msgpack)
pkgs="$msgpack liblz4 jansson libxxhash openblas"
pkg-config --exists $pkgs || { echo "pack-deps: pkg-config cannot find: $pkgs" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/include" "$tmp/lib"
inc=/usr/include
blasinc=$(pkg-config --cflags-only-I openblas | sed 's/^-I//; s/ *$//')
[ -n "$blasinc" ] || blasinc=$inc
# the OpenMP build of OpenBLAS, which the Makefile links when it is installed
blasdir=""
omp=/usr/lib/x86_64-linux-gnu/openblas-openmp
if [ -e "$omp/libopenblas.so" ]; then
    blasdir=$omp
    blasinc=/usr/include/x86_64-linux-gnu/openblas-openmp
fi
cp -a "$inc"/msgpack.h "$inc"/lz4*.h "$inc"/jansson*.h "$inc"/xxhash.h "$tmp/include/"
mkdir -p "$tmp/include/msgpack"
find "$inc/msgpack" -name '*.h' -exec cp --parents {} "$tmp" \; 2>/dev/null || true
[ -d "$tmp$inc/msgpack" ] && cp -a "$tmp$inc/msgpack/." "$tmp/include/msgpack/" && rm -rf "${tmp:?}/usr"
cp -a "$blasinc"/cblas.h "$blasinc"/openblas_config.h "$blasinc"/f77blas.h "$tmp/include/" 2>/dev/null ||
    cp -a "$blasinc"/cblas.h "$tmp/include/"

# each library under its SONAME, with the unversioned link name beside it
libs_flags=$(pkg-config --libs-only-l $pkgs)
libdirs=$(pkg-config --libs-only-L $pkgs | sed 's/-L//g')
for l in $libs_flags gfortran quadmath; do
    name=${l#-l}
    f=""
    for d in $blasdir $libdirs /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu /usr/lib64 /usr/lib; do
        for c in "$d/lib$name.so" "$d"/lib"$name".so.[0-9]*; do
            [ -e "$c" ] && { f=$(readlink -f "$c"); break 2; }
        done
    done
    [ -n "$f" ] || { echo "pack-deps: lib$name not found" >&2; exit 1; }
    soname=$(objdump -p "$f" | awk '/SONAME/ {print $2}')
    cp "$f" "$tmp/lib/$soname"
    ln -sf "$soname" "$tmp/lib/lib$name.so"
done
echo "$libs_flags" >"$tmp/libs.txt"
mkdir -p .gpu-deps
tar czf .gpu-deps/dflash-deps.tar.gz -C "$tmp" .
ls -l .gpu-deps/dflash-deps.tar.gz
echo "link flags: $libs_flags"
