#!/bin/sh
# Build generate.wasm, the wasi-nn guest `pcp export` ships beside each model.
#
# Needs clang, lld and wasi-libc (Debian/Ubuntu: apt-get install clang lld wasi-libc
# libclang-rt-dev-wasm32). The result is committed: installing PCP never builds it.
# -ffp-contract=off keeps every a*b+c two IEEE operations, as in Python: the sampler
# must produce the same bits as pcp_p2p/export/sampling.py.
set -eu
cd "$(dirname "$0")"
SYSROOT=${WASI_SYSROOT:-/usr}
clang --target=wasm32-wasi --sysroot="$SYSROOT" -O2 -ffp-contract=off -Wall -Wextra -Werror \
    -Wl,--strip-all -Wl,-z,stack-size=1048576 -o generate.wasm generate.c -lm
echo "built $(pwd)/generate.wasm ($(wc -c < generate.wasm) bytes)"
