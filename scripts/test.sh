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

# ThreadSanitizer runs the tests labelled "threads" (ranks as threads exchanging bytes, the
# compute pool, the transfer fleet), built from their folders only: the kernel, model and
# training tests run single-process code that ASan already covers, and building them too put
# this phase at about 30 of a run's 80 minutes on a 2-core AVX2 machine. The collectives' and
# transfers' reruns over UCX's TCP transport (tcp.*) are left out too: the same threads as over
# shared memory, and UCX itself is not instrumented. ASan runs all of them.
phase "tsan build (the threads tests, but the slow ones and the tcp.* reruns)"
tsan_targets=()
for dir in apps comm core fault infer parallel transfer; do tsan_targets+=("tests/$dir/all"); done
bash scripts/build.sh tsan "${tsan_targets[@]}"
ctest --preset tsan -j 2 -L threads -LE slow -E '^tcp[.]'

phase "clang thread-safety analysis (WL_GUARDED_BY annotations, libraries only)"
cmake --preset clang-tsa >/dev/null
cmake --build build/clang-tsa -j "$(nproc)" --target wl_app wl_infer
phase done
