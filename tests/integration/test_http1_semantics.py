"""HTTP/1.1 message semantics toward the client that depend on the client or on egressd's
state rather than on the request: an HTTP/1.0 client (no chunked coding, no 100 Continue,
Transfer-Encoding ends the connection) and a drain that begins while a request is in flight
(its response says Connection: close)."""
from __future__ import annotations

import signal
import socket

import helpers


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
