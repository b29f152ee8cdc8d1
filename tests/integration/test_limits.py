"""Each limit is a named config key with a safe default; these set the key low and check that
egressd enforces it with a clear refusal while other clients keep being served."""
from __future__ import annotations

import socket
import time

import pytest

import helpers
from clients import run_ca


def _limits(**kw):
    return lambda c: c.setdefault("limits", {}).update(kw)


def _a_freed_slot_is_usable_again(e, world):
    """A CONNECT gets 200 again once a held connection closed (the close is noticed
    asynchronously: a bounded poll)."""
    deadline = time.monotonic() + 5
    while True:
        c, r = helpers.proxy_connect(e.proxy_port, f"api.test:{world.U}", world.auth())
        c.close()
        if r.status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status == 200


def test_connections_per_run_answers_429_with_retry_after(world, factory, marker):
    e = factory.start(mutate=_limits(connections_per_run=2))
    ca = run_ca(e, "r1")
    held = [helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), ca) for _ in range(2)]
    try:
        c, r = helpers.proxy_connect(e.proxy_port, f"api.test:{world.U}", world.auth())
        c.close()
        assert (r.status, r.egress_reason) == (429, "too_many_connections")
        assert r.header("Retry-After") == "1"
    finally:
        held[0].close()
    _a_freed_slot_is_usable_again(e, world)
    held[1].close()
    # The refusal is written to the client before it is audited, and the audit line reaches
    # the file when that worker's loop runs dry: on a loaded machine, after the client has
    # moved on. Polled (bounded), not read once.
    assert e.wait_audit(lambda a: a.get("reason") == "too_many_connections"
                        and a.get("status") == 429)


def test_max_header_bytes_answers_431(world, factory):
    e = factory.start(mutate=_limits(max_header_bytes=4096))
    c, r = helpers.proxy_connect(e.proxy_port, f"api.test:{world.U}", world.auth(),
                                 extra="X-Big: " + "a" * 8000 + "\r\n")
    c.close()
    assert (r.status, r.egress_reason) == (431, "header_too_large")
    # a head under the limit is served
    c, r = helpers.proxy_connect(e.proxy_port, f"api.test:{world.U}", world.auth(),
                                 extra="X-Small: " + "a" * 1000 + "\r\n")
    c.close()
    assert r.status == 200


def test_max_header_fields_answers_431_and_bounds_trailers(world, factory, marker):
    """limits.max_header_fields bounds an HTTP/1.1 head's fields (431 header_too_large) and a
    trailer section's (400 bad_framing), so per-field work stays bounded whatever fits in
    max_header_bytes (64 KiB of short fields and Connection tokens had cost ~0.7 s of CPU
    per head); a head with fewer fields is served."""
    e = factory.start(mutate=_limits(max_header_fields=20))
    many = "".join(f"X-F{i}: v\r\n" for i in range(25))
    c, r = helpers.proxy_connect(e.proxy_port, f"api.test:{world.U}", world.auth(), extra=many)
    c.close()
    assert (r.status, r.egress_reason) == (431, "header_too_large")
    few = "".join(f"X-F{i}: v\r\n" for i in range(15))
    c, r = helpers.proxy_connect(e.proxy_port, f"api.test:{world.U}", world.auth(), extra=few)
    c.close()
    assert r.status == 200
    P = world.plain.port
    for n, want in ((25, (400, "bad_framing")), (15, (200, None))):
        s = socket.create_connection(("127.0.0.1", e.proxy_port), timeout=10)
        c = helpers.Conn(s)
        trailers = "".join(f"X-T{i}: v\r\n" for i in range(n))
        c.send((f"POST http://plain.test:{P}/echo/{marker}-{n} HTTP/1.1\r\n"
                f"Host: plain.test:{P}\r\nProxy-Authorization: {world.auth()}\r\n"
                f"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n{trailers}\r\n"
                ).encode())
        r = helpers.read_response(c)
        c.close()
        assert (r.status, r.egress_reason if r.status != 200 else None) == want, n
    # The default (100) refuses the many-fields-many-tokens head at once.
    d = factory.start()
    tokens = ",".join(f"t{i}" for i in range(3000))
    head = "".join(f"t{i}: v\r\n" for i in range(3000))
    c, r = helpers.proxy_connect(d.proxy_port, f"api.test:{world.U}", world.auth(),
                                 extra=f"Connection: {tokens}\r\n{head}")
    c.close()
    assert (r.status, r.egress_reason) == (431, "header_too_large")


def test_max_header_fields_bounds_an_upstream_response_head_and_trailers(world, factory, marker):
    """limits.max_header_fields bounds an HTTP/1.1 upstream's response head (502
    upstream_bad_response, audited) and its trailer section (the response is cut, not relayed
    whole), as h2_max_header_fields bounds an HTTP/2 upstream's; fewer fields are relayed
    (before: 12 000 fields went through)."""
    e = factory.start(mutate=_limits(max_header_fields=20))
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    try:
        r = helpers.request(c, "GET", f"/fields/25/{marker}-head", f"api.test:{world.U}")
        assert (r.status, r.egress_reason) == (502, "upstream_bad_response")
    finally:
        c.close()
    [rec] = e.wait_audit(lambda a: f"{marker}-head" in (a.get("path") or ""))
    assert (rec["status"], rec["reason"]) == (502, "upstream_bad_response"), rec
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    try:
        r = helpers.request(c, "GET", f"/fields/15/{marker}-few", f"api.test:{world.U}")
        assert r.status == 200 and r.body == b"ok"
        assert r.header("X-F14") == "14"
    finally:
        c.close()
    for n, whole in ((25, False), (15, True)):
        c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
        try:
            c.send((f"GET /fields/1/{marker}-t{n}?trailers={n} HTTP/1.1\r\n"
                    f"Host: api.test:{world.U}\r\nTE: trailers\r\nConnection: close\r\n\r\n"
                    ).encode())
            c.sock.settimeout(10)
            raw = c.read_to_eof()
        finally:
            c.close()
        assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
        assert (b"\r\n0\r\n" in raw) == whole, (n, raw[-300:])
        assert (b"x-t%d: %d" % (n - 1, n - 1) in raw.lower()) == whole, n


def test_interim_heads_do_not_extend_the_wait_for_the_answer(world, factory, marker):
    """idle_timeout bounds the wait for an HTTP/1.1 upstream's answer however many interim
    (1xx) heads come before it: an upstream sending 102 Processing every 300 ms gets the client
    504 upstream_timeout near the limit (before: each interim head started the wait over, and
    the client waited as long as the upstream went on); a few quick ones are passed over."""
    e = factory.start(mutate=_limits(idle_timeout="1s"))
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    started = time.monotonic()
    try:
        r = helpers.request(c, "GET", f"/interim/10/300/{marker}", f"api.test:{world.U}")
    finally:
        c.close()
    waited = time.monotonic() - started
    assert (r.status, r.egress_reason) == (504, "upstream_timeout")
    assert 0.5 < waited < 2.5, waited
    [rec] = e.wait_audit(lambda a: marker in (a.get("path") or ""))
    assert (rec["status"], rec["reason"]) == (504, "upstream_timeout"), rec
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    try:
        r = helpers.request(c, "GET", f"/interim/2/100/{marker}-quick", f"api.test:{world.U}")
    finally:
        c.close()
    assert r.status == 200 and r.body == b'{"interim":true}'


def test_max_header_bytes_bounds_an_upstream_response_head(world, factory, marker):
    """An upstream's response head over limits.max_header_bytes is 502 upstream_bad_response
    (431 is the client's answer for its own head); one under it is relayed."""
    e = factory.start(mutate=_limits(max_header_bytes=4096))
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    try:
        big = helpers.request(c, "GET", f"/bighead/6000?m={marker}", f"api.test:{world.U}")
    finally:
        c.close()
    assert (big.status, big.egress_reason) == (502, "upstream_bad_response")
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    try:
        small = helpers.request(c, "GET", f"/bighead/1000?m={marker}", f"api.test:{world.U}")
    finally:
        c.close()
    assert small.status == 200 and small.header("X-Pad") == "p" * 1000


def test_idle_timeout_closes_an_idle_keep_alive_connection(world, factory, marker):
    e = factory.start(mutate=_limits(idle_timeout="1s"))
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    r = helpers.request(c, "GET", f"/echo/{marker}", f"api.test:{world.U}")
    assert r.status == 200
    started = time.monotonic()
    c.sock.settimeout(10)
    assert c.read_to_eof() == b""  # egressd closes the idle connection
    waited = time.monotonic() - started
    c.close()
    assert 0.5 < waited < 8, waited


def test_idle_timeout_bounds_the_wait_for_an_upstream_response(world, factory, marker):
    """idle_timeout also bounds how long egressd waits for the upstream's response head: a
    slower upstream gets the client a 504 upstream_timeout (audited) near the limit, and the
    same connection settings serve a prompt upstream."""
    e = factory.start(mutate=_limits(idle_timeout="1s"))
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    started = time.monotonic()
    r = helpers.request(c, "GET", f"/delay/4000?{marker}", f"api.test:{world.U}")
    waited = time.monotonic() - started
    c.close()
    assert (r.status, r.egress_reason) == (504, "upstream_timeout")
    assert 0.5 < waited < 3.5, waited
    [rec] = e.wait_audit(lambda a: a.get("path") == "/delay/4000")
    assert (rec["status"], rec["reason"]) == (504, "upstream_timeout"), rec
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    r = helpers.request(c, "GET", "/delay/100", f"api.test:{world.U}")
    c.close()
    assert r.status == 200


def _three_requests_on_one_tunnel(world, e, marker):
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    try:
        for i in range(3):
            r = helpers.request(c, "GET", f"/echo/{marker}-{i}", f"api.test:{world.U}")
            assert r.status == 200
    finally:
        c.close()
    return [world.upstream.find(f"{marker}-{i}") for i in range(3)]


def test_no_idle_upstream_connections_redials_and_resumes_tls(world, factory, marker):
    """max_upstream_idle_per_host: 0 keeps no pooled connection (every request dials), and
    each redial resumes the TLS session the upstream sent on the previous connection
    (upstream_tls_sessions, default on)."""
    e = factory.start(mutate=_limits(max_upstream_idle_per_host=0))
    before = world.upstream.server.connections
    seen = _three_requests_on_one_tunnel(world, e, marker)
    assert [len(s) for s in seen] == [1, 1, 1]
    assert world.upstream.server.connections - before >= 3  # no reuse: one dial per request
    assert [s[0].resumed for s in seen] == [False, True, True]
    assert all(s[0].sni == "api.test" for s in seen)  # resumption keeps SNI and verification


def test_upstream_tls_sessions_zero_never_resumes(world, factory, marker):
    e = factory.start(mutate=_limits(max_upstream_idle_per_host=0, upstream_tls_sessions=0))
    seen = _three_requests_on_one_tunnel(world, e, marker)
    assert [s[0].resumed for s in seen] == [False, False, False]


@pytest.mark.parametrize("framing", ["chunk_extension", "trailer"])
def test_max_header_bytes_bounds_chunk_lines_and_trailers(world, factory, marker, framing):
    # Beast limits neither a chunk-size line (with its extensions) nor the trailer section:
    # without a bound a client could have egressd buffer an endless one until the idle timeout.
    e = factory.start(mutate=_limits(max_header_bytes=4096))
    P = world.plain.port
    s = socket.create_connection(("127.0.0.1", e.proxy_port), timeout=10)
    c = helpers.Conn(s)
    c.send((f"POST http://plain.test:{P}/echo/{marker} HTTP/1.1\r\nHost: plain.test:{P}\r\n"
            f"Proxy-Authorization: {world.auth()}\r\nTransfer-Encoding: chunked\r\n\r\n").encode())
    c.send(b"5;x=" if framing == "chunk_extension" else b"5\r\nhello\r\n0\r\nX-T: ")
    try:  # 512 KiB of a line that never ends: egressd stops reading after ~68 KiB
        for _ in range(8):
            c.send(b"a" * 65536)
    except (BrokenPipeError, ConnectionResetError):
        pass
    r = helpers.read_response(c)
    c.close()
    assert (r.status, r.egress_reason) == (400, "bad_framing")
    assert e.wait_audit(lambda a: a.get("reason") == "bad_framing" and marker in a.get("path", ""))
    # a chunk line and trailers under the limit are served
    s = socket.create_connection(("127.0.0.1", e.proxy_port), timeout=10)
    c = helpers.Conn(s)
    c.send((f"POST http://plain.test:{P}/echo/{marker} HTTP/1.1\r\nHost: plain.test:{P}\r\n"
            f"Proxy-Authorization: {world.auth()}\r\nTransfer-Encoding: chunked\r\n\r\n"
            f"5;x={'a' * 1000}\r\nhello\r\n0\r\nX-T: {'b' * 1000}\r\n\r\n").encode())
    r = helpers.read_response(c)
    c.close()
    assert r.status == 200


def test_refusal_timeout_cuts_a_client_that_does_not_read_its_refusals(world, factory):
    """A client pipelining requests egressd refuses (403, keep-alive) and never reading the
    answers: once the refusals no longer fit the socket buffers, the one being written is
    given limits.refusal_timeout and the connection is closed; other clients are served."""
    e = factory.start(mutate=_limits(refusal_timeout="500ms"))
    req = (f"GET http://unlisted.test:{world.U}/x HTTP/1.1\r\nHost: unlisted.test:{world.U}\r\n"
           f"Proxy-Authorization: {world.auth()}\r\n\r\n").encode()
    took = helpers.send_unread_until_cut(e.proxy_port, req, limit=40000)
    assert took is not None, "egressd kept the connection of a client not reading its refusals"
    assert took < 3.0, took  # ~0.5 s from the stall
    c, r = helpers.proxy_connect(e.proxy_port, f"api.test:{world.U}", world.auth())
    c.close()
    assert r.status == 200
    assert e.wait_audit(lambda a: a.get("reason") == "host_not_allowed"
                        and a.get("host") == "unlisted.test")


def test_connections_per_run_counts_across_a_reload(world, factory):
    """The count is kept by run id: a reload (which rebuilds the run) neither resets it, so
    two held connections still fill a limit of 2, nor loses the slots they free."""
    e = factory.start(mutate=_limits(connections_per_run=2))
    ca = run_ca(e, "r1")
    held = [helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), ca) for _ in range(2)]
    try:
        e.rewrite_config(lambda c: c["policy"]["allow_hosts"].append("other.test"))
        e.reload()
        c, r = helpers.proxy_connect(e.proxy_port, f"api.test:{world.U}", world.auth())
        c.close()
        assert (r.status, r.egress_reason) == (429, "too_many_connections")
    finally:
        for h in held:
            h.close()
    _a_freed_slot_is_usable_again(e, world)


def test_max_unidentified_connections_ends_the_oldest_silent_connection(world, factory, marker):
    """Connections that never send a request head are not counted by any run; beyond
    limits.max_unidentified_connections a new one ends the oldest such, so a sandbox opening
    silent connections holds at most that many descriptors and starves nobody: a client that
    sends its head at once is served meanwhile, and the newest silent ones stay open (until
    header_timeout)."""
    e = factory.start(mutate=_limits(max_unidentified_connections=4, worker_threads=1,
                                     header_timeout="30s"))
    # One worker accepts in the order the connections were made, and registers each as it
    # accepts it: the first six are the oldest.
    silent = [helpers.Conn(socket.create_connection(("127.0.0.1", e.proxy_port), timeout=5))
              for _ in range(10)]

    def closed(c) -> bool:
        return helpers.closed_by_peer(c)
    helpers.poll(lambda: sum(closed(s) for s in silent[:6]) == 6, 5.0,
                 "the six oldest silent connections closed")
    assert not any(closed(s) for s in silent[6:])
    c, r = helpers.proxy_connect(e.proxy_port, f"api.test:{world.U}", world.auth())
    c.close()
    assert r.status == 200
    assert "limits.max_unidentified_connections (4) reached" in e.stderr_text()
    for c in silent:
        c.close()


@pytest.mark.parametrize("limit", [None, 3])
def test_max_dial_addresses_bounds_the_addresses_one_dial_tries(world, factory, limit):
    """A name with 12 answers, none of which accepts (nothing listens on closed_port at any of
    127.0.0.1-12): one dial tries the first limits.max_dial_addresses of them (default 8),
    each a connect of its own, and the CONNECT is 502 connect_failed. (Every answer was tried,
    each for up to connect_timeout: a name with dozens of answers held its client that long.)"""
    port = world.closed_port
    answers = [f"127.0.0.{i}" for i in range(1, 13)]

    def mutate(c):
        c["resolver"]["overrides"]["many.test"] = answers
        c["policy"]["allow_hosts"].append("many.test")
        c["policy"]["allow_networks"] = ["127.0.0.0/28"]
        if limit is not None:
            c["limits"]["max_dial_addresses"] = limit
    e = factory.start(mutate=mutate)
    c, r = helpers.proxy_connect(e.proxy_port, f"many.test:{port}", world.auth())
    c.close()
    assert (r.status, r.egress_reason) == (502, "connect_failed")
    tried = [line for line in e.stderr_text().splitlines() if f"connect many.test:{port} (" in line]
    want = 8 if limit is None else limit
    assert len(tried) == want, tried
    assert all(f"({a})" in line for a, line in zip(answers, tried)), tried  # in answer order
