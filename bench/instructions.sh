#!/usr/bin/env bash
# Instructions egressd executes per proxied request, counted by valgrind's callgrind: a figure
# that does not move with the host's load, for A/B comparisons of small changes that the
# CPU-time figures of bench/compare.sh cannot resolve on a shared machine.
#
#   bench/instructions.sh [BUILD_DIR] [CONNECTIONS] [KEEP_PROFILE_DIR]
#   PROTO=h2 STREAMS=50 bench/instructions.sh [BUILD_DIR] [CONNECTIONS] [KEEP_PROFILE_DIR]
#
# Runs bench/compare.sh (h1, or h2 with STREAMS streams per connection; H2_UPSTREAM passes
# through) twice with egressd under callgrind (2 s and 6 s of load) and
# reports (instructions in the long run - in the short one) / (requests - requests): the
# start-up (run CA, config, dynamic linking) cancels out. User-space instructions only (the
# kernel's share is not counted), and everything runs ~50x slower under valgrind, so the
# request mix is that of a light load. h1 with one connection repeats within about 1%; h2
# moves about 4% from run to run (how many streams one read or write carries depends on
# timing): compare medians of several alternating runs there. With KEEP_PROFILE_DIR the long run's profile is kept
# there (callgrind_annotate --inclusive=yes DIR/callgrind.out.*).
# --trace-children=yes follows egressd's one re-exec at start (proxy/malloc_tuning.h): the
# profile is of the process that serves.
# Needs valgrind (apt-get install -y valgrind) and what bench/compare.sh needs.
set -euo pipefail
command -v valgrind >/dev/null || { echo "instructions.sh needs valgrind: apt-get install -y valgrind" >&2; exit 2; }
BUILD=$(cd "${1:-build}" && pwd)
CONNS=${2:-1}
if [ "${PROTO:-h1}" = h2 ]; then STREAMS=${STREAMS:-50}; else STREAMS=; fi
KEEP=${3:-}
HERE=$(cd "$(dirname "$0")" && pwd)
W=$(mktemp -d /tmp/egress-instr.XXXXXX)
trap 'rm -rf "$W"' EXIT
mkdir -p "$W/out"
ln -s "$BUILD/bench" "$W/bench"
cat > "$W/egressd" <<EOF
#!/bin/sh
exec valgrind --tool=callgrind --trace-children=yes --callgrind-out-file=$W/out/callgrind.out.%p --dump-instr=no \
  "$BUILD/egressd" "\$@"
EOF
chmod +x "$W/egressd"

# One run: prints "requests instructions".
one() {
  rm -f "$W"/out/callgrind.out.*
  local reqs
  if [ "${PROTO:-h1}" = h2 ]; then
    set -- h2 "$W" "$CONNS" "${STREAMS:-50}" "$1" 1
  else
    set -- h1 "$W" "$CONNS" "$1" 1
  fi
  reqs=$("$HERE/compare.sh" "$@" 2>&1 | sed -n 's/^egressd: \([0-9]*\) audited.*/\1/p')
  sleep 1  # callgrind writes its file when egressd exits
  echo "$reqs $(sed -n 's/^summary: //p' "$W"/out/callgrind.out.*)"
}
read -r r1 i1 < <(one 2s)
read -r r2 i2 < <(one 6s)
if [ -n "$KEEP" ]; then
  mkdir -p "$KEEP" && cp "$W"/out/callgrind.out.* "$KEEP"/
fi
if [ "$r2" -le "$r1" ]; then
  echo "the long run served no more requests than the short one ($r1, $r2)" >&2
  exit 1
fi
echo "egressd: $(( (i2 - i1) / (r2 - r1) )) instructions per request (${PROTO:-h1}, $CONNS connection(s)${STREAMS:+ x $STREAMS streams}; runs of $r1 and $r2 requests)"
