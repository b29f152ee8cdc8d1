"""The response scrubber's hold-back is the same for every content (policy/scrubber.h).

A sandbox that can make a pinned upstream reflect text it chose at the end of a body piece
("data: you said <guess>", then a pause: an event stream) used to learn, from how much of the
piece egressd sent at once (HTTP/1.1 chunk sizes, HTTP/2 DATA sizes), whether its guess was a
prefix of "Bearer <secret>": the scrubber held back only bytes that could begin a needle. It
recovered the secret byte by byte. Now every piece but the last leaves its last (longest
needle - 1) bytes, whatever they are, and when the upstream pauses for
limits.scrub_hold_timeout (200ms by default) they go out on their own, so a stream that waits
for its next event does not keep its tail until then."""
from __future__ import annotations

import http.server
import os
import socket
import ssl
import struct
import threading
import time
import urllib.parse

import h2.events

import helpers
import upstream as up
from h2_helpers import H2Client

SECRET = helpers.secret("sk-live-" + os.urandom(8).hex())
LEAD = b"data: you said "
WAIT_S = 10.0  # bound on every wait for the other side


class _Reflect(http.server.BaseHTTPRequestHandler):
    """GET /stream?g=GUESS&id=N: a chunked event stream; its first chunk reflects the guess,
    then it waits for the test to say go (server.go[N]) before its last event."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
        part1 = LEAD + q.get("g", "").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(part1), part1))
        self.wfile.flush()
        self.server.go.setdefault(q["id"], threading.Event()).wait(WAIT_S)
        self.wfile.write(b"2\r\n\n\n\r\n0\r\n\r\n")
        self.wfile.flush()


class _Upstream:
    def __init__(self, world):
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(world.pki.server_cert, world.pki.server_key)
        self.srv = up.TlsHttpServer(("127.0.0.1", 0), _Reflect)
        self.srv.ctx = ctx
        self.srv.go = {}
        self.port = self.srv.server_address[1]
        self.n = 0
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def next_id(self) -> str:
        self.n += 1
        self.srv.go.setdefault(str(self.n), threading.Event())
        return str(self.n)

    def go(self, rid: str):
        self.srv.go[rid].set()

    def close(self):
        for ev in self.srv.go.values():
            ev.set()
        self.srv.shutdown()
        self.srv.server_close()


def _start(factory, world, upstream: _Upstream, limits: dict | None = None):
    sf = os.path.join(world.tmp, f"hold_secret_{upstream.port}")
    with open(sf, "w") as f:
        f.write(SECRET)
    os.chmod(sf, 0o600)

    def mut(cfg):
        cfg["runs"][0]["pins"].append({"host": f"api.test:{upstream.port}", "secret_file": sf,
                                       "inject": {"type": "bearer"}})
        cfg["policy"]["allowed_ports"].append(upstream.port)
        if limits:
            cfg["limits"].update(limits)
    return factory.start(mut)


def _guesses() -> dict[str, str]:
    """Reflected texts of one length: a right prefix of "Bearer <secret>" (a needle), the same
    with its last character wrong, and text that begins no needle."""
    right = "Bearer " + SECRET[:12]
    wrong_last = right[:-1] + ("0" if right[-1] != "0" else "1")
    return {"right": right, "wrong_last": wrong_last, "other": "x" * len(right)}


def _chunk(c: helpers.Conn) -> bytes:
    line = c.read_until(b"\r\n")
    n = int(line.split(b";")[0], 16)
    data = c.read_exact(n + 2)[:-2]
    return data


def _h1_probe(c: helpers.Conn, port: int, upstream: _Upstream, guess: str):
    """(first chunk's size, seconds until the reflected text was whole, body) of one stream."""
    rid = upstream.next_id()
    c.send(f"GET /stream?id={rid}&g={urllib.parse.quote(guess)} HTTP/1.1\r\n"
           f"Host: api.test:{port}\r\n\r\n".encode())
    head = c.read_until(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:40]
    want = len(LEAD) + len(guess)
    first = _chunk(c)
    t0 = time.monotonic()
    got = first
    for _ in range(want + 1):  # the held bytes, while the upstream still waits
        if len(got) >= want:
            break
        got += _chunk(c)
    whole_after = time.monotonic() - t0
    upstream.go(rid)  # only now does the upstream send its next event
    body = got
    for _ in range(100):
        piece = _chunk(c)
        if not piece:  # the last chunk (no trailers: its CRLF was read with it)
            break
        body += piece
    return len(first), whole_after, body


def _tunnel(e, world, upstream):
    """An intercepted tunnel of run r1 to the test upstream, reads bounded at 5 s."""
    c = helpers.tunnel(e.proxy_port, "api.test", upstream.port, world.auth("r1"),
                       e.config["runs"][0]["ca_cert_out"])
    c.sock.settimeout(5)
    return c


def test_h1_first_chunk_is_the_same_for_a_right_and_a_wrong_guess(factory, world):
    upstream = _Upstream(world)
    try:
        e = _start(factory, world, upstream)
        c = _tunnel(e, world, upstream)
        sizes = {}
        for name, guess in list(_guesses().items()) * 2:
            first, whole_after, body = _h1_probe(c, upstream.port, upstream, guess)
            want = LEAD + guess.encode()
            assert body == want + b"\n\n", name  # nothing lost, nothing scrubbed (no needle)
            sizes.setdefault(name, set()).add(first)
            # The held tail came without the next event (the upstream waits for us): after
            # scrub_hold_timeout (200ms), not at once and not at the end.
            assert 0.1 <= whole_after < 3.0, (name, whole_after)
        assert len({frozenset(s) for s in sizes.values()}) == 1, \
            f"first chunk sizes differ by content: {sizes}"
        [size] = sizes["right"]
        assert 0 < size < len(LEAD) + len(_guesses()["right"]), sizes  # a tail was held
        c.close()
    finally:
        upstream.close()


def test_h1_strict_mode_holds_the_tail_until_the_next_piece(factory, world):
    """limits.scrub_hold_timeout: 0: the held bytes wait for the upstream's next bytes."""
    upstream = _Upstream(world)
    try:
        e = _start(factory, world, upstream, {"scrub_hold_timeout": "0"})
        c = _tunnel(e, world, upstream)
        guess = _guesses()["other"]
        rid = upstream.next_id()
        c.send(f"GET /stream?id={rid}&g={guess} HTTP/1.1\r\n"
               f"Host: api.test:{upstream.port}\r\n\r\n".encode())
        c.read_until(b"\r\n\r\n")
        first = _chunk(c)
        assert 0 < len(first) < len(LEAD) + len(guess)
        c.sock.settimeout(0.6)  # three default hold timeouts: nothing more comes
        try:
            more = c.sock.recv(1)
        except (socket.timeout, TimeoutError, ssl.SSLError):
            more = None
        assert more is None, "a held tail went out without the upstream's next bytes"
        c.sock.settimeout(5)
        upstream.go(rid)
        body = first
        for _ in range(100):
            piece = _chunk(c)
            if not piece:
                break
            body += piece
        assert body == LEAD + guess.encode() + b"\n\n"
        c.close()
    finally:
        upstream.close()


def _h2_probe(c: H2Client, upstream: _Upstream, guess: str):
    """(DATA sizes before the upstream's next event, body) of one stream on an h2 client leg."""
    rid = upstream.next_id()
    sid = c.headers(f"/stream?id={rid}&g={urllib.parse.quote(guess)}")
    c.flush()
    want = len(LEAD) + len(guess)
    sizes = []
    body = b""
    ended = False
    deadline = time.monotonic() + WAIT_S
    went = False
    while not ended and time.monotonic() < deadline:
        data = c.sock.recv(65536)
        assert data, "connection closed"
        for ev in c.conn.receive_data(data):
            if isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
                if not went:
                    sizes.append(len(ev.data))
                body += ev.data
                c.conn.acknowledge_received_data(ev.flow_controlled_length, sid)
            elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id == sid:
                ended = True
            elif isinstance(ev, h2.events.StreamReset):
                raise AssertionError(f"stream reset {ev.error_code}")
        c.flush()
        if not went and len(body) >= want:
            went = True
            upstream.go(rid)  # the reflected text is whole without the next event
    assert ended
    return sizes, body


def test_h2_data_sizes_are_the_same_for_a_right_and_a_wrong_guess(factory, world):
    upstream = _Upstream(world)
    try:
        e = _start(factory, world, upstream)
        c = H2Client(e, world, "api.test", upstream.port, timeout=5)
        seen = {}
        for name, guess in list(_guesses().items()) * 2:
            sizes, body = _h2_probe(c, upstream, guess)
            assert body == LEAD + guess.encode() + b"\n\n", name
            seen.setdefault(name, set()).add(tuple(sizes))
        assert len({frozenset(s) for s in seen.values()}) == 1, \
            f"DATA sizes differ by content: {seen}"
        [sizes] = seen["right"]
        assert len(sizes) == 2, sizes  # the piece less its tail, then the tail on its own
        c.close()
    finally:
        upstream.close()


def test_a_client_gone_during_a_held_release_ends_the_exchange_at_once(factory, world):
    """The timed release is the only write while a paused upstream is awaited: when it finds
    the client gone, the upstream part is aborted then, not when the upstream speaks again
    (here after WAIT_S) or idle_timeout passes, and the record says client_aborted."""
    upstream = _Upstream(world)
    try:
        e = _start(factory, world, upstream)
        c = _tunnel(e, world, upstream)
        rid = upstream.next_id()
        guess = _guesses()["other"]
        c.send(f"GET /stream?id={rid}&g={guess} HTTP/1.1\r\n"
               f"Host: api.test:{upstream.port}\r\n\r\n".encode())
        c.read_until(b"\r\n\r\n")
        _chunk(c)  # the piece less its held tail: the release is due in scrub_hold_timeout
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()  # a reset: the release's write fails
        t0 = time.monotonic()
        [rec] = e.wait_audit(lambda a: a.get("path") == "/stream", timeout=8)
        took = time.monotonic() - t0
        assert rec["reason"] == "client_aborted", rec
        assert took < WAIT_S / 2, f"the record came {took:.1f} s after the client left"
    finally:
        upstream.close()
