"""Answers given before a request body was taken to its end. An upstream that refuses an
upload from its head (401 on a bad credential, 413 on a size) answers and closes without
reading the rest: that answer is the client's (not 502 upstream_write_failed), the rest of the
body is not forwarded, and the connection never goes back to the pool. An early answer that
keeps the connection (the server drains the body) lets the upload go on (RFC 9112 9.3). When egressd itself
answers early (a refusal) or relays such an answer, it closes the client connection with a
lingering close (limits.linger_timeout), so the client reads the answer instead of a reset."""
from __future__ import annotations

import os
import socket
import time

import h2.exceptions
import pytest

import helpers
from clients import curl_via
from helpers import poll
from h2_helpers import H2Client

MiB = 1 << 20


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("early") / "upload.bin"
    with open(p, "wb") as f:
        f.write(os.urandom(16 * MiB))
    return str(p)


def _record(e, marker: str) -> dict:
    return e.wait_audit(lambda r: marker in r.get("path", "") and r.get("status") is not None)[-1]


def _curl_upload(world, e, url: str, *extra: str, run: str = "r1"):
    # No Expect: 100-continue, so the body is on its way while the answer comes back.
    return curl_via(world, e, url, "-sS", "-o", "-", "-w", "\n%{http_code}", "-H", "Expect:",
                    *extra, run=run)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_upstream_early_401_reaches_an_http1_client(world, egressd, marker, big_file, framing):
    url = f"https://api.test:{world.U}/reject-upload/{marker}?status=401"
    body = ["--data-binary", f"@{big_file}"] if framing == "content-length" else ["-T", big_file]
    r = _curl_upload(world, egressd, url, "--http1.1", *body)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert out.endswith("\n401") and out.startswith("rejected"), out
    rec = _record(egressd, marker)
    assert rec["status"] == 401 and rec["decision"] == "allow", rec
    assert rec["reason"] == "upstream_early_response", rec
    assert rec["bytes_in"] < 16 * MiB, "the whole body went through after the answer"
    assert egressd.leaks() == []


def test_upstream_early_413_reaches_an_http2_client(world, egressd, marker):
    c = H2Client(egressd, world, "api.test", world.U)
    try:
        total = 16 * MiB
        sid = c.headers(f"/reject-upload/{marker}?status=413", "POST",
                        [("content-length", str(total))], end_stream=False)
        r = c.responses[sid]
        left = total
        deadline = time.monotonic() + 20
        while left > 0 and r["reset"] is None and not r["ended"] and time.monotonic() < deadline:
            n = min(left, c.conn.local_flow_control_window(sid), c.conn.max_outbound_frame_size)
            if n <= 0:
                c.pump(until=lambda: (c.conn.local_flow_control_window(sid) > 0
                                      or r["reset"] is not None or r["ended"]), timeout=5)
                continue
            try:
                c.conn.send_data(sid, b"u" * n)
            except h2.exceptions.StreamClosedError:
                break
            left -= n
            c.flush()
        c.pump(until=lambda: r["ended"] or r["reset"] is not None, timeout=5)
    finally:
        c.close()
    assert r["status"] == 413 and r["body"] == b"rejected\n", r
    assert r["ended"], r
    # RFC 9113 8.1: a complete early response, then RST_STREAM(NO_ERROR) to stop the upload
    assert r["reset"] == 0, r
    assert left > 0, "the whole body was taken though the answer had come"
    rec = _record(egressd, marker)
    assert rec["status"] == 413 and rec["reason"] == "upstream_early_response", rec
    assert rec["proto_in"] == "h2"


def test_early_answer_keeping_the_connection_lets_the_upload_finish(world, egressd, marker,
                                                                    big_file):
    # keep=1: the upstream answers without Connection: close, then reads the whole upload.
    # RFC 9112 9.3 stops the body only for an answer that closes: this one gets all of it,
    # and the connection, left in step, serves the next requests.
    url = f"https://api.test:{world.U}/reject-upload/{marker}?status=401&keep=1"
    r = _curl_upload(world, egressd, url, "--http1.1", "--data-binary", f"@{big_file}")
    assert r.stdout.decode().endswith("\n401"), r.stdout[-200:]
    seen = world.upstream.find(marker)
    poll(lambda: seen[0].body_len == 16 * MiB, 10, "the whole body at the upstream")
    rec = _record(egressd, marker)
    assert rec["status"] == 401 and rec["reason"] != "upstream_early_response", rec
    for i in range(3):
        got = curl_via(world, egressd, f"https://api.test:{world.U}/echo/{marker}-after{i}",
                       "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--http1.1", timeout=10)
        assert got.stdout == b"200", (i, got.stdout, got.stderr)


def test_unasked_100_continue_does_not_stop_the_upload(world, egressd, marker, big_file):
    url = f"https://api.test:{world.U}/upload/{marker}?continue=1"
    r = _curl_upload(world, egressd, url, "--http1.1", "--data-binary", f"@{big_file}",
                     "-H", "Content-Type: application/octet-stream")
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert out.endswith("\n200") and f'"length": {16 * MiB}' in out, out[-300:]
    rec = _record(egressd, marker)
    assert rec["status"] == 200 and rec["reason"] != "upstream_early_response", rec


def test_a_refusal_with_the_body_unread_reaches_the_client(world, egressd, marker, big_file):
    # lim.test's pin allows GET only: a POST is refused from its head, its 16 MiB body unread.
    # Without a lingering close, the client still sending gets a reset, not the refusal.
    for i in range(3):
        url = f"https://lim.test:{world.U}/echo/{marker}-{i}"
        r = _curl_upload(world, egressd, url, "--http1.1", "--data-binary",
                         f"@{big_file}")
        assert r.returncode == 0, r.stderr
        assert r.stdout.decode().endswith("\n403"), r.stdout[-200:]


def test_plain_http_refusal_with_the_body_unread_reaches_the_client(world, egressd, marker,
                                                                    big_file):
    # run r2 has no pins: a cleartext POST to a host it may not reach is refused from its head
    url = f"http://unlisted.test:{world.plain.port}/upload/{marker}"
    r = _curl_upload(world, egressd, url, "--data-binary", f"@{big_file}", run="r2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().endswith("\n403"), r.stdout[-200:]


def test_lingering_is_bounded_by_linger_timeout(world, factory, marker):
    # A client that neither reads nor closes after its refusal: egressd drops the
    # connection linger_timeout after the answer, not at idle_timeout.
    e = factory.start(mutate=lambda cfg: cfg["limits"].update(linger_timeout="300ms",
                                                              idle_timeout="30s"))
    P = world.plain.port
    s = helpers.Conn(socket.create_connection(("127.0.0.1", e.proxy_port), timeout=10))
    try:
        s.send((f"POST http://unlisted.test:{P}/upload/{marker} HTTP/1.1\r\n"
                f"Host: unlisted.test:{P}\r\nProxy-Authorization: {world.auth('r2')}\r\n"
                f"Content-Length: {64 * MiB}\r\n\r\n").encode() + b"x" * 65536)
        t0 = time.monotonic()
        r = helpers.read_response(s)
        assert r.status == 403
        assert s.read_to_eof() == b""  # the FIN comes with the answer
        s.sock.settimeout(5)
        # still sending: the connection goes once linger_timeout has passed
        with pytest.raises(OSError):
            while time.monotonic() - t0 < 5:
                s.sock.sendall(b"y" * 65536)
                time.sleep(0.01)
        assert time.monotonic() - t0 < 3, "the lingering close outlived linger_timeout"
    finally:
        s.close()
