#!/usr/bin/env bash
# Direct vs through egressd, measured side by side in one run with `egress-bench --compare`
# (A B A B ...: medians and per-pair ratios). Everything on loopback: a TLS upstream (nginx for
# h1, nghttpd for h2), egressd intercepting with a pinned bearer credential.
#
#   bench/compare.sh h1 [BUILD_DIR] [CONNECTIONS] [DURATION] [PAIRS]
#   bench/compare.sh h2 [BUILD_DIR] [CONNECTIONS] [STREAMS] [DURATION] [PAIRS]
#
# Needs openssl and nginx (h1: apt-get install -y nginx-light) or nghttpd (h2: nghttp2-server).
# Environment:
#   PATH_SUFFIX      upstream path (h1 or H2_UPSTREAM=nginx: json or 64k; nghttpd: 1k)
#   H2_UPSTREAM      nginx: serve h2 from nginx (as bench/peers.sh does) instead of nghttpd
#   NGINX_KEEPALIVE_REQUESTS  nginx's keepalive_requests (default 1000000; nginx's own default
#                    is 1000): requests per upstream connection before nginx closes it (h2:
#                    a GOAWAY, whose refused streams egressd sends again)
#   BENCH_ARGS       more egress-bench options (e.g. --new-connection)
#   EGRESSD_INJECT   the pin's inject (default '{type: bearer}'; e.g. '{type: aws-sigv4,
#                    access_key_id: AKIAIOSFODNN7EXAMPLE, region: us-east-1, service: s3}': the
#                    upstream does not check it, the cost of signing is measured)
#   EGRESSD_LIMITS   'key: value, ...' for a limits: section in egressd's config (e.g.
#                    'max_upstream_idle_per_host: 0' makes every request dial the upstream)
#   BENCH_BIN        the load client (default BUILD/bench/egress-bench; bench/goload takes the
#                    same options: see bench/peers.sh's PEERS_CLIENT=go)
#   PERF_OUT=FILE    records a perf profile of egressd during the run (PERF_ARGS: perf options)
#   SYSCALLS=1       counts egressd's system calls from ready to the end of the load (perf stat
#                    on the syscalls tracepoints; needs linux-perf and root) and prints them per
#                    audited request: unlike strace, it does not slow egressd down, so the
#                    batching and the EAGAINs are those of the real load
#   COMPARE_DURABLE=1  compares egressd with audit.durable off (A) and on (B) instead of direct
#                    vs egressd: two egressd processes, same upstream, same run.
#   COMPARE_WITH=DIR   compares egressd from BUILD_DIR (A) with egressd from DIR/egressd (B), two
#                    processes side by side, same config: an A/B of two builds in one run, whose
#                    per-pair ratios do not drift with the machine's load as separate runs do.
#                    The CPU and RSS figures printed after it are A's.
#   SPLIT=1          where a request's CPU goes, instead of the --compare run: PAIRS rounds of
#                    one client run each direct, through egressd and (when haproxy is installed)
#                    through HAProxy terminating and re-encrypting TLS to the same upstream
#                    (bench/peers.sh's configuration, no CONNECT); per request: the client's CPU (its rusage)
#                    and context switches, the upstream's, the proxy's, and the machine's idle
#                    time (/proc/stat). Medians over the rounds; each ratio is to the direct run
#                    of its own round. Shows what a proxy costs the processes around it.
# Prints the comparison, egressd's CPU µs per request and its peak RSS.
set -euo pipefail
PROTO=${1:?usage: compare.sh h1|h2 [BUILD_DIR] ...}
shift
BUILD=${1:-build}
if [ "$PROTO" = h2 ]; then
  CONNS=${2:-2}; STREAMS=${3:-50}; DUR=${4:-5s}; PAIRS=${5:-3}
else
  CONNS=${2:-16}; STREAMS=1; DUR=${3:-5s}; PAIRS=${4:-3}
fi
BUILD=$(cd "$BUILD" && pwd)
W=$(mktemp -d "/tmp/egress-${PROTO}bench.XXXXXX")
chmod 755 "$W"  # nginx workers (user www-data) read the 64k file from here
cleanup() { kill "${UP_PID:-}" "${EG_PID:-}" "${EG2_PID:-}" "${HA_PID:-}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Test PKI: a CA and an upstream certificate for 127.0.0.1.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=bench-ca \
  -keyout "$W/ca.key" -out "$W/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=127.0.0.1 \
  -keyout "$W/up.key" -out "$W/up.csr" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > "$W/ext"
openssl x509 -req -in "$W/up.csr" -CA "$W/ca.pem" -CAkey "$W/ca.key" -CAcreateserial -days 2 \
  -extfile "$W/ext" -out "$W/up.pem" 2>/dev/null

UP=$(free_port); PX=$(free_port); AD=$(free_port)
# nginx upstream (one worker) on $UP: a small JSON answer and a 64 KiB body. $1 is the
# listen options: "ssl" (HTTP/1.1) or "ssl http2".
start_nginx() {
  mkdir -p "$W/nginx/logs"
  head -c 65536 /dev/urandom > "$W/64k.bin"
  cat > "$W/nginx.conf" <<NGINX
worker_processes 1;
pid $W/nginx/nginx.pid;
error_log $W/nginx/logs/error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  keepalive_requests ${NGINX_KEEPALIVE_REQUESTS:-1000000};
  server {
    listen 127.0.0.1:$UP $1;
    ssl_certificate $W/up.pem;
    ssl_certificate_key $W/up.key;
    location /json { default_type application/json; return 200 '{"ok":true,"name":"egress"}'; }
    location /64k { alias $W/64k.bin; }
  }
}
NGINX
  nginx -p "$W/nginx" -c "$W/nginx.conf" -g 'daemon off;' &
  UP_PID=$!
  DEFAULT_PATH=json
}
if [ "$PROTO" = h2 ] && [ "${H2_UPSTREAM:-nghttpd}" = nginx ]; then
  start_nginx "ssl http2"  # as bench/peers.sh serves h2
  PROTO_ARGS="--h2 --streams $STREAMS"
elif [ "$PROTO" = h2 ]; then
  mkdir -p "$W/docroot"
  head -c 1024 /dev/urandom > "$W/docroot/1k"
  nghttpd --address=127.0.0.1 -d "$W/docroot" "$UP" "$W/up.key" "$W/up.pem" > "$W/nghttpd.log" 2>&1 &
  UP_PID=$!
  DEFAULT_PATH=1k
  PROTO_ARGS="--h2 --streams $STREAMS"
else
  start_nginx ssl
  PROTO_ARGS=""
fi
for _ in $(seq 100); do
  (exec 3<>"/dev/tcp/127.0.0.1/$UP") 2>/dev/null && break; sleep 0.1
done

echo "bench-token-$(openssl rand -hex 16)" > "$W/secret"
echo "benchtoken" > "$W/run.token"
INJECT=${EGRESSD_INJECT:-'{type: bearer}'}
cat > "$W/egressd.yaml" <<YAML
listen: {proxy: 127.0.0.1:$PX, admin: 127.0.0.1:$AD}
admin: {token_file: $W/admin.token}
state: {path: $W/state}
keys: {master_key_file: $W/master.key}
upstream: {ca_file: $W/ca.pem}
policy: {allow_networks: [127.0.0.1/32], allowed_ports: [$UP]}
audit: {path: $W/audit.jsonl}
log: {level: warn}
runs:
  - id: bench
    token_file: $W/run.token
    ca_cert_out: $W/run-ca.pem
    pins:
      - {host: "127.0.0.1:$UP", secret_file: $W/secret, inject: $INJECT}
${EGRESSD_LIMITS:+limits: {$EGRESSD_LIMITS\}}
YAML
"$BUILD/egressd" --config "$W/egressd.yaml" 2> "$W/egressd.log" &
EG_PID=$!
if [ -n "${PERF_OUT:-}" ]; then  # optional profile of egressd during the run
  perf record ${PERF_ARGS:--F 499} -p "$EG_PID" -o "$PERF_OUT" 2>/dev/null &
  PERF_PID=$!
fi
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$AD/readyz" >/dev/null 2>&1 && break; sleep 0.1
done
if [ -n "${SYSCALLS:-}" ]; then
  perf stat -x, -o "$W/syscalls.txt" -p "$EG_PID" -e syscalls:sys_enter_recvfrom \
    -e syscalls:sys_enter_sendto -e syscalls:sys_enter_epoll_wait -e syscalls:sys_enter_epoll_ctl \
    -e syscalls:sys_enter_write -e syscalls:sys_enter_futex 2>/dev/null &
  STAT_PID=$!
fi
cat "$W/ca.pem" "$W/run-ca.pem" > "$W/both.pem"
A_ARGS=''
B_ARGS="--proxy http://bench:benchtoken@127.0.0.1:$PX"
if [ -n "${COMPARE_DURABLE:-}${COMPARE_WITH:-}" ]; then
  PX2=$(free_port); AD2=$(free_port); mkdir -p "$W/d"
  DURABLE=${COMPARE_DURABLE:+, durable: true}
  sed -e "s/127.0.0.1:$PX,/127.0.0.1:$PX2,/" -e "s/127.0.0.1:$AD}/127.0.0.1:$AD2}/" \
      -e "s|audit: {path: $W/audit.jsonl}|audit: {path: $W/d/audit.jsonl$DURABLE}|" \
      -e "s|$W/run-ca.pem|$W/d/run-ca.pem|" -e "s|path: $W/state|path: $W/d/state|" \
      "$W/egressd.yaml" > "$W/d/egressd.yaml"
  "${COMPARE_WITH:-$BUILD}/egressd" --config "$W/d/egressd.yaml" 2> "$W/d/egressd.log" &
  EG2_PID=$!
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$AD2/readyz" >/dev/null 2>&1 && break; sleep 0.1
  done
  cat "$W/d/run-ca.pem" >> "$W/both.pem"
  A_ARGS="--proxy http://bench:benchtoken@127.0.0.1:$PX"
  B_ARGS="--proxy http://bench:benchtoken@127.0.0.1:$PX2"
  if [ -n "${COMPARE_WITH:-}" ]; then
    echo "A = egressd from $BUILD; B = egressd from $COMPARE_WITH"
  else
    echo "A = egressd, audit.durable false; B = egressd, audit.durable true"
  fi
fi

if [ -n "${SPLIT:-}" ]; then
  ticks() { local t=0 p; for p in "$@"; do t=$((t + $(awk '{print $14+$15}' "/proc/$p/stat"))); done; echo "$t"; }
  idle_ticks() { awk 'NR == 1 {print $5 + $6}' /proc/stat; }  # idle + iowait
  px_ticks() { if [ -n "$PX_PID" ]; then ticks "$PX_PID"; else echo 0; fi; }
  UP_PIDS="$UP_PID $( (pgrep -P "$UP_PID" || true) | tr "\n" " ")"  # nginx: master and worker
  MODES="direct egressd"
  if command -v haproxy >/dev/null; then
    # peers.sh's HAProxy (bench/peers/haproxy.cfg.in), both frontends on this upstream: the
    # h1 pair for an h1 load, the h2 pair for h2. The upstream certificate names localhost.
    HA_H1=$(free_port); HA_H2=$(free_port); HA=$HA_H1; [ "$PROTO" = h2 ] && HA=$HA_H2
    mkdir -p "$W/pki" "$W/haproxy"
    cat "$W/up.pem" "$W/up.key" > "$W/pki/up-full.pem"
    cp "$W/ca.pem" "$W/pki/ca.pem"
    sed -e "s|@W@|$W|g" -e "s|@HOST@|localhost|g" -e "s|@SECRET@|$(cat "$W/secret")|g" \
        -e "s|@UP_H1@|$UP|g" -e "s|@UP_H2@|$UP|g" -e "s|@HA_H1@|$HA_H1|g" -e "s|@HA_H2@|$HA_H2|g" \
        "$(dirname "$0")/peers/haproxy.cfg.in" > "$W/haproxy.cfg"
    haproxy -db -f "$W/haproxy.cfg" > "$W/haproxy.log" 2>&1 &
    HA_PID=$!
    for _ in $(seq 100); do
      (exec 3<>"/dev/tcp/127.0.0.1/$HA") 2>/dev/null && break; sleep 0.1
    done
    MODES="$MODES haproxy"
  else
    echo "haproxy is not installed: no reference proxy in this split (apt-get install -y haproxy)"
  fi
  URL_PATH=${PATH_SUFFIX:-$DEFAULT_PATH}
  : > "$W/split.tsv"
  for round in $(seq "$PAIRS"); do
    for mode in $MODES; do
      URL="https://127.0.0.1:$UP/$URL_PATH"; ARGS=''; PX_PID=''
      case $mode in
        egressd) ARGS="--proxy http://bench:benchtoken@127.0.0.1:$PX"; PX_PID=$EG_PID ;;
        haproxy) URL="https://127.0.0.1:$HA/$URL_PATH"; PX_PID=$HA_PID ;;
      esac
      u0=$(ticks $UP_PIDS); p0=$(px_ticks); i0=$(idle_ticks)
      # The client's CPU and context switches: its rusage, read by its parent.
      # shellcheck disable=SC2086  # PROTO_ARGS, BENCH_ARGS and ARGS are lists of options
      rusage=$(/usr/bin/python3 -c '
import resource, subprocess, sys
with open(sys.argv[1], "w") as out:
    rc = subprocess.call(sys.argv[2:], stdout=out)
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print(r.ru_utime + r.ru_stime, r.ru_nvcsw + r.ru_nivcsw)
sys.exit(rc)' "$W/one.json" "${BENCH_BIN:-$BUILD/bench/egress-bench}" $PROTO_ARGS ${BENCH_ARGS:-} \
        --cacert "$W/both.pem" --connections "$CONNS" --duration "$DUR" --warmup 0s $ARGS --json "$URL")
      u1=$(ticks $UP_PIDS); p1=$(px_ticks); i1=$(idle_ticks)
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$mode" "$rusage" $((u1 - u0)) $((p1 - p0)) \
        $((i1 - i0)) "$(tr -d '\n' < "$W/one.json")" >> "$W/split.tsv"
    done
  done
  /usr/bin/python3 - "$W/split.tsv" "$(getconf CLK_TCK)" <<'PY'
import json, statistics, sys
hz = int(sys.argv[2])
rounds = {}
for line in open(sys.argv[1]):
    rnd, mode, rusage, up, px, idle, js = line.rstrip("\n").split("\t")
    cpu, switches = rusage.split()
    j = json.loads(js)
    n = max(j["requests"]["ok"], 1)
    us = lambda ticks: int(ticks) * 1e6 / hz / n
    rounds.setdefault(rnd, {})[mode] = dict(
        rps=j["rps"], errors=j["requests"]["errors"], client=float(cpu) * 1e6 / n,
        switches=int(switches) / n, upstream=us(up), proxy=us(px), idle=us(idle))
modes = list(next(iter(rounds.values())))
print("per request, medians of %d rounds (µs of CPU; idle: the machine's idle time)" % len(rounds))
print("%-8s %10s %6s %8s %8s %8s %8s %8s %10s" % ("", "req/s", "ratio", "client", "upstream",
                                                   "proxy", "idle", "all", "client cs"))
for m in modes:
    rs = [r[m] for r in rounds.values() if m in r]
    med = lambda k: statistics.median(x[k] for x in rs)
    ratio = statistics.median(r[m]["rps"] / r["direct"]["rps"] for r in rounds.values() if m in r)
    total = med("client") + med("upstream") + med("proxy") + med("idle")
    errors = sum(x["errors"] for x in rs)
    print("%-8s %10.0f %6.3f %8.1f %8.1f %8.1f %8.1f %8.1f %10.2f%s" % (
        m, med("rps"), ratio, med("client"), med("upstream"), med("proxy"), med("idle"), total,
        med("switches"), "  (%d errors)" % errors if errors else ""))
PY
  exit 0
fi

cpu_ticks() { awk '{print $14+$15}' "/proc/$EG_PID/stat"; }
T0=$(cpu_ticks)
# shellcheck disable=SC2086  # PROTO_ARGS is a list of options
"${BENCH_BIN:-$BUILD/bench/egress-bench}" $PROTO_ARGS ${BENCH_ARGS:-} --cacert "$W/both.pem" --connections "$CONNS" \
  --duration "$DUR" --warmup 1s "https://127.0.0.1:$UP/${PATH_SUFFIX:-$DEFAULT_PATH}" \
  --pairs "$PAIRS" --compare "$A_ARGS" "$B_ARGS" \
  | tee "$W/compare.txt"
T1=$(cpu_ticks)
if [ -n "${PERF_PID:-}" ]; then kill -INT "$PERF_PID"; wait "$PERF_PID" 2>/dev/null || true; fi
if [ -n "${STAT_PID:-}" ]; then kill -INT "$STAT_PID"; wait "$STAT_PID" 2>/dev/null || true; fi
HZ=$(getconf CLK_TCK)
REQS=$(wc -l < "$W/audit.jsonl")
TENTHS=$(( (T1 - T0) * 10000000 / HZ / (REQS > 0 ? REQS : 1) ))  # 0.1 µs: A/B pairs differ by less than 1
echo "egressd: $REQS audited requests, CPU $((TENTHS / 10)).$((TENTHS % 10)) us/request," \
     "peak RSS $(awk '/VmHWM/{print $2" "$3}' /proc/$EG_PID/status)"
if [ -n "${STAT_PID:-}" ]; then
  awk -F, -v n="$REQS" '/sys_enter_/ { sub(/.*sys_enter_/, "", $3); printf " %s %.2f", $3, $1 / (n > 0 ? n : 1) }
      END { print "" }' "$W/syscalls.txt" | sed 's/^/egressd: system calls per request:/'
fi
if [ -n "${COMPARE_DURABLE:-}" ]; then
  echo "egressd (durable): $(grep -c '"event":"decision"' "$W/d/audit.jsonl") decision records" \
       "for $(grep -vc '"event":"decision"' "$W/d/audit.jsonl") requests"
fi
