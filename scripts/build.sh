#!/usr/bin/env bash
# Configures and builds one CMake preset (default: release) with both cores.
# Usage: scripts/build.sh [release|debug|asan-ubsan|tsan|clang-tsa|fuzz] [ninja targets...]
#
# Compiles through ccache when it is installed (scripts/setup.sh installs it). The cache lives
# outside the checkout (CCACHE_DIR, default ~/.cache/ccache), so it survives between runs on
# the same machine; paths are taken relative to the checkout (CCACHE_BASEDIR) and the working
# directory is not hashed, so a fresh clone in another folder hits the objects an earlier clone
# compiled. `WL_CCACHE=0` builds without it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
preset=${1:-release}
shift || true
launcher=()
if [ "${WL_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null 2>&1; then
  export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true
  export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-20G}
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
else
  launcher=(-UCMAKE_CXX_COMPILER_LAUNCHER -UCMAKE_C_COMPILER_LAUNCHER)
fi
cmake --preset "$preset" "${launcher[@]}" >/dev/null
cmake --build "build/$preset" -j "$(nproc)" ${1:+--target "$@"}
