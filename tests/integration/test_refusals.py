"""Every refusal: status, text/plain body, X-Egress-Reason, nothing forwarded, one audit record
with decision "deny". CONNECT-level refusals are read from the CONNECT response with a raw
socket; in-tunnel refusals from the response to the request sent through the run-CA TLS."""
from __future__ import annotations

import json
import os
import socket
import ssl
import time

import pytest
import requests

import helpers
from clients import curl_via, requests_session, run_ca
from dns_server import fixed
from upstream import free_port


def audit_mark(e) -> int:
    """Where the next audit record will begin: the file's size once it has stopped growing
    for 50 ms (a record is written after its refusal was sent: one made just before, through
    another client, must not land after the mark). Bounded: 2 s."""
    def size():
        return os.path.getsize(e.audit_path) if os.path.exists(e.audit_path) else 0
    last, deadline = size(), time.monotonic() + 2.0
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = size()
        if now == last:
            break
        last = now
    return last


def one_record_since(e, offset: int, status: int, reason: str, prefix=False) -> dict:
    """The refusal's own record: exactly one deny record with `reason` written since `offset`
    (one refusal, one record), with `status`."""
    def matching():
        with open(e.audit_path, "rb") as f:
            f.seek(offset)
            recs = helpers.audit_lines(f.read())
        rs = [a for a in recs if a.get("decision") == "deny" and
              ((a.get("reason") or "").startswith(reason) if prefix else a.get("reason") == reason)]
        return rs or None
    recs = helpers.poll(matching, 5.0, f"the audit record of this {reason} refusal")
    assert len(recs) == 1 and recs[0]["status"] == status, recs
    return recs[0]


def assert_refusal(r: helpers.Response, status: int, reason: str | None, prefix=False):
    assert r.status == status, f"want {status} {reason}, got {r.status} " \
                               f"{r.egress_reason!r} {r.body[:200]!r}"
    if reason is not None:
        got = r.egress_reason or ""
        assert (got.startswith(reason) if prefix else got == reason), \
            f"X-Egress-Reason {got!r}, want {reason!r}"
    if (since := getattr(r, "audit_since", None)) is not None:
        # Every refusal made through the helpers waits for its own record, also one whose
        # reason the test leaves open (it would otherwise land in the next one's window).
        if reason is None:
            one_record_since(*since, status, r.egress_reason or "", prefix=not r.egress_reason)
        else:
            one_record_since(*since, status, reason, prefix)
    ctype = (r.header("Content-Type") or "").lower()
    assert ctype.startswith("text/plain"), f"Content-Type {ctype!r}"


def connect_refused(e, target, auth, status, reason, prefix=False):
    offset = audit_mark(e)
    c, r = helpers.proxy_connect(e.proxy_port, target, auth)
    c.close()
    r.audit_since = (e, offset)
    assert_refusal(r, status, reason, prefix)
    return r


def in_tunnel(e, w, host, port, method="GET", path="/echo/x", host_header=None, headers=(),
              sni=None, check_hostname=True, body=None):
    """CONNECT host:port (must be 200), TLS, one request; returns the response (with where
    the audit file stood before it, for assert_refusal to find the refusal's own record)."""
    offset = audit_mark(e)
    c, r = helpers.proxy_connect(e.proxy_port, f"{host}:{port}", w.auth())
    if r.status != 200:
        c.close()
        r.audit_since = (e, offset)
        return r  # a refusal at CONNECT time
    t = helpers.tls_wrap(c, sni or host, run_ca(e, "r1"), check_hostname=check_hostname)
    try:
        r = helpers.request(t, method, path, host_header or f"{host}:{port}", headers, body)
        r.audit_since = (e, offset)
        return r
    finally:
        t.close()


def audited(e, reason, status, prefix=False, **match):
    def pred(a):
        rs = a.get("reason") or ""
        ok = rs.startswith(reason) if prefix else rs == reason
        return ok and a.get("decision") == "deny" and all(a.get(k) == v for k, v in match.items())
    recs = e.wait_audit(pred)
    assert recs[-1]["status"] == status, recs[-1]
    return recs[-1]


# ---------------------------------------------------------------------------------------------
# identity


def test_no_identity_407(world, egressd, marker):
    r = connect_refused(egressd, f"api.test:{world.U}", None, 407, "no_identity")
    assert r.header("Proxy-Authenticate") == 'Basic realm="egressd"'
    audited(egressd, "no_identity", 407)
    # curl without credentials
    res = curl_via(world, egressd, f"https://api.test:{world.U}/echo/{marker}", run=None)
    assert res.returncode != 0
    assert b"407" in res.stderr, res.stderr
    # requests without credentials
    with requests_session(world, egressd, run=None) as s:
        with pytest.raises(requests.exceptions.ProxyError) as ei:
            s.get(f"https://api.test:{world.U}/echo/{marker}", timeout=30)
    assert "407" in str(ei.value)
    assert world.upstream.find(marker) == []


def test_wrong_identity_407(world, egressd, marker):
    bad = [helpers.basic_auth("r1", "wrong-token"),
           helpers.basic_auth("nosuchrun", world.tokens["r1"]),
           helpers.basic_auth("r2", world.tokens["r1"]),   # token of another run
           "Basic !!!not-base64!!!",
           "Bearer " + world.tokens["r1"]]
    for auth in bad:
        r = connect_refused(egressd, f"api.test:{world.U}", auth, 407, None)
        assert r.egress_reason in ("bad_identity", "no_identity"), (auth, r.egress_reason)
        assert r.header("Proxy-Authenticate") == 'Basic realm="egressd"'
    r = connect_refused(egressd, f"api.test:{world.U}", bad[0], 407, "bad_identity")
    audited(egressd, "bad_identity", 407)
    res = curl_via(world, egressd, f"https://api.test:{world.U}/echo/{marker}",
                   token="wrong-token")
    assert res.returncode != 0 and b"407" in res.stderr, res.stderr
    with requests_session(world, egressd, token="wrong-token") as s:
        with pytest.raises(requests.exceptions.ProxyError):
            s.get(f"https://api.test:{world.U}/echo/{marker}", timeout=30)
    assert world.upstream.find(marker) == []


def forward_get(c: helpers.Conn, authority: str, target: str, auth: str) -> helpers.Response:
    """One absolute-form GET http://authority/target on the forward port's connection c."""
    c.send((f"GET http://{authority}{target} HTTP/1.1\r\nHost: {authority}\r\n"
            f"Proxy-Authorization: {auth}\r\n\r\n").encode())
    return helpers.read_response(c)


def test_identity_refusals_name_this_requests_destination_and_no_earlier_run(world, egressd):
    """A refusal of a request's identity is recorded with that request's destination (the
    CONNECT target, the absolute-form URI's host, port and path) and names no run it did not
    prove: on a keep-alive connection, not the run of the request before it."""
    P = world.plain.port
    r = connect_refused(egressd, f"unlisted.test:{world.U}", helpers.basic_auth("r1", "wrong"),
                        407, "bad_identity")
    rec = audited(egressd, "bad_identity", 407, host="unlisted.test")
    assert (rec["port"], rec["run"], rec["method"]) == (world.U, None, "CONNECT"), rec
    c = helpers.Conn(socket.create_connection(("127.0.0.1", egressd.proxy_port), timeout=10))
    try:
        assert forward_get(c, f"plain.test:{P}", "/echo/attribution", world.auth()).status == 200
        offset = audit_mark(egressd)
        r = forward_get(c, "unlisted.test", "/second?q=1", helpers.basic_auth("r1", "wrong"))
    finally:
        c.close()
    assert (r.status, r.egress_reason) == (407, "bad_identity")
    rec = one_record_since(egressd, offset, 407, "bad_identity")
    assert (rec["run"], rec["host"], rec["port"], rec["path"]) == \
        (None, "unlisted.test", 80, "/second"), rec


def test_a_denied_absolute_form_request_records_its_path_not_its_uri(world, egressd):
    offset = audit_mark(egressd)
    c = helpers.Conn(socket.create_connection(("127.0.0.1", egressd.proxy_port), timeout=10))
    try:
        r = forward_get(c, "unlisted.test", "/repos/x?access_token=abc", world.auth())
    finally:
        c.close()
    assert (r.status, r.egress_reason) == (403, "host_not_allowed")
    rec = one_record_since(egressd, offset, 403, "host_not_allowed")
    assert (rec["run"], rec["host"], rec["path"]) == ("r1", "unlisted.test", "/repos/x"), rec


def test_a_malformed_absolute_form_request_records_its_path_not_its_uri(world, egressd):
    """The head's own refusals on the forward port (framing, Host) name the path too."""
    P = world.plain.port
    for extra, reason in (("Transfer-Encoding: gzip\r\n", "bad_transfer_encoding"),
                          (f"Host: plain.test:{P}\r\n", "duplicate_host")):
        offset = audit_mark(egressd)
        c = helpers.Conn(socket.create_connection(("127.0.0.1", egressd.proxy_port), timeout=10))
        try:
            c.send((f"POST http://plain.test:{P}/p/x?access_token=abc HTTP/1.1\r\n"
                    f"Host: plain.test:{P}\r\nProxy-Authorization: {world.auth()}\r\n"
                    f"{extra}\r\n").encode())
            r = helpers.read_response(c)
        finally:
            c.close()
        assert (r.status, r.egress_reason) == (400, reason)
        rec = one_record_since(egressd, offset, 400, reason)
        assert (rec["host"], rec["port"], rec["path"]) == ("plain.test", P, "/p/x"), rec


def test_an_absolute_form_options_without_a_path_goes_upstream_as_asterisk(world, egressd,
                                                                           marker):
    """RFC 9112 3.2.4: OPTIONS http://host:port (no path, no query) is "OPTIONS *" at the
    origin; with a query it is "/?query"."""
    P = world.plain.port
    c = helpers.Conn(socket.create_connection(("127.0.0.1", egressd.proxy_port), timeout=10))
    try:
        for target in (f"http://plain.test:{P}", f"http://plain.test:{P}?{marker}"):
            c.send((f"OPTIONS {target} HTTP/1.1\r\nHost: plain.test:{P}\r\n"
                    f"Proxy-Authorization: {world.auth()}\r\nX-Marker: {marker}\r\n\r\n")
                   .encode())
            r = helpers.read_response(c)
            assert r.status < 500, (r.status, r.egress_reason)
    finally:
        c.close()
    def paths():
        got = [s.path for s in world.plain.requests if s.header("X-Marker") == [marker]]
        return got if len(got) == 2 else None
    seen = helpers.poll(paths, 5.0, "both OPTIONS upstream")
    assert seen == ["*", f"/?{marker}"], seen


def test_a_revoked_runs_refusal_names_the_run_and_destination(world, factory):
    from cp_helpers import api_ok, bearer_pin, cp_mutate, create_run, put_secret
    e = factory.start(mutate=cp_mutate(world, ports=[world.U]))
    put_secret(e, "rv_tok", "rv-itest-value", org="acme")
    run = create_run(e, world, {"org": "acme"}, [bearer_pin(f"api.test:{world.U}", "rv_tok")])
    api_ok(e, "DELETE", f"/v1/runs/{run.id}")
    connect_refused(e, f"api.test:{world.U}", run.auth, 403, "run_revoked")
    rec = audited(e, "run_revoked", 403)
    assert (rec["run"], rec["host"], rec["port"]) == (run.id, "api.test", world.U), rec


# ---------------------------------------------------------------------------------------------
# destination policy (CONNECT level)


def test_host_not_allowed_403(world, egressd, marker):
    connect_refused(egressd, f"unlisted.test:{world.U}", world.auth(), 403, "host_not_allowed")
    connect_refused(egressd, f"example.com:{world.U}", world.auth(), 403, "host_not_allowed")
    audited(egressd, "host_not_allowed", 403, host="unlisted.test", method="CONNECT")
    res = curl_via(world, egressd, f"https://unlisted.test:{world.U}/echo/{marker}")
    assert res.returncode != 0 and b"403" in res.stderr, res.stderr
    with requests_session(world, egressd) as s:
        with pytest.raises(requests.exceptions.ProxyError) as ei:
            s.get(f"https://unlisted.test:{world.U}/echo/{marker}", timeout=30)
    assert "403" in str(ei.value)


def test_host_denied_403_overrides_pins_and_allow_lists(world, factory, marker):
    """policy.deny_hosts wins over a run's pin and over the allow lists: a pinned host and a
    globally allowed one, both listed, get 403 host_denied at CONNECT and nothing goes
    upstream; a pinned host not listed is served. A reload that drops the list lets the
    pinned host through again (the policy is re-read per request)."""
    e = factory.start(lambda c: c["policy"].update(deny_hosts=["api.test", "tunnel.test"]))
    connect_refused(e, f"api.test:{world.U}", world.auth(), 403, "host_denied")
    connect_refused(e, f"tunnel.test:{world.U}", world.auth(), 403, "host_denied")
    audited(e, "host_denied", 403, host="api.test", method="CONNECT")
    res = curl_via(world, e, f"https://api.test:{world.U}/echo/{marker}-denied")
    assert res.returncode != 0 and b"403" in res.stderr, res.stderr
    assert not world.upstream.find(marker + "-denied")
    ok = in_tunnel(e, world, "basic.test", world.U, path=f"/echo/{marker}-basic")
    assert ok.status == 200, ok.status
    e.rewrite_config(lambda c: c["policy"].pop("deny_hosts"))
    e.reload()
    r = in_tunnel(e, world, "api.test", world.U, path=f"/echo/{marker}-after")
    assert r.status == 200, (r.status, r.egress_reason)
    assert world.upstream.find(marker + "-after")


def _blind_tunnel_tls(e, world):
    """A CONNECT to tunnel.test (allowed, unpinned: a blind tunnel) and TLS to the upstream
    through it, trusting the upstream's own CA (egressd does not intercept)."""
    t, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.U}", world.auth())
    assert r.status == 200, (r.status, r.egress_reason)
    ctx = ssl.create_default_context(cafile=world.pki.ca)
    ctx.check_hostname = False
    return helpers.Conn(ctx.wrap_socket(t.sock, server_hostname="tunnel.test"))


@pytest.mark.parametrize("change", ["deny_hosts", "allow_networks"])
def test_a_reload_that_refuses_a_tunnels_destination_ends_the_open_tunnel(world, factory,
                                                                        marker, change):
    """A blind tunnel decided at its CONNECT does not outlive the policy that let it open: once
    a reload denies its host (policy.deny_hosts) or the address it reached (allow_networks
    narrowed), the next bytes through it end it (audited, reason policy_changed), and nothing
    more reaches the upstream."""
    e = factory.start()
    tc = _blind_tunnel_tls(e, world)
    r = helpers.request(tc, "GET", f"/echo/{marker}-1", f"api.test:{world.U}")
    assert r.status == 200
    if change == "deny_hosts":
        e.rewrite_config(lambda c: c["policy"].__setitem__("deny_hosts", ["tunnel.test"]))
    else:
        e.rewrite_config(lambda c: c["policy"].__setitem__("allow_networks", []))
    e.reload()
    try:
        r = helpers.request(tc, "GET", f"/echo/{marker}-2", f"api.test:{world.U}")
        got = r.status
    except (ConnectionError, ssl.SSLError, OSError, ValueError):
        got = None
    tc.close()
    assert got is None, got
    assert not world.upstream.find(f"{marker}-2")
    rec = e.wait_audit(lambda x: x.get("reason") == "policy_changed")
    assert rec[-1]["host"] == "tunnel.test" and rec[-1]["status"] == 200, rec[-1]
    if change == "deny_hosts":
        connect_refused(e, f"tunnel.test:{world.U}", world.auth(), 403, "host_denied")


def test_a_reload_while_a_tunnel_is_dialled_applies_to_it(world, factory, marker):
    """A change published while a blind tunnel is being decided and dialled (here: a reload
    that denies its host lands during its DNS lookup) applies to it: the CONNECT still gets
    its 200 (decided before), and the first bytes through it end it (policy_changed)."""
    import threading
    world.dns.set("slowdial.test", fixed("127.0.0.1"))
    e = factory.start(lambda c: c["policy"]["allow_hosts"].append("slowdial.test"))
    got = {}

    def connect():
        got["c"], got["r"] = helpers.proxy_connect(e.proxy_port, f"slowdial.test:{world.U}",
                                                   world.auth(), timeout=30)
    world.dns.mute = True
    t = threading.Thread(target=connect)
    try:
        t.start()
        helpers.poll(lambda: any(q.name == "slowdial.test" for q in world.dns.log), 10.0,
                     "the tunnel's lookup to be on its way")
        e.rewrite_config(lambda c: c["policy"].__setitem__("deny_hosts", ["slowdial.test"]))
        e.reload()
    finally:
        world.dns.mute = False  # c-ares asks again (after half of dns_timeout) and is answered
        t.join(30)
    assert got["r"].status == 200, (got["r"].status, got["r"].egress_reason)
    ctx = ssl.create_default_context(cafile=world.pki.ca)
    ctx.check_hostname = False
    try:
        tc = helpers.Conn(ctx.wrap_socket(got["c"].sock, server_hostname="slowdial.test"))
        r = helpers.request(tc, "GET", f"/echo/{marker}-late", f"api.test:{world.U}")
        status = r.status
    except (ConnectionError, ssl.SSLError, OSError, ValueError):
        status = None
    got["c"].close()
    assert status is None, status
    assert not world.upstream.find(f"{marker}-late")
    assert e.wait_audit(lambda x: x.get("reason") == "policy_changed"
                        and x.get("host") == "slowdial.test")


def test_a_first_flight_sent_after_a_reload_denied_the_tunnel_is_not_relayed(world, factory,
                                                                           marker):
    """A tunnel whose CONNECT was answered before a reload denied its host: the client's
    first bytes, sent after the reload, are not relayed (the first flight is checked like
    every later read) and the tunnel ends, audited policy_changed."""
    P = world.plain.port
    e = factory.start()
    c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{P}", world.auth())
    assert r.status == 200
    e.rewrite_config(lambda cfg: cfg["policy"].__setitem__("deny_hosts", ["tunnel.test"]))
    e.reload()
    c.send(f"POST /echo/{marker}-late HTTP/1.1\r\nHost: tunnel.test:{P}\r\n"
           f"Content-Length: 5\r\n\r\nhello".encode())
    assert helpers.poll(lambda: helpers.closed_by_peer(c), 5.0, "the tunnel to end")
    c.close()
    assert not world.upstream.find(f"{marker}-late")
    rec = e.wait_audit(lambda x: x.get("reason") == "policy_changed")
    assert rec[-1]["bytes_in"] == 0, rec[-1]


def test_port_not_allowed_403(world, egressd):
    port = free_port()
    while port in egressd.config["policy"]["allowed_ports"]:
        port = free_port()
    connect_refused(egressd, f"tunnel.test:{port}", world.auth(), 403, "port_not_allowed")
    connect_refused(egressd, "tunnel.test:22", world.auth(), 403, "port_not_allowed")
    audited(egressd, "port_not_allowed", 403)


def test_denied_addresses_403(world, egressd):
    # deny.test resolves to 127.0.0.2: loopback, and only 127.0.0.1/32 is an exception
    connect_refused(egressd, f"deny.test:{world.U}", world.auth(), 403, "denied_address:loopback")
    audited(egressd, "denied_address:loopback", 403)
    connect_refused(egressd, f"meta.test:{world.U}", world.auth(), 403, "denied_address:",
                    prefix=True)


def test_self_connection_403(world, egressd):
    for port in (egressd.proxy_port, egressd.admin_port):
        connect_refused(egressd, f"self.test:{port}", world.auth(), 403, "self_connection")
    audited(egressd, "self_connection", 403)
    # egressd is still serving afterwards (no loop through itself)
    assert egressd.admin_get("/healthz")[0] == 200


def test_dns_failure_502(world, egressd):
    """A name the resolver does not know (the tests' loopback DNS server answers NXDOMAIN;
    no lookup leaves the machine) is 502 dns_failure."""
    name = "nx-egressd-test.invalid"  # allowed in the test config, resolvable nowhere
    connect_refused(egressd, f"{name}:{world.U}", world.auth(), 502, "dns_failure")
    audited(egressd, "dns_failure", 502)
    assert any(q.name == name for q in world.dns.log), "the lookup did not go to the test's DNS"



def test_the_name_allowed_is_the_name_looked_up_whatever_the_search_domains(world, factory):
    """resolv.conf's search domains do not apply (LOCALDOMAIN stands in for a `search` line,
    RES_OPTIONS ndots:5 is what Kubernetes pods get): an allowed name whose own answer is
    refused is refused, not served from <name>.<search zone>; an allowed name that does not
    exist is 502 dns_failure, not the search zone's answer; no query names the zone."""
    world.dns.set("sd-victim.test", fixed("127.0.0.2"))  # loopback outside allow_networks
    world.dns.set("sd-victim.test.corp.test", fixed("127.0.0.1"))
    world.dns.set("sd-missing.test.corp.test", fixed("127.0.0.1"))

    def mutate(cfg):
        cfg["policy"]["allow_hosts"] += ["sd-victim.test", "sd-missing.test"]
    e = factory.make(mutate)
    e.extra_env = {"LOCALDOMAIN": "corp.test", "RES_OPTIONS": "ndots:5"}
    e.start()
    factory.started.append(e)
    connect_refused(e, f"sd-victim.test:{world.U}", world.auth(), 403,
                    "denied_address:loopback")
    connect_refused(e, f"sd-missing.test:{world.U}", world.auth(), 502, "dns_failure")
    asked = [q.name for q in world.dns.log]
    assert "sd-victim.test" in asked and "sd-missing.test" in asked, asked[-10:]
    assert not [n for n in asked if n.endswith("corp.test")], asked[-10:]


def test_connect_failed_502(world, egressd, marker):
    # unpinned tunnel to a closed port: refused at CONNECT
    connect_refused(egressd, f"tunnel.test:{world.closed_port}", world.auth(), 502,
                    "connect_failed")
    # pinned host on a closed port: refused at CONNECT or inside the tunnel
    r = in_tunnel(egressd, world, "down.test", world.closed_port, path=f"/echo/{marker}")
    assert_refusal(r, 502, "connect_failed")
    audited(egressd, "connect_failed", 502)


def test_upstream_tls_timeout_504(world, egressd):
    t0 = time.monotonic()
    r = in_tunnel(egressd, world, "slow.test", world.silent.port)
    assert_refusal(r, 504, "upstream_tls_timeout")
    assert time.monotonic() - t0 < 8, "tls_timeout is 3s"
    audited(egressd, "upstream_tls_timeout", 504)


def test_upstream_tls_failed_502(world, egressd, marker):
    # upstream cert signed by a CA egressd does not trust
    r = in_tunnel(egressd, world, "bad.test", world.bad.port, path=f"/echo/{marker}")
    assert_refusal(r, 502, "upstream_tls_failed")
    assert world.bad.find(marker) == [], "a request went to an unverified upstream"
    # trusted CA, but the certificate does not name wrongname.test
    r = in_tunnel(egressd, world, "wrongname.test", world.U, path=f"/echo/{marker}")
    assert_refusal(r, 502, "upstream_tls_failed")
    assert world.upstream.find(marker) == []
    audited(egressd, "upstream_tls_failed", 502)


# ---------------------------------------------------------------------------------------------
# inside the tunnel


def test_host_mismatch_421(world, egressd, marker):
    r = in_tunnel(egressd, world, "api.test", world.U, path=f"/echo/{marker}-1",
                  host_header=f"other.test:{world.U}")
    assert_refusal(r, 421, "host_mismatch")
    # port included: Host without a port means 443, not the CONNECT port
    r = in_tunnel(egressd, world, "api.test", world.U, path=f"/echo/{marker}-2",
                  host_header="api.test")
    assert_refusal(r, 421, "host_mismatch")
    # curl, with a Host header that disagrees with the URL
    res = curl_via(world, egressd, f"https://api.test:{world.U}/echo/{marker}-3", "-i",
                   "--suppress-connect-headers",
                   "-H", f"Host: other.test:{world.U}")
    assert res.stdout.startswith(b"HTTP/1.1 421"), res.stdout[:200] + res.stderr
    assert world.upstream.find(marker) == [], "nothing may be forwarded on a host mismatch"
    audited(egressd, "host_mismatch", 421)


def test_sni_mismatch_421(world, egressd, marker):
    try:
        r = in_tunnel(egressd, world, "api.test", world.U, path=f"/echo/{marker}",
                      sni="other.test", check_hostname=False)
    except (ssl.SSLError, ConnectionError) as ex:
        pytest.fail(f"expected a 421 response inside the tunnel, TLS failed instead: {ex}")
    assert_refusal(r, 421, "sni_mismatch")
    assert world.upstream.find(marker) == []
    audited(egressd, "sni_mismatch", 421)


def test_an_absolute_target_in_a_tunnel_is_recorded_by_its_path_only(world, egressd, marker):
    """Inside an intercepted tunnel an absolute-form target is refused (400
    bad_request_target); its record names the path only, as the forward port's refusals do:
    never the target's scheme and authority, the client's userinfo among them."""
    mark = audit_mark(egressd)
    c = helpers.tunnel(egressd.proxy_port, "api.test", world.U, world.auth(), run_ca(egressd, "r1"))
    try:
        r = helpers.request(c, "GET", f"http://user:pw@other.test/echo/{marker}",
                            f"api.test:{world.U}")
    finally:
        c.close()
    assert_refusal(r, 400, "bad_request_target")
    rec = one_record_since(egressd, mark, 400, "bad_request_target")
    assert rec["path"] == f"/echo/{marker}", rec


def test_a_plain_http_first_request_in_a_blind_tunnel_must_name_the_connect_host(world,
                                                                                egressd,
                                                                                marker):
    """A blind tunnel to a plain-text port: a first request whose Host is another host (a CDN
    routes plain HTTP by Host alone: fronting) is answered 421 host_mismatch and nothing goes
    upstream, as absolute-form would answer; one naming the CONNECT host passes, also with a
    first flight longer than a ClientHello may be (a body behind the head: it had been
    refused as bad_client_hello)."""
    P = world.plain.port

    def first_flight(data: bytes) -> helpers.Response:
        c, r = helpers.proxy_connect(egressd.proxy_port, f"tunnel.test:{P}", world.auth())
        assert r.status == 200, (r.status, r.egress_reason)
        try:
            c.send(data)
            return helpers.read_response(c)
        finally:
            c.close()
    mark = audit_mark(egressd)
    r = first_flight(f"GET /echo/{marker}-front HTTP/1.1\r\nHost: forbidden.example\r\n"
                     f"Connection: close\r\n\r\n".encode())
    assert_refusal(r, 421, "host_mismatch")
    assert not world.upstream.find(f"{marker}-front")
    rec = one_record_since(egressd, mark, 421, "host_mismatch")
    assert rec["host"] == "tunnel.test", rec
    for host in ("forbidden.example", None):  # a Host given twice, or none
        fields = f"Host: tunnel.test:{P}\r\n" + (f"Host: {host}\r\n" if host else "")
        if host is None:
            fields = ""
        r = first_flight(f"GET /echo/{marker}-x HTTP/1.0\r\n{fields}\r\n".encode())
        assert_refusal(r, 421, "host_mismatch")
    assert not world.upstream.find(f"{marker}-x")
    # Shaped past the parser, as a CDN would still route them: empty lines first (servers
    # skip them), an absolute-form target naming another host (it overrides Host), bare LF
    # line ends, a field name that is no token, doubled separators. Each is refused, nothing
    # relayed.
    for i, shaped in enumerate((
            f"\r\n\r\nGET /echo/{marker}-s0 HTTP/1.1\r\nHost: forbidden.example\r\n\r\n",
            f"GET http://forbidden.example/echo/{marker}-s1 HTTP/1.1\r\n"
            f"Host: tunnel.test:{P}\r\n\r\n",
            f"GET /echo/{marker}-s2 HTTP/1.1\nHost: forbidden.example\n\n",
            f"GET /echo/{marker}-s3 HTTP/1.1\r\nHost: forbidden.example\r\nX@Y: 1\r\n\r\n",
            f"GET /echo/{marker}-s4 HTTP/1.1\r\nHost: tunnel.test:{P}\r\nX@Y: 1\r\n\r\n",
            # Runs of SP or HTAB between the parts (nginx, HAProxy and the test upstream
            # read them as one separator).
            f"GET  /echo/{marker}-s5 HTTP/1.1\r\nHost: forbidden.example\r\n\r\n",
            f"GET /echo/{marker}-s6  HTTP/1.1\r\nHost: forbidden.example\r\n\r\n",
            f"GET\t/echo/{marker}-s7 HTTP/1.1\r\nHost: forbidden.example\r\n\r\n",
            # A blank inside the target (lenient parsers take it), blanks after the version.
            f"GET /echo/{marker}-s8\tx HTTP/1.1\r\nHost: forbidden.example\r\n\r\n",
            f"GET /echo/{marker}-s9 HTTP/1.1 \r\nHost: forbidden.example\r\n\r\n")):
        r = first_flight(shaped.encode())
        assert_refusal(r, 421, "host_mismatch")
        assert not world.upstream.find(f"{marker}-s{i}"), i
    # Another protocol's first line (SMTP's EHLO) is no request line: relayed as it is (the
    # HTTP upstream answers it with an error page of its own, not egressd's 421).
    c, r = helpers.proxy_connect(egressd.proxy_port, f"tunnel.test:{P}", world.auth())
    assert r.status == 200
    c.send(b"EHLO sandbox.example\r\n")
    c.sock.settimeout(5)
    got = c.sock.recv(200)
    c.close()
    assert got and not got.startswith(b"HTTP/1.1 421"), got  # the upstream's own answer
    body = b"b" * 40000
    r = first_flight(f"POST /echo/{marker}-ok HTTP/1.1\r\nHost: tunnel.test:{P}\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                     + body)
    assert r.status == 200, (r.status, r.egress_reason)
    assert json.loads(r.body)["body_length"] == len(body)


def test_forged_egress_header_403(world, egressd, marker):
    r = in_tunnel(egressd, world, "api.test", world.U, path=f"/echo/{marker}",
                  headers=[("X-Egress-Run", "r2")])
    assert_refusal(r, 403, "forged_egress_header")
    with requests_session(world, egressd) as s:
        rr = s.get(f"https://api.test:{world.U}/echo/{marker}", headers={"x-egress-foo": "1"},
                   timeout=30)
    assert rr.status_code == 403
    assert rr.headers.get("X-Egress-Reason") == "forged_egress_header"
    assert world.upstream.find(marker) == []
    audited(egressd, "forged_egress_header", 403)


def test_no_matching_pin_403(world, egressd, marker):
    # lim.test's pin allows GET under /echo only
    r = in_tunnel(egressd, world, "lim.test", world.U, path=f"/bytes/10?{marker}")
    assert_refusal(r, 403, "no_matching_pin")
    r = in_tunnel(egressd, world, "lim.test", world.U, method="POST", path=f"/echo/{marker}",
                  body=b"x")
    assert_refusal(r, 403, "no_matching_pin")
    # the prefix "/echo" is a whole segment: "/echoX" is another path
    r = in_tunnel(egressd, world, "lim.test", world.U, path=f"/echoX/{marker}")
    assert_refusal(r, 403, "no_matching_pin")
    # headers by which some servers take another method or path than the request line's
    for name, value in (("X-HTTP-Method-Override", "DELETE"), ("X-Method-Override", "POST"),
                        ("X-Original-URL", "/admin/delete"), ("X-Rewrite-URL", "/bytes/10")):
        r = in_tunnel(egressd, world, "lim.test", world.U, path=f"/echo/{marker}",
                      headers=[(name, value)])
        assert_refusal(r, 403, "no_matching_pin")
    r = in_tunnel(egressd, world, "lim.test", world.U, path=f"/echo/{marker}?_method=DELETE")
    assert_refusal(r, 403, "no_matching_pin")
    assert world.upstream.find(marker) == []
    # an override within the pin's limits is no reason to refuse
    r = in_tunnel(egressd, world, "lim.test", world.U, path=f"/echo/{marker}-within",
                  headers=[("X-HTTP-Method-Override", "GET"), ("X-Original-URL", "/echo/y")])
    assert r.status == 200
    r = in_tunnel(egressd, world, "lim.test", world.U, path=f"/echo/{marker}-ok")
    assert r.status == 200
    [up] = world.upstream.find(marker + "-ok")
    assert up.header("Authorization") == [f"Bearer {world.secrets['lim_token']}"]
    audited(egressd, "no_matching_pin", 403, host="lim.test")


def test_bad_request_400(world, egressd):
    # malformed request line inside the tunnel
    c, r = helpers.proxy_connect(egressd.proxy_port, f"api.test:{world.U}", world.auth())
    assert r.status == 200
    t = helpers.tls_wrap(c, "api.test", run_ca(egressd, "r1"))
    t.send(b"THIS IS NOT HTTP\r\n\r\n")
    assert_refusal(helpers.read_response(t), 400, "bad_request")
    t.close()
    # malformed request line on the proxy port itself
    s = socket.create_connection(("127.0.0.1", egressd.proxy_port), timeout=10)
    c = helpers.Conn(s)
    c.send(b"GARBAGE\r\n\r\n")
    assert_refusal(helpers.read_response(c), 400, "bad_request")
    c.close()
    # CONNECT without a port
    c, r = helpers.proxy_connect(egressd.proxy_port, "api.test", world.auth())
    c.close()
    assert r.status == 400, r
    audited(egressd, "bad_request", 400)


def test_data_before_connect_response_is_the_answer_to_the_connect(world, egressd):
    # A ClientHello pipelined behind a CONNECT to an intercepted host cannot be handed to TLS:
    # the refusal answers the CONNECT itself (after a 200 the client would only see a TLS error).
    s = socket.create_connection(("127.0.0.1", egressd.proxy_port), timeout=10)
    c = helpers.Conn(s)
    c.send(f"CONNECT api.test:{world.U} HTTP/1.1\r\nHost: api.test:{world.U}\r\n"
           f"Proxy-Authorization: {world.auth()}\r\n\r\n".encode() + b"\x16\x03\x01\x00\x05hello")
    r = helpers.read_response(c)
    c.close()
    assert_refusal(r, 400, "data_before_connect_response")
    audited(egressd, "data_before_connect_response", 400)


def test_oversized_header_refused(world, egressd, marker):
    r = in_tunnel(egressd, world, "api.test", world.U, path=f"/echo/{marker}",
                  headers=[("X-Big", "a" * 70000)])
    assert r.status in (400, 431), r
    assert world.upstream.find(marker) == []


def test_slow_request_head_times_out(world, egressd):
    # header_timeout is 5s: a client that never finishes its head is cut off
    s = socket.create_connection(("127.0.0.1", egressd.proxy_port), timeout=15)
    s.settimeout(15)
    s.sendall(b"CONNECT api.test:443 HTTP/1.1\r\nHost: api")
    t0 = time.monotonic()
    data = b""
    for _ in range(1000):
        try:
            b = s.recv(4096)
        except (socket.timeout, ConnectionResetError):
            break
        if not b:
            break
        data += b
    s.close()
    took = time.monotonic() - t0
    assert took < 12, f"connection still open {took:.1f}s after a stalled head"
    assert data == b"" or data.startswith(b"HTTP/1.1 408") or data.startswith(b"HTTP/1.1 400"), data


def test_egressd_still_healthy(egressd):
    assert egressd.alive()
    assert egressd.admin_get("/healthz")[0] == 200
