#!/usr/bin/env bash
# egressd next to other proxies that can inject a credential into TLS traffic, on one machine,
# loopback only, with the same client, upstream, credential and loads:
#
#   bench/peers.sh [BUILD_DIR]          # default BUILD_DIR: build (needs egressd, bench/egress-bench)
#
#   * upstream: nginx (1 worker) with a certificate for "localhost" from a test CA made here;
#     /json (small JSON) and /64k (64 KiB body); port UP_H1 is HTTP/1.1 only, UP_H2 offers h2.
#     It answers 401 unless "Authorization: Bearer <secret>" is present, so a proxy that does not
#     inject shows up as errors. The direct side sends that header itself.
#   * egressd: static run with a proxy token, the upstream pinned to the secret (bearer).
#   * mitmproxy (mitmdump + bench/peers/mitm_addon.py), upstream CA trusted via
#     ssl_verify_upstream_trusted_ca.
#   * Squid (squid-openssl) with ssl-bump (peek, bump), its own CA, request_header_add.
#   * HAProxy: a reverse proxy terminating TLS with the upstream's certificate, set-header,
#     re-encrypting (verify required). Clients target it directly (no CONNECT).
#
# Every load is one `egress-bench --compare 'direct' 'via peer' --pairs K` (A B A B ...), so each
# ratio comes from one run. Per peer and load it records req/s, ratio, p50/p99, the CPU seconds
# the peer's processes used over the comparison divided by the requests sent through it, and
# their peak RSS (VmHWM, reset before each load). Writes the section between
# <!-- peers:begin --> and <!-- peers:end --> of bench/RESULTS.md and the chart bench/peers.svg.
#
# Environment: PEERS_DURATION (5s) and PEERS_PAIRS (3) per compared run; PEERS_WARMUP (1s, not
# counted) before each run of a comparison; PEERS_ONLY (peer names) and
# PEERS_LOADS (load names) to run a subset; PEERS_RESULTS / PEERS_SVG to write elsewhere;
# PEERS_KEEP=1 keeps the temp dir. Missing Debian packages are installed with apt-get (root).
# PEERS_CLIENT=go drives the loads with bench/goload (Go's net/http, the client issue 5's
# reference figures were measured with; built here with golang-go) instead of egress-bench, on
# the loads h1_c16 h2_2x50 newconn_c16 body64k_c16 by default, and writes its own section
# (<!-- peers-go:begin --> ... <!-- peers-go:end -->) and chart (bench/peers-go.svg).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
BUILD_ARG=${1:-build}
BUILD=$(cd "$BUILD_ARG" && pwd)
EGRESSD=$BUILD/egressd
BENCH=$BUILD/bench/egress-bench
[ -x "$BENCH" ] || BENCH=$BUILD/egress-bench
for b in "$EGRESSD" "$BENCH"; do
  [ -x "$b" ] || { echo "peers.sh: $b not found (build egressd and egress-bench first)" >&2; exit 1; }
done
DUR=${PEERS_DURATION:-5s}
PAIRS=${PEERS_PAIRS:-3}
WARM=${PEERS_WARMUP:-1s}
PEERS=${PEERS_ONLY:-egressd haproxy mitmproxy squid}
CLIENT=${PEERS_CLIENT:-egress-bench}
case $CLIENT in
  egress-bench)
    LOADS=${PEERS_LOADS:-h1_c1 h1_c16 h1_c64 h2_2x50 newconn_c16 body64k_c16 rate2000}
    OUT_SVG=${PEERS_SVG:-$HERE/peers.svg}
    MARK=peers ;;
  go)
    LOADS=${PEERS_LOADS:-h1_c16 h2_2x50 newconn_c16 body64k_c16}  # goload has no open-loop mode
    OUT_SVG=${PEERS_SVG:-$HERE/peers-go.svg}
    MARK=peers-go ;;
  *) echo "peers.sh: PEERS_CLIENT must be egress-bench or go" >&2; exit 2 ;;
esac
OUT_MD=${PEERS_RESULTS:-$HERE/RESULTS.md}
HOST=localhost   # the upstream's name: in its certificate, SNI, egressd's pin and Host
PY=/usr/bin/python3
log() { printf '[peers] %s\n' "$*" >&2; }

# ---------------------------------------------------------------- packages (only if missing)
install_missing() {
  local need=() squid_ok=0
  command -v openssl >/dev/null || need+=(openssl)
  [ -x "$PY" ] || need+=(python3)
  command -v nginx >/dev/null || need+=(NGINX)
  command -v mitmdump >/dev/null || need+=(mitmproxy)
  if command -v squid >/dev/null && squid -v 2>/dev/null | grep -q -- '--with-openssl' \
     && [ -x /usr/lib/squid/security_file_certgen ]; then squid_ok=1; fi
  [ "$squid_ok" = 1 ] || need+=(squid-openssl)
  command -v haproxy >/dev/null || need+=(haproxy)
  command -v gnuplot >/dev/null || need+=(gnuplot-nox)
  if [ "$CLIENT" = go ]; then command -v go >/dev/null || need+=(golang-go); fi
  [ ${#need[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ]; then
    log "missing packages (${need[*]}); run as root or apt-get install them"; return 0
  fi
  log "installing: ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  local i
  for i in "${!need[@]}"; do
    if [ "${need[$i]}" = NGINX ]; then  # nginx-light is gone from newer Debian releases
      if apt-cache show nginx-light >/dev/null 2>&1; then need[i]=nginx-light; else need[i]=nginx; fi
    fi
  done
  # Packaged services must not start on their default ports (nginx :80, squid :3128) while
  # installing: a policy-rc.d that forbids it, unless the system has one already.
  local made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d
    made_policy=1
  fi
  local rc=0
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" \
    >&2 || rc=$?
  [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  [ "$rc" = 0 ] || log "apt-get install failed ($rc); the peers it would have brought are skipped"
}
install_missing

# ---------------------------------------------------------------- temp dir, cleanup
W=$(mktemp -d /tmp/egress-peers.XXXXXX)
chmod 711 "$W"   # squid drops to user proxy and must reach its own folder
PIDS=()
cleanup() {
  local rc=$?
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
  done
  wait 2>/dev/null || true
  if [ "${PEERS_KEEP:-0}" = 1 ] || [ "$rc" != 0 ]; then
    log "temp dir kept: $W"
  else
    rm -rf "$W"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$W/pki" "$W/nginx" "$W/egressd" "$W/mitm" "$W/squid" "$W/haproxy" "$W/res"
chmod 755 "$W/pki" "$W/nginx"

if [ "$CLIENT" = go ]; then  # standard library only: builds offline
  log "building bench/goload"
  (cd "$HERE/goload" && GOCACHE="$W/gocache" GOPATH="$W/gopath" GOPROXY=off GOFLAGS=-mod=mod \
    go build -o "$W/goload" .) || { log "go build failed"; exit 1; }
  BENCH=$W/goload
fi

# Free ports, all picked by one process so that they differ.
read -r UP_H1 UP_H2 EG EG_ADMIN MITM SQUID HA_H1 HA_H2 < <("$PY" -c '
import socket
ss = [socket.socket() for _ in range(8)]
for s in ss: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in ss])')

SECRET="peers-bench-$(openssl rand -hex 16)"
printf '%s' "$SECRET" > "$W/secret"; chmod 600 "$W/secret"
PROXY_TOKEN=$(openssl rand -hex 12)
printf '%s' "$PROXY_TOKEN" > "$W/egressd/run.token"; chmod 600 "$W/egressd/run.token"

render() {  # render TEMPLATE OUT: fill in @NAME@
  sed -e "s|@W@|$W|g" -e "s|@HOST@|$HOST|g" -e "s|@SECRET@|$SECRET|g" \
      -e "s|@UP_H1@|$UP_H1|g" -e "s|@UP_H2@|$UP_H2|g" -e "s|@EG@|$EG|g" \
      -e "s|@EG_ADMIN@|$EG_ADMIN|g" -e "s|@MITM@|$MITM|g" -e "s|@SQUID@|$SQUID|g" \
      -e "s|@HA_H1@|$HA_H1|g" -e "s|@HA_H2@|$HA_H2|g" "$1" > "$2"
}

# ---------------------------------------------------------------- test PKI
ossl() { openssl "$@" 2>>"$W/pki/openssl.log"; }
ossl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=peers-bench-ca \
  -keyout "$W/pki/ca.key" -out "$W/pki/ca.pem"
ossl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$HOST" \
  -keyout "$W/pki/up.key" -out "$W/pki/up.csr"
printf 'subjectAltName=DNS:%s,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' "$HOST" > "$W/pki/ext"
ossl x509 -req -in "$W/pki/up.csr" -CA "$W/pki/ca.pem" -CAkey "$W/pki/ca.key" -CAcreateserial \
  -days 2 -extfile "$W/pki/ext" -out "$W/pki/up.pem"
cat "$W/pki/up.pem" "$W/pki/up.key" > "$W/pki/up-full.pem"
chmod 644 "$W/pki/ca.pem"
chmod 600 "$W/pki/ca.key" "$W/pki/up.key" "$W/pki/up-full.pem"
ossl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=peers-bench-squid-ca \
  -keyout "$W/squid/ca.key" -out "$W/squid/ca.pem"

# ---------------------------------------------------------------- helpers
wait_port() {  # wait_port PORT PID: 0 when PORT accepts, 1 if PID died or 20 s passed
  local _
  for _ in $(seq 200); do
    kill -0 "$2" 2>/dev/null || return 1
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}
mark_down() {  # mark_down PEER REASON
  printf '%s\n' "$2" > "$W/res/$1.down"
  log "$1: not measured: $2"
}
is_up() { [ ! -e "$W/res/$1.down" ]; }
last_lines() {  # the first error line of a log, or its last line
  local l
  l=$(grep -m1 -iE 'alert|fatal|emerg|error' "$1" 2>/dev/null || tail -n 1 "$1" 2>/dev/null || true)
  printf '%s' "$l" | tr -s ' ' | tr -d '|' | cut -c1-200
}
declare -A PID_OF

# ---------------------------------------------------------------- upstream: nginx
head -c 65536 /dev/urandom > "$W/nginx/64k.bin"; chmod 644 "$W/nginx/64k.bin"
render "$HERE/peers/nginx.conf.in" "$W/nginx/nginx.conf"
nginx -p "$W/nginx" -c "$W/nginx/nginx.conf" -g 'daemon off;' 2> "$W/nginx/stderr.log" &
PIDS+=($!); NGINX_PID=$!
if ! wait_port "$UP_H1" "$NGINX_PID"; then
  log "nginx did not start: $(last_lines "$W/nginx/stderr.log") $(last_lines "$W/nginx/error.log")"
  exit 1
fi
CHECK=$(curl -s -o /dev/null -w '%{http_code}' --cacert "$W/pki/ca.pem" \
  -H "Authorization: Bearer $SECRET" "https://$HOST:$UP_H1/json" || true)
[ "$CHECK" = 200 ] || { log "upstream check failed (HTTP $CHECK)"; exit 1; }

# ---------------------------------------------------------------- the peers
start_egressd() {
  render "$HERE/peers/egressd.yaml.in" "$W/egressd/egressd.yaml"
  "$EGRESSD" --config "$W/egressd/egressd.yaml" 2> "$W/egressd/stderr.log" &
  PIDS+=($!); PID_OF[egressd]=$!
  if ! wait_port "$EG" "${PID_OF[egressd]}"; then
    mark_down egressd "did not start: $(last_lines "$W/egressd/stderr.log")"; return 0
  fi
  for _ in $(seq 100); do [ -s "$W/egressd/run-ca.pem" ] && break; sleep 0.1; done
}
start_haproxy() {
  command -v haproxy >/dev/null || { mark_down haproxy "haproxy is not installed"; return 0; }
  render "$HERE/peers/haproxy.cfg.in" "$W/haproxy/haproxy.cfg"
  haproxy -db -f "$W/haproxy/haproxy.cfg" > "$W/haproxy/stderr.log" 2>&1 &
  PIDS+=($!); PID_OF[haproxy]=$!
  if ! wait_port "$HA_H1" "${PID_OF[haproxy]}" || ! wait_port "$HA_H2" "${PID_OF[haproxy]}"; then
    mark_down haproxy "did not start: $(last_lines "$W/haproxy/stderr.log")"
  fi
}
start_mitmproxy() {
  command -v mitmdump >/dev/null || { mark_down mitmproxy "mitmproxy is not installed"; return 0; }
  PEERS_SECRET_FILE="$W/secret" mitmdump -q --listen-host 127.0.0.1 --listen-port "$MITM" \
    --set confdir="$W/mitm" --set ssl_verify_upstream_trusted_ca="$W/pki/ca.pem" \
    -s "$HERE/peers/mitm_addon.py" > "$W/mitm/stderr.log" 2>&1 &
  PIDS+=($!); PID_OF[mitmproxy]=$!
  if ! wait_port "$MITM" "${PID_OF[mitmproxy]}"; then
    mark_down mitmproxy "did not start: $(last_lines "$W/mitm/stderr.log")"; return 0
  fi
  [ -s "$W/mitm/mitmproxy-ca-cert.pem" ] || mark_down mitmproxy "mitmproxy made no CA certificate"
}
start_squid() {
  if ! command -v squid >/dev/null; then mark_down squid "squid is not installed"; return 0; fi
  if ! squid -v | grep -q -- '--with-openssl' || [ ! -x /usr/lib/squid/security_file_certgen ]; then
    mark_down squid "this squid has no ssl-bump (built without OpenSSL: install squid-openssl)"
    return 0
  fi
  printf '127.0.0.1 %s\n' "$HOST" > "$W/squid/hosts"
  render "$HERE/peers/squid.conf.in" "$W/squid/squid.conf"
  /usr/lib/squid/security_file_certgen -c -s "$W/squid/ssl_db" -M 16MB > "$W/squid/certgen.log" 2>&1
  if [ "$(id -u)" = 0 ]; then chown -R proxy "$W/squid" 2>/dev/null || true; fi
  squid -N -f "$W/squid/squid.conf" > "$W/squid/stderr.log" 2>&1 &
  PIDS+=($!); PID_OF[squid]=$!
  if ! wait_port "$SQUID" "${PID_OF[squid]}"; then
    mark_down squid "did not start: $(last_lines "$W/squid/stderr.log") $(last_lines "$W/squid/cache.log")"
  fi
}
for p in $PEERS; do "start_$p"; done

# The client trusts the test CA and each interceptor's CA.
cat "$W/pki/ca.pem" > "$W/all-ca.pem"
for f in "$W/egressd/run-ca.pem" "$W/mitm/mitmproxy-ca-cert.pem" "$W/squid/ca.pem"; do
  [ -s "$f" ] && cat "$f" >> "$W/all-ca.pem"
done

# ---------------------------------------------------------------- measuring
HZ=$(getconf CLK_TCK)
cpu_ticks() {  # utime+stime ("user": utime) of PID and its live children (squid helpers)
  local p t=0 v expr='$12 + $13'
  [ "${2:-}" = user ] && expr='$12'
  for p in "$1" $(pgrep -P "$1" 2>/dev/null || true); do
    v=$(sed 's/.*) //' "/proc/$p/stat" 2>/dev/null | awk "{print $expr}") || v=0
    t=$((t + ${v:-0}))
  done
  echo "$t"
}
reset_hwm() { local p; for p in "$1" $(pgrep -P "$1" 2>/dev/null || true); do echo 5 > "/proc/$p/clear_refs" 2>/dev/null || true; done; }
proxied_count() {  # requests nginx got through a proxy so far (its log is flushed each second)
  sleep 1.2
  grep -c -x -- - "$W/nginx/access.log" 2>/dev/null || true
}
hwm_kb() { awk '/^VmHWM/{print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }

load_args() {  # the common options of a load
  case $1 in
    h1_c1) echo "--connections 1" ;;
    h1_c16) echo "--connections 16" ;;
    h1_c64) echo "--connections 64" ;;
    h2_2x50) echo "--h2 --connections 2 --streams 50" ;;
    newconn_c16) echo "--new-connection --connections 16" ;;
    body64k_c16) echo "--connections 16" ;;
    rate2000) echo "--rate 2000 --connections 64" ;;
    *) log "unknown load $1"; exit 2 ;;
  esac
}
load_path() { case $1 in body64k_c16) echo 64k ;; *) echo json ;; esac; }
load_is_h2() { [ "$1" = h2_2x50 ]; }
peer_side() {  # the B words for PEER and LOAD (no quoting needed)
  local up=$UP_H1 ha=$HA_H1 path
  path=$(load_path "$2")
  if load_is_h2 "$2"; then up=$UP_H2; ha=$HA_H2; fi
  case $1 in
    egressd) echo "--proxy http://bench:$PROXY_TOKEN@127.0.0.1:$EG https://$HOST:$up/$path" ;;
    mitmproxy) echo "--proxy http://127.0.0.1:$MITM https://$HOST:$up/$path" ;;
    squid) echo "--proxy http://127.0.0.1:$SQUID https://$HOST:$up/$path" ;;
    haproxy) echo "https://$HOST:$ha/$path" ;;
  esac
}
direct_side() {
  local up=$UP_H1
  load_is_h2 "$1" && up=$UP_H2
  echo "-H 'Authorization: Bearer $SECRET' -H 'X-Peers-Direct: 1' https://$HOST:$up/$(load_path "$1")"
}
na_reason() {  # why PEER can't take LOAD, or nothing
  if load_is_h2 "$2"; then
    case $1 in squid) echo "n/a: Squid 5 speaks HTTP/1.1 only (no HTTP/2 on either leg)" ;; esac
  fi
}
meta() {  # meta LOAD PEER key=value...: one JSON object per measurement
  "$PY" -c 'import json,sys; print(json.dumps(dict(a.split("=",1) for a in sys.argv[1:])))' \
    "load=$1" "peer=$2" "${@:3}" > "$W/res/$1.$2.meta.json"
}

LOADAVG_START=$(cut -d' ' -f1-3 /proc/loadavg)
T_START=$(date +%s)
for load in $LOADS; do
  LARGS=$(load_args "$load")
  for peer in $PEERS; do
    if ! is_up "$peer"; then meta "$load" "$peer" "note=$(cat "$W/res/$peer.down")"; continue; fi
    why=$(na_reason "$peer" "$load")
    if [ -n "$why" ]; then meta "$load" "$peer" "note=$why"; continue; fi
    B=$(peer_side "$peer" "$load")
    A=$(direct_side "$load")
    pid=${PID_OF[$peer]}
    log "$load / $peer"
    # Check run through the peer (warms caches, mints certificates; not measured).
    # shellcheck disable=SC2086  # word lists built above
    "$BENCH" --cacert "$W/all-ca.pem" --json --duration 2s --requests 200 $LARGS $B \
      > "$W/res/$load.$peer.check.json" 2> "$W/res/$load.$peer.check.err" || true
    ok=$("$PY" -c 'import json,sys
try: print(json.load(open(sys.argv[1]))["requests"]["ok"])
except Exception: print(0)' "$W/res/$load.$peer.check.json")
    if [ "$ok" = 0 ]; then
      why=$("$PY" -c 'import json,sys
try:
  d=json.load(open(sys.argv[1])); e=d.get("error_samples") or {}; print(d.get("fatal_error") or "; ".join(f"{k}: {v}" for k,v in e.items()) or "no successful request")
except Exception as x: print("egress-bench failed: " + open(sys.argv[2]).read()[-200:].strip())' \
        "$W/res/$load.$peer.check.json" "$W/res/$load.$peer.check.err")
      meta "$load" "$peer" "note=failed: ${why:0:300}"
      log "$load / $peer: check run failed: $why"
      continue
    fi
    n0=$(proxied_count)
    reset_hwm "$pid"
    t0=$(cpu_ticks "$pid"); u0=$(cpu_ticks "$pid" user); s0=$(date +%s.%N)
    # shellcheck disable=SC2086
    "$BENCH" --cacert "$W/all-ca.pem" --json --duration "$DUR" --warmup "$WARM" --pairs "$PAIRS" \
      $LARGS --compare "$A" "$B" > "$W/res/$load.$peer.json" 2> "$W/res/$load.$peer.err" || true
    t1=$(cpu_ticks "$pid"); u1=$(cpu_ticks "$pid" user); s1=$(date +%s.%N)
    rss=$(hwm_kb "$pid")
    n1=$(proxied_count)
    meta "$load" "$peer" "cpu_ticks=$((t1 - t0))" "cpu_user_ticks=$((u1 - u0))" "hz=$HZ" "rss_kb=$rss" "proxied=$((n1 - n0))" \
      "wall_s=$(awk "BEGIN{print $s1 - $s0}")" "largs=$LARGS" "a=$A" "b=$B"
  done
done
LOADAVG_END=$(cut -d' ' -f1-3 /proc/loadavg)
T_END=$(date +%s)

# ---------------------------------------------------------------- report
# dpkg-query -W also answers (empty, status 0) for a package it knows of but is not installed:
# ask for the status.
installed() { [ "$(dpkg-query -W -f '${Status}' "$1" 2>/dev/null)" = "install ok installed" ]; }
ver() { if installed "$1"; then dpkg-query -W -f '${Version}' "$1"; else echo "not installed"; fi; }
NGINX_PKG=nginx-light; installed nginx-light || NGINX_PKG=nginx
PEERS_W=$W PEERS_SECRET=$SECRET PEERS_TOKEN=$PROXY_TOKEN PEERS_DUR=$DUR PEERS_PAIRS_N=$PAIRS \
  PEERS_LIST="$PEERS" PEERS_LOADS_LIST="$LOADS" PEERS_WARM=$WARM \
  M_NPROC=$(nproc) M_CPU="$(awk -F': ' '/^model name/{print $2; exit}' /proc/cpuinfo)" \
  M_KERNEL="$(uname -sr)" M_OS="$(sed -n 's/^PRETTY_NAME=//p' /etc/os-release | tr -d '"')" \
  M_MEM="$(awk '/^MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo)" \
  M_LOAD_START="$LOADAVG_START" M_LOAD_END="$LOADAVG_END" M_MINUTES=$(( (T_END - T_START + 59) / 60 )) \
  M_DATE="$(date -u +%Y-%m-%d)" \
  M_COMMIT="$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)$( \
    [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ] \
    && echo ' plus uncommitted changes in the work tree')" \
  M_BUILD_ARG="$BUILD_ARG" \
  M_BUILD_TYPE="$(sed -n 's/^CMAKE_BUILD_TYPE:STRING=//p' "$BUILD/CMakeCache.txt" 2>/dev/null || true)" \
  V_NGINX="$NGINX_PKG $(ver "$NGINX_PKG")" V_MITM="$(ver mitmproxy)" V_SQUID="$(ver squid-openssl)" \
  V_HAPROXY="$(ver haproxy)" V_OPENSSL="$(ver openssl)" V_GNUPLOT="$(ver gnuplot-nox)" \
  PEERS_SVG_NAME="$(basename "$OUT_SVG")" PEERS_CLIENT_NAME="$CLIENT" \
  V_GO="$(go version 2>/dev/null | cut -d' ' -f3 || true)" \
  "$PY" "$HERE/peers/report.py" > "$W/section.md"
cat "$W/section.md"

if ! command -v gnuplot >/dev/null; then
  log "gnuplot is not installed: $OUT_SVG not drawn"
elif gnuplot -e "datafile='$W/plot.dat'; outfile='$W/peers.svg'; peers='$PEERS'" \
     "$HERE/peers/peers.gp" 2> "$W/gnuplot.log"; then
  cp "$W/peers.svg" "$OUT_SVG"
else
  log "gnuplot failed: $(last_lines "$W/gnuplot.log")"
fi
# Replace the section between the markers (appended with markers when they are missing).
"$PY" - "$OUT_MD" "$W/section.md" "$MARK" <<'PYEOF'
import sys
path, section = sys.argv[1], open(sys.argv[2]).read().rstrip("\n") + "\n"
begin, end = "<!-- %s:begin -->" % sys.argv[3], "<!-- %s:end -->" % sys.argv[3]
try:
    text = open(path).read()
except FileNotFoundError:
    text = ""
if begin in text and end in text and text.index(begin) < text.index(end):
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    text = head + begin + "\n" + section + end + tail
else:
    text = text.rstrip("\n") + "\n\n" + begin + "\n" + section + end + "\n"
open(path + ".tmp", "w").write(text)
import os; os.replace(path + ".tmp", path)
PYEOF
log "wrote $OUT_MD ($MARK section) and $OUT_SVG"
