"""The protocol matrix {h1, h2} client x {h1, h2} upstream, named like nghttpx's TestH1H1...:
each case checks injection, host agreement, a large body, and trailers where the protocol has
them. Real clients: curl (--http1.1 / --http2) through HTTPS_PROXY, httpx with http2=True, and a
raw python3-h2 client for what the others cannot show (trailers, :authority mismatch)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time

import httpx
import pytest

import helpers
from clients import proxy_env, run_ca
from h2_helpers import H2Client, add_h2_pins, h2up, header  # noqa: F401 (fixture)
from h2_upstream import H2Upstream
from upstream import payload_sha256

MiB = 1 << 20


@pytest.fixture(scope="module")
def e2(factory, world, h2up):
    return factory.start(add_h2_pins(world, h2up))


def curl(world, e, url, http2: bool, *args, timeout=60):
    env = proxy_env(e, "r1", world.tokens["r1"])
    cmd = ["curl", "-sS", "--http2" if http2 else "--http1.1", "--max-time", str(timeout),
           "--cacert", run_ca(e, "r1"), *args, url]
    return subprocess.run(cmd, env=env, capture_output=True, timeout=timeout + 10)


def upstream_port(world, h2up, up: str) -> int:
    return h2up.port if up == "h2" else world.U


def upstream_of(world, h2up, up: str):
    return h2up if up == "h2" else world.upstream


MATRIX = ["h1h1", "h1h2", "h2h1", "h2h2"]


def split(case):
    return case[:2], case[2:]


@pytest.mark.parametrize("case", MATRIX)
def test_injection_curl(world, e2, h2up, marker, case):
    down, up = split(case)
    P = upstream_port(world, h2up, up)
    r = curl(world, e2, f"https://api.test:{P}/echo/{marker}?{marker}", down == "h2", "-f",
             "-H", "Authorization: Bearer client-supplied", "-w", "\n%{http_version}")
    assert r.returncode == 0, r.stderr
    body, _, version = r.stdout.decode().rpartition("\n")
    assert version == ("2" if down == "h2" else "1.1")
    echo = json.loads(body)
    assert world.secrets["api_token"] not in body
    [seen] = upstream_of(world, h2up, up).find(marker)
    auth = seen.header("Authorization")
    assert auth == [f"Bearer {world.secrets['api_token']}"], auth
    assert (echo.get("proto") == "h2") == (up == "h2")
    assert not seen.header("Proxy-Authorization")
    rec = helpers.poll(lambda: [x for x in e2.audit_records()
                                if marker in (x.get("path") or "")], 5, "audit record")[-1]
    assert rec["proto_in"] == ("h2" if down == "h2" else "http/1.1")
    assert rec["proto_out"] == ("h2" if up == "h2" else "http/1.1")
    assert rec["decision"] == "allow" and rec["status"] == 200


@pytest.mark.parametrize("down", ["h1", "h2"])
def test_injected_credential_is_never_indexed_upstream(world, e2, h2up, marker, down):
    """On the h2 upstream leg the injected field is sent never-indexed (RFC 7541 7.1.3), so it
    never enters the pooled connection's HPACK table, where the sandbox's own requests could
    probe it by length; nghttp2 does that by itself only for authorization. A field the client
    sent is indexable as usual (the check can fail)."""
    P = h2up.port
    r = curl(world, e2, f"https://hdr.test:{P}/echo/{marker}", down == "h2", "-f",
             "-H", "x-client-field: plain")
    assert r.returncode == 0, r.stderr
    echo = json.loads(r.stdout)
    assert world.secrets["hdr_key"] not in r.stdout.decode()
    assert echo["proto"] == "h2"
    [seen] = h2up.find(marker)
    assert seen.header("x-api-key") == [f"Key {world.secrets['hdr_key']}"]
    assert "x-api-key" in echo["never_indexed"], echo["never_indexed"]
    assert "x-client-field" not in echo["never_indexed"]


def test_injected_credential_is_wiped_when_the_request_is_done(factory, world, h2up):
    """Every copy egressd makes of an injected credential (the request head's field, the
    HTTP/1.1 head it writes, the HTTP/2 frames and nghttp2's copy of the fields, the scrubber's
    needles) is zeroed when the request is done, also when the exchange ends early (a pinned
    upstream that refuses connections): after requests on all four protocol paths the secrets
    occur in egressd's memory as often as before the first request (their locked buffers). The
    needle is each secret's random tail: a freed heap block keeps all but its first 16 bytes
    (malloc's free-list pointers), so "Bearer <secret>" itself would hide a copy left behind."""
    e = factory.start(add_h2_pins(world, h2up))
    pid = e.proc.pid
    tails = [world.secrets["api_token"][-32:].encode(), world.secrets["hdr_key"][-32:].encode()]
    before = [helpers.occurrences_in_memory(pid, t) for t in tails]
    assert before[0] >= 1  # the secret's own buffer: the scan finds what is there
    tag = "wipe-" + os.urandom(3).hex()
    for down, up in (split(case) for case in MATRIX):
        P = upstream_port(world, h2up, up)
        hosts = ["api.test"] + (["hdr.test"] if up == "h2" else [])
        for host in hosts:
            for i in range(5):
                r = curl(world, e, f"https://{host}:{P}/bytes/64?{tag}-{down}{up}-{host}-{i}",
                         down == "h2", "-f", "-o", "/dev/null")
                assert r.returncode == 0, r.stderr
    # Last, so that no later request's allocations overwrite what these leave behind.
    for http2 in (False, True):
        r = curl(world, e, f"https://down.test:{world.closed_port}/x?{tag}", http2,
                 "-o", "/dev/null", "-w", "%{http_code}")
        assert r.returncode == 0 and r.stdout == b"502", (r.stdout, r.stderr)
    sent = world.upstream.find(tag) + h2up.find(tag)
    assert len(sent) == 30
    bearer = f"Bearer {world.secrets['api_token']}"
    key = f"Key {world.secrets['hdr_key']}"
    assert sum(r.header("Authorization") == [bearer] for r in sent) == 20
    assert sum(r.header("x-api-key") == [key] for r in sent) == 10
    # The last exchanges finish just after their responses: a moment for them to end.
    deadline = time.monotonic() + 5
    while True:
        after = [helpers.occurrences_in_memory(pid, t) for t in tails]
        if after == before or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert after == before, f"secret tails in egressd's memory: {before} before, {after} after"


def test_an_echoed_credential_is_wiped_once_relayed(factory, world, h2up):
    """An upstream that echoes the injected credential (/echo reflects the request's fields)
    puts it in what egressd reads: the scrubber redacts the copy it relays, and the other copies
    of the response (the HTTP/1.1 connection's read buffer, past its consumed bytes; the HTTP/2
    session's read buffer; OpenSSL's record, decrypted where it lay) are wiped, on all four
    protocol paths, so the pooled connections keep nothing of it. Before, each exchange left
    copies that lived until later reads happened to overwrite them."""
    e = factory.start(add_h2_pins(world, h2up))
    pid = e.proc.pid
    secret = world.secrets["api_token"]
    tail = secret[-32:].encode()
    before = helpers.occurrences_in_memory(pid, tail)
    assert before >= 1  # the secret's own buffer: the scan finds what is there
    tag = "echo-wipe-" + os.urandom(3).hex()
    for down, up in (split(case) for case in MATRIX):
        P = upstream_port(world, h2up, up)
        for i in range(3):
            r = curl(world, e, f"https://api.test:{P}/echo/{tag}-{down}{up}-{i}", down == "h2",
                     "-f")
            assert r.returncode == 0, r.stderr
            assert tag.encode() in r.stdout and secret.encode() not in r.stdout
        if up == "h2":
            # The echo in a DATA frame of its own after the first: scrubbed in a copy (the
            # scrubber holds bytes from the piece before), so the piece as read is wiped.
            for i in range(3):
                r = curl(world, e, f"https://api.test:{P}/reflect-late/{tag}-{down}-late{i}",
                         down == "h2", "-f")
                assert r.returncode == 0, r.stderr
                assert r.stdout.startswith(b"f" * 2000) and b"seen=" in r.stdout
                assert secret.encode() not in r.stdout
            # The echo in a response field too (x-seen), which the upstream's HPACK encoder
            # indexes: it stays in the session's dynamic table, nghttp2's, unless emptied.
            for i in range(2):
                r = curl(world, e, f"https://api.test:{P}/reflect/{tag}-{down}-field{i}",
                         down == "h2", "-f", "-i")
                assert r.returncode == 0, r.stderr
                assert b"x-seen:" in r.stdout.lower() and secret.encode() not in r.stdout
    sent = world.upstream.find(tag) + h2up.find(tag)
    assert len(sent) == 22
    assert all(r.header("Authorization") == [f"Bearer {secret}"] for r in sent)
    deadline = time.monotonic() + 5
    while True:
        after = helpers.occurrences_in_memory(pid, tail)
        if after == before or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert after == before, f"secret tail in egressd's memory: {before} before, {after} after"


def test_hpack_table_resets_stay_one_at_a_time(factory, world):
    """After a response that echoes the credential the pooled HTTP/2 session empties its HPACK
    table with a pair of SETTINGS (size 0, then back). One pair at a time: an upstream that
    never acknowledges SETTINGS gets one pair for any number of echoing responses, instead of
    a pair per response piling up in nghttp2's queue of unacknowledged settings (before: 11
    SETTINGS frames after 5 echoes); one that acknowledges gets a pair for every echo."""
    counts = {}
    for acks in (False, True):
        up = H2Upstream(world.pki.server_cert, world.pki.server_key)
        try:
            up.ack_settings = acks
            # one event loop: one pool, so one session takes every request
            e = factory.start(add_h2_pins(world, up, {"worker_threads": 1}))
            tag = "hpack-reset-" + os.urandom(3).hex()
            for i in range(5):
                r = curl(world, e, f"https://api.test:{up.port}/reflect/{tag}-{i}", False,
                         "-f", "-i")
                assert r.returncode == 0, r.stderr
                assert b"x-seen:" in r.stdout.lower()
                assert world.secrets["api_token"].encode() not in r.stdout
            # One request more on the session, which echoes nothing: the SETTINGS submitted
            # after the last echo go out before its HEADERS, and are counted before it is seen.
            r = curl(world, e, f"https://api.test:{up.port}/bytes/64?{tag}-last", False,
                     "-f", "-o", "/dev/null")
            assert r.returncode == 0, r.stderr
            assert len(up.find(tag)) == 6
            assert up.connections == 1, (acks, up.settings_frames)
            time.sleep(0.3)
            counts[acks] = up.settings_frames[0]
            e.stop()
        finally:
            up.close()
    # the first SETTINGS, and one pair: none more however many echoes follow unacknowledged
    assert counts[False] == 3, counts
    assert counts[True] == 11, counts


@pytest.mark.parametrize("case", MATRIX)
def test_host_agreement(world, e2, h2up, marker, case):
    """A Host / :authority naming another host than the CONNECT target: 421, nothing sent."""
    down, up = split(case)
    P = upstream_port(world, h2up, up)
    r = curl(world, e2, f"https://api.test:{P}/echo/{marker}", down == "h2",
             "-H", f"Host: other.test:{P}", "-i")
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode(errors="replace")
    status_lines = [ln for ln in out.splitlines() if ln.startswith("HTTP/")]
    assert status_lines[-1].split()[1] == "421", out[:500]
    assert "host_mismatch" in out
    assert upstream_of(world, h2up, up).find(marker) == []


@pytest.mark.parametrize("case", MATRIX)
def test_large_download_and_upload(world, e2, h2up, marker, case, tmp_path):
    down, up = split(case)
    P = upstream_port(world, h2up, up)
    n = 20 * MiB
    out = tmp_path / "dl.bin"
    r = curl(world, e2, f"https://api.test:{P}/bytes/{n}?{marker}", down == "h2", "-f",
             "-o", str(out), timeout=120)
    assert r.returncode == 0, r.stderr
    h = hashlib.sha256(out.read_bytes()).hexdigest()
    assert out.stat().st_size == n and h == payload_sha256(n)
    out.unlink()
    # upload (Content-Length from a file)
    src = tmp_path / "up.bin"
    data = bytes(range(256)) * (8 * 4096)  # 8 MiB
    src.write_bytes(data)
    r = curl(world, e2, f"https://api.test:{P}/upload?{marker}-up", down == "h2", "-f",
             "--data-binary", f"@{src}", "-H", "Content-Type: application/octet-stream",
             timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    length = got.get("length", got.get("body_length"))
    digest = got.get("sha256", got.get("body_sha256"))
    assert length == len(data) and digest == hashlib.sha256(data).hexdigest()
    e2.check_peak_rss(64 * 1024)


@pytest.mark.parametrize("case", ["h2h1", "h2h2"])
def test_httpx_http2(world, e2, h2up, marker, case):
    _, up = split(case)
    P = upstream_port(world, h2up, up)
    proxy = e2.proxy_url("r1", world.tokens["r1"])
    with httpx.Client(http2=True, proxies=proxy, verify=run_ca(e2, "r1"), timeout=30) as c:
        rs = [c.get(f"https://api.test:{P}/echo/{marker}-{i}?{marker}") for i in range(5)]
    for r in rs:
        assert r.status_code == 200 and r.http_version == "HTTP/2"
        assert world.secrets["api_token"] not in r.text
    assert len(upstream_of(world, h2up, up).find(marker)) == 5
    for seen in upstream_of(world, h2up, up).find(marker):
        assert seen.header("Authorization") == [f"Bearer {world.secrets['api_token']}"]


def test_h2h2_trailers_both_ways(world, e2, h2up, marker):
    c = H2Client(e2, world, "api.test", h2up.port)
    try:
        r = c.request(f"/trailers/{marker}", "POST",
                      extra=[("te", "trailers"), ("content-type", "application/grpc")],
                      body=b"\x00\x00\x00\x00\x05hello",
                      trailers=[("x-req-trailer", "rt1")])
    finally:
        c.close()
    assert r["status"] == 200, r
    assert ("grpc-status", "0") in r["trailers"] and ("x-trailer", "t1") in r["trailers"]
    echo = json.loads(r["body"])
    assert ["x-req-trailer", "rt1"] in echo["trailers"]
    assert ["te", "trailers"] in echo["headers"]
    [seen] = h2up.find(marker)
    assert seen.header("authorization") == [f"Bearer {world.secrets['api_token']}"]


def test_h2h1_request_trailers_and_chunked_response(world, e2, h2up, marker):
    """h2 client -> h1 upstream: a body without content-length goes out chunked (trailers ride
    on the last chunk); the response arrives as an h2 stream."""
    c = H2Client(e2, world, "api.test", world.U)
    try:
        r = c.request(f"/upload?{marker}", "POST", body=b"x" * 100000,
                      trailers=[("x-req-trailer", "rt1")])
        r2 = c.request(f"/chunked/300000?{marker}-2")
    finally:
        c.close()
    assert r["status"] == 200, r
    assert json.loads(r["body"])["length"] == 100000
    assert r2["status"] == 200 and len(r2["body"]) == 300000
    [seen] = world.upstream.find(marker + "-2") or [None]
    assert seen is not None and seen.header("Authorization") == [
        f"Bearer {world.secrets['api_token']}"]


def test_h1h2_response_trailers_over_chunked(world, e2, h2up, marker):
    """h1 client -> h2 upstream: response trailers arrive on the chunked last-chunk."""
    conn = helpers.tunnel(e2.proxy_port, "api.test", h2up.port, world.auth(), run_ca(e2, "r1"))
    try:
        conn.send(f"GET /trailers/{marker} HTTP/1.1\r\nHost: api.test:{h2up.port}\r\n"
                  "TE: trailers\r\nConnection: close\r\n\r\n".encode())
        raw = conn.read_to_eof()
    finally:
        conn.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding: chunked" in head.lower()
    assert b"\r\n0\r\n" in body and b"grpc-status: 0\r\n" in body.lower()


@pytest.mark.parametrize("status", [200, 201])
def test_h1h2_empty_response_without_length_is_framed_for_the_h1_client(world, e2, h2up, marker,
                                                                        status):
    """An h2 response ended on HEADERS with no content-length reaches an HTTP/1.1 client with
    Content-Length: 0, and the keep-alive connection serves the next request."""
    conn = helpers.tunnel(e2.proxy_port, "api.test", h2up.port, world.auth(), run_ca(e2, "r1"))
    try:
        r = helpers.request(conn, "GET", f"/empty/{status}?{marker}", f"api.test:{h2up.port}")
        assert r.status == status and r.header("Content-Length") == "0", r.raw_head()
        assert r.body == b""
        r = helpers.request(conn, "GET", f"/echo/{marker}", f"api.test:{h2up.port}")
        assert r.status == 200
    finally:
        conn.close()


def test_h2_streams_multiplexed_slow_reader_does_not_stall_others(world, e2, h2up, marker):
    """One stream's 8 MiB response is never acknowledged (its stream window stays closed, the
    connection window is large); other streams on the same connection still complete, and
    egressd buffers only a bounded amount for the stalled one."""
    c = H2Client(e2, world, "api.test", h2up.port)
    try:
        c.conn.increment_flow_control_window(64 * MiB)  # connection level only
        c.flush()
        big = c.headers(f"/bytes/{8 * MiB}?{marker}-big")
        c.hold.add(big)
        c.flush()
        small = [c.request(f"/echo/{marker}-{i}?{marker}", timeout=10) for i in range(5)]
        held = c.responses[big].get("held", 0)
    finally:
        c.close()
    for s in small:
        assert s["status"] == 200, s
    assert held <= 65535, held  # the client's stream window was respected
    assert len(h2up.find(marker)) >= 6
    e2.check_peak_rss(64 * 1024)


def test_streams_an_h2_upstream_refuses_unprocessed_are_sent_again(world, factory, marker):
    """An h2 upstream that sends GOAWAY after every 10 requests (as nginx does after
    keepalive_requests) and then closes: the streams egressd had already sent above its
    last_stream_id were refused unprocessed (RFC 9113 8.7), and go out again on another
    session. 60 concurrent GETs from one client connection all answer 200 with the credential,
    each processed exactly once upstream; none is a 502. A stream refused with RST_STREAM
    REFUSED_STREAM is sent again too."""
    up = H2Upstream(world.pki.server_cert, world.pki.server_key)
    up.goaway_after = 10
    try:
        e = factory.start(add_h2_pins(world, up))
        P = up.port
        c = H2Client(e, world, "api.test", P)
        sids = [c.headers(f"/echo/{marker}-{i}") for i in range(60)]
        c.flush()
        c.pump(until=lambda: all(c.responses[s]["ended"] or c.responses[s]["reset"] is not None
                                 for s in sids), timeout=30)
        statuses = [c.responses[s]["status"] for s in sids]
        assert statuses == [200] * 60, (statuses, [(a.get("status"), a.get("reason"))
                                                   for a in e.audit_records()
                                                   if a.get("status") != 200][:5])
        for i in range(60):
            seen = [r for r in up.requests if r.path == f"/echo/{marker}-{i}"]
            assert len(seen) == 1, (i, len(seen))
            assert seen[0].header("authorization") == [f"Bearer {world.secrets['api_token']}"]
        assert up.refused > 0, "no stream was refused: the GOAWAY path was not exercised"
        assert up.connections >= 6, up.connections
        r = c.request(f"/echo/refuse-once/{marker}")
        assert r["status"] == 200, r
        assert len(up.find(f"/echo/refuse-once/{marker}")) == 1
        c.close()
        assert not [a for a in e.audit_records() if a.get("status") == 502], \
            [a for a in e.audit_records() if a.get("status") == 502][:3]
    finally:
        up.close()


def test_posts_an_h2_upstream_refuses_after_its_goaway_are_sent_again(world, factory, marker):
    """The GOAWAY above with 40 concurrent POSTs of 1 KiB from one HTTP/2 client (the
    full-duplex path): every stream above a GOAWAY's last stream goes out again with its kept
    body, and each request is processed once with its own body, intact."""
    up = H2Upstream(world.pki.server_cert, world.pki.server_key)
    up.goaway_after = 10
    c = None
    try:
        e = factory.start(add_h2_pins(world, up))
        c = H2Client(e, world, "api.test", up.port)
        bodies = {}
        for i in range(40):
            sid = c.headers(f"/echo/{marker}-n{i}-", "POST", end_stream=False)
            bodies[sid] = os.urandom(1024)
            c.conn.send_data(sid, bodies[sid], end_stream=True)
        c.flush()
        c.pump(until=lambda: all(c.responses[s]["ended"] or c.responses[s]["reset"] is not None
                                 for s in bodies), timeout=30)
        for n, (sid, body) in enumerate(bodies.items()):
            r = c.responses[sid]
            assert r["status"] == 200, (n, r["status"], r["body"][:200])
            assert r["ended"], (n, r)
            echo = json.loads(r["body"])
            assert echo["body_sha256"] == hashlib.sha256(body).hexdigest(), n
            assert len(up.find(f"/echo/{marker}-n{n}-")) == 1, n
        assert up.refused > 0, "no stream was refused: the GOAWAY path was not exercised"
    finally:
        if c is not None:
            c.close()
        up.close()


def post_through(e, world, url: str, body: bytes, http2: bool):
    """curl's POST of `body` through egressd: (status code, response body)."""
    r = subprocess.run(
        ["curl", "-sS", "--http2" if http2 else "--http1.1", "--cacert", run_ca(e, "r1"),
         "-o", "-", "-w", "\n%{http_code}", "--data-binary", "@-", url],
        input=body, env=proxy_env(e, "r1", world.tokens["r1"]), capture_output=True, timeout=60)
    out, _, code = r.stdout.rpartition(b"\n")
    return code, out


def assert_echoed_once(up, path: str, code: bytes, out: bytes, body: bytes):
    assert code == b"200", (code, out[:300])
    echo = json.loads(out)
    assert echo["body_length"] == len(body)
    assert echo["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert len(up.find(path)) == 1


@pytest.mark.parametrize("down", ["h1", "h2"])
@pytest.mark.parametrize("size", [2048, 70 * 1024])
def test_a_refused_stream_with_a_small_body_is_sent_again_with_it(world, factory, marker, size,
                                                                   down):
    """A POST to an h2 upstream that refuses the stream unprocessed (RST_STREAM REFUSED_STREAM
    after the whole request): a body of at most 64 KiB (limits.retry_body_bytes) was kept and
    goes out again with the request, processed once, intact; a larger one was not kept, and
    the client gets 502 upstream_refused_stream. From an HTTP/1.1 client (the body goes up
    before the answer is read) and from an HTTP/2 one (full duplex: the upload runs beside the
    wait for the answer, and is taken off the refused stream)."""
    up = H2Upstream(world.pki.server_cert, world.pki.server_key)
    try:
        e = factory.start(add_h2_pins(world, up))
        body = os.urandom(size)
        path = f"/echo/refuse-once/{marker}-{size}"
        code, out = post_through(e, world, f"https://api.test:{up.port}{path}", body,
                                 down == "h2")
        assert up.refused == 1, up.refused
        if size <= 64 * 1024:
            assert_echoed_once(up, path, code, out, body)
            rec = e.wait_audit(lambda a: a.get("path") == path)[-1]
            assert rec["status"] == 200 and rec["bytes_in"] == size, rec
        else:
            assert code == b"502", (code, out[:300])
            rec = e.wait_audit(lambda a: a.get("path") == path)[-1]
            assert rec["reason"] == "upstream_refused_stream", rec
    finally:
        up.close()


def test_retry_body_bytes_bounds_the_body_kept_for_a_refused_stream(world, factory, marker):
    """limits.retry_body_bytes: 1024. A 1 KiB body refused once is sent again; a 2 KiB one
    is not kept (502 upstream_refused_stream), from either client protocol."""
    up = H2Upstream(world.pki.server_cert, world.pki.server_key)
    try:
        e = factory.start(add_h2_pins(world, up, limits={"retry_body_bytes": 1024}))
        for down in ("h1", "h2"):
            small, large = os.urandom(1024), os.urandom(2048)
            path = f"/echo/refuse-once/{marker}-{down}-small"
            code, out = post_through(e, world, f"https://api.test:{up.port}{path}", small,
                                     down == "h2")
            assert_echoed_once(up, path, code, out, small)
            path = f"/echo/refuse-once/{marker}-{down}-large"
            code, out = post_through(e, world, f"https://api.test:{up.port}{path}", large,
                                     down == "h2")
            assert code == b"502", (down, code, out[:300])
            assert b"upstream_refused_stream" in out, out[:300]
        assert up.refused == 4, up.refused
    finally:
        up.close()


def test_a_stream_refused_while_its_body_comes_goes_on_another_with_the_rest(world, factory,
                                                                              marker):
    """An HTTP/2 client sends a request's head and the first half of its body, then waits:
    the upstream refuses the stream on its HEADERS while the upload waits for the client.
    The upload leaves the refused stream, the request goes out again on another with the half
    egressd kept, and the second half, sent by the client after the retry, follows it there:
    the upstream processes the request once, with the whole body, in order, and its
    credential."""
    up = H2Upstream(world.pki.server_cert, world.pki.server_key)
    c = None
    try:
        e = factory.start(add_h2_pins(world, up))
        c = H2Client(e, world, "api.test", up.port)
        path = f"/echo/refuse-early-once/{marker}"
        first, second = os.urandom(3000), os.urandom(5000)
        sid = c.headers(path, "POST", end_stream=False)
        c.conn.send_data(sid, first)
        c.flush()
        # The refusal and the retry happen while egressd waits for the rest of the body.
        helpers.poll(lambda: up.refused == 1 and up.connections >= 1, 10, "the refusal")
        c.pump(timeout=0.5)
        c.conn.send_data(sid, second, end_stream=True)
        c.flush()
        r = c.responses[sid]
        c.pump(until=lambda: r["ended"] or r["reset"] is not None, timeout=20)
        assert r["status"] == 200, r
        echo = json.loads(r["body"])
        assert echo["body_length"] == len(first) + len(second)
        assert echo["body_sha256"] == hashlib.sha256(first + second).hexdigest()
        [seen] = up.find(path)
        assert seen.header("authorization") == [f"Bearer {world.secrets['api_token']}"]
        assert up.refused == 1, up.refused
        rec = e.wait_audit(lambda a: a.get("path") == path)[-1]
        assert rec["status"] == 200 and rec["bytes_in"] == len(first) + len(second), rec
    finally:
        if c is not None:
            c.close()
        up.close()


def test_h1_to_h2_sends_one_canonical_content_length(world, e2, h2up, marker):
    """The content-length an h2 upstream gets is egressd's own, from the body's length, never
    the client's field(s): "3, 3", two fields and "003" (which a strict origin resets) each
    arrive as one "3"; a chunked body arrives with none."""
    P = h2up.port
    cases = {"single": "Content-Length: 3\r\n", "dup": "Content-Length: 3\r\nContent-Length: 3\r\n",
             "list": "Content-Length: 3, 3\r\n", "zeros": "Content-Length: 003\r\n"}
    for name, cl in cases.items():
        t = helpers.tunnel(e2.proxy_port, "api.test", P, world.auth(), run_ca(e2, "r1"))
        try:
            t.send(f"POST /echo/{marker}-{name} HTTP/1.1\r\nHost: api.test:{P}\r\n{cl}\r\nabc"
                   .encode())
            r = helpers.read_response(t)
        finally:
            t.close()
        if r.status == 400:  # refused as the head arrived: nothing went upstream
            assert h2up.heads(f"{marker}-{name}") == [], name
            continue
        assert r.status == 200, (name, r.status, r.egress_reason)
        [seen] = h2up.find(f"{marker}-{name}")
        assert seen.header("content-length") == ["3"], (name, seen.header("content-length"))
    t = helpers.tunnel(e2.proxy_port, "api.test", P, world.auth(), run_ca(e2, "r1"))
    try:
        t.send(f"POST /echo/{marker}-chunked HTTP/1.1\r\nHost: api.test:{P}\r\n"
               f"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n".encode())
        r = helpers.read_response(t)
    finally:
        t.close()
    assert r.status == 200, (r.status, r.egress_reason)
    [seen] = h2up.find(f"{marker}-chunked")
    assert seen.header("content-length") == []
    assert json.loads(r.body)["body_length"] == 3


def test_h2_to_h2_sends_the_content_length_as_egressd_spells_it(world, e2, h2up, marker):
    c = H2Client(e2, world, "api.test", h2up.port)
    try:
        r = c.request(f"/echo/{marker}", "POST", extra=[("content-length", "0003")], body=b"abc")
    finally:
        c.close()
    assert r["status"] == 200, r
    [seen] = h2up.find(marker)
    assert seen.header("content-length") == ["3"]
