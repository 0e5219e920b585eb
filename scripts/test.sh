#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test: the release build's unit and
# multi-process tests plus the PyTorch reference comparison, then the unit tests again under
# AddressSanitizer + UndefinedBehaviorSanitizer, then every test but the slow ones and the TCP
# reruns under ThreadSanitizer (the threads and processes that exchange bytes, and the compute
# pool under every kernel and model test).
# Formatting is checked first (scripts/check_format.sh); a clang build of the libraries checks
# the thread-safety annotations last. The ASan build compiles at -O1 with line tables only
# (CMakePresets.json), as ASan's own docs suggest: at -O2 -g it took 19 of the whole run's 57
# minutes on 2 cores, at -O1 -g1 about half the compile time, its tests as fast. ThreadSanitizer
# builds the same way. The clang build compiles at -O0: the thread-safety analysis runs before
# any optimisation, and -O0 halves its compile time. Each phase prints when it starts, so a
# slow CI run says where.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

phase() { echo "== $1 (at ${SECONDS} s)"; }

phase format
bash scripts/check_format.sh

phase "release build"
bash scripts/build.sh release
ctest --preset release -j 2

phase "asan-ubsan build (every test but the slow ones)"
bash scripts/build.sh asan-ubsan
ctest --preset asan-ubsan -j 2 -LE slow

# The collectives' and transfers' reruns over UCX's TCP transport (tcp.*) are left out under
# ThreadSanitizer: their threads are the same as over shared memory, UCX itself is not
# instrumented, and they were a quarter of this phase's test time. ASan runs them.
phase "tsan build (every test but the slow ones and the tcp.* reruns)"
bash scripts/build.sh tsan
ctest --preset tsan -j 2 -LE slow -E '^tcp[.]'


phase "clang thread-safety analysis (WL_GUARDED_BY annotations, libraries only)"
cmake --preset clang-tsa >/dev/null
cmake --build build/clang-tsa -j "$(nproc)" --target wl_app wl_infer
phase done
