"""Policy review fixes, end to end: a pin without a port covers `allowed_ports` only (as the
destination decision does), an X-Egress-* header named in Connection is still refused, and
`limits.dns_timeout` bounds a whole lookup however many servers and retries c-ares makes."""
from __future__ import annotations

import socket
import threading
import time

import dnslib

import dns_server
import helpers
from clients import run_ca
from upstream import Upstream


def _pin(world, host, secret, inject):
    return {"host": host, "secret_file": world.secret_files[secret], "inject": inject}


def _sent(seen, name: str) -> int:
    """How many `name` headers the upstream got (a count: never a secret in test output)."""
    return len(seen.header(name))


# ---------------------------------------------------------------------------------------------
# a pin without a port never injects on a port outside allowed_ports


def test_portless_pin_leaves_a_port_it_does_not_cover_to_the_pin_naming_it(world, factory,
                                                                           marker):
    other = Upstream(world.pki.server_cert, world.pki.server_key)  # a port not in allowed_ports
    P = other.port
    try:
        def mutate(cfg):
            assert P not in cfg["policy"]["allowed_ports"]
            pins = cfg["runs"][0]["pins"]
            pins.insert(0, _pin(world, "other.test", "api_token", {"type": "bearer"}))
            pins.append(_pin(world, f"other.test:{P}", "hdr_key",
                             {"type": "header", "name": "x-api-key", "template": "{secret}"}))
        e = factory.start(mutate)
        ca = run_ca(e, "r1")

        t = helpers.tunnel(e.proxy_port, "other.test", P, world.auth(), ca)
        r = helpers.request(t, "GET", f"/echo/{marker}-own", f"other.test:{P}")
        t.close()
        assert r.status == 200, (r.status, r.egress_reason)
        seen = other.find(f"{marker}-own")
        assert len(seen) == 1
        assert _sent(seen[0], "authorization") == 0, "the portless pin injected on port P"
        key_ok = seen[0].header("x-api-key") == [world.secrets["hdr_key"]]
        assert key_ok, "the pin naming port P did not inject its key"
        rec = e.wait_audit(lambda a: f"{marker}-own" in (a.get("path") or ""))[-1]
        assert rec["secret"] == "hdr_key", rec

        # On an allowed port the portless pin still applies.
        t = helpers.tunnel(e.proxy_port, "other.test", world.U, world.auth(), ca)
        r = helpers.request(t, "GET", f"/echo/{marker}-allowed", f"other.test:{world.U}")
        t.close()
        assert r.status == 200, (r.status, r.egress_reason)
        seen = world.upstream.find(f"{marker}-allowed")
        assert len(seen) == 1
        auth_ok = seen[0].header("authorization") == [f"Bearer {world.secrets['api_token']}"]
        assert auth_ok, "the portless pin did not inject on an allowed port"
    finally:
        other.close()


def test_portless_pin_does_not_inject_on_an_allowed_unpinned_port(world, factory, marker):
    other = Upstream(world.pki.server_cert, world.pki.server_key)
    P = other.port
    try:
        def mutate(cfg):
            assert P not in cfg["policy"]["allowed_ports"]
            cfg["runs"][0]["allow_hosts"].append(f"other.test:{P}")
            cfg["runs"][0]["pins"].insert(
                0, _pin(world, "other.test", "api_token", {"type": "bearer"}))
        e = factory.start(mutate, unpinned="intercept")
        t = helpers.tunnel(e.proxy_port, "other.test", P, world.auth(), run_ca(e, "r1"))
        r = helpers.request(t, "GET", f"/echo/{marker}", f"other.test:{P}")
        t.close()
        assert r.status == 200, (r.status, r.egress_reason)
        seen = other.find(marker)
        assert len(seen) == 1
        assert _sent(seen[0], "authorization") == 0, "a credential went to an unpinned port"
        rec = e.wait_audit(lambda a: marker in (a.get("path") or ""))[-1]
        assert rec["pin"] is None and rec["secret"] is None, rec
    finally:
        other.close()


# ---------------------------------------------------------------------------------------------
# X-Egress-* is refused even when a Connection token names it


def test_forged_egress_header_named_in_connection_is_refused(world, egressd, marker):
    t = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    r = helpers.request(t, "GET", f"/echo/{marker}", f"api.test:{world.U}",
                        headers=[("Connection", "X-Egress-Run"), ("X-Egress-Run", "forged")])
    t.close()
    assert (r.status, r.egress_reason) == (403, "forged_egress_header")
    assert world.upstream.find(marker) == []
    egressd.wait_audit(lambda a: a.get("reason") == "forged_egress_header"
                       and marker in (a.get("path") or ""))


# ---------------------------------------------------------------------------------------------
# limits.dns_timeout is the budget of the whole lookup


def _dns_limits(cfg, servers, name, timeout):
    cfg["resolver"]["servers"] = servers
    cfg["policy"]["allow_hosts"].append(name)
    cfg["limits"]["dns_timeout"] = timeout
    cfg["limits"]["worker_threads"] = 1  # the late answer below reaches the worker that asked


def test_dns_timeout_bounds_a_lookup_over_several_silent_servers(world, factory):
    # Bound UDP sockets nobody reads: DNS servers that never answer. c-ares alone tries each
    # one twice (timeout doubled the second round): 4.5 x dns_timeout for three servers.
    silent = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
    try:
        for s in silent:
            s.bind(("127.0.0.1", 0))
        servers = [f"127.0.0.1:{s.getsockname()[1]}" for s in silent]
        e = factory.start(lambda c: _dns_limits(c, servers, "nx.budget.test", "2s"))
        t0 = time.monotonic()
        c, r = helpers.proxy_connect(e.proxy_port, f"nx.budget.test:{world.U}", world.auth(),
                                     timeout=30)
        elapsed = time.monotonic() - t0
        c.close()
        assert (r.status, r.egress_reason) == (502, "dns_failure")
        # Loose bound: the 2 s budget plus a wide margin for a loaded machine (was 9 s).
        assert 1.0 <= elapsed < 5.0, f"refused after {elapsed:.2f}s with dns_timeout 2s"
        # The proxy keeps serving.
        c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.U}", world.auth())
        c.close()
        assert r.status == 200
    finally:
        for s in silent:
            s.close()


def test_a_name_whose_aaaa_queries_are_dropped_resolves_to_its_a_answer(world, factory):
    # A resolver path that drops AAAA queries (some firewalls do) while the A answer comes at
    # once: c-ares ends a lookup with its last query, and its schedule (two tries, the second
    # one twice as long) outlasted dns_timeout, so every such name failed (502 dns_failure at
    # the budget). It is sized to end inside the budget now: the A answer is used.
    dns = dns_server.DnsServer(drop={"AAAA"})
    try:
        dns.set("v4only.budget.test", dns_server.fixed("127.0.0.1"))
        e = factory.start(lambda c: _dns_limits(c, [dns.address], "v4only.budget.test", "2s"))
        c, r = helpers.proxy_connect(e.proxy_port, f"v4only.budget.test:{world.U}", world.auth(),
                                     timeout=30)
        c.close()
        assert r.status == 200, (r.status, r.egress_reason)
        assert dns.queries("v4only.budget.test", "AAAA"), "no AAAA query was dropped"
    finally:
        dns.close()


def test_two_silent_servers_before_a_good_one_are_within_the_budget(world, factory):
    # resolv.conf-style order: the first two servers never answer. Each try took half the
    # budget, so the third server was asked only as the budget ran out (502 dns_failure).
    silent = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    dns = dns_server.DnsServer()
    try:
        for s in silent:
            s.bind(("127.0.0.1", 0))
        dns.set("third.budget.test", dns_server.fixed("127.0.0.1"))
        servers = [f"127.0.0.1:{s.getsockname()[1]}" for s in silent] + [dns.address]
        e = factory.start(lambda c: _dns_limits(c, servers, "third.budget.test", "2s"))
        c, r = helpers.proxy_connect(e.proxy_port, f"third.budget.test:{world.U}", world.auth(),
                                     timeout=30)
        c.close()
        assert r.status == 200, (r.status, r.egress_reason)
    finally:
        dns.close()
        for s in silent:
            s.close()


class LateDns:
    """A DNS server on 127.0.0.1 that answers every query `delay` seconds late:
    A -> 127.0.0.1, anything else an empty answer."""

    def __init__(self, delay: float):
        self.delay = delay
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.answered = threading.Event()
        self._stop = threading.Event()
        self._timers: list[threading.Timer] = []
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.is_set() and len(self._timers) < 64:
            try:
                data, peer = self.sock.recvfrom(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            q = dnslib.DNSRecord.parse(data)
            reply = q.reply()
            if q.q.qtype == dnslib.QTYPE.A:
                reply.add_answer(dnslib.RR(q.q.qname, dnslib.QTYPE.A,
                                           rdata=dnslib.A("127.0.0.1"), ttl=0))
            timer = threading.Timer(self.delay, self._send, (reply.pack(), peer))
            timer.daemon = True
            self._timers.append(timer)
            timer.start()

    def _send(self, packet: bytes, peer):
        try:
            self.sock.sendto(packet, peer)
        except OSError:
            return
        self.answered.set()

    def close(self):
        self._stop.set()
        for t in self._timers:
            t.cancel()
        self._thread.join(timeout=2)
        self.sock.close()


def test_dns_answer_after_the_deadline_is_ignored(world, factory):
    # dns_timeout 2s and an answer at 2.6 s: after egressd stopped waiting (and after c-ares'
    # own schedule, sized to end inside the budget; with the schedule it had, this answer still
    # completed the lookup late). A late answer must be dropped harmlessly: refused in time,
    # and the worker keeps serving.
    dns = LateDns(delay=2.6)
    try:
        e = factory.start(lambda c: _dns_limits(c, [dns.address], "late.budget.test", "2s"))
        c, r = helpers.proxy_connect(e.proxy_port, f"late.budget.test:{world.U}", world.auth(),
                                     timeout=30)
        c.close()
        assert (r.status, r.egress_reason) == (502, "dns_failure")
        assert dns.answered.wait(timeout=10), "the late DNS server never answered"
        for _ in range(3):  # the worker that got the late answer still serves
            c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.U}", world.auth())
            c.close()
            assert r.status == 200
        assert e.alive()
    finally:
        dns.close()
