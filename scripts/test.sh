#!/usr/bin/env bash
# Installs what is missing, builds, and runs in the release build what needs its speed or the
# binary users run (the slow tests: the command line end to end, the Python package, the
# PyTorch reference; and the tests labelled full-size, which run on smaller models or skip a
# case under the sanitizers), then every test but the slow ones once under AddressSanitizer +
# UndefinedBehaviorSanitizer (and the two slow text-against-JavaScript ones), then every test
# under ThreadSanitizer but four kinds (said where that phase starts).
#
# Formatting is checked first (scripts/check_format.sh); a clang build of the libraries checks
# the thread-safety annotations last. Every build goes through ccache (scripts/build.sh), whose
# cache outlives the checkout: a fresh clone on a machine that built the same sources before
# compiles almost nothing. The ASan build compiles at -O1 with line tables only
# (CMakePresets.json), as ASan's own docs suggest; ThreadSanitizer builds the same way; the
# clang build compiles at -O0 (the thread-safety analysis runs before any optimisation). Each
# phase prints when it starts, and the run ends with a table of every phase's time and the
# tests each stage ran, so a slow CI run says where.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

summary=()
phase_name="" phase_start=0
phase_note=""
end_phase() {
  if [ -n "$phase_name" ]; then summary+=("$(printf '%-58s %5d s' "$phase_name" $((SECONDS - phase_start)))"); fi
  if [ -n "$phase_note" ]; then summary+=("$phase_note"); fi
  phase_name="" phase_note=""
}
phase() {
  end_phase
  phase_name=$1 phase_start=$SECONDS
  echo "== $1 (at ${SECONDS} s)"
}
passed=0 failed=0
report() {
  end_phase
  echo "== phases"
  printf '%s\n' "${summary[@]}"
  printf '%-58s %5d s\n' "whole run" "$SECONDS"
  echo "$passed passed, $failed failed"
}
trap report EXIT
# ctest with its closing count kept for the table.
run_tests() {
  local label=$1 log
  shift
  log=$(mktemp)
  local rc=0
  ctest "$@" 2>&1 | tee "$log" || rc=$?  # counted before set -e ends the run on a failure
  local line
  line=$(grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -1 ||
    true)
  phase_note+="${phase_note:+$'\n'}  $label: ${line:-no count}"
  if [[ $line =~ ([0-9]+)\ tests?\ failed\ out\ of\ ([0-9]+) ]]; then
    failed=$((failed + BASH_REMATCH[1]))
    passed=$((passed + BASH_REMATCH[2] - BASH_REMATCH[1]))
  fi
  rm -f "$log"
  return "$rc"
}

phase format
bash scripts/check_format.sh

phase "release build"
bash scripts/build.sh release
phase "release tests (the slow and the full-size ones)"
run_tests "release" --preset release -j 2 -L 'slow|full-size'

phase "asan-ubsan build"
bash scripts/build.sh asan-ubsan
phase "asan-ubsan tests (all but the slow ones, + text)"
run_tests "ASan+UBSan" --preset asan-ubsan -j 2 -LE slow
# And the tokenizers and chat templates against the JavaScript reference, which are slow (a
# corpus line by line) but have no thread for TSan to look at: under ASan they take a third of
# their TSan time, and the corpus runs through the instrumented tokenizer.
text_vs_js='text_(tokenizers|chat_templates)_vs_js'
run_tests "ASan+UBSan, text against JavaScript" --preset asan-ubsan -j 2 --no-tests=error \
  -R "^${text_vs_js}\$"

# ThreadSanitizer runs every test (the slow ones' command-line suites and references drive the TSan
# binary) but four kinds. The text-against-JavaScript pair, which ASan runs (above). The
# command-line suites that hold the binary to an address-space limit (RLIMIT_AS: bad_inputs, inputs,
# memory, scale) cannot run under it: TSan reserves its shadow and allocator ranges at start-up and
# dies there under any such limit; release runs them. The collectives' and transfers' reruns over
# UCX's TCP transport (tcp.*: the same threads as over shared memory, and UCX itself is not
# instrumented); ASan runs those. And the testbed's tests (scripts/testbed.sh: the kernel's
# namespaces and shaping, driven by scripts); release runs them. The Python package is not built
# under TSan (an uninstrumented interpreter). The full-size tests run on tiny models here, as under
# ASan. Everything is instrumented, the kernels too: under TSan they are compiled without
# multiversioning (kernels/detail/simd.h). The preset sets TSAN_OPTIONS' atexit_sleep_ms=0: by
# default TSan sleeps a second at the exit of every process that still has a second thread (every
# `weightlift` run), for the reports of threads that outlive main. The command-line suites start
# hundreds of such processes (cli_bad_flags took 156 s, 11 s without the sleep); what is given up is
# a race between a thread and the process's exit, which no test looks for.
phase "tsan build"
bash scripts/build.sh tsan
phase "tsan tests (not tcp.*, testbed, RLIMIT_AS suites, text)"
run_tests "TSan" --preset tsan -j 2 \
  -E "^(tcp[.].*|testbed(_[a-z_]+)?|cli_(bad_inputs|inputs|memory|scale)|${text_vs_js})\$"

phase "clang thread-safety analysis (libraries only)"
bash scripts/build.sh clang-tsa wl_app wl_infer
