"""HTTP/2 client leg under stress: a SIGTERM drain lets streams in flight finish while their
client keeps sending frames; slow or non-reading clients neither stall the pooled upstream
session nor pin unbounded memory; unfinished heads time out; an over-limit header block gets
its 431; a client reset stops the stream's upstream work."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import time

import pytest
from hyperframe.frame import DataFrame, HeadersFrame, RstStreamFrame

import helpers
from clients import proxy_env, run_ca
from dns_server import DnsServer, fixed
from h2_helpers import (H2Client, RawH2, add_h2_pins, frames_until_closed,  # noqa: F401
                        h2up, header)
from helpers import SANITIZER, poll
from upstream import payload_sha256

MiB = 1 << 20


def test_sigterm_drain_finishes_h2_upload_and_download(world, factory, marker, tmp_path):
    """Both clients send frames after the drain's GOAWAY: curl its upload DATA, the raw client
    a connection WINDOW_UPDATE for every DATA frame it reads (its connection window is 64 KiB).
    Both finish intact. (python-h2 itself refuses frames after a GOAWAY: hence raw frames.)"""
    e = factory.start(mutate=lambda c: c["limits"].update({"drain_timeout": "30s"}))
    upload = tmp_path / "up.bin"
    data = os.urandom(3 * MiB)
    upload.write_bytes(data)
    curl = subprocess.Popen(
        ["curl", "-sS", "-f", "--http2", "--max-time", "60", "--cacert", run_ca(e, "r1"),
         "--limit-rate", "1M", "-T", str(upload),
         f"https://api.test:{world.U}/upload/{marker}-up"],
        env=proxy_env(e, "r1", world.tokens["r1"]), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    try:
        n = 2 * MiB
        c = H2Client(e, world, "api.test", world.U, timeout=30, settings={4: 16 * MiB})
        raw = RawH2(c)
        sid = raw.send_headers([(":method", "GET"), (":scheme", "https"),
                                (":authority", f"api.test:{world.U}"),
                                (":path", f"/bytes/{n}?pace=100&id={marker}-dl")])
        # The download is mid-body at the upstream, the upload has reached it.
        raw.pump(until=lambda: world.upstream.progress(f"{marker}-dl") >= 512 * 1024, timeout=20)
        poll(lambda: world.upstream.find(f"{marker}-up"), 20, "the upload upstream")
        assert world.upstream.progress(f"{marker}-dl") < n
        e.proc.send_signal(signal.SIGTERM)
        st = raw.streams[sid]
        raw.pump(until=lambda: st["ended"] or st["reset"] is not None, timeout=40)
        assert st["status"] == 200 and st["reset"] is None and st["ended"], \
            (st["status"], st["reset"], len(st["body"]), raw.closed, raw.goaway)
        assert raw.goaway == 0  # the drain's GOAWAY came
        assert len(st["body"]) == n
        assert hashlib.sha256(st["body"]).hexdigest() == payload_sha256(n)
        out, err = curl.communicate(timeout=60)
        assert curl.returncode == 0, err.decode(errors="replace")
        got = json.loads(out)
        assert got == {"length": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        raw.pump(until=lambda: raw.closed, timeout=10)  # then egressd closes the connection
        assert raw.closed
        c.close()
        assert e.proc.wait(timeout=30) == 0
    finally:
        if curl.poll() is None:
            curl.kill()
    recs = {r["path"]: r for r in e.audit_records()}
    assert recs[f"/upload/{marker}-up"]["status"] == 200
    assert recs[f"/upload/{marker}-up"]["bytes_in"] == len(data)
    assert recs[f"/bytes/{n}"]["status"] == 200 and recs[f"/bytes/{n}"]["bytes_out"] == n


def test_non_reading_streams_do_not_stall_pooled_upstream_session(world, factory, h2up, marker):
    """Client A opens five 8 MiB downloads and reads none of them (its windows are 0); client
    B, another connection of the same run on the same (single) worker, so on the same pooled
    upstream h2 session, still gets its 2 MiB. Each of A's streams holds a stream window of
    upstream data; together they used to hold the whole upstream connection window."""
    e = factory.start(add_h2_pins(world, h2up, limits={"worker_threads": 1}))
    upstream_conns = h2up.connections
    a = H2Client(e, world, "api.test", h2up.port, timeout=30, settings={4: 0})
    b = None
    try:
        a.pump(timeout=0.3)
        for i in range(5):
            a.headers(f"/bytes/{8 * MiB}?{marker}-slow-{i}")
        a.flush()
        poll(lambda: len(h2up.find(f"{marker}-slow")) == 5, 10, "the slow streams upstream")
        a.pump(timeout=1.0)  # their heads come back; the upstream fills their windows
        b = H2Client(e, world, "api.test", h2up.port, timeout=30)
        r = b.request(f"/bytes/{2 * MiB}?{marker}-b", timeout=20)
        assert r["status"] == 200 and r["ended"], (r["status"], len(r["body"]), r["reset"])
        assert len(r["body"]) == 2 * MiB
        assert h2up.connections - upstream_conns == 1  # both clients on one pooled session
    finally:
        a.close()
        if b is not None:
            b.close()


def _unread_downloads_grow_rss(e, world, port: int, marker: str, settle: float) -> int:
    """Two connections each open 100 downloads of 4 MiB from `port` with a stream window of 0
    and read nothing; returns how far egressd's peak RSS grew (KiB) once the heads came back
    and `settle` seconds passed."""
    clients = []
    try:
        base = e.vm_hwm_kib()
        for k in range(2):
            c = H2Client(e, world, "api.test", port, timeout=30, settings={4: 0})
            c.pump(timeout=0.3)
            for i in range(100):
                c.headers(f"/bytes/{4 * MiB}?id={marker}-{k}-{i}")
            c.flush()
            clients.append(c)
        if port == world.U:
            ids = [f"{marker}-{k}-{i}" for k in range(2) for i in range(100)]
            poll(lambda: all(world.upstream.progress(i) > 0 for i in ids), 30,
                 "200 downloads upstream")
        for c in clients:  # the heads come back (HEADERS are not flow-controlled)
            c.pump(until=lambda c=c: sum(r["status"] == 200 for r in c.responses.values()) == 100,
                   timeout=20)
            assert sum(r["status"] == 200 for r in c.responses.values()) == 100
        time.sleep(settle)  # every handler has read what it can of its upstream
        grown = e.vm_hwm_kib() - base
        print(f"peak RSS grew {grown} KiB")
        assert e.alive()
        return grown
    finally:
        for c in clients:
            c.close()


def test_non_reading_client_pins_bounded_response_bytes(world, factory, marker):
    """Two connections each open 100 downloads of 4 MiB with a stream window of 0 and read
    nothing. The responses queued for them are bounded per connection (h2_connection_window,
    4 x h2_stream_window by default), not 100 streams x h2_stream_window each (which took peak
    RSS up by ~60 MiB)."""
    e = factory.start()
    grown = _unread_downloads_grow_rss(e, world, world.U, marker, settle=1.0)
    if not SANITIZER:
        assert grown < 32 * 1024, f"peak RSS grew {grown} KiB"


def test_non_reading_client_behind_an_h2_upstream_pins_streams_times_window(world, factory,
                                                                          h2up, marker):
    """The same two connections of 100 unread downloads, behind an HTTP/2 upstream: each
    upstream stream also holds what it was sent within its stream window (given back only as
    it is forwarded), so a client connection pins up to h2_max_concurrent_streams x
    h2_stream_window besides its queue; with a 64 KiB window that is ~6.5 MiB a connection
    (the default 256 KiB took ~57 MiB for the two)."""
    e = factory.start(add_h2_pins(world, h2up, limits={"h2_stream_window": 65536}))
    grown = _unread_downloads_grow_rss(e, world, h2up.port, marker, settle=1.5)
    if not SANITIZER:
        assert grown < 32 * 1024, f"peak RSS grew {grown} KiB"


def test_h2_settings_timeout_ends_a_client_that_never_acknowledges(world, factory, h2up):
    """limits.h2_settings_timeout: a client that never acknowledges egressd's SETTINGS (it
    reads nothing, so python-h2 never ACKs) gets GOAWAY SETTINGS_TIMEOUT after it, 1 s here."""
    e = factory.start(add_h2_pins(world, h2up, limits={"h2_settings_timeout": "1s"}))
    c = H2Client(e, world, "api.test", h2up.port, timeout=30)
    try:
        took, goaway = frames_until_closed(c.sock, 8)
    finally:
        c.close()
    assert goaway == 4 and took is not None and 0.8 < took < 5, (took, goaway)


def test_h2_max_settings_bounds_the_entries_of_a_settings_frame(world, factory, h2up):
    """limits.h2_max_settings: a SETTINGS frame of more entries (40 > 10 here) ends the
    connection with GOAWAY ENHANCE_YOUR_CALM; one within it is acknowledged."""
    e = factory.start(add_h2_pins(world, h2up, limits={"h2_max_settings": 10}))

    def settings(n: int) -> bytes:
        payload = b"".join(struct.pack("!HI", 0x4, 65535) for _ in range(n))
        return struct.pack("!I", len(payload))[1:] + bytes([4, 0]) + bytes(4) + payload
    ok = H2Client(e, world, "api.test", h2up.port, timeout=30)
    try:
        ok.send_raw(settings(10))
        assert ok.request("/echo/settings-ok")["status"] == 200
    finally:
        ok.close()
    c = H2Client(e, world, "api.test", h2up.port, timeout=30)
    try:
        c.send_raw(settings(40))
        took, goaway = frames_until_closed(c.sock, 5)
    finally:
        c.close()
    assert goaway == 11 and took is not None, (took, goaway)


def test_h2_connection_window_is_the_clients_connection_window(world, factory, marker):
    """limits.h2_connection_window is the connection-level window a client may fill: a client
    uploading on several streams at once stops at it (the streams' own windows allow more)
    until egressd has forwarded the bytes."""
    e = factory.start(mutate=lambda c: c["limits"].update(
        {"h2_connection_window": 200000, "h2_stream_window": 131072}))
    c = H2Client(e, world, "api.test", world.U, timeout=30)
    try:
        c.pump(timeout=0.5)  # SETTINGS and the connection's WINDOW_UPDATE
        assert c.conn.outbound_flow_control_window == 200000
        sids = [c.headers(f"/upload/{marker}-{i}", "POST", [("content-length", str(MiB))],
                          end_stream=False) for i in range(3)]
        assert all(c.conn.local_flow_control_window(s) == 131072 for s in sids)
        # two streams' windows (262144) are more than the connection's window allows
        for _ in range(8):
            c.conn.send_data(sids[0], b"a" * 16384)
        assert c.conn.outbound_flow_control_window == 200000 - 131072
        assert c.conn.local_flow_control_window(sids[1]) == 200000 - 131072
    finally:
        c.close()


def _raw_client(e, world, h2up, **kw):
    c = H2Client(e, world, "api.test", h2up.port, timeout=30, **kw)
    return c, RawH2(c)


def test_unfinished_header_block_times_out(world, factory, h2up, marker):
    """A HEADERS frame without END_HEADERS and then nothing: after header_timeout the
    connection is closed (a header block cannot be abandoned) and audited header_timeout."""
    e = factory.start(add_h2_pins(world, h2up, limits={"header_timeout": "1s",
                                                       "idle_timeout": "30s"}))
    c, raw = _raw_client(e, world, h2up)
    try:
        block = raw.enc.encode([(":method", "GET"), (":scheme", "https"),
                                (":authority", f"api.test:{h2up.port}"),
                                (":path", f"/echo/{marker}")])
        raw.streams[1] = {"status": None, "reset": None, "ended": False, "headers": []}
        raw.send(HeadersFrame(1, data=block, flags=["END_STREAM"]).serialize())  # no END_HEADERS
        t0 = time.monotonic()
        raw.pump(until=lambda: raw.closed, timeout=15)
        assert raw.closed and time.monotonic() - t0 < 10, (raw.closed, raw.goaway)
    finally:
        c.close()
    assert h2up.find(marker) == []
    poll(lambda: any(r.get("reason") == "header_timeout" for r in e.audit_records()), 5,
          "a header_timeout audit record")


def test_half_open_stream_after_early_response_is_closed(world, factory, h2up, marker):
    """A POST whose body never comes is answered 408 after idle_timeout; the stream is then
    reset with NO_ERROR (not left half-open), and the connection closes once idle."""
    e = factory.start(add_h2_pins(world, h2up, limits={"header_timeout": "1s",
                                                       "idle_timeout": "2s"}))
    c, raw = _raw_client(e, world, h2up)
    try:
        sid = raw.send_headers([(":method", "POST"), (":scheme", "https"),
                                (":authority", f"api.test:{h2up.port}"),
                                (":path", f"/echo/{marker}")], end_stream=False)
        raw.pump(until=lambda: raw.streams[sid]["reset"] is not None, timeout=10)
        st = raw.streams[sid]
        assert st["status"] == 408 and st["ended"], st
        assert dict(st["headers"]).get("x-egress-reason") == "body_timeout"
        assert st["reset"] == 0  # NO_ERROR: the response was complete
        raw.pump(until=lambda: raw.closed, timeout=10)
        assert raw.closed
    finally:
        c.close()


def test_over_limit_header_block_answers_431(world, factory, h2up, marker):
    e = factory.start(add_h2_pins(world, h2up))
    c = H2Client(e, world, "api.test", h2up.port)
    try:
        many = [(f"x-f{i}", "v") for i in range(150)]  # h2_max_header_fields: 100
        r = c.request(f"/echo/{marker}-many", extra=many, timeout=5)
        assert r["status"] == 431 and r["reset"] is None, r
        assert dict(r["headers"]).get("x-egress-reason") == "header_too_large"
        big = [("x-big", "a" * 8000)] * 10  # h2_max_header_list_bytes: 64 KiB
        r = c.request(f"/echo/{marker}-big", extra=big, timeout=5)
        assert r["status"] == 431, r
        ok = c.request(f"/echo/{marker}-ok")  # the connection goes on
        assert ok["status"] == 200, ok
    finally:
        c.close()
    assert [x.path for x in h2up.find(marker)] == [f"/echo/{marker}-ok"]
    recs = [r for r in e.audit_records() if r.get("reason") == "header_too_large"]
    assert [r["status"] for r in recs] == [431, 431]


def test_over_limit_trailers_answer_400_bad_framing(world, factory, h2up, marker):
    """Request trailers over the header budget come after the head went out: the body ends
    malformed, 400 bad_framing with its reason and a deny record, as on HTTP/1.1. (nghttp2 had
    reset the stream with INTERNAL_ERROR, no answer, and the record said allow /
    client_aborted.) The h2 upstream's stream is reset, never complete; the connection goes on."""
    e = factory.start(add_h2_pins(world, h2up))
    c = H2Client(e, world, "api.test", h2up.port)
    raw = RawH2(c)
    try:
        sid = raw.send_headers([(":method", "POST"), (":scheme", "https"),
                                (":authority", f"api.test:{h2up.port}"),
                                (":path", f"/echo/{marker}-trailers")], end_stream=False)
        raw.send(DataFrame(sid, data=b"hello").serialize())
        many = [(f"x-t{i}", "v") for i in range(150)]  # h2_max_header_fields: 100
        raw.send(HeadersFrame(sid, data=raw.enc.encode(many),
                              flags=["END_HEADERS", "END_STREAM"]).serialize())
        st = raw.streams[sid]
        raw.pump(until=lambda: st["ended"] or st["reset"] is not None, timeout=10)
        assert st["status"] == 400, st
        assert dict(st["headers"]).get("x-egress-reason") == "bad_framing", st
        ok = raw.send_headers([(":method", "GET"), (":scheme", "https"),
                               (":authority", f"api.test:{h2up.port}"),
                               (":path", f"/echo/{marker}-after")])
        raw.pump(until=lambda: raw.streams[ok]["ended"], timeout=10)
        assert raw.streams[ok]["status"] == 200, raw.streams[ok]
    finally:
        c.close()
    rec = e.wait_audit(lambda a: f"{marker}-trailers" in (a.get("path") or ""))[-1]
    assert (rec["decision"], rec["status"], rec["reason"]) == ("deny", 400, "bad_framing"), rec
    assert [r.path for r in h2up.find(marker)] == [f"/echo/{marker}-after"]


def test_an_over_limit_head_stays_refused_when_its_trailers_are_over_too(world, factory, h2up,
                                                                          marker):
    """A head over the header budget, its body and over-budget trailers, all in one write:
    the trailers' malformed body must not replace the head's refusal (the head, its fields
    past the budget dropped, had gone through the pipeline and upstream): 431."""
    e = factory.start(add_h2_pins(world, h2up))
    c = H2Client(e, world, "api.test", h2up.port)
    raw = RawH2(c)
    try:
        sid = raw.next_sid
        raw.next_sid += 2
        raw.streams[sid] = {"status": None, "reset": None, "ended": False, "headers": [],
                            "body": b""}
        head = [(":method", "POST"), (":scheme", "https"), (":authority", f"api.test:{h2up.port}"),
                (":path", f"/echo/{marker}-both")] + [(f"x-f{i}", "v") for i in range(150)]
        many = [(f"x-t{i}", "v") for i in range(150)]
        raw.send(HeadersFrame(sid, data=raw.enc.encode(head), flags=["END_HEADERS"]).serialize()
                 + DataFrame(sid, data=b"hello").serialize()
                 + HeadersFrame(sid, data=raw.enc.encode(many),
                                flags=["END_HEADERS", "END_STREAM"]).serialize())
        st = raw.streams[sid]
        raw.pump(until=lambda: st["ended"] or st["reset"] is not None, timeout=10)
        assert st["status"] == 431, st
        assert dict(st["headers"]).get("x-egress-reason") == "header_too_large", st
    finally:
        c.close()
    rec = e.wait_audit(lambda a: f"{marker}-both" in (a.get("path") or ""))[-1]
    assert (rec["status"], rec["reason"]) == (431, "header_too_large"), rec
    assert not h2up.heads(f"{marker}-both"), "the head reached the upstream"


def test_reset_streams_do_not_exceed_concurrent_stream_limit(world, factory, marker):
    """Streams reset by the client while their handler cannot be cut still count: with
    h2_max_concurrent_streams 10, of 20 such streams the later ones are refused
    (REFUSED_STREAM), though the client keeps few streams open. The handlers wait for a DNS
    lookup the server never answers, each its own (the destination answered over HTTP/1.1
    before, so its dials are not shared, and nothing is pooled): a reset ends a TCP connect,
    a TLS handshake or a wait for another stream's dial (test_client_gone.py), not a lookup.
    (A reset while waiting for a response head ends its handler at once: below.)"""
    dns = DnsServer()
    dns.set("stall.test", fixed("127.0.0.1"))

    def mutate(c):
        c["limits"].update({"h2_max_concurrent_streams": 10, "dns_timeout": "10s",
                            "max_upstream_idle_per_host": 0, "worker_threads": 1})
        c["resolver"]["servers"] = [dns.address]
        helpers.pin_bearer(c, "stall.test", world.U)
    e = factory.start(mutate=mutate)
    # One answered request first (its worker, the only one, learns that the destination
    # speaks HTTP/1.1 only), on a connection of its own (RawH2 keeps its own HPACK state).
    warm = H2Client(e, world, "stall.test", world.U, timeout=30)
    first = warm.request(f"/echo/{marker}-first")
    warm.close()
    assert first["status"] == 200, first
    dns.mute = True
    c = H2Client(e, world, "stall.test", world.U, timeout=30)
    raw = RawH2(c)
    A = f"stall.test:{world.U}"
    try:
        sids = []
        for i in range(20):  # ~2 s, shorter than the lookup's timeout (10 s)
            sid = raw.send_headers([(":method", "GET"), (":scheme", "https"), (":authority", A),
                                    (":path", f"/x?m={marker}-{i}")])
            sids.append(sid)
            raw.pump(until=lambda: raw.streams[sid]["reset"] is not None, timeout=0.1)
            if raw.streams[sid]["reset"] is None:
                raw.send(RstStreamFrame(sid, error_code=8).serialize())  # CANCEL
        raw.pump(timeout=0.5)
        refused = sum(raw.streams[s]["reset"] == 7 for s in sids)
        assert refused >= 8, refused  # 0 before: each reset freed a slot at once
        assert raw.goaway is None and not raw.closed
    finally:
        c.close()
        dns.close()
    poll(lambda: sum(r.get("reason") == "too_many_streams" for r in e.audit_records()) ==
          refused, 5, "an audit record per refused stream")


def test_reset_while_waiting_for_the_answer_ends_the_upstream_part(world, factory, marker):
    """A stream the client resets while egressd waits for its upstream's answer is given up
    at once: the upstream request is cut, its handler ends (audited client_aborted, status 0),
    and its slot is free, so a client that cancels slow requests is not refused new ones."""
    e = factory.start(mutate=lambda c: c["limits"].update({"h2_max_concurrent_streams": 4}))
    c = H2Client(e, world, "api.test", world.U, timeout=30)
    raw = RawH2(c)
    A = f"api.test:{world.U}"
    try:
        sids = []
        for i in range(4):
            sids.append(raw.send_headers([(":method", "GET"), (":scheme", "https"),
                                          (":authority", A),
                                          (":path", f"/delay/8000?m={marker}-{i}")]))
        poll(lambda: len(world.upstream.find(marker)) == 4, 5, "four requests at the upstream")
        for sid in sids:
            raw.send(RstStreamFrame(sid, error_code=8).serialize())  # CANCEL
        t0 = time.monotonic()
        # (this egressd's only /delay requests; the audit path has no query, so no marker)
        recs = e.wait_audit(lambda r: r.get("path") == "/delay/8000", count=4, timeout=5)
        assert all(r["reason"] == "client_aborted" and r["status"] == 0 for r in recs), recs
        assert all(r["duration_ms"] < 4000 for r in recs), recs  # not the upstream's 8 s
        ok = raw.send_headers([(":method", "GET"), (":scheme", "https"), (":authority", A),
                               (":path", f"/echo/{marker}-next")])
        raw.pump(until=lambda: raw.streams[ok]["status"] is not None
                 or raw.streams[ok]["reset"] is not None, timeout=5)
        assert raw.streams[ok]["status"] == 200, raw.streams[ok]
        assert time.monotonic() - t0 < 4
    finally:
        c.close()


def test_unread_streams_holding_the_queue_budget_do_not_stall_a_read_stream(world, factory,
                                                                            marker):
    """Six downloads whose client never acknowledges their DATA each queue about a stream
    window (h2_stream_window, 256 KiB) in egressd, more than the connection's queue budget
    (h2_connection_window, 1 MiB); a seventh download on the same connection, read as it comes,
    still completes at once (it used to wait for idle_timeout, then was reset INTERNAL_ERROR;
    the fifth and sixth did not even get their first window's worth), and the unread ones still
    get no more than their windows."""
    e = factory.start(mutate=lambda c: c["limits"].update({"idle_timeout": "30s"}))
    c = H2Client(e, world, "api.test", world.U, timeout=30)
    try:
        c.conn.increment_flow_control_window(64 * MiB)  # connection level only
        c.flush()
        c.pump(timeout=0.3)
        slow = []
        for i in range(6):
            sid = c.headers(f"/bytes/{4 * MiB}?id={marker}-slow{i}")
            c.hold.add(sid)
            slow.append(sid)
        c.flush()
        # Each fills the client's stream window (64 KiB), then egressd queues its next bytes.
        c.pump(until=lambda: all(c.responses[s].get("held", 0) >= 65535 for s in slow),
               timeout=10)
        assert all(c.responses[s].get("held", 0) == 65535 for s in slow), \
            [c.responses[s].get("held") for s in slow]
        c.pump(timeout=1.0)  # and queues them: the budget is full
        t0 = time.monotonic()
        sid = c.headers(f"/bytes/{2 * MiB}?id={marker}-read")
        c.flush()
        r = c.responses[sid]
        c.pump(until=lambda: r["ended"] or r["reset"] is not None, timeout=15)
        took = time.monotonic() - t0
        assert r["ended"] and r["reset"] is None, (r["status"], len(r["body"]), r["reset"], took)
        assert hashlib.sha256(r["body"]).hexdigest() == payload_sha256(2 * MiB)
        for s in slow:
            assert c.responses[s]["reset"] is None and c.responses[s]["held"] == 65535
    finally:
        c.close()


@pytest.mark.parametrize("max_header_bytes,pad", [(65536, 65400), (262144, 250000)])
def test_response_head_near_max_header_bytes_reaches_an_h2_client(world, factory, marker,
                                                                  max_header_bytes, pad):
    """A response head within limits.max_header_bytes (from an HTTP/1.1 upstream) reaches an
    HTTP/2 client whole. nghttp2 sends no header block over max_send_header_block_length (64 KiB
    of its estimate by default): it dropped this HEADERS frame silently, the stream hung until
    idle_timeout and was audited 200 client_aborted."""
    e = factory.start(mutate=lambda c: c["limits"].update(
        {"max_header_bytes": max_header_bytes, "idle_timeout": "20s"}))
    c = H2Client(e, world, "api.test", world.U, timeout=30)
    c.conn.decoder.max_header_list_size = 1 << 20  # the client takes heads that large
    try:
        r = c.request(f"/bighead/{pad}?{marker}", timeout=10)
    finally:
        c.close()
    assert r["status"] == 200 and r["ended"], (r["status"], r["ended"], r["reset"])
    assert dict(r["headers"]).get("x-pad") == "p" * pad
    # (the audit's path has no query: this egressd's only /bighead request)
    poll(lambda: [x for x in e.audit_records() if "/bighead/" in x.get("path", "")], 5, "audit")
    rec = [x for x in e.audit_records() if "/bighead/" in x.get("path", "")]
    assert [(x["status"], x.get("reason")) for x in rec] == [(200, "injected")], rec


@pytest.fixture(scope="module")
def bigup(world):
    """An h2 upstream that takes request heads up to 1 MiB (decoded)."""
    from h2_upstream import H2Upstream
    u = H2Upstream(world.pki.server_cert, world.pki.server_key)
    u.max_header_list_size = 1 << 20
    yield u
    u.close()


@pytest.mark.parametrize("down", ["h1", "h2"])
def test_request_head_within_limits_reaches_an_h2_upstream(world, factory, bigup, marker, down):
    """A request head within egressd's limits, with the credential egressd injects, goes to an
    HTTP/2 upstream: from an HTTP/1.1 client, 90 fields near the default max_header_bytes
    (each costs nghttp2's estimate 8 bytes more than its HTTP/1.1 line); from an HTTP/2 client,
    120 KB of fields under a raised h2_max_header_list_bytes. nghttp2 did not send such a head
    (over its 64 KiB default block length) and closed the stream REFUSED_STREAM, which egressd
    took for the upstream's refusal: ten retries, then 502 upstream_refused_stream, though the
    upstream never saw a byte."""
    path = f"/echo/{marker}"
    authority = f"api.test:{bigup.port}"
    if down == "h2":
        e = factory.start(add_h2_pins(world, bigup, limits={"h2_max_header_list_bytes": 262144}))
        # 8 frames (h2_max_continuations); nghttp2 decodes no field over 64 KiB
        fields = [(f"x-big{i}", "a" * 30_000) for i in range(4)]
        c = H2Client(e, world, "api.test", bigup.port, timeout=30)
        try:
            r = c.request(path, extra=fields, timeout=15)
        finally:
            c.close()
        status, reason = r["status"], header(r, "x-egress-reason")
    else:
        e = factory.start(add_h2_pins(world, bigup))
        fixed = len(f"GET {path} HTTP/1.1\r\nHost: {authority}\r\n\r\n")
        size = (65536 - 600 - fixed) // 90 - len("x-f00: \r\n")  # 600 bytes within the limit
        fields = [(f"x-f{i:02d}", "v" * size) for i in range(90)]
        conn = helpers.tunnel(e.proxy_port, "api.test", bigup.port, world.auth("r1"),
                              run_ca(e, "r1"))
        try:
            resp = helpers.request(conn, "GET", path, authority, fields)
        finally:
            conn.close()
        status, reason = resp.status, resp.egress_reason
    assert status == 200, (status, reason)
    seen = bigup.find(marker)
    assert len(seen) == 1 and [h for h in seen[0].headers if h[0].startswith("x-")] == fields
    assert dict(seen[0].headers)["authorization"].startswith("Bearer ")
    assert bigup.refused == 0


def test_request_head_too_large_to_send_is_431_not_retried(world, factory, bigup, marker):
    """A request head that would go out over the largest header block egressd sends (here
    through a pin's extra header of 600 KB) is refused on its own: 431 header_too_large, nothing
    reaches the upstream and the request is not sent again (it was taken for the upstream's
    REFUSED_STREAM: ten retries, then 502 upstream_refused_stream)."""
    pinned = add_h2_pins(world, bigup)

    def mutate(cfg):
        pinned(cfg)
        for pin in cfg["runs"][0]["pins"]:
            if pin["host"] == f"hdr.test:{bigup.port}":
                pin["headers"] = {"x-huge": "h" * 600_000}
    e = factory.start(mutate)
    c = H2Client(e, world, "hdr.test", bigup.port, timeout=30)
    try:
        r = c.request(f"/echo/{marker}", timeout=15)
        assert r["status"] == 431, (r["status"], header(r, "x-egress-reason"))
        assert header(r, "x-egress-reason") == "header_too_large"
    finally:
        c.close()
    # The same from an HTTP/1.1 client with a body: egressd sends the head before the body,
    # and a head that never opened a stream is still the 431, not 502 upstream_write_failed.
    t = helpers.tunnel(e.proxy_port, "hdr.test", bigup.port, world.auth(),
                       e.config["runs"][0]["ca_cert_out"])
    try:
        r1 = helpers.request(t, "POST", f"/echo/{marker}-body", f"hdr.test:{bigup.port}",
                             body=b"b" * 100)
    finally:
        t.close()
    assert (r1.status, r1.egress_reason) == (431, "header_too_large"), (r1.status, r1.body)
    assert bigup.heads(marker) == []
    poll(lambda: len([x for x in e.audit_records() if marker in x.get("path", "")]) >= 2, 5,
         "audit")
    rec = [x for x in e.audit_records() if marker in x.get("path", "")]
    assert [(x["status"], x.get("reason")) for x in rec] == [(431, "header_too_large")] * 2, rec


class _BigHeadUpstream:
    """Mixin for H2Upstream: /bighead answers a head of 120 fields of 1000 bytes (120 KB)."""

    def _respond(self, conn, st):
        if st.pseudo.get(":path", "/").startswith("/bighead"):
            st.responded = True
            conn.send_headers(st.sid, [(":status", "200")] +
                              [(f"x-h{i}", "v" * 1000) for i in range(120)], end_stream=True)
            st.done = True
            return
        super()._respond(conn, st)


def test_h2_upstream_response_head_over_the_limit_is_502_bad_response(world, factory, marker):
    """An HTTP/2 upstream's response head over the limits (max_header_bytes and
    h2_max_header_list_bytes, h2_max_header_fields) is 502 upstream_bad_response, as an
    HTTP/1.1 upstream's (README, max_header_bytes); egressd resets that stream itself, which
    used to be reported as the upstream's reset (502 upstream_reset)."""
    from h2_upstream import H2Upstream

    class Up(_BigHeadUpstream, H2Upstream):
        pass
    up = Up(world.pki.server_cert, world.pki.server_key)
    try:
        e = factory.start(add_h2_pins(world, up))
        c = H2Client(e, world, "api.test", up.port, timeout=30)
        try:
            r = c.request(f"/bighead/{marker}", timeout=15)
            ok = c.request(f"/echo/{marker}-ok", timeout=15)  # the session goes on
        finally:
            c.close()
    finally:
        up.close()
    assert r["status"] == 502 and header(r, "x-egress-reason") == "upstream_bad_response", \
        (r["status"], header(r, "x-egress-reason"))
    assert ok["status"] == 200
    poll(lambda: [x for x in e.audit_records() if "/bighead/" + marker in x.get("path", "")], 5,
         "audit")
    rec = [x for x in e.audit_records() if "/bighead/" + marker in x.get("path", "")]
    assert [(x["status"], x.get("reason")) for x in rec] == [(502, "upstream_bad_response")], rec
