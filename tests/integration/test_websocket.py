"""WebSocket (RFC 6455) through egressd: an HTTP/1.1 client's upgrade keeps its Upgrade, goes to
the origin on an HTTP/1.1 connection of its own with the pinned credential injected, and after
the origin's 101 the connection is relayed both ways until it closes. What the origin sends is
scrubbed frame by frame (an echoed credential never reaches the sandbox), no extension is
negotiated on a connection that carries a credential (a compressed frame could not be
scrubbed), and the connection ends with one audit record (status 101, bytes both ways). A real
client (websocket-client, through CONNECT) and a real origin (Python's websockets)."""
from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import websocket

import helpers
from clients import run_ca
from ws_upstream import WsUpstream


@pytest.fixture(scope="module")
def ws(world):
    u = WsUpstream(world.pki.server_cert, world.pki.server_key)
    yield u
    u.close()


def _with_ws(ws_port: int, extra_limits: dict | None = None, websocket_policy: bool | None = None):
    def mutate(c):
        helpers.pin_bearer(c, "api.test", ws_port)
        c["policy"]["allow_hosts"].append(f"other.test:{ws_port}")  # intercepted, no pin
        if websocket_policy is not None:
            c["policy"]["websocket"] = websocket_policy
        if extra_limits:
            c["limits"].update(extra_limits)
    return mutate


@pytest.fixture(scope="module")
def e(factory, ws):
    return factory.start(mutate=_with_ws(ws.port), unpinned="intercept")


def _connect(world, e, host: str, port: int, path: str, **kw) -> websocket.WebSocket:
    return websocket.create_connection(
        f"wss://{host}:{port}{path}", http_proxy_host="127.0.0.1",
        http_proxy_port=e.proxy_port, http_proxy_auth=("r1", world.tokens["r1"]),
        proxy_type="http", sslopt={"ca_certs": run_ca(e, "r1")}, timeout=10, **kw)


def _raw_handshake(world, e, host: str, port: int, path: str, extra: list[tuple[str, str]] = ()):
    """A handshake written by hand; returns (Conn, Response)."""
    c = helpers.tunnel(e.proxy_port, host, port, world.auth(), run_ca(e, "r1"))
    r = helpers.request(c, "GET", path, f"{host}:{port}", [
        ("Upgrade", "websocket"), ("Connection", "Upgrade"),
        ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="), ("Sec-WebSocket-Version", "13"),
        *extra])
    return c, r


def _record(e, marker: str, timeout: float = 10.0) -> dict:
    recs = e.wait_audit(lambda r: marker in r.get("path", ""), timeout=timeout)
    assert len(recs) == 1, recs
    return recs[0]


def test_websocket_to_a_pinned_host_carries_the_credential_and_scrubs_its_echo(world, e, ws,
                                                                               marker):
    secret = world.secrets["api_token"]
    # The sandbox's own Authorization is replaced, never merged.
    c = _connect(world, e, "api.test", ws.port, f"/chat/{marker}",
                 header=["Authorization: Bearer sandbox-guess"])
    try:
        seen = ws.last_seen(marker)["headers"]
        assert seen["authorization"] == f"Bearer {secret}"
        assert seen["upgrade"].lower() == "websocket" and "upgrade" in seen["connection"].lower()
        assert "proxy-authorization" not in seen
        # Text and binary both ways, in frames of all three length forms.
        c.send("echo:hello")
        assert c.recv() == "hello"
        blob = os.urandom(200_000)
        c.send_binary(blob)
        assert c.recv() == blob
        c.send("big:70000")
        assert c.recv() == b"x" * 70000
        # The origin echoes the handshake's credential: the sandbox gets it replaced, in a
        # frame of the same length.
        c.send("auth")
        echoed = c.recv()
        assert secret not in echoed, "the origin's echo reached the client unscrubbed"
        assert "[REDACTED]" in echoed, echoed
        assert len(echoed) == len(f"auth=Bearer {secret}")
        # The same echo as one message in four frames, the secret split across them: the
        # client reads one message, scrubbed as a whole.
        for cut in (len("auth=Bearer ") + 3, len("auth=Bearer ") + len(secret) // 2):
            c.send(f"authsplit:{cut}")
            echoed = c.recv()
            # (booleans only: pytest would print the operands, and they may hold the secret)
            leaked = any(secret[i:i + 8] in echoed for i in range(len(secret) - 7))
            assert not leaked, f"a split echo (cut at {cut}) reached the client"
            scrubbed = "[REDACTED]" in echoed and len(echoed) == len(f"auth=Bearer {secret}")
            assert scrubbed, f"cut at {cut}: not one scrubbed message of the echo's length"
        c.send("echo:after the echo")
        assert c.recv() == "after the echo"
    finally:
        c.close()
    rec = _record(e, marker)
    assert rec["status"] == 101 and rec["decision"] == "allow", rec
    assert rec["pin"] is not None and rec["secret"] == "api_token", rec
    assert rec["reason"] == "injected", rec
    assert rec["proto_in"] == "http/1.1" and rec["proto_out"] == "http/1.1", rec
    assert rec["bytes_in"] > 200_000 and rec["bytes_out"] > 270_000, rec
    assert e.leaks() == []


def test_the_origin_closing_ends_the_connection_with_one_record(world, e, ws, marker):
    c = _connect(world, e, "api.test", ws.port, f"/bye/{marker}")
    try:
        c.send("close")
        op, frame = c.recv_data_frame(True)
        assert op == websocket.ABNF.OPCODE_CLOSE
        assert frame.data[:2] == (1000).to_bytes(2, "big") and frame.data[2:] == b"origin done"
    finally:
        c.close()
    rec = _record(e, marker)
    assert rec["status"] == 101 and rec["reason"] == "injected", rec


def test_no_extension_is_negotiated_where_a_credential_is_injected(world, e, ws, marker):
    """permessage-deflate would carry an echoed credential past the frame scrubber: the offer is
    removed for a pinned host. An intercepted host without a pin has nothing to scrub and keeps
    it."""
    offer = ("Sec-WebSocket-Extensions", "permessage-deflate; client_max_window_bits")
    c, r = _raw_handshake(world, e, "api.test", ws.port, f"/pinned/{marker}", [offer])
    c.close()
    assert r.status == 101, (r.status, r.body)
    assert "sec-websocket-extensions" not in ws.last_seen(f"/pinned/{marker}")["headers"]
    assert r.header("sec-websocket-extensions") is None
    assert r.header("upgrade").lower() == "websocket"
    c, r = _raw_handshake(world, e, "other.test", ws.port, f"/unpinned/{marker}", [offer])
    c.close()
    assert r.status == 101, (r.status, r.body)
    assert "permessage-deflate" in ws.last_seen(f"/unpinned/{marker}")["headers"][
        "sec-websocket-extensions"]
    assert "permessage-deflate" in r.header("sec-websocket-extensions")


def test_an_origin_that_refuses_the_upgrade_answers_the_client(world, e, ws, marker):
    with pytest.raises(websocket.WebSocketBadStatusException) as err:
        _connect(world, e, "api.test", ws.port, f"/reject/{marker}")
    assert err.value.status_code == 403
    rec = _record(e, marker)
    assert rec["status"] == 403 and rec["decision"] == "allow", rec


def test_other_upgrades_are_dropped_and_the_request_served_as_http(world, e, marker):
    """h2c (or any protocol but websocket) is not offered upstream: the request is an ordinary
    HTTP/1.1 request there (RFC 9110 7.8 lets a proxy ignore Upgrade)."""
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    try:
        r = helpers.request(c, "GET", f"/echo/{marker}", f"api.test:{world.U}",
                            [("Upgrade", "h2c"), ("Connection", "Upgrade, HTTP2-Settings"),
                             ("HTTP2-Settings", "AAMAAABkAAQCAAAAAAIAAAAA")])
        assert r.status == 200
    finally:
        c.close()
    got = world.upstream.find(marker)[-1]
    names = {k.lower() for k, _ in got.headers}
    assert not names & {"upgrade", "http2-settings", "connection"}, names


def test_policy_websocket_false_refuses_upgrades(world, factory, ws, marker):
    e = factory.start(mutate=_with_ws(ws.port, websocket_policy=False))
    c, r = _raw_handshake(world, e, "api.test", ws.port, f"/nows/{marker}")
    c.close()
    assert r.status == 403 and r.egress_reason == "websocket_denied", (r.status, r.body)
    assert not [s for s in ws.seen if marker in s["path"]], "the upgrade reached the origin"
    rec = _record(e, marker)
    assert rec["decision"] == "deny" and rec["reason"] == "websocket_denied", rec


def test_an_idle_websocket_is_closed_at_idle_timeout(world, factory, ws, marker):
    e = factory.start(mutate=_with_ws(ws.port, extra_limits={"idle_timeout": "1500ms"}))
    c = _connect(world, e, "api.test", ws.port, f"/idle/{marker}")
    try:
        # Traffic either way keeps it open: a quiet spell shorter than the timeout passes.
        c.send("wait:1.0")
        assert c.recv() == "waited"
        t0 = time.monotonic()
        with pytest.raises((websocket.WebSocketConnectionClosedException, ConnectionError)):
            c.recv()
        assert 1.0 < time.monotonic() - t0 < 6.0
    finally:
        c.close()
    rec = _record(e, marker)
    assert rec["status"] == 101 and rec["reason"] == "idle_timeout", rec


def test_an_open_websocket_is_cut_at_drain_timeout_with_its_record(world, factory, ws, marker):
    e = factory.start(mutate=_with_ws(ws.port))  # drain_timeout 2s
    c = _connect(world, e, "api.test", ws.port, f"/drain/{marker}")
    try:
        c.send("echo:before")
        assert c.recv() == "before"
        t0 = time.monotonic()
        e.proc.send_signal(signal.SIGTERM)
        # In flight until the drain's deadline: it still works during the drain.
        time.sleep(0.5)
        c.send("echo:during")
        assert c.recv() == "during"
        with pytest.raises((websocket.WebSocketConnectionClosedException, ConnectionError)):
            c.recv()
        assert e.proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 15
    finally:
        c.close()
    recs = [r for r in e.audit_records() if marker in r.get("path", "")]
    assert len(recs) == 1 and recs[0]["status"] == 101, recs
    assert recs[0]["reason"] == "drain_timeout", recs


def _masked_text_frame(text: str) -> bytes:
    payload = text.encode()
    assert len(payload) < 126
    mask = os.urandom(4)
    return bytes([0x81, 0x80 | len(payload)]) + mask + bytes(
        b ^ mask[i % 4] for i, b in enumerate(payload))


def test_cleartext_websocket_through_an_absolute_form_request(world, factory, marker):
    """ws:// through the forward port: `GET http://host/...` with the upgrade, then frames both
    ways on the same connection (no credential on cleartext)."""
    plain = WsUpstream()
    try:
        def mutate(c):
            c["policy"]["allowed_ports"].append(plain.port)
            c["policy"]["allow_hosts"].append(f"other.test:{plain.port}")
        e = factory.start(mutate=mutate)
        s = socket.create_connection(("127.0.0.1", e.proxy_port), timeout=10)
        c = helpers.Conn(s)
        c.send((f"GET http://other.test:{plain.port}/plain/{marker} HTTP/1.1\r\n"
                f"Host: other.test:{plain.port}\r\nProxy-Authorization: {world.auth()}\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                "\r\n").encode())
        r = helpers.read_response(c)
        assert r.status == 101, (r.status, r.body)
        assert r.header("sec-websocket-accept") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        c.send(_masked_text_frame("echo:over cleartext"))
        assert c.read_exact(2 + len("over cleartext")) == bytes([0x81, 14]) + b"over cleartext"
        c.close()
        rec = _record(e, marker)
        assert rec["status"] == 101 and rec["scheme"] == "http" and rec["pin"] is None, rec
    finally:
        plain.close()


@pytest.mark.parametrize("query", [
    "", "?upgrade=websocket", "?upgrade=websocket&accept=bm90IHRoZSBhY2NlcHQ=",
    # The accept value of the client's own key (RFC 6455's sample): the client can compute it,
    # so an upstream that echoes it must not open the relay either. egressd sends the
    # upstream a key of its own, which the client never sees.
    "?upgrade=websocket&accept=s3pPLMBiTxaQ9kYGzzhZRbK%2BxOo%3D"])
def test_a_101_that_does_not_answer_the_handshake_is_refused(world, e, query):
    """An upstream endpoint that lets its client choose the status (and here headers) says
    101 without being a WebSocket server: switching to a raw relay there would let the
    sandbox send that upstream requests the pipeline never saw. Only a 101 with `Upgrade:
    websocket` and the Sec-WebSocket-Accept of the key egressd sent is relayed."""
    before = len([r for r in e.audit_records() if r.get("path") == "/status/101"])
    c, r = _raw_handshake(world, e, "api.test", world.U, f"/status/101{query}")
    c.close()
    assert r.status == 502 and r.egress_reason == "upstream_bad_response", (r.status, r.body)
    recs = e.wait_audit(lambda r: r.get("path") == "/status/101", count=before + 1)
    assert recs[-1]["status"] == 502 and recs[-1]["reason"] == "upstream_bad_response", recs


def test_revoking_the_run_closes_its_open_websocket(world, factory, ws, marker):
    """A WebSocket is a connection of its run: a revoke (DELETE /v1/runs/{id}) closes it at
    once, as it closes the run's other connections."""
    from cp_helpers import api_ok, bearer_pin, cp_mutate, create_run, put_secret
    e = factory.start(mutate=cp_mutate(world, ports=[ws.port]))
    value = "ws-itest-" + os.urandom(12).hex()
    put_secret(e, "ws_tok", value, org="acme")
    run = create_run(e, world, {"org": "acme"}, [bearer_pin(f"api.test:{ws.port}", "ws_tok")])
    c = websocket.create_connection(
        f"wss://api.test:{ws.port}/revoked/{marker}", http_proxy_host="127.0.0.1",
        http_proxy_port=e.proxy_port, http_proxy_auth=(run.id, run.token), proxy_type="http",
        sslopt={"ca_certs": run.ca_file}, timeout=10)
    try:
        assert ws.last_seen(marker)["headers"]["authorization"] == f"Bearer {value}"
        c.send("echo:before the revoke")
        assert c.recv() == "before the revoke"
        t0 = time.monotonic()
        api_ok(e, "DELETE", f"/v1/runs/{run.id}")
        with pytest.raises((websocket.WebSocketConnectionClosedException, ConnectionError)):
            c.send("echo:after the revoke")
            c.recv()
        assert time.monotonic() - t0 < 5
    finally:
        c.close()
    rec = _record(e, marker)
    assert rec["status"] == 101 and rec["run"] == run.id, rec
    assert rec["reason"] == "run_revoked", rec  # egressd cut it, not its client
    assert e.leaks(extra_needles=[value.encode()]) == []
