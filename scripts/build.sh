#!/usr/bin/env bash
# Configures and builds one CMake preset (default: release) with both cores.
# Usage: scripts/build.sh [release|debug|asan-ubsan|fuzz] [ninja targets...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
preset=${1:-release}
shift || true
cmake --preset "$preset" >/dev/null
cmake --build "build/$preset" -j "$(nproc)" ${1:+--target "$@"}
