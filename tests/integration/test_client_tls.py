"""The client leg's TLS as a run sees it: sessions resume only under the leaf that made them
(never across runs, nor across hosts), a run CA's name constraints are never outgrown by a
reload (egressd refuses the CONNECT instead of handing out a leaf every client must reject),
and an upstream that fails verification on a credentialed host is recorded with the pin and
the address that answered."""
from __future__ import annotations

import ssl

import pytest

import helpers
from clients import run_ca
from cp_helpers import api_ok, bearer_pin, cp_mutate, create_run, put_secret


@pytest.fixture(scope="module")
def e(factory):
    # Both runs intercept tunnel.test (allowed, unpinned): one host two runs' leaves serve.
    return factory.start(unpinned="intercept")


def _handshake(e, world, run: str, host: str, ctx: ssl.SSLContext,
               session: ssl.SSLSession | None = None) -> tuple[bool, ssl.SSLSession | None]:
    """CONNECT host as `run`, TLS with `session` offered, one request (a TLS 1.3 server sends
    its tickets after the handshake); returns (resumed, the session to offer next)."""
    c, r = helpers.proxy_connect(e.proxy_port, f"{host}:{world.U}", world.auth(run))
    assert r.status == 200, (r.status, r.egress_reason)
    s = ctx.wrap_socket(c.sock, server_hostname=host, session=session)
    s.settimeout(10)
    try:
        conn = helpers.Conn(s)
        resp = helpers.request(conn, "GET", "/echo/tls-session", f"{host}:{world.U}")
        assert resp.status == 200, resp.status
        return s.session_reused, s.session
    finally:
        s.close()


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_a_session_resumes_only_under_the_leaf_that_made_it(world, e, version):
    """egressd has one server context for every run: its session cache and ticket keys are
    shared. A session made under run r1's leaf offered on run r2's connection (a client
    trusting both CAs) must get a full handshake with r2's own leaf, not resume with no
    certificate shown; nor does a session of one host resume for another."""
    ctx = ssl.create_default_context(cafile=run_ca(e, "r1"))
    ctx.load_verify_locations(cafile=run_ca(e, "r2"))
    ctx.minimum_version = version
    ctx.maximum_version = version
    ctx.set_alpn_protocols(["http/1.1"])
    resumed, first = _handshake(e, world, "r1", "tunnel.test", ctx)
    assert not resumed and first is not None
    # The control: the same run and host resume (the test can see a resumption).
    resumed, again = _handshake(e, world, "r1", "tunnel.test", ctx, first)
    assert resumed, "a session of the same leaf did not resume: the test shows nothing"
    resumed, _ = _handshake(e, world, "r2", "tunnel.test", ctx, again)
    assert not resumed, "run r1's TLS session resumed on run r2's connection"
    resumed, _ = _handshake(e, world, "r1", "api.test", ctx, again)
    assert not resumed, "a session of tunnel.test resumed for api.test"


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_a_resumed_session_with_another_sni_is_refused(world, e, version):
    """The SNI check holds on a resumed handshake: a TLS 1.2 session of tunnel.test offered
    again on a CONNECT to tunnel.test with SNI other.test resumes (same CA and host), and
    OpenSSL then reports no server name (a TLS 1.2 name belongs to the session): the request
    was served. egressd reads each ClientHello's own name: 421 sni_mismatch, audited."""
    ctx = ssl.create_default_context(cafile=run_ca(e, "r1"))
    ctx.check_hostname = False  # the SNI names another host than the certificate
    ctx.minimum_version = version
    ctx.maximum_version = version
    ctx.set_alpn_protocols(["http/1.1"])
    resumed, first = _handshake(e, world, "r1", "tunnel.test", ctx)
    assert not resumed and first is not None
    c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.U}", world.auth("r1"))
    assert r.status == 200, (r.status, r.egress_reason)
    s = ctx.wrap_socket(c.sock, server_hostname="other.test", session=first)
    s.settimeout(10)
    marker = f"sni-resume-{version.name}"
    try:
        if version == ssl.TLSVersion.TLSv1_2:
            assert s.session_reused, "the session did not resume: the test shows nothing"
        resp = helpers.request(helpers.Conn(s), "GET", f"/echo/{marker}", f"tunnel.test:{world.U}")
    finally:
        s.close()
    assert (resp.status, resp.egress_reason) == (421, "sni_mismatch"), resp.status
    rec = e.wait_audit(lambda a: a.get("reason") == "sni_mismatch" and
                       marker in (a.get("path") or ""))[-1]
    assert rec["status"] == 421 and rec["decision"] == "deny", rec


def test_a_host_outside_the_run_cas_constraints_is_refused_not_intercepted(world, factory):
    """An API run's CA is name-constrained to the hosts known at its creation (its pins and
    allow list; the global allow list only when unpinned hosts are intercepted). A reload to
    `unpinned: intercept` routes tunnel.test to interception for that run, and no leaf its CA
    could sign would verify: egressd answers 403 outside_run_ca (audited) before the 200."""
    e = factory.start(mutate=cp_mutate(world, ports=[world.U]))
    put_secret(e, "nc_tok", "nc-itest-value", org="acme")
    run = create_run(e, world, {"org": "acme"}, [bearer_pin(f"api.test:{world.U}", "nc_tok")])
    # Under unpinned: tunnel the host is relayed blindly (no leaf needed).
    c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.U}", run.auth)
    c.sock.close()
    assert r.status == 200, (r.status, r.egress_reason)

    e.rewrite_config(lambda c: c["policy"].update({"unpinned": "intercept"}))
    e.reload()
    c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.U}", run.auth)
    c.sock.close()
    assert (r.status, r.egress_reason) == (403, "outside_run_ca"), (r.status, r.body)
    rec = e.wait_audit(lambda a: a.get("host") == "tunnel.test" and
                       a.get("reason") == "outside_run_ca")[-1]
    assert rec["status"] == 403 and rec["run"] == run.id, rec
    # Its pinned host is still intercepted and served.
    c = run.tunnel("api.test", world.U)
    try:
        resp = helpers.request(c, "GET", "/echo/nc", f"api.test:{world.U}")
        assert resp.status == 200, resp.status
    finally:
        c.close()
    api_ok(e, "DELETE", f"/v1/runs/{run.id}")


def test_an_upstream_failing_verification_is_recorded_with_its_pin_and_address(world, e):
    """The record of a credentialed request whose upstream failed verification (the record
    that would show an interception attempt) names the pin, its secret, and the address
    that answered, as an answered request's record does."""
    c = helpers.tunnel(e.proxy_port, "bad.test", world.bad.port, world.auth(), run_ca(e, "r1"))
    try:
        resp = helpers.request(c, "GET", "/echo/verify-fails", f"bad.test:{world.bad.port}")
    finally:
        c.close()
    assert (resp.status, resp.egress_reason) == (502, "upstream_tls_failed")
    rec = e.wait_audit(lambda a: a.get("host") == "bad.test" and
                       a.get("path") == "/echo/verify-fails")[-1]
    assert rec["reason"] == "upstream_tls_failed" and rec["status"] == 502, rec
    assert rec["pin"] is not None and rec["secret"] is not None, rec
    assert rec["upstream_addr"] == f"127.0.0.1:{world.bad.port}", rec
