#!/usr/bin/env python3
"""WebSocket through egressd next to a direct connection: round-trip latency of small messages
and echo throughput of 64 KiB ones, alternating direct (A) and through egressd (B) runs so a
drifting machine biases neither. Client: websocket-client; origin: Python's websockets (the
integration tests' ws_upstream.py); egressd pins the origin's host with a bearer credential, so
the frames from the origin go through the frame scrubber.

    bench/ws_echo.py [BUILD_DIR] [PAIRS]     # default: build 5

Needs python3-websocket and python3-websockets (scripts/install-deps.sh)."""
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))

import websocket  # noqa: E402

import helpers  # noqa: E402
from upstream import free_port, make_pki  # noqa: E402
from ws_upstream import WsUpstream  # noqa: E402

BUILD = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "build"))
PAIRS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
ROUND_TRIPS = 1000      # per run
BULK_SECONDS = 2.0      # per run
BULK = os.urandom(64 * 1024)


def start(tmp: str, pki, ws: WsUpstream) -> helpers.Egressd:
    secret = os.path.join(tmp, "secret")
    with open(secret, "w") as f:
        f.write("sk-bench-" + os.urandom(16).hex())
    var = os.path.join(tmp, "var")
    pp, ap = free_port(), free_port()
    cfg = {
        "listen": {"proxy": f"127.0.0.1:{pp}", "admin": f"127.0.0.1:{ap}"},
        "admin": {"token_file": os.path.join(var, "admin.token")},
        "state": {"backend": "file", "path": os.path.join(var, "state")},
        "keys": {"master_key_file": os.path.join(var, "master.key")},
        "upstream": {"ca_file": pki.ca},
        "resolver": {"overrides": {"api.test": ["127.0.0.1"]}},
        "policy": {"allow_networks": ["127.0.0.1/32"], "allowed_ports": [ws.port]},
        "log": {"level": "warn"},
        "audit": {"path": os.path.join(tmp, "audit.jsonl")},
        "runs": [{"id": "bench", "token_file": None, "ca_cert_out": os.path.join(tmp, "ca.pem"),
                  "pins": [{"host": f"api.test:{ws.port}", "secret_file": secret,
                            "inject": {"type": "bearer"}}]}],
    }
    return helpers.Egressd(os.path.join(BUILD, "egressd"), tmp, cfg, {}).start()


def connect(ws: WsUpstream, e: helpers.Egressd | None, pki) -> websocket.WebSocket:
    if e is None:
        return websocket.create_connection(
            f"wss://127.0.0.1:{ws.port}/bench", timeout=10,
            sslopt={"ca_certs": pki.ca, "check_hostname": False})
    return websocket.create_connection(
        f"wss://api.test:{ws.port}/bench", timeout=10, http_proxy_host="127.0.0.1",
        http_proxy_port=e.proxy_port, proxy_type="http",
        sslopt={"ca_certs": os.path.join(e.workdir, "ca.pem")})


def round_trips(c) -> list[float]:
    out = []
    for i in range(ROUND_TRIPS):
        t0 = time.perf_counter()
        c.send("echo:ping-%06d" % i)
        c.recv()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def bulk(c) -> float:
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < BULK_SECONDS:
        c.send_binary(BULK)
        n += len(c.recv())
    return n / (time.perf_counter() - t0) / 1e6


def main():
    tmp = tempfile.mkdtemp(prefix="ws-echo-")
    pki = make_pki(os.path.join(tmp, "pki"))
    ws = WsUpstream(pki.server_cert, pki.server_key)
    wd = os.path.join(tmp, "egressd")
    os.makedirs(wd)
    e = start(wd, pki, ws)
    try:
        lat = {"direct": [], "egressd": []}
        rate = {"direct": [], "egressd": []}
        for _ in range(PAIRS):
            for name, via in (("direct", None), ("egressd", e)):
                c = connect(ws, via, pki)
                try:
                    lat[name].append(statistics.median(round_trips(c)))
                    rate[name].append(bulk(c))
                finally:
                    c.close()
        med = {k: statistics.median(v) for k, v in lat.items()}
        thr = {k: statistics.median(v) for k, v in rate.items()}
        print(f"round trip, 32-byte text (median of {PAIRS} runs' medians of {ROUND_TRIPS}): "
              f"direct {med['direct']:.0f} us, egressd {med['egressd']:.0f} us, "
              f"added {med['egressd'] - med['direct']:.0f} us")
        print(f"echo of 64 KiB binary frames ({BULK_SECONDS:.0f} s runs, median of {PAIRS}): "
              f"direct {thr['direct']:.0f} MB/s, egressd {thr['egressd']:.0f} MB/s "
              f"({thr['egressd'] / thr['direct']:.2f}x)")
        print("per run:", {k: [round(x) for x in v] for k, v in lat.items()},
              {k: [round(x) for x in v] for k, v in rate.items()})
    finally:
        e.stop()
        ws.close()


if __name__ == "__main__":
    main()
