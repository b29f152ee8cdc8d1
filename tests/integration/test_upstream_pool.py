"""egressd's pool of keep-alive upstream connections: which pooled connection a request may
take without asking the kernel first (UpstreamPool::acquire, kFreshIdle), the retry when the
upstream had closed it, and how a connection is registered with egressd's event loop."""
from __future__ import annotations

import json
import os
import ssl
import time

import helpers
from clients import run_ca
from h2_helpers import add_h2_pins, h2up  # noqa: F401 (module fixture)


def _await_upstream_close(pid: int, port: int, timeout: float = 10.0) -> None:
    """Until each of egressd's connections to `port` has the upstream's FIN (CLOSE_WAIT)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = _tcp_to_port(port)
        ours = [states[i] for i in _socket_inodes(pid) if i in states]
        if ours and all(st == "08" for st in ours):  # 08: TCP_CLOSE_WAIT
            return
        time.sleep(0.01)
    raise AssertionError(f"the upstream did not close egressd's connections to port {port}")


def _after_a_drop(world, e, marker, drop: str, method: str, body: bytes | None,
                  wait_close: bool):
    """A request that the upstream answers and then closes its connection (/drop), and the
    next request on the same tunnel, which egressd would send on that pooled connection: at
    once, or once the upstream's close has reached egressd's socket. Returns the second
    response and what the upstream saw of it."""
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    try:
        r = helpers.request(c, "GET", f"{drop}{'&' if '?' in drop else '?'}{marker}-1",
                            f"api.test:{world.U}")
        assert r.status == 200, (r.status, r.egress_reason)
        if wait_close:
            _await_upstream_close(e.proc.pid, world.U)
        r = helpers.request(c, method, f"/echo/{marker}-2", f"api.test:{world.U}", body=body)
    finally:
        c.close()
    return r, world.upstream.find(f"{marker}-2")


def test_a_pooled_connection_the_upstream_closed_fails_a_get_that_is_retried(world, factory, marker):
    """A GET right after the upstream closed its pooled connection is sent on it without a
    peek (UpstreamPool::kFreshIdle: a fresh connection saves the system call) and, failing
    before any response byte, is sent again on a fresh connection: the client gets the answer
    and the upstream sees the request once."""
    e = factory.start()
    r, seen = _after_a_drop(world, e, marker, "/drop/0", "GET", None, wait_close=False)
    assert r.status == 200, (r.status, r.egress_reason)
    assert json.loads(r.body)["method"] == "GET"
    assert len(seen) == 1


def test_a_pooled_connection_the_upstream_closed_is_not_used_for_a_request_with_a_body(
        world, factory, marker):
    """A request with a body cannot be sent twice: a pooled connection is checked (peeked)
    before it carries one, however recently it was given back, and one the upstream closed is
    not used. Without the peek this POST would go out on the closed connection and fail 502."""
    e = factory.start()
    r, seen = _after_a_drop(world, e, marker, "/drop/0", "POST", b"x" * 1000, wait_close=True)
    assert r.status == 200, (r.status, r.egress_reason)
    assert json.loads(r.body)["body_length"] == 1000
    assert len(seen) == 1


def _second_on_a_pooled_connection(world, e, method: str, path: str):
    """GET /echo on a tunnel (its upstream connection goes back to the pool), then `method`
    without a body on `path` over the same tunnel: the pooled connection, alive, carries it."""
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    try:
        r = helpers.request(c, "GET", f"/echo/{os.urandom(4).hex()}", f"api.test:{world.U}")
        assert r.status == 200, (r.status, r.egress_reason)
        return helpers.request(c, method, path, f"api.test:{world.U}")
    finally:
        c.close()


def test_only_idempotent_requests_are_sent_again_after_a_pooled_connection_closes(
        world, factory, marker):
    """A request that went out on a pooled connection closed without a byte of answer is sent
    once more on a fresh connection only if its method is idempotent (RFC 9110 9.2.2: a proxy
    MUST NOT retry a POST, which the upstream may have acted on): a bodiless POST reaches the
    upstream once and the client gets 502; a GET twice. An answer whose head does not parse
    is the upstream's answer, not a stale connection: never sent again, whatever the method."""
    e = factory.start()
    r = _second_on_a_pooled_connection(world, e, "POST", f"/hangup?{marker}-post")
    assert (r.status, r.egress_reason) == (502, "upstream_bad_response")
    assert len(world.upstream.find(f"{marker}-post")) == 1
    r = _second_on_a_pooled_connection(world, e, "GET", f"/hangup?{marker}-get")
    assert r.status == 502
    assert len(world.upstream.find(f"{marker}-get")) == 2
    for method in ("POST", "GET"):
        r = _second_on_a_pooled_connection(world, e, method, f"/badhead?{marker}-bad{method}")
        assert (r.status, r.egress_reason) == (502, "upstream_bad_response"), method
        assert len(world.upstream.find(f"{marker}-bad{method}")) == 1, method


def test_an_unsolicited_408_on_an_idle_pooled_connection_is_not_the_next_answer(
        world, factory, marker):
    """Some servers write a 408 before they close a connection at their idle timeout. A pooled
    connection idle longer than kFreshIdle is peeked before use, so the next GET is answered
    by its own response on a fresh connection, not by that 408."""
    e = factory.start()
    r, seen = _after_a_drop(world, e, marker, "/drop/300?say=408", "GET", None,
                            wait_close=True)
    assert r.status == 200, (r.status, r.egress_reason)
    assert json.loads(r.body)["method"] == "GET"
    assert len(seen) == 1


def _epoll_masks(pid: int) -> dict[int, int]:
    """fd -> the event mask egressd's epoll instances hold for it (/proc/PID/fdinfo)."""
    masks = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:[eventpoll]":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                for line in f:
                    if line.startswith("tfd:"):
                        parts = line.split()
                        masks[int(parts[1])] = int(parts[3], 16)
        except FileNotFoundError:
            continue
    return masks


def _socket_inodes(pid: int) -> dict[str, int]:
    """socket inode -> egressd's descriptor for it."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if link.startswith("socket:["):
            out[link[8:-1]] = int(fd)
    return out


def _tcp_to_port(port: int) -> dict[str, str]:
    """socket inode -> TCP state (hex, /proc/net/tcp) of the IPv4 connections to `port`."""
    states = {}
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if int(cols[2].split(":")[1], 16) == port:
                states[cols[9]] = cols[3]
    return states


def _sockets_to_port(pid: int, port: int) -> list[int]:
    """egressd's descriptors of TCP connections whose remote port is `port` (IPv4 loopback)."""
    to_port = _tcp_to_port(port)
    return [fd for inode, fd in _socket_inodes(pid).items() if inode in to_port]


def test_a_pooled_upstream_connection_is_registered_for_reads_only(world, factory, marker):
    """Asio registers a dialed socket for writability to wait for its connect and never takes
    that away, so every later wait would also report it writable: a spurious event per read
    wait. egressd registers the connected descriptor again, for reads only (EPOLLOUT = 0x4)."""
    e = factory.start()
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    try:
        r = helpers.request(c, "GET", f"/echo/{marker}", f"api.test:{world.U}")
        assert r.status == 200
        fds = _sockets_to_port(e.proc.pid, world.U)
        assert fds, "no upstream connection from egressd"
        masks = _epoll_masks(e.proc.pid)
        for fd in fds:
            assert fd in masks, f"upstream descriptor {fd} is not registered with epoll"
            assert masks[fd] & 0x4 == 0, f"upstream descriptor {fd}: events {masks[fd]:#x}"
            assert masks[fd] & 0x1, f"upstream descriptor {fd}: events {masks[fd]:#x}"
    finally:
        c.close()


def test_an_idle_pooled_connection_is_closed_after_upstream_idle_timeout(world, factory, marker):
    """limits.upstream_idle_timeout: a pooled upstream connection unused for longer is not
    reused (a new one is dialled); one used again sooner is."""
    e = factory.start(mutate=lambda c: c["limits"].update({"upstream_idle_timeout": "1s"}))
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    try:
        def get(tag):
            before = world.upstream.server.connections
            r = helpers.request(c, "GET", f"/echo/{marker}-{tag}", f"api.test:{world.U}")
            assert r.status == 200, (r.status, r.egress_reason)
            return world.upstream.server.connections - before

        assert get("first") == 1
        assert get("soon") == 0, "a connection idle for less than the timeout is reused"
        time.sleep(1.5)
        assert get("late") == 1, "a connection idle past upstream_idle_timeout was reused"
        assert get("again") == 0
    finally:
        c.close()


def test_a_reload_that_narrows_allow_networks_ends_the_reuse_of_what_it_denies(
        world, factory, h2up, marker):
    """A pooled upstream connection was vetted at its dial: after a reload drops the
    allow_networks exception that let it dial 127.0.0.1, neither a pooled HTTP/1.1
    connection nor a pooled HTTP/2 session carries another request there; the request is
    vetted as a new dial would be (403 denied_address:loopback) and nothing reaches the
    upstream. (Both had gone on serving, credential injected, for as long as they were used.)"""
    def mutate(cfg):
        add_h2_pins(world, h2up)(cfg)
        cfg["limits"]["worker_threads"] = 1  # one worker: one pool
    e = factory.start(mutate)
    ca = run_ca(e, "r1")
    ups = ((world.U, world.upstream), (h2up.port, h2up))

    def get(port, tag):
        c = helpers.tunnel(e.proxy_port, "api.test", port, world.auth(), ca)
        try:
            return helpers.request(c, "GET", f"/echo/{marker}-{tag}", f"api.test:{port}")
        finally:
            c.close()
    for port, _ in ups:
        r = get(port, f"before-{port}")
        assert r.status == 200, (port, r.status, r.egress_reason)
    e.rewrite_config(lambda c: c["policy"].__setitem__("allow_networks", []))
    e.reload()
    for port, up in ups:
        r = get(port, f"after-{port}")
        assert (r.status, r.egress_reason) == (403, "denied_address:loopback"), port
        assert not up.find(f"{marker}-after-{port}"), port


def test_an_allow_networks_exception_in_ipv4_mapped_form_carries_tunnels_and_is_reused(
        world, factory, marker):
    """An allow_networks exception written in IPv4-mapped form (::ffff:127.0.0.1/128) admits a
    name that resolves to that form; the checks made after the dial (a pooled connection's
    reuse, a blind tunnel's bytes) see the address as the dial vetted it. (They saw it as
    127.0.0.1, which the mapped exception does not contain: every tunnel was cut at its first
    byte as policy_changed, and no pooled connection was ever reused.)"""
    def mutate(cfg):
        for host in ("api.test", "tunnel.test"):
            cfg["resolver"]["overrides"][host] = ["::ffff:127.0.0.1"]
        cfg["policy"]["allow_networks"] = ["::ffff:127.0.0.1/128"]
        cfg["limits"]["worker_threads"] = 1  # one worker: one pool
    e = factory.start(mutate)
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    try:
        def get(tag):
            before = world.upstream.server.connections
            r = helpers.request(c, "GET", f"/echo/{marker}-{tag}", f"api.test:{world.U}")
            assert r.status == 200, (r.status, r.egress_reason)
            return world.upstream.server.connections - before
        assert get("first") == 1
        assert get("again") == 0, "the pooled connection was not reused"
    finally:
        c.close()
    t, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.U}", world.auth())
    assert r.status == 200, (r.status, r.egress_reason)
    ctx = ssl.create_default_context(cafile=world.pki.ca)
    ctx.check_hostname = False
    tc = helpers.Conn(ctx.wrap_socket(t.sock, server_hostname="tunnel.test"))
    try:
        r = helpers.request(tc, "GET", f"/echo/{marker}-tunnel", f"tunnel.test:{world.U}")
        assert r.status == 200
    finally:
        tc.close()
    assert world.upstream.find(f"{marker}-tunnel")
    time.sleep(0.2)
    assert not [x for x in e.audit_records() if x.get("reason") == "policy_changed"]


def test_h2_sessions_that_take_no_stream_are_closed_not_piled_up(world, factory, marker):
    """An HTTP/2 upstream that answers a connection's first stream, then allows none
    (SETTINGS_MAX_CONCURRENT_STREAMS 0) and keeps the connection busy with PINGs: every request
    needs a new session, and each session left is closed, not kept beside the new ones (before:
    one open connection per request, for as long as the PINGs came, whatever
    upstream_idle_timeout said). And a session without streams is closed after
    upstream_idle_timeout however often the upstream PINGs."""
    from h2_upstream import H2Upstream
    up = H2Upstream(world.pki.server_cert, world.pki.server_key)
    try:
        up.streams_after_first = 0
        up.ping_every = 0.2
        e = factory.start(add_h2_pins(world, up, {"worker_threads": 1,
                                                  "upstream_idle_timeout": "2s"}))
        for i in range(12):
            c = helpers.tunnel(e.proxy_port, "api.test", up.port, world.auth(), run_ca(e, "r1"))
            try:
                r = helpers.request(c, "GET", f"/echo/{marker}-{i}", f"api.test:{up.port}")
                assert r.status == 200, (r.status, r.egress_reason)
            finally:
                c.close()
        assert len(up.find(marker)) == 12
        assert up.connections == 12  # each session took one stream
        # The sessions left before each new one was added are shut down: at most the last.
        helpers.poll(lambda: up.live <= 1, 3, "the unusable sessions to close")
        # And the last one, unused, after upstream_idle_timeout in spite of its PINGs.
        helpers.poll(lambda: up.live == 0, 5, "the idle session to close")
    finally:
        up.close()
