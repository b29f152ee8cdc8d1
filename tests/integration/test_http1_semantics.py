"""HTTP/1.1 message semantics toward the client that depend on the client or on egressd's
state rather than on the request: an HTTP/1.0 client (no chunked coding, no 100 Continue,
Transfer-Encoding ends the connection) and a drain that begins while a request is in flight
(its response says Connection: close)."""
from __future__ import annotations

import signal
import socket

import helpers
from clients import curl_via, run_ca


def _proxy(e) -> helpers.Conn:
    s = socket.create_connection(("127.0.0.1", e.proxy_port), timeout=10)
    return helpers.Conn(s)


def _get(world, path: str, version: str = "1.1", extra: str = "") -> bytes:
    P = world.plain.port
    return (f"GET http://plain.test:{P}{path} HTTP/{version}\r\nHost: plain.test:{P}\r\n"
            f"Proxy-Authorization: {world.auth()}\r\n{extra}\r\n").encode()


def test_http10_client_gets_a_close_delimited_body_not_chunks(world, egressd, marker):
    # /chunked/N answers with chunked coding, which an HTTP/1.0 client cannot decode
    c = _proxy(egressd)
    try:
        c.send(_get(world, f"/chunked/70000?{marker}", "1.0"))
        raw = c.read_to_eof()
    finally:
        c.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding" not in head.lower(), head
    assert b"connection: close" in head.lower(), head
    assert len(body) == 70000


def test_http10_client_gets_no_100_continue(world, egressd, marker):
    c = _proxy(egressd)
    try:
        c.send(_get(world, f"/echo/{marker}", "1.0", "Expect: 100-continue\r\n"))
        r = helpers.read_response(c)
    finally:
        c.close()
    assert r.status == 200, r.status


def test_expect_is_answered_by_egressd_in_any_field_and_never_forwarded(world, egressd, marker):
    """100-continue in a second Expect field, or as a list member, still gets the 100; no
    expectation goes upstream (egressd answers them; an unknown one is dropped)."""
    P = world.plain.port
    for n, expect in enumerate(["Expect: foo\r\nExpect: 100-continue\r\n",
                                "Expect: bar, 100-Continue\r\n"]):
        c = _proxy(egressd)
        try:
            c.send((f"POST http://plain.test:{P}/upload/{marker}-{n} HTTP/1.1\r\n"
                    f"Host: plain.test:{P}\r\nProxy-Authorization: {world.auth()}\r\n"
                    f"Content-Length: 5\r\n{expect}\r\n").encode())
            interim = helpers.read_response(c)
            assert interim.status == 100, interim.status
            c.send(b"hello")
            r = helpers.read_response(c)
        finally:
            c.close()
        assert r.status == 200, r.status
        [seen] = world.plain.find(f"{marker}-{n}")
        assert seen.header("Expect") == [], seen.header("Expect")
    # an expectation other than 100-continue alone: dropped, the request served
    c = _proxy(egressd)
    try:
        c.send((f"POST http://plain.test:{P}/upload/{marker}-x HTTP/1.1\r\nHost: plain.test:{P}\r\n"
                f"Proxy-Authorization: {world.auth()}\r\nContent-Length: 5\r\n"
                "Expect: foo\r\n\r\nhello").encode())
        r = helpers.read_response(c)
    finally:
        c.close()
    assert r.status == 200, r.status
    [seen] = world.plain.find(f"{marker}-x")
    assert seen.header("Expect") == []


def test_http10_request_with_transfer_encoding_ends_the_connection(world, egressd, marker):
    P = world.plain.port
    c = _proxy(egressd)
    try:
        c.send((f"POST http://plain.test:{P}/upload/{marker} HTTP/1.0\r\nHost: plain.test:{P}\r\n"
                f"Proxy-Authorization: {world.auth()}\r\nConnection: keep-alive\r\n"
                "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n").encode()
               + _get(world, f"/echo/{marker}-second"))
        r = helpers.read_response(c)
        rest = c.read_to_eof()
    finally:
        c.close()
    assert r.status == 200 and (r.header("Connection") or "").lower() == "close"
    assert rest == b"", "a request pipelined behind faulty framing was served"
    assert world.plain.find(f"{marker}-second") == []


def test_drain_beginning_mid_request_answers_with_connection_close(world, factory, marker):
    e = factory.start()
    c = _proxy(e)
    try:
        c.send(_get(world, f"/delay/1500?{marker}"))
        helpers.poll(lambda: world.plain.find(marker), 5.0, "the request at the upstream")
        e.proc.send_signal(signal.SIGTERM)
        r = helpers.read_response(c)
        assert r.status == 200
        assert (r.header("Connection") or "").lower() == "close"
        assert c.read_to_eof() == b""
    finally:
        c.close()
    assert e.proc.wait(timeout=15) == 0


def test_a_refused_head_in_a_tunnel_is_a_head_alone(world, egressd):
    """The refusal of a HEAD has no body (RFC 9110 9.3.2): its Content-Length is what a GET
    would get, and the bytes of a body would be read as the next response on the
    connection it keeps alive."""
    U = world.U
    c = helpers.tunnel(egressd.proxy_port, "lim.test", U, world.auth(), run_ca(egressd, "r1"))
    try:
        c.send(f"HEAD /not-echo HTTP/1.1\r\nHost: lim.test:{U}\r\n\r\n".encode())
        r = helpers.read_response(c, head_request=True)
        assert r.status == 403 and r.egress_reason == "no_matching_pin", (r.status, r.headers)
        c.send(f"GET /echo/after-head HTTP/1.1\r\nHost: lim.test:{U}\r\n\r\n".encode())
        r2 = helpers.read_response(c)
        assert r2.status == 200, (r2.status, r2.body[:200])
    finally:
        c.close()


def test_a_refused_absolute_form_head_is_a_head_alone(world, egressd):
    P = world.plain.port
    c = _proxy(egressd)
    try:
        c.send((f"HEAD http://unlisted.test:{P}/x HTTP/1.1\r\nHost: unlisted.test:{P}\r\n"
                f"Proxy-Authorization: {world.auth()}\r\n\r\n").encode())
        r = helpers.read_response(c, head_request=True)
        assert r.status == 403 and r.egress_reason == "host_not_allowed", (r.status, r.headers)
        c.send(_get(world, "/echo/after-head"))
        r2 = helpers.read_response(c)
        assert r2.status == 200, (r2.status, r2.body[:200])
    finally:
        c.close()


def test_a_refused_head_on_http2_ends_with_its_head(world, egressd):
    """On HTTP/2 a DATA frame on a HEAD's stream is a stream error: curl would see
    PROTOCOL_ERROR (exit 92) instead of the status. Both requests share the connection (the
    pin allows GET only: both HEADs are refused)."""
    U = world.U
    r = curl_via(world, egressd, f"https://lim.test:{U}/not-echo", "--http2", "-I",
                 f"https://lim.test:{U}/echo/after-head", timeout=20)
    out = r.stdout.decode(errors="replace")
    assert r.returncode == 0, helpers.redact_secrets(r.stderr.decode(errors="replace"))
    assert out.count("HTTP/2 403") == 2, out
    assert out.lower().count("x-egress-reason: no_matching_pin") == 2, out
