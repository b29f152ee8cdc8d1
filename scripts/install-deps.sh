#!/usr/bin/env bash
# Installs everything egressd needs to build and to run its whole test suite on Debian 12.
# Debian packages only (README.md: its first lines install, build and test; its "Tests"
# section names what each suite uses).
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends \
  build-essential cmake ninja-build pkg-config ccache \
  libboost1.81-dev libboost-json1.81-dev libboost-url1.81-dev \
  libssl-dev libnghttp2-dev libc-ares-dev libyaml-cpp-dev libspdlog-dev \
  libgtest-dev libgmock-dev libbenchmark-dev \
  ca-certificates openssl curl git procps \
  python3 python3-pytest python3-requests python3-h2 python3-httpx python3-yaml \
  python3-websocket python3-websockets python3-grpcio python3-boto3 \
  nghttp2-client nghttp2-server \
  python3-dnslib iproute2 iptables etcd-server etcd-client \
  clang-14 libclang-rt-14-dev llvm-14
# etcd-server is there for tests/integration/test_fleet.py, which starts its own etcd on
# loopback; the system service the package enables (where systemd runs) is not wanted.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now etcd >/dev/null 2>&1 || true
fi
