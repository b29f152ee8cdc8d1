#!/usr/bin/env bash
# Kept for recorded commands: bench/compare.sh h1 BUILD CONNECTIONS DURATION PAIRS.
exec "$(dirname "$0")/compare.sh" h1 "$@"
