"""Adversarial suite (issue #6): one case per attack, each held to the same five assertions
(see adversarial_helpers): (a) the refusal, status + X-Egress-Reason (h2: the stream's response
or RST_STREAM; TLS: the handshake fails) and, after an HTTP/1.1 framing error, a closed
connection; (b) nothing injected (the upstreams saw nothing from the attack); (c) one audit
record per refused attempt; (d) egressd_denied_total{reason} grew by as much; (e) well-behaved
HTTP/1.1 and HTTP/2 clients of another run were served throughout, credential injected.

Loopback only. Names resolve through resolver.overrides (api.test, ...) or through a scripted
DNS server on 127.0.0.1 (dns_server.py: *.ssrf.test, rebinding, mixed answers). Denied
addresses are refused by egressd before it connects: that is what the SSRF cases test.

Cases whose right outcome is "served, sanitised" (a client-sent Authorization replaced, a
redirect, cleartext) use the same checks with decision "allow" and an exact expectation of
what the upstream received.
"""
from __future__ import annotations

import os
import re
import secrets as pysecrets
import socket
import ssl
import subprocess
import threading
import time

import pytest

import helpers
from adversarial_helpers import (Arena, Case, Ctx, GoodClients, Obs, b64, exchange,
                                 openssl_s_client, recv_closed)
from dns_server import DnsServer, fixed, rebinding
from h2_helpers import h2up  # noqa: F401 (module fixture)

PROTOCOL_ERROR = 1
INTERNAL_ERROR = 2

# ---------------------------------------------------------------------------------------------
# SSRF table: name (under ssrf.test) -> DNS answer -> the address class egressd must refuse

SSRF = [
    ("loopback-127-0-0-2", ["127.0.0.2"], "loopback"),
    ("loopback-v6", ["::1"], "loopback"),
    ("private-10", ["10.1.2.3"], "private"),
    ("private-172-16", ["172.16.5.4"], "private"),
    ("private-192-168", ["192.168.0.1"], "private"),
    ("cgnat-100-64", ["100.64.0.1"], "carrier_nat"),
    ("link-local-v4", ["169.254.10.10"], "link_local"),
    ("link-local-v6", ["fe80::1"], "link_local"),
    ("ula-fc00", ["fc00::1"], "unique_local"),
    ("ula-fd00", ["fd12:3456::1"], "unique_local"),
    ("unspecified-v4", ["0.0.0.0"], "unspecified"),
    ("this-network-0-x", ["0.1.2.3"], "unspecified"),
    ("unspecified-v6", ["::"], "unspecified"),
    ("multicast-v4", ["224.0.0.1"], "multicast"),
    ("multicast-v6", ["ff02::1"], "multicast"),
    ("reserved-240", ["240.0.0.1"], "reserved"),
    ("broadcast", ["255.255.255.255"], "reserved"),
    ("test-net-1", ["192.0.2.1"], "reserved"),
    ("benchmark-198-18", ["198.18.0.1"], "reserved"),
    ("documentation-v6", ["2001:db8::1"], "reserved"),
    ("metadata-aws-gcp", ["169.254.169.254"], "metadata"),
    ("metadata-aws-v6", ["fd00:ec2::254"], "metadata"),
    ("metadata-alibaba", ["100.100.100.200"], "metadata"),
    ("metadata-azure", ["168.63.129.16"], "metadata"),
    ("metadata-gcp-v6", ["fd20:ce::254"], "metadata"),
    ("metadata-oracle-v6", ["fd00:c1::a9fe:a9fe"], "metadata"),
    ("metadata-tencent", ["169.254.0.23"], "metadata"),
    ("v4-mapped-loopback", ["::ffff:127.0.0.2"], "loopback"),
    ("v4-mapped-private", ["::ffff:10.0.0.1"], "private"),
    ("v4-mapped-metadata", ["::ffff:169.254.169.254"], "metadata"),
    ("v4-compatible-private", ["::10.0.0.1"], "private"),
    ("nat64-private", ["64:ff9b::a00:1"], "private"),
    ("nat64-metadata", ["64:ff9b::a9fe:a9fe"], "metadata"),
    ("nat64-local-use-private", ["64:ff9b:1:a00:0:100::"], "private"),  # RFC 8215 /48
    ("6to4-private", ["2002:a00:1::1"], "private"),
    ("6to4-loopback", ["2002:7f00:2::1"], "loopback"),
    ("teredo-private", ["2001::f5ff:fffe"], "private"),      # client 10.0.0.1, inverted
    ("teredo-metadata", ["2001::5601:5601"], "metadata"),    # client 169.254.169.254
    ("mixed-allowed-and-private", ["127.0.0.1", "10.0.0.1"], "private"),
    ("mixed-allowed-v4-and-ula-v6", ["127.0.0.1", "fd00::1"], "unique_local"),
    ("mixed-allowed-and-metadata", ["127.0.0.1", "169.254.169.254"], "metadata"),
]


# ---------------------------------------------------------------------------------------------
# fixtures: one egressd for the module, with a DNS server and good clients


@pytest.fixture(scope="module")
def dns():
    d = DnsServer()
    for name, answer, _ in SSRF:
        d.set(f"{name}.ssrf.test", fixed(*answer))
    d.set("self.ssrf.test", fixed("127.0.0.1"))
    d.set("pinned.ssrf.test", fixed("10.9.8.7"))
    d.set("metadata.google.internal", fixed("169.254.169.254"))
    d.set("*.wild.test", fixed("127.0.0.1"))
    yield d
    d.close()


@pytest.fixture(scope="module")
def good_secret(world) -> str:
    v = "sk-itest-good-" + pysecrets.token_hex(16)
    p = os.path.join(world.tmp, "secrets", "good_token")
    with open(p, "w") as f:
        f.write(v)
    os.chmod(p, 0o600)
    world.secrets["good_token"] = v
    world.secret_files["good_token"] = p
    return v


def arena_mutate(world, h2up, dns, limits: dict | None = None):
    def mutate(cfg):
        U, H = world.U, h2up.port
        wd = os.path.dirname(cfg["audit"]["path"])
        sf = world.secret_files
        r1 = cfg["runs"][0]
        r1["pins"] += [
            {"host": f"api.test:{H}", "secret_file": sf["api_token"], "inject": {"type": "bearer"}},
            {"host": f"*.wild.test:{U}", "secret_file": sf["api_token"],
             "inject": {"type": "bearer"}},
            {"host": f"pinned.ssrf.test:{U}", "secret_file": sf["api_token"],
             "inject": {"type": "bearer"}},
        ]
        tok = os.path.join(wd, "good.token")
        with open(tok, "w") as f:
            f.write(world.tokens["good"])
        os.chmod(tok, 0o600)
        cfg["runs"].append({
            "id": "good", "token_file": tok, "ca_cert_out": os.path.join(wd, "good-ca.pem"),
            "allow_hosts": [],
            "pins": [{"host": f"api.test:{U}", "secret_file": sf["good_token"],
                      "inject": {"type": "bearer"}},
                     {"host": f"api.test:{H}", "secret_file": sf["good_token"],
                      "inject": {"type": "bearer"}}]})
        cfg["resolver"]["servers"] = [dns.address]
        cfg["policy"]["allow_hosts"] += [
            "*.ssrf.test", "metadata.google.internal", "0.0.0.0", "[::ffff:a9fe:a9fe]",
            "[64:ff9b::a9fe:a9fe]", "[::ffff:127.0.0.1]"]
        cfg["policy"]["allowed_ports"] = sorted(set(cfg["policy"]["allowed_ports"]) | {H})
        cfg["limits"].update({"header_timeout": "1s", "idle_timeout": "3s",
                              "connections_per_run": 8})
        if limits:
            cfg["limits"].update(limits)
    return mutate


def start_arena(factory, world, h2up, dns, good_secret, limits=None) -> Arena:
    world.tokens.setdefault("good", "tokg-" + pysecrets.token_hex(12))
    mutate = arena_mutate(world, h2up, dns, limits)
    probe = factory.make(mutate)
    chk = probe.check()
    if chk.returncode != 0:
        pytest.fail(f"egressd --check refused the arena config (limits {limits}): "
                    f"{(chk.stdout + chk.stderr)[-1500:]}", pytrace=False)
    e = factory.start(mutate)
    s = world.secrets
    r1 = {k: s[k] for k in ("api_token", "basic_pw", "hdr_key", "lim_token", "plain_token")}
    r1["basic_pw_b64"] = b64(f"itest-user:{s['basic_pw']}")
    for run, tok in world.tokens.items():  # proxy tokens never leave either
        if run != "good":
            r1[f"proxy_token_{run}"] = tok
    a = Arena(e, world, h2up, dns, r1, good_secret)
    ca = next(r["ca_cert_out"] for r in e.config["runs"] if r["id"] == "good")
    a.good = GoodClients(e, "good", world.tokens["good"], ca,
                         f"https://api.test:{world.U}", f"https://api.test:{h2up.port}")
    a.good.start()
    return a


def leak_check(a: Arena):
    """Everything egressd wrote (audit, logs, stderr, state): no secret, in any encoding."""
    rc = a.e.stop()
    values = dict(a.w.secrets, **a.extra_secrets)
    values.update({f"proxy_token_{r}": t for r, t in a.w.tokens.items()})
    needles = {}
    for name, v in values.items():
        needles[name] = v.encode()
        needles[name + "(b64)"] = b64(v).encode()
    needles["basic(b64)"] = b64(f"itest-user:{a.w.secrets['basic_pw']}").encode()
    found = []
    for p in a.e.written_files():
        with open(p, "rb") as f:
            data = f.read()
        for name, n in needles.items():
            if n and n in data:
                found.append((os.path.basename(p), name))
    assert rc == 0, f"egressd exit status {rc} after SIGTERM"
    assert found == [], f"secret bytes in files egressd wrote: {found}"


@pytest.fixture(scope="module")
def arena(factory, world, h2up, dns, good_secret):
    a = start_arena(factory, world, h2up, dns, good_secret)
    yield a
    a.good.stop()
    leak_check(a)


def run_case(a: Arena, case: Case):
    m = re.sub(r"[^a-z0-9-]", "-", case.id.lower())[:40] + "-" + os.urandom(3).hex()
    ctx = Ctx(a, case, m)
    if case.prepare:
        case.prepare(ctx)
    snap = a.snapshot()
    obs = case.attack(ctx)
    a.verify(case, obs, snap, ctx)


# ---------------------------------------------------------------------------------------------
# request builders


def req(c: Ctx, method="GET", path=None, host=None, extra="", body=b"", version="HTTP/1.1"):
    path = path or f"/echo/{c.m}"
    host = host if host is not None else f"api.test:{c.U}"
    head = f"{method} {path} {version}\r\n"
    if host != "":
        head += f"Host: {host}\r\n"
    return head + extra + "\r\n" + (body.decode("latin-1") if isinstance(body, bytes) else body)


def tun(build, host="api.test", port="U", sni=None, check_hostname=True, smuggle=False):
    """An attack inside an intercepted tunnel: CONNECT host:port (r1), TLS, raw bytes."""
    def attack(c: Ctx):
        p = getattr(c, port) if isinstance(port, str) else port
        data = build(c)
        if smuggle:
            data += c.smuggled(f"{host}:{p}")
        return c.in_tunnel(host, p, data, sni=sni, check_hostname=check_hostname)
    return attack


def con(target, run="r1", auth=None, extra=""):
    """An attack at CONNECT time: the target is a function of the context."""
    def attack(c: Ctx):
        a = auth(c) if callable(auth) else auth
        return c.connect_obs(target(c), run, a, extra(c) if callable(extra) else extra)
    return attack


def plain(build):
    """An absolute-form request on the proxy port (identity r1)."""
    def attack(c: Ctx):
        return c.proxy_raw(build(c))
    return attack


def pa(c: Ctx, run="r1") -> str:
    return f"Proxy-Authorization: {c.auth(run)}\r\n"


def h2case(hdrs, host="api.test", port="H2", sni=None, body=None):
    def attack(c: Ctx):
        p = getattr(c, port)
        raw = c.h2(host, p, sni=sni, check_hostname=sni is None)
        try:
            _, obs = c.h2_request(raw, hdrs(c), body=body)
            return obs
        finally:
            raw.c.close()
    return attack


def host_switch_keep_alive(c: Ctx) -> Obs:
    """A first, well-formed request; the second one on the same connection names another
    pinned host (the check is per request, not per connection)."""
    t = c.tls("api.test", c.U)
    try:
        r = helpers.request(t, "GET", f"/echo/{c.m}-first", f"api.test:{c.U}")
        o = exchange(t, req(c, host=f"basic.test:{c.U}").encode(), False)
        if r.status != 200:
            o.problems.append(f"first request -> {r.status}")
        return o
    finally:
        t.close()


def h2_second_stream_switch(c: Ctx) -> Obs:
    raw = c.h2("api.test", c.H2)
    try:
        _, first = c.h2_request(raw, c.h2_base(f"/echo/{c.m}-first"))
        _, o = c.h2_request(raw, c.h2_base(f"/echo/{c.m}", f"hdr.test:{c.H2}"))
        if first.status != 200:
            o.problems.append(f"first stream -> {first.status} {first.reason}")
        return o
    finally:
        raw.c.close()


def cases_host_binding() -> list[Case]:
    C = []
    # --- HTTP/1.1 inside the tunnel: Host against the CONNECT target
    C += [
        Case("host-header-other-pinned-host",
             tun(lambda c: req(c, host=f"basic.test:{c.U}")), 421, "host_mismatch"),
        Case("host-header-default-port",
             tun(lambda c: req(c, host="api.test")), 421, "host_mismatch"),
        Case("host-header-port-pivot",
             tun(lambda c: req(c, host=f"api.test:{c.P}")), 421, "host_mismatch"),
        Case("host-header-ip-literal",
             tun(lambda c: req(c, host=f"127.0.0.1:{c.U}")), 421, "host_mismatch"),
        Case("host-header-userinfo",
             tun(lambda c: req(c, host=f"x@api.test:{c.U}")), 400, "bad_host"),
        Case("host-header-double-trailing-dot",
             tun(lambda c: req(c, host=f"api.test..:{c.U}")), 400, "bad_host"),
        Case("host-header-decimal-ip",
             tun(lambda c: req(c, host=f"2130706433:{c.U}")), 400, "bad_host"),
        Case("host-header-trailing-junk",
             tun(lambda c: req(c, host=f"api.test:{c.U}/evil")), 400, "bad_host"),
        Case("host-header-switch-on-keep-alive", host_switch_keep_alive, 421, "host_mismatch",
             upstream=upstream_only(lambda c: [("h1", f"/echo/{c.m}-first",
                                                {"Authorization": bearer(c)})])),
        Case("host-header-missing",
             tun(lambda c: req(c, host="")), 400, "missing_host"),
        Case("host-header-duplicate",
             tun(lambda c: req(c, extra=f"Host: other.test:{c.U}\r\n"), smuggle=True),
             400, "duplicate_host", closed=True),
        Case("absolute-form-in-tunnel",
             tun(lambda c: req(c, path=f"https://other.test:{c.U}/echo/{c.m}"), smuggle=True),
             400, "bad_request_target", closed=True),
        Case("connect-inside-tunnel",
             tun(lambda c: req(c, "CONNECT", f"other.test:{c.U}", f"other.test:{c.U}"),
                 smuggle=True), 400, "bad_request_target", closed=True),
        # SNI against the CONNECT target
        Case("sni-other-unpinned-host",
             tun(lambda c: req(c), sni="other.test", check_hostname=False), 421, "sni_mismatch"),
        Case("sni-other-pinned-host",
             tun(lambda c: req(c), sni="basic.test", check_hostname=False), 421, "sni_mismatch"),
        Case("sni-punycode-lookalike",
             tun(lambda c: req(c), sni="xn--pi-6kc.test", check_hostname=False),
             421, "sni_mismatch"),
    ]
    # --- CONNECT target tricks
    C += [
        Case("connect-userinfo", con(lambda c: f"user:pw@api.test:{c.U}"),
             400, "bad_request_target", closed=True),
        Case("connect-idn-utf8", con(lambda c: f"\u0430pi.test:{c.U}"),
             400, "bad_request_target", closed=True),
        Case("connect-punycode-lookalike", con(lambda c: f"xn--pi-6kc.test:{c.U}"),
             403, "host_not_allowed", closed=True),
        Case("connect-port-pivot", con(lambda c: "api.test:22"),
             403, "port_not_allowed", closed=True),
        Case("connect-port-zero", con(lambda c: "api.test:0"),
             400, "bad_request_target", closed=True),
        Case("connect-port-wraparound", con(lambda c: f"api.test:{c.U + 65536}"),
             400, "bad_request_target", closed=True),
        Case("connect-fragment", con(lambda c: f"api.test:{c.U}#@other.test"),
             400, "bad_request_target", closed=True),
        Case("connect-ipv6-zone-id", con(lambda c: f"[fe80::1%25eth0]:{c.U}"),
             400, "bad_request_target", closed=True),
        Case("connect-double-trailing-dot", con(lambda c: f"api.test..:{c.U}"),
             400, "bad_request_target", closed=True),
        # wildcard edges: *.wild.test is pinned
        Case("wildcard-apex", con(lambda c: f"wild.test:{c.U}"),
             403, "host_not_allowed", closed=True),
        Case("wildcard-apex-trailing-dot", con(lambda c: f"wild.test.:{c.U}"),
             403, "host_not_allowed", closed=True),
        Case("wildcard-apex-uppercase", con(lambda c: f"WILD.Test:{c.U}"),
             403, "host_not_allowed", closed=True),
        Case("wildcard-two-labels", con(lambda c: f"a.b.wild.test:{c.U}"),
             403, "host_not_allowed", closed=True),
        Case("wildcard-suffix-confusion", con(lambda c: f"evilwild.test:{c.U}"),
             403, "host_not_allowed", closed=True),
    ]
    # --- absolute-form on the proxy port
    C += [
        Case("absolute-form-host-header-disagrees",
             plain(lambda c: req(c, path=f"http://plain.test:{c.P}/echo/{c.m}",
                                 host=f"api.test:{c.U}", extra=pa(c))), 421, "host_mismatch"),
        Case("absolute-form-userinfo",
             plain(lambda c: req(c, path=f"http://api.test:{c.U}@plain.test:{c.P}/echo/{c.m}",
                                 host=f"plain.test:{c.P}", extra=pa(c))),
             400, "userinfo_in_uri", closed=True),
        Case("absolute-form-fragment",
             plain(lambda c: req(c, path=f"http://plain.test:{c.P}/echo/{c.m}#@api.test:{c.U}/",
                                 host=f"plain.test:{c.P}", extra=pa(c))),
             400, "not_a_proxy_request", closed=True),
        Case("absolute-form-https-scheme",
             plain(lambda c: req(c, path=f"https://api.test:{c.U}/echo/{c.m}",
                                 host=f"api.test:{c.U}", extra=pa(c))),
             400, "use_connect_for_https", closed=True),
        Case("absolute-form-decimal-ip",
             plain(lambda c: req(c, path=f"http://2130706433:{c.P}/echo/{c.m}",
                                 host=f"2130706433:{c.P}", extra=pa(c))),
             400, "bad_request_target", closed=True),
    ]
    # --- per HTTP/2 stream
    C += [
        Case("h2-authority-other-pinned-host",
             h2case(lambda c: c.h2_base(f"/echo/{c.m}", f"hdr.test:{c.H2}")), 421, "host_mismatch"),
        Case("h2-second-stream-other-pinned-host", h2_second_stream_switch,
             421, "host_mismatch",
             upstream=upstream_only(lambda c: [("h2", f"/echo/{c.m}-first",
                                                {"Authorization": bearer(c)})])),
        Case("h2-authority-default-port",
             h2case(lambda c: c.h2_base(f"/echo/{c.m}", "api.test")), 421, "host_mismatch"),
        Case("h2-authority-userinfo",
             h2case(lambda c: c.h2_base(f"/echo/{c.m}", f"x@api.test:{c.H2}")), 400, "bad_host"),
        Case("h2-host-header-disagrees",
             h2case(lambda c: c.h2_base(f"/echo/{c.m}") + [("host", f"other.test:{c.H2}")]),
             400, "host_authority_mismatch"),
        # nghttp2's messaging checks reset these streams before egressd sees the header; the
        # audit reason is bad_request, as the HTTP/1.1 parser gives for a message it rejects
        Case("h2-duplicate-host-header",
             h2case(lambda c: c.h2_base(f"/echo/{c.m}") + [("host", f"api.test:{c.H2}"),
                                                            ("host", f"other.test:{c.H2}")]),
             None, "bad_request", h2_reset=PROTOCOL_ERROR),
        Case("h2-sni-other-pinned-host",
             h2case(lambda c: c.h2_base(f"/echo/{c.m}"), sni="basic.test"), 421, "sni_mismatch"),
        Case("h2-absolute-uri-in-path",
             h2case(lambda c: c.h2_base(f"https://other.test:{c.H2}/echo/{c.m}")),
             None, "bad_request", h2_reset=PROTOCOL_ERROR),
        Case("h2-connect-method",
             h2case(lambda c: [(":method", "CONNECT"), (":authority", f"other.test:{c.H2}")]),
             405, "connect_in_tunnel"),
        Case("h2-scheme-http",
             h2case(lambda c: [(":method", "GET"), (":scheme", "http"),
                               (":authority", f"api.test:{c.H2}"), (":path", f"/echo/{c.m}")]),
             400, "bad_scheme"),
    ]
    return C


# ---------------------------------------------------------------------------------------------
# smuggling: every framing error is a 400, then the connection is closed; the request smuggled
# behind it is never answered nor forwarded


def post(c: Ctx, headers: str, body: str, path=None, host=None):
    return req(c, "POST", path or f"/echo/{c.m}", host, headers, body)


def cases_smuggling() -> list[Case]:
    S = []

    def sm(id_, build, reason="bad_request"):
        S.append(Case(id_, tun(build, smuggle=True), 400, reason, closed=True))

    sm("cl-and-te", lambda c: post(c, "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
                                   "0\r\n\r\n"))
    sm("te-and-cl", lambda c: post(c, "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
                                   "0\r\n\r\n"))
    sm("cl-duplicate-conflicting", lambda c: post(c, "Content-Length: 5\r\nContent-Length: 6\r\n",
                                                  "hello!"))
    sm("cl-comma-list", lambda c: post(c, "Content-Length: 5, 6\r\n", "hello!"))
    sm("cl-negative", lambda c: post(c, "Content-Length: -5\r\n", "hello"))
    sm("cl-plus-sign", lambda c: post(c, "Content-Length: +5\r\n", "hello"))
    sm("cl-overflow-wraps-to-5", lambda c: post(c, "Content-Length: 18446744073709551621\r\n",
                                                "hello"))
    sm("cl-hex", lambda c: post(c, "Content-Length: 0x5\r\n", "hello"))
    sm("te-gzip-chunked", lambda c: post(c, "Transfer-Encoding: gzip, chunked\r\n", "0\r\n\r\n"),
       "bad_transfer_encoding")
    sm("te-xchunked", lambda c: post(c, "Transfer-Encoding: xchunked\r\n", "0\r\n\r\n"),
       "bad_transfer_encoding")
    sm("te-chunked-identity", lambda c: post(c, "Transfer-Encoding: chunked, identity\r\n",
                                             "0\r\n\r\n"), "bad_transfer_encoding")
    sm("te-duplicate-header", lambda c: post(c, "Transfer-Encoding: chunked\r\n"
                                             "Transfer-Encoding: chunked\r\n", "0\r\n\r\n"))
    sm("te-space-before-colon", lambda c: post(c, "Transfer-Encoding : chunked\r\n",
                                               "0\r\n\r\n"))
    sm("te-vertical-tab", lambda c: post(c, "Transfer-Encoding:\x0bchunked\r\n", "0\r\n\r\n"))
    sm("te-obs-fold", lambda c: post(c, "Transfer-Encoding: gzip\r\n , chunked\r\n",
                                     "0\r\n\r\n"), "bad_transfer_encoding")
    sm("bare-lf-line-endings", lambda c: req(c).replace("\r\n", "\n"))
    sm("bare-cr-in-value", lambda c: req(c, extra="X-A: a\rb\r\n"))
    sm("nul-in-value", lambda c: req(c, extra="X-A: a\x00b\r\n"))
    sm("nul-in-name", lambda c: req(c, extra="X\x00A: b\r\n"))
    sm("space-in-header-name", lambda c: req(c, extra="X A: b\r\n"))
    sm("request-line-extra-token", lambda c: f"GET /echo/{c.m} HTTP/1.1 x\r\n"
                                             f"Host: api.test:{c.U}\r\n\r\n")
    sm("request-line-http09", lambda c: f"GET /echo/{c.m}\r\n\r\n")
    sm("request-line-space-in-target", lambda c: f"GET /echo/ {c.m} HTTP/1.1\r\n"
                                                 f"Host: api.test:{c.U}\r\n\r\n")
    sm("request-line-tab-separators", lambda c: f"GET\t/echo/{c.m}\tHTTP/1.1\r\n"
                                                f"Host: api.test:{c.U}\r\n\r\n")
    sm("request-line-bad-version", lambda c: req(c, version="HTTP/9.9"))
    # chunk framing: found while streaming the body, still a 400 and a closed connection
    for id_, body in [("chunk-size-overflow", "10000000000000005\r\nhello\r\n0\r\n\r\n"),
                      ("chunk-size-not-hex", "5g\r\nhello\r\n0\r\n\r\n"),
                      ("chunk-data-overrun", "3\r\nhello\r\n0\r\n\r\n")]:
        S.append(Case(id_, tun(lambda c, body=body: post(c, "Transfer-Encoding: chunked\r\n",
                                                          body), smuggle=True),
                      400, "bad_framing", closed=True))
    # on the proxy port itself (absolute-form, cleartext)
    S += [
        Case("proxy-port-cl-and-te",
             plain(lambda c: post(c, pa(c) + "Content-Length: 5\r\nTransfer-Encoding: chunked"
                                  "\r\n", "0\r\n\r\n", path=f"http://plain.test:{c.P}/echo/{c.m}",
                                  host=f"plain.test:{c.P}")
                   + f"GET http://plain.test:{c.P}/echo/{c.m}-smuggled HTTP/1.1\r\n"
                     f"Host: plain.test:{c.P}\r\n{pa(c)}\r\n"),
             400, "bad_request", closed=True),
        Case("proxy-port-garbage",
             plain(lambda c: "\x16\x03\x01\x02\x00 NOT HTTP\r\n\r\n"), 400, "bad_request",
             closed=True),
    ]
    # HTTP/2 -> HTTP/1.1 downgrade smuggling: the stream is reset by the codec
    S += [
        Case("h2-crlf-in-value-for-h1-upstream",
             h2case(lambda c: c.h2_base(f"/echo/{c.m}", f"api.test:{c.U}") +
                    [("x-evil", "a\r\nX-Injected: 1")], port="U"),
             None, "bad_request", h2_reset=PROTOCOL_ERROR),
        Case("h2-content-length-mismatch",
             h2case(lambda c: c.h2_base(f"/echo/{c.m}", f"api.test:{c.U}", "POST") +
                    [("content-length", "100")], port="U", body=b"x" * 10),
             None, "bad_framing", h2_reset=PROTOCOL_ERROR),
    ]
    return S


# ---------------------------------------------------------------------------------------------
# SSRF


def dns_queried(name):
    def attack(c: Ctx):
        obs = c.connect_obs(f"{name}:{c.U}")
        if not c.a.dns.queries(name):
            obs.problems.append(f"egressd never asked the DNS server for {name}")
        return obs
    return attack


def rebinding_attack(c: Ctx) -> Obs:
    name = "rebind.ssrf.test"
    # First lookup: an allowed address; the tunnel works (no credential: unpinned).
    conn, r = c.connect(f"{name}:{c.U}")
    obs = Obs()
    if r.status != 200:
        obs.problems.append(f"first CONNECT (allowed answer) -> {r.status} {r.egress_reason}")
        conn.close()
    else:
        # The ClientHello names the CONNECT host (a tunnel refuses another: sni_mismatch);
        # the test upstream's certificate does not, so only its issuer is checked.
        ctx = ssl.create_default_context(cafile=c.w.pki.ca)
        ctx.check_hostname = False
        s = ctx.wrap_socket(conn.sock, server_hostname=name)
        s.settimeout(10)
        tc = helpers.Conn(s)
        rr = helpers.request(tc, "GET", f"/echo/{c.m}-first", f"{name}:{c.U}")
        if rr.status != 200:
            obs.problems.append(f"first request through the tunnel -> {rr.status}")
        tc.close()
    n_first = len(c.a.dns.queries(name, "A"))
    # Second lookup: the name now points at a private address.
    obs2 = c.connect_obs(f"{name}:{c.U}")
    n_second = len(c.a.dns.queries(name, "A"))
    if (n_first, n_second) != (1, 2):
        obs2.problems.append(f"A queries after each CONNECT: {n_first}, {n_second} (want 1, 2: "
                             f"one lookup per dial, the vetted address is the one connected)")
    obs2.problems += obs.problems
    return obs2


def upstream_only(paths_headers):
    """(b) for cases where part of the scenario is legitimately served."""
    def check(c: Ctx, new):
        want = paths_headers(c)
        for k, p, h in want:
            if any(vals for vals in h.values()):  # the expected values are checked exactly
                c.allowed_secret_paths.add(p)
        return c.expect_upstream(new, want)
    return check


def cases_ssrf() -> list[Case]:
    C = [Case(f"ssrf-{name}", dns_queried(f"{name}.ssrf.test"), 403, f"denied_address:{cls}",
              closed=True) for name, _, cls in SSRF]
    C += [
        Case("ssrf-dns-rebinding", rebinding_attack, 403, "denied_address:private", closed=True,
             prepare=lambda c: c.a.dns.set("rebind.ssrf.test", rebinding("127.0.0.1", "10.0.0.1")),
             upstream=upstream_only(lambda c: [("h1", f"/echo/{c.m}-first",
                                                {"Authorization": []})])),
        Case("ssrf-metadata-name", dns_queried("metadata.google.internal"),
             403, "denied_address:metadata", closed=True),
        Case("ssrf-literal-unspecified", con(lambda c: f"0.0.0.0:{c.U}"),
             403, "denied_address:unspecified", closed=True),
        Case("ssrf-literal-v4-mapped-metadata", con(lambda c: f"[::ffff:169.254.169.254]:{c.U}"),
             403, "denied_address:metadata", closed=True),
        Case("ssrf-literal-nat64-metadata", con(lambda c: f"[64:ff9b::a9fe:a9fe]:{c.U}"),
             403, "denied_address:metadata", closed=True),
        Case("ssrf-literal-decimal-ipv4", con(lambda c: f"2130706433:{c.U}"),
             400, "bad_request_target", closed=True),
        Case("ssrf-literal-octal-ipv4", con(lambda c: f"0177.0.0.1:{c.U}"),
             400, "bad_request_target", closed=True),
        Case("ssrf-literal-hex-ipv4", con(lambda c: f"0x7f.0.0.1:{c.U}"),
             400, "bad_request_target", closed=True),
        Case("ssrf-literal-hex-ipv4-whole", con(lambda c: f"0x7f000001:{c.U}"),
             400, "bad_request_target", closed=True),
        Case("ssrf-literal-short-ipv4", con(lambda c: f"127.1:{c.U}"),
             400, "bad_request_target", closed=True),
        Case("ssrf-literal-leading-zeros", con(lambda c: f"127.000.000.001:{c.U}"),
             400, "bad_request_target", closed=True),
        Case("ssrf-self-proxy-listener", con(lambda c: f"self.test:{c.e.proxy_port}"),
             403, "self_connection", closed=True),
        Case("ssrf-self-admin-listener", con(lambda c: f"self.test:{c.e.admin_port}"),
             403, "self_connection", closed=True),
        Case("ssrf-self-via-dns", dns_queried_port("self.ssrf.test", "proxy"),
             403, "self_connection", closed=True),
        Case("ssrf-self-via-v4-mapped-literal",
             con(lambda c: f"[::ffff:127.0.0.1]:{c.e.proxy_port}"), 403, "self_connection",
             closed=True),
        Case("ssrf-pinned-host-resolves-private",
             tun(lambda c: req(c, host=f"pinned.ssrf.test:{c.U}"), host="pinned.ssrf.test"),
             403, "denied_address:private"),
    ]
    return C


def dns_queried_port(name, which):
    def attack(c: Ctx):
        port = c.e.proxy_port if which == "proxy" else c.e.admin_port
        obs = c.connect_obs(f"{name}:{port}")
        if not c.a.dns.queries(name):
            obs.problems.append(f"egressd never asked the DNS server for {name}")
        return obs
    return attack


# ---------------------------------------------------------------------------------------------
# credentials


def redirect_then(target_host: str):
    def attack(c: Ctx):
        follow = f"https://{target_host}:{c.U}/echo/{c.m}-follow"
        t = c.tls("api.test", c.U)
        obs = Obs()
        try:
            r = helpers.request(t, "GET", f"/redirect?to={follow}", f"api.test:{c.U}")
        finally:
            t.close()
        if r.status != 302 or r.header("Location") != follow:
            obs.problems.append(f"redirect not passed through: {r.status} "
                                f"{r.header('Location')!r}")
        # the client follows the redirect: a new CONNECT to the other host
        conn, cr = c.connect(f"{target_host}:{c.U}")
        if cr.status != 200:
            conn.close()
            o = Obs(status=cr.status, reason=cr.egress_reason, headers=cr.headers)
            o.problems = obs.problems
            return o
        ctx = ssl.create_default_context(cafile=c.w.pki.ca)  # blind tunnel: the real cert
        s = ctx.wrap_socket(conn.sock, server_hostname=target_host)
        s.settimeout(10)
        tc = helpers.Conn(s)
        rr = helpers.request(tc, "GET", f"/echo/{c.m}-follow", f"{target_host}:{c.U}")
        tc.close()
        o = Obs(status=rr.status, reason=rr.egress_reason, headers=rr.headers)
        o.problems = obs.problems
        return o
    return attack


def bearer(c: Ctx, name="api_token"):
    return [f"Bearer {c.w.secrets[name]}"]


def secret_crlf_rotate_prepare(c: Ctx):
    from cp_helpers import api, bearer_pin, create_run, put_secret
    name = "adv_crlf_" + os.urandom(3).hex()
    v1 = "sk-adv-crlf-" + pysecrets.token_hex(12)
    put_secret(c.e, name, v1, org="advorg")
    c.a.extra_secrets[name] = v1
    run = create_run(c.e, c.w, {"org": "advorg"}, [bearer_pin(f"api.test:{c.U}", name)])
    c.a.extra_secrets[f"proxy_token_{run.id}"] = run.token
    c.state.update(name=name, v1=v1, run=run, api=api)


def secret_crlf_rotate_attack(c: Ctx) -> Obs:
    api, name, run = c.state["api"], c.state["name"], c.state["run"]
    obs = Obs()
    evil = c.state["v1"] + "\r\nX-Injected: 1"
    r = api(c.e, "PUT", f"/v1/secrets/{name}", {"scope": {"org": "advorg"}, "value": evil})
    if r.status != 400 or (r.json or {}).get("error") != "invalid_request" or \
            "value" not in (r.json or {}).get("detail", ""):
        obs.problems.append(f"rotate to a CR/LF value -> {r.status} {r.body[:200]!r}")
    for bad in ("a\nb", "a\rb", "a\x00b"):
        r = api(c.e, "POST", "/v1/secrets", {"name": name + "_x", "scope": {"org": "advorg"},
                                             "value": bad})
        if r.status != 400:
            obs.problems.append(f"POST a secret with {bad!r} -> {r.status}")
    lst = api(c.e, "GET", "/v1/secrets")
    if (name + "_x").encode() in lst.body:
        obs.problems.append("a refused secret is listed")
    c.state["auth:dyn"] = run.auth
    t = helpers.tunnel(c.e.proxy_port, "api.test", c.U, run.auth, run.ca_file)
    try:
        rr = helpers.request(t, "GET", f"/echo/{c.m}", f"api.test:{c.U}")
    finally:
        t.close()
    return Obs(status=rr.status, reason=rr.egress_reason, headers=rr.headers,
               problems=obs.problems)


def cases_credentials() -> list[Case]:
    served = dict(decision="allow", audit_reason="injected", audit_status=200)
    return [
        Case("client-authorization-replaced",
             tun(lambda c: req(c, extra="Authorization: Bearer attacker-chosen\r\n")),
             200, None, **served,
             upstream=upstream_only(lambda c: [("h1", f"/echo/{c.m}",
                                                {"Authorization": bearer(c)})])),
        Case("client-authorization-duplicated-mixed-case",
             tun(lambda c: req(c, extra="authorization: Basic YTpi\r\n"
                                        "AUTHORIZATION: Bearer attacker\r\n")),
             200, None, **served,
             upstream=upstream_only(lambda c: [("h1", f"/echo/{c.m}",
                                                {"Authorization": bearer(c)})])),
        Case("client-api-key-header-replaced",
             tun(lambda c: req(c, host=f"hdr.test:{c.U}",
                               extra="X-Api-Key: attacker\r\nx-api-key: attacker2\r\n"),
                 host="hdr.test"),
             200, None, **served,
             upstream=upstream_only(lambda c: [("h1", f"/echo/{c.m}", {
                 "X-Api-Key": [f"Key {c.w.secrets['hdr_key']}"]})])),
        Case("h2-client-authorization-replaced",
             h2case(lambda c: c.h2_base(f"/echo/{c.m}") +
                    [("authorization", "Bearer attacker"), ("authorization", "Basic YTpi")]),
             200, None, **served,
             upstream=upstream_only(lambda c: [("h2", f"/echo/{c.m}",
                                                {"Authorization": bearer(c)})])),
        Case("proxy-authorization-never-forwarded",
             tun(lambda c: req(c, extra=pa(c) + "Proxy-Connection: keep-alive\r\n")),
             200, None, **served,
             upstream=upstream_only(lambda c: [("h1", f"/echo/{c.m}", {
                 "Authorization": bearer(c), "Proxy-Authorization": [],
                 "Proxy-Connection": []})])),
        Case("redirect-to-unlisted-host", redirect_then("other.test"),
             403, "host_not_allowed",
             upstream=upstream_only(lambda c: [
                 ("h1", f"/redirect?to=https://other.test:{c.U}/echo/{c.m}-follow",
                  {"Authorization": bearer(c)})])),
        Case("redirect-to-allowed-unpinned-host", redirect_then("tunnel.test"),
             200, None, decision="allow", audit_reason="tunnel", audit_status=200,
             upstream=upstream_only(lambda c: [
                 ("h1", f"/redirect?to=https://tunnel.test:{c.U}/echo/{c.m}-follow",
                  {"Authorization": bearer(c)}),
                 ("h1", f"/echo/{c.m}-follow", {"Authorization": []})])),
        Case("obs-fold-unfolded-never-a-header",
             tun(lambda c: req(c, extra="X-Fold: a\r\n X-Injected: 1\r\n")),
             200, None, **served,
             upstream=upstream_only(lambda c: [("h1", f"/echo/{c.m}", {
                 "Authorization": bearer(c), "X-Fold": ["a X-Injected: 1"]})])),
        Case("proxy-authorization-never-forwarded-cleartext",
             plain(lambda c: req(c, path=f"http://tunnel.test:{c.P}/echo/{c.m}",
                                 host=f"tunnel.test:{c.P}",
                                 extra=pa(c) + "Proxy-Connection: keep-alive\r\n")),
             200, None, decision="allow", audit_reason="allowed", audit_status=200,
             upstream=upstream_only(lambda c: [("plain", f"/echo/{c.m}", {
                 "Authorization": [], "Proxy-Authorization": [], "Proxy-Connection": []})])),
        Case("pinned-host-over-cleartext",
             plain(lambda c: req(c, path=f"http://plain.test:{c.P}/echo/{c.m}",
                                 host=f"plain.test:{c.P}", extra=pa(c))),
             200, None, decision="allow", audit_reason="cleartext_no_credential",
             audit_status=200,
             upstream=upstream_only(lambda c: [("plain", f"/echo/{c.m}",
                                                {"Authorization": []})])),
        Case("secret-with-crlf-refused-at-store", secret_crlf_rotate_attack,
             200, None, **served, prepare=secret_crlf_rotate_prepare,
             upstream=upstream_only(lambda c: [("h1", f"/echo/{c.m}", {
                 "Authorization": [f"Bearer {c.state['v1']}"]})])),
    ]


# ---------------------------------------------------------------------------------------------
# identity


def other_runs_ca_attack(c: Ctx) -> Obs:
    obs = Obs()
    # positive control: the leaf minted for r1 verifies under r1's CA
    t = c.tls("api.test", c.U, "r1")
    t.close()
    conn, r = c.connect(f"api.test:{c.U}", "r1")
    if r.status != 200:
        return Obs(status=r.status, reason=r.egress_reason)
    ctx = ssl.create_default_context(cafile=c.ca("r2"))  # run B's CA
    try:
        s = ctx.wrap_socket(conn.sock, server_hostname="api.test")
        s.settimeout(5)
        s.sendall(f"GET /echo/{c.m} HTTP/1.1\r\nHost: api.test:{c.U}\r\n\r\n".encode())
        obs.notes["handshake"] = "completed"
        s.close()
    except ssl.SSLCertVerificationError as ex:
        obs.tls_failed = True
        obs.notes["verify"] = ex.verify_message
    except (ssl.SSLError, OSError) as ex:
        obs.notes["other_error"] = repr(ex)
    finally:
        conn.close()
    return obs


def identity_switch_attack(c: Ctx) -> Obs:
    s = socket.create_connection(("127.0.0.1", c.e.proxy_port), timeout=10)
    conn = helpers.Conn(s)
    obs = Obs()
    try:
        conn.send(req(c, path=f"http://tunnel.test:{c.P}/echo/{c.m}-r2",
                      host=f"tunnel.test:{c.P}", extra=pa(c, "r2")).encode())
        r = helpers.read_response(conn)
        if r.status != 200:
            obs.problems.append(f"first request (run r2) -> {r.status} {r.egress_reason}")
        o = exchange(conn, req(c, path=f"http://plain.test:{c.P}/echo/{c.m}-r1",
                               host=f"plain.test:{c.P}", extra=pa(c, "r1")).encode(), True)
        o.problems += obs.problems
        return o
    finally:
        conn.close()


def revoked_prepare(c: Ctx):
    from cp_helpers import api, bearer_pin, create_run, put_secret
    name = "adv_rev_" + os.urandom(3).hex()
    v = "sk-adv-rev-" + pysecrets.token_hex(12)
    put_secret(c.e, name, v, org="advorg")
    c.a.extra_secrets[name] = v
    run = create_run(c.e, c.w, {"org": "advorg"}, [bearer_pin(f"api.test:{c.U}", name)])
    c.a.extra_secrets[f"proxy_token_{run.id}"] = run.token
    r = api(c.e, "DELETE", f"/v1/runs/{run.id}")
    assert r.status in (200, 204), r.status
    c.state["auth:revoked"] = run.auth


def cases_identity() -> list[Case]:
    return [
        Case("forged-egress-header", tun(lambda c: req(c, extra="X-Egress-Run: r2\r\n")),
             403, "forged_egress_header"),
        # Beast passes raw bytes from 0x80 up in a target: the audit line must stay valid JSON
        # for a strict reader (audit_since's json.loads of bytes decodes strict UTF-8).
        Case("forged-egress-header-raw-bytes-in-target",
             tun(lambda c: req(c, path=f"/echo/{c.m}/\xff\xc3(", extra="X-Egress-Run: r2\r\n")),
             403, "forged_egress_header"),
        Case("forged-egress-header-mixed-case",
             tun(lambda c: req(c, extra="x-EgReSs-Pin: any\r\n")), 403, "forged_egress_header"),
        Case("forged-egress-header-cleartext",
             plain(lambda c: req(c, path=f"http://plain.test:{c.P}/echo/{c.m}",
                                 host=f"plain.test:{c.P}",
                                 extra=pa(c) + "X-Egress-Secret: api_token\r\n")),
             403, "forged_egress_header"),
        Case("h2-forged-egress-header",
             h2case(lambda c: c.h2_base(f"/echo/{c.m}") + [("x-egress-run", "r2")]),
             403, "forged_egress_header"),
        Case("another-runs-token", con(lambda c: f"api.test:{c.U}",
                                       auth=lambda c: helpers.basic_auth("r1", c.w.tokens["r2"])),
             407, "bad_identity", closed=True),
        Case("unknown-run-with-valid-token",
             con(lambda c: f"api.test:{c.U}",
                 auth=lambda c: helpers.basic_auth("ghost", c.w.tokens["r1"])),
             407, "bad_identity", closed=True),
        Case("proxy-auth-bearer-scheme",
             con(lambda c: f"api.test:{c.U}", auth=lambda c: "Bearer " + c.w.tokens["r1"]),
             407, "bad_identity", closed=True),
        Case("no-identity", con(lambda c: f"api.test:{c.U}", run=None),
             407, "no_identity", closed=True),
        Case("revoked-runs-token", con(lambda c: f"api.test:{c.U}",
                                       auth=lambda c: c.state["auth:revoked"]),
             403, "run_revoked", closed=True, prepare=revoked_prepare),
        Case("identity-switch-on-keep-alive", identity_switch_attack, 403, "identity_changed",
             closed=True,
             upstream=upstream_only(lambda c: [("plain", f"/echo/{c.m}-r2",
                                                {"Authorization": []})])),
        Case("another-runs-ca", other_runs_ca_attack, None, "client_tls_failed",
             tls_failed=True, audit_status=0),
    ]


# ---------------------------------------------------------------------------------------------
# exhaustion


def slowloris(kind: str):
    """Sends a request head (or body) one byte every 0.25 s; the connection must be cut at
    header_timeout (1 s) with a 408, not when the attacker stops."""
    def attack(c: Ctx) -> Obs:
        obs = Obs()
        if kind == "proxy-head":
            s = socket.create_connection(("127.0.0.1", c.e.proxy_port), timeout=10)
            conn = helpers.Conn(s)
            first = f"CONNECT api.test:{c.U} HTTP/1.1\r\n".encode()
            drip = f"Host: api.test:{c.U}\r\nX-Slow: ".encode() + b"a" * 60
        else:
            conn = c.tls("api.test", c.U)
            if kind == "keepalive-head":
                r = helpers.request(conn, "GET", f"/echo/{c.m}-first", f"api.test:{c.U}")
                if r.status != 200:
                    obs.problems.append(f"first request -> {r.status}")
            if kind == "body":
                first = (f"POST /echo/{c.m} HTTP/1.1\r\nHost: api.test:{c.U}\r\n"
                         f"Content-Length: 100\r\n\r\n").encode() + b"x" * 10
                drip = b""   # a stalled body: nothing more ever comes
            else:
                first = f"GET /echo/{c.m} HTTP/1.1\r\n".encode()
                drip = f"Host: api.test:{c.U}\r\nX-Slow: ".encode() + b"a" * 60
        t0 = time.monotonic()
        data = b""
        closed = False
        try:
            conn.send(first)
            conn.sock.settimeout(0.25)
            for i in range(60):  # at most 15 s of dripping
                try:
                    b = conn.sock.recv(65536)
                    if not b:
                        closed = True
                        break
                    data += b
                    if b"\r\n\r\n" in data and kind != "keepalive-head":
                        # a response: read to the close
                        cl, extra = recv_closed(conn.sock, 3)
                        data += extra
                        closed = cl
                        break
                except (socket.timeout, TimeoutError):
                    pass
                except (ssl.SSLError, OSError):
                    closed = True
                    break
                if i < len(drip):
                    try:
                        conn.send(drip[i:i + 1])
                    except OSError:
                        closed = True
                        break
        finally:
            took = time.monotonic() - t0
            conn.close()
        obs.closed = closed
        obs.notes["closed_after_s"] = round(took, 2)
        limit = 1.0 if kind != "body" else 3.0  # header_timeout; idle_timeout for a stall
        if not closed or took > limit + 1.5:
            obs.problems.append(f"connection open {took:.1f}s (limit {limit}s)")
        if kind == "keepalive-head" and data.startswith(b"HTTP/1.1 200"):
            data = b""  # the first response was consumed by helpers.request already
        if data:
            try:
                r = helpers.read_response(helpers.Conn(_Buf(data)))
                obs.status, obs.reason, obs.headers = r.status, r.egress_reason, r.headers
            except (ValueError, ConnectionError) as ex:
                obs.notes["unparsed"] = data[:120]
                obs.notes["err"] = repr(ex)
        return obs
    return attack


class _Buf:
    """A socket-like object over bytes already received."""

    def __init__(self, data: bytes):
        self.data = data

    def recv(self, n):
        out, self.data = self.data[:n], self.data[n:]
        return out

    def sendall(self, b):
        pass


def hold_connections(c: Ctx) -> Obs:
    held = []
    obs = Obs()
    try:
        for i in range(8):  # limits.connections_per_run
            conn, r = c.connect(f"tunnel.test:{c.U}", "r2")
            if r.status != 200:
                obs.problems.append(f"held connection {i} -> {r.status} {r.egress_reason}")
            held.append(conn)
        o = c.connect_obs(f"tunnel.test:{c.U}", "r2")
        # another run is not affected: r1 still gets in
        conn, r = c.connect(f"api.test:{c.U}", "r1")
        conn.close()
        if r.status != 200:
            o.problems.append(f"run r1 refused while r2 is at its limit: {r.status}")
        o.problems += obs.problems
        return o
    finally:
        for h in held:
            h.close()


def mint_storm_names(c: Ctx) -> Obs:
    last = None
    problems = []
    for i in range(40):
        o = c.connect_obs(f"n{i}-{c.m[-6:]}.storm.test:{c.U}")
        if (o.status, o.reason) != (403, "host_not_allowed"):
            problems.append(f"name {i}: {o.status} {o.reason}")
        last = o
    last.problems += problems[:3]
    return last


def warm_r1_api_leaf(c: Ctx):
    c.tls("api.test", c.U).close()


def mint_storm_sni(c: Ctx) -> Obs:
    last = None
    problems = []
    for i in range(20):
        o = c.in_tunnel("api.test", c.U, req(c), sni=f"s{i}-{c.m[-6:]}.storm.test",
                        check_hostname=False)
        if (o.status, o.reason) != (421, "sni_mismatch"):
            problems.append(f"sni {i}: {o.status} {o.reason}")
        last = o
    last.problems += problems[:3]
    return last


def tls_old_version(c: Ctx) -> Obs:
    conn, r = c.connect(f"api.test:{c.U}")
    assert r.status == 200, r.status
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version = ssl.TLSVersion.TLSv1
        ctx.maximum_version = ssl.TLSVersion.TLSv1_1
    obs = Obs()
    try:
        s = ctx.wrap_socket(conn.sock, server_hostname="api.test")
        obs.notes["negotiated"] = s.version()
        s.sendall(req(c).encode())
        s.close()
    except (ssl.SSLError, OSError) as ex:
        obs.tls_failed = True
        obs.notes["error"] = repr(ex)[:160]
    finally:
        conn.close()
    return obs


def tls_renegotiation(c: Ctx) -> Obs:
    """openssl s_client -tls1_2 through CONNECT; 'R' asks for a client-initiated
    renegotiation, then a request follows: the renegotiation must be refused and the request
    must never be served on that connection."""
    p = openssl_s_client(c.e.proxy_port, f"api.test:{c.U}", "r1", c.w.tokens["r1"],
                         ["-tls1_2", "-servername", "api.test", "-CAfile", c.ca("r1")])
    # s_client takes "R" as a command only when it reads that line alone, after its handshake:
    # wait for what it prints at each stage (bounded) instead of sleeping, so a slow start on a
    # loaded machine does not hand it "R" and the request in one read.
    chunks: list[bytes] = []

    def pump() -> None:
        for chunk in iter(lambda: p.stdout.read1(4096), b""):
            chunks.append(chunk)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()

    def wait_for(marker: bytes, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while marker not in b"".join(chunks) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)

    try:
        wait_for(b"Verify return code", 15.0)  # the first handshake is done
        for step, marker in ((b"R\n", b"RENEGOTIATING"), (req(c).encode(), b"")):
            try:
                p.stdin.write(step)
                p.stdin.flush()
            except (BrokenPipeError, OSError):
                break
            wait_for(marker or b"\0never", 1.0)
    finally:
        try:
            p.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
        reader.join(timeout=10)
        out = b"".join(chunks) + p.stderr.read()
    text = out.decode(errors="replace")
    obs = Obs()
    obs.notes["tail"] = text[-240:]
    if "CONNECTED" not in text or "Verify return code: 0" not in text:
        obs.problems.append("s_client did not complete the first handshake through the proxy")
    started = "RENEGOTIATING" in text
    refused = re.search(r"no renegotiation|renegotiation.*(refused|failed)", text, re.I)
    served = "HTTP/1.1 200" in text
    obs.tls_failed = bool(started and refused and not served)
    return obs


def cases_exhaustion() -> list[Case]:
    return [
        Case("slowloris-head-proxy-port", slowloris("proxy-head"), 408, "header_timeout",
             closed=True),
        Case("slowloris-head-in-tunnel", slowloris("tunnel-head"), 408, "header_timeout",
             closed=True),
        Case("slowloris-head-second-request-keep-alive", slowloris("keepalive-head"),
             408, "header_timeout", closed=True,
             upstream=upstream_only(lambda c: [("h1", f"/echo/{c.m}-first",
                                                {"Authorization": bearer(c)})])),
        Case("slowloris-body-stall", slowloris("body"), 408, "body_timeout", closed=True),
        Case("huge-header-block-proxy-port",
             con(lambda c: f"api.test:{c.U}", extra="X-Big: " + "a" * 70000 + "\r\n"),
             431, "header_too_large", closed=True),
        Case("huge-header-block-in-tunnel",
             tun(lambda c: req(c, extra="X-Big: " + "a" * 70000 + "\r\n")),
             431, "header_too_large", closed=True),
        Case("h2-huge-header-block",
             h2case(lambda c: c.h2_base(f"/echo/{c.m}") +
                    [(f"x-big-{i}", "b" * 4000) for i in range(20)]),
             431, "header_too_large"),  # answered on the stream, as on HTTP/1.1
        Case("connections-per-run-exhausted", hold_connections, 429, "too_many_connections",
             closed=True, retry_after=True),
        Case("mint-storm-refused-names", mint_storm_names, 403, "host_not_allowed",
             count=40, minted=0, closed=True),
        Case("mint-storm-distinct-sni", mint_storm_sni, 421, "sni_mismatch", count=20,
             minted=0, prepare=warm_r1_api_leaf),
        Case("tls-below-1-2", tls_old_version, None, "client_tls_failed", tls_failed=True,
             audit_status=0),
        # the refused renegotiation ends the connection: egressd answers 400 and audits it
        Case("tls-renegotiation-refused", tls_renegotiation, None, None,
             audit_reason="bad_request", tls_failed=True, audit_status=400),
    ]


CASES = (cases_host_binding() + cases_smuggling() + cases_ssrf() + cases_credentials() +
         cases_identity() + cases_exhaustion())
assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_attack(arena, case):
    run_case(arena, case)


# ---------------------------------------------------------------------------------------------
# a per-run leaf-mint rate (limits.leaf_mints_per_minute): its own egressd


def mint_rate_attack(c: Ctx) -> Obs:
    problems = []
    for i in range(5):
        conn, r = c.connect(f"m{i}-{c.m[-6:]}.wild.test:{c.U}")
        conn.close()
        if r.status != 200:
            problems.append(f"mint {i} within the rate -> {r.status} {r.egress_reason}")
    o = c.connect_obs(f"m5-{c.m[-6:]}.wild.test:{c.U}")
    # 5 mints a minute: the bucket gains one every 12 s, and it was spent moments ago
    # (Retry-After was 1 whatever the rate)
    ra = o.header("Retry-After")
    if ra is None or not ra.isdigit() or not 6 <= int(ra) <= 12:
        problems.append(f"Retry-After {ra!r}, not the 12 s (less what has refilled) that "
                        f"5 mints a minute take to refill one")
    # a cached leaf is no mint: still served while the run is over its rate
    conn, r = c.connect(f"m0-{c.m[-6:]}.wild.test:{c.U}")
    conn.close()
    if r.status != 200:
        problems.append(f"cached leaf refused while over the mint rate: {r.status} "
                        f"{r.egress_reason}")
    o.problems += problems
    return o


def test_attack_leaf_mint_rate(factory, world, h2up, dns, good_secret):
    a = start_arena(factory, world, h2up, dns, good_secret,
                    limits={"leaf_mints_per_minute": 5})
    try:
        run_case(a, Case("leaf-mint-rate-exceeded", mint_rate_attack, 429,
                         "mint_rate_exceeded", retry_after=True, closed=True, minted=5))
    finally:
        a.good.stop()
        leak_check(a)


# ---------------------------------------------------------------------------------------------
# bad host patterns are refused at load (egressd --check): nothing runs, so the runtime
# assertions do not apply; the message must name the key


@pytest.mark.parametrize("pattern", ["*", "*.test", "a.*.test", "*a.test", "**.a.test",
                                     "*.*.a.test", "a.test:0", "user@a.test", "a..test",
                                     "*.1.2.3.4"])
def test_bad_pattern_rejected_at_load(factory, world, pattern):
    def mutate(cfg):
        cfg["policy"]["allow_hosts"] = [pattern]
    e = factory.make(mutate)
    r = e.check()
    out = r.stdout + r.stderr
    assert r.returncode != 0, f"egressd --check accepted allow_hosts [{pattern!r}]"
    assert "policy.allow_hosts" in out, out[-500:]

    def mutate_pin(cfg):
        cfg["runs"][0]["pins"][0]["host"] = pattern
    r = factory.make(mutate_pin).check()
    assert r.returncode != 0, f"egressd --check accepted a pin host {pattern!r}"
    assert "runs[0].pins[0].host" in r.stdout + r.stderr, (r.stdout + r.stderr)[-500:]
