"""A static run (config `runs:`) with a ttl: when it expires, the connections it has open are
closed, as a dynamic run's are when the sweeper removes it; new requests get 403 run_expired.
A reload that keeps the run does not close anything again; a reload that gives it a new ttl
closes its connections again when that one runs out."""
from __future__ import annotations

import socket
import ssl
import threading
import time

import pytest

import helpers
from clients import run_ca

# Long enough for egressd's start and three connections on a loaded machine (or under a
# sanitizer) before the run expires.
TTL_S = 6.0
# Expiry is checked once a second (the server's sweep) and the close is posted to the
# connection's worker: a connection must be gone within this many seconds of the expiry.
CLOSE_WITHIN_S = 3.0
CLOSED_LOG = "run r1 expired: closing"


class EchoServer:
    """A loopback TCP server that sends back every byte it reads (the tunnel's far end)."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self._closed = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    @staticmethod
    def _serve(c: socket.socket):
        try:
            while True:
                b = c.recv(65536)
                if not b:
                    break
                c.sendall(b)
        except OSError:
            pass
        finally:
            c.close()

    def close(self):
        self._closed = True
        self.sock.close()
        for c in self._conns:
            try:
                c.close()
            except OSError:
                pass


@pytest.fixture(scope="module")
def echo():
    s = EchoServer()
    yield s
    s.close()


def _config(echo_port: int, ttl: str):
    def mutate(c):
        c["runs"][0]["ttl"] = ttl
        c["policy"]["allowed_ports"] = sorted({*c["policy"]["allowed_ports"], echo_port})
    return mutate


def _open_tunnel(e, world, echo, run: str = "r1") -> helpers.Conn:
    """A blind tunnel (tunnel.test is allowed, unpinned: tunnel) to the echo server, checked."""
    c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{echo.port}", world.auth(run))
    assert (r.status, r.egress_reason) == (200, None), (r.status, r.egress_reason, r.body)
    # A line, as a text protocol's first message is: egressd reads a plain first flight
    # until it knows whether it is an HTTP request head (whose Host it checks), and a bare
    # word without its line end could still begin one.
    ping = b"ping-" + run.encode() + b"\n"
    c.send(ping)
    assert c.read_exact(len(ping)) == ping
    return c


def _open_intercepted(e, world, marker: str) -> helpers.Conn:
    """An intercepted HTTPS keep-alive connection (pinned api.test), with one request served."""
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    r = helpers.request(c, "GET", f"/echo/{marker}-0", f"api.test:{world.U}")
    assert r.status == 200, (r.status, r.egress_reason)
    assert r.header("Connection") != "close"
    return c


def _wait_closed(c: helpers.Conn, deadline: float) -> float | None:
    """The time (time.time()) the peer closed `c` (EOF or reset), or None if it was still open
    at `deadline`. Bytes that arrive are dropped."""
    while True:
        left = deadline - time.time()
        if left <= 0:
            return None
        c.sock.settimeout(left)
        try:
            if not c.sock.recv(65536):
                return time.time()
        except (socket.timeout, TimeoutError):
            return None
        except (ssl.SSLError, ConnectionError, OSError):
            return time.time()


def _still_open(c: helpers.Conn) -> bool:
    """True if `c` (a tunnel to the echo server) still relays a round trip."""
    try:
        c.sock.settimeout(2.0)
        c.send(b"still-there")
        return c.read_exact(len(b"still-there")) == b"still-there"
    except (OSError, ConnectionError, ValueError):
        return False


def test_static_run_connections_closed_at_expiry(world, factory, echo, marker):
    before_start = time.time()
    e = factory.start(mutate=_config(echo.port, f"{int(TTL_S)}s"))
    ready = time.time()
    # expires_at = (the runtime's build, between these two) + ttl
    earliest, latest = before_start + TTL_S, ready + TTL_S

    tun = _open_tunnel(e, world, echo)
    ka = _open_intercepted(e, world, marker)
    other = _open_tunnel(e, world, echo, run="r2")  # r2 has no ttl: never cut
    try:
        if time.time() >= earliest:
            pytest.fail(f"setup took longer than the {TTL_S}s ttl (slow machine?)")

        deadline = latest + CLOSE_WITHIN_S
        tun_closed = _wait_closed(tun, deadline)
        ka_closed = _wait_closed(ka, deadline)
        now = time.time()
        still_open = [name for name, t in (("blind tunnel", tun_closed),
                                           ("intercepted keep-alive connection", ka_closed))
                      if t is None]
        assert not still_open, (
            f"expired static run r1: {', '.join(still_open)} still open {now - latest:.1f}s "
            f"after expiry; stderr tail:\n{e.stderr_text()[-1500:]}")
        assert tun_closed >= earliest - 0.05 and ka_closed >= earliest - 0.05, \
            "closed before the run expired"

        # A new request of the expired run is refused; the other run is untouched.
        c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{echo.port}", world.auth())
        c.close()
        assert (r.status, r.egress_reason) == (403, "run_expired")
        c, r = helpers.proxy_connect(e.proxy_port, f"api.test:{world.U}", world.auth())
        c.close()
        assert (r.status, r.egress_reason) == (403, "run_expired")
        assert _still_open(other), "r2's tunnel (no ttl) was closed"
        # Logged once the shutdowns ran: maybe a moment after the client saw its end.
        helpers.poll(lambda: CLOSED_LOG + " 2 connections" in e.stderr_text(), 5,
                     "the expiry's log line")
        assert e.stderr_text().count(CLOSED_LOG) == 1, e.stderr_text()[-1500:]

        # A reload that keeps r1 (same ttl, same expiry) closes nothing again.
        e.rewrite_config(lambda cfg: cfg["limits"].update({"idle_timeout": "45s"}))
        e.reload()
        time.sleep(2.5)  # two sweeps and more
        assert e.stderr_text().count(CLOSED_LOG) == 1, e.stderr_text()[-1500:]
        c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{echo.port}", world.auth())
        c.close()
        assert (r.status, r.egress_reason) == (403, "run_expired")
        assert _still_open(other)
    finally:
        for c in (tun, ka, other):
            c.close()


def test_static_run_closed_again_after_a_reload_gives_it_a_new_ttl(world, factory, echo):
    e = factory.start(mutate=_config(echo.port, "2s"))
    helpers.poll(lambda: CLOSED_LOG in e.stderr_text(), 10, "the first expiry's log line")
    c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{echo.port}", world.auth())
    c.close()
    assert (r.status, r.egress_reason) == (403, "run_expired")

    # A new ttl: r1 is built anew (new CA, new expiry) and lives again until that one.
    e.rewrite_config(lambda cfg: cfg["runs"][0].update({"ttl": f"{int(TTL_S)}s"}))
    before = time.time()
    e.reload()
    after = time.time()
    tun = _open_tunnel(e, world, echo)
    try:
        if time.time() >= before + TTL_S:
            pytest.fail(f"setup took longer than the {TTL_S}s ttl (slow machine?)")
        closed = _wait_closed(tun, after + TTL_S + CLOSE_WITHIN_S)
        assert closed is not None, "tunnel still open after the run's new expiry"
        assert closed >= before + TTL_S - 0.05, "closed before the run's new expiry"
    finally:
        tun.close()
    helpers.poll(lambda: e.stderr_text().count(CLOSED_LOG) == 2, 5, "the second expiry's log line")
    assert CLOSED_LOG + " 1 connections" in e.stderr_text()
