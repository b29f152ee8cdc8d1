"""A client that goes away while egressd waits for its upstream's answer (an HTTP/1.1 client's
close, TLS close_notify or reset; an HTTP/2 client's RST_STREAM is in test_h2_limits.py) has
its upstream part given up at once: the request is audited client_aborted (status 0) when the
client leaves, not when the upstream answers, and its connection no longer counts against
limits.connections_per_run. A client that pipelines its next request meanwhile is not taken for
gone: the next request is served after the first."""
from __future__ import annotations

import socket
import subprocess
import time

import helpers
from clients import proxy_env, run_ca
from helpers import poll


def _curl_giving_up(e, world, url: str, after_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["curl", "-sS", "--http1.1", "--max-time", str(after_s), "--cacert", run_ca(e, "r1"),
         "-o", "/dev/null", url],
        env=proxy_env(e, "r1", world.tokens["r1"]), capture_output=True, timeout=30)


def _delay_records(e) -> list[dict]:
    # the audit path has no query, so these egressd's /delay records are found by path
    return [r for r in e.audit_records() if r.get("path", "").startswith("/delay/")]


def test_https_client_closing_aborts_the_upstream_wait(world, factory, marker):
    e = factory.start()
    t0 = time.monotonic()
    r = _curl_giving_up(e, world, f"https://api.test:{world.U}/delay/8000?{marker}", 1)
    assert r.returncode == 28, r.stderr  # curl's own timeout
    recs = e.wait_audit(lambda a: a.get("path") == "/delay/8000", timeout=5)
    assert time.monotonic() - t0 < 5, "recorded when the upstream answered, not when curl left"
    assert recs[0]["reason"] == "client_aborted" and recs[0]["status"] == 0, recs
    assert recs[0]["duration_ms"] < 4000, recs


def test_cleartext_client_closing_aborts_the_upstream_wait(world, factory, marker):
    e = factory.start()
    P = world.plain.port
    c = helpers.Conn(socket.create_connection(("127.0.0.1", e.proxy_port), timeout=10))
    c.send((f"GET http://plain.test:{P}/delay/8000?{marker} HTTP/1.1\r\nHost: plain.test:{P}\r\n"
            f"Proxy-Authorization: {world.auth()}\r\n\r\n").encode())
    poll(lambda: len(world.plain.find(marker)) == 1, 5, "the request at the upstream")
    t0 = time.monotonic()
    c.close()
    recs = e.wait_audit(lambda a: a.get("path") == "/delay/8000", timeout=5)
    assert time.monotonic() - t0 < 4
    assert recs[0]["reason"] == "client_aborted" and recs[0]["status"] == 0, recs


def test_clients_that_gave_up_free_their_connection_slots(world, factory, marker):
    # connections_per_run 2: two requests abandoned on a slow upstream no longer hold both
    # slots until it answers (8 s), so the next client is served, not refused 429.
    e = factory.start(mutate=lambda c: c["limits"].update(connections_per_run=2))
    for i in range(2):
        r = _curl_giving_up(e, world, f"https://api.test:{world.U}/delay/8000?{marker}-{i}", 1)
        assert r.returncode == 28, r.stderr
    poll(lambda: len(_delay_records(e)) == 2, 5, "both abandoned requests recorded")
    r = subprocess.run(
        ["curl", "-sS", "--http1.1", "--max-time", "5", "--cacert", run_ca(e, "r1"),
         "-o", "/dev/null", "-w", "%{http_code}", f"https://api.test:{world.U}/echo/{marker}"],
        env=proxy_env(e, "r1", world.tokens["r1"]), capture_output=True, timeout=30)
    assert r.stdout == b"200", (r.stdout, r.stderr)


def test_pipelined_request_during_the_wait_is_not_taken_for_a_close(world, egressd, marker):
    ca = run_ca(egressd, "r1")
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), ca)
    try:
        first = (f"GET /delay/1000?{marker}-1 HTTP/1.1\r\nHost: api.test:{world.U}\r\n\r\n")
        second = (f"GET /echo/{marker}-2 HTTP/1.1\r\nHost: api.test:{world.U}\r\n\r\n")
        c.send(first.encode())
        poll(lambda: len(world.upstream.find(f"{marker}-1")) == 1, 5, "the first at the upstream")
        c.send(second.encode())  # arrives while egressd waits for the first answer
        r1 = helpers.read_response(c)
        r2 = helpers.read_response(c)
    finally:
        c.close()
    assert r1.status == 200 and r2.status == 200, (r1.status, r2.status)
    assert f"{marker}-2".encode() in r2.body
