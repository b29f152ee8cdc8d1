#!/usr/bin/env bash
# Kept for recorded commands: bench/compare.sh h2 BUILD CONNECTIONS STREAMS DURATION PAIRS.
exec "$(dirname "$0")/compare.sh" h2 "$@"
