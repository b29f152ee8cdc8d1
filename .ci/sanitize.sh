#!/usr/bin/env bash
# CI: egressd, egressctl and egress-bench built with sanitizers (EGRESS_SANITIZE, CMakeLists.txt)
# and their unit, integration and egress-bench tests run: the fuzz targets cover the parsers
# alone, this covers the proxy's threads, coroutines, pools and shutdown under real clients. Fails if a test fails or any
# process wrote a sanitizer report (a leak found at exit does not fail a test by itself: the
# reports go to files, checked at the end).
#
#   .ci/sanitize.sh [address|thread]      default: address (ASan + UBSan)
#   SANITIZE_JOBS=2  SANITIZE_NICE=10  SANITIZE_BUILD_DIR=build-<sanitizer>
#   SANITIZE_TESTS='unit|integration|bench'     the ctest labels to run
set -uo pipefail
cd "$(dirname "$0")/.."

SAN="${1:-address}"
JOBS="${SANITIZE_JOBS:-2}"
NICE="${SANITIZE_NICE:-10}"
BUILD="${SANITIZE_BUILD_DIR:-build-$SAN}"
LABELS="${SANITIZE_TESTS:-unit|integration|bench}"

echo "== sanitize ($SAN): configure and build ($BUILD)"
# -O1, as the sanitizers' documentation advises: the whole suite runs in ~3 minutes here, and
# stacks still name every frame's line.
cmake -S . -B "$BUILD" -G Ninja -DEGRESS_SANITIZE="$SAN" \
      -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-g -O1" >/dev/null || exit 1
# Every target: a sanitized build leaves out only the micro-benchmarks (bench/CMakeLists.txt).
nice -n "$NICE" cmake --build "$BUILD" -j "$JOBS" || exit 1

REPORTS="$(cd "$BUILD" && pwd)/sanitizer-reports"
rm -rf "$REPORTS" && mkdir -p "$REPORTS"
# Reports go to files named by process (log_path.PID), so a report from egressd (a child of
# the integration tests) or from its exit is found whatever became of its stderr.
export ASAN_OPTIONS="log_path=$REPORTS/asan:detect_leaks=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="log_path=$REPORTS/ubsan:print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export TSAN_OPTIONS="log_path=$REPORTS/tsan:halt_on_error=1:second_deadlock_stack=1${TSAN_OPTIONS:+:$TSAN_OPTIONS}"

echo "== sanitize ($SAN): ctest -L '$LABELS'"
ctest --test-dir "$BUILD" -L "$LABELS" --output-on-failure -j "$JOBS"
rc=$?
if compgen -G "$REPORTS/*" >/dev/null; then
    for f in "$REPORTS"/*; do
        echo "== sanitizer report $f"
        cat "$f"
    done
    rc=1
fi
if [ "$rc" -eq 0 ]; then
    echo "sanitize ($SAN): OK"
else
    echo "sanitize ($SAN): FAILED"
fi
exit "$rc"
