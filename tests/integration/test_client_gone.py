"""A client that goes away while egressd waits for its upstream's answer (an HTTP/1.1 client's
close, TLS close_notify or reset; an HTTP/2 client's RST_STREAM is in test_h2_limits.py) has
its upstream part given up at once: the request is audited client_aborted (status 0) when the
client leaves, not when the upstream answers, and its connection no longer counts against
limits.connections_per_run. A client that pipelines its next request meanwhile is not taken for
gone: the next request is served after the first. The same holds while the upstream is still
being dialed (below): the dial ends, and nothing is sent."""
from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import threading
import time

import pytest

import helpers
from clients import proxy_env, run_ca
from dns_server import DnsServer, fixed
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


# A client that goes away while egressd is still dialing its upstream (TCP connect, TLS
# handshake) ends the dial: the request is recorded client_aborted when the client leaves, not
# when connect_timeout or tls_timeout pass, and nothing is sent upstream for it (nginx checks
# the client connection while it connects upstream too).

def _closed_by_peer(conn: socket.socket) -> bool:
    """Whether egressd closed this upstream-side connection (EOF or reset after its bytes)."""
    conn.settimeout(0.05)
    try:
        while True:
            data = conn.recv(65536)
            if not data:
                return True
    except (socket.timeout, TimeoutError):
        return False
    except OSError:
        return True


def _slow_dial_egressd(factory, **limits):
    return factory.start(mutate=lambda c: c["limits"].update(limits))


def test_client_leaving_during_the_upstream_tls_handshake_ends_it(world, factory, marker):
    """slow.test's upstream accepts TCP and never answers TLS: the https client gives up
    after 1 s, long before tls_timeout (20 s). The record says client_aborted at once, and
    egressd closed the half-made upstream connection."""
    e = _slow_dial_egressd(factory, tls_timeout="20s")
    before = len(world.silent.conns)
    t0 = time.monotonic()
    r = _curl_giving_up(e, world, f"https://slow.test:{world.silent.port}/x?{marker}", 1)
    assert r.returncode == 28, r.stderr
    recs = e.wait_audit(lambda a: a.get("host") == "slow.test" and a.get("path") == "/x",
                        timeout=8)
    assert time.monotonic() - t0 < 8, "recorded at tls_timeout, not when the client left"
    assert recs[0]["reason"] == "client_aborted" and recs[0]["status"] == 0, recs
    assert recs[0]["duration_ms"] < 6000, recs
    poll(lambda: len(world.silent.conns) > before, 5, "egressd's upstream connection")
    poll(lambda: all(_closed_by_peer(c) for c in world.silent.conns[before:]), 5,
         "egressd closing the abandoned upstream handshake")


@contextlib.contextmanager
def _listener_dropping_syns():
    """The port of a loopback listener whose listen queue is full: the kernel drops further
    SYNs to it, so a connect there waits until its own timeout."""
    full = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    fillers = []
    try:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        port = full.getsockname()[1]
        for _ in range(2):  # the queue of a backlog 0 holds one: the rest wait in SYN-SENT
            f = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            f.setblocking(False)
            f.connect_ex(("127.0.0.1", port))
            fillers.append(f)
        time.sleep(0.2)
        yield port
    finally:
        for f in fillers:
            f.close()
        full.close()


def test_client_leaving_during_the_upstream_tcp_connect_ends_it(world, factory, marker):
    """An upstream whose listen queue is full drops egressd's SYNs: the connect hangs until
    connect_timeout (20 s). The client gives up after 1 s; the record says client_aborted then,
    and the next request on another client is served meanwhile."""
    with _listener_dropping_syns() as port:
        def mutate(c):
            c["limits"].update(connect_timeout="20s")
            helpers.pin_bearer(c, "slow.test", port)
        e = factory.start(mutate=mutate)
        t0 = time.monotonic()
        r = _curl_giving_up(e, world, f"https://slow.test:{port}/x?{marker}", 1)
        assert r.returncode == 28, r.stderr
        recs = e.wait_audit(lambda a: a.get("host") == "slow.test" and a.get("path") == "/x",
                            timeout=8)
        assert time.monotonic() - t0 < 8, "recorded at connect_timeout, not when the client left"
        assert recs[0]["reason"] == "client_aborted" and recs[0]["status"] == 0, recs
        assert recs[0]["duration_ms"] < 6000, recs
        ok = subprocess.run(
            ["curl", "-sS", "--http1.1", "--max-time", "5", "--cacert", run_ca(e, "r1"),
             "-o", "/dev/null", "-w", "%{http_code}", f"https://api.test:{world.U}/echo/{marker}"],
            env=proxy_env(e, "r1", world.tokens["r1"]), capture_output=True, timeout=30)
        assert ok.stdout == b"200", (ok.stdout, ok.stderr)


def test_h2_stream_reset_during_the_upstream_dial_ends_it(world, factory, marker):
    """An HTTP/2 client resets its stream (RST_STREAM CANCEL) while egressd performs the TLS
    handshake with the silent upstream: the stream is recorded client_aborted when it was
    reset, and egressd closes the half-made upstream connection."""
    from h2_helpers import H2Client
    e = _slow_dial_egressd(factory, tls_timeout="20s")
    before = len(world.silent.conns)
    c = H2Client(e, world, "slow.test", world.silent.port, timeout=30)
    try:
        sid = c.headers(f"/x?{marker}")
        c.flush()
        poll(lambda: len(world.silent.conns) > before, 5, "egressd's upstream connection")
        t0 = time.monotonic()
        c.conn.reset_stream(sid)
        c.flush()
        recs = e.wait_audit(lambda a: a.get("host") == "slow.test" and a.get("path") == "/x",
                            timeout=8)
        assert time.monotonic() - t0 < 5
        assert recs[0]["reason"] == "client_aborted" and recs[0]["status"] == 0, recs
        poll(lambda: all(_closed_by_peer(s) for s in world.silent.conns[before:]), 5,
             "egressd closing the abandoned upstream handshake")
    finally:
        c.close()


class _SlowRelay:
    """A TCP relay on 127.0.0.1 that waits `delay` seconds after accepting before it connects
    to `target_port` and relays both ways: an upstream whose dial takes that long."""

    def __init__(self, target_port: int, delay: float):
        self.target_port, self.delay = target_port, delay
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.relayed = 0  # connections whose dial has ended (the relay reached the target)
        self.closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closing:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket):
        time.sleep(self.delay)
        try:
            u = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
        except OSError:
            c.close()
            return
        self.relayed += 1

        def pump(a, b):
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        threading.Thread(target=pump, args=(u, c), daemon=True).start()
        pump(c, u)

    def close(self):
        self.closing = True
        self.sock.close()


@contextlib.contextmanager
def _two_streams_on_one_dial(world, factory, marker, delay: float):
    """egressd, and one HTTP/2 client with two streams to an h2 upstream reached through a
    relay whose dial takes `delay` s: the first stream dials, the second (sent once the dial
    began) waits for it. Yields (egressd, client, upstream, relay, first, second)."""
    from h2_helpers import H2Client
    from h2_upstream import H2Upstream
    up = H2Upstream(world.pki.server_cert, world.pki.server_key)
    relay = _SlowRelay(up.port, delay)
    c = None
    try:
        e = factory.start(mutate=lambda cfg: helpers.pin_bearer(cfg, "api.test", relay.port))
        c = H2Client(e, world, "api.test", relay.port, timeout=30)
        first = c.headers(f"/echo/{marker}-first")
        c.flush()
        poll(lambda: relay.accepted == 1, 5, "the first stream's dial")
        second = c.headers(f"/echo/{marker}-second")
        c.flush()
        time.sleep(0.3)  # the second waits for the first's dial
        yield e, c, up, relay, first, second
    finally:
        if c is not None:
            c.close()
        relay.close()
        up.close()


def test_h2_dial_other_streams_wait_for_goes_on_when_its_own_stream_resets(world, factory,
                                                                         marker):
    """Two streams of one HTTP/2 client to an h2 upstream whose dial takes 1.5 s: the first
    dials, the second waits for that dial (it will bring the session both share). The first
    stream is reset during the dial: its request is recorded client_aborted and never sent,
    but the dial is not cut, since the second waits for it: the second is answered over that
    one connection (one accepted, not two)."""
    with _two_streams_on_one_dial(world, factory, marker, 1.5) as (e, c, up, relay, first,
                                                                   second):
        c.conn.reset_stream(first)
        c.flush()
        r = c.responses[second]
        c.pump(until=lambda: r["ended"] or r["reset"] is not None, timeout=15)
        assert r["status"] == 200, r
        assert relay.accepted == 1, relay.accepted
        assert [s.path for s in up.find(marker)] == [f"/echo/{marker}-second"]
        recs = e.wait_audit(lambda a: a.get("path") == f"/echo/{marker}-first")
        assert recs[0]["reason"] == "client_aborted" and recs[0]["status"] == 0, recs


def test_h2_stream_waiting_for_another_streams_dial_leaves_at_once(world, factory, marker):
    """The other way round: the second stream, which waits for the first's 2 s dial, is reset.
    It is recorded client_aborted when it was reset, not when the dial ends, and is never sent;
    the first is answered over the one connection."""
    # 2 s: under the tests' tls_timeout
    with _two_streams_on_one_dial(world, factory, marker, 2.0) as (e, c, up, relay, first,
                                                                   second):
        c.conn.reset_stream(second)
        c.flush()
        recs = e.wait_audit(lambda a: a.get("path") == f"/echo/{marker}-second", timeout=10)
        # An order, not a time: the record is there while the dial still runs.
        dial_over = relay.relayed > 0
        assert recs[0]["reason"] == "client_aborted" and recs[0]["status"] == 0, recs
        assert not dial_over, "the reset stream was recorded only when the dial ended"
        r = c.responses[first]
        c.pump(until=lambda: r["ended"] or r["reset"] is not None, timeout=15)
        assert r["status"] == 200, r
        assert relay.accepted == 1, relay.accepted
        assert [s.path for s in up.find(marker)] == [f"/echo/{marker}-first"]


class _SlowDns(DnsServer):
    """Answers every query after a second: a CONNECT's dial that the client can leave."""

    def _reply(self, data: bytes, proto: str) -> bytes | None:
        time.sleep(1.0)
        return super()._reply(data, proto)


@pytest.mark.parametrize("durable", [False, True])
def test_connect_whose_client_leaves_during_the_dial_is_audited(world, factory, durable):
    """A blind tunnel's client that resets while egressd resolves and dials gets no 200, and
    its CONNECT still ends in one record (status 0, client_aborted). The reset is noticed
    while the lookup waits (the tunnel's client is watched during its dial), so the dial
    stops after the lookup: nothing connects upstream, and under audit.durable no decision
    record is written (it is written before a tunnel's first byte flows, as a request's is
    before it is sent; a request whose client leaves during its dial has none either)."""
    dns = _SlowDns()
    dns.set("slowdns.test", fixed("127.0.0.1"))
    try:
        def mutate(c):
            c["resolver"]["servers"] = [dns.address]
            c["policy"]["allow_hosts"].append("slowdns.test")
            c["audit"]["durable"] = durable
        e = factory.start(mutate=mutate)
        before = world.upstream.server.connections
        s = socket.create_connection(("127.0.0.1", e.proxy_port), timeout=5)
        s.sendall(f"CONNECT slowdns.test:{world.U} HTTP/1.1\r\nHost: slowdns.test:{world.U}\r\n"
                  f"Proxy-Authorization: {world.auth()}\r\n\r\n".encode())
        poll(lambda: dns.queries("slowdns.test"), 5, "the CONNECT's lookup")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # a reset while the lookup waits
        recs = poll(lambda: [r for r in e.audit_records()
                             if r.get("host") == "slowdns.test" and "event" not in r], 10,
                    "the left CONNECT's record")
        assert len(recs) == 1, recs
        rec = recs[0]
        assert (rec["status"], rec["reason"], rec["method"]) == (0, "client_aborted", "CONNECT"), rec
        assert rec["run"] == "r1", rec
        assert world.upstream.server.connections == before, "the left CONNECT was dialled"
        if durable:
            decisions = [r for r in e.audit_records()
                         if r.get("host") == "slowdns.test" and r.get("event") == "decision"]
            assert decisions == [], (decisions, rec)
    finally:
        dns.close()


def test_a_first_flight_sent_with_the_connect_then_a_half_close_is_relayed(world, factory,
                                                                             marker):
    """A client that sends its first flight in the CONNECT's own packet and then half-closes
    (shutdown(SHUT_WR)) is talking, not gone: egressd read those bytes with the CONNECT head, so
    the dial's client watch, which sees only the socket, took the FIN after them for a client
    that left and cut the dial (client_aborted, nothing relayed). The flight is relayed and the
    answer comes back."""
    dns = _SlowDns()  # the dial lasts a second: the FIN arrives while it waits
    dns.set("slowdns.test", fixed("127.0.0.1"))
    try:
        def mutate(c):
            c["resolver"]["servers"] = [dns.address]
            c["policy"]["allow_hosts"].append("slowdns.test")
        e = factory.start(mutate=mutate)
        P = world.plain.port
        s = socket.create_connection(("127.0.0.1", e.proxy_port), timeout=10)
        s.sendall(f"CONNECT slowdns.test:{P} HTTP/1.1\r\nHost: slowdns.test:{P}\r\n"
                  f"Proxy-Authorization: {world.auth()}\r\n\r\n"
                  f"GET /echo/{marker} HTTP/1.1\r\nHost: slowdns.test:{P}\r\n"
                  f"Connection: close\r\n\r\n".encode())
        s.shutdown(socket.SHUT_WR)
        got = b""
        while True:
            b = s.recv(65536)
            if not b:
                break
            got += b
        s.close()
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
        assert b"\r\n\r\nHTTP/1.1 200" in got, got[:400]  # the upstream's own answer
        assert world.plain.find(marker), "the first flight did not reach the upstream"
    finally:
        dns.close()


def test_a_first_flight_sent_with_the_connect_then_a_reset_ends_the_dial(world, factory,
                                                                         marker):
    """The same client resets instead: it is gone, and the dial's watch (kept for a tunnel
    whose first flight came with its CONNECT, where a FIN alone ends the watch) cuts the dial:
    client_aborted, and nothing reaches the upstream."""
    dns = _SlowDns()
    dns.set("slowdns.test", fixed("127.0.0.1"))
    try:
        def mutate(c):
            c["resolver"]["servers"] = [dns.address]
            c["policy"]["allow_hosts"].append("slowdns.test")
        e = factory.start(mutate=mutate)
        P = world.plain.port
        before = world.plain.server.connections
        s = socket.create_connection(("127.0.0.1", e.proxy_port), timeout=10)
        s.sendall(f"CONNECT slowdns.test:{P} HTTP/1.1\r\nHost: slowdns.test:{P}\r\n"
                  f"Proxy-Authorization: {world.auth()}\r\n\r\n"
                  f"GET /echo/{marker} HTTP/1.1\r\nHost: slowdns.test:{P}\r\n\r\n".encode())
        poll(lambda: dns.queries("slowdns.test"), 5, "the CONNECT's lookup")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # a reset while the lookup waits
        recs = poll(lambda: [r for r in e.audit_records()
                             if r.get("host") == "slowdns.test" and "event" not in r], 10,
                    "the left CONNECT's record")
        assert (recs[0]["status"], recs[0]["reason"]) == (0, "client_aborted"), recs
        time.sleep(0.5)
        assert world.plain.server.connections == before, "the gone client's CONNECT was dialled"
        assert not world.plain.find(marker), "the first flight of a client gone was relayed"
    finally:
        dns.close()


def test_connect_whose_client_leaves_during_the_tcp_connect_ends_it(world, factory):
    """A blind tunnel's upstream drops egressd's SYNs (its listen queue is full): the connect
    would wait for connect_timeout (20 s). The CONNECT's client closes after half a second:
    the dial ends then, recorded client_aborted (status 0), not 504 connect_timeout at 20 s."""
    with _listener_dropping_syns() as port:
        def mutate(c):
            c["limits"].update(connect_timeout="20s")
            c["policy"]["allow_hosts"].append("tunnel.test")
            c["policy"]["allowed_ports"].append(port)
        e = factory.start(mutate=mutate)
        s = socket.create_connection(("127.0.0.1", e.proxy_port), timeout=5)
        s.sendall(f"CONNECT tunnel.test:{port} HTTP/1.1\r\nHost: tunnel.test:{port}\r\n"
                  f"Proxy-Authorization: {world.auth()}\r\n\r\n".encode())
        time.sleep(0.5)  # the connect is on its way (it cannot complete)
        t0 = time.monotonic()
        s.close()
        recs = poll(lambda: [r for r in e.audit_records()
                             if r.get("host") == "tunnel.test" and r.get("port") == port], 10,
                    "the left CONNECT's record")
        assert time.monotonic() - t0 < 5, "recorded at connect_timeout, not when the client left"
        assert len(recs) == 1, recs
        assert (recs[0]["status"], recs[0]["reason"]) == (0, "client_aborted"), recs
        assert recs[0]["duration_ms"] < 5000, recs
