# tests/gpu/deps.sh, sourced by run.sh and profile.sh: the libraries the
# build on the GPU machine links (msgpack-c, lz4, jansson, xxhash, OpenBLAS).
#
# gpu_deps [carried-only]: the system's (pkg-config), else the carried
# .gpu-deps/ (tests/gpu/pack-deps.sh) unpacked into /tmp, its flags
# appended to the caller's MAKEARGS array and its lib/ to LD_LIBRARY_PATH;
# GPU_DEPS says which. Returns 1 when neither is there. carried-only skips
# the system's (run.sh's dry run, which tests the carried ones).
gpu_deps() {
    local msgpack
    msgpack=$(pkg-config --exists msgpack-c 2>/dev/null && echo msgpack-c || echo msgpack)
    if [ "${1:-}" != carried-only ] && pkg-config --exists $msgpack liblz4 jansson libxxhash openblas 2>/dev/null; then
        GPU_DEPS="system libraries (pkg-config)"
    elif [ -f .gpu-deps/dflash-deps.tar.gz ]; then
        local D=/tmp/dflash-deps
        rm -rf "$D" && mkdir -p "$D" && tar xzf .gpu-deps/dflash-deps.tar.gz -C "$D"
        MAKEARGS+=("PKG_CFLAGS=-I$D/include" "PKG_LIBS=-L$D/lib -Wl,-rpath,$D/lib $(cat "$D/libs.txt")")
        export LD_LIBRARY_PATH="$D/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        GPU_DEPS="carried .gpu-deps (msgpack-c, lz4, jansson, xxhash, OpenBLAS)"
    else
        return 1
    fi
}
