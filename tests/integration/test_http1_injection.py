"""Credential injection over HTTP/1.1 with real clients: bearer, basic and header pins, client
values replaced, hop-by-hop/proxy headers stripped, keep-alive, absolute-form http:// (never a
credential), `unpinned: tunnel` (blind relay) and `unpinned: intercept`, a credential-less run."""
from __future__ import annotations

import json
import os
import ssl

import pytest
import requests

import helpers
from clients import curl_json, curl_via, requests_session, run_ca


def only(seen_list, marker):
    assert len(seen_list) == 1, f"expected exactly one upstream request for {marker}, " \
                                f"got {[(s.method, s.path) for s in seen_list]}"
    return seen_list[0]


def assert_no_secret_in(text: bytes | str, w):
    if isinstance(text, str):
        text = text.encode("latin-1", "replace")
    for name, v in w.secrets.items():
        assert v.encode() not in text, f"secret {name} visible to the client"


# ---------------------------------------------------------------------------------------------
# start-up


def test_health_ready_and_run_ca_written(egressd):
    status, body = egressd.admin_get("/healthz")
    assert status == 200 and body.strip() == b"ok"
    assert egressd.admin_get("/readyz")[0] == 200
    for ca in egressd.ca_paths():
        pem = open(ca).read()
        assert "-----BEGIN CERTIFICATE-----" in pem, ca
        assert "PRIVATE KEY" not in pem, f"{ca} must hold the certificate only"
    # Each run has its own CA.
    a, b = (open(p).read() for p in egressd.ca_paths())
    assert a != b


def test_run_ca_is_a_ca_and_leaf_is_minted_for_the_host(world, egressd):
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    cert = c.sock.getpeercert()
    sans = [v for k, v in cert.get("subjectAltName", ()) if k == "DNS"]
    assert "api.test" in sans
    assert c.sock.selected_alpn_protocol() in (None, "http/1.1")
    c.close()


# ---------------------------------------------------------------------------------------------
# the three injection types, with curl (HTTPS_PROXY) and requests


def test_bearer_curl(world, egressd, marker):
    body = curl_json(world, egressd, f"https://api.test:{world.U}/echo/{marker}?q=1")
    assert body["method"] == "GET"
    s = only(world.upstream.find(marker), marker)
    assert s.header("Authorization") == [f"Bearer {world.secrets['api_token']}"]
    assert s.header("Accept-Encoding") == ["identity"]
    assert s.header("Proxy-Authorization") == []
    assert s.sni == "api.test", "upstream TLS must carry SNI"
    # The echo body carried the credential back; the client must not see it.
    assert_no_secret_in(json.dumps(body), world)


def test_bearer_requests(world, egressd, marker):
    with requests_session(world, egressd) as s:
        r = s.get(f"https://api.test:{world.U}/echo/{marker}", timeout=30)
    assert r.status_code == 200
    up = only(world.upstream.find(marker), marker)
    assert up.header("Authorization") == [f"Bearer {world.secrets['api_token']}"]
    assert_no_secret_in(r.content, world)


def test_requests_reads_https_proxy_from_environment(world, egressd, marker, monkeypatch):
    url = egressd.proxy_url("r1", world.tokens["r1"])
    for k in ("HTTPS_PROXY", "https_proxy"):
        monkeypatch.setenv(k, url)
    for k in ("NO_PROXY", "no_proxy", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", run_ca(egressd, "r1"))
    r = requests.get(f"https://api.test:{world.U}/echo/{marker}", timeout=30)
    assert r.status_code == 200
    up = only(world.upstream.find(marker), marker)
    assert up.header("Authorization") == [f"Bearer {world.secrets['api_token']}"]


def test_basic_curl_and_requests(world, egressd, marker):
    want = helpers.basic_auth("itest-user", world.secrets["basic_pw"])
    curl_json(world, egressd, f"https://basic.test:{world.U}/echo/{marker}-c")
    assert only(world.upstream.find(marker + "-c"), marker).header("Authorization") == [want]
    with requests_session(world, egressd) as s:
        r = s.post(f"https://basic.test:{world.U}/echo/{marker}-r", data=b"x" * 1000, timeout=30)
    assert r.status_code == 200
    assert r.json()["body_length"] == 1000
    up = only(world.upstream.find(marker + "-r"), marker)
    assert up.header("Authorization") == [want]
    assert up.method == "POST"


def test_header_curl_and_requests(world, egressd, marker):
    want = "Key " + world.secrets["hdr_key"]
    curl_json(world, egressd, f"https://hdr.test:{world.U}/echo/{marker}-c")
    up = only(world.upstream.find(marker + "-c"), marker)
    assert up.header("X-Api-Key") == [want]
    assert up.header("Authorization") == [], "a header pin must not add Authorization"
    with requests_session(world, egressd) as s:
        r = s.get(f"https://hdr.test:{world.U}/echo/{marker}-r", timeout=30)
    assert r.status_code == 200
    assert only(world.upstream.find(marker + "-r"), marker).header("X-Api-Key") == [want]


def test_static_pin_headers_are_set_with_the_credential(world, factory, marker):
    """runs[].pins[].headers: static headers set on every request the pin injects, replacing
    (not merging with) what the client sent; a request the pin does not cover (another host)
    gets none of them."""
    extra = {"X-Api-Version": "2022-11-28", "Accept": "application/vnd.itest+json"}

    def add(c):
        c["runs"][0]["pins"][2]["headers"] = dict(extra)  # the hdr.test pin
    e = factory.start(add)
    curl_json(world, e, f"https://hdr.test:{world.U}/echo/{marker}-h",
              "-H", "X-Api-Version: client-chosen", "-H", "Accept: text/plain")
    up = only(world.upstream.find(marker + "-h"), marker)
    assert up.header("X-Api-Key") == ["Key " + world.secrets["hdr_key"]]
    assert up.header("X-Api-Version") == [extra["X-Api-Version"]]
    assert up.header("Accept") == [extra["Accept"]]
    curl_json(world, e, f"https://api.test:{world.U}/echo/{marker}-a",
              "-H", "X-Api-Version: client-chosen")
    up = only(world.upstream.find(marker + "-a"), marker)
    assert up.header("X-Api-Version") == ["client-chosen"]


def test_client_value_of_injected_header_is_replaced_not_merged(world, egressd, marker):
    curl_json(world, egressd, f"https://api.test:{world.U}/echo/{marker}-a",
              "-H", "Authorization: Bearer client-supplied", "-H", "authorization: Basic Zm9vOmJhcg==")
    up = only(world.upstream.find(marker + "-a"), marker)
    assert up.header("Authorization") == [f"Bearer {world.secrets['api_token']}"]
    curl_json(world, egressd, f"https://hdr.test:{world.U}/echo/{marker}-h",
              "-H", "X-Api-Key: client-key")
    up = only(world.upstream.find(marker + "-h"), marker)
    assert up.header("X-Api-Key") == ["Key " + world.secrets["hdr_key"]]


def test_accept_encoding_forced_to_identity(world, egressd, marker):
    curl_json(world, egressd, f"https://api.test:{world.U}/echo/{marker}",
              "-H", "Accept-Encoding: gzip, br")
    up = only(world.upstream.find(marker), marker)
    assert up.header("Accept-Encoding") == ["identity"]


def test_hop_by_hop_and_proxy_headers_are_stripped(world, egressd, marker):
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    r = helpers.request(c, "GET", f"/echo/{marker}", f"api.test:{world.U}", [
        ("Proxy-Authorization", world.auth()),
        ("Proxy-Connection", "keep-alive"),
        ("Proxy-Foo", "bar"),
        ("Connection", "keep-alive, X-Hop"),
        ("X-Hop", "nominated"),
        ("Keep-Alive", "timeout=5"),
        ("X-Kept", "yes"),
    ])
    c.close()
    assert r.status == 200, r
    up = only(world.upstream.find(marker), marker)
    names = {k.lower() for k, _ in up.headers}
    for gone in ("proxy-authorization", "proxy-connection", "proxy-foo", "x-hop", "keep-alive"):
        assert gone not in names, f"{gone} must not reach the upstream: {up.headers}"
    assert up.header("X-Kept") == ["yes"]
    assert up.header("Authorization") == [f"Bearer {world.secrets['api_token']}"]


def test_request_fields_reach_the_upstream_in_the_clients_order(world, egressd, marker):
    # Field lines with the same name keep their relative order (RFC 9110 5.3), and egressd
    # keeps the order of all of them: X-A, X-B, X-A arrives as sent, not grouped.
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    r = helpers.request(c, "GET", f"/echo/{marker}", f"api.test:{world.U}", [
        ("X-A", "1"), ("X-B", "2"), ("X-A", "3"), ("X-C", "4"), ("X-B", "5"),
    ])
    c.close()
    assert r.status == 200, r
    up = only(world.upstream.find(marker), marker)
    ours = [(k.lower(), v) for k, v in up.headers if k.lower() in ("x-a", "x-b", "x-c")]
    assert ours == [("x-a", "1"), ("x-b", "2"), ("x-a", "3"), ("x-c", "4"), ("x-b", "5")], \
        up.headers


def test_response_hop_by_hop_headers_are_stripped_by_whole_token(world, egressd, marker):
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    r = helpers.request(c, "GET", f"/hop/{marker}", f"api.test:{world.U}")
    c.close()
    assert r.status == 200, r
    assert r.header("X-Update") is None and r.header("Keep-Alive") is None, r.raw_head()
    assert r.header("Update") == "2" and r.header("X-Kept") == "yes", r.raw_head()
    assert r.header("Date"), r.raw_head()
    assert "x-update" not in (r.header("Connection") or "").lower(), r.raw_head()


def test_request_body_and_methods_pass_through(world, egressd, marker):
    data = os.urandom(200_000)
    with requests_session(world, egressd) as s:
        for m in ("PUT", "PATCH", "DELETE"):
            r = s.request(m, f"https://api.test:{world.U}/echo/{marker}-{m}", data=data, timeout=30)
            assert r.status_code == 200
            j = r.json()
            assert j["method"] == m
            assert j["body_length"] == len(data)
            import hashlib
            assert j["body_sha256"] == hashlib.sha256(data).hexdigest()
            up = only(world.upstream.find(f"{marker}-{m}"), marker)
            assert up.header("Authorization") == [f"Bearer {world.secrets['api_token']}"]
        r = s.head(f"https://api.test:{world.U}/bytes/1234", timeout=30)
        assert r.status_code == 200 and r.headers["Content-Length"] == "1234"


def test_redirect_is_passed_to_the_client(world, egressd, marker):
    with requests_session(world, egressd) as s:
        r = s.get(f"https://api.test:{world.U}/redirect/{marker}",
                  params={"to": "https://elsewhere.example/x"}, allow_redirects=False, timeout=30)
    assert r.status_code == 302
    assert r.headers["Location"] == "https://elsewhere.example/x"


# ---------------------------------------------------------------------------------------------
# keep-alive


def test_keep_alive_every_request_on_one_connection_is_injected(world, egressd, marker):
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    for i in range(5):
        body = b"b" * (i * 1000) if i % 2 else None
        r = helpers.request(c, "POST" if body else "GET", f"/echo/{marker}-{i}",
                            f"api.test:{world.U}", [("Authorization", f"Bearer client-{i}")], body)
        assert r.status == 200, (i, r)
        assert (r.header("Connection") or "").lower() != "close", "egressd closed a keep-alive"
    c.close()
    for i in range(5):
        up = only(world.upstream.find(f"{marker}-{i}"), marker)
        assert up.header("Authorization") == [f"Bearer {world.secrets['api_token']}"], i


def test_keep_alive_curl_reuses_the_tunnel(world, egressd, marker):
    urls = [f"https://api.test:{world.U}/echo/{marker}-{i}" for i in range(3)]
    r = curl_via(world, egressd, urls[0], *urls[1:], "-o", "/dev/null", "-o", "/dev/null",
                 "-o", "/dev/null", "-w", "%{http_code} %{num_connects}\n")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.decode().split()
    codes, connects = lines[0::2], [int(x) for x in lines[1::2]]
    assert codes == ["200"] * 3
    assert connects[1:] == [0, 0], f"curl opened new connections: {connects}"
    for i in range(3):
        up = only(world.upstream.find(f"{marker}-{i}"), marker)
        assert up.header("Authorization") == [f"Bearer {world.secrets['api_token']}"]


def test_keep_alive_requests_session(world, egressd, marker):
    with requests_session(world, egressd) as s:
        for i in range(4):
            r = s.get(f"https://hdr.test:{world.U}/echo/{marker}-{i}", timeout=30)
            assert r.status_code == 200
    for i in range(4):
        up = only(world.upstream.find(f"{marker}-{i}"), marker)
        assert up.header("X-Api-Key") == ["Key " + world.secrets["hdr_key"]]


# ---------------------------------------------------------------------------------------------
# absolute-form http:// — policy applies, no credential ever


def test_absolute_form_http_never_gets_a_credential(world, egressd, marker):
    url = f"http://plain.test:{world.plain.port}/echo/{marker}"
    r = curl_via(world, egressd, url + "-c", "-i")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(b"HTTP/1.1 200"), r.stdout[:300]
    with requests_session(world, egressd) as s:
        rr = s.get(url + "-r", headers={"X-Client": "1"}, timeout=30)
    assert rr.status_code == 200
    for suffix in ("-c", "-r"):
        up = only(world.plain.find(marker + suffix), marker)
        assert up.header("Authorization") == [], "cleartext request got a credential"
        assert up.header("Proxy-Authorization") == [], "Proxy-Authorization leaked upstream"
        for name, v in world.secrets.items():
            assert all(v not in val for _, val in up.headers), name


def test_absolute_form_http_is_subject_to_policy(world, egressd):
    # a host that is neither pinned nor allowed
    r = curl_via(world, egressd, f"http://unlisted.test:{world.plain.port}/echo/x", "-i")
    assert r.stdout.startswith(b"HTTP/1.1 403"), r.stdout[:300]
    assert b"x-egress-reason: host_not_allowed" in r.stdout.lower()
    # no identity
    r = curl_via(world, egressd, f"http://plain.test:{world.plain.port}/echo/x", "-i", run=None)
    assert r.stdout.startswith(b"HTTP/1.1 407"), r.stdout[:300]
    assert b'proxy-authenticate: basic realm="egressd"' in r.stdout.lower()


# ---------------------------------------------------------------------------------------------
# run isolation


def test_other_run_gets_neither_the_host_nor_the_secret(world, egressd, marker):
    c, r = helpers.proxy_connect(egressd.proxy_port, f"api.test:{world.U}", world.auth("r2"))
    c.close()
    assert r.status == 403 and r.egress_reason == "host_not_allowed", r
    assert world.upstream.find(marker) == []


def test_run_ca_of_other_run_is_not_trusted(world, egressd):
    c, r = helpers.proxy_connect(egressd.proxy_port, f"api.test:{world.U}", world.auth("r1"))
    assert r.status == 200
    with pytest.raises(ssl.SSLCertVerificationError):
        helpers.tls_wrap(c, "api.test", run_ca(egressd, "r2"))
    c.close()


# ---------------------------------------------------------------------------------------------
# unpinned hosts: tunnel (blind relay) and intercept


def test_unpinned_tunnel_relays_blindly(world, egressd, marker):
    # The client sees the upstream's own certificate: the test CA verifies it, the run CA not.
    c, r = helpers.proxy_connect(egressd.proxy_port, f"tunnel.test:{world.U}", world.auth())
    assert r.status == 200, r
    t = helpers.tls_wrap(c, "tunnel.test", world.pki.ca)
    issuer = dict(x[0] for x in t.sock.getpeercert()["issuer"])
    assert issuer["commonName"] == "egressd integration testca"
    resp = helpers.request(t, "GET", f"/echo/{marker}-raw", f"tunnel.test:{world.U}",
                           [("Authorization", "Bearer sandbox-own"), ("X-Egress-Anything", "1")])
    t.close()
    assert resp.status == 200
    up = only(world.upstream.find(marker + "-raw"), marker)
    # Nothing is parsed or rewritten in a blind tunnel.
    assert up.header("Authorization") == ["Bearer sandbox-own"]
    assert up.header("Accept-Encoding") == []
    c, r = helpers.proxy_connect(egressd.proxy_port, f"tunnel.test:{world.U}", world.auth())
    with pytest.raises(ssl.SSLCertVerificationError):
        helpers.tls_wrap(c, "tunnel.test", run_ca(egressd, "r1"))
    c.close()
    # curl through HTTPS_PROXY, trusting the upstream's CA
    r = curl_via(world, egressd, f"https://tunnel.test:{world.U}/echo/{marker}-curl",
                 cafile=world.pki.ca)
    assert r.returncode == 0, r.stderr
    assert only(world.upstream.find(marker + "-curl"), marker).header("Authorization") == []
    recs = egressd.wait_audit(lambda a: a.get("method") == "CONNECT" and
                              a.get("host") == "tunnel.test" and a.get("decision") == "allow",
                              count=2)
    assert all(a["pin"] is None and a["secret"] is None for a in recs)


def test_tunnel_refuses_a_client_hello_naming_another_host(world, egressd):
    """Domain fronting by SNI: CONNECT an allowed host, then a TLS handshake naming another
    (behind a shared CDN, the other host answers). The ClientHello is read before anything
    goes upstream; a different server name gets a TLS unrecognized_name alert, a closed
    connection and a 421 sni_mismatch audit record."""
    for sni in ("api.test", "forbidden.example"):
        c, r = helpers.proxy_connect(egressd.proxy_port, f"tunnel.test:{world.U}", world.auth())
        assert r.status == 200, r
        with pytest.raises(ssl.SSLError, match="UNRECOGNIZED_NAME"):
            helpers.tls_wrap(c, sni, world.pki.ca, check_hostname=False)
        c.close()
    recs = egressd.wait_audit(lambda a: a.get("host") == "tunnel.test" and
                              a.get("reason") == "sni_mismatch", count=2)
    assert all(a["status"] == 421 and a["decision"] == "deny" and a["method"] == "CONNECT"
               for a in recs), recs
    # The same name in another case (and with a trailing dot) is the same host.
    c, r = helpers.proxy_connect(egressd.proxy_port, f"tunnel.test:{world.U}", world.auth())
    t = helpers.tls_wrap(c, "TUNNEL.test", world.pki.ca, check_hostname=False)
    t.close()


def test_tunnel_refuses_a_malformed_client_hello(world, egressd):
    c, r = helpers.proxy_connect(egressd.proxy_port, f"tunnel.test:{world.U}", world.auth())
    assert r.status == 200
    # A TLS handshake record that holds a ServerHello (type 2), not a ClientHello.
    c.send(b"\x16\x03\x01\x00\x06\x02\x00\x00\x02\x03\x03")
    assert c.read_to_eof() == b"\x15\x03\x03\x00\x02\x02\x32"  # fatal decode_error
    c.close()
    egressd.wait_audit(lambda a: a.get("host") == "tunnel.test" and
                       a.get("reason") == "bad_client_hello" and a.get("status") == 400)


def test_tunnel_carries_what_is_not_tls(world, factory):
    """The check reads only a TLS first flight: cleartext HTTP goes through, and a protocol
    where the server speaks first (an SSH-like banner) is relayed before the client sends."""
    import socket
    import threading
    banner_srv = socket.socket()
    banner_srv.bind(("127.0.0.1", 0))
    banner_srv.listen(4)
    bport = banner_srv.getsockname()[1]

    def serve():
        try:
            s, _ = banner_srv.accept()
        except OSError:
            return
        with s:
            s.sendall(b"SSH-2.0-itest\r\n")
            data = s.recv(100)
            s.sendall(b"echo:" + data)

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    e = factory.start(mutate=lambda c: c["policy"]["allowed_ports"].append(bport))
    try:
        c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{bport}", world.auth())
        assert r.status == 200
        assert c.read_until(b"\r\n") == b"SSH-2.0-itest\r\n"
        c.send(b"SSH-2.0-client\r\n")
        assert c.read_exact(len(b"echo:SSH-2.0-client\r\n")) == b"echo:SSH-2.0-client\r\n"
        c.close()
        th.join(5)
        c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.plain.port}",
                                     world.auth())
        assert r.status == 200
        resp = helpers.request(c, "GET", "/echo/plain-through-tunnel",
                               f"tunnel.test:{world.plain.port}")
        assert resp.status == 200
        c.close()
    finally:
        banner_srv.close()


@pytest.fixture(scope="module")
def intercepting(factory):
    return factory.start(unpinned="intercept")


def test_unpinned_intercept_terminates_tls_without_credential(world, intercepting, marker):
    e = intercepting
    body = curl_json(world, e, f"https://tunnel.test:{world.U}/echo/{marker}?k=v")
    assert body["method"] == "GET"
    up = only(world.upstream.find(marker), marker)
    assert up.header("Authorization") == []
    recs = e.wait_audit(lambda a: a.get("path") == f"/echo/{marker}")
    assert recs[0]["method"] == "GET" and recs[0]["pin"] is None and recs[0]["secret"] is None
    assert recs[0]["decision"] == "allow"
    # pinned hosts are still injected
    curl_json(world, e, f"https://api.test:{world.U}/echo/{marker}-pinned")
    up = only(world.upstream.find(marker + "-pinned"), marker)
    assert up.header("Authorization") == [f"Bearer {world.secrets['api_token']}"]


# ---------------------------------------------------------------------------------------------
# a single run without proxy credentials (sidecar)


@pytest.fixture(scope="module")
def anonymous(factory):
    return factory.start(single_anonymous=True)


def test_single_run_without_proxy_credentials(world, anonymous, marker):
    e = anonymous
    r = curl_via(world, e, f"https://api.test:{world.U}/echo/{marker}", "-f", run=None)
    assert r.returncode == 0, r.stderr
    up = only(world.upstream.find(marker), marker)
    assert up.header("Authorization") == [f"Bearer {world.secrets['api_token']}"]
    with requests_session(world, e, run=None) as s:
        assert s.get(f"https://basic.test:{world.U}/echo/{marker}-r", timeout=30).status_code == 200
    up = only(world.upstream.find(marker + "-r"), marker)
    assert up.header("Authorization") == [helpers.basic_auth("itest-user",
                                                             world.secrets["basic_pw"])]


# ---------------------------------------------------------------------------------------------
# chunked framing on the injecting path (both directions)


def test_chunked_response_framing_intact(world, egressd, marker):
    from upstream import payload_sha256
    import hashlib
    n = 100_000
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    try:
        r = helpers.request(c, "GET", f"/chunked/{n}?{marker}", f"api.test:{world.U}")
        assert r.status == 200
        assert len(r.body) == n, f"chunked body cut at {len(r.body)} of {n} bytes " \
                                 f"(first chunk sizes {[len(x) for x in r.chunks[:5]]})"
        assert hashlib.sha256(r.body).hexdigest() == payload_sha256(n)
        # and the connection is still in sync
        assert helpers.request(c, "GET", f"/echo/{marker}-2", f"api.test:{world.U}").status == 200
    finally:
        c.close()


def test_chunked_request_body_framing_intact(world, egressd, marker):
    import hashlib
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    try:
        c.send(f"POST /upload/{marker} HTTP/1.1\r\nHost: api.test:{world.U}\r\n"
               "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n3\r\nabc\r\n0\r\n\r\n".encode())
        r = helpers.read_response(c)
        assert r.status == 200, (r.status, r.egress_reason, r.body)
        j = json.loads(r.body)
        assert j["length"] == 8 and j["sha256"] == hashlib.sha256(b"helloabc").hexdigest()
    finally:
        c.close()
