"""Large bodies stream through the injecting path with bounded memory: a 50 MiB download and a
20 MiB upload (curl and requests, Content-Length and chunked), parallel transfers, backpressure
from a stalled reader; egressd's peak RSS (VmHWM) stays under 64 MiB. Bodies are framed exactly
(pipelined requests with bodies) and a truncated response is never completed."""
from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time

import pytest

import helpers
from clients import curl_via, requests_session, run_ca
from upstream import iter_payload, payload_sha256

MiB = 1 << 20
RSS_LIMIT_KIB = 64 * 1024


def sha_file(path) -> tuple[int, str]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        for _ in range(1 << 20):
            b = f.read(1 << 20)
            if not b:
                break
            h.update(b)
            n += len(b)
    return n, h.hexdigest()


def check_rss(e):
    return e.check_peak_rss(RSS_LIMIT_KIB)


def test_download_50mib_curl(world, egressd, marker, tmp_path):
    n = 50 * MiB
    out = tmp_path / "dl.bin"
    r = curl_via(world, egressd, f"https://api.test:{world.U}/bytes/{n}?{marker}", "-f",
                 "-o", str(out), timeout=120)
    assert r.returncode == 0, r.stderr
    assert sha_file(out) == (n, payload_sha256(n))
    [up] = world.upstream.find(marker)
    assert up.header("Authorization") == [f"Bearer {world.secrets['api_token']}"]
    out.unlink()
    check_rss(egressd)


def test_download_50mib_chunked_requests(world, egressd, marker):
    n = 50 * MiB
    h = hashlib.sha256()
    got = 0
    with requests_session(world, egressd) as s:
        with s.get(f"https://basic.test:{world.U}/chunked/{n}?{marker}", stream=True,
                   timeout=60) as r:
            assert r.status_code == 200
            for chunk in r.iter_content(256 * 1024):
                h.update(chunk)
                got += len(chunk)
    assert (got, h.hexdigest()) == (n, payload_sha256(n))
    [up] = world.upstream.find(marker)
    assert up.header("Authorization") == [helpers.basic_auth("itest-user",
                                                             world.secrets["basic_pw"])]
    check_rss(egressd)


@pytest.fixture
def upload_file(tmp_path):
    n = 20 * MiB
    src = tmp_path / "up.bin"
    with open(src, "wb") as f:
        for piece in iter_payload(n):
            f.write(piece)
    yield src, n
    src.unlink()


def test_upload_20mib_chunked_curl(world, egressd, marker, upload_file):
    """curl -T - uploads standard input with chunked transfer coding."""
    src, n = upload_file
    ca = run_ca(egressd, "r1")
    from clients import proxy_env
    env = proxy_env(egressd, "r1", world.tokens["r1"])
    with open(src, "rb") as stdin:
        r = subprocess.run(["curl", "-sS", "--http1.1", "-f", "--max-time", "120", "--cacert", ca,
                            "-T", "-", "-H", "Expect:",
                            f"https://hdr.test:{world.U}/upload/{marker}"],
                           stdin=stdin, env=env, capture_output=True, timeout=130)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert (j["length"], j["sha256"]) == (n, payload_sha256(n))
    [up] = world.upstream.find(marker)
    assert up.header("X-Api-Key") == ["Key " + world.secrets["hdr_key"]]
    check_rss(egressd)


def test_upload_20mib_requests(world, egressd, marker, upload_file):
    """requests streams a file object with Content-Length."""
    src, n = upload_file
    with requests_session(world, egressd) as s, open(src, "rb") as f:
        r = s.post(f"https://api.test:{world.U}/upload/{marker}", data=f, timeout=120)
    assert r.status_code == 200, r.text
    assert (r.json()["length"], r.json()["sha256"]) == (n, payload_sha256(n))
    [up] = world.upstream.find(marker)
    assert up.header("Content-Length") == [str(n)]
    assert up.header("Authorization") == [f"Bearer {world.secrets['api_token']}"]
    check_rss(egressd)


def test_parallel_transfers(world, egressd, marker):
    n = 16 * MiB
    want = payload_sha256(n)
    results: dict[int, object] = {}

    def worker(i):
        try:
            h = hashlib.sha256()
            got = 0
            with requests_session(world, egressd) as s:
                with s.get(f"https://api.test:{world.U}/bytes/{n}?{marker}-{i}", stream=True,
                           timeout=60) as r:
                    for chunk in r.iter_content(128 * 1024):
                        h.update(chunk)
                        got += len(chunk)
            results[i] = (r.status_code, got, h.hexdigest())
        except Exception as ex:  # reported below
            results[i] = ex

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(not t.is_alive() for t in threads), "a transfer hung"
    for i in range(4):
        assert results[i] == (200, n, want), (i, results[i])
    check_rss(egressd)


def test_backpressure_stalled_reader(world, egressd, marker):
    """A client that stops reading stops the upstream writer; egressd does not buffer it all."""
    n = 64 * MiB
    ident = marker
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    c.send(f"GET /bytes/{n}?id={ident} HTTP/1.1\r\nHost: api.test:{world.U}\r\n\r\n".encode())
    head = c.read_until(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    first = c.read_exact(1 * MiB)

    # Wait (bounded) until the upstream writer has stopped making progress.
    deadline = time.monotonic() + 20
    last, stable_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        cur = world.upstream.progress(ident)
        if cur != last:
            last, stable_since = cur, time.monotonic()
        elif time.monotonic() - stable_since > 0.5:
            break
        time.sleep(0.05)
    stalled_at = world.upstream.progress(ident)
    assert stalled_at < n, "the upstream wrote everything: egressd read without backpressure"
    assert stalled_at - len(first) < 40 * MiB, \
        f"{(stalled_at - len(first)) / MiB:.1f} MiB in flight for a stalled reader"
    check_rss(egressd)

    h = hashlib.sha256(first)
    left = n - len(first)
    while left:
        b = c.read_exact(min(left, MiB))
        h.update(b)
        left -= len(b)
    c.close()
    assert h.hexdigest() == payload_sha256(n)


@pytest.mark.skipif(bool(helpers.SANITIZER), reason="egressd built with a sanitizer")
def test_peak_rss_after_all_transfers(egressd):
    hwm = check_rss(egressd)
    print(f"egressd VmHWM {hwm} KiB")


def test_pipelined_bodies_are_framed_exactly(world, egressd, marker):
    """Bodies are relayed in pieces and never read past their end: requests with bodies sent
    back to back in one write each get exactly their own body, and a 1 MiB response followed on
    the same connections by a small one arrives intact."""
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth("r1"),
                       run_ca(egressd, "r1"))
    bodies = [b"first-body", b"x" * 70000, b"", b"last"]
    wire = b""
    for i, body in enumerate(bodies):
        wire += (f"POST /echo/{marker}-{i} HTTP/1.1\r\nHost: api.test:{world.U}\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    c.send(wire)
    for i, body in enumerate(bodies):
        r = helpers.read_response(c)
        assert r.status == 200, (i, r.status, r.body[:200])
        got = json.loads(r.body)
        assert got["path"] == f"/echo/{marker}-{i}"
        assert got["body_length"] == len(body)
        assert got["body_sha256"] == hashlib.sha256(body).hexdigest()
    n = MiB + 17
    r = helpers.request(c, "GET", f"/bytes/{n}?{marker}", f"api.test:{world.U}")
    assert r.status == 200 and len(r.body) == n
    assert hashlib.sha256(r.body).hexdigest() == payload_sha256(n)
    r = helpers.request(c, "GET", f"/echo/{marker}-after", f"api.test:{world.U}")
    assert r.status == 200 and json.loads(r.body)["path"] == f"/echo/{marker}-after"


def test_truncated_response_body_is_not_completed(world, egressd, marker):
    """An upstream that closes before its Content-Length is reached: the client gets the bytes
    that came and then a close (never a completed response), and the audit says
    upstream_aborted."""
    n = 200000
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth("r1"),
                       run_ca(egressd, "r1"))
    c.send(f"GET /short/{n}?{marker} HTTP/1.1\r\nHost: api.test:{world.U}\r\n\r\n".encode())
    head = c.read_until(b"\r\n\r\n").decode("latin-1")
    assert head.startswith("HTTP/1.1 200") and f"Content-Length: {n}" in head, head
    got = c.read_to_eof()
    assert len(got) == n // 2 and hashlib.sha256(got).hexdigest() == \
        hashlib.sha256(b"".join(iter_payload(n))[:n // 2]).hexdigest()
    [rec] = egressd.wait_audit(lambda a: a.get("path") == f"/short/{n}")  # no query logged
    assert rec["reason"] == "upstream_aborted", rec
