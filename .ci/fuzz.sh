#!/usr/bin/env bash
# CI: builds the libFuzzer targets of tests/fuzz (clang-14, ASan + UBSan) in build-fuzz/,
# replays tests/fuzz/regressions/<target>/*, then fuzzes each target for FUZZ_SECONDS.
# Fails if any target crashes (sanitizer report, broken invariant, timeout, OOM).
#
#   FUZZ_SECONDS=60        seconds per target (-max_total_time)
#   FUZZ_TARGETS="..."     subset of: host address config scrubber ws_frames aws_chunks body_method http1 h2_server
#   FUZZ_JOBS=2            ninja -j
#   FUZZ_NICE=10           nice level of the build and the runs
#   FUZZ_BUILD_DIR=build-fuzz
#
# New corpus units go to $FUZZ_BUILD_DIR/corpus/<target> (the committed seeds in
# tests/fuzz/corpus/<target> are only read); crash inputs to $FUZZ_BUILD_DIR/artifacts/<target>.
set -uo pipefail
cd "$(dirname "$0")/.."

SECONDS_PER_TARGET="${FUZZ_SECONDS:-60}"
TARGETS="${FUZZ_TARGETS:-host address config scrubber ws_frames aws_chunks body_method http1 h2_server}"
JOBS="${FUZZ_JOBS:-2}"
NICE="${FUZZ_NICE:-10}"
BUILD="${FUZZ_BUILD_DIR:-build-fuzz}"
SRC=tests/fuzz
# ASan's own RSS limit fires just below libFuzzer's -rss_limit_mb: libFuzzer's OOM report
# walks every live allocation (minutes on a heap of millions of small chunks), ASan's is
# immediate and still leaves the input in the artifacts folder. A run that hangs anyway is
# killed FUZZ_SECONDS + 300 s after it started.
export ASAN_OPTIONS="hard_rss_limit_mb=2000${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
KILL_AFTER=$((SECONDS_PER_TARGET + 300))

echo "== fuzz: configure and build ($BUILD)"
if ! cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_CXX_COMPILER=clang++-14 \
        -DCMAKE_C_COMPILER=clang-14 >"$BUILD.configure.log" 2>&1; then
    cat "$BUILD.configure.log"
    echo "fuzz: configure failed"
    exit 1
fi
rm -f "$BUILD.configure.log"
build_targets=""
for t in $TARGETS; do build_targets+=" fuzz_$t"; done
# shellcheck disable=SC2086
if ! nice -n "$NICE" ninja -C "$BUILD" -j"$JOBS" $build_targets; then
    echo "fuzz: build failed"
    exit 1
fi

failed=()
summary=()
for t in $TARGETS; do
    bin="$BUILD/fuzz_$t"
    seeds="$SRC/corpus/$t"
    corpus="$BUILD/corpus/$t"
    artifacts="$BUILD/artifacts/$t/"
    log="$BUILD/fuzz_$t.log"
    mkdir -p "$corpus" "$artifacts"

    regressions=("$SRC/regressions/$t"/*)
    if [ -e "${regressions[0]}" ]; then
        echo "== fuzz_$t: replaying ${#regressions[@]} regression input(s)"
        if ! timeout -s KILL 600 "$bin" -rss_limit_mb=2048 -timeout=25 "${regressions[@]}" \
                >"$log.regressions" 2>&1; then
            grep -E "ERROR|FUZZ_CHECK|SUMMARY|Running:|rss limit|^    #[0-9]+ " "$log.regressions" | head -40
            echo "fuzz_$t: a regression input crashes again (full log: $log.regressions)"
            failed+=("$t(regression)")
        fi
    fi

    dict=()
    if [ -f "$SRC/dict/$t.dict" ]; then
        dict=(-dict="$SRC/dict/$t.dict")
    fi
    echo "== fuzz_$t: ${SECONDS_PER_TARGET}s"
    timeout -s KILL "$KILL_AFTER" nice -n "$NICE" "$bin" -max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=2048 -timeout=25 \
        -print_final_stats=1 -artifact_prefix="$artifacts" "${dict[@]}" \
        "$corpus" "$seeds" >"$log" 2>&1
    rc=$?
    done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1)
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    line="fuzz_$t: rc=$rc execs=${execs:-?} exec/s=${rate:-?} | ${done_line:-no DONE line}"
    echo "$line"
    summary+=("$line")
    if [ "$rc" -ne 0 ]; then
        grep -E "ERROR|FUZZ_CHECK|SUMMARY|Test unit written|rss limit|^    #[0-9]+ " "$log" | head -40
        echo "fuzz_$t: CRASH (full log: $log; input in $artifacts)"
        failed+=("$t")
    fi
done

echo "== fuzz summary (${SECONDS_PER_TARGET}s per target)"
printf '%s\n' "${summary[@]}"
if [ "${#failed[@]}" -ne 0 ]; then
    echo "fuzz: FAILED: ${failed[*]}"
    exit 1
fi
echo "fuzz: OK, no crashes"
