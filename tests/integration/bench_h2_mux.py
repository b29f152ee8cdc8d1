"""h2 multiplexed throughput, direct vs through egressd (2 connections x 50 streams in flight).

Not collected by default (name). Run explicitly:
    cd tests/integration && EGRESSD_BIN=... /usr/bin/python3 -m pytest -q -s -p no:cacheprovider bench_h2_mux.py

Upstream: nghttpd (C, TLS, ALPN h2) serving a 1 KiB file. Client: python3-h2, one thread per
connection, keeping 50 streams in flight. egress-bench has no HTTP/2 driver yet (issue 5), and
h2load cannot go through a proxy, so the client here is Python: it is the bottleneck on both
paths, which makes the ratio an upper bound; the CPU cost egressd pays per request is the
figure that does not depend on the client.
"""
from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import threading
import time

import h2.config
import h2.connection
import h2.events
import pytest

import helpers
from upstream import free_port

DURATION = float(os.environ.get("H2_BENCH_SECONDS", "5"))
CONNS, STREAMS = 2, 50


def clk_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return int(parts[11]) + int(parts[12])  # utime + stime


def drive(sock_factory, authority: str, path: str, deadline: float, out: list):
    s = sock_factory()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                                header_encoding="utf-8"))
    conn.initiate_connection()
    conn.increment_flow_control_window(1 << 24)
    s.sendall(conn.data_to_send())
    done = 0
    inflight = set()
    hdrs = [(":method", "GET"), (":scheme", "https"), (":authority", authority), (":path", path)]

    def fill():
        while len(inflight) < STREAMS and time.monotonic() < deadline:
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, hdrs, end_stream=True)
            inflight.add(sid)
    fill()
    s.sendall(conn.data_to_send())
    while inflight:
        data = s.recv(65536)
        if not data:
            break
        for ev in conn.receive_data(data):
            if isinstance(ev, h2.events.DataReceived):
                conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded):
                inflight.discard(ev.stream_id)
                done += 1
            elif isinstance(ev, h2.events.StreamReset):
                inflight.discard(ev.stream_id)
        fill()
        s.sendall(conn.data_to_send())
    s.close()
    out.append(done)


def run(sock_factory, authority, path):
    deadline = time.monotonic() + DURATION
    out: list[int] = []
    ts = [threading.Thread(target=drive, args=(sock_factory, authority, path, deadline, out))
          for _ in range(CONNS)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(out), time.monotonic() - t0


@pytest.mark.skipif(shutil.which("nghttpd") is None, reason="nghttpd not installed")
def test_h2_mux_direct_vs_egressd(world, factory, tmp_path):
    docroot = tmp_path / "www"
    docroot.mkdir()
    (docroot / "1k").write_bytes(b"x" * 1024)
    port = free_port()
    ng = subprocess.Popen(["nghttpd", "-d", str(docroot), str(port), world.pki.server_key,
                           world.pki.server_cert], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    try:
        helpers.poll(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, 5, "nghttpd")

        def mutate(cfg):
            cfg["runs"][0]["pins"].append({"host": f"api.test:{port}",
                                           "secret_file": world.secret_files["api_token"],
                                           "inject": {"type": "bearer"}})
            cfg["policy"]["allowed_ports"].append(port)
            cfg["log"] = {"level": "warn"}
            cfg["audit"]["path"] = "/dev/null"
        e = factory.start(mutate)

        def direct():
            ctx = ssl.create_default_context(cafile=world.pki.ca)
            ctx.set_alpn_protocols(["h2"])
            s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)),
                                server_hostname="api.test")
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s

        def via():
            c, r = helpers.proxy_connect(e.proxy_port, f"api.test:{port}", world.auth())
            assert r.status == 200
            ctx = ssl.create_default_context(cafile=e.config["runs"][0]["ca_cert_out"])
            ctx.set_alpn_protocols(["h2"])
            c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return ctx.wrap_socket(c.sock, server_hostname="api.test")

        a = f"api.test:{port}"
        d_n, d_t = run(direct, a, "/1k")
        t0 = clk_ticks(e.proc.pid)
        v_n, v_t = run(via, a, "/1k")
        cpu_s = (clk_ticks(e.proc.pid) - t0) / os.sysconf("SC_CLK_TCK")
        print(f"\nH2MUX {CONNS}x{STREAMS} {DURATION:.0f}s: direct {d_n / d_t:.0f} req/s, "
              f"via egressd {v_n / v_t:.0f} req/s, ratio {(v_n / v_t) / (d_n / d_t):.3f}, "
              f"egressd {cpu_s * 1e6 / max(v_n, 1):.0f} us CPU/request, "
              f"peak RSS {e.vm_hwm_kib() // 1024} MiB")
        assert v_n > 0 and d_n > 0
    finally:
        ng.terminate()
        ng.wait(timeout=10)
