"""Scrubbing (a response that echoes the injected credential has it replaced, in headers and
bodies, across chunk boundaries, length preserved), the audit log (one JSON line per request,
the documented fields, no secret values), and a grep of everything egressd wrote."""
from __future__ import annotations

import base64
import json
import os
import urllib.parse

import pytest
import requests

import helpers
from clients import curl_via, requests_session, run_ca

AUDIT_FIELDS = ["time", "run", "method", "scheme", "host", "port", "path", "status", "pin",
                "secret", "decision", "reason", "bytes_in", "bytes_out", "duration_ms",
                "upstream_addr", "proto_in", "proto_out"]


def injected_value(w, host: str) -> tuple[str, str]:
    """(the injected header value, the secret) for a pinned host."""
    if host == "api.test":
        return f"Bearer {w.secrets['api_token']}", w.secrets["api_token"]
    if host == "basic.test":
        return helpers.basic_auth("itest-user", w.secrets["basic_pw"]), w.secrets["basic_pw"]
    if host == "hdr.test":
        return f"Key {w.secrets['hdr_key']}", w.secrets["hdr_key"]
    raise KeyError(host)


def assert_scrubbed(original: str, seen: bytes | str, secret: str):
    """`seen` is what the client got where `original` (containing the secret) was echoed."""
    if isinstance(seen, bytes):
        seen = seen.decode("latin-1")
    assert seen, "the client got nothing where the credential was echoed (body truncated?)"
    assert secret not in seen, "secret reached the client"
    assert original not in seen, "injected credential reached the client"
    assert "[REDACTED" in seen or "*" * 4 in seen, f"no redaction marker in {seen!r}"


# ---------------------------------------------------------------------------------------------
# scrubbing


FRAMING = {"chunked": "", "content-length": "?cl=1"}


@pytest.mark.parametrize("framing", FRAMING)
@pytest.mark.parametrize("host", ["api.test", "basic.test", "hdr.test"])
def test_reflected_credential_is_scrubbed_curl(world, egressd, host, framing, marker):
    value, secret = injected_value(world, host)
    r = curl_via(world, egressd, f"https://{host}:{world.U}/reflect/{marker}{FRAMING[framing]}",
                 "-i", "-f",
                 "--suppress-connect-headers")
    assert r.returncode == 0, r.stderr
    head, _, body = r.stdout.partition(b"\r\n\r\n")
    headers = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    assert_scrubbed(value, headers["x-seen"], secret)
    assert len(headers["x-seen"]) == len(value), "replacement must keep the length"
    assert_scrubbed(value, headers["set-cookie"], secret)
    assert_scrubbed(value, body, secret)
    assert body.startswith(b"seen=") and body.endswith(b";end\n"), body
    assert len(body) == len("seen=") + len(value) + len(";end\n")
    [up] = world.upstream.find(marker)  # the upstream did get the real credential
    assert value in [v for _, v in up.headers]


@pytest.mark.parametrize("framing", FRAMING)
@pytest.mark.parametrize("host", ["api.test", "basic.test", "hdr.test"])
def test_reflected_credential_is_scrubbed_requests(world, egressd, host, framing, marker):
    value, secret = injected_value(world, host)
    with requests_session(world, egressd) as s:
        r = s.get(f"https://{host}:{world.U}/reflect/{marker}{FRAMING[framing]}", timeout=30)
    assert r.status_code == 200
    assert_scrubbed(value, r.headers["X-Seen"], secret)
    assert_scrubbed(value, r.content, secret)
    assert len(r.content) == len("seen=") + len(value) + len(";end\n")


@pytest.mark.parametrize("query", [
    "",                         # chunked, the value split across two chunks
    "?split=1",                 # chunked, one byte per chunk
    "?cl=1",                    # Content-Length, the value split across two writes
    "?cl=1&pad=65530",          # ... straddling a 64 KiB boundary
    "?pad=65530",               # chunked, straddling a 64 KiB boundary
    "?cl=1&pad=1000000",        # a large body around it
])
def test_scrub_across_chunk_boundaries(world, egressd, marker, query):
    value, secret = injected_value(world, "api.test")
    pad = int(dict(p.split("=") for p in query.lstrip("?").split("&") if p).get("pad", 0))
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(),
                       run_ca(egressd, "r1"))
    try:
        r = helpers.request(c, "GET", f"/reflect/{marker}{query}", f"api.test:{world.U}")
        assert r.status == 200, r
        assert len(r.body) == pad + len("seen=") + len(value) + len(";end\n"), \
            f"body length {len(r.body)} (replacement must keep the length; truncated?)"
        assert r.body[:pad] == b"a" * pad
        assert_scrubbed(value, r.body[pad:], secret)
        assert_scrubbed(value, r.header("X-Seen"), secret)
        if "cl=1" in query:
            assert r.header("Content-Length") == str(len(r.body))
        # the connection stays usable after a scrubbed response
        r2 = helpers.request(c, "GET", f"/echo/{marker}-after", f"api.test:{world.U}")
        assert r2.status == 200
    finally:
        c.close()


def test_echo_body_with_credential_is_scrubbed(world, egressd, marker):
    """/echo returns the request headers (with the credential) in a JSON body."""
    for host in ("api.test", "basic.test", "hdr.test"):
        value, secret = injected_value(world, host)
        with requests_session(world, egressd) as s:
            r = s.get(f"https://{host}:{world.U}/echo/{marker}", timeout=30)
        assert r.status_code == 200
        assert_scrubbed(value, r.content, secret)
        json.loads(r.content)  # same-length replacement keeps the JSON intact


def test_unrelated_bytes_are_not_scrubbed(world, egressd, marker):
    with requests_session(world, egressd) as s:
        r = s.get(f"https://api.test:{world.U}/echo/{marker}",
                  headers={"X-Note": "Bearer not-the-secret"}, timeout=30)
    assert r.status_code == 200
    assert ["x-note", "Bearer not-the-secret"] in [[k.lower(), v] for k, v in r.json()["headers"]]


def test_reason_phrase_echoing_the_credential_is_scrubbed(world, egressd, marker):
    value, secret = injected_value(world, "api.test")
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    try:
        r = helpers.request(c, "GET", f"/reflect-reason/{marker}", f"api.test:{world.U}")
    finally:
        c.close()
    assert r.status == 401 and r.reason.startswith("Rejected ")
    assert_scrubbed(value, r.reason, secret)


@pytest.mark.parametrize("proto", ["--http1.1", "--http2"])
def test_field_names_echoing_the_credential_are_dropped(world, egressd, proto, marker):
    """A name cannot be redacted into a valid one: fields named after the secret (as sent, or
    lowercased as an HTTP/2 hop would) are dropped whole; the others reach the client."""
    secret = world.secrets["api_token"]
    r = curl_via(world, egressd, f"https://api.test:{world.U}/reflect-name/{marker}", proto,
                 "-sS", "-i", "-f", "--suppress-connect-headers")
    assert r.returncode == 0, r.stderr
    head = r.stdout.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    leaked = secret.lower() in head or secret.lower() in r.stderr.decode("latin-1").lower()
    assert not leaked, "a field name carrying the secret reached the client"
    assert "x-kept: yes" in head
    assert "x-echo-" not in head and "x-lower-" not in head
    [seen] = world.upstream.find(marker)
    injected = seen.header("Authorization") == [f"Bearer {secret}"]
    assert injected, "the upstream did not get the credential"


def test_encoded_response_to_an_injected_request_is_refused(world, egressd, marker):
    """The scrubber reads only identity-coded bodies: an upstream that encodes anyway (here
    gzip, though the request egressd sent asked for identity) gets the response refused."""
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    try:
        r = helpers.request(c, "GET", f"/reflect-gzip/{marker}", f"api.test:{world.U}",
                            headers=[("Accept-Encoding", "gzip")])
    finally:
        c.close()
    assert (r.status, r.egress_reason) == (502, "upstream_encoded_response")
    assert world.secrets["api_token"].encode() not in r.body
    [seen] = world.upstream.find(marker)
    assert seen.header("Accept-Encoding") == ["identity"]
    egressd.wait_audit(lambda a: marker in (a.get("path") or "")
                       and a.get("reason") == "upstream_encoded_response" and a["status"] == 502)


def test_transfer_coded_response_to_an_injected_request_is_refused(world, egressd, marker):
    """A transfer coding other than chunked would reach the client as the coded bytes with no
    field saying so, past the scrubber: refused like a content coding."""
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    try:
        r = helpers.request(c, "GET", f"/reflect-te-gzip/{marker}", f"api.test:{world.U}")
    finally:
        c.close()
    assert (r.status, r.egress_reason) == (502, "upstream_transfer_coding")
    assert len(world.upstream.find(marker)) == 1  # the upstream did answer, coded
    egressd.wait_audit(lambda a: marker in (a.get("path") or "")
                       and a.get("reason") == "upstream_transfer_coding" and a["status"] == 502)


def test_byte_ranges_of_an_injected_request_are_not_asked_for(world, egressd, marker):
    """Two ranges of an echo (or the parts of one multipart/byteranges answer) would each hold
    a piece of the credential, which the scrubber finds only whole: Range and If-Range do not
    go upstream with a credential, and the answer is the whole body, scrubbed."""
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    try:
        r = helpers.request(c, "GET", f"/reflect/{marker}", f"api.test:{world.U}",
                            headers=[("Range", "bytes=14-33,34-98"), ("If-Range", '"x"')])
    finally:
        c.close()
    assert r.status == 200
    leaked = world.secrets["api_token"].encode() in r.body
    assert not leaked
    [seen] = world.upstream.find(marker)
    assert seen.header("Range") == [] and seen.header("If-Range") == []
    injected = seen.header("Authorization") == [f"Bearer {world.secrets['api_token']}"]
    assert injected


def test_request_trailers_cannot_carry_what_the_head_may_not(world, egressd, marker):
    """Trailer fields the head's rules govern (the proxy's namespace, credentials, routing,
    framing) never reach the upstream; others do."""
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    try:
        c.send((f"POST /upload/{marker} HTTP/1.1\r\nHost: api.test:{world.U}\r\n"
                "Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n"
                "X-Egress-Run: forged\r\nAuthorization: Bearer client-value\r\n"
                "Host: evil.test\r\nCookie: a=b\r\nProxy-Authorization: Basic eA==\r\n"
                "X-HTTP-Method-Override: DELETE\r\nX-Original-URL: /admin\r\n"
                "X-Amz-Copy-Source: /secret/data\r\nIf-Range: x\r\nRange: bytes=0-1\r\n"
                "X-Checksum: 900150983cd24fb0\r\n\r\n").encode())
        r = helpers.read_response(c)
    finally:
        c.close()
    assert r.status == 200 and json.loads(r.body)["length"] == 3
    [seen] = world.upstream.find(marker)
    assert seen.trailers == [("x-checksum", "900150983cd24fb0")]


# ---------------------------------------------------------------------------------------------
# audit


def test_audit_one_json_line_per_request(world, factory, marker):
    e = factory.start()
    U = world.U
    expect = []  # (path-or-host, predicate on the record)

    with requests_session(world, e) as s:
        for i in range(3):  # three requests on one keep-alive connection
            assert s.get(f"https://api.test:{U}/echo/{marker}/{i}?token=abc", timeout=30).ok
            expect.append(f"/echo/{marker}/{i}")
        assert s.post(f"https://hdr.test:{U}/upload/{marker}", data=b"z" * 5000, timeout=30).ok
        expect.append(f"/upload/{marker}")
        assert s.get(f"https://basic.test:{U}/bytes/70000?{marker}", timeout=30).ok
        r = s.get(f"https://api.test:{U}/echo/{marker}/forged", headers={"X-Egress-X": "1"},
                  timeout=30)
        assert r.status_code == 403
        expect.append(f"/echo/{marker}/forged")
    assert curl_via(world, e, f"http://plain.test:{world.plain.port}/echo/{marker}/plain",
                    "-f").returncode == 0
    expect.append(f"/echo/{marker}/plain")

    recs = e.wait_audit(lambda a: marker in (a.get("path") or ""), count=len(expect))
    by_path = {}
    for a in recs:
        by_path.setdefault(a["path"], []).append(a)
    for p in expect:
        assert len(by_path.get(p, [])) == 1, f"{p}: {by_path.get(p)}"
    for a in recs:
        missing = [f for f in AUDIT_FIELDS if f not in a]
        assert not missing, f"audit record lacks {missing}: {a}"
        assert a["run"] == "r1"
        assert "?" not in a["path"], "query must be removed"
        assert "abc" not in json.dumps(a)

    ok = by_path[f"/echo/{marker}/0"][0]
    assert ok["method"] == "GET" and ok["scheme"] == "https" and ok["host"] == "api.test"
    assert int(ok["port"]) == U and ok["status"] == 200
    assert ok["decision"] == "allow" and ok["pin"] is not None and ok["secret"] == "api_token"
    assert ok["upstream_addr"] in (f"127.0.0.1:{U}", "127.0.0.1")
    assert ok["bytes_out"] > 0  # the echo's body (a GET sends none: bytes_in may be 0)
    assert 0 < ok["duration_ms"] < 60_000
    assert ok["proto_in"] and ok["proto_out"]

    up = by_path[f"/upload/{marker}"][0]
    assert up["method"] == "POST" and up["secret"] == "hdr_key"
    assert max(up["bytes_in"], up["bytes_out"]) >= 5000

    dl = [a for a in e.audit_records() if a.get("path") == "/bytes/70000"]
    assert len(dl) >= 1 and dl[-1]["secret"] == "basic_pw"
    assert max(dl[-1]["bytes_in"], dl[-1]["bytes_out"]) >= 70000

    forged = by_path[f"/echo/{marker}/forged"][0]
    assert forged["decision"] == "deny" and forged["status"] == 403
    assert forged["reason"] == "forged_egress_header"

    plain = by_path[f"/echo/{marker}/plain"][0]
    assert plain["scheme"] == "http" and plain["decision"] == "allow"
    assert plain["secret"] is None, "cleartext requests never carry a credential"

    # refusals at CONNECT time and tunnels are audited too
    c, r = helpers.proxy_connect(e.proxy_port, f"unlisted.test:{U}", world.auth())
    c.close()
    c, r = helpers.proxy_connect(e.proxy_port, f"unlisted.test:{U}", None)
    c.close()
    assert curl_via(world, e, f"https://tunnel.test:{U}/echo/{marker}/t",
                    cafile=world.pki.ca).returncode == 0
    [deny] = e.wait_audit(lambda a: a.get("host") == "unlisted.test" and a.get("status") == 403)
    assert deny["decision"] == "deny" and deny["method"] == "CONNECT"
    assert deny["reason"] == "host_not_allowed" and deny["run"] == "r1"
    # the unauthenticated attempt is recorded too (run unknown)
    [noid] = e.wait_audit(lambda a: a.get("reason") == "no_identity")
    assert noid["status"] == 407 and noid["decision"] == "deny" and noid["run"] is None
    assert noid["method"] == "CONNECT"
    t = e.wait_audit(lambda a: a.get("host") == "tunnel.test")
    assert len(t) == 1 and t[0]["method"] == "CONNECT" and t[0]["decision"] == "allow"

    # the log lines leave the query out as the record does (it may carry tokens)
    log = e.stderr_text()
    assert f"/echo/{marker}/0 -> 200" in log
    assert "token=abc" not in log

    # every line of the file is one JSON object
    assert all(isinstance(r, dict) for r in e.audit_records())


# ---------------------------------------------------------------------------------------------
# nothing egressd writes contains a secret


def test_no_secret_in_anything_egressd_wrote(world, factory, marker):
    e = factory.start()
    U = world.U
    # Traffic of every kind; this test is about what egressd writes, not about the responses,
    # so a failing request does not stop it.
    urls = []
    for host in ("api.test", "basic.test", "hdr.test"):
        urls += [(f"https://{host}:{U}/reflect/{marker}", {}),
                 (f"https://{host}:{U}/reflect/{marker}?cl=1", {}),
                 (f"https://{host}:{U}/echo/{marker}?x=1", {}),
                 (f"https://{host}:{U}/echo/{marker}", {"X-Egress-A": "1"}),
                 (f"https://{host}:{U}/echo/{marker}", {"Host": f"other.test:{U}"})]
    urls.append((f"https://lim.test:{U}/bytes/5", {}))  # no_matching_pin
    for url, hdrs in urls:
        with requests_session(world, e) as s:
            try:
                s.get(url, headers=hdrs, timeout=30)
            except requests.RequestException:
                pass
    for target, auth in ((f"bad.test:{world.bad.port}", world.auth()),
                         (f"slow.test:{world.silent.port}", world.auth()),
                         (f"down.test:{world.closed_port}", world.auth()),
                         (f"api.test:{U}", helpers.basic_auth("r1", "nope"))):
        c, r = helpers.proxy_connect(e.proxy_port, target, auth)
        if r.status == 200:
            try:
                t = helpers.tls_wrap(c, target.split(":")[0], run_ca(e, "r1"))
                helpers.request(t, "GET", "/echo/x", target)
                t.close()
            except (OSError, ValueError):
                pass
        c.close()
    e.wait_audit(lambda a: a.get("host") == "slow.test")
    rc = e.stop()
    assert rc == 0, f"egressd exit status {rc} after SIGTERM"
    written = e.written_files()
    assert e.audit_path in written and e.stderr_path in written
    extra = [helpers.basic_auth("itest-user", world.secrets["basic_pw"]).split()[1].encode(),
             base64.b64encode(world.secrets["api_token"].encode())]
    leaks = e.leaks(extra)
    assert leaks == [], f"secret bytes found in files egressd wrote: {leaks}"
    # and the token files / secret files were not rewritten or copied anywhere under var/
    for p in written:
        assert not os.path.basename(p).startswith(("api_token", "basic_pw", "hdr_key")), p


def test_echoed_credential_is_scrubbed_in_its_url_and_json_forms(world, factory, marker,
                                                                  tmp_path):
    """A secret with bytes a URL or a JSON string escapes ('/', '+', '=', '"', '\\', as in an
    AWS-style key) echoed by the upstream percent-encoded (a Location's query; upper- and
    lowercase hex) and JSON-escaped (also with '/' as "\\/", as PHP's json_encode does) is
    scrubbed in each form, lengths kept; and none of its forms is in anything egressd wrote."""
    secret = "wJalrXUtnFEMI/K7MDENG+bPxRfi=" + os.urandom(6).hex() + '/"q\\z='
    sf = tmp_path / "aws_like"
    sf.write_text(secret)
    sf.chmod(0o600)

    def mutate(cfg):
        r1 = next(r for r in cfg["runs"] if r["id"] == "r1")
        r1["pins"].append({"host": f"enc.test:{world.U}", "secret_file": str(sf),
                           "inject": {"type": "bearer"}})
        cfg["resolver"]["overrides"]["enc.test"] = ["127.0.0.1"]
    e = factory.start(mutate=mutate)
    value = "Bearer " + secret
    quoted = urllib.parse.quote(value, safe="")
    forms = [secret, quoted, quoted.lower(), json.dumps(secret)[1:-1],
             json.dumps(secret)[1:-1].replace("/", "\\/")]
    forms += [urllib.parse.quote(secret, safe="")]
    c = helpers.tunnel(e.proxy_port, "enc.test", world.U, world.auth(), run_ca(e, "r1"))
    try:
        r = helpers.request(c, "GET", f"/reflect-encoded/{marker}", f"enc.test:{world.U}")
    finally:
        c.close()
    assert r.status == 200, r
    body = r.body.decode("latin-1")
    assert len(r.body) == int(r.header("Content-Length"))  # each form kept its length
    echo = json.loads(r.body)  # and the body is still JSON
    assert len(echo["url"]) == len(quoted) == len(echo["url_lower"]), echo
    # (indexes only: a failure must not print the secret's forms)
    leaked = [i for i, f in enumerate(forms) if f in body or f in r.header("Location")]
    assert not leaked, f"forms {leaked} of the secret reached the client"
    assert body.count("[REDACTED") >= 4, body.count("[REDACTED")
    assert "[REDACTED" in r.header("Location")
    seen = world.upstream.find(marker)
    injected = bool(seen) and seen[0].header("Authorization") == [value]
    assert injected, "the upstream did not get the credential"
    e.stop()
    leaks = e.leaks([f.encode() for f in forms])
    assert not leaks, leaks


def test_a_failing_tests_report_is_redacted_of_registered_secrets(world):
    """The conftest hook's redaction (helpers.redact_secrets): a registered secret is replaced
    as it is, percent-encoded, JSON-escaped and in base64, and so is a piece of one that
    pytest's shortened repr leaves ('head...tail'); other text is left alone."""
    import base64 as b64
    v = world.secrets["api_token"]
    text = (f"assert '{v}' == 'x'; q={urllib.parse.quote(v)}; j={json.dumps(v)}; "
            f"b={b64.b64encode(v.encode()).decode()}; short='{v[:12]}...{v[-13:]}'; keep=abc")
    red = helpers.redact_secrets(text)
    assert v[-10:] not in red and v[:10] not in red  # booleans only: no secret in a report
    assert red.count(f"[secret {helpers.fp(v)}]") == 4
    assert "[secret piece]...[secret piece]" in red and red.endswith("keep=abc")


@pytest.mark.parametrize("up", ["h1", "h2"])
def test_an_upstream_cannot_speak_in_egressds_namespace(world, factory, marker, up):
    """X-Egress-* is egressd's word to the client (a refusal's reason): an upstream's fields
    and trailers in that namespace are dropped, on HTTP/1.1 and HTTP/2 upstreams, so a 403
    dressed as egressd's refusal reaches the client as the upstream's plain 200 fields (before:
    X-Egress-Reason: secret_unavailable from the upstream reached the client as it was)."""
    from h2_helpers import add_h2_pins
    from h2_upstream import H2Upstream
    h2up = H2Upstream(world.pki.server_cert, world.pki.server_key)
    try:
        e = factory.start(add_h2_pins(world, h2up))
        P = world.U if up == "h1" else h2up.port
        if up == "h1":
            path = (f"/fields/0?set=X-Egress-Reason:secret_unavailable&set=X-Kept:yes"
                    f"&tset=X-Egress-Trailer:t&tset=X-Kept-T:1&{marker}")
        else:
            path = (f"/fields/{marker}?set=x-egress-reason:secret_unavailable&set=x-kept:yes"
                    f"&tset=x-egress-trailer:t&tset=x-kept-t:1")
        c = helpers.tunnel(e.proxy_port, "api.test", P, world.auth(), run_ca(e, "r1"))
        try:
            c.send((f"GET {path} HTTP/1.1\r\nHost: api.test:{P}\r\nTE: trailers\r\n"
                    "Connection: close\r\n\r\n").encode())
            c.sock.settimeout(10)
            raw = c.read_to_eof().lower()
        finally:
            c.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"http/1.1 200"), head
        assert b"x-kept: yes" in head and b"x-kept-t: 1" in body  # the check can fail
        assert b"x-egress-" not in raw, raw
    finally:
        h2up.close()
