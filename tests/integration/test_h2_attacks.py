"""HTTP/2 attacks with raw frames (python3-h2 / hyperframe) against the intercepted leg: rapid
reset (the client's RST_STREAMs, or resets it provokes: MadeYouReset), CONTINUATION flood, HPACK
bomb, too many streams, malformed requests, CR/LF meant for an HTTP/1.1 upstream. Each is
refused, nothing reaches the upstream (so nothing is injected; a provoked reset comes after its
head went up, and only a bounded number of them do), and a well-behaved httpx HTTP/2 client is
served the whole time."""
from __future__ import annotations

import threading
import time

import h2.events
import httpx
import pytest
from hyperframe.frame import ContinuationFrame, DataFrame, HeadersFrame, RstStreamFrame

from clients import run_ca
from h2_helpers import H2Client, RawH2, add_h2_pins, frames_until_closed, h2up  # noqa: F401
from helpers import SANITIZER, poll

ENHANCE_YOUR_CALM = 11


@pytest.fixture(scope="module")
def e2(factory, world, h2up):
    return factory.start(add_h2_pins(world, h2up))


@pytest.fixture
def good_client(world, e2, h2up):
    """A well-behaved HTTP/2 client running concurrently with the attack."""
    stop = threading.Event()
    stats = {"ok": 0, "errors": []}
    proxy = e2.proxy_url("r1", world.tokens["r1"])
    url = f"https://api.test:{h2up.port}/echo/good"

    def loop():
        with httpx.Client(http2=True, proxies=proxy, verify=run_ca(e2, "r1"), timeout=10) as c:
            while not stop.is_set():
                try:
                    r = c.get(url)
                    if r.status_code == 200 and r.http_version == "HTTP/2":
                        stats["ok"] += 1
                    else:
                        stats["errors"].append(r.status_code)
                except Exception as ex:  # noqa: BLE001
                    stats["errors"].append(repr(ex))
                time.sleep(0.01)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while stats["ok"] == 0 and not stats["errors"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stats["ok"] > 0 and not stats["errors"], stats  # served before the attack
    before = stats["ok"]
    yield stats
    # ... and after it: two more answers (bounded: the attack may have just ended).
    deadline = time.monotonic() + 10
    while stats["ok"] < before + 2 and not stats["errors"] and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    t.join(timeout=15)
    assert stats["ok"] >= before + 2, stats
    assert not stats["errors"], stats


def assert_nothing_reached(world, h2up, marker):
    assert h2up.find(marker) == [], [r.path for r in h2up.find(marker)]
    assert world.upstream.find(marker) == []


def test_rapid_reset_goaway(world, e2, h2up, marker, good_client):
    c = H2Client(e2, world, "api.test", h2up.port)
    c.pump(timeout=0.3)  # settings exchange
    burst = b""
    for i in range(1000):
        sid = c.headers(f"/echo/{marker}-{i}", end_stream=True)
        c.conn.reset_stream(sid)
        burst += c.conn.data_to_send()
        if len(burst) > 8192:
            try:
                c.send_raw(burst)
            except OSError:
                break
            burst = b""
    try:
        c.send_raw(burst)
    except OSError:
        pass
    c.pump(until=lambda: c.goaway is not None, timeout=5)
    c.close()
    print("rapid reset: goaway", c.goaway, "closed", c.closed)
    assert c.goaway == ENHANCE_YOUR_CALM or c.closed, c.goaway
    time.sleep(0.3)
    assert_nothing_reached(world, h2up, marker)
    assert e2.alive()


class UpstreamHeads:
    """Counts the request heads holding `marker` that the h2 test upstream receives, complete
    or not (its `requests` has only the complete ones), while the `with` block runs."""

    def __init__(self, h2up, marker):
        self.h2up, self.marker, self.sids = h2up, marker, []

    def __enter__(self):
        event = self.h2up._event

        def counting(conn, streams, ev, sni):
            if isinstance(ev, h2.events.RequestReceived) and \
                    self.marker in dict(ev.headers).get(":path", ""):
                self.sids.append(ev.stream_id)
            return event(conn, streams, ev, sni)

        self.h2up._event = counting  # the instance attribute shadows the method until __exit__
        return self

    def __exit__(self, *exc):
        del self.h2up._event

    def __len__(self):
        return len(self.sids)


def overflow_streams(raw, authority, path, n):
    """`n` streams of a POST that declares content-length: 1 and sends no body yet."""
    return [raw.send_headers([(":method", "POST"), (":scheme", "https"),
                              (":authority", authority), (":path", f"{path}-{i}"),
                              ("content-length", "1")], end_stream=False)
            for i in range(n)]


def overflow(raw, sids):
    """DATA("xx", END_STREAM) on each: a byte beyond content-length, nghttp2 resets the stream
    (PROTOCOL_ERROR) without the client sending RST_STREAM."""
    raw.send(b"".join(DataFrame(s, data=b"xx", flags=["END_STREAM"]).serialize() for s in sids))


def wait_heads(raw, heads, n, timeout=2.0):
    deadline = time.monotonic() + timeout
    while len(heads) < n and time.monotonic() < deadline and raw.goaway is None and \
            not raw.closed:
        raw.pump(timeout=0.02)


def test_made_you_reset_goaway(world, e2, h2up, marker, good_client):
    """MadeYouReset (CVE-2025-8671): the client never sends RST_STREAM but makes nghttp2 reset
    its streams, each after its handler sent the request head upstream: HEADERS(POST,
    content-length: 1) without END_STREAM, and once the head is upstream DATA("xx",
    END_STREAM), one byte beyond the declared length (PROTOCOL_ERROR). These count as premature
    resets like the client's own: GOAWAY ENHANCE_YOUR_CALM after about
    h2_max_premature_resets (100) of them, not a request and a cancel upstream per stream."""
    total, batch = 300, 50
    authority = f"api.test:{h2up.port}"
    sent = 0
    t0 = time.monotonic()
    with UpstreamHeads(h2up, marker) as heads:
        c = H2Client(e2, world, "api.test", h2up.port)
        raw = RawH2(c)
        try:
            while sent < total and raw.goaway is None and not raw.closed and \
                    time.monotonic() - t0 < 20:
                sids = overflow_streams(raw, authority, f"/upload/{marker}-{sent}", batch)
                # The heads go upstream (a stream reset in the read that opened it never
                # starts): what the overflow then cancels has cost the upstream a request.
                wait_heads(raw, heads, sent + batch)
                overflow(raw, sids)
                sent += batch
                raw.pump(until=lambda: raw.goaway is not None, timeout=0.2)
            raw.pump(until=lambda: raw.goaway is not None, timeout=3)
        except OSError:  # egressd closed the connection mid-burst
            pass
        finally:
            c.close()
            time.sleep(0.3)
    resets = sum(1 for s in raw.streams.values() if s["reset"] is not None)
    print(f"made-you-reset: streams={sent} reset={resets} goaway={raw.goaway} "
          f"closed={raw.closed} upstream_heads={len(heads)} "
          f"secs={time.monotonic() - t0:.1f}")
    assert raw.goaway == ENHANCE_YOUR_CALM, (raw.goaway, raw.closed, sent, len(heads))
    assert len(heads) < 150, (len(heads), sent)
    # None of them completed upstream: each was cut one byte past its length.
    assert h2up.find(marker) == []
    assert e2.alive()


def test_made_you_reset_among_good_streams(factory, world, h2up, marker):
    """Resets the client provokes, hidden among twice as many good streams (so never half of
    them: the premature-reset check alone would not stop them), are taken from a token bucket
    of h2_stream_reset_burst / h2_stream_reset_rate, like the client's own RST_STREAMs: here
    20, then 1 per second, then GOAWAY ENHANCE_YOUR_CALM."""
    e = factory.start(add_h2_pins(world, h2up, limits={
        "h2_stream_reset_burst": 20, "h2_stream_reset_rate": 1,
        "h2_max_premature_resets": 10}))
    authority = f"api.test:{h2up.port}"
    rounds = 0
    t0 = time.monotonic()
    with UpstreamHeads(h2up, marker + "-bad") as heads:
        c = H2Client(e, world, "api.test", h2up.port)
        raw = RawH2(c)
        try:
            while rounds < 60 and raw.goaway is None and not raw.closed and \
                    time.monotonic() - t0 < 30:
                good = [raw.send_headers([(":method", "GET"), (":scheme", "https"),
                                          (":authority", authority),
                                          (":path", f"/echo/{marker}-good-{rounds}-{i}")])
                        for i in range(2)]
                bad = overflow_streams(raw, authority, f"/upload/{marker}-bad-{rounds}", 1)
                wait_heads(raw, heads, rounds + 1)
                overflow(raw, bad)
                rounds += 1
                raw.pump(until=lambda: raw.goaway is not None or
                         all(raw.streams[s]["ended"] for s in good), timeout=1)
            raw.pump(until=lambda: raw.goaway is not None, timeout=3)
        except OSError:
            pass
        finally:
            c.close()
            time.sleep(0.3)
    good_done = len([r for r in h2up.find(marker) if "-good-" in r.path])
    print(f"made-you-reset among good: rounds={rounds} goaway={raw.goaway} "
          f"closed={raw.closed} bad_heads={len(heads)} good_completed={good_done} "
          f"secs={time.monotonic() - t0:.1f}")
    assert raw.goaway == ENHANCE_YOUR_CALM, (raw.goaway, raw.closed, rounds, len(heads))
    # The burst (20), what refilled while the test ran (1 per second), and the one refused.
    assert len(heads) <= 20 + int(time.monotonic() - t0) + 2, (len(heads), rounds)
    assert good_done >= 2 * 10  # the good streams were served meanwhile
    assert e.alive()


def test_continuation_flood(world, e2, h2up, marker, good_client):
    c = H2Client(e2, world, "api.test", h2up.port)
    c.pump(timeout=0.3)
    enc = c.conn.encoder
    block = enc.encode([(":method", "GET"), (":scheme", "https"),
                        (":authority", f"api.test:{h2up.port}"), (":path", f"/echo/{marker}")])
    sid = 1 if not c.responses else max(c.responses) + 2
    frames = HeadersFrame(sid, data=block, flags=["END_STREAM"]).serialize()
    for i in range(50):
        frames += ContinuationFrame(sid, data=enc.encode([(f"x-c{i}", "v")])).serialize()
    c.send_raw(frames)
    c.pump(until=lambda: c.goaway is not None, timeout=5)
    c.close()
    assert c.goaway is not None or c.closed
    assert_nothing_reached(world, h2up, marker)


def test_hpack_bomb_resets_stream_only(world, e2, h2up, marker, good_client):
    c = H2Client(e2, world, "api.test", h2up.port)
    try:
        bomb = [("x-bomb", "a" * 4000)] * 300  # 1.2 MB decoded from ~4.3 KB on the wire
        r = c.request(f"/echo/{marker}", extra=bomb, timeout=5)
        assert r["reset"] is not None or (r["status"] or 0) >= 400, r
        # The connection survives a stream error.
        ok = c.request(f"/echo/{marker}-after-ok")
        assert ok["status"] == 200, ok
    finally:
        c.close()
    assert h2up.find(marker + "-after-ok") != []
    assert [x for x in h2up.find(marker) if "after-ok" not in x.path] == []


def test_too_many_streams_refused(world, e2, h2up, marker, good_client):
    c = H2Client(e2, world, "api.test", h2up.port)
    raw = RawH2(c)
    A = f"api.test:{h2up.port}"
    limit = e2.config["limits"].get("h2_max_concurrent_streams", 100)
    try:
        sids = []
        for i in range(130):
            if i == limit:
                # The streams within the limit reach the upstream (their heads: these uploads
                # never end, so it never answers them), so that the ones past it are seen
                # not to: the check below would hold vacuously if none went up at all.
                poll(lambda: len(set(h2up.heads(marker))) == limit, 10,
                     "the streams up to the limit upstream")
            try:
                sids.append(raw.send_headers([(":method", "POST"), (":scheme", "https"),
                                              (":authority", A),
                                              (":path", f"/upload/{marker}-{i}")],
                                             end_stream=False))
            except OSError:  # the connection was torn down mid-burst
                sids.append(raw.next_sid - 2)
                break
        raw.pump(until=lambda: raw.goaway is not None or
                 sum(1 for s in sids if raw.streams[s]["reset"] == 7) >= 30, timeout=5)
        # nghttp2 answers streams over the acknowledged limit with GOAWAY(PROTOCOL_ERROR)
        # (over a not yet acknowledged limit: RST_STREAM(REFUSED_STREAM) per stream).
        # Either way the streams past the limit are refused: the connection with
        # PROTOCOL_ERROR, or at least 30 of them each with REFUSED_STREAM.
        refused = [s for s in sids if raw.streams[s]["reset"] == 7]
        assert raw.goaway == 1 or len(refused) >= 30, (
            raw.goaway, raw.closed, len(refused), [raw.streams[s] for s in sids][-5:])
    finally:
        c.close()
    time.sleep(0.3)
    # Whichever way the streams were refused, none past the limit of concurrent streams
    # reached the upstream, nor any stream refused with REFUSED_STREAM.
    heads = h2up.heads(marker)
    beyond = [p for p in heads if int(p.rsplit("-", 1)[1]) >= limit]
    assert beyond == [] and len(set(heads)) == limit, (len(set(heads)), beyond[:5])
    for s in refused:
        assert f"/upload/{marker}-{sids.index(s)}" not in heads


@pytest.mark.parametrize("name,extra,pseudo", [
    ("missing_path", [], [(":method", "GET"), (":scheme", "https"), (":authority", None)]),
    ("unknown_pseudo", [(":foo", "bar")], None),
    ("uppercase_name", [("X-Upper", "1")], None),
    ("connection_header", [("connection", "keep-alive")], None),
    ("transfer_encoding", [("transfer-encoding", "chunked")], None),
    ("te_gzip", [("te", "gzip")], None),
    ("upgrade", [("upgrade", "websocket")], None),
    ("nul_in_value", [("x-a", "a\x00b")], None),
])
def test_malformed_request_is_stream_error(world, e2, h2up, marker, good_client, name, extra,
                                           pseudo):
    c = H2Client(e2, world, "api.test", h2up.port)
    raw = RawH2(c)
    try:
        authority = f"api.test:{h2up.port}"
        if pseudo is not None:
            hdrs = [(k, v if v is not None else authority) for k, v in pseudo]
        else:
            hdrs = [(":method", "GET"), (":scheme", "https"), (":authority", authority),
                    (":path", f"/echo/{marker}")] + extra
        sid = raw.send_headers(hdrs)
        raw.pump(until=lambda: raw.refused(sid) or raw.streams[sid]["ended"], timeout=5)
        assert raw.refused(sid), raw.streams[sid]
    finally:
        c.close()
    assert_nothing_reached(world, h2up, marker)


def test_content_length_mismatch_is_stream_error(world, e2, h2up, marker, good_client):
    c = H2Client(e2, world, "api.test", h2up.port)
    try:
        r = c.request(f"/upload/{marker}", "POST", extra=[("content-length", "100")],
                      body=b"x" * 10, timeout=5)
        assert r["reset"] is not None or (r["status"] or 0) >= 400, r
    finally:
        c.close()
    time.sleep(0.3)
    assert_nothing_reached(world, h2up, marker)


@pytest.mark.parametrize("value", ["a\r\nX-Injected: 1", "a\nX-Injected: 1", "a\rb"])
def test_crlf_in_value_for_h1_upstream_refused(world, e2, h2up, marker, good_client, value):
    """A header value that would split into two HTTP/1.1 header lines never leaves."""
    c = H2Client(e2, world, "api.test", world.U)
    raw = RawH2(c)
    try:
        sid = raw.send_headers([(":method", "GET"), (":scheme", "https"),
                                (":authority", f"api.test:{world.U}"),
                                (":path", f"/echo/{marker}"), ("x-evil", value)])
        raw.pump(until=lambda: raw.refused(sid) or raw.streams[sid]["ended"], timeout=5)
        assert raw.refused(sid), raw.streams[sid]
    finally:
        c.close()
    assert world.upstream.find(marker) == []
    assert not any(k.lower() == "x-injected" for r in world.upstream.requests for k, _ in r.headers)


def test_host_header_disagreeing_with_authority_refused(world, e2, h2up, marker, good_client):
    c = H2Client(e2, world, "api.test", h2up.port)
    try:
        r = c.request(f"/echo/{marker}", extra=[("host", f"other.test:{h2up.port}")])
        assert r["status"] == 400, r
        assert ("x-egress-reason", "host_authority_mismatch") in r["headers"]
        # 421 on that stream only: the next stream on the connection names another host.
        r2 = c.request(f"/echo/{marker}-2", authority=f"other.test:{h2up.port}")
        assert r2["status"] == 421, r2
        ok = c.request(f"/echo/{marker}-ok")
        assert ok["status"] == 200
    finally:
        c.close()
    assert h2up.find(marker + "-ok") != []
    assert [x for x in h2up.find(marker) if "-ok" not in x.path] == []


def test_ping_and_settings_flood_goaway(world, e2, h2up, marker, good_client):
    c = H2Client(e2, world, "api.test", h2up.port)
    c.pump(timeout=0.3)
    try:
        for i in range(3000):
            c.conn.ping(i.to_bytes(8, "big"))
            c.conn.update_settings({4: 65535 + (i % 2)})
        c.send_raw(c.conn.data_to_send())
    except OSError:
        pass
    c.pump(until=lambda: c.goaway is not None, timeout=5)
    c.close()
    assert c.goaway is not None or c.closed
    assert e2.alive()


@pytest.mark.parametrize("kind", ["empty", "padded", "unknown_type"])
def test_empty_frame_flood_goaway(world, e2, h2up, marker, good_client, kind):
    """Frames that carry nothing egressd uses still cost it a read each: empty DATA frames,
    padded ones too (padding alone used to pass uncounted), and frames of a type it does not
    know (nghttp2 skipped them silently) count as control frames (h2_control_frame_burst), so
    20 000 of them get GOAWAY ENHANCE_YOUR_CALM (they were taken and the request answered)."""
    c = H2Client(e2, world, "api.test", h2up.port)
    raw = RawH2(c)
    try:
        sid = raw.send_headers([(":method", "POST"), (":scheme", "https"),
                                (":authority", f"api.test:{h2up.port}"),
                                (":path", f"/echo/{marker}"), ("content-type", "x/y")],
                               end_stream=False)
        if kind == "padded":
            one = DataFrame(sid, data=b"", flags=["PADDED"], pad_length=0).serialize()
        elif kind == "empty":
            one = DataFrame(sid, data=b"").serialize()
        else:  # length 0, type 0xfa, no flags, on the stream
            one = bytes([0, 0, 0, 0xFA, 0]) + sid.to_bytes(4, "big")
        try:
            for _ in range(20):
                raw.send(one * 1000)
            raw.send(DataFrame(sid, data=b"x", flags=["END_STREAM"]).serialize())
        except OSError:
            pass  # torn down mid-flood
        raw.pump(until=lambda: raw.goaway is not None, timeout=10)
        assert raw.goaway == ENHANCE_YOUR_CALM or raw.closed, (raw.goaway, raw.streams[sid])
    finally:
        c.close()
    assert e2.alive()


def test_a_request_reset_in_the_read_that_brought_it_is_audited(world, e2, h2up, marker):
    """HEADERS and RST_STREAM(CANCEL) in one write, as a rapid-reset client sends them: the
    stream closes before a handler starts, and each such request still gets its one audit
    record (client_aborted); nothing reaches the upstream."""
    c = H2Client(e2, world, "api.test", h2up.port)
    raw = RawH2(c)
    try:
        burst = b""
        for i in range(5):
            sid, frame = raw.get_frame(f"/echo/{marker}-rr{i}")
            burst += frame + RstStreamFrame(sid, error_code=8).serialize()  # CANCEL
        raw.send(burst)
        raw.pump(timeout=0.5)
    finally:
        c.close()
    def reset_records():
        recs = [r for r in e2.audit_records() if f"{marker}-rr" in (r.get("path") or "")]
        return recs if len(recs) >= 5 else None
    recs = poll(reset_records, 5, "five audit records")
    assert sorted(r["path"] for r in recs) == [f"/echo/{marker}-rr{i}" for i in range(5)]
    assert all(r["reason"] == "client_aborted" and r["status"] == 0 for r in recs), recs
    assert not h2up.find(f"{marker}-rr")


def test_one_byte_data_frames_cost_about_what_their_bytes_do(factory, world):
    """A client may cut an upload into DATA frames of one byte each. Queued while the upstream
    does not take them yet (slow.test: its TLS handshake never comes), each had cost a queue
    slot and more: 4 streams × 200 000 bytes, within the windows, grew egressd's peak RSS by
    34 MiB. Small pieces now join the last queued one: ~2 MiB. A PING sent behind them is
    answered once egressd has read them all."""
    from hyperframe.frame import PingFrame
    e = factory.start()
    hwm0 = e.vm_hwm_kib()
    c = H2Client(e, world, "slow.test", world.silent.port, timeout=30)
    raw = RawH2(c)
    try:
        for _ in range(4):
            sid = raw.send_headers([(":method", "POST"), (":scheme", "https"),
                                    (":authority", f"slow.test:{world.silent.port}"),
                                    (":path", "/upload/one-byte-frames")], end_stream=False)
            raw.send((b"\x00\x00\x01\x00\x00" + sid.to_bytes(4, "big") + b"x") * 200_000)
        raw.send(PingFrame(0, opaque_data=b"allread!").serialize())
        raw.pump(until=lambda: b"allread!" in raw.ping_acks, timeout=20)
        assert b"allread!" in raw.ping_acks, "egressd did not read the frames"
        grown = e.vm_hwm_kib() - hwm0
    finally:
        c.close()
    if not SANITIZER:  # a sanitizer's quarantine and shadow say nothing of egressd's
        assert grown < 8 * 1024, f"peak RSS grew {grown} KiB for 800 000 bytes of DATA"
    assert e.alive()


def test_duplex_upload_timing_out_while_a_response_piece_waits(factory, world, h2up, marker):
    """HTTP/2 on both legs, the upstream answering while the upload still comes: the client
    opens no window for the response (a 10-byte trickle keeps the response part waiting with
    a piece in hand) and sends no body, so the upload ends on idle_timeout and aborts the
    upstream stream. The piece in hand must outlive that abort: the stream ends, and egressd
    serves on (it crashed with a use after free: the abort freed the piece)."""
    e = factory.start(add_h2_pins(world, h2up, limits={"idle_timeout": "2s"}))
    c = H2Client(e, world, "api.test", h2up.port, timeout=30, settings={4: 0})
    try:
        sid = c.headers(f"/early-bytes/{64 << 20}?m={marker}", "POST", end_stream=False)
        c.hold.add(sid)
        c.flush()
        r = c.responses[sid]
        c.pump(until=lambda: r["status"] is not None, timeout=10)
        assert r["status"] == 200
        deadline = time.monotonic() + 6.5  # the upload idles out after ~2-4 s of this
        while time.monotonic() < deadline and r["reset"] is None and not c.closed:
            c.conn.increment_flow_control_window(10, stream_id=sid)
            c.conn.increment_flow_control_window(10)
            c.flush()
            c.pump(timeout=0.4)
        c.conn.increment_flow_control_window(16 << 20, stream_id=sid)
        c.conn.increment_flow_control_window(16 << 20)
        c.flush()
        c.pump(until=lambda: r["ended"] or r["reset"] is not None, timeout=15)
        assert r["reset"] is not None, "the aborted exchange must end its stream with a reset"
    finally:
        c.close()
    assert e.alive(), "egressd died"
    c2 = H2Client(e, world, "api.test", h2up.port)
    try:
        assert c2.request(f"/echo/{marker}-after")["status"] == 200
    finally:
        c2.close()
    rec = e.wait_audit(lambda a: a.get("path") == f"/early-bytes/{64 << 20}")  # no query
    assert (rec[0]["status"], rec[0]["reason"]) == (200, "idle_timeout"), rec[0]


# --- what a review of the HTTP/2 server found (2026-12-07) -----------------------------------

def test_refused_streams_before_the_settings_ack_are_charged(world, e2, h2up, marker):
    """A client that never acknowledges egressd's SETTINGS and opens streams past the limit:
    nghttp2 answers each with RST_STREAM(REFUSED_STREAM) without making a stream, so no stream
    close charged it and the replies queued without bound (300 000 HEADERS: +57 MB). Each is
    charged to the reset bucket now: past its burst, GOAWAY(ENHANCE_YOUR_CALM)."""
    import hpack
    c = H2Client(e2, world, "api.test", h2up.port)  # no pump: SETTINGS never acknowledged
    enc = hpack.Encoder()
    A = f"api.test:{h2up.port}"
    try:
        sid = 1
        try:
            for chunk in range(10):
                burst = b""
                for _ in range(100):
                    burst += HeadersFrame(sid, data=enc.encode([
                        (":method", "POST"), (":scheme", "https"), (":authority", A),
                        (":path", f"/upload/{marker}-{sid}")]), flags=["END_HEADERS"]).serialize()
                    sid += 2
                c.send_raw(burst)
        except OSError:
            pass  # torn down mid-burst: the GOAWAY came first
        # Within 5 s: before the settings timeout (10 s), which ends the connection anyway.
        took, goaway = frames_until_closed(c.sock, timeout=5)
        assert goaway == ENHANCE_YOUR_CALM, (
            f"1000 streams past the limit before the SETTINGS ACK: GOAWAY {goaway}, {took=}")
    finally:
        c.close()
    assert e2.alive()


def test_complete_requests_in_a_read_that_floods_are_audited(world, e2, h2up, marker):
    """Twenty complete GETs, then a PING flood, in one write: the read ended in GOAWAY before
    the requests started, and they had no audit record at all. Each gets its one record now
    (client_aborted, no status); none reaches the upstream."""
    from hyperframe.frame import PingFrame
    c = H2Client(e2, world, "api.test", h2up.port)
    raw = RawH2(c)
    try:
        burst = b""
        for i in range(20):
            burst += raw.get_frame(f"/echo/{marker}-fl{i}")[1]
        # and one refused for its head (too many fields): its RST_STREAM is queued when the
        # flood's GOAWAY comes, and dropped with it; its record must not be
        burst += raw.get_frame(f"/echo/{marker}-flbig",
                               [(f"x-f{j}", "v") for j in range(300)])[1]
        burst += b"".join(PingFrame(0, opaque_data=i.to_bytes(8, "big")).serialize()
                          for i in range(400))
        try:
            raw.send(burst)
        except OSError:
            pass
        raw.pump(until=lambda: raw.goaway is not None, timeout=5)
    finally:
        c.close()

    def records():
        recs = [r for r in e2.audit_records() if f"{marker}-fl" in (r.get("path") or "")]
        return recs if len(recs) >= 21 else None
    recs = poll(records, 5, "twenty-one audit records")
    assert len(recs) == 21, recs
    big_recs = [r for r in recs if r["path"].endswith("-flbig")]
    assert [(r["status"], r["reason"]) for r in big_recs] == [(431, "header_too_large")], recs
    recs = [r for r in recs if not r["path"].endswith("-flbig")]
    assert all(r["reason"] == "client_aborted" and r["status"] == 0 for r in recs), recs
    assert not h2up.find(f"{marker}-fl")
